"""A CUDA Buffer's memory, from allocation to destruction.

On one host, both regions are plain cudaMalloc memory (not XLA's) on every
device of the axis, registered under an integer id that the custom calls
carry; with peers in other processes (one process per GPU) they are traded
as CUDA IPC handles through the jax.distributed key-value store. An EP group
across hosts has its regions (and a send area) in NVSHMEM's symmetric heap
(`deep_ep_jax.distributed.nvshmem`). The extension's FFI targets are registered with XLA
before the first Buffer is made.
"""

from __future__ import annotations

import threading

import jax

from deep_ep_jax import _native
from deep_ep_jax.backends.cuda import (
    common,
    expert_major,
    fp8_quant,
    internode,
    intranode,
    layout,
    low_latency,
    sizes,
)
from deep_ep_jax.config import FP8_BLOCK
from deep_ep_jax.distributed import multiprocess, nvshmem

_register_lock = threading.Lock()
_registered = False


# FFI targets -------------------------------------------------------------------


def declared_ffi_outputs() -> dict:
    """{FFI target: names of its results} as this package calls them."""
    modules = (layout, intranode, internode, low_latency, expert_major, fp8_quant)
    return {t.name: t.all_results for module in modules for t in module.TARGETS}


def check_ffi_outputs(declared: dict, built: dict) -> None:
    """Raises RuntimeError unless every declared target is built with the same results, in order."""
    problems = []
    for name, results in sorted(declared.items()):
        if name not in built:
            problems.append(f"{name}: not in the extension")
        elif tuple(built[name]) != tuple(results):
            problems.append(f"{name}: the extension returns {list(built[name])}, Python expects {list(results)}")
    if problems:
        raise RuntimeError(
            "deep_ep_jax._C does not match this Python package (rebuild the extension from the same checkout): "
            + "; ".join(problems)
        )


def check_fp8_block(limits: dict) -> None:
    if limits["fp8_block"] != FP8_BLOCK:
        raise RuntimeError(
            f"deep_ep_jax._C scales FP8 rows per {limits['fp8_block']} channels, the Python API per {FP8_BLOCK} "
            f"(deep_ep_jax.config.FP8_BLOCK); rebuild the extension from the same checkout"
        )


def register_ffi_targets() -> None:
    """Registers every FFI handler of the extension with XLA for CUDA, once,
    after checking that the extension returns what this package expects."""
    global _registered
    with _register_lock:
        if _registered:
            return
        ext = _native.extension()
        check_ffi_outputs(declared_ffi_outputs(), ext.ffi_outputs())
        check_fp8_block(_native.limits())
        for name, capsule in ext.ffi_targets().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
        _registered = True


def check_config(config, limits: dict) -> None:
    """The launch configuration within the kernels' bounds."""
    for name, value, bound in (
        ("num_sms", config.num_sms, limits["max_blocks"]),
        ("num_warps", config.num_warps, limits["max_warps"]),
        ("low_latency_overlap_sms", config.low_latency_overlap_sms, limits["max_blocks"]),
    ):
        if value > bound:
            raise ValueError(f"Config.{name} must be <= {bound} for the CUDA kernels, got {value}")


def check_group_size(num_ranks, limits: dict) -> None:
    """An EP group no larger than any mode of the kernels serves (low-latency mode's)."""
    if num_ranks > limits["max_group_ranks"]:
        raise ValueError(
            f"Buffer(backend='cuda'): an EP group has at most {limits['max_group_ranks']} ranks (low-latency mode; "
            f"normal mode: {limits['max_nvlink_ranks']} on one host, {limits['max_internode_normal_ranks']} across "
            f"hosts), the mesh axis has {num_ranks}"
        )


def normal_mode_serves(num_ranks, spans_hosts, low_latency_mode) -> bool:
    """Whether normal mode serves the EP group (its region is allocated only
    then). Raises when it does not and low-latency mode is off: the Buffer
    could run nothing."""
    error = common.normal_mode_rank_error("Buffer(backend='cuda')", num_ranks, spans_hosts)
    if error is None:
        return True
    if not low_latency_mode:
        raise ValueError(
            f"{error}; create the Buffer with low_latency_mode=True to run low-latency calls "
            f"(normal-mode calls on it raise)"
        )
    return False


def check_fits(parts: dict, total_bytes, device) -> None:
    """Raises when a Buffer's memory on one GPU (parts: what -> bytes)
    exceeds the GPU's `total_bytes`, naming the bytes. Sizes and totals are the
    same on every process (same GPUs), so every process raises alike, before
    any collective allocation."""
    need = sum(parts.values())
    if need <= total_bytes:
        return
    detail = ", ".join(f"{what}: {num_bytes} bytes" for what, num_bytes in parts.items() if num_bytes)
    raise ValueError(
        f"Buffer(backend='cuda'): needs {need} bytes ({need / 2**30:.1f} GiB) on each GPU ({detail}), more than "
        f"GPU {device}'s {total_bytes} bytes; use a smaller num_max_dispatch_tokens_per_rank or hidden, or fewer "
        f"ranks (the send area of an EP group across hosts stages a combine's rows, R * M * K * H * 2 bytes; normal "
        f"mode across hosts lands up to R * T rows and gathers as many in combine, R * T * 2H bytes, T = 4096 unless "
        f"num_nvl_bytes=deep_ep_jax.backends.cuda.sizes.internode_region_bytes(R, hosts, hidden, T))"
    )


def _check_fits_device(parts: dict, device) -> None:
    check_fits(parts, _native.extension().mem_get_info(int(device))[1], device)


# The extension's buffer registry -------------------------------------------------


def create_buffer(groups, normal_bytes, low_latency_bytes) -> int:
    """Allocates both regions on every device of each group (local device
    ordinals, in rank order) and returns the buffer id the custom calls carry."""
    groups = [[int(device) for device in group] for group in groups]
    return _native.extension().create_buffer(groups, int(normal_bytes), int(low_latency_bytes))


def create_ipc_buffer(groups, normal_bytes, low_latency_bytes):
    """One process per GPU: allocates both regions on this process's devices
    (groups: local ordinal per rank, -1 for other processes' ranks). Returns
    (buffer id, [IPC handle bytes per local device, in group order])."""
    groups = [[int(device) for device in group] for group in groups]
    buffer_id, handles = _native.extension().create_ipc_buffer(groups, int(normal_bytes), int(low_latency_bytes))
    return buffer_id, list(handles)


def create_nvshmem_buffer(device, rank, pes, nodes, normal_bytes, low_latency_bytes, send_bytes) -> int:
    """An EP group across hosts: the normal region (none when 0), the
    low-latency region of `rank` (this process's `device`) and its send area
    in NVSHMEM's symmetric heap. Collective over all processes. pes[r]: PE of
    rank r; nodes[r]: its host index (ranks of this rank's host are reached
    through mapped memory, the others through NVSHMEM's transports)."""
    return _native.extension().create_nvshmem_buffer(
        int(device),
        int(rank),
        [int(p) for p in pes],
        [int(n) for n in nodes],
        int(normal_bytes),
        int(low_latency_bytes),
        int(send_bytes),
    )


def synchronize_buffer(buffer_id) -> None:
    _native.extension().synchronize_buffer(int(buffer_id))


def destroy_buffer(buffer_id) -> None:
    _native.extension().destroy_buffer(int(buffer_id))


# A Buffer's memory -----------------------------------------------------------------


def device_grid(buffer):
    """The mesh's devices as [group, rank] (multiprocess.device_grid)."""
    return multiprocess.device_grid(buffer.mesh, buffer.axis_name)


def groups(buffer):
    """Local CUDA ordinal of each rank of each EP group, -1 for a device of another process."""
    me = jax.process_index()
    return [[d.local_hardware_id if d.process_index == me else -1 for d in row] for row in device_grid(buffer)]


def group_places(buffer, spans_processes):
    """(nodes, hosts): the node and host index of each rank of each EP group
    (multiprocess.mesh_group_places): from the processes' hostnames and NVLink
    domains (traded when the mesh spans processes), cut further by
    Config.gpus_per_host and Config.gpus_per_nvlink_domain."""
    return multiprocess.mesh_group_places(buffer.mesh, buffer.axis_name, buffer.config, spans_processes)


def allocate(buffer, num_nvl_bytes, num_rdma_bytes) -> None:
    """Gives a CUDA Buffer its memory (collective when the mesh spans
    processes: every process makes the same Buffers in the same order). Sets
    its buffer_id, num_nvl_bytes, num_rdma_bytes, ipc, staged, spans_hosts,
    nvshmem, rank_hosts, num_nodes, num_send_bytes and store_key."""
    register_ffi_targets()
    check_config(buffer.config, _native.limits())
    check_group_size(buffer.num_ranks, _native.limits())
    all_groups = groups(buffer)
    mine = [g for g in all_groups if any(d >= 0 for d in g)]  # groups with devices of this process
    spans_processes = multiprocess.spans_processes(buffer.mesh.devices.flat)
    if spans_processes:
        # Advanced on every process alike, so keys agree.
        buffer.store_key = multiprocess.next_buffer_name()
    # Decided from what every process knows alike, so all take the same path.
    nodes, hosts = group_places(buffer, spans_processes)
    buffer.spans_hosts = any(len(set(n)) > 1 for n in nodes)
    if buffer.spans_hosts and not all(len(set(n)) > 1 for n in nodes):
        raise NotImplementedError(
            f"Buffer(backend='cuda'): some EP groups of the mesh span several nodes and others one ({nodes}); "
            f"one program's kernels serve every group: cut them alike (Config.gpus_per_host, "
            f"Config.gpus_per_nvlink_domain, or a mesh whose EP groups sit alike on the hosts)"
        )
    # Peer memory across nodes, or across the hosts of one NVLink domain: NVSHMEM's.
    buffer.nvshmem = buffer.spans_hosts or any(len(set(h)) > 1 for h in hosts)
    if buffer.spans_hosts:  # this process's group (its first): what its kernels and the reference model
        buffer.rank_hosts = tuple(next(n for n, g in zip(nodes, all_groups) if any(d >= 0 for d in g)))
    normal = normal_mode_serves(buffer.num_ranks, buffer.spans_hosts, buffer.low_latency_mode)
    if buffer.nvshmem:
        allocate_nvshmem(buffer, all_groups, nodes, num_nvl_bytes, num_rdma_bytes, normal)
        return
    buffer.ipc = any(-1 in g for g in mine)
    if buffer.ipc and any(sum(d >= 0 for d in g) != 1 for g in mine):
        raise NotImplementedError(
            "Buffer(backend='cuda'): an EP group that spans processes must have exactly one device of "
            "each process (one process per GPU); this process has several devices in such a group"
        )
    buffer.staged = buffer.ipc or intranode.staged_requested()
    if normal:  # else no normal region: normal-mode calls raise at trace time
        buffer.num_nvl_bytes = num_nvl_bytes or sizes.normal_region_bytes(
            buffer.num_ranks, buffer.hidden, staged=buffer.staged
        )
    if buffer.low_latency_mode:
        buffer.num_rdma_bytes = num_rdma_bytes or sizes.low_latency_region_bytes(
            buffer.num_ranks, buffer.num_experts, buffer.hidden, buffer.num_max_dispatch_tokens_per_rank
        )
    for device in sorted({d for g in mine for d in g if d >= 0})[:1]:  # the same sizes on every device
        _check_fits_device({"normal region": buffer.num_nvl_bytes, "low-latency region": buffer.num_rdma_bytes}, device)
    if not buffer.ipc:  # every group this process touches is all its own
        buffer.buffer_id = create_buffer(mine, buffer.num_nvl_bytes, buffer.num_rdma_bytes)
        return
    buffer.buffer_id, handles = create_ipc_buffer(all_groups, buffer.num_nvl_bytes, buffer.num_rdma_bytes)
    try:
        _open_ipc_peers(buffer, all_groups, handles)
    except BaseException:
        destroy_buffer(buffer.buffer_id)
        buffer.buffer_id = None
        raise


def allocate_nvshmem(buffer, all_groups, nodes, num_nvl_bytes, num_rdma_bytes, normal=True) -> None:
    """The normal (when `normal` mode serves the group) and low-latency
    regions in NVSHMEM's symmetric heap (collective: every process of the mesh
    makes the Buffer)."""
    devices = list(buffer.mesh.devices.flat)
    nvshmem.check_one_gpu_per_process(devices)
    if {d.process_index for d in devices} != set(range(jax.process_count())):
        raise NotImplementedError(
            "Buffer(backend='cuda'): an EP group across hosts uses NVSHMEM, whose PEs are all jax processes; "
            "the mesh must hold a device of every process"
        )
    g, r = next((g, r) for g, row in enumerate(all_groups) for r, d in enumerate(row) if d >= 0)
    device = all_groups[g][r]
    # Internode normal mode needs hosts of equal size; low-latency mode does not.
    spans_nodes = len(set(nodes[g])) > 1
    buffer.num_nodes = internode.check_nodes(nodes[g]) if normal and spans_nodes else max(nodes[g]) + 1
    reason = nvshmem.unavailable_reason()
    if reason:
        raise RuntimeError(f"Buffer(backend='cuda'): the EP group spans hosts, which needs NVSHMEM: {reason}")
    # The normal region: internode normal mode (the RDMA and NVLink stages), or one node's
    # staged kernels (peers in other processes) where one NVLink domain spans the hosts.
    buffer.staged = not spans_nodes
    if normal and spans_nodes:
        buffer.num_nvl_bytes = num_nvl_bytes or sizes.internode_region_bytes(
            buffer.num_ranks, buffer.num_nodes, buffer.hidden
        )
    elif normal:
        buffer.num_nvl_bytes = num_nvl_bytes or sizes.normal_region_bytes(buffer.num_ranks, buffer.hidden, staged=True)
    if buffer.low_latency_mode:
        buffer.num_rdma_bytes = num_rdma_bytes or sizes.low_latency_region_bytes(
            buffer.num_ranks, buffer.num_experts, buffer.hidden, buffer.num_max_dispatch_tokens_per_rank
        )
        buffer.num_send_bytes = sizes.low_latency_send_bytes(
            buffer.num_ranks, buffer.hidden, buffer.num_max_dispatch_tokens_per_rank
        )
    _check_fits_device(
        {
            "normal region": buffer.num_nvl_bytes,
            "low-latency region": buffer.num_rdma_bytes,
            "low-latency send area": buffer.num_send_bytes,
        },
        device,
    )
    nvshmem.initialize(
        device, buffer.num_nvl_bytes + buffer.num_rdma_bytes + buffer.num_send_bytes, buffer.config.timeout_s
    )
    pes = [d.process_index for d in device_grid(buffer)[g]]
    error = "ok"
    try:
        buffer_id = create_nvshmem_buffer(
            device, r, pes, nodes[g], buffer.num_nvl_bytes, buffer.num_rdma_bytes, buffer.num_send_bytes
        )
    except Exception as e:  # noqa: BLE001 (told to every process below, then raised)
        error = f"{type(e).__name__}: {e}"
    # A process can fail after the collective allocation (a peer NVSHMEM cannot map): all learn it and
    # raise now, instead of the others waiting for it in their first call.
    outcomes = multiprocess.from_every_process(
        f"{buffer.store_key}/created", error.encode(), buffer.config.timeout_s, "the NVSHMEM buffer's outcome"
    )
    failed = {p: e.decode() for p, e in enumerate(outcomes) if e != b"ok"}
    if failed:
        first = min(failed)
        raise RuntimeError(
            f"Buffer(backend='cuda'): making the NVSHMEM buffer failed on process(es) {sorted(failed)}; process "
            f"{first}: {failed[first]}. Its symmetric memory stays until the processes exit (NVSHMEM frees "
            f"collectively)"
        )
    buffer.buffer_id = buffer_id
    nvshmem.track(buffer)


def _open_ipc_peers(buffer, all_groups, handles):
    """Trades IPC handles with the other processes of our groups and maps theirs."""
    grid = device_grid(buffer)
    local_ranks = [(g, r) for g, row in enumerate(all_groups) for r, d in enumerate(row) if d >= 0]
    local = dict(zip(local_ranks, handles))
    remote = {
        (g, r): grid[g][r].process_index
        for g, row in enumerate(all_groups)
        if any(d >= 0 for d in row)
        for r, d in enumerate(row)
        if d < 0
    }
    received = multiprocess.exchange(buffer.store_key, local, remote, buffer.config.timeout_s)
    everything = {**local, **received}
    table = [[everything.get((g, r), b"") for r in range(buffer.num_ranks)] for g in range(len(all_groups))]
    # handles[group][rank]: bytes, ignored for local ranks.
    _native.extension().open_ipc_peers(int(buffer.buffer_id), [[bytes(h) for h in group] for group in table])


def destroy(buffer) -> None:
    """Frees the Buffer's memory. With peers in other processes, waits until
    every process's work on it is done first (collective): every process but
    those of ranks masked in low-latency mode (Config.mask_failed_ranks),
    which no peer writes to or waits for; a masked process frees at once."""
    if not buffer.ipc and not buffer.nvshmem:
        destroy_buffer(buffer.buffer_id)
        return
    if buffer.nvshmem:
        nvshmem.untrack(buffer)
    # Peers may still read or write our regions: wait until every
    # process's work is done before any memory goes.
    try:
        synchronize_buffer(buffer.buffer_id)
        gone = masked_processes(buffer)
        if not gone:
            multiprocess.barrier(f"{buffer.store_key}/destroy", buffer.config.timeout_s)
        elif jax.process_index() not in gone:
            live = sorted(set(range(jax.process_count())) - gone)
            multiprocess.barrier(f"{buffer.store_key}/destroy/{live}", buffer.config.timeout_s, live)
    except BaseException:
        # NVSHMEM's free is collective: with a process missing it would wait forever; leave the memory.
        if not buffer.nvshmem:
            destroy_buffer(buffer.buffer_id)
        raise
    if not (gone and buffer.nvshmem):  # NVSHMEM's free again: a masked process never joins it
        destroy_buffer(buffer.buffer_id)


def masked_processes(buffer) -> set:
    """The processes of the ranks that a rank of this process has masked in
    low-latency mode (Config.mask_failed_ranks), read from the devices."""
    if not buffer.config.mask_failed_ranks or not buffer.num_rdma_bytes:
        return set()
    grid = device_grid(buffer)
    me = jax.process_index()
    group_of = {d.local_hardware_id: row for row in grid for d in row if d.process_index == me}
    return {
        group_of[ordinal][r].process_index
        for ordinal, ranks in _native.extension().read_masks(int(buffer.buffer_id))
        for r in ranks
    }
