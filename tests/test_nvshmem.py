"""EP groups across hosts, the Python side, without GPUs: which ranks share a
host, the refusals (XLA's own NVSHMEM, several GPUs per process, no NVSHMEM
in the build, hosts of unequal sizes), and (with the extension built, whose
layout functions give the sizes) the send area's and internode normal mode's
region sizes and trace-time checks."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deep_ep_jax as dej
from deep_ep_jax import _native, testing
from deep_ep_jax.backends.cuda import internode, lifecycle, low_latency, sizes
from deep_ep_jax.distributed import multiprocess, nvshmem

extension = pytest.mark.extension

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
    assert lifecycle.group_places(buffer, False)[0] == [[0, 0, 0, 0, 1, 1, 1, 1]]
    buffer = _xla_buffer(8, config=dej.Config(gpus_per_host=None))
    assert lifecycle.group_places(buffer, False)[0] == [[0] * 8]


def _allocate_choosing(monkeypatch, buffer, places=None):
    """lifecycle.allocate up to its choice of memory, on CPU: {"nvshmem": nodes} where it picks NVSHMEM,
    else {"local": groups}; places (optional) stands in for lifecycle.group_places' (nodes, hosts)."""
    chosen = {}
    monkeypatch.setattr(lifecycle, "register_ffi_targets", lambda: None)
    monkeypatch.setattr(lifecycle, "check_config", lambda config, limits: None)
    monkeypatch.setattr(lifecycle, "check_group_size", lambda num_ranks, limits: None)
    monkeypatch.setattr(_native, "limits", lambda: {})
    monkeypatch.setattr(lifecycle, "normal_mode_serves", lambda num_ranks, spans_hosts, low_latency: True)
    monkeypatch.setattr(lifecycle, "allocate_nvshmem", lambda b, groups, nodes, *a: chosen.update(nvshmem=nodes))
    monkeypatch.setattr(lifecycle, "create_buffer", lambda groups, *a: chosen.update(local=groups) or 1)
    monkeypatch.setattr(lifecycle, "_check_fits_device", lambda regions, device: None)
    if places is not None:
        monkeypatch.setattr(lifecycle, "group_places", lambda b, spans: places)
    lifecycle.allocate(buffer, 1 << 20, 0)
    return chosen


def test_nodes_within_one_host_use_nvshmem(monkeypatch):
    """A host cut into nodes (Config.gpus_per_nvlink_domain, or NVML's cliques) runs the internode kernels,
    whose memory is NVSHMEM's, though every rank is on one host; one node on one host does not."""
    buffer = _xla_buffer(8, config=dej.Config(gpus_per_nvlink_domain=4))
    assert _allocate_choosing(monkeypatch, buffer) == {"nvshmem": [[0, 0, 0, 0, 1, 1, 1, 1]]}
    assert buffer.spans_hosts and buffer.nvshmem
    buffer = _xla_buffer(8)
    assert "local" in _allocate_choosing(monkeypatch, buffer) and not (buffer.spans_hosts or buffer.nvshmem)


def test_refuses_groups_cut_unlike(monkeypatch):
    """One EP group over two nodes beside one within a node: one program's kernels cannot serve both."""
    devices = np.array(jax.devices("cpu")[:8]).reshape(2, 4)
    buffer = dej.Buffer(jax.sharding.Mesh(devices, ("data", AXIS)), AXIS, backend="xla")
    places = ([[0, 0, 1, 1], [0, 0, 0, 0]], [[0, 0, 1, 1], [0, 0, 0, 0]])
    with pytest.raises(NotImplementedError, match=r"some EP groups of the mesh span several nodes and others one"):
        _allocate_choosing(monkeypatch, buffer, places)


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


def test_refuses_a_gpu_that_only_ptx_covers():
    """The NVSHMEM kernels are device-linked: PTX does not reach them, machine code must."""
    h100 = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H100")
    reason = nvshmem.uncovered_gpu_reason(["sm_80", "compute_80"], [h100])
    assert "machine code only" in reason and "['sm_80']" in reason and "DEEP_EP_JAX_CUDA_ARCHS including 90" in reason
    assert nvshmem.uncovered_gpu_reason(["sm_80", "sm_90", "compute_120"], [h100]) is None
    assert nvshmem.uncovered_gpu_reason(["sm_90a"], [h100]) is None
    cpu = types.SimpleNamespace(platform="cpu", compute_capability=None, device_kind="cpu")
    assert nvshmem.uncovered_gpu_reason(["compute_80"], [cpu]) is None


def test_refuses_a_build_without_nvshmem(monkeypatch):
    monkeypatch.setattr(_native, "load_error", lambda: None)
    monkeypatch.setattr(_native, "extension", lambda: types.SimpleNamespace(with_nvshmem=False))
    assert "built without NVSHMEM" in nvshmem.unavailable_reason()
    monkeypatch.setattr(_native, "load_error", lambda: "the extension deep_ep_jax._C is not built")
    assert "not built" in nvshmem.unavailable_reason()


def test_refuses_several_gpus_per_process():
    """One process driving 8 devices told they are 2 hosts of 4: NVSHMEM has one PE per process."""
    buffer = _xla_buffer(
        8, low_latency_mode=True, num_max_dispatch_tokens_per_rank=8, hidden=256, config=dej.Config(gpus_per_host=4)
    )
    nodes = lifecycle.group_places(buffer, False)[0]
    with pytest.raises(NotImplementedError, match="one PE, so one GPU, per process"):
        lifecycle.allocate_nvshmem(buffer, lifecycle.groups(buffer), nodes, None, None)
    nvshmem.check_one_gpu_per_process(list(buffer.mesh.devices.flat)[:1])  # one device: fine


@extension
def test_refuses_hosts_of_unequal_sizes(monkeypatch):
    """Internode normal mode forwards through the GPU of the sender's local
    index on every host: hosts must hold the same number of ranks."""
    buffer = _xla_buffer(4)
    monkeypatch.setattr(nvshmem, "check_one_gpu_per_process", lambda devices: None)
    with pytest.raises(NotImplementedError, match=r"same number of GPUs .* got \[3, 1\]"):
        lifecycle.allocate_nvshmem(buffer, lifecycle.groups(buffer), [[0, 0, 0, 1]], None, None)
    assert internode.check_nodes([0, 0, 1, 1]) == 2
    assert internode.check_nodes([0, 1, 0, 1]) == 2
    assert internode.check_nodes([0]) == 1
    assert internode.check_nodes([b for b in range(16) for _ in range(8)]) == 16
    assert internode.check_nodes([0] * 32 + [1] * 32) == 2
    with pytest.raises(
        NotImplementedError, match="NVLink domains of at most 32 GPUs .* got 33; set Config.gpus_per_nvlink_domain"
    ):
        internode.check_nodes([0] * 33 + [1] * 33)


def _fake_internode_buffer(num_ranks, num_nodes, num_nvl_bytes):
    """What the CUDA backend sees of a Buffer across hosts, for trace-time checks on CPU."""
    return testing.stand_in_cuda_buffer(num_ranks, num_nodes=num_nodes, num_nvl_bytes=num_nvl_bytes, spans_hosts=True)


def _trace_dispatch(buffer, num_tokens, hidden, topk, num_experts, dtype=jnp.bfloat16):
    x = jax.ShapeDtypeStruct((num_tokens, hidden), dtype)
    idx = jax.ShapeDtypeStruct((num_tokens, topk), jnp.int32)
    w = jax.ShapeDtypeStruct((num_tokens, topk), jnp.float32)
    return jax.eval_shape(
        lambda x, idx, w: internode.dispatch(
            (x,), idx, w, num_experts=num_experts, num_worst_tokens=None, buffer=buffer
        ),
        x,
        idx,
        w,
    )


@extension
def test_internode_trace_checks_region_size():
    num_ranks, num_tokens, hidden, topk, num_experts = 2, 64, 256, 4, 8
    need = _native.extension().internode_dispatch_region_bytes(
        num_tokens, num_tokens * num_ranks, topk, 2 * hidden, 0, num_ranks, num_ranks
    )
    recv_xs, _, _, handle = _trace_dispatch(
        _fake_internode_buffer(num_ranks, num_ranks, need), num_tokens, hidden, topk, num_experts
    )
    assert recv_xs[0].shape == (num_tokens * num_ranks, hidden) and handle.send_pos.shape == (num_tokens, num_ranks)
    buffer = _fake_internode_buffer(num_ranks, num_ranks, need - 1)
    with pytest.raises(ValueError, match=f"needs {need} bytes .* num_nvl_bytes={need - 1}"):
        _trace_dispatch(buffer, num_tokens, hidden, topk, num_experts)
    with pytest.raises(ValueError, match="bf16 rows or quantized pairs"):
        _trace_dispatch(buffer, num_tokens, hidden, topk, num_experts, dtype=jnp.float32)
    with pytest.raises(ValueError, match="at most 1024 ranks in all across hosts"):
        _trace_dispatch(_fake_internode_buffer(1032, 129, 1 << 40), num_tokens, hidden, topk, 1032)


@extension
def test_internode_region_hint():
    """The hint holds the calls of its shapes (bf16 and FP8 dispatch, combine,
    top-k up to 16) and grows with hidden, tokens and hosts."""
    ext = _native.extension()
    num_ranks, num_nodes, hidden, num_tokens = 4, 2, 7168, 512
    rows = num_ranks * num_tokens
    size = sizes.internode_region_bytes(num_ranks, num_nodes, hidden, num_tokens)
    for topk in (1, 8, 16):
        for row, scales in ((2 * hidden, 0), (hidden, hidden // 128 * 4)):
            assert (
                ext.internode_dispatch_region_bytes(num_tokens, rows, topk, row, scales, num_ranks, num_nodes) <= size
            )
        assert ext.internode_combine_region_bytes(num_tokens, rows, topk, hidden, num_ranks, num_nodes) <= size
    # A Buffer with the hint passes the trace-time check of such a dispatch.
    _trace_dispatch(_fake_internode_buffer(num_ranks, num_nodes, size), num_tokens, hidden, 16, 8 * num_ranks)
    assert size >= num_tokens * num_ranks * 2 * hidden  # at least the received bf16 rows
    assert sizes.internode_region_bytes(num_ranks, num_nodes, 2 * hidden, num_tokens) > size
    assert sizes.internode_region_bytes(num_ranks, num_nodes, hidden, 2 * num_tokens) > size
    assert sizes.internode_region_bytes(8, 8, hidden, num_tokens) > sizes.internode_region_bytes(
        8, 2, hidden, num_tokens
    )
    assert sizes.internode_region_bytes(2, 2) == sizes.internode_region_bytes(2, 2, 7168, 4096, sizes.DEFAULT_TOPK)


def test_buffer_holds_the_ops_of_its_path():
    """The path is chosen when the Buffer is made, not per call: the internode
    operations for an EP group across hosts, the intranode ones otherwise."""
    from deep_ep_jax.backends import reference
    from deep_ep_jax.backends.cuda import intranode, layout
    from deep_ep_jax.comm import buffer as buffer_module

    across = buffer_module._ops("cuda", spans_hosts=True)
    assert (across.dispatch, across.cached_dispatch, across.combine) == (
        internode.dispatch,
        internode.cached_dispatch,
        internode.combine,
    )
    one_host = buffer_module._ops("cuda", spans_hosts=False)
    assert (one_host.dispatch, one_host.cached_dispatch, one_host.combine) == (
        intranode.dispatch,
        intranode.cached_dispatch,
        intranode.combine,
    )
    for ops in (across, one_host):
        assert ops.get_dispatch_layout is layout.get_dispatch_layout
        assert ops.low_latency_dispatch_send is low_latency.low_latency_dispatch_send
    assert _xla_buffer(2).ops.dispatch is reference.dispatch


# Sizes -------------------------------------------------------------------------


@extension
def test_send_area_holds_dispatch_and_combine_staging():
    """The send area stages a dispatch's rows (one per (token, k)) or a
    combine's (one per (source, token, k)); sized for top-k 16 by default."""
    num_ranks, hidden, max_tokens, topk = 4, 7168, 128, 8
    size = sizes.low_latency_send_bytes(num_ranks, hidden, max_tokens, num_topk=topk)
    assert size >= max_tokens * topk * 2 * hidden  # dispatch: a bf16 row per (token, k)
    assert size >= num_ranks * max_tokens * topk * hidden * 2  # combine: per (source, token, k)
    assert sizes.low_latency_send_bytes(num_ranks, hidden, 2 * max_tokens, num_topk=topk) > size
    assert sizes.low_latency_send_bytes(num_ranks, 2 * hidden, max_tokens, num_topk=topk) > size
    default = sizes.low_latency_send_bytes(num_ranks, hidden, max_tokens)
    assert default == sizes.low_latency_send_bytes(num_ranks, hidden, max_tokens, num_topk=sizes.DEFAULT_TOPK)
    with pytest.raises(ValueError, match="hidden"):
        sizes.low_latency_send_bytes(num_ranks, None, max_tokens)


@extension
def test_low_latency_region_holds_dispatch_and_combine():
    """The size hint covers what the calls check: each half holds a dispatch
    (bf16 or FP8) or a combine of these shapes."""
    ext = _native.extension()
    hidden, max_tokens, num_experts = 7168, 128, 288
    for num_ranks, topk in ((2, 8), (8, 8), (8, 1), (2, 16)):
        region = sizes.low_latency_region_bytes(num_ranks, num_experts, hidden, max_tokens, num_topk=topk)
        half = ext.low_latency_half_bytes(region)
        for fp8 in (True, False):
            need = ext.low_latency_dispatch_half_bytes(
                num_ranks, num_experts // num_ranks, max_tokens, topk, hidden, fp8
            )
            assert need <= half
        assert ext.low_latency_combine_half_bytes(max_tokens, topk, hidden) <= half
        assert half >= max_tokens * topk * hidden * 2  # a combine: a bf16 row per (token, k)
        assert sizes.low_latency_region_bytes(num_ranks, num_experts, hidden, 2 * max_tokens, num_topk=topk) > region
    # num_experts None sizes for the kernels' most experts.
    most = sizes.low_latency_region_bytes(8, None, hidden, max_tokens, num_topk=8)
    assert most >= sizes.low_latency_region_bytes(
        8, _native.limits()["low_latency_max_experts"], hidden, max_tokens, num_topk=8
    )


def test_heap_bytes():
    assert nvshmem.heap_bytes(0) == nvshmem.HEAP_SLACK_BYTES
    size = nvshmem.heap_bytes(100 << 20)
    assert size >= 2 * (100 << 20) + nvshmem.HEAP_SLACK_BYTES and size % (2 << 20) == 0


def test_one_process_never_spans_hosts_by_hostname():
    buffer = _xla_buffer(4)
    assert lifecycle.group_places(buffer, False)[0] == [[0, 0, 0, 0]]
    assert not buffer.spans_hosts
    assert np.asarray(lifecycle.groups(buffer)).shape == (1, 4)
    assert jax.process_count() == 1


def test_launcher_all_gpus_visible(monkeypatch):
    from deep_ep_jax import launch

    monkeypatch.delenv(launch.LOCAL_DEVICE_VAR, raising=False)
    env = launch._child_env(1, 2, "127.0.0.1:1", ["3", "5"], False, all_gpus_visible=True)
    assert env["CUDA_VISIBLE_DEVICES"] == "3,5" and env[launch.LOCAL_DEVICE_VAR] == "1"
    env = launch._child_env(1, 2, "127.0.0.1:1", ["3", "5"], False)
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and launch.LOCAL_DEVICE_VAR not in env
