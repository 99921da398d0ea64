"""GDN on real data on the sm90 kernels (issue 15): keys far from random and edge values of the
gates and β, where an algorithm that is exact in algebra can still fail in floating point
(shared/design/MATH.md: Neumann doubling on correlated keys).

The data: one key repeated for every token; one token's key repeated inside each chunk of
otherwise random keys; keys drawn from U[0, 1) and l2-normalised, as FLA's tests draw them (also
normalised in the kernel, use_qk_l2norm_in_kernel); β = 1; g = 0 over 1000 tokens; g = −inf at a
few tokens (a reset: at a chunk's first, middle and last token, a sequence's first token, a
1-token sequence); the gates, β and the initial state in the io dtype (as FLA's varlen tests pass
them). Each in bf16 and in fp16 at K = V = 128; then, in bf16 on U[0, 1) keys, the head dims
K = V ∈ {64, 100, 128, 256} and K ≠ V (128/64, 64/128, 100/60). Every case packs sequences of 1
token and of lengths that are no multiple of 64 (or a dense batch, B = 2) and starts from an
initial state.

Each case runs, on the same inputs and with the same random cotangents of o and of the final
state: the op without grad (the inference kernels) and with grad (the training forward's kernels,
then the backward's), FLA's chunk_gated_delta_rule, and the spec's recurrence in float64 through
torch autograd (op.reference, as in test_gpu_backward.py). Measured for o, the final state (both
runs of the op) and the gradient of every input (q, k, v, g, beta, initial_state): the relative
error ‖out − ref‖ / ‖ref‖ against the float64 reference (qla_compiler.testing.rel_err).

Tolerances:
- against the reference: every value finite; relative error ≤ 1e-2 for o and the final state and
  ≤ 2e-2 for every gradient (the tolerances of test_gpu_forward.py and test_gpu_backward.py),
  unless FLA's own error on the same inputs is above that (then only the bound below applies);
- against FLA, measured in the same run on the same inputs: no more than 1.1× FLA's error, + 1e-4
  in bf16 and + 1.25e-5 in fp16 (the same share of each dtype's rounding floor, 2⁻⁸ against
  2⁻¹¹), so that two errors at the rounding floor compare as equal;
- where FLA's own result is not finite, only the reference's tolerance applies to that quantity.
  Expected at g = −inf (FLA's chunk-local gate differences become −inf − (−inf) = NaN there);
  anywhere else it is also reported as a warning.

The cases with gradients run DRAWS draws of the case's inputs and cotangents (the same kind of
data, another seed) and hold the mean error over the draws to these bounds, each draw's error to
the reference's tolerance (or, where FLA's own error on that draw is above it, to 1.1× FLA's).
One draw decides nothing for the gate's gradient: its error moves by up to ±30 % from one draw to
the next, in our kernels and in FLA's alike (benchmarks/error_draws.py; session 44 measured d g at
0.72–1.31× FLA's over 8 draws of g = 0 with either training forward, at a mean of 0.95–1.04×),
while every other quantity's moves by a few percent.

FLA must be importable: without it these tests fail, they do not skip (only a machine without
CUDA skips them). All cases use H = 2 query/key heads and HV = 4 value heads and at most 5
sequences, so K = V = 128 is one shape class per dtype; with the head-dim cases, 8 classes in all
(shape_classes(); `python3 benchmarks/fla_tests.py --precompile --real-data` compiles them,
with those of FLA's tests, without a GPU). On the GPU node: `python3 benchmarks/warm_fla.py` (FLA's Triton
compiles, once per kind of call, in parallel), then `python3 -m pytest -q tests/test_gpu_real_data.py`.
"""
import contextlib
import functools
import os
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

import qla_compiler
from qla_compiler.testing import rel_err

pytestmark = pytest.mark.gpu

os.environ.setdefault("FLA_FLASH_QLA", "0")  # FLA's own kernels (FlashQLA would take K = V = 128)

H, HV = 2, 4
GRADS = ("q", "k", "v", "g", "beta", "initial_state")
TOL = {"o": 1e-2, "final_state": 1e-2, **{f"d{n}": 2e-2 for n in GRADS}}
FLA_RATIO = 1.1
SLACK = {torch.bfloat16: 1e-4, torch.float16: 1.25e-5}
DRAWS = 4  # of inputs and cotangents, whose mean error a case with gradients is held to
C = 64  # the chunk size: the positions below are placed against it

# K = V = 128, each in bf16 and fp16. lens: packed sequences (B = 1) unless dense_B.
DATA_CASES = {
    # one unit key per head, the same for every token (A's powers explode: MATH.md's worst row)
    "repeated_key": dict(lens=[300, 1, 129], keys="repeated_key"),
    # random keys, but each chunk's 4th token's key again at 6 later positions of that chunk
    "repeated_token": dict(lens=[300, 1, 129], keys="repeated_token"),
    # FLA's tests: q, k from U[0, 1), l2-normalised; g = logsigmoid(U[0, 1)), in [-0.69, -0.31]
    "uniform_keys": dict(lens=[500, 1, 77, 130], keys="uniform", gate="fla"),
    "uniform_keys_l2norm_in_kernel": dict(lens=[200, 63, 65], keys="uniform", gate="fla", l2norm=True),
    "beta1": dict(lens=[300, 1, 129], beta=1.0),
    "beta1_repeated_key": dict(lens=[200, 1, 70], keys="repeated_key", beta=1.0),
    # no decay over 1000 tokens (FLA's test_chunk with mask_p = 1)
    "g0_uniform_keys": dict(lens=[1000, 1, 250], keys="uniform", gate=0.0),
    # g = -inf at (token, value head or all): a chunk's first (64), middle (70) and last (127)
    # token, the second sequence's first token (200), the 1-token sequence (330)
    "g_neg_inf_resets": dict(lens=[200, 130, 1], reset=((64, None), (70, 0), (127, 3), (200, None), (330, 1))),
    "dense_B2_uniform_keys": dict(lens=[300], dense_B=2, keys="uniform", gate="fla"),
    # g, beta and the initial state in the io dtype, as FLA's test_chunk_varlen passes them
    "gates_state_in_io_dtype": dict(lens=[256, 1, 243], keys="uniform", gate="fla", small_in_io=True),
    # strong decay: a state forgets everything within a token (context parallelism's windows: one chunk)
    "strong_decay": dict(lens=[700, 1, 300], gate=-16.0),
}
# context parallelism on those whose gates decay (windows), do not (whole segments) or reset
CP_CASES = ("strong_decay", "uniform_keys", "g0_uniform_keys", "g_neg_inf_resets", "repeated_token")

# bf16, U[0, 1) keys, 1-token sequences and lengths that are no multiple of 64
HEAD_DIM_CASES = [(64, 64), (100, 100), (128, 128), (256, 256), (128, 64), (64, 128), (100, 60), (256, 128),
                  (16, 32)]
HEAD_DIM_LENS = [1, 100, 64, 1, 257]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def shape_classes() -> list:
    """(H, HV, K, V, sequences, io dtype) of every case: what the kernels compile for (the
    V-block and stages follow from these: kernels/forward.scan_class)."""
    out = []
    for case in DATA_CASES.values():
        n = case.get("dense_B") or len(case["lens"])
        out += [(H, HV, 128, 128, n, io) for io in ("bfloat16", "float16")]
    out += [(H, HV, K, V, len(HEAD_DIM_LENS), "bfloat16") for K, V in HEAD_DIM_CASES]
    return list(dict.fromkeys(out))


def _sequences(lens, dense_B):
    """(first token, length) of every sequence, in the flattened [B·T] token order."""
    if dense_B:
        return [(b * lens[0], lens[0]) for b in range(dense_B)]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return list(zip(starts, lens))


def make_inputs(*, lens, K, V, dtype, keys="randn", gate="mild", beta=None, reset=(), dense_B=None,
                small_in_io=False, l2norm=False, seed=0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, T = (1, sum(lens)) if dense_B is None else (dense_B, lens[0])
    N = dense_B or len(lens)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    def rand(*shape):
        return torch.rand(*shape, device="cuda", generator=gen)

    if keys == "uniform":
        q, k = rand(B, T, H, K), rand(B, T, H, K)
        if not l2norm:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    else:
        assert not l2norm
        q, k = F.normalize(randn(B, T, H, K), dim=-1), F.normalize(randn(B, T, H, K), dim=-1)
        if keys == "repeated_key":
            k = F.normalize(randn(1, 1, H, K), dim=-1).expand(B, T, H, K).contiguous()
        elif keys == "repeated_token":
            flat = k.view(B * T, H, K)
            for first, length in _sequences(lens, dense_B):
                for c in range(0, length, C):
                    src = first + c + 3
                    for d in (4, 5, 6, 17, 40, 63):
                        if c + d < length:
                            flat[first + c + d] = flat[src]
        else:
            assert keys == "randn", keys
    v = randn(B, T, HV, V)
    if gate == "mild":
        g = F.logsigmoid(randn(B, T, HV) + 3.0)
    elif gate == "fla":
        g = F.logsigmoid(rand(B, T, HV))
    else:
        g = torch.full((B, T, HV), float(gate), device="cuda")
    flat_g = g.view(B * T, HV)
    for token, head in reset:
        flat_g[token, slice(None) if head is None else head] = float("-inf")
    b = rand(B, T, HV) if beta is None else torch.full((B, T, HV), float(beta), device="cuda")
    h0 = randn(N, HV, K, V) * 0.5
    small = dtype if small_in_io else torch.float32
    args = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.to(small), beta=b.to(small),
                initial_state=h0.to(small), output_final_state=True)
    if dense_B is None:
        args["cu_seqlens"] = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))],
                                          device="cuda", dtype=torch.int32)
    return args


def _fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:  # the comparison is part of the test: no FLA, no pass
        pytest.fail(f"FLA's chunk_gated_delta_rule cannot be imported ({e}); these tests compare with it")
    return chunk_gated_delta_rule


def _cotangents(args, seed=7):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    v, h0 = args["v"], args["initial_state"]
    d_o = torch.randn(v.shape, device="cuda", generator=gen).to(v.dtype)
    d_final = torch.randn(h0.shape, device="cuda", generator=gen)
    return d_o, d_final


def _run(fn, args, cotangents, l2norm, dtype=None) -> dict:
    """o, the final state and the gradient of every input through fn (leaves copied from args,
    cast to dtype when given)."""
    a = {n: (x.detach().to(dtype or x.dtype).clone().requires_grad_() if n in GRADS else x)
         for n, x in args.items()}
    o, final = fn(**a, use_qk_l2norm_in_kernel=l2norm)
    torch.autograd.backward([o, final], [c.to(dtype) if dtype else c for c in cotangents])
    return {"o": o.detach(), "final_state": final.detach(), **{f"d{n}": a[n].grad for n in GRADS}}


def _check(make, *, l2norm=False, fla_nan_expected=False, context_parallel=None):
    """The op against the reference and FLA on DRAWS draws of `make(draw)` (a case's inputs, each
    draw's seed its own): each draw's error within the reference's tolerance (or 1.1× FLA's where
    FLA's own is above it), the mean error over the draws within _bound of FLA's mean."""
    fla_op = _fla()  # first: without FLA the test fails before any work
    op = qla_compiler.compile("gdn", target="sm90")
    clock = _Clock()
    errors, rows, failures = {}, [], []
    for draw in range(DRAWS):
        args = make(draw)
        io = args["v"].dtype
        cot = _cotangents(args, seed=7 + draw)
        # (each part's wall time, printed with the table: the file ran past 300 s on the H200 in
        # sessions 25 and 26, a single case past 150 s; FLA's Triton autotuning compiles are the suspect)
        with clock("reference"):
            ref = _run(op.reference, args, cot, l2norm, dtype=torch.float64)
        ours_op = functools.partial(op, context_parallel=context_parallel)
        with clock("qla"):
            with torch.no_grad():
                o, final = ours_op(**args, use_qk_l2norm_in_kernel=l2norm)
            ours = {"o (no grad)": o, "final_state (no grad)": final, **_run(ours_op, args, cot, l2norm)}
        fla_args = {n: (x.long() if n == "cu_seqlens" else x) for n, x in args.items()}
        with clock("FLA"):
            fla = _run(fla_op, fla_args, cot, l2norm)
        assert o.dtype == io and final.dtype == torch.float32
        for n in GRADS:
            assert ours[f"d{n}"] is not None and ours[f"d{n}"].dtype == args[n].dtype, n
        for name, x in ours.items():
            q = name.split(" ")[0]
            err = rel_err(x, ref[q])  # (inf where not finite, FLA's NaN at g = −inf too)
            fe = float("inf") if fla[q] is None else rel_err(fla[q], ref[q])
            errors.setdefault(name, []).append((err, fe))
            per_draw = TOL[q] if fe == float("inf") or fe <= TOL[q] else FLA_RATIO * fe + SLACK[io]
            if not err <= per_draw:
                rows.append(f"{name:>22}  draw {draw}: qla {err:.3e}  FLA {fe:.3e}  bound {per_draw:.3e}  FAIL")
                failures.append(f"{name} (draw {draw})")
    for name, pairs in errors.items():
        q = name.split(" ")[0]
        err, fe = (sum(e) / len(e) for e in zip(*pairs))
        _row(rows, failures, name, err, fe, _bound(q, fe, io, fla_nan_expected),
             spread=f"  (draws {min(e for e, _ in pairs):.2e}–{max(e for e, _ in pairs):.2e})")
    table = "\n".join(rows + [str(clock)])
    print(table)
    assert not failures, f"{', '.join(failures)} out of tolerance:\n{table}"


class _Clock:
    """Wall time of named parts (summed over the draws), the GPU synchronised at each end."""

    def __init__(self):
        self.parts = {}

    @contextlib.contextmanager
    def __call__(self, name):
        torch.cuda.synchronize()
        t = time.perf_counter()
        yield
        torch.cuda.synchronize()
        self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t

    def __str__(self):
        return "wall time: " + ", ".join(f"{n} {s:.2f} s" for n, s in self.parts.items())


def _bound(q, fe, io, fla_nan_expected) -> float:
    bound = TOL[q]
    if fe != float("inf"):
        # FLA's own error can be above the reference's tolerance (g = 0 over 1000 tokens of
        # U[0, 1) keys in bf16: 1.4e-2 in o): then the comparison with FLA is the bound
        return FLA_RATIO * fe + SLACK[io] if fe > TOL[q] else min(bound, FLA_RATIO * fe + SLACK[io])
    if not fla_nan_expected:
        warnings.warn(f"FLA's {q} is not finite on these inputs: compared with the reference only")
    return bound


def _row(rows, failures, name, err, fe, bound, spread="") -> None:
    """One quantity's line: its error (inf where not finite), FLA's, the bound; a failure where above."""
    ok = err <= bound
    rows.append(f"{name:>22}  qla {err:.3e}  FLA {fe:.3e}  bound {bound:.3e}  {'ok' if ok else 'FAIL'}{spread}")
    if not ok:
        failures.append(name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DATA_CASES)
def test_gdn_real_data(case, dtype):
    spec = dict(DATA_CASES[case])
    l2norm = spec.get("l2norm", False)
    seed = list(DATA_CASES).index(case)
    _check(lambda draw: make_inputs(K=128, V=128, dtype=DTYPES[dtype], seed=seed + 1000 * draw, **spec),
           l2norm=l2norm, fla_nan_expected=bool(spec.get("reset")))


@pytest.mark.parametrize("segments", [3, 8])
@pytest.mark.parametrize("case", CP_CASES)
def test_gdn_real_data_context_parallel(case, segments):
    """Context parallelism on the same inputs, bf16, inference and training: each segment's map from
    its window where the gates decay (qla_compiler/context_parallel.py), from the whole segment
    where they do not; o, the final state and every gradient within the bounds above, against
    FLA's error without it (issue 17)."""
    spec = dict(DATA_CASES[case])
    seed = list(DATA_CASES).index(case)
    _check(lambda draw: make_inputs(K=128, V=128, dtype=torch.bfloat16, seed=seed + 1000 * draw, **spec),
           l2norm=spec.get("l2norm", False), fla_nan_expected=bool(spec.get("reset")), context_parallel=segments)


@pytest.mark.parametrize("K,V", HEAD_DIM_CASES, ids=[f"K{K}-V{V}" for K, V in HEAD_DIM_CASES])
def test_gdn_head_dims_on_uniform_keys(K, V):
    """Every head dim trains: above 128 the backward runs on column blocks of V
    (Program.backward_columns; at K = 256 blocks of 64)."""
    _check(lambda draw: make_inputs(lens=HEAD_DIM_LENS, K=K, V=V, dtype=torch.bfloat16, keys="uniform", gate="fla",
                                    seed=K + V + 1000 * draw))


@pytest.mark.parametrize("kernel", ["narrow", "wide"])
@pytest.mark.parametrize("case", DATA_CASES)
def test_gdn_real_data_fused_forward(case, kernel):
    """The fused forward — the default for inference calls whose grid fills the GPU
    (kernels/forward.fused_pays), forced here, at V-block 128 for the wide kernel — on the same
    inputs, bf16: o and the final state within the bounds above, against FLA's forward error."""
    from qla_compiler.kernels import forward as fwd

    spec = dict(DATA_CASES[case])
    l2norm = spec.get("l2norm", False)
    args = make_inputs(K=128, V=128, dtype=torch.bfloat16, seed=list(DATA_CASES).index(case), **spec)
    fla_op = _fla()
    op = qla_compiler.compile("gdn", target="sm90")
    with torch.no_grad():
        ref = op.reference(**{n: (x.double() if torch.is_tensor(x) and x.is_floating_point() else x)
                              for n, x in args.items()}, use_qk_l2norm_in_kernel=l2norm)
        with fwd.launch_policy(fused=True, block_v=128 if kernel == "wide" else None):
            ours = op(**args, use_qk_l2norm_in_kernel=l2norm)
        fla = fla_op(**{n: (x.long() if n == "cu_seqlens" else x) for n, x in args.items()},
                     use_qk_l2norm_in_kernel=l2norm)
    rows, failures = [], []
    for q, x, r, f in zip(("o", "final_state"), ours, ref, fla):
        fe = rel_err(f, r) if bool(torch.isfinite(f).all()) else float("inf")
        _row(rows, failures, q, rel_err(x, r), fe, _bound(q, fe, torch.bfloat16, bool(spec.get("reset"))))
    table = "\n".join(rows)
    print(table)
    assert not failures, f"{', '.join(failures)} out of tolerance:\n{table}"
