// post_forward and post_backward on the CPU (spec: Forward step 8, Backward "Post"): pure
// streaming, one token at a time, each token's rows widened to f32 once and used for every term.
#include <type_traits>

#include "kernels.h"
#include "thread_pool.h"
#include "tiles.h"

namespace mhc::cpu {

namespace {

template <class T>
std::vector<float> staging(int64_t count) {
  return std::vector<float>(std::is_same_v<T, bf16> ? static_cast<size_t>(count) : 0);
}

template <class X, class L>
void run_post_forward(const detail::Dims& dims, const X* x, const L* layer_out, const float* h_post,
                      const float* h_res, X* out) {
  const int64_t T = dims.T, n = dims.n, D = dims.D, M = dims.M;
  const int64_t tile = post_tile_tokens(M);
  const int64_t tasks = ceil_div(T, tile);
  ThreadPool& pool = ThreadPool::instance();
  const int workers = static_cast<int>(std::min<int64_t>(pool.threads(), tasks));
  struct Scratch {
    std::vector<float> x, layer_out, out;
  };
  std::vector<Scratch> scratch;
  scratch.reserve(static_cast<size_t>(workers));
  for (int w = 0; w < workers; ++w)
    scratch.push_back({staging<X>(M), staging<L>(D), staging<X>(M)});

  pool.parallel_for(tasks, workers, [&](int64_t task, int worker) {
    Scratch& s = scratch[static_cast<size_t>(worker)];
    const int64_t end = std::min(T, (task + 1) * tile);
    for (int64_t t = task * tile; t < end; ++t) {
      const float* xt = as_f32(x + t * M, M, s.x.data());
      const float* lo = as_f32(layer_out + t * D, D, s.layer_out.data());
      float* ot = f32_target(out + t * M, s.out.data());
      const float* hr = h_res + t * n * n;
      for (int64_t j = 0; j < n; ++j) {
        weighted_rows(lo, h_post[t * n + j], xt, n, hr + j, n, D, ot + j * D);
      }
      store_from(ot, out + t * M, M);
    }
  });
}

template <class X, class L>
void run_post_backward(const detail::Dims& dims, const X* g, const X* x, const L* layer_out,
                       const float* h_post, const float* h_res, X* dx_partial, L* dlayer_out,
                       float* dh_post, float* dh_res) {
  const int64_t T = dims.T, n = dims.n, D = dims.D, M = dims.M;
  const int64_t tile = post_tile_tokens(M);
  const int64_t tasks = ceil_div(T, tile);
  ThreadPool& pool = ThreadPool::instance();
  const int workers = static_cast<int>(std::min<int64_t>(pool.threads(), tasks));
  struct Scratch {
    std::vector<float> g, x, layer_out, dx_partial, dlayer_out;
  };
  std::vector<Scratch> scratch;
  scratch.reserve(static_cast<size_t>(workers));
  for (int w = 0; w < workers; ++w) {
    scratch.push_back({staging<X>(M), staging<X>(M), staging<L>(D), staging<X>(M), staging<L>(D)});
  }

  pool.parallel_for(tasks, workers, [&](int64_t task, int worker) {
    Scratch& s = scratch[static_cast<size_t>(worker)];
    const int64_t end = std::min(T, (task + 1) * tile);
    for (int64_t t = task * tile; t < end; ++t) {
      const float* gt = as_f32(g + t * M, M, s.g.data());
      const float* xt = as_f32(x + t * M, M, s.x.data());
      const float* lo = as_f32(layer_out + t * D, D, s.layer_out.data());
      float* dxp = f32_target(dx_partial + t * M, s.dx_partial.data());
      float* dlo = f32_target(dlayer_out + t * D, s.dlayer_out.data());
      const float* hp = h_post + t * n;
      const float* hr = h_res + t * n * n;
      weighted_rows(nullptr, 0.0f, gt, n, hp, 1, D, dlo);
      for (int64_t j = 0; j < n; ++j)
        dh_post[t * n + j] = static_cast<float>(dot(lo, gt + j * D, D));
      for (int64_t i = 0; i < n; ++i) {
        weighted_rows(nullptr, 0.0f, gt, n, hr + i * n, 1, D, dxp + i * D);
        for (int64_t j = 0; j < n; ++j) {
          dh_res[(t * n + i) * n + j] = static_cast<float>(dot(xt + i * D, gt + j * D, D));
        }
      }
      store_from(dxp, dx_partial + t * M, M);
      store_from(dlo, dlayer_out + t * D, D);
    }
  });
}

// Calls fn with typed pointers for the (x dtype, layer_out dtype) pair.
template <class Fn>
void dispatch(DType x_dtype, DType layer_out_dtype, Fn fn) {
  if (x_dtype == DType::bf16) {
    if (layer_out_dtype == DType::bf16) return fn(bf16{}, bf16{});
    return fn(bf16{}, 0.0f);
  }
  if (layer_out_dtype == DType::bf16) return fn(0.0f, bf16{});
  return fn(0.0f, 0.0f);
}

}  // namespace

void post_forward(const Config&, const detail::Dims& dims, const TensorRef& x,
                  const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                  const MutableTensorRef& out) {
  if (dims.T == 0) return;
  dispatch(x.dtype, layer_out.dtype, [&](auto x_tag, auto lo_tag) {
    using X = decltype(x_tag);
    using L = decltype(lo_tag);
    run_post_forward(dims, static_cast<const X*>(x.data), static_cast<const L*>(layer_out.data),
                     static_cast<const float*>(h_post.data), static_cast<const float*>(h_res.data),
                     static_cast<X*>(out.data));
  });
}

void post_backward(const Config&, const detail::Dims& dims, const TensorRef& g, const TensorRef& x,
                   const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                   const PostBackwardOutputs& outputs) {
  if (dims.T == 0) return;
  dispatch(x.dtype, layer_out.dtype, [&](auto x_tag, auto lo_tag) {
    using X = decltype(x_tag);
    using L = decltype(lo_tag);
    run_post_backward(
        dims, static_cast<const X*>(g.data), static_cast<const X*>(x.data),
        static_cast<const L*>(layer_out.data), static_cast<const float*>(h_post.data),
        static_cast<const float*>(h_res.data), static_cast<X*>(outputs.dx_partial.data),
        static_cast<L*>(outputs.dlayer_out.data), static_cast<float*>(outputs.dh_post.data),
        static_cast<float*>(outputs.dh_res.data));
  });
}

}  // namespace mhc::cpu
