// Per-token coefficient math. The structure mirrors src/core/reference.cc; the differences are a
// preallocated Sinkhorn history, one reciprocal per sum where the reference divides every element
// (a result moves by at most one rounding of double), a Sinkhorn kernel for n = 4 in SIMD pairs,
// and f32 inputs and outputs at the interface.
//
// Sinkhorn history: step 0 normalizes columns, then steps alternate row, column, ... so step k
// is over columns when k is even, and there are 2*iters - 1 steps. Each step keeps its result Y
// and the reciprocals q = 1 / (s + eps) of its sums s, which is all the exact backward needs:
//   dX = (dY - dot(dY, Y)) * q, the dot taken along the normalized direction.
// Every sum and dot adds its terms in index order, in the n = 4 kernel and the generic loops
// alike, so the two give the same bits.
#include "coefficients.h"

#include <algorithm>
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

// What the Sinkhorn forward keeps for the backward, and the generic loops' scratch.
struct SinkhornBuffers {
  int64_t n, iters;
  double eps;
  double* softmax;   // [n*n]
  double* steps;     // [(2*iters - 1) * n*n]
  double* inverses;  // [(2*iters - 1) * n]
  double* work;      // [n*n + n]
};

// The one place the forward and the backward read the Sinkhorn settings from.
SinkhornBuffers sinkhorn_buffers(const Config& config, int64_t n, double* softmax, double* steps,
                                 double* inverses, double* work) {
  return {n, config.sinkhorn_iters, config.sinkhorn_eps, softmax, steps, inverses, work};
}

// ---------------------------------------------------------------------------------------------
// The generic loops, any n, on y [n x n] row-major.

// q_j = 1 / (sum_i y[i][j] + eps), y[i][j] *= q_j.
void normalize_columns(int64_t n, double eps, double* __restrict y, double* __restrict q) {
  for (int64_t j = 0; j < n; ++j) q[j] = y[j];
  for (int64_t i = 1; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) q[j] += y[i * n + j];
  }
  for (int64_t j = 0; j < n; ++j) q[j] = 1.0 / (q[j] + eps);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) y[i * n + j] *= q[j];
  }
}

// q_i = 1 / (sum_j y[i][j] + eps), y[i][j] *= q_i.
void normalize_rows(int64_t n, double eps, double* __restrict y, double* __restrict q) {
  for (int64_t i = 0; i < n; ++i) {
    double sum = y[i * n];
    for (int64_t j = 1; j < n; ++j) sum += y[i * n + j];
    q[i] = 1.0 / (sum + eps);
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) y[i * n + j] *= q[i];
  }
}

// Backward of a column step with result y and reciprocals q: g[i][j] = (g[i][j] - dot_j) * q_j,
// dot_j = sum_i g[i][j] * y[i][j]; dots is [n] of scratch.
void columns_backward(int64_t n, const double* __restrict y, const double* __restrict q,
                      double* __restrict g, double* __restrict dots) {
  for (int64_t j = 0; j < n; ++j) dots[j] = g[j] * y[j];
  for (int64_t i = 1; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) dots[j] += g[i * n + j] * y[i * n + j];
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) g[i * n + j] = (g[i * n + j] - dots[j]) * q[j];
  }
}

// Backward of a row step: g[i][j] = (g[i][j] - dot_i) * q_i, dot_i = sum_j g[i][j] * y[i][j].
void rows_backward(int64_t n, const double* __restrict y, const double* __restrict q,
                   double* __restrict g) {
  for (int64_t i = 0; i < n; ++i) {
    double dot = g[i * n] * y[i * n];
    for (int64_t j = 1; j < n; ++j) dot += g[i * n + j] * y[i * n + j];
    for (int64_t j = 0; j < n; ++j) g[i * n + j] = (g[i * n + j] - dot) * q[i];
  }
}

// H_res from the row softmax (already in b.softmax), keeping every step in b.steps, b.inverses.
void sinkhorn_forward(const SinkhornBuffers& b, float* h_res) {
  const int64_t n = b.n, nn = n * n;
  double* y = b.work;
  double* q = b.work + nn;
  int64_t step = 0;
  auto keep = [&] {
    std::copy_n(y, nn, b.steps + step * nn);
    std::copy_n(q, n, b.inverses + step * n);
    ++step;
  };
  for (int64_t e = 0; e < nn; ++e) y[e] = b.softmax[e] + b.eps;
  normalize_columns(n, b.eps, y, q);
  keep();
  for (int64_t iter = 1; iter < b.iters; ++iter) {
    normalize_rows(n, b.eps, y, q);
    keep();
    normalize_columns(n, b.eps, y, q);
    keep();
  }
  for (int64_t e = 0; e < nn; ++e) h_res[e] = static_cast<float>(y[e]);
}

// dlogits [n*n] from dh_res through every step of the history, then the row softmax.
void sinkhorn_backward(const SinkhornBuffers& b, const float* dh_res, double* dlogits) {
  const int64_t n = b.n, nn = n * n;
  double* g = b.work;
  double* dots = b.work + nn;
  for (int64_t e = 0; e < nn; ++e) g[e] = dh_res[e];
  for (int64_t step = 2 * b.iters - 2;; step -= 2) {
    columns_backward(n, b.steps + step * nn, b.inverses + step * n, g, dots);
    if (step == 0) break;
    rows_backward(n, b.steps + (step - 1) * nn, b.inverses + (step - 1) * n, g);
  }
  for (int64_t i = 0; i < n; ++i) {
    const double* s = b.softmax + i * n;
    double dot = g[i * n] * s[0];
    for (int64_t k = 1; k < n; ++k) dot += g[i * n + k] * s[k];
    for (int64_t j = 0; j < n; ++j) dlogits[i * n + j] = s[j] * (g[i * n + j] - dot);
  }
}

// ---------------------------------------------------------------------------------------------
// n = 4 in pairs of doubles (one SSE2 register, the baseline every build has): the same
// operations in the same order as the generic loops, lane by lane, with the matrix in registers.
// A 4 x 4 matrix is eight pairs, row i in m[2i] (columns 0, 1) and m[2i + 1] (columns 2, 3).

typedef double Pair __attribute__((vector_size(16)));
typedef double UnalignedPair __attribute__((vector_size(16), aligned(8), may_alias));

inline Pair load_pair(const double* p) { return *reinterpret_cast<const UnalignedPair*>(p); }
inline void store_pair(double* p, Pair v) { *reinterpret_cast<UnalignedPair*>(p) = v; }
inline Pair lows(Pair a, Pair b) { return __builtin_shufflevector(a, b, 0, 2); }
inline Pair highs(Pair a, Pair b) { return __builtin_shufflevector(a, b, 1, 3); }

// The sums of rows i and i + 1, each ((m_i0 + m_i1) + m_i2) + m_i3 as the generic loops add.
inline Pair row_sums(const Pair* m, int64_t i) {
  const Pair left = m[2 * i], right = m[2 * i + 1], next_left = m[2 * i + 2],
             next_right = m[2 * i + 3];
  return ((lows(left, next_left) + highs(left, next_left)) + lows(right, next_right)) +
         highs(right, next_right);
}

// Rows i and i + 1 of m times the two lanes of `by`: row i by by[0], row i + 1 by by[1].
inline void scale_rows(Pair* m, int64_t i, Pair by) {
  const Pair first = lows(by, by), second = highs(by, by);
  m[2 * i] *= first;
  m[2 * i + 1] *= first;
  m[2 * i + 2] *= second;
  m[2 * i + 3] *= second;
}

void sinkhorn_forward_4(const SinkhornBuffers& b, float* h_res) {
  const Pair eps = {b.eps, b.eps};
  Pair y[8];
  for (int64_t k = 0; k < 8; ++k) y[k] = load_pair(b.softmax + 2 * k) + eps;
  double* steps = b.steps;
  double* inverses = b.inverses;
  auto keep = [&](Pair q_first, Pair q_second) {
    for (int64_t k = 0; k < 8; ++k) store_pair(steps + 2 * k, y[k]);
    store_pair(inverses, q_first);
    store_pair(inverses + 2, q_second);
    steps += 16;
    inverses += 4;
  };
  auto column_step = [&] {
    const Pair q_left = 1.0 / ((((y[0] + y[2]) + y[4]) + y[6]) + eps);
    const Pair q_right = 1.0 / ((((y[1] + y[3]) + y[5]) + y[7]) + eps);
    for (int64_t i = 0; i < 4; ++i) {
      y[2 * i] *= q_left;
      y[2 * i + 1] *= q_right;
    }
    keep(q_left, q_right);
  };
  auto row_step = [&] {
    const Pair q_01 = 1.0 / (row_sums(y, 0) + eps);
    const Pair q_23 = 1.0 / (row_sums(y, 2) + eps);
    scale_rows(y, 0, q_01);
    scale_rows(y, 2, q_23);
    keep(q_01, q_23);
  };
  column_step();
  for (int64_t iter = 1; iter < b.iters; ++iter) {
    row_step();
    column_step();
  }
  for (int64_t k = 0; k < 8; ++k) {
    h_res[2 * k] = static_cast<float>(y[k][0]);
    h_res[2 * k + 1] = static_cast<float>(y[k][1]);
  }
}

void sinkhorn_backward_4(const SinkhornBuffers& b, const float* dh_res, double* dlogits) {
  Pair g[8], products[8];
  for (int64_t k = 0; k < 8; ++k) g[k] = Pair{dh_res[2 * k], dh_res[2 * k + 1]};
  auto multiply = [&](const double* y) {
    for (int64_t k = 0; k < 8; ++k) products[k] = g[k] * load_pair(y + 2 * k);
  };
  for (int64_t step = 2 * b.iters - 2;; step -= 2) {
    // The column step `step`.
    multiply(b.steps + step * 16);
    const Pair dots_left = ((products[0] + products[2]) + products[4]) + products[6];
    const Pair dots_right = ((products[1] + products[3]) + products[5]) + products[7];
    const Pair q_left = load_pair(b.inverses + step * 4),
               q_right = load_pair(b.inverses + step * 4 + 2);
    for (int64_t i = 0; i < 4; ++i) {
      g[2 * i] = (g[2 * i] - dots_left) * q_left;
      g[2 * i + 1] = (g[2 * i + 1] - dots_right) * q_right;
    }
    if (step == 0) break;
    // The row step before it.
    multiply(b.steps + (step - 1) * 16);
    for (int64_t i = 0; i < 4; i += 2) {
      const Pair dots = row_sums(products, i), q = load_pair(b.inverses + (step - 1) * 4 + i);
      const Pair dot_first = lows(dots, dots), dot_second = highs(dots, dots);
      const Pair q_first = lows(q, q), q_second = highs(q, q);
      g[2 * i] = (g[2 * i] - dot_first) * q_first;
      g[2 * i + 1] = (g[2 * i + 1] - dot_first) * q_first;
      g[2 * i + 2] = (g[2 * i + 2] - dot_second) * q_second;
      g[2 * i + 3] = (g[2 * i + 3] - dot_second) * q_second;
    }
  }
  // The row softmax: dlogits = s * (g - dot(g, s)) per row.
  multiply(b.softmax);
  for (int64_t i = 0; i < 4; i += 2) {
    const Pair dots = row_sums(products, i);
    const Pair dot_first = lows(dots, dots), dot_second = highs(dots, dots);
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t first = 2 * i + half, second = 2 * i + 2 + half;
      store_pair(dlogits + 2 * first, load_pair(b.softmax + 2 * first) * (g[first] - dot_first));
      store_pair(dlogits + 2 * second,
                 load_pair(b.softmax + 2 * second) * (g[second] - dot_second));
    }
  }
}
}  // namespace

TokenCoefficients::TokenCoefficients(const Config& config, const float* alpha, const float* bias,
                                     bool pre_gates_only, Loops loops)
    : config_(config),
      alpha_(alpha),
      bias_(bias),
      pre_gates_only_(pre_gates_only),
      n_(config.n),
      N_(pre_gates_only ? config.n : projection_width(config)),
      R_(pre_gates_only ? 0 : residual_logits(config)),
      loops_(loops),
      logits_(static_cast<size_t>(N_)),
      sigmoids_(static_cast<size_t>(2 * n_)),
      softmax_(static_cast<size_t>(R_)),
      dlogits_(static_cast<size_t>(N_)) {
  if (pre_gates_only) return;
  if (config.mix == Mix::sinkhorn) {
    const int64_t steps = 2 * config.sinkhorn_iters - 1;
    steps_.resize(static_cast<size_t>(steps * n_ * n_));
    inverses_.resize(static_cast<size_t>(steps * n_));
    work_.resize(static_cast<size_t>(n_ * n_ + n_));
  } else {
    work_.resize(static_cast<size_t>(n_ * n_ + R_));
    for (int64_t p = 0; p < R_; ++p) {
      const std::vector<int> perm = permutation(n_, p);
      perm_targets_.insert(perm_targets_.end(), perm.begin(), perm.end());
    }
  }
}

void TokenCoefficients::forward(const float* P, double r, float* h_pre, float* h_post,
                                float* h_res) {
  const int64_t n = n_;
  const int groups = pre_gates_only_ ? 1 : 3;
  for (int group = 0; group < groups; ++group) {
    const double alpha = alpha_[group];
    const int64_t end = group == 2 ? N_ : (group + 1) * n;
    for (int64_t c = group * n; c < end; ++c) logits_[c] = alpha * (r * P[c]) + bias_[c];
  }
  for (int64_t k = 0; k < n; ++k) {
    sigmoids_[k] = sigmoid(logits_[k]);
    h_pre[k] = static_cast<float>(sigmoids_[k] + config_.pre_eps);
  }
  if (pre_gates_only_) return;
  for (int64_t k = 0; k < n; ++k) {
    sigmoids_[n + k] = sigmoid(logits_[n + k]);
    h_post[k] = static_cast<float>(config_.post_scale * sigmoids_[n + k]);
  }
  if (config_.mix == Mix::permutations) {
    permutations_forward(h_res);
    return;
  }
  for (int64_t i = 0; i < n; ++i) softmax(logits_.data() + 2 * n + i * n, n, &softmax_[i * n]);
  const SinkhornBuffers buffers =
      sinkhorn_buffers(config_, n, softmax_.data(), steps_.data(), inverses_.data(), work_.data());
  if (n == 4 && loops_ == Loops::specialized) {
    sinkhorn_forward_4(buffers, h_res);
  } else {
    sinkhorn_forward(buffers, h_res);
  }
}

void TokenCoefficients::permutations_forward(float* h_res) {
  const int64_t n = n_;
  softmax(logits_.data() + 2 * n, R_, softmax_.data());
  double* mix = work_.data();
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
    const double s_pre = sigmoids_[k];
    da[k] = dh_pre[k] * s_pre * (1.0 - s_pre);
  }
  if (!pre_gates_only_) {
    for (int64_t k = 0; k < n; ++k) {
      const double s_post = sigmoids_[n + k];
      da[n + k] = dh_post[k] * double{config_.post_scale} * s_post * (1.0 - s_post);
    }
    if (config_.mix == Mix::permutations) {
      permutations_backward(dh_res, da + 2 * n);
    } else {
      const SinkhornBuffers buffers = sinkhorn_buffers(config_, n, softmax_.data(), steps_.data(),
                                                       inverses_.data(), work_.data());
      if (n == 4 && loops_ == Loops::specialized) {
        sinkhorn_backward_4(buffers, dh_res, da + 2 * n);
      } else {
        sinkhorn_backward(buffers, dh_res, da + 2 * n);
      }
    }
  }
  // Per group, the terms in column order into one running sum each (dr over all columns).
  double dr_total = 0.0;
  const int groups = pre_gates_only_ ? 1 : 3;
  for (int group = 0; group < groups; ++group) {
    const double alpha = alpha_[group];
    double dalpha_group = dalpha[group];
    const int64_t end = group == 2 ? N_ : (group + 1) * n;
    for (int64_t c = group * n; c < end; ++c) {
      dbias[c] += da[c];
      dalpha_group += da[c] * (r * P[c]);
      const double dZ = alpha * da[c];
      dr_total += dZ * P[c];
      dP[c] = static_cast<float>(r * dZ);
    }
    dalpha[group] = dalpha_group;
  }
  *dr = dr_total;
}

void TokenCoefficients::permutations_backward(const float* dh_res, double* dlogits) {
  const int64_t n = n_;
  double* dweights = work_.data() + n * n;
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
