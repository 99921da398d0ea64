"""The device functions behind a KernelIR `prefetch` statement (passes/schedule_prefetch.py), as
CUDA a generated kernel imports with `T.import_source` (TileLang 0.1.15 has no L2 prefetch of its
own; its TMA descriptors, which `cp.async.bulk.prefetch.tensor` would need, are private to
`T.tma_copy`).

  * `qla_sm_count()`: the device's SM count as %nsmid reads it (the largest SM id + 1: on parts
    with SMs fused off it can exceed the SMs that run, and a prefetch then reaches a few CTAs
    further ahead, which costs nothing but the lines' stay in L2).
  * `qla_prefetch_rows(first, stride, rows, width, part, parts)`: every 128-byte line of `rows`
    rows of `width` elements, `stride` elements apart from `first` (a chunk's rows of a per-token
    tensor; a chunk state as one row), this thread's share: line w for w ≡ part mod parts.
    `prefetch.L2` with a generic address: no alignment asked (a row of K = 100 bf16 starts
    anywhere), no fault on an address past an allocation (none is formed: rows stop at the chunk's
    valid ones).
"""

L2_PREFETCH_SOURCE = r"""
__device__ __forceinline__ int qla_sm_count() {
  int n;
  asm volatile("mov.u32 %0, %%nsmid;" : "=r"(n));
  return n;
}

template <typename Elem>
__device__ __forceinline__ void qla_prefetch_rows(const Elem* first, int stride, int rows, int width,
                                                  int part, int parts) {
  const int bytes = width * (int)sizeof(Elem);
  const int per_row = bytes / 128 + 2;  // a row that starts inside a line touches one more
  for (int w = part; w < rows * per_row; w += parts) {
    const char* row = reinterpret_cast<const char*>(first + (long long)(w / per_row) * stride);
    const char* line = reinterpret_cast<const char*>(reinterpret_cast<unsigned long long>(row) & ~127ull)
                       + (w % per_row) * 128;
    if (line < row + bytes) {
      asm volatile("prefetch.L2 [%0];" : : "l"(line));
    }
  }
}
"""
