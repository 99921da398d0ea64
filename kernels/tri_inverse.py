"""Building block: T = (I + A)⁻¹ for a strictly lower triangular C×C block A, by blocked forward
substitution: the 16×16 diagonal blocks by substitution in float32, then merges 16 → 32 → 64 of
only the blocks the merge fills, the last one's two 32×32×32 products on the tensor cores (tf32).

Why this method (MATH.md, "Computing T_r"): every intermediate it forms is bounded by 1 in size
for the matrices the delta rule inverts, A = StrictLower(diag(β) K Kᵀ) with unit-norm keys and
β ∈ [0, 1], whatever the keys are — identical keys (a repeated token) included. Neumann doubling,
(I − A)(I + A²)(I + A⁴)…, forms the powers of A, which reach 1e17 on such keys while T stays ≤ 1,
and cancels catastrophically in any finite precision.

    1. substitution: each diagonal 16-block T_bb = (I + A_bb)⁻¹ by column sweeps,
       T[i, :] −= A[i, j] T[j, :] for i > j, j = 0…14, one warp a block, in registers;
    2. merges: a 2w block's lower-left w-block is T₂₁ = −T₂₂ (A₂₁ T₁₁), T₁₁ and T₂₂ being the w×w
       inverses found so far: at w = 16 for the two pairs of 16-blocks (CUDA cores, float32), at
       w = 32 for the one pair of 32-blocks (two tf32 `T.gemm`s, mma.sync: wgmma needs 64 rows).
       Each merge is two w×w×w products, and only those: no zero block of A or T rides along.

Why every intermediate is bounded by 1. Fix a column j of T and solve (I + A) x = e_j by rows:
x_i = −β_i k_iᵀ u_{i−1}, with u_i = Σ_{l ≤ i} k_l x_l. Then u_i = (I − β_i k_i k_iᵀ) u_{i−1}, and
‖I − β k kᵀ‖ ≤ 1 for ‖k‖ = 1, β ∈ [0, 2], so ‖u_i‖ ≤ ‖u_j‖ = ‖k_j‖ = 1 and |x_i| ≤ β_i ≤ 1:
|T_ij| ≤ 1. The same argument bounds what the method forms on the way: a column sweep's partial
sum T[i, c] after step j is −β_i k_iᵀ u_j (≤ 1); the diagonal blocks are inverses of the same kind;
a merge's A₂₁ T₁₁ holds rows β_i k_iᵀ of block 2 against the u's that block 1 ends in (≤ 1), and
−T₂₂ (A₂₁ T₁₁) the final entries of T (≤ 1). So each float32 sum rounds values of size ≤ 1 into
values of size ≤ 1: no cancellation beyond a few units of the last place, whatever the keys.

Why tf32 in the last merge is safe, where it was not in Neumann doubling: its operands are
bounded by 1, so rounding them to 10 mantissa bits errs by at most 2⁻¹¹ of values ≤ 1, and its
float32 accumulation adds nothing comparable; Neumann's operands were 1e17. Replayed against a
float64 solve (tests/test_tri_inverse.py, C = 64, K = 128): relative error ≤ 1e-3 on the worst
keys (U[0, 1) with β = 1: 7e-4), below the bf16 rounding T gets when it is stored (1e-3 there).
Rounded to nearest, not truncated: mma.sync reads a float32 operand by dropping its low 13 bits,
which pulls every operand toward zero, and an error of one sign adds up over a sequence's chunks
where nothing decays: at g = 0 on U[0, 1) keys, through the emulated kernels (bf16 roundings as
on the GPU), truncation made d β's error 10 % and o's 3 % larger than a float32 merge's, and the
H200's real-data test failed on it; rounded, o and every gradient stay within 3 % of the float32
merge's error (d β; o 1 % below it). The merge on the CUDA cores was 0.26 ms of the 16/64-head
prep's 0.85 on the H200; as two tf32 products, 0.10 (benchmarks/NOTES.md, sessions 17 and 18).

The lowering allocates the scratch buffers listed in SCRATCH and calls the macro:

    unit_lower_inverse(A_s, X, X_D_s, X_P_s, X_A21_s, X_T11_s, X_T22_s, X_M_s, C, WARPS)

WARPS is the kernel's threads / 32. A_s (float32, shared) is the input, and T is built in its
place: each step overwrites only blocks of A that no later step reads (the diagonal 16-blocks once
their warp has swept them, a merge's A₂₁ once its first product is formed), so A and T share one
C×C block: the GDN prep's shared memory 51 → 34 KB, 4 → 6 CTAs an SM (with the schedule's
Kernel.ctas_per_sm), 0.61 → 0.60 ms at 16/64 heads on the H200 — the prep is bound by its
shared-memory traffic more than by the CTAs that hide its latency (benchmarks/NOTES.md, session
23). Above the diagonal A_s keeps what it held; every read of T there is masked.
X (float32 fragment) receives T with zeros above the diagonal. D_s (C×16, float32) receives the
diagonal 16-blocks of T from the warps that solved them, for the 16 → 32 merge's operands. P_s
(C×16, float32) holds each 16 → 32 merge's first product A₂₁ T₁₁, which the second reads across
threads. A21_s, T11_s, T22_s and M_s (32×32, float32) are the 32 → 64 merge's operands and first
product, unpadded blocks as the tensor-core product reads them.

QLA_PREP_PAD (tri_inverse_scratch.PAD, on by default) changes layouts and vector widths only,
for the prep's shared-memory traffic, which bounds it (above): D_s's rows padded to 20 floats
(the allocation comes from SCRATCH; why, in tri_inverse_scratch.py), the substitution's results
stored into D_s and A_s 4 floats at a time, and the last merge's operands staged 4 floats at a
time. Every float32 operation is the one it was, in the same order, so T is bit for bit the same:
the generated CUDA of both, run on the CPU from the substitution to the staged operands, writes
the same bits (tests/test_tri_inverse.py); what follows the staging is the same code.

QLA_PREP_COLUMNS (tri_inverse_scratch.COLUMNS, off until timed) deals the substitution's lanes by
columns instead of rows (_substitute_by_columns): a sweep step takes one shuffle instead of eight,
and A's entries come 4 a load. Every element sees the same float32 operations in the same order:
the same bits again (tests/test_tri_inverse.py). The GDN prep's PTX: 125 → 20 shuffles, 402 → 315
shared-memory and shuffle instructions, 2411 → 1910 in all, 79 registers either way.
"""
import tilelang.language as T

# the constants live where the passes can read them without importing TileLang
from .tri_inverse_scratch import BLOCK, COLUMNS, INPUT_DTYPE, PAD, SCRATCH  # noqa: F401
from .tri_inverse_scratch import HALF as PAIR  # the blocks the first merge makes, the second multiplies


@T.macro
def _substitute(A_s, D_s, C, warps):
    # D_s[i, c] = T[i, b0 + c] for the 16-block b0 of row i, each block by one warp (the kernel's
    # `warps` take the C / 16 blocks in turn): column sweeps, at step j every row below j takes
    # row j's multiple. Lane l holds row l // 2, columns 8 (l % 2) … 8 (l % 2) + 7, in registers;
    # row j's values come from its two lanes by shuffles, final at step j (its last update was at
    # step j − 1). No block-wide barrier between the 15 steps, where a sweep over shared memory
    # needs one per step: 0.69 → 0.61 ms for the 16/64-head prep on the H200, T bit for bit the
    # same (the same float32 operations in the same order; NOTES, session 18)
    tx = T.get_thread_binding()
    lane = tx % 32
    d = T.alloc_local((BLOCK // 2,), "float32")
    for turn in T.serial((C // BLOCK + warps - 1) // warps):
        block = tx // 32 + turn * warps
        if block < C // BLOCK:
            for c in T.unroll(BLOCK // 2):
                d[c] = T.if_then_else(lane // 2 == (lane % 2) * (BLOCK // 2) + c, 1.0, 0.0)
            for j in T.unroll(BLOCK - 1):
                a = A_s[block * BLOCK + lane // 2, block * BLOCK + j]
                for c in T.unroll(BLOCK // 2):
                    dj = T.shfl_sync(d[c], 2 * j + lane % 2)
                    d[c] = T.if_then_else(lane // 2 > j, d[c] - a * dj, d[c])
            # T's block in A's place: the warp's lanes read only this block of A, but lane 2r + 1
            # reads the columns lane 2r overwrites, so the writes wait for every read (TileLang
            # puts a barrier for this write after read between the sweep and the stores)
            if PAD:
                # a lane's 8 values are 8 consecutive floats of a row in both blocks: scalar stores
                # from lanes 32 bytes apart meet 8-way conflicts in D_s (4-way in A_s), 128-bit
                # ones at most 2-way (D_s's rows 20 floats apart, A_s's 68), in a quarter as many
                # instructions
                for q in T.unroll(BLOCK // 8):
                    col = (lane % 2) * (BLOCK // 2) + 4 * q
                    for v in T.vectorized(4):
                        D_s[block * BLOCK + lane // 2, col + v] = d[4 * q + v]
                    for v in T.vectorized(4):
                        A_s[block * BLOCK + lane // 2, block * BLOCK + col + v] = d[4 * q + v]
            else:
                for c in T.unroll(BLOCK // 2):
                    D_s[block * BLOCK + lane // 2, (lane % 2) * (BLOCK // 2) + c] = d[c]
                    A_s[block * BLOCK + lane // 2, block * BLOCK + (lane % 2) * (BLOCK // 2) + c] = d[c]


def _row(r, half):
    # the block row of a column lane's r-th value (r < 8): rows 4h … 4h + 3 and 8 + 4h … 8 + 4h + 3
    # for the lanes of half h, so one store of the r-th values writes two rows 4 apart: 80 floats
    # in D_s (rows of 20), 272 in A_s (rows of 68), both ≡ 16 mod 32 banks, no conflict
    return (r // 4) * 8 + 4 * half + r % 4


@T.macro
def _substitute_by_columns(A_s, D_s, C, warps):
    # The same column sweeps as _substitute, each element's operations the same and in the same
    # order, with the block's values dealt by columns: lane l holds column l % 16 at 8 rows
    # (_row). Row j's value in the lane's column sits in one lane of the same column, so a step
    # takes one shuffle where the row lanes take eight (120 a block), and the lane reads A's
    # entries for its rows 4 columns a load (24 loads a block, all lanes of a half at one address)
    # instead of one column a step. The shuffles and loads share the MIO pipe that bounds the prep
    tx = T.get_thread_binding()
    lane = tx % 32
    col = lane % BLOCK
    half = lane // BLOCK
    d = T.alloc_local((8,), "float32")
    a = T.alloc_local((8, 4), "float32")
    for turn in T.serial((C // BLOCK + warps - 1) // warps):
        block = tx // 32 + turn * warps
        if block < C // BLOCK:
            for r in T.unroll(8):
                d[r] = T.if_then_else(_row(r, half) == col, 1.0, 0.0)
            for q in T.unroll(BLOCK // 4):
                for r in T.unroll(8):
                    if _row(r, 1) > 4 * q:  # a row below one of the 4 steps, for either half
                        for v in T.vectorized(4):
                            a[r, v] = A_s[block * BLOCK + _row(r, half), block * BLOCK + 4 * q + v]
                for v in T.unroll(4):
                    if 4 * q + v < BLOCK - 1:
                        # T[j, col] for j = 4q + v, from the lane of half (j // 4) % 2 that holds row j
                        dj = T.shfl_sync(d[(4 * q + v) // 8 * 4 + v], col + BLOCK * (q % 2))
                        for r in T.unroll(8):
                            d[r] = T.if_then_else(_row(r, half) > 4 * q + v, d[r] - a[r, v] * dj, d[r])
            # T's block in A's place, after every lane's reads of it (TileLang's barrier, as in
            # _substitute); each store a row pair 4 apart, conflict-free (_row)
            for r in T.unroll(8):
                D_s[block * BLOCK + _row(r, half), col] = d[r]
                A_s[block * BLOCK + _row(r, half), block * BLOCK + col] = d[r]


@T.macro
def _merge_pairs(A_s, D_s, P_s, C):
    # 16 → 32, the pairs p of 16-blocks at once: T[b1 + r, b0 + c] = −Σ_l T₂₂[r, l] (A₂₁ T₁₁)[l, c]
    # with b0 = 32p, b1 = b0 + 16 (T₁₁, T₂₂ in D_s); A₂₁ T₁₁ goes through P_s (rows 16p + l) for
    # the second product, and T₂₁ into A₂₁'s place (the first product's reads of it came before
    # P_s was written, which the second product waits for)
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
        A_s[p * PAIR + BLOCK + r, p * PAIR + c] = -product[p, r, c]


def _tf32(x):
    # float32 rounded to nearest tf32 (the top 19 bits; ties away from zero): mma.sync reads a
    # float32 operand by dropping its low 13 bits, a truncation whose bias (every operand pulled
    # toward zero) adds up across the 32 terms of a product and across a sequence's chunks where
    # nothing decays: at g = 0 on U[0, 1) keys it cost d β 10 % in error, rounded 3 % (NOTES, session 18)
    return T.reinterpret((T.reinterpret(x, "uint32") + T.uint32(0x1000)) & T.uint32(0xFFFFE000), "float32")


@T.macro
def _stage_wide(A_s, A21_s, T11_s, T22_s, warps):
    # the 32 → 64 merge's operands staged 4 floats a load and a store, every load before the
    # first store: staged by T.Parallel, each thread ran 24 scalar load → round → store one after
    # another (a store may alias the next load, for all the compiler knows), 6 LDS.128 then
    # 6 STS.128 at 128 threads. TileLang's swizzle of the mma.sync operands permutes 16-byte chunks
    # of a row, so 4 consecutive columns stay one 128-bit store; 8 lanes' 4 columns make a row of
    # 32: no bank conflict, in A_s either. The rounding runs in a scalar loop between the vector
    # load and store (TileLang finds no vector plan for _tf32's reinterpret and mask, and falls back
    # to scalar stores). T₁₁ and T₂₂ are loaded whole and masked after rounding: the select drops
    # whatever A_s holds above the diagonal, as the masked loads did.
    tx = T.get_thread_binding()
    turns = (PAIR * PAIR // 4 + warps * 32 - 1) // (warps * 32)
    x = T.alloc_local((turns, 3, 4), "float32")
    for turn in T.unroll(turns):
        e = turn * warps * 32 + tx  # row e // 8, columns 4 (e % 8) … 4 (e % 8) + 3 of each operand
        if e < PAIR * PAIR // 4:
            for v in T.vectorized(4):
                x[turn, 0, v] = A_s[PAIR + e // (PAIR // 4), e % (PAIR // 4) * 4 + v]
            for v in T.vectorized(4):
                x[turn, 1, v] = A_s[e // (PAIR // 4), e % (PAIR // 4) * 4 + v]
            for v in T.vectorized(4):
                x[turn, 2, v] = A_s[PAIR + e // (PAIR // 4), PAIR + e % (PAIR // 4) * 4 + v]
    for turn in T.unroll(turns):
        e = turn * warps * 32 + tx
        if e < PAIR * PAIR // 4:
            for v in T.unroll(4):
                x[turn, 0, v] = _tf32(x[turn, 0, v])
                x[turn, 1, v] = T.if_then_else(e % (PAIR // 4) * 4 + v <= e // (PAIR // 4), _tf32(x[turn, 1, v]), 0.0)
                x[turn, 2, v] = T.if_then_else(e % (PAIR // 4) * 4 + v <= e // (PAIR // 4), _tf32(x[turn, 2, v]), 0.0)
            for v in T.vectorized(4):
                A21_s[e // (PAIR // 4), e % (PAIR // 4) * 4 + v] = x[turn, 0, v]
            for v in T.vectorized(4):
                T11_s[e // (PAIR // 4), e % (PAIR // 4) * 4 + v] = x[turn, 1, v]
            for v in T.vectorized(4):
                T22_s[e // (PAIR // 4), e % (PAIR // 4) * 4 + v] = x[turn, 2, v]


@T.macro
def _merge_halves(A_s, A21_s, T11_s, T22_s, M_s, warps):
    # 32 → 64: T[32 + r, c] = −Σ_l T₂₂[r, l] (A₂₁ T₁₁)[l, c] over 32-blocks, both products tf32 on
    # the tensor cores, every operand rounded to tf32 as it is staged; T₁₁ and T₂₂ are read from A_s
    # on and below their diagonals only (above, A_s holds A's zeros or a 16-block's), and T₂₁ goes
    # into A₂₁'s place once the products have read their staged copies
    product = T.alloc_fragment((PAIR, PAIR), "float32")
    if PAD:
        _stage_wide(A_s, A21_s, T11_s, T22_s, warps)
    else:
        for r, c in T.Parallel(PAIR, PAIR):
            A21_s[r, c] = _tf32(A_s[PAIR + r, c])
            T11_s[r, c] = T.if_then_else(c <= r, _tf32(A_s[r, c]), 0.0)
            T22_s[r, c] = T.if_then_else(c <= r, _tf32(A_s[PAIR + r, PAIR + c]), 0.0)
    T.gemm(A21_s, T11_s, product, clear_accum=True)
    for r, c in T.Parallel(PAIR, PAIR):
        M_s[r, c] = _tf32(product[r, c])
    T.gemm(T22_s, M_s, product, clear_accum=True)
    for r, c in T.Parallel(PAIR, PAIR):
        A_s[PAIR + r, c] = -product[r, c]


@T.macro
def unit_lower_inverse(A_s, X, D_s, P_s, A21_s, T11_s, T22_s, M_s, C, warps):
    # (a macro's Python-level branches are resolved when it is parsed, so every block width
    # below is a constant in the kernel; `warps`: the kernel's threads / 32)
    if COLUMNS:
        _substitute_by_columns(A_s, D_s, C, warps)
    else:
        _substitute(A_s, D_s, C, warps)
    if C >= PAIR:
        _merge_pairs(A_s, D_s, P_s, C)
    if C == 2 * PAIR:
        _merge_halves(A_s, A21_s, T11_s, T22_s, M_s, warps)
    for i, j in T.Parallel(C, C):  # T on and below the diagonal; above it, what A_s held
        X[i, j] = T.if_then_else(j <= i, A_s[i, j], 0.0)
