"""The host time of each kernel launch of a training step: every launch of one step caught, then each
launched 50 times back to back (no synchronisation between) and timed on the host.

    python benchmarks/launch_overhead.py                    # GPU: GDN at 16/64:1x2048
    python benchmarks/launch_overhead.py --spec kda --row 16/16:1x4096
    python benchmarks/launch_overhead.py --peers    # FLA and FlashQLA imported first, as in qla-bench

Why (session 28): a 16/64:1x2048 training step took ~1 ms more host time on the H200 than its
Python accounts for: C-level time inside qla::run_kernels_backward that cProfile does not see, and
that a stubbed step on the development machine (torch 2.13) does not have. A TileLang kernel built
with the tvm_ffi backend converts each tensor argument to DLPack on every call. torch 2.13 gives
tvm_ffi a C exchange API for that (`torch.Tensor.__dlpack_c_exchange_api__`); without it, tvm_ffi
compiles an addon on first import or falls back to Python's DLPack protocol, tensor by tensor. The
node runs torch 2.11. The first lines say which the node has, and the table what a launch costs.
"""
import argparse
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="gdn")
    ap.add_argument("--row", default="16/64:1x2048")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--peers", action="store_true",
                    help="import FLA and FlashQLA first, as qla-bench does (session 29: the eager time of our "
                         "calls doubled in bench runs with them in the process)")
    a = ap.parse_args(argv)
    import torch

    if a.peers:
        import fla.ops.gated_delta_rule  # noqa: F401
        import flash_qla  # noqa: F401

    native = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    import tilelang  # noqa: F401  (tvm_ffi may install the exchange API on import)

    import qla_compiler
    from qla_compiler.bench import host_ms, make_inputs, parse_row, with_backward
    from qla_compiler.kernels import forward

    print(f"torch {torch.__version__}: DLPack C exchange API before tilelang's import {native}, after "
          f"{hasattr(torch.Tensor, '__dlpack_c_exchange_api__')}", flush=True)
    caught = []
    launch = forward.launch

    def catching(program, kernel, t, dims, scale, io, sizes, width, n_seqs):
        launch(program, kernel, t, dims, scale, io, sizes, width, n_seqs)
        plan = forward._launch_plan(program, kernel, dims, scale, io, t["chunk_map"].device, sizes, width, n_seqs)
        caught.append((kernel.name, plan.run, [t[n] for n in plan.names]))

    op = qla_compiler.compile(a.spec, target="sm90")
    step = with_backward(op)
    inputs = make_inputs(*parse_row(a.row), spec=a.spec)
    step(**inputs)  # compiled, warm
    torch.cuda.synchronize()
    forward.launch = catching
    try:
        step(**inputs)
        torch.cuda.synchronize()
    finally:
        forward.launch = launch

    print(f"{a.spec} {a.row}{' (FLA and FlashQLA imported)' if a.peers else ''}: host time to the return, "
          f"median: a training step {host_ms(lambda: step(**inputs))[0]:.3f} ms, "
          f"an inference call {host_ms(lambda: op(**inputs))[0]:.3f} ms")
    total = 0.0
    for name, run, args in caught:
        n = sum(torch.is_tensor(x) for x in args)
        run(*args)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.reps):
            run(*args)
        us = (time.perf_counter() - t0) / a.reps * 1e6
        torch.cuda.synchronize()
        total += us
        print(f"  {name:<40} {n:3d} tensors  {us:8.1f} µs a launch on the host", flush=True)
    print(f"  {'all launches':<40} {'':13} {total:8.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
