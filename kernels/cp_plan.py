"""How many segments `context_parallel="auto"` cuts each sequence into: a cost model of the scan.

The scan is one CTA per (V-block, value head, sequence) walking its chunks one after another, so
with few value heads and sequences most SMs idle while a long sequence is walked. Cut into S
segments (qla_compiler/context_parallel.py) the walk is S times shorter and the grid S times
larger, at the price of a first scan of each segment's window at width K + V and the work around
it (the window search, the chain of start states). Modelled in GPU time:

    t(S) = Σ over the launches  waves · (walk · chunk + wave)
         + [S > 1] · (glue + S · segment + tokens · H · token)

The launches are the walks, waves(V/BV · HV · N·S) CTAs of ⌈NC / S⌉ chunks, and with a cut the
windows, waves((K+V)/BV' · HV · N·S) of min(WINDOW, ⌈NC / S⌉); NC is the chunks of a sequence
(the call's tokens over its sequences: no lengths are read from the device), BV the launch rule's
V-block (forward.block_v), one CTA an SM (the fused kernel's registers and shared memory allow
one). `wave` is what a CTA costs besides its chunks (its state's load and store, its start);
`segment` the start states' chain (kernels/segment_chain.py: one product a segment); `token` the
window search's reads of the keys (its norms; once every key, now the windows' alone). WINDOW
assumes gates that decay (the bench's: a window of a chunk or two); where they do not, the window is the whole segment: the call stays exact and costs up to a
second walk of every segment at width K + V more than the model says.

The constants are non-negative least squares over the H200's segment sweep (session 27: eight
rows × 2, 4, 8, 16 segments against none, with the window search and the chain of segment maps as
kernels; `benchmarks/cp_sweep_h200.json`, fitted again by `python benchmarks/cp_sweep.py --fit
benchmarks/cp_sweep_h200.json --fix segment=0.002`). `segment` is held at the chain kernel's
measured cost a segment (0.014, 0.019, 0.025 ms at 2, 4, 8 segments): fitted freely it went to
zero, the sweep not telling a segment from a wave. The glue fits to zero: the kernels left none a
cut pays beyond its launches' waves. Residuals rms 0.032 ms, ≤ 0.06 ms but where the segments are
no longer than a window (16/64 × 2048 at 16 segments: 0.14 ms). On every row of the sweep the
plan is the fastest count measured; session 22's constants (fitted to the torch search and chain)
kept 2/8 × 8192 whole at 0.215 ms, against 0.116 at 4 segments.

An inference call may walk its segments on the wide fused kernel (V-block 128, a CTA per value
head and segment: forward.runs_wide, where forward.cut_wide() says so): with `wide`, the model's
launches run there where forward.wide_fused's rule holds for the N·S sequences, and their chunks
cost `wide_chunk` instead of `chunk`. Its value is not fitted (the sweep had no cut on the wide
kernel): it is `chunk` × 1.41, the ratio of a chunk-wave's time at V-block 128 to one at 64 in
session 16's measurement of the fused kernels on the H200 (`fused_variants.py`: 4/16 × 8 × 4096,
0.203 ms over one wave of 64 chunks against 0.285 over two; 16/64 × 8 × 4096, 0.801 over four
against 1.140 over eight: 3.1–3.2 µs against 2.2). `cp_sweep.py --cut-wide` measures the cuts to
fit it.

    >>> plan_segments(N=1, H=2, HV=8, K=128, V=128, tokens=32768, sms=132)
    8
    >>> plan_segments(N=8, H=16, HV=64, K=128, V=128, tokens=8 * 4096, sms=132)
    1
"""
from __future__ import annotations

import dataclasses
import functools
import math


@dataclasses.dataclass(frozen=True)
class Costs:
    """The model's constants (ms): each multiplies one of cost_terms' counts."""
    chunk: float  # one chunk of a walk, per wave of CTAs
    wave: float  # a wave of CTAs besides its chunks
    glue: float  # a cut call's fixed cost besides its launches (the torch glue, when there was some)
    segment: float  # each segment (the start states' chain)
    token: float  # each token × key head (the windows' λ)
    wide_chunk: float  # one chunk of a walk on the wide fused kernel, per wave


H200 = Costs(chunk=0.001345, wave=0.01462, glue=0.0, segment=0.002, token=5.1e-9, wide_chunk=0.001345 * 1.41)
WINDOW = 2  # chunks a segment's window walks where the gates decay
SEGMENTS = (1, 2, 4, 8, 16, 32)
GAIN = 0.9  # cut only where the model says at least 10 % faster: its error is about that
# An eager call (not captured in a CUDA graph, not compiled) takes at least its host time, and a
# cut adds host work: the search, the chain, the segment layout, two scans' launches. On the H200
# node (session 29, qla-bench's eager time of cut calls at 2/8 × 32768 tokens) a cut inference
# call took 0.40 ms of host time and a cut training step 3.24 ms (session 27: 0.28 and 2.1-2.7).
# That qla-bench process had imported FLA and FlashQLA, which makes our host time ~1.4-1.5× a
# lean process's (benchmarks/launch_overhead.py --peers): a process with a model loaded is closer
# to it than a lean one.
# So an eager call is cut only where its whole call's GPU time passes that, modelled as
# CALL_GPU's `walk` × the scan model's whole walk + `token_head` × tokens × value heads (a
# least-squares fit to the uncut calls' GPU times of the bench rows, sessions 27-29: within 0.15 ms
# for a training step on six rows, 0.25 ms for inference on eight). With one walk-time factor
# (session 27) every one-sequence row looked alike, and 2/8 × 32768's training step was cut
# eagerly at 3.24 ms against 2.79 whole, where 4/16's cut gains (3.51 against 4.02).
HOST_CUT_MS = {"inference": 0.40, "training": 3.24}
CALL_GPU = {"inference": dict(walk=1.049, token_head=3.74e-7), "training": dict(walk=1.743, token_head=5.58e-6)}


def cost_terms(segments: int, N: int, H: int, HV: int, K: int, V: int, tokens: int, sms: int,
               chunk_size: int = 64, wide: bool = False) -> dict:
    """The counts the model's constants multiply (Costs' fields) for a call cut into `segments`
    (`wide`: its walks on the wide fused kernel where that kernel's rule holds, see launch_waves)."""
    chunks = math.ceil(tokens / max(N, 1) / chunk_size)
    walk = math.ceil(chunks / segments)
    cut = segments > 1
    walks, windows, on_wide = launch_waves(segments, N, HV, K, V, sms, wide)
    launches = [(walks, walk)] + [(windows, min(WINDOW, walk))] * cut
    walked = sum(w * n for w, n in launches)
    return dict(chunk=0 if on_wide else walked, wave=sum(w for w, _ in launches), glue=float(cut),
                segment=segments * cut, token=tokens * H * cut, wide_chunk=walked if on_wide else 0)


@functools.lru_cache(maxsize=4096)
def launch_waves(segments: int, N: int, HV: int, K: int, V: int, sms: int, wide: bool = False) -> tuple:
    """(waves of the walks, waves of the windows' walks, whether both run the wide fused kernel)
    of a call cut into `segments`: the launch rule's V-block, one CTA an SM. With `wide`, the wide
    kernel where forward.wide_fused's rule holds for the N·segments sequences (as forward.runs_wide
    launches an inference call under forward.cut_wide()), at V-blocks up to 128."""
    from .forward import block_v, wide_fused, widest_v_block

    runs = N * segments
    on_wide = wide and wide_fused(K, V, HV, runs, sms)
    widest = 128 if on_wide else widest_v_block(K)

    def waves(width):
        bv = min(block_v(width, HV, runs, sms, K, widest=widest), widest)
        return math.ceil(math.ceil(width / bv) * HV * runs / sms)

    return waves(V), waves(K + V), on_wide


def walk_cost(segments: int, N: int, HV: int, K: int, V: int, sms: int, wide: bool = False) -> float:
    """The model's time of one chunk-step of a call's walks cut into `segments` (ms): their waves
    times a chunk's cost on the kernel they run on."""
    walks, _, on_wide = launch_waves(segments, N, HV, K, V, sms, wide)
    return walks * (H200.wide_chunk if on_wide else H200.chunk)


def may_choose(segments: int, N: int, HV: int, K: int, V: int, sms: int, wide: bool = False) -> bool:
    """Whether plan_segments can choose `segments` for calls of N sequences of some length: what a
    warm-up that is not told the length compiles. A cut's walks take at least c(S) · ⌈NC/S⌉ ≥
    c(S) · NC / S, c the walk_cost of a chunk-step, and the whole walk c(1) · NC, so where c(S) / S
    ≥ GAIN · c(1) no length makes the cut GAIN faster (where c(S) < c(1), which the V-block's rule
    might give, the count is kept)."""
    if segments == 1:
        return True
    cut, whole = walk_cost(segments, N, HV, K, V, sms, wide), walk_cost(1, N, HV, K, V, sms, wide)
    return cut < whole or cut / segments < GAIN * whole


def predicted_ms(segments: int, N: int, H: int, HV: int, K: int, V: int, tokens: int, sms: int,
                 chunk_size: int = 64, costs: Costs = H200, wide: bool = False) -> float:
    """The model's GPU time (ms) of the scan of a call cut into `segments` (`wide`: cost_terms')."""
    terms = cost_terms(segments, N, H, HV, K, V, tokens, sms, chunk_size, wide)
    return sum(n * getattr(costs, f) for f, n in terms.items())


def plan_segments(N: int, H: int, HV: int, K: int, V: int, tokens: int, sms: int, chunk_size: int = 64,
                  eager: str | None = None, wide: bool = False) -> int:
    """The segment count the model finds fastest (1: no cut), among SEGMENTS, cutting only where it
    predicts at least 1 − GAIN less time than the whole walk. `eager`: "inference" or "training"
    for a call its host paces (see HOST_CUT_MS), None for one captured or compiled (GPU time alone).
    `wide`: the call walks on the wide fused kernel where its rule holds (an inference call under
    forward.cut_wide(): cost_terms).

        >>> plan_segments(1, 2, 8, 128, 128, 8192, 132), plan_segments(1, 2, 8, 128, 128, 8192, 132, eager="inference")
        (4, 1)
        >>> plan_segments(1, 8, 32, 128, 128, 32768, 132), plan_segments(1, 8, 32, 128, 128, 32768, 132, wide=True)
        (2, 4)
    """
    def ms(s):
        return predicted_ms(s, N, H, HV, K, V, tokens, sms, chunk_size, wide=wide)

    whole = ms(1)
    best = min(SEGMENTS, key=ms)
    if ms(best) >= GAIN * whole:
        return 1
    return 1 if eager and call_ms(whole, tokens, HV, eager) < HOST_CUT_MS[eager] else best


def call_ms(whole_walk: float, tokens: int, HV: int, eager: str) -> float:
    """The modelled GPU time (ms) of an uncut call whose scan walks `whole_walk` ms: CALL_GPU."""
    c = CALL_GPU[eager]
    return c["walk"] * whole_walk + c["token_head"] * tokens * HV


def walks_wide(training: bool) -> bool:
    """Whether a call's plan weighs the wide kernels' walks (plan_segments' `wide`): where the
    launch policy lets a cut run them (forward.cut_wide) and the call runs the fused kernels (its
    `fused` not False); a training call's only where both its walks do, the forward's on the fused
    training forward (forward.cut_fused_training) and the backward's on the whole-V scan on roles
    (forward.backward_scan_roles)."""
    from .forward import POLICY, backward_scan_roles, cut_fused_training, cut_wide

    both = cut_fused_training() and POLICY.fused_training is not False and bool(backward_scan_roles())
    return cut_wide() and POLICY.fused is not False and (not training or both)


def planned_segments(dims, device, eager: str | None = None, training: bool = False) -> int | None:
    """What `context_parallel="auto"` runs for a call of these Dims on `device`: None (no cut) or
    plan_segments' count (`eager`: as plan_segments'; `training`: the call keeps what a backward
    needs, walks_wide). None where the kernels cannot cut (forward.cuts)."""
    from .forward import sm_count

    # (ints: under torch.compile's dynamic shapes the plan specialises the graph, as the V-block does)
    return planned(*(int(x) for x in (dims.N, dims.H, dims.HV, dims.K, dims.V, dims.B * dims.T)), sm_count(device),
                   eager, walks_wide(training or eager == "training"))


@functools.lru_cache(maxsize=256)
def planned(N: int, H: int, HV: int, K: int, V: int, tokens: int, sms: int, eager: str | None = None,
            wide: bool = False) -> int | None:
    """planned_segments from the call's sizes (what precompile.shape_classes asks for cp=auto)."""
    from .forward import cuts

    if not cuts(K, V):
        return None
    s = plan_segments(N, H, HV, K, V, tokens, sms, eager=eager, wide=wide)
    return None if s == 1 else s
