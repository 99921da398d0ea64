"""No kernel reads memory that no kernel wrote: every tensor a launch allocates filled with NaN, then
with 1e4, before its kernel runs (LaunchPolicy.poison), and the training step's outputs and
gradients are bitwise those of a step on zero-filled tensors.

Why: a kernel that leaves part of an output unwritten (rows past a sequence's end, a V-block, a
chunk slot) which a later kernel reads gives results that depend on whatever the allocator hands
out: stable within one process, different in the next, and invisible to a test that compares
against a tolerance. (Session 28 found a KDA gradient error moving between processes and tested
this by hand first; the cause was the test's unseeded cotangent, not the kernels.) Unused chunk
slots may stay unwritten: nothing reads them.

The inputs are those where a kernel could skip rows: 1-token sequences, lengths off the chunk,
grouped value heads (GDN), and for GDN a context-parallel call (segments) and the fused inference
path.
"""
import pytest
import torch

import qla_compiler
from qla_compiler.kernels.forward import launch_policy
from test_gpu_per_key import make_inputs

pytestmark = pytest.mark.gpu

FILLS = (float("nan"), 1.0e4)
# (H, HV, lengths) a spec runs at: the classes other GPU tests compile (benchmarks/precompile.py
# --tests), grouped value heads where GDN's tests have them
CASES = {"gdn": (2, 8, [1, 130, 77]), "kda": (2, 2, [1, 130, 64, 1, 77]), "gla": (2, 2, [1, 130, 64, 1, 77]),
         "simple_gla": (2, 2, [1, 130, 77])}


def step(op, args, poison, training=True, **call):
    """o, the final state and (training) every input's gradient, from one call with launches'
    tensors filled with `poison`."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    leaves = {k: (v.detach().clone().requires_grad_(training) if torch.is_tensor(v) and v.is_floating_point() else v)
              for k, v in args.items()}
    with launch_policy(poison=poison), torch.set_grad_enabled(training):
        o, s = op(**leaves, **call)
        out = {"o": o.detach().clone(), "final": s.detach().clone()}
        if training:
            d_o = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
            d_s = torch.randn(s.shape, device="cuda", generator=gen)
            torch.autograd.backward([o, s], [d_o, d_s])
            out |= {k: v.grad.clone() for k, v in leaves.items() if torch.is_tensor(v) and v.grad is not None}
    return out


def assert_same(spec, args, training=True, **call):
    op = qla_compiler.compile(spec, target="sm90")
    zero = step(op, args, 0.0, training, **call)
    assert len(zero) > 2 or not training
    for fill in FILLS:
        got = step(op, args, fill, training, **call)
        for name, x in zero.items():
            assert torch.equal(got[name], x), (spec, fill, name, (got[name].float() - x.float()).abs().max().item())


@pytest.mark.parametrize("spec", CASES)
def test_a_training_step_reads_no_unwritten_memory(spec):
    H, HV, lens = CASES[spec]
    op = qla_compiler.compile(spec, target="sm90")
    assert_same(spec, make_inputs(op, lens=lens, H=H, HV=HV))


def test_a_context_parallel_training_step_reads_no_unwritten_memory():
    op = qla_compiler.compile("gdn", target="sm90")
    assert_same("gdn", make_inputs(op, lens=[3000, 1, 200], H=2, HV=8), context_parallel=8)


def test_the_fused_inference_forward_reads_no_unwritten_memory():
    H, HV, lens = CASES["gdn"]
    op = qla_compiler.compile("gdn", target="sm90")
    with launch_policy(fused=True):
        assert_same("gdn", make_inputs(op, lens=lens, H=H, HV=HV), training=False)


@pytest.mark.parametrize("call", [{}, {"context_parallel": 8}], ids=["whole", "context_parallel"])
def test_gradients_written_over_their_partials_are_those_of_fresh_memory(call):
    """Without a poison policy the backward's scan writes d v_new in the memory of d v_new's
    intra-chunk part (not context-parallel: there each pass of the scan reads it anew), and its out
    kernel writes d q, d k and d v in the memory of the partials it reads (passes/reuse_memory.py):
    the step's outputs and gradients are bitwise those of the step whose every output is fresh,
    zero-filled memory (a CTA that stored its rows before reading them, or read another CTA's, would
    differ)."""
    H, HV, lens = CASES["gdn"]
    op = qla_compiler.compile("gdn", target="sm90")
    assert any(p.reuses for k in op.program.backward_program.kernels.kernels for p in k.params)
    args = make_inputs(op, lens=[3000, 1, 200] if call else lens, H=H, HV=HV)  # (the classes above)
    zero, reused = step(op, args, 0.0, **call), step(op, args, None, **call)
    for name, x in zero.items():
        assert torch.equal(reused[name], x), (name, (reused[name].float() - x.float()).abs().max().item())
