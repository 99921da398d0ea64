"""Check mode: after each ChunkIR pass, run the interpreter against the spec's reference.

Small random inputs (float64, a packed batch with a partial chunk and a 1-token sequence, grouped
value heads, an initial state); the first pass whose program disagrees is named in the error.
`check` returns the relative errors it measured, which the pipeline keeps per pass
(`Program.checked`, printed by `qla-compile --check`). It lives beside the op it runs, not among
the passes: compile_spec(check=True) hands it to the pipeline (run_pipeline's `checker`).

    >>> from qla_compiler import compile_spec
    >>> prog = compile_spec("gdn", check=True)
    >>> list(prog.checked)[:2], max(max(e) for e in prog.checked.values()) < TOLERANCE
    (['chunk', 'fold_constant_gates'], True)
"""
from __future__ import annotations

from .errors import PassError
from .ir.recurrence import RecurrenceIR

TOLERANCE = 1e-10


class Checker:
    def __init__(self, recurrence: RecurrenceIR):
        self.recurrence = recurrence
        self.expected = None

    def check(self, pass_name: str, chunk) -> tuple:
        """The relative errors (o, final state) of `chunk` run by the interpreter against the
        reference; a PassError naming `pass_name` where one exceeds TOLERANCE."""
        from .op import CompiledOp
        from .passes.pipeline import Program
        from .testing import random_inputs, rel_err

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
        errors = (rel_err(got[0], self.expected[0]), rel_err(got[1], self.expected[1]))
        for what, err in zip(("o", "final state"), errors):
            if not err <= TOLERANCE:
                raise PassError(pass_name, f"the chunk program no longer matches the reference: "
                                           f"relative error of {what} = {err:.3g} (> {TOLERANCE:g})")
        return errors
