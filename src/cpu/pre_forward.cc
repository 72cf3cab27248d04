// pre_forward on the CPU (spec: Forward steps 1-6), fused and split for tensor parallelism.
//
// Fused, per token tile: one sweep computes the sum of squares and the projection
// P = x (norm_weight * phi), the per-token math turns them into the coefficients, and a second
// sweep over the same cached tile applies H_pre. With fewer tiles than threads (decode), the
// projection of each tile is split over the threads by rows of W and its tokens then finish in
// parallel; the results are the same bits either way. The split form runs the first sweep alone
// (pre_forward_partials) and, after the caller's all-reduce, the rest from the summed partials
// (pre_forward_finish). The fused boundary and the head run pre_forward_tiles too (pre_kernels.h).
#include <cmath>
#include <type_traits>

#include "coefficients.h"
#include "kernels.h"
#include "pre_kernels.h"
#include "projection.h"
#include "thread_pool.h"
#include "tiles.h"
#include "workspace.h"

namespace mhc::cpu {

namespace {

// The plan of one call: tile size, strategy and workers.
struct ForwardPlan {
  int64_t tile = 0;   // tokens per tile (at most T)
  int64_t tiles = 0;  // ceil(T / tile)
  int threads = 1;
  // Decode (fewer tiles than threads): each tile's projection split over the threads by rows of
  // W, then its tokens finished in parallel. Otherwise whole tiles are shared out over the workers.
  bool split_rows = false;
  int workers = 1;
  int slots = 1;  // tile buffers: one per worker, or the one shared tile when the rows are split
};

ForwardPlan plan_forward(const detail::Dims& dims, bool computes_projection) {
  ForwardPlan plan;
  plan.tile = std::min(pre_tile_tokens(dims.M), dims.T);
  plan.tiles = ceil_div(dims.T, plan.tile);
  plan.threads = pre_threads(dims.T, dims.M, dims.N, ThreadPool::instance().threads());
  plan.split_rows = computes_projection && plan.tiles < plan.threads;
  plan.workers = plan.split_rows ? plan.threads
                                 : static_cast<int>(std::min<int64_t>(plan.threads, plan.tiles));
  plan.slots = plan.split_rows ? 1 : plan.workers;
  return plan;
}

// The workspace of one call (workspace.h): per slot the tile of x widened to f32 (bf16 only) and
// its projection; per worker one token's layer_in in f32 (bf16 only); the decode split's sums.
// Sized by the tokens a tile really has: at decode sizes a whole tile's f32 staging (1 MiB) cost
// as much as the rest of the call.
template <class X>
struct ForwardWorkspace {
  static constexpr bool kWiden = std::is_same_v<X, bf16>;
  std::vector<float*> x, P;
  std::vector<float*> layer_in;
  SplitRowsScratch split{};

  template <class Taker>
  void layout(const detail::Dims& dims, const ForwardPlan& plan, Taker& take) {
    const auto count = [](int64_t elements) { return static_cast<size_t>(elements); };
    x.clear();
    P.clear();
    layer_in.clear();
    for (int s = 0; s < plan.slots; ++s) {
      x.push_back(take.template take<float>(count(kWiden ? plan.tile * dims.M : 0)));
      P.push_back(take.template take<float>(count(plan.tile * dims.N)));
    }
    for (int w = 0; w < plan.workers; ++w) {
      layer_in.push_back(take.template take<float>(count(kWiden ? dims.D : 0)));
    }
    const int64_t split_tokens = plan.split_rows ? plan.tile : 0;
    split.sums = take.template take<float>(
        count(ceil_div(dims.M, kProjectionBlock) * split_tokens * padded_width(dims.N)));
    split.wide = take.template take<double>(count(split_tokens * padded_width(dims.N)));
  }
};

// Everything after the projection for token t of the tile from t0: r, the coefficients and the
// pre-apply. xf is the tile of x as f32; P_tile its projection (unused with partials).
template <class X>
void finish_token(const Config& config, const detail::Dims& dims, const float* supplied_partials,
                  const float* xf, const float* P_tile, int64_t t0, int64_t t,
                  TokenCoefficients& coefficients, float* layer_in_staging,
                  const PreForwardOut<X>& out, const PreApplyMix& mix) {
  const int64_t n = dims.n, D = dims.D, M = dims.M, N = dims.N;
  const int64_t token = t0 + t;
  const float* xt = xf + t * M;
  const float* P = P_tile + t * N;
  double squares = 0.0;
  if (supplied_partials == nullptr) {
    squares = sum_squares(xt, M);
  } else {
    P = supplied_partials + token * (N + 1);
    squares = P[N];
  }
  const double r = inverse_rms(squares, dims.M_full, config.rms_eps);
  float* pre = out.h_pre + token * n;
  if (dims.pre_gates_only) {  // the head: no h_post or h_res
    coefficients.forward(P, r, pre, nullptr, nullptr);
  } else {
    coefficients.forward(P, r, pre, out.h_post + token * n, out.h_res + token * n * n);
  }
  float* li = f32_target(out.layer_in + token * D, layer_in_staging);
  weighted_rows(xt, mix.streams(n), mix.row(token, n, pre), D, li);
  store_from(li, out.layer_in + token * D, D);
}

template <class X>
void run_partials(const detail::Dims& dims, const X* x, const FoldedWeight& weight,
                  float* partials) {
  const int64_t T = dims.T, M = dims.M, N = dims.N;
  MemoryTiles<X> source(x, nullptr, M);
  const ForwardPlan plan = plan_forward(dims, true);
  ForwardWorkspace<X> work;
  WorkspaceSize size;
  work.layout(dims, plan, size);
  Workspace workspace(size.bytes());
  work.layout(dims, plan, workspace);
  ThreadPool& pool = ThreadPool::instance();
  auto write = [&](const float* xf, const float* P, int64_t t0, int64_t t) {
    float* row = partials + (t0 + t) * (N + 1);
    std::copy(P + t * N, P + (t + 1) * N, row);
    row[N] = static_cast<float>(sum_squares(xf + t * M, M));
  };
  if (plan.split_rows) {
    for (int64_t t0 = 0; t0 < T; t0 += plan.tile) {
      const int64_t tokens = std::min(plan.tile, T - t0);
      const float* xf = project_split_rows(source.x_tile(t0, tokens, 0), tokens, weight, work.x[0],
                                           work.P[0], work.split);
      pool.parallel_for(tokens, plan.threads, [&](int64_t t, int) { write(xf, work.P[0], t0, t); });
    }
    return;
  }
  pool.parallel_for(plan.tiles, plan.workers, [&](int64_t task, int worker) {
    const int64_t t0 = task * plan.tile;
    const int64_t tokens = std::min(plan.tile, T - t0);
    const float* xf = as_f32(source.x_tile(t0, tokens, worker), tokens * M, work.x[worker]);
    project(xf, tokens, weight, work.P[worker]);
    for (int64_t t = 0; t < tokens; ++t) write(xf, work.P[worker], t0, t);
  });
}

void run_any(const Config& config, const detail::Dims& dims, const TensorRef& x,
             const PreWeights& weights, const float* supplied_partials,
             const PreForwardOutputs& outputs, const PreApplyMix& mix = {}) {
  with_activation_type(x.dtype, [&](auto tag) {
    using X = decltype(tag);
    MemoryTiles<X> source(static_cast<const X*>(x.data), nullptr, dims.M);
    pre_forward_tiles<X>(
        config, dims, weights, supplied_partials, source,
        {static_cast<X*>(outputs.layer_in.data), static_cast<float*>(outputs.h_pre.data),
         static_cast<float*>(outputs.h_post.data), static_cast<float*>(outputs.h_res.data)},
        mix);
  });
}

}  // namespace

template <class X>
void pre_forward_tiles(const Config& config, const detail::Dims& dims, const PreWeights& weights,
                       const float* supplied_partials, TileSource<X>& source,
                       const PreForwardOut<X>& out, const PreApplyMix& mix) {
  const int64_t T = dims.T, M = dims.M;
  if (T == 0) return;
  const ForwardPlan plan = plan_forward(dims, supplied_partials == nullptr);
  const FoldedWeight weight{weights.norm_weight, weights.phi, M, dims.N};
  ForwardWorkspace<X> work;
  WorkspaceSize size;
  work.layout(dims, plan, size);
  Workspace workspace(size.bytes());
  work.layout(dims, plan, workspace);
  std::vector<TokenCoefficients> coefficients;
  coefficients.reserve(static_cast<size_t>(plan.workers));
  for (int w = 0; w < plan.workers; ++w) {
    coefficients.emplace_back(config, weights.alpha, weights.bias, dims.pre_gates_only);
  }
  auto finish = [&](const float* xf, const float* P, int64_t t0, int64_t t, int worker) {
    finish_token(config, dims, supplied_partials, xf, P, t0, t,
                 coefficients[static_cast<size_t>(worker)], work.layer_in[worker], out, mix);
  };

  ThreadPool& pool = ThreadPool::instance();
  if (plan.split_rows) {
    for (int64_t t0 = 0; t0 < T; t0 += plan.tile) {
      const int64_t tokens = std::min(plan.tile, T - t0);
      const float* xf = project_split_rows(source.x_tile(t0, tokens, 0), tokens, weight, work.x[0],
                                           work.P[0], work.split);
      pool.parallel_for(tokens, plan.workers,
                        [&](int64_t t, int worker) { finish(xf, work.P[0], t0, t, worker); });
    }
    return;
  }
  pool.parallel_for(plan.tiles, plan.workers, [&](int64_t task, int worker) {
    const int64_t t0 = task * plan.tile;
    const int64_t tokens = std::min(plan.tile, T - t0);
    const float* xf = as_f32(source.x_tile(t0, tokens, worker), tokens * M, work.x[worker]);
    if (supplied_partials == nullptr) project(xf, tokens, weight, work.P[worker]);
    for (int64_t t = 0; t < tokens; ++t) finish(xf, work.P[worker], t0, t, worker);
  });
}

template void pre_forward_tiles<float>(const Config&, const detail::Dims&, const PreWeights&,
                                       const float*, TileSource<float>&,
                                       const PreForwardOut<float>&, const PreApplyMix&);
template void pre_forward_tiles<bf16>(const Config&, const detail::Dims&, const PreWeights&,
                                      const float*, TileSource<bf16>&, const PreForwardOut<bf16>&,
                                      const PreApplyMix&);

PreWeights pre_weights(const Params& params) {
  return PreWeights{static_cast<const float*>(params.norm_weight.data),
                    static_cast<const float*>(params.phi.data),
                    static_cast<const float*>(params.alpha.data),
                    static_cast<const float*>(params.bias.data)};
}

void pre_forward(const Config& config, const detail::Dims& dims, const TensorRef& x,
                 const Params& params, const PreForwardOutputs& outputs) {
  run_any(config, dims, x, pre_weights(params), nullptr, outputs);
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
  run_any(config, dims, x, PreWeights{nullptr, nullptr, alpha, bias}, partials, outputs);
}

}  // namespace mhc::cpu

namespace mhc::cpu {

void pre_forward_carried(const Config& config, const detail::Dims& dims, const TensorRef& x,
                         const float* carried, const Params& params,
                         const PreForwardOutputs& outputs) {
  run_any(config, dims, x, pre_weights(params), nullptr, outputs, PreApplyMix{true, carried});
}

void pre_forward_finish_carried(const Config& config, const detail::Dims& dims, const TensorRef& x,
                                const float* partials, const float* carried, const float* alpha,
                                const float* bias, const PreForwardOutputs& outputs) {
  run_any(config, dims, x, PreWeights{nullptr, nullptr, alpha, bias}, partials, outputs,
          PreApplyMix{true, carried});
}

}  // namespace mhc::cpu
