"""Normal mode for an EP group across hosts, as CUDA custom calls over NVSHMEM.

The kernels are `csrc/kernels/internode.cu` (design: docs/internode.md):
dispatch sends each token over the network at most once per destination host,
to the GPU with the sender's local index there, which forwards it over NVLink;
combine pushes every row back to its source rank, which sums them in float32
in rank order, bit-identical to `deep_ep_jax.backends.reference`. Same
signatures and handle as `cuda_normal` (which switches here when
`buffer.spans_hosts`). Everything lands in the Buffer's normal region in
NVSHMEM's symmetric heap, sized by `internode_region_bytes`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deep_ep_jax import _native
from deep_ep_jax.backends.cuda_normal import (  # limits, sizes and helpers shared with one host
    CONTROL_BYTES,
    DEFAULT_HIDDEN,
    DEFAULT_TOKENS,
    DEFAULT_TOPK,
    FP8_BLOCK,
    MAX_LOCAL_EXPERTS,
    MAX_RANKS,
    _cached_dispatch_call,
    _check_common,
    _combine_call,
    _dispatch_out_types,
    _dispatch_results,
    _launch_attrs,
    _row_bytes,
    _scales_or_empty,
)

# Mirrors of csrc/kernels/internode.{h,cu}.
ALIGN = 256
PACKET_ALIGN = 16


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _take_all(sizes) -> int:
    offset = CONTROL_BYTES
    for size in sizes:
        offset = _align(offset + size, ALIGN)
    return offset


def dispatch_region_bytes(num_tokens, num_rows, num_topk, row_bytes, num_nodes) -> int:
    """Mirror of MakeLayout (dispatch): landing area of num_rows rows, then
    packets staged (T) and received from each host (num_nodes * T)."""
    packet = (_align(row_bytes[0], PACKET_ALIGN) + _align(row_bytes[1], PACKET_ALIGN)
              + _align(4 * (1 + MAX_RANKS) + 8 * num_topk, PACKET_ALIGN))
    n, k = num_rows, num_topk
    return _take_all([n * row_bytes[0], n * row_bytes[1], n * k * 4, n * k * 4, n * 4,
                      num_tokens * packet, num_nodes * num_tokens * packet])


def combine_region_bytes(num_tokens, num_rows, num_topk, hidden, num_ranks) -> int:
    """Mirror of MakeLayout (combine): slots [rank][token] of (row, weights), then staged sends (N)."""
    packet = _align(2 * hidden, PACKET_ALIGN) + _align(4 * num_topk, PACKET_ALIGN)
    return _take_all([num_ranks * num_tokens * packet, num_rows * packet])


def internode_region_bytes(num_ranks, num_nodes, hidden=None, num_tokens=None, num_topk=DEFAULT_TOPK) -> int:
    """Bytes of the normal region per rank of an EP group across hosts: the
    largest of bf16 and FP8 dispatch (N = T * R rows) and combine, for
    num_tokens tokens per rank of `hidden` (None: 4096 and 7168)."""
    hidden = DEFAULT_HIDDEN if hidden is None else int(hidden)
    num_tokens = DEFAULT_TOKENS if num_tokens is None else int(num_tokens)
    num_rows = num_tokens * num_ranks
    bf16 = dispatch_region_bytes(num_tokens, num_rows, num_topk, (2 * hidden, 0), num_nodes)
    fp8 = dispatch_region_bytes(num_tokens, num_rows, num_topk, (hidden, hidden // FP8_BLOCK * 4), num_nodes)
    combine = combine_region_bytes(num_tokens, num_rows, num_topk, hidden, num_ranks)
    return max(bf16, fp8, combine)


def check_nodes(nodes) -> int:
    """The host index of each rank (0..H-1): every host must hold the same
    number of ranks (a token is forwarded by the GPU of the sender's local
    index). Returns the number of hosts."""
    nodes = [int(n) for n in nodes]
    num_nodes = max(nodes) + 1
    sizes = [nodes.count(n) for n in range(num_nodes)]
    if len(set(sizes)) != 1:
        raise NotImplementedError(
            f"Buffer(backend='cuda'): internode normal mode needs the same number of GPUs of the EP group on every "
            f"host, got {sizes} (ranks per host); set Config.gpus_per_host / DEEP_EP_JAX_GPUS_PER_HOST to cut hosts "
            f"evenly"
        )
    return num_nodes


# Trace-time checks ----------------------------------------------------------


def _check(fn, buffer, *, num_tokens, num_rows, num_topk, need):
    _check_common(fn, buffer, num_tokens=num_tokens, num_rows=num_rows, num_topk=num_topk)
    if buffer.num_nvl_bytes < need:
        raise ValueError(
            f"{fn}: the Buffer's EP group spans hosts; its normal region (NVSHMEM symmetric heap) needs {need} bytes "
            f"for {num_tokens} tokens, {num_rows} rows and top-k {num_topk}, and has num_nvl_bytes="
            f"{buffer.num_nvl_bytes}. Create the Buffer with num_nvl_bytes >= "
            f"cuda_internode.internode_region_bytes(ranks, hosts, hidden, tokens) (or matching hidden=)."
        )


def _attrs(buffer):
    """cuda_normal's launch attributes, less those the internode kernels do not take."""
    attrs = _launch_attrs(buffer)
    for name in ("chunk_tokens", "staged"):
        del attrs[name]
    return attrs


# Calls ----------------------------------------------------------------------


def dispatch(xs, topk_idx, topk_weights, *, num_experts, num_worst_tokens, buffer):
    fn = "dispatch"
    num_tokens, num_topk = topk_idx.shape
    num_ranks, num_nodes = buffer.num_ranks, buffer.num_nodes
    num_rows = num_tokens * num_ranks if num_worst_tokens is None else int(num_worst_tokens)
    x, hidden = xs[0], xs[0].shape[1]
    row_bytes = _row_bytes(fn, xs)
    _check(fn, buffer, num_tokens=num_tokens, num_rows=num_rows, num_topk=num_topk,
           need=dispatch_region_bytes(num_tokens, num_rows, num_topk, row_bytes, num_nodes))
    if num_experts % num_ranks or num_experts // num_ranks > MAX_LOCAL_EXPERTS:
        raise ValueError(
            f"{fn}: num_experts must be a multiple of the {num_ranks} ranks with at most {MAX_LOCAL_EXPERTS} per "
            f"rank for the CUDA kernels, got {num_experts}"
        )
    scales = _scales_or_empty(xs, num_tokens)
    weights = jnp.zeros((num_tokens, num_topk), jnp.float32) if topk_weights is None else topk_weights
    out_types = _dispatch_out_types(num_tokens, num_rows, x.dtype, hidden, scales.shape[1], num_topk, num_ranks,
                                    num_experts)
    out_types += (jax.ShapeDtypeStruct((num_tokens, num_nodes), jnp.int32),)  # node_pos (the kernels' scratch)
    _native.register_ffi_targets()
    outputs = jax.ffi.ffi_call("deep_ep_jax_internode_dispatch", out_types)(
        x, scales, jnp.asarray(topk_idx, jnp.int32), jnp.asarray(weights, jnp.float32),
        num_experts=np.int64(num_experts), **_attrs(buffer))
    return _dispatch_results(outputs, xs, topk_weights)


def cached_dispatch(xs, topk_weights, handle, *, buffer):
    fn = "cached_dispatch"
    num_tokens = handle.send_pos.shape[0]
    num_rows = handle.num_worst_tokens
    num_topk = 0 if topk_weights is None else topk_weights.shape[1]
    row_bytes = _row_bytes(fn, xs)
    _check(fn, buffer, num_tokens=num_tokens, num_rows=num_rows, num_topk=num_topk,
           need=dispatch_region_bytes(num_tokens, num_rows, num_topk, row_bytes, buffer.num_nodes))
    node_pos = jax.ShapeDtypeStruct((num_tokens, buffer.num_nodes), jnp.int32)  # the kernels' scratch
    return _cached_dispatch_call("deep_ep_jax_internode_cached_dispatch", xs, topk_weights, handle, _attrs(buffer),
                                 scratch_types=(node_pos,))


def combine(x, topk_weights, handle, *, buffer):
    fn = "combine"
    num_tokens = handle.send_pos.shape[0]
    num_rows, hidden = x.shape
    num_topk = 0 if topk_weights is None else topk_weights.shape[1]
    _row_bytes(fn, (x,))
    _check(fn, buffer, num_tokens=num_tokens, num_rows=num_rows, num_topk=num_topk,
           need=combine_region_bytes(num_tokens, num_rows, num_topk, hidden, buffer.num_ranks))
    return _combine_call("deep_ep_jax_internode_combine", x, topk_weights, num_tokens,
                         (handle.send_pos, handle.num_recv_tokens, handle.recv_src_idx, handle.recv_src_rank),
                         _attrs(buffer))
