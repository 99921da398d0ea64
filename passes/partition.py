"""partition: which ChunkIR nodes run in which kernel.

Two kinds of work (MATH.md): work parallel over chunks and the sequential scan over chunks. What
bounds a long sequence is the scan's per-chunk latency, so the scan kernel keeps only the chain —
the nodes on the path from the state entering a chunk to the state leaving it — and three kernels
run in order:

  * `prep`, one CTA per (chunk, value head): the long parallel work the chain and the output
    read — triangular inverses, chunk-local cumulative sums, the matmuls built on an inverse
    (GDN's W and U) and any other state-free per-token matmul the chain reads. Their results
    cross memory once. Also an element-wise block the chain would form from a prepared block
    and vectors alone, stored in that block's place (the fused forward's T = T_r ⊙ R).
  * `scan`, one CTA per (V-block, value head, sequence): the chain. It loads what `prep` made,
    recomputes cheap state-free values (a decay, kᵀv for a gate-only recurrence) on the fly,
    keeps the state in registers, and stores the values the output needs (`carried`: the state
    entering each chunk, and v_new for the delta rule).
  * `out`, one CTA per (chunk, value head): everything else that depends on the state (the output),
    parallel over chunks again; it recomputes Q Kᵀ and the decay mask rather than loading them
    (with SHARE_DECAYS, a per-key decayed product whose exponentials the prep forms anyway is
    prepared instead: _sharing_exponentials).

So GDN, DeltaNet and simple GLA compile to three kernels, RetNet and linear attention to two
(nothing is long enough to prepare).

    >>> print(partition(compile_spec("specs/gdn.py").chunk))            # doctest: +SKIP
    partition gdn
      kernel gdn_prep (parallel over chunks): g_cum ... W U
      ...
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import networkx as nx

from qla_compiler.errors import PassError
from qla_compiler.ir.chunk import ChunkIR

from .chunk_per_key import shares_exponentials, sum_top

# state-free results worth computing once and passing through memory
PREPARED_OPS = ("inv_unit_lower", "cumsum")
# A decayed product sharing its exponentials with one the prep forms (KDA's q⋆k beside k⋆k) is
# prepared too, and its C×C sum crosses memory (_sharing_exponentials). On the H100 (session 39,
# 16/16:8x4096) KDA's out kernel went 1.02 → 0.34 ms and the backward's d v_new prep 0.96 → 0.19
# for +0.18 ms in the inference prep (none in the training prep): the training step 12.90 → 11.30
# (FLA 10.28). QLA_SHARE_DECAYS=0 turns it off (the generated source differs: both variants cache
# side by side).
SHARE_DECAYS = os.environ.get("QLA_SHARE_DECAYS", "1") == "1"
# A matmul is "built on an inverse" (prepared) only through values this program computes: in a
# backward the forward's v_new is loaded (provided), so d P = dO·v_newᵀ and GDN's q·Kᵀ partials of
# d q and d k (d P masked, times K or Q) are plain products of loaded blocks, recomputed by the
# out kernel as Q Kᵀ is, instead of 1.25 GiB of partials crossing memory twice at 16/64:8x4096.
# On the H100 (benchmarks/NOTES.md, session 46) the GDN training step went 12.20 → 11.08 ms there
# (the backward prep 2.36 → 1.29, the out kernel no slower: 5.29 → 5.25) and its peak 6280 → 5528
# MiB. Not for per-key gates: QLA_RECOMPUTE_PER_KEY=1 applies it to them too, and KDA's training
# step went 9.85 → 11.74 ms at 16/16:8x4096 (H100, NOTES session 47; its out kernels are bound by
# their exponentials, not latency; GLA has no backward prep). QLA_RECOMPUTE_ON_LOADED=0 turns it
# off (the generated source differs: both variants cache side by side).
RECOMPUTE_ON_LOADED = os.environ.get("QLA_RECOMPUTE_ON_LOADED", "1") == "1"
RECOMPUTE_PER_KEY = os.environ.get("QLA_RECOMPUTE_PER_KEY", "0") == "1"
# The backward's whole-V scan on roles forms the products of the chunk's input blocks it reads
# (GDN's d v_new intra-chunk term, (Q Kᵀ ⊙ R)ᵀ·d O) on its value role, ahead of the entering state's
# hand-off, instead of loading them from the prep (partition's scan_products): the prep no longer
# reads q and d o for them, nor writes a C×V block a chunk. On the H100 (NOTES sessions 51–52,
# 16/64:8x4096) the backward prep went 1.277 → 0.467 ms, the scan 1.263 → 1.084, the training step
# 9.33 → 8.34 (4/16:8x4096: 2.36 → 2.12; session 51's 1.444 ms scan was timed on a source that
# depended on the hash seed). QLA_SCAN_PRODUCTS=0 turns it off (the generated source differs: both
# variants cache side by side).
SCAN_PRODUCTS = os.environ.get("QLA_SCAN_PRODUCTS", "1") == "1"
# With it, the products built on the inverse the forward kept too (partition's kept_inverse: GDN's
# W = (T_r ⊙ R)·diag(βΓ)K, its scaling on T's columns by scale_on_left_columns): the scan loads T_r
# (C×C) where it loaded W (C×K), and the backward's prep kernel, which formed W alone, goes away
# (0.47 ms of the 8.34 ms training step at 16/64:8x4096 on the H100, session 52). Off until a GPU
# run times it: QLA_SCAN_PRODUCTS_ON_INVERSE=1 turns it on (the generated source differs: both
# variants cache side by side).
SCAN_PRODUCTS_ON_INVERSE = os.environ.get("QLA_SCAN_PRODUCTS_ON_INVERSE", "0") == "1"
ELEMENTWISE = ("add", "sub", "mul", "neg", "scale_rows", "scale_cols")


@dataclass(frozen=True)
class Partition:
    chunk: ChunkIR
    prep: tuple  # nodes of the prep kernel
    crossing: tuple  # prep results that later kernels load
    scan: tuple  # nodes of the scan kernel: the chain and the state-free values it recomputes
    carried: tuple  # scan values the out kernel loads (the state entering the chunk, v_new, ...)
    out: tuple  # nodes of the out kernel
    provided: tuple = ()  # values another program's kernels stored (the forward's, for a backward): loaded
    # carried values a fused kernel stores too, though it hands them between its roles on the SM
    # (a training forward's, which its backward loads); the separate scan stores every carried value
    stored: tuple = ()

    @property
    def out_loads(self) -> set:
        """What an out kernel loads rather than computes: the prep's and the scan's results, and
        what another program stored."""
        return set(self.crossing) | set(self.carried) | set(self.provided)

    def __str__(self) -> str:
        name = self.chunk.name
        lines = [f"partition {name}"]
        if self.prep:
            lines.append(f"  kernel {name}_prep (parallel over chunks): {' '.join(self.prep)}")
            lines.append(f"    through memory: {' '.join(self.crossing)}")
        lines.append(f"  kernel {name}_scan (sequential over chunks): {' '.join(self.scan)}")
        lines.append(f"    through memory: {' '.join(self.carried)}")
        lines.append(f"  kernel {name}_out (parallel over chunks): {' '.join(self.out)}")
        if self.provided:
            lines.append(f"  from the forward's memory: {' '.join(self.provided)}")
        if self.stored:
            lines.append(f"  stored for another program, fused or not: {' '.join(self.stored)}")
        return "\n".join(lines)


def _prepared(ir: ChunkIR, name: str, for_scan: bool, provided: set = frozenset(),
              scan_products: bool = False, kept_inverse: bool = False) -> bool:
    """Computed by prep: inverses and prefix sums, and matmuls built on an inverse. For the scan,
    also every matmul whose result is per-token rows: loading it costs what loading an input block
    costs, and it leaves the sequential path (a K×V result stays in the scan: it would cost a
    state's worth of memory per chunk), unless `scan_products` and the product is made from the
    chunk's input blocks alone (_from_inputs; with `kept_inverse`, a provided inverse counts as
    one). With RECOMPUTE_ON_LOADED (not for a per-key gate),
    "built on" looks through the values this program computes only, not through the `provided`
    ones it loads."""
    n = ir.node(name)
    if n.op in PREPARED_OPS:
        return True
    if n.op != "matmul":
        return False
    if for_scan and n.shape[0] == "C":
        return not (scan_products and _from_inputs(ir, name, provided, kept_inverse))
    if RECOMPUTE_ON_LOADED and (RECOMPUTE_PER_KEY or not _per_key_gate(ir)):
        return _built_on_inverse(ir, name, provided)
    return any(ir.node(a).op == "inv_unit_lower" for a in nx.ancestors(ir.graph, name))


def _per_key_gate(ir: ChunkIR) -> bool:
    return any(n.attr.get("kind") == "key_gate" for n in ir.inputs())


def _built_on_inverse(ir: ChunkIR, name: str, provided: set) -> bool:
    """Whether an inverse is among `name`'s arguments, their arguments and so on, not counting
    what lies behind a `provided` value (loaded, not computed)."""
    seen, todo = set(), [name]
    while todo:
        for a in ir.node(todo.pop()).args:
            if a in seen or a in provided:
                continue
            if ir.node(a).op == "inv_unit_lower":
                return True
            seen.add(a)
            todo.append(a)
    return False


def _from_inputs(ir: ChunkIR, name: str, provided: set, kept_inverse: bool = False) -> bool:
    """Whether `name` is made from the chunk's input blocks, vectors and constants alone: no
    inverse, prefix-summed block, provided block or K×V value behind it (GDN's backward d v_new's
    intra-chunk term, (Q Kᵀ ⊙ R)ᵀ·d O, from q, k, d o and the gates' vector). With `kept_inverse`
    an inverse the forward kept (provided) is loaded like an input block: C×C, half a C×K
    product's bytes (GDN's backward W)."""
    seen, todo = set(), [name]
    while todo:
        n = ir.node(todo.pop())
        if kept_inverse and n.name in provided and n.op == "inv_unit_lower":
            continue
        if n.op == "inv_unit_lower" or (n.op == "cumsum" and len(n.shape) == 2) or n.shape[:1] == ("K",) \
                or (n.name in provided and len(n.shape) == 2):
            return False
        if n.name in provided or n.op == "input":
            continue
        for a in n.args:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return True


def _combined(ir: ChunkIR, free, prepared: set) -> set:
    """Also prepare an element-wise block whose block arguments are all prepared (GDN's backward
    v_new = U − W·S0): one tensor crosses memory instead of several."""
    out = set(prepared)
    for x in free:  # program order: a combination of combinations is found too
        n = ir.node(x)
        blocks = [a for a in n.args if len(ir.node(a).shape) == 2]
        if n.op not in ELEMENTWISE or len(n.shape) != 2 or not blocks:
            continue
        if len(blocks) == 1 and [u.name for u in ir.users(blocks[0])] != [x]:
            continue  # its block crosses anyway (a per-key γ_C − γ): it would only add a crossing
        if all(a in out for a in blocks):
            out.add(x)
    return out


def _vector_made(ir: ChunkIR, name: str, prepared: set) -> bool:
    """`name` is computed from prepared values, constants and parameters through vectors and
    scalars alone (GDN's decay mask R = exp2(γ_i − γ_j) from the prepared g_cum): prep can form it
    from what it has, and no block input is read for it."""
    n = ir.node(name)
    if name in prepared:
        return len(n.shape) < 2
    if n.op in ("const", "param"):
        return True
    if n.op == "input" or not n.args:
        return False
    return all(_vector_made(ir, a, prepared) for a in n.args)


def _folded_into_prep(ir: ChunkIR, scan: set, prepared: set, elsewhere: set) -> set:
    """State-free element-wise blocks of the scan that prep can store in place of a prepared block
    they read: each prepared block argument of such a block has it as its only reader anywhere
    (`elsewhere`: what other kernels read), and every other argument is made from vectors
    (_vector_made). The result has the argument's shape, so as much crosses memory as before, and
    the pass that formed it leaves the scan's sequential path (the fused forward's T = T_r ⊙ R:
    C×C exponentials a chunk). An argument a program keeps for another (the fused training
    forward's T_r) crosses memory beside it: one block more, and the pass still off the chain."""
    out, dependent = set(), ir.scan_nodes()
    for x in sorted(scan - prepared):
        n = ir.node(x)
        if n.op not in ELEMENTWISE or len(n.shape) != 2 or x in dependent:
            continue
        blocks = [a for a in n.args if a in prepared and len(ir.node(a).shape) == 2]
        rest = [a for a in n.args if a not in blocks]
        if blocks and all(ir.node(a).shape == n.shape for a in blocks) \
                and all({u.name for u in ir.users(a)} == {x} and a not in elsewhere for a in blocks) \
                and all(_vector_made(ir, a, prepared) for a in rest):
            out.add(x)
    return out


def _sharing_exponentials(ir: ChunkIR, prep: set, out: set, dependent: set) -> set:
    """The state-free C×C sums the out kernel would build on a decayed product Σ_k X_ik Z_jk
    e^{γ_ik − γ_jk} whose Z and exponentials (R) a decayed product of the prep shares (KDA's
    P_diag = q ⋆ k beside the inverse's KKt_R_diag = k ⋆ k): prepared, the two run in one loop
    with one exponential an element (schedule_build pairs them in one statement), and the sum
    (P, with its sub-chunk products) crosses memory in place of the out kernel's own pass."""
    free = set(ir.graph) - dependent
    return {sum_top(ir, x, free) for x in out
            if x in free and any(shares_exponentials(ir, x, y) for y in prep)}


def partition(ir: ChunkIR, keep=(), provided=(), share_decays: bool = SHARE_DECAYS,
              scan_products: bool = False, kept_inverse: bool = False) -> Partition:
    """`keep`: values to store per token although no later kernel reads them (the forward for
    training keeps its inverses for the backward): state-free ones cross memory from the prep;
    state-dependent ones must be carried (the entering state, v_new), and are `stored` even where
    a fused kernel hands them over on the SM. `provided`: state-free values
    already in memory (a backward's recomputed forward values that the forward stored): every
    kernel loads them and none recomputes them. `share_decays`: _sharing_exponentials.
    `scan_products`: the scan forms the per-token products of the chunk's input blocks it reads
    (_from_inputs) instead of loading them from the prep: for a scan whose roles do them off the
    chain (the backward's whole-V scan on roles), where they would cross memory twice;
    `kept_inverse`: also those built on a provided inverse (_from_inputs)."""
    provided = set(provided)
    state_in, s_next = ir.state_in, ir.next_state
    results = list(ir.outputs.values())  # o (a backward: the gradients)
    if state_in is None or s_next is None or not results:
        raise PassError("partition", "the chunk program needs a state, its next value and an output")
    dependent = ir.scan_nodes()
    if s_next not in dependent:
        raise PassError("partition", f"the next state {s_next} does not depend on the state")
    chain = ir.chain_nodes()
    free = [n.name for n in ir.order() if n.name not in dependent]
    keep_carried = {x for x in keep if x in dependent}
    keep = {x for x in keep if x not in dependent}
    if provided - set(free):
        raise PassError("partition", f"provided values must be state-free: {sorted(provided - set(free))}")
    prepared = _combined(ir, free, {x for x in free if x in provided or _prepared(ir, x, False, provided)})
    prepared_scan = _combined(ir, free, {x for x in free if x in provided
                                         or _prepared(ir, x, True, provided, scan_products, kept_inverse)})
    for n in ir.order():
        if n.op in PREPARED_OPS and n.name in dependent:
            raise PassError("partition", f"{n.name} ({n.op}) depends on the state; it cannot run ahead of the scan")

    # the scan loads prepared values; it recomputes every other state-free value it needs
    scan = ir.closure(chain, stop=prepared_scan)
    out_roots = set()
    for r in results:
        out_roots |= (nx.ancestors(ir.graph, r) & dependent) | {r}
    out_roots -= chain
    carried = {a for x in out_roots for a in ir.node(x).args if a in chain}
    # an element-wise function of other carried values (the backward's dW·S = −dv_new) is
    # recomputed by the out kernel rather than stored
    for x in sorted(carried):
        n = ir.node(x)
        others = [a for a in n.args if a in chain]
        if n.op in ELEMENTWISE and others and all(a in carried and a != x for a in others):
            carried.discard(x)
    if keep_carried - carried:
        raise PassError("partition", f"kept values {sorted(keep_carried - carried)} depend on the state but are not "
                                     f"carried from the scan to the output (carried: {sorted(carried)})")
    # the out kernel loads prefix sums and inverses (and what is built on them); it recomputes
    # the rest, including Q Kᵀ, which is parallel work there
    out = ir.closure(out_roots | carried, stop=prepared | carried)
    folded = _folded_into_prep(ir, scan, prepared_scan, out | provided)
    if folded:
        prepared_scan |= folded
        scan = ir.closure(chain, stop=prepared_scan)
    used = (scan & prepared_scan) | (out & prepared) | set(keep)
    prep = ir.closure(used - provided, stop=provided)
    shared = _sharing_exponentials(ir, prep, out, dependent) if share_decays else set()
    if shared:
        prepared |= shared
        out = ir.closure(out_roots | carried, stop=prepared | carried)
        used = (scan & prepared_scan) | (out & prepared) | set(keep)
        prep = ir.closure(used - provided, stop=provided)
    loaded = (used | prep) & provided
    order = [n.name for n in ir.order()]
    crossing = tuple(x for x in order if x in used - provided)
    for x in crossing:
        if ir.node(x).shape in ((), ("K", "V")):
            raise PassError("partition", f"{x} would cross memory with shape {ir.node(x).shape or 'scalar'}; "
                                         "only per-token rows (C, C×C, C×K, C×V) do")
    return Partition(ir, tuple(x for x in order if x in prep), crossing,
                     tuple(x for x in order if x in scan), tuple(x for x in order if x in carried),
                     tuple(x for x in order if x in out), tuple(x for x in order if x in loaded),
                     tuple(x for x in order if x in keep_carried))
