"""Gated DeltaNet (Yang et al. 2024): a decayed delta-rule update of the state."""
from qla_compiler.spec import I, exp, gate, key, recurrence, scalar, state, value

q, k = key("q"), key("k")
v = value("v")
g = gate("g")
beta = scalar("beta")
S = state()

recurrence(step=exp(g) * (I - beta * k * k.T) * S + beta * k * v.T, output=S.T * q)
