"""Per-key gates (issue 18): GLA and KDA from their specs, on the CPU backend.

Every number is a relative error ‖out − ref‖ / ‖ref‖ against the spec's own recurrence run token by
token in float64 (the reference builds Diag(e^{g_t}) as a matrix); gradients against autograd
through that reference. Tolerances: 1e-10 (forward) and 1e-8 (gradients) in float64, as the issue
asks; in float32, 1e-5 and 1e-4 (measured: ≤ 3e-6 under the worst gates below).
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import sympy as sp
import torch
import torch.nn.functional as F

import qla_compiler
from qla_compiler import SpecError, UnsupportedStructure
from qla_compiler.cli import main
from qla_compiler.emulate import emulated_kernel_step, emulated_kernels, emulated_step, reference_step
from qla_compiler.errors import PassError
from qla_compiler.ir.chunk_interp import run_all_chunks, run_chunks
from qla_compiler.ir.chunk_ops import EXPONENTIALS
from qla_compiler.ir.kernel import Buffer
from qla_compiler.kernels import forward as fwd
from qla_compiler.layout import gather, sequence_bounds, to_chunks
from qla_compiler.ops import chunk_gla, chunk_kda, fused_recurrent_kda
from qla_compiler.passes.rewrite_subchunk import SUBCHUNK
from qla_compiler.passes.schedule_out import out_kernels
from qla_compiler.passes.schedule_memory import SMEM_BUDGET, dim_sizes
from qla_compiler.passes.verify_exponents import NEG, analyse, verify_exponents
from qla_compiler.spec import K, DiagExp
from qla_compiler.testing import input_grads, random_inputs, rel_err

PER_KEY = ("gla", "kda")
FWD_TOL, GRAD_TOL = 1e-10, 1e-8
CU = [0, 1, 65, 66, 130, 131, 200]  # packed: 1-token sequences, a partial chunk, lengths ≠ 64·n


def _gates(args, how: str, seed: int = 0):
    """The worst legal gates, per key: strong decay (γ reaches −320 in a chunk of 64), none, a mix
    of both within each token, and resets (−inf) at one token of every key or of a few keys."""
    g = args["g"]
    gen = torch.Generator().manual_seed(seed)
    if how == "strong":
        g = (-5.0 + 0.5 * torch.randn(g.shape, generator=gen, dtype=torch.float64)).clamp_max(0).to(g)
    elif how == "zero":
        g = torch.zeros_like(g)
    elif how == "mixed":  # keys that forget within a token beside keys that never forget
        g = torch.where(torch.rand(g.shape, generator=gen, dtype=torch.float64) < 0.5, -5.0, 0.0).to(g)
    elif how == "reset":
        g = g.clone()
        g[0, 30] = -float("inf")  # every key of every head, mid-chunk
        g[0, 100, 0, :3] = -float("inf")  # three keys of one head
        g[0, 131] = -float("inf")  # a sequence's first token
    return {**args, "g": g}


def _args(op, how="random", dtype=torch.float64, **kw):
    kw = {"T": 200, "H": 2, "HV": 2, "K": 16, "V": 8, "cu_seqlens": CU, "initial_state": True, "seed": 3,
          "dtype": dtype, **kw}
    args = random_inputs(op, **kw)
    return args if how == "random" else _gates(args, how)


def _finite(*xs):
    return all(bool(torch.isfinite(x).all()) for x in xs)


# ---- the spec language -------------------------------------------------------------------------

HEADER = "from qla_compiler.spec import I, exp, gate, key, recurrence, scalar, state, value\n"
DECLS = "q, k = key('q'), key('k')\nv = value('v')\ng = gate('g', per='key')\nbeta = scalar('beta')\nS = state()\n"


def _spec(tmp_path, step, decls=DECLS, output="S.T * q"):
    p = tmp_path / "per_key_spec.py"
    p.write_text(HEADER + decls + f"recurrence(step={step}, output={output})\n")
    return p


def test_a_per_key_gate_is_a_key_vector_whose_exp_is_a_diagonal(ops):
    for name in PER_KEY:
        rec = ops[name].program.recurrence
        assert rec.input("g").kind == "key_gate"
        diags = {x for x in sp.preorder_traversal(rec.step) if isinstance(x, DiagExp)}
        assert [d.gate.name for d in diags] == ["g"] and diags.pop().shape == (K, K)
        assert rec.structure.decay == "key_gate" and rec.structure.decay_name == "g"
    assert "A_t = (I − beta·k·kᵀ)·Diag(exp(g))" in str(ops["kda"].program.recurrence)
    assert "A_t = Diag(exp(g))" in str(ops["gla"].program.recurrence)


@pytest.mark.parametrize("step, pattern", [
    # the other order: decay after the delta factor, another recurrence
    ("exp(g) * (I - beta * k * k.T) * S + beta * k * v.T", r"applied after the delta factor"),
    # a term of A_t without the diagonal
    ("S + exp(g) * S + k * v.T", r"Diag\(exp\(g\)\) is missing in the term"),
    # a scalar decay on top of the per-key one
    ("exp(h) * exp(g) * S + k * v.T", r"the decay factor exp\(h\)"),
])
def test_unsupported_transitions_say_what_was_found_and_what_is_supported(tmp_path, step, pattern):
    decls = DECLS + "h = gate('h')\n"
    with pytest.raises(UnsupportedStructure, match=pattern) as e:
        qla_compiler.compile(_spec(tmp_path, step, decls))
    assert "Supported: " in str(e.value) and "(I − s·k·kᵀ)·Diag(exp(g))" in str(e.value)


@pytest.mark.parametrize("decls, step, pattern", [
    # exp of a key-shaped input is not elementwise: named, with the spelling that is
    ("q, k = key('q'), key('k')\nv = value('v')\ng = key('g')\nS = state()\n", "exp(g) * S + k * v.T",
     r"exp of the matrix g is not a decay.*gate\('g', per='key'\)"),
    ("q, k = key('q'), key('k')\nv = value('v')\ng = gate('g', per='row')\nS = state()\n", "S + k * v.T",
     r"per must be 'head' or 'key', got 'row'"),
    # sympy's own diagonal: refused with the spelling that works
    ("import sympy\nq, k = key('q'), key('k')\nv = value('v')\ng = gate('g', per='key')\nS = state()\n",
     "sympy.DiagMatrix(g) * S + k * v.T", r"unsupported matrix operation DiagMatrix.*per='key'"),
])
def test_malformed_per_key_specs_name_file_and_line(tmp_path, decls, step, pattern):
    p = _spec(tmp_path, step, decls)
    with pytest.raises(SpecError, match=pattern) as e:
        qla_compiler.compile(p)
    assert str(e.value).startswith(f"{p}:")


# ---- the chunk program and its exponents ---------------------------------------------------------

@pytest.mark.parametrize("name", PER_KEY)
def test_only_differences_of_cumulative_gates_are_exponentiated(ops, name):
    """Forward and backward: every exponential's argument is proved ≤ 0, and is γ (a cumsum of
    gates), a masked per-key difference γ_ik − γ_jk (j ≤ i), a difference from a sub-chunk's
    reference row on the rows on its side (ref_diff), or γ_C − γ: never −γ."""
    prog = ops[name].program
    for ir in (prog.chunk, prog.backward):
        info = analyse(ir)
        exps = [n for n in ir.order() if n.op in EXPONENTIALS]
        for n in exps:
            assert info[n.args[0]][0] == NEG, n.name
            arg = ir.node(n.args[0])
            assert arg.op in ("mul", "masked_diff", "last", "sub", "ref_diff"), n.name
        verify_exponents(ir)
    # Γ, Γ_C, the decay to the chunk's end, R on the diagonal sub-blocks (C×C×K), and the two
    # factors of each of the C/B − 1 references (passes/rewrite_subchunk.py)
    C, B = prog.chunk.chunk_size, SUBCHUNK
    assert len([n for n in prog.chunk.order() if n.op in EXPONENTIALS]) == 4 + 2 * (C // B - 1)
    R = prog.chunk.node("R_diag")
    assert R.shape == ("C", "C", "K") and prog.chunk.node(R.args[0]).attr == {"mask": "lower", "block": B}
    products = prog.chunk.of_op("contract")
    assert [n.attr["eq"] for n in products] == ["ik,jk,ijk->ij"] * (2 if name == "kda" else 1)
    assert all(n.args[2] == "R_diag" for n in products)


@pytest.mark.parametrize("later", [True, False])
def test_a_reference_row_on_the_wrong_side_is_refused(ops, later):
    """ref_diff proves x_i − x_ref ≤ 0 only on rows after ref, x_ref − x_i only on rows up to it."""
    ir = ops["gla"].program.chunk.copy()
    g = ir.node("decay_after_15").args[0]
    g = ir.node(g).args[0]
    lo, hi = (0, 16) if later else (16, 32)  # the other side of row 15
    bad = ir.add("bad", "exp2", ir.add("wrong_side", "ref_diff", g, ref=15, lo=lo, hi=hi, later=later))
    ir.outputs["o"] = ir.add("o_bad", "add", ir.outputs["o"], ir.add("x", "matmul", ir.add("kb", "mul", "k", bad), "S0"))
    with pytest.raises(PassError, match="'bad'"):
        verify_exponents(ir)


def test_the_naive_factorisation_is_refused(ops):
    """(Q ⊙ e^γ)(K ⊙ e^{−γ})ᵀ: e^{−γ} alone is what verify_exponents exists to refuse."""
    ir = ops["gla"].program.chunk.copy()
    g_cum = next(n.name for n in ir.order() if n.op == "mul" and n.shape == ("C", "K") and
                 ir.node(n.args[0]).op == "cumsum")
    inv = ir.add("inv_Gamma", "exp2", ir.add("neg_g", "neg", g_cum))
    ir.outputs["o"] = ir.add("o_bad", "add", ir.outputs["o"],
                             ir.add("x", "matmul", ir.add("kinv", "mul", "k", inv), "S0", ))
    with pytest.raises(PassError, match="inv_Gamma"):
        verify_exponents(ir)


def _all_values(op, args, dtype):
    """Every node of the chunk program for every chunk (the entering states from a first run)."""
    prog = op.program.chunk
    starts, lengths = sequence_bounds(1, args["q"].shape[1], args["cu_seqlens"])
    C = prog.chunk_size
    NC = -(-int(lengths.max()) // C)
    HV = args["v"].shape[2]
    blocks = {n: to_chunks(gather(args[n].to(dtype), starts, lengths, NC * C), C) for n in op.input_names}
    chunk_lengths = (lengths[:, None] - C * torch.arange(NC)).clamp(0, C)
    h0 = args["initial_state"].to(dtype)
    params = {"scale": args["q"].shape[-1] ** -0.5}
    _, _, states = run_chunks(prog, blocks, chunk_lengths, params, {}, h0, save_states=True)
    every = prog.copy()
    every.outputs = {n: n for n in prog.graph}
    assert HV == states.shape[1]
    return run_all_chunks(every, blocks, chunk_lengths, params, {}, states)


@pytest.mark.parametrize("how", ["strong", "reset", "zero"])
@pytest.mark.parametrize("name", PER_KEY)
def test_every_intermediate_stays_bounded_in_float32(ops, name, how):
    """Under the worst gates every block of the chunk program is finite in float32, and every
    exponential lies in [0, 1]: no overflow anywhere, only harmless underflow to 0."""
    op = ops[name]
    args = _args(op, how, K=16, V=8)
    values = _all_values(op, args, torch.float32)
    for n, x in values.items():  # −inf: only the masked differences' masked entries (and a reset's g)
        assert not torch.isnan(x).any() and not (x == float("inf")).any(), n
        if op.program.chunk.node(n).op not in ("input", "masked_diff", "ref_diff"):
            assert _finite(x), n
    for n in op.program.chunk.order():
        if n.op in EXPONENTIALS:
            x = values[n.name]
            assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0, n.name
    if how == "strong":  # the decays did reach far below float32's e^{−88}: underflow, no overflow
        assert float(values["Gamma"].min()) == 0.0


# ---- forward and backward against the reference --------------------------------------------------

CASES = {
    "random gates": dict(),
    "strong per-key decay (g ≈ −5)": dict(how="strong"),
    "no decay (g = 0)": dict(how="zero"),
    "half the keys decay, half do not": dict(how="mixed"),
    "resets (g = −inf) at one token": dict(how="reset"),
    "grouped value heads": dict(H=1, HV=3),
    "one token": dict(T=1, cu_seqlens=None),
    "dense batch, no initial state": dict(B=2, T=70, cu_seqlens=None, initial_state=False),
}
KDA_CASES = {
    "beta near 0": dict(beta=1e-4),
    "beta near 1": dict(beta=1.0 - 1e-4),
    "beta = 1, strong decay": dict(beta=1.0, how="strong"),
}


def _run_case(op, kw):
    kw = dict(kw)
    return _args(op, kw.pop("how", "random"), **kw)


@pytest.mark.parametrize("name, case", [(n, c) for n in PER_KEY for c in CASES] + [("kda", c) for c in KDA_CASES])
def test_forward_and_gradients_match_the_reference(ops, name, case):
    op = ops[name]
    args = _run_case(op, {**CASES, **KDA_CASES}[case])
    o, final = op(**args)
    o_ref, s_ref = op.reference(**args)
    assert _finite(o, final) and o.shape == o_ref.shape
    assert rel_err(o, o_ref) <= FWD_TOL and rel_err(final, s_ref) <= FWD_TOL
    got, want = input_grads(op, args), input_grads(op.reference, args)
    assert set(got) == set(want) == {*op.input_names, *(["initial_state"] if "initial_state" in args else [])}
    for n in want:
        assert _finite(got[n]) and got[n].shape == want[n].shape, n
        assert rel_err(got[n], want[n]) <= GRAD_TOL, f"d {n}: {rel_err(got[n], want[n]):.3g}"
    if case.startswith("resets"):  # the reset zeroes the state: d g is 0 there, as the reference's
        at = args["g"] == -float("inf")
        assert not got["g"][at].any() and not want["g"][at].any()


def test_identical_keys_kda(ops):
    """One key repeated through the sequence (a repeated token), β = 1 and no decay: the delta
    rule's triangular system at its most correlated."""
    op = ops["kda"]
    args = _args(op, "zero", beta=1.0)
    args["k"] = args["k"][:, :1].expand_as(args["k"]).contiguous()
    o, final = op(**args)
    o_ref, s_ref = op.reference(**args)
    assert rel_err(o, o_ref) <= FWD_TOL and rel_err(final, s_ref) <= FWD_TOL
    got, want = input_grads(op, args), input_grads(op.reference, args)
    for n in want:
        assert rel_err(got[n], want[n]) <= GRAD_TOL, n


@pytest.mark.parametrize("how", ["strong", "mixed", "reset"])
@pytest.mark.parametrize("name", PER_KEY)
def test_float32_under_the_worst_gates(ops, name, how):
    op = ops[name]
    args = _args(op, how, dtype=torch.float32)
    o, final = op(**args)
    o_ref, s_ref = op.reference(**args)
    assert o.dtype == torch.float32 and _finite(o, final)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(final, s_ref) <= 1e-5
    got, want = input_grads(op, args), input_grads(op.reference, args)
    for n in want:
        assert _finite(got[n]) and rel_err(got[n], want[n]) <= 1e-4, n


def test_the_decay_is_per_key():
    """Decaying one key's row of the state fully while the others keep theirs changes only what
    that key carries: the op is not the scalar gate in disguise."""
    op = qla_compiler.compile("gla")
    args = _args(op, "zero", cu_seqlens=None, T=80, H=1, HV=1)
    g = args["g"].clone()
    g[0, 40, 0, 0] = -float("inf")  # key 0 forgets everything at token 40
    _, S = op(**{**args, "g": g})
    _, S_ref = op(**args)
    k = args["k"][0, 40:, 0]  # what was written at the reset (after its decay) and after it
    v = args["v"][0, 40:, 0]
    assert rel_err(S[0, 0, 0], (k[:, :1] * v).sum(0)) <= 1e-12  # row 0: only the later writes
    assert rel_err(S[0, 0, 1:], S_ref[0, 0, 1:]) <= 1e-12  # the other rows: as without the reset


# ---- the ops, in FLA's conventions ---------------------------------------------------------------

def test_chunk_gla_and_chunk_kda_follow_fla():
    torch.manual_seed(0)
    B, T, H, K, V = 1, 100, 2, 16, 8
    q, k = torch.randn(B, T, H, K, dtype=torch.float64), torch.randn(B, T, H, K, dtype=torch.float64)
    k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, H, V, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, dtype=torch.float64))
    beta = torch.rand(B, T, H, dtype=torch.float64)
    cu = torch.tensor([0, 37, 100])
    h0 = torch.randn(2, H, K, V, dtype=torch.float64)
    gla = qla_compiler.compile("gla")
    kda = qla_compiler.compile("kda")

    o, final = chunk_gla(q, k, v, g, scale=0.3, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_ref, s_ref = gla.reference(q, k, v, g, scale=0.3, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == (B, T, H, V) and final.shape == (2, H, K, V)
    assert rel_err(o, o_ref) <= FWD_TOL and rel_err(final, s_ref) <= FWD_TOL
    assert chunk_gla(q, k, v, g)[1] is None  # no final state unless asked for

    o, final = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                         use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = kda.reference(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                 use_qk_l2norm_in_kernel=True)
    assert rel_err(o, o_ref) <= FWD_TOL and rel_err(final, s_ref) <= FWD_TOL
    # l2-normalising q and k first is what use_qk_l2norm_in_kernel does
    qn, kn = (x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() for x in (q, k))
    assert rel_err(chunk_kda(qn, kn, v, g, beta, initial_state=h0, cu_seqlens=cu)[0], o) <= 1e-10

    # float32 inputs: o in float32, the state float32, differentiable
    leaves = [x.float().requires_grad_() for x in (q, k, v, g, beta)]
    o32, s32 = chunk_kda(*leaves, output_final_state=True)
    assert o32.dtype == torch.float32 and s32.dtype == torch.float32
    (o32.sum() + s32.sum()).backward()
    assert all(x.grad is not None and _finite(x.grad) for x in leaves)
    assert chunk_gla.__name__ == "chunk_gla" and chunk_kda.__name__ == "chunk_kda"


def _fla_inputs(B=1, T=20, H=2, K=8, V=8):
    return dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, V),
                g=-torch.rand(B, T, H, K), beta=torch.rand(B, T, H))


@pytest.mark.parametrize("change, pattern", [
    (dict(g=-torch.rand(1, 20, 2)), r"^g: expected \[B=1, T=20, HV=2, K=8\] \(a gate per key dimension\), got shape \[1, 20, 2\]"),
    (dict(g=-torch.rand(1, 20, 2, 4)), r"^g: expected shape \[1, 20, 2, 8\] \(a gate per key dimension\)"),
    (dict(g=-torch.rand(1, 2, 20, 8)), r"^g: .*head-first \(\[B, HV, T, K\]\)"),
    (dict(g=torch.rand(1, 20, 2, 8)), r"^g: a log-space gate must be ≤ 0"),
    (dict(beta=torch.rand(1, 20, 2, 8)), r"^beta: expected \[B=1, T=20, HV=2\], got shape \[1, 20, 2, 8\]"),
    (dict(initial_state=torch.zeros(1, 2, 8, 4)), r"^initial_state: expected shape \[1, 2, 8, 8\]"),
])
def test_bad_inputs_name_the_argument(change, pattern):
    args = {**_fla_inputs(), **change}
    with pytest.raises(ValueError, match=pattern):
        chunk_kda(**args)
    if "beta" not in change:
        args.pop("beta")
        with pytest.raises(ValueError, match=pattern):
            chunk_gla(**args)


# ---- sm90: the forward on kernels, the backward refused saying why ----------------------------

@pytest.mark.parametrize("name", PER_KEY)
def test_sm90_kernels_hold_no_whole_chunk_decay_block(name, capsys):
    """The kernels hold no C×C×K block: the diagonal sub-blocks' products are statements that never
    store R, forward (X ⋆ Z) and backward (d P ⋆_rows Z, d P ⋆_cols X, and d γ through them:
    decay_grad_by_products)."""
    prog = qla_compiler.compile_spec(name, target="sm90")
    assert prog.no_kernels is None and prog.backward_unsupported() is None
    kernels = prog.kernels.kernels
    assert [k.name for k in kernels] == [f"{name}_prep", f"{name}_scan", f"{name}_out"]
    assert not any(b.shape == ("C", "C", "K") for k in kernels for b in k.buffers)
    # q ⋆ k: in the out kernel, or in the prep beside k ⋆ k where that forms the same exponentials
    # (KDA, partition.SHARE_DECAYS)
    holder = next(k for k in kernels if k.name == f"{name}_{'prep' if name == 'kda' else 'out'}")
    assert [(st.attr["block"], st.attr["eq"]) for st in holder.body if st.op == "decayed_product"] == \
        [(SUBCHUNK, "ik,jk,ijk->ij")]
    # summed a thread a row, the rows' sums staged in a C×16 float32 block the schedule budgets
    scratch = next(st.attr["scratch"][1] for st in holder.body if st.op == "decayed_product")
    assert next(b for b in holder.buffers if b.name == scratch) == \
        Buffer(scratch, ("C", str(SUBCHUNK)), "float32", "shared")
    with pytest.raises(ValueError, match="stages its sums in no float32 shared block"):
        replace(holder, buffers=[b for b in holder.buffers if b.name != scratch]).verify()
    crossing = [p for k in kernels for p in k.params if p.name == "g_cum_log2_rows"]
    assert crossing and all(p.dtype == "float32" for p in crossing)  # γ never rounds to bf16
    assert [n.name for n in prog.backward.order() if n.shape == ("C", "C", "K")] == ["g_cum_log2_diff_diag", "R_diag"]
    back = prog.backward_program.kernels.kernels
    assert not any(b.shape == ("C", "C", "K") for k in back for b in k.buffers)
    assert {st.attr["eq"] for k in back for st in k.body if st.op == "decayed_product"} == \
        {"ik,jk,ijk->ij", "ij,jk,ijk->ik", "ij,ik,ijk->jk"}
    assert main([name, "--emit", "tilelang", "--backward"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("how", ["random", "strong", "reset", "same keys"])
@pytest.mark.parametrize("name", PER_KEY)
def test_the_backward_kernels_meet_autograd_of_the_reference(ops, name, how):
    """The training step through the GPU path's host code, every forward and backward kernel's
    statements interpreted with the GPU's roundings: gradients against autograd through the
    float64 recurrence (bf16 blocks between kernels: ~3e-3; a wrong statement is O(1))."""
    op = ops[name]
    args = _args(op, "random" if how == "same keys" else how, dtype=torch.bfloat16, K=64, V=64, T=200,
                 cu_seqlens=[0, 1, 41, 141, 200])
    if how == "same keys":
        args["k"] = args["k"][:, :1].expand_as(args["k"]).clone()
    step = emulated_step(op, args)
    ref = reference_step(op, args, step)
    names = [k.name for k in op.program.backward_program.kernels.kernels]
    assert [n for n, _ in step["emulator"].calls[-len(names):]] == names
    for name in op.input_names:
        assert rel_err(step["grads"][name], ref["grads"][name]) <= 1e-2, (name, rel_err(step["grads"][name], ref["grads"][name]))
    assert rel_err(step["d_h0"], ref["d_h0"]) <= 1e-2


def test_gla_keeps_the_state_cotangent_in_float32_for_its_gate_gradient(ops):
    """GLA's d g takes, for each key, Σ_v S0 ⊙ d S (the Γ term) and v·d Sᵀ: sums over V of large
    products with a small result, as each row of a state without a delta rule is a decayed sum of
    k v ᵀ. Its backward scan stores d S in float32 (schedule_build.state_dtype), the d g kernel
    reads it so and adds the residual of its bf16 copy into v·d Sᵀ; KDA (a delta rule) and GDN (a
    scalar gate) keep bf16 states. With the GPU's roundings emulated, GLA's d g at K = V = 64 on
    these inputs is 1.46e-3 relative; with d S in bf16 it was 2.14e-3 (session 38; FLA's own is
    about 1.35e-3 at K = 256 on the GPU)."""
    def d_s(name):
        scan = next(k for k in ops[name].program.backward_program.kernels.kernels if k.kind == "scan")
        return [p.dtype for p in scan.params if p.role == "out" and p.shape[0] == "CH"]
    assert d_s("gla") == ["float32"] and d_s("kda") == ["io"] and d_s("gdn") == ["io"]
    op, gen = ops["gla"], torch.Generator().manual_seed(0)
    # the d v kernel reads it for a wgmma alone: converted on its way in, which TMA cannot do
    cast = next(k for k in op.program.backward_program.kernels.kernels if any(st.attr.get("cast") for st in k.body))
    for attrs in ((), (("cast", True), ("async", True))):
        body = [replace(st, attrs=attrs) if st.attr.get("cast") else st for st in cast.body]
        with pytest.raises(ValueError, match="a load that converts is marked cast, and is not async"):
            replace(cast, body=body).verify()
    lens, H, K = [1, 200, 77], 2, 64
    T = sum(lens)
    args = dict(q=F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).to(torch.bfloat16),
                k=F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).to(torch.bfloat16),
                v=torch.randn(1, T, H, K, generator=gen).to(torch.bfloat16),
                g=F.logsigmoid(torch.randn(1, T, H, K, generator=gen) + 3.0),  # slow decay: large states
                cu_seqlens=torch.tensor([0, 1, 201, 278]), initial_state=torch.randn(3, H, K, K, generator=gen) * 0.5,
                output_final_state=True)
    step = emulated_kernel_step(op, args, rounding=torch.bfloat16)
    assert rel_err(step["grads"]["g"], step["grads_ref"]["g"]) <= 1.7e-3


UNSHARED_CHILD = """
import sys, torch
import qla_compiler
from qla_compiler.emulate import emulated_kernels, emulated_step
from qla_compiler.kernels import forward as fwd
from qla_compiler.testing import random_inputs
op = qla_compiler.compile("kda", target="sm90")
out = {"kernels": op.program.kernels, "runs": {}}
for how in ("random", "strong"):
    args = random_inputs(op, T=200, H=2, HV=2, K=64, V=32, cu_seqlens=[0, 1, 41, 141, 200], initial_state=True,
                         dtype=torch.bfloat16, seed=3)
    if how == "strong":
        args["g"] = args["g"] * 8
    inputs, dims, scale = op._prepare((), {n: args[n] for n in op.input_names}, None, args["initial_state"],
                                      args["cu_seqlens"], False)
    with emulated_kernels(op, args["cu_seqlens"].to(torch.int32), scale, rounding=torch.bfloat16):
        out["runs"][how] = (args, fwd.forward(op.program, inputs, op.kinds, dims, scale, args["initial_state"],
                                              args["cu_seqlens"], op._head_logs(dims.HV)))
step = emulated_step(op, out["runs"]["random"][0], rounding=torch.bfloat16)
out["grads"] = (step["grads"], step["d_h0"])
torch.save(out, sys.argv[1])
"""


def test_kdas_q_k_product_shares_the_preps_exponentials(ops, tmp_path):
    """By default (partition.SHARE_DECAYS; QLA_SHARE_DECAYS=0 turns it off) KDA's prep forms
    q ⋆ k beside the inverse's k ⋆ k in one statement, one exponential an element for both, and
    its sub-chunk products beside k ⋆ k's (2 CTAs an SM, as without it); P crosses memory, and
    neither the out kernel nor the backward's d v kernel (the training forward keeps P) forms a
    decayed product. With the GPU's roundings emulated, its o, final state and gradients are those
    of the kernels that form q ⋆ k in the out kernel (a child process with the switch off), bit for
    bit: P crosses in bf16, as the out kernel rounds it for its wgmma. (A wrong operand or a wrong
    row in the pair is O(1) off.)"""
    path = tmp_path / "unshared.pt"
    subprocess.run([sys.executable, "-c", UNSHARED_CHILD, str(path)], check=True,
                   env={**os.environ, "QLA_SHARE_DECAYS": "0"}, timeout=600)
    got = torch.load(path, weights_only=False)
    op = ops["kda"]
    prep, _, out = op.program.kernels.kernels
    paired = [st for st in prep.body if st.op == "decayed_product"]
    assert len(paired) == 1 and {paired[0].dst, paired[0].attr["second"][1]} == {"P_diag", "KKt_R_diag"}
    assert "P_rows" in [p.name for p in prep.params if p.role == "out"] and prep.ctas_per_sm == 2
    assert not any(st.op == "decayed_product" for st in out.body) and "P_rows" in [p.name for p in out.params]
    assert "one exponential for both" in str(prep)
    unshared_prep, _, unshared_out = got["kernels"].kernels
    assert not any(st.attr.get("second") for st in unshared_prep.body)
    assert any(st.op == "decayed_product" for st in unshared_out.body)
    for how, (args, (o, final)) in got["runs"].items():
        inputs, dims, scale = op._prepare((), {n: args[n] for n in op.input_names}, None, args["initial_state"],
                                          args["cu_seqlens"], False)
        with emulated_kernels(op, args["cu_seqlens"].to(torch.int32), scale, rounding=torch.bfloat16):
            o_shared, final_shared = fwd.forward(op.program, inputs, op.kinds, dims, scale, args["initial_state"],
                                                 args["cu_seqlens"], op._head_logs(dims.HV))
        assert torch.equal(o, o_shared) and torch.equal(final, final_shared), how
    d_v = op.program.backward_program.kernels.kernels[0]
    assert "P_rows" in [p.name for p in d_v.params] and not any(st.op == "decayed_product" for st in d_v.body)
    shared = emulated_step(op, got["runs"]["random"][0], rounding=torch.bfloat16)
    grads, d_h0 = got["grads"]
    assert all(torch.equal(grads[n], shared["grads"][n]) for n in grads) and torch.equal(d_h0, shared["d_h0"])
    with pytest.raises(ValueError, match="a second product takes a fourth source"):
        replace(prep, body=[replace(st, srcs=st.srcs[:3]) if st.op == "decayed_product" else st
                            for st in prep.body]).verify()


@pytest.mark.parametrize("how", ["random", "strong", "zero", "mixed", "reset", "same keys"])
@pytest.mark.parametrize("name", PER_KEY)
def test_the_forward_kernels_meet_the_reference(ops, name, how):
    """The sm90 forward's KernelIR, every statement interpreted with the GPU's roundings (bf16
    blocks, float32 γ: ir/kernel_interp.py) through the GPU path's host code, against the float64
    reference: 1-token sequences, partial chunks (their γ rows held past the end), the worst gates,
    identical keys. Neither fuses its scan and out kernel (schedule_fused: the diagonal sub-blocks'
    product stays in the parallel out kernel)."""
    op = ops[name]
    # partial chunks of 40 and 36 tokens: rows past the end after a sub-chunk's reference row
    args = _args(op, "random" if how == "same keys" else how, dtype=torch.bfloat16, K=64, V=32, T=200,
                 cu_seqlens=[0, 1, 41, 141, 200])
    if how == "same keys":
        args["k"] = args["k"][:, :1].expand_as(args["k"]).clone()
    inputs, dims, scale = op._prepare((), {n: args[n] for n in op.input_names}, None, args["initial_state"],
                                      args["cu_seqlens"], False)
    o_ref, s_ref = op.reference(**{k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v)
                                   for k, v in args.items()})
    for fused in (True, False):  # (asked to fuse, it runs the separate kernels)
        with emulated_kernels(op, args["cu_seqlens"].to(torch.int32), scale, rounding=torch.bfloat16) as emu:
            o, final = fwd.forward(op.program, inputs, op.kinds, dims, scale, args["initial_state"],
                                   args["cu_seqlens"], op._head_logs(dims.HV), fused=fused)
        assert [n for n, _ in emu.calls][-1] == f"{name}_out"
        assert rel_err(o, o_ref) <= 1e-2 and rel_err(final, s_ref) <= 1e-2, (fused, rel_err(o, o_ref), rel_err(final, s_ref))


@pytest.mark.parametrize("name", PER_KEY)
def test_the_forward_kernels_with_context_parallelism_meet_the_reference(ops, name):
    """Each sequence cut in two segments: the windows scan's kernels, the start states chained on
    the host (the emulator runs the window search's torch definition; on the GPU its kernel reads
    the gate's slowest key: kernels/window_search.py)."""
    op = ops[name]
    args = _args(op, "strong", dtype=torch.bfloat16, K=64, V=64, T=400, cu_seqlens=[0, 1, 130, 400])
    inputs, dims, scale = op._prepare((), {n: args[n] for n in op.input_names}, None, args["initial_state"],
                                      args["cu_seqlens"], False)
    o_ref, s_ref = op.reference(**{k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v)
                                   for k, v in args.items()})
    with emulated_kernels(op, args["cu_seqlens"].to(torch.int32), scale, rounding=torch.bfloat16) as emu:
        o, final = fwd.forward(op.program, inputs, op.kinds, dims, scale, args["initial_state"], args["cu_seqlens"],
                               op._head_logs(dims.HV), context_parallel=2)
    assert f"{name}_scan_windows" in [n for n, _ in emu.calls]
    assert rel_err(o, o_ref) <= 1e-2 and rel_err(final, s_ref) <= 1e-2, (rel_err(o, o_ref), rel_err(final, s_ref))


# ---- the CLI ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PER_KEY)
def test_cli_prints_the_summary_chunk_and_backward(name, capsys):
    assert main([f"specs/{name}.py"]) == 0
    out = capsys.readouterr().out
    assert f"recurrence {name}" in out and "per-key gated" in out and f"kernels: {name}_prep, {name}_scan" in out
    assert main([f"specs/{name}.py", "--emit", "chunk"]) == 0
    out = capsys.readouterr().out
    assert "g:C×K" in out and "R_diag:C×C×K" in out and "contract[eq=ik,jk,ijk->ij] q k R_diag" in out
    assert "S_decayed:K×V     = scale_rows Gamma_C S0" in out or "scale_rows Gamma_C S0" in out
    assert main([f"specs/{name}.py", "--emit", "backward"]) == 0
    out = capsys.readouterr().out
    assert "d_g:C×K" in out and "contract[eq=ij,jk,ijk->ik] d_P k R_diag" in out


@pytest.mark.parametrize("name", PER_KEY)
def test_cli_check_reports_every_pass_within_tolerance(name, capsys):
    assert main([name, "--check"]) == 0
    out = capsys.readouterr().out
    assert "after chunk" in out and "every pass within 1e-10" in out


def test_the_backward_out_kernels_are_grouped_to_do_the_least_work_twice(ops):
    """KDA's backward out kernel for all five gradients would not fit in shared memory (264 KB).
    Halving the list of outputs gave d q d k d v | d g | d β, and the d g kernel recomputed d k's
    whole chain. The grouping is now the fewest kernels that fit, then the fewest decayed products
    and matmuls done twice: d q d k d g | d v d β, with d k's chain once. The d v d β kernel runs
    first: it hands d A_T on to the d q d k d g kernel, which runs on blocks of K's columns
    (test_key_blocks)."""
    back = ops["kda"].program.backward_program.kernels
    outs = [k for k in back.kernels if k.kind == "out"]
    assert [k.outputs for k in outs] == [("d_v", "d_beta"), ("d_q", "d_k", "d_g")]
    assert all(k.shared_peak <= SMEM_BUDGET for k in outs)
    # each decayed product computed once, none stored for another kernel (d β's KKᵀ⊙R is its own)
    assert [sum(st.op == "decayed_product" for st in k.body) for k in outs] == [1, 4]
    assert [{p.name for p in k.params if p.role == "out"} - set(k.outputs) for k in outs] == [{"d_A_T_full_rows"}, set()]
    # GDN's backward at K = V = 128 fits in one out kernel, as it did
    gdn = ops["gdn"].program.backward_program.kernels
    assert [k.outputs for k in gdn.kernels if k.kind == "out"] == [("d_q", "d_k", "d_v", "d_g", "d_beta")]


def test_split_out_kernels_hand_the_diagonal_products_on(ops):
    """Where the outputs are split so that a later kernel needs a decayed product an earlier one
    holds (KDA's backward cut as d q d k d v | d g | d β, as it ran in sessions 28 to 31), the
    d g kernel loads the four diagonal sub-block products the d q, d k, d v kernel computed
    (float32 rows, stored right after each is complete) instead of computing them again: it holds
    no decayed product of its own."""
    prog = ops["kda"].program
    part = prog.backward_program.stage("partition")
    built = out_kernels(part, True, dim_sizes(prog.head_dims), (),
                         groups=[("d_q", "d_k", "d_v"), ("d_g",), ("d_beta",)])
    kernels = {k.name: k for k in built}
    first, d_g = kernels["kda_backward_out_d_q_d_k_d_v"], kernels["kda_backward_out_d_g"]
    handed = {p.name for p in first.params if p.role == "out" and p.dtype == "float32"}
    assert len(handed) == 4
    assert handed <= {p.name for p in d_g.params if p.role == "in" and p.dtype == "float32"}
    assert not any(st.op == "decayed_product" for st in d_g.body)
    for i, st in enumerate(first.body):
        if st.op == "store" and st.dst in handed:
            (src,) = st.srcs
            assert any(s.op == "decayed_product" and s.dst == src for s in first.body[:i]), st.dst
            assert not any(s.dst == src for s in first.body[i + 1:]), st.dst  # nothing written over it after


def _l2(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_chunk_kda_takes_flas_keywords(lower_bound):
    """Kimi Linear's layers call FLA's chunk_kda with the raw gate activation and A_log, dt_bias
    (use_gate_in_kernel), β through a sigmoid (use_beta_sigmoid_in_kernel, and 2σ with
    allow_neg_eigval), the state V-first: ours takes the same call. In float64 on the CPU it meets
    the spec's reference on FLA's formulas (−e^{A_log} softplus(g + dt_bias), or lower_bound ·
    σ(e^{A_log}(g + dt_bias))), and autograd gives A_log, dt_bias and the raw β their gradients."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, HV, K, V = 1, 37, 2, 4, 16, 8

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    raw = dict(q=rand(B, T, H, K), k=rand(B, T, H, K), v=rand(B, T, HV, V), g=rand(B, T, HV, K), beta=rand(B, T, HV),
               A_log=rand(HV), dt_bias=rand(HV * K), initial_state=rand(B, HV, V, K))
    ours = {n: x.clone().requires_grad_() for n, x in raw.items()}
    o, final = chunk_kda(**ours, use_gate_in_kernel=True, lower_bound=lower_bound, safe_gate=lower_bound is not None,
                         use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, state_v_first=True,
                         use_qk_l2norm_in_kernel=True, output_final_state=True, chunk_size=32)
    ref = {n: x.clone().requires_grad_() for n, x in raw.items()}
    x = ref["g"] + ref["dt_bias"].view(HV, K)
    a = ref["A_log"].view(HV, 1).exp()
    g = lower_bound * torch.sigmoid(a * x) if lower_bound is not None else -a * F.softplus(x)
    o_ref, final_ref = qla_compiler.compile("kda").reference(
        _l2(ref["q"]), _l2(ref["k"]), ref["v"], g, 2 * torch.sigmoid(ref["beta"]),
        initial_state=ref["initial_state"].transpose(-1, -2), output_final_state=True)
    assert final.shape == raw["initial_state"].shape  # V-first, as it came
    assert rel_err(o.detach(), o_ref.detach()) <= 1e-10
    assert rel_err(final.detach(), final_ref.detach().transpose(-1, -2)) <= 1e-10
    with torch.no_grad():  # the token step takes the same call (FLA's fused_recurrent_kda)
        o_step, final_step = fused_recurrent_kda(**raw, use_gate_in_kernel=True, lower_bound=lower_bound,
                                                 use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                                 state_v_first=True, use_qk_l2norm_in_kernel=True,
                                                 output_final_state=True)
    assert rel_err(o_step, o_ref.detach()) <= 1e-10 and rel_err(final_step, final.detach()) <= 1e-10
    w_o, w_s = rand(*o.shape), rand(*final.shape)
    ((o * w_o).sum() + (final * w_s).sum()).backward()
    ((o_ref * w_o).sum() + (final_ref.transpose(-1, -2) * w_s).sum()).backward()
    for n in raw:
        assert rel_err(ours[n].grad, ref[n].grad) <= 1e-8, n


@pytest.mark.parametrize("call, message", [
    (dict(A_log=torch.zeros(4)), "A_log, dt_bias: they make the gate from a raw g only with use_gate_in_kernel"),
    (dict(use_gate_in_kernel=True), "A_log: needed with use_gate_in_kernel=True unless lower_bound is set"),
    (dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-7.0), "lower_bound: safe_gate .* in \\[-5, 0\\)"),
    (dict(allow_neg_eigval=True), "allow_neg_eigval: needs use_beta_sigmoid_in_kernel=True"),
    (dict(chunk_size=16), "chunk_size: FLA's KDA takes 32 or 64, got 16"),
    (dict(return_intermediate_states=True), "return_intermediate_states: not supported"),
])
def test_flas_kda_keywords_misused_are_named(call, message):
    q = torch.randn(1, 5, 2, 16, dtype=torch.float64)
    args = dict(q=q, k=q, v=torch.randn(1, 5, 4, 8, dtype=torch.float64), g=-torch.rand(1, 5, 4, 16, dtype=torch.float64),
                beta=torch.rand(1, 5, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=message):
        chunk_kda(**args, **call)
