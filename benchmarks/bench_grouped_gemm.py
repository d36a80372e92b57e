"""Grouped GEMM of the experts on one GPU: one expert SwiGLU
(x [M, 7168] -> w_in [G, 7168, 4096] -> silu(gate) * up -> w_out [G, 2048, 7168])
through deep_ep_jax.grouped_matmul, forward and forward + backward, with the
Mosaic GPU kernels (impl="mgpu") beside jax.lax.ragged_dot (impl="xla", through
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
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on our hosts

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import chain_seconds, check_counts, environment, print_kernel_breakdown, touch

from deep_ep_jax.experts import grouped_gemm as gg


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
        pair_rows[start:start + count] = True
    x = jnp.where(pair_rows[:, None], jax.random.normal(kx, (num_rows, hidden), jnp.bfloat16), 0)
    w_in = jax.random.normal(ki, (len(sizes), hidden, 2 * ffn), jnp.bfloat16) * jnp.bfloat16(hidden**-0.5)
    w_out = jax.random.normal(ko, (len(sizes), ffn, hidden), jnp.bfloat16) * jnp.bfloat16(ffn**-0.5)
    dy = jax.random.normal(kd, (num_rows, hidden), jnp.bfloat16)
    return x, w_in, w_out, dy


def swiglu(x, w_in, w_out, sizes, valid, impl, blocks, aligned, fp8=None):
    """valid: the pairs of each group (grouped_matmul's valid_sizes), or None. fp8: the FP8 copies of
    (w_in, w_out), or None (bf16)."""
    kwargs = dict(impl=impl, block_sizes=blocks, aligned_groups=aligned, valid_sizes=valid)
    w_in8, w_out8 = fp8 or (None, None)
    h = gg.grouped_matmul(x, w_in, sizes, fp8_weights=w_in8, **kwargs)
    gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
    return gg.grouped_matmul((jax.nn.silu(gate) * up).astype(x.dtype), w_out, sizes, fp8_weights=w_out8, **kwargs)


def forward_step(impl, blocks, aligned):
    def step(x, dy, w_in, w_out, sizes, valid, fp8):
        out = lax.optimization_barrier(swiglu(x, w_in, w_out, sizes, valid, impl, blocks, aligned, fp8))
        return touch(x, out[:1, :1]), dy
    return step


def forward_backward_step(impl, blocks, aligned):
    def step(x, dy, w_in, w_out, sizes, valid, fp8):
        out, vjp = jax.vjp(lambda x, w_in, w_out: swiglu(x, w_in, w_out, sizes, valid, impl, blocks, aligned, fp8),
                           x, w_in, w_out)
        out, dx, dw_in, dw_out = lax.optimization_barrier((out, *vjp(dy)))
        link = out[:1, :1] + dx[:1, :1] + dw_in[0, :1, :1] + dw_out[0, :1, :1]
        # dy changes too: else XLA could hoist dy @ w_out^T out of the loop.
        return touch(x, link), touch(dy, link)
    return step


def report(results, impl, op, seconds, work):
    """Add a row of timings (seconds per step) to results and print it."""
    p10, p50, p90 = np.percentile(seconds, [10, 50, 90])
    results.append({"impl": impl, "op": op, "ms_median": p50 * 1e3, "ms_p10": p10 * 1e3, "ms_p90": p90 * 1e3,
                    "tflops": work / p50 / 1e12, "samples_ms": (seconds * 1e3).tolist()})
    tflops = f"{work / p50 / 1e12:.1f}" if work else ""
    print(f"| {impl} | {op} | {p50 * 1e3:.3f} | {p10 * 1e3:.3f}-{p90 * 1e3:.3f} | {tflops} |", flush=True)


def chain(step, length):
    """One jitted program of `length` steps, each on the previous one's x and dy."""
    def run(x, dy, *weights):
        x, _ = lax.fori_loop(0, length, lambda _, carry: step(*carry, *weights), (x, dy))
        return x[:1, :1]
    return jax.jit(run)


def time_step(step, inputs, length, repeats):
    return chain_seconds(chain(step, length), chain(step, 2 * length), inputs, length, repeats)


# Block-size sweep ---------------------------------------------------------------

# (block_m, block_n, max_concurrent_steps, grid_block_n) of ragged_dot_mgpu; block_n must divide both matmuls'
# N (4096 and 7168). Up to jax 0.11: around the best of a first, wider sweep on the H200 (64, 256, 5, 1).
# From jax 0.12, which lowers tiles at most 128 wide (gg.ROW_TILED_MAX_BLOCK_N): those tiles' depths and grids.
if gg.ROW_TILED_MAX_BLOCK_N >= 256:
    ROW_TILED = [(64, 256, 5, 1), (64, 256, 6, 1), (64, 256, 4, 1), (128, 256, 4, 1), (128, 256, 3, 1),
                 (192, 128, 4, 1), (64, 256, 5, 2), (128, 128, 6, 8), (128, 128, 5, 8), (64, 128, 6, 1)]
else:
    ROW_TILED = [(64, 128, 6, 1), (64, 128, 6, 2), (64, 128, 6, 8), (128, 128, 4, 2), (128, 128, 4, 8),
                 (128, 128, 5, 8), (128, 128, 6, 8), (128, 128, 5, 4), (128, 128, 5, 16), (128, 128, 4, 16)]
SWEEP_GRIDS = {
    "forward": [gg.KernelBlocks(m, n, 64, steps, gbn) for m, n, steps, gbn in ROW_TILED],
    "input_grad": [gg.KernelBlocks(m, n, 64, steps, gbn) for m, n, steps, gbn in ROW_TILED],
    "weight_grad": [gg.KernelBlocks(m, n, k, steps, 4) for (m, n), k, steps
                    in itertools.product([(128, 128), (64, 128)], (64, 128), (2, 4))],
}


def kernel_call(kernel, blocks, impl):
    """fn([(a, b, sizes)] of both matmuls) -> [one kernel's output of each]: a is the
    [M, *] operand the loop carries (x, or dy for the input gradient)."""
    use_mgpu, unit = impl == "mgpu", jnp.ones((1,), jnp.float32)  # every row valid; scale 1
    one = {"forward": lambda x, w, sizes: gg._forward(use_mgpu, blocks, False, x, w, sizes, sizes, unit),
           "input_grad": lambda dy, w, sizes: gg._input_grad(use_mgpu, blocks, False, dy, w, sizes, sizes, unit),
           "weight_grad": lambda x, dy, sizes: gg._weight_grad(use_mgpu, blocks, False, x, dy, sizes, sizes,
                                                               unit)}[kernel]
    return lambda operands: [one(*ops) for ops in operands]


def kernel_operands(key, kernel, num_rows, sizes, w_in, w_out):
    """[(a, b, sizes)] of `kernel` for the SwiGLU's two matmuls, rows padded to 128 as the wrapper does."""
    rows = -(-num_rows // 128) * 128
    (_, hidden, ffn2), ffn = w_in.shape, w_out.shape[1]
    k1, k2, k3, k4 = jax.random.split(key, 4)
    x1, dy1 = jax.random.normal(k1, (rows, hidden), jnp.bfloat16), jax.random.normal(k2, (rows, ffn2), jnp.bfloat16)
    x2, dy2 = jax.random.normal(k3, (rows, ffn), jnp.bfloat16), jax.random.normal(k4, (rows, hidden), jnp.bfloat16)
    if kernel == "forward":
        return [(x1, w_in, sizes), (x2, w_out, sizes)]
    if kernel == "input_grad":
        return [(dy1, w_in, sizes), (dy2, w_out, sizes)]
    return [(x1, dy1, sizes), (x2, dy2, sizes)]


def loop_seconds(fn, operands, length, repeats):
    """(seconds per call of fn, fn(operands)) from one jitted program: fn once on the
    operands, then a loop of `length` calls, each on the previous one's output
    (the ~0.3 ms host cost of a call is a few % of calls of milliseconds each:
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
    p.add_argument("--align", type=int, default=1, help="round each group up to this many rows")
    p.add_argument("--rows", type=int, default=0, help="static M (default: the aligned sum rounded up to 128)")
    p.add_argument("--no-valid-sizes", action="store_true",
                   help="leave grouped_matmul's valid_sizes unset (the weight gradient then computes the padding rows)")
    p.add_argument("--impls", default="mgpu,xla", help="comma list of mgpu, xla")
    p.add_argument("--fp8", action="store_true",
                   help="also time each impl with fp8_weights (FP8 forward and input gradient; mgpu needs --align "
                        "128), the weights' FP8 copies made outside the step; and the making of them")
    p.add_argument("--fp8-weight-grad", action="store_true",
                   help="with --fp8, also each impl with fp8_weights(w, weight_grad=True) (FP8 weight gradient too)")
    p.add_argument("--sweep", action="store_true", help="first sweep the Mosaic kernels' block sizes")
    p.add_argument("--sweep-kernels", default=",".join(SWEEP_GRIDS),
                   help="with --sweep, a comma list of the kernels to sweep (the others keep DEFAULT_BLOCKS)")
    p.add_argument("--chain", type=int, default=5, help="steps per timed program (and twice that)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="also print where a forward+backward step's device time goes, kernel by kernel")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)
    check_counts(p, args, "tokens", "ranks", "experts", "topk", "hidden", "ffn", "align", "chain", "repeats")
    if unknown := set(args.impls.split(",")) - set(gg.IMPLS[1:]):  # grouped_matmul's impls but "auto"
        p.error(f"--impls: {sorted(unknown)} not among {list(gg.IMPLS[1:])}")
    kernels = args.sweep_kernels.split(",")
    if unknown := set(kernels) - set(SWEEP_GRIDS):
        p.error(f"--sweep-kernels: {sorted(unknown)} not among {list(SWEEP_GRIDS)}")

    start = time.perf_counter()
    env = environment()
    hopper = gg.is_hopper_gpu()
    impls = [i for i in args.impls.split(",") if i != "mgpu" or hopper]
    if "mgpu" in args.impls and not hopper:
        print("# no Hopper GPU here: impl=mgpu left out")
    if "xla" in impls and env["platform"] == "gpu" and not use_triton_ragged_dot():
        print("# no Pallas-Triton ragged_dot in this jax: impl=xla would be a dense dot over all groups; left out")
        impls.remove("xla")

    counts, sizes = routed_group_sizes(np.random.default_rng(args.seed), args.tokens, args.ranks, args.experts,
                                       args.topk, args.align)
    num_rows = args.rows or -(-int(sizes.sum()) // 128) * 128
    if num_rows < sizes.sum():
        p.error(f"--rows {num_rows} < {int(sizes.sum())} rows of the aligned groups")
    pairs = int(counts.sum())
    x, w_in, w_out, dy = make_inputs(jax.random.key(args.seed), num_rows, counts, sizes, args.hidden, args.ffn)
    sizes_dev = jnp.asarray(sizes)
    # The MoE layer passes each group's pairs beside its aligned size; without alignment they are the same.
    valid = None if args.no_valid_sizes or args.align == 1 else jnp.asarray(counts)
    flops = 2 * pairs * args.hidden * 2 * args.ffn + 2 * pairs * args.ffn * args.hidden
    print(f"# {env['devices'][0]}, jax {env['jax']}; {pairs} pairs in {len(sizes)} groups (sizes "
          f"{sizes.min()}-{sizes.max()}, align {args.align}), M = {num_rows} rows; SwiGLU hidden {args.hidden}, "
          f"ffn {args.ffn}; chains of {args.chain} and {2 * args.chain} steps, {args.repeats} repeats")

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
    make_fp8 = jax.jit(lambda w_in, w_out, weight_grad=False: (gg.fp8_weights(w_in, weight_grad=weight_grad),
                                                                gg.fp8_weights(w_out, weight_grad=weight_grad)),
                       static_argnames="weight_grad")
    variants = [(impl, None) for impl in impls]
    if args.fp8:
        if "mgpu" in impls and not aligned:
            p.error(f"--fp8 with impl mgpu needs --align {gg.aligned_rows()}")
        variants += [(f"{impl} fp8", make_fp8(w_in, w_out)) for impl in impls]
        if args.fp8_weight_grad:
            variants += [(f"{impl} fp8 dw", make_fp8(w_in, w_out, weight_grad=True)) for impl in impls]
    for name, fp8 in variants:
        impl = name.split()[0]
        inputs = (x, dy, w_in, w_out, sizes_dev, valid, fp8)
        outputs[name] = jax.jit(swiglu, static_argnums=(5, 6, 7))(x, w_in, w_out, sizes_dev, valid, impl, blocks,
                                                                  aligned, fp8)
        for op, step, work in (("forward", forward_step, flops), ("forward+backward", forward_backward_step,
                                                                   3 * flops)):
            seconds = time_step(step(impl, blocks, aligned), inputs, args.chain, args.repeats)
            report(results, name, op, seconds, work)
    if args.fp8:
        # Once per optimizer step, not per micro-batch: both weights' FP8 copies.
        jax.block_until_ready(make_fp8(w_in, w_out))
        seconds = []
        for _ in range(args.repeats):
            begin = time.perf_counter()
            jax.block_until_ready(make_fp8(w_in, w_out))
            seconds.append(time.perf_counter() - begin)
        report(results, "fp8_weights", "w_in and w_out", np.asarray(seconds), 0)
    if args.profile:
        for name, fp8 in variants:
            print_kernel_breakdown(f"{name}, forward+backward",
                                   chain(forward_backward_step(name.split()[0], blocks, aligned), args.chain),
                                   (x, dy, w_in, w_out, sizes_dev, valid, fp8), args.chain)
    for name in ("xla", "mgpu fp8", "mgpu fp8 dw"):
        if name in outputs and "mgpu" in outputs:
            print(f"\n# {name} vs mgpu output: max error {float(relative_error(outputs[name], outputs['mgpu'])):.2e} "
                  "of the largest value")
    print(f"# {time.perf_counter() - start:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "args": vars(args), "pairs": pairs, "rows": num_rows, "sizes": sizes.tolist(),
                       "blocks": dataclasses.asdict(blocks), "swept": sorted(swept), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
