"""Grouped GEMM of the experts on one GPU: one expert SwiGLU
(x [M, 7168] -> w_in [G, 7168, 4096] -> silu(gate) * up -> w_out [G, 2048, 7168])
through deep_ep_jax.grouped_matmul, forward and forward + backward, with the
Mosaic GPU kernels (backend="cuda") beside jax.lax.ragged_dot (backend="xla", through
JAX's Pallas-Triton grouped kernel: XLA's own GPU lowering is a dense dot over
all G groups).

    python benchmarks/bench_grouped_gemm.py            # the MoE benchmark's shapes, one rank
    python benchmarks/bench_grouped_gemm.py --sweep    # first, the block sizes of each kernel
    python benchmarks/bench_grouped_gemm.py --align 128 --json gemm.json
    python benchmarks/bench_grouped_gemm.py --align 128 --impls mgpu --profile   # also: time by kernel

Group sizes: random top-8 routing of 4096 tokens x 2 ranks over 256 experts,
this rank's 128 experts (about 32768 pairs), each group rounded up to
--align rows (the expert-major layout's alignment; the extra rows are zeros
inside the group and computed). M, the static row count, is the sum rounded
up to 128 unless --rows gives it (the Mosaic kernels' cost follows M, not the
sum). Useful TFLOP/s count the routed pairs only: 2 * pairs * K * N per
matmul, x3 for forward + backward.

Timing (timing.chain_seconds): a jitted chain of n steps and one of 2n, each
step's input depending on the previous step's output; time per step = the
difference / n; median and p10-p90 over --repeats.

--sweep times each Mosaic kernel alone (forward, input gradient, weight
gradient; both matmuls' shapes summed) over a small grid of block sizes
(tiles at most 128 wide from jax 0.12), in one jitted loop per configuration,
checks each against the Mosaic kernel with DEFAULT_BLOCKS, and prints the
best, as a GroupedMatmulBlocks to paste into DEFAULT_BLOCKS; the SwiGLU is
then timed with them. --sweep-kernels sweeps some of the three only.

--impls ...,tokamax adds Google's tokamax 0.0.17 (`bash .whl/tokamax/INSTALL.sh` installs it offline;
Python >= 3.12, jax >= 0.11.1): the same SwiGLU through tokamax.ragged_dot on the same layout (rows
padded to --align; tokamax leaves rows past sum(group_sizes) unwritten, zeroed after it where M is
larger). Its candidates (tokamax_variants): on a GPU implementation="mosaic" (its Pallas Mosaic GPU
kernels; not None, whose fallback is XLA's ragged_dot: on GPUs a dense dot over all groups) with its
default config, i.e. its autotuning cache, which holds none of these shapes, else its heuristics
(64 x 64 tiles), and its own VJP; on Hopper also TUNED configs: those that won tokamax's own H100
autotuning at the nearest shapes in its cache (tuned_configs; a VJP of ours calls its three kernels
with them, as its VJP does); "triton" only where jax_triton and triton are installed (not in the
wheelhouse: ~150 MB); "xla" on CPU. With --fp8: tokamax has no FP8 x FP8 ragged_dot on Hopper
(TOKAMAX_FP8); its "fp8w" rows are FP8 weights (qwix QArrays, one scale per output channel, made
outside the step like fp8_weights) with bf16 rows (float16 where ptxas predates PTX ISA 9.2, which
Mosaic GPU needs to convert FP8 to bf16), dw in bf16. Every output is checked against the first of
mgpu and xla (max error of the largest value).

--compare-shapes: ours (mgpu on Hopper, else xla) against tokamax at the MoE layer's loads: 4096
tokens per rank, hidden 7168, top-8 of 256 experts, this rank's experts at each of --compare-ranks
(2: 128 experts, 8: 32; about 32768 pairs either way), groups aligned to 128 rows and valid_sizes set,
as the layer runs them (rows that hold no pair are zeros). Per load:
  1. each kernel alone in bf16 (forward, input gradient, weight gradient; both matmuls of the SwiGLU
     summed): ours, then each tokamax candidate (default config; TUNED; the input gradient also from
     w^T transposed beforehand, untimed, instead of tokamax's transpose of w in each call), each
     checked against ours;
  2. the SwiGLU forward and forward + backward: ours in bf16, tokamax's default and (if a TUNED
     config won a kernel in 1) its kernels' best configs; then FP8: ours with FP8 y and dx, and with
     the FP8 weight gradient too (forward + backward only: its forward is the same), against
     tokamax's fp8w (default and TUNED) and its bf16 rows.
Timing: chain_seconds of one jitted program whose loop length is an argument (--chain n and 2n steps,
one compilation each; 3 by default here), median and p10-p90 of --repeats (5 here). It ends with one
markdown table (also written beside --json as .md): case, ours (impl, ms median, p10-p90), tokamax
best (impl, ms median, p10-p90), tokamax / ours (>= 1.10: ours at least 10% faster); a candidate whose
output is off (bf16: 2e-2, FP8: 0.25 of the largest value against ours' bf16) or fails does not count.
About 50 programs are compiled in all. Expected on one H100: about 4-6 minutes (not yet measured: mostly
compilation, ~3-8 s a program, plus ~1-3 s of timing each). --budget-s (330 by default) starts no timing
past that many seconds, so the table prints within about 6 minutes whatever the compile times, the cases
left out marked skipped (then --compare-ranks 8 alone, or a larger --budget-s, gets the rest):

    python3 setup.py -q build_ext --inplace   # ours' FP8 quantizations take the extension's kernels
    python3 benchmarks/bench_grouped_gemm.py --compare-shapes --json $OUT/tokamax_compare.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on our hosts

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import chain_seconds, check_counts, environment, print_kernel_breakdown, touch

from deep_ep_jax import _native
from deep_ep_jax.experts import grouped_gemm as gg

OURS = ("mgpu", "xla")  # grouped_matmul's backends, as --impls names them ("mgpu": its backend "cuda")


def routed_group_sizes(rng, tokens, ranks, experts, topk, align):
    """(pairs per local expert, the same rounded up to align) of rank 0's experts."""
    scores = rng.standard_normal((tokens * ranks, experts))
    chosen = np.argpartition(-scores, topk, axis=1)[:, :topk]
    counts = np.bincount(chosen.ravel(), minlength=experts)[: experts // ranks]
    return counts.astype(np.int32), (-(-counts // align) * align).astype(np.int32)


def make_inputs(key, num_rows, counts, sizes, hidden, ffn):
    """x with zeros on every row that is not a routed pair, weights of unit-scale outputs, dy."""
    kx, ki, ko, kd = jax.random.split(key, 4)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    pair_rows = np.zeros(num_rows, bool)
    for start, count in zip(starts, counts):
        pair_rows[start : start + count] = True
    x = jnp.where(pair_rows[:, None], jax.random.normal(kx, (num_rows, hidden), jnp.bfloat16), 0)
    w_in = jax.random.normal(ki, (len(sizes), hidden, 2 * ffn), jnp.bfloat16) * jnp.bfloat16(hidden**-0.5)
    w_out = jax.random.normal(ko, (len(sizes), ffn, hidden), jnp.bfloat16) * jnp.bfloat16(ffn**-0.5)
    dy = jax.random.normal(kd, (num_rows, hidden), jnp.bfloat16)
    return x, w_in, w_out, dy


def swiglu(x, w_in, w_out, sizes, valid, impl, blocks, aligned, fp8=None):
    """valid: the pairs of each group (grouped_matmul's valid_sizes), or None. fp8: the FP8 copies of
    (w_in, w_out), or None (bf16). impl: grouped_matmul's, or a Tokamax (fp8: tokamax_fp8_copies')."""
    w_in8, w_out8 = fp8 or (None, None)
    h = grouped(x, w_in, sizes, valid, impl, blocks, aligned, w_in8)
    gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
    return grouped((jax.nn.silu(gate) * up).astype(x.dtype), w_out, sizes, valid, impl, blocks, aligned, w_out8)


def grouped(x, w, sizes, valid, impl, blocks, aligned, w8):
    if isinstance(impl, Tokamax):
        return tokamax_matmul(impl, x, w, sizes, w8)
    return gg.grouped_matmul(
        x, w, sizes, backend=impl, block_sizes=blocks, aligned_groups=aligned, valid_sizes=valid, fp8_weights=w8
    )


def forward_step(impl, blocks, aligned):
    def step(x, dy, w_in, w_out, sizes, valid, fp8):
        out = lax.optimization_barrier(swiglu(x, w_in, w_out, sizes, valid, impl, blocks, aligned, fp8))
        return touch(x, out[:1, :1]), dy

    return step


def forward_backward_step(impl, blocks, aligned):
    def step(x, dy, w_in, w_out, sizes, valid, fp8):
        out, vjp = jax.vjp(
            lambda x, w_in, w_out: swiglu(x, w_in, w_out, sizes, valid, impl, blocks, aligned, fp8), x, w_in, w_out
        )
        out, dx, dw_in, dw_out = lax.optimization_barrier((out, *vjp(dy)))
        link = out[:1, :1] + dx[:1, :1] + dw_in[0, :1, :1] + dw_out[0, :1, :1]
        # dy changes too: else XLA could hoist dy @ w_out^T out of the loop.
        return touch(x, link), touch(dy, link)

    return step


def report(results, impl, op, seconds, work, **extra):
    """Add a row of timings (seconds per step) to results and print it; extra: more fields for the JSON
    (error: of the output against the reference, printed too)."""
    p10, p50, p90 = np.percentile(seconds, [10, 50, 90])
    results.append(
        {
            "impl": impl,
            "op": op,
            "ms_median": p50 * 1e3,
            "ms_p10": p10 * 1e3,
            "ms_p90": p90 * 1e3,
            "tflops": work / p50 / 1e12,
            "samples_ms": (seconds * 1e3).tolist(),
            **extra,
        }
    )
    tflops = f"{work / p50 / 1e12:.1f}" if work else ""
    error = extra.get("error", "")
    error = f" {error:.2e} |" if isinstance(error, float) else f" {error or 'reference'} |" if "error" in extra else ""
    print(f"| {impl} | {op} | {p50 * 1e3:.3f} | {p10 * 1e3:.3f}-{p90 * 1e3:.3f} | {tflops} |{error}", flush=True)


def chain(step, length):
    """One jitted program of `length` steps, each on the previous one's x and dy."""

    def run(x, dy, *weights):
        x, _ = lax.fori_loop(0, length, lambda _, carry: step(*carry, *weights), (x, dy))
        return x[:1, :1]

    return jax.jit(run)


def time_step(step, inputs, length, repeats):
    return chain_seconds(chain(step, length), chain(step, 2 * length), inputs, length, repeats)


def looped(step, first):
    """jitted run(length, carry, *rest) -> (first(carry, *rest), carry's [:1, :1] after `length` steps):
    the loop's length an argument, so chain_seconds' chains of n and 2n steps are one compilation. first
    (computed once, in both chains alike; or None) gives an output to check."""

    def run(length, carry, *rest):
        out = None if first is None else first(carry, *rest)
        carry = lax.fori_loop(0, length, lambda _, c: step(c, *rest), carry)
        return out, jax.tree.leaves(carry)[0][:1, :1]

    return jax.jit(run)


def looped_seconds(run, args, length, repeats, check=None):
    """(chain_seconds of run(n, *args) and run(2n, *args), check(run's first output) or None). The
    output is dropped before the timing (the weight gradients' are GiBs)."""
    out, _ = jax.block_until_ready(run(length, *args))
    checked = None if check is None else check(out)
    del out
    return chain_seconds(
        functools.partial(run, length), functools.partial(run, 2 * length), args, length, repeats
    ), checked


def swiglu_looped(impl, blocks, aligned, backward):
    """looped() SwiGLU steps (forward_step or forward_backward_step) on ((x, dy), w_in, w_out, sizes,
    valid, fp8); first: the SwiGLU's output (forward only; None with backward)."""
    step = (forward_backward_step if backward else forward_step)(impl, blocks, aligned)
    first = None if backward else lambda carry, *w: swiglu(carry[0], *w[:4], impl, blocks, aligned, w[4])
    return looped(lambda carry, *w: step(*carry, *w), first)


def kernel_looped(fn):
    """looped() calls of fn (kernel_call's) on [(a, b, sizes)], each a on the previous call's output."""

    def step(ops):
        outs = lax.optimization_barrier(fn(ops))
        return [(touch(a, out.reshape(-1)[:1].reshape(1, 1)), *rest) for (a, *rest), out in zip(ops, outs)]

    return looped(step, fn)


# Block-size sweep ---------------------------------------------------------------

# (block_m, block_n, max_concurrent_steps, grid_block_n) of ragged_dot_mgpu; block_n must divide both matmuls'
# N (4096 and 7168). Up to jax 0.11: around the best of a first, wider sweep on the H200 (64, 256, 5, 1).
# From jax 0.12, which lowers tiles at most 128 wide (gg.ROW_TILED_MAX_BLOCK_N): those tiles' depths and grids.
if gg.ROW_TILED_MAX_BLOCK_N >= 256:
    ROW_TILED = [
        (64, 256, 5, 1),
        (64, 256, 6, 1),
        (64, 256, 4, 1),
        (128, 256, 4, 1),
        (128, 256, 3, 1),
        (192, 128, 4, 1),
        (64, 256, 5, 2),
        (128, 128, 6, 8),
        (128, 128, 5, 8),
        (64, 128, 6, 1),
    ]
else:
    ROW_TILED = [
        (64, 128, 6, 1),
        (64, 128, 6, 2),
        (64, 128, 6, 8),
        (128, 128, 4, 2),
        (128, 128, 4, 8),
        (128, 128, 5, 8),
        (128, 128, 6, 8),
        (128, 128, 5, 4),
        (128, 128, 5, 16),
        (128, 128, 4, 16),
    ]
SWEEP_GRIDS = {
    "forward": [gg.KernelBlocks(m, n, 64, steps, gbn) for m, n, steps, gbn in ROW_TILED],
    "input_grad": [gg.KernelBlocks(m, n, 64, steps, gbn) for m, n, steps, gbn in ROW_TILED],
    "weight_grad": [
        gg.KernelBlocks(m, n, k, steps, 4)
        for (m, n), k, steps in itertools.product([(128, 128), (64, 128)], (64, 128), (2, 4))
    ],
}


def kernel_call(kernel, blocks, impl, aligned=False, valid=None):
    """fn([(a, b, sizes)] of both matmuls) -> [one kernel's output of each]: a is the
    [M, *] operand the loop carries (x, or dy for the input gradient). aligned, valid: as grouped_matmul's
    aligned_groups and valid_sizes (None: every row valid). impl may be a Tokamax."""
    if isinstance(impl, Tokamax):
        return lambda operands: [tokamax_call(impl, kernel, *ops, b_transposed=impl.w_t) for ops in operands]
    use_mgpu, unit = impl == "mgpu", jnp.ones((1,), jnp.float32)  # scale 1
    v = (lambda sizes: sizes) if valid is None else (lambda sizes: valid)
    one = {
        "forward": lambda x, w, sizes: gg._forward(use_mgpu, blocks, aligned, x, w, sizes, v(sizes), unit),
        "input_grad": lambda dy, w, sizes: gg._input_grad(use_mgpu, blocks, aligned, dy, w, sizes, v(sizes), unit),
        "weight_grad": lambda x, dy, sizes: gg._weight_grad(use_mgpu, blocks, aligned, x, dy, sizes, v(sizes), unit),
    }[kernel]
    return lambda operands: [one(*ops) for ops in operands]


def kernel_operands(key, kernel, num_rows, sizes, w_in, w_out, keep=None):
    """[(a, b, sizes)] of `kernel` for the SwiGLU's two matmuls, rows padded to 128 as the wrapper does.
    keep (bool [num_rows], optional): the rows that hold data; the others are zeros."""
    rows = -(-num_rows // 128) * 128
    (_, hidden, ffn2), ffn = w_in.shape, w_out.shape[1]
    k1, k2, k3, k4 = jax.random.split(key, 4)
    mask = None if keep is None else jnp.asarray(np.pad(keep, (0, rows - num_rows)))[:, None]

    def normal(k, cols):
        a = jax.random.normal(k, (rows, cols), jnp.bfloat16)
        return a if mask is None else jnp.where(mask, a, jnp.zeros((), a.dtype))

    x1, dy1 = normal(k1, hidden), normal(k2, ffn2)
    x2, dy2 = normal(k3, ffn), normal(k4, hidden)
    if kernel == "forward":
        return [(x1, w_in, sizes), (x2, w_out, sizes)]
    if kernel == "input_grad":
        return [(dy1, w_in, sizes), (dy2, w_out, sizes)]
    return [(x1, dy1, sizes), (x2, dy2, sizes)]


def loop_seconds(fn, operands, length, repeats):
    """(seconds per call of fn, fn(operands)) from one jitted program: fn once on the
    operands, then a loop of `length` calls, each on the previous one's output
    (the host cost of a call is small beside calls of milliseconds each:
    good enough to rank block sizes). One program: Mosaic kernels compile slowly."""

    def run(operands):
        def body(_, ops):
            outs = lax.optimization_barrier(fn(ops))
            return [(touch(a, out.reshape(-1)[:1].reshape(1, 1)), *rest) for (a, *rest), out in zip(ops, outs)]

        return fn(operands), lax.fori_loop(0, length, body, operands)[0][0][:1, :1]

    run = jax.jit(run)
    outputs, _ = jax.block_until_ready(run(operands))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(operands))
        samples.append((time.perf_counter() - t0) / (length + 1))
    return float(np.median(samples)), outputs


def sweep(key, num_rows, sizes, w_in, w_out, repeats, kernels):
    """{kernel: best KernelBlocks} for each of `kernels` (keys of SWEEP_GRIDS), each checked against the
    Mosaic kernel with DEFAULT_BLOCKS (on the group rows), which tests/gpu/test_grouped_gemm_gpu.py checks
    against numpy: the xla path may be a dense dot over all groups here (no Pallas-Triton ragged_dot), too
    large to run."""
    total = int(sizes.sum())
    sizes = jnp.asarray(sizes)
    best = {}
    for kernel in kernels:
        grid = SWEEP_GRIDS[kernel]
        operands = kernel_operands(key, kernel, num_rows, sizes, w_in, w_out)
        want = jax.jit(kernel_call(kernel, gg.DEFAULT_BLOCKS, "mgpu"))(operands)
        if kernel != "weight_grad":  # the groups' rows are compared (the rest is zeros)
            want = [r[:total] for r in want]
        print(f"\n| {kernel} blocks | ms (both matmuls) |\n|---|---|")
        timed = []
        for kb in grid:
            blocks = dataclasses.replace(gg.DEFAULT_BLOCKS, aligned=None, **{kernel: kb})  # the row-tiled kernels
            try:
                seconds, got = loop_seconds(kernel_call(kernel, blocks, "mgpu"), operands, 5, repeats)
            except Exception as e:  # noqa: BLE001  (e.g. over the shared memory: not a candidate)
                print(f"| {kb} | fails: {type(e).__name__}: {str(e).strip().splitlines()[0][:100]} |")
                continue
            if kernel != "weight_grad":
                got = [g[:total] for g in got]
            err = max(float(relative_error(g, r)) for g, r in zip(got, want))
            if err > 2e-2:
                print(f"| {kb} | wrong: max error {err:.3g} of the largest value |")
                continue
            timed.append((seconds, kb))
            print(f"| {kb} | {seconds * 1e3:.3f} |", flush=True)
        if timed:
            best[kernel] = min(timed, key=lambda t: t[0])[1]
    return best


@jax.jit
def relative_error(got, want):
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-6)


# tokamax ------------------------------------------------------------------------

TOKAMAX_FP8 = (
    "tokamax 0.0.17 has no FP8 x FP8 ragged_dot on Hopper: its Mosaic GPU sm90 kernels dequantize "
    "a quantized lhs to bf16 (FP8 rows with FP8 MMAs are its sm100 kernels only), and its Triton "
    "kernel dequantizes operands with per-channel scales before a bf16 dot. It takes FP8 weights "
    "(qwix QArrays, float8_e4m3fn, one scale per output channel) with bf16 rows, dequantized in "
    "registers before bf16 WGMMAs: its 'fp8w' rows (w8a16), with dw in bf16"
)
TK = types.SimpleNamespace()  # import_tokamax's modules


def import_tokamax():
    """None once tokamax is imported into TK, else why not. tokamax/__init__ imports xprof.cli.tools (a
    profiler: 32 MB and a large dependency tree, left out of .whl/tokamax) for tokamax.benchmarking alone,
    which is not used here: where xprof is missing a placeholder module stands in for that import."""
    if hasattr(TK, "tokamax"):
        return None
    try:
        import xprof.cli.tools.get_kernel_stats_tool  # noqa: F401
    except ImportError:
        for name in ("xprof", "xprof.cli", "xprof.cli.tools", "xprof.cli.tools.get_kernel_stats_tool"):
            sys.modules.setdefault(name, types.ModuleType(name))
    try:
        import qwix
        import tokamax
        from tokamax._src.ops.ragged_dot import api, base
    except ImportError as e:
        return f"tokamax is not installed ({e}): bash .whl/tokamax/INSTALL.sh (Python >= 3.12)"
    TK.tokamax, TK.qwix, TK.api, TK.base, TK.mosaic = tokamax, qwix, api, base, None
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)  # a warning of KBs at each autotuning-cache miss (every call here)
    try:
        from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu

        TK.mosaic = pallas_mosaic_gpu
    except ImportError:
        pass
    return None


@dataclasses.dataclass(frozen=True)
class Tokamax:
    """One way of running tokamax.ragged_dot (static under jit). implementation: tokamax's argument (None:
    its own choice, and in the SwiGLU its own VJP); configs: Mosaic GPU configs of (forward, input_grad,
    weight_grad), None for one (or all) leaving tokamax its default config there; w_t: the input gradient
    from w transposed beforehand (given as b, untimed) instead of tokamax's transpose of w in each call;
    tail: zero y past sum(group_sizes), which tokamax leaves unwritten (where M is larger)."""

    name: str
    implementation: str | None = None
    configs: tuple | None = None
    w_t: bool = False
    tail: bool = False
    f16_rows: bool = False  # fp8w: rows (and the QArrays' scales) in float16 (fp8w_rows_dtype)


KERNELS = tuple(SWEEP_GRIDS)  # forward, input_grad, weight_grad


def tuned_configs():
    """{kernel or "fp8w": [(label, tokamax Mosaic GPU config)]}: the configs that won tokamax's own H100
    autotuning (its data/autotuning cache) at the nearest shapes: 128 x 64 tiles, K steps of 128, 4 stages,
    persistent, N fastest in bands of 4 (bands of 8 won about as often); the weight gradient's kernel (a grid
    per group) 2 or 4 stages. fp8w: its quantized kernel (two compute warpgroups), 3 stages to fit shared
    memory at 128 rows."""
    config, n = TK.mosaic.Config, TK.mosaic.common.MatmulDimension.N
    tile = {"block_m": 128, "block_n": 64, "block_k": 128, "split_k": 1}
    rows = [("128x64x128 s4 N/4", config(**tile, num_stages=4, persistent=True, grid_minor_dim=n, grid_tile_width=4))]
    return {
        "forward": rows,
        "input_grad": rows,
        "weight_grad": [(f"128x64x128 s{st}", config(**tile, num_stages=st)) for st in (4, 2)],
        "fp8w": [
            ("128x64x128 s3 N/4", config(**tile, num_stages=3, persistent=True, grid_minor_dim=n, grid_tile_width=4))
        ],
    }


def tokamax_call(t, kernel, a, b, sizes, b_transposed=False):
    """One tokamax kernel: forward a @ b[g] (b [G, K, N] or its QArray); input_grad a @ b[g]^T (b [G, K, N]),
    or a @ b[g] where b_transposed (b: w^T [G, N, K] or its QArray); weight_grad dw[g] = a_g^T b_g."""
    config = t.configs[KERNELS.index(kernel)] if t.configs else None
    impl = [TK.mosaic.PallasMosaicGpuRaggedDot(config=config)] if config else t.implementation
    if kernel == "weight_grad":
        return TK.tokamax.ragged_dot_general(
            a, b, sizes, TK.base.RAGGED_CONTRACTING_DOT_DIM_NUMS, preferred_element_type=a.dtype, implementation=impl
        )
    if kernel == "input_grad" and not b_transposed:
        return TK.tokamax.ragged_dot_general(a, b, sizes, TK.base.TRANS_RHS_RAGGED_DOT_DIM_NUMS, implementation=impl)
    return TK.tokamax.ragged_dot(a, b, sizes, implementation=impl)


def tokamax_matmul(t, x, w, sizes, w8):
    """grouped_matmul's maths through tokamax: w8 None (bf16) or tokamax_fp8_copies(w)."""
    if w8 is None and t.configs is None:
        y = TK.tokamax.ragged_dot(x, w, sizes, implementation=t.implementation)  # tokamax's own VJP
    else:
        y = _tokamax_matmul(t, x, w, w8, sizes)
    if t.tail:  # rows past the groups: 0, and no gradient
        y = jnp.where((jnp.arange(y.shape[0]) < jnp.sum(sizes))[:, None], y, jnp.zeros((), y.dtype))
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tokamax_matmul(t, x, w, w8, sizes):
    """y = x @ w[g] by tokamax_call's kernels (with t's configs), dx and dw as tokamax's own VJP computes
    them; with w8 (QArrays of w and w^T) y and dx from the FP8 weights (rows in float16 where t.f16_rows).
    w types dw."""
    rows = (lambda a: a.astype(jnp.float16)) if t.f16_rows else (lambda a: a)
    return tokamax_call(t, "forward", rows(x), w if w8 is None else w8[0], sizes).astype(x.dtype)


def _tokamax_matmul_fwd(t, x, w, w8, sizes):
    return _tokamax_matmul(t, x, w, w8, sizes), (x, w, w8, sizes)


def _tokamax_matmul_bwd(t, residuals, dy):
    x, w, w8, sizes = residuals
    rows = (lambda a: a.astype(jnp.float16)) if t.f16_rows else (lambda a: a)
    dx = tokamax_call(t, "input_grad", rows(dy), w if w8 is None else w8[1], sizes, b_transposed=w8 is not None)
    return dx.astype(x.dtype), tokamax_call(t, "weight_grad", x, dy, sizes), None, None


_tokamax_matmul.defvjp(_tokamax_matmul_fwd, _tokamax_matmul_bwd)


def tokamax_fp8_copies(w, scale_dtype):
    """tokamax's FP8 weights for y = x @ w[g] and dx = dy @ w[g]^T: QArrays of w [G, K, N] and w^T [G, N, K],
    float8_e4m3fn with one scale per output channel, in the rows' dtype (tokamax's sm90 kernel converts the
    FP8 values to the scales' dtype for bf16/f16 WGMMAs). Once per optimizer step, as fp8_weights."""
    quantize = functools.partial(
        TK.qwix.quantize, qtype=jnp.float8_e4m3fn, channelwise_axes=(0, 2), scale_dtype=scale_dtype
    )
    return quantize(w), quantize(jnp.swapaxes(w, 1, 2))


def fp8w_rows_dtype(platform):
    """The rows' dtype for tokamax's fp8w kernel here: bf16, but float16 on a GPU whose ptxas is older than
    PTX ISA 9.2, where Mosaic GPU converts float8_e4m3fn to float16 only (tokamax's sm90 kernel then fails
    on bf16: "Hardware has no support for converting from f8E4M3FN to bf16")."""
    if platform != "gpu":
        return jnp.dtype(jnp.bfloat16)
    try:
        from jax._src.lib import mosaic_gpu

        isa = mosaic_gpu._mosaic_gpu_ext._get_ptxas_isa_version()
    except Exception:  # noqa: BLE001  (no Mosaic GPU bindings: the kernel says why when it runs)
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(jnp.bfloat16 if isa >= 92 else jnp.float16)


def tokamax_variants(kernel, platform, tail=False):
    """The tokamax candidates for `kernel` (KERNELS, "swiglu" or "fp8w"), as Tokamax. The first: tokamax's
    default config; on a GPU through implementation="mosaic", not None, whose fallback after the Mosaic GPU
    kernels is XLA's ragged_dot: a dense dot over all groups on GPUs (G times the work)."""
    gpu = platform == "gpu"
    fp8 = kernel == "fp8w"
    f16 = fp8 and fp8w_rows_dtype(platform) == jnp.float16
    found = [
        Tokamax(
            f"tokamax {'mosaic' if gpu else 'default'}{' fp8w' if fp8 else ''}{' f16 rows' if f16 else ''}",
            "mosaic" if gpu else None,
            (None,) * 3 if fp8 else None,
            f16_rows=f16,
        )
    ]
    if gpu and TK.mosaic is not None and gg.is_hopper_gpu():
        tuned = tuned_configs()
        if kernel in KERNELS:
            i = KERNELS.index(kernel)
            for label, config in tuned[kernel]:
                found.append(
                    Tokamax(f"tokamax mosaic {label}", "mosaic", tuple(config if j == i else None for j in range(3)))
                )
            if kernel == "input_grad":
                found.append(dataclasses.replace(found[-1], name=found[-1].name + ", w^T given", w_t=True))
        else:
            forward = tuned["fp8w" if fp8 else "forward"][0][1]
            found.append(
                Tokamax(
                    f"tokamax mosaic {'fp8w ' if fp8 else ''}tuned{' f16 rows' if f16 else ''}",
                    "mosaic",
                    (forward, forward, tuned["weight_grad"][0][1]),
                    f16_rows=f16,
                )
            )
    if gpu and "triton" in TK.api.IMPLEMENTATIONS and not fp8:
        found.append(Tokamax("tokamax triton", "triton"))
    if not gpu:
        found.append(Tokamax(f"tokamax xla{' fp8w' if fp8 else ''}", "xla", (None,) * 3 if fp8 else None))
    return [dataclasses.replace(t, tail=tail) for t in found]


# --compare-shapes ----------------------------------------------------------------

BF16_TOL, FP8_TOL = 2e-2, 0.25  # max error of the largest value against ours' bf16 output: wrong maths gives ~1


def pair_rows(num_rows, sizes, counts):
    """bool [num_rows]: the rows that hold a routed pair (each group's first counts[g] rows)."""
    keep = np.zeros(num_rows, bool)
    for start, count in zip(np.concatenate([[0], np.cumsum(sizes)[:-1]]), counts):
        keep[start : start + count] = True
    return keep


class Reference:
    """Ours' output (a pytree; cut: the part compared), kept by keep and compared by error (max error of the
    largest value over its arrays; NaN without a reference)."""

    def __init__(self, cut=lambda out: out):
        self.cut, self.out = cut, None

    def keep(self, out):
        self.out = self.cut(out)  # returns None: the row says "reference"

    def error(self, out):
        if self.out is None:
            return float("nan")
        return max(
            float(relative_error(g, w)) for g, w in zip(jax.tree.leaves(self.cut(out)), jax.tree.leaves(self.out))
        )


def compare_shapes(args, env, ours, save):
    """--compare-shapes (module docstring): ours (impl `ours`) against tokamax at each load of
    args.compare_ranks; prints every timing, then the table, and save(the JSON's dict) after each load."""
    start, platform = time.perf_counter(), env["platform"]
    results, table, loads = [], [], []
    rows_dtype = fp8w_rows_dtype(platform)
    print(
        f"# {env['devices'][0]}, jax {env['jax']}, tokamax {TK.tokamax.__version__} (ragged_dot implementations "
        f"{sorted(TK.api.IMPLEMENTATIONS)}); ours: {ours}, aligned_groups={args.align % gg.aligned_rows() == 0}; "
        f"chains of {args.chain} and {2 * args.chain} steps, {args.repeats} repeats; FP8 quantizations: "
        f"{_native.unavailable_reason() or 'the extension kernels'}; tokamax fp8w rows: {rows_dtype.name}"
        f"\n# {TOKAMAX_FP8}"
    )

    def over():
        return bool(args.budget_s) and time.perf_counter() - start > args.budget_s

    def measure(load, case, name, run, run_args, work, check=None, tol=BF16_TOL):
        """One timing: its results row (ok: it counts for the table), or None (skipped or failed)."""
        if over():
            print(f"| {name} | {case} | skipped: past --budget-s {args.budget_s:g} |", flush=True)
            results.append({"load": load, "case": case, "impl": name, "skipped": "time budget"})
            return None
        try:
            seconds, error = looped_seconds(run, run_args, args.chain, args.repeats, check)
        except Exception as e:  # noqa: BLE001  (a kernel that does not take these shapes: no candidate)
            print(
                f"| {name} | {case} | fails: {type(e).__name__}: {str(e).strip().splitlines()[0][:160]} |", flush=True
            )
            results.append({"load": load, "case": case, "impl": name, "failed": f"{type(e).__name__}: {e}"[:2000]})
            return None
        error = error if check else "its forward's"
        report(
            results, name, case, seconds, work, load=load, error=error, ok=not isinstance(error, float) or error <= tol
        )
        return results[-1]

    def summarize(load, case, mine, theirs):
        fastest = lambda rows: min((r for r in rows if r and r["ok"]), key=lambda r: r["ms_median"], default=None)
        table.append({"load": load, "case": case, "ours": fastest(mine), "tokamax": fastest(theirs)})

    for ranks in args.compare_ranks:
        if over():
            print(f"\n# {ranks} ranks: skipped, past --budget-s {args.budget_s:g}")
            continue
        loads.append(compare_load(args, platform, ours, ranks, rows_dtype, measure, summarize, over))
        print("\n" + table_text(table), flush=True)
        save({"env": env, "args": vars(args), "loads": loads, "results": results, "table": table})
    print(f"# {time.perf_counter() - start:.0f} s in all")


def compare_load(args, platform, ours, ranks, rows_dtype, measure, summarize, over):
    """compare_shapes at one load: this rank's experts of `ranks`. Returns the load's description. over():
    past the time budget (then no FP8 copies are made: their timings would be skipped)."""
    counts, sizes = routed_group_sizes(
        np.random.default_rng(args.seed), args.tokens, ranks, args.experts, args.topk, args.align
    )
    total, pairs = int(sizes.sum()), int(counts.sum())
    num_rows, blocks = -(-total // 128) * 128, gg.DEFAULT_BLOCKS
    aligned, tail = args.align % gg.aligned_rows() == 0, num_rows > total
    load = f"{ranks} ranks ({len(sizes)} experts)"
    flops = 2 * pairs * args.hidden * 2 * args.ffn + 2 * pairs * args.ffn * args.hidden
    x, w_in, w_out, dy = make_inputs(jax.random.key(args.seed), num_rows, counts, sizes, args.hidden, args.ffn)
    sizes_dev, valid = jnp.asarray(sizes), jnp.asarray(counts)
    print(
        f"\n## {load}: {pairs} pairs in {len(sizes)} groups (sizes {sizes.min()}-{sizes.max()}, align "
        f"{args.align}), M = {num_rows}\n\n| impl | pass | ms median | ms p10-p90 | useful TFLOP/s | "
        "max error |\n|---|---|---|---|---|---|",
        flush=True,
    )

    # 1. Each kernel alone, bf16 (both matmuls of the SwiGLU), ours' output the reference.
    best = [(np.inf, None)] * 3  # per kernel: tokamax Mosaic's fastest (ms, config; None: its default config)
    for i, kernel in enumerate(KERNELS):
        operands = kernel_operands(
            jax.random.key(args.seed + 1), kernel, num_rows, sizes_dev, w_in, w_out, pair_rows(num_rows, sizes, counts)
        )
        # The weight gradient whole; y and dx on the groups' rows (tokamax leaves the rest unwritten).
        ref = Reference(
            (lambda outs: outs)
            if kernel == "weight_grad"
            else functools.partial(lambda total, outs: [o[:total] for o in outs], total)
        )
        case = f"bf16 {kernel.replace('_', ' ')}"
        mine = measure(
            load,
            case,
            ours,
            kernel_looped(kernel_call(kernel, blocks, ours, aligned, valid)),
            (operands,),
            flops,
            ref.keep,
        )
        theirs = []
        for t in tokamax_variants(kernel, platform):
            ops = [(a, jnp.swapaxes(b, 1, 2), s) for a, b, s in operands] if t.w_t else operands
            row = measure(load, case, t.name, kernel_looped(kernel_call(kernel, blocks, t)), (ops,), flops, ref.error)
            del ops
            theirs.append(row)
            if (
                row
                and row["ok"]
                and not t.w_t
                and t.implementation in (None, "mosaic")
                and row["ms_median"] < best[i][0]
            ):
                best[i] = (row["ms_median"], t.configs[i] if t.configs else None)
        summarize(load, case, [mine], theirs)
        del operands, ref

    # 2. The SwiGLU, forward and forward + backward: bf16, then FP8; ours' bf16 output the reference.
    ref = Reference()
    weights = (w_in, w_out, sizes_dev, valid)

    def swiglu_rows(name, impl, fp8, precision, check=ref.error, same_forward=()):
        """(forward row, forward + backward row); the latter counts only where the former checked.
        same_forward: (another impl's forward row,) standing for this one's (the same forward maths), which
        is then not timed again (its forward row: None)."""
        tol = BF16_TOL if precision == "bf16" else FP8_TOL
        fwd = (
            same_forward[0]
            if same_forward
            else measure(
                load,
                f"{precision} SwiGLU forward",
                name,
                swiglu_looped(impl, blocks, aligned, False),
                ((x, dy), *weights, fp8),
                flops,
                check,
                tol,
            )
        )
        both = measure(
            load,
            f"{precision} SwiGLU forward+backward",
            name,
            swiglu_looped(impl, blocks, aligned, True),
            ((x, dy), *weights, fp8),
            3 * flops,
        )
        if both and not (fwd and fwd["ok"]):
            both["ok"] = False
        return (None if same_forward else fwd), both

    rows = {"ours bf16": [swiglu_rows(ours, ours, None, "bf16", ref.keep)]}
    tuned = tuple(config for _, config in best)
    tk_bf16 = [t for t in tokamax_variants("swiglu", platform, tail) if t.configs is None]  # not the fixed tuned
    if any(tuned):
        tk_bf16.insert(1, Tokamax("tokamax mosaic, the kernels' best configs", "mosaic", tuned, tail=tail))
    rows["tokamax bf16"] = [swiglu_rows(t.name, t, None, "bf16") for t in tk_bf16]
    w8 = None if over() else jax.jit(lambda w_in, w_out: (gg.fp8_weights(w_in), gg.fp8_weights(w_out)))(w_in, w_out)
    rows["ours fp8"] = [swiglu_rows(f"{ours} fp8", ours, w8, "FP8")]
    w8 = w8 and tuple(dataclasses.replace(w, weight_grad=True) for w in w8)  # the same copies, the FP8 dw too
    rows["ours fp8"].append(swiglu_rows(f"{ours} fp8 dw", ours, w8, "FP8", same_forward=(rows["ours fp8"][0][0],)))
    del w8
    q8 = (
        None
        if over()
        else jax.jit(lambda w_in, w_out: (tokamax_fp8_copies(w_in, rows_dtype), tokamax_fp8_copies(w_out, rows_dtype)))(
            w_in, w_out
        )
    )
    rows["tokamax fp8w"] = [  # tuned: with the weight gradient's best config of 1
        swiglu_rows(
            t.name,
            dataclasses.replace(t, configs=(*t.configs[:2], tuned[2] or t.configs[2])) if t.configs[0] else t,
            q8,
            "FP8",
        )
        for t in tokamax_variants("fp8w", platform, tail)
    ]
    del q8
    for j, op in enumerate(("SwiGLU forward", "SwiGLU forward+backward")):
        summarize(load, f"bf16 {op}", [r[j] for r in rows["ours bf16"]], [r[j] for r in rows["tokamax bf16"]])
    for j, op in enumerate(("SwiGLU forward", "SwiGLU forward+backward")):  # tokamax's bf16 path counts too
        summarize(
            load,
            f"FP8 {op}",
            [r[j] for r in rows["ours fp8"]],
            [r[j] for r in rows["tokamax fp8w"]]
            + [r[j] and {**r[j], "impl": f"{r[j]['impl']} (bf16)"} for r in rows["tokamax bf16"]],
        )
    return {"load": load, "pairs": pairs, "rows": num_rows, "sizes": sizes.tolist()}


def table_text(table):
    """The comparison in markdown: one row per case, the fastest of ours and of tokamax's candidates whose
    output checked."""
    ms = lambda r: f"{r['impl']}: {r['ms_median']:.3f} ({r['ms_p10']:.3f}-{r['ms_p90']:.3f})" if r else "none"
    lines = [
        "| case | ours: impl, ms median (p10-p90) | tokamax best: impl, ms median (p10-p90) | tokamax / ours |",
        "|---|---|---|---|",
    ]
    for row in table:
        ours, theirs = row["ours"], row["tokamax"]
        ratio = f"{theirs['ms_median'] / ours['ms_median']:.2f}" if ours and theirs else "n/a"
        lines.append(f"| {row['load']}, {row['case']} | {ms(ours)} | {ms(theirs)} | {ratio} |")
    return "\n".join(lines) + "\n\ntokamax / ours >= 1.10: ours at least 10% faster.\n"


# Main ---------------------------------------------------------------------------


def use_triton_ragged_dot():
    """Lowers jax.lax.ragged_dot to JAX's Pallas-Triton grouped matmul; False where it is missing."""
    try:
        from jax._src.lax.pallas_lowerings.gpu import ragged_dot  # noqa: F401
    except ImportError:
        return False
    jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument(
        "--align",
        type=int,
        default=None,
        help="round each group up to this many rows (default 1; with --compare-shapes 128)",
    )
    p.add_argument("--rows", type=int, default=0, help="static M (default: the aligned sum rounded up to 128)")
    p.add_argument(
        "--no-valid-sizes",
        action="store_true",
        help="leave grouped_matmul's valid_sizes unset (the weight gradient then computes the padding rows)",
    )
    p.add_argument("--impls", default="mgpu,xla", help="comma list of mgpu, xla, tokamax")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="also time each impl with fp8_weights (FP8 forward and input gradient; mgpu needs --align "
        "128), the weights' FP8 copies made outside the step; and the making of them",
    )
    p.add_argument(
        "--fp8-weight-grad",
        action="store_true",
        help="with --fp8, also each impl with fp8_weights(w, weight_grad=True) (FP8 weight gradient too)",
    )
    p.add_argument("--sweep", action="store_true", help="first sweep the Mosaic kernels' block sizes")
    p.add_argument(
        "--sweep-kernels",
        default=",".join(SWEEP_GRIDS),
        help="with --sweep, a comma list of the kernels to sweep (the others keep DEFAULT_BLOCKS)",
    )
    p.add_argument(
        "--compare-shapes",
        action="store_true",
        help="ours against tokamax at the MoE layer's loads (see above); --ranks, --rows, --fp8*, --sweep "
        "and --profile do not apply",
    )
    p.add_argument("--compare-ranks", default="2,8", help="with --compare-shapes, a comma list of rank counts")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="with --compare-shapes, start no timing past this many seconds (default 330; 0: no limit)",
    )
    p.add_argument(
        "--chain",
        type=int,
        default=None,
        help="steps per timed program (and twice that); default 5, with --compare-shapes 3",
    )
    p.add_argument("--repeats", type=int, default=None, help="default 10; with --compare-shapes 5")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile",
        action="store_true",
        help="also print where a forward+backward step's device time goes, kernel by kernel",
    )
    p.add_argument("--json", default="", help="write the results here (with --compare-shapes, the table too: .md)")
    args = p.parse_args(argv)
    compare = args.compare_shapes
    if args.align is None:
        args.align = gg.aligned_rows() if compare else 1
    args.repeats = (5 if compare else 10) if args.repeats is None else args.repeats
    args.budget_s = 330.0 if args.budget_s is None else args.budget_s
    args.chain = (3 if compare else 5) if args.chain is None else args.chain
    check_counts(p, args, "tokens", "ranks", "experts", "topk", "hidden", "ffn", "align", "chain", "repeats")
    known = OURS + ("tokamax",)
    if unknown := set(args.impls.split(",")) - set(known):
        p.error(f"--impls: {sorted(unknown)} not among {list(known)}")
    kernels = args.sweep_kernels.split(",")
    if unknown := set(kernels) - set(SWEEP_GRIDS):
        p.error(f"--sweep-kernels: {sorted(unknown)} not among {list(SWEEP_GRIDS)}")
    try:
        args.compare_ranks = [int(r) for r in args.compare_ranks.split(",")]
    except ValueError:
        p.error(f"--compare-ranks: {args.compare_ranks!r} is not a comma list of integers")
    if compare and any(r < 1 or args.experts % r for r in args.compare_ranks):
        p.error(f"--compare-ranks: each must divide --experts {args.experts}")
    if (compare or "tokamax" in args.impls.split(",")) and (why := import_tokamax()):
        p.error(why)

    start = time.perf_counter()
    env = environment()
    hopper = gg.is_hopper_gpu()
    impls = [i for i in args.impls.split(",") if i != "mgpu" or hopper]
    if "mgpu" in args.impls and not hopper:
        print("# no Hopper GPU here: impl=mgpu left out")
    if "xla" in impls and env["platform"] == "gpu" and not use_triton_ragged_dot():
        print("# no Pallas-Triton ragged_dot in this jax: impl=xla would be a dense dot over all groups; left out")
        impls.remove("xla")

    def save(data):
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(data, f, indent=1, default=str)

    if compare:
        ours = next((i for i in impls if i in OURS), None)
        if ours is None:
            p.error("--compare-shapes: none of --impls' mgpu, xla runs here")

        def save_table(data):
            save(data)
            if args.json:
                Path(args.json).with_suffix(".md").write_text(table_text(data["table"]))

        compare_shapes(args, env, ours, save_table)
        return

    counts, sizes = routed_group_sizes(
        np.random.default_rng(args.seed), args.tokens, args.ranks, args.experts, args.topk, args.align
    )
    num_rows = args.rows or -(-int(sizes.sum()) // 128) * 128
    if num_rows < sizes.sum():
        p.error(f"--rows {num_rows} < {int(sizes.sum())} rows of the aligned groups")
    pairs = int(counts.sum())
    x, w_in, w_out, dy = make_inputs(jax.random.key(args.seed), num_rows, counts, sizes, args.hidden, args.ffn)
    sizes_dev = jnp.asarray(sizes)
    # The MoE layer passes each group's pairs beside its aligned size; without alignment they are the same.
    valid = None if args.no_valid_sizes or args.align == 1 else jnp.asarray(counts)
    flops = 2 * pairs * args.hidden * 2 * args.ffn + 2 * pairs * args.ffn * args.hidden
    print(
        f"# {env['devices'][0]}, jax {env['jax']}; {pairs} pairs in {len(sizes)} groups (sizes "
        f"{sizes.min()}-{sizes.max()}, align {args.align}), M = {num_rows} rows; SwiGLU hidden {args.hidden}, "
        f"ffn {args.ffn}; chains of {args.chain} and {2 * args.chain} steps, {args.repeats} repeats"
    )

    blocks = gg.DEFAULT_BLOCKS
    # Groups of whole row tiles: promise it (the warp-specialized kernels, no lax.cond), as the MoE layer does.
    aligned = args.align % gg.aligned_rows() == 0
    print(f"# aligned_groups={aligned}, valid_sizes {'set' if valid is not None else 'unset'}")
    swept = {}
    if args.sweep and "mgpu" in impls:
        swept = sweep(jax.random.key(args.seed + 1), num_rows, sizes, w_in, w_out, args.repeats, kernels)
        blocks = dataclasses.replace(blocks, **swept)
        print(f"\n# best: {blocks}")

    results = []
    print("\n| impl | pass | ms median | ms p10-p90 | useful TFLOP/s |\n|---|---|---|---|---|")
    outputs = {}
    make_fp8 = jax.jit(lambda w_in, w_out: (gg.fp8_weights(w_in), gg.fp8_weights(w_out)))
    tail = num_rows > int(sizes.sum())
    tokamax = [t for t in tokamax_variants("swiglu", env["platform"], tail)] if "tokamax" in impls else []
    ours = [i for i in impls if i != "tokamax"]
    variants = [(i, i, None) for i in ours] + [(t.name, t, None) for t in tokamax]  # (name, impl, FP8 copies)
    if args.fp8:
        if "mgpu" in impls and not aligned:
            p.error(f"--fp8 with impl mgpu needs --align {gg.aligned_rows()}")
        w8 = make_fp8(w_in, w_out) if ours else None
        variants += [(f"{i} fp8", i, w8) for i in ours]
        if tokamax:
            print(f"# {TOKAMAX_FP8}")
            rows_dtype = fp8w_rows_dtype(env["platform"])
            q8 = jax.jit(
                lambda w_in, w_out: (tokamax_fp8_copies(w_in, rows_dtype), tokamax_fp8_copies(w_out, rows_dtype))
            )(w_in, w_out)
            variants += [(t.name, t, q8) for t in tokamax_variants("fp8w", env["platform"], tail)]
        if args.fp8_weight_grad and ours:
            w8 = tuple(dataclasses.replace(w, weight_grad=True) for w in w8)  # the same copies, FP8 dw too
            variants += [(f"{i} fp8 dw", i, w8) for i in ours]
    for name, impl, fp8 in variants:
        inputs = (x, dy, w_in, w_out, sizes_dev, valid, fp8)
        outputs[name] = jax.jit(swiglu, static_argnums=(5, 6, 7))(
            x, w_in, w_out, sizes_dev, valid, impl, blocks, aligned, fp8
        )
        for op, step, work in (
            ("forward", forward_step, flops),
            ("forward+backward", forward_backward_step, 3 * flops),
        ):
            seconds = time_step(step(impl, blocks, aligned), inputs, args.chain, args.repeats)
            report(results, name, op, seconds, work)
    if args.fp8 and ours:
        # Once per optimizer step, not per micro-batch: both weights' FP8 copies.
        jax.block_until_ready(make_fp8(w_in, w_out))
        seconds = []
        for _ in range(args.repeats):
            begin = time.perf_counter()
            jax.block_until_ready(make_fp8(w_in, w_out))
            seconds.append(time.perf_counter() - begin)
        report(results, "fp8_weights", "w_in and w_out", np.asarray(seconds), 0)
    if args.profile:
        for name, impl, fp8 in variants:
            print_kernel_breakdown(
                f"{name}, forward+backward",
                chain(forward_backward_step(impl, blocks, aligned), args.chain),
                (x, dy, w_in, w_out, sizes_dev, valid, fp8),
                args.chain,
            )
    reference = next((i for i in ("mgpu", "xla") if i in outputs), None)
    for name, out in outputs.items():
        if reference and name != reference:
            print(
                f"\n# {name} vs {reference} output: max error "
                f"{float(relative_error(out, outputs[reference])):.2e} of the largest value"
            )
    print(f"# {time.perf_counter() - start:.0f} s in all")
    save(
        {
            "env": env,
            "args": vars(args),
            "pairs": pairs,
            "rows": num_rows,
            "sizes": sizes.tolist(),
            "blocks": dataclasses.asdict(blocks),
            "swept": sorted(swept),
            "results": results,
        }
    )


if __name__ == "__main__":
    main()
