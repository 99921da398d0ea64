"""The backward's scan on roles at V-block 128 (Program.backward_wide_roles_program): a CTA per
(value head, sequence), its d S chain cut into a state role and a value role as the wide fused
forward's is. On the CPU: what the schedule cuts and how much shared memory it takes, a training
step with every kernel emulated against the plain scan and autograd, the barriers and the in-place
buffer checked by the role interpreter, and what ptxas makes of the lowering."""
import dataclasses
import re

import pytest
import torch

import qla_compiler
from qla_compiler.emulate import emulated_step, reference_step
from qla_compiler.ir.kernel_interp import InterpretError
from qla_compiler.kernels import backward as bwd
from qla_compiler.kernels import forward as fwd
from qla_compiler.passes.lower_tilelang import ShapeClass
from qla_compiler.passes.schedule_fused import FUSED_SMEM_BUDGET
from qla_compiler.passes.schedule_memory import smem_bytes
from qla_compiler.testing import random_inputs, rel_err
from test_backward_scan_roles import _replay as replay
from test_fused_forward import _without

# the delta rule's (a value role), and the gate-only ones' (the state role alone)
SPECS = ["gdn", "delta_net", "simple_gla", "retnet", "linear_attn"]  # (every spec whose scan runs it)
LENS = [0, 1, 130, 400]  # a 1-token sequence, partial last chunks, 5 chunks in one sequence
AT = {"C": 64, "K": 128, "V": 128, "BV": 128}


def _scan(program):
    kir = program.backward_wide_roles_program.kernels
    return kir.kernels[kir.scan]


def test_gdn_whole_v_scan_fits_a_cta_with_the_state_updating_on_its_own():
    """At K = V = 128 the chain's rings and hand-offs take 218 KB (225.5 before the value role
    formed d v_new's intra-chunk term instead of loading it: tests/test_scan_products.py), under
    the 226 KB a Hopper CTA leaves beside its static barriers: the stores role stores d v_new as
    the negation of the d WS block it is handed (no buffer of its own), and the state role forms
    d QS = diag(Γ)·d O and its low half itself, in one buffer, ahead of its wait for the value
    role."""
    program = qla_compiler.compile_spec("gdn")
    k = _scan(program)
    assert program.backward_wide_roles_program.kernels.block_v_max == 128
    assert [(r.name, r.registers) for r in k.warp_roles] == [("state", 168), ("value", 112), ("stores", 112),
                                                              ("loads", 112)]
    used = sum(smem_bytes([b], AT) * b.stages for b in k.buffers if b.scope == "shared" and not b.shares)
    assert used == 223232 <= FUSED_SMEM_BUDGET
    assert [p.name for p in k.params if p.role == "out"] == ["d_S_next_chunks", "d_v_new_rows", "final_state"]
    stores = [s for s in k.warp_roles[2].body if s.op == "store"]
    assert [(s.dst, s.srcs, s.attr.get("negate")) for s in stores] == [("d_v_new_rows", ("d_WS_s",), True)]
    buffers = {b.name: b for b in k.buffers}
    assert buffers["d_QS_lo_s"].shares == "d_QS_s" and buffers["d_QS_s"].owner == "state"
    state = [str(s) for s in k.warp_roles[0].body]
    first_wait = next(i for i, s in enumerate(state) if "wait d_WS_s_full" in s)
    assert any("q_sᵀ · d_QS_lo_s" in s for s in state[:first_wait])
    # d S₀ += qᵀ·d QS runs before the low half overwrites d QS in place
    hi = next(i for i, s in enumerate(state) if "q_sᵀ · d_QS_s" in s)
    lo = next(i for i, s in enumerate(state) if s.startswith("d_QS_lo_s"))
    assert hi < lo


def test_its_out_kernel_is_the_plain_programs():
    """The out kernel a call at 16/64 heads runs is the same TileLang either way (session 46's
    first cut carried d WS instead, and its out kernel ran 0.55 ms slower on the H100); the prep
    differs only in what the scan now forms itself (tests/test_scan_products.py)."""
    from qla_compiler.cli import parse_shape
    from qla_compiler.passes.lower_tilelang import lower

    gdn = qla_compiler.compile_spec("gdn")
    plain_shape, wide_shape = (parse_shape(f"H=16,HV=64,K=128,V=128,BV={bv}") for bv in (64, 128))
    plain = gdn.for_shape(plain_shape).backward_program
    wide = gdn.for_shape(wide_shape).backward_wide_roles_program
    assert wide.stage("partition").carried == plain.stage("partition").carried == ("d_S_next", "d_v_new")

    def source(program, shape, name):
        kir = program.kernels
        one = dataclasses.replace(kir, kernels=[k for k in kir.kernels if k.name == name])
        return lower(one, shape).split("@T.prim_func", 1)[1]
    assert source(plain, plain_shape, "gdn_backward_out") == source(wide, wide_shape, "gdn_backward_out")
    assert source(plain, plain_shape, "gdn_backward_prep") != source(wide, wide_shape, "gdn_backward_prep")


@pytest.fixture(scope="module")
def steps():
    """Per spec: the op, its inputs, an emulated training step with the backward's scan on roles
    at V-block 128 and one with the plain scan (exact float64 kernels)."""
    out = {}
    for spec in SPECS:
        op = qla_compiler.compile(spec, target="sm90")
        a = random_inputs(op, T=400, H=1, HV=2, K=128, V=128, cu_seqlens=LENS, initial_state=True,
                          dtype=torch.bfloat16, seed=7)
        with fwd.launch_policy(backward_scan_roles=True, wide=True):
            roles = emulated_step(op, a, block_v=128)
        with fwd.launch_policy(backward_scan_roles=False):
            plain = emulated_step(op, a, block_v=64)
        out[spec] = (op, a, roles, plain)
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_the_wide_scan_computes_what_the_plain_scan_does(steps, spec):
    """Every chunk's d S entering it and d h0 are the plain scan's to the rounding of d v_new's
    intra-chunk term (the plain scan loads it in bf16 as the prep stored it; the whole-V scan forms
    it, and GDN's waits in a bf16 block scaled differently: up to 6e-4, float64 rounding where neither
    scan has it), and every gradient agrees with autograd through the reference."""
    op, a, roles, plain = steps[spec]
    name = f"{spec}_backward_scan_roles"
    assert name in [n for n, _ in roles["emulator"].calls]
    k = _scan(op.program)
    assert k.warp_roles[0].name == "state"
    mine, theirs = roles["emulator"].seen[name], plain["emulator"].seen[f"{spec}_backward_scan"]
    outs = [p.name for p in _scan(op.program).params if p.role == "out"]
    plain_kir = op.program.backward_program.kernels
    assert set(outs) == {p.name for p in plain_kir.kernels[plain_kir.scan].params if p.role == "out"}
    term = "d_v_new.o_intra" in op.program.backward_program.stage("partition").crossing
    for out in outs:  # (d v_new stored as −d WS, where the chain forms d WS)
        assert rel_err(mine[out], theirs[out]) <= (2e-3 if term else 1e-12), (out, rel_err(mine[out], theirs[out]))
    ref = reference_step(op, a, roles)
    for n in op.input_names:  # (bf16 inputs, bf16 tensors between kernels: ~3e-3)
        assert rel_err(roles["grads"][n], ref["grads"][n]) <= 1e-2, n
    assert rel_err(roles["d_h0"], ref["d_h0"]) <= 1e-2


def _replay(op, step: dict, kernel, order=None):
    return replay(op, step, kernel, order, K=128, V=128, BV=128)


def test_any_role_order_the_barriers_allow_gives_the_same_result(steps):
    op, _, roles, _ = steps["gdn"]
    k = _scan(op.program)
    first = _replay(op, roles, k)
    for order in (("value", "stores", "state", "loads"), ("loads", "stores", "value", "state")):
        again = _replay(op, roles, k, order)
        assert all(torch.equal(again[n], first[n]) for n in first), order


MUTANTS = {
    # the state role takes d WS before the value role has written it
    "state reads d WS unwaited": ("state", lambda s: s.op == "wait" and s.dst == "d_WS_s_full",
                                  r"reads d_WS_s without waiting on the barrier that hands it over"),
    # the value role overwrites d WS that the stores role has not stored yet
    "value skips the empty wait": ("value", lambda s: s.op == "wait" and s.dst == "d_WS_s_empty",
                                   r"writes d_WS_s without waiting for its readers to be done"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_barrier_mistakes_are_named(steps, mutant):
    op, _, roles, _ = steps["gdn"]
    role, pred, message = MUTANTS[mutant]
    with pytest.raises(InterpretError, match=message):
        _replay(op, roles, _without(_scan(op.program), role, pred))


def test_the_low_half_formed_before_the_high_half_is_read_is_wrong(steps):
    """The low half of d QS is written in the high half's memory: formed before d S₀ += qᵀ·d QS
    has read the high half (the order before the schedule moved that product ahead), the state
    takes the low half twice."""
    op, _, roles, _ = steps["gdn"]
    k = _scan(op.program)
    body = list(k.warp_roles[0].body)
    hi = next(i for i, s in enumerate(body) if s.op == "gemm" and "d_QS_s" in s.srcs)
    lo = next(i for i, s in enumerate(body) if s.dst == "d_QS_lo_s")
    body[hi], body[lo] = body[lo], body[hi]
    state = dataclasses.replace(k.warp_roles[0], body=tuple(body))
    swapped = dataclasses.replace(k, warp_roles=(state, *k.warp_roles[1:]))
    right, wrong = _replay(op, roles, k), _replay(op, roles, swapped)
    assert rel_err(wrong["final_state"], right["final_state"]) > 1e-3


def test_a_call_runs_it_where_the_policy_and_the_grid_say():
    gdn, kda = (qla_compiler.compile_spec(s) for s in ("gdn", "kda"))
    with fwd.launch_policy(backward_scan_roles=True):
        assert bwd.backward_program_of(gdn, wide=True) is gdn.backward_wide_roles_program
        assert bwd.backward_program_of(gdn) is gdn.backward_roles_program
        # (KDA's chain asks 320 KB at V-block 128: the narrow scan on roles instead)
        assert bwd.backward_program_of(kda, wide=True) is kda.backward_roles_program
    with fwd.launch_policy(backward_scan_roles=False):
        assert bwd.backward_program_of(gdn, wide=True) is gdn.backward_program
    # by default (fwd.BACKWARD_SCAN_ROLES) the wide one alone; the plain scan elsewhere
    assert bwd.backward_program_of(gdn, wide=True) is gdn.backward_wide_roles_program
    assert bwd.backward_program_of(gdn) is gdn.backward_program
    assert bwd.backward_program_of(kda, wide=True) is kda.backward_program
    assert fwd.runs_wide(128, 128, 64, 8, 132, None) and not fwd.runs_wide(128, 128, 8, 1, 132, None)


def test_precompile_compiles_the_wide_scan_where_a_call_runs_it():
    from qla_compiler.precompile import shape_classes

    with fwd.launch_policy(backward_scan_roles=True):
        many = shape_classes("gdn", H=16, HV=64, K=128, n_seqs=8, context_parallel=1, sms=132, training=True)
        one = shape_classes("gdn", H=2, HV=8, K=128, n_seqs=1, context_parallel=1, sms=132, training=True)
    back = [c for c in many if c.part == "backward"]
    assert [(c.fused, c.shape.BV) for c in back] == [("wide", 128)]
    assert [(c.fused, c.shape.BV) for c in one if c.part == "backward"] == [("", 16)]  # (8 CTAs a V-block)
    # by default ("wide") the same classes: "" is the plain scan there
    assert shape_classes("gdn", H=16, HV=64, K=128, n_seqs=8, context_parallel=1, sms=132, training=True) == many
    with fwd.launch_policy(backward_scan_roles=False):
        plain = shape_classes("gdn", H=16, HV=64, K=128, n_seqs=8, context_parallel=1, sms=132, training=True)
    assert [c.fused for c in plain if c.part == "backward"] == [""]


def test_the_cuda_has_four_register_budgets_and_no_spills(tmp_path, capsys):
    from test_lowering import _ptxas_report, _role_registers

    from qla_compiler.cli import main
    from qla_compiler.kernels.runtime import lower_to_cuda

    assert main(["gdn", "--emit", "kernel", "--backward", "--fused", "--shape", "H=2,HV=8,K=128,V=128,BV=128"]) == 0
    assert "role value: threads [128, 256), 112 registers" in capsys.readouterr().out
    program = qla_compiler.compile_spec("gdn").backward_wide_roles_program
    cuda = lower_to_cuda(program, ShapeClass(H=2, HV=8, K=128, V=128, BV=128))["gdn_backward_scan_roles"]
    assert _role_registers(cuda) == [168, 112, 112, 112]
    assert "d_QS_lo_s" in cuda and "tma_load(" in cuda and "d_v_new_rows" in cuda
    report = _ptxas_report(cuda, tmp_path)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), spills
