"""Expert-major rows in pure JAX: the oracle partner of the CUDA targets
(deep_ep_jax/backends/cuda/expert_major.py) and the path on every other
platform. The contract is docs/design.md, "Expert-major rows".

Local, per rank: no communication. The public wrapper
(deep_ep_jax/comm/expert_major.py) validates and owns the gradients; these
functions take clean arguments (local ids outside [0, L) already -1).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from deep_ep_jax.comm.handle import ExpertLayout
from deep_ep_jax.fp8_quant import _times_multipliers, _to_fp8  # fp8_quant's maths, shared


def expert_layout(topk_idx, *, num_local_experts, alignment, num_rows):
    """topk_idx int32 [N, K] local expert ids (or -1) -> ExpertLayout."""
    num_topk = topk_idx.shape[1]
    ids = topk_idx.reshape(-1)  # pair p = n * K + k
    num_pairs = ids.shape[0]
    key = jnp.where((ids >= 0) & (ids < num_local_experts), ids, num_local_experts)  # L: no expert
    counts = jnp.bincount(key, length=num_local_experts + 1).astype(jnp.int32)  # [L + 1], the last one unused
    aligned = (counts + (alignment - 1)) // alignment * alignment
    aligned_start = jnp.cumsum(aligned) - aligned  # where each group would start, unclipped
    packed_start = jnp.cumsum(counts) - counts  # where each group starts among the sorted pairs
    group_offsets = jnp.minimum(aligned_start, num_rows)[:num_local_experts]
    group_sizes = jnp.minimum(counts[:num_local_experts], num_rows - group_offsets)

    # A stable sort by expert keeps (n, k) order within each group.
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sorted_key = key[order]
    rank_in_group = jnp.arange(num_pairs, dtype=jnp.int32) - packed_start[sorted_key]
    row = aligned_start[sorted_key] + rank_in_group
    placed = (sorted_key < num_local_experts) & (row < num_rows)
    pair_row = jnp.full((num_pairs,), -1, jnp.int32).at[order].set(jnp.where(placed, row, -1))
    row_pair = jnp.full((num_rows,), -1, jnp.int32).at[jnp.where(placed, row, num_rows)].set(order, mode="drop")
    return ExpertLayout(
        group_sizes=group_sizes,
        group_offsets=group_offsets,
        pair_row=pair_row.reshape(-1, num_topk),
        row_pair=row_pair,
        num_dropped=(counts[:num_local_experts].sum() - group_sizes.sum()).astype(jnp.int32),
        alignment=int(alignment),
    )


def _as_bits(a):
    # Gathers and selects of float8 are not supported everywhere; move the bytes.
    return lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1 else a


def expand_rows(xs, layout):
    """xs: (bf16 [N, H],) or (e4m3 [N, H], f32 scales [N, H / 128]) -> the same
    arrays at [num_rows, ...]: row i is the token row of pair row_pair[i], 0 if unused."""
    num_topk = layout.pair_row.shape[1]
    used = layout.row_pair >= 0
    token = jnp.where(used, layout.row_pair // num_topk, 0)
    out = []
    for x in xs:
        bits = _as_bits(x)
        rows = jnp.where(used[:, None], bits[token], jnp.zeros((), bits.dtype))
        out.append(lax.bitcast_convert_type(rows, x.dtype) if bits.dtype != x.dtype else rows)
    return tuple(out)


def expand_rows_transposed(x, layout, row_multipliers=None, col_inverse_scales=None):
    """expand_rows((x,), layout)[0] transposed, float8 [H, num_rows]: x float8 [N, H] as it is, or bf16
    [N, H] with row_multipliers float32 [num_rows] and col_inverse_scales float32 [H] quantized as
    fp8_quant does: fp8(clip(x[row] * row_multipliers[i] * col_inverse_scales[c], -448, 448)), each
    product rounded; 0 where the multiplier is 0 (and on unused rows)."""
    (rows,) = expand_rows((x,), layout)
    if row_multipliers is not None:
        v = _times_multipliers(rows.astype(jnp.float32), row_multipliers[:, None])
        rows = _to_fp8(v, col_inverse_scales[None, :])
    return lax.bitcast_convert_type(_transposed(_as_bits(rows)), rows.dtype)


def _transposed(bits):
    """bits [R, H] -> [H, R], a block of columns per loop step. The loop reads the rows from a buffer:
    as one transpose, XLA's GPU fusion pulled the rows' gathers, and the dispatch's gathers and index
    maths behind them, into the transpose, evaluated under the transpose's tiling one byte per element:
    many times the cost of the gather alone, and the XLA baseline of the MoE benchmark's layer much
    slower for it."""
    num_rows, hidden = bits.shape
    block = math.gcd(hidden, 1024)  # the largest power of two up to 1024 that divides hidden

    def body(i, out):
        cols = lax.dynamic_slice_in_dim(bits, i * block, block, axis=1)
        return lax.dynamic_update_slice_in_dim(out, cols.T, i * block, axis=0)

    out = lax.full_like(bits, 0, shape=(hidden, num_rows))  # typed like bits (varying over the same axes)
    return lax.fori_loop(0, hidden // block, body, out)


def reduce_rows(expert_y, weights, layout):
    """out[n] = bf16(0.0 + term(n, 0) + term(n, 1) + ...) in float32, over k
    with pair_row[n, k] >= 0; term = w[n, k] * float32(expert_y[row]) rounded
    to float32 (no fused multiply-add), or float32(expert_y[row]) when weights
    is None."""
    # The rows as stored (bf16): XLA may otherwise feed a fused producer's
    # unrounded values (xla_allow_excess_precision), which the kernels never see.
    expert_y = lax.optimization_barrier(expert_y)
    has = (layout.pair_row >= 0).T  # [K, N]
    rows = expert_y[jnp.where(has, layout.pair_row.T, 0)].astype(jnp.float32)  # [K, N, H]
    terms = rows if weights is None else weights.T[:, :, None] * rows
    # The products are materialised before the sum, so that XLA cannot fuse a
    # multiply and an add into an FMA (which rounds once, unlike the kernels
    # and numpy): the barrier keeps them apart on GPU; on CPU, where barriers
    # are dropped before fusion, the loop does.
    terms = lax.optimization_barrier(jnp.where(has[:, :, None], terms, 0.0))
    zeros = jnp.zeros_like(terms[0])  # typed like terms (varying over the same mesh axes)
    acc, _ = lax.scan(lambda acc, term: (acc + term, None), zeros, terms)
    return acc.astype(expert_y.dtype)
