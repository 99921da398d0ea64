"""Context parallelism's segment counts on the GPU, beside the planner's model (kernels/cp_plan.py):
for each row and each count, the inference call's GPU time (the bench's gates, which decay) and the
model's prediction, the scan's part of it; then the model's constants fitted to the measurements.

    python benchmarks/cp_sweep.py                         # GPU: the rows where the planner may cut
    python benchmarks/cp_sweep.py --rows 2/8:1x32768 --segments 1 4 8 --json sweep.json
    python benchmarks/cp_sweep.py --fit benchmarks/cp_sweep_h200.json    # no GPU: fit stored data

Fitting: per row, t(S) − t(1) = Σ_f (terms_f(S) − terms_f(1)) · cost_f over the model's terms
(cp_plan.cost_terms: chunks and waves of the launches, the cut's glue, its segments, its tokens ×
key heads), least squares over every (row, S > 1), the prep's time cancelling in the difference;
printed as the Costs the model would take. `benchmarks/cp_sweep_h200.json` is session 22's sweep
(the constants in kernels/cp_plan.py come from it).
"""
import argparse
import dataclasses
import json

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
    ap.add_argument("--fit", metavar="JSON", help="fit the constants to measurements stored by --json, and stop")
    args = ap.parse_args()
    if args.fit:
        with open(args.fit) as f:
            return fit(json.load(f), 132)
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
    """Least squares for the model's Costs in t(S) − t(1) = Σ Δterms · cost (see the docstring)."""
    import torch

    from qla_compiler.bench import parse_row
    from qla_compiler.kernels import cp_plan

    names = [f.name for f in dataclasses.fields(cp_plan.Costs)]
    base = {d["row"]: d["ms"] for d in data if d["segments"] == 1}
    rows_a, rows_b, which = [], [], []
    for d in data:
        if d["segments"] == 1 or d["row"] not in base:
            continue
        H, HV, lens = parse_row(d["row"])
        size = (len(lens), H, HV, 128, 128, sum(lens), sms)
        one, cut = cp_plan.cost_terms(1, *size), cp_plan.cost_terms(d["segments"], *size)
        rows_a.append([cut[n] - one[n] for n in names])
        rows_b.append(d["ms"] - base[d["row"]])
        which.append((d["row"], d["segments"]))
    if len(rows_a) < len(names):
        print(f"fit: {len(rows_a)} measurements do not determine {len(names)} constants")
        return
    a, b = torch.tensor(rows_a, dtype=torch.float64), torch.tensor(rows_b, dtype=torch.float64)
    sol = torch.linalg.lstsq(a, b[:, None]).solution.flatten()
    res = a @ sol - b
    fitted = dict(zip(names, sol.tolist()))
    print("fit: " + ", ".join(f"{n} = {v:.4g} (the model's {getattr(cp_plan.H200, n):.4g})" for n, v in fitted.items()))
    print(f"fit: residuals rms {float(res.pow(2).mean().sqrt()):.3f} ms, max {float(res.abs().max()):.3f} ms "
          f"(at {which[int(res.abs().argmax())]})")


if __name__ == "__main__":
    main()
