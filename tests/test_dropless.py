"""dropless_moe (bounded receive buffers, overflow in further rounds) against
the one-round layer sized for the worst case and against tests/oracle.py, bit
for bit, forward and gradients, on fresh random and skewed routing, with
capacities that need one, two and many rounds: 8 ranks here, 16 in a process
of its own, started with the module to run beside the 8 (this file as a
script: `XLA_FLAGS=--xla_force_host_platform_device_count=16 python
tests/test_dropless.py 16 <seed>`, prints "CASE rounds OK")."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from script_run import session_items, start_script

import deep_ep_jax as dej
from deep_ep_jax import testing as dt
from deep_ep_jax.comm.quantize import pack_float4
from deep_ep_jax.config import ROW_FORMATS

TOKENS, HIDDEN, TOPK = 16, 64, 4  # per rank


def exact_inputs(rng, num_ranks, num_experts, kind):
    """Rows of small integers, weights in quarters, scales powers of two: every sum exact."""
    idx, _ = dt.make_routing(int(rng.integers(1 << 30)), num_ranks * TOKENS, num_experts, TOPK, num_ranks, kind)
    w = rng.integers(1, 9, idx.shape).astype(np.float32) / 4
    x = rng.integers(-4, 5, (num_ranks * TOKENS, HIDDEN)).astype(jnp.bfloat16)
    scales = (2.0 ** rng.integers(-1, 3, num_experts)).astype(np.float32)
    return x, idx.astype(np.int32), w, scales


def per_rank_layers(buffer, num_experts, hidden, capacities):
    """Per-rank functions of (x, idx, w, scales) -> (out, rounds [1], dx, dw, dscales), the gradients those of
    sum(out * ramp): "worst", one dispatch sized for the worst case; and dropless_moe at each capacity."""
    ramp = jnp.arange(hidden, dtype=jnp.float32) % 7 - 3

    def worst(x, idx, w, scales):
        recv_x, recv_idx, recv_w, handle = dej.dispatch(x, idx, w, num_experts=num_experts, buffer=buffer)
        return dej.combine(dt.scaled_experts(scales, recv_x, recv_idx, recv_w), handle, buffer=buffer), 1

    def dropless(capacity):
        def layer(x, idx, w, scales):
            return dej.dropless_moe(x, idx, w, dt.scaled_experts, scales, num_experts=num_experts, buffer=buffer,
                                    capacity=capacity, return_rounds=True)  # fmt: skip

        return layer

    def with_grads(layer):
        def run(x, idx, w, scales):
            def loss(x, w, scales):
                out, rounds = layer(x, idx, w, scales)
                return jnp.sum(out.astype(jnp.float32) * ramp), (out, rounds)

            (_, (out, rounds)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, scales)
            return (out, jnp.reshape(rounds, (1,))) + grads

        return run

    return {"worst": with_grads(worst), **{c: with_grads(dropless(c)) for c in capacities}}


def check_rounds(num_ranks, seed):
    """Every routing kind at capacities of one round (T * R), of two or more (T * R / 2: all tokens on one
    expert take exactly two) and of many (R: one token per block): the dropless layer equals the worst-case
    one bit for bit, forward and gradients, and its forward equals the oracle."""
    rng = np.random.default_rng(seed)
    num_experts = 2 * num_ranks
    mesh = Mesh(np.array(jax.devices("cpu")[:num_ranks]), ("ep",))
    buffer = dej.Buffer(mesh, "ep", backend="xla")
    axis = P(buffer.axis_name)
    layers = per_rank_layers(buffer, num_experts, HIDDEN, (num_ranks * TOKENS, num_ranks * TOKENS // 2, num_ranks))
    layers = {k: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=axis, out_specs=axis)) for k, f in layers.items()}
    rounds_seen = set()
    for kind in dt.ROUTING_KINDS:
        x, idx, w, scales = exact_inputs(rng, num_ranks, num_experts, kind)
        want = [np.asarray(a, np.float32) for a in layers["worst"](x, idx, w, scales)]
        valid = np.where((idx >= 0) & (idx < num_experts), idx, -1).reshape(num_ranks, TOKENS, TOPK)
        received = oracle.dispatch(
            x.astype(np.float32).reshape(num_ranks, TOKENS, HIDDEN),
            valid,
            w.reshape(valid.shape),
            num_experts,
            num_ranks * TOKENS,
        )
        y = oracle.scaled_expert_rows(received, scales.reshape(num_ranks, -1), num_ranks * TOKENS, HIDDEN)
        expected = oracle.bf16_values(oracle.combine(y, received, TOKENS)).reshape(-1, HIDDEN)
        np.testing.assert_array_equal(want[0], expected, err_msg=kind)
        for capacity, layer in list(layers.items())[1:]:
            got = [np.asarray(a, np.float32) for a in layer(x, idx, w, scales)]
            rounds = set(got[1].tolist())
            assert len(rounds) == 1, f"ranks disagree on the rounds: {rounds}"
            rounds_seen |= rounds
            for name, a, b in zip(("out", "dx", "dw", "dscales"), got[:1] + got[2:], want[:1] + want[2:]):
                np.testing.assert_array_equal(a, b, err_msg=f"{kind} capacity {capacity}: {name}")
            if capacity == num_ranks * TOKENS:
                assert rounds == {1}, (kind, rounds)
    assert 1 in rounds_seen and 2 in rounds_seen and max(rounds_seen) > 2, rounds_seen
    buffer.destroy()
    return rounds_seen


def psums_in_loops(jaxpr, axis, inside=False):
    """How many psums over `axis` stand inside a loop of `jaxpr` (a ClosedJaxpr's .jaxpr), at any depth."""
    count = 0
    for eqn in jaxpr.eqns:
        looped = inside or eqn.primitive.name == "while"
        if inside and eqn.primitive.name.startswith("psum") and axis in str(eqn.params.get("axes", ())):
            count += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    count += psums_in_loops(sub, axis, looped)
    return count


def data_by_expert(seed):
    """(mesh, buffer, x, idx, w, scales) on a (data 2, ep 4) mesh whose first EP group routes every token to
    one expert and whose second routes none: the groups need different rounds."""
    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("data", "ep"))
    rng = np.random.default_rng(seed)
    _, idx, w, scales = exact_inputs(rng, 4, 8, "one_expert")
    x = rng.integers(-4, 5, (8 * TOKENS, HIDDEN)).astype(jnp.bfloat16)
    idx, w = np.concatenate([idx, np.full_like(idx, -1)]), np.concatenate([w, w])
    return mesh, dej.Buffer(mesh, "ep", backend="xla"), x, idx, w, scales


def test_dropless_on_a_data_by_expert_mesh():
    """EP groups along a data axis that need different rounds (one routes every token to one expert, the
    other nothing): every device runs the same rounds; the experts' parameters (replicated over both axes)
    get their gradient summed over the data axis once, after the rounds, not in each (a psum per round would
    also pair one group's round with another's); results equal the worst-case layer's bit for bit."""
    num_experts, capacity = 8, 4
    mesh, buffer, x, idx, w, scales = data_by_expert(1)
    tokens = P(("data", "ep"))
    programs = {}
    for name, layer in per_rank_layers(buffer, num_experts, HIDDEN, [capacity]).items():
        per_rank = lambda *a, layer=layer: (lambda r: (*r[:4], r[4][None]))(layer(*a))  # noqa: E731
        programs[name] = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(tokens,) * 3 + (P(),), out_specs=tokens))
    assert psums_in_loops(jax.make_jaxpr(programs[capacity])(x, idx, w, scales).jaxpr, "data") == 0
    got, want = programs[capacity](x, idx, w, scales), programs["worst"](x, idx, w, scales)
    rounds = set(np.asarray(got[1]).tolist())
    assert len(rounds) == 1 and rounds.pop() > 1, np.asarray(got[1])  # the idle group's too
    for name, a, b in zip(("out", "dx", "dw", "dscales"), got[:1] + got[2:], want[:1] + want[2:]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    buffer.destroy()


def test_experts_may_close_over_what_is_differentiated():
    """experts that close over the arrays being differentiated (the scales captured by a lambda, not passed
    as params) get the same output and the same gradient for them as through params: dropless_moe hoists
    them (jax.closure_convert). On a data x expert mesh whose groups take different rounds, under jit."""
    num_experts = 8
    mesh, buffer, x, idx, w, scales = data_by_expert(2)
    tokens = P(("data", "ep"))

    def layer(closed):
        def loss(x, idx, w, scales):
            if closed:
                experts = lambda params, *rows: dt.scaled_experts(scales, *rows)  # noqa: E731
                out = dej.dropless_moe(x, idx, w, experts, None, num_experts=num_experts, buffer=buffer, capacity=4)
            else:
                out = dej.dropless_moe(x, idx, w, dt.scaled_experts, scales, num_experts=num_experts, buffer=buffer,
                                       capacity=4)  # fmt: skip
            return jax.lax.psum(jnp.sum(out.astype(jnp.float32) * jnp.arange(HIDDEN)), ("data", "ep"))

        per_rank = jax.shard_map(loss, mesh=mesh, in_specs=(tokens,) * 3 + (P(),), out_specs=P())
        return jax.jit(jax.value_and_grad(per_rank, argnums=(0, 2, 3)))

    (got, got_grads), (want, want_grads) = layer(True)(x, idx, w, scales), layer(False)(x, idx, w, scales)
    np.testing.assert_array_equal(got, want)
    for name, a, b in zip(("x", "topk_weights", "scales"), got_grads, want_grads):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    assert np.any(np.asarray(got_grads[2]) != 0)
    buffer.destroy()


@pytest.mark.parametrize(
    "bad,got",
    [
        (lambda rows: rows[:-1], r"bfloat16 \(63, 64\)"),
        (lambda rows: rows.astype(jnp.float32), r"float32 \(64, 64\)"),
        (lambda rows: rows[:, :32], r"bfloat16 \(64, 32\)"),
        (lambda rows: (rows, rows), "tuple"),
    ],
)
def test_experts_returning_other_rows_raise_naming_experts(bad, got):
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("ep",))
    buffer = dej.Buffer(mesh, "ep", backend="xla")  # no hidden=: the rows' width is x's
    experts = lambda params, rows, idx, w: bad(rows)  # noqa: E731

    def layer(x, idx, w):
        return dej.dropless_moe(x, idx, w, experts, None, num_experts=8, buffer=buffer, capacity=64)

    rows = 4 * TOKENS
    args = (jnp.zeros((rows, HIDDEN), jnp.bfloat16), jnp.zeros((rows, 2), jnp.int32), jnp.ones((rows, 2)))
    program = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    with pytest.raises(TypeError, match=rf"dropless_moe: experts must return bfloat16 \[64, 64\] .*got {got}"):
        program.lower(*args)


def exact_pair(rng, fmt, num_tokens, hidden, packed):
    """A pair of `fmt` holding small integers with power-of-two scales (every product and sum exact);
    NVFP4's data packed two per byte (uint8 [T, H // 2]) where `packed`."""
    values = rng.integers(-4, 5, (num_tokens, hidden)).astype(np.float32)  # in e4m3 and e2m1 alike
    scales = 2.0 ** rng.integers(-2, 3, (num_tokens, hidden // fmt.block))
    data, scales = jnp.asarray(values, fmt.data), jnp.asarray(scales, fmt.scales)
    return (pack_float4(data) if packed else data), scales


def pair_experts(scales, recv_x, recv_topk_idx, recv_topk_weights):
    """dt.scaled_experts on a quantized pair's rows, dequantized."""
    return dt.scaled_experts(scales, dej.dequantize(recv_x, jnp.float32), recv_topk_idx, recv_topk_weights)


def pair_layers(buffer, num_experts, hidden, capacities):
    """per_rank_layers for x a quantized pair: per-rank functions of (data, row_scales, idx, w, scales) ->
    (out, dw, dscales, and dx where the data is floating: zeros, a pair carries no gradient), the
    gradients those of sum(out * ramp), with pair_experts."""
    ramp = jnp.arange(hidden, dtype=jnp.float32) % 7 - 3

    def layer(capacity):
        def run(data, row_scales, idx, w, scales):
            def loss(w, scales, data):
                if capacity == "worst":
                    recv_x, recv_idx, recv_w, handle = dej.dispatch(
                        (data, row_scales), idx, w, num_experts=num_experts, buffer=buffer
                    )
                    out = dej.combine(pair_experts(scales, recv_x, recv_idx, recv_w), handle, buffer=buffer)
                else:
                    out = dej.dropless_moe((data, row_scales), idx, w, pair_experts, scales, num_experts=num_experts,
                                           buffer=buffer, capacity=capacity)  # fmt: skip
                return jnp.sum(out.astype(jnp.float32) * ramp), out

            argnums = (0, 1, 2) if jnp.issubdtype(data.dtype, jnp.floating) else (0, 1)
            (_, out), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(w, scales, data)
            return (out, *grads)

        return run

    return {c: layer(c) for c in ("worst", *capacities)}


def check_pair_layers(got, want, what):
    """A dropless pair layer's results equal the worst-case layer's bit for bit; x's pair got zeros."""
    for name, a, b in zip(("out", "dw", "dscales", "dx"), got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), f"{what}: {name}")
    if len(want) > 3:
        assert not np.any(np.asarray(want[3], np.float32)), f"{what}: a pair's rows carry no gradient"


@pytest.mark.parametrize("name,packed", [("FP8", False), ("MXFP8", False), ("NVFP4", False), ("NVFP4", True)])
def test_dropless_moves_quantized_pairs(name, packed):
    """dropless_moe with x a quantized pair (config.ROW_FORMATS; NVFP4 as float4 or packed bytes) equals
    the worst-case layer bit for bit, forward and the gradients of the weights and the experts'
    parameters, in many rounds (one token per block; one round: the bf16 tests)."""
    num_ranks, num_experts, hidden = 4, 8, 128  # a pair's hidden: a multiple of 128
    fmt = next(f for f in ROW_FORMATS if f.name == name)
    mesh = Mesh(np.array(jax.devices("cpu")[:num_ranks]), ("ep",))
    buffer = dej.Buffer(mesh, "ep", backend="xla")
    layers = pair_layers(buffer, num_experts, hidden, (num_ranks,))
    layers = {k: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))) for k, f in layers.items()}
    rng = np.random.default_rng(0)
    for kind in ("random", "one_expert"):
        _, idx, w, scales = exact_inputs(rng, num_ranks, num_experts, kind)
        args = (*exact_pair(rng, fmt, num_ranks * TOKENS, hidden, packed), idx, w, scales)
        check_pair_layers(layers[num_ranks](*args), layers["worst"](*args), kind)
    buffer.destroy()


def test_dropless_memory_scales_with_the_capacity():
    """On the reference backend (XLA's all_to_all, pair-capped rounds) the temporaries of the layer's forward and
    backward (the compiled program's memory analysis, per device) grow with the capacity, at most 10 rows of it
    (send and receive blocks of 1.5 capacities each, received rows, the experts' rows, forward and backward)
    besides 6 token-sized ones, where one dispatch sized for the worst case (T x R rows) needs several times
    that."""
    num_ranks, tokens, hidden, topk, num_experts = 8, 128, 512, 8, 64
    mesh = Mesh(np.array(jax.devices("cpu")[:num_ranks]), ("ep",))
    buffer = dej.Buffer(mesh, "ep", backend="xla")
    row = 2 * hidden
    idx, w = dt.make_routing(0, num_ranks * tokens, num_experts, topk, num_ranks, "random")
    args = (jnp.zeros((num_ranks * tokens, hidden), jnp.bfloat16), idx, w, jnp.ones((num_experts,), jnp.float32))

    def temporaries(capacity):
        layer = per_rank_layers(buffer, num_experts, hidden, [capacity] if capacity else [])[capacity or "worst"]
        program = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
        return program.lower(*args).compile().memory_analysis().temp_size_in_bytes

    bounded = {capacity: temporaries(capacity) for capacity in (tokens, 4 * tokens)}
    for capacity, used in bounded.items():
        assert used <= (10 * capacity + 6 * tokens) * row, (capacity, used / row)
    assert temporaries(None) > 3 * bounded[tokens]  # one dispatch for the worst case: T x R rows


@pytest.fixture(scope="module", autouse=True)
def sixteen_ranks(request):
    """The 16-rank check's process (seed, Background), started before this module's first test where
    the session runs the 16-rank test, so that it runs beside the 8-rank one (whose compiles leave a core idle
    part of the time); else None."""
    if not session_items(request, "test_dropless_matches_the_worst_case_layer_16_ranks"):
        yield None
        return
    seed = int(np.random.SeedSequence().entropy % (1 << 31))
    worker = start_script(__file__, 16, seed, devices=16)
    try:
        yield seed, worker
    finally:
        worker.stop()


def test_dropless_matches_the_worst_case_layer_8_ranks():
    seed = int(np.random.SeedSequence().entropy % (1 << 31))
    print(f"seed {seed}; rounds seen: {sorted(check_rounds(8, seed))}")


def test_dropless_matches_the_worst_case_layer_16_ranks(sixteen_ranks):
    seed, worker = sixteen_ranks
    code, stdout, stderr = worker.result(timeout=600)
    assert code == 0 and "CASE rounds OK" in stdout, f"seed {seed}:\n{stdout[-3000:]}{stderr[-6000:]}"


if __name__ == "__main__":
    print(f"rounds seen: {sorted(check_rounds(int(sys.argv[1]), int(sys.argv[2])))}")
    print("CASE rounds OK", flush=True)
