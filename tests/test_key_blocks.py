"""Kernels on blocks of K's columns (schedule_out._key_block; on by default since session 36,
QLA_KEY_BLOCKS=0 turns it off): KDA's d q d k d g kernel loads d A_T, which the d v d β kernel
computes whole, and runs a CTA per (key block, chunk, value head); GLA's, RetNet's and linear
attention's out kernels split into d v and the keys' gradients, these on key blocks; KDA's
backward prep, starved whole, splits the same way. The switch is read when the schedule is
imported, so the kernels without key blocks come from a child process: the training step through
the GPU path's host code, every kernel interpreted (qla_compiler/emulate.py), is compared with the
same step on them."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import qla_compiler
import qla_compiler.passes.schedule
from qla_compiler.emulate import emulated_step, reference_step
from qla_compiler.ir.kernel import Kernel
from qla_compiler.passes.key_blocks import key_cut
from qla_compiler.testing import random_inputs, rel_err
from child_process import run_child

CU = [0, 1, 41, 141, 200]  # a 1-token sequence, partial chunks
SHAPES = {"K = 64 (two blocks)": dict(K=64, V=32),
          "K = 100 (a 128 tile: four blocks, the last masked)": dict(K=100, V=48)}

SPECS = ("kda", "gla", "retnet", "linear_attn")
CHILD = """
import sys, torch
import qla_compiler
from qla_compiler.emulate import emulated_step
from qla_compiler.testing import random_inputs
out = {{}}
for spec in {specs!r}:
    op = qla_compiler.compile(spec)
    for name, shape in {shapes!r}.items():
        args = random_inputs(op, T=200, H=1, HV=2, cu_seqlens={cu!r}, initial_state=True, dtype=torch.bfloat16,
                             seed=5, **shape)
        step = emulated_step(op, args, rounding=torch.bfloat16)
        out[spec, name] = dict(grads=step["grads"], d_h0=step["d_h0"])
    out[spec] = op.program.backward_program.kernels
torch.save(out, sys.argv[1])
"""


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """What the child process with QLA_KEY_BLOCKS=0 computed: each spec's and shape's gradients,
    and each spec's backward kernels."""
    path = tmp_path_factory.mktemp("key_blocks") / "out.pt"
    run_child(CHILD.format(specs=SPECS, shapes=SHAPES, cu=CU), path, env={"QLA_KEY_BLOCKS": "0"})
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def blocked():
    """Each spec's backward kernels and training-forward kernels as the schedule builds them by default."""
    out = {}
    for spec in (*SPECS, "delta_net"):
        program = qla_compiler.compile_spec(spec)
        out[spec], out[spec, "training"] = program.backward_program.kernels, program.training_program.kernels
    return out


def test_kdas_d_q_d_k_d_g_kernel_runs_on_key_blocks_after_the_kernel_it_loads_from(blocked):
    kernels = {k.name: k for k in blocked["kda"].kernels}
    outs = [k.name for k in blocked["kda"].kernels if k.kind == "out"]
    assert outs == ["kda_backward_out_d_v_d_beta", "kda_backward_out_d_q_d_k_d_g"]
    dv, dq = kernels["kda_backward_out_d_v_d_beta"], kernels["kda_backward_out_d_q_d_k_d_g"]
    assert dq.key_block == 32 and dq.grid[0] == ("key_block", "K/BK") and dq.ctas_per_sm == 2
    assert ("d_A_T_full_rows", "out") in {(p.name, p.role) for p in dv.params}
    assert ("d_A_T_full_rows", "in") in {(p.name, p.role) for p in dq.params}
    assert not any("K" in b.shape for b in dq.buffers) and any("BK" in b.shape for b in dq.buffers)
    # what needed every key is loaded, not computed: no product over K's columns into a C×C block
    assert "d_T_U" not in {b.name for b in dq.buffers} and "d_A_T_full_s" in {b.name for b in dq.buffers}
    assert "key blocks BK = 32" in str(dq) and "grid(key_block:K/BK, chunk_slot:CH, value_head:HV)" in str(dq)


def test_glas_and_retnets_out_kernels_split_where_neither_part_repeats_work(blocked):
    """Their one out kernel becomes d v's and the keys' gradients', these on key blocks (no decayed
    product or matmul done twice: schedule_out._split_for_key_blocks); GDN's stays whole (its parts would
    repeat 7 of its 14 matmuls)."""
    for spec, keys in (("gla", "d_q_d_k_d_g"), ("retnet", "d_q_d_k")):
        outs = [(k.name, k.key_block) for k in blocked[spec].kernels if k.kind == "out"]
        assert outs == [(f"{spec}_backward_out_d_v", 0), (f"{spec}_backward_out_{keys}", 32)], outs
    gdn = qla_compiler.passes.schedule.schedule(
        qla_compiler.compile_spec("gdn").backward_program.stage("partition"), key_blocks=True)
    assert [k.name for k in gdn.kernels if k.kind == "out"] == ["gdn_backward_out"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("spec", SPECS)
def test_key_blocks_give_the_gradients_of_the_whole_kernel(ops, whole, blocked, spec, shape):
    """The same training step on both sets of kernels, each buffer rounded to its dtype as on the GPU
    (a value one kernel hands another crosses memory in the dtype the whole kernel's buffer held it
    in): every gradient agrees (the blocks' columns are the whole kernel's columns; a block reading
    another's columns, or the state's rows at the wrong key, is O(1)), and both meet autograd
    through the float64 recurrence (bf16 blocks between kernels: ~3e-3)."""
    op = ops[spec]
    args = random_inputs(op, T=200, H=1, HV=2, cu_seqlens=CU, initial_state=True, dtype=torch.bfloat16, seed=5,
                         **SHAPES[shape])
    got = emulated_step(op, args, rounding=torch.bfloat16)
    calls = [n for n, _ in got["emulator"].calls]
    assert any(k.key_block for k in blocked[spec].kernels) and not any(k.key_block for k in whole[spec].kernels)
    assert [k.name for k in blocked[spec].kernels] == calls[-len(blocked[spec].kernels):]
    ref = reference_step(op, args, got)
    # (1e-4: each gradient rounds to bf16 once, in the same operations. Not GLA's: with its saved
    # states in float32 (session 41) its out kernels without key blocks fit only on V's column
    # blocks of 64, whose d q and d k are float32 partials the host sums, where the key blocks
    # write them in bf16: ~2.5e-3 apart, the bf16 floor; a block at the wrong columns is O(1))
    for name in op.input_names:
        agree = 5e-3 if spec == "gla" else 1e-4
        assert rel_err(got["grads"][name], whole[spec, shape]["grads"][name]) <= agree, name
        assert rel_err(got["grads"][name], ref["grads"][name]) <= 1e-2, name
    assert rel_err(got["d_h0"], whole[spec, shape]["d_h0"]) <= 1e-5


def test_the_lowering_runs_a_cta_per_key_block(blocked):
    """The TileLang of the kernel on key blocks: its grid's first axis the key blocks, the block's
    columns of every K-wide tensor and the block's rows of the per-chunk states."""
    from qla_compiler.passes.lower_tilelang import ShapeClass, lower

    src = lower(blocked["kda"], ShapeClass(H=2, HV=4, K=100, V=48))
    kernel = src[src.index("def kda_backward_out_d_q_d_k_d_g("):]
    assert "BK32 = 32  #" in src
    assert "with T.Kernel(KP // BK32, CH, HV, threads=256) as (i_kb, i_slot, i_hv):" in kernel
    assert "k0 = i_kb * BK32" in kernel and "T.annotate_min_blocks_per_sm(2)" in kernel
    assert "S0_chunks[i_slot, i_hv, k0:k0 + BK32, 0:VP]" in kernel
    assert "k[0, t0 + i, i_h, k0 + j]" in kernel and "k0 + j < K" in kernel  # (K = 100: masked loads)


def test_preps_split_where_their_k_wide_results_need_no_other_key_and_the_whole_is_starved(blocked):
    """KDA's backward prep (4 warps an SM, spilling) is P Γ, d P and d v_new's intra-chunk term, then
    W and the keys' sums of d P on key blocks, which load d P as the first stores it
    (schedule._prep_kernels). The preps that run 8 warps an SM whole without spilling stay whole
    (PREP_FED): split, KDA's training forward prep took as long as whole (H100, session 36). GDN's
    preps stay whole besides: they scale T_r and d P by the decay before their products, and loaded
    in bf16 those would round twice."""
    first, then = [k for k in blocked["kda"].kernels if k.kind == "prep"]
    assert (first.key_block, then.key_block) == (0, 32)
    assert all("K" in p.shape for p in then.params if p.role == "out")
    assert "d_P_rows" in {p.name for p in first.params if p.role == "out"}
    assert "d_P_rows" in {p.name for p in then.params if p.role == "in"}
    for kernels in (blocked["kda", "training"], blocked["delta_net"], blocked["delta_net", "training"]):
        assert [k.key_block for k in kernels.kernels if k.kind == "prep"] == [0], kernels.name
    for program in ("backward_program", "training_program"):
        part = getattr(qla_compiler.compile_spec("gdn"), program).stage("partition")
        kir = qla_compiler.passes.schedule.schedule(part, key_blocks=True)
        assert [k.key_block for k in kir.kernels if k.kind == "prep"] == [0], program


def test_a_kernel_that_needs_every_key_is_not_cut():
    """key_cut: d β sums over K (its output needs every key); GDN's one backward out kernel writes d β
    too; GLA's writes d v, which no key block can write alone."""
    for spec in ("kda", "gdn", "gla"):
        part = qla_compiler.compile_spec(spec).backward_program.stage("partition")
        ir, loaded = part.chunk, part.out_loads
        cut, why = key_cut(ir, ir.closure(list(ir.outputs.values()), stop=loaded), loaded)
        assert cut is None and why.endswith("is an output that needs every key"), (spec, why)


def test_the_verifier_holds_a_kernel_on_key_blocks_to_its_grid_and_buffers(blocked):
    import dataclasses

    k = next(k for k in blocked["kda"].kernels if k.key_block)
    k.verify()
    bad = {
        "no key_block axis": dataclasses.replace(k, grid=(("chunk_slot", "CH"), ("value_head", "HV"))),
        "a width outside KEY_BLOCK_WIDTHS": dataclasses.replace(k, key_block=48),
        "a buffer K wide": dataclasses.replace(k, buffers=[dataclasses.replace(k.buffers[0], shape=("C", "K"))]
                                               + k.buffers[1:]),
    }
    for what, kernel in bad.items():
        with pytest.raises(ValueError, match="key block|K wide"):
            Kernel.verify(kernel)


def test_with_twice_the_warpgroups_too_the_blocks_are_the_ones_that_do_not_spill():
    """With QLA_MORE_WARPGROUPS=1 as well, KDA's d q d k d g kernel runs 16 warps an SM either way:
    whole on 512 threads it spills (104 fragment registers a thread and the rest past 128), on
    64-key blocks it does not (schedule_memory.occupancy: more warps first, then no spills). Its
    backward prep, fed on 256 threads, stays whole."""
    code = ("import qla_compiler; "
            "p = qla_compiler.compile_spec('kda').backward_program; "
            "print({k.name: (k.threads, k.key_block) for k in p.kernels.kernels if k.kind != 'scan'})")
    outs = run_child(code, env={"QLA_MORE_WARPGROUPS": "1"})
    assert eval(outs) == {"kda_backward_prep": (256, 0), "kda_backward_out_d_v_d_beta": (256, 0),  # noqa: S307
                          "kda_backward_out_d_q_d_k_d_g": (512, 64)}


def test_a_module_holds_kernels_of_two_widths(blocked):
    """Each width has its own module constant (BK32, BK64), each kernel's buffers and loads read its
    own: a module of KDA's backward prep on 32-key blocks and its d q d k d g kernel on 64."""
    from qla_compiler.passes.lower_tilelang import ShapeClass, lower

    kir = blocked["kda"]
    mixed = dataclasses.replace(kir, kernels=[dataclasses.replace(k, key_block=64)
                                              if k.name == "kda_backward_out_d_q_d_k_d_g" else k
                                              for k in kir.kernels])
    src = lower(mixed, ShapeClass(H=2, HV=4, K=128, V=128))
    assert [ln.split("  #")[0] for ln in src.splitlines() if ln.startswith("BK")] == ["BK32 = 32", "BK64 = 64"]
    out = src[src.index("def kda_backward_out_d_q_d_k_d_g("):]
    prep = src[src.index("def kda_backward_prep_W"):src.index("def kda_backward_out")]
    assert "k0 = i_kb * BK64" in out and "BK32" not in out
    assert "k0 = i_kb * BK32" in prep and "BK64" not in prep
