"""qla-compile: run the compiler on a spec and show what came out.

    qla-compile specs/gdn.py --target sm90                  # summary of what was derived
    qla-compile specs/gdn.py --target sm90 --emit chunk     # the rewritten chunk program
    qla-compile specs/gdn.py --emit chunk --print-after-all # the IR after every pass
    qla-compile specs/gdn.py --emit chunk --stop-after chunk
    qla-compile specs/gdn.py --check                        # interpreter vs reference after each pass
    qla-compile specs/gdn.py --emit backward                # the chunk program's VJP (reverse scan)
    qla-compile specs/gdn.py --emit affine                  # S_next = M S0 + H, for context parallelism
    qla-compile specs/gdn.py --emit kernel                  # kernels, buffers, roles, statements
    qla-compile specs/gdn.py --emit tilelang -o out/        # the generated TileLang module
    qla-compile specs/gdn.py --emit cuda --shape H=4,HV=16,K=128,V=128,BV=32
    qla-compile specs/gdn.py --emit kernel --backward       # the backward program's kernels
    qla-compile specs/gdn.py --emit kernel --training       # the forward a training step runs
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .compiler import compile_spec
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
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--shape", default=DEFAULT_SHAPE,
                    help=f"shape class for --emit kernel/tilelang/cuda (default: {DEFAULT_SHAPE}); "
                         "the fields not given (BV, stages, scan_warpgroups) are what the runtime picks "
                         "for one sequence on an H200")
    ap.add_argument("--backward", action="store_true",
                    help="with --emit kernel/tilelang/cuda: the backward program's kernels")
    ap.add_argument("--training", action="store_true",
                    help="with --emit kernel/tilelang/cuda: the forward's kernels as a training step runs "
                         "them (they also store what the backward loads, e.g. T_r)")
    ap.add_argument("--stop-after", metavar="PASS", help="stop the pipeline after this pass")
    ap.add_argument("--print-after-all", action="store_true", help="print the IR after every pass")
    ap.add_argument("--check", action="store_true",
                    help="run the interpreter against the reference after every pass")
    args = ap.parse_args(argv)

    def show(name, ir):
        print(f"// ----- after {name} -----\n{ir}\n")

    try:
        prog = compile_spec(args.spec, target=args.target, chunk_size=args.chunk_size,
                            stop_after=args.stop_after, check=args.check,
                            print_after=show if args.print_after_all else None)
    except (SpecError, PassError, ValueError) as e:
        print(f"qla-compile: error: {e}", file=sys.stderr)
        return 1
    if args.emit == "recurrence":
        text = str(prog.recurrence)
    elif args.emit in ("chunk", "backward", "affine", "kernel", "tilelang", "cuda"):
        stage = {"chunk": prog.chunk, "backward": prog.backward, "affine": prog.affine}.get(args.emit, prog.kernels)
        if stage is None:
            print(f"qla-compile: error: the pipeline stopped before --emit {args.emit} existed", file=sys.stderr)
            return 1
        try:
            if args.backward and args.training:
                raise ValueError("--backward and --training: choose one")
            shape = None
            if args.emit in ("kernel", "tilelang", "cuda"):  # the kernels this shape class runs
                shape = parse_shape(args.shape)
                prog = prog.for_shape(shape)
            for flag, variant in (("backward", "backward_program"), ("training", "training_program")):
                if getattr(args, flag):
                    if args.emit not in ("kernel", "tilelang", "cuda"):
                        raise ValueError(f"--{flag} goes with --emit kernel, tilelang or cuda")
                    prog = getattr(prog, variant)
            text = _emit(args.emit, prog, shape)
        except (PassError, ValueError) as e:
            print(f"qla-compile: error: {e}", file=sys.stderr)
            return 1
    else:
        text = summary(prog)
    if not (args.print_after_all and args.emit is None):
        print(text)
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        ext = {"tilelang": "py", "cuda": "cu"}.get(args.emit, "txt")
        variant = ".backward" if args.backward else ".training" if args.training else ""
        name = f"{prog.recurrence.name}{variant}.{args.emit or 'summary'}.{ext}"
        (out / name).write_text(text + "\n")
        print(f"wrote {out / name}", file=sys.stderr)
    return 0


FIELDS = ("H", "HV", "K", "V", "BV", "io", "stages", "scan_warpgroups")


def parse_shape(text: str):
    """'H=2,HV=8,K=128,V=128,BV=64,io=bfloat16' -> ShapeClass; the launch fields not given are the
    runtime's choice for one sequence on an H200 (kernels/forward.scan_class).

        >>> parse_shape("H=2,HV=8,K=128,V=128").BV, parse_shape("H=16,HV=64,K=128,V=128").scan_warpgroups
        (16, 2)
    """
    import dataclasses

    from .kernels.forward import H200_SMS, scan_class
    from .passes.lower_tilelang import HEAD_DIMS

    fields = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in FIELDS:
            raise ValueError(f"--shape: unknown field {key!r} (fields: {', '.join(FIELDS)})")
        try:
            fields[key] = value if key == "io" else int(value)
        except ValueError:
            raise ValueError(f"--shape: {key} must be an integer, got {value!r}") from None
    missing = [f for f in ("H", "HV", "K", "V") if f not in fields]
    if missing:
        raise ValueError(f"--shape: missing {', '.join(missing)} (e.g. {DEFAULT_SHAPE})")
    H, HV, K, V = (fields[f] for f in ("H", "HV", "K", "V"))
    if H < 1 or HV % H:
        raise ValueError(f"--shape: HV={HV} is not a multiple of H={H}")
    for d, n in (("K", K), ("V", V)):
        if n not in HEAD_DIMS:
            raise ValueError(f"--shape: {d}={n} is not supported by the sm90 kernels "
                             f"({', '.join(map(str, HEAD_DIMS))})")
    BV = fields.get("BV")
    if BV is not None and (BV not in (16, 32, 64) or V % BV):
        raise ValueError(f"--shape: BV={BV} must be 16, 32 or 64 and divide V={V}")
    shape = scan_class(H, HV, K, V, 1, fields.get("io", "bfloat16"), H200_SMS, BV=BV)
    try:
        return dataclasses.replace(shape, **{f: fields[f] for f in ("stages", "scan_warpgroups") if f in fields})
    except ValueError as e:
        raise ValueError(f"--shape: {e}") from None


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
            f"{c['triangular inverses']} triangular inverses",
            f"  target {prog.target}; see --emit chunk for the program",
        ]
    if prog.kernels is not None:
        lines.append(f"kernels: {', '.join(k.name for k in prog.kernels.kernels)}  "
                     "(--emit kernel, --emit tilelang, --emit cuda)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
