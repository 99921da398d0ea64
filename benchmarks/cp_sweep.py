"""Context parallelism's segment counts on the GPU, beside the planner's model (kernels/cp_plan.py):
for each row and each count, the inference call's GPU time (the bench's gates, which decay) and the
model's prediction, the scan's part of it; then the model's constants fitted to the measurements.

    python benchmarks/cp_sweep.py                         # GPU: the rows where the planner may cut
    python benchmarks/cp_sweep.py --rows 2/8:1x32768 --segments 1 4 8 --json sweep.json
    python benchmarks/cp_sweep.py --fit benchmarks/cp_sweep_h200.json    # no GPU: fit stored data
    python benchmarks/cp_sweep.py --cut-wide --json wide.json   # cuts on the wide kernel where it fills

Fitting: per row, t(S) − t(1) = Σ_f (terms_f(S) − terms_f(1)) · cost_f over the model's terms
(cp_plan.cost_terms: chunks and waves of the launches, on the narrow kernel or the wide one, the
cut's glue, its segments, its tokens × key heads), least squares over every (row, S > 1), the
prep's time cancelling in the difference; printed as the Costs the model would take. A constant no
measurement exercises (`wide_chunk` without a --cut-wide sweep) stays at the model's value.
--cut-wide: the calls under forward.launch_policy(cut_wide=True), so a cut walks on the wide fused
kernel where its rule holds (forward.runs_wide); each record says so (`wide`), and the fit counts
those walks' chunks as `wide_chunk`'s. Fit a wide sweep together with a plain one (--fit A B).
`benchmarks/cp_sweep_h200.json` is session 22's sweep (the constants in kernels/cp_plan.py come
from it).
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
    from qla_compiler.kernels import forward
    from qla_compiler.kernels.forward import sm_count

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="*", default=ROWS)
    ap.add_argument("--segments", nargs="*", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--fit", nargs="+", metavar="JSON",
                    help="fit the constants to measurements stored by --json (one file or several), and stop")
    ap.add_argument("--cut-wide", action="store_true",
                    help="cut calls walk on the wide fused kernel where its rule holds (forward.cut_wide)")
    ap.add_argument("--fix", nargs="*", default=[], metavar="NAME=MS",
                    help="hold these constants (cp_plan.Costs' fields) at a value measured otherwise")
    args = ap.parse_args()
    fixed = {k: float(v) for k, v in (f.split("=") for f in args.fix)}
    if args.fit:
        data = []
        for path in args.fit:
            with open(path) as f:
                data += json.load(f)
        return fit(data, 132, fixed)
    sms = sm_count(torch.device("cuda"))
    data = []
    for row in args.rows:
        H, HV, lens = parse_row(row)
        a = make_inputs(H, HV, lens)
        plan = cp_plan.plan_segments(len(lens), H, HV, 128, 128, sum(lens), sms, wide=args.cut_wide)
        for s in args.segments:
            fn = (lambda s=s: ops.chunk_gated_delta_rule(**a, context_parallel=s))
            with torch.no_grad(), forward.launch_policy(cut_wide=args.cut_wide):
                ms = device_ms(fn)
            model = cp_plan.predicted_ms(s, len(lens), H, HV, 128, 128, sum(lens), sms, wide=args.cut_wide)
            data.append(dict(row=row, segments=s, ms=ms, model=model, planned=plan, wide=args.cut_wide))
            print(f"{row:>14} S={s:<3} {ms:7.3f} ms   model (scan) {model:6.3f}{'   <- planned' if s == plan else ''}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    fit(data, sms, fixed)


def fit(data: list, sms: int, fixed: dict | None = None) -> dict | None:
    """Least squares for the model's Costs in t(S) − t(1) = Σ Δterms · cost (see the docstring),
    non-negative (every constant is a time: a negative one fits noise, and session 27's free fit
    made the segment's cost −0.6 µs), the constants in `fixed` held at their values. Returns the
    constants by name (None where the measurements are too few)."""
    import itertools

    import torch

    from qla_compiler.bench import parse_row
    from qla_compiler.kernels import cp_plan

    fixed = fixed or {}
    names = [f.name for f in dataclasses.fields(cp_plan.Costs)]
    # (a row's whole walk, S = 1, is its own baseline in each sweep: plain and wide rows apart)
    base = {(d["row"], d.get("wide", False)): d["ms"] for d in data if d["segments"] == 1}
    rows_a, rows_b, which = [], [], []
    for d in data:
        wide = d.get("wide", False)
        if d["segments"] == 1 or (d["row"], wide) not in base:
            continue
        H, HV, lens = parse_row(d["row"])
        size = (len(lens), H, HV, 128, 128, sum(lens), sms)
        one, cut = cp_plan.cost_terms(1, *size, wide=wide), cp_plan.cost_terms(d["segments"], *size, wide=wide)
        rows_a.append([cut[n] - one[n] for n in names])
        rows_b.append(d["ms"] - base[(d["row"], wide)])
        which.append((d["row"], d["segments"]))
    # a constant no measurement's terms change is not determined: held at the model's value
    fixed = {**{n: getattr(cp_plan.H200, n) for i, n in enumerate(names) if all(r[i] == 0 for r in rows_a)}, **fixed}
    free = [i for i, n in enumerate(names) if n not in fixed]
    if len(rows_a) < len(free):
        print(f"fit: {len(rows_a)} measurements do not determine {len(free)} constants")
        return None
    a, b = torch.tensor(rows_a, dtype=torch.float64), torch.tensor(rows_b, dtype=torch.float64)
    b = b - sum(a[:, names.index(n)] * v for n, v in fixed.items())
    # non-negative least squares by trying every subset of the free constants (five: 31 solves),
    # the rest zero; the best fit whose constants are all ≥ 0
    best = None
    for k in range(1, len(free) + 1):
        for idx in itertools.combinations(free, k):
            sol = torch.linalg.lstsq(a[:, idx], b[:, None]).solution.flatten()
            err = (a[:, idx] @ sol - b).pow(2).sum()
            if (sol >= 0).all() and (best is None or err < best[0]):
                best = (err, dict(zip(idx, sol.tolist())))
    fitted = {n: fixed.get(n, best[1].get(i, 0.0)) for i, n in enumerate(names)}
    res = a[:, free] @ torch.tensor([fitted[names[i]] for i in free], dtype=torch.float64) - b
    print("fit: " + ", ".join(f"{n} = {v:.4g}{' (fixed)' if n in fixed else ''} (the model's "
                              f"{getattr(cp_plan.H200, n):.4g})" for n, v in fitted.items()))
    print(f"fit: residuals rms {float(res.pow(2).mean().sqrt()):.3f} ms, max {float(res.abs().max()):.3f} ms "
          f"(at {which[int(res.abs().argmax())]})")
    return fitted


if __name__ == "__main__":
    main()
