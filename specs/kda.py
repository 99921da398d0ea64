"""Kimi Delta Attention (Kimi Team 2025): the delta rule after a decay per key dimension."""
from qla_compiler.spec import I, exp, gate, key, recurrence, scalar, state, value

q, k = key("q"), key("k")
v = value("v")
g = gate("g", per="key")
beta = scalar("beta")
S = state()

recurrence(step=(I - beta * k * k.T) * exp(g) * S + beta * k * v.T, output=S.T * q)
