"""The ChunkIR passes after `chunk`, in pipeline order.

    fold_constant_gates  no gate → causal masks, no exponentials; constant gate → l·positions
    gate_out_of_inverse  T = R ⊙ T_r, T_r = (I + StrictLower(diag(β) K Kᵀ))⁻¹ free of the gate
    (fold_wy             v_new = T (diag(b)V − diag(sΓ)K S₀): not in the pipeline; the fused
                         forward, Program.fused_program, applies it — see below)
    factor_scalar        β out of the scan: (T diag(β)) (V − diag(Γ) K S₀)
    exp2                 γ·log₂e once, exp2 everywhere
    cse                  merge identical nodes
    decay_value_side     (diag(d)K)ᵀ X = Kᵀ (diag(d) X): the scans scale C×BV, not C×K (it shapes
                         kernels: the backward is the VJP of the program before it, then shaped too)
    scale_after_product  (diag(d)X)Y = diag(d)(XY): a scaling acts on the fp32 product, not on a
                         rounded operand (shapes kernels; only the backward has such products)
                         (the fused forward runs it again after fold_wy, on the chain's products
                         too: scale_after_product_on_chain)
    decay_grad_by_products  a per-key gate's d γ through X ⋆ Z from the VJP's own products,
                         X ⊙ (d P ⋆ Z) − Z ⊙ (d Pᵀ ⋆ X): no C×C×K d R (shapes kernels)
    subchunk_decay       a per-key gate's X ⋆ Z (and those VJP products) as matmuls between
                         sub-chunks of 16 tokens, the decay kept inside the sum on the diagonal
                         sub-blocks alone (shapes kernels)
    verify_exponents     refuse any exponential not provably ≤ 0 (also run after every pass)
"""
from .rewrite import Rewrite
from .rewrite_const_gates import FOLD_CONSTANT_GATES
from .rewrite_cse import CSE
from .rewrite_decay_grad import DECAY_GRAD_BY_PRODUCTS
from .rewrite_decay_side import DECAY_VALUE_SIDE
from .rewrite_exp2 import EXP2
from .rewrite_factor_scalar import FACTOR_SCALAR
from .rewrite_gate_inverse import GATE_OUT_OF_INVERSE
from .rewrite_scale_after_product import SCALE_AFTER_PRODUCT
from .rewrite_subchunk import SUBCHUNK_DECAY
from .rewrite_wy import FOLD_WY
from .verify_exponents import verify_exponents

REWRITES: list[Rewrite] = [FOLD_CONSTANT_GATES, GATE_OUT_OF_INVERSE, FOLD_WY, FACTOR_SCALAR, EXP2, CSE, DECAY_VALUE_SIDE,
                         SCALE_AFTER_PRODUCT, DECAY_GRAD_BY_PRODUCTS, SUBCHUNK_DECAY]


class _Verify:
    """verify_exponents as a pipeline pass (it returns the program unchanged)."""

    name = "verify_exponents"
    doc = "every exponential's argument is provably ≤ 0"
    proof = None

    @staticmethod
    def run(ir):
        out = verify_exponents(ir).copy()
        out.history = ir.history + ("verify_exponents",)
        return out


# fold_wy suits a scan kernel that recomputes the WY step every chunk; the separate sm90 kernels
# instead compute W and U ahead of the scan (parallel over chunks), which leaves two matmuls per
# chunk on the sequential path instead of three (an early fused scan ran at ~11 µs per chunk,
# benchmarks/NOTES.md). The warp-specialised fused forward applies it: W and U never cross memory
# and its prep solves T_r alone (Program.fused_program).
PIPELINE_REWRITES = [r for r in REWRITES if r is not FOLD_WY]
CHUNK_PASSES = [*PIPELINE_REWRITES, _Verify()]
__all__ = ["CHUNK_PASSES", "PIPELINE_REWRITES", "REWRITES"]
