"""deep_ep_jax.fp8_quant's kernels on a GPU (quantize_rows' Triton one, quantize_rows_and_columns' CUDA ones),
at the MoE benchmark's shapes per rank, on skewed values with zero, NaN, inf and tiny rows: numpy's
quantization bit for bit on sampled rows, and the XLA maths (which tests/test_fp8_quant.py checks against
numpy on CPU; on GPUs it refines XLA's division, which is not correctly rounded) bit for bit everywhere;
impl="auto" must pick the kernels here.

    pytest -m gpu tests/gpu/test_fp8_quant_gpu.py -v
"""

import grouped_gemm_oracle as oracle
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deep_ep_jax import fp8_quant

pytestmark = pytest.mark.gpu(min_gpus=1)


@pytest.fixture(scope="module", autouse=True)
def fp8_gpu():
    device = jax.devices("gpu")[0]
    if not fp8_quant.triton_fp8_gpu(device):
        pytest.fail(f"the FP8 Triton kernels need compute capability 8.9+; this is {device.device_kind}",
                    pytrace=False)


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


@pytest.mark.parametrize("shape", [(40704, 7168), (40704, 2048), (2, 1024, 4096)])
def test_rows_kernel(shape):
    rng = np.random.default_rng()
    a = skewed(jax.random.key(rng.integers(1 << 30)), shape)
    run = jax.jit(fp8_quant.quantize_rows, static_argnames="impl")
    assert "fp8_quantize_rows" in run.lower(a).as_text(), "impl='auto' did not pick the Triton kernel"
    got = run(a)
    assert np.isnan(as_float(got[1])[..., 1]).all(), "a NaN must make its row's scale NaN"
    check(f"quantize_rows {shape}", a, got, run(a, impl="xla"), rng)


# (shape, multipliers): fp8_weights' shapes (80 experts: 2.3e9 float8 values per copy, past 32-bit
# offsets; 16), the FP8 weight gradient's dy with x's row scales, and a batch of rows that is no multiple
# of the tiles (a partial tile of 1000 rows: byte stores; strips cut short).
ROWS_AND_COLUMNS = [((80, 7168, 4096), False), ((16, 2048, 7168), False), ((1, 40832, 4096), True),
                    ((1, 40704, 7168), True), ((3, 1000, 384), True)]


@pytest.mark.parametrize("shape,multipliers", ROWS_AND_COLUMNS)
def test_rows_and_columns_kernels(shape, multipliers):
    rng = np.random.default_rng()
    key1, key2 = jax.random.split(jax.random.key(rng.integers(1 << 30)))
    a = skewed(key1, shape)
    m = jnp.exp(3 * jax.random.normal(key2, shape[:2])) if multipliers else None
    if multipliers:  # rows left out of the columns' copy, one of them holding a NaN
        m = m.at[:, 1].set(0).at[:, 40:47].set(0)
    run = jax.jit(fp8_quant.quantize_rows_and_columns, static_argnames="impl")
    assert "deep_ep_jax_fp8_amax_rows_and_columns" in run.lower(a, m).as_text(), \
        "impl='auto' did not pick the extension's kernels"
    got = run(a, m)
    xla = run(a, m, impl="xla")
    what = f"quantize_rows_and_columns {shape}, multipliers {multipliers}"
    check(f"{what}, rows", a, got[:2], xla[:2], rng)
    z_t = jnp.swapaxes(jnp.where(m[..., None] == 0, 0.0, a.astype(jnp.float32) * m[..., None]) if multipliers
                       else a.astype(jnp.float32), 1, 2)
    check(f"{what}, columns", z_t, got[2:], xla[2:], rng)
    assert np.isnan(as_float(got[1])[:, 1]).all(), "a NaN must make its row's scale NaN"
    if not multipliers:
        assert np.isnan(as_float(got[3])[:, 5]).all(), "a NaN must make its column's scale NaN"
