#!/usr/bin/env bash
# Builds deep_ep_jax with Bazel, offline, and checks that it is what setup.py
# builds: the same nvcc commands, and a module that imports with the same FFI
# targets as the pip-built one. Run it after the pip install of .ci/run, with
# that venv active (or PYTHON=/path/to/python). Installs Debian's
# bazel-bootstrap (Bazel 4.2) when `bazel` is missing, which needs root.
#
# BAZEL_TESTS: what `bazel test //:cpu_tests` runs; default one quick file
# (pip CI runs the whole suite already), "all" for the whole CPU suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
tests="${BAZEL_TESTS:-tests/test_validation.py}"
start=$SECONDS

if ! command -v bazel >/dev/null; then
  echo "== install bazel (Debian's bazel-bootstrap)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends bazel-bootstrap >/dev/null
  echo "installed in $((SECONDS - start)) s"
fi

# pip's isolated build had pybind11; configure needs it in this Python too.
if ! "$python" -c "import pybind11" 2>/dev/null; then
  "$python" -m pip install -q "pybind11>=2.10"  # pyproject.toml's build requirement
fi

echo "== bazel/configure.py"
"$python" bazel/configure.py

echo "== bazel build //:extension //:deep_ep_jax //:cpu_tests"
step=$SECONDS
bazel build //:extension //:deep_ep_jax //:cpu_tests
echo "built in $((SECONDS - step)) s"

echo "== same as setup.py"
"$python" bazel/check_same_as_setup.py

echo "== bazel test //:cpu_tests ($tests)"
if [[ "$tests" == all ]]; then
  bazel test //:cpu_tests
else
  bazel test //:cpu_tests --test_arg="$tests"
fi

bazel shutdown
echo "bazel check passed in $((SECONDS - start)) s"
