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

The gate's shortcut (`skips`, the generated kernels' path): step 1 need not walk a whole
segment. ‖A_t‖₂ ≤ e^{λ_t} per token (contraction_logs), so a segment's last chunks whose λ sum
to at most −NEGLIGIBLE map any two states to within 2^-24 of their norms of each other: the
scan of those chunks alone from [I | 0] gives a map whose error, M_w (S_w − S_start) with S_w
the true state where the window starts, is below float32's resolution of the state. Each
(segment, value head) walks its shortest such window (window_skips), the whole segment where
none is (weak decay, g = 0: exact), nothing where nothing uses its map (the sequence's last
segment). Strong decay turns step 1 from a scan of everything at width K + V into one of a few
chunks a segment.

All of it runs on the device, no host synchronisation: two scans, torch for the rest, and on the
GPU's compiled path the window search as one kernel (kernels/window_search.py, held to
window_skips here). Segments are whole chunks, so the chunking — and the prep kernel's per-chunk
work — is that of the plain scan.

    >>> o, final = run_segments(scan, {"v": v}, cu, h0, segments=8, chunk_size=64)   # doctest: +SKIP
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import sympy as sp
import torch

# the summed log-norm bound past which a window's start state no longer matters: its difference
# from the true one is scaled by at most 2^-24 (float32's unit roundoff)
NEGLIGIBLE = 24 * math.log(2)


def check_segments(segments, auto: bool = False) -> None:
    """The op's `context_parallel` argument: a positive number of segments (1: no cut), or (where
    `auto`) "auto" or None, the default: the launch's planner chooses (kernels/cp_plan.py). Where
    not `auto` (the interpreter's segments) None is no cut."""
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
    if st.decay in ("gate", "key_gate"):
        lam = token_gate_logs(rec, inputs, HV)
    elif st.decay == "head_constant":
        lam = head_constant_logs(rec, HV, device).expand(T, HV)
    else:
        lam = torch.zeros(T, HV, device=device)
    if st.delta:
        x = inputs[st.write_key].reshape(T, -1, inputs[st.write_key].shape[-1])
        # (float32 or wider as it reads them: a float32 copy of bf16 keys was 0.02 ms at 32768 tokens)
        wide = torch.promote_types(x.dtype, torch.float32)
        norm2 = _per_value_head(torch.linalg.vector_norm(x, dim=-1, dtype=wide).float() ** 2, HV)
        lam = lam + (1 - delta_coefficient(rec, inputs, HV) * norm2).abs().clamp(min=1).log()
    return lam.clamp(min=-2 * NEGLIGIBLE)


def token_gate_logs(rec, inputs: dict, HV: int) -> torch.Tensor:
    """[T, HV] float32: a gate's log decay per token and value head; for a per-key gate its largest
    entry (the slowest key bounds how much the state contracts)."""
    st = rec.structure
    g, T = inputs[st.decay_name], inputs[st.write_key].shape[1]
    if st.decay == "key_gate":
        return _per_value_head(g.amax(-1).reshape(T, -1).float(), HV)
    return g.reshape(T, HV).float()


def head_constant_logs(rec, HV: int, device) -> torch.Tensor:
    """[HV] float32: the log of a head-constant decay (RetNet's γ_h) per value head."""
    (c,) = [c for c in rec.constants if c.name == rec.structure.decay_name]
    return torch.tensor([math.log(x) for x in c.values(HV)], device=device, dtype=torch.float32)


def delta_coefficient(rec, inputs: dict, HV: int) -> torch.Tensor:
    """s_t [T, HV] (float32) of the delta factor I − s_t x_t x_tᵀ, from the call's packed inputs:
    a number times powers of scalar inputs (classify); for GDN β itself, no op."""
    st = rec.structure
    T = inputs[st.write_key].shape[1]
    by_symbol = {i.symbol: inputs[i.name] for i in rec.inputs if i.name in inputs}
    s = None
    for f in sp.Mul.make_args(st.delta_coeff):
        base, power = f.as_base_exp()
        term = float(f) if f.is_Number else by_symbol[base].reshape(T, HV).float()
        term = term if f.is_Number or power == 1 else term ** int(power)
        s = term if s is None else s * term
    return s if torch.is_tensor(s) else torch.full((T, HV), float(s), device=inputs[st.write_key].device)


def _per_value_head(x: torch.Tensor, HV: int) -> torch.Tensor:
    """[T, H] of the query/key heads -> [T, HV]: value head hv reads head hv // (HV / H)."""
    T, H = x.shape
    return x if H == HV else x[:, :, None].expand(T, H, HV // H).reshape(T, HV)


@dataclass(frozen=True)
class SegmentLayout:
    """How the sequences are cut into segments, a function of cu_seqlens, the segment count, the
    chunk size and the token count alone (so kept with the sequence layout: kernels/forward.py),
    and what window_skips needs of it: for each chunk of the segments (M ≥ their number, the rest
    masked) and each direction (`reverse`), the window that starts at it and walks to the
    segment's end nearest the next segment, as chunks [lo, hi) of the segments' chunks; how many
    chunks that window leaves out; and a bias (+inf: the segment's map is unused, leave out
    everything; −inf: no chunk). Windows are summed from per-chunk sums (`tokens`), not from a
    prefix over tokens: a float64 cumsum over T tokens of HV columns took 5.5 ms on the H200 at
    T = 32768 (torch scans a leading dim row by row), six times the scan it plans (NOTES, session 22)."""
    cu: torch.Tensor  # [N·S + 1] int32: the segments' cu_seqlens (segment_bounds)
    offsets: torch.Tensor  # [N·S + 1] int32: each segment's first chunk slot
    segment: torch.Tensor  # [M, 1]: the segment of each chunk
    tokens: torch.Tensor  # [M, C]: each chunk's tokens, T (a row of zeros) past its end
    windows: dict  # reverse -> (lo [M], hi [M] chunk indices, left_out [M, 1], bias [M, 1] float64)
    unused: dict  # reverse -> [N·S] int32: 1 where nothing reads the segment's map
    # (HV, K, V, dtype) -> step 1's start state [I | 0] for every segment, made once with the layout
    # (only read: the scans take it as their initial state)
    identity: dict = field(default_factory=dict)


def segment_layout(cu: torch.Tensor, segments: int, chunk_size: int, T: int) -> SegmentLayout:
    """The SegmentLayout of packed sequences cu [N + 1] of T tokens in all, cut into `segments`,
    computed on the device."""
    C = chunk_size
    cu_seg = segment_bounds(cu, segments, C)
    bounds = cu_seg.long()
    starts, ends = bounds[:-1], bounds[1:]
    n = starts.numel()
    chunks = (ends - starts + C - 1) // C
    last = torch.cumsum(chunks, 0)  # one past each segment's last chunk, counting all segments' chunks
    c = torch.arange(T // C + n, device=cu.device)  # at least as many as the segments' chunks
    seg = torch.searchsorted(last, c, right=True).clamp(max=n - 1)
    j = c - (last - chunks)[seg]  # the chunk's index in its segment
    first = (starts[seg] + j * C).clamp(max=T)
    tokens = first[:, None] + torch.arange(C, device=cu.device)
    tokens = torch.where(tokens < ends[seg][:, None], tokens, T)
    whole, begin = chunks[seg], (last - chunks)[seg]  # the segment's chunks, its first chunk's index
    index = torch.arange(n, device=cu.device) % segments
    windows, unused_segments = {}, {}
    for reverse, lo, hi, left in ((False, c, last[seg], j),  # the window: this chunk to the segment's last
                                  (True, begin, c + 1, whole - 1 - j)):  # its first to this chunk
        # the map of a sequence's last segment (its first in reverse) is unused: every chunk left out
        # (a sequence's later segments may be empty: they, and its final state, use the maps before)
        unused_segments[reverse] = (index == (0 if reverse else segments - 1)).to(torch.int32)
        unused = unused_segments[reverse].bool()[seg]
        bias = torch.where(c < last[-1], torch.where(unused, torch.inf, 0.0), -torch.inf).to(torch.float64)
        windows[reverse] = (lo, hi, torch.where(unused, whole, left)[:, None], bias[:, None])
    offsets = torch.cat([chunks.new_zeros(1), last]).to(torch.int32)
    return SegmentLayout(cu_seg, offsets, seg[:, None], tokens, windows, unused_segments)


def window_skips(contraction: torch.Tensor, layout: SegmentLayout, reverse: bool = False) -> torch.Tensor:
    """[N·segments, HV] int32: how many chunks step 1's walk of each (segment, value head) leaves out
    at its start. The shortest window of the segment's chunks nearest the next segment (for a
    `reverse` scan: the previous one) whose λ (`contraction` [T, HV]) sum to at most −NEGLIGIBLE;
    none (0) where no window does; all where nothing uses the map (the sequence's last segment, its
    first in reverse). On the device, no synchronisation; ~12 ops, the rest is the layout's.

        >>> lam = torch.full((256, 1), -1.0)                   # e^-1 a token: 64 tokens are e^-64
        >>> window_skips(lam, segment_layout(torch.tensor([0, 256]), 2, 64, 256)).flatten().tolist()
        [1, 2]
    """
    lo, hi, left_out, bias = layout.windows[reverse]
    rows = torch.cat([contraction, contraction.new_zeros(1, contraction.shape[1])])
    per_chunk = rows[layout.tokens].sum(1, dtype=torch.float64)  # [M, HV]
    # (the prefix over chunks along the last dim: torch scans a leading dim row by row)
    prefix = torch.nn.functional.pad(per_chunk.t().cumsum(-1), (1, 0)).t()
    ok = (prefix[hi] - prefix[lo] - bias) <= -NEGLIGIBLE
    n, HV = layout.cu.numel() - 1, contraction.shape[1]
    skip = torch.zeros(n, HV, dtype=torch.long, device=contraction.device).scatter_reduce_(
        0, layout.segment.expand(-1, HV), torch.where(ok, left_out, 0), "amax")
    return skip.to(torch.int32)


def run_segments(scan: Callable, values: dict, cu: torch.Tensor, h0: torch.Tensor, segments: int,
                 chunk_size: int, reverse: bool = False, skips: Callable | None = None,
                 layout: SegmentLayout | None = None, widen: bool = True, chain: Callable | None = None):
    """scan(values {name: [1, T, HV, W]}, cu_seqlens, h0 [N', HV, K, W]) -> (out, final [N', HV, K, W])
    runs the chunked scan over packed sequences for any value width W (`out` is whatever else the
    scan returns, e.g. o). `values` are the scan's per-token inputs of the state's width, each of
    which enters the state update linearly (v for the forward; dO and the like for a backward).
    Returns what one scan over the whole sequences returns (out for `values`, final [N, HV, K, V]),
    computed by segments. A `reverse` scan (a backward) carries its state from each sequence's end
    to its start: segments are chained last to first, and the final state is the first segment's.
    With `skips`, step 1 walks each segment's window alone: skips(layout, reverse) gives the chunks
    each (segment, value head) walk leaves out at its start ([N', HV] int32: window_skips of
    contraction_logs, or the GPU's kernels/window_search.py), which the scan takes as a fourth
    argument. `layout`: segment_layout's for these arguments, where the caller keeps it. `widen`:
    step 1 gets the values widened to [0 | v]; False where its scan reads the K zero columns itself
    (a kernel's Tensor.zero_columns: passes/walk_skip.py). `chain`: step 2, chain_starts or what
    computes the same (the GPU's kernels/segment_chain.py)."""
    check_segments(segments)
    N, HV, K, V = h0.shape
    if layout is None:
        layout = segment_layout(cu, segments, chunk_size, next(iter(values.values())).shape[1])
    cu_seg = layout.cu
    start = layout.identity.get((HV, K, V, h0.dtype))
    if start is None:
        eye = torch.eye(K, device=h0.device, dtype=h0.dtype)
        start = torch.cat([eye.expand(N * segments, HV, K, K), h0.new_zeros(N * segments, HV, K, V)], -1)
        layout.identity[(HV, K, V, h0.dtype)] = start
    widened = {n: _widen(v, K) for n, v in values.items()} if widen else values
    windows = () if skips is None else (skips(layout, reverse),)
    _, maps = scan(widened, cu_seg, start, *windows)            # 1. [M | H] of every segment
    starts = (chain or chain_starts)(maps, h0, segments, reverse)   # 2.
    out, finals = scan(values, cu_seg, starts)  # 3.
    return out, finals.view(N, segments, HV, K, V)[:, 0 if reverse else -1]


def chain_starts(maps: torch.Tensor, h0: torch.Tensor, segments: int, reverse: bool = False) -> torch.Tensor:
    """Step 2: every segment's start state [N·S, HV, K, V] from the segments' maps [M | H]
    [N·S, HV, K, K + V] and the sequences' start states h0 [N, HV, K, V]: the scan S ↦ M S + H over
    each sequence's segments, first to last (last to first where `reverse`), one batched matmul a
    segment (a call's host time is mostly its small ops: slices, a matmul and an add were ~10 a segment).

        >>> maps = torch.tensor([[[[2.0, 1.0]]], [[[3.0, 5.0]]]])   # one sequence, 2 segments, K = V = 1
        >>> chain_starts(maps, torch.tensor([[[[1.0]]]]), 2).flatten().tolist()   # 1, then 2·1 + 1
        [1.0, 3.0]
    """
    N, HV, K, V = h0.shape
    maps = maps.view(N, segments, HV, K, K + V).transpose(0, 1).reshape(segments, N * HV, K, K + V)
    starts, state = [None] * segments, h0.reshape(N * HV, K, V)
    order = list(reversed(range(segments)) if reverse else range(segments))
    M, H = maps[..., :K].unbind(0), maps[..., K:].unbind(0)  # (one op each, not one a segment)
    for s, after in zip(order, order[1:] + [None]):
        starts[s] = state
        if after is not None:  # (the map of the sequence's last segment: its final state is scan 3's)
            state = torch.baddbmm(H[s], M[s], state)
    return torch.stack(starts).view(segments, N, HV, K, V).transpose(0, 1).reshape(N * segments, HV, K, V)


def _widen(v: torch.Tensor, K: int) -> torch.Tensor:
    """[0 | v]: K zero columns before v's. Written in place (one pass over the result): zeros and a
    cat wrote it twice, 0.09 ms on the H200 at 32768 tokens of 8 value heads (NOTES, session 22)."""
    out = v.new_empty(*v.shape[:-1], K + v.shape[-1])
    out[..., :K].zero_()
    out[..., K:].copy_(v)
    return out
