"""The fused training forward (the launch policy's `fused_training`, QLA_FUSED_TRAINING=1;
Program.fused_training_program) on the GPU: training steps of the op whose forward is the prep and
the fused kernel, its output role storing the entering states and v_new for the backward.

Against autograd through the float64 reference and against the same step through the separate
kernels on the same inputs and cotangents: every gradient ≤ 2e-2 (test_gpu_backward's tolerance)
and ≤ 1.5× the separate kernels' error + 1e-4; o and the final state likewise. And each of its
kernels alone against the emulator's outputs on the emulator's inputs (test_gpu_kernels)."""
import pytest
import torch

import qla_compiler
from qla_compiler.emulate import emulated_step
from qla_compiler.kernels import forward as fwd
from qla_compiler.passes.lower_tilelang import ShapeClass
from qla_compiler.testing import random_inputs, rel_err

from test_gpu_backward import GRADS, TOL, _cotangents, _leaves, _ref_grads
from test_gpu_forward import GDN_CASES, make_inputs, reference
from test_gpu_kernels import _each_kernel_matches

pytestmark = pytest.mark.gpu


def _step(op, args, cotangents, **policy):
    """o, the final state and the gradients of one training step under the launch `policy`, and
    the names of the kernels it launched."""
    a = _leaves(args)
    with fwd.launch_policy(**policy), \
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        o, final = op(**a)
        torch.autograd.backward([o, final], list(cotangents))
        torch.cuda.synchronize()
    launched = {e.name for e in prof.events()}
    return o.detach(), final.detach(), {n: a[n].grad for n in GRADS if n in a}, launched


def _check(spec, args, block_v=None):
    """`block_v`: the fused kernel's V-block (128: the wide kernel)."""
    op = qla_compiler.compile(spec, target="sm90")
    cot = _cotangents(args)
    o, s, grads, launched = _step(op, args, cot, fused=True, fused_training=True, block_v=block_v)
    o_sep, s_sep, grads_sep, launched_sep = _step(op, args, cot, fused_training=False)
    assert any(f"{spec}_fused" in n for n in launched) and not any(f"{spec}_scan_kernel" in n for n in launched)
    assert any(f"{spec}_scan_kernel" in n for n in launched_sep)
    o_ref, s_ref = reference(op, args)
    grads_ref = _ref_grads(op, args, cot)
    pairs = [("o", o, o_sep, o_ref), ("final", s, s_sep, s_ref)] + \
        [(n, grads[n], grads_sep[n], grads_ref[n]) for n in grads]
    for name, ours, sep, r in pairs:
        err, err_sep = rel_err(ours, r), rel_err(sep, r)
        assert err <= TOL and err <= 1.5 * err_sep + 1e-4, (name, err, err_sep)


@pytest.mark.parametrize("case", GDN_CASES)
def test_fused_training_gdn(case):
    op = qla_compiler.compile("gdn", target="sm90")
    _check("gdn", make_inputs(op, H=2, HV=8, K=128, V=128, **GDN_CASES[case]))


@pytest.mark.parametrize("case", ["8 unequal sequences with 1-token ones", "strong decay g=-16"])
def test_fused_training_gdn_wide(case):
    op = qla_compiler.compile("gdn", target="sm90")
    _check("gdn", make_inputs(op, H=2, HV=8, K=128, V=128, **GDN_CASES[case]), block_v=128)


@pytest.mark.parametrize("spec", ["delta_net", "simple_gla", "retnet", "linear_attn"])
def test_fused_training_other_specs(spec):
    op = qla_compiler.compile(spec, target="sm90")
    _check(spec, make_inputs(op, lens=[1, 300, 64, 129, 500], H=2, HV=8, K=128, V=128))


@pytest.mark.parametrize("K, V", [(128, 128), (100, 60)])
def test_fused_training_kernels_match_the_emulator(K, V):
    """The prep (which also stores T_r) and the fused kernel (which also stores S0_chunks and
    v_new_rows) alone, every output NaN-filled first and compared where it must be written."""
    op = qla_compiler.compile("gdn", target="sm90")
    cu = [0, 1, 201, 278]
    args = random_inputs(op, T=cu[-1], H=2, HV=4, K=K, V=V, cu_seqlens=cu, initial_state=True, dtype=torch.bfloat16)
    with fwd.launch_policy(fused=True, fused_training=True):
        step = emulated_step(op, args, block_v=32)
    program = step["emulator"].programs[0]
    assert [k.name for k in program.kernels.kernels] == ["gdn_prep", "gdn_fused"]
    _each_kernel_matches(program, ShapeClass(H=2, HV=4, K=K, V=V, BV=32, scale=step["scale"]), step["emulator"].seen)
