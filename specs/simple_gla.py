"""Simple GLA / Mamba2 (SSD): a scalar data-dependent decay per token and head."""
from qla_compiler.spec import exp, gate, key, recurrence, state, value

q, k = key("q"), key("k")
v = value("v")
g = gate("g")
S = state()

recurrence(step=exp(g) * S + k * v.T, output=S.T * q)
