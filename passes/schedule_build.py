"""schedule's statement builder: one kernel's buffers and statements from a set of ChunkIR nodes,
by the placement rules schedule.py's docstring lists (what lives where, what is inlined, which
fragment a sum accumulates in)."""
from __future__ import annotations

import functools
import os
from dataclasses import replace

import networkx as nx

from qla_compiler.errors import PassError
from qla_compiler.ir.chunk import ChunkIR
from qla_compiler.ir.chunk_ops import DECAYED_PRODUCT, EXPONENTIALS
from qla_compiler.ir.kernel import Buffer, Stmt, Tensor
from qla_compiler.kernels.tri_inverse_scratch import INPUT_DTYPE as INVERSE_INPUT_DTYPE, INPUT_ROW_PAD as INVERSE_ROW_PAD
from qla_compiler.kernels.tri_inverse_scratch import TF32_FROM as INVERSE_TF32_FROM

from .chunk_per_key import shares_exponentials, sum_top
from .key_blocks import key_blocks
from .lowerable import on_sub_blocks

BLOCK_INPUT_SHAPE = {"key": ("C", "K"), "key_gate": ("C", "K"), "value": ("C", "V"), "cotangent_value": ("C", "V")}
# the scan's loop-carried state: its float32 fragment (the entering state's place, which the update
# accumulates into) and the io copy of it that wgmma reads (S0 as an operand; the chunk states stored)
STATE, STATE_IO = "state", "state_s"
# names the generated module already uses (TileLang's `T`, the size constants, loop variables)
RESERVED = {"T", "C", "K", "V", "H", "HV", "BV", "BK", "G", "IO", "SCALE", "STAGES", "SCAN_THREADS", "TOKEN_THREADS",
            "N", "NP1", "CH", "Tok", "i", "j", "i_k", "t0", "n_valid", "bos", "seq_len", "v0", "i_h", "i_hv", "i_n", "i_v",
            "i_c", "i_slot", "i_kb", "k0", "i_cta"}


def _dims(shape, tiled: bool, key_blocked: bool = False) -> tuple:
    """A value's shape as a buffer holds it: V as the V-block in the V-blocked (`tiled`) kernels,
    K as the key block in a kernel on key blocks."""
    return tuple("BV" if (d == "V" and tiled) else "BK" if (d == "K" and key_blocked) else d for d in shape)


class Builder:
    """Builds one kernel's buffers and statements from a set of ChunkIR nodes."""

    def __init__(self, ir: ChunkIR, nodes, loaded, tiled: bool, dims: dict, kept=(), key_blocked: bool = False):
        self.ir, self.nodes, self.loaded, self.tiled = ir, set(nodes), set(loaded), tiled
        self.key_blocked = key_blocked  # a kernel on blocks of K's columns (Kernel.key_block)
        # nodes another kernel loads from this one's store: their fragments hold them to the end
        # (nothing is computed over them in place)
        self.kept = set(kept)
        self.dims = dims  # the size of each dim name that shared memory and registers are budgeted at
        self.pipelined = tiled  # the V-blocked kernel is also the pipelined one
        self.buffers: dict[str, Buffer] = {}
        self.place: dict[str, str] = {}  # node -> buffer holding its value
        self.loads, self.copies, self.body = [], [], []
        self.users = {n: [u.name for u in ir.users(n) if u.name in self.nodes] for n in self.nodes}
        self.io_copy: dict[str, str] = {}  # node -> the shared io-dtype copy made for a wgmma

    def held_as(self, shape) -> tuple:
        """A value's shape as this kernel's buffers hold it (its V-block, its key block)."""
        return _dims(shape, self.tiled, self.key_blocked)

    def buf(self, name, shape, dtype, scope) -> str:
        name = ident(name)
        name = f"{name}_f" if name in RESERVED else name
        if name not in self.buffers:
            self.buffers[name] = Buffer(name, self.held_as(shape), dtype, scope)
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
            return () if s == () else idx[-len(s):]  # (a per-key vector against a C×K block: its column)

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
            if op != "neg" and inner.op == "ref_diff" and a[0] not in self.place:  # 0 off its rows
                return self._ref_rows(inner, idx, (op, self._ref_diff(inner, idx)), 0.0)
            return (op, self.ex(a[0], idx))
        if op == "scale_rows":
            return ("mul", self.ex(a[0], (idx[0],)), self.ex(a[1], idx))
        if op == "scale_cols":
            return ("mul", self.ex(a[0], idx), self.ex(a[1], (idx[1],)))
        if op == "masked_diff":
            sel = "select_lower" if n.attr["mask"] == "lower" else "select_strict"
            return (sel, idx[0], idx[1], self._diff(n, idx), ("lit", -1e30))
        if op == "ref_diff":
            return self._ref_rows(n, idx, self._ref_diff(n, idx), -1e30)
        if op == "keep":  # (select_rows on the row, or on the column index)
            at = n.attr
            return ("select_rows", idx[at["dim"]], at["lo"], at["hi"], self.ex(a[0], idx), ("lit", 0.0))
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
        if op == "last":  # (of a C×K block: its row, at this column)
            return self.ex(a[0], ("n_valid - 1", *idx[-1:]) if n.shape else ("n_valid - 1",))
        if op == "positions":
            return ("min_pos", idx[0])
        if op == "at_last":  # the scalar (or a K-vector's entry) at the chunk's last token, zero elsewhere
            return ("select_last", idx[0], self.ex(a[0], idx[1:]), ("lit", 0.0))
        if op == "valid":
            return ("select_valid", idx[0], ("lit", 1.0), ("lit", 0.0))
        raise PassError("schedule", f"node {name} ({op}) must be materialised before it is used")

    def _diff(self, n, idx):
        x = n.args[0]
        return ("sub", self.ex(x, (idx[0],)), self.ex(x, (idx[1],)))

    def _ref_diff(self, n, idx):
        """x_i − x_ref (later), or x_ref − x_i, at (i, column)."""
        x, ref = n.args[0], (str(n.attr["ref"]), *idx[1:])
        here, there = self.ex(x, idx), self.ex(x, ref)
        return ("sub", here, there) if n.attr["later"] else ("sub", there, here)

    @staticmethod
    def _ref_rows(n, idx, then, other: float):
        return ("select_rows", idx[0], n.attr["lo"], n.attr["hi"], then, ("lit", other))

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
        if n.op == "state_in" and self.place.get(name) == STATE:
            return STATE_IO
        src = self.reusable_block(name)
        if src is not None:  # write over the loaded block it is computed from
            reuse = self.place[src]
            self.ewise(reuse, name)
            del self.place[src]  # that buffer now holds `name`; a later read of src is an error
            self.place[name] = reuse
            return reuse
        held = self.place.get(name)
        dst = self.buf(f"{name}_io_s" if held == ident(f"{name}_s") else f"{name}_s", n.shape, "io", "shared")
        if dst not in [s.dst for s in self.body]:
            if held is not None:  # a float32 fragment or shared block: copy (and cast) it
                self.body.append(Stmt("copy", dst, (self.place[name],)))
            else:
                self.ewise(dst, name)
            self.io_copy[name] = dst
        return dst

    def low_part(self, args, operands, stored: bool = False):
        """The operands of A·B_lo when a state-chain product pairs a spec input A (exact in the io
        dtype) with a block B computed in float32: B ≈ B_hi + B_lo, two io roundings, so that
        A·B_hi + A·B_lo carries ~16 bits of B instead of 8. The state chain sums these products
        over every chunk (the backward's qᵀ(Γ ⊙ dO) sets d_S0's error); a tf32 product would need
        both operands in float32: twice the shared memory and half the tensor-core rate.
        `stored`: split only a state loaded in float32 (state_dtype), whatever the product: v·d Sᵀ
        sums over V for each key as the per-key Γ term does (GLA's d g at K = 256: 1.86e-3 with
        its bf16 copy, 1.52e-3 split; the emulator, session 38)."""
        exact = [self.ir.node(a).op == "input" for a in args]
        if exact.count(True) != 1:
            return None
        computed, hi = args[exact.index(False)], operands[exact.index(False)]
        held = self.place.get(computed)
        idx = ("i", "j")
        if held is not None and self.buffers[held].scope == "shared" and self.buffers[held].dtype == "float32" \
                and self.ir.node(computed).op == "state_in":
            value = ("buf", held, *idx)  # a state loaded in float32, beside its io copy
        elif stored or self.io_copy.get(computed) != hi or computed in self.place:
            return None  # loaded, or copied from a fragment: no float32 expression to split
        else:
            value = self.ex(computed, idx)
        lo = self.buf(f"{hi.removesuffix('_s')}_lo_s", self.ir.node(computed).shape, "io", "shared")
        residual = ("sub", value, ("buf", hi, *idx))
        self.body.append(Stmt("ewise", lo, (), (("expr", residual), ("index", idx))))
        return tuple(lo if o == hi else o for o in operands)

    def shared(self, name: str) -> str:
        """A float32 shared block holding `name`, for statements whose threads read other threads'
        elements (a prefix sum's rows, a last row, the diagonal sub-blocks' product)."""
        if name in self.place and self.buffers[self.place[name]].scope == "shared":
            return self.place[name]
        staged = self.buf(f"{name}_s", self.ir.node(name).shape, "float32", "shared")
        self.ewise(staged, name)
        self.place[name] = staged
        return staged

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
        if not loaded or buf.dtype != "io" or buf.shape != self.held_as(shape):
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
        ok = self.ir.node(f).op == "state_in" or (self.users[f] == [name] and f not in self.kept)
        return f if ok and self.ir.node(f).shape == self.ir.node(name).shape else None


def _accumulation(ir: ChunkIR, nodes, loaded=(), kept=()) -> dict:
    """add(x, A·B) with A·B computed here and used only there: A·B accumulates onto x (not onto
    a `kept` x, whose value must outlive the add). Returns {add: (x, matmul)}."""
    out = {}
    for name in nodes:
        n = ir.node(name)
        if n.op != "add":
            continue
        for x, m in (n.args, n.args[::-1]):
            mm = ir.node(m)
            if mm.op == "matmul" and m not in loaded and [u.name for u in ir.users(m)] == [name] \
                    and ir.node(x).shape == n.shape and x not in kept:
                out[name] = (x, m)
                break
    return out


def check_v_columns(ir: ChunkIR, nodes) -> None:
    for n in ir.of_op("matmul"):
        if n.name not in nodes:
            continue
        a, b = (ir.node(x).shape for x in n.args)
        inner = a[0] if n.attr.get("ta") else a[1]
        if inner == "V":
            raise PassError("schedule", f"{n.name} contracts over V; V-blocking the scan would be wrong")


def columns_mixed(ir: ChunkIR) -> str | None:
    """The first node of `ir` that reads a V-wide value and is not V-wide itself (a matmul over V,
    a reduction across it), or None: then column j of every output depends on column j of the
    V-wide inputs alone, so the program may run on column blocks of V as separate problems."""
    for n in ir.order():
        if "V" not in n.shape and any("V" in ir.node(a).shape for a in n.args):
            return n.name
    return None


def _running_sums(ir: ChunkIR, b: Builder, order: list, acc: dict) -> dict:
    """{root: [(leaf, factors, negated)]} for each linear combination of block terms (through adds,
    subtractions, negations and factors free of products, each node used once and none of them a
    wgmma accumulation) of which two or more leaves hold products: those would each hold a
    fragment until the whole expression. A term is `leaf` times its factors, negated or not. None
    reads a wgmma accumulation's operands (`acc`): those are one fragment, summed in place at the
    accumulation, not at a term's turn."""
    # whole: an accumulation's sum and base, and what another kernel loads from this one (b.kept,
    # stored from its own fragment: never flattened into its user's sum)
    whole = set(acc) | {x for x, _ in acc.values()} | b.kept
    summed_in_place = {x for pair in acc.values() for x in pair}

    @functools.cache  # (a DAG: without it, shared ancestors are walked once per path)
    def product(x) -> bool:  # a fragment of its own: a product (or one inlined into x)
        n = ir.node(x)
        return x not in b.place and (n.op in ("matmul", "contract") or any(product(a) for a in n.args))

    def linear(x, parent) -> bool:  # x's terms are the parent's (the parent a linear op over x)
        n, p = ir.node(x), ir.node(parent)
        return all(m.op in ("add", "sub", "neg", "mul") and (m.op != "mul" or sum(map(product, m.args)) == 1)
                   for m in (n, p)) and x not in whole and x not in b.place and b.users[x] == [parent] \
            and n.shape == p.shape and (p.op != "mul" or product(x))

    def terms(x, factors=(), negated=False):
        n = ir.node(x)
        if n.op == "mul":
            leaf, factor = n.args if product(n.args[0]) else n.args[::-1]
            parts = [(leaf, factors + (factor,), negated)]
        else:
            parts = [(a, factors, negated != (n.op == "neg" or (n.op == "sub" and k == 1)))
                     for k, a in enumerate(n.args)]
        return [t for a, f, neg in parts for t in (terms(a, f, neg) if linear(a, x) else [(a, f, neg)])]

    @functools.cache
    def in_place(x) -> bool:  # x reads (inlines) an accumulation's operand, or what this kernel lacks
        if x in b.place or x in acc or (ir.node(x).op in ("matmul", "contract") and x not in summed_in_place):
            return False  # (placed by its own statement, at its turn)
        return x in summed_in_place or x not in b.nodes or any(in_place(a) for a in ir.node(x).args)

    out = {}
    for n in order:
        if len(n.shape) != 2 or n.op not in ("add", "sub", "neg", "mul") or n.name in whole or n.name in b.place \
                or (n.op == "mul" and sum(map(product, n.args)) != 1) \
                or any(linear(n.name, u) for u in b.users[n.name]):
            continue  # (not a linear op, or a part of its user's)
        ts = terms(n.name)
        if sum(product(leaf) for leaf, _, _ in ts) >= 2 and not any(in_place(x) for t in ts for x in (t[0], *t[1])):
            out[n.name] = ts
    return out


def build(ir: ChunkIR, nodes, loaded, tiled: bool, dims: dict, vectors=(), running_sums: bool = False,
          kept=(), wide=(), key_blocked: bool = False):
    """Statements for the node set; returns the builder (buffers, loads, body). The V-blocked
    kernel is also the pipelined one (its loads run on a producer warpgroup). `vectors`: per-token
    vectors another role writes into shared memory each chunk (the fused kernel's loads role):
    read from `<name>_s`, not inlined. `running_sums`: a block summed from several products is a
    float32 fragment each term is added into once its own operands are ready (_running_sums),
    rather than one expression of every term at the end, which holds each term's fragment until
    then (KDA's backward out kernels: ten C×K partial sums live at once, 320 registers a thread,
    spilled). `kept`: nodes stored for another kernel (Builder.kept); `wide`: loaded nodes another
    kernel stored in float32. `key_blocked`: a kernel on blocks of K's columns, its K-wide buffers
    a block wide ("BK")."""
    b = Builder(ir, nodes, loaded, tiled, dims, kept, key_blocked)
    pipelined = tiled
    order = _pairs_together([n for n in ir.order() if n.name in b.nodes], ir)
    acc = _accumulation(ir, [n.name for n in order], b.loaded, b.kept)
    fused_matmuls = {m for _, m in acc.values()}
    in_place = {x for x, _ in acc.values()}

    for n in order:  # loads first: they are the producer's work
        src = global_name(ir, n.name)
        if n.name in vectors:
            b.place[n.name] = b.buf(f"{ident(n.name)}_s", ("C",), "float32", "shared")
            continue
        per_chunk = n.op == "input" and n.attr.get("kind") == "saved_state"
        if (n.op == "state_in" and n.name in b.loaded) or per_chunk:  # a state per chunk slot
            # a float32 state read here by tensor cores alone is cast to io on its way in
            # (state_dtype): no float32 copy in shared memory
            stored32 = state_dtype(ir, n.name) == "float32"
            held32 = stored32 and any(ir.node(u).op != "matmul" for u in b.users[n.name])
            b.place[n.name] = b.buf(f"{n.name}_s", n.shape, "float32" if held32 else "io", "shared")
            cast = (("cast", True),) if stored32 and not held32 else ()
            b.loads.append(Stmt("load_chunk_state", b.place[n.name], (src,), cast))
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
                wide_block = n.name in wide or log_space(ir, n.name)
                b.place[n.name] = b.buf(f"{n.name}_s", shape, "float32" if wide_block else "io", "shared")
                # a prefix sum's rows past the chunk hold its last (what zero-padded gates give; a zero
                # row would be a rise, and e^{γ_i − γ_ref} past the end could overflow)
                hold = n.op != "input" and log_space(ir, n.name)
                b.loads.append(Stmt("load", b.place[n.name], (src,), (("pad", "hold"),) if hold else ()))
        elif n.op == "state_in":
            b.place[n.name] = b.buf(STATE, n.shape, "float32", "fragment")

    linear_sums = _running_sums(ir, b, order, acc) if running_sums else {}
    at = {n.name: i for i, n in enumerate(order)}
    # each term is added once the loop has passed its leaf and its factors (all placed by then)
    due: dict = {}
    for root, ts in linear_sums.items():
        for t in ts:
            due.setdefault(max(at.get(x, -1) for x in (t[0], *t[1])), []).append((root, t))
    added: dict = {}

    def fresh(name: str) -> str:  # (a name no buffer and no node has: b.buf would share one that exists)
        while ident(name) in b.buffers or name in ir.graph:
            name += "_"
        return name

    totals = {root: fresh(f"{root}_sum") for root in linear_sums}

    def add_term(root, term):
        """Add `term` into its sum's float32 fragment; the last one places the sum there."""
        leaf, factors, negated = term
        total = b.buf(totals[root], ir.node(root).shape, "float32", "fragment")
        # (each operand indexed as its add or mul indexes it: a scalar, a per-column vector, a block)
        expr = b.ex(leaf, ("i", "j")[2 - len(ir.node(leaf).shape):])
        for f in factors:
            dims_ = len(ir.node(f).shape)
            expr = ("mul", b.ex(f, ("i", "j")[2 - dims_:] if dims_ else ()), expr)
        if added.get(root):
            expr = ("sub" if negated else "add", ("buf", total, "i", "j"), expr)
        elif negated:
            expr = ("neg", expr)
        b.body.append(Stmt("ewise", total, (), (("expr", expr), ("index", ("i", "j")))))
        added[root] = added.get(root, 0) + 1
        if added[root] == len(linear_sums[root]):
            b.place[root] = total

    for k, n in enumerate(order):
        for root, term in due.pop(k - 1, []):  # (the node before: its statements are all emitted)
            add_term(root, term)
        name, op = n.name, n.op
        if name in b.place:
            continue
        if op == "matmul":
            if name in fused_matmuls:
                continue  # emitted by its add
            A, B = b.operand(n.args[0]), b.operand(n.args[1])
            b.place[name] = b.buf(name, n.shape, "float32", "fragment")
            b.body.append(Stmt("gemm", b.place[name], (A, B), tuple(sorted(n.attrs))))
            low = b.low_part(n.args, (A, B), stored=True)
            if low is not None:
                b.body.append(Stmt("gemm", b.place[name], low, tuple(sorted(n.attrs)) + (("accumulate", True),)))
        elif op in ("cumsum", "rev_cumsum"):  # prefix sums, or suffix sums (a cumsum's VJP)
            src = b.shared(n.args[0])
            b.place[name] = b.buf(f"{name}_s", n.shape, "float32", "shared")
            b.body.append(Stmt("cumsum", b.place[name], (src,),
                               (("reverse", True),) if op == "rev_cumsum" else ()))
        elif op == "last" and len(ir.node(n.args[0]).shape) == 2:
            # a C×K block's last row, for every column: read across threads, so from shared memory
            # (a fragment's element lives in one thread); the row itself stays inlined
            b.shared(n.args[0])
        elif op == "contract":  # on the diagonal sub-blocks (passes/lowerable.py), R never stored
            if not on_sub_blocks(ir, n):
                raise PassError("schedule", f"{name} = contract[{n.attr['eq']}]: only the decayed products on the "
                                            "diagonal sub-blocks have a lowering (passes/lowerable.py)")
            X, Z, R = n.args
            diff = ir.node(ir.node(R).args[0])
            g = b.shared(diff.args[0])
            block = diff.attr["block"]
            attrs = (("block", block), ("eq", n.attr["eq"]), ("exp", ir.node(R).op))
            b.place[name] = b.buf(name, n.shape, "float32", "fragment")
            srcs = (b.operand(X), b.operand(Z), g)
            if n.attr["eq"] != DECAYED_PRODUCT and TRIANGLE_SLOTS:  # the VJP's products, by row pairs
                # (product_slots), stage their sums in a block of the result's shape
                # (not `_rows`: a handed-over product crosses memory under that name, global_name)
                attrs += (("scratch", ("buf", b.buf(f"{name}_sums", n.shape, "float32", "shared"))),)
            if n.attr["eq"] == DECAYED_PRODUCT:  # a C×C result, summed a thread a row: its rows'
                # sums reach the fragment's layout through shared memory (C × the block's columns)
                attrs += (("scratch", ("buf", b.buf(f"{name}_rows", ("C", str(block)), "float32", "shared"))),)
                # a product of the same Z and exponentials here (partition._sharing_exponentials)
                # runs in the same loop: one exponential an element for both
                m = next((m for m in order if m.name not in b.place and shares_exponentials(ir, name, m.name)), None)
                if m is not None:
                    b.place[m.name] = b.buf(m.name, m.shape, "float32", "fragment")
                    srcs += (b.operand(m.args[0]),)
                    attrs += (("second", ("buf", b.place[m.name])),
                              ("second_scratch", ("buf", b.buf(f"{m.name}_rows", ("C", str(block)), "float32",
                                                               "shared"))))
            b.body.append(Stmt("decayed_product", b.place[name], srcs, attrs))
        elif op == "inv_unit_lower":
            if ident(f"{n.args[0]}_s") in b.buffers:  # the inverse overwrites its input block
                raise PassError("schedule", f"{name}: the inverse's input {n.args[0]} needs a block of its own")
            A = b.buf(f"{n.args[0]}_s", n.shape, INVERSE_INPUT_DTYPE, "shared")
            b.buffers[A] = replace(b.buffers[A], row_pad=INVERSE_ROW_PAD)
            b.ewise(A, n.args[0])
            b.place[name] = b.buf(name, n.shape, "float32", "fragment")
            b.body.append(Stmt("inverse", b.place[name], (A,), (("tf32_from", INVERSE_TF32_FROM),)))
        elif name in acc:
            x, m = acc[name]
            mm = ir.node(m)
            A, B = b.operand(mm.args[0]), b.operand(mm.args[1])
            if x in b.place and b.buffers[b.place[x]].scope == "fragment":
                frag = b.place[x]
                attrs = tuple(sorted(mm.attrs)) + (("accumulate", True),)
                # (the backward's chain only: there it set d_S0's error, 2.5–4× FLA's without it;
                # the forwards' final states were within FLA's error, and each split costs a wgmma)
                low = b.low_part(mm.args, (A, B), stored=not (pipelined and frag == STATE and ir.reverse))
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
    for root, term in due.pop(len(order) - 1, []):
        add_term(root, term)
    return b


def _pairs_together(order: list, ir: ChunkIR) -> list:
    """Program order, with the sum built on a decayed product that shares another's Z and
    exponentials (build pairs the two: one loop) moved up beside the other's, each of its nodes
    right after its arguments: the sub-chunk blocks both sums read (KDA's k_upto_*) die there
    rather than after the inverse, and the second sum is stored before it. In program order,
    KDA's prep held 152 KB of shared memory (1 CTA an SM); so, 104 KB (2, as without the pair)."""
    names = [n.name for n in order]
    within = set(names)
    products = [n.name for n in order if n.op == "contract"]
    for i, n in enumerate(products):
        m = next((m for m in products[i + 1:] if shares_exponentials(ir, n, m)), None)
        if m is None:
            continue
        top_n, top_m = sum_top(ir, n, within), sum_top(ir, m, within)
        first, pos = nx.ancestors(ir.graph, top_n) | {top_n}, {x: k for k, x in enumerate(names)}
        second = nx.ancestors(ir.graph, top_m) | {top_m}
        moved = [x for x in names if x in second and x not in first and pos[x] > pos[top_n]]
        names = [x for x in names if x not in moved]
        for x in moved:  # each right after the last of its arguments: P_1 beside KKt_R_1, …
            at = max((names.index(a) for a in ir.node(x).args if a in within), default=-1) + 1
            names.insert(at, x)
    return [ir.node(x) for x in names]


# Where a decayed product's block is cut for its threads (lower_tilelang's templates). A C×C
# product: a thread a row walking every column of its block (a 16-block's 256 elements, 120 of
# them past the diagonal and discarded), or "triangle", the block's lower triangle alone (136
# elements) dealt to the threads in B/2 × B/2 tiles: the full tile under the diagonal, and the two
# triangles on it folded into one square (the first's rows beside the second's, reversed); each
# thread then takes half the exponentials and sums, and reads Z and γ two keys at a time. The
# VJP's products (a C×K result): every element walking all B of its block's m, half of them
# selected away, or "row_pairs", a thread a pair of rows r and B−1−r walking only their terms
# (B + 1 for the two). Both by default: on the H100 (session 40, 16/16:8x4096) KDA's training step
# 11.34 → 9.93 ms, GLA's 6.34 → 5.34 (the key gradients' kernels 5.61 → 4.23 and 3.34 → 2.52),
# KDA's forward 2.18 → 2.13; QLA_TRIANGLE_SLOTS=0 turns both off.
TRIANGLE_SLOTS = os.environ.get("QLA_TRIANGLE_SLOTS", "1") == "1"
CHUNK_ROWS = 64  # the chunk the kernels' thread mappings are built for


def product_slots(body: list, threads, triangle: bool = TRIANGLE_SLOTS) -> list:
    """The body with each decayed product marked with the slots its threads take (attribute
    `slots`; unmarked, the templates that walk whole blocks), where asked: a C×C product's
    "triangle" where its tiles fit whole warps' lanes (threads a multiple of C, each tile row's B/2
    columns dealt evenly to threads / C lanes); a VJP's product staged in a scratch block its
    "row_pairs" (threads a multiple of the chunk's C/2 row pairs)."""
    def slots(st):
        if not (triangle and st.op == "decayed_product" and isinstance(threads, int) and st.attr["block"] % 2 == 0):
            return None
        if st.attr["eq"] == DECAYED_PRODUCT:
            fits = threads % CHUNK_ROWS == 0 and (st.attr["block"] // 2) % (threads // CHUNK_ROWS) == 0
            return "triangle" if fits else None
        return "row_pairs" if "scratch" in st.attr and threads % (CHUNK_ROWS // 2) == 0 else None
    bare = [replace(st, attrs=tuple(a for a in st.attrs if a[0] != "slots")) for st in body]  # (marked again)
    return [st if how is None else replace(st, attrs=st.attrs + (("slots", how),))
            for st, how in ((st, slots(st)) for st in bare)]


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


# The parallel kernels' grid, its first axis the fastest in launch order. With the value heads
# first (QLA_HEADS_FIRST=1), the G value heads of a chunk run as neighbouring CTAs and read its
# q and k blocks from L2 after the first: H100, 16/64:8x4096, GDN's backward out kernel 4.293 ->
# 4.145 ms, the backward prep 0.467 -> 0.443, the forward's prep 0.579 -> 0.569, the training
# step 8.353 -> 8.165 (benchmarks/grid_order.py, session 52; its launch was 2-D there, the
# lowering's is one axis: NOTES). Kernels on key blocks keep theirs (the key blocks of a chunk
# side by side already share its K-free blocks through L2).
HEADS_FIRST = os.environ.get("QLA_HEADS_FIRST", "0") != "0"


def parallel_grid(key_block: bool = False) -> tuple:
    """The grid of a kernel parallel over chunk slots, as (axis, extent) pairs, fastest first."""
    if key_block:
        return ("key_block", "K/BK"), ("chunk_slot", "CH"), ("value_head", "HV")
    return (("value_head", "HV"), ("chunk_slot", "CH")) if HEADS_FIRST else (("chunk_slot", "CH"), ("value_head", "HV"))


CHUNK_MAP = Tensor("chunk_map", ("CH", "2"), "int32", "in", "(first token, tokens) of every chunk slot")
# what a kernel that stores or loads the state entering each chunk indexes its slots by
CHUNK_OFFSETS = Tensor("chunk_offsets", ("N+1",), "int32", "in", "chunk slot of each sequence's first chunk")


def store_rows(ir: ChunkIR, b: Builder, name: str) -> Stmt:
    """The store of a value crossing memory from its block: per-token rows, or a per-token vector."""
    if ir.node(name).shape == ("C",):
        return Stmt("store_vec", global_name(ir, name), (b.place[name],), (("rows", "n_valid"),))
    return Stmt("store", global_name(ir, name), (b.place[name],), (("rows", "n_valid"),))


# ---- the kernels' parameters ---------------------------------------------------------------------
def log_space(ir: ChunkIR, name: str) -> bool:
    """A block of the gates alone (a per-key cumulative gate γ, a difference of it): it is
    exponentiated later, so it stays float32 wherever it is stored (in bf16 a γ of −300 would
    be off by 1 before its exponential)."""
    n = ir.node(name)
    if len(n.shape) != 2:
        return False
    inputs = [ir.node(a) for a in nx.ancestors(ir.graph, name) | {name} if ir.node(a).op == "input"]
    return bool(inputs) and all(i.attr["kind"] in ("gate", "key_gate") for i in inputs)


def state_dtype(ir: ChunkIR, name: str) -> str:
    """The dtype a chunk state `name` (the entering state, or a backward's saved one) crosses memory
    in: its node's `stored` attribute where it has one (the training forward's entering state, when
    its backward reads the saved state so: Program.training_program); float32 where the program sums
    it, element-wise times another state, over V into one value per key (a per-key gate's Γ term,
    Σ_v S0 ⊙ dS) and the state's rows never mix (key_blocks: no delta rule); else the io dtype.
    There each row of the state is a decayed sum of k_t[k]·v_tᵀ, as large as the gate's horizon
    makes it, and the Γ term, each key's share of its gate's gradient, is a small difference of
    large products: in bf16 GLA's d g at K = 256 was 2.2e-3 against FLA's 1.35e-3, 1.5e-3 with
    d S in float32 (sessions 37–38; FLA's GLA keeps its states in float32 for this term). A delta
    rule holds the state near the values (S k ≈ v): KDA's d g gains 10% so and matches FLA's in
    bf16; a scalar gate's Γ term sums all K·V products and matches FLA's too. Both states of the
    term count: with d S in float32 and the saved S0 in bf16, GLA's d g over 2500 tokens with half
    the keys at g = 0 (K = 128) was 1.7e-3 against FLA's 5.9e-4 (H100, session 41); emulated,
    1.5e-3 so and 3.4e-4 with S0 in float32 too."""
    stored = ir.node(name).attr.get("stored")
    if stored is not None:
        return stored
    per_key = any(ir.node(u).op == "mul" and all(ir.node(a).shape == ("K", "V") for a in ir.node(u).args)
                  and any(ir.node(r).op == "rowsum" for r in ir.graph.successors(u))
                  for u in ir.graph.successors(name))
    return "float32" if per_key and key_blocks(ir)[0] is not None else "io"


def crossing_tensor(ir: ChunkIR, name: str, role: str, wide: bool = False) -> Tensor:
    """The global tensor `name` crosses memory in between kernels; `wide`: in float32 whatever it
    holds (a block one out kernel stores for another, as the fragment holds it)."""
    n, g = ir.node(name), global_name(ir, name)
    if wide:
        return Tensor(g, ("1", "T", "HV", n.shape[1]), "float32", role,
                      "rows of the chunk's block, per token, float32 (one out kernel's, for another)", padded=True)
    if n.op == "state_in":
        return Tensor(g, ("CH", "HV", "K", "V"), state_dtype(ir, name), role, "the state entering every chunk",
                      padded=True)
    if n.shape == ("C",):
        return Tensor(g, ("1", "T", "HV"), "float32", role, "per token")
    if log_space(ir, name):
        return Tensor(g, ("1", "T", "HV", n.shape[1]), "float32", role, "rows of the chunk's log-space block, per token",
                      padded=True)
    return Tensor(g, ("1", "T", "HV", n.shape[1]), "io", role, "rows of the chunk's block, per token", padded=True)


def input_params(ir: ChunkIR, nodes, loaded, wide=()) -> list:
    ps = []
    for name in nodes:
        n = ir.node(name)
        if n.op == "input" and n.attr["kind"] == "saved_state":
            ps.append(Tensor(global_name(ir, name), ("CH", "HV", "K", "V"), state_dtype(ir, name), "in",
                             "the forward's state entering every chunk", padded=True))
        elif n.op == "input":
            kind = n.attr["kind"]
            shape = {"key": ("1", "T", "H", "K"), "value": ("1", "T", "HV", "V"), "key_gate": ("1", "T", "HV", "K"),
                     "cotangent_value": ("1", "T", "HV", "V")}.get(kind, ("1", "T", "HV"))
            blocks = kind in ("key", "value", "cotangent_value")  # (a key gate: float32, as given)
            ps.append(Tensor(name, shape, "io" if blocks else "float32", "in"))
        elif name in loaded:
            ps.append(crossing_tensor(ir, name, "in", wide=name in wide))
    return ps


def head_params(ir: ChunkIR, nodes) -> list:
    return [Tensor(f"log_{n.attr['name']}", ("HV",), "float32", "in", "log of the per-head decay")
            for n in ir.of_op("head_log") if n.name in nodes]
