"""Internode normal mode at 16..128 ranks (and its 1024-rank limit) on CPU:
the limits, the region sizes from the extension's size queries against the
layout of csrc/kernels/internode.h written out here, trace-time shapes of
dispatch, cached dispatch and combine, and a Buffer too large for its GPU
failing at creation naming the bytes. The kernels run on GPUs in the worker
case shared_gpu (tests/multiprocess_worker.py) with 16 processes."""

import jax
import jax.numpy as jnp
import pytest

from deep_ep_jax import _native
from deep_ep_jax import testing as dt
from deep_ep_jax.backends.cuda import internode, lifecycle, sizes

extension = pytest.mark.extension

CONTROL, ALIGN, VECTOR, MAX_BLOCKS = 1 << 16, 256, 16, 132
# (hosts, GPUs per host)
GROUPS = [(2, 8), (4, 4), (4, 8), (8, 8), (16, 8), (128, 1)]


def _align(n, a):
    return -(-n // a) * a


def _sync_bytes(num_ranks):
    """Control bytes, records [2][R] of (tag, grid, pipelined, R host counts, R rank counts), ready [R],
    rdma_done and done [R][132], the pipelined kernels' 64-bit tails and dispatch's (head, count) pairs [R][132]."""
    record = _align(3 + 2 * num_ranks, 4) * 4
    return (
        CONTROL
        + _align(2 * num_ranks * record, ALIGN)
        + _align(4 * num_ranks, ALIGN)
        + 2 * _align(4 * num_ranks * MAX_BLOCKS, ALIGN)
        + 2 * _align(8 * num_ranks * MAX_BLOCKS, ALIGN)
    )


def _dispatch_bytes(num_tokens, num_rows, topk, row, scales, num_ranks, num_nodes):
    packet = _align(row, VECTOR) + _align(scales, VECTOR) + _align(4 + 8 * topk, VECTOR)  # no per-rank metadata
    areas = [
        num_rows * row,
        num_rows * scales,
        num_rows * topk * 4,
        num_rows * topk * 4,
        num_rows * 4,
        num_tokens * packet,
        num_nodes * num_tokens * packet,
        num_tokens * num_ranks * 4,
        num_tokens * num_ranks * 4,
    ]  # final rows per host: staged, received
    return _sync_bytes(num_ranks) + sum(_align(a, ALIGN) for a in areas)


def _combine_slot_bytes(num_tokens, topk, hidden, num_ranks):
    return _align(num_ranks * num_tokens * (_align(2 * hidden, VECTOR) + _align(4 * topk, VECTOR)), ALIGN)


def _combine_bytes(num_tokens, topk, hidden, num_ranks, num_nodes):
    """Slots [G][H][T] at the forwarder, partials [H][T] at the source, lists [H][T] of (token, mask, G rows)
    staged and received."""
    packet = _align(2 * hidden, VECTOR) + _align(4 * topk, VECTOR)
    entry = 4 * (2 + num_ranks // num_nodes)
    areas = [num_nodes * num_tokens * packet, num_nodes * num_tokens * entry, num_nodes * num_tokens * entry]
    return (
        _sync_bytes(num_ranks)
        + _combine_slot_bytes(num_tokens, topk, hidden, num_ranks)
        + sum(_align(a, ALIGN) for a in areas)
    )


@extension
def test_limits():
    limits = _native.limits()
    assert limits["max_internode_normal_ranks"] == limits["max_group_ranks"] == 1024
    assert limits["max_internode_host_ranks"] == 32  # ranks per host across hosts


@extension
@pytest.mark.parametrize("num_nodes,per_host", GROUPS)
def test_sizes(num_nodes, per_host):
    ext = _native.extension()
    num_ranks = num_nodes * per_host
    num_tokens, topk, hidden = 96, 8, 512
    rows = num_tokens * num_ranks
    assert ext.internode_sync_bytes(num_ranks) == _sync_bytes(num_ranks)
    for row, scales in ((2 * hidden, 0), (hidden, hidden // 128 * 4)):
        assert ext.internode_dispatch_region_bytes(
            num_tokens, rows, topk, row, scales, num_ranks, num_nodes
        ) == _dispatch_bytes(num_tokens, rows, topk, row, scales, num_ranks, num_nodes)
    slots = _combine_slot_bytes(num_tokens, topk, hidden, num_ranks)
    assert ext.internode_combine_slot_bytes(num_tokens, topk, hidden, num_ranks) == slots
    combine = _combine_bytes(num_tokens, topk, hidden, num_ranks, num_nodes)
    assert ext.internode_combine_region_bytes(num_tokens, rows, topk, hidden, num_ranks, num_nodes) == combine
    hint = sizes.internode_region_bytes(num_ranks, num_nodes, hidden, num_tokens, topk)
    assert hint == max(_dispatch_bytes(num_tokens, rows, topk, 2 * hidden, 0, num_ranks, num_nodes), combine)


@extension
def test_sync_area_grows_with_the_group_only():
    ext = _native.extension()
    assert ext.internode_sync_bytes(8) < 96 * 1024  # today's groups: little beyond the control bytes
    assert ext.internode_sync_bytes(128) < 768 * 1024
    assert ext.internode_sync_bytes(1024) < 20 * 2**20
    with pytest.raises(ValueError, match="multiple of num_nodes"):
        ext.internode_dispatch_region_bytes(8, 8, 1, 16, 0, 12, 5)


def _fake_buffer(num_ranks, num_nodes, num_nvl_bytes):
    return dt.stand_in_cuda_buffer(num_ranks, num_nodes=num_nodes, num_nvl_bytes=num_nvl_bytes, spans_hosts=True)


@extension
@pytest.mark.parametrize("num_nodes,per_host", [(2, 8), (16, 8)])
def test_calls_trace_at_large_groups(num_nodes, per_host):
    """Dispatch, its cached dispatch and combine trace with R-rank shapes on a Buffer sized by the hint."""
    num_ranks = num_nodes * per_host
    num_tokens, hidden, topk, num_experts = 16, 256, 4, 2 * num_ranks
    buffer = _fake_buffer(
        num_ranks, num_nodes, sizes.internode_region_bytes(num_ranks, num_nodes, hidden, num_tokens, topk)
    )
    x = jax.ShapeDtypeStruct((num_tokens, hidden), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((num_tokens, topk), jnp.int32)
    w = jax.ShapeDtypeStruct((num_tokens, topk), jnp.float32)

    def round_trip(x, idx, w):
        recv_xs, _, recv_w, handle = internode.dispatch(
            (x,), idx, w, num_experts=num_experts, num_worst_tokens=None, buffer=buffer
        )
        again = internode.cached_dispatch((x,), w, handle, buffer=buffer)
        out = internode.combine(recv_xs[0], recv_w, handle, buffer=buffer)
        return recv_xs, handle, again, out

    recv_xs, handle, again, out = jax.eval_shape(round_trip, x, idx, w)
    rows = num_tokens * num_ranks
    assert recv_xs[0].shape == (rows, hidden) and handle.send_pos.shape == (num_tokens, num_ranks)
    assert handle.rank_prefix_matrix.shape == (num_ranks, num_ranks)
    assert jax.tree.leaves(again)[0].shape == (rows, hidden)
    assert jax.tree.leaves(out)[0].shape == (num_tokens, hidden)
    need = _dispatch_bytes(num_tokens, rows, topk, 2 * hidden, 0, num_ranks, num_nodes)
    small = _fake_buffer(num_ranks, num_nodes, need - 1)
    with pytest.raises(ValueError, match=f"needs {need} bytes"):
        jax.eval_shape(
            lambda x, idx, w: internode.dispatch(
                (x,), idx, w, num_experts=num_experts, num_worst_tokens=None, buffer=small
            ),
            x,
            idx,
            w,
        )


@extension
def test_standard_case_memory_per_gpu():
    """The standard case (4096 tokens per rank, hidden 7168, top-8): the
    region per GPU is the bf16 dispatch's (R * T received rows and the
    packets of H + 1 hosts); combine, reduced per host, fits in it (R * T
    slots and H * T partials); a Buffer that cannot fit fails at creation
    naming the bytes."""
    ext = _native.extension()
    previous = 0
    for num_nodes in (2, 4, 8, 16):
        num_ranks, rows = 8 * num_nodes, 4096 * 8 * num_nodes
        region = sizes.internode_region_bytes(num_ranks, num_nodes, 7168, 4096, 8)
        assert region == _dispatch_bytes(4096, rows, 8, 2 * 7168, 0, num_ranks, num_nodes)
        slots = ext.internode_combine_slot_bytes(4096, 8, 7168, num_ranks)
        assert slots == _combine_slot_bytes(4096, 8, 7168, num_ranks)
        combine = ext.internode_combine_region_bytes(4096, rows, 8, 7168, num_ranks, num_nodes)
        assert slots < combine < region and combine < slots * (1 + 1 / 8 + 1 / 32)
        assert region > previous
        previous = region
    assert 7.9 * 2**30 < previous < 8 * 2**30  # 16 x 8
    with pytest.raises(
        ValueError,
        match=rf"needs {previous} bytes .*normal region: {previous} bytes.*more than GPU "
        r"0's .*R \* T \* 2H bytes",
    ):
        lifecycle.check_fits({"normal region": previous, "low-latency region": 0}, 6 * 2**30, device=0)
