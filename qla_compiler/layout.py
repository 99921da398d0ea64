"""Token layouts: FLA's [B, T, H, ...] (dense or packed with cu_seqlens) ↔ per-sequence blocks.

Dense batches are treated as packed ones with equal lengths, so everything downstream sees
sequences given by (start, length) into the flattened B·T tokens. Padding is zeros: a token with
k = 0, v = 0, β = 0 and g = 0 leaves the state unchanged, which is what makes padded chunks exact.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch


def packed_cu_seqlens(B: int, T: int, cu_seqlens, device, dtype=torch.int64) -> torch.Tensor:
    """cu_seqlens of the flattened B·T tokens: the given one, or T·[0, 1, …, B] for a dense batch."""
    if cu_seqlens is None:
        return torch.arange(B + 1, device=device, dtype=dtype) * T
    return cu_seqlens.to(device=device, dtype=dtype)


def sequence_bounds(B: int, T: int, cu_seqlens, device="cpu"):
    """(starts, lengths) of each sequence in the flattened B·T tokens, as int64 tensors."""
    cu = packed_cu_seqlens(B, T, cu_seqlens, device)
    return cu[:-1], cu[1:] - cu[:-1]


def token_index(starts, lengths, L: int):
    """[N, L] flat token indices and the mask of real tokens."""
    pos = torch.arange(L, device=starts.device)
    mask = pos < lengths[:, None]
    return torch.where(mask, starts[:, None] + pos, 0), mask


def gather(x: torch.Tensor, starts, lengths, L: int) -> torch.Tensor:
    """x [B, T, H, ...] -> [N, L, H, ...], zero past each sequence's length."""
    flat = x.reshape(-1, *x.shape[2:])
    idx, mask = token_index(starts, lengths, L)
    out = flat[idx]
    # a select, not a product with the mask: padding reads token 0, whose gate may be −inf (a reset)
    return torch.where(mask.view(*mask.shape, *([1] * (out.dim() - 2))), out, out.new_zeros(()))


def scatter(y: torch.Tensor, starts, lengths, B: int, T: int) -> torch.Tensor:
    """y [N, L, H, ...] -> [B, T, H, ...], the inverse of gather on the real tokens."""
    idx, mask = token_index(starts, lengths, y.shape[1])
    out = y.new_zeros(B * T, *y.shape[2:])
    out[idx[mask]] = y[mask]
    return out.view(B, T, *y.shape[2:])


def expand_heads(x: torch.Tensor, n_value_heads: int) -> torch.Tensor:
    """Grouped value heads: q/k head h serves value heads h·G … h·G + G − 1 (G = HV / H)."""
    return x.repeat_interleave(n_value_heads // x.shape[2], dim=2) if x.shape[2] != n_value_heads else x


def to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[N, L, H, ...] with L a multiple of C -> [N, H, L/C, C, ...]."""
    N, L, H = x.shape[:3]
    return x.reshape(N, L // C, C, H, *x.shape[3:]).movedim(3, 1)


def from_chunks(x: torch.Tensor) -> torch.Tensor:
    """[N, H, NC, C, ...] -> [N, NC·C, H, ...]."""
    N, H, NC, C = x.shape[:4]
    return x.movedim(1, 3).reshape(N, NC * C, H, *x.shape[4:])


def chunk_slots(B: int, T: int, N: int, C: int) -> int:
    """How many chunks the sequences of B·T tokens can have at most: T·B/C + N (what a tensor
    with one row per chunk is allocated for, from the shapes alone; kernels/forward.chunk_map)."""
    return B * T // C + N


def pack_chunks(x: torch.Tensor, lengths: torch.Tensor, C: int, slots: int) -> torch.Tensor:
    """x [N, H, NC, ...] per (sequence, chunk) -> [slots, H, ...]: each sequence's real chunks in
    token order (as chunk_map counts them), zero rows after; the chunks past a sequence's end are
    dropped."""
    real = torch.arange(x.shape[2], device=x.device) < (lengths[:, None] + C - 1) // C
    rows = x.movedim(2, 1)[real]
    return torch.cat([rows, rows.new_zeros(slots - rows.shape[0], *rows.shape[1:])])


def unpack_chunks(packed: torch.Tensor, lengths: torch.Tensor, C: int, NC: int) -> torch.Tensor:
    """The inverse of pack_chunks on the real chunks: [slots, H, ...] -> [N, H, NC, ...], zero in
    the chunks past each sequence's end."""
    real = torch.arange(NC, device=packed.device) < (lengths[:, None] + C - 1) // C
    out = packed.new_zeros(lengths.shape[0], packed.shape[1], NC, *packed.shape[2:])
    out.movedim(2, 1)[real] = packed[:int(real.sum())]  # (contiguous as pack_chunks' x was)
    return out


def chunk_offsets(cu: torch.Tensor, C: int) -> torch.Tensor:
    """The chunk slot of each sequence's first chunk, [N + 1] (slots count chunks in token order,
    as kernels/forward.chunk_map does), computed on the device."""
    per_seq = (cu[1:] - cu[:-1] + C - 1).div(C, rounding_mode="floor")
    return torch.cat([per_seq.new_zeros(1), per_seq.cumsum(0)]).to(torch.int32)


class TensorMemo:
    """Values computed from one tensor (a call's cu_seqlens), kept while it lives unmodified: every
    layer of a model calls with the same one, and each value is ~20 small device ops otherwise.
    An entry is keyed on the tensor's id (held weakly: the entry goes with the tensor), checked
    against its version counter (an in-place write recomputes), plus the caller's key; with no
    tensor (a dense batch), on the key alone. Nothing is kept during CUDA-graph capture (the ops
    must be recorded, so that a replay recomputes them from the captured tensor's new contents),
    for an inference tensor (no version counter), or where `cache` is False (a compiled graph's
    call: kernels/forward.call_tensors). A value must not hold the tensor itself, or it is never
    freed.

        >>> memo, cu = TensorMemo(), torch.tensor([0, 5, 9])
        >>> a = memo(cu, "lengths", lambda: cu[1:] - cu[:-1])
        >>> memo(cu, "lengths", lambda: cu[1:] - cu[:-1]) is a
        True
    """

    def __init__(self, size: int = 16):
        self.size, self.entries = size, {}

    def __call__(self, tensor: torch.Tensor | None, key, compute: Callable, cache: bool = True):
        if not cache or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()) or \
                (tensor is not None and tensor.is_inference()):
            return compute()
        full, version = ((key,), 0) if tensor is None else ((key, id(tensor)), tensor._version)
        hit = self.entries.get(full)
        if hit is not None and hit[0] == version and (tensor is None or hit[1]() is tensor):
            return hit[2]
        if full not in self.entries and len(self.entries) >= self.size:
            self.entries.pop(next(iter(self.entries)))
        ref = (lambda: None) if tensor is None else weakref.ref(tensor, lambda _: self.entries.pop(full, None))
        value = compute()
        self.entries[full] = (version, ref, value)
        return value
