"""schedule: ChunkIR + Partition → KernelIR. Places every value and orders the statements.

Placement rules (Hopper, TileLang):
  * loaded blocks (q, k, v, T_r) → shared memory in the io dtype (TMA loads inside the pipeline;
    in the parallel kernels, split-phase TMA loads issued as early as the peak of live shared
    memory allows and waited for right before the first reader, so that blocks with disjoint lives
    share memory: schedule_memory.place_loads; synchronous loads without SPLIT_PHASE_LOADS); per-token vectors
    (g, β) → shared float32;
  * matmul results → register fragments (float32 accumulators of wgmma);
  * a matmul operand that is computed → a shared io-dtype copy `<name>_s` (wgmma reads shared);
  * vectors over the chunk → shared float32 (the scan inlines them, and the parallel kernels a
    product of two values already placed: see schedule_build.build); scalars and element-wise C×C / C×V values
    are not stored at all: they are inlined where they are used;
  * a block crossing to a later kernel leaves through shared memory as whole rows: its bf16 wgmma
    copy if it has one, else staged in a shared block of its shape whose work is done, if there is
    one (else straight from its fragment, and right after its last reader if it is not a wgmma's
    result and wgmmas follow: _store_early);
  * a parallel kernel runs on one warpgroup (128 threads), or two when its live fragments would
    not fit in one's registers (schedule_memory.FRAGMENT_REGISTERS);
  * `x + A·B` with A·B used once accumulates into x's fragment; an element-wise x whose only
    fragment input dies there is computed in place (the state decays in place, then S += Kᵀ V).

The state stays in a register fragment for the whole sequence; the V dimension is split into
BV-wide blocks over CTAs (valid because no matmul contracts over V, which is checked).

Here: the prep and scan kernels and their parameters, and the whole program; schedule_out.py the
out kernels (grouped and split by their shared memory and occupancy), schedule_build.py builds a
kernel's buffers and statements, schedule_memory.py budgets them and places the loads by liveness,
schedule_fused.py the fused forward, schedule_vectors.py the parallel kernels' per-token vectors in
registers, schedule_reductions.py their sums' exchanges batched.
"""
from __future__ import annotations

import os
from dataclasses import replace

from qla_compiler.errors import PassError
from qla_compiler.ir.chunk import ChunkIR
from qla_compiler.ir.kernel import KEY_BLOCK_WIDTHS, Kernel, KernelIR, Stmt, Tensor

from .key_blocks import key_cut
from .partition import Partition
from .schedule_build import (CHUNK_MAP, CHUNK_OFFSETS, STATE, STATE_IO, Builder, build, check_v_columns,
                             crossing_tensor, global_name, head_params, ident, input_params, log_space, parallel_grid,
                             product_slots, state_dtype, store_rows)
from .schedule_fused import fused_kernel, scan_with_roles
from .schedule_memory import (CTA_SHARED_MAX, FRAGMENT_REGISTERS, HEAD_DIMS, SMEM_BUDGET, THREADS, ctas_per_sm,
                              dim_sizes, kernel_occupancy, live_fragments, live_shared, more_warpgroups, packed_shared,
                              place_loads, reads, repeats_work, smem_bytes, threads_for, zero_pad)
from .schedule_out import out_kernels
from .schedule_reductions import BATCHED_REDUCTIONS, batched_reductions
from .schedule_vectors import VECTOR_REGISTERS, vectors_in_registers

# Split-phase TMA loads in the parallel kernels (place_loads): on the H200 (session 5) every kernel
# matches the emulator with them; the forward's out kernel is 14% faster, its prep 7%, GDN's
# backward out 15%. QLA_SPLIT_PHASE_LOADS=0 turns them off, e.g. to tell whether a wrong result
# comes from them (the generated source differs: both variants cache side by side).
SPLIT_PHASE_LOADS = os.environ.get("QLA_SPLIT_PHASE_LOADS", "1") == "1"

# An out kernel whose outputs are all K-wide, and whose only need of every key is a few C×C values
# another out kernel holds whole, runs on blocks of K's columns, loading those values (_key_block;
# GLA's and RetNet's one out kernel splits for it: _split_for_key_blocks). KDA's d q d k d g kernel
# holds one 256-thread CTA an SM at 255 registers (11.4 of the 19.3 ms training step at
# 16/16:8x4096, session 33); on blocks of 32 keys its fragments are a quarter as wide, and an SM
# holds two CTAs. Measured (H100, 16/16:8x4096, session 36): KDA's training step 19.8 → 12.7 ms
# (d q d k d g 11.9 → 5.6), GLA's 10.5 → 6.1 (its backward out kernels 8.7 → 4.3). On by default;
# QLA_KEY_BLOCKS=0 turns it off (the generated source differs: both variants cache side by side).
KEY_BLOCKS = os.environ.get("QLA_KEY_BLOCKS", "1") == "1"


def schedule(part: Partition, split_phase_loads: bool = SPLIT_PHASE_LOADS, head_dims: tuple = HEAD_DIMS,
             fused: bool = False, wide: bool = False, partial: tuple = (), key_blocks: bool = KEY_BLOCKS,
             scan_roles: bool = False) -> KernelIR:
    """The KernelIR of a partitioned chunk program, its shared memory and registers budgeted for
    head-dim tiles up to `head_dims` (K, V): the kernels of larger tiles differ (more threads, fewer
    stages, outputs split across kernels), those of smaller ones would only waste memory. With
    `fused` (a forward), the scan and the out kernel are one warp-specialised kernel
    (schedule_fused.py); `wide`: that kernel at V-block 128, its chain on two roles. `partial`:
    the input kinds whose gradients the host adds up over blocks (a backward on column blocks of V:
    the keys'; on blocks of K: the values'), which the out kernel writes in float32: bf16 partials
    would round each before the sum. `key_blocks`: an out kernel may run on blocks of K's
    columns (_key_block). `scan_roles`: the scan alone warp-specialised (schedule_fused.scan_with_roles),
    its out kernels after it as without; with `wide`, at V-block 128 with the chain on two roles.

        >>> kir = schedule(partition(prog.chunk))          # doctest: +SKIP
        >>> print(kir)                                       # doctest: +SKIP
    """
    ir = part.chunk
    check_v_columns(ir, part.scan)
    kir = KernelIR(ir.name, ir.chunk_size, head_dims=tuple(head_dims))
    dims = dim_sizes(head_dims)
    kir.host.append("chunk_map = (first token, length) of every chunk of every sequence "
                    "(torch on the device: no synchronisation)")
    if part.prep:
        kir.kernels += _prep_kernels(part, split_phase_loads, dims, key_blocks)
    if fused:
        kernel, kir.block_v_max = fused_kernel(part, dims, wide)
        kir.kernels.append(kernel)
    else:
        if scan_roles:
            kernel, kir.block_v_max = scan_with_roles(part, dims, wide)
            kir.kernels.append(kernel)
        else:
            kir.kernels.append(_scan_kernel(part, dims))
        kir.kernels += out_kernels(part, split_phase_loads, dims, partial, key_blocks=key_blocks)
    for i, k in enumerate(kir.kernels):
        if not k.loop and not k.warp_roles:  # the parallel kernels (a scan's rings are budgeted by its stages)
            if VECTOR_REGISTERS:
                k = kir.kernels[i] = vectors_in_registers(k)
            if BATCHED_REDUCTIONS:
                k = kir.kernels[i] = batched_reductions(k, ir.chunk_size)
            buffers, at = {b.name: b for b in k.buffers}, dim_sizes(head_dims, k.key_block)
            k.shared_peak = max(live_shared(buffers, k.body, at), default=0)
            k.shared_packed = packed_shared(buffers, k.body, at)
            k.fragment_peak = -(-live_fragments(buffers, k.body, at) // (4 * k.threads))
    kir.over_budget = tuple(k.name for k in kir.kernels
                            if k.shared_peak > SMEM_BUDGET or k.shared_packed > CTA_SHARED_MAX)
    kir.over_registers = tuple(k.name for k in kir.kernels if k.fragment_peak > FRAGMENT_REGISTERS)
    return _verified(kir)


def _verified(kir: KernelIR) -> KernelIR:
    try:
        kir.verify()
    except ValueError as e:
        raise PassError("schedule", str(e)) from None
    return kir


# A prep that runs this occupancy whole (warps an SM, no spill) stays whole on key blocks too:
# split, KDA's backward prep (4 warps an SM, spilling) went 2.30 → 0.95 + 0.51 ms, its training
# forward prep (8 warps, no spill) 1.47 → 1.14 + 0.33 (H100, 16/16:8x4096; NOTES, session 36)
PREP_FED = (8, True)


def _prep_kernels(part: Partition, split_phase: bool, dims: dict, key_blocks: bool) -> list:
    """The prep kernel; with `key_blocks`, two where that pays: one for the K-free results, then
    one for the K-wide ones on blocks of K's columns, which loads the first one's results instead
    of computing them. It pays where the K-wide results need no key beyond their own but through
    the first's results (passes/key_blocks.key_cut), the one kernel is starved (under PREP_FED),
    the second's kernel_occupancy on key blocks is better than the one kernel's and the first's no
    worse, and the two do no inverse, decayed product or matmul twice. KDA's backward prep (168 KB,
    255 registers: 4 warps an SM) is P Γ, d P and d v_new's intra-chunk term, then W and the keys'
    sub-block sums of d P on key blocks, which read d P as it is stored."""
    whole = _prep_kernel(part, split_phase, dims)
    ir = part.chunk
    wide = tuple(x for x in part.crossing if "K" in ir.node(x).shape)
    rest = tuple(x for x in part.crossing if x not in wide)
    fed = kernel_occupancy(whole, dims)
    if not key_blocks or not wide or not rest or fed >= PREP_FED:
        return [whole]

    def of(crossing, provided):  # the prep of these results, given the `provided` values
        return replace(part, prep=tuple(x for x in part.prep if x in ir.closure(crossing, stop=provided)),
                       crossing=crossing, provided=tuple(x for x in part.prep if x in provided))

    first = of(rest, set(part.provided))
    given = set(part.provided) | set(rest)
    then = of(wide, given)
    cut, _ = key_cut(ir, [x for x in then.prep if x not in given], given)
    if cut != () or not all(_read_as_stored(ir, x, set(then.prep)) for x in rest if x in then.prep):
        return [whole]
    first_k = _prep_kernel(first, split_phase, dims, suffix="_" + "_".join(map(ident, rest)))
    tried = [(kernel_occupancy(k, dims), k) for k in
             (_prep_kernel(then, split_phase, dims, width, "_" + "_".join(map(ident, wide)))
              for width in KEY_BLOCK_WIDTHS if width < dims["K"])]
    if not tried:
        return [whole]
    best, then_k = max(tried, key=lambda t: (t[0], t[1].key_block))
    if repeats_work(first_k, then_k, whole) or best <= fed or kernel_occupancy(first_k, dims) < fed:
        return [whole]
    return [first_k, then_k]


# steps after which a block rounds as it did before them (a mask, a sign): io(keep(x)) = keep(io(x))
_ROUNDING_EXACT = ("keep", "tril", "neg")


def _read_as_stored(ir: ChunkIR, x: str, nodes: set) -> bool:
    """Whether a kernel computing `nodes` that loads `x` (as a prep stores it) computes what the
    kernel that computed x did: x is stored in float32, or every reader reaches a matmul, whose
    operands are io blocks anyway, through masks and signs alone. GDN's backward prep scales its
    d P by the decay before the products: loaded in bf16, d P would round twice."""
    if crossing_tensor(ir, x, "in").dtype == "float32":
        return True

    def exact(y):
        users = [u for u in ir.users(y) if u.name in nodes]
        return all(u.op == "matmul" or (u.op in _ROUNDING_EXACT and exact(u.name)) for u in users)
    return exact(x)


def _prep_kernel(part: Partition, split_phase: bool, dims: dict, key_block: int = 0, suffix: str = "") -> Kernel:
    """The prep kernel of `part` (`key_block`: on blocks of that many of K's columns; `suffix`:
    to its name, one of several)."""
    ir = part.chunk
    dims = dim_sizes((dims["K"], dims["V"]), key_block)  # (budgeted at the block's width)
    b = build(ir, part.prep, part.provided, tiled=False, dims=dims, key_blocked=bool(key_block))
    stores = []
    for x in part.crossing:
        if x in b.io_copy:  # already rounded to io in shared memory for a wgmma: the store reads that
            # (instead of keeping the float32 value, or what it is computed from, live to the end)
            b.place[x] = b.io_copy[x]
        elif x not in b.place and len(ir.node(x).shape) == 2 and ir.node(x).op != "matmul":
            # an element-wise block (T = T_r ⊙ R; a product's scaling, the backward prep's): computed
            # straight into the io block it leaves from, as whole rows, with no pass over a
            # fragment first (see _rows_block)
            rows = _rows_block(b, x, _free_at_end(b, part.crossing), own=True)
            b.ewise(rows, x)
            b.place[x] = rows
        elif x not in b.place and not (ir.node(x).shape != ("C",) and b.overwrite_fragment(x)):
            # an element-wise combination: computed into registers for the store, over the one
            # fragment it reads where it can be (a product's scaling: scale_after_product)
            b.place[x] = b.fragment(x)
    early = _store_early(b, part.crossing)
    early |= _stage_early(b, part.crossing, early)
    free = _free_at_end(b, part.crossing)
    for x in part.crossing:
        if x in early:
            continue
        staging = None
        if ir.node(x).shape != ("C",) and b.buffers[b.place[x]].scope == "fragment":
            # a wgmma fragment spreads each row over 4 threads in 8-byte pieces, the inverse's
            # holds a column a thread: staged in a shared block (one whose work is done where
            # there is one), the chunk leaves as whole 128-byte rows
            staging = _rows_block(b, x, free, own=ir.node(x).op != "matmul")
        if staging:
            b.body.append(Stmt("copy", staging, (b.place[x],)))
            b.place[x] = staging
        stores.append(store_rows(ir, b, x))
    params = input_params(ir, part.prep, part.provided) + [CHUNK_MAP] + head_params(ir, part.prep)
    params += [crossing_tensor(ir, x, "out") for x in part.crossing]
    computed = [x for x in part.prep if x not in part.provided]  # (provided values are loaded)
    ops = {ir.node(x).op for x in computed}
    inverses = {x for x in computed if ir.node(x).op == "inv_unit_lower"}
    on_inverse = any(ir.node(x).op == "matmul" and inverses & set(ir.closure([x])) for x in computed)
    # (a prep whose only matmul forms A, K Kᵀ, is the solve alone: the fused forward's)
    work = [w for op, w in (("inv_unit_lower", "(I + A)⁻¹ by blocked forward substitution (16-row blocks in "
                                              "float32, then merges 16 → 32 → 64, the last in tf32)"),
                            ("cumsum", "chunk-local cumulative gates"),
                            ("matmul", "the matmuls built on the inverse" if on_inverse else
                             None if inverses else "the per-token matmuls")) if op in ops and w]
    body = place_loads(b, b.body + stores, split_phase)
    peak, fragments = max(live_shared(b.buffers, body, dims), default=0), live_fragments(b.buffers, body, dims)
    threads = more_warpgroups(threads_for(b, body), peak, fragments)
    # the inverse's sweeps and merges wait on shared memory (short_sb stalls, H200 ncu): a prep
    # holding one asks for every CTA an SM can hold (the solve-only prep: 6 where ptxas alone
    # chose registers for 5; 2 % faster, NOTES session 23); so does one on key blocks (_key_block)
    ctas = ctas_per_sm(peak, fragments, threads) if inverses or key_block else 0
    ctas = ctas if ctas > 1 else 0  # (one is what ptxas assumes unasked)
    grid = parallel_grid(bool(key_block))
    keys = f", on blocks of {key_block} keys" if key_block else ""
    return Kernel(f"{ir.name}_prep{suffix}", grid, threads, params,
                  list(b.buffers.values()), [], product_slots(body, threads), [],
                  roles=(f"all {threads // 32} warps: " + "; ".join(work) + keys,),
                  doc=f"parallel over chunks{keys}: " + ", ".join(work), kind="prep", nodes=part.prep,
                  shared_peak=peak, ctas_per_sm=ctas, key_block=key_block)


def _rows_block(b: Builder, x: str, free: list, own: bool) -> str | None:
    """An io shared block of `x`'s shape for it to leave from as whole rows: one of the `free`
    ones (_free_at_end; taken from the list), else, where `own`, one of its own (for a block
    that is not a wgmma's result, whose fragment gains most from it). The inverse's fragment,
    and an element-wise one over it, holds one column of every other row in each thread, and went
    out from registers as 2-byte stores, 32 a thread (the solve-only prep, session 15's ncu: with
    the mask pass, ~30 % of its time); written to shared memory, the chunk leaves as a bulk copy
    of 128-byte rows (session 16, H200: that prep 1.07 → 0.85 ms at 16/64, with the padding)."""
    shape, dtype = b.ir.node(x).shape, "float32" if log_space(b.ir, x) else "io"
    block = next((n for n in free if b.buffers[n].shape == b.held_as(shape) and b.buffers[n].dtype == dtype), None)
    if block is not None:
        free.remove(block)
        return block
    return b.buf(f"{x}_rows_s", shape, dtype, "shared") if own else None


def _store_early(b: Builder, crossing) -> set:
    """Store a crossing fragment that is not a wgmma's result straight from registers right after
    its last reader when wgmmas still follow: kept for a staged store at the end, it would hold
    its registers through them (the training prep's T_r, 16/64 × 32768: 2.29 ms kept to the end,
    1.80 stored early, with split-phase loads).
    A wgmma's result keeps the staged store at the end: whole-row stores through shared memory
    beat storing each thread's 8-byte pieces (the forward prep's W stored early: 1.83 → 1.96 ms)."""
    early = set()
    for x in crossing:
        frag = b.place[x]
        if b.buffers[frag].scope != "fragment" or len(b.buffers[frag].shape) != 2 or b.ir.node(x).op == "matmul":
            continue
        last = max(i for i, st in enumerate(b.body) if frag in reads(st) or st.dst == frag)
        if any(st.op == "gemm" for st in b.body[last + 1:]):
            b.body.insert(last + 1, store_rows(b.ir, b, x))
            early.add(x)
    return early


def _stage_early(b: Builder, crossing, early: set) -> set:
    """Where keeping every wgmma result for the staged stores at the end would take the kernel a
    second warpgroup (its live fragments over one's registers: threads_for), stage such results
    right after their last writer instead, each through an io shared block of its shape that
    nothing touches afterwards, and store them from there: whole rows still, and the fragment's
    registers free for the rest. GDN's backward prep, recomputing W (T·diag(βΓ)K) rather than
    loading it, kept 144 KB of fragments to the end; W staged through its own operand's block
    leaves 112 KB, one warpgroup's, as before. A kernel with the inverse keeps its late stores and
    takes the second warpgroup (the K = 256 forward prep, measured so at 0.92× FLA): the
    substitution's sweeps split over it too."""
    if any(st.op == "inverse" for st in b.body):
        return set()

    def late(x):
        return x not in early and x in b.place and b.ir.node(x).op == "matmul" and \
            b.buffers[b.place[x]].scope == "fragment"

    def to_the_end(body):
        return body + [Stmt("copy", "", (b.place[x],)) for x in crossing if late(x)]

    staged = set()
    held = {b.place[x] for x in crossing if x in b.place}
    for x in crossing:
        if threads_for(b, to_the_end(b.body)) <= THREADS:
            break
        if not late(x):
            continue
        frag = b.place[x]
        last = max(i for i, st in enumerate(b.body) if frag in reads(st) or st.dst == frag)
        block = next((n for n, buf in b.buffers.items()
                      if buf.scope == "shared" and buf.dtype == "io" and buf.shape == b.buffers[frag].shape
                      and n not in held and not any(n in reads(st) or st.dst == n for st in b.body[last + 1:])), None)
        if block is None:
            continue
        b.body[last + 1:last + 1] = [Stmt("copy", block, (frag,))]
        b.place[x] = block
        held.add(block)
        b.body.insert(last + 2, store_rows(b.ir, b, x))
        staged.add(x)
    return staged


def _free_at_end(b: Builder, keep) -> list:
    """The io shared blocks nothing reads after the body, so a store may stage through them (no
    new shared memory, which would cost CTAs per SM): all but those holding a value in `keep`."""
    held = {b.place[x] for x in keep if x in b.place}
    return [n for n, buf in b.buffers.items()
            if buf.scope == "shared" and buf.dtype == "io" and len(buf.shape) == 2 and n not in held]


def _scan_kernel(part: Partition, dims: dict) -> Kernel:
    ir = part.chunk
    b = build(ir, part.scan, part.crossing + part.provided, tiled=True, dims=dims)
    s_node = ir.next_state
    if b.place.get(s_node) != STATE:
        raise PassError("schedule", f"the next state {s_node} is not accumulated in the state fragment")
    stores, state_stores = [], []
    for x in part.carried:
        if x == ir.state_in and state_dtype(ir, x) == "float32":
            # straight from the registers, before the chunk updates them (no shared block to wait for)
            state_stores.append(Stmt("store_chunk_state", global_name(ir, x), (STATE,)))
        elif x == ir.state_in:
            b.operand(x)  # the io copy of the entering state is what the out kernel reads
            stores.append(Stmt("store_chunk_state", global_name(ir, x), (STATE_IO,)))
        else:
            b.place[x] = b.operand(x)
            stores.append(store_rows(ir, b, x))
    uses_state_s = STATE_IO in {s for st in b.body + stores for s in st.srcs}
    if uses_state_s:
        b.buf(STATE_IO, ("K", "V"), "io", "shared")
    params = input_params(ir, part.scan, part.crossing + part.provided)
    params += [Tensor("cu_seqlens", ("N+1",), "int32", "in"),
               CHUNK_OFFSETS,
               Tensor("initial_state", ("N", "HV", "K", "V"), "float32", "in")]
    params += head_params(ir, part.scan)
    params += [crossing_tensor(ir, x, "out") for x in part.carried]
    params += [Tensor("final_state", ("N", "HV", "K", "V"), "float32", "out")]
    prologue = [Stmt("load_state", STATE, ("initial_state",))]
    body = _issue_stores_early(b.loads + zero_pad(b.loads, only_partial=True) + b.copies
                               + ([Stmt("copy", STATE_IO, (STATE,))] if uses_state_s else []) + b.body,
                               stores)
    first_update = next(i for i, st in enumerate(body) if st.dst == STATE)
    body[first_update:first_update] = state_stores
    # each load of the loop gets a buffer per stage, and the rest of shared memory is fixed
    per_stage = smem_bytes([b.buffers[st.dst] for st in b.loads], dims)
    fixed = smem_bytes(b.buffers.values(), dims) - per_stage
    max_stages = (SMEM_BUDGET - fixed) // per_stage
    if max_stages < 1:
        raise PassError("schedule", f"{ir.name}_scan: its blocks need {(fixed + per_stage) // 1024} KB of "
                                    f"shared memory, over the {SMEM_BUDGET // 1024} KB budget")
    # The forward scan's consumer is one warpgroup or two, as the shape class says (SCAN_THREADS):
    # its chunk is a chain of short dependent steps, and alone on an SM one warp per scheduler
    # leaves most issue slots idle (ncu: 79% of cycles with no eligible warp). The backward scan
    # keeps one: at two (128 registers a thread) it spilled at BV = 64; not timed.
    threads = THREADS if ir.reverse else "SCAN_THREADS"
    consumers = "consumer warpgroup" if ir.reverse else "consumer warpgroups (SCAN_THREADS / 128)"
    return Kernel(
        f"{ir.name}_scan", (("v_block", "V/BV"), ("value_head", "HV"), ("sequence", "N")), threads, params,
        list(b.buffers.values()), prologue, body, [Stmt("store_state", "final_state", (STATE,))],
        loop="chunks of the sequence" + (", last to first" if ir.reverse else ""), reverse=ir.reverse,
        max_stages=max_stages,
        roles=("producer: TMA loads of the next chunks, on as many threads as the consumer (TileLang's "
               "automatic warp specialisation)",
               f"{consumers}: the state chain; the state in registers"),
        doc="sequential over chunks: the state chain only", kind="scan", nodes=part.scan)


def _issue_stores_early(body: list, stores: list) -> list:
    """The scan's stores, each issued as soon as its block is final (the entering state's right
    after its copy) instead of at the chunk's end. The next chunk waits for all of this chunk's
    stores to have read their blocks (SCAN_STORE_WAIT, at the top of its body) before rewriting
    any; issued at the chunk's end, the last store was still reading then. Nothing in a chunk
    writes a block after its store, so the one wait still covers every store. A block only its
    store reads keeps its place after the chain's matmuls: computed earlier, it and its store's
    barrier would sit on the chain."""
    out = list(body)
    for st in stores:
        src = st.srcs[0]
        out.insert(max((i for i, s in enumerate(out) if s.dst == src), default=len(out) - 1) + 1, st)
    return out

