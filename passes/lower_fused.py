"""lower, warp-specialised kernels: a KernelIR kernel with roles (passes/schedule_fused.py) as one
TileLang kernel whose threads branch by role.

What the KernelIR states is what is emitted: each role is a branch on the thread index
(`if tx < ...`), its register budget a `T.set_max_nreg` at the branch's top, each barrier a
`T.alloc_barrier` per ring stage, each wait a parity wait (the chunk's phase, or its complement on
a ring's empty barrier, which a fresh barrier passes), each arrival a `T.barrier_arrive`, each
fence a `T.fence_proxy_async`. A ring buffer is allocated with a leading stage dim and every
statement reads and writes its copy of the chunk, `stage{d} = i_c % d` for a ring d deep (the walk's
count, where a walk leaves out its first chunks: passes/walk_skip.py). The TMA
loads of a chunk are issued by the loads role's first warp (`T.tma_copy` onto the landed barrier,
the warp's arrival after them). Loops are `T.serial`: TileLang's automatic warp specialisation
stays out of it.

The statements themselves are lower_tilelang's templates; all shared buffers are in one scope,
so the syncs TileLang inserts inside a role get distinct named-barrier ids.
"""
from __future__ import annotations

import re

from qla_compiler.ir.kernel import Kernel, Stmt, entry_registers

from .lower_tilelang import ShapeClass, _dtype, _per_sequence_grid, _Render, _shape, _signature, walk

WARP = 32


def lower_fused(kernel: Kernel, shape: ShapeClass) -> list[str]:
    r = _Render(kernel, shape)
    r.sync_stores = True
    # blocks of the op's own tensors in a wider tile load masked, by the loads role's threads
    r.masked_loads = {st.dst for role in kernel.warp_roles for st in role.body
                      if st.op == "load" and r._masked(st.srcs[0])}
    staged = {b.name: b for b in kernel.buffers if b.stages > 1}
    barriers = {b.name: b for b in kernel.barriers}
    depths = sorted({b.stages for b in staged.values()} | {b.stages for b in kernel.barriers})
    out = _signature(kernel, r) + _per_sequence_grid(kernel, r.tiles.get("V", "V"))
    out.append("        tx = T.get_thread_binding()")
    for b in kernel.buffers:
        if b.scope == "shared" and b.shares:
            out.append(f"        {b.name} = {b.shares}  # {b.owner}'s, in {b.shares}'s memory (dead by then)")
        elif b.scope == "shared":
            dims = _shape(((str(b.stages),) if b.stages > 1 else ()) + b.alloc_shape(), r.tiles)
            who = f"  # a ring of {b.stages}, written by {b.owner}" if b.stages > 1 else f"  # {b.owner}'s"
            out.append(f"        {b.name} = T.alloc_shared({dims}, {_dtype(b.dtype)}){who}")
    for bar in kernel.barriers:
        out.append(f"        {bar.name} = T.alloc_barrier([{bar.arrivals}] * {bar.stages})  # {bar.doc}")
    even = entry_registers(int(kernel.threads))  # a budget above it is a raise, below it a cut
    for i, role in enumerate(kernel.warp_roles):
        last = i == len(kernel.warp_roles) - 1
        head = "else:" if last else f"{'if' if i == 0 else 'elif'} tx < {role.first + role.threads}:"
        out.append(f"        {head}  # role {role.name}, threads [{role.first}, {role.first + role.threads}): {role.doc}")
        ind = " " * 12
        out.append(f"{ind}T.set_max_nreg({role.registers}, {1 if role.registers > even else 0})")
        for b in kernel.buffers:
            if b.scope == "fragment" and b.owner == role.name:
                out.append(f"{ind}{b.name} = T.alloc_fragment({_shape(b.shape, r.tiles)}, {_dtype(b.dtype)})")
        for s in role.prologue:
            out += [ind + ln for ln in r.stmt(s, True)]
        # the rings turn with the walk (i_w where it skips chunks), the chunk index says what to load
        loop, extent, index = walk(kernel)
        out += [f"{ind}for {loop} in T.serial({extent}):",
                *[f"{ind}    {ln}" for ln in index],
                f"{ind}    t0 = bos + i_c * C",
                f"{ind}    n_valid = T.min(C, seq_len - i_c * C)",
                *([f"{ind}    i_slot = chunk_offsets[i_n] + i_c"]
                  if any(s.op == "store_chunk_state" for s in role.body) else []),
                *[ln for d in depths for ln in (f"{ind}    {_stage(d)} = {loop} % {d}  # the copy of a {d}-deep ring",
                                                  f"{ind}    {_phase(d)} = ({loop} // {d}) % 2")]]
        out += [ind + "    " + ln for ln in _role_body(role, r, staged, barriers)]
        for s in role.epilogue:
            out += [ind + ln for ln in r.stmt(s, True)]
    return out


def _role_body(role, r: _Render, staged: dict, barriers: dict) -> list[str]:
    lines, guarded = [], False
    for s in role.body:
        # the TMA loads and the arrival after them are one warp's: from all of the role's threads
        # the arrival would complete the barrier's phase several times over (a masked load, by
        # every thread, may come between them in padded tiles: the guard opens again after it)
        if (s.op == "load" and s.attr.get("barrier") and s.dst not in r.masked_loads) or \
                (s.op == "arrive" and s.attr.get("threads") == WARP):
            if not guarded:
                lines.append(f"if tx < {role.first + WARP}:  # one warp issues the TMA loads and arrives after them")
            guarded = True
            lines += ["    " + ln for ln in _sync(s, r, staged, barriers)]
            continue
        guarded = False
        lines += _sync(s, r, staged, barriers) if s.op in ("wait", "arrive", "fence_async") else \
            [_staged(ln, staged) for ln in r.stmt(s, True)]
    return lines


def _stage(depth: int) -> str:
    return f"stage{depth}"


def _phase(depth: int) -> str:
    return f"phase{depth}"


def _sync(s: Stmt, r: _Render, staged: dict, barriers: dict):
    if s.op == "fence_async":
        return ["T.fence_proxy_async()  # the shared writes above, visible to wgmma and TMA"]
    if s.op in ("wait", "arrive"):
        d = barriers[s.dst].stages
        if s.op == "arrive":
            return [f"T.barrier_arrive({s.dst}[{_stage(d)}])"]
        return [f"T.barrier_wait({s.dst}[{_stage(d)}], {_phase(d)}{' ^ 1' if s.attr.get('free') else ''})"]
    # a TMA load into its ring copy, landing on its barrier
    src = r._global(s.srcs[0], True)
    bar = s.attr["barrier"]
    return [f"T.tma_copy({src}, {_whole(s.dst, staged)}, barrier={bar}[{_stage(barriers[bar].stages)}], "
            f"leader_scope_threads={WARP})"]


def _whole(name: str, staged: dict) -> str:
    b = staged.get(name)
    return name if b is None else f"{name}[{_stage(b.stages)}, {', '.join(':' for _ in b.shape)}]"


def _staged(line: str, staged: dict) -> str:
    """A template's line with every ring buffer read and written at its ring's copy of the chunk."""
    for name, b in staged.items():
        line = re.sub(rf"\b{name}\[", f"{name}[{_stage(b.stages)}, ", line)
        line = re.sub(rf"\b{name}\b(?!\[)", _whole(name, staged), line)
    return line
