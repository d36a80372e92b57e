"""deep_ep_jax.launch's --ranks-per-gpu on CPU: each process's environment
(its GPU, the ordinal JAX uses, no preallocation), the argument checks, and
launches of processes sharing (fake) GPUs. tests/test_multiprocess.py has the
launcher's other behaviour."""

import os
import subprocess
import sys

import pytest

from deep_ep_jax import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")
ADDRESS = "127.0.0.1:1234"


def _envs(num_processes, gpus, ranks_per_gpu, all_gpus_visible=False):
    return [
        launch._child_env(rank, num_processes, ADDRESS, gpus, False, all_gpus_visible, ranks_per_gpu)
        for rank in range(num_processes)
    ]


def test_child_env_keep_going_makes_processes_recoverable(monkeypatch):
    """launch --keep-going: initialize() turns on jax's recoverability (tests/test_multiprocess.py runs it)."""
    monkeypatch.delenv(launch.RECOVERABLE_VAR, raising=False)
    assert launch.RECOVERABLE_VAR not in launch._child_env(0, 2, ADDRESS, [], True)
    assert launch._child_env(0, 2, ADDRESS, [], True, keep_going=True)[launch.RECOVERABLE_VAR] == "1"


def test_child_env_ranks_per_gpu(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    envs = _envs(4, ["3", "5", "6"], ranks_per_gpu=2)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3", "3", "5", "5"]
    assert [e[launch.PROCESS_ID_VAR] for e in envs] == ["0", "1", "2", "3"]
    assert all(e[launch.NUM_PROCESSES_VAR] == "4" and e[launch.COORDINATOR_VAR] == ADDRESS for e in envs)
    assert all(e["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" for e in envs)  # K processes share a GPU's memory
    assert all(launch.LOCAL_DEVICE_VAR not in e for e in envs)
    # Not a multiple: the last GPU gets fewer processes.
    assert [e["CUDA_VISIBLE_DEVICES"] for e in _envs(5, ["3", "5", "6"], ranks_per_gpu=2)] == ["3", "3", "5", "5", "6"]
    # All GPUs visible: JAX uses the (rank // K)-th.
    envs = _envs(6, ["3", "5", "6"], ranks_per_gpu=2, all_gpus_visible=True)
    assert all(e["CUDA_VISIBLE_DEVICES"] == "3,5,6" for e in envs)
    assert [e[launch.LOCAL_DEVICE_VAR] for e in envs] == ["0", "0", "1", "1", "2", "2"]


def test_child_env_one_per_gpu_unchanged(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    envs = _envs(3, ["3", "5", "6"], ranks_per_gpu=1)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3", "5", "6"]
    assert all("XLA_PYTHON_CLIENT_PREALLOCATE" not in e for e in envs)
    envs = _envs(3, ["3", "5", "6"], ranks_per_gpu=1, all_gpus_visible=True)
    assert [e[launch.LOCAL_DEVICE_VAR] for e in envs] == ["0", "1", "2"]


def test_child_env_keeps_the_users_memory_settings(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    assert all(e["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true" for e in _envs(4, ["0", "1"], ranks_per_gpu=2))


def test_child_env_cpu_has_no_gpu():
    env = launch._child_env(1, 4, ADDRESS, [], True, False, 1)
    assert env["JAX_PLATFORMS"] == "cpu" and env["CUDA_VISIBLE_DEVICES"] == ""


def test_coordinator_port_is_below_the_ephemeral_range(monkeypatch):
    """The coordinator's port is one no outgoing connection can take before
    the coordinator binds it, and it is free on every interface."""
    import socket

    low, high = launch._ephemeral_ports()
    ports = {launch._free_port() for _ in range(20)}
    assert all(p >= 1024 and not low <= p <= high for p in ports), (ports, low, high)
    # A port held on the wildcard address is never handed out.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert not launch._bindable(taken)
        monkeypatch.setattr(launch, "_ephemeral_ports", lambda: (taken + 1, 60999))
        monkeypatch.setattr(launch.random.Random, "choice", lambda self, seq: taken)
        assert launch._free_port() != taken  # every try was the held port: the OS picks one


def test_too_few_gpus_are_refused(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(SystemExit, match=r"5 processes need 3 GPUs \(2 processes per GPU\), found 2 \(0,1\)"):
        launch.launch(5, ["-c", "pass"], ranks_per_gpu=2)
    with pytest.raises(SystemExit, match=r"3 processes need 3 GPUs \(one each\), found 2.*--ranks-per-gpu"):
        launch.launch(3, ["-c", "pass"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SystemExit, match="--ranks-per-gpu 2 shares GPUs, but no GPU was found"):
        launch.launch(4, ["-c", "pass"], ranks_per_gpu=2)
    with pytest.raises(ValueError, match="ranks_per_gpu must be >= 1, got 0"):
        launch.launch(4, ["-c", "pass"], ranks_per_gpu=0)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["-n", "4", "--ranks-per-gpu", "0", "--", "-c", "pass"], "--ranks-per-gpu must be >= 1"),
        (["-n", "4", "--cpu", "--ranks-per-gpu", "2", "--", "-c", "pass"], "--cpu uses none"),
        (["-n", "4", "--ranks-per-gpu", "two", "--", "-c", "pass"], "invalid int value"),
        (["-n", "2", "--timeout", "0", "--", "-c", "pass"], "--timeout must be > 0 seconds, got 0"),
        (["-n", "2", "--timeout", "-5", "--", "-c", "pass"], "--timeout must be > 0 seconds, got -5"),
        (["-n", "2", "--cpu", "-m", "pytest"], "unrecognized arguments: -m (put `--` before the command"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _run_launcher(args, *, timeout=120, **env_vars):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **env_vars)
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "deep_ep_jax.launch", "--timeout", str(timeout - 10), *args]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    return result.returncode, result.stdout + result.stderr


# Prints what a process got; initialises jax.distributed from it (CPU: the GPU ids are fake).
SCRIPT = """
import os
from deep_ep_jax import launch
launch.initialize()
import jax
print("got", jax.process_index(), jax.process_count(), os.environ["CUDA_VISIBLE_DEVICES"],
      os.environ.get(launch.LOCAL_DEVICE_VAR, "-"), os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"], flush=True)
"""


@pytest.mark.parametrize("all_gpus_visible", [False, True])
def test_launch_four_processes_on_two_gpus(all_gpus_visible):
    """Four processes, two per (fake) GPU: each gets its rank and its GPU, and
    jax.distributed comes up with four processes."""
    extra = ["--all-gpus-visible"] if all_gpus_visible else []
    code, output = _run_launcher(
        ["-n", "4", "--ranks-per-gpu", "2", *extra, "--", "-c", SCRIPT], CUDA_VISIBLE_DEVICES="6,7"
    )
    assert code == 0, output[-4000:]
    for rank in range(4):
        gpu = "67"[rank // 2]
        want = f"6,7 {rank // 2}" if all_gpus_visible else f"{gpu} -"
        assert f"[rank {rank}] got {rank} 4 {want} false" in output, output[-4000:]


def test_launcher_refuses_too_few_gpus():
    code, output = _run_launcher(["-n", "5", "--ranks-per-gpu", "2", "--", "-c", "pass"], CUDA_VISIBLE_DEVICES="6,7")
    assert code != 0 and "5 processes need 3 GPUs" in output, output


def _cpu_collectives():
    import jax

    return hasattr(jax.config, "jax_cpu_collectives_implementation")


@pytest.mark.skipif(not _cpu_collectives(), reason="this jax has no CPU collectives across processes")
def test_moe_layer_case_on_cpu():
    """The worker case of the MoE layer with a process per rank
    (tests/gpu/test_multiprocess_gpu.py), on the xla backend across two CPU
    processes: the case itself is right."""
    code, output = _run_launcher(["-n", "2", "--cpu", "--", WORKER, "shared_gpu_moe_layer"], timeout=400)
    assert code == 0, output[-6000:]
    for rank in range(2):
        assert f"[rank {rank}] process {rank}/2: CASE shared_gpu_moe_layer OK" in output, output[-6000:]
