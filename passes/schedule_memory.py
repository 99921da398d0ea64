"""schedule's budgets and liveness: the sizes a kernel is budgeted at, the shared memory and
registers its live buffers take at each statement, and the placement of the parallel kernels' loads
by that liveness (as early as the peak allows, waited for right before the reader)."""
from __future__ import annotations

import os

from qla_compiler.ir.kernel import Buffer, Kernel, Stmt
from qla_compiler.kernels.tri_inverse_scratch import PHASES as INVERSE_PHASES, SCRATCH as INVERSE_SCRATCH

from .schedule_build import Builder

THREADS = 128
HEAD_DIMS = (128, 128)  # the head-dim tiles (K, V) a schedule serves by default (schedule's head_dims)


# Shared memory a parallel kernel may use (H100/H200 allow 227 KB per CTA; the margin leaves room
# for TileLang's own scratch, and for its allocator packing less tightly than live_shared counts).
# An out kernel whose live blocks need more at their peak is split by output.
SMEM_BUDGET = 200 * 1024
# Registers per thread a parallel kernel's live fragments may fill at 128 threads (of 255; the rest
# hold addresses and temporaries). A kernel that needs more runs on 256 threads, two warpgroups
# splitting each wgmma's columns: GDN's backward out kernel (176 KB of live fragments) spilled
# at 128 threads and took 15.4 ms on 16/64 × 32768, 6.9 ms at 256 (session 5, run B).
FRAGMENT_REGISTERS = 224
# An H100/H200 SM: 228 KB of shared memory, of which the system reserves 1 KB per resident CTA,
# and 64K registers. For a prep with the inverse the schedule asks ptxas for ctas_per_sm (launch
# bounds), which caps each thread's registers at 64K / (threads · CTAs): the GDN solve-only prep
# 4 → 6 CTAs an SM with T built in A's place, 0.61 → 0.60 ms at 16/64 (H200, session 23).
SM_SHARED, CTA_RESERVED, SM_REGISTERS = 228 * 1024, 1024, 65536
# The most dynamic shared memory a CTA may ask for: a launch asking more fails ("Failed to set the
# allowed dynamic shared memory size"), which GLA's d v kernel at K = V = 256 did on the H100
# (session 36) with 192 KB live at its peak and 256 KB as TileLang placed its blocks (packed_shared)
CTA_SHARED_MAX = SM_SHARED - CTA_RESERVED
# What place_loads leaves free below the shared memory a CTA may take at its kernel's CTAs an SM
# (_room), for TileLang's allocator packing less tightly than live_shared counts
ROOM_MARGIN = 8 * 1024
# Blocks issued as early as the CTAs an SM its shared memory allows leave room for (_room), not
# only under the kernel's own peak: GDN's backward out kernel 5.31 → 4.54 ms, its training step
# 10.44 → 9.65 ms (H100, 16/64:8x4096; NOTES session 48). QLA_LOAD_ROOM=0 turns it off (the
# generated source differs: both variants cache side by side).
LOAD_ROOM = os.environ.get("QLA_LOAD_ROOM", "1") == "1"
# Blocks issued a few at a time in the order their readers need them, each as its wait for the
# block LOAD_LOOKAHEAD earlier in that order begins (the first LOAD_LOOKAHEAD where the default
# puts them), instead of as early as the shared memory allows (_issued, _room): the first block
# lands sooner where fewer copies share the SM's bandwidth, the rest stream in under the work.
# H100 (NOTES session 49), GDN's backward out kernel at 16/64:8x4096: 4.56 ms by default, 4.92 at
# L = 1 (each block lands just in time), 4.52 at 2, 4.41 at 3; the wait for the first block is
# little of that kernel's time. QLA_LOAD_LOOKAHEAD=L turns it on; 0 (the default) keeps the early
# issues (the generated source differs: both variants cache side by side).
LOAD_LOOKAHEAD = os.environ.get("QLA_LOAD_LOOKAHEAD", "0")
if not LOAD_LOOKAHEAD.isdigit():
    raise ValueError(f"QLA_LOAD_LOOKAHEAD={LOAD_LOOKAHEAD!r}: expected a count of blocks (0 turns it off)")
LOAD_LOOKAHEAD = int(LOAD_LOOKAHEAD)
# packed_shared's alignment of every block: TileLang aligns a TMA-swizzled block to 1024 bytes
PACK_ALIGN = 1024
# registers a thread needs beside its live fragments under such a cap (the GDN solve-only prep: 32
# fragment registers, 96 in all uncapped, 79 and no spills at a cap of 80)
REGISTER_OVERHEAD = 48
_DTYPE_BYTES = {"io": 2, "float32": 4, "tfloat32": 4, "int32": 4}


def dim_sizes(head_dims: tuple = HEAD_DIMS, key_block: int = 0) -> dict:
    """The size of every dim name a buffer uses, at the largest class the schedule serves: the
    head-dim tiles `head_dims`, the widest V-block, the chunk, and a kernel's key block (Kernel.key_block:
    at most K's tile)."""
    K, V = head_dims
    return {"C": 64, "K": K, "V": V, "BV": 64, **({"BK": min(key_block, K)} if key_block else {})}


def buffer_bytes(b: Buffer, dims: dict) -> int:
    """A buffer's size at the sizes `dims` (dim_sizes)."""
    n = _DTYPE_BYTES[b.dtype]
    for d in b.shape:
        n *= _size(d, dims)
    return n + n // _size(b.shape[-1], dims) * b.row_pad if b.row_pad else n


def _size(dim: str, dims: dict) -> int:
    """A dim's size: a named one's from `dims`, a literal one ("16", a building block's) itself."""
    return int(dim) if dim.isdigit() else dims[dim]


def smem_bytes(buffers, dims: dict) -> int:
    """Shared memory of a kernel's buffers at the sizes `dims` (no reuse assumed)."""
    return sum(buffer_bytes(b, dims) for b in buffers if b.scope == "shared")


def zero_pad(loads: list, only_partial: bool) -> list:
    """A partial last chunk reads the next sequence's tokens: zero those rows (padding is exact),
    or, for a loaded prefix sum (pad=hold), repeat its last row. For the pipelined scan, whose TMA
    loads cannot mask; `only_partial` skips full chunks."""
    return [Stmt("zero_pad", s.dst, (), (("rows", "n_valid"), ("only_partial", only_partial)) + _pad(s))
            for s in loads if s.op == "load"]


def _pad(load: Stmt) -> tuple:
    """A load's padding rule, for the statement that pads its rows (zeros, or the last row held)."""
    return (("pad", load.attr["pad"]),) if load.attr.get("pad") else ()


def place_loads(b: Builder, body: list, split_phase: bool) -> list:
    """The parallel kernels' statements, with their loads placed by shared-memory liveness.

    Without `split_phase` each block is loaded through registers right before its first reader,
    its padding rows zeroed on the way, so that blocks whose lives do not overlap share shared
    memory (the loads are synchronous: issuing them all first would hide no latency and keep every
    block alive through the whole kernel).

    With `split_phase` (the default, SPLIT_PHASE_LOADS) vectors are loaded first, and a block (the chunk's
    rows of a per-token tensor, or the state entering the chunk) is a TMA copy in two phases:
    issued as early as it fits under the kernel's peak of live shared memory, then earlier still
    where the CTAs an SM the kernel runs leave each more than that peak (_room), waited for right
    before its first reader, so its latency overlaps the work in between. A partial chunk's rows
    past the sequence belong to the next one (TMA cannot mask them): they are zeroed after the
    wait. An issue after other work is marked `sync`: its memory may be what an earlier block
    used, which other threads (or their wgmmas) may still be reading. A load marked `cast` (a
    float32 state into an io block) stays synchronous: TMA copies bytes and converts nothing."""
    def rows(ld):  # a synchronous block load, masked to the chunk's rows on the way
        return Stmt(ld.op, ld.dst, ld.srcs, ld.attrs + (("rows", "n_valid"),)) if ld.op == "load" else ld

    out, pending, issues = [], list(b.loads), []
    for st in body:
        touched = reads(st) | {st.dst}  # a write (a store staged in the block) needs the load first too
        for ld in [ld for ld in pending if ld.dst in touched]:
            pending.remove(ld)
            if split_phase and ld.op in ("load", "load_chunk_state") and not ld.attr.get("cast"):
                issues.append(Stmt(ld.op, ld.dst, ld.srcs, ld.attrs + (("async", True),)))
                out.append(Stmt("wait_load", ld.dst))
                if ld.op == "load":
                    out.append(Stmt("zero_pad", ld.dst, (), (("rows", "n_valid"), ("only_partial", True)) + _pad(ld)))
            else:
                out.append(rows(ld))
        out.append(st)
    if not split_phase:
        return [rows(ld) for ld in pending] + out
    out = pending + out
    # a vector is 256 bytes: all of them first, their global latencies overlapping each other's
    vectors = [st for st in out if st.op == "load_vec"]
    out = vectors + [st for st in out if st.op != "load_vec"]
    tight = _issued(b, out, issues)
    share = _share(_asks(b, tight)) if LOAD_ROOM else 0
    room = _room(b, tight, share)
    placed = tight
    if room:
        roomy = _earlier(b, tight, room)
        placed = roomy if _asks(b, roomy) <= share - ROOM_MARGIN else tight
    return _looking_ahead(b, placed, LOAD_LOOKAHEAD) if LOAD_LOOKAHEAD > 0 else placed


def _issued(b: Builder, stmts: list, issues: list) -> list:
    """`stmts` with each of the async `issues` placed as early as _earliest_issue allows."""
    out = list(stmts)
    for issue in issues:
        _insert(out, _earliest_issue(b, out, issue.dst), issue)
    return out


def _looking_ahead(b: Builder, stmts: list, lookahead: int) -> list:
    """`stmts` with each async issue moved down, where it comes earlier, to right before the wait
    for the block `lookahead` places before it in the order of their waits: no more than
    `lookahead` blocks in flight ahead of the one a reader waits for (LOAD_LOOKAHEAD). An issue only
    moves later, so no more is live at any statement than before. A moved issue has a barrier
    first only where a shared block's life has ended before it, the inverse's scratch included
    (memory TileLang may give it): otherwise nothing can be reading its memory, and a barrier would
    only hold every warp up."""
    order = [st.dst for st in stmts if st.op == "wait_load"]
    out = list(stmts)
    for i, name in enumerate(order[lookahead:], start=lookahead):
        at = next(j for j, st in enumerate(out) if _issue(st) and st.dst == name)
        anchor = next(j for j, st in enumerate(out) if st.op == "wait_load" and st.dst == order[i - lookahead])
        if at < anchor:
            issue = out.pop(at)
            ended = any(last < anchor - 1 for _, last in _lifetimes(b.buffers, out, "shared").values()) \
                or any(st.op == "inverse" for st in out[:anchor - 1])
            out.insert(anchor - 1, Stmt(issue.op, issue.dst, issue.srcs,
                                        tuple(x for x in issue.attrs if x[0] != "sync") + ((("sync", True),) if ended else ())))
    return out


def _earlier(b: Builder, stmts: list, room: int) -> list:
    """`stmts` with each async issue, in turn, moved up while its block fits under `room` as
    well, up to the issue before it: never later than it was, the issues in their order."""
    out = list(stmts)
    for issue in [st for st in stmts if _issue(st)]:
        at = next(i for i, st in enumerate(out) if st.op == issue.op and st.dst == issue.dst)
        del out[at]
        size, live = smem_bytes([b.buffers[issue.dst]], b.dims), live_shared(b.buffers, out, b.dims)
        while at > 0 and live[at - 1] + size <= room and out[at - 1].op != "inverse" and not _issue(out[at - 1]):
            at -= 1
        _insert(out, at, Stmt(issue.op, issue.dst, issue.srcs, tuple(x for x in issue.attrs if x[0] != "sync")))
    return out


def _issue(st: Stmt) -> bool:
    """Whether `st` issues a block's split-phase load."""
    return st.op in ("load", "load_chunk_state") and bool(st.attr.get("async"))


def _insert(stmts: list, at: int, issue: Stmt):
    """Put the async `issue` at `at`, marked `sync` where other work comes before it."""
    after_work = any(not st.attr.get("async") for st in stmts[:at])
    stmts.insert(at, Stmt(issue.op, issue.dst, issue.srcs, issue.attrs + ((("sync", True),) if after_work else ())))


def _asks(b: Builder, stmts: list) -> int:
    """The shared memory a kernel of these statements takes: what is live at its peak, or as its
    blocks are placed (packed_shared) where that is more."""
    return max(max(live_shared(b.buffers, stmts, b.dims), default=0), packed_shared(b.buffers, stmts, b.dims))


def _share(asks: int) -> int:
    """The shared memory each CTA of a kernel that asks `asks` bytes may take without an SM
    holding fewer of them (0 where not even one fits). Its registers may allow fewer CTAs, and so
    more each: counting them (ctas_per_sm's model) moved GDN's forward prep's and out kernel's
    loads and gained nothing (H100, session 48)."""
    ctas = SM_SHARED // (asks + CTA_RESERVED)
    return min(CTA_SHARED_MAX, SM_SHARED // ctas - CTA_RESERVED) if ctas else 0


def _room(b: Builder, stmts: list, share: int) -> int:
    """How much shared memory the blocks of the kernel of `stmts` (each issued under its own
    peak) may have live once issued earlier: `share`, the SM's share for each of as many CTAs as
    the kernel takes now (_share), less ROOM_MARGIN for TileLang's allocator packing less tightly than
    live_shared counts, and within SMEM_BUDGET; 0 where that is no more than its peak. GDN's
    backward out kernel peaks at 178 KB, one CTA an SM: its late block d o may be issued at the
    start, where the peak alone left it to be loaded right before its reader, its latency in the
    open. place_loads keeps the earlier issues only where the blocks, as placed (packed_shared),
    still fit the share."""
    peak = max(live_shared(b.buffers, stmts, b.dims), default=0)
    room = min(SMEM_BUDGET, share - ROOM_MARGIN)
    return room if room > peak else 0


def _earliest_issue(b: Builder, stmts: list, name: str) -> int:
    """Where the async load of block `name` may start: the first position from which, up to its
    wait, twice the block fits under the peak of live shared memory the statements already have,
    and not before the inverse (the usual peak). The margin and the stop are there because
    TileLang's allocator packs less tightly than this estimate: with the block allowed right up
    to the peak, GDN's backward prep took 8 KB more than it had, one CTA per SM less."""
    size = smem_bytes([b.buffers[name]], b.dims)
    live = live_shared(b.buffers, stmts, b.dims)
    wait = next(i for i, st in enumerate(stmts) if st.op == "wait_load" and st.dst == name)
    peak = max(live, default=0)
    at = wait
    while at > 0 and live[at - 1] + 2 * size <= peak and stmts[at - 1].op != "inverse":
        at -= 1
    return at


def _lifetimes(buffers: dict, stmts: list, scope: str) -> dict:
    """{buffer of `scope`: (its first statement, its last)}, in the order they are first touched."""
    first, last = {}, {}
    for i, st in enumerate(stmts):
        for x in reads(st) | {st.dst}:
            if x in buffers and buffers[x].scope == scope:
                first.setdefault(x, i)
                last[x] = i
    return {x: (first[x], last[x]) for x in first}


def _live(buffers: dict, stmts: list, scope: str) -> list:
    """The buffers of `scope` live at each statement (from first touch to last)."""
    lives = _lifetimes(buffers, stmts, scope)
    return [[buffers[x] for x, (a, b) in lives.items() if a <= i <= b] for i in range(len(stmts))]


def live_fragments(buffers: dict, stmts: list, dims: dict) -> int:
    """Peak bytes of fragments (registers, over all threads) live at once."""
    return max((sum(buffer_bytes(b, dims) for b in bs) for bs in _live(buffers, stmts, "fragment")), default=0)


def threads_for(b: Builder, body: list) -> int:
    """A parallel kernel's threads: one warpgroup, or two where its live fragments would not fit
    one's registers (FRAGMENT_REGISTERS)."""
    return THREADS if live_fragments(b.buffers, body, b.dims) <= FRAGMENT_REGISTERS * 4 * THREADS else 2 * THREADS


# A parallel kernel of one or two warpgroups whose shared memory holds one or two CTAs an SM runs
# 4–8 warps there, 1–2 a scheduler, and every shared-load and exponential latency shows (KDA's
# backward prep and d v d β kernels: 4 warps an SM; its forward prep and out kernel 8). With this
# on, a kernel takes twice its warpgroups, up to four, where an SM would then run more warps by
# ctas_per_sm's model of its shared memory and registers: each thread holds half its fragments
# (ptxas on the CPU: KDA's d q d k d g 255 → 128 registers, GDN's backward out 217 → 128 without
# spills, KDA's forward prep 167 → 96; NOTES, session 34). Off: on the H100 (session 36, 16/16
# and 16/64:8x4096) it took KDA's forward 2.66 → 3.53 ms, GLA's 1.50 → 1.93, GDN's training step
# 14.6 → 15.8; it sped KDA's and GLA's backward out kernels, but less than key blocks do
# (schedule.KEY_BLOCKS). QLA_MORE_WARPGROUPS=1 turns it on (the generated source differs, so both
# variants cache side by side).
# QLA_MORE_WARPGROUPS=gradients applies it to a backward's out kernels alone: off too, GDN's
# (latency-bound at 8 warps an SM, session 44's ncu) ran 5.26 → 5.76 ms at 16 warps (H100,
# 16/64:8x4096, NOTES session 47).
MORE_WARPGROUPS = os.environ.get("QLA_MORE_WARPGROUPS", "0") == "1"
MORE_WARPGROUPS_GRADIENTS = os.environ.get("QLA_MORE_WARPGROUPS", "0") in ("1", "gradients")
WARPS_ENOUGH = 16  # 4 a scheduler


def more_warpgroups(threads: int, shared_peak: int, fragment_bytes: int, on: bool = MORE_WARPGROUPS) -> int:
    """A parallel kernel's threads, given those its registers ask for (threads_for), its shared
    memory at its peak and its live fragments' bytes: twice them, up to four warpgroups, where `on`,
    an SM runs fewer than WARPS_ENOUGH of its warps, and would then run more (ctas_per_sm's CTAs ×
    warps a CTA). A kernel that already runs as many keeps its threads (GDN's solve-only prep, 6
    CTAs of 4 warps, was tuned there: NOTES, session 23).

        >>> KB = 1024
        >>> more_warpgroups(256, 184 * KB, 208 * 4 * 256, on=True)   # KDA's d q d k d g: 8 → 16 warps
        512
        >>> more_warpgroups(128, 88 * KB, 128 * 4 * 128, on=True)    # KDA's forward prep: 8 → 16
        256
        >>> more_warpgroups(128, 34 * KB, 32 * 4 * 128, on=True)     # GDN's solve-only prep: 24 already
        128
        >>> more_warpgroups(256, 184 * KB, 208 * 4 * 256, on=False)
        256
    """
    def warps(n):
        return occupancy(shared_peak, fragment_bytes, n)[0]
    more = on and threads < 4 * THREADS and warps(threads) < WARPS_ENOUGH and warps(2 * threads) > warps(threads)
    return 2 * threads if more else threads


def _inverse_scratch(dims: dict) -> int:
    """The shared memory the inverse building block allocates beside a kernel's buffers, at its
    widest phase."""
    return max(smem_bytes([INVERSE_SCRATCH[n] for n in phase], dims) for phase in INVERSE_PHASES)


def live_shared(buffers: dict, stmts: list, dims: dict) -> list:
    """Bytes of shared memory live at each statement: every shared buffer from its first touch
    (a load's issue) to its last, plus the scratch a building block (the inverse) allocates."""
    live = [smem_bytes(bs, dims) for bs in _live(buffers, stmts, "shared")]
    scratch = _inverse_scratch(dims)
    return [n + (scratch if st.op == "inverse" else 0) for n, st in zip(live, stmts)]


def packed_shared(buffers: dict, stmts: list, dims: dict) -> int:
    """The end of the last shared block when each is placed, at its first touch, at the lowest
    offset free through its whole life (a block never moves and never splits): the memory a kernel
    asks at launch, where live_shared counts what is live at once. The two differ where a wide
    block finds no gap as wide as itself. GLA's d v kernel at K = V = 256: 192 KB live at its peak,
    but the entering d S (128 KB) comes after g_cum (64 KB), k and q (32 KB each) have left holes
    of 96 KB, so it goes on top: 256 KB, as TileLang 0.1.15 placed it too. Over the kernels of
    every spec at K × V = 128 × 128, 64 × 100 and 256 × 256 this is within −24 to +66 KB of
    TileLang's own placement (dyn_shared_memory_buf; session 36), and exact on those past 227 KB
    whose peak fit. The inverse's scratch counts as a block live at that statement."""
    scratch = _inverse_scratch(dims)
    blocks = [(a, b, buffer_bytes(buffers[x], dims)) for x, (a, b) in _lifetimes(buffers, stmts, "shared").items()]
    blocks += [(i, i, scratch) for i, st in enumerate(stmts) if st.op == "inverse"]
    placed, end = [], 0  # (first, last, start, stop) of each placed block
    for begin, until, size in sorted(blocks, key=lambda b: b[0]):
        size = -(-size // PACK_ALIGN) * PACK_ALIGN
        at = 0
        for _, _, start, stop in sorted((p for p in placed if p[1] >= begin), key=lambda p: p[2]):
            if at + size <= start:
                break
            at = max(at, stop)
        placed.append((begin, until, at, at + size))
        end = max(end, at + size)
    return end


def ctas_per_sm(shared_peak: int, fragment_bytes: int, threads: int) -> int:
    """How many CTAs of a parallel kernel an SM can hold: as many as its shared memory at its peak
    allows (SM_SHARED, less CTA_RESERVED each), as far as the registers allow each thread its live
    fragments and REGISTER_OVERHEAD more (FRAGMENT_REGISTERS' reading: addresses, temporaries).

        >>> ctas_per_sm(34 * 1024, 32 * 4 * 128, 128)    # GDN's solve-only prep: 6 (80 registers)
        6
        >>> ctas_per_sm(51 * 1024, 32 * 4 * 128, 128)    # with T beside A: 4, the shared memory's
        4
        >>> ctas_per_sm(34 * 1024, 36 * 4 * 128, 128)    # 84 registers: a cap of 80 at 6 would spill
        5
    """
    by_shared = SM_SHARED // (shared_peak + CTA_RESERVED)
    by_registers = SM_REGISTERS // (threads * _registers_a_thread(fragment_bytes, threads))
    return max(1, min(by_shared, by_registers))


def _registers_a_thread(fragment_bytes: int, threads: int) -> int:
    """The registers a thread needs: its share of the live fragments and REGISTER_OVERHEAD, in the
    8s registers go to a thread in (ptxas's cap at n CTAs is 64K / (threads · n) rounded down to 8)."""
    return -(-(fragment_bytes // (4 * threads) + REGISTER_OVERHEAD) // 8) * 8


def occupancy(shared_peak: int, fragment_bytes: int, threads: int) -> tuple:
    """(the warps of a parallel kernel an SM holds at once, ctas_per_sm's CTAs of it; whether each
    thread's registers then hold what it needs, or it spills): compared as a pair, more warps
    first, then no spills. KDA's d q d k d g kernel whole on 512 threads runs 16 warps an SM and
    spills; on 64-key blocks, 16 without spilling.

        >>> occupancy(184 * 1024, 208 * 4 * 256, 512), occupancy(104 * 1024, 112 * 4 * 256, 512)
        ((16, False), (16, True))
    """
    ctas = ctas_per_sm(shared_peak, fragment_bytes, threads)
    cap = min(255, SM_REGISTERS // (ctas * threads))
    return ctas * threads // 32, _registers_a_thread(fragment_bytes, threads) <= cap


def reads(st: Stmt) -> set:
    """The buffers a statement reads: its sources and every buffer its expression names."""
    return st.reads()


def repeats_work(a: Kernel, b: Kernel, whole: Kernel) -> bool:
    """Whether kernels `a` and `b`, split from `whole`, do an inverse, a decayed product or a
    matmul twice between them (each more in the two than in the one)."""
    def work(k):
        ops = [st.op for st in k.body]
        return ops.count("inverse"), ops.count("decayed_product"), ops.count("gemm")
    return any(x + y > z for x, y, z in zip(work(a), work(b), work(whole)))


def kernel_occupancy(k: Kernel, dims: dict) -> tuple:
    """occupancy of a parallel kernel, at its key block."""
    at = dim_sizes((dims["K"], dims["V"]), k.key_block)
    buffers = {b.name: b for b in k.buffers}
    return occupancy(max(live_shared(buffers, k.body, at), default=0), live_fragments(buffers, k.body, at), k.threads)
