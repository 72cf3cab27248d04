// What the CPU and CUDA handler files share: XLA buffers to mhc views, the config from the
// attributes, exceptions to FFI errors, and the handlers' binding (buffers, then attributes).
#pragma once

#include <exception>
#include <string>
#include <utility>

#include "mhc/config.h"
#include "mhc/error.h"
#include "mhc/ops.h"
#include "mhc/tensor.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace mhc_ffi {

inline constexpr const char* kOp = "mhc ffi";

inline mhc::DType dtype_of(ffi::DataType type, const char* name) {
  if (type == ffi::DataType::F32) return mhc::DType::f32;
  if (type == ffi::DataType::BF16) return mhc::DType::bf16;
  throw mhc::Error(kOp, name, "expected dtype float32 or bfloat16");
}

template <class View, class Pointer>
View make_view(Pointer data, ffi::DataType type, ffi::Span<const int64_t> dims, const char* name) {
  if (dims.size() > static_cast<size_t>(mhc::kMaxRank)) {
    throw mhc::Error(kOp, name, "expected at most 4 dimensions");
  }
  View view;
  view.data = data;
  view.dtype = dtype_of(type, name);
  view.rank = static_cast<int>(dims.size());
  for (size_t axis = 0; axis < dims.size(); ++axis) view.shape[axis] = dims[axis];
  return view;
}

inline mhc::TensorRef in(const ffi::AnyBuffer& buffer, const char* name) {
  return make_view<mhc::TensorRef>(buffer.untyped_data(), buffer.element_type(),
                                   buffer.dimensions(), name);
}

inline mhc::MutableTensorRef out(ffi::Result<ffi::AnyBuffer>& buffer, const char* name) {
  return make_view<mhc::MutableTensorRef>(buffer->untyped_data(), buffer->element_type(),
                                          buffer->dimensions(), name);
}

// The argument groups that the handlers of the pre operations, the boundaries and their V4.1
// forms share, decoded under the names every handler gives them: the parameters (norm_weight, phi,
// alpha, bias, bound in this order), their gradients, and the outputs of the pre forward and of
// the post backward.
inline mhc::Params params_in(const ffi::AnyBuffer& norm_weight, const ffi::AnyBuffer& phi,
                             const ffi::AnyBuffer& alpha, const ffi::AnyBuffer& bias) {
  return {in(norm_weight, "norm_weight"), in(phi, "phi"), in(alpha, "alpha"), in(bias, "bias")};
}

inline mhc::ParamGrads grads_out(ffi::Result<ffi::AnyBuffer>& dnorm_weight,
                                 ffi::Result<ffi::AnyBuffer>& dphi,
                                 ffi::Result<ffi::AnyBuffer>& dalpha,
                                 ffi::Result<ffi::AnyBuffer>& dbias) {
  return {out(dnorm_weight, "dnorm_weight"), out(dphi, "dphi"), out(dalpha, "dalpha"),
          out(dbias, "dbias")};
}

inline mhc::PreForwardOutputs pre_forward_out(ffi::Result<ffi::AnyBuffer>& layer_in,
                                              ffi::Result<ffi::AnyBuffer>& h_pre,
                                              ffi::Result<ffi::AnyBuffer>& h_post,
                                              ffi::Result<ffi::AnyBuffer>& h_res) {
  return {out(layer_in, "layer_in"), out(h_pre, "h_pre"), out(h_post, "h_post"),
          out(h_res, "h_res")};
}

inline mhc::PostBackwardOutputs post_backward_out(ffi::Result<ffi::AnyBuffer>& dx_partial,
                                                  ffi::Result<ffi::AnyBuffer>& dlayer_out,
                                                  ffi::Result<ffi::AnyBuffer>& dh_post,
                                                  ffi::Result<ffi::AnyBuffer>& dh_res) {
  return {out(dx_partial, "dx_partial"), out(dlayer_out, "dlayer_out"), out(dh_post, "dh_post"),
          out(dh_res, "dh_res")};
}

// The config travels as attributes; D is the last dimension of x times the number of slices.
inline mhc::Config make_config(const mhc::TensorRef& x, int64_t n, int64_t mix, int64_t iters,
                               float sinkhorn_eps, float rms_eps, float pre_eps, float post_scale,
                               int64_t tensor_parallel) {
  if (x.rank != 3) throw mhc::Error(kOp, "x", "expected rank 3 [T, n, D], got " + x.shape_string());
  if (mix != 0 && mix != 1)
    throw mhc::Error(kOp, "mix", "expected 0 (sinkhorn) or 1 (permutations)");
  constexpr int64_t kMaxSlices = int64_t{1} << 20;
  if (tensor_parallel < 1 || tensor_parallel > kMaxSlices) {
    throw mhc::Error(
        kOp, "tensor_parallel",
        "expected 1 <= tensor_parallel <= 2^20, got " + std::to_string(tensor_parallel));
  }
  mhc::Config config;
  config.n = n;
  config.tensor_parallel = tensor_parallel;
  // Wraps only for shapes far beyond validate()'s D <= 2^32, which then rejects them.
  config.dim = x.shape[2] > (int64_t{1} << 40) ? -1 : x.shape[2] * tensor_parallel;
  config.mix = mix == 0 ? mhc::Mix::sinkhorn : mhc::Mix::permutations;
  config.sinkhorn_iters = iters;
  config.sinkhorn_eps = sinkhorn_eps;
  config.rms_eps = rms_eps;
  config.pre_eps = pre_eps;
  config.post_scale = post_scale;
  return config;
}

template <class Body>
ffi::Error guarded(Body body) {
  try {
    body();
    return ffi::Error::Success();
  } catch (const mhc::Error& error) {
    return ffi::Error::InvalidArgument(error.what());
  } catch (const std::exception& error) {
    return ffi::Error::Internal(std::string("mhc: ") + error.what());
  }
}

// The binding of a handler: `Args` buffer arguments, `Rets` buffer results (all AnyBuffer; the
// operations check dtypes and shapes themselves), then the config attributes, in the order every
// Impl below lists its parameters. Bindings are move-only and built by chaining, so the
// recursion passes each step's result straight on.
template <int Args, int Rets, class Binding>
auto handler_binding(Binding binding) {
  if constexpr (Args > 0) {
    return handler_binding<Args - 1, Rets>(std::move(binding).template Arg<ffi::AnyBuffer>());
  } else if constexpr (Rets > 0) {
    return handler_binding<0, Rets - 1>(std::move(binding).template Ret<ffi::AnyBuffer>());
  } else {
    return std::move(binding)
        .template Attr<int64_t>("n")
        .template Attr<int64_t>("mix")
        .template Attr<int64_t>("sinkhorn_iters")
        .template Attr<float>("sinkhorn_eps")
        .template Attr<float>("rms_eps")
        .template Attr<float>("pre_eps")
        .template Attr<float>("post_scale")
        .template Attr<int64_t>("tensor_parallel");
  }
}

}  // namespace mhc_ffi

#define MHC_CONFIG_PARAMS                                                                  \
  int64_t n, int64_t mix, int64_t iters, float sinkhorn_eps, float rms_eps, float pre_eps, \
      float post_scale, int64_t tensor_parallel
#define MHC_CONFIG_ARGS n, mix, iters, sinkhorn_eps, rms_eps, pre_eps, post_scale, tensor_parallel
