"""EP groups across hosts, emulated on one machine: two processes of one GPU
each, configured as two hosts of one GPU (DEEP_EP_JAX_GPUS_PER_HOST=1), so
every transfer goes through NVSHMEM (over its peer-to-peer transport here).
The low-latency and normal-mode suites' core comparisons against the xla
backend (normal mode: the internode kernels, csrc/kernels/internode.cu). The worker is
tests/multiprocess_worker.py; each launch is also runnable by hand:

    DEEP_EP_JAX_GPUS_PER_HOST=1 NVSHMEM_REMOTE_TRANSPORT=none XLA_PYTHON_CLIENT_PREALLOCATE=false \\
        python -m deep_ep_jax.launch -n 2 --all-gpus-visible -- tests/multiprocess_worker.py internode_low_latency

Every process sees both GPUs (--all-gpus-visible; JAX uses one each), so
NVSHMEM can map its peer. Run this module in its own pytest process with
XLA_PYTHON_CLIENT_PREALLOCATE=false (scripts/device_run.sh does).
"""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")
NUM_PROCESSES = 2


def _launch(cases, *, timeout, extra=()):
    from deep_ep_jax.distributed import nvshmem

    # Not a skip: a GPU host runs these tests (conftest), and NVSHMEM (the
    # nvidia-nvshmem-cu13 wheel) belongs there; without it this is a failure.
    reason = nvshmem.unavailable_reason()
    if reason:
        pytest.fail(f"NVSHMEM cannot be used here: {reason}", pytrace=False)
    env = dict(os.environ)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # the symmetric heap and this pytest process need memory too
    env.pop("XLA_FLAGS", None)  # conftest's CPU device count is not for the workers
    env["DEEP_EP_JAX_GPUS_PER_HOST"] = "1"
    # No RDMA NIC needed on one machine: NVSHMEM's peer-to-peer transport carries everything.
    env.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    from test_multiprocess_gpu import sharing_args

    # On a single GPU both processes share it (cases that run no XLA collective across processes).
    cmd = [
        sys.executable,
        "-m",
        "deep_ep_jax.launch",
        "-n",
        str(NUM_PROCESSES),
        "--all-gpus-visible",
        *sharing_args(NUM_PROCESSES),
        "--timeout",
        str(timeout - 15),
        *extra,
        "--",
        WORKER,
        *cases,
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    return result.returncode, result.stdout + result.stderr


def _assert_cases_ok(code, output, cases):
    assert code == 0, output[-8000:]
    for rank in range(NUM_PROCESSES):
        for case in cases:
            assert f"[rank {rank}] process {rank}/{NUM_PROCESSES}: CASE {case} OK" in output, output[-8000:]


def test_low_latency_over_nvshmem():
    code, output = _launch(["internode_low_latency"], timeout=280)
    _assert_cases_ok(code, output, ["internode_low_latency"])


def test_normal_mode_over_nvshmem():
    # Its own processes: NVSHMEM's heap is sized by the first Buffer of a process.
    code, output = _launch(["internode_normal"], timeout=280)
    _assert_cases_ok(code, output, ["internode_normal"])


def test_sequence_wrap_over_nvshmem():
    """Normal and low-latency mode across the 2^31 and 2^32 wraps of the
    sequence numbers (tests/gpu/test_wrap_gpu.py's checks), in its own processes."""
    code, output = _launch(["internode_wrap"], timeout=280)
    _assert_cases_ok(code, output, ["internode_wrap"])


@pytest.mark.gpu(min_gpus=1)  # no XLA collective: two processes may share a single GPU
def test_handlers_refuse_bad_shapes():
    """The internode handlers, called past the Python wrapper (whose checks
    would refuse first), refuse shapes the kernels cannot take with a message."""
    code, output = _launch(["internode_handler_checks"], timeout=200)
    _assert_cases_ok(code, output, ["internode_handler_checks"])


@pytest.mark.gpu(min_gpus=2)  # one process per GPU: why, at test_multiprocess_gpu's twin
def test_launch_mismatch_fails_with_a_message():
    """Processes with different Config.num_sms: the internode kernels report
    the mismatch at once on every rank (test_multiprocess_gpu has the check)."""
    from test_multiprocess_gpu import assert_launch_mismatch_reported

    code, output = _launch(["launch_mismatch"], timeout=200, extra=["--keep-going"])
    assert_launch_mismatch_reported(code, output, NUM_PROCESSES)
