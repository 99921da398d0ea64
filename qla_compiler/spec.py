"""The spec language: one token step of a linear-attention recurrence, in sympy.

A spec file declares its per-token inputs, the K×V state and one `recurrence(step=..., output=...)`:

    from qla_compiler.spec import I, exp, gate, key, recurrence, scalar, state, value

    q, k = key("q"), key("k")          # K-vectors per token and query/key head
    v = value("v")                     # V-vector per token and value head
    g = gate("g")                      # log-space decay per token and value head (≤ 0)
                                       # (gate("g", per="key"): one per key dimension too; see gate)
    beta = scalar("beta")              # a scalar per token and value head
    S = state()                        # the K×V state
    recurrence(step=exp(g) * (I - beta * k * k.T) * S + beta * k * v.T, output=S.T * q)

`*` is the matrix product (sympy's), `.T` the transpose, `I` the K×K identity, `exp(g)` of a
per-key gate the K×K diagonal Diag(e^{g}). The op scales the
output by `scale` (default K^-1/2), as FLA does. Declarations are recorded with their line so that
errors in later passes can point back at the spec.
"""
from __future__ import annotations

import math
import sys
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable

import sympy as sp
from sympy.matrices.expressions.matexpr import MatrixExpr

from .errors import SpecError
from .ir.kernel import CROSSING_SUFFIXES, SCHEDULE_TENSORS

K, V = sp.symbols("K V", integer=True, positive=True)
I = sp.Identity(K)

# Names an input cannot take: the op's keyword options, the tensors the schedule adds to the kernels
# (ir/kernel.SCHEDULE_TENSORS), and names the generated kernels use for their own sizes, loop
# variables and buffers (passes/schedule_build.py, passes/lower_tilelang.py).
RESERVED = {
    "scale", "output_final_state", "use_qk_l2norm_in_kernel", "context_parallel", "state",
    "T", "C", "K", "V", "H", "HV", "BV", "G", "N", "IO", "SCALE", "STAGES", "NP1", "CH", "Tok", "i", "j", "t0",
    "n_valid", "bos", "seq_len", "v0", "i_h", "i_hv", "i_n", "i_v", "i_c", "i_slot", "I", "exp",
} | SCHEDULE_TENSORS
RESERVED_PREFIXES = ("d_", "log_", "qla_", "_")


@dataclass
class Declared:
    """What a spec file declared; turned into a RecurrenceIR by the frontend pass."""

    path: str  # as the user named it, for messages
    filename: str  # as the spec's code object knows it
    inputs: list = field(default_factory=list)  # (name, kind, symbol, line)
    constants: list = field(default_factory=list)  # (name, fn, symbol, line)
    state: tuple | None = None  # (symbol, line)
    recurrence: tuple | None = None  # (step, output, line)


_current: ContextVar[Declared | None] = ContextVar("qla_spec", default=None)


def _record() -> tuple[Declared, int]:
    decl = _current.get()
    if decl is None:
        raise RuntimeError("spec declarations only run inside qla's frontend (qla_compiler.compile)")
    # the innermost frame running the spec file itself gives the line
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename != decl.filename:
        frame = frame.f_back
    return decl, frame.f_lineno if frame is not None else None


def _check_name(decl: Declared, line, name: str, what: str) -> None:
    if not name.isidentifier():
        raise SpecError(f"{what} name {name!r} is not a Python identifier", decl.path, line)
    if name in RESERVED or name.startswith(RESERVED_PREFIXES) or name.endswith(CROSSING_SUFFIXES):
        raise SpecError(f"{what} name {name!r} is reserved (an op option or a name the generated kernels "
                        "use); choose another", decl.path, line)
    if any(n == name for n, *_ in decl.inputs) or any(n == name for n, *_ in decl.constants):
        raise SpecError(f"{what} {name!r} is declared twice", decl.path, line)


def _input(name: str, kind: str, symbol):
    decl, line = _record()
    _check_name(decl, line, name, "input")
    decl.inputs.append((name, kind, symbol, line))
    return symbol


def key(name: str) -> sp.MatrixSymbol:
    """A K-vector per token and query/key head (q, k), passed as [B, T, H, K]."""
    return _input(name, "key", sp.MatrixSymbol(name, K, 1))


def value(name: str) -> sp.MatrixSymbol:
    """A V-vector per token and value head (v), passed as [B, T, HV, V]."""
    return _input(name, "value", sp.MatrixSymbol(name, V, 1))


def scalar(name: str) -> sp.Symbol:
    """A scalar per token and value head (β), passed as [B, T, HV]."""
    return _input(name, "scalar", sp.Symbol(name, real=True))


class KeyGate(sp.MatrixSymbol):
    """A per-key log-space gate: a K-vector (K×1) whose exp is a diagonal matrix, not a scalar."""


class DiagExp(MatrixExpr):
    """Diag(e^{g}) of a per-key gate g: the K×K diagonal decay of GLA and KDA. Symmetric, so its
    transpose is itself; the recurrence interpreter builds it from g, the classify pass reads
    `gate` (the meaning is this class and its argument, not a name)."""

    is_commutative = False

    def __new__(cls, gate):
        return sp.Basic.__new__(cls, gate)

    @property
    def gate(self) -> KeyGate:
        return self.args[0]

    @property
    def shape(self):
        return (self.gate.shape[0], self.gate.shape[0])

    def _eval_transpose(self):
        return self

    def _sympystr(self, printer):
        return f"Diag(exp({printer._print(self.gate)}))"

    def _latex(self, printer):
        return r"\operatorname{Diag}(e^{%s})" % printer._print(self.gate)


def exp(x):
    """e^x of a scalar (a gate: exp(g)); of a per-key gate, the diagonal Diag(e^{g}).

        exp(g) * S        # scalar gate: e^{g} S;  per-key gate: Diag(e^{g}) S (row k scaled by e^{g_k})
    """
    if isinstance(x, KeyGate):
        return DiagExp(x)
    if isinstance(x, MatrixExpr):
        msg = (f"exp of the matrix {x} is not a decay: exp() takes a scalar (exp(g) of a gate) or a per-key "
               "gate (g = gate('g', per='key'): exp(g) is Diag(e^g))")
        if _current.get() is None:
            raise ValueError(msg)
        decl, line = _record()
        raise SpecError(msg, decl.path, line)
    return sp.exp(x)


def gate(name: str, per: str = "head"):
    """A log-space decay (g ≤ 0); use as exp(g).

    per="head" (the default): one per token and value head, passed as [B, T, HV]; exp(g) is a scalar.
    per="key": one per token, value head and key dimension, passed as [B, T, HV, K]; exp(g) is the
    K×K diagonal Diag(e^{g}), which decays row k of the state by e^{g_k} (GLA, KDA):

        g = gate("g", per="key")
        recurrence(step=exp(g) * S + k * v.T, output=S.T * q)                          # GLA
        recurrence(step=(I - beta * k * k.T) * exp(g) * S + beta * k * v.T, output=S.T * q)  # KDA
    """
    if per == "key":
        return _input(name, "key_gate", KeyGate(name, K, 1))
    if per != "head":
        decl, line = _record()
        raise SpecError(f"gate {name!r}: per must be 'head' or 'key', got {per!r}", decl.path, line)
    return _input(name, "gate", sp.Symbol(name, nonpositive=True))


def head_constant(name: str, fn: Callable[[int], float]) -> sp.Symbol:
    """A constant per value head h, fn(h) (RetNet's γ_h); no tensor is passed for it."""
    decl, line = _record()
    _check_name(decl, line, name, "constant")
    for h in range(4):
        val = float(fn(h))
        if not (0.0 < val <= 1.0) or math.isnan(val):
            raise SpecError(f"head constant {name!r} must lie in (0, 1] (a decay); fn({h}) = {val}",
                            decl.path, line)
    symbol = sp.Symbol(name, positive=True)
    decl.constants.append((name, fn, symbol, line))
    return symbol


def state(name: str = "S") -> sp.MatrixSymbol:
    """The K×V state carried from token to token."""
    decl, line = _record()
    if decl.state is not None:
        raise SpecError("a spec has one state; state() is called twice", decl.path, line)
    symbol = sp.MatrixSymbol(name, K, V)
    decl.state = (symbol, line)
    return symbol


def recurrence(step, output) -> None:
    """S_t = step(S_{t-1}, inputs_t);  o_t = output(S_t, inputs_t) (times the op's `scale`)."""
    decl, line = _record()
    if decl.recurrence is not None:
        raise SpecError("recurrence() is called twice", decl.path, line)
    decl.recurrence = (step, output, line)
