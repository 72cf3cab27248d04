// The fused CPU kernels behind the public operations in mhc/ops.h. Arguments arrive validated
// (src/core/validate.h); each function switches on the activation dtypes and runs token tiles on
// the thread pool.
#pragma once

#include "../core/validate.h"
#include "mhc/ops.h"

namespace mhc::cpu {

void pre_forward(const Config& config, const detail::Dims& dims, const TensorRef& x,
                 const Params& params, const PreForwardOutputs& outputs);

void post_forward(const Config& config, const detail::Dims& dims, const TensorRef& x,
                  const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                  const MutableTensorRef& out);

void post_backward(const Config& config, const detail::Dims& dims, const TensorRef& g,
                   const TensorRef& x, const TensorRef& layer_out, const TensorRef& h_post,
                   const TensorRef& h_res, const PostBackwardOutputs& outputs);

void pre_backward(const Config& config, const detail::Dims& dims, const TensorRef& dlayer_in,
                  const TensorRef& dx_partial, const TensorRef& dh_post, const TensorRef& dh_res,
                  const TensorRef& x, const Params& params, const MutableTensorRef& dx,
                  const ParamGrads& grads);

}  // namespace mhc::cpu
