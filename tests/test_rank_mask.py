"""The rank mask of low-latency mode (docs/usage.md, "When a rank fails"):
Config.mask_failed_ranks, low_latency_mask, low_latency_set_mask and
drop_masked_experts on the xla backend, which masks no rank, and the
contract the CUDA kernels keep once ranks are masked, as tests/oracle.py
states it (mask_ranks). The kernels themselves run on GPUs: ranks killed or
stalled among processes sharing one (tests/gpu/test_scale_gpu.py, worker
case masked_rank)."""

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest

import deep_ep_jax as dej
from deep_ep_jax import testing as dt

R, M = 4, 8


def _buffer(**kwargs):
    mesh = dt.ep_mesh(R, platform="cpu")
    return dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=M, **kwargs)


def test_the_xla_backend_masks_no_rank():
    """Its mask is zeros on every rank; setting one is refused, naming the CUDA backend."""
    buffer = _buffer(config=dej.Config(mask_failed_ranks=True))
    mask = dt.per_rank(lambda: dej.low_latency_mask(buffer=buffer), buffer.mesh, "ep", check_vma=True)()
    assert mask.shape == (R, R) and mask.dtype == jnp.int32 and not np.asarray(mask).any()
    with pytest.raises(NotImplementedError, match="masking needs the CUDA backend"):
        _set_mask(buffer, np.zeros(R, bool))


def _set_mask(buffer, mask):
    """low_latency_set_mask(mask) on every rank (mask: one rank's)."""
    masks = jnp.asarray(np.stack([mask] * R))
    return dt.per_rank(lambda m: dej.low_latency_set_mask(m[0], buffer=buffer), buffer.mesh, "ep")(masks)


@pytest.mark.parametrize(
    "mask,error,match",
    [
        (np.zeros(R + 1, np.int32), ValueError, r"mask must be \[4\] \(one entry per rank\)"),
        (np.zeros((R, 1), np.int32), ValueError, r"mask must be \[4\]"),
        (np.zeros(R, np.float32), TypeError, "mask must be bool or an integer type, got float32"),
    ],
)
def test_set_mask_refuses_bad_masks(mask, error, match):
    with pytest.raises(error, match=match):
        _set_mask(_buffer(), mask)


def test_mask_calls_need_low_latency_mode():
    buffer = dej.Buffer(dt.ep_mesh(R, platform="cpu"), "ep", backend="xla")
    with pytest.raises(ValueError, match="low_latency_mask: the buffer was made without low_latency_mode=True"):
        dt.per_rank(lambda: dej.low_latency_mask(buffer=buffer), buffer.mesh, "ep")()
    with pytest.raises(ValueError, match="low_latency_set_mask: the buffer was made without low_latency_mode"):
        _set_mask(buffer, np.zeros(R, np.int32))


def test_config_mask_failed_ranks():
    """(Its variable, DEEP_EP_JAX_MASK_FAILED_RANKS: tests/test_environment.py.)"""
    with pytest.raises(TypeError, match="Config.mask_failed_ranks must be a bool"):
        dej.Config(mask_failed_ranks=1)


@pytest.mark.parametrize("masked", [(), (2,), (0, 3)])
def test_drop_masked_experts_is_the_oracles_mask(masked, rng):
    """On each rank that is not masked, drop_masked_experts gives the routing that
    oracle.mask_ranks says the kernels serve (ids of masked ranks' experts -1,
    -1 entries kept); masked ranks send nothing."""
    num_experts, topk, num_tokens = 4 * R, 5, 7
    idx, _ = dt.make_routing(int(rng.integers(1 << 30)), R * num_tokens, num_experts, topk, R, "minus_one")
    idx = np.asarray(idx).reshape(R, num_tokens, topk)
    mask = np.isin(np.arange(R), masked).astype(np.int32)
    want = oracle.mask_ranks(idx, masked, num_experts)
    got = np.asarray(
        jax.jit(dej.drop_masked_experts, static_argnames="num_experts")(idx, mask, num_experts=num_experts)
    )
    live = [r for r in range(R) if r not in masked]
    np.testing.assert_array_equal(got[live], want[live])
    assert (want[list(masked)] == -1).all()
    if masked:
        assert (got != idx).any()  # the routing reaches a masked rank's experts
    with pytest.raises(ValueError, match="R dividing num_experts"):
        dej.drop_masked_experts(jnp.asarray(idx), jnp.zeros(3, jnp.int32), num_experts=num_experts)
    with pytest.raises(TypeError, match="mask must be bool or an integer type"):
        dej.drop_masked_experts(jnp.asarray(idx), jnp.full(R, 0.5), num_experts=num_experts)
    with pytest.raises(ValueError, match="R dividing num_experts"):  # an empty mask
        dej.drop_masked_experts(jnp.asarray(idx), jnp.zeros(0, jnp.int32), num_experts=num_experts)
    for bad in (0, -num_experts, float(num_experts)):
        with pytest.raises(ValueError, match="num_experts must be a positive int"):
            dej.drop_masked_experts(jnp.asarray(idx), jnp.asarray(mask), num_experts=bad)
    with pytest.raises(TypeError, match="topk_idx must be int32, got float32"):
        dej.drop_masked_experts(jnp.asarray(idx, jnp.float32), jnp.asarray(mask), num_experts=num_experts)
    # Ids outside [0, E) mean no expert, whoever is masked: left as they are.
    odd = jnp.asarray([[num_experts, -7, 0]], jnp.int32)
    got = dej.drop_masked_experts(odd, jnp.ones(R, jnp.int32), num_experts=num_experts)
    np.testing.assert_array_equal(got, [[num_experts, -7, -1]])


@pytest.mark.parametrize(
    "masks,me,barrier",
    [
        ([], 0, ("deep_ep_jax/buffer/7/destroy", None)),  # no rank masked: every process
        ([(4, [2])], 0, ("deep_ep_jax/buffer/7/destroy/[0, 1, 3]", [0, 1, 3])),  # the survivors only
        ([(5, [2, 3])], 1, ("deep_ep_jax/buffer/7/destroy/[0, 1]", [0, 1])),
        ([(5, [1])], 1, None),  # masked itself: frees at once
    ],
)
def test_destroy_waits_for_the_processes_of_unmasked_ranks(monkeypatch, masks, me, barrier):
    """Buffer.destroy's barrier (backends/cuda/lifecycle.py): 4 processes, one
    rank each (GPU ordinals 4 + process); the masks read from this process's
    devices decide whom it waits for, and the memory is freed either way."""
    from types import SimpleNamespace

    from deep_ep_jax.backends.cuda import lifecycle

    grid = [[SimpleNamespace(process_index=p, local_hardware_id=4 + p) for p in range(4)]]
    calls = []
    monkeypatch.setattr(lifecycle, "device_grid", lambda buffer: grid)
    monkeypatch.setattr(lifecycle.jax, "process_index", lambda: me)
    monkeypatch.setattr(lifecycle.jax, "process_count", lambda: 4)
    monkeypatch.setattr(lifecycle._native, "extension", lambda: SimpleNamespace(read_masks=lambda buffer_id: masks))
    monkeypatch.setattr(lifecycle, "synchronize_buffer", lambda buffer_id: None)
    monkeypatch.setattr(lifecycle, "destroy_buffer", lambda buffer_id: calls.append("freed"))
    monkeypatch.setattr(
        lifecycle.multiprocess, "barrier", lambda name, t, processes=None: calls.append((name, processes))
    )
    buffer = SimpleNamespace(
        buffer_id=7,
        ipc=True,
        nvshmem=False,
        num_rdma_bytes=1 << 20,
        store_key="deep_ep_jax/buffer/7",
        config=dej.Config(mask_failed_ranks=True, timeout_s=3),
    )
    lifecycle.destroy(buffer)
    assert calls == ([barrier] if barrier else []) + ["freed"]
