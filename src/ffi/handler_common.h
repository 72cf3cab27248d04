// What the CPU and CUDA handler files share: XLA buffers to mhc views, the config from the
// attributes, exceptions to FFI errors, the handlers' binding (buffers, then attributes), and the
// decoding of one declared operation's buffers (operations.h).
#pragma once

#include <array>
#include <exception>
#include <string>
#include <utility>

#include "mhc/config.h"
#include "mhc/error.h"
#include "mhc/ops.h"
#include "mhc/tensor.h"
#include "operations.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#define MHC_CONFIG_PARAMS                                                                  \
  int64_t n, int64_t mix, int64_t iters, float sinkhorn_eps, float rms_eps, float pre_eps, \
      float post_scale, int64_t tensor_parallel
#define MHC_CONFIG_ARGS n, mix, iters, sinkhorn_eps, rms_eps, pre_eps, post_scale, tensor_parallel

namespace mhc_ffi {

// An mhc view of data whose dtype (already mapped: f32, bf16, or nullptr for any other) and
// dims the caller read; errors name the operation (op) and the argument.
template <class View, class Pointer, class Dims>
View make_view(Pointer data, const mhc::DType* dtype, const Dims& dims, const char* op,
               const char* name) {
  if (dtype == nullptr) throw mhc::Error(op, name, "expected dtype float32 or bfloat16");
  if (dims.size() > static_cast<size_t>(mhc::kMaxRank)) {
    throw mhc::Error(op, name, "expected at most 4 dimensions");
  }
  View view;
  view.data = data;
  view.dtype = *dtype;
  view.rank = static_cast<int>(dims.size());
  for (size_t axis = 0; axis < dims.size(); ++axis) view.shape[axis] = dims[axis];
  return view;
}

inline const mhc::DType* dtype_of(ffi::DataType type) {
  static constexpr mhc::DType f32 = mhc::DType::f32;
  static constexpr mhc::DType bf16 = mhc::DType::bf16;
  if (type == ffi::DataType::F32) return &f32;
  if (type == ffi::DataType::BF16) return &bf16;
  return nullptr;
}

inline mhc::TensorRef in(const ffi::AnyBuffer& buffer, const char* op, const char* name) {
  return make_view<mhc::TensorRef>(buffer.untyped_data(), dtype_of(buffer.element_type()),
                                   buffer.dimensions(), op, name);
}

inline mhc::MutableTensorRef out(ffi::Result<ffi::AnyBuffer>& buffer, const char* op,
                                 const char* name) {
  return make_view<mhc::MutableTensorRef>(buffer->untyped_data(), dtype_of(buffer->element_type()),
                                          buffer->dimensions(), op, name);
}

// The config travels as attributes; D is the last dimension of x times the number of slices.
inline mhc::Config make_config(const char* op, const mhc::TensorRef& x, int64_t n, int64_t mix,
                               int64_t iters, float sinkhorn_eps, float rms_eps, float pre_eps,
                               float post_scale, int64_t tensor_parallel) {
  if (x.rank != 3) throw mhc::Error(op, "x", "expected rank 3 [T, n, D], got " + x.shape_string());
  if (mix != 0 && mix != 1)
    throw mhc::Error(op, "mix", "expected 0 (sinkhorn) or 1 (permutations)");
  constexpr int64_t kMaxSlices = int64_t{1} << 20;
  if (tensor_parallel < 1 || tensor_parallel > kMaxSlices) {
    throw mhc::Error(
        op, "tensor_parallel",
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
// operations check dtypes and shapes themselves), then the config attributes, in the order the
// handlers (CpuHandler, CudaHandler) list their parameters. Bindings are move-only and built by
// chaining, so the recursion passes each step's result straight on.
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

constexpr bool same_name(const char* a, const char* b) {
  while (*a != '\0' && *a == *b) ++a, ++b;
  return *a == *b;
}

// Where x is among an operation's inputs: every operation takes it, and the config's D is read
// from it.
constexpr int x_index(const Operation& op) {
  for (int index = 0; index < op.input_count(); ++index) {
    if (same_name(op.inputs[index], "x")) return index;
  }
  return -1;
}

template <size_t>
using ArgBuffer = ffi::AnyBuffer;
template <size_t>
using RetBuffer = ffi::Result<ffi::AnyBuffer>;

// The buffers of the declared operation kOperations[Op] as mhc views and its config, decoded
// from what its handler's binding (handler_binding<inputs, outputs>) passes.
template <int Op, class = std::make_index_sequence<kOperations[Op].input_count()>,
          class = std::make_index_sequence<kOperations[Op].output_count()>>
struct Decoded;
template <int Op, size_t... Input, size_t... Output>
struct Decoded<Op, std::index_sequence<Input...>, std::index_sequence<Output...>> {
  static constexpr const Operation& op = kOperations[Op];
  static constexpr int kInputs = sizeof...(Input);
  static constexpr int kOutputs = sizeof...(Output);
  static_assert(x_index(op) >= 0, "every operation takes x");

  Decoded(const ArgBuffer<Input>&... args, RetBuffer<Output>&... rets, MHC_CONFIG_PARAMS)
      : inputs{in(args, op.c_name, op.inputs[Input])...},
        outputs{out(rets, op.c_name, op.outputs[Output].name)...},
        config(make_config(op.c_name, inputs[x_index(op)], MHC_CONFIG_ARGS)) {}

  // Function(config, the views grouped as its parameters, extra...).
  template <auto Function, class... Extra>
  void call(Extra&&... extra) const {
    call_flat<kInputs, kOutputs>(Function, config, inputs.data(), outputs.data(),
                                 std::forward<Extra>(extra)...);
  }

  std::array<mhc::TensorRef, kInputs> inputs;
  std::array<mhc::MutableTensorRef, kOutputs> outputs;
  mhc::Config config;
};

// An XLA FFI handler (XLA_FFI_Handler*) for Handler, whose bind() returns its bound handler.
template <class Handler>
XLA_FFI_Error* ffi_entry(XLA_FFI_CallFrame* call_frame) {
  static auto* handler = Handler::bind().release();
  return handler->Call(call_frame);
}

}  // namespace mhc_ffi
