"""deep_ep_jax.fp8_quant on CPU: the XLA maths against numpy, quantize_rows' Triton kernel (in Pallas'
interpreter) against the XLA maths bit for bit, the kernels' lowering for CUDA, and the errors.
The kernels on a GPU: tests/gpu/test_fp8_quant_gpu.py."""

import dataclasses
import importlib.util
from pathlib import Path

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
def test_rows_match_numpy(shape):
    rng = np.random.default_rng()
    a = skewed(rng, shape)
    data, scales = jax.jit(lambda a: fp8_quant.quantize_rows(a, impl="xla"))(a)
    want_values, want_scales = oracle.fp8_row_parts(a)
    np.testing.assert_array_equal(as_float(scales), want_scales[..., 0])
    np.testing.assert_array_equal(as_float(data), want_values)
    assert data.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float32
    assert not as_float(data)[..., 0, :].any(), "an all-zero row must quantize to zeros"


def test_rows_and_columns_match_numpy():
    rng = np.random.default_rng()
    a = skewed(rng, (3, 256, 128))
    m = np.exp(rng.standard_normal((3, 256))).astype(np.float32)
    m[:, 200:210] = 0  # rows left out of the columns' copy, whatever they hold
    a[1, 203, :5] = [np.nan, np.inf, -np.inf, 1e30, -7]
    rows, row_scales, cols, col_scales = jax.jit(
        lambda a, m: fp8_quant.quantize_rows_and_columns(a, m, impl="xla"))(a, m)
    want_rows, want_row_scales = oracle.fp8_row_parts(a)
    z_t = np.swapaxes(np.where(m[..., None] == 0, 0, np.asarray(a, np.float32) * m[..., None]), 1, 2)
    assert not np.isnan(z_t).any() and not z_t[:, :, 200:210].any()
    want_cols, want_col_scales = oracle.fp8_row_parts(z_t)
    for got, want in ((rows, want_rows), (row_scales, want_row_scales[..., 0]), (cols, want_cols),
                      (col_scales, want_col_scales[..., 0])):
        np.testing.assert_array_equal(as_float(got), want)


@pytest.mark.parametrize("shape", [(256, 384), (3, 8, 7168), (16, 48)])
def test_rows_kernel_matches_xla(shape):
    rng = np.random.default_rng()
    a = skewed(rng, shape)
    first = (0,) * (len(shape) - 2)
    a[first + (3, 7)] = np.nan  # a NaN makes its row NaN, on every path
    a[first + (4, 1)] = np.inf  # an inf makes its row's scale inf
    want = fp8_quant.quantize_rows(a, impl="xla")
    assert np.isnan(as_float(want[1])[first + (3,)]) and np.isinf(as_float(want[1])[first + (4,)])
    assert np.isnan(as_float(want[0])[first + (3,)]).all()
    assert_same(fp8_quant.quantize_rows(a, impl="triton", interpret=True), want, f"quantize_rows {shape}")


def test_auto_takes_xla_off_gpu_and_where_shapes_do_not_fit(monkeypatch):
    """On CPU, and for shapes the kernels cannot tile, "auto" is the XLA maths (no kernel call)."""
    a = jnp.ones((3, 20), jnp.bfloat16)  # 3 rows: not a multiple of 2; 20 columns: no power of two >= 16
    for fn in (fp8_quant.quantize_rows, lambda a: fp8_quant.quantize_rows_and_columns(a[None])):
        text = jax.jit(fn).lower(a).as_text()
        assert "triton" not in text and "deep_ep_jax" not in text
    with pytest.raises(ValueError, match="impl='triton' needs 16- or 32-bit floats, rows a multiple of 2"):
        fp8_quant.quantize_rows(a, impl="triton")
    # Shapes that tile, but 8-bit values: the kernels read 16 or 32 bits (XLA takes the rest).
    fp8 = jnp.ones((64, 128), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs 16- or 32-bit floats"):
        fp8_quant.quantize_rows(fp8, impl="triton")
    assert "triton" not in jax.jit(lambda a: fp8_quant.quantize_rows(a, interpret=True)).lower(fp8).as_text()
    # The CUDA kernels take bf16 with C a multiple of 128, and need the extension on a GPU.
    with pytest.raises(ValueError, match="impl='cuda' needs bf16 a with C a multiple of 128"):
        fp8_quant.quantize_rows_and_columns(jnp.ones((1, 64, 192), jnp.bfloat16), impl="cuda")
    with pytest.raises(ValueError, match="impl='cuda' needs bf16"):
        fp8_quant.quantize_rows_and_columns(jnp.ones((1, 64, 128), jnp.float32), impl="cuda")
    monkeypatch.setattr(fp8_quant._native, "unavailable_reason", lambda: "no GPU here")
    with pytest.raises(RuntimeError, match="impl='cuda' is not available: no GPU here"):
        fp8_quant.quantize_rows_and_columns(jnp.ones((1, 64, 128), jnp.bfloat16), impl="cuda")


@pytest.mark.parametrize("call,match", [
    (lambda: fp8_quant.quantize_rows(jnp.ones((8, 16)), impl="mgpu"), "impl must be one of"),
    (lambda: fp8_quant.quantize_rows(jnp.ones((8, 16)), impl="cuda"), "impl='cuda' needs bf16 a with C a multiple of 8"),
    (lambda: fp8_quant.quantize_rows(jnp.ones((8, 15), jnp.bfloat16), swiglu=True), r"swiglu=True needs bf16 a \[..., 2C\]"),
    (lambda: fp8_quant.quantize_rows(jnp.ones((8, 16)), swiglu=True), r"swiglu=True needs bf16"),
    (lambda: fp8_quant.quantize_rows(jnp.ones((8, 32), jnp.bfloat16), swiglu=True, impl="triton"), "no Triton kernel"),
    (lambda: fp8_quant.quantize_rows_and_columns(jnp.ones((1, 8, 128)), impl="triton"), "impl must be one of"),
    (lambda: fp8_quant.quantize_rows(jnp.ones(())), "needs a row axis"),
    (lambda: fp8_quant.quantize_rows_and_columns(jnp.ones((8, 16))), r"must be \[B, R, C\]"),
    (lambda: fp8_quant.quantize_rows_and_columns(jnp.ones((1, 8, 16)), jnp.ones((8,))), "col_multipliers must be"),
])
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_rows_kernel_lowers_for_cuda():
    """quantize_rows' Triton kernel lowers (to Triton IR, inside an XLA custom call) on this CPU machine."""
    a = jax.ShapeDtypeStruct((2, 256, 384), jnp.bfloat16)
    text = jax.jit(lambda a: fp8_quant.quantize_rows(a, impl="triton")).trace(a).lower(
        lowering_platforms=("cuda",)).as_text()
    assert 'name = "fp8_quantize_rows"' in text


def test_swiglu_rows_match_numpy():
    """quantize_rows(gate_up, swiglu=True) quantizes swiglu_values(gate_up): bf16(silu(gate) * up), within
    bf16's rounding of float64 maths (XLA's exp and numpy's may differ in float32's last bit), then
    numpy's quantization of those bf16 values bit for bit."""
    rng = np.random.default_rng()
    gate_up = skewed(rng, (3, 64, 2 * 136))
    gate_up[0, 5, :10] = [100, -100, 90, -90, 0, np.nan, np.inf, -np.inf, 1e-30, -1e-30]
    data, scales = jax.jit(lambda a: fp8_quant.quantize_rows(a, swiglu=True, impl="xla"))(gate_up)
    hidden = as_float(fp8_quant.swiglu_values(gate_up))
    g, u = np.split(np.asarray(gate_up, np.float64), 2, axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        exact = g / (1 + np.exp(-g)) * u
    finite = np.isfinite(exact)
    # atol: the tiny row's products fall to float32's subnormals, which XLA's CPU code flushes to 0.
    np.testing.assert_allclose(hidden[finite], exact[finite], rtol=2**-8, atol=1e-30)
    assert np.array_equal(np.isnan(hidden), np.isnan(exact))
    want_values, want_scales = oracle.fp8_row_parts(hidden)
    np.testing.assert_array_equal(as_float(scales), want_scales[..., 0])
    np.testing.assert_array_equal(as_float(data), want_values)
    assert data.shape == (3, 64, 136)


@pytest.mark.extension
def test_rows_lower_for_cuda(monkeypatch):
    """quantize_rows (and its swiglu rows) lower to the extension's one custom call."""
    monkeypatch.setattr(fp8_quant._native, "unavailable_reason", lambda: None)
    for shape, swiglu in (((2, 256, 392), False), ((256, 2 * 392), True)):
        a = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        text = jax.jit(lambda a: fp8_quant.quantize_rows(a, swiglu=swiglu, impl="cuda")).trace(a).lower(
            lowering_platforms=("cuda",)).as_text()
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
        text = jax.jit(lambda a, m: fp8_quant.quantize_rows_and_columns(a, m, impl="cuda")).trace(
            a, multipliers).lower(lowering_platforms=("cuda",)).as_text()
        calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
        assert len(calls) == 2, calls
        assert "@deep_ep_jax_fp8_amax_rows_and_columns" in calls[0] and "@deep_ep_jax_fp8_rows_and_columns" in calls[1]


@pytest.mark.parametrize("ulps", [-2, -1, 1, 2])
def test_reciprocal_refined_from_an_approximation(ulps):
    """The XLA path's 1 / scale is correct from a start up to 2 ulp off (XLA's GPU division, div.full):
    here the start is moved by `ulps` float32 steps from numpy's correctly rounded reciprocal."""
    rng = np.random.default_rng()
    m = np.concatenate([rng.uniform(0.5, 1.0, 200_000), [0.5, np.nextafter(1, 0), np.nextafter(0.5, 1)]])
    m = m.astype(np.float32)
    exact = np.float32(1) / m
    start = exact
    for _ in range(abs(ulps)):
        start = np.nextafter(start, np.float32(np.inf if ulps > 0 else 0)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(fp8_quant._reciprocal_refined)(m, start)), exact)


def test_bench_sweep_tiles_are_tiles():
    """benchmarks/bench_fp8_quant.py --sweep's variants name QuantTiles fields (a sweep runs only on GPUs)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_fp8_quant.py"
    spec = importlib.util.spec_from_file_location("bench_fp8_quant", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for variants in bench.SWEEP.values():
        for fields in variants:
            dataclasses.replace(fp8_quant.DEFAULT_TILES, **fields)
