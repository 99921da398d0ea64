"""The GDN op on the CPU against a plain PyTorch loop written here, independent of the spec machinery."""
import torch

from qla_compiler.ops import chunk_gated_delta_rule
from qla_compiler.testing import rel_err


def gdn_loop(q, k, v, g, beta, scale, h0, cu_seqlens):
    """S_t = e^{g_t}(I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,  o_t = scale · S_tᵀ q_t, per sequence."""
    T, H = q.shape[1], q.shape[2]
    HV = v.shape[2]
    o = torch.zeros_like(v)
    finals = []
    for n in range(len(cu_seqlens) - 1):
        S = h0[n].clone()  # [HV, K, V]
        for t in range(int(cu_seqlens[n]), int(cu_seqlens[n + 1])):
            for h in range(HV):
                kt, qt = k[0, t, h // (HV // H)], q[0, t, h // (HV // H)]
                S[h] = torch.exp(g[0, t, h]) * (S[h] - beta[0, t, h] * torch.outer(kt, kt @ S[h]))
                S[h] = S[h] + beta[0, t, h] * torch.outer(kt, v[0, t, h])
                o[0, t, h] = scale * (S[h].T @ qt)
        finals.append(S)
    return o, torch.stack(finals)


def test_gdn_op_matches_plain_loop():
    gen = torch.Generator().manual_seed(0)
    T, H, HV, K, V = 160, 2, 4, 8, 4
    cu = torch.tensor([0, 1, 70, 71, 160])
    q = torch.randn(1, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, HV, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, T, HV, generator=gen, dtype=torch.float64) * 2
    g[0, 100:120] = -16.0  # strong decay
    g[0, 120:130] = 0.0
    beta = torch.rand(1, T, HV, generator=gen, dtype=torch.float64)
    h0 = torch.randn(4, HV, K, V, generator=gen, dtype=torch.float64)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=h0,
                                      output_final_state=True, cu_seqlens=cu)
    o_ref, final_ref = gdn_loop(q, k, v, g, beta, 0.3, h0, cu)
    assert final.dtype == torch.float64
    assert rel_err(o, o_ref) <= 1e-10
    assert rel_err(final, final_ref) <= 1e-10
