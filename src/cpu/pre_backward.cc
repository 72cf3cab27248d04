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
// The file is in three parts: the plan (tile size, chunks, strategy, workspace: BackwardPlan),
// the per-tile work both strategies share (BackwardRun's sweeps), and the two strategies (token
// tiles over workers, and the decode split of each tile over rows of W).
//
// Determinism: tiles are grouped into chunks whose boundaries depend on the shapes only. A chunk
// runs its tiles in order on one worker and owns double accumulators for G, dalpha and dbias
// (each tile's weight-gradient sums are f32, see projection.h); the chunks are summed in chunk
// order at the end. No result depends on the thread count.
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

// ---------------------------------------------------------------------------------------------
// The plan: everything decided from the shapes and the thread count before any work.

// Tokens per tile: larger than the forward's, because each tile adds its weight-gradient sums to
// the [N, M] double accumulator, which does not fit in L2 (3 MiB for n = 4, D = 4096); 64 tokens
// amortize that read-modify-write. The tile's f32 copies (x, dx: 2 x 4 MiB there) stay in L3.
int64_t backward_tile_tokens(int64_t M) {
  constexpr int64_t kTileFloats = int64_t{1} << 20;
  return std::clamp<int64_t>(kTileFloats / M, 1, 64);
}

// Chunks of tiles, each with its own [N, M] gradient accumulator: up to 16 for parallelism, but
// no more than about 256 MiB of accumulators in all.
int64_t chunk_count(int64_t tiles, int64_t M, int64_t N) {
  constexpr int64_t kMaxChunks = 16;
  constexpr int64_t kBudgetDoubles = int64_t{1} << 25;
  const int64_t affordable = std::max<int64_t>(1, kBudgetDoubles / (M * N));
  return std::min({tiles, kMaxChunks, affordable});
}

struct BackwardPlan {
  int64_t tile = 0;    // tokens per tile (at most T)
  int64_t tiles = 0;   // ceil(T / tile)
  int64_t chunks = 0;  // groups of consecutive tiles with their own accumulators
  int threads = 1;     // threads the call uses
  // Decode (fewer tiles than threads): each tile's sweeps split over the threads, the projection
  // and the second sweep by rows of W, the coefficient sweep by tokens. Otherwise the chunks are
  // shared out over the workers.
  bool split_rows = false;
  int workers = 1;  // pool workers taking part
  int slots = 1;    // tile states: one per worker, or the one shared tile when the rows are split
  // One tile: its weight-gradient sums go straight to dphi and dnorm_weight (the chunk reduction
  // gives the same bits from a single term), and no accumulator is needed.
  bool direct = false;

  int64_t first_tile(int64_t chunk) const { return chunk * tiles / chunks; }
};

BackwardPlan plan_backward(const detail::Dims& dims, bool computes_projection) {
  BackwardPlan plan;
  plan.tile = std::min(backward_tile_tokens(dims.M), dims.T);
  plan.tiles = ceil_div(dims.T, plan.tile);
  plan.chunks = chunk_count(plan.tiles, dims.M, dims.N);
  plan.threads = pre_threads(dims.T, dims.M, dims.N, ThreadPool::instance().threads());
  plan.split_rows = computes_projection && plan.tiles < plan.threads;
  plan.workers = plan.split_rows ? plan.threads
                                 : static_cast<int>(std::min<int64_t>(plan.threads, plan.chunks));
  plan.slots = plan.split_rows ? 1 : plan.workers;
  plan.direct = plan.tiles == 1;
  return plan;
}

// The workspace of one call, carved from one lease (workspace.h). Per chunk: G [N, M] blocked by
// kWeightGradBlock columns of M ([M / 64][N][64], so the block a tile adds to is contiguous
// instead of N rows 8*M bytes apart), then dalpha [3] and dbias [N] (chunk_sums). At n = 4,
// D = 4096 (N = 24, M = 16384) the 16 chunks' G are 48 MiB, the bf16 staging 9 MiB per worker.
template <class X>
struct BackwardWorkspace {
  static constexpr bool kWiden = std::is_same_v<X, bf16>;

  // The per-tile state of one slot: the coefficient sweep's results for the second sweep, and the
  // f32 staging of bf16 activations.
  struct Slot {
    float* x;            // [tile, M] f32 staging (bf16 only)
    float* dlayer_in;    // [tile, D] (bf16 only)
    float* dx;           // [tile, M] (bf16 only)
    float* P;            // [tile, N]
    double* squares;     // [tile]: each token's sum of squares of x
    float* dP;           // [tile, N]
    float* h_pre;        // [tile, n]
    float* rms_term;     // [tile]: dr r^3 / M
    double* token_sums;  // [tile, 3 + N]: each token's dalpha and dbias terms
  };

  double* G = nullptr;
  double* chunk_sums = nullptr;
  float* weight_sums = nullptr;    // per worker [N, kWeightGradBlock]
  double* block_totals = nullptr;  // per thread [N, kWeightGradBlock]: a block's finished sums
  SplitRowsScratch split{};        // the decode split's projection sums
  std::vector<Slot> slots;
  std::byte* source_staging = nullptr;  // slots x the tile source's staging_bytes(tile)

  // The one description of the workspace: run with a WorkspaceSize to size the lease, then with
  // the lease to carve it.
  template <class Taker>
  void layout(const detail::Dims& dims, const BackwardPlan& plan, size_t source_bytes,
              Taker& take) {
    const int64_t tile = plan.tile, M = dims.M, D = dims.D, N = dims.N, n = dims.n;
    auto count = [](int64_t elements) { return static_cast<size_t>(elements); };
    G = take.template take<double>(count(plan.direct ? 0 : plan.chunks * N * M));
    chunk_sums = take.template take<double>(count(plan.chunks * (N + 3)));
    weight_sums = take.template take<float>(count(plan.workers * N * kWeightGradBlock));
    block_totals = take.template take<double>(count(plan.threads * N * kWeightGradBlock));
    split = take_split_rows(take, plan.split_rows ? tile : 0, M, N);
    slots.clear();
    for (int s = 0; s < plan.slots; ++s) {
      Slot slot;
      slot.x = take.template take<float>(count(kWiden ? tile * M : 0));
      slot.dlayer_in = take.template take<float>(count(kWiden ? tile * D : 0));
      slot.dx = take.template take<float>(count(kWiden ? tile * M : 0));
      slot.P = take.template take<float>(count(tile * N));
      slot.squares = take.template take<double>(count(tile));
      slot.dP = take.template take<float>(count(tile * N));
      slot.h_pre = take.template take<float>(count(tile * n));
      slot.rms_term = take.template take<float>(count(tile));
      slot.token_sums = take.template take<double>(count(tile * (3 + N)));
      slots.push_back(slot);
    }
    source_staging = take.template take<std::byte>(source_bytes * static_cast<size_t>(plan.slots));
  }
};

// ---------------------------------------------------------------------------------------------
// The work of one call: the sweeps of a tile, which both strategies run, and the final reduction.

template <class X>
struct BackwardRun {
  using Slot = typename BackwardWorkspace<X>::Slot;

  // Per-worker state of the coefficient sweep.
  struct WorkerState {
    std::vector<float> unused;   // h_post, h_res of the recompute [n + n*n]
    std::vector<double> dh_pre;  // [n]
    TokenCoefficients coefficients;
  };

  const Config& config;
  const detail::Dims& dims;
  const PreWeights& weights;
  const X* dlayer_in;
  const PostGradients<X>& post;
  Supplied supplied;
  TileSource<X>& source;
  const PreGrads& grads;
  BackwardPlan plan;
  FoldedWeight weight;
  BackwardWorkspace<X> work{};
  std::vector<WorkerState> worker_states;

  // The coefficient sweep of token t of the tile from t0: r and P (recomputed or read), the
  // gates, dh_pre, then the coefficient backward into dP, the RMS term and the token's sums.
  void coefficient_token(Slot& s, WorkerState& ws, const float* xf, const float* dli, int64_t t0,
                         int64_t t) const {
    const int64_t n = dims.n, D = dims.D, M = dims.M, N = dims.N;
    const int64_t token = t0 + t;
    const float* xt = xf + t * M;
    const float* P = s.P + t * N;
    double squares = 0.0;
    if (supplied.partials == nullptr) {
      squares = s.squares[t];
    } else {
      P = supplied.partials + token * (N + 1);
      squares = P[N];
    }
    const double r = inverse_rms(squares, dims.M_full, config.rms_eps);
    float* pre = s.h_pre + t * n;
    ws.coefficients.forward(P, r, pre, ws.unused.data(), ws.unused.data() + n);
    for (int64_t k = 0; k < n; ++k) {
      ws.dh_pre[k] = supplied.dh_pre != nullptr ? supplied.dh_pre[token * n + k]
                                                : dot(xt + k * D, dli + t * D, D);
    }
    if (supplied.dcarried != nullptr) {  // V4.1: <x_k, dli> is the carried mix's cotangent
      for (int64_t k = 0; k < n; ++k) {
        supplied.dcarried[token * n + k] = static_cast<float>(dot(xt + k * D, dli + t * D, D));
      }
    }
    // The second sweep's pre-apply weights: the carried mix replaces the gates just computed.
    if (supplied.mix.mode != PreApply::own_gates) {
      std::copy_n(supplied.mix.row(token, n, pre), supplied.mix.streams(n), pre);
    }
    double* sums = s.token_sums + t * (3 + N);
    std::fill_n(sums, 3 + N, 0.0);
    double dr = 0.0;
    const float* token_dh_post = dims.pre_gates_only ? nullptr : post.dh_post + token * n;
    const float* token_dh_res = dims.pre_gates_only ? nullptr : post.dh_res + token * n * n;
    ws.coefficients.backward(P, r, ws.dh_pre.data(), token_dh_post, token_dh_res, s.dP + t * N, &dr,
                             sums, sums + 3);
    s.rms_term[t] = static_cast<float>(dr * r * r * r / static_cast<double>(dims.M_full));
  }

  // The token sums of a tile added to its chunk's, in token order.
  void add_token_sums(const Slot& s, int64_t tokens, int64_t chunk) const {
    const int64_t N = dims.N;
    double* total = work.chunk_sums + chunk * (N + 3);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t c = 0; c < N + 3; ++c) total[c] += s.token_sums[t * (3 + N) + c];
    }
  }

  // The second sweep over rows [m_begin, m_end) of the tile from t0 (m_begin a multiple of
  // kInputGradBlock): dx = dx_partial + H_pre dli - rms_term x + dP W^T, and the weight gradient
  // of those rows, added to the chunk's G (or finished into dphi, dnorm_weight when direct). The
  // chunk's first tile stores its sums into G instead of adding them, so G is never zero-filled
  // (the same bits: the chunks' sum starts from 0.0).
  void second_sweep(Slot& s, const float* xf, const float* dli, X* dx, int64_t t0, int64_t tokens,
                    int64_t chunk, bool first_in_chunk, int64_t m_begin, int64_t m_end,
                    int worker) const {
    const int64_t n = dims.n, D = dims.D, M = dims.M, N = dims.N;
    float* dxf = f32_target(dx, s.dx);
    for (int64_t t = 0; t < tokens; ++t) {
      // The head has no post: dx has only the pre terms. A stream the pre-apply does not read
      // (V4.1's one-hot mix reads stream 0 alone) has no H_pre dli term.
      const X* partial = dims.pre_gates_only ? nullptr : post.dx_partial + (t0 + t) * M;
      for (int64_t k = m_begin / D; k * D < m_end; ++k) {
        const int64_t d0 = std::max(m_begin, k * D) - k * D;
        const int64_t d1 = std::min(m_end, (k + 1) * D) - k * D;
        const int64_t m = k * D + d0;
        const bool applied = k < supplied.mix.streams(n);
        dx_terms(partial != nullptr ? partial + m : nullptr, applied ? s.h_pre[t * n + k] : 0.0f,
                 applied ? dli + t * D + d0 : nullptr, s.rms_term[t], xf + t * M + m,
                 dxf + t * M + m, d1 - d0);
      }
    }
    add_projection_grad(s.dP, tokens, weight, m_begin, m_end, dxf);
    float* S = work.weight_sums + worker * N * kWeightGradBlock;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += kWeightGradBlock) {
      const int64_t width = std::min(kWeightGradBlock, M - m0);
      weight_grad_sums(xf, s.dP, tokens, M, N, m0, S);
      if (plan.direct) {
        finish_weight_block(S, width, N, m0, weights.norm_weight, weights.phi, grads.phi,
                            grads.norm_weight);
      } else {
        double* block = work.G + chunk * N * M + m0 * N;
        if (first_in_chunk) {
          for (int64_t e = 0; e < N * width; ++e) block[e] = static_cast<double>(S[e]);
        } else {
          for (int64_t e = 0; e < N * width; ++e) block[e] += static_cast<double>(S[e]);
        }
      }
    }
    for (int64_t t = 0; t < tokens; ++t) {
      store_from(dxf + t * M + m_begin, dx + t * M + m_begin, m_end - m_begin);
    }
  }

  // Strategy 1: the chunks shared out over the workers, each running its tiles in order, every
  // sweep of a tile on the worker that owns the chunk.
  void run_token_tiles() {
    const int64_t T = dims.T, D = dims.D, M = dims.M;
    ThreadPool::instance().parallel_for(plan.chunks, plan.workers, [&](int64_t chunk, int worker) {
      Slot& s = work.slots[static_cast<size_t>(worker)];
      WorkerState& ws = worker_states[static_cast<size_t>(worker)];
      for (int64_t task = plan.first_tile(chunk); task < plan.first_tile(chunk + 1); ++task) {
        const int64_t t0 = task * plan.tile;
        const int64_t tokens = std::min(plan.tile, T - t0);
        const float* xf = as_f32(source.x_tile(t0, tokens, worker), tokens * M, s.x);
        const float* dli = as_f32(dlayer_in + t0 * D, tokens * D, s.dlayer_in);
        if (supplied.partials == nullptr) project(xf, tokens, weight, s.P, s.squares);
        for (int64_t t = 0; t < tokens; ++t) coefficient_token(s, ws, xf, dli, t0, t);
        add_token_sums(s, tokens, chunk);
        second_sweep(s, xf, dli, source.dx_tile(t0, worker), t0, tokens, chunk,
                     task == plan.first_tile(chunk), 0, M, worker);
        source.consume(t0, 0, tokens, worker);
      }
    });
  }

  // Strategy 2 (decode): the tiles one after another, each split over the threads: the
  // projection by blocks of rows (project_split_rows), the coefficient sweep by tokens, the
  // second sweep by one contiguous range of rows per thread, as in project_split_rows.
  void run_split_rows() {
    const int64_t T = dims.T, D = dims.D, M = dims.M;
    ThreadPool& pool = ThreadPool::instance();
    Slot& s = work.slots[0];
    const int64_t row_blocks = ceil_div(M, kInputGradBlock);
    const int64_t row_tasks = std::min<int64_t>(row_blocks, plan.threads);
    for (int64_t chunk = 0; chunk < plan.chunks; ++chunk) {
      const int64_t first = plan.first_tile(chunk);
      for (int64_t task = first; task < plan.first_tile(chunk + 1); ++task) {
        const int64_t t0 = task * plan.tile;
        const int64_t tokens = std::min(plan.tile, T - t0);
        const float* xf = project_split_rows(source.x_tile(t0, tokens, 0), tokens, weight, s.x, s.P,
                                             s.squares, work.split);
        const float* dli = s.dlayer_in;
        if constexpr (std::is_same_v<X, float>) dli = dlayer_in + t0 * D;
        pool.parallel_for(tokens, plan.workers, [&](int64_t t, int worker) {
          if constexpr (std::is_same_v<X, bf16>) {
            widen(dlayer_in + (t0 + t) * D, s.dlayer_in + t * D, D);
          }
          coefficient_token(s, worker_states[static_cast<size_t>(worker)], xf, dli, t0, t);
        });
        add_token_sums(s, tokens, chunk);
        pool.parallel_for(row_tasks, plan.workers, [&](int64_t range, int worker) {
          const int64_t m_begin = range * row_blocks / row_tasks * kInputGradBlock;
          const int64_t m_end = std::min(M, (range + 1) * row_blocks / row_tasks * kInputGradBlock);
          second_sweep(s, xf, dli, source.dx_tile(t0, 0), t0, tokens, chunk, task == first, m_begin,
                       m_end, worker);
        });
        if (source.consumes()) {
          pool.parallel_for(tokens, plan.workers,
                            [&](int64_t t, int) { source.consume(t0, t, t + 1, 0); });
        }
      }
    }
  }

  // The fixed-order reduction of the chunks, parallel over blocks of rows m of phi, and of the
  // chunks' dalpha and dbias.
  void reduce_chunks() const {
    const int64_t M = dims.M, N = dims.N, chunks = plan.chunks;
    if (!plan.direct) {
      ThreadPool::instance().parallel_for(
          ceil_div(M, kWeightGradBlock), plan.threads, [&](int64_t task, int worker) {
            const int64_t m0 = task * kWeightGradBlock, width = std::min(kWeightGradBlock, M - m0);
            const double* block = work.G + m0 * N;
            double* totals = work.block_totals + worker * N * kWeightGradBlock;
            for (int64_t e = 0; e < N * width; ++e) {
              double sum = 0.0;
              for (int64_t k = 0; k < chunks; ++k) sum += block[k * N * M + e];
              totals[e] = sum;
            }
            finish_weight_block(totals, width, N, m0, weights.norm_weight, weights.phi, grads.phi,
                                grads.norm_weight);
          });
    }
    for (int64_t c = 0; c < N + 3; ++c) {
      double total = 0.0;
      for (int64_t k = 0; k < chunks; ++k) total += work.chunk_sums[k * (N + 3) + c];
      if (c < 3) {
        grads.alpha[c] = static_cast<float>(total);
      } else {
        grads.bias[c - 3] = static_cast<float>(total);
      }
    }
  }
};

}  // namespace

template <class X>
void pre_backward_tiles(const Config& config, const detail::Dims& dims, const PreWeights& weights,
                        const X* dlayer_in, const PostGradients<X>& post, Supplied supplied,
                        TileSource<X>& source, const PreGrads& grads) {
  const int64_t n = dims.n, M = dims.M, N = dims.N;
  if (dims.T == 0) {
    std::fill(grads.norm_weight, grads.norm_weight + M, 0.0f);
    std::fill(grads.phi, grads.phi + M * N, 0.0f);
    std::fill(grads.alpha, grads.alpha + 3, 0.0f);
    std::fill(grads.bias, grads.bias + N, 0.0f);
    return;
  }
  BackwardRun<X> run{config,
                     dims,
                     weights,
                     dlayer_in,
                     post,
                     supplied,
                     source,
                     grads,
                     plan_backward(dims, supplied.partials == nullptr),
                     FoldedWeight{weights.norm_weight, weights.phi, M, N},
                     BackwardWorkspace<X>{},
                     {}};
  const BackwardPlan& plan = run.plan;
  const size_t source_bytes = source.staging_bytes(plan.tile);

  WorkspaceSize size;
  run.work.layout(dims, plan, source_bytes, size);
  Workspace workspace(size.bytes());
  run.work.layout(dims, plan, source_bytes, workspace);
  source.attach(plan.tile, plan.slots, run.work.source_staging);
  std::fill_n(run.work.chunk_sums, plan.chunks * (N + 3), 0.0);
  run.worker_states.reserve(static_cast<size_t>(plan.workers));
  for (int w = 0; w < plan.workers; ++w) {
    run.worker_states.push_back(typename BackwardRun<X>::WorkerState{
        std::vector<float>(static_cast<size_t>(n + n * n)),
        std::vector<double>(static_cast<size_t>(n)),
        TokenCoefficients(config, weights.alpha, weights.bias, dims.pre_gates_only)});
  }

  if (plan.split_rows) {
    run.run_split_rows();
  } else {
    run.run_token_tiles();
  }
  run.reduce_chunks();
}

template void pre_backward_tiles<float>(const Config&, const detail::Dims&, const PreWeights&,
                                        const float*, const PostGradients<float>&, Supplied,
                                        TileSource<float>&, const PreGrads&);
template void pre_backward_tiles<bf16>(const Config&, const detail::Dims&, const PreWeights&,
                                       const bf16*, const PostGradients<bf16>&, Supplied,
                                       TileSource<bf16>&, const PreGrads&);

namespace {

template <class X>
void run_partials(const detail::Dims& dims, const X* dlayer_in, const X* x, float* dh_pre) {
  const int64_t T = dims.T, n = dims.n, D = dims.D, M = dims.M;
  const int64_t tile = post_tile_tokens(M);
  const int64_t tasks = ceil_div(T, tile);
  ThreadPool& pool = ThreadPool::instance();
  const int workers = static_cast<int>(std::min<int64_t>(pool.threads(), tasks));
  constexpr bool kWiden = std::is_same_v<X, bf16>;
  // Per worker, one token widened: x [M] and dlayer_in [D].
  const size_t per_worker = kWiden ? static_cast<size_t>(M + D) : 0;
  Workspace workspace(Workspace::bytes_for<float>(per_worker * static_cast<size_t>(workers)));
  float* staging = workspace.take<float>(per_worker * static_cast<size_t>(workers));
  pool.parallel_for(tasks, workers, [&](int64_t task, int worker) {
    float* x_staging = kWiden ? staging + static_cast<size_t>(worker) * per_worker : nullptr;
    float* dli_staging = kWiden ? x_staging + M : nullptr;
    const int64_t end = std::min(T, (task + 1) * tile);
    for (int64_t t = task * tile; t < end; ++t) {
      const float* xt = as_f32(x + t * M, M, x_staging);
      const float* dli = as_f32(dlayer_in + t * D, D, dli_staging);
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
    MemoryTiles<X> source(static_cast<const X*>(x.data), static_cast<X*>(dx.data), dims.M);
    const PostGradients<X> post{static_cast<const X*>(dx_partial.data),
                                static_cast<const float*>(dh_post.data),
                                static_cast<const float*>(dh_res.data)};
    pre_backward_tiles(config, dims, pre_weights(params), static_cast<const X*>(dlayer_in.data),
                       post, supplied, source, pre_grads(grads));
  });
}

}  // namespace

PreGrads pre_grads(const ParamGrads& grads) {
  return PreGrads{static_cast<float*>(grads.norm_weight.data), static_cast<float*>(grads.phi.data),
                  static_cast<float*>(grads.alpha.data), static_cast<float*>(grads.bias.data)};
}

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

namespace mhc::cpu {

void pre_backward_carried(const Config& config, const detail::Dims& dims,
                          const TensorRef& dlayer_in, const TensorRef& dx_partial,
                          const float* dh_pre, const TensorRef& dh_post, const TensorRef& dh_res,
                          const TensorRef& x, const PreApplyMix& mix, const Params& params,
                          const MutableTensorRef& dx, float* dcarried, const ParamGrads& grads) {
  // With the one-hot there is no dcarried: the <x_k, dli> go nowhere.
  float* const carried_grad = mix.mode == PreApply::carried ? dcarried : nullptr;
  run_any(config, dims, dlayer_in, dx_partial, dh_post, dh_res, x,
          Supplied{nullptr, dh_pre, mix, carried_grad}, params, dx, grads);
}

void pre_backward_finish_carried(const Config& config, const detail::Dims& dims,
                                 const TensorRef& dlayer_in, const TensorRef& dx_partial,
                                 const float* dh_pre, const TensorRef& dh_post,
                                 const TensorRef& dh_res, const TensorRef& x, const float* partials,
                                 const PreApplyMix& mix, const Params& params,
                                 const MutableTensorRef& dx, const ParamGrads& grads) {
  run_any(config, dims, dlayer_in, dx_partial, dh_post, dh_res, x,
          Supplied{partials, dh_pre, mix, nullptr}, params, dx, grads);
}

}  // namespace mhc::cpu
