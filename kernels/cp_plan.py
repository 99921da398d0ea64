"""How many segments `context_parallel="auto"` cuts each sequence into: a cost model of the scan.

The scan is one CTA per (V-block, value head, sequence) walking its chunks one after another, so
with few value heads and sequences most SMs idle while a long sequence is walked. Cut into S
segments (qla_compiler/context_parallel.py) the walk is S times shorter and the grid S times
larger, at the price of a first scan of each segment's window at width K + V and ~0.2 ms of torch
glue (the windows' λ sums, the start states' chain). Modelled in GPU time (waves of CTAs × chunks a walk × the time of a chunk):

    t(1) = waves(V/BV · HV · N) · NC · chunk
    t(S) = waves(V/BV · HV · N·S) · ⌈NC / S⌉ · chunk                                  the walks
         + waves((K+V)/BV' · HV · N·S) · min(WINDOW, ⌈NC / S⌉) · chunk + glue          their starts

with NC the chunks of a sequence (the call's tokens over its sequences: no lengths are read from
the device), BV the launch rule's V-block (forward.block_v) and one CTA an SM (the fused
kernel's registers and shared memory allow one). WINDOW assumes gates that decay (the bench's:
a window of a chunk or two); where they do not, the window is the whole segment: the call stays
exact and costs up to a second walk of every segment at width K + V more than the model says.

The constants are the H200's (session 21, benchmarks/NOTES.md): CHUNK_MS from the narrow fused
kernel at 8/32:1x32768 (0.907 ms for 512 chunks in one wave), GLUE_MS the context-parallel call's
torch kernels at 2/8:1x32768 and 8 segments. `benchmarks/cp_sweep.py` measures the segment counts
on the bench rows and fits them again. Session 22's sweep: the plan is the fastest count on all
six rows measured; the fit's chunk agrees (1.88 µs), its glue does not (0.425 ms), because the
glue grows with the segments and the heads, which a constant cannot say (NOTES).

    >>> plan_segments(N=1, H=2, HV=8, K=128, V=128, tokens=32768, sms=132)
    8
    >>> plan_segments(N=8, H=16, HV=64, K=128, V=128, tokens=8 * 4096, sms=132)
    1
"""
from __future__ import annotations

import functools
import math

CHUNK_MS = 0.907 / 512  # one chunk of a walk, one wave (the narrow fused kernel, V-block 64)
GLUE_MS = 0.20  # a context-parallel call's torch kernels (widened values, start states, skips)
WINDOW = 2  # chunks a segment's window walks where the gates decay
SEGMENTS = (1, 2, 4, 8, 16, 32)
GAIN = 0.9  # cut only where the model says at least 10 % faster: its error is about that


def predicted_ms(segments: int, N: int, H: int, HV: int, K: int, V: int, tokens: int, sms: int,
                 chunk_size: int = 64) -> float:
    """The model's GPU time (ms) of the scan of a call cut into `segments`."""
    from .forward import block_v, widest_v_block

    chunks = math.ceil(tokens / max(N, 1) / chunk_size)
    walk = math.ceil(chunks / segments)

    def waves(width, runs):
        bv = min(block_v(width, HV, runs, sms, K), widest_v_block(K))
        return math.ceil(math.ceil(width / bv) * HV * runs / sms)

    t = waves(V, N * segments) * walk * CHUNK_MS
    if segments > 1:
        t += waves(K + V, N * segments) * min(WINDOW, walk) * CHUNK_MS + GLUE_MS
    return t


def plan_segments(N: int, H: int, HV: int, K: int, V: int, tokens: int, sms: int, chunk_size: int = 64) -> int:
    """The segment count the model finds fastest (1: no cut), among SEGMENTS, cutting only where it
    predicts at least 1 − GAIN less time than the whole walk."""
    whole = predicted_ms(1, N, H, HV, K, V, tokens, sms, chunk_size)
    best = min(SEGMENTS, key=lambda s: predicted_ms(s, N, H, HV, K, V, tokens, sms, chunk_size))
    return best if predicted_ms(best, N, H, HV, K, V, tokens, sms, chunk_size) < GAIN * whole else 1


def planned_segments(dims, device) -> int | None:
    """What `context_parallel="auto"` runs for a call of these Dims on `device`: None (no cut) or
    plan_segments' count. None where the kernels cannot cut (forward.cuts)."""
    from .forward import sm_count

    # (ints: under torch.compile's dynamic shapes the plan specialises the graph, as the V-block does)
    return planned(*(int(x) for x in (dims.N, dims.H, dims.HV, dims.K, dims.V, dims.B * dims.T)), sm_count(device))


@functools.lru_cache(maxsize=256)
def planned(N: int, H: int, HV: int, K: int, V: int, tokens: int, sms: int) -> int | None:
    """planned_segments from the call's sizes (what precompile.shape_classes asks for cp=auto)."""
    from .forward import cuts

    if not cuts(K, V):
        return None
    s = plan_segments(N, H, HV, K, V, tokens, sms)
    return None if s == 1 else s
