"""chunk: classified RecurrenceIR → ChunkIR, the chunked algorithm of MATH.md.

For S_t = d_t (I − s_t k_t k_tᵀ) S_{t−1} + b_t k_t v_tᵀ, write the update as
S_i = d_i S_{i−1} + k_i w_iᵀ with w_i = b_i v_i − s_i d_i S_{i−1}ᵀ k_i, unroll it inside a chunk
(γ = cumsum log d, Γ = e^γ, R_ij = e^{γ_i−γ_j} for j ≤ i) and solve the triangular system for the
w's ("v_new"):

  1. A      = StrictLower(diag(s) K Kᵀ ⊙ R)
  2. T      = (I + A)⁻¹
  3. W      = T diag(s Γ) K,   U = T diag(b) V
  4. v_new  = U − W S0                                  (without the delta factor: v_new = diag(b) V)
  5. o      = scale · [diag(Γ) Q S0 + ((Q Kᵀ) ⊙ R) v_new]
  6. S_next = Γ_C S0 + Kᵀ diag(e^{γ_C − γ}) v_new

This is the direct form; the rewrite passes turn it into the hardware-friendly one. Only values
≤ 0 are exponentiated — γ (a sum of gates ≤ 0), γ_C − γ_j and the masked differences γ_i − γ_j,
j ≤ i — never −γ, which overflows (passes/verify_exponents.py checks it after every pass).

A gate input is floored at G_FLOOR before its cumulative sum (`clamp_min`), so g = −inf, a hard
reset (a document boundary inside a packed sequence), gives what the reference computes — the
state zeroed at that token — instead of NaN: the masked differences would meet (−inf) − (−inf).

A per-key gate (GLA, KDA: a diagonal decay Diag(e^{g_t})) has its own derivation,
passes/chunk_per_key.py.

    >>> chunk = derive_chunks(classify(load_spec("specs/gdn.py")), chunk_size=64)   # doctest: +SKIP
"""
from __future__ import annotations

import sympy as sp

from qla_compiler.errors import PassError
from qla_compiler.ir.chunk import ChunkIR
from qla_compiler.ir.recurrence import RecurrenceIR

from .chunk_per_key import derive_per_key_chunks

# The floor on log-gates: a hard reset, g = −inf, is computed as g = G_FLOOR. What a reset at −100
# keeps of the state before it, e^−100 ≈ 4e-44 of it, is far below float64's resolution of the
# result (that state would have to be 1e27 times larger), so the result is the reference's, and
# −1e4 and −inf give the same bits. A lower floor would cost precision: every later γ of the
# chunk carries it, and float32 resolves differences of values near −100·(resets so far) to
# ~1e-5 · that count, as it does in a chunk of strong decay (64 tokens at g ≈ −2). Measured (GDN,
# float32, 8 resets in 6 chunks): o within 5e-6 of the reference at −100, 2e-6 at −50, 1e-5 at
# −200, 4e-4 at resets of −1e4 with no floor; 2e-7 with no reset. Below the floor the gradient
# is 0, as autograd's through the reference is at −inf (e^g dg = 0).
G_FLOOR = -100.0


def derive_chunks(ir: RecurrenceIR, chunk_size: int = 64) -> ChunkIR:
    st = ir.structure
    if st is None:
        raise PassError("chunk", "the recurrence is not classified; run classify first")
    if st.decay == "key_gate":
        return derive_per_key_chunks(ir, chunk_size, G_FLOOR, _coeff)
    p = ChunkIR(ir.name, chunk_size, history=("chunk",))
    kinds = {i.name: i.kind for i in ir.inputs}
    for i in ir.inputs:  # in the spec's order, so the printed header reads like the spec
        p.add(i.name, "input", name=i.name, kind=i.kind)
    q, k, v = st.query, st.write_key, st.write_value
    S0 = p.add("S0", "state_in")
    scale = p.add("scale", "param", name="scale")

    # the log-decay per token: an input, a per-head constant (zero on padding), or nothing
    if st.decay == "gate":
        g = p.add(f"{st.decay_name}_floored", "clamp_min", st.decay_name, min=G_FLOOR)
    elif st.decay == "head_constant":
        lg = p.add(f"log_{st.decay_name}", "head_log", name=st.decay_name)
        g = p.add("g", "mul", lg, p.add("valid", "valid"))
    else:
        g = p.add("g", "const", value=0.0, shape=("C",))

    g_cum = p.add("g_cum", "cumsum", g)  # γ
    R = p.add("R", "exp", p.add("g_diff", "masked_diff", g_cum, mask="lower"))  # e^{γi−γj}, j ≤ i
    Gam = p.add("Gamma", "exp", g_cum)  # Γ = e^γ ≤ 1
    g_last = p.add("g_last", "last", g_cum)  # γ_C

    b = _coeff(p, st.write_coeff, kinds, "b")
    bv = p.add("bv", "scale_rows", b, v) if b else v
    if st.delta:
        s = _coeff(p, st.delta_coeff, kinds, "s")
        kk = p.add("KKt", "matmul", k, k, tb=True)
        skk = p.add("sKKt", "scale_rows", s, kk) if s else kk
        A = p.add("A", "tril", p.add("sKKt_R", "mul", skk, R), strict=True)
        T = p.add("T", "inv_unit_lower", A)
        sG = p.add("s_Gamma", "mul", s, Gam) if s else Gam
        W = p.add("W", "matmul", T, p.add("sGk", "scale_rows", sG, k))
        U = p.add("U", "matmul", T, bv)
        v_new = p.add("v_new", "sub", U, p.add("WS", "matmul", W, S0))
    else:
        v_new = bv

    o_inter = p.add("o_inter", "scale_rows", Gam, p.add("QS", "matmul", q, S0))
    P = p.add("P", "mul", p.add("QKt", "matmul", q, k, tb=True), R)
    o_sum = p.add("o_sum", "add", o_inter, p.add("o_intra", "matmul", P, v_new))
    c = _coeff(p, st.output_coeff, kinds, "c")
    o = p.add("o", "mul", scale, p.add("co", "scale_rows", c, o_sum) if c else o_sum)

    decay_to_end = p.add("decay_to_end", "exp", p.add("g_to_end", "sub", g_last, g_cum))
    S_decayed = p.add("S_decayed", "mul", p.add("Gamma_C", "exp", g_last), S0)
    k_dec = p.add("k_decayed", "scale_rows", decay_to_end, k)
    S_next = p.add("S_next", "add", S_decayed, p.add("S_update", "matmul", k_dec, v_new, ta=True))
    p.outputs, p.next_state = {"o": o}, S_next
    p.remove_dead()  # e.g. an unused input
    p.verify()
    return p


def _coeff(p: ChunkIR, expr, kinds: dict, name: str) -> str | None:
    """A per-token scalar coefficient (product of numbers and scalar inputs) as nodes; None for 1."""
    expr = sp.sympify(expr)
    if expr == 1:
        return None
    num, factors = sp.Integer(1), []
    for f in sp.Mul.make_args(expr):
        if f.is_Number:
            num *= f
        elif isinstance(f, sp.Symbol) and kinds.get(f.name) == "scalar":
            factors.append(f.name)
        elif isinstance(f, sp.Pow) and f.exp.is_Integer and f.exp > 0 and isinstance(f.base, sp.Symbol):
            factors += [f.base.name] * int(f.exp)
        else:
            raise PassError("chunk", f"cannot build the coefficient {expr} (factor {f})")
    node = factors[0] if factors else p.add(name, "const", value=float(num), shape=("C",))
    for f in factors[1:]:
        node = p.add(name, "mul", node, f)
    if factors and num != 1:
        node = p.add(name, "mul", p.add(f"{name}_num", "const", value=float(num), shape=("C",)), node)
    return node
