"""A dropless MoE layer at bounded memory: dispatch, experts, combine in as
many rounds as the load needs, each receiving at most `capacity` rows per rank.

    y = dropless_moe(x, topk_idx, topk_weights, experts, params, num_experts=E, buffer=buffer)

Rounds take whole blocks of tokens (the same token indices on every rank), so
each token's rows all travel in one round and combine sums them as one call
would: the result equals one dispatch sized for the worst case (T * R rows)
bit for bit, and nothing is ever dropped. Before the rounds, every rank learns
how many rows each block sends to each rank (dispatches of a few rows) and all
cut the blocks into rounds alike, greedily: a round ends before the block that
would overfill some rank (on the xla backend, whose exchanges move fixed
blocks per pair of ranks, or some pair: 1.5 * capacity // R rows). A block
holds capacity // R tokens, so one block always fits. When the load fits (the
common case) there is one round.

The backward pass runs the rounds again (the experts' forward is recomputed
per round, as under remat): memory stays bounded there too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from deep_ep_jax.comm import ordering
from deep_ep_jax.comm import validation as v
from deep_ep_jax.comm.buffer import Buffer
from deep_ep_jax.comm.normal import combine, dispatch_as
from deep_ep_jax.comm.validation import Rows
from deep_ep_jax.comm.varying import vary_over, vma
from deep_ep_jax.config import ROW_FORMATS, is_int

# experts(params, recv_x bf16 [N, H] (or x's pair), recv_topk_idx i32 [N, K], recv_topk_weights f32 [N, K])
#   -> bf16 [N, H]
Experts = Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]


def default_capacity(num_tokens: int, num_topk: int, num_experts: int, num_ranks: int) -> int:
    """Rows per rank per round: 1.25 times the rows a rank receives when every
    token picks num_topk distinct experts uniformly at random, rounded up to 128
    (at least num_ranks, at most the worst case num_tokens * num_ranks)."""
    local = num_experts // num_ranks
    misses = math.prod((num_experts - local - i) / (num_experts - i) for i in range(min(num_topk, num_experts - local)))
    expected = num_tokens * num_ranks * (1 - misses)
    capacity = -(-math.ceil(1.25 * expected) // 128) * 128
    return max(num_ranks, min(capacity, num_tokens * num_ranks))


def dropless_moe(
    x: Rows,
    topk_idx: jax.Array,
    topk_weights: jax.Array,
    experts: Experts,
    params: Any,
    *,
    num_experts: int,
    buffer: Buffer,
    capacity: int | None = None,
    return_rounds: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """One rank's MoE layer with no row dropped and receive buffers of
    `capacity` rows: out[t] = sum over k of topk_weights[t, k] * expert
    topk_idx[t, k] of x[t], as `experts` computes it.

    Per rank, inside `shard_map` over `buffer.axis_name`:
      x: bf16 [T, H], or a quantized pair as `dispatch` takes (FP8, MXFP8,
        NVFP4: config.ROW_FORMATS), which carries no gradient;
      topk_idx: int32 [T, K] global expert ids, -1 for none;
      topk_weights: float32 [T, K].
      experts(params, recv_x, recv_topk_idx, recv_topk_weights): this rank's
        experts on received rows (bf16 [N, H] or x's pair, local ids int32
        [N, K] with -1 for experts elsewhere and on padding rows, float32
        [N, K]); returns bf16 [N, H], each row the weighted sum of its local
        experts' outputs.
        Rows must not depend on each other (padding rows may hold anything;
        their outputs are ignored). It runs once per round.
      params: the experts' parameters (a pytree), differentiated like x and
        topk_weights (reverse mode; topk_idx is not differentiable).
      capacity: rows received per rank per round, in [R, T * R]; default
        `default_capacity(T, K, E, R)`.
      return_rounds: also return the number of rounds (int32 [], the same on
        every rank; more than 1 means the load exceeded `capacity` somewhere).

    A collective over every manual axis of the shard_map, not only the EP
    axis: each device runs the busiest EP group's rounds (a scalar pmax), so
    every device must call it, as any collective.

    Returns bf16 [T, H]: equal bit for bit to dispatch (worst case), experts,
    combine; so are the gradients of x and topk_weights, where `experts` (and
    its gradient) computes each row alike whatever the number of rows (XLA
    may sum a matmul of other shapes in another order: then to rounding).
    The parameters' gradient is summed over rounds in float32: with several
    rounds it may differ from the one-round sum in the last bits. `experts`
    may close over arrays being differentiated (they are hoisted, with
    jax.closure_convert, and get their gradient); passing them as params
    sums their gradient over replicated mesh axes once instead of per round.
    """
    fn = "dropless_moe"
    v.check_buffer(buffer, fn)
    v.check_num_experts(num_experts, buffer, fn)
    xs, num_tokens, hidden = v.check_tokens(x, buffer, fn, formats=ROW_FORMATS)
    v.check_topk(topk_idx, topk_weights, num_tokens, num_experts, fn)
    return_rounds = v.check_bool(fn, "return_rounds", return_rounds)
    if not callable(experts):
        raise TypeError(
            f"{fn}: experts must be a function (params, recv_x, recv_topk_idx, recv_topk_weights) -> "
            f"rows, got {type(experts).__name__}"
        )
    num_ranks = buffer.num_ranks
    worst = num_tokens * num_ranks
    if capacity is None:
        capacity = default_capacity(num_tokens, topk_idx.shape[1], num_experts, num_ranks)
    elif not is_int(capacity) or not num_ranks <= capacity <= worst:
        raise ValueError(
            f"{fn}: capacity must be an int in [ranks = {num_ranks}, tokens * ranks = {worst}] (rows "
            f"received per rank per round), got {capacity!r}"
        )
    capacity = int(capacity)
    topk_idx, _ = v.sanitize_topk_idx(topk_idx, num_experts)
    block = min(num_tokens, capacity // num_ranks)  # a block's rows always fit: block * R <= capacity
    # The reference backend exchanges fixed blocks per (source, destination): its rounds cap each pair
    # too, at half as much again as an even share, so that an uneven pair seldom takes another round.
    pair_rows = min(num_tokens, 3 * capacity // (2 * num_ranks)) if buffer.backend == "xla" else None
    token_round, num_rounds = _rounds(topk_idx, num_experts, buffer, capacity, block, hidden, pair_rows)
    # Every device of the shard_map runs as many rounds (EP groups along other axes load differently):
    # a collective of the experts' or of the backward over other axes then meets its peers each round.
    others = tuple(sorted(set(jax.sharding.get_abstract_mesh().manual_axes) - {buffer.axis_name}))
    if others:
        num_rounds = lax.pmax(num_rounds, others)
    # What the rows vary over (the EP axis and any axis an input does): experts gets its arrays so typed.
    axes = set().union(*(vma(a) for a in (*xs, topk_idx, topk_weights))) | {buffer.axis_name}
    call, consts = _hoisted(experts, params, xs, capacity, topk_idx.shape[1], axes)
    static = _Static(call, buffer, num_experts, capacity, pair_rows, hidden, axes)
    x = xs[0] if len(xs) == 1 else xs
    out = _layer(static, x, topk_weights, params, consts, topk_idx, token_round, num_rounds)
    return (out, num_rounds) if return_rounds else out


def _hoisted(experts, params, xs, capacity, num_topk, axes):
    """(call, consts): call(params, consts, recv_x, recv_topk_idx, recv_topk_weights) runs experts, with
    the arrays it closes over that AD may differentiate (weights captured by a lambda) hoisted out as
    consts (jax.closure_convert), so that they cross the layer's custom_vjp as arguments and get their
    gradient. The converted function is specialised to its arguments' types: call gives it params and
    rows varying over `axes` (and whatever they vary over), as the example here."""
    vary = lambda tree: jax.tree.map(lambda a: vary_over(a, axes), tree)  # noqa: E731
    rows = tuple(jnp.zeros((capacity,) + a.shape[1:], a.dtype) for a in xs)
    pairs = [jnp.zeros((capacity, num_topk), dtype) for dtype in (jnp.int32, jnp.float32)]
    example = vary((params, rows[0] if len(rows) == 1 else rows, *pairs))
    converted, consts = jax.closure_convert(experts, *example)
    if not consts:
        return (lambda params, consts, *rows: experts(params, *rows)), ()
    return (lambda params, consts, *rows: converted(*vary((params, *rows)), *consts)), tuple(consts)


# Rounds ---------------------------------------------------------------------


def _rounds(topk_idx, num_experts, buffer, capacity, block, hidden, pair_rows):
    """(round of each token int32 [T], number of rounds int32 []), the same on every rank: a
    round receives at most `capacity` rows per rank, and with pair_rows at most that many per
    (source, destination)."""
    num_tokens, num_ranks = topk_idx.shape[0], buffer.num_ranks
    num_blocks = -(-num_tokens // block)
    _, _, in_rank = buffer.ops.get_dispatch_layout(topk_idx, num_experts=num_experts, buffer=buffer)  # ids sanitised
    padded = jnp.pad(in_rank.astype(jnp.int32), ((0, num_blocks * block - num_tokens), (0, 0)))
    sent = padded.reshape(num_blocks, block, num_ranks).sum(axis=1)  # [blocks, R]: my rows per block and rank
    if pair_rows is None:
        # Rank j learns what every rank sends it, then every rank learns every rank's load.
        received = _exchange(sent.T, num_experts, buffer, hidden)  # [R(source), blocks]
        loads = _exchange(
            jnp.broadcast_to(received.sum(axis=0), (num_ranks, num_blocks)), num_experts, buffer, hidden
        ).T[:, None]  # [blocks, 1 (every source), R(destination)]
    else:  # every rank learns every pair's rows: [blocks, R(source), R(destination)]
        pairs = _exchange(jnp.broadcast_to(sent.reshape(-1), (num_ranks, sent.size)), num_experts, buffer, hidden)
        loads = pairs.reshape(num_ranks, num_blocks, num_ranks).transpose(1, 0, 2)

    def cut(state, load):  # greedy: a new round when this block would overfill some rank or pair
        current, filled = state
        after = filled + load
        full = jnp.any(after.sum(axis=0) > capacity) | jnp.any(after > (pair_rows or capacity))
        return (current + full, jnp.where(full, load, after)), current + full

    first = vary_over(jnp.zeros((), jnp.int32), vma(loads))
    (last, _), block_round = lax.scan(cut, (first, jnp.zeros_like(loads[0])), loads)
    return jnp.repeat(block_round, block)[:num_tokens], last + 1


def _exchange(rows, num_experts, buffer, hidden):
    """rows int32 [R, n] (row j for rank j, values in [0, 2^31)) -> int32 [R, n]
    (row s from rank s), through dispatch: each value as 4 bf16 digits of 8 bits
    (exact in bf16), rank j's row as the tokens routed to its first expert."""
    num_ranks, n = rows.shape
    digits = (rows[:, :, None] >> jnp.array([24, 16, 8, 0], jnp.int32)) & 255  # [R, n, 4]
    per_rank = -(-4 * n // hidden)  # tokens per destination
    flat = jnp.pad(digits.reshape(num_ranks, -1), ((0, 0), (0, per_rank * hidden - 4 * n)))
    tokens = flat.reshape(num_ranks * per_rank, hidden).astype(jnp.bfloat16)
    first_expert = num_experts // num_ranks * (jnp.arange(num_ranks * per_rank, dtype=jnp.int32) // per_rank)
    recv, _, _, _ = dispatch_as(
        "dropless_moe",
        tokens,
        first_expert[:, None],
        None,
        num_experts,
        buffer,
        num_ranks * per_rank,
        "optional",
        rows_per_pair=per_rank if buffer.backend == "xla" else None,
    )  # exactly that many arrive, by source
    got = recv.astype(jnp.int32).reshape(num_ranks, -1)[:, : 4 * n].reshape(num_ranks, n, 4)
    return (got << jnp.array([24, 16, 8, 0], jnp.int32)).sum(axis=-1)


# The layer and its gradient ---------------------------------------------------------------


class _Static:
    """What the rounds need besides arrays (hashed by identity, as custom_vjp's static argument)."""

    def __init__(self, call, buffer, num_experts, capacity, pair_rows, hidden, axes):
        self.call, self.buffer, self.num_experts, self.capacity = call, buffer, num_experts, capacity
        self.pair_rows, self.hidden, self.axes = pair_rows, hidden, axes

    def round_fn(self, topk_idx, token_round, k):
        """The layer's round k as a function of (x, topk_weights, params, consts): its tokens' outputs,
        zeros elsewhere."""
        mine = token_round == k
        idx = jnp.where(mine[:, None], topk_idx, -1)

        def run(x, topk_weights, params, consts):
            recv_x, recv_idx, recv_w, handle = dispatch_as(
                "dropless_moe", x, idx, topk_weights, self.num_experts, self.buffer, self.capacity,
                rows_per_pair=self.pair_rows,
            )  # fmt: skip
            rows = self.call(params, consts, recv_x, recv_idx, recv_w)
            want = (self.capacity, self.hidden)
            if not (isinstance(rows, jax.Array) and rows.dtype == jnp.bfloat16 and rows.shape == want):
                got = f"{rows.dtype} {rows.shape}" if isinstance(rows, jax.Array) else type(rows).__name__
                raise TypeError(
                    f"dropless_moe: experts must return bfloat16 {list(want)} (a row per received row: the "
                    f"capacity's, hidden), got {got}"
                )
            out = combine(rows, handle, buffer=self.buffer)
            return jnp.where(mine[:, None], out, jnp.zeros_like(out))

        return run

    def loop(self, num_rounds, body, init):
        """init after body(k, carry) for k in [0, num_rounds), the Buffer's order chain
        carried through (calls of the rounds run in round order, before what follows)."""

        def step(k, carry):
            state, value = carry
            ordering.put(self.buffer, state)
            value = body(k, value)
            return ordering.take(self.buffer), value

        state, out = lax.fori_loop(0, num_rounds, step, (ordering.take(self.buffer), init))
        ordering.put(self.buffer, state)
        return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _layer(static, x, topk_weights, params, consts, topk_idx, token_round, num_rounds):
    return _forward(static, x, topk_weights, params, consts, topk_idx, token_round, num_rounds)


def _zeros_like(a, dtype=None, axes=()):
    """Zeros of a's shape (and dtype), varying over a's mesh axes and `axes` (a loop's carry keeps its type)."""
    return vary_over(jnp.zeros(a.shape, dtype or a.dtype), vma(a) | set(axes))


def _forward(static, x, topk_weights, params, consts, topk_idx, token_round, num_rounds):
    def body(k, out):
        round_out = static.round_fn(topk_idx, token_round, k)(x, topk_weights, params, consts)
        return out + vary_over(round_out, vma(out))

    # The rounds' outputs, bf16 [T, H], vary over the EP axis and every axis an input varies over.
    axes = set().union(*(vma(a) for a in jax.tree.leaves((x, topk_weights, params, consts, topk_idx))))
    out = jnp.zeros((topk_idx.shape[0], static.hidden), jnp.bfloat16)
    return static.loop(num_rounds, body, vary_over(out, axes | {static.buffer.axis_name}))


def _layer_fwd(static, x, topk_weights, params, consts, topk_idx, token_round, num_rounds):
    out = _forward(static, x, topk_weights, params, consts, topk_idx, token_round, num_rounds)
    return out, (x, topk_weights, params, consts, topk_idx, token_round, num_rounds)


def _layer_bwd(static, residuals, g):
    x, topk_weights, params, consts, topk_idx, token_round, num_rounds = residuals
    quantized = isinstance(x, tuple)  # a pair's rows carry no gradient (as dispatch's)
    wide = lambda p: jnp.promote_types(p.dtype, jnp.float32)  # noqa: E731  (parameter gradients summed in float32)
    # The rounds differentiate float32 copies of the parameters that vary as the rows do: the sum over
    # the axes the parameters do not vary over (a psum, the transpose of that cast) runs once, after
    # the rounds. (Arrays hoisted from experts' closure keep their types: theirs runs per round.)
    wide_params, to_params = jax.vjp(
        lambda p: jax.tree.map(lambda a: vary_over(a.astype(wide(a)), static.axes), p), params
    )
    params = jax.tree.map(lambda a, p: a.astype(p.dtype), wide_params, params)

    def body(k, grads):
        run = static.round_fn(topk_idx, token_round, k)
        if quantized:
            _, vjp = jax.vjp(lambda w, p, c: run(x, w, p, c), topk_weights, params, consts)
            dx, (dw, dparams, dconsts) = grads[0], vjp(g)
        else:
            _, vjp = jax.vjp(run, x, topk_weights, params, consts)
            dx, dw, dparams, dconsts = vjp(g)
            dx = grads[0] + dx
        # Each token's gradients come from its one round (zeros elsewhere): their sums are exact.
        add = lambda a, b: a + b.astype(a.dtype)  # noqa: E731
        return (dx, grads[1] + dw, jax.tree.map(add, grads[2], dparams), jax.tree.map(add, grads[3], dconsts))

    dx = () if quantized else _zeros_like(x)
    sums = [jax.tree.map(_zeros_like, wide_params), tuple(_zeros_like(c, wide(c)) for c in consts)]
    dx, dw, dparams, dconsts = static.loop(num_rounds, body, (dx, _zeros_like(topk_weights), *sums))
    if quantized:  # integer rows (packed NVFP4) have no cotangent space: None stands for their zero
        dx = tuple(_zeros_like(a) if jnp.issubdtype(a.dtype, jnp.floating) else None for a in x)
    (dparams,) = to_params(dparams)
    dconsts = tuple(d.astype(c.dtype) for d, c in zip(dconsts, consts))
    return dx, dw, dparams, dconsts, None, None, None


_layer.defvjp(_layer_fwd, _layer_bwd)
