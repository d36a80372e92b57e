"""One process per GPU: the Buffer's CUDA IPC handles traded through the
jax.distributed key-value store, and which host and NVLink domain each
process is on.

Every process creates the same Buffers in the same order (SPMD), so a
per-process counter names each multi-process buffer identically everywhere;
keys are ours, under `deep_ep_jax/buffer/<n>/` (and `deep_ep_jax/host/<p>`,
`deep_ep_jax/nvshmem/uid`).
"""

from __future__ import annotations

import itertools
import socket

import jax
import numpy as np

from deep_ep_jax.distributed import topology

KEY_PREFIX = "deep_ep_jax/buffer"
HOST_KEY_PREFIX = "deep_ep_jax/host"

_places = None  # {process index: (hostname, NVLink domain)}, traded once

_buffer_counter = itertools.count()


def spans_processes(devices) -> bool:
    """Whether some of `devices` belong to other processes."""
    me = jax.process_index()
    return any(d.process_index != me for d in devices)


def next_buffer_name() -> str:
    """The key namespace of the next multi-process buffer (same on every process)."""
    return f"{KEY_PREFIX}/{next(_buffer_counter)}"


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "deep_ep_jax: the mesh spans several processes but jax.distributed is not initialized: call "
            "jax.distributed.initialize() (or deep_ep_jax.launch.initialize()) before creating the Buffer"
        )
    return client


def publish(key: str, value: bytes) -> None:
    """Sets our own key in the key-value store (bytes, hex-encoded)."""
    _client().key_value_set(key, bytes(value).hex())


def fetch(key: str, timeout_s: float, what: str) -> bytes:
    """The bytes another process publishes under `key`; TimeoutError naming
    `what` and the key when it does not come within timeout_s."""
    try:
        return bytes.fromhex(_client().blocking_key_value_get(key, int(timeout_s * 1000)))
    except Exception as e:  # jax raises its runtime error type; say what was missing
        kind = TimeoutError if "DEADLINE_EXCEEDED" in str(e).upper() else RuntimeError
        raise kind(
            f"deep_ep_jax: {what} did not arrive under key {key!r} within {timeout_s:g} s (Config.timeout_s); "
            f"is that process alive and creating the same Buffers in the same order? ({type(e).__name__}: {e})"
        ) from e


def from_every_process(key: str, value: bytes, timeout_s: float, what: str) -> list[bytes]:
    """Publishes this process's value under key/<process index> and returns every process's, in process
    order (TimeoutError naming `what` of a process that does not publish within timeout_s)."""
    me = jax.process_index()
    publish(f"{key}/{me}", value)
    fetched = (
        fetch(f"{key}/{p}", timeout_s, f"{what} of process {p}") if p != me else value
        for p in range(jax.process_count())
    )
    return list(fetched)


def places(timeout_s: float) -> dict:
    """{process index: (hostname, topology.Domain or None)} of every process, traded once per
    process: its host, and the NVLink domain across hosts of its first GPU (topology.local_domain)."""
    global _places
    if _places is None:
        gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
        domain = topology.local_domain(gpus[0].local_hardware_id if gpus else None)
        mine = f"{socket.gethostname()}\n{domain.key() if domain else ''}".encode()
        found = [v.decode().split("\n") for v in from_every_process(HOST_KEY_PREFIX, mine, timeout_s, "the host")]
        _places = {p: (host, topology.Domain.from_key(key)) for p, (host, key) in enumerate(found)}
    return _places


def group_hosts(hosts, gpus_per_host=None) -> list[int]:
    """Host index of each rank of an EP group, from its ranks' hostnames in rank order, each host's
    ranks cut into hosts of gpus_per_host (Config.gpus_per_host: how one machine emulates several);
    indices follow the ranks' first appearance."""
    index: dict[tuple, int] = {}
    seen: dict[str, int] = {}
    cut = []
    for host in hosts:
        i = seen.get(host, 0)
        seen[host] = i + 1
        cut.append(index.setdefault((host, i // gpus_per_host if gpus_per_host else 0), len(index)))
    return cut


def group_nodes(hosts, gpus_per_host=None, domains=None, gpus_per_domain=None) -> list[int]:
    """Node index of each rank of an EP group (a node: ranks that map each other's memory and talk
    over NVLink), from its ranks' hostnames in rank order: the ranks of one NVLink domain across
    hosts (domains: each rank's topology.Domain, None where its NVLink stays on its host; default
    all None), else of one host (cut by gpus_per_host, group_hosts). With gpus_per_domain each
    node's ranks are cut further into nodes of that many, in rank order (Config.gpus_per_nvlink_domain).
    Node indices follow the ranks' first appearance."""
    domains = [None] * len(hosts) if domains is None else list(domains)
    if len(domains) != len(hosts):
        raise ValueError(f"{len(hosts)} hosts but {len(domains)} domains")
    nodes: list[int] = []
    index: dict[tuple, int] = {}  # (place, its cut) -> node
    seen: dict[tuple, int] = {}  # place -> its ranks so far
    for host, domain in zip(group_hosts(hosts, gpus_per_host), domains):
        place = ("host", host) if domain is None else ("domain", domain)
        j = seen.get(place, 0)
        seen[place] = j + 1
        nodes.append(index.setdefault((place, j // gpus_per_domain if gpus_per_domain else 0), len(index)))
    return nodes


def ranks_per_host(nodes, backend) -> list[int]:
    """The ranks of each host of an EP group (nodes: each rank's host index);
    raises unless every host holds the same number, as normal mode across
    hosts needs (a token is forwarded by the GPU of the sender's local index)."""
    nodes = [int(n) for n in nodes]
    sizes = [nodes.count(n) for n in range(max(nodes) + 1)]
    if len(set(sizes)) != 1:
        raise NotImplementedError(
            f"Buffer(backend='{backend}'): internode normal mode needs the same number of GPUs of the EP group in "
            f"every node (host, or NVLink domain), got {sizes} (ranks per node); set Config.gpus_per_host / "
            f"DEEP_EP_JAX_GPUS_PER_HOST to cut hosts, or Config.gpus_per_nvlink_domain / "
            f"DEEP_EP_JAX_GPUS_PER_NVLINK_DOMAIN to cut nodes (domains too), evenly"
        )
    return sizes


def device_grid(mesh, axis_name):
    """The mesh's devices as [group, rank]: one EP group per index of the
    other mesh axes, in rank order."""
    axis = mesh.axis_names.index(axis_name)
    return np.moveaxis(mesh.devices, axis, -1).reshape(-1, mesh.shape[axis_name])


def mesh_group_places(mesh, axis_name, config, spans=None) -> tuple[list, list]:
    """(nodes, hosts): the node (group_nodes) and host (group_hosts) index of each rank of each EP
    group of `mesh`, from the processes' hostnames and NVLink domains (traded when the mesh spans
    processes; `spans` None: decided here), cut by config.gpus_per_host and
    config.gpus_per_nvlink_domain."""
    rows = device_grid(mesh, axis_name)
    if spans is None:
        spans = spans_processes(rows.flat)
    found = places(config.timeout_s) if spans else {jax.process_index(): ("localhost", None)}
    hosts = [[found[d.process_index][0] for d in row] for row in rows]
    domains = [[found[d.process_index][1] for d in row] for row in rows]
    nodes = [group_nodes(h, config.gpus_per_host, d, config.gpus_per_nvlink_domain) for h, d in zip(hosts, domains)]
    return nodes, [group_hosts(h, config.gpus_per_host) for h in hosts]


def handle_key(name: str, group: int, rank: int) -> str:
    return f"{name}/group/{group}/rank/{rank}"


def exchange(name, local, remote, timeout_s):
    """Publishes this process's values and collects the others'.

    local: {(group, rank): bytes} of this process; remote: {(group, rank):
    process index} of the ranks other processes publish. Returns
    {(group, rank): bytes} for the remote ranks. A rank that does not publish
    within timeout_s raises TimeoutError naming it and its key.
    """
    client = _client()
    for (group, rank), value in local.items():
        client.key_value_set(handle_key(name, group, rank), bytes(value).hex())
    received = {}
    for (group, rank), process in sorted(remote.items()):
        key = handle_key(name, group, rank)
        try:
            received[(group, rank)] = bytes.fromhex(client.blocking_key_value_get(key, int(timeout_s * 1000)))
        except Exception as e:  # jax raises its runtime error type; name the peer instead
            kind = TimeoutError if "DEADLINE_EXCEEDED" in str(e).upper() else RuntimeError
            raise kind(
                f"deep_ep_jax: rank {rank} of EP group {group} (process {process}) did not publish its buffer "
                f"handles under key {key!r} within {timeout_s:g} s (Config.timeout_s); is that process alive "
                f"and creating the same Buffers in the same order? ({type(e).__name__}: {e})"
            ) from e
    return received


def barrier(name, timeout_s, processes=None):
    """Waits until every process (or each of `processes`, process indices)
    reaches the barrier `name` (TimeoutError after timeout_s)."""
    try:
        _client().wait_at_barrier(name, int(timeout_s * 1000), process_ids=processes)
    except Exception as e:
        among = "" if processes is None else f" of processes {list(processes)}"
        raise TimeoutError(
            f"deep_ep_jax: not every process{among} reached barrier {name!r} within {timeout_s:g} s "
            f"({type(e).__name__}: {e})"
        ) from e
