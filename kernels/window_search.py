"""Building block: context parallelism's window search (context_parallel.window_skips) as one
kernel on the GPU path, in place of ~25 torch ops a call (the keys' norms, λ, per-chunk sums, their
prefix, the comparison, the scatter: 0.08–0.13 ms of GPU time and most of a context-parallel call's
host time at 2/8 and 8/32 heads on the H200; benchmarks/NOTES.md, session 22).

One CTA per (segment, value head), C threads, one per token of a chunk. It walks its segment's
chunks from the end nearest the next segment (from its start in a reverse scan); each thread forms
its token's λ_t as context_parallel.contraction_logs does — the log decay plus, with a delta
factor, log max(1, |1 − s_t ‖x_t‖²|), floored at −2·NEGLIGIBLE — and every thread adds the chunk's
λ, read back from shared memory in one order, to its own float64 total, so all threads hold the
same total and the branches on it stay uniform. At the first chunk where the total reaches
−NEGLIGIBLE it stops reading: like the window scan after it, it touches only the window's tokens.
It writes how many chunks the walk leaves out: the chunks before the window (after it, in
reverse), none where no window decays enough, all where nothing reads the segment's map.

The keys' norms ‖k_t‖² (with a delta factor): all threads first load the chunk's C×K keys into
shared memory together, coalesced, 16 bytes a load (rows past the segment's end not read), then
each thread sums its token's squares in float32 from its row there. Summed by each thread over its
own row in global memory (uncoalesced), they were ~87% of the kernel's time: 0.0735 ms against
0.0098 ms with the norms given as an input (H200, 2/8 heads, 1x32768 tokens, 8 segments;
benchmarks/window_search_variants.py, session 24). The barrier after that load also keeps a
chunk's λ from overwriting the last chunk's before every thread has summed them.

The host code's torch version stays the definition (context_parallel.window_skips; the CPU path
and the emulated kernels run it); tests/test_gpu_window_search.py holds the kernel to it.

    >>> src = source(("gate", True), H=2, HV=8, K=128, io="bfloat16", C=64, reverse=False)
    >>> [line.strip() for line in src.splitlines() if line.strip().startswith("lam_s[tx] = T.max")]
    ['lam_s[tx] = T.max(decay[0, t, i_hv] + T.log(T.max(1.0, T.abs(1.0 - coeff[t, i_hv] * norm2[0]))), FLOOR)']
"""
from __future__ import annotations

import functools

import torch

from qla_compiler.context_parallel import NEGLIGIBLE, delta_coefficient, head_constant_logs, token_gate_logs

DECAYS = ("gate", "head_constant", "none")
# A per-key gate's λ is its slowest key's log decay (contraction_logs): reduced over the keys on the
# host (one amax) and read as a gate per token, so it shares the gate's kernel.
READ_AS = {"key_gate": "gate"}


def kind(rec) -> tuple:
    """(decay, delta) of a recurrence's Structure, as the kernel is specialised for it."""
    st = rec.structure
    decay = READ_AS.get(st.decay, st.decay)
    if decay not in DECAYS:
        raise ValueError(f"window search: no kernel for a {st.decay!r} decay; it takes {DECAYS + tuple(READ_AS)}")
    return decay, bool(st.delta)


def source(kind_: tuple, H: int, HV: int, K: int, io: str, C: int, reverse: bool) -> str:
    """The TileLang module of the search for a (decay, delta) kind, these heads and key width, a
    `reverse` scan's windows or a forward one's."""
    decay, delta = kind_
    params = {"gate": ['    decay: T.Tensor((1, Tok, HV), "float32"),'],
              "head_constant": ['    head_logs: T.Tensor((HV,), "float32"),'], "none": []}[decay]
    if delta:
        params += ["    keys: T.Tensor((1, Tok, H, K), IO),", '    coeff: T.Tensor((Tok, HV), "float32"),']
    log_decay = {"gate": "decay[0, t, i_hv]", "head_constant": "head_logs[i_hv]", "none": "0.0"}[decay]
    if delta:
        lam = f"{log_decay} + T.log(T.max(1.0, T.abs(1.0 - coeff[t, i_hv] * norm2[0])))"
        vec = 16 // (4 if io == "float32" else 2)  # a key's elements in a 16-byte load
        while K % vec:
            vec //= 2
        # the chunk's C×K keys into shared memory by all threads, coalesced (the rows past the
        # segment's end, the next segment's or past the tensor's, are not read: zeros), then each
        # thread's token's ‖k‖² from its row
        load = ["                for r, x in T.Parallel(C, K):  # coalesced, VEC elements a load",
                "                    keys_s[r, x] = T.if_then_else(j * C + r < n, keys[0, bos + j * C + r, i_h, x], T.cast(0, IO))",
                "                T.sync_threads()  # the keys in, and every thread done with the last chunk's λ"]
        norm = ["                    norm2[0] = 0.0",
                "                    for x0 in T.serial(K // VEC):",
                "                        for v in T.vectorized(VEC):",
                "                            key[v] = keys_s[tx, x0 * VEC + v]",
                "                        for v in T.serial(VEC):",
                "                            norm2[0] += T.cast(key[v], \"float32\") * T.cast(key[v], \"float32\")"]
    else:
        lam, load, norm, vec = log_decay, [], [], 0
    walk = "w" if reverse else "chunks - 1 - w"
    left = "chunks - 1 - found[0]" if reverse else "found[0]"
    lines = [
        '"""Context parallelism\'s window search, generated by qla (kernels/window_search.py)."""',
        "import tilelang.language as T",
        "",
        f"H, HV, K, C = {H}, {HV}, {K}, {C}",
        *([f"VEC = {vec}  # a key's elements per 16-byte load"] if delta else []),
        "G = HV // H",
        f'IO = "{io}"',
        f"NEGLIGIBLE = {NEGLIGIBLE!r}",
        f"FLOOR = {-2 * NEGLIGIBLE!r}  # λ's floor (contraction_logs): g = −inf stays finite",
        'Tok = T.dynamic("T")',
        'NS = T.dynamic("NS")  # segments',
        'NS1 = T.dynamic("NS1")',
        "",
        "",
        "@T.prim_func",
        "def window_search(",
        *params,
        '    cu_seg: T.Tensor((NS1,), "int32"),',
        '    unused: T.Tensor((NS,), "int32"),',
        '    skip: T.Tensor((NS, HV), "int32"),',
        "):",
        "    with T.Kernel(NS, HV, threads=C) as (i_s, i_hv):",
        "        i_h = i_hv // G",
        "        tx = T.get_thread_binding()",
        '        lam_s = T.alloc_shared((C,), "float32")',
        '        total = T.alloc_local((1,), "float64")  # the window\'s λ so far, the same in every thread',
        '        found = T.alloc_local((1,), "int32")  # the chunk where it reached −NEGLIGIBLE, −1 before',
        *(['        keys_s = T.alloc_shared((C, K + VEC), IO)  # a chunk\'s keys; rows padded: no bank conflicts',
           '        key = T.alloc_local((VEC,), IO)',
           '        norm2 = T.alloc_local((1,), "float32")'] if delta else []),
        "        bos = cu_seg[i_s]",
        "        n = cu_seg[i_s + 1] - bos",
        "        chunks = T.ceildiv(n, C)",
        "        total[0] = T.float64(0)",
        "        found[0] = -1",
        "        # (nothing reads an unused segment's map: its walk would read every chunk for nothing)",
        "        walks = T.if_then_else(unused[i_s] != 0, 0, chunks)",
        f"        for w in T.serial(walks):  # from the segment's {'start' if reverse else 'end'}",
        f"            j = {walk}",
        "            if found[0] < 0:",
        *load,
        "                if j * C + tx < n:",
        "                    t = bos + j * C + tx",
        *norm,
        f"                    lam_s[tx] = T.max({lam}, FLOOR)",
        "                else:",
        "                    lam_s[tx] = 0.0",
        "                T.sync_threads()",
        "                for u in T.serial(C):",
        '                    total[0] += T.cast(lam_s[u], "float64")',
        ("                # (the next chunk's λ wait at the barrier after its keys' load)" if delta else
         "                T.sync_threads()  # before the next chunk's λ overwrite what was summed"),
        "                if total[0] <= -NEGLIGIBLE:",
        "                    found[0] = j",
        "        if tx == 0:",
        f"            skip[i_s, i_hv] = T.if_then_else(unused[i_s] != 0, chunks, T.if_then_else(found[0] < 0, 0, {left}))",
        ""]
    return "\n".join(lines)


@functools.lru_cache(maxsize=64)
def compiled(kind_: tuple, H: int, HV: int, K: int, io: str, C: int, reverse: bool):
    """The search compiled for sm_90a (TileLang's cache keeps it across processes; the first use in
    a process says so on stderr, as the generated kernels do)."""
    from .runtime import compile_prim, import_module, write_source

    path = write_source("window_search", source(kind_, H, HV, K, io, C, reverse))
    detail = f"{kind_[0]}{' delta' if kind_[1] else ''}, H={H} HV={HV} K={K} {io}{', reverse' if reverse else ''}"
    return compile_prim(import_module(path).window_search, "window_search", detail, path)


def searcher(rec, inputs: dict, HV: int, C: int):
    """(layout, reverse) -> [N·S, HV] int32, window_skips' result, by the kernel, for a call's packed
    inputs [1, T, ...] by name on the GPU."""
    k_ = kind(rec)
    keys = inputs[rec.structure.write_key]
    H, K = keys.shape[2], keys.shape[3]
    io = str(keys.dtype).removeprefix("torch.")
    args = arguments(rec, inputs, HV)

    def search(layout, reverse: bool) -> torch.Tensor:
        n = layout.cu.numel() - 1
        skip = torch.empty(n, HV, dtype=torch.int32, device=keys.device)
        compiled(k_, H, HV, K, io, C, bool(reverse))(*args, layout.cu, layout.unused[reverse], skip)
        return skip

    return search


def arguments(rec, inputs: dict, HV: int) -> list:
    """What the search takes before the layout's tensors, in source's parameter order, from a
    call's packed inputs: the log decay (a gate per token, a per-key gate's largest entry, or the
    heads' constants), and with a delta factor the keys and its coefficient."""
    k_, st = kind(rec), rec.structure
    keys = inputs[st.write_key]
    args = {"gate": lambda: [token_gate_logs(rec, inputs, HV).reshape(1, keys.shape[1], HV).contiguous()],
            "head_constant": lambda: [head_constant_logs(rec, HV, keys.device)], "none": lambda: []}[k_[0]]()
    if k_[1]:
        args += [keys.contiguous(), delta_coefficient(rec, inputs, HV).contiguous()]
    return args
