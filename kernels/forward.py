"""The forward pass on the GPU: lay the inputs out as the kernels expect, launch them in order.

Everything here is shape arithmetic and torch ops on the device: no value is read back to the
host, so a call can be captured in a CUDA graph and replayed with new inputs.
Dense batches [B, T, ...] are viewed as one packed batch [1, B·T, ...] with cu_seqlens = T·[0..B].
"""
from __future__ import annotations

import functools

import torch

from qla_compiler.context_parallel import run_segments
from qla_compiler.layout import packed_cu_seqlens
from qla_compiler.passes.lower_tilelang import HEAD_DIMS, ShapeClass

from .runtime import load_kernels

IO_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_head_dims(K: int, V: int) -> None:
    for name, d in (("K (the key head dim)", K), ("V (the value head dim)", V)):
        if d not in HEAD_DIMS:
            raise ValueError(f"{name} = {d} is not supported by the sm90 kernels; supported: "
                             f"{', '.join(map(str, HEAD_DIMS))} (float32 inputs and CPU tensors run the "
                             "interpreter for any size)")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_block_v(V: int, HV: int, N: int, device) -> int:
    """The V-block for this GPU (see block_v)."""
    return block_v(V, HV, N, _sm_count(device.index if device.index is not None else torch.cuda.current_device()))


def block_v(V: int, HV: int, N: int, sms: int) -> int:
    """The widest V-block that still gives ~70% of the SMs a CTA (more CTAs beat wider tiles when
    the scan is short of parallelism)."""
    for bv in (64, 32):
        if bv <= V and (V // bv) * HV * N >= 0.7 * sms:
            return bv
    return 32


@functools.lru_cache(maxsize=64)
def _on_device(values: tuple, device) -> torch.Tensor:
    """Constants uploaded once (an upload inside a CUDA-graph capture would fail)."""
    return torch.tensor(values, device=device, dtype=torch.float32)


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


def forward(program, inputs: dict, kinds: dict, dims, scale: float, initial_state, cu_seqlens,
            head_logs: dict, context_parallel=None):
    C = program.chunk_size
    check_head_dims(dims.K, dims.V)
    v_name = next(n for n, k in kinds.items() if k == "value")
    io = inputs[v_name].dtype
    device = inputs[v_name].device
    total = dims.B * dims.T
    packed = {}
    for n, x in inputs.items():
        x = x.reshape(1, total, *x.shape[2:])
        packed[n] = x.contiguous() if kinds[n] in ("key", "value") else x.to(torch.float32).contiguous()
    cu = packed_cu_seqlens(dims.B, dims.T, cu_seqlens, device, torch.int32)
    h0 = (torch.zeros(dims.N, dims.HV, dims.K, dims.V, device=device, dtype=torch.float32)
          if initial_state is None else initial_state.to(torch.float32).contiguous())
    tensors = dict(packed)
    for name, logs in head_logs.items():
        tensors[f"log_{name}"] = _on_device(tuple(logs), device)
    # the kernel that loops over chunks is the scan; the others are parallel over chunks and run first
    scan_kernel = next(k for k in program.kernels.kernels if k.loop)
    prep = [k for k in program.kernels.kernels if not k.loop]

    def shape(width, n_seqs):
        return ShapeClass(H=dims.H, HV=dims.HV, K=dims.K, V=width, io=IO_DTYPES[io], scale=scale,
                          BV=choose_block_v(width, dims.HV, n_seqs, device))

    if prep:  # per chunk, independent of V and of how sequences are cut into segments
        kernels = load_kernels(program, shape(dims.V, dims.N))
        tensors["chunk_map"] = chunk_map(cu, total, C)
        for k in prep:
            for p in k.params:
                if p.role == "out":
                    tensors[p.name] = _empty(p, dims, C, total, io, device)
            kernels[k.name](*[tensors[p.name] for p in k.params])

    def scan(values, cu_, h0_):
        width, n_seqs = values.shape[-1], h0_.shape[0]
        kernel = load_kernels(program, shape(width, n_seqs))[scan_kernel.name]
        t = dict(tensors, cu_seqlens=cu_, initial_state=h0_.contiguous(), **{v_name: values.contiguous()})
        t["o"] = torch.empty(1, total, dims.HV, width, device=device, dtype=io)
        t["final_state"] = torch.empty(n_seqs, dims.HV, dims.K, width, device=device, dtype=torch.float32)
        kernel(*[t[p.name] for p in scan_kernel.params])
        return t["o"], t["final_state"]

    if context_parallel:
        o, final = run_segments(scan, packed[v_name], cu, h0, context_parallel, C)
    else:
        o, final = scan(packed[v_name], cu, h0)
    return o.view(dims.B, dims.T, dims.HV, dims.V), final


def _empty(param, dims, C, total, io, device):
    sizes = {"1": 1, "T": total, "HV": dims.HV, "H": dims.H, "K": dims.K, "V": dims.V, "C": C, "N": dims.N}
    dtype = io if param.dtype == "io" else torch.float32
    return torch.empty(*[sizes[d] for d in param.shape], device=device, dtype=dtype)
