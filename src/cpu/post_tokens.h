// The post operations' token loops (post.cc) over tokens [begin, end) of flat [T, n, D] arrays,
// for the kernels that run a post inside their own tiles (the fused boundary). One overload per
// (x dtype, layer_out dtype) pair; each is compiled for every SIMD level (simd.h).
#pragma once

#include <cstdint>

#include "mhc/tensor.h"

namespace mhc::cpu {

// NOLINTBEGIN(bugprone-macro-parentheses): X and L are types, which parentheses would break.
#define MHC_DECLARE_POST_TOKENS(X, L)                                                              \
  void post_forward_tokens(const X* x, const L* lo, const float* hp, const float* hr, int64_t n,   \
                           int64_t D, int64_t begin, int64_t end, X* out);                         \
  void post_backward_tokens(const X* g, const X* x, const L* lo, const float* hp, const float* hr, \
                            int64_t n, int64_t D, int64_t begin, int64_t end, X* dxp, L* dlo,      \
                            float* dh_post, float* dh_res);

MHC_DECLARE_POST_TOKENS(float, float)
MHC_DECLARE_POST_TOKENS(float, bf16)
MHC_DECLARE_POST_TOKENS(bf16, float)
MHC_DECLARE_POST_TOKENS(bf16, bf16)
#undef MHC_DECLARE_POST_TOKENS
// NOLINTEND(bugprone-macro-parentheses)

}  // namespace mhc::cpu
