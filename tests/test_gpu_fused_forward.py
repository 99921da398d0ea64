"""The fused, warp-specialised forward (the launch policy's `fused`, passes/schedule_fused.py) on the GPU:
inference calls of every spec through prep + the one fused kernel, against the float64 reference
and FLA, with test_gpu_forward's inputs and tolerances (≤ 1e-2, and ≤ 1.5× FLA's error + 1e-4)."""
import pytest
import torch

import qla_compiler
from qla_compiler.kernels import forward as fwd
from qla_compiler.testing import rel_err

from test_gpu_forward import GDN_CASES, TOL, _fla, fla_args, make_inputs, reference

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def fused():
    with fwd.launch_policy(fused=True):
        yield


def _check(spec, args, fla=True):
    op = qla_compiler.compile(spec, target="sm90")
    with torch.no_grad():
        o, s = op(**args)
    o_ref, s_ref = reference(op, args)
    err_o, err_s = rel_err(o, o_ref), rel_err(s, s_ref)
    assert err_o <= TOL and err_s <= TOL, (err_o, err_s)
    f = _fla(spec) if fla else None
    if f is not None:
        fo, fs = f(**fla_args(args))
        assert err_o <= 1.5 * rel_err(fo, o_ref) + 1e-4, (err_o, rel_err(fo, o_ref))
        assert err_s <= 1.5 * rel_err(fs, s_ref) + 1e-4, (err_s, rel_err(fs, s_ref))
    return op


@pytest.mark.parametrize("case", GDN_CASES)
def test_fused_gdn_forward(case):
    op = qla_compiler.compile("gdn", target="sm90")
    _check("gdn", make_inputs(op, H=2, HV=8, K=128, V=128, **GDN_CASES[case]))


def test_the_fused_kernel_is_what_runs():
    op = qla_compiler.compile("gdn", target="sm90")
    args = make_inputs(op, lens=[100, 1, 250], H=2, HV=8, K=128, V=128)
    _, dims, _ = op._prepare((), {n: args[n] for n in op.input_names}, None, args["initial_state"],
                             args["cu_seqlens"], False)
    program = fwd.program_for(op.program, dims, torch.bfloat16, args["q"].device)
    assert [k.name for k in fwd.fused_or_not(program).kernels.kernels] == ["gdn_prep", "gdn_fused"]
    _check("gdn", args)


@pytest.mark.parametrize("spec", ["delta_net", "simple_gla", "retnet", "linear_attn"])
def test_fused_other_specs(spec):
    op = qla_compiler.compile(spec, target="sm90")
    _check(spec, make_inputs(op, lens=[1, 200, 77], H=2, HV=2, K=128, V=128))


@pytest.mark.parametrize("K,V", [(64, 64), (100, 60), (256, 256)])
def test_fused_other_head_dims(K, V):
    """(100, 60): padded tiles, whose masked loads faulted in session 12 (the landed barrier's
    arrival came from all of the loads role's threads; fixed in the lowering, passed in session
    13). (256, 256): fused since session 13's chain formed no C×K block, its load ring 2 deep."""
    op = qla_compiler.compile("gdn", target="sm90")
    _check("gdn", make_inputs(op, lens=[70, 1, 200], H=1, HV=2, K=K, V=V), fla=False)


def test_fused_where_the_launch_rules_pick_v_block_64():
    """4/32 heads and two sequences: block_v picks 64, which the fused program's KernelIR takes
    (its load ring 3 deep there, v_new_decayed in v_resid's memory): the fused kernel runs at 64."""
    op = qla_compiler.compile("gdn", target="sm90")
    assert fwd.block_v(128, 32, 2, fwd.sm_count(torch.device("cuda"))) == 64
    _check("gdn", make_inputs(op, lens=[300, 200], H=4, HV=32, K=128, V=128))


# ---- the wide fused kernel: V-block 128, the chain on a state and a value role (four roles) ----------

def _wide_runs(op, args) -> bool:
    """Whether the call's fused kernel is the wide one (the launch rules, or the policy's V-block)."""
    _, dims, _ = op._prepare((), {n: args[n] for n in op.input_names}, None, args.get("initial_state"),
                             args.get("cu_seqlens"), False)
    program = fwd.program_for(op.program, dims, torch.bfloat16, args["q"].device)
    wide = fwd.POLICY.block_v == 128 if fwd.POLICY.block_v else \
        fwd.wide_fused(dims.K, dims.V, dims.HV, dims.N, fwd.sm_count(args["q"].device))
    return [r.name for r in fwd.fused_or_not(program, wide).kernels.kernels[-1].warp_roles][:2] == ["state", "value"]


@pytest.mark.parametrize("case", GDN_CASES)
def test_fused_wide_gdn_forward(case):
    op = qla_compiler.compile("gdn", target="sm90")
    args = make_inputs(op, H=2, HV=8, K=128, V=128, **GDN_CASES[case])
    with fwd.launch_policy(block_v=128):
        assert _wide_runs(op, args)
        _check("gdn", args)


@pytest.mark.parametrize("spec", ["delta_net", "simple_gla", "retnet", "linear_attn"])
def test_fused_wide_other_specs(spec):
    op = qla_compiler.compile(spec, target="sm90")
    with fwd.launch_policy(block_v=128):
        _check(spec, make_inputs(op, lens=[1, 200, 77], H=2, HV=2, K=128, V=128))


def test_fused_wide_in_padded_tiles():
    """K = V = 100 in 128-wide tiles: the op's own blocks load masked by the loads role."""
    op = qla_compiler.compile("gdn", target="sm90")
    with fwd.launch_policy(block_v=128):
        _check("gdn", make_inputs(op, lens=[70, 1, 200], H=1, HV=2, K=100, V=100), fla=False)


def test_fused_wide_where_the_launch_rules_pick_it():
    """16/64 heads and eight sequences: 512 CTAs at V-block 128, so the rules run the wide kernel."""
    op = qla_compiler.compile("gdn", target="sm90")
    args = make_inputs(op, lens=[300, 1, 64, 129, 200, 77, 500, 2], H=16, HV=64, K=128, V=128)
    assert _wide_runs(op, args)
    _check("gdn", args)
