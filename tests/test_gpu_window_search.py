"""Context parallelism's window search on the GPU (kernels/window_search.py) against its torch
definition (context_parallel.window_skips of contraction_logs), the skips of every (segment, value
head) equal: every decay kind the kernels take (a per-key gate's by its slowest key), with and
without the delta factor, both walk directions, 2 to 8 segments, on packings with 1-token
sequences and lengths no multiple of the chunk, value heads that decay hard, mildly and not at all,
resets (g = −inf), and keys of norm up to 2 with β up to 3 (where the delta factor expands: λ's
second term)."""
import pytest
import torch

import qla_compiler
from qla_compiler.context_parallel import contraction_logs, segment_layout, window_skips
from qla_compiler.kernels import window_search
from qla_compiler.testing import random_inputs

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

LENS = [1, 700, 130, 64, 2000, 7]


def _inputs(op, seed):
    H, HV, K = 2, 8, 128
    cu = [0]
    for n in LENS:
        cu.append(cu[-1] + n)
    T = cu[-1]
    args = random_inputs(op, T=T, H=H, HV=HV, K=K, V=16, cu_seqlens=cu, dtype=torch.bfloat16, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    st = op.program.recurrence.structure
    if st.decay == "gate":  # per value head: hard, mild, none, and random between
        g = torch.stack([torch.full((T,), -1.5), torch.full((T,), -0.02), torch.zeros(T)]
                        + [-0.3 * torch.rand(T, generator=gen) for _ in range(HV - 3)], -1)
        g[torch.randint(0, T, (5,), generator=gen), 2] = -torch.inf  # resets in the head that never decays
        args[st.decay_name] = g[None].float()
    if st.decay == "key_gate":  # per key: the same heads in half the keys, the other half at −5
        g = torch.stack([torch.full((T,), -1.5), torch.full((T,), -0.02), torch.zeros(T)]
                        + [-0.3 * torch.rand(T, generator=gen) for _ in range(HV - 3)], -1)
        g = g[:, :, None].repeat(1, 1, K)
        g[:, :, : K // 2] = -5.0
        g[torch.randint(0, T, (5,), generator=gen), 2] = -torch.inf  # resets in the head that never decays
        args[st.decay_name] = g[None].float()
    if st.delta:  # keys of norm up to 2 and β up to 3 on some tokens: |1 − β‖k‖²| > 1 there
        k = args[st.write_key].float()
        grow = torch.where(torch.rand(T, generator=gen) < 0.1, 2.0, 1.0)
        args[st.write_key] = (k * grow[None, :, None, None]).to(torch.bfloat16)
        beta = args["beta"].float()
        args["beta"] = torch.where(torch.rand(beta.shape, generator=gen) < 0.1, 3.0, beta)
    inputs = {n: (x.cuda() if torch.is_tensor(x) else x) for n, x in args.items() if n in op.input_names}
    return inputs, torch.tensor(cu, device="cuda", dtype=torch.int32), T, HV


@needs_gpu
@pytest.mark.parametrize("spec", ["gdn", "delta_net", "simple_gla", "retnet", "kda", "gla"])
def test_window_search_kernel_is_window_skips(spec):
    op = qla_compiler.compile(spec, target="sm90")
    rec = op.program.recurrence
    for seed in range(2):
        inputs, cu, T, HV = _inputs(op, seed)
        search = window_search.searcher(rec, inputs, HV, 64)
        lam = contraction_logs(rec, inputs, HV)
        for segments in (2, 3, 5, 8):
            layout = segment_layout(cu, segments, 64, T)
            for reverse in (False, True):
                got, want = search(layout, reverse), window_skips(lam, layout, reverse)
                assert torch.equal(got, want), (spec, seed, segments, reverse, (got != want).nonzero()[:5].tolist())
