"""deep_ep_jax.fp8_quant's CUDA kernels on a GPU (quantize_rows', with swiglu=True too, and
quantize_rows_and_columns'), at the MoE benchmark's shapes per rank, on skewed values with zero, NaN, inf
and tiny rows: numpy's quantization bit for bit on sampled rows, and the XLA maths (which
tests/test_fp8_quant.py checks against numpy on CPU; on GPUs it refines XLA's division, which is not
correctly rounded) bit for bit everywhere; backend="auto" must pick the extension's kernels here.

    pytest -m gpu tests/gpu/test_fp8_quant_gpu.py -v
"""

import grouped_gemm_oracle as oracle
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deep_ep_jax import fp8_quant

pytestmark = pytest.mark.gpu(min_gpus=1)


@pytest.fixture(scope="module", autouse=True)
def fp8_gpu():
    device = jax.devices("gpu")[0]
    if not fp8_quant.fp8_gpu(device):
        pytest.fail(f"the FP8 kernels need compute capability 8.9+; this is {device.device_kind}", pytrace=False)


def skewed(key, shape):
    """bf16 values whose rows and columns differ in magnitude by up to ~e^6; row 0 zeros, row 1 holds a
    NaN, row 2 an inf, row 3 is tiny (1e-20)."""
    k1, k2, k3 = jax.random.split(key, 3)
    a = jax.random.normal(k1, shape, jnp.float32) * jnp.exp(2 * jax.random.normal(k2, shape[:-1] + (1,)))
    a = a * jnp.exp(jax.random.normal(k3, shape[-1:]))
    lead = (slice(None),) * (len(shape) - 2)
    a = a.at[lead + (0,)].set(0).at[lead + (1, 5)].set(jnp.nan).at[lead + (2, 9)].set(jnp.inf)
    return a.at[lead + (3,)].multiply(1e-20).astype(jnp.bfloat16)


def as_float(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


@jax.jit
def _differ(data, xla_data):
    """Where the float8 values differ (NaN equals NaN), and how many."""
    got, want = data.astype(jnp.float32), xla_data.astype(jnp.float32)
    differ = (got != want) & ~(jnp.isnan(got) & jnp.isnan(want))
    return jnp.sum(differ), jnp.argwhere(differ, size=5, fill_value=-1)


def check(what, values, got, xla, rng):
    """got = (data, scales) of `values` [..., R, C] quantized per row by the kernels; xla: XLA's."""
    data, scales = got
    np.testing.assert_array_equal(as_float(scales), as_float(xla[1]), err_msg=f"{what}: scales against XLA's")
    count, where = _differ(data, xla[0])
    assert int(count) == 0, f"{what}: {int(count)} values differ from XLA's, the first at {where.tolist()}"
    flat_values, flat_data = values.reshape(-1, values.shape[-1]), data.reshape(-1, values.shape[-1])
    rows = np.unique(np.concatenate([np.arange(4), rng.integers(0, flat_values.shape[0], 60)]))
    want_data, want_scales = oracle.fp8_row_parts(as_float(flat_values[rows]))
    np.testing.assert_array_equal(as_float(scales).reshape(-1)[rows], want_scales[:, 0], err_msg=f"{what}: scales")
    np.testing.assert_array_equal(as_float(flat_data[rows]), want_data, err_msg=f"{what}: data, rows {rows}")


@pytest.mark.parametrize("shape", [(40704, 7168), (40704, 2048), (2, 1024, 4096), (3, 999, 392)])
def test_rows_kernel(shape, rng):
    """quantize_rows on the extension's kernel ("auto" picks it)."""
    a = skewed(jax.random.key(rng.integers(1 << 30)), shape)
    run = jax.jit(fp8_quant.quantize_rows, static_argnames="backend")
    assert "deep_ep_jax_fp8_quantize_rows" in run.lower(a).as_text(), "backend='auto' did not pick the CUDA kernel"
    got = run(a)
    assert np.isnan(as_float(got[1])[..., 1]).all(), "a NaN must make its row's scale NaN"
    check(f"quantize_rows {shape}", a, got, run(a, backend="xla"), rng)


def swiglu_float64(gate_up):
    """bf16(silu(gate) * up), the maths in float64: [..., C] float32."""
    g, u = np.split(as_float(gate_up).astype(np.float64), 2, axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        h = g / (1 + np.exp(-g)) * u
    return np.asarray(h.astype(ml_dtypes.bfloat16), np.float32)


@pytest.mark.parametrize("shape", [(40704, 4096), (3, 999, 784)])
def test_swiglu_rows_kernel(shape, rng):
    """quantize_rows(gate_up, swiglu=True) on the extension's kernel: bf16(silu(g) * u) quantized per
    row, never written. Against XLA's maths (swiglu_values, its rows stored as bf16, then quantize_rows)
    bit for bit (its exp and division are XLA's), numpy's quantization of XLA's SwiGLU rows on sampled
    rows, and float64 maths on sampled rows. Gates reach
    +-100 (exp(100) overflows to inf: silu 0), with NaN, inf, zero and tiny rows."""
    key1, key2 = jax.random.split(jax.random.key(rng.integers(1 << 30)))
    gate_up = skewed(key1, shape).astype(jnp.float32)
    lead = (slice(None),) * (len(shape) - 2)
    gate_up = (
        gate_up.at[lead + (slice(4, 8), slice(0, 64))]
        .set(100 * jax.random.uniform(key2, shape[:-2] + (4, 64), minval=-1))
        .astype(jnp.bfloat16)
    )
    run = jax.jit(fp8_quant.quantize_rows, static_argnames=("swiglu", "backend"))
    assert "deep_ep_jax_fp8_quantize_rows" in run.lower(gate_up, swiglu=True).as_text()
    data, scales = run(gate_up, swiglu=True)
    assert data.shape == shape[:-1] + (shape[-1] // 2,)
    # XLA's SwiGLU rows (bf16, as stored) quantized: by XLA everywhere, by numpy on sampled rows.
    check(
        f"swiglu {shape}",
        jax.jit(fp8_quant.swiglu_values)(gate_up),
        (data, scales),
        run(gate_up, swiglu=True, backend="xla"),
        rng,
    )
    assert np.isnan(as_float(scales)[..., 1]).all(), "a NaN must make its row's scale NaN"
    # Sampled rows against float64 maths: within FP8's rounding (2^-4 relative, 2^-9 scales near 0) and
    # bf16's (2^-8).
    flat_h = swiglu_float64(gate_up).reshape(-1, shape[-1] // 2)
    flat_data, flat_scales = as_float(data).reshape(flat_h.shape), as_float(scales).reshape(-1)
    rows = np.unique(np.concatenate([[0, 3, 4, 5, 6, 7], rng.integers(0, flat_h.shape[0], 60)]))
    rows = rows[np.isfinite(flat_scales[rows])]  # not the NaN and inf rows (checked against XLA above)
    got = flat_data[rows] * flat_scales[rows, None]
    want = flat_h[rows]
    amax = np.max(np.abs(want), axis=1, keepdims=True)
    np.testing.assert_allclose(
        flat_scales[rows],
        np.maximum(amax[:, 0], 1e-30) / 448,
        rtol=2**-7,
        err_msg="swiglu: scales against float64 maths",
    )
    bound = 2**-4 * np.abs(want) + 2**-8 * np.abs(want) + 2**-9 * flat_scales[rows, None]
    bad = ~(np.abs(got - want) <= bound)
    assert not bad.any(), f"swiglu: {bad.sum()} values off float64 maths, rows {rows[np.any(bad, axis=1)][:5]}"
    assert not flat_data[0].any(), "an all-zero row must give zeros"


# (shape, multipliers): fp8_weights' shapes (80 experts: 2.3e9 float8 values per copy, past 32-bit
# offsets; 16), the FP8 weight gradient's dy with x's row scales, and a batch of rows that is no multiple
# of the tiles (a partial tile of 1000 rows: byte stores; strips cut short).
ROWS_AND_COLUMNS = [
    ((80, 7168, 4096), False),
    ((16, 2048, 7168), False),
    ((1, 40832, 4096), True),
    ((1, 40704, 7168), True),
    ((3, 1000, 384), True),
]


@pytest.mark.parametrize("shape,multipliers", ROWS_AND_COLUMNS)
def test_rows_and_columns_kernels(shape, multipliers, rng):
    key1, key2 = jax.random.split(jax.random.key(rng.integers(1 << 30)))
    a = skewed(key1, shape)
    m = jnp.exp(3 * jax.random.normal(key2, shape[:2])) if multipliers else None
    if multipliers:  # rows left out of the columns' copy, one of them holding a NaN
        m = m.at[:, 1].set(0).at[:, 40:47].set(0)
    run = jax.jit(fp8_quant.quantize_rows_and_columns, static_argnames="backend")
    assert "deep_ep_jax_fp8_amax_rows_and_columns" in run.lower(a, m).as_text(), (
        "backend='auto' did not pick the extension's kernels"
    )
    got = run(a, m)
    xla = run(a, m, backend="xla")
    what = f"quantize_rows_and_columns {shape}, multipliers {multipliers}"
    check(f"{what}, rows", a, got[:2], xla[:2], rng)
    z_t = jnp.swapaxes(
        jnp.where(m[..., None] == 0, 0.0, a.astype(jnp.float32) * m[..., None])
        if multipliers
        else a.astype(jnp.float32),
        1,
        2,
    )
    check(f"{what}, columns", z_t, got[2:], xla[2:], rng)
    assert np.isnan(as_float(got[1])[:, 1]).all(), "a NaN must make its row's scale NaN"
    if not multipliers:
        assert np.isnan(as_float(got[3])[:, 5]).all(), "a NaN must make its column's scale NaN"
