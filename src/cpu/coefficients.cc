// Per-token coefficient math. The structure mirrors src/core/reference.cc; the difference is a
// preallocated Sinkhorn history (and f32 inputs and outputs at the interface).
//
// Sinkhorn history: step 0 normalizes columns, then steps alternate row, column, ... so step k
// is over columns when k is even, and there are 2*iters - 1 steps. Each step keeps its result Y
// and its sums s, which is all the exact backward needs:
//   dX = (dY - dot(dY, Y)) / (s + eps), the dot taken along the normalized direction.
#include "coefficients.h"

#include <cmath>

namespace mhc::cpu {

namespace {
double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// softmax of `count` values at stride 1 into out; NaN anywhere makes every output NaN.
void softmax(const double* logits, int64_t count, double* out) {
  double largest = logits[0];
  for (int64_t k = 1; k < count; ++k) largest = logits[k] > largest ? logits[k] : largest;
  double total = 0.0;
  for (int64_t k = 0; k < count; ++k) {
    out[k] = std::exp(logits[k] - largest);
    total += out[k];
  }
  const double scale = 1.0 / total;
  for (int64_t k = 0; k < count; ++k) out[k] *= scale;
}

int group_of(int64_t column, int64_t n) { return column < n ? 0 : (column < 2 * n ? 1 : 2); }
}  // namespace

TokenCoefficients::TokenCoefficients(const Config& config, const float* alpha, const float* bias,
                                     bool pre_gates_only)
    : config_(config),
      alpha_(alpha),
      bias_(bias),
      pre_gates_only_(pre_gates_only),
      n_(config.n),
      N_(pre_gates_only ? config.n : projection_width(config)),
      R_(pre_gates_only ? 0 : residual_logits(config)),
      logits_(static_cast<size_t>(N_)),
      softmax_(static_cast<size_t>(R_)),
      gradient_(static_cast<size_t>(R_ + n_ * n_)),
      dots_(static_cast<size_t>(n_)),
      dlogits_(static_cast<size_t>(N_)) {
  if (pre_gates_only) return;
  if (config.mix == Mix::sinkhorn) {
    const int64_t steps = 2 * config.sinkhorn_iters - 1;
    steps_.resize(static_cast<size_t>(steps * n_ * n_));
    sums_.resize(static_cast<size_t>(steps * n_));
  } else {
    for (int64_t p = 0; p < R_; ++p) {
      const std::vector<int> perm = permutation(n_, p);
      perm_targets_.insert(perm_targets_.end(), perm.begin(), perm.end());
    }
  }
}

void TokenCoefficients::forward(const float* P, double r, float* h_pre, float* h_post,
                                float* h_res) {
  for (int64_t c = 0; c < N_; ++c) {
    logits_[c] = double{alpha_[group_of(c, n_)]} * (r * P[c]) + bias_[c];
  }
  for (int64_t k = 0; k < n_; ++k) {
    h_pre[k] = static_cast<float>(sigmoid(logits_[k]) + config_.pre_eps);
  }
  if (pre_gates_only_) return;
  for (int64_t k = 0; k < n_; ++k) {
    h_post[k] = static_cast<float>(config_.post_scale * sigmoid(logits_[n_ + k]));
  }
  if (config_.mix == Mix::sinkhorn) {
    sinkhorn_forward(h_res);
  } else {
    permutations_forward(h_res);
  }
}

void TokenCoefficients::sinkhorn_forward(float* h_res) {
  const int64_t n = n_, nn = n_ * n_;
  const double eps = config_.sinkhorn_eps;
  const double* logits = logits_.data() + 2 * n;
  for (int64_t i = 0; i < n; ++i) softmax(logits + i * n, n, softmax_.data() + i * n);
  const int64_t steps = 2 * config_.sinkhorn_iters - 1;
  for (int64_t step = 0; step < steps; ++step) {
    const bool over_columns = step % 2 == 0;
    double* sums = sums_.data() + step * n;
    double* result = steps_.data() + step * nn;
    if (step == 0) {
      for (int64_t e = 0; e < nn; ++e) result[e] = softmax_[e] + eps;
    } else {
      const double* previous = result - nn;
      for (int64_t e = 0; e < nn; ++e) result[e] = previous[e];
    }
    for (int64_t k = 0; k < n; ++k) sums[k] = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) sums[over_columns ? j : i] += result[i * n + j];
    }
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) result[i * n + j] /= sums[over_columns ? j : i] + eps;
    }
  }
  const double* last = steps_.data() + (steps - 1) * nn;
  for (int64_t e = 0; e < nn; ++e) h_res[e] = static_cast<float>(last[e]);
}

void TokenCoefficients::permutations_forward(float* h_res) {
  const int64_t n = n_;
  softmax(logits_.data() + 2 * n, R_, softmax_.data());
  double* mix = gradient_.data();
  for (int64_t e = 0; e < n * n; ++e) mix[e] = 0.0;
  for (int64_t p = 0; p < R_; ++p) {
    const int* perm = perm_targets_.data() + p * n;
    for (int64_t i = 0; i < n; ++i) mix[i * n + perm[i]] += softmax_[p];
  }
  for (int64_t e = 0; e < n * n; ++e) h_res[e] = static_cast<float>(mix[e]);
}

void TokenCoefficients::backward(const float* P, double r, const double* dh_pre,
                                 const float* dh_post, const float* dh_res, float* dP, double* dr,
                                 double* dalpha, double* dbias) {
  const int64_t n = n_;
  double* da = dlogits_.data();
  for (int64_t k = 0; k < n; ++k) {
    const double s_pre = sigmoid(logits_[k]);
    da[k] = dh_pre[k] * s_pre * (1.0 - s_pre);
  }
  if (!pre_gates_only_) {
    for (int64_t k = 0; k < n; ++k) {
      const double s_post = sigmoid(logits_[n + k]);
      da[n + k] = dh_post[k] * double{config_.post_scale} * s_post * (1.0 - s_post);
    }
    if (config_.mix == Mix::sinkhorn) {
      sinkhorn_backward(dh_res, da + 2 * n);
    } else {
      permutations_backward(dh_res, da + 2 * n);
    }
  }
  double dr_total = 0.0;
  for (int64_t c = 0; c < N_; ++c) {
    const int group = group_of(c, n);
    dbias[c] += da[c];
    dalpha[group] += da[c] * (r * P[c]);
    const double dZ = alpha_[group] * da[c];
    dr_total += dZ * P[c];
    dP[c] = static_cast<float>(r * dZ);
  }
  *dr = dr_total;
}

void TokenCoefficients::sinkhorn_backward(const float* dh_res, double* dlogits) {
  const int64_t n = n_, nn = n_ * n_;
  const double eps = config_.sinkhorn_eps;
  double* grad = gradient_.data();
  for (int64_t e = 0; e < nn; ++e) grad[e] = dh_res[e];
  for (int64_t step = 2 * config_.sinkhorn_iters - 2; step >= 0; --step) {
    const bool over_columns = step % 2 == 0;
    const double* result = steps_.data() + step * nn;
    const double* sums = sums_.data() + step * n;
    for (int64_t k = 0; k < n; ++k) dots_[k] = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j)
        dots_[over_columns ? j : i] += grad[i * n + j] * result[i * n + j];
    }
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t k = over_columns ? j : i;
        grad[i * n + j] = (grad[i * n + j] - dots_[k]) / (sums[k] + eps);
      }
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const double* s = softmax_.data() + i * n;
    double dot = 0.0;
    for (int64_t k = 0; k < n; ++k) dot += grad[i * n + k] * s[k];
    for (int64_t j = 0; j < n; ++j) dlogits[i * n + j] = s[j] * (grad[i * n + j] - dot);
  }
}

void TokenCoefficients::permutations_backward(const float* dh_res, double* dlogits) {
  const int64_t n = n_;
  double* dweights = gradient_.data();
  double weighted = 0.0;
  for (int64_t p = 0; p < R_; ++p) {
    const int* perm = perm_targets_.data() + p * n;
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) total += dh_res[i * n + perm[i]];
    dweights[p] = total;
    weighted += softmax_[p] * total;
  }
  for (int64_t p = 0; p < R_; ++p) dlogits[p] = softmax_[p] * (dweights[p] - weighted);
}

}  // namespace mhc::cpu
