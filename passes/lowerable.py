"""Which chunk programs the sm90 kernels can run: the ops and block shapes partition, schedule and
the TileLang lowering have rules for.

A per-key gate (GLA, KDA) brings what they have none for yet: the C×C×K block of per-key decays,
per-key vectors (K) and the decayed product `contract` (passes/chunk_per_key.py). Such a program
runs on the CPU backend (the ChunkIR interpreter); the pipeline stops before `partition`, saying
why, and the op refuses the inputs that would need kernels (qla_compiler/op.py), rather than
build a kernel that computes something else or fail deep inside TileLang.

    >>> from qla_compiler import compile_spec
    >>> print(unsupported(compile_spec("gdn").chunk))
    None
"""
from __future__ import annotations

from qla_compiler.ir.chunk import ChunkIR

NO_RULE = {"contract": "the decayed product Σ_k X_ik Z_jk R_ijk"}
NO_LAYOUT = {("C", "C", "K"): "C×C×K", ("K",): "per-key vector (K)"}


def unsupported(ir: ChunkIR) -> str | None:
    """Why the sm90 lowering cannot take `ir` (naming the nodes), or None when it can."""
    ops, blocks = {}, {}
    for n in ir.order():
        if n.op in NO_RULE:
            ops.setdefault(n.op, []).append(n.name)
        elif n.shape in NO_LAYOUT:
            blocks.setdefault(n.shape, []).append(n.name)
    if not ops and not blocks:
        return None
    found = [f"the op {op} ({NO_RULE[op]}: {', '.join(names)})" for op, names in ops.items()]
    found += [f"{NO_LAYOUT[shape]} blocks ({', '.join(names)})" for shape, names in blocks.items()]
    return (f"the sm90 lowering has no rule yet for per-key gates (a diagonal decay Diag(exp(g))): "
            f"{'; '.join(found)}. The op runs on CPU tensors (and float32/float64 CUDA tensors) through "
            "the ChunkIR interpreter; `--target cpu` compiles for that alone")
