"""The triangular inverse's numerics (kernels/tri_inverse.py), on the worst keys the delta rule
meets: the kernel's algorithm replayed step by step in torch, its tensor-core products rounded to
tf32 as the H200 rounds them, against a float64 solve.

The bound the method rests on (kernels/tri_inverse.py): for unit-norm keys and β ∈ [0, 1] every
entry of T = (I + StrictLower(diag(β) K Kᵀ))⁻¹, and of every partial sum and product the method
forms, is at most 1 in size, whatever the keys. Neumann doubling's powers of A are not bounded
(≈ 1e17 for a repeated key), which is why it was replaced.
"""
import pytest
import torch
import torch.nn.functional as F

C, BLOCK = 64, 16


def tf32(x):
    """Round float32 to tf32 (10 mantissa bits, round to nearest even), as wgmma reads its operands."""
    b = x.float().contiguous().view(torch.int32)
    b = (b + 0x0FFF + ((b >> 13) & 1)) & ~0x1FFF
    return b.view(torch.float32)


def blocked_inverse(A, trace=None):
    """The macro's steps: column sweeps on the 16-blocks in float32, then D − D·L·D merges with
    tf32 products accumulated in float32. `trace` collects every intermediate."""
    A = A.float().clone()
    i = torch.arange(C)
    D = torch.zeros(C, BLOCK)
    D[i, i % BLOCK] = 1.0
    for j in range(BLOCK - 1):
        rows = i % BLOCK > j
        src = i - i % BLOCK + j
        D[rows] -= A[i, src][rows, None] * D[src][rows]
        if trace is not None:
            trace.append(D.clone())
    r, c = i[:, None], i[None, :]
    for w in (16, 32):
        same = (r // BLOCK == c // BLOCK)
        diag = torch.where(same, D[r, c % BLOCK], torch.where((c < r) & (r // w == c // w), A, 0.0))
        coupled = ((r // w) % 2 == 1) & (c // w == r // w - 1)
        L = torch.where(coupled, A, 0.0)
        P = tf32(L) @ tf32(diag)
        P = tf32(diag) @ tf32(P)
        if trace is not None:
            trace += [L @ diag, P]
        A = torch.where(coupled, -P, A)
    same = (r // BLOCK == c // BLOCK)
    return torch.where(same, D[r, c % BLOCK], torch.where(c < r, A, 0.0))


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
    # tf32's unit roundoff is 2^-11 ≈ 4.9e-4; T is stored in bf16 (2^-9) after this anyway
    assert err < 2e-3, err
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
