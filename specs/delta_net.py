"""DeltaNet (Schlag et al. 2021; Yang et al. 2024): the delta rule with no decay."""
from qla_compiler.spec import I, key, recurrence, scalar, state, value

q, k = key("q"), key("k")
v = value("v")
beta = scalar("beta")
S = state()

recurrence(step=(I - beta * k * k.T) * S + beta * k * v.T, output=S.T * q)
