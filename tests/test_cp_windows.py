"""Context parallelism's gate shortcut (qla_compiler/context_parallel.py): the bound on each
transition's norm, the windows it picks, and the GPU path's host code with the kernels emulated
(passes/walk_skip.py's kernels walk each segment's window), against the same call walking whole
segments (exact) and against the reference."""
import math

import pytest
import torch

from qla_compiler import context_parallel as cp_mod
from qla_compiler.context_parallel import contraction_logs, segment_bounds, segment_layout, window_skips
from qla_compiler.emulate import emulated_kernels, emulated_step
from qla_compiler.kernels import forward as fwd
from qla_compiler.testing import random_inputs, rel_err


@pytest.mark.parametrize("spec", ["gdn", "delta_net", "simple_gla", "retnet", "linear_attn", "kda", "gla"])
def test_contraction_bounds_each_transitions_norm(ops, spec):
    """log ‖A_t‖₂ ≤ λ_t for every token and value head, A_t built from the spec's structure, on
    keys that are not unit-norm and β up to 3 (where I − β k kᵀ expands) as well as the usual."""
    op = ops[spec]
    rec = op.program.recurrence
    st = rec.structure
    args = random_inputs(op, T=50, H=2, HV=4, K=6, V=3, seed=3)
    gen = torch.Generator().manual_seed(5)
    for name, kind in op.kinds.items():  # keys of norm up to 2, scalars up to 3
        if kind == "key":
            norms = 2 * torch.rand(args[name].shape[:-1], generator=gen, dtype=torch.float64)
            args[name] = args[name] * norms[..., None]
        elif kind == "scalar":
            args[name] = 3 * torch.rand(args[name].shape, generator=gen, dtype=torch.float64)
    inputs = {n: args[n] for n in op.input_names}
    lam = contraction_logs(rec, inputs, HV=4)
    eye = torch.eye(6, dtype=torch.float64)
    for t in range(50):
        for hv in range(4):
            A = eye.clone()
            if st.decay == "gate":
                A = A * math.exp(inputs[st.decay_name][0, t, hv])
            elif st.decay == "key_gate":
                A = torch.diag(inputs[st.decay_name][0, t, hv].exp())
            elif st.decay == "head_constant":
                A = A * rec.constants[0].values(4)[hv]
            if st.delta:
                x = inputs[st.write_key][0, t, hv // 2]
                s = float(st.delta_coeff.subs({i.symbol: float(inputs[i.name][0, t, hv]) for i in rec.inputs
                                               if i.kind == "scalar"}))
                A = (eye - s * torch.outer(x, x)) @ A
            assert math.log(torch.linalg.matrix_norm(A, 2)) <= float(lam[t, hv]) + 1e-6, (t, hv)


def test_windows_are_the_shortest_that_decay_enough():
    """One sequence of 5 chunks in 2 segments (3 + 2 chunks); λ per chunk (64 tokens) set per head:
    head 0 decays e^-64 a chunk (a window of one chunk), head 1 e^-9.6 (two chunks: −19.2 ≤ −16.6),
    head 2 not at all (the whole segment). The last segment's map is unused: all its chunks left
    out. In reverse the window is at the segment's start and the first segment's map is unused."""
    per_token = torch.tensor([-1.0, -0.15, 0.0])
    lam = per_token.repeat(300, 1)
    layout = segment_layout(torch.tensor([0, 300]), 2, 64, 300)
    assert layout.cu.tolist() == [0, 192, 300] and layout.offsets.tolist() == [0, 3, 5]
    assert window_skips(lam, layout).tolist() == [[2, 1, 0], [2, 2, 2]]
    assert window_skips(lam, layout, reverse=True).tolist() == [[3, 3, 3], [1, 0, 0]]
    # g = −inf (a reset): contraction_logs floors it at −2·NEGLIGIBLE, a bound like strong decay
    lam[100, 2] = -2 * cp_mod.NEGLIGIBLE
    assert window_skips(lam, layout)[0, 2] == 1


def test_windows_of_packed_sequences_with_empty_segments():
    """Three sequences (1, 299 and 30 tokens) in 3 segments, one value head decaying hard: the
    1-token sequence's used segments walk their one chunk (a window needs a chunk), the empty
    ones nothing; the 299-token one's used segments (2 chunks each) one chunk; the last
    segments of each sequence nothing."""
    cu = torch.tensor([0, 1, 300, 330])
    layout = segment_layout(cu, 3, 64, 330)
    assert layout.cu.tolist() == segment_bounds(cu, 3, 64).tolist() == [0, 1, 1, 1, 129, 257, 300, 330, 330, 330]
    skip = window_skips(torch.full((330, 1), -1.0), layout).flatten().tolist()
    assert skip == [0, 0, 0, 1, 1, 1, 0, 0, 0]


def _skips_by_definition(lam, cu, segments, C, reverse):
    """window_skips spelled out, one (segment, value head) at a time over token ranges."""
    bounds = segment_bounds(torch.tensor(cu), segments, C).tolist()
    out = []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        n = (b - a + C - 1) // C
        row = []
        for hv in range(lam.shape[1]):
            if i % segments == (0 if reverse else segments - 1):
                row.append(n)  # an unused map
                continue
            sums = [float(lam[a + j * C:min(a + (j + 1) * C, b), hv].double().sum()) for j in range(n)]
            left = [j for j in range(n) if sum(sums[j:]) <= -cp_mod.NEGLIGIBLE] if not reverse else \
                [n - 1 - j for j in range(n) if sum(sums[:j + 1]) <= -cp_mod.NEGLIGIBLE]
            row.append(max(left, default=0))
        out.append(row)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_windows_match_their_definition_on_random_packings(seed):
    """Random packed lengths (1-token sequences and ones not a multiple of the chunk), random λ
    with a strong, a mild and a flat head and resets; every segment count 2..5, both directions."""
    gen = torch.Generator().manual_seed(seed)
    lens = [1, 7] + torch.randint(1, 400, (4,), generator=gen).tolist()
    lens = [lens[i] for i in torch.randperm(len(lens), generator=gen).tolist()]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = cu[-1]
    lam = torch.stack([-2 * torch.rand(T, generator=gen), -0.3 * torch.rand(T, generator=gen), torch.zeros(T)], 1)
    lam[torch.randint(0, T, (3,), generator=gen), 2] = -2 * cp_mod.NEGLIGIBLE  # resets
    for segments in range(2, 6):
        layout = segment_layout(torch.tensor(cu), segments, 16, T)
        for reverse in (False, True):
            assert window_skips(lam, layout, reverse).tolist() == \
                _skips_by_definition(lam, cu, segments, 16, reverse), (segments, reverse)


def _strong_none_mild(op, T, cu_seqlens):
    """bf16 inputs whose value heads decay hard (g = −1.5 a token), not at all, and mildly (−0.02:
    e^-1.28 a chunk, so a segment of 3 chunks is walked whole)."""
    args = random_inputs(op, T=T, H=1, HV=3, K=64, V=64, cu_seqlens=cu_seqlens, initial_state=True,
                         dtype=torch.bfloat16, seed=11)
    args["g"][...] = torch.tensor([-1.5, 0.0, -0.02])
    return args


def test_fused_forward_walks_windows_and_matches_whole_segments(ops, monkeypatch):
    """The inference call context-parallel through the fused kernel: the strongly decaying head's
    segments walk one chunk, the undecayed head's whole segments; o and the final state are those of
    the call that walks every segment whole (float64 emulation: to float32's rounding of the maps),
    and the reference's. With a threshold of 1 instead of 16.6 the mild head's windows are one chunk,
    dropping e^-1.28 of its history, and they are not: the comparison can fail."""
    op = ops["gdn"]
    args = _strong_none_mild(op, 700, [0, 1, 520, 700])
    inputs, dims, scale = op._prepare((), {n: args[n] for n in op.input_names}, None, args["initial_state"],
                                      args["cu_seqlens"], False)

    def run(threshold):
        monkeypatch.setattr(cp_mod, "NEGLIGIBLE", threshold)
        with emulated_kernels(op, args["cu_seqlens"].to(torch.int32), scale) as emu, fwd.launch_policy(fused=True):
            o, final = fwd.forward(op.program, inputs, op.kinds, dims, scale, args["initial_state"],
                                   args["cu_seqlens"], op._head_logs(dims.HV), 3)
        return o.double(), final, emu

    o, final, emu = run(24 * math.log(2))
    skip = emu.seen["gdn_fused_windows"]["skip_chunks"]
    assert emu.seen["gdn_fused_windows"]["v"].shape[-1] == 64  # v as it is: the kernel reads [0 | v]
    # 519 tokens = 9 chunks in segments of 3: head 0 leaves 2 out of each used segment, heads 1 and
    # 2 none; the sequences' last segments (index 2 of each) walk nothing
    assert skip[3:5].tolist() == [[2, 0, 0], [2, 0, 0]] and skip[5].tolist() == [3, 3, 3]
    o_whole, final_whole, _ = run(math.inf)
    assert rel_err(final, final_whole) <= 1e-6 and rel_err(o, o_whole) <= 1e-3
    ref = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in args.items()}
    o_ref, s_ref = op.reference(**ref)
    assert rel_err(o, o_ref) <= 1e-2 and rel_err(final, s_ref) <= 1e-2
    o_rough, final_rough, _ = run(1.0)
    assert rel_err(final_rough, final_whole) > 1e-3


def test_training_step_walks_windows_forward_and_backward(ops, monkeypatch):
    """A training step context-parallel (both scans walk windows: the backward's at each segment's
    start): o, the final state and every gradient as with whole segments, and as without context
    parallelism (what both share, the segments' maps, checked too)."""
    op = ops["gdn"]
    args = _strong_none_mild(op, 700, [0, 1, 520, 700])
    steps = {"plain": emulated_step(op, args)}
    for name, threshold in (("windows", 24 * math.log(2)), ("whole", math.inf)):
        monkeypatch.setattr(cp_mod, "NEGLIGIBLE", threshold)
        steps[name] = emulated_step(op, args, segments=3)
    win, whole, plain = steps["windows"], steps["whole"], steps["plain"]
    assert rel_err(win["final"], plain["final"]) <= 1e-5 and rel_err(win["o"].double(), plain["o"].double()) <= 1e-2
    for name in op.input_names:
        assert rel_err(win["grads"][name], plain["grads"][name]) <= 1e-2, name
    seen = win["emulator"].seen
    skip = seen["gdn_backward_scan_windows"]["skip_chunks"]
    # the values as they are (the kernels read [0 | x], Tensor.zero_columns): 64 wide, not 128
    assert seen["gdn_scan_windows"]["U_rows"].shape[-1] == seen["gdn_backward_scan_windows"]["d_o"].shape[-1] == 64
    assert skip[3:6].tolist() == [[3, 3, 3], [2, 0, 0], [2, 0, 0]]  # reverse: the first segment's map is unused
    assert rel_err(win["final"], whole["final"]) <= 1e-6
    for name in op.input_names:
        assert rel_err(win["grads"][name], whole["grads"][name]) <= 1e-3, name
    assert rel_err(win["d_h0"], whole["d_h0"]) <= 1e-6


def test_windows_kernels_lower_to_cuda():
    """GDN's windows kernels (fused, training forward, backward) through TileLang to CUDA (sm_90a,
    no GPU needed): the fused kernel's CTA reads its skip once, the walk runs skip fewer chunks,
    the rings turn with the walk's count, and the backward's walk indexes chunks from the
    sequence's end. The values' zero columns: each such tensor is read by TMA alone (no pointer
    to it reaches the kernel, so no element load can read before its column 0), its V-blocks from
    column v0 − K = blockIdx.x · 64 − 128, which TMA fills with zeros where negative."""
    import re

    import qla_compiler
    from qla_compiler.kernels.runtime import lower_to_cuda
    from qla_compiler.passes.lower_tilelang import ShapeClass

    prog = qla_compiler.compile_spec("gdn")
    shape = ShapeClass(H=2, HV=8, K=128, V=256, BV=64)
    fused = lower_to_cuda(prog.fused_program.windows_program, shape)["gdn_fused_windows"]
    assert fused.count("skip_chunks[") == 1 and "i_w < (((seq_len + 63) >> 6) - skip)" in fused
    assert "state_s_full[(i_w & 1)].arrive()" in fused
    back = lower_to_cuda(prog.backward_program.windows_program, shape)["gdn_backward_scan_windows"]
    assert "skip_chunks[" in back and "- (((int64_t)skip) * (int64_t)512)) - (((int64_t)i_w)" in back
    training = lower_to_cuda(prog.windows_program, shape)["gdn_scan_windows"]
    for src, names in ((fused, ["v"]), (training, ["U_rows"]), (back, ["d_o", "d_v_new_o_intra_rows"])):
        for name in names:
            assert not re.search(rf"\* __restrict__ {name}\b", src), name
            assert re.search(rf"tma_load\({name}_desc, [^;]*\(\(\(int\)blockIdx\.x\) \* 64\) - 128\)", src), name


def test_segment_layout_is_kept_with_cu_seqlens():
    """A context-parallel call's segment layout (~40 device ops) is made once per cu_seqlens tensor
    and segment count while the tensor is unchanged; an in-place write makes it again, and a
    compiled graph's call (cache False) keeps none."""
    cu = torch.tensor([0, 1, 300], dtype=torch.int32)
    first = fwd.segment_layouts(cu, 3, 64, 300)
    assert fwd.segment_layouts(cu, 3, 64, 300) is first
    assert fwd.segment_layouts(cu, 2, 64, 300) is not first
    assert fwd.segment_layouts(cu, 3, 64, 300, cache=False) is not first
    cu[1] = 100
    again = fwd.segment_layouts(cu, 3, 64, 300)
    assert again is not first and again.cu.tolist() == segment_bounds(cu, 3, 64).tolist()


@pytest.mark.parametrize("spec", ["gdn", "retnet"])
def test_window_search_kernel_lowers_to_cuda(spec):
    """The GPU's window search (kernels/window_search.py) through TileLang to CUDA for sm_90a, no
    GPU needed: GDN's (a gate and the delta factor: the keys' norms, the keys read in 16-byte loads)
    and RetNet's (a head constant, no keys read), both walk directions; each chunk's λ are summed
    between two barriers, and only while no window has been found. (On the GPU,
    tests/test_gpu_window_search.py holds its skips to window_skips'.)"""
    import qla_compiler
    from qla_compiler.kernels import window_search

    rec = qla_compiler.compile_spec(spec).recurrence
    for reverse in (False, True):
        src = window_search.compiled(window_search.kind(rec), 2, 8, 128, "bfloat16", 64, reverse).get_kernel_source()
        assert src.count("__syncthreads()") == 2 and "if_condition = (found[0] < 0)" in src.replace("bool ", "")
        assert ("*(uint4*)(keys + " in src) == ("keys" in src) == (spec == "gdn")


@pytest.mark.parametrize("spec", ["kda", "gla"])
def test_a_per_key_gates_window_search_is_the_gates_kernel_on_its_slowest_key(spec):
    """A per-key gate's λ is its slowest key's log decay (contraction_logs): the search takes it
    reduced over the keys as a gate per token (one kernel for both kinds), its λ as
    contraction_logs' (on the GPU, tests/test_gpu_window_search.py holds the skips equal). Before
    session 37 a per-key spec's context-parallel call on the GPU raised instead (16/16 × 32768
    tokens: the plan cuts it in 4)."""
    import qla_compiler
    from qla_compiler.kernels import window_search

    op = qla_compiler.compile(spec, target="cpu")
    rec = op.program.recurrence
    assert window_search.kind(rec) == ("gate", spec == "kda")
    args = random_inputs(op, T=70, H=2, HV=4, K=16, V=8, cu_seqlens=[0, 1, 70], seed=3)
    g = args["g"]
    g[0, 5, :, 3] = -torch.inf  # a reset in one key: the others still bound it
    searched = window_search.arguments(rec, args, 4)[0]
    assert searched.shape == (1, 70, 4) and searched.dtype == torch.float32
    want = g.amax(-1).float()
    want = want if want.shape[2] == 4 else want.repeat_interleave(4 // want.shape[2], dim=2)
    assert torch.equal(searched[0], want[0])
    if spec == "gla":  # (no delta factor: λ is the gate's bound itself)
        assert torch.equal(contraction_logs(rec, args, 4), want[0].clamp(min=-2 * cp_mod.NEGLIGIBLE))


def test_a_context_parallel_call_dispatches_few_torch_ops():
    """Host time of a context-parallel call is mostly its torch ops (~5–10 µs each on the H200's
    host; NOTES, session 22). With the window search and the chain of segment maps kernels (stubbed
    here: one launch each, no aten op beyond the output's allocation), an inference call at 8
    segments dispatches at most 20 aten ops besides its kernels (session 21: 175; with the torch
    search: 86; with the torch chain: 40), 14 without context parallelism; counted on meta tensors."""
    import qla_compiler
    from qla_compiler.testing import OpLog

    op = qla_compiler.compile("gdn", target="sm90")
    T, H, HV = 4096, 2, 8
    args = dict(q=torch.randn(1, T, H, 128), k=torch.randn(1, T, H, 128), v=torch.randn(1, T, HV, 128),
                g=-torch.rand(1, T, HV), beta=torch.rand(1, T, HV))
    args = {n: x.to(torch.bfloat16 if n in ("q", "k", "v") else torch.float32).to("meta") for n, x in args.items()}

    class Noop:  # what loads a program's kernels: launches that do nothing
        def __call__(self, program, shape):
            return {k.name: (lambda *a: None) for k in program.kernels.kernels}

    def search(program, tensors, HV, C):
        return lambda layout, reverse: torch.empty(layout.cu.numel() - 1, HV, dtype=torch.int32, device=layout.cu.device)

    def chain(h0):
        return lambda maps, h0, segments, reverse: h0.new_empty(h0.shape[0] * segments, *h0.shape[1:])
    counts = {}
    for segments in (None, 8):
        def call():
            inputs, dims, scale = op._prepare((), {n: args[n] for n in op.input_names}, None, None, None, False)
            return fwd.forward(op.program, inputs, op.kinds, dims, scale, None, None, op._head_logs(dims.HV), segments)
        with fwd.launch_policy(kernels=Noop(), sms=fwd.H200_SMS, window_search=search, segment_chain=chain), \
                torch.no_grad():
            call()  # (the segment layout, made once per cu_seqlens)
            with OpLog() as log:
                call()
        counts[segments] = len(log.ops)
    assert counts[None] <= 14 and counts[8] <= 20, counts
