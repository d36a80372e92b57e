"""The order chain of a Buffer's CUDA calls (deep_ep_jax.comm.ordering), checked
in the traced programs on CPU: every call that communicates takes the
previous call's order state and returns the next, aliased, so XLA cannot run
two calls of one Buffer at once or in another order on another rank. The
CUDA backend is traced with a stand-in Buffer (no device memory: the programs
are traced, not run)."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import deep_ep_jax as dej
from deep_ep_jax import testing as dt
from deep_ep_jax.backends import Ops
from deep_ep_jax.backends.cuda import intranode, layout, low_latency

pytestmark = pytest.mark.extension  # the CUDA backend's checks read the extension's limits

R, T, H, E, K = 2, 8, 128, 8, 2
CALLS = {
    "deep_ep_jax_dispatch",
    "deep_ep_jax_cached_dispatch",
    "deep_ep_jax_combine",
    "deep_ep_jax_low_latency_dispatch_send",
    "deep_ep_jax_low_latency_dispatch_recv",
    "deep_ep_jax_low_latency_combine_send",
    "deep_ep_jax_low_latency_combine_recv",
}


def _stand_in_cuda_buffer(buffer_id=7, **kwargs):
    """A Buffer whose calls trace as the CUDA backend's (never run)."""
    buffer = dej.Buffer(dt.ep_mesh(R, platform="cpu"), "ep", backend="xla", **kwargs)
    buffer.backend, buffer.buffer_id = "cuda", buffer_id
    buffer.num_nvl_bytes = buffer.num_rdma_bytes = 1 << 30
    buffer.ops = Ops.of(layout, intranode, low_latency)
    return buffer


_CUSTOM_CALL = re.compile(r"(%[\w]+)(?::(\d+))? = stablehlo\.custom_call @(\w+)\(([^)]*)\)(.*)")


def _per_rank(fn, check_vma=False):
    """fn jitted per rank over the stand-in Buffers' mesh."""
    mesh = dt.ep_mesh(R, platform="cpu")
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"), check_vma=check_vma))


def _calls(fn, *args, check_vma=False):
    """The Buffer calls of fn per rank, lowered (custom_vjp bodies inlined), in
    program order: [(target, first operand, last result, aliases)]."""
    text = _per_rank(fn, check_vma).lower(*args).as_text()
    calls = []
    for line in text.splitlines():
        match = _CUSTOM_CALL.search(line)
        if match and match.group(3) in CALLS:
            result, count, target, operands, rest = match.groups()
            last = f"{result}#{int(count) - 1}" if count else result
            calls.append((target, operands.split(",")[0].strip(), last, rest))
    return calls


def _targets(calls):
    return [target for target, *_ in calls]


def _assert_chained(calls):
    """Each call's first operand is the previous call's last result (the
    first takes a fresh state), and each aliases the two."""
    assert calls
    for previous, call in zip([None] + calls[:-1], calls):
        assert "output_operand_aliases" in call[3] and "operand_index = 0" in call[3], call[0]
        if previous is not None:
            assert call[1] == previous[2], (previous, call)


def _routing(seed):
    idx, w = dt.make_routing(seed, R * T, E, K, R, "random")
    return jnp.asarray(idx), jnp.asarray(w)


def test_two_independent_round_trips_are_one_chain():
    buffer = _stand_in_cuda_buffer()
    idx, w = _routing(1)
    x = dt.random_rows(2, (R * T, H))

    def two_round_trips(x, idx, w):
        outs = []
        for scale in (1, 2):  # nothing flows from the first round trip to the second
            recv_x, _, _, handle = dej.dispatch(x * scale, idx, w, num_experts=E, buffer=buffer)
            outs.append(dej.combine(recv_x, handle, buffer=buffer))
        return outs[0] + outs[1]

    calls = _calls(two_round_trips, x, idx, w)
    assert _targets(calls) == ["deep_ep_jax_dispatch", "deep_ep_jax_combine"] * 2
    _assert_chained(calls)


def test_the_chain_runs_through_gradients():
    buffer = _stand_in_cuda_buffer()
    idx, w = _routing(3)
    x = dt.random_rows(4, (R * T, H))

    def loss(x, w, idx):
        recv_x, _, recv_w, handle = dej.dispatch(x, idx, w, num_experts=E, buffer=buffer)
        out, out_w = dej.combine(recv_x, handle, recv_w, buffer=buffer)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(out_w)

    calls = _calls(jax.grad(loss, argnums=(0, 1)), x, w, idx)
    # forward dispatch, combine; backward: combine's (a cached dispatch), dispatch's (a combine)
    assert _targets(calls) == [
        "deep_ep_jax_dispatch",
        "deep_ep_jax_combine",
        "deep_ep_jax_cached_dispatch",
        "deep_ep_jax_combine",
    ]
    _assert_chained(calls)


def test_low_latency_halves_and_normal_calls_share_the_chain():
    buffer = _stand_in_cuda_buffer(low_latency_mode=True, num_max_dispatch_tokens_per_rank=T)
    idx, w = _routing(5)
    x = dt.random_rows(6, (R * T, H))

    def step(x, idx, w):
        pending = dej.low_latency_dispatch_send(
            x, idx, num_experts=E, num_max_dispatch_tokens_per_rank=T, use_fp8=False, buffer=buffer
        )
        recv_x, _, handle = dej.low_latency_dispatch_recv(pending, buffer=buffer)
        pending = dej.low_latency_combine_send(recv_x, idx, w, handle, buffer=buffer)
        out = dej.low_latency_combine_recv(pending, buffer=buffer)
        recv_n, _, _, h = dej.dispatch(x, idx, w, num_experts=E, buffer=buffer)
        return out + dej.combine(recv_n, h, buffer=buffer)

    calls = _calls(step, x, idx, w)
    assert len(calls) == 6
    _assert_chained(calls)


def test_calls_carry_no_jax_effect():
    """No CUDA call makes its program effectful: a jitted step holding them
    keeps jit's C++ dispatch path (an effect cost 0.4-0.9 ms of Python per call,
    measured in the decode example), and XLA sees plain custom calls."""
    buffer = _stand_in_cuda_buffer(low_latency_mode=True, num_max_dispatch_tokens_per_rank=T)
    idx, w = _routing(11)
    x = dt.random_rows(12, (R * T, H))

    def step(x, idx, w):
        recv_x, _, handle = dej.low_latency_dispatch(
            x, idx, num_experts=E, num_max_dispatch_tokens_per_rank=T, use_fp8=False, buffer=buffer
        )
        out = dej.low_latency_combine(recv_x, idx, w, handle, buffer=buffer)
        pending = dej.low_latency_dispatch_send(
            x, idx, num_experts=E, num_max_dispatch_tokens_per_rank=T, use_fp8=False, buffer=buffer
        )
        pending, y = dej.low_latency_overlap(pending, lambda a: a * 2, out)
        recv_x, _, handle = dej.low_latency_dispatch_recv(pending, buffer=buffer)
        out = y + dej.low_latency_combine_recv(
            dej.low_latency_combine_send(recv_x, idx, w, handle, buffer=buffer), buffer=buffer
        )
        recv_n, _, _, h = dej.dispatch(x, idx, w, num_experts=E, buffer=buffer)
        return out + dej.combine(recv_n, h, buffer=buffer)

    jitted = _per_rank(step)
    assert jitted.trace(x, idx, w).jaxpr.effects == set()
    text = jitted.lower(x, idx, w).as_text()
    assert text.count("stablehlo.custom_call @deep_ep_jax_") == 8, text
    assert "has_side_effect = true" not in text


def test_buffers_and_programs_have_their_own_chains():
    first, second = _stand_in_cuda_buffer(7), _stand_in_cuda_buffer(8)
    idx, w = _routing(7)
    x = dt.random_rows(8, (R * T, H))

    def both(x, idx, w):
        a, _, _, ha = dej.dispatch(x, idx, w, num_experts=E, buffer=first)
        b, _, _, hb = dej.dispatch(x, idx, w, num_experts=E, buffer=second)
        return dej.combine(a, ha, buffer=first) + dej.combine(b, hb, buffer=second)

    calls = _calls(both, x, idx, w)
    _assert_chained([calls[0], calls[2]])
    _assert_chained([calls[1], calls[3]])
    assert calls[1][1] != calls[0][2]
    # A second program starts its own chain: no value of the first program's trace leaks into it.
    assert _calls(both, x, idx, w) == calls


def test_results_vary_over_the_ep_axis():
    """check_vma=True (shard_map's default): the custom calls' results are
    typed as varying over the EP axis, so gradients type-check."""
    buffer = _stand_in_cuda_buffer()
    idx, w = _routing(9)
    x = dt.random_rows(10, (R * T, H))

    def loss(x, w, idx):
        recv_x, _, recv_w, handle = dej.dispatch(x, idx, w, num_experts=E, buffer=buffer)
        out, out_w = dej.combine(recv_x, handle, recv_w, buffer=buffer)
        return jax.lax.psum(jnp.sum(out.astype(jnp.float32)) + jnp.sum(out_w), "ep")

    # shard_map's defaults (check_vma=True): before the results were cast, the
    # gradient failed with "the manual axis types do not match".
    calls = _calls(jax.grad(loss, argnums=(0, 1)), x, w, idx, check_vma=True)
    assert len(calls) == 4
    _assert_chained(calls)
