"""Ready-made ops for the shipped specs, with FLA's names.

    >>> from qla_compiler.ops import chunk_gated_delta_rule, chunk_kda
    >>> o, final = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)   # doctest: +SKIP
    >>> o, final = chunk_kda(q, k, v, g_per_key, beta, use_qk_l2norm_in_kernel=True)  # doctest: +SKIP
    >>> o, pool = fused_recurrent_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, initial_state=pool,
    ...     ssm_state_indices=slots, inplace_final_state=True, output_final_state=True)  # doctest: +SKIP

Each op compiles its spec on first use (and caches the result for the process), also when that
first use is inside `torch.compile`: the compile runs as Python, not traced (see `_built`).
"""
from __future__ import annotations

import types

from .compiler import compile as _compile
from .fla_kda import fla_kda


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


def _make(name: str, fla_name: str, recurrent: bool = False):
    def op(*args, **kwargs):
        compiled = getattr(_built, name)
        return (compiled.recurrent if recurrent else compiled)(*args, **kwargs)

    op.__name__ = op.__qualname__ = fla_name
    op.__doc__ = (f"FLA's `{fla_name}` (call it with keywords: FLA's positional order differs), compiled from "
                  f"specs/{name}.py, with serving engines' state pools: see qla_compiler.recurrent." if recurrent
                  else f"FLA's `{fla_name}`, compiled from specs/{name}.py: see qla_compiler.op.")
    return op


chunk_gated_delta_rule = _make("gdn", "chunk_gated_delta_rule")
chunk_delta_rule = _make("delta_net", "chunk_delta_rule")
chunk_simple_gla = _make("simple_gla", "chunk_simple_gla")
chunk_retention = _make("retnet", "chunk_retention")
chunk_linear_attn = _make("linear_attn", "chunk_linear_attn")
# per-key gates, g [B, T, H, K]: the kernels for bf16/fp16 CUDA tensors, forward and backward
# (passes/rewrite_subchunk.py)
chunk_gla = _make("gla", "chunk_gla")
chunk_kda = fla_kda(_make("kda", "chunk_kda"))  # (with FLA's KDA keywords: the gate from A_log, …)

# the token-step ops, for decoding (qla_compiler/recurrent.py)
fused_recurrent_gated_delta_rule = _make("gdn", "fused_recurrent_gated_delta_rule", recurrent=True)
fused_recurrent_delta_rule = _make("delta_net", "fused_recurrent_delta_rule", recurrent=True)
fused_recurrent_simple_gla = _make("simple_gla", "fused_recurrent_simple_gla", recurrent=True)
fused_recurrent_retention = _make("retnet", "fused_recurrent_retention", recurrent=True)
fused_recurrent_linear_attn = _make("linear_attn", "fused_recurrent_linear_attn", recurrent=True)
fused_recurrent_gla = _make("gla", "fused_recurrent_gla", recurrent=True)
fused_recurrent_kda = fla_kda(_make("kda", "fused_recurrent_kda", recurrent=True))
