// pre_forward on the CPU (spec: Forward steps 1-6), fused and split for tensor parallelism.
//
// Fused, per token tile: one sweep computes the projection P = x (norm_weight * phi) and the sum
// of squares (a bf16 tile widened a few blocks at a time inside it, projection.h), the per-token
// math turns them into the coefficients, and a second sweep over the same cached tile applies
// H_pre, reading x and writing layer_in in their own type. With fewer tiles than threads (decode),
// the projection of each tile is split over the threads by rows of W and its tokens then finish in
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

// The workspace of one call (workspace.h): per slot the tile's projection and sums of squares;
// for the decode split, the tile of x widened to f32 (bf16 only) and the split's sums. The fused
// tiles need no f32 copy of x: the projection widens a bf16 tile a few blocks at a time, and the
// pre-apply reads x and writes layer_in in X.
template <class X>
struct ForwardWorkspace {
  static constexpr bool kWiden = std::is_same_v<X, bf16>;
  std::vector<float*> P;
  std::vector<double*> squares;
  float* x_split = nullptr;
  SplitRowsScratch split{};

  template <class Taker>
  void layout(const detail::Dims& dims, const ForwardPlan& plan, Taker& take) {
    const auto count = [](int64_t elements) { return static_cast<size_t>(elements); };
    P.clear();
    squares.clear();
    for (int s = 0; s < plan.slots; ++s) {
      P.push_back(take.template take<float>(count(plan.tile * dims.N)));
      squares.push_back(take.template take<double>(count(plan.tile)));
    }
    const int64_t split_tokens = plan.split_rows ? plan.tile : 0;
    x_split = take.template take<float>(count(kWiden ? split_tokens * dims.M : 0));
    split = take_split_rows(take, split_tokens, dims.M, dims.N);
  }
};

// Everything after the projection for token t of the tile from t0: r, the coefficients and the
// pre-apply. x_tile is the tile of x; P_tile and squares its projection and sums of squares
// (unused with partials).
template <class X>
void finish_token(const Config& config, const detail::Dims& dims, const float* supplied_partials,
                  const X* x_tile, const float* P_tile, const double* squares, int64_t t0,
                  int64_t t, TokenCoefficients& coefficients, const PreForwardOut<X>& out,
                  const PreApplyMix& mix) {
  const int64_t n = dims.n, D = dims.D, M = dims.M, N = dims.N;
  const int64_t token = t0 + t;
  const float* P = P_tile + t * N;
  double token_squares = 0.0;
  if (supplied_partials == nullptr) {
    token_squares = squares[t];
  } else {
    P = supplied_partials + token * (N + 1);
    token_squares = P[N];
  }
  const double r = inverse_rms(token_squares, dims.M_full, config.rms_eps);
  float* pre = out.h_pre + token * n;
  if (dims.pre_gates_only) {  // the head: no h_post or h_res
    coefficients.forward(P, r, pre, nullptr, nullptr);
  } else {
    coefficients.forward(P, r, pre, out.h_post + token * n, out.h_res + token * n * n);
  }
  weighted_rows(x_tile + t * M, mix.streams(n), mix.row(token, n, pre), D,
                out.layer_in + token * D);
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
  auto write = [&](const float* P, const double* squares, int64_t t0, int64_t t) {
    float* row = partials + (t0 + t) * (N + 1);
    std::copy(P + t * N, P + (t + 1) * N, row);
    row[N] = static_cast<float>(squares[t]);
  };
  if (plan.split_rows) {
    for (int64_t t0 = 0; t0 < T; t0 += plan.tile) {
      const int64_t tokens = std::min(plan.tile, T - t0);
      project_split_rows(source.x_tile(t0, tokens, 0), tokens, weight, work.x_split, work.P[0],
                         work.squares[0], work.split);
      pool.parallel_for(tokens, plan.threads,
                        [&](int64_t t, int) { write(work.P[0], work.squares[0], t0, t); });
    }
    return;
  }
  pool.parallel_for(plan.tiles, plan.workers, [&](int64_t task, int worker) {
    const int64_t t0 = task * plan.tile;
    const int64_t tokens = std::min(plan.tile, T - t0);
    project(source.x_tile(t0, tokens, worker), tokens, weight, work.P[worker],
            work.squares[worker]);
    for (int64_t t = 0; t < tokens; ++t) write(work.P[worker], work.squares[worker], t0, t);
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
  auto finish = [&](const X* x_tile, int64_t t0, int64_t t, int slot, int worker) {
    finish_token(config, dims, supplied_partials, x_tile, work.P[slot], work.squares[slot], t0, t,
                 coefficients[static_cast<size_t>(worker)], out, mix);
  };

  ThreadPool& pool = ThreadPool::instance();
  if (plan.split_rows) {
    for (int64_t t0 = 0; t0 < T; t0 += plan.tile) {
      const int64_t tokens = std::min(plan.tile, T - t0);
      const X* x_tile = source.x_tile(t0, tokens, 0);
      project_split_rows(x_tile, tokens, weight, work.x_split, work.P[0], work.squares[0],
                         work.split);
      pool.parallel_for(tokens, plan.workers,
                        [&](int64_t t, int worker) { finish(x_tile, t0, t, 0, worker); });
    }
    return;
  }
  pool.parallel_for(plan.tiles, plan.workers, [&](int64_t task, int worker) {
    const int64_t t0 = task * plan.tile;
    const int64_t tokens = std::min(plan.tile, T - t0);
    const X* x_tile = source.x_tile(t0, tokens, worker);
    if (supplied_partials == nullptr) {
      project(x_tile, tokens, weight, work.P[worker], work.squares[worker]);
    }
    for (int64_t t = 0; t < tokens; ++t) finish(x_tile, t0, t, worker, worker);
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
                         const PreApplyMix& mix, const Params& params,
                         const PreForwardOutputs& outputs) {
  run_any(config, dims, x, pre_weights(params), nullptr, outputs, mix);
}

void pre_forward_finish_carried(const Config& config, const detail::Dims& dims, const TensorRef& x,
                                const float* partials, const PreApplyMix& mix, const float* alpha,
                                const float* bias, const PreForwardOutputs& outputs) {
  run_any(config, dims, x, PreWeights{nullptr, nullptr, alpha, bias}, partials, outputs, mix);
}

}  // namespace mhc::cpu
