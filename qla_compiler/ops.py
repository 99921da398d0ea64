"""Ready-made ops for the shipped specs, with FLA's names.

    >>> from qla_compiler.ops import chunk_gated_delta_rule
    >>> o, final = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)   # doctest: +SKIP

Each op compiles its spec on first use (and caches the result for the process), also when that
first use is inside `torch.compile`: the compile runs as Python, not traced (see `_built`).
"""
from __future__ import annotations

import types

from .compiler import compile as _compile


class _Built(types.ModuleType):
    """The compiled op of each shipped spec, as an attribute by the spec's name, compiled on first
    access. A module on purpose: dynamo reads a module's attributes by a real getattr, so the first
    access under torch.compile runs the compile (sympy, file reads) as Python and traces none of
    it, where a cache function (functools.lru_cache) would be traced and break the graph."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        op = _compile(name, target="sm90")
        setattr(self, name, op)
        return op


_built = _Built(f"{__name__}._built")


def _op(name: str):
    """The compiled op of the shipped spec `name`."""
    return getattr(_built, name)


def _make(name: str, fla_name: str):
    def op(*args, **kwargs):
        return getattr(_built, name)(*args, **kwargs)

    op.__name__ = op.__qualname__ = fla_name
    op.__doc__ = f"FLA's `{fla_name}`, compiled from specs/{name}.py: see qla_compiler.op."
    return op


chunk_gated_delta_rule = _make("gdn", "chunk_gated_delta_rule")
chunk_delta_rule = _make("delta_net", "chunk_delta_rule")
chunk_simple_gla = _make("simple_gla", "chunk_simple_gla")
chunk_retention = _make("retnet", "chunk_retention")
chunk_linear_attn = _make("linear_attn", "chunk_linear_attn")
