"""Where the solve-only prep's time goes: the generated prep at one shape, and variants of it with
one part removed or replaced, timed alone on the GPU (an experiment; the variants' results are
wrong on purpose where a part is removed).

    python benchmarks/prep_variants.py --compile        # CPU: compile every variant into the cache
    python benchmarks/prep_variants.py --time           # GPU: time each (16/64 heads, 8 x 4096 tokens)
                                                        # and T's error against a float64 solve

The variants of earlier sessions that were measured and set aside (the three-pass tf32 merges, the
16 → 32 merge on the tensor cores, the shared-memory sweeps, heads_first, heads_shared) are in
this file as of caca352; benchmarks/NOTES.md has their results.
"""
import argparse
import re
import sys
import time

import qla_compiler
from qla_compiler.kernels.runtime import compile_prim, import_module, write_source
from qla_compiler.passes.lower_tilelang import ShapeClass, lower

SHAPE = ShapeClass(H=16, HV=64, K=128, V=128, BV=64, io="bfloat16")
INV = "unit_lower_inverse(A_r_s, T_r, T_r_D_s, T_r_P_s, T_r_A21_s, T_r_T11_s, T_r_T22_s, T_r_M_s, C, 4)"

def base_source() -> str:
    """The fused forward's module as generated."""
    prog = qla_compiler.compile_spec("gdn").fused_program
    return lower(prog.kernels, SHAPE, prog.path)


def variants() -> dict:
    src = base_source()
    assert INV in src, "the prep no longer calls the inverse as this experiment expects"
    imp = "from qla_compiler.kernels.tri_inverse import unit_lower_inverse"
    macros = imp + ", _substitute, _merge_pairs"

    def inverse_by(*steps):
        """The prep with its inverse call replaced by `steps`, then T_r read out of A_r_s as the
        building block does (the variants timing parts of the inverse)."""
        body = "\n        ".join(steps + ("for i, j in T.Parallel(C, C):",
                                        "    T_r[i, j] = T.if_then_else(j <= i, A_r_s[i, j], 0.0)"))
        return src.replace(imp, macros).replace(INV, body)

    bounds = re.search(r"\n        T\.annotate_min_blocks_per_sm\(\d+\)[^\n]*", src)
    assert bounds, "the prep no longer asks for its CTAs an SM"
    out = {"base": src}
    # (session 23) T built in A's place leaves 34 KB of shared memory: 6 CTAs an SM fit, and the
    # registers ptxas chooses alone (96) allow 5; asked for 6 it fits the prep in 79, no spills
    out["ptxas_registers"] = src.replace(bounds.group(0), "", 1)
    out["no_inverse"] = src.replace(INV, "for i, j in T.Parallel(C, C):\n            T_r[i, j] = A_r_s[i, j]")
    out["substitute_only"] = inverse_by("_substitute(A_r_s, T_r_D_s, C, 4)")
    out["no_halves_merge"] = inverse_by("_substitute(A_r_s, T_r_D_s, C, 4)", "_merge_pairs(A_r_s, T_r_D_s, T_r_P_s, C)")
    # no gate scaling: T leaves as T_r
    out["no_gate_scale"] = re.sub(r"T\.cast\(\(T_r\[i, j\] \* T\.if_then_else\(j <= i, T\.exp2\(.*?\), 0\.0\)\), IO\)",
                                  "T.cast(T_r[i, j], IO)", src)
    assert out["no_gate_scale"] != src
    out["no_cumsum"] = re.sub(r"for j in T\.unroll\(C\):.*?\n(\s+)for i in T\.Parallel\(C\):\n\s+g_cum_s_acc\[i\] \+= .*?\n",
                              "for i in T.Parallel(C):\n\\1g_cum_s_acc[i] = g_floored_s[i]\n", src, count=1, flags=re.S)
    assert out["no_cumsum"] != src
    # (session 23) the chunk-local cumsum as a scan by warp shuffles: 5 steps in each of two warps
    # and one add across them, where the generated loop reads C values from shared memory in each
    # of C threads (no_cumsum: ~0.04 ms of the 0.60)
    sweep = re.search(r"\n( *)for i in T\.Parallel\(C\):\n *g_cum_s_acc\[i\] = 0\.0\n"
                      r" *for j in T\.unroll\(C\):[^\n]*\n *for i in T\.Parallel\(C\):\n *g_cum_s_acc\[i\] \+= [^\n]*\n"
                      r" *T\.copy\(g_cum_s_acc, g_cum_s\)\n", src)
    assert sweep, "the prep's cumsum is no longer the loop this variant replaces"
    sp = sweep.group(1)
    steps = "".join(f"{sp}up = T.shfl_sync(running[0], lane_tx % 32 - {d})\n"
                    f"{sp}running[0] = T.if_then_else(lane_tx % 32 >= {d}, running[0] + up, running[0])\n"
                    for d in (1, 2, 4, 8, 16))
    out["cumsum_by_shuffles"] = src.replace(sweep.group(0), (
        f"\n{sp}lane_tx = T.get_thread_binding()\n"
        f"{sp}running = T.alloc_local((1,), \"float32\")\n"
        f"{sp}running[0] = T.if_then_else(lane_tx < C, g_floored_s[lane_tx % C], 0.0)\n" + steps +
        f"{sp}if lane_tx < C:\n{sp}    g_cum_s[lane_tx] = running[0]\n"
        f"{sp}T.sync_threads()\n"
        f"{sp}if lane_tx >= 32 and lane_tx < C:\n{sp}    g_cum_s[lane_tx] = running[0] + g_cum_s[31]\n"))
    return out


def compiled(name: str, src: str):
    path = write_source(f"prepexp_{name}", src)
    return compile_prim(import_module(path).gdn_prep, "gdn_prep", name, path, progress=False)


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
