// The operations a test binary checks: the CPU ones in mhc_tests (backend_cpu.cc), the CUDA ones
// in mhc_cuda_tests (backend_cuda.cc, which copies host views to the device and back). Both
// take host views, so one test body checks either backend against the float64 reference.
#pragma once

#include "mhc/ops.h"

namespace mhc::test {

struct Backend {
  const char* name;
  // False when this binary's backend cannot run here (no GPU): the tests then skip.
  bool (*available)();
  void (*pre_forward)(const Config& config, const TensorRef& x, const Params& params,
                      const PreForwardOutputs& outputs);
  void (*post_forward)(const Config& config, const TensorRef& x, const TensorRef& layer_out,
                       const TensorRef& h_post, const TensorRef& h_res,
                       const MutableTensorRef& out);
  void (*post_backward)(const Config& config, const TensorRef& g, const TensorRef& x,
                        const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                        const PostBackwardOutputs& outputs);
  void (*pre_backward)(const Config& config, const TensorRef& dlayer_in,
                       const TensorRef& dx_partial, const TensorRef& dh_post,
                       const TensorRef& dh_res, const TensorRef& x, const Params& params,
                       const MutableTensorRef& dx, const ParamGrads& grads);
  // The tensor-parallel split operations.
  void (*pre_forward_partials)(const Config& config, const TensorRef& x,
                               const TensorRef& norm_weight, const TensorRef& phi,
                               const MutableTensorRef& partials);
  void (*pre_forward_finish)(const Config& config, const TensorRef& x, const TensorRef& partials,
                             const TensorRef& alpha, const TensorRef& bias,
                             const PreForwardOutputs& outputs);
  void (*pre_backward_partials)(const Config& config, const TensorRef& dlayer_in,
                                const TensorRef& x, const MutableTensorRef& dh_pre);
  void (*pre_backward_finish)(const Config& config, const TensorRef& dlayer_in,
                              const TensorRef& dx_partial, const TensorRef& dh_pre,
                              const TensorRef& dh_post, const TensorRef& dh_res, const TensorRef& x,
                              const TensorRef& partials, const Params& params,
                              const MutableTensorRef& dx, const ParamGrads& grads);
};

const Backend& backend();

}  // namespace mhc::test
