"""The token-step kernel's host side: state pools, slots, and the launch (passes/token_step.py
says what the kernel computes).

A serving engine keeps every request's state in a pool `[slots, HV, K, V]` and names, per call,
the slot each sequence reads (`ssm_state_indices`, FLA's and vLLM's name). The pool semantics
become three int32 tensors the kernel reads, computed here on the device with no host
synchronisation (CUDA-graph capture stays possible):

    read_slot[n]     the slot sequence n starts from; −1 the zero state; −2 a padding entry
                     (a negative index), which reads and writes nothing
    write_slot[n, t] where the state after token t goes (speculative decoding: every token's)
    final_slot[n]    where the state after the last token goes (in place: the slot it read)

The same code runs the KernelIR interpreter in place of the compiled kernel on the CPU.
"""
from __future__ import annotations

import functools

import torch

from qla_compiler.passes.lower_tilelang import ShapeClass, tile_width

from .forward import packed_inputs

_PLACEHOLDERS: dict = {}  # (device, dtype, HV, K, V) -> a one-slot pool nothing reads or writes


def _placeholder(HV: int, K: int, V: int, dtype, device) -> torch.Tensor:
    key = (str(device), dtype, HV, K, V)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros(1, HV, K, V, dtype=dtype, device=device)
    return _PLACEHOLDERS[key]


@functools.lru_cache(maxsize=64)
def _constant(kind: str, shape: tuple, device) -> torch.Tensor:
    """A slot tensor that depends on the batch size alone (−1 everywhere, or 0…N−1), made once per
    size and device: each is a launch the decode step's host time would otherwise pay per call.
    The kernel only reads them."""
    if kind == "nowhere":
        return torch.full(shape, -1, dtype=torch.int32, device=device)
    return torch.arange(shape[0], dtype=torch.int32, device=device)


def slots(N: int, dims, device, initial_state, indices, num_accepted, inplace: bool, output_final_state: bool,
          cache: bool = True):
    """(read_slot, write_slot, final_slot, pool, state_out, returned): the kernel's slot tensors,
    the pool it reads, the tensor it writes states into, and the final state the op returns.
    Without an initial state the pool is a placeholder, one per device and shape (`cache` False:
    made afresh, as a compiled call makes every tensor it keeps none of: forward.call_tensors)."""
    i32 = dict(dtype=torch.int32, device=device)
    state_dtype = initial_state.dtype if initial_state is not None else torch.float32
    # (a pool written in place is contiguous, _check_pool says so; one only read may be a view)
    pool = initial_state.contiguous() if initial_state is not None else \
        _placeholder(dims.HV, dims.K, dims.V, state_dtype, device) if cache else \
        torch.zeros(1, dims.HV, dims.K, dims.V, dtype=state_dtype, device=device)
    def nowhere(*shape):
        return _constant("nowhere", shape, device) if cache else torch.full(shape, -1, **i32)

    def every(n):  # slot n for sequence n
        return _constant("every", (n,), device) if cache else torch.arange(n, **i32)

    if indices is not None and indices.dim() == 2:
        # speculative decoding: start after the accepted tokens, keep the state after every token
        first = (num_accepted.to(device=device, dtype=torch.long) - 1) if num_accepted is not None else \
            torch.zeros(N, dtype=torch.long, device=device)
        start = indices.to(**i32).gather(1, first.clamp(min=0)[:, None])[:, 0]
        return torch.where(start >= 0, start, -2), indices.to(**i32).contiguous(), nowhere(N), pool, pool, \
            (pool if output_final_state else None)
    if indices is None:
        read = every(N) if initial_state is not None else nowhere(N)
    else:
        idx = indices.to(**i32)
        read = torch.where(idx >= 0, idx, -2)
    if inplace:  # (only with indices [N]: _check_pool)
        return read, nowhere(N, 1), torch.where(idx >= 0, idx, -1), pool, pool, (pool if output_final_state else None)
    if output_final_state:
        # without indices every sequence's final state is written (an empty one's too); a padding
        # entry's is not, and reads as zeros
        out = (torch.empty if indices is None else torch.zeros)(N, dims.HV, dims.K, dims.V, dtype=state_dtype,
                                                                 device=device)
        return read, nowhere(N, 1), every(N), pool, out, out
    return read, nowhere(N, 1), nowhere(N), pool, pool, None


def block_v(K_tile: int) -> int:
    """The V-block: the state block, xS and qS live in registers (K×BV each)."""
    return 16 if K_tile > 128 else 32


def shape_class(dims, io: torch.dtype, state: torch.dtype, scale: float) -> ShapeClass:
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    return ShapeClass(H=dims.H, HV=dims.HV, K=dims.K, V=dims.V, BV=block_v(tile_width(dims.K)), io=names[io],
                      scale=scale, state=names[state])


def run(program, inputs: dict, kinds: dict, dims, scale: float, head_logs: dict, cu: torch.Tensor, slot_tensors,
        kernel=None) -> torch.Tensor:
    """Launch the token step (`kernel`: a stand-in with the compiled kernel's parameters, the
    interpreter on the CPU; else the compiled one). Returns o [B, T, HV, V]; writes the states."""
    read, write, final, pool, out = slot_tensors
    (k,) = program.kernels.kernels
    v = inputs[next(n for n, kind in kinds.items() if kind == "value")]
    tensors = packed_inputs(inputs, kinds, dims, head_logs, exact=kernel is not None)
    o = torch.zeros(1, dims.B * dims.T, dims.HV, dims.V, dtype=v.dtype, device=v.device)
    tensors.update(cu_seqlens=cu.to(torch.int32), read_slot=read, write_slot=write, final_slot=final,
                   state_pool=pool, state_out=out, o=o)
    if kernel is None:
        from .runtime import load_kernels

        kernel = load_kernels(program, shape_class(dims, v.dtype, pool.dtype, scale))[k.name]
    kernel(*[tensors[p.name] for p in k.params])
    return o.view(dims.B, dims.T, dims.HV, dims.V)
