"""Random inputs for any compiled op, the error measure every check uses, and input gradients.

    >>> import qla_compiler
    >>> op = qla_compiler.compile("gdn")
    >>> args = random_inputs(op, T=100, H=2, HV=4, K=16, V=16, seed=0)
    >>> rel_err(op(**args)[0], op.reference(**args)[0]) < 1e-5
    True
    >>> g, g_ref = input_grads(op, args), input_grads(op.reference, args)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def random_inputs(op, *, B=1, T=64, H=1, HV=1, K=16, V=16, cu_seqlens=None, dtype=torch.float64,
                  gate=None, beta=None, initial_state=False, device="cpu", seed=0) -> dict:
    """Keyword arguments for `op`: unit-norm keys, normal values, β in (0, 1), log-gates
    logsigmoid(N(3, 1)) (per key too, for a per-key gate) by default, or filled with `gate` /
    `beta` when given as a number."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, kind in op.kinds.items():
        if kind == "key":
            x = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
        elif kind == "value":
            x = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
        elif kind in ("gate", "key_gate"):
            shape = (B, T, HV) if kind == "gate" else (B, T, HV, K)
            x = (torch.full(shape, float(gate), dtype=torch.float64) if gate is not None
                 else F.logsigmoid(torch.randn(shape, generator=gen, dtype=torch.float64) + 3.0))
        else:
            x = (torch.full((B, T, HV), float(beta), dtype=torch.float64) if beta is not None
                 else torch.rand(B, T, HV, generator=gen, dtype=torch.float64))
        out[name] = x.to(device=device, dtype=dtype if kind in ("key", "value") else
                         (torch.float64 if dtype == torch.float64 else torch.float32))
    if cu_seqlens is not None:
        out["cu_seqlens"] = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    if initial_state:
        N = B if cu_seqlens is None else len(cu_seqlens) - 1
        s = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64)
        out["initial_state"] = s.to(device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    out["output_final_state"] = True
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf if out has any inf or NaN."""
    out, ref = out.double(), ref.double().to(out.device)
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def input_grads(fn, args: dict, *, state_grad: bool = True, seed: int = 0) -> dict:
    """Gradients of every floating tensor in `args` (inputs and initial_state) through
    `fn(**args) -> (o, final_state)`, for random cotangents of o and — with `state_grad` and a
    final state returned — of the final state (otherwise the final state gets no gradient)."""
    names = [n for n, x in args.items() if torch.is_tensor(x) and x.is_floating_point()]
    leaves = {n: args[n].detach().clone().requires_grad_(True) for n in names}
    o, final = fn(**{**args, **leaves})
    gen = torch.Generator().manual_seed(seed)
    outs, cots = [o], [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o)]
    if state_grad and final is not None:
        outs.append(final)
        cots.append(torch.randn(final.shape, generator=gen, dtype=torch.float64).to(final))
    grads = torch.autograd.grad(outs, [leaves[n] for n in names], cots, allow_unused=True)
    return {n: (torch.zeros_like(leaves[n]) if g is None else g) for n, g in zip(names, grads)}


class OpLog:
    """Within it, `ops` names every op dispatched in eager mode outside a custom op's body, in
    order (a torch dispatch mode: what a call runs around the kernels, and whether it goes
    through a custom op at all).

        >>> with OpLog() as log:
        ...     _ = torch.zeros(2) + 1
        >>> log.ops
        ['aten.zeros.default', 'aten.add.Tensor']
    """

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops = []

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.append(str(func))
                return func(*args, **(kwargs or {}))
        self._mode = _Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)
