"""Linear attention (Katharopoulos et al. 2020), without the normaliser."""
from qla_compiler.spec import key, recurrence, state, value

q, k = key("q"), key("k")
v = value("v")
S = state()

recurrence(step=S + k * v.T, output=S.T * q)
