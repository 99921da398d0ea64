"""The KernelIR interpreter for a warp-specialised kernel: its roles run one statement at a time in
an order their barriers allow, and what the hardware would get wrong is an error here.

Each role walks the chunks with its own counter (from the sequence's last chunk where the kernel
walks in reverse: a backward's scan). A wait blocks its role until the barrier's phase
for that chunk has completed; an arrival counts the role's threads. Every role runs as far as it
can before the next one gets a turn (`order` says which goes first), so a role that reads a ring
copy without waiting for it reads it before it is written. The interpreter checks, and names:

  * a read of a ring copy by a role that has not waited, in that chunk, on a barrier whose phase
    hands that copy over (kind "full"), or a copy that does not hold the reader's chunk;
  * a write of a ring copy by its owner without a wait on its "empty" barrier in that chunk, or
    over a copy a reader has not finished with; a touch of a TMA load's copy before its "landed"
    barrier's wait;
  * an arrival for a later phase than the barrier is in (an arrival ahead of its wait);
  * a deadlock (every unfinished role waiting), with what each waits on;
  * a barrier left with some of its arrivals at the end.

The statements themselves run as in kernel_interp (every grid point at once, float64); a ring
buffer (or a buffer one role hands another, a ring of one) is one buffer per copy, and a buffer in another's memory (Buffer.shares) is that one, so a
value overwritten while still live gives a wrong result here too.
"""
from __future__ import annotations

import torch

from .kernel import Kernel, Stmt
from .kernel_interp import InterpretError, Sizes, _Point, _Run, walk_skips


def _reads(st: Stmt) -> set:
    names = st.reads()
    if st.dst and (st.op == "zero_pad" or (st.op == "gemm" and st.attr.get("accumulate"))):
        names.add(st.dst)  # (it updates its destination)
    return names


class _Barriers:
    def __init__(self, kernel: Kernel):
        self.spec = {b.name: b for b in kernel.barriers}
        self.done = {(b.name, s): 0 for b in kernel.barriers for s in range(b.stages)}
        self.count = dict.fromkeys(self.done, 0)

    def _at(self, name: str, chunk: int):
        if name not in self.spec:
            raise InterpretError(f"no barrier named {name}")
        b = self.spec[name]
        return b, chunk % b.stages, chunk // b.stages

    def ready(self, name: str, chunk: int, free: bool) -> bool:
        _, s, phase = self._at(name, chunk)
        return self.done[(name, s)] >= phase + (0 if free else 1)

    def arrive(self, name: str, chunk: int, threads: int, role: str) -> None:
        b, s, phase = self._at(name, chunk)
        if self.done[(name, s)] != phase:
            raise InterpretError(f"role {role} arrives on {name}[{s}] for chunk {chunk} (phase {phase}) while the "
                                 f"barrier is at phase {self.done[(name, s)]}: an arrival ahead of its wait")
        self.count[(name, s)] += threads
        if self.count[(name, s)] > b.arrivals:
            raise InterpretError(f"{name}[{s}]: {self.count[(name, s)]} arrivals for a phase of {b.arrivals}")
        if self.count[(name, s)] == b.arrivals:
            self.done[(name, s)] += 1
            self.count[(name, s)] = 0


class _RoleState:
    def __init__(self, role, chunks: int):
        self.role, self.chunks = role, chunks
        self.section, self.chunk, self.pc = "prologue", 0, 0

    def current(self):
        while True:
            stmts = {"prologue": self.role.prologue, "body": self.role.body, "epilogue": self.role.epilogue}.get(
                self.section)
            if stmts is None:
                return None
            if self.pc < len(stmts):
                return stmts[self.pc]
            self.pc = 0
            if self.section == "prologue":
                self.section = "body" if self.chunks else "epilogue"
            elif self.section == "body" and self.chunk + 1 < self.chunks:
                self.chunk += 1
            elif self.section == "body":
                self.section = "epilogue"
            else:
                self.section = "done"

    def where(self) -> str:
        return f"role {self.role.name} at chunk {self.chunk}"


def run_roles(kernel: Kernel, tensors: dict, sizes: Sizes, scale: float, order=None) -> None:
    """Run a warp-specialised kernel's roles (`order`: role names, the first runs first; by
    default the kernel's own order)."""
    dev = next(iter(tensors.values())).device
    cu = tensors["cu_seqlens"].long()
    N, HV = cu.numel() - 1, sizes.HV
    grid = torch.cartesian_prod(torch.arange(sizes.V // sizes.BV), torch.arange(HV), torch.arange(N)).to(dev)
    grid = grid.view(-1, 3)
    i_v, i_hv, i_n = grid.unbind(1)
    bos, seq_len = cu[i_n], cu[i_n + 1] - cu[i_n]
    chunks = (seq_len + sizes.C - 1) // sizes.C
    skip = walk_skips(kernel, tensors, i_n, i_hv)  # a role's chunk c is the walk's: the rings turn with it
    # (a role that stores the state entering each chunk writes slot chunk_offsets[n] + c)
    offsets = tensors["chunk_offsets"].long()[i_n] if "chunk_offsets" in tensors else torch.zeros_like(i_n)
    at = _Point(i_hv=i_hv, i_h=i_hv // sizes.G, i_n=i_n, v0=i_v * sizes.BV, t0=bos, n_valid=torch.zeros_like(i_n),
                i_slot=offsets, active=torch.ones_like(i_n, dtype=torch.bool))
    run = _Run(kernel, tensors, sizes, scale, at, len(grid))
    # the rings, and the buffers one role hands another (a ring one copy deep): the protocol is
    # checked on each copy
    read_by = {b.name: {r.name for r in kernel.warp_roles if any(b.name in _reads(s) for s in r.body)}
               for b in kernel.buffers}
    staged = {b.name: b.stages for b in kernel.buffers if b.stages > 1 or read_by[b.name] - {b.owner}}
    # a buffer in another's memory reads and writes that one's storage, as on the GPU
    in_memory_of = {b.name: b.shares for b in kernel.buffers if b.shares}
    for name, stages in staged.items():
        blank = run.buf.pop(name)
        for s in range(stages):
            run.buf[f"{name}@{s}"] = blank.clone()
            run.dtypes[f"{name}@{s}"] = run.dtypes[name]
    bars = _Barriers(kernel)
    n_chunks = int(chunks.max()) if len(grid) else 0
    roles = {r.name: r for r in kernel.warp_roles}
    states = [_RoleState(roles[n], n_chunks) for n in (order or roles)]
    readers = {name: read_by[name] for name in staged}
    last_read = {(r.name, name): max(i for i, s in enumerate(r.body) if name in _reads(s))
                 for r in kernel.warp_roles for name in staged if r.name in readers[name]}
    version, released = {}, {}
    owner = {b.name: b.owner for b in kernel.buffers}
    waited = {}  # (role, chunk) -> the kinds of hand-over it has waited for, by buffer
    in_flight = set()  # (role, buffer, chunk): a TMA load issued, its landed barrier not yet waited on

    def handed(state, name, kind) -> bool:
        return kind in waited.get((state.role.name, state.chunk), {}).get(name, set())

    def check_protocol(state: _RoleState, st: Stmt) -> None:
        c, role = state.chunk, state.role.name
        for name in staged:
            touches = name in _reads(st) or name in st.writes()
            if not touches:
                continue
            if (role, name, c) in in_flight and not handed(state, name, "landed"):
                raise InterpretError(f"{kernel.name}: {state.where()}: `{st}` touches {name} before the wait on "
                                     "its TMA load's landed barrier")
            if owner[name] != role and not handed(state, name, "full"):
                raise InterpretError(f"{kernel.name}: {state.where()}: `{st}` reads {name} without waiting on the "
                                     "barrier that hands it over: a wait is missing")
            if owner[name] == role and name in st.writes() and not handed(state, name, "empty"):
                raise InterpretError(f"{kernel.name}: {state.where()}: `{st}` writes {name} without waiting for "
                                     "its readers to be done with the copy (its empty barrier): a wait is missing")
        if st.op == "load" and st.attr.get("barrier"):
            in_flight.add((role, st.dst, c))

    def execute(state: _RoleState, st: Stmt) -> None:
        c, in_loop = state.chunk, state.section == "body"
        names = dict(in_memory_of)
        if in_loop:
            check_protocol(state, st)
            for name, stages in staged.items():
                names[name] = f"{name}@{c % stages}"
                key = (name, c % stages)
                if name in _reads(st) and version.get(key) != c:
                    held = version.get(key)
                    raise InterpretError(
                        f"{kernel.name}: {state.where()}: `{st}` reads {name}[{c % stages}], which holds "
                        + (f"chunk {held}'s value" if held is not None else "nothing yet") + ": a wait is missing")
                if name in st.writes() and version.get(key) != c:
                    if version.get(key) is not None and released.get(key, set()) != readers[name]:
                        late = sorted(readers[name] - released.get(key, set()))
                        raise InterpretError(
                            f"{kernel.name}: {state.where()}: `{st}` overwrites {name}[{c % stages}] before role "
                            f"{', '.join(late)} has read chunk {version[key]}'s value: a wait on its empty barrier "
                            "is missing")
                    version[key], released[key] = c, set()
            active = c < chunks - skip
            # the walk's c-th chunk: from the sequence's last where the kernel walks in reverse
            i_c = (chunks - 1 - skip - c if kernel.reverse else skip + c).clamp(min=0)
            at.active, at.t0 = active, bos + i_c * sizes.C
            at.i_slot = offsets + i_c
            at.n_valid = torch.where(active, (seq_len - i_c * sizes.C).clamp(max=sizes.C), 0)
        else:
            active = torch.ones_like(i_n, dtype=torch.bool)
            at.active = active
        st = st.renamed(names)
        kept = {w: run.buf[w].clone() for w in st.writes() if w in run.buf}
        run.block([st])
        for w, old in kept.items():  # a point past its sequence's chunks keeps what it held
            run.buf[w] = torch.where(active.view(-1, *[1] * (old.dim() - 1)), run.buf[w], old)
        if in_loop:
            for name in staged:
                if (state.role.name, name) in last_read and last_read[(state.role.name, name)] == state.pc:
                    released.setdefault((name, c % staged[name]), set()).add(state.role.name)

    def step(state: _RoleState) -> bool:
        """Run the role's next statement; False where it waits."""
        st = state.current()
        if st is None:
            return False
        if st.op == "wait":
            if not bars.ready(st.dst, state.chunk, bool(st.attr.get("free"))):
                return False
            b = bars.spec[st.dst]
            got = waited.setdefault((state.role.name, state.chunk), {})
            for name in b.guards:
                got.setdefault(name, set()).add(b.kind)
        elif st.op == "arrive":
            bars.arrive(st.dst, state.chunk, st.attr.get("threads", state.role.threads), state.role.name)
        elif st.op != "fence_async":
            execute(state, st)
        state.pc += 1
        return True

    while any(s.current() is not None for s in states):
        progress = False
        for s in states:
            while step(s):
                progress = True
        if not progress:
            blocked = [f"{s.where()} waits on {s.current().dst}" for s in states if s.current() is not None]
            raise InterpretError(f"{kernel.name}: deadlock: " + "; ".join(blocked))
    left = [f"{n}[{s}] ({c} of {bars.spec[n].arrivals})" for (n, s), c in bars.count.items() if c]
    if left:
        raise InterpretError(f"{kernel.name}: barriers left with some of their arrivals: {', '.join(left)}")


__all__ = ["run_roles"]
