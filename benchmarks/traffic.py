"""What each kernel of a program moves between HBM (or L2) and the SM per call, read off its KernelIR:
every load and store statement's block, times the CTAs and chunks that run it. A bound to set
beside a kernel's measured time before building the next one (benchmarks/NOTES.md, session 45:
the backward scan with roles was as slow as the plain one, both at their traffic's time).

Each CTA's loads count whole, as if none hit in L2: a K-wide block that every V-block's CTA loads
counts once per V-block. So `time at BW` is the traffic's time at that bandwidth, an upper bound on
what DRAM sees; a kernel measured well under it is served by L2.

    python benchmarks/traffic.py --rows 16/64:8x4096 --backward --bv 64 --bandwidth 3.0
    python benchmarks/traffic.py --rows 16/64:8x4096 --backward --roles --bv 32
"""
from __future__ import annotations

import argparse

from qla_compiler.compiler import compile_spec
from qla_compiler.passes.schedule_memory import _DTYPE_BYTES

LOADS = ("load", "load_vec", "load_chunk_state", "load_state")
STORES = ("store", "store_vec", "store_chunk_state", "store_state")


def _elements(shape: tuple, sizes: dict) -> int:
    n = 1
    for d in shape:
        n *= int(d) if str(d).isdigit() else sizes[d]
    return n


def statement_bytes(params: dict, buffers: dict, st, sizes: dict, io_bytes: int) -> tuple[int, int]:
    """(bytes loaded, bytes stored) by one execution of `st` in one CTA of a kernel with these
    parameters and buffers (by name): its block's elements at the global tensor's dtype."""
    if st.op in LOADS and st.srcs and st.srcs[0] in params:
        tensor, block = params[st.srcs[0]], buffers[st.dst]
        size = io_bytes if tensor.dtype == "io" else _DTYPE_BYTES.get(tensor.dtype, 4)
        return _elements(block.shape, sizes) * size, 0
    if st.op in STORES and st.dst in params and st.srcs:
        tensor, block = params[st.dst], buffers[st.srcs[0]]
        size = io_bytes if tensor.dtype == "io" else _DTYPE_BYTES.get(tensor.dtype, 4)
        return 0, _elements(block.shape, sizes) * size
    return 0, 0


def tensor_bytes(kernel, sizes: dict, io_bytes: int = 2) -> tuple[int, int]:
    """(bytes of the tensors `kernel` reads, of those it writes), each counted once: what DRAM sees
    at the least, where every repeated block (a K-wide block each V-block's CTA loads, a key head's
    block its value heads load) hits in L2."""
    dims = dict(sizes, T=sizes["N"] * sizes["L"], **{"1": 1, "N+1": sizes["N"] + 1, "2": 2})
    total = [0, 0]
    for p in kernel.params:
        size = io_bytes if p.dtype == "io" else _DTYPE_BYTES.get(p.dtype, 4)
        total[p.role == "out"] += _elements(p.shape, dims) * size
    return total[0], total[1]


def kernel_traffic(kernel, sizes: dict, io_bytes: int = 2) -> tuple[int, int]:
    """(bytes loaded, bytes stored) by one launch of `kernel` at `sizes` (C, K, V, BV, HV, N, CH:
    the chunks of all sequences)."""
    roles = kernel.warp_roles or ()
    prologue = [s for r in roles for s in r.prologue] if roles else list(kernel.prologue)
    body = [s for r in roles for s in r.body] if roles else list(kernel.body)
    epilogue = [s for r in roles for s in r.epilogue] if roles else list(kernel.epilogue)
    per_v_block = sizes["V"] // sizes["BV"]
    if kernel.walks_chunks:  # a CTA per (V-block, value head, sequence) walks its chunks
        walks, chunks = sizes["HV"] * per_v_block * sizes["N"], sizes["HV"] * per_v_block * sizes["CH"]
    else:  # a CTA per (chunk, value head[, key block]): the body runs once
        walks = chunks = sizes["HV"] * sizes["CH"] * (sizes["K"] // kernel.key_block if kernel.key_block else 1)
        prologue, body, epilogue = [], [*prologue, *body, *epilogue], []
    params, buffers = {p.name: p for p in kernel.params}, {b.name: b for b in kernel.buffers}
    sizes = dict(sizes, BK=kernel.key_block or sizes["K"])
    total = [0, 0]
    for stmts, times in ((prologue, walks), (body, chunks), (epilogue, walks)):
        for st in stmts:
            loaded, stored = statement_bytes(params, buffers, st, sizes, io_bytes)
            total[0] += loaded * times
            total[1] += stored * times
    return total[0], total[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=["16/64:8x4096"], help="h_qk/h_v:NxL, K = V = 128")
    ap.add_argument("--spec", default="gdn")
    ap.add_argument("--backward", action="store_true", help="the backward program's kernels")
    ap.add_argument("--roles", action="store_true",
                    help="with --backward: its scan with roles (at --bv 128 the wide one)")
    ap.add_argument("--fused", action="store_true", help="the fused (training, with --training) forward")
    ap.add_argument("--training", action="store_true", help="the training forward's kernels")
    ap.add_argument("--bv", type=int, default=64, help="the walking kernel's V-block")
    ap.add_argument("--bandwidth", type=float, default=3.0, help="TB/s the times are at (H100 ~3.0, H200 ~4.3)")
    args = ap.parse_args()
    prog = compile_spec(args.spec)
    if args.backward:
        prog = (prog.backward_wide_roles_program if args.bv == 128 else prog.backward_roles_program) if args.roles \
            else prog.backward_program
    elif args.fused:
        prog = prog.fused_training_program if args.training else prog.fused_program
    elif args.training:
        prog = prog.training_program
    for row in args.rows:
        heads, seqs = row.split(":")[:2]
        H, HV = map(int, heads.split("/"))
        N, L = map(int, seqs.split("x"))
        sizes = {"C": 64, "K": 128, "V": 128, "BV": args.bv, "HV": HV, "H": H, "N": N, "L": L, "CH": N * -(-L // 64)}
        print(f"# {args.spec} {row}, V-block {args.bv}, GiB a call and its time at {args.bandwidth} TB/s: "
              "every CTA's blocks (no L2 hits) | every tensor once (all repeats hit)")
        at = args.bandwidth * 1e12 / 1e3
        for k in prog.kernels.kernels:
            loaded, stored = kernel_traffic(k, sizes)
            once_in, once_out = tensor_bytes(k, sizes)
            print(f"  {k.name:<32} {loaded / 2**30:5.2f} + {stored / 2**30:5.2f}  {(loaded + stored) / at:6.3f} ms"
                  f"  |  {once_in / 2**30:5.2f} + {once_out / 2**30:5.2f}  {(once_in + once_out) / at:6.3f} ms")


if __name__ == "__main__":
    main()
