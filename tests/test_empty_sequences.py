"""Empty sequences in cu_seqlens (two equal entries, as serving engines pad batches with) on both
backends: no rows out, the final state is the initial state, d initial_state = d final_state;
the other sequences are unaffected. The GPU path's host code runs with its kernels emulated."""
import pytest
import torch

from qla_compiler.emulate import emulated_step, reference_step
from qla_compiler.testing import input_grads, random_inputs, rel_err

LAYOUTS = [[0, 0, 70, 70, 150], [0, 150, 150], [0, 0, 150]]


def _empty(cu):
    return [i for i in range(len(cu) - 1) if cu[i] == cu[i + 1]]


@pytest.mark.parametrize("cu", LAYOUTS, ids=str)
@pytest.mark.parametrize("spec", ["gdn", "simple_gla", "gla", "kda"])
def test_interpreter(ops, spec, cu):
    op = ops[spec]
    args = random_inputs(op, T=150, H=1, HV=2, K=8, V=8, cu_seqlens=cu, initial_state=True, seed=0)
    o, final = op(**args)
    o_ref, final_ref = op.reference(**args)
    assert rel_err(o, o_ref) <= 1e-12 and rel_err(final, final_ref) <= 1e-12
    for n in _empty(cu):
        assert torch.equal(final[n], args["initial_state"][n])
    o_cp, final_cp = op(**args, context_parallel=2)
    assert rel_err(o_cp, o_ref) <= 1e-12 and rel_err(final_cp, final_ref) <= 1e-12
    got, want = input_grads(op, args), input_grads(op.reference, args)
    assert all(rel_err(got[n], want[n]) <= 1e-12 for n in want), {n: rel_err(got[n], want[n]) for n in want}


def test_interpreter_passes_the_state_cotangent_through(ops):
    op = ops["gdn"]
    cu = [0, 0, 70, 70, 150]
    args = random_inputs(op, T=150, H=1, HV=2, K=8, V=8, cu_seqlens=cu, initial_state=True, seed=1)
    h0 = args["initial_state"].clone().requires_grad_(True)
    _, final = op(**{**args, "initial_state": h0})
    d_final = torch.randn_like(final)
    final.backward(d_final)
    for n in _empty(cu):
        assert torch.equal(h0.grad[n], d_final[n])


@pytest.mark.parametrize("segments", [None, 2])
@pytest.mark.parametrize("cu", LAYOUTS[:2], ids=str)
def test_gpu_host_path_with_emulated_kernels(ops, cu, segments):
    op = ops["gdn"]
    args = random_inputs(op, T=150, H=1, HV=2, K=64, V=64, cu_seqlens=cu, initial_state=True, dtype=torch.bfloat16)
    step = emulated_step(op, args, segments=segments)
    ref = reference_step(op, args, step)
    # o and what crosses between kernels are bf16 (~4e-3); a wrong sequence layout is O(1)
    assert rel_err(step["o"], ref["o"]) <= 2e-2 and rel_err(step["final"], ref["final"]) <= 2e-2
    for n in op.input_names:
        assert rel_err(step["grads"][n], ref["grads"][n]) <= 2e-2, n
    assert rel_err(step["d_h0"], ref["d_h0"]) <= 2e-2
    for n in _empty(cu):
        assert torch.equal(step["final"][n], args["initial_state"][n].float())
        assert torch.equal(step["d_h0"][n], step["d_final"][n])
    if segments is None:  # the scan saw the empty sequences as they came (one CTA row each, no chunk)
        assert step["emulator"].seen["gdn_scan"]["cu_seqlens"].tolist() == cu


def test_decreasing_cu_seqlens_is_still_an_error(ops):
    op = ops["gdn"]
    args = random_inputs(op, T=150, H=1, HV=2, K=8, V=8, cu_seqlens=[0, 80, 70, 150])
    with pytest.raises(ValueError, match=r"^cu_seqlens: must not decrease, but cu_seqlens\[1\] = 80"):
        op(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("cu", LAYOUTS, ids=str)
def test_gpu_kernels(ops, cu):
    """The real kernels: a scan CTA of an empty sequence runs no chunk (its loop bound is 0), so it
    stores the state it loaded; the reverse scan likewise its cotangent."""
    op = ops["gdn"]
    args = random_inputs(op, T=150, H=1, HV=2, K=64, V=64, cu_seqlens=cu, initial_state=True,
                         dtype=torch.bfloat16, device="cuda")
    grads, ref = input_grads(op, args), input_grads(op.reference, {
        n: (x.double() if torch.is_tensor(x) and x.is_floating_point() else x) for n, x in args.items()})
    o, final = op(**args)
    o_ref, final_ref = op.reference(**args)
    assert rel_err(o, o_ref) <= 2e-2 and rel_err(final, final_ref) <= 2e-2
    for n in _empty(cu):
        assert torch.equal(final[n], args["initial_state"][n].float())
    assert all(rel_err(grads[n], ref[n]) <= 2e-2 for n in ref), {n: rel_err(grads[n], ref[n]) for n in ref}
