"""The per-key gates' backward products on the diagonal sub-blocks (lower_tilelang's
`decayed_product` with a VJP eq: d P ⋆_rows Z and d P ⋆_cols X, C×K results) as generated and as
variants, each timed through a training step on qla-bench's inputs and checked against the float64
reference (an experiment, session 25).

    python benchmarks/decayed_product_variants.py --compile   # CPU: every variant into the cache
    python benchmarks/decayed_product_variants.py             # GPU: the table

Why: with each element of the result walking its block's 16 rows itself, GLA's backward out kernel
took 13.0 ms and KDA's two 22.1 and 20.6 at 16/16:8x4096 (H200, session 25), FLA's whole training
steps 6.9 and 9.5. ncu (GLA): one CTA an SM (255 registers, 205 KB of shared memory), 2 warps a
scheduler, one instruction every 6.4 cycles, 42 % of the stalls waiting on instruction fetch. The
variants:
  as generated   the block's row m outermost, the thread's 32 elements of the wgmma accumulator's
                 fragment inside: its two rows share their d P loads, its 16 columns their Z and
                 γ_m loads, the 32 sums are independent (measured: the products 7.7 → 2.8 ms in
                 GLA's out kernel, KDA's kernels 22.1 → 10.7 and 20.6 → 10.3; gradients unchanged)
  element inner  each element's loop over m innermost (the form before session 25)
  no vjp         both products left out (zeros; wrong gradients): what everything else costs
Each variant runs in a process of its own (the op caches its kernels by program).
"""
import argparse
import subprocess
import sys

from qla_compiler.passes import lower_tilelang

ROW = "16/16:8x4096"
VARIANTS = ("as generated", "element inner", "no vjp")
GENERATED = lower_tilelang._Render._decayed_product_vjp


def vjp_template(variant: str):
    """The variant's lines, rearranged from the generated ones (zero the result; for each of the
    block's rows m: for each element, add its term): "element inner" moves the loop over m inside
    the elements' loop, "no vjp" keeps the zeroing alone."""
    def lines(render, s, exp):
        out = GENERATED(render, s, exp)
        zero, (over_m, _, add) = out[:2], out[2:]
        if variant == "no vjp":
            return zero
        return zero + ["    " + over_m, add]
    return lines


def patch(variant: str) -> None:
    if variant == "as generated":
        return
    lower_tilelang._Render._decayed_product_vjp = vjp_template(variant)


def one(variant: str, compile_only: bool) -> None:
    patch(variant)
    if compile_only:
        from qla_compiler.cli import main
        for spec in ("gla", "kda"):
            main([f"specs/{spec}.py", "--precompile", "H=16,HV=16,K=128,V=128,N=8", "--training"])
            main([f"specs/{spec}.py", "--precompile", "H=2,HV=2,K=128,V=128,N=2", "--training"])
        return
    import torch

    import qla_compiler
    from qla_compiler.bench import device_ms, make_inputs, parse_row, with_backward
    from qla_compiler.testing import input_grads, rel_err

    for spec in ("gla", "kda"):
        op = qla_compiler.compile(spec, target="sm90")
        gen = torch.Generator(device="cuda").manual_seed(0)
        T = 700
        args = {"q": torch.randn(1, T, 2, 128, device="cuda", generator=gen).to(torch.bfloat16),
                "k": torch.nn.functional.normalize(torch.randn(1, T, 2, 128, device="cuda", generator=gen), dim=-1)
                .to(torch.bfloat16),
                "v": torch.randn(1, T, 2, 128, device="cuda", generator=gen).to(torch.bfloat16),
                "g": -5 * torch.rand(1, T, 2, 128, device="cuda", generator=gen),
                "cu_seqlens": torch.tensor([0, 300, T], device="cuda", dtype=torch.int32),
                "initial_state": torch.randn(2, 2, 128, 128, device="cuda", generator=gen), "output_final_state": True}
        if spec == "kda":
            args["beta"] = torch.rand(1, T, 2, device="cuda", generator=gen)
        o, state = op(**args)
        o_ref, state_ref = op.reference(**{k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v)
                                           for k, v in args.items()})
        grads = input_grads(op, args)
        ref = input_grads(op.reference, {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v)
                                         for k, v in args.items()})
        errs = "  ".join(f"d{n} {rel_err(grads[n], ref[n]):.1e}" for n in grads)
        H, HV, lens = parse_row(ROW)
        a = make_inputs(H, HV, lens, spec=spec)
        kernels = {}
        total = device_ms(lambda: with_backward(op)(**a), per_kernel=kernels)
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[:6]
        print(f"{spec} {variant:13s} o {rel_err(o, o_ref):.1e}  state {rel_err(state, state_ref):.1e}  {errs}  {ROW} {total:.3f} ms ("
              + ", ".join(f"{k.removesuffix('_kernel')} {t:.3f}" for k, t in top) + ")", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--variant")
    a = ap.parse_args()
    if a.variant:
        one(a.variant, a.compile)
        return 0
    rc = 0
    for variant in VARIANTS:
        rc |= subprocess.call([sys.executable, __file__, "--variant", variant] + (["--compile"] if a.compile else []))
    return rc


if __name__ == "__main__":
    sys.exit(main())
