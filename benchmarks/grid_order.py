"""Whether the per-chunk kernels should run with the value heads first in their grid: every
parallel kernel (prep, out; forward and backward) launched with its grid reversed, so that a
chunk's G value heads are adjacent CTAs (blockIdx.x) and read its keys and queries once from
HBM, against the kernels as generated; GPU time per kernel, a training step and an inference
forward per row. The flipped kernels are what the lowering makes from the KernelIR with only its
`grid` field changed (Kernel.grid: the first axis is the fastest-varying). Session 52 (H100,
16/64:8x4096): the training step 8.353 -> 8.165 ms, the backward out kernel 4.293 -> 4.145, the
forward unchanged, with the flipped grids launched 2-D (HV, CH). The lowering now launches a grid
whose chunk slots are not first as one axis of HV x CH CTAs, so this script times that launch
too; `QLA_HEADS_FIRST=1` (schedule_build.parallel_grid) is the same choice made in the schedule.

    python benchmarks/grid_order.py --compile --rows 16/64:8x4096    # CPU: fill the cache first
    python benchmarks/grid_order.py --rows 16/64:8x4096 8/32:1x32768  # GPU
"""
import argparse
import dataclasses
import sys
from types import SimpleNamespace

ROWS = ["16/64:8x4096", "8/32:1x32768"]
_SHIMS: dict = {}  # id(KernelIR) -> (the program with its parallel kernels' grids reversed, the KernelIR kept)


def heads_first(program):
    """`program` as load_kernels takes it, every parallel kernel's grid reversed."""
    kir = program.kernels
    if id(kir) not in _SHIMS:
        flipped = [dataclasses.replace(k, grid=k.grid[::-1]) if k.kind in ("prep", "out") else k for k in kir.kernels]
        _SHIMS[id(kir)] = (SimpleNamespace(kernels=dataclasses.replace(kir, kernels=flipped), path=program.path), kir)
    return _SHIMS[id(kir)][0]


def load_heads_first(program, shape):
    from qla_compiler.kernels.runtime import load_kernels

    return load_kernels(heads_first(program), shape)


def compile_rows(rows) -> None:
    from qla_compiler.bench import parse_row
    from qla_compiler.kernels.forward import H200_SMS
    from qla_compiler.precompile import _kernel_names, _program, shape_classes

    for row in rows:
        H, HV, lens = parse_row(row)
        for c in shape_classes("gdn", H=H, HV=HV, K=128, n_seqs=len(lens), sms=H200_SMS, training=True):
            program = _program(c)
            kernels = load_heads_first(program, c.shape)
            for name in _kernel_names(c, program):
                if any(k.name == name and k.kind in ("prep", "out") for k in program.kernels.kernels):
                    kernels.get(name)


def time_rows(rows) -> None:
    from qla_compiler import ops
    from qla_compiler.bench import device_ms, make_inputs, parse_row, with_backward
    from qla_compiler.kernels import forward as fwd

    for row in rows:
        H, HV, lens = parse_row(row)
        args = make_inputs(H, HV, lens)
        for label, step in (("forward", ops.chunk_gated_delta_rule),
                            ("training", with_backward(ops.chunk_gated_delta_rule))):
            times = {}
            for order, loader in (("as generated", None), ("value heads first", load_heads_first)):
                per_kernel = {}
                with fwd.launch_policy(kernels=loader):
                    total = device_ms(lambda: step(**args), per_kernel=per_kernel)
                times[order] = (total, per_kernel)
            (t0, k0), (t1, k1) = times.values()
            print(f"{row} {label}: as generated {t0:.3f} ms, value heads first {t1:.3f} ms ({t1 / t0 - 1:+.1%})")
            for name in sorted(k0, key=lambda n: -k0[n]):
                if name in k1 and name.startswith("gdn"):
                    print(f"    {name:<32} {k0[name]:.3f} -> {k1[name]:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="*", default=ROWS)
    ap.add_argument("--compile", action="store_true", help="compile the flipped kernels (no GPU needed)")
    a = ap.parse_args(argv)
    if a.compile:
        compile_rows(a.rows)
    else:
        time_rows(a.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
