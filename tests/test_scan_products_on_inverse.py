"""The backward's whole-V scan forming W = (T_r ⊙ R)·diag(βΓ)K itself (partition's kept_inverse,
off by default: QLA_SCAN_PRODUCTS_ON_INVERSE=1 turns it on), so the backward's prep kernel, which
formed W alone, goes away: the scan loads T_r (C×C) where it loaded W (C×K). W's scaling sits on T's
columns (scale_on_left_columns), so K reaches the tensor cores as loaded; the value role forms W
ahead of the entering state and hands it to the state role, whose registers hold the state.
A child process with the switch on (it is read at import): what the partition and the schedule
cut, a training step with every kernel emulated against autograd through the float64 reference,
and what ptxas makes of the scan."""
import re
import shutil

import pytest

import qla_compiler
from qla_compiler.passes.partition import partition
from qla_compiler.passes.rewrite_scale_on_left import SCALE_ON_LEFT_COLUMNS
from child_process import last_json, run_child

CHILD = r"""
import json, sys, torch
import qla_compiler
from qla_compiler.emulate import emulated_step, reference_step
from qla_compiler.kernels import forward as fwd
from qla_compiler.kernels.runtime import lower_to_cuda
from qla_compiler.passes.lower_tilelang import ShapeClass
from qla_compiler.passes.schedule_fused import FUSED_SMEM_BUDGET
from qla_compiler.passes.schedule_memory import smem_bytes
from qla_compiler.testing import random_inputs, rel_err

from qla_compiler.passes import pipeline


def gradient_errors(op, a):
    errs = {}
    # GDN's gates as drawn and 8× stronger (Γ to ~e^-60 across a chunk, where W is ~0)
    for gates, x in ((("drawn", 1), ("strong", 8)) if "g" in a else (("none", 1),)):
        b = {**a, "g": a["g"] * x} if "g" in a else a
        with fwd.launch_policy(backward_scan_roles=True, wide=True):
            step = emulated_step(op, b, block_v=128)
        ref = reference_step(op, b, step)
        errs.update({f"{n} ({gates})": rel_err(step["grads"][n], ref["grads"][n]) for n in op.input_names})
        errs[f"initial_state ({gates})"] = rel_err(step["d_h0"], ref["d_h0"])
    return errs, step


out = {}
for spec in ("gdn", "delta_net"):
    pipeline.SCAN_PRODUCTS_ON_INVERSE = False  # the prep's W, on the same inputs (a fresh op derives anew)
    a = random_inputs(qla_compiler.compile(spec, target="sm90"), T=400, H=1, HV=2, K=128, V=128,
                      cu_seqlens=[0, 1, 130, 400], initial_state=True, dtype=torch.bfloat16, seed=7)
    before, _ = gradient_errors(qla_compiler.compile(spec, target="sm90"), a)
    pipeline.SCAN_PRODUCTS_ON_INVERSE = True
    op = qla_compiler.compile(spec, target="sm90")
    wide = op.program.backward_wide_roles_program
    part = wide.stage("partition")
    scan = wide.kernels.kernels[0]
    roles = {r.name: [str(s) for s in r.body] for r in scan.warp_roles}
    at = {"C": 64, "K": 128, "V": 128, "BV": 128}
    shared = sum(smem_bytes([b], at) * b.stages for b in scan.buffers if b.scope == "shared" and not b.shares)
    errs, step = gradient_errors(op, a)
    out[spec] = dict(kernels=[k.name for k in wide.kernels.kernels], crossing=part.crossing, scan=part.scan,
                     provided=part.provided, scan_inputs=[p.name for p in scan.params if p.role == "in"],
                     roles=roles, shared=shared, budget=FUSED_SMEM_BUDGET, errs=errs, before=before,
                     calls=[n for n, _ in step["emulator"].calls], history=list(part.chunk.history),
                     buffers={b.name: [b.scope, b.dtype, b.owner, b.shares] for b in scan.buffers})
cuda = lower_to_cuda(qla_compiler.compile_spec("gdn").backward_wide_roles_program,
                     ShapeClass(H=2, HV=8, K=128, V=128, BV=128))["gdn_backward_scan_roles"]
open(sys.argv[1], "w").write(cuda)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    cu = tmp_path_factory.mktemp("inverse_products") / "scan.cu"
    out = run_child(CHILD, cu, env={"QLA_SCAN_PRODUCTS": "1", "QLA_SCAN_PRODUCTS_ON_INVERSE": "1"}, timeout=1500)
    return last_json(out), cu


def test_off_by_default_the_prep_forms_w():
    wide = qla_compiler.compile_spec("gdn").backward_wide_roles_program
    assert [k.name for k in wide.kernels.kernels][0] == "gdn_backward_prep"
    assert wide.stage("partition").crossing == ("W",)


@pytest.mark.parametrize("spec", ["gdn", "delta_net"])
def test_the_scan_forms_w_and_no_prep_runs(child, spec):
    """Two kernels, the scan loading T_r (and β) instead of W; v_new still comes from the forward's
    memory (the rewrite changed W's form, not the value the forward stored)."""
    got = child[0][spec]
    inverse = "T_r" if spec == "gdn" else "T"  # (DeltaNet has no gate to take out of it)
    assert got["kernels"] == [f"{spec}_backward_scan_roles", f"{spec}_backward_out"]
    assert got["crossing"] == [] and "scale_on_left_columns" in got["history"]
    assert {"v_new", inverse} <= set(got["provided"])
    assert {f"{inverse}_rows", "beta", "k"} <= set(got["scan_inputs"]) and "W_rows" not in got["scan_inputs"]
    assert {"W", inverse} <= set(got["scan"])
    assert f"{spec}_backward_prep" not in got["calls"] and got["calls"][-2:] == [f"{spec}_backward_scan_roles",
                                                                                  f"{spec}_backward_out"]


@pytest.mark.parametrize("spec", ["gdn", "delta_net"])
def test_the_value_role_forms_w_and_hands_it_over(child, spec):
    """The value role: T's pass with βΓ on its columns, W = T·K on the loaded K, W's copy to
    shared memory and its publication, all before it waits for the entering state, and Q Kᵀ only
    after W's registers are free (_products_when_read). The state role waits for W last, right
    before the one product that reads it. Within the CTA's shared memory: P in the scaled T's
    memory, no scaled copy of K."""
    got = child[0][spec]
    value, state = got["roles"]["value"], got["roles"]["state"]
    w = next(i for i, s in enumerate(value) if re.match(r"W = \w+ · k_s +\(wgmma\)", s))
    scaled = value[w].split()[2]  # T with βΓ (DeltaNet: β) on its columns
    mask = next(i for i, s in enumerate(value) if s.startswith(f"{scaled}[i,j] = "))
    assert ("s_Gamma_s[j]" if spec == "gdn" else "beta_s[j]") in value[mask]
    copy = value.index("W_s = copy W")
    assert mask < w < copy < value.index("arrive W_s_full") < value.index("wait state_s_full")
    qk = next(i for i, s in enumerate(value) if s.startswith("QKt = q_s · k_sᵀ"))
    assert copy < qk
    assert state.index("wait W_s_full") == next(i for i, s in enumerate(state) if "W_sᵀ" in s) - 2
    assert got["buffers"]["W_s"][:3] == ["shared", "io", "value"] and "sGk_s" not in got["buffers"]
    assert got["buffers"]["W"][0] == "fragment" and got["buffers"]["W"][2] == "value"
    assert got["shared"] <= got["budget"]


@pytest.mark.parametrize("spec", ["gdn", "delta_net"])
def test_the_gradients_meet_the_reference(child, spec):
    """bf16 inputs and tensors between kernels, GDN's gates as drawn and strong, a 1-token sequence
    and partial chunks: every gradient within 1e-2 of autograd through the float64 reference, and
    within 1.1× of the error with the prep's W on the same inputs (W scaled on T's rows instead of
    its columns fails that: GDN's d β 1.7e-3 → 5.5e-3, DeltaNet's 2.3e-3 → 9e-2)."""
    got = child[0][spec]
    errs, before = got["errs"], got["before"]
    assert all(e <= 1e-2 for e in errs.values()), errs
    assert all(errs[n] <= 1.1 * before[n] + 1e-6 for n in errs), (errs, before)


@pytest.mark.skipif(shutil.which("nvcc") is None,
                    reason="needs nvcc (CI has it)")
def test_the_scan_compiles_without_spills(child, tmp_path):
    from test_lowering import _roles_compile_without_spills

    _roles_compile_without_spills(child[1].read_text(), tmp_path, [168, 112, 112, 112])


def test_the_rewrite_moves_only_a_scaling_of_an_input_onto_a_block():
    """On GDN's backward the two products of T with a row-scaled input, W = T·(diag(βΓ)K) and
    U = T·(diag(β)V), take the form (T·diag(·))·X (U is the forward's, recomputed by no kernel: v_new
    is loaded); no other product changes. The partition with kept_inverse then leaves nothing to a
    prep, and without it W stays there."""
    gdn = qla_compiler.compile_spec("gdn")
    back = gdn.backward_wide_roles_program.stage("partition")
    shaped = SCALE_ON_LEFT_COLUMNS.run(back.chunk)
    assert [n.name for n in shaped.order() if n.name not in back.chunk.graph] == ["T_s_Gamma", "T_beta"]
    assert [m.name for m in shaped.of_op("matmul") if m != back.chunk.node(m.name)] == ["W", "U"]
    assert (shaped.node("W").args, shaped.node("U").args) == (("T_s_Gamma", "k"), ("T_beta", "v"))
    assert (shaped.node("T_s_Gamma").op, shaped.node("T_s_Gamma").args) == ("scale_cols", ("T", "s_Gamma"))
    assert partition(shaped, provided=back.provided, scan_products=True, kept_inverse=True).crossing == ()
    assert partition(shaped, provided=back.provided, scan_products=True).crossing == ("W",)


def _stmt(op, dst, *srcs, **attrs):
    from qla_compiler.ir.kernel import Stmt

    return Stmt(op, dst, srcs, tuple(attrs.items()))


def test_a_hand_off_is_copied_out_as_soon_as_its_fragment_is_made():
    """schedule_fused._handed_on_when_made: the copy of W into its hand-off block moves up to right
    after W's product, past work that touches neither; a copy whose block something in between
    reads stays where it is."""
    from qla_compiler.passes.schedule_fused import _handed_on_when_made

    scope = {"W": "fragment", "A": "fragment", "W_s": "shared", "x_s": "shared", "k_s": "shared"}
    body = [_stmt("gemm", "W", "x_s", "k_s"), _stmt("gemm", "A", "x_s", "k_s"), _stmt("copy", "x_s", "A"),
            _stmt("copy", "W_s", "W")]
    moved = _handed_on_when_made(body, {"W_s"}, scope)
    assert [s.dst for s in moved] == ["W", "W_s", "A", "x_s"]
    blocked = body[:2] + [_stmt("copy", "x_s", "W_s")] + body[3:]
    assert _handed_on_when_made(blocked, {"W_s"}, scope) == blocked
    assert _handed_on_when_made(body, set(), scope) == body  # (not a hand-off: left alone)


def test_a_product_is_issued_right_before_its_first_reader():
    """schedule_fused._products_when_read: Q Kᵀ moves down past W's product and copy to its mask;
    not past a statement that writes one of its operands, and an accumulation stays put."""
    from qla_compiler.passes.schedule_fused import _products_when_read

    scope = {"QKt": "fragment", "W": "fragment", "W_s": "shared", "q_s": "shared", "k_s": "shared",
             "T_s": "shared", "P_s": "shared"}
    body = [_stmt("gemm", "QKt", "q_s", "k_s"), _stmt("gemm", "W", "T_s", "k_s"), _stmt("copy", "W_s", "W"),
            _stmt("copy", "P_s", "QKt")]
    assert [s.dst for s in _products_when_read(body, scope)] == ["W", "W_s", "QKt", "P_s"]
    overwrites = [body[0], _stmt("copy", "q_s", "W")] + body[1:]
    assert _products_when_read(overwrites, scope)[0] == body[0]
    summed = [_stmt("gemm", "QKt", "q_s", "k_s", accumulate=True)] + body[1:]
    assert _products_when_read(summed, scope) == summed
