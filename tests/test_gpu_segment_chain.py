"""Context parallelism's chain of segment maps on the GPU (kernels/segment_chain.py) against its
torch definition (context_parallel.chain_starts) in float64: head dims 16 to 256, ones no multiple of
the kernel's blocks, K ≠ V, 1 to 8 segments, one and several sequences, both directions, maps that
contract and maps that do not (no decay: M near the identity). Tolerance: the kernel's relative
error against the float64 chain ≤ 1e-5 (float32's unit roundoff is 6e-8; S products of K terms
each); torch's float32 chain's error is reported beside it in the message."""
import pytest
import torch

from qla_compiler.context_parallel import chain_starts
from qla_compiler.kernels import segment_chain
from qla_compiler.testing import rel_err

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _maps(N, segments, HV, K, V, contract, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    noise = torch.randn(N * segments, HV, K, K, device="cuda", generator=gen, dtype=torch.float64) / K ** 0.5
    M = torch.eye(K, device="cuda", dtype=torch.float64) * (0.5 if contract else 1.0) + 0.1 * noise
    H = torch.randn(N * segments, HV, K, V, device="cuda", generator=gen, dtype=torch.float64)
    h0 = torch.randn(N, HV, K, V, device="cuda", generator=gen, dtype=torch.float64)
    return torch.cat([M, H], -1), h0


@needs_gpu
@pytest.mark.parametrize("K,V", [(128, 128), (64, 64), (256, 128), (128, 64), (100, 60), (16, 32)])
def test_segment_chain_kernel_is_chain_starts(K, V):
    for N, segments in ((1, 1), (1, 2), (1, 8), (3, 5)):
        for reverse in (False, True):
            for contract in (True, False):
                maps, h0 = _maps(N, segments, 4, K, V, contract, seed=K + V + segments)
                want = chain_starts(maps, h0, segments, reverse)
                got = segment_chain.chain(maps.float(), h0.float(), segments, reverse)
                torch_f32 = chain_starts(maps.float(), h0.float(), segments, reverse)
                assert got.shape == want.shape and torch.isfinite(got).all()
                err, peer = rel_err(got, want), rel_err(torch_f32, want)
                assert err <= 1e-5, (K, V, N, segments, reverse, contract, err, peer)


@needs_gpu
def test_segment_chain_refuses_what_it_does_not_take():
    maps, h0 = _maps(1, 2, 2, 64, 64, True, seed=0)
    with pytest.raises(TypeError, match="float32"):
        segment_chain.chain(maps, h0, 2, False)
    with pytest.raises(ValueError, match="maps of shape"):
        segment_chain.chain(maps.float(), h0.float(), 3, False)
