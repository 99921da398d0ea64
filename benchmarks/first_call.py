"""Issue 19's serving numbers on the GPU: the first call's time with cold caches, after
`qla_compiler.warmup` in another process (warm: no compile at serve time), and where the host time
of a steady-state call goes.

    python benchmarks/first_call.py            # cold, warmed, warm first calls; a host profile
    python benchmarks/first_call.py --profile  # the host profile alone (the first calls take minutes)
    python benchmarks/first_call.py --training # the host profile of a training step (forward + backward)
    python benchmarks/first_call.py --training --row 2/8:1x8192 --cp auto   # one row, context_parallel

Each first call runs in a fresh process (the kernels cached in memory would hide the disk cache):
  cold    empty caches: the spec's compile, the lowering and TileLang's compiles, then the launch;
  warmed  a process ran warmup(...) for the deployment first; this one finds every kernel on disk;
then, in this process, where the host time of a steady-state call goes (16/64 × 2048 tokens, and
a one-token decode step at 16/64): Python's profile and torch.profiler's CPU view (issue 19, item 5).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import time

DEPLOYMENT = "H=16,HV=64,K=128,V=128,io=bfloat16,N=1"
ROW = "16/64:1x2048"


def _call_once() -> float:
    """In this process: one forward at ROW; its wall time (s), compile included."""
    import torch

    from qla_compiler import ops
    from qla_compiler.bench import make_inputs, parse_row

    H, HV, lens = parse_row(ROW)
    args = make_inputs(H, HV, lens)
    torch.cuda.synchronize()
    t = time.perf_counter()
    ops.chunk_gated_delta_rule(**args)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def _in_fresh_process(code: str, env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def first_calls() -> None:
    caches = tempfile.mkdtemp(prefix="qla-first-call-")
    env = dict(os.environ, TILELANG_CACHE_DIR=os.path.join(caches, "tl"), QLA_CACHE_DIR=os.path.join(caches, "qla"))
    call = "import sys; sys.path.insert(0, 'benchmarks'); import first_call; print(first_call._call_once())"
    cold = float(_in_fresh_process(call, env))
    again = float(_in_fresh_process(call, env))  # the same caches, now filled by the cold call
    t = time.perf_counter()
    _in_fresh_process(f"import qla_compiler; qla_compiler.warmup('gdn', ['{DEPLOYMENT}']); print(0)",
                      dict(env, TILELANG_CACHE_DIR=os.path.join(caches, "tl2"), QLA_CACHE_DIR=os.path.join(caches, "qla2")))
    warmup_s = time.perf_counter() - t
    warmed = float(_in_fresh_process(call, dict(env, TILELANG_CACHE_DIR=os.path.join(caches, "tl2"),
                                                QLA_CACHE_DIR=os.path.join(caches, "qla2"))))
    print(f"{ROW}: first call cold {cold:.2f} s; a second process on its caches {again:.2f} s; "
          f"warmup('{DEPLOYMENT}') {warmup_s:.1f} s, then a first call {warmed:.2f} s")


def host_profile(row: str = ROW, decode: bool = False, training: bool = False, cp=None) -> None:
    """Where a steady-state call's host time goes: the wall time per call beside the GPU's, then
    Python's profile (cProfile, which sees TileLang's launch path and torch's dispatch as frames)
    and torch.profiler's CPU view of the ops it launches. `training`: a training step (qla-bench
    --backward's), whose eager time was 4.66 ms against 0.87 ms of GPU time at 16/64:1x2048 in
    session 26 (session 8: 1.38); session 27 found most of it in a graph walk every call made and
    took it to 1.39 ms. `cp`: the call's context_parallel."""
    import cProfile
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile

    from qla_compiler import ops
    from qla_compiler.bench import make_inputs, parse_row, with_backward

    H, HV, lens = parse_row(row)
    args = make_inputs(H, HV, lens)
    fn = ops.fused_recurrent_gated_delta_rule if decode else ops.chunk_gated_delta_rule
    if cp is not None:
        fn = functools.partial(fn, context_parallel=cp)
    fn = with_backward(fn) if training else fn
    for _ in range(3):
        fn(**args)
    torch.cuda.synchronize()
    n = 200
    t = time.perf_counter()
    for _ in range(n):
        fn(**args)
    torch.cuda.synchronize()
    print(f"{row} {'token step' if decode else 'training step' if training else 'chunk op'}: {(time.perf_counter() - t) / n * 1e3:.3f} ms a call, "
          "host-bound where the GPU time is shorter")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn(**args)
    torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(20)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(20):
            fn(**args)
        torch.cuda.synchronize()
    print(prof.key_averages(group_by_stack_n=4).table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    if "--training" in sys.argv[1:]:
        if "--row" in sys.argv:
            cp = sys.argv[sys.argv.index("--cp") + 1] if "--cp" in sys.argv else None
            host_profile(sys.argv[sys.argv.index("--row") + 1], training=True,
                         cp=int(cp) if cp and cp.isdigit() else cp)
        else:
            host_profile(training=True)
            host_profile("2/8:1x32768", training=True)
        sys.exit()
    if "--profile" not in sys.argv[1:]:
        first_calls()
    host_profile()
    host_profile("16/64:1x1", decode=True)  # a decode step: 0.47 ms eager against 0.008 on the GPU
