#!/usr/bin/env bash
# Compile on this CPU what a GPU job will launch, and pack it as .gpu/tl-cache.tar, so that the
# device's minutes go to running (a fresh GPU node restores the tar: ../shared/gpu/README.md).
#
#   bash benchmarks/prepare_gpu_job.sh [--tests] [--real-data] [--head-dims] [--backward] [--cp-auto] [--variants]
#                                      [--fused-training] [--switches] [--lookahead] [--heads-first]
#                                      [--inverse-products] [--cut-fused] [--prep-columns]
#
# Always: the bench rows' kernels, separate and fused (qla-bench, qla-bench --fused), and the
# fused GPU tests' classes. --tests: every class of tests/test_gpu_*.py (precompile.py --tests;
# the longest part, ~20 minutes here). --real-data: tests/test_gpu_real_data.py's classes and
# those of FLA's own tests when .gpu/fla_tests/test_gdn.py is there. --head-dims: only that
# file's head-dim cases, K and V up to 256 with gradients (~5 minutes), and the bench rows at
# K = V = 256 and 100 (forward; 16/64:8x4096:256 also trained). --backward: the training
# step's classes of the bench rows (qla-bench --backward; the node compiled them in session 13,
# which used up the step's timeout). --cp-auto: the bench rows' context-parallel classes as
# qla-bench --cp auto plans them, forward and training (the window searches too). --variants: the
# experiments gpu_steps.txt runs (prep_variants.py, window_search_variants.py). --fused-training:
# tests/test_gpu_fused_training.py's classes and the bench rows' training steps through the
# fused training forward (qla-bench --backward --fused's qla-fused). --switches: what
# gpu_steps.txt times and tests under the switches that are off (QLA_RECOMPUTE_PER_KEY=1,
# QLA_MORE_WARPGROUPS=gradients), the plain backward scan it compares the default's whole-V one
# with (QLA_BACKWARD_SCAN_ROLES=0), and the whole-V scan tests' classes (~15 minutes here). Two
# processes per step (this machine's cores); a fresh cache directory each run, so the tar holds
# no stale kernels. --lookahead: the two backward bench rows under QLA_LOAD_LOOKAHEAD=3, 4 and 5,
# and test_gpu_backward's GDN classes and test_gpu_per_key's under 3. --heads-first: the two backward
# bench rows and test_gpu_backward's classes with the value heads first (QLA_HEADS_FIRST=1), and the
# two rows with QLA_LOAD_LOOKAHEAD=3 besides. --inverse-products: the two backward bench rows and
# test_gpu_backward's classes with the whole-V scan forming W (QLA_SCAN_PRODUCTS_ON_INVERSE=1).
# --cut-fused: the bench rows as qla-bench --cut-fused runs them (QLA_CUT_WIDE=1 and
# QLA_CUT_FUSED_TRAINING=1), forward and training, and cp_sweep.py's rows cut in 2, 4, 8 and 16
# both ways (its --cut-wide sweep and a plain one to fit beside it). --prep-columns: the forward
# bench rows that fill the GPU with the substitution's lanes by columns (QLA_PREP_COLUMNS=1).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -f .gpu/enter.sh ] || { echo "no .gpu/: run bash ../shared/gpu/make-bundle.sh first" >&2; exit 1; }
PY=${PY:-.venv/bin/python}
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$(mktemp -d /tmp/tlc-job.XXXX)} OMP_NUM_THREADS=1
LOGS=$(mktemp -d /tmp/precompile-logs.XXXX)
ROWS="2/8:1x32768 2/8:1x8192 2/8:8x4096 4/16:1x32768 4/16:8x4096 8/32:1x32768 16/64:1x32768 16/64:1x2048 16/64:8x4096"
SWEEP="2/8:1x32768 2/8:1x8192 4/16:1x32768 8/32:1x32768 16/64:1x32768 2/8:8x4096 4/16:8x4096 16/64:1x2048"  # cp_sweep.ROWS
WIDE="16/64:8x4096:256 2/8:1x8192:256 16/64:8x4096:100"  # issue 15's rows beside FLA
FUSED="delta_net:2/2:128:bfloat16:16 simple_gla:2/2:128:bfloat16:16 retnet:2/2:128:bfloat16:16 linear_attn:2/2:128:bfloat16:16"
FUSED="$FUSED gdn:2/2:128:bfloat16:16 gdn:1/2:64:bfloat16:16 gdn:2/8:128:bfloat16:32 gdn:2/8:128:bfloat16:16"
FUSED="$FUSED gdn:1/2:256:bfloat16:16 gdn:4/32:128:bfloat16:64"
# the wide fused kernel (V-block 128, four roles) as tests/test_gpu_fused_forward.py forces it
FUSED="$FUSED gdn:2/8:128:bfloat16:128 delta_net:2/2:128:bfloat16:128 simple_gla:2/2:128:bfloat16:128"
FUSED="$FUSED retnet:2/2:128:bfloat16:128 linear_attn:2/2:128:bfloat16:128 gdn:1/2:100:bfloat16:128"
# tests/test_gpu_real_data.py's fused forward cases (2/4 heads: V-block 16, and the wide kernel)
FUSED="$FUSED gdn:2/4:128:bfloat16:16 gdn:2/4:128:bfloat16:128"

sharded() {  # NAME COMMAND...: the command in two shards, then a check of both logs
  local name=$1; shift
  local pids=() i failed=0
  for i in 0 1; do "$@" --shard $i/2 > "$LOGS/${name}_$i.txt" 2>&1 & pids+=($!); done
  for i in 0 1; do wait "${pids[$i]}" || failed=1; done  # a missing interpreter prints no Traceback
  if [ $failed = 1 ] || grep -l Traceback "$LOGS/${name}"_*.txt; then
    echo "$name: a shard failed (logs: $LOGS/${name}_*.txt)" >&2; exit 1
  fi
  echo "$(date +%T) $name compiled"
}

sharded fused env QLA_FUSED_FORWARD=1 $PY benchmarks/precompile.py $FUSED --bench --rows $ROWS
sharded bench $PY benchmarks/precompile.py --bench --rows $ROWS
for a in "$@"; do
  case $a in
    --tests) sharded tests $PY benchmarks/precompile.py --tests ;;
    --real-data) sharded real $PY benchmarks/fla_tests.py --precompile --real-data ;;
    --head-dims) sharded heads $PY benchmarks/fla_tests.py --precompile --head-dims
                 sharded wide $PY benchmarks/precompile.py --bench --rows $WIDE
                 sharded wide_backward $PY benchmarks/precompile.py --bench --backward --rows 16/64:8x4096:256 ;;
    --backward) sharded backward $PY benchmarks/precompile.py --bench --backward --rows $ROWS ;;
    --fused-training) sharded fused_training $PY benchmarks/precompile.py --fused-training-tests
                      sharded fused_training_bench env QLA_FUSED_FORWARD=1 QLA_FUSED_TRAINING=1 \
                          $PY benchmarks/precompile.py --bench \
                          --backward --rows $ROWS ;;
    --switches) sharded plain_scan env QLA_BACKWARD_SCAN_ROLES=0 $PY benchmarks/precompile.py --bench --backward \
                    --rows 16/64:8x4096 4/16:8x4096 2/8:8x4096 16/64:1x2048
                sharded roles_tests $PY benchmarks/precompile.py --scan-roles-tests
                sharded per_key env QLA_RECOMPUTE_PER_KEY=1 $PY benchmarks/precompile.py --per-key-tests --per-key-bench
                sharded per_key_default $PY benchmarks/precompile.py --per-key-bench
                sharded more_warps env QLA_MORE_WARPGROUPS=gradients $PY benchmarks/precompile.py --backward-tests \
                    --bench --backward --rows 16/64:8x4096 4/16:8x4096 ;;
    --lookahead) for L in 3 4 5; do
                   sharded lookahead_$L env QLA_LOAD_LOOKAHEAD=$L $PY benchmarks/precompile.py --bench --backward \
                       --rows 16/64:8x4096 4/16:8x4096
                 done
                 sharded lookahead_tests env QLA_LOAD_LOOKAHEAD=3 $PY benchmarks/precompile.py --backward-tests
                 sharded lookahead_per_key env QLA_LOAD_LOOKAHEAD=3 $PY benchmarks/precompile.py --per-key-tests ;;
    --heads-first) sharded heads_first env QLA_HEADS_FIRST=1 $PY benchmarks/precompile.py --bench --backward \
                       --rows 16/64:8x4096 4/16:8x4096
                   sharded heads_first_l3 env QLA_HEADS_FIRST=1 QLA_LOAD_LOOKAHEAD=3 $PY benchmarks/precompile.py \
                       --bench --backward --rows 16/64:8x4096 4/16:8x4096
                   sharded heads_first_tests env QLA_HEADS_FIRST=1 $PY benchmarks/precompile.py --backward-tests ;;
    --inverse-products) sharded inverse_products env QLA_SCAN_PRODUCTS_ON_INVERSE=1 $PY benchmarks/precompile.py \
                            --bench --backward --rows 16/64:8x4096 4/16:8x4096
                        sharded inverse_products_tests env QLA_SCAN_PRODUCTS_ON_INVERSE=1 $PY benchmarks/precompile.py \
                            --backward-tests ;;
    --cut-fused) sharded cut_fused env QLA_CUT_WIDE=1 QLA_CUT_FUSED_TRAINING=1 $PY benchmarks/precompile.py --bench \
                     --backward --rows $ROWS
                 for S in 2 4 8 16; do
                   sharded cut_wide_$S env QLA_CUT_WIDE=1 $PY benchmarks/precompile.py --bench --cp $S --rows $SWEEP
                   sharded cut_plain_$S $PY benchmarks/precompile.py --bench --cp $S --rows $SWEEP
                 done ;;
    --prep-columns) sharded prep_columns env QLA_PREP_COLUMNS=1 $PY benchmarks/precompile.py --bench \
                        --rows 16/64:8x4096 4/16:8x4096 2/8:8x4096 16/64:1x2048 ;;
    --cp-auto) sharded cp_auto $PY benchmarks/precompile.py --bench --backward --cp auto --rows $ROWS ;;
    --variants) $PY benchmarks/prep_variants.py --compile > "$LOGS/variants.txt" 2>&1
                $PY benchmarks/window_search_variants.py --compile >> "$LOGS/variants.txt" 2>&1
                if grep -q FAILED "$LOGS/variants.txt"; then echo "variants: one failed ($LOGS/variants.txt)" >&2; exit 1; fi
                echo "$(date +%T) variants compiled" ;;
    *) echo "unknown option $a" >&2; exit 2 ;;
  esac
done
# (not cuda-binaries/: nvcc's cache for compiling, which a kernel-cache hit never reads; each
# kernel's executable.so holds its cubin, and the tar stays under half the size. xz, not gzip:
# 12 MB where gzip made 30, under the device tool's 64 MiB beside the 37 MB site bundle; the
# node's `tar -xf` detects the compression)
tar -C "$TILELANG_CACHE_DIR" --exclude=./*/cuda-binaries -cf - . | xz -T0 -6 > .gpu/tl-cache.tar
echo ".gpu/tl-cache.tar: $(du -h .gpu/tl-cache.tar | cut -f1); .gpu in all: $(du -sh .gpu | cut -f1) (the device tool carries 64 MiB)"
