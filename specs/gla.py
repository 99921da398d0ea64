"""GLA (Yang et al. 2024): gated linear attention, a data-dependent decay per key dimension."""
from qla_compiler.spec import exp, gate, key, recurrence, state, value

q, k = key("q"), key("k")
v = value("v")
g = gate("g", per="key")
S = state()

recurrence(step=exp(g) * S + k * v.T, output=S.T * q)
