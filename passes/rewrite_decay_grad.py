"""decay_grad_by_products: a per-key gate's d γ through R without its C×C×K block.

The VJP of X ⋆ Z = Σ_k X_ik Z_jk R_ijk (R_ijk = e^{γ_ik − γ_jk}, j ≤ i) reaches γ through
d R_ijk = d P_ij X_ik Z_jk, a C×C×K block, then masked_diff's transpose: row sums minus column sums
of StrictLower(d R ⊙ R) (times ln 2 in exp2 form). Each sum is one of the products the VJP forms
anyway:

    Σ_{j<i} d P_ij X_ik Z_jk R_ijk = X_ik (d P ⋆_rows Z)_ik − d P_ii X_ik Z_ik
    Σ_{i>j} d P_ij X_ik Z_jk R_ijk = Z_jk (d P ⋆_cols X)_jk − d P_jj X_jk Z_jk

with d P ⋆_rows Z = Σ_{j≤i} d P_ij Z_jk R_ijk (= d X) and d P ⋆_cols X = Σ_{i≥j} d P_ij X_ik R_ijk
(= d Z): the diagonal terms (R_iik = 1) are equal and cancel in the difference, so

    rowsum − colsum = X ⊙ (d P ⋆_rows Z) − Z ⊙ (d P ⋆_cols X),

the gradient GLA's authors give, here derived: no C×C×K block is left (d R, d g_diff and the
whole-chunk R die), and the two products go on to subchunk_decay's forms (passes/rewrite_subchunk.py).
KDA's two products (Q ⋆ K and K ⋆ K) sum their d R first: the rewrite takes any sum of them, with
scalar factors (ln 2).

It shapes kernels (the backward is the VJP of the program before it).

    >>> from qla_compiler import compile_spec
    >>> [n.name for n in compile_spec("gla").backward.order() if n.shape == ("C", "C", "K")]
    ['g_cum_log2_diff_diag', 'R_diag']
"""
from __future__ import annotations

import sympy as sp

from qla_compiler.ir.chunk import ChunkIR
from qla_compiler.ir.chunk_ops import COLS_PRODUCT, EXPONENTIALS, ROWS_PRODUCT

from .rewrite import Rewrite, add_once, arg, is_op

D_R = "ij,ik,jk->ijk"  # d R_ijk = d P_ij X_ik Z_jk


def _terms(ir: ChunkIR, name: str):
    """d R as a sum of ([scalar factors], d R product) terms, or None if it is anything else."""
    n = ir.node(name)
    if is_op(n, "contract", eq=D_R):
        return [([], name)]
    if n.op == "add":
        parts = [_terms(ir, a) for a in n.args]
        return None if None in parts else parts[0] + parts[1]
    if n.op == "mul":
        scalars = [a for a in n.args if ir.node(a).shape == ()]
        blocks = [a for a in n.args if a not in scalars]
        if len(scalars) == 1 and len(blocks) == 1 and (inner := _terms(ir, blocks[0])) is not None:
            return [(factors + scalars, t) for factors, t in inner]
    return None


def _ratio(ir: ChunkIR, name: str) -> bool:
    """R = exp(masked_diff[lower] γ) over the whole chunk (C×C×K)."""
    n = ir.node(name)
    return n.op in EXPONENTIALS and n.shape == ("C", "C", "K") and \
        is_op(arg(ir, n, 0), "masked_diff", mask="lower") and not arg(ir, n, 0).attr.get("block")


def _match(ir: ChunkIR, n):
    """(d R's terms, R) of rowsum(M) − colsum(M), M = StrictLower(d R ⊙ R), else None."""
    if n.op != "sub":
        return None
    rows, cols = (ir.node(a) for a in n.args)
    if not (rows.op == "rowsum" and cols.op == "colsum" and rows.args == cols.args):
        return None
    masked = arg(ir, rows, 0)
    if not is_op(masked, "tril", strict=True) or masked.shape != ("C", "C", "K"):
        return None
    prod = arg(ir, masked, 0)
    if prod.op != "mul":
        return None
    for R, dR in (prod.args, prod.args[::-1]):
        if _ratio(ir, R) and (terms := _terms(ir, dR)) is not None:
            return terms, R
    return None


def _apply(ir: ChunkIR) -> None:
    for n in list(ir.of_op("sub")):
        found = _match(ir, n)
        if found is None:
            continue
        terms, R = found
        created, total = [], None
        for factors, t in terms:
            W, X, Z = ir.node(t).args
            by_rows = add_once(ir, created, f"{t}_rows", "contract", W, Z, R, eq=ROWS_PRODUCT)
            by_cols = add_once(ir, created, f"{t}_cols", "contract", W, X, R, eq=COLS_PRODUCT)
            term = add_once(ir, created, f"{n.name}.{t}", "sub", add_once(ir, created, f"{t}_x", "mul", X, by_rows),
                            add_once(ir, created, f"{t}_z", "mul", Z, by_cols))
            for c in factors:
                term = add_once(ir, created, f"{term}_scaled", "mul", term, c)
            total = term if total is None else add_once(ir, created, f"{n.name}_sum", "add", total, term)
        ir.replace_uses(n.name, total)
        ir.take_place(n.name, created)


def _proof():
    C = 3
    g = sp.symbols(f"g0:{C}")
    W = sp.Matrix(C, C, sp.symbols(f"w0:{C * C}"))
    x, z = sp.symbols(f"x0:{C}"), sp.symbols(f"z0:{C}")  # one key: the identity holds key by key
    R = {(i, j): sp.exp(g[i] - g[j]) for i in range(C) for j in range(C) if j <= i}
    masked = {(i, j): W[i, j] * x[i] * z[j] * R[i, j] for (i, j) in R if j < i}
    lhs = sp.Matrix([sum(v for (i, j), v in masked.items() if i == r) - sum(v for (i, j), v in masked.items() if j == r)
                     for r in range(C)])
    rows = [sum(W[i, j] * z[j] * R[i, j] for j in range(C) if j <= i) for i in range(C)]
    cols = [sum(W[i, j] * x[i] * R[i, j] for i in range(C) if j <= i) for j in range(C)]
    rhs = sp.Matrix([x[r] * rows[r] - z[r] * cols[r] for r in range(C)])
    return lhs, rhs


DECAY_GRAD_BY_PRODUCTS = Rewrite(
    "decay_grad_by_products",
    "rowsum − colsum of StrictLower(d R ⊙ R), d R_ijk = d P_ij X_ik Z_jk: X ⊙ (d P ⋆_rows Z) − Z ⊙ (d P ⋆_cols X)",
    _apply, _proof, shapes_kernels=True)
