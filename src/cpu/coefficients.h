// Per-token coefficient math (spec: Forward steps 3-5 and Backward from the gates to dP): logits
// from the projection, the gates, H_res by Sinkhorn or permutations, and the exact backward
// through every Sinkhorn step. One instance per worker; it owns the Sinkhorn history so the
// per-token calls never allocate.
//
// Precision: the spec asks for at least f32. The work here is O(iters * n^2) per token, tiny next
// to the O(n D N) projection, so it runs in double: the softmax-gradient rows sum to zero, and
// dalpha sums such cancelling terms over all tokens, which f32 would leave at ~1e-5 relative.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "mhc/config.h"

namespace mhc::cpu {

// r = 1 / sqrt(mean(x^2) + rms_eps) from a token's sum of squares over M values (spec step 1).
inline double inverse_rms(double sum_of_squares, int64_t M, float rms_eps) {
  return 1.0 / std::sqrt(sum_of_squares / static_cast<double>(M) + rms_eps);
}

class TokenCoefficients {
 public:
  // Which Sinkhorn code runs: `specialized` takes the kernel for n = 4 (SIMD pairs, the matrix
  // in registers; about twice the generic loops' speed) and the generic loops for any other n;
  // `generic` takes the generic loops always. Both do the same operations in the same order, so
  // their results are equal bit for bit; `generic` is for the tests that check it.
  enum class Loops { specialized, generic };

  // pre_gates_only: DeepSeek-V4's head collapse (mhc::head_forward), N = n logits and only H_pre;
  // forward() then leaves h_post and h_res alone and backward() reads only dh_pre.
  TokenCoefficients(const Config& config, const float* alpha, const float* bias,
                    bool pre_gates_only = false, Loops loops = Loops::specialized);

  // From P [N] and r: h_pre [n], h_post [n], h_res [n*n]. Keeps the logits, the gates' sigmoids
  // and the Sinkhorn history of this token for a following backward().
  void forward(const float* P, double r, float* h_pre, float* h_post, float* h_res);

  // After forward() on the same token: from dh_pre, dh_post, dh_res to dP [N] and dr; adds this
  // token's terms to dalpha [3] and dbias [N]. With pre_gates_only, dh_post and dh_res may be null.
  void backward(const float* P, double r, const double* dh_pre, const float* dh_post,
                const float* dh_res, float* dP, double* dr, double* dalpha, double* dbias);

 private:
  void permutations_forward(float* h_res);
  void permutations_backward(const float* dh_res, double* dlogits);

  Config config_;
  const float* alpha_;
  const float* bias_;
  bool pre_gates_only_;
  int64_t n_, N_, R_;
  Loops loops_;
  std::vector<double> logits_;     // a [N]
  std::vector<double> sigmoids_;   // sigmoid(a) of the gates [2n], for the backward
  std::vector<double> softmax_;    // Sinkhorn: row softmax [n*n]; permutations: weights [R]
  std::vector<double> steps_;      // Sinkhorn step results, (2*iters - 1) x [n*n]
  std::vector<double> inverses_;   // Sinkhorn: 1 / (sum + eps) of every step, (2*iters - 1) x [n]
  std::vector<double> work_;       // generic Sinkhorn: [n*n + n]; permutations: [n*n] and [R]
  std::vector<double> dlogits_;    // da [N]
  std::vector<int> perm_targets_;  // permutations: perm_p(i) for all p, [R*n]
};

}  // namespace mhc::cpu
