// pre_backward on the CPU (spec: Backward from "Pre-apply" to the end), fused and split for
// tensor parallelism (pre_backward_finish reads P, the sum of squares and dh_pre from the
// caller's all-reduced partials instead of computing them from this slice of x).
//
// Per token tile, first sweep: recompute r, P (projection), the gates and the whole Sinkhorn
// history; dH_pre = <x_k, dli>; the per-token coefficient backward gives dP and dr.
// Second sweep over the same cached tile:
//   dx = dx_partial + H_pre dli + dP (norm_weight * phi)^T - dr r^3 x / M
//   G[c, m] += x[t, m] dP[t, c]           (then dphi = norm_weight * G, dnorm_weight = sum_c phi G)
//
// Determinism: tiles are grouped into chunks whose boundaries depend on the shapes only. A chunk
// runs its tiles in order on one worker and owns double accumulators for G, dalpha and dbias
// (each tile's weight-gradient sums are f32, see projection.h); the chunks are summed in chunk
// order at the end.
// No result depends on the thread count.
#include <cmath>
#include <type_traits>

#include "coefficients.h"
#include "kernels.h"
#include "projection.h"
#include "thread_pool.h"
#include "tiles.h"

namespace mhc::cpu {

namespace {

// Chunks of tiles, each with its own [N, M] gradient accumulator: up to 16 for parallelism, but
// no more than about 256 MiB of accumulators in all.
int64_t chunk_count(int64_t tiles, int64_t M, int64_t N) {
  constexpr int64_t kMaxChunks = 16;
  constexpr int64_t kBudgetDoubles = int64_t{1} << 25;
  const int64_t affordable = std::max<int64_t>(1, kBudgetDoubles / (M * N));
  return std::min({tiles, kMaxChunks, affordable});
}

// What the split form supplies instead of computing it: summed partials [T, N+1] (P and the sum
// of squares) and the summed dh_pre [T, n]; both null in the fused form.
struct Supplied {
  const float* partials = nullptr;
  const float* dh_pre = nullptr;
};

// Tokens per tile: larger than the forward's, because each tile adds its weight-gradient sums to
// the [N, M] double accumulator, which does not fit in L2 (3 MiB for n = 4, D = 4096); 64 tokens
// amortize that read-modify-write. The tile's f32 copies (x, dx: 2 x 4 MiB there) stay in L3.
inline int64_t backward_tile_tokens(int64_t M) {
  constexpr int64_t kTileFloats = int64_t{1} << 20;
  return std::clamp<int64_t>(kTileFloats / M, 1, 64);
}

template <class X>
void run(const Config& config, const detail::Dims& dims, const X* dlayer_in, const X* dx_partial,
         const float* dh_post, const float* dh_res, const X* x, Supplied supplied,
         const Params& params, X* dx, const ParamGrads& grads) {
  const int64_t T = dims.T, n = dims.n, D = dims.D, M = dims.M, N = dims.N;
  const auto* norm_weight = static_cast<const float*>(params.norm_weight.data);
  const auto* phi = static_cast<const float*>(params.phi.data);
  const auto* alpha = static_cast<const float*>(params.alpha.data);
  const auto* bias = static_cast<const float*>(params.bias.data);
  auto* dnorm_weight = static_cast<float*>(grads.norm_weight.data);
  auto* dphi = static_cast<float*>(grads.phi.data);
  auto* dalpha = static_cast<float*>(grads.alpha.data);
  auto* dbias = static_cast<float*>(grads.bias.data);
  if (T == 0) {
    std::fill(dnorm_weight, dnorm_weight + M, 0.0f);
    std::fill(dphi, dphi + M * N, 0.0f);
    std::fill(dalpha, dalpha + 3, 0.0f);
    std::fill(dbias, dbias + N, 0.0f);
    return;
  }
  // The projection is recomputed only when the caller supplies no partials.
  const ProjectionWeight weight(
      norm_weight, phi, M, N, supplied.partials == nullptr ? kRowLayout | kColLayout : kColLayout);
  const int64_t tile = backward_tile_tokens(M);
  const int64_t tiles = ceil_div(T, tile);
  const int64_t chunks = chunk_count(tiles, M, N);
  ThreadPool& pool = ThreadPool::instance();
  const int workers = static_cast<int>(std::min<int64_t>(pool.threads(), chunks));

  // Per chunk: G [N, M], then dalpha [3] and dbias [N] in `small`.
  thread_local std::vector<double> G_storage;
  const auto G_size = static_cast<size_t>(chunks * N * M);
  double* G = workspace(G_storage, G_size);
  std::fill_n(G, G_size, 0.0);
  std::vector<double> small(static_cast<size_t>(chunks * (N + 3)), 0.0);

  // f32 staging of a tile of x, dlayer_in and dx per worker (bf16 only).
  constexpr bool kWiden = std::is_same_v<X, bf16>;
  thread_local std::vector<float> staging_storage;
  const int64_t stage = kWiden ? tile * (2 * M + D) : 0;
  float* staging = workspace(staging_storage, static_cast<size_t>(workers * stage));

  struct Scratch {
    float *x, *dlayer_in, *dx;    // f32 staging (bf16 only)
    std::vector<float> P, dP;     // [tile, N]
    std::vector<float> h_pre;     // [tile, n]
    std::vector<float> rms_term;  // [tile]: dr r^3 / M
    std::vector<float> unused;    // h_post, h_res of the recompute [n + n*n]
    std::vector<double> dh_pre;   // [n]
    TokenCoefficients coefficients;
  };
  std::vector<Scratch> scratch;
  scratch.reserve(static_cast<size_t>(workers));
  for (int w = 0; w < workers; ++w) {
    // f32 activations need no staging (the pointers stay null, never offset).
    float* mine = kWiden ? staging + w * stage : nullptr;
    scratch.push_back(Scratch{
        mine, kWiden ? mine + tile * M : nullptr, kWiden ? mine + tile * (M + D) : nullptr,
        std::vector<float>(static_cast<size_t>(tile * N)),
        std::vector<float>(static_cast<size_t>(tile * N)),
        std::vector<float>(static_cast<size_t>(tile * n)),
        std::vector<float>(static_cast<size_t>(tile)),
        std::vector<float>(static_cast<size_t>(n + n * n)),
        std::vector<double>(static_cast<size_t>(n)), TokenCoefficients(config, alpha, bias)});
  }

  pool.parallel_for(chunks, workers, [&](int64_t chunk, int worker) {
    Scratch& s = scratch[static_cast<size_t>(worker)];
    double* G_chunk = G + chunk * N * M;
    double* dalpha_chunk = small.data() + chunk * (N + 3);
    double* dbias_chunk = dalpha_chunk + 3;
    const int64_t first = chunk * tiles / chunks, last = (chunk + 1) * tiles / chunks;
    for (int64_t task = first; task < last; ++task) {
      const int64_t t0 = task * tile;
      const int64_t tokens = std::min(tile, T - t0);
      const float* xf = as_f32(x + t0 * M, tokens * M, s.x);
      const float* dli = as_f32(dlayer_in + t0 * D, tokens * D, s.dlayer_in);

      // First sweep: recompute (or read) P and r, then the coefficient backward per token.
      if (supplied.partials == nullptr) project(xf, tokens, weight, s.P.data());
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t token = t0 + t;
        const float* xt = xf + t * M;
        const float* P = s.P.data() + t * N;
        double squares = 0.0;
        if (supplied.partials == nullptr) {
          squares = sum_squares(xt, M);
        } else {
          P = supplied.partials + token * (N + 1);
          squares = P[N];
        }
        const double r = inverse_rms(squares, dims.M_full, config.rms_eps);
        float* pre = s.h_pre.data() + t * n;
        s.coefficients.forward(P, r, pre, s.unused.data(), s.unused.data() + n);
        for (int64_t k = 0; k < n; ++k) {
          s.dh_pre[k] = supplied.dh_pre != nullptr ? supplied.dh_pre[token * n + k]
                                                   : dot(xt + k * D, dli + t * D, D);
        }
        double dr = 0.0;
        s.coefficients.backward(P, r, s.dh_pre.data(), dh_post + token * n, dh_res + token * n * n,
                                s.dP.data() + t * N, &dr, dalpha_chunk, dbias_chunk);
        s.rms_term[t] = static_cast<float>(dr * r * r * r / static_cast<double>(dims.M_full));
      }

      // Second sweep: dx and the weight gradient from the cached tile.
      float* dxf = f32_target(dx + t0 * M, s.dx);
      const float* dxp = as_f32(dx_partial + t0 * M, tokens * M, dxf);
      if (dxp != dxf) std::copy(dxp, dxp + tokens * M, dxf);
      for (int64_t t = 0; t < tokens; ++t) {
        float* dxt = dxf + t * M;
        for (int64_t k = 0; k < n; ++k) axpy(s.h_pre[t * n + k], dli + t * D, dxt + k * D, D);
        axpy(-s.rms_term[t], xf + t * M, dxt, M);
      }
      add_projection_grad(s.dP.data(), tokens, weight, dxf);
      accumulate_weight_grad(xf, s.dP.data(), tokens, M, N, G_chunk);
      store_from(dxf, dx + t0 * M, tokens * M);
    }
  });

  // Fixed-order reduction of the chunks, parallel over rows m of phi.
  constexpr int64_t kRows = 256;
  pool.parallel_for(ceil_div(M, kRows), pool.threads(), [&](int64_t task, int) {
    const int64_t end = std::min(M, (task + 1) * kRows);
    for (int64_t m = task * kRows; m < end; ++m) {
      // In double: dnorm_weight sums N signed terms per row, which can cancel.
      double through_norm_weight = 0.0;
      for (int64_t c = 0; c < N; ++c) {
        double total = 0.0;
        const int64_t at = weight_grad_index(c, m, M, N);
        for (int64_t k = 0; k < chunks; ++k) total += G[k * N * M + at];
        dphi[m * N + c] = static_cast<float>(norm_weight[m] * total);
        through_norm_weight += phi[m * N + c] * total;
      }
      dnorm_weight[m] = static_cast<float>(through_norm_weight);
    }
  });
  for (int64_t c = 0; c < N + 3; ++c) {
    double total = 0.0;
    for (int64_t k = 0; k < chunks; ++k) total += small[static_cast<size_t>(k * (N + 3) + c)];
    if (c < 3) {
      dalpha[c] = static_cast<float>(total);
    } else {
      dbias[c - 3] = static_cast<float>(total);
    }
  }
}

template <class X>
void run_partials(const detail::Dims& dims, const X* dlayer_in, const X* x, float* dh_pre) {
  const int64_t T = dims.T, n = dims.n, D = dims.D, M = dims.M;
  const int64_t tile = post_tile_tokens(M);
  const int64_t tasks = ceil_div(T, tile);
  ThreadPool& pool = ThreadPool::instance();
  const int workers = static_cast<int>(std::min<int64_t>(pool.threads(), tasks));
  constexpr bool kWiden = std::is_same_v<X, bf16>;
  struct Scratch {
    std::vector<float> x, dlayer_in;
  };
  std::vector<Scratch> scratch;
  scratch.reserve(static_cast<size_t>(workers));
  for (int w = 0; w < workers; ++w) {
    scratch.push_back(Scratch{std::vector<float>(kWiden ? static_cast<size_t>(M) : 0),
                              std::vector<float>(kWiden ? static_cast<size_t>(D) : 0)});
  }
  pool.parallel_for(tasks, workers, [&](int64_t task, int worker) {
    Scratch& s = scratch[static_cast<size_t>(worker)];
    const int64_t end = std::min(T, (task + 1) * tile);
    for (int64_t t = task * tile; t < end; ++t) {
      const float* xt = as_f32(x + t * M, M, s.x.data());
      const float* dli = as_f32(dlayer_in + t * D, D, s.dlayer_in.data());
      for (int64_t k = 0; k < n; ++k)
        dh_pre[t * n + k] = static_cast<float>(dot(xt + k * D, dli, D));
    }
  });
}

void run_any(const Config& config, const detail::Dims& dims, const TensorRef& dlayer_in,
             const TensorRef& dx_partial, const TensorRef& dh_post, const TensorRef& dh_res,
             const TensorRef& x, Supplied supplied, const Params& params,
             const MutableTensorRef& dx, const ParamGrads& grads) {
  with_activation_type(x.dtype, [&](auto tag) {
    using X = decltype(tag);
    run(config, dims, static_cast<const X*>(dlayer_in.data), static_cast<const X*>(dx_partial.data),
        static_cast<const float*>(dh_post.data), static_cast<const float*>(dh_res.data),
        static_cast<const X*>(x.data), supplied, params, static_cast<X*>(dx.data), grads);
  });
}

}  // namespace

void pre_backward(const Config& config, const detail::Dims& dims, const TensorRef& dlayer_in,
                  const TensorRef& dx_partial, const TensorRef& dh_post, const TensorRef& dh_res,
                  const TensorRef& x, const Params& params, const MutableTensorRef& dx,
                  const ParamGrads& grads) {
  run_any(config, dims, dlayer_in, dx_partial, dh_post, dh_res, x, Supplied{}, params, dx, grads);
}

void pre_backward_partials(const detail::Dims& dims, const TensorRef& dlayer_in, const TensorRef& x,
                           float* dh_pre) {
  with_activation_type(x.dtype, [&](auto tag) {
    using X = decltype(tag);
    run_partials(dims, static_cast<const X*>(dlayer_in.data), static_cast<const X*>(x.data),
                 dh_pre);
  });
}

void pre_backward_finish(const Config& config, const detail::Dims& dims, const TensorRef& dlayer_in,
                         const TensorRef& dx_partial, const float* dh_pre, const TensorRef& dh_post,
                         const TensorRef& dh_res, const TensorRef& x, const float* partials,
                         const Params& params, const MutableTensorRef& dx,
                         const ParamGrads& grads) {
  run_any(config, dims, dlayer_in, dx_partial, dh_post, dh_res, x, Supplied{partials, dh_pre},
          params, dx, grads);
}

}  // namespace mhc::cpu
