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

The gate's shortcut (`contraction`, the generated kernels' path): step 1 need not walk a whole
segment. ‖A_t‖₂ ≤ e^{λ_t} per token (contraction_logs), so a segment's last chunks whose λ sum
to at most −NEGLIGIBLE map any two states to within 2^-24 of their norms of each other: the
scan of those chunks alone from [I | 0] gives a map whose error, (M_w (S_w − S_start), S_w the
true state where the window starts) is below float32's resolution of the state. Each (segment,
value head) walks its shortest such window (window_skips), the whole segment where none is
(weak decay, g = 0: exact), nothing where nothing uses its map (the sequence's last segment). Strong decay turns
step 1 from a scan of everything at width K + V into one of a few chunks a segment.

All of it is torch on the device plus two scans: no host synchronisation. Segments are whole
chunks, so the chunking — and the prep kernel's per-chunk work — is that of the plain scan.

    >>> o, final = run_segments(scan, {"v": v}, cu, h0, segments=8, chunk_size=64)   # doctest: +SKIP
"""
from __future__ import annotations

import math
from typing import Callable

import sympy as sp
import torch

# the summed log-norm bound past which a window's start state no longer matters: its difference
# from the true one is scaled by at most 2^-24 (float32's unit roundoff)
NEGLIGIBLE = 24 * math.log(2)


def check_segments(segments, auto: bool = False) -> None:
    """The op's `context_parallel` argument: None (off), a positive number of segments, or (where
    `auto`) "auto": the launch's planner chooses (kernels/cp_plan.py)."""
    if auto and segments == "auto":
        return
    if segments is not None and (isinstance(segments, bool) or not isinstance(segments, int) or segments < 1):
        choices = 'None, "auto"' if auto else "None"
        raise ValueError(f"context_parallel: expected {choices} or a positive number of segments, got {segments!r}")


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


def contraction_logs(rec, inputs: dict, HV: int) -> torch.Tensor:
    """λ [T, HV] (float32): per token and value head, log ‖A_t‖₂ or more, from the recurrence's
    structure (RecurrenceIR.structure) and the call's inputs packed [1, T, ...] by name: log of the
    decay (its largest entry for a per-key gate; a head constant's own log) plus, with the delta
    factor, log max(1, |1 − s_t ‖x_t‖²|) (the eigenvalues of I − s x xᵀ are 1 and 1 − s ‖x‖²).
    Floored at −2·NEGLIGIBLE (a looser bound, so still one; g = −inf stays finite).

        >>> from qla_compiler import compile_spec
        >>> rec = compile_spec("gdn").recurrence
        >>> k = torch.tensor([[[[0.6, 0.8]]]])                          # ‖k‖ = 1
        >>> g, beta = torch.tensor([[[-0.5]]]), torch.tensor([[[1.0]]])
        >>> contraction_logs(rec, {"k": k, "g": g, "beta": beta}, HV=1)
        tensor([[-0.5000]])
    """
    st = rec.structure
    T, device = inputs[st.write_key].shape[1], inputs[st.write_key].device
    lam = torch.zeros(T, HV, device=device)
    if st.decay == "gate":
        lam = lam + inputs[st.decay_name].float().reshape(T, HV)
    elif st.decay == "key_gate":
        lam = lam + _per_value_head(inputs[st.decay_name].float().amax(-1).reshape(T, -1), HV)
    elif st.decay == "head_constant":
        (c,) = [c for c in rec.constants if c.name == st.decay_name]
        lam = lam + torch.tensor([math.log(x) for x in c.values(HV)], device=device)
    if st.delta:
        x = inputs[st.write_key].float()
        norm2 = _per_value_head((x * x).sum(-1).reshape(T, -1), HV)
        by_symbol = {i.symbol: inputs[i.name] for i in rec.inputs if i.name in inputs}
        s = 1.0
        for f in sp.Mul.make_args(st.delta_coeff):  # a number times powers of scalar inputs (classify)
            base, power = f.as_base_exp()
            s = s * (float(f) if f.is_Number else by_symbol[base].float().reshape(T, HV) ** int(power))
        lam = lam + torch.log((1 - s * norm2).abs().clamp(min=1))
    return lam.clamp(min=-2 * NEGLIGIBLE)


def _per_value_head(x: torch.Tensor, HV: int) -> torch.Tensor:
    """[T, H] of the query/key heads -> [T, HV]: value head hv reads head hv // (HV / H)."""
    return x.repeat_interleave(HV // x.shape[1], dim=1)


def window_skips(contraction: torch.Tensor, cu_seg: torch.Tensor, cu: torch.Tensor, segments: int,
                 chunk_size: int, reverse: bool = False) -> torch.Tensor:
    """[N·segments, HV] int32: how many chunks step 1's walk of each (segment, value head) leaves out
    at its start. The shortest window of the segment's chunks nearest the next segment (for a
    `reverse` scan: the previous one) whose λ (`contraction` [T, HV]) sum to at most −NEGLIGIBLE;
    none (0) where no window does; all where nothing uses the map (the sequence's last segment, its
    first in reverse). On the device, no synchronisation.

        >>> lam = torch.full((256, 1), -1.0)                   # e^-1 a token: 64 tokens are e^-64
        >>> cu = torch.tensor([0, 256])
        >>> window_skips(lam, segment_bounds(cu, 2, 64), cu, 2, 64).flatten().tolist()
        [1, 2]
    """
    C, T, HV = chunk_size, *contraction.shape
    cu_seg, cu = cu_seg.long(), cu.long()
    n = cu_seg.numel() - 1
    starts, ends = cu_seg[:-1], cu_seg[1:]
    chunks = (ends - starts + C - 1) // C
    last = torch.cumsum(chunks, 0)  # one past each segment's last chunk, counting all segments' chunks
    c = torch.arange(T // C + n, device=cu.device)  # at least as many as the segments' chunks
    seg = torch.searchsorted(last, c, right=True).clamp(max=n - 1)
    j = c - (last - chunks)[seg]  # the chunk's index in its segment
    first = (starts[seg] + j * C).clamp(max=T)
    prefix = torch.cat([contraction.new_zeros(1, HV, dtype=torch.float64), contraction.double().cumsum(0)])
    if reverse:  # the window is chunks 0..j, walked last to first: the chunks after it are left out
        span, left_out = prefix[torch.minimum(first + C, ends[seg])] - prefix[starts[seg]], chunks[seg] - 1 - j
    else:  # the window is chunks j..last: the chunks before it are left out
        span, left_out = prefix[ends[seg]] - prefix[first], j
    ok = (span <= -NEGLIGIBLE) & (c < last[-1])[:, None]
    skip = torch.zeros(n, HV, dtype=torch.long, device=cu.device).scatter_reduce(
        0, seg[:, None].expand(-1, HV), torch.where(ok, left_out[:, None], 0), "amax")
    # (a sequence's later segments may be empty: they, and its final state, still use the maps before)
    unused = torch.arange(n, device=cu.device) % segments == (0 if reverse else segments - 1)
    return torch.where(unused[:, None], chunks[:, None], skip).to(torch.int32)


def run_segments(scan: Callable, values: dict, cu: torch.Tensor, h0: torch.Tensor, segments: int,
                 chunk_size: int, reverse: bool = False, contraction: torch.Tensor | None = None):
    """scan(values {name: [1, T, HV, W]}, cu_seqlens, h0 [N', HV, K, W]) -> (out, final [N', HV, K, W])
    runs the chunked scan over packed sequences for any value width W (`out` is whatever else the
    scan returns, e.g. o). `values` are the scan's per-token inputs of the state's width, each of
    which enters the state update linearly (v for the forward; dO and the like for a backward).
    Returns what one scan over the whole sequences returns (out for `values`, final [N, HV, K, V]),
    computed by segments. A `reverse` scan (a backward) carries its state from each sequence's end
    to its start: segments are chained last to first, and the final state is the first segment's.
    With `contraction` (contraction_logs), step 1 walks each segment's window alone: the scan then
    takes a fourth argument, the chunks each (sequence, value head) walk leaves out at its start
    ([N', HV] int32, window_skips)."""
    check_segments(segments)
    N, HV, K, V = h0.shape
    cu_seg = segment_bounds(cu, segments, chunk_size)
    eye = torch.eye(K, device=h0.device, dtype=h0.dtype)
    start = torch.cat([eye.expand(N * segments, HV, K, K), h0.new_zeros(N * segments, HV, K, V)], -1)
    widened = {n: torch.cat([v.new_zeros(*v.shape[:-1], K), v], -1) for n, v in values.items()}
    windows = () if contraction is None else (window_skips(contraction, cu_seg, cu, segments, chunk_size, reverse),)
    _, maps = scan(widened, cu_seg, start, *windows)            # 1. [M | H] of every segment
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
