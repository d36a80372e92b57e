"""The expert-major row kernels (deep_ep_jax/backends/cuda/expert_major.py) against the same maths in XLA
(the reference backend), at one rank's shapes of the MoE benchmark: 4096 token rows of 7168, top-8 over
128 local experts, groups aligned to 128 rows.

    python benchmarks/bench_expert_major.py [--tokens 4096] [--experts 128] [--repeats 5]

Per case and backend: device time per call (from the first kernel's start to the last one's end, in a
profiled call right after a like one), median and min-max of --repeats calls, and the bandwidth that
time gives for the bytes the call must read and write (each gathered row counted at every use, as it
is read from L2 or memory); then whether the two backends agree bit for bit (NaN for NaN). Cases:
  expand bf16             the token rows [N, H] gathered into expert-major rows [R, H]
  expand fp8 rows         the FP8 rows and their per-block scales (the forward of FP8 rows)
  gather fp8 transposed   the FP8 rows gathered transposed, [H, R] (x^T of the FP8 weight gradient)
  gather quantized t      bf16 rows gathered transposed and quantized with a multiplier per row and an
                          inverse scale per column (z^T of grouped_matmul_reduce's weight gradient)
  reduce weighted         expert rows [R, H] summed per token with the pair weights
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import device_times, environment, same_bits

from deep_ep_jax import _native, fp8_quant
from deep_ep_jax.backends import reference_expert_major as xla_ops
from deep_ep_jax.backends.cuda import expert_major as cuda_ops
from deep_ep_jax.backends.cuda import lifecycle

ALIGNMENT = 128
FP8_BLOCK = 128


def routing(args):
    """top-k experts per token, distinct within a token, uniformly random; and the rows a layout needs:
    every group rounded up to the alignment, the total to a multiple of 128."""
    rng = np.random.default_rng(args.seed)
    idx = np.argsort(rng.random((args.tokens, args.experts)), axis=1)[:, : args.top_k].astype(np.int32)
    counts = np.bincount(idx.ravel(), minlength=args.experts)
    rows = int(np.sum(-(-counts // ALIGNMENT) * ALIGNMENT))
    return jnp.asarray(idx), -(-rows // 128) * 128


def cases(args, layout, num_rows):
    """[(name, {backend: function of the inputs}, inputs, bytes read and written)]."""
    keys = iter(jax.random.split(jax.random.key(args.seed), 8))
    n, h, k = args.tokens, args.hidden, args.top_k
    x = jax.random.normal(next(keys), (n, h), jnp.bfloat16)
    x8, x_scales = fp8_quant.quantize_rows(x)
    block_scales = jnp.broadcast_to(x_scales[:, None], (n, h // FP8_BLOCK))
    multipliers = jnp.exp(jax.random.normal(next(keys), (num_rows,))) * 1e-2
    inverse = jnp.exp(jax.random.normal(next(keys), (h,)))
    y = jax.random.normal(next(keys), (num_rows, h), jnp.bfloat16)
    weights = jax.random.uniform(next(keys), (n, k))
    pairs = int(jnp.sum(layout.pair_row >= 0))
    both = lambda name: {b: getattr(ops, name) for b, ops in (("cuda", cuda_ops), ("xla", xla_ops))}
    gather = lambda row_bytes: pairs * row_bytes + num_rows * row_bytes  # each used row read, every row written
    return [
        ("expand bf16", both("expand_rows"), ((x,), layout), gather(2 * h)),
        ("expand fp8 rows", both("expand_rows"), ((x8, block_scales), layout), gather(h + 4 * h // FP8_BLOCK)),
        ("gather fp8 transposed", both("expand_rows_transposed"), (x8, layout), gather(h)),
        (
            "gather quantized t",
            both("expand_rows_transposed"),
            (x, layout, multipliers, inverse),
            pairs * 2 * h + num_rows * h,
        ),
        ("reduce weighted", both("reduce_rows"), (y, weights, layout), pairs * 2 * h + n * 2 * h),
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="token rows (received rows) per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=128, help="local experts")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cases", default="", help="only the cases whose names contain one of these (comma-separated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.hidden % FP8_BLOCK:
        p.error(f"--hidden must be a multiple of {FP8_BLOCK}")
    if reason := _native.unavailable_reason():
        p.error(f"the CUDA kernels cannot run here, and this benchmark compares them: {reason}")
    lifecycle.register_ffi_targets()
    env = environment()
    print(f"# {env}")
    topk_idx, num_rows = routing(args)
    layout = jax.jit(
        lambda t: cuda_ops.expert_layout(t, num_local_experts=args.experts, alignment=ALIGNMENT, num_rows=num_rows)
    )(topk_idx)
    print(
        f"# {args.tokens} token rows of {args.hidden}, top-{args.top_k} over {args.experts} experts: "
        f"{num_rows} expert-major rows (groups aligned to {ALIGNMENT})"
    )
    wanted = [c for c in args.cases.split(",") if c]
    results = []
    print("\n| case | backend | ms median | ms min-max | GB/s |\n|---|---|---|---|---|")
    for name, fns, inputs, moved in cases(args, layout, num_rows):
        if wanted and not any(w in name for w in wanted):
            continue
        outputs = {}
        for backend, fn in fns.items():
            run = jax.jit(fn)
            outputs[backend] = jax.block_until_ready(run(*inputs))
            spans, _ = device_times(run, inputs, args.repeats)
            median = float(np.median(spans))
            print(
                f"| {name} | {backend} | {median * 1e3:.3f} | {spans.min() * 1e3:.3f}-{spans.max() * 1e3:.3f} | "
                f"{moved / median * 1e-9 if median else float('nan'):.0f} |",
                flush=True,
            )
            results.append(dict(case=name, backend=backend, seconds=spans.tolist(), bytes=moved))
        agree = same_bits(outputs["cuda"], outputs["xla"])
        print(f"| {name} | cuda and xla agree bit for bit: {agree} | | | |", flush=True)
        results.append(dict(case=name, agree=agree))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
