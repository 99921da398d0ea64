"""Whether a chunk program may run on blocks of K's columns, each block a problem of its own whose
outputs the host places (a K-wide output: its columns) or adds up (a K-free one) (key_blocks);
and what one of its kernels would load to run on blocks of K's columns itself (key_cut).

Where the state's rows never mix, the recurrence splits by rows of the state: with a per-key or
scalar gate and no delta rule (GLA, RetNet, linear attention, simple GLA), row k of S_t depends on
column k of q, k and the gate alone, and o_t = S_tᵀ q_t is a sum over rows. The chunked program
(and its VJP) inherits this: every K-wide value is its columns', and every sum over K (Q Kᵀ,
Q S, Kᵀ dO, …) reaches the outputs only linearly. The delta rule breaks it (A = β K Kᵀ inside an
inverse), and so would any K×K matrix.

Why: GLA's backward at K = 256 needed more shared memory per kernel than the budget even on column
blocks of V (its d g kernel 216 KB at V = 64); on blocks of 128 keys it fits. With its out kernels
on blocks of K's columns (key_cut; schedule.KEY_BLOCKS, the default) it fits with K whole, and the
program's blocks of K are the path where that is off.
"""
from __future__ import annotations

from qla_compiler.ir.chunk import ChunkIR

# ops that drop K from a value's shape by summing over it
_SUMS = {"matmul", "contract", "rowsum", "colsum", "sum_all"}
# ops linear in each argument on its own (so in one partial sum, the others fixed)
_MULTILINEAR = {"mul", "scale_rows", "scale_cols", "matmul", "contract"}
# ops linear in all their arguments at once (so in partial sums, every argument one)
_LINEAR = {"add", "sub", "neg", "cumsum", "rev_cumsum", "last", "at_last", "keep", "tril", "rowsum", "colsum",
           "sum_all"}


def key_blocks(ir: ChunkIR) -> tuple[dict | None, str | None]:
    """({output role: "columns" | "sum"}, None) where the program may run on blocks of K's columns:
    a K-wide output is the blocks' side by side, a K-free one their sum. (None, why) otherwise.

        >>> import qla_compiler
        >>> key_blocks(qla_compiler.compile_spec("gla").backward)[0]["d_v"]
        'sum'
        >>> key_blocks(qla_compiler.compile_spec("gdn").backward)[1]
        'T_r = inv_unit_lower(A_r), where A_r sums over K'
    """
    partial: set = set()  # values whose whole is the sum of the blocks' (every other: the block's own)
    for n in ir.order():
        wide = "K" in n.shape
        if list(n.shape).count("K") > 1:
            return None, f"{n.name} is {'×'.join(n.shape)}: it mixes K's columns"
        args = [ir.node(a) for a in n.args]
        summed = [a for a in args if a.name in partial]
        if not summed:
            if not wide and any("K" in a.shape for a in args):  # a sum over K
                if n.op not in _SUMS:
                    return None, f"{n.name} = {n.op}({', '.join(n.args)}) drops K, not by a sum"
                partial.add(n.name)
            elif wide and n.op in ("matmul", "contract") and _sums_k_into_k(ir, n):
                return None, f"{n.name} = {n.op}({', '.join(n.args)}) sums over K into a K-wide value"
            continue
        if wide:
            return None, f"{n.name} = {n.op}({', '.join(n.args)}), K-wide, reads {summed[0].name}, a sum over K"
        if n.op in _LINEAR and len(summed) == len(args):
            partial.add(n.name)
        elif n.op in _MULTILINEAR and len(summed) == 1 and all("K" not in a.shape for a in args):
            partial.add(n.name)
        else:
            return None, f"{n.name} = {n.op}({', '.join(n.args)}), where {summed[0].name} sums over K"
    how = {}
    for role, x in ir.outputs.items():
        if "K" in ir.node(x).shape:
            how[role] = "columns"
        elif x in partial:
            how[role] = "sum"
        else:  # (the same in every block: no shipped spec has one; summing would count it once a block)
            return None, f"{role} depends on no key: each block would compute all of it"
    return how, None


def _sums_k_into_k(ir: ChunkIR, n) -> bool:
    """A K-wide matmul or contraction that also sums over K (a K×K operand)."""
    if n.op == "matmul":
        a, b = (ir.node(x).shape for x in n.args)
        a = a[::-1] if n.attr.get("ta") else a
        return a[1] == "K"
    ins, out = n.attr["eq"].split("->")
    dims = {}
    for sub, x in zip(ins.split(","), n.args):
        dims.update(zip(sub, ir.node(x).shape))
    return any(d == "K" and letter not in out for letter, d in dims.items())


# element-wise ops the hand-over may be moved up through (_climb): a block of the value they read
# costs a kernel on key blocks a few C×C passes to rebuild
_CHEAP = {"neg", "tril", "keep", "scale_rows", "scale_cols", "mul", "add", "sub"}


def key_cut(ir: ChunkIR, nodes, loaded) -> tuple[tuple | None, str | None]:
    """For one kernel of a program (it computes `nodes` and reads the `loaded` ones whole): the
    K-free values it would load instead of computing so that it runs on blocks of K's columns, each
    block computing its outputs' columns: (values, None), () where it runs so as it is; else
    (None, why). Every output must be K-wide.

    A K-free value that sums over K, or is computed from one that does, needs every key (a block
    holds a part of the sum). Where a K-wide value reads one, that value is loaded instead, from
    another kernel that computes it whole; it is moved up through element-wise steps whose other
    arguments are vectors (_climb), so that one block crosses memory where several masks of it
    are read. KDA's d q, d k, d g kernel reads d KKt_R = β ⊙ strict-lower(−d A_T) through seven
    masks and products (d A_T sums over K: d T = … + d W (β k Γ)ᵀ); d A_T loaded, the rest of the
    kernel separates over K.

        >>> import qla_compiler
        >>> part = qla_compiler.compile_spec("kda").backward_program.stage("partition")
        >>> ir, loaded = part.chunk, part.out_loads
        >>> grads = [ir.outputs[r] for r in ("d_q", "d_k", "d_g")]
        >>> key_cut(ir, ir.closure(grads, stop=loaded), loaded)
        (('d_A.T.full',), None)
        >>> key_cut(ir, ir.closure([ir.outputs["d_beta"]], stop=loaded), loaded)[1]
        'd_beta is an output that needs every key'
    """
    nodes, loaded = set(nodes), set(loaded)
    order = [n for n in ir.order() if n.name in nodes and n.name not in loaded]
    whole: set = set()  # computed values that need every key
    cut: set = set()  # those a K-wide value reads
    for n in order:
        if list(n.shape).count("K") > 1:
            return None, f"{n.name} is {'×'.join(n.shape)}: it mixes K's columns"
        args = [ir.node(a) for a in n.args]
        if "K" in n.shape:
            if n.op in ("matmul", "contract") and _sums_k_into_k(ir, n):
                return None, f"{n.name} = {n.op}({', '.join(n.args)}) sums over K into a K-wide value"
            cut |= {a.name for a in args if a.name in whole}
        elif any(a.name in whole or "K" in a.shape for a in args):
            whole.add(n.name)
    for role, x in ir.outputs.items():
        if x in whole:
            return None, f"{role} is an output that needs every key"
    tops = []
    for x in (n.name for n in order if n.name in cut):
        top = _climb(ir, x, whole)
        if top not in tops:
            tops.append(top)
    return tuple(tops), None


def _climb(ir: ChunkIR, x: str, whole: set) -> str:
    """The value to load for `x`: x, or where x is an element-wise step of one block that needs
    every key and otherwise of vectors and scalars, that block's (recursively)."""
    n = ir.node(x)
    blocks = [a for a in n.args if len(ir.node(a).shape) == len(n.shape)]
    if n.op in _CHEAP and len(blocks) == 1 and blocks[0] in whole and ir.node(blocks[0]).shape == n.shape:
        return _climb(ir, blocks[0], whole)
    return x
