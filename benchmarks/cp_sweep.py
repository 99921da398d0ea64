"""Context parallelism's segment counts on the GPU, beside the planner's model (kernels/cp_plan.py):
for each row and each count, the inference call's GPU time (the bench's gates, which decay) and the
model's prediction, the scan's part of it; then the model's constants fitted to the measurements.

    python benchmarks/cp_sweep.py                         # GPU: the rows where the planner may cut
    python benchmarks/cp_sweep.py --rows 2/8:1x32768 --segments 1 4 8 --json sweep.json

Fitting: per row, t(S) − t(1) = (the model's walks(S) − walks(1)) · chunk + [S > 1] · glue,
least squares over every (row, S), the prep's time cancelling in the difference; printed as the
CHUNK_MS and GLUE_MS the model would take (its WINDOW is the bench gates' window).
"""
import argparse
import json
import math

ROWS = ["2/8:1x32768", "2/8:1x8192", "4/16:1x32768", "8/32:1x32768", "16/64:1x32768", "2/8:8x4096",
        "4/16:8x4096", "16/64:1x2048"]


def main():
    import torch

    from qla_compiler import ops
    from qla_compiler.bench import device_ms, make_inputs, parse_row
    from qla_compiler.kernels import cp_plan
    from qla_compiler.kernels.forward import sm_count

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="*", default=ROWS)
    ap.add_argument("--segments", nargs="*", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args()
    sms = sm_count(torch.device("cuda"))
    data = []
    for row in args.rows:
        H, HV, lens = parse_row(row)
        a = make_inputs(H, HV, lens)
        plan = cp_plan.plan_segments(len(lens), H, HV, 128, 128, sum(lens), sms)
        for s in args.segments:
            fn = (lambda s=s: ops.chunk_gated_delta_rule(**a, context_parallel=None if s == 1 else s))
            with torch.no_grad():
                ms = device_ms(fn)
            model = cp_plan.predicted_ms(s, len(lens), H, HV, 128, 128, sum(lens), sms)
            data.append(dict(row=row, segments=s, ms=ms, model=model, planned=plan))
            print(f"{row:>14} S={s:<3} {ms:7.3f} ms   model (scan) {model:6.3f}{'   <- planned' if s == plan else ''}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    fit(data, sms)


def fit(data: list, sms: int) -> None:
    """Least squares for (chunk, glue) in t(S) − t(1) = Δwalks · chunk + glue (see the docstring)."""
    from qla_compiler.bench import parse_row
    from qla_compiler.kernels import cp_plan

    base = {d["row"]: d["ms"] for d in data if d["segments"] == 1}
    rows_a, rows_b = [], []
    for d in data:
        if d["segments"] == 1 or d["row"] not in base:
            continue
        H, HV, lens = parse_row(d["row"])
        unit = dict(N=len(lens), H=H, HV=HV, K=128, V=128, tokens=sum(lens), sms=sms)
        # the model's time in units of a chunk, its glue left out: (t − glue) / CHUNK_MS
        walks = lambda s: (cp_plan.predicted_ms(s, **unit) - (cp_plan.GLUE_MS if s > 1 else 0)) / cp_plan.CHUNK_MS
        rows_a.append((walks(d["segments"]) - walks(1), 1.0))
        rows_b.append(d["ms"] - base[d["row"]])
    if len(rows_a) < 2:
        return
    import torch

    sol = torch.linalg.lstsq(torch.tensor(rows_a, dtype=torch.float64),
                             torch.tensor(rows_b, dtype=torch.float64)[:, None]).solution.flatten()
    chunk, glue = float(sol[0]), float(sol[1])
    print(f"fit: CHUNK_MS = {chunk:.6f} ({chunk * 1000:.2f} µs; the model's {cp_plan.CHUNK_MS * 1000:.2f}), "
          f"GLUE_MS = {glue:.3f} (the model's {cp_plan.GLUE_MS:.3f})")
    if not math.isfinite(chunk):
        print("fit: not determined by these measurements")


if __name__ == "__main__":
    main()
