"""walk_skip: KernelIR → KernelIR of the scan alone, each walk starting past a number of chunks.

Context parallelism (qla_compiler/context_parallel.py) finds each segment's map S ↦ M S + H by
scanning the segment from [I | 0]. Where the transitions' norms multiply to below a threshold over
the segment's last chunks (its window), what comes before the window is negligible: the scan walks
the window alone. The number of chunks a walk leaves out is data, computed on the device per
(sequence, value head), so this kernel reads it from an int32 [N, HV] tensor (`Kernel.walk_skip`):
the lowering starts the walk at that chunk, in walk order (a reverse scan leaves out the
sequence's last chunks). A walk that leaves out every chunk writes its initial state as its final.

The segment scan runs at width K + V on values [0 | v]: its per-token inputs of the state's value
width (v; U in a training forward; dO and the like in a backward) say so in a field
(Tensor.zero_columns = "K"), so the runtime passes v as it is and no [0 | v] is written: the
lowering reads a V-block from column v0 − K, and TMA fills the blocks before column 0 with zeros.

    >>> from qla_compiler import compile_spec
    >>> scan = skipping_scan(compile_spec("gdn").kernels).kernels[0]
    >>> scan.name, scan.walk_skip, [p.name for p in scan.params if p.zero_columns]
    ('gdn_scan_windows', 'skip_chunks', ['U_rows'])
"""
from __future__ import annotations

import dataclasses

from qla_compiler.errors import PassError
from qla_compiler.ir.kernel import KernelIR, Tensor

SKIP = Tensor("skip_chunks", ("N", "HV"), "int32", "in",
              "chunks each (sequence, value head) walk leaves out at its start (context parallelism's windows)")


def skipping_scan(kir: KernelIR) -> KernelIR:
    scans = [k for k in kir.kernels if k.walks_chunks]
    if len(scans) != 1:
        raise PassError("walk_skip", f"{kir.name}: expected one scan kernel, found {len(scans)}")
    (scan,) = scans
    # (it runs as a pass of its own beside the scan: what that one reuses or releases is the scan's)
    params = [dataclasses.replace(p, zero_columns="K" if widened(p) else p.zero_columns, reuses="")
              for p in scan.params]
    skipping = dataclasses.replace(scan, name=f"{scan.name}_windows", params=[*params, SKIP], walk_skip=SKIP.name,
                                   releases=())
    skipping.verify()
    return dataclasses.replace(kir, name=f"{kir.name}_windows", kernels=[skipping])


def widened(p: Tensor) -> bool:
    """Whether context parallelism widens this scan input to [0 | x]: a per-token input of the
    state's value width (qla_compiler/context_parallel.run_segments's `values`)."""
    return p.role == "in" and p.shape[0] == "1" and p.shape[-1] == "V"
