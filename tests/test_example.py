"""The Flax MoE example: the layer against dense per-token maths, and the
training script end to end (its loss must fall). CPU, reference backend."""

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import moe_layer as ml
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from script_run import run_script, run_scripts

import deep_ep_jax as dej
from deep_ep_jax import fp8_quant
from deep_ep_jax import testing as dt
from deep_ep_jax.comm.expert_major import default_num_rows
from deep_ep_jax.experts.grouped_gemm import Fp8Rows

ROOT = Path(__file__).resolve().parents[1]

H, F, K = 32, 16, 3


def run_example(script, *argv):
    """examples/<script> run on 8 virtual CPU devices, on any host."""
    return run_script(f"examples/{script}", *argv)


def _bf16(a):
    return a.astype(jnp.bfloat16).astype(jnp.float32)


def dense_moe(x, topk_idx, topk_weights, w_in, w_out):
    """sum_k w_k * SwiGLU_{idx_k}(x) per token, with the layer's bf16 roundings
    of inputs and weights; slots with ids outside [0, E) contribute nothing.
    Expert by expert over every token (each expert's weights read once, not
    gathered per token: the memory of a dense layer), times the weight of the
    token's slot for that expert (0 where it has none)."""
    x = _bf16(x)
    out = jnp.zeros(x.shape, jnp.float32)
    for e in range(w_in.shape[0]):
        chosen = topk_idx == e
        gate, up = jnp.split(x @ _bf16(w_in[e]), 2, axis=-1)
        h = _bf16(jax.nn.silu(_bf16(gate)) * _bf16(up))
        y = _bf16(h @ _bf16(w_out[e]))
        out = out + jnp.sum(jnp.where(chosen, topk_weights, 0.0), axis=1)[:, None] * y
    return out


def output_and_grads(fn, args, probe):
    """(fn(*args), the gradients of <fn(*args), probe> for every argument), the forward run once."""

    def loss(*a):
        y = fn(*a)
        return jnp.sum(y.astype(jnp.float32) * probe), y

    (_, y), grads = jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True)(*args)
    return y, grads


@jax.jit
def _dense_and_grads(x, topk_idx, topk_weights, w_in, w_out, probe):
    """dense_moe and the gradients of <dense_moe(...), probe> for (x, topk_weights, w_in, w_out), under one
    jit (run eagerly, each of its ops compiles on its own; jitted, one compile per shape for the module)."""
    return output_and_grads(
        lambda x, w, wi, wo: dense_moe(x, topk_idx, w, wi, wo), (x, topk_weights, w_in, w_out), probe
    )


def _assert_close(got, want, what, rel=3e-2):
    """Asserts got is finite and within rel of want's largest value; returns the error as that fraction."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    scale = np.abs(want).max() + 1e-6
    err = np.abs(got - want).max()
    assert err <= rel * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"
    return err / scale


def _mesh():
    """(data, expert) over the CPU devices: 2 x n/2 when possible."""
    devices = jax.devices("cpu")
    data = 2 if len(devices) >= 4 and len(devices) % 2 == 0 else 1
    return Mesh(np.array(devices).reshape(data, -1), ("data", "expert"))


def _weights(seed, num_experts):
    w_in = dt.random_rows(seed, (num_experts, H, 2 * F), jnp.float32) * 0.3
    w_out = dt.random_rows(seed + 1, (num_experts, F, H), jnp.float32) * 0.3
    return w_in, w_out


def test_expert_ffn_ignores_padding_and_empty_slots():
    """Padding rows full of NaN and -1 slots must not leak into outputs or
    gradients (the contract leaves padding rows of recv_x unspecified)."""
    num_rows, num_valid, num_local = 24, 17, 4
    rng = np.random.default_rng(0)
    idx = np.stack([rng.permutation(num_local)[:K] for _ in range(num_rows)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.3] = -1
    idx[3] = -1  # a valid row with no local expert
    idx[num_valid:] = -1
    weights = np.where(idx >= 0, rng.random(idx.shape) + 0.1, 0.0).astype(np.float32)
    x = np.array(dt.random_rows(1, (num_rows, H), jnp.float32))
    x[num_valid:] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    idx, weights = jnp.asarray(idx), jnp.asarray(weights)
    w_in, w_out = _weights(2, num_local)
    probe = dt.random_rows(3, (num_rows, H), jnp.float32)

    def loss(fn, x, weights, w_in, w_out):
        return jnp.sum(fn(x, idx, weights, w_in, w_out).astype(jnp.float32) * probe)

    clean = jnp.where(jnp.arange(num_rows)[:, None] < num_valid, x, 0)
    want_y, want = _dense_and_grads(clean.astype(jnp.float32), idx, weights, w_in, w_out, probe)  # bf16 values
    got = jax.jit(ml.expert_ffn)(x, idx, weights, w_in, w_out)
    _assert_close(got, want_y, "expert_ffn")
    assert (np.asarray(got[num_valid:], np.float32) == 0).all() and (np.asarray(got[3], np.float32) == 0).all()

    grads = jax.jit(jax.grad(lambda *a: loss(ml.expert_ffn, *a), argnums=(0, 1, 2, 3)))(x, weights, w_in, w_out)
    for name, g, w in zip(("x", "weights", "w_in", "w_out"), grads, want):
        _assert_close(g, w, f"grad {name}")
    assert (np.asarray(grads[0][num_valid:], np.float32) == 0).all()


MOE_FFN_CASES = (
    [(kind, "ragged_dot", 1) for kind in dt.ROUTING_KINDS]
    + [(kind, "grouped", 1) for kind in dt.ROUTING_KINDS]
    + [("rank_empty", "grouped", 3)]
)


@functools.cache
def _moe_ffn_and_grads(impl, alignment, expert_rows=None):
    """(buffer, f): f(x, idx, weights, w_in, w_out, probe) is moe_ffn on the (data, expert) mesh and the
    gradients of <output, probe> for (x, weights, w_in, w_out), under one jit. Built once per expert path:
    the routing kinds share its compile (idx and probe are arguments, not constants of the trace)."""
    mesh = _mesh()
    num_experts = 2 * mesh.shape["expert"]
    buffer = dej.Buffer(mesh, "expert", backend="xla", hidden=H, num_experts=num_experts)
    tokens, experts = P(("data", "expert")), P("expert")
    sharded = jax.shard_map(  # shard_map's defaults (check_vma=True), as the example
        lambda *a: ml.moe_ffn(
            *a,
            buffer=buffer,
            num_experts=num_experts,
            expert_impl=impl,
            expert_rows=expert_rows,
            expert_alignment=alignment,
        ),
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, experts, experts),
        out_specs=tokens,
    )

    def fwd_and_grads(x, idx, weights, w_in, w_out, probe):
        return output_and_grads(lambda x, w, wi, wo: sharded(x, idx, w, wi, wo), (x, weights, w_in, w_out), probe)

    return buffer, jax.jit(fwd_and_grads)


@pytest.mark.parametrize(("kind", "impl", "alignment"), MOE_FFN_CASES)
def test_moe_ffn_matches_dense(kind, impl, alignment):
    """dispatch -> experts -> combine on a (data, expert) mesh, forward and
    gradients, against the same maths per token on one device. "grouped":
    expert-major rows (groups aligned to `alignment`) and grouped_matmul."""
    mesh = _mesh()
    num_ranks = mesh.shape["expert"]
    num_experts, num_tokens = 2 * num_ranks, 12 * mesh.size
    idx, weights = dt.make_routing(4, num_tokens, num_experts, K, num_ranks, kind)
    idx, weights = jnp.asarray(idx), jnp.asarray(weights)
    x = dt.random_rows(5, (num_tokens, H), jnp.float32)
    w_in, w_out = _weights(6, num_experts)
    probe = dt.random_rows(7, (num_tokens, H), jnp.float32)

    got, grads = _moe_ffn_and_grads(impl, alignment)[1](x, idx, weights, w_in, w_out, probe)
    want_y, want = _dense_and_grads(x, idx, weights, w_in, w_out, probe)
    _assert_close(got, want_y, f"{kind}: output")
    for name, g, w in zip(("x", "topk_weights", "w_in", "w_out"), grads, want):
        _assert_close(g, w, f"{kind}: grad {name}")


def test_moe_module():
    """The NNX layer: router + experts against dense maths, gradients reach
    the router (through dispatch's weights), and the balance loss is sane."""
    mesh = _mesh()
    num_experts = 2 * mesh.shape["expert"]
    buffer = dej.Buffer(mesh, "expert", backend="xla", hidden=H, num_experts=num_experts)
    layer = ml.MoE(H, F, num_experts, 2, buffer=buffer, rngs=nnx.Rngs(0))
    x = jax.device_put(dt.random_rows(8, (4, 4 * mesh.size, H), jnp.float32), NamedSharding(mesh, P(None, None)))
    router, w_in, w_out = layer.router[...], layer.w_in[...], layer.w_out[...]

    def dense(x, router, w_in, w_out):
        idx, weights, aux = ml.route(x.reshape(-1, H), router, 2)
        return dense_moe(x.reshape(-1, H), idx, weights, w_in, w_out).reshape(x.shape), aux

    y, aux = jax.jit(lambda x: layer(x))(x)
    want_y, want_aux = jax.jit(dense)(x, router, w_in, w_out)  # jitted: one compile, not one per op
    assert y.shape == x.shape and y.dtype == x.dtype
    _assert_close(y, want_y, "MoE output")
    np.testing.assert_allclose(aux, want_aux, rtol=1e-5)
    assert 1.0 <= float(aux) < num_experts

    def loss(fn, *params):
        y, aux = fn(x, *params)
        return jnp.sum(jnp.sin(y)) + aux

    apply = lambda x, *p: ml.moe_apply(x, *p, top_k=2, buffer=buffer)
    grads = jax.jit(jax.grad(lambda *p: loss(apply, *p), argnums=(0, 1, 2)))(router, w_in, w_out)
    want = jax.jit(jax.grad(lambda *p: loss(dense, *p), argnums=(0, 1, 2)))(router, w_in, w_out)
    for name, g, w in zip(("router", "w_in", "w_out"), grads, want):
        _assert_close(g, w, f"grad {name}")


@pytest.mark.parametrize("impl", [None, "grouped"])
def test_training_example_loss_falls(tmp_path, impl):
    """examples/moe_flax.py trains on 8 virtual CPU devices and its loss falls
    (with the default experts, and with --expert-impl grouped)."""
    plot = tmp_path / "loss.png"
    run = run_example(
        "moe_flax.py",
        "--steps",
        "8",
        "--batch",  # 2 sequences per device: the loss falls as well as with the default 4, in less time
        "16",
        "--log-every",
        "1",
        "--no-progress",
        "--plot",
        str(plot),
        *(["--expert-impl", impl] if impl else []),
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "backend xla" in run.stdout and "'data': 2, 'expert': 4" in run.stdout, run.stdout
    assert f"experts {impl or 'ragged_dot'}" in run.stdout, run.stdout
    losses = [float(v) for v in re.findall(r"loss=([0-9.]+)", run.stdout)]
    assert len(losses) == 8, run.stdout
    assert losses[-1] < 0.75 * losses[0], f"loss did not fall: {losses}"
    assert plot.stat().st_size > 0


def test_quickstart_runs():
    """examples/quickstart.py on 8 virtual CPU devices: the xla backend, and
    its own check against one-device maths passes."""
    run = run_example("quickstart.py", "--cpu")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert "8 x cpu devices, backend=xla" in lines, run.stdout
    assert "combine(expert(dispatch(x))) vs one-device maths: max abs error 0.0" in lines, run.stdout
    assert lines[-1] == "OK", run.stdout


def _random_recv(seed, num_rows, num_valid, num_local):
    """Received rows as dispatch leaves them: -1 slots, NaN padding rows."""
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(num_local)[:K] for _ in range(num_rows)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.2] = -1
    idx[num_valid:] = -1
    weights = np.where(idx >= 0, rng.random(idx.shape) + 0.1, 0.0).astype(np.float32)
    x = np.array(dt.random_rows(seed + 1, (num_rows, H), jnp.float32))
    x[num_valid:] = np.nan
    return jnp.asarray(x, jnp.bfloat16), idx, weights


@functools.cache
def _expert_ffn_and_grads(impl, capacity=None, expert_rows=None, alignment=None):
    """f(x, idx, weights, w_in, w_out, probe) -> expert_ffn's output and the gradients of <output, probe>
    for (x, weights, w_in, w_out), under one jit. Built once per configuration, so that cases and tests of
    one shape share its compile (idx and probe are arguments, not constants of the trace)."""

    def f(x, idx, weights, w_in, w_out, probe):
        fn = lambda x, w, wi, wo: ml.expert_ffn(
            x, idx, w, wi, wo, impl=impl, capacity=capacity, expert_rows=expert_rows, expert_alignment=alignment
        )
        return output_and_grads(fn, (x, weights, w_in, w_out), probe)

    return jax.jit(f)


def _ffn_and_grads(impl, capacity, x, idx, weights, w_in, w_out, probe):
    return _expert_ffn_and_grads(impl, capacity)(x, idx, weights, w_in, w_out, probe)


@pytest.mark.parametrize("skewed", [False, True])
def test_capacity_matches_ragged_dot(skewed):
    """The capacity path is the ragged_dot path (forward and gradients) when
    nothing is dropped, including every pair on one expert."""
    num_rows, num_valid, num_local = 40, 29, 4
    x, idx, weights = _random_recv(10, num_rows, num_valid, num_local)
    if skewed:
        idx = np.where(idx >= 0, 2, -1).astype(np.int32)
        idx[:, 1:] = -1  # one slot per row, all on expert 2
        weights = np.where(idx >= 0, weights, 0.0).astype(np.float32)
    idx, weights = jnp.asarray(idx), jnp.asarray(weights)
    w_in, w_out = _weights(11, num_local)
    probe = dt.random_rows(12, (num_rows, H), jnp.float32)
    ragged_y, ragged_g = _ffn_and_grads("ragged_dot", None, x, idx, weights, w_in, w_out, probe)
    for cap in (None, int(np.bincount(np.asarray(idx)[np.asarray(idx) >= 0]).max())):
        assert int(ml.capacity_overflow(idx, num_local, cap or ml.default_capacity(num_rows, K, num_local))) == 0
        y, g = _ffn_and_grads("capacity", cap, x, idx, weights, w_in, w_out, probe)
        _assert_close(y, ragged_y, f"capacity {cap}: output", rel=1e-2)
        assert (np.asarray(y[num_valid:], np.float32) == 0).all()
        for name, a, b in zip(("x", "weights", "w_in", "w_out"), g, ragged_g):
            _assert_close(a, b, f"capacity {cap}: grad {name}", rel=1e-2)
        assert (np.asarray(g[0][num_valid:], np.float32) == 0).all()


def test_capacity_drops_pairs_past_capacity():
    """Past `capacity`, an expert's later pairs (in row, k order) contribute
    nothing, and capacity_overflow counts exactly them."""
    num_rows, num_valid, num_local, capacity = 32, 32, 4, 5
    x, idx, weights = _random_recv(20, num_rows, num_valid, num_local)
    kept_idx = idx.copy()
    seen = np.zeros(num_local, int)
    for p, e in enumerate(idx.reshape(-1)):
        if e >= 0:
            seen[e] += 1
            if seen[e] > capacity:
                kept_idx.reshape(-1)[p] = -1
    dropped = int((idx >= 0).sum() - (kept_idx >= 0).sum())
    assert dropped > 0
    assert int(ml.capacity_overflow(jnp.asarray(idx), num_local, capacity)) == dropped
    w_in, w_out = _weights(21, num_local)
    probe = dt.random_rows(22, (num_rows, H), jnp.float32)
    # The capacity path gets every pair with its weight; the reference only the kept ones.
    y, g = _ffn_and_grads("capacity", capacity, x, jnp.asarray(idx), jnp.asarray(weights), w_in, w_out, probe)
    want_y, want_g = _ffn_and_grads(
        "ragged_dot", None, x, jnp.asarray(kept_idx), jnp.asarray(weights), w_in, w_out, probe
    )
    _assert_close(y, want_y, "dropped: output", rel=1e-2)
    for name, a, b in zip(("x", "weights", "w_in", "w_out"), g, want_g):
        _assert_close(a, b, f"dropped: grad {name}", rel=1e-2)
    assert (np.asarray(g[1])[kept_idx < 0] == 0).all()  # a dropped pair's weight gets no gradient


def test_capacity_overflow_per_group():
    """On a (data, expert) mesh each expert-parallel group fills its experts'
    capacity on its own: its tokens (a contiguous part of topk_idx) are
    counted apart from the other groups'."""
    num_groups, num_experts, capacity = 2, 8, 3
    idx, _ = dt.make_routing(40, 64, num_experts, K, 4, "minus_one")
    want = 0
    for group in np.split(idx, num_groups):
        counts = np.bincount(group[group >= 0], minlength=num_experts)
        want += int(np.maximum(counts - capacity, 0).sum())
    assert int(ml.capacity_overflow(jnp.asarray(idx), num_experts, capacity, num_groups=num_groups)) == want
    assert int(ml.capacity_overflow(jnp.asarray(idx), num_experts, capacity)) > want  # one group of all tokens


@functools.cache
def _layer_buffer(hidden):
    """The Buffer of _layer_inputs' layers of this hidden size: one, so that their jitted steps are shared."""
    mesh = _mesh()
    return dej.Buffer(mesh, "expert", backend="xla", hidden=hidden, num_experts=2 * mesh.shape["expert"])


def _layer_inputs(layer_seed, x_seed, hidden=H):
    """(buffer, x, (router, w_in, w_out)): a top-2 MoE of 2 experts per rank on the CPU mesh, global x."""
    mesh = _mesh()
    num_experts = 2 * mesh.shape["expert"]
    buffer = _layer_buffer(hidden)
    layer = ml.MoE(hidden, F, num_experts, 2, buffer=buffer, rngs=nnx.Rngs(layer_seed))
    x = jax.device_put(dt.random_rows(x_seed, (4 * mesh.size, hidden), jnp.float32), NamedSharding(mesh, P(None, None)))
    return buffer, x, (layer.router[...], layer.w_in[...], layer.w_out[...])


def _layer_and_grads_fn(buffer, x, impl, use_fp8=False, dropless=False):
    """(router, w_in, w_out) -> moe_apply's output and the gradients of sum(sin(output)) for them;
    use_fp8: with the weights' FP8 copies made inside; dropless: moe_apply's."""

    def apply(router, w_in, w_out):
        fp8 = ml.fp8_expert_weights(w_in, w_out, mesh=buffer.mesh, axis_name=buffer.axis_name) if use_fp8 else None
        return ml.moe_apply(
            x, router, w_in, w_out, top_k=2, buffer=buffer, expert_impl=impl, fp8=fp8, dropless=dropless
        )[0]

    loss = lambda *p: jnp.sum(jnp.sin(apply(*p)))
    return lambda *p: (apply(*p), jax.grad(loss, argnums=(0, 1, 2))(*p))


@functools.cache
def _jitted_layer_and_grads(buffer, impl, use_fp8, dropless):
    """(x, router, w_in, w_out) -> _layer_and_grads_fn's results, jitted once per layer: x an argument, so
    that the tests of one buffer and expert path share its compile."""
    return jax.jit(lambda x, *params: _layer_and_grads_fn(buffer, x, impl, use_fp8, dropless)(*params))


def _layer_and_grads(buffer, x, params, impl, use_fp8=False, dropless=False):
    """_layer_and_grads_fn's results on params, under one jit."""
    return _jitted_layer_and_grads(buffer, impl, use_fp8, dropless)(x, *params)


@functools.cache
def _ragged_dot_layer():
    """The ragged_dot layer's output and gradients on _layer_inputs(1, 9): computed once, for both cases below."""
    return _layer_and_grads(*_layer_inputs(1, 9), "ragged_dot")


@pytest.mark.parametrize("impl", ["capacity", "grouped"])
def test_moe_module_matches_ragged_dot(impl):
    """The whole layer (dispatch, capacity or grouped experts, combine) against ragged_dot."""
    buffer, x, params = _layer_inputs(1, 9)
    (y_impl, g_impl), (y_rag, g_rag) = _layer_and_grads(buffer, x, params, impl), _ragged_dot_layer()
    _assert_close(y_impl, y_rag, f"{impl}: layer output", rel=1e-2)
    for name, a, b in zip(("router", "w_in", "w_out"), g_impl, g_rag):
        _assert_close(a, b, f"{impl}: layer grad {name}", rel=1e-2)


@pytest.mark.parametrize("dropless", [True, 4])
def test_moe_module_dropless_matches_ragged_dot(dropless):
    """The layer through dropless_moe (its default capacity: one round; 4 rows per rank: a token per
    block, many rounds) against the one-round layer: the same forward and router gradient; the experts'
    weights' gradients within bf16's rounding (made in bf16 per round, summed over rounds)."""
    buffer, x, params = _layer_inputs(1, 9)
    y, grads = _layer_and_grads(buffer, x, params, "ragged_dot", dropless=dropless)
    y_rag, g_rag = _ragged_dot_layer()
    _assert_close(y, y_rag, f"dropless={dropless}: layer output", rel=1e-5)
    for name, a, b, rel in zip(("router", "w_in", "w_out"), grads, g_rag, (1e-5, 1e-2, 1e-2)):
        _assert_close(a, b, f"dropless={dropless}: layer grad {name}", rel=rel)


@pytest.mark.parametrize("hidden", [H, 128])
def test_moe_apply_fp8_experts(hidden):
    """The layer with FP8 expert matmuls (fp8=fp8_expert_weights(...), grouped
    experts) close to the bf16 one, forward and gradients, on the global
    weights split over the expert axis (hidden 128: the rows sent as FP8),
    and each matmul given the FP8 operands it should get; other expert
    paths refuse fp8."""
    buffer, x, params = _layer_inputs(3, 10, hidden)
    (y8, g8), (y, g) = (_layer_and_grads(buffer, x, params, "grouped", use_fp8) for use_fp8 in (True, False))
    for name, a, b in (("output", y8, y), *zip(("grad router", "grad w_in", "grad w_out"), g8, g)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.isfinite(a).all(), name
        # FP8 operands (3 mantissa bits): a few percent off as a norm, never more than 10%.
        assert np.linalg.norm(a - b) <= 0.1 * np.linalg.norm(b), (
            f"fp8 {name}: {np.linalg.norm(a - b) / np.linalg.norm(b):.3g}"
        )
        assert not np.array_equal(a, b), f"fp8 {name}: identical to bf16, so FP8 did not run"
    # The wiring (the FP8 maths itself is checked against numpy in test_grouped_gemm.py): both matmuls take
    # the FP8 copies with FP8 weight gradients; the first takes FP8 rows where the hidden size allows them
    # (whole 128-wide blocks), the second always (the SwiGLU's output goes straight to FP8).
    calls = []

    def spy(fn):
        def recorded(rows, w, *args, fp8_weights=None, **kwargs):
            calls.append((isinstance(rows, Fp8Rows), fp8_weights is not None and fp8_weights.weight_grad))
            return fn(rows, w, *args, fp8_weights=fp8_weights, **kwargs)

        return recorded

    with pytest.MonkeyPatch.context() as patch:
        for name in ("grouped_matmul", "grouped_matmul_reduce"):
            patch.setattr(ml, name, spy(getattr(ml, name)))
        jax.eval_shape(_layer_and_grads_fn(buffer, x, "grouped", True), *params)
    assert calls == [(hidden % 128 == 0, True), (True, True)] * 2, calls  # the output's trace, then grad's
    with pytest.raises(ValueError, match="fp8 expert weights need expert_impl='grouped'"):
        # A trace-time check: traced (eval_shape), so that nothing compiles or runs op by op.
        fp8 = jax.eval_shape(ml.fp8_expert_weights, *params[1:])
        jax.eval_shape(
            lambda x, p, fp8: ml.moe_apply(x, *p, top_k=2, buffer=buffer, expert_impl="capacity", fp8=fp8),
            x,
            params,
            fp8,
        )


def test_fp8_expert_weights_per_rank():
    """With mesh and axis_name, each rank makes the copies of its own experts: the same values as the
    copies of the whole weights, split over the axis."""
    buffer, _, (_, w_in, w_out) = _layer_inputs(4, 11)
    mesh, axis = buffer.mesh, buffer.axis_name
    per_rank = jax.jit(lambda a, b: ml.fp8_expert_weights(a, b, mesh=mesh, axis_name=axis))(w_in, w_out)
    whole = jax.jit(ml.fp8_expert_weights)(w_in, w_out)
    for got, want in zip(jax.tree.leaves(per_rank), jax.tree.leaves(whole)):
        assert got.sharding.spec[0] == axis
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    with pytest.raises(ValueError, match="give both mesh and axis_name"):
        ml.fp8_expert_weights(w_in, w_out, mesh=mesh)


@pytest.mark.extension
def test_fp8_expert_weights_lower_per_rank(monkeypatch):
    """Lowered for CUDA, the quantization kernels (the extension's: an amax and a store call per weight)
    take one rank's experts with mesh and axis_name (without them, every device would quantize all the
    experts)."""
    buffer, _, (_, w_in, _) = _layer_inputs(4, 11)
    mesh, axis = buffer.mesh, buffer.axis_name
    monkeypatch.setattr(fp8_quant, "fp8_gpu", lambda device=None: True)  # the kernels' path, lowered
    monkeypatch.setattr(fp8_quant._native, "unavailable_reason", lambda: None)
    split = NamedSharding(mesh, P(axis))
    shapes = [jax.ShapeDtypeStruct((w_in.shape[0], rows, 256), jnp.bfloat16, sharding=split) for rows in (256, 128)]
    for kwargs, experts in ((dict(mesh=mesh, axis_name=axis), w_in.shape[0] // mesh.shape[axis]), ({}, w_in.shape[0])):
        text = (
            jax.jit(lambda a, b, kw=kwargs: ml.fp8_expert_weights(a, b, **kw))
            .trace(*shapes)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        calls = [line for line in text.splitlines() if "stablehlo.custom_call @deep_ep_jax_fp8_" in line]
        batches = {int(b) for line in calls for b in re.findall(r"\(tensor<(\d+)x\d+x\d+xbf16>", line)}
        assert len(calls) == 4 and batches == {experts}, (kwargs.keys(), calls)


def _grouped_and_grads(rows, alignment, x, idx, weights, w_in, w_out, probe):
    return _expert_ffn_and_grads("grouped", None, rows, alignment)(x, idx, weights, w_in, w_out, probe)


@pytest.mark.parametrize("skewed", [False, True])
def test_grouped_matches_ragged_dot_and_capacity(skewed):
    """The grouped path on one rank's received rows (NaN padding rows, -1
    slots; skewed: every pair on one expert) equals the ragged_dot and
    capacity paths, forward and gradients, at the worst-case rows, at exactly
    the pairs, and with aligned groups."""
    num_rows, num_valid, num_local = 40, 29, 4
    x, idx, weights = _random_recv(30, num_rows, num_valid, num_local)
    if skewed:
        idx = np.where(idx >= 0, 1, -1).astype(np.int32)
        idx[:, 1:] = -1
        weights = np.where(idx >= 0, weights, 0.0).astype(np.float32)
    num_pairs = int((idx >= 0).sum())
    idx, weights = jnp.asarray(idx), jnp.asarray(weights)
    w_in, w_out = _weights(31, num_local)
    probe = dt.random_rows(32, (num_rows, H), jnp.float32)
    references = {
        impl: _ffn_and_grads(impl, num_rows * K, x, idx, weights, w_in, w_out, probe)
        for impl in ("ragged_dot", "capacity")
    }
    for rows, alignment in ((None, 1), (num_pairs, 1), (None, 8), (None, 128)):  # 128: aligned_groups
        worst = default_num_rows(num_rows, K, num_local, alignment)
        assert int(ml.expert_rows_overflow(idx, num_local, 1, rows or worst, alignment)) == 0
        y, g = _grouped_and_grads(rows, alignment, x, idx, weights, w_in, w_out, probe)
        for impl, (want_y, want_g) in references.items():
            what = f"grouped rows={rows} alignment={alignment} vs {impl}"
            _assert_close(y, want_y, f"{what}: output", rel=1e-2)
            for name, a, b in zip(("x", "weights", "w_in", "w_out"), g, want_g):
                _assert_close(a, b, f"{what}: grad {name}", rel=1e-2)
        assert (np.asarray(y[num_valid:], np.float32) == 0).all()
        assert (np.asarray(g[0][num_valid:], np.float32) == 0).all()


def test_padded_group_sizes_are_whole_multiples():
    """ExpertLayout.padded_group_sizes: with alignment > 1 every group size
    handed to grouped_matmul is a multiple of it, the last one too (what its
    aligned kernels need), each group starts where the layout put it, and the
    groups end within the rows; alignment 1 gives the pairs per expert."""
    num_rows, num_local = 40, 4
    x, idx, _ = _random_recv(40, num_rows, 33, num_local)
    for alignment in (1, 8, 128):
        rows = default_num_rows(num_rows, K, num_local, alignment)

        @jax.jit  # one compile, not one per op
        def layout_and_sizes(x, idx, alignment=alignment, rows=rows):
            kwargs = dict(num_local_experts=num_local, alignment=alignment, num_rows=rows, backend="xla")
            layout = ml.expand(x, idx, **kwargs)[1]
            return layout, layout.padded_group_sizes(alignment)

        layout, sizes = layout_and_sizes(jnp.asarray(x, jnp.bfloat16), jnp.asarray(idx))
        sizes = np.asarray(sizes)
        assert (sizes % alignment == 0).all() and sizes.sum() <= rows, (alignment, sizes, rows)
        np.testing.assert_array_equal(np.cumsum(sizes) - sizes, np.asarray(layout.group_offsets))
        assert (sizes >= np.asarray(layout.group_sizes)).all(), (alignment, sizes)
        if alignment == 1:
            np.testing.assert_array_equal(sizes, np.bincount(idx[idx >= 0], minlength=num_local))
    assert ml.default_expert_alignment() == 1  # no Hopper GPU here: nothing to align for


def _kept_routing(idx, num_experts, num_ranks, num_groups, expert_rows, alignment):
    """idx with the pairs the grouped path drops set to -1: per expert-parallel
    group and rank, each local expert's pairs in token order take rows from
    its group's start (after the earlier groups, rounded up to alignment)."""
    kept = idx.copy()
    num_local = num_experts // num_ranks
    for block in np.split(kept, num_groups):  # views into kept
        for rank in range(num_ranks):
            start = 0
            for e in range(rank * num_local, (rank + 1) * num_local):
                pairs = np.argwhere(block == e)  # (token, k) in token order
                for t, k in pairs[max(expert_rows - start, 0) :]:
                    block[t, k] = -1
                start += -(-len(pairs) // alignment) * alignment
    return kept


@pytest.mark.parametrize("alignment", [1, 4])
def test_grouped_drops_pairs_past_expert_rows(alignment):
    """With expert_rows too small, each rank's last pairs are dropped (they
    contribute nothing, forward and backward); expert_rows_overflow counts
    them, as the layouts' num_dropped summed over all ranks does."""
    mesh = _mesh()
    num_ranks, num_groups = mesh.shape["expert"], mesh.shape["data"]
    num_experts, num_tokens, expert_rows = 2 * num_ranks, 12 * mesh.size, 20
    buffer, fwd_and_grads = _moe_ffn_and_grads("grouped", alignment, expert_rows)
    idx, weights = dt.make_routing(33, num_tokens, num_experts, K, num_ranks, "minus_one")
    kept = _kept_routing(idx, num_experts, num_ranks, num_groups, expert_rows, alignment)
    dropped = int((idx >= 0).sum() - (kept >= 0).sum())
    assert dropped > 0
    overflow = ml.expert_rows_overflow(idx, num_experts, num_ranks, expert_rows, alignment, num_groups=num_groups)
    assert int(overflow) == dropped

    tokens = P(("data", "expert"))

    def num_dropped(x, idx, w):
        layout = dej.dispatch_expert_major(
            x.astype(jnp.bfloat16),
            idx,
            w,
            num_experts=num_experts,
            buffer=buffer,
            alignment=alignment,
            num_rows=expert_rows,
        )[1]
        return jax.lax.psum(layout.num_dropped, ("data", "expert"))

    x = dt.random_rows(34, (num_tokens, H), jnp.float32)
    idx, weights, kept = jnp.asarray(idx), jnp.asarray(weights), jnp.asarray(kept)
    layouts = jax.jit(jax.shard_map(num_dropped, mesh=mesh, in_specs=(tokens,) * 3, out_specs=P()))
    assert int(layouts(x, idx, weights)) == dropped

    w_in, w_out = _weights(35, num_experts)
    probe = dt.random_rows(36, (num_tokens, H), jnp.float32)

    got, grads = fwd_and_grads(x, idx, weights, w_in, w_out, probe)  # moe_ffn, grouped, expert_rows 20
    want_y, want = _dense_and_grads(x, kept, weights, w_in, w_out, probe)
    _assert_close(got, want_y, "dropped: output")
    for name, g, w in zip(("x", "topk_weights", "w_in", "w_out"), grads, want):
        _assert_close(g, w, f"dropped: grad {name}")


BAD_MODEL_OPTIONS = [
    ("moe_flax.py", ["--top-k", "9"], "--top-k 9 must be in [1, --experts 8]"),
    ("moe_flax.py", ["--heads", "3"], "--hidden 128 must divide by --heads 3"),
    ("moe_flax.py", ["--batch", "12"], "--batch 12 must divide by the 8 devices"),
    ("moe_decode.py", ["--train-batch", "12"], "--train-batch 12 must divide by the 8 devices"),
    ("moe_flax.py", ["--seq-len", "0"], "--seq-len 0 must be at least 1"),
    ("moe_flax.py", ["--dropless", "0"], "--dropless 0 must be at least 1 (rows per rank per round)"),
    ("moe_flax.py", ["--branching", "129"], "--branching 129 must be at most --vocab 128 (distinct successors)"),
    ("moe_decode.py", ["--experts", "6"], "--experts 6 must divide by the expert axis (4)"),
    ("moe_decode.py", ["--batch", "3"], "--batch 3 must be a positive even number (two micro-batches)"),
    (
        "moe_decode.py",
        ["--prompt-len", "0"],
        "--prompt-len 0 + --decode-steps 32 must be at most --seq-len 64 "
        "(the model's positions), with a prompt of at least 1",
    ),
    ("moe_decode.py", ["--decode-steps", "0"], "--repeats 5 and --decode-steps 0 must be at least 1"),
]


@pytest.fixture(scope="module")
def bad_model_option_runs():
    """The runs of BAD_MODEL_OPTIONS, in one process (run_scripts): each refused before any work, so
    Python's start and the imports are most of a run. 8 devices on any host: the messages' device counts."""
    return run_scripts([(f"examples/{script}", argv) for script, argv, _ in BAD_MODEL_OPTIONS])


@pytest.mark.parametrize("script,argv,message", BAD_MODEL_OPTIONS)
def test_examples_reject_bad_model_options(script, argv, message, bad_model_option_runs):
    """The examples exit with one line naming the option, before building anything."""
    run = bad_model_option_runs[BAD_MODEL_OPTIONS.index((script, argv, message))]
    assert run.returncode == 1 and run.stderr.strip().splitlines()[-1] == message, run.stderr[-2000:]


def test_expert_args_rejected_at_trace_time():
    mesh = _mesh()
    num_experts = 2 * mesh.shape["expert"]
    buffer = dej.Buffer(mesh, "expert", backend="xla", hidden=H, num_experts=num_experts)
    with pytest.raises(ValueError, match="expert_impl must be one of"):
        ml.MoE(H, F, num_experts, 2, buffer=buffer, rngs=nnx.Rngs(0), expert_impl="dense")
    with pytest.raises(ValueError, match=rf"MoE: top_k {num_experts + 1} must be in \[1, num_experts={num_experts}\]"):
        ml.MoE(H, F, num_experts, num_experts + 1, buffer=buffer, rngs=nnx.Rngs(0))
    layer = ml.MoE(H, F, num_experts, 2, buffer=buffer, rngs=nnx.Rngs(0))
    x = dt.random_rows(37, (4 * mesh.size, H), jnp.float32)
    params = (layer.router[...], layer.w_in[...], layer.w_out[...])
    for rows in (0, 2.5):
        with pytest.raises(ValueError, match="expert_rows must be a positive int"):
            jax.jit(
                lambda x, *p, rows=rows: ml.moe_apply(
                    x, *p, top_k=2, buffer=buffer, expert_impl="grouped", expert_rows=rows
                )
            )(x, *params)
    with pytest.raises(ValueError, match="expert_alignment must be a positive int"):
        ml.expert_ffn(
            x,
            jnp.zeros((x.shape[0], 2), jnp.int32),
            jnp.ones((x.shape[0], 2)),
            *params[1:],
            impl="grouped",
            expert_alignment=0,
        )
    with pytest.raises(ValueError, match="expert_rows 30 must be a multiple of the expert alignment 8"):
        ml.expert_ffn(
            x,
            jnp.zeros((x.shape[0], 2), jnp.int32),
            jnp.ones((x.shape[0], 2)),
            *params[1:],
            impl="grouped",
            expert_rows=30,
            expert_alignment=8,
        )
