// The public operations of mhc/ops.h: validate every argument, then run the CPU kernels.
#include "kernels.h"
#include "mhc/ops.h"
#include "thread_pool.h"

namespace mhc {

void pre_forward(const Config& config, const TensorRef& x, const Params& params,
                 const PreForwardOutputs& outputs) {
  const detail::Dims d = detail::check_pre_forward("mhc::pre_forward", config, x, params, outputs);
  cpu::pre_forward(config, d, x, params, outputs);
}

void post_forward(const Config& config, const TensorRef& x, const TensorRef& layer_out,
                  const TensorRef& h_post, const TensorRef& h_res, const MutableTensorRef& out) {
  const detail::Dims d =
      detail::check_post_forward("mhc::post_forward", config, x, layer_out, h_post, h_res, out);
  cpu::post_forward(config, d, x, layer_out, h_post, h_res, out);
}

void post_backward(const Config& config, const TensorRef& g, const TensorRef& x,
                   const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                   const PostBackwardOutputs& outputs) {
  const detail::Dims d = detail::check_post_backward("mhc::post_backward", config, g, x, layer_out,
                                                     h_post, h_res, outputs);
  cpu::post_backward(config, d, g, x, layer_out, h_post, h_res, outputs);
}

void pre_backward(const Config& config, const TensorRef& dlayer_in, const TensorRef& dx_partial,
                  const TensorRef& dh_post, const TensorRef& dh_res, const TensorRef& x,
                  const Params& params, const MutableTensorRef& dx, const ParamGrads& grads) {
  const detail::Dims d = detail::check_pre_backward(
      "mhc::pre_backward", config, dlayer_in, dx_partial, dh_post, dh_res, x, params, dx, grads);
  cpu::pre_backward(config, d, dlayer_in, dx_partial, dh_post, dh_res, x, params, dx, grads);
}

void head_forward(const Config& config, const TensorRef& x, const HeadParams& params,
                  const MutableTensorRef& out, const MutableTensorRef& gates) {
  const detail::Dims d =
      detail::check_head_forward("mhc::head_forward", config, x, params, out, gates);
  cpu::head_forward(config, d, x, params, out, gates);
}

void head_backward(const Config& config, const TensorRef& dout, const TensorRef& x,
                   const HeadParams& params, const MutableTensorRef& dx, const HeadGrads& grads) {
  const detail::Dims d =
      detail::check_head_backward("mhc::head_backward", config, dout, x, params, dx, grads);
  cpu::head_backward(config, d, dout, x, params, dx, grads);
}

void pre_forward_partials(const Config& config, const TensorRef& x, const TensorRef& norm_weight,
                          const TensorRef& phi, const MutableTensorRef& partials) {
  const detail::Dims d = detail::check_pre_forward_partials("mhc::pre_forward_partials", config, x,
                                                            norm_weight, phi, partials);
  cpu::pre_forward_partials(d, x, norm_weight, phi, static_cast<float*>(partials.data));
}

void pre_forward_finish(const Config& config, const TensorRef& x, const TensorRef& partials,
                        const TensorRef& alpha, const TensorRef& bias,
                        const PreForwardOutputs& outputs) {
  const detail::Dims d = detail::check_pre_forward_finish("mhc::pre_forward_finish", config, x,
                                                          partials, alpha, bias, outputs);
  cpu::pre_forward_finish(config, d, x, static_cast<const float*>(partials.data),
                          static_cast<const float*>(alpha.data),
                          static_cast<const float*>(bias.data), outputs);
}

void pre_backward_partials(const Config& config, const TensorRef& dlayer_in, const TensorRef& x,
                           const MutableTensorRef& dh_pre) {
  const detail::Dims d = detail::check_pre_backward_partials("mhc::pre_backward_partials", config,
                                                             dlayer_in, x, dh_pre);
  cpu::pre_backward_partials(d, dlayer_in, x, static_cast<float*>(dh_pre.data));
}

void pre_backward_finish(const Config& config, const TensorRef& dlayer_in,
                         const TensorRef& dx_partial, const TensorRef& dh_pre,
                         const TensorRef& dh_post, const TensorRef& dh_res, const TensorRef& x,
                         const TensorRef& partials, const Params& params,
                         const MutableTensorRef& dx, const ParamGrads& grads) {
  const detail::Dims d =
      detail::check_pre_backward_finish("mhc::pre_backward_finish", config, dlayer_in, dx_partial,
                                        dh_pre, dh_post, dh_res, x, partials, params, dx, grads);
  cpu::pre_backward_finish(config, d, dlayer_in, dx_partial, static_cast<const float*>(dh_pre.data),
                           dh_post, dh_res, x, static_cast<const float*>(partials.data), params, dx,
                           grads);
}

void boundary_forward(const Config& config, const TensorRef& x, const TensorRef& layer_out,
                      const TensorRef& h_post, const TensorRef& h_res, const Params& next_params,
                      const MutableTensorRef& x_next, const PreForwardOutputs& next) {
  const detail::Dims d = detail::check_boundary_forward(
      "mhc::boundary_forward", config, x, layer_out, h_post, h_res, next_params, x_next, next);
  cpu::boundary_forward(config, d, x, layer_out, h_post, h_res, next_params, x_next, next);
}

void boundary_backward(const Config& config, const TensorRef& next_dlayer_in,
                       const TensorRef& next_dx_partial, const TensorRef& next_dh_post,
                       const TensorRef& next_dh_res, const TensorRef& x, const TensorRef& layer_out,
                       const TensorRef& h_post, const TensorRef& h_res, const Params& next_params,
                       const PostBackwardOutputs& outputs, const ParamGrads& next_grads) {
  const detail::Dims d = detail::check_boundary_backward(
      "mhc::boundary_backward", config, next_dlayer_in, next_dx_partial, next_dh_post, next_dh_res,
      x, layer_out, h_post, h_res, next_params, outputs, next_grads);
  cpu::boundary_backward(config, d, next_dlayer_in, next_dx_partial, next_dh_post, next_dh_res, x,
                         layer_out, h_post, h_res, next_params, outputs, next_grads);
}

namespace {
// The pre-apply of a validated carried view: the mix, or the one-hot on stream 0 when absent.
cpu::PreApplyMix carried_mix(const TensorRef& carried) {
  const PreApply mode = detail::pre_apply_of(carried);
  return {mode, mode == PreApply::carried ? static_cast<const float*>(carried.data) : nullptr};
}
}  // namespace

void pre_forward_carried(const Config& config, const TensorRef& x, const TensorRef& carried,
                         const Params& params, const PreForwardOutputs& outputs) {
  const detail::Dims d = detail::check_pre_forward_carried("mhc::pre_forward_carried", config, x,
                                                           carried, params, outputs);
  cpu::pre_forward_carried(config, d, x, carried_mix(carried), params, outputs);
}

void pre_backward_carried(const Config& config, const TensorRef& dlayer_in,
                          const TensorRef& dx_partial, const TensorRef& dh_pre,
                          const TensorRef& dh_post, const TensorRef& dh_res, const TensorRef& x,
                          const TensorRef& carried, const Params& params,
                          const MutableTensorRef& dx, const MutableTensorRef& dcarried,
                          const ParamGrads& grads) {
  const detail::Dims d = detail::check_pre_backward_carried(
      "mhc::pre_backward_carried", config, dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x,
      carried, params, dx, dcarried, grads);
  cpu::pre_backward_carried(
      config, d, dlayer_in, dx_partial, static_cast<const float*>(dh_pre.data), dh_post, dh_res, x,
      carried_mix(carried), params, dx, static_cast<float*>(dcarried.data), grads);
}

void collapse_forward(const Config& config, const TensorRef& x, const TensorRef& carried,
                      const MutableTensorRef& out) {
  const detail::Dims d =
      detail::check_collapse_forward("mhc::collapse_forward", config, x, carried, out);
  cpu::collapse_forward(d, x, carried_mix(carried), out);
}

void collapse_backward(const Config& config, const TensorRef& dout, const TensorRef& x,
                       const TensorRef& carried, const MutableTensorRef& dx,
                       const MutableTensorRef& dcarried) {
  const detail::Dims d = detail::check_collapse_backward("mhc::collapse_backward", config, dout, x,
                                                         carried, dx, dcarried);
  cpu::collapse_backward(d, dout, x, carried_mix(carried), dx, static_cast<float*>(dcarried.data));
}

void boundary_forward_carried(const Config& config, const TensorRef& x, const TensorRef& layer_out,
                              const TensorRef& h_pre, const TensorRef& h_post,
                              const TensorRef& h_res, const Params& next_params,
                              const MutableTensorRef& x_next, const PreForwardOutputs& next) {
  const detail::Dims d =
      detail::check_boundary_forward_carried("mhc::boundary_forward_carried", config, x, layer_out,
                                             h_pre, h_post, h_res, next_params, x_next, next);
  cpu::boundary_forward_carried(config, d, x, layer_out, h_pre, h_post, h_res, next_params, x_next,
                                next);
}

void boundary_backward_carried(const Config& config, const TensorRef& next_dlayer_in,
                               const TensorRef& next_dx_partial, const TensorRef& next_dh_pre,
                               const TensorRef& next_dh_post, const TensorRef& next_dh_res,
                               const TensorRef& x, const TensorRef& layer_out,
                               const TensorRef& h_pre, const TensorRef& h_post,
                               const TensorRef& h_res, const Params& next_params,
                               const PostBackwardOutputs& outputs, const MutableTensorRef& dh_pre,
                               const ParamGrads& next_grads) {
  const detail::Dims d = detail::check_boundary_backward_carried(
      "mhc::boundary_backward_carried", config, next_dlayer_in, next_dx_partial, next_dh_pre,
      next_dh_post, next_dh_res, x, layer_out, h_pre, h_post, h_res, next_params, outputs, dh_pre,
      next_grads);
  cpu::boundary_backward_carried(config, d, next_dlayer_in, next_dx_partial, next_dh_pre,
                                 next_dh_post, next_dh_res, x, layer_out, h_pre, h_post, h_res,
                                 next_params, outputs, dh_pre, next_grads);
}

void pre_forward_finish_carried(const Config& config, const TensorRef& x, const TensorRef& partials,
                                const TensorRef& carried, const TensorRef& alpha,
                                const TensorRef& bias, const PreForwardOutputs& outputs) {
  const detail::Dims d = detail::check_pre_forward_finish_carried(
      "mhc::pre_forward_finish_carried", config, x, partials, carried, alpha, bias, outputs);
  cpu::pre_forward_finish_carried(config, d, x, static_cast<const float*>(partials.data),
                                  carried_mix(carried), static_cast<const float*>(alpha.data),
                                  static_cast<const float*>(bias.data), outputs);
}

void pre_backward_finish_carried(const Config& config, const TensorRef& dlayer_in,
                                 const TensorRef& dx_partial, const TensorRef& dh_pre,
                                 const TensorRef& dh_post, const TensorRef& dh_res,
                                 const TensorRef& x, const TensorRef& partials,
                                 const TensorRef& carried, const Params& params,
                                 const MutableTensorRef& dx, const ParamGrads& grads) {
  const detail::Dims d = detail::check_pre_backward_finish_carried(
      "mhc::pre_backward_finish_carried", config, dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x,
      partials, carried, params, dx, grads);
  cpu::pre_backward_finish_carried(
      config, d, dlayer_in, dx_partial, static_cast<const float*>(dh_pre.data), dh_post, dh_res, x,
      static_cast<const float*>(partials.data), carried_mix(carried), params, dx, grads);
}

void set_num_threads(int threads) { cpu::ThreadPool::instance().set_threads(threads); }

int num_threads() { return cpu::ThreadPool::instance().threads(); }

}  // namespace mhc
