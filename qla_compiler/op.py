"""The compiled op: FLA's call conventions over a compiled spec.

    >>> import qla_compiler
    >>> op = qla_compiler.compile("specs/gdn.py", target="sm90")
    >>> o, final = op(q, k, v, g, beta, initial_state=h0, output_final_state=True,
    ...               cu_seqlens=cu)                                            # doctest: +SKIP

Arguments are the spec's inputs in the spec's order (positional or by name), then `scale=None`
(K^-1/2), `initial_state=None` [N, HV, K, V], `output_final_state=False`, `cu_seqlens=None`
(packed sequences, B = 1), `use_qk_l2norm_in_kernel=False` and `context_parallel=None` (a number
of segments: each sequence is cut into that many, which run at once; qla_compiler/context_parallel.py).
Returns `(o, final_state or None)`; o has v's dtype and shape [B, T, HV, V]; the state is float32
(float64 for float64 inputs). CUDA tensors in bf16/fp16 run the generated kernels (a spec the sm90
lowering cannot take yet, a per-key gate's, refuses them with a PassError saying why), everything
else the ChunkIR interpreter; `op.reference(...)` runs the spec's own recurrence in float64 with the same
arguments (less context_parallel).

On CPU tensors the op is differentiable (torch.autograd): the chunk program's evaluation is one
autograd.Function whose forward runs the interpreter saving only the state entering each chunk, and
whose backward runs the backward chunk program (passes/autodiff.py) as a reverse scan. Everything
around it — l2-normalising q/k, expanding q/k heads to the value heads, packing/unpacking sequences,
dtype casts — is plain torch, so autograd differentiates it. On CUDA bf16/fp16 tensors that require
grad the same holds with kernels (kernels/backward.KernelStep): the forward kernels keep what the
backward kernels read, and backward() runs the backward program's kernels (context-parallel too,
when the forward was).
"""
from __future__ import annotations

import math

import torch

from .checks import Dims, check_inputs
from .context_parallel import check_segments, run_segments
from .errors import PassError
from .ir.chunk_interp import run_backward, run_chunks
from .ir.recurrence_interp import run_recurrence
from .layout import expand_heads, from_chunks, gather, packed_cu_seqlens, scatter, sequence_bounds, to_chunks

OPTIONS = ("scale", "initial_state", "output_final_state", "cu_seqlens", "use_qk_l2norm_in_kernel",
           "context_parallel")


class CompiledOp:
    def __init__(self, program):
        self.program = program
        rec = program.recurrence
        self.name = rec.name
        self.input_names = rec.input_names
        self.kinds = {i.name: i.kind for i in rec.inputs}
        self.__doc__ = f"{rec.name}({', '.join(self.input_names)}, " + ", ".join(
            f"{o}=..." for o in OPTIONS) + ")\n\n" + (__doc__ or "")

    @property
    def value_name(self) -> str:
        """The spec's value input (its width is V; o has its dtype)."""
        return next(n for n in self.input_names if self.kinds[n] == "value")

    def __repr__(self) -> str:
        return f"<qla op {self.name}({', '.join(self.input_names)}) target={self.program.target}>"

    # ---- argument handling -----------------------------------------------------------------
    def _bind(self, args, named):
        if len(args) > len(self.input_names):
            raise ValueError(f"{self.name}: takes {len(self.input_names)} inputs "
                             f"({', '.join(self.input_names)}), got {len(args)} positional arguments")
        inputs = dict(zip(self.input_names, args))
        for n, x in named.items():
            if n not in self.input_names:
                raise ValueError(f"{self.name}: unknown argument {n!r}; inputs are "
                                 f"{', '.join(self.input_names)}, options {', '.join(OPTIONS)}")
            if n in inputs:
                raise ValueError(f"{n}: given both by position and by name")
            inputs[n] = x
        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise ValueError(f"{self.name}: missing input(s) {', '.join(missing)}")
        return inputs

    def _prepare(self, args, named, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
                 context_parallel=None):
        inputs = self._bind(args, named)
        dims = check_inputs(inputs, self.kinds, initial_state, cu_seqlens, scale)
        check_segments(context_parallel)
        if use_qk_l2norm_in_kernel:
            inputs = {n: (_l2norm(x) if self.kinds[n] == "key" else x) for n, x in inputs.items()}
        scale = dims.K ** -0.5 if scale is None else float(scale)
        return inputs, dims, scale

    # ---- entry points ------------------------------------------------------------------------
    def __call__(self, *args, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                 use_qk_l2norm_in_kernel=False, context_parallel=None, **named):
        inputs, dims, scale = self._prepare(args, named, scale, initial_state, cu_seqlens,
                                            use_qk_l2norm_in_kernel, context_parallel)
        v = inputs[self.value_name]
        work = torch.float64 if v.dtype == torch.float64 else torch.float32
        if self.program.target == "sm90" and v.is_cuda and v.dtype in (torch.bfloat16, torch.float16):
            if self.program.kernels is None:  # (a per-key gate: passes/lowerable.py)
                raise PassError("partition", f"{self.program.no_kernels or 'the program has no kernels'} "
                                f"(got {v.dtype} CUDA tensors, which run the kernels)")
            if _wants_grad(*inputs.values(), initial_state):
                from .kernels.backward import KernelStep  # tilelang is imported only when kernels run

                o, final = KernelStep.apply(self, dims, scale, context_parallel, cu_seqlens, initial_state,
                                            *[inputs[n] for n in self.input_names])
            else:
                from .kernels.forward import forward

                o, final = forward(self.program, inputs, self.kinds, dims, scale, initial_state, cu_seqlens,
                                   self._head_logs(dims.HV), context_parallel)
        elif context_parallel is not None:
            o, final = self._interpret_segments(inputs, dims, scale, initial_state, cu_seqlens, work,
                                                context_parallel)
        else:
            o, final = self._interpret(inputs, dims, scale, initial_state, cu_seqlens, work)
        return o.to(v.dtype), (final.to(work) if output_final_state else None)

    def recurrent(self, *args, **options):
        """The token-step call for decoding, with state pools: qla_compiler/recurrent.py."""
        from .recurrent import recurrent

        return recurrent(self, *args, **options)

    def reference(self, *args, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                  use_qk_l2norm_in_kernel=False, **named):
        """The spec's recurrence, token by token, in float64: the ground truth (slow)."""
        inputs, dims, scale = self._prepare(args, named, scale, initial_state, cu_seqlens,
                                            use_qk_l2norm_in_kernel)
        starts, lengths = sequence_bounds(dims.B, dims.T, cu_seqlens, device=_device(inputs))
        L = int(lengths.max())
        seqs = {n: gather(self._heads(n, x, dims).double(), starts, lengths, L) for n, x in inputs.items()}
        h0 = None if initial_state is None else initial_state.double()
        o, final = run_recurrence(self.program.recurrence, seqs, lengths, scale, h0)
        return scatter(o, starts, lengths, dims.B, dims.T), (final if output_final_state else None)

    # ---- execution ---------------------------------------------------------------------------
    def _head_logs(self, HV: int) -> dict:
        """log of each per-head constant decay, per value head."""
        out = {}
        for c in self.program.recurrence.constants:
            values = c.values(HV)
            bad = next((h for h, x in enumerate(values) if not 0.0 < x <= 1.0), None)
            if bad is not None:
                raise ValueError(f"{c.name}: the head constant must lie in (0, 1] (a decay), but "
                                 f"{c.name}[{bad}] = {values[bad]} for {HV} value heads")
            out[c.name] = [math.log(x) for x in values]
        return out

    def _heads(self, name, x, dims: Dims):
        return expand_heads(x, dims.HV) if self.kinds[name] == "key" else x

    def _interpret_segments(self, inputs, dims: Dims, scale, initial_state, cu_seqlens, work, segments):
        """The interpreter, context-parallel (qla_compiler/context_parallel.py)."""
        total = dims.B * dims.T
        packed = {n: x.reshape(1, total, *x.shape[2:]) for n, x in inputs.items()}
        v_name = self.value_name
        device = packed[v_name].device
        cu = packed_cu_seqlens(dims.B, dims.T, cu_seqlens, device)
        h0 = (torch.zeros(dims.N, dims.HV, dims.K, dims.V, dtype=work, device=device)
              if initial_state is None else initial_state.to(work))

        def scan(values, cu_, h0_):
            d = Dims(1, total, dims.H, dims.HV, dims.K, values[v_name].shape[-1], cu_.numel() - 1)
            return self._interpret({**packed, **values}, d, scale, h0_, cu_, work)

        o, final = run_segments(scan, {v_name: packed[v_name]}, cu, h0, segments, self.program.chunk_size)
        return o.view(dims.B, dims.T, dims.HV, dims.V), final

    def _interpret(self, inputs, dims: Dims, scale, initial_state, cu_seqlens, work):
        chunk = self.program.chunk
        C = chunk.chunk_size
        device = _device(inputs)
        starts, lengths = sequence_bounds(dims.B, dims.T, cu_seqlens, device=device)
        NC = max(1, math.ceil(int(lengths.max()) / C))
        blocks = {n: to_chunks(gather(self._heads(n, x, dims).to(work), starts, lengths, NC * C), C)
                  for n, x in inputs.items()}
        chunk_lengths = (lengths[:, None] - C * torch.arange(NC, device=device)).clamp(0, C)
        head_consts = self._head_logs(dims.HV)
        h0 = (torch.zeros(dims.N, dims.HV, dims.K, dims.V, dtype=work, device=device)
              if initial_state is None else initial_state.to(work))
        params = {"scale": scale}
        if _wants_grad(h0, *blocks.values()):
            names = list(blocks)
            o, final = _ChunkScan.apply((self, names, chunk_lengths, params, head_consts), h0,
                                        *[blocks[n] for n in names])
        else:
            o, final = run_chunks(chunk, blocks, chunk_lengths, params, head_consts, h0)
        return scatter(from_chunks(o), starts, lengths, dims.B, dims.T), final


class _ChunkScan(torch.autograd.Function):
    """(h0, input blocks) -> (o blocks, final state) by the chunk program; backward by its VJP program.

    Saves its inputs and the state entering each chunk, nothing else: the backward program
    recomputes every other forward value from those."""

    @staticmethod
    def forward(ctx, how, h0, *blocks):
        op, names, lengths, params, head_consts = how
        o, final, states = run_chunks(op.program.chunk, dict(zip(names, blocks)), lengths, params,
                                      head_consts, h0, save_states=True)
        ctx.how = how
        ctx.save_for_backward(states, *blocks)
        return o, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_o, d_final):
        op, names, lengths, params, head_consts = ctx.how
        states, *blocks = ctx.saved_tensors
        grads, d_h0 = run_backward(op.program.backward, dict(zip(names, blocks)), lengths, params,
                                   head_consts, states, d_o, d_final)
        d_blocks = [(grads[n] if n in grads else torch.zeros_like(b)) if need else None
                    for n, b, need in zip(names, blocks, ctx.needs_input_grad[2:])]
        return None, (d_h0 if ctx.needs_input_grad[1] else None), *d_blocks


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _device(inputs):
    return next(iter(inputs.values())).device


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """FLA's use_qk_l2norm_in_kernel: x / sqrt(sum(x²) + 1e-6) along the head dim."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)
