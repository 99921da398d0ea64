"""Context parallelism inside one GPU (MATH.md): cut each sequence into segments that run at once.

Per chunk, and so per segment, the state update is affine: S_end = M S_start + H (passes/affine.py
derives M and H symbolically). Any scan backend (the generated kernels, the interpreter) computes
them without new code: because the write term is linear in v, scanning a segment with the value
columns widened to [0 | v] from the start state [I | 0] ends in [M | H]. Then

    1. scan every segment at once on the widened values from [I | 0]      ->  (M, H) per segment
    2. a short scan over the segments of each sequence                     ->  its start states
    3. scan every segment at once from its start state                      ->  o, final states

The backward's reverse scan carries dS the same way (its dO-like inputs are widened), from each
sequence's end: step 2 chains the segments last to first.

All of it is torch on the device plus two scans: no host synchronisation. Segments are whole
chunks, so the chunking — and the prep kernel's per-chunk work — is that of the plain scan.
Exact: no term is dropped (the gate-driven warm-up shortcut of MATH.md is not used).

    >>> o, final = run_segments(scan, {"v": v}, cu, h0, segments=8, chunk_size=64)   # doctest: +SKIP
"""
from __future__ import annotations

from typing import Callable

import torch


def check_segments(segments) -> None:
    """The op's `context_parallel` argument: None (off) or a positive number of segments."""
    if segments is not None and (isinstance(segments, bool) or not isinstance(segments, int) or segments < 1):
        raise ValueError(f"context_parallel: expected None or a positive number of segments, got {segments!r}")


def segment_bounds(cu: torch.Tensor, segments: int, chunk_size: int) -> torch.Tensor:
    """cu_seqlens of the segments: each sequence in `segments` runs of whole chunks (the last ones
    may be empty), [N·segments + 1], computed on the device."""
    cu = cu.long()
    lens = cu[1:] - cu[:-1]
    per_segment = (lens + chunk_size - 1) // chunk_size
    per_segment = (per_segment + segments - 1) // segments * chunk_size
    j = torch.arange(segments, device=cu.device)
    starts = torch.minimum(cu[:-1, None] + j * per_segment[:, None], cu[1:, None])
    return torch.cat([starts.flatten(), cu[-1:]]).to(torch.int32)


def run_segments(scan: Callable, values: dict, cu: torch.Tensor, h0: torch.Tensor, segments: int,
                 chunk_size: int, reverse: bool = False):
    """scan(values {name: [1, T, HV, W]}, cu_seqlens, h0 [N', HV, K, W]) -> (out, final [N', HV, K, W])
    runs the chunked scan over packed sequences for any value width W (`out` is whatever else the
    scan returns, e.g. o). `values` are the scan's per-token inputs of the state's width, each of
    which enters the state update linearly (v for the forward; dO and the like for a backward).
    Returns what one scan over the whole sequences returns (out for `values`, final [N, HV, K, V]),
    computed by segments. A `reverse` scan (a backward) carries its state from each sequence's end
    to its start: segments are chained last to first, and the final state is the first segment's."""
    check_segments(segments)
    N, HV, K, V = h0.shape
    cu_seg = segment_bounds(cu, segments, chunk_size)
    eye = torch.eye(K, device=h0.device, dtype=h0.dtype)
    start = torch.cat([eye.expand(N * segments, HV, K, K), h0.new_zeros(N * segments, HV, K, V)], -1)
    widened = {n: torch.cat([v.new_zeros(*v.shape[:-1], K), v], -1) for n, v in values.items()}
    _, maps = scan(widened, cu_seg, start)                       # 1. [M | H] of every segment
    # 2. the scan over segments, one batched S ↦ M S + H (baddbmm) a segment: a call's host time is
    # mostly its small ops, and slices, a matmul and an add were ~10 of them a segment
    maps = maps.view(N, segments, HV, K, K + V).transpose(0, 1).reshape(segments, N * HV, K, K + V)
    starts, state = [None] * segments, h0.reshape(N * HV, K, V)
    order = list(reversed(range(segments)) if reverse else range(segments))
    for s, after in zip(order, order[1:] + [None]):
        starts[s] = state
        if after is not None:  # (the map of the sequence's last segment: its final state is scan 3's)
            state = torch.baddbmm(maps[s, :, :, K:], maps[s, :, :, :K], state)
    starts = torch.stack(starts).view(segments, N, HV, K, V).transpose(0, 1).reshape(N * segments, HV, K, V)
    out, finals = scan(values, cu_seg, starts)  # 3.
    return out, finals.view(N, segments, HV, K, V)[:, 0 if reverse else -1]
