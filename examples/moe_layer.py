"""A reusable expert-parallel MoE layer (Flax NNX) on deep_ep_jax.

    router (softmax top-k, load-balancing loss)      global view, plain JAX
    -> dispatch -> SwiGLU experts (ragged_dot) -> combine   per rank, shard_map

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

from deep_ep_jax import Buffer, combine, dispatch

try:  # jax >= 0.7
    from jax import shard_map as _shard_map

    def shard_map(f, mesh, in_specs, out_specs):
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

except ImportError:  # older jax
    from jax.experimental.shard_map import shard_map as _shard_map

    def shard_map(f, mesh, in_specs, out_specs):
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


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


def expert_ffn(recv_x, recv_topk_idx, recv_topk_weights, w_in, w_out):
    """SwiGLU experts over the received rows, weighted by their top-k weights.

    recv_x bf16 [N, H]; recv_topk_idx int32 [N, K] local expert ids or -1;
    recv_topk_weights f32 [N, K]; w_in [L, H, 2F] (gate | up); w_out [L, F, H].
    Returns bf16 [N, H]: sum over k of weight_k * expert_k(row), in float32.
    """
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

    gate_up = jax.lax.ragged_dot(pairs, w_in.astype(jnp.bfloat16), group_sizes)
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    hidden = (jax.nn.silu(gate) * up).astype(jnp.bfloat16)
    # bf16 products keep the backward's grouped matmuls in bf16 too.
    out = jax.lax.ragged_dot(hidden, w_out.astype(jnp.bfloat16), group_sizes)
    out = out.astype(jnp.float32) * recv_topk_weights.reshape(-1)[order][:, None]

    # Back to (row, k) order, then sum each row's top-k outputs in float32.
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(num_pairs, dtype=order.dtype), unique_indices=True)
    out = out.at[inverse].get(unique_indices=True)
    return out.reshape(num_rows, topk, -1).sum(axis=1).astype(jnp.bfloat16)


def moe_ffn(x, topk_idx, topk_weights, w_in, w_out, *, buffer: Buffer, num_experts: int):
    """One rank's MoE: dispatch, local experts, combine. x [T, H] -> bf16 [T, H]."""
    recv_x, recv_idx, recv_weights, handle = dispatch(
        x.astype(jnp.bfloat16), topk_idx, topk_weights, num_experts=num_experts, buffer=buffer
    )
    expert_out = expert_ffn(recv_x, recv_idx, recv_weights, w_in, w_out)
    return combine(expert_out, handle, buffer=buffer)


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


def moe_apply(x, router_kernel, w_in, w_out, *, top_k: int, buffer: Buffer, normalize: bool = True):
    """The whole layer on global arrays. x [..., H] -> (y like x, aux_loss)."""
    mesh, num_experts = buffer.mesh, router_kernel.shape[-1]
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    topk_idx, topk_weights, aux_loss = route(x, router_kernel, top_k, normalize)
    tokens = P(tuple(mesh.axis_names))  # tokens are split over every mesh axis
    experts = P(buffer.axis_name)
    per_rank = shard_map(
        lambda *a: moe_ffn(*a, buffer=buffer, num_experts=num_experts),
        mesh,
        in_specs=(tokens, tokens, tokens, experts, experts),
        out_specs=tokens,
    )
    y = per_rank(x, topk_idx, topk_weights, w_in, w_out)
    return y.astype(x.dtype).reshape(shape), aux_loss


class ExpertParam(nnx.Param):
    """A parameter split over the expert axis (the rest are replicated)."""


class MoE(nnx.Module):
    """Expert-parallel SwiGLU MoE. Call: x [..., H] -> (y [..., H], aux_loss)."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, *, buffer: Buffer, rngs: nnx.Rngs):
        if num_experts % buffer.num_ranks:
            raise ValueError(f"MoE: num_experts {num_experts} must divide by the {buffer.num_ranks} expert ranks")
        self.top_k = top_k
        self.buffer = buffer
        init = jax.nn.initializers.normal(stddev=0.02)
        self.router = nnx.Param(init(rngs.params(), (hidden, num_experts)))
        self.w_in = ExpertParam(init(rngs.params(), (num_experts, hidden, 2 * ffn)))
        self.w_out = ExpertParam(init(rngs.params(), (num_experts, ffn, hidden)))

    def __call__(self, x):
        return moe_apply(x, self.router[...], self.w_in[...], self.w_out[...], top_k=self.top_k, buffer=self.buffer)
