"""The blocks of the CTA that takes an SM's place, fetched into L2 by the CTA before it
(passes/schedule_prefetch.py; QLA_L2_PREFETCH=1, off by default): which kernels prefetch, where,
what the lowering emits for it, and that nothing a kernel computes changes."""
import shutil

import pytest
import torch

import qla_compiler
from qla_compiler.ir.kernel import Buffer, Kernel, Stmt, Tensor
from qla_compiler.passes.schedule_prefetch import l2_prefetched


def _backward(monkeypatch, on: bool):
    from qla_compiler.passes import schedule

    monkeypatch.setattr(schedule, "L2_PREFETCH", on)
    return {k.name: k for k in qla_compiler.compile_spec("gdn").backward_program.kernels.kernels}


def test_the_kernel_an_sm_holds_alone_prefetches_every_block_it_loads(monkeypatch):
    """GDN's backward out kernel (one CTA an SM: 194 KB of shared memory) asks L2 for each tensor
    it loads blocks of, once, after its own loads are issued and before it first waits for one;
    the prep (several CTAs an SM) and the scan (a loop) ask nothing."""
    kernels = _backward(monkeypatch, True)
    out = kernels["gdn_backward_out"]
    out.verify()
    body = out.body
    loaded = {s.srcs[0] for s in body if s.op in ("load", "load_chunk_state")}
    asked = [s.srcs[0] for s in body if s.op == "prefetch"]
    assert sorted(asked) == sorted(loaded) and len(loaded) == 9 and "S0_chunks" in loaded
    at = [i for i, s in enumerate(body) if s.op == "prefetch"]
    assert at == list(range(at[0], at[0] + len(at)))  # together
    first_wait = next(i for i, s in enumerate(body) if s.op == "wait_load")
    assert at[-1] + 1 == first_wait
    assert all(s.attr["ahead"] == 1 for s in body if s.op == "prefetch")
    for name, k in kernels.items():
        if name != "gdn_backward_out":
            assert not any(s.op == "prefetch" for s in k.body), name


def test_off_by_default_and_idempotent(monkeypatch):
    kernels = _backward(monkeypatch, False)
    out = kernels["gdn_backward_out"]
    assert not any(s.op == "prefetch" for s in out.body)
    once = l2_prefetched(out, ctas=1)
    assert l2_prefetched(once, ctas=1) == once
    assert l2_prefetched(out, ctas=2) == out  # another CTA on the SM hides the loads already


def test_the_lowering_finds_the_next_cta_and_its_rows(monkeypatch):
    from qla_compiler.passes.lower_tilelang import ShapeClass, lower_kernel

    out = _backward(monkeypatch, True)["gdn_backward_out"]
    src = "\n".join(lower_kernel(out, ShapeClass(H=2, HV=8, K=128, V=128)))
    assert src.count("T.import_source(L2_PREFETCH_SOURCE)") == 1
    # the grid is (chunk slot, value head), the slot fastest: the CTA an SM-full later
    assert 'i_next = i_slot + i_hv * CH + T.call_extern("int32", "qla_sm_count") * 1' in src
    assert "T.address_of(q[0, t0_next, hv_next // G, 0]), H * K, rows_next, K, tx, 256)" in src
    assert "T.address_of(d_o[0, t0_next, hv_next, 0]), HV * V, rows_next, V, tx, 256)" in src
    assert "T.address_of(S0_chunks[slot_next, hv_next, 0, 0]), 0, T.if_then_else(i_next < CH * HV, 1, 0), " \
           "K * V, tx, 256)" in src
    # before its first wait, after its own loads
    assert src.index("qla_prefetch_rows") > src.rindex("T.tma_copy(d_o[")
    assert src.index("qla_prefetch_rows") < src.index("T.mbarrier_wait_parity")


def test_verify_refuses_a_prefetch_where_no_later_cta_is_known():
    q = Tensor("q", ("1", "T", "H", "K"), "io", "in")
    bufs = [Buffer("q_s", ("C", "K"), "io", "shared")]
    ask = Stmt("prefetch", None, ("q",), (("ahead", 1),))
    walk = Kernel("k", (("v_block", "V/BV"), ("value_head", "HV"), ("sequence", "N")), 128, [q], bufs, [],
                  [ask], [], loop="chunks of the sequence")
    with pytest.raises(ValueError, match="only a parallel kernel"):
        walk.verify()
    o = Tensor("o", ("1", "T", "HV", "V"), "io", "out")
    wrong = Kernel("k", (("chunk_slot", "CH"), ("value_head", "HV")), 128, [q, o], bufs, [],
                   [Stmt("prefetch", None, ("o",), (("ahead", 1),))], [])
    with pytest.raises(ValueError, match="names one input"):
        wrong.verify()


def test_the_emulated_gradients_do_not_move(monkeypatch):
    """The interpreter runs the kernels with their prefetches (a hint, nothing computed): the
    emulated training step gives the same gradients bit for bit."""
    from qla_compiler.emulate import emulated_step
    from qla_compiler.passes import schedule
    from qla_compiler.testing import random_inputs

    def step(on):
        monkeypatch.setattr(schedule, "L2_PREFETCH", on)
        op = qla_compiler.compile("gdn", target="sm90")
        assert any(s.op == "prefetch" for k in op.program.backward_program.kernels.kernels for s in k.body) == on
        a = random_inputs(op, T=200, H=1, HV=2, K=64, V=64, cu_seqlens=[0, 1, 70, 200], initial_state=True,
                          dtype=torch.bfloat16, seed=3)
        return emulated_step(op, a)

    plain, asked = step(False), step(True)
    assert asked["emulator"].calls and [n for n, _ in asked["emulator"].calls] == [n for n, _ in plain["emulator"].calls]
    for name, g in plain["grads"].items():
        assert torch.equal(g, asked["grads"][name]), name
    assert torch.equal(plain["d_h0"], asked["d_h0"])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
def test_the_cuda_compiles_for_sm90a_without_spills(monkeypatch, tmp_path):
    from test_lowering import _ptxas_report

    from qla_compiler.kernels.runtime import lower_to_cuda
    from qla_compiler.passes.lower_tilelang import ShapeClass

    _backward(monkeypatch, True)
    program = qla_compiler.compile_spec("gdn").backward_program
    cuda = lower_to_cuda(program, ShapeClass(H=2, HV=8, K=128, V=128))["gdn_backward_out"]
    assert "prefetch.L2" in cuda and cuda.count("qla_prefetch_rows(") == 1 + 9  # the template, each block
    report = _ptxas_report(cuda, tmp_path)
    assert "0 bytes spill stores, 0 bytes spill loads" in report and "spill stores" in report
