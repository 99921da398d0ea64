"""What the schedule and the lowering need to know of kernels/tri_inverse.py's macro, without
TileLang: its input's dtype and the scratch buffers to allocate for it. tri_inverse.py imports
TileLang to define the macro; the passes import only this (so does `qla-compile --emit chunk`).

    >>> list(SCRATCH), INPUT_DTYPE
    (['D_s', 'T_s', 'P_s'], 'float32')
"""

BLOCK = 16  # the diagonal blocks solved by substitution
# name suffix -> (scope, dtype, shape) of the scratch buffers, in the order the macro takes them
SCRATCH = {"D_s": ("shared", "float32", ("C", str(BLOCK))), "T_s": ("shared", "float32", ("C", "C")), "P_s": ("shared", "float32", ("C", str(BLOCK)))}
INPUT_DTYPE = "float32"  # A_s, read in float32
