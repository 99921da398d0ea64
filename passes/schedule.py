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

Here: the kernels (prep, scan, out) and their parameters; schedule_build.py builds a kernel's
buffers and statements, schedule_memory.py budgets them and places the loads by liveness.
"""
from __future__ import annotations

import os
from dataclasses import replace

from qla_compiler.errors import PassError
from qla_compiler.ir.chunk import ChunkIR
from qla_compiler.ir.kernel import KEY_BLOCK_WIDTHS, Kernel, KernelIR, Stmt, Tensor

from .key_blocks import key_cut
from .partition import Partition
from .schedule_build import (Builder, build, check_v_columns, crossing_tensor, global_name, head_params, ident,
                             input_params, log_space, product_slots, state_dtype)
from .schedule_fused import fused_kernel
from .schedule_vectors import VECTOR_REGISTERS, vectors_in_registers
from .schedule_memory import (CTA_SHARED_MAX, FRAGMENT_REGISTERS, HEAD_DIMS, SMEM_BUDGET, THREADS, ctas_per_sm,
                              dim_sizes, live_fragments, live_shared, more_warpgroups, occupancy, packed_shared,
                              place_loads, reads, smem_bytes, threads_for, zero_pad)

CHUNK_MAP = Tensor("chunk_map", ("CH", "2"), "int32", "in", "(first token, tokens) of every chunk slot")


def _store_rows(ir: ChunkIR, b: Builder, name: str) -> Stmt:
    if ir.node(name).shape == ("C",):
        return Stmt("store_vec", global_name(ir, name), (b.place[name],), (("rows", "n_valid"),))
    return Stmt("store", global_name(ir, name), (b.place[name],), (("rows", "n_valid"),))


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
             fused: bool = False, wide: bool = False, partial: tuple = (), key_blocks: bool = KEY_BLOCKS) -> KernelIR:
    """The KernelIR of a partitioned chunk program, its shared memory and registers budgeted for
    head-dim tiles up to `head_dims` (K, V): the kernels of larger tiles differ (more threads, fewer
    stages, outputs split across kernels), those of smaller ones would only waste memory. With
    `fused` (a forward), the scan and the out kernel are one warp-specialised kernel
    (schedule_fused.py); `wide`: that kernel at V-block 128, its chain on two roles. `partial`:
    the input kinds whose gradients the host adds up over blocks (a backward on column blocks of V:
    the keys'; on blocks of K: the values'), which the out kernel writes in float32: bf16 partials
    would round each before the sum. `key_blocks`: an out kernel may run on blocks of K's
    columns (_key_block).

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
        kir.kernels.append(_scan_kernel(part, dims))
        kir.kernels += _out_kernels(part, split_phase_loads, dims, partial, key_blocks=key_blocks)
    if VECTOR_REGISTERS:
        kir.kernels = [vectors_in_registers(k) if not k.loop and not k.warp_roles else k for k in kir.kernels]
    for k in kir.kernels:
        if not k.loop and not k.warp_roles:  # the parallel kernels (a scan's rings are budgeted by its stages)
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


def _out_kernels(part: Partition, split_phase: bool, dims: dict, partial: tuple, groups=None,
                 key_blocks: bool = False) -> list:
    """The out kernel, or (when one kernel for every output would not fit in shared memory) one
    kernel per group of outputs (`groups`, else _out_groups'), each recomputing what its outputs
    need, except the diagonal sub-block products an earlier group's kernel holds, which it stores
    for the later ones (_handed_over). What must fit is the peak
    of live blocks, not their sum: loads sit right before their readers, so blocks whose lives do
    not overlap share memory (GDN's backward: one kernel for all five gradients, ~145 KB at its
    peak, where the sum is ~310 KB; split five ways, ~45% of its matmuls ran more than once).
    With `key_blocks`, a kernel that _key_block says gains runs on blocks of K's columns, after
    the kernels it loads from."""
    roles = tuple(part.chunk.outputs)
    built = {}

    def suffix(group):
        return "" if group == roles else "_" + "_".join(group)

    def build_group(group):
        if group not in built:
            built[group] = _out_built(part, group, suffix(group), split_phase, dims, partial)
        return built[group]

    def fits(k):
        at = dim_sizes((dims["K"], dims["V"]), k.key_block)
        return max(live_shared({x.name: x for x in k.buffers}, k.body, at)) <= SMEM_BUDGET

    def block_of(group, others):  # (the values it loads, its key block), or None: _key_block
        return _key_block(part, group, build_group(group)[0], others, split_phase, dims, partial)

    if groups is None:
        groups = _out_groups(roles, lambda g: build_group(g)[0], fits)
        if key_blocks and len(groups) == 1:
            groups = _split_for_key_blocks(part, roles, build_group, block_of, dims)
    parts = [(tuple(group), *build_group(tuple(group))) for group in groups]
    blocked = {}
    for j, (group, _, _) in enumerate(parts):
        how = block_of(group, [held for i, (_, _, held) in enumerate(parts) if i != j]) if key_blocks else None
        if how:
            blocked[group] = how
    for group, (cut, _) in list(blocked.items()):  # (what it loads comes from a kernel not on key blocks)
        if not all(any(x in held for g, _, held in parts if g not in blocked) for x in cut):
            del blocked[group]
    # (a kernel on key blocks after those it loads from: the kernels run in the list's order)
    parts = [p for p in parts if p[0] not in blocked] + [p for p in parts if p[0] in blocked]
    handed = _handed_over(part, parts, {g: cut for g, (cut, _) in blocked.items()})
    for j, (group, _, _) in enumerate(parts):
        for x in blocked.get(group, ((), 0))[0]:
            owner = next(i for i, (g, _, held) in enumerate(parts) if g not in blocked and x in held)
            handed.setdefault(x, (owner, []))[1].append(j)
    if not handed and not blocked:
        return [k for _, k, _ in parts]
    out = []
    for i, (group, k, _) in enumerate(parts):
        hands = tuple(x for x, (owner, _) in handed.items() if owner == i)
        takes = tuple(x for x, (_, users) in handed.items() if i in users)
        if not hands and not takes and group not in blocked:
            out.append(k)
            continue
        k, _ = _out_built(part, group, suffix(group), split_phase, dims, partial, hands, takes,
                          key_block=blocked[group][1] if group in blocked else 0)
        if not fits(k):
            return [k for _, k, _ in parts]  # (a loaded block in place of work that needed more: recompute)
        out.append(k)
    return out


def _key_block(part: Partition, group: tuple, k: Kernel, others: list, split_phase: bool, dims: dict,
               partial: tuple) -> tuple | None:
    """(the values it loads, its key block) where the out kernel `k` of the outputs `group` runs on
    blocks of K's columns; None where it does not. Its outputs must all be K-wide, and what needs
    every key in it must be a few K-free values one of the other out kernels holds whole in float32
    (`others`: the values each holds; passes/key_blocks.key_cut), which it loads. Its block is the
    width of ir.kernel.KEY_BLOCK_WIDTHS, narrower than K's tile, with the best _occupancy (the most
    warps an SM, then no spills; the wider on a tie: each block loads the K-free blocks again),
    where that is better than without blocks. KDA's d q d k d g kernel at
    K = 128, 8 warps an SM at 255 registers: blocks of 32 keys, 16 warps (2 CTAs of 256 threads,
    56 fragment registers a thread)."""
    ir = part.chunk
    if any("K" not in ir.node(ir.outputs[r]).shape for r in group):
        return None
    cut, _ = key_cut(ir, k.nodes, part.out_loads)
    if cut is None or any(not any(x in held for held in others) for x in cut):
        return None
    tried = [(_occupancy(_out_built(part, group, "", split_phase, dims, partial, takes=cut, key_block=width)[0],
                         dims), width) for width in KEY_BLOCK_WIDTHS if width < dims["K"]]
    if tried and max(tried)[0] > _occupancy(k, dims):
        return cut, max(tried)[1]
    return None


def _split_for_key_blocks(part: Partition, roles: tuple, build_group, block_of, dims: dict) -> list:
    """The groups of outputs for out kernels where one kernel fits them all and key blocks are
    on: the K-wide outputs apart from the rest, where the K-wide ones' kernel then runs on key blocks
    (block_of), the rest's kernel's _occupancy is no worse than the one kernel's, and the two do no
    decayed product or matmul twice (_repeats_work). Else all in one. GLA's out kernel (200 KB, 8
    warps an SM at 255 registers, 14 matmuls and 3 decayed products) is d v (96 KB, 5 and 1) and
    d q d k d g (9 and 2, on blocks of 32 keys: 56 KB, 12 warps an SM); GDN's would compute 21
    matmuls for its 14."""
    ir = part.chunk
    wide = tuple(r for r in roles if "K" in ir.node(ir.outputs[r]).shape)
    rest = tuple(r for r in roles if r not in wide)
    if not wide or not rest:
        return [roles]
    one, (rest_k, rest_held), wide_k = build_group(roles)[0], build_group(rest), build_group(wide)[0]
    if _repeats_work(wide_k, rest_k, one) or _occupancy(rest_k, dims) < _occupancy(one, dims) \
            or not block_of(wide, [rest_held]):
        return [roles]
    return [wide, rest]


def _repeats_work(a: Kernel, b: Kernel, whole: Kernel) -> bool:
    """Whether kernels `a` and `b`, split from `whole`, do an inverse, a decayed product or a
    matmul twice between them (each more in the two than in the one)."""
    def work(k):
        ops = [st.op for st in k.body]
        return ops.count("inverse"), ops.count("decayed_product"), ops.count("gemm")
    return any(x + y > z for x, y, z in zip(work(a), work(b), work(whole)))


def _occupancy(k: Kernel, dims: dict) -> tuple:
    """schedule_memory.occupancy of a parallel kernel, at its key block."""
    at = dim_sizes((dims["K"], dims["V"]), k.key_block)
    buffers = {b.name: b for b in k.buffers}
    return occupancy(max(live_shared(buffers, k.body, at), default=0), live_fragments(buffers, k.body, at), k.threads)


def _out_groups(roles: tuple, kernel_of, fits) -> list:
    """The groups of outputs that get an out kernel each: all in one where that kernel fits; else
    the fewest kernels that all fit, and among those the one that does the least work twice
    (_recomputed). Each group keeps the outputs' order. An output that does not fit even alone
    gets its own kernel (KernelIR.over_budget says so). Halving the list, as this did before,
    split KDA's backward into d q d k d v | d g | d β: the d g kernel then recomputed the whole
    d k chain (15 matmuls), 6.5 of the training step's 24.6 ms on the H200 (session 29), where
    d q d k d g | d v d β fits (184 and 128 KB) and does it once."""
    if len(roles) == 1 or fits(kernel_of(roles)):
        return [roles]
    best = None
    for groups in _set_partitions(roles):
        if best is not None and len(groups) > len(best[0]):
            break
        kernels = [kernel_of(g) for g in groups]
        if all(fits(k) or len(g) == 1 for g, k in zip(groups, kernels)):
            cost = tuple(map(sum, zip(*(_recomputed(k) for k in kernels))))
            if best is None or cost < best[1]:
                best = (groups, cost)
    return best[0]


def _set_partitions(items: tuple) -> list:
    """Every way to cut `items` into groups, fewest groups first; each group and the list of
    groups in the items' order (so kernel names and parameters do not depend on the search)."""
    def cuts(rest):
        if not rest:
            yield []
            return
        first, tail = rest[0], rest[1:]
        for sub in cuts(tail):
            yield [(first,)] + sub
            for i in range(len(sub)):
                yield sub[:i] + [(first,) + sub[i]] + sub[i + 1:]
    return sorted(cuts(tuple(items)), key=len)


def _recomputed(k: Kernel) -> tuple:
    """What a kernel costs, for comparing groupings: its decayed products (CUDA-core loops over
    C × K × the sub-block; four of them were 7.2 of KDA's d q d k d v kernel's 10.1 ms, session
    27), then its matmuls, then its statements."""
    ops = [st.op for st in k.body]
    return ops.count("decayed_product"), ops.count("gemm"), len(ops)


def _handed_over(part: Partition, parts: list, cuts: dict) -> dict:
    """{node: (the kernel that stores it, the later kernels that load it)}: where one out kernel
    would not fit and the outputs are split, each later kernel loads what an earlier one computes
    instead of computing it again, where that work is a decayed product on the diagonal sub-blocks
    (CUDA-core loops over C × K × the block; a per-key gate's VJP) or is built on one. KDA's
    d g kernel recomputed 90 of its 136 nodes from the d q, d k, d v kernel, the four diagonal
    products among them: 5.9 of its 10.4 ms on the H200 (ablate_backward, session 27). A handed
    block costs its float32 rows written once and read once; a product of matmuls alone stays
    recomputed (a 64×64×128 wgmma is cheaper than 64 KB of traffic a chunk). `cuts`: by group, what
    a kernel on key blocks loads (_key_block): it needs nothing that only those are computed from."""
    ir = part.chunk
    loaded = part.out_loads
    within = set(part.out)

    def heavy(x):
        n = ir.node(x)
        return len(n.shape) == 2 and n.shape[0] == "C" and n.op not in ("input", "state_in") and any(
            ir.node(y).op == "contract" for y in ir.closure([x], stop=loaded, within=within))

    owner = {}  # node -> index of the first kernel that holds it in float32 (not inlined)
    for i, (_, k, held) in enumerate(parts):
        for x in k.nodes:
            if x in held and x not in loaded and heavy(x):
                owner.setdefault(x, i)
    handed = {}
    for j, (group, _, _) in enumerate(parts):
        earlier = {x for x, i in owner.items() if i < j}
        reached = ir.closure([ir.outputs[r] for r in group], stop=loaded | earlier | set(cuts.get(group, ())),
                             within=within)
        for x in owner:  # (in the program's order, as owner was filled: a set's order would change
            # the kernels' parameter order, and so TileLang's cache key, from process to process)
            if x in earlier and x in reached:
                handed.setdefault(x, (owner[x], []))[1].append(j)
    return handed


# A prep that runs this occupancy whole (warps an SM, no spill) stays whole on key blocks too:
# split, KDA's backward prep (4 warps an SM, spilling) went 2.30 → 0.95 + 0.51 ms, its training
# forward prep (8 warps, no spill) 1.47 → 1.14 + 0.33 (H100, 16/16:8x4096; NOTES, session 36)
PREP_FED = (8, True)


def _prep_kernels(part: Partition, split_phase: bool, dims: dict, key_blocks: bool) -> list:
    """The prep kernel; with `key_blocks`, two where that pays: one for the K-free results, then
    one for the K-wide ones on blocks of K's columns, which loads the first one's results instead
    of computing them. It pays where the K-wide results need no key beyond their own but through
    the first's results (passes/key_blocks.key_cut), the one kernel is starved (under PREP_FED),
    the second's _occupancy on key blocks is better than the one kernel's and the first's no
    worse, and the two do no inverse, decayed product or matmul twice. KDA's backward prep (168 KB,
    255 registers: 4 warps an SM) is P Γ, d P and d v_new's intra-chunk term, then W and the keys'
    sub-block sums of d P on key blocks, which read d P as it is stored."""
    whole = _prep_kernel(part, split_phase, dims)
    ir = part.chunk
    wide = tuple(x for x in part.crossing if "K" in ir.node(x).shape)
    rest = tuple(x for x in part.crossing if x not in wide)
    fed = _occupancy(whole, dims)
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
    tried = [(_occupancy(k, dims), k) for k in
             (_prep_kernel(then, split_phase, dims, width, "_" + "_".join(map(ident, wide)))
              for width in KEY_BLOCK_WIDTHS if width < dims["K"])]
    if not tried:
        return [whole]
    best, then_k = max(tried, key=lambda t: (t[0], t[1].key_block))
    if _repeats_work(first_k, then_k, whole) or best <= fed or _occupancy(first_k, dims) < fed:
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
        stores.append(_store_rows(ir, b, x))
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
    grid = ((("key_block", "K/BK"),) if key_block else ()) + (("chunk_slot", "CH"), ("value_head", "HV"))
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
            b.body.insert(last + 1, _store_rows(b.ir, b, x))
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
        b.body.insert(last + 2, _store_rows(b.ir, b, x))
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
    if b.place.get(s_node) != "state":
        raise PassError("schedule", f"the next state {s_node} is not accumulated in the state fragment")
    stores, state_stores = [], []
    for x in part.carried:
        if x == ir.state_in and state_dtype(ir, x) == "float32":
            # straight from the registers, before the chunk updates them (no shared block to wait for)
            state_stores.append(Stmt("store_chunk_state", global_name(ir, x), ("state",)))
        elif x == ir.state_in:
            b.operand(x)  # the io copy of the entering state is what the out kernel reads
            stores.append(Stmt("store_chunk_state", global_name(ir, x), ("state_s",)))
        else:
            b.place[x] = b.operand(x)
            stores.append(_store_rows(ir, b, x))
    uses_state_s = "state_s" in {s for st in b.body + stores for s in st.srcs}
    if uses_state_s:
        b.buf("state_s", ("K", "V"), "io", "shared")
    params = input_params(ir, part.scan, part.crossing + part.provided)
    params += [Tensor("cu_seqlens", ("N+1",), "int32", "in"),
               Tensor("chunk_offsets", ("N+1",), "int32", "in", "chunk slot of each sequence's first chunk"),
               Tensor("initial_state", ("N", "HV", "K", "V"), "float32", "in")]
    params += head_params(ir, part.scan)
    params += [crossing_tensor(ir, x, "out") for x in part.carried]
    params += [Tensor("final_state", ("N", "HV", "K", "V"), "float32", "out")]
    prologue = [Stmt("load_state", "state", ("initial_state",))]
    body = _issue_stores_early(b.loads + zero_pad(b.loads, only_partial=True) + b.copies
                               + ([Stmt("copy", "state_s", ("state",))] if uses_state_s else []) + b.body,
                               stores)
    first_update = next(i for i, st in enumerate(body) if st.dst == "state")
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
        list(b.buffers.values()), prologue, body, [Stmt("store_state", "final_state", ("state",))],
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


def _out_built(part: Partition, roles: tuple, suffix: str, split_phase: bool, dims: dict,
               partial: tuple = (), hands=(), takes=(), key_block: int = 0) -> tuple:
    """The out kernel of `roles`, and the nodes it holds in float32 blocks (which it could hand
    on); `hands`: blocks it stores for a later out kernel, `takes`: blocks it loads from an
    earlier one (_handed_over, _key_block), both float32 rows; `key_block`: the kernel runs on
    blocks of that many of K's columns (Kernel.key_block)."""
    ir = part.chunk
    loaded = part.out_loads | set(takes)
    needed = ir.closure([ir.outputs[r] for r in roles], stop=loaded, within=set(part.out))
    nodes = tuple(n.name for n in ir.order() if n.name in needed)
    dims = dim_sizes((dims["K"], dims["V"]), key_block)  # (budgeted at the block's width)
    b, stores, outs = _out_statements(ir, roles, nodes, loaded, dims, partial, False, hands, takes, key_block)
    two = FRAGMENT_REGISTERS * 4 * 2 * THREADS  # two warpgroups' registers for fragments
    # (a kernel that loads handed blocks sums as it goes too: with one expression at the end,
    # KDA's d g kernel held all four loaded products in shared memory at once, 296 KB; 172 so)
    running = live_fragments(b.buffers, b.body + stores, dims) > two or bool(takes)
    if running:  # over even two warpgroups' registers: sums of block terms accumulate as they go,
        # where that fits them (GLA's backward out kernel: 256 → 240 registers a thread, and
        # ptxas spilled 168 bytes against 136: kept as it was)
        built = _out_statements(ir, roles, nodes, loaded, dims, partial, True, hands, takes, key_block)
        running = live_fragments(built[0].buffers, built[0].body + built[1], dims) <= two
        b, stores, outs = built if running else (b, stores, outs)
    params = input_params(ir, nodes, loaded, wide=takes) + [CHUNK_MAP] + head_params(ir, nodes) + outs
    what = "the gradients " + ", ".join(roles) if any(r in ir.gradient_of for r in roles) else "the output"
    body = b.body + stores
    # (with running sums it keeps two warpgroups: KDA's d q, d k, d v kernel, 224 fragment registers
    # a thread on one, spilled 472 bytes at 255; on two, 112)
    threads = 2 * THREADS if running else threads_for(b, body)
    placed = place_loads(b, body, split_phase)
    peak, fragments = max(live_shared(b.buffers, placed, dims), default=0), live_fragments(b.buffers, placed, dims)
    threads = more_warpgroups(threads, peak, fragments)
    # a kernel on key blocks asks ptxas for the CTAs an SM the blocks were chosen for (_key_block):
    # unasked, it gave KDA's d q d k d g kernel 163 registers a thread at 256 threads, one CTA an SM
    ctas = ctas_per_sm(peak, fragments, threads) if key_block else 0
    ctas = ctas if ctas > 1 else 0
    held = {x for x, buf in b.place.items() if b.buffers[buf].dtype == "float32" and x not in loaded}
    # (the key blocks of a chunk adjacent: they load the same K-free blocks, from L2 after the first)
    grid = ((("key_block", "K/BK"),) if key_block else ()) + (("chunk_slot", "CH"), ("value_head", "HV"))
    keys = f", on blocks of {key_block} keys" if key_block else ""
    return Kernel(f"{ir.name}_out{suffix}", grid, threads, params,
                  list(b.buffers.values()), [], product_slots(placed, threads), [],
                  roles=(f"all {threads // 32} warps: {what} from the entering state and the chunk's own "
                         f"tokens{keys}",),
                  doc=f"parallel over chunks{keys}: {what}", kind="out", nodes=nodes, outputs=roles,
                  key_block=key_block, ctas_per_sm=ctas), held


def _out_statements(ir: ChunkIR, roles: tuple, nodes: tuple, loaded: set, dims: dict, partial: tuple,
                    running_sums: bool, hands=(), takes=(), key_block: int = 0) -> tuple:
    """An out kernel's builder, its outputs' stores and their tensors (`hands`, `takes`,
    `key_block`: as _out_built's)."""
    b = build(ir, nodes, loaded, tiled=False, dims=dims, running_sums=running_sums, kept=hands, wide=takes,
              key_blocked=bool(key_block))
    outs = []
    for x in hands:  # stored from its float32 block right after that is written, for a later kernel
        src = b.place.get(x)
        if src is None or b.buffers[src].dtype != "float32":
            raise PassError("schedule", f"{x}: handed to a later out kernel, but not held in float32 here")
        last = max(i for i, st in enumerate(b.body) if st.dst == src)
        b.body.insert(last + 1, _store_rows(ir, b, x))
        outs.append(crossing_tensor(ir, x, "out", wide=True))
    stores = []
    io_kinds = tuple(kind for kind in ("value", "key") if kind not in partial)
    for role in roles:
        x = ir.outputs[role]
        shape = ir.node(x).shape
        of = ir.node(ir.gradient_of[role]) if role in ir.gradient_of else None
        if of is None or of.attr.get("kind") in io_kinds:
            # the op's output, or a value's or key's gradient per value head, in the io dtype the op
            # returns (a key's the host sums over its group, in float32, as FLA sums its bf16
            # per-value-head d q, d k: half the bytes written and read of float32 partials; not where
            # the host also sums over blocks, `partial`), staged in shared memory for
            # whole-row stores
            buf = b.buf(f"{role}_s", shape, "io", "shared")
            stores += [Stmt("ewise", buf, (), (("expr", b.ex(x, ("i", "j"))), ("index", ("i", "j")))),
                       Stmt("store", role, (buf,), (("rows", "n_valid"),))]
            outs.append(Tensor(role, ("1", "T", "HV", shape[1]), "io", "out",
                               "per token, per value head" if of is not None else "", result=role))
        elif shape == ("C",):  # a gradient per token (gates, scalars), float32
            if x not in b.place or b.buffers[b.place[x]].scope != "shared":
                dst = b.buf(f"{x}_s", ("C",), "float32", "shared")
                b.ewise(dst, x)
                b.place[x] = dst
            stores.append(Stmt("store_vec", role, (b.place[x],), (("rows", "n_valid"),)))
            outs.append(Tensor(role, ("1", "T", "HV"), "float32", "out", "per token", result=role))
        else:  # a gradient block of another kind of input, per token and value head, float32
            stores.append(Stmt("store", role, (b.fragment(x),), (("rows", "n_valid"),)))
            outs.append(Tensor(role, ("1", "T", "HV", shape[1]), "float32", "out", "per token, per value head",
                               result=role))
    return b, stores, outs

