#include "ffi/registration.h"

namespace deep_ep_jax {

// A function-local static, so registrars in other files' static initialisers
// can use it whatever the initialisation order.
std::map<std::string, FfiTarget>& FfiTargets() {
  static std::map<std::string, FfiTarget> targets;
  return targets;
}

}  // namespace deep_ep_jax
