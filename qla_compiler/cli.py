"""qla-compile: run the compiler on a spec and show what came out.

    qla-compile specs/gdn.py --target sm90                  # summary of what was derived
    qla-compile specs/gdn.py --target sm90 --emit chunk     # the rewritten chunk program
    qla-compile specs/gdn.py --emit chunk --print-after-all # what every pass changed, and why
    qla-compile specs/gdn.py --print-after-all=full         # ... and the whole IR after every pass
    qla-compile specs/gdn.py --emit chunk --stop-after chunk
    qla-compile specs/gdn.py --check                        # interpreter vs reference after each pass
    qla-compile specs/gdn.py --emit backward                # the chunk program's VJP (reverse scan)
    qla-compile specs/gdn.py --emit affine                  # S_next = M S0 + H, for context parallelism
    qla-compile specs/gdn.py --emit kernel                  # kernels, buffers, roles, statements
    qla-compile specs/gdn.py --emit tilelang -o out/        # the generated TileLang module
    qla-compile specs/gdn.py --emit cuda --shape H=4,HV=16,K=128,V=128,BV=32
    qla-compile specs/gdn.py --emit kernel --backward       # the backward program's kernels
    qla-compile specs/gdn.py --emit kernel --training       # the forward a training step runs
    qla-compile specs/gdn.py --emit kernel --token-step     # the decoding kernel (op.recurrent)
    qla-compile specs/gdn.py --emit kernel --fused --windows  # context parallelism's first scan
    qla-compile specs/gdn.py --emit kernel --fused --training # the fused training forward
    qla-compile gdn --cp-plan H=2,HV=8,K=128,T=32768         # what context_parallel="auto" chooses
    qla-compile gdn --precompile H=16,HV=64,K=128,V=128,io=bfloat16 --training
                                 # compile a deployment's kernels into the disk cache ahead of time
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import PassError, SpecError

EMITS = ("recurrence", "chunk", "backward", "affine", "kernel", "tilelang", "cuda")
DEFAULT_SHAPE = "H=2,HV=8,K=128,V=128,io=bfloat16"  # Qwen3-Next's GDN layer under TP8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="qla-compile", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[2:]))
    ap.add_argument("spec", help="a spec file (or the name of a shipped spec: gdn, delta_net, ...)")
    ap.add_argument("--target", default="sm90", help="sm90 (Hopper) or cpu (default: sm90)")
    ap.add_argument("--emit", choices=EMITS, help="print this IR instead of the summary")
    ap.add_argument("-o", "--output", metavar="DIR", help="also write what is printed into DIR")
    ap.add_argument("--chunk-size", type=int, default=64, metavar="C",
                    help="tokens per chunk, a power of two (default: 64; the sm90 kernels are built for "
                         "64, the interpreter runs any)")
    ap.add_argument("--shape", default=DEFAULT_SHAPE,
                    help=f"shape class for --emit kernel/tilelang/cuda (default: {DEFAULT_SHAPE}); "
                         "the fields not given (BV, stages, scan_warpgroups) are what the runtime picks "
                         "for one sequence on an H200; the token step's state, gates and scalars "
                         "(dtypes: float32 by default, or the io dtype) are what a call's pools, gates and "
                         "scalars come in")
    ap.add_argument("--backward", action="store_true",
                    help="with --emit kernel/tilelang/cuda: the backward program's kernels (one block's, where "
                         "the backward at --shape runs on blocks of K's or V's columns)")
    ap.add_argument("--token-step", action="store_true",
                    help="with --emit kernel/tilelang/cuda: the token-step kernel for decoding (op.recurrent)")
    ap.add_argument("--fused", action="store_true",
                    help="with --emit kernel/tilelang/cuda: the forward with its scan and output fused into one "
                         "warp-specialised kernel (roles, register budgets, barriers; QLA_FUSED_FORWARD=1 runs it); "
                         "at --shape ...,BV=128 the wide one, its chain on a state and a value role; with "
                         "--training: the fused training forward, which also stores what the backward loads "
                         "(what a training call runs where inference fuses; QLA_FUSED_TRAINING=0 turns it off); "
                         "with --backward: the backward with its scan warp-specialised the same way, at "
                         "BV=128 whole-V on a state and a value role (by default where the grid fills the GPU at BV=128; "
                         "QLA_BACKWARD_SCAN_ROLES=1 runs roles everywhere, =0 nowhere)")
    ap.add_argument("--windows", action="store_true",
                    help="with --emit kernel/tilelang/cuda: the scan kernel alone as context parallelism's first "
                         "scan runs it, each walk from a chunk given per sequence and value head (its segment's "
                         "window; passes/walk_skip.py); with --fused, --training or --backward: that program's scan")
    ap.add_argument("--training", action="store_true",
                    help="with --emit kernel/tilelang/cuda: the forward's kernels as a training step runs "
                         "them (they also store what the backward loads, e.g. T_r); with --precompile: also "
                         "the kernels a training step runs (that forward and the backward)")
    ap.add_argument("--precompile", action="append", metavar="DEPLOYMENT",
                    help="compile the kernels that calls at these sizes launch into the on-disk cache, a line "
                         "per kernel (qla_compiler/precompile.py; no GPU needed): H=..,HV=..,K=..[,V=..][,io=bfloat16|"
                         "float16][,N=a or a-b sequences per call; default every number][,cp=auto (the default; "
                         "with T=a call's tokens, the plan's for that length), segments, or 1][,sms=the "
                         "GPU's SMs; default this machine's GPU, else an H200's][,state=float32|bfloat16|float16: the "
                         "decoding pools' dtype, whose token step is compiled too; default float32]; repeatable")
    ap.add_argument("--cp-plan", metavar="DEPLOYMENT",
                    help="print what context_parallel=\"auto\" chooses for calls of these sizes and the cost "
                         "model's time at each segment count (kernels/cp_plan.py): H=..,HV=..,K=..[,V=..],T=a "
                         "call's tokens[,N=sequences, default 1][,sms=..]")
    ap.add_argument("--stop-after", metavar="PASS", help="stop the pipeline after this pass")
    ap.add_argument("--print-after-all", nargs="?", const="diff", choices=("diff", "full"),
                    help="after every pass, print what it changed: for a rewrite of the chunk program the "
                         "nodes removed (-), added (+), rewritten (~), renamed or merged (=), under the "
                         "identity that justifies them; =full: the whole IR after each pass too")
    ap.add_argument("--check", action="store_true",
                    help="run the interpreter against the reference after every pass; report each "
                         "pass's relative error and the worst")
    args = ap.parse_args(argv)
    if args.precompile:
        return run_precompile(args)
    if args.cp_plan:
        return print_cp_plan(args.cp_plan)

    from .compiler import compile_spec  # (after parsing: --help imports none of the compiler)

    try:
        prog = compile_spec(args.spec, target=args.target, chunk_size=args.chunk_size,
                            stop_after=args.stop_after, check=args.check,
                            print_after=_printer(args.print_after_all == "full") if args.print_after_all else None)
    except (SpecError, PassError, ValueError) as e:
        print(f"qla-compile: error: {e}", file=sys.stderr)
        return 1
    if args.target == "cpu" and args.emit in ("kernel", "tilelang", "cuda"):
        print(f"qla-compile: error: --emit {args.emit}: target cpu has no kernels (the ChunkIR interpreter "
              "runs the chunk program); --target sm90 for them", file=sys.stderr)
        return 1
    if args.emit == "recurrence":
        text = str(prog.recurrence)
    elif args.emit in ("chunk", "backward", "affine", "kernel", "tilelang", "cuda"):
        try:
            # (derived on demand: --emit chunk needs neither the backward nor the affine program)
            stage = {"chunk": lambda: prog.chunk, "backward": lambda: prog.backward,
                     "affine": lambda: prog.affine}.get(args.emit, lambda: prog.kernels)()
        except PassError as e:
            print(f"qla-compile: error: {e}", file=sys.stderr)
            return 1
        if stage is None:
            if prog.no_kernels and args.emit in ("kernel", "tilelang", "cuda"):
                print(f"qla-compile: error: --emit {args.emit}: no kernels: {prog.no_kernels}", file=sys.stderr)
            else:
                print(f"qla-compile: error: the pipeline stopped before --emit {args.emit} existed", file=sys.stderr)
            return 1
        try:
            chosen = [f for f in ("backward", "training", "token_step", "fused") if getattr(args, f)]
            # (training and fused: the fused training forward; backward and fused: the backward's
            # scan with roles)
            if len(chosen) > 1 and chosen not in (["training", "fused"], ["backward", "fused"]):
                raise ValueError(" and ".join(f"--{f.replace('_', '-')}" for f in chosen) + ": choose one")
            shape = None
            if args.emit in ("kernel", "tilelang", "cuda"):  # the kernels this shape class runs
                shape = parse_shape(args.shape, token_step=args.token_step)
                prog = prog.for_shape(shape)
            fused = "fused_wide_program" if shape is not None and shape.BV > 64 else "fused_program"
            if args.training and args.fused:
                fused = fused.replace("_program", "_training_program")
            if args.backward and args.fused:
                wide = shape is not None and shape.BV > 64
                fused = "backward_wide_roles_program" if wide else "backward_roles_program"
            note = ""
            for flag, variant in (("backward", "backward_program"), ("training", "training_program"),
                                  ("token_step", "token_step_program"), ("fused", fused)):
                if getattr(args, flag) and not (flag in ("training", "backward") and args.fused):
                    if args.emit not in ("kernel", "tilelang", "cuda"):
                        raise ValueError(f"--{flag.replace('_', '-')} goes with --emit kernel, tilelang or cuda")
                    if args.backward:  # (the kernels one block runs, where it runs on blocks)
                        prog, shape, note = _backward_block(prog, shape)
                    prog = getattr(prog, variant)
            if args.windows:
                if args.emit not in ("kernel", "tilelang", "cuda") or args.token_step:
                    raise ValueError("--windows goes with --emit kernel, tilelang or cuda (a chunk scan's)")
                prog = prog.windows_program
            text = _emit(args.emit, prog, shape)
            if note:
                text = f"{'//' if args.emit == 'cuda' else '#'} {note}\n{text}"
        except (PassError, ValueError) as e:
            print(f"qla-compile: error: {e}", file=sys.stderr)
            return 1
    else:
        text = summary(prog)
    if not (args.print_after_all and args.emit is None):
        print(text)
    if args.check:  # (on stderr when the output is an IR: stdout stays that IR)
        print(check_report(prog), file=sys.stderr if args.emit else sys.stdout)
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        ext = {"tilelang": "py", "cuda": "cu"}.get(args.emit, "txt")
        variant = "".join(f".{f}" for f in ("backward", "training", "token_step", "fused") if getattr(args, f))
        name = f"{prog.recurrence.name}{variant}.{args.emit or 'summary'}.{ext}"
        (out / name).write_text(text + "\n")
        print(f"wrote {out / name}", file=sys.stderr)
    return 0


FIELDS = ("H", "HV", "K", "V", "BV", "io", "stages", "scan_warpgroups", "state", "gates", "scalars")
_NAMED = ("io", "state", "gates", "scalars")  # (dtype names; the other fields are integers)


def parse_shape(text: str, token_step: bool = False):
    """'H=2,HV=8,K=128,V=128,BV=64,io=bfloat16' -> ShapeClass; the launch fields not given are the
    runtime's choice for one sequence on an H200 (kernels/forward.scan_class; `token_step`: the
    token step's V-block, kernels/token_step.block_v).

        >>> parse_shape("H=2,HV=8,K=128,V=128").BV, parse_shape("H=16,HV=64,K=128,V=128").scan_warpgroups
        (16, 2)
    """
    import dataclasses

    from .kernels.forward import H200_SMS, scan_class
    from .kernels.token_step import block_v as token_step_block_v, check_dims as check_token_step_dims
    from .passes.lower_tilelang import check_head_dim, tile_width

    from .checks import option_fields

    fields = {}
    for key, value in option_fields(text, FIELDS, "--shape"):
        try:
            fields[key] = value if key in _NAMED else int(value)
        except ValueError:
            raise ValueError(f"--shape: {key} must be an integer, got {value!r}") from None
    missing = [f for f in ("H", "HV", "K", "V") if f not in fields]
    if missing:
        raise ValueError(f"--shape: missing {', '.join(missing)} (e.g. {DEFAULT_SHAPE})")
    H, HV, K, V = (fields[f] for f in ("H", "HV", "K", "V"))
    if H < 1 or HV % H:
        raise ValueError(f"--shape: HV={HV} is not a multiple of H={H}")
    try:
        if token_step:
            check_token_step_dims(K, V)
        for d, n in () if token_step else (("K", K), ("V", V)):
            check_head_dim(d, n)
    except ValueError as e:
        raise ValueError(f"--shape: {e}") from None
    BV = fields.get("BV")
    if BV is None and token_step:  # the token step's own V-block, as the op launches it
        BV = token_step_block_v(tile_width(V), HV, 1, 1, H200_SMS)
    try:
        shape = scan_class(H, HV, K, V, 1, fields.get("io", "bfloat16"), H200_SMS, BV=BV,
                           block_v_max=max(BV or 0, 64))
        return dataclasses.replace(shape, **{f: fields[f] for f in ("stages", "scan_warpgroups", *_NAMED[1:])
                                             if f in fields})
    except ValueError as e:
        raise ValueError(f"--shape: {e}") from None


def run_precompile(args) -> int:
    """--precompile: the warm-up (qla_compiler/precompile.py) of each deployment given."""
    import time

    from .precompile import compile_classes, parse_deployment, shape_classes

    t = time.time()
    try:
        if args.emit or args.target != "sm90" or args.chunk_size != 64:
            raise ValueError("--precompile compiles the sm90 kernels the op runs (chunk size 64): "
                             "leave out --emit, --target and --chunk-size")
        todo = [c for d in args.precompile for c in shape_classes(args.spec, training=args.training,
                                                                    **parse_deployment(d))]
        done = compile_classes(list(dict.fromkeys(todo)))
    except (SpecError, PassError, ValueError) as e:
        print(f"qla-compile: error: {e}", file=sys.stderr)
        return 1
    from .kernels.runtime import cache_dir

    compiled = sum(c for *_, c in done)
    print(f"{len(done)} kernels of {len(todo)} shape classes: {compiled} compiled, {len(done) - compiled} "
          f"found in the cache, {time.time() - t:.1f}s (generated modules in {cache_dir()})")
    return 0


def print_cp_plan(deployment: str) -> int:
    """--cp-plan: the planner's choice and its model's time at each segment count."""
    from .kernels import cp_plan
    from .precompile import _this_gpus_sms, parse_deployment

    try:
        d = parse_deployment(deployment)
        unknown = set(d) - {"H", "HV", "K", "V", "n_seqs", "tokens", "sms"}
        if unknown or "tokens" not in d:
            raise ValueError("--cp-plan: give H, HV, K, T (a call's tokens) and optionally V, N, sms"
                             + (f"; not {', '.join(sorted(unknown))}" if unknown else ""))
    except ValueError as e:
        print(f"qla-compile: error: {e}", file=sys.stderr)
        return 1
    H, HV, K, T = d["H"], d["HV"], d["K"], d["tokens"]
    V, sms = d.get("V", K), d.get("sms") or _this_gpus_sms()
    for N in d.get("n_seqs", [1]):
        print(f"context_parallel=\"auto\" for H={H} HV={HV} K={K} V={V}, {N} sequence(s), {T} tokens, {sms} SMs "
              f"(kernels/cp_plan.py; the scan's modelled GPU time):")
        wide = cp_plan.walks_wide(False)
        print("  segments  plain walks  on the wide kernel where it fills the GPU"
              + ("" if wide else " (not taken: forward.cut_wide() is off)"))
        for s in cp_plan.SEGMENTS:
            print(f"  {s:>8}  {cp_plan.predicted_ms(s, N, H, HV, K, V, T, sms):8.3f} ms"
                  f"  {cp_plan.predicted_ms(s, N, H, HV, K, V, T, sms, wide=True):8.3f} ms")
        for eager, training, who in ((None, False, "a captured or compiled inference call"),
                                     (None, True, "a captured or compiled training step"),
                                     ("inference", False, "an eager inference call"),
                                     ("training", True, "an eager training step")):
            s = cp_plan.planned(N, H, HV, K, V, T, sms, eager, cp_plan.walks_wide(training))
            print(f"  chosen for {who}: {s or 'none (the whole walk)'}")
    return 0


def _backward_block(prog, shape) -> tuple:
    """(program, shape class, note): where the backward at this shape runs on blocks of K's or V's
    columns (Program.backward_blocks), the program and class of one block, and a line saying so;
    else the program and class as they are."""
    import dataclasses

    keys, values, each = prog.backward_blocks()
    if keys >= shape.K and values >= shape.V:
        return prog, shape, ""
    K, V = min(keys, shape.K), min(values, shape.V)
    blocks = f"{K} keys × {V} of V's columns" if K < shape.K else f"{V} of V's columns (K whole)"
    return each, dataclasses.replace(shape, K=K, V=V, BV=min(shape.BV, 64)), (
        f"the backward at K = {shape.K}, V = {shape.V} runs on blocks of {blocks}, each a "
        f"problem of its own (Program.backward_blocks): one block's kernels")


def _emit(what: str, prog, shape) -> str:
    if what == "chunk":
        return str(prog.chunk)
    if what in ("backward", "affine"):
        return str(getattr(prog, what))
    if what == "kernel":
        return str(prog.kernels)
    from .kernels.runtime import lower_to_cuda, module_source  # imports TileLang

    if what == "tilelang":
        return module_source(prog, shape)
    return "\n\n".join(f"// ===== kernel {name} =====\n{src}" for name, src in lower_to_cuda(prog, shape).items())


def _printer(full: bool):
    """The print_after of --print-after-all: what each pass changed in the chunk program (the
    chunk program's own derivation, the recurrence and the partition in full, the kernels' names),
    and with `full` every IR in full too."""
    from .ir.chunk import ChunkIR
    from .ir.chunk_diff import chunk_diff
    from .ir.kernel import KernelIR
    from .passes.pipeline import identity

    last = [None]

    def show(name, ir):
        before, last[0] = last[0], ir
        if isinstance(ir, ChunkIR) and isinstance(before, ChunkIR):
            text = str(chunk_diff(before, ir, why=identity(name))) + (f"\n\n{ir}" if full else "")
        elif isinstance(ir, KernelIR) and not full:
            heads = [ln for ln in str(ir).splitlines() if ln.startswith(("kernel_program ", "kernel "))]
            text = "\n".join([*heads, "(--print-after-all=full or --emit kernel: the kernels in full)"])
        else:
            text = str(ir)
        print(f"// ----- after {name} -----\n{text}\n")

    return show


def check_report(prog) -> str:
    """--check's report: the relative error of the interpreter against the reference after each
    chunk-program pass (o and the final state), and the worst.

        >>> from qla_compiler import compile_spec
        >>> print(check_report(compile_spec("linear_attn", check=True)).splitlines()[-1])
          worst: ... every pass within 1e-10
    """
    from .check_mode import TOLERANCE

    if not prog.checked:
        return "check: nothing to check (the pipeline stopped before the chunk program)"
    width = max(len(n) for n in prog.checked)
    lines = ["check: the ChunkIR interpreter against the reference (float64, random inputs), relative error"]
    lines += [f"  after {n:<{width}}  o {eo:.1e}   final state {es:.1e}" for n, (eo, es) in prog.checked.items()]
    name, errs = max(prog.checked.items(), key=lambda item: max(item[1]))
    what = "o" if errs[0] >= errs[1] else "final state"
    lines.append(f"  worst: {max(errs):.1e} ({what} after {name}); every pass within {TOLERANCE:g}")
    return "\n".join(lines)


def summary(prog) -> str:
    rec, chunk = prog.recurrence, prog.chunk
    lines = [str(rec), ""]
    if chunk is not None:
        c = chunk.counts()
        scan = chunk.scan_nodes()
        lines += [
            f"chunk program (C={chunk.chunk_size}) after {len(prog.stages)} passes: "
            f"{' → '.join(n for n, _ in prog.stages)}",
            f"  {c['nodes']} nodes: {c['nodes'] - len(scan)} free of the state, {len(scan)} depending on it",
            f"  {c['matmuls']} matmuls ({c['CxC matmuls']} of C×C), {c['exponentials']} exponentials, "
            f"{c['triangular inverses']} triangular inverse{'' if c['triangular inverses'] == 1 else 's'}",
            f"  target {prog.target}; see --emit chunk for the program",
        ]
    if prog.target == "cpu":
        lines.append("kernels: none for target cpu (the ChunkIR interpreter runs the chunk program; "
                     "--target sm90 for the kernels)")
    elif prog.no_kernels is not None:
        lines.append(f"kernels: none — {prog.no_kernels}")
    elif prog.kernels is not None:
        lines.append(f"kernels: {', '.join(k.name for k in prog.kernels.kernels)}  "
                     "(--emit kernel, --emit tilelang, --emit cuda)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
