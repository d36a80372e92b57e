"""Backends: the same per-rank operations, in pure JAX or as CUDA custom calls.

Every function here runs per rank, inside `jax.shard_map` over
`buffer.axis_name`. The public API (`deep_ep_jax.normal`,
`deep_ep_jax.low_latency`) validates arguments, sanitises `topk_idx` (ids out
of [0, E) become -1) and owns gradients; a backend only moves data. Rows are
passed as tuples: `(x,)` for bf16 [T, H], or `(x_fp8 [T, H], scales f32
[T, H // 128])` for an FP8 pair; received rows come back in the same form.

A backend module provides:

  get_dispatch_layout(topk_idx, *, num_experts, buffer)
      -> (num_tokens_per_rank i32 [R], num_tokens_per_expert i32 [E],
          is_token_in_rank bool [T, R])
  dispatch(xs, topk_idx, topk_weights, *, num_experts, num_worst_tokens, buffer)
      -> (recv_xs, recv_topk_idx i32 [N, K], recv_topk_weights f32 [N, K],
          handle: DispatchHandle)
  cached_dispatch(xs, topk_weights | None, handle, *, buffer)
      -> (recv_xs, recv_topk_weights | None)   # handle's layout, no count exchange
  combine(x bf16 [N, H], topk_weights f32 [N, K] | None, handle, *, buffer)
      -> (out bf16 [T, H], out_weights f32 [T, K] | None)
  low_latency_dispatch_send(x bf16 [T, H], topk_idx, *, num_experts,
                            num_max_dispatch_tokens_per_rank, use_fp8,
                            round_scale, buffer) -> pending (a pytree)
  low_latency_dispatch_recv(pending, *, buffer)
      -> (recv_xs ([E/R, R*M, H] bf16, or FP8 pair with scales
          [E/R, R*M, H // 128]), recv_count i32 [E/R], handle: LowLatencyHandle)
  low_latency_combine_send(x bf16 [E/R, R*M, H], topk_idx, topk_weights,
                           handle, *, buffer) -> pending
  low_latency_combine_recv(pending, *, buffer) -> out bf16 [T, H]
  low_latency_dispatch(...), low_latency_combine(...)
      -> send then recv, whole (the CUDA backend runs them as one kernel)

The semantics (row order, padding, summation order) are those of
`deep_ep_jax.backends.reference`, the oracle: a CUDA result must equal it bit
for bit (FP8 quantisation included).
"""
