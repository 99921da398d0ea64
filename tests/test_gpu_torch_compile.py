"""torch.compile(fullgraph=True) of the chunk op on CUDA (bf16, the TileLang kernels): the op
traces to its custom ops (qla::run_kernels and its backward) with no graph break, and the compiled
call gives the eager call's results — bitwise with backend aot_eager (the same kernels run on the
same tensors), within bf16 rounding with inductor (it fuses the l2-norm and casts around the
custom ops). A compiled call also replays under a CUDA graph (mode="reduce-overhead")."""
import pytest
import torch

import qla_compiler
from qla_compiler.testing import rel_err

from test_gpu_forward import make_inputs

pytestmark = pytest.mark.gpu

NAMES = ("q", "k", "v", "g", "beta", "initial_state")
LENS = [1, 300, 77]  # the classes of test_gpu_forward (H = 2, HV = 8, K = V = 128, 3 sequences)


def _close(out, ref, backend):
    return torch.equal(out, ref) if backend == "aot_eager" else rel_err(out, ref) <= 2e-3


def _fn(op):
    def call(q, k, v, g, beta, initial_state, cu_seqlens):
        return op(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    return call


@pytest.fixture(scope="module")
def op():
    return qla_compiler.compile("gdn", target="sm90")


def _args(op, seed=0):
    a = make_inputs(op, lens=LENS, H=2, HV=8, K=128, V=128, seed=seed)
    return [a[n] for n in NAMES] + [a["cu_seqlens"]]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_forward_on_cuda(op, backend):
    torch._dynamo.reset()
    fn = _fn(op)
    args = _args(op)
    with torch.no_grad():
        o, s = torch.compile(fn, fullgraph=True, backend=backend)(*args)
        o_ref, s_ref = fn(*args)
    assert o.is_cuda and o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert _close(o, o_ref, backend) and _close(s, s_ref, backend)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_step_on_cuda(op, backend):
    torch._dynamo.reset()
    fn = _fn(op)
    *xs, cu = _args(op, seed=1)
    w = torch.randn_like(xs[2], dtype=torch.float32)

    def step(f):
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        o, s = f(*leaves, cu)
        loss = (o.float() * w).sum() + s.square().sum()
        loss.backward()
        return [x.grad for x in leaves]

    grads = step(torch.compile(fn, fullgraph=True, backend=backend))
    grads_ref = step(fn)
    for name, g, g_ref in zip(NAMES, grads, grads_ref):
        assert g is not None and g.dtype == g_ref.dtype, name
        assert _close(g, g_ref, backend), (name, rel_err(g, g_ref))


def test_compiled_call_replays_under_cuda_graphs(op):
    """mode="reduce-overhead" captures the compiled forward in a CUDA graph: replays with new
    input values (copied into the same tensors by the CUDA-graph tree) give the eager results."""
    torch._dynamo.reset()
    fn = _fn(op)
    compiled = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for seed in (0, 1, 2):  # the first calls record, later ones replay
            args = _args(op, seed=seed)
            o, s = compiled(*args)
            o, s = o.clone(), s.clone()
            o_ref, s_ref = fn(*args)
            assert rel_err(o, o_ref) <= 2e-3 and rel_err(s, s_ref) <= 2e-3, seed


def test_compiled_token_step_on_cuda():
    """A decode step with a float32 pool written in place, compiled whole (qla::token_step): the
    pool and o are the eager call's, bitwise."""
    from qla_compiler import ops

    torch._dynamo.reset()
    op = qla_compiler.compile("gdn", target="sm90")
    a = make_inputs(op, lens=[1, 1, 1], H=2, HV=8, K=128, V=128, seed=3)
    slots = torch.tensor([5, -1, 0], device="cuda")

    def step(q, k, v, g, beta, pool, cu):
        return ops.fused_recurrent_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, initial_state=pool, cu_seqlens=cu,
                                                    ssm_state_indices=slots, inplace_final_state=True,
                                                    output_final_state=True)

    pool0 = torch.randn(8, 8, 128, 128, device="cuda")
    pool_c, pool_e = pool0.clone(), pool0.clone()
    xs = [a[n] for n in ("q", "k", "v", "g", "beta")]
    with torch.no_grad():
        o_c, _ = torch.compile(step, fullgraph=True, backend="aot_eager")(*xs, pool_c, a["cu_seqlens"])
        o_e, _ = step(*xs, pool_e, a["cu_seqlens"])
    assert torch.equal(o_c, o_e) and torch.equal(pool_c, pool_e) and torch.equal(pool_c[1], pool0[1])
