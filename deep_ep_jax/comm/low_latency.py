"""Low-latency mode (decode): static shapes, one row per (token, expert).

Each operation comes whole and as a send half and a receive half, so other
work (attention, shared experts) can run between them while the rows are in
flight (DeepEP's `return_recv_hook`); `low_latency_overlap` places it there.
On the CUDA backend a whole operation is one kernel, a half one kernel each.
Not differentiable (decode only): taking a gradient through one raises, on
every backend.

The CUDA kernels double-buffer, as DeepEP does: at most two low-latency
operations of a buffer may be in flight, i.e. the send of an operation must
come after the receive of the operation two before it. XLA orders calls only
by data, so let each send depend on an earlier receive's output (as a decode
step does: the next layer's dispatch uses this layer's combine). A program
that breaks the rule fails after the timeout with a message naming the flag
it waited for; it never corrupts data.

A rank that fails (its process dies, or it stops calling) makes the others'
waits for it time out. With `Config(mask_failed_ranks=True)` the CUDA kernels
then mask it instead of failing: from then on they neither send to nor wait
for it, its experts contribute nothing (as an expert id of -1 would), and
every other (token, expert) pair stays exact. `low_latency_mask` reads the
mask inside a program, `low_latency_set_mask` sets or clears it, and
`drop_masked_experts` re-routes around it (docs/usage.md, "When a rank fails").
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from deep_ep_jax.comm import validation as v
from deep_ep_jax.comm.buffer import Buffer
from deep_ep_jax.comm.handle import LowLatencyHandle
from deep_ep_jax.comm.validation import Pending, Rows
from deep_ep_jax.config import FP8_BLOCK, is_int


def _check_mode(buffer, fn):
    v.check_buffer(buffer, fn)
    if not buffer.low_latency_mode:
        raise ValueError(f"{fn}: the buffer was made without low_latency_mode=True")


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _not_differentiable(fn, x):
    """x, refusing a gradient (JVP) through it with a message naming fn: the
    kernels have no backward, and the xla backend must not differ."""
    return x


@_not_differentiable.defjvp
def _refuse_gradient(fn, primals, tangents):
    raise TypeError(
        f"{fn}: low-latency mode is not differentiable (decode only); train with dispatch and combine, "
        f"or apply jax.lax.stop_gradient to its inputs"
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Pending:
    """A send half's result: the backend's in-flight value, and which send of
    which Buffer made it, so that a receive of another kind or Buffer is
    refused at trace time (on the kernels it would wait until the timeout)."""

    value: Any
    send: str = dataclasses.field(metadata=dict(static=True))
    buffer_key: int = dataclasses.field(metadata=dict(static=True))
    topk_idx: jax.Array | None = None  # a dispatch's (sanitised), for its handle


def _receive(pending, buffer, fn):
    """`pending` (a _Pending), after checking that fn (a _recv) may take it from its buffer."""
    _check_mode(buffer, fn)
    send = fn.replace("_recv", "_send")
    if not isinstance(pending, _Pending):
        raise TypeError(f"{fn}: pending must be what {send} returned, got {type(pending).__name__}")
    if pending.send != send:
        raise TypeError(f"{fn}: pending must be what {send} returned, got {pending.send}'s")
    if pending.buffer_key != buffer.key:
        raise ValueError(f"{fn}: pending comes from a send on another Buffer; receive with the Buffer that sent")
    return pending


def _dispatch_arguments(x, topk_idx, buffer, max_tokens, num_experts, use_fp8, round_scale, mxfp8, fn):
    """Validates a dispatch; returns the backend's arguments (topk_idx sanitised)."""
    _check_mode(buffer, fn)
    v.check_num_experts(num_experts, buffer, fn)
    _, num_tokens, hidden = v.check_tokens(x, buffer, fn, allow_fp8=False)
    v.check_topk(topk_idx, None, num_tokens, num_experts, fn, weights="none")
    use_fp8, round_scale = v.check_bool(fn, "use_fp8", use_fp8), v.check_bool(fn, "round_scale", round_scale)
    if v.check_bool(fn, "mxfp8", mxfp8) and not use_fp8:
        raise ValueError(f"{fn}: mxfp8=True quantizes to FP8: it needs use_fp8=True")
    if round_scale and not use_fp8:
        raise ValueError(f"{fn}: round_scale=True rounds FP8 scales: it needs use_fp8=True")
    if not is_int(max_tokens) or max_tokens <= 0:
        raise ValueError(f"{fn}: num_max_dispatch_tokens_per_rank must be a positive int, got {max_tokens!r}")
    if buffer.num_max_dispatch_tokens_per_rank is not None and max_tokens > buffer.num_max_dispatch_tokens_per_rank:
        raise ValueError(
            f"{fn}: num_max_dispatch_tokens_per_rank={max_tokens} exceeds the buffer's "
            f"{buffer.num_max_dispatch_tokens_per_rank}"
        )
    if num_tokens > max_tokens:
        raise ValueError(f"{fn}: x has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank={max_tokens}")
    if use_fp8 and hidden % FP8_BLOCK:
        raise ValueError(f"{fn}: use_fp8 needs hidden to be a multiple of {FP8_BLOCK}, got {hidden}")
    topk_idx, bad_ids = v.sanitize_topk_idx(topk_idx, num_experts)
    if buffer.config.checks:
        capacity = buffer.num_ranks * max_tokens
        topk_idx = v.raise_if_any(
            buffer,
            [
                (bad_ids, f"{fn}: topk_idx holds expert ids outside [-1, {num_experts})"),
                (
                    _rows_per_expert(topk_idx, num_experts, buffer).max() > capacity,
                    f"{fn}: more than {capacity} rows (ranks x num_max_dispatch_tokens_per_rank) for one expert, "
                    f"the rest dropped: a token lists an expert twice",
                ),
            ],
            topk_idx,
        )
    return (_not_differentiable(fn, x), topk_idx), dict(
        num_experts=num_experts,
        num_max_dispatch_tokens_per_rank=int(max_tokens),
        use_fp8=use_fp8,
        round_scale=round_scale,
        mxfp8=bool(mxfp8),
        buffer=buffer,
    )


def _rows_per_expert(topk_idx, num_experts, buffer):
    """int32 [E]: the rows a dispatch of `topk_idx` (sanitised) sends to each expert, over all ranks."""
    ids = jnp.where(topk_idx >= 0, topk_idx, num_experts).reshape(-1)
    return lax.psum(jnp.zeros(num_experts, jnp.int32).at[ids].add(1, mode="drop"), buffer.axis_name)


def _dispatch_results(topk_idx, buffer, recv_xs, recv_count, handle):
    """The public results of a dispatch of `topk_idx` (sanitised) on `buffer`, its handle holding both for
    combine's checks."""
    handle = dataclasses.replace(handle, topk_idx=topk_idx, buffer_key=buffer.key)
    return (recv_xs[0] if len(recv_xs) == 1 else recv_xs), recv_count, handle


def low_latency_dispatch_send(
    x: jax.Array,
    topk_idx: jax.Array,
    *,
    buffer: Buffer,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
    use_fp8: bool = True,
    round_scale: bool = False,
    mxfp8: bool = False,
) -> Pending:
    """Send half of `low_latency_dispatch`; returns a pending value for
    `low_latency_dispatch_recv`."""
    fn = "low_latency_dispatch_send"
    args, kwargs = _dispatch_arguments(
        x, topk_idx, buffer, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, mxfp8, fn
    )
    return _Pending(buffer.ops.low_latency_dispatch_send(*args, **kwargs), fn, buffer.key, topk_idx=args[1])


def low_latency_dispatch_recv(pending: Pending, *, buffer: Buffer) -> tuple[Rows, jax.Array, LowLatencyHandle]:
    """Receive half: returns (recv_x, recv_count, handle)."""
    pending = _receive(pending, buffer, "low_latency_dispatch_recv")
    recv = buffer.ops.low_latency_dispatch_recv(pending.value, buffer=buffer)
    return _dispatch_results(pending.topk_idx, buffer, *recv)


def low_latency_dispatch(
    x: jax.Array,
    topk_idx: jax.Array,
    *,
    buffer: Buffer,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
    use_fp8: bool = True,
    round_scale: bool = False,
    mxfp8: bool = False,
) -> tuple[Rows, jax.Array, LowLatencyHandle]:
    """Per rank: x bf16 [T, H] (T <= M), topk_idx int32 [T, K].

    Returns (recv_x, recv_count, handle): recv_x bf16 [E/R, R*M, H], or with
    use_fp8 an FP8 pair (float8_e4m3fn [E/R, R*M, H], float32 scales
    [E/R, R*M, H // 128]; round_scale: each scale rounded up to a power of
    two), or with mxfp8 too an MXFP8 pair (float8_e4m3fn [E/R, R*M, H],
    float8_e8m0fnu scales [E/R, R*M, H // 32], powers of two rounded up); the
    first recv_count[e] rows of local expert e are valid, ordered by source rank then source token. A local expert can
    receive at most R*M rows; more (only possible when a token lists the same
    expert twice) are dropped, and combining such a dispatch is undefined
    (`Config(checks=True)` raises a CheckError on that).
    The same as `low_latency_dispatch_send` then `_recv`, in one kernel.
    """
    args, kwargs = _dispatch_arguments(
        x,
        topk_idx,
        buffer,
        num_max_dispatch_tokens_per_rank,
        num_experts,
        use_fp8,
        round_scale,
        mxfp8,
        "low_latency_dispatch",
    )
    return _dispatch_results(args[1], buffer, *buffer.ops.low_latency_dispatch(*args, **kwargs))


def _combine_arguments(x, topk_idx, topk_weights, handle, buffer, fn):
    """Validates a combine; returns the backend's arguments (topk_idx sanitised)."""
    _check_mode(buffer, fn)
    if not isinstance(handle, LowLatencyHandle):
        raise TypeError(
            f"{fn}: handle must be the LowLatencyHandle from low_latency_dispatch, got {type(handle).__name__}"
        )
    if handle.buffer_key is not None and handle.buffer_key != buffer.key:
        raise ValueError(f"{fn}: handle comes from a dispatch on another Buffer; combine on the Buffer that dispatched")
    rows = tuple(handle.recv_src_rank.shape)
    if isinstance(x, (tuple, list)):
        raise TypeError(
            f"{fn}: x must be the experts' bfloat16 outputs [{rows[0]}, {rows[1]}, hidden], got a "
            f"{type(x).__name__} (an FP8 dispatch's rows? dequantize them first)"
        )
    shape, dtype = v.shape_dtype(x, fn, "x")
    if dtype != jnp.bfloat16:
        raise TypeError(f"{fn}: x must be bfloat16, got {dtype}")
    if len(shape) != 3 or shape[:2] != rows:
        raise ValueError(f"{fn}: x must be [{rows[0]}, {rows[1]}, hidden] (the dispatch's rows), got {shape}")
    if buffer.hidden is not None and shape[2] != buffer.hidden:
        raise ValueError(f"{fn}: x has hidden {shape[2]} but the buffer was made for hidden {buffer.hidden}")
    num_experts = rows[0] * buffer.num_ranks
    v.check_topk(topk_idx, topk_weights, None, num_experts, fn)
    dispatched = (handle.num_tokens, handle.num_topk)
    if tuple(topk_idx.shape) != dispatched:
        raise ValueError(
            f"{fn}: topk_idx must be the dispatch's, {list(dispatched)}, got {list(topk_idx.shape)} "
            f"(each row returns to the (token, k) slot it was dispatched from)"
        )
    topk_idx, _ = v.sanitize_topk_idx(topk_idx, num_experts)  # checked at dispatch
    if buffer.config.checks and handle.topk_idx is not None:
        topk_idx = v.raise_if_any(
            buffer,
            [
                (
                    (topk_idx != handle.topk_idx).any(),
                    f"{fn}: topk_idx is not the dispatch's (each (token, k) must name the expert it "
                    f"was dispatched to, or -1 where it was -1)",
                )
            ],
            topk_idx,
        )
    return _not_differentiable(fn, x), topk_idx, _not_differentiable(fn, topk_weights), handle


def low_latency_combine_send(
    x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, handle: LowLatencyHandle, *, buffer: Buffer
) -> Pending:
    """Send half of `low_latency_combine`; returns a pending value for
    `low_latency_combine_recv`."""
    fn = "low_latency_combine_send"
    args = _combine_arguments(x, topk_idx, topk_weights, handle, buffer, fn)
    return _Pending(buffer.ops.low_latency_combine_send(*args, buffer=buffer), fn, buffer.key)


def low_latency_combine_recv(pending: Pending, *, buffer: Buffer) -> jax.Array:
    """Receive half: returns bf16 [T, H]."""
    pending = _receive(pending, buffer, "low_latency_combine_recv")
    return buffer.ops.low_latency_combine_recv(pending.value, buffer=buffer)


def low_latency_combine(
    x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, handle: LowLatencyHandle, *, buffer: Buffer
) -> jax.Array:
    """Per rank: x bf16 [E/R, R*M, H] expert outputs in the dispatch's rows.
    Returns bf16 [T, H]: out[t] = sum over k of topk_weights[t, k] * the
    output of expert topk_idx[t, k] for token t, reduced in float32 in k
    order (k with topk_idx -1 skipped). topk_idx must be the dispatch's, values
    as well as shape: the handle locates each (t, k)'s row only for the pairs
    that dispatch sent, so another expert id there reads another token's row
    (`Config(checks=True)` raises a CheckError on that).
    The same as `low_latency_combine_send` then `_recv`, in one kernel."""
    args = _combine_arguments(x, topk_idx, topk_weights, handle, buffer, "low_latency_combine")
    return buffer.ops.low_latency_combine(*args, buffer=buffer)


def low_latency_overlap(pending: Pending, fn: Callable[..., Any], *args: Any) -> tuple[Pending, Any]:
    """Runs fn(*args) between the send that returned `pending` and its
    receive; returns (pending for the receive, fn's result).

    XLA orders work by data only, so compute written between a send and its
    receive may be scheduled before the send or after the receive. This ties
    fn's inputs to the send's result and the receive's input to fn's result
    (optimization barriers, no copies). With the CUDA backend and
    `Config.low_latency_overlap_sms` > 0, fn then runs while the send's rows
    travel; with the default 0 the send ends before fn starts.
    """
    pending, args = lax.optimization_barrier((pending, args))
    out = fn(*args)
    return lax.optimization_barrier((pending, out))


def low_latency_mask(*, buffer: Buffer) -> jax.Array:
    """Per rank: int32 [R], 1 for each rank this rank has masked (neither sends
    to nor waits for; `Config.mask_failed_ranks` masks a rank that does not
    answer within the timeout), 0 for the others. A rank masked in its own
    entry sends to and waits for no one. Ordered with the Buffer's other calls;
    no rank waits for another. The xla backend never masks a rank (zeros)."""
    _check_mode(buffer, "low_latency_mask")
    return buffer.ops.low_latency_mask(None, buffer=buffer)


def low_latency_set_mask(mask: jax.Array, *, buffer: Buffer) -> jax.Array:
    """Per rank: replaces the Buffer's mask with `mask` (bool or int [R], nonzero
    = masked) and returns it as int32 [R]: to take a rank out on purpose, or,
    with zeros, to take every rank back (DeepEP's clean_mask_buffer). Every
    live rank must make the call at the same point of its sequence of
    low-latency operations, with the same mask. A rank taken back must have
    made every operation meanwhile (a rank that was out for maintenance): a
    process that died cannot rejoin this Buffer; make a new Buffer on every
    rank instead. CUDA backend only."""
    fn = "low_latency_set_mask"
    _check_mode(buffer, fn)
    shape, dtype = v.shape_dtype(mask, fn, "mask")
    if shape != (buffer.num_ranks,):
        raise ValueError(f"{fn}: mask must be [{buffer.num_ranks}] (one entry per rank), got {list(shape)}")
    _check_mask_dtype(fn, dtype)
    return buffer.ops.low_latency_mask((jnp.asarray(mask) != 0).astype(jnp.int32), buffer=buffer)


def _check_mask_dtype(fn, dtype):
    if not (jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_):
        raise TypeError(f"{fn}: mask must be bool or an integer type, got {dtype}")


def drop_masked_experts(topk_idx: jax.Array, mask: jax.Array, *, num_experts: int) -> jax.Array:
    """topk_idx with -1 for every expert of a masked rank (mask: [R] flags,
    nonzero for a masked rank, as `low_latency_mask` returns; not a list of
    rank ids; R dividing num_experts): what the kernels of a rank that is not
    masked itself do with those pairs once the rank is masked, for a serving
    loop to see (or to re-route them to replicas first)."""
    fn = "drop_masked_experts"
    shape, dtype = v.shape_dtype(mask, fn, "mask")
    if not is_int(num_experts) or num_experts <= 0:
        raise ValueError(f"{fn}: num_experts must be a positive int, got {num_experts!r}")
    if len(shape) != 1 or not shape[0] or num_experts % shape[0]:
        raise ValueError(
            f"{fn}: mask must be [R] (one flag per rank) with R dividing num_experts, got mask {list(shape)} and "
            f"num_experts={num_experts}"
        )
    _check_mask_dtype(fn, dtype)
    _, idx_dtype = v.shape_dtype(topk_idx, fn, "topk_idx")
    if idx_dtype != jnp.int32:
        raise TypeError(f"{fn}: topk_idx must be int32, got {idx_dtype}")
    owner = jnp.clip(topk_idx, 0, num_experts - 1) // (num_experts // shape[0])
    expert = (topk_idx >= 0) & (topk_idx < num_experts)  # other ids mean no expert: left as they are
    return jnp.where(expert & (jnp.asarray(mask)[owner] != 0), -1, topk_idx).astype(topk_idx.dtype)
