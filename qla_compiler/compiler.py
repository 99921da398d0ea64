"""compile(): a spec file in, a callable op out (with every IR stage kept on `op.program`).

    >>> import qla_compiler
    >>> op = qla_compiler.compile("specs/gdn.py", target="sm90")
    >>> op.input_names
    ('q', 'k', 'v', 'g', 'beta')
    >>> print(op.program.chunk)                       # doctest: +SKIP
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import SpecError
from .passes.pipeline import Program, run_pipeline
from .specs import NAMES
from .specs import path as shipped_spec

if TYPE_CHECKING:
    from .op import CompiledOp


def resolve_spec(spec) -> Path:
    """A spec file's path, or the name of a shipped spec ('gdn', 'delta_net', ...). A name that is
    neither says which shipped specs it is close to.

        >>> resolve_spec("gdn").name
        'gdn.py'
        >>> resolve_spec("gdnx")
        Traceback (most recent call last):
        ...
        qla_compiler.errors.SpecError: gdnx: no such spec file, and no shipped spec of that name (did you mean gdn? shipped specs: gdn, delta_net, simple_gla, retnet, linear_attn, gla, kda)
    """
    p = Path(spec)
    if p.suffix != ".py" and str(spec) in NAMES:
        return shipped_spec(str(spec))
    if not p.exists():
        close = difflib.get_close_matches(p.stem, NAMES, n=3, cutoff=0.6)  # (0.5: "delta" ~ "kda")
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        what = "cannot read the spec: no such file" if p.suffix == ".py" else \
            "no such spec file, and no shipped spec of that name"
        raise SpecError(f"{what} ({hint}shipped specs: {', '.join(NAMES)})", str(spec))
    return p


def compile_spec(spec, target: str = "sm90", chunk_size: int = 64, check: bool = False, **options) -> Program:
    """Run the pipeline and return every stage (see passes.pipeline.run_pipeline for options);
    `check`: run the interpreter against the reference after every chunk pass (check_mode.py)."""
    checker = None
    if check:
        from .check_mode import Checker  # the numerical check needs torch; plain compiles do not

        checker = Checker
    return run_pipeline(resolve_spec(spec), target=target, chunk_size=chunk_size, checker=checker, **options)


def compile(spec, target: str = "sm90", chunk_size: int = 64, check: bool = False) -> CompiledOp:
    """Compile a spec (a file, or a shipped spec's name) into an op with FLA's call conventions."""
    from .op import CompiledOp  # (torch: what runs an op, not what compiles one; qla-compile needs none)

    return CompiledOp(compile_spec(spec, target=target, chunk_size=chunk_size, check=check))
