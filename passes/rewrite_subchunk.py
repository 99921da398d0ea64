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

The VJP's two products of the same R take the same factors: d P ⋆_rows Z (Σ_{j≤i} d P_ij Z_jk R_ijk,
d X) = Σ_a E_a ⊙ (d P (Z ⊙ F_a)) and d P ⋆_cols X (Σ_{i≥j} d P_ij X_ik R_ijk, d Z) =
Σ_a F_a ⊙ (d Pᵀ (X ⊙ E_a)), each plus its diagonal sub-blocks (E_a's rows are a's alone, F_a's
those before it, so every pair (i, j) below the blocks is counted once, at the a of row i).

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
from qla_compiler.ir.chunk_ops import EXPONENTIALS

from .chunk_per_key import DECAYED_PRODUCT
from .rewrite import Rewrite, add_once, arg, is_op

SUBCHUNK = 16  # tokens a sub-chunk (B)


# the decayed products with a sub-chunk form: X ⋆ Z, and the two a VJP makes of it,
# d X = d P ⋆ Z (the rows' form) and d Z = d Pᵀ ⋆ X (the columns')
ROWS_FORM, COLS_FORM = "ij,jk,ijk->ik", "ij,ik,ijk->jk"
FORMS = (DECAYED_PRODUCT, ROWS_FORM, COLS_FORM)


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
        for a in range(1, C // B):
            ref = a * B - 1
            after = add(f"decay_after_{ref}", exp,
                        add(f"{g}_after_{ref}", "ref_diff", g, ref=ref, lo=a * B, hi=(a + 1) * B, later=True))
            upto = add(f"decay_upto_{ref}", exp,
                       add(f"{g}_upto_{ref}", "ref_diff", g, ref=ref, lo=0, hi=a * B, later=False))
            if eq == DECAYED_PRODUCT:  # (X ⊙ E_a)(Z ⊙ F_a)ᵀ
                rows, cols = add(f"{X}_after_{ref}", "mul", X, after), add(f"{Z}_upto_{ref}", "mul", Z, upto)
                term = add(f"{n.name}_{a}", "matmul", rows, cols, tb=True)
            elif eq == ROWS_FORM:  # E_a ⊙ (d P (Z ⊙ F_a)): rows of a against the columns before it
                cols = add(f"{Z}_upto_{ref}", "mul", Z, upto)
                term = add(f"{n.name}_{a}", "mul", after, add(f"{n.name}_{a}_undecayed", "matmul", X, cols))
            else:  # F_a ⊙ (d Pᵀ (X ⊙ E_a)): the columns before a against its rows
                rows = add(f"{Z}_after_{ref}", "mul", Z, after)
                term = add(f"{n.name}_{a}", "mul", upto, add(f"{n.name}_{a}_undecayed", "matmul", X, rows, ta=True))
            total = add(f"{n.name}_sum", "add", term, total)
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
    C, K, B = 4, 2, 2
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
    for a in range(1, C // B):
        rows, cols = _factors(G, B, a)
        rhs_r += rows.multiply_elementwise(W * Z.multiply_elementwise(cols))
        rhs_c += cols.multiply_elementwise(W.T * X.multiply_elementwise(rows))
    lhs = sp.diag(lhs_p, lhs_r, lhs_c)
    rhs = sp.diag(_split(X, Z, G, B), rhs_r, rhs_c)
    return lhs, rhs.applyfunc(sp.powsimp)


SUBCHUNK_DECAY = Rewrite("subchunk_decay",
                         "X ⋆ Z = Σ_a (X ⊙ e^{γ−γ_{r_a}})(Z ⊙ e^{γ_{r_a}−γ})ᵀ + the diagonal sub-blocks' X ⋆ Z "
                         "(and its VJP's d P ⋆ Z, d Pᵀ ⋆ X likewise)",
                         _apply, _proof, shapes_kernels=True)
