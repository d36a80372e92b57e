"""NVSHMEM for EP groups that span hosts: one PE per process, started once.

PE p is jax process p. Process 0 makes an NVSHMEM unique id, which travels
through the jax.distributed key-value store under our own key
(`deep_ep_jax/nvshmem/uid`; XLA's NVSHMEM, when on, uses its own); every
process then initialises NVSHMEM on its GPU (collectively). The symmetric heap
is sized from the first Buffer across hosts (NVSHMEM_SYMMETRIC_SIZE, set here
unless the user set it). At exit, Buffers still alive are destroyed and
NVSHMEM is finalised. NVSHMEM's own environment (NVSHMEM_REMOTE_TRANSPORT,
NVSHMEM_IB_SL, NVSHMEM_IBGDA_*, NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME, ...) is
passed through untouched.
"""

from __future__ import annotations

import atexit
import os
import shlex
import threading
import weakref

import jax

from deep_ep_jax import _native
from deep_ep_jax.distributed import multiprocess

UID_KEY = "deep_ep_jax/nvshmem/uid"
XLA_NVSHMEM_FLAG = "--xla_gpu_experimental_enable_nvshmem"
HEAP_ENV = "NVSHMEM_SYMMETRIC_SIZE"
# Heap beyond the first Buffer's needs: NVSHMEM's own symmetric objects.
HEAP_SLACK_BYTES = 256 << 20

_lock = threading.Lock()
_initialized_device = None
_live_buffers: weakref.WeakSet = weakref.WeakSet()  # Buffers in the symmetric heap, destroyed before finalize


def xla_nvshmem_enabled(xla_flags: str | None = None) -> bool:
    """Whether XLA_FLAGS turns on XLA's own NVSHMEM (the last setting wins)."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    enabled = False
    for token in shlex.split(flags):
        name, has_value, value = token.partition("=")
        if name == XLA_NVSHMEM_FLAG:
            enabled = not has_value or value.strip().lower() not in ("false", "0", "no", "off")
    return enabled


def unavailable_reason() -> str | None:
    """Why this process cannot use NVSHMEM for an EP group across hosts, or None."""
    if xla_nvshmem_enabled():
        return (
            f"XLA's own NVSHMEM is on ({XLA_NVSHMEM_FLAG} in XLA_FLAGS); deep_ep_jax would start a second "
            f"NVSHMEM runtime in the same process. Remove the flag, or use Buffer(..., backend='xla')"
        )
    reason = _native.load_error()
    if reason:
        return reason
    if not getattr(_native.extension(), "with_nvshmem", False):
        return (
            "deep_ep_jax._C was built without NVSHMEM: install nvidia-nvshmem-cu13 (or set NVSHMEM_HOME) and "
            "rebuild (`python setup.py build_ext --inplace`; DEEP_EP_JAX_NO_NVSHMEM must not be 1)"
        )
    return uncovered_gpu_reason(_native.extension().cuda_archs(), jax.local_devices())


def uncovered_gpu_reason(compiled, devices) -> str | None:
    """Why the NVSHMEM kernels cannot run on one of `devices`, or None: they are device-linked
    (-rdc), which keeps machine code only, so a GPU that the build covers with PTX alone (e.g.
    an H100 under an sm_80+PTX build) cannot load them, though the other kernels run there."""
    machine_code = _native._machine_code(compiled)
    for device in devices:
        capability = getattr(device, "compute_capability", None)
        if device.platform == "gpu" and capability and not _native._arch_matches(machine_code, capability):
            return (
                f"the NVSHMEM kernels are device-linked, which keeps machine code only, and deep_ep_jax._C has "
                f"it for {machine_code}, not for {device.device_kind} (compute capability {capability}); rebuild "
                f"with DEEP_EP_JAX_CUDA_ARCHS including {capability.replace('.', '')}"
            )
    return None


def check_one_gpu_per_process(devices) -> None:
    """NVSHMEM has one PE per process: refuse a process with several of `devices`."""
    me = jax.process_index()
    mine = [d for d in devices if d.process_index == me]
    if len(mine) > 1:
        raise NotImplementedError(
            f"Buffer(backend='cuda'): this EP group spans hosts (NVSHMEM), and NVSHMEM allows one PE, so one GPU, "
            f"per process, but process {me} has {len(mine)} devices of the mesh ({mine}); start one process per "
            f"GPU (python -m deep_ep_jax.launch, srun --ntasks-per-node=<gpus>, ...)"
        )


def heap_bytes(needed: int) -> int:
    """Symmetric heap for a first Buffer needing `needed` bytes: room for a
    second one of its size and NVSHMEM's own objects, in 2 MiB pages."""
    size = 2 * int(needed) + HEAP_SLACK_BYTES
    return (size + (2 << 20) - 1) // (2 << 20) * (2 << 20)


def initialize(device: int, needed_bytes: int, timeout_s: float) -> None:
    """Starts NVSHMEM on local `device` (once per process; collective: every
    process calls it, with its own device). Raises RuntimeError if unavailable."""
    global _initialized_device
    with _lock:
        if _initialized_device is not None:
            if _initialized_device != device:
                raise RuntimeError(
                    f"deep_ep_jax: NVSHMEM runs on device {_initialized_device} of this process, not {device} "
                    f"(one PE, one GPU per process)"
                )
            return
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"Buffer(backend='cuda'): the EP group spans hosts, which needs NVSHMEM: {reason}")
        ext = _native.extension()
        if HEAP_ENV not in os.environ:  # the user's setting wins
            os.environ[HEAP_ENV] = str(heap_bytes(needed_bytes))
        me, count = jax.process_index(), jax.process_count()
        if me == 0:
            uid = ext.nvshmem_unique_id()
            multiprocess.publish(UID_KEY, uid)
        else:
            uid = multiprocess.fetch(UID_KEY, timeout_s, "the NVSHMEM unique id of process 0")
        ext.nvshmem_init(device, me, count, uid)
        _initialized_device = device
        atexit.register(_finalize_at_exit)


def initialized_device() -> int | None:
    return _initialized_device


def track(buffer) -> None:
    """A Buffer in the symmetric heap: destroyed at exit before NVSHMEM finalizes."""
    _live_buffers.add(buffer)


def untrack(buffer) -> None:
    _live_buffers.discard(buffer)


def _finalize_at_exit() -> None:
    """Destroys the Buffers still alive (collectively), then finalizes NVSHMEM.
    When a Buffer cannot be destroyed (a peer process is gone), NVSHMEM's
    finalize would wait for it forever: skipped."""
    global _initialized_device
    clean = True
    for buffer in sorted(_live_buffers, key=lambda b: b.store_key):  # the same order on every process
        try:
            buffer.destroy()
        except Exception as e:  # noqa: BLE001 (at exit: report, carry on)
            clean = False
            print(
                f"deep_ep_jax: at exit, destroying {buffer!r} failed ({type(e).__name__}: {e}); "
                f"NVSHMEM is not finalized"
            )
    if clean and _initialized_device is not None:
        _native.extension().nvshmem_finalize()
        _initialized_device = None
