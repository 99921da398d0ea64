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


@pytest.mark.parametrize("spec", ["delta_net", "gdn"])
def test_solve_kernel_matches_torch_inverse(spec):
    prog = qla_compiler.compile_spec(spec)
    H, HV, K = 2, 2, 128
    kernels = load_kernels(prog, ShapeClass(H=H, HV=HV, K=K, V=K, BV=32))
    k, beta, cu = _inputs([1, 200, 77], H, HV, K)
    out = torch.full((1, k.shape[1], HV, C), float("nan"), device="cuda", dtype=torch.bfloat16)
    solve = prog.kernels.kernels[0]  # the prep kernel
    args = {"k": k, "beta": beta, "chunk_map": chunk_map(cu, k.shape[1], C)}
    args[solve.params[-1].name] = out
    kernels[solve.name](*[args[p.name] for p in solve.params])
    ref = _inverse_rows(k, beta, cu, HV)
    mask = torch.zeros_like(ref, dtype=torch.bool)
    for n in range(cu.numel() - 1):
        for t0 in range(int(cu[n]), int(cu[n + 1]), C):
            L = min(C, int(cu[n + 1]) - t0)
            mask[0, t0:t0 + L, :, :L] = True
    assert not torch.isnan(out).any(), "some rows were not written"
    assert rel_err(out.double()[mask], ref[mask]) <= 1e-2


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
