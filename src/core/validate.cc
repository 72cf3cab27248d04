// Argument checks shared by every backend's entry points.
#include "validate.h"

#include <cstddef>

#include "mhc/error.h"

namespace mhc::detail {

namespace {
std::string shape_text(const std::vector<int64_t>& dims) {
  std::string text = "[";
  for (size_t axis = 0; axis < dims.size(); ++axis) {
    if (axis > 0) text += ", ";
    text += std::to_string(dims[axis]);
  }
  return text + "]";
}
}  // namespace

ArgumentChecker::ArgumentChecker(const char* op, const Config& config)
    : op_(op), tensor_parallel_(config.tensor_parallel) {
  validate(config, op);
  dims_.n = config.n;
  dims_.D = local_dim(config);
  dims_.M = config.n * dims_.D;
  dims_.M_full = flat_width(config);
  dims_.N = projection_width(config);
}

void ArgumentChecker::tokens(const char* name, const TensorRef& view) {
  if (view.rank != 3 || view.shape[1] != dims_.n || view.shape[2] != dims_.D || view.shape[0] < 0) {
    throw Error(op_, name,
                "expected shape [T, " + std::to_string(dims_.n) + ", " + std::to_string(dims_.D) +
                    "] with T >= 0 (n and D / tensor_parallel from the config), got " +
                    view.shape_string());
  }
  if (view.dtype != DType::f32 && view.dtype != DType::bf16) {
    throw Error(op_, name, "expected dtype f32 or bf16, got an unknown dtype value");
  }
  dims_.T = view.shape[0];
  check_view(name, view, {dims_.T, dims_.n, dims_.D}, view.dtype, false);
}

void ArgumentChecker::tensor(const std::string& name, const TensorRef& view,
                             std::initializer_list<int64_t> expected, DType dtype) {
  check_view(name, view, std::vector<int64_t>(expected), dtype, false);
}

void ArgumentChecker::output(const std::string& name, const MutableTensorRef& view,
                             std::initializer_list<int64_t> expected, DType dtype) {
  check_view(name, view, std::vector<int64_t>(expected), dtype, true);
}

void ArgumentChecker::whole_dim(const char* split_ops) {
  if (tensor_parallel_ != 1) {
    throw Error(
        op_, "config.tensor_parallel",
        "expected 1: this fused operation needs all of D; with D split across devices use " +
            std::string(split_ops) + ", got " + std::to_string(tensor_parallel_));
  }
}

void ArgumentChecker::pre_forward_outputs(const PreForwardOutputs& outputs, DType x_dtype,
                                          const std::string& prefix) {
  output(prefix + "layer_in", outputs.layer_in, {dims_.T, dims_.D}, x_dtype);
  output(prefix + "h_pre", outputs.h_pre, {dims_.T, dims_.n}, DType::f32);
  output(prefix + "h_post", outputs.h_post, {dims_.T, dims_.n}, DType::f32);
  output(prefix + "h_res", outputs.h_res, {dims_.T, dims_.n, dims_.n}, DType::f32);
}

void ArgumentChecker::params(const Params& params, const std::string& name) {
  tensor(name + ".norm_weight", params.norm_weight, {dims_.M}, DType::f32);
  tensor(name + ".phi", params.phi, {dims_.M, dims_.N}, DType::f32);
  tensor(name + ".alpha", params.alpha, {3}, DType::f32);
  tensor(name + ".bias", params.bias, {dims_.N}, DType::f32);
}

void ArgumentChecker::grads(const ParamGrads& grads, const std::string& name) {
  output(name + ".norm_weight", grads.norm_weight, {dims_.M}, DType::f32);
  output(name + ".phi", grads.phi, {dims_.M, dims_.N}, DType::f32);
  output(name + ".alpha", grads.alpha, {3}, DType::f32);
  output(name + ".bias", grads.bias, {dims_.N}, DType::f32);
}

DType ArgumentChecker::post_inputs(const TensorRef& layer_out, const TensorRef& h_post,
                                   const TensorRef& h_res) {
  const DType lo_dtype = layer_out.dtype == DType::bf16 ? DType::bf16 : DType::f32;
  tensor("layer_out", layer_out, {dims_.T, dims_.D}, lo_dtype);
  tensor("h_post", h_post, {dims_.T, dims_.n}, DType::f32);
  tensor("h_res", h_res, {dims_.T, dims_.n, dims_.n}, DType::f32);
  return lo_dtype;
}

void ArgumentChecker::head_params(const HeadParams& params) {
  tensor("params.fn", params.fn, {dims_.n, dims_.M}, DType::f32);
  tensor("params.base", params.base, {dims_.n}, DType::f32);
  tensor("params.scale", params.scale, {1}, DType::f32);
}

void ArgumentChecker::head_grads(const HeadGrads& grads) {
  output("grads.fn", grads.fn, {dims_.n, dims_.M}, DType::f32);
  output("grads.base", grads.base, {dims_.n}, DType::f32);
  output("grads.scale", grads.scale, {1}, DType::f32);
}

PreApply ArgumentChecker::carried(const std::string& name, const TensorRef& view) {
  if (view.rank == 0 && view.data == nullptr) return PreApply::one_hot;
  if (view.rank == 2 && view.shape[0] == dims_.T && view.shape[1] == 0) {
    check_view(name, view, {dims_.T, 0}, DType::f32, false);
    return PreApply::one_hot;
  }
  if (view.rank != 2 || view.shape[0] != dims_.T || view.shape[1] != dims_.n) {
    throw Error(op_, name,
                "expected shape " + shape_text({dims_.T, dims_.n}) +
                    " (the carried mix, f32 [T, n]) or absent (an empty view or shape " +
                    shape_text({dims_.T, 0}) + ": the one-hot on stream 0), got " +
                    view.shape_string());
  }
  check_view(name, view, {dims_.T, dims_.n}, DType::f32, false);
  return PreApply::carried;
}

void ArgumentChecker::dcarried(const std::string& name, const MutableTensorRef& view,
                               PreApply pre_apply) {
  const bool empty_view = view.rank == 0 && view.data == nullptr;
  const bool zero_width = view.rank == 2 && view.shape[0] == dims_.T && view.shape[1] == 0;
  if (pre_apply == PreApply::carried) {
    if (empty_view || zero_width) {
      throw Error(op_, name,
                  "expected shape " + shape_text({dims_.T, dims_.n}) +
                      " (f32 [T, n]) because carried is present, got " +
                      TensorRef(view).shape_string());
    }
    output(name, view, {dims_.T, dims_.n}, DType::f32);
    return;
  }
  if (empty_view) return;
  if (!zero_width) {
    throw Error(op_, name,
                "expected absent (an empty view or shape " + shape_text({dims_.T, 0}) +
                    ") because carried is absent (the one-hot on stream 0 has no cotangent), got " +
                    TensorRef(view).shape_string());
  }
  output(name, view, {dims_.T, 0}, DType::f32);
}

void ArgumentChecker::head() {
  dims_.pre_gates_only = true;
  dims_.N = dims_.n;
}

void ArgumentChecker::check_view(const std::string& name, const TensorRef& view,
                                 const std::vector<int64_t>& expected, DType dtype, bool written) {
  bool same_shape = view.rank == static_cast<int>(expected.size());
  for (size_t axis = 0; same_shape && axis < expected.size(); ++axis) {
    same_shape = view.shape[axis] == expected[axis];
  }
  if (!same_shape) {
    throw Error(op_, name,
                "expected shape " + shape_text(expected) + ", got " + view.shape_string());
  }
  if (view.dtype != dtype) {
    const bool is_unknown = view.dtype != DType::f32 && view.dtype != DType::bf16;
    throw Error(op_, name,
                std::string("expected dtype ") + to_string(dtype) + ", got " +
                    (is_unknown ? "an unknown dtype value" : to_string(view.dtype)));
  }
  // The byte size must be representable: a shape that overflows is a caller bug, not a size.
  int64_t bytes = size_of(dtype);
  for (int64_t extent : expected) {
    if (__builtin_mul_overflow(bytes, extent, &bytes) || bytes > PTRDIFF_MAX) {
      throw Error(op_, name,
                  "shape " + shape_text(expected) + " of " + to_string(dtype) +
                      " overflows the addressable byte size");
    }
  }
  if (bytes == 0) return;  // empty tensors may have null data and overlap nothing
  if (view.data == nullptr) {
    throw Error(op_, name, "expected non-null data for shape " + shape_text(expected));
  }
  const auto begin = reinterpret_cast<uintptr_t>(view.data);
  if (begin > UINTPTR_MAX - static_cast<uintptr_t>(bytes)) {
    throw Error(op_, name,
                "buffer of " + std::to_string(bytes) + " bytes wraps around the address space");
  }
  spans_.push_back(Span{name, begin, begin + static_cast<uintptr_t>(bytes), written});
}

void ArgumentChecker::finish() const {
  for (size_t a = 0; a < spans_.size(); ++a) {
    for (size_t b = 0; b < spans_.size(); ++b) {
      if (a == b || !spans_[a].written || (spans_[b].written && b < a)) continue;
      const bool overlap = spans_[a].begin < spans_[b].end && spans_[b].begin < spans_[a].end;
      if (overlap) {
        throw Error(op_, spans_[a].name,
                    "output memory overlaps " + spans_[b].name +
                        "; outputs must not alias any other argument");
      }
    }
  }
}

namespace {
// The argument checks of V4's operations that have a V4.1 form, between the checker's whole_dim
// (the fused operations) and finish(): the V4 checker runs them alone, the V4.1 one
// (DeepSeek-V4.1's carried mix, mhc/ops.h) then checks its own operands before finish(), so that
// they too are checked for overlaps.
void pre_forward_arguments(ArgumentChecker& check, const TensorRef& x, const Params& params,
                           const PreForwardOutputs& outputs) {
  check.tokens("x", x);
  check.params(params);
  check.pre_forward_outputs(outputs, x.dtype);
}

void pre_backward_arguments(ArgumentChecker& check, const TensorRef& dlayer_in,
                            const TensorRef& dx_partial, const TensorRef& dh_post,
                            const TensorRef& dh_res, const TensorRef& x, const Params& params,
                            const MutableTensorRef& dx, const ParamGrads& grads) {
  check.tokens("x", x);
  const Dims& d = check.dims();
  check.tensor("dlayer_in", dlayer_in, {d.T, d.D}, x.dtype);
  check.tensor("dx_partial", dx_partial, {d.T, d.n, d.D}, x.dtype);
  check.tensor("dh_post", dh_post, {d.T, d.n}, DType::f32);
  check.tensor("dh_res", dh_res, {d.T, d.n, d.n}, DType::f32);
  check.params(params);
  check.output("dx", dx, {d.T, d.n, d.D}, x.dtype);
  check.grads(grads);
}

void pre_forward_finish_arguments(ArgumentChecker& check, const TensorRef& x,
                                  const TensorRef& partials, const TensorRef& alpha,
                                  const TensorRef& bias, const PreForwardOutputs& outputs) {
  check.tokens("x", x);
  const Dims& d = check.dims();
  check.tensor("partials", partials, {d.T, d.N + 1}, DType::f32);
  check.tensor("alpha", alpha, {3}, DType::f32);
  check.tensor("bias", bias, {d.N}, DType::f32);
  check.pre_forward_outputs(outputs, x.dtype);
}

void pre_backward_finish_arguments(ArgumentChecker& check, const TensorRef& dlayer_in,
                                   const TensorRef& dx_partial, const TensorRef& dh_pre,
                                   const TensorRef& dh_post, const TensorRef& dh_res,
                                   const TensorRef& x, const TensorRef& partials,
                                   const Params& params, const MutableTensorRef& dx,
                                   const ParamGrads& grads) {
  pre_backward_arguments(check, dlayer_in, dx_partial, dh_post, dh_res, x, params, dx, grads);
  const Dims& d = check.dims();
  check.tensor("dh_pre", dh_pre, {d.T, d.n}, DType::f32);
  check.tensor("partials", partials, {d.T, d.N + 1}, DType::f32);
}

void boundary_forward_arguments(ArgumentChecker& check, const TensorRef& x,
                                const TensorRef& layer_out, const TensorRef& h_post,
                                const TensorRef& h_res, const Params& next_params,
                                const MutableTensorRef& x_next, const PreForwardOutputs& next) {
  check.tokens("x", x);
  const Dims& d = check.dims();
  check.post_inputs(layer_out, h_post, h_res);
  check.params(next_params, "next_params");
  check.output("x_next", x_next, {d.T, d.n, d.D}, x.dtype);
  check.pre_forward_outputs(next, x.dtype, "next.");
}

void boundary_backward_arguments(ArgumentChecker& check, const TensorRef& next_dlayer_in,
                                 const TensorRef& next_dx_partial, const TensorRef& next_dh_post,
                                 const TensorRef& next_dh_res, const TensorRef& x,
                                 const TensorRef& layer_out, const TensorRef& h_post,
                                 const TensorRef& h_res, const Params& next_params,
                                 const PostBackwardOutputs& outputs, const ParamGrads& next_grads) {
  check.tokens("x", x);
  const Dims& d = check.dims();
  check.tensor("next_dlayer_in", next_dlayer_in, {d.T, d.D}, x.dtype);
  check.tensor("next_dx_partial", next_dx_partial, {d.T, d.n, d.D}, x.dtype);
  check.tensor("next_dh_post", next_dh_post, {d.T, d.n}, DType::f32);
  check.tensor("next_dh_res", next_dh_res, {d.T, d.n, d.n}, DType::f32);
  const DType lo_dtype = check.post_inputs(layer_out, h_post, h_res);
  check.params(next_params, "next_params");
  check.output("dx_partial", outputs.dx_partial, {d.T, d.n, d.D}, x.dtype);
  check.output("dlayer_out", outputs.dlayer_out, {d.T, d.D}, lo_dtype);
  check.output("dh_post", outputs.dh_post, {d.T, d.n}, DType::f32);
  check.output("dh_res", outputs.dh_res, {d.T, d.n, d.n}, DType::f32);
  check.grads(next_grads, "next_grads");
}
}  // namespace

Dims check_pre_forward(const char* op, const Config& config, const TensorRef& x,
                       const Params& params, const PreForwardOutputs& outputs) {
  ArgumentChecker check(op, config);
  check.whole_dim("pre_forward_partials and pre_forward_finish");
  pre_forward_arguments(check, x, params, outputs);
  check.finish();
  return check.dims();
}

Dims check_post_forward(const char* op, const Config& config, const TensorRef& x,
                        const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                        const MutableTensorRef& out) {
  ArgumentChecker check(op, config);
  check.tokens("x", x);
  const Dims& d = check.dims();
  check.post_inputs(layer_out, h_post, h_res);
  check.output("out", out, {d.T, d.n, d.D}, x.dtype);
  check.finish();
  return check.dims();
}

Dims check_post_backward(const char* op, const Config& config, const TensorRef& g,
                         const TensorRef& x, const TensorRef& layer_out, const TensorRef& h_post,
                         const TensorRef& h_res, const PostBackwardOutputs& outputs) {
  ArgumentChecker check(op, config);
  check.tokens("x", x);
  const Dims& d = check.dims();
  check.tensor("g", g, {d.T, d.n, d.D}, x.dtype);
  const DType lo_dtype = check.post_inputs(layer_out, h_post, h_res);
  check.output("dx_partial", outputs.dx_partial, {d.T, d.n, d.D}, x.dtype);
  check.output("dlayer_out", outputs.dlayer_out, {d.T, d.D}, lo_dtype);
  check.output("dh_post", outputs.dh_post, {d.T, d.n}, DType::f32);
  check.output("dh_res", outputs.dh_res, {d.T, d.n, d.n}, DType::f32);
  check.finish();
  return check.dims();
}

Dims check_pre_backward(const char* op, const Config& config, const TensorRef& dlayer_in,
                        const TensorRef& dx_partial, const TensorRef& dh_post,
                        const TensorRef& dh_res, const TensorRef& x, const Params& params,
                        const MutableTensorRef& dx, const ParamGrads& grads) {
  ArgumentChecker check(op, config);
  check.whole_dim("pre_backward_partials and pre_backward_finish");
  pre_backward_arguments(check, dlayer_in, dx_partial, dh_post, dh_res, x, params, dx, grads);
  check.finish();
  return check.dims();
}

Dims check_pre_forward_partials(const char* op, const Config& config, const TensorRef& x,
                                const TensorRef& norm_weight, const TensorRef& phi,
                                const MutableTensorRef& partials) {
  ArgumentChecker check(op, config);
  check.tokens("x", x);
  const Dims& d = check.dims();
  check.tensor("norm_weight", norm_weight, {d.M}, DType::f32);
  check.tensor("phi", phi, {d.M, d.N}, DType::f32);
  check.output("partials", partials, {d.T, d.N + 1}, DType::f32);
  check.finish();
  return check.dims();
}

Dims check_pre_forward_finish(const char* op, const Config& config, const TensorRef& x,
                              const TensorRef& partials, const TensorRef& alpha,
                              const TensorRef& bias, const PreForwardOutputs& outputs) {
  ArgumentChecker check(op, config);
  pre_forward_finish_arguments(check, x, partials, alpha, bias, outputs);
  check.finish();
  return check.dims();
}

Dims check_pre_backward_partials(const char* op, const Config& config, const TensorRef& dlayer_in,
                                 const TensorRef& x, const MutableTensorRef& dh_pre) {
  ArgumentChecker check(op, config);
  check.tokens("x", x);
  const Dims& d = check.dims();
  check.tensor("dlayer_in", dlayer_in, {d.T, d.D}, x.dtype);
  check.output("dh_pre", dh_pre, {d.T, d.n}, DType::f32);
  check.finish();
  return check.dims();
}

Dims check_pre_backward_finish(const char* op, const Config& config, const TensorRef& dlayer_in,
                               const TensorRef& dx_partial, const TensorRef& dh_pre,
                               const TensorRef& dh_post, const TensorRef& dh_res,
                               const TensorRef& x, const TensorRef& partials, const Params& params,
                               const MutableTensorRef& dx, const ParamGrads& grads) {
  ArgumentChecker check(op, config);
  pre_backward_finish_arguments(check, dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, partials,
                                params, dx, grads);
  check.finish();
  return check.dims();
}

Dims check_boundary_forward(const char* op, const Config& config, const TensorRef& x,
                            const TensorRef& layer_out, const TensorRef& h_post,
                            const TensorRef& h_res, const Params& next_params,
                            const MutableTensorRef& x_next, const PreForwardOutputs& next) {
  ArgumentChecker check(op, config);
  check.whole_dim("post_forward, then pre_forward_partials and pre_forward_finish");
  boundary_forward_arguments(check, x, layer_out, h_post, h_res, next_params, x_next, next);
  check.finish();
  return check.dims();
}

Dims check_boundary_backward(const char* op, const Config& config, const TensorRef& next_dlayer_in,
                             const TensorRef& next_dx_partial, const TensorRef& next_dh_post,
                             const TensorRef& next_dh_res, const TensorRef& x,
                             const TensorRef& layer_out, const TensorRef& h_post,
                             const TensorRef& h_res, const Params& next_params,
                             const PostBackwardOutputs& outputs, const ParamGrads& next_grads) {
  ArgumentChecker check(op, config);
  check.whole_dim("pre_backward_partials and pre_backward_finish, then post_backward");
  boundary_backward_arguments(check, next_dlayer_in, next_dx_partial, next_dh_post, next_dh_res, x,
                              layer_out, h_post, h_res, next_params, outputs, next_grads);
  check.finish();
  return check.dims();
}

Dims check_head_forward(const char* op, const Config& config, const TensorRef& x,
                        const HeadParams& params, const MutableTensorRef& out,
                        const MutableTensorRef& gates) {
  ArgumentChecker check(op, config);
  check.whole_dim("an all-gather of D before the head (it has no split form)");
  check.head();
  check.tokens("x", x);
  const Dims& d = check.dims();
  check.head_params(params);
  check.output("out", out, {d.T, d.D}, x.dtype);
  check.output("gates", gates, {d.T, d.n}, DType::f32);
  check.finish();
  return check.dims();
}

Dims check_head_backward(const char* op, const Config& config, const TensorRef& dout,
                         const TensorRef& x, const HeadParams& params, const MutableTensorRef& dx,
                         const HeadGrads& grads) {
  ArgumentChecker check(op, config);
  check.whole_dim("an all-gather of D before the head (it has no split form)");
  check.head();
  check.tokens("x", x);
  const Dims& d = check.dims();
  check.tensor("dout", dout, {d.T, d.D}, x.dtype);
  check.head_params(params);
  check.output("dx", dx, {d.T, d.n, d.D}, x.dtype);
  check.head_grads(grads);
  check.finish();
  return check.dims();
}

Dims check_pre_forward_carried(const char* op, const Config& config, const TensorRef& x,
                               const TensorRef& carried, const Params& params,
                               const PreForwardOutputs& outputs) {
  ArgumentChecker check(op, config);
  check.whole_dim("pre_forward_partials and pre_forward_finish_carried");
  pre_forward_arguments(check, x, params, outputs);
  check.carried("carried", carried);
  check.finish();
  return check.dims();
}

Dims check_pre_backward_carried(const char* op, const Config& config, const TensorRef& dlayer_in,
                                const TensorRef& dx_partial, const TensorRef& dh_pre,
                                const TensorRef& dh_post, const TensorRef& dh_res,
                                const TensorRef& x, const TensorRef& carried, const Params& params,
                                const MutableTensorRef& dx, const MutableTensorRef& dcarried,
                                const ParamGrads& grads) {
  ArgumentChecker check(op, config);
  check.whole_dim("pre_backward_partials and pre_backward_finish_carried");
  pre_backward_arguments(check, dlayer_in, dx_partial, dh_post, dh_res, x, params, dx, grads);
  const Dims& d = check.dims();
  check.tensor("dh_pre", dh_pre, {d.T, d.n}, DType::f32);
  check.dcarried("dcarried", dcarried, check.carried("carried", carried));
  check.finish();
  return check.dims();
}

Dims check_collapse_forward(const char* op, const Config& config, const TensorRef& x,
                            const TensorRef& carried, const MutableTensorRef& out) {
  ArgumentChecker check(op, config);
  check.tokens("x", x);
  const Dims& d = check.dims();
  check.carried("carried", carried);
  check.output("out", out, {d.T, d.D}, x.dtype);
  check.finish();
  return check.dims();
}

Dims check_collapse_backward(const char* op, const Config& config, const TensorRef& dout,
                             const TensorRef& x, const TensorRef& carried,
                             const MutableTensorRef& dx, const MutableTensorRef& dcarried) {
  ArgumentChecker check(op, config);
  check.tokens("x", x);
  const Dims& d = check.dims();
  check.tensor("dout", dout, {d.T, d.D}, x.dtype);
  const PreApply pre_apply = check.carried("carried", carried);
  check.output("dx", dx, {d.T, d.n, d.D}, x.dtype);
  check.dcarried("dcarried", dcarried, pre_apply);
  check.finish();
  return check.dims();
}

Dims check_boundary_forward_carried(const char* op, const Config& config, const TensorRef& x,
                                    const TensorRef& layer_out, const TensorRef& h_pre,
                                    const TensorRef& h_post, const TensorRef& h_res,
                                    const Params& next_params, const MutableTensorRef& x_next,
                                    const PreForwardOutputs& next) {
  ArgumentChecker check(op, config);
  check.whole_dim("post_forward, then pre_forward_partials and pre_forward_finish_carried");
  boundary_forward_arguments(check, x, layer_out, h_post, h_res, next_params, x_next, next);
  const Dims& d = check.dims();
  check.tensor("h_pre", h_pre, {d.T, d.n}, DType::f32);
  check.finish();
  return check.dims();
}

Dims check_boundary_backward_carried(const char* op, const Config& config,
                                     const TensorRef& next_dlayer_in,
                                     const TensorRef& next_dx_partial, const TensorRef& next_dh_pre,
                                     const TensorRef& next_dh_post, const TensorRef& next_dh_res,
                                     const TensorRef& x, const TensorRef& layer_out,
                                     const TensorRef& h_pre, const TensorRef& h_post,
                                     const TensorRef& h_res, const Params& next_params,
                                     const PostBackwardOutputs& outputs,
                                     const MutableTensorRef& dh_pre, const ParamGrads& next_grads) {
  ArgumentChecker check(op, config);
  check.whole_dim("pre_backward_partials and pre_backward_finish_carried, then post_backward");
  boundary_backward_arguments(check, next_dlayer_in, next_dx_partial, next_dh_post, next_dh_res, x,
                              layer_out, h_post, h_res, next_params, outputs, next_grads);
  const Dims& d = check.dims();
  check.tensor("next_dh_pre", next_dh_pre, {d.T, d.n}, DType::f32);
  check.tensor("h_pre", h_pre, {d.T, d.n}, DType::f32);
  check.output("dh_pre", dh_pre, {d.T, d.n}, DType::f32);
  check.finish();
  return check.dims();
}

Dims check_pre_forward_finish_carried(const char* op, const Config& config, const TensorRef& x,
                                      const TensorRef& partials, const TensorRef& carried,
                                      const TensorRef& alpha, const TensorRef& bias,
                                      const PreForwardOutputs& outputs) {
  ArgumentChecker check(op, config);
  pre_forward_finish_arguments(check, x, partials, alpha, bias, outputs);
  check.carried("carried", carried);
  check.finish();
  return check.dims();
}

Dims check_pre_backward_finish_carried(const char* op, const Config& config,
                                       const TensorRef& dlayer_in, const TensorRef& dx_partial,
                                       const TensorRef& dh_pre, const TensorRef& dh_post,
                                       const TensorRef& dh_res, const TensorRef& x,
                                       const TensorRef& partials, const TensorRef& carried,
                                       const Params& params, const MutableTensorRef& dx,
                                       const ParamGrads& grads) {
  ArgumentChecker check(op, config);
  pre_backward_finish_arguments(check, dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, partials,
                                params, dx, grads);
  check.carried("carried", carried);
  check.finish();
  return check.dims();
}

}  // namespace mhc::detail
