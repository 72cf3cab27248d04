// Shared pieces of the CPU kernels: tile sizes and f32 staging of bf16 activations.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "mhc/tensor.h"
#include "vector_math.h"

namespace mhc::cpu {

// Tokens per tile of the pre operations: the f32 copy of a tile (tokens x M) stays within
// about 1 MiB so its second sweep (pre-apply, dx) hits cache. Depends only on M, which keeps
// the tile boundaries, and so every result, independent of the thread count.
inline int64_t pre_tile_tokens(int64_t M) {
  constexpr int64_t kTileFloats = int64_t{1} << 18;
  return std::clamp<int64_t>(kTileFloats / M, 1, 64);
}

// Tokens per task of the post operations (pure streaming): enough work to amortize a task.
inline int64_t post_tile_tokens(int64_t M) {
  constexpr int64_t kTaskFloats = int64_t{1} << 16;
  return std::clamp<int64_t>(kTaskFloats / M, 1, 256);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// f32 view of `count` activations: the data itself when it is f32, else widened into scratch.
inline const float* as_f32(const float* src, int64_t, float*) { return src; }
inline const float* as_f32(const bf16* src, int64_t count, float* scratch) {
  widen(src, scratch, count);
  return scratch;
}

// Where to compute an output: in place when it is f32, else in scratch until store_from().
inline float* f32_target(float* dst, float*) { return dst; }
inline float* f32_target(bf16*, float* scratch) { return scratch; }
inline void store_from(const float*, float*, int64_t) {}
inline void store_from(const float* src, bf16* dst, int64_t count) { narrow(src, dst, count); }

}  // namespace mhc::cpu
