"""Normal mode (training, prefill): layout, dispatch, combine, and gradients.

The wrapper owns shapes, validation and gradients; the backend only moves
data. Gradients follow docs/design.md: the backward of dispatch is a combine of
the gradients, the backward of combine is a dispatch along the handle's
layout (no count exchange). Both are shared by every backend.
"""

from __future__ import annotations

import functools
from typing import overload

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from deep_ep_jax.comm import ordering
from deep_ep_jax.comm import validation as v
from deep_ep_jax.comm.buffer import Buffer
from deep_ep_jax.comm.handle import DispatchHandle
from deep_ep_jax.comm.quantize import pack_float4, unpack_float4
from deep_ep_jax.comm.validation import Rows
from deep_ep_jax.comm.varying import zero_rows_like
from deep_ep_jax.config import ROW_FORMATS, is_int, row_bytes, row_format

# The names of dispatch's and combine's results for jax.checkpoint policies.
DISPATCH_NAME, COMBINE_NAME = "deep_ep_jax.dispatch", "deep_ep_jax.combine"
CHECKPOINT_NAMES = (DISPATCH_NAME, COMBINE_NAME)


def get_dispatch_layout(
    topk_idx: jax.Array, *, num_experts: int, buffer: Buffer
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per rank: (num_tokens_per_rank int32 [R], num_tokens_per_expert int32
    [E], is_token_in_rank bool [T, R]) for `topk_idx` int32 [T, K]."""
    fn = "get_dispatch_layout"
    v.check_buffer(buffer, fn)
    v.check_num_experts(num_experts, buffer, fn)
    v.check_topk(topk_idx, None, None, num_experts, fn, weights="none")
    topk_idx, bad_ids = v.sanitize_topk_idx(topk_idx, num_experts)
    layout = buffer.ops.get_dispatch_layout(topk_idx, num_experts=num_experts, buffer=buffer)
    if buffer.config.checks:
        layout = v.raise_if_any(buffer, [(bad_ids, _bad_ids_message(fn, num_experts))], layout)
    return layout


def dispatch(
    x: Rows,
    topk_idx: jax.Array,
    topk_weights: jax.Array | None,
    *,
    num_experts: int,
    buffer: Buffer,
    num_worst_tokens: int | None = None,
) -> tuple[Rows, jax.Array, jax.Array | None, DispatchHandle]:
    """Sends each token once to every rank owning one of its experts.

    Per rank, inside `shard_map` over `buffer.axis_name`:
      x: bf16 [T, H], or a quantized pair (data, scales) of `config.ROW_FORMATS`: DeepEP's FP8
        (float8_e4m3fn [T, H], float32 [T, H // 128]), MXFP8 (float8_e4m3fn [T, H],
        float8_e8m0fnu [T, H // 32]), NVFP4 (float4_e2m1fn [T, H], or packed as uint8 [T, H // 2];
        float8_e4m3fn [T, H // 16]); H a multiple of 128. A pair's bytes arrive as they are.
      topk_idx: int32 [T, K] global expert ids, -1 for none.
      topk_weights: float32 [T, K], or None (recv_topk_weights is then None).
      num_worst_tokens: rows N of the outputs (default T * R, the worst case).

    Returns (recv_x [N, H] (or the pair, in x's dtypes), recv_topk_idx int32 [N, K] local ids,
    recv_topk_weights float32 [N, K], handle). Rows [0, handle.num_recv_tokens)
    are valid, ordered by source rank then source token; if more rows arrive
    than N, the last ones are dropped and counted in handle.num_dropped_tokens.
    """
    return dispatch_as("dispatch", x, topk_idx, topk_weights, num_experts, buffer, num_worst_tokens, "optional")


def dispatch_as(
    fn: str,
    x,
    topk_idx,
    topk_weights,
    num_experts,
    buffer,
    num_worst_tokens,
    weights="required",
    formats=ROW_FORMATS,
    rows_per_pair=None,
):
    """`dispatch`, its errors and run-time checks naming `fn` (the function the
    user called); weights: whether fn takes topk_weights=None (v.check_topk);
    formats: the quantized pairs fn takes (config.ROW_FORMATS); rows_per_pair:
    the reference backend's (backends/__init__.py), from dropless_moe."""
    v.check_buffer(buffer, fn)
    v.check_num_experts(num_experts, buffer, fn)
    xs, num_tokens, _ = v.check_tokens(x, buffer, fn, formats=formats)
    v.check_topk(topk_idx, topk_weights, num_tokens, num_experts, fn, weights=weights)
    worst = num_tokens * buffer.num_ranks
    if num_worst_tokens is None:
        _check_budget(fn, xs, topk_idx, worst, buffer)
        num_worst_tokens = worst
    elif not is_int(num_worst_tokens) or not 1 <= num_worst_tokens <= worst:
        raise ValueError(
            f"{fn}: num_worst_tokens must be an int in [1, tokens * ranks = {worst}] (None means {worst}), "
            f"got {num_worst_tokens!r}"
        )
    topk_idx, bad_ids = v.sanitize_topk_idx(topk_idx, num_experts)
    outputs, order = _dispatch(
        _to_wire(xs),
        topk_weights,
        topk_idx,
        ordering.take(buffer),
        num_experts,
        int(num_worst_tokens),
        rows_per_pair,
        buffer,
    )
    # Named, so that a remat policy can keep them (a backward pass then exchanges nothing again):
    # jax.checkpoint_policies.save_only_these_names(*deep_ep_jax.CHECKPOINT_NAMES).
    recv_xs, recv_idx, recv_w, handle = checkpoint_name(outputs, DISPATCH_NAME)
    ordering.put(buffer, order)
    if buffer.config.checks:
        overflow = f"{fn}: more rows arrived than num_worst_tokens={num_worst_tokens}; the excess was dropped"
        failures = [(bad_ids, _bad_ids_message(fn, num_experts)), (handle.num_dropped_tokens > 0, overflow)]
        recv_xs, recv_idx, recv_w, handle = v.raise_if_any(buffer, failures, (recv_xs, recv_idx, recv_w, handle))
    recv_xs = _from_wire(recv_xs, xs)
    return (recv_xs[0] if len(recv_xs) == 1 else recv_xs), recv_idx, recv_w, handle


def _check_budget(fn, xs, topk_idx, num_rows, buffer):
    """Results sized for the worst case (num_rows = T x R rows) within Config.dispatch_budget_gib."""
    need = num_rows * (row_bytes(xs) + 8 * topk_idx.shape[1] + 4)  # rows, local ids, weights, source index
    check_budget(
        fn,
        need,
        f"{num_rows} rows: every token of the {buffer.num_ranks} ranks",
        "Use dropless_moe (buffers sized to the load, no row dropped), or pass num_worst_tokens= (rows past it are "
        "dropped and counted; Config(checks=True) raises on them)",
        buffer,
    )


def check_budget(fn, need, sized, ways_out, buffer):
    """need bytes of results sized for the worst case (`sized` says how) within Config.dispatch_budget_gib,
    else an error naming the ways out."""
    budget = buffer.config.dispatch_budget_gib
    if need > budget * 2**30:
        raise ValueError(
            f"{fn}: sized for the worst case ({sized}), its results take {need / 2**30:.3g} GiB per GPU, over "
            f"Config.dispatch_budget_gib={budget:.3g}. {ways_out}, or raise the budget "
            f"(Config(dispatch_budget_gib=...) / DEEP_EP_JAX_DISPATCH_BUDGET_GIB; inf for none)"
        )


def _to_wire(xs):
    """Rows as the backends move them: NVFP4's float4 data as its packed bytes (uint8 [T, H // 2])."""
    return (pack_float4(xs[0]), *xs[1:]) if xs[0].dtype == jnp.float4_e2m1fn else xs


def _from_wire(recv_xs, xs):
    """The received rows in the dtypes the caller sent (`_to_wire`'s inverse)."""
    return recv_xs if recv_xs[0].dtype == xs[0].dtype else (unpack_float4(recv_xs[0]), *recv_xs[1:])


@overload
def combine(x: jax.Array, handle: DispatchHandle, topk_weights: None = None, *, buffer: Buffer) -> jax.Array: ...


@overload
def combine(
    x: jax.Array, handle: DispatchHandle, topk_weights: jax.Array, *, buffer: Buffer
) -> tuple[jax.Array, jax.Array]: ...


def combine(
    x: jax.Array, handle: DispatchHandle, topk_weights: jax.Array | None = None, *, buffer: Buffer
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Inverse of dispatch: out[t] = sum over the ranks that received token t
    of their row for it, in float32 in rank order, as bf16 [T, H].

    x: bf16 [N, H] (rows as dispatch returned them; weight expert outputs
    before combining). With topk_weights float32 [N, K], also returns their
    sum back at [T, K].
    """
    fn = "combine"
    v.check_buffer(buffer, fn)
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"{fn}: handle must be the DispatchHandle that dispatch returned, got {type(handle).__name__}")
    (x,), num_rows, _ = v.check_tokens(x, buffer, fn, allow_fp8=False)
    if num_rows != handle.num_worst_tokens:
        raise ValueError(f"{fn}: x must have the handle's {handle.num_worst_tokens} rows, got {num_rows}")
    if topk_weights is not None:
        shape, dtype = v.shape_dtype(topk_weights, fn, "topk_weights")
        if dtype != jnp.float32 or len(shape) != 2 or shape[0] != num_rows:
            raise TypeError(f"{fn}: topk_weights must be float32 [{num_rows}, topk], got {dtype} {shape}")
    (out, out_w), order = _combine(x, topk_weights, handle, ordering.take(buffer), buffer)
    out, out_w = checkpoint_name((out, out_w), COMBINE_NAME)
    ordering.put(buffer, order)
    return out if topk_weights is None else (out, out_w)


def _bad_ids_message(fn, num_experts):
    return f"{fn}: topk_idx holds expert ids outside [-1, {num_experts})"


# Gradients -----------------------------------------------------------------
#
# The custom_vjp functions take the Buffer's order state and return the next
# one (deep_ep_jax.comm.ordering): their bodies may be traced apart from the
# caller, and the chain of calls must run through them. The backward rules
# run in the caller's trace and take the state there.


def _ordered(buffer, order, op):
    """op()'s results and the Buffer's order state after it, op's calls chained after `order`."""
    ordering.put(buffer, order)
    return op(), ordering.take(buffer)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _dispatch(xs, topk_weights, topk_idx, order, num_experts, num_worst_tokens, rows_per_pair, buffer):
    pairs = {} if rows_per_pair is None else {"rows_per_pair": rows_per_pair}  # the reference backend's only
    return _ordered(
        buffer,
        order,
        lambda: buffer.ops.dispatch(
            xs,
            topk_idx,
            topk_weights,
            num_experts=num_experts,
            num_worst_tokens=num_worst_tokens,
            buffer=buffer,
            **pairs,
        ),
    )


def _dispatch_fwd(xs, topk_weights, topk_idx, order, num_experts, num_worst_tokens, rows_per_pair, buffer):
    out = _dispatch(xs, topk_weights, topk_idx, order, num_experts, num_worst_tokens, rows_per_pair, buffer)
    (_, recv_idx, _, handle), _ = out
    # xs' types (x[:0]), for FP8 rows' zero gradients. Named as the results: a policy that keeps those keeps these.
    return out, checkpoint_name((handle, recv_idx, tuple(x[:0] for x in xs)), DISPATCH_NAME)


def dispatch_backward(g_recv_x, g_recv_w, recv_idx, handle, buffer):
    """dispatch's gradients (x's bf16 [T, H], topk_weights' float32 [T, K]) from its received rows'
    (bf16 [N, H]) and weights': a combine of both."""
    # Weights of experts on other ranks arrive as constant zeros (None: dispatched without weights).
    if g_recv_w is not None:
        g_recv_w = jnp.where(recv_idx >= 0, g_recv_w, 0.0)
    return buffer.ops.combine(g_recv_x, g_recv_w, handle, buffer=buffer)


def _dispatch_bwd(num_experts, num_worst_tokens, rows_per_pair, buffer, residuals, cotangents):
    handle, recv_idx, xs_like = residuals
    (g_recv_xs, _, g_recv_w, _), _ = cotangents
    if len(g_recv_xs) == 1:
        g_x, g_w = dispatch_backward(g_recv_xs[0], g_recv_w, recv_idx, handle, buffer)
        g_xs = (g_x,)
    else:  # quantized rows carry no gradient; the weights still do.
        data, scales = xs_like
        hidden = data.shape[1] * row_format(data.dtype, scales.dtype).pack
        rows = jnp.zeros((num_worst_tokens, hidden), jnp.bfloat16)
        _, g_w = dispatch_backward(rows, g_recv_w, recv_idx, handle, buffer)
        num_tokens = handle.is_token_in_rank.shape[0]  # the inputs' rows, [T, ...]
        # Integer rows (packed NVFP4) have no cotangent space: None stands for their zero.
        g_xs = tuple(zero_rows_like(num_tokens, x) if jnp.issubdtype(x.dtype, jnp.floating) else None for x in xs_like)
    return g_xs, g_w, None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _combine(x, topk_weights, handle, order, buffer):
    return _ordered(buffer, order, lambda: buffer.ops.combine(x, topk_weights, handle, buffer=buffer))


def _combine_fwd(x, topk_weights, handle, order, buffer):
    return _combine(x, topk_weights, handle, order, buffer), handle


def _combine_bwd(buffer, handle, cotangents):
    (g_out, g_out_w), _ = cotangents
    (g_x,), g_w = buffer.ops.cached_dispatch((g_out,), g_out_w, handle, buffer=buffer)
    # Padding rows did not contribute to the output.
    valid = handle.recv_src_idx >= 0
    g_x = jnp.where(valid[:, None], g_x, jnp.zeros((), g_x.dtype))
    if g_w is not None:
        g_w = jnp.where(valid[:, None], g_w, 0.0)
    return g_x, g_w, jax.tree.map(lambda _: None, handle), None


_combine.defvjp(_combine_fwd, _combine_bwd)
