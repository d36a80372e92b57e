"""Each of the SwiGLU's six grouped-GEMM kernels once, at the MoE benchmark's shapes, for a profiler.

The forward, input gradient and weight gradient of both matmuls on one GPU, with the routing and
128-aligned groups of hopper_gemm_sweep.py and grouped_gemm.DEFAULT_ALIGNED_TILES. From benchmarks/:

    ncu --clock-control none --kernel-name regex:"mosaic|body" --launch-count 6 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis python3 ncu_grouped_gemm.py
"""

from __future__ import annotations

import jax
import numpy as np

import hopper_gemm_sweep as sweep
from deep_ep_jax import grouped_gemm as gg


def main():
    counts, sizes = sweep.routed_group_sizes(np.random.default_rng(0), 4096, 2, 256, 8, 128)
    num_rows = -(-int(sizes.sum()) // 256) * 256
    for kernel in ("forward", "input_grad", "weight_grad"):
        tiles = getattr(gg.DEFAULT_ALIGNED_TILES, kernel)
        for a, b in sweep.operands(jax.random.key(1), kernel, num_rows, sizes, counts):
            run = jax.jit(lambda a, b, kernel=kernel, tiles=tiles: sweep.call(kernel, tiles, a, b, sizes, counts))
            jax.block_until_ready(run(a, b))
            print(f"{kernel}: {a.shape} x {b.shape}", flush=True)


if __name__ == "__main__":
    main()
