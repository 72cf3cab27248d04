// Argument checks shared by every backend's entry points: config, view shapes, dtypes, null
// data, byte sizes that overflow, and outputs that overlap other arguments.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "mhc/config.h"
#include "mhc/ops.h"
#include "mhc/tensor.h"

namespace mhc::detail {

// Sizes of one call once its arguments are known to be consistent.
struct Dims {
  int64_t T = 0;  // tokens
  int64_t n = 0;  // streams
  int64_t D = 0;  // features per stream in this call's tensors (a slice when tensor_parallel > 1)
  int64_t M = 0;  // n*D
  int64_t M_full = 0;  // n * config.dim: the values one token's RMS averages over, all slices
  int64_t N = 0;       // projection width 2n + R (R residual logits)
  // The head (mhc::head_forward): the pre operations with only the pre gates, N = n.
  bool pre_gates_only = false;
};

// Validates one call; every message starts with the operation's name. Construct it (checks the
// config), call tokens() on the tensor that defines T, then tensor()/output() for the rest, then
// finish() to reject outputs that overlap any other argument.
class ArgumentChecker {
 public:
  ArgumentChecker(const char* op, const Config& config);

  // A [T, n, D] tensor of any supported dtype; sets dims().T.
  void tokens(const char* name, const TensorRef& view);
  // A tensor whose shape must equal `expected` and whose dtype must equal `dtype`.
  void tensor(const std::string& name, const TensorRef& view,
              std::initializer_list<int64_t> expected, DType dtype);
  void output(const std::string& name, const MutableTensorRef& view,
              std::initializer_list<int64_t> expected, DType dtype);
  // For the fused pre operations, which need every feature of a token: tensor_parallel == 1.
  void whole_dim(const char* split_ops);
  // layer_in [T, D] in x's dtype and the f32 coefficients, as both pre_forward and
  // pre_forward_finish write them. `prefix` names the argument in messages ("next.layer_in").
  void pre_forward_outputs(const PreForwardOutputs& outputs, DType x_dtype,
                           const std::string& prefix = "");
  void params(const Params& params, const std::string& name = "params");
  void grads(const ParamGrads& grads, const std::string& name = "grads");
  // The post operations' inputs: layer_out [T, D] (f32 or bf16, its own dtype), h_post [T, n]
  // and h_res [T, n, n] (f32). Returns layer_out's dtype, which dlayer_out shares.
  DType post_inputs(const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res);
  // A carried mix (V4.1, mhc/ops.h): f32 [T, n], or absent (an empty view or [T, 0]: the one-hot
  // on stream 0). Returns the pre-apply it selects: PreApply::carried or PreApply::one_hot.
  PreApply carried(const std::string& name, const TensorRef& view);
  // Its cotangent, an output: f32 [T, n] for PreApply::carried, else absent as well.
  void dcarried(const std::string& name, const MutableTensorRef& view, PreApply pre_apply);
  // The head: only the pre gates, so N = n and R = 0 from here on.
  void head();
  // The head's parameters (fn [n, M], base [n], scale [1]) and their gradients, f32.
  void head_params(const HeadParams& params);
  void head_grads(const HeadGrads& grads);
  void finish() const;

  const Dims& dims() const { return dims_; }

 private:
  struct Span {
    std::string name;
    uintptr_t begin;
    uintptr_t end;
    bool written;
  };
  void check_view(const std::string& name, const TensorRef& view,
                  const std::vector<int64_t>& expected, DType dtype, bool written);

  const char* op_;
  int64_t tensor_parallel_;
  Dims dims_;
  std::vector<Span> spans_;
};

// One check per public operation, shared by every backend: the same arguments are checked in the
// same order, and messages start with `op` (e.g. "mhc::pre_forward" or "mhc::cuda::pre_forward").
Dims check_pre_forward(const char* op, const Config& config, const TensorRef& x,
                       const Params& params, const PreForwardOutputs& outputs);
Dims check_post_forward(const char* op, const Config& config, const TensorRef& x,
                        const TensorRef& layer_out, const TensorRef& h_post, const TensorRef& h_res,
                        const MutableTensorRef& out);
Dims check_post_backward(const char* op, const Config& config, const TensorRef& g,
                         const TensorRef& x, const TensorRef& layer_out, const TensorRef& h_post,
                         const TensorRef& h_res, const PostBackwardOutputs& outputs);
Dims check_pre_backward(const char* op, const Config& config, const TensorRef& dlayer_in,
                        const TensorRef& dx_partial, const TensorRef& dh_post,
                        const TensorRef& dh_res, const TensorRef& x, const Params& params,
                        const MutableTensorRef& dx, const ParamGrads& grads);
Dims check_pre_forward_partials(const char* op, const Config& config, const TensorRef& x,
                                const TensorRef& norm_weight, const TensorRef& phi,
                                const MutableTensorRef& partials);
Dims check_pre_forward_finish(const char* op, const Config& config, const TensorRef& x,
                              const TensorRef& partials, const TensorRef& alpha,
                              const TensorRef& bias, const PreForwardOutputs& outputs);
Dims check_pre_backward_partials(const char* op, const Config& config, const TensorRef& dlayer_in,
                                 const TensorRef& x, const MutableTensorRef& dh_pre);
Dims check_pre_backward_finish(const char* op, const Config& config, const TensorRef& dlayer_in,
                               const TensorRef& dx_partial, const TensorRef& dh_pre,
                               const TensorRef& dh_post, const TensorRef& dh_res,
                               const TensorRef& x, const TensorRef& partials, const Params& params,
                               const MutableTensorRef& dx, const ParamGrads& grads);
Dims check_boundary_forward(const char* op, const Config& config, const TensorRef& x,
                            const TensorRef& layer_out, const TensorRef& h_post,
                            const TensorRef& h_res, const Params& next_params,
                            const MutableTensorRef& x_next, const PreForwardOutputs& next);
// The head's checks return Dims with pre_gates_only set (N = n, R = 0).
Dims check_head_forward(const char* op, const Config& config, const TensorRef& x,
                        const HeadParams& params, const MutableTensorRef& out,
                        const MutableTensorRef& gates);
Dims check_head_backward(const char* op, const Config& config, const TensorRef& dout,
                         const TensorRef& x, const HeadParams& params, const MutableTensorRef& dx,
                         const HeadGrads& grads);
Dims check_boundary_backward(const char* op, const Config& config, const TensorRef& next_dlayer_in,
                             const TensorRef& next_dx_partial, const TensorRef& next_dh_post,
                             const TensorRef& next_dh_res, const TensorRef& x,
                             const TensorRef& layer_out, const TensorRef& h_post,
                             const TensorRef& h_res, const Params& next_params,
                             const PostBackwardOutputs& outputs, const ParamGrads& next_grads);

// DeepSeek-V4.1's carried mix (mhc/ops.h): the pre-apply a validated carried view selects, the
// mix itself or, absent, the one-hot on stream 0. The one place a view is read as the mode.
inline PreApply pre_apply_of(const TensorRef& carried) {
  return carried.rank == 2 && carried.shape[1] != 0 ? PreApply::carried : PreApply::one_hot;
}
Dims check_pre_forward_carried(const char* op, const Config& config, const TensorRef& x,
                               const TensorRef& carried, const Params& params,
                               const PreForwardOutputs& outputs);
Dims check_pre_backward_carried(const char* op, const Config& config, const TensorRef& dlayer_in,
                                const TensorRef& dx_partial, const TensorRef& dh_pre,
                                const TensorRef& dh_post, const TensorRef& dh_res,
                                const TensorRef& x, const TensorRef& carried, const Params& params,
                                const MutableTensorRef& dx, const MutableTensorRef& dcarried,
                                const ParamGrads& grads);
Dims check_collapse_forward(const char* op, const Config& config, const TensorRef& x,
                            const TensorRef& carried, const MutableTensorRef& out);
Dims check_collapse_backward(const char* op, const Config& config, const TensorRef& dout,
                             const TensorRef& x, const TensorRef& carried,
                             const MutableTensorRef& dx, const MutableTensorRef& dcarried);
Dims check_boundary_forward_carried(const char* op, const Config& config, const TensorRef& x,
                                    const TensorRef& layer_out, const TensorRef& h_pre,
                                    const TensorRef& h_post, const TensorRef& h_res,
                                    const Params& next_params, const MutableTensorRef& x_next,
                                    const PreForwardOutputs& next);
Dims check_boundary_backward_carried(const char* op, const Config& config,
                                     const TensorRef& next_dlayer_in,
                                     const TensorRef& next_dx_partial, const TensorRef& next_dh_pre,
                                     const TensorRef& next_dh_post, const TensorRef& next_dh_res,
                                     const TensorRef& x, const TensorRef& layer_out,
                                     const TensorRef& h_pre, const TensorRef& h_post,
                                     const TensorRef& h_res, const Params& next_params,
                                     const PostBackwardOutputs& outputs,
                                     const MutableTensorRef& dh_pre, const ParamGrads& next_grads);
Dims check_pre_forward_finish_carried(const char* op, const Config& config, const TensorRef& x,
                                      const TensorRef& partials, const TensorRef& carried,
                                      const TensorRef& alpha, const TensorRef& bias,
                                      const PreForwardOutputs& outputs);
Dims check_pre_backward_finish_carried(const char* op, const Config& config,
                                       const TensorRef& dlayer_in, const TensorRef& dx_partial,
                                       const TensorRef& dh_pre, const TensorRef& dh_post,
                                       const TensorRef& dh_res, const TensorRef& x,
                                       const TensorRef& partials, const TensorRef& carried,
                                       const Params& params, const MutableTensorRef& dx,
                                       const ParamGrads& grads);

}  // namespace mhc::detail
