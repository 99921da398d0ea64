"""Compile kernels ahead of time on a machine without a GPU (TileLang's cache key does not depend
on the GPU), then carry the cache to the GPU machine as .gpu/tl-cache.tar.

    TILELANG_CACHE_DIR=/tmp/tlc python benchmarks/precompile.py gdn:2/8:128:bfloat16:64 ...
    tar -C /tmp/tlc -cf .gpu/tl-cache.tar .

Each argument: spec:H/HV:K:io:BV (V = K).
"""
import sys
import time

import qla_compiler
from qla_compiler.kernels.runtime import load_kernels
from qla_compiler.passes.lower_tilelang import ShapeClass


def main(argv):
    for item in argv:
        spec, heads, K, io, BV = item.split(":")
        H, HV = map(int, heads.split("/"))
        prog = qla_compiler.compile_spec(spec)
        t = time.time()
        load_kernels(prog, ShapeClass(H=H, HV=HV, K=int(K), V=int(K), BV=int(BV), io=io))
        print(f"{item}: {time.time() - t:.1f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
