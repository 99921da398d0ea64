"""FLA's own tests, run against qla's ops: GDN's (issue 15: correct on real data) and KDA's (issue 18).

    python3 benchmarks/fla_tests.py                 # qla's ops in place of FLA's (chunk_, fused_recurrent_)
    python3 benchmarks/fla_tests.py --family kda    # FLA's KDA test_chunk on qla's chunk_kda
    python3 benchmarks/fla_tests.py --family gla    # FLA's GLA test_chunk and test_chunk_varlen on chunk_gla
    python3 benchmarks/fla_tests.py --op fla        # the same tests on FLA's own ops (the baseline)
    python3 benchmarks/fla_tests.py --op both       # both, one process, side by side
    python3 benchmarks/fla_tests.py -k D64 -- -x    # a subset (pytest's -k); after --, pytest's own options
    python3 benchmarks/fla_tests.py --collect-only  # what would run, nothing compiled

    # without a GPU (and without FLA): the shape classes these tests compile, then compile them,
    # with --real-data also those of tests/test_gpu_real_data.py (GDN's; as benchmarks/precompile.py does)
    python3 benchmarks/fla_tests.py --classes [--real-data] [--family kda]
    TILELANG_CACHE_DIR=/tmp/tlc python3 benchmarks/fla_tests.py --precompile [--real-data] --tar /tmp/fla.tar

The test files are FLA's `tests/ops/test_gdn.py`, `test_gla.py` and `test_kda.py`, unchanged and
kept out of this repository: by default `.gpu/fla_tests/test_<family>.py` (git-ignored;
.gpu/fla_tests/SOURCE.txt says which commit), else `--tests PATH`.
- GDN: four tests run. `test_chunk`, `test_chunk_varlen` and `test_chunk_varlen_prefill` (the
  acceptance) call the module-level name `chunk_gated_delta_rule` for the op under test;
  `test_fused_recurrent` calls `fused_recurrent_gated_delta_rule` (q, k in float32 beside v and β
  in the test's dtype, every input requiring gradients; its forward only).
- GLA: `test_chunk` (K = V = D up to 512: past 256 on blocks of K and of V) and
  `test_chunk_varlen` call `chunk_gla`, against FLA's fused_recurrent_gla, forward and gradients.
- KDA: `test_chunk` calls `chunk_kda` with Kimi Linear's keywords (the gate from A_log and
  dt_bias, safe_gate, lower_bound, chunk_size, …: qla_compiler/fla_kda.py), uniform [0, 1) keys
  (every pair correlated), forward and gradients.
Each compares the op (FLA's `assert_close`: RMS error over RMS of the reference, below a
per-quantity ratio) with FLA's float32 token-by-token naive recurrence. For every test the runner
rebinds those names to `qla_compiler.ops`' ops of the same names (thin wrappers that only count
calls and the keyword arguments they pass), and wraps `assert_close` to record each comparison it
makes, then prints one line per test: its outcome and every quantity's ratio against the test's
bound.

The summary lists the keywords the tests actually passed, so a newer test file that passes more
shows up there (and as the op's ValueError naming the unknown argument). Environment, set before
fla is imported: FLA_DISABLE_BACKEND_DISPATCH=1 (test_chunk skips its grouped-head cases, HV != H,
otherwise) and FLA_CI_ENV unset (with it, FLA's assert_close only warns on errors below 1%).
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
os.environ.pop("FLA_CI_ENV", None)
os.environ.setdefault("FLA_FLASH_QLA", "0")  # FLA's own kernels when --op fla/both (as enter.sh sets)

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Family:
    """One of FLA's test files: the spec it tests, its tests that run, the names they call for the
    op under test (each rebound to qla's op of that name) and the keywords they pass it (q, k, v,
    g, beta included; anything else is news)."""
    spec: str
    selected: tuple
    ops: tuple
    kwargs: frozenset

    @property
    def default_tests(self) -> Path:
        return REPO / ".gpu" / "fla_tests" / f"test_{self.spec}.py"


_COMMON = frozenset({"q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                     "use_qk_l2norm_in_kernel", "cu_seqlens"})
FAMILIES = {
    "gdn": Family("gdn", ("test_chunk", "test_chunk_varlen", "test_chunk_varlen_prefill", "test_fused_recurrent"),
                  ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"), _COMMON),
    # (its reference is FLA's own fused_recurrent_gla, called as `gk=`: not rebound)
    "gla": Family("gla", ("test_chunk", "test_chunk_varlen"), ("chunk_gla",), _COMMON),
    # (Kimi Linear's call: the gate from A_log and dt_bias, and FLA's tuning options: qla_compiler/fla_kda.py)
    "kda": Family("kda", ("test_chunk",), ("chunk_kda",),
                  _COMMON | {"A_log", "dt_bias", "use_gate_in_kernel", "safe_gate", "lower_bound", "disable_recompute",
                             "chunk_size"}),
}


class Swap:
    """A pytest plugin: per test, the module's names of the family's ops are qla's, and
    every `assert_close` is recorded (prefix, ratio, bound, max abs error) before it runs."""

    def __init__(self, which: str, family: Family):
        self.which, self.family = which, family
        self.results = {}  # nodeid -> {"outcome", "message", "calls", "closes": [(name, ratio, bound, abs, warns)]}
        self.kwargs_seen = set()

    def _op(self, module, name):
        if self.which == "fla":
            return getattr(module, name)
        from qla_compiler import ops

        return getattr(ops, name)

    def _entry(self, nodeid):
        return self.results.setdefault(nodeid, {"outcome": None, "message": "", "calls": 0, "closes": []})

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        module = item.module
        entry = self._entry(item.nodeid)
        close = module.assert_close
        from fla.utils import get_abs_err, get_err_ratio

        def counted(op):
            def call(*args, **kwargs):
                entry["calls"] += 1
                self.kwargs_seen.update(kwargs)
                return op(*args, **kwargs)
            return call

        def recorded(prefix, ref, tri, ratio, *rest, **kw):
            try:
                # (in float64: FLA's ratio squares half tensors in their own dtype, where errors
                # below ~2e-4 square to 0 and values past 256 to inf: the ratio reads 0, and FLA's
                # own check passes whatever the error)
                rate, abs_err = get_err_ratio(ref.double(), tri.double()), get_abs_err(ref, tri)
            except Exception:  # e.g. shapes that do not match: the original raises it below
                rate, abs_err = float("nan"), float("nan")
            # (FLA's assert_close(..., warning=True) only warns past its bound)
            warns = bool(kw.get("warning", rest[0] if rest else False))
            entry["closes"].append((prefix.strip(), rate, ratio, abs_err, warns))
            return close(prefix, ref, tri, ratio, *rest, **kw)

        names = [n for n in self.family.ops if hasattr(module, n)]
        saved = {n: getattr(module, n) for n in (*names, "assert_close")}
        for n in names:
            setattr(module, n, counted(self._op(module, n)))
        module.assert_close = recorded
        try:
            yield
        finally:
            for n, f in saved.items():
                setattr(module, n, f)

    def pytest_runtest_logreport(self, report):
        entry = self._entry(report.nodeid)
        if report.when == "call" or (report.when == "setup" and not report.passed):
            entry["outcome"] = report.outcome
            if not report.passed:
                entry["message"] = _first_line(report)


def _first_line(report) -> str:
    """The one line that says why a test failed or skipped."""
    lr = report.longrepr
    if isinstance(lr, tuple):  # a skip: (path, line, reason)
        return str(lr[2])
    crash = getattr(lr, "reprcrash", None)
    text = crash.message if crash is not None else str(lr)
    return text.strip().splitlines()[0] if text.strip() else ""


def _passes(rate, bound, abs_err) -> bool:
    """FLA's assert_close: passes when the max abs error is at most 1e-6, else when ratio < bound."""
    return abs_err <= 1e-6 or rate < bound  # (NaN compares False)


def _fmt(x) -> str:
    return f"{x:.2e}" if isinstance(x, float) and math.isfinite(x) else str(x)


def run(which: str, family: Family, tests: Path, keyword: str | None, pytest_args: list) -> tuple[int, Swap]:
    plugin = Swap(which, family)
    args = [f"{tests}::{name}" for name in family.selected]
    args += ["-p", "no:cacheprovider", "-q", "-rfEs", "--tb=short"] + (["-k", keyword] if keyword else [])
    args += pytest_args
    print(f"\n=== FLA's {family.spec.upper()} tests on {which}'s op: pytest {' '.join(args)}", flush=True)
    code = pytest.main(args, plugins=[plugin])
    return int(code), plugin


def summarize(runs: dict) -> None:
    """One line per test (and op): outcome, each compared quantity's ratio / the test's bound."""
    print("\n=== summary: ratio = RMS(out - ref) / RMS(ref) against FLA's naive float32 reference, "
          "'<' the test's bound")
    nodeids = []
    for plugin in runs.values():
        nodeids += [n for n in plugin.results if n not in nodeids]
    tally = {which: defaultdict(int) for which in runs}
    for nodeid in nodeids:
        print(nodeid.split("::", 1)[-1])
        for which, plugin in runs.items():
            r = plugin.results.get(nodeid)
            if r is None:
                continue
            tally[which][r["outcome"]] += 1
            closes = "  ".join(f"{name} {_fmt(rate)}{'<' if _passes(rate, bound, abs_err) else ' NOT <'}{bound:g}"
                               + (" (FLA warns only)" if warns and not _passes(rate, bound, abs_err) else "")
                               for name, rate, bound, abs_err, warns in r["closes"])
            print(f"  {which:>3} {str(r['outcome']).upper():8} calls {r['calls']}  {closes}")
            if r["message"]:
                print(f"      {r['message'][:300]}")
    if len(runs) == 2 and all(k in runs for k in ("qla", "fla")):
        print("\n=== qla / FLA, per quantity (both measured in this process on the same inputs)")
        for nodeid in nodeids:
            a, b = runs["qla"].results.get(nodeid), runs["fla"].results.get(nodeid)
            if not a or not b or not a["closes"] or not b["closes"]:
                continue
            fla = {name: rate for name, rate, *_ in b["closes"]}
            parts = [f"{name} {rate / fla[name]:.2f}" for name, rate, *_ in a["closes"]
                     if name in fla and isinstance(rate, float) and fla[name] > 0]
            print(f"  {nodeid.split('::', 1)[-1]}: " + "  ".join(parts))
    for which, plugin in runs.items():
        counts = ", ".join(f"{n} {k}" for k, n in sorted(tally[which].items(), key=lambda kv: str(kv[0])))
        print(f"\n{which}: {counts}")
        unexpected = plugin.kwargs_seen - plugin.family.kwargs
        print(f"{which}: keywords the tests passed the op: {', '.join(sorted(plugin.kwargs_seen)) or '(none)'}"
              + (f"; NOT among those qla takes: {', '.join(sorted(unexpected))}" if unexpected else ""))


def fla_test_params(path: Path, family: Family) -> dict:
    """name -> the parameter rows (dicts) of each selected test, read from the test file's source:
    no import, so it works where FLA cannot be imported (a machine without a GPU). Expects FLA's
    form, `@pytest.mark.parametrize((names...), [pytest.param(*test, ...) for test in [(...), ...]])`;
    a dtype such as `torch.float16` reads as its name."""
    def value(node):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
            return node.attr
        return ast.literal_eval(node)

    out = {}
    for fn in ast.parse(path.read_text()).body:
        if not (isinstance(fn, ast.FunctionDef) and fn.name in family.selected):
            continue
        for dec in fn.decorator_list:
            if isinstance(dec, ast.Call) and getattr(dec.func, "attr", None) == "parametrize":
                names, rows = ast.literal_eval(dec.args[0]), dec.args[1]
                if not (isinstance(rows, ast.ListComp) and isinstance(rows.generators[-1].iter, ast.List)):
                    raise ValueError(f"{path}: {fn.name}'s parameters are not in the form this reader knows")
                out[fn.name] = [dict(zip(names, map(value, t.elts))) for t in rows.generators[-1].iter.elts]
    missing = [n for n in family.selected if n not in out]
    if missing:
        raise ValueError(f"{path}: no parametrized {', '.join(missing)}")
    return out


def fla_classes(params: dict) -> list:
    """(H, HV, K, V, sequences, io, scale, training) of every selected test's call of the op."""
    out = []
    for p in params["test_chunk"]:  # dense batches, trained (gradients checked); GLA's: HV = H, no scale
        out.append((p["H"], p.get("HV", p["H"]), p["D"], p["D"], p["B"], p["dtype"], p.get("scale"), True))
    for p in params.get("test_chunk_varlen", []):  # packed, trained, scale None
        out.append((p["H"], p.get("HV", p["H"]), p["D"], p["D"], len(p["cu_seqlens"]) - 1, p["dtype"], None, True))
    for p in params.get("test_chunk_varlen_prefill", []):  # packed, HV = H, inference mode
        out.append((p["H"], p["H"], p["D"], p["D"], len(p["cu_seqlens"]) - 1, p["dtype"], None, False))
    for p in params.get("test_fused_recurrent", []):  # inputs that need gradients: the chunk op's training
        if p["dtype"] in ("float16", "bfloat16"):  # forward (float32 runs no kernels)
            out.append((p["H"], p["HV"], p["D"], p["D"], p["B"], p["dtype"], p["scale"], True))
    return out


def real_data_classes(head_dims_only: bool = False) -> list:
    """The same for tests/test_gpu_real_data.py: each case runs the op without and with grad
    (`head_dims_only`: its head-dim cases alone)."""
    spec = importlib.util.spec_from_file_location("test_gpu_real_data", REPO / "tests" / "test_gpu_real_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cases = [(mod.H, mod.HV, K, V, len(mod.HEAD_DIM_LENS), "bfloat16") for K, V in mod.HEAD_DIM_CASES] \
        if head_dims_only else mod.shape_classes()
    return [(*c, None, training) for c in cases for training in (False, True)]


def compile_items(classes: list, spec: str = "gdn") -> list:
    """(program variant, ShapeClass, the class that picks the program's variant) of each call,
    as kernels/forward.py picks them on an H200 (the scale as the op passes it: a float)."""
    import qla_compiler
    from qla_compiler.kernels import forward
    from qla_compiler.kernels.backward import column_blocks

    todo, program = [], qla_compiler.compile_spec(spec)
    for H, HV, K, V, n, io, scale, training in _blocks(classes, spec):
        shape = forward.scan_class(H, HV, K, V, n, io, forward.H200_SMS, scale)
        runs_as = forward.scan_class(H, HV, K, V, n, io, forward.H200_SMS)
        if not training:
            todo.append((spec, shape, runs_as))
            continue
        todo.append((f"{spec}.training", shape, runs_as))
        keys, width, _ = program.for_shape(runs_as).backward_blocks()
        # a backward on blocks of V's columns, or of K's (kernels/backward.py): each block a class of
        # its widths
        if keys >= K and width >= V:
            todo.append((f"{spec}.backward", shape, runs_as))
            continue
        for kb in dict.fromkeys(w for _, w in column_blocks(K, keys)):
            for w in dict.fromkeys(w for _, w in column_blocks(V, width)):
                todo.append((f"{spec}.backward_columns",
                             forward.scan_class(H, HV, kb, w, n, io, forward.H200_SMS, scale), runs_as))
    return list(dict.fromkeys(todo))


def _blocks(classes: list, spec: str) -> list:
    """The calls as the op makes them (CompiledOp.head_blocks: a head dim past the kernels' widest
    tile as blocks of its columns, a call each), each with the whole call's scale."""
    from qla_compiler import ops

    op, out = ops._op(spec), []
    for H, HV, K, V, n, io, scale, training in classes:
        scale = K ** -0.5 if scale is None else float(scale)
        out += [(H, HV, k, v, n, io, scale, training) for k, v in dict.fromkeys(op.head_blocks(K, V))]
    return out


def precompile(todo: list, tar: str | None) -> int:
    """Compile every kernel of each item (no GPU needed), as benchmarks/precompile.py does; with
    tar, then pack the cache entries this run used (precompile.pack_used)."""
    import precompile as pc  # benchmarks/precompile.py, beside this file

    import qla_compiler
    from qla_compiler.kernels.runtime import load_kernels

    cache = Path(os.environ.get("TILELANG_CACHE_DIR", Path.home() / ".tilelang" / "cache"))
    start, programs, failed = time.time(), {}, []
    if tar:
        pc.forget_reads(cache)
    for spec, shape, runs_as in todo:
        t = time.time()
        name, _, variant = spec.partition(".")
        if name not in programs:
            programs[name] = qla_compiler.compile_spec(name)
        program = programs[name].for_shape(runs_as)
        program = {"": lambda: program, "training": lambda: program.training_program,
                   "backward": lambda: program.backward_program,
                   "backward_columns": lambda: program.backward_blocks()[2].backward_program}[variant]()
        try:
            kernels = load_kernels(program, shape)
            for k in program.kernels.kernels:
                kernels[k.name]
        except Exception as e:  # e.g. a head dim the lowering refuses: say so, go on
            failed.append(f"{spec} {shape}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            print(f"FAILED {failed[-1]}", flush=True)
            continue
        print(f"{spec} {shape}: {time.time() - t:.1f}s", flush=True)
    if tar:
        pc.pack_used(cache, start, tar)
    print(f"{len(todo) - len(failed)} of {len(todo)} compiled" + "".join(f"\n  not: {f}" for f in failed))
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=tuple(FAMILIES), default="gdn",
                    help="whose FLA tests: gdn, gla or kda (tests/ops/test_<family>.py)")
    ap.add_argument("--tests", type=Path, help="FLA's test file (default .gpu/fla_tests/test_<family>.py)")
    ap.add_argument("--op", choices=("qla", "fla", "both"), default="qla",
                    help="whose ops the tests call (both: qla, then FLA)")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression, within the selected tests")
    ap.add_argument("--collect-only", action="store_true", help="list the selected tests, run none")
    ap.add_argument("--classes", action="store_true", help="print the shape classes the tests compile, run none")
    ap.add_argument("--precompile", action="store_true", help="compile those classes here (no GPU or FLA needed)")
    ap.add_argument("--real-data", action="store_true", help="with --classes/--precompile: also "
                    "tests/test_gpu_real_data.py's classes")
    ap.add_argument("--head-dims", action="store_true", help="with --classes/--precompile: only "
                    "tests/test_gpu_real_data.py's head-dim cases (K, V up to 256, with gradients; no FLA test file needed)")
    ap.add_argument("--tar", metavar="PATH", help="with --precompile: then pack the cache entries it used")
    ap.add_argument("--shard", metavar="I/N", help="with --precompile: only every N-th item from the I-th "
                    "(N processes share the cores; then one run with --tar), as precompile.py --shard")
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to pytest as they are")
    a = ap.parse_args(argv)
    family = FAMILIES[a.family]
    tests = (a.tests or family.default_tests).resolve()
    missing = f"no FLA test file at {tests}: save FLA's tests/ops/test_{family.spec}.py there or pass --tests PATH"
    if (a.real_data or a.head_dims) and family.spec != "gdn":
        print("--real-data, --head-dims: tests/test_gpu_real_data.py's classes are GDN's (--family gdn)", file=sys.stderr)
        return 2
    if (a.classes or a.precompile) and a.head_dims:
        classes = real_data_classes(head_dims_only=True)
    elif a.classes or a.precompile:
        if not tests.is_file() and not a.real_data:
            print(missing, file=sys.stderr)
            return 2
        if not tests.is_file():
            print(f"{missing}; only tests/test_gpu_real_data.py's classes", file=sys.stderr)
        classes = (fla_classes(fla_test_params(tests, family)) if tests.is_file() else []) \
            + (real_data_classes() if a.real_data else [])
    if a.classes or a.precompile:
        todo = compile_items(classes, family.spec)
        if a.shard:
            i, n = map(int, a.shard.split("/"))
            todo = todo[i::n]
        if a.classes:
            for spec, shape, _ in todo:
                print(spec, shape)
            print(f"{len(todo)} (program, class) pairs from {len(classes)} calls")
        return precompile(todo, a.tar) if a.precompile else 0
    if not tests.is_file():
        print(missing, file=sys.stderr)
        return 2
    try:
        import fla  # noqa: F401  (after the environment above)
    except ImportError as e:
        print(f"FLA is not importable ({e}); on the GPU node: source .gpu/enter.sh", file=sys.stderr)
        return 2
    extra = list(a.pytest_args) + (["--collect-only"] if a.collect_only else [])
    ops = ["qla", "fla"] if a.op == "both" else [a.op]
    runs, codes = {}, {}
    for which in ops:
        codes[which], runs[which] = run(which, family, tests, a.keyword, extra)
    if not a.collect_only:
        summarize(runs)
    return codes[ops[0]]


if __name__ == "__main__":
    sys.exit(main())
