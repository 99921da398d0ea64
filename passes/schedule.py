"""schedule: ChunkIR + Partition → KernelIR. Places every value and orders the statements.

Placement rules (Hopper, TileLang):
  * loaded blocks (q, k, v, T_r) → shared memory in the io dtype (TMA loads inside the pipeline;
    in the parallel kernels, split-phase TMA loads issued as early as the peak of live shared
    memory allows and waited for right before the first reader, so that blocks with disjoint lives
    share memory: _place_loads; synchronous loads without SPLIT_PHASE_LOADS); per-token vectors
    (g, β) → shared float32;
  * matmul results → register fragments (float32 accumulators of wgmma);
  * a matmul operand that is computed → a shared io-dtype copy `<name>_s` (wgmma reads shared);
  * vectors over the chunk → shared float32 (the scan inlines them, and the parallel kernels a
    product of two values already placed: see _build); scalars and element-wise C×C / C×V values
    are not stored at all: they are inlined where they are used;
  * a block crossing to a later kernel leaves through shared memory as whole rows: its bf16 wgmma
    copy if it has one, else staged in a shared block of its shape whose work is done, if there is
    one (else straight from its fragment, and right after its last reader if it is not a wgmma's
    result and wgmmas follow: _store_early);
  * a parallel kernel runs on one warpgroup (128 threads), or two when its live fragments would
    not fit in one's registers (FRAGMENT_REGISTERS);
  * `x + A·B` with A·B used once accumulates into x's fragment; an element-wise x whose only
    fragment input dies there is computed in place (the state decays in place, then S += Kᵀ V).

The state stays in a register fragment for the whole sequence; the V dimension is split into
BV-wide blocks over CTAs (valid because no matmul contracts over V, which is checked).
"""
from __future__ import annotations

import os

import networkx as nx

from qla_compiler.errors import PassError
from qla_compiler.ir.chunk import ChunkIR
from qla_compiler.ir.chunk_ops import EXPONENTIALS
from qla_compiler.ir.kernel import Buffer, Kernel, KernelIR, Stmt, Tensor
from qla_compiler.kernels.tri_inverse_scratch import INPUT_DTYPE as INVERSE_INPUT_DTYPE
from qla_compiler.kernels.tri_inverse_scratch import SCRATCH as INVERSE_SCRATCH

from .partition import Partition

BLOCK_INPUT_SHAPE = {"key": ("C", "K"), "value": ("C", "V"), "cotangent_value": ("C", "V")}
# names the generated module already uses (TileLang's `T`, the size constants, loop variables)
RESERVED = {"T", "C", "K", "V", "H", "HV", "BV", "G", "IO", "SCALE", "STAGES", "SCAN_THREADS", "N", "NP1", "CH",
            "Tok", "i", "j", "t0", "n_valid", "bos", "seq_len", "v0", "i_h", "i_hv", "i_n", "i_v", "i_c", "i_slot"}
THREADS = 128
HEAD_DIMS = (128, 128)  # the head-dim tiles (K, V) a schedule serves by default (schedule's head_dims)


def _dims(shape, tiled: bool) -> tuple:
    return tuple("BV" if (d == "V" and tiled) else d for d in shape)


class _Builder:
    """Builds one kernel's buffers and statements from a set of ChunkIR nodes."""

    def __init__(self, ir: ChunkIR, nodes, loaded, tiled: bool, dims: dict):
        self.ir, self.nodes, self.loaded, self.tiled = ir, set(nodes), set(loaded), tiled
        self.dims = dims  # the size of each dim name that shared memory and registers are budgeted at
        self.pipelined = tiled  # the V-blocked kernel is also the pipelined one
        self.buffers: dict[str, Buffer] = {}
        self.place: dict[str, str] = {}  # node -> buffer holding its value
        self.loads, self.copies, self.body = [], [], []
        self.users = {n: [u.name for u in ir.users(n) if u.name in self.nodes] for n in self.nodes}
        self.io_copy: dict[str, str] = {}  # node -> the shared io-dtype copy made for a wgmma

    def buf(self, name, shape, dtype, scope) -> str:
        name = ident(name)
        name = f"{name}_f" if name in RESERVED else name
        if name not in self.buffers:
            self.buffers[name] = Buffer(name, _dims(shape, self.tiled), dtype, scope)
        return name

    # ---- expressions -------------------------------------------------------------------------
    def ex(self, name: str, idx: tuple):
        n = self.ir.node(name)
        if name in self.place:
            b = self.buffers[self.place[name]]
            if n.shape == ():  # a scalar computed by a reduction lives in a 1-element buffer
                return ("buf", b.name, "0")
            return ("buf", b.name, *idx[-len(b.shape):]) if b.shape else ("buf", b.name)
        op, a = n.op, n.args

        def sub(arg):
            s = self.ir.node(arg).shape
            return () if s == () else idx

        if op in ("add", "sub", "mul"):
            return (op, self.ex(a[0], sub(a[0])), self.ex(a[1], sub(a[1])))
        if op in ("clamp_min", "above"):  # max(x, min); its derivative, 1 where x > min
            return ("max" if op == "clamp_min" else op, self.ex(a[0], idx), ("lit", float(n.attr["min"])))
        if op == "neg" or op in EXPONENTIALS:
            inner = self.ir.node(a[0])
            if op != "neg" and inner.op == "masked_diff" and a[0] not in self.place:
                sel = "select_lower" if inner.attr["mask"] == "lower" else "select_strict"
                diff = self._diff(inner, idx)
                return (sel, idx[0], idx[1], (op, diff), ("lit", 0.0))
            return (op, self.ex(a[0], idx))
        if op == "scale_rows":
            return ("mul", self.ex(a[0], (idx[0],)), self.ex(a[1], idx))
        if op == "scale_cols":
            return ("mul", self.ex(a[0], idx), self.ex(a[1], (idx[1],)))
        if op == "masked_diff":
            sel = "select_lower" if n.attr["mask"] == "lower" else "select_strict"
            return (sel, idx[0], idx[1], self._diff(n, idx), ("lit", -1e30))
        if op == "causal_mask":
            sel = "select_lower" if n.attr["mask"] == "lower" else "select_strict"
            return (sel, idx[0], idx[1], ("lit", 1.0), ("lit", 0.0))
        if op == "tril":
            sel = "select_strict" if n.attr.get("strict") else "select_lower"
            return (sel, idx[0], idx[1], self.ex(a[0], idx), ("lit", 0.0))
        if op == "const":
            return ("lit", float(n.attr["value"]))
        if op == "param":
            return ("param", n.attr["name"])
        if op == "head_log":
            return ("head", n.attr["name"])
        if op == "last":
            return self.ex(a[0], ("n_valid - 1",))
        if op == "positions":
            return ("min_pos", idx[0])
        if op == "at_last":  # the scalar at the chunk's last token, zero elsewhere
            return ("select_last", idx[0], self.ex(a[0], ()), ("lit", 0.0))
        if op == "valid":
            return ("select_valid", idx[0], ("lit", 1.0), ("lit", 0.0))
        raise PassError("schedule", f"node {name} ({op}) must be materialised before it is used")

    def _diff(self, n, idx):
        x = n.args[0]
        return ("sub", self.ex(x, (idx[0],)), self.ex(x, (idx[1],)))

    # ---- statements -------------------------------------------------------------------------
    def ewise(self, dst: str, name: str):
        shape = self.buffers[dst].shape
        idx = ("i", "j")[:len(shape)]
        self.body.append(Stmt("ewise", dst, (), (("expr", self.ex(name, idx)), ("index", idx))))

    def operand(self, name: str) -> str:
        """A shared io-dtype buffer holding `name`, for wgmma."""
        n = self.ir.node(name)
        if name in self.place and self.buffers[self.place[name]].scope == "shared" \
                and self.buffers[self.place[name]].dtype == "io":
            return self.place[name]
        if n.op == "state_in":
            return "state_s"
        src = self.reusable_block(name)
        if src is not None:  # write over the loaded block it is computed from
            reuse = self.place[src]
            self.ewise(reuse, name)
            del self.place[src]  # that buffer now holds `name`; a later read of src is an error
            self.place[name] = reuse
            return reuse
        dst = self.buf(f"{name}_s", n.shape, "io", "shared")
        if dst not in [s.dst for s in self.body]:
            if name in self.place:  # a fragment: copy (and cast) it
                self.body.append(Stmt("copy", dst, (self.place[name],)))
            else:
                self.ewise(dst, name)
            self.io_copy[name] = dst
        return dst

    def low_part(self, args, operands):
        """The operands of A·B_lo when a state-chain product pairs a spec input A (exact in the io
        dtype) with a block B computed in float32: B ≈ B_hi + B_lo, two io roundings, so that
        A·B_hi + A·B_lo carries ~16 bits of B instead of 8. The state chain sums these products
        over every chunk (the backward's qᵀ(Γ ⊙ dO) sets d_S0's error); a tf32 product would need
        both operands in float32: twice the shared memory and half the tensor-core rate."""
        exact = [self.ir.node(a).op == "input" for a in args]
        if exact.count(True) != 1:
            return None
        computed, hi = args[exact.index(False)], operands[exact.index(False)]
        if self.io_copy.get(computed) != hi or computed in self.place:
            return None  # loaded, or copied from a fragment: no float32 expression to split
        idx = ("i", "j")
        lo = self.buf(f"{hi.removesuffix('_s')}_lo_s", self.ir.node(computed).shape, "io", "shared")
        residual = ("sub", self.ex(computed, idx), ("buf", hi, *idx))
        self.body.append(Stmt("ewise", lo, (), (("expr", residual), ("index", idx))))
        return tuple(lo if o == hi else o for o in operands)

    def fragment(self, name: str) -> str:
        """A float32 register fragment holding `name` (for a reduction)."""
        if name in self.place and self.buffers[self.place[name]].scope == "fragment":
            return self.place[name]
        dst = self.buf(f"{name}_f", self.ir.node(name).shape, "float32", "fragment")
        if dst not in [s.dst for s in self.body]:
            self.ewise(dst, name)
        return dst

    def reusable_block(self, name: str):
        """The loaded io block an element-wise `name` may overwrite: its only block-shaped input,
        of the same shape, with every other reader already emitted. Shared memory decides how many
        CTAs of a parallel kernel share an SM. Not in the pipelined scan, whose loaded buffers
        belong to the producer."""
        if self.pipelined or name in self.place:
            return None
        shape, blocks = self.ir.node(name).shape, set()

        def walk(x):
            if x in self.place:
                if self.ir.node(x).shape == shape:
                    blocks.add(x)
                return
            n = self.ir.node(x)
            if n.op == "matmul" or n.op == "inv_unit_lower" or n.op == "cumsum":
                blocks.add(None)  # not element-wise: not computed here
                return
            for a in n.args:
                walk(a)
        walk(name)
        if len(blocks) != 1 or None in blocks:
            return None
        (src,) = blocks
        buf = self.buffers[self.place[src]]
        loaded = any(st.dst == buf.name for st in self.loads if st.op == "load")
        if not loaded or buf.dtype != "io" or buf.shape != _dims(shape, self.tiled):
            return None
        readers = [u for u in self.users[src] if u != name]
        if any(u not in self.place and not self._inlined_into(u, name) for u in readers):
            return None
        return src

    def _inlined_into(self, node: str, target: str) -> bool:
        """`node` is computed inside `target`'s expression (not placed, and `target` reads it)."""
        return node in nx.ancestors(self.ir.graph, target) and node not in self.place

    def overwrite_fragment(self, name: str) -> bool:
        """Compute the element-wise `name` over the one fragment it reads, if that may be
        overwritten (single_fragment); registers decide how many warps a parallel kernel needs."""
        frag = self.single_fragment(name)
        if frag is None:
            return False
        self.body.append(Stmt("ewise", self.place[frag], (),
                              (("expr", self.ex(name, ("i", "j"))), ("index", ("i", "j")))))
        self.place[name] = self.place[frag]
        return True

    def single_fragment(self, name: str):
        """The one fragment an element-wise node reads, if it may be overwritten in place."""
        frags = set()

        def walk(x):
            if x in self.place:
                b = self.buffers[self.place[x]]
                if b.scope == "fragment":
                    frags.add(x)
                return
            for a in self.ir.node(x).args:
                walk(a)
        walk(name)
        if len(frags) != 1:
            return None
        (f,) = frags
        ok = self.ir.node(f).op == "state_in" or self.users[f] == [name]
        return f if ok and self.ir.node(f).shape == self.ir.node(name).shape else None


def _accumulation(ir: ChunkIR, nodes, loaded=()) -> dict:
    """add(x, A·B) with A·B computed here and used only there: A·B accumulates onto x.
    Returns {add: (x, matmul)}."""
    out = {}
    for name in nodes:
        n = ir.node(name)
        if n.op != "add":
            continue
        for x, m in (n.args, n.args[::-1]):
            mm = ir.node(m)
            if mm.op == "matmul" and m not in loaded and [u.name for u in ir.users(m)] == [name] \
                    and ir.node(x).shape == n.shape:
                out[name] = (x, m)
                break
    return out


def _check_v_columns(ir: ChunkIR, nodes) -> None:
    for n in ir.of_op("matmul"):
        if n.name not in nodes:
            continue
        a, b = (ir.node(x).shape for x in n.args)
        inner = a[0] if n.attr.get("ta") else a[1]
        if inner == "V":
            raise PassError("schedule", f"{n.name} contracts over V; V-blocking the scan would be wrong")


def _build(ir: ChunkIR, nodes, loaded, tiled: bool, dims: dict):
    """Statements for the node set; returns the builder (buffers, loads, body). The V-blocked
    kernel is also the pipelined one (its loads run on a producer warpgroup)."""
    b = _Builder(ir, nodes, loaded, tiled, dims)
    pipelined = tiled
    order = [n for n in ir.order() if n.name in b.nodes]
    acc = _accumulation(ir, [n.name for n in order], b.loaded)
    fused_matmuls = {m for _, m in acc.values()}
    in_place = {x for x, _ in acc.values()}

    for n in order:  # loads first: they are the producer's work
        src = global_name(ir, n.name)
        per_chunk = n.op == "input" and n.attr.get("kind") == "saved_state"
        if (n.op == "state_in" and n.name in b.loaded) or per_chunk:  # a state per chunk slot
            b.place[n.name] = b.buf(f"{n.name}_s", n.shape, "io", "shared")
            b.loads.append(Stmt("load_chunk_state", b.place[n.name], (src,)))
        elif n.op == "input" or n.name in b.loaded:
            kind = n.attr.get("kind", "vector" if n.shape == ("C",) else "block")
            if kind in ("scalar", "gate", "vector"):
                staged = b.buf(f"{n.name}_s", ("C",), "float32", "shared")
                # a prefix sum of zero-padded gates holds its last value over the padding
                pad = "hold" if n.op == "cumsum" else "zero"
                b.loads.append(Stmt("load_vec", staged, (src,), (("pad", pad),)))
                b.place[n.name] = staged
                if pipelined:
                    # TileLang 0.1.15 hands a vector loaded by the producer back to it too early
                    # (after the chunk's first matmuls, before β's last use): read a private copy
                    own = b.buf(f"{n.name}_c", ("C",), "float32", "shared")
                    b.copies.append(Stmt("ewise", own, (), (("expr", ("buf", staged, "i")), ("index", ("i",)))))
                    b.place[n.name] = own
            else:
                shape = BLOCK_INPUT_SHAPE.get(kind, n.shape)
                b.place[n.name] = b.buf(f"{n.name}_s", shape, "io", "shared")
                b.loads.append(Stmt("load", b.place[n.name], (src,)))
        elif n.op == "state_in":
            b.place[n.name] = b.buf("state", n.shape, "float32", "fragment")

    for n in order:
        name, op = n.name, n.op
        if name in b.place:
            continue
        if op == "matmul":
            if name in fused_matmuls:
                continue  # emitted by its add
            A, B = b.operand(n.args[0]), b.operand(n.args[1])
            b.place[name] = b.buf(name, n.shape, "float32", "fragment")
            b.body.append(Stmt("gemm", b.place[name], (A, B), tuple(sorted(n.attrs))))
        elif op in ("cumsum", "rev_cumsum"):  # prefix sums, or suffix sums (a cumsum's VJP)
            src = n.args[0]
            if src not in b.place or b.buffers[b.place[src]].scope != "shared":
                dst = b.buf(f"{src}_s", ("C",), "float32", "shared")
                b.ewise(dst, src)
                b.place[src] = dst
            b.place[name] = b.buf(f"{name}_s", ("C",), "float32", "shared")
            b.body.append(Stmt("cumsum", b.place[name], (b.place[src],),
                               (("reverse", True),) if op == "rev_cumsum" else ()))
        elif op == "inv_unit_lower":
            if ident(f"{n.args[0]}_s") in b.buffers:  # the inverse overwrites its input block
                raise PassError("schedule", f"{name}: the inverse's input {n.args[0]} needs a block of its own")
            A = b.buf(f"{n.args[0]}_s", n.shape, INVERSE_INPUT_DTYPE, "shared")
            b.ewise(A, n.args[0])
            b.place[name] = b.buf(name, n.shape, "float32", "fragment")
            b.body.append(Stmt("inverse", b.place[name], (A,)))
        elif name in acc:
            x, m = acc[name]
            mm = ir.node(m)
            A, B = b.operand(mm.args[0]), b.operand(mm.args[1])
            if x in b.place and b.buffers[b.place[x]].scope == "fragment":
                frag = b.place[x]
                attrs = tuple(sorted(mm.attrs)) + (("accumulate", True),)
                # (the backward's chain only: there it set d_S0's error, 2.5–4× FLA's without it;
                # the forwards' final states were within FLA's error, and each split costs a wgmma)
                low = b.low_part(mm.args, (A, B)) if pipelined and frag == "state" and ir.reverse else None
                b.body.append(Stmt("gemm", frag, (A, B), attrs))
                if low is not None:
                    b.body.append(Stmt("gemm", frag, low, attrs))
                b.place[name] = frag
            else:  # x is not in registers: the product gets its own fragment, the sum stays inline
                b.place[m] = b.buf(m, mm.shape, "float32", "fragment")
                b.body.append(Stmt("gemm", b.place[m], (A, B), tuple(sorted(mm.attrs))))
        elif name in in_place and n.shape != ():
            if not b.overwrite_fragment(name):  # several fragments feed it: a fresh one to accumulate onto
                b.place[name] = b.fragment(name)
        elif op in ("rowsum", "colsum", "sum_all"):
            src = b.fragment(n.args[0])
            shape = ir.node(n.args[0]).shape
            # partial sums in registers (the rows', or the columns'), then shared for any thread to read
            sums = []
            if len(shape) == 2:
                sums.append(b.buf(f"{name}_acc", (shape[1] if op == "colsum" else shape[0],), "float32", "fragment"))
            if op == "sum_all":
                sums.append(b.buf(f"{name}_acc1", ("1",), "float32", "fragment"))
            b.place[name] = b.buf(f"{name}_s", ("1",) if op == "sum_all" else n.shape, "float32", "shared")
            # one reduction per accumulator: rows (dim 1), columns (dim 0), then a vector (dim 0)
            dims = {"rowsum": (1,), "colsum": (0,)}.get(op, (1, 0) if len(shape) == 2 else (0,))
            b.body.append(Stmt("reduce", b.place[name], (src, *sums), (("dims", dims),)))
        elif n.shape == ("C",) and op not in ("const", "valid", "positions") and not pipelined \
                and not (op == "mul" and all(a in b.place for a in n.args)):
            # (the pipelined scan inlines its per-token vectors instead: TileLang 0.1.15 puts the
            # barrier after a C-wide write, which only half the consumer threads run, inside
            # their branch, so the other half read the vector before it is written)
            dst = b.buf(f"{name}_s", ("C",), "float32", "shared")
            b.ewise(dst, name)
            b.place[name] = dst
    return b


def ident(name: str) -> str:
    """A node name as a Python identifier (autodiff names partial gradients `d_x.user`)."""
    return name.replace(".", "_")


def global_name(ir: ChunkIR, name: str) -> str:
    """The global tensor a value crosses memory in: per-token rows, or one state per chunk."""
    n = ir.node(name)
    if n.op == "state_in" or (n.op == "input" and n.attr.get("kind") == "saved_state"):
        return f"{ident(name)}_chunks"
    if n.op == "input":
        return name
    return ident(name) if n.shape == ("C",) else f"{ident(name)}_rows"


def _crossing_tensor(ir: ChunkIR, name: str, role: str) -> Tensor:
    n, g = ir.node(name), global_name(ir, name)
    if n.op == "state_in":
        return Tensor(g, ("CH", "HV", "K", "V"), "io", role, "the state entering every chunk", padded=True)
    if n.shape == ("C",):
        return Tensor(g, ("1", "T", "HV"), "float32", role, "per token")
    return Tensor(g, ("1", "T", "HV", n.shape[1]), "io", role, "rows of the chunk's block, per token", padded=True)


def _input_params(ir: ChunkIR, nodes, loaded) -> list:
    ps = []
    for name in nodes:
        n = ir.node(name)
        if n.op == "input" and n.attr["kind"] == "saved_state":
            ps.append(Tensor(global_name(ir, name), ("CH", "HV", "K", "V"), "io", "in",
                             "the forward's state entering every chunk", padded=True))
        elif n.op == "input":
            kind = n.attr["kind"]
            shape = {"key": ("1", "T", "H", "K"), "value": ("1", "T", "HV", "V"),
                     "cotangent_value": ("1", "T", "HV", "V")}.get(kind, ("1", "T", "HV"))
            blocks = kind in ("key", "value", "cotangent_value")
            ps.append(Tensor(name, shape, "io" if blocks else "float32", "in"))
        elif name in loaded:
            ps.append(_crossing_tensor(ir, name, "in"))
    return ps


def _head_params(ir: ChunkIR, nodes) -> list:
    return [Tensor(f"log_{n.attr['name']}", ("HV",), "float32", "in", "log of the per-head decay")
            for n in ir.of_op("head_log") if n.name in nodes]


CHUNK_MAP = Tensor("chunk_map", ("CH", "2"), "int32", "in", "(first token, tokens) of every chunk slot")


def _store_rows(ir: ChunkIR, b: _Builder, name: str) -> Stmt:
    if ir.node(name).shape == ("C",):
        return Stmt("store_vec", global_name(ir, name), (b.place[name],), (("rows", "n_valid"),))
    return Stmt("store", global_name(ir, name), (b.place[name],), (("rows", "n_valid"),))


# Split-phase TMA loads in the parallel kernels (_place_loads): on the H200 (session 5) every kernel
# matches the emulator with them; the forward's out kernel is 14% faster, its prep 7%, GDN's
# backward out 15%. QLA_SPLIT_PHASE_LOADS=0 turns them off, e.g. to tell whether a wrong result
# comes from them (the generated source differs: both variants cache side by side).
SPLIT_PHASE_LOADS = os.environ.get("QLA_SPLIT_PHASE_LOADS", "1") == "1"


def schedule(part: Partition, split_phase_loads: bool = SPLIT_PHASE_LOADS, head_dims: tuple = HEAD_DIMS) -> KernelIR:
    """The KernelIR of a partitioned chunk program, its shared memory and registers budgeted for
    head-dim tiles up to `head_dims` (K, V): the kernels of larger tiles differ (more threads, fewer
    stages, outputs split across kernels), those of smaller ones would only waste memory.

        >>> kir = schedule(partition(prog.chunk))          # doctest: +SKIP
        >>> print(kir)                                       # doctest: +SKIP
    """
    ir = part.chunk
    _check_v_columns(ir, part.scan)
    kir = KernelIR(ir.name, ir.chunk_size, head_dims=tuple(head_dims))
    dims = dim_sizes(head_dims)
    kir.host.append("chunk_map = (first token, length) of every chunk of every sequence "
                    "(torch on the device: no synchronisation)")
    if part.prep:
        kir.kernels.append(_prep_kernel(part, split_phase_loads, dims))
    kir.kernels.append(_scan_kernel(part, dims))
    kir.kernels += _out_kernels(part, split_phase_loads, dims)
    return kir


# Shared memory a parallel kernel may use (H100/H200 allow 227 KB per CTA; the margin leaves room
# for TileLang's own scratch, and for its allocator packing less tightly than _live_shared counts).
# An out kernel whose live blocks need more at their peak is split by output.
SMEM_BUDGET = 200 * 1024
# Registers per thread a parallel kernel's live fragments may fill at 128 threads (of 255; the rest
# hold addresses and temporaries). A kernel that needs more runs on 256 threads, two warpgroups
# splitting each wgmma's columns: GDN's backward out kernel (176 KB of live fragments) spilled
# at 128 threads and took 15.4 ms on 16/64 × 32768, 6.9 ms at 256 (session 5, run B).
FRAGMENT_REGISTERS = 224
_DTYPE_BYTES = {"io": 2, "float32": 4, "tfloat32": 4, "int32": 4}


def dim_sizes(head_dims: tuple = HEAD_DIMS) -> dict:
    """The size of every dim name a buffer uses, at the largest class the schedule serves: the
    head-dim tiles `head_dims`, the widest V-block, the chunk."""
    K, V = head_dims
    return {"C": 64, "K": K, "V": V, "BV": 64, "1": 1, "16": 16}


def buffer_bytes(b: Buffer, dims: dict) -> int:
    """A buffer's size at the sizes `dims` (dim_sizes)."""
    n = _DTYPE_BYTES[b.dtype]
    for d in b.shape:
        n *= dims[d]
    return n


def smem_bytes(buffers, dims: dict) -> int:
    """Shared memory of a kernel's buffers at the sizes `dims` (no reuse assumed)."""
    return sum(buffer_bytes(b, dims) for b in buffers if b.scope == "shared")


def _out_kernels(part: Partition, split_phase: bool, dims: dict) -> list:
    """The out kernel, or (when one kernel for every output would not fit in shared memory) one
    kernel per group of outputs, each recomputing what its outputs need. What must fit is the peak
    of live blocks, not their sum: loads sit right before their readers, so blocks whose lives do
    not overlap share memory (GDN's backward: one kernel for all five gradients, ~145 KB at its
    peak, where the sum is ~310 KB; split five ways, ~45% of its matmuls ran more than once)."""
    roles = tuple(r for r in part.chunk.outputs if r != "state")

    def split(group):
        k = _out_kernel(part, group, "" if group == roles else "_" + "_".join(group), split_phase, dims)
        if max(_live_shared({x.name: x for x in k.buffers}, k.body, dims)) <= SMEM_BUDGET or len(group) == 1:
            return [k]
        half = (len(group) + 1) // 2
        return split(group[:half]) + split(group[half:])
    return split(roles)


def _prep_kernel(part: Partition, split_phase: bool, dims: dict) -> Kernel:
    ir = part.chunk
    b = _build(ir, part.prep, part.provided, tiled=False, dims=dims)
    stores = []
    for x in part.crossing:
        if x in b.io_copy:  # already rounded to io in shared memory for a wgmma: the store reads that
            # (instead of keeping the float32 value, or what it is computed from, live to the end)
            b.place[x] = b.io_copy[x]
        elif x not in b.place and not (ir.node(x).shape != ("C",) and b.overwrite_fragment(x)):
            # an element-wise combination: computed into registers for the store, over the one
            # fragment it reads where it can be (a product's scaling: scale_after_product)
            b.place[x] = b.fragment(x)
    early = _store_early(b, part.crossing)
    free = _free_at_end(b, part.crossing)
    for x in part.crossing:
        if x in early:
            continue
        staging = next((f for f in free if b.buffers[f].shape == b.buffers[b.place[x]].shape), None)
        if ir.node(x).shape != ("C",) and b.buffers[b.place[x]].scope == "fragment" and staging:
            # a wgmma fragment spreads each row over 4 threads in 8-byte pieces: staged in a
            # shared block whose work is done, the chunk leaves as whole 128-byte rows
            free.remove(staging)
            b.body.append(Stmt("copy", staging, (b.place[x],)))
            b.place[x] = staging
        stores.append(_store_rows(ir, b, x))
    params = _input_params(ir, part.prep, part.provided) + [CHUNK_MAP] + _head_params(ir, part.prep)
    params += [_crossing_tensor(ir, x, "out") for x in part.crossing]
    ops = {ir.node(x).op for x in part.prep if x not in part.provided}  # (provided values are loaded)
    work = [w for op, w in (("inv_unit_lower", "(I + A)⁻¹ by blocked forward substitution (16-row blocks in float32, "
                                              "merges on tf32 wgmma)"),
                            ("cumsum", "chunk-local cumulative gates"),
                            ("matmul", "the matmuls built on the inverse" if "inv_unit_lower" in ops
                             else "the per-token matmuls")) if op in ops]
    body = _place_loads(b, b.body + stores, split_phase)
    threads = _threads(b, body)
    return Kernel(f"{ir.name}_prep", (("chunk_slot", "CH"), ("value_head", "HV")), threads, params,
                  list(b.buffers.values()), [], body, [],
                  roles=(f"all {threads // 32} warps: " + "; ".join(work),),
                  doc="parallel over chunks: " + ", ".join(work), kind="prep", nodes=part.prep)


def _store_early(b: _Builder, crossing) -> set:
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
        last = max(i for i, st in enumerate(b.body) if frag in _reads(st) or st.dst == frag)
        if any(st.op == "gemm" for st in b.body[last + 1:]):
            b.body.insert(last + 1, _store_rows(b.ir, b, x))
            early.add(x)
    return early


def _free_at_end(b: _Builder, keep) -> list:
    """The io shared blocks nothing reads after the body, so a store may stage through them (no
    new shared memory, which would cost CTAs per SM): all but those holding a value in `keep`."""
    held = {b.place[x] for x in keep if x in b.place}
    return [n for n, buf in b.buffers.items()
            if buf.scope == "shared" and buf.dtype == "io" and len(buf.shape) == 2 and n not in held]


def _scan_kernel(part: Partition, dims: dict) -> Kernel:
    ir = part.chunk
    b = _build(ir, part.scan, part.crossing + part.provided, tiled=True, dims=dims)
    s_node = ir.outputs["state"]
    if b.place.get(s_node) != "state":
        raise PassError("schedule", f"the next state {s_node} is not accumulated in the state fragment")
    stores = []
    for x in part.carried:
        if x == ir.state_in:
            b.operand(x)  # the io copy of the entering state is what the out kernel reads
            stores.append(Stmt("store_chunk_state", global_name(ir, x), ("state_s",)))
        else:
            b.place[x] = b.operand(x)
            stores.append(_store_rows(ir, b, x))
    uses_state_s = "state_s" in {s for st in b.body + stores for s in st.srcs}
    if uses_state_s:
        b.buf("state_s", ("K", "V"), "io", "shared")
    params = _input_params(ir, part.scan, part.crossing + part.provided)
    params += [Tensor("cu_seqlens", ("N+1",), "int32", "in"),
               Tensor("chunk_offsets", ("N+1",), "int32", "in", "chunk slot of each sequence's first chunk"),
               Tensor("initial_state", ("N", "HV", "K", "V"), "float32", "in")]
    params += _head_params(ir, part.scan)
    params += [_crossing_tensor(ir, x, "out") for x in part.carried]
    params += [Tensor("final_state", ("N", "HV", "K", "V"), "float32", "out")]
    prologue = [Stmt("load_state", "state", ("initial_state",))]
    body = _issue_stores_early(b.loads + _zero_pad(b, only_partial=True) + b.copies
                               + ([Stmt("copy", "state_s", ("state",))] if uses_state_s else []) + b.body,
                               stores)
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


def _out_kernel(part: Partition, roles: tuple, suffix: str, split_phase: bool, dims: dict) -> Kernel:
    ir = part.chunk
    loaded = set(part.crossing) | set(part.carried) | set(part.provided)
    needed = ir.closure([ir.outputs[r] for r in roles], stop=loaded, within=set(part.out))
    nodes = tuple(n.name for n in ir.order() if n.name in needed)
    b = _build(ir, nodes, loaded, tiled=False, dims=dims)
    stores, outs = [], []
    for role in roles:
        x = ir.outputs[role]
        shape = ir.node(x).shape
        of = ir.node(role[2:]) if role.startswith("d_") and role[2:] in ir.graph else None
        if role == "o" or (of is not None and of.attr.get("kind") in ("value", "key")):
            # the op's output, or a value's or key's gradient per value head, in the io dtype the op
            # returns (a key's the host sums over its group, in float32, as FLA sums its bf16
            # per-value-head d q, d k: half the bytes written and read of float32 partials), staged
            # in shared memory for whole-row stores
            buf = b.buf(f"{role}_s", shape, "io", "shared")
            stores += [Stmt("ewise", buf, (), (("expr", b.ex(x, ("i", "j"))), ("index", ("i", "j")))),
                       Stmt("store", role, (buf,), (("rows", "n_valid"),))]
            outs.append(Tensor(role, ("1", "T", "HV", shape[1]), "io", "out",
                               "per token, per value head" if role != "o" else ""))
        elif shape == ("C",):  # a gradient per token (gates, scalars), float32
            if x not in b.place or b.buffers[b.place[x]].scope != "shared":
                dst = b.buf(f"{x}_s", ("C",), "float32", "shared")
                b.ewise(dst, x)
                b.place[x] = dst
            stores.append(Stmt("store_vec", role, (b.place[x],), (("rows", "n_valid"),)))
            outs.append(Tensor(role, ("1", "T", "HV"), "float32", "out", "per token"))
        else:  # a gradient block of another kind of input, per token and value head, float32
            stores.append(Stmt("store", role, (b.fragment(x),), (("rows", "n_valid"),)))
            outs.append(Tensor(role, ("1", "T", "HV", shape[1]), "float32", "out", "per token, per value head"))
    params = _input_params(ir, nodes, loaded) + [CHUNK_MAP] + _head_params(ir, nodes) + outs
    what = "the output" if roles == ("o",) else "the gradients " + ", ".join(roles)
    body = b.body + stores
    threads = _threads(b, body)
    return Kernel(f"{ir.name}_out{suffix}", (("chunk_slot", "CH"), ("value_head", "HV")), threads, params,
                  list(b.buffers.values()), [], _place_loads(b, body, split_phase), [],
                  roles=(f"all {threads // 32} warps: {what} from the entering state and the chunk's own tokens",),
                  doc=f"parallel over chunks: {what}", kind="out", nodes=nodes, outputs=roles)


def _zero_pad(b: _Builder, only_partial: bool) -> list:
    """A partial last chunk reads the next sequence's tokens: zero those rows (padding is exact).
    For the pipelined scan, whose TMA loads cannot mask; `only_partial` skips full chunks."""
    return [Stmt("zero_pad", s.dst, (), (("rows", "n_valid"), ("only_partial", only_partial)))
            for s in b.loads if s.op == "load"]


def _place_loads(b: _Builder, body: list, split_phase: bool) -> list:
    """The parallel kernels' statements, with their loads placed by shared-memory liveness.

    Without `split_phase` each block is loaded through registers right before its first reader,
    its padding rows zeroed on the way, so that blocks whose lives do not overlap share shared
    memory (the loads are synchronous: issuing them all first would hide no latency and keep every
    block alive through the whole kernel).

    With `split_phase` (the default, SPLIT_PHASE_LOADS) vectors are loaded first, and a block (the chunk's
    rows of a per-token tensor, or the state entering the chunk) is a TMA copy in two phases:
    issued as early as it fits under the kernel's peak of live shared memory, waited for right
    before its first reader, so its latency overlaps the work in between. A partial chunk's rows
    past the sequence belong to the next one (TMA cannot mask them): they are zeroed after the
    wait. An issue after other work is marked `sync`: its memory may be what an earlier block
    used, which other threads (or their wgmmas) may still be reading."""
    def rows(ld):  # a synchronous block load, masked to the chunk's rows on the way
        return Stmt(ld.op, ld.dst, ld.srcs, ld.attrs + (("rows", "n_valid"),)) if ld.op == "load" else ld

    out, pending, issues = [], list(b.loads), []
    for st in body:
        touched = _reads(st) | {st.dst}  # a write (a store staged in the block) needs the load first too
        for ld in [ld for ld in pending if ld.dst in touched]:
            pending.remove(ld)
            if split_phase and ld.op in ("load", "load_chunk_state"):
                issues.append(Stmt(ld.op, ld.dst, ld.srcs, ld.attrs + (("async", True),)))
                out.append(Stmt("wait_load", ld.dst))
                if ld.op == "load":
                    out.append(Stmt("zero_pad", ld.dst, (), (("rows", "n_valid"), ("only_partial", True))))
            else:
                out.append(rows(ld))
        out.append(st)
    if not split_phase:
        return [rows(ld) for ld in pending] + out
    out = pending + out
    # a vector is 256 bytes: all of them first, their global latencies overlapping each other's
    vectors = [st for st in out if st.op == "load_vec"]
    out = vectors + [st for st in out if st.op != "load_vec"]
    for issue in issues:
        at = _earliest_issue(b, out, issue.dst)
        after_work = any(not st.attr.get("async") for st in out[:at])
        out.insert(at, Stmt(issue.op, issue.dst, issue.srcs, issue.attrs + ((("sync", True),) if after_work else ())))
    return out


def _earliest_issue(b: _Builder, stmts: list, name: str) -> int:
    """Where the async load of block `name` may start: the first position from which, up to its
    wait, twice the block fits under the peak of live shared memory the statements already have,
    and not before the inverse (the usual peak). The margin and the stop are there because
    TileLang's allocator packs less tightly than this estimate: with the block allowed right up
    to the peak, GDN's backward prep took 8 KB more than it had, one CTA per SM less."""
    size = smem_bytes([b.buffers[name]], b.dims)
    live = _live_shared(b.buffers, stmts, b.dims)
    wait = next(i for i, st in enumerate(stmts) if st.op == "wait_load" and st.dst == name)
    peak = max(live, default=0)
    at = wait
    while at > 0 and live[at - 1] + 2 * size <= peak and stmts[at - 1].op != "inverse":
        at -= 1
    return at


def _live(buffers: dict, stmts: list, scope: str) -> list:
    """The buffers of `scope` live at each statement (from first touch to last)."""
    first, last = {}, {}
    for i, st in enumerate(stmts):
        for x in _reads(st) | {st.dst}:
            if x in buffers and buffers[x].scope == scope:
                first.setdefault(x, i)
                last[x] = i
    return [[buffers[x] for x in first if first[x] <= i <= last[x]] for i in range(len(stmts))]


def _live_fragments(buffers: dict, stmts: list, dims: dict) -> int:
    """Peak bytes of fragments (registers, over all threads) live at once."""
    return max((sum(buffer_bytes(b, dims) for b in bs) for bs in _live(buffers, stmts, "fragment")), default=0)


def _threads(b: _Builder, body: list) -> int:
    """A parallel kernel's threads: one warpgroup, or two where its live fragments would not fit
    one's registers (FRAGMENT_REGISTERS)."""
    return THREADS if _live_fragments(b.buffers, body, b.dims) <= FRAGMENT_REGISTERS * 4 * THREADS else 2 * THREADS


def _live_shared(buffers: dict, stmts: list, dims: dict) -> list:
    """Bytes of shared memory live at each statement: every shared buffer from its first touch
    (a load's issue) to its last, plus the scratch a building block (the inverse) allocates."""
    live = [smem_bytes(bs, dims) for bs in _live(buffers, stmts, "shared")]
    scratch = smem_bytes([Buffer("", shape, dt, scope) for scope, dt, shape in INVERSE_SCRATCH.values()], dims)
    return [n + (scratch if st.op == "inverse" else 0) for n, st in zip(live, stmts)]


def _reads(st: Stmt) -> set:
    """The buffers a statement reads: its sources and every buffer its expression names."""
    names = set(st.srcs)

    def walk(e):
        if isinstance(e, tuple):
            if len(e) >= 2 and e[0] == "buf":
                names.add(e[1])
            for x in e:
                walk(x)
    for _, v in st.attrs:
        walk(v)
    return names
