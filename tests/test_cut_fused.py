"""Context parallelism on the fused kernels, as a whole call of its N·segments sequences would run
them (kernels/forward.py): under cut_wide a cut inference call walks on the wide fused kernel
where that kernel's rule holds for them (a training call's backward on the whole-V scan on
roles), and the planner (kernels/cp_plan.py) weighs those walks; under cut_fused_training a cut
training call's forward is the fused training forward. The host
code with the kernels emulated against the float64 reference, the uncut call and the separate
kernels; the plans; the warm-up's classes; the windows kernel's CUDA; the sweep's fit of the wide
walk's constant."""
import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import torch

import qla_compiler
from qla_compiler.checks import Dims
from qla_compiler.emulate import emulated_kernels
from qla_compiler.kernels import cp_plan
from qla_compiler.kernels import forward as fwd
from qla_compiler.testing import random_inputs, rel_err

# 16 SMs: 2 value heads × 3 sequences (6 CTAs at V-block 128) leave the wide kernel's rule short
# of 70 % of them; cut in 4 (24 CTAs) they pass it
SMS = 16
LENS = [0, 1, 700, 900]  # a 1-token sequence, 11 and 4 chunks, partial last chunks


@pytest.fixture(scope="module")
def call():
    op = qla_compiler.compile("gdn", target="sm90")
    a = random_inputs(op, T=900, H=1, HV=2, K=128, V=128, cu_seqlens=LENS, initial_state=True,
                      dtype=torch.bfloat16, seed=7)
    a["g"][..., 0] = -1.5  # head 0 decays hard (its segments' windows are a chunk), head 1 as drawn
    inputs, dims, scale = op._prepare((), {n: a[n] for n in op.input_names}, None, a["initial_state"],
                                      a["cu_seqlens"], False)
    ref = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in a.items()}
    return op, a, inputs, dims, scale, op.reference(**ref)


def _run(call, segments, cut_wide, keep=False):
    op, a, inputs, dims, scale, _ = call
    with emulated_kernels(op, a["cu_seqlens"].to(torch.int32), scale, block_v=None) as emu, \
            fwd.launch_policy(cut_wide=cut_wide, sms=SMS, fused=True):
        out = fwd.forward(op.program, inputs, op.kinds, dims, scale, a["initial_state"], a["cu_seqlens"],
                          op._head_logs(dims.HV), segments, keep=keep)
    return out[0], out[1], emu


def _scan_roles(emu) -> set:
    """The roles of every walking kernel the call's launches loaded."""
    return {tuple(r.name for r in k.warp_roles) for p in emu.programs for k in p.kernels.kernels if k.walks_chunks}


def test_a_cut_inference_call_walks_its_segments_on_the_wide_kernel(call):
    """Whole, the call runs the narrow fused kernel (6 CTAs); cut in 4 with cut_wide, its windows
    (width K + V) and its walks run the wide one, four roles at V-block 128; without cut_wide the
    same cut runs the narrow one at 64. o and the final state as the float64 reference's, and as
    the narrow cut's (the same sums in another order)."""
    *_, (o_ref, s_ref) = call
    o_whole, s_whole, whole = _run(call, None, True)
    assert _scan_roles(whole) == {("chain", "output", "loads")}
    o_wide, s_wide, wide = _run(call, 4, True)
    assert wide.calls == [("gdn_prep", 128), ("gdn_fused_windows", 256), ("gdn_fused", 128)]
    assert [s.BV for s in wide.shapes[1:]] == [128, 128]  # (the prep's class is the uncut call's)
    assert _scan_roles(wide) == {("state", "value", "output", "loads")}
    # the hard-decaying head walks one chunk of each of the long sequence's three full segments
    skip = wide.seen["gdn_fused_windows"]["skip_chunks"]
    assert skip.shape == (12, 2) and skip[4:7, 0].tolist() == [2, 2, 2] and skip[4:7, 1].tolist() == [0, 0, 0]
    o_narrow, s_narrow, narrow = _run(call, 4, False)
    assert [s.BV for s in narrow.shapes[1:]] == [64, 64] and _scan_roles(narrow) == {("chain", "output", "loads")}
    for o, s in ((o_wide, s_wide), (o_narrow, s_narrow), (o_whole, s_whole)):
        assert rel_err(o, o_ref) <= 1e-2 and rel_err(s, s_ref) <= 1e-3
    assert rel_err(o_wide.double(), o_narrow.double()) <= 1e-3 and rel_err(s_wide, s_narrow) <= 1e-5
    assert rel_err(s_wide, s_whole) <= 1e-5


@pytest.mark.parametrize("spec", ["delta_net", "simple_gla", "retnet", "linear_attn"])
def test_every_specs_cut_walks_on_its_wide_kernel(spec):
    """The other specs' wide kernels walk a cut's windows and segments too (linear attention's
    chain is the state's update alone: three roles), to the float64 reference."""
    op = qla_compiler.compile(spec, target="sm90")
    a = random_inputs(op, T=900, H=1, HV=2, K=128, V=128, cu_seqlens=LENS, initial_state=True,
                      dtype=torch.bfloat16, seed=7)
    inputs, dims, scale = op._prepare((), {n: a[n] for n in op.input_names}, None, a["initial_state"],
                                      a["cu_seqlens"], False)
    with emulated_kernels(op, a["cu_seqlens"].to(torch.int32), scale, block_v=None) as emu, \
            fwd.launch_policy(cut_wide=True, sms=SMS, fused=True):
        o, final = fwd.forward(op.program, inputs, op.kinds, dims, scale, a["initial_state"], a["cu_seqlens"],
                               op._head_logs(dims.HV), 4)
    assert [name for name, _ in emu.calls][-2:] == [f"{spec}_fused_windows", f"{spec}_fused"]
    assert [s.BV for s in emu.shapes][-2:] == [128, 128]
    assert _scan_roles(emu) == {("state", "output", "loads") if spec == "linear_attn" else
                                ("state", "value", "output", "loads")}
    ref = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in a.items()}
    o_ref, s_ref = op.reference(**ref)
    assert rel_err(o, o_ref) <= 1e-2 and rel_err(final, s_ref) <= 1e-3


def test_a_training_forward_under_a_cut_runs_the_plain_scan_either_way(call):
    """Without cut_fused_training a training forward cut in 4 keeps the training program's kernels,
    whatever cut_wide says."""
    runs = {on: _run(call, 4, on, keep=True)[2] for on in (False, True)}
    assert runs[True].calls == runs[False].calls and [s.BV for s in runs[True].shapes] == \
        [s.BV for s in runs[False].shapes]
    assert not any(k.warp_roles for p in runs[True].programs for k in p.kernels.kernels)


def test_a_cut_training_step_runs_the_fused_training_forward_under_the_switch():
    """Under cut_fused_training a training step cut in 3 runs the prep, the fused training
    forward's windows and walks (no separate out kernel), then the backward as always; o, the
    final state and every gradient are the uncut fused step's (float64 emulation: to float32's
    rounding of the segment maps), as the separate kernels' cut is the separate kernels'. Without
    the switch the cut runs the separate kernels."""
    from qla_compiler.emulate import emulated_step

    op = qla_compiler.compile("gdn", target="sm90")
    args = random_inputs(op, T=700, H=1, HV=3, K=64, V=64, cu_seqlens=[0, 1, 520, 700], initial_state=True,
                         dtype=torch.bfloat16, seed=11)
    args["g"][...] = torch.tensor([-1.5, 0.0, -0.02])  # windows of a chunk, whole segments, mild
    with fwd.launch_policy(fused=True):
        whole = emulated_step(op, args)
        with fwd.launch_policy(cut_fused_training=True):
            cut = emulated_step(op, args, segments=3)
        separate = emulated_step(op, args, segments=3)
    forward_calls = [name for name, _ in cut["emulator"].calls if "backward" not in name]
    assert forward_calls == ["gdn_prep", "gdn_fused_windows", "gdn_fused"]
    assert [name for name, _ in separate["emulator"].calls if "backward" not in name] == \
        ["gdn_prep", "gdn_scan_windows", "gdn_scan", "gdn_out"]
    assert [n for n, _ in cut["emulator"].calls if "backward" in n] == \
        [n for n, _ in separate["emulator"].calls if "backward" in n]
    assert rel_err(cut["final"], whole["final"]) <= 1e-6 and rel_err(cut["o"].double(), whole["o"].double()) <= 1e-6
    assert rel_err(cut["d_h0"], whole["d_h0"]) <= 1e-6
    for name in op.input_names:
        assert rel_err(cut["grads"][name], whole["grads"][name]) <= 1e-3, name


def test_under_both_switches_a_cut_training_step_walks_the_wide_kernels_both_ways():
    """With cut_wide and cut_fused_training, 3 sequences × 4 segments × 8 value heads (96 CTAs at
    V-block 128, past 70 % of an H200's SMs) walk the wide fused training forward and the whole-V
    backward scan on roles, each its windows first (width K + V); o, the final state and every
    gradient are those of the uncut step on the same wide kernels (the policy's `wide`), to
    float32's rounding of the segment maps. Its plan weighs the wide walk (cp_plan.walks_wide)."""
    from qla_compiler.emulate import emulated_step

    op = qla_compiler.compile("gdn", target="sm90")
    args = random_inputs(op, T=700, H=2, HV=8, K=128, V=128, cu_seqlens=[0, 1, 520, 700], initial_state=True,
                         dtype=torch.bfloat16, seed=11)
    args["g"][..., 0], args["g"][..., 1] = -1.5, 0.0  # windows of a chunk; whole segments
    with fwd.launch_policy(wide=True):
        whole = emulated_step(op, args, block_v=None)
    with fwd.launch_policy(cut_wide=True, cut_fused_training=True):
        cut = emulated_step(op, args, segments=4, block_v=None)
        assert cp_plan.walks_wide(True) and cp_plan.walks_wide(False)
    assert [n for n, _ in whole["emulator"].calls] == ["gdn_prep", "gdn_fused", "gdn_backward_prep",
                                                      "gdn_backward_scan_roles", "gdn_backward_out"]
    assert cut["emulator"].calls == [("gdn_prep", 128), ("gdn_fused_windows", 256), ("gdn_fused", 128),
                                     ("gdn_backward_prep", 128), ("gdn_backward_scan_roles_windows", 256),
                                     ("gdn_backward_scan_roles", 128), ("gdn_backward_out", 128)]
    walks = [s.BV for (name, _), s in zip(cut["emulator"].calls, cut["emulator"].shapes) if "prep" not in name
             and "out" not in name]
    assert walks == [128, 128, 128, 128]
    # (o in bf16: a float32 difference of the maps flips a few roundings)
    assert rel_err(cut["final"], whole["final"]) <= 1e-6 and rel_err(cut["o"].double(), whole["o"].double()) <= 1e-4
    assert rel_err(cut["d_h0"], whole["d_h0"]) <= 1e-6
    errs = {name: rel_err(cut["grads"][name], whole["grads"][name]) for name in op.input_names}
    assert all(e <= 1e-3 for e in errs.values()), errs  # (as the plain kernels' cut: test_cp_windows)


def test_under_a_cut_the_backward_takes_the_whole_v_scan_on_roles_alone():
    """backward_program_of with segments: the whole-V scan on roles where `wide` (runs_wide for the
    N·segments sequences), never the narrow one on roles (its windows are not built), the plain
    scan elsewhere and where the wide one does not fit (KDA)."""
    from qla_compiler.kernels import backward as bwd

    gdn, kda = (qla_compiler.compile_spec(s) for s in ("gdn", "kda"))
    assert bwd.backward_program_of(gdn, segments=4, wide=True) is gdn.backward_wide_roles_program
    assert bwd.backward_program_of(gdn, segments=4) is gdn.backward_program
    assert bwd.backward_program_of(kda, segments=4, wide=True) is kda.backward_program
    with fwd.launch_policy(backward_scan_roles=True):
        assert bwd.backward_program_of(gdn, segments=4) is gdn.backward_program
        assert bwd.backward_program_of(kda, segments=4, wide=True) is kda.backward_program
    with fwd.launch_policy(backward_scan_roles=False):
        assert bwd.backward_program_of(gdn, segments=4, wide=True) is gdn.backward_program


def test_the_custom_ops_fake_shapes_hold_for_the_fused_training_forward_under_a_cut():
    """qla::run_kernels (what autograd and torch.compile call) under cut_fused_training, cut in 2:
    opcheck runs the fused training forward's windows and walks and the backward, and the fake
    implementation's shapes of what the forward keeps are the kernels' (backward.kept_shapes)."""
    from qla_compiler import ops

    op = ops._op("gdn")
    a = random_inputs(op, T=300, H=1, HV=2, K=64, V=64, cu_seqlens=[0, 30, 300], initial_state=True,
                      dtype=torch.bfloat16)
    leaves = [a[n].detach().requires_grad_() for n in (*op.input_names, "initial_state")]
    with emulated_kernels(op, a["cu_seqlens"], 64 ** -0.5) as emu, \
            fwd.launch_policy(fused=True, cut_fused_training=True):
        torch.library.opcheck(torch.ops.qla.run_kernels.default,
                              (op.key, leaves[:-1], leaves[-1], a["cu_seqlens"], 64 ** -0.5, 2, True, False))
    assert {"gdn_fused_windows", "gdn_fused", "gdn_backward_scan_windows"} <= {n for n, _ in emu.calls}
    assert "gdn_out" not in {n for n, _ in emu.calls}


ROWS = {"8/32:1x32768": (8, 32, 1, 32768), "16/64:1x32768": (16, 64, 1, 32768), "4/16:1x32768": (4, 16, 1, 32768),
        "2/8:1x32768": (2, 8, 1, 32768), "16/64:8x4096": (16, 64, 8, 4096), "4/16:8x4096": (4, 16, 8, 4096),
        "2/8:8x4096": (2, 8, 8, 4096), "16/64:1x2048": (16, 64, 1, 2048), "2/8:1x8192": (2, 8, 1, 8192)}


def test_the_wide_plan_cuts_where_the_wide_walk_fills_the_gpu():
    """With the wide walk weighed, the one-sequence rows are cut into as many segments as put
    their value heads × segments at 128 CTAs (the wide kernel's rule at 132 SMs), and
    16/64 × 32768, kept whole before, in 2; every plan that changes walks on the wide kernel and is
    modelled faster than the narrow plan's (2/8 × 8192 stays at 4 narrow segments: its 128-chunk
    sequence cut in 16 would be mostly windows). The rows whose grid fills the GPU stay whole."""
    plans = {row: (cp_plan.plan_segments(n, H, HV, 128, 128, n * L, fwd.H200_SMS),
                   cp_plan.plan_segments(n, H, HV, 128, 128, n * L, fwd.H200_SMS, wide=True))
             for row, (H, HV, n, L) in ROWS.items()}
    assert {row: p for row, p in plans.items() if p[0] != p[1]} == {
        "8/32:1x32768": (2, 4), "16/64:1x32768": (1, 2), "4/16:1x32768": (4, 8), "2/8:1x32768": (8, 16)}
    assert plans["16/64:8x4096"] == plans["4/16:8x4096"] == plans["2/8:8x4096"] == plans["16/64:1x2048"] == (1, 1)
    for row, (narrow, wide) in plans.items():
        H, HV, n, L = ROWS[row]
        if wide != narrow:
            assert cp_plan.launch_waves(wide, n, HV, 128, 128, fwd.H200_SMS, True)[2], row
            assert cp_plan.predicted_ms(wide, n, H, HV, 128, 128, n * L, fwd.H200_SMS, wide=True) < \
                cp_plan.predicted_ms(narrow, n, H, HV, 128, 128, n * L, fwd.H200_SMS), row
    # without `wide` no term is the wide walk's: the model (and every plan) is the narrow one's
    assert all(cp_plan.cost_terms(s, n, H, HV, 128, 128, n * L, fwd.H200_SMS)["wide_chunk"] == 0
               for H, HV, n, L in ROWS.values() for s in cp_plan.SEGMENTS)


def test_only_an_inference_call_under_cut_wide_plans_the_wide_walk():
    """planned_segments (what "auto" runs): an inference call weighs the wide walk where the launch
    policy's cut_wide is on, a training step only where cut_fused_training is on too (then its
    forward and its backward walk the wide kernels)."""
    dims = Dims(1, 32768, 8, 32, 128, 128, 1)
    with fwd.launch_policy(sms=fwd.H200_SMS, cut_wide=False):
        off = [cp_plan.planned_segments(dims, "cuda", eager, training) for eager, training in
               ((None, False), (None, True), ("inference", False), ("training", True))]
    with fwd.launch_policy(sms=fwd.H200_SMS, cut_wide=True):
        on = [cp_plan.planned_segments(dims, "cuda", eager, training) for eager, training in
              ((None, False), (None, True), ("inference", False), ("training", True))]
        with fwd.launch_policy(fused=False):  # (inference on the separate kernels: no wide walk)
            assert cp_plan.planned_segments(dims, "cuda", None, False) == 2
        with fwd.launch_policy(cut_fused_training=True):  # (a training step's walks wide both ways)
            assert [cp_plan.planned_segments(dims, "cuda", e, True) for e in (None, "training")] == [4, 4]
    assert off == [2, 2, 2, 2] and on == [4, 2, 4, 2]


def test_a_warmup_compiles_what_a_wide_plan_runs():
    """Under cut_wide, a deployment's warm-up (precompile.shape_classes, cp=auto at the call's
    tokens) compiles the wide kernel's windows and walks at the inference plan's 4 segments, and
    the plain scan's at the training plan's 2 (with cut_fused_training too, the training step's
    plan is 4 and its forward and backward walk the wide kernels there); without the length,
    may_choose keeps every count either plan picks at any length."""
    from qla_compiler.precompile import shape_classes

    with fwd.launch_policy(cut_wide=True):
        got = shape_classes("gdn", H=8, HV=32, K=128, n_seqs=1, tokens=32768, sms=132, training=True)
    wide = {(c.kernels, c.shape.V, c.shape.BV) for c in got if c.part == "forward" and c.fused == "wide"}
    assert wide == {("windows", 256, 128), ("scan", 128, 128), ("parallel", 128, 32)}  # (the prep: uncut)
    assert {(c.kernels, c.shape.V, c.shape.BV) for c in got if c.part == "training" and c.kernels != "all"} == \
        {("windows", 256, 64), ("scan", 128, 64), ("parallel", 128, 32)}
    # (the backward's at either plan's count: at the inference plan's 4 on the wide scan on roles)
    assert {(c.kernels, c.shape.V, c.shape.BV) for c in got if c.part == "backward" and c.fused == "wide"} == \
        {("windows", 256, 128), ("scan", 128, 128), ("parallel", 128, 32)}
    with fwd.launch_policy(cut_wide=True, cut_fused_training=True):  # (a training step's plan: 4, wide both ways)
        both = shape_classes("gdn", H=8, HV=32, K=128, n_seqs=1, tokens=32768, sms=132, training=True)
    assert {(c.part, c.kernels, c.shape.V, c.shape.BV, c.fused) for c in both if c.kernels != "all"} == {
        (part, kernels, width, bv, "wide") for part in ("forward", "training", "backward")
        for kernels, width, bv in (("windows", 256, 128), ("scan", 128, 128), ("parallel", 128, 32))}
    for H, HV, N in ((2, 8, 1), (4, 16, 1), (8, 32, 1), (16, 64, 1), (2, 8, 3), (16, 64, 8)):
        chosen = {cp_plan.plan_segments(N, H, HV, 128, 128, N * 64 * c, fwd.H200_SMS, eager=e, wide=True)
                  for c in range(1, 4097, 5) for e in (None, "inference")}
        allowed = {s for s in cp_plan.SEGMENTS if cp_plan.may_choose(s, N, HV, 128, 128, fwd.H200_SMS, True)}
        assert chosen <= allowed, (H, HV, N, chosen - allowed)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
def test_the_wide_windows_kernel_compiles_with_its_budgets_and_no_spills(tmp_path):
    """The wide fused kernel walking windows (width K + V at V-block 128) for sm_90a: its CTA reads
    its skip once and walks skip fewer chunks; its V-block 0 reads the values from column −128,
    which TMA fills with zeros (the maps' identity half); four setmaxnreg budgets; no spills."""
    from test_lowering import _roles_compile_without_spills

    from qla_compiler.kernels.runtime import lower_to_cuda
    from qla_compiler.passes.lower_tilelang import ShapeClass

    program = qla_compiler.compile_spec("gdn").fused_wide_program.windows_program
    cuda = lower_to_cuda(program, ShapeClass(H=8, HV=32, K=128, V=256, BV=128))["gdn_fused_windows"]
    assert cuda.count("skip_chunks[") == 1 and "i_w < (((seq_len + 63) >> 6) - skip)" in cuda
    assert re.search(r"tma_load\(v_desc, [^;]*\(\(\(int\)blockIdx\.x\) \* 128\) - 128\)", cuda)
    _roles_compile_without_spills(cuda, tmp_path, [168, 112, 112, 112])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
def test_the_whole_v_backward_scans_windows_kernel_compiles_with_its_budgets_and_no_spills(tmp_path):
    """The whole-V backward scan on roles walking windows (width K + V at V-block 128, a cut
    training call's under cut_wide) for sm_90a: four setmaxnreg budgets, no spills."""
    from test_lowering import _roles_compile_without_spills

    from qla_compiler.kernels.runtime import lower_to_cuda
    from qla_compiler.passes.lower_tilelang import ShapeClass

    program = qla_compiler.compile_spec("gdn").backward_wide_roles_program.windows_program
    cuda = lower_to_cuda(program, ShapeClass(H=8, HV=32, K=128, V=256, BV=128))["gdn_backward_scan_roles_windows"]
    assert "skip_chunks[" in cuda
    _roles_compile_without_spills(cuda, tmp_path, [168, 112, 112, 112])


def _sweep_module():
    path = Path(__file__).parents[1] / "benchmarks" / "cp_sweep.py"
    spec = importlib.util.spec_from_file_location("cp_sweep", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sweep_fits_the_wide_walk_from_a_wide_sweep():
    """cp_sweep.fit on measurements made by a known model (the H200's constants, the wide chunk at
    3 µs instead of 1.9) from a plain and a wide sweep of the rows: it gives back the wide chunk's
    cost; from the plain sweep alone the wide chunk is not determined and stays at the model's."""
    import dataclasses

    sweep = _sweep_module()
    truth = dataclasses.replace(cp_plan.H200, wide_chunk=0.003)
    data = []
    for row in ("2/8:1x32768", "4/16:1x32768", "8/32:1x32768", "16/64:1x32768", "2/8:8x4096", "16/64:1x2048"):
        H, HV, n, L = ROWS[row]
        for wide in (False, True):
            for s in (1, 2, 4, 8, 16):
                ms = cp_plan.predicted_ms(s, n, H, HV, 128, 128, n * L, fwd.H200_SMS, costs=truth, wide=wide)
                data.append(dict(row=row, segments=s, ms=ms + 0.1, wide=wide))  # (+ a prep the fit cancels)
    both = sweep.fit(data, fwd.H200_SMS)
    assert abs(both["wide_chunk"] - 0.003) <= 1e-6 and abs(both["chunk"] - truth.chunk) <= 1e-6
    plain = sweep.fit([d for d in data if not d["wide"]], fwd.H200_SMS)
    assert plain["wide_chunk"] == cp_plan.H200.wide_chunk
