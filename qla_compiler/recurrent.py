"""The recurrent (token-step) call of a compiled op: FLA's `fused_recurrent_*` conventions, plus the
state pools serving engines pass. For decoding: a few tokens per sequence, many sequences.

    >>> import torch, qla_compiler
    >>> op = qla_compiler.compile("gdn")
    >>> q, k = torch.randn(1, 3, 2, 16), torch.randn(1, 3, 2, 16)
    >>> v, g, beta = torch.randn(1, 3, 2, 16), -torch.rand(1, 3, 2), torch.rand(1, 3, 2)
    >>> pool = torch.zeros(8, 2, 16, 16)                     # 8 slots, one per request
    >>> cu = torch.tensor([0, 1, 2, 3])                       # three requests, one token each
    >>> o, _ = op.recurrent(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu,
    ...                     ssm_state_indices=torch.tensor([5, -1, 0]), inplace_final_state=True)
    >>> o.shape, bool(pool[5].abs().sum() > 0), bool(pool[1].abs().sum() == 0)
    (torch.Size([1, 3, 2, 16]), True, True)

Arguments: the spec's inputs, then `scale`, `initial_state` ([N, HV, K, V], or a pool [slots, HV, K, V]
with `ssm_state_indices`), `output_final_state`, `cu_seqlens`, `use_qk_l2norm_in_kernel`,
`ssm_state_indices` ([N]: the slot of each sequence, negative for a padding entry that reads and
writes nothing; or [N, T_max] for speculative decoding, the slot the state after each token goes
to, with `num_accepted_tokens` [N]: the step starts from slot [n, num_accepted_tokens[n] − 1]),
`inplace_final_state` (write each sequence's new state into its own slot; no other slot changes).
Returns (o, final): o like the chunk op's; final is the pool itself when in place, else
[N, HV, K, V] in the state's dtype (float32 without an initial state), or None without
`output_final_state`.

As FLA's `fused_recurrent_*`, q and k may come in float32 beside bf16/fp16 values (its tests pass
them so): they are normalised in their own dtype (with `use_qk_l2norm_in_kernel`), then rounded to
the values' dtype the kernel reads, which is what FLA's reference does to them. A call whose inputs
need gradients (FLA's takes such inputs, and raises only in backward) runs the chunk op, the same
recurrence chunk by chunk, and is differentiable; with a state pool it is refused.

CUDA bf16/fp16 inputs run the generated token-step kernel (passes/token_step.py); anything else
runs the same host code with the KernelIR interpreter in place of the kernel.
"""
from __future__ import annotations

import torch

from . import custom_ops
from .checks import FLOATS, check_inputs
from .op import _l2norm, _wants_grad

STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_pool(initial_state, indices, num_accepted, inplace, dims, device):
    N = dims.N
    if indices is not None:
        if not torch.is_tensor(indices) or indices.dtype not in (torch.int32, torch.int64) or indices.dim() not in (1, 2):
            raise ValueError("ssm_state_indices: expected an int32/int64 tensor [N] or [N, T_max], got "
                             + (f"{indices.dtype} {list(indices.shape)}" if torch.is_tensor(indices)
                                else type(indices).__name__))
        if indices.shape[0] != N:
            raise ValueError(f"ssm_state_indices: expected {N} rows (one per sequence), got {indices.shape[0]}")
        if indices.device != device:
            raise ValueError(f"ssm_state_indices: on {indices.device}, but the inputs are on {device}")
        if initial_state is None:
            raise ValueError("initial_state: ssm_state_indices names slots of a state pool; pass the pool "
                             "[slots, HV, K, V] as initial_state")
        if indices.dim() == 2 and not inplace:
            raise ValueError("inplace_final_state: speculative decoding (ssm_state_indices [N, T_max]) writes "
                             "the state after every token into the pool; pass inplace_final_state=True")
    elif inplace:
        raise ValueError("inplace_final_state: needs ssm_state_indices (the slots to write back into)")
    if num_accepted is not None:
        if indices is None or indices.dim() != 2:
            raise ValueError("num_accepted_tokens: only with ssm_state_indices [N, T_max] (speculative decoding)")
        if not torch.is_tensor(num_accepted) or tuple(num_accepted.shape) != (N,) or num_accepted.is_floating_point():
            raise ValueError(f"num_accepted_tokens: expected an integer tensor [{N}]")
    if initial_state is not None:
        want = [dims.HV, dims.K, dims.V]
        if not torch.is_tensor(initial_state) or initial_state.dim() != 4 or list(initial_state.shape[1:]) != want:
            got = list(initial_state.shape) if torch.is_tensor(initial_state) else type(initial_state).__name__
            raise ValueError(f"initial_state: expected [{'slots' if indices is not None else N}, {dims.HV}, "
                             f"{dims.K}, {dims.V}], got {got}")
        if indices is None and initial_state.shape[0] != N:
            raise ValueError(f"initial_state: expected {N} states (one per sequence) without ssm_state_indices, "
                             f"got {initial_state.shape[0]}")
        if initial_state.dtype not in STATE_DTYPES:
            raise ValueError(f"initial_state: expected a float32, bf16 or fp16 pool (float64 on the CPU), "
                             f"got {initial_state.dtype}")
        if initial_state.device != device:
            raise ValueError(f"initial_state: on {initial_state.device}, but the inputs are on {device}")
        if indices is not None and not torch.compiler.is_compiling():  # (there: qla::token_step checks)
            check_pool_values(initial_state, indices)
        if inplace and not initial_state.is_contiguous():
            raise ValueError("initial_state: the pool must be contiguous to be written in place")


def check_pool_values(pool, *slots) -> None:
    """Every slot named lies inside the pool (read on the CPU only: values on a GPU are not read,
    which would synchronise)."""
    for s in slots:
        if s.device.type == "cpu" and s.numel() and int(s.max()) >= pool.shape[0]:
            raise ValueError(f"ssm_state_indices: slot {int(s.max())} is past the pool's {pool.shape[0]} slots")


def token_step_kernel(op, v, dims, scale: float, pool):
    """What runs the token step: None for the compiled kernel (CUDA bf16/fp16 inputs), else the
    KernelIR interpreter standing in for it."""
    if not (op.program.target == "sm90" and v.is_cuda and v.dtype in (torch.bfloat16, torch.float16)):
        return _interpreted(op.program.token_step_program, dims, scale, op._head_logs(dims.HV))
    from .kernels.token_step import check_dims

    check_dims(dims.K, dims.V)
    if pool.dtype == torch.float64:
        raise ValueError("initial_state: the GPU token step takes float32, bf16 or fp16 states, got float64")
    return None


def recurrent(op, *args, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              use_qk_l2norm_in_kernel=False, ssm_state_indices=None, inplace_final_state=False,
              num_accepted_tokens=None, **named):
    from .kernels import token_step as host

    inputs, use_qk_l2norm_in_kernel = _keys_in_values_dtype(op, op._bind(args, named), use_qk_l2norm_in_kernel)
    compiling = torch.compiler.is_compiling()  # (then the custom op reads the values)
    dims = check_inputs(inputs, op.kinds, None, cu_seqlens, scale, read_values=not compiling)
    device = inputs[op.value_name].device
    _check_pool(initial_state, ssm_state_indices, num_accepted_tokens, inplace_final_state, dims, device)
    if _wants_grad(*inputs.values(), initial_state):
        if ssm_state_indices is not None or inplace_final_state:
            raise ValueError(f"{op.name}.recurrent: a state pool (ssm_state_indices, inplace_final_state) is for "
                             "decoding and takes no gradients; call under torch.no_grad(), or without the pool")
        o, final = op(**inputs, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                      cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return o, (final.to(initial_state.dtype) if final is not None and initial_state is not None else final)
    if use_qk_l2norm_in_kernel:  # FLA's normalisation, as the chunk op and the reference do it
        inputs = {n: (_l2norm(x) if op.kinds[n] == "key" else x) for n, x in inputs.items()}
    scale = dims.K ** -0.5 if scale is None else float(scale)
    read, write, final, pool, out, returned = host.slots(dims.N, dims, device, initial_state, ssm_state_indices,
                                                         num_accepted_tokens, inplace_final_state, output_final_state,
                                                         cache=not compiling)
    cu = host.sequence_starts(dims.B, dims.T, cu_seqlens, device, cache=not compiling)
    xs = [inputs[n] for n in op.input_names]
    if inplace_final_state or (ssm_state_indices is not None and ssm_state_indices.dim() == 2):
        o = custom_ops.call("token_step_inplace", op.key, xs, cu, read, write, final, pool, scale, compiling)
    else:  # (nothing returned: the kernel writes no state, into a placeholder rather than the pool)
        out = pool.new_empty(1, *pool.shape[1:]) if out is pool else out
        o = custom_ops.call("token_step", op.key, xs, cu, read, write, final, pool, out, scale, compiling)
    return o, returned


def _keys_in_values_dtype(op, inputs: dict, l2norm: bool) -> tuple:
    """(inputs, whether the keys are still to be normalised): keys in a floating dtype other than the
    values' normalised (if asked) in their own, then rounded to the values'; else as they came (a
    dtype check_inputs refuses, or one dtype for all: normalised later, once checked)."""
    v = inputs.get(op.value_name)
    keys = [n for n in op.input_names if op.kinds[n] == "key"]
    if not (torch.is_tensor(v) and v.dtype in FLOATS and all(torch.is_tensor(inputs[n]) and inputs[n].dtype in FLOATS
                                                             for n in keys if n in inputs)):
        return inputs, l2norm
    if all(inputs[n].dtype == v.dtype for n in keys if n in inputs):
        return inputs, l2norm
    return {n: ((_l2norm(x) if l2norm else x).to(v.dtype) if n in keys else x) for n, x in inputs.items()}, False


def _interpreted(program, dims, scale, head_logs):
    """The token step run by the KernelIR interpreter, in float64, on the GPU's tiles and V-blocks
    (kernels/token_step.block_v): padded head dims and V-blocks are exercised on the CPU too."""
    from .ir.kernel_interp import Sizes, run_kernel
    from .kernels.forward import H200_SMS
    from .kernels.token_step import block_v
    from .passes.lower_tilelang import tile_width

    (k,) = program.kernels.kernels
    K, V = tile_width(dims.K), tile_width(dims.V)
    BV = block_v(V, dims.HV, dims.N, dims.B * dims.T, H200_SMS)
    sizes = Sizes(K=K, V=V, BV=BV, HV=dims.HV, G=dims.HV // dims.H, C=1, head_logs=head_logs)

    def run(*tensors):
        run_kernel(k, {p.name: x for p, x in zip(k.params, tensors)}, sizes, scale)
    return run
