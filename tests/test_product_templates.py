"""The decayed products' thread mappings (passes/lower_tilelang.py: a C×C product's a thread a
row and the blocks' lower triangles; the VJP's products' every element walking its block and the
row pairs) run on the CPU as the GPU runs them: the template's generated lines executed thread by
thread with TileLang's primitives played by Python (each thread's loop up to the block barrier,
then the block-wide read), against their einsums on the diagonal blocks (Σ_k X_ik Z_jk
2^{γ_ik − γ_jk}, j ≤ i, and the VJP's sums over m ≤ i or m ≥ i). The emulator interprets the
statement, not its lowering: without this a wrong row, column, key or select in a template fails
no CPU test (session 37's slots did not)."""
import itertools
from dataclasses import replace

import numpy as np
import pytest

import qla_compiler
from qla_compiler.passes.lower_tilelang import ShapeClass, _Render
from qla_compiler.passes.schedule_build import product_slots


class _T:
    """TileLang's `T` as the templates use it, one thread at a time."""

    def __init__(self):
        self.thread = 0

    def get_thread_binding(self):
        return self.thread

    @staticmethod
    def alloc_local(shape, dtype):
        return np.full(shape, np.nan)

    serial = unroll = vectorized = staticmethod(range)

    @staticmethod
    def Parallel(*dims):
        return itertools.product(*map(range, dims))

    @staticmethod
    def cast(x, dtype):
        return int(x) if dtype == "int32" else float(x)

    @staticmethod
    def exp2(x):
        return 2.0 ** x

    @staticmethod
    def if_then_else(c, a, b):
        return a if c else b


def run_template(lines: list, threads: int, buffers: dict, consts: dict) -> None:
    """Each thread runs the lines before the template's one `T.sync_threads()`, then the lines
    after it run once (a block-wide T.Parallel): `buffers` (numpy) are updated in place."""
    cut = lines.index("T.sync_threads()")
    t = _T()
    per_thread = compile("\n".join(lines[:cut]), "<per thread>", "exec")
    for tid in range(threads):
        t.thread = tid
        exec(per_thread, {"T": t, **consts, **buffers})
    exec("\n".join(lines[cut + 1:]), {"T": t, **consts, **buffers})


def _expected(x, z, g, block):
    C = x.shape[0]
    d = g[:, None, :] - g[None, :, :]
    out = np.einsum("ik,jk,ijk->ij", x, z, 2.0 ** np.where(np.isfinite(d), d, 0.0))
    i, j = np.indices((C, C))
    return np.where((i // block == j // block) & (j <= i), out, 0.0)


def _product(spec):
    """The first kernel holding a C×C decayed product, and that statement (KDA's prep pairs q ⋆ k
    with k ⋆ k; GLA's out kernel forms q ⋆ k alone)."""
    op = qla_compiler.compile(spec, target="sm90")
    for k in op.program.kernels.kernels:
        for st in k.body:
            if st.op == "decayed_product" and "scratch" in st.attr:
                return k, st
    raise AssertionError(f"{spec}: no decayed product")


@pytest.mark.parametrize("spec", ["kda", "gla"])
@pytest.mark.parametrize("threads", [64, 128, 256])
@pytest.mark.parametrize("slots", ["rows", "triangle"])
def test_a_product_template_computes_the_decayed_product(spec, threads, slots):
    kernel, st = _product(spec)
    kernel = replace(kernel, threads=threads)
    if slots == "triangle":
        (st,) = product_slots([st], threads, triangle=True)
        assert st.attr["slots"] == "triangle"
    lines = getattr(_Render(kernel, ShapeClass(H=1, HV=1, K=64, V=64)),
                    f"_decayed_product_{slots}")(st, "T.exp2", False)
    C, K, B = 64, 64, st.attr["block"]
    rng = np.random.default_rng(threads)
    x, z = rng.standard_normal((C, K)), rng.standard_normal((C, K))
    # a decaying cumulative gate per key, one key's strong enough that exponents reach −60
    g = -np.cumsum(rng.uniform(0.0, 1.0, (C, K)), axis=0)
    g[:, 3] *= 30
    names = st.srcs[:3]
    buffers = {names[0]: x, names[1]: z, names[2]: g}
    pairs = [(st.dst, st.attr["scratch"][1])]
    if st.attr.get("second"):
        x2 = rng.standard_normal((C, K)) if st.srcs[3] != names[1] else z
        buffers[st.srcs[3]] = x2
        pairs.append((st.attr["second"][1], st.attr["second_scratch"][1]))
    for dst, scratch in pairs:
        buffers[dst] = np.full((C, C), np.nan)
        buffers[scratch] = np.full((C, B), np.nan)
    run_template(lines, threads, buffers, {"C": C, "K": K})
    want = [_expected(x, z, g, B)] + ([_expected(buffers[st.srcs[3]], z, g, B)] if len(pairs) > 1 else [])
    for (dst, _), w in zip(pairs, want):
        np.testing.assert_allclose(buffers[dst], w, rtol=1e-12, atol=1e-12, err_msg=f"{slots}: {dst}")


def test_triangle_slots_go_where_their_tiles_fit_whole_lanes():
    """Asked for, the triangle marks C×C decayed products of kernels whose threads deal each tile
    row's B/2 columns evenly (threads a multiple of C, B/2 a multiple of threads / C); elsewhere the
    statement keeps a thread a row, and unasked (QLA_TRIANGLE_SLOTS=0) it is unmarked."""
    kernel, st = _product("kda")
    assert st.attr["slots"] == "triangle"  # the default since session 40's H100 timings
    bare = product_slots([st], 128, triangle=False)[0]
    assert "slots" not in bare.attr
    assert product_slots([bare], 128, triangle=True) == product_slots([st], 128, triangle=True) == [st]
    for threads in (96, "SCAN_THREADS", 1024):  # not C's multiple; not a number; 16 lanes a tile row
        assert product_slots([st], threads, triangle=True) == [bare]
    assert "lower triangle" in str(product_slots([st], 128, triangle=True)[0])
    with pytest.raises(ValueError, match="slots 'diagonal'"):
        replace(kernel, body=[replace(s, attrs=s.attrs + (("slots", "diagonal"),)) if s == st else s
                              for s in kernel.body]).verify()


def _vjp_expected(w, y, g, block, rows):
    C = w.shape[0]
    i, m = np.indices((C, C))
    inside = (i // block == m // block) & ((m <= i) if rows else (m >= i))
    if rows:  # Σ_m W_im Y_mk 2^{γ_ik − γ_mk}
        d = g[:, None, :] - g[None, :, :]
        return np.einsum("im,mk,imk->ik", np.where(inside, w, 0.0), y, 2.0 ** np.where(inside[..., None], d, 0.0))
    d = g[None, :, :] - g[:, None, :]  # [i, m, k]: γ_mk − γ_ik
    return np.einsum("mi,mk,imk->ik", np.where(inside.T, w, 0.0), y, 2.0 ** np.where(inside[..., None], d, 0.0))


@pytest.mark.parametrize("spec", ["kda", "gla"])
@pytest.mark.parametrize("threads", [128, 256])
@pytest.mark.parametrize("slots", ["whole", "row_pairs"])
def test_a_vjp_product_template_computes_its_sums(spec, threads, slots):
    """The backward's d P ⋆_rows Z and d P ⋆_cols X, the template that walks every m of a block and
    the one whose threads take row pairs' terms alone, against their einsums."""
    op = qla_compiler.compile(spec, target="sm90")
    kernel, products = next((k, [st for st in k.body if st.op == "decayed_product"])
                            for k in op.program.backward_program.kernels.kernels
                            if any(st.op == "decayed_product" and st.attr["eq"] != "ik,jk,ijk->ij" for st in k.body))
    kernel = replace(kernel, threads=threads)
    r = _Render(kernel, ShapeClass(H=1, HV=1, K=64, V=64))
    C, B, W = 64, products[-1].attr["block"], r._width(products[-1].dst)
    rng = np.random.default_rng(threads)
    for st in (st for st in products if st.attr["eq"] != "ik,jk,ijk->ij"):
        if slots == "row_pairs":
            st = replace(st, attrs=st.attrs + (("scratch", ("buf", "sums")), ("slots", "row_pairs")))
            lines = r._decayed_product_vjp_pairs(st, "T.exp2", False)
        else:
            lines = r._decayed_product_vjp(st, "T.exp2")
        w, y = rng.standard_normal((C, C)), rng.standard_normal((C, W))
        g = -np.cumsum(rng.uniform(0.0, 1.0, (C, W)), axis=0)
        g[:, 3] *= 30
        buffers = {st.srcs[0]: w, st.srcs[1]: y, st.srcs[2]: g, st.dst: np.full((C, W), np.nan),
                   "sums": np.full((C, W), np.nan)}
        consts = {"C": C, **{name: W for name in ("K", *r.tiles.values())}}  # (a key block's constant: BK32)
        if "T.sync_threads()" in lines:
            run_template(lines, threads, buffers, consts)
        else:  # (a block-wide template: its T.Parallel loops are the whole CTA's)
            exec("\n".join(lines), {"T": _T(), **consts, **buffers})
        want = _vjp_expected(w, y, g, B, rows=st.attr["eq"] == "ij,jk,ijk->ik")
        np.testing.assert_allclose(buffers[st.dst], want, rtol=1e-12, atol=1e-12, err_msg=f"{slots}: {st}")


def test_a_block_named_as_a_tensor_of_its_kernel_fails_verification():
    """A VJP product's scratch block was first named `<product>_rows`, the name under which a
    handed-over product crosses memory: in GLA's and KDA's kernels that load it, the block shadowed
    the tensor, and TileLang failed on a 4-index store into a 2-dimensional block (session 39). The
    KernelIR now refuses one name for both."""
    from qla_compiler.ir.kernel import Buffer
    kernel, _ = _product("gla")
    tensor = kernel.params[0].name
    with pytest.raises(ValueError, match=f"{tensor} names both a tensor and a block"):
        replace(kernel, buffers=kernel.buffers + [Buffer(tensor, ("C", "C"), "float32", "shared")]).verify()


def test_with_the_triangle_glas_wide_heads_schedule():
    """With the triangle slots (the default; QLA_TRIANGLE_SLOTS=1 set for the child process all the
    same, the switch being read at import), GLA's backward at K = V = 256, whose key gradients'
    kernel loads the handed-over d q product, schedules: the scratch block named `<product>_rows`
    failed there (see the test above)."""
    import os
    import subprocess
    import sys
    child = ("import qla_compiler\n"
             "from qla_compiler.passes.lower_tilelang import ShapeClass\n"
             "p = qla_compiler.compile_spec('gla', target='sm90').backward_program\n"
             "q = p.for_shape(ShapeClass(H=2, HV=2, K=256, V=256, BV=32))\n"
             "print(sum(st.attr.get('slots') == 'row_pairs' for k in q.kernels.kernels for st in k.body))\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "QLA_TRIANGLE_SLOTS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) >= 1  # the row pairs are there
