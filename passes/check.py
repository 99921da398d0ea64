"""Check mode: after each ChunkIR pass, run the interpreter against the spec's reference.

Small random inputs (float64, a packed batch with a partial chunk and a 1-token sequence, grouped
value heads, an initial state); the first pass whose program disagrees is named in the error.
"""
from __future__ import annotations

from qla_compiler.errors import PassError
from qla_compiler.ir.recurrence import RecurrenceIR

TOLERANCE = 1e-10


class Checker:
    def __init__(self, recurrence: RecurrenceIR):
        self.recurrence = recurrence
        self.expected = None

    def check(self, pass_name: str, chunk) -> None:
        from qla_compiler.op import CompiledOp
        from qla_compiler.testing import random_inputs, rel_err

        from .pipeline import Program

        C = chunk.chunk_size
        op = CompiledOp(Program("<check>", "cpu", C, self.recurrence, chunk))
        args = random_inputs(op, T=2 * C + 9, H=1, HV=2, K=8, V=6, cu_seqlens=[0, C + 3, C + 4, 2 * C + 9],
                             initial_state=True, seed=1)
        if self.expected is None:
            self.expected = op.reference(**args)
        try:
            got = op(**args)
        except Exception as e:  # noqa: BLE001 - a program the interpreter cannot run names the pass too
            raise PassError(pass_name, f"the interpreter cannot run the chunk program: "
                                       f"{type(e).__name__}: {e}") from e
        for what, a, b in (("o", got[0], self.expected[0]), ("final state", got[1], self.expected[1])):
            err = rel_err(a, b)
            if not err <= TOLERANCE:
                raise PassError(pass_name, f"the chunk program no longer matches the reference: "
                                           f"relative error of {what} = {err:.3g} (> {TOLERANCE:g})")
