"""Each of the SwiGLU's six grouped-GEMM kernels once, at the MoE benchmark's shapes, for a profiler.

The forward, input gradient and weight gradient of both matmuls on one GPU, with the routing and
128-aligned groups of hopper_gemm_sweep.py and grouped_gemm.DEFAULT_ALIGNED_TILES. With --fp8-weight-grad,
instead the two FP8 weight gradients (w_in's, then w_out's) as fp8_gemm_sweep.py calls them, with
DEFAULT_ALIGNED_TILES.fp8_weight_grad. From benchmarks/:

    ncu --clock-control none --kernel-name regex:"mosaic|body" --launch-count 6 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis python3 ncu_grouped_gemm.py
    ncu --clock-control none --kernel-name regex:body --launch-count 2 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis python3 ncu_grouped_gemm.py --fp8-weight-grad
"""

from __future__ import annotations

import sys

import jax
import numpy as np

import hopper_gemm_sweep as sweep
from deep_ep_jax import grouped_gemm as gg


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


def fp8_weight_grads():
    import fp8_gemm_sweep as fs

    counts, sizes, num_rows = routing()
    tiles = gg.DEFAULT_ALIGNED_TILES.fp8_weight_grad
    for k, n in ((7168, 4096), (2048, 7168)):
        ops = fs.weight_grad_operands(jax.random.key(1), k, n, num_rows, sizes, counts)
        run = jax.jit(lambda *ops: fs.weight_grad_call(tiles, ops, sizes, counts))
        jax.block_until_ready(run(*ops))
        print(f"fp8 weight_grad: x^T {ops[0].shape}, z^T {ops[1].shape}", flush=True)


if __name__ == "__main__":
    fp8_weight_grads() if "--fp8-weight-grad" in sys.argv[1:] else bf16_kernels()
