"""The overlapped low-latency halves (Config.low_latency_overlap_sms) as they
lower, checked on the CPU: their custom calls, the send's SM limit, and the
receive taking the send's inputs so that XLA keeps them alive. Lowering
needs the extension (the trace-time checks ask it for sizes and limits), not
a GPU."""

import re
import types

import jax
import jax.numpy as jnp
import pytest

import deep_ep_jax as dej
from deep_ep_jax import testing as dt
from deep_ep_jax.backends.cuda import low_latency as cll
from deep_ep_jax.backends.cuda import sizes

NUM_RANKS, NUM_EXPERTS, M, K, H = 2, 16, 8, 4, 256
extension = pytest.mark.extension


def _buffer(overlap_sms):
    region = sizes.low_latency_region_bytes(NUM_RANKS, NUM_EXPERTS, H, M, num_topk=K)
    return dt.stand_in_cuda_buffer(
        NUM_RANKS, num_rdma_bytes=region, config=dej.Config(low_latency_overlap_sms=overlap_sms)
    )


def _step(send_buffer, recv_buffer):
    def step(x, idx, w, y):
        pending = cll.low_latency_dispatch_send(
            x,
            idx,
            num_experts=NUM_EXPERTS,
            num_max_dispatch_tokens_per_rank=M,
            use_fp8=True,
            round_scale=False,
            buffer=send_buffer,
        )
        recv_x, count, handle = cll.low_latency_dispatch_recv(pending, buffer=recv_buffer)
        pending = cll.low_latency_combine_send(y, idx, w, handle, buffer=send_buffer)
        return cll.low_latency_combine_recv(pending, buffer=recv_buffer), recv_x, count

    return step


_ARGS = (
    jax.ShapeDtypeStruct((M, H), jnp.bfloat16),
    jax.ShapeDtypeStruct((M, K), jnp.int32),
    jax.ShapeDtypeStruct((M, K), jnp.float32),
    jax.ShapeDtypeStruct((NUM_EXPERTS // NUM_RANKS, NUM_RANKS * M, H), jnp.bfloat16),
)


def _custom_calls(text):
    """[(target, number of operands, attribute text)] in program order."""
    calls = []
    for m in re.finditer(r"custom_call @(\w+)\(([^)]*)\)(.*)", text):
        operands = [o for o in m.group(2).split(",") if o.strip()]
        calls.append((m.group(1), len(operands), m.group(3)))
    return calls


@extension
@pytest.mark.parametrize("overlap_sms", [0, 16])
def test_halves_lower_to_their_flavour(overlap_sms):
    buffer = _buffer(overlap_sms)
    text = jax.jit(_step(buffer, buffer)).lower(*_ARGS).as_text()
    suffix = "_overlapped" if overlap_sms else ""
    calls = _custom_calls(text)
    assert [c[0] for c in calls] == [
        f"deep_ep_jax_low_latency_{half}{suffix}"
        for half in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")
    ]
    (_, _, send_attrs), (_, recv_operands, _), (_, _, combine_send_attrs), calls_recv = calls
    _, combine_recv_operands, combine_recv_attrs = calls_recv
    assert f"max_blocks = {overlap_sms} : i64" in send_attrs
    assert f"max_blocks = {overlap_sms} : i64" in combine_send_attrs
    # The receive skips top-k ids outside [0, E) itself: it is told E.
    assert f"num_experts = {NUM_EXPERTS} : i64" in combine_recv_attrs
    # The order state and the token, then (overlapped) the send's inputs: x and topk_idx; x and the handle's
    # four arrays.
    assert recv_operands == (2 + 2 if overlap_sms else 2)
    assert combine_recv_operands == (4 + 5 if overlap_sms else 4)


@extension
def test_receive_of_the_other_flavour_is_refused():
    with pytest.raises(ValueError, match="overlapped .* receive with the buffer that sent"):
        jax.jit(_step(_buffer(16), _buffer(0))).lower(*_ARGS)


@extension
@pytest.mark.parametrize("send_sms, recv_sms", [(16, 0), (0, 16)])
def test_combine_receive_of_the_other_flavour_is_refused(send_sms, recv_sms):
    def step(x, idx, w, y):
        _, _, handle = cll.low_latency_dispatch(
            x,
            idx,
            num_experts=NUM_EXPERTS,
            num_max_dispatch_tokens_per_rank=M,
            use_fp8=True,
            round_scale=False,
            buffer=_buffer(0),
        )
        pending = cll.low_latency_combine_send(y, idx, w, handle, buffer=_buffer(send_sms))
        return cll.low_latency_combine_recv(pending, buffer=_buffer(recv_sms))

    was = "" if send_sms else "not "
    with pytest.raises(
        ValueError,
        match=f"^low_latency_combine_recv: the send was {was}overlapped but this buffer's "
        f"config.low_latency_overlap_sms is {recv_sms}; receive with the buffer",
    ):
        jax.jit(step).lower(*_ARGS)


def test_config_bounds(monkeypatch):
    assert dej.Config().low_latency_overlap_sms == 0
    monkeypatch.setenv("DEEP_EP_JAX_LL_OVERLAP_SMS", "20")
    assert dej.Config().low_latency_overlap_sms == 20
    with pytest.raises(ValueError, match="low_latency_overlap_sms"):
        dej.Config(low_latency_overlap_sms=-1)


@extension
def test_region_checks():
    """A region of the hint's size passes the trace-time checks of its
    shapes; a quarter of it is refused, naming the size function."""
    buffer = _buffer(0)
    jax.jit(_step(buffer, buffer)).lower(*_ARGS)
    small = types.SimpleNamespace(**dict(vars(buffer), num_rdma_bytes=buffer.num_rdma_bytes // 4))
    with pytest.raises(ValueError, match="too small .*sizes.low_latency_region_bytes"):
        jax.jit(_step(small, small)).lower(*_ARGS)


@extension
def test_overlap_places_compute_between_the_halves():
    """low_latency_overlap ties the compute to the send's result and the
    receive to the compute's, so XLA cannot move it before or after them."""
    buffer = _buffer(16)

    def step(x, idx, w, y):
        pending = cll.low_latency_dispatch_send(
            x,
            idx,
            num_experts=NUM_EXPERTS,
            num_max_dispatch_tokens_per_rank=M,
            use_fp8=True,
            round_scale=False,
            buffer=buffer,
        )
        pending, z = dej.low_latency_overlap(pending, lambda a: jnp.tanh(a @ a.T), w)
        return cll.low_latency_dispatch_recv(pending, buffer=buffer), z

    text = jax.jit(step).lower(*_ARGS).as_text()
    send = re.search(r"(%\d+):2 = stablehlo.custom_call @deep_ep_jax_low_latency_dispatch_send", text).group(1)
    send += "#0"  # its token (then its order state)
    first, second = re.findall(r"(%\d+):\d+ = stablehlo.optimization_barrier (.*) :", text)
    assert send in first[1].split(", ")  # the compute's inputs wait for the send ...
    dot = re.search(r"stablehlo.dot_general (%\S+),", text).group(1)
    assert dot.startswith(first[0] + "#")  # ... the compute reads them ...
    tanh = re.search(r"(%\d+) = stablehlo.tanh", text).group(1)
    assert tanh in second[1].split(", ")  # ... and the receive waits for its result
    recv = re.search(r"custom_call @deep_ep_jax_low_latency_dispatch_recv_overlapped\(%[^,)]+, (%[^,)]+)", text).group(
        1
    )
    assert recv.startswith(second[0] + "#")


@extension
@pytest.mark.parametrize("split", [False, True])
def test_mxfp8_lowers_with_its_attribute(split):
    """mxfp8=True reaches the send's custom call as an attribute, and the receive's float32 scale
    words come back as float8_e8m0fnu [E/R, R*M, H // 32] (the kernels write e8m0 bytes there)."""
    buffer = _buffer(0)
    kwargs = dict(num_experts=NUM_EXPERTS, num_max_dispatch_tokens_per_rank=M, use_fp8=True, round_scale=False)

    def dispatch(x, idx):
        if split:
            pending = cll.low_latency_dispatch_send(x, idx, buffer=buffer, mxfp8=True, **kwargs)
            return cll.low_latency_dispatch_recv(pending, buffer=buffer)[0]
        return cll.low_latency_dispatch(x, idx, buffer=buffer, mxfp8=True, **kwargs)[0]

    lowered = jax.jit(dispatch).lower(*_ARGS[:2])
    data, scales = lowered.out_info
    assert scales.dtype == jnp.float8_e8m0fnu and scales.shape == (NUM_EXPERTS // NUM_RANKS, NUM_RANKS * M, H // 32)
    assert data.dtype == jnp.float8_e4m3fn
    sends = [c for c in _custom_calls(lowered.as_text()) if "dispatch_send" in c[0] or c[0].endswith("dispatch")]
    assert sends and all("mxfp8 = true" in c[2] for c in sends), sends
