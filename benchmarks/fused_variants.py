"""The fused forward built other ways, timed beside the one generated: GPU time per forward call
(kernels/forward's fused path forced), each kernel's share and o against the generated path's,
one process per variant (a variant changes how the program is derived or launched, which a
process fixes when the spec compiles).

    python benchmarks/fused_variants.py --compile     # CPU: every variant's kernels into the cache
    python benchmarks/fused_variants.py               # GPU: the table

The variants (session 19; the predictions are in benchmarks/NOTES.md):
  narrow at V-block 32   the narrow kernel (three roles) where the wide one would run: the baseline
                         of the next two
  R in the fused kernel  the gates' ratio R_ij = e^{γ_i − γ_j} applied to T_r on the chain, not by
                         the prep (partition._folded_into_prep off: FlashQLA's split). The prep's
                         pass costs 0.08 ms at 16/64:8x4096; with R on the chain the wide kernel
                         needs 227 KB of shared memory, over the budget, so this runs narrow
  four roles at 32, 64   the wide kernel's split (the chain cut into a state and a value role) at a
                         narrower V-block, where the grid would otherwise run the narrow kernel:
                         FlashQLA runs its four roles at V-block 32 on 8/32 heads, ~0.9 µs a chunk
                         against our narrow kernel's ~1.8
  chain's hand-off first  (session 55) the wide kernel's value role hands the state role the
                         decayed new values (V' = diag(decay)·V_new, the chain's next operand)
                         before it hands the output role the undecayed ones, the decay read from
                         a per-row register vector: the generated order puts the output's copy,
                         its fence and arrival on the chain. A source patch of the generated
                         module (an experiment; the schedule would derive the order if it pays)
"""
import argparse
import json
import re
import subprocess
import sys

ROWS = ["16/64:8x4096", "8/32:1x32768", "4/16:8x4096", "4/16:1x32768", "2/8:8x4096"]
VARIANTS = ["as generated", "narrow at V-block 32", "R in the fused kernel", "four roles at 32", "four roles at 64",
            "chain's hand-off first"]

# the wide kernel's value role as generated (kernels/forward's GDN at V-block 128), from the product
# that makes the new values to the end of the chunk
_HANDED = re.compile(r"""(?P<ind> +)T\.barrier_wait\(v_new_s_empty\[stage1\], phase1 \^ 1\)
(?P=ind)T\.copy\(v_new, v_new_s\)
(?P=ind)T\.fence_proxy_async\(\).*
(?P=ind)T\.barrier_arrive\(v_new_s_full\[stage1\]\)
(?P=ind)for i, j in T\.Parallel\(C, BV\):
(?P=ind)    v_new\[i, j\] = \(decay_to_end_s\[stage2, i\] \* v_new\[i, j\]\)
(?P=ind)T\.barrier_arrive\(loads_empty\[stage2\]\)
(?P=ind)T\.barrier_wait\(v_new_decayed_s_empty\[stage1\], phase1 \^ 1\)
(?P=ind)T\.copy\(v_new, v_new_decayed_s\)
(?P=ind)T\.fence_proxy_async\(\).*
(?P=ind)T\.barrier_arrive\(v_new_decayed_s_full\[stage1\]\)
""")


def _chain_first(source: str) -> str:
    """The generated module with the value role's two hand-offs swapped (see the docstring)."""
    def swapped(m):
        ind = m["ind"]
        return "\n".join(ind + ln for ln in (
            "for i in T.Parallel(C):",
            "    decay_i[i] = decay_to_end_s[stage2, i]",
            "T.barrier_wait(v_new_decayed_s_empty[stage1], phase1 ^ 1)",
            "for i, j in T.Parallel(C, BV):",
            "    v_new_decayed_s[i, j] = T.cast(decay_i[i] * v_new[i, j], IO)",
            "T.fence_proxy_async()",
            "T.barrier_arrive(v_new_decayed_s_full[stage1])",
            "T.barrier_wait(v_new_s_empty[stage1], phase1 ^ 1)",
            "T.copy(v_new, v_new_s)",
            "T.fence_proxy_async()",
            "T.barrier_arrive(v_new_s_full[stage1])",
            "T.barrier_arrive(loads_empty[stage2])")) + "\n"
    if "def gdn_fused" not in source or "T.set_max_nreg(112, 0)\n" not in source:
        return source
    patched, n = _HANDED.subn(swapped, source)
    assert n == 1, "the wide kernel's value role is no longer as this experiment expects"
    decl = re.search(r"( +)v_new = T\.alloc_fragment\(\(C, BV\), \"float32\"\)\n", patched)
    return patched[:decl.end()] + f'{decl[1]}decay_i = T.alloc_fragment((C,), "float32")\n' + patched[decl.end():]


def _set_up(variant: str) -> dict:
    """Patch this process for `variant`; the launch policy its calls take."""
    if variant == "narrow at V-block 32":
        return dict(block_v=32)
    if variant == "chain's hand-off first":
        from qla_compiler.kernels import runtime

        lower = runtime.lower
        runtime.lower = lambda *args: _chain_first(lower(*args))
        return dict(wide=True)
    if variant == "R in the fused kernel":
        from qla_compiler.passes import partition

        partition._folded_into_prep = lambda *args: set()
    elif variant.startswith("four roles at "):
        from qla_compiler.passes import schedule_fused

        schedule_fused.WIDE_BLOCK_V = int(variant.rsplit(" ", 1)[1])
        return dict(wide=True)
    return {}


def _run(variant: str, rows, compile_only: bool) -> dict:
    policy = _set_up(variant)
    from qla_compiler.bench import parse_row
    from qla_compiler.kernels import forward as fwd

    if compile_only:
        from qla_compiler.precompile import compile_classes, shape_classes

        todo = []
        for row in rows:
            H, HV, lens = parse_row(row)
            with fwd.launch_policy(**policy):
                todo += [c for c in shape_classes("gdn", H=H, HV=HV, K=128, n_seqs=len(lens), sms=fwd.H200_SMS,
                                                  block_v=policy.get("block_v")) if c.fused]
        compile_classes(list(dict.fromkeys(todo)), log=lambda line: print(line, file=sys.stderr, flush=True))
        return {}
    import torch

    from qla_compiler import ops
    from qla_compiler.bench import device_ms, make_inputs

    out = {}
    for row in rows:
        args = make_inputs(*parse_row(row))
        per_kernel = {}
        with fwd.launch_policy(fused=True, **policy):
            total = device_ms(lambda: ops.chunk_gated_delta_rule(**args), per_kernel=per_kernel)
            o = ops.chunk_gated_delta_rule(**args)[0]
        torch.save(o.cpu(), _outputs(variant, row))
        out[row] = (total, {k: v for k, v in per_kernel.items() if k.startswith("gdn")})
    return out


def _outputs(variant: str, row: str) -> str:
    """Where a variant's o on a row is kept for the comparison with the generated path's."""
    return f"/tmp/fused_variants_{variant.replace(' ', '_')}_{row.replace('/', '-').replace(':', '_')}.pt"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="*", default=ROWS)
    ap.add_argument("--only", nargs="*", choices=VARIANTS, default=VARIANTS)
    ap.add_argument("--compile", action="store_true", help="compile every variant's classes (no GPU needed)")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # (one process's variant)
    a = ap.parse_args(argv)
    if a.variant:
        print(json.dumps(_run(a.variant, a.rows, a.compile)))
        return 0
    results = {}
    for variant in a.only:
        cmd = [sys.executable, __file__, "--variant", variant, "--rows", *a.rows] + (["--compile"] if a.compile else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            print(f"{variant}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
            continue
        if a.compile:
            print(f"{variant}: compiled", flush=True)
            continue
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    if a.compile:
        return 0
    for row in a.rows:
        print(f"{row} (GPU ms per forward)")
        for variant, by_row in results.items():
            total, kernels = by_row[row]
            parts = ", ".join(f"{k.removesuffix('_kernel')} {ms:.3f}" for k, ms in sorted(kernels.items(), key=lambda x: -x[1]))
            diff = ""
            if variant != "as generated" and "as generated" in results:
                import torch

                o, base = torch.load(_outputs(variant, row)).double(), torch.load(_outputs("as generated", row)).double()
                diff = f"   o against as generated: {float((o - base).norm() / base.norm()):.1e}"
            print(f"    {variant:<24} {total:.3f}   ({parts}){diff}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
