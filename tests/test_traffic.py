"""Traffic counters (Config.count_traffic) of the xla backend against
tests/oracle.py's traffic(), on 8 CPU devices as one host and as hosts of 4,
2 and 1: the rows (and bytes) each rank's kernels would move over NVLink and
over the network, per operation, with fresh random and skewed routing and
num_worst_tokens drops. The CUDA kernels' counters are checked against the
same oracle on GPUs (tests/gpu/test_scale_gpu.py, worker case traffic).
And the API of the other counters, Buffer.wait_times()."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import oracle
import pytest

import deep_ep_jax as dej
from deep_ep_jax import testing as dt

R, T, H, K = 8, 12, 128, 4
E = 2 * R
OPS = ("dispatch", "cached_dispatch", "combine")


def _shards(a):
    return np.asarray(a).reshape((R, -1) + np.asarray(a).shape[1:])


def _buffer(gpus_per_host, count=True):
    mesh = dt.ep_mesh(R, platform="cpu")
    return mesh, dej.Buffer(
        mesh, "ep", backend="xla", config=dej.Config(count_traffic=count, gpus_per_host=gpus_per_host)
    )


@functools.cache
def _counted_step(gpus_per_host, num_worst_tokens):
    """(buffer, its jitted per-rank step: dispatch, combine and combine's backward), built once per host
    split and num_worst_tokens: the routing kinds share its compile (the routing is an argument, and the
    counters are the buffer's, zeroed before each case)."""
    mesh, buffer = _buffer(gpus_per_host)

    def step(x, idx, w, y):
        recv_x, _, _, handle = dej.dispatch(x, idx, w, num_experts=E, buffer=buffer, num_worst_tokens=num_worst_tokens)

        def loss(y):  # combine, and its backward: a cached dispatch
            return (dej.combine(y, handle, buffer=buffer).astype(jnp.float32) ** 2).sum()

        value, grad = jax.value_and_grad(loss)(y)
        return recv_x, value, grad

    return buffer, dt.per_rank(step, mesh, "ep")


@pytest.mark.parametrize("gpus_per_host", [None, 4, 2, 1])
@pytest.mark.parametrize(
    "kind,worst", [("random", None), ("one_expert", None), ("rank_empty", None), ("minus_one", None), ("random", 0.3)]
)
def test_counters_match_the_oracle(gpus_per_host, kind, worst, rng):
    num_worst_tokens = None if worst is None else int(worst * R * T)
    rows = num_worst_tokens or R * T
    buffer, step = _counted_step(gpus_per_host, num_worst_tokens)
    buffer.reset_traffic()  # an earlier case's counts (one that failed before its own reset)
    idx, w = dt.make_routing(int(rng.integers(1 << 30)), R * T, E, K, R, kind)
    x = rng.standard_normal((R * T, H), np.float32).astype(ml_dtypes.bfloat16)
    y = rng.standard_normal((R * rows, H), np.float32).astype(ml_dtypes.bfloat16)
    jax.block_until_ready(step(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w), jnp.asarray(y)))
    got = buffer.traffic()
    expected = oracle.dispatch(np.zeros((R, T, 1)), _shards(idx), _shards(w), E, rows)
    if worst is not None:
        assert any(e["total"] > rows for e in expected), "no row dropped"
    want = oracle.traffic(_shards(idx), expected, E, gpus_per_host)
    row_bytes = {"dispatch": 2 * H, "cached_dispatch": 2 * H, "combine": 2 * H}
    assert sorted(got) == list(range(R))
    for r in range(R):
        for op in OPS:
            nvlink, network = want[r][op]
            assert got[r][op] == {
                "nvlink_rows": nvlink,
                "nvlink_bytes": nvlink * row_bytes[op],
                "network_rows": network,
                "network_bytes": network * row_bytes[op],
            }, (r, op)
    totals = {op: sum(want[r][op][1] for r in range(R)) for op in OPS}
    if gpus_per_host in (None, 8):
        assert totals == dict.fromkeys(OPS, 0)  # one host: nothing crosses the network
    elif kind == "random" and worst is None:
        # Deduplication: per token once per remote host, in dispatch and in combine alike.
        assert totals["dispatch"] == totals["combine"] == totals["cached_dispatch"] > 0
    buffer.reset_traffic()
    zeros = {op: dict.fromkeys(dej.config.TRAFFIC_FIELDS, 0) for op in OPS}
    assert buffer.traffic() == dict.fromkeys(range(R), zeros)  # every rank still listed, as on the CUDA backend


def test_fp8_rows_count_their_scales():
    mesh, buffer = _buffer(2)
    idx, w = dt.make_routing(0, R * T, E, K, R)
    x = dej.backends.reference.quantize_fp8(dt.random_rows(1, (R * T, H)))
    run = dt.per_rank(lambda x, idx, w: dej.dispatch(x, idx, w, num_experts=E, buffer=buffer)[0], mesh, "ep")
    jax.block_until_ready(run(x, jnp.asarray(idx), jnp.asarray(w)))
    got = buffer.traffic()
    row_bytes = H + H // 128 * 4  # e4m3 data and float32 scales
    for ops in got.values():
        c = ops["dispatch"]
        assert c["nvlink_bytes"] == c["nvlink_rows"] * row_bytes and c["network_bytes"] == c["network_rows"] * row_bytes
    assert sum(ops["dispatch"]["network_rows"] for ops in got.values()) > 0


def test_off_by_default():
    _, buffer = _buffer(2, count=False)
    with pytest.raises(RuntimeError, match="count_traffic=True"):
        buffer.traffic()
    with pytest.raises(RuntimeError, match="count_traffic=True"):
        buffer.reset_traffic()


def test_a_new_buffer_lists_every_rank_at_zero():
    """Before any call, traffic() holds every rank of this process with zero counters (as the CUDA backend's);
    under jit it is refused (a host call)."""
    _, buffer = _buffer(2)
    zeros = {op: dict.fromkeys(dej.config.TRAFFIC_FIELDS, 0) for op in OPS}
    assert buffer.traffic() == dict.fromkeys(range(R), zeros)
    with pytest.raises(RuntimeError, match="Buffer.traffic is a host call"):
        jax.jit(lambda: buffer.traffic() and 0)()
    buffer.destroy()


# Wait times (Buffer.wait_times: low-latency receives) ------------------------


def test_wait_times_api():
    """Every rank of this process, a float per source rank for each receive kind; zeros on the xla backend
    (it does not wait; the CUDA kernels' counters: tests/gpu/test_scale_gpu.py, worker case wait_times);
    refused under jit, without low-latency mode and after destroy."""
    mesh = dt.ep_mesh(R, platform="cpu")
    buffer = dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=T)
    times = buffer.wait_times()
    assert sorted(times) == list(range(R))
    for kinds in times.values():
        assert sorted(kinds) == ["combine", "dispatch"]
        assert all(v.shape == (R,) and v.dtype == np.float64 and not v.any() for v in kinds.values())
    buffer.reset_wait_times()
    for host_call in (buffer.wait_times, buffer.reset_wait_times):  # under a trace: one reading frozen in
        with pytest.raises(RuntimeError, match="is a host call: run it outside jit"):
            jax.jit(lambda call=host_call: call() and 0)()
    buffer.destroy()
    with pytest.raises(RuntimeError, match="Buffer.wait_times"):
        buffer.wait_times()
    with pytest.raises(RuntimeError, match="low_latency_mode=True"):
        dej.Buffer(mesh, "ep", backend="xla").wait_times()
