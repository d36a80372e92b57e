"""Helpers for tests and benchmarks: routing generators, per-rank runs, and
exact comparisons on poisoned outputs.

Routing kinds (global arrays [R * T, K], rank r holds rows [r*T, (r+1)*T)):
  "random"        K distinct random experts per token
  "one_expert"    every token to expert 0 only (the other slots -1)
  "rank_empty"    no token picks an expert of the last rank
  "minus_one"     random, with about a third of the slots -1 (some tokens all -1)
  "out_of_range"  random, with some ids >= E or < -1 (the API treats them as -1)
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from deep_ep_jax.config import Config

ROUTING_KINDS = ("random", "one_expert", "rank_empty", "minus_one", "out_of_range")


def stand_in_cuda_buffer(num_ranks, **fields):
    """What the CUDA backend's operations read of a Buffer, for checking on a
    machine without GPUs what they trace and refuse (one EP group of device
    ids 0..R-1 on one host; `fields` override any of it)."""
    defaults = dict(
        num_ranks=num_ranks,
        axis_name="ep",
        buffer_id=1,
        backend="cuda",
        config=Config(),
        num_nodes=1,
        spans_hosts=False,
        staged=False,
        ipc=False,
        num_nvl_bytes=0,
        num_rdma_bytes=0,
        num_send_bytes=0,
        ep_groups=(tuple(range(num_ranks)),),
        nvshmem=fields.get("spans_hosts", False),  # several nodes: on several hosts
    )
    return types.SimpleNamespace(**{**defaults, **fields})


def scaled_experts(scales, recv_x, recv_topk_idx, recv_topk_weights):
    """Experts that check communication, not arithmetic: local expert l scales
    its rows by scales[l], a row's output is row * (sum over k, in k order, of
    weight * scale) in float32, as bf16 (tests/oracle.py: scaled_expert_rows).
    With small integers as rows, weights in quarters and scales powers of two,
    every sum is exact, so any order gives the same bits, gradients included."""
    local = jnp.where(recv_topk_idx >= 0, recv_topk_idx, 0)
    factor = jnp.where(recv_topk_idx >= 0, recv_topk_weights * scales[local], 0.0)
    total = factor[:, 0]
    for k in range(1, factor.shape[1]):
        total = total + factor[:, k]
    return (recv_x.astype(jnp.float32) * total[:, None]).astype(jnp.bfloat16)


def make_routing(seed, num_tokens, num_experts, topk, num_ranks, kind="random"):
    """Returns (topk_idx int32 [num_tokens, topk], topk_weights float32) as numpy."""
    rng = np.random.default_rng(seed)
    pool = num_experts
    if kind == "rank_empty":
        if num_ranks < 2:
            raise ValueError("rank_empty routing needs at least 2 ranks")
        pool = num_experts - num_experts // num_ranks  # experts of ranks 0..R-2
    if topk > pool:
        raise ValueError(f"topk {topk} > usable experts {pool}")
    scores = rng.random((num_tokens, pool))
    idx = np.argsort(scores, axis=1)[:, :topk].astype(np.int32)
    if kind == "one_expert":
        idx[:] = -1
        idx[:, 0] = 0
    elif kind == "minus_one":
        idx[rng.random(idx.shape) < 0.33] = -1
        idx[:: max(1, num_tokens // 4)] = -1
    elif kind == "out_of_range":
        bad = rng.random(idx.shape) < 0.2
        idx[bad] = rng.choice(np.array([num_experts, num_experts + 7, -2, -100], np.int32), size=int(bad.sum()))
    elif kind not in ("random", "rank_empty"):
        raise ValueError(f"unknown routing kind {kind!r}; one of {ROUTING_KINDS}")
    weights = rng.random(idx.shape).astype(np.float32) + 0.1
    return idx, weights


def random_rows(seed, shape, dtype=jnp.bfloat16):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), dtype)


def random_pair(seed, fmt, num_tokens, hidden):
    """A quantized pair of `fmt` (a config.RowFormat) for [num_tokens, hidden], every byte random
    (NaN patterns included: dispatch moves a pair's bytes as they are, so any bytes must arrive)."""
    rng = np.random.default_rng(seed)
    if fmt.data == np.dtype(jnp.float4_e2m1fn):  # one 4-bit value per element
        data = rng.integers(0, 16, (num_tokens, hidden), np.uint8).view(fmt.data)
    else:
        data = rng.integers(0, 256, (num_tokens, hidden // fmt.pack * fmt.data.itemsize), np.uint8).view(fmt.data)
    scale_bytes = rng.integers(0, 256, (num_tokens, hidden // fmt.block * fmt.scales.itemsize), np.uint8)
    return jnp.asarray(data), jnp.asarray(scale_bytes.view(fmt.scales))


def ep_mesh(num_ranks, axis_name="ep", platform=None):
    devices = jax.devices(platform) if platform else jax.devices()
    if len(devices) < num_ranks:
        raise ValueError(f"need {num_ranks} devices, have {len(devices)}")
    return Mesh(np.array(devices[:num_ranks]), (axis_name,))


def per_rank(fn, mesh, axis_name, *, jit=True, check_vma=False):
    """Runs fn(*args) per rank under shard_map: every argument is split along
    its leading axis; every output comes back stacked, [R, ...] (so scalars
    and handles work too). check_vma=True is shard_map's default."""

    def body(*args):
        out = fn(*args)
        return jax.tree.map(lambda a: None if a is None else jnp.expand_dims(a, 0), out)

    def run(*args):
        in_specs = jax.tree.map(lambda _: P(axis_name), args)
        mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P(axis_name), check_vma=check_vma)
        return mapped(*args)

    return jax.jit(run) if jit else run


def filled(shape, value, dtype, sharding):
    """A global array of `value` laid out by `sharding`, each process filling
    only its own shards (device_put of one host array would compare the array
    across processes, and NaN poison never compares equal)."""
    return jax.make_array_from_callback(
        tuple(shape), sharding, lambda index: np.full(np.empty(shape, np.bool_)[index].shape, value, dtype)
    )


def bits(a):
    """An exact comparison view: floats as their bit patterns (NaN == NaN)."""
    a = np.asarray(a)
    if a.dtype.kind not in "fV":  # bf16 and FP8 (ml_dtypes) are kind "V"
        return a
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_bits_equal(got, want, what):
    """got and want of one shape and dtype, equal bit for bit; the message
    names how many entries differ and the first."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype, want.shape, want.dtype)
    g, w = bits(got), bits(want)
    if not np.array_equal(g, w):
        bad = np.argwhere(g != w)
        raise AssertionError(
            f"{what}: {len(bad)} of {g.size} entries differ, first at {bad[0].tolist()}: "
            f"got {got[tuple(bad[0])]}, want {want[tuple(bad[0])]}"
        )


def poison_allocator(mesh, axis_name, per_rank_shapes):
    """Allocates and frees arrays of the outputs' per-rank sizes, each
    (shape, dtype) or (shape, dtype, value), full of poison (by default NaN,
    -7, True), so rows a kernel leaves unwritten show in its outputs."""
    sharding = jax.sharding.NamedSharding(mesh, P(axis_name))
    num_ranks = mesh.shape[axis_name]
    arrays = []
    for shape, dtype, *value in per_rank_shapes:
        if not value:
            value = [True if dtype == jnp.bool_ else (-7 if jnp.issubdtype(dtype, jnp.integer) else jnp.nan)]
        arrays.append(filled((num_ranks,) + tuple(shape), value[0], dtype, sharding))
    jax.block_until_ready(arrays)
    del arrays
