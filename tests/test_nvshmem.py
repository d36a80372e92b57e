"""EP groups across hosts, the Python side, without GPUs: which ranks share a
host, the refusals (XLA's own NVSHMEM, several GPUs per process, no NVSHMEM
in the build, hosts of unequal sizes), the send-area size, and internode
normal mode's region sizes and trace-time checks."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deep_ep_jax as dej
from deep_ep_jax import _native, multiprocess, nvshmem, testing
from deep_ep_jax.backends import cuda_internode as cin
from deep_ep_jax.backends import cuda_low_latency as cll

AXIS = "ep"


# Which ranks share a host ----------------------------------------------------


def test_group_nodes_from_hostnames():
    assert multiprocess.group_nodes(["a", "a", "a", "a"]) == [0, 0, 0, 0]
    assert multiprocess.group_nodes(["a", "a", "b", "b"]) == [0, 0, 1, 1]
    assert multiprocess.group_nodes(["b", "a", "b", "a"]) == [0, 1, 0, 1]


def test_group_nodes_cut_by_gpus_per_host():
    assert multiprocess.group_nodes(["h"] * 4, 1) == [0, 1, 2, 3]
    assert multiprocess.group_nodes(["h"] * 4, 2) == [0, 0, 1, 1]
    assert multiprocess.group_nodes(["h"] * 4, 4) == [0, 0, 0, 0]
    assert multiprocess.group_nodes(["h"] * 4, 8) == [0, 0, 0, 0]
    # Per host, in rank order: two hosts of four GPUs, seen as four of two.
    assert multiprocess.group_nodes(["a", "b", "a", "b", "a", "b", "a", "b"], 2) == [0, 1, 0, 1, 2, 3, 2, 3]


def test_config_gpus_per_host(monkeypatch):
    monkeypatch.delenv("DEEP_EP_JAX_GPUS_PER_HOST", raising=False)
    assert dej.Config().gpus_per_host is None
    monkeypatch.setenv("DEEP_EP_JAX_GPUS_PER_HOST", "1")
    assert dej.Config().gpus_per_host == 1
    assert dej.Config(gpus_per_host=4).gpus_per_host == 4
    with pytest.raises(ValueError, match="gpus_per_host"):
        dej.Config(gpus_per_host=0)


def _xla_buffer(num_ranks, **kwargs):
    return dej.Buffer(testing.ep_mesh(num_ranks, AXIS, platform="cpu"), AXIS, backend="xla", **kwargs)


def test_buffer_decides_hosts_from_config():
    buffer = _xla_buffer(8, config=dej.Config(gpus_per_host=4))
    assert buffer._group_nodes(False) == [[0, 0, 0, 0, 1, 1, 1, 1]]
    buffer = _xla_buffer(8, config=dej.Config(gpus_per_host=None))
    assert buffer._group_nodes(False) == [[0] * 8]


# Refusals --------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags,enabled",
    [
        ("", False),
        ("--xla_gpu_experimental_enable_nvshmem", True),
        ("--xla_gpu_experimental_enable_nvshmem=true", True),
        ("--xla_gpu_experimental_enable_nvshmem=false", False),
        ("--foo=1 --xla_gpu_experimental_enable_nvshmem=1 --bar", True),
        ("--xla_gpu_experimental_enable_nvshmem=true --xla_gpu_experimental_enable_nvshmem=false", False),
        ("--xla_gpu_experimental_enable_nvshmem_other=true", False),
    ],
)
def test_xla_nvshmem_flag(flags, enabled):
    assert nvshmem.xla_nvshmem_enabled(flags) is enabled


def test_refuses_xla_nvshmem(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_gpu_experimental_enable_nvshmem")
    reason = nvshmem.unavailable_reason()
    assert "--xla_gpu_experimental_enable_nvshmem" in reason and "XLA's own NVSHMEM" in reason


def test_refuses_a_build_without_nvshmem(monkeypatch):
    monkeypatch.setattr(_native, "_load", lambda: (types.SimpleNamespace(with_nvshmem=False), None))
    assert "built without NVSHMEM" in nvshmem.unavailable_reason()
    monkeypatch.setattr(_native, "_load", lambda: (None, "the extension deep_ep_jax._C is not built"))
    assert "not built" in nvshmem.unavailable_reason()


def test_refuses_several_gpus_per_process():
    """One process driving 8 devices told they are 2 hosts of 4: NVSHMEM has one PE per process."""
    buffer = _xla_buffer(8, low_latency_mode=True, num_max_dispatch_tokens_per_rank=8, hidden=256,
                         config=dej.Config(gpus_per_host=4))
    nodes = buffer._group_nodes(False)
    with pytest.raises(NotImplementedError, match="one PE, so one GPU, per process"):
        buffer._allocate_nvshmem(buffer._groups(), nodes, None, None)
    nvshmem.check_one_gpu_per_process(list(buffer.mesh.devices.flat)[:1])  # one device: fine


def test_refuses_hosts_of_unequal_sizes(monkeypatch):
    """Internode normal mode forwards through the GPU of the sender's local
    index on every host: hosts must hold the same number of ranks."""
    buffer = _xla_buffer(4)
    monkeypatch.setattr(nvshmem, "check_one_gpu_per_process", lambda devices: None)
    with pytest.raises(NotImplementedError, match=r"same number of GPUs .* got \[3, 1\]"):
        buffer._allocate_nvshmem(buffer._groups(), [[0, 0, 0, 1]], None, None)
    assert cin.check_nodes([0, 0, 1, 1]) == 2
    assert cin.check_nodes([0, 1, 0, 1]) == 2
    assert cin.check_nodes([0]) == 1


def _fake_internode_buffer(num_ranks, num_nodes, num_nvl_bytes):
    """What the CUDA backend sees of a Buffer across hosts, for trace-time checks on CPU."""
    return types.SimpleNamespace(num_ranks=num_ranks, num_nodes=num_nodes, buffer_id=1, backend="cuda",
                                 num_nvl_bytes=num_nvl_bytes, config=dej.Config(), spans_hosts=True)


def test_internode_trace_checks_region_size():
    num_ranks, num_tokens, hidden, topk, num_experts = 2, 64, 256, 4, 8
    need = cin.dispatch_region_bytes(num_tokens, num_tokens * num_ranks, topk, (2 * hidden, 0), num_ranks)
    buffer = _fake_internode_buffer(num_ranks, num_ranks, need - 1)
    x = jax.ShapeDtypeStruct((num_tokens, hidden), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((num_tokens, topk), jnp.int32)
    w = jax.ShapeDtypeStruct((num_tokens, topk), jnp.float32)

    def trace(buffer):
        return jax.eval_shape(lambda x, idx, w: cin.dispatch(
            (x,), idx, w, num_experts=num_experts, num_worst_tokens=None, buffer=buffer), x, idx, w)

    with pytest.raises(ValueError, match=f"needs {need} bytes .* num_nvl_bytes={need - 1}"):
        trace(buffer)
    with pytest.raises(ValueError, match="bf16 or FP8"):
        jax.eval_shape(lambda x, idx, w: cin.dispatch((x.astype(jnp.float32),), idx, w, num_experts=num_experts,
                                                      num_worst_tokens=None, buffer=buffer), x, idx, w)
    with pytest.raises(ValueError, match="at most 8 ranks"):
        trace(_fake_internode_buffer(16, 2, need))


def test_internode_region_bytes():
    """The layout mirror: control bytes, landing area, packets staged and
    received per host (dispatch); slots per (rank, token) and staged rows (combine)."""
    num_ranks, num_nodes, hidden, num_tokens, topk = 2, 2, 7168, 4096, 8
    rows = num_ranks * num_tokens
    packet = 2 * hidden + 16 * ((4 * 9 + 8 * topk + 15) // 16)
    dispatch = cin.dispatch_region_bytes(num_tokens, rows, topk, (2 * hidden, 0), num_nodes)
    assert dispatch >= cin.CONTROL_BYTES + rows * 2 * hidden + (1 + num_nodes) * num_tokens * packet
    assert dispatch % cin.ALIGN == 0
    combine = cin.combine_region_bytes(num_tokens, rows, topk, hidden, num_ranks)
    assert combine >= cin.CONTROL_BYTES + 2 * rows * (2 * hidden + 4 * topk)
    size = cin.internode_region_bytes(num_ranks, num_nodes, hidden, num_tokens, topk)
    assert size == max(dispatch, combine, cin.dispatch_region_bytes(
        num_tokens, rows, topk, (hidden, hidden // 128 * 4), num_nodes))
    # More hosts: more packets received; the default hint is the standard case.
    assert cin.internode_region_bytes(8, 8, hidden, num_tokens) > cin.internode_region_bytes(8, 2, hidden, num_tokens)
    assert cin.internode_region_bytes(2, 2) == cin.internode_region_bytes(2, 2, 7168, 4096, cin.DEFAULT_TOPK)


def test_cuda_normal_switches_to_internode(monkeypatch):
    from deep_ep_jax.backends import cuda_normal

    calls = []
    monkeypatch.setattr(cin, "dispatch", lambda *a, **k: calls.append("dispatch"))
    monkeypatch.setattr(cin, "cached_dispatch", lambda *a, **k: calls.append("cached_dispatch"))
    monkeypatch.setattr(cin, "combine", lambda *a, **k: calls.append("combine"))
    buffer = _fake_internode_buffer(2, 2, 1 << 30)
    cuda_normal.dispatch(None, None, None, num_experts=8, num_worst_tokens=None, buffer=buffer)
    cuda_normal.cached_dispatch(None, None, None, buffer=buffer)
    cuda_normal.combine(None, None, None, buffer=buffer)
    assert calls == ["dispatch", "cached_dispatch", "combine"]


# Sizes -------------------------------------------------------------------------


def test_send_area_holds_dispatch_and_combine_staging():
    num_ranks, hidden, max_tokens, topk = 4, 7168, 128, 8
    size = cll.low_latency_send_bytes(num_ranks, hidden, max_tokens, num_topk=topk)
    assert size >= max_tokens * topk * 2 * hidden  # dispatch: a bf16 row per (token, k)
    assert size >= num_ranks * max_tokens * topk * hidden * 2  # combine: per (source, token, k)
    assert size % 256 == 0
    default = cll.low_latency_send_bytes(num_ranks, hidden, max_tokens)
    assert default == cll.low_latency_send_bytes(num_ranks, hidden, max_tokens, num_topk=cll.DEFAULT_HINT_TOPK)
    with pytest.raises(ValueError, match="hidden"):
        cll.low_latency_send_bytes(num_ranks, None, max_tokens)


def test_low_latency_region_holds_dispatch_and_combine():
    """The size hint covers both operations: a dispatch holds one row per
    (source, token), whatever the top-k; a combine one bf16 row per (token, k)."""
    hidden, max_tokens, num_experts = 7168, 128, 288
    for num_ranks, topk in ((2, 8), (8, 8), (8, 1), (2, 16)):
        region = cll.low_latency_region_bytes(num_ranks, num_experts, hidden, max_tokens, num_topk=topk)
        half = cll._half_bytes(region)
        for fp8 in (True, False):
            need = cll._dispatch_half_bytes(num_ranks, num_experts // num_ranks, max_tokens, topk, hidden, fp8)
            assert need <= half
            assert need >= num_ranks * max_tokens * cll._row_bytes(hidden, fp8)  # each token once per source
        assert cll._combine_half_bytes(max_tokens, topk, hidden) <= half
    # DeepEP's decode case: the combine's rows size it (the dispatch no longer sends M * K rows per source).
    region = cll.low_latency_region_bytes(2, num_experts, hidden, max_tokens, num_topk=8)
    assert cll._half_bytes(region) < cll._combine_half_bytes(max_tokens, 8, hidden) + (1 << 20)


def test_heap_bytes():
    assert nvshmem.heap_bytes(0) == nvshmem.HEAP_SLACK_BYTES
    size = nvshmem.heap_bytes(100 << 20)
    assert size >= 2 * (100 << 20) + nvshmem.HEAP_SLACK_BYTES and size % (2 << 20) == 0


def test_one_process_never_spans_hosts_by_hostname():
    buffer = _xla_buffer(4)
    assert buffer._group_nodes(False) == [[0, 0, 0, 0]]
    assert not buffer.spans_hosts
    assert np.asarray(buffer._groups()).shape == (1, 4)
    assert jax.process_count() == 1


def test_launcher_all_gpus_visible(monkeypatch):
    from deep_ep_jax import launch

    monkeypatch.delenv(launch.LOCAL_DEVICE_VAR, raising=False)
    env = launch._child_env(1, 2, "127.0.0.1:1", ["3", "5"], False, all_gpus_visible=True)
    assert env["CUDA_VISIBLE_DEVICES"] == "3,5" and env[launch.LOCAL_DEVICE_VAR] == "1"
    env = launch._child_env(1, 2, "127.0.0.1:1", ["3", "5"], False)
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and launch.LOCAL_DEVICE_VAR not in env
