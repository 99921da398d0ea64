"""Where a generated kernel's time goes: the kernel as generated against copies of it with one
piece of work taken out, each timed alone on the same tensors (those of a real forward call).
With --trials, copies with a schedule changed instead (threads, pipeline stages, V-block): what a
change to the generator would buy, measured before it is made.

    TILELANG_CACHE_DIR=/tmp/tlc python benchmarks/ablate.py --compile-only   # on the CPU, first
    python benchmarks/ablate.py --row 16/64:1x32768                          # on the GPU
    python benchmarks/ablate.py --trials --row 16/64:1x32768

A variant is a list of (regex, replacement) edits of the generated module's lines; an edit that
matches nothing is an error (the generator moved on: update the variant), so the table never
silently times the unmodified kernel twice. The variants' results are wrong on purpose: only their
times mean something. A trial's results must not change: each is checked against the generated
kernel's outputs on the same inputs.
"""
import argparse
import dataclasses
import re
import sys

import qla_compiler
from qla_compiler.bench import make_inputs, parse_row
from qla_compiler.kernels.runtime import TARGET, BACKEND, import_module, module_source, write_source

# the decay to the chunk's end, on whichever side decay_value_side left it (k_decayed_s or v_new_decayed_s)
_DECAY = r"^(\w+_decayed_s\[i, j\] = T\.cast\(\()T\.exp2\(\(\(g_cum_c\[n_valid - 1\] \* [\d.]+\) - \(g_cum_c\[i\] \* [\d.]+\)\)\) \* "
VARIANTS = {
    "gdn_prep": {
        "no inverse (I − A only)": [(r"^INVERSE_SQUARINGS = \d+$", "INVERSE_SQUARINGS = 0")],
        "no cumulative sum loop": [(r"^for j in T\.unroll\(C\):.*$", "for j in T.serial(1):")],
        "no K·Kᵀ product": [(r"^T\.gemm\(k_s, k_s, KKt,.*\)$", "T.clear(KKt)")],
        "no W, U products": [(r"T\.gemm\(T_s, (\w+), (W|U),.*\)$", r"T.clear(\2)")],
        "no W, U stores": [(r"T\.copy\(\w+, (W|U)_rows\[.*\]\)$", "pass"),
                           (r"(W|U)_rows\[0, t0 \+ i, i_hv, j\] = .*$", "pass")],
    },
    "gdn_scan": {
        "no W·S product": [(r"^T\.gemm\(W_s, state_s, WS,.*\)$", "T.clear(WS)")],
        "no state update": [(r"^T\.gemm\((k_decayed_s|k_s), (v_new_s|v_new_decayed_s), state,.*\)$", "pass")],
        "no decay in the update": [(_DECAY, r"\1")],
        "no state decay": [(r"^state\[i, j\] = \(T\.exp2\(.*\) \* state\[i, j\]\)$", "pass")],
        "no per-chunk state store": [(r"^T\.tma_copy\(state_s, S0_chunks\[.*\]\)$", "pass")],
        "no v_new store": [(r"^T\.tma_copy\(v_new_s, v_new_rows\[.*\]\)$", "pass")],
        "no wait for the stores": [(r"^T\.tma_store_wait\(\)  # the previous chunk's", "pass  #")],
    },
    "gdn_out": {
        "no Q·S0": [(r"T\.gemm\(q_s, S0_s, QS,.*\)$", "T.clear(QS)")],
        "no state load": [(r"^T\.tma_copy\(S0_chunks\[.*\], S0_s, .*\)$", "pass"),
                          (r"^T\.mbarrier_wait_parity\(S0_s_bar\[0\], 0\)$", "pass")],
    },
}


# label -> (ShapeClass fields to change, edits): schedules the generator could choose instead; a
# trial whose kernel comes out as generated at a row's class (or as an earlier trial's) is left out
TRIALS = {
    "gdn_prep": {
        "cumulative sum not unrolled": ({}, [(r"^for j in T\.unroll\(C\):.*$", "for j in T.serial(C):")]),
    },
    "gdn_scan": {
        "one consumer warpgroup": ({"scan_warpgroups": 1}, []),
        "two consumer warpgroups": ({"scan_warpgroups": 2}, []),
        "2 stages": ({"stages": 2}, []),
        "3 stages": ({"stages": 3}, []),
        "4 stages": ({"stages": 4}, []),
        "half the V-block, one warpgroup": ({"BV": "half", "scan_warpgroups": 1}, []),
        "half the V-block, one warpgroup, 3 stages": ({"BV": "half", "scan_warpgroups": 1, "stages": 3}, []),
        "half the V-block, two warpgroups": ({"BV": "half", "scan_warpgroups": 2}, []),
    },
}


def edited(source: str, edits) -> str:
    lines = source.splitlines()
    for pattern, repl in edits:
        rx, hits = re.compile(pattern), 0
        for i, line in enumerate(lines):
            body = line.lstrip()
            if rx.search(body):
                lines[i] = line[:len(line) - len(body)] + rx.sub(repl, body)
                hits += 1
        if not hits:
            raise SystemExit(f"ablate: no line matches {pattern!r}: update the variant")
    return "\n".join(lines) + "\n"


def trial_shape(shape, changes):
    """The shape class a trial compiles for: `changes` applied ("half" halves the V-block)."""
    changes = {f: (getattr(shape, f) // 2 if c == "half" else c) for f, c in changes.items()}
    return dataclasses.replace(shape, **changes)


def compile_variants(gdn, shape, kernel_name, variants):
    """{label: compiled kernel} for the kernel as generated and each variant; a variant is a list
    of edits, or (shape changes, edits) for a trial (compiled from the program variant its shape
    runs, Program.for_shape)."""
    import logging

    import tilelang

    logging.getLogger("tilelang").setLevel(logging.ERROR)  # one progress line per variant instead

    out, seen = {}, set()
    for label, variant in [("as generated", [])] + list(variants.items()):
        changes, edits = variant if isinstance(variant, tuple) else ({}, variant)
        try:
            s = trial_shape(shape, changes)
        except ValueError:  # not a class the lowering builds (ShapeClass says why)
            continue
        if s.BV < 16:  # narrower than the runtime's V-blocks
            continue
        program = gdn.for_shape(s)
        kernel = next(k for k in program.kernels.kernels if k.name == kernel_name)
        # the stages the kernel really gets (a scan takes no more than its shared memory holds)
        runs = dataclasses.replace(s, stages=min(s.stages, kernel.max_stages) if kernel.loop else 0)
        if (runs, tuple(edits)) in seen:  # the kernel as generated, or as an earlier trial
            continue
        seen.add((runs, tuple(edits)))
        path = write_source(f"{kernel_name}_ablate", edited(module_source(program, s), edits))
        fn = getattr(import_module(path), kernel_name)
        out[label] = tilelang.compile(fn, target=TARGET, execution_backend=BACKEND)
        print(f"compiled {kernel_name}: {label}", file=sys.stderr, flush=True)
    return out


def shape_for(row):
    from qla_compiler.kernels.forward import H200_SMS, scan_class

    H, HV, lens = parse_row(row)
    return scan_class(H, HV, 128, 128, len(lens), "bfloat16", H200_SMS)


def time_us(kernel, args, reps=20) -> float:
    import torch

    for _ in range(3):
        kernel(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        kernel(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", action="append", help="h_qk/h_v:NxL (repeatable; default 16/64:1x32768, 2/8:1x32768)")
    ap.add_argument("--compile-only", action="store_true", help="compile every variant (no GPU needed)")
    ap.add_argument("--trials", action="store_true", help="time the schedule trials instead of the ablations")
    args = ap.parse_args(argv)
    table = TRIALS if args.trials else VARIANTS
    rows = args.row or ["16/64:1x32768", "2/8:1x32768"]
    gdn = qla_compiler.compile_spec("gdn")
    for row in rows:
        shape = shape_for(row)
        program = gdn.for_shape(shape)  # the variant this row runs (Program.for_shape)
        compiled = {name: compile_variants(gdn, shape, name, v) for name, v in table.items()}
        if args.compile_only:
            continue
        import torch

        from qla_compiler.kernels.forward import chunk_offsets, forward
        from qla_compiler.ops import _op

        op = _op("gdn")
        a = make_inputs(*parse_row(row))
        inputs, dims, scale = op._prepare((), {n: a[n] for n in op.input_names}, None, a["initial_state"],
                                          a["cu_seqlens"], False)
        _, _, kept = forward(program, inputs, op.kinds, dims, scale, a["initial_state"], a["cu_seqlens"],
                             op._head_logs(dims.HV), keep=True)
        kept.update(chunk_offsets=chunk_offsets(kept["cu_seqlens"], program.chunk_size),
                    initial_state=a["initial_state"].float().contiguous(), final_state=torch.empty_like(a["initial_state"]))
        print(f"# {row}: each kernel alone, µs per launch (CUDA events, 20 launches)")
        for k in (k for k in program.kernels.kernels if k.name in compiled):
            ks = compiled[k.name]
            params = [kept[p.name] for p in k.params]
            outs = [params[i] for i, p in enumerate(k.params) if p.role == "out"]

            def blank():  # NaN in every output: a slot no kernel writes (past the last chunk) stays NaN
                for x in outs:
                    x.fill_(float("nan"))
            if args.trials:
                blank()
            base = time_us(ks["as generated"], params)
            reference = [x.float().clone() for x in outs] if args.trials else None
            print(f"{k.name:>10}  as generated {base:9.1f}")
            for label, kern in ks.items():
                if label != "as generated":
                    if reference is not None:  # what the trial itself writes is compared, not leftovers
                        blank()
                    t = time_us(kern, params)
                    note = ""
                    if reference is not None:  # same math, other schedule: the outputs must not move
                        errs = [((x.float() - r)[r == r].norm() / r[r == r].norm().clamp_min(1e-30)).item()
                                for x, r in zip(outs, reference)]
                        worst = float("nan") if any(e != e for e in errs) else max(errs)
                        note = f"  outputs {'agree' if worst < 1e-2 else 'DIFFER'} ({worst:.1e})"
                    print(f"{'':>10}  {label:<34} {t:9.1f}  ({t - base:+.1f}){note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
