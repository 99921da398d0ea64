"""Building block: (I + A)⁻¹ for a strictly lower triangular C×C block A, on tensor cores.

A is nilpotent (A^C = 0), so (I + A)⁻¹ = (I − A)(I + A²)(I + A⁴)…(I + A^{C/2}): log₂C − 1
squarings, each two C×C matmuls, X·P and P² issued together (they are independent). Products
run as tf32 wgmma, which needs both operands K-major: the right-hand factor is kept transposed
(`PT_s`). In float32 on unit-norm keys with C = 64 this lands near 1e-7 relative error (MATH.md);
tf32 inputs round to 10 mantissa bits, ~5e-4.

The lowering allocates the scratch buffers listed in SCRATCH and calls the macro:

    unit_lower_inverse(A_s, X, X_s, PT_s, P_f)     # X (fragment) = (I + A_s)⁻¹; A_s is overwritten

A_s itself holds the running power P (A, A², A⁴, …): the kernel's peak shared memory is during
the inverse, and a separate copy of P would be 16 KB more of it (at C = 64, in tf32).
"""
import tilelang.language as T

# name suffix -> (scope, dtype) of the scratch buffers, all C×C
SCRATCH = {"X_s": ("shared", "tfloat32"), "PT_s": ("shared", "tfloat32"), "P_f": ("fragment", "float32")}


def squarings(C: int) -> int:
    return max(C.bit_length() - 2, 0)  # A², A⁴, …, A^{C/2}


@T.macro
def unit_lower_inverse(A_s, X, X_s, PT_s, P_f, C, steps):
    # X = I − A (kept in shared as the left factor), P = A (in A_s), PT = Aᵀ
    for i, j in T.Parallel(C, C):
        X_s[i, j] = T.if_then_else(i == j, 1.0, 0.0) - A_s[i, j]
        PT_s[j, i] = A_s[i, j]
    T.copy(X_s, X)
    T.gemm(A_s, PT_s, P_f, transpose_B=True, clear_accum=True)  # P = A²
    # X·P and the next P² both read only P (and X's copy), so they run on the tensor cores side by
    # side: the chain is one product per squaring (plus the last X·P), not two
    for _ in T.serial(steps - 1):
        T.copy(P_f, A_s)
        for i, j in T.Parallel(C, C):
            PT_s[j, i] = P_f[i, j]
        T.wgmma_gemm(X_s, PT_s, X, transpose_B=True)  # X ← X + X·P = X (I + P), no wait
        T.wgmma_gemm(A_s, PT_s, P_f, transpose_B=True, clear_accum=True)  # P ← P², no wait
        T.wait_wgmma(0)  # both done: A_s, PT_s and X_s may be written again
        T.copy(X, X_s)
    for i, j in T.Parallel(C, C):
        PT_s[j, i] = P_f[i, j]
    T.gemm(X_s, PT_s, X, transpose_B=True)  # the last factor, I + A^{C/2}
