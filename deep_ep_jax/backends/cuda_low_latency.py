"""Low-latency mode of the CUDA backend: XLA FFI custom calls.

`low_latency_dispatch_send` / `_recv` and `low_latency_combine_send` / `_recv`
(see `deep_ep_jax.backends` for the interface), and `low_latency_dispatch` /
`low_latency_combine`, both halves in one kernel. A send returns a pending
value holding a token (int32 [1], the operation's sequence number on the
buffer) that the matching recv takes, so XLA keeps them in order and may
schedule other work in between. All are side-effecting custom calls: XLA
neither drops nor merges them.

Rules the kernels rely on (csrc/kernels/low_latency.h):
  * every rank runs the same sequence of low-latency operations on a buffer
    (one SPMD program does);
  * at most two operations of a buffer are in flight (sent, not yet
    received); a third send waits for the first recv and, if that recv comes
    later in the program, fails with a timeout naming the "freed" flag.
Shapes are checked here at trace time; the handlers check them again.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from deep_ep_jax import _native
from deep_ep_jax.handle import LowLatencyHandle

# Mirrors of csrc/kernels/low_latency.h and csrc/runtime/registry.h.
CONTROL_BYTES = 1 << 16
FP8_BLOCK = 128
MAX_TOPK = 64
MAX_EXPERTS = 2048
MAX_RANKS = 8
MAX_SHARED_BYTES = 48 * 1024
# Top-k the size hint provisions when not told (a combine returns M * K rows to each rank).
DEFAULT_HINT_TOPK = 16

_FP8 = jnp.float8_e4m3fn


def _align(n, a):
    return (n + a - 1) // a * a


def _row_bytes(hidden, fp8):
    return _align(hidden + (hidden // FP8_BLOCK) * 4, 16) if fp8 else 2 * hidden


def _dispatch_half_bytes(num_ranks, num_local_experts, max_tokens, num_topk, hidden, fp8):
    """Bytes of one half a dispatch with these shapes uses (MakeDispatchLayout)."""
    capacity = max_tokens * num_topk
    infos = _align(num_ranks * num_local_experts * 4, 16)
    rows = infos + _align(num_ranks * capacity * 4, 16)
    return rows + num_ranks * max_tokens * _row_bytes(hidden, fp8)


def _combine_half_bytes(max_tokens, num_topk, hidden):
    return max_tokens * num_topk * hidden * 2


def _half_bytes(region_bytes):
    """Usable bytes of each half of a region (HalfBytes)."""
    region_bytes = max(int(region_bytes), CONTROL_BYTES)
    return (region_bytes - CONTROL_BYTES) // 2 // 256 * 256


def _shared_bytes(num_experts, hidden, fp8):
    send = _align(4 * (2 * num_experts + 1 + 33), 16) + (_row_bytes(hidden, True) if fp8 else 0)
    recv = 4 * (2 * num_experts + 2 + 33)
    return max(send, recv)


def low_latency_region_bytes(num_ranks, num_experts, hidden, num_max_dispatch_tokens_per_rank, num_topk=None) -> int:
    """Bytes of the low-latency region per device for these shapes.

    The region holds a control block and two halves (consecutive operations
    alternate); a half holds a dispatch's rows (up to M per source rank) or a
    combine's (M * K, this rank's tokens' expert outputs). `num_topk`
    defaults to DEFAULT_HINT_TOPK; pass the real top-k to save memory.
    `num_experts` may be None (sized for MAX_EXPERTS); `hidden` is required.
    """
    if hidden is None:
        raise ValueError(
            "low_latency_region_bytes: hidden is required to size the low-latency region; "
            "create the Buffer with hidden=... (or num_rdma_bytes=...)"
        )
    if num_max_dispatch_tokens_per_rank is None:
        raise ValueError("low_latency_region_bytes: num_max_dispatch_tokens_per_rank is required")
    num_topk = DEFAULT_HINT_TOPK if num_topk is None else int(num_topk)
    num_local = MAX_EXPERTS // num_ranks + 1 if num_experts is None else -(-int(num_experts) // num_ranks)
    max_tokens, hidden = int(num_max_dispatch_tokens_per_rank), int(hidden)
    half = max(_dispatch_half_bytes(num_ranks, num_local, max_tokens, num_topk, hidden, False),
               _combine_half_bytes(max_tokens, num_topk, hidden))
    return CONTROL_BYTES + 2 * _align(half, 256)


def low_latency_send_bytes(num_ranks, hidden, num_max_dispatch_tokens_per_rank, num_topk=None) -> int:
    """Bytes of the send area of a Buffer across hosts (after its low-latency
    region in NVSHMEM's symmetric heap): rows put to other hosts are staged
    there: M * K slots for a dispatch (a token uses one per destination rank)
    and one per (source rank, token, k) for a combine
    (DispatchStageBytes/CombineStageBytes)."""
    if hidden is None or num_max_dispatch_tokens_per_rank is None:
        raise ValueError("low_latency_send_bytes: hidden and num_max_dispatch_tokens_per_rank are required")
    num_topk = DEFAULT_HINT_TOPK if num_topk is None else int(num_topk)
    slots = int(num_max_dispatch_tokens_per_rank) * num_topk
    dispatch = slots * _row_bytes(int(hidden), False)
    combine = int(num_ranks) * _combine_half_bytes(int(num_max_dispatch_tokens_per_rank), num_topk, int(hidden))
    return _align(max(dispatch, combine), 256)


# Pending values ------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchPending:
    """Between low_latency_dispatch_send and _recv: rows are in flight."""

    token: jax.Array  # int32 [1]: sequence number of the operation
    num_experts: int = dataclasses.field(metadata=dict(static=True))
    max_tokens: int = dataclasses.field(metadata=dict(static=True))
    hidden: int = dataclasses.field(metadata=dict(static=True))
    num_topk: int = dataclasses.field(metadata=dict(static=True))
    use_fp8: bool = dataclasses.field(metadata=dict(static=True))
    # An overlapped send's inputs: the receive takes them so that XLA keeps
    # them while the send, beside XLA's stream, may still read them.
    keep_alive: tuple = ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CombinePending:
    """Between low_latency_combine_send and _recv: expert outputs are in flight."""

    token: jax.Array  # int32 [1]
    topk_idx: jax.Array  # int32 [T, K]
    topk_weights: jax.Array  # float32 [T, K]
    hidden: int = dataclasses.field(metadata=dict(static=True))
    keep_alive: tuple = ()  # as DispatchPending's


# Checks --------------------------------------------------------------------


def _check_region(buffer, needed, fn, what):
    available = _half_bytes(buffer.num_rdma_bytes)
    if needed > available:
        raise ValueError(
            f"{fn}: the buffer's low-latency region is too small for {what}: each half needs {needed} bytes, "
            f"has {available} (num_rdma_bytes={buffer.num_rdma_bytes}); create the Buffer with "
            f"num_rdma_bytes=deep_ep_jax.backends.cuda_low_latency.low_latency_region_bytes(num_ranks, "
            f"num_experts, hidden, num_max_dispatch_tokens_per_rank, num_topk)"
        )


def _check_send_area(buffer, needed, fn, what):
    """A Buffer across hosts stages rows for other hosts in its send area."""
    if getattr(buffer, "spans_hosts", False) and needed > buffer.num_send_bytes:
        raise ValueError(
            f"{fn}: the send area of this Buffer across hosts is too small for {what}: needs {needed} bytes, has "
            f"{buffer.num_send_bytes}; create the Buffer with the hidden and num_max_dispatch_tokens_per_rank of "
            f"these calls (the send area is sized for top-k <= {DEFAULT_HINT_TOPK})"
        )


def _check_dispatch(x, topk_idx, num_experts, max_tokens, buffer, fn):
    num_ranks = buffer.num_ranks
    if num_ranks > MAX_RANKS:
        raise ValueError(f"{fn}: at most {MAX_RANKS} ranks over NVLink, got {num_ranks}")
    if jnp.dtype(x.dtype) != jnp.bfloat16 or x.ndim != 2:
        raise TypeError(f"{fn}: x must be bfloat16 [T, H], got {jnp.dtype(x.dtype)} {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if hidden % FP8_BLOCK:
        raise ValueError(f"{fn}: hidden must be a multiple of {FP8_BLOCK} (FP8 blocks), got {hidden}")
    if num_tokens > max_tokens:
        raise ValueError(f"{fn}: x has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank={max_tokens}")
    if topk_idx.ndim != 2 or topk_idx.shape[0] != num_tokens:
        raise ValueError(f"{fn}: topk_idx must be [{num_tokens}, K], got {tuple(topk_idx.shape)}")
    num_topk = topk_idx.shape[1]
    if not 1 <= num_topk <= MAX_TOPK:
        raise ValueError(f"{fn}: top-k must be in [1, {MAX_TOPK}] for the CUDA kernels, got {num_topk}")
    if num_experts % num_ranks or num_experts > MAX_EXPERTS:
        raise ValueError(
            f"{fn}: num_experts must be a multiple of {num_ranks} ranks and <= {MAX_EXPERTS} for the CUDA "
            f"kernels, got {num_experts}"
        )
    return num_tokens, hidden, num_topk


def _half(name, buffer):
    """The custom call of a split half: overlapped with XLA's work, or on its stream."""
    return name + "_overlapped" if buffer.config.low_latency_overlap_sms else name


def _check_pending(pending, buffer, fn):
    """A receive must be of the same flavour as its send (overlapped or not)."""
    if bool(pending.keep_alive) != bool(buffer.config.low_latency_overlap_sms):
        raise ValueError(
            f"{fn}: the send was {'' if pending.keep_alive else 'not '}overlapped but this buffer's "
            f"config.low_latency_overlap_sms is {buffer.config.low_latency_overlap_sms}; receive with the buffer "
            f"that sent"
        )


def _call(name, out_types, args, buffer, **attrs):
    _native.register_ffi_targets()
    call = jax.ffi.ffi_call(name, out_types, has_side_effect=True)
    return call(*args, buffer_id=np.int64(buffer.buffer_id), timeout_ns=np.int64(buffer.config.timeout_ns), **attrs)


# Operations ----------------------------------------------------------------


def _dispatch_attrs(x, topk_idx, num_experts, max_tokens, use_fp8, round_scale, buffer, fn):
    """Checks a dispatch's send half; returns (its pending value less the
    token, the custom call's attributes)."""
    max_tokens = int(max_tokens)
    _, hidden, num_topk = _check_dispatch(x, topk_idx, num_experts, max_tokens, buffer, fn)
    if _shared_bytes(num_experts, hidden, use_fp8) > MAX_SHARED_BYTES:
        raise ValueError(
            f"{fn}: num_experts={num_experts} with hidden={hidden} needs more shared memory than the kernels use "
            f"({_shared_bytes(num_experts, hidden, use_fp8)} > {MAX_SHARED_BYTES} bytes)"
        )
    num_local = num_experts // buffer.num_ranks
    needed = _dispatch_half_bytes(buffer.num_ranks, num_local, max_tokens, num_topk, hidden, use_fp8)
    _check_region(buffer, needed, fn, f"M={max_tokens}, top-k={num_topk}, hidden={hidden}")
    _check_send_area(buffer, max_tokens * num_topk * _row_bytes(hidden, use_fp8), fn,
                     f"M={max_tokens}, top-k={num_topk}, hidden={hidden}")
    pending = DispatchPending(None, int(num_experts), max_tokens, int(hidden), int(num_topk), bool(use_fp8))
    attrs = dict(num_experts=np.int64(num_experts), max_tokens=np.int64(max_tokens), use_fp8=bool(use_fp8),
                 round_scale=bool(round_scale))
    return pending, attrs


def _dispatch_out_types(pending, buffer):
    """What a dispatch's receive half returns: recv_x, scales, count and the handle's arrays."""
    num_local = pending.num_experts // buffer.num_ranks
    rows = buffer.num_ranks * pending.max_tokens
    hidden = pending.hidden
    scales_shape = (num_local, rows, hidden // FP8_BLOCK) if pending.use_fp8 else (1,)
    return (
        jax.ShapeDtypeStruct((num_local, rows, hidden), _FP8 if pending.use_fp8 else jnp.bfloat16),
        jax.ShapeDtypeStruct(scales_shape, jnp.float32),
        jax.ShapeDtypeStruct((num_local,), jnp.int32),
        jax.ShapeDtypeStruct((num_local, rows), jnp.int32),
        jax.ShapeDtypeStruct((num_local, rows), jnp.int32),
        jax.ShapeDtypeStruct((num_local, rows), jnp.int32),
    )


def _dispatch_results(pending, outputs):
    recv_x, scales, recv_count, src_rank, src_token, src_topk = outputs
    handle = LowLatencyHandle(
        recv_count=recv_count, recv_src_rank=src_rank, recv_src_token=src_token, recv_src_topk=src_topk
    )
    recv_xs = (recv_x, scales) if pending.use_fp8 else (recv_x,)
    return recv_xs, recv_count, handle


def low_latency_dispatch_send(
    x, topk_idx, *, num_experts, num_max_dispatch_tokens_per_rank, use_fp8, round_scale, buffer
):
    pending, attrs = _dispatch_attrs(x, topk_idx, num_experts, num_max_dispatch_tokens_per_rank, use_fp8,
                                     round_scale, buffer, "low_latency_dispatch_send")
    inputs = (x, topk_idx.astype(jnp.int32))
    overlap_sms = buffer.config.low_latency_overlap_sms
    (token,) = _call(_half("deep_ep_jax_low_latency_dispatch_send", buffer), (jax.ShapeDtypeStruct((1,), jnp.int32),),
                     inputs, buffer, max_blocks=np.int64(overlap_sms), **attrs)
    return dataclasses.replace(pending, token=token, keep_alive=inputs if overlap_sms else ())


def low_latency_dispatch_recv(pending, *, buffer):
    if not isinstance(pending, DispatchPending):
        raise TypeError(
            f"low_latency_dispatch_recv: pending must come from the CUDA low_latency_dispatch_send, "
            f"got {type(pending).__name__}"
        )
    _check_pending(pending, buffer, "low_latency_dispatch_recv")
    outputs = _call(_half("deep_ep_jax_low_latency_dispatch_recv", buffer), _dispatch_out_types(pending, buffer),
                    (pending.token,) + pending.keep_alive, buffer, num_topk=np.int64(pending.num_topk))
    return _dispatch_results(pending, outputs)


def low_latency_dispatch(x, topk_idx, *, num_experts, num_max_dispatch_tokens_per_rank, use_fp8, round_scale, buffer):
    """Both halves in one kernel."""
    pending, attrs = _dispatch_attrs(x, topk_idx, num_experts, num_max_dispatch_tokens_per_rank, use_fp8,
                                     round_scale, buffer, "low_latency_dispatch")
    outputs = _call("deep_ep_jax_low_latency_dispatch", _dispatch_out_types(pending, buffer),
                    (x, topk_idx.astype(jnp.int32)), buffer, **attrs)
    return _dispatch_results(pending, outputs)


def _check_combine(x, topk_idx, buffer, fn):
    """Checks a combine's send half; returns num_topk."""
    if jnp.dtype(x.dtype) != jnp.bfloat16 or x.ndim != 3:
        raise TypeError(f"{fn}: x must be bfloat16 [E/R, R*M, H], got {jnp.dtype(x.dtype)} {tuple(x.shape)}")
    num_local, rows, hidden = x.shape
    if rows % buffer.num_ranks:
        raise ValueError(f"{fn}: x's second dimension ({rows}) must be R*M with R={buffer.num_ranks}")
    if hidden % 8:
        raise ValueError(f"{fn}: hidden must be a multiple of 8, got {hidden}")
    num_topk = topk_idx.shape[1]
    if not 1 <= num_topk <= MAX_TOPK:
        raise ValueError(f"{fn}: top-k must be in [1, {MAX_TOPK}] for the CUDA kernels, got {num_topk}")
    max_tokens = rows // buffer.num_ranks
    _check_region(buffer, _combine_half_bytes(max_tokens, num_topk, hidden), fn, f"M={max_tokens}, top-k={num_topk}")
    _check_send_area(buffer, buffer.num_ranks * _combine_half_bytes(max_tokens, num_topk, hidden), fn,
                     f"M={max_tokens}, top-k={num_topk}, hidden={hidden}")
    return num_topk


def _handle_arrays(handle):
    return (handle.recv_count, handle.recv_src_rank, handle.recv_src_token, handle.recv_src_topk)


def low_latency_combine_send(x, topk_idx, topk_weights, handle, *, buffer):
    num_topk = _check_combine(x, topk_idx, buffer, "low_latency_combine_send")
    inputs = (x,) + _handle_arrays(handle)
    overlap_sms = buffer.config.low_latency_overlap_sms
    (token,) = _call(_half("deep_ep_jax_low_latency_combine_send", buffer), (jax.ShapeDtypeStruct((1,), jnp.int32),),
                     inputs, buffer, num_topk=np.int64(num_topk), max_blocks=np.int64(overlap_sms))
    return CombinePending(token, topk_idx.astype(jnp.int32), topk_weights.astype(jnp.float32), int(x.shape[2]),
                          keep_alive=inputs if overlap_sms else ())


def low_latency_combine_recv(pending, *, buffer):
    if not isinstance(pending, CombinePending):
        raise TypeError(
            f"low_latency_combine_recv: pending must come from the CUDA low_latency_combine_send, "
            f"got {type(pending).__name__}"
        )
    _check_pending(pending, buffer, "low_latency_combine_recv")
    num_tokens = pending.topk_idx.shape[0]
    (out,) = _call(
        _half("deep_ep_jax_low_latency_combine_recv", buffer),
        (jax.ShapeDtypeStruct((num_tokens, pending.hidden), jnp.bfloat16),),
        (pending.token, pending.topk_idx, pending.topk_weights) + pending.keep_alive,
        buffer,
    )
    return out


def low_latency_combine(x, topk_idx, topk_weights, handle, *, buffer):
    """Both halves in one kernel."""
    _check_combine(x, topk_idx, buffer, "low_latency_combine")
    (out,) = _call(
        "deep_ep_jax_low_latency_combine",
        (jax.ShapeDtypeStruct((topk_idx.shape[0], x.shape[2]), jnp.bfloat16),),
        (x,) + _handle_arrays(handle) + (topk_idx.astype(jnp.int32), topk_weights.astype(jnp.float32)),
        buffer,
    )
    return out
