// The float64 reference: each function is the spec's formulas as plain loops, one token at a time.
#include "mhc/reference.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace mhc::reference {

namespace {

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// The active RoundingNoise of this thread (unit 0: none).
struct Noise {
  std::mt19937_64 rng;
  double unit = 0.0;
};
thread_local Noise noise;

// `value` as a kernel may hold it after rounding to f32: unchanged unless a RoundingNoise is alive.
double rounded(double value) {
  if (noise.unit == 0.0) return value;
  std::uniform_real_distribution<double> u(-noise.unit, noise.unit);
  return value * (1.0 + u(noise.rng));
}

// Row-wise softmax of an n x n matrix.
Vec softmax_rows(const double* logits, int64_t n) {
  Vec result(static_cast<size_t>(n * n));
  for (int64_t i = 0; i < n; ++i) {
    double largest = logits[i * n];
    for (int64_t j = 1; j < n; ++j) largest = std::fmax(largest, logits[i * n + j]);
    double total = 0.0;
    for (int64_t j = 0; j < n; ++j) total += std::exp(logits[i * n + j] - largest);
    for (int64_t j = 0; j < n; ++j)
      result[i * n + j] = std::exp(logits[i * n + j] - largest) / total;
  }
  return result;
}

Vec softmax(const double* logits, int64_t count) {
  double largest = logits[0];
  for (int64_t p = 1; p < count; ++p) largest = std::fmax(largest, logits[p]);
  double total = 0.0;
  for (int64_t p = 0; p < count; ++p) total += std::exp(logits[p] - largest);
  Vec result(static_cast<size_t>(count));
  for (int64_t p = 0; p < count; ++p) result[p] = std::exp(logits[p] - largest) / total;
  return result;
}

// One normalization step Y = X / (sums + eps), over rows or over columns, kept for the backward.
struct SinkhornStep {
  bool over_columns;
  Vec sums;    // [n]
  Vec result;  // Y, n x n
};

struct SinkhornTrace {
  Vec softmax;  // before + eps
  std::vector<SinkhornStep> steps;
};

SinkhornStep normalize(const Vec& matrix, int64_t n, bool over_columns, double eps) {
  SinkhornStep step{over_columns, Vec(static_cast<size_t>(n), 0.0), matrix};
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) step.sums[over_columns ? j : i] += matrix[i * n + j];
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) step.result[i * n + j] /= step.sums[over_columns ? j : i] + eps;
  }
  return step;
}

// Spec step 5 (sinkhorn): softmax over rows + eps, a column step, then (row, column) x (iters-1).
SinkhornTrace sinkhorn(const Config& config, const double* logits) {
  const int64_t n = config.n;
  const double eps = config.sinkhorn_eps;
  SinkhornTrace trace;
  trace.softmax = softmax_rows(logits, n);
  Vec current = trace.softmax;
  for (double& v : current) v += eps;
  trace.steps.push_back(normalize(current, n, true, eps));
  for (int64_t iter = 1; iter < config.sinkhorn_iters; ++iter) {
    trace.steps.push_back(normalize(trace.steps.back().result, n, false, eps));
    trace.steps.push_back(normalize(trace.steps.back().result, n, true, eps));
  }
  return trace;
}

// Gradient of the residual logits from dH_res (spec: Backward, Sinkhorn and Permutations).
Vec mix_matrix_backward(const Config& config, const double* logits, const double* dh_res) {
  const int64_t n = config.n;
  if (config.mix == Mix::permutations) {
    const int64_t count = residual_logits(config);
    const Vec weights = softmax(logits, count);
    Vec dweights(static_cast<size_t>(count), 0.0);
    double weighted = 0.0;
    for (int64_t p = 0; p < count; ++p) {
      const std::vector<int> perm = permutation(n, p);
      for (int64_t i = 0; i < n; ++i) dweights[p] += dh_res[i * n + perm[i]];
      weighted += weights[p] * dweights[p];
    }
    Vec dlogits(static_cast<size_t>(count));
    for (int64_t p = 0; p < count; ++p) dlogits[p] = weights[p] * (dweights[p] - weighted);
    return dlogits;
  }
  const SinkhornTrace trace = sinkhorn(config, logits);
  Vec dmatrix(dh_res, dh_res + n * n);  // gradient w.r.t. the latest result
  for (size_t s = trace.steps.size(); s-- > 0;) {
    const SinkhornStep& step = trace.steps[s];
    Vec dots(static_cast<size_t>(n), 0.0);  // rowdot (or column dot) of dY with Y
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        dots[step.over_columns ? j : i] += dmatrix[i * n + j] * step.result[i * n + j];
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t k = step.over_columns ? j : i;
        dmatrix[i * n + j] = (dmatrix[i * n + j] - dots[k]) / (step.sums[k] + config.sinkhorn_eps);
      }
    }
  }
  // dmatrix is now dS; the softmax backward (eps carries no gradient).
  Vec dlogits(static_cast<size_t>(n * n));
  for (int64_t i = 0; i < n; ++i) {
    double dot = 0.0;
    for (int64_t k = 0; k < n; ++k) dot += dmatrix[i * n + k] * trace.softmax[i * n + k];
    for (int64_t j = 0; j < n; ++j) {
      dlogits[i * n + j] = trace.softmax[i * n + j] * (dmatrix[i * n + j] - dot);
    }
  }
  return dlogits;
}

// Everything the forward computes for one token before the pre-apply (spec: steps 1-5).
struct TokenCoefficients {
  double r = 0.0;
  Vec P, Z, a;  // [N]
  Vec h_pre, h_post, h_res;
};

TokenCoefficients token_coefficients(const Config& config, const double* x, const Params& params) {
  const int64_t n = config.n;
  const int64_t M = flat_width(config);
  const int64_t N = projection_width(config);
  TokenCoefficients tc;
  double sum_squares = 0.0;
  for (int64_t m = 0; m < M; ++m) sum_squares += x[m] * x[m];
  tc.r = rounded(1.0 / std::sqrt(sum_squares / static_cast<double>(M) + config.rms_eps));
  tc.P.assign(static_cast<size_t>(N), 0.0);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < N; ++c) tc.P[c] += x[m] * params.norm_weight[m] * params.phi[m * N + c];
  }
  for (double& projection : tc.P) projection = rounded(projection);
  tc.Z.resize(static_cast<size_t>(N));
  tc.a.resize(static_cast<size_t>(N));
  for (int64_t c = 0; c < N; ++c) {
    const int group = c < n ? 0 : (c < 2 * n ? 1 : 2);
    tc.Z[c] = tc.r * tc.P[c];
    tc.a[c] = rounded(params.alpha[group] * tc.Z[c] + params.bias[c]);
  }
  for (int64_t k = 0; k < n; ++k) {
    tc.h_pre.push_back(rounded(sigmoid(tc.a[k]) + config.pre_eps));
    tc.h_post.push_back(rounded(config.post_scale * sigmoid(tc.a[n + k])));
  }
  tc.h_res = mix_matrix(config, tc.a.data() + 2 * n);
  for (double& coefficient : tc.h_res) coefficient = rounded(coefficient);
  return tc;
}

}  // namespace

RoundingNoise::RoundingNoise(uint64_t seed, double unit) {
  noise.rng.seed(seed);
  noise.unit = unit;
}

RoundingNoise::~RoundingNoise() { noise.unit = 0.0; }

Vec mix_matrix(const Config& config, const double* logits) {
  const int64_t n = config.n;
  if (config.mix == Mix::sinkhorn) return sinkhorn(config, logits).steps.back().result;
  const int64_t count = residual_logits(config);
  const Vec weights = softmax(logits, count);
  Vec h_res(static_cast<size_t>(n * n), 0.0);
  for (int64_t p = 0; p < count; ++p) {
    const std::vector<int> perm = permutation(n, p);
    for (int64_t i = 0; i < n; ++i) h_res[i * n + perm[i]] += weights[p];
  }
  return h_res;
}

PreForward pre_forward(const Config& config, const Vec& x, const Params& params) {
  const int64_t n = config.n, D = config.dim, M = flat_width(config);
  const int64_t T = static_cast<int64_t>(x.size()) / M;
  PreForward out{Vec(static_cast<size_t>(T * D), 0.0), {}, {}, {}};
  for (int64_t t = 0; t < T; ++t) {
    const double* xt = x.data() + t * M;
    const TokenCoefficients tc = token_coefficients(config, xt, params);
    for (int64_t k = 0; k < n; ++k) {
      for (int64_t d = 0; d < D; ++d) out.layer_in[t * D + d] += tc.h_pre[k] * xt[k * D + d];
    }
    out.h_pre.insert(out.h_pre.end(), tc.h_pre.begin(), tc.h_pre.end());
    out.h_post.insert(out.h_post.end(), tc.h_post.begin(), tc.h_post.end());
    out.h_res.insert(out.h_res.end(), tc.h_res.begin(), tc.h_res.end());
  }
  return out;
}

Vec post_forward(const Config& config, const Vec& x, const Vec& layer_out, const Vec& h_post,
                 const Vec& h_res) {
  const int64_t n = config.n, D = config.dim;
  const int64_t T = static_cast<int64_t>(x.size()) / (n * D);
  Vec out(x.size(), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t d = 0; d < D; ++d) {
        double value = h_post[t * n + j] * layer_out[t * D + d];
        for (int64_t i = 0; i < n; ++i)
          value += h_res[(t * n + i) * n + j] * x[(t * n + i) * D + d];
        out[(t * n + j) * D + d] = value;
      }
    }
  }
  return out;
}

PostBackward post_backward(const Config& config, const Vec& g, const Vec& x, const Vec& layer_out,
                           const Vec& h_post, const Vec& h_res) {
  const int64_t n = config.n, D = config.dim;
  const int64_t T = static_cast<int64_t>(x.size()) / (n * D);
  PostBackward out{Vec(x.size(), 0.0), Vec(static_cast<size_t>(T * D), 0.0),
                   Vec(static_cast<size_t>(T * n), 0.0), Vec(static_cast<size_t>(T * n * n), 0.0)};
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t j = 0; j < n; ++j) {
        const double gj = g[(t * n + j) * D + d];
        out.dlayer_out[t * D + d] += h_post[t * n + j] * gj;
        out.dh_post[t * n + j] += layer_out[t * D + d] * gj;
        for (int64_t i = 0; i < n; ++i) {
          out.dh_res[(t * n + i) * n + j] += x[(t * n + i) * D + d] * gj;
          out.dx_partial[(t * n + i) * D + d] += h_res[(t * n + i) * n + j] * gj;
        }
      }
    }
  }
  return out;
}

namespace {

// The weight of stream k in the pre-apply of token t: the carried mix [T, n], or, when it is
// empty, the one-hot on stream 0 (spec: Single-pass schedule).
double carried_weight(const Vec& carried, int64_t n, int64_t t, int64_t k) {
  if (carried.empty()) return k == 0 ? 1.0 : 0.0;
  return carried[t * n + k];
}

// pre_backward with its two sources of the pre-apply made explicit: `carried` null (V4) applies
// the sublayer's own H_pre and takes dH_pre = <x_k, dli>; otherwise (V4.1) the pre-apply reads
// *carried (empty: the one-hot), <x_k, dli> goes to dcarried, and the gates take `dh_pre_in`.
PreBackward pre_backward_general(const Config& config, const Vec& dlayer_in, const Vec& dx_partial,
                                 const Vec* dh_pre_in, const Vec& dh_post, const Vec& dh_res,
                                 const Vec& x, const Vec* carried, const Params& params,
                                 Vec* dcarried) {
  const int64_t n = config.n, D = config.dim, M = flat_width(config);
  const int64_t N = projection_width(config);
  const int64_t T = static_cast<int64_t>(x.size()) / M;
  PreBackward out;
  out.dx = dx_partial;
  out.grads = Params{Vec(static_cast<size_t>(M), 0.0), Vec(static_cast<size_t>(M * N), 0.0),
                     Vec(3, 0.0), Vec(static_cast<size_t>(N), 0.0)};
  if (carried != nullptr && !carried->empty()) dcarried->assign(static_cast<size_t>(T * n), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const double* xt = x.data() + t * M;
    const double* dli = dlayer_in.data() + t * D;
    const TokenCoefficients tc = token_coefficients(config, xt, params);

    // Pre-apply: dx += H_pre dli, dH_pre = <x_k, dli> (V4); dx += p dli, dp = <x_k, dli> (V4.1).
    Vec da(static_cast<size_t>(N), 0.0);
    for (int64_t k = 0; k < n; ++k) {
      const double weight = carried == nullptr ? tc.h_pre[k] : carried_weight(*carried, n, t, k);
      double dh_pre = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        out.dx[t * M + k * D + d] += weight * dli[d];
        dh_pre += xt[k * D + d] * dli[d];
      }
      if (carried != nullptr) {
        if (!carried->empty()) (*dcarried)[t * n + k] = dh_pre;
        dh_pre = (*dh_pre_in)[t * n + k];
      }
      // Gates (pre_eps carries no gradient).
      const double s_pre = sigmoid(tc.a[k]);
      da[k] = dh_pre * s_pre * (1.0 - s_pre);
      const double s_post = sigmoid(tc.a[n + k]);
      da[n + k] = dh_post[t * n + k] * config.post_scale * s_post * (1.0 - s_post);
    }
    const Vec dres = mix_matrix_backward(config, tc.a.data() + 2 * n, dh_res.data() + t * n * n);
    for (int64_t c = 2 * n; c < N; ++c) da[c] = dres[c - 2 * n];
    for (double& gradient : da) gradient = rounded(gradient);

    // Scales, biases, then back through Z = r P.
    Vec dP(static_cast<size_t>(N));
    double dr = 0.0;
    for (int64_t c = 0; c < N; ++c) {
      const int group = c < n ? 0 : (c < 2 * n ? 1 : 2);
      out.grads.bias[c] += da[c];
      out.grads.alpha[group] += da[c] * tc.Z[c];
      const double dZ = params.alpha[group] * da[c];
      dP[c] = rounded(tc.r * dZ);
      dr += dZ * tc.P[c];
    }
    dr = rounded(dr);

    // Projection and the RMS statistic.
    for (int64_t m = 0; m < M; ++m) {
      double through_projection = 0.0;
      for (int64_t c = 0; c < N; ++c) {
        out.grads.phi[m * N + c] += params.norm_weight[m] * xt[m] * dP[c];
        out.grads.norm_weight[m] += params.phi[m * N + c] * xt[m] * dP[c];
        through_projection += dP[c] * params.norm_weight[m] * params.phi[m * N + c];
      }
      out.dx[t * M + m] +=
          rounded(through_projection) - dr * tc.r * tc.r * tc.r * xt[m] / static_cast<double>(M);
    }
  }
  return out;
}

}  // namespace

PreBackward pre_backward(const Config& config, const Vec& dlayer_in, const Vec& dx_partial,
                         const Vec& dh_post, const Vec& dh_res, const Vec& x,
                         const Params& params) {
  return pre_backward_general(config, dlayer_in, dx_partial, nullptr, dh_post, dh_res, x, nullptr,
                              params, nullptr);
}

PreForward pre_forward_carried(const Config& config, const Vec& x, const Vec& carried,
                               const Params& params) {
  // Steps 1-5 as in V4; step 6 reads the carried mix, the same sum as the final collapse.
  PreForward out = pre_forward(config, x, params);
  out.layer_in = collapse_forward(config, x, carried);
  return out;
}

PreBackwardCarried pre_backward_carried(const Config& config, const Vec& dlayer_in,
                                        const Vec& dx_partial, const Vec& dh_pre,
                                        const Vec& dh_post, const Vec& dh_res, const Vec& x,
                                        const Vec& carried, const Params& params) {
  PreBackwardCarried out;
  PreBackward back = pre_backward_general(config, dlayer_in, dx_partial, &dh_pre, dh_post, dh_res,
                                          x, &carried, params, &out.dcarried);
  out.dx = std::move(back.dx);
  out.grads = std::move(back.grads);
  return out;
}

Vec collapse_forward(const Config& config, const Vec& x, const Vec& carried) {
  const int64_t n = config.n, D = config.dim;
  const int64_t T = static_cast<int64_t>(x.size()) / (n * D);
  Vec out(static_cast<size_t>(T * D), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < n; ++k) {
      const double weight = carried_weight(carried, n, t, k);
      for (int64_t d = 0; d < D; ++d) out[t * D + d] += weight * x[(t * n + k) * D + d];
    }
  }
  return out;
}

CollapseBackward collapse_backward(const Config& config, const Vec& dout, const Vec& x,
                                   const Vec& carried) {
  const int64_t n = config.n, D = config.dim;
  const int64_t T = static_cast<int64_t>(x.size()) / (n * D);
  CollapseBackward out{Vec(x.size(), 0.0), Vec(carried.empty() ? 0 : static_cast<size_t>(T * n))};
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < n; ++k) {
      const double weight = carried_weight(carried, n, t, k);
      double dweight = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        out.dx[(t * n + k) * D + d] = weight * dout[t * D + d];
        dweight += x[(t * n + k) * D + d] * dout[t * D + d];
      }
      if (!carried.empty()) out.dcarried[t * n + k] = dweight;
    }
  }
  return out;
}

BoundaryForward boundary_forward(const Config& config, const Vec& x, const Vec& layer_out,
                                 const Vec& h_post, const Vec& h_res, const Params& next_params) {
  BoundaryForward out;
  out.x_next = post_forward(config, x, layer_out, h_post, h_res);
  for (double& value : out.x_next) value = rounded(value);
  out.next = pre_forward(config, out.x_next, next_params);
  return out;
}

BoundaryBackward boundary_backward(const Config& config, const Vec& next_dlayer_in,
                                   const Vec& next_dx_partial, const Vec& next_dh_post,
                                   const Vec& next_dh_res, const Vec& x, const Vec& layer_out,
                                   const Vec& h_post, const Vec& h_res, const Params& next_params) {
  Vec x_next = post_forward(config, x, layer_out, h_post, h_res);
  for (double& value : x_next) value = rounded(value);
  PreBackward next = pre_backward(config, next_dlayer_in, next_dx_partial, next_dh_post,
                                  next_dh_res, x_next, next_params);
  return BoundaryBackward{post_backward(config, next.dx, x, layer_out, h_post, h_res),
                          std::move(next.grads)};
}

BoundaryForward boundary_forward_carried(const Config& config, const Vec& x, const Vec& layer_out,
                                         const Vec& h_pre, const Vec& h_post, const Vec& h_res,
                                         const Params& next_params) {
  BoundaryForward out;
  out.x_next = post_forward(config, x, layer_out, h_post, h_res);
  for (double& value : out.x_next) value = rounded(value);
  out.next = pre_forward_carried(config, out.x_next, h_pre, next_params);
  return out;
}

BoundaryBackwardCarried boundary_backward_carried(const Config& config, const Vec& next_dlayer_in,
                                                  const Vec& next_dx_partial,
                                                  const Vec& next_dh_pre, const Vec& next_dh_post,
                                                  const Vec& next_dh_res, const Vec& x,
                                                  const Vec& layer_out, const Vec& h_pre,
                                                  const Vec& h_post, const Vec& h_res,
                                                  const Params& next_params) {
  Vec x_next = post_forward(config, x, layer_out, h_post, h_res);
  for (double& value : x_next) value = rounded(value);
  const Vec& carried = h_pre;  // sublayer l's gates are the mix sublayer l+1 reads
  PreBackwardCarried next =
      pre_backward_carried(config, next_dlayer_in, next_dx_partial, next_dh_pre, next_dh_post,
                           next_dh_res, x_next, carried, next_params);
  return BoundaryBackwardCarried{post_backward(config, next.dx, x, layer_out, h_post, h_res),
                                 std::move(next.dcarried), std::move(next.grads)};
}

namespace {
// One token of the head up to the gates: r, the projections p_k = sum_m x_m fn[k, m] and the
// sigmoids s_k (gates = s + pre_eps).
struct HeadToken {
  double r;
  Vec p, s;
};

HeadToken head_token(const Config& config, const double* xt, const HeadParams& params) {
  const int64_t n = config.n, M = flat_width(config);
  double squares = 0.0;
  for (int64_t m = 0; m < M; ++m) squares += xt[m] * xt[m];
  HeadToken token{rounded(1.0 / std::sqrt(squares / static_cast<double>(M) + config.rms_eps)),
                  Vec(static_cast<size_t>(n)), Vec(static_cast<size_t>(n))};
  for (int64_t k = 0; k < n; ++k) {
    double dot = 0.0;
    for (int64_t m = 0; m < M; ++m) dot += xt[m] * params.fn[k * M + m];
    token.p[k] = rounded(dot);
    token.s[k] = rounded(sigmoid(rounded(params.scale[0] * token.r * token.p[k] + params.base[k])));
  }
  return token;
}
}  // namespace

HeadForward head_forward(const Config& config, const Vec& x, const HeadParams& params) {
  const int64_t n = config.n, D = config.dim, M = n * D;
  const int64_t T = static_cast<int64_t>(x.size()) / M;
  HeadForward result{Vec(static_cast<size_t>(T * D)), Vec(static_cast<size_t>(T * n))};
  for (int64_t t = 0; t < T; ++t) {
    const HeadToken token = head_token(config, x.data() + t * M, params);
    for (int64_t k = 0; k < n; ++k) {
      const double gate = token.s[k] + config.pre_eps;
      result.gates[t * n + k] = gate;
      for (int64_t d = 0; d < D; ++d) result.out[t * D + d] += gate * x[t * M + k * D + d];
    }
  }
  return result;
}

HeadBackward head_backward(const Config& config, const Vec& dout, const Vec& x,
                           const HeadParams& params) {
  const int64_t n = config.n, D = config.dim, M = n * D;
  const int64_t T = static_cast<int64_t>(x.size()) / M;
  HeadBackward result{
      Vec(static_cast<size_t>(T * M)),
      HeadParams{Vec(static_cast<size_t>(n * M)), Vec(static_cast<size_t>(n)), Vec(1)}};
  const double scale = params.scale[0];
  for (int64_t t = 0; t < T; ++t) {
    const double* xt = x.data() + t * M;
    const double* g = dout.data() + t * D;
    double* dxt = result.dx.data() + t * M;
    const HeadToken token = head_token(config, xt, params);
    // Through out = sum_k gate_k x_k, then gate_k = sigmoid(a_k) + pre_eps with
    // a_k = scale * r * p_k + base_k; r = (sum x^2 / M + eps)^(-1/2), dr/dx_m = -r^3 x_m / M.
    double dr = 0.0;
    for (int64_t k = 0; k < n; ++k) {
      double dgate = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        dgate += g[d] * xt[k * D + d];
        dxt[k * D + d] += (token.s[k] + config.pre_eps) * g[d];
      }
      const double da = rounded(dgate * token.s[k] * (1.0 - token.s[k]));
      result.grads.base[k] += da;
      result.grads.scale[0] += da * token.r * token.p[k];
      dr += da * scale * token.p[k];
      const double dp = rounded(da * scale * token.r);
      for (int64_t m = 0; m < M; ++m) {
        dxt[m] += dp * params.fn[k * M + m];
        result.grads.fn[k * M + m] += dp * xt[m];
      }
    }
    dr = rounded(dr);
    const double r3 = token.r * token.r * token.r;
    for (int64_t m = 0; m < M; ++m) dxt[m] -= dr * r3 * xt[m] / static_cast<double>(M);
  }
  return result;
}

}  // namespace mhc::reference
