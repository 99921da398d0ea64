"""The backward pass on the GPU: the kernels of `Program.backward_program` (the chunk program's
VJP taken through partition and schedule), run after the forward kept what they read.

The forward's scan already stores the state entering every chunk (bf16, `S0_chunks`, for its
output kernel), so the backward reads it instead of recomputing the forward scan; likewise what the
forward's prep and scan stored per token (W, v_new, the cumulative gates, and the inverse T_r,
which the training forward stores for this). Its own scan
runs from the last chunk to the first, carrying dS from the final state's cotangent; its output
kernel writes every input's gradient per token, keys per value head (summed here over each
group of value heads that shares a query/key head).

    >>> o, final, kept = forward(program, inputs, ..., segments, keep=True)            # doctest: +SKIP
    >>> grads, d_h0 = backward(program, kept, kinds, dims, scale, d_o, d_final, segments)  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from qla_compiler.errors import NotFusable
from qla_compiler.layout import chunk_slots
from qla_compiler.passes.lower_tilelang import tile_width

from . import forward
from .forward import run_kernels


def reads_from_forward(program) -> set:
    """The names of the forward's tensors the backward kernels read (the inputs, the chunk map,
    cu_seqlens, the entering states): what they take and none of them makes."""
    ks = program.backward_program.kernels.kernels
    made = {p.name for k in ks for p in k.params if p.role == "out"}
    return {p.name for k in ks for p in k.params if p.role == "in" and p.name not in made}


def backward(program, kept: dict, kinds: dict, dims, scale: float, d_o: torch.Tensor, d_final, segments=None,
             cache: bool = True):
    """Gradients of every input (name -> tensor shaped like the input: a key's or a value's in the io
    dtype, the out kernel's, a key's summed over its group; gates and scalars float32) and of the
    initial state [N, HV, K, V], from the cotangents of o [B, T, HV, V] and of the final state.
    With `segments` the reverse scan runs context-parallel, as the forward's can. Where the
    backward's kernels do not fit at the head dims' tiles (Program.backward_blocks), it runs on
    blocks of V's columns (K = V = 256 GDN), or of K's (K = 256 GLA), each a problem of its own
    columns. `cache`: as forward.run_kernels'."""
    keys, width, each = program.backward_blocks()
    v_name = next(n for n, k in kinds.items() if k == "value")
    io = kept[v_name].dtype if v_name in kept else d_o.dtype  # the forward's io dtype
    t = {n: kept[n] for n in reads_from_forward(each) | {"cu_seqlens"} if n in kept}
    (cotangent,) = each.backward_program.chunk.cotangent_of  # the input d o binds to
    t[cotangent] = d_o.reshape(1, dims.B * dims.T, dims.HV, dims.V).to(io).contiguous()
    d_final = (torch.zeros(dims.N, dims.HV, dims.K, dims.V, device=d_o.device, dtype=torch.float32)
               if d_final is None else d_final.to(torch.float32).contiguous())
    params = {p.name: p for k in each.backward_program.kernels.kernels for p in k.params}
    if keys >= dims.K:
        return _on_columns(width, each, params, t, kinds, dims, scale, io, d_final, segments, cache)
    parts = []
    for k0, w in column_blocks(dims.K, keys):
        sub = dataclasses.replace(dims, K=w)
        block = {n: _block(x, params.get(n), "K", k0, w) for n, x in t.items()}
        parts.append(_on_columns(width, each, params, block, kinds, sub, scale, io,
                                 d_final[..., k0:k0 + w, :].contiguous(), segments, cache))
    # a key's (and a per-key gate's) gradient is its columns'; every other input's the blocks' sum
    return _joined(parts, kinds, ("key", "key_gate"), io), torch.cat([d for _, d in parts], dim=-2)


def _on_columns(width: int, each, params: dict, t: dict, kinds: dict, dims, scale: float, io, d_final, segments,
                cache: bool):
    """backward() on V's column blocks of `width` (one, where that is V whole)."""
    if width >= dims.V:
        return _backward(each, t, kinds, dims, scale, io, d_final, segments, cache)
    parts = []
    for v0, w in column_blocks(dims.V, width):
        sub = dataclasses.replace(dims, V=w)
        cols = {n: _block(x, params.get(n), "V", v0, w) for n, x in t.items()}
        parts.append(_backward(each, cols, kinds, sub, scale, io, d_final[..., v0:v0 + w].contiguous(), segments,
                               cache))
    # a value's gradient is its columns'; every other input's the blocks' sum
    return _joined(parts, kinds, ("value",), io), torch.cat([d for _, d in parts], dim=-1)


def _joined(parts: list, kinds: dict, placed: tuple, io) -> dict:
    """Each input's gradient from the blocks' (`parts`: (grads, d_h0) of each): side by side along
    the last dim for the kinds `placed`, else the sum of the blocks' float32 partials (schedule's
    `partial`), added in place (stacking them first copied 4 GB at K = V = 256, 16/64 heads, 32768
    tokens), then a key's or a value's in the io dtype."""
    grads = {}
    for name, kind in kinds.items():
        blocks = [g[name] for g, _ in parts]
        if kind in placed:
            grads[name] = torch.cat(blocks, dim=-1)
            continue
        total = blocks[0].float()
        for b in blocks[1:]:
            total += b
        grads[name] = total.to(io if kind in ("key", "value") else blocks[0].dtype)
    return grads


def column_blocks(V: int, width: int) -> list:
    """(first column, width) of each block of a head dim's columns (V's, or K's) the backward runs
    on (the last one may be narrower; precompile compiles each width's classes).

    >>> column_blocks(256, 64), column_blocks(200, 128), column_blocks(128, 128)
    ([(0, 64), (64, 64), (128, 64), (192, 64)], [(0, 128), (128, 72)], [(0, 128)])
    """
    return [(v0, min(V, v0 + width) - v0) for v0 in range(0, V, width)]


def _block(x: torch.Tensor, param, dim: str, start: int, width: int) -> torch.Tensor:
    """Columns [start, start + width) of head dim `dim` of a tensor the backward kernels read as
    `param` (its padding columns too, where the kernels read it at the tile's width); the tensor
    itself where it has no such dim."""
    if param is None or dim not in param.shape:
        return x
    axis = param.shape.index(dim)
    n = tile_width(width) if param.padded else width
    return x.narrow(axis, start, n).contiguous()


def backward_program_of(program, segments=None, wide: bool = False):
    """The backward program a call of `program` (a block's, where it runs on blocks) runs: with
    its scan warp-specialised where the launch policy says so (forward.backward_scan_roles) and
    the schedule can (not where the entering states are kept in float32: GLA's), at V-block 128
    where `wide` (forward.runs_wide, the fused forward's rule: Program.backward_wide_roles_program)
    and else at the narrow one's V-block unless the policy says "wide" (the wide one alone). Under
    context parallelism (`segments`) the wide one alone, where runs_wide says so for the N·segments
    sequences (forward.cut_wide), its windows program walking the windows; else the plain scan's
    kernels."""
    on = forward.backward_scan_roles()
    if on and (wide or not segments):
        narrow = ("backward_roles_program",) if on is True and not segments else ()
        for variant in ("backward_wide_roles_program",) * wide + narrow:
            try:
                return getattr(program, variant)
            except NotFusable:
                pass
    return program.backward_program


def _backward(bprog_of, t: dict, kinds: dict, dims, scale: float, io, d_final, segments, cache: bool = True):
    """backward() on the whole of V (t: the kernels' tensors by name, the cotangent of o among them)."""
    # (the rule only where the policy puts the scan on roles, as by default: a few integer steps)
    wide = bool(forward.backward_scan_roles()) and \
        forward.runs_wide(dims.K, dims.V, dims.HV, dims.N, forward.sm_count(t["chunk_map"].device), segments)
    bprog = backward_program_of(bprog_of, segments, wide)
    d_h0 = run_kernels(bprog, t, dims, scale, io, t["cu_seqlens"], d_final, segments, cache)
    role = {x: r for r, x in bprog.chunk.gradient_of.items()}  # input -> its gradient's output role
    holds = bprog.kernels.results()  # output role -> the tensor an out kernel writes it to
    grads = {}
    for name, kind in kinds.items():
        g = t[holds[role[name]]]
        if kind == "key" and dims.HV != dims.H:  # per value head: the query/key head's sums its group
            g = group_sum(g, dims.HV // dims.H, cache)
        grads[name] = g.reshape(dims.B, dims.T, *g.shape[2:])
    return grads, d_h0


def group_sum(x: torch.Tensor, G: int, cache: bool = True) -> torch.Tensor:
    """x [1, T, H·G, K] summed over each group of G value heads -> [1, T, H, K], as one GEMM against
    G stacked identities (float32 accumulation). On the H200 (benchmarks/group_sum.py, session 20:
    16/64 heads, 32768 tokens, bf16) 0.170 ms against torch's sum over the group's 0.261, at the
    same error: a training step sums dq and dk so. `cache`: as forward.run_kernels'.

        >>> group_sum(torch.ones(1, 3, 4, 2), 2)[0, 0]
        tensor([[2., 2.],
                [2., 2.]])
    """
    _, T, HV, K = x.shape
    # a compiled graph's call makes them (a tensor outliving it breaks CUDA-graph trees' recording);
    # an eager call keeps them: eye and repeat were four launches a training step, ~0.2 ms of its
    # host time under torch.profiler (H200, session 27)
    stacked = (_stacked_identities if cache else _stacked_identities.__wrapped__)(K, G, x.dtype, x.device)
    return (x.reshape(T * HV // G, G * K) @ stacked).view(1, T, HV // G, K)


@functools.lru_cache(maxsize=16)
def _stacked_identities(K: int, G: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.eye(K, dtype=dtype, device=device).repeat(G, 1)


def kept(program) -> list:
    """The tensors the training forward's kernels make that the backward kernels read, by name in
    kernel order: what a training forward keeps for its backward (`program`: the call's variant,
    forward.program_for). The rest the backward reads — the inputs, the chunk map, cu_seqlens — it
    rebuilds from the call's arguments (forward.call_tensors)."""
    reads = reads_from_forward(program)
    return [p.name for k in program.training_program.kernels.kernels for p in k.params
            if p.role == "out" and p.name in reads]


def kept_shapes(program, dims, io, segments=None) -> list:
    """(shape, dtype) of each of `kept(program)`, from the call's dims alone (what the forward's
    launches allocate; the custom op's fake implementation)."""
    names = set(kept(program))
    C = program.chunk_size
    KP, VP = tile_width(dims.K), tile_width(dims.V)
    out = []
    for k in program.training_program.kernels.kernels:
        n_seqs = dims.N * (segments or 1) if k.walks_chunks else dims.N  # the scan runs segments as sequences
        sizes = {"1": 1, "T": dims.B * dims.T, "HV": dims.HV, "H": dims.H, "C": C, "N": n_seqs,
                 "CH": chunk_slots(dims.B, dims.T, dims.N, C), "K": dims.K, "V": dims.V}
        for p in k.params:
            if p.role == "out" and p.name in names:
                tiles = dict(K=KP, V=VP) if p.padded else {}
                shape = tuple(dict(sizes, **tiles)[d] for d in p.shape)
                out.append((shape, io if p.dtype == "io" else torch.float32))
    return out
