"""Where the fused forward should apply the gates' ratio R_ij = e^{γ_i − γ_j} to the inverse: in the
prep, which then stores T = T_r ⊙ R (partition._folded_into_prep: as generated since session 13,
to take a C×C pass off the scan's chain), or in the fused kernel, whose chain then forms T_r ⊙ R
from the T_r the prep stores (FlashQLA's split: its solve is gate-free). The prep's gate pass
costs 0.08 ms at 16/64:8x4096 (prep_variants' no_gate_scale, session 19); the fused kernel has
since become 2× faster, so what the chain pays for the pass has changed. GPU time per forward,
the fused path forced, each way in a process of its own (the partition is chosen when the spec
compiles). Both ways run the narrow kernel at V-block 32: with R on the chain the wide one
(V-block 128) needs 227 KB of shared memory, over the 224 KB budget, and the narrow one takes no
V-block wider than 32.

    python benchmarks/gate_in_prep.py --compile          # CPU: both ways' kernels into the cache
    python benchmarks/gate_in_prep.py                    # GPU
"""
import argparse
import json
import os
import subprocess
import sys

ROWS = ["16/64:8x4096", "8/32:1x32768", "4/16:8x4096"]
BLOCK_V = 32  # (the widest both ways take)


def _unfold() -> None:
    """The fused forward with R applied in the fused kernel: nothing folded into the prep."""
    from qla_compiler.passes import partition

    partition._folded_into_prep = lambda *args: set()


def _one(where: str, rows, compile_only: bool) -> dict:
    if where == "kernel":
        _unfold()
    from qla_compiler.bench import parse_row
    from qla_compiler.kernels.forward import H200_SMS

    if compile_only:
        from qla_compiler.precompile import compile_classes, shape_classes

        todo = []
        for row in rows:
            H, HV, lens = parse_row(row)
            todo += [c for c in shape_classes("gdn", H=H, HV=HV, K=128, n_seqs=len(lens), sms=H200_SMS,
                                              block_v=BLOCK_V) if c.fused]
        compile_classes(list(dict.fromkeys(todo)), log=lambda line: print(line, file=sys.stderr, flush=True))
        return {}
    from qla_compiler import ops
    from qla_compiler.bench import device_ms, make_inputs
    from qla_compiler.kernels import forward as fwd

    out = {}
    for row in rows:
        H, HV, lens = parse_row(row)
        args = make_inputs(H, HV, lens)
        per_kernel = {}
        with fwd.launch_policy(fused=True, block_v=BLOCK_V):
            total = device_ms(lambda: ops.chunk_gated_delta_rule(**args), per_kernel=per_kernel)
        out[row] = (total, {k: v for k, v in per_kernel.items() if k.startswith("gdn")})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="*", default=ROWS)
    ap.add_argument("--compile", action="store_true", help="compile both ways' fused classes (no GPU needed)")
    ap.add_argument("--where", choices=["prep", "kernel"], help=argparse.SUPPRESS)  # (one process's way)
    a = ap.parse_args(argv)
    if a.where:
        print(json.dumps(_one(a.where, a.rows, a.compile)))
        return 0
    results = {}
    for where in ("prep", "kernel"):
        cmd = [sys.executable, __file__, "--where", where, "--rows", *a.rows] + (["--compile"] if a.compile else [])
        done = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        results[where] = json.loads(done.stdout.strip().splitlines()[-1])
    if a.compile:
        return 0
    for row in a.rows:
        (tp, kp), (tk, kk) = results["prep"][row], results["kernel"][row]
        print(f"{row}: R in the prep {tp:.3f} ms, in the fused kernel {tk:.3f} ms ({tk / tp - 1:+.1%})")
        for name in sorted(set(kp) | set(kk)):
            print(f"    {name:<24} {kp.get(name, float('nan')):.3f} -> {kk.get(name, float('nan')):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
