"""Normal mode (training, prefill) as CUDA custom calls over NVLink.

The kernels are `csrc/kernels/intranode.cu`; each function here is one FFI
call per rank, inside `shard_map`, with the signature and results of
`deep_ep_jax.backends.reference` (see `deep_ep_jax.backends`), equal to it
bit for bit. Counts stay on the device, so the calls are command-buffer
(CUDA graph) compatible.

Rows land straight in the receiver's XLA output buffers. Set
DEEP_EP_JAX_STAGED=1 (before creating the Buffer) to land them in a staging
area of the Buffer's normal region instead, copied locally by extra blocks of
the same kernels while the transfer runs: it does not need peer access to
XLA's memory. Multi-process buffers (peers in other processes, `buffer.ipc`)
are always staged: XLA's buffers of another process are out of reach.

An EP group across hosts (`buffer.spans_hosts`, NVSHMEM) runs the internode
kernels instead: `deep_ep_jax.backends.cuda_internode`, same signatures.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from deep_ep_jax import _native
from deep_ep_jax.handle import DispatchHandle

# Limits of the kernels (csrc/kernels/intranode.h, csrc/runtime/registry.h).
CONTROL_BYTES = 1 << 16
MAX_RANKS = 8
MAX_LOCAL_EXPERTS = 4096
STAGING_ALIGN = 256
STAGED_RECORD_BYTES = 16  # a dispatch chunk record (ChunkRecord)
STAGED_COPY_ROWS = 32  # rows per combine ready flag (kStagedCopyRows)
INT32_MAX = 2**31 - 1

# The standard case the Buffer is sized for when it is not told.
DEFAULT_HIDDEN = 7168
DEFAULT_TOKENS = 4096
DEFAULT_TOPK = 16  # staging room for top-k ids and weights

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_BLOCK = 128


def staged(buffer=None) -> bool:
    """Whether rows land in the Buffer's staging area (DEEP_EP_JAX_STAGED=1,
    or a multi-process buffer)."""
    if getattr(buffer, "ipc", False):
        return True
    return os.environ.get("DEEP_EP_JAX_STAGED", "0").lower() in ("1", "true", "yes", "on")


def _align(n: int) -> int:
    return (n + STAGING_ALIGN - 1) // STAGING_ALIGN * STAGING_ALIGN


def staged_region_bytes(num_rows: int, row_bytes: tuple[int, int], num_topk: int, num_chunks: int) -> int:
    """Mirror of StagedRegionBytes in intranode.cu: control bytes, then
    num_rows rows of each row array, top-k ids, weights and source indices,
    then MAX_RANKS * num_chunks chunk records (dispatch: num_chunks =
    ceil(tokens / chunk_tokens); 0 for combine) and MAX_RANKS ready flags
    (one per source) per STAGED_COPY_ROWS rows."""
    offset = CONTROL_BYTES
    num_flags = MAX_RANKS * -(-num_rows // STAGED_COPY_ROWS)
    for size in (num_rows * row_bytes[0], num_rows * row_bytes[1], num_rows * num_topk * 4, num_rows * num_topk * 4,
                 num_rows * 4, MAX_RANKS * num_chunks * STAGED_RECORD_BYTES, num_flags * 4):
        offset = _align(offset + size)
    return offset


def _num_chunks(num_tokens: int, config) -> int:
    """Chunk records per source of a staged dispatch: ceil(tokens / chunk_tokens)."""
    return -(-num_tokens // config.chunk_tokens)


def normal_region_bytes(num_ranks, hidden, num_tokens, config, *, force_staged=False) -> int:
    """Bytes of the normal-mode region per device. Rows go straight to XLA's
    buffers, so only the control bytes are needed, unless staged mode is on
    (DEEP_EP_JAX_STAGED=1, or force_staged for a multi-process buffer): then
    room for num_tokens * num_ranks received rows of bf16 or FP8 hidden
    (None: the standard case, 7168 and 4096), and chunk records for any
    chunk_tokens (one record per token and source)."""
    del config  # sized for chunk_tokens = 1, so any launch configuration fits
    if not (force_staged or staged()):
        return CONTROL_BYTES
    hidden = DEFAULT_HIDDEN if hidden is None else int(hidden)
    num_tokens = DEFAULT_TOKENS if num_tokens is None else int(num_tokens)
    num_rows = num_tokens * num_ranks
    bf16 = staged_region_bytes(num_rows, (2 * hidden, 0), DEFAULT_TOPK, num_tokens)
    fp8 = staged_region_bytes(num_rows, (hidden, hidden // FP8_BLOCK * 4), DEFAULT_TOPK, num_tokens)
    return max(bf16, fp8)


# Trace-time checks ----------------------------------------------------------


def _check_common(fn, buffer, *, num_tokens, num_rows, num_topk):
    if buffer.num_ranks > MAX_RANKS:
        raise ValueError(f"{fn}: the CUDA kernels support at most {MAX_RANKS} ranks, the buffer has {buffer.num_ranks}")
    if buffer.buffer_id is None:
        raise ValueError(f"{fn}: the buffer has no device memory (backend {buffer.backend!r}); use backend='cuda'")
    for what, value in (("tokens * ranks", num_tokens * buffer.num_ranks), ("tokens * topk", num_tokens * num_topk),
                        ("num_worst_tokens * topk", num_rows * num_topk)):
        if value > INT32_MAX:
            raise ValueError(f"{fn}: {what} must be <= {INT32_MAX} (32-bit row indices), got {value}")


def _row_bytes(fn, xs):
    """Bytes per row of x and of its FP8 scales (0 for bf16)."""
    x = xs[0]
    hidden = x.shape[1]
    if jnp.dtype(x.dtype) == FP8_DTYPE:
        return hidden, hidden // FP8_BLOCK * 4
    if jnp.dtype(x.dtype) != jnp.bfloat16:
        raise ValueError(f"{fn}: the CUDA kernels move bf16 or FP8 rows, got x of dtype {x.dtype}")
    if hidden % 8:
        raise ValueError(f"{fn}: bf16 hidden must be a multiple of 8 (16-byte rows) for the CUDA kernels, got {hidden}")
    return 2 * hidden, 0


def _check_region(fn, buffer, num_rows, row_bytes, num_topk, num_chunks):
    """num_chunks: _num_chunks of the tokens for dispatch, 0 for combine (as the FFI check)."""
    if not staged(buffer):
        return
    need = staged_region_bytes(num_rows, row_bytes, num_topk, num_chunks)
    if buffer.num_nvl_bytes < need:
        mode = "a multi-process buffer (staged)" if getattr(buffer, "ipc", False) else "staged mode (DEEP_EP_JAX_STAGED=1)"
        raise ValueError(
            f"{fn}: {mode} needs a normal region of at least {need} bytes for "
            f"{num_rows} rows of {sum(row_bytes)} bytes and top-k {num_topk}; the buffer has num_nvl_bytes="
            f"{buffer.num_nvl_bytes}. Create the Buffer with num_nvl_bytes >= {need} (or a matching hidden=)."
        )


# Calls ----------------------------------------------------------------------


def _launch_attrs(buffer):
    config = buffer.config
    return dict(
        buffer_id=np.int64(buffer.buffer_id),
        num_sms=np.int64(config.num_sms),
        num_warps=np.int64(config.num_warps),
        chunk_tokens=np.int64(config.chunk_tokens),
        timeout_ns=np.int64(config.timeout_ns),
        staged=np.int64(staged(buffer)),
    )


def _scales_or_empty(xs, num_tokens):
    return xs[1] if len(xs) == 2 else jnp.zeros((num_tokens, 0), jnp.float32)


def _dispatch_out_types(num_tokens, num_rows, dtype, hidden, num_scales, num_topk, num_ranks, num_experts):
    """Output types of the dispatch custom calls (one host and several), in order."""
    i32 = jnp.int32
    return (
        jax.ShapeDtypeStruct((num_rows, hidden), dtype),  # recv_x
        jax.ShapeDtypeStruct((num_rows, num_scales), jnp.float32),  # recv_x_scales
        jax.ShapeDtypeStruct((num_rows, num_topk), i32),  # recv_topk_idx
        jax.ShapeDtypeStruct((num_rows, num_topk), jnp.float32),  # recv_topk_weights
        jax.ShapeDtypeStruct((num_tokens, num_ranks), jnp.bool_),  # is_token_in_rank
        jax.ShapeDtypeStruct((num_ranks,), i32),  # num_tokens_per_rank
        jax.ShapeDtypeStruct((num_ranks, num_ranks), i32),  # rank_prefix_matrix
        jax.ShapeDtypeStruct((num_tokens, num_ranks), i32),  # send_pos
        jax.ShapeDtypeStruct((num_rows,), i32),  # recv_src_idx
        jax.ShapeDtypeStruct((num_rows,), i32),  # recv_src_rank
        jax.ShapeDtypeStruct((), i32),  # num_recv_tokens
        jax.ShapeDtypeStruct((num_experts // num_ranks,), i32),  # num_recv_tokens_per_expert
        jax.ShapeDtypeStruct((), i32),  # num_dropped_tokens
    )


def _dispatch_results(outputs, xs, topk_weights):
    """(recv_xs, recv_topk_idx, recv_topk_weights, handle) from the outputs of _dispatch_out_types."""
    (recv_x, recv_scales, recv_idx, recv_w, in_rank, per_rank, prefix, send_pos, src_idx, src_rank, num_recv,
     per_expert, dropped) = outputs[:13]
    handle = DispatchHandle(
        is_token_in_rank=in_rank,
        num_tokens_per_rank=per_rank,
        rank_prefix_matrix=prefix,
        send_pos=send_pos,
        recv_src_idx=src_idx,
        recv_src_rank=src_rank,
        num_recv_tokens=num_recv,
        num_recv_tokens_per_expert=per_expert,
        num_dropped_tokens=dropped,
    )
    recv_xs = (recv_x,) if len(xs) == 1 else (recv_x, recv_scales)
    return recv_xs, recv_idx, (None if topk_weights is None else recv_w), handle


def dispatch(xs, topk_idx, topk_weights, *, num_experts, num_worst_tokens, buffer):
    if getattr(buffer, "spans_hosts", False):
        from deep_ep_jax.backends import cuda_internode  # imports this module's helpers

        return cuda_internode.dispatch(xs, topk_idx, topk_weights, num_experts=num_experts,
                                       num_worst_tokens=num_worst_tokens, buffer=buffer)
    fn = "dispatch"
    num_tokens, num_topk = topk_idx.shape
    num_ranks = buffer.num_ranks
    num_rows = num_tokens * num_ranks if num_worst_tokens is None else int(num_worst_tokens)
    x, hidden = xs[0], xs[0].shape[1]
    row_bytes = _row_bytes(fn, xs)
    _check_common(fn, buffer, num_tokens=num_tokens, num_rows=num_rows, num_topk=num_topk)
    if num_experts % num_ranks or num_experts // num_ranks > MAX_LOCAL_EXPERTS:
        raise ValueError(
            f"{fn}: num_experts must be a multiple of the {num_ranks} ranks with at most {MAX_LOCAL_EXPERTS} per "
            f"rank for the CUDA kernels, got {num_experts}"
        )
    _check_region(fn, buffer, num_rows, row_bytes, num_topk, _num_chunks(num_tokens, buffer.config))

    scales = _scales_or_empty(xs, num_tokens)
    weights = jnp.zeros((num_tokens, num_topk), jnp.float32) if topk_weights is None else topk_weights
    i32 = jnp.int32
    out_types = _dispatch_out_types(num_tokens, num_rows, x.dtype, hidden, scales.shape[1], num_topk, num_ranks,
                                    num_experts)
    _native.register_ffi_targets()
    outputs = jax.ffi.ffi_call("deep_ep_jax_dispatch", out_types)(
        x, scales, jnp.asarray(topk_idx, i32), jnp.asarray(weights, jnp.float32),
        num_experts=np.int64(num_experts), **_launch_attrs(buffer))
    return _dispatch_results(outputs, xs, topk_weights)


def cached_dispatch(xs, topk_weights, handle, *, buffer):
    if getattr(buffer, "spans_hosts", False):
        from deep_ep_jax.backends import cuda_internode  # imports this module's helpers

        return cuda_internode.cached_dispatch(xs, topk_weights, handle, buffer=buffer)
    fn = "cached_dispatch"
    num_tokens = handle.send_pos.shape[0]
    num_rows = handle.num_worst_tokens
    num_topk = 0 if topk_weights is None else topk_weights.shape[1]
    row_bytes = _row_bytes(fn, xs)
    _check_common(fn, buffer, num_tokens=num_tokens, num_rows=num_rows, num_topk=num_topk)
    _check_region(fn, buffer, num_rows, row_bytes, num_topk, _num_chunks(num_tokens, buffer.config))
    return _cached_dispatch_call("deep_ep_jax_cached_dispatch", xs, topk_weights, handle, _launch_attrs(buffer))


def _cached_dispatch_call(target, xs, topk_weights, handle, attrs, scratch_types=()):
    """The cached-dispatch custom call of either path (this host, or across
    hosts, which adds its scratch outputs): rows (and scales), weights, the
    handle's send positions and received-row count; returns (received rows
    (and scales), received weights or None)."""
    num_tokens, num_rows = handle.send_pos.shape[0], handle.num_worst_tokens
    num_topk = 0 if topk_weights is None else topk_weights.shape[1]
    x = xs[0]
    scales = _scales_or_empty(xs, num_tokens)
    weights = jnp.zeros((num_tokens, 0), jnp.float32) if topk_weights is None else topk_weights
    out_types = (
        jax.ShapeDtypeStruct((num_rows, x.shape[1]), x.dtype),
        jax.ShapeDtypeStruct((num_rows, scales.shape[1]), jnp.float32),
        jax.ShapeDtypeStruct((num_rows, num_topk), jnp.float32),
    ) + tuple(scratch_types)
    _native.register_ffi_targets()
    recv_x, recv_scales, recv_w = jax.ffi.ffi_call(target, out_types)(
        x, scales, jnp.asarray(weights, jnp.float32), handle.send_pos, handle.num_recv_tokens, **attrs)[:3]
    recv_xs = (recv_x,) if len(xs) == 1 else (recv_x, recv_scales)
    return recv_xs, (None if topk_weights is None else recv_w)


def combine(x, topk_weights, handle, *, buffer):
    if getattr(buffer, "spans_hosts", False):
        from deep_ep_jax.backends import cuda_internode  # imports this module's helpers

        return cuda_internode.combine(x, topk_weights, handle, buffer=buffer)
    fn = "combine"
    num_tokens = handle.send_pos.shape[0]
    num_rows = x.shape[0]
    num_topk = 0 if topk_weights is None else topk_weights.shape[1]
    row_bytes = _row_bytes(fn, (x,))
    _check_common(fn, buffer, num_tokens=num_tokens, num_rows=num_rows, num_topk=num_topk)
    _check_region(fn, buffer, num_rows, row_bytes, num_topk, 0)
    return _combine_call("deep_ep_jax_combine", x, topk_weights, num_tokens,
                         (handle.send_pos, handle.num_recv_tokens, jnp.asarray(handle.rank_prefix_matrix, jnp.int32)),
                         _launch_attrs(buffer))


def _combine_call(target, x, topk_weights, num_tokens, handle_arrays, attrs):
    """The combine custom call of either path (this host, or across hosts):
    x and the weights, then the path's handle arrays; returns (out bf16
    [T, H], reduced weights f32 [T, K] or None)."""
    num_rows, hidden = x.shape
    num_topk = 0 if topk_weights is None else topk_weights.shape[1]
    weights = jnp.zeros((num_rows, 0), jnp.float32) if topk_weights is None else topk_weights
    out_types = (
        jax.ShapeDtypeStruct((num_tokens, hidden), x.dtype),
        jax.ShapeDtypeStruct((num_tokens, num_topk), jnp.float32),
    )
    _native.register_ffi_targets()
    out, out_w = jax.ffi.ffi_call(target, out_types)(x, jnp.asarray(weights, jnp.float32), *handle_arrays, **attrs)
    return out, (None if topk_weights is None else out_w)
