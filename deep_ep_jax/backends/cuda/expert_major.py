"""Expert-major rows as CUDA custom calls (csrc/ffi/expert_major.cc).

Local targets (no peers, no Buffer memory, not in a Buffer's order chain),
bit-identical to deep_ep_jax/backends/reference_expert_major.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deep_ep_jax.backends.cuda.common import FfiTarget, limit
from deep_ep_jax.comm.handle import ExpertLayout

EXPERT_LAYOUT = FfiTarget(
    "deep_ep_jax_expert_layout",
    ("group_sizes", "group_offsets", "pair_row", "row_pair", "num_dropped", "pair_counts"),
    vmap_method="sequential",
    ordered=False,
)
EXPAND_ROWS = FfiTarget(
    "deep_ep_jax_expand_rows", ("expert_x", "expert_x_scales"), vmap_method="sequential", ordered=False
)
EXPAND_ROWS_TRANSPOSED = FfiTarget(
    "deep_ep_jax_expand_rows_transposed", ("expert_x_t",), vmap_method="sequential", ordered=False
)
REDUCE_ROWS = FfiTarget("deep_ep_jax_reduce_rows", ("out",), vmap_method="sequential", ordered=False)
TARGETS = (EXPERT_LAYOUT, EXPAND_ROWS, EXPAND_ROWS_TRANSPOSED, REDUCE_ROWS)


def check_shapes(fn, *, num_local_experts, hidden, rows_dtype):
    """What the kernels need beyond the public contract, at trace time."""
    max_local = limit("max_local_experts")
    if num_local_experts > max_local:
        raise ValueError(
            f"{fn}: num_local_experts must be <= {max_local} for the CUDA kernels, got {num_local_experts}"
        )
    if jnp.dtype(rows_dtype) == jnp.bfloat16 and hidden % 8:
        raise ValueError(f"{fn}: bf16 hidden must be a multiple of 8 (16-byte rows) for the CUDA kernels, got {hidden}")


def expert_layout(topk_idx, *, num_local_experts, alignment, num_rows):
    num_tokens, num_topk = topk_idx.shape
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    out_types = {
        "group_sizes": i32(num_local_experts),
        "group_offsets": i32(num_local_experts),
        "pair_row": i32(num_tokens, num_topk),
        "row_pair": i32(num_rows),
        "num_dropped": i32(),
        "pair_counts": i32(num_local_experts),
    }
    out = EXPERT_LAYOUT(None, out_types, jnp.asarray(topk_idx, jnp.int32), alignment=np.int64(alignment))
    return ExpertLayout(**{name: out[name] for name in out_types if name != "pair_counts"}, alignment=int(alignment))


def expand_rows(xs, layout):
    num_rows, num_topk = layout.num_rows, layout.pair_row.shape[1]
    x = xs[0]
    scales = xs[1] if len(xs) == 2 else jnp.zeros((x.shape[0], 0), jnp.float32)
    out_types = {
        "expert_x": jax.ShapeDtypeStruct((num_rows, x.shape[1]), x.dtype),
        "expert_x_scales": jax.ShapeDtypeStruct((num_rows, scales.shape[1]), jnp.float32),
    }
    out = EXPAND_ROWS(None, out_types, x, scales, layout.row_pair, num_topk=np.int64(num_topk))
    return (out["expert_x"],) if len(xs) == 1 else (out["expert_x"], out["expert_x_scales"])


def expand_rows_transposed(x, layout, row_multipliers=None, col_inverse_scales=None):
    if row_multipliers is None:  # float8 x: its bytes
        row_multipliers = col_inverse_scales = jnp.zeros((0,), jnp.float32)
    out_types = {"expert_x_t": jax.ShapeDtypeStruct((x.shape[1], layout.num_rows), jnp.float8_e4m3fn)}
    return EXPAND_ROWS_TRANSPOSED(
        None,
        out_types,
        x,
        layout.row_pair,
        row_multipliers,
        col_inverse_scales,
        num_topk=np.int64(layout.pair_row.shape[1]),
    )["expert_x_t"]


def reduce_rows(expert_y, weights, layout):
    num_tokens = layout.pair_row.shape[0]
    if weights is None:  # [N, 0]: the plain sum (expand's backward)
        weights = jnp.zeros((num_tokens, 0), jnp.float32)
    out_types = {"out": jax.ShapeDtypeStruct((num_tokens, expert_y.shape[1]), expert_y.dtype)}
    return REDUCE_ROWS(None, out_types, expert_y, weights, layout.pair_row)["out"]
