"""Single generated kernels on the GPU, each against torch on the same inputs: when the whole op
disagrees with the reference, these say which kernel is wrong."""
import pytest
import torch
import torch.nn.functional as F

import qla_compiler
from qla_compiler.kernels.forward import chunk_map
from qla_compiler.kernels.runtime import load_kernels
from qla_compiler.passes.lower_tilelang import ShapeClass
from qla_compiler.testing import rel_err

pytestmark = pytest.mark.gpu
C = 64


def _inputs(lens, H, HV, K, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)
    k = F.normalize(torch.randn(1, T, H, K, device="cuda", generator=gen), dim=-1).to(torch.bfloat16)
    beta = torch.rand(1, T, HV, device="cuda", generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    return k, beta, cu


def _inverse_rows(k, beta, cu, HV):
    """T = (I + StrictLower(diag(β) K Kᵀ))⁻¹ per chunk, in float64, stored per token row."""
    T_tok = k.shape[1]
    H = k.shape[2]
    out = torch.zeros(1, T_tok, HV, C, dtype=torch.float64, device=k.device)
    for n in range(cu.numel() - 1):
        for t0 in range(int(cu[n]), int(cu[n + 1]), C):
            L = min(C, int(cu[n + 1]) - t0)
            for h in range(HV):
                kk = k[0, t0:t0 + L, h // (HV // H)].double()
                A = torch.tril(beta[0, t0:t0 + L, h].double()[:, None] * (kk @ kk.T), -1)
                eye = torch.eye(L, dtype=torch.float64, device=k.device)
                out[0, t0:t0 + L, h, :L] = torch.linalg.solve_triangular(eye + A, eye, upper=False)
    return out


def _chunk_cumsum(g, cu):
    """γ: the chunk-local prefix sum of the gates, per token (float64)."""
    out = torch.zeros_like(g, dtype=torch.float64)
    for n in range(cu.numel() - 1):
        for t0 in range(int(cu[n]), int(cu[n + 1]), C):
            t1 = min(t0 + C, int(cu[n + 1]))
            out[0, t0:t1] = g[0, t0:t1].double().cumsum(0)
    return out


CLASSES = [(2, 8, 128), (2, 2, 128), (1, 2, 64)]


@pytest.mark.parametrize("H, HV, K", CLASSES)
@pytest.mark.parametrize("spec", ["delta_net", "gdn"])
def test_prep_kernel_matches_torch(spec, H, HV, K):
    prog = qla_compiler.compile_spec(spec)
    kernels = load_kernels(prog, ShapeClass(H=H, HV=HV, K=K, V=K, BV=32))
    lens = [1, 200, 77]
    k, beta, cu = _inputs(lens, H, HV, K)
    g = F.logsigmoid(torch.randn(1, k.shape[1], HV, device="cuda") + 3.0)
    prep = prog.kernels.kernels[0]
    args = {"k": k, "beta": beta, "g": g, "chunk_map": chunk_map(cu, k.shape[1], C)}
    for p in prep.params:
        if p.role == "out":
            shape = (1, k.shape[1], HV) + ((C,) if len(p.shape) == 4 else ())
            args[p.name] = torch.full(shape, float("nan"), device="cuda",
                                      dtype=torch.bfloat16 if len(p.shape) == 4 else torch.float32)
    kernels[prep.name](*[args[p.name] for p in prep.params])
    inv = next(p.name for p in prep.params if p.role == "out" and len(p.shape) == 4)
    ref = _inverse_rows(k, beta, cu, HV)
    mask = torch.zeros_like(ref, dtype=torch.bool)
    for n in range(cu.numel() - 1):
        for t0 in range(int(cu[n]), int(cu[n + 1]), C):
            L = min(C, int(cu[n + 1]) - t0)
            mask[0, t0:t0 + L, :, :L] = True
    assert not torch.isnan(args[inv]).any(), "some rows were not written"
    assert rel_err(args[inv].double()[mask], ref[mask]) <= 1e-2
    if "g_cum" in args:
        assert rel_err(args["g_cum"], _chunk_cumsum(g, cu)) <= 1e-5


@pytest.mark.parametrize("H, HV, K", CLASSES)
def test_gdn_scan_with_exact_prep(H, HV, K):
    """The GDN scan kernel alone, fed exact γ and T_r, against the reference."""
    op = qla_compiler.compile("gdn")
    prog = op.program
    kernels = load_kernels(prog, ShapeClass(H=H, HV=HV, K=K, V=K, BV=32))
    lens = [1, 200, 77]
    k, beta, cu = _inputs(lens, H, HV, K)
    gen = torch.Generator(device="cuda").manual_seed(3)
    T_tok = k.shape[1]
    g = F.logsigmoid(torch.randn(1, T_tok, HV, device="cuda", generator=gen) + 3.0)
    q = torch.randn(1, T_tok, H, K, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(1, T_tok, HV, K, device="cuda", generator=gen).to(torch.bfloat16)
    h0 = torch.randn(len(lens), HV, K, K, device="cuda", generator=gen) * 0.5
    scan = prog.kernels.kernels[-1]
    tensors = {"q": q, "k": k, "v": v, "beta": beta, "cu_seqlens": cu, "initial_state": h0,
               "g_cum": _chunk_cumsum(g, cu).float(),
               "T_r": _inverse_rows(k, beta, cu, HV).to(torch.bfloat16),
               "o": torch.empty_like(v), "final_state": torch.empty_like(h0)}
    kernels[scan.name](*[tensors[p.name] for p in scan.params])
    o_ref, s_ref = op.reference(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                initial_state=h0.double(), output_final_state=True, cu_seqlens=cu)
    assert rel_err(tensors["o"], o_ref) <= 1e-2
    assert rel_err(tensors["final_state"], s_ref) <= 1e-2


def test_delta_net_scan_with_exact_inverse():
    """The scan kernel alone: fed the float64 inverse (rounded to bf16), against the reference."""
    op = qla_compiler.compile("delta_net")
    prog = op.program
    H, HV, K = 2, 2, 128
    kernels = load_kernels(prog, ShapeClass(H=H, HV=HV, K=K, V=K, BV=32))
    lens = [1, 200, 77]
    k, beta, cu = _inputs(lens, H, HV, K)
    gen = torch.Generator(device="cuda").manual_seed(3)
    T_tok = k.shape[1]
    q = torch.randn(1, T_tok, H, K, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(1, T_tok, HV, K, device="cuda", generator=gen).to(torch.bfloat16)
    h0 = torch.randn(len(lens), HV, K, K, device="cuda", generator=gen) * 0.5
    scan = prog.kernels.kernels[-1]
    tensors = {"q": q, "k": k, "v": v, "beta": beta, "cu_seqlens": cu, "initial_state": h0,
               "T": _inverse_rows(k, beta, cu, HV).to(torch.bfloat16),
               "o": torch.empty_like(v), "final_state": torch.empty_like(h0)}
    kernels[scan.name](*[tensors[p.name] for p in scan.params])
    o_ref, s_ref = op.reference(q.double(), k.double(), v.double(), beta.double(), initial_state=h0.double(),
                                output_final_state=True, cu_seqlens=cu)
    assert rel_err(tensors["o"], o_ref) <= 1e-2
    assert rel_err(tensors["final_state"], s_ref) <= 1e-2
