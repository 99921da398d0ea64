"""frontend: spec file → RecurrenceIR.

Runs the spec file with the spec language's declarations recording into a fresh `Declared`, then
checks what a recurrence must be: shapes agree, the step is K×V and affine in the state, the output
is V×1 and linear in the state, and no symbol appears that the spec did not declare. Every error
names the spec file and line.

    >>> ir = load_spec("specs/gdn.py")
    >>> ir.input_names
    ('q', 'k', 'v', 'g', 'beta')
"""
from __future__ import annotations

import traceback
from pathlib import Path

import sympy as sp

from qla_compiler import spec as lang
from qla_compiler.errors import SpecError
from qla_compiler.ir.recurrence import HeadConstant, Input, RecurrenceIR

from .sympy_terms import NotATerm, count, shape, terms


def load_spec(path) -> RecurrenceIR:
    path = Path(path)
    shown = str(path)
    try:
        source = path.read_text()
    except OSError as e:
        raise SpecError(f"cannot read the spec: {e.strerror}", shown) from None
    decl = lang.Declared(path=shown, filename=str(path.resolve()))
    token = lang._current.set(decl)
    try:
        code = compile(source, str(path.resolve()), "exec")
        exec(code, {"__name__": f"qla_spec_{path.stem}", "__file__": str(path)})
    except SpecError:
        raise
    except SyntaxError as e:
        raise SpecError(f"syntax error: {e.msg}", shown, e.lineno) from None
    except Exception as e:  # noqa: BLE001 - any failure inside user code becomes a located SpecError
        line = _spec_line(e, path)
        msg = f"unknown symbol: {e}" if isinstance(e, NameError) else f"{type(e).__name__}: {e}"
        raise SpecError(msg, shown, line) from None
    finally:
        lang._current.reset(token)
    return _check(decl, path.stem)


def _spec_line(exc: BaseException, path: Path) -> int | None:
    target = str(path.resolve())
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == target]
    return lines[-1] if lines else None


def _check(decl: lang.Declared, name: str) -> RecurrenceIR:
    where = decl.path
    if decl.state is None:
        raise SpecError("the spec declares no state: add S = state()", where)
    if decl.recurrence is None:
        raise SpecError("the spec has no recurrence(step=..., output=...)", where)
    S, _ = decl.state
    step, output, line = decl.recurrence
    known = {sym for *_, sym, _l in decl.inputs} | {sym for *_, sym, _l in decl.constants}
    known |= {S, lang.K, lang.V}

    def fail(msg):
        raise SpecError(msg, where, line)

    for what, expr, want in (("step", step, (lang.K, lang.V)), ("output", output, (lang.V, 1))):
        if not isinstance(expr, sp.Basic):
            fail(f"{what} must be an expression of the declared symbols, got {type(expr).__name__}")
        stray = {s for s in expr.free_symbols if s not in known and s.name not in {k.name for k in known}}
        if stray:
            fail(f"{what} uses undeclared symbols: {', '.join(sorted(map(str, stray)))}")
        try:
            got = shape(expr)
            parts = terms(expr)
        except (ValueError, NotATerm) as e:
            fail(f"{what}: {e}")
        if tuple(got) != want:
            fail(f"{what} has shape [{got[0]}×{got[1]}], expected [{want[0]}×{want[1]}]")
        for coeff, factors in parts:
            n = count(factors, S)
            if coeff.has(S):
                fail(f"{what} is not linear in the state {S.name}: {coeff}")
            if n > 1:
                fail(f"{what} is not linear in the state {S.name}: the term "
                     f"{_term(coeff, factors)} contains {S.name} {n} times")
            if what == "output" and n == 0:
                fail(f"output is not linear in the state {S.name}: the term {_term(coeff, factors)} "
                     f"does not involve {S.name}")
        if what == "step" and all(count(f, S) == 0 for _, f in parts):
            fail(f"step does not involve the previous state {S.name}")

    inputs = tuple(Input(n, kind, sym, ln) for n, kind, sym, ln in decl.inputs)
    constants = tuple(HeadConstant(n, fn, sym, ln) for n, fn, sym, ln in decl.constants)
    return RecurrenceIR(name=name, path=where, inputs=inputs, constants=constants, state=S,
                        step=step, output=output, line=line)


def _term(coeff, factors) -> str:
    return "·".join([str(coeff)] * (coeff != 1) + [str(f).replace(".T", "ᵀ") for f in factors])
