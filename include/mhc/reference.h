// mhc/reference.h: the float64 reference of the operations, the test oracle and the readable
// definition. Plain loops that mirror docs/math.md line by line; no tiling, no threads, no SIMD.
// Tensors are row-major std::vector<double> with the shapes listed in mhc/ops.h; T is inferred
// from x.size() / (n*D). These functions do not validate; they are for tests and reading.
#pragma once

#include <cstdint>
#include <vector>

#include "mhc/config.h"
#include "mhc/export.h"

namespace mhc::reference {

using Vec = std::vector<double>;

struct Params {
  Vec norm_weight;  // [M]
  Vec phi;          // [M, N]
  Vec alpha;        // [3]
  Vec bias;         // [N]
};

struct PreForward {
  Vec layer_in;  // [T, D]
  Vec h_pre;     // [T, n]
  Vec h_post;    // [T, n]
  Vec h_res;     // [T, n, n]
};
MHC_API PreForward pre_forward(const Config& config, const Vec& x, const Params& params);

MHC_API Vec post_forward(const Config& config, const Vec& x, const Vec& layer_out,
                         const Vec& h_post, const Vec& h_res);

struct PostBackward {
  Vec dx_partial;  // [T, n, D]
  Vec dlayer_out;  // [T, D]
  Vec dh_post;     // [T, n]
  Vec dh_res;      // [T, n, n]
};
MHC_API PostBackward post_backward(const Config& config, const Vec& g, const Vec& x,
                                   const Vec& layer_out, const Vec& h_post, const Vec& h_res);

struct PreBackward {
  Vec dx;  // [T, n, D]
  Params grads;
};
MHC_API PreBackward pre_backward(const Config& config, const Vec& dlayer_in, const Vec& dx_partial,
                                 const Vec& dh_post, const Vec& dh_res, const Vec& x,
                                 const Params& params);

// The boundary between sublayers l and l+1 (spec: Boundary) as the chain of operations the fused
// kernels replace: post_forward, then pre_forward of its result; in the backward pre_backward,
// then post_backward with g = its dx. In float64 throughout: the kernels store x_next and dx_next
// in the activation dtype between the two halves (bf16 tests compare each half against the
// reference on the values it saw).
struct BoundaryForward {
  Vec x_next;  // [T, n, D]
  PreForward next;
};
MHC_API BoundaryForward boundary_forward(const Config& config, const Vec& x, const Vec& layer_out,
                                         const Vec& h_post, const Vec& h_res,
                                         const Params& next_params);

struct BoundaryBackward {
  PostBackward post;  // sublayer l's post gradients
  Params next_grads;  // sublayer l+1's parameter gradients
};
MHC_API BoundaryBackward boundary_backward(const Config& config, const Vec& next_dlayer_in,
                                           const Vec& next_dx_partial, const Vec& next_dh_post,
                                           const Vec& next_dh_res, const Vec& x,
                                           const Vec& layer_out, const Vec& h_post,
                                           const Vec& h_res, const Params& next_params);

// DeepSeek-V4.1's single-pass schedule (spec: Single-pass schedule). `carried` [T, n] is the mix
// the pre-apply reads (the previous sublayer's H_pre); an empty Vec is the one-hot on stream 0.
// pre_forward_carried: h_pre, h_post, h_res as pre_forward (the sublayer's own gates, h_pre to be
// carried on), layer_in = sum_k carried[k] x_k.
MHC_API PreForward pre_forward_carried(const Config& config, const Vec& x, const Vec& carried,
                                       const Params& params);

// dh_pre [T, n] is an input (the cotangent of this sublayer's H_pre, from the next sublayer or the
// final collapse); dcarried [T, n] = <x_k, dlayer_in> per token (empty when carried is).
struct PreBackwardCarried {
  Vec dx;        // [T, n, D]
  Vec dcarried;  // [T, n]
  Params grads;
};
MHC_API PreBackwardCarried pre_backward_carried(const Config& config, const Vec& dlayer_in,
                                                const Vec& dx_partial, const Vec& dh_pre,
                                                const Vec& dh_post, const Vec& dh_res, const Vec& x,
                                                const Vec& carried, const Params& params);

// The final collapse: out[t, d] = sum_k carried[t, k] x[t, k, d], [T, D]; and its backward.
MHC_API Vec collapse_forward(const Config& config, const Vec& x, const Vec& carried);
struct CollapseBackward {
  Vec dx;        // [T, n, D]
  Vec dcarried;  // [T, n] (empty when carried is)
};
MHC_API CollapseBackward collapse_backward(const Config& config, const Vec& dout, const Vec& x,
                                           const Vec& carried);

// V4.1's boundary: post_forward, then pre_forward_carried of its result with carried = h_pre (the
// H_pre of sublayer l); in the backward pre_backward_carried, then post_backward with g = its dx.
// dh_pre is the cotangent of sublayer l's h_pre (dcarried of l+1).
MHC_API BoundaryForward boundary_forward_carried(const Config& config, const Vec& x,
                                                 const Vec& layer_out, const Vec& h_pre,
                                                 const Vec& h_post, const Vec& h_res,
                                                 const Params& next_params);
struct BoundaryBackwardCarried {
  PostBackward post;  // sublayer l's post gradients
  Vec dh_pre;         // [T, n]
  Params next_grads;  // sublayer l+1's parameter gradients
};
MHC_API BoundaryBackwardCarried boundary_backward_carried(
    const Config& config, const Vec& next_dlayer_in, const Vec& next_dx_partial,
    const Vec& next_dh_pre, const Vec& next_dh_post, const Vec& next_dh_res, const Vec& x,
    const Vec& layer_out, const Vec& h_pre, const Vec& h_post, const Vec& h_res,
    const Params& next_params);

// DeepSeek-V4's head (spec: Head). fn [n, M], base [n], scale [1].
struct HeadParams {
  Vec fn;
  Vec base;
  Vec scale;
};
struct HeadForward {
  Vec out;    // [T, D]
  Vec gates;  // [T, n]
};
MHC_API HeadForward head_forward(const Config& config, const Vec& x, const HeadParams& params);

struct HeadBackward {
  Vec dx;  // [T, n, D]
  HeadParams grads;
};
MHC_API HeadBackward head_backward(const Config& config, const Vec& dout, const Vec& x,
                                   const HeadParams& params);

// Rounding noise for the tests' condition estimate (tests/cpp/test_util.h, expect_matches). While
// one is alive on the calling thread, every function above multiplies each intermediate that the
// kernels round to f32 and then reuse by (1 + u), u uniform in [-unit, unit], drawn from `seed`:
// per token the RMS factor r, the projection P, the logits a, the coefficients H_pre, H_post,
// H_res and, in the backward, the gradients of a, P and r and the dx through the projection (the
// head: r, p, a, the sigmoids and the gradients of a, p and r); the boundary's x_next. Moving the
// inputs alone cannot show an error that comes from rounding these where a later sum cancels:
// the RMS backward's dx is two terms that both carry r and P (with one value per token they
// cancel to rms_eps r^2 of either), layer_in of one feature is n terms h_pre_k x_k, and the
// kernels sum dnorm_weight over tokens per column of P before the columns cancel. Not for use
// across threads; scopes do not nest.
class MHC_API RoundingNoise {
 public:
  RoundingNoise(uint64_t seed, double unit);
  ~RoundingNoise();
  RoundingNoise(const RoundingNoise&) = delete;
  RoundingNoise& operator=(const RoundingNoise&) = delete;
};

// H_res of one token from its R residual logits (spec: Forward step 5).
MHC_API Vec mix_matrix(const Config& config, const double* residual_logits);

}  // namespace mhc::reference
