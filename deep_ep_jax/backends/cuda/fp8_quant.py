"""The FP8 quantizations as CUDA custom calls (csrc/ffi/fp8_quant.cc), for
deep_ep_jax/fp8_quant.py. Local targets (no peers, no Buffer memory, not in a
Buffer's order chain)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deep_ep_jax.backends.cuda.common import FfiTarget, limit

FP8_AMAX = FfiTarget(
    "deep_ep_jax_fp8_amax_rows_and_columns", ("row_amax", "col_amax_parts"), vmap_method="sequential", ordered=False
)
FP8_ROWS_AND_COLUMNS = FfiTarget(
    "deep_ep_jax_fp8_rows_and_columns", ("rows", "cols"), vmap_method="sequential", ordered=False
)
FP8_QUANTIZE_ROWS = FfiTarget(
    "deep_ep_jax_fp8_quantize_rows", ("data", "scales"), vmap_method="sequential", ordered=False
)
TARGETS = (FP8_AMAX, FP8_ROWS_AND_COLUMNS, FP8_QUANTIZE_ROWS)
# Blocks the amax kernel should have at least, where rows allow: about eight per SM, in waves of three
# (fewer partial column maxima than more blocks would leave).
_AMAX_MIN_BLOCKS = 1024


def fp8_amax(a, row_multipliers=None):
    """bf16 a [B, R, C] -> (row_amax int32 [B, R], col_amax_parts int32 [B, strips, C]): magnitude bits
    (|v|'s float32 bits, sign cleared: ordered as |v|, NaN above inf) of each row's amax of a, and of each
    column's amax of a * row_multipliers[..., None] (None: of a) over each strip of rows, for the caller
    to reduce."""
    batch, num_rows, cols = a.shape
    strip = limit("max_amax_strip_rows")  # long strips: fewer partial maxima
    bands = -(-cols // limit("amax_band_cols"))  # a block per (entry, strip, band of columns)
    while strip > 32 and batch * -(-num_rows // strip) * bands < _AMAX_MIN_BLOCKS:
        strip //= 2
    strips = -(-num_rows // strip)
    out_types = {
        "row_amax": jax.ShapeDtypeStruct((batch, num_rows), jnp.int32),
        "col_amax_parts": jax.ShapeDtypeStruct((batch, strips, cols), jnp.int32),
    }
    out = FP8_AMAX(None, out_types, a, _or_empty(row_multipliers), strip_rows=np.int64(strip))
    return out["row_amax"], out["col_amax_parts"]


def fp8_rows_and_columns(a, row_multipliers, row_inverse_scales, col_inverse_scales):
    """bf16 a [B, R, C] -> (float8 [B, R, C]: fp8(a * row_inverse_scales[..., None]), float8 [B, C, R]:
    fp8(a * row_multipliers[..., None] * col_inverse_scales[:, None, :]) transposed, 0 where a
    multiplier is 0; row_multipliers None: 1), from one read of a."""
    batch, num_rows, cols = a.shape
    out_types = {
        "rows": jax.ShapeDtypeStruct(a.shape, jnp.float8_e4m3fn),
        "cols": jax.ShapeDtypeStruct((batch, cols, num_rows), jnp.float8_e4m3fn),
    }
    out = FP8_ROWS_AND_COLUMNS(None, out_types, a, _or_empty(row_multipliers), row_inverse_scales, col_inverse_scales)
    return out["rows"], out["cols"]


def fp8_quantize_rows(a, swiglu):
    """bf16 a [..., C] -> (float8 [..., C], float32 [...]): fp8_quant.quantize_rows(a, swiglu=swiglu) (with
    swiglu, a is [..., 2C])."""
    shape = a.shape[:-1] + (a.shape[-1] // 2 if swiglu else a.shape[-1],)
    out_types = {
        "data": jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn),
        "scales": jax.ShapeDtypeStruct(a.shape[:-1], jnp.float32),
    }
    out = FP8_QUANTIZE_ROWS(None, out_types, a, swiglu=bool(swiglu))
    return out["data"], out["scales"]


def _or_empty(row_multipliers):
    return jnp.zeros((0,), jnp.float32) if row_multipliers is None else row_multipliers
