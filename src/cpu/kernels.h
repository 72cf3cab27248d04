// The fused CPU kernels behind the public operations in mhc/ops.h. Arguments arrive validated
// (src/core/validate.h); each function switches on the activation dtypes and runs token tiles on
// the thread pool.
#pragma once

#include "../core/validate.h"
#include "mhc/ops.h"

namespace mhc::cpu {

// The one dtype dispatch of the CPU backend: calls body(X{}) with X the activation type (float or
// bf16) of `dtype`.
template <class Body>
void with_activation_type(DType dtype, Body body) {
  if (dtype == DType::bf16) {
    body(bf16{});
  } else {
    body(float{});
  }
}

// body(X{}, L{}) for the post operations' pair of dtypes: x (and the streams) and layer_out.
template <class Body>
void with_activation_types(DType x_dtype, DType layer_out_dtype, Body body) {
  with_activation_type(x_dtype, [&](auto x_tag) {
    with_activation_type(layer_out_dtype, [&](auto lo_tag) { body(x_tag, lo_tag); });
  });
}

// The mix the pre-apply reads (mhc::PreApply): the sublayer's own h_pre (the default), a carried
// mix [T, n] (weights), or the one-hot on stream 0, applied as stream 0 alone with weight 1 (an
// exact copy; the other streams never enter). weights is read in mode carried only.
inline constexpr float kOneHotWeight = 1.0f;
struct PreApplyMix {
  PreApply mode = PreApply::own_gates;
  const float* weights = nullptr;  // [T, n]
  // The streams the pre-apply sums (the first streams(n)) and their weights for `token`.
  int64_t streams(int64_t n) const { return mode == PreApply::one_hot ? 1 : n; }
  const float* row(int64_t token, int64_t n, const float* own_h_pre) const {
    switch (mode) {
      case PreApply::own_gates: return own_h_pre;
      case PreApply::one_hot: return &kOneHotWeight;
      case PreApply::carried: break;
    }
    return weights + token * n;
  }
};

void pre_forward(const Config& config, const detail::Dims& dims, const TensorRef& x,
                 const Params& params, const PreForwardOutputs& outputs);

// The tensor-parallel split of pre_forward and pre_backward (mhc/ops.h).
void pre_forward_partials(const detail::Dims& dims, const TensorRef& x,
                          const TensorRef& norm_weight, const TensorRef& phi, float* partials);
void pre_forward_finish(const Config& config, const detail::Dims& dims, const TensorRef& x,
                        const float* partials, const float* alpha, const float* bias,
                        const PreForwardOutputs& outputs);
void pre_backward_partials(const detail::Dims& dims, const TensorRef& dlayer_in, const TensorRef& x,
                           float* dh_pre);
void pre_backward_finish(const Config& config, const detail::Dims& dims, const TensorRef& dlayer_in,
                         const TensorRef& dx_partial, const float* dh_pre, const TensorRef& dh_post,
                         const TensorRef& dh_res, const TensorRef& x, const float* partials,
                         const Params& params, const MutableTensorRef& dx, const ParamGrads& grads);

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

// DeepSeek-V4's head: the pre operations with dims.pre_gates_only (mhc/ops.h).
void head_forward(const Config& config, const detail::Dims& dims, const TensorRef& x,
                  const HeadParams& params, const MutableTensorRef& out,
                  const MutableTensorRef& gates);
void head_backward(const Config& config, const detail::Dims& dims, const TensorRef& dout,
                   const TensorRef& x, const HeadParams& params, const MutableTensorRef& dx,
                   const HeadGrads& grads);

// The fused boundary (mhc/ops.h), in boundary.cc.
void boundary_forward(const Config& config, const detail::Dims& dims, const TensorRef& x,
                      const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                      const Params& next_params, const MutableTensorRef& x_next,
                      const PreForwardOutputs& next);
void boundary_backward(const Config& config, const detail::Dims& dims,
                       const TensorRef& next_dlayer_in, const TensorRef& next_dx_partial,
                       const TensorRef& next_dh_post, const TensorRef& next_dh_res,
                       const TensorRef& x, const TensorRef& layer_out, const TensorRef& h_post,
                       const TensorRef& h_res, const Params& next_params,
                       const PostBackwardOutputs& outputs, const ParamGrads& next_grads);

// DeepSeek-V4.1's carried mix (mhc/ops.h, spec: Single-pass schedule). `mix` is the carried
// mix (mode carried) or the one-hot on stream 0 (mode one_hot; then dcarried is unused). The pre
// operations are the pre kernels with that PreApplyMix (pre_forward.cc, pre_backward.cc), the
// boundary the fused boundary's tile sources with one (boundary.cc); collapse.cc has the collapse.
void pre_forward_carried(const Config& config, const detail::Dims& dims, const TensorRef& x,
                         const PreApplyMix& mix, const Params& params,
                         const PreForwardOutputs& outputs);
void pre_backward_carried(const Config& config, const detail::Dims& dims,
                          const TensorRef& dlayer_in, const TensorRef& dx_partial,
                          const float* dh_pre, const TensorRef& dh_post, const TensorRef& dh_res,
                          const TensorRef& x, const PreApplyMix& mix, const Params& params,
                          const MutableTensorRef& dx, float* dcarried, const ParamGrads& grads);
void pre_forward_finish_carried(const Config& config, const detail::Dims& dims, const TensorRef& x,
                                const float* partials, const PreApplyMix& mix, const float* alpha,
                                const float* bias, const PreForwardOutputs& outputs);
void pre_backward_finish_carried(const Config& config, const detail::Dims& dims,
                                 const TensorRef& dlayer_in, const TensorRef& dx_partial,
                                 const float* dh_pre, const TensorRef& dh_post,
                                 const TensorRef& dh_res, const TensorRef& x, const float* partials,
                                 const PreApplyMix& mix, const Params& params,
                                 const MutableTensorRef& dx, const ParamGrads& grads);
void collapse_forward(const detail::Dims& dims, const TensorRef& x, const PreApplyMix& mix,
                      const MutableTensorRef& out);
void collapse_backward(const detail::Dims& dims, const TensorRef& dout, const TensorRef& x,
                       const PreApplyMix& mix, const MutableTensorRef& dx, float* dcarried);
void boundary_forward_carried(const Config& config, const detail::Dims& dims, const TensorRef& x,
                              const TensorRef& layer_out, const TensorRef& h_pre,
                              const TensorRef& h_post, const TensorRef& h_res,
                              const Params& next_params, const MutableTensorRef& x_next,
                              const PreForwardOutputs& next);
void boundary_backward_carried(const Config& config, const detail::Dims& dims,
                               const TensorRef& next_dlayer_in, const TensorRef& next_dx_partial,
                               const TensorRef& next_dh_pre, const TensorRef& next_dh_post,
                               const TensorRef& next_dh_res, const TensorRef& x,
                               const TensorRef& layer_out, const TensorRef& h_pre,
                               const TensorRef& h_post, const TensorRef& h_res,
                               const Params& next_params, const PostBackwardOutputs& outputs,
                               const MutableTensorRef& dh_pre, const ParamGrads& next_grads);

}  // namespace mhc::cpu
