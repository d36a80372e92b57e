"""Each of the SwiGLU's six grouped-GEMM kernels once, at the MoE benchmark's shapes, for a profiler.

The forward, input gradient and weight gradient of both matmuls on one GPU, with the routing and
128-aligned groups of hopper_gemm_sweep.py and grouped_gemm.DEFAULT_ALIGNED_TILES. With --fp8-weight-grad,
instead the two FP8 weight gradients (w_in's, then w_out's) as fp8_gemm_sweep.py calls them, with
DEFAULT_ALIGNED_TILES.fp8_weight_grad; with --fp8-forward, the two FP8 forwards (w_in's y, then
w_out's) with DEFAULT_ALIGNED_TILES.fp8. --tiles "HopperTiles(...)" replaces an FP8 kernel's tiles
(as fp8_gemm_sweep.py prints them). From benchmarks/:

    ncu --clock-control none --kernel-name regex:"mosaic|body" --launch-count 6 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis python3 ncu_grouped_gemm.py
    ncu --clock-control none --kernel-name regex:body --launch-count 2 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis python3 ncu_grouped_gemm.py --fp8-weight-grad
    ncu --clock-control none --kernel-name regex:body --launch-count 1 \\
        --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct python3 ncu_grouped_gemm.py --fp8-forward
"""

from __future__ import annotations

import argparse
import ast
import sys

import hopper_gemm_sweep as sweep
import jax
import numpy as np

from deep_ep_jax.experts import grouped_gemm as gg
from deep_ep_jax.experts import hopper_gemm as hg


def routing():
    """(pairs per group, 128-aligned group sizes, rows): hopper_gemm_sweep.py's routing."""
    counts, sizes = sweep.routed_group_sizes(np.random.default_rng(0), 4096, 2, 256, 8, 128)
    return counts, sizes, -(-int(sizes.sum()) // 256) * 256


def bf16_kernels():
    counts, sizes, num_rows = routing()
    for kernel in ("forward", "input_grad", "weight_grad"):
        tiles = getattr(gg.DEFAULT_ALIGNED_TILES, kernel)
        for a, b in sweep.operands(jax.random.key(1), kernel, num_rows, sizes, counts):
            run = jax.jit(lambda a, b, kernel=kernel, tiles=tiles: sweep.call(kernel, tiles, a, b, sizes, counts))
            jax.block_until_ready(run(a, b))
            print(f"{kernel}: {a.shape} x {b.shape}", flush=True)


def fp8_kernels(kernel, tiles=None):
    """fp8_gemm_sweep.py's `kernel` ("forward" or "weight_grad") of w_in, then of w_out, with `tiles` or
    else its tiles in DEFAULT_ALIGNED_TILES (fp8 or fp8_weight_grad)."""
    import fp8_gemm_sweep as fs

    _, make_operands, _, call = fs.KERNELS[kernel]
    if tiles is None:
        tiles = gg.DEFAULT_ALIGNED_TILES.fp8 if kernel == "forward" else gg.DEFAULT_ALIGNED_TILES.fp8_weight_grad
    counts, sizes, num_rows = routing()
    for k, n in ((7168, 4096), (2048, 7168)):
        ops = make_operands(jax.random.key(1), k, n, num_rows, sizes, counts)
        run = jax.jit(lambda *ops: call(tiles, ops, sizes, counts))
        jax.block_until_ready(run(*ops))
        print(f"fp8 {kernel}: operands {[tuple(a.shape) for a in ops]}", flush=True)


def parse_tiles(text):
    """--tiles' value as fp8_gemm_sweep.py prints it, "HopperTiles(tile_m=64, ...)": names and literals
    only, nothing evaluated."""
    try:
        call = ast.parse(text, mode="eval").body
    except SyntaxError as e:  # text pasted short, e.g. "HopperTiles("
        raise SystemExit(f"--tiles: expected HopperTiles(name=value, ...), got {text!r} ({e.msg})") from e
    if not (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == "HopperTiles"
        and not call.args
        and all(kw.arg for kw in call.keywords)
    ):
        raise SystemExit(f"--tiles: expected HopperTiles(name=value, ...), got {text!r}")
    try:
        return hg.HopperTiles(**{kw.arg: ast.literal_eval(kw.value) for kw in call.keywords})
    except (TypeError, ValueError) as e:  # a name HopperTiles does not have, a value that is not a literal
        raise SystemExit(f"--tiles: {text!r}: {e}") from e


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    kernels = parser.add_mutually_exclusive_group()
    kernels.add_argument("--fp8-weight-grad", action="store_true", help="the two FP8 weight gradients")
    kernels.add_argument("--fp8-forward", action="store_true", help="the two FP8 forwards")
    parser.add_argument("--tiles", help='an FP8 kernel\'s tiles, "HopperTiles(...)" as fp8_gemm_sweep.py prints them')
    args = parser.parse_args()
    tiles = parse_tiles(args.tiles) if args.tiles else None
    if reason := sweep.not_hopper():
        sys.exit(f"ncu_grouped_gemm.py: {reason}")
    if args.fp8_weight_grad:
        fp8_kernels("weight_grad", tiles)
    elif args.fp8_forward:
        fp8_kernels("forward", tiles)
    else:
        bf16_kernels()
