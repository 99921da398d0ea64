"""The CLI's small answers: the cpu target has no kernels, a mistyped spec name gets the shipped
specs suggested, every option has help text."""
import argparse

import pytest

import qla_compiler
from qla_compiler import SpecError
from qla_compiler.cli import main
from qla_compiler.specs import NAMES


def test_cpu_target_lists_no_kernels(capsys):
    assert main(["gdn", "--target", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "gdn_prep" not in out and "gdn_scan" not in out
    assert "kernels: none for target cpu (the ChunkIR interpreter runs the chunk program" in out
    assert main(["gdn", "--target", "sm90"]) == 0
    assert "kernels: gdn_prep, gdn_scan, gdn_out" in capsys.readouterr().out


@pytest.mark.parametrize("emit", ["kernel", "tilelang", "cuda"])
def test_cpu_target_refuses_the_kernels(capsys, emit):
    assert main(["gdn", "--target", "cpu", "--emit", emit]) == 1
    assert f"--emit {emit}: target cpu has no kernels" in capsys.readouterr().err


@pytest.mark.parametrize("given, close", [("gdnx", "gdn"), ("delta", "delta_net"), ("specs/retnt.py", "retnet")])
def test_unknown_spec_suggests_the_shipped_ones(capsys, given, close):
    assert main([given]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"qla-compile: error: {given}: ")
    assert f"did you mean {close}?" in err and f"shipped specs: {', '.join(NAMES)}" in err


def test_nothing_close_still_lists_the_shipped_specs():
    with pytest.raises(SpecError) as e:
        qla_compiler.compile_spec("zzzz")
    assert "did you mean" not in str(e.value) and "shipped specs: gdn, delta_net" in str(e.value)


def test_every_option_has_help(monkeypatch):
    seen = []
    real = argparse.ArgumentParser.parse_args

    def spy(self, *a, **k):
        seen.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", spy)
    with pytest.raises(SystemExit):
        main(["--help"])
    actions = [a for a in seen[0]._actions if a.option_strings]
    assert {"--chunk-size", "--print-after-all", "--check"} <= {s for a in actions for s in a.option_strings}
    assert all(a.help for a in actions), [a.option_strings for a in actions if not a.help]
    chunk = next(a for a in actions if "--chunk-size" in a.option_strings)
    assert "power of two" in chunk.help and "64" in chunk.help
