"""deep_ep_jax.fp8_quant on CPU: the XLA maths against numpy, the CUDA kernels' lowering, and the
errors. The kernels on a GPU: tests/gpu/test_fp8_quant_gpu.py."""

import grouped_gemm_oracle as oracle
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deep_ep_jax import fp8_quant


def skewed(rng, shape):
    """bf16 values whose rows and columns differ in magnitude by up to ~e^6, with an all-zero row, a row
    of one nonzero value and a tiny row (far below the activations' 1e-4 floor)."""
    a = rng.standard_normal(shape) * np.exp(2 * rng.standard_normal(shape[:-1] + (1,)))
    a = a * np.exp(rng.standard_normal(shape[-1]))
    a[..., 0, :] = 0
    a[..., 1, :] = 0
    a[..., 1, 5] = -3.0
    a[..., 2, :] *= 1e-20
    return np.asarray(a, ml_dtypes.bfloat16)


def as_float(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def assert_same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = as_float(g), as_float(w)
        assert g.shape == w.shape, f"{what}: output {i} shaped {g.shape}, want {w.shape}"
        bad = ~((g == w) | (np.isnan(g) & np.isnan(w)))
        assert not bad.any(), f"{what}: output {i} differs at {np.argwhere(bad)[:5].tolist()} ({bad.sum()} places)"


@pytest.mark.parametrize("shape", [(256, 384), (2, 64, 7168 // 14), (8, 16)])
def test_rows_match_numpy(shape, rng):
    a = skewed(rng, shape)
    data, scales = jax.jit(lambda a: fp8_quant.quantize_rows(a, backend="xla"))(a)
    want_values, want_scales = oracle.fp8_row_parts(a)
    np.testing.assert_array_equal(as_float(scales), want_scales[..., 0])
    np.testing.assert_array_equal(as_float(data), want_values)
    assert data.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float32
    assert not as_float(data)[..., 0, :].any(), "an all-zero row must quantize to zeros"


def test_rows_and_columns_match_numpy(rng):
    a = skewed(rng, (3, 256, 128))
    m = np.exp(rng.standard_normal((3, 256))).astype(np.float32)
    m[:, 200:210] = 0  # rows left out of the columns' copy, whatever they hold
    a[1, 203, :5] = [np.nan, np.inf, -np.inf, 1e30, -7]
    rows, row_scales, cols, col_scales = jax.jit(lambda a, m: fp8_quant.quantize_rows_and_columns(a, m, backend="xla"))(
        a, m
    )
    want_rows, want_row_scales = oracle.fp8_row_parts(a)
    with np.errstate(invalid="ignore"):  # inf * 0 in the rows left out, which np.where then drops
        z_t = np.swapaxes(np.where(m[..., None] == 0, 0, np.asarray(a, np.float32) * m[..., None]), 1, 2)
    assert not np.isnan(z_t).any() and not z_t[:, :, 200:210].any()
    want_cols, want_col_scales = oracle.fp8_row_parts(z_t)
    for got, want in (
        (rows, want_rows),
        (row_scales, want_row_scales[..., 0]),
        (cols, want_cols),
        (col_scales, want_col_scales[..., 0]),
    ):
        np.testing.assert_array_equal(as_float(got), want)


def test_auto_takes_xla_off_gpu_and_where_shapes_do_not_fit(monkeypatch):
    """On CPU, and for shapes the kernels do not take, "auto" is the XLA maths (no kernel call)."""
    for a in (jnp.ones((3, 20), jnp.bfloat16), jnp.ones((64, 128), jnp.float32)):
        for fn in (fp8_quant.quantize_rows, lambda a: fp8_quant.quantize_rows_and_columns(a[None])):
            assert "custom_call" not in jax.jit(fn).lower(a).as_text()
    # On a GPU with the extension: C not a multiple of 8, or not bf16, still XLA.
    monkeypatch.setattr(fp8_quant, "fp8_gpu", lambda device=None: True)
    monkeypatch.setattr(fp8_quant._native, "unavailable_reason", lambda: None)
    for a in (jnp.ones((3, 20), jnp.bfloat16), jnp.ones((64, 128), jnp.float32)):
        assert "custom_call" not in jax.jit(fp8_quant.quantize_rows).lower(a).as_text()
    # The CUDA kernels take bf16 (quantize_rows_and_columns' with C a multiple of 128), and need the
    # extension on a GPU.
    with pytest.raises(ValueError, match="backend='cuda' needs bf16 a with C a multiple of 8"):
        fp8_quant.quantize_rows(jnp.ones((3, 20), jnp.bfloat16), backend="cuda")
    with pytest.raises(ValueError, match="backend='cuda' needs bf16 a with C a multiple of 128"):
        fp8_quant.quantize_rows_and_columns(jnp.ones((1, 64, 192), jnp.bfloat16), backend="cuda")
    with pytest.raises(ValueError, match="backend='cuda' needs bf16"):
        fp8_quant.quantize_rows_and_columns(jnp.ones((1, 64, 128), jnp.float32), backend="cuda")
    monkeypatch.setattr(fp8_quant._native, "unavailable_reason", lambda: "no GPU here")
    with pytest.raises(RuntimeError, match="backend='cuda' is not available: no GPU here"):
        fp8_quant.quantize_rows_and_columns(jnp.ones((1, 64, 128), jnp.bfloat16), backend="cuda")
    with pytest.raises(RuntimeError, match="backend='cuda' is not available: no GPU here"):
        fp8_quant.quantize_rows(jnp.ones((2, 64), jnp.bfloat16), swiglu=True, backend="cuda")


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: fp8_quant.quantize_rows(jnp.ones((8, 16)), backend="triton"), "backend must be one of"),
        (
            lambda: fp8_quant.quantize_rows(jnp.ones((8, 16)), backend="cuda"),
            "backend='cuda' needs bf16 a with C a multiple of 8",
        ),
        (
            lambda: fp8_quant.quantize_rows(jnp.ones((8, 15), jnp.bfloat16), swiglu=True),
            r"swiglu=True needs bf16 a \[..., 2C\]",
        ),
        (lambda: fp8_quant.quantize_rows(jnp.ones((8, 16)), swiglu=True), r"swiglu=True needs bf16"),
        (
            lambda: fp8_quant.quantize_rows_and_columns(jnp.ones((1, 8, 128)), backend="triton"),
            "backend must be one of",
        ),
        (lambda: fp8_quant.quantize_rows(jnp.ones(())), "needs a row axis"),
        (lambda: fp8_quant.quantize_rows_and_columns(jnp.ones((8, 16))), r"must be \[B, R, C\]"),
        (lambda: fp8_quant.quantize_rows_and_columns(jnp.ones((1, 8, 16)), jnp.ones((8,))), "col_multipliers must be"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.extension
def test_rows_lower_for_cuda(monkeypatch):
    """quantize_rows (and its swiglu rows) lower to the extension's one custom call."""
    monkeypatch.setattr(fp8_quant._native, "unavailable_reason", lambda: None)
    for shape, swiglu in (((2, 256, 392), False), ((256, 2 * 392), True)):
        a = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        text = (
            jax.jit(lambda a, swiglu=swiglu: fp8_quant.quantize_rows(a, swiglu=swiglu, backend="cuda"))
            .trace(a)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
        assert len(calls) == 1 and "@deep_ep_jax_fp8_quantize_rows" in calls[0], calls
        assert f"swiglu = {str(swiglu).lower()}" in calls[0], calls[0]


@pytest.mark.extension
def test_rows_and_columns_lower_for_cuda(monkeypatch):
    """quantize_rows_and_columns lowers to the extension's two custom calls (amaxes, then both copies)."""
    a = jax.ShapeDtypeStruct((2, 256, 384), jnp.bfloat16)
    m = jax.ShapeDtypeStruct((2, 256), jnp.float32)
    monkeypatch.setattr(fp8_quant._native, "unavailable_reason", lambda: None)
    for multipliers in (None, m):
        text = (
            jax.jit(lambda a, m: fp8_quant.quantize_rows_and_columns(a, m, backend="cuda"))
            .trace(a, multipliers)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
        assert len(calls) == 2, calls
        assert "@deep_ep_jax_fp8_amax_rows_and_columns" in calls[0] and "@deep_ep_jax_fp8_rows_and_columns" in calls[1]


@pytest.mark.parametrize("ulps", [-2, -1, 1, 2])
def test_reciprocal_refined_from_an_approximation(ulps, rng):
    """The XLA path's 1 / scale is correct from a start up to 2 ulp off (XLA's GPU division, div.full):
    here the start is moved by `ulps` float32 steps from numpy's correctly rounded reciprocal."""
    m = np.concatenate([rng.uniform(0.5, 1.0, 200_000), [0.5, np.nextafter(1, 0), np.nextafter(0.5, 1)]])
    m = m.astype(np.float32)
    exact = np.float32(1) / m
    start = exact
    for _ in range(abs(ulps)):
        start = np.nextafter(start, np.float32(np.inf if ulps > 0 else 0)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(fp8_quant._reciprocal_refined)(m, start)), exact)
