// The one finish of pre_backward's weight gradient (projection.h: finish_weight_block).
//
// Compiled with -ffp-contract=off (CMakeLists.txt): each product phi * total is rounded to double
// before it is added. The chunked reduction's totals are sums of several chunks, not products of
// two floats, so an FMA would keep the product unrounded and change the bits; this way the
// single-tile path (f32 sums widened to double, whose products with phi are exact either way) and
// the chunked path run the same code.
#include <algorithm>

#include "projection.h"
#include "simd.h"

namespace mhc::cpu {

using simd::kLanes;
using simd::Lanes8;
using simd::Wide8;

namespace {

// Eight totals from p as double lanes: loaded, or widened exactly from f32.
MHC_INLINE void load_totals(Wide8* v, const double* p) { simd::load(v, p); }
MHC_INLINE void load_totals(Wide8* v, const float* p) {
  Lanes8 narrow;
  simd::load(&narrow, p);
  simd::widen(&narrow, v);
}

template <class Total>
MHC_INLINE void finish_any(const Total* total, int64_t width, int64_t N, int64_t m0,
                           const float* norm_weight, const float* phi, float* dphi,
                           float* dnorm_weight) {
  int64_t j = 0;
  if (N >= kLanes) {
    // 8 rows at a time, one per lane: blocks of 8 columns c of phi transposed in registers, so each
    // row's dnorm_weight sum runs over c in order in its lane, and dphi, computed along the rows,
    // is transposed back to be stored along c.
    for (; j + kLanes <= width; j += kLanes) {
      const int64_t m = m0 + j;
      Lanes8 scale8;
      simd::load(&scale8, norm_weight + m);
      Wide8 scale;
      simd::widen(&scale8, &scale);
      Wide8 through = {};
      for (int64_t c0 = 0; c0 < N; c0 += kLanes) {
        const int64_t start = std::min(c0, N - kLanes);
        Lanes8 phis[8], g[8];
        for (int64_t i = 0; i < 8; ++i) simd::load(&phis[i], phi + (m + i) * N + start);
        simd::transpose8(phis);  // phis[k] = column start + k of the 8 rows
        for (int64_t k = 0; k < 8; ++k) {
          Wide8 totals;
          load_totals(&totals, total + (start + k) * width + j);
          // Columns before c0 belong to the block before (the last block overlaps it); their
          // dphi is recomputed to the same values.
          if (k >= c0 - start) {
            Wide8 phi_k;
            simd::widen(&phis[k], &phi_k);
            through += phi_k * totals;
          }
          const Wide8 product = totals * scale;
          g[k] = __builtin_convertvector(product, Lanes8);
        }
        simd::transpose8(g);  // g[i] = row m + i, columns start..start+8
        for (int64_t i = 0; i < 8; ++i) simd::store(dphi + (m + i) * N + start, &g[i]);
      }
      for (int64_t i = 0; i < 8; ++i) dnorm_weight[m + i] = static_cast<float>(through[i]);
    }
  }
  for (; j < width; ++j) {
    const int64_t m = m0 + j;
    double through = 0.0;
    for (int64_t c = 0; c < N; ++c) {
      const double g = static_cast<double>(total[c * width + j]);
      dphi[m * N + c] = static_cast<float>(norm_weight[m] * g);
      through += phi[m * N + c] * g;
    }
    dnorm_weight[m] = static_cast<float>(through);
  }
}

}  // namespace

MHC_CLONES void finish_weight_block(const double* total, int64_t width, int64_t N, int64_t m0,
                                    const float* norm_weight, const float* phi, float* dphi,
                                    float* dnorm_weight) {
  finish_any(total, width, N, m0, norm_weight, phi, dphi, dnorm_weight);
}

MHC_CLONES void finish_weight_block(const float* total, int64_t width, int64_t N, int64_t m0,
                                    const float* norm_weight, const float* phi, float* dphi,
                                    float* dnorm_weight) {
  finish_any(total, width, N, m0, norm_weight, phi, dphi, dnorm_weight);
}

}  // namespace mhc::cpu
