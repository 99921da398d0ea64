"""The rewrite passes: each proves its identity, keeps the program exact after every pass, keeps it
finite under strong decay, and the exponent verifier refuses the algebraically-equal D·X·D⁻¹ form.

Sizes are small (K = V = 8, at most two chunks and a few tokens) so the whole file runs in seconds.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import networkx as nx
import pytest
import sympy as sp
import torch

import qla_compiler
from conftest import KERNEL_SPECS, SPECS
from qla_compiler.cli import main
from qla_compiler.errors import PassError
from qla_compiler.ir.chunk import ChunkIR
from qla_compiler.ir.chunk_interp import run_chunks
from qla_compiler.op import CompiledOp
from qla_compiler.passes import pipeline
from qla_compiler.passes.pipeline import Program, pass_names
from qla_compiler.passes.rewrite import Rewrite, lower_tri, strict_lower
from qla_compiler.passes.rewrite_exp2 import EXP2
from qla_compiler.passes.rewrite_scale_after_product import SCALE_AFTER_PRODUCT_ON_CHAIN
from qla_compiler.passes.rewrite_scale_on_left import SCALE_ON_LEFT_COLUMNS
from qla_compiler.passes.rewrites import CHUNK_PASSES, REWRITES
from qla_compiler.passes.verify_exponents import verify_exponents
from qla_compiler.testing import random_inputs, rel_err
from qla_compiler.ir.chunk_ops import EXPONENTIALS

ROOT = Path(__file__).resolve().parent.parent
GDN = str(ROOT / "specs" / "gdn.py")
C = 64
TOL = 1e-10


@pytest.fixture(scope="module")
def progs():
    return {name: qla_compiler.compile_spec(name, target="sm90", chunk_size=C) for name in SPECS}


def chunk_stages(prog):
    return [(name, ir) for name, ir in prog.stages if isinstance(ir, ChunkIR)]


def chunk_pass_names():
    """The passes that produce a ChunkIR: `chunk`, then the rewrites (later passes lower it further)."""
    return ["chunk"] + [p.name for p in pipeline.CHUNK_PASSES]


def op_for(prog, ir: ChunkIR) -> CompiledOp:
    """An op that runs one stage's chunk program (as qla_compiler/check_mode.py does)."""
    return CompiledOp(Program(prog.path, "cpu", ir.chunk_size, prog.recurrence, ir))


def to_float64(args: dict) -> dict:
    return {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in args.items()}


# ---- the proofs ---------------------------------------------------------------------------------

PROVED = [r for r in REWRITES + [SCALE_AFTER_PRODUCT_ON_CHAIN, SCALE_ON_LEFT_COLUMNS] if r.proof is not None]


def test_the_rewrites_with_proofs_are_the_algebraic_ones():
    names = {r.name for r in PROVED}
    assert {"fold_constant_gates", "gate_out_of_inverse", "fold_wy", "factor_scalar", "exp2",
            "decay_value_side", "scale_after_product"} <= names
    names = pass_names()
    assert names[:3] == ["frontend", "classify", "chunk"]
    assert names[3:3 + len(CHUNK_PASSES)] == [p.name for p in CHUNK_PASSES]


@pytest.mark.parametrize("rewrite", PROVED, ids=lambda r: r.name)
def test_rewrite_proves_its_identity(rewrite):
    lhs, rhs = rewrite.proof()
    assert isinstance(lhs, (sp.Basic, sp.MatrixBase)) and isinstance(rhs, (sp.Basic, sp.MatrixBase))
    assert rewrite.proves() is True


def _wrong_gate_inverse():
    # D⁻¹ X D instead of D X D⁻¹: the ratio mask with i and j swapped
    C_, g = 3, sp.symbols("gamma0:3", real=True)
    X = sp.Matrix(C_, C_, lambda i, j: sp.Symbol(f"x{i}{j}"))
    R = lower_tri(C_, lambda i, j: sp.exp(g[i] - g[j]))
    R_swapped = lower_tri(C_, lambda i, j: sp.exp(g[j] - g[i]))
    return (sp.eye(C_) + strict_lower(X.multiply_elementwise(R))).inv(), \
        R_swapped.multiply_elementwise((sp.eye(C_) + strict_lower(X)).inv())


def _wrong_factor_scalar():
    # diag(β) on the wrong side of T: diag(b)·T ≠ T·diag(b)
    b = sp.diag(*sp.symbols("b0:2"))
    T = sp.Matrix(2, 2, sp.symbols("t0:4"))
    G = sp.diag(*sp.symbols("G0:2"))
    V, K = sp.Matrix(2, 2, sp.symbols("v0:4")), sp.Matrix(2, 2, sp.symbols("k0:4"))
    S = sp.Matrix(2, 2, sp.symbols("s0:4"))
    return T * (b * V - (b * G) * K * S), (b * T) * (V - G * K * S)


def _wrong_fold_wy():
    # S₀ applied before T: T·B₁ − (T·B₂)·S ≠ T·B₁ − B₂·(T·S)
    T, B1 = sp.Matrix(2, 2, sp.symbols("t0:4")), sp.Matrix(2, 3, sp.symbols("u0:6"))
    B2, S = sp.Matrix(2, 2, sp.symbols("w0:4")), sp.Matrix(2, 3, sp.symbols("s0:6"))
    return T * B1 - (T * B2) * S, T * B1 - B2 * (T * S)


def _wrong_decay_value_side():
    # the decay on the value side's columns instead of its rows: (DK)ᵀX ≠ Kᵀ(XD)
    d = sp.diag(*sp.symbols("d0:2"))
    K, X = sp.Matrix(2, 2, sp.symbols("k0:4")), sp.Matrix(2, 2, sp.symbols("x0:4"))
    return sp.diag((d * K).T * X, d * K), sp.diag(K.T * (X * d), d * K)


def _wrong_exp2():
    x = sp.Symbol("x", real=True)
    return sp.exp(x), 2 ** (x * sp.log(2))  # multiplied by ln 2 instead of log₂e


@pytest.mark.parametrize("name, wrong", [("gate_out_of_inverse", _wrong_gate_inverse),
                                         ("factor_scalar", _wrong_factor_scalar),
                                         ("fold_wy", _wrong_fold_wy),
                                         ("exp2", _wrong_exp2),
                                         ("decay_value_side", _wrong_decay_value_side)])
def test_a_wrong_identity_is_not_proved(name, wrong):
    """Negative control: the same check on a deliberately wrong identity fails."""
    r = next(r for r in REWRITES if r.name == name)
    bad = dataclasses.replace(r, proof=wrong)
    assert r.proves() is True
    assert not bad.proves()


def test_the_d_x_dinv_factorisation_is_exact_algebra():
    """R ⊙ X = D X D⁻¹ on lower-triangular X: the proof device that the emitted code must not use."""
    C_, g = 4, sp.symbols("gamma0:4", real=True)
    X = lower_tri(C_, lambda i, j: sp.Symbol(f"x{i}{j}"))
    R = lower_tri(C_, lambda i, j: sp.exp(g[i] - g[j]))
    D, Dinv = sp.diag(*[sp.exp(x) for x in g]), sp.diag(*[sp.exp(-x) for x in g])
    assert sp.simplify(R.multiply_elementwise(X) - D * X * Dinv).is_zero_matrix


# ---- every pass keeps the program exact ----------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
def test_every_pass_agrees_with_the_reference(progs, spec):
    prog = progs[spec]
    stages = chunk_stages(prog)
    assert [n for n, _ in stages] == chunk_pass_names()
    # one packed batch: a 1-token sequence, one of 2 chunks + a partial one, and a short partial one;
    # grouped value heads (H = 2 query/key heads, HV = 4 value heads); an initial state
    T = 2 * C + 9
    kw = dict(T=T, H=2, HV=4, K=8, V=8, cu_seqlens=[0, 1, 2 * C + 4, T], initial_state=True, seed=11)
    ref_op = op_for(prog, stages[0][1])
    args = random_inputs(ref_op, **kw)
    o_ref, s_ref = ref_op.reference(**args)
    assert o_ref.shape == (1, T, 4, 8) and s_ref.shape == (3, 4, 8, 8)
    for name, ir in stages:
        o, s = op_for(prog, ir)(**args)
        assert rel_err(o, o_ref) <= TOL, (name, rel_err(o, o_ref))
        assert rel_err(s, s_ref) <= TOL, (name, rel_err(s, s_ref))


@pytest.mark.parametrize("spec", ("gdn", "simple_gla", "retnet"))
def test_strong_decay_in_float32_after_every_pass(progs, spec):
    """g = −16 per token: over a chunk the cumulative decay reaches −1024; e^{−γ} would overflow."""
    prog = progs[spec]
    stages = chunk_stages(prog)
    kw = dict(T=2 * C + 7, H=1, HV=2, K=8, V=8, gate=-16.0, dtype=torch.float32, initial_state=True, seed=2)
    args = random_inputs(op_for(prog, stages[0][1]), **kw)
    assert args["q"].dtype == torch.float32
    o_ref, s_ref = op_for(prog, stages[0][1]).reference(**to_float64(args))
    assert o_ref.norm() > 0 and s_ref.norm() > 0
    for name, ir in stages:
        o, s = op_for(prog, ir)(**args)
        assert o.dtype == torch.float32
        assert torch.isfinite(o).all() and torch.isfinite(s).all(), name
        assert rel_err(o, o_ref) <= 1e-4, (name, rel_err(o, o_ref))
        assert rel_err(s, s_ref) <= 1e-4, (name, rel_err(s, s_ref))


# ---- the D X D⁻¹ form: exact in algebra, wrong in float32, refused by the verifier -----------------

def split_ratio_mask(ir: ChunkIR) -> None:
    """Replace P = QKt ⊙ R by diag(Γ)·tril(QKt)·diag(Γ⁻¹), Γ⁻¹ = exp(−γ) (edits `ir` in place)."""
    P = ir.node("P")
    assert P.op == "mul" and set(P.args) == {"QKt", "R"}
    assert ir.node("Gamma").op == "exp" and ir.node("Gamma").args == ("g_cum",)
    gamma_inv = ir.add("Gamma_inv", "exp", ir.add("neg_g_cum", "neg", "g_cum"))
    masked = ir.add("QKt_masked", "tril", "QKt")
    dxd = ir.add("P'", "scale_rows", "Gamma", ir.add("QKt_D", "scale_cols", masked, gamma_inv))
    ir.replace_uses("P", dxd)


@pytest.fixture(scope="module")
def gdn_dxd(progs):
    prog = progs["gdn"]
    bad = prog.stage("chunk").copy()
    split_ratio_mask(bad)
    bad.remove_dead()
    bad.verify()
    assert "R" in bad.graph and "P" not in bad.graph  # R survives in A, but not in the output term
    return prog, bad


def test_dxd_form_is_the_same_program_in_float64(gdn_dxd):
    prog, bad = gdn_dxd
    op = op_for(prog, bad)
    args = random_inputs(op, T=C + 6, H=1, HV=2, K=8, V=8, cu_seqlens=[0, 1, C + 6], initial_state=True, seed=4)
    o_ref, s_ref = op.reference(**args)
    o, s = op(**args)
    assert rel_err(o, o_ref) <= TOL and rel_err(s, s_ref) <= TOL


def test_dxd_form_overflows_in_float32_with_strong_decay(gdn_dxd):
    prog, bad = gdn_dxd
    args = random_inputs(op_for(prog, bad), T=2 * C + 7, H=1, HV=2, K=8, V=8, gate=-16.0,
                         dtype=torch.float32, initial_state=True, seed=2)
    o_ref, _ = op_for(prog, bad).reference(**to_float64(args))
    o_bad, _ = op_for(prog, bad)(**args)
    assert not torch.isfinite(o_bad).all()  # e^{+16·j} overflows, then 0·inf = NaN
    assert rel_err(o_bad, o_ref) > 1.0
    o_good, _ = op_for(prog, prog.chunk)(**args)  # the emitted program on the same inputs
    assert torch.isfinite(o_good).all() and rel_err(o_good, o_ref) <= 1e-4


def test_verifier_refuses_the_dxd_form_naming_the_exp(gdn_dxd):
    prog, bad = gdn_dxd
    assert verify_exponents(prog.stage("chunk")) is prog.stage("chunk")  # the direct form passes
    with pytest.raises(PassError) as e:
        verify_exponents(bad)
    assert e.value.pass_name == "verify_exponents"
    assert "'Gamma_inv'" in str(e.value) and "exp(neg_g_cum)" in str(e.value)
    assert "'R'" not in str(e.value) and "'Gamma'" not in str(e.value)


def test_pipeline_refuses_a_pass_that_splits_the_ratio_mask(monkeypatch):
    """The pipeline runs verify_exponents after every ChunkIR pass: the bad program never becomes a stage."""
    splitter = Rewrite("split_ratio_mask", "R ⊙ X = D X D⁻¹ (exact, but e^{−γ} overflows)", split_ratio_mask)
    passes = list(CHUNK_PASSES)
    passes.insert(1, splitter)  # right after fold_constant_gates: the names are still the chunk pass's
    monkeypatch.setattr(pipeline, "CHUNK_PASSES", passes)
    seen = []
    with pytest.raises(PassError) as e:
        qla_compiler.compile_spec("gdn", print_after=lambda name, ir: seen.append(name))
    assert "Gamma_inv" in str(e.value) and "overflow" in str(e.value)
    assert e.value.pass_name in ("verify_exponents", "split_ratio_mask")
    assert seen == ["frontend", "classify", "chunk", "fold_constant_gates"]


# ---- what the rewrites produce for GDN -------------------------------------------------------------

def test_gdn_sm90_emits_the_wy_program(capsys):
    assert main([GDN, "--target", "sm90", "--emit", "chunk"]) == 0
    out = capsys.readouterr().out
    assert "T_r:C×C" in out and "v_new:C×V" in out
    assert re.search(r"^\s*W:C×K\s+= matmul T ", out, re.M) and re.search(r"^\s*U:C×V\s+= matmul T ", out, re.M)

    ir = qla_compiler.compile_spec(GDN, target="sm90").chunk
    assert str(ir) == out.rstrip("\n")
    node = ir.node
    # T_r depends on k and β only: no gate, no cumulative gate, no exponential
    assert node("T_r").op == "inv_unit_lower"
    anc = nx.ancestors(ir.graph, "T_r")
    assert {a for a in anc if node(a).op == "input"} == {"k", "beta"}
    assert not {"g", "g_cum"} & anc
    assert not any(node(a).op in EXPONENTIALS | {"cumsum", "masked_diff"} for a in anc)
    # T = T_r ⊙ R with R = exp2 of masked differences of the cumulative gate
    t = node("T")
    assert t.op == "mul" and "T_r" in t.args
    r = node(next(a for a in t.args if a != "T_r"))
    assert r.op in EXPONENTIALS and node(r.args[0]).op == "masked_diff"
    # W = T·diag(βΓ)K and U = T·diag(β)V, both free of the state: v_new = U − W·S0 is one matmul
    w, u = node("W"), node("U")
    assert w.args[0] == u.args[0] == "T"
    assert node(u.args[1]).op == "scale_rows" and node(u.args[1]).args == ("beta", "v")
    assert node(w.args[1]).op == "scale_rows" and node(w.args[1]).args[1] == "k"
    v_new = node("v_new")
    assert v_new.op == "sub" and v_new.args[0] == "U"
    ws = node(v_new.args[1])
    assert ws.op == "matmul" and ws.args[0] == "W" and node(ws.args[1]).op == "state_in"
    # the scan's matmuls: W·S0 and the state update (and the output's Q·S0, P·v_new)
    scan = ir.scan_nodes()
    assert {"W", "U", "T_r", "T"}.isdisjoint(scan) and "v_new" in scan


@pytest.mark.parametrize("spec", ("delta_net", "linear_attn"))
def test_no_gate_means_no_exponentials(progs, spec):
    prog = progs[spec]
    assert prog.stage("chunk").counts()["exponentials"] > 0  # the direct form had them
    ir = prog.chunk
    assert ir.counts()["exponentials"] == 0
    assert not any(n.op in EXPONENTIALS for n in ir.order())
    assert not any(n.op in ("cumsum", "masked_diff") for n in ir.order())


def test_exp2_only_scales_sums_of_gamma():
    """exp2 rewrites exp(γ + c) only when every term of the sum is scaled (c ≠ 0 is not): a regression
    test for a closure that accepted add/sub with a term not derived from γ."""
    ir = ChunkIR("mixed", 4)
    ir.add("g", "input", name="g", kind="gate")
    ir.add("v", "input", name="v", kind="value")
    ir.add("S0", "state_in")
    ir.add("g_cum", "cumsum", "g")
    ir.add("R", "exp", ir.add("g_diff", "masked_diff", "g_cum", mask="lower"))
    off = ir.add("off", "const", value=-0.5, shape=("C",))
    ir.add("E", "exp", ir.add("g_off", "add", "g_cum", off))
    ir.outputs, ir.next_state = {"o": ir.add("o", "scale_rows", "E", ir.add("Rv", "matmul", "R", "v"))}, "S0"
    ir.verify()
    after = EXP2.run(ir)
    after.verify()
    gen = torch.Generator().manual_seed(0)
    blocks = {"g": -torch.rand(1, 1, 1, 4, generator=gen, dtype=torch.float64),
              "v": torch.randn(1, 1, 1, 4, 3, generator=gen, dtype=torch.float64)}
    lens, S0 = torch.full((1, 1), 4), torch.zeros(1, 1, 2, 3, dtype=torch.float64)
    before_o = run_chunks(ir, blocks, lens, {}, {}, S0)[0]
    after_o = run_chunks(after, blocks, lens, {}, {}, S0)[0]
    assert rel_err(after_o, before_o) <= 1e-14
    # the shipped programs still get exp2 everywhere
    gdn = qla_compiler.compile_spec("gdn").chunk
    assert {n.op for n in gdn.order()} & EXPONENTIALS == {"exp2"}


# ---- check mode names the first failing pass -----------------------------------------------------

def _drop_decayed_state(ir):
    """S_next = S_update: forgets Γ_C·S0."""
    ir.replace_uses(ir.next_state, "S_update")


def _zero_o_inter(ir):
    """o_inter · 0: forgets diag(Γ)·Q·S0."""
    zero = ir.add("zero", "const", value=0.0, shape=())
    new = ir.add("o_inter_zero", "mul", zero, "o_inter")
    ir.replace_uses("o_inter", new, exclude={new})


def _const_o_inter(ir):
    """o_inter replaced by a C×V zero block (the interpreter may not even run it)."""
    ir.replace_uses("o_inter", ir.add("zero", "const", value=0.0, shape=("C", "V")))


@pytest.mark.parametrize("broken", [_drop_decayed_state, _zero_o_inter, _const_o_inter],
                         ids=lambda f: f.__name__.strip("_"))
def test_check_mode_names_the_broken_pass(monkeypatch, broken):
    bad = Rewrite(f"broken{broken.__name__}", "a deliberately wrong rewrite", broken)
    passes = list(CHUNK_PASSES)
    passes.insert([p.name for p in passes].index("gate_out_of_inverse") + 1, bad)
    monkeypatch.setattr(pipeline, "CHUNK_PASSES", passes)
    assert bad.name in pass_names()
    # without check mode the wrong chunk program is accepted (it verifies: shapes, exponents)
    qla_compiler.compile_spec("gdn", stop_after=CHUNK_PASSES[-1].name)
    with pytest.raises(PassError) as e:
        qla_compiler.compile_spec("gdn", check=True)
    assert e.value.pass_name == bad.name
    assert f"pass '{bad.name}'" in str(e.value)


@pytest.mark.parametrize("spec", SPECS)
def test_check_mode_passes_for_shipped_specs(spec):
    prog = qla_compiler.compile_spec(spec, check=True)
    kernel_passes = ("partition", "schedule")
    expected = pass_names() if spec in KERNEL_SPECS else [n for n in pass_names() if n not in kernel_passes]
    assert [n for n, _ in prog.stages] == expected


# ---- the CLI ---------------------------------------------------------------------------------------

def test_print_after_all_prints_every_pass(capsys):
    assert main([GDN, "--emit", "chunk", "--print-after-all"]) == 0
    out = capsys.readouterr().out
    headers = re.findall(r"^// ----- after (\S+) -----$", out, re.M)
    assert headers == pass_names()


def test_stop_after_gate_out_of_inverse(capsys):
    assert main([GDN, "--stop-after", "gate_out_of_inverse", "--emit", "chunk"]) == 0
    out = capsys.readouterr().out
    for name in ("T_r", "W", "U"):
        assert re.search(rf"^\s*{name}:", out, re.M), name
    assert re.search(r"^\s*T:C×C\s+= mul T_r R$", out, re.M)


def test_stop_after_unknown_pass(capsys):
    assert main([GDN, "--stop-after", "nosuchpass"]) == 1
    err = capsys.readouterr().err
    assert "nosuchpass" in err
    for name in pass_names():
        assert name in err, name


def test_check_flag(capsys):
    assert main([GDN, "--check"]) == 0
    assert "chunk program (C=64)" in capsys.readouterr().out


def test_decay_value_side_shapes_both_scans_and_the_backward_differentiates_before_it():
    """The decay to the chunk's end scales the V-blocked operand (C×BV per scan CTA) in the forward's
    state update and in the backward's d V_new; the VJP is of the program before the rewrite, where
    the decay's gradient is a row sum over K, and the rewrite then runs on the VJP."""
    prog = qla_compiler.compile_spec("gdn")
    update = next(n for n in prog.chunk.of_op("matmul") if n.attr.get("ta") and n.shape == ("K", "V"))
    keys, values = (prog.chunk.node(a) for a in update.args)
    assert keys.op == "input" and values.op == "scale_rows" and values.args[1] == "v_new"
    assert prog.differentiated is prog.stage("cse") and "k_decayed" in prog.differentiated.graph
    back = prog.backward
    assert "k_decayed" not in back.graph and "d_k_decayed" in back.graph  # the row sum stays over K
    d_v_new = back.node("d_v_new.S_update")
    assert d_v_new.op == "scale_rows" and back.node(d_v_new.args[1]).args == ("k", "d_S_next")
    # the replacement takes the replaced node's place: the rest of the program keeps its order
    assert [n.name for n in back.order()].index("d_v_new.S_update") < [n.name for n in back.order()].index("d_v_new")
    # a spec with a scalar gate takes it too
    gla = qla_compiler.compile_spec("simple_gla").chunk
    assert "v_decayed" in gla.graph and "k_decayed" not in gla.graph


def test_scale_after_product_scales_the_float32_product_off_the_state_chain():
    """The backward's d q = d_QKt·k + diag(Γ)·(scale·dO)·S0ᵀ: the product of dO as loaded, then
    Γ·scale on its float32 result (FLA's order; rounding Γ ⊙ scale·dO to bf16 first put d q at
    1.13–1.16× FLA's error). Products summed into the state (qᵀ·(Γ ⊙ scale·dO) onto d S0) and the
    scan's keep their form; the forward has no such product."""
    prog = qla_compiler.compile_spec("gdn")
    back = prog.backward
    d_q = back.node("d_q.QS")
    assert d_q.op == "scale_rows" and d_q.args[0] == "Gamma"
    scaled = back.node(d_q.args[1])
    assert scaled.op == "mul" and scaled.args[1] == "scale"
    product = back.node(scaled.args[0])
    assert product.op == "matmul" and product.args == ("d_o", "S0") and product.attr.get("tb")
    into_state = back.node("d_S0.QS")  # qᵀ·(Γ ⊙ scale·dO), accumulated on the state's registers
    assert into_state.op == "matmul" and back.node(into_state.args[1]).op == "scale_rows"
    assert str(prog.stage("scale_after_product")) == str(prog.stage("decay_value_side"))  # forward unchanged
    # a scaling of an operand computed in float32 stays: it is rounded for the tensor cores anyway
    assert back.node("d_k.KKt").op == "matmul"


def test_take_place_keeps_the_programs_order():
    """decay_value_side's replacements take the replaced nodes' places (ChunkIR.take_place): the
    shaped VJP lists every node it shares with the plain one in the same order, so no kernel
    statement outside the rewrite moves. A node that still has users cannot be replaced."""
    from qla_compiler.passes.autodiff import derive_backward

    prog = qla_compiler.compile_spec("gdn")
    plain, shaped = derive_backward(prog.differentiated), prog.backward
    assert "d_v_new.S_update_undecayed" in shaped.graph
    common = [n.name for n in plain.order() if n.name in shaped.graph]
    assert common == [n.name for n in shaped.order() if n.name in plain.graph]
    ir = prog.differentiated.copy()
    with pytest.raises(ValueError, match="still has users"):
        ir.take_place("S_update", ["k_decayed"])


def test_a_shaping_rewrite_that_fails_on_the_backward_is_named(monkeypatch):
    """The kernel-shaping rewrites also run on the VJP (Program.backward, through pipeline._SHAPING;
    the forward's runs through CHUNK_PASSES): a failure there names the rewrite, not autodiff."""
    from qla_compiler.errors import PassError

    def crash(ir):
        raise KeyError("no such node")

    broken = dataclasses.replace(pipeline._SHAPING["decay_value_side"], apply=crash)
    monkeypatch.setitem(pipeline._SHAPING, "decay_value_side", broken)
    prog = qla_compiler.compile_spec("gdn")
    with pytest.raises(PassError, match="pass 'decay_value_side': on the backward program: KeyError"):
        prog.backward


def test_for_shape_keeps_the_value_side_decay_only_where_the_v_block_is_narrow():
    """decay_value_side pays where BV < K/2 (its `pays`): the runtime's program for other shape
    classes is the pipeline without it (Program.without), derived once; both forms compute the same
    outputs and gradients."""
    from qla_compiler.passes.lower_tilelang import ShapeClass

    prog = qla_compiler.compile_spec("gdn")
    narrow, wide = (ShapeClass(H=2, HV=8, K=128, V=128, BV=bv) for bv in (32, 64))
    assert prog.for_shape(narrow) is prog
    key_side = prog.for_shape(wide)
    assert key_side is prog.for_shape(wide) is prog.without("decay_value_side")
    assert key_side.for_shape(wide) is key_side  # nothing left to take out
    assert [n for n, _ in key_side.stages] == [n for n in pass_names() if n != "decay_value_side"]
    assert "k_decayed" in key_side.chunk.graph and "v_new_decayed" not in key_side.chunk.graph
    assert "k_decayed" in key_side.backward_program.chunk.graph
    assert "d_v_new.S_update_undecayed" not in key_side.backward.graph
    assert str(key_side.differentiated) == str(prog.differentiated)  # one VJP for both forms
    assert prog.for_shape(ShapeClass(H=1, HV=2, K=64, V=64, BV=32)) is key_side  # 32 is half of 64
    with pytest.raises(ValueError, match="'cse' is not a kernel-shaping rewrite"):
        prog.without("cse")

    op, op_key = CompiledOp(prog), CompiledOp(key_side)
    args = random_inputs(op, T=150, H=1, HV=2, K=16, V=16, cu_seqlens=[0, 1, 70, 150], initial_state=True,
                         dtype=torch.float64, seed=7)
    o, s = op(**args)
    o_k, s_k = op_key(**args)
    assert rel_err(o_k, o) <= 1e-12 and rel_err(s_k, s) <= 1e-12


def test_emit_kernel_shows_the_form_the_shape_class_runs(capsys):
    assert main(["gdn", "--emit", "kernel", "--shape", "H=2,HV=8,K=128,V=128,BV=16"]) == 0
    narrow = capsys.readouterr().out
    assert main(["gdn", "--emit", "kernel", "--shape", "H=2,HV=8,K=128,V=128,BV=64"]) == 0
    wide = capsys.readouterr().out
    assert "v_new_decayed_s" in narrow and "k_decayed_s" not in narrow
    assert "k_decayed_s" in wide and "v_new_decayed_s" not in wide


def test_a_crash_scheduling_the_backward_names_the_pass(monkeypatch):
    """The training and backward programs go through partition and schedule like the forward: a
    crash there names the pass and the program."""
    real = pipeline.schedule

    def schedule(part, **options):
        if part.chunk.reverse:
            raise IndexError("no such statement")
        return real(part, **options)

    monkeypatch.setattr(pipeline, "schedule", schedule)
    prog = qla_compiler.compile_spec("gdn")
    assert prog.training_program.kernels is not None
    with pytest.raises(PassError, match="pass 'schedule': backward program: IndexError: no such statement"):
        prog.backward_program
