"""exp2: e^x = 2^(x·log₂e). Scale the cumulative gate by log₂e once; every exponential becomes exp2.

Only valid where every use of γ reaches an exponential through ops that are linear in γ
(differences, last element, cumsum): those commute with the scaling. exp2 is one special-function
instruction on the GPU; exp is exp2 plus a multiply.
"""
from __future__ import annotations

import math

import sympy as sp

from qla_compiler.ir.chunk import ChunkIR
from qla_compiler.ir.chunk_ops import LINEAR

from .rewrite import Rewrite

LOG2E = 1.0 / math.log(2.0)


def _linear_closure(ir: ChunkIR, start: str):
    """Nodes reached from `start` through linear ops, and the exponentials at their ends; None if
    some path ends anywhere else, or if a sum or difference on the way also takes a term that does
    not come from `start` (scaling γ would not scale that term)."""
    seen, exps, todo = {start}, set(), [start]
    while todo:
        for u in ir.users(todo.pop()):
            if u.op == "exp":
                exps.add(u.name)
            elif u.op in LINEAR and u.name not in seen:
                seen.add(u.name)
                todo.append(u.name)
            elif u.op not in LINEAR:
                return None
    # a sum scales with γ only if every term does: (γ + c)·log₂e ≠ γ·log₂e + c
    if any(not set(ir.node(n).args) <= seen for n in seen - {start}):
        return None
    return exps


def _apply(ir: ChunkIR) -> None:
    roots = {n.args[0] for n in ir.of_op("masked_diff")}  # γ: what the ratio mask differences
    for root in sorted(roots):
        exps = _linear_closure(ir, root)
        if not exps:
            continue
        log2e = ir.add("log2e", "const", value=LOG2E, shape=())
        scaled = ir.add(f"{root}_log2", "mul", root, log2e)
        ir.replace_uses(root, scaled, exclude={scaled})
        for e in sorted(exps):
            ir.replace_uses(e, ir.add(f"{e}'", "exp2", ir.node(e).args[0]))


def _proof():
    x = sp.Symbol("x", real=True)
    return sp.exp(x), 2 ** (x * sp.log(2) ** -1)


EXP2 = Rewrite("exp2", "e^x = 2^(x·log₂e): γ₂ = γ·log₂e once, then exp2 everywhere", _apply, _proof)
