"""partition: which ChunkIR nodes run in which kernel.

Two kinds of work (MATH.md): work parallel over chunks and the sequential scan over chunks.
Splitting every parallel node into its own kernel would send C×C tensors through memory; fusing
everything into the scan would put long parallel computations on the scan's critical path. The
rule:

  * triangular inverses and chunk-local cumulative sums (with their inputs) run in a `prep`
    kernel, one CTA per (chunk, value head): they are the parallel work that is long (ten
    tensor-core products for the inverse) or serial (a prefix sum); their results cross memory
    once (T_r is gate-free, so the backward reuses it);
  * everything else — the cheap parallel work (masks, decays, Q Kᵀ) and the scan — is one fused
    `scan` kernel per (V-block, value head, sequence), recomputing parallel values on the fly.

So GDN, DeltaNet and simple GLA compile to two kernels; RetNet and linear attention to one.
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from qla_compiler.errors import PassError
from qla_compiler.ir.chunk import ChunkIR

PREP_OPS = ("inv_unit_lower", "cumsum")


@dataclass(frozen=True)
class Partition:
    chunk: ChunkIR
    prep: tuple  # nodes computed by the prep kernel (the PREP_OPS nodes and their ancestors)
    crossing: tuple  # prep results the scan kernel loads
    scan: tuple  # nodes of the fused scan kernel

    def __str__(self) -> str:
        lines = [f"partition {self.chunk.name}"]
        if self.prep:
            lines.append(f"  kernel {self.chunk.name}_prep (parallel over chunks): {' '.join(self.prep)}")
            lines.append(f"  through memory: {' '.join(self.crossing)}")
        lines.append(f"  kernel {self.chunk.name}_scan (sequential over chunks): {' '.join(self.scan)}")
        return "\n".join(lines)


def partition(ir: ChunkIR) -> Partition:
    scan_side = ir.scan_nodes()
    roots = [n.name for n in ir.order() if n.op in PREP_OPS]
    prep = set()
    for r in roots:
        if r in scan_side:
            raise PassError("partition", f"{r} ({ir.node(r).op}) depends on the state; "
                                         "it cannot run ahead of the scan")
        prep |= nx.ancestors(ir.graph, r) | {r}
    order = [n.name for n in ir.order()]
    crossing = tuple(r for r in roots if any(u.name not in prep for u in ir.users(r)))
    # the scan kernel computes what the outputs need, stopping at what the prep kernel made
    scan, todo = set(), list(ir.outputs.values())
    while todo:
        name = todo.pop()
        if name not in scan:
            scan.add(name)
            if name not in crossing:
                todo.extend(ir.node(name).args)
    return Partition(ir, tuple(n for n in order if n in prep), crossing,
                     tuple(n for n in order if n in scan))
