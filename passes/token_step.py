"""token_step: RecurrenceIR (classified) → KernelIR of one kernel that runs the recurrence token by
token, for decoding: S_t = d_t (I − s_t x_t x_tᵀ) S_{t−1} + b_t x_t y_tᵀ,  o_t = scale · c · S_tᵀ q_t.

Per token, with the state block S (K×BV, float32) in registers:

    S ← d · S                          the decay (a gate e^g, a head constant, or Diag(e^g) of a
                                       per-key gate, which decays row i by e^{g_i})
    u ← xᵀ S                           (BV) only with the delta factor
    S ← S + x (b·y − s·u)ᵀ             (I − s x xᵀ) d S + b x yᵀ, one rank-1 update
    o ← scale · c · Sᵀ q               (BV)

No chunking: a decode step has one token, and for a few tokens the chunk program's triangular
solve and matmuls cost more than the rank-1 updates. The state comes from and goes to pools, by
slot (the serving engines' layout): `read_slot[n]` says which slot sequence n starts from (−1:
the zero state; −2: a padding entry, which reads and writes no state and only writes its outputs'
zeros, Kernel.padding), `write_slot[n, t]` where the state after its token t goes (−1: nowhere),
`final_slot[n]` where the state after the last token goes. The host (kernels/token_step.py) fills
them from the op's arguments.

    >>> from qla_compiler.passes.frontend import load_spec
    >>> from qla_compiler.passes.classify import classify
    >>> print(token_step(classify(load_spec("specs/gdn.py"))).kernels[0].name)
    gdn_token_step
"""
from __future__ import annotations

import sympy as sp

from qla_compiler.errors import PassError
from qla_compiler.ir.kernel import Buffer, Kernel, KernelIR, Stmt, Tensor
from qla_compiler.ir.recurrence import RecurrenceIR

# per-token tensors as the op packs them: keys per query/key head, values and scalars per value head;
# gates in the shape class's `gates` dtype and scalars in its `scalars` dtype, each float32 or the
# io dtype as a call passes them (read as given, no conversion launched: vLLM passes g in float32
# beside β in bf16), held in float32 once loaded
_LAYOUT = {"key": (("1", "T", "H", "K"), "io"), "value": (("1", "T", "HV", "V"), "io"),
           "scalar": (("1", "T", "HV"), "scalars"), "gate": (("1", "T", "HV"), "gates"),
           "key_gate": (("1", "T", "HV", "K"), "gates")}
_SHAPE = {"key": ("K",), "value": ("BV",), "scalar": ("1",), "gate": ("1",), "key_gate": ("K",)}

WARP_COLUMNS = 8  # the V-block's columns a warp holds (TOKEN_THREADS = 32 · BV / 8)

READ_SLOT = Tensor("read_slot", ("N",), "int32", "in",
                   "the pool slot each sequence starts from; -1: the zero state; -2: padding (no state; o's zeros)")
WRITE_SLOT = Tensor("write_slot", ("N", "L"), "int32", "in",
                    "the slot the state after each token goes to (tokens past L: none); -1: not stored")
FINAL_SLOT = Tensor("final_slot", ("N",), "int32", "in", "the slot the state after the last token goes to; -1: none")
# (the caller's cu_seqlens read in place, int32 or int64, with no conversion launched: an int64
# tensor is its int32 words, [N+1, 2], the low word first; token counts are below 2^31)
CU_SEQLENS = Tensor("cu_seqlens", ("N+1", "W"), "int32", "in",
                    "first token of each sequence, in column 0 (W = 1: int32; W = 2: an int64's words)")


def _coeff(e: sp.Expr, scalar_bufs: dict):
    """A coefficient of the structure (β, 1, ...) as a KernelIR expression over the token's scalars."""
    if e.is_Number:
        return ("lit", float(e))
    if isinstance(e, sp.Symbol):
        if e.name not in scalar_bufs:
            raise PassError("token_step", f"the coefficient {e} is not a scalar input of the token")
        return ("buf", scalar_bufs[e.name], "0")
    if isinstance(e, (sp.Mul, sp.Add)):
        parts = [_coeff(a, scalar_bufs) for a in e.args]
        out = parts[0]
        for p in parts[1:]:
            out = ("mul" if isinstance(e, sp.Mul) else "add", out, p)
        return out
    if isinstance(e, sp.exp):
        return ("exp", _coeff(e.args[0], scalar_bufs))
    raise PassError("token_step", f"no token-step form for the coefficient {e}")


def _mul(*xs):
    out = xs[0]
    for x in xs[1:]:
        out = out if x == ("lit", 1.0) else ("mul", out, x)
    return out


def token_step(rec: RecurrenceIR) -> KernelIR:
    st = rec.structure
    if st is None:
        raise PassError("token_step", "the recurrence is not classified (run classify first)")
    params, buffers, body = [], [], []
    bufs = {}
    # Each token's inputs are loaded one token ahead: the first token's in the prologue, beside the
    # state's loads (the state's wait for read_slot, the token's for cu_seqlens: issued together, a
    # one-token decode waits one memory latency for both, not two), and token t + 1's at the top of
    # token t, into a second set of registers, so that their latency hides behind t's arithmetic
    # (several tokens a sequence: speculative decoding). In registers: each thread loads the rows
    # or columns it holds of the state block (staged in shared memory they took a block barrier
    # before the reads and one after)
    first, ahead, advance = [], [], []
    for inp in rec.inputs:
        shape, dtype = _LAYOUT[inp.kind]
        params.append(Tensor(inp.name, shape, dtype, "in", f"{inp.kind} per token"))
        b, nb = f"{inp.name}_t", f"{inp.name}_next"
        held = dtype if inp.kind in ("key", "value") else "float32"
        buffers += [Buffer(b, _SHAPE[inp.kind], held, "fragment"), Buffer(nb, _SHAPE[inp.kind], held, "fragment")]
        bufs[inp.name] = b
        first.append(Stmt("load_token", b, (inp.name,)))
        ahead.append(Stmt("load_token", nb, (inp.name,), (("ahead", 1),)))
        advance.append(Stmt("copy", b, (nb,)))
    # where each state goes, read with the inputs (the token's write slot a token ahead, the final
    # one in the prologue), not right before the store: read there, a one-token decode waited two
    # more memory latencies after its arithmetic, the write slot's and then the final one's
    buffers += [Buffer(x, ("1",), "int32", "fragment") for x in ("write_at", "write_at_next", "final_at")]
    first.append(Stmt("load_slot", "write_at", ("write_slot",)))
    ahead.append(Stmt("load_slot", "write_at_next", ("write_slot",), (("ahead", 1),)))
    advance.append(Stmt("copy", "write_at", ("write_at_next",)))
    body += ahead
    head = [Tensor(f"log_{c.name}", ("HV",), "float32", "in", "log of the per-head decay") for c in rec.constants]
    state_in = Tensor("state_pool", ("S", "HV", "K", "V"), "state", "in", "the states the sequences start from, by slot")
    state_out = Tensor("state_out", ("S", "HV", "K", "V"), "state", "out",
                       "where the states after the tokens go, by slot (the same tensor as state_pool in place)")
    o = Tensor("o", ("1", "T", "HV", "V"), "io", "out", "per token, per value head")
    params = params + head + [CU_SEQLENS, READ_SLOT, WRITE_SLOT, FINAL_SLOT, state_in, state_out, o]
    # the state block and its products by a warp per WARP_COLUMNS columns: the sums over K (u, o_t)
    # are shuffles inside each warp, no block barrier in a token
    block = dict(scope="fragment", warp_columns=WARP_COLUMNS)
    buffers += [Buffer("state", ("K", "BV"), "float32", **block),
                Buffer("xS", ("K", "BV"), "float32", **block),
                Buffer("u", ("BV",), "float32", "fragment"),
                Buffer("o_t", ("BV",), "float32", "fragment"),
                Buffer("qS", ("K", "BV"), "float32", **block)]
    S, x, y, q = ("buf", "state", "i", "j"), bufs[st.write_key], bufs[st.write_value], bufs[st.query]
    ij = ("index", ("i", "j"))
    if st.decay == "gate":
        body.append(Stmt("ewise", "state", (), (("expr", ("mul", ("exp", ("buf", bufs[st.decay_name], "0")), S)), ij)))
    elif st.decay == "head_constant":
        body.append(Stmt("ewise", "state", (), (("expr", ("mul", ("exp", ("head", st.decay_name)), S)), ij)))
    elif st.decay == "key_gate":  # Diag(e^g) S: row i of the state decays by its key's gate
        body.append(Stmt("ewise", "state", (), (("expr", ("mul", ("exp", ("buf", bufs[st.decay_name], "i")), S)), ij)))
    elif st.decay != "none":
        raise PassError("token_step", f"no token-step form for the decay {st.decay!r}")
    write = _mul(_coeff(st.write_coeff, bufs), ("buf", y, "j"))
    if st.delta:
        body += [Stmt("ewise", "xS", (), (("expr", ("mul", ("buf", x, "i"), S)), ij)),
                 Stmt("reduce", "u", ("xS",), (("dims", (0,)),))]
        write = ("sub", write, ("mul", _coeff(st.delta_coeff, bufs), ("buf", "u", "j")))
    body += [Stmt("ewise", "state", (), (("expr", ("add", S, ("mul", ("buf", x, "i"), write))), ij)),
             Stmt("ewise", "qS", (), (("expr", ("mul", ("buf", q, "i"), S)), ij)),
             Stmt("reduce", "o_t", ("qS",), (("dims", (0,)),)),
             Stmt("ewise", "o_t", (), (("expr", _mul(("param", "scale"), _coeff(st.output_coeff, bufs),
                                                      ("buf", "o_t", "j"))), ("index", ("j",)))),
             Stmt("store_token", "o", ("o_t",)),
             Stmt("store_state", "state_out", ("state",), (("slot", "write_at"),)),
             *advance]
    epilogue = [Stmt("store_state", "state_out", ("state",), (("slot", "final_at"),))]
    # (o is allocated, not zeroed: a padding entry's tokens get zeros from the kernel, one launch
    # less a call)
    padding = (Stmt("ewise", "o_t", (), (("expr", ("lit", 0.0)), ("index", ("j",)))),
               Stmt("store_token", "o", ("o_t",)))
    kernel = Kernel(f"{rec.name}_token_step", (("v_block", "V/BV"), ("value_head", "HV"), ("sequence", "N")),
                    "TOKEN_THREADS", params, buffers,
                    [Stmt("load_slot", "final_at", ("final_slot",)), *first,
                     Stmt("load_state", "state", ("state_pool",), (("slot", "read_slot"),))],
                    body, epilogue, loop="tokens of the sequence", kind="token_step",
                    roles=(f"a warp per {WARP_COLUMNS} columns of the V-block (TOKEN_THREADS = 32 BV / {WARP_COLUMNS}): "
                           "the state block in registers, one token after another",),
                    doc=f"sequential over tokens: the recurrence's own step ({st.family}), for decoding",
                    padding=padding)
    return KernelIR(f"{rec.name}_token_step", 1, [kernel],
                    host=["read_slot, write_slot, final_slot = the pool slots of every sequence and token (kernels/token_step.py)"])
