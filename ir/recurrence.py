"""RecurrenceIR: one token step of a linear recurrence, as sympy expressions.

    S_t = step(S_{t-1}, inputs_t)       (K×V)
    o_t = output(S_t, inputs_t)         (V×1; the op multiplies by `scale`)

It is plain data. The frontend pass builds it from a spec file; the classify pass fills `structure`
(how the transition A_t and the write B_t of S_t = A_t S_{t-1} + B_t look). Its interpreter
(`ir.recurrence_interp`) runs the step token by token in float64: the reference for every spec.

    >>> from qla_compiler.passes.frontend import load_spec
    >>> print(load_spec("specs/linear_attn.py"))     # doctest: +SKIP
    recurrence linear_attn  # specs/linear_attn.py
      in  q: key[K]   k: key[K]   v: value[V]
      ...
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Callable

import sympy as sp

KIND_SHAPE = {"key": "[K]", "value": "[V]", "scalar": "[]", "gate": "[] ≤ 0", "key_gate": "[K] ≤ 0"}


@dataclass(frozen=True)
class Input:
    name: str
    kind: str  # key | value | scalar | gate | key_gate (a gate per key dimension)
    symbol: sp.Basic = field(compare=False)
    line: int = 0


@dataclass(frozen=True)
class HeadConstant:
    name: str
    fn: Callable[[int], float] = field(compare=False)
    symbol: sp.Basic = field(compare=False)
    line: int = 0

    def values(self, n_heads: int) -> list[float]:
        return [float(self.fn(h)) for h in range(n_heads)]


@dataclass(frozen=True)
class Structure:
    """S_t = d_t (I − s_t x_t x_tᵀ) S_{t−1} + b_t x_t y_tᵀ,   o_t = c · S_tᵀ q_t.

    decay: 'none' (d = 1), 'gate' (d = exp(gate input)), 'head_constant' (d = γ_h), 'key_gate'
    (the diagonal D_t = Diag(exp(g_t)) of a per-key gate, applied first:
    S_t = (I − s_t x_t x_tᵀ) D_t S_{t−1} + b_t x_t y_tᵀ).
    delta: the rank-1 factor (I − s x xᵀ) is present; `delta_coeff` is s.
    """

    decay: str
    decay_name: str | None
    delta: bool
    delta_coeff: sp.Expr | None
    write_key: str
    write_value: str
    write_coeff: sp.Expr
    query: str
    output_coeff: sp.Expr

    @property
    def family(self) -> str:
        d = {"none": "", "gate": "gated ", "head_constant": "constant-decay ", "key_gate": "per-key gated "}[self.decay]
        return d + ("delta rule" if self.delta else "linear attention")

    def transition(self) -> str:
        x = self.write_key
        delta = f"(I − {self.delta_coeff}·{x}·{x}ᵀ)" if self.delta else "I"
        if self.decay == "key_gate":
            diag = f"Diag(exp({self.decay_name}))"
            return f"{delta}·{diag}" if self.delta else diag
        decay = {"none": "", "gate": f"exp({self.decay_name})·", "head_constant": f"{self.decay_name}·"}
        return decay[self.decay] + delta

    def write(self) -> str:
        coeff = "" if self.write_coeff == 1 else f"{self.write_coeff}·"
        return f"{coeff}{self.write_key}·{self.write_value}ᵀ"


@dataclass(frozen=True)
class RecurrenceIR:
    name: str
    path: str
    inputs: tuple[Input, ...]
    constants: tuple[HeadConstant, ...]
    state: sp.MatrixSymbol
    step: sp.Basic
    output: sp.Basic
    line: int  # of the recurrence(...) call
    structure: Structure | None = None

    def input(self, name: str) -> Input:
        return next(i for i in self.inputs if i.name == name)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs)

    def __str__(self) -> str:
        s = self.state.name
        ins = "   ".join(f"{i.name}: {i.kind}{KIND_SHAPE[i.kind]}" for i in self.inputs)
        lines = [f"recurrence {self.name}  # {self.path}", f"  in     {ins}"]
        for c in self.constants:
            vals = ", ".join(f"{v:.6g}" for v in c.values(3))
            lines.append(f"  const  {c.name}[h] = {vals}, …  (per value head)")
        lines += [
            f"  state  {s}: [K, V]",
            f"  step   {s} ← {_pretty(self.step)}",
            f"  out    o ← scale · {_pretty(self.output)}",
        ]
        if self.structure is not None:
            st = self.structure
            lines += [
                f"  # classify: {st.family}",
                f"  #   A_t = {st.transition()}",
                f"  #   B_t = {st.write()}",
                f"  #   o_t = scale · {'' if st.output_coeff == 1 else f'{st.output_coeff}·'}{s}_tᵀ·{st.query}",
            ]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """The text form, then the step and output typeset (MathJax renders $$…$$ in notebooks)."""
        s, shape = self.state.name, self.state.shape
        prev, now = sp.MatrixSymbol(f"{s}_{{t-1}}", *shape), sp.MatrixSymbol(f"{s}_t", *shape)
        math = (f"$$ {s}_t = {sp.latex(self.step.subs(self.state, prev))} $$"
                f"$$ o_t = \\mathrm{{scale}} \\cdot {sp.latex(self.output.subs(self.state, now))} $$")
        return f"<pre>{html.escape(str(self))}</pre>{math}"


def _pretty(expr) -> str:
    return str(expr).replace(".T", "ᵀ").replace("*", "·")
