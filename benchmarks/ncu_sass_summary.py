"""Read the per-instruction SASS tables that benchmarks/ncu_kernel.sh writes and print, for each
kernel side by side, the instructions executed and the warp-stall samples by opcode: where two
kernels doing the same work differ (runs anywhere; no GPU, no ncu).

    python benchmarks/ncu_sass_summary.py ncu/prep.sass.csv ncu/kkt.sass.csv
"""
import csv
import re
import sys
from collections import Counter


def _column(header: list, *words) -> int | None:
    for i, h in enumerate(header):
        if all(w.lower() in h.lower() for w in words):
            return i
    return None


def _number(s: str) -> float:
    s = s.replace(",", "").strip()
    try:
        return float(s)
    except ValueError:
        return 0.0


def summary(path: str) -> tuple:
    """(instructions executed by opcode, stall samples by opcode) of one table."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    start = next(i for i, r in enumerate(rows) if _column(r, "source") is not None)
    header, body = rows[start], rows[start + 1:]
    src = _column(header, "source")
    executed = _column(header, "instructions executed")
    stalls = _column(header, "stall sampling", "all") or _column(header, "stall sampling")
    ops, stall_ops = Counter(), Counter()
    for r in body:
        if len(r) <= max(c for c in (src, executed, stalls) if c is not None):
            continue
        m = re.match(r"\s*(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", r[src])
        if not m:
            continue
        op = m.group(2).split(".")[0] if not m.group(2).startswith(("LDS", "STS", "LDG", "STG")) else m.group(2)
        if executed is not None:
            ops[op] += _number(r[executed])
        if stalls is not None:
            stall_ops[op] += _number(r[stalls])
    return ops, stall_ops


def main(argv=None) -> int:
    paths = (argv if argv is not None else sys.argv[1:])
    if not paths:
        print(__doc__)
        return 2
    tables = [summary(p) for p in paths]
    for title, idx in (("instructions executed (warp-level)", 0), ("warp-stall samples", 1)):
        totals = [sum(t[idx].values()) or 1 for t in tables]
        ops = sorted(set().union(*(t[idx] for t in tables)), key=lambda o: -max(t[idx][o] for t in tables))
        print(f"\n{title}")
        print(f"{'opcode':18s}" + "".join(f"{p.split('/')[-1][:22]:>24s}" for p in paths))
        for op in ops[:30]:
            print(f"{op:18s}" + "".join(f"{t[idx][op]:>14.0f} ({t[idx][op] / tot:5.1%})" for t, tot in zip(tables, totals)))
        print(f"{'total':18s}" + "".join(f"{tot:>24.0f}" for tot in totals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
