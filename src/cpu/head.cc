// DeepSeek-V4's head on the CPU (spec: Head): the pre operations with only the pre gates. The
// head's parameters are put in the pre kernels' layout (phi = fn^T [M, n], norm_weight = ones,
// alpha = {scale, 0, 0}, bias = base), so the projection, the gates, the pre-apply and their
// exact backward are pre_forward's and pre_backward's own code with N = n (dims.pre_gates_only).
// The layout costs one transposed copy of fn (n*M floats) per call, next to the T*M of x.
#include <vector>

#include "kernels.h"

namespace mhc::cpu {

namespace {

struct PreLayout {
  std::vector<float> norm_weight;  // ones [M]: V4's head RMS factor has no weight
  std::vector<float> phi;          // fn^T [M, n]
  float alpha[3];
  Params params;
};

PreLayout pre_layout(const detail::Dims& dims, const HeadParams& head) {
  const int64_t n = dims.n, M = dims.M;
  const auto* fn = static_cast<const float*>(head.fn.data);
  PreLayout layout{std::vector<float>(static_cast<size_t>(M), 1.0f),
                   std::vector<float>(static_cast<size_t>(M * n)),
                   {*static_cast<const float*>(head.scale.data), 0.0f, 0.0f},
                   {}};
  for (int64_t k = 0; k < n; ++k) {
    for (int64_t m = 0; m < M; ++m) layout.phi[static_cast<size_t>(m * n + k)] = fn[k * M + m];
  }
  layout.params =
      Params{TensorRef(layout.norm_weight.data(), {M}), TensorRef(layout.phi.data(), {M, n}),
             TensorRef(layout.alpha, {3}), head.base};
  return layout;
}

}  // namespace

void head_forward(const Config& config, const detail::Dims& dims, const TensorRef& x,
                  const HeadParams& params, const MutableTensorRef& out,
                  const MutableTensorRef& gates) {
  if (dims.T == 0) return;
  const PreLayout layout = pre_layout(dims, params);
  pre_forward(config, dims, x, layout.params, PreForwardOutputs{out, gates, {}, {}});
}

void head_backward(const Config& config, const detail::Dims& dims, const TensorRef& dout,
                   const TensorRef& x, const HeadParams& params, const MutableTensorRef& dx,
                   const HeadGrads& grads) {
  const int64_t n = dims.n, M = dims.M;
  const PreLayout layout = pre_layout(dims, params);
  std::vector<float> dnorm_weight(static_cast<size_t>(M)), dphi(static_cast<size_t>(M * n));
  float dalpha[3];
  const ParamGrads pre_grads{MutableTensorRef(dnorm_weight.data(), {M}),
                             MutableTensorRef(dphi.data(), {M, n}), MutableTensorRef(dalpha, {3}),
                             grads.base};
  // No dx_partial, dh_post or dh_res: null views (dims.pre_gates_only).
  pre_backward(config, dims, dout, TensorRef{}, TensorRef{}, TensorRef{}, x, layout.params, dx,
               pre_grads);
  auto* dfn = static_cast<float*>(grads.fn.data);
  for (int64_t k = 0; k < n; ++k) {
    for (int64_t m = 0; m < M; ++m) dfn[k * M + m] = dphi[static_cast<size_t>(m * n + k)];
  }
  *static_cast<float*>(grads.scale.data) = dalpha[0];
}

}  // namespace mhc::cpu
