// mhc/cuda.h: the four mHC operations on an NVIDIA GPU (built for sm_80 and sm_90).
//
// Same semantics, shapes, dtypes and argument checks as mhc/ops.h; every pointer in the views is
// device memory (or memory the device can address). Each call enqueues its kernels on `stream`
// and returns: it never synchronizes and never allocates. Scratch memory comes from the caller as
// a Workspace of at least *_workspace_bytes(config, T) bytes, aligned to 256 bytes, which the call
// may overwrite and which must not be touched until the stream has passed the call.
//
// Determinism: every result, parameter gradients included, is bitwise identical run to run for
// the same shapes on the same GPU, given the same 16-byte alignment of the tensors (cudaMalloc
// and XLA always give it; the aligned and unaligned paths sum per-token dots in different orders).
// Partial sums are indexed by data tile (token group, slice of n*D), never by block scheduling, and
// summed in a fixed order; no floating-point atomics.
//
// Errors: bad arguments throw mhc::Error before anything is enqueued (the same checks and messages
// as the CPU operations, with "mhc::cuda::" in front). So does a shape whose grid CUDA cannot hold
// (more than 2^31 - 1 blocks; argument "x", naming the kernel): every grid of an operation is
// checked before its first launch. A failed launch throws mhc::Error naming the CUDA error; an
// earlier asynchronous error on the stream can surface here too.
//
// STATUS: compiled and linked in CI, not yet run on a GPU (see README, "Support").
#pragma once

#include <cstdint>

#include "mhc/config.h"
#include "mhc/ops.h"
#include "mhc/tensor.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*; callers need not include the CUDA headers

namespace mhc::cuda {

using Stream = CUstream_st*;

// Caller-owned device scratch memory.
struct Workspace {
  void* data = nullptr;
  int64_t bytes = 0;
};

// Bytes of workspace each operation needs for T tokens (0 for the post operations, which need
// none). Depends on the config and T only.
int64_t pre_forward_workspace_bytes(const Config& config, int64_t tokens);
int64_t pre_backward_workspace_bytes(const Config& config, int64_t tokens);

void pre_forward(const Config& config, const TensorRef& x, const Params& params,
                 const PreForwardOutputs& outputs, const Workspace& workspace, Stream stream);

void post_forward(const Config& config, const TensorRef& x, const TensorRef& layer_out,
                  const TensorRef& h_post, const TensorRef& h_res, const MutableTensorRef& out,
                  Stream stream);

void post_backward(const Config& config, const TensorRef& g, const TensorRef& x,
                   const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                   const PostBackwardOutputs& outputs, Stream stream);

void pre_backward(const Config& config, const TensorRef& dlayer_in, const TensorRef& dx_partial,
                  const TensorRef& dh_post, const TensorRef& dh_res, const TensorRef& x,
                  const Params& params, const MutableTensorRef& dx, const ParamGrads& grads,
                  const Workspace& workspace, Stream stream);

// Tensor parallelism: the split operations of mhc/ops.h (D sliced across devices, an all-reduce
// of the small per-token partials in between), same shapes and checks.
int64_t pre_forward_partials_workspace_bytes(const Config& config, int64_t tokens);
int64_t pre_forward_finish_workspace_bytes(const Config& config, int64_t tokens);
int64_t pre_backward_finish_workspace_bytes(const Config& config, int64_t tokens);

void pre_forward_partials(const Config& config, const TensorRef& x, const TensorRef& norm_weight,
                          const TensorRef& phi, const MutableTensorRef& partials,
                          const Workspace& workspace, Stream stream);
void pre_forward_finish(const Config& config, const TensorRef& x, const TensorRef& partials,
                        const TensorRef& alpha, const TensorRef& bias,
                        const PreForwardOutputs& outputs, const Workspace& workspace,
                        Stream stream);
void pre_backward_partials(const Config& config, const TensorRef& dlayer_in, const TensorRef& x,
                           const MutableTensorRef& dh_pre, Stream stream);
void pre_backward_finish(const Config& config, const TensorRef& dlayer_in,
                         const TensorRef& dx_partial, const TensorRef& dh_pre,
                         const TensorRef& dh_post, const TensorRef& dh_res, const TensorRef& x,
                         const TensorRef& partials, const Params& params,
                         const MutableTensorRef& dx, const ParamGrads& grads,
                         const Workspace& workspace, Stream stream);

// True when the CUDA runtime finds at least one device this build can run on.
bool device_available();

// The bandwidth limit of the spec's roofline on the current device: read + write bytes per second
// (in GB/s) of a device-to-device copy of `bytes`, the median of `repeats` timed by CUDA events.
// Allocates and frees its buffers and synchronizes: a measurement, not for the hot path.
double copy_bandwidth_gbs(int64_t bytes = int64_t{1} << 30, int repeats = 10);

}  // namespace mhc::cuda
