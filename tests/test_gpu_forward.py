"""The generated sm90 kernels on the GPU: against the spec's float64 reference and against FLA.

Each case draws bf16/fp16 inputs, runs the compiled op (TileLang kernels), the float64 reference
on the same (upcast) inputs and, where FLA has the variant, FLA's kernel. Tolerances: relative
error ≤ 1e-2 for o and the final state, and no more than 1.5× FLA's own error (+1e-4 so that two
errors at the bf16 rounding floor compare as equal).
"""
import pytest
import torch
import torch.nn.functional as F

import qla_compiler
from qla_compiler.testing import rel_err

pytestmark = pytest.mark.gpu

TOL = 1e-2


def _fla(spec):
    try:
        if spec == "gdn":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as f
        elif spec == "delta_net":
            from fla.ops.delta_rule import chunk_delta_rule as f
        elif spec == "simple_gla":
            from fla.ops.simple_gla import chunk_simple_gla as f
        elif spec == "retnet":
            from fla.ops.retention import chunk_retention as f
        else:
            return None
    except ImportError as e:  # the comparison is part of the test: no FLA, no pass
        pytest.fail(f"FLA's op for {spec} cannot be imported ({e}); these tests compare with it")
    return f


def make_inputs(op, *, lens, H, HV, K, V, dtype=torch.bfloat16, gate=None, beta=None, dense_B=None,
                initial_state=True, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens) if dense_B is None else lens[0]
    B = 1 if dense_B is None else dense_B
    args = {}
    for name, kind in op.kinds.items():
        if kind == "key":
            x = F.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1)
        elif kind == "value":
            x = torch.randn(B, T, HV, V, device="cuda", generator=gen)
        elif kind == "gate":
            x = (torch.full((B, T, HV), float(gate), device="cuda") if gate is not None
                 else F.logsigmoid(torch.randn(B, T, HV, device="cuda", generator=gen) + 3.0))
        else:
            x = (torch.full((B, T, HV), float(beta), device="cuda") if beta is not None
                 else torch.rand(B, T, HV, device="cuda", generator=gen))
        args[name] = x.to(dtype) if kind in ("key", "value") else x
    N = B
    if dense_B is None:
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
        args["cu_seqlens"] = cu
        N = len(lens)
    if initial_state:
        args["initial_state"] = torch.randn(N, HV, K, V, device="cuda", generator=gen) * 0.5
    args["output_final_state"] = True
    return args


def reference(op, args):
    ref_args = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in args.items()}
    return op.reference(**ref_args)


def fla_args(args):
    """FLA documents cu_seqlens as a LongTensor."""
    return {k: (v.long() if k == "cu_seqlens" else v) for k, v in args.items()}


GDN_CASES = {
    "8 unequal sequences with 1-token ones": dict(lens=[1, 300, 64, 1, 129, 77, 500, 2]),
    "strong decay g=-16": dict(lens=[200, 130], gate=-16.0),
    "no decay g=0": dict(lens=[200, 130], gate=0.0),
    "beta near 0": dict(lens=[190], beta=1e-3),
    "beta near 1": dict(lens=[190], beta=0.999),
    "no initial state": dict(lens=[100, 157], initial_state=False),
    "dense batch B=2, T not a multiple of 64": dict(lens=[300], dense_B=2),
    "one token": dict(lens=[1]),
    "one long sequence (47 chunks)": dict(lens=[3000]),
}


@pytest.mark.parametrize("case", GDN_CASES)
def test_gdn_forward_matches_reference_and_fla(case):
    op = qla_compiler.compile("gdn", target="sm90")
    args = make_inputs(op, H=2, HV=8, K=128, V=128, **GDN_CASES[case])
    o, s = op(**args)
    o_ref, s_ref = reference(op, args)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    err_o, err_s = rel_err(o, o_ref), rel_err(s, s_ref)
    assert err_o <= TOL and err_s <= TOL, (err_o, err_s)
    fla = _fla("gdn")
    if fla is not None:
        fo, fs = fla(**fla_args(args))
        fe_o, fe_s = rel_err(fo, o_ref), rel_err(fs, s_ref)
        assert err_o <= 1.5 * fe_o + 1e-4, (err_o, fe_o)
        assert err_s <= 1.5 * fe_s + 1e-4, (err_s, fe_s)


def test_gdn_fp16_head_dim_64():
    op = qla_compiler.compile("gdn", target="sm90")
    args = make_inputs(op, lens=[70, 1, 200], H=1, HV=2, K=64, V=64, dtype=torch.float16)
    o, s = op(**args)
    o_ref, s_ref = reference(op, args)
    assert o.dtype == torch.float16
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL


def test_gdn_qk_l2norm_in_kernel():
    op = qla_compiler.compile("gdn", target="sm90")
    args = make_inputs(op, lens=[150, 90], H=2, HV=8, K=128, V=128)
    args["q"], args["k"] = args["q"] * 3, args["k"] * 0.25
    o, s = op(**args, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = reference(op, {**args, "use_qk_l2norm_in_kernel": True})
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL


@pytest.mark.parametrize("spec", ["delta_net", "simple_gla", "retnet", "linear_attn"])
def test_other_specs_forward(spec):
    op = qla_compiler.compile(spec, target="sm90")
    args = make_inputs(op, lens=[1, 200, 77], H=2, HV=2, K=128, V=128)
    o, s = op(**args)
    o_ref, s_ref = reference(op, args)
    err_o, err_s = rel_err(o, o_ref), rel_err(s, s_ref)
    assert err_o <= TOL and err_s <= TOL, (err_o, err_s)
    fla = _fla(spec)
    if fla is not None:
        fo, fs = fla(**fla_args(args))
        fe_o = rel_err(fo, o_ref)
        assert err_o <= 1.5 * fe_o + 1e-4, (err_o, fe_o)


def test_unsupported_head_dim_is_refused():
    op = qla_compiler.compile("gdn", target="sm90")
    args = make_inputs(op, lens=[64], H=1, HV=1, K=300, V=128)
    with pytest.raises(ValueError, match=r"K \(the key head dim\) = 300 is not supported by the sm90 kernels"):
        op(**args)
    args = make_inputs(op, lens=[64], H=1, HV=1, K=64, V=8)
    with pytest.raises(ValueError, match=r"V \(the value head dim\) = 8 is not supported"):
        op(**args)


def test_cuda_graph_capture_and_replay():
    op = qla_compiler.compile("gdn", target="sm90")
    args = make_inputs(op, lens=[100, 1, 250], H=2, HV=8, K=128, V=128, seed=1)
    static = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in args.items()}
    op(**static)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, s_static = op(**static)
    fresh = make_inputs(op, lens=[100, 1, 250], H=2, HV=8, K=128, V=128, seed=2)
    for k, v in fresh.items():
        if torch.is_tensor(v) and v.is_floating_point():
            static[k].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    o_eager, s_eager = op(**fresh)
    assert torch.equal(o_static, o_eager)
    assert torch.equal(s_static, s_eager)


@pytest.mark.parametrize("segments", [2, 8])
def test_gdn_context_parallel(segments):
    """Segments of one long sequence at once (qla_compiler/context_parallel.py) on the kernels."""
    op = qla_compiler.compile("gdn", target="sm90")
    args = make_inputs(op, lens=[1000, 1, 300], H=2, HV=8, K=128, V=128, seed=4)
    o, s = op(**args, context_parallel=segments)
    o_ref, s_ref = reference(op, args)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL


@pytest.mark.parametrize("gate", [None, -16.0, 0.0])
def test_gdn_context_parallel_on_the_wide_kernel(gate):
    """Cut in 8 under cut_wide, 3 sequences × 8 segments × 8 value heads walk on the wide fused
    kernel (kernels/forward.runs_wide: 192 CTAs at V-block 128); gates as drawn, strong decay (its
    windows a chunk) and none (whole segments). o and the final state as the reference's, within
    1.1× the error of the narrow kernel cut the same way (+1e-4: two errors at bf16's floor)."""
    from qla_compiler.kernels import forward as fwd

    op = qla_compiler.compile("gdn", target="sm90")
    args = make_inputs(op, lens=[1000, 1, 300], H=2, HV=8, K=128, V=128, gate=gate, seed=4)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert fwd.runs_fused(128, 128, 8, 3 * 8, sms) and not fwd.runs_wide(128, 128, 8, 3, sms, 8)
    with fwd.launch_policy(cut_wide=True):
        assert fwd.runs_wide(128, 128, 8, 3, sms, 8)
        o, s = op(**args, context_parallel=8)
    o_narrow, s_narrow = op(**args, context_parallel=8)
    o_ref, s_ref = reference(op, args)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL
    assert rel_err(o, o_ref) <= 1.1 * rel_err(o_narrow, o_ref) + 1e-4, (rel_err(o, o_ref), rel_err(o_narrow, o_ref))
    assert rel_err(s, s_ref) <= 1.1 * rel_err(s_narrow, s_ref) + 1e-4, (rel_err(s, s_ref), rel_err(s_narrow, s_ref))


def test_the_default_is_the_planners_choice(monkeypatch):
    """context_parallel's default ("auto", or None) asks kernels/cp_plan.py for the call's cut, an
    eager inference call as such, and runs what it returns; 1 asks nothing and cuts nothing."""
    from qla_compiler import op as op_module

    op = qla_compiler.compile("gdn", target="sm90")
    args = make_inputs(op, lens=[1000, 1, 300], H=2, HV=8, K=128, V=128, seed=4)
    asked = []
    monkeypatch.setattr(op_module, "planned_segments", lambda dims, device, eager, training: asked.append(eager) or 2)
    o, s = op(**args)
    o_none, s_none = op(**args, context_parallel=None)
    assert asked == ["inference", "inference"]
    o2, s2 = op(**args, context_parallel=2)
    assert torch.equal(o, o2) and torch.equal(s, s2) and torch.equal(o_none, o2)
    o1, s1 = op(**args, context_parallel=1)
    assert len(asked) == 2 and not torch.equal(s1, s2)
    o_ref, s_ref = reference(op, args)
    assert rel_err(o1, o_ref) <= TOL and rel_err(s1, s_ref) <= TOL


def test_a_context_parallel_call_replays_in_a_cuda_graph():
    """The default plan cuts a captured call where it pays (kernels/cp_plan.py: one sequence of 8192
    tokens at 2/8 heads into 4 segments; an eager call keeps it whole): the windows' search, the
    chain of segment maps and both scans run without a host synchronisation, so the capture
    succeeds, and a replay on fresh inputs equals the eager call cut the same way, bitwise."""
    from qla_compiler.kernels.cp_plan import planned

    cut = planned(1, 2, 8, 128, 128, 8192, torch.cuda.get_device_properties(0).multi_processor_count)
    assert cut is not None and cut > 1, "the plan cuts this call when captured (on an H200: 4 segments)"
    op = qla_compiler.compile("gdn", target="sm90")
    static = make_inputs(op, lens=[8192], H=2, HV=8, K=128, V=128, seed=5)
    op(**static, context_parallel=cut)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, s_static = op(**static)
    fresh = make_inputs(op, lens=[8192], H=2, HV=8, K=128, V=128, seed=6)
    for k, v in fresh.items():
        if torch.is_tensor(v) and v.is_floating_point():
            static[k].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    o_eager, s_eager = op(**fresh, context_parallel=cut)
    assert torch.equal(o_static, o_eager) and torch.equal(s_static, s_eager)
    o_ref, s_ref = reference(op, fresh)
    assert rel_err(o_static, o_ref) <= TOL and rel_err(s_static, s_ref) <= TOL
