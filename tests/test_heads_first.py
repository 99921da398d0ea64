"""The parallel kernels launched with the value heads fastest (schedule_build.parallel_grid;
QLA_HEADS_FIRST=1, off until the GPU tests run it): a chunk's G value heads as neighbouring
CTAs, one launch axis of HV × CH, and nothing a kernel computes changes."""
import shutil

import pytest
import torch

import qla_compiler


def _heads_first(monkeypatch, on: bool = True):
    from qla_compiler.passes import schedule_build

    monkeypatch.setattr(schedule_build, "HEADS_FIRST", on)


def test_every_parallel_kernel_not_on_key_blocks_runs_heads_first(monkeypatch):
    _heads_first(monkeypatch)
    for spec in ("gdn", "kda"):
        prog = qla_compiler.compile_spec(spec)
        for program in (prog, prog.backward_program):
            for k in program.kernels.kernels:
                k.verify()
                if k.loop or k.warp_roles:
                    assert k.grid[0][0] == "v_block", k.name
                elif k.key_block:  # (a chunk's key blocks side by side already share its other blocks)
                    assert [a for a, _ in k.grid] == ["key_block", "chunk_slot", "value_head"], k.name
                else:
                    assert [a for a, _ in k.grid] == ["value_head", "chunk_slot"], k.name
    monkeypatch.undo()
    out = next(k for k in qla_compiler.compile_spec("gdn").backward_program.kernels.kernels
               if k.name == "gdn_backward_out")
    assert [a for a, _ in out.grid] == ["chunk_slot", "value_head"]  # the default


def test_the_launch_is_one_axis_that_counts_past_65535_slots(monkeypatch):
    """blockIdx.y stops at 65535: chunk slots on it would refuse a packed batch of 4M tokens, so a
    grid whose chunk slots are not its first axis launches as one axis."""
    from qla_compiler.passes.lower_tilelang import ShapeClass, lower_kernel

    _heads_first(monkeypatch)
    out = next(k for k in qla_compiler.compile_spec("gdn").backward_program.kernels.kernels
               if k.name == "gdn_backward_out")
    src = "\n".join(lower_kernel(out, ShapeClass(H=2, HV=8, K=128, V=128)))
    assert "with T.Kernel(HV * CH, threads=256) as i_cta:" in src
    assert "        i_hv = i_cta % (HV)\n        i_slot = i_cta // (HV)\n" in src


def test_the_emulated_gradients_do_not_move(monkeypatch):
    from qla_compiler.emulate import emulated_step
    from qla_compiler.testing import random_inputs

    def step(on):
        _heads_first(monkeypatch, on)
        op = qla_compiler.compile("gdn", target="sm90")
        a = random_inputs(op, T=200, H=1, HV=2, K=64, V=64, cu_seqlens=[0, 1, 70, 200], initial_state=True,
                          dtype=torch.bfloat16, seed=3)
        return emulated_step(op, a)

    plain, flipped = step(False), step(True)
    for name, g in plain["grads"].items():
        assert torch.equal(g, flipped["grads"][name]), name
    assert torch.equal(plain["o"], flipped["o"]) and torch.equal(plain["d_h0"], flipped["d_h0"])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
def test_the_cuda_reads_one_block_index(monkeypatch, tmp_path):
    from test_lowering import _ptxas_report

    from qla_compiler.kernels.runtime import lower_to_cuda
    from qla_compiler.passes.lower_tilelang import ShapeClass

    _heads_first(monkeypatch)
    program = qla_compiler.compile_spec("gdn").backward_program
    cuda = lower_to_cuda(program, ShapeClass(H=2, HV=8, K=128, V=128))["gdn_backward_out"]
    assert "blockIdx.x" in cuda and "blockIdx.y" not in cuda
    report = _ptxas_report(cuda, tmp_path)
    assert "0 bytes spill stores, 0 bytes spill loads" in report
