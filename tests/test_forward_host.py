"""The GPU forward's host side (kernels/forward.py) on the CPU, with the compiled kernels replaced
by torch stand-ins that honour the KernelIR's parameter lists: packing, chunk map, the wiring of
tensors to kernel parameters by name, shape classes per call, and context parallelism's widened
second value width — everything but the kernels themselves, which run on the GPU (tests/test_gpu_*).
"""
import contextlib

import pytest
import torch

import qla_compiler
from qla_compiler.emulate import KernelEmulator
from qla_compiler.kernels import forward as fwd
from qla_compiler.testing import random_inputs, rel_err


@pytest.fixture
def fake():
    """Installs the emulator as the test's kernels, with the launch rules of an H200, until the test ends."""
    with contextlib.ExitStack() as stack:
        def install(op, cu, scale):
            f = KernelEmulator(op, cu, scale)
            stack.enter_context(fwd.launch_policy(kernels=f, sms=fwd.H200_SMS))
            return f
        yield install


@pytest.mark.parametrize("cp", [None, 3])
@pytest.mark.parametrize("spec", ["gdn", "delta_net", "simple_gla", "retnet", "linear_attn"])
def test_forward_wiring_matches_reference(ops, fake, spec, cp):
    op = ops[spec]
    args = random_inputs(op, T=300, H=2, HV=4, K=64, V=64, cu_seqlens=[0, 1, 200, 300], initial_state=True,
                         dtype=torch.bfloat16)
    inputs, dims, scale = op._prepare((), {k: v for k, v in args.items() if k in op.input_names}, None,
                                      args["initial_state"], args["cu_seqlens"], False)
    f = fake(op, args["cu_seqlens"].to(torch.int32), scale)
    with fwd.launch_policy(fused=False):  # the separate kernels (the fused ones: tests/test_fused_forward.py)
        o, final = fwd.forward(op.program, inputs, op.kinds, dims, scale, args["initial_state"], args["cu_seqlens"],
                               op._head_logs(dims.HV), cp)
    o_ref, s_ref = op.reference(**args)
    # o and the tensors between kernels are stored in bf16 (rounding ~4e-3); a wiring mistake is O(1)
    assert o.dtype == torch.bfloat16 and rel_err(o, o_ref) <= 2e-2 and rel_err(final, s_ref) <= 2e-2
    names = [n for n, _ in f.calls]
    kernels = [k.name for k in op.program.kernels.kernels]
    # parallel kernels run once, even with segments; the scan once per value width, the segments'
    # windows on [0 | v] first (context_parallel.window_skips)
    scan = kernels[-2]
    assert names == kernels if cp is None else names == kernels[:-2] + [f"{scan}_windows", scan] + kernels[-1:]
    assert [w for n, w in f.calls if n.startswith(scan)] == ([64] if cp is None else [128, 64])


def test_context_parallel_runs_fused_where_its_segments_fill_the_gpu(ops, fake):
    """Whether a context-parallel call runs the fused kernel is decided on the sequences its scans
    launch, N·segments (kernels/forward.fused_pays): 3 sequences of 4 value heads are 48 CTAs at
    V-block 16 for an H200's 132 SMs, separate kernels; cut in 8 segments, 96 at V-block 64: fused."""
    op = ops["gdn"]
    args = random_inputs(op, T=300, H=2, HV=4, K=64, V=64, cu_seqlens=[0, 1, 200, 300], dtype=torch.bfloat16)
    inputs, dims, scale = op._prepare((), {k: v for k, v in args.items() if k in op.input_names}, None, None,
                                      args["cu_seqlens"], False)
    for cp, last in ((None, "gdn_out"), (8, "gdn_fused")):
        f = fake(op, args["cu_seqlens"].to(torch.int32), scale)
        fwd.forward(op.program, inputs, op.kinds, dims, scale, None, args["cu_seqlens"], op._head_logs(dims.HV), cp)
        assert f.calls[-1][0] == last, (cp, f.calls)


def test_a_repeated_call_plans_its_launches_once(ops, fake):
    """The program a call runs and each launch's shape class, kernel and output shapes are worked
    out once per call shape (kernels/forward._call_program, _launch_plan): a second call of the same
    shape loads nothing and launches the same kernels; another length plans afresh and is right."""
    op = ops["gdn"]

    def call(T, f):
        args = random_inputs(op, T=T, H=2, HV=4, K=64, V=64, cu_seqlens=[0, 1, T], initial_state=True,
                             dtype=torch.bfloat16, seed=T)
        inputs, dims, scale = op._prepare((), {k: v for k, v in args.items() if k in op.input_names}, None,
                                          args["initial_state"], args["cu_seqlens"], False)
        f.cu = args["cu_seqlens"].to(torch.int32)  # (the emulator reads each call's sequences)
        o, final = fwd.forward(op.program, inputs, op.kinds, dims, scale, args["initial_state"], args["cu_seqlens"],
                               op._head_logs(dims.HV))
        o_ref, s_ref = op.reference(**args)
        assert rel_err(o, o_ref) <= 2e-2 and rel_err(final, s_ref) <= 2e-2
        return len(f.programs), [n for n, _ in f.calls]

    f = fake(op, torch.tensor([0, 1, 150], dtype=torch.int32), 64 ** -0.5)
    loads, first = call(150, f)
    f.calls.clear()
    assert call(150, f) == (loads, first)  # nothing loaded again, the same launches
    f.calls.clear()
    more, again = call(90, f)
    assert more > loads and again == first


def test_sequence_layout_is_reused_while_cu_seqlens_is_unchanged():
    """The chunk map of one cu_seqlens tensor is computed once while that tensor lives unmodified
    (every layer of a model passes the same one); an in-place write, another tensor, or an
    inference-mode tensor (no version counter) gets a fresh, correct one."""
    from qla_compiler.checks import Dims

    layout = fwd._Layout()
    dims = Dims(1, 300, 1, 2, 64, 64, 3)
    cu = torch.tensor([0, 1, 200, 300])
    first = layout(dims, cu, "cpu", 64)
    assert layout(dims, cu, "cpu", 64)[1] is first[1]
    cu[1] = 150  # in place: the version counter moves
    again = layout(dims, cu, "cpu", 64)
    assert again[1] is not first[1]
    assert torch.equal(again[1], fwd.chunk_map(cu.to(torch.int32), 300, 64))
    other = torch.tensor([0, 1, 200, 300])
    assert layout(dims, other, "cpu", 64)[1] is not again[1]
    assert len(layout.entries) == 2
    del other  # its entry goes with it
    assert len(layout.entries) == 1
    with torch.inference_mode():
        frozen = torch.tensor([0, 100, 300])
        got = layout(Dims(1, 300, 1, 2, 64, 64, 2), frozen, "cpu", 64)
    assert torch.equal(got[1], fwd.chunk_map(frozen.to(torch.int32), 300, 64))
    dense = Dims(2, 150, 1, 2, 64, 64, 2)
    assert layout(dense, None, "cpu", 64)[1] is layout(dense, None, "cpu", 64)[1]
    own = torch.tensor([0, 300], dtype=torch.int32)  # used as is: the cache must not hold it
    assert layout(Dims(1, 300, 1, 2, 64, 64, 1), own, "cpu", 64)[0] is own
    assert layout(Dims(1, 300, 1, 2, 64, 64, 1), own, "cpu", 64)[0] is own
    n = len(layout.entries)
    del own
    assert len(layout.entries) == n - 1


def test_a_compiled_call_keeps_no_device_tensor_past_itself():
    """Under torch.compile the kernels' custom op is called with traced=True: its layout is not
    cached and the head constants are made by fill kernels, not the per-device upload cache
    (CUDA-graph trees warm up with every allocation in the graph's pool and refuse to record
    where one outlives the call) — and the tensors are the same."""
    from qla_compiler.checks import Dims

    dims = Dims(1, 300, 1, 2, 64, 64, 3)
    cu = torch.tensor([0, 1, 200, 300])
    layout = fwd._Layout()
    fresh = layout(dims, cu, "cpu", 64, cache=False)
    assert not layout.entries
    assert all(torch.equal(a, b) for a, b in zip(fresh, layout(dims, cu, "cpu", 64)))
    fwd._on_device.cache_clear()
    logs = {"gamma": (-0.03125, -0.015625, float("-inf"))}
    x = {"v": torch.zeros(1, 300, 3, 64)}
    made = fwd.packed_inputs(x, {"v": "value"}, Dims(1, 300, 1, 3, 64, 64, 1), logs, cache=False)
    assert fwd._on_device.cache_info().currsize == 0
    assert torch.equal(made["log_gamma"], torch.tensor(logs["gamma"]))


def test_block_v_widest_that_fills_the_sms_else_narrowest():
    # H200 (132 SMs), one sequence: 64 heads fill the SMs at 64 wide, 32 at 32; 16 and fewer
    # heads run at 16, the narrowest the lowering builds (more CTAs for a latency-bound scan)
    assert [fwd.block_v(128, hv, 1, 132) for hv in (64, 32, 16, 8)] == [64, 32, 16, 16]
    assert fwd.block_v(128, 8, 8, 132) == 64  # eight sequences give the CTAs
    assert fwd.block_v(64, 4, 1, 132) == 16
