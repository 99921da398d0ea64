"""fold_wy: T·B₁ − (T·B₂)·S₀ = T·(B₁ − B₂·S₀).

U = T diag(b) V and W = T diag(sΓ) K are the WY representation of the chunk's updates. Folding
them into v_new = T (diag(b) V − diag(sΓ) K S₀) means neither W nor U crosses memory: the scan
forms the C×V residual and applies T to it.
"""
from __future__ import annotations

import sympy as sp

from qla_compiler.ir.chunk import ChunkIR

from .rewrite import Rewrite, arg, is_op


def _plain_matmul(n) -> bool:
    return is_op(n, "matmul") and not n.attr.get("ta") and not n.attr.get("tb")


def _apply(ir: ChunkIR) -> None:
    for v_new in ir.of_op("sub"):
        U, WS = arg(ir, v_new, 0), arg(ir, v_new, 1)
        if not (_plain_matmul(U) and _plain_matmul(WS)):
            continue
        W = arg(ir, WS, 0)
        if not (_plain_matmul(W) and W.args[0] == U.args[0]):
            continue
        T, b1, b2, S = U.args[0], U.args[1], W.args[1], WS.args[1]
        resid = ir.add("v_resid", "sub", b1, ir.add("kS", "matmul", b2, S))
        ir.replace_uses(v_new.name, ir.add(v_new.name + "'", "matmul", T, resid))


def _proof():
    T, B1 = sp.Matrix(2, 2, sp.symbols("t0:4")), sp.Matrix(2, 3, sp.symbols("u0:6"))
    B2, S = sp.Matrix(2, 2, sp.symbols("w0:4")), sp.Matrix(2, 3, sp.symbols("s0:6"))
    return T * B1 - (T * B2) * S, T * (B1 - B2 * S)


FOLD_WY = Rewrite("fold_wy", "T·U′ − (T·W′)·S₀ = T·(U′ − W′·S₀)  (no W, U tensors)", _apply, _proof)
