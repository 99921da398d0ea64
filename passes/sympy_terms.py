"""Reading sympy matrix expressions as sums of products: the vocabulary of the frontend and classify.

A term is a scalar coefficient times an ordered product of matrix atoms (symbols, their transposes,
the identity). Everything the recurrence family needs is a sum of such terms once expanded.
"""
from __future__ import annotations

import sympy as sp
from sympy.matrices.expressions.matexpr import MatrixExpr

from qla_compiler.spec import DiagExp

# the matrix atoms a term is a product of
ATOMS = (sp.MatrixSymbol, sp.Identity, DiagExp)

Term = tuple[sp.Expr, tuple]  # (scalar coefficient, matrix factors left to right)


class NotATerm(ValueError):
    """An operation outside sums of products (an inverse, a power, a function of a matrix...)."""


def shape(expr) -> tuple:
    """The shape of a matrix expression, checking every product and sum (sympy does not for
    symbolic dimensions). Raises ValueError naming the mismatch."""
    if isinstance(expr, ATOMS):
        return expr.shape
    if isinstance(expr, sp.Transpose):
        r, c = shape(expr.arg)
        return (c, r)
    if isinstance(expr, sp.MatMul):
        mats = [a for a in expr.args if isinstance(a, MatrixExpr)]
        cur = shape(mats[0])
        for m in mats[1:]:
            nxt = shape(m)
            if cur[1] != nxt[0]:
                raise ValueError(f"shape mismatch in product: [{cur[0]}×{cur[1]}] · [{nxt[0]}×{nxt[1]}] "
                                 f"in {_s(expr)}")
            cur = (cur[0], nxt[1])
        return cur
    if isinstance(expr, sp.MatAdd):
        shapes = [shape(a) for a in expr.args]
        if len(set(shapes)) > 1:
            got = ", ".join(f"[{r}×{c}]" for r, c in shapes)
            raise ValueError(f"shape mismatch in sum: {got} in {_s(expr)}")
        return shapes[0]
    if isinstance(expr, MatrixExpr):
        raise NotATerm(_unsupported(expr))
    raise ValueError(f"expected a matrix expression, got the scalar {_s(expr)}")


def terms(expr) -> list[Term]:
    """Expand into a list of (coefficient, factors)."""
    shape(expr)
    expanded = sp.expand(expr) if isinstance(expr, MatrixExpr) else expr
    parts = expanded.args if isinstance(expanded, sp.MatAdd) else (expanded,)
    out = []
    for p in parts:
        if isinstance(p, sp.MatMul):
            coeff, mats = p.as_coeff_mmul()
            factors = tuple(a for m in (mats.args if isinstance(mats, sp.MatMul) else (mats,))
                            for a in ([m] if not isinstance(m, sp.MatMul) else m.args))
        else:
            coeff, factors = sp.Integer(1), (p,)
        for f in factors:
            if not isinstance(f, (*ATOMS, sp.Transpose)) or (
                    isinstance(f, sp.Transpose) and not isinstance(f.arg, sp.MatrixSymbol)):
                raise NotATerm(_unsupported(f))
        out.append((sp.sympify(coeff), tuple(f for f in factors if not isinstance(f, sp.Identity))))
    return out


def count(factors: tuple, symbol: sp.MatrixSymbol) -> int:
    """How often `symbol` (or its transpose) occurs among the factors of a term."""
    return sum(1 for f in factors if f == symbol or f == symbol.T)


def _unsupported(expr) -> str:
    msg = f"unsupported matrix operation {type(expr).__name__}: {_s(expr)}"
    if isinstance(expr, (sp.DiagMatrix, sp.DiagonalMatrix, sp.HadamardProduct)):
        msg += ("; a diagonal decay is written exp(g) with a per-key gate g = gate('g', per='key') "
                "(exp(g) is Diag(e^g))")
    return msg


def _s(expr) -> str:
    return str(expr).replace(".T", "ᵀ")
