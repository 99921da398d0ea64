"""The token step's V-block against the batch: GPU time per decoding call at each V-block the kernel
takes (a warp per 8 columns: 8 is one warp a CTA, 16 two, 32 four), beside FLA's fused_recurrent,
with each call's kernels by name (what a call launches besides the token step shows up there).

    python benchmarks/token_step_bv.py                       # GPU: qla-bench --decode's rows
    python benchmarks/token_step_bv.py --rows 16/64:1x1 2/8:32x1
    python benchmarks/token_step_bv.py --compile             # no GPU: compile the classes it launches

Why (session 30): at batch 1 the token step took 0.008 ms against FLA's 0.004 (session 12) at a
V-block of 32 and 128 threads, five block barriers a token; FLA runs one warp on 8 columns. The
sweep set kernels/token_step.block_v's rule (MANY_TOKENS, and the grid against the SMs): the
"chosen" column is what it picks, to be read against the fastest.
"""
import argparse
import sys

BLOCKS = (8, 16, 32)


def _calls(rows):
    from qla_compiler.bench import make_inputs, parse_row

    for row in rows:
        H, HV, lens = parse_row(row)
        a = make_inputs(H, HV, lens)
        # (packed, as qla-bench --decode calls both)
        yield row, H, HV, lens, dict(q=a["q"], k=a["k"], v=a["v"], g=a["g"], beta=a["beta"],
                                     initial_state=a["initial_state"], output_final_state=True,
                                     cu_seqlens=a["cu_seqlens"])


def compile_only(rows) -> int:
    import torch

    from qla_compiler.checks import Dims
    from qla_compiler.kernels import token_step
    from qla_compiler.precompile import Compile, compile_classes
    from qla_compiler.bench import parse_row

    todo = set()
    for row in rows:
        H, HV, lens = parse_row(row)
        for bv in BLOCKS:
            todo.add(token_step.shape_class(Dims(1, sum(lens), H, HV, 128, 128, len(lens)), torch.bfloat16,
                                            torch.float32, 128 ** -0.5, 0, BV=bv))
    compile_classes([Compile("gdn", "token_step", s, None) for s in sorted(todo, key=str)])
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="*", help="h_qk/h_v:NxL rows (default: qla-bench --decode's)")
    ap.add_argument("--compile", action="store_true", help="compile the token steps the sweep runs (no GPU)")
    a = ap.parse_args(argv)
    from qla_compiler.bench import DECODE_ROWS

    rows = a.rows or DECODE_ROWS
    if a.compile:
        return compile_only(rows)
    import torch

    import qla_compiler.ops as qla_ops
    from qla_compiler.bench import device_ms, state_floor_ms
    from qla_compiler.kernels import forward, token_step

    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_step
    except ImportError as e:  # the comparison is the point: no FLA, no table
        print(f"FLA not importable: {e}", file=sys.stderr)
        return 1
    print(f"{'row':<14} {'floor':>7} " + " ".join(f"{'BV=' + str(b):>7}" for b in BLOCKS)
          + f" {'FLA':>7}  chosen  kernels at the chosen BV (ms)", flush=True)
    for row, H, HV, lens, args in _calls(rows):
        times, kernels = {}, {}
        for bv in BLOCKS:
            with forward.launch_policy(token_block_v=bv):
                per = {}
                times[bv] = device_ms(lambda: qla_ops.fused_recurrent_gated_delta_rule(**args), 20, per)
                kernels[bv] = per
        fla = device_ms(lambda: fla_step(**args), 20)
        chosen = token_step.block_v(128, HV, len(lens), sum(lens), forward.sm_count(args["v"].device))
        per = ", ".join(f"{k[:40]} {v:.4f}" for k, v in sorted(kernels[chosen].items(), key=lambda x: -x[1]))
        floor = state_floor_ms(HV, 128, 128, len(lens), torch.cuda.get_device_name())
        print(f"{row:<14} {floor:>7.4f} "
              + " ".join(f"{times[b]:>7.4f}" for b in BLOCKS) + f" {fla:>7.4f}  {chosen:>6}  {per}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
