"""Buffer: the communication state of one expert-parallel mesh axis.

Created eagerly, outside `jit`. With the CUDA backend it owns device memory
(plain cudaMalloc, not XLA's) on every device of the axis, registered under an
integer id that the custom calls carry as an attribute. With the xla backend
it holds only the axis description.
"""

from __future__ import annotations

import jax
import numpy as np

from deep_ep_jax import multiprocess
from deep_ep_jax.config import Config

BACKENDS = ("auto", "cuda", "xla")


def _is_gpu(device) -> bool:
    return device.platform in ("gpu", "cuda")


def _cuda_unavailable_reason(devices) -> str | None:
    if not all(_is_gpu(d) for d in devices):
        platforms = sorted({d.platform for d in devices})
        return f"the mesh's devices are {platforms}, not CUDA GPUs"
    from deep_ep_jax import _native

    return _native.unavailable_reason()


def _backend_module(name: str):
    if name == "xla":
        from deep_ep_jax.backends import reference

        return reference
    from deep_ep_jax.backends import cuda

    return cuda


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
    """

    def __init__(
        self,
        mesh,
        axis_name,
        *,
        backend="auto",
        num_nvl_bytes=None,
        num_rdma_bytes=None,
        low_latency_mode=False,
        num_max_dispatch_tokens_per_rank=None,
        hidden=None,
        num_experts=None,
        config=None,
    ):
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
            if value is not None and (not isinstance(value, (int, np.integer)) or value <= 0):
                raise ValueError(f"Buffer: {name} must be a positive int or None, got {value!r}")
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
        self.buffer_id = None
        self.num_nvl_bytes = self.num_rdma_bytes = 0
        # Peers in other processes, reached through CUDA IPC (normal mode then
        # lands rows in the buffer's regions: staged).
        self.ipc = False
        self._ipc_name = None
        # An EP group spans hosts (real ones, or Config.gpus_per_host): both
        # regions are in NVSHMEM's symmetric heap, ranks on other hosts are
        # reached through NVSHMEM (normal mode: backends/cuda_internode.py).
        self.spans_hosts = False
        self.num_nodes = 1  # hosts of the EP group
        self.num_send_bytes = 0  # its send area (rows staged for other hosts)

        devices = list(mesh.devices.flat)
        reason = _cuda_unavailable_reason(devices)
        if backend == "cuda" and reason:
            raise RuntimeError(f"Buffer(backend='cuda') is not available: {reason}")
        self.backend = "cuda" if backend == "cuda" or (backend == "auto" and not reason) else "xla"
        self._ops = _backend_module(self.backend)
        self._destroyed = False
        if self.backend == "cuda":
            self._allocate(num_nvl_bytes, num_rdma_bytes)

    def _device_grid(self):
        """The mesh's devices as [group, rank]: one EP group per index of the
        other mesh axes, in rank order."""
        axis = self.mesh.axis_names.index(self.axis_name)
        return np.moveaxis(self.mesh.devices, axis, -1).reshape(-1, self.num_ranks)

    def _groups(self):
        """Local CUDA ordinal of each rank of each EP group, -1 for a device of another process."""
        me = jax.process_index()
        return [[d.local_hardware_id if d.process_index == me else -1 for d in row] for row in self._device_grid()]

    def _group_nodes(self, spans_processes):
        """Node (host) index of each rank of each EP group: from the processes'
        hostnames (traded when the mesh spans processes), cut further by
        Config.gpus_per_host."""
        if spans_processes:
            hosts = multiprocess.hostnames(self.config.timeout_s)
        else:
            hosts = {jax.process_index(): "localhost"}
        return [
            multiprocess.group_nodes([hosts[d.process_index] for d in row], self.config.gpus_per_host)
            for row in self._device_grid()
        ]

    def _allocate(self, num_nvl_bytes, num_rdma_bytes):
        ops = self._ops
        groups = self._groups()
        mine = [g for g in groups if any(d >= 0 for d in g)]  # groups with devices of this process
        spans_processes = multiprocess.spans_processes(self.mesh.devices.flat)
        if spans_processes:
            # Advanced on every process alike, so keys agree (SPMD: same Buffers, same order).
            self._ipc_name = multiprocess.next_buffer_name()
        # Decided from what every process knows alike, so all take the same path.
        nodes = self._group_nodes(spans_processes)
        self.spans_hosts = any(len(set(n)) > 1 for n in nodes)
        if self.spans_hosts:
            self._allocate_nvshmem(groups, nodes, num_nvl_bytes, num_rdma_bytes)
            return
        self.ipc = any(-1 in g for g in mine)
        if self.ipc and any(sum(d >= 0 for d in g) != 1 for g in mine):
            raise NotImplementedError(
                "Buffer(backend='cuda'): an EP group that spans processes must have exactly one device of "
                "each process (one process per GPU); this process has several devices in such a group"
            )
        self.num_nvl_bytes = num_nvl_bytes or ops.normal_region_bytes(
            self.num_ranks, self.hidden, None, self.config, force_staged=self.ipc
        )
        if self.low_latency_mode:
            self.num_rdma_bytes = num_rdma_bytes or ops.low_latency_region_bytes(
                self.num_ranks, self.num_experts, self.hidden, self.num_max_dispatch_tokens_per_rank
            )
        if not self.ipc:  # every group this process touches is all its own
            self.buffer_id = ops.create_buffer(mine, self.num_nvl_bytes, self.num_rdma_bytes)
            return
        self.buffer_id, handles = ops.create_ipc_buffer(groups, self.num_nvl_bytes, self.num_rdma_bytes)
        try:
            self._open_ipc_peers(groups, handles)
        except BaseException:
            ops.destroy_buffer(self.buffer_id)
            self.buffer_id = None
            raise

    def _allocate_nvshmem(self, groups, nodes, num_nvl_bytes, num_rdma_bytes):
        """The normal and low-latency regions in NVSHMEM's symmetric heap
        (collective: every process of the mesh creates the Buffer)."""
        from deep_ep_jax import nvshmem

        devices = list(self.mesh.devices.flat)
        nvshmem.check_one_gpu_per_process(devices)
        if {d.process_index for d in devices} != set(range(jax.process_count())):
            raise NotImplementedError(
                "Buffer(backend='cuda'): an EP group across hosts uses NVSHMEM, whose PEs are all jax processes; "
                "the mesh must hold a device of every process"
            )
        g, r = next((g, r) for g, row in enumerate(groups) for r, d in enumerate(row) if d >= 0)
        device = groups[g][r]
        from deep_ep_jax.backends import cuda_internode

        self.num_nodes = cuda_internode.check_nodes(nodes[g])
        reason = nvshmem.unavailable_reason()
        if reason:
            raise RuntimeError(f"Buffer(backend='cuda'): the EP group spans hosts, which needs NVSHMEM: {reason}")
        # The normal region: internode normal mode (the RDMA and NVLink stages).
        self.num_nvl_bytes = num_nvl_bytes or cuda_internode.internode_region_bytes(
            self.num_ranks, self.num_nodes, self.hidden
        )
        send_bytes = 0
        if self.low_latency_mode:
            self.num_rdma_bytes = num_rdma_bytes or self._ops.low_latency_region_bytes(
                self.num_ranks, self.num_experts, self.hidden, self.num_max_dispatch_tokens_per_rank
            )
            send_bytes = self._ops.low_latency_send_bytes(
                self.num_ranks, self.hidden, self.num_max_dispatch_tokens_per_rank
            )
        self.num_send_bytes = send_bytes
        nvshmem.initialize(device, self.num_nvl_bytes + self.num_rdma_bytes + send_bytes, self.config.timeout_s)
        pes = [d.process_index for d in self._device_grid()[g]]
        self.buffer_id = self._ops.create_nvshmem_buffer(
            device, r, pes, nodes[g], self.num_nvl_bytes, self.num_rdma_bytes, send_bytes
        )
        nvshmem.track(self)

    def _open_ipc_peers(self, groups, handles):
        """Trades IPC handles with the other processes of our groups and opens theirs."""
        grid = self._device_grid()
        local_ranks = [(g, r) for g, row in enumerate(groups) for r, d in enumerate(row) if d >= 0]
        local = dict(zip(local_ranks, handles))
        remote = {
            (g, r): grid[g][r].process_index
            for g, row in enumerate(groups)
            if any(d >= 0 for d in row)
            for r, d in enumerate(row)
            if d < 0
        }
        received = multiprocess.exchange(self._ipc_name, local, remote, self.config.timeout_s)
        everything = {**local, **received}
        table = [[everything.get((g, r), b"") for r in range(self.num_ranks)] for g in range(len(groups))]
        self._ops.open_ipc_peers(self.buffer_id, table)

    # Lifecycle ------------------------------------------------------------

    def destroy(self):
        """Frees the device memory. Calls that use the buffer afterwards fail."""
        if self._destroyed:
            return
        self._destroyed = True
        if self.buffer_id is None:
            return
        if not self.ipc and not self.spans_hosts:
            self._ops.destroy_buffer(self.buffer_id)
            return
        if self.spans_hosts:
            from deep_ep_jax import nvshmem

            nvshmem.untrack(self)
        # Peers may still read or write our regions: wait until every
        # process's work is done before any memory goes.
        try:
            self._ops.synchronize_buffer(self.buffer_id)
            multiprocess.barrier(f"{self._ipc_name}/destroy", self.config.timeout_s)
        except BaseException:
            # NVSHMEM's free is collective: with a process missing it would wait forever; leave the memory.
            if not self.spans_hosts:
                self._ops.destroy_buffer(self.buffer_id)
            raise
        self._ops.destroy_buffer(self.buffer_id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def check_alive(self, fn_name):
        if self._destroyed:
            raise RuntimeError(f"{fn_name}: the Buffer was destroyed; create a new one")

    @property
    def ops(self):
        """The backend module (`deep_ep_jax.backends.reference` or `.cuda`)."""
        return self._ops

    def __repr__(self):
        return (
            f"Buffer(axis={self.axis_name!r}, num_ranks={self.num_ranks}, backend={self.backend!r}, "
            f"low_latency_mode={self.low_latency_mode}, spans_hosts={self.spans_hosts}, id={self.buffer_id})"
        )
