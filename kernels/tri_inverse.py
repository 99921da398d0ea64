"""Building block: T = (I + A)⁻¹ for a strictly lower triangular C×C block A, by blocked forward
substitution: the 16×16 diagonal blocks by substitution in float32, then merges on tensor cores.

Why this method (MATH.md, "Computing T_r"): every intermediate it forms is bounded by 1 in size
for the matrices the delta rule inverts, A = StrictLower(diag(β) K Kᵀ) with unit-norm keys and
β ∈ [0, 1], whatever the keys are — identical keys (a repeated token) included. Neumann doubling,
(I − A)(I + A²)(I + A⁴)…, forms the powers of A, which reach 1e17 on such keys while T stays ≤ 1,
and cancels catastrophically in any finite precision.

    1. substitution: each diagonal 16-block T_bb = (I + A_bb)⁻¹ by column sweeps,
       T[i, :] −= A[i, j] T[j, :] for i > j, j = 0…14, in float32 in shared memory;
    2. merges, 16 → 32 → … → C: at width w, with D the block-diagonal of the w×w inverses found so
       far and L the part of A that couples the two halves of each 2w block,
       (I + A)⁻¹ restricted to the 2w blocks = D − D·L·D   (T₂₁ = −T₂₂ A₂₁ T₁₁ per block),
       two C×C tf32 wgmmas per level (the zero blocks ride along: two products per level on the
       tensor cores beat slicing them out).

Why every intermediate is bounded by 1. Fix a column j of T and solve (I + A) x = e_j by rows:
x_i = −β_i k_iᵀ u_{i−1}, with u_i = Σ_{l ≤ i} k_l x_l. Then u_i = (I − β_i k_i k_iᵀ) u_{i−1}, and
‖I − β k kᵀ‖ ≤ 1 for ‖k‖ = 1, β ∈ [0, 2], so ‖u_i‖ ≤ ‖u_j‖ = ‖k_j‖ = 1 and |x_i| ≤ β_i ≤ 1:
|T_ij| ≤ 1. The same argument bounds what the method forms on the way: a column sweep's partial
sum T[i, c] after step j is −β_i k_iᵀ u_j (≤ 1); the diagonal blocks are inverses of the same kind;
a merge's L·D holds A₂₁ T₁₁ = rows β_i k_iᵀ of block 2 against the u's that block 1 ends in (≤ 1),
and D·L·D the final entries of T (≤ 1). So each float32 sum and each tf32 product rounds values of
size ≤ 1 into values of size ≤ 1: no cancellation beyond a few units of the last place, whatever
the keys. Replayed with tf32 rounding against a float64 solve (tests/test_tri_inverse.py, C = 64,
K = 128): relative error ≤ 9e-4 on keys from U[0, 1), 2e-16 on one repeated key with β = 1, 2e-4
on random keys; Neumann doubling gave 6e9 and 2e12 on the first two.

The lowering allocates the scratch buffers listed in SCRATCH and calls the macro:

    unit_lower_inverse(A_s, X, X_D_s, X_Lt_s, X_Rt_s, X_P_f, C)   # X (fragment) = (I + A_s)⁻¹

A_s (float32, shared) is the input; each merge writes the coupling blocks of T it found over the
blocks of A it consumed. D_s (C×16, float32) holds the diagonal 16-blocks of T. The two tf32
buffers are the wgmmas' operands, the right-hand one transposed (tf32 wgmma reads both K-major).
"""
import tilelang.language as T

# the constants live where the passes can read them without importing TileLang
from .tri_inverse_scratch import BLOCK, INPUT_DTYPE, SCRATCH  # noqa: F401


@T.macro
def _substitute(A_s, D_s, C):
    # D_s[i, c] = T[i, b0 + c] for the 16-block b0 of row i: column sweeps, at step j every row
    # below j in its block takes row j's multiple; row j is final then (its last update was at
    # step j − 1) and nobody writes it, so one barrier per step is the only synchronisation
    for i, c in T.Parallel(C, BLOCK):
        D_s[i, c] = T.if_then_else(i % BLOCK == c, 1.0, 0.0)
    for j in T.serial(BLOCK - 1):
        for i, c in T.Parallel(C, BLOCK):
            if i % BLOCK > j:
                D_s[i, c] -= A_s[i, i - i % BLOCK + j] * D_s[i - i % BLOCK + j, c]


@T.macro
def _merge(A_s, D_s, X, Lt_s, Rt_s, P_f, C, w, last):
    # D: the block-diagonal of the w-blocks of T so far (its 16-blocks in D_s, the blocks merged
    # since over A's own coupling blocks in A_s); L: A's (odd, even) w-blocks of each 2w block
    for i, j in T.Parallel(C, C):
        Lt_s[i, j] = T.if_then_else((i // w) % 2 == 1 and j // w == i // w - 1, A_s[i, j], 0.0)
        Rt_s[j, i] = T.if_then_else(i // BLOCK == j // BLOCK, D_s[i, j % BLOCK],
                                    T.if_then_else(j < i and i // w == j // w, A_s[i, j], 0.0))
    T.gemm(Lt_s, Rt_s, P_f, transpose_B=True, clear_accum=True)  # L·D
    for i, j in T.Parallel(C, C):
        Lt_s[i, j] = T.if_then_else(i // BLOCK == j // BLOCK, D_s[i, j % BLOCK],
                                    T.if_then_else(j < i and i // w == j // w, A_s[i, j], 0.0))
        Rt_s[j, i] = P_f[i, j]
    T.gemm(Lt_s, Rt_s, P_f, transpose_B=True, clear_accum=True)  # D·L·D, nonzero only where L is
    if last:  # the result, in registers
        for i, j in T.Parallel(C, C):
            X[i, j] = T.if_then_else(i // BLOCK == j // BLOCK, D_s[i, j % BLOCK], T.if_then_else(
                (i // w) % 2 == 1 and j // w == i // w - 1, -P_f[i, j],
                T.if_then_else(j < i and i // w == j // w, A_s[i, j], 0.0)))
    else:  # T's new coupling blocks, over A's (the next level's L lies elsewhere)
        for i, j in T.Parallel(C, C):
            if (i // w) % 2 == 1 and j // w == i // w - 1:
                A_s[i, j] = -P_f[i, j]


@T.macro
def unit_lower_inverse(A_s, X, D_s, Lt_s, Rt_s, P_f, C):
    # (the levels are spelled out: a macro's Python-level branches are resolved when it is parsed,
    # so every block width below is a constant in the kernel)
    _substitute(A_s, D_s, C)
    if C == BLOCK:
        for i, j in T.Parallel(C, C):
            X[i, j] = D_s[i, j]
    elif C == 2 * BLOCK:
        _merge(A_s, D_s, X, Lt_s, Rt_s, P_f, C, BLOCK, True)
    else:
        _merge(A_s, D_s, X, Lt_s, Rt_s, P_f, C, BLOCK, False)
        _merge(A_s, D_s, X, Lt_s, Rt_s, P_f, C, 2 * BLOCK, True)
