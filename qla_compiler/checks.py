"""Argument checks for compiled ops: every bad input is a ValueError naming the argument.

The checks read only shapes, dtypes and devices, plus the values of cu_seqlens and of the gates
when they live on the CPU; values on the GPU are not read (that would synchronise the host, and
break CUDA-graph capture), so `check_cu_seqlens_values` is separate. Under torch.compile the
values are not read here either (a graph break): `check_values` runs inside the custom op
instead (qla_compiler/custom_ops.py), where they are at hand.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Dims:
    B: int
    T: int
    H: int  # query/key heads
    HV: int  # value heads
    K: int
    V: int
    N: int  # sequences


def _tensor(name, x, ndim, what):
    """`what`: the expected shape in words, or a function making it (formatting a size under
    torch.compile would specialise the graph to it)."""
    if not (torch.is_tensor(x) and x.dim() == ndim and x.dtype in FLOATS) and callable(what):
        what = what()
    if not torch.is_tensor(x):
        raise ValueError(f"{name}: expected a tensor {what}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected {what}, got shape {list(x.shape)}")
    if x.dtype not in FLOATS:
        raise ValueError(f"{name}: expected a floating dtype (bf16, fp16, fp32, fp64), got {x.dtype}")


_PASSED: dict = {}  # check_inputs: the signatures whose shapes, dtypes and devices passed -> Dims
_PASSED_MAX = 256


def check_inputs(inputs: dict, kinds: dict, initial_state, cu_seqlens, scale, read_values: bool = True) -> Dims:
    """inputs: name -> tensor, kinds: name -> key|value|scalar|gate|key_gate (in the spec's order).
    `read_values=False`: shapes, dtypes and devices only (check_values is left to the caller).

    A call whose arguments have the shapes, dtypes and devices of one that passed before (a model's
    every layer, every decode step) skips those checks: they were ~35 µs of a decode step's ~130
    µs of host time (issue 19). The values are read every call.

        >>> x, g = torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2)
        >>> check_inputs(dict(k=x, v=x, g=g), dict(k="key", v="value", g="gate"), None, None, None).HV
        2
    """
    key = _signature(inputs, kinds, initial_state, cu_seqlens, scale)
    dims = _PASSED.get(key) if key is not None else None
    if dims is None:
        dims = _check_shapes(inputs, kinds, initial_state, cu_seqlens, scale, read_values)
        if key is not None:
            if len(_PASSED) >= _PASSED_MAX:
                _PASSED.pop(next(iter(_PASSED)))
            _PASSED[key] = dims
    elif read_values:
        check_values(inputs, kinds, cu_seqlens, dims.T)
    return dims


def _signature(inputs: dict, kinds: dict, initial_state, cu_seqlens, scale):
    """What check_inputs' shape checks read, hashable; None where the arguments are not all tensors
    (the checks then name the one that is not), or under torch.compile (whose symbolic sizes a
    dictionary key would specialise)."""
    if torch.compiler.is_compiling():
        return None
    try:
        key = (tuple((n, kinds[n], x.shape, x.dtype, x.device) for n, x in inputs.items()), len(kinds),
               None if initial_state is None else (initial_state.shape, initial_state.dtype, initial_state.device),
               None if cu_seqlens is None else (cu_seqlens.shape, cu_seqlens.dtype, cu_seqlens.device),
               type(scale), scale)  # (the type: True == 1, but only one is a scale)
        hash(key)
        return key
    except (AttributeError, KeyError, TypeError):
        return None


def _check_shapes(inputs: dict, kinds: dict, initial_state, cu_seqlens, scale, read_values: bool) -> Dims:
    keys = [n for n in kinds if kinds[n] == "key"]
    values = [n for n in kinds if kinds[n] == "value"]
    for n in keys:
        _tensor(n, inputs[n], 4, "[B, T, H, K]")
    for n in values:
        _tensor(n, inputs[n], 4, "[B, T, HV, V]")
    B, T, H, K = inputs[keys[0]].shape
    _, _, HV, V = inputs[values[0]].shape
    for n, size in ((keys[0], dict(B=B, T=T, H=H, K=K)), (values[0], dict(HV=HV, V=V))):
        empty = [d for d, s in size.items() if s == 0]
        if empty:
            raise ValueError(f"{n}: has no elements ({', '.join(empty)} = 0 in shape {list(inputs[n].shape)})")
    if tuple(inputs[values[0]].shape[:2]) != (B, T):
        raise ValueError(_token_dims_differ(inputs, kinds, keys, values))
    for n in keys[1:]:
        if tuple(inputs[n].shape) != (B, T, H, K):
            raise ValueError(f"{n}: expected shape {[B, T, H, K]} like {keys[0]}, got {list(inputs[n].shape)}"
                             + _head_first(n, inputs[n], (B, T, H, K), "[B, H, T, K]"))
    for n in values:
        if tuple(inputs[n].shape[:2]) != (B, T):
            raise ValueError(f"{n}: expected [B={B}, T={T}, HV, V], got {list(inputs[n].shape)}")
    if HV % H != 0:
        raise ValueError(f"{values[0]}: its {HV} value heads must be a multiple of the {H} query/key "
                         f"heads of {keys[0]} (grouped value heads)")
    for n, kind in kinds.items():
        if kind in ("scalar", "gate"):
            _tensor(n, inputs[n], 3, lambda: f"[B={B}, T={T}, HV={HV}]")
            if tuple(inputs[n].shape) != (B, T, HV):
                raise ValueError(f"{n}: expected shape {[B, T, HV]}, got {list(inputs[n].shape)}"
                                 + _head_first(n, inputs[n], (B, T, HV), "[B, HV, T]"))
    for n, kind in kinds.items():
        if kind == "key_gate":
            _tensor(n, inputs[n], 4, f"[B={B}, T={T}, HV={HV}, K={K}] (a gate per key dimension)")
            if tuple(inputs[n].shape) != (B, T, HV, K):
                raise ValueError(f"{n}: expected shape {[B, T, HV, K]} (a gate per key dimension), got "
                                 f"{list(inputs[n].shape)}" + _head_first(n, inputs[n], (B, T, HV, K), "[B, HV, T, K]"))
    first = inputs[keys[0]]
    dt = first.dtype
    for n in keys + values:
        if inputs[n].dtype != dt:
            raise ValueError(f"{n}: dtype {inputs[n].dtype} differs from {keys[0]}'s {dt}; "
                             "q, k and v must share one dtype")
    for n, x in inputs.items():
        if x.device != first.device:
            raise ValueError(f"{n}: on {x.device}, but {keys[0]} is on {first.device}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(scale)):
        raise ValueError(f"scale: expected a finite float or None, got {scale!r}")
    if read_values:
        check_gate_values(inputs, kinds)

    N = B
    if cu_seqlens is not None:
        if not torch.is_tensor(cu_seqlens) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (
                torch.int32, torch.int64):
            raise ValueError("cu_seqlens: expected a 1-D int32 or int64 tensor [N+1]")
        if B != 1:
            raise ValueError(f"cu_seqlens: packed sequences need B = 1, got B = {B}")
        if cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens: expected at least 2 entries [0, ..., T]")
        if cu_seqlens.device != first.device:
            raise ValueError(f"cu_seqlens: on {cu_seqlens.device}, but the inputs are on {first.device}")
        N = cu_seqlens.numel() - 1
        if cu_seqlens.device.type == "cpu" and read_values:
            check_cu_seqlens_values(cu_seqlens, T)
    if initial_state is not None:
        if not torch.is_tensor(initial_state) or initial_state.dtype not in FLOATS:
            raise ValueError("initial_state: expected a floating tensor [N, HV, K, V]")
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(f"initial_state: expected shape {[N, HV, K, V]} (N sequences, HV value heads, "
                             f"K, V), got {list(initial_state.shape)}")
        if initial_state.device != first.device:
            raise ValueError(f"initial_state: on {initial_state.device}, but the inputs are on {first.device}")
    return Dims(B, T, H, HV, K, V, N)


def check_values(inputs: dict, kinds: dict, cu_seqlens, T: int) -> None:
    """What check_inputs reads of the values (on the CPU): the gates, then cu_seqlens."""
    check_gate_values(inputs, kinds)
    if cu_seqlens is not None and cu_seqlens.device.type == "cpu":
        check_cu_seqlens_values(cu_seqlens, T)


def check_gate_values(inputs: dict, kinds: dict) -> None:
    """The premise of every decay computation: log-gates are ≤ 0 (read on the CPU only)."""
    for n, kind in kinds.items():
        if kind in ("gate", "key_gate") and inputs[n].device.type == "cpu" and inputs[n].numel() \
                and bool((inputs[n] > 0).any()):
            raise ValueError(f"{n}: a log-space gate must be ≤ 0 (a decay), but its largest value is "
                             f"{float(inputs[n].max()):g}")


def _head_first(name: str, x, expected: tuple, layout: str) -> str:
    """The hint for a tensor that is `expected` with its dims 1 and 2 swapped (else nothing)."""
    if x.dim() < 3 or (x.shape[0], x.shape[2], x.shape[1], *x.shape[3:]) != tuple(expected):
        return ""
    return _layout_hint([name], layout)


def _layout_hint(names: list, layout: str) -> str:
    return (f": {' and '.join(names)} {'are' if len(names) > 1 else 'is'} head-first ({layout}); the op "
            f"takes FLA's layout, tokens before heads ({names[0]}.transpose(1, 2))")


def _token_dims_differ(inputs: dict, kinds: dict, keys: list, values: list) -> str:
    """The message for q/k and v disagreeing on [B, T], naming the side at fault: the one the
    per-token scalars and gates ([B, T, HV]) disagree with, else the one whose dims 1 and 2
    swapped agree with the other's (it is head-first, [B, H, T, ...]), else the value."""
    q, v = inputs[keys[0]], inputs[values[0]]
    bt_k, bt_v = tuple(q.shape[:2]), tuple(v.shape[:2])
    per_token = {n: tuple(inputs[n].shape[:2]) for n, kind in kinds.items()
                 if kind in ("scalar", "gate") and torch.is_tensor(inputs[n]) and inputs[n].dim() == 3}
    votes_k, votes_v = list(per_token.values()).count(bt_k), list(per_token.values()).count(bt_v)
    tensors = [x for x in inputs.values() if torch.is_tensor(x) and x.dim() >= 3]
    if all((x.shape[0], x.shape[2]) == (q.shape[0], q.shape[2]) for x in tensors) and \
            v.shape[1] % q.shape[1] == 0 and all(bt[1] == v.shape[1] for bt in per_token.values()):
        names = list(inputs)
        return (f"{keys[0]}: expected [B, T, H, K], got shape {list(q.shape)}: {', '.join(names[:-1])} and "
                f"{names[-1]} are all head-first ([B, H, T, ...]); the op takes FLA's layout, tokens before "
                "heads (transpose(1, 2) each)")
    keys_first = (q.shape[0], q.shape[2]) == bt_v  # q as [B, H, T, K]
    if votes_v > votes_k or (votes_v == votes_k and keys_first):
        (B, T), wrong = bt_v, [n for n in keys if tuple(inputs[n].shape[:2]) != bt_v]
        agree = [values[0], *[n for n, bt in per_token.items() if bt == bt_v]]
        return (f"{wrong[0]}: expected [B, T, H, K] with B = {B}, T = {T} like {', '.join(agree)}, got shape "
                f"{list(inputs[wrong[0]].shape)}" + (_layout_hint(wrong, "[B, H, T, K]") if keys_first else ""))
    (B, T), hint = bt_k, ""
    if (v.shape[0], v.shape[2]) == bt_k:
        hint = _layout_hint([values[0]], "[B, HV, T, V]")
    return f"{values[0]}: expected [B={B}, T={T}, HV, V] like {keys[0]}, got {list(v.shape)}{hint}"


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, T: int) -> None:
    """Starts at 0, ends at T, never decreases: two equal entries are an empty sequence (serving
    engines pad batches with them), which yields no rows and passes its initial state through."""
    cu = cu_seqlens.tolist()
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens: must start at 0, starts at {cu[0]}")
    if cu[-1] != T:
        raise ValueError(f"cu_seqlens: must end at T = {T} (the number of tokens), ends at {cu[-1]}")
    bad = next((i for i in range(len(cu) - 1) if cu[i + 1] < cu[i]), None)
    if bad is not None:
        raise ValueError(f"cu_seqlens: must not decrease, but cu_seqlens[{bad}] = {cu[bad]} "
                         f"and cu_seqlens[{bad + 1}] = {cu[bad + 1]}")


def option_fields(text: str, fields, option: str) -> list:
    """'A=1,B=x' -> [(A, '1'), (B, 'x')] for a CLI option whose value is a list of fields; an
    unknown field is a ValueError naming the option and the fields it takes."""
    out = []
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in fields:
            raise ValueError(f"{option}: unknown field {key!r} (fields: {', '.join(fields)})")
        out.append((key, value))
    return out

