"""Normal-mode CUDA kernels (dispatch, cached dispatch, combine) against the
xla backend, through the public API, on all local GPUs (R = 2..8).

Everything must match the reference bit for bit: received rows [0,
num_recv_tokens), every metadata row (padding included: ids -1, weights 0,
source -1), the whole handle, combine's sums. Before each CUDA run the
allocator is handed freed arrays of the outputs' sizes filled with poison,
which it tends to give back for the outputs, and every case runs twice with
different data, so rows the kernels do not write show up as mismatches.

The last tests run on CPU, with the extension built (it gives the sizes):
the trace-time checks and the size hint.
"""

import dataclasses
import functools
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import deep_ep_jax
from deep_ep_jax import _native, testing
from deep_ep_jax.backends import reference
from deep_ep_jax.backends.cuda import intranode, sizes

AXIS = "ep"
bits, assert_bits_equal = testing.bits, testing.assert_bits_equal


ROOT = pathlib.Path(__file__).resolve().parents[2]
gpu = pytest.mark.gpu


# Helpers ----------------------------------------------------------------------


def make_x(seed, num_ranks, num_tokens, hidden, fp8):
    x = testing.random_rows(seed, (num_ranks * num_tokens, hidden))
    return tuple(reference.quantize_fp8(x)) if fp8 else x


def routing(seed, num_ranks, num_tokens, num_experts, topk, kind):
    usable = num_experts - num_experts // num_ranks if kind == "rank_empty" else num_experts
    idx, w = testing.make_routing(seed, num_ranks * num_tokens, num_experts, max(1, min(topk, usable)), num_ranks, kind)
    return jnp.asarray(idx), jnp.asarray(w)


@functools.cache
def dispatch_combine_runner(buffer, mesh, num_experts, num_worst_tokens):
    """Per rank: dispatch, combine of fresh rows y with the received weights,
    and the backend's cached dispatch of x along the same handle."""

    def fn(x, idx, w, y):
        recv_x, recv_idx, recv_w, handle = deep_ep_jax.dispatch(
            x, idx, w, num_experts=num_experts, buffer=buffer, num_worst_tokens=num_worst_tokens
        )
        out, out_w = deep_ep_jax.combine(y, handle, recv_w, buffer=buffer)
        xs = tuple(x) if isinstance(x, tuple) else (x,)
        cached_xs, cached_w = buffer.ops.cached_dispatch(xs, w, handle, buffer=buffer)
        return recv_x, recv_idx, recv_w, handle, out, out_w, cached_xs, cached_w

    return testing.per_rank(fn, mesh, AXIS)


def run_case(
    buffers, mesh, *, seed, num_tokens, hidden, topk, num_experts, kind="random", fp8=False, num_worst_tokens=None
):
    cuda, xla = buffers
    num_ranks = mesh.shape[AXIS]
    rows = num_worst_tokens or num_tokens * num_ranks
    x = make_x(seed, num_ranks, num_tokens, hidden, fp8)
    idx, w = routing(seed, num_ranks, num_tokens, num_experts, topk, kind)
    y = testing.random_rows(seed + 1, (num_ranks * rows, hidden))
    k = idx.shape[1]
    testing.poison_allocator(
        mesh,
        AXIS,
        [
            ((rows, hidden), jnp.bfloat16),
            ((rows, k), jnp.int32),
            ((rows, k), jnp.float32),
            ((rows,), jnp.int32),
            ((num_tokens, num_ranks), jnp.int32),
            ((num_tokens, hidden), jnp.bfloat16),
            ((num_tokens, k), jnp.float32),
        ],
    )
    got = dispatch_combine_runner(cuda, mesh, num_experts, num_worst_tokens)(x, idx, w, y)
    want = dispatch_combine_runner(xla, mesh, num_experts, num_worst_tokens)(x, idx, w, y)
    check_same(got, want, fp8)
    return got


def check_same(got, want, fp8):
    recv_x, recv_idx, recv_w, handle, out, out_w, cached_xs, cached_w = got
    w_recv_x, w_recv_idx, w_recv_w, w_handle, w_out, w_out_w, w_cached_xs, w_cached_w = want
    num_recv = np.asarray(handle.num_recv_tokens)
    for name in (
        "num_recv_tokens",
        "num_dropped_tokens",
        "num_tokens_per_rank",
        "rank_prefix_matrix",
        "is_token_in_rank",
        "send_pos",
        "recv_src_idx",
        "recv_src_rank",
        "num_recv_tokens_per_expert",
    ):
        assert_bits_equal(getattr(handle, name), getattr(w_handle, name), f"handle.{name}")
    assert_bits_equal(recv_idx, w_recv_idx, "recv_topk_idx")
    assert_bits_equal(recv_w, w_recv_w, "recv_topk_weights")
    assert_bits_equal(cached_w, w_cached_w, "cached_dispatch weights")
    parts = (recv_x, w_recv_x) if fp8 else ((recv_x,), (w_recv_x,))
    for r, n in enumerate(num_recv):
        for i, (g, w) in enumerate(zip(*parts)):
            assert_bits_equal(np.asarray(g)[r, :n], np.asarray(w)[r, :n], f"recv_x[{i}] of rank {r}")
        for i, (g, w) in enumerate(zip(cached_xs, w_cached_xs)):
            assert_bits_equal(np.asarray(g)[r, :n], np.asarray(w)[r, :n], f"cached_dispatch rows[{i}] of rank {r}")
        # Padding rows, explicitly.
        assert (np.asarray(recv_idx)[r, n:] == -1).all()
        assert (bits(np.asarray(recv_w)[r, n:]) == 0).all()
        assert (np.asarray(handle.recv_src_idx)[r, n:] == -1).all()
        assert (np.asarray(handle.recv_src_rank)[r, n:] == -1).all()
    assert_bits_equal(out, w_out, "combine out")
    assert_bits_equal(out_w, w_out_w, "combine out_weights")


def cases(num_ranks):
    # (tokens per rank, hidden, top-k, experts)
    yield 1, 2048, 1, num_ranks
    yield 1, 7168, 8, 256
    yield 7, 4096, 2, 2 * num_ranks
    yield 128, 2048, 4, 16 * num_ranks
    yield 333, 7168, 8, 256
    yield 1024, 4096, 6, 64 * num_ranks


# Dispatch / combine against the reference --------------------------------------


@gpu
@pytest.mark.parametrize("kind", testing.ROUTING_KINDS)
def test_matches_reference(mesh, buffers, kind):
    num_ranks = mesh.shape[AXIS]
    for seed, (num_tokens, hidden, topk, num_experts) in enumerate(cases(num_ranks)):
        if kind == "rank_empty" and num_ranks < 2:
            continue
        for repeat in range(2):  # fresh data on the same buffers: stale rows would show
            got = run_case(
                buffers,
                mesh,
                seed=100 * seed + repeat,
                num_tokens=num_tokens,
                hidden=hidden,
                topk=topk,
                num_experts=num_experts,
                kind=kind,
            )
        if kind == "rank_empty":
            assert np.asarray(got[3].num_recv_tokens)[-1] == 0
        if kind == "random" and num_tokens > 1:
            assert (np.asarray(got[3].num_recv_tokens) > 0).all()


@gpu
def test_topk_range(mesh, buffers):
    num_ranks = mesh.shape[AXIS]
    for topk in range(1, 10):
        run_case(
            buffers,
            mesh,
            seed=topk,
            num_tokens=77,
            hidden=2048,
            topk=topk,
            num_experts=16 * num_ranks,
            kind="minus_one",
        )


@gpu
@pytest.mark.parametrize("kind", ["random", "one_expert", "minus_one"])
def test_fp8_pairs(mesh, buffers, kind):
    num_ranks = mesh.shape[AXIS]
    for seed, (num_tokens, hidden, topk, num_experts) in enumerate(cases(num_ranks)):
        run_case(
            buffers,
            mesh,
            seed=seed,
            num_tokens=num_tokens,
            hidden=hidden,
            topk=topk,
            num_experts=num_experts,
            kind=kind,
            fp8=True,
        )
    # hidden 128 * 3: scale rows of 12 bytes, not a multiple of 16.
    run_case(buffers, mesh, seed=99, num_tokens=65, hidden=384, topk=3, num_experts=4 * num_ranks, kind=kind, fp8=True)


@gpu
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.7])
def test_num_worst_tokens_smaller(mesh, buffers, fraction):
    num_ranks = mesh.shape[AXIS]
    num_tokens = 256
    rows = max(1, int(fraction * num_tokens * num_ranks))
    for kind in ("random", "one_expert"):
        got = run_case(
            buffers,
            mesh,
            seed=rows,
            num_tokens=num_tokens,
            hidden=2048,
            topk=8,
            num_experts=32 * num_ranks,
            kind=kind,
            num_worst_tokens=rows,
        )
        assert np.asarray(got[3].num_dropped_tokens).sum() > 0


@gpu
@pytest.mark.parametrize("num_sms,chunk_tokens,num_warps", [(1, 1, 1), (7, 3, 5), (24, 8, 16), (132, 64, 16)])
def test_launch_configs(mesh, num_sms, chunk_tokens, num_warps):
    """Any launch configuration gives the same bits (also the staged fallback)."""
    fields = {"num_sms": num_sms, "chunk_tokens": chunk_tokens}
    if "num_warps" in deep_ep_jax.Config.__dataclass_fields__:
        fields["num_warps"] = num_warps
    with deep_ep_jax.Buffer(mesh, AXIS, backend="cuda", config=deep_ep_jax.Config(**fields)) as cuda:
        xla = deep_ep_jax.Buffer(mesh, AXIS, backend="xla")
        run_case((cuda, xla), mesh, seed=num_sms, num_tokens=500, hidden=4096, topk=8, num_experts=64, kind="minus_one")


@gpu
def test_staged_fallback(mesh, monkeypatch):
    monkeypatch.setenv("DEEP_EP_JAX_STAGED", "1")
    num_ranks = mesh.shape[AXIS]
    with deep_ep_jax.Buffer(mesh, AXIS, backend="cuda", hidden=2048) as cuda:
        xla = deep_ep_jax.Buffer(mesh, AXIS, backend="xla")
        for fp8 in (False, True):
            run_case(
                (cuda, xla),
                mesh,
                seed=5,
                num_tokens=300,
                hidden=2048,
                topk=8,
                num_experts=16 * num_ranks,
                kind="random",
                fp8=fp8,
            )
            run_case(
                (cuda, xla),
                mesh,
                seed=6,
                num_tokens=300,
                hidden=2048,
                topk=8,
                num_experts=16 * num_ranks,
                kind="one_expert",
                fp8=fp8,
                num_worst_tokens=100,
            )


@gpu
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_handle_rows_out_of_range_are_not_sent(mesh, monkeypatch, staged):
    """A hand-made handle may name rows past num_worst_tokens: the cached
    dispatch and combine kernels treat them as not sent (no write or read out
    of bounds), exactly as the same handle with -1 there."""
    if staged:
        monkeypatch.setenv("DEEP_EP_JAX_STAGED", "1")
    num_ranks, num_tokens, hidden, topk = mesh.shape[AXIS], 96, 1024, 4
    num_experts = 8 * num_ranks
    with deep_ep_jax.Buffer(mesh, AXIS, backend="cuda", hidden=hidden) as cuda:
        idx, w = testing.make_routing(41, num_ranks * num_tokens, num_experts, topk, num_ranks)
        x = testing.random_rows(42, (num_ranks * num_tokens, hidden))
        num_rows = num_tokens * num_ranks

        # The combine's rows are an argument: a constant folded into the program would live in memory the
        # peers cannot map (see the note on constants in docs/design.md).
        def run(x, idx, w, rows):
            _, _, _, handle = deep_ep_jax.dispatch(x, idx, w, num_experts=num_experts, buffer=cuda)
            sent = handle.send_pos >= 0
            # Every third sent row of the handle moved out of range, by 0 .. 2 * N.
            bad = sent & (jnp.arange(handle.send_pos.size).reshape(handle.send_pos.shape) % 3 == 0)
            wild = dataclasses.replace(handle, send_pos=jnp.where(bad, num_rows + handle.send_pos * 2, handle.send_pos))
            dropped = dataclasses.replace(handle, send_pos=jnp.where(bad, -1, handle.send_pos))
            outs = []
            for h in (wild, dropped):
                (recv,), _ = cuda.ops.cached_dispatch((x,), None, h, buffer=cuda)
                outs += [recv, deep_ep_jax.combine(rows, h, buffer=cuda)]
            return tuple(outs) + (dropped.send_pos, bad.sum())

        rows = testing.random_rows(43, (num_ranks * num_rows, hidden))
        recv_wild, out_wild, recv_dropped, out_dropped, send_pos, num_bad = testing.per_rank(run, mesh, AXIS)(
            x, jnp.asarray(idx), jnp.asarray(w), rows
        )
        assert int(np.asarray(num_bad).sum()) > 0
        assert_bits_equal(out_wild, out_dropped, "combine of out-of-range rows")
        # Cached dispatch: every row the handles still send is the source's token, under both handles.
        x_rows, send_pos = bits(x).reshape(num_ranks, num_tokens, hidden), np.asarray(send_pos)
        wild_rows, dropped_rows = bits(recv_wild), bits(recv_dropped)
        for src, t, dst in zip(*np.nonzero(send_pos >= 0)):
            row = send_pos[src, t, dst]
            np.testing.assert_array_equal(wild_rows[dst, row], x_rows[src, t])
            np.testing.assert_array_equal(dropped_rows[dst, row], x_rows[src, t])


@gpu
def test_combine_of_a_constant_fails_clearly(mesh):
    """Direct mode's peers read combine's rows where XLA keeps them; rows XLA
    folded into a constant of the program live in module memory the other GPU
    cannot map. The call fails with a message naming x, not an illegal address,
    and the same rows as an argument combine as the reference does."""
    num_ranks, num_tokens, hidden, topk = mesh.shape[AXIS], 64, 512, 4
    num_experts = 4 * num_ranks
    with deep_ep_jax.Buffer(mesh, AXIS, backend="cuda", hidden=hidden) as cuda:
        idx, w = testing.make_routing(51, num_ranks * num_tokens, num_experts, topk, num_ranks)
        x = testing.random_rows(52, (num_ranks * num_tokens, hidden))
        rows = np.asarray(testing.random_rows(53, (num_tokens * num_ranks, hidden)))  # bf16 numpy

        def runner(buffer):
            def run(x, idx, w, *arg_rows):
                _, _, _, handle = deep_ep_jax.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
                # Without an argument: numpy rows captured by the program, a constant of it.
                r = arg_rows[0] if arg_rows else jnp.asarray(rows)
                return deep_ep_jax.combine(r, handle, buffer=buffer)

            return testing.per_rank(run, mesh, AXIS)

        args = (x, jnp.asarray(idx), jnp.asarray(w))
        with pytest.raises(Exception, match="x is a constant of the compiled program"):
            np.asarray(runner(cuda)(*args))
        per_rank_rows = jnp.tile(jnp.asarray(rows), (num_ranks, 1))
        xla = deep_ep_jax.Buffer(mesh, AXIS, backend="xla")
        assert_bits_equal(
            runner(cuda)(*args, per_rank_rows), runner(xla)(*args, per_rank_rows), "combine of argument rows"
        )


@gpu
@pytest.mark.parametrize("num_sms,chunk_tokens", [(24, 2), (1, 1), (7, 64), (132, 3)])
def test_staged_overlap_skewed(mesh, monkeypatch, num_sms, chunk_tokens):
    """Staged mode's copy blocks beside the transfer (dispatch: per-chunk
    records; combine: per-row-chunk ready flags) under skewed routing: a rank
    that receives nothing, every token to one expert (one rank gets all, the
    others nothing), -1 and out-of-range entries, drops (num_worst_tokens),
    FP8, and launch configurations that change the block split (132 SMs
    leaves the copy role room only by taking move blocks). Shapes change from
    call to call on the same buffer, so the flags move around the region."""
    monkeypatch.setenv("DEEP_EP_JAX_STAGED", "1")
    num_ranks = mesh.shape[AXIS]
    config = deep_ep_jax.Config(num_sms=num_sms, chunk_tokens=chunk_tokens)
    # Sized for the largest call (no hidden=: the calls' hidden sizes differ).
    region = _native.extension().staged_region_bytes(num_ranks * 333, 2 * 2048, 0, 8, 333, num_ranks)
    with deep_ep_jax.Buffer(mesh, AXIS, backend="cuda", num_nvl_bytes=region, config=config) as cuda:
        xla = deep_ep_jax.Buffer(mesh, AXIS, backend="xla")
        kinds = [k for k in testing.ROUTING_KINDS if k != "rank_empty" or num_ranks >= 2]
        for seed, kind in enumerate(kinds):
            got = run_case(
                (cuda, xla),
                mesh,
                seed=10 + seed,
                num_tokens=333,
                hidden=2048,
                topk=8,
                num_experts=16 * num_ranks,
                kind=kind,
            )
            if kind == "rank_empty":
                assert np.asarray(got[3].num_recv_tokens)[-1] == 0
            if kind == "one_expert":
                assert (np.asarray(got[3].num_recv_tokens)[1:] == 0).all()
            got = run_case(
                (cuda, xla),
                mesh,
                seed=20 + seed,
                num_tokens=333,
                hidden=1024,
                topk=3,
                num_experts=4 * num_ranks,
                kind=kind,
                num_worst_tokens=97,
            )
            if kind in ("random", "one_expert"):
                assert np.asarray(got[3].num_dropped_tokens).sum() > 0
        run_case(
            (cuda, xla),
            mesh,
            seed=30,
            num_tokens=200,
            hidden=2048,
            topk=8,
            num_experts=16 * num_ranks,
            kind="one_expert",
            fp8=True,
            num_worst_tokens=150,
        )
        run_case(
            (cuda, xla),
            mesh,
            seed=31,
            num_tokens=65,
            hidden=384,
            topk=3,
            num_experts=4 * num_ranks,
            kind="minus_one",
            fp8=True,
        )
        run_case((cuda, xla), mesh, seed=32, num_tokens=1, hidden=2048, topk=1, num_experts=num_ranks, kind="random")


@gpu
def test_staged_exact_region(mesh, monkeypatch):
    """A normal region of exactly the bytes the trace-time check asks for
    (rows, chunk records, ready flags): the kernels stay inside it."""
    monkeypatch.setenv("DEEP_EP_JAX_STAGED", "1")
    num_ranks = mesh.shape[AXIS]
    num_tokens, hidden, topk, rows = 300, 2048, 8, 500
    config = deep_ep_jax.Config(chunk_tokens=1)
    need = _native.extension().staged_region_bytes(rows, 2 * hidden, 0, topk, num_tokens, num_ranks)
    with deep_ep_jax.Buffer(mesh, AXIS, backend="cuda", num_nvl_bytes=need, config=config) as cuda:
        xla = deep_ep_jax.Buffer(mesh, AXIS, backend="xla")
        for seed, kind in enumerate(("random", "one_expert")):
            run_case(
                (cuda, xla),
                mesh,
                seed=seed,
                num_tokens=num_tokens,
                hidden=hidden,
                topk=topk,
                num_experts=16 * num_ranks,
                kind=kind,
                num_worst_tokens=rows,
            )


@gpu
def test_staged_many_calls(mesh, monkeypatch):
    """Staged flags are compared against each call's sequence number and
    cleared per call: hundreds of calls in one program stay exact."""
    monkeypatch.setenv("DEEP_EP_JAX_STAGED", "1")
    num_ranks = mesh.shape[AXIS]
    num_experts = 8 * num_ranks
    with deep_ep_jax.Buffer(mesh, AXIS, backend="cuda", hidden=512) as cuda:
        xla = deep_ep_jax.Buffer(mesh, AXIS, backend="xla")
        x = testing.random_rows(0, (num_ranks * 96, 512))
        idx, w = routing(1, num_ranks, 96, num_experts, 3, "minus_one")
        got = _loop_runner(cuda, mesh, num_experts, 300)(x, idx, w)
        want = _loop_runner(xla, mesh, num_experts, 300)(x, idx, w)
        for name, g, wv in zip(
            ("sum of combined rows", "sum of combined weights", "sum of num_recv_tokens"), got, want
        ):
            assert_bits_equal(g, wv, name)


# Gradients ------------------------------------------------------------------------


def _moe_exact_grads(buffer, mesh, num_experts, check_vma=False):
    """A MoE step whose expert math is exact in any evaluation order (scaling
    by powers of two), so the gradients must agree bit for bit."""

    def fn(x, w, idx, probe, probe_w):
        def loss(x, w):
            recv_x, recv_idx, recv_w, handle = deep_ep_jax.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
            scale = jnp.asarray([1.0, 2.0, 4.0], jnp.float32)[jnp.max(recv_idx, axis=1) % 3]
            y = (recv_x.astype(jnp.float32) * scale[:, None]).astype(jnp.bfloat16)
            out, out_w = deep_ep_jax.combine(y, handle, recv_w * 2.0, buffer=buffer)
            return jnp.sum(out.astype(jnp.float32) * probe) + jnp.sum(out_w * probe_w)

        return jax.grad(loss, argnums=(0, 1))(x, w)

    return testing.per_rank(fn, mesh, AXIS, check_vma=check_vma)


def _moe_matmul_grads(buffer, mesh, num_experts):
    """A small MoE step with a per-row expert matmul (each row times the
    weights of its local experts), gradients for x, topk_weights and experts."""
    num_ranks = mesh.shape[AXIS]

    def fn(x, w, idx, experts, probe):
        def loss(x, w, experts):
            recv_x, recv_idx, recv_w, handle = deep_ep_jax.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
            h = recv_x.astype(jnp.float32)
            y = jnp.zeros_like(h)
            for k in range(recv_idx.shape[1]):
                wk = experts[jnp.clip(recv_idx[:, k], 0, num_experts // num_ranks - 1)]  # [N, H, H]
                yk = jnp.einsum("nh,nhg->ng", h, wk)
                y = y + jnp.where(recv_idx[:, k : k + 1] >= 0, recv_w[:, k : k + 1] * yk, 0.0)
            out = deep_ep_jax.combine(y.astype(jnp.bfloat16), handle, buffer=buffer)
            return jnp.sum(out.astype(jnp.float32) * probe)

        return jax.grad(loss, argnums=(0, 1, 2))(x, w, experts)

    return testing.per_rank(fn, mesh, AXIS)


@gpu
@pytest.mark.parametrize("kind", ["random", "minus_one", "rank_empty"])
def test_gradients_exact(mesh, buffers, kind):
    cuda, xla = buffers
    num_ranks = mesh.shape[AXIS]  # at least 2: the mesh fixture's, or the internode worker's
    num_tokens, hidden, num_experts = 200, 1024, 8 * num_ranks
    x = testing.random_rows(1, (num_ranks * num_tokens, hidden))
    idx, w = routing(2, num_ranks, num_tokens, num_experts, 4, kind)
    probe = testing.random_rows(3, (num_ranks * num_tokens, hidden)).astype(jnp.float32)
    probe_w = jnp.asarray(np.random.default_rng(4).standard_normal(w.shape, np.float32))
    got = _moe_exact_grads(cuda, mesh, num_experts)(x, w, idx, probe, probe_w)
    want = _moe_exact_grads(xla, mesh, num_experts)(x, w, idx, probe, probe_w)
    assert_bits_equal(got[0], want[0], "grad x")
    assert_bits_equal(got[1], want[1], "grad topk_weights")
    assert np.abs(np.asarray(got[0], np.float32)).sum() > 0


@gpu
def test_gradients_under_shard_map_defaults(mesh, buffers):
    """shard_map's default check_vma=True, as users write it: the custom
    calls' results vary over the EP axis, so the gradients type-check and
    equal the reference's bit for bit."""
    cuda, xla = buffers
    num_ranks = mesh.shape[AXIS]
    num_tokens, hidden, num_experts = 160, 1024, 8 * num_ranks
    x = testing.random_rows(11, (num_ranks * num_tokens, hidden))
    idx, w = routing(12, num_ranks, num_tokens, num_experts, 4, "random")
    probe = testing.random_rows(13, (num_ranks * num_tokens, hidden)).astype(jnp.float32)
    probe_w = jnp.asarray(np.random.default_rng(14).standard_normal(w.shape, np.float32))
    got = _moe_exact_grads(cuda, mesh, num_experts, check_vma=True)(x, w, idx, probe, probe_w)
    want = _moe_exact_grads(xla, mesh, num_experts, check_vma=True)(x, w, idx, probe, probe_w)
    assert_bits_equal(got[0], want[0], "grad x")
    assert_bits_equal(got[1], want[1], "grad topk_weights")
    assert np.abs(np.asarray(got[0], np.float32)).sum() > 0


@gpu
def test_gradients_moe_matmul(mesh, buffers):
    cuda, xla = buffers
    num_ranks = mesh.shape[AXIS]
    num_tokens, hidden, num_experts = 64, 128, 4 * num_ranks
    x = testing.random_rows(1, (num_ranks * num_tokens, hidden))
    idx, w = routing(2, num_ranks, num_tokens, num_experts, 2, "random")
    # Global [E, H, H]: rank r holds its E/R experts.
    experts = jnp.asarray(
        np.random.default_rng(5).standard_normal((num_experts, hidden, hidden), np.float32) / np.sqrt(hidden)
    )
    probe = testing.random_rows(3, (num_ranks * num_tokens, hidden)).astype(jnp.float32)
    got = _moe_matmul_grads(cuda, mesh, num_experts)(x, w, idx, experts, probe)
    want = _moe_matmul_grads(xla, mesh, num_experts)(x, w, idx, experts, probe)
    # The matmuls are compiled separately in the two programs; the
    # communication is exact, the expert math agrees to rounding.
    for name, g, wv in zip(("x", "topk_weights", "experts"), got, want):
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(wv, np.float32), rtol=2e-2, atol=2e-2, err_msg=f"grad {name}"
        )


# Many calls, command buffers --------------------------------------------------------


def _loop_runner(buffer, mesh, num_experts, num_iters):
    def fn(x, idx, w):
        def body(i, carry):
            acc, acc_w, acc_recv = carry
            shifted = jnp.where(idx >= 0, (idx + i) % num_experts, -1)
            xi = (x.astype(jnp.float32) + i.astype(jnp.float32)).astype(jnp.bfloat16)
            recv_x, _, recv_w, handle = deep_ep_jax.dispatch(xi, shifted, w, num_experts=num_experts, buffer=buffer)
            out, out_w = deep_ep_jax.combine(recv_x, handle, recv_w, buffer=buffer)
            return acc + out.astype(jnp.float32), acc_w + out_w, acc_recv + handle.num_recv_tokens

        init = (jnp.zeros(x.shape, jnp.float32), jnp.zeros(w.shape, jnp.float32), jnp.zeros((), jnp.int32))
        return lax.fori_loop(0, num_iters, body, init)

    return testing.per_rank(fn, mesh, AXIS)


@gpu
def test_wide_kernels_direct_and_staged():
    """The single-node kernels' path for more than 8 ranks, at this host's
    ranks, direct and staged: this file's core comparisons again in a process
    of its own with DEEP_EP_JAX_WIDE_KERNELS=1 (read once per process)."""
    tests = "matches_reference or fp8_pairs or num_worst_tokens_smaller or gradients_exact or staged_overlap_skewed"
    env = dict(os.environ, DEEP_EP_JAX_WIDE_KERNELS="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", __file__, "-k", f"({tests}) and not wide_kernels"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0 and " passed" in result.stdout, result.stdout[-6000:] + result.stderr[-3000:]


@gpu
def test_1000_calls_in_fori_loop(mesh, buffers):
    cuda, xla = buffers
    num_ranks = mesh.shape[AXIS]
    num_experts = 8 * num_ranks
    x = testing.random_rows(0, (num_ranks * 96, 512))
    idx, w = routing(1, num_ranks, 96, num_experts, 3, "minus_one")
    got = _loop_runner(cuda, mesh, num_experts, 1000)(x, idx, w)
    want = _loop_runner(xla, mesh, num_experts, 1000)(x, idx, w)
    for name, g, wv in zip(("sum of combined rows", "sum of combined weights", "sum of num_recv_tokens"), got, want):
        assert_bits_equal(g, wv, name)


# The chain of test_command_buffers, in this module so that its worker
# processes run the very same program on the very same inputs.
CHAIN_TOKENS, CHAIN_HIDDEN, CHAIN_TOPK = 512, 2048, 8
CHAIN_KINDS = ("random", "one_expert", "minus_one", "rank_empty")  # one per execution: counts change every replay


def chain_runner(buffer, mesh):
    """dispatch -> expert -> combine, three times, jitted (one program)."""
    num_experts = 16 * mesh.shape[AXIS]

    def command_buffer_chain(x, idx, w):
        h = x
        for _ in range(3):
            recv_x, _, recv_w, handle = deep_ep_jax.dispatch(h, idx, w, num_experts=num_experts, buffer=buffer)
            y = (recv_x.astype(jnp.float32) * 0.5).astype(jnp.bfloat16)
            h, _ = deep_ep_jax.combine(y, handle, recv_w, buffer=buffer)
        return h

    spec = jax.sharding.PartitionSpec(AXIS)
    return jax.jit(jax.shard_map(command_buffer_chain, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def chain_inputs(mesh, seed, kind):
    num_ranks = mesh.shape[AXIS]
    x = testing.random_rows(seed, (num_ranks * CHAIN_TOKENS, CHAIN_HIDDEN))
    return (x,) + routing(seed, num_ranks, CHAIN_TOKENS, 16 * num_ranks, CHAIN_TOPK, kind)


# Runs the chain in a process of its own, with the XLA_FLAGS it is given:
# argv = output folder, seeds (tests/gpu on PYTHONPATH). Saves each output's bits and the
# number of deep_ep_jax custom calls in the compiled program.
CHAIN_WORKER = """
import sys
import jax, numpy as np
import deep_ep_jax, test_normal_gpu as t

mesh = t.testing.ep_mesh(len(jax.devices("gpu")), t.AXIS, platform="gpu")
buffer = deep_ep_jax.Buffer(mesh, t.AXIS, backend="cuda")
seeds = [int(s) for s in sys.argv[2:]]
runs = [t.chain_inputs(mesh, seed, kind) for seed, kind in zip(seeds, t.CHAIN_KINDS)]
compiled = t.chain_runner(buffer, mesh).lower(*runs[0]).compile()  # one compilation, every execution its replay
for seed, args in zip(seeds, runs):
    np.save(f"{sys.argv[1]}/out_{seed}.npy", np.asarray(compiled(*args)).view(np.uint16))
print("deep_ep_jax custom calls:", compiled.as_text().count('custom_call_target="deep_ep_jax_'))
buffer.destroy()
"""


def _thunk_lines(text):
    """[(indent, kind)] of the thunk lines of an XLA thunk sequence dump:
    indent, an optional 'NNN: ' id, then the kind (kCommandBuffer, kCustomCall, ...)."""
    lines = [re.match(r"( *)(?:-?\d+: )?(k[A-Z]\w*)", line) for line in text.splitlines()]
    return [(len(m.group(1)), m.group(2)) for m in lines if m]


def custom_calls_in_command_buffers(dump_dir):
    """(custom-call thunks inside command buffers, outside them) over the
    thunk sequences XLA dumped (per module, the one after its thunk passes,
    which form the command buffers, if it wrote one)."""
    dumps = {}
    for path in sorted(pathlib.Path(dump_dir).glob("*thunk_sequence*.txt")):
        module = path.name.split(".thunk_sequence")[0]
        if module not in dumps or "after_thunk_passes" in path.name:
            dumps[module] = path
    inside = outside = 0
    for path in dumps.values():
        lines = _thunk_lines(path.read_text())
        top = min((indent for indent, _ in lines), default=0)
        in_buffer = False
        for indent, kind in lines:
            if indent == top:
                in_buffer = kind == "kCommandBuffer"
            if kind == "kCustomCall":
                if in_buffer and indent > top:
                    inside += 1
                else:
                    outside += 1
    return inside, outside, sorted(p.name for p in dumps.values())


def _run_chain_worker(tmp_path, name, xla_flags, seeds):
    out = tmp_path / name
    dump = out / "dump"
    dump.mkdir(parents=True)
    path = [str(ROOT), str(ROOT / "tests" / "gpu")] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p
    ]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(path),
        PYTHONUNBUFFERED="1",
        XLA_PYTHON_CLIENT_PREALLOCATE="false",  # this process holds most of the memory
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
        f"--xla_dump_hlo_module_re=.*command_buffer_chain.* {xla_flags}",
    )
    result = subprocess.run(
        [sys.executable, "-c", CHAIN_WORKER, str(out)] + [str(s) for s in seeds],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"{name} worker failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    num_calls = int(re.search(r"deep_ep_jax custom calls: (\d+)", result.stdout).group(1))
    outputs = {seed: np.load(out / f"out_{seed}.npy") for seed in seeds}
    return outputs, num_calls, custom_calls_in_command_buffers(dump)


@gpu
def test_command_buffers(mesh, buffers, tmp_path):
    """With command buffers on for custom calls, the jitted chain's
    dispatches and combines are all captured into CUDA graphs (XLA's thunk
    dump shows them inside kCommandBuffer thunks); with command buffers off,
    none is. Both give the reference's bits on every execution, each with
    fresh inputs and routing (replays of the graph are where state left by
    an earlier call, e.g. stale flags, would show)."""
    _, xla = buffers
    seeds = [int(s) for s in np.random.default_rng().integers(1 << 30, size=len(CHAIN_KINDS))]
    graph, graph_calls, graph_dump = _run_chain_worker(
        tmp_path, "graph", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1", seeds
    )
    plain, plain_calls, plain_dump = _run_chain_worker(tmp_path, "plain", "--xla_gpu_enable_command_buffer=", seeds)
    reference = chain_runner(xla, mesh)
    for seed, kind in zip(seeds, CHAIN_KINDS):
        want = np.asarray(reference(*chain_inputs(mesh, seed, kind))).view(np.uint16)
        for name, got in (("inside a CUDA graph", graph[seed]), ("outside CUDA graphs", plain[seed])):
            bad = np.argwhere(got != want)
            assert not len(bad), f"seed {seed} ({kind}), {name}: {len(bad)} values differ, first {bad[:4].tolist()}"
    assert graph_calls == plain_calls == 6, (graph_calls, plain_calls)  # 3 dispatches, 3 combines
    inside, outside, dumps = graph_dump
    assert inside >= graph_calls and outside == 0, (
        f"command buffers on: {inside} custom-call thunks inside command buffers, {outside} outside; dumps {dumps}"
    )
    # The same count without command buffers: the check above tells the two apart.
    inside, outside, dumps = plain_dump
    assert inside == 0 and outside >= plain_calls, (
        f"command buffers off: {inside} custom-call thunks inside command buffers, {outside} outside; dumps {dumps}"
    )


# CPU: trace-time checks and the size hint ---------------------------------------


def _stand_in(num_ranks=2, num_nvl_bytes=1 << 16, config=None, staged=False):
    return testing.stand_in_cuda_buffer(
        num_ranks, axis_name=AXIS, num_nvl_bytes=num_nvl_bytes, config=config or deep_ep_jax.Config(), staged=staged
    )


def _trace_dispatch(buffer, x, topk=4, num_experts=8, num_worst_tokens=None):
    idx = jax.ShapeDtypeStruct((x.shape[0], topk), jnp.int32)
    w = jax.ShapeDtypeStruct((x.shape[0], topk), jnp.float32)
    return jax.eval_shape(
        lambda x, idx, w: intranode.dispatch(
            (x,), idx, w, num_experts=num_experts, num_worst_tokens=num_worst_tokens, buffer=buffer
        ),
        x,
        idx,
        w,
    )


@pytest.mark.extension
def test_trace_checks_cpu():
    staged_region_bytes = _native.extension().staged_region_bytes
    x = jax.ShapeDtypeStruct((16, 256), jnp.bfloat16)
    recv_xs, recv_idx, _, handle = _trace_dispatch(_stand_in(), x)
    assert recv_xs[0].shape == (32, 256) and recv_idx.shape == (32, 4) and handle.send_pos.shape == (16, 2)
    assert handle.num_recv_tokens_per_expert.shape == (4,)
    with pytest.raises(ValueError, match="multiple of 8"):
        _trace_dispatch(_stand_in(), jax.ShapeDtypeStruct((16, 260), jnp.bfloat16))
    with pytest.raises(ValueError, match="at most 72 ranks"):
        _trace_dispatch(_stand_in(num_ranks=73), x, num_experts=73)
    with pytest.raises(ValueError, match="bf16 rows or quantized pairs"):
        _trace_dispatch(_stand_in(), jax.ShapeDtypeStruct((16, 256), jnp.float32))
    with pytest.raises(ValueError, match="experts per rank|at most 4096"):
        _trace_dispatch(_stand_in(), x, num_experts=2 * 5000)
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        _trace_dispatch(_stand_in(staged=True), x)
    # 32 rows of 512 bytes, top-k 4, records for 16 tokens in chunks of Config.chunk_tokens.
    chunks = -(-16 // deep_ep_jax.Config().chunk_tokens)
    need = staged_region_bytes(32, 512, 0, 4, chunks, 2)
    _trace_dispatch(_stand_in(num_nvl_bytes=need, staged=True), x)
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        _trace_dispatch(_stand_in(num_nvl_bytes=need - 1, staged=True), x)
    _trace_dispatch(_stand_in(num_nvl_bytes=need - 1), x)  # not staged: rows go to XLA's buffers
    # chunk_tokens 1: a record per token, more than chunks of 2.
    one = deep_ep_jax.Config(chunk_tokens=1)
    one_need = staged_region_bytes(32, 512, 0, 4, 16, 2)
    assert one_need > need
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        _trace_dispatch(_stand_in(num_nvl_bytes=one_need - 1, config=one, staged=True), x)
    _trace_dispatch(_stand_in(num_nvl_bytes=one_need, config=one, staged=True), x)
    # Combine needs no chunk records.
    combine_need = staged_region_bytes(32, 512, 0, 4, 0, 2)
    assert combine_need < need
    _trace_combine(_stand_in(num_nvl_bytes=combine_need, staged=True), 16, 32, 256, 4)
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        _trace_combine(_stand_in(num_nvl_bytes=combine_need - 1, staged=True), 16, 32, 256, 4)


def _trace_combine(buffer, num_tokens, num_rows, hidden, topk):
    num_ranks = buffer.num_ranks
    i32 = jnp.int32
    handle = deep_ep_jax.DispatchHandle(
        is_token_in_rank=jax.ShapeDtypeStruct((num_tokens, num_ranks), jnp.bool_),
        num_tokens_per_rank=jax.ShapeDtypeStruct((num_ranks,), i32),
        rank_prefix_matrix=jax.ShapeDtypeStruct((num_ranks, num_ranks), i32),
        send_pos=jax.ShapeDtypeStruct((num_tokens, num_ranks), i32),
        recv_src_idx=jax.ShapeDtypeStruct((num_rows,), i32),
        recv_src_rank=jax.ShapeDtypeStruct((num_rows,), i32),
        num_recv_tokens=jax.ShapeDtypeStruct((), i32),
        num_recv_tokens_per_expert=jax.ShapeDtypeStruct((4,), i32),
        num_dropped_tokens=jax.ShapeDtypeStruct((), i32),
    )
    x = jax.ShapeDtypeStruct((num_rows, hidden), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((num_rows, topk), jnp.float32)
    out, out_w = jax.eval_shape(lambda x, w, h: intranode.combine(x, w, h, buffer=buffer), x, w, handle)
    assert out.shape == (num_tokens, hidden) and out_w.shape == (num_tokens, topk)


@pytest.mark.extension
def test_region_hint_cpu():
    """Direct rows need only the control block; staged, the hint holds a
    bf16 or FP8 dispatch of its shapes with any chunk_tokens and top-k up to
    16, and grows with hidden and tokens."""
    staged_region_bytes = _native.extension().staged_region_bytes
    assert sizes.normal_region_bytes(2, staged=False) == _native.limits()["control_bytes"]
    standard = sizes.normal_region_bytes(2, staged=True)
    assert standard >= 2 * 4096 * 7168 * 2  # the standard case's received bf16 rows
    hint = sizes.normal_region_bytes(2, 2048, 100, staged=True)
    assert hint < standard
    for chunks in (100, 50, 1):  # chunk_tokens 1, 2, 100
        for topk in (1, 16):
            assert staged_region_bytes(200, 4096, 0, topk, chunks, 2) <= hint
            assert staged_region_bytes(200, 2048, 2048 // 128 * 4, topk, chunks, 2) <= hint
    assert sizes.normal_region_bytes(2, 4096, 100, staged=True) > hint
    assert sizes.normal_region_bytes(2, 2048, 200, staged=True) > hint
    # A Buffer with the hint passes the trace-time check of such a dispatch.
    x = jax.ShapeDtypeStruct((100, 2048), jnp.bfloat16)
    _trace_dispatch(
        _stand_in(num_nvl_bytes=hint, config=deep_ep_jax.Config(chunk_tokens=1), staged=True),
        x,
        topk=16,
        num_experts=32,
    )
