"""torch.compile(fullgraph=True) of the chunk ops on the CPU backend: the op traces down to its
custom ops (qla_compiler/custom_ops.py) with no graph break, forward and training step, and gives
what the eager call gives. backend="eager" and "aot_eager" run the same torch ops as the eager
call (bitwise equal); inductor fuses the plain torch around the custom ops (l2-norm, casts), so
its results are compared to float32 rounding. fullgraph=True makes any graph break an error."""
import pytest
import torch

import qla_compiler
from qla_compiler import ops
from qla_compiler.emulate import emulated_kernels
from qla_compiler.testing import OpLog, random_inputs, rel_err

BACKENDS = ["eager", "aot_eager", "inductor"]
NAMES = ("q", "k", "v", "g", "beta")


def _close(out, ref, backend):
    if backend == "inductor":
        return rel_err(out, ref) <= 1e-6
    return torch.equal(out, ref)


def _gdn(final_state, cu_seqlens, initial_state, l2norm=False):
    def call(q, k, v, g, beta, h0, cu):
        return ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                                          output_final_state=final_state, use_qk_l2norm_in_kernel=l2norm)
    return call


def _args(op, cu_seqlens=None, initial_state=False, T=150, seed=0):
    a = random_inputs(op, T=T, H=2, HV=4, K=16, V=16, cu_seqlens=cu_seqlens, initial_state=initial_state,
                      dtype=torch.float32, seed=seed)
    return [a[n] for n in op.input_names] + [a.get("initial_state"), a.get("cu_seqlens")]


CASES = {  # final state, cu_seqlens, initial state
    "dense": (False, None, False),
    "final_state": (True, None, False),
    "varlen_initial_state": (True, [0, 1, 64, 150], True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_compiled_forward_equals_eager(ops_gdn, backend, case):
    torch._dynamo.reset()
    final_state, cu, h0 = CASES[case]
    fn = _gdn(final_state, cu, h0)
    args = _args(ops_gdn, cu, h0)
    o, final = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    o_ref, final_ref = fn(*args)
    assert _close(o, o_ref, backend)
    assert (final is None) == (final_ref is None) == (not final_state)
    if final_state:
        assert final.dtype == torch.float32 and _close(final, final_ref, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_training_step_equals_eager(ops_gdn, backend):
    """loss.backward() through the compiled function: the backward custom op runs in the backward
    graph, and every gradient — inputs, the initial state — is the eager call's."""
    torch._dynamo.reset()
    fn = _gdn(True, None, True, l2norm=True)
    *xs, h0, cu = _args(ops_gdn, [0, 30, 150], True)
    w = torch.randn(1, 150, 4, 16, generator=torch.Generator().manual_seed(3))

    def step(f):
        leaves = [x.detach().clone().requires_grad_() for x in [*xs, h0]]
        o, final = f(*leaves, cu)
        loss = (o * w).sum() + final.square().sum()
        loss.backward()
        return loss.detach(), [x.grad for x in leaves]

    loss, grads = step(torch.compile(fn, fullgraph=True, backend=backend))
    loss_ref, grads_ref = step(fn)
    assert _close(loss, loss_ref, backend)
    for name, g, g_ref in zip([*NAMES, "initial_state"], grads, grads_ref):
        assert g is not None and g.dtype == g_ref.dtype, name
        assert _close(g, g_ref, backend), name


def test_new_lengths_reuse_one_dynamic_graph(ops_gdn):
    """Calls with new token counts and numbers of sequences: after the first recompile (dynamo
    makes the sizes symbolic) one graph serves them all — nothing in the traced code specialises
    on T or N — and each result is the eager call's."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    fn = _gdn(True, None, True)
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    for T, cu in ((150, [0, 1, 64, 150]), (120, [0, 50, 120]), (90, [0, 10, 30, 60, 90]), (180, [0, 90, 180])):
        args = _args(ops_gdn, cu, True, T=T)
        o, final = compiled(*args)
        o_ref, final_ref = fn(*args)
        assert torch.equal(o, o_ref) and torch.equal(final, final_ref)
    assert counter.frame_count == 2


def test_context_parallel_compiles_around_two_interpreter_calls(ops_gdn):
    """context_parallel: the segment algebra between the two scans is plain torch in the graph."""
    torch._dynamo.reset()

    def fn(q, k, v, g, beta, h0, cu):
        return ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                                          output_final_state=True, context_parallel=3)
    args = _args(ops_gdn, [0, 100, 150], True)
    o, final = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    o_ref, final_ref = fn(*args)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)


def test_first_use_inside_torch_compile_is_not_traced():
    """An op whose spec was never compiled in this process, first called inside the compiled
    region (another spec, to show nothing is GDN's): its compile runs as Python, no graph break."""
    torch._dynamo.reset()
    ops._built.__dict__.pop("simple_gla", None)  # as in a fresh process

    def fn(q, k, v, g):
        return ops.chunk_simple_gla(q, k, v, g, output_final_state=True)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    a = random_inputs(ops._op("linear_attn"), T=100, H=1, HV=2, K=16, V=16, dtype=torch.float32)
    g = -torch.rand(1, 100, 2, generator=torch.Generator().manual_seed(1))
    ops._built.__dict__.pop("simple_gla", None)
    o, final = compiled(a["q"], a["k"], a["v"], g)
    assert "simple_gla" in ops._built.__dict__
    o_ref, final_ref = fn(a["q"], a["k"], a["v"], g)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)


def test_value_checks_still_raise_under_compile(ops_gdn):
    """What the op reads of the values (the gates' sign, cu_seqlens) is checked inside the custom
    op under torch.compile: the same ValueError as the eager call."""
    torch._dynamo.reset()
    fn = torch.compile(_gdn(True, None, False), fullgraph=True, backend="eager")
    q, k, v, g, beta, h0, cu = _args(ops_gdn, [0, 50, 150])
    with pytest.raises(ValueError, match="a log-space gate must be ≤ 0"):
        fn(q, k, v, g.abs() + 0.5, beta, h0, cu)
    with pytest.raises(ValueError, match="must not decrease"):
        fn(q, k, v, g, beta, h0, torch.tensor([0, 100, 50, 150], dtype=torch.int32))


def test_opcheck_interpreter_ops(ops_gdn):
    """torch.library.opcheck: the schema (no aliasing), the fake implementation against the real
    one, autograd registration and AOT dispatch (static and dynamic shapes) of qla::interpret,
    and through its backward of qla::interpret_backward."""
    xs = _args(ops_gdn, T=70)[:5]
    h0 = torch.randn(2, 4, 16, 16)
    cu = torch.tensor([0, 20, 70])
    leaves = [x.detach().requires_grad_() for x in [*xs, h0]]  # a forward that saves for backward
    torch.library.opcheck(torch.ops.qla.interpret.default, (ops_gdn.key, leaves[:5], leaves[5], cu, 0.25, True, True))
    torch.library.opcheck(torch.ops.qla.interpret.default, (ops_gdn.key, xs, h0, cu, 0.25, False, False))


def test_opcheck_kernel_ops_with_emulated_kernels(ops_gdn):
    """The GPU path's custom ops, qla::run_kernels and its backward, on the CPU with every kernel
    emulated (qla_compiler/emulate.py): the fake implementation gives the shapes and dtypes of what
    the kernels make (what the training forward keeps included), and autograd is registered."""
    op = ops_gdn
    a = random_inputs(op, T=100, H=1, HV=2, K=64, V=64, cu_seqlens=[0, 30, 100], initial_state=True,
                      dtype=torch.bfloat16)
    xs, h0, cu = [a[n] for n in op.input_names], a["initial_state"], a["cu_seqlens"]
    leaves = [x.detach().requires_grad_() for x in [*xs, h0]]  # a training forward: it keeps
    with emulated_kernels(op, cu, 64 ** -0.5):
        for segments in (None, 2):  # context parallelism: both scans by segments
            torch.library.opcheck(torch.ops.qla.run_kernels.default,
                                  (op.key, leaves[:-1], leaves[-1], cu, 64 ** -0.5, segments, True, False))
        torch.library.opcheck(torch.ops.qla.run_kernels.default, (op.key, xs, h0, cu, 64 ** -0.5, None, False, True))


def test_compiled_kernel_path_training_step_with_emulated_kernels(ops_gdn):
    """The GPU path's training step traced whole (aot_eager), its kernels emulated on the CPU: the
    graph holds qla::run_kernels and qla::run_kernels_backward, and the gradients are the eager
    call's."""
    torch._dynamo.reset()
    op = ops_gdn
    a = random_inputs(op, T=100, H=1, HV=2, K=64, V=64, cu_seqlens=[0, 30, 100], initial_state=True,
                      dtype=torch.bfloat16)
    scale = 64 ** -0.5

    def fn(h0, cu, *xs):
        return op._run_kernels(dict(zip(op.input_names, xs)), scale, h0, cu, None)

    def step(f):
        leaves = [a[n].detach().clone().requires_grad_() for n in ("initial_state", *op.input_names)]
        o, final = f(leaves[0], a["cu_seqlens"], *leaves[1:])
        (o.float().sum() + final.square().sum()).backward()
        return o.detach(), [x.grad for x in leaves]

    with emulated_kernels(op, a["cu_seqlens"], scale):
        o, grads = step(torch.compile(fn, fullgraph=True, backend="aot_eager"))
        o_ref, grads_ref = step(fn)
    assert torch.equal(o, o_ref)
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == g_ref.dtype and torch.equal(g, g_ref)


@pytest.fixture(scope="module")
def ops_gdn():
    return ops._op("gdn")


def test_compiled_token_step_with_a_pool_equals_eager():
    """op.recurrent under torch.compile(fullgraph=True): one custom op (qla::token_step_inplace)
    that writes the pool in place; the pool and o are the eager call's, bitwise (aot_eager)."""
    torch._dynamo.reset()
    op = ops._op("gdn")
    a = random_inputs(op, T=3, H=1, HV=2, K=16, V=16, cu_seqlens=[0, 1, 2, 3], dtype=torch.float32, seed=2)
    xs = [a[n] for n in op.input_names]
    slots = torch.tensor([4, -1, 0])

    def step(q, k, v, g, beta, pool, cu):
        return ops.fused_recurrent_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, initial_state=pool, cu_seqlens=cu,
                                                    ssm_state_indices=slots, inplace_final_state=True,
                                                    output_final_state=True)

    pool0 = torch.randn(6, 2, 16, 16, generator=torch.Generator().manual_seed(3))
    pool_c, pool_e = pool0.clone(), pool0.clone()
    o_c, _ = torch.compile(step, fullgraph=True, backend="aot_eager")(*xs, pool_c, a["cu_seqlens"])
    o_e, _ = step(*xs, pool_e, a["cu_seqlens"])
    assert torch.equal(o_c, o_e) and torch.equal(pool_c, pool_e)
    assert not torch.equal(pool_c[4], pool0[4]) and torch.equal(pool_c[1], pool0[1])


def test_opcheck_token_step():
    """The token step's two schemas (one writes the output states, the other the pool; each
    returns a fresh o), their fake implementations against the real ones, their AOT dispatch."""
    from qla_compiler.kernels import token_step as host
    from qla_compiler.checks import Dims

    op = ops._op("gdn")
    a = random_inputs(op, T=3, H=1, HV=2, K=16, V=16, cu_seqlens=[0, 1, 2, 3], dtype=torch.float32, seed=2)
    xs = [a[n] for n in op.input_names]
    dims = Dims(1, 3, 1, 2, 16, 16, 3)
    pool = torch.randn(6, 2, 16, 16)
    for indices, inplace in ((torch.tensor([4, -1, 0]), True), (None, False)):
        read, write, final, p, out, _ = host.slots(3, dims, "cpu", pool if indices is not None else pool[:3],
                                                   indices, None, inplace, True)
        cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
        if out is p:
            torch.library.opcheck(torch.ops.qla.token_step_inplace.default,
                                  (op.key, xs, cu, read, write, final, p, 0.25, True))
        else:
            torch.library.opcheck(torch.ops.qla.token_step.default,
                                  (op.key, xs, cu, read, write, final, p, out, 0.25, True))


def test_an_eager_call_without_gradients_skips_the_dispatcher():
    """An eager call that records no autograd graph runs the custom op's body directly (torch's
    dispatch of a Python custom op is ~75 µs of host time a call), and so does one that records a
    graph (as a torch.autograd.Function: custom_ops._EagerGrad); one under a dispatch mode goes
    through the op, where the mode sees it."""
    from torch.profiler import profile

    op = ops._op("gdn")
    a = random_inputs(op, T=20, H=1, HV=2, K=8, V=8, dtype=torch.float32)

    def dispatched(**kw):
        with profile() as p:
            o, _ = op(**kw)
        return o, "qla::interpret" in {e.name for e in p.events()}

    with torch.no_grad():
        o_direct, seen = dispatched(**a)
    assert not seen
    o_graph, seen = dispatched(**{**a, "q": a["q"].clone().requires_grad_()})
    assert not seen and torch.equal(o_direct, o_graph.detach()) and "_EagerGrad" in type(o_graph.grad_fn).__name__
    with torch.no_grad(), OpLog() as log:
        op(**a)
    assert "qla.interpret.default" in log.ops


def test_an_eager_training_call_has_the_custom_ops_gradients():
    """The eager path's autograd (custom_ops._EagerGrad) runs the setup and backward registered with
    the op, so every gradient equals the one torch's custom-op autograd gives (what a compiled
    graph runs): bitwise, with and without an initial state, with a loss on the final state alone."""
    from qla_compiler import custom_ops

    op = ops._op("gdn")
    for initial_state, loss_on_o in ((True, True), (False, True), (True, False)):
        a = random_inputs(op, T=50, H=1, HV=2, K=8, V=8, cu_seqlens=[0, 13, 50], initial_state=initial_state)
        grads = []
        for run in (lambda *args: custom_ops.call("interpret", *args), torch.ops.qla.interpret):
            xs = [a[n].clone().requires_grad_() for n in op.input_names]
            h0 = a["initial_state"].clone().requires_grad_() if initial_state else None
            o, final, _ = run(op.key, xs, h0, a["cu_seqlens"], 0.3, True, False)
            ((o.sum() if loss_on_o else 0) + (final ** 2).sum()).backward()
            grads.append([x.grad for x in xs] + ([h0.grad] if initial_state else []))
        assert all(torch.equal(e, c) for e, c in zip(*grads)), (initial_state, loss_on_o)


def test_a_fresh_programs_backward_check_is_a_constant_of_the_trace():
    """A training call asks whether the backward has kernels (op.py); on a fresh program that
    derives the backward (sympy, networkx), which dynamo cannot trace: under torch.compile it is
    taken as a constant, so a compiled training step's first call has no graph break (it failed
    with fullgraph=True on the H200, session 28)."""
    from qla_compiler.op import _backward_unsupported

    torch._dynamo.reset()
    op = qla_compiler.compile("gdn", target="sm90")
    assert "backward_unsupported" not in op.program._derived  # (else nothing would be derived in the trace)

    def fn(x):
        return x + 1 if _backward_unsupported(op.key) is None else x - 1

    assert torch.equal(torch.compile(fn, fullgraph=True, backend="eager")(torch.zeros(2)), torch.ones(2))
