"""Which chunk programs the sm90 kernels can run: the ops and block shapes partition, schedule and
the TileLang lowering have rules for.

A per-key gate (GLA, KDA) brings the decayed product X ⋆ Z = Σ_k X_ik Z_jk R_ijk over the C×C×K
block of per-key decays (passes/chunk_per_key.py), and its VJP two more (d P ⋆_rows Z, d P ⋆_cols X;
d γ through them: passes/rewrite_decay_grad.py). subchunk_decay (passes/rewrite_subchunk.py) leaves
of each matmuls and the product on the diagonal sub-blocks, which the lowering computes element by
element without storing R (lower_tilelang's `decayed_product`, by its eq): those forms run. Any
other decayed product, or a C×C×K block outside one, stops the pipeline here, saying why, rather
than build a kernel that computes something else or fail deep inside TileLang.

    >>> from qla_compiler import compile_spec
    >>> print(unsupported(compile_spec("gdn").chunk), unsupported(compile_spec("kda").chunk))
    None None
"""
from __future__ import annotations

from qla_compiler.ir.chunk import ChunkIR
from qla_compiler.ir.chunk_ops import COLS_PRODUCT, DECAYED_PRODUCT, EXPONENTIALS, ROWS_PRODUCT


# the decayed products with a lowering rule on the diagonal sub-blocks: X ⋆ Z, and its VJP's
# d P ⋆_rows Z and d P ⋆_cols X (lower_tilelang's decayed_product, by eq)
SUB_BLOCK_PRODUCTS = (DECAYED_PRODUCT, ROWS_PRODUCT, COLS_PRODUCT)


def on_sub_blocks(ir: ChunkIR, n) -> bool:
    """A decayed product restricted to the diagonal sub-blocks, its R = exp(masked_diff[block] γ) inlined."""
    if n.op != "contract" or n.attr["eq"] not in SUB_BLOCK_PRODUCTS:
        return False
    R = ir.node(n.args[2])
    return R.op in EXPONENTIALS and ir.node(R.args[0]).op == "masked_diff" and bool(ir.node(R.args[0]).attr.get("block"))


def unsupported(ir: ChunkIR) -> str | None:
    """Why the sm90 lowering cannot take `ir` (naming the nodes), or None when it can."""
    inside = set()  # R of a sub-block product and its exponent: never stored
    for n in ir.order():
        if on_sub_blocks(ir, n):
            inside |= {n.args[2], ir.node(n.args[2]).args[0]}
    products, blocks = [], []
    for n in ir.order():
        if n.op == "contract" and not on_sub_blocks(ir, n):
            products.append(f"{n.name} = contract[{n.attr['eq']}]")
        elif n.shape == ("C", "C", "K") and n.name not in inside:
            blocks.append(n.name)
    if not products and not blocks:
        return None
    found = [f"decayed products not in a sub-block form ({', '.join(products)})"] if products else []
    found += [f"C×C×K blocks outside a sub-block product ({', '.join(blocks)})"] if blocks else []
    return (f"the sm90 lowering has no rule yet for {'; '.join(found)}: it runs the decayed products "
            f"{', '.join(SUB_BLOCK_PRODUCTS)} on the diagonal sub-blocks (passes/rewrite_subchunk.py) alone. The op "
            "runs on CPU tensors (and float32/float64 CUDA tensors) through the ChunkIR interpreter; `--target cpu` "
            "compiles for that alone")
