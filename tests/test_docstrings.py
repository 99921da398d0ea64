"""Every example in a docstring runs and prints what it says (those marked +SKIP need a GPU or a
compiled kernel): the docs cannot drift from the code."""
import doctest
import importlib
import pkgutil

import pytest

PACKAGES = ["qla_compiler", "qla_compiler.ir", "qla_compiler.passes", "qla_compiler.kernels"]


def _modules() -> list:
    names = ["qla_compiler.specs"]  # (its modules are spec files: they run only inside the frontend)
    for pkg in PACKAGES:
        names.append(pkg)
        names += [m.name for m in pkgutil.iter_modules(importlib.import_module(pkg).__path__, pkg + ".")
                  if not m.ispkg]
    return names


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, report=True)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
