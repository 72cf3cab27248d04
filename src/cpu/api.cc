// The public operations of mhc/ops.h: validate every argument, then run the CPU kernels.
#include "kernels.h"
#include "mhc/ops.h"
#include "thread_pool.h"

namespace mhc {

void pre_forward(const Config& config, const TensorRef& x, const Params& params,
                 const PreForwardOutputs& outputs) {
  detail::ArgumentChecker check("mhc::pre_forward", config);
  check.whole_dim("pre_forward_partials and pre_forward_finish");
  check.tokens("x", x);
  const detail::Dims& d = check.dims();
  check.params(params);
  check.output("layer_in", outputs.layer_in, {d.T, d.D}, x.dtype);
  check.output("h_pre", outputs.h_pre, {d.T, d.n}, DType::f32);
  check.output("h_post", outputs.h_post, {d.T, d.n}, DType::f32);
  check.output("h_res", outputs.h_res, {d.T, d.n, d.n}, DType::f32);
  check.finish();
  cpu::pre_forward(config, d, x, params, outputs);
}

void post_forward(const Config& config, const TensorRef& x, const TensorRef& layer_out,
                  const TensorRef& h_post, const TensorRef& h_res, const MutableTensorRef& out) {
  detail::ArgumentChecker check("mhc::post_forward", config);
  check.tokens("x", x);
  const detail::Dims& d = check.dims();
  check.tensor("layer_out", layer_out, {d.T, d.D},
               layer_out.dtype == DType::bf16 ? DType::bf16 : DType::f32);
  check.tensor("h_post", h_post, {d.T, d.n}, DType::f32);
  check.tensor("h_res", h_res, {d.T, d.n, d.n}, DType::f32);
  check.output("out", out, {d.T, d.n, d.D}, x.dtype);
  check.finish();
  cpu::post_forward(config, d, x, layer_out, h_post, h_res, out);
}

void post_backward(const Config& config, const TensorRef& g, const TensorRef& x,
                   const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                   const PostBackwardOutputs& outputs) {
  detail::ArgumentChecker check("mhc::post_backward", config);
  check.tokens("x", x);
  const detail::Dims& d = check.dims();
  const DType lo_dtype = layer_out.dtype == DType::bf16 ? DType::bf16 : DType::f32;
  check.tensor("g", g, {d.T, d.n, d.D}, x.dtype);
  check.tensor("layer_out", layer_out, {d.T, d.D}, lo_dtype);
  check.tensor("h_post", h_post, {d.T, d.n}, DType::f32);
  check.tensor("h_res", h_res, {d.T, d.n, d.n}, DType::f32);
  check.output("dx_partial", outputs.dx_partial, {d.T, d.n, d.D}, x.dtype);
  check.output("dlayer_out", outputs.dlayer_out, {d.T, d.D}, lo_dtype);
  check.output("dh_post", outputs.dh_post, {d.T, d.n}, DType::f32);
  check.output("dh_res", outputs.dh_res, {d.T, d.n, d.n}, DType::f32);
  check.finish();
  cpu::post_backward(config, d, g, x, layer_out, h_post, h_res, outputs);
}

void pre_backward(const Config& config, const TensorRef& dlayer_in, const TensorRef& dx_partial,
                  const TensorRef& dh_post, const TensorRef& dh_res, const TensorRef& x,
                  const Params& params, const MutableTensorRef& dx, const ParamGrads& grads) {
  detail::ArgumentChecker check("mhc::pre_backward", config);
  check.whole_dim("pre_backward_partials and pre_backward_finish");
  check.tokens("x", x);
  const detail::Dims& d = check.dims();
  check.tensor("dlayer_in", dlayer_in, {d.T, d.D}, x.dtype);
  check.tensor("dx_partial", dx_partial, {d.T, d.n, d.D}, x.dtype);
  check.tensor("dh_post", dh_post, {d.T, d.n}, DType::f32);
  check.tensor("dh_res", dh_res, {d.T, d.n, d.n}, DType::f32);
  check.params(params);
  check.output("dx", dx, {d.T, d.n, d.D}, x.dtype);
  check.grads(grads);
  check.finish();
  cpu::pre_backward(config, d, dlayer_in, dx_partial, dh_post, dh_res, x, params, dx, grads);
}

void pre_forward_partials(const Config& config, const TensorRef& x, const TensorRef& norm_weight,
                          const TensorRef& phi, const MutableTensorRef& partials) {
  detail::ArgumentChecker check("mhc::pre_forward_partials", config);
  check.tokens("x", x);
  const detail::Dims& d = check.dims();
  check.tensor("norm_weight", norm_weight, {d.M}, DType::f32);
  check.tensor("phi", phi, {d.M, d.N}, DType::f32);
  check.output("partials", partials, {d.T, d.N + 1}, DType::f32);
  check.finish();
  cpu::pre_forward_partials(d, x, norm_weight, phi, static_cast<float*>(partials.data));
}

void pre_forward_finish(const Config& config, const TensorRef& x, const TensorRef& partials,
                        const TensorRef& alpha, const TensorRef& bias,
                        const PreForwardOutputs& outputs) {
  detail::ArgumentChecker check("mhc::pre_forward_finish", config);
  check.tokens("x", x);
  const detail::Dims& d = check.dims();
  check.tensor("partials", partials, {d.T, d.N + 1}, DType::f32);
  check.tensor("alpha", alpha, {3}, DType::f32);
  check.tensor("bias", bias, {d.N}, DType::f32);
  check.output("layer_in", outputs.layer_in, {d.T, d.D}, x.dtype);
  check.output("h_pre", outputs.h_pre, {d.T, d.n}, DType::f32);
  check.output("h_post", outputs.h_post, {d.T, d.n}, DType::f32);
  check.output("h_res", outputs.h_res, {d.T, d.n, d.n}, DType::f32);
  check.finish();
  cpu::pre_forward_finish(config, d, x, static_cast<const float*>(partials.data),
                          static_cast<const float*>(alpha.data),
                          static_cast<const float*>(bias.data), outputs);
}

void pre_backward_partials(const Config& config, const TensorRef& dlayer_in, const TensorRef& x,
                           const MutableTensorRef& dh_pre) {
  detail::ArgumentChecker check("mhc::pre_backward_partials", config);
  check.tokens("x", x);
  const detail::Dims& d = check.dims();
  check.tensor("dlayer_in", dlayer_in, {d.T, d.D}, x.dtype);
  check.output("dh_pre", dh_pre, {d.T, d.n}, DType::f32);
  check.finish();
  cpu::pre_backward_partials(d, dlayer_in, x, static_cast<float*>(dh_pre.data));
}

void pre_backward_finish(const Config& config, const TensorRef& dlayer_in,
                         const TensorRef& dx_partial, const TensorRef& dh_pre,
                         const TensorRef& dh_post, const TensorRef& dh_res, const TensorRef& x,
                         const TensorRef& partials, const Params& params,
                         const MutableTensorRef& dx, const ParamGrads& grads) {
  detail::ArgumentChecker check("mhc::pre_backward_finish", config);
  check.tokens("x", x);
  const detail::Dims& d = check.dims();
  check.tensor("dlayer_in", dlayer_in, {d.T, d.D}, x.dtype);
  check.tensor("dx_partial", dx_partial, {d.T, d.n, d.D}, x.dtype);
  check.tensor("dh_pre", dh_pre, {d.T, d.n}, DType::f32);
  check.tensor("dh_post", dh_post, {d.T, d.n}, DType::f32);
  check.tensor("dh_res", dh_res, {d.T, d.n, d.n}, DType::f32);
  check.tensor("partials", partials, {d.T, d.N + 1}, DType::f32);
  check.params(params);
  check.output("dx", dx, {d.T, d.n, d.D}, x.dtype);
  check.grads(grads);
  check.finish();
  cpu::pre_backward_finish(config, d, dlayer_in, dx_partial, static_cast<const float*>(dh_pre.data),
                           dh_post, dh_res, x, static_cast<const float*>(partials.data), params, dx,
                           grads);
}

void set_num_threads(int threads) { cpu::ThreadPool::instance().set_threads(threads); }

int num_threads() { return cpu::ThreadPool::instance().threads(); }

}  // namespace mhc
