"""The warp-specialized aligned kernels (deep_ep_jax/experts/hopper_gemm.py) on one
Hopper GPU: each configuration checked against numpy at a small size (empty
groups, tiles past the last group) and against the row-tiled Mosaic kernels
at the MoE benchmark's shapes, then timed there.

    python benchmarks/hopper_gemm_sweep.py [--kernels forward,input_grad,weight_grad] [--repeats 5]
                                           [--align 128] [--first N] [--match REGEX] [--no-baseline]

Shapes: one rank's 128 experts of random top-8 routing (4096 tokens x 2 ranks
over 256 experts), groups rounded up to --align rows (128, today's layout; 64
halves the padding and takes the configurations whose row tile is 64: the
forward and input gradient's tile_m, the weight gradient's tile_k); the SwiGLU's two matmuls
(K, N = 7168, 4096 and 2048, 7168) summed per kernel. Each group holds its
pairs, then zero rows up to its aligned size, and the kernels are called as
grouped_matmul calls them with valid_sizes (the pairs): the weight gradient
reads a group's rows up to the row step that covers its pairs. Useful TFLOP/s
count the routed pairs only.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import itertools

from bench_grouped_gemm import relative_error, routed_group_sizes
from timing import chain_seconds

from deep_ep_jax.experts import grouped_gemm as gg
from deep_ep_jax.experts import hopper_gemm as hg

ALIGN = 128
T = hg.HopperTiles
UNIT = np.ones((1,), np.float32)  # the kernels' scale: 1


def not_hopper():
    """Why the Mosaic GPU kernels cannot run here, or None on a Hopper GPU (these sweeps' only target)."""
    if gg.is_hopper_gpu():
        return None
    return (
        "needs a Hopper GPU (compute capability 9.x) for the Mosaic GPU kernels; "
        f"JAX sees {jax.devices()[0].device_kind}"
    )


def call(kernel, t, a, b, sizes, counts):
    """The kernel on groups of `sizes` (numpy) holding `counts` pairs each, its index maps made as
    grouped_matmul makes them (valid_sizes = counts), but at trace time: constants of the program,
    outside what is timed."""
    with jax.ensure_compile_time_eval():
        s, c = jnp.asarray(sizes, jnp.int32), jnp.asarray(counts, jnp.int32)
        row_steps = gg.group_row_steps(s, c, t.tile_k)
    if kernel != "weight_grad":  # rows_matmul through the wrapper's helper (its few index ops are timed)
        return gg._rows_matmul(a, b, s, c, UNIT, t, transpose_rhs=kernel == "input_grad")
    return hg.weight_grad(a, b, *row_steps, UNIT, t)


def numpy_reference(kernel, a, b, sizes):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    if kernel == "weight_grad":
        return np.stack([a[s:e].T @ b[s:e] for s, e in itertools.pairwise(starts)])
    out = np.zeros((a.shape[0], b.shape[1] if kernel == "input_grad" else b.shape[2]), np.float32)
    for g, (s, e) in enumerate(itertools.pairwise(starts)):
        out[s:e] = a[s:e] @ (b[g].T if kernel == "input_grad" else b[g])
    return out, starts[-1]


def pair_rows(num_rows, sizes, counts):
    """bool [num_rows]: the rows of the groups that hold pairs (the first counts[g] of group g)."""
    rows = np.zeros(num_rows, bool)
    for start, count in zip(np.cumsum(sizes) - sizes, counts):
        rows[start : start + count] = True
    return rows


def small_check(kernel, t):
    """Against numpy at a small size: empty groups, tiles past the last group, and padding rows
    (zeros, as the layout's) in a group's last tile, its first half (group 0) or second (group 3)."""
    rng = np.random.default_rng()
    k, n, g = 512, 4 * 2 * t.tile_n * (2 if t.cluster_n else 1), 5
    sizes = np.array([2, 0, 1, 3, 0]) * t.tile_m
    counts = sizes - np.array([3, 0, 0, 1, 0]) * (t.tile_m // 4)
    rows = int(sizes.sum()) + 2 * t.tile_m  # two tiles past the last group
    a = jnp.asarray(rng.standard_normal((rows, k)) * pair_rows(rows, sizes, counts)[:, None], jnp.bfloat16)
    if kernel == "weight_grad":
        b = jnp.asarray(rng.standard_normal((rows, n)), jnp.bfloat16)
    else:
        b = jnp.asarray(rng.standard_normal((g, n, k) if kernel == "input_grad" else (g, k, n)), jnp.bfloat16)
    got = np.asarray(jax.jit(lambda a, b: call(kernel, t, a, b, sizes, counts))(a, b), np.float32)
    if kernel == "weight_grad":
        want = numpy_reference(kernel, a, b, sizes)
    else:
        want, total = numpy_reference(kernel, a, b, sizes)
        got, want = got[:total], want[:total]
    err = np.abs(got - want).max() / (np.abs(want).max() + 1e-9)
    assert err < 2e-2, (kernel, t, err)
    if kernel == "weight_grad":
        assert not got[1].any() and not got[4].any(), "empty groups not zero"
    return err


def operands(key, kernel, num_rows, sizes, counts):
    """[(a, b)] of both matmuls for `kernel`; a's rows that hold no pair are zeros, as the layout's."""
    out = []
    for i, (kk, nn) in enumerate([(7168, 4096), (2048, 7168)]):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        if kernel == "forward":
            a = jax.random.normal(k1, (num_rows, kk), jnp.bfloat16)
            b = jax.random.normal(k2, (len(sizes), kk, nn), jnp.bfloat16) * jnp.bfloat16(kk**-0.5)
        elif kernel == "input_grad":
            a = jax.random.normal(k1, (num_rows, nn), jnp.bfloat16)
            b = jax.random.normal(k2, (len(sizes), kk, nn), jnp.bfloat16) * jnp.bfloat16(nn**-0.5)
        else:
            a = jax.random.normal(k1, (num_rows, kk), jnp.bfloat16)
            b = jax.random.normal(k2, (num_rows, nn), jnp.bfloat16) * jnp.bfloat16(0.06)
        out.append((jnp.where(pair_rows(num_rows, sizes, counts)[:, None], a, 0), b))
    return out


ROW_TILED = dataclasses.replace(gg.DEFAULT_BLOCKS, aligned=None)  # JAX's row-tiled kernels only


def generic(kernel, a, b, sizes):
    s = jnp.asarray(sizes)
    if kernel == "forward":
        return gg._forward(True, ROW_TILED, False, a, b, s, s, UNIT)
    if kernel == "input_grad":
        return gg._input_grad(True, ROW_TILED, False, a, b, s, s, UNIT)
    return gg._weight_grad(True, ROW_TILED, False, a, b, s, s, UNIT)


def time_fn(fn, ops, repeats):
    """Seconds per call of fn over both matmuls, from chains of 3 and 6."""

    def chain(length):
        def run(*flat):
            pairs = [tuple(flat[i : i + 2]) for i in range(0, len(flat), 2)]

            def body(_, carry):
                outs = [fn(a, b) for a, b in carry]
                link = sum(o.reshape(-1)[0] for o in outs).astype(carry[0][0].dtype) * 0
                return [(a.at[0, 0].add(link), b) for a, b in carry]

            pairs = lax.fori_loop(0, length, body, pairs)
            return pairs[0][0][:1, :1]

        return jax.jit(run)

    flat = [x for pair in ops for x in pair]
    return chain_seconds(chain(3), chain(6), flat, 3, repeats)


# Around the best of the first two sweeps (benchmarks/RESULTS.md): the tile walk, multicast, and for the
# weight gradient longer row steps (tile_k 128). 5 stages of 128 x 256 tiles exceed shared memory.
CONFIGS = {
    "forward": [
        T(128, 128, 64, 4, grid_minor_n=False, grid_tile_width=w, cluster_n=c)
        for w, c in [(4, False), (2, False), (8, False), (4, True), (8, True)]
    ]
    + [
        T(128, 128, 128, 2, grid_minor_n=False, grid_tile_width=4),
        T(128, 128, 64, 3, grid_minor_n=False, grid_tile_width=4),
    ]
    + [
        T(128, 128, 64, 4, grid_minor_n=False, grid_tile_width=w, cluster_n=c, steady_pipeline=True)
        for w, c in [(4, False), (8, True)]
    ]
    # 64-row tiles, for groups aligned to 64 rows (--align 64): half the padding, half the row tile's reuse
    + [T(64, 128, 64, 4, grid_minor_n=False, grid_tile_width=w) for w in (4, 8)]
    + [T(64, 256, 32, 5, grid_minor_n=False, grid_tile_width=4)]
    + [T(128, 128, 64, 3, grid_minor_n=False, grid_tile_width=4, epi_tile_m=128, epi_tile_n=128)]
    # bands of row tiles that end with a group (the FP8 forward's default walk)
    + [T(128, 128, 64, 4, grid_minor_n=False, grid_tile_width=w, group_bands=True) for w in (2, 4)],
    "weight_grad": [T(128, 128, 64, 4, grid_tile_width=w, cluster_n=c) for w, c in [(4, False), (8, False), (4, True)]]
    + [
        T(128, 128, 128, 2, grid_tile_width=4),
        T(128, 128, 64, 3, grid_tile_width=4),
        T(128, 128, 64, 4, grid_minor_n=False, grid_tile_width=8),
    ]
    # A CTA's tiles as one pipeline (the next tile's loads overlap this one's products and stores); tile_k 32
    # is refused there (the transposed x tile's wgmma takes K steps of 64)
    + [T(128, 128, 64, s, grid_tile_width=w, steady_pipeline=True) for s, w in [(4, 4), (3, 4), (4, 8), (3, 8)]]
    # The epilogue in fewer, larger stores (3 stages leave room for them)
    + [
        T(128, 128, 64, 3, grid_tile_width=w, steady_pipeline=True, epi_tile_m=em, epi_tile_n=128)
        for w, em in [(8, 128), (4, 128), (8, 64)]
    ],
}
CONFIGS["input_grad"] = CONFIGS["forward"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="forward,input_grad,weight_grad")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--align", type=int, default=ALIGN, help="group sizes rounded up to this (64 or 128)")
    parser.add_argument("--first", type=int, default=0, help="only the first N configurations per kernel (0: all)")
    parser.add_argument("--match", default="", help="only the configurations whose repr matches this regex")
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip timing the row-tiled kernels (they still check each configuration)",
    )
    args = parser.parse_args()
    if reason := not_hopper():
        parser.error(reason)
    if ALIGN % args.align:
        parser.error(f"--align must divide {ALIGN}")
    rng = np.random.default_rng(0)
    counts, sizes = routed_group_sizes(rng, 4096, 2, 256, 8, args.align)
    num_rows = -(-int(sizes.sum()) // 256) * 256  # room for every alignment up to ALIGN
    pairs = int(counts.sum())
    flops = 2 * pairs * (7168 * 4096 + 2048 * 7168)
    print(f"pairs {pairs}, aligned rows {int(sizes.sum())} (+{sizes.sum() / pairs - 1:.1%}), M {num_rows}")
    key = jax.random.key(1)
    for kernel in args.kernels.split(","):
        ops = operands(key, kernel, num_rows, sizes, counts)
        if not args.no_baseline:
            base = time_fn(lambda a, b, kernel=kernel: generic(kernel, a, b, sizes), ops, args.repeats)
            print(
                f"{kernel} row-tiled (DEFAULT_BLOCKS, aligned=None): {np.median(base) * 1e3:.2f} ms "
                f"{flops / np.median(base) / 1e12:.0f} useful TFLOP/s",
                flush=True,
            )
        # Checked against the row-tiled kernels on the device (a weight gradient is gigabytes).
        references = [generic(kernel, a, b, sizes) for a, b in ops]
        # The configurations whose row tile divides the groups (weight_grad: its K step runs along the rows).
        fitting = [
            t
            for t in CONFIGS[kernel]
            if args.align % (t.tile_k if kernel == "weight_grad" else hg.row_tile(t)) == 0
            and re.search(args.match, repr(t))
        ]
        for t in fitting[: args.first or None]:
            try:
                err = small_check(kernel, t)
                for (a, b), want in zip(ops, references):
                    got = jax.jit(lambda a, b, t=t, k=kernel: call(k, t, a, b, sizes, counts))(a, b)
                    rows = None if kernel == "weight_grad" else int(sizes.sum())  # rows_matmul leaves the rest
                    big = relative_error(got[:rows], want[:rows])
                    assert big < 2e-2, ("real size", big)
                secs = time_fn(lambda a, b, t=t, k=kernel: call(k, t, a, b, sizes, counts), ops, args.repeats)
                med = np.median(secs)
                print(
                    f"{kernel} {t}: {med * 1e3:.2f} ms ({np.min(secs) * 1e3:.2f}-{np.max(secs) * 1e3:.2f}) "
                    f"{flops / med / 1e12:.0f} useful TFLOP/s; small err {err:.1e}",
                    flush=True,
                )
            except Exception as e:  # noqa: BLE001 (a sweep: report and go on)
                text = "".join(traceback.format_exception_only(type(e), e))
                print(f"{kernel} {t}: FAILED {text[:1500]}", flush=True)


if __name__ == "__main__":
    main()
