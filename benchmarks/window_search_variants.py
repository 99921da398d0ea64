"""Where the window search's time goes (kernels/window_search.py): the kernel as generated and
variants of its source with one part changed, timed alone on the GPU on qla-bench's inputs, each
one's skips compared with the generated kernel's (an experiment, session 23).

    python benchmarks/window_search_variants.py --compile     # CPU: every variant into the cache
    python benchmarks/window_search_variants.py               # GPU: the table

Why: at 2/8:1x32768 cut in 8 segments the search took 0.080 ms of a 0.384 ms call (H200, session
23), the same at 4/16 (4 segments) and 8/32 (2), though its windows there are ~4 chunks long
(qla-bench's gates, log σ(x + 3): ~ −0.08 a token, −NEGLIGIBLE = −16.6): ~20 µs a chunk walked.
Unrolling the ‖k‖² loop (its 128 loads in flight together) changed nothing measurable. The
variants:
  norms given     ‖k‖² read from a [T, H] float32 input (one torch op before the launch) instead of
                  summed over K from the keys: whether the keys' loads are the cost (0.0098 ms
                  against 0.0735 ms at 2/8 when each thread read its own key's row; since session
                  24 the kernel loads the chunk's keys coalesced into shared memory first)
  float32 total   the window's running sum in float32, not float64 (results may differ near the
                  threshold; the comparison says how often)
  gate only       λ = the log decay alone, no delta factor: what walking and summing cost
  one thread      the λ sum by one thread, whether it reached −NEGLIGIBLE broadcast through shared
                  memory (the 64 float64 adds once a chunk, not in each of 64 threads; a barrier
                  after it)
"""
import argparse
import re
import sys
import time

ROWS = {"2/8:1x32768": (2, 8, 8), "4/16:1x32768": (4, 16, 4), "8/32:1x32768": (8, 32, 2)}  # H, HV, segments
K, C = 128, 64


def variants(H: int, HV: int) -> dict:
    from qla_compiler.kernels import window_search

    src = window_search.source(("gate", True), H=H, HV=HV, K=K, io="bfloat16", C=C, reverse=False)
    out = {"as generated": src}
    load = re.search(r"\n *for r, x in T\.Parallel\(C, K\):[^\n]*\n *keys_s\[r, x\] = [^\n]*\n", src)
    loop = re.search(r"\n *norm2\[0\] = 0\.0\n *for x0 in T\.serial\(K // VEC\):\n(?: {24,}[^\n]*\n)+", src)
    assert load and loop and load.end() < loop.start(), "the search no longer sums ‖k‖² as this experiment expects"
    out["norms given"] = (src[:load.start()] + "\n" + src[load.end():loop.start()]
                          + "\n                    norm2[0] = norms[t, i_h]\n" + src[loop.end():]) \
        .replace('    coeff: T.Tensor((Tok, HV), "float32"),',
                 '    coeff: T.Tensor((Tok, HV), "float32"),\n    norms: T.Tensor((Tok, H), "float32"),')
    out["float32 total"] = src.replace('total = T.alloc_local((1,), "float64")', 'total = T.alloc_local((1,), "float32")') \
        .replace('T.cast(lam_s[u], "float64")', "lam_s[u]").replace("total[0] = T.float64(0)", "total[0] = 0.0")
    lam = re.search(r"lam_s\[tx\] = T\.max\((.*), FLOOR\)", src)
    out["gate only"] = src.replace(lam.group(0), "lam_s[tx] = T.max(decay[0, t, i_hv], FLOOR)")
    summed = re.search(r"\n( *)for u in T\.serial\(C\):\n *total\[0\] \+= [^\n]*\n", src)
    indent = summed.group(1)
    out["one thread"] = src.replace(summed.group(0), (
        f"\n{indent}if tx == 0:\n"
        f"{indent}    for u in T.serial(C):\n"
        f"{indent}        total[0] += T.cast(lam_s[u], \"float64\")\n"
        f"{indent}    reached_s[0] = T.if_then_else(total[0] <= -NEGLIGIBLE, 1, 0)\n"
        f"{indent}T.sync_threads()\n")) \
        .replace("                if total[0] <= -NEGLIGIBLE:", "                if reached_s[0] != 0:") \
        .replace('        lam_s = T.alloc_shared((C,), "float32")',
                 '        lam_s = T.alloc_shared((C,), "float32")\n        reached_s = T.alloc_shared((1,), "int32")')
    for name, s in out.items():
        assert name == "as generated" or s != src, f"{name}: the source did not change"
    return out


def compiled(name: str, src: str):
    from qla_compiler.kernels.runtime import compile_prim, import_module, write_source

    path = write_source(f"wsexp_{name.replace(' ', '_')}", src)
    return compile_prim(import_module(path).window_search, "window_search", name, path, progress=False)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--rows", nargs="*", default=list(ROWS))
    a = ap.parse_args()
    for row in a.rows:
        H, HV, segments = ROWS[row]
        vs = variants(H, HV)
        if a.compile:
            for n, s in vs.items():
                t = time.time()
                compiled(n, s)
                print(f"{row} {n}: compiled in {time.time() - t:.0f} s", flush=True)
            continue
        import torch

        import qla_compiler
        from qla_compiler.bench import make_inputs, parse_row
        from qla_compiler.context_parallel import segment_layout
        from qla_compiler.kernels import window_search

        _, _, lens = parse_row(row)
        args = make_inputs(H, HV, lens)
        op = qla_compiler.compile("gdn", target="sm90")
        T_ = sum(lens)
        inputs = {"k": args["k"], "g": args["g"], "beta": args["beta"]}
        layout = segment_layout(args["cu_seqlens"].to(torch.int32), segments, C, T_)
        searched = window_search.arguments(op.program.recurrence, inputs, HV)  # decay, keys, coefficient
        norms = args["k"].float().pow(2).sum(-1).reshape(T_, H).contiguous()
        print(f"{row}, {segments} segments (GPU ms per search; skips against the generated kernel's)")
        base = None
        for n, s in vs.items():
            kern = compiled(n, s)
            skip = torch.empty(layout.cu.numel() - 1, HV, dtype=torch.int32, device="cuda")
            call_args = searched + ([norms] if n == "norms given" else []) + [layout.cu, layout.unused[False], skip]
            kern(*call_args)
            torch.cuda.synchronize()
            if base is None:
                base = skip.clone()
            same = int((skip == base).sum())
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ms = []
            for _ in range(5):
                e0.record()
                for _ in range(20):
                    kern(*call_args)
                e1.record()
                torch.cuda.synchronize()
                ms.append(e0.elapsed_time(e1) / 20)
            print(f"    {n:<16} {min(ms):.4f} ms   skips equal: {same}/{base.numel()}   "
                  f"(mean skip {float(base.float().mean()):.1f} chunks)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
