"""Warp-specialized grouped matmul kernels for Hopper GPUs (Mosaic GPU, Pallas),
for groups of rows that start and end on a tile boundary.

The expert-major layout (`expand(..., alignment=A)`) pads each expert's group
of rows to a multiple of A. When A is a multiple of the kernels' row tile,
every row tile belongs to one group, so a tile is a plain matmul against its
group's weights: no tile is computed twice at a group boundary. These
kernels use that:

    rows_matmul(x, w, tile_group, tile_rows, scale, tiles)       # y = x @ w[g]  (and dx = dy @ w[g]^T)
    weight_grad(x, dy, group_starts, group_steps, scale, tiles)  # dw[g] = x_g^T dy_g

A group's padding rows are left out: rows_matmul stores zeros on a tile's
rows past its data rows (tile_rows) and on the tiles past the last group, so
its output needs no mask; weight_grad takes each group's row steps (up to the
step that covers its data). `scale` (float32 [1]) multiplies every output:
1, or NaN where the caller's promise of aligned groups is broken.

Each CTA runs a memory warpgroup (TMA loads into a ring of shared-memory
stages) and two compute warpgroups (WGMMA into float32 accumulators) that
split the CTA's tile along N, so the warpgroups share the row tile's loads
(or, with split_rows, along the rows, sharing the weights' loads).
The CTAs are persistent (one per SM, or one per cluster of two whose CTAs
share the row tile by TMA multicast) and walk the tiles in an order that
keeps a group's weights and a row tile's rows in L2 while they are reused.
That reuse relies on the CTAs that share a weight tile stepping through K
together: a tile made shorter than the rest (one that leaves out its padding
rows' products) breaks the step, and the extra HBM reads cost more than the
products saved (docs/history.md). With group_bands, rows_matmul's
bands of row tiles end where a group does, so no group's weights are read by
two bands (planar_snake's bands of fixed width cut through groups). Tiles
past the last group are not computed, only stored as zeros.

rows_matmul also takes float8_e4m3fn x and w (w as [G, N, K]: FP8 WGMMA
reads both operands K-major) with a float32 scale per row of x and per
output column of w[g], applied in the epilogue; with `promote`, each K
step's products are added to a float32 total in registers. weight_grad
takes them transposed (x^T [K, M] and dy^T [N, M], the contraction over
rows contiguous) with a float32 scale per column of dw, and `promote` and
`split_rows` likewise, or `promote_after_steps` (only a group longer than
that many row steps promoted, in halves of the warpgroups' tiles).

Preconditions, checked by the caller (deep_ep_jax.experts.grouped_gemm): bf16 or
f16 (or float8_e4m3fn, transposed in weight_grad); rows, K and N multiples
of the tiles; every group size a multiple of `row_tile(tiles)`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

MEMORY_REGISTERS = 40  # per thread of the memory warpgroup (TMA issue only); the compute ones get the rest


@dataclasses.dataclass(frozen=True)
class HopperTiles:
    """Tiles of one warp-specialized kernel. Each compute warpgroup owns a
    tile_m x tile_n accumulator; the CTA's tile is tile_m x 2 tile_n (the
    warpgroups split it by columns), or 2 tile_m x tile_n with split_rows."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    grid_minor_n: bool = True  # walk N fastest (a row tile's rows stay in L2)
    grid_tile_width: int = 1  # tiles along the minor dimension per band (planar_snake)
    # rows_matmul, walking M fastest tile by tile: each band of row tiles ends where a group does (about
    # grid_tile_width of them), so no group's weight tiles are read by two bands.
    group_bands: bool = False
    cluster_n: bool = False  # two CTAs share the row tile by multicast (adjacent N tiles)
    # A CTA's tiles form one pipeline: the loads of its next tile start while it finishes and stores
    # this one. rows_matmul: a pipeline of pipelines over the row tiles that hold groups, when the K
    # steps are a multiple of max_concurrent_steps (else it is off). weight_grad (without cluster_n):
    # one ring of stages over every row step of the CTA's tiles.
    steady_pipeline: bool = False
    epi_tile_m: int = 64
    epi_tile_n: int = 64
    split_rows: bool = False  # rows_matmul: the compute warpgroups split the CTA's tile by rows
    # rows_matmul: each K step's products go to a fresh WGMMA accumulator, then are added to a
    # float32 total in registers (twice the accumulator registers). FP8 needs it: its WGMMA keeps
    # only about 14 bits while it accumulates, so without it the error grows with K.
    promote: bool = False
    # weight_grad, transposed, without promote or split_rows: a group of more than this many row steps is
    # promoted (each warpgroup's tile taken as two halves of tile_m / 2 rows, each a pass over the group's
    # rows whose steps are added to a float32 total: the registers of one tile_m accumulator); the shorter
    # groups, the common case, keep the one accumulator. 0: no group is promoted.
    promote_after_steps: int = 0


def row_tile(tiles: HopperTiles) -> int:
    """Rows per tile: group sizes must be multiples of this."""
    return tiles.tile_m * (2 if tiles.split_rows else 1)


def cta_cols(tiles: HopperTiles) -> int:
    """Output columns per CTA, or per pair of CTAs with cluster_n (N must be a multiple of this)."""
    return tiles.tile_n * (1 if tiles.split_rows else 2) * (2 if tiles.cluster_n else 1)


def _num_sms():
    return jax.devices()[0].core_count


def _transforms(plgpu, cols, dtype):
    swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)


def _epilogue_slots(t: HopperTiles) -> int:
    """Shared-memory slots per warpgroup for the stores (two, so one fills while the other drains)."""
    return min(2, (t.tile_m * t.tile_n) // (t.epi_tile_m * t.epi_tile_n))


def _out_smem(plgpu, t: HopperTiles, dtype):
    return plgpu.SMEM(
        (2, _epilogue_slots(t), t.epi_tile_m, t.epi_tile_n), dtype, transforms=_transforms(plgpu, t.epi_tile_n, dtype)
    )


def _store(plgpu, t: HopperTiles, out_smem, wg, dst, acc):
    """Store this warpgroup's tile_m x tile_n products `acc` (float32; or fewer rows, as a half tile's)
    into dst, as dst's dtype, through the epilogue's shared-memory slots (the copies stay in flight)."""
    num_slots = _epilogue_slots(t)
    epi_m = min(t.epi_tile_m, acc.shape[0])
    acc = acc.astype(dst.dtype)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    i = 0
    for em in range(acc.shape[0] // epi_m):
        for en in range(t.tile_n // t.epi_tile_n):
            rows = slice(em * epi_m, (em + 1) * epi_m)
            cols = slice(en * t.epi_tile_n, (en + 1) * t.epi_tile_n)
            slot = out_smem.at[wg, i % num_slots]
            slot = slot if epi_m == t.epi_tile_m else slot.at[0:epi_m]
            i += 1
            plgpu.wait_smem_to_gmem(num_slots - 1, wait_read_only=True)
            slot[...] = acc[rows, cols]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(slot, dst.at[rows, cols])


def _accumulate_then_store(plgpu, pl, t: HopperTiles, out_smem, wg, dst, finish, start=lambda: None):
    """The compute warpgroups' context of a pipeline: call start(), accumulate this
    warpgroup's tile_m x tile_n products in float32, then store finish(them) into dst.
    The pipeline's carry is the WGMMA accumulator, or with t.promote the float32
    total (see _promoted)."""

    def compute_context(eval_pipeline):
        start()
        if t.promote:
            _store(plgpu, t, out_smem, wg, dst, finish(eval_pipeline(jnp.zeros((t.tile_m, t.tile_n), jnp.float32))))
            return

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((t.tile_m, t.tile_n), jnp.float32))
        def _acc(acc_ref):
            eval_pipeline(acc_ref)
            _store(plgpu, t, out_smem, wg, dst, finish(acc_ref[...]))

    return compute_context


def _promoted(plgpu, pl, total, a, b):
    """total + a @ b, the product accumulated by WGMMA on its own (t.promote)."""

    def product(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    return total + pl.run_scoped(product, plgpu.ACC(total.shape, jnp.float32))


def _first_rows(acc, num_rows):
    """acc with its rows from num_rows on set to 0."""
    return jnp.where(lax.broadcasted_iota(jnp.int32, acc.shape, 0) < num_rows, acc, 0.0)


def _kernel(body, out_shape, dtype, t: HopperTiles):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    cluster = 2 if t.cluster_n else 1
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(out_shape, dtype),
        grid=(_num_sms() // cluster,),
        grid_names=("cluster_grid",),
        cluster=(cluster,),
        cluster_names=("cluster",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


def rows_matmul(
    x,
    w,
    tile_group,
    tile_rows,
    scale,
    t: HopperTiles,
    *,
    transpose_rhs: bool = False,
    out_dtype=None,
    row_scales=None,
    col_scales=None,
):
    """out[r] = scale * x[r] @ w[g] for the first tile_rows[i] rows r of row
    tile i, g = tile_group[i]; scale * 0 on the tile's other rows and on the
    tiles with g < 0 (not computed).

    x [M, K]; w [G, K, N], or [G, N, K] with transpose_rhs (out = x @ w[g]^T,
    the input gradient); tile_group, tile_rows int32 [M // row_tile(t)]; scale
    float32 [1]. out has out_dtype (default x's). With row_scales (float32
    [M]) and col_scales (float32 [G, N]), out[r, c] is also multiplied by
    row_scales[r] * col_scales[g, c]: the scales of FP8 operands (float8
    takes transpose_rhs, as its WGMMA reads both operands K-major)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = x.shape
    n = w.shape[1] if transpose_rhs else w.shape[2]
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    if t.group_bands and (t.grid_minor_n or t.cluster_n or t.steady_pipeline):
        raise ValueError("rows_matmul: group_bands walks M fastest, without cluster_n or steady_pipeline")
    cluster = 2 if t.cluster_n else 1
    cta_m, cta_n = row_tile(t), cta_cols(t) // cluster
    m_iters, n_iters, k_iters = m // cta_m, n // (cta_n * cluster), k // t.tile_k
    transforms = _transforms(plgpu, t.tile_k, x.dtype)
    b_block = (cta_n, t.tile_k) if transpose_rhs else (t.tile_k, cta_n)

    # A pipeline of pipelines needs whole rounds of stages per tile.
    steady = t.steady_pipeline and k_iters % t.max_concurrent_steps == 0

    def pipeline(body, compute_context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec(
                    (cta_m, t.tile_k),
                    lambda kk: (0, kk),
                    transforms=transforms,
                    memory_space=plgpu.SMEM,
                    collective_axes=("cluster",) if t.cluster_n else (),
                ),
                plgpu.BlockSpec(
                    b_block,
                    (lambda kk: (0, kk)) if transpose_rhs else (lambda kk: (kk, 0)),
                    transforms=transforms,
                    memory_space=plgpu.SMEM,
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=t.max_concurrent_steps,
            compute_context=compute_context,
            pipeline_state=state,
        )

    scaled = row_scales is not None
    if scaled != (col_scales is not None):
        raise ValueError("rows_matmul: give both row_scales and col_scales, or neither")

    def body(tile_group_gmem, tile_rows_gmem, scale_gmem, *refs):
        # With scales: row and column scales; then the walk's table: with steady, the count of row tiles
        # that hold groups, with group_bands, the tile order; then x, w, out.
        *extra, x_gmem, w_gmem, out_gmem = refs
        row_scales_gmem, col_scales_gmem = extra[:2] if scaled else (None, None)
        walk_gmem = extra[2:] if scaled else extra
        ignore = lambda *_, **__: None

        # Each compute warpgroup's row and column scales, loaded while its tile accumulates.
        scale_allocs = (
            dict(
                row_smem=plgpu.SMEM((2, t.tile_m), jnp.float32),
                col_smem=plgpu.SMEM((2, t.tile_n), jnp.float32),
                scales_loaded=plgpu.Barrier(num_arrivals=2, num_barriers=2),
            )
            if scaled
            else {}
        )

        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem.at[0]),
            out_smem=_out_smem(plgpu, t, out_dtype),
            collective_axes="wg",
            **scale_allocs,
        )
        def _scope(allocs, out_smem, row_smem=None, col_smem=None, scales_loaded=None):
            wg = lax.axis_index("wg")
            # This warpgroup's rows of the CTA's tile (split_rows), or its columns (otherwise).
            wg_rows, wg_cols = pl.ds(wg * t.tile_m, t.tile_m), pl.ds(wg * t.tile_n, t.tile_n)
            wg_first_row = wg * t.tile_m if t.split_rows else 0

            def wg_part(ref):
                """This warpgroup's part of a CTA tile's ref: its rows, or its columns."""
                return ref.at[wg_rows] if t.split_rows else ref.at[:, wg_cols]

            def rows_and_cols(mi, ni):
                """The rows and this CTA's columns of output tile (mi, ni)."""
                if t.cluster_n:
                    ni = ni * 2 + lax.axis_index("cluster")
                return pl.ds(mi * cta_m, cta_m), pl.ds(ni * cta_n, cta_n)

            def tile(mi, ni, state):
                """Row tile mi (of group tile_group[mi] >= 0), CTA columns ni."""
                rows, cols = rows_and_cols(mi, ni)

                def load_scales():
                    if scaled:
                        row_s = row_scales_gmem.at[rows]
                        col_s = col_scales_gmem.at[tile_group_gmem[mi]].at[cols]
                        if t.split_rows:
                            row_s = row_s.at[wg_rows]
                        else:
                            col_s = col_s.at[wg_cols]
                        plgpu.copy_gmem_to_smem(row_s, row_smem.at[wg], scales_loaded.at[wg])
                        plgpu.copy_gmem_to_smem(col_s, col_smem.at[wg], scales_loaded.at[wg])

                def finish(acc):
                    if scaled:  # before the rows are cut: a padding row's scale may be NaN
                        plgpu.barrier_wait(scales_loaded.at[wg])
                        acc = (
                            acc
                            * lax.broadcast_in_dim(row_smem[wg], acc.shape, (0,))
                            * lax.broadcast_in_dim(col_smem[wg], acc.shape, (1,))
                        )
                    return _first_rows(acc, tile_rows_gmem[mi] - wg_first_row) * scale_gmem[0]

                compute_context = _accumulate_then_store(
                    plgpu, pl, t, out_smem, wg, wg_part(out_gmem.at[rows, cols]), finish, load_scales
                )

                def mma(_, a_smem, b_smem, carry):
                    if t.split_rows:  # this warpgroup's rows of x, all of the CTA's columns
                        a, b = wg_part(a_smem), b_smem
                    else:  # all rows, this warpgroup's columns (b_smem's rows with transpose_rhs)
                        a, b = a_smem, b_smem.at[wg_cols] if transpose_rhs else b_smem.at[:, wg_cols]
                    b = b.transpose((1, 0)) if transpose_rhs else b
                    if t.promote:
                        return _promoted(plgpu, pl, carry, a, b)
                    plgpu.wgmma(carry, a, b)
                    plgpu.wgmma_wait(0)
                    return carry

                weights = w_gmem.at[tile_group_gmem[mi]]
                pipeline(mma, compute_context, state)(
                    x_gmem.at[rows, :],
                    weights.at[cols, :] if transpose_rhs else weights.at[:, cols],
                    allocations=allocs,
                )

            def zero_tile(mi, ni):
                """Row tile mi, past the groups: zeros (times scale) from the compute warpgroups."""

                @pl.when(wg < 2)
                def _():
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((t.tile_m, t.tile_n), jnp.float32))
                    def _zeros(acc_ref):
                        rows, cols = rows_and_cols(mi, ni)
                        _store(plgpu, t, out_smem, wg, wg_part(out_gmem.at[rows, cols]), acc_ref[...] * scale_gmem[0])

            minor = 1 if t.grid_minor_n else 0
            if not steady:

                @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
                def _tiles(info):
                    if t.group_bands:
                        order = walk_gmem[0][info.index[0]]
                        mi, ni = order // n_iters, order % n_iters
                    else:
                        mi, ni = plgpu.planar_snake(info.index[0], (m_iters, n_iters), minor, t.grid_tile_width)

                    @pl.when(tile_group_gmem[mi] >= 0)
                    def _():
                        tile(mi, ni, None)

                    @pl.when(tile_group_gmem[mi] < 0)
                    def _():
                        zero_tile(mi, ni)
            else:
                # Only the row tiles that hold groups (a prefix), so that every step of a CTA runs a
                # pipeline: the first starts the chain, the last ends it, one alone does both.
                num_m = walk_gmem[0][0]

                @plgpu.nd_loop((num_m * n_iters,), collective_axes="cluster_grid")
                def _tiles(info):
                    mi, ni = plgpu.planar_snake(info.index[0], (num_m, n_iters), minor, t.grid_tile_width)
                    step, last = info.local_index, info.num_local_steps - 1

                    @pl.when(last == 0)
                    def _():
                        tile(mi, ni, None)

                    @pl.when(last > 0)
                    def _():
                        chain = plgpu.PipelinePipeline
                        state = jnp.where(
                            step == 0, int(chain.START), jnp.where(step == last, int(chain.STOP), int(chain.STEADY))
                        )
                        tile(mi, ni, state.astype(jnp.int32))

                @plgpu.nd_loop(((m_iters - num_m) * n_iters,), collective_axes="cluster_grid")
                def _tiles_past(info):
                    zero_tile(num_m + info.index[0] // n_iters, info.index[0] % n_iters)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    # The walk's table: the steady walk's count of row tiles that hold groups (they come first), or
    # group_bands' tile order.
    walk: tuple[jax.Array, ...]
    if steady:
        walk = (jnp.sum(tile_group >= 0, dtype=jnp.int32).reshape(1),)
    elif t.group_bands:
        walk = (_group_band_order(tile_group, n_iters, t.grid_tile_width),)
    else:
        walk = ()
    scales = (row_scales, col_scales) if scaled else ()
    return _kernel(body, (m, n), out_dtype, t)(tile_group, tile_rows, scale, *scales, *walk, x, w)


def _group_band_order(tile_group, n_iters, width):
    """int32 [len(tile_group) * n_iters]: the tiles (row tile * n_iters + column) in walking order, for
    group_bands. Each group's row tiles go to band first_tile // width (its first tile's); a band's tiles
    are walked row tile fastest, column by column."""
    num = tile_group.shape[0]
    index = jnp.arange(num, dtype=jnp.int32)
    starts = lambda v: jnp.concatenate([jnp.ones(1, bool), v[1:] != v[:-1]])  # where a run of equal values starts
    band = lax.cummax(jnp.where(starts(tile_group), index, 0)) // width
    band_start = lax.cummax(jnp.where(starts(band), index, 0))
    band_end = lax.cummin(jnp.where(jnp.append(starts(band)[1:], True), index + 1, num), reverse=True)
    cols = jnp.arange(n_iters, dtype=jnp.int32)
    position = (
        (band_start * n_iters)[:, None]
        + cols[None, :] * (band_end - band_start)[:, None]
        + (index - band_start)[:, None]
    )
    return jnp.zeros(num * n_iters, jnp.int32).at[position.reshape(-1)].set(jnp.arange(num * n_iters, dtype=jnp.int32))


def weight_grad(
    x,
    dy,
    group_starts,
    group_steps,
    scale,
    t: HopperTiles,
    *,
    transposed: bool = False,
    col_scales=None,
    out_dtype=None,
):
    """dw[g] = scale * x[rows of g]^T @ dy[rows of g]: x [M, K], dy [M, N] -> [G, K, N].

    Group g's rows are group_starts[g] + [0, group_steps[g] * tile_k); an
    empty group (0 steps) gets zeros. Here the kernel's rows are K's and its
    contraction runs over the group's rows. With t.steady_pipeline (and no
    cluster_n) a CTA's tiles form one pipeline (`_weight_grad_one_pipeline`).

    transposed: x and dy come as x^T [K, M] and dy^T [N, M], the rows (the
    contraction) contiguous, as FP8 WGMMA reads both operands (float8_e4m3fn
    needs it); then col_scales (float32 [N], optional) multiplies column n of
    every dw[g], t.promote adds each row step's products to a float32 total
    (t.promote_after_steps: only for a group of more steps than that, each
    warpgroup's tile then taken in two halves of tile_m / 2 rows, each a pass
    over the group's rows), and dw has out_dtype (default x's); t.split_rows
    has the compute warpgroups split the CTA's tile by K rows (2 tile_m x
    tile_n). Only as one pipeline."""
    if t.group_bands:
        raise ValueError(f"weight_grad: group_bands is rows_matmul's walk, got {t}")
    if transposed or col_scales is not None or t.promote or t.split_rows or t.promote_after_steps:
        if not (transposed and t.steady_pipeline and not t.cluster_n):
            raise ValueError(
                "weight_grad: col_scales, promote, split_rows and promote_after_steps need "
                "transposed=True, and transposed needs tiles with steady_pipeline and without "
                f"cluster_n, got {t}"
            )
    if t.promote_after_steps and (t.promote or t.split_rows or t.tile_m % 128):
        raise ValueError(
            "weight_grad: promote_after_steps needs tiles without promote and split_rows, and "
            f"tile_m a multiple of 128 (its halves are WGMMA's 64 rows or more), got {t}"
        )
    if t.steady_pipeline and not t.cluster_n:
        return _weight_grad_one_pipeline(
            x,
            dy,
            group_starts,
            group_steps,
            scale,
            t,
            transposed=transposed,
            col_scales=col_scales,
            out_dtype=out_dtype,
        )
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    num_rows, k = x.shape
    n = dy.shape[1]
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    g = group_starts.shape[0]
    cluster = 2 if t.cluster_n else 1
    cta_n = 2 * t.tile_n
    m_iters, n_iters = k // t.tile_m, n // (cta_n * cluster)
    a_transforms = _transforms(plgpu, t.tile_m, x.dtype)
    b_transforms = _transforms(plgpu, cta_n, x.dtype)

    def pipeline(body, compute_context, steps):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec(
                    (t.tile_k, t.tile_m),
                    lambda kk: (kk, 0),
                    transforms=a_transforms,
                    memory_space=plgpu.SMEM,
                    collective_axes=("cluster",) if t.cluster_n else (),
                ),
                plgpu.BlockSpec(
                    (t.tile_k, cta_n), lambda kk: (kk, 0), transforms=b_transforms, memory_space=plgpu.SMEM
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=t.max_concurrent_steps,
            compute_context=compute_context,
        )

    def body(starts_gmem, steps_gmem, scale_gmem, x_gmem, dy_gmem, out_gmem):
        ignore = lambda *_, **__: None

        @functools.partial(
            pl.run_scoped,
            # A static grid longer than the stages, so the ring gets all of them.
            allocs=pipeline(ignore, ignore, 1 << 16).get_allocations(x_gmem, dy_gmem),
            out_smem=_out_smem(plgpu, t, out_dtype),
            collective_axes="wg",
        )
        def _scope(allocs, out_smem):
            wg = lax.axis_index("wg")
            wg_cols = pl.ds(wg * t.tile_n, t.tile_n)

            @plgpu.nd_loop((g, m_iters * n_iters), collective_axes="cluster_grid")
            def _tiles(info):
                gi, lin = info.index
                mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 1 if t.grid_minor_n else 0, t.grid_tile_width)
                if t.cluster_n:
                    ni = ni * 2 + lax.axis_index("cluster")
                steps = steps_gmem[gi]
                # An empty group runs one step without its products, so that its tile is stored as zeros;
                # the step reads rows that exist (start clamped into the array).
                start = pl.multiple_of(jnp.minimum(starts_gmem[gi], num_rows - t.tile_k), t.tile_k)
                cols = pl.ds(ni * cta_n, cta_n)
                k_rows = pl.ds(mi * t.tile_m, t.tile_m)

                compute_context = _accumulate_then_store(
                    plgpu,
                    pl,
                    t,
                    out_smem,
                    wg,
                    out_gmem.at[gi].at[k_rows, cols].at[:, wg_cols],
                    lambda acc: acc * scale_gmem[0],
                )

                def mma(_, a_smem, b_smem, acc_ref):
                    @pl.when(steps > 0)
                    def _():
                        plgpu.wgmma(acc_ref, a_smem.transpose((1, 0)), b_smem.at[:, wg_cols])
                        plgpu.wgmma_wait(0)

                    return acc_ref

                group_rows = pl.ds(start, num_rows)  # steps * tile_k of them are read
                pipeline(mma, compute_context, jnp.maximum(steps, 1))(
                    x_gmem.at[group_rows, k_rows], dy_gmem.at[group_rows, cols], allocations=allocs
                )

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _kernel(body, (g, k, n), out_dtype, t)(group_starts, group_steps, scale, x, dy)


def _weight_grad_one_pipeline(
    x, dy, group_starts, group_steps, scale, t: HopperTiles, *, transposed=False, col_scales=None, out_dtype=None
):
    """weight_grad with a CTA's tiles as one pipeline: a tile has only a few
    row steps (a group's rows / tile_k), so instead of a pipeline per tile
    (whose loads wait for the previous tile's last product) the memory
    warpgroup walks every row step of every tile of its CTA through one ring
    of stages, and loads the next tile's first steps while the compute
    warpgroups finish and store this one. Both roles walk the same tiles in
    the same order and count steps the same way, so a stage's slot is its
    running step count mod max_concurrent_steps."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    k, n = (x.shape[0], dy.shape[0]) if transposed else (x.shape[1], dy.shape[1])
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    g = group_starts.shape[0]
    cta_m, cta_n = row_tile(t), cta_cols(t)
    m_iters, n_iters = k // cta_m, n // cta_n
    stages = t.max_concurrent_steps
    compute_registers = (512 - MEMORY_REGISTERS) // 2 // 8 * 8  # the rest, shared by the compute warpgroups
    # A stage's blocks of x and dy: [rows, K] and [rows, N] pieces, or with transposed [K, rows] and [N, rows].
    a_block, b_block = ((cta_m, t.tile_k), (cta_n, t.tile_k)) if transposed else ((t.tile_k, cta_m), (t.tile_k, cta_n))
    scaled = col_scales is not None

    def body(starts_gmem, steps_gmem, scale_gmem, *refs):
        *col_scales_gmem, x_gmem, dy_gmem, out_gmem = refs
        # Each compute warpgroup's column scales, loaded while its tile accumulates.
        scale_allocs = (
            dict(
                col_smem=plgpu.SMEM((2, t.tile_n), jnp.float32),
                scales_loaded=plgpu.Barrier(num_arrivals=1, num_barriers=2),
            )
            if scaled
            else {}
        )

        @functools.partial(
            pl.run_scoped,
            a_smem=plgpu.SMEM((stages, *a_block), x.dtype, transforms=_transforms(plgpu, a_block[1], x.dtype)),
            b_smem=plgpu.SMEM((stages, *b_block), x.dtype, transforms=_transforms(plgpu, b_block[1], x.dtype)),
            loaded=plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # both copies of a stage landed
            consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # both compute warpgroups are done with it
            out_smem=_out_smem(plgpu, t, out_dtype),
            collective_axes="wg",
            **scale_allocs,
        )
        def _scope(a_smem, b_smem, loaded, consumed, out_smem, col_smem=None, scales_loaded=None):
            wg = lax.axis_index("wg")

            def tile(info):
                """(group, K rows, CTA columns, row steps, first row) of this loop step's tile."""
                gi, lin = info.index
                mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 1 if t.grid_minor_n else 0, t.grid_tile_width)
                return gi, pl.ds(mi * cta_m, cta_m), pl.ds(ni * cta_n, cta_n), steps_gmem[gi], starts_gmem[gi]

            def promoted_halves(steps):
                """Whether a tile of `steps` row steps is taken in promoted halves (t.promote_after_steps)."""
                return (steps > t.promote_after_steps) if t.promote_after_steps else jnp.bool_(False)

            def walk(per_tile):
                """Run per_tile(info, carry=steps so far) -> steps after over this CTA's tiles."""
                plgpu.nd_loop((g, m_iters * n_iters), collective_axes="cluster_grid", init_carry=jnp.int32(0))(per_tile)

            @pl.when(wg == 2)
            def _memory():
                plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

                def per_tile(info, carry):
                    _, k_rows, cols, steps, start = tile(info)
                    passes = jnp.where(promoted_halves(steps), 2, 1)  # each pass loads the group's rows

                    def step(s, count):
                        slot = lax.rem(count, stages)

                        @pl.when(count >= stages)  # the ring's first round finds its stages free
                        def _():
                            plgpu.barrier_wait(consumed.at[slot])

                        row_step = lax.rem(s, jnp.maximum(steps, 1))
                        rows = pl.ds(pl.multiple_of(start + row_step * t.tile_k, t.tile_k), t.tile_k)
                        x_part, dy_part = (
                            (x_gmem.at[k_rows, rows], dy_gmem.at[cols, rows])
                            if transposed
                            else (x_gmem.at[rows, k_rows], dy_gmem.at[rows, cols])
                        )
                        plgpu.copy_gmem_to_smem(x_part, a_smem.at[slot], loaded.at[slot])
                        plgpu.copy_gmem_to_smem(dy_part, b_smem.at[slot], loaded.at[slot])
                        return count + 1

                    return lax.fori_loop(0, steps * passes, step, carry)

                walk(per_tile)

            @pl.when(wg < 2)
            def _compute():
                plgpu.set_max_registers(compute_registers, action="increase")
                # This warpgroup's K rows of the CTA's tile (split_rows), or its columns (otherwise).
                wg_rows, wg_cols = pl.ds(wg * t.tile_m, t.tile_m), pl.ds(wg * t.tile_n, t.tile_n)

                def wg_part(ref):
                    """This warpgroup's part of a CTA tile's [K rows, columns] ref."""
                    return ref.at[wg_rows] if t.split_rows else ref.at[:, wg_cols]

                def operands(slot, a_rows=None):
                    """This warpgroup's WGMMA operands in a stage: x's block [K rows, rows], dy's [rows, columns]
                    (a_rows: only those of x's K rows, transposed)."""
                    if transposed:
                        a, b = a_smem.at[slot], b_smem.at[slot]
                        a, b = (a.at[wg_rows], b) if t.split_rows else (a, b.at[wg_cols])
                        return (a if a_rows is None else a.at[a_rows]), b.transpose((1, 0))
                    return a_smem.at[slot].transpose((1, 0)), b_smem.at[slot].at[:, wg_cols]

                def per_tile(info, carry):
                    gi, k_rows, cols, steps, _ = tile(info)
                    if scaled:
                        wg_scales = col_scales_gmem[0].at[cols]
                        wg_scales = wg_scales if t.split_rows else wg_scales.at[wg_cols]
                        plgpu.copy_gmem_to_smem(wg_scales, col_smem.at[wg], scales_loaded.at[wg])
                    dst = wg_part(out_gmem.at[gi].at[k_rows, cols])

                    def wait_scales():  # once per tile: the barrier completes one phase per tile
                        if scaled:
                            plgpu.barrier_wait(scales_loaded.at[wg])

                    def store(acc, rows=None):  # rows: of the warpgroup's part (a half tile's)
                        # The column scales come times `scale`: one product per element in the epilogue.
                        acc = acc * (lax.broadcast_in_dim(col_smem[wg], acc.shape, (1,)) if scaled else scale_gmem[0])
                        _store(plgpu, t, out_smem, wg, dst if rows is None else dst.at[rows], acc)

                    def promoted_pass(count, a_rows=None):
                        """(count after, float32 total): each of the tile's row steps (with a_rows: of those
                        K rows) accumulated by WGMMA on its own, then added to the total."""

                        def promoted_step(s, count_total):
                            count, total = count_total
                            slot = lax.rem(count, stages)
                            plgpu.barrier_wait(loaded.at[slot])
                            total = _promoted(plgpu, pl, total, *operands(slot, a_rows))
                            plgpu.barrier_arrive(consumed.at[slot])
                            return count + 1, total

                        rows = t.tile_m if a_rows is None else a_rows.size
                        return lax.fori_loop(0, steps, promoted_step, (count, jnp.zeros((rows, t.tile_n), jnp.float32)))

                    if t.promote:  # each step's products on their own, added to a float32 total
                        count, total = promoted_pass(carry)
                        wait_scales()
                        store(total)
                        return count

                    def one_accumulator(count_before):
                        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((t.tile_m, t.tile_n), jnp.float32))
                        def count_after(acc_ref):  # zeros: an empty group's tile is stored as zeros
                            def step(s, count):
                                slot = lax.rem(count, stages)
                                plgpu.barrier_wait(loaded.at[slot])
                                plgpu.wgmma(acc_ref, *operands(slot))
                                plgpu.wgmma_wait(0)
                                plgpu.barrier_arrive(consumed.at[slot])
                                return count + 1

                            count = lax.fori_loop(0, steps, step, count_before)
                            wait_scales()
                            store(acc_ref[...])
                            return count

                        return count_after

                    if not t.promote_after_steps:
                        return one_accumulator(carry)

                    def halves(count):  # a long group: promoted, half of the warpgroup's K rows at a time
                        half = t.tile_m // 2
                        for h in range(2):
                            count, total = promoted_pass(count, pl.ds(h * half, half))
                            if h == 0:
                                wait_scales()
                            store(total, pl.ds(h * half, half))
                        return count

                    return lax.cond(promoted_halves(steps), halves, one_accumulator, carry)

                walk(per_tile)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scales = (col_scales * scale,) if scaled else ()  # exact for scale 1; NaN everywhere for NaN, as before
    return _kernel(body, (g, k, n), out_dtype, t)(group_starts, group_steps, scale, *scales, x, dy)
