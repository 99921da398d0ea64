"""decay_value_side: the decay to the chunk's end goes on the V-blocked side of a matmul.

    (diag(d)·K)ᵀ·X = Kᵀ·(diag(d)·X)        the forward's state update, X = V_new (C×V)
    (diag(d)·K)·X  = diag(d)·(K·X)         the backward's d V_new = diag(d)·K·d S (X = d S, K×V)

The scans are blocked along V (one CTA per BV-wide slab of the state), so the scaled block is C×BV
per CTA instead of C×K in every CTA, with an exponential each, and the keys reach the matmul as
loaded instead of through a C×K block written to shared memory every chunk.

It shapes kernels (`shapes_kernels`): the backward is the VJP of the program before it
(Program.differentiated), and the rewrite then runs on that VJP too. Differentiating the shaped
forward would put the decay's gradient on the value side, a row sum over V that a V-blocked scan
cannot finish, so the backward scan would store one more C×V block per token; the key-side form's
row sum is over K, inside the matmul the backward's out kernel already has (v_new·d Sᵀ).

It pays only where the V-block is narrow (`_pays`): the runtime runs the program without it at
other shape classes (Program.for_shape).
"""
from __future__ import annotations

import sympy as sp

from qla_compiler.ir.chunk import ChunkIR

from .rewrite import Rewrite, arg, is_op


def _apply(ir: ChunkIR, on_chain: bool = False) -> None:
    chain = ir.chain_nodes() if on_chain else None
    for mm in ir.of_op("matmul"):
        if mm.attr.get("tb") or (chain is not None and mm.name not in chain):
            continue
        scaled, x = arg(ir, mm, 0), arg(ir, mm, 1)
        if not is_op(scaled, "scale_rows") or x.shape[-1] != "V" or scaled.shape[-1] == "V":
            continue
        d, keys = scaled.args
        if mm.attr.get("ta"):  # the decay runs along the contracted rows: it moves onto X
            first = ir.add(f"{x.name}_decayed", "scale_rows", d, x.name)
            new = ir.add(f"{mm.name}'", "matmul", keys, first, ta=True)
        else:  # the decay runs along the result's rows: it scales the C×V product
            first = ir.add(f"{mm.name}_undecayed", "matmul", keys, x.name)
            new = ir.add(f"{mm.name}'", "scale_rows", d, first)
        ir.replace_uses(mm.name, new)
        ir.take_place(mm.name, [first, new])


def _proof():
    C = 3
    d = sp.diag(*sp.symbols(f"d0:{C}"))
    K, X = sp.Matrix(C, 2, sp.symbols("k0:6")), sp.Matrix(C, 2, sp.symbols("x0:6"))
    dS = sp.Matrix(2, 2, sp.symbols("s0:4"))
    # both identities at once, as the two blocks of a block-diagonal matrix
    return sp.diag((d * K).T * X, (d * K) * dS), sp.diag(K.T * (d * X), d * (K * dS))


def _pays(shape) -> bool:
    """Where the V-block is under half the keys' width. The value-side product puts its scaling
    on the chain (after v_new, before the state update), where the key side's could run beside
    it; that pays for the narrower block only when the key side's C×K per CTA is the larger
    cost. On the H200 (session 7) the forward scan was 22-26% faster at BV = 16, 5% at 32, and
    12-16% slower at 64 (K = 128); the backward scan likewise."""
    return 2 * shape.BV < shape.K


DECAY_VALUE_SIDE = Rewrite("decay_value_side",
                           "(diag(d)K)ᵀX = Kᵀ(diag(d)X), (diag(d)K)X = diag(d)(KX): the decay on the V-blocked side",
                           _apply, _proof, shapes_kernels=True, pays=_pays)
# The chain's products alone (the backward's scan on roles at V-block 128,
# Program.backward_wide_roles_program): there a C×K block of decayed keys would be a shared buffer
# the budget has no room for, and the decay on the product's C×V result stays in registers; the
# out kernel's products keep the form the runtime picked for the V-block.
DECAY_VALUE_SIDE_ON_CHAIN = Rewrite("decay_value_side_on_chain", "the same, on the state chain's products alone",
                                    lambda ir: _apply(ir, on_chain=True), _proof, shapes_kernels=True)
