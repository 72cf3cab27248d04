// The public operations of mhc/cuda.h: the same argument checks as the CPU operations, the
// workspace carved into the kernels' scratch, every grid of the operation checked (checked_grid),
// and only then the launches on the caller's stream, so a failing operation enqueues nothing.
//
// pre_forward:   projection partials -> per-token coefficients -> pre-apply
// post_forward:  one streaming kernel
// post_backward: one streaming kernel (dh_post, dh_res reduced per token in the block)
// pre_backward:  projection partials, dh_pre -> per-token coefficient backward (dP, the x
//                coefficient, h_pre, dbias/dalpha terms) -> dx (input gradient with the pre-apply
//                and RMS terms in its epilogue) -> weight-gradient partials per token group ->
//                fixed-order sums of the partials and terms
//
// STATUS: compiled in CI; not yet run on a GPU.
#include <algorithm>
#include <vector>

#include "common.cuh"
#include "kernels.h"
#include "mhc/cuda.h"

namespace mhc::cuda {

namespace {

constexpr int64_t kAlignment = 256;

// Hands out aligned pieces of the workspace in order; with a null base it only counts bytes.
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}
  template <class T>
  T* take(int64_t count) {
    T* piece = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + used_);
    used_ += round_up(count * static_cast<int64_t>(sizeof(T)), kAlignment);
    return piece;
  }
  int64_t used() const { return used_; }

 private:
  char* base_;
  int64_t used_ = 0;
};

struct PreForwardScratch {
  ProjectionSplit split;
  CoefficientSlots slots;
  float* partials = nullptr;  // [slices, T, N+1]
  double* coefficient_scratch = nullptr;
};

// The forward's two stages: the projection partials and the per-token coefficients. The fused
// operation needs both, each tensor-parallel half one.
enum Stages : unsigned { kProjection = 1, kCoefficients = 2 };

PreForwardScratch carve_pre_forward(const Config& config, const detail::Dims& d, unsigned stages,
                                    Carver& carver) {
  PreForwardScratch w;
  w.split = projection_split(d);
  w.slots = forward_coefficient_slots(config, d.T);
  if (stages & kProjection) w.partials = carver.take<float>(w.split.slices * d.T * (d.N + 1));
  if (stages & kCoefficients) {
    w.coefficient_scratch = carver.take<double>(w.slots.threads * w.slots.doubles_per_thread);
  }
  return w;
}

struct PreBackwardScratch {
  ProjectionSplit split;
  CoefficientSlots slots;
  float* partials = nullptr;  // recomputed projection (fused operation only)
  float* dh_pre = nullptr;    // (fused operation only)
  TokenGrads token;
  double* term_group_sums;
  float* weight_partials;
  double* coefficient_scratch;
};

// `recompute`: the fused operation recomputes the projection and dh_pre; pre_backward_finish is
// handed both.
PreBackwardScratch carve_pre_backward(const Config& config, const detail::Dims& d, bool recompute,
                                      Carver& carver) {
  PreBackwardScratch w;
  w.split = projection_split(d);
  w.slots = backward_coefficient_slots(config, d.T);
  if (recompute) {
    w.partials = carver.take<float>(w.split.slices * d.T * (d.N + 1));
    w.dh_pre = carver.take<float>(d.T * d.n);
  }
  w.token.dP = carver.take<float>(d.T * d.N);
  w.token.x_coef = carver.take<float>(d.T);
  w.token.h_pre = carver.take<float>(d.T * d.n);
  w.token.terms = carver.take<double>(d.T * (d.N + 3));
  w.term_group_sums = carver.take<double>(ceil_div(d.T, kTermTokens) * (d.N + 3));
  w.weight_partials = carver.take<float>(weight_grad_groups(d.T) * d.M * d.N);
  w.coefficient_scratch = carver.take<double>(w.slots.threads * w.slots.doubles_per_thread);
  return w;
}

detail::Dims dims_for(const char* op, const Config& config, int64_t tokens) {
  if (tokens < 0) throw Error(op, "tokens", "expected T >= 0, got " + std::to_string(tokens));
  detail::Dims d = detail::ArgumentChecker(op, config).dims();
  d.T = tokens;
  return d;
}

void check_workspace(const char* op, const Workspace& workspace, int64_t needed,
                     const char* size_function) {
  if (workspace.bytes < needed) {
    throw Error(op, "workspace",
                "expected at least " + std::to_string(needed) + " bytes (" + size_function +
                    "), got " + std::to_string(workspace.bytes));
  }
  if (needed > 0 && workspace.data == nullptr) {
    throw Error(op, "workspace", "expected non-null data for " + std::to_string(needed) + " bytes");
  }
  if (reinterpret_cast<uintptr_t>(workspace.data) % kAlignment != 0) {
    throw Error(op, "workspace", "expected data aligned to 256 bytes");
  }
}

const float* f32(const TensorRef& view) { return static_cast<const float*>(view.data); }
float* f32(const MutableTensorRef& view) { return static_cast<float*>(view.data); }

// The grids of the backward from the coefficients' inputs on, checked together before the
// operation's first launch.
struct TailGrids {
  Grid coefficients, input_grad, weight_grad, weight_grad_finish, term_groups;
};

TailGrids plan_pre_backward_tail(const char* op, const detail::Dims& d,
                                 const PreBackwardScratch& w) {
  return TailGrids{
      checked_grid(op, "backward_coefficients", coefficient_blocks(w.slots), d),
      checked_grid(op, "input_grad", input_grad_blocks(d), d),
      checked_grid(op, "weight_grad", weight_grad_blocks(d), d),
      checked_grid(op, "weight_grad_finish", weight_grad_finish_blocks(d), d),
      checked_grid(op, "term_group_sums", term_group_blocks(d), d),
  };
}

// The backward from the coefficients' inputs (the summed projection partials and dh_pre) on:
// the coefficient backward, dx, then the parameter gradients.
void pre_backward_tail(const Config& config, const detail::Dims& d, const PreBackwardScratch& w,
                       const TailGrids& grids, const ProjectionSplit& split, const float* partials,
                       const float* dh_pre, const TensorRef& dlayer_in, const TensorRef& dx_partial,
                       const TensorRef& dh_post, const TensorRef& dh_res, const TensorRef& x,
                       const Params& params, const MutableTensorRef& dx, const ParamGrads& grads,
                       cudaStream_t stream) {
  launch_backward_coefficients(config, d, split, grids.coefficients, partials, dh_pre, f32(dh_post),
                               f32(dh_res), f32(params.alpha), f32(params.bias), w.token, w.slots,
                               w.coefficient_scratch, stream);
  launch_input_grad(d, grids.input_grad, x, dlayer_in, dx_partial, w.token.h_pre, w.token.x_coef,
                    w.token.dP, f32(params.norm_weight), f32(params.phi), dx, stream);
  launch_weight_grad(d, grids.weight_grad, x, w.token.dP, w.weight_partials, stream);
  // These two run for T = 0 as well: they write the zero gradients.
  launch_weight_grad_finish(d, grids.weight_grad_finish, w.weight_partials, f32(params.norm_weight),
                            f32(params.phi), f32(grads.phi), f32(grads.norm_weight), stream);
  launch_term_sums(d, grids.term_groups, w.token.terms, w.term_group_sums, f32(grads.bias),
                   f32(grads.alpha), stream);
}

template <class Carve>
int64_t bytes_of(const char* op, const Config& config, int64_t tokens, Carve carve) {
  const detail::Dims d = dims_for(op, config, tokens);
  Carver counter(nullptr);
  carve(d, counter);
  return counter.used();
}

// The summed partials [T, N+1] of the tensor-parallel operations, read as one slice.
constexpr ProjectionSplit kSummed{1, 0};

}  // namespace

Grid checked_grid(const char* op, const char* kernel, int64_t blocks, const detail::Dims& d) {
  if (blocks < 0 || blocks > kMaxGridBlocks) {
    throw Error(op, "x",
                "expected a shape whose " + std::string(kernel) + " grid fits in " +
                    std::to_string(kMaxGridBlocks) + " blocks, got T = " + std::to_string(d.T) +
                    ", n = " + std::to_string(d.n) + ", D = " + std::to_string(d.D) + " (" +
                    std::to_string(blocks) + " blocks): split the tokens over several calls");
  }
  return Grid(static_cast<unsigned>(blocks));
}

int64_t pre_forward_workspace_bytes(const Config& config, int64_t tokens) {
  return bytes_of("mhc::cuda::pre_forward_workspace_bytes", config, tokens,
                  [&](const detail::Dims& d, Carver& c) {
                    carve_pre_forward(config, d, kProjection | kCoefficients, c);
                  });
}

int64_t pre_backward_workspace_bytes(const Config& config, int64_t tokens) {
  return bytes_of(
      "mhc::cuda::pre_backward_workspace_bytes", config, tokens,
      [&](const detail::Dims& d, Carver& c) { carve_pre_backward(config, d, true, c); });
}

int64_t pre_forward_partials_workspace_bytes(const Config& config, int64_t tokens) {
  return bytes_of(
      "mhc::cuda::pre_forward_partials_workspace_bytes", config, tokens,
      [&](const detail::Dims& d, Carver& c) { carve_pre_forward(config, d, kProjection, c); });
}

int64_t pre_forward_finish_workspace_bytes(const Config& config, int64_t tokens) {
  return bytes_of(
      "mhc::cuda::pre_forward_finish_workspace_bytes", config, tokens,
      [&](const detail::Dims& d, Carver& c) { carve_pre_forward(config, d, kCoefficients, c); });
}

int64_t pre_backward_finish_workspace_bytes(const Config& config, int64_t tokens) {
  return bytes_of(
      "mhc::cuda::pre_backward_finish_workspace_bytes", config, tokens,
      [&](const detail::Dims& d, Carver& c) { carve_pre_backward(config, d, false, c); });
}

void pre_forward(const Config& config, const TensorRef& x, const Params& params,
                 const PreForwardOutputs& outputs, const Workspace& workspace, Stream stream) {
  const char* op = "mhc::cuda::pre_forward";
  const detail::Dims d = detail::check_pre_forward(op, config, x, params, outputs);
  check_workspace(op, workspace, pre_forward_workspace_bytes(config, d.T),
                  "mhc::cuda::pre_forward_workspace_bytes");
  if (d.T == 0) return;
  Carver carver(workspace.data);
  const PreForwardScratch w = carve_pre_forward(config, d, kProjection | kCoefficients, carver);
  const Grid projection = checked_grid(op, "projection", projection_blocks(d, w.split), d);
  const Grid coefficients =
      checked_grid(op, "forward_coefficients", coefficient_blocks(w.slots), d);
  const Grid apply = checked_grid(op, "pre_apply", token_blocks(d.T), d);
  launch_projection(d, w.split, projection, x, f32(params.norm_weight), f32(params.phi), w.partials,
                    stream);
  launch_forward_coefficients(config, d, w.split, coefficients, w.partials, f32(params.alpha),
                              f32(params.bias), f32(outputs.h_pre), f32(outputs.h_post),
                              f32(outputs.h_res), w.slots, w.coefficient_scratch, stream);
  launch_pre_apply(d, apply, x, f32(outputs.h_pre), outputs.layer_in, stream);
  check_launch(op, "kernels");
}

void post_forward(const Config& config, const TensorRef& x, const TensorRef& layer_out,
                  const TensorRef& h_post, const TensorRef& h_res, const MutableTensorRef& out,
                  Stream stream) {
  const char* op = "mhc::cuda::post_forward";
  const detail::Dims d = detail::check_post_forward(op, config, x, layer_out, h_post, h_res, out);
  if (d.T == 0) return;
  const Grid grid = checked_grid(op, "post_forward", token_blocks(d.T), d);
  launch_post_forward(d, grid, x, layer_out, h_post, h_res, out, stream);
  check_launch(op, "kernels");
}

void post_backward(const Config& config, const TensorRef& g, const TensorRef& x,
                   const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                   const PostBackwardOutputs& outputs, Stream stream) {
  const char* op = "mhc::cuda::post_backward";
  const detail::Dims d =
      detail::check_post_backward(op, config, g, x, layer_out, h_post, h_res, outputs);
  if (d.T == 0) return;
  const Grid grid = checked_grid(op, "post_backward", token_blocks(d.T), d);
  launch_post_backward(d, grid, g, x, layer_out, h_post, h_res, outputs, stream);
  check_launch(op, "kernels");
}

void pre_backward(const Config& config, const TensorRef& dlayer_in, const TensorRef& dx_partial,
                  const TensorRef& dh_post, const TensorRef& dh_res, const TensorRef& x,
                  const Params& params, const MutableTensorRef& dx, const ParamGrads& grads,
                  const Workspace& workspace, Stream stream) {
  const char* op = "mhc::cuda::pre_backward";
  const detail::Dims d = detail::check_pre_backward(op, config, dlayer_in, dx_partial, dh_post,
                                                    dh_res, x, params, dx, grads);
  check_workspace(op, workspace, pre_backward_workspace_bytes(config, d.T),
                  "mhc::cuda::pre_backward_workspace_bytes");
  Carver carver(workspace.data);
  const PreBackwardScratch w = carve_pre_backward(config, d, true, carver);
  const Grid projection = checked_grid(op, "projection", projection_blocks(d, w.split), d);
  const Grid dh_pre = checked_grid(op, "dh_pre", token_blocks(d.T), d);
  const TailGrids tail = plan_pre_backward_tail(op, d, w);
  launch_projection(d, w.split, projection, x, f32(params.norm_weight), f32(params.phi), w.partials,
                    stream);
  launch_dh_pre(d, dh_pre, dlayer_in, x, w.dh_pre, stream);
  pre_backward_tail(config, d, w, tail, w.split, w.partials, w.dh_pre, dlayer_in, dx_partial,
                    dh_post, dh_res, x, params, dx, grads, stream);
  check_launch(op, "kernels");
}

void pre_forward_partials(const Config& config, const TensorRef& x, const TensorRef& norm_weight,
                          const TensorRef& phi, const MutableTensorRef& partials,
                          const Workspace& workspace, Stream stream) {
  const char* op = "mhc::cuda::pre_forward_partials";
  const detail::Dims d =
      detail::check_pre_forward_partials(op, config, x, norm_weight, phi, partials);
  check_workspace(op, workspace, pre_forward_partials_workspace_bytes(config, d.T),
                  "mhc::cuda::pre_forward_partials_workspace_bytes");
  if (d.T == 0) return;
  Carver carver(workspace.data);
  const PreForwardScratch w = carve_pre_forward(config, d, kProjection, carver);
  const Grid projection = checked_grid(op, "projection", projection_blocks(d, w.split), d);
  const Grid sum = checked_grid(op, "sum_slices", sum_slices_blocks(d), d);
  launch_projection(d, w.split, projection, x, f32(norm_weight), f32(phi), w.partials, stream);
  launch_sum_slices(d, w.split, sum, w.partials, f32(partials), stream);
  check_launch(op, "kernels");
}

void pre_forward_finish(const Config& config, const TensorRef& x, const TensorRef& partials,
                        const TensorRef& alpha, const TensorRef& bias,
                        const PreForwardOutputs& outputs, const Workspace& workspace,
                        Stream stream) {
  const char* op = "mhc::cuda::pre_forward_finish";
  const detail::Dims d =
      detail::check_pre_forward_finish(op, config, x, partials, alpha, bias, outputs);
  check_workspace(op, workspace, pre_forward_finish_workspace_bytes(config, d.T),
                  "mhc::cuda::pre_forward_finish_workspace_bytes");
  if (d.T == 0) return;
  Carver carver(workspace.data);
  const PreForwardScratch w = carve_pre_forward(config, d, kCoefficients, carver);
  const Grid coefficients =
      checked_grid(op, "forward_coefficients", coefficient_blocks(w.slots), d);
  const Grid apply = checked_grid(op, "pre_apply", token_blocks(d.T), d);
  launch_forward_coefficients(config, d, kSummed, coefficients, f32(partials), f32(alpha),
                              f32(bias), f32(outputs.h_pre), f32(outputs.h_post),
                              f32(outputs.h_res), w.slots, w.coefficient_scratch, stream);
  launch_pre_apply(d, apply, x, f32(outputs.h_pre), outputs.layer_in, stream);
  check_launch(op, "kernels");
}

void pre_backward_partials(const Config& config, const TensorRef& dlayer_in, const TensorRef& x,
                           const MutableTensorRef& dh_pre, Stream stream) {
  const char* op = "mhc::cuda::pre_backward_partials";
  const detail::Dims d = detail::check_pre_backward_partials(op, config, dlayer_in, x, dh_pre);
  if (d.T == 0) return;
  const Grid grid = checked_grid(op, "dh_pre", token_blocks(d.T), d);
  launch_dh_pre(d, grid, dlayer_in, x, f32(dh_pre), stream);
  check_launch(op, "kernels");
}

void pre_backward_finish(const Config& config, const TensorRef& dlayer_in,
                         const TensorRef& dx_partial, const TensorRef& dh_pre,
                         const TensorRef& dh_post, const TensorRef& dh_res, const TensorRef& x,
                         const TensorRef& partials, const Params& params,
                         const MutableTensorRef& dx, const ParamGrads& grads,
                         const Workspace& workspace, Stream stream) {
  const char* op = "mhc::cuda::pre_backward_finish";
  const detail::Dims d = detail::check_pre_backward_finish(
      op, config, dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, partials, params, dx, grads);
  check_workspace(op, workspace, pre_backward_finish_workspace_bytes(config, d.T),
                  "mhc::cuda::pre_backward_finish_workspace_bytes");
  Carver carver(workspace.data);
  const PreBackwardScratch w = carve_pre_backward(config, d, false, carver);
  const TailGrids tail = plan_pre_backward_tail(op, d, w);
  pre_backward_tail(config, d, w, tail, kSummed, f32(partials), f32(dh_pre), dlayer_in, dx_partial,
                    dh_post, dh_res, x, params, dx, grads, stream);
  check_launch(op, "kernels");
}

bool device_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error for later calls
    return false;
  }
  return count > 0;
}

double copy_bandwidth_gbs(int64_t bytes, int repeats) {
  const char* op = "mhc::cuda::copy_bandwidth_gbs";
  if (bytes < 1) throw Error(op, "bytes", "expected >= 1, got " + std::to_string(bytes));
  if (repeats < 1) throw Error(op, "repeats", "expected >= 1, got " + std::to_string(repeats));
  auto check = [&](cudaError_t status, const char* what) {
    if (status != cudaSuccess) throw Error(op, what, cudaGetErrorString(status));
  };
  void *from = nullptr, *to = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  std::vector<float> times;
  try {
    check(cudaMalloc(&from, static_cast<size_t>(bytes)), "cudaMalloc");
    check(cudaMalloc(&to, static_cast<size_t>(bytes)), "cudaMalloc");
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
    for (int i = -2; i < repeats; ++i) {  // two warm-up copies
      check(cudaEventRecord(start), "cudaEventRecord");
      check(cudaMemcpyAsync(to, from, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice),
            "cudaMemcpyAsync");
      check(cudaEventRecord(stop), "cudaEventRecord");
      check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float ms = 0.0f;
      check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
      if (i >= 0) times.push_back(ms);
    }
  } catch (...) {
    cudaFree(from);
    cudaFree(to);
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
    throw;
  }
  cudaFree(from);
  cudaFree(to);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  const double ms = times[times.size() / 2];
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
}

}  // namespace mhc::cuda
