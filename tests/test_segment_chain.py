"""Context parallelism's step 2, the chain of segment maps: the torch definition
(context_parallel.chain_starts) against a loop over one sequence and one head at a time in float64,
and the GPU's kernel (kernels/segment_chain.py) through TileLang to CUDA without a GPU.
tests/test_gpu_segment_chain.py holds the kernel to chain_starts on the H200."""
import pytest
import torch

from qla_compiler.context_parallel import chain_starts


def _loop(maps, h0, segments, reverse):
    N, HV, K, V = h0.shape
    out = torch.empty(N * segments, HV, K, V, dtype=maps.dtype)
    for n in range(N):
        for hv in range(HV):
            state = h0[n, hv]
            order = range(segments - 1, -1, -1) if reverse else range(segments)
            for s in order:
                out[n * segments + s, hv] = state
                M, H = maps[n * segments + s, hv, :, :K], maps[n * segments + s, hv, :, K:]
                state = M @ state + H
    return out


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("N,segments", [(1, 1), (1, 8), (3, 3)])
def test_chain_starts_is_the_segment_by_segment_scan(N, segments, reverse):
    """Each segment starts from the state its sequence's earlier segments (later ones, in reverse)
    map h0 to; the first starts from h0 and the last segment's map is not used."""
    gen = torch.Generator().manual_seed(N * 10 + segments)
    HV, K, V = 2, 5, 3
    maps = torch.randn(N * segments, HV, K, K + V, generator=gen, dtype=torch.float64) * 0.5
    h0 = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64)
    got = chain_starts(maps, h0, segments, reverse)
    assert torch.allclose(got, _loop(maps, h0, segments, reverse), rtol=1e-12, atol=1e-12)
    # the last map read is the one before the sequence's last (first, in reverse) segment
    unused = [n * segments + (0 if reverse else segments - 1) for n in range(N)]
    maps[unused] = float("nan")
    assert torch.isfinite(chain_starts(maps, h0, segments, reverse)).all()


@pytest.mark.parametrize("K,V,reverse", [(128, 128, False), (256, 128, True), (100, 60, False), (16, 32, True)])
def test_segment_chain_kernel_lowers_to_cuda(K, V, reverse):
    """The kernel at head dims up to 256 and ones no multiple of its blocks: plain float32 FMAs (no
    tensor cores, which would round the state to tf32), M's blocks between two barriers, and the
    state's update after one more. Up to K = 128 M comes in one block (a block's load is a whole
    global latency before its products; four blocks a segment took ~6.7 µs on the H200)."""
    from qla_compiler.kernels import segment_chain

    src = segment_chain.compiled(K, V, reverse).get_kernel_source()
    assert "wgmma" not in src and "mma" not in src.replace("m_s", "")
    assert src.count("__syncthreads()") >= 4
    assert "(m[0] * ((float*)state_s)[" in src
    assert ("for (int kb = 0; kb < 2; ++kb)" in src) == (K > 128) and ("for (int kb" in src) == (K > 128)
