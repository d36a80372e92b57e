"""deep_ep_jax.quantize / dequantize: the pairs dispatch moves (config.ROW_FORMATS), made and read back."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import deep_ep_jax as dej
from deep_ep_jax.comm import validation
from deep_ep_jax.config import ROW_FORMATS

FORMATS = [f.name for f in ROW_FORMATS]
# Per format: values it holds exactly (a block's largest is the format's largest, so its scale is a power
# of two), and the largest error of a round trip relative to the block's amax.
EXACT = {"FP8": ml_dtypes.float8_e4m3fn, "MXFP8": ml_dtypes.float8_e4m3fn}
EXACT.update(dict.fromkeys(["NVFP4", "NVFP4 packed"], ml_dtypes.float4_e2m1fn))
# NVFP4: half e2m1's widest step (4 to 6) in units of a scale that rounds to e4m3 (to 2^-4).
TOLERANCE = {"FP8": 2**-4, "MXFP8": 2**-3, "NVFP4": 0.25, "NVFP4 packed": 0.25}


@pytest.mark.parametrize("name", FORMATS)
def test_pairs_are_what_dispatch_takes_and_read_back(name, rng):
    fmt = ROW_FORMATS[FORMATS.index(name)]
    # Rows of magnitudes 1 to 100: NVFP4's e4m3 block scales stay normal (no tensor scale: docstring).
    x = jnp.asarray(rng.standard_normal((2, 6, 256)) * 10.0 ** rng.integers(0, 3, (2, 6, 1)), jnp.bfloat16)
    data, scales = jax.jit(dej.quantize, static_argnums=1)(x, name)
    assert (data.dtype, scales.dtype) == (fmt.data, fmt.scales)
    assert (data.shape, scales.shape) == ((2, 6, 256 // fmt.pack), (2, 6, 256 // fmt.block))
    validation.check_tokens((data[0], scales[0]), None, "dispatch", formats=ROW_FORMATS)  # dispatch takes it
    back = dej.dequantize((data, scales), jnp.float32)
    assert back.shape == x.shape and dej.dequantize((data, scales)).dtype == jnp.bfloat16
    blocks = np.asarray(x, np.float32).reshape(2, 6, -1, fmt.block)
    error = np.abs(np.asarray(back).reshape(blocks.shape) - blocks)
    assert (error <= TOLERANCE[name] * np.abs(blocks).max(-1, keepdims=True)).all()


@pytest.mark.parametrize("name", FORMATS)
def test_representable_rows_round_trip_exactly(name, rng):
    """Rows of the format's own values, each block's largest its largest (times a power of two): dequantize
    gives them back bit for bit (FP8: to float32 rounding, its scale amax / 448 being inexact)."""
    fmt = ROW_FORMATS[FORMATS.index(name)]
    kind = EXACT[name]
    largest = float(ml_dtypes.finfo(kind).max)
    codes = rng.integers(0, 256 if kind == ml_dtypes.float8_e4m3fn else 16, (4, 128), np.uint8)
    values = np.nan_to_num(codes.view(kind).astype(np.float32), nan=0.0).reshape(4, -1, fmt.block)
    values[..., 0] = largest
    x = values.reshape(4, 128) * 2.0 ** rng.integers(-4, 5, (4, 1))
    back = dej.dequantize(dej.quantize(jnp.asarray(x), name), jnp.float32)
    np.testing.assert_allclose(back, x, rtol=1e-6 if name == "FP8" else 0, atol=0)


def test_packed_nvfp4_is_the_float4_data_two_to_a_byte(rng):
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    data, scales = dej.quantize(x, "NVFP4")
    packed, packed_scales = dej.quantize(x, "NVFP4 packed")
    nibbles = np.asarray(data).view(np.uint8).reshape(3, 64, 2)
    np.testing.assert_array_equal(packed, nibbles[..., 0] | nibbles[..., 1] << 4)
    np.testing.assert_array_equal(packed_scales.view(np.uint8), scales.view(np.uint8))


def test_bad_arguments():
    x = jnp.zeros((4, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"quantize: format must be one of \('FP8', 'MXFP8', 'NVFP4'"):
        dej.quantize(x, "fp8")
    with pytest.raises(TypeError, match="H a multiple of 32 for MXFP8, got bfloat16 \\(4, 48\\)"):
        dej.quantize(x[:, :48], "MXFP8")
    with pytest.raises(TypeError, match="must be a float array"):
        dej.quantize(x.astype(jnp.int32), "FP8")
    pair = dej.quantize(x, "MXFP8")
    with pytest.raises(TypeError, match="dequantize: pair must be \\(data, scales\\)"):
        dej.dequantize(pair[0])
    with pytest.raises(TypeError, match=r"got \(float8_e4m3fn \(4, 128\), float8_e8m0fnu \(4, 2\)\)"):
        dej.dequantize((pair[0], pair[1][:, :2]))
