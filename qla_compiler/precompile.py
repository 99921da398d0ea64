"""Warm-up: compile ahead of time the kernels a deployment's calls will launch, so that no call
compiles (TileLang's nvcc runs take seconds per kernel) at serve time.

A deployment is described by its head counts and dims, its io dtype and, optionally, the numbers
of sequences per call (N; by default every number) and its context parallelism (by default as the
op's default, "auto", plans it: the segment scans of every count the plan may choose; `cp=1`
none): the shape classes
its calls launch follow from the runtime's own launch rules (kernels/forward.scan_class; the
V-block and the scan's warpgroups depend on N through the SM count). Everything is compiled into
the on-disk caches (`$QLA_CACHE_DIR`, `$TILELANG_CACHE_DIR`: kernels/runtime.py); TileLang needs
no GPU for it, so a CPU machine can fill the cache that the GPU machines then read. A later
process finds every kernel there and compiles nothing; running the same warm-up at its start-up
also loads them (and the spec's compile), so its first call does no host-side compiling either.

    qla-compile gdn --precompile H=16,HV=64,K=128,V=128,io=bfloat16 [--training]

    >>> import qla_compiler
    >>> [(s.part, s.shape.BV) for s in shape_classes("gdn", H=2, HV=8, K=128, n_seqs=[1, 8], context_parallel=1)
    ...  if s.part == "forward"]
    [('forward', 16), ('forward', 64)]
    >>> sorted({(s.shape.BV, s.shape.gates, s.shape.scalars) for s in shape_classes("gdn", H=2, HV=8, K=128)
    ...         if s.part == "token_step"})[:3]  # (V-blocks 8 and 16; g and β each in float32 or bf16)
    [(8, 'bfloat16', 'bfloat16'), (8, 'bfloat16', 'float32'), (8, 'float32', 'bfloat16')]
    >>> sorted({s.kernels for s in shape_classes("gdn", H=2, HV=8, K=128, n_seqs=[1, 8])})  # the default cuts one
    ['all', 'parallel', 'scan', 'windows']
    >>> qla_compiler.warmup("gdn", [dict(H=2, HV=8, K=128, V=128)])     # doctest: +SKIP
    [1/6] gdn_prep     forward H=2 HV=8 K=128 V=128 BV=16 bfloat16: compiled in 4.1s
    ...
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from .passes.lower_tilelang import HEAD_DIM_RANGE, ShapeClass, tile_width

PARTS = ("forward", "training", "backward", "token_step")  # the program: as inference runs it; a training
# step's two; the token step decoding calls run (op.recurrent, and decode-shaped chunk calls)
FIELDS = ("H", "HV", "K", "V", "io", "N", "cp", "T", "sms", "state")


@dataclass(frozen=True)
class Compile:
    """One shape class of one of a spec's programs to compile: `part` names the program (the
    forward, a training step's forward or backward, or the token step), `shape` the class its kernels are
    launched at, `runs_as` the call's class without context parallelism (it picks the program's
    variant: Program.for_shape; None: the program as compiled), `kernels` which of its kernels
    run at this class: all, the scan alone, all but the scan (context parallelism runs the scan by
    segments, at classes of its own), or the scan walking the segments' windows (its first scan,
    Program.windows_program)."""
    spec: str
    part: str
    shape: ShapeClass
    runs_as: ShapeClass | None
    kernels: str = "all"  # | "scan" | "parallel" | "windows"
    # a backward on blocks of K's or V's columns (Program.backward_blocks): V's block width (0: the
    # backward of the whole problem)
    columns: int = 0
    # a call that runs the fused forward (kernels/forward.runs_fused; a training one, the fused
    # training forward where the launch policy says so): "narrow", or "wide" (kernels/forward.wide_fused);
    # "" where it runs the separate kernels. A backward's: "wide" where its grid fills the GPU at
    # V-block 128 (its scan on roles runs there, where the launch policy says so: kernels/backward)
    fused: str = ""


def shape_classes(spec, H: int, HV: int, K: int, V: int | None = None, io: str = "bfloat16", n_seqs=None,
                  context_parallel: int | str | None = "auto", sms: int | None = None, training: bool = False,
                  scale: float | None = None, stages: int | None = None, block_v: int | None = None,
                  tokens: int | None = None, state: str | None = "float32", plan: tuple | None = None) -> list:
    """What calls of `spec` with these heads and head dims launch, as a list of Compile: at each
    number of sequences in `n_seqs` (None: every number; the classes stop changing past the SM
    count), with `context_parallel` segments also the segment scans (as the op takes it: "auto", the
    default, or None: as many as kernels/cp_plan.py plans for calls of `tokens` tokens in all, which
    its plan depends on, or without `tokens` every count it may choose, cp_plan.SEGMENTS; 1: no cut), with
    `training` also the training forward and the backward. `sms`: the GPU's SMs (None: this
    machine's GPU, else an H200's). `scale`: the op's scale argument (None: K^-1/2). `stages`,
    `block_v`: what qla-bench --scan-stages and --block-v force instead of the launch rules.
    `state`: the dtype of the state pools decoding calls pass, whose token-step kernel is compiled
    too (None: no token step). A V wider than the kernels' tiles runs as blocks of its columns, a
    call each (op._run_kernels), and so does a K where the program splits over keys: their classes,
    with context parallelism planned at the whole head dims as the op plans it (`plan`: (K, V));
    the token step takes such a V whole (and no such K: those calls run the chunk kernels)."""
    from .context_parallel import check_segments
    from .kernels import forward
    from .kernels.backward import column_blocks
    from .kernels.cp_plan import SEGMENTS, may_choose, planned, walks_wide

    V = V or K
    plan = plan or (K, V)
    scale = K ** -0.5 if scale is None else float(scale)  # as the op passes it to every launch
    blocks = list(dict.fromkeys(_op_of(str(spec)).head_blocks(K, V)))
    if blocks != [(K, V)]:  # (the token step takes a wide V whole, and no wide K: those run the chunk kernels)
        steps = [Compile(str(spec), "token_step", c, None) for c in _token_step_classes(
            str(spec), H, HV, K, V, io, state, scale)] if state and K <= HEAD_DIM_RANGE[1] else []
        return list(dict.fromkeys([c for k, v in blocks for c in shape_classes(
            spec, H, HV, k, v, io, n_seqs, context_parallel, sms, training, scale, stages, block_v, tokens, None, plan)]
            + steps))
    if H < 1 or HV % H:
        raise ValueError(f"HV={HV}: the value heads must be a multiple of the H={H} query/key heads")
    forward.check_head_dims(K, V)
    check_segments(context_parallel, auto=True)
    if io not in forward.IO_DTYPES.values():
        raise ValueError(f"io: the kernels take {' or '.join(forward.IO_DTYPES.values())}, got {io!r}")
    if state not in (None, "float32", "bfloat16", "float16"):
        raise ValueError(f"state: the token step's pools are float32, bfloat16 or float16, got {state!r}")
    sms = sms or _this_gpus_sms()
    counts = range(1, sms + 2) if n_seqs is None else [n_seqs] if isinstance(n_seqs, int) else n_seqs
    pk, pv = plan  # (the head dims context parallelism is planned at)

    def launch(width, n, block_v_max=64, keys=K):
        # (as kernels/forward.shape_class: past 64 the wide fused kernel's rule)
        BV = min(block_v, tile_width(width)) if block_v else \
            forward.block_v(width, HV, n, sms, keys, widest=block_v_max) if block_v_max > 64 else None
        shape = forward.scan_class(H, HV, keys, width, n, io, sms, scale, BV=BV, block_v_max=block_v_max)
        return dataclasses.replace(shape, stages=stages) if stages else shape

    # (the plans of a captured or compiled call, an eager one, a captured and an eager training
    # step; each weighs the wide kernels' walks where cp_plan.walks_wide says so)
    kinds = [(None, walks_wide(False)), ("inference", walks_wide(False))]
    kinds += [(None, walks_wide(True)), ("training", walks_wide(True))] if training else []

    def segments(n):  # (as the op resolves "auto": kernels/cp_plan.planned_segments, for each of `kinds`)
        if context_parallel not in (None, "auto"):
            return [None if context_parallel == 1 else context_parallel]
        if not tokens:  # every count it may choose for some length: its choice is not monotone in
            # the length (4/16 heads: 2 segments between 2816 and 3968 tokens, 1 at 2048, 4 at 4096)
            return [None, *(s for s in SEGMENTS if s > 1 and forward.cuts(pk, pv) and
                            any(may_choose(s, n, HV, pk, pv, sms, wide) for _, wide in kinds))]
        return list(dict.fromkeys(planned(n, H, HV, pk, pv, tokens, sms, eager, wide) for eager, wide in kinds))

    classes, seqs = [], []  # as the separate kernels run them (a training step too); seqs: each
    # class's (sequences of the call, sequences its launches run: N·segments for a segment scan,
    # the call's segments)
    for n, cp in ((n, cp) for n in counts for cp in segments(n)):
        plain = launch(V, n)
        runs_as = dataclasses.replace(plain, scale=None)
        classes.append(Compile(str(spec), "forward", plain, runs_as, "parallel" if cp else "all"))
        seqs.append((n, n, cp))
        if cp:  # segments are scanned as sequences: their windows on [0 | v] (width K + V), then on v
            classes += [Compile(str(spec), "forward", launch(w, n * cp), runs_as, which)
                        for w, which in ((K + V, "windows"), (V, "scan"))]
            seqs += [(n, n * cp, cp)] * 2
    def fused(c, n, cp):  # c on the fused kernel, wide or narrow as kernels/forward._call_program takes it
        with forward.launch_policy(block_v=block_v):
            wide = forward.runs_wide(K, V, HV, n, sms, cp)
        return dataclasses.replace(c, fused="wide" if wide else "narrow")

    def capped(c, launched, cap):  # c at the V-blocks up to `cap` (its program's)
        return dataclasses.replace(c, shape=launch(c.shape.V, launched, cap)) if cap < c.shape.BV or cap > 64 else c

    out = []
    for c, (n, launched, cp) in zip(classes, seqs):  # an inference call: at the V-blocks its program takes
        # (kernels/forward._call_program: context parallelism decides on N·segments sequences,
        # and runs the fused kernel as its scan, the wide one where runs_wide says)
        if forward.runs_fused(K, V, HV, n * (cp or 1), sms):
            c = fused(c, n, cp)
        out.append(capped(c, launched, _program(c).kernels.block_v_max if c.kernels == "all" or c.fused
                          else c.shape.BV))
    if state:  # (both V-blocks, every gate and scalar dtype: any batch, any call: kernels/token_step.block_v)
        out += [Compile(str(spec), "token_step", c, None) for c in _token_step_classes(str(spec), H, HV, K, V, io, state, scale)]
    if training:
        for c, (n, launched, cp) in zip(classes, seqs):
            c = dataclasses.replace(c, part="training")
            # (kernels/forward._call_program: where the launch policy fuses training and an
            # inference call of this class runs fused, the fused training forward, at its V-blocks;
            # under a cut only where cut_fused_training says so, decided on N·segments sequences)
            if forward.POLICY.fused_training is not False and (not cp or forward.cut_fused_training()) \
                    and forward.runs_fused(K, V, HV, n * (cp or 1), sms):
                c = fused(c, n, cp)
                c = capped(c, launched, _program(c).kernels.block_v_max)
            out.append(c)
        for c, (n, launched, cp) in zip(classes, seqs):
            keys, width, _ = _variant(c).backward_blocks()

            def on_roles(k, v):  # (kernels/backward._backward: where the launch policy puts the scan
                # on roles, at V-block 128 where runs_wide says; under a cut, for N·segments sequences)
                if not forward.backward_scan_roles():
                    return ""
                with forward.launch_policy(block_v=block_v):
                    return "wide" if forward.runs_wide(k, v, HV, n, sms, cp) else ""
            if keys >= K and width >= V:
                back = dataclasses.replace(c, part="backward", fused=on_roles(K, V))
                out.append(capped(back, launched, _program(back).kernels.block_v_max))
                continue
            # each block is a problem of its own widths (the last one's may be narrower); a
            # context-parallel scan's widened values, K + V wide, are the block's K + V wide there
            for kw in dict.fromkeys(w for _, w in column_blocks(K, keys)):
                for w in dict.fromkeys(w for _, w in column_blocks(V, width)):
                    wide = w + (kw if c.shape.V > V else 0)
                    back = dataclasses.replace(c, part="backward", columns=width, fused=on_roles(kw, w),
                                               shape=launch(wide, launched, keys=kw))
                    cap = _program(back).kernels.block_v_max
                    out.append(dataclasses.replace(back, shape=launch(wide, launched, cap, keys=kw))
                               if cap < back.shape.BV or cap > 64 else back)
    return list(dict.fromkeys(out))


def parse_deployment(text: str) -> dict:
    """'H=16,HV=64,K=128,V=128,io=bfloat16[,N=1-64][,cp=auto, 8 or 1][,T=32768][,sms=132][,state=float32]' ->
    shape_classes' keywords (N: a number of sequences per call or a range a-b; V defaults to K;
    cp: as the op's context_parallel, "auto" when not given, 1 for calls that pass 1 (no cut);
    state: the decoding state pools' dtype, float32 when not given;
    T: a call's tokens in all, which cp=auto's plan depends on; without it, every count it may choose).

        >>> parse_deployment("H=2,HV=8,K=128,N=1-4,cp=8")
        {'H': 2, 'HV': 8, 'K': 128, 'n_seqs': [1, 2, 3, 4], 'context_parallel': 8}
        >>> parse_deployment("H=2,HV=8,K=128,N=1,cp=auto,T=32768")
        {'H': 2, 'HV': 8, 'K': 128, 'n_seqs': [1], 'context_parallel': 'auto', 'tokens': 32768}
    """
    from .checks import option_fields

    out = {}
    for key, value in option_fields(text, FIELDS, "--precompile"):
        try:
            if key == "io":
                if value not in ("bfloat16", "float16"):
                    raise ValueError(f"--precompile: io must be bfloat16 or float16, got {value!r}")
                out["io"] = value
            elif key == "state":
                if value not in ("float32", "bfloat16", "float16"):
                    raise ValueError(f"--precompile: state must be float32, bfloat16 or float16, got {value!r}")
                out["state"] = value
            elif key == "N":
                a, _, b = value.partition("-")
                out["n_seqs"] = list(range(int(a), int(b or a) + 1))
            elif key == "cp" and value == "auto":
                out["context_parallel"] = "auto"
            else:
                out[{"cp": "context_parallel", "T": "tokens"}.get(key, key)] = int(value)
        except ValueError as e:
            if str(e).startswith("--precompile"):
                raise
            raise ValueError(f"--precompile: {key} must be an integer{' or a range a-b' if key == 'N' else ''}, "
                             f"got {value!r}") from None
    missing = [f for f in ("H", "HV", "K") if f not in out]
    if missing:
        raise ValueError(f"--precompile: missing {', '.join(missing)} (e.g. H=16,HV=64,K=128,V=128,io=bfloat16)")
    return out


def compile_classes(todo: list, log=print) -> list:
    """Compile every kernel of each Compile into the on-disk caches, printing a line per kernel
    (compiled, or found in TileLang's cache). The kernels compile beside each other, a thread a
    core (runtime.Kernels.prefetch); the lines come in order. Returns (kernel, Compile, seconds,
    compiled) per kernel, seconds its own compile's."""
    from .kernels import segment_chain, window_search
    from .kernels.runtime import load_kernels

    done, total = [], sum(len(_kernel_names(c)) + 2 * (c.kernels == "windows") for c in todo)
    before = _tilelang_entries()
    started = []
    for c in todo:
        program = _program(c)
        if c.fused and c.part != "backward" and not any(k.warp_roles for k in program.kernels.kernels):
            # (the runtime's fallback, kernels/forward.fused_or_not, on errors.NotFusable: said
            # here, where a deployment would otherwise not learn that its class runs unfused)
            log(f"{c.spec} {c.fused} fused forward at H={c.shape.H} HV={c.shape.HV} K={c.shape.K} "
                f"V={c.shape.V}: not schedulable, the separate kernels instead")
        kernels = load_kernels(program, c.shape)
        names = _kernel_names(c, program)
        if hasattr(kernels, "prefetch"):
            kernels.prefetch(names, progress=False)
        started.append((c, program, kernels, names))
    for c, program, kernels, names in started:
        for name in names:
            t = time.time()
            compiled = _compiled_now(kernels.get(name, progress=False), before)
            done.append((name, c, getattr(kernels, "seconds", {}).get(name, time.time() - t), compiled))
            s = c.shape
            # (the token step's: the pools' dtype and the dtypes it reads gates and scalars in)
            reads = f" state={s.state} gates={s.gates} scalars={s.scalars}" if c.part == "token_step" else ""
            log(f"[{len(done)}/{total}] {name:<{max(len(name), 24)}} {c.part} H={s.H} HV={s.HV} K={s.K} V={s.V} "
                f"BV={s.BV} {s.io}{reads}: {'compiled' if compiled else 'cached'} in {done[-1][2]:.1f}s")
        if c.kernels == "windows":  # and what runs beside that scan: the search before, the chain after
            s, reverse = c.shape, program.kernels.kernels[0].reverse
            rev, V = "reverse " if reverse else "", s.V - s.K  # (the windows scan's state is [M | H]: K + V wide)
            for name, build, detail in (
                    ("window_search", lambda: window_search.compiled(window_search.kind(program.recurrence), s.H, s.HV,
                                                                     s.K, s.io, program.chunk_size, reverse),
                     f"H={s.H} HV={s.HV} K={s.K} {rev}{s.io}"),
                    ("segment_chain", lambda: segment_chain.compiled(s.K, V, reverse), f"K={s.K} V={V} {rev}".strip())):
                t = time.time()
                compiled = _compiled_now(build(), before)
                done.append((name, c, time.time() - t, compiled))
                log(f"[{len(done)}/{total}] {name:<24} {c.part} {detail}: {'compiled' if compiled else 'cached'} "
                    f"in {done[-1][2]:.1f}s")
    return done


def warmup(spec, shapes: list, training: bool = False, log=print) -> list:
    """Compile the kernels that calls of `spec` (a shipped spec's name, a spec file, or a compiled
    op) at each of `shapes` launch — each a dict of shape_classes' keywords or a string as
    parse_deployment reads it — into the on-disk caches; with `training` also what a training
    step runs. Returns what compile_classes returns.

        >>> warmup("gdn", ["H=16,HV=64,K=128,V=128,io=bfloat16"], training=True)   # doctest: +SKIP
    """
    spec = getattr(spec, "key", spec)  # a compiled op: by its key (custom_ops.register)
    todo = []
    for s in shapes:
        kw = parse_deployment(s) if isinstance(s, str) else dict(s)
        todo += shape_classes(spec, training=training, **kw)
    return compile_classes(list(dict.fromkeys(todo)), log)


_COMPILED: dict = {}  # spec file -> its op


def _variant(c: Compile):
    """The variant of the op's program the Compile's call runs (Program.for_shape), of the op the
    process calls (_op_of): the kernels it loads are then the ones that op's calls find in memory,
    not only on disk."""
    program = _op_of(c.spec).program
    return program.for_shape(c.runs_as) if c.runs_as is not None else program


def _op_of(spec: str):
    """The op the process calls for `spec`: a compiled op by its key, ops' shared op for a shipped
    spec, else one compiled here."""
    from . import ops
    from .compiler import compile as compile_op
    from .custom_ops import _OPS
    from .specs import NAMES

    if spec in _OPS:
        return _OPS[spec]
    if spec in NAMES:
        return ops._op(spec)
    return _COMPILED.get(spec) or _COMPILED.setdefault(spec, compile_op(spec))


def _program(c: Compile):
    """The program a Compile names: its variant's forward (as inference runs it), training
    forward or backward (on blocks of K's or V's columns, where c.columns says so)."""
    from .kernels import backward, forward

    program = _variant(c)
    if c.part == "token_step":
        return program.token_step_program
    # (a context-parallel class's backward runs the plain scan: backward.backward_program_of)
    if c.columns:
        program = backward.backward_program_of(program.backward_blocks()[2], segments=c.kernels != "all",
                                               wide=c.fused == "wide")
    elif c.part == "forward":  # what an inference call runs (a context-parallel one: its scan or the rest)
        program = forward.inference_program(program, fused=bool(c.fused), wide=c.fused == "wide")
    elif c.part == "training" and c.fused:  # (a fused training forward: the launch policy's fused_training)
        program = forward.fused_or_not(program, wide=c.fused == "wide", training=True)
    else:
        program = program.training_program if c.part == "training" else \
            backward.backward_program_of(program, segments=c.kernels != "all", wide=c.fused == "wide")
    return program.windows_program if c.kernels == "windows" else program


def _token_step_classes(spec: str, H: int, HV: int, K: int, V: int, io: str, state: str, scale: float) -> list:
    """The classes a decoding call's token step launches at, whatever its batch and its gates' and
    scalars' dtypes: one per V-block kernels/token_step.block_v chooses between and per dtype the
    kernel may read each of its per-call dtype fields in, float32 or the io dtype
    (token_step.read_dtypes; a spec without gates or without scalars has that field at float32
    only). (token_step.shape_class, from a call's dims and dtypes.)"""
    import itertools

    import torch

    from .checks import Dims
    from .kernels import token_step
    from .passes.lower_tilelang import PER_CALL_DTYPES

    dims = Dims(1, 1, H, HV, K, V, 1)
    (kernel,) = _variant(Compile(spec, "token_step", None, None)).token_step_program.kernels.kernels
    fields = [f for f in PER_CALL_DTYPES if any(p.dtype == f for p in kernel.params)]
    return [token_step.shape_class(dims, getattr(torch, io), getattr(torch, state), scale, 0, BV=bv,
                                   read_in=dict(zip(fields, dtypes)))
            for bv in token_step.V_BLOCKS
            for dtypes in itertools.product((torch.float32, getattr(torch, io)), repeat=len(fields))]


def _kernel_names(c: Compile, program=None) -> list:
    program = program or _program(c)
    return [k.name for k in program.kernels.kernels
            if c.kernels in ("all", "windows") or (c.kernels == "scan") == k.walks_chunks]


def _tilelang_entries() -> set:
    """The folders of TileLang's disk cache, a kernel's each (a compile adds one; a cache hit none)."""
    import tilelang

    root = Path(tilelang.env.TILELANG_CACHE_DIR)
    return {str(d) for d in root.rglob("*") if d.is_dir() and ".staging" not in d.parts} if root.exists() else set()


def _compiled_now(kernel, before: set) -> bool:
    """Whether `kernel` was compiled since TileLang's disk cache held the folders `before`, rather
    than read from it (TileLang 0.1.15 tags a kernel with its cache folder; with compiles beside
    each other, counting the cache's files no longer says whose a new one is). Its folder joins
    `before`: a later class whose kernel is the same one found it cached."""
    folder = getattr(kernel, "_tilelang_cache_path", None)
    if folder is None:
        return True
    new = str(Path(folder)) not in before
    before.add(str(Path(folder)))
    return new


def _this_gpus_sms() -> int:
    from .kernels import forward

    try:
        import torch

        if torch.cuda.is_available():
            return forward.sm_count(torch.device("cuda"))
    except ImportError:
        pass
    return forward.H200_SMS
