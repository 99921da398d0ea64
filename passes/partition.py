"""partition: which ChunkIR nodes run in which kernel.

Two kinds of work (MATH.md): work parallel over chunks and the sequential scan over chunks.
Splitting every parallel node into its own kernel would send C×C tensors through memory; fusing
everything into the scan would put the triangular solve on the scan's critical path. The rule:

  * each triangular inverse (with its gate-free inputs) gets a `solve` kernel, one CTA per
    (chunk, value head); its result crosses memory once and is reused (by the backward too);
  * everything else — the cheap parallel work (masks, decays, Q Kᵀ) and the scan — is one fused
    `scan` kernel per (V-block, value head, sequence), recomputing parallel values on the fly.

So GDN and DeltaNet compile to two kernels; simple GLA, RetNet and linear attention to one.
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from qla_compiler.errors import PassError
from qla_compiler.ir.chunk import ChunkIR


@dataclass(frozen=True)
class Partition:
    chunk: ChunkIR
    solve: tuple  # nodes computed by the solve kernel (ancestors of the inverses, and the inverses)
    crossing: tuple  # solve results the scan kernel loads
    scan: tuple  # nodes of the fused scan kernel

    def __str__(self) -> str:
        lines = [f"partition {self.chunk.name}"]
        if self.solve:
            lines.append(f"  kernel {self.chunk.name}_solve (parallel over chunks): {' '.join(self.solve)}")
            lines.append(f"  through memory: {' '.join(self.crossing)}")
        lines.append(f"  kernel {self.chunk.name}_scan (sequential over chunks): {' '.join(self.scan)}")
        return "\n".join(lines)


def partition(ir: ChunkIR) -> Partition:
    scan_side = ir.scan_nodes()
    inverses = [n.name for n in ir.of_op("inv_unit_lower")]
    solve = set()
    for inv in inverses:
        if inv in scan_side:
            raise PassError("partition", f"the triangular inverse {inv} depends on the state; "
                                         "it cannot run ahead of the scan")
        solve |= nx.ancestors(ir.graph, inv) | {inv}
    order = [n.name for n in ir.order()]
    crossing = tuple(i for i in inverses if any(u.name not in solve for u in ir.users(i)))
    # the scan kernel computes what the outputs need, stopping at what the solve kernel made
    scan, todo = set(), list(ir.outputs.values())
    while todo:
        name = todo.pop()
        if name not in scan:
            scan.add(name)
            if name not in crossing:
                todo.extend(ir.node(name).args)
    return Partition(ir, tuple(n for n in order if n in solve), crossing,
                     tuple(n for n in order if n in scan))
