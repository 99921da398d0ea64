"""gate_out_of_inverse: (I + StrictLower(X ⊙ R))⁻¹ = R ⊙ (I + StrictLower(X))⁻¹.

R ⊙ Y = D Y D⁻¹ with D = diag(e^γ), so the gated system is a similarity transform of the gate-free
one. T_r then depends on β and K only: one exponential-free kernel computes it, and the backward
pass reuses it. The D·D⁻¹ factorisation is only the proof; the program keeps R (masked
differences), since e^{−γ} alone overflows.
"""
from __future__ import annotations

import sympy as sp

from qla_compiler.ir.chunk import ChunkIR

from .rewrite import Rewrite, arg, is_op, is_ratio_mask, lower_tri, strict_lower


def _apply(ir: ChunkIR) -> None:
    for T in ir.of_op("inv_unit_lower"):
        A = arg(ir, T, 0)
        if not is_op(A, "tril", strict=True):
            continue
        XR = arg(ir, A, 0)
        if not is_op(XR, "mul"):
            continue
        x, r = XR.args if is_ratio_mask(ir, arg(ir, XR, 1)) else XR.args[::-1]
        if not is_ratio_mask(ir, ir.node(r)):
            continue
        T_r = ir.add("T_r", "inv_unit_lower", ir.add("A_r", "tril", x, strict=True))
        ir.replace_uses(T.name, ir.add(T.name + "'", "mul", T_r, r))


def _proof():
    C = 3
    g = sp.symbols(f"gamma0:{C}", real=True)
    X = sp.Matrix(C, C, lambda i, j: sp.Symbol(f"x{i}{j}"))
    R = lower_tri(C, lambda i, j: sp.exp(g[i] - g[j]))
    lhs = (sp.eye(C) + strict_lower(X.multiply_elementwise(R))).inv()
    rhs = R.multiply_elementwise((sp.eye(C) + strict_lower(X)).inv())
    return lhs, rhs


GATE_OUT_OF_INVERSE = Rewrite(
    "gate_out_of_inverse", "(I + StrictLower(X ⊙ R))⁻¹ = R ⊙ T_r,  T_r = (I + StrictLower(X))⁻¹",
    _apply, _proof)
