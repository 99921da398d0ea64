import os
import tempfile

import pytest
import torch

import qla_compiler
from qla_compiler.specs import NAMES, WITH_KERNELS

# generated TileLang modules go to a scratch directory, not the user's cache
os.environ.setdefault("QLA_CACHE_DIR", tempfile.mkdtemp(prefix="qla-test-cache-"))

# xdist workers share the machine's cores: with torch's default of a thread a core each, 8
# workers' float64 emulators oversubscribe the 16-core GPU node 8 times (the suspected reason why
# test_gpu_kernels and test_gpu_real_data did 45 tests in 430 s in session 25: unconfirmed)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

SPECS = NAMES
KERNEL_SPECS = WITH_KERNELS  # the specs the sm90 lowering takes (all: forward kernels)


def svg_texts(svg: str) -> set:
    """The text labels of a drawing: a whole SVG document whose labels stayed <text> elements
    (svg.fonttype 'none'), not glyph paths."""
    import html
    import re

    assert svg.lstrip().startswith(("<svg", "<?xml")) and svg.rstrip().endswith("</svg>")
    return {html.unescape(t).strip() for t in re.findall(r"<text[^>]*>(.*?)</text>", svg, re.S)}


@pytest.fixture(scope="session")
def ops():
    """One compiled op per shipped spec (compiling is the slow part of a CPU test)."""
    return {name: qla_compiler.compile(name, target="sm90") for name in SPECS}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
