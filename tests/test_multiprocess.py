"""Several processes on CPU, started by deep_ep_jax.launch: the xla backend
across processes against the oracle (also through the GPU scale tests' worker
case), the key-value handle exchange (and its timeout), and the launcher's own
behaviour (rank prefixes, failure handling, processes outliving a dead one).
The worker is tests/multiprocess_worker.py."""

import os
import signal
import subprocess
import sys
import time

import jax
import pytest

from deep_ep_jax import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")


def _cpu_collectives_reason():
    try:
        jax.config.jax_cpu_collectives_implementation  # noqa: B018
    except AttributeError:
        return f"jax {jax.__version__} has no CPU collectives across processes (jax_cpu_collectives_implementation)"
    return None


needs_cpu_collectives = pytest.mark.skipif(_cpu_collectives_reason() is not None, reason=str(_cpu_collectives_reason()))


def _launch(num_processes, args, *, devices_per_process=1, timeout=120, launcher_timeout=None, extra=(), env=None):
    env = dict(os.environ, **(env or {}))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_process}"
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    launcher_timeout = timeout - 10 if launcher_timeout is None else launcher_timeout
    cmd = [
        sys.executable,
        "-m",
        "deep_ep_jax.launch",
        "-n",
        str(num_processes),
        "--cpu",
        "--timeout",
        str(launcher_timeout),
        *extra,
        "--",
        *args,
    ]
    start = time.time()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout + result.stderr, time.time() - start


@needs_cpu_collectives
@pytest.mark.parametrize("num_processes,devices_per_process", [(2, 1), (2, 2), (4, 1)])
def test_reference_backend_across_processes(num_processes, devices_per_process):
    cases = ["reference", "exchange", "hosts", "nvshmem_outcome"] if devices_per_process == 1 else ["reference"]
    code, output, _ = _launch(num_processes, [WORKER, *cases], devices_per_process=devices_per_process)
    assert code == 0, output[-4000:]
    for rank in range(num_processes):
        for case in cases:
            assert f"[rank {rank}] process {rank}/{num_processes}: CASE {case} OK" in output, output[-4000:]


@needs_cpu_collectives
def test_shared_gpu_case_on_cpu():
    """The worker case the GPU scale tests run (tests/gpu/test_scale_gpu.py),
    here on the xla backend, so that its inputs, oracle checks and NaN poison
    stay right between the GPU runs: normal mode, its cached dispatch, FP8,
    MXFP8 and NVFP4 pairs, and low-latency mode whole and by halves; and case mesh_order's
    refusals; and cases wait_times (zeros) and traffic (the xla backend's
    counters against the oracle), and masked_rank with no rank stopping (the xla backend masks none)."""
    cases = ("shared_gpu", "mesh_order", "wait_times", "traffic", "masked_rank")
    code, output, _ = _launch(2, [WORKER, *cases], env={"MASKED_RANK_MODE": "none"})
    assert code == 0, output[-4000:]
    for rank in range(2):
        for case in cases:
            assert f"[rank {rank}] process {rank}/2: CASE {case} OK" in output, output[-4000:]
    # 4 routings x ((bf16, FP8) x (whole, halves) + MXFP8 whole) low-latency checks per rank.
    assert output.count("shared_gpu low-latency ") == 2 * 20, output[-4000:]
    assert output.count("mxfp8=True split=False: ok") == 2 * 4, output[-4000:]
    # 3 routings x (MXFP8, NVFP4, NVFP4 packed) per rank, byte for byte.
    assert output.count("shared_gpu MXFP8 ") + output.count("shared_gpu NVFP4 ") == 2 * 9, output[-4000:]
    assert output.count("masked_rank R=2: ok") == 2, output[-4000:]


def test_launcher_stops_the_others_when_one_fails(tmp_path):
    # Rank 1 fails once every rank has said hello (files in tmp_path), so a
    # slow start of the others on a busy machine cannot hide their greeting.
    script = (
        "import os, sys, time\n"
        "rank = int(os.environ['JAX_PROCESS_ID'])\n"
        "print('hello from', rank, 'of', os.environ['JAX_NUM_PROCESSES'],\n"
        "      os.environ['JAX_COORDINATOR_ADDRESS'], flush=True)\n"
        f"open(os.path.join({str(tmp_path)!r}, str(rank)), 'w').close()\n"
        f"while rank == 1 and len(os.listdir({str(tmp_path)!r})) < 3: time.sleep(0.05)\n"
        "sys.exit(3) if rank == 1 else time.sleep(100)\n"
    )
    code, output, elapsed = _launch(3, ["-c", script], timeout=60)
    assert code == 3, output
    assert elapsed < 30, (elapsed, output)
    for rank in range(3):
        assert f"[rank {rank}] hello from {rank} of 3 127.0.0.1:" in output, output
    assert "rank 1 exited with status 3" in output, output


def test_launcher_keep_going():
    script = (
        "import os, sys, time\n"
        "rank = int(os.environ['JAX_PROCESS_ID'])\n"
        "sys.exit(5) if rank == 1 else (time.sleep(1), print('finished'))\n"
    )
    code, output, _ = _launch(2, ["-c", script], timeout=60, extra=["--keep-going"])
    assert code == 5, output
    assert "[rank 0] finished" in output, output


# Rank argv[1] kills itself once every process's backend is up; the others outlive its missed heartbeats.
DEAD_PROCESS_SCRIPT = (
    "import os, sys, time\n"
    "from deep_ep_jax import launch\n"
    "launch.initialize(heartbeat_timeout_seconds=2)\n"
    "import jax\n"
    "rank = jax.process_index()\n"
    "jax.devices()\n"
    "if rank == int(sys.argv[1]): os.kill(os.getpid(), 9)\n"
    "time.sleep(8)\n"
    "print('survivor', rank, float(jax.numpy.arange(4.0).sum()), flush=True)\n"
    "os._exit(0)  # no shutdown: process 0's would end the service under the other's (docs/multiprocess.md)\n"
)


@pytest.mark.parametrize("recoverable", [True, False])
def test_survivors_of_a_dead_process(recoverable):
    """With --keep-going, the processes outlive one killed after initialize() (jax's recoverability, which
    launch sets); without recoverability jax's coordination service ends them once the dead one misses its
    heartbeats."""
    extra_env = {} if recoverable else {launch.RECOVERABLE_VAR: "0"}
    code, output, _ = _launch(3, ["-c", DEAD_PROCESS_SCRIPT, "2"], timeout=90, extra=["--keep-going"], env=extra_env)
    survivors = [f"[rank {r}] survivor {r} 6.0" in output for r in (0, 1)]
    if recoverable:
        assert code == 128 + 9 and all(survivors), output[-4000:]  # the status of the killed rank, the only failure
    else:  # the lowest failed rank's status: 0's abort
        assert code == 128 + signal.SIGABRT and not any(survivors), output[-4000:]
        assert "JAX distributed service detected fatal errors" in output, output[-4000:]


def test_process_0_dying_ends_all():
    """Process 0 hosts jax's coordination service: its death ends every process, recoverable or not."""
    code, output, _ = _launch(3, ["-c", DEAD_PROCESS_SCRIPT, "0"], timeout=90, extra=["--keep-going"])
    assert code != 0 and "survivor" not in output, output[-4000:]
    assert "JAX distributed service detected fatal errors" in output, output[-4000:]


def test_launcher_timeout():
    code, output, elapsed = _launch(2, ["-c", "import time; time.sleep(100)"], timeout=60, launcher_timeout=2)
    assert code == 124 and "timeout after 2" in output, output
    assert elapsed < 20, elapsed


def test_a_rank_dying_after_initialize_stops_the_others():
    """A rank that dies of an exception after launch.initialize() exits at once (not after jax.distributed's
    shutdown wait for the others), so the launcher stops the rank still sleeping and reports the failure."""
    script = (
        "import time\n"
        "from deep_ep_jax import launch\n"
        "launch.initialize()\n"
        "import jax\n"
        "if jax.process_index() == 1: raise RuntimeError('rank 1 fails')\n"
        "time.sleep(100)\n"
    )
    code, output, elapsed = _launch(2, ["-c", script], timeout=90)
    assert code == 1, output[-4000:]
    assert "[rank 1] RuntimeError: rank 1 fails" in output and "rank 1 exited with status 1" in output, output[-4000:]
    assert elapsed < 45, (elapsed, output[-4000:])


def test_sigterm_to_the_launcher_stops_its_processes():
    """SIGTERM to the launcher (a job's time limit, `timeout`) stops its processes, even initialised ones
    (jax catches their SIGTERM; the launcher kills them), and the launcher exits with 128 + 15."""
    script = (
        "import os, time\n"
        "from deep_ep_jax import launch\n"
        "launch.initialize()\n"
        "print('pid', os.getpid(), flush=True)\n"
        "time.sleep(100)\n"
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    launcher = subprocess.Popen(
        [sys.executable, "-m", "deep_ep_jax.launch", "-n", "2", "--cpu", "--", "-c", script],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids, lines = [], []
    try:
        while len(pids) < 2:
            line = launcher.stdout.readline()
            assert line, "the launcher ended before both ranks started: " + "".join(lines[-40:])
            lines.append(line)
            if "] pid " in line:
                pids.append(int(line.split()[-1]))
        launcher.send_signal(signal.SIGTERM)
        rest, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, "".join(lines) + rest
    assert "[launch] SIGTERM received; stopping all processes" in rest, rest
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
