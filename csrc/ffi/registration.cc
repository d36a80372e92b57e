// The one table of the FFI targets: name, handler symbol, result names in
// order (the handler's ffi::Result parameters; Python checks its own against
// them).
#include "ffi/registration.h"

namespace deep_ep_jax {

// The handlers, each defined by XLA_FFI_DEFINE_HANDLER_SYMBOL in the file named.
extern "C" {
FfiHandler GetDispatchLayoutHandler;  // layout.cc
FfiHandler IntranodeDispatchHandler;  // intranode.cc
FfiHandler IntranodeCachedDispatchHandler;
FfiHandler IntranodeCombineHandler;
FfiHandler InternodeDispatchHandler;  // internode.cc
FfiHandler InternodeCachedDispatchHandler;
FfiHandler InternodeCombineHandler;
FfiHandler LowLatencyDispatchSendHandler;  // low_latency.cc
FfiHandler LowLatencyDispatchRecvHandler;
FfiHandler LowLatencyDispatchHandler;
FfiHandler LowLatencyCombineSendHandler;
FfiHandler LowLatencyCombineRecvHandler;
FfiHandler LowLatencyCombineHandler;
FfiHandler LowLatencyDispatchSendOverlappedHandler;
FfiHandler LowLatencyDispatchRecvOverlappedHandler;
FfiHandler LowLatencyCombineSendOverlappedHandler;
FfiHandler LowLatencyCombineRecvOverlappedHandler;
FfiHandler LowLatencyMaskHandler;
FfiHandler ExpertLayoutHandler;  // expert_major.cc
FfiHandler ExpandRowsHandler;
FfiHandler ExpandRowsTransposedHandler;
FfiHandler ReduceRowsHandler;
FfiHandler Fp8AmaxHandler;  // fp8_quant.cc
FfiHandler Fp8RowsAndColumnsHandler;
FfiHandler Fp8QuantizeRowsHandler;
}

const std::map<std::string, FfiTarget>& FfiTargets() {
  static const std::map<std::string, FfiTarget> targets = {
      {"deep_ep_jax_get_dispatch_layout",
       {GetDispatchLayoutHandler, {"num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"}}},
      // Normal mode on one host.
      {"deep_ep_jax_dispatch",
       {IntranodeDispatchHandler,
        {"recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights", "is_token_in_rank", "num_tokens_per_rank",
         "rank_prefix_matrix", "send_pos", "recv_src_idx", "recv_src_rank", "num_recv_tokens",
         "num_recv_tokens_per_expert", "num_dropped_tokens", "order_out"}}},
      {"deep_ep_jax_cached_dispatch",
       {IntranodeCachedDispatchHandler, {"recv_x", "recv_x_scales", "recv_topk_weights", "order_out"}}},
      {"deep_ep_jax_combine", {IntranodeCombineHandler, {"out", "out_weights", "order_out"}}},
      // Normal mode across hosts.
      {"deep_ep_jax_internode_dispatch",
       {InternodeDispatchHandler,
        {"recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights", "is_token_in_rank", "num_tokens_per_rank",
         "rank_prefix_matrix", "send_pos", "recv_src_idx", "recv_src_rank", "num_recv_tokens",
         "num_recv_tokens_per_expert", "num_dropped_tokens", "node_pos", "order_out"}}},
      {"deep_ep_jax_internode_cached_dispatch",
       {InternodeCachedDispatchHandler, {"recv_x", "recv_x_scales", "recv_topk_weights", "node_pos", "order_out"}}},
      {"deep_ep_jax_internode_combine", {InternodeCombineHandler, {"out", "out_weights", "order_out"}}},
      // Low-latency mode.
      {"deep_ep_jax_low_latency_dispatch_send", {LowLatencyDispatchSendHandler, {"token", "order_out"}}},
      {"deep_ep_jax_low_latency_dispatch_recv",
       {LowLatencyDispatchRecvHandler,
        {"recv_x", "recv_scales", "recv_count", "recv_src_rank", "recv_src_token", "recv_src_topk", "order_out"}}},
      {"deep_ep_jax_low_latency_dispatch",
       {LowLatencyDispatchHandler,
        {"recv_x", "recv_scales", "recv_count", "recv_src_rank", "recv_src_token", "recv_src_topk", "order_out"}}},
      {"deep_ep_jax_low_latency_combine_send", {LowLatencyCombineSendHandler, {"token", "order_out"}}},
      {"deep_ep_jax_low_latency_combine_recv", {LowLatencyCombineRecvHandler, {"out", "order_out"}}},
      {"deep_ep_jax_low_latency_combine", {LowLatencyCombineHandler, {"out", "order_out"}}},
      {"deep_ep_jax_low_latency_dispatch_send_overlapped",
       {LowLatencyDispatchSendOverlappedHandler, {"token", "order_out"}}},
      {"deep_ep_jax_low_latency_dispatch_recv_overlapped",
       {LowLatencyDispatchRecvOverlappedHandler,
        {"recv_x", "recv_scales", "recv_count", "recv_src_rank", "recv_src_token", "recv_src_topk", "order_out"}}},
      {"deep_ep_jax_low_latency_combine_send_overlapped",
       {LowLatencyCombineSendOverlappedHandler, {"token", "order_out"}}},
      {"deep_ep_jax_low_latency_combine_recv_overlapped",
       {LowLatencyCombineRecvOverlappedHandler, {"out", "order_out"}}},
      {"deep_ep_jax_low_latency_mask", {LowLatencyMaskHandler, {"mask", "order_out"}}},
      // Expert-major rows.
      {"deep_ep_jax_expert_layout",
       {ExpertLayoutHandler, {"group_sizes", "group_offsets", "pair_row", "row_pair", "num_dropped", "pair_counts"}}},
      {"deep_ep_jax_expand_rows", {ExpandRowsHandler, {"expert_x", "expert_x_scales"}}},
      {"deep_ep_jax_expand_rows_transposed", {ExpandRowsTransposedHandler, {"expert_x_t"}}},
      {"deep_ep_jax_reduce_rows", {ReduceRowsHandler, {"out"}}},
      // FP8 quantizations.
      {"deep_ep_jax_fp8_amax_rows_and_columns", {Fp8AmaxHandler, {"row_amax", "col_amax_parts"}}},
      {"deep_ep_jax_fp8_rows_and_columns", {Fp8RowsAndColumnsHandler, {"rows", "cols"}}},
      {"deep_ep_jax_fp8_quantize_rows", {Fp8QuantizeRowsHandler, {"data", "scales"}}},
  };
  return targets;
}

}  // namespace deep_ep_jax
