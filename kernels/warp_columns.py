"""A fragment layout that deals a block's columns to the warps: `warp_columns(buffer, n)` for a
[rows × columns] fragment gives warp w the columns n·w … n·w + n − 1 and every row of them, so
that a sum over the rows (T.reduce_sum(..., dim=0)) is shuffles inside each warp, with no block
barrier.

Why: TileLang's own layout for the token step's [K × BV] state at BV = 16 (64 threads) spread the
rows over both warps, and each sum over K went through shared memory behind block barriers, 24 of
them a token, on the critical path of a one-token decode (the KernelIR's Buffer.warp_columns says
which fragments take this layout; passes/token_step.py).

Within a warp each lane holds 4 adjacent columns of n / 4 column groups, and rows 32 / (n / 4)
apart: at n = 8, lane l holds columns 4 (l % 2) … 4 (l % 2) + 3 of rows l // 2, l // 2 + 16, ….

    >>> from qla_compiler.kernels.warp_columns import lane_of, slot_of
    >>> [lane_of(i, j, 8) for i, j in ((0, 0), (0, 4), (1, 0), (15, 7), (16, 0), (0, 8))]
    [0, 1, 2, 31, 0, 32]
    >>> [slot_of(i, j, 8) for i, j in ((0, 0), (0, 3), (16, 0), (17, 5))]
    [0, 3, 4, 5]
"""
from qla_compiler.ir.kernel import WARP_COLUMN_COUNTS

WARP = 32
VECTOR = 4  # adjacent columns a lane holds: one 16-byte load or store of float32


def lane_of(i, j, n: int):
    """The thread that holds element (i, j) (a Python int or a TileLang expression)."""
    groups = n // VECTOR
    return (j // n) * WARP + (i % (WARP // groups)) * groups + (j % n) // VECTOR


def slot_of(i, j, n: int):
    """Its index among that thread's registers."""
    groups = n // VECTOR
    return (i // (WARP // groups)) * VECTOR + j % VECTOR


def check(rows: int, columns: int, n: int) -> None:
    """What the layout needs of a block (a ValueError naming it)."""
    if n not in WARP_COLUMN_COUNTS or columns % n or rows % (WARP // (n // VECTOR)):
        raise ValueError(f"warp_columns={n}: needs a power of two from 4 to 128 dividing the {columns} columns, "
                         f"and rows ({rows}) a multiple of {WARP // max(n // VECTOR, 1)}")


def warp_columns(buffer, n: int):
    """The layout for a 2-D fragment `buffer` (T.annotate_layout's value)."""
    from tilelang.layout import Fragment

    rows, columns = (int(d) for d in buffer.shape)
    check(rows, columns, n)
    return Fragment((rows, columns), forward_thread_fn=lambda i, j: lane_of(i, j, n),
                    forward_index_fn=lambda i, j: slot_of(i, j, n))
