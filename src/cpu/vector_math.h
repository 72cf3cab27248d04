// The inner loops of the CPU kernels, on f32 arrays. Each function is compiled for x86-64-v4
// (AVX-512), x86-64-v3 (AVX2 + FMA) and baseline x86-64, and the loader picks the clone the CPU
// supports (simd.h).
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
// per-token sums of signed terms can cancel far below the size of the terms. (The sum of squares,
// which sets r, is taken in the projection's sweep: f32 per block of 128 rows, the blocks added in
// double, projection.h; f32 lanes over the whole row left ~eps*sqrt(M/8) in r, which dalpha, a
// cancelling sum over tokens of da*Z, magnified past 1e-5.)
double dot(const float* a, const float* b, int64_t count);
void axpy(float a, const float* x, float* y, int64_t count);  // y += a*x

// The pre backward's per-element terms of dx in one pass: out[k] = (partial[k] + h_pre * dli[k])
// + -rms_term * x[k] (partial null: 0; dli null: no h_pre term, for a stream the pre-apply does
// not read), contracted into FMAs as the axpy()s they replace were, so the bits are those of
// copying partial, then axpy(h_pre, dli), then axpy(-rms_term, x).
void dx_terms(const float* partial, float h_pre, const float* dli, float rms_term, const float* x,
              float* out, int64_t count);
void dx_terms(const bf16* partial, float h_pre, const float* dli, float rms_term, const float* x,
              float* out, int64_t count);

// out[d] = sum_r weights[r] * rows[r * D + d]: the pre-apply, a mix of at most 16 streams, in f32
// FMA (a few ulps, inside the spec's bounds). The bf16 form reads bf16 rows and rounds each out[d]
// to bf16 once: the bits of the f32 form on the widened rows followed by narrow().
void weighted_rows(const float* rows, int64_t count, const float* weights, int64_t D, float* out);
void weighted_rows(const bf16* rows, int64_t count, const float* weights, int64_t D, bf16* out);

}  // namespace mhc::cpu
