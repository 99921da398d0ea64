"""qla: a compiler for gated linear-attention recurrences.

    >>> import qla_compiler
    >>> op = qla_compiler.compile("specs/gdn.py", target="sm90")
    >>> o, final_state = op(q, k, v, g, beta, output_final_state=True)      # doctest: +SKIP
    >>> qla_compiler.warmup("gdn", ["H=16,HV=64,K=128,V=128,io=bfloat16"])  # doctest: +SKIP
"""
from .errors import PassError, SpecError, UnsupportedStructure


def __getattr__(name):
    # the compiler (sympy, networkx) on first use: `qla-compile --help` starts without it
    if name in ("compile", "compile_spec", "warmup"):
        from . import compiler, precompile

        globals()[name] = value = getattr(precompile if name == "warmup" else compiler, name)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["compile", "compile_spec", "warmup", "SpecError", "UnsupportedStructure", "PassError"]
__version__ = "0.1.0"
