"""The GPU backward's host side (kernels/backward.py) on the CPU, with every kernel of the forward
and of the backward program emulated in float64 (qla_compiler/emulate.py): the backward's
partition and schedule, the tensors the forward keeps for it, the reverse scan, the sums over
value-head groups. Gradients against torch autograd through the spec's float64 recurrence."""
import pytest
import torch

from qla_compiler.emulate import emulated_step
from qla_compiler.testing import random_inputs, rel_err


@pytest.mark.parametrize("spec", ["gdn", "delta_net", "simple_gla", "retnet", "linear_attn"])
def test_backward_wiring_matches_autograd_of_the_reference(ops, spec):
    op = ops[spec]
    args = random_inputs(op, T=300, H=2, HV=4, K=64, V=64, cu_seqlens=[0, 1, 200, 300], initial_state=True,
                         dtype=torch.bfloat16)
    step = emulated_step(op, args)
    grads = step["grads"]

    ref = {n: (x.double().requires_grad_() if torch.is_tensor(x) and x.is_floating_point() else x)
           for n, x in args.items()}
    o_ref, s_ref = op.reference(**ref)
    torch.autograd.backward([o_ref, s_ref], [step["d_o"].double(), step["d_final"].double()])
    names = [k.name for k in op.program.backward_program.kernels.kernels]
    assert [n for n, _ in step["emulator"].calls[-len(names):]] == names  # each backward kernel once, in order
    # the tensors between kernels are bf16 (W, U, the states, v_new, dv_new): ~2e-3 here; a wiring
    # mistake is O(1)
    for name in op.input_names:
        assert grads[name].shape == args[name].shape, name
        assert rel_err(grads[name], ref[name].grad) <= 1e-2, name
    assert rel_err(step["d_h0"], ref["initial_state"].grad) <= 1e-2
