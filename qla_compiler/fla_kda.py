"""FLA's call conventions for KDA beyond the recurrence itself: the gate computed from raw
activations (`use_gate_in_kernel` with `A_log`, `dt_bias`, `lower_bound`), β through a sigmoid
(`use_beta_sigmoid_in_kernel`, `allow_neg_eigval`), the state stored V-first (`state_v_first`),
and the options that only tune FLA's own kernels. Kimi Linear's layers call `chunk_kda` so; with
these, `qla_compiler.ops.chunk_kda` takes the same call.

Each is a torch expression around the op (differentiable, so the backward meets FLA's: d A_log,
d dt_bias and the raw β's gradient come from autograd through it), not a change to the
recurrence: the spec stays S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ.

    >>> import torch
    >>> g_raw, A_log = torch.randn(1, 4, 2, 8), torch.zeros(2)
    >>> bool((kda_gate(g_raw, A_log, None, None) <= 0).all())     # −e^{A_log} softplus(g): a decay
    True
    >>> float(kda_gate(torch.full((1, 1, 1, 1), 50.0), None, None, -5.0).min())   # lower_bound σ(g)
    -5.0
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


def kda_gate(g: torch.Tensor, A_log, dt_bias, lower_bound) -> torch.Tensor:
    """FLA's KDA gate from the raw activation g [B, T, HV, K], in float32 (float64 from float64):
    −e^{A_log} softplus(g + dt_bias), or with `lower_bound` lower_bound · σ(e^{A_log} (g + dt_bias))
    (σ(g + dt_bias) without A_log), which lies in [lower_bound, 0). A_log [HV], dt_bias [HV · K]."""
    HV, dtype = g.shape[-2], _wide(g)
    x = g.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).view(HV, -1)
    if lower_bound is not None:
        if A_log is not None:
            x = A_log.to(dtype).view(HV, 1).exp() * x
        return lower_bound * torch.sigmoid(x)
    return -A_log.to(dtype).view(HV, 1).exp() * F.softplus(x)


def _wide(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def fla_kda(op):
    """`op` (a KDA op, chunk or recurrent) taking FLA's KDA keywords on top of its own."""
    def call(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
             use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
             use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
             return_intermediate_states=False, safe_gate=False, chunk_size=64, disable_recompute=False,
             cu_seqlens_cpu=None, transpose_state_layout=None, **options):
        # (safe_gate, chunk_size, disable_recompute and cu_seqlens_cpu choose among FLA's own
        # kernels' algorithms: the recurrence is the same, so they are checked as FLA checks them
        # and change nothing)
        if transpose_state_layout is not None:  # (FLA's deprecated name)
            if state_v_first:
                raise ValueError("state_v_first: cannot pass both it and the deprecated transpose_state_layout")
            warnings.warn("transpose_state_layout is deprecated and renamed to state_v_first",
                          DeprecationWarning, stacklevel=2)
            state_v_first = transpose_state_layout
        if return_intermediate_states:
            raise ValueError("return_intermediate_states: not supported (FLA's vLLM path returns every chunk's "
                             "state); the final state comes with output_final_state=True")
        if chunk_size not in (32, 64):
            raise ValueError(f"chunk_size: FLA's KDA takes 32 or 64, got {chunk_size} (here it changes "
                             "nothing: the kernels' chunk is 64, the recurrence the same)")
        if use_gate_in_kernel:
            if A_log is None and lower_bound is None:
                raise ValueError("A_log: needed with use_gate_in_kernel=True unless lower_bound is set")
            if safe_gate and not (lower_bound is not None and -5 <= lower_bound < 0):
                raise ValueError(f"lower_bound: safe_gate with use_gate_in_kernel takes one in [-5, 0), "
                                 f"got {lower_bound}")
            g = kda_gate(g, A_log, dt_bias, lower_bound)
        elif A_log is not None or dt_bias is not None:
            raise ValueError("A_log, dt_bias: they make the gate from a raw g only with use_gate_in_kernel=True")
        if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
            raise ValueError("allow_neg_eigval: needs use_beta_sigmoid_in_kernel=True (β = 2σ(β_raw))")
        if use_beta_sigmoid_in_kernel:
            beta = torch.sigmoid(beta.to(_wide(beta))) * (2.0 if allow_neg_eigval else 1.0)
        if state_v_first and options.get("ssm_state_indices") is not None:
            raise ValueError("state_v_first: a state pool is read and written in place, K-first ([slots, HV, K, V])")
        if state_v_first and initial_state is not None:
            initial_state = initial_state.transpose(-1, -2).contiguous()
        o, final = op(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, **options)
        if state_v_first and final is not None:
            final = final.transpose(-1, -2).contiguous()
        return o, final

    call.__name__ = call.__qualname__ = op.__name__
    call.__doc__ = (op.__doc__ or "") + "\n\nWith FLA's KDA keywords: qla_compiler.fla_kda."
    return call
