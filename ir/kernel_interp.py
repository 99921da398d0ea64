"""The KernelIR interpreter: runs a kernel's statements, as the lowering renders them, in float64.

Each statement has one meaning here and one template in passes/lower_tilelang.py. The interpreter
runs the statements themselves, so a wrong index, mask, zero-padding or order in the schedule
changes its result the way it would change the GPU's. Re-evaluating the chunk program would hide
such a mistake (qla_compiler/emulate.py runs every kernel through here).

Every point of the grid runs at once: a buffer is a tensor [points, *its shape]. A parallel kernel's
points are (chunk slot, value head), or (chunk slot, key block, value head) on key blocks. A scan's
points are (V-block, value head, sequence), and they walk their sequences' chunks together; a point
whose sequence has no chunk left keeps its buffers and stores nothing. Blocks in the io dtype are
held exactly: the rounding this models is that of the global tensors, which keep their dtypes.

    >>> run_kernel(kernel, tensors, Sizes(K=128, V=128, BV=32, HV=8, G=4), scale=0.088)   # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .chunk_ops import OPS
from .kernel import Kernel, Stmt

F64 = torch.float64


@dataclass(frozen=True)
class Sizes:
    """What the kernels are specialised for: the head dims' tiles (K, V), the V-block, the value
    heads (HV) and those per query/key head (G), the chunk; `head_logs`: the head constants
    (name -> [HV])."""
    K: int
    V: int
    BV: int
    HV: int
    G: int
    C: int = 64
    head_logs: dict = field(default_factory=dict)
    # None: every buffer exact (float64). Else the io dtype (torch.bfloat16, torch.float16): each
    # buffer is rounded to its own dtype whenever a statement writes it (io, float32, tf32), as on
    # the GPU, so the interpreter predicts the kernels' rounding error. Products accumulate exactly
    # (the GPU's float32 accumulation adds less than the rounding of their operands); the
    # triangular inverse runs the kernel's method: 16-blocks by substitution, exact (its float32
    # sums err by a few units of 2⁻²⁴: kernels/tri_inverse.py), and merges T₂₁ = −T₂₂ (A₂₁ T₁₁)
    # whose operands blocks of `tf32_from` and wider are rounded to tf32, as the kernel stages them.
    rounding: torch.dtype | None = None
    # the key block of the kernel running (Kernel.key_block, at most K; run_kernel sets it)
    BK: int = 0

    def of(self, dim: str) -> int:
        if dim.isdigit():  # a building block's literal size (a decayed product's sub-block: "16")
            return int(dim)
        return {"C": self.C, "K": self.K, "V": self.V, "BV": self.BV, "BK": self.BK}[dim]


class InterpretError(RuntimeError):
    """A statement the interpreter cannot run as written (names the kernel and the statement)."""


class _Point:
    """The per-point scalars of the lowering (t0, n_valid, i_hv, ...), each a long tensor [points]."""

    def __init__(self, **values):
        self.__dict__.update(values)


class _Run:
    def __init__(self, kernel: Kernel, tensors: dict, sizes: Sizes, scale: float, at: _Point, n: int):
        self.k, self.g, self.sz, self.scale, self.at, self.n = kernel, tensors, sizes, scale, at, n
        self.dev = next(iter(tensors.values())).device
        self.params = {p.name: p for p in kernel.params}
        self.buf = {b.name: torch.zeros(n, *[sizes.of(d) for d in b.shape], dtype=F64, device=self.dev)
                    for b in kernel.buffers}
        self.dtypes = {b.name: b.dtype for b in kernel.buffers}
        self.scan = kernel.loop is not None

    # ---- global memory ---------------------------------------------------------------------------
    def _head(self, name):
        return self.at.i_h if self.params[name].shape[2] == "H" else self.at.i_hv

    def _columns(self, name):
        """The block's columns of a per-token tensor [1, T, heads, D] at every point, [points, width]."""
        p = self.params[name]
        if p.shape[3] == "V" and self.scan:
            # (a tensor's zero columns are not in memory: its columns start that much later)
            start = self.at.v0 - (self.sz.of(p.zero_columns) if p.zero_columns else 0)
            return start[:, None] + torch.arange(self.sz.BV, device=self.dev)
        if p.shape[3] == "K" and self.k.key_block:  # the CTA's key block
            return self.at.k0[:, None] + torch.arange(self.sz.BK, device=self.dev)
        return torch.arange(self.sz.of(p.shape[3]), device=self.dev).expand(self.n, -1)

    def _rows(self):
        return self.at.t0[:, None] + torch.arange(self.sz.C, device=self.dev)  # [points, C]

    def read_block(self, name):
        """The chunk's rows of a per-token tensor; rows past the tensor and columns outside it (past
        its head dim, before its first: zero columns) read zeros (TMA fills them; a masked load
        writes them)."""
        x = self.g[name][0]
        rows, cols = self._rows(), self._columns(name)
        ok = (rows < x.shape[0])[:, :, None] & ((cols >= 0) & (cols < x.shape[2]))[:, None, :]
        r = rows.clamp(max=x.shape[0] - 1)[:, :, None]
        c = cols.clamp(min=0, max=x.shape[2] - 1)[:, None, :]
        return torch.where(ok, x[r, self._head(name)[:, None, None], c].to(F64), 0.0)

    def write_block(self, name, value):
        x = self.g[name]
        rows, cols = self._rows(), self._columns(name)
        ok = self._valid_rows()[:, :, None] & (cols < x.shape[3])[:, None, :] & self.at.active[:, None, None]
        r, c = rows[:, :, None].expand_as(ok), cols[:, None, :].expand_as(ok)
        h = self._head(name)[:, None, None].expand_as(ok)
        x[0, r[ok], h[ok], c[ok]] = value[ok].to(x.dtype)

    def _pad(self, block, attrs):
        """What a block's rows past the chunk hold: zeros, or (pad=hold, a prefix sum) its last row."""
        if attrs.get("pad") != "hold":
            return torch.zeros((), dtype=block.dtype, device=block.device)
        last = (self.at.n_valid - 1).clamp(min=0)
        return block[torch.arange(self.n, device=self.dev), last][:, None]

    def _valid_rows(self):
        return torch.arange(self.sz.C, device=self.dev)[None, :] < self.at.n_valid[:, None]

    def _state_rows(self):
        """The state's rows a point holds, [points, rows]: all K, or its key block's."""
        if self.k.key_block:
            return self.at.k0[:, None] + torch.arange(self.sz.BK, device=self.dev)
        return torch.arange(self.sz.K, device=self.dev).expand(self.n, -1)

    def _state_slice(self, x, first, points_cols):
        """x[first, i_hv, rows, cols] at every point (_state_rows), zeros past x's own K and V."""
        rows = self._state_rows()
        ok = (rows < x.shape[2])[:, :, None] & (points_cols < x.shape[3])[:, None, :]
        v = x[first[:, None, None], self.at.i_hv[:, None, None], rows.clamp(max=x.shape[2] - 1)[:, :, None],
              points_cols.clamp(max=x.shape[3] - 1)[:, None, :]]  # (gathered before the cast: a pool is large)
        return torch.where(ok, v.to(F64), 0.0)

    def _state_cols(self, width):
        base = self.at.v0 if self.scan else torch.zeros_like(self.at.i_hv)
        return base[:, None] + torch.arange(width, device=self.dev)

    def _write_state(self, x, first, value):
        K, width = value.shape[1], value.shape[2]
        rows = self._state_rows()[:, :, None].expand(self.n, K, width)
        cols = self._state_cols(width)[:, None, :].expand(self.n, K, width)
        ok = (rows < x.shape[2]) & (cols < x.shape[3]) & self.at.active[:, None, None]
        f = first[:, None, None].expand_as(ok)
        h = self.at.i_hv[:, None, None].expand_as(ok)
        x[f[ok], h[ok], rows[ok], cols[ok]] = value[ok].to(x.dtype)

    # ---- expressions -------------------------------------------------------------------------------
    def _index(self, e, loop):
        if e in loop:
            return loop[e]
        if e == "n_valid - 1":
            return (self.at.n_valid - 1).clamp(min=0).view(-1, *[1] * len(loop))
        if e.isdigit():
            return torch.tensor(int(e), device=self.dev)
        raise InterpretError(f"{self.k.name}: no meaning for the index {e!r}")

    def expr(self, e, loop):
        tag = e[0]
        point = torch.arange(self.n, device=self.dev).view(-1, *[1] * len(loop))
        if tag == "buf":
            b = self.buf[e[1]]
            if len(e) == 2:
                return b.view(self.n, *[1] * len(loop)) if b.dim() == 1 else b
            return b[(point, *[self._index(i, loop) for i in e[2:]])]
        if tag == "lit":
            return torch.tensor(float(e[1]), dtype=F64, device=self.dev)
        if tag == "param":
            if e[1] != "scale":
                raise InterpretError(f"{self.k.name}: no value for the parameter {e[1]!r}")
            return torch.tensor(self.scale, dtype=F64, device=self.dev)
        if tag == "head":
            logs = torch.as_tensor(self.sz.head_logs[e[1]], dtype=F64, device=self.dev)
            return logs[self.at.i_hv].view(-1, *[1] * len(loop))
        sub = [self.expr(x, loop) for x in e[1:] if isinstance(x, tuple)]
        if tag in ("add", "sub", "mul", "max"):
            a, b = sub
            return {"add": a + b, "sub": a - b, "mul": a * b, "max": torch.maximum(a, b)}[tag]
        if tag == "above":
            return (sub[0] > sub[1]).to(F64)
        if tag in ("neg", "exp", "exp2"):
            value = {"neg": torch.neg, "exp": torch.exp, "exp2": torch.exp2}[tag](sub[0])
            # as the GPU computes it: in float32, where e^{89} is already inf (and inf · 0 is NaN)
            return value.float().to(F64) if tag != "neg" and self.sz.rounding is not None else value
        if tag in ("select_lower", "select_strict"):
            i, j = self._index(e[1], loop), self._index(e[2], loop)
            return torch.where(j <= i if tag == "select_lower" else j < i, *sub)
        n_valid = self.at.n_valid.view(-1, *[1] * len(loop))
        if tag == "select_valid":
            return torch.where(self._index(e[1], loop) < n_valid, *sub)
        if tag == "select_last":
            return torch.where(self._index(e[1], loop) == n_valid - 1, *sub)
        if tag == "select_rows":
            i = self._index(e[1], loop)
            return torch.where((i >= int(e[2])) & (i < int(e[3])), *sub)
        if tag == "min_pos":
            return torch.minimum(self._index(e[1], loop) + 1, n_valid).to(F64)
        raise InterpretError(f"{self.k.name}: no meaning for the expression {tag!r}")

    def _loop(self, dst, index):
        shape = self.buf[dst].shape[1:]
        return {name: torch.arange(size, device=self.dev).view(1, *[size if d == k else 1 for d in range(len(shape))])
                for k, (name, size) in enumerate(zip(index, shape))}

    # ---- statements ----------------------------------------------------------------------------------
    def stmt(self, s: Stmt):
        a, b = s.attr, self.buf
        if s.op == "load":
            block = self.read_block(s.srcs[0])
            if a.get("rows"):  # a synchronous load masked to the chunk's rows
                block = torch.where(self._valid_rows()[:, :, None], block, self._pad(block, a))
            b[s.dst] = block
        elif s.op == "load_vec":
            x = self.g[s.srcs[0]][0].to(F64)
            rows = self._rows().clamp(max=x.shape[0] - 1)
            v = x[rows, self.at.i_hv[:, None]]
            if a.get("pad") == "hold":
                last = (self.at.t0 + (self.at.n_valid - 1).clamp(min=0)).clamp(max=x.shape[0] - 1)
                pad = x[last, self.at.i_hv][:, None]
            else:
                pad = torch.zeros((), dtype=F64, device=self.dev)
            b[s.dst] = torch.where(self._valid_rows(), v, pad)
        elif s.op == "load_token":  # (the current token's row, or a later one's: attribute ahead)
            x = self.g[s.srcs[0]][0].to(F64)
            ahead = a.get("ahead", 0)
            row = (self.at.t0 + ahead).clamp(max=x.shape[0] - 1)
            if x.dim() == 2:  # a scalar of the token
                value = x[row, self.at.i_hv][:, None]
            else:
                cols = self._columns(s.srcs[0])
                ok = cols < x.shape[2]
                value = torch.where(ok, x[row[:, None], self._head(s.srcs[0])[:, None], cols.clamp(max=x.shape[2] - 1)], 0.0)
            within = (self.at.token + ahead < self.at.seq_len)[:, None]  # past the sequence: nothing loaded
            b[s.dst] = torch.where(within, value, b[s.dst])
        elif s.op == "store_token":
            x = self.g[s.dst]
            cols = self._columns(s.dst)
            ok = (cols < x.shape[3]) & self.at.active[:, None]
            rows, h = self.at.t0[:, None].expand_as(ok), self.at.i_hv[:, None].expand_as(ok)
            x[0, rows[ok], h[ok], cols[ok]] = b[s.srcs[0]][ok].to(x.dtype)
        elif s.op == "load_slot":  # a sequence's entry, or the token's (−1 past L; past the sequence: nothing)
            x = self.g[s.srcs[0]].long()
            if x.dim() == 1:
                b[s.dst] = x[self.at.i_n].to(F64)[:, None]
            else:
                ahead = a.get("ahead", 0)
                t = self.at.token + ahead
                value = torch.where(t < x.shape[1], x[self.at.i_n, t.clamp(max=x.shape[1] - 1)], -1)
                within = (t < self.at.seq_len)[:, None]
                b[s.dst] = torch.where(within, value.to(F64)[:, None], b[s.dst])
        elif s.op in ("load_state", "store_state") and a.get("slot"):
            self._pool_state(s, a["slot"])
        elif s.op == "load_chunk_state":
            b[s.dst] = self._state_slice(self.g[s.srcs[0]], self.at.i_slot, self._state_cols(b[s.dst].shape[2]))
        elif s.op == "load_state":
            b[s.dst] = self._state_slice(self.g[s.srcs[0]], self.at.i_n, self._state_cols(b[s.dst].shape[2]))
        elif s.op == "wait_load":
            pass  # the statements run in order: a block has landed by its next statement
        elif s.op == "zero_pad":
            x = b[s.dst]
            b[s.dst] = torch.where(self._valid_rows().view(self.n, -1, *[1] * (x.dim() - 2)), x, self._pad(x, a))
        elif s.op == "copy":
            b[s.dst] = b[s.srcs[0]].clone()
        elif s.op == "gemm":
            x, y = b[s.srcs[0]], b[s.srcs[1]]
            prod = (x.mT if a.get("ta") else x) @ (y.mT if a.get("tb") else y)
            b[s.dst] = b[s.dst] + prod if a.get("accumulate") else prod
        elif s.op == "ewise":
            value = self.expr(a["expr"], self._loop(s.dst, a["index"]))
            b[s.dst] = value.expand_as(b[s.dst]).clone()
        elif s.op == "cumsum":  # along the chunk (a C×K block's rows, per key)
            x = b[s.srcs[0]]
            b[s.dst] = x.flip(1).cumsum(1).flip(1) if a.get("reverse") else x.cumsum(1)
        elif s.op == "decayed_product":  # einsum(eq) with R_ijk = e^{γ_ik − γ_jk} on the diagonal sub-blocks, j ≤ i
            x, z, g = (b[n] for n in s.srcs[:3])
            d = OPS["masked_diff"].eval(None, (g,), {"mask": "lower", "block": int(a["block"])}, (("C", "K"),))
            exp = {"exp": torch.exp, "exp2": torch.exp2}[a["exp"]]
            ins, out = a["eq"].split("->")
            eq = ",".join(f"n{t}" for t in ins.split(",")) + f"->n{out}"
            b[s.dst] = torch.einsum(eq, x, z, exp(d))
            if a.get("second"):  # X2's product with the same Z and exponentials, into a float32 fragment
                second = torch.einsum(eq, b[s.srcs[3]], z, exp(d))
                b[a["second"][1]] = second.float().to(F64) if self.sz.rounding is not None else second
        elif s.op == "reduce":
            src, *accs = s.srcs
            prev = b[src]
            for k, dim in enumerate(a["dims"]):  # one accumulator per reduction, or straight into dst
                prev = prev.sum(dim + 1) if prev.dim() > 1 else prev
                if k < len(accs):
                    b[accs[k]] = prev.reshape(b[accs[k]].shape)
            b[s.dst] = prev.reshape(b[s.dst].shape)
        elif s.op == "inverse":
            x = torch.tril(b[s.srcs[0]], -1)
            b[s.dst] = _unit_lower_inverse(x, a["tf32_from"]) if self.sz.rounding is not None else _exact_inverse(x)
            # the building block builds T in its input's place: what the input held is gone, and a
            # statement that read it afterwards would read NaN here (kernels/tri_inverse.py)
            b[s.srcs[0]] = torch.full_like(b[s.srcs[0]], float("nan"))
        elif s.op == "store":
            self.write_block(s.dst, -b[s.srcs[0]] if a.get("negate") else b[s.srcs[0]])
        elif s.op == "store_vec":
            x = self.g[s.dst]
            ok = self._valid_rows() & self.at.active[:, None]
            rows, h = self._rows().expand_as(ok), self.at.i_hv[:, None].expand_as(ok)
            x[0, rows[ok], h[ok]] = b[s.srcs[0]][ok].to(x.dtype)
        elif s.op == "store_chunk_state":
            self._write_state(self.g[s.dst], self.at.i_slot, b[s.srcs[0]])
        elif s.op == "store_state":
            self._write_state(self.g[s.dst], self.at.i_n, b[s.srcs[0]])
        else:
            raise InterpretError(f"{self.k.name}: no meaning for the statement {s.op!r}")

    def _pool_state(self, s: Stmt, slots: str):
        """A token step's state from or into its pool slot: the tensor read_slot[n] (−1: the zero
        state) for a load; for a store the slot buffer a load_slot filled (−1: not stored)."""
        b, cols = self.buf, self._state_cols(self.sz.BV)
        if s.op == "load_state":
            slot = self.g[slots].long()[self.at.i_n]
            state = self._state_slice(self.g[s.srcs[0]], slot.clamp(min=0), cols)
            b[s.dst] = torch.where((slot >= 0)[:, None, None], state, 0.0)
            return
        slot = b[slots][:, 0].long()
        active = self.at.active
        self.at.active = active & (slot >= 0)
        self._write_state(self.g[s.dst], slot.clamp(min=0), b[s.srcs[0]])
        self.at.active = active

    def _round(self, name: str):
        dtype = self.dtypes.get(name)
        x = self.buf[name]
        if dtype == "io":
            self.buf[name] = x.to(self.sz.rounding).to(F64)
        elif dtype == "float32":
            self.buf[name] = x.float().to(F64)
        elif dtype == "tfloat32":  # 10 mantissa bits, rounded to nearest
            bits = x.float().view(torch.int32)
            self.buf[name] = ((bits + 0x1000) & ~0x1FFF).view(torch.float32).to(F64)

    def block(self, stmts):
        for s in stmts:
            try:
                self.stmt(s)
                if self.sz.rounding is not None and s.dst in self.buf:
                    self._round(s.dst)
            except InterpretError:
                raise
            except Exception as err:  # name the statement: the message alone rarely says which
                raise InterpretError(f"{self.k.name}: `{s}` failed: {type(err).__name__}: {err}") from err


def _run_token_step(kernel: Kernel, tensors: dict, sizes: Sizes, scale: float) -> None:
    """Every (V-block, value head, sequence) walks its sequence's tokens; a padding entry
    (read_slot −2) runs the kernel's padding statements instead. The prologue runs at the first
    token (its token loads load it, where the sequence has one)."""
    dev = tensors["cu_seqlens"].device
    cu = tensors["cu_seqlens"]
    cu = (cu[:, 0] if cu.dim() == 2 else cu).long()  # ([N+1, W]: an int64's words, the low one first)
    N = cu.numel() - 1
    grid = torch.cartesian_prod(torch.arange(sizes.V // sizes.BV), torch.arange(sizes.HV),
                                torch.arange(N)).to(dev).view(-1, 3)
    i_v, i_hv, i_n = grid.unbind(1)
    bos, seq_len = cu[i_n], cu[i_n + 1] - cu[i_n]
    slot = next(s for s in kernel.prologue if s.op == "load_state").attr["slot"]  # (as the lowering reads it)
    runs = tensors[slot].long()[i_n] != -2
    at = _Point(i_hv=i_hv, i_h=i_hv // sizes.G, i_n=i_n, v0=i_v * sizes.BV, t0=bos, token=torch.zeros_like(i_n),
                seq_len=seq_len, n_valid=torch.ones_like(i_n), active=runs)
    run = _Run(kernel, tensors, sizes, scale, at, len(grid))
    run.block(kernel.prologue)

    def token_by_token(points, stmts):
        # the points whose sequence has this token run it; the others' buffers keep their values
        for step in range(int(seq_len.max()) if len(grid) else 0):
            at.active = points & (step < seq_len)
            at.token, at.t0 = torch.full_like(i_n, step), bos + step
            kept = {name: x.clone() for name, x in run.buf.items()}
            run.block(stmts)
            for name, x in run.buf.items():
                run.buf[name] = torch.where(at.active.view(-1, *[1] * (x.dim() - 1)), x, kept[name])

    token_by_token(runs, kernel.body)
    at.active = runs
    run.block(kernel.epilogue)
    if kernel.padding:
        token_by_token(~runs, kernel.padding)


def run_kernel(kernel: Kernel, tensors: dict, sizes: Sizes, scale: float) -> None:
    """Run `kernel` on `tensors` (its parameters by name, torch tensors as the runtime passes them);
    writes its outputs in place."""
    if kernel.kind == "token_step":
        return _run_token_step(kernel, tensors, sizes, scale)
    if kernel.warp_roles:
        from .kernel_interp_roles import run_roles  # (it builds on this module)
        return run_roles(kernel, tensors, sizes, scale)
    dev = next(iter(tensors.values())).device
    if kernel.loop is None:
        cmap = tensors["chunk_map"].long()
        CH, HV = cmap.shape[0], sizes.HV
        if kernel.key_block:  # every (chunk slot, key block, value head)
            sizes = replace(sizes, BK=min(kernel.key_block, sizes.K))
        blocks = sizes.K // sizes.BK if kernel.key_block else 1
        slot, i_kb, i_hv = torch.cartesian_prod(torch.arange(CH), torch.arange(blocks),
                                                torch.arange(HV)).to(dev).view(-1, 3).unbind(1)
        at = _Point(t0=cmap[slot, 0], n_valid=cmap[slot, 1], i_hv=i_hv, i_h=i_hv // sizes.G, i_slot=slot,
                    k0=i_kb * sizes.BK, active=torch.ones(len(slot), dtype=torch.bool, device=dev))
        run = _Run(kernel, tensors, sizes, scale, at, len(slot))
        run.block(kernel.prologue + kernel.body + kernel.epilogue)
        return
    cu = tensors["cu_seqlens"].long()
    N, HV = cu.numel() - 1, sizes.HV
    nV = sizes.V // sizes.BV
    grid = torch.cartesian_prod(torch.arange(nV), torch.arange(HV), torch.arange(N)).to(dev)
    i_v, i_hv, i_n = grid.unbind(1)
    bos, seq_len = cu[i_n], cu[i_n + 1] - cu[i_n]
    chunks = (seq_len + sizes.C - 1) // sizes.C
    skip = walk_skips(kernel, tensors, i_n, i_hv)
    offsets = tensors["chunk_offsets"].long()[i_n] if "chunk_offsets" in tensors else torch.zeros_like(i_n)
    at = _Point(i_hv=i_hv, i_h=i_hv // sizes.G, i_n=i_n, v0=i_v * sizes.BV, t0=bos, n_valid=torch.zeros_like(i_n),
                i_slot=offsets, active=torch.ones_like(i_n, dtype=torch.bool))
    run = _Run(kernel, tensors, sizes, scale, at, len(grid))
    run.block(kernel.prologue)
    for step in range(int(chunks.max()) if len(grid) else 0):
        active = step < chunks - skip
        i_c = (chunks - 1 - skip - step if kernel.reverse else skip + step).clamp(min=0)
        at.active, at.t0 = active, bos + i_c * sizes.C
        at.n_valid = torch.where(active, (seq_len - i_c * sizes.C).clamp(max=sizes.C), 0)
        at.i_slot = offsets + i_c
        kept = {name: x.clone() for name, x in run.buf.items()}
        run.block(kernel.body)
        for name, x in run.buf.items():  # a point past its sequence's chunks keeps what it held
            run.buf[name] = torch.where(active.view(-1, *[1] * (x.dim() - 1)), x, kept[name])
    at.active = torch.ones_like(i_n, dtype=torch.bool)
    run.block(kernel.epilogue)


def walk_skips(kernel: Kernel, tensors: dict, i_n: torch.Tensor, i_hv: torch.Tensor) -> torch.Tensor:
    """How many chunks each point's walk leaves out at its start (Kernel.walk_skip; 0 without)."""
    if not kernel.walk_skip:
        return torch.zeros_like(i_n)
    return tensors[kernel.walk_skip].long()[i_n, i_hv]


def _exact_inverse(a: torch.Tensor) -> torch.Tensor:
    """(I + a)⁻¹ for strictly lower triangular blocks a (batched)."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand_as(a)
    return torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 rounded to tf32 as kernels/tri_inverse.py stages the merge's operands (to nearest,
    ties away from zero; mma.sync then reads them exactly)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).to(x.dtype)


def _unit_lower_inverse(a: torch.Tensor, tf32_from: int, block: int = 16) -> torch.Tensor:
    """(I + a)⁻¹ by the kernels' blocked method (kernels/tri_inverse.py), the merges of blocks
    `tf32_from` wide and wider with tf32 operands, batched over the leading dims."""
    n = a.shape[-1]
    block = min(block, n)
    t = torch.zeros_like(a)
    for b0 in range(0, n, block):
        t[..., b0:b0 + block, b0:b0 + block] = _exact_inverse(a[..., b0:b0 + block, b0:b0 + block])
    w = block
    while w < n:
        r = _tf32 if w >= tf32_from else (lambda v: v)
        for b0 in range(0, n, 2 * w):
            b1 = b0 + w
            p = r(a[..., b1:b1 + w, b0:b1]) @ r(t[..., b0:b1, b0:b1])
            t[..., b1:b1 + w, b0:b1] = -(r(t[..., b1:b1 + w, b1:b1 + w]) @ r(p))
        w *= 2
    return t


__all__ = ["InterpretError", "Sizes", "run_kernel"]
