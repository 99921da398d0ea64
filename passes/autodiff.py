"""autodiff: reverse mode over a chunk program; the backward (VJP) chunk program, itself a ChunkIR.

The forward chunk program is a function (input blocks, S0) -> (o, S_next) of one chunk. Its VJP
takes the same input blocks, S0 and the cotangents d_o (C×V) and d_S_next (K×V), and returns the
gradient of every differentiable input block (keys, values, scalars, gates; not params, constants
or head constants) and d_S0. As a program:

    inputs        the forward's inputs, S0 (kind saved_state, K×V), d_o (kind cotangent_value, C×V)
    state_in      d_S_next: the scan carries the state's cotangent ...
    outputs       "d_<input>" per differentiable input
    next_state    d_S0
    reverse       ... from the last chunk to the first

What the backward program reads of the forward, besides its inputs: only the state entering each
chunk (`run_chunks(..., save_states=True)`, [N, HV, NC, K, V]).
It recomputes everything else of the forward from the inputs and that S0, so the recomputation (and
most of the backward) does not depend on d_S_next and runs in parallel over chunks; only the d_S
chain is a sequential scan, run in reverse. (Its kernels go further: the values the forward's
kernels stored per token — W, v_new, the inverse — they load instead; see Program.backward_program.)

Per-op VJP rules are data: `VJP[op](b, node, g, want)` gets the node's cotangent `g` and returns one
cotangent (a node name, or None) per argument; `want[i]` says whether argument i needs one. A
value used more than once gets the `add` of its partial cotangents. A VJP only multiplies by values
the forward computed (d exp(x) = dy ⊙ exp(x)), so the backward exponentiates exactly what the forward
does and verify_exponents accepts it. The table covers every op of the forward programs (and
rev_cumsum, at_last, above); the backward's own reductions (rowsum, colsum, sum_all) have no rule
yet, so a backward program cannot itself be differentiated.

    >>> bwd = derive_backward(compile_spec("gdn").chunk)          # doctest: +SKIP
    >>> print(bwd)                                                # doctest: +SKIP
"""
from __future__ import annotations

import math
from collections import defaultdict

from qla_compiler.errors import PassError
from qla_compiler.ir.chunk import ChunkIR, Node

from .rewrite_cse import CSE
from .verify_exponents import verify_exponents

DIFFERENTIABLE_KINDS = ("key", "value", "scalar", "gate", "key_gate")
LN2 = math.log(2.0)


class Builder:
    """Adds the backward's nodes; `d(n, i)` names the cotangent a node sends to its i-th argument."""

    def __init__(self, ir: ChunkIR):
        self.ir = ir

    def __call__(self, name: str, op: str, /, *args: str, **attrs) -> str:
        return self.ir.add(name, op, *args, **attrs)

    def shape(self, name: str) -> tuple:
        return self.ir.node(name).shape

    @staticmethod
    def d(n: Node, i: int) -> str:
        return f"d_{n.args[i]}.{n.name}"

    def to_shape(self, name: str, g: str, target: str) -> str:
        """The transpose of broadcasting `target` to g's shape: a scalar's cotangent sums g, a
        per-key vector's (K, broadcast over a C×K block's rows) sums its columns."""
        gs, ts = self.shape(g), self.shape(target)
        if gs == ts:
            return g
        if ts == ():
            return self(name, "sum_all", g)
        if len(gs) == 2 and ts == gs[1:]:
            return self(name, "colsum", g)
        raise PassError("autodiff", f"cannot reduce a {gs} cotangent to {target}'s shape {ts}")


# ---- the rules: op -> (builder, node, cotangent, want) -> one cotangent per argument -------------

def _no_grad(b, n, g, want):  # leaves: inputs, the state, params, constants, masks
    return ()


def _cumsum(b, n, g, want):  # y_i = Σ_{j≤i} x_j  ->  dx_j = Σ_{i≥j} dy_i
    return (b(b.d(n, 0), "rev_cumsum", g),)


def _rev_cumsum(b, n, g, want):
    return (b(b.d(n, 0), "cumsum", g),)


def _last(b, n, g, want):  # y = x_{len−1}  ->  dx = dy at position len−1
    return (b(b.d(n, 0), "at_last", g),)


def _at_last(b, n, g, want):
    return (b(b.d(n, 0), "last", g),)


def _masked_diff(b, n, g, want):  # y_ij = x_i − x_j on the mask  ->  dx = rowsum(dy) − colsum(dy)
    # The −inf entries of y get no gradient, and neither does the diagonal, x_i − x_i ≡ 0: summed,
    # it would reach x_i twice with opposite signs, an O(1) cancellation that swamps the true
    # gradient when every off-diagonal decay is tiny (g ≈ −16 per token).
    gm = b(f"{b.d(n, 0)}.masked", "tril", g, strict=True)
    return (b(b.d(n, 0), "sub", b(f"{b.d(n, 0)}.rows", "rowsum", gm), b(f"{b.d(n, 0)}.cols", "colsum", gm)),)


def _clamp_min(b, n, g, want):  # y = max(x, m)  ->  dx = dy where x > m, 0 elsewhere
    # (at a reset, g = −inf, this is autograd's through the reference: d e^g = e^g dg = 0)
    x = n.args[0]
    return (b(b.d(n, 0), "mul", g, b(f"{x}_above", "above", x, min=n.attr["min"])),)


def _exp(b, n, g, want):  # dx = dy ⊙ e^x: reuses the forward's exponential
    return (b(b.d(n, 0), "mul", g, n.name),)


def _exp2(b, n, g, want):  # dx = dy ⊙ 2^x ⊙ ln 2
    ln2 = b("ln2", "const", value=LN2, shape=())
    return (b(b.d(n, 0), "mul", b(f"{b.d(n, 0)}.ln2", "mul", g, ln2), n.name),)


def _neg(b, n, g, want):
    return (b(b.d(n, 0), "neg", g),)


def _add(b, n, g, want):
    return tuple(b.to_shape(b.d(n, i), g, a) for i, a in enumerate(n.args))


def _sub(b, n, g, want):
    x, y = n.args
    if b.ir.node(x).op == "last" and b.ir.node(x).args[0] == y and b.shape(g) == b.shape(y) in (("C",), ("C", "K")):
        # y_last − y_i is ≡ 0 at i = last: drop that cotangent (exactly: g − g) for the reason
        # _masked_diff drops its diagonal
        name = b.d(n, 1)
        g = b(f"{name}.off_last", "sub", g, b(f"{name}.at_last", "at_last", b(f"{name}.last", "last", g)))
    if not want[1]:
        return b.to_shape(b.d(n, 0), g, x), None
    dy = b(b.d(n, 1) if b.shape(g) == b.shape(y) else f"{b.d(n, 1)}.full", "neg", g)
    return b.to_shape(b.d(n, 0), g, x), b.to_shape(b.d(n, 1), dy, y)


def _mul(b, n, g, want):  # d x = dy ⊙ y (summed over the broadcast dims when x is a scalar)
    out = []
    for i, (a, other) in enumerate(zip(n.args, reversed(n.args))):
        if not want[i]:
            out.append(None)
            continue
        name = b.d(n, i)
        prod = b(name if b.shape(a) == n.shape else f"{name}.full", "mul", g, other)
        out.append(b.to_shape(name, prod, a))
    return tuple(out)


def _scale_rows(b, n, g, want):  # Y = diag(d) X  ->  dd = rowsum(dY ⊙ X), dX = diag(d) dY
    d, x = n.args
    dd = b(b.d(n, 0), "rowsum", b(f"{b.d(n, 0)}.full", "mul", g, x)) if want[0] else None
    dx = b(b.d(n, 1), "scale_rows", d, g) if want[1] else None
    return dd, dx


def _scale_cols(b, n, g, want):  # Y = X diag(d)  ->  dX = dY diag(d), dd = colsum(dY ⊙ X)
    x, d = n.args
    dx = b(b.d(n, 0), "scale_cols", g, d) if want[0] else None
    dd = b(b.d(n, 1), "colsum", b(f"{b.d(n, 1)}.full", "mul", g, x)) if want[1] else None
    return dx, dd


def _matmul(b, n, g, want):  # Y = op(A) op(B), op = ᵀ where ta / tb
    a, bb = n.args
    ta, tb = n.attr.get("ta", False), n.attr.get("tb", False)
    da = db = None
    if want[0]:  # d op(A) = dY op(B)ᵀ
        da = (b(b.d(n, 0), "matmul", bb, g, **_t(tb, True)) if ta else
              b(b.d(n, 0), "matmul", g, bb, **_t(False, not tb)))
    if want[1]:  # d op(B) = op(A)ᵀ dY
        db = (b(b.d(n, 1), "matmul", g, a, **_t(True, ta)) if tb else
              b(b.d(n, 1), "matmul", a, g, **_t(not ta, False)))
    return da, db


def _t(ta: bool, tb: bool) -> dict:
    return {k: True for k, v in (("ta", ta), ("tb", tb)) if v}


def _contract(b, n, g, want):  # Y = einsum(eq, X₁, …)  ->  dXᵢ = einsum(Y's, the others' -> Xᵢ's)
    ins, out = n.attr["eq"].split("->")
    ins = ins.split(",")
    grads = []
    for i, (a, sub) in enumerate(zip(n.args, ins)):
        if not want[i]:
            grads.append(None)
            continue
        others = [(x, s) for j, (x, s) in enumerate(zip(n.args, ins)) if j != i]
        if len(set(sub)) != len(sub) or not set(sub) <= set(out).union(*(s for _, s in others)):
            raise PassError("autodiff", f"no VJP for {n.name} = contract[{n.attr['eq']}] in argument {i}: "
                                        f"an index of {sub} is repeated or summed within it alone")
        eq = ",".join([out, *(s for _, s in others)]) + "->" + sub
        grads.append(b(b.d(n, i), "contract", g, *(x for x, _ in others), eq=eq))
    return tuple(grads)


def _tril(b, n, g, want):
    return (b(b.d(n, 0), "tril", g, **({"strict": True} if n.attr.get("strict") else {})),)


def _inv_unit_lower(b, n, g, want):  # T = (I + A)⁻¹  ->  dA = StrictLower(−Tᵀ dT Tᵀ)
    tg = b(f"{b.d(n, 0)}.left", "matmul", n.name, g, ta=True)
    if b.ir.node(n.args[0]).op == "tril" and b.ir.node(n.args[0]).attr.get("strict"):
        return (b(b.d(n, 0), "neg", b(f"{b.d(n, 0)}.full", "matmul", tg, n.name, tb=True)),)  # tril masks it
    tgt = b(f"{b.d(n, 0)}.full", "matmul", tg, n.name, tb=True)  # the op reads only A's strict lower part
    return (b(b.d(n, 0), "tril", b(f"{b.d(n, 0)}.neg", "neg", tgt), strict=True),)


VJP = {
    **{op: _no_grad for op in ("input", "state_in", "param", "head_log", "const", "valid", "positions",
                               "causal_mask", "above")},  # (above: a step, flat almost everywhere)
    "cumsum": _cumsum,
    "rev_cumsum": _rev_cumsum,
    "last": _last,
    "at_last": _at_last,
    "masked_diff": _masked_diff,
    "clamp_min": _clamp_min,
    "exp": _exp,
    "exp2": _exp2,
    "neg": _neg,
    "add": _add,
    "sub": _sub,
    "mul": _mul,
    "scale_rows": _scale_rows,
    "scale_cols": _scale_cols,
    "matmul": _matmul,
    "tril": _tril,
    "contract": _contract,
    "inv_unit_lower": _inv_unit_lower,
}


def derive_backward(fwd: ChunkIR) -> ChunkIR:
    """The VJP chunk program of `fwd` (see the module docstring), CSE'd, verified."""
    missing = sorted({n.op for n in fwd.order() if n.op not in VJP})
    if missing:
        where = ", ".join(f"'{n.name}'" for n in fwd.order() if n.op in missing)
        raise PassError("autodiff", f"no VJP rule for op {', '.join(repr(m) for m in missing)} "
                                    f"(node {where}): add one to passes/autodiff.py VJP")
    S0 = fwd.state_in
    if S0 is None or len(fwd.outputs) != 1 or fwd.next_state is None:
        raise PassError("autodiff", "the chunk program needs a state_in, one output and a next state")
    bwd = ChunkIR(f"{fwd.name}_backward", fwd.chunk_size, history=fwd.history + ("autodiff",), reverse=True)
    b = Builder(bwd)

    # the forward, recomputed from the inputs and the saved entering state
    for n in fwd.order():
        if n.op == "state_in":
            b(n.name, "input", name=n.name, kind="saved_state")
        else:
            b(n.name, n.op, *n.args, **n.attr)
    leaves = {n.name for n in fwd.inputs() if n.attr["kind"] in DIFFERENTIABLE_KINDS} | {S0}
    active = set(leaves)
    for n in fwd.order():
        if any(a in active for a in n.args):
            active.add(n.name)

    # the seeds: d_o, and the carried cotangent of the state
    ((role, o),), S_next = fwd.outputs.items(), fwd.next_state
    parts: dict = defaultdict(list)
    cotangent = b(f"d_{o}", "input", name=f"d_{o}", kind="cotangent_value")
    parts[o].append(cotangent)
    parts[S_next].append(b(f"d_{S_next}", "state_in"))

    grads = {}
    for n in reversed(fwd.order()):
        if n.name not in active or not parts.get(n.name):
            continue
        g = grads[n.name] = _accumulate(b, n.name, parts.pop(n.name))
        want = [a in active for a in n.args]
        if any(want):
            for a, d, w in zip(n.args, VJP[n.op](b, n, g, want), want):
                if w and d is not None:
                    parts[a].append(d)

    if S0 not in grads:
        raise PassError("autodiff", f"neither output depends on the state {S0}")
    bwd.outputs = {f"d_{n.name}": grads[n.name] for n in fwd.inputs() if n.name in grads and n.name in leaves}
    bwd.gradient_of = {f"d_{n.name}": n.name for n in fwd.inputs() if f"d_{n.name}" in bwd.outputs}
    bwd.next_state = grads[S0]
    bwd.cotangent_of = {cotangent: role}
    bwd = CSE.run(bwd)  # merges repeated products; drops the forward nodes the backward does not need
    bwd.verify()
    verify_exponents(bwd)
    return bwd


def _accumulate(b: Builder, x: str, parts: list) -> str:
    """The cotangent of x: its one partial (renamed d_x when the rule made it for x), or their sum."""
    name = f"d_{x}"
    if len(parts) == 1:
        p = parts[0]
        if p.startswith(f"{name}.") and name not in b.ir.graph:
            b.ir.rename(p, name)
            return name
        return p
    total = parts[0]
    for i, p in enumerate(parts[1:], 2):
        total = b(name if i == len(parts) else f"{name}.sum{i}", "add", total, p)
    return total
