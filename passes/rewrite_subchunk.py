"""subchunk_decay: a per-key gate's decayed product as matmuls, with no e^{−γ} and no C×C×K block.

    (X ⋆ Z)_ij = Σ_k X_ik Z_jk e^{γ_ik − γ_jk}   (j ≤ i; passes/chunk_per_key.py)

Cut the chunk into sub-chunks of B tokens, a = 0 … C/B − 1, and let r_a = aB − 1 be the last
token before sub-chunk a. For i in sub-chunk a and j ≤ r_a (an earlier sub-chunk)

    e^{γ_ik − γ_jk} = e^{γ_ik − γ_{r_a k}} · e^{γ_{r_a k} − γ_jk},   both exponents ≤ 0,

so the block of rows a against every earlier column is one plain matmul,
(X ⊙ E_a)(Z ⊙ F_a)ᵀ with E_a = e^{γ − γ_{r_a}} on a's rows and F_a = e^{γ_{r_a} − γ} on the rows
up to r_a (both 0 elsewhere: `ref_diff` is −inf there). The rows of different sub-chunks are
disjoint, so

    X ⋆ Z = Σ_{a ≥ 1} (X ⊙ E_a)(Z ⊙ F_a)ᵀ + (X ⋆ Z restricted to the diagonal sub-blocks)

and only the diagonal blocks keep the per-key decay inside the sum (`masked_diff[block=B]`):
C·B·K/2 exponentials a chunk instead of C·C·K/2, and C/B − 1 matmuls the tensor cores run.
A single reference for the whole chunk would need e^{γ_r − γ_j} for j after r: e^{+320} over 64
tokens at g = −5 a key, past float32's e^{88}; verify_exponents proves every factor here ≤ 1.
A factor that underflows to 0 does so only where the product it belongs to is below float32's
range too (the other factor is ≤ 1).

The VJP's two products of the same R take the same factors, each in one accumulator:
d P ⋆_rows Z (Σ_{j≤i} d P_ij Z_jk R_ijk, d X) = E ⊙ Σ_a (d P on a's rows)(Z ⊙ F_a), since the E_a
have disjoint rows (E = Σ_a E_a); d P ⋆_cols X (Σ_{i≥j} d P_ij X_ik R_ijk, d Z) takes each column
block b's reference at its end, r = (b + 1)B − 1: G ⊙ Σ_b (d P on b's columns)ᵀ (X ⊙ E'_b), with
G_b = e^{γ_r − γ} on b's rows (disjoint) and E'_b = e^{γ − γ_r} on every row after r. Each plus its
diagonal sub-blocks. (Scaled per term instead, the backward's d g kernel kept six C×K fragments
alive and spilled: benchmarks/NOTES.md, session 24.)

B = 16: the diagonal blocks' element-wise work and the C/B − 1 matmuls balance there, and 16 rows
is the tensor cores' smallest tile. The rewrite shapes kernels: the backward is the VJP of the
program before it (the VJP of one contract is three, each with its own form; passes/pipeline.py).

    >>> from qla_compiler import compile_spec
    >>> [n.name for n in compile_spec("gla").chunk.of_op("ref_diff")][:2]
    ['g_cum_log2_after_15', 'g_cum_log2_upto_15']
"""
from __future__ import annotations

import sympy as sp

from qla_compiler.ir.chunk import ChunkIR
from qla_compiler.ir.chunk_ops import COLS_PRODUCT, DECAYED_PRODUCT, EXPONENTIALS, ROWS_PRODUCT

from .rewrite import Rewrite, add_once, arg, is_op

SUBCHUNK = 16  # tokens a sub-chunk (B)


FORMS = (DECAYED_PRODUCT, ROWS_PRODUCT, COLS_PRODUCT)  # the decayed products with a sub-chunk form


def _decayed_product(ir: ChunkIR, n) -> tuple | None:
    """(its two block arguments, exponential op, γ) of a whole-chunk decayed product, else None."""
    if n.op != "contract" or n.attr["eq"] not in FORMS:
        return None
    R = arg(ir, n, 2)
    if R.op not in EXPONENTIALS:
        return None
    diff = arg(ir, R, 0)
    if not is_op(diff, "masked_diff", mask="lower") or diff.attr.get("block") or diff.shape != ("C", "C", "K"):
        return None
    return n.args[0], n.args[1], R.op, diff.args[0]


def _apply(ir: ChunkIR) -> None:
    C = ir.chunk_size
    B = min(SUBCHUNK, C)
    for n in list(ir.of_op("contract")):
        found = _decayed_product(ir, n)
        if found is None:
            continue
        X, Z, exp, g = found
        eq = n.attr["eq"]
        created = []

        def add(name, op, *args, **attrs):  # (KDA's products share their factors)
            return add_once(ir, created, name, op, *args, **attrs)

        diag_R = add(f"{n.args[2]}_diag", exp, add(f"{g}_diff_diag", "masked_diff", g, mask="lower", block=B))
        total = add(f"{n.name}_diag", "contract", X, Z, diag_R, eq=eq)

        def factor(ref, lo, hi, later):
            side = "after" if later else "upto"
            return add(f"decay_{side}_{ref}", exp, add(f"{g}_{side}_{ref}", "ref_diff", g, ref=ref, lo=lo, hi=hi,
                                                       later=later))

        if eq == DECAYED_PRODUCT:  # Σ_a (X ⊙ E_a)(Z ⊙ F_a)ᵀ, one accumulator
            for a in range(1, C // B):
                ref = a * B - 1
                rows = add(f"{X}_after_{ref}", "mul", X, factor(ref, a * B, (a + 1) * B, True))
                cols = add(f"{Z}_upto_{ref}", "mul", Z, factor(ref, 0, a * B, False))
                total = add(f"{n.name}_sum", "add", add(f"{n.name}_{a}", "matmul", rows, cols, tb=True), total)
        else:
            # d P ⋆_rows Z: rows i of sub-chunk a (r = aB − 1), E_a ⊙ ((d P on a's rows)(Z ⊙ F_a)); the
            # E_a have disjoint rows, so Σ_a E_a ⊙ W_a = E ⊙ Σ_a W_a: one accumulator, scaled once.
            # d P ⋆_cols X: columns j of sub-chunk b against every later row, with the reference
            # at b's end (r = (b + 1)B − 1): G_b ⊙ ((d P on b's columns)ᵀ(X ⊙ E'_b)), G_b's rows disjoint
            rows_form = eq == ROWS_PRODUCT
            scale, acc = None, None
            for a in (range(1, C // B) if rows_form else range(C // B - 1)):
                lo, hi = (a * B, (a + 1) * B)
                ref = a * B - 1 if rows_form else hi - 1
                own = factor(ref, lo, hi, True) if rows_form else factor(ref, lo, hi, False)  # a's own rows
                other = factor(ref, 0, lo, False) if rows_form else factor(ref, hi, C, True)
                blocked = add(f"{X}_{'rows' if rows_form else 'cols'}_{lo}", "keep", X, dim=0 if rows_form else 1,
                              lo=lo, hi=hi)
                product = add(f"{n.name}_{a}_undecayed", "matmul", blocked, add(f"{Z}_by_{ref}", "mul", Z, other),
                              ta=not rows_form)
                acc = product if acc is None else add(f"{n.name}_undecayed_sum", "add", product, acc)
                scale = own if scale is None else add(f"{n.name}_decay", "add", scale, own)
            total = add(f"{n.name}_sum", "add", add(f"{n.name}_off_diag", "mul", scale, acc), total)
        ir.replace_uses(n.name, total)
        ir.take_place(n.name, created)


def _split(X, Z, G, B):
    """X ⋆ Z's right-hand side, built as _apply builds it, on sympy blocks (C×K)."""
    C, K = X.shape
    E = sp.exp
    diag = sp.Matrix(C, C, lambda i, j: sum(X[i, k] * Z[j, k] * E(G[i, k] - G[j, k]) for k in range(K))
                     if j <= i and i // B == j // B else 0)
    out = diag
    for a in range(1, C // B):
        rows, cols = _factors(G, B, a)
        out = out + X.multiply_elementwise(rows) * Z.multiply_elementwise(cols).T
    return out


def _factors(G, B, a):
    """E_a (e^{γ − γ_r} on a's rows) and F_a (e^{γ_r − γ} on the rows before a), r = aB − 1."""
    C, K = G.shape
    r = a * B - 1
    rows = sp.Matrix(C, K, lambda i, k: sp.exp(G[i, k] - G[r, k]) if a * B <= i < (a + 1) * B else 0)
    cols = sp.Matrix(C, K, lambda j, k: sp.exp(G[r, k] - G[j, k]) if j < a * B else 0)
    return rows, cols


def _proof():
    """X ⋆ Z, d P ⋆ Z (rows' form) and d Pᵀ ⋆ X (columns'), each against its sub-chunk form, as
    three blocks of one block-diagonal matrix."""
    C, K, B = 6, 1, 2  # three sub-chunks: the disjoint rows summed, the nested ones not
    X, Z, G = (sp.Matrix(C, K, sp.symbols(f"{s}0:{C * K}")) for s in "xzg")
    W = sp.Matrix(C, C, sp.symbols(f"w0:{C * C}"))
    R = {(i, j, k): sp.exp(G[i, k] - G[j, k]) if j <= i else 0 for i in range(C) for j in range(C) for k in range(K)}

    def same_block(i, j):
        return i // B == j // B

    lhs_p = sp.Matrix(C, C, lambda i, j: sum(X[i, k] * Z[j, k] * R[i, j, k] for k in range(K)))
    lhs_r = sp.Matrix(C, K, lambda i, k: sum(W[i, j] * Z[j, k] * R[i, j, k] for j in range(C)))
    lhs_c = sp.Matrix(C, K, lambda j, k: sum(W[i, j] * X[i, k] * R[i, j, k] for i in range(C)))
    rhs_r = sp.Matrix(C, K, lambda i, k: sum(W[i, j] * Z[j, k] * R[i, j, k] for j in range(C) if same_block(i, j)))
    rhs_c = sp.Matrix(C, K, lambda j, k: sum(W[i, j] * X[i, k] * R[i, j, k] for i in range(C) if same_block(i, j)))
    scale_r, acc_r = sp.zeros(C, K), sp.zeros(C, K)
    for a in range(1, C // B):
        rows, cols = _factors(G, B, a)
        keep = sp.Matrix(C, C, lambda i, j: W[i, j] if a * B <= i < (a + 1) * B else 0)
        acc_r += keep * Z.multiply_elementwise(cols)
        scale_r += rows
    rhs_r += scale_r.multiply_elementwise(acc_r)
    scale_c, acc_c = sp.zeros(C, K), sp.zeros(C, K)
    for b in range(C // B - 1):
        r = (b + 1) * B - 1
        own = sp.Matrix(C, K, lambda j, k: sp.exp(G[r, k] - G[j, k]) if b * B <= j < (b + 1) * B else 0)
        later = sp.Matrix(C, K, lambda i, k: sp.exp(G[i, k] - G[r, k]) if i > r else 0)
        keep = sp.Matrix(C, C, lambda i, j: W[i, j] if b * B <= j < (b + 1) * B else 0)
        acc_c += keep.T * X.multiply_elementwise(later)
        scale_c += own
    rhs_c += scale_c.multiply_elementwise(acc_c)
    lhs = sp.diag(lhs_p, lhs_r, lhs_c)
    rhs = sp.diag(_split(X, Z, G, B), rhs_r, rhs_c)
    return lhs, rhs.applyfunc(sp.powsimp)


SUBCHUNK_DECAY = Rewrite("subchunk_decay",
                         "X ⋆ Z = Σ_a (X ⊙ e^{γ−γ_{r_a}})(Z ⊙ e^{γ_{r_a}−γ})ᵀ + the diagonal sub-blocks' X ⋆ Z "
                         "(and its VJP's d P ⋆ Z, d Pᵀ ⋆ X likewise)",
                         _apply, _proof, shapes_kernels=True)
