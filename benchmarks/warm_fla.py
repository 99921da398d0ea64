"""Compile FLA's Triton kernels for tests/test_gpu_real_data.py before the tests run, one process per
family of calls, all at once.

Each real-data case runs FLA's chunk_gated_delta_rule forward and backward beside ours. Triton
compiles every autotuning config of every FLA kernel once per specialisation (io dtype, head dims,
packed or dense, gates in float32 or in the io dtype), and the file ran past 300 s on the H200 in
sessions 25 and 26 (a single case past 150 s; `~/.triton/cache` held 484 MB afterwards). Under
xdist, the workers that start cases of one family compile the same kernels at the same time. Here
each family compiles once, in a process of its own, in parallel with the others. Triton's disk
cache, and FLA's cached autotuning results (FLA_CACHE_RESULTS, on by default), then serve the
workers.

    python3 benchmarks/warm_fla.py            # on the GPU node, before pytest tests/test_gpu_real_data.py
    python3 benchmarks/warm_fla.py --per-key  # before tests/test_gpu_per_key.py (FLA's chunk_gla, chunk_kda)
    python3 benchmarks/warm_fla.py --list     # the families, nothing run

The families come from the test file itself (its cases' dtypes, head dims, layouts and flags),
so they follow it when it changes.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _tests(name: str = "test_gpu_real_data"):
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def families() -> list:
    """(io dtype name, K, V, dense, l2norm, small_in_io) of every kind of FLA call the tests make,
    each once."""
    mod = _tests()
    out = []
    for case in mod.DATA_CASES.values():
        for dtype in mod.DTYPES:
            out.append((dtype, 128, 128, bool(case.get("dense_B")), bool(case.get("l2norm")),
                        bool(case.get("small_in_io"))))
    out += [("bf16", K, V, False, False, False) for K, V in mod.HEAD_DIM_CASES]
    return list(dict.fromkeys(out))


def per_key_families() -> list:
    """(spec, K, V, initial state) of every kind of FLA call tests/test_gpu_per_key.py makes: its
    cases with and without an initial state at K = V = 128, and GLA's wide heads. (Session 38: that
    file ran past 480 s on the H100 without a result, FLA's Triton kernels compiling inside it.)"""
    mod = _tests("test_gpu_per_key")
    states = sorted({case.get("initial_state", True) for case in mod.CASES.values()})
    out = [(spec, 128, 128, state) for spec in ("gla", "kda") for state in states]
    return out + [("gla", K, V, True) for K, V in ((256, 256), (256, 512))]


def warm(family: tuple) -> str:
    """One family's forward and backward through FLA, on the test file's own input maker; what went
    wrong, as a line, where it failed (one family's failure stops neither the others nor the pool:
    pytest.fail, where FLA does not import, is a BaseException)."""
    try:
        return _warm(family)
    except BaseException as e:  # noqa: BLE001 (reported, not raised: see the docstring)
        return f"{family}: FAILED {type(e).__name__}: {e}"


def _warm(family: tuple) -> str:
    import torch

    if isinstance(family[0], str) and family[0] in ("gla", "kda"):
        return _warm_per_key(family)
    dtype, K, V, dense, l2norm, small_in_io = family
    mod = _tests()
    lens = [130] if dense else [100, 1, 77]
    args = mod.make_inputs(lens=lens, K=K, V=V, dtype=mod.DTYPES[dtype], keys="uniform", gate="fla",
                           dense_B=2 if dense else None, small_in_io=small_in_io, l2norm=l2norm)
    fla_args = {n: (x.long() if n == "cu_seqlens" else x) for n, x in args.items()}
    t = time.time()
    mod._run(mod._fla(), fla_args, mod._cotangents(args), l2norm)
    torch.cuda.synchronize()
    return f"{family}: {time.time() - t:.1f} s"


def _warm_per_key(family: tuple) -> str:
    """One per-key family: FLA's op forward and backward on the per-key test file's inputs."""
    import torch

    import qla_compiler

    spec, K, V, state = family
    mod = _tests("test_gpu_per_key")
    args = mod.make_inputs(qla_compiler.compile(spec, target="sm90"), lens=[100, 1, 77], K=K, V=V,
                           initial_state=state)
    args = {n: (x.long() if n == "cu_seqlens" else x.detach().clone().requires_grad_()
                if torch.is_tensor(x) and x.is_floating_point() else x) for n, x in args.items()}
    t = time.time()
    o, s = mod._fla(spec)(**args)
    torch.autograd.backward([o, s], [torch.ones_like(o), torch.ones_like(s)])
    torch.cuda.synchronize()
    return f"{family}: {time.time() - t:.1f} s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the families and stop")
    ap.add_argument("--processes", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--per-key", action="store_true", help="tests/test_gpu_per_key.py's calls instead")
    args = ap.parse_args()
    todo = per_key_families() if args.per_key else families()
    if args.list:
        print("\n".join(map(str, todo)))
        return 0
    import multiprocessing as mp

    os.environ.setdefault("FLA_FLASH_QLA", "0")  # (as the tests: FLA's own kernels)
    t = time.time()
    with mp.get_context("spawn").Pool(min(args.processes, len(todo))) as pool:
        for line in pool.imap_unordered(warm, todo):
            print(line, flush=True)
    print(f"{len(todo)} families in {time.time() - t:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
