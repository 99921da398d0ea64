"""The lowering, checked without a GPU: KernelIR shape, generated TileLang, CUDA for sm_90a.

CI has no GPU but has TileLang and nvcc, so it can lower every spec to CUDA, check that the GDN
kernels use tensor-core wgmma and TMA, and compile them with ptxas to catch register spills.
"""
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import qla_compiler
from qla_compiler.cli import main, parse_shape
from qla_compiler.errors import PassError
from qla_compiler.kernels.runtime import launch_shared_bytes, lower_to_cuda
from qla_compiler.passes.lower_tilelang import ShapeClass, lower, lower_kernel
from qla_compiler.passes.partition import partition
from qla_compiler.passes.schedule import schedule
from qla_compiler.passes.schedule_memory import HEAD_DIMS, SMEM_BUDGET, reads
from qla_compiler.passes.schedule_reductions import batched_reductions
from qla_compiler.specs import WITH_KERNELS as NAMES

SHAPE = "H=2,HV=8,K=128,V=128,BV=64,io=bfloat16,scan_warpgroups=2"  # as the runtime runs BV = 64


@pytest.fixture(scope="module")
def cuda_sources(tmp_path_factory):
    """--emit cuda for every shipped spec (lowering is the slow part: do it once)."""
    out = tmp_path_factory.mktemp("cuda")
    for name in NAMES:
        assert main([name, "--emit", "cuda", "--shape", SHAPE, "-o", str(out)]) == 0
    return {name: (out / f"{name}.cuda.cu").read_text() for name in NAMES}


def test_partition_gives_prep_scan_and_out_kernels():
    kernels = {n: [k.name for k in qla_compiler.compile_spec(n).kernels.kernels] for n in NAMES}
    for n in ("gdn", "delta_net", "simple_gla"):
        assert kernels[n] == [f"{n}_prep", f"{n}_scan", f"{n}_out"]
    for n in ("retnet", "linear_attn"):  # constant decay or none: no cumsum, no solve
        assert kernels[n] == [f"{n}_scan", f"{n}_out"]


def test_gdn_scan_keeps_only_the_state_chain():
    kir = qla_compiler.compile_spec("gdn").kernels
    text = str(kir)
    prep, scan, out = kir.kernels
    assert {p.name for p in prep.params if p.role == "out"} == {"g_cum", "W_rows", "U_rows"}
    assert "T_r = inverse A_r_s" in text
    # two matmuls per chunk on the sequential path, the state decays then accumulates in place
    gemms = [str(s) for s in scan.body if s.op == "gemm"]
    # the decay to the chunk's end scales the C×BV value side (decay_value_side), not C×K keys
    assert gemms == ["WS = W_s · state_s   (wgmma)", "state += k_sᵀ · v_new_decayed_s   (wgmma)"]
    assert scan.buffer("v_new_decayed_s").shape == ("C", "BV") and "k_decayed_s" not in str(scan)
    assert scan.buffer("state").scope == "fragment"
    assert {p.name for p in scan.params if p.role == "out"} == {"S0_chunks", "v_new_rows", "final_state"}
    # the output is parallel over chunks again, from the stored entering states
    assert {p.name for p in out.params if p.role == "in"} >= {"S0_chunks", "v_new_rows", "q", "k", "g_cum"}
    assert "QS += P_s · v_new_s   (wgmma)" in text


def test_scan_issues_each_store_as_soon_as_its_block_is_final():
    """The next chunk waits once for all of this chunk's stores to have read their blocks: each is
    issued right after its block is final (the entering state right after its copy), and nothing
    in the chunk writes a block after its store. A block only its store reads stays after the
    chain's matmuls (decay_value_side's v_new); one a matmul reads is stored before it."""
    gdn = qla_compiler.compile_spec("gdn")
    key_side = gdn.for_shape(ShapeClass(H=2, HV=8, K=128, V=128, BV=64))
    for prog in (gdn, gdn.backward_program, key_side, key_side.backward_program):
        scan = next(k for k in prog.kernels.kernels if k.kind == "scan")
        ops = [(st.op, st.dst) for st in scan.body]
        copy = ops.index(("copy", "state_s"))
        assert scan.body[copy + 1].op == "store_chunk_state"
        for i, st in enumerate(scan.body):
            if st.op in ("store", "store_chunk_state"):
                src = st.srcs[0]
                assert max(j for j, s in enumerate(scan.body) if s.dst == src) == i - 1, st
                read_later = any(src in s.srcs for s in scan.body[i + 1:])
                assert read_later or not any(s.op == "gemm" for s in scan.body[i + 1:]), st
    scan = next(k for k in key_side.kernels.kernels if k.kind == "scan")
    v_new_store = next(i for i, st in enumerate(scan.body) if st.dst == "v_new_rows")
    assert any(st.op == "gemm" and "v_new_s" in st.srcs for st in scan.body[v_new_store:])


def test_partition_prints_what_crosses_memory():
    text = str(qla_compiler.compile_spec("gdn").stage("partition"))
    assert "kernel gdn_prep (parallel over chunks)" in text and "through memory: g_cum W U" in text
    assert "kernel gdn_scan (sequential over chunks)" in text and "through memory: S0 v_new" in text


def test_every_kernel_parameter_is_an_input_a_crossing_value_or_a_schedule_tensor():
    """A kernel's parameters are the spec's inputs, the values crossing memory (named after their
    chunk-program nodes: `<node>_rows`, `<node>_chunks`, gradients `d_…`, head decays `log_…`) and
    the tensors the schedule adds (ir/kernel.SCHEDULE_TENSORS, names a spec's input cannot take),
    each once in a kernel. A spec key named `chunk_offsets` made the scan's second parameter of
    that name, and the lowering failed with an IndexError: a name outside these sets is one an
    input could collide with."""
    from qla_compiler.ir.kernel import CROSSING_SUFFIXES, SCHEDULE_TENSORS
    from qla_compiler.spec import RESERVED_PREFIXES
    seen = set()
    for name in NAMES:
        p = qla_compiler.compile_spec(name, target="sm90")
        programs = [p, p.training_program, p.token_step_program, p.windows_program]
        programs += [p.backward_program] if p.backward_unsupported is None else []
        for prog in programs:
            nodes = set(prog.chunk.graph.nodes) if prog.chunk is not None else set()
            for k in prog.kernels.kernels:
                params = [t.name for t in k.params]
                assert len(set(params)) == len(params), (name, k.name, params)
                for t in params:
                    seen.add(t)
                    assert (t in p.recurrence.input_names or t in SCHEDULE_TENSORS or t in nodes
                            or t.startswith(RESERVED_PREFIXES) or t.endswith(CROSSING_SUFFIXES)), (name, k.name, t)
    assert SCHEDULE_TENSORS <= seen, SCHEDULE_TENSORS - seen


def test_the_kernels_say_which_walks_the_chunks_and_which_tensors_hold_the_results():
    """The runtime finds the scan (KernelIR.scan: the one kernel walking chunks) and each output
    role's tensor (Tensor.result, KernelIR.results) from fields, not from "the first kernel with a
    loop" or a tensor named after the role; a program with two scans fails verification."""
    p = qla_compiler.compile_spec("gdn", target="sm90")
    kir = p.kernels
    assert [k.kind for k in kir.kernels] == ["prep", "scan", "out"] and kir.scan == 1
    assert kir.results() == {"o": "o"}
    grads = p.backward_program.kernels.results()
    assert set(grads) == set(p.backward_program.chunk.gradient_of) and all(grads.values())
    assert p.token_step_program.kernels.scan is None
    scan = kir.kernels[kir.scan]
    with pytest.raises(ValueError, match="each walk a sequence's chunks"):
        dataclasses.replace(kir, kernels=[*kir.kernels, dataclasses.replace(scan, name="second")]).verify()


def test_generated_tilelang_is_readable(capsys):
    assert main(["gdn", "--emit", "tilelang", "--shape", SHAPE]) == 0
    src = capsys.readouterr().out
    compile(src, "gdn_kernels.py", "exec")  # valid Python
    for needle in ("def gdn_prep(", "def gdn_scan(", "def gdn_out(", "state = T.alloc_fragment((K, BV)",
                   "unit_lower_inverse(A_r_s, T_r,", "for i_c in T.Pipelined(", "T.gemm(W_s, state_s, WS",
                   "i_slot = chunk_offsets[i_n] + i_c"):
        assert needle in src, needle
    assert not re.search(r"\bbuf_\d+", src)


@pytest.mark.parametrize("name", NAMES)
def test_emit_cuda_uses_wgmma(cuda_sources, name):
    """Every product is a wgmma but the triangular inverse's last merge: two 32×32 tf32 products
    (kernels/tri_inverse.py), which wgmma's 64-row tiles do not fit, on mma.sync."""
    src = cuda_sources[name]
    assert "tl::wgmma_ss<" in src
    kernels = dict(re.findall(r'extern "C" __global__ void __launch_bounds__\([^)]*\) (\w+)\((.*?)(?=extern "C"|\Z)',
                              src, re.S))
    assert kernels, "no kernel found in the CUDA source"
    with_inverse = {k for k, body in kernels.items() if "mma_sync" in body}
    expected = {f"{name}_prep_kernel"} if name in ("gdn", "delta_net", "kda") else set()
    assert with_inverse == expected  # no fallback to the sm80 tensor-core path anywhere else
    for k in with_inverse:
        calls = re.findall(r"tl::mma_sync<([^>]*)>", kernels[k])
        assert calls and all(c.startswith("tl::DataType::kTensorFloat32, tl::DataType::kTensorFloat32") for c in calls)


def test_gdn_scan_uses_tma_and_warp_specialisation(cuda_sources):
    scan = cuda_sources["gdn"].split("kernel gdn_scan")[1]
    assert "tl::tma_load(" in scan
    assert re.search(r"__launch_bounds__\(512, 1\)", scan)  # two consumer warpgroups, and as many producer threads
    assert "mbarrier" in scan


def _split_phase_loads_complete(src: str) -> int:
    """Every split-phase load's barrier gets an arrival with the bytes to expect (else it never
    completes and the wait hangs the kernel) and is waited on. Returns how many there are."""
    n = 0
    for kernel in src.split('extern "C" __global__')[1:]:
        for bar in set(re.findall(r"(\w+_bar)\[0\]\.init\(1\)", kernel)):
            assert f"{bar}[0].arrive_and_expect_tx(" in kernel, f"{bar}: no arrival, the wait would hang"
            assert f"{bar}[0].wait(0)" in kernel
            n += 1
    return n


def test_split_phase_loads_arrive_on_their_barriers():
    """GDN's forward and backward with split-phase loads, in CUDA: every load's barrier gets its
    arrival and its wait, and an issue after the first wait comes after a block barrier."""
    prog = qla_compiler.compile_spec("gdn")
    shape = ShapeClass(H=2, HV=8, K=128, V=128, BV=64)
    for p, at_least in ((prog, 6), (prog.backward_program, 10)):
        kir = schedule(p.stage("partition"), split_phase_loads=True)
        src = "\n".join(lower_to_cuda(dataclasses.replace(p, kernels=kir), shape).values())
        assert _split_phase_loads_complete(src) >= at_least
        for kernel in src.split('extern "C" __global__')[1:]:
            for m in re.finditer(r"\w+_bar\[0\]\.arrive_and_expect_tx\(", kernel):
                before = kernel[:m.start()]
                if ".wait(0)" in before:  # after work: a barrier since the last wgmma or wait
                    last = max(before.rfind(".wait(0)"), before.rfind("warpgroup_wait"))
                    assert "__syncthreads()" in before[last:], kernel[m.start() - 300:m.start()]


def _role_registers(cuda: str) -> list:
    """The register budget each role of a warp-specialised kernel sets (setmaxnreg), in the order
    of the roles in its CUDA."""
    return [int(n) for n in re.findall(r"warpgroup_reg_(?:alloc|dealloc)<(\d+)>", cuda)]


def _roles_compile_without_spills(cuda: str, tmp_path, budgets: list) -> None:
    """A warp-specialised kernel's CUDA sets these setmaxnreg budgets and compiles with no spills."""
    assert _role_registers(cuda) == budgets
    spills = _ptxas_spills(cuda, tmp_path)
    assert spills and all(s == ("0", "0") for s in spills), spills


def _ptxas_spills(source: str, tmp_path) -> list:
    """(spill stores, spill loads) of every kernel in a CUDA source, compiled for sm_90a."""
    return re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", _ptxas_report(source, tmp_path))


def _ptxas_report(source: str, tmp_path) -> str:
    """ptxas -v's report on a CUDA source compiled for sm_90a."""
    import tilelang

    root = Path(tilelang.__file__).parent
    cu = tmp_path / "kernels.cu"
    cu.write_text(source)
    r = subprocess.run(["nvcc", "-std=c++20", "-O3", "-w", "-gencode=arch=compute_90a,code=sm_90a", "-cubin",
                        "-Xptxas", "-v", f"-I{root / 'src'}", f"-I{root / '3rdparty' / 'cutlass' / 'include'}",
                        str(cu), "-o", str(tmp_path / "kernels.cubin")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
def test_gdn_cuda_compiles_for_sm90a_without_spills(cuda_sources, tmp_path):
    spills = _ptxas_spills(cuda_sources["gdn"], tmp_path)
    assert len(spills) >= 2 and all(s == ("0", "0") for s in spills), spills


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
def test_gdn_forward_at_head_dims_256_compiles_without_spills(tmp_path):
    """K = V = 256, the kernels scheduled for those tiles, at the V-block the runtime picks (32:
    at 64 the scan's state spilled on two warpgroups)."""
    from qla_compiler.kernels.forward import scan_class

    shape = scan_class(16, 64, 256, 256, 1, "bfloat16", 132)
    program = qla_compiler.compile_spec("gdn").for_shape(shape)
    spills = _ptxas_spills("\n".join(lower_to_cuda(program, shape).values()), tmp_path)
    assert len(spills) == 3 and all(s == ("0", "0") for s in spills), spills


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
def test_gdn_backward_compiles_for_sm90a_without_spills(tmp_path):
    """The backward's kernels at K = V = 128 (the out kernel on two warpgroups: d q's product now
    keeps its float32 fragment until Γ·scale is applied, scale_after_product)."""
    program = qla_compiler.compile_spec("gdn").backward_program
    shape = ShapeClass(H=2, HV=8, K=128, V=128, BV=32)
    spills = _ptxas_spills("\n".join(lower_to_cuda(program, shape).values()), tmp_path)
    assert len(spills) >= 3 and all(s == ("0", "0") for s in spills), spills


def test_shape_option_is_checked():
    with pytest.raises(ValueError, match="HV=3 is not a multiple of H=2"):
        parse_shape("H=2,HV=3,K=128,V=128")
    with pytest.raises(ValueError, match="unknown field 'D'"):
        parse_shape("D=4")


def test_shape_option_needs_supported_sizes():
    with pytest.raises(ValueError, match="missing H, HV"):
        parse_shape("K=128,V=128")
    with pytest.raises(ValueError, match="K = 300 is not supported by the sm90 kernels: they take 16 to"):
        parse_shape("H=1,HV=1,K=300,V=128")
    with pytest.raises(ValueError, match="V = 8 is not supported"):
        parse_shape("H=1,HV=1,K=128,V=8")
    assert parse_shape("H=1,HV=1,K=100,V=64").padded == {"K": "KP"}  # tiles of 128 and 64
    with pytest.raises(ValueError, match="BV=48: the V-block must be 8 .the token step.s., 16, 32, 64 or 128"):
        parse_shape("H=1,HV=1,K=128,V=128,BV=48")


def test_lowering_refuses_other_chunk_sizes(capsys):
    assert main(["gdn", "--chunk-size", "16", "--emit", "tilelang"]) == 1
    assert "built for chunks of 64 tokens, not 16" in capsys.readouterr().err


def test_print_after_all_still_emits_what_was_asked(capsys):
    assert main(["linear_attn", "--print-after-all", "--emit", "kernel"]) == 0
    out = capsys.readouterr().out
    assert "// ----- after schedule -----" in out and out.rstrip().endswith(
        str(qla_compiler.compile_spec("linear_attn").kernels).rstrip())


# ---- the backward program's kernels ------------------------------------------------------------

def test_backward_program_has_a_reverse_scan_and_per_output_kernels():
    prog = qla_compiler.compile_spec("gdn").backward_program
    kinds = [k.kind for k in prog.kernels.kernels]
    assert kinds[:2] == ["prep", "scan"] and set(kinds[2:]) == {"out"}
    scan = prog.kernels.kernels[1]
    assert scan.reverse and "last to first" in str(scan)
    # the chain: dv_new = (loaded) + diag(decay)·(K·dS), dS ← Γ_C dS − Wᵀ dv_new + Qᵀ(Γ ⊙ dO), the
    # last product split in two (Γ ⊙ dO = hi + lo, both bf16): q is exact, so the split keeps 16 bits
    gemms = [(s.dst, s.srcs) for s in scan.body if s.op == "gemm"]
    assert [d for d, _ in gemms] == ["d_v_new_S_update_undecayed", "state", "state", "state"]
    assert gemms[0][1] == ("k_s", "state_s")  # the decay scales the C×BV product (decay_value_side)
    assert gemms[2][1] == ("q_s", "d_QS_s") and gemms[3][1] == ("q_s", "d_QS_lo_s")
    # every gradient from one kernel: they share most of their loads and matmuls, and the blocks
    # live at once fit in shared memory
    outs = [k for k in prog.kernels.kernels if k.kind == "out"]
    assert [sorted(k.outputs) for k in outs] == [sorted(["d_q", "d_k", "d_v", "d_g", "d_beta"])]
    assert {p.name for p in outs[0].params if p.role == "out"} == set(outs[0].outputs)
    # the block gradients leave in the io dtype the op returns, as whole rows staged in shared
    # memory (no float32 tensor, no cast on the host; the keys' per-value-head ones are summed
    # over their group in float32 there, as FLA sums its bf16 d q, d k); per-token ones float32
    dtypes = {p.name: p.dtype for p in outs[0].params if p.role == "out"}
    assert dtypes["d_v"] == dtypes["d_k"] == dtypes["d_q"] == "io" and dtypes["d_g"] == "float32"
    assert [s.srcs for s in outs[0].body if s.op == "store" and s.dst in ("d_q", "d_k", "d_v")] == [
        ("d_q_s",), ("d_k_s",), ("d_v_s",)]


def test_backward_kernels_load_what_the_training_forward_stored():
    """The training forward's prep also stores T_r; the backward's kernels load it, v_new and the
    cumulative gates instead of recomputing them: no inverse left in the backward. W = T·diag(βΓ)K,
    one matmul on T_r, the backward prep recomputes: a training step keeps no W (issue 16's
    memory: a C×K block per token, 512 MiB per layer at 16/64 heads × 32768 tokens). The
    inference forward stores no T_r."""
    from qla_compiler.kernels.backward import kept

    prog = qla_compiler.compile_spec("gdn")
    made = {p.name for k in prog.training_program.kernels.kernels for p in k.params if p.role == "out"}
    assert "T_r_rows" in made and "W_rows" in made
    assert "T_r_rows" not in {p.name for k in prog.kernels.kernels for p in k.params}
    bks = prog.backward_program.kernels.kernels
    reads = {p.name for k in bks for p in k.params if p.role == "in"}
    assert {"T_r_rows", "v_new_rows", "g_cum"} <= reads & made
    assert {p.name for k in bks for p in k.params if p.role == "out"} & made == {"final_state", "W_rows"}
    assert "W_rows" not in kept(prog) and {"T_r_rows", "S0_chunks", "v_new_rows", "g_cum"} <= set(kept(prog))
    assert not [s for k in bks for s in k.body if s.op == "inverse" or (s.op == "cumsum" and not s.attr.get("reverse"))]
    # the prep's products: QKᵀ, W and the intra-chunk dv_new (the out kernel forms dP and its two
    # products with k and q from blocks it loads: partition.RECOMPUTE_ON_LOADED)
    assert len([s for s in bks[0].body if s.op == "gemm"]) == 3
    # a spec without an inverse trains with its own forward
    simple = qla_compiler.compile_spec("simple_gla")
    assert simple.training_program is simple


def test_provided_values_are_loaded_and_must_be_state_free():
    """partition's `provided`: a value another program stored is loaded, not recomputed, and
    only a state-free value can be (one that depends on the carried state cannot exist ahead)."""
    from qla_compiler.errors import PassError

    back = qla_compiler.compile_spec("gdn").backward
    plain, given = partition(back), partition(back, provided=["T_r"])
    assert "T_r" in plain.crossing and "T_r" not in given.crossing and given.provided == ("T_r",)
    assert "A_r" in plain.prep and "A_r" not in given.prep  # what the inverse is of: not built
    with pytest.raises(PassError, match="state-free"):
        partition(back, provided=["d_v_new"])


def test_a_kernel_takes_a_second_warpgroup_only_for_its_registers(capsys):
    """GDN's backward out kernel keeps ~176 KB of fragments live at once, more than one
    warpgroup's registers hold (it spilled): it runs on 256 threads. The backward prep, which
    recomputes W, stores it through a block nothing reads afterwards and stays on one. The
    forward scan's consumer warpgroups come from the shape class
    (SCAN_THREADS); every other kernel runs on 128."""
    prog = qla_compiler.compile_spec("gdn")
    threads = {k.name: k.threads for k in prog.kernels.kernels + prog.backward_program.kernels.kernels}
    assert threads.pop("gdn_backward_out") == 256 and threads.pop("gdn_scan") == "SCAN_THREADS"
    prep = prog.backward_program.kernels.kernels[0].body
    at = next(i for i, s in enumerate(prep) if s.op == "store" and s.dst == "W_rows")
    assert prep[at - 1].op == "copy" and prep[at - 1].srcs == ("W",) and prep[at].srcs == (prep[at - 1].dst,)
    assert set(threads.values()) == {128}
    assert main(["gdn", "--emit", "tilelang", "--backward", "--shape", SHAPE]) == 0
    assert "with T.Kernel(CH, HV, threads=256)" in capsys.readouterr().out


@pytest.mark.parametrize("warpgroups", [1, 2])
def test_forward_scan_takes_its_consumer_warpgroups_from_the_shape_class(warpgroups):
    prog = qla_compiler.compile_spec("gdn")
    src = lower(prog.kernels, ShapeClass(H=2, HV=8, K=128, V=128, BV=32, scan_warpgroups=warpgroups))
    assert f"SCAN_THREADS = {128 * warpgroups}" in src
    assert "with T.Kernel(V // BV, HV, N, threads=SCAN_THREADS)" in src
    back = lower(prog.backward_program.kernels, ShapeClass(H=2, HV=8, K=128, V=128, BV=32, scan_warpgroups=2))
    assert "with T.Kernel(V // BV, HV, N, threads=128)" in back  # the backward scan keeps one


def test_two_scan_warpgroups_need_a_v_block_of_32():
    with pytest.raises(ValueError, match="scan_warpgroups=2 at BV=16: one warpgroup, or two where BV ≥ 32"):
        ShapeClass(H=2, HV=8, K=128, V=128, BV=16, scan_warpgroups=2)
    with pytest.raises(ValueError, match="--shape: scan_warpgroups=3 at BV=64"):
        parse_shape("H=2,HV=8,K=128,V=128,BV=64,scan_warpgroups=3")


def test_out_kernels_split_by_live_shared_memory(monkeypatch):
    """Under a smaller shared-memory budget the gradients split into groups, each kernel computing
    only what its outputs need and staying under the budget at its peak of live blocks (not the
    sum of its blocks, which reuse each other's memory)."""
    import qla_compiler.passes.schedule_memory as memory
    import qla_compiler.passes.schedule_out as out

    part = partition(qla_compiler.compile_spec("gdn").backward)
    whole = [k for k in schedule(part).kernels if k.kind == "out"][0]
    dims = memory.dim_sizes()
    assert memory.smem_bytes(whole.buffers, dims) > memory.SMEM_BUDGET  # the sum alone would have split it
    monkeypatch.setattr(out, "SMEM_BUDGET", 120 * 1024)
    monkeypatch.setattr(memory, "SMEM_BUDGET", 120 * 1024)  # (what early loads may fill: _room)
    outs = [k for k in schedule(part).kernels if k.kind == "out"]
    assert len(outs) > 1
    assert sorted(r for k in outs for r in k.outputs) == sorted(whole.outputs)
    for k in outs:
        assert {p.result for p in k.params if p.role == "out"} == set(k.outputs)
        assert max(memory.live_shared({b.name: b for b in k.buffers}, k.body, dims)) <= 120 * 1024 or len(k.outputs) == 1
        assert len(k.body) < len(whole.body)


@pytest.mark.parametrize("name", NAMES)
def test_backward_tilelang_is_valid_python(name, capsys):
    assert main([name, "--emit", "tilelang", "--backward", "--shape", SHAPE]) == 0
    src = capsys.readouterr().out
    compile(src, f"{name}_backward.py", "exec")
    assert "i_c = T.ceildiv(seq_len, C) - 1 - i_r" in src  # the scan runs backwards
    assert not re.search(r"\w\.\w+_s\b", src.split('"""')[-1].replace("T.", ""))  # no dotted names


def test_backward_lowers_to_cuda_with_reductions(tmp_path):
    """simple GLA's backward has every new statement: row, column and full sums, a reverse cumsum."""
    assert main(["simple_gla", "--emit", "cuda", "--backward", "--shape", SHAPE, "-o", str(tmp_path)]) == 0
    src = (tmp_path / "simple_gla.backward.cuda.cu").read_text()
    assert "tl::wgmma_ss<" in src and "tl::AllReduce<tl::SumOp" in src


def test_vector_cumsums_scan_by_warp_shuffles(capsys):
    """GDN's chunk-local cumsum (its prep) and the backward's suffix sum of d g: five shuffle steps
    in each of two warps, the second warp adding the first's total; a suffix sum scans from the
    end (thread t holds element C − 1 − t). No fragment of running sums is declared for them."""
    for backward, src, dst in ((False, "g_floored_s", "g_cum_s"), (True, "d_g_cum_s", "d_g_floored_s")):
        assert main(["gdn", "--emit", "tilelang", "--shape", SHAPE] + (["--backward"] if backward else [])) == 0
        out = capsys.readouterr().out
        at = "C - 1 - " if backward else ""
        assert f"{dst}_run[0] = T.if_then_else(i_t < C, {src}[{at}i_t % C], 0.0)" in out
        assert [int(d) for d in re.findall(rf"{dst}_run_up = T.shfl_sync\({dst}_run\[0\], i_t % 32 - (\d+)\)", out)] \
            == [1, 2, 4, 8, 16]
        assert f"{dst}[{at}i_t] = {dst}_run[0] + {dst}[{at}31]" in out
        assert f"{dst}_acc" not in out


def _vector_copy(k, st) -> bool:
    """A per-token vector copied into a register fragment right before the 2-D pass that reads it
    (passes/schedule_vectors.py): part of that pass, not work between a load and its reader."""
    buf = next((b for b in k.buffers if b.name == st.dst), None)
    return st.op == "ewise" and buf is not None and buf.scope == "fragment" and len(buf.shape) == 1


def _scheduled(prog, split_phase: bool, head_dims: tuple = HEAD_DIMS):
    """The kernels of the program and of its backward (where it has them: not yet a per-key
    gate's), with or without split-phase loads (the default is schedule.SPLIT_PHASE_LOADS), at
    head-dim tiles `head_dims`."""
    progs = (prog,) if prog.backward_unsupported() else (prog, prog.backward_program)
    return [schedule(p.stage("partition"), split_phase_loads=split_phase, head_dims=head_dims) for p in progs]


@pytest.mark.parametrize("name", NAMES)
def test_parallel_kernels_load_each_block_right_before_its_first_reader(name):
    """Without split-phase loads a block's load is synchronous: loaded first, every block would be
    alive in the whole kernel and none could share memory, and loading early would hide nothing."""
    prog = qla_compiler.compile_spec(name)
    kirs = _scheduled(prog, split_phase=False)
    for k in (k for kir in kirs for k in kir.kernels):
        if k.loop:
            continue
        body = k.body
        assert not any(st.op == "wait_load" or st.attr.get("async") for st in body)
        for i, st in enumerate(body):
            if st.op != "load":
                continue
            first = next(j for j in range(i + 1, len(body)) if st.dst in reads(body[j]) | {body[j].dst})
            assert all(body[j].op in ("load", "load_vec", "load_chunk_state") or _vector_copy(k, body[j])
                       for j in range(i + 1, first)), \
                f"{k.name}: {st} is loaded before it is needed"
            assert not any(st.dst in reads(body[j]) | {body[j].dst} for j in range(i)), \
                f"{k.name}: {st.dst} used before its load"
    prep = kirs[0].kernels[0]
    if name == "gdn":  # v is needed only after the inverse: its block does not exist during it
        order = [(s.op, s.dst) for s in prep.body]
        assert order.index(("load", "v_s")) > next(i for i, (op, _) in enumerate(order) if op == "inverse")


@pytest.mark.parametrize("name", NAMES)
def test_split_phase_loads_issue_early_and_wait_right_before_the_reader(name):
    """With split-phase loads a block's TMA load is issued, then waited for right before its
    first reader (its padding rows zeroed after the wait), so its latency overlaps the work in
    between; nothing touches the block between the issue and the wait; an issue after other work
    has a barrier first (its memory may be an earlier block's). Vectors (through registers) come
    first, after the issues of blocks needed at once. A state converted on its way in is the
    exception: a synchronous copy right before its reader."""
    prog = qla_compiler.compile_spec(name)
    for kir in _scheduled(prog, split_phase=True):
        for k in kir.kernels:
            if k.loop:
                continue
            body = k.body
            head = [st for st in body if not st.attr.get("async")]
            n_vec = sum(st.op == "load_vec" for st in body)
            assert all(st.op == "load_vec" for st in head[:n_vec]), f"{k.name}: vectors are not loaded first"
            for i, st in enumerate(body):
                if st.op not in ("load", "load_chunk_state"):
                    continue
                if st.attr.get("cast"):  # (a float32 state converted on its way in: TMA converts nothing)
                    assert not st.attr.get("async") and st.op == "load_chunk_state", f"{k.name}: {st}"
                    continue
                assert st.attr.get("async"), f"{k.name}: {st} is synchronous"
                assert bool(st.attr.get("sync")) == any(not x.attr.get("async") for x in body[:i]), \
                    f"{k.name}: {st} has no barrier before it"
                wait = next(j for j in range(i + 1, len(body)) if body[j].op == "wait_load" and body[j].dst == st.dst)
                assert not any(st.dst in reads(body[j]) | {body[j].dst} for j in list(range(i)) + list(range(i + 1, wait))), \
                    f"{k.name}: {st.dst} is touched between its issue and its wait"
                after = wait + 1
                if st.op == "load":
                    assert body[after].op == "zero_pad" and body[after].attr["only_partial"], f"{k.name}: {st.dst} not padded"
                    after += 1
                readers = [j for j in range(after, len(body)) if st.dst in reads(body[j]) | {body[j].dst}]
                assert readers and all(body[j].op in ("wait_load", "zero_pad") or body[j].op.startswith("load")
                                       or _vector_copy(k, body[j])
                                       for j in range(after, readers[0])), f"{k.name}: {st.dst} waited for too early"
        if name == "gdn" and kir.kernels[0].name == "gdn_prep":
            order = [(s.op, s.dst) for s in kir.kernels[0].body]
            assert order.index(("load", "v_s")) > next(i for i, (op, _) in enumerate(order) if op == "inverse")
            assert order.index(("load", "k_s")) < order.index(("cumsum", "g_cum_s")), "k's load overlaps nothing"


def _work_before_issues(k) -> dict:
    """{block: the statements other than async issues before its load is issued} of a kernel."""
    body, done = k.body, {}
    for i, st in enumerate(k.body):
        if st.op in ("load", "load_chunk_state") and st.attr.get("async"):
            done[st.dst] = sum(not x.attr.get("async") for x in body[:i])
    return done


@pytest.mark.parametrize("tiles", [(128, 128), (256, 256)])
def test_blocks_are_issued_as_early_as_the_ctas_an_sm_leave_room_for(monkeypatch, tiles):
    """schedule_memory._room: a parallel kernel's blocks are issued as early as the shared memory
    its CTAs an SM leave each allows, not only under its own peak. Every block is issued no later
    than under its peak alone, and no kernel of any spec takes so much more (as live or as placed)
    that an SM holds fewer of its CTAs. GDN's backward out kernel (178 KB, one CTA an SM) issues
    d o at the start, where under its peak it waited for it right before its reader."""
    from qla_compiler.passes import schedule_memory
    from qla_compiler.passes.schedule_memory import CTA_RESERVED, SM_SHARED

    monkeypatch.setattr(schedule_memory, "LOAD_LOOKAHEAD", 0)

    def kernels(room):
        monkeypatch.setattr(schedule_memory, "LOAD_ROOM", room)
        out = {}
        for name in NAMES:
            try:
                kirs = _scheduled(qla_compiler.compile_spec(name), True, tiles)
            except PassError as err:  # (KDA's scan at K = V = 256: the pipeline takes blocks)
                out[name] = str(err)
                continue
            out.update({k.name: k for kir in kirs for k in kir.kernels if not k.loop})
        return out

    def ctas(k):
        return SM_SHARED // (max(k.shared_peak, k.shared_packed) + CTA_RESERVED)

    tight, roomy = kernels(False), kernels(True)
    assert tight.keys() == roomy.keys()
    moved = []
    for name, k in roomy.items():
        if isinstance(k, str):
            assert k == tight[name]
            continue
        assert ctas(k) == ctas(tight[name]), f"{name}: {ctas(tight[name])} CTAs an SM under its peak, {ctas(k)} so"
        early, late = _work_before_issues(k), _work_before_issues(tight[name])
        assert early.keys() == late.keys() and all(early[x] <= late[x] for x in early), f"{name}: {early} {late}"
        moved += [name] if early != late else []
    if tiles == (128, 128):
        assert "gdn_backward_out" in moved
        out = roomy["gdn_backward_out"]
        assert _work_before_issues(out)["d_o_s"] == 0 < _work_before_issues(tight["gdn_backward_out"])["d_o_s"]
        assert tight["gdn_backward_out"].shared_peak < out.shared_peak <= SMEM_BUDGET


@pytest.mark.parametrize("lookahead", [1, 3])
def test_blocks_issued_a_few_ahead_of_their_readers(monkeypatch, lookahead):
    """schedule_memory.LOAD_LOOKAHEAD: when a reader waits for a block, at most `lookahead` more
    blocks have been issued and not yet waited for; no block is issued earlier than by default
    (so no kernel takes more shared memory), and the first `lookahead` blocks in need order are
    issued where the default issues them; an issue without a barrier before it comes before the
    end of every shared block's life and before the inverse (whose scratch TileLang allocates
    too): no memory it could be given is still being read. GDN's
    backward out kernel then issues its last blocks after work it issued them before."""
    from qla_compiler.passes import schedule_memory
    from qla_compiler.passes.schedule_memory import _lifetimes

    def kernels(n):
        monkeypatch.setattr(schedule_memory, "LOAD_LOOKAHEAD", n)
        return {k.name: k for name in NAMES for kir in _scheduled(qla_compiler.compile_spec(name), True)
                for k in kir.kernels if not k.loop}

    default, ahead = kernels(0), kernels(lookahead)
    assert default.keys() == ahead.keys()
    for name, k in ahead.items():
        in_flight = set()
        lives = _lifetimes({b.name: b for b in k.buffers}, k.body, "shared")
        for i, st in enumerate(k.body):
            if st.op in ("load", "load_chunk_state") and st.attr.get("async"):
                in_flight.add(st.dst)
                assert st.attr.get("sync") or (all(last >= i for _, last in lives.values())
                                               and not any(x.op == "inverse" for x in k.body[:i])), \
                    f"{name}: {st} unguarded"
            elif st.op == "wait_load":
                assert len(in_flight - {st.dst}) <= lookahead, f"{name}: {sorted(in_flight)} in flight at {st}"
                in_flight.discard(st.dst)
        early, late = _work_before_issues(default[name]), _work_before_issues(k)
        assert early.keys() == late.keys() and all(early[x] <= late[x] for x in early), f"{name}: {early} {late}"
        first = [st.dst for st in k.body if st.op == "wait_load"][:lookahead]
        assert all(early[x] == late[x] for x in first), f"{name}: {first} moved"
        assert k.shared_peak <= default[name].shared_peak
    out = "gdn_backward_out"
    assert _work_before_issues(ahead[out])["d_o_s"] > _work_before_issues(default[out])["d_o_s"] == 0


def test_gdn_backward_out_kernel_with_early_blocks_fits_a_cta():
    """What TileLang asks at launch for GDN's backward out kernel, its blocks issued early: more
    than under its peak alone, within what one CTA may take."""
    from qla_compiler.passes.schedule_memory import CTA_SHARED_MAX

    backward = qla_compiler.compile_spec("gdn").backward_program
    out = next(k for k in backward.kernels.kernels if k.name == "gdn_backward_out")
    program = dataclasses.replace(backward, kernels=dataclasses.replace(backward.kernels, kernels=[out]))
    asked = launch_shared_bytes(program, ShapeClass(H=2, HV=8, K=128, V=128, BV=64))["gdn_backward_out"]
    assert 180 * 1024 < asked <= CTA_SHARED_MAX, asked


def test_scan_waits_for_its_stores_only_before_reusing_their_blocks():
    """The scan's TMA stores (the entering state, v_new) are only issued in the chunk's body; the
    wait for their shared sources comes at the top of the next chunk (and once after the loop),
    not after each store on the sequential path."""
    prog = qla_compiler.compile_spec("gdn")
    src = lower(prog.kernels, ShapeClass(H=1, HV=2, K=128, V=128, BV=64))
    scan = src[src.index("def gdn_scan("):src.index("def gdn_out(")]
    loop = scan[scan.index("T.Pipelined"):]
    assert loop.count("T.tma_copy(") == 2 and "T.copy(state_s" not in loop
    body_lines = loop.splitlines()
    assert body_lines[4].strip().startswith("T.tma_store_wait()")  # after the loop, t0, n_valid, i_slot
    assert "T.tma_store_wait()" in scan[scan.rindex("T.tma_copy("):scan.index("final_state[i_n")]


@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("gla", "kda")])
def test_only_the_backward_chain_splits_its_products(name):
    """The hi/lo split (two wgmmas) is for the backward's state chain, where it set d_S0's error;
    the forward scans keep one product per term. (A per-key gate's chain products, e.g. GLA's
    (Q ⊙ Γ)ᵀ (scale · d O), have no operand exact in bf16 to pair the split with:
    schedule_build.low_part.)"""
    prog = qla_compiler.compile_spec(name)
    fwd_scan = next(k for k in prog.kernels.kernels if k.loop)
    bwd_scan = next(k for k in prog.backward_program.kernels.kernels if k.loop)
    assert not any(b.name.endswith("_lo_s") for b in fwd_scan.buffers)
    assert any(b.name.endswith("_lo_s") for b in bwd_scan.buffers)


def test_prep_stores_its_wgmma_copies():
    """DeltaNet's inverse T was rounded to bf16 in shared memory for the prep's own wgmmas (W, U):
    the training prep stores that copy (no float32 fragment kept alive to the end for it)."""
    prep = qla_compiler.compile_spec("delta_net").training_program.kernels.kernels[0]
    stores = {s.dst: s.srcs[0] for s in prep.body if s.op == "store"}
    assert stores["T_rows"] == "T_s"
    copies = [i for i, s in enumerate(prep.body) if s.op == "copy" and s.dst == "T_s"]
    reads = [i for i, s in enumerate(prep.body) if s.op == "gemm" and s.srcs[0] == "T_s"]
    assert len(copies) == 1 and len(reads) == 2 and copies[0] < reads[0]


def test_the_solve_only_prep_stores_T_as_whole_rows_from_a_padded_inverse():
    """The fused forward's prep: T = T_r ⊙ R is written straight into an io shared block and
    leaves as a bulk copy of whole rows (from registers it went out as 2-byte stores); the
    inverse's input block is padded so that one column of different rows falls in different
    banks, and the padding shows in the KernelIR and in the allocation."""
    prog = qla_compiler.compile_spec("gdn")
    prep = prog.fused_program.kernels.kernels[0]
    stores = {s.dst: s.srcs[0] for s in prep.body if s.op == "store"}
    block = prep.buffer(stores["T_rows"])
    assert (block.scope, block.dtype, block.shape) == ("shared", "io", ("C", "C"))
    assert prep.buffer("A_r_s").row_pad == 4 and "rows padded by 4" in str(prep)
    src = lower(prog.fused_program.kernels, ShapeClass(H=2, HV=8, K=128, V=128, BV=16))
    assert "A_r_s = T.alloc_shared((C, C + 4), \"float32\")" in src
    assert "T_r_T_s" not in src  # T is built in A's place (kernels/tri_inverse.py)
    assert f"T.copy({stores['T_rows']}, T_rows[0, t0:t0 + C, i_hv, 0:C])" in src


def test_the_solve_only_prep_asks_for_the_ctas_its_shared_memory_allows():
    """Without a second C×C float32 block for T the prep's shared memory at its peak is ~34 KB:
    6 CTAs fit an H200 SM, and the registers of 80 a thread (its 32 of live fragments and the
    overhead) allow 6. The KernelIR says so, and the lowering asks ptxas for it (launch bounds)."""
    prep = qla_compiler.compile_spec("gdn").fused_program.kernels.kernels[0]
    assert 32 * 1024 < prep.shared_peak < 36 * 1024 and prep.ctas_per_sm == 6
    assert "6 CTAs an SM" in str(prep).splitlines()[0]
    src = lower(qla_compiler.compile_spec("gdn").fused_program.kernels, ShapeClass(H=2, HV=8, K=128, V=128, BV=16))
    assert "T.annotate_min_blocks_per_sm(6)" in src
    for wrong in (17, -1, 33):  # 17 · 128 threads over the SM's 2048; negative; over Hopper's 32 CTAs
        with pytest.raises(ValueError, match="only a parallel kernel over chunk slots of a fixed thread count asks"):
            dataclasses.replace(prep, ctas_per_sm=wrong).verify()


def test_an_inverse_stored_as_it_is_stages_through_a_block_of_its_own():
    """DeltaNet's fused prep stores the inverse itself (no gate mask over it) and has no io block
    of its shape left free: the fragment is copied into a block of its own for the row store."""
    prep = qla_compiler.compile_spec("delta_net").fused_program.kernels.kernels[0]
    stores = {s.dst: s.srcs[0] for s in prep.body if s.op == "store"}
    block = prep.buffer(stores["T_rows"])
    assert (block.scope, block.dtype, block.shape) == ("shared", "io", ("C", "C"))
    copy = next(s for s in prep.body if s.op == "copy" and s.dst == block.name)
    assert prep.buffer(copy.srcs[0]).scope == "fragment"


def test_only_a_2d_shared_block_pads_its_rows():
    prep = qla_compiler.compile_spec("gdn").fused_program.kernels.kernels[0]
    bad = dataclasses.replace(prep, buffers=[dataclasses.replace(b, row_pad=4) if b.name == "T_r" else b
                                             for b in prep.buffers])
    with pytest.raises(ValueError, match="T_r pads its rows by 4: only a 2-D shared block"):
        bad.verify()


def test_a_scan_takes_no_more_stages_than_its_shared_memory_holds():
    """A pipeline stage is one more buffer per load. At 3 stages GDN's backward scan would need
    257 KB at BV = 64 (its launch failed on the H200): it lowers with 2; the forward's takes 3."""
    prog = qla_compiler.compile_spec("gdn")
    shape = ShapeClass(H=2, HV=8, K=128, V=128, BV=64, stages=3, scan_warpgroups=2)
    forward_scan = next(k for k in prog.for_shape(shape).kernels.kernels if k.loop)
    backward_scan = next(k for k in prog.for_shape(shape).backward_program.kernels.kernels if k.loop)
    assert backward_scan.max_stages == 2 and forward_scan.max_stages >= 3
    assert "num_stages=STAGES)" in lower(prog.for_shape(shape).kernels, shape)
    back = lower(prog.for_shape(shape).backward_program.kernels, shape)
    assert "T.Pipelined(T.ceildiv(seq_len, C), num_stages=2):  # the most its shared memory holds" in back


def test_wide_head_dims_get_kernels_scheduled_for_their_tiles():
    """K = V = 256: the program a class of such tiles runs is scheduled for them (Program.for_shape):
    the prep on two warpgroups (its W and U fragments), the scan with the stages its shared memory
    holds, the V-block at most 32 (the state's registers); classes up to 128 keep the usual kernels."""
    from qla_compiler.kernels.forward import scan_class

    prog = qla_compiler.compile_spec("gdn")
    narrow = prog.for_shape(scan_class(2, 8, 100, 60, 1, "bfloat16", 132))
    assert narrow.kernels is prog.kernels and prog.kernels.head_dims == (128, 128)
    shape = scan_class(16, 64, 256, 256, 1, "bfloat16", 132)
    wide = prog.for_shape(shape)
    assert wide.head_dims == wide.kernels.head_dims == (256, 256) and shape.BV == 32
    threads = {k.kind: k.threads for k in wide.kernels.kernels}
    assert threads["prep"] == 256 and {k.kind: k.threads for k in prog.kernels.kernels}["prep"] == 128
    scan = next(k for k in wide.kernels.kernels if k.loop)
    assert scan.max_stages < next(k for k in prog.kernels.kernels if k.loop).max_stages
    assert wide.training_program.head_dims == (256, 256)
    assert prog.for_shape(shape) is wide  # derived once
    src = lower(wide.kernels, shape)
    assert "threads=256" in src and "K, V, BV, C = 16, 64, 256, 256, 32, 64" in src.replace("H, HV, ", "")


def test_padded_scan_reads_its_masked_blocks_through_a_private_copy():
    """A head dim narrower than its tile loads the op's blocks masked (cp.async, not TMA); in the
    pipelined scan TileLang 0.1.15 hands such a block's stage back to the producer after the last
    reader of the TMA load it is grouped with, before the block's own last reader (on the H200:
    the forward scan's S0 15% off at K = 100). The generated CUDA must copy each such block into
    the consumer's own buffer before the consumer's first release of a stage, and read only the
    copy after it."""
    prog = qla_compiler.compile_spec("gdn")
    shape = ShapeClass(2, 4, 100, 60, BV=32, stages=4)
    for program in (prog, prog.backward_program):
        src = lower_to_cuda(program, shape)
        name = next(n for n in src if n.endswith("_scan"))
        cuda = src[name]
        privates = sorted(set(re.findall(r"void\* (\w+)_c = ", cuda)) - {"g_cum"})
        assert {"k_s"} <= set(privates), privates
        consumer = cuda[cuda.index("} else {", cuda.index("tma_load(")):]  # the consumer warpgroups' branch
        release = consumer.index(".arrive();")
        for x in privates:
            # the copy's stores: a statement that begins by writing the private buffer
            copies = [m.start() for m in re.finditer(rf"^\s*\*\(uint4\*\)\(\(\(bfloat16_t\*\){x}_c\)", consumer, re.M)]
            assert copies and max(copies) < release, (name, x)
            assert not re.search(rf"\(bfloat16_t\*\){x}\)", consumer[release:]), (name, x)


def test_columns_mixed_finds_what_reads_across_v():
    """The backward's column blocks are exact only for a forward that never mixes V's columns:
    columns_mixed names the first node that reads a V-wide value and is not V-wide itself."""
    from qla_compiler.passes.schedule_build import columns_mixed

    ir = qla_compiler.compile_spec("gdn").chunk
    assert columns_mixed(ir) is None
    mixed = ir.copy()
    v = next(n.name for n in mixed.order() if n.shape == ("C", "V"))
    mixed.add("across_v", "rowsum", v)
    assert columns_mixed(mixed) == "across_v"


@pytest.mark.parametrize("spec, shape", [("gdn", "H=2,HV=8,K=100,V=60"), ("kda", "H=2,HV=2,K=64,V=64")])
def test_the_generated_source_does_not_depend_on_the_hash_seed(spec, shape):
    """The TileLang source is TileLang's cache key: kernels precompiled in one process are found
    by another only if both generate the same text. Sets iterated in the lowering once ordered a
    padded backward's private copies by the process's string hashing (a cache miss on the GPU
    node, which then compiled again); so did the blocks KDA's split out kernels hand on (session
    28: their parameters' order)."""
    cmd = [sys.executable, "-m", "qla_compiler.cli", spec, "--emit", "tilelang", "--backward",
           "--shape", f"{shape},io=bfloat16"]
    texts = {subprocess.run(cmd, capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2", "3")}
    assert len(texts) == 1


def test_the_launch_follows_the_kernels_grid():
    """The grid is the KernelIR's, axis order included (its first axis is blockIdx.x, the
    fastest-varying: with the value heads first, a chunk's G value heads run side by side and read
    its keys once from HBM); a grid over other axes is refused by the verifier."""
    prog = qla_compiler.compile_spec("gdn")
    shape = ShapeClass(H=2, HV=8, K=128, V=128, BV=64, io="bfloat16")
    prep = next(k for k in prog.kernels.kernels if k.kind == "prep")
    assert "with T.Kernel(CH, HV, threads=128) as (i_slot, i_hv):" in "\n".join(lower_kernel(prep, shape))
    heads_first = dataclasses.replace(prep, grid=prep.grid[::-1])
    heads_first.verify()
    # (chunk slots past the first axis: one launch axis, since blockIdx.y stops at 65535)
    assert "with T.Kernel(HV * CH, threads=128) as i_cta:" in "\n".join(lower_kernel(heads_first, shape))
    scan = next(k for k in prog.kernels.kernels if k.loop)
    seq_first = dataclasses.replace(scan, grid=(scan.grid[2], scan.grid[0], scan.grid[1]))
    assert "with T.Kernel(N, V // BV, HV, threads=SCAN_THREADS) as (i_n, i_v, i_hv):" in \
        "\n".join(lower_kernel(seq_first, shape))
    with pytest.raises(ValueError, match="grid over chunk_slot, key_head"):
        dataclasses.replace(prep, grid=(("chunk_slot", "CH"), ("key_head", "H"))).verify()


def test_each_parallel_kernel_states_its_live_fragment_registers(ops):
    """Kernel.fragment_peak: the registers a thread's live fragments take at their peak (the
    schedule's liveness over the kernel's statements), printed with the kernel; the KernelIR
    lists the kernels where that exceeds the budget (over_registers). GLA's one backward out
    kernel held eight C×K float32 blocks at once (256 registers a thread at 256 threads; ptxas
    spilled 136 bytes of them); split, its keys' gradients on blocks of K's columns, none is over."""
    from qla_compiler.passes.schedule_memory import FRAGMENT_REGISTERS, dim_sizes, live_fragments

    for spec in ("gdn", "kda", "gla"):
        prog = ops[spec].program
        for kir in (prog.kernels, prog.backward_program.kernels):
            for k in kir.kernels:
                if k.loop:
                    assert k.fragment_peak == 0, k.name
                    continue
                live = live_fragments({b.name: b for b in k.buffers}, k.body, dim_sizes(kir.head_dims, k.key_block))
                assert k.fragment_peak == -(-live // (4 * k.threads)), k.name
                assert not k.fragment_peak or f"fragments ≤ {k.fragment_peak} registers a thread" in str(k)
            assert kir.over_registers == tuple(k.name for k in kir.kernels if k.fragment_peak > FRAGMENT_REGISTERS)
        assert prog.backward_program.kernels.over_registers == ()
    over = dataclasses.replace(ops["gla"].program.backward_program.kernels, over_registers=("gla_backward_out_d_v",))
    assert "live fragments over the registers (spilled): gla_backward_out_d_v" in str(over)


def test_sums_of_many_products_accumulate_as_they_go_where_registers_run_out(ops):
    """KDA's backward out kernels sum d k from five products (d k's own, the diagonal and
    off-diagonal decayed products, k Γ's) and d g from eleven: as one expression at the end,
    every term's C×K fragment is live at once (320 and 289 registers a thread on two warpgroups
    when d g had a kernel of its own; ptxas spilled 1680 and 804 bytes, and each kernel took ~10 ms
    at 16/16 × 8 × 4096 on the H200, session 27). Built with running sums, each term is added
    into the sum's fragment at its turn: the d q, d k, d g kernel held 208 (352 without) whole,
    and 57 on blocks of 32 keys. GDN's kernels, within their budget, have none."""
    def sums(kir):
        return {b.name for k in kir.kernels for b in k.buffers if b.name.endswith("_sum") and b.scope == "fragment"}

    back = ops["kda"].program.backward_program.kernels
    peaks = {k.name: (k.threads, k.fragment_peak) for k in back.kernels}
    assert peaks["kda_backward_out_d_q_d_k_d_g"] == (256, 57)
    assert {"d_q_sum", "d_k_sum", "d_g_cum_sum"} <= sums(back)
    for k in back.kernels:  # each sum: its first term written, every later one added onto it
        for name in {b.name for b in k.buffers} & sums(back):
            writes = [st for st in k.body if st.dst == name]
            assert len(writes) >= 2 and f"'buf', '{name}'" not in str(writes[0].attr)
            assert all(f"'buf', '{name}'" in str(st.attr) for st in writes[1:]), name
    assert not sums(ops["gdn"].program.backward_program.kernels) and not sums(ops["gdn"].program.kernels)


@pytest.mark.parametrize("name", NAMES)
def test_threads_writes_are_ordered_before_a_fix_up_that_a_whole_chunk_skips(name):
    """TileLang 0.1.15 places the barrier that orders threads' writes to shared memory before other
    threads read them inside a following `if n_valid < C:` fix-up, where a whole chunk never goes
    (on the H200: KDA's backward prep at K = 60 read β before it was stored in some chunks, W 3%
    off, and FLA's KDA tests found d h0 5% off at D = 60 and 2% at 100). In every kernel without a
    loop, a `T.sync_threads()` must come between such writes and the `if`."""
    prog = qla_compiler.compile_spec(name)
    for program in (prog.training_program, prog.backward_program):
        for shape in (ShapeClass(2, 2, 128, 128, BV=64), ShapeClass(2, 4, 60, 100, BV=32)):
            for k in program.kernels.kernels:
                if k.loop or k.warp_roles or k.kind == "token_step":
                    continue
                lines = lower_kernel(k, shape)
                shared = set(re.findall(r"^\s+(\w+) = T\.alloc_shared\(", "\n".join(lines), re.M))
                written, skipping = [], False
                for ln in lines:
                    depth, text = len(ln) - len(ln.lstrip()), ln.strip()
                    if skipping and depth > 8:
                        continue  # (the fix-up's own writes run exactly when every later fix-up does)
                    skipping = False
                    if depth == 8 and text.startswith("if n_valid < C:"):
                        assert not written, f"{name} {k.name} at {shape}: {written} written, then `{text}`"
                        skipping = True
                    elif text.startswith("T.sync_threads()"):
                        written = []
                    elif (m := re.match(r"(\w+)\[.*\] = ", text)) and m.group(1) in shared:
                        written.append(m.group(1))


def test_kernels_short_of_warps_take_twice_their_warpgroups_when_asked():
    """QLA_MORE_WARPGROUPS=1 (off by default: on the H100 it slowed GDN's training step and every
    forward, session 36): a parallel kernel that an
    SM runs fewer than 16 warps of takes twice its warpgroups, up to four, where the SM would then
    run more; the KernelIR says so (its threads, its role's warps). GDN's solve-only prep, 6 CTAs
    of 4 warps, keeps its 128 threads. The 512-thread kernel lowers to CUDA with launch bounds of 512.
    QLA_MORE_WARPGROUPS=gradients does it for a backward's out kernels alone."""
    code = ("import qla_compiler; p = qla_compiler.compile_spec('{}'); "
            "print({{k.name: (k.threads, k.roles[0].split(':')[0]) for k in p.{}.kernels.kernels if not k.loop}})")
    seen = {}
    for on in ("0", "1", "gradients"):
        env = {**os.environ, "QLA_MORE_WARPGROUPS": on}
        for spec, program in (("kda", "backward_program"), ("kda", "training_program"), ("gdn", "fused_program"),
                              ("gdn", "backward_program")):
            out = subprocess.run([sys.executable, "-c", code.format(spec, program)], capture_output=True, text=True,
                                 check=True, env=env).stdout
            seen.setdefault(on, {}).update(eval(out))  # noqa: S307 - our own dict's repr
    assert seen["0"]["kda_backward_out_d_q_d_k_d_g"] == (256, "all 8 warps")
    assert seen["1"]["kda_backward_out_d_q_d_k_d_g"] == (512, "all 16 warps")
    # (at 128 threads KDA's backward prep is starved whole and splits, the K-wide part on key blocks:
    # schedule._prep_kernels; at 256 it is fed whole)
    assert seen["0"]["kda_backward_prep_d_v_new_o_intra_d_P"][0] == 128
    assert seen["1"]["kda_backward_prep"] == (256, "all 8 warps")
    assert seen["0"]["kda_prep"][0] == 128 and seen["1"]["kda_prep"] == (256, "all 8 warps")  # (2 CTAs an SM)
    assert seen["1"]["gdn_prep"] == seen["0"]["gdn_prep"] == (128, "all 4 warps")  # (GDN's solve-only prep)
    grads = {n for n in seen["0"] if "_backward_out" in n}
    assert seen["gradients"]["gdn_backward_out"] == (512, "all 16 warps")
    assert {n: seen["gradients"][n] for n in grads} == {n: seen["1"][n] for n in grads}
    assert {n: k for n, k in seen["gradients"].items() if n not in grads} == \
        {n: k for n, k in seen["0"].items() if n not in grads}

    import types

    from qla_compiler.passes import schedule_memory

    backward = qla_compiler.compile_spec("gdn").backward_program
    kernel = next(k for k in backward.kernels.kernels if k.kind == "out")
    wide = dataclasses.replace(kernel, threads=schedule_memory.more_warpgroups(
        kernel.threads, kernel.shared_peak, kernel.fragment_peak * 4 * kernel.threads, on=True))
    # (its sums' batches were counted for 256 threads: recounted for the kernel as it is now)
    wide = batched_reductions(wide, 64)
    assert (kernel.threads, wide.threads) == (256, 512)
    program = types.SimpleNamespace(kernels=dataclasses.replace(backward.kernels, kernels=[wide]), path=backward.path)
    src = lower_to_cuda(program, ShapeClass(H=2, HV=4, K=64, V=64))[kernel.name]
    assert "__launch_bounds__(512, 1)" in src


def test_a_kernel_whose_blocks_do_not_pack_is_over_budget(ops):
    """schedule_memory.packed_shared: GLA's d v kernel at K = V = 256 has 192 KB live at its peak,
    but the entering d S (128 KB) comes after g_cum, k and q have left holes of 96 KB, so TileLang
    places it on top and the kernel asks 256 KB at launch, more than a CTA may (the H100 refused
    it, session 36). The schedule counts the blocks as placed: the kernel is over the budget, and
    the backward takes V on column blocks of 128, where every kernel asks at most what a CTA may."""
    from qla_compiler.passes.schedule_memory import CTA_SHARED_MAX

    wide = ops["gla"].program.scheduled_for((256, 256))
    d_v = next(k for k in wide.backward_program.kernels.kernels if k.name == "gla_backward_out_d_v")
    assert (d_v.shared_peak, d_v.shared_packed) == (192 * 1024, 256 * 1024)
    assert "shared ≤ 192 KB (256 KB as placed)" in str(d_v)
    assert wide.backward_program.kernels.over_budget == ("gla_backward_out_d_v",)
    asked = launch_shared_bytes(dataclasses.replace(wide.backward_program, kernels=dataclasses.replace(
        wide.backward_program.kernels, kernels=[d_v])), ShapeClass(H=2, HV=2, K=256, V=256, BV=64))
    assert asked == {"gla_backward_out_d_v": d_v.shared_packed}
    _, values, each = wide.backward_blocks()
    asked = launch_shared_bytes(each.backward_program, ShapeClass(H=2, HV=2, K=256, V=values, BV=64))
    assert values == 128 and max(asked.values()) <= CTA_SHARED_MAX, asked
