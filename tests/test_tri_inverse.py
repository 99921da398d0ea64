"""The triangular inverse's numerics (kernels/tri_inverse.py), on the worst keys the delta rule
meets: the kernel's algorithm replayed step by step in torch, in float32 (the last merge in tf32) as
the kernel runs it, against a float64 solve.

The bound the method rests on (kernels/tri_inverse.py): for unit-norm keys and β ∈ [0, 1] every
entry of T = (I + StrictLower(diag(β) K Kᵀ))⁻¹, and of every partial sum and product the method
forms, is at most 1 in size, whatever the keys. Neumann doubling's powers of A are not bounded
(≈ 1e17 for a repeated key), which is why it was replaced.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qla_compiler.ir import kernel_interp
from qla_compiler.ir.kernel_interp import _tf32 as tf32_staged  # as the merge stages its operands
from qla_compiler.ir.kernel_interp import _unit_lower_inverse

C, BLOCK = 64, 16
PAIR = 2 * BLOCK


def tf32(x):
    """Round float32 to tf32 (10 mantissa bits, round to nearest even), as wgmma reads its operands."""
    b = x.float().contiguous().view(torch.int32)
    b = (b + 0x0FFF + ((b >> 13) & 1)) & ~0x1FFF
    return b.view(torch.float32)


def blocked_inverse(A, trace=None, tf32_last_merge=True):
    """The macro's steps in float32: column sweeps on the 16-blocks, then the merges
    T₂₁ = −T₂₂ (A₂₁ T₁₁) of the pairs of 16-blocks and of the two 32-blocks, the last merge's
    operands read as tf32 (its products on the tensor cores). `trace` collects every
    intermediate."""
    A = A.float()
    i = torch.arange(C)
    D = torch.zeros(C, BLOCK)
    D[i, i % BLOCK] = 1.0
    for j in range(BLOCK - 1):
        rows = i % BLOCK > j
        src = i - i % BLOCK + j
        D[rows] -= A[i, src][rows, None] * D[src][rows]
        if trace is not None:
            trace.append(D.clone())
    Tm = torch.zeros(C, C)
    for b in range(0, C, BLOCK):
        Tm[b:b + BLOCK, b:b + BLOCK] = D[b:b + BLOCK]
    for w in (BLOCK, 2 * BLOCK):
        r = tf32_staged if tf32_last_merge and w == 2 * BLOCK else (lambda x: x)
        for b0 in range(0, C, 2 * w):
            b1 = b0 + w
            P = r(A[b1:b1 + w, b0:b1]) @ r(Tm[b0:b1, b0:b1])
            Tm[b1:b1 + w, b0:b1] = -(r(Tm[b1:b1 + w, b1:b1 + w]) @ r(P))
            if trace is not None:
                trace += [P.clone(), Tm[b1:b1 + w, b0:b1].clone()]
    return Tm


def neumann_inverse(A):
    """(I − A)(I + A²)(I + A⁴)…, tf32 products: what the kernels used before."""
    eye = torch.eye(C)
    X, P = eye - A, A.float()
    for _ in range(5):
        P = tf32(P) @ tf32(P)
        X = X + tf32(X) @ tf32(P)
    return X


def delta_rule_A(keys, beta):
    k = F.normalize(keys.double(), dim=-1)
    return torch.tril(beta[:, None] * (k @ k.T), -1)


def keys_of(kind, gen):
    K = 128
    if kind == "randn":
        return torch.randn(C, K, generator=gen, dtype=torch.float64)
    if kind == "uniform":  # FLA's tests: every pair of keys has cosine ≈ 0.75
        return torch.rand(C, K, generator=gen, dtype=torch.float64)
    if kind == "identical":  # a repeated token
        return torch.randn(1, K, generator=gen, dtype=torch.float64).expand(C, K)
    if kind == "near_identical":
        return torch.randn(1, K, generator=gen, dtype=torch.float64) + 1e-3 * torch.randn(C, K, generator=gen,
                                                                                          dtype=torch.float64)
    if kind == "two_alternating":  # padding tokens between real ones
        two = torch.randn(2, K, generator=gen, dtype=torch.float64)
        return two[torch.arange(C) % 2]
    raise ValueError(kind)


KINDS = ["randn", "uniform", "identical", "near_identical", "two_alternating"]


@pytest.mark.parametrize("beta_kind", ["one", "uniform", "near_zero"])
@pytest.mark.parametrize("kind", KINDS)
def test_blocked_inverse_is_accurate_on_worst_keys(kind, beta_kind):
    gen = torch.Generator().manual_seed(KINDS.index(kind))
    beta = {"one": torch.ones(C, dtype=torch.float64),
            "uniform": torch.rand(C, generator=gen, dtype=torch.float64),
            "near_zero": 1e-3 * torch.rand(C, generator=gen, dtype=torch.float64)}[beta_kind]
    A = delta_rule_A(keys_of(kind, gen), beta)
    ref = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A)
    trace = []
    got = blocked_inverse(A.float(), trace).double()
    err = ((got - ref).norm() / ref.norm()).item()
    # the last merge rounds its operands (≤ 1) to tf32, 2^-11 relative each: worst here 7e-4 (U[0, 1)
    # keys, β = 1), under the 2^-9 that storing T in bf16 rounds by
    assert err < 1.5e-3, err
    # all in float32: a few units of 2^-24 per sum of ≤ 64 terms of size ≤ 1
    exact = blocked_inverse(A.float(), tf32_last_merge=False).double()
    assert ((exact - ref).norm() / ref.norm()).item() < 1e-6
    # every intermediate is bounded by 1 (plus rounding): the premise of the error bound
    assert max(t.abs().max().item() for t in trace) <= 1 + 1e-3
    assert ref.abs().max().item() <= 1 + 1e-12


def test_neumann_doubling_fails_where_the_blocked_inverse_does_not():
    """The failure that motivated the method, as a regression guard on the test itself: on a repeated
    key Neumann doubling's error is astronomically large, the blocked inverse's tiny."""
    gen = torch.Generator().manual_seed(0)
    A = delta_rule_A(keys_of("identical", gen), torch.ones(C, dtype=torch.float64))
    ref = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A)

    def rel(x):
        return ((x.double() - ref).norm() / ref.norm()).item()
    assert rel(neumann_inverse(A.float())) > 1e3
    assert rel(blocked_inverse(A.float())) < 1e-5


def test_the_interpreter_models_the_kernels_inverse():
    """With rounding on, the KernelIR interpreter inverts as the kernel does (its merges of 32-blocks
    with tf32 operands, the inverse statement's field), so the CPU's emulated kernels carry the
    kernel's error: equal to this file's replay, and off the exact inverse by what tf32 costs."""
    gen = torch.Generator().manual_seed(3)
    A = torch.stack([delta_rule_A(keys_of("uniform", gen), torch.ones(C, dtype=torch.float64)) for _ in range(3)])
    ref = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A)
    model = _unit_lower_inverse(A, tf32_from=2 * BLOCK)
    replay = torch.stack([blocked_inverse(a.float()).double() for a in A])

    def rel(x):
        return ((x - ref).norm() / ref.norm()).item()
    assert rel(replay) > 1e-4 and abs(rel(model) - rel(replay)) < 0.2 * rel(replay)
    assert rel(_unit_lower_inverse(A, tf32_from=C)) < 1e-12  # no tf32 merge: exact


def test_the_kernel_ir_says_the_inverse_precision_and_the_lowering_holds_it_to_the_block():
    """The inverse statement's tf32_from is a field the KernelIR prints; the lowering has one
    building block and refuses a statement asking for another precision."""
    import dataclasses

    import qla_compiler
    from qla_compiler.errors import PassError
    from qla_compiler.passes.lower_tilelang import ShapeClass, lower

    kir = qla_compiler.compile_spec("gdn").kernels
    assert ("T_r = inverse A_r_s   (16-blocks by substitution in float32, merges of 32-blocks in tf32; "
            "built in A_r_s's place, which it overwrites)") in str(kir)
    prep = kir.kernels[0]
    body = [dataclasses.replace(s, attrs=(("tf32_from", 64),)) if s.op == "inverse" else s for s in prep.body]
    other = dataclasses.replace(kir, kernels=[dataclasses.replace(prep, body=body)] + kir.kernels[1:])
    with pytest.raises(PassError, match="merges are tf32 from 32-blocks, not 64"):
        lower(other, ShapeClass(H=2, HV=8, K=128, V=128))
    # the substitution runs a warp a block, handed the kernel's warps: a partial warp is refused
    src = lower(kir, ShapeClass(H=2, HV=8, K=128, V=128))
    assert f"T_r_M_s, C, {prep.threads // 32})" in src
    partial = dataclasses.replace(kir, kernels=[dataclasses.replace(prep, threads=80)] + kir.kernels[1:])
    with pytest.raises(PassError, match="one warp a block, in a kernel of whole warps, not 80 threads"):
        lower(partial, ShapeClass(H=2, HV=8, K=128, V=128))


def test_the_merge_rounds_its_tf32_operands(monkeypatch):
    """mma.sync reads a float32 operand as tf32 by dropping its low 13 bits: every operand pulled
    toward zero, an error of one sign that adds up over the chunks of a sequence where nothing
    decays (g = 0: on U[0, 1) keys it made d β's error 10 % larger through the emulated kernels,
    and failed the H200's real-data test). The merge rounds each operand to nearest as it stages
    it: per block the error is the same size, but summed over many chunks' blocks it mostly
    cancels."""
    gen = torch.Generator().manual_seed(5)
    A = torch.stack([delta_rule_A(keys_of("uniform", gen), torch.ones(C, dtype=torch.float64)) for _ in range(64)])
    ref = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A)
    rounded = _unit_lower_inverse(A, tf32_from=2 * BLOCK)
    monkeypatch.setattr(kernel_interp, "_tf32",
                        lambda x: (x.float().contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32).to(x.dtype))
    truncated = _unit_lower_inverse(A, tf32_from=2 * BLOCK)

    def summed_error(x):
        return ((x - ref).sum(0).norm() / ref.sum(0).norm()).item()
    assert summed_error(rounded) < 0.6 * summed_error(truncated)


_PREP_CUDA = """
import dataclasses, sys
import qla_compiler
from qla_compiler.kernels.runtime import lower_to_cuda
from qla_compiler.passes.lower_tilelang import ShapeClass
p = qla_compiler.compile_spec("gdn")
prep = p.kernels.kernels[0]
p = dataclasses.replace(p, kernels=dataclasses.replace(p.kernels, kernels=[prep]))
sys.stdout.write(lower_to_cuda(p, ShapeClass(H=2, HV=8, K=128, V=128))[prep.name])
"""

# what the generated section needs, for 128 threads on the CPU: a barrier for __syncthreads, a
# warp's exchange (two barriers) for __shfl_sync, float4 as a 16-byte struct
_HARNESS = r"""
#include <barrier>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>
typedef unsigned int uint;
typedef unsigned char uchar;
struct alignas(16) float4 { float x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
thread_local struct { int x; } threadIdx;
alignas(1024) static uchar buf_dyn_shmem[65536];
static std::barrier<> *block, *warp[4];
static float lanes[4][32];
static void __syncthreads() { block->arrive_and_wait(); }
static float __shfl_sync(uint, float v, int src, int) {
  int w = threadIdx.x / 32;
  warp[w]->arrive_and_wait(); lanes[w][threadIdx.x % 32] = v; warp[w]->arrive_and_wait();
  return lanes[w][src % 32];
}
POINTERS
static void run(int tx) {
  threadIdx.x = tx;
LOCALS
SECTION
}
int main(int, char **argv) {
  memset(buf_dyn_shmem, 0xA5, sizeof buf_dyn_shmem);
  FILE *f = fopen(argv[1], "rb");
  if (fread(A_r_s, 4, 64 * 68, f) != 64 * 68) return 1;
  fclose(f);
  std::barrier<> b(128), w0(32), w1(32), w2(32), w3(32);
  block = &b; warp[0] = &w0; warp[1] = &w1; warp[2] = &w2; warp[3] = &w3;
  std::vector<std::thread> threads;
  for (int t = 0; t < 128; ++t) threads.emplace_back(run, t);
  for (auto &t : threads) t.join();
  f = fopen(argv[2], "wb");
  fwrite(A_r_s, 4, 64 * 68, f);
  for (void *s : {T_r_A21_s, T_r_T11_s, T_r_T22_s}) fwrite(s, 4, 32 * 32, f);
  fclose(f);
}
"""


def _emulate_inverse(cuda: str, A_s: torch.Tensor, tmp_path, name: str) -> torch.Tensor:
    """Runs a prep kernel's generated CUDA on the CPU, from the substitution to the staged operands
    of the last merge, on the input block A_s (64×68): A_s after the merges of 16-blocks, then the
    staged A₂₁, T₁₁, T₂₂, as float32 bits (int32)."""
    lines = cuda.split("\n")
    first = next(i for i, ln in enumerate(lines) if re.match(r"\s+d\[\w+\] = condval", ln))
    start = max(i for i in range(first) if lines[i].strip() == "#pragma unroll")
    end = next(i for i in range(first, len(lines)) if "float A_local[4];" in lines[i]) - 1  # the gemm's block
    assert lines[end].strip() == "{", lines[end]
    section = "\n".join(lines[start:end])
    assert "tl::" not in section and "T_r_D_s" in section and "T_r_A21_s" in section
    pointers = [ln for ln in lines if re.match(r"\s+void\* \w+ = \(\(void\*\)\(\(char\*\)buf_dyn_shmem", ln)]
    local_arrays = [ln for ln in lines[:start] if re.match(r"\s+float \w+\[\d+\];$", ln)]
    src = (_HARNESS.replace("SECTION", section).replace("POINTERS", "\n".join(pointers))
           .replace("LOCALS", "\n".join(local_arrays)))
    (tmp_path / f"{name}.cpp").write_text(src)
    subprocess.run(["g++", "-std=c++20", "-O1", "-w", "-ffp-contract=off", "-fno-strict-aliasing", "-pthread",
                    str(tmp_path / f"{name}.cpp"), "-o", str(tmp_path / name)], check=True)
    (tmp_path / "A.bin").write_bytes(A_s.float().contiguous().numpy().tobytes())
    subprocess.run([str(tmp_path / name), str(tmp_path / "A.bin"), str(tmp_path / f"{name}.out")], check=True)
    return torch.frombuffer(bytearray((tmp_path / f"{name}.out").read_bytes()), dtype=torch.int32)


def _prep_cuda_both_ways(switch: str) -> dict:
    """The GDN prep's CUDA with the environment switch `switch` at "0" and at "1"."""
    root = Path(__file__).resolve().parents[1]
    return {on: subprocess.run([sys.executable, "-c", _PREP_CUDA], capture_output=True, text=True, check=True,
                               cwd=root, env={**os.environ, switch: on}).stdout for on in ("0", "1")}


def _assert_same_bits(cuda: dict, A: torch.Tensor, gen, tmp_path, name: str) -> None:
    """Both CUDA sources, replayed on A (with A's zeros above the diagonal, then garbage on and
    above it, drawn from `gen`), leave the same bits in A_s and the staged operands, and did
    invert: the 32-blocks of T within 1e-5 of a float64 solve."""
    ref = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A.double())
    for above in (torch.zeros(C, C), torch.randn(C, C, generator=gen)):
        A_s = torch.full((C, C + 4), 12345.0)  # the row padding: never read
        A_s[:, :C] = A + torch.triu(above)
        bits = {on: _emulate_inverse(cuda[on], A_s, tmp_path, f"{name}{on}") for on in ("0", "1")}
        assert torch.equal(bits["0"], bits["1"])
        T_s = bits["1"][:C * (C + 4)].view(torch.float32).view(C, C + 4)
        for h in (slice(0, PAIR), slice(PAIR, C)):
            assert (torch.tril(T_s[h, h]).double() - ref[h, h]).abs().max() < 1e-5


@pytest.mark.skipif(shutil.which("g++") is None, reason="runs the generated CUDA on the CPU with g++")
def test_the_padded_scratch_leaves_the_inverse_bit_for_bit(tmp_path):
    """QLA_PREP_PAD=1 pads D_s's rows and stores into D_s, A_s and the last merge's operands 4 floats
    at a time: layouts and vector widths, the same float32 operations. The GDN prep's CUDA, lowered
    both ways, run on the CPU (a thread a CUDA thread) from the substitution to the staged tf32
    operands, leaves the same bits in A_s and the operands — on A's zeros above the diagonal, as the
    kernel stores them, and on garbage on and above it, which every read of it masks. Past the
    staging the two are the same code. The vector stores are checked to be there: TileLang lowers a T.vectorized
    loop it finds no plan for to scalar stores with only a warning."""
    cuda = _prep_cuda_both_ways("QLA_PREP_PAD")
    for b in ("T_r_D_s", "A_r_s", "T_r_A21_s", "T_r_T11_s", "T_r_T22_s"):  # the macro's 128-bit stores
        store = rf"^ *\*\(float4\*\)\(\(\(float\*\){b}\) \+ .* = \*\(float4\*\)\((d|x) \+"
        assert not re.search(store, cuda["0"], re.M) and re.search(store, cuda["1"], re.M), b
    assert re.search(r"\(\(float\*\)T_r_D_s\)\[.*\* 20\)", cuda["1"])  # a column read, rows 20 floats apart
    gen = torch.Generator().manual_seed(7)
    A = delta_rule_A(keys_of("uniform", gen), torch.rand(C, generator=gen, dtype=torch.float64)).float()
    _assert_same_bits(cuda, A, gen, tmp_path, "pad")


@pytest.mark.skipif(shutil.which("g++") is None, reason="runs the generated CUDA on the CPU with g++")
def test_the_column_lanes_leave_the_inverse_bit_for_bit(tmp_path):
    """QLA_PREP_COLUMNS=1 deals each 16-block's sweeps to lanes by columns (one shuffle a step, A's
    entries read 4 at a time): the same float32 operations on each element in the same order, so
    the GDN prep's CUDA, run on the CPU from the substitution to the staged operands, leaves the
    same bits as the row lanes' on A's zeros above the diagonal and on garbage there. The columns'
    code is checked to be what ran: one shuffle a step, 128-bit loads of A."""
    cuda = _prep_cuda_both_ways("QLA_PREP_COLUMNS")
    shuffles = {on: len(re.findall(r"__shfl_sync\(.*\bd\[", cuda[on])) for on in cuda}
    assert shuffles == {"0": 1, "1": 1}  # one call in a loop each: over 8 values a step, or once a step
    assert re.search(r"for \(int c_\d+ = 0; c_\d+ < 8; \+\+c_\d+\) \{\n.*__shfl_sync", cuda["0"])  # 8 a step
    assert re.search(r"\*\(float4\*\)\(a \+ .*\) = \*\(float4\*\)\(\(\(float\*\)A_r_s\)", cuda["1"])
    gen = torch.Generator().manual_seed(11)
    for keys in ("uniform", "identical"):
        A = delta_rule_A(keys_of(keys, gen), torch.rand(C, generator=gen, dtype=torch.float64)).float()
        _assert_same_bits(cuda, A, gen, tmp_path, f"columns_{keys}")
