#include "vector_math.h"

#include <algorithm>
#include <cstring>

#include "simd.h"

namespace mhc::cpu {

namespace {
using simd::kLanes;
using simd::Wide8;
}  // namespace

MHC_CLONES void widen(const bf16* src, float* dst, int64_t count) {
  int64_t k = 0;
  for (; k + kLanes <= count; k += kLanes) {
    simd::Lanes8 v;
    simd::load_bf16(&v, src + k);
    simd::store(dst + k, &v);
  }
  for (; k < count; ++k) {
    const uint32_t word = static_cast<uint32_t>(src[k].bits) << 16;
    std::memcpy(dst + k, &word, sizeof(float));
  }
}

MHC_CLONES void narrow(const float* src, bf16* dst, int64_t count) {
  int64_t k = 0;
  for (; k + kLanes <= count; k += kLanes) {
    simd::Lanes8 v;
    simd::load(&v, src + k);
    simd::store_bf16(dst + k, &v);
  }
  for (; k < count; ++k) dst[k] = to_bf16(src[k]);
}

// Lane l sums the elements k = l mod 8; the lanes are combined in simd::sum8's fixed order, then
// the scalar tail is added.
MHC_CLONES double dot(const float* a, const float* b, int64_t count) {
  Wide8 lanes = {};
  int64_t k = 0;
  for (; k + kLanes <= count; k += kLanes) {
    simd::Lanes8 va, vb;
    simd::load(&va, a + k);
    simd::load(&vb, b + k);
    lanes += __builtin_convertvector(va, Wide8) * __builtin_convertvector(vb, Wide8);
  }
  double tail = 0.0;
  for (; k < count; ++k) tail += static_cast<double>(a[k]) * b[k];
  return simd::sum8(&lanes) + tail;
}

namespace {

inline float scalar(float v) { return v; }
inline float scalar(bf16 v) { return to_float(v); }
inline void put(float* p, float v) { *p = v; }
inline void put(bf16* p, float v) { *p = to_bf16(v); }

// weighted_rows for either activation type: f32 FMAs in the same order, the result rounded to X
// once when stored (so a bf16 call gives the bits of the f32 call followed by narrow()).
// The last D % 8 features go through the same vector arithmetic, zero-padded: a scalar tail loop
// was contracted into FMAs differently in the two instances, so the bf16 call's last features
// (D = 130) missed the f32 call's bits by one f32 ulp for some inputs, and V4.1's collapse then
// missed pre_forward_carried's layer_in (carried_test's bitwise check, 1 seed in ~300).
template <class X>
MHC_INLINE void weighted_rows_any(const X* rows, int64_t count, const float* weights, int64_t D,
                                  X* out) {
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    simd::Lanes8 acc{};
    for (int64_t r = 0; r < count; ++r) {
      simd::Lanes8 row;
      simd::load_any(&row, rows + r * D + d);
      acc += weights[r] * row;
    }
    simd::store_any(out + d, &acc);
  }
  if (d == D) return;
  const int64_t rest = D - d;
  simd::Lanes8 acc{};
  for (int64_t r = 0; r < count; ++r) {
    float padded[kLanes] = {};
    for (int64_t j = 0; j < rest; ++j) padded[j] = scalar(rows[r * D + d + j]);
    simd::Lanes8 row;
    simd::load(&row, padded);
    acc += weights[r] * row;
  }
  float sums[kLanes];
  simd::store(sums, &acc);
  for (int64_t j = 0; j < rest; ++j) put(out + d + j, sums[j]);
}

}  // namespace

MHC_CLONES void weighted_rows(const float* rows, int64_t count, const float* weights, int64_t D,
                              float* out) {
  weighted_rows_any(rows, count, weights, D, out);
}

MHC_CLONES void weighted_rows(const bf16* rows, int64_t count, const float* weights, int64_t D,
                              bf16* out) {
  weighted_rows_any(rows, count, weights, D, out);
}

namespace {

// dx_terms for either type of dx_partial (null: none, the head), 8 lanes at a time (bf16 widened
// in the loads), then the scalar tail: the same contracted FMAs in the same order either way.
template <class X>
MHC_INLINE void dx_terms_any(const X* partial, float h_pre, const float* dli, float rms_term,
                             const float* x, float* out, int64_t count) {
  const float minus_rms = -rms_term;
  int64_t k = 0;
  for (; k + kLanes <= count; k += kLanes) {
    simd::Lanes8 start{}, xv, v;
    if (partial != nullptr) simd::load_any(&start, partial + k);
    simd::load(&xv, x + k);
    if (dli != nullptr) {
      simd::Lanes8 d;
      simd::load(&d, dli + k);
      v = (start + h_pre * d) + minus_rms * xv;
    } else {
      v = start + minus_rms * xv;
    }
    simd::store(out + k, &v);
  }
  for (; k < count; ++k) {
    const float start = partial != nullptr ? scalar(partial[k]) : 0.0f;
    out[k] =
        dli != nullptr ? (start + h_pre * dli[k]) + minus_rms * x[k] : start + minus_rms * x[k];
  }
}

}  // namespace

MHC_CLONES void dx_terms(const float* partial, float h_pre, const float* dli, float rms_term,
                         const float* x, float* out, int64_t count) {
  dx_terms_any(partial, h_pre, dli, rms_term, x, out, count);
}

MHC_CLONES void dx_terms(const bf16* partial, float h_pre, const float* dli, float rms_term,
                         const float* x, float* out, int64_t count) {
  dx_terms_any(partial, h_pre, dli, rms_term, x, out, count);
}

MHC_CLONES void axpy(float a, const float* x, float* y, int64_t count) {
  for (int64_t k = 0; k < count; ++k) y[k] += a * x[k];
}

}  // namespace mhc::cpu
