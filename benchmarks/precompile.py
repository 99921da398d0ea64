"""Compile kernels ahead of time on a machine without a GPU, then carry the cache to the GPU.

TileLang's cache key does not depend on the GPU, so every shape class the GPU tests and the
benchmark will need can be compiled here (a few seconds each) and the GPU's minutes go to running:

    TILELANG_CACHE_DIR=/tmp/tlc python benchmarks/precompile.py --tests --bench --cp 8 --tar .gpu/tl-cache.tar

(enter.sh unpacks the tar on the GPU node). --tar packs only the cache entries this run compiled or
read, so stale kernels from earlier sources do not eat into the 64 MiB the device tool carries.

or name classes: spec:H/HV:K:io:BV (V = K), e.g. gdn:2/8:128:bfloat16:64; their stages and scan
warpgroups are the runtime's for one sequence. The shape classes and the compiling are the
package's warm-up (qla_compiler/precompile.py, `qla-compile SPEC --precompile ...`); this script
adds the classes of the GPU tests and of the benchmark, sharding and packing.
"""
import argparse
import dataclasses
import os
import sys
import tarfile
import time
from pathlib import Path

from qla_compiler.bench import ROWS, parse_dims, parse_row
from qla_compiler.kernels import forward
from qla_compiler.passes.lower_tilelang import ShapeClass
from qla_compiler.precompile import Compile, compile_classes, shape_classes


def classes(spec, H, HV, K, n_seqs, io="bfloat16", cp=1, stages=None, bv=None, V=None, training=False, tokens=None):
    """The shape classes calls at these sizes launch, on an H200 (qla_compiler/precompile.py;
    `bv`: the V-block qla-bench --block-v forces instead of the launch rules; `tokens`: a call's,
    which cp="auto"'s plan depends on). `cp` 1, no cut, by default: at the GPU tests' sizes (a few
    hundred tokens a sequence) the op's default plan cuts nothing, and without `tokens` the classes
    of "auto" would be those of every count it may choose."""
    return shape_classes(spec, H=H, HV=HV, K=K, V=V, io=io, n_seqs=n_seqs, context_parallel=cp, sms=forward.H200_SMS,
                         training=training, stages=stages, block_v=bv, tokens=tokens)


def for_gpu_tests():
    """The classes tests/test_gpu_*.py use (keep in step with those files)."""
    out = for_backward_tests()  # (test_gpu_forward's GDN cases are the same classes)
    out += classes("gdn", 1, 2, 64, 3, io="float16", training=True)  # fp16, K = V = 64
    for spec in ("delta_net", "simple_gla", "retnet", "linear_attn"):
        out += classes(spec, 2, 2, 128, 3, training=True)
    # test_gpu_kernels' CASES, BV = 32: every spec at three classes, the delta rule's also in padded tiles
    kernel_cases = [(spec, *c) for spec in ("gdn", "delta_net", "simple_gla", "linear_attn")
                    for c in ((2, 8, 128, 128), (2, 2, 128, 128), (1, 2, 64, 64))]
    kernel_cases += [(spec, *c) for spec in ("gdn", "delta_net", "kda", "gla")
                     for c in ((2, 4, 100, 60), (1, 2, 16, 48))]
    for spec, H, HV, K, V in kernel_cases:
        shape = ShapeClass(H=H, HV=HV, K=K, V=V, BV=32)  # the whole program, as the test runs it
        out += [Compile(spec, part, shape, None) for part in ("forward", "training", "backward")]
        wide = dataclasses.replace(shape, scan_warpgroups=2)  # the forward scan on two warpgroups
        out += [Compile(spec, "forward", wide, None), Compile(spec, "training", wide, None)]
    # (and GLA's backward at K = V = 128 on each V-block its calls take)
    out += [Compile("gla", "backward", ShapeClass(H=2, HV=2, K=128, V=128, BV=bv), None) for bv in (16, 32, 64)]
    for s in (2, 8):  # the context-parallel cases of test_gpu_forward and test_gpu_backward (3 sequences)
        out += classes("gdn", 2, 8, 128, 3, cp=s, training=True)
    with forward.launch_policy(cut_wide=True):  # test_gpu_forward's cut on the wide kernel
        out += classes("gdn", 2, 8, 128, 3, cp=8)
    for s, wide in ((2, False), (8, True)):  # test_gpu_backward's cuts on the fused training forward
        with forward.launch_policy(cut_fused_training=True, cut_wide=wide):
            out += classes("gdn", 2, 8, 128, 3, cp=s, training=True)
    # (test_gpu_unwritten_memory's CASES are chosen among the classes here; its fused forward of
    # 2/8 heads, 3 sequences, forced fused, compiles on the node)
    return out + for_per_key_tests()


def for_per_key_tests():
    """tests/test_gpu_per_key.py's classes."""
    out = []
    for spec in ("gla", "kda"):  # 1, 2, 3 and 5 sequences; grouped heads at K = V = 64
        for n in (1, 2, 3, 5):
            out += classes(spec, 2, 2, 128, n, training=True)
        out += classes(spec, 1, 4, 64, 3, training=True)
        out += classes(spec, 2, 2, 128, 3, cp=4, training=True)  # its context-parallel case
    for V in (256, 512):  # GLA at its standard heads: K blocks, and V's column blocks
        out += classes("gla", 2, 2, 256, 3, V=V, training=True)
    return out


def for_fused_training_tests():
    """tests/test_gpu_fused_training.py's classes: its training steps, both ways (the fused
    training forward forced, and the separate kernels), two GDN cases on the wide kernel, and
    its kernels alone at V-block 32."""
    out = []
    for policy in (dict(fused=True, fused_training=True), dict(fused_training=False)):
        with forward.launch_policy(**policy):
            for n in (8, 2, 1):  # test_gpu_forward's GDN cases
                out += classes("gdn", 2, 8, 128, n, training=True)
            for spec in ("delta_net", "simple_gla", "retnet", "linear_attn"):
                out += classes(spec, 2, 8, 128, 5, training=True)
    with forward.launch_policy(fused=True, fused_training=True):  # the wide kernel, as the test forces it
        for n in (8, 2):
            out += classes("gdn", 2, 8, 128, n, training=True, bv=128)
    return out + [Compile("gdn", "training", ShapeClass(H=2, HV=4, K=K, V=V, BV=32), None, fused="narrow")
                  for K, V in ((128, 128), (100, 60))]


def for_backward_tests():
    """tests/test_gpu_backward.py's GDN classes (its real-data cases: 8, 2, 1 and 3 sequences)."""
    return [c for n in (8, 2, 1, 3) for c in classes("gdn", 2, 8, 128, n, training=True)]


def for_scan_roles_tests():
    """tests/test_gpu_backward.py's whole-V scans on roles, as its tests force them (GDN's cases,
    DeltaNet and simple GLA)."""
    out = []
    with forward.launch_policy(backward_scan_roles=True, wide=True):
        for n in (8, 2, 1, 3):
            out += classes("gdn", 2, 8, 128, n, training=True)
        for spec in ("delta_net", "simple_gla"):
            out += classes(spec, 2, 2, 128, 3, training=True)
    return out


def for_per_key_bench(rows=("16/16:8x4096", "16/16:1x32768")):
    """qla-bench --spec gla|kda --backward's classes (issue 18's rows), as the op's default ("auto")
    cuts them: 16/16:1x32768 in 4 segments."""
    return [c for spec in ("gla", "kda") for H, HV, lens in map(parse_row, rows)
            for c in classes(spec, H, HV, 128, len(lens), cp="auto", training=True, tokens=sum(lens))]


def for_bench(cp=None, rows=ROWS, stages=None, backward=False, bv=None):
    """qla-bench's: the op's default ("auto": the plan's at the row's tokens), the uncut call (--cp 1)
    and, with `cp`, that count's."""
    out = []
    for row in rows:
        H, HV, lens = parse_row(row)
        K, V = parse_dims(row)
        # (qla-bench --backward: the training step's programs too)
        for segments in dict.fromkeys((1, "auto", cp or 1)):
            out += classes("gdn", H, HV, K, len(lens), cp=segments, stages=stages, bv=bv, V=V, training=backward,
                           tokens=sum(lens))
    return out


def _entries(cache: Path) -> list:
    """The cache's units: a directory of one compiled kernel's files (TileLang), or one generated
    module (qla)."""
    qla = cache / "qla"
    dirs = [d for d in cache.rglob("*") if d.is_dir() and d != qla and any(f.is_file() for f in d.iterdir())]
    return dirs + sorted(qla.glob("*.py"))


def forget_reads(cache: Path) -> None:
    """Set every cached file's access time to 0 (its modification time kept): under Linux's
    relatime a later read moves it again, which is how pack_used finds the entries in use."""
    for f in cache.rglob("*"):
        if f.is_file():
            os.utime(f, (0, f.stat().st_mtime))


def pack_used(cache: Path, since: float, out: str) -> None:
    """Tar (gzip) the cache entries read or written after `since`, relative to the cache root."""
    def used(path: Path) -> bool:
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        return any(f.stat().st_atime > 0 or f.stat().st_mtime >= since for f in files)
    entries = _entries(cache)
    keep = [e for e in entries if used(e)]
    if not any(f.stat().st_atime > 0 for e in keep for f in ([e] if e.is_file() else e.rglob("*")) if f.is_file()):
        # no read moved an access time (a noatime mount): what this run used is unknown, pack it all
        print("precompile: access times do not move here; packing the whole cache", file=sys.stderr)
        keep = entries
    with tarfile.open(out, "w:gz") as tar:
        for e in keep:
            tar.add(e, arcname=str(e.relative_to(cache)))
    print(f"{out}: {len(keep)} cache entries, {os.path.getsize(out) / 2**20:.1f} MiB", flush=True)


def parse(item):
    """spec:H/HV:K:io:BV (V = K) -> the class of one sequence, forced to that V-block."""
    spec, heads, K, io, BV = item.split(":")
    H, HV = map(int, heads.split("/"))
    return classes(spec, H, HV, int(K), 1, io=io, bv=int(BV))


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("items", nargs="*", help="spec:H/HV:K:io:BV")
    ap.add_argument("--tests", action="store_true", help="the classes of the GPU tests")
    ap.add_argument("--bench", action="store_true", help="the classes of qla-bench's rows")
    ap.add_argument("--fused-training-tests", action="store_true",
                    help="the classes of tests/test_gpu_fused_training.py")
    ap.add_argument("--backward-tests", action="store_true", help="the GDN classes of tests/test_gpu_backward.py")
    ap.add_argument("--per-key-tests", action="store_true", help="the classes of tests/test_gpu_per_key.py")
    ap.add_argument("--scan-roles-tests", action="store_true",
                    help="the classes of tests/test_gpu_backward.py's whole-V scans on roles")
    ap.add_argument("--per-key-bench", action="store_true",
                    help="the classes of qla-bench --spec gla|kda --backward on issue 18's rows")
    ap.add_argument("--cp", type=lambda x: x if x == "auto" else int(x), metavar="SEGMENTS",
                    help="with --bench: also the context-parallel classes (a segment count, or auto: the plan's)")
    ap.add_argument("--rows", nargs="*", default=ROWS, help="with --bench: only these rows")
    ap.add_argument("--scan-stages", type=int, help="with --bench: for qla-bench --scan-stages N")
    ap.add_argument("--backward", action="store_true", help="with --bench: for qla-bench --backward")
    ap.add_argument("--block-v", type=int, metavar="BV", help="with --bench: for qla-bench --block-v BV")
    ap.add_argument("--tar", metavar="PATH", help="then pack the cache entries this run used into PATH")
    ap.add_argument("--shard", metavar="I/N", help="compile only every N-th class from the I-th (0-based): "
                                                    "N processes share the machine's cores; then one run with --tar")
    args = ap.parse_args(argv)
    cache, start = Path(os.environ.get("TILELANG_CACHE_DIR", Path.home() / ".tilelang" / "cache")), time.time()
    if args.tar:
        forget_reads(cache)
    todo = [c for i in args.items for c in parse(i)] + (for_gpu_tests() if args.tests else []) \
        + (for_bench(args.cp, args.rows, args.scan_stages, args.backward, args.block_v) if args.bench else []) \
        + (for_per_key_bench() if args.per_key_bench else []) \
        + (for_fused_training_tests() if args.fused_training_tests else []) \
        + (for_scan_roles_tests() if args.scan_roles_tests else []) \
        + (for_per_key_tests() if args.per_key_tests else []) \
        + (for_backward_tests() if args.backward_tests else [])
    todo = list(dict.fromkeys(todo))
    if args.shard:
        i, n = map(int, args.shard.split("/"))
        todo = todo[i::n]
    compile_classes(todo)
    if args.tar:
        pack_used(cache, start, args.tar)


if __name__ == "__main__":
    main(sys.argv[1:])
