// The projection of bf16 x on tensor cores (mma.sync m16n8k16, sm_80 and newer), opt-in with
// MHC_CUDA_TENSOR_CORES=1 until it has run on a GPU. Same partials as projection_kernel in
// gemm.cu: [slices, T, N+1], P without r, the sum of squares at column N.
//
// Precision: x is bf16, exact as an MMA operand. W = norm_weight * phi (f32) is split into three
// bf16 terms w0 + w1 + w2 (each the rounding of what the previous ones left), which carry its 24
// bits; the three products are accumulated by the MMA in f32, and each 32-deep step's sums are
// folded into double as in gemm.cu. The tensor cores' internal f32 accumulation is not IEEE
// round-to-nearest, so bits differ from the CUDA-core path (and may between sm_80 and sm_90); run
// to run they are the same. An infinite x against a W term of 0 gives NaN here (Inf x 0) where the
// CUDA-core kernel gives Inf; the outputs downstream are NaN either way.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16 operands), g = lane / 4, q = lane % 4:
//   A 16x16 row-major: {A[g][2q..2q+1]}, {A[g+8][2q..]}, {A[g][2q+8..]}, {A[g+8][2q+8..]}
//   B 16x8 ("col"):    {B[2q..2q+1][g]}, {B[2q+8..2q+9][g]}
//   C 16x8 f32:        C[g][2q], C[g][2q+1], C[g+8][2q], C[g+8][2q+1]
//
// STATUS: compiled in CI; NOT yet run on a GPU, and off by default.
#include <cstdlib>
#include <cstring>

#include "common.cuh"
#include "kernels.h"

namespace mhc::cuda {

namespace {

constexpr int kRows = 64;   // tokens per block: 4 warps x 16
constexpr int kCols = 32;   // columns per block: 4 MMA tiles of 8
constexpr int kDepth = 32;  // two MMA k-steps of 16
constexpr int kThreads = 128;
constexpr int kPad = 8;    // bf16 elements of padding per shared row (bank spread, 16-byte rows)
constexpr int kTerms = 3;  // bf16 terms of W

struct MmaTiles {
  __nv_bfloat16 x[kRows][kDepth + kPad];          // x[token][k]
  __nv_bfloat16 w[kTerms][kCols][kDepth + kPad];  // w[term][column][k]: B read as columns
};

__device__ __forceinline__ uint32_t pair_at(const __nv_bfloat16* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // the host never launches this kernel for an architecture without bf16 MMA
#endif
}

__global__ void __launch_bounds__(kThreads)
    projection_mma_kernel(const __nv_bfloat16* __restrict__ x,
                          const float* __restrict__ norm_weight, const float* __restrict__ phi,
                          int64_t T, int64_t M, int N, int64_t slice_width, int64_t token_tiles,
                          int64_t col_tiles, float* __restrict__ partials) {
  __shared__ __align__(16) MmaTiles s;
  const ProjectionTile tile = projection_tile(kRows, kCols, token_tiles, col_tiles, slice_width, M);
  const int64_t t0 = tile.t0, c0 = tile.c0, k_begin = tile.k_begin, k_end = tile.k_end;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, q = lane % 4;
  const int x_row = tid / 2, x_k = (tid % 2) * 16;  // 16 consecutive x values of one token
  const int w_k = tid / 4, w_c = (tid % 4) * 8;     // 8 consecutive phi values of one row
  const int64_t t_load = t0 + x_row;

  float acc[4][4] = {};  // [column tile][fragment]
  double total[4][4] = {};
  double squares = 0.0;
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kDepth) {
    float step_squares = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int64_t k = k0 + x_k + j;
      const __nv_bfloat16 v =
          t_load < T && k < k_end ? x[t_load * M + k] : __float2bfloat16_rn(0.0f);
      const float f = __bfloat162float(v);
      step_squares = fmaf(f, f, step_squares);
      s.x[x_row][x_k + j] = v;
    }
    squares += step_squares;
    const int64_t kw = k0 + w_k;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t c = c0 + w_c + j;
      // Explicit roundings: a contracted multiply-subtract would split the unrounded product.
      float rest = kw < k_end && c < N ? __fmul_rn(norm_weight[kw], phi[kw * N + c]) : 0.0f;
#pragma unroll
      for (int term = 0; term < kTerms; ++term) {
        const __nv_bfloat16 part = __float2bfloat16_rn(rest);
        s.w[term][w_c + j][w_k] = part;
        rest = __fsub_rn(rest, __bfloat162float(part));
      }
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kDepth; kk += 16) {
      const int row = warp * 16 + g;
      const uint32_t a[4] = {pair_at(&s.x[row][kk + 2 * q]), pair_at(&s.x[row + 8][kk + 2 * q]),
                             pair_at(&s.x[row][kk + 2 * q + 8]),
                             pair_at(&s.x[row + 8][kk + 2 * q + 8])};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int term = 0; term < kTerms; ++term) {
          const __nv_bfloat16* column = s.w[term][nt * 8 + g];
          mma_bf16(acc[nt], a, pair_at(column + kk + 2 * q), pair_at(column + kk + 2 * q + 8));
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        total[nt][e] += acc[nt][e];
        acc[nt][e] = 0.0f;
      }
    }
    __syncthreads();
  }
  squares += __shfl_xor_sync(0xffffffffu, squares, 1);  // the two threads of a token

  float* out = partials + tile.slice * T * (N + 1);
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t t = t0 + warp * 16 + g + (e >= 2 ? 8 : 0);
      const int64_t c = c0 + nt * 8 + 2 * q + (e % 2);
      if (t < T && c < N) out[t * (N + 1) + c] = static_cast<float>(total[nt][e]);
    }
  }
  if (tile.writes_squares && tid % 2 == 0 && t_load < T) {
    out[t_load * (N + 1) + N] = static_cast<float>(squares);
  }
}

}  // namespace

bool tensor_core_projection(DType x_dtype) {
  static const bool enabled = [] {
    const char* flag = std::getenv("MHC_CUDA_TENSOR_CORES");
    if (flag == nullptr || std::strcmp(flag, "1") != 0) return false;
    int device = 0, major = 0;
    return cudaGetDevice(&device) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) ==
               cudaSuccess &&
           major >= 8;
  }();
  return enabled && x_dtype == DType::bf16;
}

void launch_projection_mma(const detail::Dims& d, const ProjectionSplit& split, Grid grid,
                           const TensorRef& x, const float* norm_weight, const float* phi,
                           float* partials, cudaStream_t stream) {
  if (d.T == 0) return;
  // The grid is projection_blocks (gemm.cu): the same 64 x 32 tiles, here of 128 threads.
  static_assert(kRows == 64 && kCols == 32, "projection_blocks assumes gemm.cu's tile");
  const int64_t token_tiles = ceil_div(d.T, kRows), col_tiles = ceil_div(d.N, kCols);
  projection_mma_kernel<<<grid.blocks(), kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x.data), norm_weight, phi, d.T, d.M, static_cast<int>(d.N),
      split.slice_width, token_tiles, col_tiles, partials);
}

}  // namespace mhc::cuda
