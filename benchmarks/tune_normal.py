"""Sweeps the normal-mode launch configuration (SMs x chunk tokens, and warps
per block where Config has num_warps) at the standard case and prints the
best configuration per operation, overall and at each SM count.

    python benchmarks/tune_normal.py
    python benchmarks/tune_normal.py --num-sms 16 24 32 --chunk-tokens 1 2 4 8 16 --json tune.json

Timing as in bench_normal.py (chains of n and 2n operations in one jitted
program, difference / n). Put the winners into deep_ep_jax/config.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_normal as bench  # noqa: E402
from timing import check_counts  # noqa: E402

import deep_ep_jax  # noqa: E402
from deep_ep_jax import testing  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-sms", type=int, nargs="+", default=[8, 16, 24, 32])
    parser.add_argument("--chunk-tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument(
        "--num-warps", type=int, nargs="+", default=[8, 16], help="warps per block (only if Config has num_warps)"
    )
    parser.add_argument("--ops", nargs="+", default=list(bench.OPS), choices=bench.OPS)
    parser.add_argument("--tokens", type=int, default=bench.Case.num_tokens)
    parser.add_argument("--hidden", type=int, default=bench.Case.hidden)
    parser.add_argument("--experts", type=int, default=bench.Case.num_experts)
    parser.add_argument("--topk", type=int, default=bench.Case.topk)
    parser.add_argument("--chain", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    check_counts(parser, args, "tokens", "hidden", "experts", "topk", "chain", "repeats")

    mesh = testing.ep_mesh(len(jax.devices()), bench.AXIS)
    case = bench.Case(args.tokens, args.hidden, args.experts, args.topk)
    inputs = bench.make_inputs(case, mesh.shape[bench.AXIS])
    has_warps = "num_warps" in deep_ep_jax.Config.__dataclass_fields__
    warps_list = args.num_warps if has_warps else [None]
    print(f"# tuning EP={mesh.shape[bench.AXIS]}, {case}, ops {args.ops}")

    results = []
    for num_sms in args.num_sms:
        for chunk_tokens in args.chunk_tokens:
            for num_warps in warps_list:
                fields = bench.config_fields(num_sms, chunk_tokens, num_warps)
                buffer = bench.make_buffer(mesh, "cuda", **fields)
                try:
                    for op in args.ops:
                        r = bench.measure(op, buffer, mesh, case, inputs, length=args.chain, repeats=args.repeats)
                        results.append(r)
                        print(
                            f"{op:14s} sms={num_sms:3d} chunk={chunk_tokens:3d} warps={r['num_warps']} "
                            f"{r['us_median']:8.1f} us {r['gbps_median']:7.1f} GB/s",
                            flush=True,
                        )
                finally:
                    buffer.destroy()

    print("\n# best per op (median time)")
    for op in args.ops:
        rows = [r for r in results if r["op"] == op]
        best = min(rows, key=lambda r: r["us_median"])
        print(
            f"{op:14s} overall: sms={best['num_sms']} chunk_tokens={best['chunk_tokens']} "
            f"num_warps={best['num_warps']} -> {best['us_median']:.1f} us, {best['gbps_median']:.1f} GB/s"
        )
        for num_sms in args.num_sms:
            at = min((r for r in rows if r["num_sms"] == num_sms), key=lambda r: r["us_median"])
            print(
                f"{'':14s} at {num_sms:3d} SMs: chunk_tokens={at['chunk_tokens']} num_warps={at['num_warps']} "
                f"-> {at['us_median']:.1f} us, {at['gbps_median']:.1f} GB/s"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=bench.environment(), results=results), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
