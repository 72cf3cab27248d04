// Shared pieces of the CPU kernels: tile sizes and f32 staging of bf16 activations.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "mhc/tensor.h"
#include "projection.h"
#include "thread_pool.h"
#include "vector_math.h"
#include "workspace.h"

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

// Threads a pre operation uses: all of the pool's, or only the calling thread when the
// projection is under 2^18 multiply-adds (a few microseconds on one core), less than waking
// and handing work to another thread costs. Results do not depend on it.
inline int pre_threads(int64_t T, int64_t M, int64_t N, int pool_threads) {
  constexpr int64_t kMinParallelWork = int64_t{1} << 18;
  return T * M * N >= kMinParallelWork ? pool_threads : 1;
}

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

// Widens rows [m0, m1) of `tokens` rows of x (row stride M) into the same place of dst (bf16
// only; f32 activations are used in place).
inline void widen_columns(const float*, int64_t, int64_t, int64_t, int64_t, float*) {}
inline void widen_columns(const bf16* x, int64_t tokens, int64_t M, int64_t m0, int64_t m1,
                          float* dst) {
  for (int64_t t = 0; t < tokens; ++t) widen(x + t * M + m0, dst + t * M + m0, m1 - m0);
}

// Workspace of project_split_rows for tiles of up to `tile` tokens (0 when the plan does not
// split): the f32 block sums and sums of squares of every block of rows, and the double total of
// the block sums.
struct SplitRowsScratch {
  float* sums;     // [blocks, tile, NP]
  float* squares;  // [blocks, tile]
  double* wide;    // [tile, NP]
};
template <class Taker>
SplitRowsScratch take_split_rows(Taker& take, int64_t tile, int64_t M, int64_t N) {
  const auto count = [](int64_t elements) { return static_cast<size_t>(elements); };
  const int64_t NP = padded_width(N), blocks = ceil_div(M, kProjectionBlock);
  SplitRowsScratch scratch;
  scratch.sums = take.template take<float>(count(blocks * tile * NP));
  scratch.squares = take.template take<float>(count(blocks * tile));
  scratch.wide = take.template take<double>(count(tile * NP));
  return scratch;
}

// A tile with fewer tiles than threads to share: its projection P [tokens, N] and sums of squares
// [tokens] split over the threads by blocks of rows of W, each range widening its own columns of
// x (bf16) first. The block sums are added in block order, so P and the squares have the same bits
// as project() on one thread. Returns the tile of x as f32 (staging itself for bf16; staging then
// holds tokens x M).
template <class X>
const float* project_split_rows(const X* x, int64_t tokens, const FoldedWeight& w, float* staging,
                                float* P, double* squares, const SplitRowsScratch& scratch) {
  const int64_t M = w.M, NP = padded_width(w.N);
  const int64_t blocks = ceil_div(M, kProjectionBlock);
  const float* xf = staging;
  if constexpr (std::is_same_v<X, float>) xf = x;
  ThreadPool& pool = ThreadPool::instance();
  // One contiguous range of rows per thread: the caller usually takes the first and a worker the
  // next, so a thread's share of phi tends to stay in its own L2 from one call to the next (with
  // 4 ranges per thread, taken in any order, a T = 1 call took 50 us instead of 35).
  const int64_t ranges = std::min<int64_t>(blocks, int64_t{pool.threads()});
  pool.parallel_for(ranges, pool.threads(), [&](int64_t range, int) {
    const int64_t b0 = range * blocks / ranges, b1 = (range + 1) * blocks / ranges;
    widen_columns(x, tokens, M, b0 * kProjectionBlock, std::min(M, b1 * kProjectionBlock), staging);
    project_blocks(xf, tokens, w, b0, b1, scratch.sums + b0 * tokens * NP,
                   scratch.squares + b0 * tokens);
  });
  std::fill_n(scratch.wide, tokens * NP, 0.0);
  std::fill_n(squares, tokens, 0.0);
  add_block_sums(scratch.sums, scratch.squares, blocks, tokens, NP, scratch.wide, squares);
  round_projection(scratch.wide, tokens, w.N, P);
  return xf;
}

}  // namespace mhc::cpu
