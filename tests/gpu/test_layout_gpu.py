"""The CUDA get_dispatch_layout against the reference backend, on all local GPUs.

Every output must equal the reference exactly. Before each CUDA call the
allocator is handed freed arrays of the outputs' sizes filled with poison
(True / -7), which it tends to give back for the outputs, so entries the kernel
does not write show up as mismatches.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import deep_ep_jax
from deep_ep_jax import testing

pytestmark = pytest.mark.gpu

AXIS = "ep"


@pytest.fixture(scope="module")
def buffers(mesh):
    # num_nvl_bytes given: the layout needs no communication memory, and this
    # keeps the test independent of the normal-mode size hint.
    cuda = deep_ep_jax.Buffer(mesh, AXIS, backend="cuda", num_nvl_bytes=1 << 20)
    xla = deep_ep_jax.Buffer(mesh, AXIS, backend="xla")
    yield cuda, xla
    cuda.destroy()


@functools.cache
def _layout_fn(buffer, mesh, num_experts, public):
    """One jitted per-rank function per configuration, so shapes compile once."""
    if public:
        fn = lambda idx: deep_ep_jax.get_dispatch_layout(idx, num_experts=num_experts, buffer=buffer)
    else:  # the backend itself, without the API's sanitising of ids
        fn = lambda idx: buffer.ops.get_dispatch_layout(idx, num_experts=num_experts, buffer=buffer)
    return testing.per_rank(fn, mesh, AXIS)


def _layout(buffer, mesh, topk_idx, num_experts, *, public=True):
    run = _layout_fn(buffer, mesh, num_experts, public)
    if buffer.backend == "cuda":
        assert "deep_ep_jax_get_dispatch_layout" in run.lower(topk_idx).as_text()
        testing.poison_allocator(
            mesh,
            AXIS,
            [
                ((mesh.shape[AXIS],), jnp.int32),
                ((num_experts,), jnp.int32),
                ((topk_idx.shape[0] // mesh.shape[AXIS], mesh.shape[AXIS]), jnp.bool_),
            ],
        )
    return [np.asarray(a) for a in run(topk_idx)]


def _assert_same(got, want):
    names = ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank")
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape, w.dtype, w.shape)
        np.testing.assert_array_equal(g, w, err_msg=name)


def _cases(num_ranks):
    # (tokens per rank, top-k, experts per rank); top-k clipped to what the routing can pick.
    for num_tokens, topk, per_rank in [
        (1, 1, 1),
        (1, 8, 4),
        (3, 2, 1),
        (129, 4, 8),
        (1000, 8, 128 // num_ranks),
        (4096, 8, 256 // num_ranks),
    ]:
        num_experts = per_rank * num_ranks
        usable = num_experts - per_rank if num_ranks > 1 else num_experts
        yield num_tokens, max(1, min(topk, usable)), num_experts


@pytest.mark.parametrize("kind", testing.ROUTING_KINDS)
def test_layout_matches_reference(mesh, buffers, kind):
    cuda, xla = buffers
    num_ranks = mesh.shape[AXIS]
    for seed, (num_tokens, topk, num_experts) in enumerate(_cases(num_ranks)):
        if kind == "rank_empty" and num_ranks < 2:
            continue
        idx, _ = testing.make_routing(seed, num_ranks * num_tokens, num_experts, topk, num_ranks, kind)
        got = _layout(cuda, mesh, jnp.asarray(idx), num_experts)
        want = _layout(xla, mesh, jnp.asarray(idx), num_experts)
        _assert_same(got, want)
        if kind == "rank_empty":  # the skew really happened
            assert (got[0][:, -1] == 0).all()


@pytest.mark.parametrize("num_experts_per_rank", [1, 3, 32])
def test_layout_raw_ids_and_duplicates(mesh, buffers, num_experts_per_rank):
    """The kernel itself ignores ids outside [0, E) and counts duplicates:
    the same expert twice counts twice per expert, the same rank once."""
    cuda, xla = buffers
    num_ranks = mesh.shape[AXIS]
    num_experts = num_experts_per_rank * num_ranks
    rng = np.random.default_rng(num_experts)
    idx = rng.integers(-3, num_experts + 3, size=(num_ranks * 517, 8), dtype=np.int32)
    idx[:, 1] = idx[:, 0]  # duplicates in every row
    idx[::5] = -1  # tokens with no expert
    sanitized = np.where((idx < 0) | (idx >= num_experts), -1, idx).astype(np.int32)
    got = _layout(cuda, mesh, jnp.asarray(idx), num_experts, public=False)
    want = _layout(xla, mesh, jnp.asarray(sanitized), num_experts, public=False)
    _assert_same(got, want)


def test_layout_in_fori_loop(mesh, buffers):
    """Under jit in a lax.fori_loop (a while loop, possibly a command buffer):
    every iteration routes differently; the summed counts must match."""
    cuda, xla = buffers
    num_ranks = mesh.shape[AXIS]
    num_experts, num_iters = 16 * num_ranks, 50
    idx, _ = testing.make_routing(7, num_ranks * 256, num_experts, 8, num_ranks, "minus_one")

    def make(buffer):
        def fn(local_idx):
            def body(i, acc):
                shifted = jnp.where(local_idx >= 0, (local_idx + i) % num_experts, -1)
                per_rank, per_expert, in_rank = deep_ep_jax.get_dispatch_layout(
                    shifted, num_experts=num_experts, buffer=buffer
                )
                return acc[0] + per_rank, acc[1] + per_expert, acc[2] + in_rank.astype(jnp.int32)

            init = (
                jnp.zeros(num_ranks, jnp.int32),
                jnp.zeros(num_experts, jnp.int32),
                jnp.zeros((local_idx.shape[0], num_ranks), jnp.int32),
            )
            return lax.fori_loop(0, num_iters, body, init)

        return testing.per_rank(fn, mesh, AXIS)

    run_cuda = make(cuda)
    assert "deep_ep_jax_get_dispatch_layout" in run_cuda.lower(jnp.asarray(idx)).as_text()
    got = [np.asarray(a) for a in run_cuda(jnp.asarray(idx))]
    want = [np.asarray(a) for a in make(xla)(jnp.asarray(idx))]
    _assert_same(got, want)
    assert got[0].sum() > 0


def test_buffer_registry_lifecycle(mesh):
    """The runtime under the Buffer: create/destroy bookkeeping, clear errors,
    and rollback of a failed allocation (nothing leaks)."""
    from deep_ep_jax import _native
    from deep_ep_jax.backends.cuda import lifecycle as cuda

    ext = _native.extension()
    groups = [[d.local_hardware_id for d in mesh.devices.flat]]
    live = ext.num_live_buffers()
    buffer_id = cuda.create_buffer(groups, 1 << 20, 1 << 16)
    assert ext.num_live_buffers() == live + 1
    cuda.destroy_buffer(buffer_id)
    assert ext.num_live_buffers() == live
    with pytest.raises(ValueError, match="does not exist"):
        cuda.destroy_buffer(buffer_id)
    with pytest.raises(RuntimeError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
        cuda.create_buffer(groups, 1 << 50, 0)  # 1 PiB: out of memory
    assert ext.num_live_buffers() == live
    with pytest.raises(ValueError, match="appears twice"):
        cuda.create_buffer([groups[0][:1] * 2], 1 << 20, 0)
