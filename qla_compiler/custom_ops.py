"""The op's two backends as torch.library custom ops: what torch.compile sees of a call.

`torch.compile(fullgraph=True)` traces CompiledOp.__call__ — binding, the shape checks, the
l2-norm, context parallelism's segment algebra, all plain torch — down to one of two custom ops,
each with a fake implementation (its outputs' shapes and dtypes from its inputs' alone) and a
backward that is a custom op too:

    qla::interpret, qla::interpret_backward      the ChunkIR interpreter (CPU; float32/float64)
    qla::run_kernels, qla::run_kernels_backward  the generated kernels (CUDA bf16/fp16)

and the token step (op.recurrent, qla_compiler/recurrent.py) as `qla::token_step` (the states
into an output tensor) or `qla::token_step_inplace` (back into the pool), each writing in place.

What needs host values or compiles runs inside them, where dynamo does not look: sequence lengths
from cu_seqlens, the gates' sign check, the launch rules' device query, TileLang's compile of a
new shape class. Each forward returns what its backward reads besides the inputs (the states
entering each chunk; the tensors the training kernels store), as tensors whose shapes follow from
the input shapes alone: one row per chunk slot, B·T/C + N of them (layout.chunk_slots). A
compiled op is named in a graph by its key (CompiledOp.key: custom_ops.register). An eager call
that records no autograd graph runs an op's body without the dispatcher (`call`).

    >>> import torch, qla_compiler
    >>> from qla_compiler.testing import random_inputs
    >>> op = qla_compiler.compile("gdn")
    >>> args = random_inputs(op, T=40, H=1, HV=2, K=8, V=8, dtype=torch.float32)
    >>> f = torch.compile(lambda a: op(**a), fullgraph=True, backend="eager")
    >>> o, final = f(args)
    >>> torch.equal(o, op(**args)[0])
    True
    >>> torch._dynamo.reset()  # (before doctest clears the globals the compiled frame is guarded on)
"""
import hashlib
import math
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from . import checks
from .checks import Dims
from .ir.chunk_interp import run_backward, run_chunks
from .layout import chunk_slots, from_chunks, gather, pack_chunks, scatter, sequence_bounds, to_chunks, unpack_chunks

_OPS: dict = {}  # key -> CompiledOp
_BODIES: dict = {}  # a custom op's name -> its Python body (call)


def _custom_op(name: str, mutates_args=()):
    """torch.library.custom_op("qla::<name>"), its body kept for `call`."""
    def wrap(body):
        _BODIES[name] = body
        return torch.library.custom_op(f"qla::{name}", body, mutates_args=mutates_args)
    return wrap


def call(name: str, *args):
    """torch.ops.qla.<name>(*args) where something must see the op — torch.compile or export
    tracing, a dispatch mode (fake tensors), a functorch transform — and its body called directly
    otherwise: the same result, without torch's dispatch of a Python custom op, which took ~75 µs
    a call on one CPU core (session 19), a quarter of a short forward's host time. An eager call
    that records an autograd graph runs the body in a torch.autograd.Function (_EagerGrad) with the
    op's own setup and backward: the same graph, without the custom op's autograd wrapper.

        >>> import torch, qla_compiler
        >>> from qla_compiler.testing import random_inputs
        >>> op = qla_compiler.compile("gdn")
        >>> a = random_inputs(op, T=20, H=1, HV=1, K=8, V=8, dtype=torch.float32)
        >>> xs = [a[n] for n in op.input_names]
        >>> o, final, _ = call("interpret", op.key, xs, None, None, 0.3, False, False)
        >>> torch.equal(o, torch.ops.qla.interpret(op.key, xs, None, None, 0.3, False, False)[0])
        True
    """
    if _traced():
        return getattr(torch.ops.qla, name)(*args)
    if torch.is_grad_enabled() and any(torch.is_tensor(t) and t.requires_grad
                                       for a in args for t in (a if isinstance(a, (list, tuple)) else (a,))):
        if name not in _AUTOGRAD:
            return getattr(torch.ops.qla, name)(*args)
        return _EagerGrad.run(name, args)
    return _BODIES[name](*args)


def _traced() -> bool:
    # (a dispatch mode: fake tensors, a tracer; functorch's transforms: vmap, grad)
    return torch.compiler.is_compiling() or bool(torch._C._len_torch_dispatch_stack()) or \
        torch._C._are_functorch_transforms_active()


class _Autograd(NamedTuple):
    """What a custom op registered for autograd, kept for _EagerGrad."""
    setup_context: Callable
    backward: Callable
    kept_is_list: bool  # the op's third output is a list of tensors (else one tensor)


_AUTOGRAD: dict = {}  # a custom op's name -> its _Autograd


def _register_autograd(op, name: str, backward, setup_context, kept_is_list: bool):
    """op.register_autograd(backward, setup_context), kept for _EagerGrad."""
    _AUTOGRAD[name] = _Autograd(setup_context, backward, kept_is_list)
    op.register_autograd(backward, setup_context=setup_context)


class _EagerGrad(torch.autograd.Function):
    """An eager training call of a differentiable custom op (interpret, run_kernels): its body and
    its registered setup and backward, as a torch.autograd.Function. The op's inputs are
    (key, xs: list of tensors, initial_state, ...) and its outputs (o, final, kept) with `kept` a
    tensor or a list of them; autograd sees tensors only as a Function's own arguments and
    results, so xs and the initial state come in flat and the kept tensors go out flat. torch's
    custom-op autograd does that flattening with pytrees, a redispatch and a dynamo-disabled frame
    per call: 0.13-0.18 ms of a training step's 0.51 ms of host time on one CPU core (session 29,
    GDN at 16/64 heads, every kernel a no-op)."""

    @staticmethod
    def run(name: str, args):
        out = _EagerGrad.apply(name, args, len(args[1]), *args[1], args[2])
        return (out[0], out[1], list(out[2:]) if _AUTOGRAD[name].kept_is_list else out[2])

    @staticmethod
    def forward(ctx, name, args, n, *leaves):
        args = (args[0], list(leaves[:n]), leaves[n], *args[3:])
        o, final, kept = _BODIES[name](*args)
        ctx.op_name = name  # (not ctx.name: a graph node's name() method)
        _AUTOGRAD[name].setup_context(ctx, args, (o, final, kept))
        return (o, final, *(kept if _AUTOGRAD[name].kept_is_list else [kept]))

    @staticmethod
    def backward(ctx, d_o, d_final, *_):
        grads = _AUTOGRAD[ctx.op_name].backward(ctx, d_o, d_final, None)
        d_xs, d_h0 = grads[1], grads[2]
        return (None, None, None, *d_xs, d_h0)


def register(op) -> str:
    """The key the custom ops know `op` by: its spec's name, a hash of its programs, and how many
    ops of that hash this process made before it (so each op runs its own program, whose kernels
    and derived variants it holds, and a process that builds its ops in the same order names
    them alike: a graph compiled and cached on disk by one process is found by the next)."""
    prog = op.program
    text = [prog.target, str(prog.chunk_size), str(prog.head_dims), str(prog.recurrence), str(prog.chunk),
            " ".join(n for n, _ in prog.stages)]
    h = hashlib.sha256("\n".join(text).encode()).hexdigest()[:16]
    n = sum(k.startswith(f"{op.name}_{h}_") for k in _OPS)
    key = f"{op.name}_{h}_{n}"
    _OPS[key] = op
    return key


def registered(key: str):
    """The CompiledOp that `register` named `key`."""
    return _OPS[key]


def dims_of(op, xs, cu_seqlens) -> Dims:
    """The call's dims from its inputs' shapes (the op checked them: checks.check_inputs)."""
    named = dict(zip(op.input_names, xs))
    B, T, H, K = named[next(n for n in op.input_names if op.kinds[n] == "key")].shape
    HV, V = named[op.value_name].shape[2:]
    return Dims(B, T, H, HV, K, V, B if cu_seqlens is None else cu_seqlens.shape[0] - 1)


def work_dtype(io: torch.dtype) -> torch.dtype:
    """What the interpreter computes in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if io == torch.float64 else torch.float32


# ---- the interpreter ------------------------------------------------------------------------------
@_custom_op("interpret", mutates_args=())
def interpret(op: str, xs: list[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
              scale: float, save_states: bool, check_values: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(o [B, T, HV, V], final state [N, HV, K, V], the states entering each chunk [slots, HV, K, V]
    with `save_states`, else empty), in the work dtype; `check_values`: the value checks the op
    left out (under torch.compile)."""
    cop = _OPS[op]
    named, dims = dict(zip(cop.input_names, xs)), dims_of(cop, xs, cu_seqlens)
    if check_values:
        checks.check_values(named, cop.kinds, cu_seqlens, dims.T)
    run = _Chunked(cop, named, dims, initial_state, cu_seqlens)
    out = run_chunks(cop.program.chunk, run.blocks, run.chunk_lengths, {"scale": scale}, run.head_consts, run.h0,
                     save_states=save_states)
    states = pack_chunks(out[2], run.lengths, run.C, run.slots) if save_states else run.h0.new_empty(0)
    return run.unchunk(out[0]), out[1], states


@interpret.register_fake
def _(op, xs, initial_state, cu_seqlens, scale, save_states, check_values):
    cop = _OPS[op]
    d = dims_of(cop, xs, cu_seqlens)
    v = dict(zip(cop.input_names, xs))[cop.value_name]
    work = work_dtype(v.dtype)
    slots = chunk_slots(d.B, d.T, d.N, cop.program.chunk_size)
    return (v.new_empty(d.B, d.T, d.HV, d.V, dtype=work), v.new_empty(d.N, d.HV, d.K, d.V, dtype=work),
            v.new_empty((slots, d.HV, d.K, d.V) if save_states else (0,), dtype=work))


@_custom_op("interpret_backward", mutates_args=())
def interpret_backward(op: str, xs: list[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
                       scale: float, states: Tensor, d_o: Tensor, d_final: Optional[Tensor]) -> tuple[list[Tensor], Tensor]:
    """(the gradient of each input, in its dtype; of the initial state [N, HV, K, V]) by the backward
    chunk program from the cotangents of o and the final state."""
    cop = _OPS[op]
    named, dims = dict(zip(cop.input_names, xs)), dims_of(cop, xs, cu_seqlens)
    run = _Chunked(cop, named, dims, initial_state, cu_seqlens)
    if states.numel() == 0:
        raise ValueError("qla::interpret_backward: the forward was called with save_states=False")
    entering = unpack_chunks(states, run.lengths, run.C, run.NC)
    d_final = torch.zeros_like(run.h0) if d_final is None else d_final.to(run.work)
    grads, d_h0 = run_backward(cop.program.backward, run.blocks, run.chunk_lengths, {"scale": scale},
                               run.head_consts, entering, run.chunk(d_o.to(run.work)), d_final)
    d_xs = []
    for n, x in named.items():
        g = run.unchunk(grads[n]) if n in grads else torch.zeros(x.shape, dtype=run.work, device=x.device)
        if cop.kinds[n] == "key" and dims.HV != dims.H:  # expand_heads' adjoint: a group's sum
            g = g.view(dims.B, dims.T, dims.H, dims.HV // dims.H, dims.K).sum(3)
        d_xs.append(g.to(x.dtype))
    return d_xs, d_h0.to(initial_state.dtype if initial_state is not None else run.work)


@interpret_backward.register_fake
def _(op, xs, initial_state, cu_seqlens, scale, states, d_o, d_final):
    cop = _OPS[op]
    d = dims_of(cop, xs, cu_seqlens)
    v = dict(zip(cop.input_names, xs))[cop.value_name]
    dtype = initial_state.dtype if initial_state is not None else work_dtype(v.dtype)
    return [torch.empty_like(x) for x in xs], v.new_empty(d.N, d.HV, d.K, d.V, dtype=dtype)


def _interpret_setup(ctx, inputs, output):
    op, xs, initial_state, cu_seqlens, scale, _, _ = inputs
    ctx.op, ctx.scale = op, scale
    _no_zero_cotangents(ctx, output[2])
    ctx.save_for_backward(initial_state, cu_seqlens, output[2], *xs)


def _interpret_grad(ctx, d_o, d_final, _):
    initial_state, cu_seqlens, states, *xs = ctx.saved_tensors
    d_o = _cotangent_of_o(ctx.op, xs, cu_seqlens, d_o)
    d_xs, d_h0 = call("interpret_backward", ctx.op, xs, initial_state, cu_seqlens, ctx.scale, states, d_o, d_final)
    return None, list(d_xs), (d_h0 if initial_state is not None else None), None, None, None, None


_register_autograd(interpret, "interpret", _interpret_grad, _interpret_setup, kept_is_list=False)


class _Chunked:
    """One call's inputs as the interpreter takes them: per (sequence, value head, chunk) blocks in
    the work dtype, each chunk's length, the head constants, the initial state."""

    def __init__(self, op, named: dict, dims: Dims, initial_state, cu_seqlens):
        v = named[op.value_name]
        self.work, self.dims, self.C = work_dtype(v.dtype), dims, op.program.chunk_size
        self.starts, self.lengths = sequence_bounds(dims.B, dims.T, cu_seqlens, device=v.device)
        self.NC = max(1, math.ceil(int(self.lengths.max()) / self.C))
        self.slots = chunk_slots(dims.B, dims.T, dims.N, self.C)
        self.blocks = {n: self.chunk(op._heads(n, x, dims).to(self.work)) for n, x in named.items()}
        self.chunk_lengths = (self.lengths[:, None] - self.C * torch.arange(self.NC, device=v.device)).clamp(0, self.C)
        self.head_consts = op._head_logs(dims.HV)
        self.h0 = (torch.zeros(dims.N, dims.HV, dims.K, dims.V, dtype=self.work, device=v.device)
                   if initial_state is None else initial_state.to(self.work))

    def chunk(self, x: Tensor) -> Tensor:
        """[B, T, HV, ...] -> [N, HV, NC, C, ...], zero past each sequence's end."""
        return to_chunks(gather(x, self.starts, self.lengths, self.NC * self.C), self.C)

    def unchunk(self, x: Tensor) -> Tensor:
        """[N, HV, NC, C, ...] -> [B, T, HV, ...] on the real tokens (chunk's adjoint there)."""
        return scatter(from_chunks(x), self.starts, self.lengths, self.dims.B, self.dims.T)


# ---- the kernels ----------------------------------------------------------------------------------
@_custom_op("run_kernels", mutates_args=())
def run_kernels(op: str, xs: list[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
                scale: float, segments: Optional[int], keep: bool, traced: bool
                ) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(o [B, T, HV, V] in the io dtype, final state [N, HV, K, V] float32, with `keep` what the
    backward kernels read of the training forward's tensors: kernels/backward.kept). `traced`: the
    call is a compiled graph's, so it keeps no device tensor past itself (forward.call_tensors)."""
    from .kernels.backward import kept
    from .kernels.forward import forward, program_for

    cop = _OPS[op]
    named, dims = dict(zip(cop.input_names, xs)), dims_of(cop, xs, cu_seqlens)
    out = forward(cop.program, named, cop.kinds, dims, scale, initial_state, cu_seqlens, cop._head_logs(dims.HV),
                  segments, keep=keep, cache=not traced)
    # (context parallelism's final state is a view across segments: the fake's strides are dense)
    o, final = out[0], out[1].contiguous()
    if not keep:
        return o, final, []
    v = named[cop.value_name]
    return o, final, [out[2][n] for n in kept(program_for(cop.program, dims, v.dtype, v.device))]


@run_kernels.register_fake
def _(op, xs, initial_state, cu_seqlens, scale, segments, keep, traced):
    from .kernels.backward import kept_shapes
    from .kernels.forward import check_call

    cop = _OPS[op]
    d = dims_of(cop, xs, cu_seqlens)
    v = dict(zip(cop.input_names, xs))[cop.value_name]
    check_call(d, keep, segments)
    made = [v.new_empty(shape, dtype=dtype) for shape, dtype in
            kept_shapes(_variant(cop, d, v), d, v.dtype, segments)] if keep else []
    return v.new_empty(d.B, d.T, d.HV, d.V), v.new_empty(d.N, d.HV, d.K, d.V, dtype=torch.float32), made


@_custom_op("run_kernels_backward", mutates_args=())
def run_kernels_backward(op: str, xs: list[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
                         scale: float, segments: Optional[int], made: list[Tensor], d_o: Tensor,
                         d_final: Optional[Tensor], traced: bool) -> tuple[list[Tensor], Tensor]:
    """(the gradient of each input, in its dtype; of the initial state) by the backward program's
    kernels, from what run_kernels(keep=True) kept (`made`) and the call's own tensors rebuilt."""
    from .kernels.backward import backward, kept
    from .kernels.forward import call_tensors, program_for

    cop = _OPS[op]
    named, dims = dict(zip(cop.input_names, xs)), dims_of(cop, xs, cu_seqlens)
    v = named[cop.value_name]
    program = program_for(cop.program, dims, v.dtype, v.device)
    if len(made) != len(kept(program)):
        raise ValueError("qla::run_kernels_backward: the forward was called with keep=False")
    tensors, cu, _ = call_tensors(named, cop.kinds, dims, initial_state, cu_seqlens, cop._head_logs(dims.HV),
                                  program.chunk_size, cache=not traced)
    tensors.update(zip(kept(program), made), cu_seqlens=cu)
    grads, d_h0 = backward(program, tensors, cop.kinds, dims, scale, d_o, d_final, segments, cache=not traced)
    return ([grads[n].to(x.dtype) for n, x in named.items()],
            d_h0.to(initial_state.dtype) if initial_state is not None else d_h0)


@run_kernels_backward.register_fake
def _(op, xs, initial_state, cu_seqlens, scale, segments, made, d_o, d_final, traced):
    d = dims_of(_OPS[op], xs, cu_seqlens)
    dtype = initial_state.dtype if initial_state is not None else torch.float32
    return [torch.empty_like(x) for x in xs], xs[0].new_empty(d.N, d.HV, d.K, d.V, dtype=dtype)


def _variant(cop, d: Dims, v: Tensor):
    """The program variant a call runs (kernels/forward.program_for), chosen on the head counts,
    head dims and sequences as ints: under dynamic shapes the fake specialises on them (the variant
    depends on them through the V-block), never on T."""
    from .kernels.forward import program_for

    static = Dims(d.B, d.T, *(int(x) for x in (d.H, d.HV, d.K, d.V, d.N)))
    return program_for(cop.program, static, v.dtype, v.device)


def _kernels_setup(ctx, inputs, output):
    op, xs, initial_state, cu_seqlens, scale, segments, _, traced = inputs
    ctx.op, ctx.scale, ctx.segments, ctx.n, ctx.traced = op, scale, segments, len(xs), traced
    _no_zero_cotangents(ctx, *output[2])
    ctx.save_for_backward(initial_state, cu_seqlens, *xs, *output[2])


def _kernels_grad(ctx, d_o, d_final, _):
    initial_state, cu_seqlens, *rest = ctx.saved_tensors
    xs, made = rest[:ctx.n], rest[ctx.n:]
    d_o = _cotangent_of_o(ctx.op, xs, cu_seqlens, d_o)
    d_xs, d_h0 = call("run_kernels_backward", ctx.op, xs, initial_state, cu_seqlens, ctx.scale, ctx.segments, made,
                      d_o, d_final, ctx.traced)
    return None, list(d_xs), (d_h0 if initial_state is not None else None), None, None, None, None, None


_register_autograd(run_kernels, "run_kernels", _kernels_grad, _kernels_setup, kept_is_list=True)


def _no_zero_cotangents(ctx, *kept):
    """What a forward returns for its backward alone is not differentiable, and no cotangent is
    made for it: autograd would otherwise hand the backward a zero-filled tensor per kept output
    (and for o or the final state when the loss does not read them). At 16/64 heads and 8 × 4096
    tokens those fills wrote ~1.9 GB a training step: ~0.58 ms of the 0.72 ms of element-wise
    fills the H200's profile showed (session 19, benchmarks/NOTES.md)."""
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*kept)


def _cotangent_of_o(op: str, xs, cu_seqlens, d_o):
    """d_o, or zeros where the loss does not read o (the final state's gradient alone)."""
    if d_o is not None:
        return d_o
    cop = _OPS[op]
    d = dims_of(cop, xs, cu_seqlens)
    return dict(zip(cop.input_names, xs))[cop.value_name].new_zeros(d.B, d.T, d.HV, d.V)


# ---- the token step -------------------------------------------------------------------------------
# Two ops, so that what each declares it writes is what it writes (a declared mutation costs a
# copy of the whole pool under torch.compile): qla::token_step writes the states into `out` and only
# reads the pool; qla::token_step_inplace writes them back into the pool (inplace_final_state,
# speculative decoding).
def _token_step(op, xs, cu, read, write, final, pool, out, scale, check_values):
    from .kernels import token_step as host
    from .recurrent import check_pool_values, token_step_kernel

    cop = _OPS[op]
    named = dict(zip(cop.input_names, xs))
    dims = dims_of(cop, xs, cu)
    if check_values:
        checks.check_values(named, cop.kinds, cu, dims.T)
        check_pool_values(pool, read, write)
        check_pool_values(out, final)
    kernel = token_step_kernel(cop, named[cop.value_name], dims, scale, pool)
    return host.run(cop.program.token_step_program, named, cop.kinds, dims, scale, cop._head_logs(dims.HV), cu,
                    (read, write, final, pool, out), kernel)


def _token_step_fake(op, xs, cu):
    cop = _OPS[op]
    d = dims_of(cop, xs, cu)
    return dict(zip(cop.input_names, xs))[cop.value_name].new_empty(d.B, d.T, d.HV, d.V)


@_custom_op("token_step", mutates_args=("out",))
def token_step(op: str, xs: list[Tensor], cu: Tensor, read: Tensor, write: Tensor, final: Tensor, pool: Tensor,
               out: Tensor, scale: float, check_values: bool) -> Tensor:
    """o [B, T, HV, V] of the token-step kernel (the KernelIR interpreter where the inputs are not
    CUDA bf16/fp16), reading the states from `pool` by slot and writing them into `out`
    (kernels/token_step.slots); `check_values`: the value checks the call left out (under
    torch.compile)."""
    return _token_step(op, xs, cu, read, write, final, pool, out, scale, check_values)


@token_step.register_fake
def _(op, xs, cu, read, write, final, pool, out, scale, check_values):
    return _token_step_fake(op, xs, cu)


@_custom_op("token_step_inplace", mutates_args=("pool",))
def token_step_inplace(op: str, xs: list[Tensor], cu: Tensor, read: Tensor, write: Tensor, final: Tensor,
                       pool: Tensor, scale: float, check_values: bool) -> Tensor:
    """qla::token_step with the states written back into the pool they are read from."""
    return _token_step(op, xs, cu, read, write, final, pool, pool, scale, check_values)


@token_step_inplace.register_fake
def _(op, xs, cu, read, write, final, pool, scale, check_values):
    return _token_step_fake(op, xs, cu)
