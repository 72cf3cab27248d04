// The three products with phi, on CUDA cores: the projection x (nw * phi), its weight gradient
// x^T dP and its input gradient dP (nw * phi)^T. All three are skinny (N = 2n + R columns, 24 at
// n = 4) and share one shared-memory tile scheme: 64 x 32 outputs per block of 256 threads, 4 x 2
// per thread, depth 32 per step.
//
// Precision: f32 products summed in f32 over one 32-deep step, then the steps in double, so a
// block's sum over thousands of terms keeps f32 accuracy; slices and token groups are summed later
// in double (coefficients.cu, launch_weight_grad_finish).
//
// STATUS: compiled in CI; not yet run on a GPU. Tensor cores (mma.sync / wgmma) are the next
// step once these have been verified and measured on a device.
#include <algorithm>

#include "common.cuh"
#include "kernels.h"

namespace mhc::cuda {

namespace {

constexpr int kRows = 64;   // output rows per block
constexpr int kCols = 32;   // output columns per block
constexpr int kDepth = 32;  // summed index per step

struct Tiles {
  float a[kDepth][kRows + 4];  // a[k][row]; rows padded, keeping 16-byte alignment
  float b[kDepth][kCols];      // b[k][col]
};

// acc[i][j] += sum_k a[k][4 ty + i] b[k][2 tx + j] with tx = thread % 16, ty = thread / 16.
__device__ __forceinline__ void multiply(const Tiles& s, float (&acc)[4][2]) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll 8
  for (int k = 0; k < kDepth; ++k) {
    const float4 a = *reinterpret_cast<const float4*>(&s.a[k][ty * 4]);
    const float2 b = *reinterpret_cast<const float2*>(&s.b[k][tx * 2]);
    const float av[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[i][0] = fmaf(av[i], b.x, acc[i][0]);
      acc[i][1] = fmaf(av[i], b.y, acc[i][1]);
    }
  }
}

// total += acc, then acc = 0: one step's f32 sums folded into the double totals.
__device__ __forceinline__ void fold(float (&acc)[4][2], double (&total)[4][2]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      total[i][j] += acc[i][j];
      acc[i][j] = 0.0f;
    }
  }
}

__device__ __forceinline__ int out_row(int i) { return (threadIdx.x / 16) * 4 + i; }
__device__ __forceinline__ int out_col(int j) { return (threadIdx.x % 16) * 2 + j; }

template <class X>
__global__ void __launch_bounds__(kBlockThreads)
    projection_kernel(const X* __restrict__ x, const float* __restrict__ norm_weight,
                      const float* __restrict__ phi, int64_t T, int64_t M, int N,
                      int64_t slice_width, int64_t token_tiles, int64_t col_tiles,
                      float* __restrict__ partials) {
  __shared__ __align__(16) Tiles s;
  const ProjectionTile tile = projection_tile(kRows, kCols, token_tiles, col_tiles, slice_width, M);
  const int64_t t0 = tile.t0, c0 = tile.c0, k_begin = tile.k_begin, k_end = tile.k_end;

  const int tid = threadIdx.x;
  const int a_row = tid / 4, a_k = (tid % 4) * 8;  // 8 consecutive x values of one token
  const int b_k = tid / 8, b_c = (tid % 8) * 4;    // 4 consecutive phi values of one row
  const int64_t t_load = t0 + a_row;
  float acc[4][2] = {};
  double total[4][2] = {};
  double squares = 0.0;
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kDepth) {
    float step_squares = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t k = k0 + a_k + j;
      const float v = t_load < T && k < k_end ? to_f32(x[t_load * M + k]) : 0.0f;
      step_squares = fmaf(v, v, step_squares);
      s.a[a_k + j][a_row] = v;
    }
    squares += step_squares;
    const int64_t kb = k0 + b_k;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t c = c0 + b_c + j;
      s.b[b_k][b_c + j] = kb < k_end && c < N ? norm_weight[kb] * phi[kb * N + c] : 0.0f;
    }
    __syncthreads();
    multiply(s, acc);
    fold(acc, total);
    __syncthreads();
  }
  // The four threads of a token hold its squares: a butterfly gives all four the same sum.
  squares += __shfl_xor_sync(0xffffffffu, squares, 1);
  squares += __shfl_xor_sync(0xffffffffu, squares, 2);

  float* out = partials + tile.slice * T * (N + 1);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t t = t0 + out_row(i);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int64_t c = c0 + out_col(j);
      if (t < T && c < N) out[t * (N + 1) + c] = static_cast<float>(total[i][j]);
    }
  }
  if (tile.writes_squares && tid % 4 == 0 && t_load < T) {
    out[t_load * (N + 1) + N] = static_cast<float>(squares);
  }
}

template <class X>
__global__ void __launch_bounds__(kBlockThreads)
    weight_grad_kernel(const X* __restrict__ x, const float* __restrict__ dP, int64_t T, int64_t M,
                       int N, int64_t group_tokens, int64_t m_tiles, int64_t col_tiles,
                       float* __restrict__ group_partials) {
  __shared__ __align__(16) Tiles s;
  int64_t block = blockIdx.x;
  const int64_t tile_m = block % m_tiles;
  block /= m_tiles;
  const int64_t tile_c = block % col_tiles;
  const int64_t group = block / col_tiles;
  const int64_t m0 = tile_m * kRows, c0 = tile_c * kCols;
  const int64_t t_begin = group * group_tokens;
  const int64_t t_end = min(T, t_begin + group_tokens);

  const int tid = threadIdx.x;
  const int a_k = tid / 8, a_m = (tid % 8) * 8;  // 8 consecutive x values of one token
  const int b_k = tid / 8, b_c = (tid % 8) * 4;  // 4 consecutive dP values of one token
  float acc[4][2] = {};
  double total[4][2] = {};
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kDepth) {
    const int64_t ta = t0 + a_k;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t m = m0 + a_m + j;
      s.a[a_k][a_m + j] = ta < t_end && m < M ? to_f32(x[ta * M + m]) : 0.0f;
    }
    const int64_t tb = t0 + b_k;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t c = c0 + b_c + j;
      s.b[b_k][b_c + j] = tb < t_end && c < N ? dP[tb * N + c] : 0.0f;
    }
    __syncthreads();
    multiply(s, acc);
    fold(acc, total);
    __syncthreads();
  }
  float* out = group_partials + group * M * N;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t m = m0 + out_row(i);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int64_t c = c0 + out_col(j);
      if (m < M && c < N) out[m * N + c] = static_cast<float>(total[i][j]);
    }
  }
}

__global__ void __launch_bounds__(kBlockThreads)
    weight_grad_finish_kernel(const float* __restrict__ group_partials, int64_t groups, int64_t M,
                              int N, const float* __restrict__ norm_weight,
                              const float* __restrict__ phi, float* __restrict__ dphi,
                              float* __restrict__ dnorm_weight) {
  for (int64_t m = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; m < M;
       m += int64_t{gridDim.x} * blockDim.x) {
    double dnw = 0.0;
    for (int c = 0; c < N; ++c) {
      double G = 0.0;
      for (int64_t z = 0; z < groups; ++z) G += group_partials[(z * M + m) * N + c];
      dphi[m * N + c] = static_cast<float>(double{norm_weight[m]} * G);
      dnw += double{phi[m * N + c]} * G;
    }
    dnorm_weight[m] = static_cast<float>(dnw);
  }
}

template <class X>
__global__ void __launch_bounds__(kBlockThreads)
    input_grad_kernel(const X* __restrict__ x, const X* __restrict__ dlayer_in,
                      const X* __restrict__ dx_partial, const float* __restrict__ h_pre,
                      const float* __restrict__ x_coef, const float* __restrict__ dP,
                      const float* __restrict__ norm_weight, const float* __restrict__ phi,
                      X* __restrict__ dx, int64_t T, int n, int64_t D, int N, int64_t token_tiles) {
  __shared__ __align__(16) Tiles s;
  const int64_t M = n * D;
  const int64_t tile_t = blockIdx.x % token_tiles;
  const int64_t tile_m = blockIdx.x / token_tiles;
  const int64_t t0 = tile_t * kRows, m0 = tile_m * kCols;

  const int tid = threadIdx.x;
  const int a_row = tid / 4, a_k = (tid % 4) * 8;  // 8 consecutive dP values of one token
  const int b_col = tid / 8, b_k = (tid % 8) * 4;  // 4 consecutive phi values of one row
  const int64_t ta = t0 + a_row;
  const int64_t mb = m0 + b_col;
  const float nw = mb < M ? norm_weight[mb] : 0.0f;
  float acc[4][2] = {};
  for (int c0 = 0; c0 < N; c0 += kDepth) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = c0 + a_k + j;
      s.a[a_k + j][a_row] = ta < T && c < N ? dP[ta * N + c] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = c0 + b_k + j;
      s.b[b_k + j][b_col] = mb < M && c < N ? nw * phi[mb * N + c] : 0.0f;
    }
    __syncthreads();
    multiply(s, acc);
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t t = t0 + out_row(i);
    if (t >= T) continue;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int64_t m = m0 + out_col(j);
      if (m >= M) continue;
      const int64_t k = m / D, d = m - k * D;
      const int64_t at = t * M + m;
      const float value = to_f32(dx_partial[at]) + h_pre[t * n + k] * to_f32(dlayer_in[t * D + d]) +
                          x_coef[t] * to_f32(x[at]) + acc[i][j];
      dx[at] = from_f32<X>(value);
    }
  }
}

__global__ void __launch_bounds__(kBlockThreads)
    sum_slices_kernel(const float* __restrict__ sliced, int64_t slices, int64_t count,
                      float* __restrict__ partials) {
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < count;
       e += int64_t{gridDim.x} * blockDim.x) {
    double total = 0.0;
    for (int64_t s = 0; s < slices; ++s) total += sliced[s * count + e];
    partials[e] = static_cast<float>(total);
  }
}

}  // namespace

ProjectionSplit projection_split(const detail::Dims& d) {
  // Enough blocks to fill a large GPU several times over; a constant, not the device's SM count,
  // so the summation order (and the bits) are the same on every device.
  constexpr int64_t kTargetBlocks = 1024;
  constexpr int64_t kMaxSlices = 128;
  const int64_t depth_steps = std::max<int64_t>(1, ceil_div(d.M, kDepth));
  const int64_t tiles = std::max<int64_t>(1, ceil_div(d.T, kRows) * ceil_div(d.N, kCols));
  const int64_t wanted =
      std::clamp<int64_t>(ceil_div(kTargetBlocks, tiles), 1, std::min(depth_steps, kMaxSlices));
  ProjectionSplit split;
  split.slice_width = ceil_div(depth_steps, wanted) * kDepth;
  split.slices = ceil_div(std::max<int64_t>(d.M, 1), split.slice_width);
  return split;
}

int64_t projection_blocks(const detail::Dims& d, const ProjectionSplit& split) {
  return ceil_div(d.T, kRows) * ceil_div(d.N, kCols) * split.slices;
}

int64_t sum_slices_blocks(const detail::Dims& d) {
  return std::min<int64_t>(ceil_div(d.T * (d.N + 1), kBlockThreads), kMaxStrideBlocks);
}

int64_t weight_grad_blocks(const detail::Dims& d) {
  return ceil_div(d.M, kRows) * ceil_div(d.N, kCols) * weight_grad_groups(d.T);
}

int64_t weight_grad_finish_blocks(const detail::Dims& d) {
  return std::min<int64_t>(ceil_div(d.M, kBlockThreads), kMaxStrideBlocks);
}

int64_t input_grad_blocks(const detail::Dims& d) {
  return ceil_div(d.T, kRows) * ceil_div(d.M, kCols);
}

void launch_projection(const detail::Dims& d, const ProjectionSplit& split, Grid grid,
                       const TensorRef& x, const float* norm_weight, const float* phi,
                       float* partials, cudaStream_t stream) {
  if (d.T == 0) return;
  if (tensor_core_projection(x.dtype)) {
    launch_projection_mma(d, split, grid, x, norm_weight, phi, partials, stream);
    return;
  }
  const int64_t token_tiles = ceil_div(d.T, kRows), col_tiles = ceil_div(d.N, kCols);
  with_device_type(x.dtype, [&](auto x_type) {
    using X = decltype(x_type);
    projection_kernel<X><<<grid.blocks(), kBlockThreads, 0, stream>>>(
        static_cast<const X*>(x.data), norm_weight, phi, d.T, d.M, static_cast<int>(d.N),
        split.slice_width, token_tiles, col_tiles, partials);
  });
}

void launch_sum_slices(const detail::Dims& d, const ProjectionSplit& split, Grid grid,
                       const float* sliced, float* partials, cudaStream_t stream) {
  const int64_t count = d.T * (d.N + 1);
  if (count == 0) return;
  sum_slices_kernel<<<grid.blocks(), kBlockThreads, 0, stream>>>(sliced, split.slices, count,
                                                                 partials);
}

void launch_weight_grad(const detail::Dims& d, Grid grid, const TensorRef& x, const float* dP,
                        float* group_partials, cudaStream_t stream) {
  if (d.T == 0) return;
  const int64_t m_tiles = ceil_div(d.M, kRows), col_tiles = ceil_div(d.N, kCols);
  with_device_type(x.dtype, [&](auto x_type) {
    using X = decltype(x_type);
    weight_grad_kernel<X><<<grid.blocks(), kBlockThreads, 0, stream>>>(
        static_cast<const X*>(x.data), dP, d.T, d.M, static_cast<int>(d.N),
        weight_grad_group_tokens(d.T), m_tiles, col_tiles, group_partials);
  });
}

void launch_weight_grad_finish(const detail::Dims& d, Grid grid, const float* group_partials,
                               const float* norm_weight, const float* phi, float* dphi,
                               float* dnorm_weight, cudaStream_t stream) {
  if (d.M == 0) return;
  weight_grad_finish_kernel<<<grid.blocks(), kBlockThreads, 0, stream>>>(
      group_partials, weight_grad_groups(d.T), d.M, static_cast<int>(d.N), norm_weight, phi, dphi,
      dnorm_weight);
}

void launch_input_grad(const detail::Dims& d, Grid grid, const TensorRef& x,
                       const TensorRef& dlayer_in, const TensorRef& dx_partial, const float* h_pre,
                       const float* x_coef, const float* dP, const float* norm_weight,
                       const float* phi, const MutableTensorRef& dx, cudaStream_t stream) {
  if (d.T == 0) return;
  const int64_t token_tiles = ceil_div(d.T, kRows);
  with_device_type(x.dtype, [&](auto x_type) {
    using X = decltype(x_type);
    input_grad_kernel<X><<<grid.blocks(), kBlockThreads, 0, stream>>>(
        static_cast<const X*>(x.data), static_cast<const X*>(dlayer_in.data),
        static_cast<const X*>(dx_partial.data), h_pre, x_coef, dP, norm_weight, phi,
        static_cast<X*>(dx.data), d.T, static_cast<int>(d.n), d.D, static_cast<int>(d.N),
        token_tiles);
  });
}

}  // namespace mhc::cuda
