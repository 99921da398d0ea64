"""What the schedule and the lowering need to know of kernels/tri_inverse.py's macro, without
TileLang: its input's dtype and row padding, and the scratch buffers to allocate for it.
tri_inverse.py imports TileLang to define the macro; the passes import only this (so does
`qla-compile --emit chunk`).

    >>> list(SCRATCH), INPUT_DTYPE, INPUT_ROW_PAD
    (['D_s', 'P_s', 'A21_s', 'T11_s', 'T22_s', 'M_s'], 'float32', 4)
    >>> sorted(sum(PHASES, ())) == sorted(SCRATCH)
    True

Why the padding. A row of C = 64 floats is 256 bytes, a multiple of the 32 banks' 128, so one
column of different rows is one bank. The macro reads A and T by rows that differ from thread to
thread: a column sweep reads A[i, j] for the 8 rows of a warp, the 32-merge A[32 + r, l] and
T[32 + r, 32 + l] for its 4 (8-way and 4-way conflicts, most of the inverse's shared-memory time
on the H200, session 15's ncu). Rows 68 floats apart put those 8 rows in 8 distinct banks, and
the store of β ⊙ K Kᵀ from a wgmma accumulator (4 column pairs of 8 rows a warp) meets 2-way
conflicts where it met 8-way.

Why D_s's rows are padded too (QLA_PREP_PAD, on by default; 0 turns it off): a row of 16 floats
is 64 bytes, so the 16 → 32 merge's second product, reading one column D_s[16 + r, l] for the 8
rows r of a warp, finds them in 2 banks (4-way conflicts: 64 of its 220 shared wavefronts a
warp); rows 20 floats apart put them in 8. P_s stays unpadded: it is read a row at a time (one 16-float row to every lane), and written by
lanes 4 floats apart that fill its rows end to end, which padding would split (4 → 8 wavefronts).
With the macro's stores into D_s and its tf32 staging 4 floats wide, the GDN prep's shared
wavefronts a warp go 681 → 569, its shared loads and stores 348 → 300 (counted on the generated
CUDA with a model of the banks, session 40). On the H100 (session 41, 16/64:8x4096) the GDN prep
took 0.576 ms without it, 0.523 with it, 0.494 with it and QLA_VECTOR_REGISTERS.
"""
import os

from qla_compiler.ir.kernel import Buffer

BLOCK = 16  # the diagonal blocks solved by substitution
INPUT_DTYPE = "float32"  # A_s, read in float32
INPUT_ROW_PAD = 4  # A_s's rows, 68 floats apart at C = 64
# QLA_PREP_PAD (on unless 0): D_s's rows padded as A_s's are, and the macro's stores into D_s and
# A_s and its tf32 staging 4 floats wide (kernels/tri_inverse.py); read once, at import, like the
# passes' switches. At 0 the kernels are what they were before the switch, byte for byte
PAD = os.environ.get("QLA_PREP_PAD", "1") != "0"
# QLA_PREP_COLUMNS=1 (off until timed): the substitution's lanes each hold a column of their
# 16-block (kernels/tri_inverse.py, _substitute_by_columns): one shuffle a sweep step where the row
# lanes take eight, A's entries read 4 at a time; the same float32 operations in the same order
COLUMNS = os.environ.get("QLA_PREP_COLUMNS", "0") == "1"
HALF = 2 * BLOCK  # the 32 → 64 merge's blocks, multiplied on the tensor cores (tf32)
# merges of blocks this wide multiply on the tensor cores, reading their operands as tf32 (the
# inverse statement's field `tf32_from`: the KernelIR says it, the interpreter models it)
TF32_FROM = HALF
# name suffix -> the scratch buffer, in the order the macro takes them: the sweeps' and the 16 → 32
# merge's, then the 32 → 64 merge's operands A₂₁, T₁₁, T₂₂ and its first product M = A₂₁ T₁₁
SCRATCH = {"D_s": Buffer("D_s", ("C", str(BLOCK)), "float32", "shared", row_pad=INPUT_ROW_PAD if PAD else 0),
           "P_s": Buffer("P_s", ("C", str(BLOCK)), "float32", "shared"),  # unpadded: see above
           **{n: Buffer(n, (str(HALF), str(HALF)), "float32", "shared") for n in ("A21_s", "T11_s", "T22_s", "M_s")}}
# the scratch buffers live at once, phase by phase: the substitution's and the 16 → 32 merge's,
# then the 32 → 64 merge's; TileLang's allocator gives a later phase an earlier one's memory (the
# GDN prep at C = 64: 16 KB of scratch at its peak, not the 24 of all six)
PHASES = (("D_s", "P_s"), ("A21_s", "T11_s", "T22_s", "M_s"))
