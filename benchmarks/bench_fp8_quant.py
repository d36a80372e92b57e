"""FP8 quantization of the grouped GEMM's operands: the extension's CUDA kernels of deep_ep_jax.fp8_quant
against the same maths in XLA, at one rank's shapes of the MoE benchmark (H = --hidden 7168, F = --ffn 2048).

    python benchmarks/bench_fp8_quant.py [--experts 128] [--rows 40704] [--repeats 5] [--cases a,b]

Per case and impl: device time per call (from the first kernel's start to the last one's end, in a
profiled call right after a like one), median and min-max of --repeats calls, and the bandwidth that
time gives for the bytes a call must move (its input read once, its outputs written once); then
whether each impl's outputs agree with the first's bit for bit (NaN for NaN). Cases:
  fp8_weights(w_in), fp8_weights(w_out)     quantize_rows_and_columns of [E, H, 2F], [E, F, H]
  rows x, rows h                            quantize_rows of [rows, H], [rows, F]
  swiglu h                                  quantize_rows(gate_up [rows, 2F], swiglu=True): the
                                            SwiGLU's hidden rows
  swiglu h unfused                          the same as XLA's SwiGLU (bf16 rows written), then
                                            quantize_rows of them
  backward dy_out, backward dy_in           quantize_rows_and_columns of dy [1, rows, H] and
                                            [1, rows, 2F] with x's row scales (the FP8 weight gradient)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import device_times, environment, same_bits

from deep_ep_jax import _native, fp8_quant

HIDDEN, FFN = 7168, 2048  # DeepSeek-V3's


def cases(args):
    """[(name, function of (a, m) and impl, a, m or None)]."""
    keys = (jax.random.fold_in(jax.random.key(args.seed), i) for i in itertools.count())

    def normal(shape):
        # Rows and columns of different magnitudes, as weights and activations have.
        scale = jnp.exp(jax.random.normal(next(keys), shape[:-1] + (1,))) * jnp.exp(
            jax.random.normal(next(keys), shape[-1:])
        )
        return (jax.random.normal(next(keys), shape, jnp.bfloat16) * scale).astype(jnp.bfloat16)

    both = lambda a, m, impl: fp8_quant.quantize_rows_and_columns(a, m, backend=impl)
    rows = lambda a, m, impl: fp8_quant.quantize_rows(a, backend=impl)
    swiglu = lambda a, m, impl: fp8_quant.quantize_rows(a, swiglu=True, backend=impl)
    # The barrier: XLA's SwiGLU writes its bf16 rows, as before the fused kernel.
    unfused = lambda a, m, impl: fp8_quant.quantize_rows(
        lax.optimization_barrier(fp8_quant.swiglu_values(a)), backend=impl
    )
    e, r = args.experts, args.rows
    h, f = args.hidden, args.ffn
    x_scales = jnp.exp(jax.random.normal(next(keys), (1, r))) * 1e-2
    return [
        ("fp8_weights(w_in)", both, lambda: normal((e, h, 2 * f)), None),
        ("fp8_weights(w_out)", both, lambda: normal((e, f, h)), None),
        ("rows x", rows, lambda: normal((r, h)), None),
        ("rows h", rows, lambda: normal((r, f)), None),
        ("swiglu h", swiglu, lambda: normal((r, 2 * f)), None),
        ("swiglu h unfused", unfused, lambda: normal((r, 2 * f)), None),
        ("backward dy_out", both, lambda: normal((1, r, h)), x_scales),
        ("backward dy_in", both, lambda: normal((1, r, 2 * f)), x_scales),
    ]


def bytes_moved(a, outputs):
    return a.nbytes + sum(o.nbytes for o in outputs)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128, help="experts per rank (the weights' E)")
    p.add_argument("--rows", type=int, default=40704, help="expert-major rows (a multiple of 128)")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="the model's hidden size H (a multiple of 128)")
    p.add_argument("--ffn", type=int, default=FFN, help="the experts' intermediate size F (a multiple of 128)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--impls", default="xla,cuda", help="cuda: the extension's kernels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    impls = args.impls.split(",")
    if unknown := set(impls) - set(fp8_quant.BACKENDS[1:]):  # fp8_quant's backends but "auto"
        p.error(f"--impls: {sorted(unknown)} not among {list(fp8_quant.BACKENDS[1:])}")
    if "cuda" in impls and (reason := _native.unavailable_reason()):
        p.error(f"--impls cuda: the CUDA kernels cannot run here ({reason}); --impls xla times XLA's alone")
    env = environment()
    print(f"# {env}")
    results = []
    print("\n| case | impl | ms median | ms min-max | GB/s | kernels, ms |\n|---|---|---|---|---|---|")
    chosen = set(filter(None, args.cases.split(",")))
    names = [case[0] for case in cases(args)]
    if chosen - set(names):
        p.error(f"--cases: no case {sorted(chosen - set(names))}; the cases are {names}")
    for name, fn, make, m in cases(args):
        if chosen and name not in chosen:
            continue
        a = jax.block_until_ready(make())
        outputs = {}
        for impl in impls:
            run = jax.jit(lambda a, m, impl=impl, fn=fn: fn(a, m, impl))
            outputs[impl] = jax.block_until_ready(run(a, m))
            moved = bytes_moved(a, outputs[impl])
            spans, kernels = device_times(run, (a, m), args.repeats)
            median = float(np.median(spans))
            by_kernel = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in kernels.items()) if impl != "xla" else ""
            print(
                f"| {name} | {impl} | {median * 1e3:.3f} | {spans.min() * 1e3:.3f}-{spans.max() * 1e3:.3f} | "
                f"{moved / median * 1e-9 if median else float('nan'):.0f} | {by_kernel}",
                flush=True,
            )
            results.append(dict(case=name, backend=impl, seconds=spans.tolist(), bytes=moved, kernels=kernels))
        (first, first_out), *others = outputs.items()
        for other, other_out in others:
            agree = same_bits(first_out, other_out)
            print(f"| {name} | {first} and {other} agree bit for bit: {agree} | | | |", flush=True)
            results.append(dict(case=name, agree=agree, impls=[first, other]))
        del a, outputs
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
