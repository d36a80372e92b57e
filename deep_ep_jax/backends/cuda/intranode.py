"""Normal mode (training, prefill) on one host: CUDA custom calls over NVLink.

The kernels are `csrc/kernels/intranode.cu` (FFI: csrc/ffi/intranode.cc);
each function here is one FFI call per rank, inside `shard_map`, with the
signature and results of `deep_ep_jax.backends.reference` (see
`deep_ep_jax.backends`), equal to it bit for bit. Counts stay on the device,
so the calls are command-buffer (CUDA graph) compatible.

Rows land straight in the receiver's XLA output buffers. With
DEEP_EP_JAX_STAGED=1 when the Buffer is made, they land in a staging area of
the Buffer's normal region instead, copied locally by extra blocks of the
same kernels while the transfer runs: it does not need peer access to XLA's
memory. Multi-process buffers (peers in other processes, `buffer.ipc`) are
always staged: XLA's buffers of another process are out of reach.
`buffer.staged` holds the choice.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from deep_ep_jax import _native
from deep_ep_jax.backends.cuda import common
from deep_ep_jax.backends.cuda.common import FfiTarget
from deep_ep_jax.config import env_bool

DISPATCH = FfiTarget("deep_ep_jax_dispatch", common.DISPATCH_RESULTS)
CACHED_DISPATCH = FfiTarget("deep_ep_jax_cached_dispatch", common.CACHED_DISPATCH_RESULTS)
COMBINE = FfiTarget("deep_ep_jax_combine", common.COMBINE_RESULTS)
TARGETS = (DISPATCH, CACHED_DISPATCH, COMBINE)

STAGED_ENV = "DEEP_EP_JAX_STAGED"


def staged_requested() -> bool:
    """Whether DEEP_EP_JAX_STAGED asks for staged mode (read when a Buffer is made)."""
    return env_bool(STAGED_ENV, False)


def _num_chunks(num_tokens, config) -> int:
    """Chunk records per source of a staged dispatch: ceil(tokens / chunk_tokens)."""
    return -(-num_tokens // config.chunk_tokens)


def _check_region(fn, buffer, num_rows, row_bytes, num_topk, num_chunks):
    """num_chunks: _num_chunks of the tokens for dispatch, 0 for combine (as the FFI check)."""
    if not buffer.staged:
        return
    need = _native.extension().staged_region_bytes(
        num_rows, row_bytes[0], row_bytes[1], num_topk, num_chunks, buffer.num_ranks
    )
    if buffer.num_nvl_bytes < need:
        multi = buffer.ipc or buffer.nvshmem
        mode = "a multi-process buffer (staged)" if multi else "staged mode (DEEP_EP_JAX_STAGED=1)"
        raise ValueError(
            f"{fn}: {mode} needs a normal region of at least {need} bytes for "
            f"{num_rows} rows of {sum(row_bytes)} bytes and top-k {num_topk}; the buffer has num_nvl_bytes="
            f"{buffer.num_nvl_bytes}. Create the Buffer with num_nvl_bytes >= {need} (or a matching hidden=)."
        )


def _attrs(buffer):
    return dict(
        common.launch_attrs(buffer), chunk_tokens=np.int64(buffer.config.chunk_tokens), staged=np.int64(buffer.staged)
    )


def dispatch(xs, topk_idx, topk_weights, *, num_experts, num_worst_tokens, buffer):
    fn = "dispatch"
    num_tokens, num_topk = topk_idx.shape
    num_ranks = buffer.num_ranks
    num_rows = num_tokens * num_ranks if num_worst_tokens is None else int(num_worst_tokens)
    row_bytes = common.row_bytes(fn, xs)
    common.check_common(fn, buffer, num_tokens=num_tokens, num_rows=num_rows, num_topk=num_topk)
    common.check_num_experts(fn, num_experts, num_ranks)
    _check_region(fn, buffer, num_rows, row_bytes, num_topk, _num_chunks(num_tokens, buffer.config))
    return common.dispatch_call(
        DISPATCH, buffer, xs, topk_idx, topk_weights, num_experts, num_rows, num_ranks, _attrs(buffer)
    )


def cached_dispatch(xs, topk_weights, handle, *, buffer):
    fn = "cached_dispatch"
    num_tokens = handle.send_pos.shape[0]
    num_rows = handle.num_worst_tokens
    num_topk = 0 if topk_weights is None else topk_weights.shape[1]
    row_bytes = common.row_bytes(fn, xs)
    common.check_common(fn, buffer, num_tokens=num_tokens, num_rows=num_rows, num_topk=num_topk)
    _check_region(fn, buffer, num_rows, row_bytes, num_topk, _num_chunks(num_tokens, buffer.config))
    return common.cached_dispatch_call(CACHED_DISPATCH, buffer, xs, topk_weights, handle, _attrs(buffer))


def combine(x, topk_weights, handle, *, buffer):
    fn = "combine"
    num_tokens = handle.send_pos.shape[0]
    num_rows = x.shape[0]
    num_topk = 0 if topk_weights is None else topk_weights.shape[1]
    row_bytes = common.row_bytes(fn, (x,))
    common.check_common(fn, buffer, num_tokens=num_tokens, num_rows=num_rows, num_topk=num_topk)
    _check_region(fn, buffer, num_rows, row_bytes, num_topk, 0)
    handle_arrays = (handle.send_pos, handle.num_recv_tokens, jnp.asarray(handle.rank_prefix_matrix, jnp.int32))
    return common.combine_call(COMBINE, buffer, x, topk_weights, num_tokens, handle_arrays, _attrs(buffer))
