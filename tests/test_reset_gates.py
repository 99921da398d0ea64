"""g = −inf is a reset: a log-gate of −inf at one token (a document boundary inside a packed
sequence) zeroes the state there, as the float64 reference recurrence does, forward and backward,
with no NaN anywhere; −1e4 is the same reset. The chunk program floors every gate input at
G_FLOOR before its cumulative sum (passes/chunk.py)."""
import pytest
import torch

from qla_compiler.emulate import emulated_step, reference_step
from qla_compiler.passes.chunk import G_FLOOR
from qla_compiler.passes.lower_tilelang import ShapeClass, lower
from qla_compiler.testing import input_grads, random_inputs, rel_err

GATED = ["gdn", "simple_gla", "gla", "kda"]  # (per-key gates: the reset at every key of a head)
KERNEL_GATED = ["gdn", "simple_gla"]  # the gated specs with sm90 kernels
CU = [0, 70, 75, 260]  # packed: a partial chunk, a 5-token sequence, a sequence of three chunks
# (token, value head or all): mid-chunk, the batch's first token (which padding reads), a
# sequence's first token, a chunk's first token inside a sequence, a 5-token sequence's last token
RESETS = [(20, None), (0, 1), (75, 0), (75 + 64, None), (74, 1), (75 + 64 + 30, 0)]


def _reset_args(op, value, dtype=torch.float64, dim=8):
    args = random_inputs(op, T=CU[-1], H=1, HV=2, K=dim, V=dim, cu_seqlens=CU, initial_state=True, dtype=dtype)
    g = args["g"].clone()
    for t, h in RESETS:
        g[0, t, slice(None) if h is None else h] = value
    return {**args, "g": g}


def _finite(*tensors):
    return all(bool(torch.isfinite(x).all()) for x in tensors)


@pytest.mark.parametrize("cp", [None, 3])
@pytest.mark.parametrize("value", [-float("inf"), -1e4])
@pytest.mark.parametrize("spec", GATED)
def test_a_reset_gives_the_reference_forward_and_backward(ops, spec, value, cp):
    """cp: context-parallel (segments of whole chunks, chained by the affine map of each)."""
    op = ops[spec]
    run = op if cp is None else (lambda **kw: op(**kw, context_parallel=cp))
    args = _reset_args(op, value)
    o, final = run(**args)
    o_ref, s_ref = op.reference(**args)
    assert _finite(o, final, o_ref, s_ref)
    assert rel_err(o, o_ref) <= 1e-10 and rel_err(final, s_ref) <= 1e-10
    # the reset does zero the state: the reference differs from the same inputs without it
    assert rel_err(op.reference(**{**args, "g": args["g"].clamp_min(-0.5)})[0], o_ref) > 1e-2

    grads, ref = input_grads(run, args), input_grads(op.reference, args)
    assert set(grads) == set(ref) == {*op.input_names, "initial_state"}
    for n in ref:
        assert _finite(grads[n], ref[n]), n
        assert rel_err(grads[n], ref[n]) <= 1e-8, n
    # at a reset, d e^g = e^g dg = 0 through the reference; the floor's derivative is 0 there too
    resets = args["g"] == value
    keys = args["g"].shape[3] if args["g"].dim() == 4 else 1  # a per-key gate resets every key
    assert int(resets.sum()) == keys * sum(2 if h is None else 1 for _, h in RESETS)
    assert not grads["g"][resets].any() and not ref["g"][resets].any()


@pytest.mark.parametrize("spec", GATED)
def test_minus_1e4_and_minus_inf_are_the_same_reset(ops, spec):
    op = ops[spec]
    a, b = _reset_args(op, -float("inf")), _reset_args(op, -1e4)
    for x, y in zip(op(**a), op(**b)):
        assert torch.equal(x, y)  # both floored to G_FLOOR: the same bits
    ga, gb = input_grads(op, a), input_grads(op, b)
    assert all(torch.equal(ga[n], gb[n]) for n in ga)


@pytest.mark.parametrize("spec", GATED)
def test_a_reset_in_float32(ops, spec):
    """The interpreter in float32 (its path for CPU tensors that are not float64): the floor keeps
    every cumulative gate finite, and the decays after a reset keep float32's precision."""
    op = ops[spec]
    args = _reset_args(op, -float("inf"), dtype=torch.float32)
    o, final = op(**args)
    o_ref, s_ref = op.reference(**args)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(final, s_ref) <= 1e-5
    grads, ref = input_grads(op, args), input_grads(op.reference, args)
    for n in ref:
        assert rel_err(grads[n], ref[n]) <= 1e-4, n


@pytest.mark.parametrize("spec", KERNEL_GATED)
def test_a_reset_through_the_gpu_host_code_with_emulated_kernels(ops, spec):
    """The GPU path's host code with every forward and backward kernel emulated in float64
    (qla_compiler/emulate.py): each kernel's share of the program, the floor in the prep, its
    derivative in the backward's out kernel."""
    op = ops[spec]
    steps = [emulated_step(op, _reset_args(op, value, torch.bfloat16, dim=64)) for value in (-float("inf"), -1e4)]
    step = steps[0]
    assert _finite(step["o"], step["final"], step["d_h0"], *step["grads"].values())
    for name in ("o", "final", "d_h0"):
        assert torch.equal(steps[0][name], steps[1][name]), name
    assert all(torch.equal(steps[0]["grads"][n], steps[1]["grads"][n]) for n in op.input_names)

    args = _reset_args(op, -float("inf"), torch.bfloat16, dim=64)
    ref = reference_step(op, args, step)
    # bf16 between kernels (~4e-3); a reset gone wrong is O(1) or NaN
    assert rel_err(step["o"], ref["o"]) <= 2e-2 and rel_err(step["final"], ref["final"]) <= 2e-2
    for n in op.input_names:
        assert rel_err(step["grads"][n], ref["grads"][n]) <= 2e-2, n
    assert rel_err(step["d_h0"], ref["d_h0"]) <= 2e-2
    assert not step["grads"]["g"][args["g"] == -float("inf")].any()


def test_the_floor_is_a_node_of_the_chunk_program_and_of_the_kernels(ops):
    """Gated specs floor their gate before its cumulative sum; the others have no gate to floor.
    The kernels compute the floor (prep) and its derivative (the backward's out kernel)."""
    for spec, op in ops.items():
        floors = op.program.chunk.of_op("clamp_min")
        if spec in GATED:
            (f,) = floors
            assert f.args == ("g",) and f.attr == {"min": G_FLOOR}
            assert [u.op for u in op.program.chunk.users(f.name)] == ["cumsum"]
        else:
            assert not floors
    prog = ops["gdn"].program
    shape = ShapeClass(H=2, HV=8, K=128, V=128, BV=64)
    assert f"g_floored_s[i] = T.max(g_s[i], {G_FLOOR!r})" in lower(prog.for_shape(shape).kernels, shape)
    back = lower(prog.for_shape(shape).backward_program.kernels, shape)
    assert f"g_above_s[i] = T.if_then_else(g_s[i] > {G_FLOOR!r}, 1.0, 0.0)" in back
    assert "max(g_s[i], -100)" in str(prog.kernels)
