"""Where the per-key gates' backward out kernels spend their time (issue 18): each kernel as
generated against copies of it with one piece of work taken out, timed alone on the tensors of a
real training step (qla-bench's inputs at 16/16:8x4096), as benchmarks/ablate.py does for GDN's
forward. The copies' results are wrong on purpose: only their times mean something. With
--rewrites, the copies are rewrites that keep the results instead (REWRITES: candidates for the
generator), each timed and checked bitwise against the kernel as generated.

    TILELANG_CACHE_DIR=/tmp/tlc python benchmarks/ablate_backward.py --compile-only   # on the CPU
    python benchmarks/ablate_backward.py                                              # on the GPU
    python benchmarks/ablate_backward.py --rewrites                                   # the rewrites
    python benchmarks/ablate_backward.py --rewrites --only "twice the warpgroups"     # one of them

GDN's backward kernels and the backward preps are here too, for the rewrites that apply to any
kernel (twice the warpgroups: GDN's backward out at 512 threads needs 128 registers a thread and
spills nothing).

Why: GLA's backward out kernel took 5.4 ms at 16/16:8x4096 on the H200 with its VJP products
taken out (session 25), against FLA's whole intra + inter + dv + dA ≈ 3.8 ms; KDA's two out
kernels 4.6 and 3.3 ms. ncu (GLA): one 256-thread CTA an SM (255 registers, 205 KB of shared
memory), 42 % of the stalls on instruction fetch, 192 KB of code (readelf on the cubin, session 26).
Each variant below takes out one kind of work, so the table says which is worth rewriting.

A kernel's variants are the ones whose every edit matches its generated lines (which depend on the
spec); an edit that matches nothing leaves the variant out of that kernel's table, said on stderr.
"""
import argparse
import re
import sys

from ablate import edited, time_us

ROW = "16/16:8x4096"
KERNELS = {"gla": ["gla_backward_out"],
           "kda": ["kda_backward_out_d_q_d_k_d_g", "kda_backward_out_d_v_d_beta", "kda_backward_prep"],
           "gdn": ["gdn_backward_out", "gdn_backward_prep"]}
# label -> (regex, replacement) edits of the generated module's lines
VARIANTS = {
    "no VJP products (d P ⋆ Z, d P ⋆ X)": [(r"^for i_m in T\.serial\(16\):$", "for i_m in T.serial(0):")],
    "no P recompute (diagonal rows, chains)": [(r"^for i_k in T\.serial\(K\):$", "for i_k in T.serial(0):"),
                                               (r"^T\.gemm\(q_after_\d+_s, k_upto_\d+_s, .*\)$", "pass")],
    "no backward sub-chunk chains (wgmma)": [(r"^T\.gemm\(\w+_(rows|cols)_\d+_s, .*\)$", "pass")],
    "no masked operands (C×K, C×C passes)": [
        (r"^(\w+_(after|upto|by)_\d+_s\[i, j\]) = .*$", r"\1 = T.cast(0, IO)"),
        (r"^(\w+_(rows|cols)_\d+_s\[i, j\]) = .*$", r"\1 = T.cast(0, IO)")],
    "no d g expression": [(r"^(d_g_cum_s\[i, j\]) = .*$", r"\1 = 0.0")],
    "no d q, d k expressions": [(r"^(d_[qk]_s\[i, j\]) = T\.cast\(.*$", r"\1 = T.cast(0, IO)")],
    "no reverse cumsum (d g)": [(r"^for i in T\.serial\(C\):$", "for i in T.serial(0):")],
    # session 28's handover: d q d k d v stores its diagonal products' float32 rows for d g, which
    # loads them instead of recomputing; d q d k d v went 8.8 -> 10.1 ms with it (session 29)
    "no handed-over stores (float32 rows for d g)": [(r"^\w+_diag_rows\[0, t0 \+ i, i_hv, j\] = \w+\[i, j\]$", "pass")],
}


def _diagonal_loops(lines):
    """(index of `for i_m in T.serial(n):`, its T.Parallel line, its statement) of each of a kernel's
    diagonal sub-block loops (the VJP products d P ⋆ Z, d P ⋆ X on the diagonal blocks)."""
    return [(n, n + 1, n + 2) for n, line in enumerate(lines)
            if re.match(r"\s*for i_m in T\.serial\(\d+\):$", line)
            and lines[n + 1].lstrip().startswith("for i, j in T.Parallel(") and "+=" in lines[n + 2]]


def swizzled(text: str) -> str:
    """The shared blocks a diagonal loop reads at [i, …] (one column across the 8 rows a warp's
    lanes hold in a fragment: with 128- or 512-byte rows one bank, an 8-way conflict; ncu, session
    28: 54 % of KDA d g's shared wavefronts were conflicts) laid out with the 128-byte swizzle,
    which puts each row's 16-byte chunk c at c XOR (row mod 8). Same arithmetic: bitwise the same."""
    lines = text.splitlines()
    names = sorted({m for _, _, s in _diagonal_loops(lines) for m in re.findall(r"(\w+_s)\[i, ", lines[s])})
    two_d = {m.group(1) for m in (re.match(r"\s*(\w+) = T\.alloc_shared\(\([^,()]+, [^,()]+\),", line)
                                 for line in lines) if m}
    names = [n for n in names if n in two_d]
    if not names:
        raise SystemExit("no diagonal loop reads a 2-D shared block at [i, ...]")
    last = max(n for n, line in enumerate(lines) if re.match(r"\s*\w+ = T\.alloc_(shared|fragment)\(", line))
    indent = lines[last][:len(lines[last]) - len(lines[last].lstrip())]
    layouts = ", ".join(f"{n}: tilelang.layout.make_full_bank_swizzled_layout({n})" for n in names)
    return "\n".join(lines[:last + 1] + [f"{indent}T.annotate_layout({{{layouts}}})"] + lines[last + 1:])


def interchanged(text: str) -> str:
    """Each diagonal loop with its sub-block row loop inside the element loop: an element's own
    row of the gates, g[i, j], is read once instead of once a row of the block. Each element sums
    its terms in the same order: bitwise the same."""
    lines = text.splitlines()
    loops = _diagonal_loops(lines)
    if not loops:
        raise SystemExit("no diagonal loop")
    for m, p, s in loops:
        outer, inner = lines[m], lines[p]
        pad = outer[:len(outer) - len(outer.lstrip())]
        lines[m] = pad + inner.lstrip()
        lines[p] = pad + "    " + outer.lstrip()
    return "\n".join(lines)


def twice_the_warpgroups(text: str) -> str:
    """The kernel on twice its warpgroups (128 → 256 threads, 256 → 512): TileLang deals each
    fragment over twice the threads, so each holds half (KDA's d q d k d g: 208 → 104 fragment
    registers a thread; ptxas on the CPU: 255 → 128 registers, 300 → 408 bytes spilled, 274 → 160
    KB of code), and an SM whose shared memory holds one CTA runs twice the warps: the latency of
    the diagonal loops' shared loads and exponentials hides behind them. The same arithmetic per
    element; sums across threads may add in another order. (The inverse's building block keeps the
    warps it was given: the others wait at its barriers.)"""
    for n in (128, 256):
        if f"threads={n})" in text:
            return text.replace(f"threads={n})", f"threads={2 * n})")
    raise SystemExit("not a kernel of one or two warpgroups")


# label -> a rewrite of the kernel's text that keeps its results (timed and checked bitwise)
REWRITES = {
    "swizzled diagonal operands": swizzled,
    "element loop outside the block's rows": interchanged,
    "both": lambda text: interchanged(swizzled(text)),
    "twice the warpgroups": twice_the_warpgroups,
}


def classes(spec: str):
    """(program, shape class) of each backward kernel of KERNELS[spec] at ROW, as the runtime
    launches them on an H200 (qla_compiler.precompile's classes, which the tests hold to the
    runtime's)."""
    from qla_compiler.bench import parse_row
    from qla_compiler.kernels.forward import H200_SMS
    from qla_compiler.precompile import _program, shape_classes

    H, HV, lens = parse_row(ROW)
    out = {}
    for c in shape_classes(spec, H=H, HV=HV, K=128, V=128, n_seqs=[len(lens)], training=True, sms=H200_SMS):
        if c.part != "backward":
            continue
        program = _program(c)
        for k in program.kernels.kernels:
            if k.name in KERNELS[spec]:
                out[k.name] = (program, c.shape, k)
    return out


def edited_kernel(source: str, name: str, edits) -> str:
    """The module with `edits` made in kernel `name`'s function alone (the module holds all of the
    program's kernels, whose lines the same patterns may match)."""
    lines = source.splitlines()
    start = lines.index(f"def {name}(") - 1  # its @T.prim_func
    end = next((i for i in range(start + 2, len(lines)) if lines[i].startswith("@")), len(lines))
    text = "\n".join(lines[start:end])
    body = (edits(text) if callable(edits) else edited(text, edits) if edits else text).splitlines()
    head = ["import tilelang.layout"] if callable(edits) else []  # (swizzled's layouts)
    return "\n".join(head + lines[:start] + body + lines[end:]) + "\n"


def compile_variants(program, shape, kernel_name: str, table: dict) -> dict:
    """{label: compiled kernel}: the kernel as generated and each variant of `table` (VARIANTS or
    REWRITES) whose edits all match."""
    import logging

    import tilelang

    from qla_compiler.kernels.runtime import BACKEND, TARGET, import_module, module_source, write_source

    logging.getLogger("tilelang").setLevel(logging.ERROR)
    source = module_source(program, shape)
    out = {}
    for label, edits in [("as generated", [])] + list(table.items()):
        try:
            text = edited_kernel(source, kernel_name, edits)
        except SystemExit:  # (ablate.edited: an edit matched no line of this kernel)
            print(f"{kernel_name}: '{label}' does not apply (an edit matches no line)", file=sys.stderr)
            continue
        path = write_source(f"{kernel_name}_ablate", text)
        out[label] = tilelang.compile(getattr(import_module(path), kernel_name), target=TARGET,
                                      execution_backend=BACKEND)
        print(f"compiled {kernel_name}: {label}", file=sys.stderr, flush=True)
    return out


def step_tensors(spec: str) -> dict:
    """Every tensor of the backward kernels by name, after one training step at ROW (the backward's
    kernels' own dictionary, caught where kernels/backward.py runs them)."""
    import torch

    import qla_compiler
    from qla_compiler.bench import make_inputs, parse_row, with_backward
    from qla_compiler.kernels import backward

    caught = {}
    run = backward.run_kernels

    def catching(bprog, t, *args, **kw):
        out = run(bprog, t, *args, **kw)
        caught.update(t)
        return out

    backward.run_kernels = catching
    try:
        op = qla_compiler.compile(spec, target="sm90")
        with_backward(op)(**make_inputs(*parse_row(ROW), spec=spec))
        torch.cuda.synchronize()
    finally:
        backward.run_kernels = run
    return caught


def _relative(x, ref) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (a rewrite whose sums add in another order differs by roundings)."""
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", nargs="*", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--compile-only", action="store_true", help="compile every variant (no GPU needed)")
    ap.add_argument("--rewrites", action="store_true",
                    help="the rewrites that keep the results (REWRITES), each checked bitwise, not the ablations")
    ap.add_argument("--only", nargs="*", metavar="LABEL", help="only these variants or rewrites (by label)")
    args = ap.parse_args(argv)
    table = REWRITES if args.rewrites else VARIANTS
    if args.only:
        unknown = [x for x in args.only if x not in table]
        if unknown:
            ap.error(f"--only: no variant {unknown[0]!r} (those are: {', '.join(table)})")
        table = {label: table[label] for label in args.only}
    for spec in args.spec:
        todo = {name: (program, shape, k, compile_variants(program, shape, name, table))
                for name, (program, shape, k) in classes(spec).items()}
        if args.compile_only:
            continue
        t = step_tensors(spec)
        print(f"# {spec} at {ROW}: each backward out kernel alone, µs per launch (CUDA events, 20 launches)",
              flush=True)
        for name, (_, _, k, variants) in todo.items():
            params = [t[p.name] for p in k.params]
            outs = [t[p.name] for p in k.params if p.role == "out"]
            base = time_us(variants["as generated"], params)
            expected = [o.clone() for o in outs]
            print(f"{name:>30}  as generated {base:9.1f}", flush=True)
            for label, kernel in variants.items():
                if label != "as generated":
                    us = time_us(kernel, params)
                    same = "" if not args.rewrites else \
                        "  bitwise the same" if all(o.equal(e) for o, e in zip(outs, expected)) else \
                        f"  RESULTS DIFFER (relative {max(_relative(o, e) for o, e in zip(outs, expected)):.1e})"
                    print(f"{'':>30}  {label:<38} {us:9.1f}  ({us - base:+.1f}){same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
