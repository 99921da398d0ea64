"""schedule, fused forward: the scan and the out kernel as one warp-specialised kernel.

One CTA per (V-block, value head, sequence) walks the sequence's chunks with three roles of one
warpgroup each, cut from the partition (no spec names here):

  * `chain`: the scan's nodes — the loop-carried path from the state entering a chunk to the
    state leaving it, the state in registers for the whole sequence (at V-block 128, the wide
    kernel, cut in two: `state`, the statements that touch the state fragment, and `value`, the
    products that form the chunk's new values from the entering state: four roles);
  * `output`: the out kernel's nodes, on the V-block: what the output needs of the state (the
    entering state, and for the delta rule v_new) it reads from the chain through shared memory
    instead of from HBM, so the per-chunk states and v_new never leave the SM;
  * `loads`: every block and vector either role reads per chunk, by TMA (one warp issues), its
    padding rows zeroed when the chunk is a sequence's partial last one.

Every edge across a cut is a ring of shared buffers, chunk c in copy c % depth (the loads' ring
as deep as shared memory holds at the V-block it is budgeted at, FUSED_BLOCK_VS; the hand-overs
between compute roles RING deep, in the wide kernel one deep where two do not fit), with a pair of
barriers: `full` (the writer's arrivals: the copy holds chunk c) and `empty` (every reader's
arrivals: the copy may be overwritten). A role waits on
`full` right before its first read in the chunk and arrives on `empty` right after its last; the
writer waits on `empty` right before its first write and publishes with a proxy fence and an
arrival on `full` right after its last. So the chain never waits for the output except through a
full ring: the output of chunk c overlaps the chain's chunk c + 1.

Registers: setmaxnreg moves the loads role down to LOADS_REGISTERS and shares the rest of the
CTA's pool (3 · 168 at 384 threads, 4 · 128 at 512: ir/kernel.entry_registers) between the compute
roles: a state role of its own gets the state's registers first, the others evenly (the state and
its products live in the chain, Q Kᵀ and the output block in the output role).

For the delta rule the program comes through fold_wy first (Program.fused_program): the chain
forms v_new = T·(diag(β)V − diag(βΓ)K·S₀) itself, three products a chunk, and the prep before it
solves T_r alone and stores T = T_r ⊙ R (partition._folded_into_prep); scale_after_product_on_chain
puts diag(βΓ) on the product K·S₀. The chain then forms no block wider than the V-block.

The scan alone (scan_with_roles: a backward's, whose out kernel sums over V and stays parallel
over chunks) is the same cut without an output role: the chain, a `stores` role that stores every
carried value from its ring copy, and the loads, walking the chunks last to first.

For training (Program.fused_training_program) the partition keeps what the backward loads: the
prep stores T_r beside T, and the output role stores the carried values it is handed (the
entering state, v_new) from their ring copies (Partition.stored), so the training forward is this
kernel too, not a scan that writes W·S and U's difference and an out kernel that reads it back.
"""
from __future__ import annotations

from dataclasses import replace

from qla_compiler.errors import NotFusable, PassError
from qla_compiler.ir.kernel import Barrier, Kernel, Role, Stmt, Tensor, entry_registers

from .partition import Partition
from .schedule_build import (CHUNK_OFFSETS, STATE, STATE_IO, build, crossing_tensor, global_name, head_params,
                             input_params, state_dtype)
from .schedule_memory import REGISTER_OVERHEAD, THREADS, buffer_bytes, reads, smem_bytes, zero_pad

RING = 2  # copies of a hand-over between compute roles: the writer fills one while the readers read the other
# copies of the load ring, the deepest that fits: the loads of chunk c + depth start when both
# roles are done with chunk c, so the chain waits on a load unless depth − 1 of its chunks outlast
# one load's latency (on the H200 a 2-deep ring ran 3 µs a chunk against the plain scan's 1.1 µs)
LOAD_STAGES = (4, 3, 2)
# the V-blocks the fused kernel's shared memory may be budgeted at, widest first: the widest at
# which the load ring is still MIN_WIDE_STAGES deep (else the narrowest that fits). The output
# role's Q Kᵀ and its C×C mask are the same work at every V-block, done once per V-block: on the
# H200 at BV = 32 that mask pass was half the output role's samples and the output role set the
# pace (session 14, ncu source counters). At K = 128: 3 deep at 64 (4 at 32); at K = 256: 2 at 32.
FUSED_BLOCK_VS = (64, 32)
MIN_WIDE_STAGES = 3
# Every buffer of the fused kernel lives for the whole kernel, so TileLang lays them out exactly
# as smem_bytes sums them (the gdn kernel at BV = 16: 127488 bytes both ways; GDN's whole-V
# backward scan: 230912 when it loaded d v_new's intra-chunk term, 223232 forming it); the
# parallel kernels' SMEM_BUDGET leaves room for an allocator that packs reused memory less
# tightly. A Hopper CTA takes 227 KB of shared memory, and ptxas reports 1 KB of static shared
# memory (the barriers) in every TileLang kernel of ours.
FUSED_SMEM_BUDGET = 226 * 1024
LOADS_REGISTERS = 112  # addresses, and a masked load's (K = 100: 40, 56, 88 spilled; ptxas, sm_90a)
WARP = 32
# The wide kernel's V-block: the output role's Q Kᵀ and mask once per value head, not per V-block,
# and half the CTAs of 64 to walk the same chunks. Its state, K×128 float32, is 128 registers a
# thread at K = 128: the chain is cut in two roles (the state, and the value products), as FlashQLA
# does, and the hand-offs go one deep where two do not fit beside a two-deep load ring.
WIDE_BLOCK_V = 128
STATE_EXTRA_REGISTERS = 40  # the state role's addresses and its decay pass, beside the state itself
ROLE_DOCS = {
    "chain": "the state chain: S in registers; hands the entering state (and the chunk's new values) on",
    "state": "the state: S in registers, its decay and update; hands the entering state on",
    "value": "the chain's products, from the entering state to the chunk's new values",
    "output": "the output from the entering state and the chunk's own tokens",
    "stores": "stores what the chain hands on (the entering state, ...) for the out kernels after the scan",
    "loads": "TMA loads of the next chunks into the rings (one warp issues), padding rows zeroed",
}


def fused_kernel(part: Partition, dims: dict, wide: bool = False, output: bool = True) -> tuple:
    """(the fused scan + output kernel of a forward partition, the widest V-block it is budgeted
    for); its prep kernel stays before it. `wide`: at V-block WIDE_BLOCK_V, the chain cut into a
    state role and a value role (four roles in all). Without `output` (scan_with_roles), the
    scan alone, its out kernels after it."""
    ir = part.chunk
    if ir.reverse and output:
        raise NotFusable("schedule", "the fused kernel is a forward's: a backward scan keeps its out kernels")
    outputs = tuple(ir.outputs) if output else ()
    if output and len(outputs) != 1:
        raise NotFusable("schedule", f"the fused kernel writes one output; this program has {outputs}")
    result = outputs[0] if output else None
    stored = part.stored if output else part.carried  # (a scan alone stores all it carries)
    if any(ir.node(x).shape == ("C",) for x in stored):  # (no shipped spec's scan carries one)
        raise NotFusable("schedule", "a per-token vector the scan carries: its roles hand on blocks only")
    if ir.state_in in stored and state_dtype(ir, ir.state_in) != "io":
        raise NotFusable("schedule", f"the entering states are kept in {state_dtype(ir, ir.state_in)}; a kernel "
                         "with roles hands them on between its roles, and stores them, in the io dtype")
    kernel_name = f"{ir.name}_fused" if output else f"{ir.name}_scan_roles"
    if wide and dims["K"] * WIDE_BLOCK_V // THREADS + STATE_EXTRA_REGISTERS > 255:
        raise NotFusable("schedule", f"the wide fused kernel's state, K×{WIDE_BLOCK_V} float32 at K = {dims['K']}, "
                         "does not fit one warpgroup's registers")

    # -- the two compute roles' statements, as the scan and the out kernel would have them, with
    # the per-token vectors their blocks scale by (β·Γ, the decay to the chunk's end, ...) made
    # by the loads role: once a chunk, where inlined each block element recomputes its exponential
    loaded_out = part.out_loads
    needed = ir.closure([ir.outputs[result]], stop=loaded_out, within=set(part.out)) if output else set()
    out_nodes = tuple(n.name for n in ir.order() if n.name in needed)
    products = [x for x in out_nodes if ir.node(x).op == "contract"]
    if products:  # (a per-key gate's X ⋆ Z on its diagonal sub-blocks: passes/rewrite_subchunk.py)
        raise NotFusable("schedule", f"{', '.join(products)}: element-wise work a chunk and V-block, which the "
                                     "sequential walk would repeat per V-block (GLA fused: 17.4 ms at 16/16:1x32768 "
                                     "where FLA takes 2.1, H200, session 24); it stays in the parallel out kernel")
    vectors = _vectors_for_loads(ir, set(part.scan) | set(out_nodes), set(part.crossing) | set(part.provided))
    chain = build(ir, part.scan, part.crossing + part.provided, tiled=True, dims=dims, vectors=vectors)
    if chain.place.get(ir.next_state) != STATE:
        raise PassError("schedule", f"the next state {ir.next_state} is not accumulated in the state fragment")
    handed = {}  # carried value -> its chain buffer (the ring the output role reads)
    # (a scan alone: a carried x whose negation the chain writes for a product of its own, the
    # backward's d WS = −d v_new, is stored as −(that block): no buffer of its own)
    negated = {x: y for x in part.carried if not output and (y := _negation_held(ir, chain, x))}
    for x in part.carried:
        handed[x] = STATE_IO if x == ir.state_in else negated.get(x) or chain.operand(x)
    chain_body = list(chain.body)
    if STATE_IO in handed.values() or any(STATE_IO in st.srcs for st in chain_body):
        chain.buf(STATE_IO, ("K", "V"), "io", "shared")
        chain_body.insert(0, Stmt("copy", STATE_IO, (STATE,)))
    out = build(ir, out_nodes, loaded_out, tiled=True, dims=dims, vectors=vectors)
    out_body = []
    if output:
        o_s = out.buf(f"{result}_s", ir.node(ir.outputs[result]).shape, "io", "shared")
        out_body = out.body + [Stmt("ewise", o_s, (), (("expr", out.ex(ir.outputs[result], ("i", "j"))),
                                                       ("index", ("i", "j")))),
                               Stmt("store", result, (o_s,), (("rows", "n_valid"),))]

    # -- one set of loads for both roles: the carried values come from the chain instead
    rename_out = {}
    for st in out.loads:
        carried = next((x for x in part.carried if global_name(ir, x) == st.srcs[0]), None)
        if carried is not None:
            rename_out[st.dst] = handed[carried]
    made = build(ir, ir.closure(vectors, stop=set(part.crossing) | set(part.provided)),
                 part.crossing + part.provided, tiled=True, dims=dims)
    computed = [Stmt("ewise", chain.place.get(x) or out.place[x], (), (("expr", made.ex(x, ("i",))), ("index", ("i",))))
                for x in (n.name for n in ir.order() if n.name in vectors)]
    loads, seen = [], {}
    for st in chain.loads + [s for s in out.loads if s.dst not in rename_out] + made.loads + computed:
        if st.dst in seen and seen[st.dst] != st:
            raise PassError("schedule", f"{st.dst}: loaded twice, differently ({seen[st.dst]}; {st})")
        if st.dst not in seen:
            seen[st.dst] = st
            loads.append(st)
    private = {c.dst: c.attr["expr"][1] for c in chain.copies + out.copies + made.copies}  # X_c -> X_s: the ring is held
    loads = [st.renamed(private) for st in loads]
    for name in set(out.buffers) & set(chain.buffers):
        if name not in seen and name not in private and name not in handed.values() and name != STATE_IO:
            rename_out[name] = f"{name}_out"
    rename_out.update(private)
    chain_body = [st.renamed(private) for st in chain_body]
    # (the scan alone stores every carried value: the out kernels after it load them)
    out_body = _stores(ir, stored, handed, set(negated)) + [st.renamed(rename_out) for st in out_body]

    # -- the compute roles: the chain as one role, or (wide) cut in two where the state and the
    # chain's products would not fit one warpgroup's registers: the state role, every statement
    # that touches the state fragment (its decay, its update, its copy for the products), and the
    # value role, the rest of the chain (the products from the entering state to the new values)
    kinds = {b.name: b.scope for b in (*chain.buffers.values(), *out.buffers.values())}
    kinds.update({rename_out.get(n, n): b.scope for n, b in out.buffers.items()})
    bodies = _split_chain(chain_body, kinds) if wide else {"chain": chain_body}
    bodies["output" if output else "stores"] = out_body
    bodies = {role: _through_fragments(body, kinds) for role, body in bodies.items()}

    # -- buffers, their owners (the role that writes each) and the hand-offs between roles
    ring = {st.dst for st in loads}
    found = {}
    for b, names in ((chain, {}), (out, rename_out)):
        for buf in b.buffers.values():
            name = names.get(buf.name, buf.name)
            if name in private or buf.name in private or name in found:
                continue
            found[name] = buf
    _check_rings([st for body in bodies.values() for st in body], ring)
    owner, handoffs = _owners(bodies, {n: b for n, b in found.items() if n not in ring})
    owner.update(dict.fromkeys(ring, "loads"))
    # the output role and a state role of its own wait for what the others hand them as late as
    # they can: their other work first (the output's Q Kᵀ; the state's products of loaded blocks;
    # the value role's products of loaded blocks, where the partition gave it some: scan_products)
    for role in ("output", "state", "value"):
        if role in bodies:
            bodies[role] = _independent_first(bodies[role], {x for x, rs in handoffs.items() if role in rs})
    bodies = {role: _products_when_read(_handed_on_when_made(body, set(handoffs), kinds), kinds)
              for role, body in bodies.items()}
    budgets = _budgets(list(bodies), dims)
    for role in bodies:
        bodies[role], parked = _parked(bodies[role], {x for x, rs in handoffs.items() if role in rs}, found,
                                       budgets[role], {**dims, "BV": WIDE_BLOCK_V if wide else FUSED_BLOCK_VS[0]})
        for fragment, block in parked.items():
            found[block] = replace(found[fragment], name=block, dtype="io", scope="shared")
            owner[block] = role
    shares = {}
    for role, body in bodies.items():
        own = {n: b for n, b in found.items() if owner.get(n) == role and n not in handoffs and b.scope == "shared"}
        bodies[role], taken = _dead_before(body, own)
        shares.update(taken)

    def ring_depth(bv: int, handed_depth: int):
        at = {**dims, "BV": bv}
        per_copy = sum(smem_bytes([found[n]], at) for n in ring)
        fixed = sum(smem_bytes([b], at) * (handed_depth if n in handoffs else 1) for n, b in found.items()
                    if n not in ring and n not in shares)
        return next((d for d in LOAD_STAGES if fixed + d * per_copy <= FUSED_SMEM_BUDGET), None), \
            (fixed + LOAD_STAGES[-1] * per_copy) // 1024

    if wide:  # the hand-offs as deep as the budget allows with the load ring still two deep
        block_v = WIDE_BLOCK_V
        fits = {d: ring_depth(block_v, d) for d in (RING, 1)}
        handed_depth = next((d for d, (stages, _) in fits.items() if (stages or 0) >= 2), None)
        if handed_depth is None:
            raise NotFusable("schedule", f"{kernel_name}: its rings and blocks need {fits[1][1]} KB of shared "
                             f"memory at V-block {block_v}, over the {FUSED_SMEM_BUDGET // 1024} KB budget")
        depth = fits[handed_depth][0]
    else:
        handed_depth = RING
        widths = [bv for bv in FUSED_BLOCK_VS if bv <= dims["BV"]]
        fits = {bv: ring_depth(bv, RING) for bv in widths}
        block_v = next((bv for bv in widths if (fits[bv][0] or 0) >= MIN_WIDE_STAGES), None) or \
            next((bv for bv in reversed(widths) if fits[bv][0]), None)
        if block_v is None:
            raise NotFusable("schedule", f"{kernel_name}: its rings and blocks need {fits[widths[-1]][1]} KB "
                             f"of shared memory at V-block {widths[-1]}, over the "
                             f"{FUSED_SMEM_BUDGET // 1024} KB budget")
        depth = fits[block_v][0]
    buffers = {name: replace(b, stages=depth if name in ring else handed_depth if name in handoffs else 1,
                             owner=owner[name], shares=shares.get(name, ""))
               for name, b in found.items()}

    # -- barriers, and the roles' statements with their waits and arrivals
    readers = [r for r, body in bodies.items() if any(reads(s) & ring for s in body)]
    loaded = tuple(st.dst for st in loads)
    barriers = [Barrier("loads_landed", WARP, depth, "the TMA loads of a chunk have landed", "landed", loaded),
                Barrier("loads_full", THREADS, depth, "a chunk's loads are in their ring copy, padding zeroed",
                        "full", loaded),
                Barrier("loads_empty", THREADS * len(readers), depth, "every reader is done with the copy", "empty",
                        loaded)]
    for x in sorted(handoffs):
        took = " and ".join(sorted(handoffs[x]))
        barriers += [Barrier(f"{x}_full", THREADS, handed_depth, f"the {owner[x]} role has written the chunk's {x}",
                             "full", (x,)),
                     Barrier(f"{x}_empty", THREADS * len(handoffs[x]), handed_depth,
                             f"the {took} role{'s have' if len(handoffs[x]) > 1 else ' has'} read the chunk's {x}",
                             "empty", (x,))]
    for role, body in bodies.items():
        read = {x for x, rs in handoffs.items() if role in rs}
        written = {x for x in handoffs if owner[x] == role}
        body = _synced(body, ring, "loads", reader=True) if role in readers else body
        bodies[role] = _synced(_synced(body, read, None, reader=True), written, None, reader=False)
    loads_body = _loads_role(loads)
    roles, first = [], 0
    held = chain.place[ir.next_state]  # the state's fragment, which one role updates
    for role, budget in budgets.items():
        state = any(st.dst == held for st in bodies[role])  # that role loads and stores it
        roles.append(Role(role, first, THREADS, budget,
                          (Stmt("load_state", STATE, ("initial_state",)),) if state else (), tuple(bodies[role]),
                          (Stmt("store_state", "final_state", (STATE,)),) if state else (), doc=ROLE_DOCS[role]))
        first += THREADS
    roles.append(Role("loads", first, THREADS, LOADS_REGISTERS, (), tuple(loads_body), (), doc=ROLE_DOCS["loads"]))
    roles = tuple(roles)

    params, names = [], set()
    for p in _params(ir, part, out_nodes, loaded_out, result, stored):
        if p.name not in names:
            names.add(p.name)
            params.append(p)
    nodes = tuple(n.name for n in ir.order() if n.name in set(part.scan) | set(out_nodes))
    kernel = Kernel(
        kernel_name, (("v_block", "V/BV"), ("value_head", "HV"), ("sequence", "N")),
        len(roles) * THREADS, params, list(buffers.values()), [], [], [],
        loop="chunks of the sequence" + (", last to first" if ir.reverse else ""), reverse=ir.reverse,
        max_stages=depth, roles=tuple(f"{r.name}: {r.doc}" for r in roles),
        doc=("sequential over chunks: the state chain and the output, warp-specialised" if output else
             "sequential over chunks: the state chain, warp-specialised; its out kernels after it"),
        kind="fused" if output else "scan", nodes=nodes, outputs=outputs, warp_roles=roles, barriers=tuple(barriers))
    return kernel, block_v  # (schedule verifies it)


def scan_with_roles(part: Partition, dims: dict, wide: bool = False) -> tuple:
    """(the scan kernel of `part` warp-specialised, the widest V-block it is budgeted for): the
    chain, a `stores` role and the loads role, as fused_kernel cuts them, with no output role: the
    out kernels stay after it and load what the stores role stores. For a backward, whose out
    kernel sums over V and runs parallel over chunks: its reverse walk carries d S in registers
    while the loads of the chunks before it land and the stores of the one after it drain, where
    the plain scan kernel leaves the loads to TileLang's automatic producer and its stores on the
    chain. `wide`: at V-block 128, the chain on a state role and a value role (a CTA per value
    head and sequence loads each chunk's K-wide blocks once, where V-blocks of 32 load them four
    times)."""
    return fused_kernel(part, dims, wide=wide, output=False)


def _stores(ir, stored: tuple, handed: dict, negated: set = frozenset()) -> list:
    """The output role's stores of the carried values `stored` (those the partition keeps for
    another program: a training forward's entering states and v_new, which its backward loads; a
    scan alone's: every carried value, for its out kernels), from the ring copies the chain hands
    over: first once the copy is there (_independent_first keeps them ahead of the role's other
    reads of it), plain copies by the role's threads, so the copy is free again when the role's
    last read is done, with no wait on a bulk store. Those `negated` are handed as their negation:
    stored negated back."""
    out = []
    for x in stored:
        if x == ir.state_in:
            out.append(Stmt("store_chunk_state", global_name(ir, x), (handed[x],)))
        else:
            out.append(Stmt("store", global_name(ir, x), (handed[x],),
                            (("rows", "n_valid"),) + ((("negate", True),) if x in negated else ())))
    return out


def _negation_held(ir, chain, x: str) -> str | None:
    """The chain's shared io block holding −x (a node y = neg x the chain computes for a product),
    if there is one."""
    for u in ir.users(x):
        held = chain.io_copy.get(u.name) or chain.place.get(u.name)
        if u.op == "neg" and held and chain.buffers[held].scope == "shared" and chain.buffers[held].dtype == "io":
            return held
    return None


def _split_chain(body: list, scope: dict) -> dict:
    """The chain's statements as two roles: `state`, those that read or write the state fragment
    (the loop-carried accumulator), and `value`, the rest (what the state's update needs from the
    entering state); a chain with no such rest (linear attention) is the state role alone. Where
    the value role works on the entering state, the state role also takes the statements of loaded
    values that only it reads (the backward's d QS = diag(Γ)·d O): it forms them while it waits
    for the value role, and no buffer between the roles holds them. Not those that touch another
    fragment (`scope`: each buffer's): the state leaves its role STATE_EXTRA_REGISTERS beside it,
    no room for a block (the backward's W = T·K, C×K float32, is formed by the value role and
    handed over). What one role hands the other goes through shared memory (_owners)."""
    touches = [bool({STATE} & (reads(st) | st.writes())) for st in body]
    if not any(touches):
        raise NotFusable("schedule", "the chain cannot be cut into a state role and a value role: "
                         "no statement touches the state")
    entering, made = [], {STATE_IO}  # the statements on the entering state's copy, and what they make
    for st, t in zip(body, touches):
        entering.append(not t and bool(reads(st) & made))
        if entering[-1]:
            made |= st.writes()
    # the loaded-value statements whose results only the state (and others of them) read, where
    # the value role works on the entering state: the state role forms them while it waits for
    # that (else, the gate-only chains' V' = diag(d)V, the value role forms them ahead of it)
    blocks = [any(scope.get(b) == "fragment" for b in (reads(st) | st.writes()) - {STATE}) for st in body]
    moved = {i for i, (t, e, f) in enumerate(zip(touches, entering, blocks)) if not (t or e or f)} \
        if any(entering) else set()
    while True:
        keep = {i for i in moved if all(touches[j] or j in moved for j, other in enumerate(body)
                                        if j != i and body[i].writes() & reads(other))}
        if keep == moved:
            break
        moved = keep
    state = [t or i in moved for i, t in enumerate(touches)]
    roles = {"state": [st for st, s in zip(body, state) if s], "value": [st for st, s in zip(body, state) if not s]}
    return roles if roles["value"] else {"state": roles["state"]}


def _through_fragments(body: list, scope: dict) -> list:
    """A role's element-wise writes of shared blocks from other shared blocks, made in registers
    first: X_s = f(F, ...) with F a fragment of X_s's shape that f reads element for element
    becomes F = f(F, ...) in place, then a copy F → X_s (FlashQLA's order). Why: in one loop, a
    shared write followed by the next element's shared read of a ring copy (its stage a runtime
    index) is one TileLang 0.1.15 cannot prove disjoint, so its thread-sync pass put a named
    barrier between every two elements (32 `bar.sync` a pass on the H200's ncu trace, session 15);
    a loop that writes registers and a copy that reads them need none. A copy of F that came after
    the write (the undecayed v_new the output role reads) moves before it, so F's value is taken
    before it changes; a write whose F is read otherwise later stays as it is. Where several
    fragments qualify (GDN's d WS = −(diag(decay)·K S + s·its intra term), both C×V fragments of
    the value role), F is the first f reads, so the kernel does not depend on a set's order."""
    out = list(body)
    i = 0
    while i < len(out):
        st = out[i]
        if st.op != "ewise" or scope.get(st.dst) != "shared" or not any(scope.get(r) == "shared" for r in reads(st)):
            i += 1
            continue
        idx = st.attr["index"]
        frags = [r for r in dict.fromkeys(_buffers_in(st.attr["expr"]))
                 if scope.get(r) == "fragment" and _read_at(st.attr["expr"], r, idx)]
        later = out[i + 1:]
        for f in frags:
            touch = [f in reads(x) or f in x.writes() for x in later]
            moved = [x for x, t in zip(later, touch) if t]
            if all(x.op == "copy" and x.srcs == (f,) and x.dst not in reads(st) for x in moved):
                rest = [x for x, t in zip(later, touch) if not t]
                out[i:] = moved + [Stmt("ewise", f, (), st.attrs), Stmt("copy", st.dst, (f,))] + rest
                i += len(moved) + 1
                break
        i += 1
    return out


def _buffers_in(expr) -> list:
    """The buffers `expr` reads, in the order it reads them (with repeats)."""
    if not isinstance(expr, tuple):
        return []
    here = [expr[1]] if len(expr) >= 2 and expr[0] == "buf" else []
    return here + [b for x in expr for b in _buffers_in(x)]


def _read_at(expr, name: str, idx: tuple) -> bool:
    """Whether `expr` reads `name`, and only at the element `idx` (so it can be rewritten in place)."""
    found = []

    def walk(e):
        if isinstance(e, tuple):
            if len(e) >= 2 and e[0] == "buf" and e[1] == name:
                found.append(tuple(e[2:]))
            for x in e:
                walk(x)
    walk(expr)
    return bool(found) and all(f == tuple(idx) for f in found)


def _owners(bodies: dict, buffers: dict) -> tuple:
    """(the role that writes each buffer, the hand-offs: buffer -> the other roles that read it).
    A buffer two roles write, or a fragment another role reads, cannot be cut between them: a
    PassError names it. A buffer no role touches is dropped."""
    writers, readers = {}, {}
    for role, body in bodies.items():
        for st in body:
            for w in st.writes() & set(buffers):
                writers.setdefault(w, set()).add(role)
            for r in reads(st) & set(buffers):
                readers.setdefault(r, set()).add(role)
    owner, handoffs = {}, {}
    for name, buf in buffers.items():
        ws, rs = writers.get(name, set()), readers.get(name, set())
        if not ws and not rs:
            continue
        if len(ws) != 1:
            raise PassError("schedule", f"{name} is written by {' and '.join(sorted(ws)) or 'no'} role"
                                        f"{'s' if len(ws) != 1 else ''}: a buffer between roles has one writer")
        owner[name] = next(iter(ws))
        if rs - ws:
            if buf.scope != "shared":
                raise PassError("schedule", f"the fragment {name} is written by the {owner[name]} role and read by "
                                            f"the {' and '.join(sorted(rs - ws))} role: registers stay in one role")
            handoffs[name] = rs - ws
    return owner, handoffs


def _parked(body: list, handed: set, buffers: dict, budget: int, at: dict) -> tuple:
    """(`body`, fragment -> the shared io block it waits in): a role's chunk-local fragments
    written before its first wait for a hand-off and read after it, where its fragments would not
    fit its register budget (less REGISTER_OVERHEAD) across that wait, copied to shared memory once
    written and read from there, largest first until the rest fit (`at`: the sizes, at the
    widest V-block). GDN's whole-V backward scan with scan_products forms d v_new's intra-chunk
    term (C×V, 64 registers a thread) ahead of the entering state, whose product K·S needs
    another 64, on a value role of 112. The io block rounds it as the prep's store did when the
    term crossed memory."""
    first = next((i for i, st in enumerate(body) if reads(st) & handed), None)
    if first is None:
        return body, {}

    def regs(name):  # a float32 fragment's registers a thread
        return buffer_bytes(buffers[name], at) // 4 // THREADS

    frags = {n for n, b in buffers.items() if b.scope == "fragment" and b.dtype == "float32"}
    touched_first = {}
    for i, st in enumerate(body):
        for n in (reads(st) | st.writes()) & frags:
            touched_first.setdefault(n, (i, n in st.writes() and n not in reads(st)))
    local = {n for n, (i, written) in touched_first.items() if written}  # chunk-local: written before read
    across = sorted((n for n in local if touched_first[n][0] < first
                     and any(n in reads(st) for st in body[first:])), key=lambda n: (-regs(n), n))
    after = {n for st in body[first:] for n in st.writes() & frags} - set(across)
    carried = {n for n in frags - local if any(n in reads(st) | st.writes() for st in body)}
    need = sum(regs(n) for n in set(across) | after | carried)
    room = budget - REGISTER_OVERHEAD
    parked = {}
    for n in across:
        if need <= room:
            break
        block = f"{n}_s" if f"{n}_s" not in buffers else f"{n}_held_s"
        parked[n] = block
        need -= regs(n)
    if not parked:
        return body, {}
    out = []
    last_write = {n: max(i for i, st in enumerate(body[:first]) if n in st.writes()) for n in parked}
    for i, st in enumerate(body):
        out.append(st.renamed(parked) if i >= first else st)
        out += [Stmt("copy", parked[n], (n,)) for n in sorted(parked) if last_write[n] == i]
    return out, parked


def _budgets(roles: list, dims: dict) -> dict:
    """Each compute role's register budget: the CTA's pool (its threads · entry_registers) less
    the loads role's LOADS_REGISTERS; a state role of its own gets the state's registers and
    STATE_EXTRA_REGISTERS, the other roles share the rest evenly."""
    threads = (len(roles) + 1) * THREADS
    left = (len(roles) + 1) * entry_registers(threads) - LOADS_REGISTERS
    out = {}
    if "state" in roles:
        out["state"] = (dims["K"] * WIDE_BLOCK_V // THREADS + STATE_EXTRA_REGISTERS + 7) // 8 * 8
        left -= out["state"]
    rest = [r for r in roles if r not in out]
    share = min(left // len(rest) // 8 * 8, 256)  # setmaxnreg's largest (a small state leaves more)
    return {r: out.get(r, share) for r in roles}


def _params(ir, part: Partition, out_nodes, loaded_out, result: str | None, stored: tuple) -> list:
    carried = set(part.carried)
    ps = input_params(ir, part.scan, part.crossing + part.provided)
    ps += input_params(ir, out_nodes, loaded_out - carried)
    ps += [Tensor("cu_seqlens", ("N+1",), "int32", "in")]
    if ir.state_in in stored:
        ps.append(CHUNK_OFFSETS)
    ps += [Tensor("initial_state", ("N", "HV", "K", "V"), "float32", "in")]
    ps += head_params(ir, set(part.scan) | set(out_nodes))
    made = [Tensor(result, ("1", "T", "HV", "V"), "io", "out", result=result)] if result else []
    return ps + made + [crossing_tensor(ir, x, "out") for x in stored] \
        + [Tensor("final_state", ("N", "HV", "K", "V"), "float32", "out")]


def _vectors_for_loads(ir, nodes: set, loaded: set) -> set:
    """The per-token vectors among `nodes` that scale a block and are made from loaded vectors,
    constants and parameters alone (no block is read for them): the loads role can form each
    once a chunk. Only those a block reads: the vectors inside them stay inlined there."""
    def from_vectors(x) -> bool:
        n = ir.node(x)
        if len(n.shape) > 1 or n.op in ("valid", "positions"):
            return False
        if x in loaded or n.op in ("const", "param", "head_log"):
            return True
        if n.op == "input":
            return n.attr.get("kind") in ("scalar", "gate", "vector")
        return bool(n.args) and all(from_vectors(a) for a in n.args)

    return {x for x in nodes if ir.node(x).shape == ("C",) and x not in loaded and ir.node(x).op != "input"
            and from_vectors(x) and any(len(u.shape) == 2 for u in ir.users(x) if u.name in nodes)}


def _dead_before(body: list, buffers: dict) -> tuple:
    """(`body`, the shared buffers of one role that can take another's memory): B takes A's where
    A and B have one shape and dtype, the chunk's first access to each is a write, and every
    access to A comes before the first to B (so A's value is dead when B is written, and B's when
    the next chunk writes A). GDN's chain: v_new_decayed in v_resid's memory, whose last reader
    (T·) is done. Also where B's first write reads A at the element it writes and nothing else
    touches A after it (B is A updated in place: the backward's low half of d QS, its bf16
    rounding's remainder, in the high half's memory); a later reader of A that can go before that
    write does (_in_place), so the body comes back in its new order."""
    body = _in_place(body, buffers)
    span = {}
    for i, st in enumerate(body):
        for name in (reads(st) | st.writes()) & set(buffers):
            first, _ = span.get(name, (i, i))
            span[name] = (first, i)
    written_first = sorted((n for n, (i, _) in span.items() if n in body[i].writes() and n not in reads(body[i])),
                           key=lambda n: span[n][0])

    def dead(a: str, b: str) -> bool:
        first = span[b][0]
        return span[a][1] < first or (span[a][1] == first and _updates(body[first], a, b))

    out, hosts = {}, {}
    for b in written_first:
        host = next((a for a in written_first
                     if a != b and a not in out and dead(a, b)
                     and (buffers[a].shape, buffers[a].dtype) == (buffers[b].shape, buffers[b].dtype)
                     and all(span[g][1] < span[b][0] for g in hosts.get(a, ()))), None)
        if host is not None:
            out[b] = host
            hosts.setdefault(host, []).append(b)
    return body, out


def _updates(st: Stmt, a: str, b: str) -> bool:
    """Whether `st` writes `b` element-wise reading `a` only at the element it writes (an update
    of A into B that can run in A's memory)."""
    return st.op == "ewise" and st.dst == b and _read_at(st.attr["expr"], a, st.attr["index"])


def _in_place(body: list, buffers: dict) -> list:
    """`body` with the readers of a block A that come after a write of B updating A in place
    (_updates) moved ahead of that write, where they touch nothing the statements they pass write
    or read: then the update is A's last access (the backward's d S₀ += qᵀ·d QS before d QS's low
    half is formed from it)."""
    out = list(body)
    for st in list(out):
        if st.op != "ewise" or st.dst not in buffers:
            continue
        same = (buffers[st.dst].shape, buffers[st.dst].dtype)
        for a in sorted(a for a in reads(st) & set(buffers) if a != st.dst and _updates(st, a, st.dst)
                        and (buffers[a].shape, buffers[a].dtype) == same):
            i = out.index(st)
            for j in range(i + 1, len(out)):
                later, passed = out[j], out[i:j]
                if a in reads(later) and a not in later.writes() \
                        and not any((reads(later) | later.writes()) & p.writes() or later.writes() & reads(p)
                                    for p in passed):
                    out[i:j + 1] = [later, *passed]
                    i += 1
    return out


def _check_rings(body: list, ring: set) -> None:
    for st in body:
        if st.dst in ring:
            raise PassError("schedule", f"`{st}` writes {st.dst}, a ring the loads role fills (its readers must not)")


def _independent_first(body: list, handed: set) -> list:
    """A role's statements with those that need nothing handed over to it (the output's Q Kᵀ and
    its mask, the state's products of loaded blocks) moved ahead of those that do, so the role
    waits for another as late as it can. A statement stays behind if it reads what is handed over,
    or touches a buffer a statement staying behind reads or writes (so the order of every
    dependent pair is kept), except that accumulations into one buffer commute (d S₀ += Qᵀ·d QS
    goes ahead of d S₀ += Wᵀ·d WS, which waits for the value role)."""
    ahead, behind, reads_behind, writes_behind, summed_behind = [], [], set(), set(), set()
    for st in body:
        r, w = reads(st), st.writes()
        summed = w if st.op == "gemm" and st.attr.get("accumulate") else set()
        if r & handed or r & (writes_behind | summed_behind) or (w - summed) & (reads_behind | writes_behind
                                                                                | summed_behind) \
                or summed & (reads_behind | writes_behind):
            behind.append(st)
            reads_behind |= r
            writes_behind |= w - summed
            summed_behind |= summed
        else:
            ahead.append(st)
    return ahead + behind


def _handed_on_when_made(body: list, handed: set, scope: dict) -> list:
    """`body` with each copy of a fragment into a hand-off block moved up to right after the
    fragment's last write, past statements that touch neither: the fragment's registers are free
    for what comes between (the backward scan's W = T·K, 64 registers a thread on a value role of
    112, would otherwise stay live across that role's C×V product with d O, another 64)."""
    out = list(body)
    for st in list(out):
        if st.op != "copy" or st.dst not in handed or scope.get(st.srcs[0]) != "fragment":
            continue
        i = out.index(st)
        made = max((j for j in range(i) if st.srcs[0] in out[j].writes()), default=None)
        if made is None or any(st.dst in reads(x) | x.writes() for x in out[made + 1:i]):
            continue
        out[made + 1:i + 1] = [st, *out[made + 1:i]]
    return out


def _products_when_read(body: list, scope: dict) -> list:
    """`body` with each product into a fragment moved down to right before the first statement
    that reads it, past statements that touch neither its result nor what its operands hold: a
    product is synchronous (T.gemm waits for its wgmma), so issuing it early gains nothing, and its
    result would hold registers across what comes between (the backward scan's Q Kᵀ, 32
    registers a thread, across the value role's W = T·K, another 64, on a role of 112)."""
    out = list(body)
    for st in [x for x in out if x.op == "gemm" and scope.get(x.dst) == "fragment" and not x.attr.get("accumulate")]:
        i = out.index(st)
        first = next((j for j in range(i + 1, len(out)) if st.dst in reads(out[j]) | out[j].writes()), None)
        if first is None or any(reads(st) & x.writes() for x in out[i + 1:first]):
            continue
        out[i:first] = [*out[i + 1:first], st]
    return out


def _synced(body: list, bufs: set, barrier: str | None, reader: bool) -> list:
    """`body` with its hand-offs on the rings `bufs`: a reader waits on full before its first read
    and arrives on empty after its last; a writer waits on empty before its first write, fences
    and arrives on full after its last. `barrier`: one pair for all of `bufs` (the loads), else a
    pair per buffer."""
    groups = {barrier: bufs} if barrier else {b: {b} for b in sorted(bufs)}
    first, last = {}, {}
    for name, members in groups.items():
        touched = [i for i, st in enumerate(body) if (reads(st) if reader else st.writes()) & members]
        if touched:
            first[name], last[name] = touched[0], touched[-1]
    out = []
    for i, st in enumerate(body):
        for name in first:
            if first[name] == i:
                out.append(Stmt("wait", f"{name}_full" if reader else f"{name}_empty", (),
                                () if reader else (("free", True),)))
        out.append(st)
        for name in last:
            if last[name] == i:
                if not reader:
                    out.append(Stmt("fence_async", None))
                out.append(Stmt("arrive", f"{name}_empty" if reader else f"{name}_full"))
    return out


def _loads_role(loads: list) -> list:
    """The loads role's chunk: wait for the ring copy to be free, TMA its blocks (one warp issues
    and arrives), load its vectors (every thread), wait for the blocks to land, zero the rows
    past a partial chunk, publish."""
    blocks = [st for st in loads if st.op == "load"]
    tma = [Stmt("load", st.dst, st.srcs, st.attrs + (("barrier", "loads_landed"),)) for st in blocks]
    vectors = [st for st in loads if st.op != "load"]
    pads = zero_pad(blocks, only_partial=True)
    return ([Stmt("wait", "loads_empty", (), (("free", True),))] + tma
            + [Stmt("arrive", "loads_landed", (), (("threads", WARP),))] + vectors
            + [Stmt("wait", "loads_landed")] + pads + [Stmt("fence_async", None), Stmt("arrive", "loads_full")])
