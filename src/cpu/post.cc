// post_forward and post_backward on the CPU (spec: Forward step 8, Backward "Post"): pure
// streaming. Each token is swept once, eight features at a time: its n streams (and g, and
// layer_out) are loaded, widened to double in registers, mixed, and the results rounded and
// stored in the same step, so nothing is staged in memory. Per-token dots (dh_post, dh_res)
// accumulate in double lanes and are summed in a fixed order.
#include "kernels.h"
#include "simd.h"
#include "thread_pool.h"
#include "tiles.h"

namespace mhc::cpu {

namespace {

using simd::Lanes8;
using simd::Wide4;

inline float scalar(float v) { return v; }
inline float scalar(bf16 v) { return to_float(v); }
inline void put(float* p, double v) { *p = static_cast<float>(v); }
inline void put(bf16* p, double v) { *p = to_bf16(static_cast<float>(v)); }

// Eight features of one stream, widened to double.
struct Block {
  Wide4 low, high;
};

template <class T>
MHC_INLINE Block load_block(const T* p) {
  Lanes8 v;
  simd::load_any(&v, p);
  Block b;
  simd::widen8(&v, &b.low, &b.high);
  return b;
}

template <class T>
MHC_INLINE void store_block(T* p, const Block& b) {
  Lanes8 v;
  simd::narrow8(&b.low, &b.high, &v);
  simd::store_any(p, &v);
}

// out[j] = h_post[j] layer_out + sum_i h_res[i][j] x[i] for one token.
template <class X, class L>
MHC_INLINE void post_forward_token(const X* x, const L* lo, const float* hp, const float* hr,
                                   int64_t n, int64_t D, X* out) {
  Block rows[kMaxStreams];
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    for (int64_t i = 0; i < n; ++i) rows[i] = load_block(x + i * D + d);
    const Block l = load_block(lo + d);
    for (int64_t j = 0; j < n; ++j) {
      const double w = hp[j];
      Block acc{w * l.low, w * l.high};
      for (int64_t i = 0; i < n; ++i) {
        const double h = hr[i * n + j];
        acc.low += h * rows[i].low;
        acc.high += h * rows[i].high;
      }
      store_block(out + j * D + d, acc);
    }
  }
  for (; d < D; ++d) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = double{hp[j]} * scalar(lo[d]);
      for (int64_t i = 0; i < n; ++i) acc += double{hr[i * n + j]} * scalar(x[i * D + d]);
      put(out + j * D + d, acc);
    }
  }
}

// One token of the post backward: dlayer_out, dx_partial, dh_post, dh_res.
template <class X, class L>
MHC_INLINE void post_backward_token(const X* g, const X* x, const L* lo, const float* hp,
                                    const float* hr, int64_t n, int64_t D, X* dxp, L* dlo,
                                    float* dh_post, float* dh_res) {
  Block gs[kMaxStreams], xs[kMaxStreams];
  Block post[kMaxStreams], res[kMaxStreams * kMaxStreams];
  for (int64_t e = 0; e < n; ++e) post[e] = Block{};
  for (int64_t e = 0; e < n * n; ++e) res[e] = Block{};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    for (int64_t k = 0; k < n; ++k) {
      gs[k] = load_block(g + k * D + d);
      xs[k] = load_block(x + k * D + d);
    }
    const Block l = load_block(lo + d);
    Block dl{};
    for (int64_t j = 0; j < n; ++j) {
      const double w = hp[j];
      dl.low += w * gs[j].low;
      dl.high += w * gs[j].high;
      post[j].low += l.low * gs[j].low;
      post[j].high += l.high * gs[j].high;
    }
    store_block(dlo + d, dl);
    for (int64_t i = 0; i < n; ++i) {
      Block dx{};
      for (int64_t j = 0; j < n; ++j) {
        const double h = hr[i * n + j];
        dx.low += h * gs[j].low;
        dx.high += h * gs[j].high;
        Block& r = res[i * n + j];
        r.low += xs[i].low * gs[j].low;
        r.high += xs[i].high * gs[j].high;
      }
      store_block(dxp + i * D + d, dx);
    }
  }
  double post_tail[kMaxStreams] = {}, res_tail[kMaxStreams * kMaxStreams] = {};
  for (; d < D; ++d) {
    double dl = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      const double gj = scalar(g[j * D + d]);
      dl += double{hp[j]} * gj;
      post_tail[j] += scalar(lo[d]) * gj;
    }
    put(dlo + d, dl);
    for (int64_t i = 0; i < n; ++i) {
      double dx = 0.0;
      const double xi = scalar(x[i * D + d]);
      for (int64_t j = 0; j < n; ++j) {
        const double gj = scalar(g[j * D + d]);
        dx += double{hr[i * n + j]} * gj;
        res_tail[i * n + j] += xi * gj;
      }
      put(dxp + i * D + d, dx);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    dh_post[j] = static_cast<float>(simd::sum8(&post[j].low, &post[j].high) + post_tail[j]);
  }
  for (int64_t e = 0; e < n * n; ++e) {
    dh_res[e] = static_cast<float>(simd::sum8(&res[e].low, &res[e].high) + res_tail[e]);
  }
}

// target_clones applies to plain functions, not templates: one overloaded pair per dtype pair,
// with the token bodies inlined into each clone.
// NOLINTBEGIN(bugprone-macro-parentheses): X and L are types, which parentheses would break.
#define MHC_POST_TOKENS(X, L)                                                                      \
  MHC_CLONES void post_forward_tokens(const X* x, const L* lo, const float* hp, const float* hr,   \
                                      int64_t n, int64_t D, int64_t begin, int64_t end, X* out) {  \
    const int64_t M = n * D;                                                                       \
    for (int64_t t = begin; t < end; ++t) {                                                        \
      post_forward_token(x + t * M, lo + t * D, hp + t * n, hr + t * n * n, n, D, out + t * M);    \
    }                                                                                              \
  }                                                                                                \
  MHC_CLONES void post_backward_tokens(                                                            \
      const X* g, const X* x, const L* lo, const float* hp, const float* hr, int64_t n, int64_t D, \
      int64_t begin, int64_t end, X* dxp, L* dlo, float* dh_post, float* dh_res) {                 \
    const int64_t M = n * D;                                                                       \
    for (int64_t t = begin; t < end; ++t) {                                                        \
      post_backward_token(g + t * M, x + t * M, lo + t * D, hp + t * n, hr + t * n * n, n, D,      \
                          dxp + t * M, dlo + t * D, dh_post + t * n, dh_res + t * n * n);          \
    }                                                                                              \
  }

MHC_POST_TOKENS(float, float)
MHC_POST_TOKENS(float, bf16)
MHC_POST_TOKENS(bf16, float)
MHC_POST_TOKENS(bf16, bf16)
#undef MHC_POST_TOKENS
// NOLINTEND(bugprone-macro-parentheses)

// Runs body(begin, end) over the tokens in tasks of post_tile_tokens(M) on the pool.
template <class Body>
void over_token_tiles(const detail::Dims& dims, Body body) {
  const int64_t tile = post_tile_tokens(dims.M);
  const int64_t tasks = ceil_div(dims.T, tile);
  ThreadPool& pool = ThreadPool::instance();
  const int workers = static_cast<int>(std::min<int64_t>(pool.threads(), tasks));
  pool.parallel_for(tasks, workers, [&](int64_t task, int) {
    body(task * tile, std::min(dims.T, (task + 1) * tile));
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
    over_token_tiles(dims, [&](int64_t begin, int64_t end) {
      post_forward_tokens(static_cast<const X*>(x.data), static_cast<const L*>(layer_out.data),
                          static_cast<const float*>(h_post.data),
                          static_cast<const float*>(h_res.data), dims.n, dims.D, begin, end,
                          static_cast<X*>(out.data));
    });
  });
}

void post_backward(const Config&, const detail::Dims& dims, const TensorRef& g, const TensorRef& x,
                   const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                   const PostBackwardOutputs& outputs) {
  if (dims.T == 0) return;
  dispatch(x.dtype, layer_out.dtype, [&](auto x_tag, auto lo_tag) {
    using X = decltype(x_tag);
    using L = decltype(lo_tag);
    over_token_tiles(dims, [&](int64_t begin, int64_t end) {
      post_backward_tokens(
          static_cast<const X*>(g.data), static_cast<const X*>(x.data),
          static_cast<const L*>(layer_out.data), static_cast<const float*>(h_post.data),
          static_cast<const float*>(h_res.data), dims.n, dims.D, begin, end,
          static_cast<X*>(outputs.dx_partial.data), static_cast<L*>(outputs.dlayer_out.data),
          static_cast<float*>(outputs.dh_post.data), static_cast<float*>(outputs.dh_res.data));
    });
  });
}

}  // namespace mhc::cpu
