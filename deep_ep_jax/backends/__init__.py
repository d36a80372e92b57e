"""Backends: the same per-rank operations, in pure JAX or as CUDA custom calls.

A Buffer picks its backend once, when it is made, and holds the operations it
runs as `buffer.ops` (an `Ops`): those of `deep_ep_jax.backends.reference`,
or of the CUDA modules `deep_ep_jax.backends.cuda.layout`, `.intranode` (an
EP group on one host) or `.internode` (across hosts), and `.low_latency`.

Every operation runs per rank, inside `jax.shard_map` over
`buffer.axis_name`. The public API (`deep_ep_jax.comm.normal`,
`deep_ep_jax.comm.low_latency`) validates arguments, sanitises `topk_idx` (ids out
of [0, E) become -1) and owns gradients; a backend only moves data. Rows are
passed as tuples: `(x,)` for bf16 [T, H], or `(x_fp8 [T, H], scales f32
[T, H // 128])` for an FP8 pair; received rows come back in the same form.

The operations (a backend module defines each under its name):

  get_dispatch_layout(topk_idx, *, num_experts, buffer)
      -> (num_tokens_per_rank i32 [R], num_tokens_per_expert i32 [E],
          is_token_in_rank bool [T, R])
  dispatch(xs, topk_idx, topk_weights, *, num_experts, num_worst_tokens, buffer)
      -> (recv_xs, recv_topk_idx i32 [N, K], recv_topk_weights f32 [N, K],
          handle: DispatchHandle)
      # the reference also takes rows_per_pair=P (dropless_moe's rounds on it):
      # at most P rows per (source, destination), its exchanges [R, P] blocks
  cached_dispatch(xs, topk_weights | None, handle, *, buffer)
      -> (recv_xs, recv_topk_weights | None)   # handle's layout, no count exchange
  combine(x bf16 [N, H], topk_weights f32 [N, K] | None, handle, *, buffer)
      -> (out bf16 [T, H], out_weights f32 [T, K] | None)
  low_latency_dispatch_send(x bf16 [T, H], topk_idx, *, num_experts,
                            num_max_dispatch_tokens_per_rank, use_fp8,
                            round_scale, buffer, mxfp8=False) -> pending (a pytree)
  low_latency_dispatch_recv(pending, *, buffer)
      -> (recv_xs ([E/R, R*M, H] bf16, or FP8 pair with scales float32
          [E/R, R*M, H // 128], or with mxfp8 float8_e8m0fnu [E/R, R*M, H // 32]),
          recv_count i32 [E/R], handle: LowLatencyHandle)
  low_latency_combine_send(x bf16 [E/R, R*M, H], topk_idx, topk_weights,
                           handle, *, buffer) -> pending
  low_latency_combine_recv(pending, *, buffer) -> out bf16 [T, H]
  low_latency_dispatch(...), low_latency_combine(...)
      -> send then recv, whole (the CUDA backend runs them as one kernel)
  low_latency_mask(set_to i32 [R] | None, *, buffer) -> mask i32 [R]
      # the ranks this rank neither sends to nor waits for (set_to: replaced first)

The semantics (row order, padding, summation order) are those of
`deep_ep_jax.backends.reference`, the oracle: a CUDA result must equal it bit
for bit (FP8 quantisation included).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Ops:
    """The per-rank operations of one Buffer, bound when it is made."""

    get_dispatch_layout: Callable
    dispatch: Callable
    cached_dispatch: Callable
    combine: Callable
    low_latency_dispatch_send: Callable
    low_latency_dispatch_recv: Callable
    low_latency_dispatch: Callable
    low_latency_combine_send: Callable
    low_latency_combine_recv: Callable
    low_latency_combine: Callable
    low_latency_mask: Callable

    @classmethod
    def of(cls, *modules) -> Ops:
        """Each operation from the one module of `modules` that defines it."""
        ops = {}
        for field in dataclasses.fields(cls):
            found = [m for m in modules if hasattr(m, field.name)]
            if len(found) != 1:
                names = [m.__name__ for m in found]
                raise TypeError(f"Ops.of: {field.name} must be defined by exactly one module, found {names}")
            ops[field.name] = getattr(found[0], field.name)
        return cls(**ops)
