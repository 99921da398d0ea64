"""benchmarks/traffic.py: the bytes a kernel moves per call, read off its KernelIR, against a count
by hand."""
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "traffic.py"


def _rows(*args) -> dict:
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines():
        m = re.match(r"\s+(\w+)\s+([\d.]+) \+\s+([\d.]+)\s+([\d.]+) ms\s+\|\s+([\d.]+) \+\s+([\d.]+)", line)
        if m:
            rows[m.group(1)] = tuple(float(x) for x in m.groups()[1:])
    return rows


def test_the_backward_scans_traffic_is_its_blocks_times_its_chunks():
    """16/64:8x4096, V-block 64: each of 64 heads × 2 V-blocks walks 512 chunks, loading q, k and W
    (64×128 bf16: 16 KiB each), d o and d v_new_o_intra (64×64 bf16: 8 KiB each) and g_cum (256 B)
    a chunk, and each of its 1024 walks loads d S's start (128×64 float32: 32 KiB); it stores d S
    entering every chunk (128×64 bf16) and d v_new (64×64 bf16) a chunk, and d h0 once a walk."""
    plain = _rows("--backward", "--bv", "64", "--rows", "16/64:8x4096")["gdn_backward_scan"]
    chunks, walks = 64 * 2 * 512, 64 * 2 * 8
    loads = (chunks * (3 * 16 * 1024 + 2 * 8 * 1024 + 256) + walks * 32 * 1024) / 2**30
    stores = (chunks * (16 * 1024 + 8 * 1024) + walks * 32 * 1024) / 2**30
    assert abs(plain[0] - loads) < 0.006 and abs(plain[1] - stores) < 0.006, (plain, loads, stores)
    assert abs(plain[2] - (loads + stores) * 2**30 / 3e9) < 0.002  # ms at 3.0 TB/s
    # the roles kernel at V-block 32 moves more blocks (twice the CTAs load q, k and W), the same
    # tensors: its floor is the plain scan's
    roles = _rows("--backward", "--roles", "--bv", "32", "--rows", "16/64:8x4096")["gdn_backward_scan_roles"]
    assert roles[0] > 1.5 * plain[0] and roles[1] == plain[1]
    assert roles[3:] == plain[3:] and plain[3] < plain[0]
