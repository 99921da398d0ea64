"""The GPU backward's host side (kernels/backward.py) on the CPU, with every kernel of the forward
and of the backward program emulated in float64 (qla_compiler/emulate.py): the backward's
partition and schedule, the tensors the forward keeps for it, the reverse scan, the sums over
value-head groups. Gradients against torch autograd through the spec's float64 recurrence."""
import pytest
import torch

from qla_compiler.emulate import KernelEmulator
from qla_compiler.kernels import backward as bwd
from qla_compiler.kernels import forward as fwd
from qla_compiler.testing import random_inputs, rel_err


@pytest.mark.parametrize("spec", ["gdn", "delta_net", "simple_gla", "retnet", "linear_attn"])
def test_backward_wiring_matches_autograd_of_the_reference(ops, monkeypatch, spec):
    op = ops[spec]
    cu = [0, 1, 200, 300]
    args = random_inputs(op, T=300, H=2, HV=4, K=64, V=64, cu_seqlens=cu, initial_state=True,
                         dtype=torch.bfloat16)
    inputs, dims, scale = op._prepare((), {n: args[n] for n in op.input_names}, None, args["initial_state"],
                                      args["cu_seqlens"], False)
    emu = KernelEmulator(op, args["cu_seqlens"].to(torch.int32), scale)
    monkeypatch.setattr(fwd, "load_kernels", emu)
    monkeypatch.setattr(fwd, "choose_block_v", lambda V, HV, N, device: 32)
    o, final, kept = fwd.forward(op.program, inputs, op.kinds, dims, scale, args["initial_state"],
                                 args["cu_seqlens"], op._head_logs(dims.HV), keep=True)
    gen = torch.Generator().manual_seed(1)
    d_o = torch.randn(o.shape, generator=gen).to(torch.bfloat16)
    d_final = torch.randn(final.shape, generator=gen)
    grads, d_h0 = bwd.backward(op.program, kept, op.kinds, dims, scale, d_o, d_final)

    ref = {n: (x.double().requires_grad_() if torch.is_tensor(x) and x.is_floating_point() else x)
           for n, x in args.items()}
    o_ref, s_ref = op.reference(**ref)
    torch.autograd.backward([o_ref, s_ref], [d_o.double(), d_final.double()])
    names = [k.name for k in op.program.backward_program.kernels.kernels]
    assert [n for n, _ in emu.calls[-len(names):]] == names  # each backward kernel once, in order
    # the tensors between kernels are bf16 (W, U, the states, v_new, dv_new): ~2e-3 here; a wiring mistake is O(1)
    for name in op.input_names:
        assert grads[name].shape == args[name].shape, name
        assert rel_err(grads[name], ref[name].grad) <= 1e-2, name
    assert rel_err(d_h0, ref["initial_state"].grad) <= 1e-2
