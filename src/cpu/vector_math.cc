#include "vector_math.h"

#include <algorithm>
#include <cstring>

#include "simd.h"

namespace mhc::cpu {

namespace {
using simd::kLanes;

// Fixed-order combination of the lane partial sums and the scalar tail.
inline double combine_wide(const double* lanes, double tail) {
  const double low = (lanes[0] + lanes[4]) + (lanes[2] + lanes[6]);
  const double high = (lanes[1] + lanes[5]) + (lanes[3] + lanes[7]);
  return (low + high) + tail;
}

}  // namespace

MHC_CLONES void widen(const bf16* src, float* dst, int64_t count) {
  for (int64_t k = 0; k < count; ++k) {
    const uint32_t word = static_cast<uint32_t>(src[k].bits) << 16;
    std::memcpy(dst + k, &word, sizeof(float));
  }
}

MHC_CLONES void narrow(const float* src, bf16* dst, int64_t count) {
  for (int64_t k = 0; k < count; ++k) dst[k] = to_bf16(src[k]);
}

MHC_CLONES double dot(const float* a, const float* b, int64_t count) {
  double lanes[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= count; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += static_cast<double>(a[k + l]) * b[k + l];
  }
  double tail = 0.0;
  for (; k < count; ++k) tail += static_cast<double>(a[k]) * b[k];
  return combine_wide(lanes, tail);
}

MHC_CLONES double sum_squares(const float* x, int64_t count) {
  double lanes[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= count; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += static_cast<double>(x[k + l]) * x[k + l];
  }
  double tail = 0.0;
  for (; k < count; ++k) tail += static_cast<double>(x[k]) * x[k];
  return combine_wide(lanes, tail);
}

MHC_CLONES void weighted_rows(const float* rows, int64_t count, const float* weights, int64_t D,
                              float* out) {
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    simd::Lanes8 acc{};
    for (int64_t r = 0; r < count; ++r) {
      simd::Lanes8 row;
      simd::load(&row, rows + r * D + d);
      acc += weights[r] * row;
    }
    simd::store(out + d, &acc);
  }
  for (; d < D; ++d) {
    float acc = 0.0f;
    for (int64_t r = 0; r < count; ++r) acc += weights[r] * rows[r * D + d];
    out[d] = acc;
  }
}

MHC_CLONES void axpy(float a, const float* x, float* y, int64_t count) {
  for (int64_t k = 0; k < count; ++k) y[k] += a * x[k];
}

}  // namespace mhc::cpu
