// XLA FFI handlers for the CPU platform, and the nanobind module that hands their capsules to
// Python (mhc/_ffi.py registers them with jax.ffi). Each handler only converts XLA buffers and
// attributes into mhc views and a Config, calls the public C++ operation, and turns mhc::Error
// into an FFI InvalidArgument error; the operations validate everything themselves.
#include <nanobind/nanobind.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <atomic>
#include <functional>
#include <utility>

#include "../cpu/thread_pool.h"
#include "handler_common.h"
#include "mhc/ops.h"
#include "mhc/roofline.h"

namespace ffi = xla::ffi;
using mhc_ffi::grads_out;
using mhc_ffi::guarded;
using mhc_ffi::handler_binding;
using mhc_ffi::in;
using mhc_ffi::make_config;
using mhc_ffi::out;
using mhc_ffi::params_in;
using mhc_ffi::post_backward_out;
using mhc_ffi::pre_forward_out;

namespace {

// XLA's intra-op thread pool as the executor of mhc's parallel_for (src/cpu/thread_pool.h).
class XlaPool final : public mhc::cpu::Executor {
 public:
  explicit XlaPool(ffi::ThreadPool& pool) : pool_(pool), threads_(pool.num_threads()) {}
  int threads() const override { return static_cast<int>(threads_); }
  void schedule(std::function<void()> task) const override { pool_.Schedule(std::move(task)); }

 private:
  ffi::ThreadPool& pool_;
  int64_t threads_;
};

// Whether the kernels' helper threads come from XLA's intra-op pool (the default) or from mhc's
// own pool. Inside jitted steps (2026-12-02, 2 cores shared with other work) XLA's pool was as
// fast or faster and used less CPU (decode-sized chains 1.2-1.8x), and it adds no threads that
// compete with XLA's; results are the same bits either way. use_xla_thread_pool(False) stays for
// measuring the difference (docs/performance.md).
std::atomic<bool> run_on_xla_pool{true};

// guarded (handler_common.h), with the kernels' helper threads taken from XLA's pool when
// run_on_xla_pool is set, else from mhc's own; at most mhc::num_threads() threads either way.
template <class Body>
ffi::Error guarded_on(ffi::ThreadPool& pool, Body body) {
  if (!run_on_xla_pool.load(std::memory_order_relaxed)) return guarded(std::move(body));
  const XlaPool executor(pool);
  const mhc::cpu::ScopedExecutor scope(&executor);
  return guarded(std::move(body));
}

ffi::Error PreForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer norm_weight,
                          ffi::AnyBuffer phi, ffi::AnyBuffer alpha, ffi::AnyBuffer bias,
                          ffi::Result<ffi::AnyBuffer> layer_in, ffi::Result<ffi::AnyBuffer> h_pre,
                          ffi::Result<ffi::AnyBuffer> h_post, ffi::Result<ffi::AnyBuffer> h_res,
                          MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::pre_forward(make_config(xv, MHC_CONFIG_ARGS), xv, params_in(norm_weight, phi, alpha, bias),
                     pre_forward_out(layer_in, h_pre, h_post, h_res));
  });
}

ffi::Error PostForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer layer_out,
                           ffi::AnyBuffer h_post, ffi::AnyBuffer h_res,
                           ffi::Result<ffi::AnyBuffer> result, MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::post_forward(make_config(xv, MHC_CONFIG_ARGS), xv, in(layer_out, "layer_out"),
                      in(h_post, "h_post"), in(h_res, "h_res"), out(result, "out"));
  });
}

ffi::Error PostBackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer g, ffi::AnyBuffer x,
                            ffi::AnyBuffer layer_out, ffi::AnyBuffer h_post, ffi::AnyBuffer h_res,
                            ffi::Result<ffi::AnyBuffer> dx_partial,
                            ffi::Result<ffi::AnyBuffer> dlayer_out,
                            ffi::Result<ffi::AnyBuffer> dh_post, ffi::Result<ffi::AnyBuffer> dh_res,
                            MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::post_backward(make_config(xv, MHC_CONFIG_ARGS), in(g, "g"), xv, in(layer_out, "layer_out"),
                       in(h_post, "h_post"), in(h_res, "h_res"),
                       post_backward_out(dx_partial, dlayer_out, dh_post, dh_res));
  });
}

ffi::Error PreBackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer dlayer_in,
                           ffi::AnyBuffer dx_partial, ffi::AnyBuffer dh_post, ffi::AnyBuffer dh_res,
                           ffi::AnyBuffer x, ffi::AnyBuffer norm_weight, ffi::AnyBuffer phi,
                           ffi::AnyBuffer alpha, ffi::AnyBuffer bias,
                           ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dnorm_weight,
                           ffi::Result<ffi::AnyBuffer> dphi, ffi::Result<ffi::AnyBuffer> dalpha,
                           ffi::Result<ffi::AnyBuffer> dbias, MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::pre_backward(make_config(xv, MHC_CONFIG_ARGS), in(dlayer_in, "dlayer_in"),
                      in(dx_partial, "dx_partial"), in(dh_post, "dh_post"), in(dh_res, "dh_res"),
                      xv, params_in(norm_weight, phi, alpha, bias), out(dx, "dx"),
                      grads_out(dnorm_weight, dphi, dalpha, dbias));
  });
}

ffi::Error PreForwardPartialsImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                  ffi::AnyBuffer norm_weight, ffi::AnyBuffer phi,
                                  ffi::Result<ffi::AnyBuffer> partials, MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::pre_forward_partials(make_config(xv, MHC_CONFIG_ARGS), xv, in(norm_weight, "norm_weight"),
                              in(phi, "phi"), out(partials, "partials"));
  });
}

ffi::Error PreForwardFinishImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer partials,
                                ffi::AnyBuffer alpha, ffi::AnyBuffer bias,
                                ffi::Result<ffi::AnyBuffer> layer_in,
                                ffi::Result<ffi::AnyBuffer> h_pre,
                                ffi::Result<ffi::AnyBuffer> h_post,
                                ffi::Result<ffi::AnyBuffer> h_res, MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::pre_forward_finish(make_config(xv, MHC_CONFIG_ARGS), xv, in(partials, "partials"),
                            in(alpha, "alpha"), in(bias, "bias"),
                            pre_forward_out(layer_in, h_pre, h_post, h_res));
  });
}

ffi::Error PreBackwardPartialsImpl(ffi::ThreadPool pool, ffi::AnyBuffer dlayer_in, ffi::AnyBuffer x,
                                   ffi::Result<ffi::AnyBuffer> dh_pre, MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::pre_backward_partials(make_config(xv, MHC_CONFIG_ARGS), in(dlayer_in, "dlayer_in"), xv,
                               out(dh_pre, "dh_pre"));
  });
}

ffi::Error PreBackwardFinishImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer dlayer_in, ffi::AnyBuffer dx_partial,
    ffi::AnyBuffer dh_pre, ffi::AnyBuffer dh_post, ffi::AnyBuffer dh_res, ffi::AnyBuffer x,
    ffi::AnyBuffer partials, ffi::AnyBuffer norm_weight, ffi::AnyBuffer phi, ffi::AnyBuffer alpha,
    ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dnorm_weight,
    ffi::Result<ffi::AnyBuffer> dphi, ffi::Result<ffi::AnyBuffer> dalpha,
    ffi::Result<ffi::AnyBuffer> dbias, MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::pre_backward_finish(make_config(xv, MHC_CONFIG_ARGS), in(dlayer_in, "dlayer_in"),
                             in(dx_partial, "dx_partial"), in(dh_pre, "dh_pre"),
                             in(dh_post, "dh_post"), in(dh_res, "dh_res"), xv,
                             in(partials, "partials"), params_in(norm_weight, phi, alpha, bias),
                             out(dx, "dx"), grads_out(dnorm_weight, dphi, dalpha, dbias));
  });
}

ffi::Error BoundaryForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer layer_out,
                               ffi::AnyBuffer h_post, ffi::AnyBuffer h_res,
                               ffi::AnyBuffer norm_weight, ffi::AnyBuffer phi, ffi::AnyBuffer alpha,
                               ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> x_next,
                               ffi::Result<ffi::AnyBuffer> layer_in,
                               ffi::Result<ffi::AnyBuffer> h_pre,
                               ffi::Result<ffi::AnyBuffer> next_h_post,
                               ffi::Result<ffi::AnyBuffer> next_h_res, MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::boundary_forward(make_config(xv, MHC_CONFIG_ARGS), xv, in(layer_out, "layer_out"),
                          in(h_post, "h_post"), in(h_res, "h_res"),
                          params_in(norm_weight, phi, alpha, bias), out(x_next, "x_next"),
                          {out(layer_in, "layer_in"), out(h_pre, "h_pre"),
                           out(next_h_post, "next_h_post"), out(next_h_res, "next_h_res")});
  });
}

ffi::Error BoundaryBackwardImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer next_dlayer_in, ffi::AnyBuffer next_dx_partial,
    ffi::AnyBuffer next_dh_post, ffi::AnyBuffer next_dh_res, ffi::AnyBuffer x,
    ffi::AnyBuffer layer_out, ffi::AnyBuffer h_post, ffi::AnyBuffer h_res,
    ffi::AnyBuffer norm_weight, ffi::AnyBuffer phi, ffi::AnyBuffer alpha, ffi::AnyBuffer bias,
    ffi::Result<ffi::AnyBuffer> dx_partial, ffi::Result<ffi::AnyBuffer> dlayer_out,
    ffi::Result<ffi::AnyBuffer> dh_post, ffi::Result<ffi::AnyBuffer> dh_res,
    ffi::Result<ffi::AnyBuffer> dnorm_weight, ffi::Result<ffi::AnyBuffer> dphi,
    ffi::Result<ffi::AnyBuffer> dalpha, ffi::Result<ffi::AnyBuffer> dbias, MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::boundary_backward(make_config(xv, MHC_CONFIG_ARGS), in(next_dlayer_in, "next_dlayer_in"),
                           in(next_dx_partial, "next_dx_partial"), in(next_dh_post, "next_dh_post"),
                           in(next_dh_res, "next_dh_res"), xv, in(layer_out, "layer_out"),
                           in(h_post, "h_post"), in(h_res, "h_res"),
                           params_in(norm_weight, phi, alpha, bias),
                           post_backward_out(dx_partial, dlayer_out, dh_post, dh_res),
                           grads_out(dnorm_weight, dphi, dalpha, dbias));
  });
}

ffi::Error HeadForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer fn,
                           ffi::AnyBuffer base, ffi::AnyBuffer scale,
                           ffi::Result<ffi::AnyBuffer> result, ffi::Result<ffi::AnyBuffer> gates,
                           MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::head_forward(make_config(xv, MHC_CONFIG_ARGS), xv,
                      {in(fn, "fn"), in(base, "base"), in(scale, "scale")}, out(result, "out"),
                      out(gates, "gates"));
  });
}

ffi::Error HeadBackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer dout, ffi::AnyBuffer x,
                            ffi::AnyBuffer fn, ffi::AnyBuffer base, ffi::AnyBuffer scale,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dfn,
                            ffi::Result<ffi::AnyBuffer> dbase, ffi::Result<ffi::AnyBuffer> dscale,
                            MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::head_backward(make_config(xv, MHC_CONFIG_ARGS), in(dout, "dout"), xv,
                       {in(fn, "fn"), in(base, "base"), in(scale, "scale")}, out(dx, "dx"),
                       {out(dfn, "dfn"), out(dbase, "dbase"), out(dscale, "dscale")});
  });
}

// DeepSeek-V4.1's carried mix (mhc/ops.h): carried is f32 [T, n], or [T, 0] for the one-hot on
// stream 0 (then dcarried is [T, 0] as well).
ffi::Error PreForwardCarriedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer carried,
                                 ffi::AnyBuffer norm_weight, ffi::AnyBuffer phi,
                                 ffi::AnyBuffer alpha, ffi::AnyBuffer bias,
                                 ffi::Result<ffi::AnyBuffer> layer_in,
                                 ffi::Result<ffi::AnyBuffer> h_pre,
                                 ffi::Result<ffi::AnyBuffer> h_post,
                                 ffi::Result<ffi::AnyBuffer> h_res, MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::pre_forward_carried(make_config(xv, MHC_CONFIG_ARGS), xv, in(carried, "carried"),
                             params_in(norm_weight, phi, alpha, bias),
                             pre_forward_out(layer_in, h_pre, h_post, h_res));
  });
}

ffi::Error PreBackwardCarriedImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer dlayer_in, ffi::AnyBuffer dx_partial,
    ffi::AnyBuffer dh_pre, ffi::AnyBuffer dh_post, ffi::AnyBuffer dh_res, ffi::AnyBuffer x,
    ffi::AnyBuffer carried, ffi::AnyBuffer norm_weight, ffi::AnyBuffer phi, ffi::AnyBuffer alpha,
    ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dcarried,
    ffi::Result<ffi::AnyBuffer> dnorm_weight, ffi::Result<ffi::AnyBuffer> dphi,
    ffi::Result<ffi::AnyBuffer> dalpha, ffi::Result<ffi::AnyBuffer> dbias, MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::pre_backward_carried(
        make_config(xv, MHC_CONFIG_ARGS), in(dlayer_in, "dlayer_in"), in(dx_partial, "dx_partial"),
        in(dh_pre, "dh_pre"), in(dh_post, "dh_post"), in(dh_res, "dh_res"), xv,
        in(carried, "carried"), params_in(norm_weight, phi, alpha, bias), out(dx, "dx"),
        out(dcarried, "dcarried"), grads_out(dnorm_weight, dphi, dalpha, dbias));
  });
}

ffi::Error CollapseForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer carried,
                               ffi::Result<ffi::AnyBuffer> result, MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::collapse_forward(make_config(xv, MHC_CONFIG_ARGS), xv, in(carried, "carried"),
                          out(result, "out"));
  });
}

ffi::Error CollapseBackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer dout, ffi::AnyBuffer x,
                                ffi::AnyBuffer carried, ffi::Result<ffi::AnyBuffer> dx,
                                ffi::Result<ffi::AnyBuffer> dcarried, MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::collapse_backward(make_config(xv, MHC_CONFIG_ARGS), in(dout, "dout"), xv,
                           in(carried, "carried"), out(dx, "dx"), out(dcarried, "dcarried"));
  });
}

ffi::Error BoundaryForwardCarriedImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer layer_out, ffi::AnyBuffer h_pre,
    ffi::AnyBuffer h_post, ffi::AnyBuffer h_res, ffi::AnyBuffer norm_weight, ffi::AnyBuffer phi,
    ffi::AnyBuffer alpha, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> x_next,
    ffi::Result<ffi::AnyBuffer> layer_in, ffi::Result<ffi::AnyBuffer> next_h_pre,
    ffi::Result<ffi::AnyBuffer> next_h_post, ffi::Result<ffi::AnyBuffer> next_h_res,
    MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::boundary_forward_carried(make_config(xv, MHC_CONFIG_ARGS), xv, in(layer_out, "layer_out"),
                                  in(h_pre, "h_pre"), in(h_post, "h_post"), in(h_res, "h_res"),
                                  params_in(norm_weight, phi, alpha, bias), out(x_next, "x_next"),
                                  {out(layer_in, "layer_in"), out(next_h_pre, "next_h_pre"),
                                   out(next_h_post, "next_h_post"), out(next_h_res, "next_h_res")});
  });
}

ffi::Error BoundaryBackwardCarriedImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer next_dlayer_in, ffi::AnyBuffer next_dx_partial,
    ffi::AnyBuffer next_dh_pre, ffi::AnyBuffer next_dh_post, ffi::AnyBuffer next_dh_res,
    ffi::AnyBuffer x, ffi::AnyBuffer layer_out, ffi::AnyBuffer h_pre, ffi::AnyBuffer h_post,
    ffi::AnyBuffer h_res, ffi::AnyBuffer norm_weight, ffi::AnyBuffer phi, ffi::AnyBuffer alpha,
    ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> dx_partial,
    ffi::Result<ffi::AnyBuffer> dlayer_out, ffi::Result<ffi::AnyBuffer> dh_post,
    ffi::Result<ffi::AnyBuffer> dh_res, ffi::Result<ffi::AnyBuffer> dh_pre,
    ffi::Result<ffi::AnyBuffer> dnorm_weight, ffi::Result<ffi::AnyBuffer> dphi,
    ffi::Result<ffi::AnyBuffer> dalpha, ffi::Result<ffi::AnyBuffer> dbias, MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::boundary_backward_carried(
        make_config(xv, MHC_CONFIG_ARGS), in(next_dlayer_in, "next_dlayer_in"),
        in(next_dx_partial, "next_dx_partial"), in(next_dh_pre, "next_dh_pre"),
        in(next_dh_post, "next_dh_post"), in(next_dh_res, "next_dh_res"), xv,
        in(layer_out, "layer_out"), in(h_pre, "h_pre"), in(h_post, "h_post"), in(h_res, "h_res"),
        params_in(norm_weight, phi, alpha, bias),
        post_backward_out(dx_partial, dlayer_out, dh_post, dh_res), out(dh_pre, "dh_pre"),
        grads_out(dnorm_weight, dphi, dalpha, dbias));
  });
}

ffi::Error PreForwardFinishCarriedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                       ffi::AnyBuffer partials, ffi::AnyBuffer carried,
                                       ffi::AnyBuffer alpha, ffi::AnyBuffer bias,
                                       ffi::Result<ffi::AnyBuffer> layer_in,
                                       ffi::Result<ffi::AnyBuffer> h_pre,
                                       ffi::Result<ffi::AnyBuffer> h_post,
                                       ffi::Result<ffi::AnyBuffer> h_res, MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::pre_forward_finish_carried(make_config(xv, MHC_CONFIG_ARGS), xv, in(partials, "partials"),
                                    in(carried, "carried"), in(alpha, "alpha"), in(bias, "bias"),
                                    pre_forward_out(layer_in, h_pre, h_post, h_res));
  });
}

ffi::Error PreBackwardFinishCarriedImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer dlayer_in, ffi::AnyBuffer dx_partial,
    ffi::AnyBuffer dh_pre, ffi::AnyBuffer dh_post, ffi::AnyBuffer dh_res, ffi::AnyBuffer x,
    ffi::AnyBuffer partials, ffi::AnyBuffer carried, ffi::AnyBuffer norm_weight, ffi::AnyBuffer phi,
    ffi::AnyBuffer alpha, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> dx,
    ffi::Result<ffi::AnyBuffer> dnorm_weight, ffi::Result<ffi::AnyBuffer> dphi,
    ffi::Result<ffi::AnyBuffer> dalpha, ffi::Result<ffi::AnyBuffer> dbias, MHC_CONFIG_PARAMS) {
  return guarded_on(pool, [&] {
    const mhc::TensorRef xv = in(x, "x");
    mhc::pre_backward_finish_carried(
        make_config(xv, MHC_CONFIG_ARGS), in(dlayer_in, "dlayer_in"), in(dx_partial, "dx_partial"),
        in(dh_pre, "dh_pre"), in(dh_post, "dh_post"), in(dh_res, "dh_res"), xv,
        in(partials, "partials"), in(carried, "carried"), params_in(norm_weight, phi, alpha, bias),
        out(dx, "dx"), grads_out(dnorm_weight, dphi, dalpha, dbias));
  });
}

}  // namespace

// x, norm_weight, phi, alpha, bias -> layer_in, h_pre, h_post, h_res
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcPreForward, PreForwardImpl,
                              (handler_binding<5, 4>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

// x, layer_out, h_post, h_res -> out
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcPostForward, PostForwardImpl,
                              (handler_binding<4, 1>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

// g, x, layer_out, h_post, h_res -> dx_partial, dlayer_out, dh_post, dh_res
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcPostBackward, PostBackwardImpl,
                              (handler_binding<5, 4>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

// dlayer_in, dx_partial, dh_post, dh_res, x, norm_weight, phi, alpha, bias
//   -> dx, dnorm_weight, dphi, dalpha, dbias
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcPreBackward, PreBackwardImpl,
                              (handler_binding<9, 5>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

// The fused boundary (mhc/ops.h), the next sublayer's parameters last:
// x, layer_out, h_post, h_res, norm_weight, phi, alpha, bias
//   -> x_next, layer_in, h_pre, next h_post, next h_res
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcBoundaryForward, BoundaryForwardImpl,
                              (handler_binding<8, 5>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));
// next dlayer_in, next dx_partial, next dh_post, next dh_res, x, layer_out, h_post, h_res,
// norm_weight, phi, alpha, bias
//   -> dx_partial, dlayer_out, dh_post, dh_res, dnorm_weight, dphi, dalpha, dbias
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcBoundaryBackward, BoundaryBackwardImpl,
                              (handler_binding<12, 8>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

// DeepSeek-V4's head: x, fn, base, scale -> out, gates
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcHeadForward, HeadForwardImpl,
                              (handler_binding<4, 2>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));
// dout, x, fn, base, scale -> dx, dfn, dbase, dscale
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcHeadBackward, HeadBackwardImpl,
                              (handler_binding<5, 4>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

// Tensor-parallel split (D sliced across devices; mhc/ops.h):
// x, norm_weight, phi -> partials
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcPreForwardPartials, PreForwardPartialsImpl,
                              (handler_binding<3, 1>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));
// x, partials, alpha, bias -> layer_in, h_pre, h_post, h_res
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcPreForwardFinish, PreForwardFinishImpl,
                              (handler_binding<4, 4>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));
// dlayer_in, x -> dh_pre
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcPreBackwardPartials, PreBackwardPartialsImpl,
                              (handler_binding<2, 1>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));
// dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, partials, norm_weight, phi, alpha, bias
//   -> dx, dnorm_weight, dphi, dalpha, dbias
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcPreBackwardFinish, PreBackwardFinishImpl,
                              (handler_binding<11, 5>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

// DeepSeek-V4.1's carried mix (CPU only), carried f32 [T, n] or [T, 0] for the one-hot:
// x, carried, norm_weight, phi, alpha, bias -> layer_in, h_pre, h_post, h_res
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcPreForwardCarried, PreForwardCarriedImpl,
                              (handler_binding<6, 4>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));
// dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, carried, norm_weight, phi, alpha, bias
//   -> dx, dcarried, dnorm_weight, dphi, dalpha, dbias
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcPreBackwardCarried, PreBackwardCarriedImpl,
                              (handler_binding<11, 6>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));
// x, carried -> out
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcCollapseForward, CollapseForwardImpl,
                              (handler_binding<2, 1>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));
// dout, x, carried -> dx, dcarried
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcCollapseBackward, CollapseBackwardImpl,
                              (handler_binding<3, 2>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));
// x, layer_out, h_pre, h_post, h_res, norm_weight, phi, alpha, bias
//   -> x_next, layer_in, next h_pre, next h_post, next h_res
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcBoundaryForwardCarried, BoundaryForwardCarriedImpl,
                              (handler_binding<9, 5>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));
// next dlayer_in, next dx_partial, next dh_pre, next dh_post, next dh_res, x, layer_out, h_pre,
// h_post, h_res, norm_weight, phi, alpha, bias
//   -> dx_partial, dlayer_out, dh_post, dh_res, dh_pre, dnorm_weight, dphi, dalpha, dbias
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcBoundaryBackwardCarried, BoundaryBackwardCarriedImpl,
                              (handler_binding<14, 9>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));
// x, partials, carried, alpha, bias -> layer_in, h_pre, h_post, h_res
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcPreForwardFinishCarried, PreForwardFinishCarriedImpl,
                              (handler_binding<5, 4>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));
// dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, partials, carried, norm_weight, phi, alpha,
// bias -> dx, dnorm_weight, dphi, dalpha, dbias
XLA_FFI_DEFINE_HANDLER_SYMBOL(MhcPreBackwardFinishCarried, PreBackwardFinishCarriedImpl,
                              (handler_binding<12, 5>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

// The one registration table: target name -> handler. Python registers every entry.
NB_MODULE(_mhc_cpu, module) {
  module.doc() = "XLA FFI handlers of mhc for the CPU platform";
  // glibc serves every block over its mmap threshold (at most 32 MiB, whatever mallopt asks) with
  // a fresh mmap, so each large XLA output is zero-filled page by page on first touch: the post
  // operations inside JAX ran at a third to half the speed of the kernels alone. With mmap off and
  // a high trim threshold, freed large blocks stay in the heap and are reused. Process-wide (the
  // heap keeps its high-water mark instead of returning freed large blocks to the system), so
  // nothing calls it by default: mhc.tune_allocator() is the explicit opt-in (mhc/__init__.py).
  // Returns whether it applied (glibc only).
  module.def("keep_large_blocks_in_heap", []() {
#if defined(__GLIBC__)
    constexpr int kTrimThreshold = 1 << 30;
    return mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1;
#else
    return false;
#endif
  });
  module.def("registrations", []() {
    const std::pair<const char*, XLA_FFI_Handler*> handlers[] = {
        {"mhc_pre_forward", MhcPreForward},
        {"mhc_post_forward", MhcPostForward},
        {"mhc_post_backward", MhcPostBackward},
        {"mhc_pre_backward", MhcPreBackward},
        {"mhc_boundary_forward", MhcBoundaryForward},
        {"mhc_boundary_backward", MhcBoundaryBackward},
        {"mhc_head_forward", MhcHeadForward},
        {"mhc_head_backward", MhcHeadBackward},
        {"mhc_pre_forward_partials", MhcPreForwardPartials},
        {"mhc_pre_forward_finish", MhcPreForwardFinish},
        {"mhc_pre_backward_partials", MhcPreBackwardPartials},
        {"mhc_pre_backward_finish", MhcPreBackwardFinish},
        {"mhc_pre_forward_carried", MhcPreForwardCarried},
        {"mhc_pre_backward_carried", MhcPreBackwardCarried},
        {"mhc_collapse_forward", MhcCollapseForward},
        {"mhc_collapse_backward", MhcCollapseBackward},
        {"mhc_boundary_forward_carried", MhcBoundaryForwardCarried},
        {"mhc_boundary_backward_carried", MhcBoundaryBackwardCarried},
        {"mhc_pre_forward_finish_carried", MhcPreForwardFinishCarried},
        {"mhc_pre_backward_finish_carried", MhcPreBackwardFinishCarried},
    };
    nanobind::dict table;
    for (const auto& [name, handler] : handlers) {
      table[name] = nanobind::capsule(reinterpret_cast<void*>(handler));
    }
    return table;
  });
  // The library's thread count and the roofline ceilings, for mhc.bench and users' own timing.
  module.def("set_num_threads", &mhc::set_num_threads, nanobind::arg("threads"));
  module.def("num_threads", &mhc::num_threads);
  module.def(
      "use_xla_thread_pool", [](bool on) { run_on_xla_pool.store(on); }, nanobind::arg("on"));
  module.def("uses_xla_thread_pool", [] { return run_on_xla_pool.load(); });
  module.def("copy_bandwidth_gbs", &mhc::copy_bandwidth_gbs,
             nanobind::arg("bytes") = int64_t{256} << 20, nanobind::arg("threads") = 0,
             nanobind::arg("repeats") = 5);
  module.def("fma_peak_gflops", &mhc::fma_peak_gflops, nanobind::arg("threads") = 0);
  module.def("widest_simd", &mhc::widest_simd);
}
