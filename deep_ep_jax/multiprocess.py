"""One process per GPU: the Buffer's CUDA IPC handles traded through the
jax.distributed key-value store.

Every process creates the same Buffers in the same order (SPMD), so a
per-process counter names each multi-process buffer identically everywhere;
keys are ours, under `deep_ep_jax/buffer/<n>/`.
"""

from __future__ import annotations

import itertools

import jax

KEY_PREFIX = "deep_ep_jax/buffer"

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


def barrier(name, timeout_s):
    """Waits until every process reaches the barrier `name` (TimeoutError after timeout_s)."""
    try:
        _client().wait_at_barrier(name, int(timeout_s * 1000))
    except Exception as e:
        raise TimeoutError(
            f"deep_ep_jax: not every process reached barrier {name!r} within {timeout_s:g} s ({type(e).__name__}: {e})"
        ) from e
