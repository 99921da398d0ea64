#!/usr/bin/env bash
# One kernel of a library's forward (or training step) under Nsight Compute (the full set of sections, with source),
# and the report read back as text: the details page and the per-instruction SASS table with its
# stall samples. For comparing a kernel of ours with a peer's that does the same work (the GDN
# prep beside FlashQLA's kkt_solve: the same load, K Kᵀ and inverse, 0.60 against 0.44 ms at
# 16/64:8x4096, and no ablation has said where the difference is; NOTES, sessions 19-23).
#
#   bash benchmarks/ncu_kernel.sh NAME REGEX LIB ROW [SPEC [backward]]   (LIB as qla-bench --only names it)
#   bash benchmarks/ncu_kernel.sh prep gdn_prep qla 16/64:8x4096
#   bash benchmarks/ncu_kernel.sh kkt kkt_solve FlashQLA 16/64:8x4096
#   bash benchmarks/ncu_kernel.sh dqdkdg d_q_d_k_d_g qla 16/16:8x4096 kda backward   (a training step's kernel)
#
# The calls are plain (no torch.profiler beside ncu). Writes $OUT/ncu/NAME.ncu-rep,
# NAME.details.txt and NAME.sass.csv (in a step of gpu_detached.sh, OUT=/tmp/qla-job brings the two
# text files back in job.tgz; a report over 12 MB stays on the node). Session 52: ~30 s for our
# backward out kernel, ~160 s for FlashQLA's fused backward (its TileLang compiles first). The fourth launch of a matching kernel is the one profiled:
# the first ones compile and warm up. --clock-control none: the device's notes (METHOD.md) ask
# that the clocks be left alone.
set -eu
name=$1; regex=$2; lib=$3; row=$4; spec=${5:-gdn}; mode=${6:-forward}
dir=${OUT:-/tmp}/ncu; mkdir -p "$dir"
ncu --clock-control none --target-processes all -k "regex:$regex" --launch-skip 3 --launch-count 1 \
    --set full --import-source yes -f -o "$dir/$name" python3 -c "
import torch
from qla_compiler.bench import libraries, make_inputs, parse_row, with_backward
H, HV, lens = parse_row('$row')
fn = libraries(only=['$lib'], spec='$spec')['$lib']
fn = with_backward(fn) if '$mode' == 'backward' else fn
args = make_inputs(H, HV, lens, spec='$spec')
for _ in range(6):
    fn(**args)
torch.cuda.synchronize()
" > "$dir/$name.log" 2>&1 || { tail -20 "$dir/$name.log"; exit 1; }
ncu -i "$dir/$name.ncu-rep" --page details --print-details all > "$dir/$name.details.txt"
ncu -i "$dir/$name.ncu-rep" --page source --print-source sass --csv > "$dir/$name.sass.csv" 2>/dev/null || true
grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Executed Ipc Active|Issue Slots Busy|Mem Pipes Busy|Shared Memory|Bank|Warp Cycles Per Issued|Block Limit" \
    "$dir/$name.details.txt" | head -40
