"""Large EP groups on CPU: the ranks each mode serves (low-latency mode up to
1024, normal mode one NVLink domain on one host and up to 1024 across hosts of
at most 8: tests/test_internode_scale.py), where a
too large group is refused (Buffer creation, trace time, the registry), and
the low-latency sizes at 16..1024 ranks, from the extension's size queries
against the layout of csrc/kernels/low_latency.h."""

import jax
import jax.numpy as jnp
import pytest

from deep_ep_jax import _native, info
from deep_ep_jax import testing as dt
from deep_ep_jax.backends.cuda import (
    common,
    intranode,
    lifecycle,
    low_latency,
    sizes,
)

extension = pytest.mark.extension

RANKS = (16, 32, 64, 128, 256, 512, 1024)
CONTROL, ALIGN, HALF_ALIGN = 1 << 16, 16, 256


def _align(n, a):
    return -(-n // a) * a


# Limits ------------------------------------------------------------------------


@extension
def test_limits_name_each_mode():
    limits = _native.limits()
    assert "max_ranks" not in limits  # one limit per mode, none ambiguous
    names = ("max_group_ranks", "max_nvlink_ranks", "max_internode_host_ranks", "max_internode_normal_ranks")
    assert tuple(limits[n] for n in names) == (1024, 72, 32, 1024)


@extension
def test_group_size_at_buffer_creation():
    limits = _native.limits()
    lifecycle.check_group_size(1024, limits)
    with pytest.raises(
        ValueError,
        match=r"at most 1024 ranks \(low-latency mode; normal mode: 72 on one host, 1024 "
        r"across hosts\).* has 1025",
    ):
        lifecycle.check_group_size(1025, limits)


@extension
def test_normal_mode_serves_up_to_its_ranks():
    """On one host a larger group gets no normal region; without low-latency
    mode its Buffer is refused when made. Across hosts normal mode serves the
    whole group."""
    for num_ranks in (8, 16, 72):  # one NVLink domain: a GB200 NVL72 rack
        assert lifecycle.normal_mode_serves(num_ranks, False, low_latency_mode=False)
    assert not lifecycle.normal_mode_serves(73, False, low_latency_mode=True)
    with pytest.raises(
        ValueError,
        match=r"normal mode supports at most 72 ranks in one node \(one NVLink.*the EP "
        r"group has 73 \(low-latency mode: 1024\); Config.gpus_per_nvlink_domain cuts it into nodes joined by "
        r"NVSHMEM; create the Buffer with low_latency_mode=True",
    ):
        lifecycle.normal_mode_serves(73, False, low_latency_mode=False)
    for num_ranks in (16, 128, 1024):
        assert lifecycle.normal_mode_serves(num_ranks, True, low_latency_mode=False)
    assert common.normal_mode_rank_error("f", 1025, True) == (
        "f: normal mode supports at most 1024 ranks in all across hosts, the EP group has 1025 (low-latency mode: 1024)"
    )


def _fake_buffer(num_ranks, spans_hosts, **extra):
    """What the CUDA backend sees of a Buffer, for trace-time checks on CPU."""
    return dt.stand_in_cuda_buffer(num_ranks, num_nodes=2 if spans_hosts else 1, spans_hosts=spans_hosts, **extra)


@extension
def test_normal_mode_calls_name_the_limit():
    spans_hosts = False
    num_ranks, num_tokens, hidden, topk = 73, 8, 256, 2
    buffer = _fake_buffer(num_ranks, spans_hosts)
    module = intranode
    x = jax.ShapeDtypeStruct((num_tokens, hidden), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((num_tokens, topk), jnp.int32)
    w = jax.ShapeDtypeStruct((num_tokens, topk), jnp.float32)
    with pytest.raises(
        ValueError,
        match=r"dispatch: normal mode supports at most 72 ranks .* has 73 \(low-latency "
        r"mode: 1024\)",
    ):
        jax.eval_shape(
            lambda x, idx, w: module.dispatch(
                (x,), idx, w, num_experts=2 * num_ranks, num_worst_tokens=None, buffer=buffer
            ),
            x,
            idx,
            w,
        )
    assert common.normal_mode_rank_error("f", 72, spans_hosts) is None


def _ll_buffer(num_ranks, max_tokens, num_topk, hidden, num_experts, spans_hosts=True):
    region = sizes.low_latency_region_bytes(num_ranks, num_experts, hidden, max_tokens, num_topk)
    send = sizes.low_latency_send_bytes(num_ranks, hidden, max_tokens, num_topk) if spans_hosts else 0
    return _fake_buffer(num_ranks, spans_hosts, num_rdma_bytes=region, num_send_bytes=send)


def _trace_ll_dispatch(buffer, num_tokens, hidden, topk, num_experts, max_tokens, fp8=False):
    x = jax.ShapeDtypeStruct((num_tokens, hidden), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((num_tokens, topk), jnp.int32)
    return jax.eval_shape(
        lambda x, idx: low_latency.low_latency_dispatch(
            x,
            idx,
            num_experts=num_experts,
            num_max_dispatch_tokens_per_rank=max_tokens,
            use_fp8=fp8,
            round_scale=False,
            buffer=buffer,
        ),
        x,
        idx,
    )


@extension
@pytest.mark.parametrize("num_ranks", [16, 32, 1024])
def test_low_latency_traces_at_large_groups(num_ranks):
    """A low-latency dispatch traces with the received shapes of R ranks (its buffer sized by the hint)."""
    max_tokens, topk, hidden = 4, 2, 256
    num_experts = num_ranks  # one per rank
    buffer = _ll_buffer(num_ranks, max_tokens, topk, hidden, num_experts)
    for fp8 in (False, True):
        recv_xs, recv_count, handle = _trace_ll_dispatch(buffer, max_tokens, hidden, topk, num_experts, max_tokens, fp8)
        assert recv_xs[0].shape == (1, num_ranks * max_tokens, hidden) and recv_count.shape == (1,)
        assert handle.recv_src_rank.shape == (1, num_ranks * max_tokens)


@extension
def test_low_latency_refuses_what_the_kernels_cannot_do():
    hidden = 128
    with pytest.raises(ValueError, match=r"low-latency mode supports at most 1024 ranks, the buffer has 1025"):
        _trace_ll_dispatch(
            _fake_buffer(1025, True, num_rdma_bytes=1 << 30, num_send_bytes=1 << 30), 1, hidden, 1, 1025, 1
        )
    # The receivers count every source's (token, k) pairs in 32-bit ints.
    buffer = _fake_buffer(1024, True, num_rdma_bytes=1 << 40, num_send_bytes=1 << 40)
    with pytest.raises(ValueError, match=r"1024 \* 16384 \* 64\) must be < 2\^30"):
        _trace_ll_dispatch(buffer, 1, hidden, 64, 1024, 16384)
    # Shared memory: the peer table (12 KiB at 1024 ranks) on top of the experts' histograms and the FP8 row.
    hidden, num_experts = 24576, 2048
    with pytest.raises(ValueError, match="at 1024 ranks needs more shared memory"):
        _trace_ll_dispatch(buffer, 1, hidden, 1, num_experts, 1, fp8=True)
    small = _fake_buffer(2, True, num_rdma_bytes=1 << 40, num_send_bytes=1 << 40)
    recv_xs, _, _ = _trace_ll_dispatch(small, 1, hidden, 1, num_experts, 1, fp8=True)
    assert recv_xs[0].shape == (num_experts // 2, 2, hidden)


# Sizes ---------------------------------------------------------------------------


def _dispatch_half(num_ranks, num_local, max_tokens, topk, hidden):
    """A bf16 dispatch's half, as csrc/kernels/low_latency.h lays it out: counts, row infos, rows."""
    counts = _align(num_ranks * num_local * 4, ALIGN)
    infos = _align(num_ranks * max_tokens * topk * 4, ALIGN)
    return counts + infos + num_ranks * max_tokens * 2 * hidden


@extension
@pytest.mark.parametrize("num_ranks", RANKS)
def test_low_latency_sizes_at_large_groups(num_ranks):
    ext = _native.extension()
    max_tokens, topk, hidden = 128, 8, 7168
    num_experts = max(256, num_ranks)
    num_local = num_experts // num_ranks
    dispatch = _dispatch_half(num_ranks, num_local, max_tokens, topk, hidden)
    assert ext.low_latency_dispatch_half_bytes(num_ranks, num_local, max_tokens, topk, hidden, False) == dispatch
    combine = max_tokens * topk * hidden * 2
    region = CONTROL + 2 * _align(max(dispatch, combine), HALF_ALIGN)
    assert ext.low_latency_region_bytes(num_ranks, num_local, hidden, max_tokens, topk) == region
    assert sizes.low_latency_region_bytes(num_ranks, num_experts, hidden, max_tokens, topk) == region
    # The send area across hosts: a combine stages a row per (source rank, token, k).
    stage = num_ranks * max_tokens * topk * hidden * 2
    assert ext.low_latency_combine_stage_bytes(num_ranks, hidden, max_tokens, topk) == stage
    assert ext.low_latency_send_bytes(num_ranks, hidden, max_tokens, topk) == _align(stage, HALF_ALIGN)
    # Shared memory: the peer table (a pointer, a PE and a mask entry per rank) on top of the experts' histograms.
    table = lambda ranks: _align(8 * ranks, ALIGN) + 2 * _align(4 * ranks, ALIGN)  # noqa: E731
    for fp8 in (False, True):
        assert (
            ext.low_latency_shared_bytes(num_ranks, num_experts, hidden, fp8)
            - ext.low_latency_shared_bytes(2, num_experts, hidden, fp8)
        ) == table(num_ranks) - table(2)
        assert (
            ext.low_latency_shared_bytes(num_ranks, num_experts, hidden, fp8)
            <= _native.limits()["low_latency_max_shared_bytes"]
        )


@extension
def test_combine_staging_at_256_ranks():
    """The staging area the brief names: about 3.8 GB per GPU at R=256, M=128, K=8, H=7168."""
    assert _native.extension().low_latency_combine_stage_bytes(256, 7168, 128, 8) == 3_758_096_384


@extension
def test_info_reports_large_groups(capsys):
    for num_ranks in info.LARGE_EP_RANKS:
        s = info.large_ep_sizes(num_ranks)
        assert s["num_experts"] == max(256, num_ranks)
        assert s["combine_stage"] == num_ranks * 128 * 8 * 7168 * 2 <= s["send"]
        assert s["region"] == sizes.low_latency_region_bytes(num_ranks, s["num_experts"], 7168, 128, 8)
    info.print_large_ep_sizes()
    out = capsys.readouterr().out
    assert all(f"EP {r}:" in out for r in info.LARGE_EP_RANKS)
    assert "(combine staging 3584.0 MiB)" in out  # EP 256


def test_a_buffer_larger_than_its_gpu_fails_naming_the_bytes():
    parts = {"normal region": 0, "low-latency region": 1000, "low-latency send area": 3000}
    lifecycle.check_fits(parts, 4000, device=0)
    with pytest.raises(
        ValueError,
        match=r"needs 4000 bytes .*low-latency region: 1000 bytes, low-latency send "
        r"area: 3000 bytes\), more than GPU 3's 3999 bytes.*R \* M \* K \* H \* 2",
    ):
        lifecycle.check_fits(parts, 3999, device=3)


# The registry's own checks (they come before any GPU is needed) -------------------


@extension
def test_registry_refuses_groups_it_cannot_serve():
    ext = _native.extension()
    with pytest.raises(ValueError, match=r"an EP group must have 1\.\.1024 devices, got 1025"):
        ext.create_buffer([list(range(1025))], 0, 1 << 16)
    with pytest.raises(
        ValueError,
        match=r"normal mode supports at most 72 ranks on one host .* has 73 \(low-latency "
        r"mode: 1024\)",
    ):
        ext.create_buffer([list(range(73))], 1 << 16, 1 << 16)
    with pytest.raises(ValueError, match="normal mode supports at most 72 ranks"):
        ext.create_ipc_buffer([[0] + [-1] * 72], 1 << 16, 1 << 16)
