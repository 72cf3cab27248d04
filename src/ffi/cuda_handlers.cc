// XLA FFI handlers for the CUDA platform, in their own nanobind module (_mhc_cuda) so that the
// CPU module imports on machines without CUDA. Generated from the declared operations
// (operations.h) whose platforms include cuda: same target names and attributes as the CPU
// handlers; mhc/_ffi.py registers these for platform "CUDA". Each handler launches on XLA's
// stream and takes the pre operations' workspace from XLA's scratch allocator.
//
// STATUS: compiled and linked in CI; not yet run on a GPU.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>

#include "handler_common.h"
#include "mhc/cuda.h"

namespace ffi = xla::ffi;
using mhc_ffi::ArgBuffer;
using mhc_ffi::Decoded;
using mhc_ffi::ffi_entry;
using mhc_ffi::guarded;
using mhc_ffi::handler_binding;
using mhc_ffi::kOperations;
using mhc_ffi::RetBuffer;

namespace {

using Stream = ffi::PlatformStream<cudaStream_t>;

mhc::cuda::Workspace scratch_workspace(ffi::ScratchAllocator& scratch, int64_t bytes) {
  if (bytes == 0) return {};
  const std::optional<void*> data = scratch.Allocate(static_cast<size_t>(bytes), 256);
  if (!data.has_value()) {
    throw std::runtime_error("could not allocate " + std::to_string(bytes) +
                             " bytes of workspace from XLA's scratch allocator");
  }
  return mhc::cuda::Workspace{*data, bytes};
}

// The CUDA handler of the declared operation kOperations[Op], the function Function: XLA's stream
// as context, and where WorkspaceBytes is given (platforms cpu_cuda_scratch) XLA's scratch
// allocator, from which the call's workspace comes; then its buffers and the config attributes.
template <int Op, auto Function, auto WorkspaceBytes = nullptr,
          class = std::make_index_sequence<kOperations[Op].input_count()>,
          class = std::make_index_sequence<kOperations[Op].output_count()>>
struct CudaHandler;
template <int Op, auto Function, auto WorkspaceBytes, size_t... Input, size_t... Output>
struct CudaHandler<Op, Function, WorkspaceBytes, std::index_sequence<Input...>,
                   std::index_sequence<Output...>> {
  static ffi::Error call(cudaStream_t stream, ArgBuffer<Input>... args, RetBuffer<Output>... rets,
                         MHC_CONFIG_PARAMS) {
    return guarded(
        [&] { Decoded<Op>(args..., rets..., MHC_CONFIG_ARGS).template call<Function>(stream); });
  }
  static ffi::Error call_with_scratch(cudaStream_t stream, ffi::ScratchAllocator scratch,
                                      ArgBuffer<Input>... args, RetBuffer<Output>... rets,
                                      MHC_CONFIG_PARAMS) {
    return guarded([&] {
      const Decoded<Op> decoded(args..., rets..., MHC_CONFIG_ARGS);
      const int64_t tokens = decoded.inputs[mhc_ffi::x_index(decoded.op)].shape[0];
      const mhc::cuda::Workspace workspace =
          scratch_workspace(scratch, WorkspaceBytes(decoded.config, tokens));
      decoded.template call<Function>(workspace, stream);
    });
  }
  static auto bind() {
    constexpr size_t inputs = sizeof...(Input), outputs = sizeof...(Output);
    if constexpr (WorkspaceBytes == nullptr) {
      return handler_binding<inputs, outputs>(ffi::Ffi::Bind().Ctx<Stream>()).To(call);
    } else {
      return handler_binding<inputs, outputs>(
                 ffi::Ffi::Bind().Ctx<Stream>().Ctx<ffi::ScratchAllocator>())
          .To(call_with_scratch);
    }
  }
};

// The operations whose platforms include cuda (operations.h), as target -> handler.
#define MHC_CUDA_HANDLER_cpu(name)
#define MHC_CUDA_HANDLER_cpu_cuda(name) \
  {"mhc_" #name, &ffi_entry<CudaHandler<mhc_ffi::op_##name, &mhc::cuda::name>>},
#define MHC_CUDA_HANDLER_cpu_cuda_scratch(name) \
  {"mhc_" #name,                                \
   &ffi_entry<                                  \
       CudaHandler<mhc_ffi::op_##name, &mhc::cuda::name, &mhc::cuda::name##_workspace_bytes>>},
#define MHC_CUDA_HANDLER(name, platforms, ...) MHC_CUDA_HANDLER_##platforms(name)
const std::pair<const char*, XLA_FFI_Handler*> kCudaHandlers[] = {MHC_OPERATIONS(MHC_CUDA_HANDLER)};
#undef MHC_CUDA_HANDLER

}  // namespace

NB_MODULE(_mhc_cuda, module) {
  module.doc() = "XLA FFI handlers of mhc for the CUDA platform (unverified on a GPU)";
  module.def("registrations", []() {
    nanobind::dict table;
    for (const auto& [target, handler] : kCudaHandlers) {
      table[target] = nanobind::capsule(reinterpret_cast<void*>(handler));
    }
    return table;
  });
  module.def("device_available", &mhc::cuda::device_available);
  module.def("copy_bandwidth_gbs", &mhc::cuda::copy_bandwidth_gbs,
             nanobind::arg("bytes") = int64_t{1} << 30, nanobind::arg("repeats") = 10);
}
