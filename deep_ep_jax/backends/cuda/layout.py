"""get_dispatch_layout as a CUDA custom call (csrc/ffi/layout.cc)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deep_ep_jax.backends.cuda.common import FfiTarget, limit

GET_DISPATCH_LAYOUT = FfiTarget(
    "deep_ep_jax_get_dispatch_layout",
    ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"),
    vmap_method="sequential",
    ordered=False,  # local: no peers
)
TARGETS = (GET_DISPATCH_LAYOUT,)


def get_dispatch_layout(topk_idx, *, num_experts, buffer):
    """(num_tokens_per_rank i32 [R], num_tokens_per_expert i32 [E],
    is_token_in_rank bool [T, R]); ids outside [0, E) count as -1."""
    num_tokens = topk_idx.shape[0]
    num_ranks = buffer.num_ranks
    max_bins = limit("max_layout_bins")
    if num_experts + num_ranks > max_bins:
        raise ValueError(
            f"get_dispatch_layout: num_experts + ranks must be <= {max_bins} for the CUDA kernel, got "
            f"{num_experts} + {num_ranks}"
        )
    out_types = dict(
        num_tokens_per_rank=jax.ShapeDtypeStruct((num_ranks,), jnp.int32),
        num_tokens_per_expert=jax.ShapeDtypeStruct((num_experts,), jnp.int32),
        is_token_in_rank=jax.ShapeDtypeStruct((num_tokens, num_ranks), jnp.bool_),
    )
    out = GET_DISPATCH_LAYOUT(
        buffer,
        out_types,
        jnp.asarray(topk_idx, jnp.int32),
        num_experts=np.int64(num_experts),
        num_ranks=np.int64(num_ranks),
    )
    return out["num_tokens_per_rank"], out["num_tokens_per_expert"], out["is_token_in_rank"]
