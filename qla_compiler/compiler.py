"""compile(): a spec file in, a callable op out (with every IR stage kept on `op.program`).

    >>> import qla_compiler
    >>> op = qla_compiler.compile("specs/gdn.py", target="sm90")
    >>> op.input_names
    ('q', 'k', 'v', 'g', 'beta')
    >>> print(op.program.chunk)                       # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path

from .op import CompiledOp
from .passes.pipeline import Program, run_pipeline
from .specs import NAMES
from .specs import path as shipped_spec


def resolve_spec(spec) -> Path:
    """A spec file's path, or the name of a shipped spec ('gdn', 'delta_net', ...)."""
    p = Path(spec)
    if p.suffix != ".py" and str(spec) in NAMES:
        return shipped_spec(str(spec))
    return p


def compile_spec(spec, target: str = "sm90", chunk_size: int = 64, **options) -> Program:
    """Run the pipeline and return every stage (see passes.pipeline.run_pipeline for options)."""
    return run_pipeline(resolve_spec(spec), target=target, chunk_size=chunk_size, **options)


def compile(spec, target: str = "sm90", chunk_size: int = 64, check: bool = False) -> CompiledOp:
    """Compile a spec (a file, or a shipped spec's name) into an op with FLA's call conventions."""
    return CompiledOp(compile_spec(spec, target=target, chunk_size=chunk_size, check=check))
