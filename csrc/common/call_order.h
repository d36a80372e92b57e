// Where a call stands among its Buffer's calls (deep_ep_jax/comm/ordering.py).
// XLA passes every call that communicates its Buffer's order state (int32
// [1]) as an operand aliased to a result, so the Buffer's calls form one
// chain of data dependences that XLA runs in program order, the same on every
// rank. The state holds the call's position along the chain: the call writes
// position + 1 to its result (the send half, for the split low-latency
// halves) and publishes a tag (position and kind of call) to its peers, who
// compare it with their own (kernels/device.cuh, CheckPeerCall). Ranks that
// ran a Buffer's calls in different orders therefore stop with a message
// instead of exchanging two different calls' data.
#pragma once

namespace deep_ep_jax {

struct CallOrder {
  const int* position;  // XLA's operand: this call's position along the chain
  int* next_position;   // the aliased result
};

// The kinds of call, in the tags: normal mode's match the kernels' mode enums.
enum CallKind : int {
  kDispatchCall = 0,
  kCachedDispatchCall = 1,
  kCombineCall = 2,
  kLowLatencyDispatchCall = 3,
  kLowLatencyCombineCall = 4,
  kNumCallKinds = 8,  // tag = position * kNumCallKinds + kind
};

}  // namespace deep_ep_jax
