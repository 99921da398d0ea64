"""FLA's input dtypes: q, k, v in fp16/bf16 with β, g and the initial state in the io dtype too (FLA's
tests pass them so). Both backends take them: the final state comes back in float32 (float64 for
float64 inputs), every gradient in its input's own dtype."""
import pytest
import torch

from qla_compiler.emulate import emulated_kernel_step
from qla_compiler.testing import input_grads, random_inputs, rel_err

# relative error of a result rounded to the io dtype (the reference runs on the same rounded inputs)
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _inputs(op, io, dtypes=None, dim=16):
    """Random inputs with q, k, v in `io`, and each other tensor in dtypes[name] (default: io)."""
    args = random_inputs(op, T=200, H=1, HV=2, K=dim, V=dim, cu_seqlens=[0, 70, 200], initial_state=True)
    dtypes = dtypes or {}
    return {n: (x.to(dtypes.get(n, io)) if torch.is_tensor(x) and x.is_floating_point() else x)
            for n, x in args.items()}


@pytest.mark.parametrize("io", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", ["gdn", "simple_gla", "delta_net", "gla", "kda"])
def test_io_dtype_gates_scalars_and_state_on_the_cpu(ops, spec, io):
    op = ops[spec]
    args = _inputs(op, io)
    o, final = op(**args)
    o_ref, s_ref = op.reference(**args)
    assert o.dtype == io and final.dtype == torch.float32
    assert rel_err(o, o_ref) <= TOLERANCE[io] and rel_err(final, s_ref) <= 1e-5
    grads, ref = input_grads(op, args), input_grads(op.reference, args)
    assert set(grads) == {*op.input_names, "initial_state"}
    for n, g in grads.items():
        assert g.dtype == args[n].dtype, n
        assert rel_err(g, ref[n]) <= TOLERANCE[io], n


@pytest.mark.parametrize("io, dtypes, state", [
    (torch.float16, {"g": torch.float32, "beta": torch.bfloat16, "initial_state": torch.bfloat16}, torch.float32),
    (torch.float64, {"g": torch.float16, "beta": torch.float32, "initial_state": torch.bfloat16}, torch.float64),
])
def test_mixed_dtypes_on_the_cpu(ops, io, dtypes, state):
    op = ops["gdn"]
    args = _inputs(op, io, dtypes)
    o, final = op(**args)
    o_ref, s_ref = op.reference(**args)
    assert o.dtype == io and final.dtype == state
    assert rel_err(o, o_ref) <= TOLERANCE.get(io, 1e-10) and rel_err(final, s_ref) <= 1e-5
    for n, g in input_grads(op, args).items():
        assert g.dtype == args[n].dtype, n


@pytest.mark.parametrize("io", [torch.float16, torch.bfloat16])
def test_io_dtype_gates_scalars_and_state_through_the_gpu_host_code(ops, io):
    """qla::run_kernels (the GPU path, kernels/forward.py and kernels/backward.py) with every kernel
    emulated in float64: β, g and the initial state in the io dtype are converted to the kernels'
    float32 by plain torch ops, and each gradient comes back in its input's dtype."""
    op = ops["gdn"]
    args = _inputs(op, io, dim=64)
    step = emulated_kernel_step(op, args)
    assert step["o"].dtype == io and step["final"].dtype == torch.float32
    # the tensors between kernels are in the io dtype (W, U, the states, v_new)
    assert rel_err(step["o"], step["o_ref"]) <= 2e-2 and rel_err(step["final"], step["final_ref"]) <= 2e-2
    for n, g in step["grads"].items():
        assert g is not None and g.dtype == io, n
        assert rel_err(g, step["grads_ref"][n]) <= 2e-2, n
