"""The READMEs' MoE snippets run as printed (8 CPU devices, the xla backend)
and give the MoE layer's experts: against float32 maths token by token, on
fresh random routing. README.md's expert-major path and examples/README.md's
per-rank layer (dispatch, ragged_dot experts, combine)."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from deep_ep_jax import Buffer
from deep_ep_jax import testing as dt

ROOT = Path(__file__).resolve().parents[1]
R, T, H, F, E, K = 8, 16, 64, 32, 256, 8


def snippet(name, readme="README.md"):
    """The README's python block that defines `name`."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / readme).read_text(), re.S)
    [block] = [b for b in blocks if f"def {name}(" in b]
    return block


def reference(x, idx, weights, w_in, w_out):
    """float32: sum over k of weight * SwiGLU of expert idx[t, k] (inputs rounded as the layer rounds them)."""
    x, w_in, w_out = (np.asarray(a, np.float32) for a in (x, w_in, w_out))
    out = np.zeros((x.shape[0], H), np.float32)
    for t in range(x.shape[0]):
        for k in range(K):
            e = idx[t, k]
            gate, up = np.split(x[t] @ w_in[e], 2)
            hidden = np.asarray(gate / (1 + np.exp(-gate)) * up, jnp.bfloat16).astype(np.float32)
            out[t] += weights[t, k] * (hidden @ w_out[e])
    return out


def inputs():
    """Fresh random routing (K distinct experts per token), tokens and weights."""
    rng = np.random.default_rng()
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(R * T)]).astype(np.int32)
    weights = rng.random((R * T, K)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
    w_in = jnp.asarray(rng.standard_normal((E, H, 2 * F)) / np.sqrt(H), jnp.bfloat16)
    w_out = jnp.asarray(rng.standard_normal((E, F, H)) / np.sqrt(F), jnp.bfloat16)
    return x, idx, weights, w_in, w_out


def check(out, x, idx, weights, w_in, w_out):
    out = np.asarray(out, np.float32)
    want = reference(x, idx, weights, w_in, w_out)
    assert out.shape == (R * T, H)
    np.testing.assert_allclose(out, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_expert_major_snippet_runs_and_matches_float32():
    mesh = dt.ep_mesh(R, platform="cpu")
    x, idx, weights, w_in, w_out = inputs()
    with Buffer(mesh, "ep", backend="xla", hidden=H, num_experts=E) as buffer:
        scope = {"jax": jax, "jnp": jnp, "P": P, "mesh": mesh, "buffer": buffer}
        exec(snippet("moe_experts"), scope)  # noqa: S102 (the README's own code)
        out = scope["moe_experts"](x, jnp.asarray(idx), jnp.asarray(weights), w_in, w_out)
        check(out, x, idx, weights, w_in, w_out)


def test_examples_layer_snippet_runs_and_matches_float32():
    mesh = dt.ep_mesh(R, platform="cpu")
    x, idx, weights, w_in, w_out = inputs()
    scope = {}
    exec(snippet("moe_ffn", "examples/README.md"), scope)  # noqa: S102 (the README's own code)
    with Buffer(mesh, "ep", backend="xla", hidden=H, num_experts=E) as buffer:
        layer = jax.jit(jax.shard_map(
            lambda *a: scope["moe_ffn"](*a, buffer=buffer, num_experts=E), mesh=mesh,
            in_specs=(P("ep"),) * 5, out_specs=P("ep")))
        out = layer(x, jnp.asarray(idx), jnp.asarray(weights), w_in, w_out)
        check(out, x, idx, weights, w_in, w_out)
