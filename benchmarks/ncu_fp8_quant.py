"""Each chosen case of bench_fp8_quant.py once, on the extension's CUDA kernels, for a profiler.

The cases' inputs and calls are bench_fp8_quant.py's; each runs once, after its input is made, so a
profiler filtered to the extension's kernels sees one launch of each. From the repository root:

    ncu --clock-control none --kernel-name regex:"Amax|TransposedRows" --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        python3 benchmarks/ncu_fp8_quant.py "fp8_weights(w_in)" "backward dy_in"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_fp8_quant


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="+", help="bench_fp8_quant.py's case names")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--rows", type=int, default=40704)
    p.add_argument("--hidden", type=int, default=bench_fp8_quant.HIDDEN)
    p.add_argument("--ffn", type=int, default=bench_fp8_quant.FFN)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    by_name = {case[0]: case for case in bench_fp8_quant.cases(args)}
    if set(args.cases) - set(by_name):
        p.error(f"no case {sorted(set(args.cases) - set(by_name))}; the cases are {sorted(by_name)}")
    for name in args.cases:
        _, fn, make, m = by_name[name]
        a = jax.block_until_ready(make())
        jax.block_until_ready(jax.jit(lambda a, m, fn=fn: fn(a, m, "cuda"))(a, m))
        print(f"{name}: {a.shape}", flush=True)
        del a


if __name__ == "__main__":
    main()
