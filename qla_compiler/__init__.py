"""qla: a compiler for gated linear-attention recurrences.

    >>> import qla_compiler
    >>> op = qla_compiler.compile("specs/gdn.py", target="sm90")
    >>> o, final_state = op(q, k, v, g, beta, output_final_state=True)      # doctest: +SKIP
"""
from .compiler import compile, compile_spec
from .errors import PassError, SpecError, UnsupportedStructure

__all__ = ["compile", "compile_spec", "SpecError", "UnsupportedStructure", "PassError"]
__version__ = "0.1.0"
