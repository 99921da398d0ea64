"""The block operations of ChunkIR: for each op its shape rule and its interpretation in torch.

Blocks live on one chunk of C tokens: C×K, C×V, C×C, K×V, vectors over the chunk (C) and
scalars (); a per-key gate adds per-key vectors (K) and the C×C×K block of its pairwise decays.
The chunk dim C, when a block has one, comes first. Tensors carry leading batch dims (sequences,
heads, chunks) before the block dims.
Adding an op means adding one entry here (and, for the GPU, one lowering rule).

Facts about ops that passes use are data here too: LINEAR, EXPONENTIALS.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch
else:
    class _Torch:
        """torch, imported on first use: building, rewriting and printing chunk programs needs
        only the shape rules (`qla-compile --emit chunk` starts without torch)."""

        def __getattr__(self, name):
            import torch as module

            globals()["torch"] = module  # every later use is the module itself
            return getattr(module, name)

    torch = _Torch()

Shape = tuple  # of dim names: "C", "K", "V"


@dataclass(frozen=True)
class OpDef:
    name: str
    arity: int  # -1: any
    shape: Callable  # (arg shapes, attrs) -> shape
    eval: Callable  # (ctx, args, attrs, arg shapes) -> tensor
    doc: str


class Context:
    """What the interpreter knows beyond the block inputs: chunk lengths, runtime params, head
    constants, the state entering the chunk. `nb` is the number of batch dims."""

    def __init__(self, inputs, lengths, params, head_consts, state, chunk_size, nb):
        self.inputs, self.lengths, self.params = inputs, lengths, params
        self.head_consts, self.state, self.C, self.nb = head_consts, state, chunk_size, nb


def _bcast(x: torch.Tensor, xs: Shape, target: Shape) -> torch.Tensor:
    """Pad a lower-rank block so it broadcasts against target: a scalar () or a leading part of
    target's dims (a vector (C,) against C×K) on the right, a trailing part (a per-key vector (K,)
    against C×K) on the left of its dims."""
    pad = [1] * (len(target) - len(xs))
    if xs and tuple(target[len(target) - len(xs):]) == tuple(xs) and tuple(target[:len(xs)]) != tuple(xs):
        batch = x.shape[:x.dim() - len(xs)]
        return x.reshape(*batch, *pad, *x.shape[x.dim() - len(xs):])
    return x.reshape(*x.shape, *pad)


def _elementwise(fn):
    def ev(ctx, args, attrs, shapes):
        out = max(shapes, key=len)
        return fn(*[_bcast(a, s, out) for a, s in zip(args, shapes)])
    return ev


def _elementwise_shape(shapes, attrs):
    out = max(shapes, key=len)
    for s in shapes:
        # a scalar broadcasts, and so does a per-key vector (K,) against a C×K block
        if s and s != out and not (len(out) == 2 and s == (out[1],) and s != (out[0],)):
            raise ValueError(f"elementwise shapes {list(shapes)} do not match")
    return out


def _matmul_shape(shapes, attrs):
    (a, b), ta, tb = shapes, attrs.get("ta", False), attrs.get("tb", False)
    if len(a) != 2 or len(b) != 2:
        raise ValueError(f"matmul of non-matrices {a}, {b}")
    a, b = (a[::-1] if ta else a), (b[::-1] if tb else b)
    if a[1] != b[0]:
        raise ValueError(f"matmul inner dims differ: {a} · {b}")
    return (a[0], b[1])


def _matmul(ctx, args, attrs, shapes):
    a, b = args
    if attrs.get("ta"):
        a = a.transpose(-1, -2)
    if attrs.get("tb"):
        b = b.transpose(-1, -2)
    return a @ b


def _tri_mask(C, strict, like):
    return torch.ones(C, C, dtype=torch.bool, device=like.device).tril(-1 if strict else 0)


def _block_mask(C, block, like):
    """True where i and j lie in the same sub-chunk of `block` tokens (the diagonal blocks)."""
    sub = torch.arange(C, device=like.device) // block
    return sub.unsqueeze(-1) == sub.unsqueeze(-2)


def _masked_diff(ctx, args, attrs, shapes):
    (x,), (s,) = args, shapes
    C = x.shape[-len(s)]
    keep = _tri_mask(C, attrs["mask"] == "strict", x)
    if attrs.get("block"):
        keep = keep & _block_mask(C, attrs["block"], x)
    if len(s) == 2:  # x: C×K, per key: d_ijk = x_ik − x_jk
        d = x.unsqueeze(-2) - x.unsqueeze(-3)
        keep = keep.unsqueeze(-1)
    else:
        d = x.unsqueeze(-1) - x.unsqueeze(-2)
    return torch.where(keep, d, torch.full_like(d, -math.inf))


def _ref_diff(ctx, args, attrs, shapes):
    """x_i − x_ref on rows lo ≤ i < hi (later) or x_ref − x_i there (not later), −inf elsewhere."""
    (x,), (s,) = args, shapes
    dim = x.dim() - len(s)  # the chunk's
    ref = x.narrow(dim, attrs["ref"], 1)
    d = x - ref if attrs["later"] else ref - x
    rows = torch.arange(x.shape[dim], device=x.device)
    keep = ((rows >= attrs["lo"]) & (rows < attrs["hi"])).view(-1, *[1] * (len(s) - 1))
    return torch.where(keep, d, torch.full_like(d, -math.inf))


def _ref_diff_shape(shapes, attrs):
    (s,) = shapes
    if s not in (("C",), ("C", "K")):
        raise ValueError(f"ref_diff of a {s} block: it takes a vector over the chunk (C) or a C×K block")
    if not 0 <= attrs["lo"] < attrs["hi"]:
        raise ValueError(f"ref_diff rows [{attrs['lo']}, {attrs['hi']}) are empty")
    return s


def _keep(ctx, args, attrs, shapes):
    """x on the rows (dim 0) or columns (dim 1) lo ≤ · < hi of a C×C block, 0 elsewhere."""
    (x,) = args
    dim = x.dim() - 2 + attrs["dim"]
    idx = torch.arange(x.shape[dim], device=x.device)
    keep = (idx >= attrs["lo"]) & (idx < attrs["hi"])
    return x * (keep.unsqueeze(-1) if attrs["dim"] == 0 else keep).to(x.dtype)


def _keep_shape(shapes, attrs):
    (s,) = shapes
    if s != ("C", "C") or attrs["dim"] not in (0, 1):
        raise ValueError(f"keep of a {s} block along dim {attrs['dim']}: it takes a C×C block's rows (0) or columns (1)")
    return s


def _masked_diff_shape(shapes, attrs):
    (s,) = shapes
    if s not in (("C",), ("C", "K")):
        raise ValueError(f"masked_diff of a {s} block: it takes a vector over the chunk (C) or a C×K block")
    return ("C", "C", *s[1:])


def _tril(ctx, args, attrs, shapes):
    (x,), (s,) = args, shapes
    mask = _tri_mask(x.shape[-len(s) + 1], attrs.get("strict", False), x)
    return x * (mask.unsqueeze(-1) if len(s) == 3 else mask)  # C×C×K: masked over (i, j)


def _cumsum(reverse):
    def ev(ctx, args, attrs, shapes):
        (x,), (s,) = args, shapes
        dim = -len(s)  # along the chunk: a C×K block's rows
        return x.flip(dim).cumsum(dim).flip(dim) if reverse else x.cumsum(dim)
    return ev


def _parse_eq(eq: str):
    ins, out = eq.split("->")
    return ins.split(","), out


def _contract_shape(shapes, attrs):
    ins, out = _parse_eq(attrs["eq"])
    if len(ins) != len(shapes):
        raise ValueError(f"contract[{attrs['eq']}] takes {len(ins)} arguments, got {len(shapes)}")
    dims = {}
    for sub, shape in zip(ins, shapes):
        if len(sub) != len(shape):
            raise ValueError(f"contract[{attrs['eq']}]: {sub} does not index a {shape} block")
        for letter, d in zip(sub, shape):
            if dims.setdefault(letter, d) != d:
                raise ValueError(f"contract[{attrs['eq']}]: index {letter} is both {dims[letter]} and {d}")
    if any(letter not in dims for letter in out):
        raise ValueError(f"contract[{attrs['eq']}]: an output index appears in no argument")
    return tuple(dims[letter] for letter in out)


def _contract(ctx, args, attrs, shapes):
    ins, out = _parse_eq(attrs["eq"])
    return torch.einsum(",".join(f"...{s}" for s in ins) + f"->...{out}", *args)


def _inv_unit_lower(ctx, args, attrs, shapes):
    (a,) = args
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand_as(a)
    return torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)


def _last(ctx, args, attrs, shapes):
    (x,), (s,) = args, shapes
    if len(s) == 2:  # a C×K block's row at the last token
        idx = (ctx.lengths - 1).clamp(min=0).unsqueeze(-1).unsqueeze(-1)
        idx = idx.expand(*x.shape[:-2], 1, x.shape[-1])
        return x.gather(-2, idx).squeeze(-2)
    idx = (ctx.lengths - 1).clamp(min=0).expand(x.shape[:-1]).unsqueeze(-1)
    return x.gather(-1, idx).squeeze(-1)


def _iota(ctx):
    return torch.arange(ctx.C, device=ctx.lengths.device)


def _valid(ctx, args, attrs, shapes):
    dt = ctx.state.dtype
    return (_iota(ctx) < ctx.lengths.unsqueeze(-1)).to(dt)


def _positions(ctx, args, attrs, shapes):
    return torch.minimum(_iota(ctx) + 1, ctx.lengths.unsqueeze(-1)).to(ctx.state.dtype)


def _const(ctx, args, attrs, shapes):
    sizes = {"C": ctx.C}
    batch = ctx.lengths.shape
    return torch.full((*batch, *[sizes[d] for d in attrs["shape"]]), float(attrs["value"]),
                      dtype=ctx.state.dtype, device=ctx.state.device)


def _at_last(ctx, args, attrs, shapes):
    (x,), (s,) = args, shapes
    at = (_iota(ctx) == (ctx.lengths - 1).clamp(min=0).unsqueeze(-1)).to(x.dtype)
    return x.unsqueeze(-2) * at.unsqueeze(-1) if s else x.unsqueeze(-1) * at  # a K-vector: a C×K block


def _sum_all(ctx, args, attrs, shapes):
    (x,), (s,) = args, shapes
    return x.sum(dim=tuple(range(-len(s), 0))) if s else x


def _matrix_to(dim):
    """rowsum (dim 0 kept) sums a block's second dim, colsum (dim 1 kept) its first; a C×C×K block
    keeps its K too."""
    def shape(shapes, attrs):
        (s,) = shapes
        if len(s) not in (2, 3):
            raise ValueError(f"a row or column sum of a non-matrix {s}")
        return (s[0], *s[2:]) if dim == 0 else s[1:]
    return shape


def _block_sum(first):
    def ev(ctx, args, attrs, shapes):
        (x,), (s,) = args, shapes
        return x.sum(-len(s) if first else -len(s) + 1)
    return ev


def _last_shape(shapes, attrs):
    (s,) = shapes
    if s not in (("C",), ("C", "K")):
        raise ValueError(f"last of a {s} block: it takes a vector over the chunk or a C×K block")
    return s[1:]


def _at_last_shape(shapes, attrs):
    (s,) = shapes
    if s not in ((), ("K",)):
        raise ValueError(f"at_last of a {s} block: it takes a scalar or a per-key vector")
    return ("C", *s)


def _same(shapes, attrs):
    return shapes[0]


def _fixed(shape):
    return lambda shapes, attrs: shape


OPS: dict[str, OpDef] = {}


def _op(name, arity, shape, ev, doc):
    OPS[name] = OpDef(name, arity, shape, ev, doc)


# input kinds: key, value, scalar, gate (the spec's); the backward program adds the cotangent of o
# (cotangent_value) and the state saved by the forward as the one that entered the chunk (saved_state)
INPUT_SHAPES = {"key": ("C", "K"), "key_gate": ("C", "K"), "value": ("C", "V"), "cotangent_value": ("C", "V"),
                "saved_state": ("K", "V")}
_op("input", 0, lambda s, a: INPUT_SHAPES.get(a["kind"], ("C",)),
    lambda ctx, args, a, s: ctx.inputs[a["name"]], "a block of a per-token input")
_op("head_log", 0, _fixed(()), lambda ctx, args, a, s: ctx.head_consts[a["name"]],
    "log of a per-head constant decay")
_op("param", 0, _fixed(()), lambda ctx, args, a, s: ctx.params[a["name"]], "a runtime scalar")
_op("const", 0, lambda s, a: tuple(a["shape"]), _const, "a constant block")
_op("state_in", 0, _fixed(("K", "V")), lambda ctx, args, a, s: ctx.state, "the state entering the chunk")
_op("valid", 0, _fixed(("C",)), _valid, "1 for tokens of the chunk, 0 for padding")
_op("positions", 0, _fixed(("C",)), _positions, "i+1, clipped at the chunk's length (= cumsum(valid))")
_op("cumsum", 1, _same, _cumsum(False), "chunk-local inclusive prefix sum (of a C×K block: per key)")
_op("last", 1, _last_shape, _last, "the value at the chunk's last token (of a C×K block: its row, K)")
_op("masked_diff", 1, _masked_diff_shape, _masked_diff,
    "x_i − x_j where j ≤ i (mask=lower) or j < i (mask=strict), −inf elsewhere (of C×K: C×C×K, per key); "
    "block=B: only where i and j share a sub-chunk of B tokens")
_op("keep", 1, _keep_shape, _keep, "a C×C block on its rows (dim=0) or columns (dim=1) lo ≤ · < hi, 0 elsewhere")
_op("ref_diff", 1, _ref_diff_shape, _ref_diff,
    "x_i − x_ref (later) or x_ref − x_i (not later) on the rows lo ≤ i < hi, −inf elsewhere "
    "(of C×K: per key; ref, lo, hi: rows of the chunk)")
# the floor on a log-gate (passes/chunk.py's G_FLOOR): g = −inf, a hard reset, would otherwise meet
# another −inf in a masked difference, (−inf) − (−inf) = NaN
_op("clamp_min", 1, _same, lambda ctx, args, a, s: args[0].clamp_min(a["min"]), "max(x, min)")
_op("above", 1, _same, lambda ctx, args, a, s: (args[0] > a["min"]).to(args[0].dtype),
    "1 where x > min, else 0 (the derivative of clamp_min)")
_op("exp", 1, _same, lambda ctx, args, a, s: torch.exp(args[0]), "e^x")
_op("exp2", 1, _same, lambda ctx, args, a, s: torch.exp2(args[0]), "2^x")
_op("neg", 1, _same, lambda ctx, args, a, s: -args[0], "−x")
_op("add", 2, _elementwise_shape, _elementwise(operator.add), "x + y")
_op("sub", 2, _elementwise_shape, _elementwise(operator.sub), "x − y")
_op("mul", 2, _elementwise_shape, _elementwise(operator.mul), "x ⊙ y (a scalar or vector broadcasts)")
_op("scale_rows", 2, lambda s, a: s[1], lambda ctx, args, a, s: args[0].unsqueeze(-1) * args[1],
    "diag(d) X")
_op("scale_cols", 2, lambda s, a: s[0], lambda ctx, args, a, s: args[0] * args[1].unsqueeze(-2),
    "X diag(d)")
_op("eye", 0, _fixed(("K", "K")),
    lambda ctx, args, a, s: torch.eye(ctx.state.shape[-2], dtype=ctx.state.dtype, device=ctx.state.device)
    .view(*[1] * ctx.nb, ctx.state.shape[-2], ctx.state.shape[-2]),
    "the K×K identity (the linear part of the state, passes/affine.py)")
_op("causal_mask", 0, _fixed(("C", "C")),
    lambda ctx, args, a, s: _tri_mask(ctx.C, a["mask"] == "strict", ctx.lengths).to(ctx.state.dtype)
    .view(*[1] * ctx.nb, ctx.C, ctx.C),
    "1 where j ≤ i (mask=lower) or j < i (mask=strict), else 0")
_op("matmul", 2, _matmul_shape, _matmul, "X · Y (ta, tb: transpose an operand)")
_op("tril", 1, _same, _tril, "keep the lower triangle (strict: below the diagonal; of C×C×K: over i, j)")
# the per-key decay's products, Σ_k X_ik Z_jk R_ijk (eq DECAYED_PRODUCT), and their VJPs: an
# einsum, whose every index names a block dim
DECAYED_PRODUCT = "ik,jk,ijk->ij"  # (X ⋆ Z)_ij = Σ_k X_ik Z_jk R_ijk
# the two its VJP makes: d X = d P ⋆_rows Z (Σ_{j≤i} d P_ij Z_jk R_ijk) and d Z = d P ⋆_cols X
# (Σ_{i≥j} d P_ij X_ik R_ijk)
ROWS_PRODUCT, COLS_PRODUCT = "ij,jk,ijk->ik", "ij,ik,ijk->jk"
_op("contract", -1, _contract_shape, _contract, "einsum over the block dims (eq: its subscripts)")
_op("inv_unit_lower", 1, _same, _inv_unit_lower, "(I + A)⁻¹ for strictly lower triangular A")

# ops of the backward program (passes/autodiff.py): the transposes of cumsum, last, broadcasting
_op("rev_cumsum", 1, _same, _cumsum(True), "chunk-local inclusive suffix sum (the transpose of cumsum)")
_op("at_last", 1, _at_last_shape, _at_last,
    "x at the chunk's last token, 0 elsewhere (the transpose of last)")
_op("rowsum", 1, _matrix_to(0), _block_sum(False), "Σ_j X_ij (of C×C×K: Σ_j X_ijk)")
_op("colsum", 1, _matrix_to(1), _block_sum(True), "Σ_i X_ij (of C×C×K: Σ_i X_ijk)")
_op("sum_all", 1, _fixed(()), _sum_all, "the sum of every entry of a block (the transpose of broadcasting)")

# ops through which a scaling of the input scales the output by the same factor
LINEAR = {"cumsum", "last", "masked_diff", "ref_diff", "keep", "neg", "add", "sub", "rev_cumsum", "at_last", "rowsum", "colsum",
          "sum_all"}  # (contract is linear in each argument, not in all at once: not here)
EXPONENTIALS = {"exp", "exp2"}
