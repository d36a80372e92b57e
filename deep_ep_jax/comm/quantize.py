"""The quantized pairs `dispatch` moves (config.ROW_FORMATS), made from rows and read back:

    pair = deep_ep_jax.quantize(x, "MXFP8")        # x [..., H] -> (data, scales)
    rows = deep_ep_jax.dequantize(recv_x)          # a received pair -> bf16 [..., H]

FP8 and MXFP8 round as low-latency dispatch's own quantization does (amax floored at 1e-4, divided by
448; MXFP8's scales the power of two at or above). NVFP4 takes a float8_e4m3fn scale of amax / 6 per 16
channels and no tensor scale: blocks whose amax is under 6 * 2^-6 get subnormal scales (less precise)
and values past 448 * 6 saturate; multiply x by a tensor scale first where its values are that far from
1 (and the result by its inverse).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from deep_ep_jax.backends.reference import quantize_fp8
from deep_ep_jax.comm import validation as v
from deep_ep_jax.config import ROW_FORMATS, row_format

FORMATS = tuple(f.name for f in ROW_FORMATS)
_FP4_MAX = 6.0  # largest float4_e2m1fn
_E4M3_TINY = 2.0**-9  # smallest positive float8_e4m3fn: a block scale never rounds to 0


def quantize(x: jax.Array, format: str = "FP8") -> tuple[jax.Array, jax.Array]:
    """x [..., H] (any float dtype) -> the pair (data, scales) of `format`, one of FORMATS."""
    fmt = next((f for f in ROW_FORMATS if f.name == format), None)
    if fmt is None:
        raise ValueError(f"quantize: format must be one of {FORMATS}, got {format!r}")
    shape, dtype = v.shape_dtype(x, "quantize", "x")
    if not jnp.issubdtype(dtype, jnp.floating) or not shape or shape[-1] % fmt.block:
        raise TypeError(
            f"quantize: x must be a float array [..., H] with H a multiple of {fmt.block} for {format}, "
            f"got {dtype} {shape}"
        )
    if fmt.name in ("FP8", "MXFP8"):
        return quantize_fp8(x, mxfp8=fmt.name == "MXFP8")
    blocks = x.astype(jnp.float32).reshape(shape[:-1] + (shape[-1] // fmt.block, fmt.block))
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    scales = jnp.maximum(amax / _FP4_MAX, _E4M3_TINY).astype(fmt.scales)
    values = jnp.clip(blocks / scales.astype(jnp.float32)[..., None], -_FP4_MAX, _FP4_MAX)
    data = values.astype(jnp.float4_e2m1fn).reshape(shape)
    return (pack_float4(data) if fmt.pack > 1 else data), scales


def dequantize(pair, dtype=jnp.bfloat16) -> jax.Array:
    """A pair of any of FORMATS -> its rows [..., H] in `dtype` (values times their block's scale)."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"dequantize: pair must be (data, scales) of one of {FORMATS}, got {type(pair).__name__}")
    (shape, data_dtype), (sshape, sdtype) = (
        v.shape_dtype(a, "dequantize", n) for a, n in zip(pair, ("pair[0]", "pair[1]"))
    )
    fmt = row_format(data_dtype, sdtype)
    hidden = shape[-1] * fmt.pack if fmt and shape else 0
    if fmt is None or sshape != shape[:-1] + (hidden // fmt.block,) or not hidden:
        raise TypeError(
            f"dequantize: pair must be (data, scales) of one of {FORMATS} (docs/design.md), got "
            f"({data_dtype} {shape}, {sdtype} {sshape})"
        )
    data, scales = pair
    if fmt.pack > 1:
        data = unpack_float4(data)
    blocks = data.astype(jnp.float32).reshape(shape[:-1] + (hidden // fmt.block, fmt.block))
    return (blocks * scales.astype(jnp.float32)[..., None]).reshape(shape[:-1] + (hidden,)).astype(dtype)


def pack_float4(data: jax.Array) -> jax.Array:
    """float4_e2m1fn [..., H] -> uint8 [..., H // 2]: two values a byte, the first in the low half."""
    return lax.bitcast_convert_type(data.reshape(data.shape[:-1] + (data.shape[-1] // 2, 2)), jnp.uint8)


def unpack_float4(packed: jax.Array) -> jax.Array:
    """pack_float4's inverse."""
    data = lax.bitcast_convert_type(packed, jnp.float4_e2m1fn)  # [..., H // 2, 2]
    return data.reshape(data.shape[:-2] + (-1,))
