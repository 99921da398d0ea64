"""The warm-up (qla_compiler/precompile.py): the shape classes it compiles are exactly those the
runtime's calls launch (recorded through the GPU path's host code with emulated kernels), and
`qla-compile SPEC --precompile` fills an empty cache, after which a second process compiles
nothing."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qla_compiler import ops
from qla_compiler.emulate import KernelEmulator
from qla_compiler.kernels import forward as fwd
from qla_compiler.precompile import _kernel_names, _program, parse_deployment, shape_classes
from qla_compiler.testing import random_inputs


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("spec, heads, cu, K, V", [("gdn", (1, 2), [0, 30, 100], 64, 64),
                                                  ("gdn", (2, 8), [0, 10, 20, 40, 60, 100], 64, 64),
                                                  ("gdn", (1, 2), [0, 30, 100], 256, 256),
                                                  ("gla", (1, 2), [0, 30, 100], 256, 256),
                                                  ("gla", (1, 2), [0, 30, 100], 256, 512),
                                                  ("gla", (1, 2), [0, 30, 100], 320, 64)])
def test_the_warmup_compiles_what_calls_launch(training, cp, spec, heads, cu, K, V):
    """Every (program, shape class, kernel) a call loads — the forward; with training also a
    training step's forward and backward (at K = V = 256 on column blocks of V for GDN, on blocks
    of K for GLA); with context parallelism the segment scans too; at V = 512 each of V's column
    blocks, at K = 320 each block of K, a call each — is one the warm-up of its deployment
    compiles, and the warm-up compiles nothing no call loads."""
    op = ops._op(spec)
    H, HV = heads
    a = random_inputs(op, T=100, H=H, HV=HV, K=K, V=V, cu_seqlens=cu, initial_state=True, dtype=torch.bfloat16)
    emu, launched = KernelEmulator(op, a["cu_seqlens"], K ** -0.5), set()

    def recording(program, shape):
        kernels = emu(program, shape)
        return {n: (lambda *xs, n=n, k=k: (launched.add((id(program.kernels), shape, n)), k(*xs)))
                for n, k in kernels.items()}

    # (the launch rules at the warm-up's default SM count)
    with fwd.launch_policy(kernels=recording, sms=fwd.H200_SMS):
        for grad in (False, True) if training else (False,):  # inference, and a training step
            leaves = {n: a[n].detach().requires_grad_(grad) for n in (*op.input_names, "initial_state")}
            inputs = {n: leaves[n] for n in op.input_names}
            o, final = op._run_kernels(inputs, K ** -0.5, leaves["initial_state"], a["cu_seqlens"],
                                       None if cp == 1 else cp)
            if grad:
                (o.float().sum() + final.sum()).backward()

    todo = shape_classes(spec, H=H, HV=HV, K=K, V=V, n_seqs=len(cu) - 1, context_parallel=cp, training=training,
                         state=None)  # (the chunk calls alone: the token step's class is the next test's)
    if training and K == 256 and spec == "gdn":
        assert {c.shape.V for c in todo if c.part == "backward"} >= {64} and all(
            c.columns == 64 for c in todo if c.part == "backward")
    if training and spec == "gla" and K == 256:
        # (K whole, its out kernels on blocks of K's columns; V on column blocks of 128)
        assert {(c.shape.K, c.shape.V) for c in todo if c.part == "backward" and c.kernels != "windows"} == {(256, 128)}
    warmed = {(id(_program(c).kernels), c.shape, n) for c in todo for n in _kernel_names(c)}
    assert launched == warmed


@pytest.mark.parametrize("state", [torch.float32, torch.bfloat16])
def test_the_warmup_compiles_the_token_step_decoding_calls_launch(monkeypatch, state):
    """A decoding call (op.recurrent, or a decode-shaped chunk call) launches the token step at one
    of two V-blocks, by its batch (kernels/token_step.block_v: 8 columns where 16-column blocks would
    leave SMs idle or sequences are several tokens long, else 16), reading its gates and its scalars
    each as the call passes them (float32, or bf16 beside bf16 values): the classes the warm-up of
    its deployment compiles (`state=`: the pools' dtype). The kernel gets the caller's g and β
    themselves wherever it reads them as given, and float32 copies only of the others."""
    from qla_compiler.checks import Dims
    from qla_compiler.kernels import runtime
    from qla_compiler.kernels import token_step as host

    op = ops._op("gdn")
    H, HV, K = 2, 8, 128
    launched, handed = [], []
    (kernel,) = op.program.token_step_program.kernels.kernels

    def recording(program, shape):
        launched.append((id(program.kernels), shape))
        return {k.name: (lambda *tensors: handed.append(dict(zip([p.name for p in k.params], tensors))))
                for k in program.kernels.kernels}

    monkeypatch.setattr(runtime, "load_kernels", recording)
    f32, bf16 = torch.float32, torch.bfloat16
    # 2·8 value heads' 16-column blocks leave SMs idle at 132 (8 columns), 3·8 do not (16); g and β
    # each in float32 or in the io dtype (vLLM: g in float32, β in bf16)
    for N in (2, 3):
        for g_dtype, beta_dtype in ((f32, f32), (f32, bf16), (bf16, f32), (bf16, bf16)):
            a = random_inputs(op, T=N, H=H, HV=HV, K=K, V=K, cu_seqlens=list(range(N + 1)), dtype=bf16)
            a["g"], a["beta"] = a["g"].to(g_dtype), a["beta"].to(beta_dtype)
            dims = Dims(1, N, H, HV, K, K, N)
            pool = torch.zeros(N, HV, K, K, dtype=state)
            slot_tensors = host.slots(N, dims, "cpu", pool, None, None, False, True)[:5]
            host.run(op.program.token_step_program, {n: a[n] for n in op.input_names}, op.kinds, dims, K ** -0.5,
                     op._head_logs(HV), a["cu_seqlens"], slot_tensors)
            for name, given in (("g", g_dtype), ("beta", beta_dtype)):
                got = handed[-1][name]
                assert got.dtype == given and got.data_ptr() == a[name].data_ptr() if given == bf16 else \
                    got.dtype == f32, (name, given, got.dtype)
    assert [(shape.BV, shape.gates, shape.scalars) for _, shape in launched] == \
        [(bv, g, b) for bv in (8, 16) for g, b in (("float32", "float32"), ("float32", "bfloat16"),
                                                   ("bfloat16", "float32"), ("bfloat16", "bfloat16"))]
    assert {p.dtype for p in kernel.params if p.name in ("g", "beta")} == {"gates", "scalars"}
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
    todo = [c for c in shape_classes("gdn", H=H, HV=HV, K=K, n_seqs=[1, 64], state=names[state])
            if c.part == "token_step"]
    assert sorted((c.shape.BV, c.shape.gates, c.shape.scalars) for c in todo) == \
        sorted(shape for shape in {(s.BV, s.gates, s.scalars) for _, s in launched})
    assert [(id(_program(c).kernels), c.shape) for c in todo] == launched
    assert parse_deployment("H=2,HV=8,K=128,state=bfloat16")["state"] == "bfloat16"


def test_every_number_of_sequences_by_default():
    """Without N the warm-up covers any batch: the classes of 1 … SMs + 1 sequences, past which
    the launch rules no longer change (V-block 128 where enough sequences fill the GPU at it: the
    fused forward's wide kernel, which inference calls run by default there)."""
    every = shape_classes("gdn", H=2, HV=8, K=128)
    assert {c.shape.BV for c in every if c.part != "token_step"} == {16, 32, 64, 128}
    dtypes = ("float32", "bfloat16")  # (any batch; the gates and the scalars each in either dtype)
    assert {(c.shape.BV, c.shape.gates, c.shape.scalars) for c in every if c.part == "token_step"} == \
        {(bv, g, b) for bv in (8, 16) for g in dtypes for b in dtypes}
    assert {c.fused for c in every if c.shape.BV == 128} == {"wide"}
    assert set(shape_classes("gdn", H=2, HV=8, K=128, n_seqs=list(range(1, 1000)))) == set(every)


def test_parse_deployment_names_what_is_wrong():
    assert parse_deployment("H=16,HV=64,K=128,V=128,io=bfloat16,N=8,sms=78") == dict(
        H=16, HV=64, K=128, V=128, io="bfloat16", n_seqs=[8], sms=78)
    for text, message in (("H=2,HV=8", "missing K"), ("H=2,HV=8,K=128,BV=64", "unknown field 'BV'"),
                          ("H=2,HV=8,K=x", "K must be an integer"), ("H=2,HV=8,K=64,N=1-x", "or a range"),
                          ("H=2,HV=8,K=64,io=float32", "io must be bfloat16 or float16")):
        with pytest.raises(ValueError, match=message):
            parse_deployment(text)


def test_a_deployment_the_kernels_refuse_is_named_before_any_compile():
    for kw, message in ((dict(H=2, HV=7, K=128), "multiple of the H=2"), (dict(H=1, HV=1, K=512), "K \\(the key"),
                        (dict(H=1, HV=1, K=64, context_parallel=0), "context_parallel"),
                        (dict(H=1, HV=1, K=64, io="float32"), "io: the kernels take")):
        with pytest.raises(ValueError, match=message):
            shape_classes("gdn", **kw)


def test_precompile_fills_the_cache_and_a_second_process_compiles_nothing(tmp_path, monkeypatch):
    """The CLI in two fresh processes on one empty cache: the first compiles every kernel of the
    classes, the chunk pipeline's and the token step's at both its V-blocks and gate dtypes
    (TileLang writes its cache entries; ~40 s on a CPU), the second finds them all and compiles
    none (no file of the cache changes). Then qla_compiler.warmup in this process: it too compiles nothing, and leaves
    the kernels loaded for the op's calls."""
    env = dict(os.environ, TILELANG_CACHE_DIR=str(tmp_path / "tilelang"), QLA_CACHE_DIR=str(tmp_path / "qla"),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "qla_compiler.cli", "simple_gla", "--precompile", "H=1,HV=1,K=64,N=1,cp=1"]

    def run():
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    def cache():
        return {f: f.stat().st_mtime_ns for f in Path(tmp_path).rglob("*") if f.is_file()}

    first = run()
    assert [line.split()[1] for line in first[:-1]] == ["simple_gla_prep", "simple_gla_scan", "simple_gla_out",
                                                        *["simple_gla_token_step"] * 4]
    assert all(": compiled in" in line for line in first[:-1])
    assert first[-1].startswith("7 kernels of 5 shape classes: 7 compiled, 0 found in the cache")
    files = cache()
    assert any(f.suffix == ".cubin" for f in files) and any(f.suffix == ".py" for f in files)
    second = run()
    assert all(": cached in" in line for line in second[:-1])
    assert second[-1].startswith("7 kernels of 5 shape classes: 0 compiled, 7 found in the cache")
    assert cache() == files

    import qla_compiler
    from qla_compiler.kernels.runtime import load_kernels

    monkeypatch.setenv("TILELANG_CACHE_DIR", env["TILELANG_CACHE_DIR"])
    monkeypatch.setenv("QLA_CACHE_DIR", env["QLA_CACHE_DIR"])
    lines = []
    done = qla_compiler.warmup("simple_gla", ["H=1,HV=1,K=64,N=1,cp=1"], log=lines.append)
    assert [(name, compiled) for name, _, _, compiled in done] == \
        [("simple_gla_prep", False), ("simple_gla_scan", False), ("simple_gla_out", False),
         *[("simple_gla_token_step", False)] * 4]
    assert len(lines) == 7 and cache() == files
    for c in {c for _, c, _, _ in done}:  # what the op's first call at each class finds in memory: no lowering, no load
        assert set(load_kernels(_program(c), c.shape)._compiled) == {name for name, d, *_ in done if d == c}


def test_a_fused_class_that_falls_back_says_so(monkeypatch):
    """A fused program that does not schedule falls back to the separate kernels (the runtime's
    rule); precompile says so, since a scheduling bug falls back the same way (session 16: one
    did, silently, on DeltaNet's fused prep)."""
    from qla_compiler import precompile
    from qla_compiler.kernels import runtime

    todo = [c for c in shape_classes("delta_net", H=16, HV=64, K=128, V=128, n_seqs=8) if c.fused][:1]
    assert todo, "16/64 heads × 8 sequences run the fused forward by the launch rules"
    lines = []

    class NoCompile:
        def get(self, *args, **kwargs):
            pass
    monkeypatch.setattr(runtime, "load_kernels", lambda program, shape: NoCompile())
    precompile.compile_classes(todo, log=lines.append)
    assert not any("not schedulable" in ln for ln in lines)
    monkeypatch.setattr(fwd, "fused_or_not", lambda program, wide=False: program)
    lines.clear()
    precompile.compile_classes(todo, log=lines.append)
    assert "fused forward at H=16 HV=64 K=128 V=128: not schedulable, the separate kernels instead" in lines[0]


def test_prefetched_kernels_compile_beside_each_other(tmp_path, monkeypatch):
    """Kernels.prefetch starts the compiles on threads, as many at once as the cores allow, and
    get hands each its own kernel: a first call's kernels, and the warm-up's, no longer compile
    one after another."""
    import threading
    import time

    from qla_compiler.kernels import runtime
    from qla_compiler.passes.lower_tilelang import ShapeClass

    monkeypatch.setenv("QLA_CACHE_DIR", str(tmp_path))
    program = ops._op("gdn").program
    kernels = runtime.Kernels(program, ShapeClass(H=1, HV=2, K=64, V=64))
    names = [k.name for k in program.kernels.kernels]
    running, most, lock = [0], [0], threading.Lock()

    def compile_prim(func, name, detail, path, progress=True):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        return f"compiled {name}"

    monkeypatch.setattr(runtime, "compile_prim", compile_prim)
    kernels.prefetch(names)
    assert [kernels[n] for n in names] == [f"compiled {n}" for n in names]
    cores = len(os.sched_getaffinity(0))
    assert most[0] == min(cores, len(names)), (most[0], cores)
    assert set(kernels.seconds) == set(names) and all(s >= 0.3 for s in kernels.seconds.values())
