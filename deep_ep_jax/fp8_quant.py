"""FP8 quantization of the grouped GEMM's operands: one scale per row, or per row and per column.

    data, scales = quantize_rows(a)               # a [..., C] -> float8 [..., C], float32 [...]
    data, scales = quantize_rows(gate_up, swiglu=True)   # the rows of swiglu_values(gate_up [..., 2C])
    rows, row_scales, cols, col_scales = quantize_rows_and_columns(a, col_multipliers)
        # a [B, R, C] -> rows: a quantized per row, as quantize_rows;
        #               cols [B, C, R]: (a * col_multipliers[..., None]) quantized per column, transposed
        #               (0 on the rows whose multiplier is 0, whatever a holds there)

A scale is max(amax, FP8_MIN_AMAX) / 448 and a value clip(v * (1 / scale), -448, 448) rounded to the
nearest float8_e4m3fn (ties to even), 1 / scale correctly rounded: the same maths, bit for bit, as numpy's,
on every path (XLA's GPU division is not correctly rounded: the XLA path refines it). XLA computes it on
CPUs (and where the kernels below do not take the shape) in a pass per reduction and per conversion. On
CUDA GPUs with FP8 conversions (compute capability 8.9 and up) the extension's CUDA kernels read `a` fewer
times: quantize_rows in one pass (a warp per row: its amax, then its values again, from L1 or L2), with
swiglu=True from gate_up, so that the SwiGLU's bf16 rows are never written (its exp and division are
XLA's: the same values, bit for bit, on jax 0.11); quantize_rows_and_columns in two (both amaxes; then
both copies from one read, the columns' transposed through shared memory), with 64-bit offsets (the
weights' copies hold more than 2^31 values). Amaxes are integer maxima of |v|'s bits, in which NaN sorts
above inf (a float max drops NaNs). `fp8_weights` copies an expert's weights this way, and the FP8
weight gradient quantizes its dy. The kernels take bf16; other dtypes take the XLA maths everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from deep_ep_jax import _native
from deep_ep_jax.comm.validation import check_backend
from deep_ep_jax.comm.varying import vary_together

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0
# amax floored only so that 1 / scale stays finite: gradients may be far below the 1e-4 floor of the
# activations' FP8 (an all-zero row gets zeros).
FP8_MIN_AMAX = 1e-30

BACKENDS = ("auto", "cuda", "xla")


def quantize_rows(a, *, swiglu: bool = False, backend: str = "auto", impl: str | None = None):
    """a [..., C] -> (float8_e4m3fn [..., C], float32 [...]): one scale per row.
    swiglu=True: a [..., 2C] holds [gate, up] and the rows quantized are swiglu_values(a), bf16 (never
    written). backend: "auto" (the extension's CUDA kernel where it runs and takes a: bf16, C a multiple
    of 8; else XLA), "cuda" or "xla" (impl: its old name, deprecated). No gradient flows through
    (rounding's derivative is 0 almost everywhere; both paths stop it)."""
    backend = check_backend("quantize_rows", backend, BACKENDS, impl)
    a = lax.stop_gradient(a)
    if a.ndim < 1:
        raise ValueError(f"quantize_rows: a needs a row axis, got shape {tuple(a.shape)}")
    if swiglu and (a.shape[-1] % 2 or a.dtype != jnp.bfloat16):
        raise ValueError(f"quantize_rows: swiglu=True needs bf16 a [..., 2C], got {a.dtype} {tuple(a.shape)}")
    cols = a.shape[-1] // 2 if swiglu else a.shape[-1]
    if _use_cuda(
        "quantize_rows", backend, a, a.dtype == jnp.bfloat16 and cols % 8 == 0, "bf16 a with C a multiple of 8"
    ):
        return _cuda_ops().fp8_quantize_rows(a, swiglu)
    if swiglu:  # the barrier: the rows rounded to bf16 as stored (XLA would otherwise keep them in float32)
        return _quantize_rows_xla(lax.optimization_barrier(swiglu_values(a)))
    return _quantize_rows_xla(a)


def swiglu_values(gate_up):
    """bf16(silu(gate) * up) in float32 of gate_up [..., 2C] = [gate, up] along the last axis: [..., C]."""
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(jnp.bfloat16)


def quantize_rows_and_columns(a, col_multipliers=None, *, backend: str = "auto", impl: str | None = None):
    """a [B, R, C] -> (rows float8 [B, R, C], row_scales float32 [B, R], cols float8 [B, C, R],
    col_scales float32 [B, C]): rows is a quantized per row (quantize_rows(a)); cols is
    z = a * col_multipliers[..., None] (float32 [B, R], default 1; a row whose multiplier is 0 is 0 in z,
    whatever a holds there, NaN included: so padding rows are left out) quantized per column of z and
    transposed (quantize_rows(swapaxes(z, 1, 2))). backend: "auto" (the extension's CUDA kernels where
    they run and take a: bf16, C a multiple of 128; else XLA), "cuda" or "xla" (impl: its old name,
    deprecated). No gradient flows through."""
    backend = check_backend("quantize_rows_and_columns", backend, BACKENDS, impl)
    a = lax.stop_gradient(a)
    col_multipliers = None if col_multipliers is None else lax.stop_gradient(col_multipliers)
    if a.ndim != 3:
        raise ValueError(f"quantize_rows_and_columns: a must be [B, R, C], got shape {tuple(a.shape)}")
    if col_multipliers is not None and tuple(col_multipliers.shape) != a.shape[:2]:
        raise ValueError(
            f"quantize_rows_and_columns: col_multipliers must be {a.shape[:2]}, got {tuple(col_multipliers.shape)}"
        )
    if col_multipliers is not None:
        a, col_multipliers = vary_together(a, col_multipliers.astype(jnp.float32))  # (shard_map) typed alike
    if _use_cuda(
        "quantize_rows_and_columns",
        backend,
        a,
        a.dtype == jnp.bfloat16 and a.shape[2] % 128 == 0 and a.shape[1] < 2**31,
        "bf16 a with C a multiple of 128",
    ):
        return _cuda_rows_and_columns(a, col_multipliers)
    z = (
        a.astype(jnp.float32)
        if col_multipliers is None
        else _times_multipliers(a.astype(jnp.float32), col_multipliers[..., None])
    )
    return (*_quantize_rows_xla(a), *_quantize_rows_xla(jnp.swapaxes(z, 1, 2)))


def column_scales(a, row_multipliers):
    """(scales float32 [C], their inverses [C]) of the columns of z = a * row_multipliers[:, None] (a [R,
    C], row_multipliers float32 [R]; a row whose multiplier is 0 is 0 in z), as quantize_rows_and_columns'
    column copy has them: for copies of z whose rows are a's, each with a multiplier of at most that
    row's in magnitude (|a * m| = |a| * |m| exactly in float32, so the largest is in z)."""
    a, row_multipliers = lax.stop_gradient(a), lax.stop_gradient(row_multipliers)
    scales = _scales(_abs_max(_times_multipliers(a.astype(jnp.float32), row_multipliers[:, None]), axis=0))
    return scales, _inverse(scales)[:, 0]


# XLA ---------------------------------------------------------------------------------------------------


def _scales(amax):
    return _nan_max(amax, FP8_MIN_AMAX) * np.float32(1.0 / FP8_MAX)  # what XLA makes of amax / 448 anyway


def _to_fp8(v, inverse_scales):
    """float8 of clip(v * inverse_scales, -448, 448), NaN kept."""
    p = v * inverse_scales
    return jnp.where(p != p, p, jnp.minimum(jnp.maximum(p, -FP8_MAX), FP8_MAX)).astype(FP8_DTYPE)


def _times_multipliers(v, m):
    """v * m, 0 where m is 0 (whatever v holds: rows left out of the columns' copy)."""
    return jnp.where(m == 0, 0.0, v * m)


def _abs_max(v, axis):
    """max |v| along axis, NaN where v holds one (XLA's CPU reductions drop NaNs at some shapes)."""
    return jnp.where(jnp.max(jnp.where(v != v, 1.0, 0.0), axis=axis) > 0, jnp.nan, jnp.max(jnp.abs(v), axis=axis))


def _nan_max(a, b):
    """jnp.maximum, NaN if either is NaN on every backend."""
    return jnp.where((a != a) | (b != b), jnp.nan, jnp.maximum(a, b))


def _inverse(scales):
    """float32 1 / scales [...] as [..., 1], correctly rounded on every backend (XLA's GPU division is
    div.full, up to 2 ulp off; scales are at most float32's max / 448, so the inverses are normal); the
    barrier keeps XLA from folding the division into the scales' own arithmetic."""
    scales = lax.optimization_barrier(scales)
    mantissa, exponent = jnp.frexp(scales)  # scales = mantissa 2^exponent, 0.5 <= mantissa < 1
    inverse = jnp.ldexp(_reciprocal_refined(mantissa, 1.0 / mantissa), -exponent)
    return jnp.where(jnp.isfinite(scales) & (scales > 0), inverse, 1.0 / scales)[..., None]


def _reciprocal_refined(m, r):
    """The correctly rounded 1 / m (float32, 0.5 <= m < 1) from r, an approximation within 2 ulp: of r and
    its neighbours, the one whose m * r is nearest 1, the products taken exactly (Dekker's two-product,
    exact with or without fused multiply-adds)."""

    def split(a):  # a = high + low, each of at most 12 significant bits
        t = a * 4097.0
        high = t - (t - a)
        return high, a - high

    def distance_from_one(c):
        p = m * c
        (mh, ml), (ch, cl) = split(m), split(c)
        error = ((mh * ch - p) + mh * cl + ml * ch) + ml * cl  # m * c - p, exactly
        return jnp.abs((1.0 - p) - error)  # 1 - p is exact: p is within a few ulp of 1

    best, best_distance = r, distance_from_one(r)
    for toward in (0.0, 4.0):  # the two float32 values below r, then the two above
        c = r
        for _ in range(2):
            c = jnp.nextafter(c, jnp.float32(toward))
            d = distance_from_one(c)
            best, best_distance = jnp.where(d < best_distance, c, best), jnp.minimum(d, best_distance)
    return best


def _quantize_rows_xla(a, scales=None):
    """quantize_rows by XLA, with the given scales [...] or a's own."""
    v = a.astype(jnp.float32)
    scales = _scales(_abs_max(v, axis=-1)) if scales is None else scales
    return _to_fp8(v, _inverse(scales)), scales


# Choice ---------------------------------------------------------------------------------------------------


def _use_cuda(fn, backend, a, fits, need) -> bool:
    """Whether fn runs the extension's kernels: backend "cuda" (which raises where a does not fit them or the
    extension does not load), or "auto" where they fit and run (a GPU with FP8 conversions)."""
    if backend == "cuda":
        if not fits:
            raise ValueError(f"{fn}: backend='cuda' needs {need}, got {a.dtype} {tuple(a.shape)}")
        reason = _native.unavailable_reason()
        if reason:
            raise RuntimeError(f"{fn}: backend='cuda' is not available: {reason}")
        return True
    return backend == "auto" and fits and fp8_gpu() and _native.unavailable_reason() is None


def fp8_gpu(device=None) -> bool:
    """Whether `device` (default jax.devices()[0]) is a CUDA GPU that converts to FP8 (compute capability
    8.9 and up), where the kernels run."""
    device = jax.devices()[0] if device is None else device
    major, _, minor = str(getattr(device, "compute_capability", "0")).partition(".")
    return getattr(device, "platform", None) == "gpu" and (int(major or 0), int(minor or 0)) >= (8, 9)


# CUDA kernels (the extension's: csrc/ffi/fp8_quant.cc, csrc/kernels/fp8_quant.cu) ---------------------------


def _cuda_ops():
    """The extension's FP8 targets (backends/cuda/fp8_quant.py), registered with XLA."""
    from deep_ep_jax.backends.cuda import fp8_quant as cuda
    from deep_ep_jax.backends.cuda import lifecycle

    lifecycle.register_ffi_targets()
    return cuda


def _cuda_rows_and_columns(a, col_multipliers):
    cuda = _cuda_ops()
    row_bits, col_bits = cuda.fp8_amax(a, col_multipliers)
    as_float = lambda bits: lax.bitcast_convert_type(bits, jnp.float32)
    row_scales, col_scales = _scales(as_float(row_bits)), _scales(as_float(jnp.max(col_bits, axis=1)))
    rows, cols = cuda.fp8_rows_and_columns(
        a, col_multipliers, _inverse(row_scales)[..., 0], _inverse(col_scales)[..., 0]
    )
    return rows, row_scales, cols, col_scales
