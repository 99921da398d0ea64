"""factor_scalar: diag(b)V − diag(b·Γ)K S₀ = diag(b)(V − diag(Γ)K S₀), and T·diag(b)·Y = (T·diag(b))·Y.

When the write coefficient and the delta strength are the same per-token scalar (β in DeltaNet and
GDN), β leaves the scan: T·diag(β) is formed once per chunk in the parallel part, and the scan only
computes V − diag(Γ)K S₀ — MATH.md's V_new = (R ⊙ T_r) diag(β)(V − diag(Γ) K S₀).
"""
from __future__ import annotations

import sympy as sp

from qla_compiler.ir.chunk import ChunkIR

from .rewrite import Rewrite, arg, is_op


def _split(ir, n, b):
    """n = diag(b·G)·X or diag(b)·X  ->  (G or None, X); None if n is not of that form."""
    if not is_op(n, "scale_rows"):
        return None
    d, x = n.args
    if d == b:
        return (None, x)
    dn = ir.node(d)
    if is_op(dn, "mul") and b in dn.args:
        return (dn.args[1] if dn.args[0] == b else dn.args[0], x)
    return None


def _apply(ir: ChunkIR) -> None:
    for mm in ir.of_op("matmul"):
        if mm.attr.get("ta") or mm.attr.get("tb"):
            continue
        resid = arg(ir, mm, 1)
        if not is_op(resid, "sub"):
            continue
        bv, kS = arg(ir, resid, 0), arg(ir, resid, 1)
        if not (is_op(bv, "scale_rows") and is_op(kS, "matmul")) or kS.attr:
            continue
        b, v = bv.args
        split = _split(ir, arg(ir, kS, 0), b)
        if split is None:
            continue
        G, k = split
        gk = ir.add("k_Gamma", "scale_rows", G, k) if G else k
        new_resid = ir.add(f"{resid.name}'", "sub", v, ir.add(f"{kS.name}'", "matmul", gk, kS.args[1]))
        Tb = ir.add(f"{mm.args[0]}_{b}", "scale_cols", mm.args[0], b)
        ir.replace_uses(mm.name, ir.add(f"{mm.name}'", "matmul", Tb, new_resid))


def _proof():
    C = 2
    b = sp.diag(*sp.symbols(f"b0:{C}"))
    G = sp.diag(*sp.symbols(f"G0:{C}"))
    T, V = sp.Matrix(C, C, sp.symbols("t0:4")), sp.Matrix(C, 2, sp.symbols("v0:4"))
    K, S = sp.Matrix(C, 2, sp.symbols("k0:4")), sp.Matrix(2, 2, sp.symbols("s0:4"))
    return T * (b * V - (b * G) * K * S), (T * b) * (V - G * K * S)


FACTOR_SCALAR = Rewrite("factor_scalar", "T·(diag(b)V − diag(bΓ)K S₀) = (T·diag(b))·(V − diag(Γ)K S₀)",
                        _apply, _proof)
