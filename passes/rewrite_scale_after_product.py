"""scale_after_product: (diag(d)X)·Y = diag(d)(X·Y) and (sX)·Y = s(X·Y), the scaling on the product.

A matmul's operands reach the tensor cores in the io dtype (bf16 or fp16), its product is fp32. A
scaled operand is rounded once more after its scaling: the backward's d_q.QS = diag(Γ)·(scale·dO)·S₀ᵀ
rounds Γ·scale·dO to bf16 where dO itself is exact, which put d q's error at 1.13–1.16× FLA's with
grouped heads on the H200 (session 9; FLA scales dO·hᵀ in fp32). Scaling the fp32 product instead
costs one multiply per result element, where the scaled operand cost one per operand element.

Row scalings move only off the result's rows: those of the left operand of a matmul not transposed
there. Along the contracted rows (Xᵀ·Y with X scaled) they cannot leave the product; a scalar always
can. Only an operand that is the program's input moves: one computed in float32 is rounded to the io
dtype for the tensor cores either way, and moving its scaling would gain nothing.

On the state chain a product summed into the state keeps its form: the scan accumulates it onto
the state's registers, and where its decay goes is decided by what it costs the chain
(decay_value_side). The pipeline's form (SCALE_AFTER_PRODUCT) leaves every chain product as it is:
its scans ran on the H200 in that form. The fused forward's (SCALE_AFTER_PRODUCT_ON_CHAIN,
Program.fused_program, after fold_wy) also moves the scaling of a chain product that is not summed
into the state, which shortens the chain: kS = (diag(βΓ)K)·S₀ scaled its C×K operand, a pass over
K columns with an exponential per element, where the product is only a V-block wide and its row
scaling joins the pass that forms v_resid = diag(β)V − kS anyway. (The backward scan of the
key-side form, (diag(d)K)·dS, is the same case; not moved until a GPU run measures it.) It shapes
kernels (the backward is the VJP of the program before it); the pipeline's forward of the delta
rule has no such product, so only the backward changes there.
"""
from __future__ import annotations

import sympy as sp

from qla_compiler.ir.chunk import ChunkIR

from .rewrite import Rewrite, is_op


def _peel(ir: ChunkIR, name: str, rows: bool):
    """`name` as (op, scaling) layers, outermost first, and the operand under them: scalars always,
    row scalings when `rows` (the operand's rows are the product's)."""
    layers = []
    while True:
        n = ir.node(name)
        if is_op(n, "mul"):
            a, b = (ir.node(x) for x in n.args)
            scalar, rest = (b, a) if b.shape == () else (a, b)
            if scalar.shape != () or rest.shape == ():
                return layers, name
            layers.append(("mul", scalar.name))
            name = rest.name
        elif rows and is_op(n, "scale_rows"):
            layers.append(("scale_rows", n.args[0]))
            name = n.args[1]
        else:
            return layers, name


def _summed_into_state(ir: ChunkIR, name: str) -> bool:
    """`name` reaches the next state through sums alone: the scan accumulates it in the state's
    registers, wgmma onto wgmma, which a scaled product would break."""
    if name == ir.next_state:
        return True
    return any(u.op == "add" and _summed_into_state(ir, u.name) for u in ir.users(name))


def _apply(ir: ChunkIR, on_chain: bool = False) -> None:
    chain = set() if on_chain else ir.scan_nodes()
    for mm in ir.of_op("matmul"):
        if mm.name in chain or _summed_into_state(ir, mm.name):
            continue  # the state's own update: its form is decay_value_side's choice, by its latency
        args, layers = list(mm.args), []
        for i in (0, 1):
            peeled, base = _peel(ir, args[i], rows=i == 0 and not mm.attr.get("ta"))
            if peeled and ir.node(base).op == "input":  # else the operand is rounded to io anyway
                layers, args[i] = layers + peeled, base
        if not layers:
            continue
        product = ir.add(f"{mm.name}_unscaled", "matmul", *args, **mm.attr)
        created = [product]
        for k, (op, scaling) in enumerate(reversed(layers)):  # innermost first
            name = f"{mm.name}'" if k == len(layers) - 1 else f"{mm.name}_scaled"
            created.append(ir.add(name, "scale_rows", scaling, created[-1]) if op == "scale_rows"
                           else ir.add(name, "mul", created[-1], scaling))
        ir.replace_uses(mm.name, created[-1])
        ir.take_place(mm.name, created)


def _proof():
    C = 3
    d, s = sp.diag(*sp.symbols(f"d0:{C}")), sp.Symbol("s")
    X, Y = sp.Matrix(C, 2, sp.symbols("x0:6")), sp.Matrix(2, 2, sp.symbols("y0:4"))
    Z = sp.Matrix(C, 2, sp.symbols("z0:6"))
    # the three moves at once, as the blocks of a block-diagonal matrix
    return (sp.diag((d * X) * Y, (s * X) * Y, (s * Z).T * X),
            sp.diag(d * (X * Y), s * (X * Y), s * (Z.T * X)))


SCALE_AFTER_PRODUCT = Rewrite("scale_after_product",
                              "(diag(d)X)Y = diag(d)(XY), (sX)Y = s(XY): scalings act on the fp32 product",
                              _apply, _proof, shapes_kernels=True)
SCALE_AFTER_PRODUCT_ON_CHAIN = Rewrite("scale_after_product_on_chain",
                                       "the same, also on the state chain's products not summed into the state",
                                       lambda ir: _apply(ir, on_chain=True), _proof, shapes_kernels=True)
