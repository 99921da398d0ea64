"""Gradients through the sm90 kernels on the GPU (the op, as training calls it: the forward
kernels keep what the backward kernels read, qla::run_kernels, qla_compiler/custom_ops.py), against torch autograd
through the spec's float64 recurrence on the same bf16 inputs, and against FLA's own gradients on
those inputs.

Tolerances (issue #5): relative error ≤ 2e-2 for every gradient, and no more than 1.5× FLA's error
(+1e-4, so that two errors at the bf16 rounding floor compare as equal).
"""
import pytest
import torch

import qla_compiler
from qla_compiler.testing import rel_err
from test_gpu_forward import GDN_CASES, fla_args, make_inputs

pytestmark = pytest.mark.gpu

TOL = 2e-2
GRADS = ("q", "k", "v", "g", "beta", "initial_state")


def _leaves(args):
    return {n: (x.detach().clone().requires_grad_() if n in GRADS and torch.is_tensor(x) else x)
            for n, x in args.items()}


def _qla_grads(op, args, cotangents, l2norm=False, context_parallel=None):
    a = _leaves(args)
    o, final = op(**a, use_qk_l2norm_in_kernel=l2norm, context_parallel=context_parallel)
    torch.autograd.backward([o, final], list(cotangents))
    return {n: a[n].grad for n in GRADS if n in a}


def _ref_grads(op, args, cotangents, l2norm=False):
    a = {n: (x.detach().double().requires_grad_() if n in GRADS and torch.is_tensor(x) else x)
         for n, x in args.items()}
    o, final = op.reference(**a, use_qk_l2norm_in_kernel=l2norm)
    torch.autograd.backward([o, final], [c.double() for c in cotangents])
    return {n: a[n].grad for n in GRADS if n in a}


def _fla_grads(args, cotangents, l2norm=False):
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
    except ImportError as e:  # the comparison is part of the test: no FLA, no pass
        pytest.fail(f"FLA's chunk_gated_delta_rule cannot be imported ({e}); these tests compare with it")
    a = _leaves(args)
    o, final = fla(**fla_args(a), use_qk_l2norm_in_kernel=l2norm)
    torch.autograd.backward([o, final], list(cotangents))
    return {n: a[n].grad for n in GRADS if n in a}


def _cotangents(args, seed=7):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    v, h0 = args["v"], args.get("initial_state")
    N = h0.shape[0] if h0 is not None else (args["cu_seqlens"].numel() - 1 if "cu_seqlens" in args else v.shape[0])
    d_o = torch.randn(v.shape, device="cuda", generator=gen).to(v.dtype)
    d_final = torch.randn(N, v.shape[2], args["k"].shape[-1], v.shape[-1], device="cuda", generator=gen)
    return d_o, d_final


def _check(op, args, l2norm=False, context_parallel=None):
    cot = _cotangents(args)
    ours, ref, fla = _qla_grads(op, args, cot, l2norm, context_parallel), _ref_grads(op, args, cot, l2norm), \
        _fla_grads(args, cot, l2norm)
    for n in ours:
        assert ours[n] is not None and ours[n].dtype == args[n].dtype, n
        err = rel_err(ours[n], ref[n])
        assert err <= TOL, (n, err)
        if fla is not None and fla.get(n) is not None:
            fe = rel_err(fla[n], ref[n])
            assert err <= 1.5 * fe + 1e-4, (n, err, fe)


@pytest.mark.parametrize("case", GDN_CASES)
def test_gdn_gradients_match_reference_and_fla(case):
    op = qla_compiler.compile("gdn", target="sm90")
    _check(op, make_inputs(op, H=2, HV=8, K=128, V=128, **GDN_CASES[case]))


def test_gdn_gradients_fp16_head_dim_64():
    op = qla_compiler.compile("gdn", target="sm90")
    _check(op, make_inputs(op, lens=[70, 1, 200], H=1, HV=2, K=64, V=64, dtype=torch.float16))


def test_gdn_gradients_with_qk_l2norm_in_kernel():
    op = qla_compiler.compile("gdn", target="sm90")
    args = make_inputs(op, lens=[150, 90], H=2, HV=8, K=128, V=128)
    args["q"], args["k"] = (args["q"] * 3).detach(), (args["k"] * 0.25).detach()
    _check(op, args, l2norm=True)


@pytest.mark.parametrize("segments", [2, 8])
def test_gdn_gradients_with_context_parallel(segments):
    """Both scans by segments (the backward's chained last to first): the same gradients."""
    op = qla_compiler.compile("gdn", target="sm90")
    _check(op, make_inputs(op, H=2, HV=8, K=128, V=128, lens=[1, 700, 300]), context_parallel=segments)


@pytest.mark.parametrize("segments, wide", [(2, False), (8, True)])
def test_gdn_gradients_with_context_parallel_on_the_fused_training_forward(segments, wide):
    """Under cut_fused_training the cut forward is the fused training forward; at 8 segments under
    cut_wide the wide one and the backward on the whole-V scan on roles (3 sequences × 8 segments
    × 8 value heads fill the SMs at V-block 128), each walking its windows first: the same
    gradients."""
    from qla_compiler.kernels import forward as fwd

    op = qla_compiler.compile("gdn", target="sm90")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert fwd.runs_fused(128, 128, 8, 3 * segments, sms)
    with fwd.launch_policy(cut_fused_training=True, cut_wide=wide):
        assert fwd.runs_wide(128, 128, 8, 3, sms, segments) == wide
        _check(op, make_inputs(op, H=2, HV=8, K=128, V=128, lens=[1, 700, 300]), context_parallel=segments)


@pytest.mark.parametrize("spec", ["delta_net", "simple_gla", "retnet", "linear_attn"])
def test_other_specs_gradients(spec):
    """The same compiler's backward for the other specs (1-token, partial and multi-chunk sequences)."""
    ours, ref = _other_grads(qla_compiler.compile(spec, target="sm90"))
    for n in ours:
        assert ours[n] is not None, n
        err = rel_err(ours[n], ref[n])
        assert err <= TOL, (n, err)


def _other_grads(op):
    args = make_inputs(op, lens=[1, 200, 77], H=2, HV=2, K=128, V=128)
    cot = _cotangents(args)
    return _qla_grads(op, args, cot), _ref_grads(op, args, cot)


@pytest.mark.parametrize("case", GDN_CASES)
def test_gdn_gradients_through_the_whole_v_scan_on_roles(case):
    """The backward's scan on roles at V-block 128 (Program.backward_wide_roles_program: a CTA per
    value head and sequence), as the launch policy forces it: the same tolerances against the
    reference and FLA as the plain scan's."""
    from qla_compiler.kernels import backward as bwd
    from qla_compiler.kernels import forward as fwd

    op = qla_compiler.compile("gdn", target="sm90")
    with fwd.launch_policy(backward_scan_roles=True, wide=True):
        assert bwd.backward_program_of(op.program, wide=True) is op.program.backward_wide_roles_program
        _check(op, make_inputs(op, H=2, HV=8, K=128, V=128, **GDN_CASES[case]))


@pytest.mark.parametrize("spec", ["delta_net", "simple_gla"])
def test_other_specs_gradients_through_the_whole_v_scan_on_roles(spec):
    from qla_compiler.kernels import forward as fwd

    op = qla_compiler.compile(spec, target="sm90")
    with fwd.launch_policy(backward_scan_roles=True, wide=True):
        ours, ref = _other_grads(op)
    for n in ours:
        assert ours[n] is not None and rel_err(ours[n], ref[n]) <= TOL, (n, rel_err(ours[n], ref[n]))
