"""cse: two nodes with the same op, arguments and attributes compute the same block; keep one.

Dead nodes are dropped after every rewrite (Rewrite.run), so this pass only merges.
"""
from __future__ import annotations

from qla_compiler.ir.chunk import ChunkIR

from .rewrite import Rewrite


def _apply(ir: ChunkIR) -> None:
    seen: dict = {}
    for n in ir.order():  # topological: arguments are merged before their users are compared
        n = ir.node(n.name)
        if n.op in ("input", "state_in"):
            continue
        first = seen.setdefault(n.key(), n.name)
        if first != n.name:
            ir.replace_uses(n.name, first)


CSE = Rewrite("cse", "f(x) = f(x): one node per distinct (op, args, attrs)", _apply)
