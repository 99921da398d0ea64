"""The backward pass on the GPU: the kernels of `Program.backward_program` (the chunk program's
VJP taken through partition and schedule), run after the forward kept what they read.

The forward's scan already stores the state entering every chunk (bf16, `S0_chunks`, for its
output kernel), so the backward reads it instead of recomputing the forward scan. Its own scan
runs from the last chunk to the first, carrying dS from the final state's cotangent; its output
kernel writes every input's gradient per token, keys per value head (summed here over each
group of value heads that shares a query/key head).

    >>> o, final, kept = forward(program, inputs, ..., keep=True)            # doctest: +SKIP
    >>> grads, d_h0 = backward(program, kept, kinds, dims, scale, d_o, d_final)  # doctest: +SKIP
"""
from __future__ import annotations

import torch

from .forward import chunk_offsets, launch, tensor_sizes


def backward(program, kept: dict, kinds: dict, dims, scale: float, d_o: torch.Tensor, d_final):
    """Gradients of every input (name -> tensor shaped like the input, float32) and of the
    initial state [N, HV, K, V], from the cotangents of o [B, T, HV, V] and of the final state."""
    bprog = program.backward_program
    C = program.chunk_size
    v_name = next(n for n, k in kinds.items() if k == "value")
    io = kept[v_name].dtype
    total = dims.B * dims.T
    ks = bprog.kernels.kernels
    made = {p.name for k in ks for p in k.params if p.role == "out"}
    # what the forward kept and the backward reads: the inputs, the chunk map, the entering states
    t = {p.name: kept[p.name] for k in ks for p in k.params
         if p.role == "in" and p.name not in made and p.name in kept}
    t["d_o"] = d_o.reshape(1, total, dims.HV, dims.V).to(io).contiguous()
    cu = kept["cu_seqlens"]
    t["chunk_map"] = kept["chunk_map"]
    sizes = tensor_sizes(dims, C, kept["chunk_map"])
    d_final = (torch.zeros(dims.N, dims.HV, dims.K, dims.V, device=d_o.device, dtype=torch.float32)
               if d_final is None else d_final.to(torch.float32).contiguous())
    t.update(cu_seqlens=cu, chunk_offsets=chunk_offsets(cu, C), initial_state=d_final)
    for k in ks:
        launch(bprog, k, t, dims, scale, io, sizes, dims.V, dims.N)
    grads = {}
    for name, kind in kinds.items():
        g = t[f"d_{name}"]
        if kind == "key":  # per value head: the query/key head's gradient sums its group
            g = g.view(1, total, dims.H, dims.HV // dims.H, dims.K).sum(3)
        grads[name] = g.reshape(dims.B, dims.T, *g.shape[2:])
    return grads, t["final_state"]
