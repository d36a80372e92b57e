"""The docs' MoE snippets run as printed (8 CPU devices, the xla backend)
and give the MoE layer's experts: against float32 maths token by token, on
fresh random routing. docs/usage.md's expert-major path, examples/README.md's
per-rank layer (dispatch, ragged_dot experts, combine) and its global-array
snippet around it (moe_layer's route and MoE); docs/usage.md's dropless_moe."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from deep_ep_jax import Buffer, dequantize, quantize
from deep_ep_jax import testing as dt

ROOT = Path(__file__).resolve().parents[1]
R, T, H, F, E, K = 8, 16, 64, 32, 256, 8


def snippet(name, readme="README.md", text=None):
    """The python block of the markdown file `readme` that defines `name` (or holds `text`)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / readme).read_text(), re.S)
    [block] = [b for b in blocks if (text or f"def {name}(") in b]
    return block


def reference(x, idx, weights, w_in, w_out):
    """float32: sum over k of weight * SwiGLU of expert idx[t, k] (inputs rounded as the layer rounds them)."""
    x, w_in, w_out = (np.asarray(a, np.float32) for a in (x, w_in, w_out))
    out = np.zeros(x.shape, np.float32)
    for t in range(x.shape[0]):
        for k in range(K):
            e = idx[t, k]
            gate, up = np.split(x[t] @ w_in[e], 2)
            hidden = np.asarray(gate / (1 + np.exp(-gate)) * up, jnp.bfloat16).astype(np.float32)
            out[t] += weights[t, k] * (hidden @ w_out[e])
    return out


def inputs(hidden=H):
    """Fresh random routing (K distinct experts per token), tokens and weights."""
    rng = np.random.default_rng()
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(R * T)]).astype(np.int32)
    weights = rng.random((R * T, K)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((R * T, hidden)), jnp.bfloat16)
    w_in = jnp.asarray(rng.standard_normal((E, hidden, 2 * F)) / np.sqrt(hidden), jnp.bfloat16)
    w_out = jnp.asarray(rng.standard_normal((E, F, hidden)) / np.sqrt(F), jnp.bfloat16)
    return x, idx, weights, w_in, w_out


def check(out, x, idx, weights, w_in, w_out):
    out = np.asarray(out, np.float32)
    want = reference(x, idx, weights, w_in, w_out)
    assert out.shape == x.shape
    np.testing.assert_allclose(out, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_expert_major_snippet_runs_and_matches_float32():
    mesh = dt.ep_mesh(R, platform="cpu")
    x, idx, weights, w_in, w_out = inputs()
    with Buffer(mesh, "ep", backend="xla", hidden=H, num_experts=E) as buffer:
        scope = {"jax": jax, "jnp": jnp, "P": P, "mesh": mesh, "buffer": buffer}
        exec(snippet("moe_experts", "docs/usage.md"), scope)  # noqa: S102 (the docs' own code)
        out = scope["moe_experts"](x, jnp.asarray(idx), jnp.asarray(weights), w_in, w_out)
        check(out, x, idx, weights, w_in, w_out)


def test_dropless_snippet_runs_and_matches_float32():
    """docs/usage.md's dropless_moe snippet per rank: bf16 rows, and rows sent as MXFP8 (against float32
    maths on the rows MXFP8 holds)."""
    mesh = dt.ep_mesh(R, platform="cpu")
    x, idx, weights, w_in, w_out = inputs(hidden=128)  # a pair's hidden is a multiple of 128
    bf16_part, mxfp8_part = snippet(None, "docs/usage.md", text="dropless_moe(").split("# x sent as MXFP8")
    with Buffer(mesh, "ep", backend="xla") as buffer:

        def layer(x, topk_idx, topk_weights, w_in, w_out):
            scope = dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, w_in=w_in, w_out=w_out, buffer=buffer)
            exec(bf16_part, scope)  # noqa: S102 (the docs' own code)
            y = scope["y"]
            exec("#" + mxfp8_part, scope)  # noqa: S102
            return y, scope["y"]

        program = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep")))
        out, out_mxfp8 = program(x, jnp.asarray(idx), jnp.asarray(weights), w_in, w_out)
    check(out, x, idx, weights, w_in, w_out)
    held = dequantize(quantize(x, "MXFP8"))
    check(out_mxfp8, held, idx, weights, w_in, w_out)


def test_examples_layer_snippet_runs_and_matches_float32():
    mesh = dt.ep_mesh(R, platform="cpu")
    x, idx, weights, w_in, w_out = inputs()
    scope = {}
    exec(snippet("moe_ffn", "examples/README.md"), scope)  # noqa: S102 (the README's own code)
    with Buffer(mesh, "ep", backend="xla", hidden=H, num_experts=E) as buffer:
        layer = jax.jit(
            jax.shard_map(
                lambda *a: scope["moe_ffn"](*a, buffer=buffer, num_experts=E),
                mesh=mesh,
                in_specs=(P("ep"),) * 5,
                out_specs=P("ep"),
            )
        )
        out = layer(x, jnp.asarray(idx), jnp.asarray(weights), w_in, w_out)
        check(out, x, idx, weights, w_in, w_out)


def test_examples_global_snippet_runs_and_matches_float32(monkeypatch):
    """examples/README.md's snippet around moe_ffn (a (data, expert) mesh, route, jax.shard_map, then the MoE
    module): its shard_map's output against float32 maths on route's choice, the module's output shape."""
    from flax import nnx

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    cpus = jax.devices("cpu")
    monkeypatch.setattr(jax, "devices", lambda backend=None: cpus)  # the snippet's mesh on 8 CPU devices anywhere
    x, _, _, w_in, w_out = inputs()
    router_kernel = jnp.asarray(np.random.default_rng().standard_normal((H, E)), jnp.float32)
    scope = {}
    exec(snippet("moe_ffn", "examples/README.md"), scope)  # noqa: S102 (the README's own code)
    scope.update(
        jax=jax,
        np=np,
        nnx=nnx,
        data=2,
        ep=R // 2,
        H=H,
        F=F,
        E=E,
        top_k=K,
        x=x,
        router_kernel=router_kernel,
        w_in=w_in,
        w_out=w_out,
    )
    functional, module = snippet(None, "examples/README.md", text="from moe_layer import").split("layer = MoE")
    exec(functional, scope)  # noqa: S102
    try:
        assert scope["buffer"].backend == "xla"
        check(scope["y"], x, np.asarray(scope["topk_idx"]), np.asarray(scope["topk_weights"]), w_in, w_out)
        exec("layer = MoE" + module, scope)  # noqa: S102
        assert scope["y"].shape == x.shape and np.isfinite(np.asarray(scope["y"], np.float32)).all()
        assert np.isfinite(float(scope["aux_loss"]))
    finally:
        scope["buffer"].destroy()
