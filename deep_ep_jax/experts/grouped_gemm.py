"""Grouped matmul for the experts: y[m] = x[m] @ w[g(m)] over contiguous row groups.

    y = grouped_matmul(x, w, group_sizes)     # x [M, K], w [G, K, N] -> y [M, N]

Row m belongs to group g when offset[g] <= m < offset[g] + group_sizes[g]
(offsets: the exclusive cumsum of group_sizes); rows past sum(group_sizes) are
padding: their output rows are 0 and they get zero gradient. Products
accumulate in float32; the output has x's dtype. Gradients (custom_vjp):
dx = dy @ w[g]^T per group, dw[g] = x_g^T dy_g; group_sizes has none.

backend="auto" runs Mosaic GPU kernels on a Hopper GPU (compute capability
9.x) when the shapes fit their tiles (see `mgpu_unsupported_reason`), and
`jax.lax.ragged_dot` otherwise. Of the Mosaic GPU kernels, the
warp-specialized ones of `deep_ep_jax.experts.hopper_gemm` run when every group size
is a multiple of `aligned_rows(blocks)` (128 by default: the expert-major
layout's `alignment=128`), checked on the device at run time; other sizes
take JAX's row-tiled kernels (`ragged_dot_mgpu` for y and dx,
`transposed_ragged_dot_mgpu` for dw), which compute a tile twice where it
straddles two groups. backend="cuda" (the Mosaic GPU kernels; "mgpu" before) or "xla"
forces one; "cuda" raises
a ValueError where the shapes do not fit or jax's first device is no Hopper
GPU. Notes on the mgpu path:
- The warp-specialized kernels store the zeros of padding rows themselves
  (no pass over y or dx). JAX's row-tiled kernels leave rows past
  sum(group_sizes) unwritten: there the wrapper masks y and dx. On every
  path the backward zeroes dy's padding rows once, for the weight gradient
  (the aligned kernel reads up to a row step past a group's data). Each mask
  is a select, fused by XLA into a neighbouring op where there is one (in
  the MoE layer, dy's producer).
- The row-tiled kernels' cost follows M, not sum(group_sizes): tiles past
  the last group still run (and are thrown away); the warp-specialized ones
  skip them. Keep M near the worst case you need.
- JAX's row-tiled kernels lower tiles at most `ROW_TILED_MAX_BLOCK_N`
  columns wide (256 before jax 0.12, 128 from it; `DEFAULT_BLOCKS` follows);
  wider `block_sizes` raise a ValueError.
- M not a multiple of `row_multiple(blocks)` (128 by default) costs a padded
  copy of x; make the expert-major layout's row count a multiple of it.
- dw multiplies some padding rows of x by zero (just past the last group,
  and with valid_sizes up to a row step past a group's valid rows): they
  must hold finite values (zero them where they may hold NaN, as the padding
  rows of `dispatch`'s output may; the expert-major layout's are zeros).
On a GPU, jax.lax.ragged_dot (the "xla" path) expands to a dense dot over all
groups (G times the work) unless JAX's Pallas-Triton lowering is switched on
(`jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)`).

FP8 (`fp8_weights=fp8_weights(w)`): y and dx from float8_e4m3fn operands, x
and dy quantized with one scale per row inside (or x given quantized, as an
`Fp8Rows`), w from its copies (one scale per output channel); dw as without FP8
(from the dequantized rows where x is an `Fp8Rows`). With `fp8_weights(w,
weight_grad=True)` dw too: dw[g] = x_g^T dy_g from the forward's quantized x
(kept instead of x) and dy times x's row scales, quantized with one scale per
column (faster for the SwiGLU and the MoE layer alike). The
quantizations are deep_ep_jax.fp8_quant's.
On Hopper the warp-specialized kernels run with FP8 WGMMA, each K step added
to a float32 total in registers (the FP8 tensor cores keep only about 14
bits while they accumulate; the weight gradient's row steps only in groups
longer than its tiles' promote_after_steps), the scales applied in their
epilogues; groups
must be aligned (aligned_groups=True). Elsewhere the same maths is
jax.lax.ragged_dot in float32 on the dequantized operands.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from deep_ep_jax.comm import validation as v
from deep_ep_jax.comm.varying import vary_over, vary_together, vma
from deep_ep_jax.experts import hopper_gemm
from deep_ep_jax.experts.hopper_gemm import HopperTiles
from deep_ep_jax.fp8_quant import FP8_DTYPE, quantize_rows, quantize_rows_and_columns, swiglu_values

BACKENDS = ("auto", "cuda", "xla")  # "cuda": the Mosaic GPU kernels
MGPU_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
    """Tiles of one Mosaic GPU kernel, under the kernels' own argument names."""

    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int
    grid_block_n: int


@dataclasses.dataclass(frozen=True)
class AlignedTiles:
    """Tiles of the warp-specialized kernels (deep_ep_jax.experts.hopper_gemm), for groups whose sizes are
    multiples of `aligned_rows`."""

    forward: HopperTiles
    input_grad: HopperTiles
    weight_grad: HopperTiles
    fp8: HopperTiles  # forward and input gradient on FP8 operands (fp8_weights=)
    fp8_weight_grad: HopperTiles  # weight gradient on FP8 operands (fp8_weights(w, weight_grad=True))


# The best of `benchmarks/hopper_gemm_sweep.py` (bf16) and `benchmarks/fp8_gemm_sweep.py` (FP8) at the MoE
# benchmark's shapes per rank, groups aligned to 128 rows (the figures: benchmarks/RESULTS.md).
DEFAULT_ALIGNED_TILES = AlignedTiles(
    forward=HopperTiles(128, 128, 64, 4, grid_minor_n=False, grid_tile_width=4),
    input_grad=HopperTiles(128, 128, 64, 4, grid_minor_n=False, grid_tile_width=4),
    # A CTA's tiles as one pipeline (the next tile's loads overlap this tile's last products), each
    # warpgroup's tile stored at once rather than in 64 x 64 pieces (a tile has only a few row steps to
    # hide its stores behind).
    weight_grad=HopperTiles(128, 128, 64, 3, grid_tile_width=4, steady_pipeline=True, epi_tile_m=128, epi_tile_n=128),
    # K steps of 256 float8 (two 128-byte swizzled tiles), each added to a float32 total (promote), for which
    # the warpgroups' 64 x 128 accumulators leave room; steps of 256 promote half as often as steps of 128,
    # at the same error. Bands of row tiles that end with a group read each weight tile from HBM about once
    # (a band of fixed width that cuts through a group reads that group's weights twice), which shortens the
    # layer's step; bands of about 2 row tiles (a group or two) edge out bands of 4 in the four matmuls and
    # the layer alike.
    fp8=HopperTiles(
        64, 128, 256, 3, grid_minor_n=False, grid_tile_width=2, split_rows=True, promote=True, group_bands=True
    ),
    # Row steps of 128 float8 (the contraction runs over a group's rows: a few steps per tile). A group of up
    # to 4 steps (512 rows: twice the mean load) in one accumulator per warpgroup (128 x 128), whose ~14 bits
    # are about as exact as promotion over so few steps; a longer one (a group may hold every row) promoted,
    # in halves. Faster than the warpgroups' 64 x 128 tiles all promoted, whose accumulators are half the
    # size (benchmarks/fp8_gemm_sweep.py --kernels weight_grad).
    fp8_weight_grad=HopperTiles(
        128, 128, 128, 3, grid_tile_width=4, steady_pipeline=True, epi_tile_m=128, epi_tile_n=128, promote_after_steps=4
    ),
)


@dataclasses.dataclass(frozen=True)
class GroupedMatmulBlocks:
    """Block sizes of the three kernel calls of one forward + backward."""

    forward: KernelBlocks  # ragged_dot_mgpu: y = x @ w[g]
    input_grad: KernelBlocks  # ragged_dot_mgpu(transpose_rhs=True): dx = dy @ w[g]^T
    weight_grad: KernelBlocks  # transposed_ragged_dot_mgpu: dw[g] = x_g^T dy_g (its k runs over rows)
    aligned: AlignedTiles | None = DEFAULT_ALIGNED_TILES  # None: row-tiled kernels only


# The widest row tiles (block_n) of ragged_dot_mgpu that this jax lowers: from jax 0.12 Mosaic GPU's
# layout inference rejects its 256-column tiles ("Failed to infer a possible set of layouts"; the kernel's
# own tests use 64 and 128).
ROW_TILED_MAX_BLOCK_N = 256 if jax.__version_info__ < (0, 12) else 128

# The best of `benchmarks/bench_grouped_gemm.py --sweep` at the MoE benchmark's shapes per rank: 32768 pairs
# in 128 groups, K, N = 7168, 4096 and 2048, 7168 (the figures: benchmarks/RESULTS.md). Up to jax 0.11:
# 64 x 256 row tiles. From jax 0.12, which lowers tiles at most 128 columns wide: 128 x 128 row tiles,
# 5 stages, grid_block_n 4, clearly ahead of 64 x 128 tiles in both the forward and the input gradient.
if ROW_TILED_MAX_BLOCK_N >= 256:
    _FORWARD, _INPUT_GRAD = KernelBlocks(64, 256, 64, 5, grid_block_n=1), KernelBlocks(64, 256, 64, 5, grid_block_n=2)
else:
    _FORWARD = _INPUT_GRAD = KernelBlocks(128, 128, 64, 5, grid_block_n=4)
DEFAULT_BLOCKS = GroupedMatmulBlocks(
    forward=_FORWARD,
    input_grad=_INPUT_GRAD,
    weight_grad=KernelBlocks(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=4),
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weights:
    """FP8 copies of expert weights w [G, K, N] for grouped_matmul(..., fp8_weights=), made by
    `fp8_weights(w)`: float8_e4m3fn data with one float32 scale per output channel of the matmul
    that each copy serves (w ~= data * scales, broadcast along the other axis)."""

    forward: jax.Array  # [G, N, K]: w[g]^T with K contiguous, as FP8 WGMMA reads its operands
    forward_scales: jax.Array  # [G, N]
    input_grad: jax.Array  # [G, K, N]: w, for dx = dy @ w[g]^T
    input_grad_scales: jax.Array  # [G, K]
    weight_grad: bool = dataclasses.field(default=False, metadata=dict(static=True))  # dw from FP8 operands too


def fp8_weights(w, *, weight_grad: bool = False) -> Fp8Weights:
    """The FP8 copies of w [G, K, N] for grouped_matmul(..., fp8_weights=).
    weight_grad=True: w's gradient from FP8 operands as well (see the module docstring).

    Make them once per optimizer step, outside the gradient accumulation:
    they read all of w twice (fp8_quant.quantize_rows_and_columns)."""
    _validate_array("w", w, 3, "fp8_weights")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"fp8_weights: w must be a floating array (the weights), got {w.dtype}")
    weight_grad = v.check_bool("fp8_weights", "weight_grad", weight_grad)
    input_grad, input_grad_scales, forward, forward_scales = quantize_rows_and_columns(w)
    return Fp8Weights(forward, forward_scales, input_grad, input_grad_scales, weight_grad)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Rows:
    """Rows x [M, K] already quantized, one scale per row (as `quantize_rows(x)` makes them), for
    grouped_matmul(..., fp8_weights=) in place of x: its forward reads them, so x need not exist in bf16
    (`dispatch_expert_major(..., fp8_rows=True)` sends rows as FP8 and regroups them so). The rows'
    gradient (bf16) is the cotangent of `grad_sink`: zeros standing for x in the forward, never read,
    whose producer routes that gradient back to where the rows came from (FP8 values carry none: read
    `data` and `scales` elsewhere and that use sends no gradient back)."""

    data: jax.Array  # float8_e4m3fn [M, K]
    scales: jax.Array  # float32 [M]: x[m] ~= data[m] * scales[m]
    grad_sink: jax.Array  # bf16 [M, K] zeros; its cotangent is x's gradient
    # float8_e4m3fn [K, M], data transposed, which the FP8 weight gradient reads (FP8 WGMMA takes both
    # operands contraction-major), or None: then the matmul transposes data itself. expand makes it.
    data_t: jax.Array | None = None


def swiglu(gate_up, *, fp8_rows: bool = False):
    """silu(gate) * up in float32, bf16 [..., F], of gate_up bf16 [..., 2F] = [gate, up] along its last
    axis (the experts' first matmul's output). fp8_rows=True: the same rows as an Fp8Rows (quantize_rows of
    them) for the next grouped_matmul(..., fp8_weights=), made in one pass over gate_up by the extension's
    kernel where it runs: the bf16 rows are never written. Its gradient reaches gate_up through the
    Fp8Rows' grad_sink. Meant for fp8_weights(w, weight_grad=True), whose dw reads the FP8 rows anyway;
    with bf16 weight gradients dw would come from the dequantized rows."""
    if not fp8_rows:
        return swiglu_values(gate_up)
    if getattr(gate_up, "ndim", None) != 2 or gate_up.dtype != jnp.bfloat16 or gate_up.shape[1] % 2:
        raise ValueError(
            f"swiglu: fp8_rows=True needs bf16 gate_up [M, 2F], got {gate_up.dtype} {tuple(gate_up.shape)}"
        )
    data, scales = quantize_rows(gate_up, swiglu=True)  # no gradient: the sink's backward gives gate_up's
    return Fp8Rows(data, scales, _swiglu_sink(gate_up))


@jax.custom_vjp
def _swiglu_sink(gate_up):
    """Zeros shaped as swiglu(gate_up), whose cotangent (the rows' gradient) is taken back through
    swiglu_values."""
    return vary_over(jnp.zeros((gate_up.shape[0], gate_up.shape[1] // 2), gate_up.dtype), vma(gate_up))


def _swiglu_sink_fwd(gate_up):
    return _swiglu_sink(gate_up), gate_up


def _swiglu_sink_bwd(gate_up, g_rows):
    return jax.vjp(swiglu_values, gate_up)[1](g_rows)


_swiglu_sink.defvjp(_swiglu_sink_fwd, _swiglu_sink_bwd)


def resolve_backend(fn, backend, impl=None) -> str:
    """grouped_matmul's backend ("auto", "cuda", "xla"), from backend= or impl= (its deprecated
    name); "mgpu" (the Mosaic GPU kernels' old name) means "cuda"."""
    return v.check_backend(fn, backend, BACKENDS, impl, {"mgpu": "cuda"})


def grouped_matmul(
    x,
    w,
    group_sizes,
    *,
    backend: str = "auto",
    block_sizes: GroupedMatmulBlocks | None = None,
    aligned_groups: bool = False,
    valid_sizes=None,
    fp8_weights: Fp8Weights | None = None,
    impl: str | None = None,
):
    """y[m] = x[m] @ w[g(m)]: x [M, K], w [G, K, N], group_sizes int [G] -> y [M, N] of x's dtype.

    Negative group sizes count as 0 and groups are cut at row M, so a bad
    group_sizes never reads or writes past x and y. See the module docstring
    for `backend` and `block_sizes` (`impl`: backend's old name, deprecated).

    aligned_groups=True promises that every group size is a multiple of
    `aligned_rows(block_sizes)` (as the expert-major layout's with that
    alignment are): the warp-specialized kernels then run without the
    device-side choice of kernels (a lax.cond, which on GPUs waits for the
    device before its branch is launched). Sizes that break the promise make
    y and the gradients NaN, on every backend, never silently wrong.

    valid_sizes (int [G], optional): of each group's rows, how many at its
    start hold data (clamped to [0, group_sizes[g]]; the expert-major
    layout's `layout.group_sizes` beside its aligned sizes). The group's
    other rows are padding, as rows past the last group are: y is 0 there and
    they get zero gradient, so the weight gradient's kernel skips them (on
    the warp-specialized path it reads a group's rows only up to the next
    multiple of its row step past valid_sizes[g]).

    fp8_weights (optional, `fp8_weights(w)` of this w): y and dx are
    computed from float8_e4m3fn operands, x and dy quantized with one scale
    per row, w from these copies; products accumulate in float32 (on the
    GPU in the FP8 WGMMA's accumulator), then are scaled. w's gradient is
    computed in x's dtype, as without them. On the Mosaic GPU path this
    needs aligned_groups=True. With them, x may be an Fp8Rows: rows quantized
    before (e.g. sent as FP8 by dispatch_expert_major(..., fp8_rows=True)),
    which the forward reads as they are; dx is then the cotangent of
    x.grad_sink (and without w's FP8 weight gradient, dw comes from the
    dequantized rows)."""
    backend = resolve_backend("grouped_matmul", backend, impl)
    call = prepared_call(x, w, group_sizes, backend, block_sizes, aligned_groups, valid_sizes, fp8_weights)
    x, w, group_sizes, valid_sizes, scale = call.arrays
    if fp8_weights is not None:
        y = _grouped_matmul_fp8(*call.static, x, w, fp8_weights, group_sizes, valid_sizes, scale)
    else:
        y = _grouped_matmul(call.use_mgpu, call.blocks, aligned_groups, x, w, group_sizes, valid_sizes, scale)
    return y[: call.num_rows]


class PreparedCall(NamedTuple):
    """grouped_matmul's arguments validated and made ready for its custom_vjps."""

    use_mgpu: bool
    blocks: GroupedMatmulBlocks
    given_rows: bool  # x is an Fp8Rows
    num_rows: int  # x's rows (the arrays' may be padded past them: slice the output back)
    arrays: tuple  # (x, w, group_sizes, valid_sizes, scale), varying together

    @property
    def static(self):
        """The FP8 custom_vjp's static arguments."""
        return self.use_mgpu, self.blocks, self.given_rows


def prepared_call(x, w, group_sizes, backend, block_sizes, aligned_groups, valid_sizes, fp8_weights) -> PreparedCall:
    """grouped_matmul's validation and preparation: the shared sizes, the promise's scale, padded rows."""
    blocks = DEFAULT_BLOCKS if block_sizes is None else block_sizes
    given_rows = isinstance(x, Fp8Rows)
    if given_rows:
        _validate_fp8_rows(x, fp8_weights)
    x_like = x.grad_sink if given_rows else x  # what x's shape and dtype are
    _validate(x_like, w, group_sizes, blocks)
    if valid_sizes is not None:
        _validate_array("valid_sizes", valid_sizes, 1)
        if valid_sizes.shape != group_sizes.shape or not jnp.issubdtype(valid_sizes.dtype, jnp.integer):
            raise ValueError(
                f"grouped_matmul: valid_sizes must be integers shaped as group_sizes "
                f"{tuple(group_sizes.shape)}, got {valid_sizes.dtype} {tuple(valid_sizes.shape)}"
            )
    aligned_groups = v.check_bool("grouped_matmul", "aligned_groups", aligned_groups)
    use_mgpu = _use_mgpu(backend, x_like, w, blocks)
    if fp8_weights is not None:
        _validate_fp8(fp8_weights, w, use_mgpu, aligned_groups, blocks)
    num_rows = x_like.shape[0]
    padded_rows = -(-num_rows // row_multiple(blocks)) * row_multiple(blocks) if use_mgpu else num_rows
    # kept: whether the promise holds (the sizes as given); cut at the padded rows, aligned sizes stay aligned.
    kept = _sizes_aligned(group_sizes, blocks) if aligned_groups else None
    group_sizes = _clamp_group_sizes(group_sizes, padded_rows)
    valid_sizes = group_sizes if valid_sizes is None else jnp.clip(valid_sizes.astype(jnp.int32), 0, group_sizes)
    # One vma for all (shard_map): the custom_vjp's cotangents then match
    # their primals, and a weight replicated over the axis gets its gradient summed.
    # x 1, or x NaN where the promise is broken (y and the gradients are NaN then, never silently wrong).
    scale = jnp.ones((1,), jnp.float32) if kept is None else jnp.where(kept, 1.0, jnp.nan).astype(jnp.float32)[None]
    x_leaves, x_tree = jax.tree.flatten(x)  # [x], or an Fp8Rows' arrays
    *x_leaves, w, group_sizes, valid_sizes, scale = vary_together(*x_leaves, w, group_sizes, valid_sizes, scale)
    x = jax.tree.unflatten(x_tree, x_leaves)
    if padded_rows != num_rows:
        x = _padded_rows(x, padded_rows - num_rows)
    return PreparedCall(use_mgpu, blocks, given_rows, num_rows, (x, w, group_sizes, valid_sizes, scale))


def row_multiple(blocks: GroupedMatmulBlocks = DEFAULT_BLOCKS) -> int:
    """The mgpu path pads x's rows to a multiple of this (every kernel's row tile)."""
    aligned = () if blocks.aligned is None else (aligned_rows(blocks),)
    return math.lcm(blocks.forward.block_m, blocks.input_grad.block_m, blocks.weight_grad.block_k, *aligned)


def aligned_rows(blocks: GroupedMatmulBlocks = DEFAULT_BLOCKS) -> int:
    """Group sizes that are all multiples of this take the warp-specialized
    kernels (pass it as the expert-major layout's alignment)."""
    a = blocks.aligned or DEFAULT_ALIGNED_TILES
    return math.lcm(
        hopper_gemm.row_tile(a.forward),
        hopper_gemm.row_tile(a.input_grad),
        a.weight_grad.tile_k,
        hopper_gemm.row_tile(a.fp8),
        a.fp8_weight_grad.tile_k,
    )


def _sizes_aligned(group_sizes, blocks):
    """bool []: every group size is a multiple of aligned_rows(blocks) (traced)."""
    return jnp.all(group_sizes % aligned_rows(blocks) == 0)


def _aligned_fits(k, n, blocks) -> bool:
    """Whether K and N split into the aligned kernels' tiles."""
    a = blocks.aligned
    if a is None:
        return False
    f, dx, dw = a.forward, a.input_grad, a.weight_grad
    cols = hopper_gemm.cta_cols
    return not (k % f.tile_k or n % cols(f) or n % dx.tile_k or k % cols(dx) or k % dw.tile_m or n % cols(dw))


def mgpu_unsupported_reason(x_shape, w_shape, dtype, blocks: GroupedMatmulBlocks = DEFAULT_BLOCKS) -> str | None:
    """Why the Mosaic GPU kernels cannot take these shapes, or None if they can.

    They need 16-bit floats, K and N whole multiples of the tiles that split
    them (each kernel stores and loads whole tiles along K and N), and rows."""
    num_rows, k = x_shape
    _, _, n = w_shape
    if jnp.dtype(dtype) not in MGPU_DTYPES:
        return f"dtype {jnp.dtype(dtype)} (the kernels take bfloat16 or float16)"
    if num_rows == 0:
        return "no rows"
    f, dx, dw = blocks.forward, blocks.input_grad, blocks.weight_grad
    for size, name, tile, tile_name in (
        (k, "K", f.block_k, "forward.block_k"),
        (n, "N", f.block_n, "forward.block_n"),
        (n, "N", dx.block_k, "input_grad.block_k"),
        (k, "K", dx.block_n, "input_grad.block_n"),
        (k, "K", dw.block_m, "weight_grad.block_m"),
        (n, "N", dw.block_n, "weight_grad.block_n"),
    ):
        if size % tile:
            return f"{name}={size} is not a multiple of {tile_name}={tile}"
    return None


def is_hopper_gpu(device=None) -> bool:
    """Whether `device` (default jax.devices()[0]) is a CUDA GPU of compute capability 9.x."""
    device = jax.devices()[0] if device is None else device
    capability = str(getattr(device, "compute_capability", ""))
    return device.platform == "gpu" and capability.startswith("9.")


# Validation and choice --------------------------------------------------------


def _validate_array(name, a, rank, fn="grouped_matmul"):
    shape, _ = v.shape_dtype(a, fn, name)
    if len(shape) != rank:
        raise ValueError(f"{fn}: {name} must have rank {rank}, got shape {shape}")


def _validate(x, w, group_sizes, blocks):
    fn = "grouped_matmul"
    if not isinstance(blocks, GroupedMatmulBlocks):
        raise TypeError(f"{fn}: block_sizes must be a GroupedMatmulBlocks or None, got {type(blocks).__name__}")
    for name, a, rank in (("x", x, 2), ("w", w, 3), ("group_sizes", group_sizes, 1)):
        _validate_array(name, a, rank)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype != w.dtype:
        raise ValueError(f"{fn}: x and w must have the same floating dtype, got {x.dtype} and {w.dtype}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{fn}: group_sizes must be integers (int32), got {group_sizes.dtype}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"{fn}: x [M, K] and w [G, K, N] disagree on K: x {tuple(x.shape)}, w {tuple(w.shape)}")
    if group_sizes.shape[0] != w.shape[0]:
        raise ValueError(f"{fn}: group_sizes has {group_sizes.shape[0]} groups, w has {w.shape[0]} (G)")
    if w.shape[0] == 0:
        raise ValueError(f"{fn}: w needs at least one group, got shape {tuple(w.shape)}")


def _padded_rows(x, extra):
    """x (an array [M, ...] or an Fp8Rows) with `extra` rows of zeros after its M (data_t: columns)."""

    def pad(a, axis=0):
        return jnp.pad(a, [(0, extra if d == axis else 0) for d in range(a.ndim)])

    if isinstance(x, Fp8Rows):
        return Fp8Rows(pad(x.data), pad(x.scales), pad(x.grad_sink), None if x.data_t is None else pad(x.data_t, 1))
    return pad(x)


def _validate_fp8_rows(rows, w8):
    fn = "grouped_matmul"
    if w8 is None:
        raise TypeError(f"{fn}: x given as Fp8Rows needs fp8_weights= (FP8 matmuls); pass bf16 x otherwise")
    _validate_array("x.grad_sink", rows.grad_sink, 2)
    shape = tuple(rows.grad_sink.shape)
    fields = (("data", shape, FP8_DTYPE), ("scales", shape[:1], jnp.float32))
    if rows.data_t is not None:
        fields += (("data_t", shape[::-1], FP8_DTYPE),)
    _validate_fields(rows, "x", fields, " (x.grad_sink's rows)", "")


def _validate_fields(obj, what, fields, context, hint):
    """Each field (name, shape, dtype) of obj as given; else a ValueError naming `what`.name."""
    for name, want_shape, want_dtype in fields:
        a = getattr(obj, name)
        if tuple(a.shape) != want_shape or a.dtype != want_dtype:
            raise ValueError(
                f"grouped_matmul: {what}.{name} must be {jnp.dtype(want_dtype)} {want_shape}{context}, "
                f"got {a.dtype} {tuple(a.shape)}{hint}"
            )


def _validate_fp8(w8, w, use_mgpu, aligned_groups, blocks):
    fn = "grouped_matmul"
    if not isinstance(w8, Fp8Weights):
        raise TypeError(f"{fn}: fp8_weights must be an Fp8Weights (from fp8_weights(w)), got {type(w8).__name__}")
    g, k, n = w.shape
    _validate_fields(
        w8,
        "fp8_weights",
        (
            ("forward", (g, n, k), FP8_DTYPE),
            ("forward_scales", (g, n), jnp.float32),
            ("input_grad", (g, k, n), FP8_DTYPE),
            ("input_grad_scales", (g, k), jnp.float32),
        ),
        f" for w {tuple(w.shape)}",
        ": make it with fp8_weights(w)",
    )
    if use_mgpu:
        if not aligned_groups:
            raise ValueError(
                f"{fn}: fp8_weights on the Mosaic GPU path needs aligned_groups=True (group sizes "
                f"multiples of {aligned_rows(blocks)}, as the expert-major layout's with that "
                f"alignment); or pass backend='xla'"
            )
        tiles = blocks.aligned
        multiple = None if tiles is None else _fp8_multiple(tiles, w8.weight_grad)
        if tiles is None or k % multiple or n % multiple:
            need = "block_sizes.aligned" if tiles is None else f"K and N multiples of {multiple}"
            raise ValueError(f"{fn}: fp8_weights on the Mosaic GPU path needs {need}; got K={k}, N={n}")


def _fp8_multiple(tiles: AlignedTiles, weight_grad: bool) -> int:
    """K and N must be multiples of this on the FP8 kernels (both serve as the forward's K and the input
    gradient's; with weight_grad, as rows and columns of the weight gradient's tiles)."""
    f, dw = tiles.fp8, tiles.fp8_weight_grad
    dw_sides = (hopper_gemm.row_tile(dw), hopper_gemm.cta_cols(dw)) if weight_grad else ()
    return math.lcm(f.tile_k, hopper_gemm.cta_cols(f), *dw_sides)


def _use_mgpu(backend, x, w, blocks) -> bool:
    if backend == "xla":
        return False
    reason = mgpu_unsupported_reason(x.shape, w.shape, x.dtype, blocks)
    if backend == "cuda":
        if not reason and not is_hopper_gpu():
            device = jax.devices()[0]
            reason = (
                f"its kernels need a Hopper GPU (compute capability 9.x), and jax's first device is "
                f"{getattr(device, 'device_kind', device.platform)}"
            )
        if reason:
            raise ValueError(f"grouped_matmul: backend='cuda' cannot run: {reason}")
    elif reason or not is_hopper_gpu():
        return False
    _check_row_tiles_lower(blocks)
    return True


def _check_row_tiles_lower(blocks):
    """A clear error for row tiles this jax's Mosaic GPU cannot lower (its own error comes at lowering
    and names no block size)."""
    for name in ("forward", "input_grad"):
        block_n = getattr(blocks, name).block_n
        if block_n > ROW_TILED_MAX_BLOCK_N:
            raise ValueError(
                f"grouped_matmul: block_sizes.{name}.block_n={block_n} is wider than the "
                f"{ROW_TILED_MAX_BLOCK_N} columns jax {jax.__version__} lowers for "
                f"ragged_dot_mgpu; use at most {ROW_TILED_MAX_BLOCK_N} (DEFAULT_BLOCKS does)"
            )


def _clamp_group_sizes(group_sizes, num_rows):
    """Sizes >= 0 whose groups end by row num_rows."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), num_rows)
    return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


def _valid_rows(num_rows, group_sizes, valid_sizes):
    """bool [num_rows]: the row is one of the first valid_sizes[g] rows of its group g."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    ends = jnp.cumsum(group_sizes)
    group = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), group_sizes.shape[0] - 1)
    return (rows < ends[-1]) & (rows - (ends - group_sizes)[group] < valid_sizes[group])


# The custom_vjp and its kernels -----------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _grouped_matmul(use_mgpu, blocks, assume_aligned, x, w, group_sizes, valid_sizes, scale):
    """y = scale * x @ w[g] per group, 0 (times scale) on padding rows (past
    valid_sizes[g] in group g, or past the groups); the gradients likewise,
    whatever dy holds on padding rows. scale: float32 [1], 1, or NaN where the
    caller's promise of aligned sizes (assume_aligned) is broken. x, w, the
    sizes and scale vary over the same shard_map axes."""
    return _forward(use_mgpu, blocks, assume_aligned, x, w, group_sizes, valid_sizes, scale)


def _grouped_matmul_fwd(use_mgpu, blocks, assume_aligned, x, w, group_sizes, valid_sizes, scale):
    y = _forward(use_mgpu, blocks, assume_aligned, x, w, group_sizes, valid_sizes, scale)
    return y, (x, w, group_sizes, valid_sizes, scale)


def _grouped_matmul_bwd(use_mgpu, blocks, assume_aligned, residuals, dy):
    x, w, group_sizes, valid_sizes, scale = residuals
    # Every weight gradient contracts dy's rows (the aligned kernel up to a row step past a group's valid
    # rows); dx reads only valid rows. A select, which XLA fuses into dy's producer where that is a fusion
    # (as in the MoE layer).
    dy = _padding_zeroed(dy, group_sizes, valid_sizes)
    dx = _input_grad(use_mgpu, blocks, assume_aligned, dy, w, group_sizes, valid_sizes, scale)
    dw = _weight_grad(use_mgpu, blocks, assume_aligned, x, dy, group_sizes, valid_sizes, scale)
    # The Mosaic GPU kernels of jax 0.10 type their outputs unvarying, and dy
    # may come in unvarying: type each cotangent as its primal.
    return vary_over(dx, vma(x)), vary_over(dw, vma(w)), None, None, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def _aligned_or_row_tiled(blocks, assume_aligned, k, n, group_sizes, aligned, row_tiled):
    """aligned() where every group size is a multiple of aligned_rows (promised
    by the caller, or decided on the device), else row_tiled(); row_tiled()
    alone where K and N do not fit. Typed varying as the sizes (shard_map):
    the Mosaic GPU kernels of jax 0.10 type their outputs unvarying."""
    axes = vma(group_sizes)
    if not _aligned_fits(k, n, blocks):
        return vary_over(row_tiled(), axes)
    if assume_aligned:
        return vary_over(aligned(), axes)
    return lax.cond(
        _sizes_aligned(group_sizes, blocks), lambda: vary_over(aligned(), axes), lambda: vary_over(row_tiled(), axes)
    )


def _padding_zeroed(a, group_sizes, valid_sizes, scale=None):
    """a [M, *] with its padding rows set to 0, times scale (the kernels of
    deep_ep_jax.experts.hopper_gemm do this themselves: only the others need it)."""
    a = jnp.where(_valid_rows(a.shape[0], group_sizes, valid_sizes)[:, None], a, jnp.zeros((), a.dtype))
    return a if scale is None else a * scale.astype(a.dtype)


def _row_tiles(group_sizes, valid_sizes, num_rows, tile_m):
    """(group, data rows) of each row tile, int32 [num_rows // tile_m] each:
    the tile's group (-1 past the last group), and how many of the tile's
    first rows are among its group's first valid_sizes rows (0 past the groups)."""
    ends = jnp.cumsum(group_sizes)
    starts = jnp.arange(num_rows // tile_m, dtype=jnp.int32) * tile_m
    groups = jnp.searchsorted(ends, starts, side="right").astype(jnp.int32)
    past = starts >= ends[-1]
    g = jnp.minimum(groups, group_sizes.shape[0] - 1)
    rows = jnp.clip(ends[g] - group_sizes[g] + valid_sizes[g] - starts, 0, tile_m)
    return jnp.where(past, -1, groups), jnp.where(past, 0, rows).astype(jnp.int32)


def _rows_matmul(x, w, group_sizes, valid_sizes, scale, tiles, transpose_rhs=False, **kernel_args):
    """hopper_gemm.rows_matmul on aligned groups (kernel_args: its out_dtype and FP8 scales)."""
    groups, rows = _row_tiles(group_sizes, valid_sizes, x.shape[0], hopper_gemm.row_tile(tiles))
    return hopper_gemm.rows_matmul(x, w, groups, rows, scale, tiles, transpose_rhs=transpose_rhs, **kernel_args)


def _forward(use_mgpu, blocks, assume_aligned, x, w, group_sizes, valid_sizes, scale):
    if use_mgpu:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        return _aligned_or_row_tiled(
            blocks,
            assume_aligned,
            x.shape[1],
            w.shape[2],
            group_sizes,
            lambda: _rows_matmul(x, w, group_sizes, valid_sizes, scale, blocks.aligned.forward),
            lambda: _padding_zeroed(
                ragged_dot_mgpu.ragged_dot(x, w, group_sizes=group_sizes, **dataclasses.asdict(blocks.forward)),
                group_sizes,
                valid_sizes,
                scale,
            ),
        )
    y = lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    return _padding_zeroed(y, group_sizes, valid_sizes, scale)


def _input_grad(use_mgpu, blocks, assume_aligned, dy, w, group_sizes, valid_sizes, scale):
    """dx [M, K] = scale * dy [M, N] @ w[g]^T, without materializing w^T; 0 on padding rows."""
    if use_mgpu:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        # transpose_rhs: w [G, K, N] read as [G, out=K, contracted=N].
        return _aligned_or_row_tiled(
            blocks,
            assume_aligned,
            w.shape[1],
            w.shape[2],
            group_sizes,
            lambda: _rows_matmul(dy, w, group_sizes, valid_sizes, scale, blocks.aligned.input_grad, transpose_rhs=True),
            lambda: _padding_zeroed(
                ragged_dot_mgpu.ragged_dot(
                    dy, w, group_sizes=group_sizes, transpose_rhs=True, **dataclasses.asdict(blocks.input_grad)
                ),
                group_sizes,
                valid_sizes,
                scale,
            ),
        )
    dx = _ragged_dot_rhs_transposed(dy, w, group_sizes).astype(dy.dtype)
    return _padding_zeroed(dx, group_sizes, valid_sizes, scale)


def _ragged_dot_rhs_transposed(a, w, group_sizes):
    """float32 a [M, C] @ w[g]^T per group of rows, w [G, C', C] (jax.lax.ragged_dot_general)."""
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
    )
    return lax.ragged_dot_general(a, w, group_sizes, dims, preferred_element_type=jnp.float32)


def _weight_grad(use_mgpu, blocks, assume_aligned, x, dy, group_sizes, valid_sizes, scale):
    """dw [G, K, N]: dw[g] = scale * x_g^T dy_g, dy zero on the padding rows
    (the backward zeroes them; x's padding rows must be finite)."""
    if use_mgpu:
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

        def row_tiled():
            # The kernel's own tests run it under standard promotion (its grid sizes mix Python ints).
            with jax.numpy_dtype_promotion("standard"):
                dw = transposed_ragged_dot_mgpu.transposed_ragged_dot(
                    x, dy, group_sizes=group_sizes, **dataclasses.asdict(blocks.weight_grad)
                )
            return dw * scale.astype(dw.dtype)

        def aligned():
            tiles = blocks.aligned.weight_grad
            return hopper_gemm.weight_grad(
                x, dy, *group_row_steps(group_sizes, valid_sizes, tiles.tile_k), scale, tiles
            )

        return _aligned_or_row_tiled(blocks, assume_aligned, x.shape[1], dy.shape[1], group_sizes, aligned, row_tiled)
    return _ragged_weight_grad(x, dy, group_sizes, scale).astype(x.dtype)


def group_row_steps(group_sizes, valid_sizes, tile_k):
    """(first row, row steps) of each group, int32 [G] each, for hopper_gemm.weight_grad on aligned groups:
    a group stops at the row step that covers its valid rows (<= group_sizes // tile_k, the sizes being
    multiples of it)."""
    return jnp.cumsum(group_sizes) - group_sizes, -(-valid_sizes // tile_k)


def _ragged_weight_grad(x, dy, group_sizes, scale):
    """float32 scale * x_g^T dy_g per group of rows (jax.lax.ragged_dot_general)."""
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
    )
    return lax.ragged_dot_general(x, dy, group_sizes, dims, preferred_element_type=jnp.float32) * scale


# FP8 ---------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _grouped_matmul_fp8(use_mgpu, blocks, given_rows, x, w, w8, group_sizes, valid_sizes, scale):
    """_grouped_matmul from FP8 operands: x and dy quantized here (x given
    quantized where given_rows: an Fp8Rows), w as w8 (dw in w's dtype, or
    with w8.weight_grad from FP8 operands). w is not read: it types dw."""
    return fp8_forward(use_mgpu, blocks, given_rows, x, w, w8, group_sizes, valid_sizes, scale)[0]


def fp8_forward(use_mgpu, blocks, given_rows, x, w, w8, group_sizes, valid_sizes, scale):
    x_data, x_scales = (x.data, x.scales) if given_rows else quantize_rows(x)
    y = _fp8_matmul(
        use_mgpu, blocks, x_data, x_scales, w8.forward, w8.forward_scales, group_sizes, valid_sizes, scale, w.dtype
    )
    # dw from the FP8 rows, transposed (with w8.weight_grad), or dequantized where x came quantized, else from x.
    if w8.weight_grad:
        x_data_t = x.data_t if given_rows and x.data_t is not None else x_data.T
        x_for_dw = (x_data_t, x_scales)
    else:
        x_for_dw = (x_data, x_scales) if given_rows else x
    return y, (x_for_dw, w, w8, group_sizes, valid_sizes, scale)


def _grouped_matmul_fp8_bwd(use_mgpu, blocks, given_rows, residuals, dy):
    x_for_dw, w, w8, group_sizes, valid_sizes, scale = residuals
    if w8.weight_grad:  # dy's padding rows are left out by their 0 multipliers (dx's kernel stores 0 there)
        dy_data, dy_scales, z_data_t, z_scales = fp8_backward_operands(fp8_dw_row_scales(residuals), dy)
        dw = fp8_weight_grad_of(use_mgpu, blocks, residuals, z_data_t, z_scales)
    else:  # sizes are aligned on the Mosaic GPU path (_validate_fp8)
        if given_rows:  # the rows the forward read, in w's dtype
            x_data, x_scales = x_for_dw
            x_for_dw = (x_data.astype(jnp.float32) * x_scales[:, None]).astype(w.dtype)
        dy = _padding_zeroed(dy, group_sizes, valid_sizes)
        dy_data, dy_scales = quantize_rows(dy)
        dw = _weight_grad(use_mgpu, blocks, True, x_for_dw, dy, group_sizes, valid_sizes, scale)
    return fp8_cotangents(use_mgpu, blocks, given_rows, residuals, dy_data, dy_scales, dw)


def fp8_dw_row_scales(residuals):
    """x's row scales of the forward (with fp8_weights(w, weight_grad=True)), 0 on padding rows: the
    multipliers that move onto dy for the FP8 weight gradient (fp8_backward_operands)."""
    (_, x_scales), _, _, group_sizes, valid_sizes, _ = residuals
    return jnp.where(_valid_rows(x_scales.shape[0], group_sizes, valid_sizes), x_scales, 0.0)


def fp8_weight_grad_of(use_mgpu, blocks, residuals, z_data_t, z_scales):
    """dw from the forward's FP8 rows and z (dy times x's row scales) quantized per column, transposed."""
    (x_data_t, _), w, _, group_sizes, valid_sizes, scale = residuals
    return _fp8_weight_grad(use_mgpu, blocks, x_data_t, z_data_t, z_scales, group_sizes, valid_sizes, scale, w.dtype)


def fp8_cotangents(use_mgpu, blocks, given_rows, residuals, dy_data, dy_scales, dw):
    """_grouped_matmul_fp8's cotangents: dx from dy's FP8 rows (dy_data [M, N], dy_scales [M]), and dw."""
    _, w, w8, group_sizes, valid_sizes, scale = residuals
    dx = _fp8_matmul(
        use_mgpu,
        blocks,
        dy_data,
        dy_scales,
        w8.input_grad,
        w8.input_grad_scales,
        group_sizes,
        valid_sizes,
        scale,
        w.dtype,
    )
    no_grad = jax.tree.map(jnp.zeros_like, w8)
    # x, w, the sizes and scale vary together (grouped_matmul): the sizes type dx as x.
    dx = vary_over(dx, vma(group_sizes))
    if given_rows:  # the FP8 arrays carry no gradient (None: zeros); grad_sink's cotangent is dx
        dx = Fp8Rows(None, None, dx, None)
    return dx, vary_over(dw, vma(w)), no_grad, None, None, None


_grouped_matmul_fp8.defvjp(fp8_forward, _grouped_matmul_fp8_bwd)


def _fp8_matmul(use_mgpu, blocks, a_data, a_scales, w_data, w_scales, group_sizes, valid_sizes, scale, out_dtype):
    """out [M, C'] = scale * (a_data * a_scales) @ (w_data * w_scales)[g]^T, 0 on padding rows:
    a_data float8 [M, C] with one scale per row (a_scales [M]), w_data float8 [G, C', C], w_scales [G, C']."""
    if use_mgpu:
        out = _rows_matmul(
            a_data,
            w_data,
            group_sizes,
            valid_sizes,
            scale,
            blocks.aligned.fp8,
            transpose_rhs=True,
            out_dtype=out_dtype,
            row_scales=a_scales,
            col_scales=w_scales,
        )
        return vary_over(out, vma(group_sizes))
    a, w = _dequantized(a_data, a_scales[:, None], w_data, w_scales[..., None])
    out = _ragged_dot_rhs_transposed(a, w, group_sizes)
    return _padding_zeroed(out, group_sizes, valid_sizes, scale).astype(out_dtype)


def _fp8_weight_grad(use_mgpu, blocks, x_data_t, z_data_t, z_scales, group_sizes, valid_sizes, scale, out_dtype):
    """dw [G, K, N]: dw[g] = scale * x_g^T dy_g from x = x_data * x_scales (per row; x_data_t is x_data
    transposed, [K, M]), as (x_data_g^T z_data_g) * z's column scales (fp8_backward_operands). Padding rows
    of z are 0 (x_data there may be anything finite)."""
    if use_mgpu:
        tiles = blocks.aligned.fp8_weight_grad
        # FP8 WGMMA reads both operands contraction-major: x^T [K, M], z^T [N, M].
        dw = hopper_gemm.weight_grad(
            x_data_t,
            z_data_t,
            *group_row_steps(group_sizes, valid_sizes, tiles.tile_k),
            scale,
            tiles,
            transposed=True,
            col_scales=z_scales,
            out_dtype=out_dtype,
        )
        return vary_over(dw, vma(group_sizes))
    x, z = _dequantized(x_data_t.T, 1.0, z_data_t.T, z_scales)
    return _ragged_weight_grad(x, z, group_sizes, scale).astype(out_dtype)


def fp8_backward_operands(x_scales, dy):
    """(dy's FP8 rows [M, N], their scales [M], z's FP8 values transposed [N, M], z's column scales [N])
    from one read of dy per pass: dy quantized per row for dx, and z = dy * x_scales (the forward's row
    scales of x, which vary along dw's contraction, so they move onto dy) quantized per column for dw.
    z is 0 on the rows whose x_scales are 0 (padding rows: dy may hold anything there)."""
    dy_data, dy_scales, z_data_t, z_scales = quantize_rows_and_columns(dy[None], x_scales[None])
    return dy_data[0], dy_scales[0], z_data_t[0], z_scales[0]


def _dequantized(a_data, a_scales, b_data, b_scales):
    """float32 a_data * a_scales and b_data * b_scales (the scales broadcast as given).
    The barrier keeps XLA from dropping a float -> float8 -> float pair of converts (excess precision)."""
    a_data, b_data = lax.optimization_barrier((a_data, b_data))
    return a_data.astype(jnp.float32) * a_scales, b_data.astype(jnp.float32) * b_scales
