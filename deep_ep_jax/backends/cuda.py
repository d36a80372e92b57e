"""The CUDA backend: the per-rank operations as XLA FFI custom calls.

Same interface as `deep_ep_jax.backends.reference` (see
`deep_ep_jax.backends`). The layout and the buffer lifecycle live here; normal
mode comes from `cuda_normal`, low-latency mode from `cuda_low_latency`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deep_ep_jax import _native


from deep_ep_jax.backends.cuda_low_latency import (  # noqa: F401  (re-exported: the backend interface)
    low_latency_combine,
    low_latency_combine_recv,
    low_latency_combine_send,
    low_latency_dispatch,
    low_latency_dispatch_recv,
    low_latency_dispatch_send,
    low_latency_region_bytes,
    low_latency_send_bytes,
)
from deep_ep_jax.backends.cuda_normal import cached_dispatch, combine, dispatch, normal_region_bytes  # noqa: F401


# Buffer lifecycle -----------------------------------------------------------


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


def open_ipc_peers(buffer_id, handles) -> None:
    """Maps the peers' regions from handles[group][rank] (bytes; ignored for local ranks)."""
    _native.extension().open_ipc_peers(int(buffer_id), [[bytes(h) for h in group] for group in handles])


def create_nvshmem_buffer(device, rank, pes, nodes, normal_bytes, low_latency_bytes, send_bytes) -> int:
    """An EP group across hosts: the normal region (none when 0), the
    low-latency region of `rank` (this process's `device`) and its send area
    in NVSHMEM's symmetric heap. Collective over all processes. pes[r]: PE of
    rank r; nodes[r]: its host index (ranks of this rank's host are reached
    through mapped memory, the others through NVSHMEM's transports)."""
    return _native.extension().create_nvshmem_buffer(
        int(device), int(rank), [int(p) for p in pes], [int(n) for n in nodes], int(normal_bytes),
        int(low_latency_bytes), int(send_bytes),
    )


def synchronize_buffer(buffer_id) -> None:
    _native.extension().synchronize_buffer(int(buffer_id))


def destroy_buffer(buffer_id) -> None:
    _native.extension().destroy_buffer(int(buffer_id))


# Layout ---------------------------------------------------------------------


def get_dispatch_layout(topk_idx, *, num_experts, buffer):
    """(num_tokens_per_rank i32 [R], num_tokens_per_expert i32 [E],
    is_token_in_rank bool [T, R]); ids outside [0, E) count as -1."""
    _native.register_ffi_targets()
    num_tokens = topk_idx.shape[0]
    num_ranks = buffer.num_ranks
    out_types = (
        jax.ShapeDtypeStruct((num_ranks,), jnp.int32),
        jax.ShapeDtypeStruct((num_experts,), jnp.int32),
        jax.ShapeDtypeStruct((num_tokens, num_ranks), jnp.bool_),
    )
    call = jax.ffi.ffi_call("deep_ep_jax_get_dispatch_layout", out_types, vmap_method="sequential")
    return tuple(
        call(jnp.asarray(topk_idx, jnp.int32), num_experts=np.int64(num_experts), num_ranks=np.int64(num_ranks))
    )
