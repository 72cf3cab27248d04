// Shared pieces of the CUDA kernels: activation loads and stores in f32, launch checks, the
// per-thread scratch view of the coefficient kernels and a deterministic double block sum.
//
// STATUS: compiled in CI; not yet run on a GPU (no device was available when this was written).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "kernels.h"
#include "mhc/error.h"
#include "mhc/tensor.h"

namespace mhc::cuda {

inline constexpr int kBlockThreads = 256;
static_assert(kBlockThreads == kStrideThreads,
              "kernels.h states the block size of gemm.cu's loops");
inline constexpr int kWarps = kBlockThreads / 32;
// Elements per thread on the vector path: one 16-byte load of bf16, two of f32.
inline constexpr int kVector = 8;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Throws mhc::Error for a failed launch (or an earlier asynchronous error on the device).
inline void check_launch(const char* op, const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    throw Error(op, kernel, std::string("CUDA launch failed: ") + cudaGetErrorString(status));
  }
}

// Calls body(X{}) with X the device activation type of `dtype`.
template <class Body>
void with_device_type(DType dtype, Body body) {
  if (dtype == DType::bf16) {
    body(__nv_bfloat16{});
  } else {
    body(float{});
  }
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class X>
__device__ __forceinline__ X from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// V consecutive elements at p, as f32. V == kVector needs p aligned to V elements' bytes and
// 16 bytes (the host picks the vector path only then); V == 1 is the scalar tail path.
template <int V>
__device__ __forceinline__ void load(const float* p, float (&out)[V]) {
  if constexpr (V == kVector) {
    const float4 lo = __ldg(reinterpret_cast<const float4*>(p));
    const float4 hi = __ldg(reinterpret_cast<const float4*>(p) + 1);
    out[0] = lo.x, out[1] = lo.y, out[2] = lo.z, out[3] = lo.w;
    out[4] = hi.x, out[5] = hi.y, out[6] = hi.z, out[7] = hi.w;
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) out[v] = __ldg(p + v);
  }
}

template <int V>
__device__ __forceinline__ void load(const __nv_bfloat16* p, float (&out)[V]) {
  if constexpr (V == kVector) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {  // bf16 is the top half of an f32: unpack by shifting
      out[2 * w] = __uint_as_float(words[w] << 16);
      out[2 * w + 1] = __uint_as_float(words[w] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) out[v] = __bfloat162float(p[v]);
  }
}

template <int V>
__device__ __forceinline__ void store(float* p, const float (&in)[V]) {
  if constexpr (V == kVector) {
    reinterpret_cast<float4*>(p)[0] = make_float4(in[0], in[1], in[2], in[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(in[4], in[5], in[6], in[7]);
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) p[v] = in[v];
  }
}

template <int V>
__device__ __forceinline__ void store(__nv_bfloat16* p, const float (&in)[V]) {
  if constexpr (V == kVector) {
    __nv_bfloat162 pairs[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) pairs[w] = __floats2bfloat162_rn(in[2 * w], in[2 * w + 1]);
    // The pairs' bytes as one 16-byte word: memcpy between two trivially copyable objects of the
    // same size is defined (reading the array through a uint4 lvalue was not); nvcc keeps both in
    // registers, so this is still one 16-byte store (sm_90 PTX: one st.global.v4.u32).
    static_assert(sizeof(pairs) == sizeof(uint4), "four bf16 pairs fill one 16-byte vector");
    uint4 raw;
    memcpy(&raw, pairs, sizeof(raw));
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) p[v] = __float2bfloat16_rn(in[v]);
  }
}

// One thread's scratch in a coefficient kernel: element i at base[i * stride]. Threads of a warp
// hold consecutive bases, so their accesses to the same element are coalesced.
struct Slot {
  double* base;
  int64_t stride;
  __device__ double& operator[](int64_t i) const { return base[i * stride]; }
  __device__ Slot at(int64_t offset) const { return Slot{base + offset * stride, stride}; }
};

// Sums values[v] over the block for v < count (count <= kCount, the same on every thread) into
// out[v], in double and in an order fixed by the block size alone: a shuffle tree in each warp,
// then the warps in order. blockDim.x must be kBlockThreads. `scratch` holds kWarps * count
// doubles. The streaming kernels' per-token dots come here as per-thread double sums
// (streams.cu says why double).
template <int kCount>
__device__ void block_sum(const double (&values)[kCount], int count, double* scratch, double* out) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int v = 0; v < kCount; ++v) {
    if (v < count) {
      double s = values[v];
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) s += __shfl_down_sync(0xffffffffu, s, offset);
      if (lane == 0) scratch[warp * count + v] = s;
    }
  }
  __syncthreads();
  for (int v = threadIdx.x; v < count; v += blockDim.x) {
    double total = 0.0;
    for (int w = 0; w < kWarps; ++w) total += scratch[w * count + v];
    out[v] = total;
  }
  __syncthreads();  // scratch is free again when this returns
}

// The tile of the projection a block computes (gemm.cu and projection_mma.cu share the grid):
// blocks enumerate token tiles fastest, then column tiles, then slices of n*D.
struct ProjectionTile {
  int64_t t0, c0;          // first token and first column
  int64_t slice;           // which slice of n*D: its partials' index
  int64_t k_begin, k_end;  // that slice's columns of x
  bool writes_squares;     // column tile 0 also writes the sum of squares
};

__device__ __forceinline__ ProjectionTile projection_tile(int64_t rows, int64_t cols,
                                                          int64_t token_tiles, int64_t col_tiles,
                                                          int64_t slice_width, int64_t M) {
  int64_t block = blockIdx.x;
  const int64_t tile_t = block % token_tiles;
  block /= token_tiles;
  const int64_t tile_c = block % col_tiles;
  const int64_t slice = block / col_tiles;
  const int64_t k_begin = slice * slice_width;
  return ProjectionTile{tile_t * rows, tile_c * cols, slice, k_begin, min(M, k_begin + slice_width),
                        tile_c == 0};
}

// The vector path needs every tensor of the call aligned and rows of a multiple of kVector.
inline bool vector_path(int64_t D, std::initializer_list<const void*> pointers) {
  if (D % kVector != 0) return false;
  for (const void* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

}  // namespace mhc::cuda
