"""Low-latency mode of the CUDA backend: XLA FFI custom calls
(csrc/ffi/low_latency.cc).

`low_latency_dispatch_send` / `_recv` and `low_latency_combine_send` / `_recv`
(see `deep_ep_jax.backends` for the interface), and `low_latency_dispatch` /
`low_latency_combine`, both halves in one kernel. A send returns a pending
value holding a token (int32 [1], the operation's sequence number on the
buffer) that the matching recv takes, so XLA keeps them in order and may
schedule other work in between. As every call of a Buffer, they are chained
by its order state and carry no JAX effect (`common.FfiTarget`): a recv whose
results nothing uses may be dropped, leaving its send unanswered (the buffer's
next sends then time out on the "freed" flag): receive what you send.

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
from jax import lax

from deep_ep_jax import _native
from deep_ep_jax.backends.cuda import sizes
from deep_ep_jax.backends.cuda.common import FfiTarget, limit
from deep_ep_jax.comm.handle import LowLatencyHandle
from deep_ep_jax.config import FP8_BLOCK

_FP8 = jnp.float8_e4m3fn

_TOKEN = ("token",)  # a send's result: the operation's sequence number
_DISPATCH_RECV = ("recv_x", "recv_scales", "recv_count", "recv_src_rank", "recv_src_token", "recv_src_topk")
_OUT = ("out",)


def _targets(name, results):
    """A split half's target on XLA's stream and its overlapped flavour (beside it)."""
    return (
        FfiTarget(f"deep_ep_jax_low_latency_{name}", results),
        FfiTarget(f"deep_ep_jax_low_latency_{name}_overlapped", results),
    )


DISPATCH_SEND = _targets("dispatch_send", _TOKEN)
DISPATCH_RECV = _targets("dispatch_recv", _DISPATCH_RECV)
COMBINE_SEND = _targets("combine_send", _TOKEN)
COMBINE_RECV = _targets("combine_recv", _OUT)
DISPATCH = FfiTarget("deep_ep_jax_low_latency_dispatch", _DISPATCH_RECV)
COMBINE = FfiTarget("deep_ep_jax_low_latency_combine", _OUT)
MASK = FfiTarget("deep_ep_jax_low_latency_mask", ("mask",))
TARGETS = DISPATCH_SEND + DISPATCH_RECV + COMBINE_SEND + COMBINE_RECV + (DISPATCH, COMBINE, MASK)


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
    mxfp8: bool = dataclasses.field(metadata=dict(static=True))
    num_tokens: int = dataclasses.field(metadata=dict(static=True))  # T of the dispatch (<= max_tokens)
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
    num_experts: int = dataclasses.field(metadata=dict(static=True))  # ids outside [0, E) name no expert
    keep_alive: tuple = ()  # as DispatchPending's


# Checks --------------------------------------------------------------------


def _check_region(buffer, needed, fn, what):
    available = _native.extension().low_latency_half_bytes(buffer.num_rdma_bytes)
    if needed > available:
        raise ValueError(
            f"{fn}: the buffer's low-latency region is too small for {what}: each half needs {needed} bytes, "
            f"has {available} (num_rdma_bytes={buffer.num_rdma_bytes}); create the Buffer with "
            f"num_rdma_bytes=deep_ep_jax.backends.cuda.sizes.low_latency_region_bytes(num_ranks, "
            f"num_experts, hidden, num_max_dispatch_tokens_per_rank, num_topk)"
        )


def _check_send_area(buffer, max_tokens, num_topk, hidden, fn):
    """A Buffer across hosts (NVSHMEM) stages rows for other hosts in its send area."""
    if not buffer.nvshmem:
        return
    needed = _native.extension().low_latency_send_bytes(buffer.num_ranks, hidden, max_tokens, num_topk)
    if needed > buffer.num_send_bytes:
        raise ValueError(
            f"{fn}: the send area of this Buffer across hosts is too small for M={max_tokens}, top-k={num_topk}, "
            f"hidden={hidden}: needs {needed} bytes, has {buffer.num_send_bytes}; create the Buffer with the hidden "
            f"and num_max_dispatch_tokens_per_rank of these calls (the send area is sized for top-k <= "
            f"{sizes.DEFAULT_TOPK})"
        )


def _check_dispatch(x, topk_idx, num_experts, max_tokens, buffer, fn):
    num_ranks = buffer.num_ranks
    max_ranks, max_topk = limit("max_group_ranks"), limit("low_latency_max_topk")
    max_experts = limit("low_latency_max_experts")
    if num_ranks > max_ranks:
        raise ValueError(f"{fn}: low-latency mode supports at most {max_ranks} ranks, the buffer has {num_ranks}")
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
    if not 1 <= num_topk <= max_topk:
        raise ValueError(f"{fn}: top-k must be in [1, {max_topk}] for the CUDA kernels, got {num_topk}")
    if num_experts % num_ranks or num_experts > max_experts:
        raise ValueError(
            f"{fn}: num_experts must be a multiple of {num_ranks} ranks and <= {max_experts} for the CUDA "
            f"kernels, got {num_experts}"
        )
    if num_ranks * max_tokens * num_topk >= 2**30:
        raise ValueError(
            f"{fn}: ranks * num_max_dispatch_tokens_per_rank * top-k ({num_ranks} * {max_tokens} * {num_topk}) "
            f"must be < 2^30 (the kernels count received rows in 32-bit ints)"
        )
    return num_tokens, hidden, num_topk


def _half(targets, buffer):
    """The target of a split half: overlapped with XLA's work, or on its stream."""
    on_stream, overlapped = targets
    return overlapped if buffer.config.low_latency_overlap_sms else on_stream


def _check_pending(pending, kind, buffer, fn):
    """A receive takes what its own kind of CUDA send returned, of the same
    flavour (overlapped or not)."""
    if not isinstance(pending, kind):
        send = fn.replace("_recv", "_send")
        raise TypeError(f"{fn}: pending must come from the CUDA {send}, got {type(pending).__name__}")
    if bool(pending.keep_alive) != bool(buffer.config.low_latency_overlap_sms):
        raise ValueError(
            f"{fn}: the send was {'' if pending.keep_alive else 'not '}overlapped but this buffer's "
            f"config.low_latency_overlap_sms is {buffer.config.low_latency_overlap_sms}; receive with the buffer "
            f"that sent"
        )


def _call(target, out_types, args, buffer, **attrs):
    return target(
        buffer,
        out_types,
        *args,
        buffer_id=np.int64(buffer.buffer_id),
        timeout_ns=np.int64(buffer.config.timeout_ns),
        mask_failed_ranks=bool(buffer.config.mask_failed_ranks),
        **attrs,
    )


_TOKEN_TYPE = dict(token=jax.ShapeDtypeStruct((1,), jnp.int32))


# Operations ----------------------------------------------------------------


def _dispatch_attrs(x, topk_idx, num_experts, max_tokens, fp8, buffer, fn):
    """Checks a dispatch's send half (fp8: use_fp8, round_scale, mxfp8); returns (its pending
    value less the token, the custom call's attributes)."""
    use_fp8, round_scale, mxfp8 = fp8
    max_tokens = int(max_tokens)
    num_tokens, hidden, num_topk = _check_dispatch(x, topk_idx, num_experts, max_tokens, buffer, fn)
    ext = _native.extension()
    shared = ext.low_latency_shared_bytes(buffer.num_ranks, num_experts, hidden, bool(use_fp8))
    max_shared = limit("low_latency_max_shared_bytes")
    if shared > max_shared:
        raise ValueError(
            f"{fn}: num_experts={num_experts} with hidden={hidden} at {buffer.num_ranks} ranks needs more shared "
            f"memory than the kernels use ({shared} > {max_shared} bytes)"
        )
    num_local = num_experts // buffer.num_ranks
    needed = ext.low_latency_dispatch_half_bytes(
        buffer.num_ranks, num_local, max_tokens, num_topk, hidden, bool(use_fp8)
    )
    _check_region(buffer, needed, fn, f"M={max_tokens}, top-k={num_topk}, hidden={hidden}")
    _check_send_area(buffer, max_tokens, num_topk, hidden, fn)
    pending = DispatchPending(
        None, int(num_experts), max_tokens, int(hidden), int(num_topk), bool(use_fp8), bool(mxfp8), int(num_tokens)
    )
    attrs = dict(
        num_experts=np.int64(num_experts),
        max_tokens=np.int64(max_tokens),
        use_fp8=bool(use_fp8),
        round_scale=bool(round_scale),
        mxfp8=bool(mxfp8),
    )
    return pending, attrs


def _dispatch_out_types(pending, buffer):
    """What a dispatch's receive half returns: recv_x, scales, count and the handle's arrays."""
    num_local = pending.num_experts // buffer.num_ranks
    rows = buffer.num_ranks * pending.max_tokens
    hidden = pending.hidden
    scales_shape = (num_local, rows, hidden // FP8_BLOCK) if pending.use_fp8 else (1,)
    per_row = jax.ShapeDtypeStruct((num_local, rows), jnp.int32)
    return dict(
        recv_x=jax.ShapeDtypeStruct((num_local, rows, hidden), _FP8 if pending.use_fp8 else jnp.bfloat16),
        recv_scales=jax.ShapeDtypeStruct(scales_shape, jnp.float32),
        recv_count=jax.ShapeDtypeStruct((num_local,), jnp.int32),
        recv_src_rank=per_row,
        recv_src_token=per_row,
        recv_src_topk=per_row,
    )


def _dispatch_results(pending, out):
    handle = LowLatencyHandle(
        recv_count=out["recv_count"],
        recv_src_rank=out["recv_src_rank"],
        recv_src_token=out["recv_src_token"],
        recv_src_topk=out["recv_src_topk"],
        num_tokens=pending.num_tokens,
        num_topk=pending.num_topk,
    )
    scales = out["recv_scales"]
    if pending.mxfp8:  # the kernels store float8_e8m0fnu bytes where float32 scales [.., H // 128] would be
        scales = lax.bitcast_convert_type(scales, jnp.uint8).reshape(scales.shape[:-1] + (-1,))
        scales = lax.bitcast_convert_type(scales, jnp.float8_e8m0fnu)
    recv_xs = (out["recv_x"], scales) if pending.use_fp8 else (out["recv_x"],)
    return recv_xs, out["recv_count"], handle


def low_latency_dispatch_send(
    x, topk_idx, *, num_experts, num_max_dispatch_tokens_per_rank, use_fp8, round_scale, buffer, mxfp8=False
):
    fp8, fn = (use_fp8, round_scale, mxfp8), "low_latency_dispatch_send"
    pending, attrs = _dispatch_attrs(x, topk_idx, num_experts, num_max_dispatch_tokens_per_rank, fp8, buffer, fn)
    inputs = (x, topk_idx.astype(jnp.int32))
    overlap_sms = buffer.config.low_latency_overlap_sms
    out = _call(_half(DISPATCH_SEND, buffer), _TOKEN_TYPE, inputs, buffer, max_blocks=np.int64(overlap_sms), **attrs)
    return dataclasses.replace(pending, token=out["token"], keep_alive=inputs if overlap_sms else ())


def low_latency_dispatch_recv(pending, *, buffer):
    _check_pending(pending, DispatchPending, buffer, "low_latency_dispatch_recv")
    out = _call(
        _half(DISPATCH_RECV, buffer),
        _dispatch_out_types(pending, buffer),
        (pending.token,) + pending.keep_alive,
        buffer,
        num_topk=np.int64(pending.num_topk),
    )
    return _dispatch_results(pending, out)


def low_latency_dispatch(
    x, topk_idx, *, num_experts, num_max_dispatch_tokens_per_rank, use_fp8, round_scale, buffer, mxfp8=False
):
    """Both halves in one kernel."""
    fp8, fn = (use_fp8, round_scale, mxfp8), "low_latency_dispatch"
    pending, attrs = _dispatch_attrs(x, topk_idx, num_experts, num_max_dispatch_tokens_per_rank, fp8, buffer, fn)
    out = _call(DISPATCH, _dispatch_out_types(pending, buffer), (x, topk_idx.astype(jnp.int32)), buffer, **attrs)
    return _dispatch_results(pending, out)


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
    max_topk = limit("low_latency_max_topk")
    if not 1 <= num_topk <= max_topk:
        raise ValueError(f"{fn}: top-k must be in [1, {max_topk}] for the CUDA kernels, got {num_topk}")
    max_tokens = rows // buffer.num_ranks
    needed = _native.extension().low_latency_combine_half_bytes(max_tokens, num_topk, hidden)
    _check_region(buffer, needed, fn, f"M={max_tokens}, top-k={num_topk}")
    _check_send_area(buffer, max_tokens, num_topk, hidden, fn)
    return num_topk


def _num_experts(x, buffer):
    """E of a combine, from x [E/R, R*M, H]: the receive skips top-k ids outside [0, E), as dispatch did."""
    return int(x.shape[0]) * buffer.num_ranks


def _handle_arrays(handle):
    return (handle.recv_count, handle.recv_src_rank, handle.recv_src_token, handle.recv_src_topk)


def low_latency_combine_send(x, topk_idx, topk_weights, handle, *, buffer):
    num_topk = _check_combine(x, topk_idx, buffer, "low_latency_combine_send")
    inputs = (x,) + _handle_arrays(handle)
    overlap_sms = buffer.config.low_latency_overlap_sms
    out = _call(
        _half(COMBINE_SEND, buffer),
        _TOKEN_TYPE,
        inputs,
        buffer,
        num_topk=np.int64(num_topk),
        max_blocks=np.int64(overlap_sms),
    )
    return CombinePending(
        out["token"],
        topk_idx.astype(jnp.int32),
        topk_weights.astype(jnp.float32),
        int(x.shape[2]),
        _num_experts(x, buffer),
        keep_alive=inputs if overlap_sms else (),
    )


def low_latency_combine_recv(pending, *, buffer):
    _check_pending(pending, CombinePending, buffer, "low_latency_combine_recv")
    num_tokens = pending.topk_idx.shape[0]
    out = _call(
        _half(COMBINE_RECV, buffer),
        dict(out=jax.ShapeDtypeStruct((num_tokens, pending.hidden), jnp.bfloat16)),
        (pending.token, pending.topk_idx, pending.topk_weights) + pending.keep_alive,
        buffer,
        num_experts=np.int64(pending.num_experts),
    )
    return out["out"]


def low_latency_combine(x, topk_idx, topk_weights, handle, *, buffer):
    """Both halves in one kernel."""
    _check_combine(x, topk_idx, buffer, "low_latency_combine")
    out = _call(
        COMBINE,
        dict(out=jax.ShapeDtypeStruct((topk_idx.shape[0], x.shape[2]), jnp.bfloat16)),
        (x,) + _handle_arrays(handle) + (topk_idx.astype(jnp.int32), topk_weights.astype(jnp.float32)),
        buffer,
        num_experts=np.int64(_num_experts(x, buffer)),
    )
    return out["out"]


def low_latency_mask(set_to, *, buffer):
    """The Buffer's mask on this rank, int32 [R]; with set_to (int32 [R]) first replaced by it."""
    mask_type = jax.ShapeDtypeStruct((buffer.num_ranks,), jnp.int32)
    args = (jnp.zeros(mask_type.shape, jnp.int32) if set_to is None else set_to,)
    out = MASK(buffer, dict(mask=mask_type), *args, buffer_id=np.int64(buffer.buffer_id), set=set_to is not None)
    return out["mask"]
