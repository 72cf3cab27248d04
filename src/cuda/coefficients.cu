// Per-token coefficient math on the GPU (spec: Forward steps 1, 3-5; Backward from the gates to
// dP), one thread per token, in double like the CPU backend (src/cpu/coefficients.h says why).
// Each thread's state lives in a Slot of the workspace: runtime n and sinkhorn_iters need
// runtime-sized arrays, and the slot layout keeps a warp's accesses coalesced.
//
// Sinkhorn backward: the forward keeps each step's sums s (n doubles per step) and the softmax;
// walking back, each step's input is rebuilt from its output as X = Y * (s + eps), which is exact
// up to one rounding per step in double. That keeps the history at (2*iters - 1) * n doubles per
// token instead of the CPU's full matrices.
//
// STATUS: compiled in CI; not yet run on a GPU.
#include <algorithm>

#include "common.cuh"
#include "kernels.h"

namespace mhc::cuda {

namespace {

constexpr int kCoefficientThreads = 128;
// Scratch a coefficient kernel may use; its threads loop over the tokens when T needs more. At
// least 32 threads (one warp), so n = 16 with 10000 Sinkhorn iterations needs about 80 MB.
constexpr int64_t kScratchBudget = int64_t{64} << 20;

struct Shape {
  int n, N, R;
  int steps;  // Sinkhorn normalization steps: 2 * iters - 1
  bool sinkhorn;
  double sinkhorn_eps, pre_eps, post_scale, rms_eps;
  int64_t M_full;  // values one token's RMS averages over
};

Shape shape_of(const Config& config) {
  Shape s;
  s.n = static_cast<int>(config.n);
  s.N = static_cast<int>(projection_width(config));
  s.R = static_cast<int>(residual_logits(config));
  s.steps = static_cast<int>(2 * config.sinkhorn_iters - 1);
  s.sinkhorn = config.mix == Mix::sinkhorn;
  s.sinkhorn_eps = config.sinkhorn_eps;
  s.pre_eps = config.pre_eps;
  s.post_scale = config.post_scale;
  s.rms_eps = config.rms_eps;
  s.M_full = flat_width(config);
  return s;
}

__device__ double sigmoid(double v) { return 1.0 / (1.0 + exp(-v)); }
__device__ int group_of(int column, int n) { return column < n ? 0 : (column < 2 * n ? 1 : 2); }

// softmax of `count` values of `in` into `out` (may be the same slot).
__device__ void softmax(Slot in, int count, Slot out) {
  double largest = in[0];
  for (int k = 1; k < count; ++k) largest = in[k] > largest ? in[k] : largest;
  double total = 0.0;
  for (int k = 0; k < count; ++k) {
    out[k] = exp(in[k] - largest);
    total += out[k];
  }
  const double scale = 1.0 / total;
  for (int k = 0; k < count; ++k) out[k] *= scale;
}

// perm_p(i) for the p-th permutation of range(n) in lexicographic order (mhc::permutation).
__device__ void permutation_targets(int n, int64_t p, int* targets) {
  int unused[kMaxPermutationStreams];
  int64_t block = 1;
  for (int k = 0; k < n; ++k) {
    unused[k] = k;
    block *= k + 1;
  }
  for (int remaining = n, i = 0; remaining > 0; --remaining, ++i) {
    block /= remaining;
    const int index = static_cast<int>(p / block);
    p %= block;
    targets[i] = unused[index];
    for (int k = index; k < remaining - 1; ++k) unused[k] = unused[k + 1];
  }
}

// The projection partials of token t summed over the slices in order: P[c] for c < N, the sum
// of squares at c = N.
__device__ double summed_partial(const float* partials, int64_t slices, int64_t T, int N, int64_t t,
                                 int c) {
  double total = 0.0;
  for (int64_t s = 0; s < slices; ++s) total += partials[(s * T + t) * (N + 1) + c];
  return total;
}

// Logits a [N] of token t and its r (spec: Forward steps 1-3); P [N] is kept when non-null.
__device__ double token_logits(const Shape& s, const float* partials, int64_t slices, int64_t T,
                               int64_t t, const float* alpha, const float* bias, Slot logits,
                               Slot* P) {
  const double sum_of_squares = summed_partial(partials, slices, T, s.N, t, s.N);
  const double r = 1.0 / sqrt(sum_of_squares / static_cast<double>(s.M_full) + s.rms_eps);
  for (int c = 0; c < s.N; ++c) {
    const double p = summed_partial(partials, slices, T, s.N, t, c);
    if (P != nullptr) (*P)[c] = p;
    logits[c] = double{alpha[group_of(c, s.n)]} * (r * p) + bias[c];
  }
  return r;
}

// Sinkhorn from the n*n residual logits into `matrix` (spec: step 5). `sums` holds n doubles,
// or n per step when `keep_history`; `softmax_copy` receives the row softmax when non-null.
__device__ void sinkhorn_forward(const Shape& s, Slot logits, Slot matrix, Slot sums,
                                 bool keep_history, Slot* softmax_copy) {
  const int n = s.n;
  for (int i = 0; i < n; ++i) softmax(logits.at(i * n), n, matrix.at(i * n));
  for (int e = 0; e < n * n; ++e) {
    if (softmax_copy != nullptr) (*softmax_copy)[e] = matrix[e];
    matrix[e] += s.sinkhorn_eps;
  }
  for (int step = 0; step < s.steps; ++step) {
    const bool over_columns = step % 2 == 0;
    Slot step_sums = keep_history ? sums.at(step * n) : sums;
    for (int k = 0; k < n; ++k) step_sums[k] = 0.0;
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) step_sums[over_columns ? j : i] += matrix[i * n + j];
    }
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j)
        matrix[i * n + j] /= step_sums[over_columns ? j : i] + s.sinkhorn_eps;
    }
  }
}

// Exact backward through every Sinkhorn step. In: `matrix` = the last step's result, `grad` =
// dH_res; out: dlogits [n*n]. `matrix` and `grad` are overwritten.
__device__ void sinkhorn_backward(const Shape& s, Slot softmax_rows, Slot matrix, Slot sums,
                                  Slot grad, Slot dots, Slot dlogits) {
  const int n = s.n;
  const double eps = s.sinkhorn_eps;
  for (int step = s.steps - 1; step >= 0; --step) {
    const bool over_columns = step % 2 == 0;
    Slot step_sums = sums.at(step * n);
    for (int k = 0; k < n; ++k) dots[k] = 0.0;
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) dots[over_columns ? j : i] += grad[i * n + j] * matrix[i * n + j];
    }
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        const int k = over_columns ? j : i;
        grad[i * n + j] = (grad[i * n + j] - dots[k]) / (step_sums[k] + eps);
        if (step > 0) matrix[i * n + j] *= step_sums[k] + eps;  // this step's input
      }
    }
  }
  for (int i = 0; i < n; ++i) {
    double dot = 0.0;
    for (int k = 0; k < n; ++k) dot += grad[i * n + k] * softmax_rows[i * n + k];
    for (int j = 0; j < n; ++j) {
      dlogits[i * n + j] = softmax_rows[i * n + j] * (grad[i * n + j] - dot);
    }
  }
}

// H_res as a mix of permutation matrices: weights = softmax of the R logits (spec: step 5).
__device__ void permutations_forward(const Shape& s, Slot logits, Slot weights, Slot matrix) {
  const int n = s.n;
  softmax(logits, s.R, weights);
  for (int e = 0; e < n * n; ++e) matrix[e] = 0.0;
  int targets[kMaxPermutationStreams];
  for (int p = 0; p < s.R; ++p) {
    permutation_targets(n, p, targets);
    for (int i = 0; i < n; ++i) matrix[i * n + targets[i]] += weights[p];
  }
}

__device__ void permutations_backward(const Shape& s, Slot weights, const float* dh_res,
                                      Slot dweights, Slot dlogits) {
  const int n = s.n;
  int targets[kMaxPermutationStreams];
  double weighted = 0.0;
  for (int p = 0; p < s.R; ++p) {
    permutation_targets(n, p, targets);
    double total = 0.0;
    for (int i = 0; i < n; ++i) total += dh_res[i * n + targets[i]];
    dweights[p] = total;
    weighted += weights[p] * total;
  }
  for (int p = 0; p < s.R; ++p) dlogits[p] = weights[p] * (dweights[p] - weighted);
}

__host__ __device__ int64_t matrix_or_weights(const Shape& s) {
  return int64_t{s.n} * s.n > s.R ? int64_t{s.n} * s.n : int64_t{s.R};
}

// Forward slot: logits [N] | matrix [n*n] | sums [n] | weights [R] (permutations)
int64_t forward_doubles(const Shape& s) {
  return s.N + int64_t{s.n} * s.n + s.n + (s.sinkhorn ? 0 : s.R);
}

// Backward slot: logits [N] | P [N] | da [N] | softmax or weights [max(n*n, R)] | matrix [n*n] |
// grad or dweights [max(n*n, R)] | dots [n] | sums [steps * n] (Sinkhorn)
int64_t backward_doubles(const Shape& s) {
  return 3 * int64_t{s.N} + 2 * matrix_or_weights(s) + int64_t{s.n} * s.n + s.n +
         (s.sinkhorn ? int64_t{s.steps} * s.n : 0);
}

CoefficientSlots slots_for(int64_t T, int64_t doubles) {
  CoefficientSlots slots;
  slots.doubles_per_thread = doubles;
  const int64_t capacity = std::clamp<int64_t>(kScratchBudget / (doubles * 8), 32, 65536);
  slots.threads = std::min(T, capacity);
  return slots;
}

__global__ void __launch_bounds__(kCoefficientThreads)
    forward_coefficients_kernel(Shape s, const float* __restrict__ partials, int64_t slices,
                                int64_t T, const float* __restrict__ alpha,
                                const float* __restrict__ bias, float* __restrict__ h_pre,
                                float* __restrict__ h_post, float* __restrict__ h_res,
                                double* scratch, int64_t threads) {
  const int64_t thread = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (thread >= threads) return;
  const Slot slot{scratch + thread, threads};
  const int n = s.n;
  Slot logits = slot, matrix = slot.at(s.N), sums = slot.at(s.N + n * n);
  Slot weights = slot.at(s.N + n * n + n);
  for (int64_t t = thread; t < T; t += threads) {
    token_logits(s, partials, slices, T, t, alpha, bias, logits, nullptr);
    for (int k = 0; k < n; ++k) {
      h_pre[t * n + k] = static_cast<float>(sigmoid(logits[k]) + s.pre_eps);
      h_post[t * n + k] = static_cast<float>(s.post_scale * sigmoid(logits[n + k]));
    }
    if (s.sinkhorn) {
      sinkhorn_forward(s, logits.at(2 * n), matrix, sums, false, nullptr);
    } else {
      permutations_forward(s, logits.at(2 * n), weights, matrix);
    }
    for (int e = 0; e < n * n; ++e) h_res[t * n * n + e] = static_cast<float>(matrix[e]);
  }
}

__global__ void __launch_bounds__(kCoefficientThreads)
    backward_coefficients_kernel(Shape s, const float* __restrict__ partials, int64_t slices,
                                 int64_t T, const float* __restrict__ dh_pre,
                                 const float* __restrict__ dh_post,
                                 const float* __restrict__ dh_res, const float* __restrict__ alpha,
                                 const float* __restrict__ bias, TokenGrads out, double* scratch,
                                 int64_t threads) {
  const int64_t thread = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (thread >= threads) return;
  const Slot slot{scratch + thread, threads};
  const int n = s.n, N = s.N;
  const int64_t wide = matrix_or_weights(s);
  Slot logits = slot, P = slot.at(N), da = slot.at(2 * N);
  Slot soft = slot.at(3 * N), matrix = slot.at(3 * N + wide);
  Slot grad = slot.at(3 * N + wide + n * n), dots = slot.at(3 * N + 2 * wide + n * n);
  Slot sums = slot.at(3 * N + 2 * wide + n * n + n);
  for (int64_t t = thread; t < T; t += threads) {
    const double r = token_logits(s, partials, slices, T, t, alpha, bias, logits, &P);
    for (int k = 0; k < n; ++k) {
      const double s_pre = sigmoid(logits[k]);
      out.h_pre[t * n + k] = static_cast<float>(s_pre + s.pre_eps);
      da[k] = double{dh_pre[t * n + k]} * s_pre * (1.0 - s_pre);
      const double s_post = sigmoid(logits[n + k]);
      da[n + k] = double{dh_post[t * n + k]} * s.post_scale * s_post * (1.0 - s_post);
    }
    if (s.sinkhorn) {
      sinkhorn_forward(s, logits.at(2 * n), matrix, sums, true, &soft);
      for (int e = 0; e < n * n; ++e) grad[e] = dh_res[t * n * n + e];
      sinkhorn_backward(s, soft, matrix, sums, grad, dots, da.at(2 * n));
    } else {
      softmax(logits.at(2 * n), s.R, soft);
      permutations_backward(s, soft, dh_res + t * n * n, grad, da.at(2 * n));
    }
    double dalpha[3] = {0.0, 0.0, 0.0};
    double dr = 0.0;
    double* terms = out.terms + t * (N + 3);
    for (int c = 0; c < N; ++c) {
      const int group = group_of(c, n);
      const double dac = da[c];
      terms[c] = dac;
      dalpha[group] += dac * (r * P[c]);
      const double dZ = double{alpha[group]} * dac;
      dr += dZ * P[c];
      out.dP[t * N + c] = static_cast<float>(r * dZ);
    }
    for (int g = 0; g < 3; ++g) terms[N + g] = dalpha[g];
    out.x_coef[t] = static_cast<float>(-dr * r * r * r / static_cast<double>(s.M_full));
  }
}

// Deterministic double sum of one value per thread over the block, returned on thread 0.
__device__ double block_sum_double(double value, double* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_down_sync(0xffffffffu, value, offset);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kWarps; ++w) total += scratch[w];
  }
  __syncthreads();
  return total;
}

__global__ void __launch_bounds__(kBlockThreads)
    term_group_sums_kernel(const double* __restrict__ terms, int64_t T, int columns,
                           double* __restrict__ group_sums) {
  __shared__ double scratch[kWarps];
  const int64_t group = blockIdx.x;
  const int64_t t_begin = group * kTermTokens;
  const int64_t t_end = min(T, t_begin + kTermTokens);
  for (int c = 0; c < columns; ++c) {
    double value = 0.0;
    for (int64_t t = t_begin + threadIdx.x; t < t_end; t += blockDim.x) {
      value += terms[t * columns + c];
    }
    const double total = block_sum_double(value, scratch);
    if (threadIdx.x == 0) group_sums[group * columns + c] = total;
  }
}

__global__ void term_finish_kernel(const double* __restrict__ group_sums, int64_t groups, int N,
                                   float* __restrict__ dbias, float* __restrict__ dalpha) {
  for (int c = threadIdx.x; c < N + 3; c += blockDim.x) {
    double total = 0.0;
    for (int64_t g = 0; g < groups; ++g) total += group_sums[g * (N + 3) + c];
    if (c < N) {
      dbias[c] = static_cast<float>(total);
    } else {
      dalpha[c - N] = static_cast<float>(total);
    }
  }
}

}  // namespace

CoefficientSlots forward_coefficient_slots(const Config& config, int64_t T) {
  return slots_for(T, forward_doubles(shape_of(config)));
}

CoefficientSlots backward_coefficient_slots(const Config& config, int64_t T) {
  return slots_for(T, backward_doubles(shape_of(config)));
}

int64_t coefficient_blocks(const CoefficientSlots& slots) {
  return ceil_div(slots.threads, kCoefficientThreads);
}

void launch_forward_coefficients(const Config& config, const detail::Dims& d,
                                 const ProjectionSplit& split, Grid grid, const float* partials,
                                 const float* alpha, const float* bias, float* h_pre, float* h_post,
                                 float* h_res, const CoefficientSlots& slots, double* scratch,
                                 cudaStream_t stream) {
  if (d.T == 0) return;
  forward_coefficients_kernel<<<grid.blocks(), kCoefficientThreads, 0, stream>>>(
      shape_of(config), partials, split.slices, d.T, alpha, bias, h_pre, h_post, h_res, scratch,
      slots.threads);
}

void launch_backward_coefficients(const Config& config, const detail::Dims& d,
                                  const ProjectionSplit& split, Grid grid, const float* partials,
                                  const float* dh_pre, const float* dh_post, const float* dh_res,
                                  const float* alpha, const float* bias, const TokenGrads& out,
                                  const CoefficientSlots& slots, double* scratch,
                                  cudaStream_t stream) {
  if (d.T == 0) return;
  backward_coefficients_kernel<<<grid.blocks(), kCoefficientThreads, 0, stream>>>(
      shape_of(config), partials, split.slices, d.T, dh_pre, dh_post, dh_res, alpha, bias, out,
      scratch, slots.threads);
}

int64_t term_group_blocks(const detail::Dims& d) { return ceil_div(d.T, kTermTokens); }

void launch_term_sums(const detail::Dims& d, Grid group_grid, const double* terms,
                      double* group_sums, float* dbias, float* dalpha, cudaStream_t stream) {
  const int columns = static_cast<int>(d.N + 3);
  if (group_grid.blocks() > 0) {
    term_group_sums_kernel<<<group_grid.blocks(), kBlockThreads, 0, stream>>>(terms, d.T, columns,
                                                                              group_sums);
  }
  term_finish_kernel<<<1, kBlockThreads, 0, stream>>>(group_sums, group_grid.blocks(),
                                                      static_cast<int>(d.N), dbias, dalpha);
}

}  // namespace mhc::cuda
