// mhc_cuda_tests checks the CUDA operations of mhc/cuda.h through host views: inputs are copied
// to the device, outputs too (so their NaN poison travels), the workspace is filled with NaN
// bytes, the call runs on a non-default stream, and the outputs come back after a synchronize.
// A device copy sits at the same address modulo 256 bytes as its host view, so a test that
// misaligns a host view on purpose misaligns the device pointer the kernels see.
//
// MHC_REQUIRE_CUDA=1 (scripts/gpu_check.sh sets it): no device is an error, not a skip.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend.h"
#include "mhc/cuda.h"

namespace mhc::test {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

int64_t bytes_of(const TensorRef& view) {
  int64_t count = 1;
  for (int axis = 0; axis < view.rank; ++axis) count *= view.shape[axis];
  return count * size_of(view.dtype);
}

// `bytes` of device memory starting `offset` bytes past a cudaMalloc'ed (256-byte aligned) base.
class DeviceMemory {
 public:
  explicit DeviceMemory(int64_t bytes, int64_t offset = 0) : bytes_(bytes) {
    if (bytes > 0) {
      check(cudaMalloc(&base_, static_cast<size_t>(bytes + offset)), "cudaMalloc");
      data_ = static_cast<char*>(base_) + offset;
    }
  }
  ~DeviceMemory() { cudaFree(base_); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  void* data() const { return data_; }
  int64_t bytes() const { return bytes_; }

 private:
  void* base_ = nullptr;
  void* data_ = nullptr;
  int64_t bytes_;
};

int64_t misalignment(const void* host) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(host) % 256);
}

// A device copy of a host view; for an output, copy_back() writes the device values back.
class DeviceTensor {
 public:
  explicit DeviceTensor(const TensorRef& host)
      : memory_(bytes_of(host), misalignment(host.data)), view_(host) {
    if (memory_.bytes() > 0) {
      check(cudaMemcpy(memory_.data(), host.data, static_cast<size_t>(memory_.bytes()),
                       cudaMemcpyHostToDevice),
            "cudaMemcpy to the device");
    }
    view_.data = memory_.data();
  }
  explicit DeviceTensor(const MutableTensorRef& host) : DeviceTensor(static_cast<TensorRef>(host)) {
    host_output_ = host.data;
  }
  TensorRef ref() const { return view_; }
  MutableTensorRef mut() const {
    MutableTensorRef view;
    view.data = memory_.data();
    view.dtype = view_.dtype;
    view.rank = view_.rank;
    for (int axis = 0; axis < kMaxRank; ++axis) view.shape[axis] = view_.shape[axis];
    return view;
  }
  void copy_back() const {
    if (memory_.bytes() > 0) {
      check(cudaMemcpy(host_output_, memory_.data(), static_cast<size_t>(memory_.bytes()),
                       cudaMemcpyDeviceToHost),
            "cudaMemcpy to the host");
    }
  }

 private:
  DeviceMemory memory_;
  TensorRef view_;
  void* host_output_ = nullptr;
};

struct DeviceParams {
  DeviceTensor norm_weight, phi, alpha, bias;
  explicit DeviceParams(const Params& p)
      : norm_weight(p.norm_weight), phi(p.phi), alpha(p.alpha), bias(p.bias) {}
  Params view() const { return Params{norm_weight.ref(), phi.ref(), alpha.ref(), bias.ref()}; }
};

struct DeviceGrads {
  DeviceTensor norm_weight, phi, alpha, bias;
  explicit DeviceGrads(const ParamGrads& g)
      : norm_weight(g.norm_weight), phi(g.phi), alpha(g.alpha), bias(g.bias) {}
  ParamGrads view() const {
    return ParamGrads{norm_weight.mut(), phi.mut(), alpha.mut(), bias.mut()};
  }
  void copy_back() const {
    for (const DeviceTensor* t : {&norm_weight, &phi, &alpha, &bias}) t->copy_back();
  }
};

// Scratch filled with 0xff bytes (NaN as f32 and f64), so a read before a write shows up.
class PoisonedWorkspace {
 public:
  explicit PoisonedWorkspace(int64_t bytes) : memory_(bytes) {
    if (bytes > 0)
      check(cudaMemset(memory_.data(), 0xff, static_cast<size_t>(bytes)), "cudaMemset");
  }
  cuda::Workspace view() const { return cuda::Workspace{memory_.data(), memory_.bytes()}; }

 private:
  DeviceMemory memory_;
};

cuda::Stream test_stream() {
  static cudaStream_t stream = [] {
    cudaStream_t created = nullptr;
    // A blocking stream: it waits for the setup's cudaMemcpy / cudaMemset on the legacy default
    // stream, which may still be in flight when they return.
    check(cudaStreamCreate(&created), "cudaStreamCreate");
    return created;
  }();
  return stream;
}

void finish() { check(cudaStreamSynchronize(test_stream()), "the operation's kernels"); }

void pre_forward(const Config& config, const TensorRef& x, const Params& params,
                 const PreForwardOutputs& outputs) {
  const DeviceTensor dx(x), layer_in(outputs.layer_in), h_pre(outputs.h_pre),
      h_post(outputs.h_post), h_res(outputs.h_res);
  const DeviceParams dparams(params);
  const PoisonedWorkspace workspace(cuda::pre_forward_workspace_bytes(config, x.shape[0]));
  cuda::pre_forward(config, dx.ref(), dparams.view(),
                    PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()},
                    workspace.view(), test_stream());
  finish();
  for (const DeviceTensor* t : {&layer_in, &h_pre, &h_post, &h_res}) t->copy_back();
}

void post_forward(const Config& config, const TensorRef& x, const TensorRef& layer_out,
                  const TensorRef& h_post, const TensorRef& h_res, const MutableTensorRef& out) {
  const DeviceTensor dx(x), dlo(layer_out), dhp(h_post), dhr(h_res), dout(out);
  cuda::post_forward(config, dx.ref(), dlo.ref(), dhp.ref(), dhr.ref(), dout.mut(), test_stream());
  finish();
  dout.copy_back();
}

void post_backward(const Config& config, const TensorRef& g, const TensorRef& x,
                   const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                   const PostBackwardOutputs& outputs) {
  const DeviceTensor dg(g), dx(x), dlo(layer_out), dhp(h_post), dhr(h_res);
  const DeviceTensor dx_partial(outputs.dx_partial), dlayer_out(outputs.dlayer_out),
      dh_post(outputs.dh_post), dh_res(outputs.dh_res);
  cuda::post_backward(
      config, dg.ref(), dx.ref(), dlo.ref(), dhp.ref(), dhr.ref(),
      PostBackwardOutputs{dx_partial.mut(), dlayer_out.mut(), dh_post.mut(), dh_res.mut()},
      test_stream());
  finish();
  for (const DeviceTensor* t : {&dx_partial, &dlayer_out, &dh_post, &dh_res}) t->copy_back();
}

void pre_backward(const Config& config, const TensorRef& dlayer_in, const TensorRef& dx_partial,
                  const TensorRef& dh_post, const TensorRef& dh_res, const TensorRef& x,
                  const Params& params, const MutableTensorRef& dx, const ParamGrads& grads) {
  const DeviceTensor ddli(dlayer_in), ddxp(dx_partial), ddhp(dh_post), ddhr(dh_res), ddx_in(x),
      ddx(dx);
  const DeviceParams dparams(params);
  const DeviceGrads dgrads(grads);
  const PoisonedWorkspace workspace(cuda::pre_backward_workspace_bytes(config, x.shape[0]));
  cuda::pre_backward(config, ddli.ref(), ddxp.ref(), ddhp.ref(), ddhr.ref(), ddx_in.ref(),
                     dparams.view(), ddx.mut(), dgrads.view(), workspace.view(), test_stream());
  finish();
  ddx.copy_back();
  dgrads.copy_back();
}

void pre_forward_partials(const Config& config, const TensorRef& x, const TensorRef& norm_weight,
                          const TensorRef& phi, const MutableTensorRef& partials) {
  const DeviceTensor dx(x), dnw(norm_weight), dphi(phi), dpartials(partials);
  const PoisonedWorkspace workspace(cuda::pre_forward_partials_workspace_bytes(config, x.shape[0]));
  cuda::pre_forward_partials(config, dx.ref(), dnw.ref(), dphi.ref(), dpartials.mut(),
                             workspace.view(), test_stream());
  finish();
  dpartials.copy_back();
}

void pre_forward_finish(const Config& config, const TensorRef& x, const TensorRef& partials,
                        const TensorRef& alpha, const TensorRef& bias,
                        const PreForwardOutputs& outputs) {
  const DeviceTensor dx(x), dpartials(partials), dalpha(alpha), dbias(bias),
      layer_in(outputs.layer_in), h_pre(outputs.h_pre), h_post(outputs.h_post),
      h_res(outputs.h_res);
  const PoisonedWorkspace workspace(cuda::pre_forward_finish_workspace_bytes(config, x.shape[0]));
  cuda::pre_forward_finish(
      config, dx.ref(), dpartials.ref(), dalpha.ref(), dbias.ref(),
      PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()}, workspace.view(),
      test_stream());
  finish();
  for (const DeviceTensor* t : {&layer_in, &h_pre, &h_post, &h_res}) t->copy_back();
}

void pre_backward_partials(const Config& config, const TensorRef& dlayer_in, const TensorRef& x,
                           const MutableTensorRef& dh_pre) {
  const DeviceTensor ddli(dlayer_in), dx(x), ddh_pre(dh_pre);
  cuda::pre_backward_partials(config, ddli.ref(), dx.ref(), ddh_pre.mut(), test_stream());
  finish();
  ddh_pre.copy_back();
}

void pre_backward_finish(const Config& config, const TensorRef& dlayer_in,
                         const TensorRef& dx_partial, const TensorRef& dh_pre,
                         const TensorRef& dh_post, const TensorRef& dh_res, const TensorRef& x,
                         const TensorRef& partials, const Params& params,
                         const MutableTensorRef& dx, const ParamGrads& grads) {
  const DeviceTensor ddli(dlayer_in), ddxp(dx_partial), ddh_pre(dh_pre), ddhp(dh_post),
      ddhr(dh_res), ddx_in(x), dpartials(partials), ddx(dx);
  const DeviceParams dparams(params);
  const DeviceGrads dgrads(grads);
  const PoisonedWorkspace workspace(cuda::pre_backward_finish_workspace_bytes(config, x.shape[0]));
  cuda::pre_backward_finish(config, ddli.ref(), ddxp.ref(), ddh_pre.ref(), ddhp.ref(), ddhr.ref(),
                            ddx_in.ref(), dpartials.ref(), dparams.view(), ddx.mut(), dgrads.view(),
                            workspace.view(), test_stream());
  finish();
  ddx.copy_back();
  dgrads.copy_back();
}

bool required() {
  const char* flag = std::getenv("MHC_REQUIRE_CUDA");
  return flag != nullptr && std::strcmp(flag, "1") == 0;
}

// False without a usable device, so the tests skip; with MHC_REQUIRE_CUDA=1 it throws instead,
// which fails the test that asked (GoogleTest reports an exception in SetUp or the body).
bool available() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaSuccess && count > 0) return true;
  cudaGetLastError();  // clear the sticky error for later calls
  if (required()) {
    throw std::runtime_error(
        std::string("MHC_REQUIRE_CUDA=1 but no usable CUDA device: cudaGetDeviceCount: ") +
        (status == cudaSuccess ? "0 devices" : cudaGetErrorString(status)));
  }
  return false;
}

}  // namespace

const Backend& backend() {
  static const Backend cuda_backend{"cuda",
                                    &available,
                                    &pre_forward,
                                    &post_forward,
                                    &post_backward,
                                    &pre_backward,
                                    &pre_forward_partials,
                                    &pre_forward_finish,
                                    &pre_backward_partials,
                                    &pre_backward_finish};
  return cuda_backend;
}

}  // namespace mhc::test
