"""qla-compile prints what the compiler derived."""
import re
import subprocess
import sys

from qla_compiler.cli import main


def test_summary(capsys):
    assert main(["specs/gdn.py", "--target", "sm90"]) == 0
    out = capsys.readouterr().out
    assert "recurrence gdn" in out and "chunk program (C=64)" in out and "depending on it" in out


def test_emit_chunk_follows_math_md(capsys):
    assert main(["specs/gdn.py", "--target", "sm90", "--emit", "chunk"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("chunk_program gdn  C=64 { in q:C×K k:C×K v:C×V g:C beta:C ; state S0:K×V")
    for line in ("g_cum:C", "= cumsum g", "R:C×C", "= inv_unit_lower A", "v_new:C×V",
                 "o:C×V", "S_next:K×V", "# scan over chunks (carries the state)"):
        assert line in out, line
    assert out.rstrip().endswith("} out o=o state=S_next")


def test_emit_recurrence_and_output_dir(tmp_path, capsys):
    assert main(["gdn", "--emit", "recurrence", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step   S ←" in out
    assert (tmp_path / "gdn.recurrence.txt").read_text().strip() == out.strip()


def test_error_goes_to_stderr_with_status_1(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("from qla_compiler.spec import key\nq = key('q')\nz = undefined_thing\n")
    assert main([str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:3: unknown symbol" in err


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "qla_compiler.cli", "linear_attn", "--emit", "chunk"],
                       capture_output=True, text=True, check=True)
    assert "chunk_program linear_attn" in r.stdout


def test_emit_backward_is_a_reverse_scan(capsys):
    assert main(["gdn", "--emit", "backward"]) == 0
    out = capsys.readouterr().out
    assert "last to first" in out and "d_S0" in out and "d_v_new" in out


def test_emit_affine(capsys):
    assert main(["gdn", "--emit", "affine"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("chunk_program gdn_affine") and "out M=" in out and "H=" in out


def test_backward_flag_goes_with_kernel_outputs(capsys):
    assert main(["gdn", "--emit", "kernel", "--backward"]) == 0
    out = capsys.readouterr().out
    assert "kernel gdn_backward_scan" in out and "last to first" in out
    assert main(["gdn", "--emit", "chunk", "--backward"]) == 1
    assert "--backward goes with --emit kernel, tilelang or cuda" in capsys.readouterr().err


def test_backward_on_blocks_shows_one_blocks_kernels(capsys):
    """Where the backward at a shape runs on blocks (GLA at K = V = 256: 128 of V's columns; GDN: 64),
    --emit kernel --backward prints one block's kernels, first saying so: what the runtime
    launches, not the whole shape's program, over its budget."""
    assert main(["gla", "--emit", "kernel", "--backward", "--shape", "H=4,HV=4,K=256,V=256"]) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert first.startswith("# the backward at K = 256, V = 256 runs on blocks of 128 of V's columns (K whole)")
    assert second.startswith("kernel_program gla_backward") and "tiles up to K=256 V=128" in second
    assert main(["gdn", "--emit", "kernel", "--backward", "--shape", "H=2,HV=2,K=256,V=256"]) == 0
    assert "blocks of 64 of V's columns (K whole)" in capsys.readouterr().out.splitlines()[0]
    assert main(["gdn", "--emit", "kernel", "--backward"]) == 0
    assert capsys.readouterr().out.startswith("kernel_program gdn_backward")


def test_training_flag_shows_the_forward_that_stores_T_r(capsys, tmp_path):
    assert main(["gdn", "--emit", "kernel", "--training", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "out T_r_rows" in out and "kernel gdn_scan" in out
    assert (tmp_path / "gdn.training.kernel.txt").read_text().startswith("kernel_program gdn")
    assert main(["gdn", "--emit", "kernel"]) == 0
    assert "T_r_rows" not in capsys.readouterr().out
    assert main(["gdn", "--emit", "kernel", "--training", "--backward"]) == 1
    assert "choose one" in capsys.readouterr().err


def test_windows_flag_shows_the_scan_that_walks_from_a_given_chunk(capsys):
    """--windows: context parallelism's first scan (passes/walk_skip.py), here the fused kernel's."""
    assert main(["gdn", "--emit", "kernel", "--fused", "--windows"]) == 0
    out = capsys.readouterr().out
    assert "kernel gdn_fused_windows" in out and "in  skip_chunks: int32[N, HV]" in out
    assert "past the first skip_chunks[sequence, value head] of its walk" in out
    assert "kernel gdn_prep" not in out  # the scan alone
    assert main(["gdn", "--emit", "chunk", "--windows"]) == 1
    assert "--windows goes with --emit kernel" in capsys.readouterr().err


def test_cp_plan_prints_the_planners_choice(capsys):
    from qla_compiler.kernels import forward

    assert main(["gdn", "--cp-plan", "H=2,HV=8,K=128,T=32768,sms=132"]) == 0
    out = capsys.readouterr().out
    assert "1 sequence(s), 32768 tokens, 132 SMs" in out and "chosen for an eager inference call: 8" in out
    assert "chosen for a captured or compiled inference call: 8" in out and re.search(r"\n +32 +[0-9.]+ ms", out)
    assert "chosen for an eager training step: none (the whole walk)" in out
    assert main(["gdn", "--cp-plan", "H=16,HV=64,K=128,N=8,T=32768,sms=132"]) == 0
    assert "chosen for a captured or compiled inference call: none (the whole walk)" in capsys.readouterr().out
    # 8192 tokens: cut where the GPU sets the pace, whole where the host does (kernels/cp_plan.py)
    assert main(["gdn", "--cp-plan", "H=2,HV=8,K=128,T=8192,sms=132"]) == 0
    out = capsys.readouterr().out
    assert "chosen for a captured or compiled inference call: 4" in out and "chosen for an eager inference call: none" in out
    # the wide kernel's column, and its plan where cut_wide lets an inference call take it
    with forward.launch_policy(cut_wide=False):
        assert main(["gdn", "--cp-plan", "H=8,HV=32,K=128,T=32768,sms=132"]) == 0
    out = capsys.readouterr().out
    assert "(not taken: forward.cut_wide() is off)" in out and "chosen for a captured or compiled inference call: 2" in out
    assert re.search(r"\n +4 +0\.452 ms +0\.304 ms", out)
    with forward.launch_policy(cut_wide=True):
        assert main(["gdn", "--cp-plan", "H=8,HV=32,K=128,T=32768,sms=132"]) == 0
    out = capsys.readouterr().out
    assert "chosen for a captured or compiled inference call: 4" in out
    assert "chosen for a captured or compiled training step: 2" in out
    assert main(["gdn", "--cp-plan", "H=2,HV=8,K=128"]) == 1
    assert "--cp-plan: give H, HV, K, T" in capsys.readouterr().err
