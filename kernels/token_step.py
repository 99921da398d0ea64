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

from qla_compiler.passes.lower_tilelang import HEAD_DIM_RANGE, PER_CALL_DTYPES, ShapeClass, check_head_dim, tile_width

from . import forward
from .forward import packed_inputs, sm_count

_PLACEHOLDERS: dict = {}  # (device, dtype, HV, K, V) -> a one-slot pool nothing reads or writes


def _placeholder(HV: int, K: int, V: int, dtype, device) -> torch.Tensor:
    key = (str(device), dtype, HV, K, V)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros(1, HV, K, V, dtype=dtype, device=device)
    return _PLACEHOLDERS[key]


def _made(kind: str, shape: tuple, device) -> torch.Tensor:
    """A slot tensor that depends on the batch size alone (−1 everywhere, or 0…N−1), or a dense
    batch's cu_seqlens (B sequences of T tokens). The kernel only reads them."""
    if kind == "nowhere":
        return torch.full(shape, -1, dtype=torch.int32, device=device)
    if kind == "dense":
        B, T = shape
        return torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
    return torch.arange(shape[0], dtype=torch.int32, device=device)


# made once per size and device: each is a launch the decode step's host time (and GPU time) would
# otherwise pay per call
_cached = functools.lru_cache(maxsize=64)(_made)


def _constant(kind: str, shape: tuple, device, cache: bool = True) -> torch.Tensor:
    """_made's tensor, kept for the next call (`cache` False: made afresh, as a compiled call makes
    every tensor it keeps none of: forward.call_tensors)."""
    return (_cached if cache else _made)(kind, shape, device)


def sequence_starts(B: int, T: int, cu_seqlens, device, cache: bool = True) -> torch.Tensor:
    """cu_seqlens as the call passes it on (int32 or int64, as given: the kernel reads either in
    place, index_words), or a dense batch's (`cache`: as _constant's)."""
    if cu_seqlens is None:
        return _constant("dense", (B, T), device, cache)
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        cu_seqlens = cu_seqlens.long()
    return cu_seqlens.to(device=device)


def index_words(cu: torch.Tensor) -> torch.Tensor:
    """cu_seqlens [N+1] as the kernel reads it, [N+1, W] int32 with the value in column 0: an int32
    tensor as [N+1, 1], an int64 one as its words [N+1, 2] (little-endian: the low word first;
    token counts are below 2^31). A view either way: no conversion kernel a call."""
    cu = cu.contiguous()
    return cu.view(torch.int32).view(-1, 2) if cu.dtype == torch.int64 else cu.to(torch.int32).view(-1, 1)


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
        return _constant("nowhere", shape, device, cache)

    def every(n):  # slot n for sequence n
        return _constant("every", (n,), device, cache)

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


# sequences' average tokens from which a call runs the narrow V-block (speculative decoding)
MANY_TOKENS = 4
# the V-blocks block_v chooses between: a warm-up that does not know the batch compiles both
V_BLOCKS = (8, 16)


def check_dims(K: int, V: int) -> None:
    """The head dims the token-step kernel takes: K as the chunk kernels (a state column lives in
    one warp's registers), V from the narrowest tile up, any width: V is only its grid, blocks of
    8 or 16 columns, so GLA's and RetNet's V = 512 decode in one launch."""
    check_head_dim("K (the key head dim)", K)
    if V < HEAD_DIM_RANGE[0]:
        check_head_dim("V (the value head dim)", V)


def block_v(V_tile: int, HV: int, N: int, tokens: int, sms: int) -> int:
    """The V-block of a call of N sequences, `tokens` in all, on a GPU of `sms` SMs; the kernel
    runs a warp per 8 of its columns (TOKEN_THREADS). 16 (two warps) where one token a sequence
    fills the GPU; 8 (one warp) where sequences average MANY_TOKENS or more, or where 16-column
    blocks would leave SMs idle. Measured on the H200 (benchmarks/token_step_bv.py, session 30,
    16/64 and 2/8 heads, 1 to 256 sequences of 1 to 16 tokens): the fastest of 8, 16 and 32 on
    every row; 32 was nowhere the fastest. (Then the two-warp block summed over K through shared
    memory behind block barriers, 24 a token, and the one-warp block took two; since session 31
    neither takes any, passes/token_step.py, and the rule is to be measured again.)

        >>> block_v(128, 64, 1, 1, 132), block_v(128, 8, 1, 1, 132), block_v(128, 64, 256, 1024, 132)
        (16, 8, 8)
    """
    if forward.POLICY.token_block_v:  # (read at the call: launch_policy rebinds it)
        return forward.POLICY.token_block_v
    narrow, wide = V_BLOCKS
    if tokens >= MANY_TOKENS * N or HV * N * (V_tile // wide) < sms:
        return narrow
    return wide


def shape_class(dims, io: torch.dtype, state: torch.dtype, scale: float, sms: int, BV: int | None = None,
                read_in: dict | None = None) -> ShapeClass:
    """The class a call of these dims launches on a GPU of `sms` SMs (`BV`: this V-block instead;
    `read_in`: the dtypes its gates and scalars are read in, by ShapeClass field, read_dtypes)."""
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    BV = BV or block_v(tile_width(dims.V), dims.HV, dims.N, dims.B * dims.T, sms)
    return ShapeClass(H=dims.H, HV=dims.HV, K=dims.K, V=dims.V, BV=BV, io=names[io], scale=scale, state=names[state],
                      **{field: names[dtype] for field, dtype in (read_in or {}).items()})


def read_dtypes(params, inputs: dict, io: torch.dtype) -> dict:
    """The dtypes the kernel reads a call's gates and scalars in, by ShapeClass field (the dtype
    its parameters name, PER_CALL_DTYPES): for each field, the io dtype where every input of it
    comes in that dtype (FLA's own examples pass g and β in bf16 beside bf16 q, k, v), so that no
    conversion is launched; else float32, each converted that is not. The fields apart: vLLM
    passes g in float32 beside β in bf16, and neither is converted.

        >>> from qla_compiler.ir.kernel import Tensor
        >>> params = [Tensor("g", ("1", "T", "HV"), "gates", "in"), Tensor("beta", ("1", "T", "HV"), "scalars", "in")]
        >>> read_dtypes(params, {"g": torch.zeros(1), "beta": torch.zeros(1, dtype=torch.bfloat16)}, torch.bfloat16)
        {'gates': torch.float32, 'scalars': torch.bfloat16}
    """
    given: dict = {}
    for p in params:
        if p.dtype in PER_CALL_DTYPES:
            given.setdefault(p.dtype, []).append(inputs[p.name].dtype)
    return {field: io if all(d == io for d in dtypes) else torch.float32 for field, dtypes in given.items()}


def run(program, inputs: dict, kinds: dict, dims, scale: float, head_logs: dict, cu: torch.Tensor, slot_tensors,
        kernel=None) -> torch.Tensor:
    """Launch the token step (`kernel`: a stand-in with the compiled kernel's parameters, the
    interpreter on the CPU; else the compiled one). Returns o [B, T, HV, V]; writes the states."""
    read, write, final, pool, out = slot_tensors
    (k,) = program.kernels.kernels
    forward.check_grid(k, {}, dims.N)  # (its grid: V-blocks, value heads, sequences)
    v = inputs[next(n for n, kind in kinds.items() if kind == "value")]
    tensors = packed_inputs(inputs, kinds, dims, head_logs, exact=True)
    # (every token's row is the kernel's, a padding entry's zeros too: allocated, not filled)
    o = forward.allocated((1, dims.B * dims.T, dims.HV, dims.V), v.dtype, v.device)
    tensors.update(cu_seqlens=index_words(cu), read_slot=read, write_slot=write, final_slot=final,
                   state_pool=pool, state_out=out, o=o)
    if kernel is None:  # (a stand-in reads the gates and scalars as given)
        from .runtime import load_kernels

        read_in = read_dtypes(k.params, inputs, v.dtype)
        for p in k.params:
            if read_in.get(p.dtype) == torch.float32:
                tensors[p.name] = tensors[p.name].to(torch.float32)
        sms = sm_count(v.device) if v.is_cuda else forward.H200_SMS  # (on the CPU: a stand-in's launch)
        kernel = load_kernels(program, shape_class(dims, v.dtype, pool.dtype, scale, sms, read_in=read_in))[k.name]
    kernel(*[tensors[p.name] for p in k.params])
    return o.view(dims.B, dims.T, dims.HV, dims.V)
