"""grouped_matmul's Mosaic GPU path (backend="cuda") on a Hopper GPU, at the MoE
benchmark's shapes per rank: 32768 (row, expert) pairs in M = 33000 rows
(the rest padding; not a multiple of 128, so the wrapper pads), G = 128 local
experts, the SwiGLU's two matmuls (K=7168, N=4096 and K=2048, N=7168).

Forward, dx and dw against plain dots one group at a time on the whole arrays
(per_group_reference) and against numpy in float64 on sampled rows
and dw blocks (boundary rows of the groups, the biggest group, the first and
last ones). Padding rows and empty groups must come out exactly zero: before
the kernels run, the allocator is handed freed NaN arrays of the outputs'
sizes, which it tends to give back for them, so zeros a kernel leaves to
fresh memory show. Group sizes: skewed loads with empty groups, and every
row in one group.
Then a small case per rank under shard_map on two GPUs.

    pytest -m gpu tests/gpu/test_grouped_gemm_gpu.py -v

Fails (does not skip) on a GPU that is not a Hopper one: backend="auto" must pick
the Mosaic GPU kernels there.
"""

import dataclasses
import functools

import grouped_gemm_oracle as oracle
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from deep_ep_jax import grouped_matmul, testing
from deep_ep_jax.experts import grouped_gemm as gg
from deep_ep_jax.experts import hopper_gemm

pytestmark = pytest.mark.gpu(min_gpus=1)  # one GPU, but the shard_map case

NUM_PAIRS, NUM_ROWS, NUM_GROUPS = 32768, 33000, 128
LAYERS = {"w_in": (7168, 4096), "w_out": (2048, 7168)}  # (K, N): gate+up of ffn 2048, then down
# bf16 outputs of float32 sums in different orders: each value within 1% of itself (a bf16 step is 0.4-0.8%)
# plus 1% of the array's largest value (excess_error, assert_close_numpy).
RTOL = 1e-2


@pytest.fixture(scope="module", autouse=True)
def hopper():
    device = jax.devices("gpu")[0]
    if not gg.is_hopper_gpu(device):
        pytest.fail(
            f"the Mosaic GPU kernels need a Hopper GPU (compute capability 9.x); this is "
            f"{device.device_kind}, {getattr(device, 'compute_capability', '?')}",
            pytrace=False,
        )


def routed_sizes(rng, kind):
    """Group sizes of this rank's 128 experts for 32768 pairs: skewed loads
    (Dirichlet, alpha 0.5) with four experts nobody picks (the first and the
    last among them), or every pair in one expert."""
    if kind == "all_in_one":
        sizes = np.zeros(NUM_GROUPS, np.int64)
        sizes[77] = NUM_PAIRS
    else:
        popularity = rng.dirichlet(np.full(NUM_GROUPS, 0.5))
        popularity[[0, 31, 64, NUM_GROUPS - 1]] = 0
        sizes = rng.multinomial(NUM_PAIRS, popularity / popularity.sum())
    return sizes.astype(np.int32)


def make_inputs(key, k, n, num_rows=NUM_ROWS):
    """x [M, K], w [G, K, N], dy [M, N] in bf16, outputs of order 1; padding rows
    of x and dy hold finite junk (1e3), which must not leak into any result."""
    kx, kw, kd = jax.random.split(key, 3)
    x = jax.random.normal(kx, (num_rows, k), jnp.bfloat16)
    w = jax.random.normal(kw, (NUM_GROUPS, k, n), jnp.bfloat16) * jnp.bfloat16(1 / np.sqrt(k))
    dy = jax.random.normal(kd, (num_rows, n), jnp.bfloat16)
    return x, w, dy


def poison_outputs(*shapes):
    """Hands the allocator freed bf16 NaN arrays of these shapes (made on the GPU), which it tends to give
    back for the next outputs."""
    jax.block_until_ready([jnp.full(shape, jnp.nan, jnp.bfloat16) for shape in shapes])


def output_shapes(x, w):
    """The shapes of y [M, N], dx [M, K] and dw [G, K, N] for x [M, K], w [G, K, N]."""
    return (x.shape[0], w.shape[2]), x.shape, w.shape


def with_junk_padding(a, total):
    rows = jnp.arange(a.shape[0])[:, None] >= total
    return jnp.where(rows, jnp.asarray(1e3, a.dtype), a)


def group_pair_rows(num_rows, sizes, counts):
    """bool [num_rows]: the first counts[g] rows of each group g (its pairs)."""
    rows = np.zeros(num_rows, bool)
    for start, count in zip(oracle.offsets(sizes), counts):
        rows[start : start + count] = True
    return rows


@functools.partial(jax.jit, static_argnames=("backend", "aligned_groups"))
def forward_and_grads(x, w, sizes, dy, backend, aligned_groups=False):
    y, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, sizes, backend=backend, aligned_groups=aligned_groups), x, w)
    return (y, *vjp(dy))


@functools.partial(jax.jit, static_argnames="window")
def _per_group_reference(x, w, sizes, dy, window):
    def dot(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    num_rows = x.shape[0]
    starts = jnp.cumsum(sizes) - sizes
    # window zero rows past the end, so that no group's window is clamped (which would shift its rows).
    x, dy = (jnp.pad(a, ((0, window), (0, 0))) for a in (x, dy))

    def group(g, outputs):
        y, dx, dw = outputs
        start, rows = starts[g], (jnp.arange(window) < sizes[g])[:, None]
        xg = jnp.where(rows, jax.lax.dynamic_slice_in_dim(x, start, window), 0)
        dyg = jnp.where(rows, jax.lax.dynamic_slice_in_dim(dy, start, window), 0)
        # Rows past the group keep what the groups after it wrote (they come later in the loop).
        y = jax.lax.dynamic_update_slice_in_dim(
            y, jnp.where(rows, dot(xg, w[g]), jax.lax.dynamic_slice_in_dim(y, start, window)), start, 0
        )
        dx = jax.lax.dynamic_update_slice_in_dim(
            dx, jnp.where(rows, dot(dyg, w[g].T), jax.lax.dynamic_slice_in_dim(dx, start, window)), start, 0
        )
        return y, dx, dw.at[g].set(dot(xg.T, dyg))

    init = (jnp.zeros((x.shape[0], w.shape[2]), jnp.bfloat16), jnp.zeros_like(x), jnp.zeros_like(w))
    y, dx, dw = jax.lax.fori_loop(0, w.shape[0], group, init)
    return y[:num_rows], dx[:num_rows], dw


def per_group_reference(x, w, sizes, dy):
    """(y, dx, dw) one group at a time with plain dots (float32 sums) on a
    window of the largest group's rows, the rows outside the group masked to
    zero: the whole-array reference, one dot shape per matmul (so it compiles
    once, not once per group size). jax.lax.ragged_dot is no reference here:
    without JAX's Pallas-Triton lowering (absent in 0.11.2) XLA makes it a
    dense dot over all groups, 60 GB at these shapes."""
    sizes = np.asarray(sizes, np.int32)
    window = int(-(-max(int(sizes.max()), 1) // 128) * 128)
    return _per_group_reference(x, w, jnp.asarray(sizes), dy, window)


@jax.jit
def excess_error(got, want):
    """max(|got - want| - RTOL |want|) / max|want|: <= RTOL when close."""
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return jnp.max(jnp.abs(got - want) - RTOL * jnp.abs(want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-6)


def assert_close_numpy(got, want, what):
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * max(np.abs(want).max(), 1e-6), err_msg=what)


def sampled_groups(rng, sizes):
    """Groups to check against numpy: the biggest, the first and last non-empty, three more."""
    nonempty = np.flatnonzero(sizes)
    picks = {int(np.argmax(sizes)), int(nonempty[0]), int(nonempty[-1])}
    picks |= set(rng.choice(nonempty, min(3, len(nonempty)), replace=False).tolist())
    return sorted(picks)


def check_against_numpy(rng, x, w, sizes, dy, y, dx, dw, what, data_rows=None):
    """data_rows (bool [M], optional): the rows of x and dy that y and dx are of (0 on the others)."""
    starts = oracle.offsets(sizes)
    for g in sampled_groups(rng, sizes):
        start, size = int(starts[g]), int(sizes[g])
        # Its first and last two rows (where tiles straddle groups) and eight more.
        rows = np.unique(
            np.concatenate(
                [[start, start + 1, start + size - 2, start + size - 1], rng.integers(start, start + size, 8)]
            ).clip(start, start + size - 1)
        )
        xg, dyg, wg = (np.asarray(a, np.float64) for a in (x[rows], dy[rows], w[g]))
        if data_rows is not None:
            xg, dyg = (a * data_rows[rows][:, None] for a in (xg, dyg))
        assert_close_numpy(y[rows], xg @ wg, f"{what}: y, group {g}, rows {rows.tolist()}")
        assert_close_numpy(dx[rows], dyg @ wg.T, f"{what}: dx, group {g}, rows {rows.tolist()}")
        # A 256 x 256 block of dw[g] over all the group's rows.
        k0 = int(rng.integers(0, x.shape[1] - 256 + 1))
        n0 = int(rng.integers(0, dy.shape[1] - 256 + 1))
        x_block = np.asarray(x[start : start + size, k0 : k0 + 256], np.float64)
        dy_block = np.asarray(dy[start : start + size, n0 : n0 + 256], np.float64)
        assert_close_numpy(
            dw[g, k0 : k0 + 256, n0 : n0 + 256],
            x_block.T @ dy_block,
            f"{what}: dw[{g}] block at ({k0}, {n0}), {size} rows",
        )


@pytest.mark.parametrize("aligned", [False, True], ids=["row_tiled", "aligned"])
@pytest.mark.parametrize("kind", ["routed", "all_in_one"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_mgpu_matches_reference_and_numpy(layer, kind, aligned, rng):
    """Group sizes as routed, or rounded up to gg.aligned_rows() (the
    warp-specialized kernels' case; the others take the row-tiled kernels)."""
    seed = int(rng.integers(1 << 30))
    k, n = LAYERS[layer]
    sizes = routed_sizes(rng, kind)
    if aligned:
        sizes = (-(-sizes // gg.aligned_rows()) * gg.aligned_rows()).astype(np.int32)
    total = int(sizes.sum())
    num_rows = max(NUM_ROWS, total + 200)  # the aligned groups need more rows
    x, w, dy = make_inputs(jax.random.key(seed), k, n, num_rows)
    x, dy = with_junk_padding(x, total), with_junk_padding(dy, total)
    what = (
        f"{layer} {kind} {'aligned ' if aligned else ''}(seed {seed}, {total} rows, "
        f"{int((sizes == 0).sum())} empty groups)"
    )

    # Both kernel families are in the program (lax.cond on the sizes), three calls each.
    lowered = forward_and_grads.lower(x, w, sizes, dy, backend="auto").as_text()
    assert lowered.count("custom_call @mosaic_gpu") == 6, f"{what}: backend='auto' did not pick the Mosaic GPU kernels"

    poison_outputs(*output_shapes(x, w))
    got = forward_and_grads(x, w, sizes, dy, backend="cuda")
    want = per_group_reference(x, w, sizes, dy)
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        assert g.shape == r.shape and g.dtype == r.dtype == jnp.bfloat16, (what, name, g.shape, g.dtype)
        assert bool(jnp.all(jnp.isfinite(g))), f"{what}: {name} has non-finite values"
        err = float(excess_error(g, r))
        assert err <= RTOL, f"{what}: {name}, mgpu vs per-group dots, max excess error {err:.3g} of the scale"
    if aligned:  # the promise (no lax.cond): the same kernels, the same bits
        promised = forward_and_grads(x, w, sizes, dy, backend="cuda", aligned_groups=True)
        for name, g, p in zip(("y", "dx", "dw"), got, promised):
            assert bool(jnp.all(g == p)), f"{what}: {name} with aligned_groups=True differs"
    y, dx, dw = got
    assert not bool(jnp.any(y[total:])), f"{what}: padding rows of y are not zero"
    assert not bool(jnp.any(dx[total:])), f"{what}: dx of padding rows is not zero"
    nonzero_groups = np.asarray(jnp.any(dw != 0, axis=(1, 2)))
    assert not nonzero_groups[sizes == 0].any(), f"{what}: dw of empty groups is not zero"
    check_against_numpy(rng, x, w, sizes, dy, y, dx, dw, what)


@pytest.mark.parametrize("kind", ["routed", "all_in_one"])
def test_valid_sizes_leave_out_padding_rows(kind, rng):
    """The expert-major layout's case: groups rounded up to gg.aligned_rows(),
    valid_sizes their pairs. Junk (1e3) on every padding row of x and dy,
    inside the groups and past them; y and dx must be exactly zero there, and
    y, dx and dw equal the per-group dots of the pair rows alone (the weight
    gradient's kernel stops at the row step that covers a group's pairs)."""
    seed = int(rng.integers(1 << 30))
    k, n = LAYERS["w_in"]
    counts = routed_sizes(rng, kind)
    sizes = (-(-counts // gg.aligned_rows()) * gg.aligned_rows()).astype(np.int32)
    num_rows = int(sizes.sum()) + 200
    pair_rows = group_pair_rows(num_rows, sizes, counts)
    x, w, dy = make_inputs(jax.random.key(seed), k, n, num_rows)
    junk = jnp.asarray(~pair_rows)[:, None]
    x_junk, dy_junk = (jnp.where(junk, jnp.asarray(1e3, a.dtype), a) for a in (x, dy))
    what = f"valid_sizes, {kind} (seed {seed}, {int(counts.sum())} pairs in {int(sizes.sum())} rows)"

    @jax.jit
    def run(x, w, dy):
        y, vjp = jax.vjp(
            lambda x, w: grouped_matmul(
                x, w, jnp.asarray(sizes), backend="cuda", aligned_groups=True, valid_sizes=jnp.asarray(counts)
            ),
            x,
            w,
        )
        return (y, *vjp(dy))

    poison_outputs(*output_shapes(x, w))
    got = run(x_junk, w, dy_junk)
    zeroed = [jnp.where(junk, jnp.zeros((), a.dtype), a) for a in (x, dy)]
    want = per_group_reference(zeroed[0], w, sizes, zeroed[1])
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        assert bool(jnp.all(jnp.isfinite(g))), f"{what}: {name} has non-finite values"
        err = float(excess_error(g, r))
        assert err <= RTOL, f"{what}: {name} vs per-group dots of the pairs, max excess error {err:.3g} of the scale"
    for name, g in zip(("y", "dx"), got[:2]):
        assert not bool(jnp.any(jnp.where(junk, g, 0))), f"{what}: {name} is not zero on padding rows"


def test_broken_promise_makes_everything_nan(rng):
    """aligned_groups=True with sizes that are not multiples of
    gg.aligned_rows(): the warp-specialized kernels run anyway (there is no
    lax.cond to fall back on) and every value of y, dx and dw is NaN (the
    kernels' scale), never silently wrong."""
    k, n, num_rows = 512, 256, 512
    x = rng.standard_normal((num_rows, k)).astype(jnp.bfloat16)
    w = rng.standard_normal((4, k, n)).astype(jnp.bfloat16)
    dy = rng.standard_normal((num_rows, n)).astype(jnp.bfloat16)
    sizes = np.array([128, 1, 127, 0], np.int32)
    lowered = forward_and_grads.lower(x, w, sizes, dy, backend="cuda", aligned_groups=True).as_text()
    assert lowered.count("custom_call @mosaic_gpu") == 3, "aligned_groups=True: the three aligned kernels alone"
    for name, got in zip(("y", "dx", "dw"), forward_and_grads(x, w, sizes, dy, backend="cuda", aligned_groups=True)):
        assert bool(jnp.all(jnp.isnan(got))), f"a broken promise: {name} is not NaN everywhere"


@jax.jit
def norm_ratio(got, want):
    """|got - want| / |want| in float32, jitted: one fused reduction (dw's float32 copies alone would
    take 14 GiB, more than an H100 leaves)."""
    diff, want = (got - want).astype(jnp.float32), want.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(diff * diff)) / jnp.sqrt(jnp.sum(want * want))


def check_against_reference(what, got, want, data):
    """got, want: (y, dx, dw); want from per-group dots. Every value finite, within RTOL
    (excess_error), and y and dx exactly 0 off the pairs (data: bool [M, 1], the pair rows)."""
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        assert bool(jnp.all(jnp.isfinite(g))), f"{what}: {name} has non-finite values"
        err = float(excess_error(g, r))
        assert err <= RTOL, f"{what}: {name} vs per-group dots, max excess error {err:.3g} of the scale"
    for name, g in zip(("y", "dx"), got[:2]):
        assert not bool(jnp.any(jnp.where(data, 0, g))), f"{what}: {name} is not 0 on rows that are not pairs"


@pytest.mark.parametrize("walk", ["tile_by_tile", "steady_pipeline", "group_bands"])
@pytest.mark.parametrize("kind", ["routed", "all_in_one"])
def test_aligned_kernels_directly(kind, walk, rng):
    """deep_ep_jax.experts.hopper_gemm's kernels called straight (no lax.cond to fall
    back on), aligned groups with empty ones and tiles past the last group,
    at the w_in layer's shapes, against the per-group dots; also with a CTA's
    tiles as one pipeline (HopperTiles.steady_pipeline: a pipeline of
    pipelines in rows_matmul, one ring over every row step in weight_grad),
    and with rows_matmul's tiles walked in bands that end with a group
    (HopperTiles.group_bands). rows_matmul's data rows are each group's
    pairs (the rest of x and dy random, not zero): its output must be
    exactly 0 on every other row, the tiles past the groups included (it
    stores their zeros itself)."""
    seed = int(rng.integers(1 << 30))
    k, n = LAYERS["w_in"]
    tiles = gg.DEFAULT_ALIGNED_TILES
    if walk == "steady_pipeline":
        tiles = gg.AlignedTiles(
            *(dataclasses.replace(getattr(tiles, f.name), steady_pipeline=True) for f in dataclasses.fields(tiles))
        )
    elif walk == "group_bands":
        tiles = dataclasses.replace(
            tiles,
            forward=dataclasses.replace(tiles.forward, group_bands=True),
            input_grad=dataclasses.replace(tiles.input_grad, group_bands=True),
        )
    align = gg.aligned_rows()
    counts = routed_sizes(rng, kind)
    sizes = (-(-counts // align) * align).astype(np.int32)
    total = int(sizes.sum())
    num_rows = -(-(total + 3 * align) // align) * align  # three row tiles past the last group
    x, w, dy = make_inputs(jax.random.key(seed), k, n, num_rows)
    jsizes, jcounts, unit = jnp.asarray(sizes), jnp.asarray(counts), jnp.ones((1,), jnp.float32)

    def rows_matmul(a, w, t, transpose_rhs=False):
        return gg._rows_matmul(a, w, jsizes, jcounts, unit, t, transpose_rhs=transpose_rhs)

    poison_outputs(*output_shapes(x, w))
    y = jax.jit(lambda x, w: rows_matmul(x, w, tiles.forward))(x, w)
    dx = jax.jit(lambda dy, w: rows_matmul(dy, w, tiles.input_grad, transpose_rhs=True))(dy, w)
    dw = jax.jit(
        lambda x, dy: hopper_gemm.weight_grad(
            x, dy, jnp.cumsum(jsizes) - jsizes, jsizes // tiles.weight_grad.tile_k, unit, tiles.weight_grad
        )
    )(x, dy)
    pair_rows = group_pair_rows(num_rows, sizes, counts)
    data = jnp.asarray(pair_rows)[:, None]
    pairs_only = [jnp.where(data, a, jnp.zeros((), a.dtype)) for a in (x, dy)]
    want_y, want_dx, _ = per_group_reference(*pairs_only[:1], w, sizes, pairs_only[1])
    want_dw = per_group_reference(x, w, sizes, dy)[2]  # dw: every row of the groups
    what = f"aligned kernels, {walk}, {kind} (seed {seed}, {total} rows, {int((sizes == 0).sum())} empty groups)"
    check_against_reference(what, (y, dx, dw), (want_y, want_dx, want_dw), data)
    assert not bool(jnp.any(dw[sizes == 0])), f"{what}: dw of empty groups is not zero"
    check_against_numpy(rng, x, w, sizes, dy, y, dx, dw, what, pair_rows)


@pytest.mark.gpu(min_gpus=2)
def test_mgpu_per_rank_under_shard_map(rng):
    """Two GPUs, each its own experts and sizes (one all in one group, one
    skewed with padding), shard_map with check_vma, against numpy."""
    num_ranks, num_rows, num_groups, k, n = 2, 4096, 8, 1024, 512
    mesh = testing.ep_mesh(num_ranks, "ep", platform="gpu")
    sizes = [np.array([0, 0, 3000, 0, 0, 0, 0, 0], np.int32), np.array([700, 0, 1, 129, 1000, 0, 900, 1], np.int32)]
    x = rng.standard_normal((num_ranks * num_rows, k)).astype(jnp.bfloat16)
    w = (rng.standard_normal((num_ranks * num_groups, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = rng.standard_normal((num_ranks * num_rows, n)).astype(jnp.bfloat16)

    def per_rank(x, w, sizes, dy):
        y, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, sizes, backend="cuda"), x, w)
        return (y, *vjp(dy))

    run = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    y, dx, dw = (np.asarray(a, np.float64) for a in run(x, w, np.concatenate(sizes), dy))
    for r in range(num_ranks):
        rows, groups = slice(r * num_rows, (r + 1) * num_rows), slice(r * num_groups, (r + 1) * num_groups)
        what = f"rank {r}, sizes {sizes[r].tolist()}"
        assert_close_numpy(y[rows], oracle.forward(x[rows], w[groups], sizes[r]), f"{what}: y")
        assert_close_numpy(dx[rows], oracle.input_grad(dy[rows], w[groups], sizes[r]), f"{what}: dx")
        assert_close_numpy(dw[groups], oracle.weight_grad(x[rows], dy[rows], sizes[r]), f"{what}: dw")
        total = int(sizes[r].sum())
        assert not y[rows][total:].any() and not dx[rows][total:].any(), f"{what}: padding rows"


@jax.jit
def _fp8_operands(x, w, dy):
    """What grouped_matmul's FP8 path computes with, for x and dy zero off the
    pairs: x and dy quantized per row (dequantized, bf16), w's forward and
    input-gradient copies (dequantized, bf16, both [G, K, N]); for dw, x's FP8
    values (bf16) and z = dy * x's row scales quantized per column, as float8
    z^T [N, M] and its scales [N]. (Quantized as grouped_matmul quantizes: by
    fp8_quant's kernels, which tests/gpu/test_fp8_quant_gpu.py checks against
    numpy. The barriers keep XLA from dropping a
    float -> float8 -> float pair of converts, which it may do on GPUs: excess
    precision is allowed by default.)"""

    def rows(a):
        data, scales = lax.optimization_barrier(gg.quantize_rows(a))
        return data.astype(jnp.float32), scales[..., None]

    (x_values, x_scales), (dy_values, dy_scales) = rows(x), rows(dy)
    z_t, z_scales = lax.optimization_barrier(gg.quantize_rows((dy.astype(jnp.float32) * x_scales).T))
    w8 = lax.optimization_barrier(gg.fp8_weights(w))
    forward = jnp.swapaxes(w8.forward.astype(jnp.float32) * w8.forward_scales[..., None], 1, 2)
    input_grad = w8.input_grad.astype(jnp.float32) * w8.input_grad_scales[..., None]
    bf16 = lambda a: a.astype(jnp.bfloat16)
    return (
        bf16(x_values * x_scales),
        bf16(forward),
        bf16(input_grad),
        bf16(dy_values * dy_scales),
        bf16(x_values),
        z_t,
        z_scales,
    )


@pytest.mark.parametrize("weight_grad", [False, True], ids=["bf16_dw", "fp8_dw"])
@pytest.mark.parametrize("kind", ["routed", "all_in_one"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_fp8_matches_dequantized_reference_and_numpy(layer, kind, weight_grad, rng):
    """fp8_weights= on the warp-specialized kernels (FP8 WGMMA for y and dx,
    and for dw with weight_grad=True, else bf16): groups aligned to 128 whose
    first rows are the pairs (valid_sizes), finite junk on every other row of
    x and dy, a row tile past the groups. y, dx and dw against per-group dots
    of the operands they are computed from (dequantized), and against numpy on
    sampled rows (y and dx, numpy's own quantization) and dw blocks; all three
    near the bf16 maths; y and dx exactly 0 off the pairs."""
    seed = int(rng.integers(1 << 30))
    k, n = LAYERS[layer]
    align = gg.aligned_rows()
    counts = routed_sizes(rng, kind)
    sizes = (-(-counts // align) * align).astype(np.int32)
    total = int(sizes.sum())
    num_rows = total + align
    pair_rows = group_pair_rows(num_rows, sizes, counts)
    data = jnp.asarray(pair_rows)[:, None]
    x, w, dy = make_inputs(jax.random.key(seed), k, n, num_rows)
    x, dy = (jnp.where(data, a, jnp.asarray(1e3, a.dtype)) for a in (x, dy))
    jsizes, jcounts = jnp.asarray(sizes), jnp.asarray(counts)

    @jax.jit
    def run(x, w, dy):
        w8 = gg.fp8_weights(w, weight_grad=weight_grad)
        y, vjp = jax.vjp(
            lambda x, w: grouped_matmul(
                x, w, jsizes, backend="cuda", aligned_groups=True, valid_sizes=jcounts, fp8_weights=w8
            ),
            x,
            w,
        )
        return (y, *vjp(dy))

    poison_outputs(*output_shapes(x, w))
    y, dx, dw = run(x, w, dy)
    pairs_only = [jnp.where(data, a, jnp.zeros((), a.dtype)) for a in (x, dy)]
    xq, w_forward, w_input_grad, dyq, x_values, z_t, z_scales = _fp8_operands(pairs_only[0], w, pairs_only[1])
    want_y = per_group_reference(xq, w_forward, sizes, dyq)[0]
    want_dx = per_group_reference(xq, w_input_grad, sizes, dyq)[1]
    bf16 = per_group_reference(*pairs_only[:1], w, sizes, pairs_only[1])
    if weight_grad:
        z = (z_t.astype(jnp.float32) * z_scales[:, None]).T.astype(jnp.bfloat16)
        want_dw = per_group_reference(x_values, w, sizes, z)[2]
    else:
        want_dw = bf16[2]
    what = (
        f"fp8 {layer}, {'FP8' if weight_grad else 'bf16'} dw, {kind} (seed {seed}, {total} rows, "
        f"{int((counts == 0).sum())} empty groups)"
    )
    check_against_reference(what, (y, dx, dw), (want_y, want_dx, want_dw), data)
    # FP8 is FP8: each result within 10% (as a norm) of the bf16 maths, so no scale is missing or wrong.
    for name, got, want in zip(("y", "dx", "dw"), (y, dx, dw), bf16):
        ratio = float(norm_ratio(got, want))
        assert ratio <= 0.1, f"{what}: {name} is {ratio:.3f} of the bf16 result's norm away from it"
    # numpy's own quantization on sampled rows of sampled groups (float64 products).
    starts = oracle.offsets(sizes)
    for g in sampled_groups(rng, counts):
        start, count = int(starts[g]), int(counts[g])
        rows = np.unique(np.concatenate([[start, start + count - 1], rng.integers(start, start + count, 6)]))
        w_forward_g, w_input_grad_g = (a[0] for a in oracle.fp8_weights(np.asarray(w[g : g + 1], np.float32)))
        assert_close_numpy(
            y[rows],
            oracle.fp8_rows(np.asarray(x[rows], np.float32)) @ w_forward_g,
            f"{what}: y, group {g}, rows {rows.tolist()}",
        )
        assert_close_numpy(
            dx[rows],
            oracle.fp8_rows(np.asarray(dy[rows], np.float32)) @ w_input_grad_g.T,
            f"{what}: dx, group {g}, rows {rows.tolist()}",
        )
        # A 128 x 128 block of dw[g] over the group's pairs, from the same operands (FP8 or bf16).
        k0, n0 = int(rng.integers(0, k - 128 + 1)), int(rng.integers(0, n - 128 + 1))
        pairs = slice(start, start + count)
        if weight_grad:
            x_block = np.asarray(x_values[pairs, k0 : k0 + 128], np.float64)
            z_block = np.asarray(z_t[n0 : n0 + 128, pairs], np.float64).T * np.asarray(z_scales[n0 : n0 + 128])
        else:
            x_block, z_block = (np.asarray(a, np.float64) for a in (x[pairs, k0 : k0 + 128], dy[pairs, n0 : n0 + 128]))
        assert_close_numpy(
            dw[g, k0 : k0 + 128, n0 : n0 + 128],
            x_block.T @ z_block,
            f"{what}: dw[{g}] block at ({k0}, {n0}), {count} pairs",
        )


@pytest.mark.parametrize("scale", [1.0, 0.7])
@pytest.mark.parametrize("shape", [(256, 256, 3), (2048, 2048, 8)], ids=["one_tile_per_cta", "tiles_per_cta"])
def test_fp8_weight_grad_kernel(shape, scale, rng):
    """hopper_gemm.weight_grad on FP8 operands called straight: groups of 0
    to 6 row steps of 128 rows (those over 4 promoted in halves), K x N small
    enough that each CTA gets at most one tile, or large enough for several
    per CTA, with a `scale` of 1 or not (the kernel takes the column scales
    times it). dw against float32 dots of the same FP8 values times the
    column scales and `scale`; the empty groups' dw exactly zero."""
    k, n, num_groups = shape
    tiles = gg.DEFAULT_ALIGNED_TILES.fp8_weight_grad
    seed = int(rng.integers(1 << 30))
    steps = np.resize(np.array([3, 0, 1, 5, 4, 6, 2, 3], np.int32), num_groups)
    sizes = steps * tiles.tile_k
    num_rows = int(sizes.sum())
    kx, kz, ks = jax.random.split(jax.random.key(seed), 3)
    x_t = (jax.random.normal(kx, (k, num_rows), jnp.float32) * 8).astype(jnp.float8_e4m3fn)
    z_t = (jax.random.normal(kz, (n, num_rows), jnp.float32) * 8).astype(jnp.float8_e4m3fn)
    col_scales = jax.random.uniform(ks, (n,), jnp.float32, 0.5, 2.0)
    starts = jnp.asarray(np.cumsum(sizes) - sizes, jnp.int32)
    poison_outputs((num_groups, k, n))
    dw = jax.jit(
        lambda x_t, z_t, c: hopper_gemm.weight_grad(
            x_t,
            z_t,
            starts,
            jnp.asarray(steps),
            jnp.full((1,), scale, jnp.float32),
            tiles,
            transposed=True,
            col_scales=c,
            out_dtype=jnp.bfloat16,
        )
    )(x_t, z_t, col_scales)
    x32, z32 = np.asarray(x_t, np.float32), np.asarray(z_t, np.float32)
    what = f"fp8 weight_grad, K x N {k} x {n}, scale {scale} (seed {seed})"
    for g in range(num_groups):
        rows = slice(int(starts[g]), int(starts[g]) + int(sizes[g]))
        got = np.asarray(dw[g], np.float32)
        if sizes[g] == 0:
            assert not got.any(), f"{what}: dw[{g}] of an empty group is not zero"
            continue
        want = (x32[:, rows] @ z32[:, rows].T) * np.asarray(col_scales)[None, :] * scale
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        assert err <= RTOL, f"{what}: dw[{g}] ({steps[g]} row steps) off by {err:.3g} of its largest value"
