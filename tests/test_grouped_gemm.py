"""grouped_matmul on CPU (the jax.lax.ragged_dot path) against numpy maths
group by group (tests/grouped_gemm_oracle.py): forward, dx and dw, with empty
groups, one group holding every row, padding rows, G = 1, under jit, grad
and shard_map on 8 CPU devices; bad arguments; and the Mosaic GPU path traced
and lowered for a GPU (its shapes, custom_vjp and shard_map types), which
needs no GPU."""

import dataclasses
import functools

import grouped_gemm_oracle as oracle
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from deep_ep_jax import _native, fp8_quant, grouped_matmul, testing
from deep_ep_jax.experts import grouped_gemm as gg
from deep_ep_jax.experts import hopper_gemm

K, N = 32, 48
# bf16 products with float32 sums: the output's rounding (2^-9 relative) dominates.
RTOL = 1e-2


def make_sizes(rng, kind, num_rows, num_groups):
    """int32 group sizes of `kind`; their sum is num_rows unless kind says less."""
    if kind == "all_in_one":
        sizes = np.zeros(num_groups, np.int64)
        sizes[rng.integers(num_groups)] = num_rows
    elif kind == "all_empty":
        sizes = np.zeros(num_groups, np.int64)
    else:
        total = num_rows if kind == "random" else int(rng.integers(1, num_rows))  # "padding": sum < M
        cuts = np.sort(rng.integers(0, total + 1, num_groups - 1))
        sizes = np.diff(np.concatenate([[0], cuts, [total]]))
        if num_groups > 2:
            sizes[rng.integers(num_groups)] += sizes[0]  # at least one empty group
            sizes[0] = 0
    return sizes.astype(np.int32)


def make_inputs(rng, num_rows, num_groups, sizes):
    """bf16 x, w, dy; x's and dy's padding rows hold large finite junk, which must not leak."""
    x = rng.standard_normal((num_rows, K))
    w = rng.standard_normal((num_groups, K, N)) / np.sqrt(K)
    dy = rng.standard_normal((num_rows, N))
    total = int(sizes.sum())
    x[total:] = 1e4 * rng.standard_normal((num_rows - total, K))
    dy[total:] = 1e4
    return (np.asarray(a, ml_dtypes.bfloat16) for a in (x, w, dy))


def assert_close(got, want, what):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(np.abs(want).max(), 1e-3)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale, err_msg=what)


def forward_and_grads(backend="auto"):
    """jitted (x, w, sizes, dy) -> (y, dx, dw): the forward and its vjp at dy."""

    def run(x, w, sizes, dy):
        y, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, sizes, backend=backend), x, w)
        return (y, *vjp(dy))

    return jax.jit(run)


def check_against_oracle(x, w, sizes, dy, y, dx, dw, what):
    total = int(sizes.sum())
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype, what
    assert_close(y, oracle.forward(x, w, sizes), f"{what}: y")
    assert_close(dx, oracle.input_grad(dy, w, sizes), f"{what}: dx")
    assert_close(dw, oracle.weight_grad(x, dy, sizes), f"{what}: dw")
    # Exactly zero, not just small: padding rows and empty groups.
    assert not np.asarray(y[total:], np.float32).any(), f"{what}: padding rows of y"
    assert not np.asarray(dx[total:], np.float32).any(), f"{what}: dx of padding rows"
    assert not np.asarray(dw[sizes == 0], np.float32).any(), f"{what}: dw of empty groups"


@pytest.mark.parametrize(
    "kind,num_groups",
    [
        ("random", 6),
        ("all_in_one", 6),
        ("padding", 6),
        ("all_empty", 4),
        ("random", 1),
        ("padding", 1),
    ],
)
def test_matches_numpy(kind, num_groups, rng):
    num_rows = int(rng.integers(40, 120))
    sizes = make_sizes(rng, kind, num_rows, num_groups)
    x, w, dy = make_inputs(rng, num_rows, num_groups, sizes)
    y, dx, dw = forward_and_grads()(x, w, sizes, dy)
    check_against_oracle(x, w, sizes, dy, y, dx, dw, f"{kind}, sizes {sizes.tolist()}")


def test_float32_gradients_match_ragged_dot_autodiff(rng):
    """In float32, the custom_vjp against JAX's own derivative of ragged_dot."""
    num_rows, num_groups = 70, 5
    sizes = make_sizes(rng, "padding", num_rows, num_groups)
    x, w, dy = (np.asarray(a, np.float32) for a in make_inputs(rng, num_rows, num_groups, sizes))
    x[sizes.sum() :] = 0  # ragged_dot's own rule knows nothing of our padding rows
    dy[sizes.sum() :] = 0
    _, dx, dw = forward_and_grads()(x, w, sizes, dy)
    _, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes, precision="highest"), x, w)
    want_dx, want_dw = vjp(dy)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)


def test_grad_of_a_swiglu_loss(rng):
    """jax.grad through two grouped matmuls (the experts' SwiGLU) against numpy."""
    num_rows, num_groups, ffn = 64, 4, 16
    sizes = make_sizes(rng, "padding", num_rows, num_groups)
    x = np.asarray(rng.standard_normal((num_rows, K)), np.float32)
    w_in = np.asarray(rng.standard_normal((num_groups, K, 2 * ffn)) / np.sqrt(K), np.float32)
    w_out = np.asarray(rng.standard_normal((num_groups, ffn, K)) / np.sqrt(ffn), np.float32)

    def loss(x, w_in, w_out):
        gate, up = jnp.split(grouped_matmul(x, w_in, sizes), 2, axis=-1)
        return jnp.sum(grouped_matmul(jax.nn.silu(gate) * up, w_out, sizes) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w_in, w_out)
    # numpy: forward, then the chain rule by hand.
    h = oracle.forward(x, w_in, sizes)
    gate, up = h[:, :ffn], h[:, ffn:]
    sig = 1 / (1 + np.exp(-gate))
    act = gate * sig * up
    out = oracle.forward(act, w_out, sizes)
    d_out = 2 * out
    d_act = oracle.input_grad(d_out, w_out, sizes)
    d_h = np.concatenate([d_act * up * sig * (1 + gate * (1 - sig)), d_act * gate * sig], axis=1)
    want = (
        oracle.input_grad(d_h, w_in, sizes),
        oracle.weight_grad(x, d_h, sizes),
        oracle.weight_grad(act, d_out, sizes),
    )
    for name, got, w in zip(("dx", "dw_in", "dw_out"), grads, want):
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-4 * np.abs(w).max(), err_msg=name)


def test_aligned_groups_promise(rng):
    """aligned_groups=True: sizes that keep the promise (multiples of
    aligned_rows(), empty groups, the last cut at row M) give the same results
    as without it; one that breaks it makes all of y, dx and dw NaN: never
    silently wrong, on every backend."""
    align = gg.aligned_rows()
    num_groups, num_rows = 4, 5 * align + 40  # M not a multiple of the alignment: the last group is cut

    def run(sizes, aligned_groups):
        def f(x, w, dy):
            y, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, sizes, aligned_groups=aligned_groups), x, w)
            return (y, *vjp(dy))

        return jax.jit(f)(x, w, dy)

    kept = np.array([2, 0, 1, 3], np.int32) * align  # ends past row M
    x, w, dy = make_inputs(rng, num_rows, num_groups, np.minimum(np.cumsum(kept), num_rows)[-1:])
    for got, want, name in zip(run(kept, True), run(kept, False), ("y", "dx", "dw")):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=name)
    broken = np.array([align, 1, align - 1, 0], np.int32)
    for got, name in zip(run(broken, True), ("y", "dx", "dw")):
        assert np.isnan(np.asarray(got, np.float32)).all(), f"a broken promise: {name} must be NaN"
    with pytest.raises(TypeError, match="aligned_groups must be a bool"):
        grouped_matmul(x, w, kept, aligned_groups=1)


def test_group_sizes_are_clamped(rng):
    """Negative sizes count as 0; groups past row M are cut at M."""
    num_rows, num_groups = 30, 4
    given = np.array([-5, 20, 25, 7], np.int32)
    used = np.array([0, 20, 10, 0], np.int32)
    x, w, dy = make_inputs(rng, num_rows, num_groups, used)
    y, dx, dw = forward_and_grads()(x, w, given, dy)
    check_against_oracle(x, w, used, dy, y, dx, dw, "clamped sizes")


def test_valid_sizes_make_the_rest_of_a_group_padding(rng):
    """valid_sizes: a group's rows past its valid count (holding junk here) act
    as padding rows: y and dx exactly zero there, dw without them; counts
    above a group's size are clamped to it, negative ones to 0."""
    num_rows, num_groups = 60, 4
    sizes = np.array([16, 0, 24, 16], np.int32)
    valid = np.array([5, 3, 24, -2], np.int32)  # 3 > 0 and -2 < 0: clamped to 0 and 0
    used = np.array([5, 0, 24, 0], np.int32)
    x, w, dy = make_inputs(rng, num_rows, num_groups, sizes)
    pair = np.zeros(num_rows, bool)
    for start, count in zip(oracle.offsets(sizes), used):
        pair[start : start + count] = True
    x[~pair] = 1e4  # junk on every padding row, inside the groups too
    dy[~pair] = 1e4

    def run(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, sizes, valid_sizes=valid), x, w)
        return (y, *vjp(dy))

    y, dx, dw = jax.jit(run)(x, w, dy)
    zeroed = [np.where(pair[:, None], a, 0).astype(a.dtype) for a in (x, dy)]
    assert_close(y, oracle.forward(zeroed[0], w, sizes), "y")
    assert_close(dx, oracle.input_grad(zeroed[1], w, sizes), "dx")
    assert_close(dw, oracle.weight_grad(zeroed[0], zeroed[1], sizes), "dw")
    assert not np.asarray(y, np.float32)[~pair].any() and not np.asarray(dx, np.float32)[~pair].any()
    with pytest.raises(ValueError, match="valid_sizes must be integers shaped as group_sizes"):
        grouped_matmul(x, w, sizes, valid_sizes=np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="valid_sizes must be integers shaped as group_sizes"):
        grouped_matmul(x, w, sizes, valid_sizes=np.zeros(4, np.float32))


def test_shard_map_per_rank(rng):
    """Per rank under shard_map (check_vma on) over 8 CPU devices: each rank its
    own experts and sizes (one rank all in one group, one with no rows at all)."""
    num_ranks, num_rows, num_groups = 8, 48, 3
    mesh = testing.ep_mesh(num_ranks, "ep", platform="cpu")
    kinds = ["all_in_one", "all_empty"] + ["random", "padding"] * 3
    sizes = [make_sizes(rng, kind, num_rows, num_groups) for kind in kinds]
    inputs = [list(make_inputs(rng, num_rows, num_groups, s)) for s in sizes]
    x, w, dy = (np.concatenate([a[i] for a in inputs]) for i in range(3))
    run = jax.jit(jax.shard_map(forward_and_grads(), mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    y, dx, dw = run(x, w, np.concatenate(sizes), dy)
    for r in range(num_ranks):
        rows, groups = slice(r * num_rows, (r + 1) * num_rows), slice(r * num_groups, (r + 1) * num_groups)
        check_against_oracle(
            *inputs[r][:2],
            sizes[r],
            inputs[r][2],
            y[rows],
            dx[rows],
            dw[groups],
            f"rank {r} ({kinds[r]}, sizes {sizes[r].tolist()})",
        )


def test_shard_map_replicated_weights_sum_their_gradient(rng):
    """Weights replicated over the axis: dw is the sum of every rank's x_g^T dy_g."""
    num_ranks, num_rows, num_groups = 8, 40, 3
    mesh = testing.ep_mesh(num_ranks, "ep", platform="cpu")
    sizes = [make_sizes(rng, "padding", num_rows, num_groups) for _ in range(num_ranks)]
    x = np.asarray(rng.standard_normal((num_ranks * num_rows, K)), np.float32)
    w = np.asarray(rng.standard_normal((num_groups, K, N)), np.float32)

    def loss(x, w, sizes):
        return jax.lax.psum(jnp.sum(grouped_matmul(x, w, sizes)), "ep")

    grad = jax.shard_map(jax.grad(loss, argnums=1), mesh=mesh, in_specs=(P("ep"), P(), P("ep")), out_specs=P())
    dw = jax.jit(grad)(x, w, np.concatenate(sizes))
    want = sum(
        oracle.weight_grad(x[r * num_rows : (r + 1) * num_rows], np.ones((num_rows, N)), sizes[r])
        for r in range(num_ranks)
    )
    np.testing.assert_allclose(dw, want, rtol=1e-5, atol=1e-4)


# Choice of path and bad arguments ---------------------------------------------


class FakeDevice:
    def __init__(self, platform, compute_capability=None):
        self.platform = platform
        if compute_capability is not None:
            self.compute_capability = compute_capability


def test_hopper_detection():
    assert gg.is_hopper_gpu(FakeDevice("gpu", "9.0"))
    assert not gg.is_hopper_gpu(FakeDevice("gpu", "8.0"))
    assert not gg.is_hopper_gpu(FakeDevice("gpu", "10.0"))
    assert not gg.is_hopper_gpu(FakeDevice("cpu"))
    assert not gg.is_hopper_gpu(jax.devices("cpu")[0])


def test_mgpu_shape_rules():
    ok = gg.mgpu_unsupported_reason((1000, 512), (4, 512, 256), jnp.bfloat16)
    assert ok is None
    assert "dtype" in gg.mgpu_unsupported_reason((1000, 512), (4, 512, 256), jnp.float32)
    assert "K=500" in gg.mgpu_unsupported_reason((1000, 500), (4, 500, 256), jnp.bfloat16)
    assert "N=200" in gg.mgpu_unsupported_reason((1000, 512), (4, 512, 200), jnp.bfloat16)
    assert gg.aligned_rows() == 128  # the warp-specialized kernels' row tile
    assert gg.row_multiple() == 128  # every kernel's row tile
    kb = gg.KernelBlocks
    row_tiled = gg.GroupedMatmulBlocks(kb(64, 128, 64, 6, 1), kb(64, 128, 64, 6, 2), kb(128, 128, 64, 4, 4), None)
    assert gg.row_multiple(row_tiled) == 64  # the row-tiled kernels' row tiles and the weight gradient's k step


def test_bf16_rows_matmul_takes_the_kernels_row_tiles(monkeypatch):
    """With split_rows tiles (two warpgroups of tile_m rows), the bf16 path hands
    rows_matmul one (group, data rows) entry per 2 tile_m rows, the kernel's row
    tile, not per tile_m: else every tile past the first reads another's group."""
    seen = {}

    def fake_rows_matmul(x, w, groups, rows, scale, tiles, transpose_rhs=False):
        seen.update(groups=groups.tolist(), rows=rows.tolist())
        return x

    monkeypatch.setattr(hopper_gemm, "rows_matmul", fake_rows_matmul)
    tiles = hopper_gemm.HopperTiles(64, 128, 64, 4, split_rows=True)
    sizes, valid = jnp.array([256, 128], jnp.int32), jnp.array([200, 64], jnp.int32)
    gg._rows_matmul(jnp.zeros((512, 8)), None, sizes, valid, None, tiles)
    assert seen == {"groups": [0, 0, 1, -1], "rows": [128, 72, 64, 0]}


def test_row_tiles_and_aligned_fit():
    """The row tiles' groups (empty groups skipped, -1 past the last group) and
    data rows (of the group's valid rows; 0 past the last group), and which
    K, N the warp-specialized kernels split."""
    sizes = jnp.array([256, 0, 128, 0, 384, 0], jnp.int32)
    groups, rows = gg._row_tiles(sizes, jnp.array([200, 0, 0, 0, 384, 0], jnp.int32), 128 * 8, 128)
    assert groups.tolist() == [0, 0, 2, 4, 4, 4, -1, -1]
    assert rows.tolist() == [128, 72, 0, 128, 128, 128, 0, 0]
    assert gg._row_tiles(sizes, sizes, 128 * 8, 128)[1].tolist() == [128] * 6 + [0, 0]
    none = jnp.zeros(3, jnp.int32)
    assert [a.tolist() for a in gg._row_tiles(none, none, 256, 128)] == [[-1, -1], [0, 0]]
    assert gg._aligned_fits(7168, 4096, gg.DEFAULT_BLOCKS) and gg._aligned_fits(2048, 7168, gg.DEFAULT_BLOCKS)
    assert not gg._aligned_fits(7168, 4096 + 128, gg.DEFAULT_BLOCKS)  # N not a multiple of the CTA's 256 columns
    assert not gg._aligned_fits(7168, 4096, dataclasses.replace(gg.DEFAULT_BLOCKS, aligned=None))


S = jax.ShapeDtypeStruct


def bad_call(**overrides):
    args = {"x": S((8, K), jnp.bfloat16), "w": S((3, K, N), jnp.bfloat16), "group_sizes": S((3,), jnp.int32)}
    backend = overrides.pop("backend", "auto")
    block_sizes = overrides.pop("block_sizes", None)
    args.update(overrides)
    return jax.jit(functools.partial(grouped_matmul, backend=backend, block_sizes=block_sizes)).trace(**args)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"x": S((8, 2, K), jnp.bfloat16)}, "x must have rank 2"),
        ({"w": S((K, N), jnp.bfloat16)}, "w must have rank 3"),
        ({"group_sizes": S((3, 1), jnp.int32)}, "group_sizes must have rank 1"),
        ({"w": S((3, K, N), jnp.float32)}, "same floating dtype"),
        ({"x": S((8, K), jnp.int32), "w": S((3, K, N), jnp.int32)}, "same floating dtype"),
        ({"group_sizes": S((3,), jnp.float32)}, "group_sizes must be integers"),
        ({"x": S((8, K + 1), jnp.bfloat16)}, "disagree on K"),
        ({"group_sizes": S((4,), jnp.int32)}, "4 groups, w has 3"),
        ({"w": S((0, K, N), jnp.bfloat16), "group_sizes": S((0,), jnp.int32)}, "at least one group"),
        ({"backend": "mosaic"}, "backend must be one of"),
        ({"backend": "cuda"}, "cannot run: K=32 is not a multiple of forward.block_k=64"),
        ({"backend": "mgpu"}, "cannot run: K=32 is not a multiple of forward.block_k=64"),  # its old name
        ({"backend": "cuda", "x": S((8, K), jnp.float32), "w": S((3, K, N), jnp.float32)}, "cannot run: dtype"),
    ],
)
def test_bad_arguments(overrides, match):
    with pytest.raises(ValueError, match=match):
        bad_call(**overrides)


@pytest.mark.parametrize("platform,capability,kind", [("cpu", "", "cpu"), ("gpu", "8.0", "NVIDIA A100")])
def test_mgpu_needs_a_hopper_gpu(monkeypatch, platform, capability, kind):
    """backend="cuda" on shapes that fit its tiles, where jax's first device is no Hopper GPU: a ValueError that
    says so at trace time (not an error from deep inside the kernels' tracing)."""
    fake = type("FakeDevice", (), {"platform": platform, "compute_capability": capability, "device_kind": kind})()
    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [fake])
    with pytest.raises(ValueError, match=rf"backend='cuda' cannot run: .*Hopper GPU.*first device is {kind}\b"):
        bad_call(
            backend="cuda",
            x=S((1024, 512), jnp.bfloat16),
            w=S((4, 512, 256), jnp.bfloat16),
            group_sizes=S((4,), jnp.int32),
        )


def test_impl_is_backends_old_name():
    """impl= (before backend=) still works, with a DeprecationWarning; both words at once follow impl."""
    x, w = np.ones((8, K), np.float32), np.ones((3, K, N), np.float32)
    sizes = np.array([3, 0, 5], np.int32)
    want = grouped_matmul(x, w, sizes, backend="xla")
    with pytest.warns(DeprecationWarning, match="grouped_matmul: impl= is now backend="):
        np.testing.assert_array_equal(grouped_matmul(x, w, sizes, impl="xla"), want)
    with pytest.warns(DeprecationWarning, match="quantize_rows: impl= is now backend="):
        fp8_quant.quantize_rows(x, impl="xla")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="backend must be one of"):
        grouped_matmul(x, w, sizes, impl="triton")


def test_bad_block_sizes():
    with pytest.raises(TypeError, match="block_sizes must be a GroupedMatmulBlocks"):
        bad_call(block_sizes={"block_m": 64})


# The Mosaic GPU path, lowered for a GPU without one ------------------------------


@pytest.fixture
def gpu_core_count(monkeypatch):
    """transposed_ragged_dot_mgpu reads jax.devices()[0].core_count while tracing: a GPU's SM count; an
    H200's platform and compute capability make backend="auto" choices (fp8_quant's kernels) a GPU's, the
    extension's CUDA kernels included where it is built."""
    fake = type("FakeGpu", (), {"core_count": 132, "platform": "gpu", "compute_capability": "9.0"})()
    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [fake])
    if _native.load_error() is None:
        monkeypatch.setattr(_native, "unavailable_reason", lambda: None)


def mosaic_calls(lowered):
    return lowered.as_text().count("stablehlo.custom_call @mosaic_gpu")


def quantization_calls(lowered):
    """fp8_quant's kernels (the extension's): one per row quantization, two per quantize_rows_and_columns
    (fp8_weights, and dy's with the FP8 dw); none where the extension is not built (XLA's maths)."""
    return lowered.as_text().count("stablehlo.custom_call @deep_ep_jax_fp8_")


def extension_calls(n):
    """n kernel calls, or 0 where the extension is not built."""
    return n if _native.load_error() is None else 0


def test_mgpu_path_lowers(gpu_core_count):
    """backend="cuda" traces and lowers for CUDA: the forward and both gradients as
    three Mosaic GPU kernels, each a row-tiled and a warp-specialized one (the
    lax.cond on the group sizes' alignment), rows padded to a multiple of 128 (M = 1000)."""
    x = jax.ShapeDtypeStruct((1000, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, 512, 256), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)

    def loss(x, w, sizes):
        return jnp.sum(grouped_matmul(x, w, sizes, backend="cuda").astype(jnp.float32) ** 2)  # dy needs y

    fwd = jax.jit(functools.partial(grouped_matmul, backend="cuda")).trace(x, w, sizes)
    assert fwd.out_info.shape == (1000, 256) and fwd.out_info.dtype == jnp.bfloat16
    assert mosaic_calls(fwd.lower(lowering_platforms=("cuda",))) == 2
    grad = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w, sizes)
    assert mosaic_calls(grad.lower(lowering_platforms=("cuda",))) == 6
    row_tiled_only = functools.partial(
        grouped_matmul, backend="cuda", block_sizes=dataclasses.replace(gg.DEFAULT_BLOCKS, aligned=None)
    )
    assert mosaic_calls(jax.jit(row_tiled_only).trace(x, w, sizes).lower(lowering_platforms=("cuda",))) == 1

    # aligned_groups=True: the warp-specialized kernels alone, no lax.cond (with valid_sizes too).
    for with_valid in (False, True):

        def promised_loss(x, w, sizes, with_valid=with_valid):
            y = grouped_matmul(
                x, w, sizes, backend="cuda", aligned_groups=True, valid_sizes=sizes // 2 if with_valid else None
            )
            return jnp.sum(y.astype(jnp.float32) ** 2)

        promised = (
            jax.jit(jax.grad(promised_loss, argnums=(0, 1))).trace(x, w, sizes).lower(lowering_platforms=("cuda",))
        )
        assert mosaic_calls(promised) == 3 and "stablehlo.case" not in promised.as_text()


def test_row_tiles_wider_than_jax_lowers_raise(gpu_core_count, monkeypatch):
    """Row tiles wider than this jax's Mosaic GPU lowers (256 columns from jax 0.12, whose own error comes
    at lowering and names no block size) raise a ValueError at trace time on the Mosaic GPU path, forced
    or chosen by backend="auto"; DEFAULT_BLOCKS stays within; backend="xla" ignores block sizes."""
    blocks = gg.DEFAULT_BLOCKS
    assert max(blocks.forward.block_n, blocks.input_grad.block_n) <= gg.ROW_TILED_MAX_BLOCK_N
    monkeypatch.setattr(gg, "ROW_TILED_MAX_BLOCK_N", 128)
    wide = dataclasses.replace(
        blocks,
        forward=dataclasses.replace(blocks.forward, block_n=128),
        input_grad=dataclasses.replace(blocks.input_grad, block_n=256),
    )
    args = S((1000, 512), jnp.bfloat16), S((4, 512, 256), jnp.bfloat16), S((4,), jnp.int32)
    for impl in ("mgpu", "auto"):
        with pytest.raises(ValueError, match=r"block_sizes.input_grad.block_n=256 is wider than the 128 columns"):
            jax.jit(functools.partial(grouped_matmul, backend=impl, block_sizes=wide)).trace(*args)
    jax.jit(functools.partial(grouped_matmul, backend="xla", block_sizes=wide)).trace(*args)


def test_steady_pipeline_lowers(gpu_core_count):
    """rows_matmul as one pipeline of pipelines per CTA (HopperTiles.steady_pipeline)
    lowers for CUDA, plain and transposed, with and without multicast; so does
    weight_grad's single pipeline."""
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    for cluster_n in (False, True):
        tiles = hopper_gemm.HopperTiles(128, 128, 64, 4, cluster_n=cluster_n, steady_pipeline=True)
        for transpose in (False, True):
            w = jax.ShapeDtypeStruct((4, 1024, 512) if transpose else (4, 512, 1024), jnp.bfloat16)

            def run(x, w, sizes, tiles=tiles, transpose=transpose):
                return gg._rows_matmul(
                    x, w, sizes, sizes // 2, jnp.ones((1,), jnp.float32), tiles, transpose_rhs=transpose
                )

            assert mosaic_calls(jax.jit(run).trace(x, w, sizes).lower(lowering_platforms=("cuda",))) == 1
    # weight_grad: one ring of stages over every row step of a CTA's tiles
    tiles = hopper_gemm.HopperTiles(128, 128, 64, 4, steady_pipeline=True)
    dy = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)

    def dw(x, dy, sizes):
        return hopper_gemm.weight_grad(
            x, dy, jnp.cumsum(sizes) - sizes, sizes // 64, jnp.ones((1,), jnp.float32), tiles
        )

    assert mosaic_calls(jax.jit(dw).trace(x, dy, sizes).lower(lowering_platforms=("cuda",))) == 1


def test_group_bands_order_and_lowers(gpu_core_count):
    """HopperTiles.group_bands: every tile once, each band's row tiles whole groups (a group goes to the
    band of its first tile // grid_tile_width), row tiles fastest; rows_matmul lowers with it."""
    groups = jnp.array([0, 0, 0, 2, 2, 3, 5, 5, 5, 5, -1, -1], jnp.int32)
    for width, bands in [
        (4, [range(0, 5), range(5, 10), range(10, 12)]),  # groups 0 and 2; 3 and 5; past the groups
        (2, [range(0, 3), range(3, 5), range(5, 6), range(6, 10), range(10, 12)]),  # a band per group
    ]:
        order = hopper_gemm._group_band_order(groups, 3, width).tolist()
        assert sorted(order) == list(range(36))
        assert [divmod(o, 3) for o in order] == [(mi, ni) for band in bands for ni in range(3) for mi in band]
    tiles = dataclasses.replace(gg.DEFAULT_ALIGNED_TILES.forward, group_bands=True)
    x, w = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16), jax.ShapeDtypeStruct((4, 512, 1024), jnp.bfloat16)

    def run(x, w, sizes, tiles=tiles):
        return gg._rows_matmul(x, w, sizes, sizes // 2, jnp.ones((1,), jnp.float32), tiles)

    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    assert mosaic_calls(jax.jit(run).trace(x, w, sizes).lower(lowering_platforms=("cuda",))) == 1
    with pytest.raises(ValueError, match="group_bands walks M fastest"):
        jax.jit(functools.partial(run, tiles=dataclasses.replace(tiles, grid_minor_n=True))).trace(x, w, sizes)
    with pytest.raises(ValueError, match="group_bands is rows_matmul's walk"):
        hopper_gemm.weight_grad(x, x, sizes, sizes, jnp.ones((1,), jnp.float32), tiles)


@pytest.mark.parametrize("fp8", [None, "bf16_dw", "fp8_dw"])
def test_mgpu_path_lowers_under_shard_map(gpu_core_count, fp8):
    """The same under shard_map with check_vma: the kernels' outputs get the right types
    (with fp8_weights: aligned groups, the three warp-specialized kernels; with an FP8 weight
    gradient, valid_sizes too, whose padding rows it leaves out)."""
    mesh = jax.sharding.AbstractMesh((2,), ("ep",), (jax.sharding.AxisType.Auto,))

    def loss(x, w, sizes):
        kwargs = {}
        if fp8:
            kwargs = dict(
                aligned_groups=True, fp8_weights=gg.fp8_weights(w, weight_grad=fp8 == "fp8_dw"), valid_sizes=sizes // 2
            )
        return jnp.sum(grouped_matmul(x, w, sizes, backend="cuda", **kwargs).astype(jnp.float32) ** 2)  # dy needs y

    for w_spec in (P("ep"), P()):  # local experts, and weights replicated over the axis
        step = jax.shard_map(
            jax.grad(loss, argnums=(0, 1)), mesh=mesh, in_specs=(P("ep"), w_spec, P("ep")), out_specs=(P("ep"), w_spec)
        )
        args = (
            jax.ShapeDtypeStruct((2 * 1024, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct(((2 if w_spec == P("ep") else 1) * 4, 512, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((2 * 4,), jnp.int32),
        )
        lowered = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",))
        # fp8_weights' 2 passes, x's rows, dy's rows (or with the FP8 dw, dy's 2 passes)
        want = {None: (6, 0), "bf16_dw": (3, extension_calls(4)), "fp8_dw": (3, extension_calls(5))}[fp8]
        assert (mosaic_calls(lowered), quantization_calls(lowered)) == want


# FP8 (fp8_weights=) ---------------------------------------------------------------


def fp8_forward_and_grads(backend="xla", aligned_groups=False, valid_sizes=None, weight_grad=False):
    """jitted (x, w, sizes, dy) -> (y, dx, dw) with FP8 copies of w made inside."""

    def run(x, w, sizes, dy):
        w8 = gg.fp8_weights(w, weight_grad=weight_grad)
        y, vjp = jax.vjp(
            lambda x, w: grouped_matmul(
                x, w, sizes, backend=backend, aligned_groups=aligned_groups, valid_sizes=valid_sizes, fp8_weights=w8
            ),
            x,
            w,
        )
        return (y, *vjp(dy))

    return jax.jit(run)


@pytest.mark.parametrize("weight_grad", [False, True], ids=["bf16_dw", "fp8_dw"])
@pytest.mark.parametrize("kind,num_groups", [("random", 6), ("all_in_one", 6), ("padding", 6), ("padding", 1)])
def test_fp8_matches_numpy(kind, num_groups, weight_grad, rng):
    """y and dx from FP8 operands (per-row x and dy, the FP8 weight copies),
    against numpy on the same quantized values and near the bf16 maths; dw as
    without FP8, or with weight_grad=True from FP8 operands too (x's values,
    dy times x's row scales quantized per column); junk padding rows stay out."""
    num_rows = int(rng.integers(40, 120))
    sizes = make_sizes(rng, kind, num_rows, num_groups)
    x, w, dy = make_inputs(rng, num_rows, num_groups, sizes)
    y, dx, dw = fp8_forward_and_grads(weight_grad=weight_grad)(x, w, sizes, dy)
    w_forward, w_input_grad = oracle.fp8_weights(w)
    total, what = int(sizes.sum()), f"fp8, {kind}, sizes {sizes.tolist()}"
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype, what
    assert_close(y, oracle.forward(oracle.fp8_rows(x), w_forward, sizes), f"{what}: y")
    assert_close(dx, oracle.input_grad(oracle.fp8_rows(dy), w_input_grad, sizes), f"{what}: dx")
    assert_close(dw, (oracle.fp8_weight_grad if weight_grad else oracle.weight_grad)(x, dy, sizes), f"{what}: dw")
    assert not np.asarray(y[total:], np.float32).any(), f"{what}: padding rows of y"
    assert not np.asarray(dx[total:], np.float32).any(), f"{what}: dx of padding rows"
    # FP8 is FP8: within 10% (as a norm) of the bf16 maths, so no scale is missing or wrong.
    for got, want, name in (
        (y, oracle.forward(x, w, sizes), "y"),
        (dx, oracle.input_grad(dy, w, sizes), "dx"),
        (dw, oracle.weight_grad(x, dy, sizes), "dw"),
    ):
        assert np.linalg.norm(np.asarray(got, np.float64) - want) <= 0.1 * np.linalg.norm(want), f"{what}: {name}"


def test_swiglu_fp8_rows_match_bf16_rows(rng):
    """swiglu(gate_up, fp8_rows=True) into grouped_matmul with FP8 weight gradients: the same y and the
    same gradients of gate_up and w, bit for bit, as the bf16 rows swiglu(gate_up), which the matmul
    quantizes itself the same way; the rows' gradient reaches gate_up through the grad_sink."""
    num_rows, num_groups, ffn = 96, 4, 40
    sizes = make_sizes(rng, "padding", num_rows, num_groups)
    gate_up = np.asarray(rng.standard_normal((num_rows, 2 * ffn)) * 2, ml_dtypes.bfloat16)
    w = np.asarray(rng.standard_normal((num_groups, ffn, N)) / np.sqrt(ffn), ml_dtypes.bfloat16)
    dy = np.asarray(rng.standard_normal((num_rows, N)), ml_dtypes.bfloat16)

    def run(fp8_rows):
        def f(gate_up, w):
            rows = gg.swiglu(gate_up, fp8_rows=fp8_rows)
            assert isinstance(rows, gg.Fp8Rows) == fp8_rows
            return grouped_matmul(rows, w, sizes, backend="xla", fp8_weights=gg.fp8_weights(w, weight_grad=True))

        y, vjp = jax.vjp(f, gate_up, w)
        return (y, *vjp(dy))

    got, want = jax.jit(lambda: run(True))(), jax.jit(lambda: run(False))()
    for name, g, w_ in zip(("y", "d gate_up", "dw"), got, want):
        assert g.dtype == w_.dtype and g.shape == w_.shape, name
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w_, np.float32), err_msg=name)
    assert np.abs(np.asarray(got[1], np.float32)[: int(sizes.sum())]).max() > 0
    rows = jax.jit(lambda a: gg.swiglu(a, fp8_rows=True))(gate_up)
    want_data, want_scales = jax.jit(lambda a: fp8_quant.quantize_rows(gg.swiglu(a), backend="xla"))(gate_up)
    np.testing.assert_array_equal(np.asarray(rows.data, np.float32), np.asarray(want_data, np.float32))
    np.testing.assert_array_equal(np.asarray(rows.scales), np.asarray(want_scales))
    with pytest.raises(ValueError, match=r"fp8_rows=True needs bf16 gate_up \[M, 2F\]"):
        gg.swiglu(jnp.ones((4, 6), jnp.float32), fp8_rows=True)


def test_fp8_weights_copies(rng):
    """fp8_weights(w): float8 data in each matmul's layout, one float32 scale per output channel."""
    w = np.asarray(rng.standard_normal((3, K, N)) * np.exp(rng.standard_normal((3, 1, N))), ml_dtypes.bfloat16)
    w8 = jax.jit(gg.fp8_weights)(w)
    assert not w8.weight_grad and jax.jit(functools.partial(gg.fp8_weights, weight_grad=True))(w).weight_grad
    assert (w8.forward.shape, w8.forward_scales.shape) == ((3, N, K), (3, N))
    assert (w8.input_grad.shape, w8.input_grad_scales.shape) == ((3, K, N), (3, K))
    assert w8.forward.dtype == jnp.float8_e4m3fn and w8.forward_scales.dtype == jnp.float32
    forward = np.swapaxes(np.asarray(w8.forward, np.float64) * np.asarray(w8.forward_scales)[..., None], 1, 2)
    input_grad = np.asarray(w8.input_grad, np.float64) * np.asarray(w8.input_grad_scales)[..., None]
    want_forward, want_input_grad = oracle.fp8_weights(w)
    np.testing.assert_allclose(forward, want_forward, rtol=1e-6)
    np.testing.assert_allclose(input_grad, want_input_grad, rtol=1e-6)
    # Each column's (row's) largest magnitude is 448 times its scale.
    assert np.allclose(np.abs(np.asarray(w8.forward, np.float32)).max(-1), 448)
    assert np.allclose(np.abs(np.asarray(w8.input_grad, np.float32)).max(-1), 448)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"fp8_weights": "w"}, "fp8_weights must be an Fp8Weights"),
        ({"w8_shape": (3, K, N)}, r"fp8_weights.forward must be float8_e4m3fn \(3, 48, 32\)"),
        ({"impl": "mgpu", "big": True}, "needs aligned_groups=True"),
    ],
)
def test_fp8_bad_arguments(overrides, match, request):
    if overrides.get("impl") == "mgpu":
        request.getfixturevalue("gpu_core_count")  # past backend="cuda"'s device check on any host
    big = overrides.pop("big", False)
    k, n = (512, 256) if big else (K, N)
    w = S((3, k, n), jnp.bfloat16)
    w8 = jax.eval_shape(gg.fp8_weights, w)
    if "w8_shape" in overrides:
        w8 = dataclasses.replace(w8, forward=S(overrides.pop("w8_shape"), jnp.float8_e4m3fn))
    w8 = overrides.pop("fp8_weights", w8)
    impl = overrides.pop("impl", "xla")
    with pytest.raises((TypeError, ValueError), match=match):
        jax.jit(functools.partial(grouped_matmul, backend=impl, fp8_weights=w8)).trace(
            S((1024, k), jnp.bfloat16), w, S((3,), jnp.int32)
        )


def test_fp8_weights_bad_arguments():
    with pytest.raises(TypeError, match="fp8_weights: weight_grad must be a bool, got int"):
        jax.eval_shape(functools.partial(gg.fp8_weights, weight_grad=1), S((3, K, N), jnp.bfloat16))
    with pytest.raises(TypeError, match="^fp8_weights: w must be a floating array"):
        jax.eval_shape(gg.fp8_weights, S((3, K, N), jnp.int32))
    with pytest.raises(ValueError, match="^fp8_weights: w must have rank 3"):
        jax.eval_shape(gg.fp8_weights, S((K, N), jnp.bfloat16))


@pytest.mark.parametrize("weight_grad", [False, True], ids=["bf16_dw", "fp8_dw"])
def test_fp8_mgpu_path_lowers(gpu_core_count, weight_grad):
    """fp8_weights with aligned groups: the FP8 forward and input gradient and the
    weight gradient (bf16, or FP8), three warp-specialized kernels, lowered for CUDA."""
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, 512, 256), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)

    def loss(x, w, sizes):
        y = grouped_matmul(
            x,
            w,
            sizes,
            backend="cuda",
            aligned_groups=True,
            valid_sizes=sizes // 2,
            fp8_weights=gg.fp8_weights(w, weight_grad=weight_grad),
        )
        return jnp.sum(y.astype(jnp.float32) ** 2)

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w, sizes).lower(lowering_platforms=("cuda",))
    assert mosaic_calls(lowered) == 3 and "f8E4M3FN" in lowered.as_text()
    # fp8_weights 2 (an amax and a store pass), x 1, dy 1 (or with FP8 dw, its rows and columns: 2 passes)
    assert quantization_calls(lowered) == extension_calls(5 if weight_grad else 4)


def test_weight_grad_promoted_halves_lowers(gpu_core_count):
    """weight_grad with promote_after_steps (long groups in promoted halves, the rest in one accumulator)
    lowers for CUDA on FP8 operands with column scales; the options it excludes are refused."""
    t = hopper_gemm.HopperTiles(
        128, 128, 128, 3, grid_tile_width=4, steady_pipeline=True, epi_tile_m=128, epi_tile_n=128, promote_after_steps=2
    )
    x_t, z_t = S((512, 1024), jnp.float8_e4m3fn), S((256, 1024), jnp.float8_e4m3fn)
    starts, steps = S((4,), jnp.int32), S((4,), jnp.int32)

    def run(x_t, z_t, starts, steps, tiles=t):
        return hopper_gemm.weight_grad(
            x_t,
            z_t,
            starts,
            steps,
            jnp.ones((1,), jnp.float32),
            tiles,
            transposed=True,
            col_scales=jnp.ones((256,), jnp.float32),
            out_dtype=jnp.bfloat16,
        )

    lowered = jax.jit(run).trace(x_t, z_t, starts, steps).lower(lowering_platforms=("cuda",))
    assert mosaic_calls(lowered) == 1
    for bad in (dict(promote=True), dict(split_rows=True), dict(tile_m=64)):
        with pytest.raises(ValueError, match="promote_after_steps needs"):
            jax.jit(functools.partial(run, tiles=dataclasses.replace(t, **bad))).trace(x_t, z_t, starts, steps)
