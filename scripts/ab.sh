#!/usr/bin/env bash
# A/B of commits on the GPU machine, interleaved so that both see the same
# machine state (clocks, neighbours). Two steps:
#
#   here:    scripts/ab.sh prepare REV [REV...]
#            -> exports each REV into .ab/<n>/ (git archive; .ab/ is ignored)
#   device:  scripts/ab.sh run ROUNDS COMMAND...
#            (carry [".ab"]) builds every .ab/<n>/ in parallel, then runs
#            COMMAND in each of them, in turn, ROUNDS times, e.g.
#            scripts/ab.sh run 2 python3 benchmarks/bench_low_latency.py --backends cuda --repeats 6
#
# Each output block starts with "=== <n> <rev> round <i> <time>". The device
# has no git, hence the two steps.
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  prepare)
    shift
    rm -rf .ab && mkdir .ab
    n=0
    for rev in "$@"; do
      mkdir ".ab/$n" && git archive "$rev" | tar -x -C ".ab/$n" && git rev-parse --short "$rev" > ".ab/$n/REV"
      echo ".ab/$n: $(cat ".ab/$n/REV") $(git log -1 --format=%s "$rev")"
      n=$((n + 1))
    done
    ;;
  run)
    rounds=$2
    shift 2
    export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
    # With $OUT set: the GPUs' power draw, power limit and SM clock every 200 ms into $OUT/gpu_power.csv,
    # to read beside the blocks' start times (is a kernel held back by the power limit?).
    if [[ -n "${OUT:-}" ]] && command -v nvidia-smi > /dev/null; then
      # The event reasons say why the clock is below its maximum; older drivers lack the field.
      query=timestamp,index,power.draw,power.limit,clocks.sm,temperature.gpu
      nvidia-smi --query-gpu=$query,clocks_event_reasons.active --format=csv > /dev/null 2>&1 &&
        query=$query,clocks_event_reasons.active
      nvidia-smi --query-gpu=$query --format=csv -lms 200 >> "$OUT/gpu_power.csv" 2>&1 &
      trap "kill $! 2> /dev/null" EXIT
    fi
    builds=()
    for dir in .ab/*/; do
      (cd "$dir" && python3 setup.py -q build_ext --inplace > build.log 2>&1 && echo "built $dir" ||
        { echo "build failed in $dir"; tail -20 build.log; }) &
      builds+=($!)
    done
    wait "${builds[@]}"
    for ((i = 1; i <= rounds; i++)); do
      for dir in .ab/*/; do
        echo "=== $(basename "$dir") $(cat "$dir/REV") round $i $(date +%T)"
        (cd "$dir" && PYTHONPATH="$PWD" "$@")
      done
    done
    ;;
  *)
    echo "usage: scripts/ab.sh prepare REV [REV...] | scripts/ab.sh run ROUNDS COMMAND..." >&2
    exit 2
    ;;
esac
