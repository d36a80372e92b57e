#!/usr/bin/env bash
# The whole GPU run in one command, from the repository root of the GPU machine
# (python3 with jax + CUDA plugin, pybind11 and nvcc there; no network):
#
#   scripts/device_run.sh [extra pytest args] [--bench "benchmarks/x.py args"]...
#
# Builds the extension in place (incremental), prints the environment report,
# runs each GPU test file (TEST_FILES narrows them; set but empty, none), then each benchmark. Benchmarks run even if tests fail;
# the exit status is the first failure's. With $OUT set, the log is also
# written to $OUT/device_run.log.
set -uo pipefail
cd "$(dirname "$0")/.."

# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1
# A GPU test that skips fails here (tests/conftest.py): the run cannot be green by skipping.
export DEEP_EP_JAX_REQUIRE_GPU=1
# The benchmarks run as scripts from benchmarks/: the in-place build must be importable.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python3}"

if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/device_run.log") 2>&1
fi

pytest_args=()
benches=()
while (($#)); do
  case "$1" in
    --bench) benches+=("$2"); shift 2 ;;
    *) pytest_args+=("$1"); shift ;;
  esac
done

status=0
timings=()
stage() {  # stage NAME COMMAND...: runs it, records its time and status
  local name=$1 start=$SECONDS rc
  shift
  echo "=== $name: $*"
  "$@"
  rc=$?
  timings+=("$(printf '%-40s %5d s  rc=%d' "$name" $((SECONDS - start)) "$rc")")
  echo "=== $name: rc=$rc in $((SECONDS - start)) s"
  if ((rc != 0 && status == 0)); then status=$rc; fi
  return $rc
}

stage build "$PYTHON" setup.py -q build_ext --inplace || { printf '%s\n' "${timings[@]}"; exit "$status"; }
stage info "$PYTHON" -m deep_ep_jax.info
# One process per test file: a hang or crash in one leaves the others' results.
for test_file in ${TEST_FILES-tests/gpu/test_*.py}; do  # TEST_FILES="" runs none
  # Multi-process tests start GPU processes beside pytest's own: no preallocation there
  # (elsewhere preallocation stays on, so memory checks see only our allocations).
  prealloc=true; [[ $test_file == *multiprocess* || $test_file == *_scale_gpu* ]] && prealloc=false
  stage "$(basename "$test_file" .py)" env XLA_PYTHON_CLIENT_PREALLOCATE=$prealloc "$PYTHON" -m pytest -m gpu -q --timeout 300 "$test_file" "${pytest_args[@]}"
done
for bench in "${benches[@]}"; do
  # shellcheck disable=SC2086  # the benchmark string is a command line
  stage "bench ${bench%% *}" "$PYTHON" $bench
done

echo "=== timings"
printf '%s\n' "${timings[@]}"
exit "$status"
