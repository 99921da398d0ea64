"""decay_value_side: (diag(d)·K)ᵀ·X = Kᵀ·(diag(d)·X). A state update's row decay moves to the value side.

The state update Kᵀ·(diag(d)·V_new) needs the decay to the chunk's end on one operand's rows. The
scan is blocked along V (one CTA per BV-wide slab of the state), so scaling the value-side operand
costs C×BV multiplies per CTA where scaling the keys costs C×K in every CTA, with an exponential
each, plus a C×K block written to shared memory for the matmul to read. The keys then go to the
matmul as loaded, and the scaled value-side block is a new node: the unscaled one stays for its
other users (the output's V_new).
"""
from __future__ import annotations

import sympy as sp

from qla_compiler.ir.chunk import ChunkIR

from .rewrite import Rewrite, arg, is_op


def _apply(ir: ChunkIR) -> None:
    for mm in ir.of_op("matmul"):
        if not mm.attr.get("ta") or mm.attr.get("tb"):
            continue
        scaled, x = arg(ir, mm, 0), arg(ir, mm, 1)
        if not is_op(scaled, "scale_rows") or x.shape[-1] != "V" or scaled.shape[-1] == "V":
            continue
        d, keys = scaled.args
        x_decayed = ir.add(f"{x.name}_decayed", "scale_rows", d, x.name)
        ir.replace_uses(mm.name, ir.add(f"{mm.name}'", "matmul", keys, x_decayed, ta=True))


def _proof():
    C = 3
    d = sp.diag(*sp.symbols(f"d0:{C}"))
    K, X = sp.Matrix(C, 2, sp.symbols("k0:6")), sp.Matrix(C, 2, sp.symbols("x0:6"))
    return (d * K).T * X, K.T * (d * X)


# Forward only: in the VJP the decay's gradient is a row sum of d(diag(d)X) ⊙ X over V, which the
# V-blocked backward scan cannot finish, so it would store another C×V block per token for the out
# kernel; the key-side form's row sum is over K, in the out kernel's existing matmul (v_new·d_Sᵀ).
DECAY_VALUE_SIDE = Rewrite("decay_value_side", "(diag(d)K)ᵀ X = Kᵀ (diag(d) X): the decay on the V-blocked side",
                           _apply, _proof, forward_only=True)
