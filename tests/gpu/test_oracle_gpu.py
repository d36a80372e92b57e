"""The CUDA kernels against the numpy oracle (tests/oracle.py), which shares
no code with the package, at the standard sizes, on 2 GPUs driven by one
process: normal mode with 4096 tokens per rank, hidden 7168, 256 experts,
top-8 (bf16 rows, and FP8 pairs of random bytes), and low-latency mode with 128 tokens per rank
and the same hidden, experts and top-k (bf16, FP8, FP8 with round_scale).
The other GPU suites compare the kernels with the reference backend, which
shares the package's code; this one does not.

What must match, and how exactly:
- normal dispatch: per receiving rank its row count and, for rows [0, n),
  rows from each source rank in the contract's order (source rank, then
  token), bit for bit: x (or FP8 bytes and scales), top-k ids, weights,
  source token and rank; per-expert counts, the layout; padding metadata
  (-1, 0) as the contract says. Padding rows of recv_x are unspecified and
  not read.
- normal combine: bit for bit (float32 sum in rank order, one bf16 rounding:
  the oracle sums in that order too), with the weights' sum.
- get_dispatch_layout: per rank, its counts per rank and per expert and
  is_token_in_rank, exactly.
- combine's backward (the cached dispatch along the handle): each valid row
  and its weights get the cotangent of the token they came from, bit for
  bit; padding rows get 0.
- low-latency dispatch: counts, handles and rows bit for bit; FP8 scales bit
  for bit; FP8 values bit for bit with round_scale (1 / scale is a power of
  two, exact). Without round_scale only, the kernels take 1 / scale with
  div.full.f32 (as XLA does for the reference backend on GPU), an
  approximate division within 2 float32 ulps of the IEEE quotient that the
  oracle uses, so a value may round to the neighbouring FP8 value near a
  tie: each value must lie between the oracle's values for 1 / scale moved
  2 ulps down and 2 ulps up (rounding is monotonic, so this bounds it).
- low-latency combine: bit for bit (float32, k in order, w * y rounded
  before the add, one bf16 rounding).

Before each run the allocator is handed freed arrays of the outputs' sizes
filled with poison, and combine's input rows past the received count are
NaN, so rows the kernels do not write, or read when they must not, show.
Every input is fresh random data (the seed is in the failure message). The
file takes about a minute, mostly host work (inputs, the oracle, transfers).

    pytest -q -m gpu tests/gpu/test_oracle_gpu.py
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import oracle
import pytest
from jax.sharding import Mesh

import deep_ep_jax
from deep_ep_jax import testing

pytestmark = pytest.mark.gpu

AXIS = "ep"
bits, assert_bits_equal = testing.bits, testing.assert_bits_equal


NUM_RANKS = 2
HIDDEN, NUM_EXPERTS, TOPK = 7168, 256, 8
NORMAL_TOKENS = 4096  # per rank
LOW_LATENCY_TOKENS = 128  # per rank, and the buffer's num_max_dispatch_tokens_per_rank
DIVISION_ULPS = 2  # div.full.f32's documented maximum error


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices("gpu")[:NUM_RANKS]), (AXIS,))


@pytest.fixture(scope="module")
def normal_buffer(mesh):
    buffer = deep_ep_jax.Buffer(mesh, AXIS, backend="cuda")
    yield buffer
    buffer.destroy()


@pytest.fixture(scope="module")
def low_latency_buffer(mesh):
    buffer = deep_ep_jax.Buffer(
        mesh,
        AXIS,
        backend="cuda",
        low_latency_mode=True,
        num_max_dispatch_tokens_per_rank=LOW_LATENCY_TOKENS,
        hidden=HIDDEN,
        num_experts=NUM_EXPERTS,
    )
    yield buffer
    buffer.destroy()


# Helpers ---------------------------------------------------------------------


def random_bf16(rng, shape):
    """Random bf16 values of both signs, magnitudes in [2^-7, 2): random bits
    with the top 5 exponent bits fixed (a normal generator takes seconds here)."""
    raw = rng.integers(0, 1 << 16, shape, np.uint16)
    return ((raw & 0x83FF) | 0x3C00).view(ml_dtypes.bfloat16)


def wide_range_bf16(rng, shape):
    """Random bf16 rows whose 128-channel blocks are scaled by 2^-22..2^8
    (exact), one block in 16 all zero: FP8 scales at the 1e-4 floor, FP8
    zeros and subnormals, and values up to 448."""
    blocks = np.asarray(random_bf16(rng, shape), np.float32).reshape(shape[:-1] + (-1, 128))
    exponents = rng.integers(-22, 9, blocks.shape[:-1])
    blocks *= np.exp2(exponents).astype(np.float32)[..., None]
    blocks[rng.random(blocks.shape[:-1]) < 1 / 16] = 0.0
    return (blocks.reshape(shape).view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)  # exact


def nan_bf16(shape):
    return np.full(shape, 0x7FC0, np.uint16).view(ml_dtypes.bfloat16)


def random_fp8_pairs(rng, num_rows, hidden):
    """FP8 rows of random bytes (NaN codes too) and random positive scales:
    normal mode moves the bytes as they are."""
    data = rng.integers(0, 256, (num_rows, hidden), np.uint8)
    scales = np.exp2(rng.uniform(-20, 20, (num_rows, hidden // 128))).astype(np.float32)
    return data.view(ml_dtypes.float8_e4m3fn), scales


_lowering_checked = set()


def run_per_rank(buffer, mesh, step, *args):
    """step per rank under shard_map (one compiled program per step); checks
    once that the CUDA program calls our kernels."""
    run = _per_rank(step, mesh)
    if buffer.backend == "cuda" and step not in _lowering_checked:
        assert "@deep_ep_jax_" in run.lower(*args).as_text(), "the program calls none of the kernels"
        _lowering_checked.add(step)
    return jax.tree.map(np.asarray, run(*args))


@functools.cache
def _per_rank(step, mesh):
    return testing.per_rank(step, mesh, AXIS)


# Normal mode -----------------------------------------------------------------


@functools.cache
def normal_step(buffer):
    def step(x, idx, w, y, g_out, g_out_w):
        layout = deep_ep_jax.get_dispatch_layout(idx, num_experts=NUM_EXPERTS, buffer=buffer)
        recv_x, recv_idx, recv_w, handle = deep_ep_jax.dispatch(x, idx, w, num_experts=NUM_EXPERTS, buffer=buffer)
        (out, out_w), combine_vjp = jax.vjp(
            lambda y, recv_w: deep_ep_jax.combine(y, handle, recv_w, buffer=buffer), y, recv_w
        )
        return recv_x, recv_idx, recv_w, handle, out, out_w, layout, combine_vjp((g_out, g_out_w))

    return step


def check_normal_mode(buffer, mesh, kind, fp8, seed):
    rng = np.random.default_rng(seed)
    R, T, H, E, K = NUM_RANKS, NORMAL_TOKENS, HIDDEN, NUM_EXPERTS, TOPK
    N = R * T  # rows per rank (the default num_worst_tokens: nothing dropped)
    idx, w = testing.make_routing(seed, R * T, E, K, R, kind)
    idxs, ws = idx.reshape(R, T, K), w.reshape(R, T, K)
    if fp8:
        x_in = data, scales = random_fp8_pairs(rng, R * T, H)
        x = data
    else:
        x_in = x = random_bf16(rng, (R * T, H))
    expected = oracle.dispatch(x.reshape(R, T, H), idxs, ws, E, N)
    # Combine's input: fresh rows, NaN past each rank's count (never to be read).
    y = nan_bf16((R, N, H))
    for r in range(R):
        y[r, : len(expected[r]["x"])] = random_bf16(rng, (len(expected[r]["x"]), H))
    # Cotangents of combine's outputs, for its backward.
    g_out, g_out_w = random_bf16(rng, (R * T, H)), rng.standard_normal((R * T, K), np.float32)

    data_dtype = ml_dtypes.float8_e4m3fn if fp8 else ml_dtypes.bfloat16
    outputs = [
        ((N, H), data_dtype),
        ((N, K), np.int32),
        ((N, K), np.float32),
        ((N,), np.int32),
        ((T, H), ml_dtypes.bfloat16),
        ((T, K), np.float32),
        ((N, H), ml_dtypes.bfloat16),
        ((T, R), np.bool_),
    ]
    testing.poison_allocator(mesh, AXIS, outputs + ([((N, H // 128), np.float32)] if fp8 else []))
    recv_x, recv_idx, recv_w, handle, out, out_w, layout, (g_y, g_recv_w) = run_per_rank(
        buffer, mesh, normal_step(buffer), x_in, jnp.asarray(idx), jnp.asarray(w), y.reshape(R * N, H), g_out, g_out_w
    )

    where = f"normal mode, {kind}, {'FP8' if fp8 else 'bf16'}, seed {seed}"
    epr = E // R
    for r in range(R):
        rows = expected[r]
        n = len(rows["x"])
        assert int(handle.num_recv_tokens[r]) == n == rows["total"], (where, r)
        assert int(handle.num_dropped_tokens[r]) == 0, (where, r)
        src, rank = np.asarray(rows["src"], np.int32), np.asarray(rows["rank"], np.int32)
        assert_bits_equal(handle.recv_src_rank[r, :n], rank, f"{where}: rank {r} source ranks")
        assert_bits_equal(handle.recv_src_idx[r, :n], src, f"{where}: rank {r} source tokens")
        # Each source's rows, in token order (row i came from token src[i] of rank rank[i]).
        got_x = recv_x[0] if fp8 else recv_x
        assert_bits_equal(got_x[r, :n], x[rank * T + src], f"{where}: rank {r} rows")
        if fp8:
            assert_bits_equal(recv_x[1][r, :n], scales[rank * T + src], f"{where}: rank {r} scales")
        want_idx = np.reshape(rows["idx"], (n, K)).astype(np.int32)
        assert_bits_equal(recv_idx[r, :n], want_idx, f"{where}: rank {r} top-k ids")
        assert_bits_equal(recv_w[r, :n], np.reshape(rows["w"], (n, K)).astype(np.float32), f"{where}: rank {r} weights")
        # Padding metadata, as the contract says.
        assert (recv_idx[r, n:] == -1).all() and (bits(recv_w[r, n:]) == 0).all(), (where, r)
        assert (handle.recv_src_idx[r, n:] == -1).all() and (handle.recv_src_rank[r, n:] == -1).all(), (where, r)
        per_expert = np.bincount(want_idx[want_idx >= 0], minlength=epr)
        np.testing.assert_array_equal(handle.num_recv_tokens_per_expert[r], per_expert, err_msg=where)
        per_rank, per_global_expert, in_rank = oracle.layout(idxs[r], E, R)
        np.testing.assert_array_equal(handle.num_tokens_per_rank[r], per_rank, err_msg=where)
        np.testing.assert_array_equal(handle.is_token_in_rank[r], in_rank, err_msg=where)
        for name, got, want in zip(
            ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"),
            layout,
            (per_rank, per_global_expert, in_rank),
        ):
            np.testing.assert_array_equal(got[r], want, err_msg=f"{where}: get_dispatch_layout's {name}")
        # Combine's backward: row i gets the cotangent of token src[i] of rank rank[i]; padding rows 0.
        assert_bits_equal(g_y[r, :n], g_out[rank * T + src], f"{where}: rank {r} combine's row gradients")
        assert_bits_equal(g_recv_w[r, :n], g_out_w[rank * T + src], f"{where}: rank {r} combine's weight gradients")
        assert (bits(g_y[r, n:]) == 0).all() and (bits(g_recv_w[r, n:]) == 0).all(), (where, r)
    if kind == "rank_empty":  # the skew really happened
        assert int(handle.num_recv_tokens[-1]) == 0
    if kind == "one_expert":
        assert int(handle.num_recv_tokens[0]) == N and int(handle.num_recv_tokens[1]) == 0

    want = oracle.combine(y, expected, T)
    assert_bits_equal(bits(out).reshape(R, T, H), oracle.bf16_bits(want), f"{where}: combine")
    w_rows = np.zeros((R, N, K), np.float32)
    for r in range(R):
        w_rows[r, : len(expected[r]["w"])] = np.reshape(expected[r]["w"], (-1, K))
    assert_bits_equal(out_w.reshape(R, T, K), oracle.combine(w_rows, expected, T), f"{where}: combined weights")


@pytest.mark.parametrize("kind", testing.ROUTING_KINDS)
def test_normal_mode_bf16(mesh, normal_buffer, kind, rng):
    check_normal_mode(normal_buffer, mesh, kind, fp8=False, seed=int(rng.integers(1 << 31)))


@pytest.mark.parametrize("kind", ["random", "minus_one"])
def test_normal_mode_fp8(mesh, normal_buffer, kind, rng):
    check_normal_mode(normal_buffer, mesh, kind, fp8=True, seed=int(rng.integers(1 << 31)))


# Low-latency mode ------------------------------------------------------------


@functools.cache
def low_latency_step(buffer, use_fp8, round_scale):
    def step(x, idx, w, y):
        recv_x, count, handle = deep_ep_jax.low_latency_dispatch(
            x,
            idx,
            buffer=buffer,
            num_max_dispatch_tokens_per_rank=LOW_LATENCY_TOKENS,
            num_experts=NUM_EXPERTS,
            use_fp8=use_fp8,
            round_scale=round_scale,
        )
        out = deep_ep_jax.low_latency_combine(y, idx, w, handle, buffer=buffer)
        return recv_x, count, handle, out

    return step


def check_low_latency(buffer, mesh, kind, use_fp8, round_scale, seed, exact_division):
    """exact_division: whether the backend's 1 / scale is IEEE (the reference
    backend on CPU) rather than div.full.f32 (the kernels)."""
    rng = np.random.default_rng(seed)
    R, T, M, H, E, K = NUM_RANKS, LOW_LATENCY_TOKENS, LOW_LATENCY_TOKENS, HIDDEN, NUM_EXPERTS, TOPK
    L = E // R  # local experts
    idx, w = testing.make_routing(seed, R * T, E, K, R, kind)
    x = wide_range_bf16(rng, (R * T, H))
    xs, idxs, ws = np.asarray(x, np.float32).reshape(R, T, H), idx.reshape(R, T, K), w.reshape(R, T, K)
    expected = oracle.low_latency_dispatch(xs, idxs, E, M)
    counts = np.array([[len(slots) for slots in experts] for experts in expected])
    # Expert outputs: fresh rows, NaN past each expert's count (never to be read).
    y = nan_bf16((R, L, R * M, H))
    for r in range(R):
        for e in range(L):
            y[r, e, : counts[r, e]] = random_bf16(rng, (counts[r, e], H))

    data_dtype = ml_dtypes.float8_e4m3fn if use_fp8 else ml_dtypes.bfloat16
    outputs = [
        ((L, R * M, H), data_dtype),
        ((L,), np.int32),
        ((L, R * M), np.int32),
        ((L, R * M), np.int32),
        ((L, R * M), np.int32),
        ((T, H), ml_dtypes.bfloat16),
    ]
    testing.poison_allocator(mesh, AXIS, outputs + ([((L, R * M, H // 128), np.float32)] if use_fp8 else []))
    recv_x, count, handle, out = run_per_rank(
        buffer,
        mesh,
        low_latency_step(buffer, use_fp8, round_scale),
        x,
        jnp.asarray(idx),
        jnp.asarray(w),
        y.reshape(R * L, R * M, H),
    )

    where = f"low-latency, {kind}, {'FP8' if use_fp8 else 'bf16'}{', round_scale' if round_scale else ''}, seed {seed}"
    np.testing.assert_array_equal(count, counts, err_msg=f"{where}: recv_count")
    np.testing.assert_array_equal(handle.recv_count, counts, err_msg=f"{where}: handle.recv_count")
    # Every valid row: (rank r, expert e, row j) came from (source s, token t, slot k).
    valid = np.arange(R * M)[None, None, :] < counts[:, :, None]
    r, e, j = np.nonzero(valid)
    s, t, k = np.array([expected[a][b][c] for a, b, c in zip(r, e, j)], np.int32).reshape(-1, 3).T
    for name, want in (("recv_src_rank", s), ("recv_src_token", t), ("recv_src_topk", k)):
        got = getattr(handle, name)
        assert_bits_equal(got[r, e, j], want, f"{where}: handle.{name}")
        assert (got[~valid] == -1).all(), f"{where}: handle.{name} padding"
    if use_fp8:
        scales = oracle.fp8_scales(xs, round_scale)
        assert_bits_equal(recv_x[1][r, e, j], scales[s, t], f"{where}: scales")
        got = recv_x[0][r, e, j].astype(np.float32)
        if round_scale or exact_division:
            assert_bits_equal(got, oracle.fp8_values(xs, scales)[s, t], f"{where}: FP8 values")
        else:
            bounds = [oracle.fp8_values(xs, scales, u)[s, t] for u in (-DIVISION_ULPS, DIVISION_ULPS)]
            low, high = np.minimum(*bounds), np.maximum(*bounds)
            outside = np.argwhere((got < low) | (got > high))
            assert not len(outside), (
                f"{where}: {len(outside)} FP8 values outside the division's bounds, first at "
                f"{outside[:4].tolist()}: {got[tuple(outside[0])]} not in "
                f"[{low[tuple(outside[0])]}, {high[tuple(outside[0])]}]"
            )
    else:
        assert_bits_equal(recv_x[r, e, j], x.reshape(R, T, H)[s, t], f"{where}: rows")
    if kind == "rank_empty":  # the skew really happened
        assert (counts[-1] == 0).all()
    if kind == "one_expert":
        assert counts[0, 0] == R * T

    want = oracle.low_latency_combine(y, expected, idxs, ws, E)
    assert_bits_equal(bits(out).reshape(R, T, H), oracle.bf16_bits(want), f"{where}: combine")


@pytest.mark.parametrize("kind", ["random", "one_expert", "rank_empty", "out_of_range"])  # FP8 below has minus_one
def test_low_latency_bf16(mesh, low_latency_buffer, kind, rng):
    check_low_latency(low_latency_buffer, mesh, kind, False, False, int(rng.integers(1 << 31)), exact_division=False)


@pytest.mark.parametrize(
    "kind,round_scale",
    [("random", False), ("one_expert", False), ("minus_one", False), ("random", True), ("rank_empty", True)],
)
def test_low_latency_fp8(mesh, low_latency_buffer, kind, round_scale, rng):
    seed = int(rng.integers(1 << 31))
    check_low_latency(low_latency_buffer, mesh, kind, True, round_scale, seed, exact_division=False)
