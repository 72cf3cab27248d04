// DeepSeek-V4.1's final collapse on the CPU (spec: Single-pass schedule): out[t, d] =
// sum_k carried[t, k] x[t, k, d], no parameters, and its backward dx[t, k, d] = carried[t, k]
// dout[t, d], dcarried[t, k] = <x[t, k], dout[t]>. Streaming work of about n + 1 flops per element:
// one pass per token over tasks of post_tile_tokens(M) tokens, as the post operations, in the
// pre kernels' inner loops (the forward's sum is weighted_rows, so it has the bits of
// pre_forward_carried's layer_in, reading x and writing out in their own type, bf16 widened in
// the loads; dcarried is dot, as pre_backward_carried's). The PreApply one_hot is
// the one-hot on stream 0: the forward copies stream 0, the backward writes dout to dx[:, 0] and
// zeros to the other streams.
#include <algorithm>
#include <type_traits>

#include "kernels.h"
#include "pre_kernels.h"
#include "tiles.h"
#include "workspace.h"

namespace mhc::cpu {

namespace {

// As the post operations (post.cc): below 2^18 elements of x the calling thread does it alone.
constexpr int64_t kMinParallelElements = int64_t{1} << 18;

// Runs body(begin, end, staging) over the tokens in tasks of post_tile_tokens(M) on the pool,
// with `per_worker` floats of staging for each worker (bf16 widening).
template <class Body>
void over_token_tiles(const detail::Dims& dims, size_t per_worker, Body body) {
  const int64_t tile = post_tile_tokens(dims.M);
  const int64_t tasks = ceil_div(dims.T, tile);
  ThreadPool& pool = ThreadPool::instance();
  const int64_t threads = dims.T * dims.M < kMinParallelElements ? 1 : pool.threads();
  const int workers = static_cast<int>(std::min<int64_t>(threads, tasks));
  Workspace workspace(Workspace::bytes_for<float>(per_worker * static_cast<size_t>(workers)));
  float* staging = workspace.take<float>(per_worker * static_cast<size_t>(workers));
  pool.parallel_for(tasks, workers, [&](int64_t task, int worker) {
    body(task * tile, std::min(dims.T, (task + 1) * tile),
         staging + static_cast<size_t>(worker) * per_worker);
  });
}

template <class X>
void forward_tokens(const detail::Dims& dims, const X* x, const PreApplyMix& mix, X* out) {
  const int64_t n = dims.n, D = dims.D, M = dims.M;
  over_token_tiles(dims, 0, [&](int64_t begin, int64_t end, float*) {
    for (int64_t t = begin; t < end; ++t) {
      weighted_rows(x + t * M, mix.streams(n), mix.row(t, n, nullptr), D, out + t * D);
    }
  });
}

template <class X>
void backward_tokens(const detail::Dims& dims, const X* dout, const X* x, const PreApplyMix& mix,
                     X* dx, float* dcarried) {
  const int64_t n = dims.n, D = dims.D, M = dims.M;
  constexpr bool kWiden = std::is_same_v<X, bf16>;
  // Per worker, one token widened: x [M], dout [D] and dx [M].
  const size_t per_worker = kWiden ? static_cast<size_t>(2 * M + D) : 0;
  over_token_tiles(dims, per_worker, [&](int64_t begin, int64_t end, float* staging) {
    float* dout_staging = kWiden ? staging + M : nullptr;  // f32 has no staging (null)
    float* dx_staging = kWiden ? staging + M + D : nullptr;
    for (int64_t t = begin; t < end; ++t) {
      const float* g = as_f32(dout + t * D, D, dout_staging);
      float* dxt = f32_target(dx + t * M, dx_staging);
      const float* weights = mix.row(t, n, nullptr);
      std::fill(dxt, dxt + M, 0.0f);
      for (int64_t k = 0; k < mix.streams(n); ++k) axpy(weights[k], g, dxt + k * D, D);
      store_from(dxt, dx + t * M, M);
      if (dcarried != nullptr) {
        const float* xt = as_f32(x + t * M, M, staging);
        for (int64_t k = 0; k < n; ++k) {
          dcarried[t * n + k] = static_cast<float>(dot(xt + k * D, g, D));
        }
      }
    }
  });
}

}  // namespace

void collapse_forward(const detail::Dims& dims, const TensorRef& x, const PreApplyMix& mix,
                      const MutableTensorRef& out) {
  if (dims.T == 0) return;
  with_activation_type(x.dtype, [&](auto tag) {
    using X = decltype(tag);
    forward_tokens(dims, static_cast<const X*>(x.data), mix, static_cast<X*>(out.data));
  });
}

void collapse_backward(const detail::Dims& dims, const TensorRef& dout, const TensorRef& x,
                       const PreApplyMix& mix, const MutableTensorRef& dx, float* dcarried) {
  if (dims.T == 0) return;
  with_activation_type(x.dtype, [&](auto tag) {
    using X = decltype(tag);
    backward_tokens(dims, static_cast<const X*>(dout.data), static_cast<const X*>(x.data), mix,
                    static_cast<X*>(dx.data), mix.mode == PreApply::carried ? dcarried : nullptr);
  });
}

}  // namespace mhc::cpu
