"""Compiling, caching and loading the generated kernels.

The lowering writes one TileLang module per (program, shape class) under the cache directory —
`$QLA_CACHE_DIR`, else `$TILELANG_CACHE_DIR/qla`, else `~/.cache/qla` — named by a hash of
everything that determines it (spec, passes' output, shape class, versions), so a second process
finds it. TileLang caches the compiled binaries under its own `TILELANG_CACHE_DIR`. Compiling
prints progress to stderr: the first call of a new shape class takes tens of seconds.

    >>> kernels = load_kernels(program, ShapeClass(H=2, HV=8, K=128, V=128))   # doctest: +SKIP
    >>> kernels["gdn_scan"](q, k, v, ...)                                       # doctest: +SKIP
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import importlib.util
import os
import sys
import time
from pathlib import Path

from qla_compiler.passes.lower_tilelang import ShapeClass, lower

_LOADED: dict = {}  # (id of the KernelIR, shape class) -> Kernels
_KEEP: list = []
# An explicit sm_90a target and the tvm_ffi backend make TileLang's cache key the same on a machine
# without a GPU, so kernels can be compiled ahead of time and the cache carried to the GPU.
TARGET = {"kind": "cuda", "arch": "sm_90a"}
BACKEND = "tvm_ffi"


def cache_dir() -> Path:
    if os.environ.get("QLA_CACHE_DIR"):
        return Path(os.environ["QLA_CACHE_DIR"])
    if os.environ.get("TILELANG_CACHE_DIR"):
        return Path(os.environ["TILELANG_CACHE_DIR"]) / "qla"
    return Path.home() / ".cache" / "qla"


def module_source(program, shape: ShapeClass) -> str:
    return lower(program.kernels, shape, program.path)


def cache_key(source: str) -> str:
    """The module's name: its source bakes in the shape class, so the source is the key."""
    import tilelang

    from qla_compiler import __version__

    h = hashlib.sha256()
    for part in (source, tilelang.__version__, __version__):
        h.update(part.encode())
    return h.hexdigest()[:16]


def write_module(program, shape: ShapeClass) -> Path:
    """The generated TileLang module on disk (TileLang reads kernel source with `inspect`)."""
    return write_source(program.kernels.name, module_source(program, shape))


def write_source(name: str, source: str) -> Path:
    """A TileLang module's source on disk under the cache, named by its hash."""
    key = cache_key(source)
    path = cache_dir() / f"{name}_{key}.py"
    if not path.exists() or path.read_text() != source:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(source)
        tmp.replace(path)
    return path


def import_module(path: Path):
    name = f"qla_generated_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def _compiling_threads() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that compile kernels beside each other (made on first use): TileLang's lowering
    releases the GIL and nvcc is a process of its own, so n kernels take about the longest one's
    time on n cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return concurrent.futures.ThreadPoolExecutor(max(1, cores), "qla-compile")


class Kernels:
    """The compiled kernels of one (program, shape class), by name; each is compiled (or fetched
    from the caches) on first use, so a class only some kernels run at (context parallelism's
    widened scan) compiles only those. `prefetch` starts several compiling at once."""

    def __init__(self, program, shape: ShapeClass):
        self.shape, self._compiled = shape, {}
        self._pending: dict = {}  # name -> the future of a compile under way (prefetch)
        self.seconds: dict = {}  # name -> how long its compile (or cache read) took
        self.path = write_module(program, shape)
        self._module = import_module(self.path)

    def __getitem__(self, name: str):
        return self.get(name)

    def prefetch(self, names, progress: bool = True) -> None:
        """Start compiling the kernels `names` (those not compiled, nor under way) beside each
        other, on threads; `get` waits for each. A first call launches its kernels in order, and
        without this compiled them one after another."""
        for name in names:
            if name not in self._compiled and name not in self._pending:
                self._pending[name] = _compiling_threads().submit(self._compile, name, progress)

    def get(self, name: str, progress: bool = True):
        """The kernel `name`, compiled (or read from TileLang's cache) on first use; `progress`:
        print a line to stderr before and after (the warm-up prints its own)."""
        if name not in self._compiled:
            pending = self._pending.pop(name, None)
            self._compiled[name] = pending.result() if pending is not None else self._compile(name, progress)
        return self._compiled[name]

    def _compile(self, name: str, progress: bool):
        s, t = self.shape, time.time()
        kernel = compile_prim(getattr(self._module, name), name, f"H={s.H} HV={s.HV} K={s.K} V={s.V} BV={s.BV} {s.io}",
                              self.path, progress)
        self.seconds[name] = time.time() - t
        return kernel


def compile_prim(func, name: str, detail: str, path: Path, progress: bool = True):
    """A TileLang prim_func compiled for sm_90a (or read from TileLang's cache); `progress`: a line
    to stderr before and after, naming it and `detail` (its class), and the module's `path`."""
    import logging

    import tilelang

    # TileLang logs every compile and cache hit; qla prints its own progress line instead
    logging.getLogger("tilelang").setLevel(logging.ERROR)
    t = time.time()
    if progress:
        print(f"qla: compiling {name} ({detail}) ...", file=sys.stderr, flush=True)
    kernel = tilelang.compile(func, target=TARGET, execution_backend=BACKEND)
    if progress:
        print(f"qla: {name} ready in {time.time() - t:.1f}s  ({path})", file=sys.stderr, flush=True)
    return kernel


def load_kernels(program, shape: ShapeClass) -> Kernels:
    """The program's kernels for this shape class (compiled on first use)."""
    key = (id(program.kernels), shape)  # the hot path: no lowering, no file access
    if key not in _LOADED:
        _LOADED[key] = Kernels(program, shape)
        _KEEP.append(program.kernels)  # keeps id(program.kernels) from being reused while cached
    return _LOADED[key]


def lower_to_cuda(program, shape: ShapeClass) -> dict:
    """CUDA C++ source of every kernel for sm_90a, without a GPU (used by --emit cuda and CI)."""
    return {name: artifact.kernel_source for name, artifact in _lowered(program, shape).items()}


def launch_shared_bytes(program, shape: ShapeClass) -> dict:
    """The dynamic shared memory each kernel asks at launch, as TileLang placed its blocks, without
    a GPU (what schedule_memory.packed_shared estimates; a launch asking more than a CTA may fails)."""
    return {name: max(int(f.attrs.get("dyn_shared_memory_buf", 0)) for f in artifact.device_mod.functions.values())
            for name, artifact in _lowered(program, shape).items()}


def _lowered(program, shape: ShapeClass) -> dict:
    """Each kernel's TileLang artifact, lowered for sm_90a on the CPU."""
    import tilelang
    from tvm.target import Target

    mod = import_module(write_module(program, shape))
    with Target(TARGET) as target:
        return {k.name: tilelang.lower(getattr(mod, k.name), target=target) for k in program.kernels.kernels}
