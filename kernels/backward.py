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

import torch

from .forward import run_kernels


def reads_from_forward(program) -> set:
    """The names of the forward's tensors the backward kernels read (the inputs, the chunk map,
    cu_seqlens, the entering states): what they take and none of them makes."""
    ks = program.backward_program.kernels.kernels
    made = {p.name for k in ks for p in k.params if p.role == "out"}
    return {p.name for k in ks for p in k.params if p.role == "in" and p.name not in made}


def backward(program, kept: dict, kinds: dict, dims, scale: float, d_o: torch.Tensor, d_final, segments=None):
    """Gradients of every input (name -> tensor shaped like the input: a key's or a value's in the io
    dtype, the out kernel's, a key's summed over its group; gates and scalars float32) and of the
    initial state [N, HV, K, V], from the cotangents of o [B, T, HV, V] and of the final state.
    With `segments` the reverse scan runs context-parallel, as the forward's can."""
    bprog = program.backward_program
    v_name = next(n for n, k in kinds.items() if k == "value")
    io = kept[v_name].dtype if v_name in kept else d_o.dtype  # the forward's io dtype
    total = dims.B * dims.T
    t = {n: kept[n] for n in reads_from_forward(program) if n in kept}
    t["d_o"] = d_o.reshape(1, total, dims.HV, dims.V).to(io).contiguous()
    d_final = (torch.zeros(dims.N, dims.HV, dims.K, dims.V, device=d_o.device, dtype=torch.float32)
               if d_final is None else d_final.to(torch.float32).contiguous())
    d_h0 = run_kernels(bprog, t, dims, scale, io, kept["cu_seqlens"], d_final, segments)
    grads = {}
    for name, kind in kinds.items():
        g = t[f"d_{name}"]
        if kind == "key" and dims.HV != dims.H:  # per value head: the query/key head's sums its group
            g = g.view(1, total, dims.H, dims.HV // dims.H, dims.K).sum(3)  # accumulates in float32
        grads[name] = g.reshape(dims.B, dims.T, *g.shape[2:])
    return grads, d_h0


class KernelStep(torch.autograd.Function):
    """The GPU path as one differentiable function: the forward kernels (keeping what the backward
    reads), then on backward the backward kernels. Gradients come back in each input's dtype.
    `segments`: context parallelism for both scans (None: off).

        >>> o, final = KernelStep.apply(op, dims, scale, None, cu_seqlens, h0, *inputs)   # doctest: +SKIP
    """

    @staticmethod
    def forward(ctx, op, dims, scale, segments, cu_seqlens, h0, *inputs):
        from .forward import forward, program_for

        named = dict(zip(op.input_names, inputs))
        v = named[op.value_name]
        program = program_for(op.program, dims, v.dtype, v.device)
        o, final, kept = forward(program, named, op.kinds, dims, scale, h0, cu_seqlens, op._head_logs(dims.HV),
                                 segments, keep=True)
        # hold on only to what the backward kernels read (U, for one, is not),
        # through save_for_backward: an in-place write to an input before backward() is an error
        # there, not a silently wrong gradient, and saved-tensor hooks (offloading) apply
        reads = reads_from_forward(program)
        ctx.kept_names = [n for n in kept if n in reads]
        ctx.save_for_backward(*[kept[n] for n in ctx.kept_names])
        ctx.op, ctx.program, ctx.dims, ctx.scale, ctx.segments = op, program, dims, scale, segments
        ctx.dtypes = [x.dtype for x in inputs]
        return o, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_o, d_final):
        op = ctx.op
        kept = dict(zip(ctx.kept_names, ctx.saved_tensors))
        grads, d_h0 = backward(ctx.program, kept, op.kinds, ctx.dims, ctx.scale, d_o, d_final, ctx.segments)
        d_inputs = [grads[n].to(dt) if need else None
                    for n, dt, need in zip(op.input_names, ctx.dtypes, ctx.needs_input_grad[6:])]
        return None, None, None, None, None, (d_h0 if ctx.needs_input_grad[5] else None), *d_inputs
