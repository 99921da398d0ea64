#!/usr/bin/env bash
# A GPU session's work as one job that outlives the device tool's 10-minute calls, polled by
# short calls; what each step wrote is copied to $OUT on every poll, so a call that runs out of
# device time still brings back everything finished before it.
#
#   start:  bash benchmarks/gpu_detached.sh start STEPS_FILE     (one shell command per line)
#   poll:   bash benchmarks/gpu_detached.sh poll SECONDS         (waits at most SECONDS, then copies)
#
# The steps run in /tmp/qla-job/src, a copy of the tree made by start. Each step's output goes to /tmp/qla-job/NN.log; /tmp/qla-job/progress says which have ended.
# Keep SECONDS well under the call's limit_s (the device time left can make it shorter than 600).
set -u
J=/tmp/qla-job
case "${1:-}" in
  start)
    # the steps run in a copy of the tree as it is now: every later call (a poll) brings the
    # tree as it is then, and a step starting after an edit would run the edited code
    mkdir -p $J/src && cp "$2" $J/steps
    tar --exclude=./.git -cf - . | tar -C $J/src -xf -
    cd $J/src
    ENTER="${ENTER:-.gpu/enter.sh}" setsid bash -c '
      source ${ENTER:-.gpu/enter.sh}
      n=0
      while IFS= read -r step; do
        n=$((n + 1)); [ -z "$step" ] && continue
        echo "$(date +%T) start $n: $step" >> '$J'/progress
        # each step in a session of its own, and whatever of it outlives the step killed with it
        # (test workers a timeout left running would share the CPU with the next step)
        setsid bash -c "$step" > '$J'/$(printf %02d $n).log 2>&1 & pid=$!; wait $pid; rc=$?
        kill -9 -- -$pid 2>/dev/null
        echo "$(date +%T) end $n rc=$rc" >> '$J'/progress
      done < '$J'/steps
      touch '$J'/done' > $J/runner.log 2>&1 &
    echo "started $(wc -l < "$2") steps" ;;
  poll)
    # a machine without the job is a fresh one: the lease lapsed between calls (30 s idle) and
    # took the job with it; say so now rather than wait out SECONDS (session 16 lost 8 minutes so)
    [ -f $J/steps ] || { echo "no job on this machine: the lease lapsed since start; start again" >&2; exit 3; }
    end=$(( $(date +%s) + ${2:-300} ))
    # job.tgz leaves out any file over 12 MB: the device tool brings back files up to 16 MiB, and
    # one bigger job.tgz (session 26: a 41 MB Triton cache in it) brings back no log at all
    pack() {
      find $J -path $J/src -prune -o -type f -size +12M -printf './%P\n' > $J/.too-big
      tar -C $J --exclude=./src --exclude-from=$J/.too-big -czf "$OUT/job.tgz" . 2>/dev/null
      # (smaller files can still add up past the limit: then the logs alone)
      if [ "$(stat -c %s "$OUT/job.tgz")" -gt 15000000 ]; then
        echo "./* (job.tgz over 15 MB: the logs alone)" >> $J/.too-big
        tar -C $J -czf "$OUT/job.tgz" progress steps .too-big $(cd $J && ls [0-9]*.log 2>/dev/null) 2>/dev/null
      fi
    }
    while [ ! -f $J/done ] && [ "$(date +%s)" -lt $end ]; do
      pack
      sleep 15
    done
    pack
    [ -s $J/.too-big ] && echo "left out of job.tgz (over 12 MB): $(tr '\n' ' ' < $J/.too-big)"
    cat $J/progress 2>/dev/null
    for f in $J/[0-9]*.log; do echo "== $f"; tail -n 15 "$f"; done ;;
  *) echo "usage: $0 start STEPS_FILE | poll SECONDS" >&2; exit 2 ;;
esac
