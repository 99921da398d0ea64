"""Where the solve-only prep's time goes: the generated prep at one shape, and variants of it with
one part removed or replaced, timed alone on the GPU (an experiment; the variants' results are
wrong on purpose where a part is removed).

    python benchmarks/prep_variants.py --compile        # CPU: compile every variant into the cache
    python benchmarks/prep_variants.py --time           # GPU: time each (16/64 heads, 8 x 4096 tokens)
                                                        # and T's error against a float64 solve
"""
import argparse
import re
import sys
import time

import qla_compiler
from qla_compiler.kernels.runtime import BACKEND, TARGET, import_module, write_source
from qla_compiler.passes.lower_tilelang import ShapeClass, lower

SHAPE = ShapeClass(H=16, HV=64, K=128, V=128, BV=64, io="bfloat16")
INV = "unit_lower_inverse(A_r_s, T_r, T_r_D_s, T_r_T_s, T_r_P_s, T_r_A21_s, T_r_T11_s, T_r_T22_s, T_r_M_s, C, 4)"

# the 32 → 64 merge with each product in three tf32 passes (a = a_hi + a_lo, with a_hi a's top 19
# bits: a_hi b_hi + a_hi b_lo + a_lo b_hi), about float32's accuracy (FLA's FLA_TRIL_PRECISION=tf32x3);
# the inverse's four 32×32 scratch blocks hold the operands' high and low parts
GEMM3_MERGE = '''
@T.macro
def _split(x, hi, lo):
    for r, c in T.Parallel(32, 32):
        hi[r, c] = T.reinterpret(T.reinterpret(x[r, c], "uint32") & T.uint32(0xFFFFE000), "float32")
        lo[r, c] = x[r, c] - T.reinterpret(T.reinterpret(x[r, c], "uint32") & T.uint32(0xFFFFE000), "float32")


@T.macro
def _product3(a_hi, a_lo, b_hi, b_lo, acc):
    T.gemm(a_hi, b_hi, acc, clear_accum=True)
    T.gemm(a_hi, b_lo, acc)
    T.gemm(a_lo, b_hi, acc)


@T.macro
def _halves3(A_s, X, T_s, C, a_hi, a_lo, b_hi, b_lo, x, acc):
    # the 32 → 64 merge, T₂₁ = −T₂₂ (A₂₁ T₁₁) on 32-blocks, and T's copy out of T_s
    for r, c in T.Parallel(32, 32):
        x[r, c] = A_s[32 + r, c]
    _split(x, a_hi, a_lo)
    for r, c in T.Parallel(32, 32):
        x[r, c] = T.if_then_else(c <= r, T_s[r, c], 0.0)
    _split(x, b_hi, b_lo)
    _product3(a_hi, a_lo, b_hi, b_lo, acc)
    _split(acc, b_hi, b_lo)
    for r, c in T.Parallel(32, 32):
        x[r, c] = T.if_then_else(c <= r, T_s[32 + r, 32 + c], 0.0)
    _split(x, a_hi, a_lo)
    _product3(a_hi, a_lo, b_hi, b_lo, acc)
    for r, c in T.Parallel(32, 32):
        T_s[32 + r, c] = -acc[r, c]
    for i, j in T.Parallel(C, C):
        X[i, j] = T.if_then_else(j <= i, T_s[i, j], 0.0)


@T.macro
def inverse_gemm3_merge(A_s, X, D_s, T_s, P_s, a_hi, a_lo, b_hi, b_lo, C, warps):
    _substitute(A_s, D_s, T_s, C, warps)
    _merge_pairs(A_s, D_s, T_s, P_s, C)
    x = T.alloc_fragment((32, 32), "float32")
    acc = T.alloc_fragment((32, 32), "float32")
    _halves3(A_s, X, T_s, C, a_hi, a_lo, b_hi, b_lo, x, acc)
'''

# both merges on the tensor cores, three-pass tf32: the 16 → 32 merge of the two pairs at once as
# 32×32 products of block-diagonal operands, blockdiag(A₂₁⁰, A₂₁¹) · blockdiag(T₁₁⁰, T₁₁¹) (the zero
# blocks ride along: four times the flops of the two 16×16 products, nothing on the tensor cores)
GEMM3_BOTH = GEMM3_MERGE + '''

@T.macro
def inverse_gemm3_both(A_s, X, D_s, T_s, P_s, a_hi, a_lo, b_hi, b_lo, C, warps):
    _substitute(A_s, D_s, T_s, C, warps)
    x = T.alloc_fragment((32, 32), "float32")
    acc = T.alloc_fragment((32, 32), "float32")
    # pair p's blocks at rows and columns 16p of the 32×32 operands
    for r, c in T.Parallel(32, 32):
        x[r, c] = T.if_then_else(r // 16 == c // 16, A_s[32 * (r // 16) + 16 + r % 16, 32 * (r // 16) + c % 16], 0.0)
    _split(x, a_hi, a_lo)
    for r, c in T.Parallel(32, 32):
        x[r, c] = T.if_then_else(r // 16 == c // 16, D_s[32 * (r // 16) + r % 16, c % 16], 0.0)
    _split(x, b_hi, b_lo)
    _product3(a_hi, a_lo, b_hi, b_lo, acc)
    _split(acc, b_hi, b_lo)
    for r, c in T.Parallel(32, 32):
        x[r, c] = T.if_then_else(r // 16 == c // 16, D_s[32 * (r // 16) + 16 + r % 16, c % 16], 0.0)
    _split(x, a_hi, a_lo)
    _product3(a_hi, a_lo, b_hi, b_lo, acc)
    for r, c in T.Parallel(32, 32):
        if r // 16 == c // 16:
            T_s[32 * (r // 16) + 16 + r % 16, 32 * (r // 16) + c % 16] = -acc[r, c]
    _halves3(A_s, X, T_s, C, a_hi, a_lo, b_hi, b_lo, x, acc)
'''


# the 16 → 32 merge on the tensor cores too, single-pass tf32 as main's 32 → 64 merge: both pairs at
# once as 32×32 products of block-diagonal operands
PAIRS_GEMM = '''
@T.macro
def _pairs_gemm(A_s, D_s, T_s, A21_s, T11_s, T22_s, M_s):
    product = T.alloc_fragment((32, 32), "float32")
    for r, c in T.Parallel(32, 32):
        A21_s[r, c] = T.if_then_else(r // 16 == c // 16, A_s[32 * (r // 16) + 16 + r % 16, 32 * (r // 16) + c % 16], 0.0)
        T11_s[r, c] = T.if_then_else(r // 16 == c // 16, D_s[32 * (r // 16) + r % 16, c % 16], 0.0)
        T22_s[r, c] = T.if_then_else(r // 16 == c // 16, D_s[32 * (r // 16) + 16 + r % 16, c % 16], 0.0)
    T.gemm(A21_s, T11_s, product, clear_accum=True)
    T.copy(product, M_s)
    T.gemm(T22_s, M_s, product, clear_accum=True)
    for r, c in T.Parallel(32, 32):
        if r // 16 == c // 16:
            T_s[32 * (r // 16) + 16 + r % 16, 32 * (r // 16) + c % 16] = -product[r, c]
'''

# the 16-blocks' substitution as a sweep over shared memory, the block's threads over (row, column),
# a block-wide barrier between its 15 steps (main's method until session 18)
SHARED_SWEEPS = '''
@T.macro
def _substitute_shared(A_s, D_s, T_s, C):
    for i, c in T.Parallel(C, 16):
        D_s[i, c] = T.if_then_else(i % 16 == c, 1.0, 0.0)
    for j in T.serial(15):
        for i, c in T.Parallel(C, 16):
            if i % 16 > j:
                D_s[i, c] -= A_s[i, i - i % 16 + j] * D_s[i - i % 16 + j, c]
    for i, c in T.Parallel(C, 32):
        T_s[i, i - i % 32 + c] = T.if_then_else(i % 32 // 16 == c // 16, D_s[i, c % 16], 0.0)
'''


def base_source(heads_first: bool = False) -> str:
    """The fused forward's module as generated; `heads_first`: its prep's grid with the value heads
    as the fastest-varying axis (a chunk's G value heads side by side, reading its keys once from
    HBM: FlashQLA's solve orders its grid so)."""
    prog = qla_compiler.compile_spec("gdn").fused_program
    if heads_first:
        from grid_order import heads_first as flipped

        prog = flipped(prog)
    return lower(prog.kernels, SHAPE, prog.path)


def variants() -> dict:
    src = base_source()
    assert INV in src, "the prep no longer calls the inverse as this experiment expects"
    imp = "from qla_compiler.kernels.tri_inverse import unit_lower_inverse"
    macros = imp + ", _substitute, _merge_pairs, _merge_halves"

    def inverse_by(*steps, defs=""):
        """The prep with its inverse call replaced by `steps`, then T_r read out of T_s as the
        building block does; `defs`: the macros the steps call."""
        body = "\n        ".join(steps + ("for i, j in T.Parallel(C, C):",
                                        "    T_r[i, j] = T.if_then_else(j <= i, T_r_T_s[i, j], 0.0)"))
        return src.replace(imp, macros + "\n" + defs).replace(INV, body)

    def macro_instead(name, defs):
        """The prep calling `name`, with the inverse's arguments, instead of the building block."""
        return src.replace(imp, macros + "\n" + defs).replace(INV, INV.replace("unit_lower_inverse", name))

    substitute = "_substitute(A_r_s, T_r_D_s, T_r_T_s, C, 4)"
    shared_sweeps = "_substitute_shared(A_r_s, T_r_D_s, T_r_T_s, C)"
    pairs = "_merge_pairs(A_r_s, T_r_D_s, T_r_T_s, T_r_P_s, C)"
    pairs_gemm = "_pairs_gemm(A_r_s, T_r_D_s, T_r_T_s, T_r_A21_s, T_r_T11_s, T_r_T22_s, T_r_M_s)"
    halves = "_merge_halves(A_r_s, T_r_T_s, T_r_A21_s, T_r_T11_s, T_r_T22_s, T_r_M_s)"
    out = {"base": src}
    out["no_inverse"] = src.replace(INV, "for i, j in T.Parallel(C, C):\n            T_r[i, j] = A_r_s[i, j]")
    out["substitute_only"] = inverse_by(substitute)
    out["no_halves_merge"] = inverse_by(substitute, pairs)
    out["gemm3_halves_merge"] = macro_instead("inverse_gemm3_merge", GEMM3_MERGE)
    out["gemm_both_merges"] = inverse_by(substitute, pairs_gemm, halves, defs=PAIRS_GEMM)
    out["shared_sweeps"] = inverse_by(shared_sweeps, pairs, halves, defs=SHARED_SWEEPS)
    out["gemm3_both_merges"] = macro_instead("inverse_gemm3_both", GEMM3_BOTH)
    # no gate scaling: T leaves as T_r
    out["no_gate_scale"] = re.sub(r"T\.cast\(\(T_r\[i, j\] \* T\.if_then_else\(j <= i, T\.exp2\(.*?\), 0\.0\)\), IO\)",
                                  "T.cast(T_r[i, j], IO)", src)
    assert out["no_gate_scale"] != src
    out["heads_first"] = base_source(heads_first=True)
    assert "with T.Kernel(HV, CH, threads=128) as (i_hv, i_slot):" in out["heads_first"]
    out["threads256"] = src.replace("with T.Kernel(CH, HV, threads=128)", "with T.Kernel(CH, HV, threads=256)", 1)
    out["no_cumsum"] = re.sub(r"for j in T\.unroll\(C\):.*?\n(\s+)for i in T\.Parallel\(C\):\n\s+g_cum_s_acc\[i\] \+= .*?\n",
                              "for i in T.Parallel(C):\n\\1g_cum_s_acc[i] = g_floored_s[i]\n", src, count=1, flags=re.S)
    assert out["threads256"] != src and out["no_cumsum"] != src
    # one CTA per (chunk, key head) for its G value heads: the prep's per-CTA fixed work (the keys'
    # load, KKt on wgmma, the waits) is ~0.33 ms of its 0.61 ms at 16/64:8x4096 on the H200 (the
    # `no_inverse` variant), paid once per value head though the G value heads read the same keys;
    # shared here, it is paid once per key head. Per value head (a serial loop) the base's own
    # statements: g, β, the cumsum, A, the inverse, the gate scaling, the stores (T bit for bit the
    # base's); KKt stays in its fragment across the loop
    out["heads_shared"] = heads_shared(src)
    return out


def heads_shared(src: str) -> str:
    """`src` with its prep's grid over (chunk, key head) and its per-value-head part in a loop over
    the key head's G value heads, the keys loaded and KKt formed once before it."""
    start = src.index("@T.prim_func\ndef gdn_prep(")
    end = src.index("\n\n\n", start)
    prep = src[start:end]
    grid = "with T.Kernel(CH, HV, threads=128) as (i_slot, i_hv):\n        i_h = i_hv // G\n"
    assert prep.count(grid) == 1, "the prep's grid is no longer (chunk, value head)"
    prep = prep.replace(grid, "with T.Kernel(CH, H, threads=128) as (i_slot, i_h):\n")
    # everything after the keys' TMA load is per value head, but the wait, the padding rows' zeroing
    # and KKt: those move before the loop (the barrier is waited on once, in phase 0)
    load = re.search(r"\n        T\.tma_copy\(k\[0, t0:t0 \+ C, i_h, 0:K\], k_s, .*?\n", prep)
    assert load, "the prep no longer loads its keys by one TMA copy"
    head, per_head = prep[:load.end()], prep[load.end():]
    once = re.search(r"        T\.mbarrier_wait_parity\(k_s_bar\[0\], 0\)\n"
                     r"        if n_valid < C:.*?\n"
                     r"        T\.gemm\(k_s, k_s, KKt, [^\n]*\n", per_head, flags=re.S)
    assert once, "the prep's key wait, padding and KKt are no longer as this variant expects"
    per_head = per_head[:once.start()] + per_head[once.end():]
    assert "i_h" not in per_head.replace("i_hv", "") and "k_s" not in per_head and "KKt[i, j]" in per_head
    loop = ("        for gi in T.serial(G):\n"
            "            i_hv = i_h * G + gi\n"
            + "".join("    " + ln if ln.strip() else ln for ln in per_head.splitlines(True))
            # the next value head overwrites g_s, β, g_cum_s and T_rows_s, which this one's stores read
            + "\n            T.sync_threads()")
    out = src[:start] + head + once.group(0) + loop + src[end:]
    assert out.count("for gi in T.serial(G):") == 1
    return out


def compiled(name: str, src: str):
    import tilelang
    mod = import_module(write_source(f"prepexp_{name}", src))
    return tilelang.compile(mod.gdn_prep, target=TARGET, execution_backend=BACKEND)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    vs = variants()
    if a.only:
        vs = {n: s for n, s in vs.items() if n in a.only}
    if a.compile:
        for n, s in vs.items():
            t = time.time()
            try:
                compiled(n, s)
                print(f"{n}: compiled in {time.time() - t:.0f} s", flush=True)
            except Exception as e:  # a variant TileLang refuses is a finding, not a crash
                print(f"{n}: FAILED {type(e).__name__}: {str(e)[-800:]}", flush=True)
    if a.time:
        import torch
        B, T_, H, HV, K, C = 8, 4096, SHAPE.H, SHAPE.HV, SHAPE.K, 64
        tok, dev = B * T_, "cuda"
        gen = torch.Generator(device=dev).manual_seed(0)
        # keys from U[0, 1), normalised (FLA's tests: every pair's cosine ≈ 0.75, the inverse's worst
        # ordinary case), β ∈ [0, 1), mild decay
        k64 = torch.nn.functional.normalize(torch.rand(1, tok, H, K, device=dev, generator=gen, dtype=torch.float64), dim=-1)
        k = k64.to(torch.bfloat16)
        g = -0.1 * torch.rand(1, tok, HV, device=dev, generator=gen)
        beta = torch.rand(1, tok, HV, device=dev, generator=gen)
        starts = torch.arange(0, tok, C, device=dev, dtype=torch.int32)
        chunk_map = torch.stack([starts, torch.full_like(starts, C)], 1).contiguous()
        g_cum = torch.empty(1, tok, HV, device=dev)
        T_rows = torch.empty(1, tok, HV, C, device=dev, dtype=torch.bfloat16)
        # the float64 reference: T = (I + StrictLower(diag(β) K Kᵀ))⁻¹ ⊙ exp(g_i − g_j) on i ≥ j, per chunk and
        # value head, from the keys as the kernel reads them (bf16)
        kc = k.double().view(tok // C, C, H, K).repeat_interleave(HV // H, dim=2).permute(0, 2, 1, 3)
        bc = beta.double().view(tok // C, C, HV).permute(0, 2, 1)
        A = torch.tril(bc[..., None] * (kc @ kc.transpose(-1, -2)), -1)
        Tr = torch.linalg.inv(torch.eye(C, device=dev, dtype=torch.float64) + A)
        gc = g.double().view(tok // C, C, HV).permute(0, 2, 1).cumsum(-1)
        ref = torch.tril(Tr * torch.exp(gc[..., :, None] - gc[..., None, :])).permute(0, 2, 1, 3).reshape(1, tok, HV, C)
        del kc, A, Tr
        for n, src in vs.items():
            try:
                kern = compiled(n, src)
            except Exception as e:  # noqa: BLE001
                print(f"{n}: FAILED {type(e).__name__}: {str(e)[-300:]}", flush=True)
                continue
            kern(k, g, beta, chunk_map, g_cum, T_rows)
            torch.cuda.synchronize()
            err = float((T_rows.double() - ref).norm() / ref.norm())
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ms = []
            for _ in range(5):
                e0.record()
                for _ in range(20):
                    kern(k, g, beta, chunk_map, g_cum, T_rows)
                e1.record()
                torch.cuda.synchronize()
                ms.append(e0.elapsed_time(e1) / 20)
            print(f"{n:20s} {min(ms):.4f} ms   T against float64: {err:.2e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
