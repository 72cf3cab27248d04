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
#include "post_tokens.h"
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

// dphi = norm_weight * G and dnorm_weight = sum_c phi G for the rows [m0, m0 + width) of one
// weight-gradient block, from total(c, j) = G[c, m0 + j] in double. dnorm_weight sums its N
// signed terms, which can cancel, in double and in order of c; the rows' sums run side by side
// (c outside, rows inside), so they are independent chains instead of one long dependent one.
template <class Total>
void finish_weight_block(int64_t m0, int64_t width, int64_t N, Total total,
                         const float* norm_weight, const float* phi, float* dphi,
                         float* dnorm_weight) {
  double through_norm_weight[kWeightGradBlock] = {};
  for (int64_t c = 0; c < N; ++c) {
    for (int64_t j = 0; j < width; ++j) {
      const int64_t m = m0 + j;
      const double g = total(c, j);
      dphi[m * N + c] = static_cast<float>(norm_weight[m] * g);
      through_norm_weight[j] += phi[m * N + c] * g;
    }
  }
  for (int64_t j = 0; j < width; ++j) {
    dnorm_weight[m0 + j] = static_cast<float>(through_norm_weight[j]);
  }
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

// Per-tile state of the backward: the coefficient sweep's results for the second sweep, and the
// f32 staging of bf16 activations. One per worker, or one shared when the rows are split.
struct TileState {
  float *x, *dlayer_in, *dx;       // f32 staging [tile, M], [tile, D], [tile, M] (bf16 only)
  std::vector<float> P, dP;        // [tile, N]
  std::vector<float> h_pre;        // [tile, n]
  std::vector<float> rms_term;     // [tile]: dr r^3 / M
  std::vector<double> token_sums;  // [tile, 3 + N]: each token's dalpha and dbias terms
};

// Per-worker state of the coefficient sweep.
struct WorkerState {
  std::vector<float> unused;   // h_post, h_res of the recompute [n + n*n]
  std::vector<double> dh_pre;  // [n]
  TokenCoefficients coefficients;
};

// `staging` holds tile * (2M + D) floats for bf16 activations (null for f32: never offset).
// NOLINTNEXTLINE(readability-non-const-parameter): the tile state writes through it.
TileState make_tile_state(const detail::Dims& dims, int64_t tile, float* staging) {
  auto floats = [](int64_t count) { return std::vector<float>(static_cast<size_t>(count)); };
  const int64_t M = dims.M, D = dims.D;
  return TileState{staging,
                   staging != nullptr ? staging + tile * M : nullptr,
                   staging != nullptr ? staging + tile * (M + D) : nullptr,
                   floats(tile * dims.N),
                   floats(tile * dims.N),
                   floats(tile * dims.n),
                   floats(tile),
                   std::vector<double>(static_cast<size_t>(tile * (3 + dims.N)))};
}

// Where the tiles of x come from and where their dx goes, for tile state `state`: x read from
// memory and dx written to memory (the operations), or, for the fused boundary, x recomputed by the
// previous sublayer's post and dx handed to its post_backward (BoundaryTiles).
template <class X>
struct MemoryTiles {
  static constexpr bool kConsumes = false;  // consume() does nothing
  const X* x;
  X* dx;
  int64_t M;
  void prepare(int64_t /*tile*/, int /*states*/) {}
  const X* x_tile(int64_t t0, int64_t /*tokens*/, int /*state*/) const { return x + t0 * M; }
  X* dx_tile(int64_t t0, int /*state*/) const { return dx + t0 * M; }
  // Tokens [t0 + begin, t0 + end) of dx are complete.
  void consume(int64_t /*t0*/, int64_t /*begin*/, int64_t /*end*/, int /*state*/) const {}
};

template <class X, class TileIO>
void run(const Config& config, const detail::Dims& dims, const X* dlayer_in, const X* dx_partial,
         const float* dh_post, const float* dh_res, TileIO& io, Supplied supplied,
         const Params& params, const ParamGrads& grads) {
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
  const FoldedWeight weight{norm_weight, phi, M, N};
  const int64_t tile = backward_tile_tokens(M);
  const int64_t tiles = ceil_div(T, tile);
  const int64_t chunks = chunk_count(tiles, M, N);
  ThreadPool& pool = ThreadPool::instance();
  // With fewer tiles than threads (decode), each tile's sweeps are split over the threads: the
  // projection and the second sweep by rows of W, the coefficient sweep by tokens.
  const int threads = pre_threads(T, M, N, pool.threads());
  const bool split_rows = supplied.partials == nullptr && tiles < threads;
  const int workers = split_rows ? threads : static_cast<int>(std::min<int64_t>(threads, chunks));
  // One tile: its weight-gradient sums go straight to dphi and dnorm_weight (the chunk
  // reduction below gives the same bits from a single term).
  const bool direct = tiles == 1;

  // Per chunk: G [N, M], then dalpha [3] and dbias [N]. G is blocked by kWeightGradBlock columns
  // of M ([M / 64][N][64]), so the block a tile adds to is contiguous instead of N rows 8*M bytes
  // apart.
  thread_local std::vector<double> G_storage;
  const auto G_size = direct ? size_t{0} : static_cast<size_t>(chunks * N * M);
  double* G = workspace(G_storage, G_size);
  std::fill_n(G, G_size, 0.0);
  std::vector<double> small(static_cast<size_t>(chunks * (N + 3)), 0.0);

  // f32 staging of a tile of x, dlayer_in and dx per tile state (bf16 only), reused across calls.
  constexpr bool kWiden = std::is_same_v<X, bf16>;
  const int tile_state_count = split_rows ? 1 : workers;
  io.prepare(tile, tile_state_count);
  thread_local std::vector<float> staging_storage;
  const int64_t stage = kWiden ? tile * (2 * M + D) : 0;
  float* staging = workspace(staging_storage, static_cast<size_t>(tile_state_count * stage));
  std::vector<TileState> tile_states;
  tile_states.reserve(static_cast<size_t>(tile_state_count));
  for (int w = 0; w < tile_state_count; ++w) {
    tile_states.push_back(make_tile_state(dims, tile, kWiden ? staging + w * stage : nullptr));
  }
  std::vector<WorkerState> worker_states;
  worker_states.reserve(static_cast<size_t>(workers));
  for (int w = 0; w < workers; ++w) {
    worker_states.push_back(
        WorkerState{std::vector<float>(static_cast<size_t>(n + n * n)),
                    std::vector<double>(static_cast<size_t>(n)),
                    TokenCoefficients(config, alpha, bias, dims.pre_gates_only)});
  }

  // The coefficient sweep of token t of the tile from t0: r and P (recomputed or read), the
  // gates, dh_pre, then the coefficient backward into dP, the RMS term and the token's sums.
  auto coefficient_token = [&](TileState& s, WorkerState& ws, const float* xf, const float* dli,
                               int64_t t0, int64_t t) {
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
    ws.coefficients.forward(P, r, pre, ws.unused.data(), ws.unused.data() + n);
    for (int64_t k = 0; k < n; ++k) {
      ws.dh_pre[k] = supplied.dh_pre != nullptr ? supplied.dh_pre[token * n + k]
                                                : dot(xt + k * D, dli + t * D, D);
    }
    double* sums = s.token_sums.data() + t * (3 + N);
    std::fill_n(sums, 3 + N, 0.0);
    double dr = 0.0;
    // The head (pre gates only) has no dh_post, dh_res (null).
    const float* token_dh_post = dims.pre_gates_only ? nullptr : dh_post + token * n;
    const float* token_dh_res = dims.pre_gates_only ? nullptr : dh_res + token * n * n;
    ws.coefficients.backward(P, r, ws.dh_pre.data(), token_dh_post, token_dh_res,
                             s.dP.data() + t * N, &dr, sums, sums + 3);
    s.rms_term[t] = static_cast<float>(dr * r * r * r / static_cast<double>(dims.M_full));
  };

  // The token sums of a tile added to its chunk's, in token order.
  auto add_token_sums = [&](const TileState& s, int64_t tokens, int64_t chunk) {
    double* total = small.data() + chunk * (N + 3);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t c = 0; c < N + 3; ++c)
        total[c] += s.token_sums[static_cast<size_t>(t * (3 + N) + c)];
    }
  };

  // The second sweep over rows [m_begin, m_end) of the tile from t0 (m_begin a multiple of
  // kInputGradBlock): dx = dx_partial + H_pre dli - rms_term x + dP W^T, and the weight gradient
  // of those rows, added to the chunk's G (or finished into dphi, dnorm_weight when direct).
  auto second_sweep = [&](TileState& s, const float* xf, const float* dli, X* dx, int64_t t0,
                          int64_t tokens, int64_t chunk, int64_t m_begin, int64_t m_end) {
    float* dxf = f32_target(dx, s.dx);
    for (int64_t t = 0; t < tokens; ++t) {
      float* dxt = dxf + t * M;
      if (dx_partial == nullptr) {  // the head: dx has only the pre terms
        std::fill(dxt + m_begin, dxt + m_end, 0.0f);
      } else {
        const X* partial = dx_partial + (t0 + t) * M;
        const float* dxp = as_f32(partial + m_begin, m_end - m_begin, dxt + m_begin);
        if (dxp != dxt + m_begin) std::copy(dxp, dxp + (m_end - m_begin), dxt + m_begin);
      }
      for (int64_t k = m_begin / D; k * D < m_end; ++k) {
        const int64_t d0 = std::max(m_begin, k * D) - k * D;
        const int64_t d1 = std::min(m_end, (k + 1) * D) - k * D;
        axpy(s.h_pre[static_cast<size_t>(t * n + k)], dli + t * D + d0, dxt + k * D + d0, d1 - d0);
      }
      axpy(-s.rms_term[static_cast<size_t>(t)], xf + t * M + m_begin, dxt + m_begin,
           m_end - m_begin);
    }
    add_projection_grad(s.dP.data(), tokens, weight, m_begin, m_end, dxf);
    thread_local std::vector<float> sums_storage;
    float* S = workspace(sums_storage, static_cast<size_t>(N * kWeightGradBlock));
    for (int64_t m0 = m_begin; m0 < m_end; m0 += kWeightGradBlock) {
      const int64_t width = std::min(kWeightGradBlock, M - m0);
      weight_grad_sums(xf, s.dP.data(), tokens, M, N, m0, S);
      if (direct) {
        finish_weight_sums(S, width, N, m0, norm_weight, phi, dphi, dnorm_weight);
      } else {
        double* block = G + chunk * N * M + m0 * N;
        for (int64_t e = 0; e < N * width; ++e) block[e] += static_cast<double>(S[e]);
      }
    }
    for (int64_t t = 0; t < tokens; ++t) {
      store_from(dxf + t * M + m_begin, dx + t * M + m_begin, m_end - m_begin);
    }
  };

  // Chunks own consecutive tiles; within a chunk the tiles run in order.
  auto chunk_of = [&](int64_t chunk_index) {
    return std::pair<int64_t, int64_t>{chunk_index * tiles / chunks,
                                       (chunk_index + 1) * tiles / chunks};
  };

  if (split_rows) {
    TileState& s = tile_states[0];
    // One contiguous range of rows per thread, as in project_split_rows (tiles.h).
    const int64_t row_blocks = ceil_div(M, kInputGradBlock);
    const int64_t row_tasks = std::min<int64_t>(row_blocks, threads);
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const auto [first, last] = chunk_of(chunk);
      for (int64_t task = first; task < last; ++task) {
        const int64_t t0 = task * tile;
        const int64_t tokens = std::min(tile, T - t0);
        const float* xf =
            project_split_rows(io.x_tile(t0, tokens, 0), tokens, weight, s.x, s.P.data());
        const float* dli = s.dlayer_in;
        if constexpr (std::is_same_v<X, float>) dli = dlayer_in + t0 * D;
        pool.parallel_for(tokens, workers, [&](int64_t t, int worker) {
          if constexpr (std::is_same_v<X, bf16>) {
            widen(dlayer_in + (t0 + t) * D, s.dlayer_in + t * D, D);
          }
          coefficient_token(s, worker_states[static_cast<size_t>(worker)], xf, dli, t0, t);
        });
        add_token_sums(s, tokens, chunk);
        pool.parallel_for(row_tasks, workers, [&](int64_t range, int) {
          const int64_t m_begin = range * row_blocks / row_tasks * kInputGradBlock;
          const int64_t m_end = std::min(M, (range + 1) * row_blocks / row_tasks * kInputGradBlock);
          second_sweep(s, xf, dli, io.dx_tile(t0, 0), t0, tokens, chunk, m_begin, m_end);
        });
        if constexpr (TileIO::kConsumes) {
          pool.parallel_for(tokens, workers, [&](int64_t t, int) { io.consume(t0, t, t + 1, 0); });
        }
      }
    }
  } else {
    pool.parallel_for(chunks, workers, [&](int64_t chunk, int worker) {
      TileState& s = tile_states[static_cast<size_t>(worker)];
      WorkerState& ws = worker_states[static_cast<size_t>(worker)];
      const auto [first, last] = chunk_of(chunk);
      for (int64_t task = first; task < last; ++task) {
        const int64_t t0 = task * tile;
        const int64_t tokens = std::min(tile, T - t0);
        const float* xf = as_f32(io.x_tile(t0, tokens, worker), tokens * M, s.x);
        const float* dli = as_f32(dlayer_in + t0 * D, tokens * D, s.dlayer_in);
        if (supplied.partials == nullptr) project(xf, tokens, weight, s.P.data());
        for (int64_t t = 0; t < tokens; ++t) coefficient_token(s, ws, xf, dli, t0, t);
        add_token_sums(s, tokens, chunk);
        second_sweep(s, xf, dli, io.dx_tile(t0, worker), t0, tokens, chunk, 0, M);
        io.consume(t0, 0, tokens, worker);
      }
    });
  }

  // Fixed-order reduction of the chunks, parallel over blocks of rows m of phi.
  if (!direct) {
    pool.parallel_for(ceil_div(M, kWeightGradBlock), pool.threads(), [&](int64_t task, int) {
      const int64_t m0 = task * kWeightGradBlock, width = std::min(kWeightGradBlock, M - m0);
      const double* block = G + m0 * N;
      auto total = [&](int64_t c, int64_t j) {
        double sum = 0.0;
        for (int64_t k = 0; k < chunks; ++k) sum += block[k * N * M + c * width + j];
        return sum;
      };
      finish_weight_block(m0, width, N, total, norm_weight, phi, dphi, dnorm_weight);
    });
  }
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
    MemoryTiles<X> io{static_cast<const X*>(x.data), static_cast<X*>(dx.data), dims.M};
    run(config, dims, static_cast<const X*>(dlayer_in.data), static_cast<const X*>(dx_partial.data),
        static_cast<const float*>(dh_post.data), static_cast<const float*>(dh_res.data), io,
        supplied, params, grads);
  });
}

// The fused boundary's tiles: x_next recomputed from x and layer_out by the post forward into a
// staging tile, and dx_next staged per tile and consumed by the post backward, so neither is
// written to or read from memory. Same bits as pre_backward then post_backward: the staged tiles
// hold exactly what those operations would store (rounded to X) and read back.
template <class X, class L>
struct BoundaryTiles {
  static constexpr bool kConsumes = true;
  const X* x;  // x of the post (sublayer l), [T, n, D]
  const L* layer_out;
  const float* h_post;
  const float* h_res;
  PostBackwardOutputs outputs;
  int64_t n, D, M;
  X* staging = nullptr;  // per tile state: x_next, then dx_next, tile x M each
  int64_t tile = 0;

  void prepare(int64_t tile_tokens, int states) {
    thread_local std::vector<X> storage;
    tile = tile_tokens;
    staging = workspace(storage, static_cast<size_t>(int64_t{2} * states * tile * M));
  }
  const X* x_tile(int64_t t0, int64_t tokens, int state) const {
    X* x_next = staging + int64_t{2} * state * tile * M;
    post_forward_tokens(x + t0 * M, layer_out + t0 * D, h_post + t0 * n, h_res + t0 * n * n, n, D,
                        0, tokens, x_next);
    return x_next;
  }
  X* dx_tile(int64_t /*t0*/, int state) const {
    return staging + (int64_t{2} * state + 1) * tile * M;
  }
  void consume(int64_t t0, int64_t begin, int64_t end, int state) const {
    post_backward_tokens(dx_tile(t0, state), x + t0 * M, layer_out + t0 * D, h_post + t0 * n,
                         h_res + t0 * n * n, n, D, begin, end,
                         static_cast<X*>(outputs.dx_partial.data) + t0 * M,
                         static_cast<L*>(outputs.dlayer_out.data) + t0 * D,
                         static_cast<float*>(outputs.dh_post.data) + t0 * n,
                         static_cast<float*>(outputs.dh_res.data) + t0 * n * n);
  }
};

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

void boundary_backward(const Config& config, const detail::Dims& dims,
                       const TensorRef& next_dlayer_in, const TensorRef& next_dx_partial,
                       const TensorRef& next_dh_post, const TensorRef& next_dh_res,
                       const TensorRef& x, const TensorRef& layer_out, const TensorRef& h_post,
                       const TensorRef& h_res, const Params& next_params,
                       const PostBackwardOutputs& outputs, const ParamGrads& next_grads) {
  with_activation_type(x.dtype, [&](auto x_tag) {
    using X = decltype(x_tag);
    with_activation_type(layer_out.dtype, [&](auto lo_tag) {
      using L = decltype(lo_tag);
      BoundaryTiles<X, L> io{static_cast<const X*>(x.data),
                             static_cast<const L*>(layer_out.data),
                             static_cast<const float*>(h_post.data),
                             static_cast<const float*>(h_res.data),
                             outputs,
                             dims.n,
                             dims.D,
                             dims.M};
      run(config, dims, static_cast<const X*>(next_dlayer_in.data),
          static_cast<const X*>(next_dx_partial.data), static_cast<const float*>(next_dh_post.data),
          static_cast<const float*>(next_dh_res.data), io, Supplied{}, next_params, next_grads);
    });
  });
}

}  // namespace mhc::cpu
