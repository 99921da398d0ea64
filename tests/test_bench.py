"""qla-bench's bookkeeping (the timing itself needs a GPU)."""
import pytest

import qla_compiler.ops as qla_ops
from qla_compiler import bench
from qla_compiler.bench import ROWS, _table, parse_row


def test_rows_follow_the_baseline_table():
    assert parse_row("2/8:1x32768") == (2, 8, [32768])
    assert parse_row("16/64:8x4096") == (16, 64, [4096] * 8)
    assert len(ROWS) == 9 and all(parse_row(r)[1] % parse_row(r)[0] == 0 for r in ROWS)


def test_table_reports_times_and_ratios():
    libs = {"qla": None, "FLA": None}
    rows = [{"row": "2/8:1x8192", "qla device": 0.1, "qla eager": 0.4, "FLA device": 0.2, "FLA eager": 0.8}]
    text = _table(rows, libs)
    header, rule, line = text.splitlines()
    assert "qla/FLA device" in header and "qla/FLA eager" in header
    assert line.split(" | ")[-2:] == ["0.50", "0.50 |"]


def test_backward_mode_times_a_training_step_through_the_kernel_path():
    """--backward: every input of the timed call becomes a leaf that receives a gradient, through
    the kernel path's custom op qla::run_kernels (what the op runs for CUDA inputs; emulated here
    on the CPU)."""
    import torch

    from qla_compiler.bench import with_backward
    from qla_compiler.emulate import KernelEmulator
    from qla_compiler.kernels import forward as fwd
    from qla_compiler.ops import _op
    from qla_compiler.testing import random_inputs

    def kernel_path(**a):  # the op's CUDA branch, for CPU tensors
        named = {n: a.pop(n) for n in op.input_names}
        h0, cu = a.pop("initial_state"), a.pop("cu_seqlens")
        inputs, dims, scale = op._prepare((), named, None, h0, cu, False)
        return op._run_kernels(inputs, scale, h0, cu, None)

    op = _op("gdn")
    args = random_inputs(op, T=100, H=1, HV=2, K=64, V=64, cu_seqlens=[0, 30, 100], initial_state=True,
                         dtype=torch.bfloat16)
    args["output_final_state"] = True
    emu = KernelEmulator(op, args["cu_seqlens"].to(torch.int32), 64 ** -0.5)
    seen = {}

    def recording(**a):
        o, final = kernel_path(**a)
        seen.update({k: v for k, v in a.items() if torch.is_tensor(v)})
        return o, final

    with fwd.launch_policy(kernels=emu, block_v=32, sms=fwd.H200_SMS):
        with_backward(recording)(**args)
    assert [k.name for k in op.program.backward_program.kernels.kernels] == [n for n, _ in emu.calls[-len(
        op.program.backward_program.kernels.kernels):]]
    for n in ("q", "k", "v", "g", "beta", "initial_state"):
        assert seen[n].grad is not None and torch.isfinite(seen[n].grad).all(), n


def test_block_v_option_forces_the_scans_v_block(monkeypatch):
    import pytest

    import qla_compiler.bench as bench
    from qla_compiler.kernels import forward as fwd

    chosen = []
    monkeypatch.setattr(bench, "run", lambda *a, **k: chosen.append(fwd.choose_block_v(128, 8, 1, None)))
    assert bench.main(["--block-v", "64", "--rows", "2/8:1x8192"]) == 0
    assert chosen == [64]  # block_v alone picks 16 there
    assert fwd.POLICY.block_v is None  # the launch policy, for the benchmark's calls only
    with pytest.raises(SystemExit):  # the V-blocks the lowering builds: 16, 32, 64
        bench.main(["--block-v", "8"])


def test_decode_rows_and_the_state_floor():
    """--decode's rows are batches of one-token sequences, and of a few tokens each (where the
    token step and the chunk pipeline cross); the floor is one read and one write of every float32
    state at HBM speed (256 × 64 heads × 128 × 128: 2.1 GB, ~0.5 ms)."""
    from qla_compiler.bench import DECODE_ROWS, state_floor_ms

    assert parse_row("16/64:256x1") == (16, 64, [1] * 256) and "16/64:256x1" in DECODE_ROWS
    assert "16/64:256x16" in DECODE_ROWS
    assert 0.45 < state_floor_ms(64, 128, 128, 256) < 0.55


def test_decode_tokens_bound_switches_the_dispatch():
    from qla_compiler.checks import Dims
    from qla_compiler.op import decode_shaped, decode_tokens

    dims = Dims(1, 512, 16, 64, 128, 128, 256)  # 2 tokens per sequence
    assert decode_shaped(dims)
    with decode_tokens(0):
        assert not decode_shaped(dims)
    assert decode_shaped(dims)


def test_spec_option_times_a_per_key_op_beside_flas(capsys):
    """--spec gla|kda: qla's chunk_gla / chunk_kda (FLA's names, FLA's matching op beside them);
    FlashQLA has no per-key gate, and GDN's token step is the only decode bench."""
    for spec, name in (("gla", "chunk_gla"), ("kda", "chunk_kda")):
        libs = bench.libraries(only=["qla"], spec=spec)
        assert libs == {"qla": getattr(qla_ops, name)}
        assert "FlashQLA" not in bench.libraries(spec=spec)
    with pytest.raises(SystemExit):
        bench.main(["--spec", "kda", "--decode"])
    assert "--decode times GDN's token step only" in capsys.readouterr().err


def test_a_peer_left_out_is_not_imported(monkeypatch):
    """--only without FLA or FlashQLA imports neither: their import alone makes our host time ~1.4×
    (benchmarks/launch_overhead.py --peers, session 29), so a run of qla alone is a lean process."""
    import builtins
    import importlib

    tried, real_import = [], builtins.__import__

    def watching(name, *args, **kwargs):
        if name.split(".")[0] in ("fla", "flash_qla"):
            tried.append(name)
            raise ImportError(f"{name}: not imported in this test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", watching)
    monkeypatch.setattr(importlib, "import_module", lambda name, package=None: watching(name))
    assert set(bench.libraries(only=["qla", "qla-cp4"], cp=4)) == {"qla", "qla-cp4"}
    assert tried == []
    bench.libraries(only=["qla", "FLA"])
    assert tried == [bench.FLA_OPS["gdn"][0]]


def test_cut_fused_times_the_op_under_both_switches_beside_the_default(monkeypatch):
    """--cut-fused adds qla-cut-fused: the same op called under launch_policy(cut_wide=True,
    cut_fused_training=True), so a cut inference call's plan weighs the wide walk
    (kernels/cp_plan.walks_wide) and a cut training call runs the fused training forward; qla
    itself runs as the defaults say."""
    from qla_compiler.kernels import forward

    def switches():
        return forward.cut_wide(), forward.cut_fused_training()

    seen, before = [], switches()
    monkeypatch.setattr(qla_ops, "chunk_gated_delta_rule", lambda **a: seen.append(switches()))
    libs = bench.libraries(only=["qla", "qla-cut-fused"], cut_fused=True)
    assert set(libs) == {"qla", "qla-cut-fused"}
    libs["qla"]()
    libs["qla-cut-fused"]()
    assert seen == [before, (True, True)] and switches() == before
