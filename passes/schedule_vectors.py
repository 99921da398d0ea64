"""Per-token vectors in registers for a parallel kernel's 2-D element-wise passes.

Why. A pass over a C×C or C×K block that scales by a per-token vector (β_i K Kᵀ_ij, the gate
mask's γ_i − γ_j) reads the vector's shared block once per element: TileLang keeps every block of a
kernel in one dynamic shared array, so nvcc cannot prove that the pass's own shared stores leave
the vector alone, and loads it again for each element. Copied first into a fragment indexed the
same way, the vector takes the pass's layout (TileLang infers it: a thread holds the entries of
the rows, or the columns, its elements lie in), and each entry is loaded once. The GDN prep's two
such passes (ptxas and nvdisasm on the CPU, session 40): 64 loads a thread in the gate pass, where
a thread holds 32 rows of one column of T_r, and 32 in the β pass, where it holds 2 rows of a wgmma
accumulator, become 33 and 2; the prep's shared loads 253 → 191, its instructions 2000 → 1816, 80
registers as before, no spills.

One fragment per pass, vector and index: passes over blocks of different layouts (a wgmma
accumulator's, the inverse's) cannot share one. On by default since session 41 (H100, with
QLA_PREP_PAD: GDN's prep 0.576 → 0.494 ms at 16/64:8x4096, its training step 14.42 → 13.69);
QLA_VECTOR_REGISTERS=0 turns it off (the generated source differs, so both variants cache side by
side).

    >>> import qla_compiler
    >>> prep = qla_compiler.compile_spec("gdn", target="sm90").kernels.kernels[0]
    >>> [str(s) for s in vectors_in_registers(prep).body if s.op == "ewise" and "beta_i" in str(s)][:2]
    ['beta_i[i] = beta_s[i]', 'A_r_s[i,j] = [j<i ? (beta_i[i] · KKt[i, j]) : 0]']
"""
from __future__ import annotations

import os
from dataclasses import replace

from qla_compiler.ir.kernel import Buffer, Kernel, Stmt

VECTOR_REGISTERS = os.environ.get("QLA_VECTOR_REGISTERS", "1") != "0"
_LEAVES = ("buf", "lit", "param", "head")


def vectors_in_registers(kernel: Kernel) -> Kernel:
    """`kernel` with each 2-D element-wise statement's reads of a shared per-token vector at the
    row or column index (x_s[i], x_s[j]) taken from a fragment copied from it right before, where
    the statement reads or writes a 2-D fragment: its layout (a wgmma accumulator's, the
    inverse's) gives a thread a few rows or one column. A pass over shared blocks alone takes
    TileLang's layout for the loop, whose threads hold many rows: there the copies cost more than
    they save (KDA's prep, ptxas: 65 → 104 barriers, 445 → 453 shared stores)."""
    bufs = {b.name: b for b in kernel.buffers}
    taken = set(bufs) | {p.name for p in kernel.params}
    added, body = [], []
    blocks = {b.name for b in kernel.buffers if b.scope == "fragment" and len(b.shape) == 2}
    for st in kernel.body:
        if (st.op != "ewise" or tuple(st.attr["index"]) != ("i", "j")
                or not ({st.dst} | st.reads()) & blocks):
            body.append(st)
            continue
        copies = {}  # (vector, index) -> its fragment

        def swap(e):
            if not isinstance(e, tuple) or not e:
                return e
            if e[0] == "buf":
                b = bufs.get(e[1])
                if (len(e) == 3 and e[2] in ("i", "j") and b is not None and b.scope == "shared"
                        and len(b.shape) == 1 and b.stages == 1):
                    if (e[1], e[2]) not in copies:
                        base = name = f"{e[1].removesuffix('_s')}_{e[2]}"
                        n = 1
                        while name in taken:  # (beta_i, beta_i2, ...: one per pass)
                            n += 1
                            name = f"{base}{n}"
                        taken.add(name)
                        copies[e[1], e[2]] = Buffer(name, b.shape, b.dtype, "fragment")
                    return ("buf", copies[e[1], e[2]].name, e[2])
                return e
            if e[0] in _LEAVES:
                return e
            return (e[0], *map(swap, e[1:]))

        expr = swap(st.attr["expr"])
        for (vector, var), frag in copies.items():
            added.append(frag)
            body.append(Stmt("ewise", frag.name, (), (("expr", ("buf", vector, var)), ("index", (var,)))))
        body.append(replace(st, attrs=tuple((k, expr if k == "expr" else v) for k, v in st.attrs)) if copies else st)
    return replace(kernel, buffers=kernel.buffers + added, body=body) if added else kernel
