"""benchmarks/bench_normal.py's XLA baseline does the whole work in every
operation of a chain: the compiled chain of 2n operations holds exactly twice
the exchanges, gathers and prefix sums of the chain of n (none computed once
per chain), and the FP8 dispatch exchanges its scales. CPU, small shapes."""

import re

import bench_normal as bench  # noqa: E402
import numpy as np
import pytest

import deep_ep_jax as dej
from deep_ep_jax import testing as dt

NUM_RANKS = 4
CASE = bench.Case(num_tokens=32, hidden=256, num_experts=16, topk=4)
# HLO ops a backend's work per operation shows up as.
WORK = {"exchanges": r"all-to-all\(|all-gather\(", "gathers": r" gather\(", "prefix sums": r"reduce-window\("}


def _work(op, length):
    """{kind of work: its count in the compiled chain of `length` operations}."""
    mesh = dt.ep_mesh(NUM_RANKS, bench.AXIS, platform="cpu")
    buffer = dej.Buffer(mesh, bench.AXIS, backend="xla")
    inputs = bench.make_inputs(CASE, NUM_RANKS)
    args = bench.chain_args(op, buffer, mesh, CASE, inputs, 2 * length)
    text = bench.make_chain(op, buffer, mesh, CASE, length).lower(*args).compile().as_text()
    return {kind: len(re.findall(pattern, text)) for kind, pattern in WORK.items()}


@pytest.mark.parametrize("op", bench.OPS)
def test_every_operation_does_the_whole_work(op):
    short, long = _work(op, 2), _work(op, 4)
    assert short["exchanges"] > 0 and short["gathers"] > 0, short
    assert long == {kind: 2 * n for kind, n in short.items()}, (short, long)


def test_fp8_dispatch_exchanges_its_scales():
    """One exchange more per operation than bf16: the scales travel too."""
    assert _work("dispatch_fp8", 2)["exchanges"] == _work("dispatch_bf16", 2)["exchanges"] + 2


def test_routings_permute_tokens_within_ranks():
    """Each operation's routing: each rank's own tokens reordered, so every
    operation receives the same rows (the bandwidth formula counts them once)."""
    inputs = bench.make_inputs(CASE, NUM_RANKS)
    routings = [tuple(map(np.asarray, r)) for r in bench.op_routings(CASE, NUM_RANKS, inputs, 3)]
    assert len({r[0].tobytes() for r in routings}) == 3  # all different

    def rows_of_each_rank(idx, w):
        rows = np.concatenate([idx, w.view(np.int32)], axis=1).reshape(NUM_RANKS, CASE.num_tokens, -1)
        return [sorted(map(tuple, r.tolist())) for r in rows]

    want = rows_of_each_rank(np.asarray(inputs["idx"]), np.asarray(inputs["w"]))
    for idx, w in routings:
        assert rows_of_each_rank(idx, w) == want
