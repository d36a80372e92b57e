"""The reference backend against the contract (tests/oracle.py), on CPU."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import oracle
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import deep_ep_jax as dej
from deep_ep_jax import testing as dt
from deep_ep_jax.backends import reference
from deep_ep_jax.config import ROW_FORMATS

H = 256


@functools.cache
def _dispatch_step(num_ranks, num_experts, num_worst_tokens):
    """The jitted per-rank dispatch, layout and combine, built once per configuration: the routing kinds
    (arguments of the step) share its compile."""
    mesh = dt.ep_mesh(num_ranks, platform="cpu")
    buffer = dej.Buffer(mesh, "ep", backend="xla")

    def step(x, idx, w, y):
        recv_x, recv_idx, recv_w, handle = dej.dispatch(
            x, idx, w, num_experts=num_experts, buffer=buffer, num_worst_tokens=num_worst_tokens
        )
        layout = dej.get_dispatch_layout(idx, num_experts=num_experts, buffer=buffer)
        out, out_w = dej.combine(y, handle, recv_w, buffer=buffer)
        return recv_x, recv_idx, recv_w, handle, layout, out, out_w

    return dt.per_rank(step, mesh, "ep")


def _run_dispatch(num_ranks, num_tokens, num_experts, topk, kind, seed=0, num_worst_tokens=None, fp8=False):
    """Inputs (x as given to dispatch) and the outputs, as numpy: the checks index them per rank, and
    indexing a jax array would compile a gather for each new slice."""
    idx, w = dt.make_routing(seed, num_ranks * num_tokens, num_experts, topk, num_ranks, kind)
    x = dt.random_rows(seed + 1, (num_ranks * num_tokens, H))
    y = dt.random_rows(seed + 2, (num_ranks * (num_worst_tokens or num_ranks * num_tokens), H))
    if fp8:
        x = dej.backends.reference.quantize_fp8(x)
    outs = _dispatch_step(num_ranks, num_experts, num_worst_tokens)(x, jnp.asarray(idx), jnp.asarray(w), y)
    return (x, idx, w, y), jax.tree.map(np.asarray, outs)


def _shards(a, num_ranks):
    a = np.asarray(a.astype(jnp.float32) if a.dtype in (jnp.bfloat16, jnp.float8_e4m3fn) else a)
    return a.reshape((num_ranks, -1) + a.shape[1:])


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("kind", dt.ROUTING_KINDS)
def test_dispatch_combine_contract(num_ranks, kind):
    _check_contract(num_ranks, 12, 4 * num_ranks, 3, kind)


@pytest.mark.parametrize("kind", ["random", "one_expert", "minus_one"])
def test_single_token(kind):
    """One token per rank, top-2 of 4 experts on 2 ranks."""
    _check_contract(2, 1, 4, 2, kind)


def _check_contract(num_ranks, num_tokens, num_experts, topk, kind):
    """Dispatch, layout and combine against the oracle, bit for bit."""
    (x, idx, w, y), (recv_x, recv_idx, recv_w, handle, layout, out, out_w) = _run_dispatch(
        num_ranks, num_tokens, num_experts, topk, kind
    )
    xs, idxs, ws = _shards(x, num_ranks), _shards(idx, num_ranks), _shards(w, num_ranks)
    expected = oracle.dispatch(xs, idxs, ws, num_experts, num_ranks * num_tokens)
    for r in range(num_ranks):
        rows = expected[r]
        n = len(rows["x"])
        assert int(handle.num_recv_tokens[r]) == n == rows["total"]
        assert int(handle.num_dropped_tokens[r]) == 0
        np.testing.assert_array_equal(np.asarray(recv_x[r, :n], np.float32), np.reshape(rows["x"], (n, H)))
        np.testing.assert_array_equal(recv_idx[r, :n], np.reshape(rows["idx"], (n, topk)))
        np.testing.assert_array_equal(recv_w[r, :n], np.reshape(rows["w"], (n, topk)))
        np.testing.assert_array_equal(handle.recv_src_idx[r, :n], rows["src"])
        np.testing.assert_array_equal(handle.recv_src_rank[r, :n], rows["rank"])
        # Padding rows.
        assert (recv_idx[r, n:] == -1).all() and (recv_w[r, n:] == 0).all()
        assert (handle.recv_src_idx[r, n:] == -1).all() and (handle.recv_src_rank[r, n:] == -1).all()
        local_counts = [(np.reshape(rows["idx"], (n, topk)) == e).any(1).sum() for e in range(num_experts // num_ranks)]
        np.testing.assert_array_equal(handle.num_recv_tokens_per_expert[r], local_counts)
        # Layout.
        per_rank, per_expert, in_rank = oracle.layout(idxs[r], num_experts, num_ranks)
        np.testing.assert_array_equal(layout[0][r], per_rank)
        np.testing.assert_array_equal(layout[1][r], per_expert)
        np.testing.assert_array_equal(layout[2][r], in_rank)
        np.testing.assert_array_equal(handle.is_token_in_rank[r], in_rank)
    # Combine: rank order float32 sums, bit for bit after the bf16 cast.
    ys = _shards(y, num_ranks)
    want = oracle.combine(ys, expected, num_tokens)
    np.testing.assert_array_equal(
        np.asarray(out, np.float32), np.asarray(jnp.asarray(want).astype(jnp.bfloat16), np.float32)
    )
    # Combining the received weights gives the original weights of valid slots back.
    valid_w = np.where((idxs >= 0) & (idxs < num_experts), ws, 0)
    np.testing.assert_allclose(np.asarray(out_w).reshape(valid_w.shape), valid_w, rtol=0, atol=0)


def test_num_worst_tokens_overflow_is_visible():
    num_ranks, num_tokens, num_experts = 4, 16, 8
    worst = 10  # fewer rows than most ranks receive
    (x, idx, w, y), (recv_x, recv_idx, recv_w, handle, _, out, _) = _run_dispatch(
        num_ranks, num_tokens, num_experts, 2, "random", num_worst_tokens=worst
    )
    expected = oracle.dispatch(
        _shards(x, num_ranks), _shards(idx, num_ranks), _shards(w, num_ranks), num_experts, worst
    )
    assert recv_x.shape == (num_ranks, worst, H)
    for r in range(num_ranks):
        total = expected[r]["total"]
        assert int(handle.num_recv_tokens[r]) == min(total, worst)
        assert int(handle.num_dropped_tokens[r]) == max(total - worst, 0)
        n = len(expected[r]["x"])
        np.testing.assert_array_equal(np.asarray(recv_x[r, :n], np.float32), np.reshape(expected[r]["x"], (n, H)))
    assert int(np.asarray(handle.num_dropped_tokens).sum()) > 0
    # Dropped rows contribute nothing to combine; kept ones do.
    want = oracle.combine(_shards(y, num_ranks), expected, num_tokens)
    np.testing.assert_array_equal(
        np.asarray(out, np.float32), np.asarray(jnp.asarray(want).astype(jnp.bfloat16), np.float32)
    )


@functools.cache
def _per_host_step(num_ranks, num_tokens, num_experts, gpus_per_host, worst):
    """(buffer, the jitted per-rank dispatch and combine) for the test below, built once per configuration:
    the routing kinds (arguments of the step) share its compile."""
    mesh = dt.ep_mesh(num_ranks, platform="cpu")
    buffer = dej.Buffer(mesh, "ep", backend="xla", config=dej.Config(gpus_per_host=gpus_per_host))

    def step(idx, w, y):
        _, _, recv_w, handle = dej.dispatch(
            jnp.zeros((num_tokens, H), jnp.bfloat16),
            idx,
            w,
            num_experts=num_experts,
            buffer=buffer,
            num_worst_tokens=worst,
        )
        return dej.combine(y, handle, recv_w, buffer=buffer)

    return buffer, dt.per_rank(step, mesh, "ep")


def test_hosts_of_unequal_sizes_refused_as_on_cuda():
    """8 ranks cut into hosts of 3 (3, 3, 2): refused at Buffer creation, as the CUDA backend refuses them
    for normal mode; a low-latency Buffer (no such need) is made."""
    mesh = dt.ep_mesh(8, platform="cpu")
    with pytest.raises(NotImplementedError, match=r"Buffer\(backend='xla'\): .*same number of GPUs .* got \[3, 3, 2\]"):
        dej.Buffer(mesh, "ep", backend="xla", config=dej.Config(gpus_per_host=3))
    with dej.Buffer(
        mesh,
        "ep",
        backend="xla",
        config=dej.Config(gpus_per_host=3),
        low_latency_mode=True,
        num_max_dispatch_tokens_per_rank=8,
        hidden=H,
        num_experts=16,
    ) as buffer:
        assert buffer.rank_hosts == (0, 0, 0, 1, 1, 1, 2, 2)


@pytest.mark.parametrize("gpus_per_host", [1, 2, 4])
@pytest.mark.parametrize(
    "kind,worst_fraction",
    [("random", None), ("one_expert", None), ("rank_empty", None), ("minus_one", None), ("random", 0.3)],
)
def test_combine_sums_per_host(gpus_per_host, kind, worst_fraction, rng):
    """8 ranks cut into hosts of G (Config.gpus_per_host): combine sums each
    host's rows in rank order, rounds the partial to bf16 (weights: float32),
    then sums the partials in host order (tests/oracle.py, bit for bit).
    Rows of +-2^24 among small ones make the order show: with G > 1 the
    per-host result differs from the plain rank order."""
    num_ranks, num_tokens, topk = 8, 10, 4
    num_experts = 2 * num_ranks
    worst = None if worst_fraction is None else int(worst_fraction * num_ranks * num_tokens)
    rows = worst or num_ranks * num_tokens
    buffer, run = _per_host_step(num_ranks, num_tokens, num_experts, gpus_per_host, worst)
    assert buffer.rank_hosts == tuple(r // gpus_per_host for r in range(num_ranks))
    idx, w = dt.make_routing(int(rng.integers(1 << 30)), num_ranks * num_tokens, num_experts, topk, num_ranks, kind)
    y = rng.standard_normal((num_ranks * rows, H), np.float32)
    y = np.where(rng.random(y.shape) < 0.5, np.sign(y) * np.float32(1 << 24), y).astype(ml_dtypes.bfloat16)

    out, out_w = run(jnp.asarray(idx), jnp.asarray(w), jnp.asarray(y))
    idxs, ws = _shards(idx, num_ranks), _shards(w, num_ranks)
    expected = oracle.dispatch(np.zeros((num_ranks, num_tokens, 1)), idxs, ws, num_experts, rows)
    if worst is not None:
        assert any(e["total"] > worst for e in expected), "no row dropped"
    ys = np.asarray(y, np.float32).reshape(num_ranks, rows, H)
    want = oracle.combine(ys, expected, num_tokens, gpus_per_host)
    to_bf16 = lambda a: np.asarray(a.astype(ml_dtypes.bfloat16), np.float32)
    np.testing.assert_array_equal(np.asarray(out, np.float32), to_bf16(want))
    flat = to_bf16(oracle.combine(ys, expected, num_tokens))
    if gpus_per_host == 1:
        np.testing.assert_array_equal(to_bf16(want), flat)  # a bf16 row's partial is the row
    elif kind == "random":
        assert (to_bf16(want) != flat).any(), "the per-host order did not show"
    w_rows = np.zeros((num_ranks, rows, topk), np.float32)
    for r in range(num_ranks):
        w_rows[r, : len(expected[r]["w"])] = np.reshape(expected[r]["w"], (-1, topk))
    np.testing.assert_array_equal(
        np.asarray(out_w), oracle.combine(w_rows, expected, num_tokens, gpus_per_host, bf16_partials=False)
    )


def test_fp8_pair_roundtrip():
    num_ranks = 4
    (x, idx, w, _), (recv_x, recv_idx, _, handle, _, _, _) = _run_dispatch(num_ranks, 8, 8, 2, "random", fp8=True)
    data, scales = recv_x
    assert data.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float32
    assert data.shape == (num_ranks, num_ranks * 8, H) and scales.shape == (num_ranks, num_ranks * 8, H // 128)
    # The oracle places the pairs' rows (data and scales side by side, as float32).
    both = np.concatenate([_shards(x[0], num_ranks), _shards(x[1], num_ranks)], -1)
    expected = oracle.dispatch(both, _shards(idx, num_ranks), _shards(w, num_ranks), 8, num_ranks * 8)
    for r in range(num_ranks):
        n = len(expected[r]["x"])
        assert int(handle.num_recv_tokens[r]) == n > 0
        want = np.reshape(expected[r]["x"], (n, -1))
        np.testing.assert_array_equal(np.asarray(data[r, :n].astype(jnp.float32)), want[:, :H])
        np.testing.assert_array_equal(scales[r, :n], want[:, H:])


@functools.cache
def _pair_step(num_ranks, num_experts):
    """Dispatch of a pair, and the weights' gradient through it (quantized rows carry none)."""
    mesh = dt.ep_mesh(num_ranks, platform="cpu")
    buffer = dej.Buffer(mesh, "ep", backend="xla")

    def step(data, scales, idx, w):
        dispatch = lambda w: dej.dispatch((data, scales), idx, w, num_experts=num_experts, buffer=buffer)
        recv_x, _, _, handle = dispatch(w)
        return recv_x, handle.num_recv_tokens, jax.grad(lambda w: dispatch(w)[2].sum())(w)

    return dt.per_rank(step, mesh, "ep")


@pytest.mark.parametrize("name", [f.name for f in ROW_FORMATS[1:]])
@pytest.mark.parametrize("kind", ["random", "one_expert", "rank_empty", "minus_one"])
def test_quantized_pairs_arrive_as_they_are(name, kind):
    """MXFP8 and NVFP4 (float4, or packed uint8) rows through dispatch, every byte random: each
    rank's rows equal the oracle's byte for byte, in the dtypes sent; the weights still get their
    gradient (that of bf16 rows)."""
    num_ranks, num_tokens, num_experts = 4, 8, 16
    fmt = next(f for f in ROW_FORMATS if f.name == name)
    pair = dt.random_pair(7, fmt, num_ranks * num_tokens, H)
    idx, w = dt.make_routing(8, num_ranks * num_tokens, num_experts, 3, num_ranks, kind)
    (data, scales), counts, g_w = _pair_step(num_ranks, num_experts)(*pair, jnp.asarray(idx), jnp.asarray(w))
    assert (data.dtype, scales.dtype) == (pair[0].dtype, pair[1].dtype)
    expected = oracle.dispatch(
        oracle.pair_bytes(*pair).reshape(num_ranks, num_tokens, -1),
        _shards(idx, num_ranks),
        _shards(w, num_ranks),
        num_experts,
        num_ranks * num_tokens,
    )
    got = oracle.pair_bytes(data, scales)
    for r in range(num_ranks):
        n = len(expected[r]["x"])
        assert int(counts[r]) == n, (r, int(counts[r]), n)
        want = np.reshape(np.asarray(expected[r]["x"], np.uint8), (n, got.shape[-1]))
        dt.assert_bits_equal(got[r, :n], want, f"{name}: rank {r}'s rows")
    want_g_w = np.where(np.asarray(idx) >= 0, 1.0, 0.0).astype(np.float32)  # d(sum of recv_w)/dw
    np.testing.assert_array_equal(np.asarray(g_w).reshape(want_g_w.shape), want_g_w)


def test_two_dimensional_mesh():
    """EP on one axis of a (data, ep) mesh: each data row is its own EP group."""
    devices = np.array(jax.devices("cpu")[:8]).reshape(2, 4)
    mesh = Mesh(devices, ("data", "ep"))
    buffer = dej.Buffer(mesh, "ep", backend="xla")
    num_tokens, num_experts = 6, 8
    idx, w = dt.make_routing(3, 8 * num_tokens, num_experts, 2, 4)
    x = dt.random_rows(4, (8 * num_tokens, H))

    def step(x, idx, w):
        recv_x, _, recv_w, handle = dej.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
        return dej.combine(recv_x, handle, buffer=buffer), handle.num_recv_tokens[None]

    spec = P(("data", "ep"))
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec), check_vma=False))
    out, num_recv = f(x, jnp.asarray(idx), jnp.asarray(w))
    # combine(dispatch(x)) = x times the number of ranks each token went to.
    in_rank = np.stack([oracle.layout(i, num_experts, 4)[2] for i in idx.reshape(8, num_tokens, 2)])
    want = np.asarray(x, np.float32).reshape(8, num_tokens, H) * in_rank.sum(-1)[..., None]
    np.testing.assert_array_equal(np.asarray(out, np.float32).reshape(want.shape), want)
    # Each group of 4 exchanged only among itself.
    for group in range(2):
        sent = in_rank[group * 4 : (group + 1) * 4].sum()
        assert int(np.asarray(num_recv)[group * 4 : (group + 1) * 4].sum()) == sent


@functools.cache
def _low_latency_step(num_ranks, max_tokens, num_experts, use_fp8, round_scale, mxfp8=False):
    """The jitted per-rank low-latency dispatch and combine for the test below, built once per
    configuration: the routing kinds (arguments of the step) share its compile."""
    mesh = dt.ep_mesh(num_ranks, platform="cpu")
    buffer = dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=max_tokens)

    def step(x, idx, w, y):
        recv_x, count, handle = dej.low_latency_dispatch(
            x,
            idx,
            buffer=buffer,
            num_max_dispatch_tokens_per_rank=max_tokens,
            num_experts=num_experts,
            use_fp8=use_fp8,
            round_scale=round_scale,
            mxfp8=mxfp8,
        )
        out = dej.low_latency_combine(y, idx, w, handle, buffer=buffer)
        return recv_x, count, handle, out

    return dt.per_rank(step, mesh, "ep")


@pytest.mark.parametrize(
    "use_fp8,round_scale,mxfp8", [(False, False, False), (True, False, False), (True, True, False), (True, False, True)]
)
@pytest.mark.parametrize("kind", ["random", "one_expert", "rank_empty", "minus_one", "out_of_range"])
def test_low_latency_contract(use_fp8, round_scale, mxfp8, kind, rng):
    """Dispatch and combine against tests/oracle.py, bit for bit: rows (FP8
    values and scales as the oracle quantises them; MXFP8: float8_e8m0fnu
    scales per 32 channels), handles, combine sums."""
    num_ranks, max_tokens, num_tokens, num_experts, topk = 4, 8, 6, 16, 3
    seed = int(rng.integers(1 << 30))
    idx, w = dt.make_routing(seed, num_ranks * num_tokens, num_experts, topk, num_ranks, kind)
    x = dt.random_rows(seed + 1, (num_ranks * num_tokens, H))
    epr = num_experts // num_ranks
    y = dt.random_rows(seed + 2, (num_ranks * epr, num_ranks * max_tokens, H))

    run = _low_latency_step(num_ranks, max_tokens, num_experts, use_fp8, round_scale, mxfp8)
    # As numpy: the checks slice per rank and expert (a jax array would compile a gather per slice).
    recv_x, count, handle, out = jax.tree.map(np.asarray, run(x, jnp.asarray(idx), jnp.asarray(w), y))
    xs, idxs, ws = _shards(x, num_ranks), _shards(idx, num_ranks), _shards(w, num_ranks)
    expected = oracle.low_latency_dispatch(xs, idxs, num_experts, max_tokens)
    if use_fp8:
        assert recv_x[1].dtype == (jnp.float8_e8m0fnu if mxfp8 else jnp.float32)
        assert recv_x[1].shape[-1] == H // (32 if mxfp8 else 128)
        data, scales = (np.asarray(a, np.float32) for a in recv_x)  # e8m0 scales: powers of two, exact
        want_data, want_scales = oracle.quantize_fp8(xs, round_scale, mxfp8)
    for r in range(num_ranks):
        for e in range(epr):
            slots = expected[r][e]
            n = len(slots)
            assert int(count[r, e]) == n
            src = np.array([s for s, _, _ in slots], np.int32)
            tok = np.array([t for _, t, _ in slots], np.int32)
            np.testing.assert_array_equal(handle.recv_src_rank[r, e, :n], src)
            np.testing.assert_array_equal(handle.recv_src_token[r, e, :n], tok)
            np.testing.assert_array_equal(handle.recv_src_topk[r, e, :n], [k for _, _, k in slots])
            for padding in (handle.recv_src_rank, handle.recv_src_token, handle.recv_src_topk):
                assert (padding[r, e, n:] == -1).all()
            if use_fp8:
                _assert_bits_equal(data[r, e, :n], want_data[src, tok], f"FP8 values of rank {r} expert {e}")
                _assert_bits_equal(scales[r, e, :n], want_scales[src, tok], f"scales of rank {r} expert {e}")
            else:
                _assert_bits_equal(np.asarray(recv_x[r, e, :n], np.float32), xs[src, tok], f"rows of {r}, {e}")
    if kind == "one_expert":
        assert int(count[0, 0]) == num_ranks * num_tokens
    if kind == "rank_empty":
        assert (np.asarray(count[-1]) == 0).all()
    ys = np.asarray(y, np.float32).reshape(num_ranks, epr, num_ranks * max_tokens, H)
    want = oracle.low_latency_combine(ys, expected, idxs, ws, num_experts)
    _assert_bits_equal(np.asarray(out).view(np.uint16).reshape(want.shape), oracle.bf16_bits(want), "combine")


def _assert_bits_equal(got, want, what):
    """Equal bit patterns (so -0 differs from 0, and NaN equals itself)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype, want.shape, want.dtype)
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
    bad = np.argwhere(got.view(bits) != want.view(bits))
    assert not len(bad), (
        f"{what}: {len(bad)} of {got.size} differ, first at {bad[0].tolist()}: "
        f"{got[tuple(bad[0])]} vs {want[tuple(bad[0])]}"
    )


def _wide_range_rows(rng, shape):
    """bf16 rows whose 128-channel blocks span magnitudes 1e-9..1e4, with an
    all-zero block (scale floor 1e-4), tiny blocks (subnormal FP8) and
    blocks whose maximum is a power of two (round_scale's exact case)."""
    x = rng.standard_normal(shape).astype(np.float32)
    blocks = x.reshape(shape[:-1] + (-1, 128))
    blocks *= np.exp(rng.uniform(np.log(1e-9), np.log(1e4), blocks.shape[:-1]))[..., None].astype(np.float32)
    blocks[0, 0] = 0.0
    blocks[1, 1] *= np.float32(1e-6)
    blocks[2, 2, 5] = np.float32(448.0 * 2.0**-3)
    blocks[2, 2] = np.clip(blocks[2, 2], -56.0, 56.0)
    return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.parametrize("round_scale,mxfp8", [(False, False), (True, False), (False, True)])
def test_quantize_fp8_matches_oracle(round_scale, mxfp8, rng):
    """The reference backend's quantiser, jitted on CPU, equals the oracle's
    bit for bit (values and scales; MXFP8's as float8_e8m0fnu), over a wide
    range of magnitudes."""
    x = _wide_range_rows(rng, (64, 1024))
    data, scales = jax.jit(reference.quantize_fp8, static_argnums=(1, 2))(x, round_scale, mxfp8)
    want_data, want_scales = oracle.quantize_fp8(np.asarray(x, np.float32), round_scale, mxfp8)
    if mxfp8:
        assert scales.dtype == jnp.float8_e8m0fnu and scales.shape == (64, 1024 // 32)
        _assert_bits_equal(np.asarray(scales), want_scales.astype(jnp.float8_e8m0fnu), "e8m0 scales")
        scales = scales.astype(jnp.float32)
    round_scale = round_scale or mxfp8
    _assert_bits_equal(np.asarray(scales), want_scales, "scales")
    _assert_bits_equal(np.asarray(data.astype(jnp.float32)), want_data, "FP8 values")
    assert (want_data == 0).mean() < 0.5 and (np.abs(want_data) == 448).any()  # the data really spans FP8
    if round_scale:
        assert (want_scales.view(np.uint32) & 0x007FFFFF == 0).all()


def test_oracle_e4m3_rounding_agrees_with_ml_dtypes():
    """The oracle's own FP8 rounding, checked on every bf16 value in [-448,
    448] and on float32 values around each FP8 rounding midpoint."""
    import ml_dtypes

    every_bf16 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    values = every_bf16[np.abs(every_bf16) <= 448]
    grid = np.unique(np.abs(values.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)))
    mid = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)  # exact: few mantissa bits
    near = np.concatenate([mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))])
    values = np.concatenate([values, near, -near])
    want = values.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    _assert_bits_equal(oracle.e4m3_round(values), want, "e4m3 rounding")


def test_oracle_bf16_rounding_agrees_with_ml_dtypes(rng):
    import ml_dtypes

    values = np.concatenate(
        [
            rng.standard_normal(1 << 16).astype(np.float32) * np.float32(1e3),
            ((rng.integers(0, 1 << 16, 1 << 12, dtype=np.uint32) << 16) | 0x8000).view(np.float32),
        ]
    )
    values = values[np.isfinite(values)]  # the second half: exact ties
    want = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    _assert_bits_equal(oracle.bf16_bits(values), want, "bf16 rounding")


@pytest.mark.parametrize("round_scale", [False, True])
def test_low_latency_fp8_rows_and_scales(round_scale):
    """Each valid FP8 row equals a numpy quantisation of its source token:
    scales amax / 448 per 128 channels, or with round_scale the power of two
    at or above that; values x * (1 / scale) rounded to float8_e4m3fn."""
    num_ranks, max_tokens, num_tokens, num_experts, topk = 4, 8, 7, 16, 3
    mesh = dt.ep_mesh(num_ranks, platform="cpu")
    buffer = dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=max_tokens)
    idx, _ = dt.make_routing(14, num_ranks * num_tokens, num_experts, topk, num_ranks, "minus_one")
    # Channels over nine decades, so that the blocks' scales differ widely.
    x = dt.random_rows(15, (num_ranks * num_tokens, H), jnp.float32) * np.logspace(-6, 3, H, dtype=np.float32)
    x = x.astype(jnp.bfloat16)

    def step(x, idx):
        return dej.low_latency_dispatch(
            x,
            idx,
            buffer=buffer,
            num_max_dispatch_tokens_per_rank=max_tokens,
            num_experts=num_experts,
            use_fp8=True,
            round_scale=round_scale,
        )

    (data, scales), count, handle = jax.tree.map(np.asarray, dt.per_rank(step, mesh, "ep")(x, jnp.asarray(idx)))
    blocks = np.asarray(x, np.float32).reshape(num_ranks, num_tokens, H // 128, 128)
    want_scales = np.maximum(np.abs(blocks).max(-1), np.float32(1e-4)) * np.float32(1 / 448)
    if round_scale:
        mantissa, exponent = np.frexp(want_scales)
        powers = np.ldexp(np.float32(1), np.where(mantissa == 0.5, exponent - 1, exponent)).astype(np.float32)
        assert (powers >= want_scales).all() and (powers < 2 * want_scales).all()
        want_scales = powers
    # x times 1 / scale (not x / scale, which rounds differently at ties), as the kernels.
    inverse = (np.float32(1) / want_scales).astype(np.float32)
    want_data = np.clip(blocks * inverse[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)

    r, e, j = np.nonzero(np.arange(num_ranks * max_tokens)[None, None, :] < count[:, :, None])
    assert len(r) > 0
    s, t = handle.recv_src_rank[r, e, j], handle.recv_src_token[r, e, j]
    np.testing.assert_array_equal(scales[r, e, j].view(np.uint32), want_scales[s, t].view(np.uint32))
    np.testing.assert_array_equal(data[r, e, j].view(np.uint8), want_data[s, t].reshape(len(r), H).view(np.uint8))
    if round_scale:
        assert (scales[r, e, j].view(np.uint32) & 0x007FFFFF == 0).all(), "scales are not powers of two"


def test_low_latency_halves_with_overlap_match_whole_operations():
    """The halves, with compute placed between them by low_latency_overlap,
    give the whole operations' results, and the compute's own."""
    num_ranks, max_tokens, num_experts, topk = 4, 8, 16, 3
    mesh = dt.ep_mesh(num_ranks, platform="cpu")
    buffer = dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=max_tokens)
    idx, w = dt.make_routing(8, num_ranks * max_tokens, num_experts, topk, num_ranks, "minus_one")
    x = dt.random_rows(9, (num_ranks * max_tokens, H))
    z = dt.random_rows(10, (num_ranks * 16, 16), jnp.float32)
    kw = dict(buffer=buffer, num_max_dispatch_tokens_per_rank=max_tokens, num_experts=num_experts, use_fp8=False)

    def step(x, idx, w, z):
        recv_x, count, handle = dej.low_latency_dispatch(x, idx, **kw)
        whole = dej.low_latency_combine(recv_x, idx, w, handle, buffer=buffer)
        pending = dej.low_latency_dispatch_send(x, idx, **kw)
        pending, z1 = dej.low_latency_overlap(pending, lambda a: jnp.tanh(a @ a.T), z)
        split_x, split_count, split_handle = dej.low_latency_dispatch_recv(pending, buffer=buffer)
        pending = dej.low_latency_combine_send(split_x, idx, w, split_handle, buffer=buffer)
        pending, z2 = dej.low_latency_overlap(pending, lambda a: a * 2, z1)
        split = dej.low_latency_combine_recv(pending, buffer=buffer)
        return (recv_x, count, whole), (split_x, split_count, split), z2

    want, got, z2 = dt.per_rank(step, mesh, "ep")(x, jnp.asarray(idx), jnp.asarray(w), z)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    zs = np.asarray(z).reshape(num_ranks, 16, 16)
    np.testing.assert_allclose(np.asarray(z2).reshape(zs.shape), 2 * np.tanh(zs @ zs.transpose(0, 2, 1)), atol=1e-5)


def test_low_latency_backend_treats_ids_outside_range_as_none():
    """The reference backend itself (buffer.ops, past the wrapper's
    sanitising) treats top-k ids outside [0, E) as -1 in combine as dispatch
    does (docs/design.md, section 1): the same results as the sanitised ids."""
    num_ranks, max_tokens, num_experts, topk = 2, 8, 8, 4
    mesh = dt.ep_mesh(num_ranks, platform="cpu")
    buffer = dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=max_tokens)
    idx, w = dt.make_routing(12, num_ranks * max_tokens, num_experts, topk, num_ranks, "random")
    bad = idx.copy()
    bad[::2, 1] = num_experts
    bad[1::3, 2] = num_experts + 5
    bad[::5, 3] = -7
    clean = np.where((bad >= 0) & (bad < num_experts), bad, -1)
    x = dt.random_rows(13, (num_ranks * max_tokens, H))
    kw = dict(
        buffer=buffer,
        num_max_dispatch_tokens_per_rank=max_tokens,
        num_experts=num_experts,
        use_fp8=False,
        round_scale=False,
    )

    def round_trip(x, idx, w):
        recv_xs, count, handle = buffer.ops.low_latency_dispatch(x, idx, **kw)
        y = (recv_xs[0].astype(jnp.float32) * 1.5).astype(jnp.bfloat16)
        return count, buffer.ops.low_latency_combine(y, idx, w, handle, buffer=buffer)

    run = dt.per_rank(round_trip, mesh, "ep")
    got = run(x, jnp.asarray(bad), jnp.asarray(w))
    want = run(x, jnp.asarray(clean), jnp.asarray(w))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("limit", [3, None])
def test_rows_per_pair(limit):
    """The reference dispatch's rows_per_pair (dropless_moe's rounds on this backend): exchange blocks of that
    many rows per (source, destination); the rows past it in a pair are dropped and counted, and the rest,
    with their combine, are the oracle's for the routing without those rows. None: a cap at the largest
    pair's rows, which changes nothing."""
    num_ranks, num_tokens, num_experts, topk = 4, 12, 8, 2
    idx, w = dt.make_routing(7, num_ranks * num_tokens, num_experts, topk, num_ranks, "random")
    x = dt.random_rows(8, (num_ranks * num_tokens, H))
    y = dt.random_rows(9, (num_ranks * num_ranks * num_tokens, H))
    idxs, ws = _shards(idx, num_ranks), _shards(w, num_ranks)
    dest = np.where(idxs >= 0, idxs // (num_experts // num_ranks), -1)  # [source, token, k]
    sent = (dest[..., None] == np.arange(num_ranks)).any(axis=2)  # [source, token, destination]
    order = np.cumsum(sent, axis=1) - 1  # each token's place among its source's rows for a destination
    cap = limit or int(sent.sum(axis=1).max())
    kept_idx = np.where(np.take_along_axis(order, np.maximum(dest, 0), axis=2) < cap, idxs, -1)
    mesh = dt.ep_mesh(num_ranks, platform="cpu")
    buffer = dej.Buffer(mesh, "ep", backend="xla")

    def step(x, idx, w, y):
        (recv_x,), recv_idx, recv_w, handle = reference.dispatch(
            (x,), idx, w, num_experts=num_experts, num_worst_tokens=num_ranks * num_tokens, buffer=buffer,
            rows_per_pair=cap,
        )  # fmt: skip
        out, _ = reference.combine(y, recv_w, handle, buffer=buffer)
        return recv_x, recv_idx, handle.num_recv_tokens, handle.num_dropped_tokens, out

    recv_x, recv_idx, num_recv, dropped, out = jax.tree.map(
        np.asarray, dt.per_rank(step, mesh, "ep")(x, jnp.asarray(idx), jnp.asarray(w), y)
    )
    expected = oracle.dispatch(_shards(x, num_ranks), kept_idx, ws, num_experts, num_ranks * num_tokens)
    assert int(dropped.sum()) == int(np.maximum(sent.sum(axis=1) - cap, 0).sum())
    assert (int(dropped.sum()) > 0) == (limit is not None)
    for r in range(num_ranks):
        n = len(expected[r]["x"])
        assert int(num_recv[r]) == n
        np.testing.assert_array_equal(np.asarray(recv_x[r, :n], np.float32), np.reshape(expected[r]["x"], (n, H)))
        np.testing.assert_array_equal(recv_idx[r, :n], np.reshape(expected[r]["idx"], (n, topk)))
    want = oracle.combine(_shards(y, num_ranks), expected, num_tokens)
    np.testing.assert_array_equal(
        np.asarray(out, np.float32), np.asarray(jnp.asarray(want).astype(jnp.bfloat16), np.float32)
    )
