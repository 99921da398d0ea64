"""The GPU forward's host side (kernels/forward.py) on the CPU, with the compiled kernels replaced
by torch stand-ins that honour the KernelIR's parameter lists: packing, chunk map, the wiring of
tensors to kernel parameters by name, shape classes per call, and context parallelism's widened
second value width — everything but the kernels themselves, which run on the GPU (tests/test_gpu_*).
"""
import pytest
import torch

import qla_compiler
from qla_compiler.checks import Dims
from qla_compiler.kernels import forward as fwd
from qla_compiler.testing import random_inputs, rel_err


class FakeKernels:
    """Stands in for load_kernels: each kernel checks its arguments against the KernelIR; the prep
    marks its outputs, the scan checks it was handed exactly those and computes o and the final
    state with the interpreter (inputs the scan kernel does not take, like g, come from `spec_inputs`)."""

    def __init__(self, op, spec_inputs):
        self.op, self.spec_inputs, self.shapes, self.calls, self.made = op, spec_inputs, [], [], {}

    def __call__(self, program, shape):
        self.shapes.append(shape)
        return {k.name: self._kernel(k, shape) for k in program.kernels.kernels}

    def _kernel(self, kernel, shape):
        def run(*args):
            assert len(args) == len(kernel.params)
            named = dict(zip((p.name for p in kernel.params), args))
            self.calls.append((kernel.name, shape.V))
            if not kernel.loop:
                assert (named["chunk_map"][:, 1] >= 0).all()
                for p in kernel.params:
                    if p.role == "out":
                        self.made[p.name] = named[p.name].data_ptr()
                return
            for name, ptr in self.made.items():  # the prep kernel's outputs reach the scan
                assert named[name].data_ptr() == ptr, name
            op = self.op
            inputs = {n: named.get(n, self.spec_inputs[n]) for n in op.input_names}
            cu, h0 = named["cu_seqlens"], named["initial_state"]
            assert inputs[op.value_name].shape[-1] == shape.V == h0.shape[-1]
            dims = Dims(1, inputs[op.value_name].shape[1], shape.H, shape.HV, shape.K, shape.V, cu.numel() - 1)
            o, final = op._interpret(inputs, dims, shape.scale_value, h0, cu, torch.float64)
            named["o"].copy_(o)
            named["final_state"].copy_(final)
        return run


@pytest.fixture
def fake(monkeypatch):
    def install(op, spec_inputs):
        f = FakeKernels(op, spec_inputs)
        monkeypatch.setattr(fwd, "load_kernels", f)
        monkeypatch.setattr(fwd, "choose_block_v", lambda V, HV, N, device: fwd.block_v(V, HV, N, 132))
        return f
    return install


@pytest.mark.parametrize("cp", [None, 3])
@pytest.mark.parametrize("spec", ["gdn", "retnet"])
def test_forward_wiring_matches_reference(ops, fake, spec, cp):
    op = ops[spec]
    args = random_inputs(op, T=300, H=2, HV=4, K=64, V=64, cu_seqlens=[0, 1, 200, 300], initial_state=True,
                         dtype=torch.bfloat16)
    f = fake(op, {n: args[n] for n in op.input_names})
    inputs, dims, scale = op._prepare((), {k: v for k, v in args.items() if k in op.input_names}, None,
                                      args["initial_state"], args["cu_seqlens"], False)
    o, final = fwd.forward(op.program, inputs, op.kinds, dims, scale, args["initial_state"], args["cu_seqlens"],
                           op._head_logs(dims.HV), cp)
    o_ref, s_ref = op.reference(**args)
    # o is stored in bf16 (rounding ~4e-3); a wiring mistake is an O(1) error
    assert o.dtype == torch.bfloat16 and rel_err(o, o_ref) <= 1e-2 and rel_err(final, s_ref) <= 1e-5
    prep = [c for c in f.calls if not c[0].endswith("_scan")]
    scans = [c for c in f.calls if c[0].endswith("_scan")]
    assert len(prep) == (1 if spec == "gdn" else 0)  # the prep kernel runs once, even with segments
    assert [w for _, w in scans] == ([64] if cp is None else [128, 64])  # [0 | v] first, then v
