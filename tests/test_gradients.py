"""Gradients through dispatch and combine (custom_vjp) against jax.grad of the
same MoE maths written densely on one device (in float32: the rows cross
dispatch and combine as bf16, as the contract says, so they agree to bf16's
precision)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import deep_ep_jax as dej
from deep_ep_jax import testing as dt

H, F = 16, 8


def _sharded_loss(buffer, num_experts, num_worst_tokens=None):
    def per_rank(x, idx, w, experts, probe):
        recv_x, recv_idx, recv_w, handle = dej.dispatch(
            x, idx, w, num_experts=num_experts, buffer=buffer, num_worst_tokens=num_worst_tokens
        )
        local = jnp.clip(recv_idx, 0)  # -1 slots carry weight 0
        h = jnp.einsum("nh,nkhf->nkf", recv_x.astype(jnp.float32), experts[local])
        rows = jnp.einsum("nk,nkf->nf", recv_w, jnp.tanh(h))
        out, out_w = dej.combine(rows.astype(jnp.bfloat16), handle, recv_w, buffer=buffer)
        return jax.lax.psum(jnp.sum(out.astype(jnp.float32) * probe) + jnp.sum(out_w * probe[:, :1] ** 2), "ep")

    return jax.jit(jax.shard_map(per_rank, mesh=buffer.mesh, in_specs=P("ep"), out_specs=P(), check_vma=False))


def _dense_loss(x, idx, w, experts, probe):
    x = x.astype(jnp.float32)
    valid = idx >= 0
    h = jnp.einsum("th,tkhf->tkf", x, experts[jnp.clip(idx, 0)])
    w = jnp.where(valid, w, 0.0)
    out = jnp.einsum("tk,tkf->tf", w, jnp.tanh(h))
    return jnp.sum(out * probe) + jnp.sum(w * probe[:, :1] ** 2)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("kind", ["random", "minus_one", "rank_empty"])
def test_grad_matches_dense(num_ranks, kind):
    num_tokens, num_experts, topk = 10, 4 * num_ranks, 3
    mesh = dt.ep_mesh(num_ranks, platform="cpu")
    buffer = dej.Buffer(mesh, "ep", backend="xla")
    idx, w = dt.make_routing(11, num_ranks * num_tokens, num_experts, topk, num_ranks, kind)
    idx, w = jnp.asarray(idx), jnp.asarray(w)
    x = dt.random_rows(12, (num_ranks * num_tokens, H))  # bf16, as the contract says
    experts = dt.random_rows(13, (num_experts, H, F), jnp.float32) * 0.3
    probe = dt.random_rows(14, (num_ranks * num_tokens, F), jnp.float32)

    loss = _sharded_loss(buffer, num_experts)
    value, grads = jax.value_and_grad(loss, argnums=(0, 2, 3))(x, idx, w, experts, probe)
    want_value, want_grads = jax.value_and_grad(_dense_loss, argnums=(0, 2, 3))(x, idx, w, experts, probe)
    np.testing.assert_allclose(value, want_value, rtol=2e-2)
    assert grads[0].dtype == jnp.bfloat16
    for got, want, name in zip(grads, want_grads, ("x", "topk_weights", "experts")):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        # A few bf16 roundings on the way: relative to the gradient's scale.
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max(), err_msg=name)


def test_grad_bf16_rows():
    """bf16 rows (the kernels' dtype) differentiate too; gradients are bf16."""
    num_ranks, num_tokens, num_experts, topk = 4, 8, 8, 2
    mesh = dt.ep_mesh(num_ranks, platform="cpu")
    buffer = dej.Buffer(mesh, "ep", backend="xla")
    idx, w = dt.make_routing(21, num_ranks * num_tokens, num_experts, topk, num_ranks)
    x = dt.random_rows(22, (num_ranks * num_tokens, H))

    def per_rank(x, idx, w):
        recv_x, _, _, handle = dej.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
        return jax.lax.psum(jnp.sum(dej.combine(recv_x * 3, handle, buffer=buffer).astype(jnp.float32)), "ep")

    f = jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P(), check_vma=False)
    g = jax.grad(f)(x, jnp.asarray(idx), jnp.asarray(w))
    assert g.dtype == jnp.bfloat16
    in_ranks = np.zeros((num_ranks * num_tokens,))
    for t, row in enumerate(idx):
        in_ranks[t] = len({e // (num_experts // num_ranks) for e in row if e >= 0})
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.broadcast_to(3 * in_ranks[:, None], g.shape))
