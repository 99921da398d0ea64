"""Building block: T = (I + A)⁻¹ for a strictly lower triangular C×C block A, by blocked forward
substitution in float32: the 16×16 diagonal blocks by substitution, then merges 16 → 32 → 64 of
only the blocks the merge fills.

Why this method (MATH.md, "Computing T_r"): every intermediate it forms is bounded by 1 in size
for the matrices the delta rule inverts, A = StrictLower(diag(β) K Kᵀ) with unit-norm keys and
β ∈ [0, 1], whatever the keys are — identical keys (a repeated token) included. Neumann doubling,
(I − A)(I + A²)(I + A⁴)…, forms the powers of A, which reach 1e17 on such keys while T stays ≤ 1,
and cancels catastrophically in any finite precision.

    1. substitution: each diagonal 16-block T_bb = (I + A_bb)⁻¹ by column sweeps,
       T[i, :] −= A[i, j] T[j, :] for i > j, j = 0…14;
    2. merges: a 2w block's lower-left w-block is T₂₁ = −T₂₂ (A₂₁ T₁₁), T₁₁ and T₂₂ being the w×w
       inverses found so far: at w = 16 for the two pairs of 16-blocks, at w = 32 for the one pair
       of 32-blocks. Each merge is two w×w×w products, and only those: no zero block of A or T
       rides along.

All of it runs on the CUDA cores in float32: about 800 multiply-adds a thread at C = 64 on 128
threads, vectorised four wide, fewer instructions than the element-wise passes that laid out the
operands of the C×C tf32 products an earlier version merged with (their zero blocks riding along),
and no tf32 rounding. Scratch shared memory: T (C×C) and two C×16 buffers, 24 KB at C = 64,
where the earlier version took 36 KB.

Why every intermediate is bounded by 1. Fix a column j of T and solve (I + A) x = e_j by rows:
x_i = −β_i k_iᵀ u_{i−1}, with u_i = Σ_{l ≤ i} k_l x_l. Then u_i = (I − β_i k_i k_iᵀ) u_{i−1}, and
‖I − β k kᵀ‖ ≤ 1 for ‖k‖ = 1, β ∈ [0, 2], so ‖u_i‖ ≤ ‖u_j‖ = ‖k_j‖ = 1 and |x_i| ≤ β_i ≤ 1:
|T_ij| ≤ 1. The same argument bounds what the method forms on the way: a column sweep's partial
sum T[i, c] after step j is −β_i k_iᵀ u_j (≤ 1); the diagonal blocks are inverses of the same kind;
a merge's A₂₁ T₁₁ holds rows β_i k_iᵀ of block 2 against the u's that block 1 ends in (≤ 1), and
−T₂₂ (A₂₁ T₁₁) the final entries of T (≤ 1). So each float32 sum rounds values of size ≤ 1 into
values of size ≤ 1: no cancellation beyond a few units of the last place, whatever the keys.
Replayed in float32 against a float64 solve (tests/test_tri_inverse.py, C = 64, K = 128): relative
error ≤ 2e-7 on keys from U[0, 1), near-identical and alternating keys, 5e-17 on one repeated key
with β = 1; Neumann doubling in tf32 gave 6e9 and 2e12 on the first two.

The lowering allocates the scratch buffers listed in SCRATCH and calls the macro:

    unit_lower_inverse(A_s, X, X_D_s, X_T_s, X_P_s, C)   # X (fragment) = (I + A_s)⁻¹

A_s (float32, shared) is the input, left as it is. D_s (C×16, float32) holds the diagonal 16-blocks
of T as the substitution makes them (16-wide rows: its sweeps read and write four floats at a
time). T_s (C×C, float32) holds T as the merges build it: the diagonal 16-blocks, then the merged
blocks below them; above the diagonal only the blocks a merge reads are zeroed. P_s (C×16,
float32) holds each merge's first product A₂₁ T₁₁, which the second reads across threads.
"""
import tilelang.language as T

# the constants live where the passes can read them without importing TileLang
from .tri_inverse_scratch import BLOCK, INPUT_DTYPE, SCRATCH  # noqa: F401

PAIR = 2 * BLOCK  # the blocks the first merge makes


@T.macro
def _substitute(A_s, D_s, T_s, C):
    # D_s[i, c] = T[i, b0 + c] for the 16-block b0 of row i: column sweeps, at step j every row
    # below j in its block takes row j's multiple; row j is final then (its last update was at
    # step j − 1) and nobody writes it, so one barrier per step is the only synchronisation
    for i, c in T.Parallel(C, BLOCK):
        D_s[i, c] = T.if_then_else(i % BLOCK == c, 1.0, 0.0)
    for j in T.serial(BLOCK - 1):
        for i, c in T.Parallel(C, BLOCK):
            if i % BLOCK > j:
                D_s[i, c] -= A_s[i, i - i % BLOCK + j] * D_s[i - i % BLOCK + j, c]
    # into T_s's 32-wide diagonal blocks, zeros above the 16-blocks (the second merge reads them)
    for i, c in T.Parallel(C, min(C, PAIR)):
        T_s[i, i - i % PAIR + c] = T.if_then_else(i % PAIR // BLOCK == c // BLOCK, D_s[i, c % BLOCK], 0.0)


@T.macro
def _merge_pairs(A_s, D_s, T_s, P_s, C):
    # 16 → 32, the pairs p of 16-blocks at once: T[b1 + r, b0 + c] = −Σ_l T₂₂[r, l] (A₂₁ T₁₁)[l, c]
    # with b0 = 32p, b1 = b0 + 16 (T₁₁, T₂₂ in D_s); A₂₁ T₁₁ goes through P_s (rows 16p + l) for
    # the second product
    product = T.alloc_fragment((C // PAIR, BLOCK, BLOCK), "float32")
    T.clear(product)
    for l in T.unroll(BLOCK):
        for p, r, c in T.Parallel(C // PAIR, BLOCK, BLOCK):
            product[p, r, c] += A_s[p * PAIR + BLOCK + r, p * PAIR + l] * D_s[p * PAIR + l, c]
    for p, r, c in T.Parallel(C // PAIR, BLOCK, BLOCK):
        P_s[p * BLOCK + r, c] = product[p, r, c]
    T.clear(product)
    for l in T.unroll(BLOCK):
        for p, r, c in T.Parallel(C // PAIR, BLOCK, BLOCK):
            product[p, r, c] += D_s[p * PAIR + BLOCK + r, l] * P_s[p * BLOCK + l, c]
    for p, r, c in T.Parallel(C // PAIR, BLOCK, BLOCK):
        T_s[p * PAIR + BLOCK + r, p * PAIR + c] = -product[p, r, c]


@T.macro
def _merge_halves(A_s, T_s, P_s):
    # 32 → 64: T[32 + r, c] = −Σ_l T₂₂[r, l] (A₂₁ T₁₁)[l, c] over 32-blocks; P_s holds the 32×32
    # product A₂₁ T₁₁ as two 32×16 halves of columns, (l, c) at row l + 32·(c // 16), column c % 16
    product = T.alloc_fragment((PAIR, PAIR), "float32")
    T.clear(product)
    for l in T.unroll(PAIR):
        for r, c in T.Parallel(PAIR, PAIR):
            product[r, c] += A_s[PAIR + r, l] * T_s[l, c]
    for r, c in T.Parallel(PAIR, PAIR):
        P_s[r + PAIR * (c // BLOCK), c % BLOCK] = product[r, c]
    T.clear(product)
    for l in T.unroll(PAIR):
        for r, c in T.Parallel(PAIR, PAIR):
            product[r, c] += T_s[PAIR + r, PAIR + l] * P_s[l + PAIR * (c // BLOCK), c % BLOCK]
    for r, c in T.Parallel(PAIR, PAIR):
        T_s[PAIR + r, c] = -product[r, c]


@T.macro
def unit_lower_inverse(A_s, X, D_s, T_s, P_s, C):
    # (a macro's Python-level branches are resolved when it is parsed, so every block width
    # below is a constant in the kernel)
    _substitute(A_s, D_s, T_s, C)
    if C >= PAIR:
        _merge_pairs(A_s, D_s, T_s, P_s, C)
    if C == 2 * PAIR:
        _merge_halves(A_s, T_s, P_s)
    for i, j in T.Parallel(C, C):  # above the diagonal T_s holds zeros or nothing
        X[i, j] = T.if_then_else(j <= i, T_s[i, j], 0.0)
