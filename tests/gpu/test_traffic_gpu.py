"""Traffic counters (Config.count_traffic) of the one-host kernels on the
GPUs at hand, direct and staged: after dispatch, combine and combine's
backward (a cached dispatch), each rank's counters equal the xla backend's
and tests/oracle.py's traffic(), fresh random and skewed routing, and
num_worst_tokens drops. Across processes, several ranks per GPU (the
staged kernels over CUDA IPC, and the internode kernels across hosts):
tests/gpu/test_scale_gpu.py::test_traffic_counters_with_ranks_sharing_gpus.

    pytest -q -m gpu tests/gpu/test_traffic_gpu.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest

import deep_ep_jax as dej
from deep_ep_jax import testing as dt
from deep_ep_jax.backends.cuda import intranode

pytestmark = pytest.mark.gpu
AXIS = "ep"
T, H, K = 64, 512, 4


@pytest.mark.parametrize("staged", [False, True])
def test_one_host_counters(monkeypatch, staged, rng):
    monkeypatch.setenv(intranode.STAGED_ENV, "1" if staged else "0")
    mesh = dt.ep_mesh(len(jax.devices("gpu")), AXIS, platform="gpu")
    num_ranks = mesh.shape[AXIS]
    num_experts = 4 * num_ranks
    config = dej.Config(count_traffic=True)
    cuda = dej.Buffer(mesh, AXIS, backend="cuda", hidden=H, config=config)
    xla = dej.Buffer(mesh, AXIS, backend="xla", config=config)
    assert cuda.backend == "cuda" and cuda.staged == staged, cuda
    for kind, worst in [("random", None), ("one_expert", None), ("rank_empty", None), ("random", 0.4)]:
        num_worst_tokens = None if worst is None else int(worst * num_ranks * T)
        rows = num_worst_tokens or num_ranks * T
        idx, w = dt.make_routing(int(rng.integers(1 << 30)), num_ranks * T, num_experts, K, num_ranks, kind)
        x = dt.random_rows(int(rng.integers(1 << 30)), (num_ranks * T, H))
        y = dt.random_rows(int(rng.integers(1 << 30)), (num_ranks * rows, H))
        counts = []
        for buffer in (cuda, xla):

            def step(x, idx, w, y, buffer=buffer, num_worst_tokens=num_worst_tokens):
                _, _, _, handle = dej.dispatch(
                    x, idx, w, num_experts=num_experts, buffer=buffer, num_worst_tokens=num_worst_tokens
                )

                def loss(y):  # combine, and its backward: a cached dispatch
                    return (dej.combine(y, handle, buffer=buffer).astype(jnp.float32) ** 2).sum()

                return jax.value_and_grad(loss)(y)

            buffer.reset_traffic()
            jax.block_until_ready(dt.per_rank(step, mesh, AXIS)(x, jnp.asarray(idx), jnp.asarray(w), y))
            counts.append(buffer.traffic())
        got, reference = counts
        assert got == reference, (kind, worst, got, reference)
        shards = lambda a: np.asarray(a).reshape(num_ranks, T, -1)
        expected = oracle.dispatch(np.zeros((num_ranks, T, 1)), shards(idx), shards(w), num_experts, rows)
        want = oracle.traffic(shards(idx), expected, num_experts)
        for r in range(num_ranks):
            for op, (nvlink, network) in want[r].items():
                assert got[r][op]["nvlink_rows"] == nvlink and got[r][op]["nvlink_bytes"] == nvlink * 2 * H, (r, op)
                assert got[r][op]["network_rows"] == network == 0, (r, op)
        assert sum(got[r]["combine"]["nvlink_rows"] for r in range(num_ranks)) > 0 or kind == "one_expert"
    cuda.destroy()
