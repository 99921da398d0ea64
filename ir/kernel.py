"""KernelIR: the chunk program split into GPU kernels, with buffers placed and statements ordered.

Per kernel: the grid, the global tensors it reads and writes, its buffers and where they live
(shared memory, register fragments), the warpgroup roles, and three statement lists — before the
chunk loop, inside it, after it. Sizes stay symbolic (C, K, V, BV, H, HV); the lowering fills in
a `ShapeClass`.

Statements are plain data: `Stmt(op, dst, srcs, attrs)`. Element-wise work carries an expression
tree (`Expr`) indexed by the loop variables of one `T.Parallel` loop.

    >>> kir = compile_spec("specs/gdn.py").kernels                     # doctest: +SKIP
    >>> print(kir)                                                      # doctest: +SKIP
    kernel_program gdn  C=64
    ...
    kernel gdn_prep  grid(chunk_slot:CH, value_head:HV)  threads 128  # parallel over chunks: ...
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .chunk_ops import DECAYED_PRODUCT
from .display import rich_html

# ---- expressions -----------------------------------------------------------------------------
# An Expr is a tuple: ("buf", name, idx...) | ("lit", value) | ("param", name) | ("head", name)
# | (op, a, b) for add, sub, mul, max, above (1 where a > b, else 0) | (op, a) for neg, exp, exp2
# | ("select_lower"|"select_strict", i, j, then, else) | ("select_valid", i, then, else) | ("min_pos", i)
# | ("select_rows", i, lo, hi, then, else): then on the rows lo ≤ i < hi.
# Index entries are expressions over the loop variables i, j and n_valid (the tokens of the chunk).


# Operator templates, one table per dialect: KernelIR's own print, and TileLang (passes/lower_tilelang)
PRETTY = {
    "add": "({0} + {1})", "sub": "({0} − {1})", "mul": "({0} · {1})", "neg": "−{0}",
    "exp": "exp({0})", "exp2": "exp2({0})", "max": "max({0}, {1})", "above": "[{0} > {1} ? 1 : 0]",
    "select_lower": "[{j}≤{i} ? {a} : {b}]", "select_strict": "[{j}<{i} ? {a} : {b}]",
    "select_valid": "[{i}<n_valid ? {a} : {b}]", "min_pos": "min({i}+1, n_valid)",
    "select_last": "[{i}=n_valid−1 ? {a} : {b}]",
    "select_rows": "[{lo}≤{i}<{hi} ? {a} : {b}]",
}


def format_expr(e, syntax: dict, leaf) -> str:
    """Render an expression tree with one dialect's operator templates; `leaf` renders buffers,
    literals, params and head constants."""
    tag = e[0]
    if tag in ("buf", "lit", "param", "head"):
        return leaf(e)

    def sub(x):
        return format_expr(x, syntax, leaf)

    if tag not in syntax:
        raise ValueError(f"unknown expression {e!r}")
    if tag in ("select_lower", "select_strict"):
        return syntax[tag].format(i=e[1], j=e[2], a=sub(e[3]), b=sub(e[4]))
    if tag in ("select_valid", "select_last"):
        return syntax[tag].format(i=e[1], a=sub(e[2]), b=sub(e[3]))
    if tag == "select_rows":
        return syntax[tag].format(i=e[1], lo=e[2], hi=e[3], a=sub(e[4]), b=sub(e[5]))
    if tag == "min_pos":
        return syntax[tag].format(i=e[1])
    return syntax[tag].format(*[sub(x) for x in e[1:]])


def _pretty_leaf(e) -> str:
    tag = e[0]
    if tag == "buf":
        return f"{e[1]}[{', '.join(e[2:])}]" if len(e) > 2 else e[1]
    if tag == "lit":
        return f"{e[1]:.6g}" if isinstance(e[1], float) else str(e[1])
    return e[1] if tag == "param" else f"log_{e[1]}[head]"


def expr_str(e) -> str:
    """Readable infix form of an expression (for printing KernelIR)."""
    return format_expr(e, PRETTY, _pretty_leaf)


# the columns a warp may be dealt of a fragment (Buffer.warp_columns): a lane holds 4 adjacent
# columns, and a warp's 32 lanes tile whole rows of them
WARP_COLUMN_COUNTS = (4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class Tensor:
    """A global-memory tensor the kernel takes; dims are names (T tokens, N sequences, ...)."""
    name: str
    shape: tuple
    # "io" (the op's q/k/v dtype), "float32", "int32"; the token step's "state" (its pools' dtype),
    # "gates" and "scalars" (its gates', its scalars': float32 or io), each the shape class's
    dtype: str
    role: str  # "in" | "out"
    doc: str = ""
    # its head dims (K, V) are the kernels' tile widths, not the op's: a tensor only kernels read
    # and write, allocated by the runtime, so that its blocks load and store whole even where the
    # op's head dim is narrower than the tile (K = 100 in a 128-wide tile); the op's own tensors
    # are loaded and stored masked there
    padded: bool = False
    # a dim name (e.g. "K"): the first that many columns of its last dim read as zeros that memory
    # does not hold. In memory the tensor is that much narrower, and a block at column c reads it
    # from column c − zero_columns; TMA fills what lies before column 0 with zeros, so a block wholly
    # there reads zeros at no cost (context parallelism's widened values [0 | v], passes/walk_skip.py,
    # without writing the zeros: 0.07 ms a call at 32768 tokens of 8 value heads on the H200)
    zero_columns: str = ""
    # the chunk program's output role this tensor holds (ChunkIR.outputs: the forward's result, a
    # backward's gradient), which the runtime returns; "" for every other tensor
    result: str = ""
    # an output: the input of this kernel whose memory it takes where the two are allocated alike
    # (shape and dtype at the launch; passes/reuse_memory.py). That input is made by an earlier
    # kernel of the program, read by no later one, and every CTA loads the rows it stores before
    # storing them (Kernel.verify, KernelIR.verify): a backward's gradient in its partial's place.
    # A scan's output takes it only where the scan runs once a call (not context-parallel)
    reuses: str = ""


@dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple  # of dim names
    dtype: str  # "io" | "float32" | "tfloat32" | "int32" (the token step's pool slots)
    scope: str  # "shared" | "fragment"
    # a ring of this many copies, chunk c in copy c % stages (a warp-specialised kernel's loads
    # and hand-offs between roles: the writer fills one copy while readers read another)
    stages: int = 1
    owner: str = ""  # the role that writes it (a warp-specialised kernel), "" where all threads do
    # the buffer whose memory it takes (a warp-specialised kernel): that one's value is dead, in
    # every chunk, before this one is written, and this one's before that one is written again
    shares: str = ""
    # elements of padding after each row of a 2-D shared block (its shape stays the logical one):
    # a row of 64 floats is 256 bytes, so the same column of different rows falls in one bank, and
    # threads that store a wgmma accumulator's rows, or read one column across rows, serialise
    row_pad: int = 0
    # a 2-D fragment's columns dealt to the warps, this many each with every row of them
    # (kernels/warp_columns.py; one of WARP_COLUMN_COUNTS): a sum over its rows is shuffles inside a
    # warp, no block barrier; 0: TileLang's own layout
    warp_columns: int = 0

    def alloc_shape(self) -> tuple:
        """Its shape as allocated: the last dim padded by row_pad."""
        return self.shape[:-1] + (f"{self.shape[-1]} + {self.row_pad}",) if self.row_pad else self.shape


@dataclass(frozen=True)
class Barrier:
    """An mbarrier per stage of a ring: a phase completes when `arrivals` threads have arrived (and,
    for a TMA load's, its bytes have landed). Chunk c uses stage c % stages at phase
    (c // stages) % 2; a wait on a `free` barrier (a ring's empty one) passes for the first
    `stages` chunks, when nothing has been put in the ring yet."""
    name: str
    arrivals: int
    stages: int
    doc: str = ""
    # what a completed phase hands over: "full" (the ring copies in `guards` hold the chunk: their
    # readers may read), "empty" (their readers are done: the writer may write), "landed" (a TMA
    # load's bytes are in: the writer may touch them)
    kind: str = "full"
    guards: tuple = ()

    def __str__(self) -> str:
        return (f"barrier  {self.name}[{self.stages}]: {self.arrivals} arrivals, {self.kind}: "
                f"{' '.join(self.guards)}   # {self.doc}")


def entry_registers(threads: int) -> int:
    """The registers each thread of a CTA of `threads` threads starts with, one CTA per SM
    (__launch_bounds__(threads, 1)): the SM's 64K shared evenly, in setmaxnreg's steps of 8, at
    most 255 (ptxas: 168 at 384 threads). setmaxnreg moves registers between the warpgroups inside
    this CTA's pool of threads · entry_registers; an increase that the pool cannot meet waits
    forever (the H200 hung on 200 + 200 + 112 > 3 · 168)."""
    return min(255, 64 * 1024 // threads) // 8 * 8


@dataclass(frozen=True)
class Role:
    """A warp-specialised kernel's role: the threads [first, first + threads) running their own
    statements, before, inside and after the loop over chunks, at their own register budget
    (setmaxnreg: raised or lowered from entry_registers, the launch's even share)."""
    name: str
    first: int
    threads: int
    registers: int
    prologue: tuple
    body: tuple
    epilogue: tuple
    doc: str = ""  # its math

    def __str__(self) -> str:
        head = (f"role {self.name}: threads [{self.first}, {self.first + self.threads}), "
                f"{self.registers} registers   # {self.doc}")
        lines = [head] + [f"  {s}" for s in self.prologue]
        lines += ["  for chunk:"] + [f"    {s}" for s in self.body]
        return "\n".join(lines + [f"  {s}" for s in self.epilogue])


@dataclass(frozen=True)
class Stmt:
    """op: load | load_vec | load_chunk_state | wait_load | zero_pad | copy | gemm | ewise | cumsum |
    reduce | inverse | decayed_product | store | store_vec | store_chunk_state | store_state | load_state, and in a
    token step load_token | load_slot | store_token (one token's row, or its scalar). A load with
    attribute async only starts the copy; wait_load (same dst) waits for it. A load_chunk_state
    with attribute cast converts a float32 state into its io block on the way (a synchronous copy),
    and a store_chunk_state from the state fragment writes it as it is. In the token step a
    state load with attribute slot takes the state's slot in its pool from that int32 [N] tensor,
    a state store from that int32 buffer, which a load_slot filled (−1: not stored). A
    load_token loads the current token's row (in the prologue the current token is the first),
    or with attribute ahead the one that many tokens later; a token past the sequence's end loads
    nothing (the buffer keeps its value). A load_slot loads the sequence's entry of an int32 [N]
    tensor, or of an [N, L] one the token's entry as load_token would (−1 past L). In a
    warp-specialised kernel also: wait (dst: a barrier, at the chunk's stage and phase), arrive
    (dst: a barrier), fence_async (generic shared writes made visible to wgmma and TMA before the
    arrive that publishes them), and a load with attribute barrier (a TMA load issued by one
    warp, landing on that barrier). A store with attribute negate stores its block's negation (a
    scan on roles storing a carried value whose negation its chain holds: GDN's d v_new from d
    WS). A decayed_product (einsum `eq` of its sources with
    e^{γ_ik − γ_jk} on the diagonal `block`-blocks) with attribute scratch ("buf", name) sums a
    thread a row and stages the rows' sums in that shared block; with a fourth source X2 and
    attributes second ("buf", name) and second_scratch ("buf", name) it also forms X2's product
    with the same Z and exponentials into that fragment, in the same loop (one exponential an
    element for both: KDA's q ⋆ k beside k ⋆ k); with attribute slots "triangle" its threads take
    only the blocks' lower triangles (schedule_build.product_slots), else a thread a row. A VJP's
    product (eq ij,jk,ijk->ik or ij,ik,ijk->jk) with attribute slots "row_pairs" sums a thread a
    pair of rows, staged in its scratch block. A reduce with attribute batch (one count per reduction)
    exchanges that many of a thread's outputs across threads in one round of barriers."""
    op: str
    dst: str | None
    srcs: tuple = ()
    attrs: tuple = ()

    @property
    def attr(self) -> dict:
        return dict(self.attrs)

    def reads(self) -> set:
        """The buffers it reads: its sources and every buffer its expression names."""
        names = set(self.srcs)

        def walk(e):
            if isinstance(e, tuple):
                if len(e) >= 2 and e[0] == "buf":
                    names.add(e[1])
                for x in e:
                    walk(x)
        for _, v in self.attrs:
            walk(v)
        return names

    def writes(self) -> set:
        """The buffers it writes: its destination, a reduction's accumulators, and a paired decayed
        product's second result and scratch."""
        second = {self.attr[k][1] for k in ("second", "second_scratch") if k in self.attr} \
            if self.op == "decayed_product" else set()
        return ({self.dst} if self.dst else set()) | (set(self.srcs[1:]) if self.op == "reduce" else set()) | second

    def renamed(self, names: dict) -> "Stmt":
        """The statement with buffers renamed (old -> new), in its destination, sources and
        expression."""
        def walk(e):
            if isinstance(e, tuple):
                if len(e) >= 2 and e[0] == "buf" and e[1] in names:
                    return (e[0], names[e[1]], *e[2:])
                return tuple(walk(x) for x in e)
            return e
        return Stmt(self.op, names.get(self.dst, self.dst), tuple(names.get(x, x) for x in self.srcs),
                    tuple((k, walk(v)) for k, v in self.attrs))

    def __str__(self) -> str:
        a = self.attr
        if self.op == "ewise":
            return f"{self.dst}[{','.join(a['index'])}] = {expr_str(a['expr'])}"
        if self.op == "wait":
            return f"wait {self.dst}" + ("   (free: passes for the ring's first chunks)" if a.get("free") else "")
        if self.op == "arrive":
            return f"arrive {self.dst}" + (f"   ({a['threads']} threads)" if a.get("threads") else "")
        if self.op == "fence_async":
            return "fence_async   (shared writes visible to wgmma and TMA)"
        if self.op == "gemm":
            ta, tb = ("ᵀ" if a.get("ta") else ""), ("ᵀ" if a.get("tb") else "")
            acc = "+=" if a.get("accumulate") else "="
            return f"{self.dst} {acc} {self.srcs[0]}{ta} · {self.srcs[1]}{tb}   (wgmma)"
        if self.op == "inverse":
            return (f"{self.dst} = inverse {self.srcs[0]}   (16-blocks by substitution in float32, "
                    f"merges of {a['tf32_from']}-blocks in tf32; built in {self.srcs[0]}'s place, which it overwrites)")
        if self.op == "decayed_product":
            x, z, g = self.srcs[:3]
            whole = "a thread a row" if a["eq"] == DECAYED_PRODUCT else "each element walking its block"
            slots = {"triangle": "the block's lower triangle in tiles of half its rows",
                     "row_pairs": "a thread the terms of rows r and B−1−r"}.get(a.get("slots"), whole)
            how = f"   ({slots}, the rows' sums staged in {a['scratch'][1]})" if a.get("scratch") else ""
            if a.get("second"):
                x2 = self.srcs[3] if len(self.srcs) > 3 else "(no X2)"
                return (f"{self.dst}, {a['second'][1]} = decayed_product[{a['eq']}, {a['exp']}, diagonal "
                        f"{a['block']}-blocks] {x} {z} {g} and {x2} {z} {g}   (one exponential for both; "
                        f"{slots}, the rows' sums staged in {a['scratch'][1]} and {a['second_scratch'][1]})")
            return (f"{self.dst} = decayed_product[{a['eq']}, {a['exp']}, diagonal {a['block']}-blocks] "
                    f"{x} {z} {g}{how}")
        extra = " ".join(f"{k}={v}" for k, v in a.items())
        return f"{self.dst} = {self.op} {' '.join(self.srcs)} {extra}".rstrip()


# the grids a kernel can run over (each sorted): one CTA per (chunk slot, value head), or per
# (chunk slot, key block, value head) where the kernel's K-wide values are its block of K's
# columns (Kernel.key_block), or per (V-block, value head, sequence) walking the sequence
GRID_AXES = (("chunk_slot", "value_head"), ("chunk_slot", "key_block", "value_head"),
             ("sequence", "v_block", "value_head"))
# the widths of key blocks a kernel may run on (Kernel.key_block): wgmma tiles and whole warps' columns
KEY_BLOCK_WIDTHS = (32, 64)
# the tensors a schedule gives its kernels beside the spec's inputs and the values crossing memory
# (named `<node>_rows` and `<node>_chunks`): the sequence layout, the states, the output, the token
# step's pools and slots. A spec's input of one of these names would be a second parameter of the
# same name (qla_compiler/spec.py refuses them; Kernel.verify refuses any repeated parameter).
SCHEDULE_TENSORS = frozenset({
    "cu_seqlens", "chunk_map", "chunk_offsets", "skip_chunks", "initial_state", "final_state", "o",
    "state_pool", "state_out", "read_slot", "write_slot", "final_slot"})
CROSSING_SUFFIXES = ("_rows", "_chunks")


@dataclass
class Kernel:
    name: str
    # ((axis, extent), ...), the first axis the fastest-varying (blockIdx.x: CTAs adjacent in it
    # run together and share what they read through L2); axes from GRID_AXES
    grid: tuple
    threads: int | str  # a number, or the shape-class constant that sets it (SCAN_THREADS, TOKEN_THREADS)
    params: list
    buffers: list
    prologue: list
    body: list  # inside the loop over chunks (the loop is None for one-chunk kernels)
    epilogue: list
    loop: str | None = None  # "chunks of the sequence" for the scan
    reverse: bool = False  # the loop runs from the last chunk to the first (a backward scan)
    # a scan: the int32 [N, HV] parameter holding how many chunks each (sequence, value head) walk
    # leaves out at its start, in walk order (context parallelism's windows, passes/walk_skip.py);
    # "" where every walk takes every chunk of its sequence
    walk_skip: str = ""
    max_stages: int = 0  # a scan: the most buffers per load its shared memory holds (0: no loop)
    roles: tuple = ()  # warpgroup roles, as lowered (descriptions; see warp_roles)
    doc: str = ""
    kind: str = ""  # "prep" | "scan" | "out": its place in the partition; "token_step": a decode kernel
    nodes: tuple = ()  # the ChunkIR nodes it evaluates (loaded ones included)
    outputs: tuple = ()  # for an out kernel: the chunk program's output roles it writes
    # a warp-specialised kernel (kind "fused"): its roles, each with its own statements (the
    # kernel's prologue, body and epilogue are then empty), and the barriers between them
    warp_roles: tuple = ()
    barriers: tuple = ()
    # a parallel kernel: the most shared memory its live buffers take at once, in bytes, at the
    # KernelIR's head-dim tiles (what the schedule budgets; 0 where it budgets otherwise)
    shared_peak: int = 0
    # a parallel kernel: the shared memory it asks at launch, its blocks placed where each first
    # fits through its life (schedule_memory.packed_shared; more than shared_peak where a wide
    # block finds no gap as wide; 0 where the schedule budgets otherwise)
    shared_packed: int = 0
    # a parallel kernel: the CTAs an SM is to hold at once, asked of ptxas as launch bounds (each
    # thread's registers then fit 64K / (threads · ctas_per_sm)); 0 where ptxas chooses alone
    ctas_per_sm: int = 0
    # a parallel kernel: the registers a thread's live fragments take at once, at their peak (what
    # the schedule budgets; past ~224 of a thread's 255, ptxas spills to local memory)
    fragment_peak: int = 0
    # a token step: what a padding entry of the batch (read_slot −2, which reads and writes no
    # state) runs for each of its tokens instead: its outputs' zeros, which nothing else writes
    padding: tuple = ()
    # a parallel kernel on blocks of K's columns (grid axis key_block, extent K/BK): each CTA
    # computes its outputs' columns [k0, k0 + BK), k0 = key_block · BK, from those columns of the
    # K-wide tensors and those rows of the per-chunk states; its buffers' K-wide dims are "BK".
    # BK is this width, or K's tile where that is narrower. 0: the whole of K
    key_block: int = 0
    # the tensors the kernels before it made whose values are dead once it has run: read by no
    # later kernel and no result. The runtime drops them after its launch, so their memory serves
    # what runs after it (passes/release_memory.py)
    releases: tuple = ()

    def buffer(self, name: str) -> Buffer:
        return next(b for b in self.buffers if b.name == name)

    @property
    def walks_chunks(self) -> bool:
        """A scan: a CTA walks one sequence's chunks in order (the loop), where every other kernel
        of a chunk program is parallel over chunks; a token step's loop walks tokens instead."""
        return self.loop is not None and self.kind != "token_step"

    def verify(self) -> None:
        """What the lowering relies on (ValueError naming what breaks it): only 2-D shared blocks
        pad their rows; a warp-specialised kernel's roles are whole warpgroups, in order, covering
        its threads; their register budgets are setmaxnreg's (multiples of 8 in [24, 256]) and fit
        the SM; every wait and arrival names a barrier; every ring has an owner among the roles; a
        decayed product's scratch is a float32 shared block of the kernel; a chunk state's load
        converts its dtype only where marked cast, and then synchronously (TMA copies bytes)."""
        if any(s.op in ("load_token", "load_slot") for s in self.prologue + self.body) and self.kind != "token_step":
            raise ValueError(f"{self.name}: loads a token's row, and only a token step walks tokens")
        if self.kind == "token_step":
            slots = {b.name for b in self.buffers if (b.shape, b.dtype, b.scope) == (("1",), "int32", "fragment")}
            by_name = {p.name: p for p in self.params}
            for st in (*self.prologue, *self.body, *self.epilogue):
                if st.op == "store_state" and st.attr.get("slot") not in slots:
                    raise ValueError(f"{self.name}: `{st}` takes its slot from no int32 [1] fragment (a load_slot's)")
                src = by_name.get(st.srcs[0]) if st.op == "load_slot" else None
                if st.op == "load_slot" and (src is None or src.dtype != "int32" or src.shape[0] != "N"
                                             or len(src.shape) > 2 or st.dst not in slots):
                    raise ValueError(f"{self.name}: `{st}` loads a slot from no int32 [N] or [N, L] input into "
                                     "an int32 [1] fragment")
        tensors, blocks = {p.name: p for p in self.params}, {b.name: b for b in self.buffers}
        if len(tensors) < len(self.params):  # (the lowering would bind one name to two arguments)
            twice = sorted({p.name for p in self.params if sum(q.name == p.name for q in self.params) > 1})
            raise ValueError(f"{self.name}: the parameter{'s' if len(twice) > 1 else ''} {', '.join(twice)} "
                             "appear twice (a spec input named like a tensor the schedule adds?)")
        if set(tensors) & set(blocks):  # (one name in the generated kernel: the block would shadow the tensor)
            raise ValueError(f"{self.name}: {', '.join(sorted(set(tensors) & set(blocks)))} names both a tensor "
                             "and a block of the kernel")
        for st in self.body:
            if st.op == "load_chunk_state" and st.srcs[0] in tensors and st.dst in blocks:
                converts = tensors[st.srcs[0]].dtype != blocks[st.dst].dtype
                if converts != bool(st.attr.get("cast")) or (converts and st.attr.get("async")):
                    raise ValueError(f"{self.name}: `{st}` loads {tensors[st.srcs[0]].dtype} into "
                                     f"{blocks[st.dst].dtype}: a load that converts is marked cast, and is not async")
        axes = tuple(sorted(a for a, _ in self.grid))
        if axes not in GRID_AXES:
            raise ValueError(f"{self.name}: grid over {', '.join(a for a, _ in self.grid)}; a kernel runs over "
                             + " or ".join("(" + ", ".join(g) + ")" for g in GRID_AXES) + ", in any order")
        blocked = "key_block" in axes
        dims = {d for b in self.buffers for d in b.shape}
        if blocked != bool(self.key_block) or (self.key_block and self.key_block not in KEY_BLOCK_WIDTHS):
            widths = " or ".join(map(str, KEY_BLOCK_WIDTHS))
            raise ValueError(f"{self.name}: key blocks of {self.key_block} over a grid of {', '.join(axes)}: a kernel "
                             f"on key blocks has the axis key_block and a width of {widths}")
        if ("K" if blocked else "BK") in dims:
            raise ValueError(f"{self.name}: a buffer {'K' if blocked else 'BK'} wide in a kernel "
                             f"{'on' if blocked else 'not on'} key blocks: its K-wide buffers are "
                             f"{'BK' if blocked else 'K'} wide")
        if blocked and any(p.role == "out" and "K" not in p.shape for p in self.params):
            raise ValueError(f"{self.name}: on key blocks, every output is K-wide (each block writes its columns; a "
                             "K-free output would be written by every block)")
        if self.walk_skip:
            p = next((p for p in self.params if p.name == self.walk_skip), None)
            if not self.loop or p is None or (p.shape, p.dtype, p.role) != (("N", "HV"), "int32", "in"):
                raise ValueError(f"{self.name}: walks skipping chunks by {self.walk_skip!r} need a loop over chunks "
                                 "and an int32 [N, HV] input of that name")
        for p in self.params:
            if p.zero_columns and (p.role != "in" or len(p.shape) != 4 or p.shape[0] != "1"
                                   or p.zero_columns == p.shape[-1]):
                raise ValueError(f"{self.name}: {p.name} reads {p.zero_columns} zero columns: only an input of "
                                 "tokens [1, T, heads, D] can (its blocks loaded whole, by TMA)")
        if self.ctas_per_sm and (self.loop or self.warp_roles or self.kind == "token_step"
                                 or not isinstance(self.threads, int) or not 0 < self.ctas_per_sm <= 32
                                 or self.ctas_per_sm * self.threads > 2048):
            raise ValueError(f"{self.name}: {self.ctas_per_sm} CTAs an SM asked of a kernel of {self.threads} threads"
                             f"{' with a loop over chunks' if self.loop or self.warp_roles else ''}: only a parallel "
                             "kernel over chunk slots of a fixed thread count asks, for 1–32 CTAs and at most 2048 "
                             "threads an SM")
        for p in self.params:
            if p.reuses and (why := self.cannot_reuse(p, tensors.get(p.reuses))):
                raise ValueError(f"{self.name}: {p.name} takes {p.reuses}'s memory, but {why}")
        shared = {b.name for b in self.buffers if b.scope == "shared" and b.dtype == "float32"}
        for st in (*self.prologue, *self.body, *self.epilogue):
            if st.op == "decayed_product" and any(st.attr.get(k) and st.attr[k][1] not in shared
                                                   for k in ("scratch", "second_scratch")):
                raise ValueError(f"{self.name}: `{st}` stages its sums in no float32 shared block of the kernel")
            if st.op == "decayed_product" and "slots" in st.attr and st.attr["slots"] != (
                    "triangle" if st.attr["eq"] == DECAYED_PRODUCT else "row_pairs" if st.attr.get("scratch") else None):
                raise ValueError(f"{self.name}: `{st}`: slots {st.attr['slots']!r}; a decayed product's threads take "
                                 "whole blocks (no attribute), a C×C product's the blocks' triangles (\"triangle\"), "
                                 "a VJP's product staged in a scratch block row pairs (\"row_pairs\")")
            if st.op == "decayed_product" and bool(st.attr.get("second")) != (len(st.srcs) == 4) \
                    or st.attr.get("second") and not st.attr.get("second_scratch"):
                raise ValueError(f"{self.name}: `{st}`: a second product takes a fourth source, a second result "
                                 "and a second scratch block")
            if st.op == "reduce" and "batch" in st.attr and (
                    len(st.attr["batch"]) != len(st.attr["dims"])
                    or not all(isinstance(n, int) and n >= 1 for n in st.attr["batch"])):
                raise ValueError(f"{self.name}: `{st}`: a reduce's batch is a positive count per reduction "
                                 f"(its dims {st.attr['dims']})")
        for b in self.buffers:
            if b.warp_columns and (b.scope != "fragment" or len(b.shape) != 2
                                   or b.warp_columns not in WARP_COLUMN_COUNTS):
                raise ValueError(f"{self.name}: {b.name} deals {b.warp_columns} columns a warp: only a 2-D "
                                 f"fragment's columns are dealt to warps, {', '.join(map(str, WARP_COLUMN_COUNTS))} each")
            if b.row_pad and (b.scope != "shared" or len(b.shape) != 2 or b.row_pad < 0):
                raise ValueError(f"{self.name}: {b.name} pads its rows by {b.row_pad}: only a 2-D shared block's rows are padded")
        if not self.warp_roles:
            return
        at = 0
        for r in self.warp_roles:
            if r.first != at or r.threads % 128:
                raise ValueError(f"{self.name}: role {r.name} has threads [{r.first}, {r.first + r.threads}); "
                                 f"roles are whole warpgroups, in order, from thread {at}")
            if r.registers % 8 or not 24 <= r.registers <= 256:
                raise ValueError(f"{self.name}: role {r.name}: {r.registers} registers is not a setmaxnreg "
                                 "budget (a multiple of 8 in [24, 256])")
            at += r.threads
        if at != self.threads:
            raise ValueError(f"{self.name}: the roles cover {at} threads of {self.threads}")
        pool = int(self.threads) * entry_registers(int(self.threads))
        if sum(r.threads * r.registers for r in self.warp_roles) > pool:
            raise ValueError(f"{self.name}: the roles' register budgets exceed the CTA's pool of {pool} registers "
                             f"({self.threads} threads × {entry_registers(int(self.threads))}): setmaxnreg would wait forever")
        names = {b.name for b in self.barriers}
        for r in self.warp_roles:
            for st in (*r.prologue, *r.body, *r.epilogue):
                if st.op in ("wait", "arrive") and st.dst not in names:
                    raise ValueError(f"{self.name}: role {r.name}: `{st}` names no barrier of the kernel")
        roles = {r.name for r in self.warp_roles}
        by_name = {b.name: b for b in self.buffers}
        for b in self.buffers:
            if b.stages > 1 and b.owner not in roles:
                raise ValueError(f"{self.name}: the ring {b.name} has no owning role ({b.owner!r})")
            host = by_name.get(b.shares) if b.shares else None
            if b.shares and (host is None or host.shares or (host.shape, host.dtype, host.scope, host.stages, host.owner)
                             != (b.shape, b.dtype, b.scope, 1, b.owner) or b.stages != 1):
                raise ValueError(f"{self.name}: {b.name} shares {b.shares}'s memory, which is not a single buffer "
                                 "of its shape, dtype and scope written by the same role (the roles' statements "
                                 "interleave)")

    def cannot_reuse(self, out: Tensor, given: Tensor | None) -> str:
        """Why the output `out` cannot take the memory of this kernel's input `given` ("" where it can):
        the kernel's CTAs each own a chunk's rows of one value head (a parallel kernel, or a scan
        whose CTA walks one sequence's chunks of one value head and V-block; not on key blocks, not
        warp-specialised by roles of its own), the two are alike, and the one load of `given` (and
        its wait, where async) comes before every store of `out`, in one statement list: a scan's
        body, which loads and stores each chunk's rows in its own iteration (its pipeline's loads
        ahead are of later chunks' rows). A scan runs more than once a call under context
        parallelism, each pass reading its inputs anew: the runtime hands a scan the memory only
        where it runs once (kernels/forward.launch)."""
        if given is None or given.role != "in":
            return "that is no input of the kernel"
        if self.warp_roles or self.key_block or self.kind == "token_step":
            return "only a parallel kernel or a scan, not on key blocks or warp roles, owns each block's rows"
        if (out.shape, out.dtype) != (given.shape, given.dtype) or given.zero_columns or given.result:
            return "the two differ in shape or dtype (or the input reads zero columns, or is a result)"
        if "HV" not in out.shape or len(out.shape) != 4 or out.shape[:2] != ("1", "T"):
            return "only tokens' rows of one value head, [1, T, HV, D], are each one CTA's"
        stmts = list(self.body) if self.loop else [*self.prologue, *self.body, *self.epilogue]
        if self.loop and any(given.name in st.srcs or st.dst == out.name for st in (*self.prologue, *self.epilogue)):
            return f"the scan reads {given.name} or stores {out.name} outside its loop over chunks"
        loads = [i for i, st in enumerate(stmts) if given.name in st.srcs and st.op.startswith("load")]
        stores = [i for i, st in enumerate(stmts) if st.dst == out.name]
        if len(loads) != 1 or stmts[loads[0]].op != "load":
            return f"{given.name} is read by {len(loads)} loads (the rule allows one load of whole blocks)"
        load = stmts[loads[0]]
        ready = next((i for i, st in enumerate(stmts) if st.op == "wait_load" and st.dst == load.dst),
                     loads[0]) if load.attr.get("async") else loads[0]
        if not stores or min(stores) < ready:
            return f"{out.name} is stored before {given.name}'s rows are read"
        return ""

    def __str__(self) -> str:
        grid = ", ".join(f"{a}:{e}" for a, e in self.grid)
        peak = f"  shared ≤ {self.shared_peak / 1024:.0f} KB" if self.shared_peak else ""
        if self.shared_packed > self.shared_peak + 8 * 1024:  # (alignment alone adds a few KB)
            peak += f" ({self.shared_packed / 1024:.0f} KB as placed)"
        peak += f"  {self.ctas_per_sm} CTAs an SM" if self.ctas_per_sm else ""
        peak += f"  fragments ≤ {self.fragment_peak} registers a thread" if self.fragment_peak else ""
        peak += f"  key blocks BK = {self.key_block}" if self.key_block else ""
        lines = [f"kernel {self.name}  grid({grid})  threads {self.threads}{peak}  # {self.doc}"]
        for p in self.params:
            lines.append(f"  {p.role:<3} {p.name}: {p.dtype}[{', '.join(map(str, p.shape))}]"
                         + (" padded" if p.padded else "")
                         + (f" (its first {p.zero_columns} columns zeros, not in memory)" if p.zero_columns else "")
                         + (f"   # {p.doc}" if p.doc else "")
                         + (("; " if p.doc else "   # ") + f"the result {p.result}" if p.result else "")
                         + (f"   (in {p.reuses}'s memory)" if p.reuses else ""))
        if self.releases:
            lines.append(f"  then released: {', '.join(self.releases)}   # dead: read by no later kernel")
        for b in self.buffers:
            ring = f" ×{b.stages} stages" if b.stages > 1 else ""
            owner = f"  (written by {b.owner})" if b.owner else ""
            shares = f"  (in {b.shares}'s memory)" if b.shares else ""
            pad = f"  (rows padded by {b.row_pad})" if b.row_pad else ""
            pad += f"  ({b.warp_columns} columns a warp, all their rows)" if b.warp_columns else ""
            lines.append(f"  {b.scope:<8} {b.name}: {b.dtype}[{'×'.join(b.shape)}]{ring}{owner}{shares}{pad}")
        lines += [f"  {b}" for b in self.barriers]
        skip = (f", past the first {self.walk_skip}[sequence, value head] of its walk" if self.walk_skip else "")
        if self.warp_roles:
            lines.append(f"  for chunk in {self.loop}{skip}, every role:")
            for r in self.warp_roles:
                lines += ["  " + ln for ln in str(r).splitlines()]
            return "\n".join(lines)
        for r in self.roles:
            lines.append(f"  role     {r}")
        lines += [f"  {s}" for s in self.prologue]
        if self.loop and self.kind == "token_step":
            lines.append(f"  for token in {self.loop}:")
            lines += [f"    {s}" for s in self.body]
        elif self.loop:
            lines.append(f"  for chunk in {self.loop}{skip} (pipelined: STAGES buffers per load, from the shape class, "
                         f"at most {self.max_stages}):")
            lines += [f"    {s}" for s in self.body]
        else:
            lines += [f"  {s}" for s in self.body]
        lines += [f"  {s}" for s in self.epilogue]
        if self.padding:
            lines.append(f"  a padding entry instead of all above, for token in {self.loop}:")
            lines += [f"    {s}" for s in self.padding]
        return "\n".join(lines)


@dataclass
class KernelIR:
    name: str
    chunk_size: int
    kernels: list = field(default_factory=list)
    host: list = field(default_factory=list)  # host-side steps, in order (no synchronisation)
    consts: dict = field(default_factory=dict)  # values baked into the kernels (e.g. head constants)
    # the largest head-dim tiles (K, V) its shared memory and registers are budgeted for: a shape
    # class with wider tiles needs kernels scheduled for them (Program.for_shape)
    head_dims: tuple = (128, 128)
    # the widest V-block its kernels are budgeted for: a launch takes no wider one (the fused
    # forward's load ring is budgeted at 64, or at 32 where 64 would leave it under 3 deep)
    block_v_max: int = 64
    # the kernels whose live shared memory exceeds the schedule's budget at those tiles (one output's
    # blocks alone are too many), or whose blocks as placed exceed what a CTA may ask: no launch can
    # run them, so a caller takes V in narrower column blocks where the program allows it
    # (Program.backward_columns)
    over_budget: tuple = ()
    # the kernels whose live fragments at their peak exceed a thread's registers (Kernel.fragment_peak
    # over the schedule's budget, at the most threads it gives a parallel kernel): ptxas spills
    # them to local memory, which the kernel's time shows (KDA's backward out kernels, session 27)
    over_registers: tuple = ()

    @property
    def scan(self) -> int | None:
        """The index of the kernel that walks each sequence's chunks in order (its `loop`; a token
        step walks tokens): the runtime launches the kernels before it, it, then those after it,
        and launches it per segment where context parallelism cuts sequences. None where no kernel
        walks chunks (a token-step program)."""
        walks = [i for i, k in enumerate(self.kernels) if k.walks_chunks]
        return walks[0] if walks else None

    def results(self) -> dict:
        """The chunk program's output role -> the tensor of the kernel that writes it (Tensor.result)."""
        return {p.result: p.name for k in self.kernels for p in k.params if p.result and p.role == "out"}

    def verify(self) -> None:
        """Every kernel's verify, and at most one kernel walking chunks (ValueError naming the
        kernel and what breaks it)."""
        for k in self.kernels:
            k.verify()
        for i, k in enumerate(self.kernels):
            for p in k.params:
                if p.reuses and (why := self.live_after(i, p.reuses)):
                    raise ValueError(f"{self.name}: {k.name}'s {p.name} takes {p.reuses}'s memory, but {why}")
            reads = {p.name for p in k.params if p.role == "in"}
            for name in k.releases:
                if why := ("it is no input of the kernel" if name not in reads else self.live_after(i, name)):
                    raise ValueError(f"{self.name}: {k.name} releases {name}, but {why}")
        walks = [k.name for k in self.kernels if k.walks_chunks]
        if len(walks) > 1:
            raise ValueError(f"{self.name}: {', '.join(walks)} each walk a sequence's chunks; a program has one scan")

    def live_after(self, i: int, name: str) -> str:
        """Why the value of `name` is still needed once kernel i has run ("" where it is dead, so its
        memory may be written over (Tensor.reuses) or released (Kernel.releases)): it is dead where
        an earlier kernel makes it, no later kernel reads it and it is no result."""
        made = [p for k in self.kernels[:i] for p in k.params if p.name == name and p.role == "out"]
        if not made:
            return f"no earlier kernel makes {name} (the caller's tensors are not the program's)"
        if any(p.result for p in made):
            return f"{name} is a result (the caller reads it)"
        if later := [k.name for k in self.kernels[i + 1:] if any(p.name == name for p in k.params)]:
            return f"{', '.join(later)} read{'s' if len(later) == 1 else ''} it later"
        return ""

    def __str__(self) -> str:
        head = [f"kernel_program {self.name}  C={self.chunk_size}  head-dim tiles up to K={self.head_dims[0]} "
                f"V={self.head_dims[1]}  V-blocks up to {self.block_v_max}"]
        if self.over_budget:
            head.append(f"  over the shared-memory budget at these tiles: {', '.join(self.over_budget)}")
        if self.over_registers:
            head.append(f"  live fragments over the registers (spilled): {', '.join(self.over_registers)}")
        head += [f"  host: {h}" for h in self.host]
        return "\n".join(head + [""] + [str(k) + "\n" for k in self.kernels]).rstrip()

    def _repr_html_(self) -> str:
        return rich_html(self, "kernel_draw")
