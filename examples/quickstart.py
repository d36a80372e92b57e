"""Quick start: dispatch tokens to their experts' ranks and combine them back.

Runs on whatever devices are present: on GPUs with the CUDA kernels (when the
extension is built), otherwise on 8 virtual CPU devices with the pure-JAX
reference backend.

    python examples/quickstart.py
"""

import os
import sys

if "--cpu" in sys.argv or not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from deep_ep_jax import Buffer, combine, dispatch

TOKENS, HIDDEN, EXPERTS, TOPK = 64, 512, 16, 4


def main():
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("ep",))
    num_ranks = len(devices)
    buffer = Buffer(mesh, "ep", hidden=HIDDEN, num_experts=EXPERTS)
    print(f"{num_ranks} x {devices[0].platform} devices, backend={buffer.backend}")

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((num_ranks * TOKENS, HIDDEN)), jnp.bfloat16)
    topk_idx = jnp.asarray(np.argsort(rng.random((num_ranks * TOKENS, EXPERTS)), axis=1)[:, :TOPK], jnp.int32)
    topk_weights = jnp.asarray(rng.random((num_ranks * TOKENS, TOPK)), jnp.float32)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    def roundtrip(x, topk_idx, topk_weights):
        # Each rank receives the tokens routed to its experts...
        recv_x, recv_topk_idx, recv_topk_weights, handle = dispatch(
            x, topk_idx, topk_weights, num_experts=EXPERTS, buffer=buffer
        )
        # ...runs its experts (here: scale each row by how many of its experts
        # the token chose on this rank)...
        scale = (recv_topk_idx >= 0).sum(axis=1, keepdims=True).astype(jnp.float32)
        expert_out = (recv_x.astype(jnp.float32) * scale).astype(jnp.bfloat16)
        # ...and combine sums the results back at the tokens' ranks.
        out = combine(expert_out, handle, buffer=buffer)
        return out, handle.num_recv_tokens[None]

    out, num_recv = roundtrip(x, topk_idx, topk_weights)

    # Check against the same maths on one device.
    ranks_of = np.asarray(topk_idx) // (EXPERTS // num_ranks)
    want = np.zeros((num_ranks * TOKENS, HIDDEN), np.float32)
    xf = np.asarray(x, np.float32)
    for t in range(num_ranks * TOKENS):
        for r in range(num_ranks):  # combine sums rank by rank
            mask = ranks_of[t] == r
            if mask.any():
                row = (xf[t] * np.float32(mask.sum())).astype(jnp.bfloat16).astype(np.float32)
                want[t] = want[t] + row
    err = np.abs(np.asarray(out, np.float32) - np.asarray(jnp.asarray(want).astype(jnp.bfloat16), np.float32)).max()
    print(f"rows received per rank: {np.asarray(num_recv).tolist()}")
    print(f"combine(expert(dispatch(x))) vs one-device maths: max abs error {err}")
    assert err == 0, "mismatch"
    print("OK")


if __name__ == "__main__":
    main()
