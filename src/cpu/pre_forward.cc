// pre_forward on the CPU (spec: Forward steps 1-6). Per token tile: one sweep computes the sum of
// squares and the projection P = x (norm_weight * phi), the per-token math turns them into the
// coefficients, and a second sweep over the same cached tile applies H_pre.
#include <cmath>
#include <type_traits>

#include "coefficients.h"
#include "kernels.h"
#include "thread_pool.h"
#include "tiles.h"

namespace mhc::cpu {

std::vector<float> fold_weight(const float* norm_weight, const float* phi, int64_t M, int64_t N) {
  std::vector<float> wt(static_cast<size_t>(M * N));
  constexpr int64_t kRows = 1024;
  ThreadPool& pool = ThreadPool::instance();
  pool.parallel_for(ceil_div(M, kRows), pool.threads(), [&](int64_t task, int) {
    const int64_t end = std::min(M, (task + 1) * kRows);
    for (int64_t m = task * kRows; m < end; ++m) {
      for (int64_t c = 0; c < N; ++c) wt[c * M + m] = norm_weight[m] * phi[m * N + c];
    }
  });
  return wt;
}

namespace {

template <class X>
void run(const Config& config, const detail::Dims& dims, const X* x, const Params& params,
         X* layer_in, float* h_pre, float* h_post, float* h_res) {
  const int64_t T = dims.T, n = dims.n, D = dims.D, M = dims.M, N = dims.N;
  if (T == 0) return;
  const auto* alpha = static_cast<const float*>(params.alpha.data);
  const auto* bias = static_cast<const float*>(params.bias.data);
  const std::vector<float> wt = fold_weight(static_cast<const float*>(params.norm_weight.data),
                                            static_cast<const float*>(params.phi.data), M, N);
  const int64_t tile = pre_tile_tokens(M);
  const int64_t tiles = ceil_div(T, tile);
  ThreadPool& pool = ThreadPool::instance();
  const int workers = static_cast<int>(std::min<int64_t>(pool.threads(), tiles));

  struct Scratch {
    std::vector<float> x;         // tile of x widened to f32 (bf16 only)
    std::vector<float> P;         // [tile, N]
    std::vector<float> layer_in;  // [D] (bf16 only)
    TokenCoefficients coefficients;
  };
  constexpr bool kWiden = std::is_same_v<X, bf16>;
  std::vector<Scratch> scratch;
  for (int w = 0; w < workers; ++w) {
    scratch.push_back(Scratch{std::vector<float>(kWiden ? static_cast<size_t>(tile * M) : 0),
                              std::vector<float>(static_cast<size_t>(tile * N)),
                              std::vector<float>(kWiden ? static_cast<size_t>(D) : 0),
                              TokenCoefficients(config, alpha, bias)});
  }

  pool.parallel_for(tiles, workers, [&](int64_t task, int worker) {
    Scratch& s = scratch[static_cast<size_t>(worker)];
    const int64_t t0 = task * tile;
    const int64_t tokens = std::min(tile, T - t0);
    const float* xf = as_f32(x + t0 * M, tokens * M, s.x.data());
    project(xf, tokens, M, wt.data(), N, s.P.data());
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t token = t0 + t;
      const float* xt = xf + t * M;
      const double r = inverse_rms(sum_squares(xt, M), M, config.rms_eps);
      float* pre = h_pre + token * n;
      s.coefficients.forward(s.P.data() + t * N, r, pre, h_post + token * n, h_res + token * n * n);
      float* li = f32_target(layer_in + token * D, s.layer_in.data());
      weighted_rows(nullptr, 0.0f, xt, n, pre, 1, D, li);
      store_from(li, layer_in + token * D, D);
    }
  });
}

}  // namespace

void pre_forward(const Config& config, const detail::Dims& dims, const TensorRef& x,
                 const Params& params, const PreForwardOutputs& outputs) {
  auto* h_pre = static_cast<float*>(outputs.h_pre.data);
  auto* h_post = static_cast<float*>(outputs.h_post.data);
  auto* h_res = static_cast<float*>(outputs.h_res.data);
  if (x.dtype == DType::bf16) {
    run(config, dims, static_cast<const bf16*>(x.data), params,
        static_cast<bf16*>(outputs.layer_in.data), h_pre, h_post, h_res);
  } else {
    run(config, dims, static_cast<const float*>(x.data), params,
        static_cast<float*>(outputs.layer_in.data), h_pre, h_post, h_res);
  }
}

}  // namespace mhc::cpu
