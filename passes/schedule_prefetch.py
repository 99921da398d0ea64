"""The blocks of the CTA that starts next on this SM, fetched into L2 while this one works.

Why. GDN's backward out kernel holds one 256-thread CTA an SM (194 KB of shared memory, 193
fragment registers a thread): a CTA's TMA loads (168 KB at K = V = 128) start when it starts, so
every CTA waits out a full trip to HBM before its first product, and nothing else on the SM runs
meanwhile. It moves ~1.3 TB/s of the H100's ~3.3 (session 49's reading: latency, not bandwidth).
A CTA of such a kernel can ask for the blocks of the CTA `ahead` SM-fulls later in launch order
(the one that takes this SM's place when it leaves) with `prefetch.L2`, a hint that occupies no
shared memory and no register past its address: that CTA's TMA loads then come from L2.

What this step decides is a KernelIR fact the lowering reads: a `prefetch` statement per block
the kernel loads (its source tensor; `ahead`, in CTAs per SM), placed after the CTA's own load
issues and before its first wait, so its own loads go first. Only parallel kernels over (chunk
slot, value head) that an SM holds one at a time (schedule_memory.ctas_per_sm): where several
share an SM, the others' work hides a CTA's loads already. Per-token vectors are left to their
plain loads (a few hundred bytes).

QLA_L2_PREFETCH=1 turns it on (off by default until an H100 or H200 times it: NOTES.md, session 52).

    >>> from qla_compiler.ir.kernel import Buffer, Kernel, Stmt, Tensor
    >>> k = Kernel("k", (("chunk_slot", "CH"), ("value_head", "HV")), 256,
    ...            [Tensor("q", ("1", "T", "H", "K"), "io", "in")], [Buffer("q_s", ("C", "K"), "io", "shared")], [],
    ...            [Stmt("load", "q_s", ("q",), (("async", True),)), Stmt("wait_load", "q_s")], [])
    >>> [str(s) for s in l2_prefetched(k, ctas=1).body]
    ['q_s = load q async=True', 'prefetch q   (into L2: its block the CTA 1 SM-full later loads)', 'q_s = wait_load']
"""
from __future__ import annotations

import os
from dataclasses import replace

from qla_compiler.ir.kernel import Kernel, Stmt

L2_PREFETCH = os.environ.get("QLA_L2_PREFETCH", "0") != "0"
PREFETCH_GRID = (("chunk_slot", "CH"), ("value_head", "HV"))


def l2_prefetched(kernel: Kernel, ctas: int) -> Kernel:
    """`kernel` with a prefetch of each block it loads, for the CTA one SM-full later, where an SM
    holds `ctas` = 1 of it; else `kernel` as it is. A kernel that has prefetches already keeps
    them (the step is idempotent)."""
    if (ctas != 1 or kernel.loop or kernel.warp_roles or tuple(kernel.grid) != PREFETCH_GRID
            or any(st.op == "prefetch" for st in kernel.body)):
        return kernel
    blocks = [st.srcs[0] for st in kernel.body if st.op in ("load", "load_chunk_state")]
    first_wait = next((i for i, st in enumerate(kernel.body) if st.op == "wait_load"), None)
    if not blocks or first_wait is None:  # (synchronous loads: the CTA waits for its own at once)
        return kernel
    prefetches = [Stmt("prefetch", None, (src,), (("ahead", 1),)) for src in dict.fromkeys(blocks)]
    return replace(kernel, body=kernel.body[:first_wait] + prefetches + kernel.body[first_wait:])
