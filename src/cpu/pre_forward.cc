// pre_forward on the CPU (spec: Forward steps 1-6), fused and split for tensor parallelism.
//
// Fused, per token tile: one sweep computes the sum of squares and the projection
// P = x (norm_weight * phi), the per-token math turns them into the coefficients, and a second
// sweep over the same cached tile applies H_pre. With fewer tiles than threads (decode), the
// projection of each tile is split over the threads by rows of W and its tokens then finish in
// parallel; the results are the same bits either way. The split form runs the first sweep alone
// (pre_forward_partials) and, after the caller's all-reduce, the rest from the summed partials
// (pre_forward_finish).
#include <cmath>
#include <type_traits>

#include "coefficients.h"
#include "kernels.h"
#include "post_tokens.h"
#include "projection.h"
#include "thread_pool.h"
#include "tiles.h"

namespace mhc::cpu {

namespace {

// Where each token's projection P [N] and sum of squares come from: computed from the tile of x
// with the folded weight, or read from summed partials [T, N+1] (weight is then null).
struct ProjectionSource {
  const FoldedWeight* weight = nullptr;
  const float* partials = nullptr;
};

// Per-worker buffers of the pre operations, sized for one tile.
struct PreScratch {
  float* x;                     // tile of x widened to f32 (bf16 only; null for f32)
  std::vector<float> P;         // [tile, N]
  std::vector<float> layer_in;  // [D] (bf16 only)
  TokenCoefficients coefficients;
};

template <class X>
std::vector<PreScratch> make_scratch(const Config& config, const detail::Dims& dims, int64_t tile,
                                     int workers, const float* alpha, const float* bias) {
  constexpr bool kWiden = std::is_same_v<X, bf16>;
  // The f32 staging persists across calls (a fresh multi-MiB buffer per call would be
  // zero-filled page by page; see workspace()), one tile per worker.
  thread_local std::vector<float> staging_storage;
  const int64_t stage = kWiden ? tile * dims.M : 0;
  float* staging = workspace(staging_storage, static_cast<size_t>(workers * stage));
  std::vector<PreScratch> scratch;
  scratch.reserve(static_cast<size_t>(workers));
  for (int w = 0; w < workers; ++w) {
    // With the rows split, worker 0's tile buffers are the shared ones.
    const bool tile_buffers = w == 0 || dims.T > tile;
    scratch.push_back(
        PreScratch{kWiden ? staging + w * stage : nullptr,
                   std::vector<float>(tile_buffers ? static_cast<size_t>(tile * dims.N) : 0),
                   std::vector<float>(kWiden ? static_cast<size_t>(dims.D) : 0),
                   TokenCoefficients(config, alpha, bias, dims.pre_gates_only)});
  }
  return scratch;
}

// Everything after the projection for token t of the tile from t0: r, the coefficients and the
// pre-apply. xf is the tile of x as f32; P_tile its projection (unused with partials).
template <class X>
void finish_token(const Config& config, const detail::Dims& dims, ProjectionSource source,
                  const float* xf, const float* P_tile, int64_t t0, int64_t t, PreScratch& s,
                  X* layer_in, float* h_pre, float* h_post, float* h_res) {
  const int64_t n = dims.n, D = dims.D, M = dims.M, N = dims.N;
  const int64_t token = t0 + t;
  const float* xt = xf + t * M;
  const float* P = P_tile + t * N;
  double squares = 0.0;
  if (source.weight != nullptr) {
    squares = sum_squares(xt, M);
  } else {
    P = source.partials + token * (N + 1);
    squares = P[N];
  }
  const double r = inverse_rms(squares, dims.M_full, config.rms_eps);
  float* pre = h_pre + token * n;
  if (dims.pre_gates_only) {  // the head: no h_post or h_res (null)
    s.coefficients.forward(P, r, pre, nullptr, nullptr);
  } else {
    s.coefficients.forward(P, r, pre, h_post + token * n, h_res + token * n * n);
  }
  float* li = f32_target(layer_in + token * D, s.layer_in.data());
  weighted_rows(xt, n, pre, D, li);
  store_from(li, layer_in + token * D, D);
}

// What happens to a tile of x before it is read: nothing (pre_forward reads x from memory), or,
// for the fused boundary, the previous sublayer's post writes it (tokens [begin, end) of x_next),
// so that the projection reads it back from cache.
struct ReadFromMemory {
  void operator()(int64_t, int64_t) const {}
};

template <class X, class Produce = ReadFromMemory>
void run(const Config& config, const detail::Dims& dims, const X* x, ProjectionSource source,
         const float* alpha, const float* bias, X* layer_in, float* h_pre, float* h_post,
         float* h_res, Produce produce = {}) {
  const int64_t T = dims.T, M = dims.M;
  if (T == 0) return;
  const int64_t tile = pre_tile_tokens(M);
  const int64_t tiles = ceil_div(T, tile);
  ThreadPool& pool = ThreadPool::instance();
  // With fewer tiles than threads (decode), each tile's projection is split over the threads by
  // rows of W instead, and its tokens finish in parallel.
  const int threads = pre_threads(T, M, dims.N, pool.threads());
  const bool split_rows = source.weight != nullptr && tiles < threads;
  const int workers = split_rows ? threads : static_cast<int>(std::min<int64_t>(threads, tiles));
  // Buffers for the tokens a tile really has: at decode sizes a whole tile's f32 staging (1 MiB,
  // zero-filled) cost as much as the rest of the call.
  std::vector<PreScratch> scratch =
      make_scratch<X>(config, dims, std::min(tile, T), workers, alpha, bias);
  auto finish = [&](const float* xf, const float* P, int64_t t0, int64_t t, int worker) {
    finish_token(config, dims, source, xf, P, t0, t, scratch[static_cast<size_t>(worker)], layer_in,
                 h_pre, h_post, h_res);
  };

  if (split_rows) {
    PreScratch& shared = scratch[0];
    for (int64_t t0 = 0; t0 < T; t0 += tile) {
      const int64_t tokens = std::min(tile, T - t0);
      produce(t0, t0 + tokens);
      const float* xf =
          project_split_rows(x + t0 * M, tokens, *source.weight, shared.x, shared.P.data());
      pool.parallel_for(tokens, workers,
                        [&](int64_t t, int worker) { finish(xf, shared.P.data(), t0, t, worker); });
    }
    return;
  }
  pool.parallel_for(tiles, workers, [&](int64_t task, int worker) {
    PreScratch& s = scratch[static_cast<size_t>(worker)];
    const int64_t t0 = task * tile;
    const int64_t tokens = std::min(tile, T - t0);
    produce(t0, t0 + tokens);
    const float* xf = as_f32(x + t0 * M, tokens * M, s.x);
    if (source.weight != nullptr) project(xf, tokens, *source.weight, s.P.data());
    for (int64_t t = 0; t < tokens; ++t) finish(xf, s.P.data(), t0, t, worker);
  });
}

template <class X>
void run_partials(const detail::Dims& dims, const X* x, const FoldedWeight& weight,
                  float* partials) {
  const int64_t T = dims.T, M = dims.M, N = dims.N;
  const int64_t tile = pre_tile_tokens(M);
  const int64_t tiles = ceil_div(T, tile);
  ThreadPool& pool = ThreadPool::instance();
  const int threads = pre_threads(T, M, N, pool.threads());
  const bool split_rows = tiles < threads;
  const int workers = static_cast<int>(std::min<int64_t>(threads, tiles));
  struct Scratch {
    std::vector<float> x, P;
  };
  std::vector<Scratch> scratch;
  scratch.reserve(static_cast<size_t>(workers));
  for (int w = 0; w < workers; ++w) {
    scratch.push_back(
        Scratch{std::vector<float>(std::is_same_v<X, bf16> ? static_cast<size_t>(tile * M) : 0),
                std::vector<float>(static_cast<size_t>(tile * N))});
  }
  auto write = [&](const float* xf, const float* P, int64_t t0, int64_t t) {
    float* row = partials + (t0 + t) * (N + 1);
    std::copy(P + t * N, P + (t + 1) * N, row);
    row[N] = static_cast<float>(sum_squares(xf + t * M, M));
  };
  if (split_rows) {
    Scratch& s = scratch[0];
    for (int64_t t0 = 0; t0 < T; t0 += tile) {
      const int64_t tokens = std::min(tile, T - t0);
      const float* xf = project_split_rows(x + t0 * M, tokens, weight, s.x.data(), s.P.data());
      pool.parallel_for(tokens, threads, [&](int64_t t, int) { write(xf, s.P.data(), t0, t); });
    }
    return;
  }
  pool.parallel_for(tiles, workers, [&](int64_t task, int worker) {
    Scratch& s = scratch[static_cast<size_t>(worker)];
    const int64_t t0 = task * tile;
    const int64_t tokens = std::min(tile, T - t0);
    const float* xf = as_f32(x + t0 * M, tokens * M, s.x.data());
    project(xf, tokens, weight, s.P.data());
    for (int64_t t = 0; t < tokens; ++t) write(xf, s.P.data(), t0, t);
  });
}

void run_any(const Config& config, const detail::Dims& dims, const TensorRef& x,
             ProjectionSource source, const float* alpha, const float* bias,
             const PreForwardOutputs& outputs) {
  with_activation_type(x.dtype, [&](auto tag) {
    using X = decltype(tag);
    run(config, dims, static_cast<const X*>(x.data), source, alpha, bias,
        static_cast<X*>(outputs.layer_in.data), static_cast<float*>(outputs.h_pre.data),
        static_cast<float*>(outputs.h_post.data), static_cast<float*>(outputs.h_res.data));
  });
}

}  // namespace

void pre_forward(const Config& config, const detail::Dims& dims, const TensorRef& x,
                 const Params& params, const PreForwardOutputs& outputs) {
  if (dims.T == 0) return;
  const FoldedWeight weight{static_cast<const float*>(params.norm_weight.data),
                            static_cast<const float*>(params.phi.data), dims.M, dims.N};
  run_any(config, dims, x, ProjectionSource{&weight, nullptr},
          static_cast<const float*>(params.alpha.data), static_cast<const float*>(params.bias.data),
          outputs);
}

void pre_forward_partials(const detail::Dims& dims, const TensorRef& x,
                          const TensorRef& norm_weight, const TensorRef& phi, float* partials) {
  if (dims.T == 0) return;
  const FoldedWeight weight{static_cast<const float*>(norm_weight.data),
                            static_cast<const float*>(phi.data), dims.M, dims.N};
  with_activation_type(x.dtype, [&](auto tag) {
    using X = decltype(tag);
    run_partials(dims, static_cast<const X*>(x.data), weight, partials);
  });
}

void pre_forward_finish(const Config& config, const detail::Dims& dims, const TensorRef& x,
                        const float* partials, const float* alpha, const float* bias,
                        const PreForwardOutputs& outputs) {
  run_any(config, dims, x, ProjectionSource{nullptr, partials}, alpha, bias, outputs);
}

void boundary_forward(const Config& config, const detail::Dims& dims, const TensorRef& x,
                      const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                      const Params& next_params, const MutableTensorRef& x_next,
                      const PreForwardOutputs& next) {
  if (dims.T == 0) return;
  const FoldedWeight weight{static_cast<const float*>(next_params.norm_weight.data),
                            static_cast<const float*>(next_params.phi.data), dims.M, dims.N};
  const auto* hp = static_cast<const float*>(h_post.data);
  const auto* hr = static_cast<const float*>(h_res.data);
  with_activation_type(x.dtype, [&](auto x_tag) {
    using X = decltype(x_tag);
    auto* streams = static_cast<X*>(x_next.data);
    with_activation_type(layer_out.dtype, [&](auto lo_tag) {
      using L = decltype(lo_tag);
      auto post = [&](int64_t begin, int64_t end) {
        post_forward_tokens(static_cast<const X*>(x.data), static_cast<const L*>(layer_out.data),
                            hp, hr, dims.n, dims.D, begin, end, streams);
      };
      run(config, dims, static_cast<const X*>(streams), ProjectionSource{&weight, nullptr},
          static_cast<const float*>(next_params.alpha.data),
          static_cast<const float*>(next_params.bias.data), static_cast<X*>(next.layer_in.data),
          static_cast<float*>(next.h_pre.data), static_cast<float*>(next.h_post.data),
          static_cast<float*>(next.h_res.data), post);
    });
  });
}

}  // namespace mhc::cpu
