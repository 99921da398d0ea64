"""affine: the chunk's state update as an affine map, S_next = M · S0 + H (MATH.md, context parallelism).

The scan is the only sequential part of a chunk program, and it is affine in the state. This pass
derives, from the chunk program itself, a state-free program computing per chunk

    M = ∂S_next/∂S0   (K×K: the linear part applied to the identity)
    H = S_next(S0 = 0) (K×V: the state reached from zero)

by propagating two parts through every node downstream of S0: its linear part in S0 (with S0
replaced by I_K, so the V columns become K columns) and its constant part (S0 replaced by 0;
`None` stands for an exact zero). Affine maps compose, (M₂, H₂) ∘ (M₁, H₁) = (M₂M₁, M₂H₁ + H₂), so
a long sequence can be cut into segments that run in parallel once a short scan over the segment
maps has given each its start state — exactly, with no error term. For GDN the pass finds MATH.md's
M = Γ_C (I − Kᵀ T_r diag(β) K) (in the rewritten form (Γ_C I − K_decᵀ (T ⊙ R) diag(β) K_Γ)).

    >>> aff = derive_affine(compile_spec("gdn").chunk)           # doctest: +SKIP
    >>> print(aff)                                               # doctest: +SKIP
"""
from __future__ import annotations

from qla_compiler.errors import PassError
from qla_compiler.ir.chunk import ChunkIR

from .rewrite_cse import CSE

# ops through which the two parts propagate, and which of their arguments may depend on S0
_ONE_DEPENDENT = ("matmul", "mul", "scale_rows", "scale_cols")


def derive_affine(fwd: ChunkIR) -> ChunkIR:
    S0 = fwd.state_in
    if S0 is None:
        raise PassError("affine", f"{fwd.name} has no state")
    p = fwd.copy()
    p.name = f"{fwd.name}_affine"
    dep = fwd.scan_nodes()
    lin = {S0: p.add("I_K", "eye")}  # the linear part of each S0-dependent node, applied to I_K
    cst = {S0: None}  # its constant part; None is an exact zero

    def part(table, a):
        return table[a] if a in dep else a

    for n in fwd.order():
        if n.name not in dep or n.name == S0:
            continue
        args, attrs = n.args, n.attr
        deps = [a in dep for a in args]
        if n.op in _ONE_DEPENDENT:
            if sum(deps) != 1:
                raise PassError("affine", f"{n.name} = {n.op}({', '.join(args)}) is not affine in the state "
                                          "(both arguments depend on it)")
            i = deps.index(True)
            if lin[args[i]] == lin[S0] and n.op == "matmul" and not attrs.get("ta") and not attrs.get("tb"):
                lin[n.name] = args[1 - i]  # X · I = X, I · Y = Y
            else:
                lin[n.name] = p.add(f"{n.name}_lin", n.op, *_swap(args, i, lin[args[i]]), **attrs)
            c = cst[args[i]]
            cst[n.name] = None if c is None else p.add(f"{n.name}_cst", n.op, *_swap(args, i, c), **attrs)
        elif n.op in ("add", "sub"):
            lin[n.name] = _combine(p, n, [lin[a] if d else None for a, d in zip(args, deps)], "lin")
            cst[n.name] = _combine(p, n, [part(cst, a) for a in args], "cst")
        elif n.op == "neg":
            lin[n.name] = p.add(f"{n.name}_lin", "neg", lin[args[0]])
            c = cst[args[0]]
            cst[n.name] = None if c is None else p.add(f"{n.name}_cst", "neg", c)
        else:
            raise PassError("affine", f"{n.name} = {n.op}(...) is not affine in the state")

    S_next = fwd.next_state
    if cst[S_next] is None:
        raise PassError("affine", "the state reached from zero is identically zero (no write term)")
    p.outputs, p.next_state = {"M": lin[S_next], "H": cst[S_next]}, None  # (state-free: no scan)
    out = CSE.run(p)
    out.name, out.history = p.name, fwd.history + ("affine",)
    out.verify()
    return out


def _swap(args, i, new):
    return tuple(new if j == i else a for j, a in enumerate(args))


def _combine(p: ChunkIR, n, parts, tag):
    """add/sub of parts, any of which may be an exact zero (None)."""
    a, b = parts
    if a is None and b is None:
        return None
    if b is None:
        return a
    if a is None:
        return b if n.op == "add" else p.add(f"{n.name}_{tag}", "neg", b)
    return p.add(f"{n.name}_{tag}", n.op, a, b)
