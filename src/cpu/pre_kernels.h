// The pre kernels' entry points: pre_forward's and pre_backward's token-tile loops, shared by the
// operations and their split forms (pre_forward.cc, pre_backward.cc), the fused boundary
// (boundary.cc) and the head (head.cc). What differs between those callers is said by three
// things only: the tile source (tile_source.h), whether P and the sum of squares are computed or
// supplied (the split forms), and dims.pre_gates_only (the head). Instantiated for X = float and
// X = bf16.
#pragma once

#include "../core/validate.h"
#include "kernels.h"
#include "mhc/ops.h"
#include "tile_source.h"

namespace mhc::cpu {

// The parameters as the kernels read them. norm_weight and phi are unused (may be null) when the
// projection is supplied.
struct PreWeights {
  const float* norm_weight;  // [M]
  const float* phi;          // [M, N]
  const float* alpha;        // [3]
  const float* bias;         // [N]
};
PreWeights pre_weights(const Params& params);

// Their gradients, [M], [M, N], [3], [N].
struct PreGrads {
  float* norm_weight;
  float* phi;
  float* alpha;
  float* bias;
};
PreGrads pre_grads(const ParamGrads& grads);

// What the split forms supply instead of computing it from this slice of x: the all-reduced
// partials [T, N+1] (P and the sum of squares) and, for the backward, dh_pre [T, n]. Null in the
// fused forms. With a carried mix (V4.1) dh_pre is always supplied (the cotangent of the
// sublayer's own h_pre comes from the next sublayer), the pre-apply reads `mix`, and its
// cotangent <x_k, dlayer_in> goes to dcarried [T, n] (null in the split form, whose caller sums
// pre_backward_partials instead).
struct Supplied {
  const float* partials = nullptr;
  const float* dh_pre = nullptr;
  PreApplyMix mix{};
  float* dcarried = nullptr;
};

// The pre forward's outputs: layer_in [T, D], h_pre [T, n], h_post [T, n], h_res [T, n, n]
// (h_post and h_res unused for the head).
template <class X>
struct PreForwardOut {
  X* layer_in;
  float* h_pre;
  float* h_post;
  float* h_res;
};

template <class X>
void pre_forward_tiles(const Config& config, const detail::Dims& dims, const PreWeights& weights,
                       const float* supplied_partials, TileSource<X>& source,
                       const PreForwardOut<X>& out, const PreApplyMix& mix = {});

// The gradients the post operation of the same sublayer adds to the pre backward: dx_partial
// [T, n, D], dh_post [T, n], dh_res [T, n, n]. Unused (null) for the head, which has no post:
// dims.pre_gates_only is the one signal of that.
template <class X>
struct PostGradients {
  const X* dx_partial = nullptr;
  const float* dh_post = nullptr;
  const float* dh_res = nullptr;
};

template <class X>
void pre_backward_tiles(const Config& config, const detail::Dims& dims, const PreWeights& weights,
                        const X* dlayer_in, const PostGradients<X>& post, Supplied supplied,
                        TileSource<X>& source, const PreGrads& grads);

}  // namespace mhc::cpu
