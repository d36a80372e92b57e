"""Normal mode for an EP group across hosts, as CUDA custom calls over NVSHMEM.

The kernels are `csrc/kernels/internode.cu` (FFI: csrc/ffi/internode.cc;
design: docs/internode.md): dispatch sends each token over the network at
most once per destination host, to the GPU with the sender's local index
there, which forwards it over NVLink; combine sums each host's rows of a
token on that GPU and sends one bf16 partial per host back to the source
rank, which sums the partials in host order, bit-identical to
`deep_ep_jax.backends.reference` (which models the same hosts). Same signatures and handle as `intranode`;
a Buffer whose EP group spans hosts (`buffer.spans_hosts`) runs these. Rows
land in the Buffer's normal region in NVSHMEM's symmetric heap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deep_ep_jax import _native
from deep_ep_jax.backends.cuda import common
from deep_ep_jax.backends.cuda.common import FfiTarget
from deep_ep_jax.distributed import multiprocess

# The kernels' scratch, [T, hosts] int32, comes after the results both paths share.
DISPATCH = FfiTarget("deep_ep_jax_internode_dispatch", common.DISPATCH_RESULTS + ("node_pos",))
CACHED_DISPATCH = FfiTarget("deep_ep_jax_internode_cached_dispatch", common.CACHED_DISPATCH_RESULTS + ("node_pos",))
COMBINE = FfiTarget("deep_ep_jax_internode_combine", common.COMBINE_RESULTS)
TARGETS = (DISPATCH, CACHED_DISPATCH, COMBINE)


def check_nodes(nodes) -> int:
    """The host index of each rank (0..H-1): every host must hold the same
    number of ranks (a token is forwarded by the GPU of the sender's local
    index), at most `max_internode_host_ranks` (32: the kernels keep a host's
    ranks in fixed arrays and 32-bit masks). Returns the number of hosts."""
    sizes = multiprocess.ranks_per_host(nodes, "cuda")
    num_nodes = len(sizes)
    max_per_host = common.limit("max_internode_host_ranks")
    if sizes[0] > max_per_host:
        raise NotImplementedError(
            f"Buffer(backend='cuda'): internode normal mode serves NVLink domains of at most {max_per_host} GPUs "
            f"of the EP group on a host, got {sizes[0]}; set Config.gpus_per_nvlink_domain / "
            f"DEEP_EP_JAX_GPUS_PER_NVLINK_DOMAIN to {max_per_host} or fewer (the rest talk through NVSHMEM)"
        )
    return num_nodes


def _check_region(fn, buffer, need, *, num_tokens, num_rows, num_topk):
    if buffer.num_nvl_bytes < need:
        raise ValueError(
            f"{fn}: the Buffer's EP group spans hosts; its normal region (NVSHMEM symmetric heap) needs {need} bytes "
            f"for {num_tokens} tokens, {num_rows} rows and top-k {num_topk}, and has num_nvl_bytes="
            f"{buffer.num_nvl_bytes}. Create the Buffer with num_nvl_bytes >= "
            f"deep_ep_jax.backends.cuda.sizes.internode_region_bytes(ranks, hosts, hidden, tokens) (or a matching "
            f"hidden=)."
        )


def _dispatch_region_bytes(buffer, num_tokens, num_rows, num_topk, row_bytes):
    return _native.extension().internode_dispatch_region_bytes(
        num_tokens, num_rows, num_topk, row_bytes[0], row_bytes[1], buffer.num_ranks, buffer.num_nodes
    )


def _launch_attrs(buffer):
    """The normal-mode launch attributes and whether the kernels pipeline their stages (Config.internode_pipeline)."""
    return dict(common.launch_attrs(buffer), pipeline=np.int64(buffer.config.internode_pipeline))


def _node_pos(num_tokens, buffer):
    return dict(node_pos=jax.ShapeDtypeStruct((num_tokens, buffer.num_nodes), jnp.int32))


def dispatch(xs, topk_idx, topk_weights, *, num_experts, num_worst_tokens, buffer):
    fn = "dispatch"
    num_tokens, num_topk = topk_idx.shape
    num_ranks = buffer.num_ranks
    num_rows = num_tokens * num_ranks if num_worst_tokens is None else int(num_worst_tokens)
    row_bytes = common.row_bytes(fn, xs)
    shape = dict(num_tokens=num_tokens, num_rows=num_rows, num_topk=num_topk)
    common.check_common(fn, buffer, **shape)
    _check_region(fn, buffer, _dispatch_region_bytes(buffer, num_tokens, num_rows, num_topk, row_bytes), **shape)
    common.check_num_experts(fn, num_experts, num_ranks)
    return common.dispatch_call(
        DISPATCH,
        buffer,
        xs,
        topk_idx,
        topk_weights,
        num_experts,
        num_rows,
        num_ranks,
        _launch_attrs(buffer),
        scratch_types=_node_pos(num_tokens, buffer),
    )


def cached_dispatch(xs, topk_weights, handle, *, buffer):
    fn = "cached_dispatch"
    num_tokens = handle.send_pos.shape[0]
    num_rows = handle.num_worst_tokens
    num_topk = 0 if topk_weights is None else topk_weights.shape[1]
    row_bytes = common.row_bytes(fn, xs)
    shape = dict(num_tokens=num_tokens, num_rows=num_rows, num_topk=num_topk)
    common.check_common(fn, buffer, **shape)
    _check_region(fn, buffer, _dispatch_region_bytes(buffer, num_tokens, num_rows, num_topk, row_bytes), **shape)
    return common.cached_dispatch_call(
        CACHED_DISPATCH,
        buffer,
        xs,
        topk_weights,
        handle,
        _launch_attrs(buffer),
        scratch_types=_node_pos(num_tokens, buffer),
    )


def combine(x, topk_weights, handle, *, buffer):
    fn = "combine"
    num_tokens = handle.send_pos.shape[0]
    num_rows, hidden = x.shape
    num_topk = 0 if topk_weights is None else topk_weights.shape[1]
    common.row_bytes(fn, (x,))
    shape = dict(num_tokens=num_tokens, num_rows=num_rows, num_topk=num_topk)
    common.check_common(fn, buffer, **shape)
    need = _native.extension().internode_combine_region_bytes(
        num_tokens, num_rows, num_topk, hidden, buffer.num_ranks, buffer.num_nodes
    )
    _check_region(fn, buffer, need, **shape)
    handle_arrays = (handle.send_pos, handle.num_recv_tokens, handle.recv_src_idx, handle.recv_src_rank)
    return common.combine_call(COMBINE, buffer, x, topk_weights, num_tokens, handle_arrays, _launch_attrs(buffer))
