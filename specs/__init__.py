"""The recurrences shipped with qla. Each file is a spec: see qla_compiler.spec.

    >>> from qla_compiler.specs import path
    >>> path("gdn").name
    'gdn.py'
"""
from pathlib import Path

# the specs the sm90 lowering turns into kernels, forward and backward: every shipped one
WITH_KERNELS = ("gdn", "delta_net", "simple_gla", "retnet", "linear_attn", "gla", "kda")
NAMES = WITH_KERNELS


def path(name: str) -> Path:
    """The file of a shipped spec, by name."""
    p = Path(__file__).with_name(f"{name}.py")
    if name.startswith("_") or not p.exists():
        raise ValueError(f"no shipped spec named {name!r}; shipped: {', '.join(NAMES)}")
    return p
