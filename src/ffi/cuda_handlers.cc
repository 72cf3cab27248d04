// XLA FFI handlers for the CUDA platform, in their own nanobind module (_mhc_cuda) so that the
// CPU module imports on machines without CUDA. Same target names and attributes as the CPU
// handlers (cpu_handlers.cc); mhc/_ffi.py registers these for platform "CUDA". Each handler
// launches on XLA's stream and takes the pre operations' workspace from XLA's scratch allocator.
//
// STATUS: compiled and linked in CI; not yet run on a GPU.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>

#include "handler_common.h"
#include "mhc/cuda.h"

namespace ffi = xla::ffi;
using mhc_ffi::guarded;
using mhc_ffi::handler_binding;
using mhc_ffi::in;
using mhc_ffi::make_config;
using mhc_ffi::out;

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

ffi::Error PreForwardImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                          ffi::AnyBuffer norm_weight, ffi::AnyBuffer phi, ffi::AnyBuffer alpha,
                          ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> layer_in,
                          ffi::Result<ffi::AnyBuffer> h_pre, ffi::Result<ffi::AnyBuffer> h_post,
                          ffi::Result<ffi::AnyBuffer> h_res, MHC_CONFIG_PARAMS) {
  return guarded([&] {
    const mhc::TensorRef xv = in(x, "x");
    const mhc::Config config = make_config(xv, MHC_CONFIG_ARGS);
    const mhc::cuda::Workspace workspace =
        scratch_workspace(scratch, mhc::cuda::pre_forward_workspace_bytes(config, xv.shape[0]));
    mhc::cuda::pre_forward(
        config, xv,
        {in(norm_weight, "norm_weight"), in(phi, "phi"), in(alpha, "alpha"), in(bias, "bias")},
        {out(layer_in, "layer_in"), out(h_pre, "h_pre"), out(h_post, "h_post"),
         out(h_res, "h_res")},
        workspace, stream);
  });
}

ffi::Error PostForwardImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer layer_out,
                           ffi::AnyBuffer h_post, ffi::AnyBuffer h_res,
                           ffi::Result<ffi::AnyBuffer> result, MHC_CONFIG_PARAMS) {
  return guarded([&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::cuda::post_forward(make_config(xv, MHC_CONFIG_ARGS), xv, in(layer_out, "layer_out"),
                            in(h_post, "h_post"), in(h_res, "h_res"), out(result, "out"), stream);
  });
}

ffi::Error PostBackwardImpl(cudaStream_t stream, ffi::AnyBuffer g, ffi::AnyBuffer x,
                            ffi::AnyBuffer layer_out, ffi::AnyBuffer h_post, ffi::AnyBuffer h_res,
                            ffi::Result<ffi::AnyBuffer> dx_partial,
                            ffi::Result<ffi::AnyBuffer> dlayer_out,
                            ffi::Result<ffi::AnyBuffer> dh_post, ffi::Result<ffi::AnyBuffer> dh_res,
                            MHC_CONFIG_PARAMS) {
  return guarded([&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::cuda::post_backward(make_config(xv, MHC_CONFIG_ARGS), in(g, "g"), xv,
                             in(layer_out, "layer_out"), in(h_post, "h_post"), in(h_res, "h_res"),
                             {out(dx_partial, "dx_partial"), out(dlayer_out, "dlayer_out"),
                              out(dh_post, "dh_post"), out(dh_res, "dh_res")},
                             stream);
  });
}

ffi::Error PreBackwardImpl(cudaStream_t stream, ffi::ScratchAllocator scratch,
                           ffi::AnyBuffer dlayer_in, ffi::AnyBuffer dx_partial,
                           ffi::AnyBuffer dh_post, ffi::AnyBuffer dh_res, ffi::AnyBuffer x,
                           ffi::AnyBuffer norm_weight, ffi::AnyBuffer phi, ffi::AnyBuffer alpha,
                           ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> dx,
                           ffi::Result<ffi::AnyBuffer> dnorm_weight,
                           ffi::Result<ffi::AnyBuffer> dphi, ffi::Result<ffi::AnyBuffer> dalpha,
                           ffi::Result<ffi::AnyBuffer> dbias, MHC_CONFIG_PARAMS) {
  return guarded([&] {
    const mhc::TensorRef xv = in(x, "x");
    const mhc::Config config = make_config(xv, MHC_CONFIG_ARGS);
    const mhc::cuda::Workspace workspace =
        scratch_workspace(scratch, mhc::cuda::pre_backward_workspace_bytes(config, xv.shape[0]));
    mhc::cuda::pre_backward(
        config, in(dlayer_in, "dlayer_in"), in(dx_partial, "dx_partial"), in(dh_post, "dh_post"),
        in(dh_res, "dh_res"), xv,
        {in(norm_weight, "norm_weight"), in(phi, "phi"), in(alpha, "alpha"), in(bias, "bias")},
        out(dx, "dx"),
        {out(dnorm_weight, "dnorm_weight"), out(dphi, "dphi"), out(dalpha, "dalpha"),
         out(dbias, "dbias")},
        workspace, stream);
  });
}

ffi::Error PreForwardPartialsImpl(cudaStream_t stream, ffi::ScratchAllocator scratch,
                                  ffi::AnyBuffer x, ffi::AnyBuffer norm_weight, ffi::AnyBuffer phi,
                                  ffi::Result<ffi::AnyBuffer> partials, MHC_CONFIG_PARAMS) {
  return guarded([&] {
    const mhc::TensorRef xv = in(x, "x");
    const mhc::Config config = make_config(xv, MHC_CONFIG_ARGS);
    const mhc::cuda::Workspace workspace = scratch_workspace(
        scratch, mhc::cuda::pre_forward_partials_workspace_bytes(config, xv.shape[0]));
    mhc::cuda::pre_forward_partials(config, xv, in(norm_weight, "norm_weight"), in(phi, "phi"),
                                    out(partials, "partials"), workspace, stream);
  });
}

ffi::Error PreForwardFinishImpl(cudaStream_t stream, ffi::ScratchAllocator scratch,
                                ffi::AnyBuffer x, ffi::AnyBuffer partials, ffi::AnyBuffer alpha,
                                ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> layer_in,
                                ffi::Result<ffi::AnyBuffer> h_pre,
                                ffi::Result<ffi::AnyBuffer> h_post,
                                ffi::Result<ffi::AnyBuffer> h_res, MHC_CONFIG_PARAMS) {
  return guarded([&] {
    const mhc::TensorRef xv = in(x, "x");
    const mhc::Config config = make_config(xv, MHC_CONFIG_ARGS);
    const mhc::cuda::Workspace workspace = scratch_workspace(
        scratch, mhc::cuda::pre_forward_finish_workspace_bytes(config, xv.shape[0]));
    mhc::cuda::pre_forward_finish(config, xv, in(partials, "partials"), in(alpha, "alpha"),
                                  in(bias, "bias"),
                                  {out(layer_in, "layer_in"), out(h_pre, "h_pre"),
                                   out(h_post, "h_post"), out(h_res, "h_res")},
                                  workspace, stream);
  });
}

ffi::Error PreBackwardPartialsImpl(cudaStream_t stream, ffi::AnyBuffer dlayer_in, ffi::AnyBuffer x,
                                   ffi::Result<ffi::AnyBuffer> dh_pre, MHC_CONFIG_PARAMS) {
  return guarded([&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::cuda::pre_backward_partials(make_config(xv, MHC_CONFIG_ARGS), in(dlayer_in, "dlayer_in"),
                                     xv, out(dh_pre, "dh_pre"), stream);
  });
}

ffi::Error PreBackwardFinishImpl(
    cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer dlayer_in,
    ffi::AnyBuffer dx_partial, ffi::AnyBuffer dh_pre, ffi::AnyBuffer dh_post, ffi::AnyBuffer dh_res,
    ffi::AnyBuffer x, ffi::AnyBuffer partials, ffi::AnyBuffer norm_weight, ffi::AnyBuffer phi,
    ffi::AnyBuffer alpha, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> dx,
    ffi::Result<ffi::AnyBuffer> dnorm_weight, ffi::Result<ffi::AnyBuffer> dphi,
    ffi::Result<ffi::AnyBuffer> dalpha, ffi::Result<ffi::AnyBuffer> dbias, MHC_CONFIG_PARAMS) {
  return guarded([&] {
    const mhc::TensorRef xv = in(x, "x");
    const mhc::Config config = make_config(xv, MHC_CONFIG_ARGS);
    const mhc::cuda::Workspace workspace = scratch_workspace(
        scratch, mhc::cuda::pre_backward_finish_workspace_bytes(config, xv.shape[0]));
    mhc::cuda::pre_backward_finish(
        config, in(dlayer_in, "dlayer_in"), in(dx_partial, "dx_partial"), in(dh_pre, "dh_pre"),
        in(dh_post, "dh_post"), in(dh_res, "dh_res"), xv, in(partials, "partials"),
        {in(norm_weight, "norm_weight"), in(phi, "phi"), in(alpha, "alpha"), in(bias, "bias")},
        out(dx, "dx"),
        {out(dnorm_weight, "dnorm_weight"), out(dphi, "dphi"), out(dalpha, "dalpha"),
         out(dbias, "dbias")},
        workspace, stream);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MhcCudaPreForward, PreForwardImpl,
    (handler_binding<5, 4>(ffi::Ffi::Bind().Ctx<Stream>().Ctx<ffi::ScratchAllocator>())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcCudaPostForward, PostForwardImpl,
                              (handler_binding<4, 1>(ffi::Ffi::Bind().Ctx<Stream>())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcCudaPostBackward, PostBackwardImpl,
                              (handler_binding<5, 4>(ffi::Ffi::Bind().Ctx<Stream>())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MhcCudaPreBackward, PreBackwardImpl,
    (handler_binding<9, 5>(ffi::Ffi::Bind().Ctx<Stream>().Ctx<ffi::ScratchAllocator>())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MhcCudaPreForwardPartials, PreForwardPartialsImpl,
    (handler_binding<3, 1>(ffi::Ffi::Bind().Ctx<Stream>().Ctx<ffi::ScratchAllocator>())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MhcCudaPreForwardFinish, PreForwardFinishImpl,
    (handler_binding<4, 4>(ffi::Ffi::Bind().Ctx<Stream>().Ctx<ffi::ScratchAllocator>())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcCudaPreBackwardPartials, PreBackwardPartialsImpl,
                              (handler_binding<2, 1>(ffi::Ffi::Bind().Ctx<Stream>())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MhcCudaPreBackwardFinish, PreBackwardFinishImpl,
    (handler_binding<11, 5>(ffi::Ffi::Bind().Ctx<Stream>().Ctx<ffi::ScratchAllocator>())));

NB_MODULE(_mhc_cuda, module) {
  module.doc() = "XLA FFI handlers of mhc for the CUDA platform (unverified on a GPU)";
  module.def("registrations", []() {
    nanobind::dict table;
    table["mhc_pre_forward"] = nanobind::capsule(reinterpret_cast<void*>(MhcCudaPreForward));
    table["mhc_post_forward"] = nanobind::capsule(reinterpret_cast<void*>(MhcCudaPostForward));
    table["mhc_post_backward"] = nanobind::capsule(reinterpret_cast<void*>(MhcCudaPostBackward));
    table["mhc_pre_backward"] = nanobind::capsule(reinterpret_cast<void*>(MhcCudaPreBackward));
    table["mhc_pre_forward_partials"] =
        nanobind::capsule(reinterpret_cast<void*>(MhcCudaPreForwardPartials));
    table["mhc_pre_forward_finish"] =
        nanobind::capsule(reinterpret_cast<void*>(MhcCudaPreForwardFinish));
    table["mhc_pre_backward_partials"] =
        nanobind::capsule(reinterpret_cast<void*>(MhcCudaPreBackwardPartials));
    table["mhc_pre_backward_finish"] =
        nanobind::capsule(reinterpret_cast<void*>(MhcCudaPreBackwardFinish));
    return table;
  });
  module.def("device_available", &mhc::cuda::device_available);
  module.def("copy_bandwidth_gbs", &mhc::cuda::copy_bandwidth_gbs,
             nanobind::arg("bytes") = int64_t{1} << 30, nanobind::arg("repeats") = 10);
}
