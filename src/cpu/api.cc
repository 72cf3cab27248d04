// The public operations of mhc/ops.h: validate every argument, then run the CPU kernels.
#include "kernels.h"
#include "mhc/ops.h"
#include "thread_pool.h"

namespace mhc {

void pre_forward(const Config& config, const TensorRef& x, const Params& params,
                 const PreForwardOutputs& outputs) {
  detail::ArgumentChecker check("mhc::pre_forward", config);
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
  check.tensor("layer_out", layer_out, {d.T, d.D}, layer_out.dtype == DType::bf16 ? DType::bf16 : DType::f32);
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

void set_num_threads(int threads) { cpu::ThreadPool::instance().set_threads(threads); }

int num_threads() { return cpu::ThreadPool::instance().threads(); }

}  // namespace mhc
