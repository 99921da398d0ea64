"""release_memory: KernelIR -> KernelIR, each tensor the program makes released after the last
kernel that reads it (Kernel.releases).

The runtime holds every tensor of a call by name until the call returns, so a backward's buffers
stay allocated after their last reader: the prep's recomputed W and d v_new's intra-chunk part
after the scan, the per-chunk d S and the partials after the out kernel, while the host sums d q
and d k over each group of value heads on top of them all. With the releases marked,
kernels/forward.run_kernels drops each after its last reader's launch, and torch's allocator gives
the memory to what runs after it. At 16/64 heads, K = V = 128 and 32768 tokens, with the scan's
d v_new in its input's memory (reuse_memory), a step's peak on the H100 went 7064 → 6280 MiB
(benchmarks/NOTES.md session 44).

For a program whose caller reads only its results (a backward's gradients and the state's); not a
training forward, whose caller keeps tensors for the backward beside its results.

    >>> import qla_compiler
    >>> scan = qla_compiler.compile_spec("gdn").backward_program.kernels.kernels[1]
    >>> scan.name, scan.releases
    ('gdn_backward_scan', ('W_rows', 'd_v_new_o_intra_rows'))
"""
from __future__ import annotations

import dataclasses

from qla_compiler.ir.kernel import KernelIR


def release_memory(kir: KernelIR) -> KernelIR:
    """`kir` with each kernel's `releases`: its inputs that an earlier kernel made, no later kernel
    reads and no result holds (KernelIR.live_after), in parameter order; verified."""
    kernels = [dataclasses.replace(k, releases=tuple(p.name for p in k.params
                                                     if p.role == "in" and not kir.live_after(i, p.name)))
               for i, k in enumerate(kir.kernels)]
    out = dataclasses.replace(kir, kernels=kernels)
    out.verify()
    return out
