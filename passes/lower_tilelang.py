"""lower: KernelIR + ShapeClass → TileLang source, one readable Python module per kernel program.

Each statement kind has one template; element-wise expressions render from their trees. The
module names its buffers after the math (`state`, `v_new`, `T_r_s`) and bakes the shape class
(head counts, head dims, V-block, io dtype, scale) in as constants at the top. The decayed
products' templates live in lower_products.py (mixed into the renderer here).

    >>> src = lower(kernel_ir, ShapeClass(H=2, HV=8, K=128, V=128, BV=64))   # doctest: +SKIP
    >>> print(src)                                                             # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass

from qla_compiler.errors import PassError
from qla_compiler.ir.chunk_ops import DECAYED_PRODUCT
from qla_compiler.ir.kernel import Kernel, KernelIR, Stmt, format_expr
from qla_compiler.kernels.tri_inverse_scratch import SCRATCH as INVERSE_SCRATCH, TF32_FROM as INVERSE_TF32_FROM

from .lower_products import CHUNK_SIZE, ProductTemplates


IO_DTYPES = ("bfloat16", "float16")
HEAD_DIM_RANGE = (16, 256)  # K and V the kernels take, each on its own


def tile_width(d: int) -> int:
    """The tile a head dim runs in: the next power of two, at least 64 (a head dim is a wgmma's M
    in some products, e.g. the state update Kᵀ·V, and a warpgroup's M is 64: TileLang found no
    warp partition for M = 16). The op's tensors are loaded and stored masked where the tile is
    wider; what only kernels read and write is allocated at the tile's width (`Tensor.padded`),
    and its padding holds zeros.

    >>> tile_width(64), tile_width(100), tile_width(60), tile_width(16), tile_width(256)
    (64, 128, 64, 64, 256)
    """
    return max(64, 1 << (d - 1).bit_length())


def check_head_dim(name: str, d: int) -> None:
    lo, hi = HEAD_DIM_RANGE
    if not lo <= d <= hi:
        raise ValueError(f"{name} = {d} is not supported by the sm90 kernels: they take {lo} to {hi} "
                         "(float32 inputs and CPU tensors run the interpreter for any size)")


TILELANG = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "neg": "(-{0})",
    "exp": "T.exp({0})", "exp2": "T.exp2({0})", "max": "T.max({0}, {1})",
    "above": "T.if_then_else({0} > {1}, 1.0, 0.0)",
    "select_lower": "T.if_then_else({j} <= {i}, {a}, {b})", "select_strict": "T.if_then_else({j} < {i}, {a}, {b})",
    "select_valid": "T.if_then_else({i} < n_valid, {a}, {b})",
    "select_last": "T.if_then_else({i} == n_valid - 1, {a}, {b})",
    "select_rows": "T.if_then_else({lo} <= {i}, T.if_then_else({i} < {hi}, {a}, {b}), {b})",
    "min_pos": 'T.cast(T.min({i} + 1, n_valid), "float32")',
}


# Tensor dtypes named for a ShapeClass field that each call picks: the token step reads its gates
# ("gates") and its scalars ("scalars") each in float32 or in the io dtype, as the call passes them
PER_CALL_DTYPES = ("gates", "scalars")


@dataclass(frozen=True)
class ShapeClass:
    """What a compiled kernel is specialised for (the runtime's cache key, with the spec)."""
    H: int
    HV: int
    K: int
    V: int
    BV: int = 64
    io: str = "bfloat16"
    scale: float | None = None
    stages: int = 1
    # consumer warpgroups of the forward scan (its kernel's threads: SCAN_THREADS = 128 × this); the
    # runtime chooses (kernels/forward.scan_warpgroups)
    scan_warpgroups: int = 1
    # the dtype of the state pools the token step reads and writes (float32 or the io dtype)
    state: str = "float32"
    # the dtypes the token step reads its per-token gates and its scalars in (each float32 or the io
    # dtype: PER_CALL_DTYPES)
    gates: str = "float32"
    scalars: str = "float32"

    def __post_init__(self):
        # (the op checks its head dims, kernels/forward.check_head_dims: context parallelism's
        # scan runs on values widened past them)
        if self.BV not in (8, 16, 32, 64, 128) or self.VP % self.BV:
            raise ValueError(f"BV={self.BV}: the V-block must be 8 (the token step's), 16, 32, 64 or 128 (the wide "
                             "fused kernel's) and "
                             f"divide V's tile {self.VP}")
        if self.state not in ("float32", *IO_DTYPES):
            raise ValueError(f"state={self.state!r}: a state pool is float32, bfloat16 or float16")
        for kind in PER_CALL_DTYPES:
            if getattr(self, kind) not in ("float32", self.io):
                raise ValueError(f"{kind}={getattr(self, kind)!r}: the token step reads its {kind} in float32 or "
                                 f"the io dtype {self.io}")
        if self.scan_warpgroups not in (1, 2) or (self.scan_warpgroups == 2 and self.BV < 32):
            raise ValueError(f"scan_warpgroups={self.scan_warpgroups} at BV={self.BV}: one warpgroup, or two "
                             "where BV ≥ 32 (they split the columns of W·S; 8 each is not a wgmma layout "
                             "TileLang lowers)")

    @property
    def KP(self) -> int:
        """K's tile (tile_width)."""
        return tile_width(self.K)

    @property
    def VP(self) -> int:
        """V's tile (tile_width)."""
        return tile_width(self.V)

    @property
    def padded(self) -> dict:
        """The head dims whose tile is wider than the op's, by name -> the tile's constant."""
        return {d: f"{d}P" for d, n, t in (("K", self.K, self.KP), ("V", self.V, self.VP)) if n != t}

    @property
    def G(self) -> int:
        return self.HV // self.H

    @property
    def scale_value(self) -> float:
        return self.K ** -0.5 if self.scale is None else float(self.scale)


def _dtype(d: str) -> str:
    return {"io": "IO", "float32": '"float32"', "int32": '"int32"', "tfloat32": "T.tfloat32", "state": "STATE",
            "gates": "GATES", "scalars": "SCALARS"}[d]


def _shape(shape, tiles: dict | None = None) -> str:
    shape = [(tiles or {}).get(d, d) for d in shape]
    return "(" + ", ".join(shape) + ("," if len(shape) == 1 else "") + ")"


class _Render(ProductTemplates):
    def __init__(self, kernel: Kernel, shape: ShapeClass):
        self.k = kernel
        self.shape = shape
        self.dtype = {b.name: b.dtype for b in kernel.buffers}
        self.tiles = shape.padded  # head dim -> its tile's constant, where they differ
        if kernel.key_block:  # and the key block's: its kernel's own (_key_block_constant)
            self.tiles["BK"] = _key_block_constant(kernel.key_block)
        self.params = {p.name: p for p in kernel.params}
        self.aliases = {}  # a private copy's name -> the buffer it copies (lower_kernel)
        self.sync_stores = False  # whole-block stores wait for their reads (see _bulk_store)
        # blocks of the op's own tensors where the tile is wider: loaded masked, so no barrier
        self.masked_loads = {st.dst for st in kernel.prologue + kernel.body + kernel.epilogue
                             if st.op == "load" and self._masked(st.srcs[0])}

    def _masked(self, name: str) -> str | None:
        """The head dim of the op's tensor `name` whose tile is wider (its blocks load and store
        masked), else None."""
        p = self.params.get(name)
        if p is None or p.padded or p.shape[-1] not in self.tiles:
            return None
        return p.shape[-1]

    def _col_ok(self, name: str, scan: bool) -> str:
        """The condition that column j of a block of `name` lies inside the op's head dim."""
        d = self._masked(name)
        _, start, _ = self._columns(name, scan)
        return f"{start} + j < {d}" if start != "0" else f"j < {d}"

    def expr(self, e) -> str:
        try:
            return format_expr(e, TILELANG, self._leaf)
        except ValueError as err:
            raise PassError("lower", f"no template for expression: {err}") from None

    def _leaf(self, e) -> str:
        tag = e[0]
        if tag == "buf":
            ref = f"{e[1]}[{', '.join(e[2:])}]" if len(e) > 2 else e[1]
            return f'T.cast({ref}, "float32")' if self.dtype.get(e[1]) == "io" else ref
        if tag == "lit":
            return repr(float(e[1]))
        return e[1].upper() if tag == "param" else f"log_{e[1]}[i_hv]"

    def stmt(self, s: Stmt, scan: bool) -> list[str]:
        a = s.attr
        if s.op == "load" and s.dst in self.masked_loads:  # rows past the sequence, columns past the head dim
            if a.get("pad") == "hold":
                raise PassError("lower", f"{s}: a block holding its last row loads whole (no padded head-dim tile)")
            sync = ["T.sync_threads()  # nobody reads what this block's memory held before"] if a.get("sync") else []
            return sync + [f"for i, j in T.Parallel({self._buf_shape(s.dst)}):",
                           f"    {s.dst}[i, j] = T.if_then_else(i < n_valid and {self._col_ok(s.srcs[0], scan)}, "
                           f"{self._element(s.srcs[0], scan)}, T.cast(0, IO))"]
        if s.op in ("wait_load", "zero_pad") and s.dst in self.masked_loads:
            return []  # loaded whole and masked above
        if s.op == "load" and a.get("rows"):  # rows past the sequence belong to the next one: zeros
            if a.get("pad") == "hold":  # (or the last row again)
                return [f"for i, j in T.Parallel({self._buf_shape(s.dst)}):",
                        f"    {s.dst}[i, j] = {self._element(s.srcs[0], scan, row='T.min(i, T.max(n_valid - 1, 0))')}"]
            return [f"for i, j in T.Parallel({self._buf_shape(s.dst)}):",
                    f"    {s.dst}[i, j] = T.if_then_else(i < n_valid, {self._element(s.srcs[0], scan)}, "
                    f"{self._zero(s.dst)})"]
        if s.op in ("load", "load_chunk_state"):
            K, V = self.tiles.get("K", "K"), self.tiles.get("V", "V")  # (a per-chunk state is padded)
            # (a kernel on key blocks: its block's rows)
            rows = f"k0:k0 + {self.tiles['BK']}" if self.k.key_block else f"0:{K}"
            src = self._global(s.srcs[0], scan) if s.op == "load" else \
                f"{s.srcs[0]}[i_slot, i_hv, {rows}, {'v0:v0 + BV' if scan else f'0:{V}'}]"
            if not a.get("async"):
                return [f"T.copy({src}, {s.dst})"]
            # issued here, waited for at wait_load; after other work, the block's memory may be
            # what an earlier block used, and TileLang puts no barrier before a TMA write into it
            sync = ["T.sync_threads()  # nobody reads what this block's memory held before"] if a.get("sync") else []
            return sync + [f"T.tma_copy({src}, {s.dst}, barrier={s.dst}_bar[0], {ARRIVE})"]
        if s.op == "wait_load":
            return [f"T.mbarrier_wait_parity({s.dst}_bar[0], 0)"]
        if s.op == "load_vec":
            x = s.srcs[0]
            # (an unused chunk slot has n_valid = 0 and t0 = 0: it reads token 0)
            pad = f"{x}[0, t0 + T.max(n_valid - 1, 0), i_hv]" if a.get("pad") == "hold" else "0.0"
            return ["for i in T.Parallel(C):",
                    f"    {s.dst}[i] = T.if_then_else(i < n_valid, {x}[0, t0 + i, i_hv], {pad})"]
        if s.op == "zero_pad":
            # (holding: rows below n_valid are not written, so reading row n_valid − 1 races with nothing)
            pad = f"{s.dst}[T.max(n_valid - 1, 0), j]" if a.get("pad") == "hold" else self._zero(s.dst)
            loop = [f"for i, j in T.Parallel({self._buf_shape(s.dst)}):",
                    f"    {s.dst}[i, j] = T.if_then_else(i < n_valid, {s.dst}[i, j], {pad})"]
            if not a.get("only_partial"):
                return ["# the rows past the sequence belong to the next one"] + loop
            return ["if n_valid < C:  # the rows past the sequence belong to the next one"] + \
                [f"    {ln}" for ln in loop]
        if s.op == "copy":
            return [f"T.copy({s.srcs[0]}, {s.dst})"]
        if s.op == "gemm":
            return [f"T.gemm({s.srcs[0]}, {s.srcs[1]}, {s.dst}, transpose_A={bool(a.get('ta'))}, "
                    f"transpose_B={bool(a.get('tb'))}, clear_accum={not a.get('accumulate')})"]
        if s.op == "ewise":
            idx = a["index"]
            value = self.expr(a["expr"])
            if self.dtype[s.dst] in ("io", "tfloat32"):
                value = f"T.cast({value}, {_dtype(self.dtype[s.dst])})"
            return [f"for {', '.join(idx)} in T.Parallel({self._buf_shape(s.dst)}):",
                    f"    {s.dst}[{', '.join(idx)}] = {value}"]
        if s.op == "cumsum" and "," in self._buf_shape(s.dst):
            # a C×K block, per key: a thread a column walks the C rows (no barrier; C dependent adds)
            row = "C - 1 - i" if a.get("reverse") else "i"
            cols = self._buf_shape(s.dst).split(", ")[1]
            return [f"for j in T.Parallel({cols}):",
                    f"    {s.dst}_acc[j] = 0.0",
                    "for i in T.serial(C):",
                    f"    for j in T.Parallel({cols}):",
                    f"        {s.dst}_acc[j] += {s.srcs[0]}[{row}, j]",
                    f"        {s.dst}[{row}, j] = {s.dst}_acc[j]"]
        if s.op == "decayed_product":
            exp = {"exp": "T.exp", "exp2": "T.exp2"}[a["exp"]]
            if a["eq"] != DECAYED_PRODUCT:
                if a.get("slots") == "row_pairs":
                    return self._decayed_product_vjp_pairs(s, exp, scan)
                return self._decayed_product_vjp(s, exp)
            if a.get("slots") == "triangle":
                return self._decayed_product_triangle(s, exp, scan)
            return self._decayed_product_rows(s, exp, scan)
        if s.op == "cumsum":
            return self._vector_cumsum(s, scan)
        if s.op == "reduce":  # srcs: the fragment, then one accumulator per reduction, in order
            src, *accs = s.srcs
            out, prev = [], src
            for acc, dim, batch in zip(accs, a["dims"], a.get("batch", (1,) * len(accs))):
                # batch: the outputs a thread holds, exchanged in one round (schedule_reductions.py)
                out.append(f"T.reduce_sum({prev}, {acc}, dim={dim}" + (f", batch={batch})" if batch > 1 else ")"))
                prev = acc
            return out + [f"T.copy({prev}, {s.dst})"]
        if s.op == "inverse":
            if a["tf32_from"] != INVERSE_TF32_FROM:  # one building block, one method
                raise PassError("lower", f"{s}: kernels/tri_inverse.py's merges are tf32 from "
                                         f"{INVERSE_TF32_FROM}-blocks, not {a['tf32_from']}")
            if not isinstance(self.k.threads, int) or self.k.threads % 32:
                raise PassError("lower", f"{s}: the inverse's substitution runs one warp a block, "
                                         f"in a kernel of whole warps, not {self.k.threads} threads")
            a_s = s.srcs[0]
            scratch = ", ".join(f"{s.dst}_{suffix}" for suffix in INVERSE_SCRATCH)
            return [f"unit_lower_inverse({a_s}, {s.dst}, {scratch}, C, {self.k.threads // 32})"]
        if s.op == "store":
            src = s.srcs[0]
            dst_dtype = next(p.dtype for p in self.k.params if p.name == s.dst)
            value = f"{src}[i, j]" if self.dtype[src] == dst_dtype else f"T.cast({src}[i, j], {_dtype(dst_dtype)})"
            value = f"-{value}" if a.get("negate") else value
            cols = f" and {self._col_ok(s.dst, scan)}" if self._masked(s.dst) else ""
            masked = [f"for i, j in T.Parallel({self._buf_shape(src)}):",
                      f"    if i < n_valid{cols}:",
                      f"        {self._element(s.dst, scan)} = {value}"]
            # a float32 fragment: each thread stores its own elements (a negated block: negated on the way)
            if self.dtype[src] != "io" or cols or a.get("negate"):
                return masked
            return ["if n_valid == C:", f"    {self._bulk_store(scan)}({src}, {self._global(s.dst, scan)})",
                    "else:"] + [f"    {ln}" for ln in masked]
        if s.op == "store_vec":
            return ["for i in T.Parallel(C):",
                    "    if i < n_valid:",
                    f"        {s.dst}[0, t0 + i, i_hv] = {s.srcs[0]}[i]"]
        if s.op == "store_chunk_state":
            K = self.tiles.get("K", "K")
            # (a float32 state from its fragment: each thread writes its own elements)
            store = "T.copy" if self.dtype[s.srcs[0]] == "float32" else self._bulk_store(scan)
            return [f"{store}({s.srcs[0]}, {s.dst}[i_slot, i_hv, 0:{K}, v0:v0 + BV])"]
        if s.op in ("load_state", "store_state") and self.tiles:  # the op's state, in a wider tile
            state, glob = (s.dst, s.srcs[0]) if s.op == "load_state" else (s.srcs[0], s.dst)
            inside = "i < K and v0 + j < V"
            if s.op == "load_state":
                return [f"for i, j in T.Parallel({self._buf_shape(state)}):",
                        f"    {state}[i, j] = T.if_then_else({inside}, {glob}[i_n, i_hv, i, v0 + j], 0.0)"]
            return [f"for i, j in T.Parallel({self._buf_shape(state)}):",
                    f"    if {inside}:",
                    f"        {glob}[i_n, i_hv, i, v0 + j] = {state}[i, j]"]
        if s.op == "load_state":
            return [f"T.copy({s.srcs[0]}[i_n, i_hv, 0:K, v0:v0 + BV], {s.dst})"]
        if s.op == "store_state":
            return [f"T.copy({s.srcs[0]}, {s.dst}[i_n, i_hv, 0:K, v0:v0 + BV])"]
        raise PassError("lower", f"no template for statement {s.op}")

    def _vector_cumsum(self, s: Stmt, scan: bool) -> list[str]:
        """The C prefix sums of a vector (suffix sums with `reverse`) by a scan of warp shuffles:
        five steps in each of the chunk's two warps, then the second adds the first's total. (Each
        thread summing its own prefix read C values from shared memory: the GDN prep 0.598 →
        0.573 ms at 16/64:8x4096 on the H200, prep_variants.py's cumsum_by_shuffles, session 24.)
        A reverse sum scans the vector from its end: thread t holds element C − 1 − t."""
        threads = self.k.threads
        if scan or self.k.warp_roles or CHUNK_SIZE != 64 or not isinstance(threads, int) or threads < CHUNK_SIZE:
            raise PassError("lower", f"{s}: the shuffle scan runs in a parallel kernel of at least C = 64 threads "
                                     "(two warps of the chunk's rows), not in a scan or a role")
        src, run = s.srcs[0], f"{s.dst}_run"
        at = (lambda t: f"C - 1 - {t}") if s.attr.get("reverse") else (lambda t: t)
        out = ["i_t = T.get_thread_binding()",
               f"{run} = T.alloc_local((1,), \"float32\")",
               f"{run}[0] = T.if_then_else(i_t < C, {src}[{at('i_t % C')}], 0.0)"]
        for d in (1, 2, 4, 8, 16):  # (every lane shuffles: a lane of the full mask may not sit out)
            out += [f"{run}_up = T.shfl_sync({run}[0], i_t % 32 - {d})",
                    f"{run}[0] = T.if_then_else(i_t % 32 >= {d}, {run}[0] + {run}_up, {run}[0])"]
        return out + ["if i_t < C:",
                      f"    {s.dst}[{at('i_t')}] = {run}[0]",
                      "T.sync_threads()",
                      "if i_t >= 32 and i_t < C:  # the second warp: plus the first's total",
                      f"    {s.dst}[{at('i_t')}] = {run}[0] + {s.dst}[{at('31')}]"]

    def _bulk_store(self, scan: bool) -> str:
        # In the scan a TMA store's wait for its shared source to be read sat on the sequential path,
        # once per store per chunk; there the store is only issued, and the next chunk waits (at
        # the top of its body, see SCAN_STORE_WAIT) before it overwrites the source block. (A
        # warp-specialised kernel's stores are off the chain: they wait, sync_stores.)
        return "T.tma_copy" if scan and not self.sync_stores else "T.copy"

    def bulk_stores(self) -> bool:
        """Whether the body stores whole io blocks (with _bulk_store: TMA copies in the scan)."""
        return any(s.op in ("store_chunk_state", "store") and self.dtype[s.srcs[0]] == "io" for s in self.k.body)

    def _buf_shape(self, name) -> str:
        name = self.aliases.get(name, name)
        return ", ".join(self.tiles.get(d, d) for d in next(b for b in self.k.buffers if b.name == name).shape)

    def _columns(self, name, scan: bool) -> tuple:
        """(head index, first column, width) of a per-token tensor [1, T, heads, D] in this
        kernel (the scan reads its V-block)."""
        p = self.params[name]
        head = "i_h" if p.shape[2] == "H" else "i_hv"
        width = self.tiles.get(p.shape[3], p.shape[3]) if p.padded else p.shape[3]
        if p.zero_columns and not (p.shape[3] == "V" and scan):
            raise PassError("lower", f"{p.name}: zero columns are read by the scans' V-blocks alone")
        start = f"v0 - {p.zero_columns}" if p.zero_columns else "v0"  # (TMA reads zeros before column 0)
        if p.shape[3] == "K" and self.k.key_block:
            return head, "k0", self.tiles["BK"]
        return (head, start, "BV") if (p.shape[3] == "V" and scan) else (head, "0", width)

    def _global(self, name, scan: bool) -> str:
        """The chunk's rows of a per-token tensor, as a slice."""
        head, start, width = self._columns(name, scan)
        cols = f"0:{width}" if start == "0" else f"{start}:{start} + {width}"
        return f"{name}[0, t0:t0 + C, {head}, {cols}]"

    def _element(self, name, scan: bool, row: str = "i") -> str:
        """Element (row, j) of the chunk's rows of a per-token tensor."""
        if self.params[name].zero_columns:  # an element load would read before column 0
            raise PassError("lower", f"{name}: a tensor with zero columns loads by whole blocks (TMA) only")
        head, start, _ = self._columns(name, scan)
        return f"{name}[0, t0 + {row}, {head}, {'j' if start == '0' else f'{start} + j'}]"

    def _zero(self, name) -> str:
        return "T.cast(0, IO)" if self.dtype[self.aliases.get(name, name)] == "io" else "0.0"


# scratch buffers a statement's template needs: suffix -> (scope, shape, dtype)
SCRATCH = {
    "inverse": {k: (b.scope, _shape(b.alloc_shape()), b.dtype) for k, b in INVERSE_SCRATCH.items()},
    # a C×K block's K running sums (a thread a column; a vector's sums are scanned in registers)
    "cumsum": {"acc": ("fragment", None, "float32")},
}

_DIMS = {"T": "Tok", "N": "N", "N+1": "NP1", "CH": "CH", "1": "1", "S": "Slots", "L": "L", "W": "Words"}


def _param(p, tiles: dict) -> str:
    name = p.name
    dims = [_DIMS.get(d, tiles.get(d, d) if p.padded else d) for d in p.shape]
    if p.zero_columns:  # (memory holds the columns after them)
        dims[-1] = f"{dims[-1]} - {p.zero_columns}"
    dims = ", ".join(dims)
    return f"{name}: T.Tensor(({dims}{',' if len(p.shape) == 1 else ''}), {_dtype(p.dtype)})"


def _signature(kernel: Kernel, r: _Render) -> list[str]:
    return ["@T.prim_func", f"def {kernel.name}("] + [f"    {_param(p, r.tiles)}," for p in kernel.params] + \
        ["):", f'    """{kernel.doc}"""']


_GRID_INDEX = {"chunk_slot": "i_slot", "value_head": "i_hv", "v_block": "i_v", "sequence": "i_n", "key_block": "i_kb"}


# the grid extent known only at launch that can pass the 65535 CTAs CUDA takes on grid axes y and
# z: the chunk slots. (The scans' and the token step's sequences are their grid's z: a call of
# more than 65535 sequences is refused, kernels/forward.check_grid.)
_DYNAMIC_EXTENTS = ("CH",)


def one_launch_axis(kernel: Kernel) -> bool:
    """Whether `kernel` launches as one axis of all its CTAs (_grid): where its chunk slots are
    not its grid's first axis. (Kernels on key blocks launch theirs on y as before, at most 65535
    of them: their one-axis launch has not run on a GPU yet, NOTES session 52.)"""
    return not kernel.key_block and any(e in _DYNAMIC_EXTENTS for _, e in kernel.grid[1:])


def _grid(kernel: Kernel, V: str, K: str = "K", BK: str = "BK") -> list[str]:
    """The kernel's launch, its grid's axes in the KernelIR's order (the first is blockIdx.x).
    Where the chunk slots are not the first axis (the value heads first, schedule_build's
    HEADS_FIRST), the grid is one axis of all its CTAs, each axis's index taken from it in that
    order: a packed batch of 4M tokens has 65536 chunk slots, past what blockIdx.y counts."""
    extents = [{"V/BV": f"{V} // BV", "K/BK": f"{K} // {BK}"}.get(e, e) for _, e in kernel.grid]
    names = [_GRID_INDEX[a] for a, _ in kernel.grid]
    if not one_launch_axis(kernel):
        return [f"    with T.Kernel({', '.join(extents)}, threads={kernel.threads}) as ({', '.join(names)}):"]
    out = [f"    with T.Kernel({' * '.join(f'({e})' if '/' in e else e for e in extents)}, "
           f"threads={kernel.threads}) as i_cta:",
           f"        # one launch axis: {kernel.grid[0][0]} fastest, then "
           + ", then ".join(a for a, _ in kernel.grid[1:])]
    below = []
    for i, (name, e) in enumerate(zip(names, extents)):
        at = f"i_cta // ({' * '.join(below)})" if below else "i_cta"
        out.append(f"        {name} = {at}" if i == len(names) - 1 else f"        {name} = {at} % ({e})")
        below.append(f"({e})" if "/" in e else e)
    return out


def _per_sequence_grid(kernel: Kernel, V: str) -> list[str]:
    """One CTA per (V-block, value head, sequence), walking the sequence (the scans, the token step)."""
    skip = ([f"        skip = {kernel.walk_skip}[i_n, i_hv]  # the chunks this walk leaves out (its window's start)"]
            if kernel.walk_skip else [])
    words = len(next(p for p in kernel.params if p.name == "cu_seqlens").shape) == 2  # [N+1, W]: column 0
    at = (lambda n: f"cu_seqlens[{n}, 0]") if words else (lambda n: f"cu_seqlens[{n}]")
    return [*_grid(kernel, V),
            "        i_h = i_hv // G  # the query/key head this value head reads",
            "        v0 = i_v * BV",
            f"        bos = {at('i_n')}",
            f"        seq_len = {at('i_n + 1')} - bos", *skip]


def walk(kernel: Kernel) -> tuple[str, str, list[str]]:
    """A scan's loop over its chunks: (loop variable, extent, the lines that make the chunk index
    i_c from it). The walk runs from the sequence's last chunk where the kernel is `reverse`, and
    leaves out its first `skip` chunks where it has `walk_skip`."""
    if not kernel.walk_skip:
        if kernel.reverse:
            return "i_r", "T.ceildiv(seq_len, C)", ["i_c = T.ceildiv(seq_len, C) - 1 - i_r"]
        return "i_c", "T.ceildiv(seq_len, C)", []
    first = "T.ceildiv(seq_len, C) - 1 - skip - i_w" if kernel.reverse else "skip + i_w"
    return "i_w", "T.ceildiv(seq_len, C) - skip", [f"i_c = {first}"]


def lower_token_step(kernel: Kernel, shape: ShapeClass) -> list[str]:
    """A token-step kernel (passes/token_step.py): one CTA per (V-block, value head, sequence) runs
    the sequence's tokens in order, the state block in registers."""
    r = _Render(kernel, shape)
    K, V = r.tiles.get("K", "K"), r.tiles.get("V", "V")
    inside = ("i < K and v0 + j < V" if r.tiles else None)  # the op's state in a wider tile

    def stmt(s: Stmt, token: str = "t") -> list[str]:
        # (`token`: the current token's index in the sequence, as the load statements read it)
        a = s.attr
        if s.op == "load_token":
            p = r.params[s.srcs[0]]
            widened = p.dtype in PER_CALL_DTYPES  # (held in float32 once loaded)
            widen = (lambda x: f'T.cast({x}, "float32")') if widened else (lambda x: x)
            row = " + ".join(["bos", *(x for x in (token, str(a.get("ahead", 0))) if x != "0")])
            if len(p.shape) == 3:  # a scalar of the token
                return ["for i in T.Parallel(1):", f"    {s.dst}[i] = {widen(f'{s.srcs[0]}[0, {row}, i_hv]')}"]
            head = "i_h" if p.shape[2] == "H" else "i_hv"
            col, width, dim = ("v0 + i", "BV", "V") if p.shape[3] == "V" else ("i", K, "K")
            ok = f"{col} < {dim}" if dim in r.tiles else None
            value = widen(f"{s.srcs[0]}[0, {row}, {head}, {col}]")
            zero = _dtype("float32" if widened else p.dtype)
            value = f"T.if_then_else({ok}, {value}, T.cast(0, {zero}))" if ok else value
            return [f"for i in T.Parallel({width}):", f"    {s.dst}[i] = {value}"]
        if s.op == "store_token":
            store = [f"{s.dst}[0, bos + t, i_hv, v0 + j] = T.cast({s.srcs[0]}[j], IO)"]
            if "V" in r.tiles:  # the op's values in a wider tile
                store = ["if v0 + j < V:", f"    {store[0]}"]
            return ["for j in T.Parallel(BV):"] + [f"    {ln}" for ln in store]
        if s.op == "load_state":
            pool = s.srcs[0]
            load = ([f"for i, j in T.Parallel({K}, BV):",
                     f"    {s.dst}[i, j] = T.if_then_else({inside}, T.cast({pool}[slot, i_hv, i, v0 + j], \"float32\"), 0.0)"]
                    if inside else [f"T.copy({pool}[slot, i_hv, 0:K, v0:v0 + BV], {s.dst})"])
            return ["if slot >= 0:  # else the zero state"] + [f"    {ln}" for ln in load] + \
                ["else:", f"    T.clear({s.dst})"]
        if s.op == "store_state":
            store = ([f"for i, j in T.Parallel({K}, BV):", f"    if {inside}:",
                      f"        {s.dst}[dst_slot, i_hv, i, v0 + j] = T.cast({s.srcs[0]}[i, j], STATE)"]
                     if inside else [f"T.copy({s.srcs[0]}, {s.dst}[dst_slot, i_hv, 0:K, v0:v0 + BV])"])
            return [f"dst_slot = {a['slot']}[0]", "if dst_slot >= 0:  # else this state is not kept"] + \
                [f"    {ln}" for ln in store]
        if s.op == "load_slot":
            src = s.srcs[0]
            if len(r.params[src].shape) == 1:  # the sequence's
                return ["for i in T.Parallel(1):", f"    {s.dst}[i] = {src}[i_n]"]
            row = " + ".join(x for x in (token, str(a.get("ahead", 0))) if x != "0") or "0"
            return ["for i in T.Parallel(1):", f"    {s.dst}[i] = T.if_then_else({row} < L, {src}[i_n, {row}], -1)"]
        if s.op == "reduce" and len(s.srcs) == 1:  # straight into the destination fragment
            return [f"T.reduce_sum({s.srcs[0]}, {s.dst}, dim={a['dims'][0]})"]
        return r.stmt(s, scan=True)

    out = _signature(kernel, r) + _per_sequence_grid(kernel, V)
    for b in kernel.buffers:
        alloc = "T.alloc_shared" if b.scope == "shared" else "T.alloc_fragment"
        out.append(f"        {b.name} = {alloc}({_shape(b.alloc_shape(), r.tiles)}, {_dtype(b.dtype)})")
    dealt = [b for b in kernel.buffers if b.warp_columns]
    if dealt:
        out += ["        # each warp holds whole columns of these: their sums over K are shuffles in the warp",
                "        T.annotate_layout({" + ", ".join(f"{b.name}: warp_columns({b.name}, {b.warp_columns})"
                                                      for b in dealt) + "})"]

    def per_token(s: Stmt) -> bool:  # a load of a token's row, or of its entry of an [N, L] tensor
        return s.op == "load_token" or (s.op == "load_slot" and len(r.params[s.srcs[0]].shape) == 2)

    def block(stmts, ind: str, token: str) -> list[str]:
        # each run of token loads under one guard that their token is in the sequence (a load of
        # the current token in the loop needs none)
        lines, i = [], 0
        while i < len(stmts):
            s = stmts[i]
            ahead = s.attr.get("ahead", 0)
            if not per_token(s) or (token == "t" and not ahead):
                lines += [ind + ln for ln in stmt(s, token)]
                i += 1
                continue
            loads = []
            while i < len(stmts) and per_token(stmts[i]) and stmts[i].attr.get("ahead", 0) == ahead:
                loads += stmt(stmts[i], token)
                i += 1
            which = ("the first token's inputs, their loads beside the state's: one memory latency for both"
                     if token == "0" and not ahead else "the next token's inputs, loaded while this one computes"
                     if ahead == 1 else f"the inputs of the token {ahead} on, loaded while this one computes")
            guard = " + ".join(x for x in (token, str(ahead)) if x != "0") or "0"
            lines += [f"{ind}if {guard} < seq_len:  # {which}"] + [f"{ind}    {ln}" for ln in loads]
        return lines

    slot = next(s for s in kernel.prologue if s.op == "load_state").attr["slot"]
    out += [f"        slot = {slot}[i_n]",
            "        if slot != -2:  # -2: a padding entry of the batch, which reads and writes nothing"]
    out += block(kernel.prologue, " " * 12, "0")
    out.append("            for t in T.serial(seq_len):")
    out += block(kernel.body, " " * 16, "t")
    out += block(kernel.epilogue, " " * 12, "t")
    if kernel.padding:
        out += ["        else:", "            for t in T.serial(seq_len):"] + block(kernel.padding, " " * 16, "t")
    return out


def lower_kernel(kernel: Kernel, shape: ShapeClass) -> list[str]:
    if kernel.kind == "token_step":
        return lower_token_step(kernel, shape)
    if kernel.warp_roles:
        from .lower_fused import lower_fused  # (it renders statements with this module's templates)
        return lower_fused(kernel, shape)
    r = _Render(kernel, shape)
    scan = kernel.loop is not None
    store_waits = scan and r.bulk_stores()
    out = _signature(kernel, r)
    if scan:
        out += _per_sequence_grid(kernel, r.tiles.get("V", "V"))
    else:
        out += [*_grid(kernel, r.tiles.get("V", "V"), r.tiles.get("K", "K"), r.tiles.get("BK", "BK")),
                "        i_h = i_hv // G",
                "        t0 = chunk_map[i_slot, 0]",
                "        n_valid = chunk_map[i_slot, 1]  # 0 for unused slots: nothing is stored"]
        if kernel.key_block:
            out.append(f"        k0 = i_kb * {r.tiles['BK']}  # the block of K's columns (of the state's rows) this CTA "
                       "computes")
        if kernel.ctas_per_sm:
            out.append(f"        T.annotate_min_blocks_per_sm({kernel.ctas_per_sm})  # registers for "
                       f"{kernel.ctas_per_sm} CTAs an SM (launch bounds)")
    for b in kernel.buffers:
        alloc = "T.alloc_shared" if b.scope == "shared" else "T.alloc_fragment"
        out.append(f"        {b.name} = {alloc}({_shape(b.alloc_shape(), r.tiles)}, {_dtype(b.dtype)})")
        for s in (st for st in kernel.body if st.dst == b.name and st.op in SCRATCH):
            for suffix, (scope, shape, dt) in SCRATCH[s.op].items():
                if shape is None:  # a vector over a 2-D block's last dim (a cumsum's running sums)
                    if len(b.shape) < 2:
                        continue
                    shape = f"({r.tiles.get(b.shape[-1], b.shape[-1])},)"
                alloc = "T.alloc_shared" if scope == "shared" else "T.alloc_fragment"
                out.append(f"        {s.dst}_{suffix} = {alloc}({shape}, {_dtype(dt)})")
    for s in kernel.body:
        if s.attr.get("async") and s.dst not in r.masked_loads:
            out.append(f"        {s.dst}_bar = T.alloc_barrier([1])  # completes when {s.dst} has landed")
    for s in kernel.prologue:
        out += [f"        {ln}" for ln in r.stmt(s, scan)]
    ind = "        "
    if scan:
        assert kernel.max_stages >= 1, f"{kernel.name}: a scan without max_stages (schedule sets it)"
        stages, why = "STAGES", ""
        if shape.stages > kernel.max_stages:
            stages, why = kernel.max_stages, f"  # the most its shared memory holds (STAGES = {shape.stages})"
        loop, extent, index = walk(kernel)  # (a backward scan: from the sequence's last chunk to its first)
        out.append(f"        for {loop} in T.Pipelined({extent}, num_stages={stages}):{why}")
        out += ["            " + ln for ln in index]
        out += ["            t0 = bos + i_c * C",
                "            n_valid = T.min(C, seq_len - i_c * C)"]
        if any(s.op in ("store_chunk_state", "load_chunk_state") for s in kernel.body):
            out.append("            i_slot = chunk_offsets[i_n] + i_c")
        ind = "            "
        if store_waits:
            out.append(ind + SCAN_STORE_WAIT + "  # the previous chunk's stores have read their blocks")
    # In the pipelined scan a block loaded masked (cp.async, not TMA) shares its stage's barrier
    # with the next TMA load, and TileLang 0.1.15 hands the stage back to the producer after that
    # load's last reader: seen on the H200, the forward scan's k (read again by the chunk's last
    # wgmma) overwritten by a later chunk's, S0 15% off. Its readers take a private copy instead,
    # made first thing in the chunk's work, before the stage can go back (as the scan's vectors are
    # read, schedule.py).
    private = {x: f"{x}_c" for x in sorted(r.masked_loads)} if scan else {}
    for x, own in private.items():
        b = kernel.buffer(x)
        r.dtype[own], r.aliases[own] = b.dtype, x
        out.insert(next(i for i, ln in enumerate(out) if ln.startswith(f"        {x} = ")) + 1,
                   f"        {own} = T.alloc_shared({_shape(b.shape, r.tiles)}, {_dtype(b.dtype)})  # the consumer's")
    copied = not private
    unordered = False  # threads have written shared memory since the last barrier this code placed
    for s in kernel.body:
        if s.op in ("wait_load", "zero_pad") and s.dst in private:
            continue  # (loaded whole and masked)
        if not copied and s.op not in ("load", "load_vec", "load_chunk_state", "zero_pad", "wait_load"):
            out += [f"{ind}T.copy({x}, {own})  # the producer may reuse {x}'s stage from here on"
                    for x, own in private.items()]
            copied = True
        if copied and private:
            s = s.renamed(private)
        if unordered and not scan and s.op == "zero_pad" and s.attr.get("only_partial") \
                and s.dst not in r.masked_loads:
            # TileLang 0.1.15 places the barrier that orders those writes before other threads'
            # reads inside this `if n_valid < C:`, which a whole chunk skips: its readers then
            # race the writes (seen on the H200: KDA's backward prep at K = 60 read β before it
            # was stored, and W came out 3% off). A barrier of its own before the `if`.
            out.append(f"{ind}T.sync_threads()  # the writes above, before a whole chunk skips the `if` below")
            unordered = False
        lines = r.stmt(s, scan)
        out += [ind + ln for ln in lines]
        if any(ln.startswith("T.sync_threads()") for ln in lines):
            unordered = False
        # (a fix-up's own writes need no such barrier: every `if n_valid < C:` after it, where
        # TileLang orders them, runs exactly when it ran)
        if s.dst in r.dtype and kernel.buffer(s.dst).scope == "shared" and s.op != "wait_load" \
                and not (s.attr.get("async") and s.dst not in r.masked_loads) \
                and not (s.op == "zero_pad" and s.attr.get("only_partial")):
            unordered = True
    if store_waits:
        out.append("        " + SCAN_STORE_WAIT + "  # and the last chunk's")
    for s in kernel.epilogue:
        out += [f"        {ln}" for ln in r.stmt(s, scan)]
    return out


# A split-phase TMA load: the issuing thread also arrives on the load's barrier (with the bytes to
# expect), which then completes when they land. Without the arrival the barrier never completes and
# the wait hangs (T.tma_copy leaves the arrival to the caller unless asked).
ARRIVE = 'annotations={"emit_arrive": 1}'

# only the thread that issued the stores waits; a barrier follows before any thread writes a block
SCAN_STORE_WAIT = "T.tma_store_wait()"


def _key_block_constant(width: int) -> str:
    """The module constant of the kernels on blocks of `width` keys (Kernel.key_block): one a width,
    since a program's kernels may run on blocks of different widths (a prep on 32, an out kernel on
    64)."""
    return f"BK{width}"


def lower(kir: KernelIR, shape: ShapeClass, source: str = "") -> str:
    """The TileLang module for one shape class."""
    if shape.io not in IO_DTYPES:
        raise PassError("lower", f"io dtype {shape.io} is not one of {IO_DTYPES}")
    if kir.chunk_size != CHUNK_SIZE and any(k.kind != "token_step" for k in kir.kernels):
        raise PassError("lower", f"the sm90 kernels are built for chunks of {CHUNK_SIZE} tokens, not "
                                 f"{kir.chunk_size} (the interpreter runs any chunk size)")
    if shape.BV < 16 and any(k.kind != "token_step" for k in kir.kernels):
        raise PassError("lower", f"V-block {shape.BV}: the chunk kernels' products are wgmma tiles of at least 16 "
                                 "columns (a V-block of 8 is the token step's)")
    if shape.BV > kir.block_v_max:
        raise PassError("lower", f"V-block {shape.BV}: {kir.name}'s kernels are budgeted for V-blocks up to "
                                 f"{kir.block_v_max} (the launch takes no wider one: kernels/forward.shape_class)")
    lines = [
        f'"""TileLang kernels for {kir.name}, generated by qla{f" from {source}" if source else ""}.',
        "",
        f"Shape class: H={shape.H} HV={shape.HV} K={shape.K} V={shape.V} BV={shape.BV} io={shape.io}.",
        'Regenerated on every compile; edit the spec or the passes, not this file."""',
        "import tilelang.language as T",
        "",
        "from qla_compiler.kernels.tri_inverse import unit_lower_inverse",
        *(["from qla_compiler.kernels.warp_columns import warp_columns"]
          if any(b.warp_columns for k in kir.kernels for b in k.buffers) else []),
        "",
        f"H, HV, K, V, BV, C = {shape.H}, {shape.HV}, {shape.K}, {shape.V}, {shape.BV}, {kir.chunk_size}",
        *(f"{_key_block_constant(w)} = {min(w, shape.KP)}  # the keys of a block of the kernels on {w}-key blocks "
          "(K's tile where that is narrower): their K-wide buffers' width"
          for w in sorted({k.key_block for k in kir.kernels if k.key_block})),
        *([f"{', '.join(shape.padded.values())} = {', '.join(str(getattr(shape, t)) for t in shape.padded.values())}"
           "  # the tiles of the head dims narrower than a power of two: the op's tensors load and "
           "store masked"] if shape.padded else []),
        "G = HV // H  # value heads per query/key head",
        f'IO = "{shape.io}"',
        f"SCALE = {shape.scale_value!r}",
        f"STAGES = {shape.stages}",
        *([f"SCAN_THREADS = {128 * shape.scan_warpgroups}  # the forward scan's consumer threads"]
          if any(k.threads == "SCAN_THREADS" for k in kir.kernels) else []),
        *([f"TOKEN_THREADS = {32 * shape.BV // n}  # the token step's: a warp per {n} columns of the V-block"
           for n in {b.warp_columns for k in kir.kernels if k.threads == "TOKEN_THREADS" for b in k.buffers
                     if b.warp_columns}]),
        'Tok = T.dynamic("T")  # tokens of the packed batch',
        'N = T.dynamic("N")  # sequences',
        'NP1 = T.dynamic("NP1")  # len(cu_seqlens)',
        'CH = T.dynamic("CH")  # chunk slots',
        *([f'STATE = "{shape.state}"  # the state pools\' dtype',
           'Slots = T.dynamic("Slots")  # slots of a state pool',
           'L = T.dynamic("L")  # tokens of the longest sequence']
          if any(p.dtype == "state" for k in kir.kernels for p in k.params) else []),
        *(['Words = T.dynamic("Words")  # int32 words of a cu_seqlens entry: 1, or 2 (an int64\'s, low first)']
          if any("W" in p.shape for k in kir.kernels for p in k.params) else []),
        *([f'{_dtype(kind)} = "{getattr(shape, kind)}"  # the dtype the token step reads its per-token {kind} in'
           for kind in PER_CALL_DTYPES if any(p.dtype == kind for k in kir.kernels for p in k.params)]),
    ]
    for k in kir.kernels:
        lines += ["", ""] + lower_kernel(k, shape)
    return "\n".join(lines) + "\n"
