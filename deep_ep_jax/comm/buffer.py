"""Buffer: the communication state of one expert-parallel mesh axis.

Created eagerly, outside `jit`. It picks its backend and path once, when
made, and holds the operations it runs as `buffer.ops`. With the CUDA
backend it owns device memory on every device of the axis
(`deep_ep_jax.backends.cuda.lifecycle`); with the xla backend it holds only
the axis description.
"""

from __future__ import annotations

import itertools
import warnings

import jax
import numpy as np

from deep_ep_jax.backends import Ops
from deep_ep_jax.comm.mesh import ep_groups
from deep_ep_jax.config import TRAFFIC_FIELDS, Config, is_bool, is_int

BACKENDS = ("auto", "cuda", "xla")
_keys = itertools.count()  # Buffer.key: unlike id(), never reused by a later Buffer


def _is_gpu(device) -> bool:
    return device.platform in ("gpu", "cuda")


def _under_trace() -> bool:
    """Whether this runs while JAX traces a function (jit, shard_map, grad, ...): every operation is staged."""
    return isinstance(jax.numpy.zeros(()), jax.core.Tracer)


def _cuda_unavailable_reason(devices) -> str | None:
    if not all(_is_gpu(d) for d in devices):
        platforms = sorted({d.platform for d in devices})
        return f"the mesh's devices are {platforms}, not CUDA GPUs"
    from deep_ep_jax import _native

    return _native.unavailable_reason()


def _ops(backend, spans_hosts) -> Ops:
    """The operations of a Buffer on `backend` (one host, or across hosts)."""
    if backend == "xla":
        from deep_ep_jax.backends import reference

        return Ops.of(reference)
    from deep_ep_jax.backends.cuda import internode, intranode, layout, low_latency

    return Ops.of(layout, internode if spans_hosts else intranode, low_latency)


def _reference_hosts(mesh, axis_name, config, low_latency_mode) -> tuple:
    """The host of each rank for the xla backend, decided as the CUDA backend
    decides it (hostnames and NVLink domains, cut by Config.gpus_per_host and gpus_per_nvlink_domain). Its one program
    serves every EP group of the mesh, so all must be cut alike; and, as on
    the CUDA backend, normal mode across hosts needs hosts of equal size."""
    from deep_ep_jax.distributed import multiprocess

    nodes, _ = multiprocess.mesh_group_places(mesh, axis_name, config)
    if any(n != nodes[0] for n in nodes):
        raise NotImplementedError(
            f"Buffer(backend='xla'): the EP groups of the mesh are cut into hosts differently ({nodes}); the "
            f"reference backend sums combine per host and needs one cut for all groups"
        )
    if not low_latency_mode:
        multiprocess.ranks_per_host(nodes[0], "xla")
    return tuple(nodes[0])


class Buffer:
    """Communication buffer for dispatch/combine over `mesh` axis `axis_name`.

    Args:
      mesh: a `jax.sharding.Mesh`.
      axis_name: the expert-parallel axis (R ranks; rank r owns experts
        [r*E/R, (r+1)*E/R)).
      backend: "cuda" (the kernels), "xla" (the pure-JAX reference backend,
        any platform) or "auto" (cuda on GPUs when the extension is built).
      num_nvl_bytes: bytes of the normal-mode region per device (CUDA);
        default from the size hint for `hidden`.
      num_rdma_bytes: bytes of the low-latency region per device (CUDA);
        default from the size hint when `low_latency_mode`.
      low_latency_mode: also allocate the low-latency region.
      num_max_dispatch_tokens_per_rank, hidden, num_experts: the shapes the
        buffer is sized for; calls are checked against them when given.
      config: kernel launch configuration (`deep_ep_jax.Config`).

    `buffer.ops` holds the operations it runs (`deep_ep_jax.backends.Ops`).
    """

    def __init__(
        self,
        mesh: jax.sharding.Mesh,
        axis_name: str,
        *,
        backend: str = "auto",
        num_nvl_bytes: int | None = None,
        num_rdma_bytes: int | None = None,
        low_latency_mode: bool = False,
        num_max_dispatch_tokens_per_rank: int | None = None,
        hidden: int | None = None,
        num_experts: int | None = None,
        config: Config | None = None,
    ) -> None:
        if _under_trace():  # a CUDA Buffer would allocate (and register with its peers) once per trace
            raise RuntimeError("Buffer: create it eagerly, outside jit (and outside shard_map), and use it inside")
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"Buffer: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if axis_name not in mesh.axis_names:
            raise ValueError(f"Buffer: axis_name {axis_name!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
        if backend not in BACKENDS:
            raise ValueError(f"Buffer: backend must be one of {BACKENDS}, got {backend!r}")
        for name, value in (
            ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
            ("hidden", hidden),
            ("num_experts", num_experts),
            ("num_nvl_bytes", num_nvl_bytes),
            ("num_rdma_bytes", num_rdma_bytes),
        ):
            if value is not None and (not is_int(value) or value <= 0):
                raise ValueError(f"Buffer: {name} must be a positive int or None, got {value!r}")
        if not is_bool(low_latency_mode):
            raise TypeError(
                f"Buffer: low_latency_mode must be a bool, got {type(low_latency_mode).__name__} {low_latency_mode!r}"
            )
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"Buffer: config must be a deep_ep_jax.Config or None, got {type(config).__name__}")
        self.mesh = mesh
        self.axis_name = axis_name
        self.num_ranks = int(mesh.shape[axis_name])
        if num_experts is not None and num_experts % self.num_ranks:
            raise ValueError(
                f"Buffer: num_experts ({num_experts}) must be divisible by the size of axis "
                f"{axis_name!r} ({self.num_ranks})"
            )
        if low_latency_mode and num_max_dispatch_tokens_per_rank is None:
            raise ValueError("Buffer: low_latency_mode=True needs num_max_dispatch_tokens_per_rank")
        self.low_latency_mode = bool(low_latency_mode)
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.hidden = hidden
        self.num_experts = num_experts
        self.config = config if config is not None else Config()
        self.key = next(_keys)  # this Buffer among all of the process (a low-latency send's pending value names it)
        self.buffer_id: int | None = None  # the extension's, set by the CUDA backend when it allocates
        self.num_nvl_bytes = self.num_rdma_bytes = 0
        # Decided by the CUDA backend (backends/cuda/lifecycle.py) when it allocates:
        self.ipc = False  # peers in other processes, reached through CUDA IPC
        self.staged = False  # normal mode lands rows in the normal region (ipc, or DEEP_EP_JAX_STAGED=1)
        # The EP group spans nodes (docs/internode.md: a node is one host, real or cut by
        # Config.gpus_per_host, or one NVLink domain across hosts): normal mode is
        # backends/cuda/internode.py.
        self.spans_hosts = False
        # Its processes are on several hosts: both regions are in NVSHMEM's symmetric heap
        # (peers of the node mapped by NVSHMEM, the others reached through its transports).
        self.nvshmem = False
        self.num_nodes = 1  # nodes of the EP group
        # The host (0..num_nodes-1) of each rank, every backend: combine sums per host first
        # (docs/internode.md), so the xla backend reproduces the kernels' order.
        self.rank_hosts = (0,) * self.num_ranks
        self.num_send_bytes = 0  # its send area (rows staged for other hosts)
        self.store_key = None  # a multi-process Buffer's keys in the jax.distributed store
        # Device ids of each EP group in rank order: a program's mesh must give every device the same rank
        # and peers (validation.same_mesh).
        self.ep_groups = ep_groups(mesh, axis_name)

        devices = list(mesh.devices.flat)
        reason = _cuda_unavailable_reason(devices)
        if backend == "cuda" and reason:
            raise RuntimeError(f"Buffer(backend='cuda') is not available: {reason}")
        self.backend = "cuda" if backend == "cuda" or (backend == "auto" and not reason) else "xla"
        if backend == "auto" and reason and all(_is_gpu(d) for d in devices):
            # On GPUs the kernels were expected: say why the reference backend runs instead.
            warnings.warn(f"Buffer(backend='auto'): the mesh's GPUs run the xla backend, the CUDA one is not "
                          f"available: {reason}", stacklevel=2)  # fmt: skip
        self._destroyed = False
        if self.backend == "cuda":
            from deep_ep_jax.backends.cuda import lifecycle

            lifecycle.allocate(self, num_nvl_bytes, num_rdma_bytes)
        else:
            self.rank_hosts = _reference_hosts(mesh, axis_name, self.config, self.low_latency_mode)
            self.num_nodes = max(self.rank_hosts) + 1
            self.spans_hosts = self.num_nodes > 1
        # xla backend, Config.count_traffic: {rank: {op: counters}}
        self._reference_traffic: dict[int, dict[str, dict[str, int]]] = {}
        self.ops = _ops(self.backend, self.spans_hosts)

    # Traffic counters (Config.count_traffic) ------------------------------

    TRAFFIC_OPS = ("dispatch", "cached_dispatch", "combine")

    def traffic(self) -> dict:
        """Rows and bytes normal mode moved since the Buffer was made (or
        `reset_traffic`), per rank of this process: {rank: {op: {"nvlink_rows",
        "nvlink_bytes", "network_rows", "network_bytes"}}}, op in TRAFFIC_OPS
        (cached_dispatch: combine's backward). A rank counts what its kernels
        move: rows stored into or loaded from another rank's memory on its host
        (NVLink), rows put to another host (network); bytes are the rows' data
        and FP8 scales (docs/internode.md). The xla backend gives what the CUDA
        kernels would count. Needs Config(count_traffic=True). A host call:
        run it outside jit, after jax.block_until_ready on the calls' results.
        With several EP groups (other mesh axes), each rank sums its groups."""
        self._check_counting("Buffer.traffic")
        if self.backend == "xla":
            jax.effects_barrier()  # the counting callbacks of finished programs
            # Every rank of this process, zeros where nothing was counted (as the CUDA counters read).
            counts: dict[int, dict[str, dict[str, int]]] = {rank: {} for rank in self._local_ranks()}
            counts.update(
                {rank: {op: dict(c) for op, c in ops.items()} for rank, ops in self._reference_traffic.items()}
            )
        else:
            from deep_ep_jax import _native

            assert self.buffer_id is not None  # a live CUDA Buffer has one (lifecycle.allocate)
            counts = {}
            for rank, kinds in _native.extension().read_traffic(int(self.buffer_id)):
                ops = counts.setdefault(rank, {})
                for op, values in zip(self.TRAFFIC_OPS, kinds):
                    entry = ops.setdefault(op, dict.fromkeys(TRAFFIC_FIELDS, 0))
                    for field, value in zip(TRAFFIC_FIELDS, values):
                        entry[field] += int(value)
        for ops in counts.values():
            for op in self.TRAFFIC_OPS:
                ops.setdefault(op, dict.fromkeys(TRAFFIC_FIELDS, 0))
        return counts

    def reset_traffic(self) -> None:
        """Zeroes the traffic counters (outside jit, once the calls have finished)."""
        self._check_counting("Buffer.reset_traffic")
        if self.backend == "xla":
            jax.effects_barrier()
            self._reference_traffic.clear()
        else:
            from deep_ep_jax import _native

            assert self.buffer_id is not None
            _native.extension().reset_traffic(int(self.buffer_id))

    def _check_host_call(self, fn_name: str) -> None:
        """The counters live on the host side of the device's memory: read
        under a trace, they would be one reading frozen into the program."""
        self.check_alive(fn_name)
        if _under_trace():
            raise RuntimeError(f"{fn_name} is a host call: run it outside jit (after jax.block_until_ready)")

    def _check_counting(self, fn_name: str) -> None:
        self._check_host_call(fn_name)
        if not self.config.count_traffic:
            raise RuntimeError(
                f"{fn_name}: traffic is counted only with Config(count_traffic=True) (or DEEP_EP_JAX_COUNT_TRAFFIC=1)"
            )
        if self.backend == "cuda" and self.buffer_id is not None and not self.num_nvl_bytes:
            raise RuntimeError(f"{fn_name}: this Buffer has no normal-mode region, so nothing to count")

    # Wait times (low-latency receives) -----------------------------------

    WAIT_KINDS = ("dispatch", "combine")

    def wait_times(self) -> dict:
        """Seconds the low-latency receives of each rank of this process have
        waited for each source rank's rows since the Buffer was made (or
        `reset_wait_times`): {rank: {"dispatch": float64 [R], "combine":
        float64 [R]}}, entry s the waits for rank s. Always counted (a clock
        read when a wait is not over at once): a rank whose entry grows on
        the other ranks is slow, before it is late enough to time out. The xla
        backend does not wait: zeros. A host call: run it outside jit, after
        jax.block_until_ready on the calls' results. With several EP groups
        (other mesh axes), each rank sums its groups."""
        self._check_low_latency("Buffer.wait_times")
        if self.backend == "xla":
            return {rank: {kind: np.zeros(self.num_ranks) for kind in self.WAIT_KINDS} for rank in self._local_ranks()}
        from deep_ep_jax import _native

        assert self.buffer_id is not None  # a live CUDA Buffer has one (lifecycle.allocate)
        times: dict[int, dict] = {}
        for rank, kinds in _native.extension().read_wait_times(int(self.buffer_id)):
            mine = times.setdefault(rank, {kind: np.zeros(self.num_ranks) for kind in self.WAIT_KINDS})
            for kind, ns in zip(self.WAIT_KINDS, kinds):
                mine[kind] += np.asarray(ns, np.float64) * 1e-9
        return times

    def reset_wait_times(self) -> None:
        """Zeroes the wait-time counters (outside jit, once the calls have finished)."""
        self._check_low_latency("Buffer.reset_wait_times")
        if self.backend == "cuda":
            from deep_ep_jax import _native

            assert self.buffer_id is not None
            _native.extension().reset_wait_times(int(self.buffer_id))

    def _local_ranks(self) -> list[int]:
        """The ranks of this process's devices (in every EP group)."""
        from deep_ep_jax.distributed import multiprocess

        return [
            rank
            for row in multiprocess.device_grid(self.mesh, self.axis_name)
            for rank, device in enumerate(row)
            if device.process_index == jax.process_index()
        ]

    def _check_low_latency(self, fn_name: str) -> None:
        self._check_host_call(fn_name)
        if not self.low_latency_mode:
            raise RuntimeError(
                f"{fn_name}: only low-latency mode's receives are timed; create the Buffer with low_latency_mode=True"
            )

    # Lifecycle ------------------------------------------------------------

    def destroy(self) -> None:
        """Frees the device memory. Calls traced afterwards fail at trace time; on
        the CUDA backend a program compiled before fails when run (the xla backend
        holds no memory: there such a program still runs)."""
        if self._destroyed:
            return
        self._destroyed = True
        if self.buffer_id is not None:
            from deep_ep_jax.backends.cuda import lifecycle

            lifecycle.destroy(self)

    def __copy__(self) -> Buffer:
        return self  # a handle to device memory: a copy freeing it would free the original's

    def __deepcopy__(self, memo: dict) -> Buffer:
        return self

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def check_alive(self, fn_name: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"{fn_name}: the Buffer was destroyed; create a new one")

    @property
    def peer_memory(self) -> str:
        """How the kernels reach their peers' memory: "NVSHMEM" (processes on several hosts),
        "CUDA IPC" (several processes of one host), "peer access" (one process), or "none"
        (the xla backend)."""
        if self.backend != "cuda":
            return "none"
        return "NVSHMEM" if self.nvshmem else "CUDA IPC" if self.ipc else "peer access"

    def __repr__(self) -> str:
        return (
            f"Buffer(axis={self.axis_name!r}, num_ranks={self.num_ranks}, backend={self.backend!r}, "
            f"low_latency_mode={self.low_latency_mode}, spans_hosts={self.spans_hosts}, "
            f"peer_memory={self.peer_memory!r}, id={self.buffer_id})"
        )
