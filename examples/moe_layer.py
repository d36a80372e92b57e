"""A reusable expert-parallel MoE layer (Flax NNX) on deep_ep_jax.

    router (softmax top-k, load-balancing loss)      global view, plain JAX
    -> dispatch -> SwiGLU experts -> combine          per rank, shard_map

Three ways to run the experts (`expert_impl`):
- "ragged_dot" (the default): grouped matmuls (jax.lax.ragged_dot) over the
  received (row, k) pairs sorted by expert (argsort, gather, scatter).
- "capacity": batched matmuls over a padded [experts, capacity, H] buffer.
  Pairs beyond `capacity` are dropped; `capacity_overflow` counts them.
- "grouped": `dispatch_expert_major` puts one row per (token, local expert)
  pair straight into expert-major rows, `grouped_matmul` runs the SwiGLU on
  them (JAX's Mosaic GPU kernels on Hopper, ragged_dot elsewhere), its last
  matmul and the weighted sum per row in one (`grouped_matmul_reduce`), and
  `combine` brings the rows back: no argsort, gather or scatter. `expert_rows` rows per rank
  (default: the worst case); pairs past
  them are dropped; `expert_rows_overflow` counts them.
With `dropless=True` (or a capacity: rows per rank per round) the layer runs
through `dropless_moe`: receive buffers sized to the load instead of the worst
case, the overflow delivered in further rounds, no row dropped; the experts
run on the received rows (any `expert_impl`; "grouped" through `expand`).
With "grouped", `fp8=fp8_expert_weights(w_in, w_out, mesh=, axis_name=)` runs the experts'
matmuls on FP8 operands (make the copies once per optimizer step and pass
them to each of its micro-batches), and the rows travel to the experts as
FP8 (`fp8_rows=True`: quantized once per token, half the bytes).
The default stays "ragged_dot": exact on every platform. On GPUs
jax.lax.ragged_dot is a dense dot, so there choose "capacity" or "grouped"
(with expert_rows from your routing). "grouped" on Hopper aligns each
expert's rows to 128 (default_expert_alignment) so that grouped_matmul takes
its warp-specialized kernels, the fastest of the three paths at the
benchmark's shapes, in bf16 and more so with FP8 weights (docs/experts.md;
figures in benchmarks/README.md).

The mesh has a "data" axis and an "expert" axis. Tokens are split over both;
expert weights over "expert" (each rank holds E/R experts) and replicated over
"data"; the Buffer belongs to the "expert" axis.

Copy `expert_ffn` and `moe_ffn` into your model; `MoE` shows how they sit in
an NNX module.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from deep_ep_jax import (
    Buffer,
    combine,
    dispatch,
    dispatch_expert_major,
    dropless_moe,
    expand,
    grouped_matmul,
    grouped_matmul_reduce,
)
from deep_ep_jax.config import FP8_BLOCK
from deep_ep_jax.experts.grouped_gemm import aligned_rows, fp8_weights, is_hopper_gpu, swiglu

EXPERT_IMPLS = ("ragged_dot", "capacity", "grouped")


def use_fast_ragged_dot() -> bool:
    """On GPUs, lower ragged_dot to JAX's Pallas-Triton grouped matmul.

    XLA's default GPU lowering expands ragged_dot to a dense dot over all
    groups (E/R times the FLOPs and memory), which does not fit at real MoE
    sizes. Returns whether the grouped kernel is in use. Call before jit.
    """
    if jax.default_backend() != "gpu":
        return False
    try:
        from jax._src.lax.pallas_lowerings.gpu import ragged_dot  # noqa: F401

        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)
        return True
    except (ImportError, AttributeError):
        return False


# --------------------------------------------------------------------------
# Per rank, inside shard_map


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _take_pairs(x, order, topk):
    """Row of each sorted (row, k) pair: x[order // topk], [N * K, H].

    Its gradient is the inverse permutation plus a float32 sum over k: two
    gathers, where autodiff would scatter-add with atomics (slow,
    nondeterministic, and in bf16)."""
    return x[order // topk]


def _take_pairs_fwd(x, order, topk):
    return x[order // topk], order


def _take_pairs_bwd(topk, order, g):
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    g_rows = g[inverse].reshape(-1, topk, g.shape[-1]).sum(axis=1, dtype=jnp.float32)
    return g_rows.astype(g.dtype), None


_take_pairs.defvjp(_take_pairs_fwd, _take_pairs_bwd)


def _expert_ffn_ragged(recv_x, recv_topk_idx, recv_topk_weights, w_in, w_out):
    """expert_ffn with grouped matmuls (jax.lax.ragged_dot)."""
    num_rows, topk = recv_topk_idx.shape
    num_local_experts = w_in.shape[0]
    num_pairs = num_rows * topk

    # One (row, k) pair per routed slot, sorted by local expert. Empty slots
    # (-1, and every slot of the padding rows) sort into a trailing group that
    # ragged_dot leaves out (rows past sum(group_sizes) give zeros).
    expert = recv_topk_idx.reshape(-1)
    valid = expert >= 0
    key = jnp.where(valid, expert, num_local_experts)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=num_local_experts + 1)[:num_local_experts].astype(jnp.int32)

    # Padding rows of recv_x may hold any bits (NaN too): zero them, whatever
    # the ragged_dot lowering does with rows past sum(group_sizes).
    pairs = jnp.where(valid[order][:, None], _take_pairs(recv_x, order, topk), 0).astype(jnp.bfloat16)

    hidden = swiglu(jax.lax.ragged_dot(pairs, w_in.astype(jnp.bfloat16), group_sizes))
    # bf16 products keep the backward's grouped matmuls in bf16 too.
    out = jax.lax.ragged_dot(hidden, w_out.astype(jnp.bfloat16), group_sizes)
    out = out.astype(jnp.float32) * recv_topk_weights.reshape(-1)[order][:, None]

    # Back to (row, k) order, then sum each row's top-k outputs in float32.
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(num_pairs, dtype=order.dtype), unique_indices=True)
    out = out.at[inverse].get(unique_indices=True)
    return out.reshape(num_rows, topk, -1).sum(axis=1).astype(jnp.bfloat16)


def default_capacity(num_rows: int, topk: int, num_local_experts: int) -> int:
    """Slots per expert: twice the mean load of N * K pairs, rounded up to 128."""
    mean = -(-num_rows * topk // num_local_experts)
    return -(-2 * mean // 128) * 128


def _pairs_per_expert(topk_idx, num_experts: int, num_groups: int):
    """int32 [num_groups, E]: the pairs each expert-parallel group routes to
    each expert, topk_idx [T, K] being all tokens' routing split in order
    over the groups."""
    idx = jnp.asarray(topk_idx).reshape(num_groups, -1)
    valid = (idx >= 0) & (idx < num_experts)
    counts = jax.vmap(lambda i: jnp.bincount(i, length=num_experts + 1))(jnp.where(valid, idx, num_experts))
    return counts[:, :num_experts]


def capacity_overflow(topk_idx, num_experts: int, capacity: int, num_groups: int = 1):
    """(row, expert) pairs the capacity path drops, summed over all ranks.

    topk_idx: int32 [T, K] routing of all tokens, split in order over
    num_groups expert-parallel groups (num_groups: the size of the "data"
    axis). Each rank receives, for each of its experts, every pair its group
    routes to it (dispatch drops nothing at its default size), and keeps the
    first `capacity`."""
    return jnp.sum(jnp.maximum(_pairs_per_expert(topk_idx, num_experts, num_groups) - capacity, 0))


def _take(a, index):
    """a[index] with zeros where index is out of bounds (our 'none' marker)."""
    return a.at[index].get(mode="fill", fill_value=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rows_to_slots(x, slot_pair, pair_slot, topk):
    """Row of the pair in each slot: x[slot_pair // topk], zeros for empty slots.

    slot_pair [S] and pair_slot [P] are inverse partial maps between slots and
    (row, k) pairs, out of bounds for 'none'. The gradient is a gather plus a
    float32 sum over k, where autodiff would scatter-add."""
    return _take(x, slot_pair // topk)


def _rows_to_slots_fwd(x, slot_pair, pair_slot, topk):
    return _rows_to_slots(x, slot_pair, pair_slot, topk), (slot_pair, pair_slot)


def _rows_to_slots_bwd(topk, res, g):
    _, pair_slot = res
    g_rows = _take(g, pair_slot).reshape(-1, topk, g.shape[-1]).sum(axis=1, dtype=jnp.float32)
    return g_rows.astype(g.dtype), None, None


_rows_to_slots.defvjp(_rows_to_slots_fwd, _rows_to_slots_bwd)


@jax.custom_vjp
def _slots_to_pairs(y, pair_slot, slot_pair):
    """Output slot of each (row, k) pair: y[pair_slot], zeros for none. Its
    gradient is the inverse gather (each slot holds at most one pair)."""
    return _take(y, pair_slot)


def _slots_to_pairs_fwd(y, pair_slot, slot_pair):
    return _take(y, pair_slot), (pair_slot, slot_pair)


def _slots_to_pairs_bwd(res, g):
    _, slot_pair = res
    return _take(g, slot_pair), None, None


_slots_to_pairs.defvjp(_slots_to_pairs_fwd, _slots_to_pairs_bwd)


def _expert_ffn_capacity(recv_x, recv_topk_idx, recv_topk_weights, w_in, w_out, capacity):
    """expert_ffn with batched matmuls over a padded [L, capacity, H] buffer.

    Pairs sorted by local expert fill their expert's slots in (row, k) order;
    those past `capacity` are dropped (they contribute zero)."""
    num_rows, topk = recv_topk_idx.shape
    num_local_experts, hidden = w_in.shape[0], w_in.shape[1]
    num_pairs, num_slots = num_rows * topk, num_local_experts * capacity

    expert = recv_topk_idx.reshape(-1)
    key = jnp.where(expert >= 0, expert, num_local_experts)
    order = jnp.argsort(key, stable=True)
    counts = jnp.bincount(key, length=num_local_experts + 1)
    starts = jnp.cumsum(counts) - counts
    sorted_key = key[order]
    rank_in_expert = jnp.arange(num_pairs, dtype=order.dtype) - starts[sorted_key]
    kept = (sorted_key < num_local_experts) & (rank_in_expert < capacity)
    # Slot of each pair (num_slots for none) and pair of each slot (num_pairs for none).
    slot_of_sorted = jnp.where(kept, sorted_key * capacity + rank_in_expert, num_slots)
    pair_slot = jnp.full((num_pairs,), num_slots, order.dtype).at[order].set(slot_of_sorted, unique_indices=True)
    slot_pair = jnp.full((num_slots,), num_pairs, order.dtype).at[slot_of_sorted].set(order, mode="drop")

    # Padding rows of recv_x may hold any bits (NaN too): only kept pairs are read.
    slots = _rows_to_slots(recv_x.astype(jnp.bfloat16), slot_pair, pair_slot, topk)
    slots = slots.reshape(num_local_experts, capacity, hidden)
    hidden_act = swiglu(jnp.einsum("ech,ehf->ecf", slots, w_in.astype(jnp.bfloat16)))
    out = jnp.einsum("ecf,efh->ech", hidden_act, w_out.astype(jnp.bfloat16)).reshape(num_slots, hidden)

    out = _slots_to_pairs(out, pair_slot, slot_pair).astype(jnp.float32) * recv_topk_weights.reshape(-1)[:, None]
    return out.reshape(num_rows, topk, hidden).sum(axis=1).astype(jnp.bfloat16)


def swiglu_grouped(expert_x, w_in, w_out, group_sizes, alignment: int = 1, pairs=None, fp8=None, reduce_with=None):
    """SwiGLU experts on expert-major rows: expert_x bf16 [M, H] (or, with
    fp8, the Fp8Rows of expand or dispatch_expert_major(fp8_rows=True)), group g
    the next group_sizes[g] rows (rows past them give 0), every size a
    multiple of `alignment`; pairs (optional): the rows at each group's start
    that hold a pair (the layout's group_sizes), the rest being padding;
    fp8 (optional): fp8_expert_weights(w_in, w_out), for FP8 matmuls.
    Returns bf16 [M, H]; with reduce_with=(recv_topk_weights, layout) the
    rows reduced with the weights, bf16 [N, H] (grouped_matmul_reduce: with
    FP8 weight gradients, the backward never writes the expert rows' bf16
    gradient)."""
    # Sizes of whole row tiles: say so, and grouped_matmul needs no device-side choice of kernels.
    # The pairs let the weight gradient skip the padding rows.
    kwargs = dict(aligned_groups=alignment % aligned_rows() == 0, valid_sizes=pairs)
    w_in8, w_out8 = fp8 or (None, None)
    gate_up = grouped_matmul(expert_x, w_in.astype(jnp.bfloat16), group_sizes, fp8_weights=w_in8, **kwargs)
    # With FP8 weight gradients the hidden rows go straight to FP8 (one pass over gate_up).
    hidden = swiglu(gate_up, fp8_rows=w_out8 is not None and w_out8.weight_grad)
    if reduce_with is not None:
        return grouped_matmul_reduce(
            hidden, w_out.astype(jnp.bfloat16), group_sizes, *reduce_with, fp8_weights=w_out8, **kwargs
        )
    return grouped_matmul(hidden, w_out.astype(jnp.bfloat16), group_sizes, fp8_weights=w_out8, **kwargs)


def fp8_expert_weights(w_in, w_out, weight_grad: bool = True, *, mesh=None, axis_name=None):
    """The FP8 copies of the experts' weights for `fp8=` (grouped experts):
    their forward, input-gradient and weight-gradient matmuls then run on FP8
    operands (with weight_grad=False the weight gradients stay bf16). Make
    them once per optimizer step (they read all the weights, several
    micro-batches' worth of FP8's savings) and pass them to every
    micro-batch's step: made every step they cost more than FP8 saves
    (benchmarks/RESULTS.md). mesh, axis_name: where the
    weights are split over that axis (as moe_apply takes them: the Buffer's
    mesh and axis), each rank makes its own experts' copies (the GPU kernels
    would otherwise get the whole weights gathered onto every device)."""

    def copies(w_in, w_out):
        return (
            fp8_weights(w_in.astype(jnp.bfloat16), weight_grad=weight_grad),
            fp8_weights(w_out.astype(jnp.bfloat16), weight_grad=weight_grad),
        )

    if (mesh is None) != (axis_name is None):
        raise ValueError("fp8_expert_weights: give both mesh and axis_name, or neither")
    if mesh is None:
        return copies(w_in, w_out)
    experts = P(axis_name)
    return jax.shard_map(copies, mesh=mesh, in_specs=(experts, experts), out_specs=experts)(w_in, w_out)


def default_expert_alignment() -> int:
    """grouped_gemm.aligned_rows() (128) where grouped_matmul runs the Mosaic
    GPU kernels (a Hopper GPU): groups of whole row tiles take its
    warp-specialized kernels. 1 elsewhere (no padding rows to compute)."""
    return aligned_rows() if is_hopper_gpu() else 1


def _fp8_rows(fp8, x) -> bool:
    """Whether the rows move as FP8, quantized once per token (half the bytes; the values the FP8
    matmul would make of them anyway): with FP8 matmuls, where the hidden size is whole 128-wide
    blocks, as FP8 rows need."""
    return fp8 is not None and x.shape[-1] % FP8_BLOCK == 0


def _expert_ffn_grouped(recv_x, recv_topk_idx, recv_topk_weights, w_in, w_out, expert_rows, alignment, fp8):
    """expert_ffn on rank-major rows through expert-major ones: expand, the
    grouped SwiGLU, reduce with the weights (the local half of moe_ffn's path)."""
    expert_x, layout = expand(
        recv_x.astype(jnp.bfloat16),
        recv_topk_idx,
        num_local_experts=w_in.shape[0],
        alignment=alignment,
        num_rows=expert_rows,
        fp8_rows=_fp8_rows(fp8, recv_x),
    )
    return swiglu_grouped(
        expert_x,
        w_in,
        w_out,
        layout.padded_group_sizes(alignment),
        alignment,
        layout.group_sizes,
        fp8,
        reduce_with=(recv_topk_weights, layout),
    )


def expert_rows_overflow(
    topk_idx, num_experts: int, num_ranks: int, expert_rows: int, alignment: int = 1, num_groups: int = 1
):
    """(token, expert) pairs the grouped path drops, summed over all ranks.

    topk_idx: int32 [T, K] routing of all tokens, split in order over
    num_groups expert-parallel groups of num_ranks ranks (num_groups: the size
    of the "data" axis). Rank r of a group receives every pair its group routes
    to experts [r * L, (r + 1) * L) (dispatch drops nothing at its default
    size); expert e's group of rows starts after the earlier ones, each
    rounded up to `alignment`, and its pairs from row expert_rows on are dropped."""
    counts = _pairs_per_expert(topk_idx, num_experts, num_groups).reshape(num_groups, num_ranks, -1)  # [groups, R, L]
    aligned = -(-counts // alignment) * alignment
    start = jnp.cumsum(aligned, axis=-1) - aligned
    kept = jnp.clip(expert_rows - start, 0, counts)
    return jnp.sum(counts - kept)


def _check_expert_args(fn, impl, expert_rows, alignment, fp8=None, dropless=False):
    """Raises on bad arguments; returns the alignment (None: default_expert_alignment())."""
    if alignment is None:
        alignment = default_expert_alignment()
    if impl not in EXPERT_IMPLS:
        raise ValueError(f"{fn}: expert_impl must be one of {EXPERT_IMPLS}, got {impl!r}")
    if fp8 is not None and impl != "grouped":
        raise ValueError(f"{fn}: fp8 expert weights need expert_impl='grouped', got {impl!r}")
    if not isinstance(dropless, bool) and (not isinstance(dropless, int) or dropless < 1):
        raise ValueError(f"{fn}: dropless must be a bool or a positive int (rows per rank per round), got {dropless!r}")
    if dropless is not False and fp8 is not None:
        raise ValueError(f"{fn}: dropless with fp8 expert weights is not supported by this example")
    if expert_rows is not None and (
        not isinstance(expert_rows, int) or isinstance(expert_rows, bool) or expert_rows < 1
    ):
        raise ValueError(f"{fn}: expert_rows must be a positive int or None, got {expert_rows!r}")
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1:
        raise ValueError(f"{fn}: expert_alignment must be a positive int or None, got {alignment!r}")
    if impl == "grouped" and expert_rows is not None and expert_rows % alignment:
        raise ValueError(
            f"{fn}: expert_rows {expert_rows} must be a multiple of the expert alignment {alignment} "
            f"(expert_alignment; on Hopper 128 by default)"
        )
    return alignment


def expert_ffn(
    recv_x,
    recv_topk_idx,
    recv_topk_weights,
    w_in,
    w_out,
    *,
    impl="ragged_dot",
    capacity=None,
    expert_rows=None,
    expert_alignment=None,
    fp8=None,
):
    """SwiGLU experts over the received rows, weighted by their top-k weights.

    recv_x bf16 [N, H]; recv_topk_idx int32 [N, K] local expert ids or -1;
    recv_topk_weights f32 [N, K]; w_in [L, H, 2F] (gate | up); w_out [L, F, H].
    Returns bf16 [N, H]: sum over k of weight_k * expert_k(row), in float32.

    impl: "ragged_dot" (grouped matmuls, nothing dropped), "capacity"
    (batched matmuls over `capacity` slots per expert, default
    default_capacity(N, K, L); pairs past it are dropped) or "grouped"
    (expand to `expert_rows` expert-major rows, default
    deep_ep_jax.comm.expert_major.default_num_rows(N, K, L, expert_alignment),
    grouped_matmul, reduce; pairs past them are dropped). expert_alignment: each expert's rows start
    at a multiple of it (default: default_expert_alignment()). fp8 ("grouped" only):
    fp8_expert_weights(w_in, w_out), for FP8 matmuls (on Hopper, with an alignment of 128).
    """
    expert_alignment = _check_expert_args("expert_ffn", impl, expert_rows, expert_alignment, fp8)
    if impl == "ragged_dot":
        return _expert_ffn_ragged(recv_x, recv_topk_idx, recv_topk_weights, w_in, w_out)
    if impl == "capacity":
        if capacity is None:
            capacity = default_capacity(*recv_topk_idx.shape, w_in.shape[0])
        return _expert_ffn_capacity(recv_x, recv_topk_idx, recv_topk_weights, w_in, w_out, int(capacity))
    return _expert_ffn_grouped(
        recv_x, recv_topk_idx, recv_topk_weights, w_in, w_out, expert_rows, expert_alignment, fp8
    )


def moe_ffn(
    x,
    topk_idx,
    topk_weights,
    w_in,
    w_out,
    *,
    buffer: Buffer,
    num_experts: int,
    expert_impl="ragged_dot",
    capacity=None,
    expert_rows=None,
    expert_alignment=None,
    fp8=None,
    dropless=False,
):
    """One rank's MoE: dispatch, local experts, combine. x [T, H] -> bf16 [T, H].
    expert_impl, capacity, expert_rows, expert_alignment, fp8: see expert_ffn.
    dropless: True (dropless_moe's default capacity) or rows per rank per round:
    dropless_moe runs dispatch, expert_ffn and combine in as many rounds as the
    load needs."""
    expert_alignment = _check_expert_args("moe_ffn", expert_impl, expert_rows, expert_alignment, fp8, dropless)
    x = x.astype(jnp.bfloat16)
    if dropless is not False:
        experts = functools.partial(
            _dropless_experts, impl=expert_impl, capacity=capacity, expert_rows=expert_rows, alignment=expert_alignment
        )
        rows = None if dropless is True else dropless
        return dropless_moe(
            x, topk_idx, topk_weights, experts, (w_in, w_out), num_experts=num_experts, buffer=buffer, capacity=rows
        )
    if expert_impl == "grouped":
        # Received pairs land grouped by local expert: no sort, gather or scatter here.
        expert_x, layout, recv_weights, handle = dispatch_expert_major(
            x,
            topk_idx,
            topk_weights,
            num_experts=num_experts,
            buffer=buffer,
            alignment=expert_alignment,
            num_rows=expert_rows,
            fp8_rows=_fp8_rows(fp8, x),
        )
        y = swiglu_grouped(
            expert_x,
            w_in,
            w_out,
            layout.padded_group_sizes(expert_alignment),
            expert_alignment,
            layout.group_sizes,
            fp8,
            reduce_with=(recv_weights, layout),
        )
        return combine(y, handle, buffer=buffer)  # combine_expert_major's combine, the reduction done above
    recv_x, recv_idx, recv_weights, handle = dispatch(x, topk_idx, topk_weights, num_experts=num_experts, buffer=buffer)
    expert_out = expert_ffn(recv_x, recv_idx, recv_weights, w_in, w_out, impl=expert_impl, capacity=capacity)
    return combine(expert_out, handle, buffer=buffer)


def _dropless_experts(params, recv_x, recv_topk_idx, recv_topk_weights, *, impl, capacity, expert_rows, alignment):
    """dropless_moe's experts: expert_ffn on a round's received rows, params = (w_in, w_out)."""
    return expert_ffn(
        recv_x, recv_topk_idx, recv_topk_weights, *params, impl=impl, capacity=capacity, expert_rows=expert_rows,
        expert_alignment=alignment,
    )  # fmt: skip


# --------------------------------------------------------------------------
# Global view


def route(x, router_kernel, top_k: int, normalize: bool = True):
    """Softmax top-k router. x [T, H] -> (topk_idx int32 [T, K], topk_weights
    f32 [T, K], aux_loss). aux_loss is the Switch/GShard load-balancing loss
    E * sum_e (fraction of slots routed to e) * (mean router probability of
    e): 1.0 when balanced, E when everything goes to one expert."""
    logits = x.astype(jnp.float32) @ router_kernel.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    topk_weights, topk_idx = jax.lax.top_k(probs, top_k)
    if normalize:
        topk_weights = topk_weights / jnp.sum(topk_weights, axis=-1, keepdims=True)
    num_experts = probs.shape[-1]
    fraction = jnp.mean(jax.nn.one_hot(topk_idx, num_experts, dtype=jnp.float32).sum(1), axis=0) / top_k
    aux_loss = num_experts * jnp.sum(fraction * jnp.mean(probs, axis=0))
    return topk_idx.astype(jnp.int32), topk_weights, aux_loss


def moe_apply(
    x,
    router_kernel,
    w_in,
    w_out,
    *,
    top_k: int,
    buffer: Buffer,
    normalize: bool = True,
    expert_impl="ragged_dot",
    capacity=None,
    expert_rows=None,
    expert_alignment=None,
    fp8=None,
    dropless=False,
):
    """The whole layer on global arrays. x [..., H] -> (y like x, aux_loss).
    expert_impl, capacity, expert_rows, expert_alignment, fp8: see expert_ffn
    (expert_rows: per rank; fp8: fp8_expert_weights(w_in, w_out, mesh=buffer.mesh,
    axis_name=buffer.axis_name)); dropless: see moe_ffn."""
    mesh, num_experts = buffer.mesh, router_kernel.shape[-1]
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    topk_idx, topk_weights, aux_loss = route(x, router_kernel, top_k, normalize)
    tokens = P(tuple(mesh.axis_names))  # tokens are split over every mesh axis
    experts = P(buffer.axis_name)
    # Under jit even when called eagerly: shard_map alone would run the body op by op on every device.
    per_rank = jax.jit(
        jax.shard_map(
            lambda x, idx, weights, w_in, w_out, fp8=None: moe_ffn(
                x,
                idx,
                weights,
                w_in,
                w_out,
                buffer=buffer,
                num_experts=num_experts,
                expert_impl=expert_impl,
                capacity=capacity,
                expert_rows=expert_rows,
                expert_alignment=expert_alignment,
                fp8=fp8,
                dropless=dropless,
            ),
            mesh=mesh,
            in_specs=(tokens, tokens, tokens, experts, experts) + ((experts,) if fp8 is not None else ()),
            out_specs=tokens,
        )
    )
    y = per_rank(x, topk_idx, topk_weights, w_in, w_out, *(() if fp8 is None else (fp8,)))
    return y.astype(x.dtype).reshape(shape), aux_loss


class ExpertParam(nnx.Param):
    """A parameter split over the expert axis (the rest are replicated)."""


class MoE(nnx.Module):
    """Expert-parallel SwiGLU MoE. Call: x [..., H] -> (y [..., H], aux_loss)."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        num_experts: int,
        top_k: int,
        *,
        buffer: Buffer,
        rngs: nnx.Rngs,
        expert_impl: str = "ragged_dot",
        capacity: int | None = None,
        expert_rows: int | None = None,
        expert_alignment: int | None = None,
        dropless: bool | int = False,
    ):
        if num_experts % buffer.num_ranks:
            raise ValueError(f"MoE: num_experts {num_experts} must divide by the {buffer.num_ranks} expert ranks")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k {top_k} must be in [1, num_experts={num_experts}]")
        _check_expert_args("MoE", expert_impl, expert_rows, expert_alignment, dropless=dropless)
        self.top_k = top_k
        self.dropless = dropless
        self.buffer = buffer
        self.expert_impl, self.capacity = expert_impl, capacity
        self.expert_rows, self.expert_alignment = expert_rows, expert_alignment
        init = jax.nn.initializers.normal(stddev=0.02)
        self.router = nnx.Param(init(rngs.params(), (hidden, num_experts)))
        self.w_in = ExpertParam(init(rngs.params(), (num_experts, hidden, 2 * ffn)))
        self.w_out = ExpertParam(init(rngs.params(), (num_experts, ffn, hidden)))

    def __call__(self, x):
        return moe_apply(
            x,
            self.router[...],
            self.w_in[...],
            self.w_out[...],
            top_k=self.top_k,
            buffer=self.buffer,
            expert_impl=self.expert_impl,
            capacity=self.capacity,
            expert_rows=self.expert_rows,
            expert_alignment=self.expert_alignment,
            dropless=self.dropless,
        )
