"""classify: RecurrenceIR → RecurrenceIR with `structure` filled in.

Splits the step into S_t = A_t S_{t−1} + B_t by sympy and recognises

    A_t = d_t (I − s_t x_t x_tᵀ)  or  d_t I,     d_t ∈ {1, exp(gate), head constant}
    A_t = (I − s_t x_t x_tᵀ) D_t  or  D_t,       D_t = Diag(exp(g_t)), g a per-key gate
    B_t = b_t x_t y_tᵀ                            (x a key input, y a value input)
    o_t = c · S_tᵀ q_t

which is the family MATH.md chunks (linear attention, Mamba2/simple GLA, RetNet, DeltaNet, GDN;
GLA and KDA with the per-key diagonal). Anything else is refused with the structure that was
found: a diagonal applied after the delta factor, D_t (I − s k kᵀ), is another recurrence.

    >>> from qla_compiler.compiler import resolve_spec
    >>> from qla_compiler.passes.frontend import load_spec
    >>> ir = classify(load_spec(resolve_spec("gdn")))
    >>> ir.structure.transition()
    'exp(g)·(I − beta·k·kᵀ)'
"""
from __future__ import annotations

import dataclasses

import sympy as sp

from qla_compiler.errors import UnsupportedStructure
from qla_compiler.ir.recurrence import RecurrenceIR, Structure
from qla_compiler.spec import DiagExp

from .sympy_terms import count, terms

SUPPORTED = ("A_t = d·I or d·(I − s·k·kᵀ) with d = 1, exp(gate) or a head constant, or "
             "Diag(exp(g)) or (I − s·k·kᵀ)·Diag(exp(g)) with g a per-key gate; B_t = b·k·vᵀ; o_t = Sᵀ·q")


def classify(ir: RecurrenceIR) -> RecurrenceIR:
    S = ir.state
    kinds = {i.symbol: i.kind for i in ir.inputs}
    consts = {c.symbol for c in ir.constants}

    def refuse(found: str):
        raise UnsupportedStructure(f"unsupported structure: {found}. Supported: {SUPPORTED}", ir.path, ir.line)

    def scalar_ok(expr) -> bool:
        """A coefficient the chunk program can build: a number times powers of scalar inputs."""
        for f in sp.Mul.make_args(sp.sympify(expr)):
            base, power = f.as_base_exp()
            if f.is_Number:
                continue
            if not (isinstance(base, sp.Symbol) and kinds.get(base) == "scalar" and power.is_Integer and power > 0):
                return False
        return True

    transition, write = [], []
    for coeff, factors in terms(ir.step):
        if count(factors, S) == 0:
            write.append((coeff, factors))
        elif factors[-1] != S:
            refuse(f"the state is not multiplied from the left in {coeff}·{'·'.join(map(str, factors))}")
        else:
            transition.append((coeff, factors[:-1]))

    transition, diag = _strip_diagonal(transition, refuse)
    # A_t = c·I + r·x xᵀ  →  d = c, s = −r/c
    ident = sp.Add(*[c for c, f in transition if not f])
    rank1 = [(c, f) for c, f in transition if f]
    if ident == 0:
        refuse("A_t has no identity part")
    decay, decay_name = _decay(ident, kinds, consts)
    if decay is None:
        refuse(f"the decay factor of A_t is {ident}, which is not 1, exp(<gate>) or a head constant")
    if diag is not None:
        if decay != "none":
            refuse(f"A_t has the per-key decay {diag} and the decay factor {ident}; one decay is supported")
        decay, decay_name = "key_gate", diag.gate.name
    delta_key, s = None, None
    if rank1:
        keys = {f for _, f in rank1}
        if len(keys) > 1:
            refuse(f"A_t has rank-1 terms {sorted(map(str, keys))}; at most one k·kᵀ factor is supported")
        (factors,) = keys
        if len(factors) != 2 or factors[1] != factors[0].T or kinds.get(factors[0]) != "key":
            refuse(f"A_t has the factor {'·'.join(map(str, factors))}; only k·kᵀ of one key input is "
                   "supported (diagonal and non-symmetric transitions are not)")
        delta_key = factors[0]
        s = sp.simplify(-sp.Add(*[c for c, _ in rank1]) / ident)
        if not scalar_ok(s):
            refuse(f"the delta-rule strength s = {s} must be a number times powers of scalar inputs")

    if len(write) != 1:
        refuse(f"B_t has {len(write)} terms; exactly one b·k·vᵀ is supported")
    b, wf = write[0]
    if len(wf) != 2 or kinds.get(wf[0]) != "key" or not isinstance(wf[1], sp.Transpose) \
            or kinds.get(wf[1].arg) != "value":
        refuse(f"B_t = {b}·{'·'.join(map(str, wf))} is not b·k·vᵀ with k a key and v a value input")
    if not scalar_ok(b):
        refuse(f"the write coefficient b = {b} must be a number times powers of scalar inputs")
    if delta_key is not None and delta_key != wf[0]:
        refuse(f"the delta factor uses key {delta_key} but the write uses {wf[0]}")

    outs = terms(ir.output)
    if len(outs) != 1:
        refuse(f"the output has {len(outs)} terms; one c·Sᵀ·q is supported")
    c, of = outs[0]
    if len(of) != 2 or of[0] != S.T or kinds.get(of[1]) != "key" or not scalar_ok(c):
        refuse(f"the output {ir.output} is not c·Sᵀ·q with q a key input")

    structure = Structure(
        decay=decay, decay_name=decay_name, delta=delta_key is not None, delta_coeff=s,
        write_key=wf[0].name, write_value=wf[1].arg.name, write_coeff=b,
        query=of[1].name, output_coeff=c)
    return dataclasses.replace(ir, structure=structure)


def _strip_diagonal(transition, refuse):
    """A_t = M·D with D = Diag(exp(g)) of a per-key gate, rightmost in every term (it acts on the
    state first): (the terms of M, D). (transition, None) when no term has a diagonal."""
    diags = {f for _, fs in transition for f in fs if isinstance(f, DiagExp)}
    if not diags:
        return transition, None
    if len(diags) > 1:
        refuse(f"A_t has the diagonals {', '.join(sorted(map(str, diags)))}; one per-key decay is supported")
    (diag,) = diags
    for c, fs in transition:
        if not fs or fs[-1] != diag or diag in fs[:-1]:
            term = "·".join([str(c)] * (c != 1) + [str(f).replace(".T", "ᵀ") for f in fs]) or "1"
            where = "is applied after the delta factor" if diag in fs else "is missing"
            refuse(f"the per-key decay {diag} {where} in the term {term}·S of A_t; it must act on the state "
                   f"first in every term, A_t = {diag} or (I − s·k·kᵀ)·{diag}")
    return [(c, fs[:-1]) for c, fs in transition], diag


def _decay(d, kinds, consts):
    if d == 1:
        return "none", None
    if isinstance(d, sp.exp) and isinstance(d.args[0], sp.Symbol) and kinds.get(d.args[0]) == "gate":
        return "gate", d.args[0].name
    if d in consts:
        return "head_constant", d.name
    return None, None
