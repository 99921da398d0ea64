"""The backward: the autodiff pass's VJP chunk program, run by the interpreter as a reverse scan
inside torch.autograd, against autograd through the spec's own recurrence (float64).

Small sizes (K = V = 8, two chunks and a partial one at most) so the file runs in seconds.
"""
from __future__ import annotations

import pytest
import torch

from conftest import SPECS
from qla_compiler.errors import PassError
from qla_compiler.ir.chunk import ChunkIR
from qla_compiler.ir.chunk_interp import run_backward, run_chunks
from qla_compiler.passes import autodiff
from qla_compiler.op import CompiledOp
from qla_compiler.passes.autodiff import VJP, derive_backward
from qla_compiler.passes.pipeline import Program
from qla_compiler.passes.verify_exponents import verify_exponents
from qla_compiler.testing import input_grads, random_inputs, rel_err

TOL = 1e-8
GATED = ("gdn", "simple_gla", "gla", "kda")

CASES = {
    # name: (keyword arguments for random_inputs, the final state gets a gradient)
    "packed varlen, 1-token sequence, partial chunk": (
        dict(T=150, cu_seqlens=[0, 1, 70, 150], initial_state=True), True),
    "grouped value heads": (dict(B=2, T=80, H=2, HV=4, initial_state=True), True),
    "no gradient on the final state": (dict(T=100, initial_state=True), False),
    "no initial state": (dict(T=130, HV=3), True),
    "strong decay": (dict(T=140, gate=-16.0, initial_state=True), True),
    "no decay (g = 0)": (dict(T=140, gate=0.0, initial_state=True), True),
}


def assert_grads_match(op, args, state_grad=True, **call):
    fn, ref = (lambda **a: op(**a, **call)), (lambda **a: op.reference(**a, **call))
    got, want = input_grads(fn, args, state_grad=state_grad), input_grads(ref, args, state_grad=state_grad)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        assert got[name].shape == want[name].shape, name
        err = rel_err(got[name], want[name])
        assert err <= TOL, f"d {name}: relative error {err:.3g}"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("spec", SPECS)
def test_gradients_match_autograd_through_the_recurrence(ops, spec, case):
    kw, state_grad = CASES[case]
    if "gate" in kw and spec not in GATED:
        pytest.skip("no gate input")
    op = ops[spec]
    args = random_inputs(op, **{"H": 1, "HV": 2, "K": 8, "V": 8, "seed": len(case), **kw})
    assert_grads_match(op, args, state_grad)


@pytest.mark.parametrize("spec", SPECS)
def test_gradients_without_a_final_state(ops, spec):
    op = ops[spec]
    args = random_inputs(op, T=70, H=1, HV=2, K=8, V=8, cu_seqlens=[0, 5, 70], initial_state=True, seed=2)
    args["output_final_state"] = False
    assert_grads_match(op, args)


def test_qk_l2norm_in_kernel_gradients(ops):
    op = ops["gdn"]
    args = random_inputs(op, T=90, H=1, HV=2, K=8, V=8, initial_state=True, seed=4)
    args["q"], args["k"] = args["q"] * 3.0, args["k"] * 0.5
    assert_grads_match(op, args, use_qk_l2norm_in_kernel=True)


def test_gate_gradient_under_strong_decay_in_float32(ops):
    """g = −16 per token: every decay between two tokens is ~1e-7, and so is d g. The VJP of a
    difference x_i − x_j drops the entries where it is ≡ 0 (the decay matrix's diagonal, the last
    token's x_last − x_last), whose O(1) cotangents would otherwise cancel in float32 and leave a
    relative error of ~1 in d g (measured 1.7 before). What is left (1.3e-5 measured, 3e-6 at
    g = −4: proportional to g) is the exponent G_i − G_j taken as a difference of chunk-local
    cumulative sums of size up to 64·16, each rounded to ~|G|·2⁻²⁴ ≈ 6e-5; the other gradients keep
    float32 accuracy."""
    op = ops["gdn"]
    args = random_inputs(op, T=140, H=1, HV=2, K=16, V=16, gate=-16.0, initial_state=True, seed=3)
    as32 = {n: (x.float() if torch.is_tensor(x) and x.is_floating_point() else x) for n, x in args.items()}
    got = input_grads(lambda **a: op(**a), as32)
    want = input_grads(lambda **a: op.reference(**a), args)
    for name in want:
        assert got[name].dtype == torch.float32
        err = rel_err(got[name], want[name])
        assert err <= (1e-4 if name == "g" else 1e-6), f"d {name}: relative error {err:.3g}"


@pytest.mark.parametrize("T,HV", [(5, 2), (70, 1)])
def test_gradcheck_gdn(ops, T, HV):
    """Finite differences of the op itself (every input element, both outputs), no reference."""
    op = ops["gdn"]
    args = random_inputs(op, T=T, H=1, HV=HV, K=4, V=4, initial_state=True, seed=T)
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    leaves = [args[n].detach().clone().requires_grad_(True) for n in names]

    def fn(*xs):
        kw = dict(zip(names, xs))
        return op(**kw, output_final_state=True)

    assert torch.autograd.gradcheck(fn, leaves, fast_mode=False)


def test_the_chunk_program_is_one_autograd_function(ops):
    op = ops["gdn"]
    args = random_inputs(op, T=70, H=1, HV=1, K=8, V=8, initial_state=True)
    args["v"].requires_grad_(True)
    o, _ = op(**args)
    seen, todo = set(), [o.grad_fn]
    while todo:
        f = todo.pop()
        if f is not None and f not in seen:
            seen.add(f)
            todo += [g for g, _ in f.next_functions]
    # one node: the custom op qla::interpret's backward (qla_compiler/custom_ops.py), which an eager
    # call records as a torch.autograd.Function (custom_ops._EagerGrad)
    assert [getattr(f, "op_name", None) for f in seen if "_EagerGrad" in type(f).__name__] == ["interpret"]
    with torch.no_grad():  # no grad wanted: the plain interpreter, no saved states
        assert op(**args)[0].grad_fn is None


def test_forward_saves_the_entering_states(ops):
    op = ops["gdn"]
    chunk = op.program.chunk
    N, HV, NC, C, K, V = 2, 2, 3, chunk.chunk_size, 4, 4
    gen = torch.Generator().manual_seed(0)
    blocks = {"q": torch.randn(N, HV, NC, C, K, generator=gen, dtype=torch.float64),
              "k": torch.nn.functional.normalize(torch.randn(N, HV, NC, C, K, generator=gen,
                                                             dtype=torch.float64), dim=-1),
              "v": torch.randn(N, HV, NC, C, V, generator=gen, dtype=torch.float64),
              "g": -torch.rand(N, HV, NC, C, generator=gen, dtype=torch.float64),
              "beta": torch.rand(N, HV, NC, C, generator=gen, dtype=torch.float64)}
    lengths = torch.tensor([[C, C, 10], [C, 0, 0]])
    h0 = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64)
    o, final = run_chunks(chunk, blocks, lengths, {"scale": 0.5}, {}, h0)
    o2, final2, states = run_chunks(chunk, blocks, lengths, {"scale": 0.5}, {}, h0, save_states=True)
    assert torch.equal(o, o2) and torch.equal(final, final2)
    assert states.shape == (N, HV, NC, K, V) and torch.equal(states[:, :, 0], h0)
    for c in range(1, NC):  # each chunk's entering state is the previous chunk's state
        part = {n: b[:, :, :c] for n, b in blocks.items()}
        upto = run_chunks(chunk, part, lengths[:, :c], {"scale": 0.5}, {}, h0)[1]
        assert torch.allclose(states[:, :, c], upto)


def test_backward_program_of_gdn(ops):
    prog = ops["gdn"].program
    bwd = prog.backward
    assert bwd is not None and bwd.reverse
    assert verify_exponents(bwd) is bwd
    # the backward exponentiates only what the forward does (no new exponentials)
    fwd_exps = {(n.op, n.args) for n in prog.chunk.order() if n.op in ("exp", "exp2")}
    assert {(n.op, n.args) for n in bwd.order() if n.op in ("exp", "exp2")} <= fwd_exps
    kinds = {n.name: n.attr["kind"] for n in bwd.inputs()}
    assert kinds["S0"] == "saved_state" and kinds["d_o"] == "cotangent_value"
    assert bwd.state_in == "d_S_next" and bwd.next_state == "d_S0"
    assert set(bwd.outputs) == {"d_q", "d_k", "d_v", "d_g", "d_beta"}
    text = str(bwd)
    assert text.startswith("chunk_program gdn_backward")
    assert "state d_S_next:K×V" in text and "scan over chunks, last to first" in text
    assert "d_v_new:C×V" in text and "d_S0:K×V" in text
    bwd.verify()


@pytest.mark.parametrize("spec", SPECS)
def test_every_backward_program_passes_the_exponent_verifier(ops, spec):
    bwd = ops[spec].program.backward
    verify_exponents(bwd)
    assert bwd.reverse and bwd.next_state in bwd.graph


def test_a_missing_vjp_rule_names_the_op(ops, monkeypatch):
    monkeypatch.delitem(VJP, "inv_unit_lower")
    with pytest.raises(PassError, match="inv_unit_lower"):
        derive_backward(ops["gdn"].program.chunk)


def test_vjp_rules_cover_every_op_of_the_shipped_programs(ops):
    """Of the programs autodiff differentiates: the one before the kernel-shaping rewrites, which
    then run on the VJP (a per-key gate's sub-chunk form, ref_diff, is never differentiated)."""
    used = {n.op for spec in SPECS for n in ops[spec].program.differentiated.order()}
    assert used <= set(autodiff.VJP)


@pytest.mark.parametrize("spec", ["gdn", "retnet"])
def test_gradients_of_every_chunk_stage(ops, spec):
    """Each ChunkIR stage (the direct form with exp, W and U, then each rewrite) differentiates to the
    same gradients; the op derives a stage's backward program itself when the Program has none."""
    prog = ops[spec].program
    for name, ir in prog.stages:
        if not isinstance(ir, ChunkIR):
            continue
        op = CompiledOp(Program(prog.path, "cpu", ir.chunk_size, prog.recurrence, ir))
        args = random_inputs(op, T=100, H=1, HV=2, K=8, V=8, cu_seqlens=[0, 3, 100], initial_state=True,
                             seed=7)
        assert "autodiff" not in op.program._derived  # derived on first use, not before
        try:
            assert_grads_match(op, args)
        except AssertionError as e:
            raise AssertionError(f"after pass {name}: {e}") from e
        assert op.program.backward.reverse


def test_backward_program_matches_autograd_through_the_interpreter():
    """On a toy program whose triangular inverse takes a full matrix (no tril before it): the rule
    must keep only the strictly lower part, as the op reads only that. The interpreter's ops are
    torch ops, so autograd through run_chunks is a second, independent reference."""
    p = ChunkIR("toy", 8)
    k, v = p.add("k", "input", name="k", kind="key"), p.add("v", "input", name="v", kind="value")
    g = p.add("g", "input", name="g", kind="gate")
    S0 = p.add("S0", "state_in")
    R = p.add("R", "exp", p.add("g_diff", "masked_diff", p.add("g_cum", "cumsum", g), mask="lower"))
    T = p.add("T", "inv_unit_lower", p.add("KKt", "matmul", k, k, tb=True))
    o = p.add("o", "matmul", p.add("TR", "mul", T, R), p.add("kS", "matmul", k, S0))
    S_next = p.add("S_next", "add", S0, p.add("S_update", "matmul", k, p.add("Tv", "matmul", T, v), ta=True))
    p.outputs, p.next_state = {"o": o}, S_next
    p.verify()
    bwd = derive_backward(p)
    gen = torch.Generator().manual_seed(0)
    N, HV, NC, C, K, V = 2, 1, 3, 8, 4, 4
    blocks = {"k": 0.3 * torch.randn(N, HV, NC, C, K, generator=gen, dtype=torch.float64),
              "v": torch.randn(N, HV, NC, C, V, generator=gen, dtype=torch.float64),
              "g": -torch.rand(N, HV, NC, C, generator=gen, dtype=torch.float64)}
    lengths = torch.tensor([[C, C, 5], [C, 2, 0]])
    h0 = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64)
    d_o = torch.randn(N, HV, NC, C, V, generator=gen, dtype=torch.float64)
    d_S = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64)

    leaves = {n: b.clone().requires_grad_(True) for n, b in blocks.items()}
    h0_leaf = h0.clone().requires_grad_(True)
    o_val, final = run_chunks(p, leaves, lengths, {}, {}, h0_leaf)
    want = torch.autograd.grad((o_val * d_o).sum() + (final * d_S).sum(), [*leaves.values(), h0_leaf])

    _, _, states = run_chunks(p, blocks, lengths, {}, {}, h0, save_states=True)
    grads, d_h0 = run_backward(bwd, blocks, lengths, {}, {}, states, d_o, d_S)
    for name, w in zip([*leaves, "initial_state"], want):
        got = d_h0 if name == "initial_state" else grads[name]
        assert rel_err(got, w) <= 1e-12, name

    # which output is which input's gradient is a field of the program, not its role's name
    assert bwd.gradient_of == {"d_k": "k", "d_v": "v", "d_g": "g"} and "d_k=d_k (∂/∂k)" in str(bwd)
    renamed = bwd.copy()
    renamed.outputs = {("grad_of_k" if r == "d_k" else r): x for r, x in bwd.outputs.items()}
    renamed.gradient_of = {("grad_of_k" if r == "d_k" else r): x for r, x in bwd.gradient_of.items()}
    renamed.verify()
    again, _ = run_backward(renamed, blocks, lengths, {}, {}, states, d_o, d_S)
    assert again.keys() == grads.keys() and torch.equal(again["k"], grads["k"])
