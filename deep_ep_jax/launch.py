"""Starts N local processes of a script, one per GPU, for jax.distributed.

    python -m deep_ep_jax.launch -n 2 [--] script.py args...
    python -m deep_ep_jax.launch -n 2 -- -m pytest tests/gpu/test_multiprocess_gpu.py
    python -m deep_ep_jax.launch -n 16 --ranks-per-gpu 8 -- script.py   # 16 ranks on 2 GPUs

Each process gets the environment `initialize()` reads (coordinator address
on localhost with a free port, process id, number of processes) and, when
GPUs are present, CUDA_VISIBLE_DEVICES set to one GPU (the i-th of the
launcher's own CUDA_VISIBLE_DEVICES, if set); with --all-gpus-visible every
process sees all of them and JAX uses only the i-th (NVSHMEM's peer-to-peer
transport wants to see its peers' GPUs). With --ranks-per-gpu K, process i
gets GPU i // K instead, so N processes share ceil(N / K) GPUs (to run EP
groups larger than the GPUs at hand): the processes of one GPU are
time-sliced by the driver, so this checks correctness, not speed; GPU memory
is not preallocated (XLA_PYTHON_CLIENT_PREALLOCATE=false unless set), and
XLA's own collectives across processes do not work there (NCCL refuses two
ranks on one GPU). NVLink multicast stays off
(NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1). Output lines are prefixed with
the rank. The launcher waits for all; when one fails it kills the others and
exits with that process's status (initialize() makes a process that dies of an
uncaught exception exit at once, not after jax.distributed's shutdown wait).
With --keep-going the others run on, and their jax.distributed runtime
survives the loss (RECOVERABLE_VAR: initialize() turns on jax's
jax_enable_recoverability; without it, jax ends every process once the
coordination service misses the dead one's heartbeats). Process 0 hosts that
service: when it dies, every process ends either way.
SIGTERM or SIGHUP to the launcher stops the processes too.

The script calls `deep_ep_jax.launch.initialize()` first; under SLURM or
mpirun (no launcher variables) that falls back to jax's cluster detection.
"""

from __future__ import annotations

import argparse
import errno
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

COORDINATOR_VAR = "JAX_COORDINATOR_ADDRESS"  # also read by jax.distributed itself
NUM_PROCESSES_VAR = "JAX_NUM_PROCESSES"
PROCESS_ID_VAR = "JAX_PROCESS_ID"
LOCAL_DEVICE_VAR = "DEEP_EP_JAX_LOCAL_DEVICE"  # --all-gpus-visible: the GPU ordinal JAX uses
RECOVERABLE_VAR = "DEEP_EP_JAX_RECOVERABLE"  # --keep-going: survivors' jax.distributed outlives a dead process


def initialize(*, recoverable: bool | None = None, **kwargs) -> None:
    """jax.distributed.initialize from the launcher's variables (or, without
    them, from jax's cluster detection: SLURM, Open MPI, ...). On CPU the
    collectives need an implementation across processes: gloo, when the
    installed jax has the option and nothing else was chosen. Idempotent.

    recoverable: the processes outlive one that dies (jax's
    jax_enable_recoverability; default: $DEEP_EP_JAX_RECOVERABLE, which
    `launch --keep-going` sets). Without it jax ends every process once the
    dead one misses its heartbeats (heartbeat_timeout_seconds=, 100 s by
    default). Process 0's death ends all either way (it hosts the
    coordination service)."""
    import jax

    from deep_ep_jax.config import env_bool

    if recoverable is None:
        recoverable = env_bool(RECOVERABLE_VAR, False)
    if recoverable and not jax.distributed.is_initialized():
        try:
            jax.config.update("jax_enable_recoverability", True)
        except AttributeError as e:  # a jax without the option
            raise RuntimeError(
                f"deep_ep_jax.launch.initialize(recoverable=True): jax {jax.__version__} has no "
                f"jax_enable_recoverability; its processes cannot outlive a dead one"
            ) from e

    try:
        # A flag's attribute is made at run time, so type checkers do not know it.
        if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):  # type: ignore[attr-defined]
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:  # an old jax without the option: CPU runs stay single-process
        pass
    if jax.distributed.is_initialized():
        return
    if NUM_PROCESSES_VAR in os.environ:
        kwargs.setdefault("coordinator_address", os.environ[COORDINATOR_VAR])
        kwargs.setdefault("num_processes", int(os.environ[NUM_PROCESSES_VAR]))
        kwargs.setdefault("process_id", int(os.environ[PROCESS_ID_VAR]))
        # The launcher said everything: no SLURM/MPI detection overriding the device choice.
        kwargs.setdefault("cluster_detection_method", "deactivate")
        if os.environ.get(LOCAL_DEVICE_VAR):
            kwargs.setdefault("local_device_ids", [int(os.environ[LOCAL_DEVICE_VAR])])
        sys.excepthook = _exit_at_once(sys.excepthook)
    jax.distributed.initialize(**kwargs)


def _exit_at_once(excepthook):
    """An excepthook that reports the exception, then exits the process at once. A process of the
    launcher's that dies of an uncaught exception would otherwise wait in jax.distributed's shutdown
    for the others (up to its 300 s), which may be waiting for it: the launcher would not see it fail
    and stop them. Exiting skips the atexit handlers, which a failed rank does not need."""

    def hook(exc_type, exc, tb):
        excepthook(exc_type, exc, tb)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed
                pass
        os._exit(1)

    return hook


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel hands out to outgoing connections (Linux's default
    where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    """Free on every interface, as the coordinator binds it ('[::]:port')."""
    families = [(socket.AF_INET, "0.0.0.0")] + ([(socket.AF_INET6, "::")] if socket.has_ipv6 else [])
    for family, host in families:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((host, port))
        except OSError as e:
            if family == socket.AF_INET6 and e.errno == errno.EAFNOSUPPORT:
                continue
            return False
    return True


def _free_port() -> int:
    """A port for the coordinator, from below the ephemeral range: a port in
    that range can be taken by any process's outgoing connection between this
    check and the coordinator's bind (seen with 8 ranks starting at once),
    while one below it is taken only by an explicit bind."""
    low, high = _ephemeral_ports()
    candidates = range(max(1024, low - 10000), low) if low > 2048 else range(high + 1, 65536)
    rng = random.Random()
    for _ in range(200 if len(candidates) else 0):
        port = rng.choice(candidates)
        if _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # everything tried was taken
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _visible_gpus() -> list[str]:
    """GPU ids the launcher may hand out: its CUDA_VISIBLE_DEVICES, or every
    GPU nvidia-smi lists; [] on a machine without GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def _child_env(rank, num_processes, address, gpus, cpu, all_gpus_visible=False, ranks_per_gpu=1, keep_going=False):
    """The environment of process `rank`: the launcher's own, plus what
    initialize() reads and its GPU (the (rank // ranks_per_gpu)-th of gpus)."""
    env = dict(os.environ)
    if keep_going:
        env.setdefault(RECOVERABLE_VAR, "1")
    env[COORDINATOR_VAR] = address
    env[NUM_PROCESSES_VAR] = str(num_processes)
    env[PROCESS_ID_VAR] = str(rank)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
        return env
    gpu = rank // ranks_per_gpu
    if gpus and all_gpus_visible:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        env[LOCAL_DEVICE_VAR] = str(gpu)  # an ordinal among the visible GPUs
    elif gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[gpu]
    if gpus and ranks_per_gpu > 1:
        # XLA's default (75% of the GPU per process) would leave nothing to the GPU's other processes.
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


def _pump(rank, stream, out, lock):
    """Copies a child's output line by line, prefixed with its rank."""
    prefix = f"[rank {rank}] ".encode()
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()


def _stop(procs, grace_s=5.0):
    """SIGTERM to the processes still running, SIGKILL after grace_s."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(
    num_processes,
    command,
    *,
    cpu=False,
    timeout_s=None,
    keep_going=False,
    out=None,
    all_gpus_visible=False,
    ranks_per_gpu=1,
) -> int:
    """Runs `python command...` in num_processes processes; returns 0 when all
    succeed, else the first failure's exit status (124 on timeout). A failure
    stops the others, unless keep_going (then all run to their end).
    Process i runs on GPU i // ranks_per_gpu."""
    out = out if out is not None else sys.stdout.buffer
    if ranks_per_gpu < 1:
        raise ValueError(f"deep_ep_jax.launch: ranks_per_gpu must be >= 1, got {ranks_per_gpu}")
    gpus = [] if cpu else _visible_gpus()
    needed = -(-num_processes // ranks_per_gpu)  # GPUs: ceil(num_processes / ranks_per_gpu)
    if ranks_per_gpu > 1 and not gpus:
        raise SystemExit(
            f"deep_ep_jax.launch: --ranks-per-gpu {ranks_per_gpu} shares GPUs, but "
            + ("--cpu uses none" if cpu else "no GPU was found (CUDA_VISIBLE_DEVICES, nvidia-smi -L)")
        )
    if gpus and len(gpus) < needed:
        per = "one each" if ranks_per_gpu == 1 else f"{ranks_per_gpu} processes per GPU"
        raise SystemExit(
            f"deep_ep_jax.launch: {num_processes} processes need {needed} GPUs ({per}), "
            f"found {len(gpus)} ({','.join(gpus)}); use fewer processes, --ranks-per-gpu, or --cpu"
        )
    address = f"127.0.0.1:{_free_port()}"
    lock = threading.Lock()
    procs, pumps = [], []
    for rank in range(num_processes):
        p = subprocess.Popen(
            [sys.executable, *command],
            env=_child_env(rank, num_processes, address, gpus, cpu, all_gpus_visible, ranks_per_gpu, keep_going),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        procs.append(p)
        t = threading.Thread(target=_pump, args=(rank, p.stdout, out, lock), daemon=True)
        t.start()
        pumps.append(t)

    status = 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    previous = _stop_on_termination()
    try:
        while [p.poll() for p in procs].count(None):  # polls every process (any() would stop early)
            failed = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed and not keep_going:
                rank, status = failed[0]
                _report(out, lock, f"rank {rank} exited with status {status}; stopping the others")
                break
            if deadline is not None and time.monotonic() > deadline:
                status = 124
                _report(out, lock, f"timeout after {timeout_s} s; stopping all processes")
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        status = 130
    except _Terminated as e:
        status = 128 + e.signum
        _report(out, lock, f"{signal.Signals(e.signum).name} received; stopping all processes")
    finally:
        _stop(procs)
        for t in pumps:
            t.join(timeout=5)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if status == 0:
        failed = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode != 0]
        if failed:
            rank, status = failed[0]
            _report(out, lock, f"rank {rank} exited with status {status}")
    # A signal (negative returncode) as the shell reports it.
    return status if status >= 0 else 128 - status


class _Terminated(Exception):
    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def _stop_on_termination() -> dict:
    """SIGTERM and SIGHUP (a job's timeout or kill, a closed terminal) raise _Terminated in the launcher,
    so that it stops its processes (which may not stop on SIGTERM: jax's preemption handling catches it,
    hence _stop's SIGKILL) instead of leaving them running. Returns the handlers it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, frame):
        raise _Terminated(signum)

    return {signum: signal.signal(signum, handler) for signum in (signal.SIGTERM, signal.SIGHUP)}


def _report(out, lock, message):
    with lock:
        out.write(f"[launch] {message}\n".encode())
        out.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deep_ep_jax.launch",
        description="Start N local processes (one GPU each) of a script that calls deep_ep_jax.launch.initialize().",
    )
    parser.add_argument("-n", "--num-processes", type=int, required=True)
    parser.add_argument("--cpu", action="store_true", help="CPU only: JAX_PLATFORMS=cpu, no GPU per process")
    parser.add_argument("--timeout", type=float, default=None, help="stop everything after this many seconds")
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="when a process fails, let the others run on (their jax.distributed survives it: "
        f"{RECOVERABLE_VAR}=1; process 0's death still ends all)",
    )
    parser.add_argument(
        "--all-gpus-visible",
        action="store_true",
        help="every process sees all GPUs and JAX uses the i-th (for NVSHMEM's peer-to-peer transport)",
    )
    parser.add_argument(
        "--ranks-per-gpu",
        type=int,
        default=1,
        metavar="K",
        help="process i uses GPU i // K, so that N processes share ceil(N / K) GPUs; time-sliced: "
        "for correctness runs, not speed",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="script.py args... (or -m module args...)")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(
            f"unrecognized arguments: {' '.join(unknown)} (put `--` before the command, e.g. `-n 2 -- -m pytest ...`)"
        )
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the script to run, e.g. `-n 2 -- script.py`")
    if args.num_processes < 1:
        parser.error("-n must be >= 1")
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    if args.ranks_per_gpu < 1:
        parser.error("--ranks-per-gpu must be >= 1")
    if args.cpu and args.ranks_per_gpu > 1:
        parser.error("--ranks-per-gpu shares GPUs; --cpu uses none (give each process CPU devices with XLA_FLAGS)")
    return launch(
        args.num_processes,
        command,
        cpu=args.cpu,
        timeout_s=args.timeout,
        keep_going=args.keep_going,
        all_gpus_visible=args.all_gpus_visible,
        ranks_per_gpu=args.ranks_per_gpu,
    )


if __name__ == "__main__":
    sys.exit(main())
