"""The forward pass on the GPU: lay the inputs out as the kernels expect, launch them in order.

Everything here is shape arithmetic and torch ops on the device: no value is read back to the
host, so a call can be captured in a CUDA graph and replayed with new inputs.
Dense batches [B, T, ...] are viewed as one packed batch [1, B·T, ...] with cu_seqlens = T·[0..B].
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch

from qla_compiler.context_parallel import chain_starts, contraction_logs, run_segments, segment_layout, window_skips
from qla_compiler.layout import TensorMemo, chunk_offsets, packed_cu_seqlens
from qla_compiler.passes.lower_tilelang import ShapeClass, check_head_dim, one_launch_axis, tile_width
from qla_compiler.passes.walk_skip import widened

from . import segment_chain, window_search
from .runtime import load_kernels

IO_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
# an H200's SMs: what the tools that choose classes without a GPU assume (qla-compile --shape,
# benchmarks/precompile.py, benchmarks/ablate.py)
H200_SMS = 132

@dataclass(frozen=True)
class LaunchPolicy:
    """The launch choices a caller makes instead of the rules below (launch_policy sets them for
    a block of calls): `sms` the SM count the rules see (None: the device's), `block_v` the scans'
    V-block (None: block_v's rule), `scan_stages` the scan's pipeline stages (None: scan_stages'
    rule), `fused` whether inference calls run the fused, warp-specialised forward
    (passes/schedule_fused.py; None: where it pays, fused_pays; QLA_FUSED_FORWARD=1 or 0 sets it
    for the process), `kernels` what loads a program's kernels for a shape class (None: the
    compiled ones, runtime.load_kernels; the emulator stands in on the CPU), `poison` a value
    every tensor a launch allocates is filled with before its kernel runs (None: left as
    torch.empty leaves it). A kernel that leaves part of an output unwritten, read by a later one,
    then gives results that depend on the value (tests/test_gpu_unwritten_memory.py).
    `token_block_v` the token step's V-block (None: kernels/token_step.block_v's rule). `wide`
    whether a fused call runs the wide fused kernel, and a backward with its scan on roles the
    wide scan (None: runs_wide's rule). `window_search` and
    `segment_chain` what runs context parallelism's two helper steps, with _window_search's and
    _segment_chain's signatures (None: their kernels on the GPU, else their torch definitions).
    `fused_training` whether a training call runs the fused training forward
    (Program.fused_training_program) where an inference call of its shape runs the fused one
    (None or True: it does, 12 % off a GDN training step on the H100 and as accurate or more in
    every output and gradient, benchmarks/NOTES.md session 44; False: the training program's
    separate kernels, as QLA_FUSED_TRAINING=0 sets it for the process). `backward_scan_roles`
    whether a backward runs its scan warp-specialised: True, everywhere it can
    (Program.backward_roles_program, or backward_wide_roles_program where runs_wide says); "wide",
    only the wide one, where runs_wide says (a CTA per value head and sequence), the plain scan
    kernel elsewhere; False, the plain scan kernel everywhere; None, BACKWARD_SCAN_ROLES's choice.
    QLA_BACKWARD_SCAN_ROLES=1, wide or 0 sets it for the process. `cut_wide` whether a
    context-parallel inference call may walk its segments on the wide fused kernel (runs_wide;
    None: CUT_WIDE's choice; QLA_CUT_WIDE=1 or 0 sets it for the process). `cut_fused_training`
    whether a context-parallel training call runs the fused training forward where a call of its
    N·segments sequences would (None: CUT_FUSED_TRAINING's choice; QLA_CUT_FUSED_TRAINING=1 or 0)."""
    sms: int | None = None
    block_v: int | None = None
    token_block_v: int | None = None
    scan_stages: int | None = None
    fused: bool | None = None
    wide: bool | None = None
    kernels: Callable | None = None
    window_search: Callable | None = None
    segment_chain: Callable | None = None
    poison: float | None = None
    fused_training: bool | None = None
    backward_scan_roles: bool | str | None = None
    cut_wide: bool | None = None
    cut_fused_training: bool | None = None


_SWITCH = {"1": True, "0": False}
POLICY = LaunchPolicy(fused=_SWITCH.get(os.environ.get("QLA_FUSED_FORWARD", "")),
                      fused_training=_SWITCH.get(os.environ.get("QLA_FUSED_TRAINING", "")),
                      backward_scan_roles={**_SWITCH, "wide": "wide"}.get(os.environ.get("QLA_BACKWARD_SCAN_ROLES", "")),
                      cut_wide=_SWITCH.get(os.environ.get("QLA_CUT_WIDE", "")),
                      cut_fused_training=_SWITCH.get(os.environ.get("QLA_CUT_FUSED_TRAINING", "")))
# A backward's scan where the policy leaves it None: the whole-V one on roles where runs_wide says,
# else the plain kernel. On the H100 (NOTES session 47) the GDN training step 11.09 → 10.37 ms at
# 16/64:8x4096 (the scan 2.00 → 1.29, the out kernel the plain one) and 2.81 → 2.62 at
# 4/16:8x4096, the peak unchanged. The narrow scan on roles is no faster at V-block 32 and 0.5 GiB
# heavier (session 45): not by default.
BACKWARD_SCAN_ROLES = "wide"
# Whether a context-parallel inference call walks its N·segments sequences on the wide fused
# kernel where wide_fused's rule holds for them (the policy's cut_wide left None). FlashQLA's fused
# kernel at 8/32:1x32768 (0.391 ms, H200) fits 4 segments walked at V-block 128; ours cuts in 2 at
# 64 (0.55 ms). The planner weighs the wide walk too (kernels/cp_plan.py, Costs.wide_chunk). A
# cut training call's backward then walks the whole-V scan on roles there too (its windows
# program), as an uncut call's does. Off until timed on the GPU (NOTES session 54).
CUT_WIDE = False
# Whether a context-parallel training call's forward is the fused training forward where an
# uncut call of its N·segments sequences runs it (the policy's cut_fused_training left None): its
# windows and walks store what the backward reads as the uncut one does, and the separate out
# kernel goes (12 % off an uncut GDN step at 16/64:8x4096 on the H100, session 44). Off until
# timed on the GPU (NOTES session 54).
CUT_FUSED_TRAINING = False


@contextlib.contextmanager
def launch_policy(**choices):
    """Within it, calls launch with these LaunchPolicy fields changed (qla-bench --block-v,
    --scan-stages and --fused, the emulator).

        >>> with launch_policy(block_v=64):
        ...     choose_block_v(128, 8, 1, None)
        64
    """
    global POLICY
    before, POLICY = POLICY, dataclasses.replace(POLICY, **choices)
    try:
        yield POLICY
    finally:
        POLICY = before


def scan_stages(BV: int) -> int:
    """Buffers per load of the scan's pipeline: the producer fetches up to stages − 1 chunks ahead
    (a scan whose shared memory holds fewer takes fewer: Kernel.max_stages).

    The narrower a V-block, the less work a chunk holds against the same loads (k and W do not
    narrow), so the loads must run further ahead. Forward scans on the H200 (session 8): at BV =
    16 and 32, 4 stages were 5-10% faster than 3 (2/8, 4/16, 8/32 heads); at 64, 3 were 7-16%
    faster than 2 (16/64) and 1% faster than 4.

    >>> scan_stages(16), scan_stages(32), scan_stages(64)
    (4, 4, 3)
    """
    return POLICY.scan_stages or (4 if BV <= 32 else 3)


def check_head_dims(K: int, V: int) -> None:
    check_head_dim("K (the key head dim)", K)
    check_head_dim("V (the value head dim)", V)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """The SMs of the GPU a CUDA device names (the launch rules below depend on it)."""
    if POLICY.sms:
        return POLICY.sms
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_block_v(V: int, HV: int, N: int, device, widest: int | None = None, sms: int | None = None) -> int:
    """The V-block for this GPU (see block_v; `sms`: its SM count, if known, else the device's),
    or the policy's."""
    if POLICY.block_v:
        return min(POLICY.block_v, tile_width(V))  # (a V-block tiles the padded width)
    return block_v(V, HV, N, sms or sm_count(device), widest=widest)


def widest_v_block(K: int) -> int:
    """64, or 32 where K's tile is wider than 128: the scan's state, K×BV float32 in registers,
    spilled at K = 256, BV = 64 even on two warpgroups (ptxas: 208 bytes)."""
    return 64 if tile_width(K) <= 128 else 32


def block_v(V: int, HV: int, N: int, sms: int, K: int = 128, widest: int | None = None) -> int:
    """The widest V-block (up to `widest`, by default widest_v_block(K)) that still gives ~70% of
    the SMs a CTA, else the narrowest (16).

    The scan is one CTA per (sequence, value head, V-block) and its per-chunk time is mostly
    latency, so more CTAs beat wider tiles while the grid is short of the SMs. On the H200, 2/8
    and 4/16 heads with one sequence ran their scans 17-26% faster at 16 than at 32 (forward and
    backward); 8/32 (256 CTAs at 16, two waves) tied forward and lost 50% backward: this rule
    keeps 32 there.

    >>> block_v(128, 16, 1, 132), block_v(128, 32, 1, 132), block_v(128, 64, 1, 132), block_v(256, 64, 1, 132, K=256)
    (16, 32, 64, 32)
    """
    widest = widest or widest_v_block(K)
    V = tile_width(V)  # the V-blocks tile the padded width
    for bv in (128, 64, 32, 16):
        if bv <= min(V, widest) and (V // bv) * HV * N >= 0.7 * sms:
            return bv
    return 16


def fused_pays(K: int, V: int, HV: int, N: int, sms: int) -> bool:
    """Whether an inference call runs the fused forward by default: where its grid, at block_v's
    V-block, gives ~70% of the SMs a CTA. On the H200 (session 15) the fused kernel beat the
    separate scan and out kernels on the seven bench rows whose grid does (1.04–1.71× faster), and
    was 7–8% slower on the two that do not (2/8 heads, one sequence: 64 CTAs at V-block 16), its
    hand-offs a latency each chunk that a short grid cannot hide.

    >>> fused_pays(128, 128, 8, 1, 132), fused_pays(128, 128, 16, 1, 132), fused_pays(128, 128, 8, 8, 132)
    (False, True, True)
    """
    bv = block_v(V, HV, N, sms, K)
    return (tile_width(V) // bv) * HV * N >= 0.7 * sms


def runs_fused(K: int, V: int, HV: int, N: int, sms: int, fused=None) -> bool:
    """Whether an inference call runs the fused forward: `fused`, else the launch policy's, else
    where it pays (fused_pays)."""
    choice = POLICY.fused if fused is None else fused
    return fused_pays(K, V, HV, N, sms) if choice is None else choice


def wide_fused(K: int, V: int, HV: int, N: int, sms: int) -> bool:
    """Whether a fused inference call runs the wide fused kernel (Program.fused_wide_program: V-block
    128, its chain on a state and a value role): where its grid at that width still gives ~70% of
    the SMs a CTA (block_v's rule), and the state, K×128 float32, fits a warpgroup (K's tile ≤ 128).
    The output role's Q Kᵀ and mask, the same work at every V-block, then run once per value head.

    >>> wide_fused(128, 128, 64, 8, 132), wide_fused(128, 128, 64, 1, 132), wide_fused(256, 256, 64, 8, 132)
    (True, False, False)
    """
    return tile_width(K) <= 128 and tile_width(V) >= 128 and block_v(V, HV, N, sms, K, widest=128) == 128


def backward_scan_roles() -> bool | str:
    """The launch policy's backward_scan_roles, its None read as BACKWARD_SCAN_ROLES: True,
    "wide" or False."""
    on = POLICY.backward_scan_roles
    return BACKWARD_SCAN_ROLES if on is None else on


def cut_wide() -> bool:
    """The launch policy's cut_wide, its None read as CUT_WIDE."""
    on = POLICY.cut_wide
    return CUT_WIDE if on is None else on


def cut_fused_training() -> bool:
    """The launch policy's cut_fused_training, its None read as CUT_FUSED_TRAINING."""
    on = POLICY.cut_fused_training
    return CUT_FUSED_TRAINING if on is None else on


def runs_wide(K: int, V: int, HV: int, N: int, sms: int, context_parallel) -> bool:
    """Whether a fused inference call runs the wide fused kernel (and a backward on roles the wide
    scan: kernels/backward.py): the launch policy's choice (its `wide`, or a V-block of 128), else
    wide_fused's rule. A context-parallel call walks N·segments sequences: on the wide kernel where
    the rule holds for them and cut_wide() says so (its backward on the whole-V scan on roles, its
    training forward on the wide fused training forward where cut_fused_training() says so), else
    on the narrow one.

        >>> runs_wide(128, 128, 32, 1, 132, None), runs_wide(128, 128, 32, 1, 132, 4)
        (False, False)
        >>> with launch_policy(cut_wide=True):
        ...     runs_wide(128, 128, 32, 1, 132, 2), runs_wide(128, 128, 32, 1, 132, 4)
        (False, True)
    """
    if context_parallel and not cut_wide():
        return False
    if POLICY.wide is not None:
        return POLICY.wide
    runs = N * (context_parallel or 1)
    return POLICY.block_v == 128 if POLICY.block_v else wide_fused(K, V, HV, runs, sms)


def scan_warpgroups(K: int, V: int, BV: int, HV: int, N: int, sms: int) -> int:
    """Consumer warpgroups of the forward scan: two where each of its CTAs has an SM to itself
    anyway, one elsewhere.

    A chunk of the scan is a chain of short dependent steps; with one warp per scheduler most
    issue slots go idle, and a second warpgroup halves each warp's share of every step. It only
    pays where it takes no co-resident CTA's place: where a one-warpgroup CTA is alone on its SM
    anyway (at K·BV ≥ 128·64 the state fragment alone is 64 registers a thread, and the kernel's
    163 registers on 256 threads, producer included, leave no room for a second CTA), or where
    the grid has no more CTAs than SMs. On the H200 (session 8, forward scan, same stages): 16/64
    heads at BV = 64 −12%, 8/32 at BV = 32 (128 CTAs) −9%; 16/64 at BV = 32 (256 CTAs, two per SM
    at one warpgroup) +65%. Below BV = 32 it is not lowered (each warpgroup would hold 8 columns).

    >>> scan_warpgroups(128, 128, 64, 64, 1, 132), scan_warpgroups(128, 128, 32, 32, 1, 132)
    (2, 2)
    >>> scan_warpgroups(128, 128, 32, 64, 1, 132), scan_warpgroups(128, 128, 16, 8, 1, 132)
    (1, 1)
    """
    if BV < 32:
        return 1
    K, V = tile_width(K), tile_width(V)
    return 2 if K * BV >= 128 * 64 or (V // BV) * HV * N <= sms else 1


def scan_class(H: int, HV: int, K: int, width: int, n_seqs: int, io: str, sms: int, scale=None,
               BV: int | None = None, block_v_max: int = 64) -> ShapeClass:
    """The shape class a launch compiles for, on a GPU with `sms` SMs: the head counts and dims, the
    value width (context parallelism widens it), the scan's V-block (block_v, unless given; at most
    the program's KernelIR.block_v_max) and warpgroups (scan_warpgroups) for this many sequences,
    its pipeline stages (scan_stages)."""
    BV = min(BV or block_v(width, HV, n_seqs, sms, K), block_v_max)
    return ShapeClass(H=H, HV=HV, K=K, V=width, io=io, scale=scale, BV=BV, stages=scan_stages(BV),
                      scan_warpgroups=scan_warpgroups(K, width, BV, HV, n_seqs, sms))


@functools.lru_cache(maxsize=64)
def _on_device(values: tuple, device) -> torch.Tensor:
    """Constants uploaded once (an upload inside a CUDA-graph capture would fail)."""
    return torch.tensor(values, device=device, dtype=torch.float32)


def _filled(values: tuple, device) -> torch.Tensor:
    """The same constants made by fill kernels, which a CUDA-graph capture records (no upload) and
    nothing keeps: what a compiled call uses (see call_tensors)."""
    out = torch.empty(len(values), device=device, dtype=torch.float32)
    for i, x in enumerate(values):
        out[i].fill_(x)
    return out


def chunk_map(cu: torch.Tensor, n_tokens: int, C: int) -> torch.Tensor:
    """(first token, tokens) of every chunk of every sequence, padded with (0, 0) up to the static
    bound T/C + N, computed on the device."""
    N = cu.numel() - 1
    slots = n_tokens // C + N
    lens = (cu[1:] - cu[:-1]).long()
    per_seq = (lens + C - 1) // C
    ends = per_seq.cumsum(0)
    slot = torch.arange(slots, device=cu.device)
    seq = torch.searchsorted(ends, slot, right=True).clamp(max=N - 1)
    local = slot - (ends - per_seq)[seq]
    n_valid = (lens[seq] - local * C).clamp(0, C)
    n_valid = torch.where(slot < ends[-1], n_valid, torch.zeros_like(n_valid))
    first = cu[:-1].long()[seq] + local * C
    return torch.stack([torch.where(n_valid > 0, first, torch.zeros_like(first)), n_valid], 1).to(torch.int32)


class _Layout(TensorMemo):
    """The per-call layout tensors of one sequence layout — cu_seqlens as int32, the chunk map, each
    sequence's first chunk slot — kept while the cu_seqlens tensor they came from lives unmodified
    (qla_compiler/layout.TensorMemo; a dense batch's by its shape)."""

    def __call__(self, dims, cu_seqlens, device, C: int, cache: bool = True):
        def compute():
            cu = packed_cu_seqlens(dims.B, dims.T, cu_seqlens, device, torch.int32)
            # (the caller's own int32 tensor is not held: it would never be freed)
            return None if cu is cu_seqlens else cu, chunk_map(cu, dims.B * dims.T, C), chunk_offsets(cu, C)

        key = ("dense", dims.B) if cu_seqlens is None else "packed"
        cu, cmap, offsets = super().__call__(cu_seqlens, (key, dims.T, str(device), C), compute, cache)
        return (cu_seqlens if cu is None else cu), cmap, offsets


sequence_layout = _Layout()
_SEGMENT_LAYOUTS = TensorMemo()


def segment_layouts(cu: torch.Tensor, segments: int, C: int, T: int, cache: bool = True):
    """context_parallel.segment_layout, kept while `cu` (the call's int32 cu_seqlens, which
    sequence_layout keeps too) lives unmodified: ~40 small device ops a call otherwise."""
    return _SEGMENT_LAYOUTS(cu, (segments, C, T), lambda: segment_layout(cu, segments, C, T), cache)


def forward(program, inputs: dict, kinds: dict, dims, scale: float, initial_state, cu_seqlens,
            head_logs: dict, context_parallel=None, keep: bool = False, cache: bool = True, fused=None):
    """Run the program's kernels: (o [B, T, HV, V], final state [N, HV, K, V]). With keep, also
    every global tensor by name (what kernels/backward.py needs: the packed inputs, the chunk map,
    the state entering every chunk, the prep's results), from the kernels of the training program
    (which also store the triangular inverses for the backward). `cache`: see call_tensors.
    `fused`: run the scan and the output as one warp-specialised kernel (None: the launch
    policy's choice, runs_fused; a context-parallel call decides on its N·segments sequences); a
    training call runs the fused training forward so where the policy's fused_training allows it
    (under a cut, where cut_fused_training does too). Where a program's fused kernel does not
    fit, the separate kernels run."""
    check_call(dims, keep, context_parallel)
    v_name = next(n for n, k in kinds.items() if k == "value")
    io = inputs[v_name].dtype
    device = inputs[v_name].device
    program = _call_program(program, dims, io, device, keep, context_parallel, fused)
    tensors, cu, h0 = call_tensors(inputs, kinds, dims, initial_state, cu_seqlens, head_logs, program.chunk_size,
                                 cache)
    final = run_kernels(program, tensors, dims, scale, io, cu, h0, context_parallel, cache)
    (result,) = program.chunk.outputs  # the forward's one result, o
    o = tensors[program.kernels.results()[result]].view(dims.B, dims.T, dims.HV, dims.V)
    return (o, final, dict(tensors, cu_seqlens=cu)) if keep else (o, final)


def _memo(table: dict, size: int, key, kept, make):
    """table[key], made by make() on a miss; `kept`: the object whose id the key holds, kept alive
    with the entry (an id is reused once its object is freed); past `size` entries the oldest goes."""
    hit = table.get(key)
    if hit is None:
        if len(table) >= size:
            table.pop(next(iter(table)))
        hit = table[key] = (make(), kept)
    return hit[0]


_CALL_PROGRAMS: dict = {}  # _call_program's: key -> (program, the program its key names by id)


def _call_program(program, dims, io, device, keep: bool, context_parallel, fused):
    """The program a forward call runs: the training program of its variant (program_for) with
    `keep`, else what inference runs there (inference_program); chosen once per shape class,
    launch policy and options, not per call (issue 19's host time)."""
    def make():
        variant = program_for(program, dims, io, device)
        # (the fused program is the same from every variant: it puts the decay on the value side
        # itself, the one kernel-shaping choice that depends on the V-block)
        sms = sm_count(device)
        # context parallelism launches the scan (here the fused kernel) on N·segments sequences
        runs = dims.N * (context_parallel or 1)
        fuses = runs_fused(dims.K, dims.V, dims.HV, runs, sms, fused)
        wide = runs_wide(dims.K, dims.V, dims.HV, dims.N, sms, context_parallel)
        if keep:
            variant.backward_blocks()  # a backward the kernels cannot run fails here, before the forward
            if fuses and POLICY.fused_training is not False and (not context_parallel or cut_fused_training()):
                return fused_or_not(variant, wide, training=True)
            return variant.training_program
        return inference_program(variant, fuses, wide)

    key = (id(program), dims.H, dims.HV, dims.K, dims.V, dims.N, io, device, keep, context_parallel, fused,
           POLICY, sm_count(device))
    return _memo(_CALL_PROGRAMS, 256, key, program, make)


def inference_program(program, fused: bool = False, wide: bool = False):
    """The kernels an inference call of `program` (its variant, program_for) runs: the fused
    forward where `fused` (runs_fused; the wide one where `wide`: wide_fused), else the separate
    kernels. A context-parallel call runs the fused kernel as its scan, twice (on the widened
    values, then on v), and the prep once (run_kernels)."""
    return fused_or_not(program, wide) if fused else program


def fused_or_not(program, wide: bool = False, training: bool = False):
    """The program's fused forward (Program.fused_wide_program where `wide`, else or where that
    one does not fit, Program.fused_program), or the program itself where the schedule cannot
    fuse it (errors.NotFusable: e.g. its rings would not fit in shared memory at its head-dim
    tiles); any other failure of the fused schedule is a bug, and raises. `training`: the fused
    training forward (Program.fused_training_program), else the training program."""
    from qla_compiler.errors import NotFusable

    suffix = "_training_program" if training else "_program"
    for variant in ("fused_wide", "fused") if wide else ("fused",):
        try:
            return getattr(program, variant + suffix)
        except NotFusable:
            pass
    return program.training_program if training else program


def cuts(K: int, V: int) -> bool:
    """Whether the kernels run context parallelism at these head dims: where K and V are powers of
    two from 64 (their tiles, which the widened values [0 | v] are laid out in, are the dims
    themselves: lower_tilelang.tile_width)."""
    return tile_width(K) == K and tile_width(V) == V


def check_call(dims, keep: bool, context_parallel) -> None:
    """What the kernels refuse, from the shapes alone (a ValueError naming the argument)."""
    check_head_dims(dims.K, dims.V)
    if context_parallel and not cuts(dims.K, dims.V):
        raise ValueError(f"context_parallel: the GPU kernels run it only where K and V are powers of two from 64 "
                         f"(got K = {dims.K}, V = {dims.V}); leave it None")


GRID_YZ_MAX = 65535  # CTAs CUDA launches along grid y and z (x: 2^31 − 1)


def check_grid(kernel, sizes: dict, n_seqs: int) -> None:
    """A launch that would put more CTAs on grid y or z than CUDA takes is refused with a
    ValueError saying what to split, not left to fail in the driver: the sequences of a scan or
    token step (grid z), the chunk slots of a kernel on key blocks (grid y; elsewhere the lowering
    launches them on x or as one axis, lower_tilelang.one_launch_axis). `sizes`: the call's
    (tensor_sizes), of which a grid over chunk slots reads CH and T.

        >>> from qla_compiler.ir.kernel import Kernel
        >>> scan = Kernel("scan", (("v_block", "V/BV"), ("value_head", "HV"), ("sequence", "N")), 128, [], [], [], [], [])
        >>> check_grid(scan, {}, n_seqs=70000)
        Traceback (most recent call last):
        ...
        ValueError: cu_seqlens: 70000 sequences, but scan launches a CTA per sequence on grid axis z, which CUDA caps at 65535: split the call into calls of at most 65535 sequences
    """
    if one_launch_axis(kernel):
        return
    for i, (axis, extent) in enumerate(kernel.grid[1:]):
        n = {"CH": sizes.get("CH"), "N": n_seqs}.get(extent)
        if n is None or n <= GRID_YZ_MAX:
            continue
        where = f"grid axis {'yz'[i]}, which CUDA caps at {GRID_YZ_MAX}"
        if axis == "sequence":
            raise ValueError(f"cu_seqlens: {n} sequences, but {kernel.name} launches a CTA per sequence on {where}: "
                             f"split the call into calls of at most {GRID_YZ_MAX} sequences")
        raise ValueError(f"q, k, v: the call's {sizes['T']} tokens make {n} chunks, but {kernel.name} launches a CTA "
                         f"per chunk on {where}: split the call into calls of fewer tokens")


def packed_inputs(inputs: dict, kinds: dict, dims, head_logs: dict, exact: bool = False, cache: bool = True) -> dict:
    """The inputs packed [1, B·T, ...] by parameter name (gates and scalars in float32, as the
    kernels read them; `exact`: as they are, for a stand-in), and each head constant's logs
    (uploaded once per device, or with `cache` False made afresh: see call_tensors)."""
    device = next(iter(inputs.values())).device
    total = dims.B * dims.T
    tensors = {}
    for n, x in inputs.items():
        x = x.reshape(1, total, *x.shape[2:])
        tensors[n] = x.contiguous() if kinds[n] in ("key", "value") or exact else x.to(torch.float32).contiguous()
    for name, logs in head_logs.items():
        tensors[f"log_{name}"] = (_on_device if cache else _filled)(tuple(logs), device)
    return tensors


def call_tensors(inputs: dict, kinds: dict, dims, initial_state, cu_seqlens, head_logs: dict, C: int,
                 cache: bool = True):
    """The kernels' tensors that are the call's own, by parameter name — the inputs packed
    [1, B·T, ...] (gates and scalars in float32), each head constant's logs, the chunk map and
    each sequence's first chunk slot — with cu_seqlens as int32 and the initial state as float32.
    (The backward rebuilds them from the same arguments rather than keeping them.)

    With `cache` False nothing made here outlives the call: a compiled graph's call, which
    torch.compile's CUDA-graph trees run once to warm up with every allocation in the graph's
    memory pool; a tensor kept past the call there (a cached layout, uploaded constants) is an
    allocation the trees do not own, and they refuse to record."""
    device = next(iter(inputs.values())).device
    tensors = packed_inputs(inputs, kinds, dims, head_logs, cache=cache)
    cu, cmap, offsets = sequence_layout(dims, cu_seqlens, device, C, cache)
    h0 = (torch.zeros(dims.N, dims.HV, dims.K, dims.V, device=device, dtype=torch.float32)
          if initial_state is None else initial_state.to(torch.float32).contiguous())
    tensors["chunk_map"], tensors["chunk_offsets"] = cmap, offsets
    return tensors, cu, h0


def program_for(program, dims, io, device):
    """The variant of `program` this call runs (Program.for_shape: the kernel-shaping rewrites that
    pay at its V-block), chosen once per call from its shape without context parallelism, so the
    backward runs the same variant as the forward it follows."""
    return program.for_shape(shape_class(dims, dims.V, dims.N, None, io, device))


def run_kernels(program, tensors: dict, dims, scale: float, io, cu, h0, segments=None, cache: bool = True):
    """Launch the program's kernels in KernelIR order — the parallel ones before the scan (prep),
    the scan, the parallel ones after it (out) — reading and writing `tensors` by parameter name
    (it needs the chunk map). With `segments`, the scan runs context-parallel (each sequence cut
    into that many segments; qla_compiler/context_parallel.py), the parallel kernels once; its
    segment layout kept with `cu` unless `cache` is False (see call_tensors).
    Returns the scan's final state [N, HV, K, V]."""
    C = program.chunk_size
    sizes = tensor_sizes(dims, C, tensors["chunk_map"])
    ks = program.kernels.kernels
    i_scan = program.kernels.scan
    scan_kernel = ks[i_scan]
    # the scan's per-token inputs of the state's value width (v, or what prep made from it; dO in a
    # backward): context parallelism widens them
    values = [p.name for p in scan_kernel.params if widened(p)]

    def run(kernel, t, width=dims.V, n_seqs=dims.N):
        # (a context-parallel scan runs a pass per step, each reading its inputs anew)
        launch(program, kernel, t, dims, scale, io, sizes, width, n_seqs, once=not (segments and kernel.walks_chunks))

    for k in ks[:i_scan]:  # per chunk, independent of how sequences are cut into segments
        run(k, tensors)
        _release(k, tensors)

    cut = segment_layouts(cu, segments, C, dims.B * dims.T, cache) if segments else None
    windows = program.windows_program if segments else None  # the first scan's: the windows alone

    def scan(vals, cu_, h0_, skip=None):
        width, n_seqs = h0_.shape[-1], h0_.shape[0]
        offsets = cut.offsets if cut is not None and cu_ is cut.cu else \
            tensors["chunk_offsets"] if cu_ is cu and "chunk_offsets" in tensors else chunk_offsets(cu_, C)
        t = dict(tensors, cu_seqlens=cu_, chunk_offsets=offsets, initial_state=h0_.contiguous(),
                 **{n: x.contiguous() for n, x in vals.items()})
        if skip is None:
            run(scan_kernel, t, width, n_seqs)
        else:  # the walks of segments' windows (context_parallel.window_skips)
            (kernel,) = windows.kernels.kernels
            t[kernel.walk_skip] = skip
            launch(windows, kernel, t, dims, scale, io, sizes, width, n_seqs, once=False)
        return t, t["final_state"]

    vals = {n: tensors[n] for n in values}
    if segments:
        # the windows kernel reads the values' zero columns itself (Tensor.zero_columns): no [0 | v]
        reads_zeros = any(p.zero_columns for p in windows.kernels.kernels[0].params)
        t, final = run_segments(scan, vals, cu, h0, segments, C, reverse=scan_kernel.reverse,
                                skips=_window_search(program, tensors, dims.HV, C), layout=cut, widen=not reads_zeros,
                                chain=_segment_chain(h0))
    else:
        t, final = scan(vals, cu, h0)
    tensors.update({p.name: t[p.name] for p in scan_kernel.params if p.role == "out"})
    del t, vals  # (the scan's view of the call's tensors: what it releases is to go now)
    _release(scan_kernel, tensors)
    for k in ks[i_scan + 1:]:
        run(k, tensors)
        _release(k, tensors)
    return final


def _release(kernel, tensors: dict) -> None:
    """Drop what the program no longer reads after `kernel` (Kernel.releases): torch's allocator
    hands that memory to the kernels after it."""
    for name in kernel.releases:
        tensors.pop(name, None)


def _window_search(program, tensors: dict, HV: int, C: int):
    """(layout, reverse) -> the chunks each segment's window walk leaves out: on the GPU's compiled
    path one kernel (kernels/window_search.py), else (the emulator, meta tensors) the torch
    definition it is held to (context_parallel.window_skips)."""
    if POLICY.window_search is not None:
        return POLICY.window_search(program, tensors, HV, C)
    if POLICY.kernels is None and tensors["chunk_map"].is_cuda:
        return window_search.searcher(program.recurrence, tensors, HV, C)
    lam = contraction_logs(program.recurrence, tensors, HV)
    return lambda layout, reverse: window_skips(lam, layout, reverse)


def _segment_chain(h0: torch.Tensor):
    """Step 2 of context parallelism, the chain of segment maps: on the GPU's compiled path one
    kernel (kernels/segment_chain.py), else (the emulator, meta tensors, states wider than float32)
    the torch definition it is held to (context_parallel.chain_starts)."""
    if POLICY.segment_chain is not None:
        return POLICY.segment_chain(h0)
    if POLICY.kernels is None and h0.is_cuda and h0.dtype == torch.float32:
        return segment_chain.chain
    return chain_starts


def tensor_sizes(dims, C: int, chunk_map_: torch.Tensor) -> dict:
    """The value of every dim name a KernelIR tensor uses, for this call."""
    return {"1": 1, "T": dims.B * dims.T, "HV": dims.HV, "H": dims.H, "K": dims.K, "V": dims.V, "C": C,
            "N": dims.N, "CH": chunk_map_.shape[0]}


def shape_class(dims, width: int, n_seqs: int, scale: float, io, device, block_v_max: int = 64) -> ShapeClass:
    """What a launch compiles for on this GPU (scan_class), for a program whose kernels take
    V-blocks up to `block_v_max` (KernelIR.block_v_max). Every launch of a call asks it, and
    every layer of a model with the same shapes: made once per shape, SM count and launch policy
    (issue 19's host time per call)."""
    return _shape_class(dims.H, dims.HV, dims.K, width, n_seqs, scale, IO_DTYPES[io], sm_count(device),
                        block_v_max, POLICY.block_v, POLICY.scan_stages)


@functools.lru_cache(maxsize=256)
def _shape_class(H, HV, K, width, n_seqs, scale, io: str, sms: int, block_v_max, policy_block_v, policy_stages):
    # policy_block_v, policy_stages: the launch policy's fields that the rules below read, in the key
    widest = block_v_max if block_v_max > 64 else widest_v_block(K)  # (the wide fused kernel's: 128)
    return scan_class(H, HV, K, width, n_seqs, io, sms, scale, block_v_max=block_v_max,
                      BV=min(choose_block_v(width, HV, n_seqs, None, widest, sms=sms), widest))


def launch(program, kernel, t: dict, dims, scale, io, sizes: dict, width: int, n_seqs: int, once: bool = True) -> None:
    """One kernel of `program`: its outputs allocated into `t` (unless given; in the memory of the
    input an output reuses where that one is allocated alike and the kernel runs `once` a call,
    Tensor.reuses), its parameters taken from `t` by name."""
    device = t["chunk_map"].device
    plan = _launch_plan(program, kernel, dims, scale, io, device, sizes, width, n_seqs)
    for name, shape, dtype, reuses in plan.outs:
        if name not in t:
            dead = t.get(reuses) if once else None
            # (not under a poison policy: what the kernel leaves unwritten is to show as poison)
            alike = dead is not None and POLICY.poison is None and dead.shape == shape and dead.dtype == dtype \
                and dead.is_contiguous()
            t[name] = dead if alike else allocated(shape, dtype, device)
    plan.run(*[t[n] for n in plan.names])


def allocated(shape, dtype, device) -> torch.Tensor:
    """A tensor a kernel writes: left as torch.empty leaves it, or filled with the launch policy's
    poison (a test's: what the kernel leaves unwritten shows)."""
    return torch.empty(shape, device=device, dtype=dtype) if POLICY.poison is None else \
        torch.full(shape, POLICY.poison, device=device, dtype=dtype)


@dataclass(frozen=True)
class _Launch:
    """What a launch needs besides the call's tensors: the kernel, its parameters' names in
    order, and (name, shape, dtype, the input whose memory it may take) of each output it
    allocates where the call holds none."""
    run: Callable
    names: tuple
    outs: tuple


_LAUNCHES: dict = {}  # _launch_plan's: key -> (_Launch, the KernelIR its key names by id)


def _launch_plan(program, kernel, dims, scale, io, device, sizes: dict, width: int, n_seqs: int) -> _Launch:
    """A launch's shape class, kernel and output shapes, worked out once per kernel, call shape and
    launch policy: a short call's host time is mostly such bookkeeping (issue 19; ~20 µs a call of
    two launches on one CPU core, session 19)."""
    loader = POLICY.kernels or load_kernels

    def make():
        check_grid(kernel, sizes, n_seqs)
        shape = shape_class(dims, width, n_seqs, scale, io, device, program.kernels.block_v_max)
        outs = []
        for p in kernel.params:
            if p.role == "out":
                size = dict(sizes, N=n_seqs, **(dict(K=shape.KP, V=shape.VP) if p.padded else dict(V=width)))
                outs.append((p.name, tuple(size[d] for d in p.shape), io if p.dtype == "io" else torch.float32,
                             p.reuses))
        kernels = loader(program, shape)
        if not kernel.walks_chunks and hasattr(kernels, "prefetch"):
            # a call's first launch at this class: every kernel of the program compiles at once,
            # beside each other, not each at its launch (a context-parallel call runs its scan at
            # another class, and this one's compiles in vain, on a spare core)
            kernels.prefetch([k.name for k in program.kernels.kernels])
        return _Launch(kernels[kernel.name], tuple(p.name for p in kernel.params), tuple(outs))

    key = (id(program.kernels), kernel.name, dims, scale, io, device, sizes["CH"], width, n_seqs, POLICY, loader,
           sm_count(device))
    return _memo(_LAUNCHES, 1024, key, program.kernels, make)  # (varlen training: a key per total length)
