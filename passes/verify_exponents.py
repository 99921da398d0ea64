"""verify_exponents: every exponential's argument is provably ≤ 0, so nothing overflows.

e^{γ_i − γ_j} for j ≤ i is ≤ 1, but e^{−γ_j} alone overflows float32 once the cumulative decay
passes about −88 (64 tokens at g ≈ −2). Algebra cannot tell the two apart — D X D⁻¹ = R ⊙ X —
so this pass does, by abstract interpretation over two small lattices:

    sign:  '≤0', '≥0' or '?'          (gates are ≤ 0 by declaration; head constants γ ≤ 1)
    order: 'dec', 'inc', 'flat', '?'  (along the chunk: a cumsum of ≤ 0 values never increases)

masked_diff of a non-increasing vector is ≤ 0; last(x) − x of a non-increasing x is ≤ 0; so is
ref_diff's x_i − x_ref on rows after ref and x_ref − x_i on rows up to it. A C×K
block (a per-key gate's) is ordered along the chunk in each of its columns, and its masked_diff
(C×C×K) and last (K) are taken per column, so the same rules prove e^{γ_ik − γ_jk} ≤ 1.
A program with an exponential of anything else is refused, naming the node.
"""
from __future__ import annotations

from qla_compiler.errors import PassError
from qla_compiler.ir.chunk import ChunkIR
from qla_compiler.ir.chunk_ops import EXPONENTIALS

NEG, POS, ANY = "≤0", "≥0", "?"
DEC, INC, FLAT = "dec", "inc", "flat"


def _flip(s):
    return {NEG: POS, POS: NEG}.get(s, ANY)


def _reverse(o):
    return {DEC: INC, INC: DEC}.get(o, o)


def _mul(a, b):
    if ANY in (a, b):
        return ANY
    return POS if a == b else NEG


def analyse(ir: ChunkIR) -> dict:
    """node -> (sign, order along the chunk)."""
    info = {}
    for n in ir.order():
        a = [info[x] for x in n.args]
        sign, order = ANY, ANY
        if n.op == "input":
            sign = NEG if n.attr["kind"] in ("gate", "key_gate") else ANY
        elif n.op == "head_log":
            sign = NEG
        elif n.op == "const":
            sign, order = (NEG if n.attr["value"] <= 0 else POS), FLAT
        elif n.op in ("valid", "positions"):
            sign, order = POS, (INC if n.op == "positions" else ANY)
        elif n.op == "cumsum":
            sign = a[0][0]
            order = {NEG: DEC, POS: INC}.get(sign, ANY)
        elif n.op == "last":
            sign = a[0][0]
        elif n.op == "masked_diff":
            sign = {DEC: NEG, FLAT: NEG, INC: POS}.get(a[0][1], ANY)
        elif n.op == "ref_diff":  # x_i − x_ref on rows after ref, or x_ref − x_i on rows up to it
            at = n.attr
            after, upto = at["lo"] >= at["ref"], at["hi"] <= at["ref"] + 1
            if a[0][1] in (DEC, FLAT) and (after if at["later"] else upto):
                sign = NEG
            elif a[0][1] in (INC, FLAT) and (after if at["later"] else upto):
                sign = POS
        elif n.op == "clamp_min":  # max(x, m) is ≤ 0 when both are; it keeps x's order
            m = n.attr["min"]
            sign = NEG if a[0][0] == NEG and m <= 0 else (POS if a[0][0] == POS or m >= 0 else ANY)
            order = a[0][1]
        elif n.op == "above":
            sign = POS
        elif n.op == "neg":
            sign, order = _flip(a[0][0]), _reverse(a[0][1])
        elif n.op == "add":
            sign = a[0][0] if a[0][0] == a[1][0] else ANY
        elif n.op == "sub":
            sign = a[0][0] if a[0][0] == _flip(a[1][0]) != ANY else ANY
            if ir.node(n.args[0]).op == "last" and ir.node(n.args[0]).args[0] == n.args[1] \
                    and a[1][1] in (DEC, FLAT):
                sign = NEG  # last(x) − x_j ≤ 0 when x never increases
        elif n.op == "mul":
            sign = _mul(a[0][0], a[1][0])
            shapes = [ir.node(x).shape for x in n.args]
            if () in shapes:  # a scalar times a vector keeps (or flips) its order
                s_i, v_i = (0, 1) if shapes[0] == () else (1, 0)
                o = a[v_i][1]
                order = o if a[s_i][0] == POS else (_reverse(o) if a[s_i][0] == NEG else ANY)
        elif n.op in EXPONENTIALS:
            sign = POS
        info[n.name] = (sign, order)
    return info


def verify_exponents(ir: ChunkIR) -> ChunkIR:
    info = analyse(ir)
    for n in ir.order():
        if n.op in EXPONENTIALS and info[n.args[0]][0] != NEG:
            raise PassError("verify_exponents",
                            f"node '{n.name}' = {n.op}({n.args[0]}) exponentiates a value not provably ≤ 0 "
                            f"(sign {info[n.args[0]][0]}): it can overflow in float32. Exponentiate masked "
                            "differences of the cumulative gate instead (R = exp(γ_i − γ_j), j ≤ i)")
    return ir
