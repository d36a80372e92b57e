#!/usr/bin/env bash
# Optional, not part of .ci/run: builds deep_ep_jax._C with no CUDA toolkit,
# from NVIDIA's CUDA 13 pip wheels alone (the [cuda] extra: nvcc, nvvm, the
# CUDA headers and static runtime, CCCL, NVSHMEM), as a user who installed JAX
# with `pip install "jax[cuda13]"` would, and checks that the module imports.
# Downloads about 450 MB (jax, and the wheels: 130 MB for the toolchain, 180 MB
# for NVSHMEM) into a new venv; the build takes 2-5 minutes on 2 cores. Runs
# on a CPU machine: it checks the compile, not the kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
# No system toolkit in sight: no CUDA_HOME, no /usr/local/cuda on PATH, and
# DEEP_EP_JAX_NO_SYSTEM_CUDA=1 so discovery skips /usr/local/cuda too.
run() { env -u CUDA_HOME PATH="$tmp/venv/bin:/usr/bin:/bin" DEEP_EP_JAX_NO_SYSTEM_CUDA=1 "$@"; }
start=$SECONDS

echo "== pip install \".[cuda]\" (brings the wheels; this first build finds no nvcc yet)"
run python -m pip install -q "$repo[cuda]"
run python -m pip list 2>/dev/null | grep -E "^(jax|jaxlib|nvidia-)"

echo "== pip install -v . (builds with the wheels' nvcc)"
run python -m pip install -v "$repo" >"$tmp/build.log" 2>&1 || { tail -50 "$tmp/build.log"; exit 1; }
grep "deep_ep_jax: built" "$tmp/build.log"
grep -q "from the nvidia-cuda-nvcc wheel" "$tmp/build.log" || { echo "nvcc did not come from the wheel"; exit 1; }

echo "== import deep_ep_jax._C"
cd "$tmp"  # the installed package, not the checkout
run python -c "from deep_ep_jax import _C, _native; _C.limits(); print(_native.build_summary())"
echo "pip CUDA wheels check passed in $((SECONDS - start)) s"
