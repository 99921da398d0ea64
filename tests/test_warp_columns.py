"""kernels/warp_columns.py: the layout that deals a fragment's columns to the warps."""
import itertools

import pytest

from qla_compiler.kernels.warp_columns import WARP, check, lane_of, slot_of


@pytest.mark.parametrize("rows, columns, n", [(128, 16, 8), (128, 8, 8), (64, 16, 8), (256, 16, 8), (64, 32, 16),
                                              (32, 8, 4)])
def test_every_element_has_one_thread_and_register_and_a_warp_holds_whole_columns(rows, columns, n):
    check(rows, columns, n)
    threads = WARP * columns // n
    per_thread = rows * columns // threads
    held = {}
    for i, j in itertools.product(range(rows), range(columns)):
        lane, slot = lane_of(i, j, n), slot_of(i, j, n)
        assert 0 <= lane < threads and 0 <= slot < per_thread, (i, j, lane, slot)
        assert (lane, slot) not in held, f"({i}, {j}) and {held[(lane, slot)]} share a register"
        held[(lane, slot)] = (i, j)
    assert len(held) == threads * per_thread  # (a bijection: no register left unused)
    for j in range(columns):  # a column's rows in one warp: a sum over the rows never leaves it
        assert len({lane_of(i, j, n) // WARP for i in range(rows)}) == 1
    for lane in range(threads):  # four adjacent columns a lane: one 16-byte access of float32
        cols = sorted({j for (t, _), (_, j) in held.items() if t == lane})
        assert cols == list(range(cols[0], cols[0] + 4)) and cols[0] % 4 == 0


@pytest.mark.parametrize("rows, columns, n", [(128, 16, 6), (128, 12, 8), (8, 16, 8), (128, 16, 256)])
def test_blocks_the_layout_cannot_deal_are_refused(rows, columns, n):
    with pytest.raises(ValueError, match="warp_columns"):
        check(rows, columns, n)


@pytest.mark.parametrize("n", [12, 2, 256])
def test_the_kernel_ir_refuses_what_the_layout_cannot_deal(n):
    """The verifier holds Buffer.warp_columns to the counts the lowering's layout takes (it once
    took any multiple of 4, and 12 failed only in the lowering)."""
    from dataclasses import replace

    import qla_compiler

    (kernel,) = qla_compiler.compile_spec("gdn").token_step_program.kernels.kernels
    kernel.verify()
    bad = replace(kernel, buffers=tuple(replace(b, warp_columns=n) if b.warp_columns else b for b in kernel.buffers))
    with pytest.raises(ValueError, match="columns a warp"):
        bad.verify()
