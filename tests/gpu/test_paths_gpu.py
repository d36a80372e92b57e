"""Paths of the API on GPUs that the other files leave out: Buffer(backend="auto")
choosing the kernels, checks mode on the CUDA backend, the low-latency
combine's CUDA-only trace-time errors, `python -m deep_ep_jax.info` and
examples/quickstart.py on GPUs, and (last: its process traps) the documented
timeout of a third low-latency operation in flight. About a minute of GPU time.

    pytest -q -m gpu tests/gpu/test_paths_gpu.py
"""

import os
import pathlib
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deep_ep_jax as dej
from deep_ep_jax import _native
from deep_ep_jax import testing as dt
from deep_ep_jax.backends.cuda import internode, intranode, layout, low_latency, sizes

pytestmark = pytest.mark.gpu
AXIS = "ep"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run_python(args, timeout=180):
    """A Python process of its own (this one holds most of the GPU memory)."""
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false"
    )
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False, cwd=ROOT
    )


def _roundtrip(buffer, num_experts):
    def fn(x, idx, w):
        recv_x, recv_idx, recv_w, handle = dej.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
        out, out_w = dej.combine(recv_x, handle, recv_w, buffer=buffer)
        return recv_x, recv_idx, recv_w, handle, out, out_w

    return dt.per_rank(fn, mesh=buffer.mesh, axis_name=AXIS)


def _assert_same_bits(got, want, what):
    """Equal bits; received rows compared where valid (rows past num_recv_tokens are unspecified)."""
    (g_x, *g_rest), (w_x, *w_rest) = got, want
    num_recv = np.asarray(w_rest[2].num_recv_tokens)
    assert (np.asarray(g_rest[2].num_recv_tokens) == num_recv).all(), what
    for r, n in enumerate(num_recv):
        np.testing.assert_array_equal(
            np.asarray(g_x)[r, :n].view(np.uint16),
            np.asarray(w_x)[r, :n].view(np.uint16),
            err_msg=f"{what}: received rows of rank {r}",
        )
    for g, w in zip(jax.tree.leaves(g_rest), jax.tree.leaves(w_rest)):
        g, w = np.asarray(g), np.asarray(w)
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=what)


def test_auto_backend_is_cuda_on_gpus(mesh):
    """Buffer(backend="auto") on GPUs with the extension built picks the
    kernels, for both modes, and gives the reference's bits."""
    num_ranks = mesh.shape[AXIS]
    num_tokens, hidden, num_experts = 96, 1024, 8 * num_ranks
    xla = dej.Buffer(mesh, AXIS, backend="xla")
    ll_sizes = dict(num_max_dispatch_tokens_per_rank=32, hidden=hidden, num_experts=num_experts)
    with dej.Buffer(mesh, AXIS) as auto, dej.Buffer(mesh, AXIS, low_latency_mode=True, **ll_sizes) as ll:
        assert _native.unavailable_reason() is None
        assert auto.backend == ll.backend == "cuda" and auto.buffer_id is not None and ll.buffer_id is not None
        normal_mode = internode if auto.spans_hosts else intranode
        assert auto.ops.dispatch is normal_mode.dispatch and auto.ops.combine is normal_mode.combine
        assert auto.ops.get_dispatch_layout is layout.get_dispatch_layout
        assert ll.ops.low_latency_dispatch is low_latency.low_latency_dispatch
        idx, w = dt.make_routing(71, num_ranks * num_tokens, num_experts, 4, num_ranks, "minus_one")
        x = dt.random_rows(72, (num_ranks * num_tokens, hidden))
        args = (x, jnp.asarray(idx), jnp.asarray(w))
        run = _roundtrip(auto, num_experts)
        assert "deep_ep_jax_dispatch" in run.lower(*args).as_text()  # the kernels, really
        _assert_same_bits(run(*args), _roundtrip(xla, num_experts)(*args), "auto against the reference")


def test_checks_mode_on_cuda(mesh):
    """Config(checks=True) on the CUDA backend: good data passes with the
    same bits as without checks; bad ids (layout, dispatch, low-latency
    dispatch) and rows dropped past num_worst_tokens raise one CheckError."""
    num_ranks = mesh.shape[AXIS]
    num_tokens, hidden, num_experts, topk = 64, 512, 8 * num_ranks, 4
    checks = dej.Config(checks=True)
    ll_sizes = dict(num_max_dispatch_tokens_per_rank=num_tokens, hidden=hidden, num_experts=num_experts)
    with (
        dej.Buffer(mesh, AXIS, backend="cuda", config=checks) as checked,
        dej.Buffer(mesh, AXIS, backend="cuda") as plain,
        dej.Buffer(mesh, AXIS, backend="cuda", config=checks, low_latency_mode=True, **ll_sizes) as ll,
    ):
        idx, w = dt.make_routing(81, num_ranks * num_tokens, num_experts, topk, num_ranks)
        x = dt.random_rows(82, (num_ranks * num_tokens, hidden))
        idx, w = jnp.asarray(idx), jnp.asarray(w)
        bad = idx.at[3, 1].set(num_experts + 5)  # on rank 0 only
        bad_ids = rf"topk_idx holds expert ids outside \[-1, {num_experts}\) \(on 1 of {num_ranks} ranks\)"

        def dispatch(buffer, num_worst_tokens=None):
            return dej.checked(
                dt.per_rank(
                    lambda x, idx, w: dej.dispatch(
                        x, idx, w, num_experts=num_experts, buffer=buffer, num_worst_tokens=num_worst_tokens
                    ),
                    mesh,
                    AXIS,
                )
            )

        def get_layout(buffer):
            return dej.checked(
                dt.per_rank(
                    lambda idx: dej.get_dispatch_layout(idx, num_experts=num_experts, buffer=buffer), mesh, AXIS
                )
            )

        checked_dispatch, checked_layout = dispatch(checked), get_layout(checked)
        _assert_same_bits(checked_dispatch(x, idx, w), dispatch(plain)(x, idx, w), "dispatch with checks")
        for got, want in zip(checked_layout(idx), get_layout(plain)(idx)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg="layout with checks")
        with pytest.raises(dej.CheckError, match=f"^dispatch: {bad_ids}$"):
            checked_dispatch(x, bad, w)
        with pytest.raises(dej.CheckError, match=f"^get_dispatch_layout: {bad_ids}$"):
            checked_layout(bad)
        with pytest.raises(
            dej.CheckError,
            match=rf"^dispatch: more rows arrived than num_worst_tokens=8; "
            rf"the excess was dropped \(on {num_ranks} of {num_ranks} ranks\)$",
        ):
            dispatch(checked, num_worst_tokens=8)(x, idx, w)

        low_latency_dispatch = dej.checked(
            dt.per_rank(
                lambda x, idx: dej.low_latency_dispatch(
                    x, idx, buffer=ll, num_max_dispatch_tokens_per_rank=num_tokens, num_experts=num_experts
                ),
                mesh,
                AXIS,
            )
        )
        _, count, _ = low_latency_dispatch(x, idx)
        assert np.asarray(count).sum() == int((np.asarray(idx) >= 0).sum())
        with pytest.raises(dej.CheckError, match=f"^low_latency_dispatch: {bad_ids}$"):
            low_latency_dispatch(x, bad)
        checked_dispatch(x, idx, w)  # nothing left over from the failures


def test_low_latency_combine_errors_on_cuda(mesh):
    """What only the kernels cannot do fails at trace time, through the
    public API: hidden not a multiple of 8, top-k above the kernels' limit,
    a region too small for the combine's rows, a receive given a dispatch's
    pending value."""
    num_ranks = mesh.shape[AXIS]
    max_tokens, hidden, num_experts, topk = 16, 256, 64 * num_ranks, 8
    num_local = num_experts // num_ranks
    region = sizes.low_latency_region_bytes(num_ranks, num_experts, hidden, max_tokens, num_topk=topk)
    with dej.Buffer(
        mesh,
        AXIS,
        backend="cuda",
        low_latency_mode=True,
        num_max_dispatch_tokens_per_rank=max_tokens,
        num_rdma_bytes=region,  # no hidden=: the API leaves the combine's hidden to the kernels
    ) as buffer:
        i32 = jnp.int32

        def trace_combine(combine, combine_hidden, combine_topk):
            """Per rank: x [E/R, R*M, H], the handle's arrays [E/R, R*M], top-k [M, K]."""
            rows = (num_ranks * num_local, num_ranks * max_tokens)
            handle = dej.LowLatencyHandle(
                *(jax.ShapeDtypeStruct(shape, i32) for shape in ((num_ranks * num_local,), rows, rows, rows)),
                num_tokens=max_tokens,
                num_topk=combine_topk,
            )  # as a dispatch of this top-k
            args = (
                jax.ShapeDtypeStruct(rows + (combine_hidden,), jnp.bfloat16),
                jax.ShapeDtypeStruct((num_ranks * max_tokens, combine_topk), i32),
                jax.ShapeDtypeStruct((num_ranks * max_tokens, combine_topk), jnp.float32),
                handle,
            )
            jax.eval_shape(dt.per_rank(lambda x, idx, w, h: combine(x, idx, w, h, buffer=buffer), mesh, AXIS), *args)

        max_topk = _native.limits()["low_latency_max_topk"]
        for combine in (dej.low_latency_combine, dej.low_latency_combine_send):
            name = combine.__name__
            trace_combine(combine, hidden, topk)  # fine
            with pytest.raises(ValueError, match=f"^{name}: hidden must be a multiple of 8, got 100"):
                trace_combine(combine, 100, topk)
            with pytest.raises(
                ValueError,
                match=rf"^{name}: top-k must be in \[1, {max_topk}\] for the CUDA kernels, "
                rf"got {max_topk + 1}",
            ):
                trace_combine(combine, hidden, max_topk + 1)
            with pytest.raises(
                ValueError,
                match=f"^{name}: the buffer's low-latency region is too small for M={max_tokens}, top-k={topk}",
            ):
                trace_combine(combine, 7168, topk)

        def receive_a_dispatch(x, idx):
            pending = dej.low_latency_dispatch_send(
                x, idx, buffer=buffer, num_max_dispatch_tokens_per_rank=max_tokens, num_experts=num_experts
            )
            return dej.low_latency_combine_recv(pending, buffer=buffer)

        with pytest.raises(
            TypeError,
            match="^low_latency_combine_recv: pending must be what low_latency_combine_send "
            "returned, got low_latency_dispatch_send's",
        ):
            jax.eval_shape(
                dt.per_rank(receive_a_dispatch, mesh, AXIS),
                jax.ShapeDtypeStruct((num_ranks * max_tokens, hidden), jnp.bfloat16),
                jax.ShapeDtypeStruct((num_ranks * max_tokens, topk), i32),
            )


def test_info_on_gpus(mesh):
    """`python -m deep_ep_jax.info` on the GPU machine: the GPUs, their peer
    access, and the kernels as what Buffer(backend="auto") picks."""
    result = _run_python(["-m", "deep_ep_jax.info"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    out = result.stdout
    assert 'Buffer(backend="auto") -> "cuda"' in out, out
    assert "No GPU here" not in out, out
    for ordinal in range(mesh.shape[AXIS]):
        assert f"\nGPU {ordinal}: " in out, out
    assert "peer access (row can access column" in out, out
    assert "low latency (num_max_dispatch_tokens_per_rank=128" in out, out


def test_quickstart_on_gpus(mesh):
    """examples/quickstart.py picks the kernels on GPUs and its own check passes."""
    result = _run_python([str(ROOT / "examples" / "quickstart.py")])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert f"{mesh.shape[AXIS]} x gpu devices, backend=cuda" in lines, result.stdout
    assert "combine(expert(dispatch(x))) vs one-device maths: max abs error 0.0" in lines, result.stdout
    assert lines[-1] == "OK", result.stdout


THREE_IN_FLIGHT = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    import deep_ep_jax as dej
    from deep_ep_jax import testing as dt

    mesh = dt.ep_mesh(len(jax.devices("gpu")), "ep", platform="gpu")
    R, M, H, E = mesh.shape["ep"], 32, 256, 8 * mesh.shape["ep"]
    buffer = dej.Buffer(mesh, "ep", backend="cuda", low_latency_mode=True, num_max_dispatch_tokens_per_rank=M,
                        hidden=H, num_experts=E, config=dej.Config(timeout_s=2))
    idx, _ = dt.make_routing(0, R * M, E, 4, R)
    x = dt.random_rows(1, (R * M, H))
    kw = dict(buffer=buffer, num_max_dispatch_tokens_per_rank=M, num_experts=E)

    def fn(x, idx):
        sends = [dej.low_latency_dispatch_send(x, idx, **kw) for _ in range(3)]
        # Every receive after all three sends: the third send waits for the first receive.
        sends = jax.lax.optimization_barrier(sends)
        return [dej.low_latency_dispatch_recv(p, buffer=buffer)[1] for p in sends]

    jax.block_until_ready(dt.per_rank(fn, mesh, "ep")(x, jnp.asarray(idx)))
    print("NO TIMEOUT")
    """
)


def test_three_low_latency_operations_in_flight_time_out():
    """Three sends before any receive (two may be in flight): the third send
    fails after Config.timeout_s with the documented message naming the
    freed flag, instead of hanging. In a process of its own: the trap ends
    its CUDA context."""
    start = time.time()
    result = _run_python(["-c", THREE_IN_FLIGHT], timeout=150)
    elapsed = time.time() - start
    output = result.stdout + result.stderr
    assert "NO TIMEOUT" not in output
    assert result.returncode != 0, output[-3000:]
    assert "deep_ep_jax timeout: low-latency dispatch send rank " in output, output[-3000:]
    freed = "waited 2.0 s for the freed flag (more than two low-latency operations in flight?)"
    assert freed in output, output[-3000:]
    assert elapsed < 120, elapsed
