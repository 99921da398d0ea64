"""Context parallelism across ranks (qla_compiler/distributed.py) on the CPU: 2 and 4 processes on
gloo, the interpreter backend, float64. Each rank holds its slice of one packed batch whose
sequences cross rank boundaries (one spans three ranks), lie wholly inside one, have one token or
none; with an initial state and the final state. Its o and gradients are the slice of what one
process computes for the whole batch, the final states and the initial state's gradient (summed
over ranks) the whole batch's, to 1e-10."""
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qla_compiler
from qla_compiler.testing import random_inputs, rel_err

LENS = [1, 150, 0, 40, 193]  # 384 tokens: 2 ranks of 192, or 4 of 96
NAMES = ("q", "k", "v", "g", "beta")


def _batch():
    op = qla_compiler.compile("gdn")
    cu = [0]
    for n in LENS:
        cu.append(cu[-1] + n)
    a = random_inputs(op, T=cu[-1], H=1, HV=2, K=16, V=16, cu_seqlens=cu, initial_state=True,
                      dtype=torch.float64, seed=5)
    gen = torch.Generator().manual_seed(7)
    w_o = torch.randn(a["v"].shape, generator=gen, dtype=torch.float64)
    w_s = torch.randn(a["initial_state"].shape, generator=gen, dtype=torch.float64)
    return op, a, w_o, w_s


def _step(op, xs, h0, w_o, w_s, **call):
    leaves = {n: x.detach().clone().requires_grad_() for n, x in xs.items()}
    h0 = h0.detach().clone().requires_grad_()
    o, final = op(**leaves, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, **call)
    loss = (o * w_o).sum() + (final * w_s).sum()
    loss.backward()
    return o.detach(), final.detach(), {n: x.grad for n, x in leaves.items()}, h0.grad


def _worker(rank, world, init, out):
    # (a hang becomes a failure in minutes, not gloo's default half hour)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        from qla_compiler.distributed import build_cp_context

        op, a, w_o, w_s = _batch()
        ctx = build_cp_context(a["cu_seqlens"])
        part = {n: a[n][:, ctx.start:ctx.end] for n in NAMES}
        # the final state's term once (rank 0): every rank holds the same, all-reduced final states
        o, final, grads, d_h0 = _step(op, part, a["initial_state"], w_o[:, ctx.start:ctx.end],
                                      w_s if rank == 0 else torch.zeros_like(w_s), cp_context=ctx)
        torch.save(dict(o=o, final=final, grads=grads, d_h0=d_h0, start=ctx.start, end=ctx.end),
                   os.path.join(out, f"{rank}.pt"))
        # every rank done with its collectives before any tears gloo down: in one CI run (session
        # 27, 4 ranks on 2 cores) a rank aborted in teardown, "terminate called without an active
        # exception"
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_give_the_single_process_result(world, tmp_path):
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_worker, args=(world, init, str(tmp_path)), nprocs=world, join=True)
    op, a, w_o, w_s = _batch()
    o, final, grads, d_h0 = _step(op, {n: a[n] for n in NAMES}, a["initial_state"], w_o, w_s,
                                  cu_seqlens=a["cu_seqlens"])
    d_h0_sum = torch.zeros_like(d_h0)
    for r in range(world):
        got = torch.load(tmp_path / f"{r}.pt")
        s, e = got["start"], got["end"]
        assert rel_err(got["o"], o[:, s:e]) <= 1e-10, r
        assert rel_err(got["final"], final) <= 1e-10, r
        for n in NAMES:
            assert rel_err(got["grads"][n], grads[n][:, s:e]) <= 1e-10, (r, n)
        d_h0_sum += got["d_h0"]
    assert rel_err(d_h0_sum, d_h0) <= 1e-10


def test_cp_context_needs_a_process_group_and_an_even_split(tmp_path):
    from qla_compiler.distributed import build_cp_context

    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        build_cp_context(torch.tensor([0, 10]))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ctx = build_cp_context(torch.tensor([0, 3, 10]))
        assert (ctx.start, ctx.end, ctx.pieces, ctx.continues, ctx.carries_on) == (0, 10, (0, 1), False, False)
        op, a, _, _ = _batch()
        with pytest.raises(ValueError, match="leave cu_seqlens None and context_parallel at its default"):
            op(*[a[n][:, :10] for n in NAMES], cu_seqlens=a["cu_seqlens"], cp_context=ctx)
        with pytest.raises(ValueError, match=r"initial_state: expected the global batch's \[2, 2, 16, 16\]"):
            op(*[a[n][:, :10] for n in NAMES], initial_state=a["initial_state"], cp_context=ctx)
    finally:
        dist.destroy_process_group()
