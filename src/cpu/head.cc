// DeepSeek-V4's head on the CPU (spec: Head): the pre kernels (pre_kernels.h) with only the pre
// gates, dims.pre_gates_only, which is the one thing that tells them it is the head (no post
// gates, no Sinkhorn, no post gradients in the backward, dx starting at zero).
//
// The head's parameters are put in the pre kernels' layout per call: phi = fn^T [M, n],
// norm_weight = ones (V4's head RMS has no weight; multiplying by 1.0 is exact), alpha =
// {scale, 0, 0}, bias = base. The transpose stays because every projection kernel reads W by rows
// of N columns (vectors along N, projection.h); reading fn [n, M] in place would take a second
// set of kernels with vectors along M. It costs one pass over n*M floats (fn, and dfn back in the
// backward) next to the T*M of x; the buffers come from the call's workspace, so a warm call
// allocates nothing.
#include "kernels.h"
#include "pre_kernels.h"
#include "workspace.h"

namespace mhc::cpu {

namespace {

// The head's parameters in the pre kernels' layout, in the call's workspace.
struct PreLayout {
  float* norm_weight;  // ones [M]
  float* phi;          // fn^T [M, n]
  float alpha[3];
  PreWeights weights;
};

void to_pre_layout(const detail::Dims& dims, const HeadParams& head, Workspace& workspace,
                   PreLayout* layout) {
  const int64_t n = dims.n, M = dims.M;
  const auto* fn = static_cast<const float*>(head.fn.data);
  layout->norm_weight = workspace.take<float>(static_cast<size_t>(M));
  layout->phi = workspace.take<float>(static_cast<size_t>(M * n));
  std::fill_n(layout->norm_weight, M, 1.0f);
  for (int64_t k = 0; k < n; ++k) {
    for (int64_t m = 0; m < M; ++m) layout->phi[m * n + k] = fn[k * M + m];
  }
  layout->alpha[0] = *static_cast<const float*>(head.scale.data);
  layout->alpha[1] = 0.0f;
  layout->alpha[2] = 0.0f;
  layout->weights = PreWeights{layout->norm_weight, layout->phi, layout->alpha,
                               static_cast<const float*>(head.base.data)};
}

size_t layout_bytes(const detail::Dims& dims) {
  return Workspace::bytes_for<float>(static_cast<size_t>(dims.M)) +
         Workspace::bytes_for<float>(static_cast<size_t>(dims.M * dims.n));
}

}  // namespace

void head_forward(const Config& config, const detail::Dims& dims, const TensorRef& x,
                  const HeadParams& params, const MutableTensorRef& out,
                  const MutableTensorRef& gates) {
  if (dims.T == 0) return;
  Workspace workspace(layout_bytes(dims));
  PreLayout layout{};
  to_pre_layout(dims, params, workspace, &layout);
  with_activation_type(x.dtype, [&](auto tag) {
    using X = decltype(tag);
    MemoryTiles<X> source(static_cast<const X*>(x.data), nullptr, dims.M);
    const PreForwardOut<X> outputs{static_cast<X*>(out.data), static_cast<float*>(gates.data),
                                   nullptr, nullptr};
    pre_forward_tiles<X>(config, dims, layout.weights, nullptr, source, outputs);
  });
}

void head_backward(const Config& config, const detail::Dims& dims, const TensorRef& dout,
                   const TensorRef& x, const HeadParams& params, const MutableTensorRef& dx,
                   const HeadGrads& grads) {
  const int64_t n = dims.n, M = dims.M;
  // The layout, then the gradients of the pre layout: dnorm_weight [M] (discarded), dphi [M, n].
  Workspace workspace(layout_bytes(dims) + Workspace::bytes_for<float>(static_cast<size_t>(M)) +
                      Workspace::bytes_for<float>(static_cast<size_t>(M * n)));
  PreLayout layout{};
  to_pre_layout(dims, params, workspace, &layout);
  float* dphi = workspace.take<float>(static_cast<size_t>(M * n));
  float dalpha[3];
  const PreGrads pre_grads{workspace.take<float>(static_cast<size_t>(M)), dphi, dalpha,
                           static_cast<float*>(grads.base.data)};
  with_activation_type(x.dtype, [&](auto tag) {
    using X = decltype(tag);
    MemoryTiles<X> source(static_cast<const X*>(x.data), static_cast<X*>(dx.data), M);
    pre_backward_tiles<X>(config, dims, layout.weights, static_cast<const X*>(dout.data),
                          PostGradients<X>{}, Supplied{}, source, pre_grads);
  });
  auto* dfn = static_cast<float*>(grads.fn.data);
  for (int64_t k = 0; k < n; ++k) {
    for (int64_t m = 0; m < M; ++m) dfn[k * M + m] = dphi[m * n + k];
  }
  *static_cast<float*>(grads.scale.data) = dalpha[0];
}

}  // namespace mhc::cpu
