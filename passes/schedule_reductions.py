"""Row and column sums of a wgmma accumulator's blocks, each thread's sums exchanged together.

Why. A sum across threads that live in different warps goes through shared memory: TileLang's
AllReduce writes each thread's partial into a workspace, waits at a barrier, reads its partner's,
and waits again before the workspace is reused. It does that once per output element a thread
holds, so a row sum of a C×K accumulator (two rows a thread, the two warpgroups of a 256-thread
CTA each holding half of every row's columns) costs two rounds of three barriers, and the column
sum of a C×C one (eight columns a thread, four warps down the rows) eight rounds of five. GDN's
backward out kernel, one CTA an SM and latency-bound (session 49), runs 86 barriers a chunk in its
nine sums alone. TileLang 0.1.15's `T.reduce_sum(..., batch=n)` exchanges n of a thread's outputs
per round: one round for all of them, 33 barriers for those sums.

What this step decides is a KernelIR fact the lowering reads (`batch` on a reduce statement):
how many outputs a thread holds, which only the layout TileLang infers knows. That is known here
for the layout of a wgmma accumulator with C = 64 rows in a parallel kernel of one or two
warpgroups: each warpgroup takes all 64 rows (m64), a thread two of them (r and r + 8), and the
warpgroups split the columns, so a thread holds 2 rows of a row sum and n_cols / (4 · warpgroups)
columns of a column sum. A block written element-wise from such accumulators of its own shape
takes their layout (TileLang propagates it through the parallel loop); one read as a wgmma
operand, or dealt to warps by columns (Buffer.warp_columns), does not, and is left alone. Column
sums are batched only over C columns: a K- or V-wide block's width is the shape class's, not the
KernelIR's. A sum that crosses no warp (a row sum inside one warpgroup) has no barrier to share.

On by default since session 50 (H100, 16/64:8x4096: GDN's backward out kernel 4.59 → 4.27 ms,
the training step 9.66 → 9.32; the batched workspaces, 2 KB a row sum and 8 KB the C×C column
sum, fit the memory TileLang already gave the kernel); QLA_BATCHED_REDUCTIONS=0 turns it off (the
generated source differs, so both variants cache side by side).

    >>> from qla_compiler.ir.kernel import Buffer, Kernel, Stmt
    >>> bufs = [Buffer("A", ("C", "K"), "float32", "fragment"), Buffer("x", ("C", "K"), "io", "shared"),
    ...         Buffer("P", ("C", "K"), "float32", "fragment"), Buffer("acc", ("C",), "float32", "fragment"),
    ...         Buffer("r", ("C",), "float32", "shared")]
    >>> body = [Stmt("gemm", "A", ("x", "x")),
    ...         Stmt("ewise", "P", (), (("index", ("i", "j")), ("expr", ("mul", ("buf", "A", "i", "j"), ("lit", 2.0))))),
    ...         Stmt("reduce", "r", ("P", "acc"), (("dims", (1,)),))]
    >>> k = Kernel("k", (("chunk_slot", "CH"), ("value_head", "HV")), 256, [], bufs, [], body, [])
    >>> str(batched_reductions(k, 64).body[-1])
    'r = reduce P acc dims=(1,) batch=(2,)'
"""
from __future__ import annotations

import os
from dataclasses import replace

from qla_compiler.ir.kernel import Kernel, Stmt

BATCHED_REDUCTIONS = os.environ.get("QLA_BATCHED_REDUCTIONS", "1") != "0"
_WGMMA_ROWS = 64  # the rows of one wgmma (m64): a warpgroup's rows of an accumulator of C = 64


def batched_reductions(kernel: Kernel, chunk_size: int) -> Kernel:
    """`kernel` with each reduce statement over a wgmma-laid C×X block marked with the outputs a
    thread holds (attribute batch, one entry per reduction of the statement; 1: unbatched), where
    the sum crosses warps. Parallel kernels of one or two warpgroups only. The marks are computed
    from the kernel as it is: marks an earlier call made for other threads are dropped, so a pass
    that changes a kernel's threads calls this again rather than keeping counts TileLang would
    refuse."""
    stripped = replace(kernel, **{part: [_unbatched(st) for st in getattr(kernel, part)]
                                  for part in ("prologue", "body", "epilogue")})
    if (kernel.loop or kernel.warp_roles or not isinstance(kernel.threads, int)
            or kernel.threads not in (128, 256) or chunk_size != _WGMMA_ROWS):
        return stripped
    groups = kernel.threads // 128
    laid = _accumulator_laid(stripped)
    body = []
    for st in stripped.body:
        if st.op == "reduce" and st.srcs[0] in laid:
            shape = kernel.buffer(st.srcs[0]).shape
            first = st.attr["dims"][0]
            if first == 1 and groups > 1:  # two rows a thread, its warpgroup's half of their columns
                n = 2
            elif first == 0 and shape[1] == "C":  # its columns, 4 warps down the rows
                n = _WGMMA_ROWS // (4 * groups)
            else:
                n = 1
            if n > 1:
                batch = (n,) + (1,) * (len(st.attr["dims"]) - 1)
                st = Stmt(st.op, st.dst, st.srcs, st.attrs + (("batch", batch),))
        body.append(st)
    return replace(stripped, body=body)


def _unbatched(st: Stmt) -> Stmt:
    if st.op != "reduce" or "batch" not in st.attr:
        return st
    return Stmt(st.op, st.dst, st.srcs, tuple((k, v) for k, v in st.attrs if k != "batch"))


def _accumulator_laid(kernel: Kernel) -> set:
    """The kernel's 2-D fragments of C rows laid out as a wgmma accumulator: the results of its
    products, and blocks of the same shape written element-wise (at [i, j]) from one of them,
    unless a product reads the block (an operand's layout is not an accumulator's) or its columns
    are dealt to warps."""
    frags = {b.name: b for b in kernel.buffers
             if b.scope == "fragment" and len(b.shape) == 2 and b.shape[0] == "C" and not b.warp_columns}
    stmts = (*kernel.prologue, *kernel.body, *kernel.epilogue)
    operands = {x for st in stmts if st.op == "gemm" for x in st.srcs}
    laid = {st.dst for st in stmts if st.op == "gemm" and st.dst in frags} - operands
    grown = True
    while grown:
        grown = False
        for st in stmts:
            if (st.op == "ewise" and st.dst in frags and st.dst not in laid | operands
                    and tuple(st.attr["index"]) == ("i", "j")
                    and any(frags[x].shape == frags[st.dst].shape for x in st.reads() & laid)):
                laid.add(st.dst)
                grown = True
    return laid
