"""The CUDA low-latency dispatch/combine against the xla backend (the
reference), on all local GPUs (R = number of GPUs), through the public API.

Received rows, scales, counts and handles must equal the reference bit for
bit on the valid rows; padding rows of the handle must be -1; combine must
match bit for bit. Before CUDA calls the allocator is handed freed arrays of
the outputs' sizes filled with poison, which it tends to give back for the
outputs, so rows the kernels do not write show up as mismatches.

    pytest -q tests/gpu/test_low_latency_gpu.py
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import deep_ep_jax
from deep_ep_jax import _native, testing
from deep_ep_jax.backends.cuda import sizes

pytestmark = pytest.mark.gpu

AXIS = "ep"
MAX_TOKENS = 128  # the buffers' num_max_dispatch_tokens_per_rank
MAX_TOPK = 9
MAX_HIDDEN = 7168
MAX_EXPERTS = 512
OVERLAP_SMS = 16  # SMs of the overlapped sends


def _cuda_buffer(mesh, config=None):
    num_ranks = mesh.shape[AXIS]
    region = sizes.low_latency_region_bytes(num_ranks, MAX_EXPERTS, MAX_HIDDEN, MAX_TOKENS, num_topk=MAX_TOPK)
    return deep_ep_jax.Buffer(
        mesh,
        AXIS,
        backend="cuda",
        low_latency_mode=True,
        num_max_dispatch_tokens_per_rank=MAX_TOKENS,
        num_nvl_bytes=1 << 20,
        num_rdma_bytes=region,
        config=config,
    )


@pytest.fixture(scope="module")
def buffers(mesh):
    cuda = _cuda_buffer(mesh)
    xla = deep_ep_jax.Buffer(
        mesh, AXIS, backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=MAX_TOKENS
    )
    yield cuda, xla
    cuda.destroy()


@pytest.fixture(scope="module")
def overlapped_buffers(mesh, buffers):
    """As `buffers`, but the CUDA one runs its split sends beside XLA's stream."""
    cuda = _cuda_buffer(mesh, deep_ep_jax.Config(low_latency_overlap_sms=OVERLAP_SMS))
    yield cuda, buffers[1]
    cuda.destroy()


@pytest.fixture(params=["on_stream", "overlapped"])
def split_buffers(request):
    """The tests of the split halves run with both flavours of them."""
    return request.getfixturevalue("buffers" if request.param == "on_stream" else "overlapped_buffers")


# Helpers ---------------------------------------------------------------------


def _poison_outputs(mesh, num_experts, max_tokens, hidden, num_tokens, use_fp8):
    num_ranks = mesh.shape[AXIS]
    rows = (num_experts // num_ranks, num_ranks * max_tokens)  # [L, R * M] per rank
    shapes = [
        (rows + (hidden,), ml_dtypes.float8_e4m3fn if use_fp8 else ml_dtypes.bfloat16, 7.0),
        (rows, np.int32),
        (rows, np.int32),
        (rows, np.int32),
        ((num_tokens, hidden), ml_dtypes.bfloat16),
    ]
    if use_fp8:
        shapes.append((rows + (hidden // 128,), np.float32))
    testing.poison_allocator(mesh, AXIS, shapes)


def _dispatch(buffer, x, idx, *, num_experts, max_tokens, use_fp8, round_scale=False, split=False, mxfp8=False):
    kwargs = dict(
        buffer=buffer,
        num_max_dispatch_tokens_per_rank=max_tokens,
        num_experts=num_experts,
        use_fp8=use_fp8,
        round_scale=round_scale,
        mxfp8=mxfp8,
    )
    if split:
        pending = deep_ep_jax.low_latency_dispatch_send(x, idx, **kwargs)
        recv_x, count, handle = deep_ep_jax.low_latency_dispatch_recv(pending, buffer=buffer)
    else:
        recv_x, count, handle = deep_ep_jax.low_latency_dispatch(x, idx, **kwargs)
    return (tuple(recv_x) if use_fp8 else (recv_x,)), count, handle


def _combine(buffer, y, idx, w, handle, *, split=False):
    if split:
        pending = deep_ep_jax.low_latency_combine_send(y, idx, w, handle, buffer=buffer)
        return deep_ep_jax.low_latency_combine_recv(pending, buffer=buffer)
    return deep_ep_jax.low_latency_combine(y, idx, w, handle, buffer=buffer)


def _round_to_bf16(a):
    """f32 -> the nearest bf16 value (ties to even), kept as f32, by integer
    ops. An f32 -> bf16 -> f32 convert pair is not a safe rounding: with
    xla_allow_excess_precision (on by default) XLA may drop it, and it did in
    one program but not the other (the first GPU run's FP8 combine failures)."""
    bits = lax.bitcast_convert_type(a, jnp.uint32)
    bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _dequantize_f32(xs):
    """Rows as float32 values that are exactly bf16 (identity experts)."""
    if len(xs) == 1:
        return xs[0].astype(jnp.float32)
    return _round_to_bf16(deep_ep_jax.dequantize(xs, jnp.float32))


def _dequantize(xs):
    """Rows as bf16 (identity experts)."""
    return xs[0] if len(xs) == 1 else _dequantize_f32(xs).astype(jnp.bfloat16)  # exact: already bf16 values


def _hash_noise(shape, seed, rank):
    """Values k / 64, k in [-32, 32), from an integer hash of (seed, rank,
    element): exact, so every program computes the same bits (a
    transcendental RNG's code may differ between XLA fusions)."""
    flat = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        flat = flat + lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride)
        stride *= shape[d]
    h = flat * jnp.uint32(0x9E3779B1) + jnp.uint32((seed * 0x85EBCA77) & 0xFFFFFFFF)
    h = h + jnp.asarray(rank, jnp.uint32) * jnp.uint32(0xC2B2AE3D)
    for mul in (0x2C1B3C6D, 0x297A2D39):
        h = (h ^ (h >> 15)) * jnp.uint32(mul)
    h = h ^ (h >> 15)
    return ((h >> 26).astype(jnp.int32) - 32).astype(jnp.float32) * (1.0 / 64)


def _expert_outputs(xs, num_local, seed):
    """Deterministic per-rank expert outputs: the received rows (exact bf16
    values) times 1 + e/64 (exact), plus hash noise (exact): one rounding
    (the add) and one conversion, so y is the same bits in both programs
    whatever XLA fuses, contracts into an FMA or keeps in excess precision."""
    rank = lax.axis_index(AXIS)
    scale = 1.0 + jnp.arange(num_local, dtype=jnp.float32)[:, None, None] / 64
    return (_dequantize_f32(xs) * scale + _hash_noise(xs[0].shape, seed, rank)).astype(jnp.bfloat16)


def _step(buffer, x, idx, w, *, num_experts, max_tokens, use_fp8, round_scale=False, split=False, seed=0, mxfp8=False):
    xs, count, handle = _dispatch(
        buffer,
        x,
        idx,
        num_experts=num_experts,
        max_tokens=max_tokens,
        use_fp8=use_fp8,
        round_scale=round_scale,
        split=split,
        mxfp8=mxfp8,
    )
    y = _expert_outputs(xs, num_experts // buffer.num_ranks, seed)
    out = _combine(buffer, y, idx, w, handle, split=split)
    return xs, count, handle, out, y


def _run_both(mesh, buffers, fn, *args, check_vma=False, **kwargs):
    """fn(buffer, *args) per rank on the CUDA and the xla backends: (got, want)."""
    cuda, xla = buffers
    run_cuda = testing.per_rank(functools.partial(fn, cuda, **kwargs), mesh, AXIS, check_vma=check_vma)
    if cuda.backend == "cuda":  # really the kernels (not a fallback)
        text = run_cuda.lower(*args).as_text()
        assert "deep_ep_jax_low_latency_dispatch" in text or "deep_ep_jax_low_latency_combine" in text
    got = jax.tree.map(np.asarray, run_cuda(*args))
    want = jax.tree.map(
        np.asarray, testing.per_rank(functools.partial(fn, xla, **kwargs), mesh, AXIS, check_vma=check_vma)(*args)
    )
    return got, want


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _valid_rows(count, rows):
    """bool [R, L, R*M]: the first count[r, e] rows of each expert."""
    return np.arange(rows)[None, None, :] < count[:, :, None]


def _assert_dispatch_equal(got, want):
    (gxs, gcount, gh), (wxs, wcount, wh) = got, want
    np.testing.assert_array_equal(gcount, wcount, err_msg="recv_count")
    for name in ("recv_count", "recv_src_rank", "recv_src_token", "recv_src_topk"):
        np.testing.assert_array_equal(getattr(gh, name), getattr(wh, name), err_msg=name)
    valid = _valid_rows(wcount, wh.recv_src_rank.shape[-1])
    for i, (g, w) in enumerate(zip(gxs, wxs)):
        assert g.shape == w.shape and g.dtype == w.dtype, (i, g.shape, g.dtype, w.shape, w.dtype)
        bad = (_bits(g) != _bits(w)).any(-1) & valid
        assert not bad.any(), f"recv_xs[{i}]: {bad.sum()} valid rows differ, first at {np.argwhere(bad)[:4].tolist()}"


def _host_combine(y, handle, idx, w):
    """Combine recomputed on the host from one program's y and handle, summed
    as the kernels and the reference do (float32, k in order, w * y then +,
    no FMA). Returns (out bf16 [R, T, H], loc int [R, T, K, 3]): where each
    (rank, token, k) was received, as (expert rank, local expert, row), or -1."""
    num_ranks, _, rows = handle.recv_src_rank.shape
    _, num_tokens, topk = idx.shape
    loc = np.full((num_ranks, num_tokens, topk, 3), -1, np.int64)
    r, e, j = np.nonzero(_valid_rows(np.asarray(handle.recv_count), rows))
    s, t, k = handle.recv_src_rank[r, e, j], handle.recv_src_token[r, e, j], handle.recv_src_topk[r, e, j]
    ok = (s >= 0) & (s < num_ranks) & (t >= 0) & (t < num_tokens) & (k >= 0) & (k < topk)
    loc[s[ok], t[ok], k[ok]] = np.stack([r, e, j], -1)[ok]
    acc = np.zeros((num_ranks, num_tokens, y.shape[-1]), np.float32)
    for kk in range(topk):
        at = loc[:, :, kk].clip(0)
        term = w[:, :, kk, None].astype(np.float32) * y[at[..., 0], at[..., 1], at[..., 2]].astype(np.float32)
        acc = np.where(((idx[:, :, kk] >= 0) & (loc[:, :, kk, 0] >= 0))[..., None], acc + term, acc)
    return acc.astype(ml_dtypes.bfloat16), loc


def _explain_combine(bad, got, want, routing, limit=6):
    """Which (rank, token, k) terms make the combine outputs differ: compares
    the two programs' expert outputs y row by row and each program's output
    with a host sum of its own y (a kernel that summed other rows than the
    handle names disagrees with the host sum of its own y)."""
    (gy, gh, gout), (wy, wh, wout) = got, want
    idx, w, num_experts = routing
    num_ranks = gout.shape[0]
    idx = np.asarray(idx).reshape(num_ranks, gout.shape[1], -1)
    idx = np.where((idx >= 0) & (idx < num_experts), idx, -1)  # the API's sanitisation
    w = np.asarray(w, np.float32).reshape(idx.shape)
    valid = _valid_rows(np.asarray(wh.recv_count), wh.recv_src_rank.shape[-1])
    y_bad = (_bits(gy) != _bits(wy)).any(-1) & valid
    lines = [
        f"expert outputs y differ between the programs on {y_bad.sum()} of {valid.sum()} valid rows"
        + (" (the test's y is not reproducible: not a kernel bug)" if y_bad.any() else "")
    ]
    host_g, loc = _host_combine(gy, gh, idx, w)
    host_w, _ = _host_combine(wy, wh, idx, w)
    g_ok = ~(_bits(host_g) != _bits(gout)).any(-1)
    w_ok = ~(_bits(host_w) != _bits(wout)).any(-1)
    lines.append(
        f"cuda out == host sum of its y on {g_ok.sum()} of {g_ok.size} tokens; "
        f"reference out == host sum of its y on {w_ok.sum()} of {w_ok.size} tokens"
    )
    for s, t in np.argwhere(bad)[:limit]:
        d = _bits(gout[s, t]) != _bits(wout[s, t])
        diff = np.abs(gout[s, t].astype(np.float32) - wout[s, t].astype(np.float32)).max()
        lines.append(
            f"rank {s} token {t}: {d.sum()} of {d.size} channels differ (max |diff| {diff:g}, first at "
            f"{np.flatnonzero(d)[:4].tolist()}); cuda out == host(cuda y): {bool(g_ok[s, t])}, "
            f"reference out == host(reference y): {bool(w_ok[s, t])}"
        )
        for k in range(idx.shape[-1]):
            if idx[s, t, k] < 0:
                continue
            r, e, j = loc[s, t, k]
            if r < 0:
                lines.append(f"  k={k} expert {idx[s, t, k]}: no received row in the handle")
                continue
            yd = np.flatnonzero(_bits(gy[r, e, j]) != _bits(wy[r, e, j]))
            where = (
                f" at {yd[:4].tolist()} (cuda {gy[r, e, j][yd[:4]]}, reference {wy[r, e, j][yd[:4]]})"
                if yd.size
                else ""
            )
            lines.append(
                f"  k={k} expert {idx[s, t, k]} (rank {r}, local {e}, row {j}), w={w[s, t, k]:.6g}: "
                f"y rows differ in {yd.size} channels{where}"
            )
    return "\n".join(lines)


def _assert_combine_equal(got, want, explain=None):
    """explain: ((cuda y, handle), (reference y, handle), (topk_idx, topk_weights, num_experts)) to say,
    on a mismatch, which terms differ."""
    g, w = np.asarray(got), np.asarray(want)
    assert g.shape == w.shape and g.dtype == w.dtype
    # Exactly equal values; +0 == -0, since XLA may fold a sum of zeros in the
    # reference to either sign (the kernels always give +0).
    gf, wf = g.astype(np.float32), w.astype(np.float32)
    bad = ((gf != wf) & ~(np.isnan(gf) & np.isnan(wf))).any(-1)
    if bad.any() and explain is not None:
        (gy, gh), (wy, wh), routing = explain
        text = _explain_combine(bad, (np.asarray(gy), gh, g), (np.asarray(wy), wh, w), routing)
        assert not bad.any(), f"combine: {bad.sum()} tokens differ, first at {np.argwhere(bad)[:4].tolist()}\n{text}"
    assert not bad.any(), f"combine: {bad.sum()} tokens differ, first at {np.argwhere(bad)[:4].tolist()}"


def _inputs(seed, mesh, num_tokens, hidden, num_experts, topk, kind):
    num_ranks = mesh.shape[AXIS]
    idx, w = testing.make_routing(seed, num_ranks * num_tokens, num_experts, topk, num_ranks, kind)
    x = testing.random_rows(seed + 1, (num_ranks * num_tokens, hidden))
    return x, jnp.asarray(idx), jnp.asarray(w)


def _cases(num_ranks):
    # (tokens per rank, max tokens, hidden, experts, top-k)
    yield 128, 128, 7168, 288, 8  # DeepEP's decode case
    yield 37, 64, 512, 16 * num_ranks, 4  # fewer tokens than M
    yield 1, 8, 128, num_ranks, 1  # one expert per rank, one token
    yield 64, 128, 1024, 64 * num_ranks, 9  # many experts, odd top-k


# Tests -----------------------------------------------------------------------


@pytest.mark.parametrize("use_fp8", [True, False])
@pytest.mark.parametrize("kind", testing.ROUTING_KINDS)
def test_matches_reference(mesh, buffers, kind, use_fp8):
    num_ranks = mesh.shape[AXIS]
    for seed, (num_tokens, max_tokens, hidden, num_experts, topk) in enumerate(_cases(num_ranks)):
        topk = min(topk, num_experts - (num_experts // num_ranks if kind == "rank_empty" else 0))
        if topk < 1 or (kind == "rank_empty" and num_ranks < 2):
            continue
        x, idx, w = _inputs(seed, mesh, num_tokens, hidden, num_experts, topk, kind)
        _poison_outputs(mesh, num_experts, max_tokens, hidden, num_tokens, use_fp8)
        (gxs, gcount, gh, gout, gy), (wxs, wcount, wh, wout, wy) = _run_both(
            mesh, buffers, _step, x, idx, w, num_experts=num_experts, max_tokens=max_tokens, use_fp8=use_fp8, seed=seed
        )
        _assert_dispatch_equal((gxs, gcount, gh), (wxs, wcount, wh))
        _assert_combine_equal(gout, wout, explain=((gy, gh), (wy, wh), (idx, w, num_experts)))
        if kind == "rank_empty":  # the skew really happened
            assert (gcount[-1] == 0).all()
        if kind == "one_expert":
            assert gcount[0, 0] == num_ranks * num_tokens


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("kind", ["random", "one_expert", "rank_empty", "minus_one"])
def test_mxfp8_matches_reference(mesh, buffers, kind, split):
    """mxfp8=True (FP8 with float8_e8m0fnu scales per 32 channels, powers of two): the kernels'
    rows and scales equal the reference's bit for bit (the reference equals the oracle:
    tests/test_reference.py), whole and split, the combine of their dequantised rows too."""
    num_ranks = mesh.shape[AXIS]
    if kind == "rank_empty" and num_ranks < 2:
        pytest.skip("rank_empty routing needs two ranks")
    for seed, (num_tokens, max_tokens, hidden, num_experts, topk) in enumerate(list(_cases(num_ranks))[:2]):
        x, idx, w = _inputs(seed, mesh, num_tokens, hidden, num_experts, topk, kind)
        _poison_outputs(mesh, num_experts, max_tokens, hidden, num_tokens, True)
        kwargs = dict(num_experts=num_experts, max_tokens=max_tokens, use_fp8=True, mxfp8=True, split=split)
        (gxs, gcount, gh, gout, gy), (wxs, wcount, wh, wout, wy) = _run_both(
            mesh, buffers, _step, x, idx, w, seed=seed, **kwargs
        )
        assert gxs[1].dtype == jnp.float8_e8m0fnu and gxs[1].shape[-1] == hidden // 32
        _assert_dispatch_equal((gxs, gcount, gh), (wxs, wcount, wh))
        _assert_combine_equal(gout, wout, explain=((gy, gh), (wy, wh), (idx, w, num_experts)))


@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_quantisation(mesh, buffers, round_scale):
    """Each valid FP8 row against an independent numpy quantisation of its
    source token: scales bit for bit; values bit for bit with round_scale
    (exact powers of two), else fewer than 0.1% one FP8 step off (the
    kernels' 1 / scale is div.full.f32, not IEEE; test_oracle_gpu.py bounds
    it exactly); and dequantised within FP8 rounding of the input."""
    num_ranks = mesh.shape[AXIS]
    num_tokens, max_tokens, hidden, num_experts, topk = 96, 128, 2048, 32 * num_ranks, 8
    x, idx, w = _inputs(11, mesh, num_tokens, hidden, num_experts, topk, "random")
    x = x * jnp.asarray(np.logspace(-6, 3, hidden, dtype=np.float32)).astype(jnp.bfloat16)  # wide range of scales
    cuda, _ = buffers
    fn = functools.partial(
        _dispatch, cuda, num_experts=num_experts, max_tokens=max_tokens, use_fp8=True, round_scale=round_scale
    )
    (data, scales), count, handle = jax.tree.map(np.asarray, testing.per_rank(fn, mesh, AXIS)(x, idx))

    xs = np.asarray(x, np.float32).reshape(num_ranks, num_tokens, hidden)
    blocks = xs.reshape(num_ranks, num_tokens, hidden // 128, 128)
    amax = np.maximum(np.abs(blocks).max(-1), np.float32(1e-4))
    want_scale = (amax * np.float32(1.0 / 448.0)).astype(np.float32)  # XLA's form of amax / 448
    if round_scale:
        mantissa, exponent = np.frexp(want_scale)
        want_scale = np.ldexp(np.float32(1.0), np.where(mantissa == 0.5, exponent - 1, exponent)).astype(np.float32)
    inv = (np.float32(1.0) / want_scale).astype(np.float32)
    want_q = np.clip(blocks * inv[..., None], -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)

    valid = _valid_rows(count, handle.recv_src_rank.shape[-1])
    r, e, j = np.nonzero(valid)
    s, t = handle.recv_src_rank[r, e, j], handle.recv_src_token[r, e, j]
    assert len(r) > 0
    np.testing.assert_array_equal(_bits(scales[r, e, j]), _bits(want_scale[s, t]))
    got_q, want_q = _bits(data[r, e, j]), _bits(want_q[s, t].reshape(len(r), hidden))
    if round_scale:  # exact powers of two: every way of computing 1 / scale agrees
        np.testing.assert_array_equal(got_q, want_q)
    else:  # XLA's (and our) 1 / scale is div.full.f32, not IEEE: rarely one FP8 step apart at a tie
        differ = got_q != want_q
        assert differ.mean() < 1e-3, f"{differ.sum()} of {differ.size} FP8 values differ"
        assert (np.abs(got_q[differ].astype(int) - want_q[differ].astype(int)) == 1).all()
    if round_scale:
        assert (_bits(scales[r, e, j]) & 0x007FFFFF == 0).all(), "scales are not powers of two"
    deq = data[r, e, j].astype(np.float32).reshape(len(r), -1, 128) * scales[r, e, j][..., None]
    src = xs[s, t].reshape(len(r), -1, 128)
    step = np.maximum(np.abs(src) * 2.0**-4, scales[r, e, j][..., None] * 2.0**-9)  # e4m3: 3 mantissa bits
    assert (np.abs(deq - src) <= step * 1.0001).all()


def test_split_halves(mesh, split_buffers):
    """The *_send / *_recv halves give the same results as the whole calls."""
    num_ranks = mesh.shape[AXIS]
    x, idx, w = _inputs(21, mesh, 100, 1024, 16 * num_ranks, 6, "minus_one")
    kwargs = dict(num_experts=16 * num_ranks, max_tokens=MAX_TOKENS, use_fp8=True, seed=3)
    _poison_outputs(mesh, 16 * num_ranks, MAX_TOKENS, 1024, 100, True)
    got, want = _run_both(mesh, split_buffers, functools.partial(_step, split=True), x, idx, w, **kwargs)
    _assert_dispatch_equal(got[:3], want[:3])
    _assert_combine_equal(got[3], want[3], explain=((got[4], got[2]), (want[4], want[2]), (idx, w, 16 * num_ranks)))


def test_split_halves_under_shard_map_defaults(mesh, split_buffers):
    """shard_map's default check_vma=True, as users write it: both flavours of
    the halves type-check and equal the reference."""
    num_ranks = mesh.shape[AXIS]
    x, idx, w = _inputs(23, mesh, 64, 1024, 8 * num_ranks, 4, "random")
    kwargs = dict(num_experts=8 * num_ranks, max_tokens=MAX_TOKENS, use_fp8=False, seed=5)
    got, want = _run_both(
        mesh, split_buffers, functools.partial(_step, split=True), x, idx, w, check_vma=True, **kwargs
    )
    _assert_dispatch_equal(got[:3], want[:3])
    _assert_combine_equal(got[3], want[3])


def test_duplicates_and_overflow(mesh, buffers):
    """Duplicate experts in a token's top-k are each sent (ordered by k); an
    expert receiving more than R*M rows keeps the first R*M in contract order."""
    num_ranks = mesh.shape[AXIS]
    num_tokens, hidden, num_experts, topk = 24, 256, 4 * num_ranks, 4
    idx, w = testing.make_routing(31, num_ranks * num_tokens, num_experts, topk, num_ranks, "random")
    idx[:, 1] = idx[:, 0]  # duplicates in every token
    x = testing.random_rows(32, (num_ranks * num_tokens, hidden))
    idx, w = jnp.asarray(idx), jnp.asarray(w)
    got, want = _run_both(
        mesh, buffers, _step, x, idx, w, num_experts=num_experts, max_tokens=2 * num_tokens, use_fp8=False
    )
    _assert_dispatch_equal(got[:3], want[:3])
    _assert_combine_equal(got[3], want[3], explain=((got[4], got[2]), (want[4], want[2]), (idx, w, num_experts)))

    # Overflow: every slot of every token to expert 0; only dispatch is defined then.
    flood = jnp.zeros_like(idx)
    fn = lambda b, x, i: _dispatch(b, x, i, num_experts=num_experts, max_tokens=num_tokens, use_fp8=True)
    got, want = _run_both(mesh, buffers, fn, x, flood)
    _assert_dispatch_equal(got, want)
    assert got[1][0, 0] == num_ranks * num_tokens


def _backend_round_trip(buffer, x, idx, w, *, num_experts, max_tokens, split, seed):
    """dispatch -> expert outputs -> combine through buffer.ops, the backend
    itself: unlike the public API, nothing sanitises idx first."""
    ops, kwargs = (
        buffer.ops,
        dict(
            num_experts=num_experts,
            num_max_dispatch_tokens_per_rank=max_tokens,
            use_fp8=False,
            round_scale=False,
            buffer=buffer,
        ),
    )
    if split:
        xs, count, handle = ops.low_latency_dispatch_recv(
            ops.low_latency_dispatch_send(x, idx, **kwargs), buffer=buffer
        )
    else:
        xs, count, handle = ops.low_latency_dispatch(x, idx, **kwargs)
    y = _expert_outputs(xs, num_experts // buffer.num_ranks, seed)
    if split:
        out = ops.low_latency_combine_recv(
            ops.low_latency_combine_send(y, idx, w, handle, buffer=buffer), buffer=buffer
        )
    else:
        out = ops.low_latency_combine(y, idx, w, handle, buffer=buffer)
    return xs, count, handle, out, y


@pytest.mark.parametrize("split", [False, True])
def test_kernels_treat_ids_outside_range_as_none(mesh, buffers, split):
    """Top-k ids outside [0, E) name no expert in every kernel (docs/design.md,
    section 1), whatever reaches them: dispatch drops them, and combine must
    skip them too. Called through the backend (no sanitising), a round trip
    with ids E, E + 5 and -7 equals the reference's on the sanitised ids. A
    round trip with valid ids first leaves rows in every combine slot, so a
    combine that read the slot of an id >= E would add a stale row."""
    num_ranks = mesh.shape[AXIS]
    num_tokens, hidden, num_experts, topk = 64, 512, 8 * num_ranks, 4
    x, idx, w = _inputs(41, mesh, num_tokens, hidden, num_experts, topk, "random")
    bad = np.asarray(idx).copy()
    bad[::2, 1] = num_experts
    bad[1::3, 2] = num_experts + 5
    bad[::5, 3] = -7
    bad = jnp.asarray(bad)
    kwargs = dict(num_experts=num_experts, max_tokens=MAX_TOKENS, split=split, seed=5)

    def two_rounds(buffer, x, idx, bad, w):
        first = _backend_round_trip(buffer, x, idx, w, **kwargs)
        x, _ = lax.optimization_barrier((x, first[3]))  # the second round after the first
        return _backend_round_trip(buffer, x, bad, w, **kwargs)

    def reference(buffer, x, idx, bad, w):
        return _step(buffer, x, bad, w, num_experts=num_experts, max_tokens=MAX_TOKENS, use_fp8=False, seed=5)

    cuda, xla = buffers
    got = jax.tree.map(np.asarray, testing.per_rank(functools.partial(two_rounds, cuda), mesh, AXIS)(x, idx, bad, w))
    want = jax.tree.map(np.asarray, testing.per_rank(functools.partial(reference, xla), mesh, AXIS)(x, idx, bad, w))
    _assert_dispatch_equal(got[:3], want[:3])
    _assert_combine_equal(got[3], want[3], explain=((got[4], got[2]), (want[4], want[2]), (bad, w, num_experts)))


def test_many_calls_in_fori_loop(mesh, split_buffers):
    """250 dispatch -> combine steps in a jitted fori_loop (command buffers on
    by default): routing shifts and data changes every step, each step's
    output feeds the next; the final state must equal the reference's."""
    num_ranks = mesh.shape[AXIS]
    num_tokens, hidden, num_experts, topk, steps = 64, 512, 8 * num_ranks, 4, 250
    x, idx, w = _inputs(41, mesh, num_tokens, hidden, num_experts, topk, "minus_one")
    w = w / jnp.maximum(jnp.where(idx >= 0, w, 0).sum(-1, keepdims=True), 1e-3)  # keep values bounded

    def loop(buffer, x, idx, w):
        def step(i, x, counts, use_fp8, split):
            shifted = jnp.where(idx >= 0, (idx + i) % num_experts, -1)
            xs, count, handle = _dispatch(
                buffer, x, shifted, num_experts=num_experts, max_tokens=num_tokens, use_fp8=use_fp8, split=split
            )
            out = _combine(buffer, _dequantize(xs), shifted, w, handle, split=split)
            return (out * (1.0 + (i % 5) / 64)).astype(jnp.bfloat16), counts + count

        def body(i, carry):  # two steps: FP8 whole calls, then bf16 split halves
            carry = step(2 * i, *carry, use_fp8=True, split=False)
            return step(2 * i + 1, *carry, use_fp8=False, split=True)

        return lax.fori_loop(0, steps // 2, body, (x, jnp.zeros(num_experts // num_ranks, jnp.int32)))

    (gx, gcounts), (wx, wcounts) = _run_both(mesh, split_buffers, loop, x, idx, w)
    np.testing.assert_array_equal(gcounts, wcounts)
    assert gcounts.sum() > 0
    _assert_combine_equal(gx, wx)
    assert np.isfinite(np.asarray(gx, np.float32)).all()


def test_compute_between_send_and_recv(mesh, split_buffers):
    """Work placed between the halves (two ops in flight, and a matmul chain)
    neither blocks nor corrupts anything."""
    num_ranks = mesh.shape[AXIS]
    num_tokens, hidden, num_experts, topk = 128, 1024, 32 * num_ranks, 8
    x, idx, w = _inputs(51, mesh, num_tokens, hidden, num_experts, topk, "random")
    x2, idx2, _ = _inputs(52, mesh, num_tokens, hidden, num_experts, topk, "minus_one")
    z = testing.random_rows(53, (num_ranks * 512, 512), jnp.float32)

    def heavy(z):
        for _ in range(8):
            z = jnp.tanh(z @ z.T[:, :512] / 32)
        return z

    def fn(buffer, x, idx, w, x2, idx2, z):
        kw = dict(buffer=buffer, num_max_dispatch_tokens_per_rank=num_tokens, num_experts=num_experts)
        p1 = deep_ep_jax.low_latency_dispatch_send(x, idx, **kw)
        p2 = deep_ep_jax.low_latency_dispatch_send(x2, idx2, use_fp8=False, **kw)  # two in flight
        (p1, p2), z = deep_ep_jax.low_latency_overlap((p1, p2), heavy, z)
        recv1, count1, h1 = deep_ep_jax.low_latency_dispatch_recv(p1, buffer=buffer)
        recv2, count2, h2 = deep_ep_jax.low_latency_dispatch_recv(p2, buffer=buffer)
        y = _dequantize(tuple(recv1))
        pc = deep_ep_jax.low_latency_combine_send(y, idx, w, h1, buffer=buffer)
        pc, z = deep_ep_jax.low_latency_overlap(pc, heavy, z)
        out = deep_ep_jax.low_latency_combine_recv(pc, buffer=buffer)
        return recv1, count1, h1, recv2, count2, h2, out, z, y

    got, want = _run_both(mesh, split_buffers, fn, x, idx, w, x2, idx2, z)
    _assert_dispatch_equal((tuple(got[0]), got[1], got[2]), (tuple(want[0]), want[1], want[2]))
    _assert_dispatch_equal(((got[3],), got[4], got[5]), ((want[3],), want[4], want[5]))
    _assert_combine_equal(got[6], want[6], explain=((got[8], got[2]), (want[8], want[2]), (idx, w, num_experts)))
    np.testing.assert_allclose(got[7], want[7], rtol=1e-5, atol=1e-5)


def test_trace_time_errors(mesh, buffers):
    """What the kernels cannot do fails at trace time with a ValueError."""
    cuda, _ = buffers
    num_ranks = mesh.shape[AXIS]
    num_experts = 64 * num_ranks

    def trace(buffer, num_tokens, hidden, topk, max_tokens=MAX_TOKENS):
        fn = functools.partial(_dispatch, buffer, num_experts=num_experts, max_tokens=max_tokens, use_fp8=True)
        x = jax.ShapeDtypeStruct((num_ranks * num_tokens, hidden), jnp.bfloat16)
        idx = jax.ShapeDtypeStruct((num_ranks * num_tokens, topk), jnp.int32)
        jax.eval_shape(testing.per_rank(fn, mesh, AXIS), x, idx)

    trace(cuda, 8, 256, 4)  # fine
    with pytest.raises(ValueError, match="hidden"):
        trace(cuda, 8, 200, 4)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
        trace(cuda, 9, 256, 4, max_tokens=8)
    with pytest.raises(ValueError, match="top-k"):
        trace(cuda, 8, 256, _native.limits()["low_latency_max_topk"] + 1)
    with deep_ep_jax.Buffer(
        mesh,
        AXIS,
        backend="cuda",
        low_latency_mode=True,
        num_max_dispatch_tokens_per_rank=64,
        num_nvl_bytes=1 << 20,
        num_rdma_bytes=1 << 20,
    ) as small:
        with pytest.raises(ValueError, match="too small"):
            trace(small, 64, 4096, 8, max_tokens=64)


def test_overlapped_send_must_be_received_first(mesh, overlapped_buffers):
    """With overlapped sends, another operation of the buffer between a send
    and its receive fails with a message instead of racing the send (last in
    this file: the refused program leaves that send unreceived)."""
    cuda, _ = overlapped_buffers
    num_ranks = mesh.shape[AXIS]
    x, idx, _ = _inputs(61, mesh, 32, 256, 4 * num_ranks, 2, "random")
    kwargs = dict(buffer=cuda, num_max_dispatch_tokens_per_rank=MAX_TOKENS, num_experts=4 * num_ranks)

    def fn(x, idx):
        pending = deep_ep_jax.low_latency_dispatch_send(x, idx, **kwargs)
        # The whole dispatch between the halves (XLA orders by data only).
        pending, whole = deep_ep_jax.low_latency_overlap(
            pending, lambda x, idx: deep_ep_jax.low_latency_dispatch(x, idx, **kwargs), x, idx
        )
        return whole, deep_ep_jax.low_latency_dispatch_recv(pending, buffer=cuda)

    with pytest.raises(Exception, match="still wait for their receive"):
        jax.block_until_ready(testing.per_rank(fn, mesh, AXIS)(x, idx))
