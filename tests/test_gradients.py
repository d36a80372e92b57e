"""Gradients through dispatch and combine (custom_vjp) against jax.grad of the
same MoE maths written densely on one device (in float32: the rows cross
dispatch and combine as bf16, as the contract says, so they agree to bf16's
precision). Also FP8 rows (no gradient for them, the weights still have
one) and rows dropped past num_worst_tokens (no gradient through them)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import deep_ep_jax as dej
from deep_ep_jax import testing as dt
from deep_ep_jax.backends import reference

H, F = 16, 8


def _sharded_loss(buffer, num_experts, num_worst_tokens=None, check_vma=False):
    def per_rank(x, idx, w, experts, probe):
        recv_x, recv_idx, recv_w, handle = dej.dispatch(
            x, idx, w, num_experts=num_experts, buffer=buffer, num_worst_tokens=num_worst_tokens
        )
        local = jnp.clip(recv_idx, 0)  # -1 slots carry weight 0
        recv_rows = dej.dequantize(recv_x, jnp.float32) if isinstance(recv_x, tuple) else recv_x.astype(jnp.float32)
        h = jnp.einsum("nh,nkhf->nkf", recv_rows, experts[local])
        rows = jnp.einsum("nk,nkf->nf", recv_w, jnp.tanh(h))
        out, out_w = dej.combine(rows.astype(jnp.bfloat16), handle, recv_w, buffer=buffer)
        return jax.lax.psum(jnp.sum(out.astype(jnp.float32) * probe) + jnp.sum(out_w * probe[:, :1] ** 2), "ep")

    return jax.jit(jax.shard_map(per_rank, mesh=buffer.mesh, in_specs=P("ep"), out_specs=P(), check_vma=check_vma))


@functools.cache
def _sharded_value_and_grads(num_ranks, num_experts, num_worst_tokens=None, check_vma=False):
    """The sharded loss's value and gradients for (x, topk_weights, experts), jitted once per configuration:
    the routing kinds share its compile (the routing is an argument, not a constant of the trace)."""
    buffer = dej.Buffer(dt.ep_mesh(num_ranks, platform="cpu"), "ep", backend="xla")
    return jax.jit(
        jax.value_and_grad(_sharded_loss(buffer, num_experts, num_worst_tokens, check_vma), argnums=(0, 2, 3))
    )


def _dense_loss(x, idx, w, experts, probe):
    x = x.astype(jnp.float32)
    valid = idx >= 0
    h = jnp.einsum("th,tkhf->tkf", x, experts[jnp.clip(idx, 0)])
    w = jnp.where(valid, w, 0.0)
    out = jnp.einsum("tk,tkf->tf", w, jnp.tanh(h))
    return jnp.sum(out * probe) + jnp.sum(w * probe[:, :1] ** 2)


# The dense maths' value and gradients, jitted: one compile per shape, not one per op run eagerly.
_dense_value_and_grads = jax.jit(jax.value_and_grad(_dense_loss, argnums=(0, 2, 3)))
_dense_value_and_weight_grads = jax.jit(jax.value_and_grad(_dense_loss, argnums=(2, 3)))  # x not differentiable


def _assert_grads_close(grads, want_grads, names):
    for got, want, name in zip(grads, want_grads, names):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        # A few bf16 roundings on the way: relative to the gradient's scale.
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max(), err_msg=name)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("kind", ["random", "minus_one", "rank_empty"])
def test_grad_matches_dense(num_ranks, kind):
    num_tokens, num_experts, topk = 10, 4 * num_ranks, 3
    idx, w = dt.make_routing(11, num_ranks * num_tokens, num_experts, topk, num_ranks, kind)
    idx, w = jnp.asarray(idx), jnp.asarray(w)
    x = dt.random_rows(12, (num_ranks * num_tokens, H))  # bf16, as the contract says
    experts = dt.random_rows(13, (num_experts, H, F), jnp.float32) * 0.3
    probe = dt.random_rows(14, (num_ranks * num_tokens, F), jnp.float32)

    value, grads = _sharded_value_and_grads(num_ranks, num_experts)(x, idx, w, experts, probe)
    want_value, want_grads = _dense_value_and_grads(x, idx, w, experts, probe)
    np.testing.assert_allclose(value, want_value, rtol=2e-2)
    assert grads[0].dtype == jnp.bfloat16
    _assert_grads_close(grads, want_grads, ("x", "topk_weights", "experts"))
    # Exactly 0, not just small: the -1 slots' weights, and the rows that go to no expert.
    unsent = np.asarray(idx < 0)
    assert kind != "minus_one" or unsent.all(axis=1).any()
    assert (np.asarray(grads[1])[unsent] == 0).all()
    assert (np.asarray(grads[0], np.float32)[unsent.all(axis=1)] == 0).all()


@pytest.mark.parametrize("check_vma", [False, True])
@pytest.mark.parametrize("kind", ["random", "minus_one"])
def test_grad_fp8_rows(kind, check_vma):
    """FP8 rows carry no gradient (zeros of the pair's shapes and dtypes,
    typed as the pair under check_vma); the weights and the experts get the
    dense maths' gradients, with x the dequantised FP8 rows."""
    num_ranks, num_tokens, num_experts, topk, hidden = 4, 8, 16, 3, 256  # FP8 needs hidden % 128 == 0
    idx, w = dt.make_routing(31, num_ranks * num_tokens, num_experts, topk, num_ranks, kind)
    idx, w = jnp.asarray(idx), jnp.asarray(w)
    x = reference.quantize_fp8(dt.random_rows(32, (num_ranks * num_tokens, hidden)))
    experts = dt.random_rows(33, (num_experts, hidden, F), jnp.float32) * 0.1
    probe = dt.random_rows(34, (num_ranks * num_tokens, F), jnp.float32)

    value, grads = _sharded_value_and_grads(num_ranks, num_experts, check_vma=check_vma)(x, idx, w, experts, probe)
    dense_x = dej.dequantize(x, jnp.float32)
    want_value, want_grads = _dense_value_and_weight_grads(dense_x, idx, w, experts, probe)
    np.testing.assert_allclose(value, want_value, rtol=2e-2)
    (g_data, g_scales), g_w, g_experts = grads
    assert g_data.dtype == jnp.float8_e4m3fn and g_data.shape == x[0].shape
    assert g_scales.dtype == jnp.float32 and g_scales.shape == x[1].shape
    assert not np.asarray(g_data, np.float32).any() and not np.asarray(g_scales).any()
    assert np.abs(np.asarray(g_w)).max() > 0
    _assert_grads_close((g_w, g_experts), want_grads, ("topk_weights", "experts"))


def _without_dropped_slots(idx, num_experts, num_ranks, num_worst_tokens):
    """idx [R*T, K] with -1 in the slots whose row was dropped: a rank
    receives rows by source rank, then token, and keeps its first
    num_worst_tokens."""
    experts_per_rank = num_experts // num_ranks
    idx = np.array(idx).reshape(num_ranks, -1, idx.shape[-1])
    received = np.zeros(num_ranks, int)
    for s in range(num_ranks):
        for t in range(idx.shape[1]):
            row = idx[s, t]
            for r in sorted({int(e) // experts_per_rank for e in row if 0 <= e < num_experts}):
                received[r] += 1
                if received[r] > num_worst_tokens:
                    row[(row >= 0) & (row // experts_per_rank == r)] = -1
    return idx.reshape(-1, idx.shape[-1])


@pytest.mark.parametrize("kind", ["random", "one_expert"])
def test_grad_with_dropped_rows(kind):
    """Rows dropped past num_worst_tokens contribute nothing forward and get
    no gradient: the gradients equal the dense maths' with those slots -1."""
    num_ranks, num_tokens, num_experts, topk = 4, 12, 16, 3
    num_worst_tokens = 9  # fewer than most ranks receive (one_expert: rank 0 gets all 48)
    idx, w = dt.make_routing(41, num_ranks * num_tokens, num_experts, topk, num_ranks, kind)
    kept = _without_dropped_slots(idx, num_experts, num_ranks, num_worst_tokens)
    assert (kept != idx).any() and (kept >= 0).any()  # some rows dropped, some kept
    x = dt.random_rows(42, (num_ranks * num_tokens, H))
    experts = dt.random_rows(43, (num_experts, H, F), jnp.float32) * 0.3
    probe = dt.random_rows(44, (num_ranks * num_tokens, F), jnp.float32)
    idx, kept, w = jnp.asarray(idx), jnp.asarray(kept), jnp.asarray(w)

    value, grads = _sharded_value_and_grads(num_ranks, num_experts, num_worst_tokens)(x, idx, w, experts, probe)
    want_value, want_grads = _dense_value_and_grads(x, kept, w, experts, probe)
    np.testing.assert_allclose(value, want_value, rtol=2e-2)
    _assert_grads_close(grads, want_grads, ("x", "topk_weights", "experts"))
    # Slots of dropped rows: exactly zero gradient.
    dropped = np.asarray((kept < 0) & (idx >= 0))
    assert (np.asarray(grads[1])[dropped] == 0).all()


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
    g = jax.jit(jax.grad(f))(x, jnp.asarray(idx), jnp.asarray(w))
    assert g.dtype == jnp.bfloat16
    in_ranks = np.zeros((num_ranks * num_tokens,))
    for t, row in enumerate(idx):
        in_ranks[t] = len({e // (num_experts // num_ranks) for e in row if e >= 0})
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.broadcast_to(3 * in_ranks[:, None], g.shape))


def test_remat_policy_keeps_the_communication():
    """jax.checkpoint around a layer re-runs dispatch (its count exchange and rows) in the backward pass; with
    save_only_these_names(*CHECKPOINT_NAMES) it keeps dispatch's and combine's results and exchanges nothing
    again: the gradient's program holds as many all_to_all and all_gather as without remat."""
    import re

    num_ranks, num_tokens, hidden, topk, num_experts = 8, 8, 32, 2, 16
    mesh = dt.ep_mesh(num_ranks, platform="cpu")
    buffer = dej.Buffer(mesh, "ep", backend="xla")
    idx, w = (jnp.asarray(a) for a in dt.make_routing(0, num_ranks * num_tokens, num_experts, topk, num_ranks))
    x = dt.random_rows(1, (num_ranks * num_tokens, hidden))
    kernel = dt.random_rows(2, (num_ranks * hidden, hidden))

    def layer(x, w, kernel, idx):
        recv_x, _, recv_w, handle = dej.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
        y = jnp.tanh((recv_x @ kernel).astype(jnp.float32)) * recv_w.sum(axis=1, keepdims=True)
        return dej.combine(y.astype(jnp.bfloat16), handle, buffer=buffer)

    def collectives(f):
        def grads(x, w, kernel, idx):
            return jax.grad(lambda *a: f(*a, idx).astype(jnp.float32).sum(), argnums=(0, 1, 2))(x, w, kernel)

        text = str(
            jax.make_jaxpr(jax.shard_map(grads, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(x, w, kernel, idx)
        )
        return len(re.findall(r"\ball_to_all\b", text)), len(re.findall(r"\ball_gather\b", text))

    plain = collectives(layer)
    assert all(a > b for a, b in zip(collectives(jax.checkpoint(layer)), plain))  # remat alone re-runs it
    policy = jax.checkpoint_policies.save_only_these_names(*dej.CHECKPOINT_NAMES)
    assert collectives(jax.checkpoint(layer, policy=policy)) == plain
