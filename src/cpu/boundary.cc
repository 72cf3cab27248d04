// The fused boundary on the CPU (spec: the boundary, post of sublayer l with pre of l+1): the pre
// kernels (pre_kernels.h) with tile sources (tile_source.h) that run sublayer l's post inside the
// pre's tiles.
//
// Forward: the post forward writes each tile of x_{l+1} (to the output, which the caller keeps)
// just before the pre forward reads it back from cache.
// Backward: x_{l+1} is recomputed per tile into staging, the pre backward of l+1 runs as usual
// with its dx_{l+1} going to a second staging tile, and the post backward of l consumes that tile
// at once, so dx_{l+1} is never written to memory. The staged tiles hold exactly what the
// separate operations store and read back (rounded to X), so the results equal pre_backward then
// post_backward bit for bit.
#include "kernels.h"
#include "post_tokens.h"
#include "pre_kernels.h"
#include "workspace.h"

namespace mhc::cpu {

namespace {

// Sublayer l's post: x [T, n, D], layer_out [T, D], h_post [T, n], h_res [T, n, n].
template <class X, class L>
struct PostInputs {
  const X* x;
  const L* layer_out;
  const float* h_post;
  const float* h_res;
  int64_t n, D, M;
};

template <class X, class L>
PostInputs<X, L> post_inputs(const detail::Dims& dims, const TensorRef& x,
                             const TensorRef& layer_out, const TensorRef& h_post,
                             const TensorRef& h_res) {
  return {static_cast<const X*>(x.data),
          static_cast<const L*>(layer_out.data),
          static_cast<const float*>(h_post.data),
          static_cast<const float*>(h_res.data),
          dims.n,
          dims.D,
          dims.M};
}

// Forward: tile t0 of x_{l+1} is written by the post forward into x_next, then read from there.
template <class X, class L>
class PostForwardTiles final : public TileSource<X> {
 public:
  PostForwardTiles(const PostInputs<X, L>& post, X* x_next) : post_(post), x_next_(x_next) {}

  const X* x_tile(int64_t t0, int64_t tokens, int /*slot*/) override {
    post_forward_tokens(post_.x, post_.layer_out, post_.h_post, post_.h_res, post_.n, post_.D, t0,
                        t0 + tokens, x_next_);
    return x_next_ + t0 * post_.M;
  }
  X* dx_tile(int64_t /*t0*/, int /*slot*/) override { return nullptr; }  // forward only
  void consume(int64_t /*t0*/, int64_t /*begin*/, int64_t /*end*/, int /*slot*/) override {}

 private:
  PostInputs<X, L> post_;
  X* x_next_;
};

// Backward: per slot two staging tiles of X, x_next then dx_next.
template <class X, class L>
class PostBackwardTiles final : public TileSource<X> {
 public:
  PostBackwardTiles(const PostInputs<X, L>& post, const PostBackwardOutputs& outputs)
      : post_(post), outputs_(outputs) {}

  size_t staging_bytes(int64_t tile) const override {
    return Workspace::bytes_for<X>(static_cast<size_t>(2 * tile * post_.M));
  }
  void attach(int64_t tile, int /*slots*/, void* staging) override {
    staging_ = static_cast<std::byte*>(staging);
    tile_ = tile;
  }
  const X* x_tile(int64_t t0, int64_t tokens, int slot) override {
    X* x_next = staged(slot);
    const int64_t n = post_.n, D = post_.D, M = post_.M;
    const X* x = post_.x;
    const L* layer_out = post_.layer_out;
    const float* h_post = post_.h_post;
    const float* h_res = post_.h_res;
    post_forward_tokens(x + t0 * M, layer_out + t0 * D, h_post + t0 * n, h_res + t0 * n * n, n, D,
                        0, tokens, x_next);
    return x_next;
  }
  X* dx_tile(int64_t /*t0*/, int slot) override { return staged(slot) + tile_ * post_.M; }
  void consume(int64_t t0, int64_t begin, int64_t end, int slot) override {
    const int64_t n = post_.n, D = post_.D, M = post_.M;
    post_backward_tokens(dx_tile(t0, slot), post_.x + t0 * M, post_.layer_out + t0 * D,
                         post_.h_post + t0 * n, post_.h_res + t0 * n * n, n, D, begin, end,
                         static_cast<X*>(outputs_.dx_partial.data) + t0 * M,
                         static_cast<L*>(outputs_.dlayer_out.data) + t0 * D,
                         static_cast<float*>(outputs_.dh_post.data) + t0 * n,
                         static_cast<float*>(outputs_.dh_res.data) + t0 * n * n);
  }
  bool consumes() const override { return true; }

 private:
  X* staged(int slot) const {
    return reinterpret_cast<X*>(staging_ + static_cast<size_t>(slot) * staging_bytes(tile_));
  }

  PostInputs<X, L> post_;
  PostBackwardOutputs outputs_;
  std::byte* staging_ = nullptr;
  int64_t tile_ = 0;
};

// The boundary with the next sublayer's pre-apply reading `mix`: V4's own h_pre (the default
// mix) or V4.1's carried h_pre of sublayer l.
void run_forward(const Config& config, const detail::Dims& dims, const TensorRef& x,
                 const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                 const Params& next_params, const MutableTensorRef& x_next,
                 const PreForwardOutputs& next, const PreApplyMix& mix) {
  with_activation_types(x.dtype, layer_out.dtype, [&](auto x_tag, auto lo_tag) {
    using X = decltype(x_tag);
    using L = decltype(lo_tag);
    PostForwardTiles<X, L> source(post_inputs<X, L>(dims, x, layer_out, h_post, h_res),
                                  static_cast<X*>(x_next.data));
    pre_forward_tiles<X>(
        config, dims, pre_weights(next_params), nullptr, source,
        {static_cast<X*>(next.layer_in.data), static_cast<float*>(next.h_pre.data),
         static_cast<float*>(next.h_post.data), static_cast<float*>(next.h_res.data)},
        mix);
  });
}

// Its backward; `supplied` carries V4.1's mix, the next sublayer's dh_pre and where the mix's
// cotangent (dh_pre of sublayer l) goes, or nothing for V4.
void run_backward(const Config& config, const detail::Dims& dims, const TensorRef& next_dlayer_in,
                  const TensorRef& next_dx_partial, const TensorRef& next_dh_post,
                  const TensorRef& next_dh_res, const TensorRef& x, const TensorRef& layer_out,
                  const TensorRef& h_post, const TensorRef& h_res, const Params& next_params,
                  const PostBackwardOutputs& outputs, const Supplied& supplied,
                  const ParamGrads& next_grads) {
  with_activation_types(x.dtype, layer_out.dtype, [&](auto x_tag, auto lo_tag) {
    using X = decltype(x_tag);
    using L = decltype(lo_tag);
    PostBackwardTiles<X, L> source(post_inputs<X, L>(dims, x, layer_out, h_post, h_res), outputs);
    const PostGradients<X> post{static_cast<const X*>(next_dx_partial.data),
                                static_cast<const float*>(next_dh_post.data),
                                static_cast<const float*>(next_dh_res.data)};
    pre_backward_tiles<X>(config, dims, pre_weights(next_params),
                          static_cast<const X*>(next_dlayer_in.data), post, supplied, source,
                          pre_grads(next_grads));
  });
}

}  // namespace

void boundary_forward(const Config& config, const detail::Dims& dims, const TensorRef& x,
                      const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                      const Params& next_params, const MutableTensorRef& x_next,
                      const PreForwardOutputs& next) {
  run_forward(config, dims, x, layer_out, h_post, h_res, next_params, x_next, next, PreApplyMix{});
}

void boundary_backward(const Config& config, const detail::Dims& dims,
                       const TensorRef& next_dlayer_in, const TensorRef& next_dx_partial,
                       const TensorRef& next_dh_post, const TensorRef& next_dh_res,
                       const TensorRef& x, const TensorRef& layer_out, const TensorRef& h_post,
                       const TensorRef& h_res, const Params& next_params,
                       const PostBackwardOutputs& outputs, const ParamGrads& next_grads) {
  run_backward(config, dims, next_dlayer_in, next_dx_partial, next_dh_post, next_dh_res, x,
               layer_out, h_post, h_res, next_params, outputs, Supplied{}, next_grads);
}

// V4.1's boundary (spec: Single-pass schedule): the next sublayer's pre-apply reads sublayer l's
// h_pre instead of its own gates.
void boundary_forward_carried(const Config& config, const detail::Dims& dims, const TensorRef& x,
                              const TensorRef& layer_out, const TensorRef& h_pre,
                              const TensorRef& h_post, const TensorRef& h_res,
                              const Params& next_params, const MutableTensorRef& x_next,
                              const PreForwardOutputs& next) {
  run_forward(config, dims, x, layer_out, h_post, h_res, next_params, x_next, next,
              PreApplyMix{PreApply::carried, static_cast<const float*>(h_pre.data)});
}

void boundary_backward_carried(const Config& config, const detail::Dims& dims,
                               const TensorRef& next_dlayer_in, const TensorRef& next_dx_partial,
                               const TensorRef& next_dh_pre, const TensorRef& next_dh_post,
                               const TensorRef& next_dh_res, const TensorRef& x,
                               const TensorRef& layer_out, const TensorRef& h_pre,
                               const TensorRef& h_post, const TensorRef& h_res,
                               const Params& next_params, const PostBackwardOutputs& outputs,
                               const MutableTensorRef& dh_pre, const ParamGrads& next_grads) {
  const Supplied supplied{nullptr, static_cast<const float*>(next_dh_pre.data),
                          PreApplyMix{PreApply::carried, static_cast<const float*>(h_pre.data)},
                          static_cast<float*>(dh_pre.data)};
  run_backward(config, dims, next_dlayer_in, next_dx_partial, next_dh_post, next_dh_res, x,
               layer_out, h_post, h_res, next_params, outputs, supplied, next_grads);
}

}  // namespace mhc::cpu
