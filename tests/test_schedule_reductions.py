"""Sums across threads with their exchanges batched (passes/schedule_reductions.py; on by
default, QLA_BATCHED_REDUCTIONS=0 turns it off): which sums are marked, with how many outputs a
thread holds, and that TileLang lowers the marks into one round of barriers per sum within a CTA's
shared memory."""
import pytest

import qla_compiler
from qla_compiler.ir.kernel import Stmt
from qla_compiler.passes.schedule_reductions import batched_reductions
from child_process import last_json, run_child


def _batches(kernel):
    return {s.dst: s.attr.get("batch") for s in kernel.body if s.op == "reduce"}


def _unmarked_out_kernel(monkeypatch):
    """GDN's backward out kernel as scheduled without the step."""
    from qla_compiler.passes import schedule

    monkeypatch.setattr(schedule, "BATCHED_REDUCTIONS", False)
    return next(k for k in qla_compiler.compile_spec("gdn").backward_program.kernels.kernels
                if k.name == "gdn_backward_out")


def test_sums_of_accumulator_blocks_are_marked_with_the_outputs_a_thread_holds(monkeypatch):
    """GDN's backward out kernel (256 threads: two warpgroups, each half of every row's columns):
    its row sums of wgmma-laid C×K, C×V and C×C blocks hold 2 rows a thread; the column sum of
    the C×C gate-difference block 64 / (4 warps · 2 warpgroups) = 8 columns; the sum of d S_next ⊙
    S0, a block of two shared operands (TileLang's loop layout, not an accumulator's), and the
    sums of 1-D accumulators are left alone."""
    out = _unmarked_out_kernel(monkeypatch)
    assert all(b is None for b in _batches(out).values())
    after = batched_reductions(out, 64)
    monkeypatch.undo()
    default = next(k for k in qla_compiler.compile_spec("gdn").backward_program.kernels.kernels
                   if k.name == "gdn_backward_out")
    assert _batches(default) == _batches(after)  # what the schedule does by default
    after.verify()
    marked = {d: b for d, b in _batches(after).items() if b}
    assert marked == {"d_decay_to_end_s": (2,), "d_Gamma_o_inter_s": (2,), "d_s_Gamma_s": (2,),
                      "d_g_cum_log2_g_diff_rows_s": (2,), "d_g_cum_log2_g_diff_cols_s": (8,),
                      "d_beta_sKKt_s": (2,), "d_beta_bv_s": (2,)}
    assert _batches(after)["d_Gamma_C_s"] is None and _batches(after)["d_g_last_g_to_end_s"] is None
    assert "T.reduce_sum(d_beta_bv_full_f, d_beta_bv_acc, dim=1, batch=2)" in _lowered(after)
    assert "T.reduce_sum(d_g_cum_log2_g_diff_masked_f, d_g_cum_log2_g_diff_cols_acc, dim=0, batch=8)" \
        in _lowered(after)


def _lowered(kernel):
    from qla_compiler.passes.lower_tilelang import ShapeClass, lower_kernel

    return "\n".join(lower_kernel(kernel, ShapeClass(H=2, HV=8, K=128, V=128)))


def test_only_sums_that_cross_warps_over_a_known_layout_are_marked(monkeypatch):
    """A row sum in a one-warpgroup kernel is shuffles inside a warp (no barrier to share); a block
    a product reads as an operand is laid out as one, not as an accumulator; a kernel with a loop
    or roles is not the parallel kind this reasons about. None of them is marked."""
    for spec in ("gdn", "kda", "gla", "delta_net", "simple_gla"):
        program = qla_compiler.compile_spec(spec)
        for kernel in program.kernels.kernels + program.backward_program.kernels.kernels:
            after = batched_reductions(kernel, 64)
            for st in after.body:
                if st.attr.get("batch"):
                    assert kernel.threads == 256 and not kernel.loop and not kernel.warp_roles, (spec, kernel.name)
                    b = kernel.buffer(st.srcs[0])
                    assert b.scope == "fragment" and b.shape[0] == "C" and not b.warp_columns
            if kernel.threads == 128:
                assert all(not st.attr.get("batch") or st.attr["dims"][0] == 0 for st in after.body)
    out = _unmarked_out_kernel(monkeypatch)
    read = next(st for st in out.body if st.op == "reduce" and st.dst == "d_beta_bv_s").srcs[0]
    # the same kernel with the block d_beta_bv_full_f also read by a product: not an accumulator's layout
    mutant = out.__class__(**{**out.__dict__, "body": out.body + [Stmt("gemm", "d_bv", (read, "k_s"))]})
    assert _batches(batched_reductions(mutant, 64))["d_beta_bv_s"] is None
    assert all(b is None for b in _batches(batched_reductions(out, 32)).values())  # C = 32: not one wgmma's 64 rows


def test_the_marks_are_counted_for_the_kernel_as_it_is():
    """The marks count a thread's outputs for the kernel's threads: a kernel given other threads
    after the schedule marked it gets counts for those (one warpgroup: a row sum stays inside it,
    the C×C column sum has 16 columns a thread) or none (512 threads, C = 32), never the stale
    ones, which TileLang would refuse."""
    import dataclasses

    out = next(k for k in qla_compiler.compile_spec("gdn").backward_program.kernels.kernels
               if k.name == "gdn_backward_out")
    assert _batches(out)["d_beta_bv_s"] == (2,)
    one_group = _batches(batched_reductions(dataclasses.replace(out, threads=128), 64))
    assert {d: b for d, b in one_group.items() if b} == {"d_g_cum_log2_g_diff_cols_s": (16,)}
    for stale in (batched_reductions(dataclasses.replace(out, threads=512), 64), batched_reductions(out, 32)):
        assert all(b is None for b in _batches(stale).values())
    assert _batches(batched_reductions(out, 64)) == _batches(out)


def test_a_batch_that_is_not_a_count_per_reduction_is_refused():
    out = next(k for k in qla_compiler.compile_spec("gdn").backward_program.kernels.kernels
               if k.name == "gdn_backward_out")
    at = next(i for i, st in enumerate(out.body) if st.op == "reduce" and st.dst == "d_beta_bv_s")
    for bad in ((2, 2), (0,), ("2",)):
        st = out.body[at]
        body = out.body[:at] + [Stmt(st.op, st.dst, st.srcs, st.attrs + (("batch", bad),))] + out.body[at + 1:]
        with pytest.raises(ValueError, match="batch"):
            out.__class__(**{**out.__dict__, "body": body}).verify()


CHILD = """
import json, re, sys
import qla_compiler
from qla_compiler.kernels.runtime import launch_shared_bytes, lower_to_cuda
from qla_compiler.passes.lower_tilelang import ShapeClass
program = qla_compiler.compile_spec("gdn").backward_program
shape = ShapeClass(H=2, HV=8, K=128, V=128)
cuda = lower_to_cuda(program, shape)["gdn_backward_out"]
print(json.dumps({"batched": re.findall(r"AllReduce<tl::SumOp, (\\d+), (\\d+), 0, tl::NamedBarrier<256>, (\\d+), 256>::run_batch", cuda),
                  "scalar": re.findall(r"AllReduce<[^>]*>>::run\\(\\(?(\\w+)\\[", cuda),
                  "shared": launch_shared_bytes(program, shape)["gdn_backward_out"]}))
"""


def test_tilelang_lowers_the_batched_sums_into_one_exchange_each(tmp_path):
    """GDN's backward out kernel (a child process, so that no test's monkeypatch reaches it) lowered
    to CUDA for sm_90a on this CPU: TileLang accepts every batch (it refuses one that does not
    divide a thread's outputs), each marked sum is one batched AllReduce per level of its
    butterfly (the cross-warpgroup row sums 2 wide, the column sum 8), the cross-warp scalar
    exchanges left are the unmarked sums', and the larger workspaces still fit a CTA's 227 KB."""
    got = last_json(run_child(CHILD))
    batched = [tuple(map(int, t)) for t in got["batched"]]
    assert batched.count((256, 128, 2)) == 6 and batched.count((4, 1, 2)) == 6  # six row sums, two levels each
    assert batched.count((128, 32, 8)) == 1 and batched.count((32, 4, 8)) == 1  # the column sum
    # the unmarked sums keep their scalar exchanges: d S_next ⊙ S0's (a loop layout), the 1-D ones
    assert set(got["scalar"]) == {"d_Gamma_C_acc", "d_Gamma_C_acc1", "d_g_last_g_to_end_acc1"}, got["scalar"]
    assert got["shared"] <= 227 * 1024
