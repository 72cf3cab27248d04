// post_forward and post_backward on the CPU (spec: Forward step 8, Backward "Post"): pure
// streaming. Each token is swept once, eight features at a time: its n streams (and g, and
// layer_out) are loaded into registers, mixed, and the results stored in the same step, so
// nothing is staged in memory.
//
// Precision: the mixes are sums of at most n + 1 <= 17 products, in f32 FMA (a few ulps, inside
// the spec's bounds). The per-token dots over D (dh_post, dh_res) sum signed terms that can
// cancel, so their products and sums are in double lanes, summed in a fixed order: f32 partial
// sums over 64 features failed the 1e-5 bound on a single cancelling dh_post (n = 1, D = 130). The
// stream loops are unrolled for n = 4 (with_streams), so a token's streams stay in registers.
#include <type_traits>

#include "kernels.h"
#include "post_tokens.h"
#include "simd.h"
#include "thread_pool.h"
#include "tiles.h"

namespace mhc::cpu {

namespace {

using simd::Lanes8;
using simd::sum8;
using simd::Wide8;
using simd::widen;

inline float scalar(float v) { return v; }
inline float scalar(bf16 v) { return to_float(v); }
inline void put(float* p, float v) { *p = v; }
inline void put(bf16* p, float v) { *p = to_bf16(v); }

// out[j] = h_post[j] layer_out + sum_i h_res[i][j] x[i] for one token.
template <int kFixed, class X, class L>
MHC_INLINE void post_forward_token(const X* x, const L* lo, const float* hp, const float* hr,
                                   int64_t n_runtime, int64_t D, X* out) {
  const int n = kFixed > 0 ? kFixed : static_cast<int>(n_runtime);
  constexpr int kCap = kFixed > 0 ? kFixed : kMaxStreams;
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    Lanes8 rows[kCap], l;
    for (int i = 0; i < n; ++i) simd::load_any(&rows[i], x + i * D + d);
    simd::load_any(&l, lo + d);
    for (int j = 0; j < n; ++j) {
      Lanes8 acc = hp[j] * l;
      for (int i = 0; i < n; ++i) acc += hr[i * n + j] * rows[i];
      simd::store_any(out + j * D + d, &acc);
    }
  }
  for (; d < D; ++d) {
    for (int j = 0; j < n; ++j) {
      float acc = hp[j] * scalar(lo[d]);
      for (int i = 0; i < n; ++i) acc += hr[i * n + j] * scalar(x[i * D + d]);
      put(out + j * D + d, acc);
    }
  }
}

// One token of the post backward: dlayer_out, dx_partial, dh_post, dh_res.
template <int kFixed, class X, class L>
MHC_INLINE void post_backward_token(const X* g, const X* x, const L* lo, const float* hp,
                                    const float* hr, int64_t D, X* dxp, L* dlo, float* dh_post,
                                    float* dh_res, int64_t n_runtime) {
  const int n = kFixed > 0 ? kFixed : static_cast<int>(n_runtime);
  constexpr int kCap = kFixed > 0 ? kFixed : kMaxStreams;
  Wide8 post[kCap], res[kCap * kCap];
  for (int e = 0; e < n; ++e) post[e] = Wide8{};
  for (int e = 0; e < n * n; ++e) res[e] = Wide8{};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    Lanes8 gs[kCap], l;
    Wide8 gw[kCap];
    for (int k = 0; k < n; ++k) {
      simd::load_any(&gs[k], g + k * D + d);
      widen(&gs[k], &gw[k]);
    }
    simd::load_any(&l, lo + d);
    Lanes8 dl{};
    for (int j = 0; j < n; ++j) dl += hp[j] * gs[j];
    simd::store_any(dlo + d, &dl);
    Wide8 lw;
    widen(&l, &lw);
    for (int j = 0; j < n; ++j) post[j] += lw * gw[j];
    for (int i = 0; i < n; ++i) {
      Lanes8 dx{};
      for (int j = 0; j < n; ++j) dx += hr[i * n + j] * gs[j];
      simd::store_any(dxp + i * D + d, &dx);
      Lanes8 xi;
      simd::load_any(&xi, x + i * D + d);
      Wide8 xw;
      widen(&xi, &xw);
      for (int j = 0; j < n; ++j) res[i * n + j] += xw * gw[j];
    }
  }
  double post_tail[kCap] = {}, res_tail[kCap * kCap] = {};
  for (; d < D; ++d) {
    float dl = 0.0f;
    for (int j = 0; j < n; ++j) dl += hp[j] * scalar(g[j * D + d]);
    put(dlo + d, dl);
    for (int j = 0; j < n; ++j) post_tail[j] += double{scalar(lo[d])} * scalar(g[j * D + d]);
    for (int i = 0; i < n; ++i) {
      const double xi = scalar(x[i * D + d]);
      float dx = 0.0f;
      for (int j = 0; j < n; ++j) dx += hr[i * n + j] * scalar(g[j * D + d]);
      put(dxp + i * D + d, dx);
      for (int j = 0; j < n; ++j) res_tail[i * n + j] += xi * scalar(g[j * D + d]);
    }
  }
  for (int j = 0; j < n; ++j) {
    dh_post[j] = static_cast<float>(sum8(&post[j]) + post_tail[j]);
  }
  for (int e = 0; e < n * n; ++e) {
    dh_res[e] = static_cast<float>(sum8(&res[e]) + res_tail[e]);
  }
}

// Calls body(std::integral_constant<int, 4>{}) for n = 4 (the paper's and DeepSeek-V4's), where
// the stream loops unroll and a token's streams stay in registers, and
// body(std::integral_constant<int, 0>{}) (n known at run time only) for every other n. Unrolling
// each n from 1 to 8 for every dtype pair and clone made this file take 45 s to compile, several
// times per `make test` (sanitizers, coverage, mutations), and pushed CI past its 30 minutes.
// The body must be an always_inline lambda: an outlined lambda would be compiled for the
// baseline target only.
template <class Body>
MHC_INLINE void with_streams(int64_t n, Body body) {
  if (n == 4) return body(std::integral_constant<int, 4>{});
  return body(std::integral_constant<int, 0>{});
}

}  // namespace

// target_clones applies to plain functions, not templates: one overloaded pair per dtype pair,
// with the token bodies inlined into each clone (declared in post_tokens.h).
// NOLINTBEGIN(bugprone-macro-parentheses): X and L are types, which parentheses would break.
#define MHC_POST_TOKENS(X, L)                                                                      \
  MHC_CLONES void post_forward_tokens(const X* x, const L* lo, const float* hp, const float* hr,   \
                                      int64_t n, int64_t D, int64_t begin, int64_t end, X* out) {  \
    with_streams(                                                                                  \
        n, [&](auto streams) __attribute__((always_inline)) {                                      \
          constexpr int kFixed = decltype(streams)::value;                                         \
          const int64_t M = n * D;                                                                 \
          for (int64_t t = begin; t < end; ++t) {                                                  \
            post_forward_token<kFixed>(x + t * M, lo + t * D, hp + t * n, hr + t * n * n, n, D,    \
                                       out + t * M);                                               \
          }                                                                                        \
        });                                                                                        \
  }                                                                                                \
  MHC_CLONES void post_backward_tokens(                                                            \
      const X* g, const X* x, const L* lo, const float* hp, const float* hr, int64_t n, int64_t D, \
      int64_t begin, int64_t end, X* dxp, L* dlo, float* dh_post, float* dh_res) {                 \
    with_streams(                                                                                  \
        n, [&](auto streams) __attribute__((always_inline)) {                                      \
          constexpr int kFixed = decltype(streams)::value;                                         \
          const int64_t M = n * D;                                                                 \
          for (int64_t t = begin; t < end; ++t) {                                                  \
            post_backward_token<kFixed>(g + t * M, x + t * M, lo + t * D, hp + t * n,              \
                                        hr + t * n * n, D, dxp + t * M, dlo + t * D,               \
                                        dh_post + t * n, dh_res + t * n * n, n);                   \
          }                                                                                        \
        });                                                                                        \
  }

MHC_POST_TOKENS(float, float)
MHC_POST_TOKENS(float, bf16)
MHC_POST_TOKENS(bf16, float)
MHC_POST_TOKENS(bf16, bf16)
#undef MHC_POST_TOKENS
// NOLINTEND(bugprone-macro-parentheses)

namespace {

// Elements of x below which a post operation runs on the calling thread alone: 2^18 is 16 tokens
// at n D = 16384, about 80 us of work on one core. Below it, handing half to a second thread cost
// more than it saved (decode, T = 8, D = 4096: 46 us on one thread against 75-128 us on two, the
// second thread competing with XLA's own). Results do not depend on it.
constexpr int64_t kMinParallelElements = int64_t{1} << 18;

// Runs body(begin, end) over the tokens in tasks of post_tile_tokens(M) on the pool.
template <class Body>
void over_token_tiles(const detail::Dims& dims, Body body) {
  const int64_t tile = post_tile_tokens(dims.M);
  const int64_t tasks = ceil_div(dims.T, tile);
  ThreadPool& pool = ThreadPool::instance();
  const int64_t threads = dims.T * dims.M < kMinParallelElements ? 1 : pool.threads();
  const int workers = static_cast<int>(std::min<int64_t>(threads, tasks));
  pool.parallel_for(tasks, workers, [&](int64_t task, int) {
    body(task * tile, std::min(dims.T, (task + 1) * tile));
  });
}

}  // namespace

void post_forward(const Config&, const detail::Dims& dims, const TensorRef& x,
                  const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                  const MutableTensorRef& out) {
  if (dims.T == 0) return;
  with_activation_types(x.dtype, layer_out.dtype, [&](auto x_tag, auto lo_tag) {
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
  with_activation_types(x.dtype, layer_out.dtype, [&](auto x_tag, auto lo_tag) {
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
