"""qla-bench: GDN (or GLA, KDA) forward beside FLA and FlashQLA, in one process on one GPU.

    qla-bench                        # the rows of the baseline table (shared/gpu/README.md)
    qla-bench --rows 2/8:1x32768 --plot bench.png
    qla-bench --backward             # forward + backward per call (training)
    qla-bench --rows 16/64:8x4096:100   # head dims K = V = 100 (K×V: e.g. 128x64)
    qla-bench --fused                # also the fused, warp-specialised forward (qla-fused)
    qla-bench --cut-fused            # also qla with cuts on the fused kernels as whole calls run them (qla-cut-fused)
    qla-bench --decode               # the token step (op.recurrent) beside FLA's fused_recurrent, one token
                                     # per sequence; each row also prints the time to move the states once
    qla-bench --decode --beta-dtype bfloat16   # β in bf16 beside g in float32, as vLLM passes them
    qla-bench --spec kda --rows 16/16:1x32768 16/16:8x4096   # a per-key gate beside FLA's chunk_kda
                                     # (gla: chunk_gla; FlashQLA has neither); h_qk = h_v there
    python benchmarks/bench_gdn.py   # the same

Two times per call, as the baseline table reports them:
  device  the sum of GPU kernel durations (torch.profiler), averaged over calls;
  eager   wall time per call from Python (triton.testing.do_bench median), host work included.
Inputs: bf16 q/k/v, K = V = 128 unless the row says, packed varlen (B = 1), initial state given,
final state returned. qla runs the op's defaults: context parallelism as the planner chooses
(`--cp 1` adds the uncut call as qla-cp1).
"""
from __future__ import annotations

import argparse
import sys

ROWS = ["2/8:1x32768", "2/8:1x8192", "2/8:8x4096", "4/16:1x32768", "4/16:8x4096", "8/32:1x32768",
        "16/64:1x32768", "16/64:1x2048", "16/64:8x4096"]
# decoding: batches of 1, 32 and 256 one-token sequences (issue 19's rows), and 256 sequences of 2-16
# tokens (where the token step and the chunk pipeline cross: op.DECODE_TOKENS)
DECODE_ROWS = [f"{h}:{n}x1" for h in ("16/64", "2/8") for n in (1, 32, 256)] + \
    [f"16/64:256x{t}" for t in (2, 4, 8, 16)]
# Bytes a ms that copies reach, by the device's name: the H200's HBM3e ~4.3 TB/s as measured
# (shared/gpu notes, 90% of its 4.8 peak); the H100's HBM3 at the same 90% of its 3.35 (not
# measured here). A row's floor on the other card was 1.4x off (session 36 printed the H200's).
BYTES_PER_MS = {"H200": 4.3e9, "H100": 3.0e9}


def parse_row(row: str):
    """'h_qk/h_v:NxL[:K[xV]]' -> (H, HV, N lengths of L); the head dims: parse_dims."""
    heads, seqs = row.split(":")[:2]
    H, HV = map(int, heads.split("/"))
    n, L = map(int, seqs.split("x"))
    return H, HV, [L] * n


def parse_dims(row: str) -> tuple:
    """The row's head dims (K, V): its third field, K or KxV; 128, 128 without one.

    >>> parse_dims("2/8:1x8192"), parse_dims("2/8:1x8192:100"), parse_dims("2/8:1x8192:128x64")
    ((128, 128), (100, 100), (128, 64))
    """
    parts = row.split(":")
    if len(parts) < 3:
        return 128, 128
    K, _, V = parts[2].partition("x")
    return int(K), int(V or K)


# the benched ops by spec: FLA's module and the name qla_compiler.ops and FLA both give the op
FLA_OPS = {"gdn": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"), "gla": ("fla.ops.gla", "chunk_gla"),
           "kda": ("fla.ops.kda", "chunk_kda")}
SPECS = tuple(FLA_OPS)


def make_inputs(H, HV, lens, K=128, V=128, seed=0, spec="gdn", beta_dtype="float32"):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)
    q = torch.randn(1, T, H, K, device="cuda", generator=gen).to(torch.bfloat16)
    k = F.normalize(torch.randn(1, T, H, K, device="cuda", generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(1, T, HV, V, device="cuda", generator=gen).to(torch.bfloat16)
    per_key = (K,) if spec in ("gla", "kda") else ()  # a gate per key dimension
    g = F.logsigmoid(torch.randn(1, T, HV, *per_key, device="cuda", generator=gen) + 3.0)
    beta = torch.rand(1, T, HV, device="cuda", generator=gen).to(getattr(torch, beta_dtype))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.long)
    h0 = torch.randn(len(lens), HV, K, V, device="cuda", generator=gen) * 0.1
    return dict(q=q, k=k, v=v, g=g, **({} if spec == "gla" else {"beta": beta}), initial_state=h0,
                output_final_state=True, cu_seqlens=cu)


def with_backward(fn):
    """fn(**inputs) -> (o, final) as one training step: the forward, then the backward from
    fixed cotangents (the inputs become leaves that require grad)."""
    import torch

    def step(**a):
        a = {k: (v.detach().requires_grad_() if torch.is_tensor(v) and v.is_floating_point() else v)
             for k, v in a.items()}
        o, final = fn(**a)
        torch.autograd.backward([o, final], [torch.ones_like(o), torch.ones_like(final)])
        return o
    return step


def host_ms(fn, calls=30) -> tuple:
    """(median, min) ms of fn()'s host time to its return, each call from an idle GPU: what an
    eager caller pays where the GPU keeps up (a synchronisation inside fn would add its GPU time)."""
    import time

    import torch

    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    times.sort()
    return times[calls // 2] * 1e3, times[0] * 1e3


def device_ms(fn, iters=10, per_kernel=None) -> float:
    """Sum of the GPU kernels' durations per call; `per_kernel` (a dict), if given, receives each
    kernel's share (ms per call), by kernel name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    if per_kernel is not None:
        for e in events:
            per_kernel[e.key] = per_kernel.get(e.key, 0.0) + e.self_device_time_total / iters / 1000.0
    return sum(e.self_device_time_total for e in events) / iters / 1000.0


def eager_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def peak_mib(fn) -> float:
    """The most GPU memory fn() holds at once beyond what was allocated before it (MiB)."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def state_floor_ms(HV: int, K: int, V: int, n_seqs: int, device: str = "H200") -> float:
    """The time to read and write every sequence's float32 state once at HBM speed on `device`
    (a name holding H100 or H200, as torch.cuda.get_device_name gives it): a token step's floor.

        >>> round(state_floor_ms(64, 128, 128, 256), 3)
        0.499
        >>> round(state_floor_ms(64, 128, 128, 256, "NVIDIA H100 80GB HBM3"), 3)
        0.716
    """
    card = next((c for c in BYTES_PER_MS if c in device), None)
    if card is None:
        raise ValueError(f"state_floor_ms: no bandwidth known for device {device!r}; known: {list(BYTES_PER_MS)}")
    return 2 * n_seqs * HV * K * V * 4 / BYTES_PER_MS[card]


def _floor(HV: int, K: int, V: int, n_seqs: int) -> str:
    import torch
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "H200"
    try:
        return f"{state_floor_ms(HV, K, V, n_seqs, name):.4f} ms on {name}"
    except ValueError:
        return f"{state_floor_ms(HV, K, V, n_seqs):.4f} ms at the H200's bandwidth"


def decode_libraries(only=None):
    import qla_compiler.ops as qla_ops
    from qla_compiler.op import decode_tokens

    def chunked(**a):  # the chunk pipeline, where the op would dispatch to the token step
        with decode_tokens(0):
            return qla_ops.chunk_gated_delta_rule(**a)

    libs = {"qla": qla_ops.fused_recurrent_gated_delta_rule, "qla-chunk": chunked}
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_step
        libs["FLA"] = fla_step
    except ImportError as e:
        print(f"FLA not importable: {e}", file=sys.stderr)
    return {k: v for k, v in libs.items() if not only or k in only}


def libraries(cp=None, only=None, backward=False, fused=False, spec="gdn", cut_fused=False):
    import functools
    import importlib

    import qla_compiler.ops as qla_ops
    from qla_compiler.kernels import forward

    module, name = FLA_OPS[spec]
    ours = getattr(qla_ops, name)

    def with_policy(on):
        def call(**a):  # (a training step's forward fused too: Program.fused_training_program)
            with forward.launch_policy(fused=on, fused_training=on):
                return ours(**a)
        return call

    libs = {"qla": with_policy(False) if fused else ours}
    if fused:
        libs["qla-fused"] = with_policy(True)
    if cp:
        libs[f"qla-cp{cp}"] = functools.partial(ours, context_parallel=cp)
    if cut_fused:
        def cut_on_fused(**a):  # (an inference call's plan then weighs the wide walk: cp_plan.walks_wide)
            with forward.launch_policy(cut_wide=True, cut_fused_training=True):
                return ours(**a)
        libs["qla-cut-fused"] = cut_on_fused

    def wanted(lib):  # a peer left out is not imported either: its import alone makes our host time
        # ~1.4x (benchmarks/launch_overhead.py --peers, session 29)
        return not only or lib in only

    try:
        if wanted("FLA"):
            libs["FLA"] = getattr(importlib.import_module(module), name)
    except ImportError as e:
        print(f"FLA not importable: {e}", file=sys.stderr)
    if spec == "gdn" and wanted("FlashQLA"):  # (FlashQLA has no per-key gate)
        try:
            from flash_qla import chunk_gated_delta_rule as fq_gdn
            libs["FlashQLA"] = fq_gdn
        except ImportError as e:
            print(f"FlashQLA not importable: {e}", file=sys.stderr)
    if backward:
        libs = {k: with_backward(f) for k, f in libs.items()}
    if only:  # e.g. while tuning: the baselines' times do not change between runs
        libs = {k: v for k, v in libs.items() if k in only}
    return libs


def run(rows, plot=None, cp=None, only=None, backward=False, decode=False, fused=False, spec="gdn",
        beta_dtype="float32", cut_fused=False):
    import torch

    libs = decode_libraries(only) if decode else libraries(cp, only, backward, fused, spec, cut_fused)
    results = []
    what = "token step (decode)" if decode else "forward + backward" if backward else "forward"
    print(f"# {spec.upper()} {what}, {torch.cuda.get_device_name()}, bf16, packed varlen, β in {beta_dtype}, "
          "ms per call")
    for row in rows:
        H, HV, lens = parse_row(row)
        K, V = parse_dims(row)
        args = make_inputs(H, HV, lens, K, V, spec=spec, beta_dtype=beta_dtype)
        res = {"row": row}
        for name, fn in libs.items():
            def call(f=fn, a=args):
                return f(**a)

            try:
                kernels = {}
                res[f"{name} device"] = device_ms(call, per_kernel=kernels)
                # every library's, so a kernel can be set beside its counterpart (our scan, FLA's fwd_h)
                top = sorted(kernels.items(), key=lambda kv: -kv[1])
                print(f"  {row} {name} kernels (ms): " + ", ".join(f"{k[:48]} {t:.3f}" for k, t in top))
                res[f"{name} eager"] = eager_ms(call)
                if backward:  # (issue 16: what a training step holds at once, beside the peers')
                    print(f"  {row} {name} peak memory above the inputs: {peak_mib(call):.0f} MiB")
            except Exception as e:  # noqa: BLE001 - one failing library must not hide the others
                print(f"{row} {name}: {type(e).__name__}: {e}", file=sys.stderr)
        results.append(res)
        floor = f"  (the states once: {_floor(HV, K, V, len(lens))})" if decode else ""
        print(_line(res, libs) + floor, flush=True)
    print(_table(results, libs))
    if plot:
        _plot(results, libs, plot)
    return results


def _line(res, libs) -> str:
    parts = [res["row"]] + [f"{n} {res.get(f'{n} device', float('nan')):.3f}/{res.get(f'{n} eager', float('nan')):.3f}"
                            for n in libs]
    return "  ".join(parts)


def _table(results, libs) -> str:
    names = list(libs)
    ours = [n for n in names if n.startswith("qla")]
    ratios = [(q, b) for q in ours for b in names if not b.startswith("qla")]
    head = "| h_qk/h_v:seqs | " + " | ".join(f"{n} device | {n} eager" for n in names)
    head += "".join(f" | {q}/{b} device | {q}/{b} eager" for q, b in ratios) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(names) + 2 * len(ratios))]
    for r in results:
        cells = [r["row"]] + [f"{r.get(f'{n} {w}', float('nan')):.3f}" for n in names for w in ("device", "eager")]
        for q, b in ratios:
            for w in ("device", "eager"):
                x, y = r.get(f"{q} {w}"), r.get(f"{b} {w}")
                cells.append(f"{x / y:.2f}" if x and y else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot(results, libs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    x = range(len(results))
    width = 0.8 / len(libs)
    for i, n in enumerate(libs):
        ax.bar([xi + i * width for xi in x], [r.get(f"{n} device", 0) for r in results], width, label=n)
    ax.set_xticks([xi + 0.4 - width / 2 for xi in x], [r["row"] for r in results], rotation=30, ha="right")
    ax.set_ylabel("GPU time per forward (ms)")
    ax.set_title("GDN forward, K = V = 128, bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="qla-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="*", default=None,
                    help="h_qk/h_v:NxL[:K[xV]], e.g. 2/8:1x32768 or 16/64:8x4096:100 (K = V = 128 by default); "
                         "default: the baseline table's nine rows (--decode: DECODE_ROWS)")
    ap.add_argument("--plot", metavar="PNG", help="save a bar chart of the GPU times")
    ap.add_argument("--cp", type=lambda x: x if x == "auto" else int(x), metavar="SEGMENTS",
                    help="also time qla with context parallelism, each sequence in SEGMENTS segments "
                         "(qla-cpS; qla itself runs the op's default, \"auto\": as many as the planner, "
                         "kernels/cp_plan.py, finds fastest; --cp 1 times the uncut call)")
    ap.add_argument("--only", nargs="*", metavar="LIB",
                    help="time only these (qla, qla-cpS, qla-cut-fused, FLA, FlashQLA; a peer left out is not "
                         "imported); default: all")
    ap.add_argument("--scan-stages", type=int, metavar="N",
                    help="pipeline stages of the scan kernel's loads (default: kernels/forward.py's scan_stages)")
    ap.add_argument("--backward", action="store_true", help="time forward + backward (a training step)")
    ap.add_argument("--fused", action="store_true",
                    help="also time the fused, warp-specialised forward (qla-fused; with --backward, training "
                         "steps whose forward is the fused training forward)")
    ap.add_argument("--cut-fused", action="store_true",
                    help="also time qla with context parallelism's segments on the fused kernels as a whole call of "
                         "them would run: inference on the wide kernel where it fills the GPU, planned so; training "
                         "on the fused training forward (qla-cut-fused; kernels/forward.cut_wide, cut_fused_training)")
    ap.add_argument("--decode", action="store_true",
                    help="time the token step (op.recurrent) beside FLA's fused_recurrent_gated_delta_rule; "
                         "rows default to batches of 1, 32 and 256 one-token sequences")
    ap.add_argument("--block-v", type=int, choices=(16, 32, 64),
                    help="the scan's V-block, for every row (default: kernels/forward.py's block_v choice)")
    ap.add_argument("--beta-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="β's dtype (g stays float32): bfloat16 as vLLM passes it")
    ap.add_argument("--spec", choices=SPECS, default="gdn",
                    help="the op to time beside FLA's: gdn (default), gla or kda (per-key gates)")
    args = ap.parse_args(argv)
    if args.spec != "gdn" and args.decode:
        ap.error("--decode times GDN's token step only")
    from qla_compiler.kernels import forward

    rows = args.rows or (DECODE_ROWS if args.decode else ROWS)
    with forward.launch_policy(scan_stages=args.scan_stages, block_v=args.block_v):
        run(rows, args.plot, args.cp, args.only, args.backward, args.decode, args.fused, args.spec, args.beta_dtype,
            args.cut_fused)
    return 0


if __name__ == "__main__":
    sys.exit(main())
