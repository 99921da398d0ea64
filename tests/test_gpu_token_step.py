"""The token-step kernel (op.recurrent) on the GPU: against the spec's float64 recurrence and, for
GDN, within 1.1× of FLA's `fused_recurrent_gated_delta_rule` error on the same inputs (+ 1e-4, the
same share of bf16's rounding floor as tests/test_gpu_real_data.py allows); the state pools'
semantics as on the CPU (tests/test_token_step.py). FLA must import here: without it the FLA test
fails, it does not skip."""
import pytest
import torch

import qla_compiler
from qla_compiler.testing import random_inputs, rel_err

pytestmark = pytest.mark.gpu
TOL = 1e-2  # bf16 inputs and o; the state in float32


def _args(op, cu, K=128, V=128, seed=0):
    args = random_inputs(op, T=cu[-1], H=2, HV=8, K=K, V=V, cu_seqlens=cu, initial_state=True, seed=seed,
                         dtype=torch.bfloat16, device="cuda")
    return args


@pytest.mark.parametrize("spec", ["gdn", "delta_net", "simple_gla", "retnet", "linear_attn"])
def test_token_step_matches_the_recurrence(spec):
    """Sequences of 1, 39, 1, 0 and 4 tokens: the empty one's state passes through (the kernel
    loads each sequence's first token beside its state, and the next token ahead of each, where
    there is one)."""
    op = qla_compiler.compile(spec)
    args = _args(op, [0, 1, 40, 41, 41, 45])
    o, final = op.recurrent(**args)
    o_ref, final_ref = op.reference(**args)
    assert rel_err(o, o_ref) <= TOL and rel_err(final, final_ref) <= TOL
    assert torch.equal(final[3], args["initial_state"][3].float())


@pytest.mark.parametrize("K, V", [(128, 128), (100, 60), (256, 256), (128, 512)])
def test_gdn_token_step_within_flas_error(K, V):
    """(V = 512: past the chunk kernels' tiles, the token step takes it whole.)"""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla

    op = qla_compiler.compile("gdn")
    args = _args(op, [0, 1, 3, 35], K=K, V=V, seed=4)
    args["k"][0, 10:20] = args["k"][0, 10]  # a repeated token
    args["g"][0, 25] = -16.0
    o, final = op.recurrent(**args)
    o_ref, final_ref = op.reference(**args)
    o_fla, final_fla = fla(q=args["q"], k=args["k"], v=args["v"], g=args["g"], beta=args["beta"],
                           initial_state=args["initial_state"], output_final_state=True,
                           cu_seqlens=args["cu_seqlens"].long())
    for ours, theirs, ref in ((o, o_fla, o_ref), (final, final_fla, final_ref)):
        assert rel_err(ours, ref) <= 1.1 * rel_err(theirs, ref) + 1e-4, (rel_err(ours, ref), rel_err(theirs, ref))


def test_fla_fused_recurrent_conventions_on_the_gpu():
    """q, k in float32 beside bf16 v and β with use_qk_l2norm_in_kernel, as FLA's own
    test_fused_recurrent passes them: without gradients the token-step kernel runs on the keys
    normalised in float32 and rounded to bf16 (bitwise what it gives those keys passed so); with
    inputs that need gradients the chunk op runs, within bf16's tolerance of the reference, and
    backward gives every input a gradient."""
    op = qla_compiler.compile("gdn")
    args = _args(op, [0, 1, 3, 35], seed=6)
    keys = {n: args[n].float() for n in ("q", "k")}
    rounded = {n: (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) for n, x in keys.items()}
    o, final = op.recurrent(**{**args, **keys}, use_qk_l2norm_in_kernel=True)
    o_same, final_same = op.recurrent(**{**args, **rounded})
    assert torch.equal(o, o_same) and torch.equal(final, final_same)
    leaves = {n: x.clone().requires_grad_() for n, x in {**args, **keys}.items()
              if torch.is_tensor(x) and x.is_floating_point()}
    o_grad, final_grad = op.recurrent(**{**args, **leaves}, use_qk_l2norm_in_kernel=True)
    o_ref, final_ref = op.reference(**{**args, **rounded})
    assert rel_err(o_grad.detach(), o_ref) <= TOL and rel_err(final_grad.detach(), final_ref) <= TOL
    (o_grad.float().square().sum() + final_grad.square().sum()).backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in leaves.values())


@pytest.mark.parametrize("block_v", [8, 16])
def test_pool_semantics_on_the_gpu(block_v):
    """In place into slots 7, 2, 0, 5 of a float32 pool with a padding entry: the named slots at the
    reference, every other slot bitwise unchanged, the padding entry's o zero (the kernel's: o is
    allocated with NaN in it here), at both V-blocks the launch chooses between."""
    from qla_compiler.kernels.forward import launch_policy

    op = qla_compiler.compile("gdn")
    args = _args(op, list(range(6)))
    del args["initial_state"], args["output_final_state"]
    pool = torch.randn(9, 8, 128, 128, device="cuda")
    before = pool.clone()
    idx = torch.tensor([7, 2, -1, 0, 5], device="cuda")
    with launch_policy(token_block_v=block_v, poison=float("nan")):
        o, _ = op.recurrent(**args, initial_state=pool, ssm_state_indices=idx, inplace_final_state=True)
    real = (idx >= 0).cpu()
    o_ref, s_ref = op.reference(**args, initial_state=before[idx.clamp(min=0)], output_final_state=True)
    assert rel_err(o[0, real], o_ref[0, real]) <= TOL
    assert rel_err(pool[idx[real]], s_ref[real]) <= TOL
    assert torch.equal(o[0, 2], torch.zeros_like(o[0, 2]))
    untouched = [s for s in range(9) if s not in idx.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_cu_seqlens_int32_and_int64_are_read_in_place():
    """cu_seqlens as int64 (FLA's) or int32 (vLLM's): the kernel reads either in place, and the
    results are bitwise the same; nothing but the token step runs (no conversion, no fill)."""
    from torch.profiler import ProfilerActivity, profile

    op = qla_compiler.compile("gdn")
    args = _args(op, [0, 1, 2, 5])
    outs = []
    for dtype in (torch.int64, torch.int32):
        call = dict(args, cu_seqlens=args["cu_seqlens"].to(dtype))
        op.recurrent(**call)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            outs.append(op.recurrent(**call))
            torch.cuda.synchronize()
        kernels = [e.key for e in prof.key_averages() if e.self_device_time_total > 0]
        assert len(kernels) == 1 and "token_step" in kernels[0], (dtype, kernels)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("g_dtype, beta_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                                  (torch.bfloat16, torch.float32)])
def test_gates_in_the_io_dtype_are_read_as_they_are(g_dtype, beta_dtype):
    """g and β in bf16 beside bf16 q, k, v (FLA's own examples pass them so), or one of them in
    float32 (vLLM: g in float32, β in bf16): the kernel reads each as it is, one launch a call, and
    gives bitwise what the same values in float32 give."""
    from torch.profiler import ProfilerActivity, profile

    op = qla_compiler.compile("gdn")
    args = _args(op, [0, 1, 3, 7])
    low = dict(args, g=args["g"].to(g_dtype), beta=args["beta"].to(beta_dtype))
    same = dict(args, g=low["g"].float(), beta=low["beta"].float())
    op.recurrent(**low)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        o_low, s_low = op.recurrent(**low)
        torch.cuda.synchronize()
    kernels = [e.key for e in prof.key_averages() if e.self_device_time_total > 0]
    assert len(kernels) == 1 and "token_step" in kernels[0], kernels
    o, s = op.recurrent(**same)
    assert torch.equal(o_low, o) and torch.equal(s_low, s)


def test_decode_shaped_chunk_calls_run_the_token_step(monkeypatch):
    """An inference call of the chunk op with ≤ DECODE_TOKENS tokens per sequence on average runs
    op.recurrent (its result bitwise); a long one, or one that needs gradients, runs the chunks."""
    from qla_compiler import op as op_module

    op = qla_compiler.compile("gdn")
    args = _args(op, [0, 1, 2, 5, 6])  # 4 sequences, 6 tokens
    with torch.no_grad():
        o, final = op(**args)
        o_rec, final_rec = op.recurrent(**args)
    assert torch.equal(o, o_rec) and torch.equal(final, final_rec) and final.dtype == torch.float32
    calls = []
    monkeypatch.setattr(op_module.CompiledOp, "recurrent", lambda self, *a, **k: calls.append(1))
    long_args = _args(op, [0, 100, 300])
    with torch.no_grad():
        op(**long_args)
    leaves = {k: (v.requires_grad_() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in args.items()}
    op(**leaves)
    assert calls == []
