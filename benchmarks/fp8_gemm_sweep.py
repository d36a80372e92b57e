"""FP8 configurations of the warp-specialized kernels (deep_ep_jax/experts/hopper_gemm.py), as
grouped_matmul(..., fp8_weights=) calls them, on one Hopper GPU: rows_matmul for y and
weight_grad(transposed=True) for dw, each timed at the MoE benchmark's shapes per rank and
checked against float32 dots of the dequantized operands.

    python benchmarks/fp8_gemm_sweep.py [--repeats 5] [--match REGEX] [--kernels forward,weight_grad]
                                        [--shapes 7168x4096,2048x7168] [--sustain 2] [--random-padding]

Shapes and groups as benchmarks/hopper_gemm_sweep.py (one rank's 128 experts of random top-8
routing, groups aligned to 128 rows holding their pairs; by default the SwiGLU's two matmuls, K x N =
7168 x 4096 and 2048 x 7168, each on its own line; their input gradients are 4096 x 7168 and 7168 x 2048
for rows_matmul). Operands: x quantized per row, w's forward
copy (grouped_gemm.fp8_weights). The error is the largest |y - y_ref| over four groups (the
largest, the first, the middle and the last) as a fraction of their largest |y_ref|, y_ref in
float32 (HIGHEST precision) on the dequantized operands, outside any jit; bf16 output rounding
alone gives about 3e-3. dw likewise, from x's FP8 values and z = dy * x's row scales
quantized per column (grouped_gemm._fp8_weight_grad), over all of each group's pair rows.

The time is from short chains with idle gaps between them, where the GPU keeps its highest clock. Inside
the MoE layer's step the GPU runs at its power limit and a lower clock (benchmarks/RESULTS.md), so
--sustain S also runs each configuration back to back for about S seconds and prints its time and
energy per call under that load (energy from NVML, where the driver has it).
"""

from __future__ import annotations

import argparse
import re
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_grouped_gemm import routed_group_sizes
from hopper_gemm_sweep import not_hopper, pair_rows
from timing import chain_seconds, sustained

from deep_ep_jax.experts import grouped_gemm as gg
from deep_ep_jax.experts import hopper_gemm as hg

T = hg.HopperTiles
CONFIGS = [
    # one accumulator per warpgroup, no promotion: faster, but its error grows with K (~14-bit accumulation)
    T(128, 128, 128, 4, grid_minor_n=False, grid_tile_width=4),
    T(64, 128, 128, 6, grid_minor_n=False, grid_tile_width=4, split_rows=True),
    # promoted every K step (128 or 256)
    T(64, 128, 128, 4, grid_minor_n=False, grid_tile_width=4, split_rows=True, promote=True),
    T(64, 128, 128, 6, grid_minor_n=False, grid_tile_width=4, split_rows=True, promote=True),
    T(64, 128, 128, 6, grid_minor_n=False, grid_tile_width=4, split_rows=True, promote=True, cluster_n=True),
    T(64, 128, 128, 6, grid_minor_n=False, grid_tile_width=4, split_rows=True, promote=True, steady_pipeline=True),
    T(64, 128, 256, 3, grid_minor_n=False, grid_tile_width=4, split_rows=True, promote=True),
    T(64, 128, 256, 3, grid_minor_n=False, grid_tile_width=8, split_rows=True, promote=True),
    T(64, 128, 256, 3, grid_minor_n=False, grid_tile_width=2, split_rows=True, promote=True),
    # bands of row tiles that end with a group, so that no group's weights are read by two bands
    *(
        T(64, 128, 256, 3, grid_minor_n=False, grid_tile_width=w, split_rows=True, promote=True, group_bands=True)
        for w in (4, 8, 2, 3, 5, 6)
    ),
    T(64, 128, 256, 3, grid_minor_n=True, grid_tile_width=4, split_rows=True, promote=True),
    T(64, 128, 256, 3, grid_minor_n=False, grid_tile_width=4, split_rows=True, promote=True, cluster_n=True),
]
WEIGHT_GRAD_CONFIGS = [
    # warpgroups split N (128 x 256 CTA tile), no promotion
    T(128, 128, 128, 3, grid_tile_width=4, steady_pipeline=True, epi_tile_m=128, epi_tile_n=128),
    # the same, groups of more than 4 row steps (512 rows) promoted in halves
    T(128, 128, 128, 3, grid_tile_width=4, steady_pipeline=True, epi_tile_m=128, epi_tile_n=128, promote_after_steps=4),
    # warpgroups split K rows (2 x 64 x 128), promoted every row step
    T(64, 128, 128, 4, grid_tile_width=4, steady_pipeline=True, split_rows=True, promote=True, epi_tile_n=128),
    T(64, 128, 128, 6, grid_tile_width=4, steady_pipeline=True, split_rows=True, promote=True, epi_tile_n=128),
    T(64, 128, 128, 4, grid_tile_width=8, steady_pipeline=True, split_rows=True, promote=True, epi_tile_n=128),
    T(
        64,
        128,
        128,
        4,
        grid_minor_n=False,
        grid_tile_width=4,
        steady_pipeline=True,
        split_rows=True,
        promote=True,
        epi_tile_n=128,
    ),
    T(64, 128, 128, 4, grid_tile_width=4, steady_pipeline=True, split_rows=True, epi_tile_n=128),
]


def operands(key, k, n, num_rows, sizes, counts, random_padding=False):
    """(x data, x row scales, w's forward copy, its scales): x's rows that hold no pair are zeros, as in the
    layer, or with random_padding random like the others (what multiplying a padding row costs)."""
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (num_rows, k), jnp.bfloat16)
    x = x if random_padding else jnp.where(pair_rows(num_rows, sizes, counts)[:, None], x, 0)
    w = jax.random.normal(kw, (len(sizes), k, n), jnp.bfloat16) * jnp.bfloat16(k**-0.5)
    x_data, x_scales = jax.jit(gg.quantize_rows)(x)
    w8 = jax.jit(gg.fp8_weights)(w)
    return x_data, x_scales, w8.forward, w8.forward_scales


def references(ops, sizes, counts, groups):
    """{group: (its pair rows, float32 y of the dequantized operands)}, computed eagerly."""
    x_data, x_scales, w_data, w_scales = ops
    starts = np.cumsum(sizes) - sizes
    out = {}
    for g in groups:
        rows = slice(int(starts[g]), int(starts[g] + counts[g]))
        x = x_data[rows].astype(jnp.float32) * x_scales[rows][:, None]
        w = w_data[g].astype(jnp.float32) * w_scales[g][:, None]  # [N, K]
        out[g] = rows, jnp.dot(x, w.T, precision=lax.Precision.HIGHEST)
    return out


def call(t, ops, sizes, counts):
    x_data, x_scales, w_data, w_scales = ops
    with jax.ensure_compile_time_eval():  # the index maps are constants of the program, not timed
        groups, rows = gg._row_tiles(jnp.asarray(sizes), jnp.asarray(counts), x_data.shape[0], hg.row_tile(t))
    return hg.rows_matmul(
        x_data,
        w_data,
        groups,
        rows,
        jnp.ones((1,), jnp.float32),
        t,
        transpose_rhs=True,
        out_dtype=jnp.bfloat16,
        row_scales=x_scales,
        col_scales=w_scales,
    )


def weight_grad_operands(key, k, n, num_rows, sizes, counts):
    """(x's FP8 values transposed [K, M], z^T's FP8 values [N, M], z's column scales [N]), as
    grouped_gemm's FP8 backward makes them: z = dy * x's row scales, 0 off the pairs (here dy is)."""
    kx, kd = jax.random.split(key)
    x = jax.random.normal(kx, (num_rows, k), jnp.bfloat16)
    dy = jnp.where(pair_rows(num_rows, sizes, counts)[:, None], jax.random.normal(kd, (num_rows, n), jnp.bfloat16), 0)

    @jax.jit
    def make(x, dy):
        x_data, x_scales = gg.quantize_rows(x)
        _, _, z_t, z_scales = gg.fp8_backward_operands(x_scales, dy)
        return x_data.T, z_t, z_scales

    return make(x, dy)


def weight_grad_references(ops, sizes, counts, groups):
    """{group: (g, float32 dw[g] of the dequantized operands over its pair rows)}, computed eagerly."""
    x_t, z_t, z_scales = ops
    starts = np.cumsum(sizes) - sizes
    out = {}
    for g in groups:
        rows = slice(int(starts[g]), int(starts[g] + counts[g]))
        z = z_t[:, rows].astype(jnp.float32) * z_scales[:, None]  # [N, rows]
        out[g] = g, jnp.dot(x_t[:, rows].astype(jnp.float32), z.T, precision=lax.Precision.HIGHEST)
    return out


def weight_grad_call(t, ops, sizes, counts):
    x_t, z_t, z_scales = ops
    with jax.ensure_compile_time_eval():  # the steps are constants of the program, not timed
        starts, steps = gg.group_row_steps(jnp.asarray(sizes, jnp.int32), jnp.asarray(counts, jnp.int32), t.tile_k)
    return hg.weight_grad(
        x_t,
        z_t,
        starts,
        steps,
        jnp.ones((1,), jnp.float32),
        t,
        transposed=True,
        col_scales=z_scales,
        out_dtype=jnp.bfloat16,
    )


def seconds(t, ops, sizes, counts, repeats, call=call):
    """(seconds per call from chains of 3 and 6, the chain of 6): each call's scales, the operands' last,
    depend on the previous output."""

    def chain(length):
        def run(*ops):
            def body(_, scales):
                out = call(t, (*ops[:-1], scales), sizes, counts)
                return scales.at[0].add(out.reshape(-1)[0].astype(jnp.float32) * 0)

            return lax.fori_loop(0, length, body, ops[-1])[:1]

        return jax.jit(run)

    long = chain(6)
    return chain_seconds(chain(3), long, ops, 3, repeats), long


KERNELS = {  # name: (configurations, operands, references, call)
    "forward": (CONFIGS, operands, references, call),
    "weight_grad": (WEIGHT_GRAD_CONFIGS, weight_grad_operands, weight_grad_references, weight_grad_call),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--match", default="", help="only the configurations whose repr matches this regex")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--shapes", default="7168x4096,2048x7168", help="K x N of each matmul, comma-separated")
    parser.add_argument(
        "--random-padding",
        action="store_true",
        help="forward: x's padding rows random instead of zero (the layer's are zero)",
    )
    parser.add_argument(
        "--sustain",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also time each configuration run back to back for about this long (and its energy)",
    )
    args = parser.parse_args()
    if reason := not_hopper():
        parser.error(reason)
    counts, sizes = routed_group_sizes(np.random.default_rng(0), 4096, 2, 256, 8, 128)
    num_rows = -(-int(sizes.sum()) // 128) * 128
    groups = sorted({int(np.argmax(counts)), 0, len(sizes) // 2, len(sizes) - 1})
    print(f"pairs {int(counts.sum())}, M {num_rows}; errors over groups {groups}")
    for name in args.kernels.split(","):
        configs, make_operands, make_references, kernel_call = KERNELS[name]
        for i, (k, n) in enumerate(tuple(map(int, shape.split("x"))) for shape in args.shapes.split(",")):
            padding = dict(random_padding=True) if args.random_padding and name == "forward" else {}
            ops = make_operands(jax.random.key(i), k, n, num_rows, sizes, counts, **padding)
            want = make_references(ops, sizes, counts, groups)  # {group: (index of the output, float32 values)}
            flops = 2 * int(counts.sum()) * k * n
            for t in (t for t in configs if re.search(args.match, repr(t))):
                try:
                    out = jax.jit(lambda *ops, t=t, call=kernel_call: call(t, ops, sizes, counts))(*ops)
                    err = max(
                        float(jnp.max(jnp.abs(out[index].astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
                        for index, ref in want.values()
                    )
                    secs, chain6 = seconds(t, ops, sizes, counts, args.repeats, kernel_call)
                    med = np.median(secs)
                    print(
                        f"{name} {k} x {n} {t}: {med * 1e3:.3f} ms ({np.min(secs) * 1e3:.3f}-"
                        f"{np.max(secs) * 1e3:.3f}) {flops / med / 1e12:.0f} useful TFLOP/s; max error {err:.1e}",
                        flush=True,
                    )
                    if args.sustain:
                        per_call, (_, power) = sustained(chain6, ops, 6, args.sustain)
                        print(
                            f"  sustained {args.sustain:g} s: {per_call * 1e3:.3f} ms per call"
                            f"{'; ' + power if power else ''}",
                            flush=True,
                        )
                except Exception as e:  # noqa: BLE001 (a sweep: report and go on)
                    text = "".join(traceback.format_exception_only(type(e), e))
                    print(f"{name} {k} x {n} {t}: FAILED {text[:1500]}", flush=True)


if __name__ == "__main__":
    main()
