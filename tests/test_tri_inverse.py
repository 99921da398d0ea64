"""The triangular inverse's numerics (kernels/tri_inverse.py), on the worst keys the delta rule
meets: the kernel's algorithm replayed step by step in torch, in float32 (the last merge in tf32) as
the kernel runs it, against a float64 solve.

The bound the method rests on (kernels/tri_inverse.py): for unit-norm keys and β ∈ [0, 1] every
entry of T = (I + StrictLower(diag(β) K Kᵀ))⁻¹, and of every partial sum and product the method
forms, is at most 1 in size, whatever the keys. Neumann doubling's powers of A are not bounded
(≈ 1e17 for a repeated key), which is why it was replaced.
"""
import pytest
import torch
import torch.nn.functional as F

from qla_compiler.ir import kernel_interp
from qla_compiler.ir.kernel_interp import _tf32 as tf32_staged  # as the merge stages its operands
from qla_compiler.ir.kernel_interp import _unit_lower_inverse

C, BLOCK = 64, 16


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
