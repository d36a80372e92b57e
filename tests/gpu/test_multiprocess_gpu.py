"""One process per GPU (CUDA IPC between processes), started by
deep_ep_jax.launch: the normal-mode and low-latency suites' core comparisons
against the xla backend, the MoE layer's grouped path against dense maths,
and a peer process that dies mid-loop ending in the kernels' timeout error on
the survivors. The worker is
tests/multiprocess_worker.py; each launch is also runnable by hand:

    python -m deep_ep_jax.launch -n 2 -- tests/multiprocess_worker.py normal low_latency

Run this module in its own pytest process with XLA_PYTHON_CLIENT_PREALLOCATE=false:
the pytest process itself initialises the GPUs (conftest), and XLA's default
preallocation there would leave the worker processes little memory.
"""

import os
import subprocess
import sys
import time

import jax
import pytest

from deep_ep_jax import testing

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")


def _num_processes():
    return min(len(jax.devices("gpu")), 8)


def sharing_args(num_processes):
    """launch's arguments that fit num_processes on the GPUs at hand: none with a
    GPU each, else --ranks-per-gpu (only for cases that run no XLA collective
    across processes: NCCL refuses two ranks on one GPU)."""
    num_gpus = len(jax.devices("gpu"))
    return [] if num_gpus >= num_processes else ["--ranks-per-gpu", str(-(-num_processes // num_gpus))]


def _at_least_two_processes():
    """(processes, launch args): one per GPU, but at least two, sharing a single GPU."""
    num_processes = max(2, _num_processes())
    return num_processes, sharing_args(num_processes)


def _launch(cases, *, timeout, extra=(), num_processes=None):
    env = dict(os.environ)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # share the GPUs with this pytest process
    env.pop("XLA_FLAGS", None)  # conftest's CPU device count is not for the workers
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [
        sys.executable,
        "-m",
        "deep_ep_jax.launch",
        "-n",
        str(num_processes or _num_processes()),
        "--timeout",
        str(timeout - 15),
        *extra,
        "--",
        WORKER,
        *cases,
    ]
    start = time.time()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    return result.returncode, result.stdout + result.stderr, time.time() - start


def _assert_cases_ok(code, output, cases, num_processes=None):
    assert code == 0, output[-6000:]
    n = num_processes or _num_processes()
    for rank in range(n):
        for case in cases:
            assert f"[rank {rank}] process {rank}/{n}: CASE {case} OK" in output, output[-6000:]


def test_normal_mode_across_processes():
    code, output, _ = _launch(["normal"], timeout=280)
    _assert_cases_ok(code, output, ["normal"])


def test_low_latency_across_processes():
    code, output, _ = _launch(["low_latency"], timeout=280)
    _assert_cases_ok(code, output, ["low_latency"])


@pytest.mark.gpu(min_gpus=1)  # no XLA collective across processes: all 8 may share one GPU
def test_processes_sharing_gpus():
    """launch --ranks-per-gpu: 8 ranks (the kernels' limit) on the GPUs at
    hand, at least 2 per GPU, time-sliced: CUDA IPC between processes of one
    GPU and of different GPUs; each process checks its own rank's normal and
    low-latency results against tests/oracle.py (worker case shared_gpu: no
    XLA collective, which NCCL refuses with two ranks on one GPU)."""
    num_gpus = len(jax.devices("gpu"))
    ranks_per_gpu = max(2, 8 // num_gpus)
    num_processes = min(8, num_gpus * ranks_per_gpu)
    code, output, _ = _launch(
        ["shared_gpu"], timeout=280, extra=["--ranks-per-gpu", str(ranks_per_gpu)], num_processes=num_processes
    )
    _assert_cases_ok(code, output, ["shared_gpu"], num_processes)


@pytest.mark.gpu(min_gpus=1)  # no XLA collective across processes: ranks may share one GPU
@pytest.mark.parametrize("ranks", ["one_per_gpu", "eight"])
def test_moe_layer_across_processes(ranks):
    """The MoE layer's grouped path with each rank in its own process (one per
    GPU, at least two, sharing a single GPU; or 8, the GPUs shared as
    needed): expert-major dispatch of bf16 and FP8 rows, the grouped GEMMs on
    Hopper's kernels, the reduction and combine, forward and every gradient
    against dense maths, for fresh, one expert, a rank that receives nothing
    and -1 routing (worker case shared_gpu_moe_layer)."""
    num_processes, extra = _at_least_two_processes() if ranks == "one_per_gpu" else (8, sharing_args(8))
    code, output, elapsed = _launch(["shared_gpu_moe_layer"], timeout=500, extra=extra, num_processes=num_processes)
    _assert_cases_ok(code, output, ["shared_gpu_moe_layer"], num_processes)
    print(
        f"{num_processes} processes, {elapsed:.0f} s",
        *(line for line in output.splitlines() if ": ok (" in line),
        sep="\n",
    )


def test_sequence_wrap_across_processes():
    """Normal (staged) and low-latency mode across the 2^31 and 2^32 wraps
    of the sequence numbers (tests/gpu/test_wrap_gpu.py's checks)."""
    code, output, _ = _launch(["wrap"], timeout=280)
    _assert_cases_ok(code, output, ["wrap"])


def test_outputs_identical_across_deployments():
    """Dispatch/combine outputs for fixed inputs are bit-identical in every
    process of a one-process-per-GPU run and in this process driving all GPUs."""
    import re

    import test_reliability_gpu as reliability

    code, output, _ = _launch(["digest"], timeout=200)
    _assert_cases_ok(code, output, ["digest"])
    digests = dict(re.findall(r"\[rank (\d+)\] DIGEST ([0-9a-f]{64})", output))
    assert len(digests) == _num_processes(), output[-4000:]
    here = reliability.outputs_digest(testing.ep_mesh(_num_processes(), "ep", platform="gpu"))
    assert set(digests.values()) == {here}, (digests, here)


# With processes sharing a GPU the traps surface one after another, slowly:
# more than two there get a longer limit (run them with pytest's --timeout 600).
@pytest.mark.parametrize("min_processes", [2, 4])
@pytest.mark.gpu(min_gpus=1)
def test_dead_peer_process_times_out_with_a_message(min_processes):
    """Normal mode, one process per GPU (at least min_processes, sharing one
    GPU where there are fewer): the last kills itself mid-loop; every
    survivor's next call fails within Config.timeout_s (3 s) with the kernels'
    message naming its rank, the counter and the peer it waited for (rank 0:
    the dead one) and saying to restart, and exits (a trap loses the CUDA
    context: the documented path is a restart, docs/multiprocess.md); then
    restarted processes pass shared_gpu's checks on the same GPUs."""
    num_processes = max(min_processes, _num_processes())
    limit = 200 if len(jax.devices("gpu")) >= num_processes or num_processes == 2 else 500
    code, output, elapsed = _launch(
        ["kill"], timeout=limit + 40, extra=["--keep-going", *sharing_args(num_processes)], num_processes=num_processes
    )
    assert code != 0, output[-4000:]
    assert "killing myself" in output, output[-4000:]
    assert "NO TIMEOUT" not in output, output[-4000:]
    victim = num_processes - 1
    for rank in range(victim):
        text = "\n".join(line for line in output.splitlines() if line.startswith(f"[rank {rank}]"))
        assert "deep_ep_jax timeout" in text and f"rank {rank} waited" in text, (rank, output[-4000:])
        assert "CUDA context is lost; restart it" in text, (rank, output[-4000:])  # DEEP_EP_JAX_TRAP_NOTE
        assert "failed as expected" in text, (rank, output[-4000:])
        assert rank != 0 or f"peer {victim}" in text, output[-4000:]
    print(f"dead peer, {num_processes} processes: every survivor out in {elapsed:.0f} s")
    assert elapsed < limit, elapsed
    # The documented way on (docs/multiprocess.md): restart the processes; the GPUs serve the new ones.
    code, output, _ = _launch(
        ["shared_gpu"], timeout=240, extra=sharing_args(num_processes), num_processes=num_processes
    )
    _assert_cases_ok(code, output, ["shared_gpu"], num_processes)


def assert_launch_mismatch_reported(code, output, num_processes):
    """Every rank failed at its first call with the kernels' launch-mismatch
    message naming itself and a peer, not with a timeout (tests/multiprocess_worker.py
    case launch_mismatch, also used by test_internode_gpu)."""
    assert code != 0, output[-4000:]
    assert "NO LAUNCH MISMATCH ERROR" not in output and "deep_ep_jax timeout" not in output, output[-4000:]
    for rank in range(num_processes):
        text = "\n".join(line for line in output.splitlines() if line.startswith(f"[rank {rank}]"))
        assert "deep_ep_jax launch mismatch" in text and f"rank {rank} launched" in text, output[-4000:]
        assert "failed as expected" in text, output[-4000:]


# One process per GPU, as a real mismatch (GPUs with different SM counts) has:
# with two processes trapping on one shared GPU, the second one's error took
# over a minute to surface (one H200, 2026-12-01), so the check is not timely there.
@pytest.mark.gpu(min_gpus=2)
def test_launch_mismatch_fails_with_a_message():
    """Processes with different Config.num_sms (as GPUs with different SM
    counts would be): intranode kernels (staged) report the mismatch at once."""
    num_processes, sharing = _at_least_two_processes()
    code, output, elapsed = _launch(
        ["launch_mismatch"], timeout=200, extra=["--keep-going", *sharing], num_processes=num_processes
    )
    assert_launch_mismatch_reported(code, output, num_processes)
    assert elapsed < 150, elapsed
