"""Code run in a fresh Python process, for what a module reads once at import (a QLA_* switch) or
what no test's monkeypatch may reach: the tests that compare a switch's two ways run one of them
there."""
import json
import os
import subprocess
import sys


def run_child(code: str, *args, env: dict | None = None, timeout: int = 900) -> str:
    """`python -c code args...` with this process's environment plus `env` and OMP_NUM_THREADS=1
    (the suite runs on two cores beside it); its stdout, or an AssertionError with the end of
    its stderr."""
    run = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def last_json(stdout: str):
    """The JSON a child printed last."""
    return json.loads(stdout.strip().splitlines()[-1])
