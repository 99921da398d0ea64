"""The compiled op: FLA's call conventions over a compiled spec.

    >>> import qla_compiler
    >>> op = qla_compiler.compile("specs/gdn.py", target="sm90")
    >>> o, final = op(q, k, v, g, beta, initial_state=h0, output_final_state=True,
    ...               cu_seqlens=cu)                                            # doctest: +SKIP

Arguments are the spec's inputs in the spec's order (positional or by name), then `scale=None`
(K^-1/2), `initial_state=None` [N, HV, K, V], `output_final_state=False`, `cu_seqlens=None`
(packed sequences, B = 1), `use_qk_l2norm_in_kernel=False` and `context_parallel="auto"` (each
sequence is cut into that many segments, which run at once: qla_compiler/context_parallel.py; "auto", the
default, and None: as many as the GPU kernels' planner finds fastest for the call's shape, kernels/cp_plan.py,
none on the interpreter; 1: no cut).
Returns `(o, final_state or None)`; o has v's dtype and shape [B, T, HV, V]; the state is float32
(float64 for float64 inputs). CUDA tensors in bf16/fp16 run the generated kernels (a spec the sm90
lowering cannot take yet, a per-key gate's, refuses them with a PassError saying why), everything
else the ChunkIR interpreter; `op.reference(...)` runs the spec's own recurrence in float64 with the same
arguments (less context_parallel).

On CPU tensors the op is differentiable (torch.autograd): the interpreter is one custom op,
qla::interpret (qla_compiler/custom_ops.py), whose forward saves only the state entering each
chunk, and whose backward, qla::interpret_backward, runs the backward chunk program
(passes/autodiff.py) as a reverse scan. Everything around it — l2-normalising q/k, context
parallelism's segments, dtype casts — is plain torch, so autograd differentiates it. On CUDA
bf16/fp16 tensors the same holds with kernels (qla::run_kernels): the training forward's kernels
keep what the backward kernels read, and backward() runs the backward program's kernels
(context-parallel too, when the forward was). The custom ops have fake implementations, so
`torch.compile(fullgraph=True)` traces a call with no graph break (forward and backward); the op
itself (`qla_compiler.compile`) is built outside the compiled region.
"""
from __future__ import annotations

import contextlib
import math

import torch

from . import custom_ops
from .checks import Dims, check_inputs
from .context_parallel import check_segments, run_segments
from .errors import PassError
from .ir.recurrence_interp import run_recurrence
from .kernels.cp_plan import planned_segments
from .layout import expand_heads, gather, packed_cu_seqlens, scatter, sequence_bounds
from .passes.key_blocks import key_blocks
from .passes.lower_tilelang import HEAD_DIM_RANGE
from .passes.schedule_build import columns_mixed

OPTIONS = ("scale", "initial_state", "output_final_state", "cu_seqlens", "use_qk_l2norm_in_kernel",
           "context_parallel", "cp_context")

# An inference call with at most this many tokens per sequence on average runs the token-step kernel
# (op.recurrent) instead of the chunk pipeline: decode and speculative-decoding batches. Measured on
# the H200 (qla-bench --decode, session 12, 256 sequences at 16/64 heads, GPU ms): 1 token a
# sequence 0.66 against the chunk pipeline's 2.54, 2 tokens 0.84 / 2.58, 4 tokens 1.18 / 2.62,
# 8 tokens 1.99 / 2.74, 16 tokens 3.74 / 2.89: the paths cross between 8 and 16.
DECODE_TOKENS = 8


@contextlib.contextmanager
def decode_tokens(n: int):
    """Within it, the bound is `n` (0: chunk calls never run the token step; qla-bench --decode
    times both paths)."""
    global DECODE_TOKENS
    before, DECODE_TOKENS = DECODE_TOKENS, n
    try:
        yield
    finally:
        DECODE_TOKENS = before


WIDEST_HEAD_DIM = HEAD_DIM_RANGE[1]  # the widest head dim a kernel's tile takes


def decode_shaped(dims) -> bool:
    """Whether a call is a decode batch (DECODE_TOKENS), from host-side sizes only: every token
    count here is a tensor's shape, so deciding costs no synchronisation.

        >>> from qla_compiler.checks import Dims
        >>> decode_shaped(Dims(1, 256, 16, 64, 128, 128, 256)), decode_shaped(Dims(1, 4096, 16, 64, 128, 128, 1))
        (True, False)
    """
    return dims.B * dims.T <= DECODE_TOKENS * max(dims.N, 1)


class CompiledOp:
    def __init__(self, program):
        self.program = program
        rec = program.recurrence
        self.name = rec.name
        self.input_names = rec.input_names
        self.kinds = {i.name: i.kind for i in rec.inputs}
        self.__doc__ = f"{rec.name}({', '.join(self.input_names)}, " + ", ".join(
            f"{o}=..." for o in OPTIONS) + ")\n\n" + (__doc__ or "")
        self.key = custom_ops.register(self)  # how the custom ops name it in a graph
        # (whether values, or keys, wider than the kernels' tiles may run as blocks of their columns:
        # _run_kernels)
        self._columns_split = columns_mixed(program.chunk) is None
        self._keys_split = key_blocks(program.chunk)[0] is not None
        self._key_names = tuple(n for n in self.input_names if self.kinds[n] in ("key", "key_gate"))

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
        # under torch.compile reading values is a graph break: the custom op checks them instead
        dims = check_inputs(inputs, self.kinds, initial_state, cu_seqlens, scale,
                            read_values=not torch.compiler.is_compiling())
        check_segments(context_parallel, auto=True)
        if use_qk_l2norm_in_kernel:
            inputs = {n: (_l2norm(x) if self.kinds[n] == "key" else x) for n, x in inputs.items()}
        scale = dims.K ** -0.5 if scale is None else float(scale)
        return inputs, dims, scale

    # ---- entry points ------------------------------------------------------------------------
    def __call__(self, *args, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                 use_qk_l2norm_in_kernel=False, context_parallel="auto", cp_context=None, **named):
        context_parallel = "auto" if context_parallel is None else context_parallel
        if cp_context is not None:
            return self._across_ranks(args, named, scale, initial_state, output_final_state, cu_seqlens,
                                      use_qk_l2norm_in_kernel, context_parallel, cp_context)
        inputs, dims, scale = self._prepare(args, named, scale, initial_state, cu_seqlens,
                                            use_qk_l2norm_in_kernel, context_parallel)
        v = inputs[self.value_name]
        work = torch.float64 if v.dtype == torch.float64 else torch.float32
        context_parallel = None if context_parallel == 1 else context_parallel  # one segment: no cut
        if self.program.target == "sm90" and v.is_cuda and v.dtype in (torch.bfloat16, torch.float16):
            if context_parallel == "auto":  # (an eager call's plan counts its host time: kernels/cp_plan.py)
                training = _wants_grad(initial_state, *inputs.values())
                eager = None if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing() else \
                    "training" if training else "inference"
                context_parallel = planned_segments(dims, v.device, eager, training)
            if self._decodes(inputs, dims, initial_state, context_parallel):
                return self.recurrent(**inputs, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                      output_final_state=output_final_state)
            if self.program.kernels is None:  # (passes/lowerable.py)
                raise PassError("partition", f"{self.program.no_kernels or 'the program has no kernels'} "
                                f"(got {v.dtype} CUDA tensors, which run the kernels)")
            if _wants_grad(initial_state, *inputs.values()) and (why := _backward_unsupported(self.key)):
                raise PassError("partition", f"backward program: {why}. Got {v.dtype} CUDA tensors that need "
                                "gradients: the forward alone runs on the kernels (under torch.no_grad(), or on "
                                "detached inputs); training runs on the CPU backend")
            o, final = self._run_kernels(inputs, scale, initial_state, cu_seqlens, context_parallel)
        elif context_parallel not in (None, "auto"):  # ("auto" is the GPU's planner: kernels/cp_plan.py)
            o, final = self._interpret_segments(inputs, dims, scale, initial_state, cu_seqlens, work,
                                                context_parallel)
        else:
            o, final = self._interpret(inputs, scale, initial_state, cu_seqlens)
        return o.to(v.dtype), (final.to(work) if output_final_state else None)

    def _across_ranks(self, args, named, scale, initial_state, output_final_state, cu_seqlens,
                      use_qk_l2norm_in_kernel, context_parallel, ctx):
        """This rank's slice of a batch split over a process group (qla_compiler/distributed.py)."""
        from .distributed import CPContext, run_cp

        if not isinstance(ctx, CPContext):
            raise ValueError(f"cp_context: expected what build_cp_context returns, got {type(ctx).__name__}")
        if cu_seqlens is not None or context_parallel != "auto":
            raise ValueError("cp_context: the context holds the global cu_seqlens and splits the batch; "
                             "leave cu_seqlens None and context_parallel at its default")
        inputs = self._bind(args, named)
        device = inputs[self.value_name].device
        inputs, dims, scale = self._prepare((), inputs, scale, None, ctx.local_cu.to(device),
                                            use_qk_l2norm_in_kernel)
        N = ctx.cu_seqlens.numel() - 1
        want = (N, dims.HV, dims.K, dims.V)
        if initial_state is not None and (not torch.is_tensor(initial_state) or tuple(initial_state.shape) != want):
            got = list(initial_state.shape) if torch.is_tensor(initial_state) else type(initial_state).__name__
            raise ValueError(f"initial_state: expected the global batch's [{', '.join(map(str, want))}] "
                             f"(every sequence, on every rank), got {got}")
        return run_cp(self, inputs, dims, scale, initial_state, ctx, output_final_state)

    def _decodes(self, inputs, dims, initial_state, context_parallel) -> bool:
        """Run this chunk call as a token step: a decode-shaped inference call (decode_shaped) whose
        final state the token step returns as the chunk op does (float32), outside torch.compile
        (there the chunk op's custom op is what the graph holds)."""
        return (decode_shaped(dims) and context_parallel is None and not torch.compiler.is_compiling()
                and dims.K <= WIDEST_HEAD_DIM  # (the token step's K: kernels/token_step.check_dims)
                and not _wants_grad(initial_state, *inputs.values())
                and (initial_state is None or initial_state.dtype == torch.float32))

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
            return self._interpret({**packed, **values}, scale, h0_, cu_)

        o, final = run_segments(scan, {v_name: packed[v_name]}, cu, h0, segments, self.program.chunk_size)
        return o.view(dims.B, dims.T, dims.HV, dims.V), final

    def _interpret(self, inputs, scale, initial_state, cu_seqlens):
        """The ChunkIR interpreter (qla::interpret): (o, final state) in the work dtype."""
        xs = [inputs[n] for n in self.input_names]
        o, final, _ = custom_ops.call("interpret", self.key, xs, initial_state, cu_seqlens, scale,
                                      _wants_grad(initial_state, *xs), torch.compiler.is_compiling())
        return o, final

    def _run_kernels(self, inputs, scale, initial_state, cu_seqlens, segments):
        """The generated kernels (qla::run_kernels); with inputs that need gradients, the training
        forward, keeping what the backward kernels read. Values wider than the kernels' widest tile
        (GLA's and RetNet's V = 512) run as blocks of V's columns, a call each: exact where the
        program never mixes V's columns (columns_mixed), and autograd sums the other inputs'
        gradients over the blocks. Keys wider than it run so too where the program splits over keys
        (passes/key_blocks.py: GLA at K = 512, not the delta rule): o is the blocks' sum, the final
        state their rows."""
        K, V = inputs[self._key_names[0]].shape[-1], inputs[self.value_name].shape[-1]
        if K > WIDEST_HEAD_DIM and self._keys_split:
            parts = self._on_blocks(inputs, self._key_names, K, -2, scale, initial_state, cu_seqlens, segments)
            o = sum(o.float() for o, _ in parts).to(parts[0][0].dtype)  # (rounded once, from float32)
            return o, torch.cat([s for _, s in parts], -2)
        if V > WIDEST_HEAD_DIM and self._columns_split:
            parts = self._on_blocks(inputs, (self.value_name,), V, -1, scale, initial_state, cu_seqlens, segments)
            return torch.cat([o for o, _ in parts], -1), torch.cat([s for _, s in parts], -1)
        xs = [inputs[n] for n in self.input_names]
        o, final, _ = custom_ops.call("run_kernels", self.key, xs, initial_state, cu_seqlens, scale, segments,
                                      _wants_grad(initial_state, *xs), torch.compiler.is_compiling())
        return o, final

    def _on_blocks(self, inputs, names, width: int, state_axis: int, scale, initial_state, cu_seqlens, segments):
        """(o, final) of each block of WIDEST_HEAD_DIM of the last dim of the inputs `names` (and of
        the initial state's `state_axis`), run as a call of its own (_run_kernels)."""
        from .kernels.backward import column_blocks

        return [self._run_kernels({n: (x[..., a:a + w].contiguous() if n in names else x) for n, x in inputs.items()},
                                  scale, None if initial_state is None else
                                  initial_state.narrow(state_axis, a, w).contiguous(), cu_seqlens, segments)
                for a, w in column_blocks(width, WIDEST_HEAD_DIM)]

    def head_blocks(self, K: int, V: int) -> list:
        """(K, V) of each kernel call a call at these head dims makes (_run_kernels): itself where
        both fit the kernels' widest tile; else blocks of K where the program splits over keys, and
        of V where it never mixes V's columns (what the warm-up compiles: qla_compiler/precompile.py).

            >>> import qla_compiler
            >>> qla_compiler.compile("gla").head_blocks(320, 512)
            [(256, 256), (256, 256), (64, 256), (64, 256)]
        """
        from .kernels.backward import column_blocks

        def widths(d, split):
            return [w for _, w in column_blocks(d, WIDEST_HEAD_DIM)] if d > WIDEST_HEAD_DIM and split else [d]

        return [(k, v) for k in widths(K, self._keys_split) for v in widths(V, self._columns_split)]


@torch._dynamo.assume_constant_result
def _backward_unsupported(key: str) -> str | None:
    """The program's backward_unsupported() of the op registered as `key`, which torch.compile takes
    as a constant of the trace: its first call derives the backward program (sympy and networkx),
    which dynamo cannot trace (fullgraph=True failed on a fresh op's first training call, H200
    session 28). By key, not by program: torch 2.11's dynamo takes only constants as the arguments
    of such a function."""
    return custom_ops.registered(key).program.backward_unsupported()


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _device(inputs):
    return next(iter(inputs.values())).device


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """FLA's use_qk_l2norm_in_kernel: x / sqrt(sum(x²) + 1e-6) along the head dim."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)
