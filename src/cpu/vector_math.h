// The inner loops of the CPU kernels, on f32 arrays. Each function is compiled twice (x86-64-v3
// with AVX2 and FMA, and baseline x86-64) and the loader picks the clone the CPU supports.
//
// Every reduction keeps kLanes independent partial sums and combines them in a fixed order, so
// its result depends on the length only, never on blocking or threads (and the loops vectorize).
#pragma once

#include <cstdint>

#include "mhc/tensor.h"

namespace mhc::cpu {

void widen(const bf16* src, float* dst, int64_t count);
void narrow(const float* src, bf16* dst, int64_t count);

// Accumulate in double and return double: dot products feed dh_pre, dh_post and dh_res, whose
// per-token sums of signed terms can cancel far below the size of the terms, and the sum of
// squares sets r, which scales every logit of the token (f32 lanes left ~eps*sqrt(M/8) in r, and
// dalpha, a cancelling sum over tokens of da*Z, magnified it past 1e-5).
double dot(const float* a, const float* b, int64_t count);
double sum_squares(const float* x, int64_t count);
void axpy(float a, const float* x, float* y, int64_t count);  // y += a*x

// out[d] = first_weight * first[d] + sum_r weights[r * weight_stride] * rows[r * D + d], summed in
// double and rounded once (first may be null). These are the few-term mixes over streams; a
// short sum of signed terms can cancel, and double keeps even a single element within 1 ulp.
void weighted_rows(const float* first, float first_weight, const float* rows, int64_t count,
                   const float* weights, int64_t weight_stride, int64_t D, float* out);

// P[t*N + c] = sum_m x[t*M + m] * wt[c*M + m] for t < tokens, c < N (wt is the [N, M] weight).
void project(const float* x, int64_t tokens, int64_t M, const float* wt, int64_t N, float* P);

// G[c*M + m] += sum_t dP[t*N + c] * x[t*M + m], tokens summed in order, in double: a parameter
// gradient sums T signed terms, and any f32 rounding of them (of dP, or of partial sums) leaves
// ~1e-5 relative error when the sum cancels. Costs about a third more time in pre_backward.
void accumulate_weight_grad(const float* x, const double* dP, int64_t tokens, int64_t M, int64_t N,
                            double* G);

// dx[t*M + m] += sum_c dP[t*N + c] * wt[c*M + m], columns summed in order.
void add_projection_grad(const float* dP, const float* wt, int64_t tokens, int64_t M, int64_t N,
                         float* dx);

}  // namespace mhc::cpu
