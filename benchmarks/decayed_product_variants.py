"""The per-key gates' diagonal sub-block product (lower_tilelang's `decayed_product`) as generated
and as a variant, each timed through the whole forward on qla-bench's inputs and checked against
the float64 reference (an experiment, session 24).

    python benchmarks/decayed_product_variants.py --compile   # CPU: both variants into the cache
    python benchmarks/decayed_product_variants.py             # GPU: the table

Why: at 16/16:8x4096 the product is ~0.85 ms of GLA's 1.44 (H200, session 24), where its
instructions were predicted to take 0.15-0.3. The generated form loops over the wgmma
accumulator's 32 elements a thread; a warp runs the k loop of each of the 8 elements in its own
diagonal block, ~22 instructions an element and k (4 loads with their rotated addresses,
conversions, the exponential, two multiplies): ~90 k warp instructions a CTA, ~0.7 ms over 8192
CTAs. The variant:
  rows  each thread takes one row i and B / (threads / C) columns of its diagonal block: per k it
        loads X_ik and γ_ik once for all its columns, then per column Z_jk, γ_jk, one exp2, one
        FMA (k rotated by the row, so that a warp's 16 rows read 16 banks); the sums go to a
        C×B float32 block in shared memory, from which the product's fragment is set. Predicted
        ~2.9× fewer instructions: the product ~0.3 ms, GLA 1.44 -> ~0.9 ms, KDA 3.3 -> ~2.2.
Each variant runs in a process of its own (the op caches its kernels by program).
"""
import argparse
import subprocess
import sys

ROWS = ["16/16:8x4096", "16/16:1x32768"]


def rows_template(render, s):
    """The variant's lines for a decayed_product statement (see the module's docstring)."""
    a = s.attr
    x, z, g = s.srcs
    width = render._buf_shape(x).split(", ")[1]
    exp = {"exp": "T.exp", "exp2": "T.exp2"}[a["exp"]]
    B, threads = a["block"], render.k.threads
    per_row = threads // 64  # threads a row (C = 64)
    cols = B // per_row
    d = f"{s.dst}_rows"
    return [
        f"{d} = T.alloc_shared((C, {B}), \"float32\")",
        f"{d}_acc = T.alloc_local(({cols},), \"float32\")",
        f"{d}_xg = T.alloc_local((2,), \"float32\")",
        "i_t = T.get_thread_binding()",
        f"for jj in T.serial({cols}):",
        f"    {d}_acc[jj] = 0.0",
        f"for i_k in T.serial({width}):",
        f"    {d}_xg[0] = T.cast({x}[i_t // {per_row}, (i_k + 2 * (i_t // {per_row} % 32)) % {width}], \"float32\")",
        f"    {d}_xg[1] = {g}[i_t // {per_row}, (i_k + 2 * (i_t // {per_row} % 32)) % {width}]",
        f"    for jj in T.unroll({cols}):",
        f"        {d}_acc[jj] += {d}_xg[0] * T.cast({z}[i_t // {per_row} // {B} * {B} + i_t % {per_row} * {cols} + jj, "
        f"(i_k + 2 * (i_t // {per_row} % 32)) % {width}], \"float32\") * {exp}({d}_xg[1] - "
        f"{g}[i_t // {per_row} // {B} * {B} + i_t % {per_row} * {cols} + jj, (i_k + 2 * (i_t // {per_row} % 32)) % {width}])",
        f"for jj in T.serial({cols}):",
        f"    {d}[i_t // {per_row}, i_t % {per_row} * {cols} + jj] = T.if_then_else("
        f"i_t % {per_row} * {cols} + jj <= i_t // {per_row} % {B}, {d}_acc[jj], 0.0)",
        "T.sync_threads()",
        "for i, j in T.Parallel(C, C):",
        f"    {s.dst}[i, j] = T.if_then_else(i // {B} == j // {B}, {d}[i, j % {B}], 0.0)",
    ]


def patch(variant: str) -> None:
    if variant == "as generated":
        return
    from qla_compiler.passes import lower_tilelang

    stmt = lower_tilelang._Render.stmt

    def patched(self, s, scan):
        return rows_template(self, s) if s.op == "decayed_product" else stmt(self, s, scan)
    lower_tilelang._Render.stmt = patched


def one(variant: str, compile_only: bool) -> None:
    patch(variant)
    if compile_only:
        from qla_compiler.cli import main
        for spec in ("gla", "kda"):
            main([f"specs/{spec}.py", "--precompile", "H=16,HV=16,K=128,V=128,N=1-8"])
            main([f"specs/{spec}.py", "--precompile", "H=2,HV=2,K=128,V=128,N=2"])
        return
    import torch

    import qla_compiler
    from qla_compiler.bench import device_ms, make_inputs, parse_row
    from qla_compiler.testing import rel_err

    for spec in ("gla", "kda"):
        op = qla_compiler.compile(spec, target="sm90")
        gen = torch.Generator(device="cuda").manual_seed(0)
        T = 700
        args = {"q": torch.randn(1, T, 2, 128, device="cuda", generator=gen).to(torch.bfloat16),
                "k": torch.nn.functional.normalize(torch.randn(1, T, 2, 128, device="cuda", generator=gen), dim=-1)
                .to(torch.bfloat16),
                "v": torch.randn(1, T, 2, 128, device="cuda", generator=gen).to(torch.bfloat16),
                "g": torch.full((1, T, 2, 128), -5.0, device="cuda"),
                "cu_seqlens": torch.tensor([0, 300, T], device="cuda", dtype=torch.int32),
                "initial_state": torch.randn(2, 2, 128, 128, device="cuda", generator=gen), "output_final_state": True}
        if spec == "kda":
            args["beta"] = torch.rand(1, T, 2, device="cuda", generator=gen)
        o, s = op(**args)
        o_ref, s_ref = op.reference(**{k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v)
                                       for k, v in args.items()})
        times = []
        for row in ROWS:
            H, HV, lens = parse_row(row)
            a = make_inputs(H, HV, lens, spec=spec)
            kernels = {}
            total = device_ms(lambda: op(**a), per_kernel=kernels)
            times.append(f"{row} {total:.3f} ms (" + ", ".join(f"{k[:16]} {t:.3f}" for k, t in kernels.items()) + ")")
        print(f"{spec} {variant:14s} o err {rel_err(o, o_ref):.2e}  state err {rel_err(s, s_ref):.2e}  "
              + "  ".join(times), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--variant")
    a = ap.parse_args()
    if a.variant:
        one(a.variant, a.compile)
        return 0
    rc = 0
    for variant in ("as generated", "rows"):
        rc |= subprocess.call([sys.executable, __file__, "--variant", variant] + (["--compile"] if a.compile else []))
    return rc


if __name__ == "__main__":
    sys.exit(main())
