"""The chunked algorithm for a per-key gate (GLA, KDA): the chunk pass for a diagonal decay.

S_t = (I − s_t k_t k_tᵀ) D_t S_{t−1} + b_t k_t v_tᵀ with D_t = Diag(e^{g_t}), g_t ∈ ℝ^K (≤ 0);
without the delta factor (GLA) S_t = D_t S_{t−1} + b_t k_t v_tᵀ. Inside a chunk (positions
i, j = 1..C, S0 the state entering it), per key k:

    γ_i  = Σ_{j≤i} g_j   (C×K, chunk-local),   Γ = e^γ (C×K),   Γ_C = e^{γ_C} (K)
    R_ijk = e^{γ_ik − γ_jk} for j ≤ i, 0 above       (C×C×K: the decay from token j to i, per key)
    (X ⋆ Z)_ij = Σ_k X_ik Z_jk R_ijk                  (C×C: Q Kᵀ with the decay inside the sum)

  1. A      = StrictLower(diag(s) (K ⋆ K))
  2. T      = (I + A)⁻¹
  3. W      = T diag(s) (K ⊙ Γ),   U = T diag(b) V
  4. v_new  = U − W S0                                   (without the delta factor: diag(b) V)
  5. o      = scale · [(Q ⊙ Γ) S0 + (Q ⋆ K) v_new]
  6. S_next = diag(Γ_C) S0 + (K ⊙ e^{γ_C − γ})ᵀ v_new

Derivation: S_i = D_i S_{i−1} + k_i w_iᵀ with w_i = b_i v_i − s_i S_{i−1}ᵀ D_i k_i. Unrolled,
S_i = diag(Γ_i) S0 + Σ_{j≤i} diag(e^{γ_i − γ_j}) k_j w_jᵀ, so S_{i−1}ᵀ D_i k_i =
S0ᵀ (Γ_i ⊙ k_i) + Σ_{j<i} (K ⋆ K)_ij w_j: a unit lower triangular system for the w's ("v_new"),
and o_i = S_iᵀ q_i gives step 5. With a scalar gate R_ijk = R_ij for every k and this is MATH.md's
GDN form (K ⋆ K = (K Kᵀ) ⊙ R).

Only differences of cumulative gates are exponentiated, each ≤ 0: γ_ik − γ_jk with j ≤ i
(R), γ_ik (Γ) and γ_Ck − γ_ik; every factor lies in [0, 1] whatever the gates. The tempting
factorisation Q ⋆ K = (Q ⊙ Γ)(K ⊙ e^{−γ})ᵀ, two plain matmuls, needs e^{−γ}: e^{320} in a chunk
of 64 tokens at g = −5 per key (float32 overflows past e^{88}), e^{6400} after resets (g = −inf
is floored at G_FLOOR = −100, as for the scalar gate). So ⋆ is its own op (`contract`, an einsum
over the C×C×K block R); verify_exponents proves each exponent ≤ 0 as for the scalar gate.
R costs C·C·K exponentials a chunk. A GPU lowering would keep R only inside the diagonal blocks of
sub-chunks (16 tokens) and take the blocks below them, sub-chunk a against an earlier b, with the
reference r = the first token of a: (Q_a ⊙ e^{γ_a − γ_r})(K_b ⊙ e^{γ_r − γ_b})ᵀ, both factors ≤ 1
(j < r ≤ i), as FLA's GLA kernels do; the interpreter runs the exact form above.

Float32 resolves a difference γ_i − γ_j of two cumulative gates near −320 to ~3e-5 (its ulp
there), as it does for a scalar gate of the same strength.

    >>> chunk = derive_chunks(classify(load_spec("specs/kda.py")), chunk_size=64)   # doctest: +SKIP
"""
from __future__ import annotations

from qla_compiler.ir.chunk import ChunkIR
from qla_compiler.ir.chunk_ops import DECAYED_PRODUCT
from qla_compiler.ir.recurrence import RecurrenceIR


def shares_exponentials(ir: ChunkIR, a: str, b: str) -> bool:
    """Two decayed products X ⋆ Z of the same Z and decays R (KDA's q ⋆ k and k ⋆ k): one loop can
    form both, one exponential an element (partition._sharing_exponentials, schedule_build)."""
    x, y = ir.node(a), ir.node(b)
    return a != b and x.op == y.op == "contract" and x.attr["eq"] == y.attr["eq"] == DECAYED_PRODUCT \
        and x.args[1:] == y.args[1:]


def sum_top(ir: ChunkIR, name: str, within) -> str:
    """The last of the sums a block is added into alone, through nodes in `within` (P_diag →
    P_sum → … → P)."""
    while len(users := [u.name for u in ir.users(name)]) == 1 and users[0] in within \
            and ir.node(users[0]).op == "add":
        name = users[0]
    return name


def derive_per_key_chunks(ir: RecurrenceIR, chunk_size: int, floor: float, coefficient) -> ChunkIR:
    """The chunk program of a classified recurrence whose decay is a per-key gate (`floor`: the
    gate's floor; `coefficient`: builds a per-token scalar coefficient, passes/chunk.py)."""
    st = ir.structure
    p = ChunkIR(ir.name, chunk_size, history=("chunk",))
    kinds = {i.name: i.kind for i in ir.inputs}
    for i in ir.inputs:
        p.add(i.name, "input", name=i.name, kind=i.kind)
    q, k, v = st.query, st.write_key, st.write_value
    S0 = p.add("S0", "state_in")
    scale = p.add("scale", "param", name="scale")

    g = p.add(f"{st.decay_name}_floored", "clamp_min", st.decay_name, min=floor)
    g_cum = p.add("g_cum", "cumsum", g)  # γ, C×K
    R = p.add("R", "exp", p.add("g_diff", "masked_diff", g_cum, mask="lower"))  # C×C×K, j ≤ i
    Gam = p.add("Gamma", "exp", g_cum)  # Γ = e^γ ≤ 1, C×K
    g_last = p.add("g_last", "last", g_cum)  # γ_C, K

    b = coefficient(p, st.write_coeff, kinds, "b")
    bv = p.add("bv", "scale_rows", b, v) if b else v
    if st.delta:
        s = coefficient(p, st.delta_coeff, kinds, "s")
        kk = p.add("KKt_R", "contract", k, k, R, eq=DECAYED_PRODUCT)
        A = p.add("A", "tril", p.add("sKKt_R", "scale_rows", s, kk) if s else kk, strict=True)
        T = p.add("T", "inv_unit_lower", A)
        kG = p.add("k_Gamma", "mul", k, Gam)
        W = p.add("W", "matmul", T, p.add("sGk", "scale_rows", s, kG) if s else kG)
        U = p.add("U", "matmul", T, bv)
        v_new = p.add("v_new", "sub", U, p.add("WS", "matmul", W, S0))
    else:
        v_new = bv

    o_inter = p.add("o_inter", "matmul", p.add("q_Gamma", "mul", q, Gam), S0)
    P = p.add("P", "contract", q, k, R, eq=DECAYED_PRODUCT)
    o_sum = p.add("o_sum", "add", o_inter, p.add("o_intra", "matmul", P, v_new))
    c = coefficient(p, st.output_coeff, kinds, "c")
    o = p.add("o", "mul", scale, p.add("co", "scale_rows", c, o_sum) if c else o_sum)

    decay_to_end = p.add("decay_to_end", "exp", p.add("g_to_end", "sub", g_last, g_cum))  # C×K
    S_decayed = p.add("S_decayed", "scale_rows", p.add("Gamma_C", "exp", g_last), S0)
    k_dec = p.add("k_decayed", "mul", decay_to_end, k)
    S_next = p.add("S_next", "add", S_decayed, p.add("S_update", "matmul", k_dec, v_new, ta=True))
    p.outputs, p.next_state = {"o": o}, S_next
    p.remove_dead()
    p.verify()
    return p
