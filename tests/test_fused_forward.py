"""The fused, warp-specialised forward (passes/schedule_fused.py, passes/lower_fused.py) on the CPU:
its KernelIR run by the role interpreter (ir/kernel_interp_roles.py) against the float64 reference
for every spec, the interpreter's checks of the barriers (a wait or an arrival taken out is an
error that names it), and what the lowering emits (roles, setmaxnreg, mbarriers; no spills)."""
import dataclasses
import re
import shutil

import pytest
import torch

import qla_compiler
from qla_compiler.emulate import emulated_kernels
from qla_compiler.errors import PassError
from qla_compiler.ir.kernel_interp import InterpretError, Sizes, run_kernel
from qla_compiler.ir.kernel_interp_roles import run_roles
from qla_compiler.kernels import forward as fwd
from qla_compiler.passes import schedule_fused
from qla_compiler.passes.lower_tilelang import ShapeClass, lower
from qla_compiler.testing import random_inputs, rel_err

SPECS = ["gdn", "delta_net", "simple_gla", "retnet", "linear_attn"]
LENS = [0, 1, 130, 400]  # a 1-token sequence, partial last chunks; 5 chunks wrap the 3-deep load ring


def _forward(op, a, fused):
    inputs, dims, scale = op._prepare((), {n: a[n] for n in op.input_names}, None, a["initial_state"],
                                      a["cu_seqlens"], False)
    with emulated_kernels(op, a["cu_seqlens"].to(torch.int32), scale) as emu:
        o, final = fwd.forward(op.program, inputs, op.kinds, dims, scale, a["initial_state"], a["cu_seqlens"],
                               op._head_logs(dims.HV), fused=fused)
    return o, final, emu, scale


@pytest.fixture(scope="module")
def runs():
    """Per spec: the inputs, and the emulated forward both ways (fused and separate kernels)."""
    out = {}
    for spec in SPECS:
        op = qla_compiler.compile(spec, target="sm90")
        a = random_inputs(op, T=400, H=1, HV=2, K=64, V=64, cu_seqlens=LENS, initial_state=True,
                          dtype=torch.bfloat16, seed=3)
        out[spec] = (op, a, _forward(op, a, True), _forward(op, a, False))
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_fused_forward_matches_reference(runs, spec):
    """Prep (where the spec has one), then the one fused kernel; o and the final state agree with
    the float64 reference to bf16 (o is stored in bf16), as the separate kernels do."""
    op, a, (o, final, emu, _), (o_sep, final_sep, emu_sep, _) = runs[spec]
    names = [n for n, _ in emu.calls]
    assert names[-1] == f"{spec}_fused" and f"{spec}_out" not in names and f"{spec}_scan" not in names
    assert [n for n, _ in emu_sep.calls][-1] == f"{spec}_out"
    ref = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in a.items()}
    o_ref, s_ref = op.reference(**ref)
    assert rel_err(o, o_ref) <= 1e-2 and rel_err(final, s_ref) <= 1e-2  # (the prep stores bf16 blocks)
    assert rel_err(o, o_sep) <= 1e-2  # (the separate kernels round the states and v_new to bf16 in HBM)
    # the chain's statements are the scan's, except where fold_wy reshaped them (the delta rule:
    # the separate kernels round W and U to bf16 in HBM, the fused one T_r)
    folded = "fold_wy" in [n for n, _ in op.program.fused_program.stages]
    assert folded == (spec in ("gdn", "delta_net"))
    assert rel_err(final, final_sep) <= (5e-3 if folded else 1e-12)


@pytest.mark.parametrize("spec", ["gdn", "simple_gla"])
def test_fused_forward_at_v_block_64_matches_reference(spec):
    """At the V-block the big rows launch (64, two V-blocks of K = V = 128), where the load ring is
    3 deep and v_new_decayed lives in v_resid's memory: o and the final state as the reference's,
    every kernel run by the interpreter at that V-block."""
    op = qla_compiler.compile(spec, target="sm90")
    a = random_inputs(op, T=400, H=1, HV=2, K=128, V=128, cu_seqlens=LENS, initial_state=True,
                      dtype=torch.bfloat16, seed=5)
    inputs, dims, scale = op._prepare((), {n: a[n] for n in op.input_names}, None, a["initial_state"],
                                      a["cu_seqlens"], False)
    with emulated_kernels(op, a["cu_seqlens"].to(torch.int32), scale, block_v=64) as emu:
        o, final = fwd.forward(op.program, inputs, op.kinds, dims, scale, a["initial_state"], a["cu_seqlens"],
                               op._head_logs(dims.HV), fused=True)
    assert emu.calls[-1][0] == f"{spec}_fused" and emu.shapes[-1].BV == 64
    assert emu.programs[-1].kernels.kernels[-1].max_stages >= 3
    ref = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in a.items()}
    o_ref, s_ref = op.reference(**ref)
    assert rel_err(o, o_ref) <= 1e-2 and rel_err(final, s_ref) <= 1e-2


def test_the_fused_delta_rule_forms_w_and_u_on_the_fly():
    """fold_wy before the fused schedule: v_new = T·(diag(β)V − diag(βΓ)K·S₀) in the chain, so the
    prep solves the inverse alone and no W or U tensor exists (FlashQLA's split, issue 16's design). Then
    scale_after_product_on_chain: K·S₀ reads the loaded keys, and diag(βΓ) scales the V-block-wide product
    inside the pass that forms v_resid, so the chain makes no C×K block of its own."""
    prog = qla_compiler.compile_spec("gdn").fused_program
    prep, fused = prog.kernels.kernels
    # the prep stores T = T_r ⊙ R (partition._folded_into_prep: T_r's only reader, same shape), so
    # the chain loads the gated inverse instead of forming it every chunk
    assert {p.name for p in prep.params if p.role == "out"} == {"g_cum", "T_rows"}
    tensors = {p.name for k in prog.kernels.kernels for p in k.params}
    assert not tensors & {"W_rows", "U_rows", "S0_chunks", "v_new_rows"}
    chain = next(r for r in fused.warp_roles if r.name == "chain")
    assert [st.srcs for st in chain.body if st.op == "gemm"][:2] == [("k_s", "state_s"), ("T_s", "v_resid_s")]
    assert not [b for b in fused.buffers if b.owner == "chain" and b.shape in (("C", "K"), ("C", "C"))]
    # what the chain no longer keeps, and v_new_decayed in v_resid's memory, give the load ring
    # a third copy at V-block 64
    assert fused.max_stages == 3 and prog.kernels.block_v_max == 64
    assert fused.buffer("v_new_decayed_s").shares == "v_resid_s"
    assert [n for n, _ in prog.stages][-4:] == ["fold_wy", "scale_after_product_on_chain", "partition", "schedule"]


def _fused(op):
    return op.program.fused_program.kernels.kernels[-1]


def _replay(op, scale, seen, kernel, order=None):
    """Run `kernel` (the fused one, or a mutant) on the tensors the fused launch was given."""
    t = {n: x.clone() for n, x in seen.items()}
    for n in ("o", "final_state"):
        t[n].zero_()
    sizes = Sizes(K=64, V=64, BV=32, HV=2, G=2, C=64, head_logs=op._head_logs(2))
    run_roles(kernel, t, sizes, scale, order=order) if order else run_kernel(kernel, t, sizes, scale)
    return t


def test_any_role_order_the_barriers_allow_gives_the_same_result(runs):
    op, _, (_, _, emu, scale), _ = runs["gdn"]
    k = _fused(op)
    seen = emu.seen[k.name]
    first = _replay(op, scale, seen, k)
    for order in (("output", "chain", "loads"), ("loads", "chain", "output"), ("chain", "loads", "output")):
        again = _replay(op, scale, seen, k, order)
        assert torch.equal(again["o"], first["o"]) and torch.equal(again["final_state"], first["final_state"])
    assert torch.equal(first["o"], seen["o"])


def _without(kernel, role: str, pred):
    """The kernel with the first statement of `role` that satisfies `pred` taken out."""
    roles = []
    for r in kernel.warp_roles:
        body = list(r.body)
        if r.name == role:
            body.pop(next(i for i, s in enumerate(body) if pred(s)))
        roles.append(dataclasses.replace(r, body=tuple(body)))
    return dataclasses.replace(kernel, warp_roles=tuple(roles))


MUTANTS = {
    # the output role reads the loads' ring without waiting for it (whatever order the roles run in)
    "output reads loads unwaited": ("output", lambda s: s.op == "wait" and s.dst == "loads_full",
                                    r"role output at chunk 0: `.*` reads \w+_s without waiting on the barrier "
                                    "that hands it over"),
    # the chain overwrites its hand-off to the output without waiting for the output to be done
    "chain skips the empty wait": ("chain", lambda s: s.op == "wait" and s.dst == "state_s_empty",
                                   r"writes state_s without waiting for its readers to be done"),
    # the loads role zeroes the padding rows before the TMA bytes are in
    "loads skip the landed wait": ("loads", lambda s: s.op == "wait" and s.dst == "loads_landed",
                                   r"touches k_s before the wait on its TMA load's landed barrier"),
    # an arrival left out: the barrier never completes its phase
    "output never releases loads": ("output", lambda s: s.op == "arrive" and s.dst == "loads_empty",
                                    r"deadlock: .*waits on loads_empty"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_barrier_mistakes_are_named(runs, mutant):
    op, _, (_, _, emu, scale), _ = runs["gdn"]
    k = _fused(op)
    role, pred, message = MUTANTS[mutant]
    with pytest.raises(InterpretError, match=message):
        _replay(op, scale, emu.seen[k.name], _without(k, role, pred))


def test_a_missing_arrival_at_the_end_is_named(runs):
    """The output role's last hand-back of v_new left out: the chain finishes anyway (two copies),
    and the barrier is left one role's arrivals short."""
    op, _, (_, _, emu, scale), _ = runs["gdn"]
    k = _fused(op)
    with pytest.raises(InterpretError, match=r"v_new_s_empty\[\d\] \(0 of 128\)|deadlock"):
        _replay(op, scale, emu.seen[k.name], _without(k, "output", lambda s: s.op == "arrive" and s.dst == "v_new_s_empty"))


def test_the_loads_role_makes_the_vectors_the_blocks_scale_by():
    """The per-token vectors the compute roles' blocks scale by are made once a chunk by the loads
    role into its ring (session 14's ncu: inlined, every block element recomputed its exponential,
    ~40% of the chain's element-wise passes); the blocks read them. The C×C mask's exponential of
    a difference stays per element (it is no vector), on the pre-scaled log2 gates."""
    from qla_compiler.ir.kernel import expr_str

    k = _fused(qla_compiler.compile("gdn", target="sm90"))
    roles = {r.name: r for r in k.warp_roles}
    made = {st.dst for st in roles["loads"].body if st.op == "ewise"}
    assert made == {"g_cum_log2_s", "Gamma_s", "s_Gamma_s", "decay_to_end_s"}
    assert all(k.buffer(x).stages == k.max_stages and k.buffer(x).owner == "loads" for x in made)
    blocks = [expr_str(st.attr["expr"]) for r in ("chain", "output") for st in roles[r].body
              if st.op == "ewise" and len(st.attr["index"]) == 2]
    mask, decay = "exp2((g_cum_log2_s[i] − g_cum_log2_s[j]))", "exp2(g_cum_log2_s[n_valid - 1])"  # (a scalar)
    assert any(mask in e for e in blocks)
    assert not [e for e in blocks if "exp2(" in e.replace(mask, "").replace(decay, "")], blocks


def test_fused_kernel_prints_its_roles_and_barriers():
    text = str(qla_compiler.compile_spec("gdn").fused_program.kernels)
    for line in ("role chain: threads [0, 128)", "role output: threads [128, 256)", "role loads: threads [256, 384), 112",
                 "barrier  loads_full[3]: 128 arrivals", "barrier  loads_empty[3]: 256 arrivals",
                 "v_new_decayed_s: io[C×BV]  (written by chain)  (in v_resid_s's memory)",
                 "shared   state_s: io[K×BV] ×2 stages  (written by chain)", "wait state_s_full",
                 "arrive v_new_s_empty", "fence_async"):
        assert line in text, line


def test_lowering_emits_roles_register_budgets_and_barriers():
    src = lower(qla_compiler.compile_spec("gdn").fused_program.kernels, ShapeClass(H=2, HV=8, K=128, V=128, BV=32))
    fused = src[src.index("def gdn_fused"):]
    assert "if tx < 128:  # role chain" in fused and "elif tx < 256:  # role output" in fused
    assert "T.set_max_nreg(192, 1)" in fused and "T.set_max_nreg(112, 0)" in fused  # 2 · 192 + 112 ≤ 3 · 168
    assert "state_s = T.alloc_shared((2, K, BV), IO)" in fused
    assert "T.barrier_wait(loads_empty[stage3], phase3 ^ 1)" in fused  # the load ring, 3 deep
    assert "T.barrier_wait(state_s_full[stage2], phase2)" in fused  # the chain's hand-over, 2 deep
    assert "stage3 = i_c % 3" in fused and "phase2 = (i_c // 2) % 2" in fused
    assert "k_s = T.alloc_shared((3, C, K), IO)" in fused
    assert "v_new_decayed_s = v_resid_s  # chain's, in v_resid_s's memory" in fused
    assert "barrier=loads_landed[stage3], leader_scope_threads=32" in fused
    assert "T.Pipelined" not in fused  # (TileLang's automatic warp specialisation stays out)


def test_unfusable_programs_keep_their_separate_kernels(monkeypatch):
    """Where the rings do not fit in shared memory the runtime keeps the three kernels. K = V = 256
    fits the H200's (two copies of the load ring, 213 KB: the chain forms no C×K or C×C block of
    its own); with a budget 16 KB smaller it does not."""
    shape = fwd.scan_class(16, 64, 256, 256, 1, "bfloat16", 132)
    program = qla_compiler.compile_spec("gdn").for_shape(shape)
    assert fwd.fused_or_not(program).kernels.kernels[-1].max_stages == 2
    monkeypatch.setattr(schedule_fused, "FUSED_SMEM_BUDGET", schedule_fused.FUSED_SMEM_BUDGET - 16 * 1024)
    program = qla_compiler.compile_spec("gdn").for_shape(shape)
    assert fwd.fused_or_not(program) is program
    small = qla_compiler.compile_spec("gdn")
    assert fwd.fused_or_not(small) is small.fused_program


def test_a_fused_schedule_bug_is_raised_not_run_unfused(monkeypatch):
    """Only errors.NotFusable (no room, no such kernel) sends a call to the separate kernels; any
    other failure of the fused schedule is a bug and reaches the caller, where falling back would
    hide it behind slower kernels."""
    from qla_compiler.errors import NotFusable, PassError

    def broken(*args, **kwargs):
        raise PassError("schedule", "a role reads a fragment another role wrote")
    monkeypatch.setattr(schedule_fused, "_budgets", broken)
    with pytest.raises(PassError, match="a role reads a fragment") as e:
        fwd.fused_or_not(qla_compiler.compile_spec("gdn"))
    assert not isinstance(e.value, NotFusable)


@pytest.mark.parametrize("spec", ["linear_attn", "gdn"])
def test_wide_fused_budgets_are_setmaxnreg_budgets_at_small_k(spec):
    """At K = 64 the wide kernel's state role needs few registers, and the rest of the pool shared
    by two roles came to 288 a thread, more than setmaxnreg takes (256): the verifier refused it."""
    kernels = qla_compiler.compile_spec(spec).scheduled_for((64, 64)).fused_wide_program.kernels
    roles = kernels.kernels[-1].warp_roles
    assert all(r.registers % 8 == 0 and 24 <= r.registers <= 256 for r in roles)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
def test_fused_cuda_has_setmaxnreg_and_mbarriers_and_no_spills(tmp_path):
    """And the roles' budgets fit the pool the CTA is launched with, as ptxas allocates it: an
    increase beyond it waits forever (200 + 200 + 112 hung the H200 at 168 per thread)."""
    from test_lowering import _ptxas_report, _role_registers

    from qla_compiler.kernels.runtime import lower_to_cuda

    program = qla_compiler.compile_spec("gdn").fused_program
    cuda = lower_to_cuda(program, ShapeClass(H=2, HV=8, K=128, V=128, BV=64))["gdn_fused"]  # (the widest)
    budgets = _role_registers(cuda)
    assert len(budgets) == 3 and "warpgroup_reg_dealloc<112>" in cuda
    assert "state_s_full[(i_c & 1)].arrive()" in cuda and ".wait(" in cuda and "tma_load(" in cuda
    report = _ptxas_report(cuda, tmp_path)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), spills
    used = int(re.search(r"'gdn_fused_kernel'.*?Used (\d+) registers", report, re.S).group(1))
    assert sum(budgets) * 128 <= 384 * used, (budgets, used)


def test_cli_emits_the_fused_kernel(capsys, tmp_path):
    from qla_compiler.cli import main

    assert main(["gdn", "--emit", "kernel", "--fused", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "kernel gdn_fused" in out and "role output: threads [128, 256)" in out and "kernel gdn_out" not in out
    assert (tmp_path / "gdn.fused.kernel.txt").exists()
    assert main(["gdn", "--emit", "kernel", "--fused", "--token-step"]) == 1
    assert "--token-step and --fused: choose one" in capsys.readouterr().err


def test_the_policy_picks_the_fused_kernel(runs):
    """The launch policy's `fused` (what qla-bench --fused and QLA_FUSED_FORWARD set): inference
    calls run the fused kernel; a training forward runs the fused training forward too, unless the
    policy's `fused_training` is False (QLA_FUSED_TRAINING=0): then the separate kernels."""
    op, a, _, _ = runs["simple_gla"]
    inputs, dims, scale = op._prepare((), {n: a[n] for n in op.input_names}, None, a["initial_state"],
                                      a["cu_seqlens"], False)
    before = fwd.POLICY.fused
    for keep, training, expect in ((False, None, "simple_gla_fused"), (True, None, "simple_gla_fused"),
                                   (True, False, "simple_gla_out")):
        with fwd.launch_policy(fused=True, fused_training=training), \
                emulated_kernels(op, a["cu_seqlens"].to(torch.int32), scale) as emu:
            fwd.forward(op.program, inputs, op.kinds, dims, scale, a["initial_state"], a["cu_seqlens"],
                        op._head_logs(dims.HV), keep=keep)
        assert emu.calls[-1][0] == expect, (keep, training)
        assert [n for n, _ in emu.calls].count("simple_gla_scan") == (expect == "simple_gla_out")
    assert fwd.POLICY.fused is before


def test_by_default_inference_is_fused_where_the_grid_fills_the_gpu(runs):
    """With no policy set (fused None), an inference call runs the fused forward where its grid at
    block_v's V-block gives 70% of the SMs a CTA (fused_pays), the separate kernels elsewhere: this
    test's 2 value heads and 4 sequences give 8 CTAs of 132 SMs (separate), 2 SMs' worth of policy
    (fused)."""
    op, a, _, _ = runs["gdn"]
    inputs, dims, scale = op._prepare((), {n: a[n] for n in op.input_names}, None, a["initial_state"],
                                      a["cu_seqlens"], False)
    for sms, expect in ((132, "gdn_out"), (2, "gdn_fused")):
        with emulated_kernels(op, a["cu_seqlens"].to(torch.int32), scale) as emu, \
                fwd.launch_policy(fused=None, sms=sms):
            fwd.forward(op.program, inputs, op.kinds, dims, scale, a["initial_state"], a["cu_seqlens"],
                        op._head_logs(dims.HV))
        assert emu.calls[-1][0] == expect, (sms, emu.calls)


@pytest.mark.parametrize("spec", SPECS)
def test_context_parallel_runs_the_fused_kernel_as_its_scan(runs, spec):
    """A context-parallel inference call (qla_compiler/context_parallel.py) runs the prep once and
    the fused kernel twice: on the widened values [0 | v] (width K + V, each segment's map, walking
    its window: passes/walk_skip.py), then on v from each segment's start state. Its o and final state are the fused forward's, to bf16."""
    op, a, (o_whole, final_whole, _, scale), _ = runs[spec]
    inputs, dims, _ = op._prepare((), {n: a[n] for n in op.input_names}, None, a["initial_state"],
                                  a["cu_seqlens"], False)
    with emulated_kernels(op, a["cu_seqlens"].to(torch.int32), scale) as emu, fwd.launch_policy(fused=True):
        o, final = fwd.forward(op.program, inputs, op.kinds, dims, scale, a["initial_state"], a["cu_seqlens"],
                               op._head_logs(dims.HV), 3)
    prep = [(f"{spec}_prep", 64)] if f"{spec}_prep" in {k.name for k in op.program.kernels.kernels} else []
    assert emu.calls == prep + [(f"{spec}_fused_windows", 128), (f"{spec}_fused", 64)]
    ref = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in a.items()}
    o_ref, s_ref = op.reference(**ref)
    assert rel_err(o, o_ref) <= 1e-2 and rel_err(final, s_ref) <= 1e-2
    assert rel_err(o, o_whole) <= 1e-2 and rel_err(final, final_whole) <= 1e-3


def test_fused_forward_in_padded_tiles():
    """K = 100, V = 60 in 128- and 64-wide tiles: the op's own blocks load masked (by the loads
    role's threads), the prep's padded ones by TMA; the result is the reference's."""
    op = qla_compiler.compile("gdn", target="sm90")
    a = random_inputs(op, T=200, H=1, HV=2, K=100, V=60, cu_seqlens=[0, 1, 90, 200], initial_state=True,
                      dtype=torch.bfloat16, seed=4)
    o, final, emu, _ = _forward(op, a, True)
    assert emu.calls[-1][0] == "gdn_fused"
    ref = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in a.items()}
    o_ref, s_ref = op.reference(**ref)
    assert rel_err(o, o_ref) <= 1e-2 and rel_err(final, s_ref) <= 1e-2


def test_one_warps_arrival_stays_one_warps_between_masked_loads():
    """In padded tiles the masked loads (every thread of the role) split the TMA group; the landed
    barrier's arrival after them must still come from the issuing warp alone. From all 128 threads
    it completed the 32-arrival barrier's phase four times over: the H200 faulted (session 12)."""
    src = lower(qla_compiler.compile_spec("gdn").fused_program.kernels,
                ShapeClass(H=1, HV=2, K=100, V=60, BV=32))
    lines = src[src.index("def gdn_fused"):].splitlines()
    arrivals = [i for i, ln in enumerate(lines) if "T.barrier_arrive(loads_landed" in ln]
    assert arrivals
    for i in arrivals:
        guard = next(ln for ln in reversed(lines[:i]) if ln.strip().startswith(("if tx <", "for ", "T.")))
        assert guard.strip().startswith("if tx < 288:") and len(guard) - len(guard.lstrip()) < \
            len(lines[i]) - len(lines[i].lstrip()), (guard, lines[i])


def test_the_fused_forward_launches_at_v_blocks_up_to_64():
    """Its shared memory is budgeted at the widest V-block whose load ring is still 3 deep: 64 at
    K = 128 (the output role's Q Kᵀ and mask, the same at every V-block, run half as often as at
    32), 32 at K = 256, where 64 does not fit; the lowering refuses a wider launch."""
    prog = qla_compiler.compile_spec("gdn")
    assert prog.fused_program.kernels.block_v_max == 64 and prog.kernels.block_v_max == 64
    k = prog.fused_program.kernels.kernels[-1]
    assert k.max_stages == 3 and {b.stages for b in k.barriers} == {2, 3}
    assert fwd.scan_class(16, 64, 128, 128, 1, "bfloat16", 132).BV == 64
    wide = prog.scheduled_for((256, 256)).fused_program.kernels
    assert wide.block_v_max == 32 and wide.kernels[-1].max_stages == 2
    with pytest.raises(PassError, match="V-blocks up to 32"):
        lower(wide, ShapeClass(H=2, HV=8, K=256, V=256, BV=64))


def test_a_buffer_in_anothers_memory_is_that_memory_in_the_interpreter(runs):
    """Buffer.shares is what the interpreter runs, as the GPU does. A mutant chain that forms v_new
    from v_resid once more after v_new_decayed was written, and the decayed v_new from it again,
    reads v_new_decayed there when the two share memory (another state, so another o), and
    v_resid's own value when they do not (the same o). Sharing across roles, whose statements
    interleave, the verifier refuses."""
    op, _, (_, _, emu, scale), _ = runs["gdn"]
    k = _fused(op)
    seen = emu.seen[k.name]
    assert k.buffer("v_new_decayed_s").shares == "v_resid_s"
    chain = next(r for r in k.warp_roles if r.name == "chain")
    body = list(chain.body)
    again = next(st for st in body if st.op == "gemm" and st.srcs == ("T_s", "v_resid_s"))
    at = next(i for i, st in enumerate(body) if st.dst == "v_new_decayed_s")
    decay = body[at - 1]
    assert decay.op == "ewise" and decay.dst == "v_new"  # (the decay in place, then its copy)
    body[at + 1:at + 1] = [again, decay, body[at]]
    roles = tuple(dataclasses.replace(r, body=tuple(body)) if r is chain else r for r in k.warp_roles)
    mutant = dataclasses.replace(k, warp_roles=roles)
    apart = dataclasses.replace(mutant, buffers=[dataclasses.replace(b, shares="") for b in k.buffers])
    assert torch.equal(_replay(op, scale, seen, apart)["o"], seen["o"])
    assert not torch.equal(_replay(op, scale, seen, mutant)["o"], seen["o"])
    across = dataclasses.replace(k, buffers=[dataclasses.replace(b, shares="v_resid_s") if b.name == "o_s" else b
                                             for b in k.buffers])
    with pytest.raises(ValueError, match="o_s shares v_resid_s's memory"):
        across.verify()


def test_the_fused_forward_keeps_the_decay_on_the_value_side():
    """A call whose separate kernels take V-block 64 at K = 128 runs them with the decay on the key
    side (decay_value_side pays below K/2 there); the fused kernel, at the same V-block, takes it
    on the value side anyway (Program.fused_program): its chain runs every pass itself, so a C×BV
    pass beats the key side's C×K one (on the H200's 16/64 rows it had run that C×K pass)."""
    op = qla_compiler.compile("gdn", target="sm90")
    a = random_inputs(op, T=150, H=1, HV=2, K=128, V=128, cu_seqlens=[0, 1, 70, 150], initial_state=True,
                      dtype=torch.bfloat16, seed=3)
    inputs, dims, scale = op._prepare((), {n: a[n] for n in op.input_names}, None, a["initial_state"],
                                      a["cu_seqlens"], False)
    ran = {}
    for fused in (False, True):
        with emulated_kernels(op, a["cu_seqlens"].to(torch.int32), scale, block_v=64) as emu:
            o, final = fwd.forward(op.program, inputs, op.kinds, dims, scale, a["initial_state"], a["cu_seqlens"],
                                   op._head_logs(dims.HV), fused=fused)
        ran[fused] = ({n for n, _ in emu.programs[-1].stages}, emu.shapes[-1].BV, o)
    assert "decay_value_side" not in ran[False][0] and ran[False][1] == 64
    assert "decay_value_side" in ran[True][0] and ran[True][1] == 64
    assert rel_err(ran[True][2], ran[False][2]) <= 1e-2


def test_the_kernel_verifier_refuses_what_the_lowering_cannot_emit():
    k = _fused(qla_compiler.compile("gdn", target="sm90"))
    k.verify()
    chain, output, loads = k.warp_roles
    cases = {
        r"roles are whole warpgroups": (dataclasses.replace(output, first=160), chain, loads),
        r"not a setmaxnreg budget": (dataclasses.replace(chain, registers=201), output, loads),
        # 200 + 200 + 112 fit the SM's 64K but not the CTA's 3 · 168: the H200 hung on it
        r"exceed the CTA's pool": (dataclasses.replace(chain, registers=200), dataclasses.replace(output, registers=200),
                                   loads),
        r"names no barrier": (dataclasses.replace(chain, body=chain.body + (chain.body[0].renamed({"state_s_empty": "x"}),)),
                              output, loads),
    }
    for message, roles in cases.items():
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(k, warp_roles=tuple(sorted(roles, key=lambda r: r.first))).verify()


# ---- the wide fused kernel (V-block 128: the chain cut into a state role and a value role) ---------

def _wide_forward(spec, seed=5):
    op = qla_compiler.compile(spec, target="sm90")
    a = random_inputs(op, T=400, H=1, HV=2, K=128, V=128, cu_seqlens=LENS, initial_state=True,
                      dtype=torch.bfloat16, seed=seed)
    inputs, dims, scale = op._prepare((), {n: a[n] for n in op.input_names}, None, a["initial_state"],
                                      a["cu_seqlens"], False)
    with emulated_kernels(op, a["cu_seqlens"].to(torch.int32), scale, block_v=128) as emu:
        o, final = fwd.forward(op.program, inputs, op.kinds, dims, scale, a["initial_state"], a["cu_seqlens"],
                               op._head_logs(dims.HV), fused=True)
    ref = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in a.items()}
    return op, (o, final), op.reference(**ref), emu, scale


@pytest.fixture(scope="module")
def wide_runs():
    return {spec: _wide_forward(spec) for spec in SPECS}


@pytest.mark.parametrize("spec", SPECS)
def test_wide_fused_forward_matches_reference(wide_runs, spec):
    """Every spec at V-block 128 through the role interpreter (every wait, arrival and hand-off
    checked, the one-deep hand-offs included): o and the final state as the reference's. The
    delta rule and the gated specs cut their chain in two; linear attention's chain is the state's
    update alone, so its state role is the chain."""
    op, (o, final), (o_ref, s_ref), emu, _ = wide_runs[spec]
    kernel = emu.programs[-1].kernels.kernels[-1]
    assert emu.calls[-1][0] == f"{spec}_fused" and emu.shapes[-1].BV == 128
    roles = [r.name for r in kernel.warp_roles]
    assert roles == (["state", "output", "loads"] if spec == "linear_attn" else ["state", "value", "output", "loads"])
    assert rel_err(o, o_ref) <= 1e-2 and rel_err(final, s_ref) <= 1e-2


def test_the_wide_kernel_cuts_the_chain_at_the_state():
    """The state role holds S and does only what touches it: its copy for the products, its decay,
    its update by Kᵀ·(decayed v_new); the value role forms v_new from the entering state. Each
    crosses to the other through a one-deep hand-off (a pair of barriers); the entering state goes
    to two roles, so its empty barrier counts both. The load ring stays two deep at 219 KB."""
    prog = qla_compiler.compile_spec("gdn").fused_wide_program
    k = prog.kernels.kernels[-1]
    roles = {r.name: r for r in k.warp_roles}
    assert prog.kernels.block_v_max == 128 and k.threads == 512 and k.max_stages == 2
    assert [st.op for st in roles["state"].body if st.op not in ("wait", "arrive", "fence_async")] == \
        ["copy", "ewise", "gemm"]
    assert [st.srcs for st in roles["value"].body if st.op == "gemm"] == [("k_s", "state_s"), ("T_s", "v_resid_s")]
    bars = {b.name: b for b in k.barriers}
    assert bars["state_s_empty"].arrivals == 256 and bars["state_s_full"].stages == 1
    assert bars["v_new_decayed_s_empty"].arrivals == 128 and bars["loads_empty"].arrivals == 3 * 128
    assert {b.name: (b.owner, b.stages) for b in k.buffers if b.name in ("state_s", "v_new_decayed_s", "v_new_s")} == \
        {"state_s": ("state", 1), "v_new_decayed_s": ("value", 1), "v_new_s": ("value", 1)}
    # the state's registers, then the rest shared: 168 + 3 · 112 ≤ 4 · 128
    assert [r.registers for r in k.warp_roles] == [168, 112, 112, 112]


WIDE_MUTANTS = {
    # the state role updates S from the value role's hand-off before it is written
    "state skips the full wait": ("state", lambda s: s.op == "wait" and s.dst == "v_new_decayed_s_full",
                                  r"reads v_new_decayed_s without waiting on the barrier that hands it over"),
    # the value role overwrites its one-deep hand-off while the state role may still read it
    "value skips the empty wait": ("value", lambda s: s.op == "wait" and s.dst == "v_new_decayed_s_empty",
                                   r"writes v_new_decayed_s without waiting for its readers to be done"),
    # the value role never gives the entering state back: the state role cannot write the next one
    "value never releases the state": ("value", lambda s: s.op == "arrive" and s.dst == "state_s_empty",
                                       r"deadlock: .*waits on state_s_empty"),
}


@pytest.mark.parametrize("mutant", WIDE_MUTANTS)
def test_wide_barrier_mistakes_are_named(wide_runs, mutant):
    op, _, _, emu, scale = wide_runs["gdn"]
    k = emu.programs[-1].kernels.kernels[-1]
    role, pred, message = WIDE_MUTANTS[mutant]
    t = {n: x.clone() for n, x in emu.seen[k.name].items()}
    sizes = Sizes(K=128, V=128, BV=128, HV=2, G=2, C=64, head_logs=op._head_logs(2))
    run_roles(k, {n: x.clone() for n, x in t.items()}, sizes, scale)  # the kernel as scheduled runs
    for order in (None, ("value", "output", "loads", "state"), ("loads", "output", "value", "state")):
        try:
            run_roles(_without(k, role, pred), {n: x.clone() for n, x in t.items()}, sizes, scale, order=order)
        except InterpretError as e:
            assert re.search(message, str(e)), str(e)
            return
    pytest.fail(f"{mutant}: no role order made the interpreter see it")


def test_the_runtime_takes_the_wide_kernel_where_its_grid_fills_the_gpu():
    """wide_fused: 16/64 heads and eight sequences give 512 CTAs at V-block 128 (the wide kernel);
    one sequence gives 64, under 70% of 132 SMs (the narrow kernel at 64); K = 256 never (its state
    would not fit a warpgroup)."""
    assert fwd.wide_fused(128, 128, 64, 8, 132) and not fwd.wide_fused(128, 128, 64, 1, 132)
    assert not fwd.wide_fused(256, 256, 64, 8, 132) and not fwd.wide_fused(128, 64, 64, 8, 132)
    with pytest.raises(PassError, match="does not fit one warpgroup's registers"):
        qla_compiler.compile_spec("gdn").scheduled_for((256, 256)).fused_wide_program
    from qla_compiler.precompile import shape_classes
    with fwd.launch_policy(fused=True):
        got = [(c.fused, c.shape.BV) for c in shape_classes("gdn", H=16, HV=64, K=128, n_seqs=[1, 8], sms=132)
               if c.part == "forward"]
    assert got == [("narrow", 64), ("wide", 128)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
def test_wide_fused_cuda_has_four_register_budgets_and_no_spills(tmp_path):
    """setmaxnreg 168 for the state role, 112 for the others, within the pool of 512 threads at
    ptxas's 128 registers each; no spills."""
    from test_lowering import _ptxas_report, _role_registers

    from qla_compiler.kernels.runtime import lower_to_cuda

    program = qla_compiler.compile_spec("gdn").fused_wide_program
    cuda = lower_to_cuda(program, ShapeClass(H=16, HV=64, K=128, V=128, BV=128))["gdn_fused"]
    budgets = _role_registers(cuda)
    assert sorted(budgets) == [112, 112, 112, 168]
    report = _ptxas_report(cuda, tmp_path)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), spills
    used = int(re.search(r"'gdn_fused_kernel'.*?Used (\d+) registers", report, re.S).group(1))
    assert sum(budgets) * 128 <= 512 * used, (budgets, used)


def test_element_wise_writes_of_shared_blocks_go_through_registers():
    """In both fused kernels no compute role's element-wise statement writes a shared block while
    reading one (schedule_fused._through_fragments): such a loop, reading a ring copy at a runtime
    stage, got a TileLang named barrier between every two elements. The write happens in the
    fragment it reads, then one copy to shared memory; the undecayed v_new the output role reads is
    copied out before the decay changes it."""
    prog = qla_compiler.compile_spec("gdn")
    for kernels in (prog.fused_program.kernels, prog.fused_wide_program.kernels):
        k = kernels.kernels[-1]
        scope = {b.name: b.scope for b in k.buffers}
        for r in k.warp_roles:
            if r.name == "loads":
                continue
            bad = [str(st) for st in r.body if st.op == "ewise" and scope[st.dst] == "shared"
                   and any(scope.get(x) == "shared" for x in st.reads())]
            assert not bad, (r.name, bad)
        body = [str(st) for st in next(r for r in k.warp_roles if r.name in ("chain", "value")).body]
        assert body.index("v_new_s = copy v_new") < body.index("v_new[i,j] = (decay_to_end_s[i] · v_new[i, j])") \
            < body.index("v_new_decayed_s = copy v_new")
