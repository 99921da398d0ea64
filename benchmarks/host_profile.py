"""Where a call's host time goes: torch.profiler with CPU activities over qla-bench calls, the top
host-side entries by self CPU time per call, the synchronisations among them, and the call's
wall time with and without a synchronisation after it.

    python benchmarks/host_profile.py --row 2/8:1x32768 --cp auto      # GPU
    python benchmarks/host_profile.py --row 16/64:1x2048 --cp 1 --backward

It first runs one call under torch.cuda.set_sync_debug_mode("error") and prints where the first
synchronisation of the host is, if any: a synchronisation would make a call's host time its GPU
time plus its Python (session 29 found none, in an inference call or a training step). Then each
call's host time alone (to its return, no synchronisation after it), which is what an eager caller
pays when the GPU keeps up.

Why (session 23): with context_parallel="auto" a 2/8:1x32768 forward took 1.23 ms eager for
0.38 ms of GPU time, where 35 aten ops on meta tensors with no-op kernels take 0.31 ms of host
time on the development machine: ~0.5 ms is somewhere the CPU tests do not see.
"""
import argparse
import sys
import time
import traceback


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--row", default="2/8:1x32768")
    ap.add_argument("--cp", default="auto", help="context_parallel: auto, or a segment count (1: no cut)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--backward", action="store_true", help="a training step (forward and backward)")
    a = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from qla_compiler import ops
    from qla_compiler.bench import host_ms, make_inputs, parse_row, with_backward

    H, HV, lens = parse_row(a.row)
    args = make_inputs(H, HV, lens)
    cp = a.cp if a.cp == "auto" else int(a.cp)

    def forward(**a):
        return ops.chunk_gated_delta_rule(**a, context_parallel=cp)

    step = with_backward(forward) if a.backward else forward

    def call():
        return step(**args)

    for _ in range(3):  # compiles, plans, layouts: made once
        call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
        print("synchronisation check: the call never synchronised the host")
    except RuntimeError as e:
        print(f"synchronisation check: the call synchronised the host ({str(e).splitlines()[0]}), at:")
        traceback.print_exc(limit=-8, file=sys.stdout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    iters = 20
    median, least = host_ms(call, iters)
    print(f"{a.row} cp={a.cp}: host time to the call's return, from an idle GPU: median {median:.3f} ms, "
          f"min {least:.3f}")
    for synced in (False, True):
        t = time.perf_counter()
        for _ in range(iters):
            call()
            if synced:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        print(f"{a.row} cp={a.cp}: {(time.perf_counter() - t) / iters * 1e3:.3f} ms a call "
              f"({'synchronised after each' if synced else 'back to back'})")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    print(f"top {a.top} host entries, self CPU µs per call (count per call):")
    for e in rows[:a.top]:
        print(f"  {e.self_cpu_time_total / iters:9.1f}  ({e.count / iters:5.1f})  {e.key[:100]}")
    syncs = [e for e in rows if "synchron" in e.key.lower() or e.key in ("aten::item", "aten::_local_scalar_dense")]
    print("synchronisations:", ", ".join(f"{e.key} ×{e.count / iters:.1f}" for e in syncs) or "none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
