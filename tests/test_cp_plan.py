"""The context-parallel planner (kernels/cp_plan.py): its model's choices on the bench rows of an
H200, and what `context_parallel="auto"` hands the kernels."""
from qla_compiler.checks import Dims
from qla_compiler.kernels import cp_plan
from qla_compiler.kernels import forward as fwd

# (H, HV, sequences, tokens each): the bench rows
ROWS = {"16/64:8x4096": (16, 64, 8, 4096), "8/32:1x32768": (8, 32, 1, 32768), "4/16:8x4096": (4, 16, 8, 4096),
        "2/8:8x4096": (2, 8, 8, 4096), "16/64:1x2048": (16, 64, 1, 2048), "16/64:1x32768": (16, 64, 1, 32768),
        "2/8:1x32768": (2, 8, 1, 32768), "2/8:1x8192": (2, 8, 1, 8192), "4/16:1x32768": (4, 16, 1, 32768)}


def test_cuts_only_long_sequences_of_few_heads():
    """Where the grid already fills the SMs (eight sequences, or 64 value heads) the model keeps
    the whole walk; one long sequence of 2, 4 or 8 KV groups is cut, more for fewer heads, and
    fewer for a shorter sequence."""
    plan = {row: cp_plan.plan_segments(n, H, HV, 128, 128, n * L, fwd.H200_SMS) for row, (H, HV, n, L) in ROWS.items()}
    assert {row for row, s in plan.items() if s > 1} == {"8/32:1x32768", "2/8:1x32768", "4/16:1x32768",
                                                         "2/8:1x8192"}
    assert plan["2/8:1x32768"] > plan["4/16:1x32768"] > plan["8/32:1x32768"]
    assert plan["2/8:1x32768"] > plan["2/8:1x8192"]


def test_a_cut_is_predicted_faster_than_none_by_the_margin():
    for H, HV, n, L in ROWS.values():
        s = cp_plan.plan_segments(n, H, HV, 128, 128, n * L, fwd.H200_SMS)
        whole = cp_plan.predicted_ms(1, n, H, HV, 128, 128, n * L, fwd.H200_SMS)
        assert s == 1 or cp_plan.predicted_ms(s, n, H, HV, 128, 128, n * L, fwd.H200_SMS) < cp_plan.GAIN * whole


def test_an_eager_call_is_cut_only_where_its_gpu_time_passes_the_cut_host_time():
    """An eager call takes at least its host time, and a cut adds some (HOST_CUT_MS, measured on
    the H200 node): 2/8 × 8192 tokens is cut where the GPU sets the pace (a captured or compiled
    call: 0.116 against 0.215 ms), kept whole where the host does (eager inference 0.47 whole, a
    cut call's host 0.40; its training step 0.72 ms of GPU time). The long rows' inference is cut
    either way (2/8 × 32768: 0.40 eager against 0.85). A training step at 2/8 × 32768 is kept
    whole eagerly (cut: 3.24 ms eager, host-paced, against 2.79 whole, session 29); at 4/16 and
    8/32 heads its uncut GPU time passes the cut's host time and it is cut (3.51 against 4.04)."""
    def plan(row, eager):
        H, HV, n, L = ROWS[row]
        return cp_plan.plan_segments(n, H, HV, 128, 128, n * L, fwd.H200_SMS, eager=eager)

    assert plan("2/8:1x8192", None) == 4
    assert plan("2/8:1x8192", "inference") == plan("2/8:1x8192", "training") == 1
    for row in ("2/8:1x32768", "4/16:1x32768", "8/32:1x32768"):
        assert plan(row, None) == plan(row, "inference") > 1, row
    assert plan("2/8:1x32768", "training") == 1
    assert plan("4/16:1x32768", "training") == plan("4/16:1x32768", None) > 1
    assert plan("8/32:1x32768", "training") == plan("8/32:1x32768", None) > 1
    for row in ROWS:  # an eager call never cuts where a captured one keeps the whole walk
        assert plan(row, None) > 1 or plan(row, "inference") == plan(row, "training") == 1, row


def test_the_call_model_fits_the_uncut_gpu_times_it_was_fitted_to():
    """CALL_GPU against the bench's uncut GPU times (ms) it was fitted to: a training step within
    0.15 ms, an inference call within 0.25 (the eager rule compares it with HOST_CUT_MS)."""
    training = {"2/8:1x32768": 2.786, "4/16:1x32768": 4.019, "2/8:1x8192": 0.720, "8/32:1x32768": 7.085,
                "16/64:1x2048": 0.863, "16/64:8x4096": 13.119}
    inference = {"2/8:1x32768": 0.843, "2/8:1x8192": 0.217, "2/8:8x4096": 0.221, "4/16:1x32768": 0.935,
                 "8/32:1x32768": 1.185, "16/64:8x4096": 1.406, "16/64:1x32768": 1.725, "4/16:8x4096": 0.364}
    for measured, eager, tol in ((training, "training", 0.15), (inference, "inference", 0.25)):
        for row, ms in measured.items():
            H, HV, n, L = ROWS[row]
            whole = cp_plan.predicted_ms(1, n, H, HV, 128, 128, n * L, fwd.H200_SMS)
            assert abs(cp_plan.call_ms(whole, n * L, HV, eager) - ms) <= tol, (row, eager)


def test_auto_gives_the_kernels_a_count_or_none():
    with fwd.launch_policy(sms=fwd.H200_SMS):
        assert cp_plan.planned_segments(Dims(1, 32768, 2, 8, 128, 128, 1), "cuda") == 8
        assert cp_plan.planned_segments(Dims(8, 4096, 16, 64, 128, 128, 8), "cuda") is None
        assert cp_plan.planned_segments(Dims(1, 32768, 2, 8, 100, 128, 1), "cuda") is None  # (K not a power of two)


def test_precompile_covers_what_auto_runs():
    """cp=auto in a deployment (qla-compile --precompile ...,cp=auto,T=...) compiles the segment scans
    the planner will choose at that size, and none where it keeps the whole walk; without T, every
    count it may choose."""
    from qla_compiler.precompile import parse_deployment, shape_classes

    long = shape_classes("gdn", **parse_deployment("H=2,HV=8,K=128,N=1,cp=auto,T=32768,sms=132"))
    assert {(c.kernels, c.shape.V) for c in long} >= {("windows", 256), ("scan", 128)}
    assert shape_classes("gdn", H=2, HV=8, K=128, n_seqs=1, context_parallel=8, sms=132) == long
    short = shape_classes("gdn", **parse_deployment("H=16,HV=64,K=128,N=8,cp=auto,T=32768,sms=132"))
    assert short == shape_classes("gdn", H=16, HV=64, K=128, n_seqs=8, context_parallel=1, sms=132)
    # 8192 tokens: a captured call is cut in 4, an eager one not: both compiled
    mid = shape_classes("gdn", **parse_deployment("H=2,HV=8,K=128,N=1,cp=auto,T=8192,sms=132"))
    assert set(mid) == set(shape_classes("gdn", H=2, HV=8, K=128, n_seqs=1, context_parallel=4, sms=132)) | \
        set(shape_classes("gdn", H=2, HV=8, K=128, n_seqs=1, context_parallel=1, sms=132))
    # without T: every count the planner may choose for some length (its choice is not monotone in
    # the length: 4/16 heads, one sequence, is cut in 2 between 2816 and 3968 tokens, whole at 2048,
    # in 4 at 4096), and the whole walk; "auto" is the default
    every = shape_classes("gdn", H=4, HV=16, K=128, n_seqs=1, sms=132)
    assert set(every) == {c for s in (1, 2, 4, 8, 16, 32) for c in
                          shape_classes("gdn", H=4, HV=16, K=128, n_seqs=1, context_parallel=s, sms=132)}
    assert cp_plan.planned(1, 4, 16, 128, 128, 3072, 132) == 2
    assert set(shape_classes("gdn", H=4, HV=16, K=128, n_seqs=1, context_parallel="auto", tokens=3072,
                             sms=132)) <= set(every)


def _sweep():
    """Session 27's segment sweep on the H200, stored beside its fitting script."""
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parents[1] / "benchmarks" / "cp_sweep_h200.json").read_text())


def test_the_plan_is_the_fastest_count_measured():
    """On every row of the stored H200 sweep, the planned count's measured time is within 5 % of
    the fastest count's (session 27: it is the fastest on all eight)."""
    data = _sweep()
    for row in {d["row"] for d in data}:
        measured = {d["segments"]: d["ms"] for d in data if d["row"] == row}
        H, HV, n, L = ROWS[row]
        plan = cp_plan.plan_segments(n, H, HV, 128, 128, n * L, fwd.H200_SMS)
        assert measured[plan] <= 1.05 * min(measured.values()), (row, plan, measured)


def test_the_model_predicts_the_sweep():
    """The model's constants against the measurements they were fitted to: each cut's change in
    GPU time against none (the prep cancels) within 0.06 ms, where the segments are longer than a
    window (the model's windows walk min(WINDOW, segment) chunks; at 16/64 × 2048 cut in 16 the
    segments are two chunks, and the model is 0.14 ms under)."""
    for d in _sweep():
        H, HV, n, L = ROWS[d["row"]]
        if L // 64 // d["segments"] <= cp_plan.WINDOW:
            continue
        base = next(e["ms"] for e in _sweep() if e["row"] == d["row"] and e["segments"] == 1)
        size = (n, H, HV, 128, 128, n * L, fwd.H200_SMS)
        model = cp_plan.predicted_ms(d["segments"], *size) - cp_plan.predicted_ms(1, *size)
        assert abs(model - (d["ms"] - base)) <= 0.06, d


def test_a_warmup_without_the_length_compiles_every_count_the_plan_chooses_and_no_hopeless_one():
    """may_choose (what a warm-up not told T compiles) holds every count plan_segments chooses at
    lengths up to 4096 chunks (every third), eager or not, and rules out the counts no length makes pay:
    none for 64 value heads or 8 sequences of 16 (the grid fills the SMs whole)."""
    for H, HV, N in ((2, 8, 1), (2, 8, 3), (4, 16, 1), (8, 32, 3), (1, 1, 8), (16, 64, 1), (4, 16, 8)):
        chosen = {cp_plan.plan_segments(N, H, HV, 128, 128, N * 64 * c, fwd.H200_SMS, eager=e)
                  for c in range(1, 4097, 3) for e in (None, "inference", "training")}
        allowed = {s for s in cp_plan.SEGMENTS if cp_plan.may_choose(s, N, HV, 128, 128, fwd.H200_SMS)}
        assert chosen <= allowed, (H, HV, N, chosen - allowed)
    assert [s for s in cp_plan.SEGMENTS if cp_plan.may_choose(s, 1, 64, 128, 128, fwd.H200_SMS)] == [1]
    assert [s for s in cp_plan.SEGMENTS if cp_plan.may_choose(s, 8, 16, 128, 128, fwd.H200_SMS)] == [1]
