"""The errors of o, the final state and every gradient over several draws of real-data cases
(tests/test_gpu_real_data.py's inputs and cotangents, a seed each draw), for qla's two training
forwards — the separate kernels and the fused one (launch policy fused_training) — and for FLA,
each against the float64 reference: per quantity, the mean error of each and the mean and range of
qla's ratio to FLA's on the same draw.

The real-data test holds each quantity of one draw to 1.1× FLA's error. Where a quantity's error
moves tens of percent from draw to draw (d g at g = 0, session 43), one draw cannot tell the
kernels' accuracy from the draw's: this can, before a default changes.

    python3 benchmarks/error_draws.py g0_uniform_keys uniform_keys --draws 8      # on the GPU node
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests import test_gpu_real_data as rd  # noqa: E402 (its inputs, cotangents and runs)

import qla_compiler  # noqa: E402
from qla_compiler.kernels import forward as fwd  # noqa: E402
from qla_compiler.testing import rel_err  # noqa: E402

FORWARDS = {"separate": dict(fused_training=False), "fused": dict(fused=True, fused_training=True)}


def draws(case: str, n: int, dtype=torch.bfloat16) -> dict:
    """quantity -> {"FLA": [error a draw], "separate": [...], "fused": [...]}."""
    spec = dict(rd.DATA_CASES[case])
    l2norm = spec.pop("l2norm", False)
    op = qla_compiler.compile("gdn", target="sm90")
    fla_op = rd._fla()
    errors = {}
    for seed in range(n):
        args = rd.make_inputs(K=128, V=128, dtype=dtype, seed=1000 * (seed + 1), l2norm=l2norm, **spec)
        cot = rd._cotangents(args, seed=7 + seed)
        ref = rd._run(op.reference, args, cot, l2norm, dtype=torch.float64)
        runs = {"FLA": rd._run(fla_op, {n_: (x.long() if n_ == "cu_seqlens" else x) for n_, x in args.items()},
                               cot, l2norm)}
        for name, policy in FORWARDS.items():
            with fwd.launch_policy(**policy):
                runs[name] = rd._run(op, args, cot, l2norm)
        for q in ref:
            for who, got in runs.items():
                x = got[q]
                err = rel_err(x, ref[q]) if x is not None and bool(torch.isfinite(x).all()) else float("inf")
                errors.setdefault(q, {}).setdefault(who, []).append(err)
    return errors


def report(case: str, errors: dict) -> str:
    lines = [f"{case}: mean error over {len(next(iter(errors.values()))['FLA'])} draws; qla / FLA on each draw"]
    for q, by in errors.items():
        row = f"  {q:>13}  FLA {statistics.mean(by['FLA']):.3e}"
        for name in FORWARDS:
            # (only draws where FLA's error is finite: at g = −inf it is NaN, and a ratio to it says nothing)
            ratios = [a / b for a, b in zip(by[name], by["FLA"]) if 0 < b < float("inf")]
            row += f"  {name} {statistics.mean(by[name]):.3e}" + (
                f" (×{statistics.mean(ratios):.2f}, {min(ratios):.2f}–{max(ratios):.2f})" if ratios else " (FLA not finite)")
        lines.append(row)
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+", choices=list(rd.DATA_CASES))
    ap.add_argument("--draws", type=int, default=8)
    a = ap.parse_args(argv)
    for case in a.cases:
        print(report(case, draws(case, a.draws)), flush=True)


if __name__ == "__main__":
    main()
