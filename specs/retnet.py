"""RetNet (Sun et al. 2023): a fixed decay per head, gamma_h = 1 - 2^(-5-h)."""
from qla_compiler.spec import head_constant, key, recurrence, state, value

q, k = key("q"), key("k")
v = value("v")
gamma = head_constant("gamma", lambda h: 1 - 2 ** (-5 - h))
S = state()

recurrence(step=gamma * S + k * v.T, output=S.T * q)
