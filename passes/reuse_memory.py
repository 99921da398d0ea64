"""reuse_memory: KernelIR -> KernelIR, an output placed in the memory of an input whose value is
dead once its kernel has read it (Tensor.reuses).

A backward's out kernel reads per-token partials the kernels before it made (the scan's
d_v_new_rows; with QLA_RECOMPUTE_ON_LOADED=0 also GDN's d_q_QKt_rows and d_k_QKt_rows, which its
prep forms then) and writes the gradients of the same shape; each CTA loads its chunk's rows of a
partial before it stores those rows of the gradient, and nothing after it reads the partial. So
the gradient can be written in the partial's place: at 16/64 heads, K = V = 128 and 32768 tokens,
1.5 GB of the backward's 5.4 GB of buffers were never allocated (a step's peak on the H100: 8600 →
7064 MiB, benchmarks/NOTES.md session 43; since session 46 GDN's prep makes no q·Kᵀ partials,
partition.RECOMPUTE_ON_LOADED). Its scan likewise writes each chunk's d v_new where it read that
chunk's d v_new_o_intra (0.5 GB more, at the scan, where the step peaks since). The lowering is
unchanged; the runtime passes the input's tensor as the output's where the two are allocated
alike and the kernel runs once a call (kernels/forward.launch).

Only a parallel kernel or a scan qualifies (Kernel.cannot_reuse says why another does not): a CTA on
key blocks shares its rows with the other blocks, and a warp-specialised kernel's loads are a
ring's. A scan runs more than once a call under context parallelism: the runtime reuses nothing
for it there.

    >>> import qla_compiler
    >>> out = qla_compiler.compile_spec("gdn").backward_program.kernels.kernels[-1]
    >>> sorted((p.name, p.reuses) for p in out.params if p.reuses)
    [('d_v', 'd_v_new_rows')]
"""
from __future__ import annotations

import dataclasses

from qla_compiler.ir.kernel import KernelIR


def reuse_memory(kir: KernelIR) -> KernelIR:
    """`kir` with each output that can take an input's memory marked so (the first such input in
    parameter order, each input taken once), verified."""
    kernels = []
    for i, k in enumerate(kir.kernels):
        taken, params = set(), []
        inputs = [p for p in k.params if p.role == "in"]
        for p in k.params:
            if p.role == "out" and not p.reuses:
                given = next((q for q in inputs if q.name not in taken and not k.cannot_reuse(p, q)
                              and not kir.live_after(i, q.name)), None)
                if given is not None:
                    taken.add(given.name)
                    p = dataclasses.replace(p, reuses=given.name)
            params.append(p)
        kernels.append(dataclasses.replace(k, params=params))
    out = dataclasses.replace(kir, kernels=kernels)
    out.verify()
    return out
