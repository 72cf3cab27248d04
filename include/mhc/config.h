// mhc/config.h: the mHC configuration and the widths derived from it (spec: Shapes and names).
#pragma once

#include <cstdint>
#include <vector>

#include "mhc/export.h"

namespace mhc {

// How H_res, the doubly stochastic stream mix, is built from its logits.
enum class Mix {
  sinkhorn,      // softmax then alternating row/column normalization, R = n*n logits
  permutations,  // convex mix of the n! permutation matrices ("mHC-lite"), R = n! logits
};

MHC_API const char* to_string(Mix mix);

// Which mix a pre's pre-apply (spec: Forward step 6) reads: the one value the layers pass for it.
// DeepSeek-V4's operations read the sublayer's own gates h_pre; V4.1's *_carried operations
// (spec: Single-pass schedule) read a carried mix [T, n], or for the first sublayer the one-hot
// on stream 0, which their callers select with an absent carried view (mhc/ops.h). Python's
// mhc._config.PreApply has the same values.
enum class PreApply : int32_t {
  own_gates = 0,  // V4: the sublayer's own h_pre
  carried = 1,    // V4.1: the carried mix, the previous sublayer's h_pre
  one_hot = 2,    // V4.1's first sublayer: stream 0 alone (layer_in = x[:, 0])
};

// Largest stream counts the library accepts. Sinkhorn's per-token state is n*n floats; the
// permutation mix has n! logits, so 6 (720 columns) is where it stops being "small".
inline constexpr int64_t kMaxStreams = 16;
inline constexpr int64_t kMaxPermutationStreams = 6;
// The exact Sinkhorn backward keeps 2*iters+1 matrices per token; this bounds that scratch.
inline constexpr int64_t kMaxSinkhornIters = 10000;

struct Config {
  int64_t n = 4;    // streams
  int64_t dim = 0;  // D, features per stream
  Mix mix = Mix::sinkhorn;
  int64_t sinkhorn_iters = 20;
  float sinkhorn_eps = 1e-6f;
  float rms_eps = 1e-6f;
  float pre_eps = 1e-6f;
  float post_scale = 2.0f;
  // Tensor parallelism: the number of equal slices D is split into across devices. The tensors
  // of one call then hold one slice, D / tensor_parallel features of every stream (see the
  // split operations in mhc/ops.h); 1 means the call sees all of D.
  int64_t tensor_parallel = 1;
};

// M = n*D: one token's flattened streams (all of D, whatever tensor_parallel is).
MHC_API int64_t flat_width(const Config& config);
// D / tensor_parallel: the features per stream that one call's tensors hold.
MHC_API int64_t local_dim(const Config& config);
// R: n*n for Sinkhorn, n! for permutations.
MHC_API int64_t residual_logits(const Config& config);
// N = 2n + R: columns of phi and entries of bias.
MHC_API int64_t projection_width(const Config& config);

// Throws mhc::Error naming the field when the config is outside what the spec allows:
// 1 <= n <= 16 (<= 6 for permutations), D >= 1, 1 <= sinkhorn_iters <= 10000,
// eps values finite and >= 0 with rms_eps > 0, post_scale finite, tensor_parallel >= 1 and
// dividing D.
MHC_API void validate(const Config& config, const char* op = "mhc::Config");

// The p-th permutation of range(n) in lexicographic order (p = 0 is the identity):
// result[i] = perm_p(i). Requires 0 <= p < n!.
MHC_API std::vector<int> permutation(int64_t n, int64_t p);

}  // namespace mhc
