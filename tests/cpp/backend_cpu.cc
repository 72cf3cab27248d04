// mhc_tests checks the CPU operations of mhc/ops.h.
#include "backend.h"

namespace mhc::test {

const Backend& backend() {
  static const Backend cpu{"cpu",
                           [] { return true; },
                           &mhc::pre_forward,
                           &mhc::post_forward,
                           &mhc::post_backward,
                           &mhc::pre_backward,
                           &mhc::pre_forward_partials,
                           &mhc::pre_forward_finish,
                           &mhc::pre_backward_partials,
                           &mhc::pre_backward_finish};
  return cpu;
}

}  // namespace mhc::test
