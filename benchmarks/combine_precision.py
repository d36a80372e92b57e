"""Precision of combine reduced per host (docs/internode.md): the error of
bf16 per-host partials, and of float32 ones, against a float64 sum, on CPU.

Standard case: top-8 of 256 experts (softmax weights of random logits), hidden
7168; each rank's row of a token is bf16(sum of its experts' w_k * y_k), y_k ~
N(0, 1). Per host the rows are summed in rank order in float32 from 0.0, the
partial rounded to bf16 (or kept float32), then the partials summed in host
order and the result rounded to bf16 ("flat": today's rank order, one rounding).

    python benchmarks/combine_precision.py [--tokens 512]
"""

import argparse

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
HIDDEN, EXPERTS, TOPK = 7168, 256, 8


def rows_per_rank(rng, num_ranks, num_tokens):
    """[R, T, H] float32 holding bf16 values: each rank's row of each token (0 where it has none)."""
    logits = rng.standard_normal((num_tokens, EXPERTS))
    idx = np.argsort(-logits, 1)[:, :TOPK]
    w = np.exp(np.take_along_axis(logits, idx, 1))
    w /= w.sum(1, keepdims=True)
    rows = np.zeros((num_ranks, num_tokens, HIDDEN), np.float32)
    tokens = np.arange(num_tokens)
    for k in range(TOPK):
        y = rng.standard_normal((num_tokens, HIDDEN)).astype(np.float32)
        rows[idx[:, k] // (EXPERTS // num_ranks), tokens] += w[:, k, None].astype(np.float32) * y
    return rows.astype(BF16).astype(np.float32)


def combine(rows, num_hosts, partial_dtype):
    """Per host in rank order, partial in partial_dtype (None: flat rank order), then hosts in order; bf16 out."""
    if partial_dtype is None:
        acc = np.zeros(rows.shape[1:], np.float32)
        for row in rows:
            acc = acc + row
        return acc.astype(BF16)
    per_host = rows.shape[0] // num_hosts
    acc = np.zeros(rows.shape[1:], np.float32)
    for h in range(num_hosts):
        partial = np.zeros(rows.shape[1:], np.float32)
        for row in rows[h * per_host : (h + 1) * per_host]:
            partial = partial + row
        acc = acc + partial.astype(partial_dtype).astype(np.float32)
    return acc.astype(BF16)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(
        f"{args.tokens} tokens, hidden {HIDDEN}, top-{TOPK} of {EXPERTS}; error against the float64 sum of the "
        f"bf16 rows"
    )
    print("| hosts x GPUs | partials | relative RMS error | max error / RMS | outputs not the correctly rounded bf16 |")
    print("|---|---|---|---|---|")
    for num_hosts, per_host in ((2, 4), (2, 8), (4, 8), (8, 8), (16, 8)):
        rows = rows_per_rank(rng, num_hosts * per_host, args.tokens)
        exact = rows.astype(np.float64).sum(0)
        correct = exact.astype(np.float32).astype(BF16).astype(np.float64)
        scale = np.sqrt((exact**2).mean())
        for name, dtype in (("none (rank order)", None), ("float32", np.float32), ("bf16", BF16)):
            out = combine(rows, num_hosts, dtype).astype(np.float64)
            err = np.abs(out - exact)
            print(
                f"| {num_hosts} x {per_host} | {name} | {np.sqrt((err**2).mean()) / scale:.2e} | "
                f"{err.max() / scale:.2e} | {(out != correct).mean():.1%} |"
            )


if __name__ == "__main__":
    main()
