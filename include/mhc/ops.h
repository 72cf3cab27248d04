// mhc/ops.h: the mHC operations on the CPU, split the way a framework's custom VJP needs.
//
// Forward of one sublayer:   pre_forward -> (caller runs F on layer_in) -> post_forward
// Backward of one sublayer:  post_backward -> (caller back-propagates through F) -> pre_backward
//
// Dtypes. Coefficients (h_pre, h_post, h_res and their gradients) and parameters (and their
// gradients) are always f32. Activations are f32 or bf16: tensors shaped like x or layer_in
// (x, layer_in, out, g, dx_partial, dlayer_in, dx) share the dtype of x; layer_out and
// dlayer_out share the dtype of layer_out. Math is f32; bf16 is rounded once, at the store.
//
// Threads. Work is split into token tiles run on a shared pool (set_num_threads, or the
// MHC_NUM_THREADS environment variable read at first use). Every result, parameter gradients
// included, is bitwise identical for any thread count: tiles and reduction order depend only on
// the shapes. Calls from several threads at once are safe; a call that finds the pool busy runs
// on its own thread.
//
// Errors. Every entry point validates the config and every view (null data, dtype, shape,
// byte sizes that overflow) and throws mhc::Error naming the argument before touching memory.
// T = x.shape[0] may be 0: nothing is read, and parameter gradients are set to zero.
//
// Shapes below are for config.tensor_parallel == 1; with D split, every D in a shape is the
// slice's D / tensor_parallel (see "Tensor parallelism" further down).
#pragma once

#include <cstdint>

#include "mhc/config.h"
#include "mhc/error.h"
#include "mhc/export.h"
#include "mhc/tensor.h"

namespace mhc {

// Parameters (spec: Shapes and names), all f32: norm_weight [M], phi [M, N], alpha [3],
// bias [N], with phi's columns [pre 0:n | post n:2n | res 2n:N].
struct Params {
  TensorRef norm_weight;
  TensorRef phi;
  TensorRef alpha;
  TensorRef bias;
};

// Their gradients, same shapes, f32. pre_backward overwrites them (it does not accumulate).
struct ParamGrads {
  MutableTensorRef norm_weight;
  MutableTensorRef phi;
  MutableTensorRef alpha;
  MutableTensorRef bias;
};

// x [T, n, D] -> layer_in [T, D], h_pre [T, n], h_post [T, n], h_res [T, n, n]
// (spec: Forward steps 1-6, one pass over each token tile of x).
struct PreForwardOutputs {
  MutableTensorRef layer_in;
  MutableTensorRef h_pre;
  MutableTensorRef h_post;
  MutableTensorRef h_res;
};
MHC_API void pre_forward(const Config& config, const TensorRef& x, const Params& params,
                         const PreForwardOutputs& outputs);

// out[t,j,d] = sum_i h_res[t,i,j] x[t,i,d] + h_post[t,j] layer_out[t,d]   (spec: step 8).
// out [T, n, D] has the dtype of x.
MHC_API void post_forward(const Config& config, const TensorRef& x, const TensorRef& layer_out,
                          const TensorRef& h_post, const TensorRef& h_res,
                          const MutableTensorRef& out);

// g = dL/dout [T, n, D] -> dx_partial [T, n, D] (the part of dx that flows through H_res),
// dlayer_out [T, D], dh_post [T, n], dh_res [T, n, n]   (spec: Backward, Post).
struct PostBackwardOutputs {
  MutableTensorRef dx_partial;
  MutableTensorRef dlayer_out;
  MutableTensorRef dh_post;
  MutableTensorRef dh_res;
};
MHC_API void post_backward(const Config& config, const TensorRef& g, const TensorRef& x,
                           const TensorRef& layer_out, const TensorRef& h_post,
                           const TensorRef& h_res, const PostBackwardOutputs& outputs);

// dlayer_in [T, D], dx_partial [T, n, D], dh_post [T, n], dh_res [T, n, n] -> dx [T, n, D] and
// the parameter gradients. Recomputes r, P, the gates and every Sinkhorn step from x, so nothing
// but x has to be kept from the forward; dx = dx_partial + (pre-apply and coefficient terms).
MHC_API void pre_backward(const Config& config, const TensorRef& dlayer_in,
                          const TensorRef& dx_partial, const TensorRef& dh_post,
                          const TensorRef& dh_res, const TensorRef& x, const Params& params,
                          const MutableTensorRef& dx, const ParamGrads& grads);

// The boundary between sublayer l and sublayer l+1 (spec: Boundary), fused: the post of l and the
// pre of l+1 in one pass over each token tile. In a stack of sublayers the chain becomes
//   pre_forward -> F_1 -> boundary_forward -> F_2 -> ... -> boundary_forward -> F_L -> post_forward
//   post_backward -> F_L' -> boundary_backward -> ... -> F_1' -> pre_backward
// with one Config for both sublayers (the same n, D and scalars) and each sublayer's parameters.
//
// Forward: x_next = post_forward(x, layer_out, h_post, h_res) and next = pre_forward(x_next,
// next_params). Each tile of x_next is written once and projected while it is still in cache;
// every output has the same bits as the two calls.
MHC_API void boundary_forward(const Config& config, const TensorRef& x, const TensorRef& layer_out,
                              const TensorRef& h_post, const TensorRef& h_res,
                              const Params& next_params, const MutableTensorRef& x_next,
                              const PreForwardOutputs& next);

// Backward: pre_backward of sublayer l+1 (from its next_dlayer_in, next_dx_partial, next_dh_post,
// next_dh_res, with x_next = post_forward(x, layer_out, h_post, h_res) recomputed per tile rather
// than read) and post_backward of sublayer l with g = the dx_next that pre_backward forms, tile by
// tile: dx_next is never written. Outputs: sublayer l's post gradients (as post_backward) and
// sublayer l+1's parameter gradients (as pre_backward), the same bits as the three calls.
MHC_API void boundary_backward(const Config& config, const TensorRef& next_dlayer_in,
                               const TensorRef& next_dx_partial, const TensorRef& next_dh_post,
                               const TensorRef& next_dh_res, const TensorRef& x,
                               const TensorRef& layer_out, const TensorRef& h_post,
                               const TensorRef& h_res, const Params& next_params,
                               const PostBackwardOutputs& outputs, const ParamGrads& next_grads);

// DeepSeek-V4's head (spec: Head): after the last sublayer, a learned collapse of the n streams
// into one, in place of a plain sum. Its parameters, f32, as V4 stores them: fn [n, M] (hc_head_fn,
// one row per stream, not transposed), base [n] and scale [1].
struct HeadParams {
  TensorRef fn;
  TensorRef base;
  TensorRef scale;
};

// Their gradients, same shapes, f32; head_backward overwrites them.
struct HeadGrads {
  MutableTensorRef fn;
  MutableTensorRef base;
  MutableTensorRef scale;
};

// x [T, n, D] -> out [T, D] (x's dtype) and gates [T, n] f32:
//   gates[t,k] = sigmoid(scale * r_t * sum_m x[t,m] fn[k,m] + base[k]) + pre_eps,
//   out[t,d] = sum_k gates[t,k] x[t,k,d],
// with r_t the unweighted RMS factor. It is pre_forward with only the pre columns (N = n, no
// H_post or H_res), run by the same kernels. From the config it uses n, dim, rms_eps and
// pre_eps; tensor_parallel must be 1 (gather D before the head).
MHC_API void head_forward(const Config& config, const TensorRef& x, const HeadParams& params,
                          const MutableTensorRef& out, const MutableTensorRef& gates);

// dout [T, D] (x's dtype) -> dx [T, n, D] and the parameter gradients, recomputing the gates
// from x (pre_backward's kernels with N = n).
MHC_API void head_backward(const Config& config, const TensorRef& dout, const TensorRef& x,
                           const HeadParams& params, const MutableTensorRef& dx,
                           const HeadGrads& grads);

// DeepSeek-V4.1's single-pass schedule (spec: Single-pass schedule; V4.1's
// hc_pre_from_prev_sublayer). Each sublayer s computes H_pre, H_post and H_res from its own x as in
// V4, but its pre-apply reads the CARRIED mix p_s = H_pre of sublayer s-1, f32 [T, n]:
// layer_in[t, d] = sum_k p_s[t, k] x[t, k, d]; the first sublayer's p_0 is the one-hot on stream 0
// (layer_in = x[:, 0]), and the model ends with the collapse sum_k p_last[t, k] x[t, k, d]. The
// schedule is not a Config field: calling these operations is what selects it (a framework's
// config, e.g. mhc.jax.Config(pre_from_previous=True), picks them). In a stack of sublayers:
//   pre_forward_carried(carried = absent) -> F_1 -> boundary_forward_carried -> F_2 -> ...
//     -> boundary_forward_carried -> F_L -> post_forward -> collapse_forward(carried = h_pre of L)
//   collapse_backward -> post_backward -> F_L' -> boundary_backward_carried -> ... -> F_1'
//     -> pre_backward_carried
// with each backward's dh_pre the dcarried (or dh_pre output) of the operation after it.
//
// An absent carried mix is an empty TensorRef (TensorRef{}: null data and rank 0) or one of shape
// [T, 0]: the one-hot on stream 0, read as a copy of stream 0. A present one is f32 [T, n] (data
// may be null only when T = 0). A backward's dcarried is absent exactly when its carried is.

// x [T, n, D] and carried [T, n] | absent -> the outputs of pre_forward: h_pre, h_post, h_res are
// the sublayer's own coefficients (the same bits as pre_forward; h_pre is the mix to carry on),
// layer_in = sum_k carried[t, k] x[t, k, :].
MHC_API void pre_forward_carried(const Config& config, const TensorRef& x, const TensorRef& carried,
                                 const Params& params, const PreForwardOutputs& outputs);

// pre_backward with the carried mix: dh_pre [T, n] f32 is an input, the cotangent of this
// sublayer's own h_pre (the next sublayer's dcarried, or collapse_backward's), and enters the gate
// backward as given; the pre-apply's cotangent goes to dcarried [T, n] f32,
// dcarried[t, k] = sum_d x[t, k, d] dlayer_in[t, d], and to dx through carried (not h_pre).
MHC_API void pre_backward_carried(const Config& config, const TensorRef& dlayer_in,
                                  const TensorRef& dx_partial, const TensorRef& dh_pre,
                                  const TensorRef& dh_post, const TensorRef& dh_res,
                                  const TensorRef& x, const TensorRef& carried,
                                  const Params& params, const MutableTensorRef& dx,
                                  const MutableTensorRef& dcarried, const ParamGrads& grads);

// The final collapse, no parameters: out[t, d] = sum_k carried[t, k] x[t, k, d], out [T, D] in x's
// dtype (the same sum, and bits, as pre_forward_carried's layer_in). Local in D: with D split
// (config.tensor_parallel > 1) both collapse operations take this slice's tensors, and
// collapse_backward's dcarried is then this slice's partial sum, to be all-reduced by the caller.
MHC_API void collapse_forward(const Config& config, const TensorRef& x, const TensorRef& carried,
                              const MutableTensorRef& out);

// dout [T, D] (x's dtype) -> dx[t, k, d] = carried[t, k] dout[t, d] (x's dtype) and
// dcarried[t, k] = sum_d x[t, k, d] dout[t, d] (f32 [T, n]).
MHC_API void collapse_backward(const Config& config, const TensorRef& dout, const TensorRef& x,
                               const TensorRef& carried, const MutableTensorRef& dx,
                               const MutableTensorRef& dcarried);

// V4.1's boundary, fused as boundary_forward is: x_next = post_forward(x, layer_out, h_post, h_res)
// and next = pre_forward_carried(x_next, carried = h_pre, next_params), where h_pre [T, n] is
// sublayer l's own (its pre_forward_carried's output). Since the carried mix is known before x_next
// exists, each tile of x_next is written once and mixed and projected while in cache. Every output
// has the same bits as the two calls.
MHC_API void boundary_forward_carried(const Config& config, const TensorRef& x,
                                      const TensorRef& layer_out, const TensorRef& h_pre,
                                      const TensorRef& h_post, const TensorRef& h_res,
                                      const Params& next_params, const MutableTensorRef& x_next,
                                      const PreForwardOutputs& next);

// Backward: pre_backward_carried of sublayer l+1 (carried = h_pre, x_next recomputed per tile)
// then post_backward of sublayer l with g = its dx_next, tile by tile: dx_next is never written.
// dh_pre [T, n] f32 (output) is l+1's dcarried: the cotangent of sublayer l's h_pre, to pass as
// the dh_pre of sublayer l's own backward. The same bits as the separate calls.
MHC_API void boundary_backward_carried(
    const Config& config, const TensorRef& next_dlayer_in, const TensorRef& next_dx_partial,
    const TensorRef& next_dh_pre, const TensorRef& next_dh_post, const TensorRef& next_dh_res,
    const TensorRef& x, const TensorRef& layer_out, const TensorRef& h_pre, const TensorRef& h_post,
    const TensorRef& h_res, const Params& next_params, const PostBackwardOutputs& outputs,
    const MutableTensorRef& dh_pre, const ParamGrads& next_grads);

// Tensor parallelism: D split into config.tensor_parallel equal slices, one per device.
//
// Each device holds its slice of every stream, x [T, n, Dl] with Dl = D / tensor_parallel, the
// matching rows of norm_weight [n*Dl] and phi [n*Dl, N] (rows k*D + d for the slice's d, in
// order), and all of alpha and bias. The RMS and the projection sum over all of n*D, so the
// fused pre operations (which require tensor_parallel == 1) are split in two, with a sum of small
// per-token partials across the devices (an all-reduce) in between:
//
//   forward:  pre_forward_partials -> all-reduce [T, N+1] -> pre_forward_finish -> F ->
//             post_forward (local in D as it is)
//   backward: post_backward (its dh_post, dh_res are this slice's partial sums) -> back through
//             F -> pre_backward_partials -> all-reduce dh_pre, dh_post, dh_res ->
//             pre_backward_finish
//
// With one device, pre_forward and pre_backward do the same work in one pass over x.

// partials [T, N+1] f32: [t, c] = sum over the slice of x[t, m] norm_weight[m] phi[m, c] for
// c < N, and [t, N] = sum over the slice of x[t, m]^2 (spec: Forward steps 1-2, before r).
MHC_API void pre_forward_partials(const Config& config, const TensorRef& x,
                                  const TensorRef& norm_weight, const TensorRef& phi,
                                  const MutableTensorRef& partials);

// From the partials summed over all slices: the coefficients (the same on every device) and
// this slice of layer_in [T, Dl] (spec: Forward steps 3-6).
MHC_API void pre_forward_finish(const Config& config, const TensorRef& x, const TensorRef& partials,
                                const TensorRef& alpha, const TensorRef& bias,
                                const PreForwardOutputs& outputs);

// dh_pre [T, n] f32, this slice's part: [t, k] = sum over the slice of x[t, k, d] dlayer_in[t, d].
MHC_API void pre_backward_partials(const Config& config, const TensorRef& dlayer_in,
                                   const TensorRef& x, const MutableTensorRef& dh_pre);

// From dh_pre, dh_post, dh_res summed over all slices and the forward's summed partials (so
// nothing is recomputed across devices): this slice of dx [T, n, Dl], the gradients of this
// slice's rows of norm_weight and phi, and the whole gradients of alpha and bias (every device
// computes the same values; sum them over the token shards only).
MHC_API void pre_backward_finish(const Config& config, const TensorRef& dlayer_in,
                                 const TensorRef& dx_partial, const TensorRef& dh_pre,
                                 const TensorRef& dh_post, const TensorRef& dh_res,
                                 const TensorRef& x, const TensorRef& partials,
                                 const Params& params, const MutableTensorRef& dx,
                                 const ParamGrads& grads);

// The split forms of the V4.1 pre operations (as pre_forward_finish and pre_backward_finish, with
// the carried mix [T, n] | absent as in pre_forward_carried). The forward's first half is
// pre_forward_partials unchanged; in the backward the carried mix's cotangent is this slice's
// partial sum, pre_backward_partials (the same formula), which the caller all-reduces, and dh_pre
// is the cotangent of the sublayer's own h_pre, whole (the next sublayer's summed dcarried).
MHC_API void pre_forward_finish_carried(const Config& config, const TensorRef& x,
                                        const TensorRef& partials, const TensorRef& carried,
                                        const TensorRef& alpha, const TensorRef& bias,
                                        const PreForwardOutputs& outputs);
MHC_API void pre_backward_finish_carried(const Config& config, const TensorRef& dlayer_in,
                                         const TensorRef& dx_partial, const TensorRef& dh_pre,
                                         const TensorRef& dh_post, const TensorRef& dh_res,
                                         const TensorRef& x, const TensorRef& partials,
                                         const TensorRef& carried, const Params& params,
                                         const MutableTensorRef& dx, const ParamGrads& grads);

// Threads used by the operations; values < 1 restore the default (MHC_NUM_THREADS, else the
// number of hardware threads).
MHC_API void set_num_threads(int threads);
MHC_API int num_threads();

}  // namespace mhc
