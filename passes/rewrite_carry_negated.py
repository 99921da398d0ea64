"""carry_negated: x = −(−x), so a block read by the chain's products is the one the scan carries.

Where the chain forms y = −x for a product of its own (the backward's d WS = −d v_new, the operand
of d S₀ += Wᵀ·d WS) and the out kernel reads x as well, partition carries x and the out kernel
recomputes y from it. This rewrite turns that round: the out kernel's readers of x read −y, a node
of their own, so the scan carries y, the block its products read from shared memory anyway, and
the out kernel forms x = −y, one element-wise pass. A kernel with roles then stores y from the
buffer its chain hands over and needs no second one for x (16 KB of shared memory at V-block 128
in GDN's whole-V backward scan: schedule_fused.py). The plain kernels do not need it: the backward
program with its scan on roles at V-block 128 runs it (Program.backward_wide_roles_program).
"""
from __future__ import annotations

import networkx as nx
import sympy as sp

from qla_compiler.ir.chunk import ChunkIR

from .rewrite import Rewrite


def _apply(ir: ChunkIR) -> None:
    if ir.state_in is None or ir.next_state is None:
        return
    dependent = ir.scan_nodes()
    chain = (nx.ancestors(ir.graph, ir.next_state) | {ir.next_state}) & dependent
    for y in [n for n in ir.order() if n.op == "neg" and n.name in chain]:
        x = y.args[0]
        if len(ir.node(x).shape) != 2 or not any(u.op == "matmul" and u.name in chain for u in ir.users(y.name)):
            continue
        outside = [u.name for u in ir.users(x) if u.name != y.name and u.name not in chain]
        if not outside:
            continue
        twin = ir.add(f"{x}.of_{y.name}", "neg", y.name)
        ir.replace_uses(x, twin, exclude=set(ir.graph.successors(x)) - set(outside))


def _proof():
    x = sp.Matrix(2, 2, sp.symbols("x0:4"))
    return x, -(-x)


CARRY_NEGATED = Rewrite("carry_negated",
                        "x = −(−x): the out kernel reads −y where the chain's products read y = −x", _apply, _proof)
