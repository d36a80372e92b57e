"""Expert-major rows (deep_ep_jax.comm.expert_major) on the xla backend against
tests/oracle.py, bit for bit, on CPU devices, under jit and shard_map with
check_vma=True (shard_map's default)."""

import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import oracle
import pytest

import deep_ep_jax as dej
from deep_ep_jax import _native, fp8_quant
from deep_ep_jax import testing as dt
from deep_ep_jax.backends import reference
from deep_ep_jax.comm import expert_major as em
from deep_ep_jax.experts.grouped_gemm import Fp8Rows, fp8_weights

H = 128
ROUTINGS = ("random", "one_expert", "rank_empty", "minus_one", "out_of_range", "duplicates", "rank_gets_nothing")


def _per_rank(fn, num_ranks):
    return dt.per_rank(fn, dt.ep_mesh(num_ranks, platform="cpu"), "ep", check_vma=True)


def _local_ids(seed, num_ranks, num_tokens, num_local_experts, topk, routing):
    """int32 [R * N, K] local expert ids of each rank's received rows."""
    if routing in ("duplicates", "rank_gets_nothing", "expert_gets_nothing"):
        idx, _ = dt.make_routing(seed, num_ranks * num_tokens, num_local_experts, topk, 1, "minus_one")
        if routing == "duplicates":  # a row naming one expert twice gives two pairs
            idx[::3, 1] = idx[::3, 0]
        elif routing == "expert_gets_nothing":  # an empty group between full ones
            assert num_local_experts > 2
            idx[idx == 1] = -1
        else:
            assert num_ranks > 1, "one rank cannot be the rank that gets nothing"
            idx[num_tokens : 2 * num_tokens] = -1
        return idx
    kind_ranks = 2 if routing == "rank_empty" else 1  # rank_empty: only the first half of the experts
    idx, _ = dt.make_routing(seed, num_ranks * num_tokens, num_local_experts, topk, kind_ranks, routing)
    if routing == "out_of_range":
        assert ((idx < -1) | (idx >= num_local_experts)).any()
    return idx


def _seed(*case):
    """A seed of its own for each test case."""
    return zlib.crc32(repr(case).encode()) % 10_000


def _bits(a):
    """bf16 (or e4m3) values as comparable integers."""
    a = np.asarray(a)
    if a.dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):
        return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8)
    return a


def _rank(tree, r):
    """Rank r's part of per_rank's stacked outputs."""
    return jax.tree.map(lambda a: a[r], tree)


def _bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)


def _check_layout(layout, idx, num_local_experts, alignment, num_rows):
    want = oracle.expert_layout(idx, num_local_experts, alignment, num_rows)
    for name, value in want.items():
        got = getattr(layout, name)
        assert got.dtype == jnp.int32, name
        np.testing.assert_array_equal(got, value, err_msg=name)
    return want


@functools.cache
def _expand_reduce_step(num_ranks, num_local_experts, alignment, rows):
    """The jitted per-rank step of the test below, built once per (alignment, rows): the routings
    (arguments of the step) share its compile."""

    def step(x, idx, w, y_in):
        expert_x, layout = dej.expand(x, idx, num_local_experts=num_local_experts, alignment=alignment, num_rows=rows)
        y = dej.reduce(y_in, w, layout)
        # Unused rows never reach the sum, whatever they hold.
        poisoned = jnp.where((layout.row_pair >= 0)[:, None], y_in, jnp.asarray(jnp.nan, y_in.dtype))
        return expert_x, layout, y, dej.reduce(poisoned, w, layout)

    return _per_rank(step, num_ranks)


@pytest.mark.parametrize("alignment, rows", [(1, None), (8, None), (128, None), (1, 7), (8, 24), (128, 256)])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_expand_reduce_against_oracle(routing, alignment, rows):
    num_ranks, num_tokens, topk, num_local_experts = 4, 24, 4, 8
    seed = _seed(routing, alignment, rows)
    idx = _local_ids(seed, num_ranks, num_tokens, num_local_experts, topk, routing)
    x = dt.random_rows(seed + 1, (num_ranks * num_tokens, H))
    w = np.random.default_rng(seed + 2).random(idx.shape).astype(np.float32) + 0.1
    num_rows = rows or em.default_num_rows(num_tokens, topk, num_local_experts, alignment)
    y_in = dt.random_rows(seed + 3, (num_ranks * num_rows, H))

    run = _expand_reduce_step(num_ranks, num_local_experts, alignment, rows)
    # As numpy: the checks index per rank (indexing a jax array runs a gather op by op).
    expert_x, layout, y, y_poisoned = jax.tree.map(np.asarray, run(x, jnp.asarray(idx), jnp.asarray(w), y_in))
    assert expert_x.shape == (num_ranks, num_rows, H) and expert_x.dtype == jnp.bfloat16
    x, y_in = np.asarray(x).reshape(num_ranks, num_tokens, H), np.asarray(y_in).reshape(num_ranks, num_rows, H)
    idx, w = idx.reshape(num_ranks, num_tokens, topk), w.reshape(num_ranks, num_tokens, topk)
    dropped = 0
    for r in range(num_ranks):
        rank_layout = _rank(layout, r)
        want = _check_layout(rank_layout, idx[r], num_local_experts, alignment, num_rows)
        dropped += want["num_dropped"]
        np.testing.assert_array_equal(_bits(expert_x[r]), _bits(oracle.expert_expand(x[r], want["row_pair"], topk)))
        want_y = oracle.bf16_bits(oracle.expert_reduce(y_in[r], w[r], want["pair_row"]))
        np.testing.assert_array_equal(_bits(y[r]), want_y)
        np.testing.assert_array_equal(_bits(y_poisoned[r]), want_y)
    if rows is None:
        assert dropped == 0
    elif routing == "random":
        assert dropped > 0  # the overflow really happened


def test_expand_fp8_pair():
    """FP8 rows move as they are, data and scales, unused rows 0."""
    num_ranks, num_tokens, topk, num_local_experts, alignment = 2, 16, 3, 5, 4
    idx = _local_ids(3, num_ranks, num_tokens, num_local_experts, topk, "minus_one")
    data, scales = reference.quantize_fp8(dt.random_rows(4, (num_ranks * num_tokens, H)))

    def step(data, scales, idx):
        (expert_data, expert_scales), layout = dej.expand(
            (data, scales), idx, num_local_experts=num_local_experts, alignment=alignment
        )
        return expert_data, expert_scales, layout

    expert_data, expert_scales, layout = _per_rank(step, num_ranks)(data, scales, jnp.asarray(idx))
    assert expert_data.dtype == jnp.float8_e4m3fn and expert_scales.dtype == jnp.float32
    data = np.asarray(data).reshape(num_ranks, num_tokens, H)
    scales = np.asarray(scales).reshape(num_ranks, num_tokens, -1)
    for r in range(num_ranks):
        want = _check_layout(
            _rank(layout, r),
            idx.reshape(num_ranks, num_tokens, topk)[r],
            num_local_experts,
            alignment,
            expert_data.shape[1],
        )
        want_data = oracle.expert_expand(data[r], want["row_pair"], topk)
        np.testing.assert_array_equal(_bits(expert_data[r]), _bits(want_data))
        np.testing.assert_array_equal(expert_scales[r], oracle.expert_expand(scales[r], want["row_pair"], topk))


@functools.cache
def _dispatch_combine_step(num_ranks, num_experts, alignment):
    """The jitted per-rank step of the test below, built once per alignment: the routings (arguments of
    the step) share its compile."""
    buffer = dej.Buffer(dt.ep_mesh(num_ranks, platform="cpu"), "ep", backend="xla")

    def step(x, idx, w):
        expert_x, layout, recv_w, handle = dej.dispatch_expert_major(
            x, idx, w, num_experts=num_experts, buffer=buffer, alignment=alignment
        )
        # Exact in bf16 (XLA may not round a fused bf16 product); unused rows are 1: they must not reach the sum.
        expert_y = jnp.where((layout.row_pair >= 0)[:, None], expert_x * 2, jnp.ones((), expert_x.dtype))
        out = dej.combine_expert_major(expert_y, recv_w, layout, handle, buffer=buffer)
        return expert_y, layout, recv_w, out

    return _per_rank(step, num_ranks)


@pytest.mark.parametrize("routing", ["random", "minus_one", "rank_empty", "rank_gets_nothing", "duplicates"])
@pytest.mark.parametrize("alignment", [1, 8])
def test_dispatch_combine_expert_major_against_oracle(routing, alignment):
    """The whole path: dispatch, expand, an expert, reduce, combine; the expert rows, the received
    weights and the output each against the oracle's."""
    num_ranks, num_tokens, experts_per_rank, topk = 4, 10, 3, 3
    num_experts = num_ranks * experts_per_rank
    seed = _seed(routing, alignment)
    base = "minus_one" if routing in ("duplicates", "rank_gets_nothing") else routing
    idx, w = dt.make_routing(seed, num_ranks * num_tokens, num_experts, topk, num_ranks, base)
    if routing == "duplicates":
        idx[::2, 1] = idx[::2, 0]
    if routing == "rank_gets_nothing":  # no token picks an expert of rank 1
        idx[(idx >= experts_per_rank) & (idx < 2 * experts_per_rank)] = -1
    x = dt.random_rows(seed + 1, (num_ranks * num_tokens, H))

    run = _dispatch_combine_step(num_ranks, num_experts, alignment)
    # As numpy: the checks index per rank (indexing a jax array runs a gather op by op).
    expert_y, layout, recv_w, out = jax.tree.map(np.asarray, run(x, jnp.asarray(idx), jnp.asarray(w)))
    xs = np.asarray(x).reshape(num_ranks, num_tokens, H)
    received = oracle.dispatch(
        xs,
        idx.reshape(num_ranks, num_tokens, topk),
        w.reshape(num_ranks, num_tokens, topk),
        num_experts,
        num_ranks * num_tokens,
    )
    num_worst = num_ranks * num_tokens
    rows = np.zeros((num_ranks, num_worst, H), ml_dtypes.bfloat16)
    for r in range(num_ranks):
        n = len(received[r]["idx"])
        recv_idx = np.full((num_worst, topk), -1, np.int32)
        recv_idx[:n] = np.reshape(received[r]["idx"], (n, topk))
        want = _check_layout(_rank(layout, r), recv_idx, experts_per_rank, alignment, expert_y.shape[1])
        assert want["num_dropped"] == 0
        recv_x = np.zeros((num_worst, H), ml_dtypes.bfloat16)
        want_w = np.zeros((num_worst, topk), np.float32)  # padding rows: weight 0
        if n:
            recv_x[:n], want_w[:n] = received[r]["x"], received[r]["w"]
        np.testing.assert_array_equal(recv_w[r], want_w, err_msg=f"rank {r}: received weights")
        # The step's expert: each used row times 2, unused rows 1.
        doubled = _bf16(oracle.expert_expand(recv_x, want["row_pair"], topk).astype(np.float32) * 2)
        want_y = np.where((want["row_pair"] >= 0)[:, None], doubled, ml_dtypes.bfloat16(1))
        np.testing.assert_array_equal(_bits(expert_y[r]), _bits(want_y), err_msg=f"rank {r}: expert rows")
        reduced = oracle.expert_reduce(want_y, want_w, want["pair_row"])
        rows[r] = oracle.bf16_bits(reduced).view(ml_dtypes.bfloat16)
    if routing == "rank_gets_nothing":
        assert (layout.group_sizes[1] == 0).all()
    want_out = oracle.combine(rows, received, num_tokens).reshape(num_ranks * num_tokens, H)
    np.testing.assert_array_equal(_bits(out).reshape(num_ranks * num_tokens, H), oracle.bf16_bits(want_out))


def test_default_num_rows_never_drops():
    """The default bound holds the worst case: every row names min(K, L)
    distinct experts, all groups misaligned by one."""
    num_tokens, num_local_experts, alignment = 9, 3, 8
    idx = np.tile(np.array([0, 1, 2, -1], np.int32), (num_tokens, 1))
    x = dt.random_rows(0, (num_tokens, H))
    expert_x, layout = jax.jit(
        lambda x, idx: dej.expand(x, idx, num_local_experts=num_local_experts, alignment=alignment)
    )(x, jnp.asarray(idx))
    assert expert_x.shape[0] == num_tokens * 3 + 3 * 7
    assert int(layout.num_dropped) == 0 and (layout.group_sizes == num_tokens).all()
    np.testing.assert_array_equal(layout.group_offsets, [0, 16, 32])


def _loss_parts(seed, num_ranks, num_tokens, topk, num_local_experts, routing):
    idx = _local_ids(seed, num_ranks, num_tokens, num_local_experts, topk, routing)
    x = dt.random_rows(seed + 1, (num_ranks * num_tokens, H))
    w = np.random.default_rng(seed + 2).random(idx.shape).astype(np.float32) + 0.1
    c = dt.random_rows(seed + 3, (num_ranks * num_tokens, H))  # the loss's cotangent
    return idx, x, w, c


@pytest.mark.parametrize(
    "routing, alignment, rows",
    [("random", 1, None), ("minus_one", 8, None), ("duplicates", 128, None), ("random", 8, 32)],
)
def test_gradients_against_oracle(routing, alignment, rows):
    """loss = sum(c * reduce(expand(x) * 2, w)): expand's backward sums each
    pair's row back in k order (bit for bit), reduce's gives bf16(w * dy) per
    row and the dot products for w."""
    num_ranks, num_tokens, topk, num_local_experts = 2, 20, 4, 5
    idx, x, w, c = _loss_parts(11, num_ranks, num_tokens, topk, num_local_experts, routing)
    s = jnp.asarray(2, jnp.bfloat16)  # exact: no rounding for XLA to skip (xla_allow_excess_precision)

    def step(x, idx, w, c):
        def loss(x, w):
            expert_x, layout = dej.expand(
                x, idx, num_local_experts=num_local_experts, alignment=alignment, num_rows=rows
            )
            y = dej.reduce(expert_x * s, w, layout)
            return jnp.sum(y.astype(jnp.float32) * c.astype(jnp.float32)), (expert_x * s, layout)

        (_, (expert_y, layout)), (g_x, g_w) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
        return g_x, g_w, expert_y, layout

    g_x, g_w, expert_y, layout = _per_rank(step, num_ranks)(x, jnp.asarray(idx), jnp.asarray(w), c)
    assert g_x.dtype == jnp.bfloat16 and g_w.dtype == jnp.float32
    c = np.asarray(c, np.float32).reshape(num_ranks, num_tokens, H)
    w = w.reshape(num_ranks, num_tokens, topk)
    dropped = 0
    for r in range(num_ranks):
        pair_row = np.asarray(layout.pair_row[r])
        dropped += int(layout.num_dropped[r])
        # d expert_y row = bf16(w * c[n]) (c is dy here); then d x[n] = the plain sum of its rows' gradients * s.
        g_rows = np.zeros(expert_y.shape[1:], np.float32)
        for n, k in zip(*np.nonzero(pair_row >= 0)):
            g_rows[pair_row[n, k]] = _bf16(np.float32(w[r, n, k]) * c[r, n]).astype(np.float32)
        g_expert_x = g_rows * np.float32(2)  # d (expert_x * s) / d expert_x
        want_x = oracle.expert_reduce(g_expert_x, None, pair_row)
        np.testing.assert_array_equal(_bits(g_x.reshape(num_ranks, num_tokens, H)[r]), oracle.bf16_bits(want_x))
        ey = np.asarray(expert_y[r], np.float64)
        want_w = np.where(pair_row >= 0, np.einsum("nh,nkh->nk", c[r], ey[np.maximum(pair_row, 0)]), 0.0)
        np.testing.assert_allclose(
            np.asarray(g_w).reshape(num_ranks, num_tokens, topk)[r], want_w, rtol=1e-4, atol=1e-3
        )
        assert (np.asarray(g_w).reshape(num_ranks, num_tokens, topk)[r][pair_row < 0] == 0).all()
    assert (dropped > 0) == (rows is not None)


def test_gradients_match_rank_major_formula():
    """Through dispatch_expert_major and combine_expert_major, the gradients
    of x and the weights equal (to rounding) those of the same model written
    on the rank-major rows in plain JAX."""
    num_ranks, num_tokens, experts_per_rank, topk = 4, 16, 4, 4
    num_experts = num_ranks * experts_per_rank
    mesh = dt.ep_mesh(num_ranks, platform="cpu")
    buffer = dej.Buffer(mesh, "ep", backend="xla")
    idx, w = dt.make_routing(21, num_ranks * num_tokens, num_experts, topk, num_ranks, "minus_one")
    x = dt.random_rows(22, (num_ranks * num_tokens, H))
    c = dt.random_rows(23, (num_ranks * num_tokens, H), jnp.float32)
    scale = jnp.linspace(0.5, 2.0, experts_per_rank, dtype=jnp.float32)  # a different "expert" per local id

    def expert_major(x, w, idx):
        expert_x, layout, recv_w, handle = dej.dispatch_expert_major(
            x, idx, w, num_experts=num_experts, buffer=buffer, alignment=8
        )
        group = jnp.searchsorted(layout.group_offsets, jnp.arange(layout.num_rows), side="right") - 1
        expert_y = (expert_x.astype(jnp.float32) * scale[group][:, None]).astype(jnp.bfloat16)
        return dej.combine_expert_major(expert_y, recv_w, layout, handle, buffer=buffer)

    def rank_major(x, w, idx):
        recv_x, recv_idx, recv_w, handle = dej.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
        has = recv_idx >= 0
        terms = [
            (recv_x.astype(jnp.float32) * scale[jnp.maximum(recv_idx[:, k], 0)][:, None]).astype(jnp.bfloat16)
            for k in range(topk)
        ]
        y = sum(
            jnp.where(has[:, k : k + 1], recv_w[:, k : k + 1] * terms[k].astype(jnp.float32), 0.0) for k in range(topk)
        )
        return dej.combine(y.astype(jnp.bfloat16), handle, buffer=buffer)

    def grads(model):
        def step(x, w, idx, c):
            loss = lambda x, w: jnp.sum(model(x, w, idx).astype(jnp.float32) * c)
            return jax.grad(loss, argnums=(0, 1))(x, w)

        return _per_rank(step, num_ranks)(x, jnp.asarray(w), jnp.asarray(idx), c)

    (gx, gw), (want_gx, want_gw) = grads(expert_major), grads(rank_major)
    assert np.abs(np.asarray(want_gx, np.float32)).max() > 0 and np.abs(np.asarray(want_gw)).max() > 0
    np.testing.assert_allclose(np.asarray(gx, np.float32), np.asarray(want_gx, np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(gw, want_gw, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("routing", ["minus_one", "duplicates", "rank_gets_nothing"])
def test_dispatch_backward_is_combine_with_unit_weights(routing):
    """x's gradient through dispatch_expert_major equals combine_expert_major of the rows' gradient
    with weights 1, bit for bit (each token's rows summed in float32 in k order, then sent home): a
    layer that dispatches FP8 rows can take its x gradient this way."""
    num_ranks, num_tokens, experts_per_rank, topk = 4, 10, 3, 3
    num_experts = num_ranks * experts_per_rank
    seed = _seed("unit_weights", routing)
    buffer = dej.Buffer(dt.ep_mesh(num_ranks, platform="cpu"), "ep", backend="xla")
    idx, w = dt.make_routing(seed, num_ranks * num_tokens, num_experts, topk, num_ranks, "minus_one")
    if routing == "duplicates":
        idx[::2, 1] = idx[::2, 0]
    if routing == "rank_gets_nothing":
        idx[(idx >= experts_per_rank) & (idx < 2 * experts_per_rank)] = -1
    x = dt.random_rows(seed + 1, (num_ranks * num_tokens, H))

    def step(x, idx, w, key):
        def rows(x):
            expert_x, layout, recv_w, handle = dej.dispatch_expert_major(
                x, idx, w, num_experts=num_experts, buffer=buffer, alignment=8
            )
            return expert_x, (layout, recv_w, handle)

        expert_x, vjp, (layout, recv_w, handle) = jax.vjp(rows, x, has_aux=True)
        g = jax.random.normal(key[0], expert_x.shape).astype(expert_x.dtype)  # this rank's key
        g = jnp.where((layout.row_pair >= 0)[:, None], g, jnp.zeros((), g.dtype))
        return vjp(g)[0], dej.combine_expert_major(g, jnp.ones_like(recv_w), layout, handle, buffer=buffer)

    keys = jax.random.split(jax.random.key(seed), num_ranks)
    got, want = _per_rank(step, num_ranks)(x, jnp.asarray(idx), jnp.asarray(w), keys)
    assert np.abs(np.asarray(want, np.float32)).max() > 0
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_fp8_rows_carry_no_gradient():
    idx = _local_ids(5, 1, 8, 3, 2, "random")
    data, scales = reference.quantize_fp8(dt.random_rows(6, (8, H)))
    w = jnp.ones(idx.shape, jnp.float32)

    def loss(scales, w):
        (expert_data, expert_scales), layout = dej.expand((data, scales), jnp.asarray(idx), num_local_experts=3)
        y = dej.reduce(expert_data.astype(jnp.bfloat16), w, layout)
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(expert_scales)

    g_scales, g_w = jax.jit(jax.grad(loss, argnums=(0, 1)))(scales, w)
    assert (np.asarray(g_scales) == 0).all() and np.abs(np.asarray(g_w)).max() > 0


def test_fp8_pair_gradients_under_check_vma():
    """An FP8 pair sent by dispatch_expert_major (and expanded alone) under
    shard_map's check_vma: zero cotangents typed as the pair, the weights'
    gradients as without check_vma."""
    num_ranks, num_tokens, num_experts, topk = 4, 8, 8, 2
    mesh = dt.ep_mesh(num_ranks, platform="cpu")
    buffer = dej.Buffer(mesh, "ep", backend="xla", hidden=H, num_experts=num_experts)
    idx, w = dt.make_routing(7, num_ranks * num_tokens, num_experts, topk, num_ranks, "minus_one")
    pair = reference.quantize_fp8(dt.random_rows(8, (num_ranks * num_tokens, H)))

    def layer(data, scales, idx, w):
        (expert_data, expert_scales), layout, recv_w, handle = dej.dispatch_expert_major(
            (data, scales), idx, w, num_experts=num_experts, buffer=buffer
        )
        y = dej.dequantize((expert_data, expert_scales), jnp.float32).astype(jnp.bfloat16)
        out = dej.combine_expert_major(y, recv_w, layout, handle, buffer=buffer)
        (local_data, _), local = dej.expand((data, scales), jnp.where(idx < 2, idx, -1), num_local_experts=2)
        return out, dej.reduce(local_data.astype(jnp.bfloat16), w, local)

    def grads(check_vma):
        f = dt.per_rank(layer, mesh, "ep", check_vma=check_vma)
        loss = lambda *a: sum(jnp.sum(o.astype(jnp.float32)) for o in f(*a))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 3)))(*pair, jnp.asarray(idx), jnp.asarray(w))

    (g_data, g_scales, g_w), want = grads(True), grads(False)
    assert g_data.dtype == jnp.float8_e4m3fn and not np.asarray(g_data, np.float32).any()
    assert not np.asarray(g_scales).any() and np.abs(np.asarray(g_w)).max() > 0
    np.testing.assert_array_equal(np.asarray(g_w), np.asarray(want[2]))


def _fp8_rows_layer(buffer, num_experts, alignment, num_rows, fp8_rows, weight_grad):
    """One rank's layer on FP8 matmuls: dispatch_expert_major (rows sent as FP8 with fp8_rows, or bf16 and
    quantized inside grouped_matmul), a grouped matmul per local expert, combine_expert_major; with buffer
    None, expand and reduce alone (the rows local)."""

    def layer(x, idx, w, w_e):
        w8 = fp8_weights(w_e, weight_grad=weight_grad)
        if buffer is None:
            expert_x, layout = dej.expand(
                x, idx, num_local_experts=w_e.shape[0], alignment=alignment, num_rows=num_rows, fp8_rows=fp8_rows
            )
        else:
            expert_x, layout, w, handle = dej.dispatch_expert_major(
                x,
                idx,
                w,
                num_experts=num_experts,
                buffer=buffer,
                alignment=alignment,
                num_rows=num_rows,
                fp8_rows=fp8_rows,
            )
        expert_y = dej.grouped_matmul(
            expert_x,
            w_e,
            layout.padded_group_sizes(alignment),
            backend="xla",
            valid_sizes=layout.group_sizes,
            fp8_weights=w8,
        )
        y = dej.reduce(expert_y, w, layout)
        return (y if buffer is None else dej.combine(y, handle, buffer=buffer)), expert_x

    return layer


@functools.cache
def _fp8_rows_buffer(num_ranks):
    return dej.Buffer(dt.ep_mesh(num_ranks, platform="cpu"), "ep", backend="xla")


@functools.cache
def _fp8_rows_step(local, num_ranks, num_experts, rows, fp8_rows, weight_grad):
    """The jitted per-rank step of the test below: the layer's output, its expert rows and gradients. Built
    once per configuration, so that routings of one configuration share its compile (the routing is an
    argument of the step, not a constant)."""
    layer = _fp8_rows_layer(None if local else _fp8_rows_buffer(num_ranks), num_experts, 8, rows, fp8_rows, weight_grad)

    def step(x, idx, w, w_e, c):
        loss = lambda x, w, w_e: jnp.sum(layer(x, idx, w, w_e)[0].astype(jnp.float32) * c)
        y, expert_x = layer(x, idx, w, w_e)
        # x's gradient alone too (the weights constant): the same rows' gradient, sent back alone.
        return y, expert_x, jax.grad(loss, argnums=(0, 1, 2))(x, w, w_e), jax.grad(loss)(x, w, w_e)

    return _per_rank(step, num_ranks)


# quantize_rows jitted: one compile per shape, not one per op of each call run eagerly.
_quantize_rows_xla = jax.jit(functools.partial(fp8_quant.quantize_rows, backend="xla"))


@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize(
    "routing, rows, weight_grad",
    [("minus_one", None, True), ("duplicates", None, False), ("rank_gets_nothing", None, True), ("random", 24, True)],
)
def test_fp8_rows_match_rows_quantized_in_the_matmul(local, routing, rows, weight_grad):
    """Rows sent (or expanded) as FP8 (fp8_rows=True) are quantize_rows of the bf16 expert rows, bit for
    bit, and the layer's output and its gradients for x, the weights and the experts are those of bf16
    rows quantized inside grouped_matmul, bit for bit (dw from the dequantized rows without the FP8
    weight gradient: close); with -1 entries, duplicate ids, a rank that gets nothing (no row of its own, or
    none sent to it) and pairs dropped (random routing, rows=24)."""
    num_ranks, num_tokens, experts_per_rank, topk, n_out = 4, 10, 3, 3, 64
    num_experts = num_ranks * experts_per_rank
    seed = _seed("fp8_rows", local, routing, rows)
    kind = "random" if routing == "random" else "minus_one"
    idx, w = dt.make_routing(seed, num_ranks * num_tokens, num_experts, topk, num_ranks, kind)
    if routing == "duplicates":
        idx[::2, 1] = idx[::2, 0]
    if local:  # every rank's own rows on its local experts
        idx = np.where(idx >= 0, idx % experts_per_rank, -1).astype(np.int32)
    if routing == "rank_gets_nothing":
        if local:  # rank 1's rows name no expert
            idx[num_tokens : 2 * num_tokens] = -1
        else:  # no row names an expert of rank 1
            idx[idx // experts_per_rank == 1] = -1
    # Pairs per (rank, local expert), each group padded to 8 rows: past `rows` on a rank, some are dropped.
    valid = idx >= 0
    owner = np.broadcast_to(np.arange(len(idx))[:, None] // num_tokens, idx.shape) if local else idx // experts_per_rank
    pairs = np.zeros((num_ranks, experts_per_rank), np.int64)
    np.add.at(pairs, (owner[valid], idx[valid] % experts_per_rank), 1)
    needed = (-(-pairs // 8) * 8).sum(axis=1)
    assert routing != "rank_gets_nothing" or needed[1] == 0, needed
    assert rows is None or needed.max() > rows, needed
    x = dt.random_rows(seed + 1, (num_ranks * num_tokens, H))
    w_e = dt.random_rows(seed + 2, (num_ranks * experts_per_rank, H, n_out)) * 0.1
    c = dt.random_rows(seed + 3, (num_ranks * num_tokens, n_out), jnp.float32)  # the loss's cotangent

    def run(fp8_rows):
        step = _fp8_rows_step(local, num_ranks, num_experts, rows, fp8_rows, weight_grad)
        return step(x, jnp.asarray(idx), jnp.asarray(w), w_e, c)

    (y8, rows8, grads8, g_x8), (y, rows_bf16, grads, g_x) = run(True), run(False)
    assert isinstance(rows8, Fp8Rows)
    for r in range(num_ranks):
        data, scales = _quantize_rows_xla(rows_bf16[r])
        used = np.abs(np.asarray(rows_bf16[r], np.float32)).max(axis=1) > 0
        np.testing.assert_array_equal(_bits(rows8.data[r])[used], _bits(data)[used])
        np.testing.assert_array_equal(np.asarray(rows8.scales[r])[used], np.asarray(scales)[used])
        assert (_bits(rows8.data[r])[~used] == 0).all() and (np.asarray(rows8.scales[r])[~used] == 0).all()
        np.testing.assert_array_equal(_bits(rows8.data_t[r]), _bits(rows8.data[r]).T)  # the weight gradient's
    assert np.abs(np.asarray(y, np.float32)).max() > 0
    np.testing.assert_array_equal(_bits(y8), _bits(y))
    for name, a, b in zip(("x", "weights", "x alone"), (*grads8[:2], g_x8), (*grads[:2], grads[0])):
        assert np.abs(np.asarray(b, np.float32)).max() > 0, name
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"gradient of {name}")
    np.testing.assert_array_equal(_bits(g_x), _bits(grads[0]))
    if weight_grad:
        np.testing.assert_array_equal(_bits(grads8[2]), _bits(grads[2]))
    else:
        a, b = np.asarray(grads8[2], np.float32), np.asarray(grads[2], np.float32)
        assert np.linalg.norm(a - b) <= 0.1 * np.linalg.norm(b) and not np.array_equal(a, b)


def test_fp8_rows_without_data_t():
    """An Fp8Rows without data_t (the matmul then transposes data itself) gives the same output and
    gradients, bit for bit, as expand's, whose data_t the FP8 weight gradient reads."""
    idx = jnp.asarray(_local_ids(11, 1, 12, 3, 2, "minus_one"))
    x = dt.random_rows(12, (12, H))
    w_e = dt.random_rows(13, (3, H, 64)) * 0.1

    def loss(x, w_e, keep_t):
        rows, layout = dej.expand(x, idx, num_local_experts=3, alignment=8, fp8_rows=True)
        assert rows.data_t is not None
        rows = rows if keep_t else Fp8Rows(rows.data, rows.scales, rows.grad_sink)
        y = dej.grouped_matmul(
            rows,
            w_e,
            layout.padded_group_sizes(8),
            backend="xla",
            valid_sizes=layout.group_sizes,
            fp8_weights=fp8_weights(w_e, weight_grad=True),
        )
        return jnp.sum(y.astype(jnp.float32) ** 2)

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    with_t, without_t = run(x, w_e, True), run(x, w_e, False)
    for a, b in zip(jax.tree.leaves(with_t), jax.tree.leaves(without_t)):
        assert np.abs(np.asarray(a, np.float32)).max() > 0
        np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("routing", ["minus_one", "one_expert", "expert_gets_nothing"])
def test_expand_rows_transposed_quantized(routing):
    """The xla backend's expand_rows_transposed of bf16 rows (the fused FP8 weight gradient's operand)
    against the numpy oracle, bit for bit: token rows gathered, times their row's multiplier (some 0,
    whose rows must come out 0 even where the token row holds NaN) and the column's inverse scale,
    saturated to +-448 where a few columns' scales are too small."""
    from deep_ep_jax.backends import reference_expert_major

    seed = _seed("quantized_t", routing)
    rng = np.random.default_rng(seed)
    idx = jnp.asarray(_local_ids(seed, 1, 40, 3, 2, routing))
    layout = jax.jit(  # jitted, here and below: one compile, not one per op
        functools.partial(reference_expert_major.expert_layout, num_local_experts=3, alignment=8, num_rows=104)
    )(idx)
    x = np.asarray(dt.random_rows(seed + 1, (40, 2 * H)), np.float32)
    m = rng.random(104).astype(np.float32) * np.where(rng.random(104) < 0.2, 0.0, 1.0).astype(np.float32)
    row_pair = np.asarray(layout.row_pair)
    zero_tokens = [p // 2 for p, mm in zip(row_pair, m) if p >= 0 and mm == 0]
    only_zero = [n for n in zero_tokens if all(mm == 0 for p, mm in zip(row_pair, m) if p >= 0 and p // 2 == n)]
    x[only_zero, 3] = np.nan  # read by no row with a multiplier
    inverse = (rng.random(2 * H) * 300 + 1).astype(np.float32)
    inverse[:4] = 1e6  # saturates
    got = jax.jit(reference_expert_major.expand_rows_transposed)(
        jnp.asarray(x, jnp.bfloat16), layout, jnp.asarray(m), jnp.asarray(inverse)
    )
    assert got.dtype == jnp.float8_e4m3fn and got.shape == (2 * H, 104)
    want = oracle.expert_expand_quantized_t(
        np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), row_pair, 2, m, inverse
    )
    np.testing.assert_array_equal(_bits(got), _bits(want.astype(ml_dtypes.float8_e4m3fn)))
    assert (np.abs(np.asarray(got, np.float32)) == 448).any() and (np.asarray(got, np.float32) != 0).any()


def test_column_scales_from_token_rows():
    """fp8_quant.column_scales of token rows with each token's largest |multiplier| equals the column
    scales quantize_rows_and_columns finds on the rows gathered with their own multipliers, bit for bit."""
    seed = _seed("column_scales")
    rng = np.random.default_rng(seed)
    idx = jnp.asarray(_local_ids(seed, 1, 24, 3, 2, "minus_one"))
    g = dt.random_rows(seed + 1, (24, H))
    m = jnp.asarray(rng.standard_normal(64).astype(np.float32))

    @jax.jit
    def both(g, m):
        _, layout = dej.expand(g, idx, num_local_experts=3, alignment=8, num_rows=64)
        m = jnp.where(layout.row_pair >= 0, m, 0.0)
        gathered = em._XLA.expand_rows((g,), layout)[0]
        want = fp8_quant.quantize_rows_and_columns(gathered[None], m[None], backend="xla")[3][0]
        has = layout.pair_row >= 0
        token_m = jnp.max(jnp.where(has, jnp.abs(m)[jnp.where(has, layout.pair_row, 0)], 0.0), axis=1)
        return want, *fp8_quant.column_scales(g, token_m)

    want, scales, inverse = both(g, m)
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(inverse), np.float32(1) / np.asarray(want))


def _matmul_reduce_grads(fused, fp8, weight_grad, routing, exact=False):
    """Output and gradients (rows, expert weights, pair weights) of expand, a grouped matmul and reduce
    on one rank: grouped_matmul_reduce (fused) or the two calls; fp8: with FP8 matmuls; exact: the two
    calls, the matmul in float32 on the bf16 values."""
    seed = _seed("matmul_reduce", routing)
    idx = jnp.asarray(_local_ids(seed, 1, 48, 3, 3, routing))
    x = dt.random_rows(seed + 1, (48, H))
    w_e = dt.random_rows(seed + 2, (3, H, 2 * H)) * 0.1
    w = jnp.asarray(np.random.default_rng(seed).random((48, 3)).astype(np.float32))
    c = dt.random_rows(seed + 3, (48, 2 * H), jnp.float32)
    return _matmul_reduce_fn(fused, fp8, weight_grad, exact)(x, w_e, w, idx, c)


@functools.cache
def _matmul_reduce_fn(fused, fp8, weight_grad, exact):
    """_matmul_reduce_grads' jitted function, built once per configuration: the routings share its compile
    (idx and the loss's cotangent c are arguments, not constants of the trace)."""

    def layer(x, w_e, w, idx):
        expert_x, layout = dej.expand(x, idx, num_local_experts=3, alignment=8)
        kwargs = dict(valid_sizes=layout.group_sizes)
        if fp8:
            kwargs["fp8_weights"] = fp8_weights(w_e, weight_grad=weight_grad)
        if exact:
            expert_x, w_e = expert_x.astype(jnp.float32), w_e.astype(jnp.float32)
        sizes = layout.padded_group_sizes(8)
        if fused:
            return dej.grouped_matmul_reduce(expert_x, w_e, sizes, w, layout, matmul_backend="xla", **kwargs)
        y = dej.grouped_matmul(expert_x, w_e, sizes, backend="xla", **kwargs)
        return dej.reduce(y.astype(jnp.bfloat16), w, layout)

    def f(x, w_e, w, idx, c):
        loss = lambda x, w_e, w: jnp.sum(layer(x, w_e, w, idx).astype(jnp.float32) * c)
        return layer(x, w_e, w, idx), jax.grad(loss, argnums=(0, 1, 2))(x, w_e, w)

    return jax.jit(f)


@pytest.mark.parametrize("routing", ["minus_one", "one_expert", "expert_gets_nothing"])
def test_grouped_matmul_reduce(routing):
    """grouped_matmul_reduce's output and pair weights' gradient equal reduce(grouped_matmul(...))'s bit
    for bit. With FP8 weight gradients (its own backward: the token rows' gradient quantized once and
    gathered) the rows' and experts' gradients are as close to float32 maths as the two calls' (each
    within 6% of it); otherwise all equal bit for bit."""
    exact = _matmul_reduce_grads(False, False, False, routing, exact=True)[1]
    for weight_grad in (True, False):
        (y, grads), (y2, grads2) = (_matmul_reduce_grads(fused, True, weight_grad, routing) for fused in (True, False))
        assert np.abs(np.asarray(y, np.float32)).max() > 0
        np.testing.assert_array_equal(_bits(y), _bits(y2))
        np.testing.assert_array_equal(np.asarray(grads[2]), np.asarray(grads2[2]))
        for name, a, b, e in zip(("rows", "experts"), grads[:2], grads2[:2], exact[:2]):
            a, b, e = (np.asarray(v, np.float32) for v in (a, b, e))
            if not weight_grad:
                np.testing.assert_array_equal(a, b, err_msg=name)
                continue
            error, error2 = np.linalg.norm(a - e) / np.linalg.norm(e), np.linalg.norm(b - e) / np.linalg.norm(e)
            assert 0 < error < 0.06 and error < 1.25 * error2, (name, error, error2)
    (y, grads), (y2, grads2) = (_matmul_reduce_grads(fused, False, False, routing) for fused in (True, False))
    for a, b in zip(jax.tree.leaves((y, grads)), jax.tree.leaves((y2, grads2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_grouped_matmul_reduce_errors():
    x = jnp.zeros((6, H), jnp.bfloat16)
    idx = jnp.zeros((6, 2), jnp.int32)
    rows, layout = jax.jit(lambda x, idx: dej.expand(x, idx, num_local_experts=2))(x, idx)  # compiled once
    w_e = jnp.zeros((2, H, H), jnp.bfloat16)
    w8 = jax.eval_shape(lambda w_e: fp8_weights(w_e, weight_grad=True), w_e)  # refused before it is read
    w = jnp.ones((6, 2), jnp.float32)
    sizes = layout.padded_group_sizes(1)
    with pytest.raises(TypeError, match=r"grouped_matmul_reduce: unknown grouped_matmul arguments \['alignment'\]"):
        dej.grouped_matmul_reduce(rows, w_e, sizes, w, layout, fp8_weights=w8, alignment=8)
    with pytest.raises(TypeError, match=r"grouped_matmul_reduce: recv_topk_weights must be float32 \(6, 2\)"):
        dej.grouped_matmul_reduce(rows, w_e, sizes, w[:3], layout, fp8_weights=w8)
    with pytest.raises(ValueError, match=r"grouped_matmul_reduce: expert_y must have the layout's 12 rows, got 11"):
        dej.grouped_matmul_reduce(rows[:11], w_e, sizes, w, layout, fp8_weights=w8)
    with pytest.raises(TypeError, match="grouped_matmul_reduce: layout must be the ExpertLayout"):
        dej.grouped_matmul_reduce(rows, w_e, sizes, w, None, fp8_weights=w8)
    with pytest.raises(ValueError, match="grouped_matmul: x and w must have the same floating dtype"):
        dej.grouped_matmul_reduce(rows, w_e.astype(jnp.float32), sizes, w, layout, fp8_weights=w8)


def test_fp8_rows_errors():
    x = jnp.zeros((6, H), jnp.bfloat16)
    idx = jnp.zeros((6, 2), jnp.int32)
    pair = (x.astype(jnp.float8_e4m3fn), jnp.ones((6, 1), jnp.float32))
    with pytest.raises(TypeError, match="expand: fp8_rows=True quantizes bf16 recv_x itself"):
        dej.expand(pair, idx, num_local_experts=2, fp8_rows=True)
    with pytest.raises(TypeError, match="expand: recv_x must be bfloat16"):
        dej.expand(x.astype(jnp.float32), idx, num_local_experts=2, fp8_rows=True)
    with pytest.raises(ValueError, match="expand: fp8_rows=True needs hidden a multiple of 128"):
        dej.expand(x[:, :96], idx, num_local_experts=2, fp8_rows=True)
    # Compiled once each (op by op, the quantizations would compile every op on its own).
    rows, layout = jax.jit(lambda x, idx: dej.expand(x, idx, num_local_experts=2, fp8_rows=True))(x, idx)
    w_e = jnp.zeros((2, H, 64), jnp.bfloat16)
    w8 = jax.jit(fp8_weights)(w_e)
    sizes = layout.padded_group_sizes(1)
    with pytest.raises(TypeError, match="x given as Fp8Rows needs fp8_weights"):
        dej.grouped_matmul(rows, w_e, sizes)
    bad = Fp8Rows(rows.data, rows.scales[:-1], rows.grad_sink)
    with pytest.raises(ValueError, match=r"x.scales must be float32 \(12,\)"):
        dej.grouped_matmul(bad, w_e, sizes, fp8_weights=w8)
    bad = Fp8Rows(rows.data, rows.scales, rows.grad_sink, rows.data)
    with pytest.raises(ValueError, match=r"x.data_t must be float8_e4m3fn \(128, 12\)"):
        dej.grouped_matmul(bad, w_e, sizes, fp8_weights=w8)


def test_outside_shard_map_and_auto_backend():
    """expand and reduce are local: plain jit works, and 'auto' on CPU is the xla backend."""
    idx = _local_ids(8, 1, 12, 3, 2, "minus_one")
    x = dt.random_rows(9, (12, H))
    w = jnp.full(idx.shape, 0.5, jnp.float32)

    def run(backend):
        def fn(x, idx):
            expert_x, layout = dej.expand(x, idx, num_local_experts=3, alignment=4, backend=backend)
            return dej.reduce(expert_x, w, layout, backend=backend)

        lowered = jax.jit(fn).lower(x, jnp.asarray(idx))
        assert "deep_ep_jax" not in lowered.as_text()
        return lowered.compile()(x, jnp.asarray(idx))

    layout = oracle.expert_layout(idx, 3, 4, 12 * 2 + 3 * 3)
    expert_x = oracle.expert_expand(np.asarray(x), layout["row_pair"], 2)
    want = oracle.expert_reduce(expert_x, np.asarray(w), layout["pair_row"])
    np.testing.assert_array_equal(_bits(run("auto")), oracle.bf16_bits(want))
    np.testing.assert_array_equal(_bits(run("xla")), oracle.bf16_bits(want))


@pytest.mark.extension
def test_cuda_branch_traces_on_cpu(monkeypatch):
    """With the kernels 'available', 'auto' traces the CUDA calls beside the
    pure-JAX ones (lax.platform_dependent) under check_vma=True, gradients
    included, and the CPU program runs the pure-JAX branch."""
    from deep_ep_jax.backends.cuda import lifecycle

    monkeypatch.setattr(em._native, "unavailable_reason", lambda: None)
    monkeypatch.setattr(lifecycle, "register_ffi_targets", lambda: None)
    em._cuda_ops.cache_clear()
    try:
        num_ranks, num_tokens, topk, num_local_experts = 2, 12, 3, 4
        idx, x, w, c = _loss_parts(13, num_ranks, num_tokens, topk, num_local_experts, "minus_one")

        def step(backend):
            def fn(x, idx, w, c):
                def loss(x, w):
                    expert_x, layout = dej.expand(
                        x, idx, num_local_experts=num_local_experts, alignment=8, backend=backend
                    )
                    y = dej.reduce(expert_x, w, layout, backend=backend)
                    return jnp.sum(y.astype(jnp.float32) * c.astype(jnp.float32)), (expert_x, layout)

                return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)

            return _per_rank(fn, num_ranks)

        args = (x, jnp.asarray(idx), jnp.asarray(w), c)
        text = step("auto").lower(*args).as_text()
        assert "deep_ep_jax" not in text  # lowered for CPU: the CUDA branch is gone
        got, want = step("auto")(*args), step("xla")(*args)
        for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(_bits(g), _bits(v))
        # The CUDA functions alone give the types of the pure-JAX ones.
        from deep_ep_jax.backends import reference_expert_major as ref
        from deep_ep_jax.backends.cuda import expert_major as cuda

        local_idx = jnp.asarray(idx[:num_tokens])
        kw = {"num_local_experts": num_local_experts, "alignment": 8, "num_rows": 40}
        layouts = [jax.eval_shape(lambda i, m=m: m.expert_layout(i, **kw), local_idx) for m in (cuda, ref)]
        assert layouts[0] == layouts[1]
        for m in (cuda, ref):
            rows = jax.eval_shape(m.expand_rows, (x[:num_tokens],), layouts[0])
            assert rows == (jax.ShapeDtypeStruct((40, H), jnp.bfloat16),)
            out = jax.eval_shape(
                m.reduce_rows, rows[0], jax.ShapeDtypeStruct(idx[:num_tokens].shape, jnp.float32), layouts[0]
            )
            assert out == jax.ShapeDtypeStruct((num_tokens, H), jnp.bfloat16)
    finally:
        em._cuda_ops.cache_clear()


@pytest.mark.extension
def test_cuda_path_lowers_under_check_vma(monkeypatch):
    """The whole path on the CUDA backend, gradients included, traced and
    lowered on CPU with a stand-in CUDA Buffer (never run): the kernels'
    calls are all there, with the expected operands and attributes."""
    import re

    from deep_ep_jax.backends import Ops
    from deep_ep_jax.backends.cuda import intranode, layout, lifecycle, low_latency

    monkeypatch.setattr(em._native, "unavailable_reason", lambda: None)
    monkeypatch.setattr(lifecycle, "register_ffi_targets", lambda: None)
    num_ranks, num_tokens, experts_per_rank, topk = 2, 8, 4, 2
    num_experts = num_ranks * experts_per_rank
    buffer = dej.Buffer(dt.ep_mesh(num_ranks, platform="cpu"), "ep", backend="xla")
    buffer.backend, buffer.buffer_id = "cuda", 7
    buffer.ops = Ops.of(layout, intranode, low_latency)
    idx, w = dt.make_routing(1, num_ranks * num_tokens, num_experts, topk, num_ranks, "minus_one")
    x = dt.random_rows(2, (num_ranks * num_tokens, H))

    def loss(x, w, idx):
        expert_x, layout_, recv_w, handle = dej.dispatch_expert_major(
            x, idx, w, num_experts=num_experts, buffer=buffer, alignment=8
        )
        out = dej.combine_expert_major(expert_x * 2, recv_w, layout_, handle, buffer=buffer)
        return jnp.sum(out.astype(jnp.float32))

    def step(x, w, idx):
        return jax.grad(loss, argnums=(0, 1))(x, w, idx)

    text = _per_rank(step, num_ranks).lower(x, jnp.asarray(w), jnp.asarray(idx)).as_text()
    calls = re.findall(r"stablehlo\.custom_call @(deep_ep_jax_\w+)\(([^)]*)\)(.*)", text)
    names = [name for name, _, _ in calls]
    for name, count in (
        ("deep_ep_jax_expert_layout", 1),
        ("deep_ep_jax_expand_rows", 1),
        ("deep_ep_jax_reduce_rows", 2),
    ):  # reduce: forward, and expand's backward
        assert names.count(name) == count, names
    attrs = {name: rest for name, _, rest in calls}
    assert re.search(r"alignment = 8 : i64", attrs["deep_ep_jax_expert_layout"])
    assert re.search(r"num_topk = 2 : i64", attrs["deep_ep_jax_expand_rows"])

    # FP8 pairs: data and scales both through the expand target.
    data, scales = reference.quantize_fp8(x)

    def fp8_step(data, scales, idx):
        return dej.expand((data, scales), idx, num_local_experts=experts_per_rank, backend="cuda")

    text = _per_rank(fp8_step, num_ranks).lower(data, scales, jnp.asarray(idx % experts_per_rank)).as_text()
    assert re.search(r"deep_ep_jax_expand_rows.*-> \(tensor<\d+x128xf8E4M3FN>, tensor<\d+x1xf32>\)", text)

    # fp8_rows: the transposed FP8 rows from their own target ([H, rows]), dropped where nothing reads them.
    def rows_step(x, idx, read_t):
        rows, _ = dej.expand(x, idx, num_local_experts=experts_per_rank, backend="cuda", fp8_rows=True)
        return rows.data_t if read_t else rows.data

    for read_t in (True, False):
        lowered = _per_rank(functools.partial(rows_step, read_t=read_t), num_ranks).lower(
            x, jnp.asarray(idx % experts_per_rank)
        )
        pattern = r"deep_ep_jax_expand_rows_transposed.*num_topk = 2 : i64.*-> tensor<128x\d+xf8E4M3FN>"
        assert bool(re.search(pattern, lowered.as_text())) == read_t

    # grouped_matmul_reduce with FP8 weight gradients: its backward quantizes and gathers the token rows'
    # bf16 gradient (transposed, with a multiplier per row and an inverse scale per column).
    w_e = dt.random_rows(3, (experts_per_rank, H, H)) * 0.1

    def fused_step(x, w, idx):
        def loss(x, w_e, w):
            rows, layout_ = dej.expand(x, idx, num_local_experts=experts_per_rank, alignment=8, backend="cuda")
            y = dej.grouped_matmul_reduce(
                rows,
                w_e,
                layout_.padded_group_sizes(8),
                w,
                layout_,
                backend="cuda",
                fp8_weights=fp8_weights(w_e, weight_grad=True),
            )
            return jnp.sum(y.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(x, w_e, w)

    text = _per_rank(fused_step, num_ranks).lower(x, jnp.asarray(w), jnp.asarray(idx % experts_per_rank)).as_text()
    pattern = (
        r"deep_ep_jax_expand_rows_transposed\([^)]*\).*num_topk = 2 : i64.*"
        r"\(tensor<\d+x128xbf16>, tensor<\d+xi32>, tensor<\d+xf32>, tensor<128xf32>\) -> tensor<128x\d+xf8E4M3FN>"
    )
    assert re.search(pattern, text), "the fused backward's quantized transposed expansion"


def test_trace_time_errors():
    x = jnp.zeros((6, H), jnp.bfloat16)
    idx = jnp.zeros((6, 2), jnp.int32)
    expand = lambda *a, **k: dej.expand(*a, **{"num_local_experts": 4, **k})
    for alignment in (0, -8, 1.5, True, "8"):
        with pytest.raises(ValueError, match=r"expand: alignment must be an int in \[1, "):
            expand(x, idx, alignment=alignment)
    for num_local_experts in (0, 2.0, None):
        with pytest.raises(ValueError, match="expand: num_local_experts must be an int"):
            dej.expand(x, idx, num_local_experts=num_local_experts)
    with pytest.raises(ValueError, match="expand: num_rows must be an int"):
        expand(x, idx, num_rows=0)
    with pytest.raises(
        ValueError,
        match=r"expand: num_rows \(10\) must be a multiple of alignment \(4\), so every "
        r"group ends on it; use 12 or 8$",
    ):
        expand(x, idx, alignment=4, num_rows=10)
    with pytest.raises(TypeError, match="expand: recv_x must be bfloat16"):
        expand(x.astype(jnp.float32), idx)
    with pytest.raises(ValueError, match=r"expand: recv_x must be \[tokens, hidden\]"):
        expand(x[0], idx)
    with pytest.raises(TypeError, match="FP8 scales recv_x"):
        expand((x.astype(jnp.float8_e4m3fn), jnp.zeros((6, 2), jnp.float32)), idx)
    for bad_idx in (idx.astype(jnp.int16), idx.astype(jnp.float32), idx[:, 0], idx[:5], idx[:, :0]):
        with pytest.raises(TypeError, match=r"expand: recv_topk_idx must be int32 \[6, topk\]"):
            expand(x, bad_idx)
    with pytest.raises(ValueError, match="int32 rows"):
        expand(x, idx, alignment=2**30)
    with pytest.raises(ValueError, match="backend must be one of"):
        expand(x, idx, backend="tpu")
    if _native.unavailable_reason() is not None:
        with pytest.raises(RuntimeError, match="expand: backend 'cuda' is not available"):
            expand(x, idx, backend="cuda")

    for fp8_rows in ("no", 0):
        with pytest.raises(TypeError, match="^expand: fp8_rows must be a bool"):
            expand(x, idx, fp8_rows=fp8_rows)

    expert_x, layout = jax.jit(lambda x, idx: expand(x, idx, alignment=2))(x, idx)  # compiled once, not op by op
    for alignment in (0, -2, 2.0):
        with pytest.raises(ValueError, match=r"^ExpertLayout.padded_group_sizes: alignment must be an int >= 1"):
            layout.padded_group_sizes(alignment)
    for alignment in (1, 4):
        with pytest.raises(
            ValueError,
            match=rf"^ExpertLayout.padded_group_sizes: alignment {alignment} is not the "
            r"layout's \(2\)",
        ):
            layout.padded_group_sizes(alignment)
    assert layout.alignment == 2
    np.testing.assert_array_equal(layout.padded_group_sizes(), layout.padded_group_sizes(2))
    w = jnp.ones((6, 2), jnp.float32)
    with pytest.raises(ValueError, match=f"reduce: expert_y must have the layout's {layout.num_rows} rows"):
        dej.reduce(expert_x[1:], w, layout)
    with pytest.raises(TypeError, match="reduce: expert_y must be bfloat16"):
        dej.reduce(expert_x.astype(jnp.float32), w, layout)
    with pytest.raises(TypeError, match="reduce: expert_y must be one array"):
        dej.reduce((expert_x, expert_x), w, layout)
    for bad_w in (w.astype(jnp.bfloat16), w[:, :1], w[:5]):
        with pytest.raises(TypeError, match=r"reduce: recv_topk_weights must be float32 \(6, 2\)"):
            dej.reduce(expert_x, bad_w, layout)
    with pytest.raises(TypeError, match="reduce: layout must be the ExpertLayout"):
        dej.reduce(expert_x, w, layout.pair_row)


def test_wrapper_errors():
    num_ranks, num_tokens, experts_per_rank, topk = 2, 6, 3, 2
    num_experts = num_ranks * experts_per_rank
    mesh = dt.ep_mesh(num_ranks, platform="cpu")
    buffer = dej.Buffer(mesh, "ep", backend="xla")
    idx, w = dt.make_routing(0, num_ranks * num_tokens, num_experts, topk, num_ranks)
    x = dt.random_rows(1, (num_ranks * num_tokens, H))

    def run(fn):
        return _per_rank(fn, num_ranks)(x, jnp.asarray(idx), jnp.asarray(w))

    def other_layout(x, idx, w):  # a layout of another number of local experts than the handle's
        expert_x, layout, recv_w, handle = dej.dispatch_expert_major(x, idx, w, num_experts=num_experts, buffer=buffer)
        _, wrong = dej.expand(
            expert_x[: handle.num_worst_tokens],
            jnp.zeros_like(recv_w, jnp.int32),
            num_local_experts=experts_per_rank + 1,
            num_rows=layout.num_rows,
        )
        return dej.combine_expert_major(expert_x, recv_w, wrong, handle, buffer=buffer)

    with pytest.raises(
        ValueError, match="combine_expert_major: layout is for 4 local experts and 12 rows, the handle for 3 and 12"
    ):
        run(other_layout)

    def not_a_handle(x, idx, w):
        expert_x, layout, recv_w, _ = dej.dispatch_expert_major(x, idx, w, num_experts=num_experts, buffer=buffer)
        return dej.combine_expert_major(expert_x, recv_w, layout, layout, buffer=buffer)

    with pytest.raises(TypeError, match="combine_expert_major: handle must be the DispatchHandle"):
        run(not_a_handle)

    def bad_alignment(x, idx, w):
        return dej.dispatch_expert_major(x, idx, w, num_experts=num_experts, buffer=buffer, alignment=0)

    with pytest.raises(ValueError, match=r"dispatch_expert_major: alignment must be an int in \[1, "):
        run(bad_alignment)

    def bad_routing(x, idx, w):  # dispatch's own checks name the function the user called
        return dej.dispatch_expert_major(x, idx.astype(jnp.float32), w, num_experts=num_experts, buffer=buffer)

    with pytest.raises(TypeError, match="^dispatch_expert_major: topk_idx must be int32, got float32"):
        run(bad_routing)

    def no_weights(x, idx, w):
        return dej.dispatch_expert_major(x, idx, None, num_experts=num_experts, buffer=buffer)

    with pytest.raises(TypeError, match="^dispatch_expert_major: topk_weights is required"):
        run(no_weights)

    def bad_flag(x, idx, w):
        return dej.dispatch_expert_major(x, idx, w, num_experts=num_experts, buffer=buffer, fp8_rows="no")

    with pytest.raises(TypeError, match="^dispatch_expert_major: fp8_rows must be a bool, got str 'no'"):
        run(bad_flag)

    def other_hidden(x, idx, w):  # the buffer was made for hidden=H
        expert_x, layout, recv_w, handle = dej.dispatch_expert_major(
            x, idx, w, num_experts=num_experts, buffer=hidden_buffer
        )
        return dej.combine_expert_major(expert_x[:, : H // 2], recv_w, layout, handle, buffer=hidden_buffer)

    hidden_buffer = dej.Buffer(mesh, "ep", backend="xla", hidden=H)
    with pytest.raises(
        ValueError, match=f"^combine_expert_major: expert_y has hidden {H // 2} but the buffer was made for hidden {H}"
    ):
        run(other_hidden)

    def no_tokens(x, idx, w):  # 0 tokens per rank and no num_worst_tokens: no row can arrive
        return dej.dispatch_expert_major(x[:0], idx[:0], w[:0], num_experts=num_experts, buffer=buffer)

    with pytest.raises(ValueError, match="^dispatch_expert_major: no row can arrive .* needs at least one row"):
        run(no_tokens)


def test_a_group_cut_by_num_rows_stays_aligned():
    """Pairs dropped from a group that is not the last (num_rows cuts expert 1's group, experts 2 and 3 get
    nothing): padded_group_sizes are still whole multiples of the alignment, so grouped_matmul's aligned_groups
    promise holds; every pair that fit gets its product, the dropped ones are counted."""
    num_tokens, alignment, num_rows = 200, 128, 384
    x = dt.random_rows(7, (num_tokens, H))
    idx = jnp.tile(jnp.array([[0, 1]], jnp.int32), (num_tokens, 1))
    expand = lambda x, idx: dej.expand(
        x, idx, num_local_experts=4, alignment=alignment, num_rows=num_rows, backend="xla"
    )
    expert_x, layout = jax.jit(expand)(x, idx)  # jitted: one compile, not one per op
    sizes = np.asarray(layout.padded_group_sizes())
    np.testing.assert_array_equal(sizes, [256, 128, 0, 0])
    assert int(layout.num_dropped) == num_tokens - 128
    w = jnp.asarray(np.random.default_rng(8).standard_normal((4, H, 64)) / np.sqrt(H), jnp.bfloat16)
    matmul = lambda expert_x, w, sizes, valid: dej.grouped_matmul(
        expert_x, w, sizes, backend="xla", aligned_groups=True, valid_sizes=valid
    )
    y = np.asarray(jax.jit(matmul)(expert_x, w, jnp.asarray(sizes), layout.group_sizes), np.float32)
    assert np.isfinite(y).all()
    x32, w32 = np.asarray(x, np.float32), np.asarray(w, np.float32)
    pair_row = np.asarray(layout.pair_row)
    for k in (0, 1):
        placed = pair_row[:, k] >= 0
        np.testing.assert_allclose(y[pair_row[placed, k]], x32[placed] @ w32[k], rtol=2e-2, atol=2e-2)
    assert (pair_row[:, 0] >= 0).all() and (pair_row[:, 1] >= 0).sum() == 128
