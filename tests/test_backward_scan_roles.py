"""The backward's scan warp-specialised (schedule_fused.scan_with_roles, Program.backward_roles_program)
on the CPU: a training step through the GPU path's host code with every kernel emulated, its scan
run by the role interpreter (ir/kernel_interp_roles.py) walking the chunks last to first, against
the plain scan kernel and autograd through the float64 reference; the interpreter's checks of its
barriers; what the lowering emits."""
import dataclasses
import re
import shutil
import traceback

import pytest
import torch

import qla_compiler
from qla_compiler.emulate import emulated_step, reference_step
from qla_compiler.errors import NotFusable
from qla_compiler.ir.kernel_interp import InterpretError, Sizes
from qla_compiler.ir.kernel_interp_roles import run_roles
from qla_compiler.kernels import backward as bwd
from qla_compiler.kernels import forward as fwd
from qla_compiler.passes.lower_tilelang import ShapeClass
from qla_compiler.testing import random_inputs, rel_err
from test_fused_forward import _without

SPECS = ["gdn", "delta_net", "simple_gla", "retnet", "linear_attn", "kda"]
# a 1-token sequence, partial last chunks, and 5 chunks in one sequence: the 3-deep load ring wraps
LENS = [0, 1, 130, 400]
SCAN_OUTPUTS = ("d_S_next_chunks", "final_state")


@pytest.fixture(scope="module")
def steps():
    """Per spec: the op, its inputs, and an emulated training step with the backward's scan on
    roles and one with the plain scan kernel (exact float64 kernels)."""
    out = {}
    for spec in SPECS:
        op = qla_compiler.compile(spec, target="sm90")
        a = random_inputs(op, T=400, H=1, HV=2, K=64, V=64, cu_seqlens=LENS, initial_state=True,
                          dtype=torch.bfloat16, seed=5)
        with fwd.launch_policy(backward_scan_roles=True):
            roles = emulated_step(op, a)
        with fwd.launch_policy(backward_scan_roles=False):
            plain = emulated_step(op, a)
        out[spec] = (op, a, roles, plain)
    return out


def _scans(spec):
    return f"{spec}_backward_scan_roles", f"{spec}_backward_scan"


@pytest.mark.parametrize("spec", SPECS)
def test_the_scan_with_roles_computes_what_the_plain_scan_does(steps, spec):
    """Same inputs, same kernels around it: the warp-specialised scan's stores (every chunk's d S
    entering it, in its chunk slot; the carried per-token values) and d h0 are the plain scan's
    to float64 rounding, and every gradient agrees with autograd through the reference."""
    op, a, roles, plain = steps[spec]
    with_roles, without = _scans(spec)
    called = [n for n, _ in roles["emulator"].calls]
    assert with_roles in called and without not in called
    assert without in [n for n, _ in plain["emulator"].calls]
    mine, theirs = roles["emulator"].seen[with_roles], plain["emulator"].seen[without]
    outs = [p.name for p in op.program.backward_roles_program.kernels.kernels[op.program.backward_roles_program.kernels.scan].params
            if p.role == "out"]
    assert set(SCAN_OUTPUTS) <= set(outs)
    for name in outs:
        assert rel_err(mine[name], theirs[name]) <= 1e-12, name
    ref = reference_step(op, a, roles)
    for name in op.input_names:  # (bf16 inputs, bf16 tensors between kernels: ~3e-3)
        assert rel_err(roles["grads"][name], ref["grads"][name]) <= 1e-2, name
    assert rel_err(roles["d_h0"], ref["d_h0"]) <= 1e-2


def _kernel(op):
    kir = op.program.backward_roles_program.kernels
    return kir.kernels[kir.scan]


def _replay(op, step: dict, kernel, order=None, K=64, V=64, BV=32):
    """Run `kernel` (the scan with roles, or a mutant) on the tensors its launch in `step` was given
    (at head dims K, V and V-block BV)."""
    seen = step["emulator"].seen[f"{op.program.recurrence.name}_backward_scan_roles"]
    t = {n: x.clone() for n, x in seen.items()}
    outs = {p.name for p in kernel.params if p.role == "out"}
    for n in outs:
        t[n].zero_()
    sizes = Sizes(K=K, V=V, BV=BV, HV=2, G=2, C=64, head_logs=op._head_logs(2))
    run_roles(kernel, t, sizes, step["scale"], order=order)
    return {n: t[n] for n in outs}


def test_any_role_order_the_barriers_allow_gives_the_same_result(steps):
    op, _, roles, _ = steps["gdn"]
    k = _kernel(op)
    assert [r.name for r in k.warp_roles] == ["chain", "stores", "loads"] and k.reverse
    seen = roles["emulator"].seen[k.name]
    first = _replay(op, roles, k)
    assert all(torch.equal(first[n], seen[n]) for n in first)
    for order in (("stores", "chain", "loads"), ("loads", "chain", "stores"), ("loads", "stores", "chain")):
        again = _replay(op, roles, k, order)
        assert all(torch.equal(again[n], first[n]) for n in first), order


MUTANTS = {
    # the stores role stores the chain's copy of d S before the chain has written it
    "stores read unwaited": ("stores", lambda s: s.op == "wait" and s.dst == "state_s_full",
                             r"reads state_s without waiting on the barrier that hands it over"),
    # the chain overwrites a copy of d S the stores role has not stored yet
    "chain skips the empty wait": ("chain", lambda s: s.op == "wait" and s.dst == "state_s_empty",
                                   r"writes state_s without waiting for its readers to be done"),
    # the chain reads the loads' ring before the loads role has published it
    "chain reads loads unwaited": ("chain", lambda s: s.op == "wait" and s.dst == "loads_full",
                                   r"without waiting on the barrier that hands it over"),
    # the stores role never hands a copy of the carried values back: the chain waits forever
    "stores never release": ("stores", lambda s: s.op == "arrive" and s.dst.endswith("_empty"),
                             r"deadlock: .*waits on \w+_empty"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_barrier_mistakes_are_named(steps, mutant):
    op, _, roles, _ = steps["gdn"]
    k = _kernel(op)
    role, pred, message = MUTANTS[mutant]
    with pytest.raises(InterpretError, match=message):
        _replay(op, roles, _without(k, role, pred))


def test_a_forward_walk_of_the_reverse_scan_is_wrong():
    """The interpreter walks a reverse kernel's chunks last to first: the same kernel marked as a
    forward walk carries d S the wrong way, and its stores differ (what a lowering that lost
    `reverse` would compute)."""
    op = qla_compiler.compile("gdn", target="sm90")
    a = random_inputs(op, T=300, H=1, HV=2, K=64, V=64, cu_seqlens=[0, 300], initial_state=True,
                      dtype=torch.bfloat16, seed=6)
    with fwd.launch_policy(backward_scan_roles=True):
        step = emulated_step(op, a)
    k = _kernel(op)
    right = _replay(op, step, k)
    wrong = _replay(op, step, dataclasses.replace(k, reverse=False))
    assert torch.equal(right["final_state"], step["emulator"].seen[k.name]["final_state"])
    assert rel_err(wrong["final_state"], right["final_state"]) > 1e-2


def test_the_policy_picks_the_scan_with_roles_where_it_can():
    """Off by default at the narrow V-block (no faster than the plain scan on the H100, and it takes
    no input's memory; by default only the whole-V one runs, test_backward_wide_scan.py); on,
    every call but a context-parallel one (its window walks are the plain scan's) and GLA's (its
    entering states are kept in float32, which the roles do not hand on) runs it."""
    gdn, gla = (qla_compiler.compile_spec(s) for s in ("gdn", "gla"))
    assert not fwd.POLICY.backward_scan_roles
    assert bwd.backward_program_of(gdn) is gdn.backward_program
    with fwd.launch_policy(backward_scan_roles=True):
        assert bwd.backward_program_of(gdn) is gdn.backward_roles_program
        assert bwd.backward_program_of(gdn, segments=4) is gdn.backward_program
        assert bwd.backward_program_of(gla) is gla.backward_program
        for _ in range(20):  # (every backward asks: the kept refusal must not grow a traceback a call)
            bwd.backward_program_of(gla)
    with pytest.raises(NotFusable) as refused:
        gla.backward_roles_program
    assert len(traceback.extract_tb(refused.value.__traceback__)) < 8
    names = [k.name for k in gdn.backward_roles_program.kernels.kernels]
    assert names == ["gdn_backward_prep", "gdn_backward_scan_roles", "gdn_backward_out"]


def test_the_kernel_prints_its_roles_and_walks_last_to_first(capsys):
    from qla_compiler.cli import main

    assert main(["gdn", "--emit", "kernel", "--backward", "--fused"]) == 0
    text = capsys.readouterr().out
    for line in ("kernel gdn_backward_scan_roles", "role chain: threads [0, 128)", "role stores: threads [128, 256)",
                 "role loads: threads [256, 384), 112", "for chunk in chunks of the sequence, last to first, every role",
                 "d_S_next_chunks = store_chunk_state state_s", "barrier  state_s_full[2]"):
        assert line in text, line


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
def test_the_cuda_has_three_register_budgets_a_reverse_loop_and_no_spills(tmp_path):
    from test_lowering import _ptxas_report, _role_registers

    from qla_compiler.kernels.runtime import lower_to_cuda

    program = qla_compiler.compile_spec("gdn").backward_roles_program
    assert program.kernels.block_v_max == 32  # (at 64 the load ring is two deep: too shallow)
    cuda = lower_to_cuda(program, ShapeClass(H=2, HV=8, K=128, V=128, BV=32))["gdn_backward_scan_roles"]
    budgets = _role_registers(cuda)
    assert len(budgets) == 3 and "warpgroup_reg_dealloc<112>" in cuda
    assert "for (int i_r = 0; i_r < ((seq_len + 63) >> 6); ++i_r)" in cuda and "tma_load(" in cuda
    report = _ptxas_report(cuda, tmp_path)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), spills
    used = int(re.search(r"'gdn_backward_scan_roles_kernel'.*?Used (\d+) registers", report, re.S).group(1))
    assert sum(budgets) * 128 <= 384 * used, (budgets, used)
