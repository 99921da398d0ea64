"""What a rewrite is: a ChunkIR → ChunkIR pass that states the identity it relies on and can prove it.

`identity` is the math in one line (it is printed with the pass). `proof()` returns (lhs, rhs) as
sympy expressions over small symbolic blocks; `proves()` checks lhs − rhs simplifies to zero.
Tests run every proof; the interpreter checks every rewrite numerically in `--check` mode.

    >>> from qla_compiler.passes.rewrites import CHUNK_PASSES
    >>> all(r.proves() for r in CHUNK_PASSES if r.proof)       # doctest: +SKIP
    True
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import sympy as sp

from qla_compiler.ir.chunk import ChunkIR, Node


@dataclass(frozen=True)
class Rewrite:
    name: str
    identity: str
    apply: Callable[[ChunkIR], None]  # edits a copy in place
    proof: Callable[[], tuple] | None = None
    # a choice of form for the kernels rather than algebra to differentiate through: the backward is
    # the VJP of the program before the first such pass, and these passes then run on the VJP too
    shapes_kernels: bool = False
    # for a kernel-shaping rewrite: whether its form is the faster at a shape class (BV, K, ...);
    # where not, the runtime runs the program without it (Program.for_shape)
    pays: Callable[[object], bool] = lambda shape: True

    @property
    def doc(self) -> str:
        return self.identity

    def run(self, ir: ChunkIR) -> ChunkIR:
        out = ir.copy()
        self.apply(out)
        out.remove_dead()
        out.tidy_names()
        out.history = ir.history + (self.name,)
        return out

    def proves(self) -> bool:
        lhs, rhs = self.proof()
        diff = sp.simplify(sp.expand(lhs - rhs))
        return bool(diff.is_zero_matrix) if isinstance(diff, sp.MatrixBase) else bool(diff == 0)


# ---- small pattern helpers shared by the rewrites ----------------------------------------------

def arg(ir: ChunkIR, n: Node, i: int) -> Node:
    return ir.node(n.args[i])


def is_op(n: Node | None, op: str, **attrs) -> bool:
    return n is not None and n.op == op and all(n.attr.get(k) == v for k, v in attrs.items())


def is_ratio_mask(ir: ChunkIR, n: Node, mask: str = "lower") -> bool:
    """R = exp(masked_diff γ): the decay between positions j ≤ i."""
    return is_op(n, "exp") and is_op(arg(ir, n, 0), "masked_diff", mask=mask)


def const_value(n: Node):
    return n.attr["value"] if n.op == "const" else None


def lower_tri(C: int, f) -> sp.Matrix:
    return sp.Matrix(C, C, lambda i, j: f(i, j) if j <= i else 0)


def strict_lower(M: sp.Matrix) -> sp.Matrix:
    return sp.Matrix(M.rows, M.cols, lambda i, j: M[i, j] if j < i else 0)


def add_once(ir: ChunkIR, created: list, name: str, op: str, *args, **attrs) -> str:
    """A node, or the one already computing the same (op, args, attrs): a rewrite that builds the
    same factor for several products shares it (`created` collects the new ones, for take_place)."""
    key = (op, args, tuple(sorted(attrs.items())))
    same = next((m.name for m in ir.order() if m.key() == key), None)
    if same is None:
        same = ir.add(name, op, *args, **attrs)
        created.append(same)
    return same

