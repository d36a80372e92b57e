"""Calls of one Buffer run one at a time, in one order on every rank (issue
21): XLA sees them as one chain of data dependences (deep_ep_jax.comm.ordering),
and the kernels stop with a message when ranks are at different calls or a
call enters while another runs.

Each case runs in its own process: XLA's flags are read when JAX starts, and
a kernel that stops (trap) leaves its CUDA context unusable.

Before the order chain, the first case failed under concurrent command-buffer
scheduling: the ranks ran two independent round trips in different orders
and a combine timed out ("waited 20.0 s for ready flag").
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

CONCURRENT = "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"

PRELUDE = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    import deep_ep_jax as dej
    from deep_ep_jax import _native, testing as dt

    R = len(jax.devices())
    mesh = dt.ep_mesh(R, "ep")
    T, H, E, K = 128, 1024, 8 * R, 4
    config = dej.Config(timeout_s=15)
    cuda = dej.Buffer(mesh, "ep", backend="cuda", hidden=H, low_latency_mode=True,
                      num_max_dispatch_tokens_per_rank=T, num_experts=E, config=config)
    ref = dej.Buffer(mesh, "ep", backend="xla", low_latency_mode=True, num_max_dispatch_tokens_per_rank=T)

    def inputs(seed, kind="random"):
        idx, w = dt.make_routing(seed, R * T, E, K, R, kind)
        x = dt.random_rows(seed + 1, (R * T, H))
        return x, jnp.asarray(idx), jnp.asarray(w)
    """
)

# Independent round trips in one program: normal-mode dispatch + combine
# (one with gradients' cached dispatch), and low-latency dispatch + combine;
# nothing flows from one to the next, so only the order chain orders them.
ROUND_TRIPS = PRELUDE + textwrap.dedent(
    """
    def program(buffer):
        def fn(x, idx, w):
            outs = []
            for scale in (1.0, 2.0, 3.0):
                xs = (x * scale).astype(jnp.bfloat16)
                recv_x, recv_idx, recv_w, handle = dej.dispatch(xs, idx, w, num_experts=E, buffer=buffer)
                out, out_w = dej.combine(recv_x, handle, recv_w, buffer=buffer)
                outs += [recv_x, recv_idx, recv_w, handle.num_recv_tokens, out, out_w]
            for scale in (1.0, 2.0):
                xs = (x * scale).astype(jnp.bfloat16)
                recv_x, count, handle = dej.low_latency_dispatch(
                    xs, idx, num_experts=E, num_max_dispatch_tokens_per_rank=T, use_fp8=False, buffer=buffer)
                outs += [count, dej.low_latency_combine(recv_x, idx, w, handle, buffer=buffer)]
            return tuple(outs)
        return dt.per_rank(fn, mesh, "ep")

    run_cuda, run_ref = program(cuda), program(ref)
    for step, kind in enumerate(["random", "random", "one_expert", "rank_empty", "minus_one"] * 2):
        args = inputs(100 + step, kind)
        got, want = run_cuda(*args), run_ref(*args)
        for i, (g, w_) in enumerate(zip(got, want)):
            g, w_ = np.asarray(g), np.asarray(w_)
            if i < 18 and i % 6 in (0, 1, 2):  # received rows: only the valid ones are defined
                n = np.asarray(got[(i // 6) * 6 + 3])
                for r in range(R):
                    np.testing.assert_array_equal(g[r, :n[r]].view(np.uint8), w_[r, :n[r]].view(np.uint8))
            else:
                np.testing.assert_array_equal(g.view(np.uint8), w_.view(np.uint8), err_msg=f"output {i}, {kind}")
    print("ROUND TRIPS OK")
    """
)

# The same program with the chain cut: every call takes a fresh state holding
# its own position, so nothing orders the calls but XLA's schedule; the
# device checks must then stop any other order with a message.
UNCHAINED = ROUND_TRIPS.replace(
    "run_cuda, run_ref = program(cuda), program(ref)",
    """
import itertools
from deep_ep_jax.comm import ordering
positions = itertools.count()
ordering.take = lambda buffer: jnp.full((1,), next(positions), jnp.int32)
run_cuda, run_ref = program(cuda), program(ref)""",
)

# Ranks at different positions of the chain: rank r claims position 5 * r.
MISMATCH = PRELUDE + textwrap.dedent(
    """
    import sys
    from deep_ep_jax.comm import ordering
    ordering.take = lambda buffer: jnp.full((1,), 5 * jax.lax.axis_index("ep"), jnp.int32)
    x, idx, w = inputs(1)
    if sys.argv[1] == "normal":
        fn = lambda x, idx, w: dej.dispatch(x, idx, w, num_experts=E, buffer=cuda)[0]
    else:
        fn = lambda x, idx, w: dej.low_latency_dispatch(
            x, idx, num_experts=E, num_max_dispatch_tokens_per_rank=T, use_fp8=False, buffer=cuda)[1]
    jax.block_until_ready(dt.per_rank(fn, mesh, "ep")(x, idx, w))
    print("NO MISMATCH SEEN")
    """
)

# A call entering while the Buffer is marked as running a call.
OVERLAP = PRELUDE + textwrap.dedent(
    """
    import sys
    x, idx, w = inputs(2)
    if sys.argv[1] == "normal":
        fn = lambda x, idx, w: dej.dispatch(x, idx, w, num_experts=E, buffer=cuda)[0]
    else:
        fn = lambda x, idx, w: dej.low_latency_dispatch(
            x, idx, num_experts=E, num_max_dispatch_tokens_per_rank=T, use_fp8=False, buffer=cuda)[1]
    run = dt.per_rank(fn, mesh, "ep")
    jax.block_until_ready(run(x, idx, w))  # a call that runs alone passes
    print("FIRST CALL OK", flush=True)
    _native.extension().mark_call_running_for_testing(cuda.buffer_id)
    jax.block_until_ready(run(x, idx, w))
    print("NO OVERLAP SEEN")
    """
)


def _run(script, *args, xla_flags=""):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=240, env=env)
    return result, result.stdout + result.stderr


@pytest.mark.parametrize("flags", ["", CONCURRENT], ids=["default", "concurrent"])
def test_independent_round_trips_in_one_program(flags):
    """Five independent round trips in one jitted program equal the
    reference bit for bit, with XLA's default schedule and with concurrent
    command-buffer scheduling."""
    result, output = _run(ROUND_TRIPS, xla_flags=flags)
    assert result.returncode == 0 and "ROUND TRIPS OK" in output, output[-4000:]


def test_without_the_chain_another_order_is_stopped_not_mixed():
    """Concurrent scheduling of calls that nothing orders: the program either
    ran in one order everywhere (results exact) or the kernels stopped it
    with one of their messages; never wrong results."""
    result, output = _run(UNCHAINED, xla_flags=CONCURRENT)
    caught = "deep_ep_jax call order mismatch" in output or "deep_ep_jax overlapping calls" in output
    print("unchained under concurrent scheduling:", "stopped by a device check" if caught else "ran in order")
    assert ("ROUND TRIPS OK" in output and result.returncode == 0) or caught, output[-4000:]


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_ranks_at_different_calls_stop_with_a_message(mode):
    result, output = _run(MISMATCH, mode)
    assert "NO MISMATCH SEEN" not in output and result.returncode != 0, output[-3000:]
    kind = "dispatch" if mode == "normal" else "low-latency dispatch"
    assert "deep_ep_jax call order mismatch" in output, output[-3000:]
    assert f"rank 0 is at call 0 ({kind})" in output and f"peer 1 at call 5 ({kind})" in output, output[-3000:]


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_a_call_entering_while_another_runs_stops_with_a_message(mode):
    result, output = _run(OVERLAP, mode)
    assert "FIRST CALL OK" in output, output[-3000:]
    assert "NO OVERLAP SEEN" not in output and result.returncode != 0, output[-3000:]
    kind = "dispatch" if mode == "normal" else "low-latency dispatch"
    assert f"deep_ep_jax overlapping calls: a {kind} entered on rank" in output, output[-3000:]
