"""The GPU backward's host side (kernels/backward.py) on the CPU, with every kernel of the forward
and of the backward program emulated in float64 (qla_compiler/emulate.py): the backward's
partition and schedule, the tensors the forward keeps for it, the reverse scan, the sums over
value-head groups. Gradients against torch autograd through the spec's float64 recurrence."""
import pytest
import torch

from qla_compiler.emulate import KernelEmulator, emulated_step
from qla_compiler.kernels import forward as fwd
from qla_compiler.testing import random_inputs, rel_err


@pytest.mark.parametrize("cp", [None, 3])
@pytest.mark.parametrize("spec", ["gdn", "delta_net", "simple_gla", "retnet", "linear_attn"])
def test_backward_wiring_matches_autograd_of_the_reference(ops, spec, cp):
    """cp: both scans context-parallel; the backward's reverse scan chains its segments last to
    first, on the widened [0 | dO] and the like, as the forward's does on [0 | v]."""
    op = ops[spec]
    args = random_inputs(op, T=300, H=2, HV=4, K=64, V=64, cu_seqlens=[0, 1, 200, 300], initial_state=True,
                         dtype=torch.bfloat16)
    step = emulated_step(op, args, segments=cp)
    grads = step["grads"]

    ref = {n: (x.double().requires_grad_() if torch.is_tensor(x) and x.is_floating_point() else x)
           for n, x in args.items()}
    o_ref, s_ref = op.reference(**ref)
    torch.autograd.backward([o_ref, s_ref], [step["d_o"].double(), step["d_final"].double()])
    # each backward kernel once, in order; with cp the reverse scan twice (widened values first)
    names = [n for k in op.program.backward_program.kernels.kernels for n in [k.name] * (2 if cp and k.loop else 1)]
    if cp:
        assert [w for n, w in step["emulator"].calls[-len(names):] if n.endswith("_scan")] == [128, 64]
    assert [n for n, _ in step["emulator"].calls[-len(names):]] == names
    # the tensors between kernels are bf16 (W, U, the states, v_new, dv_new): ~2e-3 here; a wiring
    # mistake is O(1)
    for name in op.input_names:
        assert grads[name].shape == args[name].shape, name
        assert rel_err(grads[name], ref[name].grad) <= 1e-2, name
    assert rel_err(step["d_h0"], ref["initial_state"].grad) <= 1e-2


def test_kernel_step_carries_gradients_through_autograd(ops):
    """KernelStep (the GPU path as an autograd.Function) with emulated kernels, inside a torch
    autograd graph: the gradients of a loss reach every input in its own dtype."""
    from unittest import mock

    from qla_compiler.kernels.backward import KernelStep

    op = ops["gdn"]
    args = random_inputs(op, T=150, H=1, HV=2, K=64, V=64, cu_seqlens=[0, 70, 150], initial_state=True,
                         dtype=torch.bfloat16)
    leaves = {n: x.detach().clone().requires_grad_() for n, x in args.items() if torch.is_tensor(x) and x.is_floating_point()}
    inputs, dims, scale = op._prepare((), {n: leaves[n] for n in op.input_names}, None, leaves["initial_state"],
                                      args["cu_seqlens"], False)
    emu = KernelEmulator(op, args["cu_seqlens"].to(torch.int32), scale)
    with mock.patch.object(fwd, "load_kernels", emu), \
            mock.patch.object(fwd, "choose_block_v", lambda V, HV, N, device: 32), \
            mock.patch.object(fwd, "sm_count", lambda device: fwd.H200_SMS):
        o, final = KernelStep.apply(op, dims, scale, None, args["cu_seqlens"], leaves["initial_state"],
                                    *[inputs[n] for n in op.input_names])
        gen = torch.Generator().manual_seed(2)
        w_o, w_s = torch.randn(o.shape, generator=gen), torch.randn(final.shape, generator=gen)
        ((o.float() * w_o).sum() + (final * w_s).sum()).backward()
    ref = {n: (x.double().requires_grad_() if torch.is_tensor(x) and x.is_floating_point() else x)
           for n, x in args.items()}
    o_ref, s_ref = op.reference(**ref)
    ((o_ref * w_o.double()).sum() + (s_ref * w_s.double()).sum()).backward()
    for n, leaf in leaves.items():
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype, n
        assert rel_err(leaf.grad, ref[n].grad) <= 2e-2, n


def test_kernel_step_refuses_an_input_written_in_place_before_backward(ops):
    """What the backward kernels read is saved through save_for_backward: writing an input in place
    between the forward and backward() raises instead of giving silently wrong gradients."""
    from unittest import mock

    from qla_compiler.kernels.backward import KernelStep

    op = ops["gdn"]
    args = random_inputs(op, T=70, H=1, HV=2, K=64, V=64, cu_seqlens=[0, 70], initial_state=True,
                         dtype=torch.bfloat16)
    k = args["k"].detach().clone().requires_grad_()
    inputs, dims, scale = op._prepare((), {**{n: args[n] for n in op.input_names}, "k": k}, None,
                                      args["initial_state"], args["cu_seqlens"], False)
    emu = KernelEmulator(op, args["cu_seqlens"].to(torch.int32), scale)
    with mock.patch.object(fwd, "load_kernels", emu), \
            mock.patch.object(fwd, "choose_block_v", lambda V, HV, N, device: 32), \
            mock.patch.object(fwd, "sm_count", lambda device: fwd.H200_SMS):
        o, final = KernelStep.apply(op, dims, scale, None, args["cu_seqlens"], args["initial_state"],
                                    *[inputs[n] for n in op.input_names])
        with torch.no_grad():
            k.mul_(2.0)
        with pytest.raises(RuntimeError, match="inplace"):
            (o.float().sum() + final.sum()).backward()
