"""scale_on_left_columns: T·(diag(d)X) = (T·diag(d))·X, a row scaling of a product's right operand
moved onto its left operand's columns.

Where the left operand is a C×C block and the right one a wider input block (GDN's backward
W = T·diag(βΓ)K with T = T_r ⊙ R), the scaling joins the pass that forms T (C×C elements) instead
of a pass over the input's K columns, and the input reaches the tensor cores as it was loaded: no
scaled C×K copy in shared memory. Both forms round one scaled operand to the io dtype once (T·diag(d)
or diag(d)X), so the error does not change in kind.

It shapes kernels: the backward's whole-V scan that forms W itself (partition's scan products on
the kept inverse) runs it, where the 16 KB C×K copy would not fit beside its rings
(Program.backward_wide_roles_program).
"""
from __future__ import annotations

import sympy as sp

from qla_compiler.ir.chunk import ChunkIR

from .rewrite import Rewrite, arg, is_op


def _apply(ir: ChunkIR) -> None:
    for mm in ir.of_op("matmul"):
        if mm.attr.get("ta") or mm.attr.get("tb"):
            continue  # (transposed, the scaling would fall on the other index of the stored block)
        left, right = arg(ir, mm, 0), arg(ir, mm, 1)
        if left.shape != ("C", "C") or not is_op(right, "scale_rows"):
            continue
        d, x = right.args
        if ir.node(x).op != "input" or ir.node(x).shape[1:] == ("C",):
            continue  # a computed operand is formed in shared memory anyway; a C×C one saves nothing
        scaled = ir.add(f"{left.name}_{d}", "scale_cols", left.name, d)
        product = ir.add(f"{mm.name}'", "matmul", scaled, x, **mm.attr)
        ir.replace_uses(mm.name, product)
        ir.take_place(mm.name, [scaled, product])


def _proof():
    C = 3
    d = sp.diag(*sp.symbols(f"d0:{C}"))
    T, X = sp.Matrix(C, C, sp.symbols(f"t0:{C * C}")), sp.Matrix(C, 2, sp.symbols("x0:6"))
    return T * (d * X), (T * d) * X


SCALE_ON_LEFT_COLUMNS = Rewrite("scale_on_left_columns",
                                "T·(diag(d)X) = (T·diag(d))·X: a C×C operand's columns take the scaling",
                                _apply, _proof, shapes_kernels=True)
