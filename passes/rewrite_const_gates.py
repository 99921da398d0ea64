"""fold_constant_gates: what a missing or per-head constant gate makes of the chunk program.

No gate (g ≡ 0): γ = 0, so R is the causal mask, Γ = 1, and every exponential folds away.
A per-head constant log-decay l: γ = cumsum(l·valid) = l·positions, so the decay pattern depends on
the head and the chunk length only, never on data (no cumsum, nothing loaded).

Rules, tinygrad-style: (op, fn) where fn returns a replacement node name or None to decline; run
to a fixed point.
"""
from __future__ import annotations

import math

import sympy as sp

from qla_compiler.ir.chunk import ChunkIR

from .rewrite import Rewrite, arg, const_value, is_op, lower_tri


def _const(ir, n, value):
    return ir.add(f"{n.name}'", "const", value=float(value), shape=n.shape)


def _fold_cumsum(ir, n):
    x = arg(ir, n, 0)
    if const_value(x) == 0.0:  # cumsum 0 -> 0
        return _const(ir, n, 0.0)
    if is_op(x, "mul"):  # cumsum(l·valid) -> l·positions
        a, b = arg(ir, x, 0), arg(ir, x, 1)
        if is_op(b, "valid") and a.shape == ():
            return ir.add(f"{n.name}'", "mul", a.name, ir.add("positions", "positions"))
    return None


def _fold_exp(ir, n):
    x = arg(ir, n, 0)
    if x.op == "const":  # exp c -> e^c
        return _const(ir, n, math.exp(x.attr["value"]))
    if is_op(x, "masked_diff") and arg(ir, x, 0).op == "const":  # exp(c_i - c_j) masked -> causal mask
        return ir.add(f"{n.name}'", "causal_mask", mask=x.attr["mask"])
    return None


def _fold_unary_const(ir, n):  # last c -> c
    x = arg(ir, n, 0)
    return _const(ir, n, x.attr["value"]) if x.op == "const" else None


def _fold_sub(ir, n):  # a - b on constants
    a, b = arg(ir, n, 0), arg(ir, n, 1)
    if a.op == "const" and b.op == "const":
        return _const(ir, n, a.attr["value"] - b.attr["value"])
    return None


def _drop_ones(ir, n):  # 1·x -> x, diag(1)·X -> X (only where the shape is unchanged)
    for i, j in ((0, 1), (1, 0)):
        c, x = arg(ir, n, i), arg(ir, n, j)
        if const_value(c) == 1.0 and x.shape == n.shape:
            return x.name
    return None


def _drop_mask_under_tril(ir, n):  # StrictLower(X ⊙ causal) -> StrictLower(X)
    x = arg(ir, n, 0)
    if n.attr.get("strict") and is_op(x, "mul"):
        for i, j in ((0, 1), (1, 0)):
            if is_op(arg(ir, x, i), "causal_mask"):
                return ir.add(f"{n.name}'", "tril", x.args[j], strict=True)
    return None


RULES = {
    "cumsum": _fold_cumsum,
    "exp": _fold_exp,
    "last": _fold_unary_const,
    "sub": _fold_sub,
    "mul": _drop_ones,
    "scale_rows": _drop_ones,
    "tril": _drop_mask_under_tril,
}


def _apply(ir: ChunkIR) -> None:
    changed = True
    while changed:
        changed = False
        for n in ir.order():
            rule = RULES.get(n.op)
            new = rule(ir, n) if rule and n.name in ir.graph else None
            if new is not None and new != n.name:
                ir.replace_uses(n.name, new)
                ir.remove_dead()
                changed = True
                break


def _proof():
    """Both folds, for a symbolic per-head log-decay l and every chunk length n of a C = 4 chunk:
    cumsum(l·valid)_i = l·min(i + 1, n) (the constant gate), and with it the ratio mask
    exp(γ_i − γ_j) = exp(l·(min(i+1, n) − min(j+1, n))), which at l = 0 is the causal mask."""
    C, l = 4, sp.Symbol("l", nonpositive=True)
    lhs, rhs = [], []
    for n in range(1, C + 1):
        valid = [1 if i < n else 0 for i in range(C)]
        cum = [sum(l * valid[j] for j in range(i + 1)) for i in range(C)]
        pos = [l * min(i + 1, n) for i in range(C)]
        lhs += cum + list(lower_tri(C, lambda i, j: sp.exp(cum[i] - cum[j])).subs(l, 0))
        rhs += pos + list(lower_tri(C, lambda i, j: 1))
    return sp.Matrix(lhs), sp.Matrix(rhs)


FOLD_CONSTANT_GATES = Rewrite(
    "fold_constant_gates", "g ≡ 0: R = causal mask, Γ = 1;  cumsum(l·valid) = l·positions", _apply, _proof)
