"""schedule's out kernels: after the scan, parallel over chunks, the outputs (a forward's o, a
backward's gradients) from each chunk's entering state and its own tokens.

One kernel for every output where its live blocks fit in shared memory at their peak; else one per
group of outputs (_out_groups), each recomputing what its outputs need except the diagonal
sub-block products an earlier group's kernel holds and hands over (_handed_over); a group whose
outputs are all K-wide runs on blocks of K's columns where that fills an SM better (_key_block,
_split_for_key_blocks). schedule.py builds the prep and scan kernels and calls out_kernels.
"""
from __future__ import annotations

from qla_compiler.errors import PassError
from qla_compiler.ir.chunk import ChunkIR
from qla_compiler.ir.kernel import KEY_BLOCK_WIDTHS, Kernel, Stmt, Tensor

from .key_blocks import key_cut
from .partition import Partition
from .schedule_build import (CHUNK_MAP, build, crossing_tensor, head_params, input_params, parallel_grid,
                             product_slots, store_rows)
from .schedule_memory import (FRAGMENT_REGISTERS, MORE_WARPGROUPS, MORE_WARPGROUPS_GRADIENTS, SMEM_BUDGET, THREADS,
                              ctas_per_sm, dim_sizes, kernel_occupancy, live_fragments, live_shared, more_warpgroups,
                              place_loads, repeats_work, threads_for)


def out_kernels(part: Partition, split_phase: bool, dims: dict, partial: tuple, groups=None,
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
        # (the K-wide outputs on key blocks beside the rest: also where one kernel would not fit,
        # as GLA's with its saved state in float32 does not, ahead of a grouping that recomputes)
        groups = _split_for_key_blocks(part, roles, build_group, block_of, dims, fits) if key_blocks else [roles]
        if len(groups) == 1:
            groups = _out_groups(roles, lambda g: build_group(g)[0], fits)
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
    width of ir.kernel.KEY_BLOCK_WIDTHS, narrower than K's tile, with the best kernel_occupancy (the most
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
    tried = [(kernel_occupancy(_out_built(part, group, "", split_phase, dims, partial, takes=cut, key_block=width)[0],
                         dims), width) for width in KEY_BLOCK_WIDTHS if width < dims["K"]]
    if tried and max(tried)[0] > kernel_occupancy(k, dims):
        return cut, max(tried)[1]
    return None


def _split_for_key_blocks(part: Partition, roles: tuple, build_group, block_of, dims: dict, fits) -> list:
    """The groups of outputs for out kernels where key blocks are on: the K-wide outputs apart
    from the rest, where the K-wide ones' kernel then runs on key blocks (block_of), the rest's
    kernel fits and its kernel_occupancy is no worse than the one kernel's, and the two do no
    decayed product or matmul twice (repeats_work). Else all in one (out_kernels then groups them
    by _out_groups where one kernel does not fit). GLA's out kernel (200 KB, 8
    warps an SM at 255 registers, 14 matmuls and 3 decayed products) is d v (96 KB, 5 and 1) and
    d q d k d g (9 and 2, on blocks of 32 keys: 56 KB, 12 warps an SM); GDN's would compute 21
    matmuls for its 14."""
    ir = part.chunk
    wide = tuple(r for r in roles if "K" in ir.node(ir.outputs[r]).shape)
    rest = tuple(r for r in roles if r not in wide)
    if not wide or not rest:
        return [roles]
    one, (rest_k, rest_held), wide_k = build_group(roles)[0], build_group(rest), build_group(wide)[0]
    if repeats_work(wide_k, rest_k, one) or kernel_occupancy(rest_k, dims) < kernel_occupancy(one, dims) \
            or not fits(rest_k) or not block_of(wide, [rest_held]):
        return [roles]
    return [wide, rest]


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
    gradients = any(r in ir.gradient_of for r in roles)
    what = "the gradients " + ", ".join(roles) if gradients else "the output"
    body = b.body + stores
    # (with running sums it keeps two warpgroups: KDA's d q, d k, d v kernel, 224 fragment registers
    # a thread on one, spilled 472 bytes at 255; on two, 112)
    threads = 2 * THREADS if running else threads_for(b, body)
    placed = place_loads(b, body, split_phase)
    peak, fragments = max(live_shared(b.buffers, placed, dims), default=0), live_fragments(b.buffers, placed, dims)
    threads = more_warpgroups(threads, peak, fragments, MORE_WARPGROUPS_GRADIENTS if gradients else MORE_WARPGROUPS)
    # a kernel on key blocks asks ptxas for the CTAs an SM the blocks were chosen for (_key_block):
    # unasked, it gave KDA's d q d k d g kernel 163 registers a thread at 256 threads, one CTA an SM
    ctas = ctas_per_sm(peak, fragments, threads) if key_block else 0
    ctas = ctas if ctas > 1 else 0
    held = {x for x, buf in b.place.items() if b.buffers[buf].dtype == "float32" and x not in loaded}
    # (the key blocks of a chunk adjacent: they load the same K-free blocks, from L2 after the first)
    grid = parallel_grid(bool(key_block))
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
        b.body.insert(last + 1, store_rows(ir, b, x))
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
