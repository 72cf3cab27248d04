// Host-side launchers of the CUDA kernels behind mhc/cuda.h. Arguments arrive validated
// (src/core/validate.h) and grids planned (checked_grid, below); each launcher enqueues on
// `stream`, returns at once for T == 0, and leaves error checking to the caller (check_launch
// after the operation's last launch).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../core/validate.h"
#include "mhc/config.h"
#include "mhc/ops.h"

namespace mhc::cuda {

// Grid caps. A launch that would need more blocks starts this many and each block loops
// (grid-stride): the block-per-token kernels (streams.cu) start at most kMaxTokenBlocks blocks,
// the element-wise loops of gemm.cu (sum_slices, weight_grad_finish) at most kMaxStrideBlocks
// blocks of kStrideThreads threads. tests/cpp/cuda_test.cc sizes shapes past both.
inline constexpr int64_t kMaxTokenBlocks = int64_t{1} << 20;
inline constexpr int64_t kMaxStrideBlocks = int64_t{1} << 16;
inline constexpr int64_t kStrideThreads = 256;

// --- launch configuration ---
//
// mhc/cuda.h promises that errors come before anything is enqueued, so an operation computes
// every grid it will launch from the shapes and checks them all (checked_grid) before its first
// launch; the launchers take only a checked Grid, never compute their own. A grid's x extent is
// at most 2^31 - 1 blocks: a larger problem is refused, never truncated.
inline constexpr int64_t kMaxGridBlocks = 0x7fffffff;

// The x extent of a grid that checked_grid accepted.
class Grid {
 public:
  unsigned blocks() const { return blocks_; }

 private:
  explicit Grid(unsigned blocks) : blocks_(blocks) {}
  friend Grid checked_grid(const char* op, const char* kernel, int64_t blocks,
                           const detail::Dims& d);
  unsigned blocks_;
};

// Throws mhc::Error(op, "x", ...) naming the kernel when `blocks` is outside [0, kMaxGridBlocks].
Grid checked_grid(const char* op, const char* kernel, int64_t blocks, const detail::Dims& d);

// Blocks of each launch, from the shapes alone (the kernels' files hold their tile sizes).
int64_t token_blocks(int64_t T);  // streams.cu's block-per-token kernels, capped

// --- streaming kernels (streams.cu) ---
// Each launches token_blocks(T) blocks.
void launch_pre_apply(const detail::Dims& d, Grid grid, const TensorRef& x, const float* h_pre,
                      const MutableTensorRef& layer_in, cudaStream_t stream);
void launch_post_forward(const detail::Dims& d, Grid grid, const TensorRef& x,
                         const TensorRef& layer_out, const TensorRef& h_post,
                         const TensorRef& h_res, const MutableTensorRef& out, cudaStream_t stream);
void launch_post_backward(const detail::Dims& d, Grid grid, const TensorRef& g, const TensorRef& x,
                          const TensorRef& layer_out, const TensorRef& h_post,
                          const TensorRef& h_res, const PostBackwardOutputs& outputs,
                          cudaStream_t stream);
void launch_dh_pre(const detail::Dims& d, Grid grid, const TensorRef& dlayer_in, const TensorRef& x,
                   float* dh_pre, cudaStream_t stream);

// --- the three products with phi (gemm.cu) ---

// How the projection's sum over n*D is split across blocks: slices of `slice_width` columns of
// x (a multiple of the tile depth), `slices` of them. Chosen from the shapes alone, so results do
// not depend on the GPU.
struct ProjectionSplit {
  int64_t slices = 1;
  int64_t slice_width = 0;
};
ProjectionSplit projection_split(const detail::Dims& d);

// partials [slices, T, N+1]: per slice of n*D, P[t, c] without r for c < N, and the sum of
// squares of x at c = N (spec: Forward steps 1-2). Both projection kernels (CUDA cores and tensor
// cores) tile the same way: projection_blocks.
int64_t projection_blocks(const detail::Dims& d, const ProjectionSplit& split);
void launch_projection(const detail::Dims& d, const ProjectionSplit& split, Grid grid,
                       const TensorRef& x, const float* norm_weight, const float* phi,
                       float* partials, cudaStream_t stream);

// partials [T, N+1] = the slices of `sliced` [slices, T, N+1] summed in order (in double).
int64_t sum_slices_blocks(const detail::Dims& d);
void launch_sum_slices(const detail::Dims& d, const ProjectionSplit& split, Grid grid,
                       const float* sliced, float* partials, cudaStream_t stream);

// The tensor-core projection (projection_mma.cu): bf16 x only, opt-in with the environment variable
// MHC_CUDA_TENSOR_CORES=1 (read once) on sm_80 or newer, until it has been verified on a GPU.
// Same split and the same partials as launch_projection, which dispatches to it.
bool tensor_core_projection(DType x_dtype);
void launch_projection_mma(const detail::Dims& d, const ProjectionSplit& split, Grid grid,
                           const TensorRef& x, const float* norm_weight, const float* phi,
                           float* partials, cudaStream_t stream);

// dphi is summed over fixed groups of tokens, then over the groups in order. At most
// kMaxWeightGradGroups groups (their partials are groups * M * N floats of workspace), each a
// multiple of 32 tokens and at least kMinWeightGradTokens.
inline constexpr int64_t kMinWeightGradTokens = 2048;
inline constexpr int64_t kMaxWeightGradGroups = 32;
inline int64_t weight_grad_group_tokens(int64_t T) {
  const int64_t spread = (T + kMaxWeightGradGroups - 1) / kMaxWeightGradGroups;
  const int64_t tokens = spread > kMinWeightGradTokens ? spread : kMinWeightGradTokens;
  return (tokens + 31) / 32 * 32;
}
inline int64_t weight_grad_groups(int64_t T) {
  const int64_t group = weight_grad_group_tokens(T);
  return (T + group - 1) / group;
}

// group_partials [groups, M, N]: sum over the group's tokens of x[t, m] dP[t, c].
int64_t weight_grad_blocks(const detail::Dims& d);
void launch_weight_grad(const detail::Dims& d, Grid grid, const TensorRef& x, const float* dP,
                        float* group_partials, cudaStream_t stream);
// dphi[m, c] = norm_weight[m] G[m, c] and dnorm_weight[m] = sum_c phi[m, c] G[m, c], with G the
// groups' partials summed in order.
int64_t weight_grad_finish_blocks(const detail::Dims& d);
void launch_weight_grad_finish(const detail::Dims& d, Grid grid, const float* group_partials,
                               const float* norm_weight, const float* phi, float* dphi,
                               float* dnorm_weight, cudaStream_t stream);

// dx[t, k*D+d] = dx_partial + h_pre[t,k] dlayer_in[t,d] + x_coef[t] x[t, k*D+d]
//               + sum_c dP[t, c] norm_weight[k*D+d] phi[k*D+d, c]
int64_t input_grad_blocks(const detail::Dims& d);
void launch_input_grad(const detail::Dims& d, Grid grid, const TensorRef& x,
                       const TensorRef& dlayer_in, const TensorRef& dx_partial, const float* h_pre,
                       const float* x_coef, const float* dP, const float* norm_weight,
                       const float* phi, const MutableTensorRef& dx, cudaStream_t stream);

// --- per-token coefficient math (coefficients.cu) ---

// Threads of a coefficient kernel and the doubles of scratch each one owns.
struct CoefficientSlots {
  int64_t threads = 0;
  int64_t doubles_per_thread = 0;
  int64_t bytes() const { return threads * doubles_per_thread * 8; }
};
CoefficientSlots forward_coefficient_slots(const Config& config, int64_t T);
CoefficientSlots backward_coefficient_slots(const Config& config, int64_t T);
// Blocks of either coefficient kernel: one thread per slot.
int64_t coefficient_blocks(const CoefficientSlots& slots);

// From the projection partials: h_pre, h_post, h_res (spec: Forward steps 1, 3-5).
void launch_forward_coefficients(const Config& config, const detail::Dims& d,
                                 const ProjectionSplit& split, Grid grid, const float* partials,
                                 const float* alpha, const float* bias, float* h_pre, float* h_post,
                                 float* h_res, const CoefficientSlots& slots, double* scratch,
                                 cudaStream_t stream);

// Per-token outputs of the coefficient backward.
struct TokenGrads {
  float* dP;      // [T, N]: dL/dP
  float* x_coef;  // [T]: -dr r^3 / M, the coefficient of x in dx
  float* h_pre;   // [T, n]: the recomputed gate, for the pre-apply gradient
  double* terms;  // [T, N+3]: da[c] (the dbias terms) then sum over each group of da Z
};
// From the projection partials and dh_pre, dh_post, dh_res (spec: Backward, gates to dP).
void launch_backward_coefficients(const Config& config, const detail::Dims& d,
                                  const ProjectionSplit& split, Grid grid, const float* partials,
                                  const float* dh_pre, const float* dh_post, const float* dh_res,
                                  const float* alpha, const float* bias, const TokenGrads& out,
                                  const CoefficientSlots& slots, double* scratch,
                                  cudaStream_t stream);

// Tokens per first-level block of the dbias / dalpha reduction.
inline constexpr int64_t kTermTokens = 1024;
// dbias [N] and dalpha [3] from the per-token terms, summed in a fixed order through
// group_sums [ceil(T / kTermTokens), N+3] doubles: one block per group (term_group_blocks),
// then one block for the sums of the groups.
int64_t term_group_blocks(const detail::Dims& d);
void launch_term_sums(const detail::Dims& d, Grid group_grid, const double* terms,
                      double* group_sums, float* dbias, float* dalpha, cudaStream_t stream);

}  // namespace mhc::cuda
