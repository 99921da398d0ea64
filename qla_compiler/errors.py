"""The errors qla raises, each one pointing at what to fix."""


class SpecError(ValueError):
    """A spec file that is not a valid recurrence; names the file and line.

    >>> str(SpecError("unknown symbol 'x'", "specs/bad.py", 7))
    "specs/bad.py:7: unknown symbol 'x'"
    """

    def __init__(self, message: str, path: str | None = None, line: int | None = None):
        self.message, self.path, self.line = message, path, line
        where = f"{path}:{line}: " if path and line else (f"{path}: " if path else "")
        super().__init__(where + message)


class UnsupportedStructure(SpecError):
    """A valid recurrence whose transition the compiler cannot chunk (yet)."""


class PassError(RuntimeError):
    """A compiler pass failed or broke an invariant; names the pass."""

    def __init__(self, pass_name: str, message: str):
        self.pass_name = pass_name
        super().__init__(f"pass '{pass_name}': {message}")


class NotFusable(PassError):
    """The schedule cannot fuse a program's scan and output kernel at its head-dim tiles: a
    backward, more outputs than o, a chain that does not split into roles, or rings and state
    that do not fit the SM. The runtime runs the separate kernels instead; any other PassError
    from the fused schedule is a bug and propagates."""
