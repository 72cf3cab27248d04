#include "vector_math.h"

#include <algorithm>
#include <cstring>

#define MHC_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))

namespace mhc::cpu {

namespace {
constexpr int kLanes = 8;     // one AVX2 register of f32
constexpr int64_t kBlock = 64;  // columns of M kept in L1 while the small dimension is swept

// Fixed-order combination of the lane partial sums and the scalar tail.
inline double combine_wide(const double* lanes, double tail) {
  const double low = (lanes[0] + lanes[4]) + (lanes[2] + lanes[6]);
  const double high = (lanes[1] + lanes[5]) + (lanes[3] + lanes[7]);
  return (low + high) + tail;
}

// TB tokens x CB columns of project() sharing their loads; every (t, c) sees the same
// arithmetic as in the 1 x 1 case, so blocking never changes a result.
//
// Blocked summation: f32 lanes sum kSumBlock elements, then fold into double lanes. The error of
// a length-M dot drops from about eps*sqrt(M/8) to eps*sqrt(kSumBlock/8) relative, which matters
// because the logits feed sums whose terms cancel (dalpha, softmax rows); the fold costs a few
// percent of the FMAs.
// Eight f32 lanes as one value (GCC/Clang vector extension): one AVX register in the x86-64-v3
// clone, two SSE registers in the baseline one.
typedef float Lanes8 __attribute__((vector_size(32)));
// By pointer: passing vector values by value would change the ABI between the two clones.
inline void load_lanes(Lanes8* v, const float* p) { std::memcpy(v, p, sizeof(*v)); }

template <int TB, int CB>
inline void project_block(const float* x, int64_t M, const float* wt, float* P, int64_t N) {
  constexpr int64_t kSumBlock = 256;
  double total[TB][CB][kLanes] = {};
  int64_t m = 0;
  while (m + kLanes <= M) {
    Lanes8 acc[TB][CB] = {};
    const int64_t block_end = std::min(M, m + kSumBlock);
    for (; m + kLanes <= block_end; m += kLanes) {
      Lanes8 xv[TB];
      for (int t = 0; t < TB; ++t) load_lanes(&xv[t], x + t * M + m);
      for (int c = 0; c < CB; ++c) {
        Lanes8 w;
        load_lanes(&w, wt + c * M + m);
        for (int t = 0; t < TB; ++t) acc[t][c] += xv[t] * w;
      }
    }
    for (int t = 0; t < TB; ++t) {
      for (int c = 0; c < CB; ++c) {
        for (int l = 0; l < kLanes; ++l) total[t][c][l] += acc[t][c][l];
      }
    }
  }
  for (int t = 0; t < TB; ++t) {
    for (int c = 0; c < CB; ++c) {
      double tail = 0.0;
      for (int64_t k = m; k < M; ++k) tail += static_cast<double>(x[t * M + k]) * wt[c * M + k];
      P[t * N + c] = static_cast<float>(combine_wide(total[t][c], tail));
    }
  }
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

MHC_CLONES void weighted_rows(const float* first, float first_weight, const float* rows,
                              int64_t count, const float* weights, int64_t weight_stride,
                              int64_t D, float* out) {
  constexpr int64_t kChunk = 512;
  double acc[kChunk];
  for (int64_t d0 = 0; d0 < D; d0 += kChunk) {
    const int64_t len = std::min(kChunk, D - d0);
    if (first != nullptr) {
      const double w = first_weight;
      for (int64_t k = 0; k < len; ++k) acc[k] = w * first[d0 + k];
    } else {
      for (int64_t k = 0; k < len; ++k) acc[k] = 0.0;
    }
    for (int64_t r = 0; r < count; ++r) {
      const double w = weights[r * weight_stride];
      const float* row = rows + r * D + d0;
      for (int64_t k = 0; k < len; ++k) acc[k] += w * row[k];
    }
    for (int64_t k = 0; k < len; ++k) out[d0 + k] = static_cast<float>(acc[k]);
  }
}

MHC_CLONES void axpy(float a, const float* x, float* y, int64_t count) {
  for (int64_t k = 0; k < count; ++k) y[k] += a * x[k];
}

MHC_CLONES void project(const float* x, int64_t tokens, int64_t M, const float* wt, int64_t N,
                        float* P) {
  int64_t t = 0;
  for (; t + 2 <= tokens; t += 2) {
    int64_t c = 0;
    for (; c + 4 <= N; c += 4) project_block<2, 4>(x + t * M, M, wt + c * M, P + t * N + c, N);
    for (; c < N; ++c) project_block<2, 1>(x + t * M, M, wt + c * M, P + t * N + c, N);
  }
  for (; t < tokens; ++t) {
    int64_t c = 0;
    for (; c + 4 <= N; c += 4) project_block<1, 4>(x + t * M, M, wt + c * M, P + t * N + c, N);
    for (; c < N; ++c) project_block<1, 1>(x + t * M, M, wt + c * M, P + t * N + c, N);
  }
}

MHC_CLONES void accumulate_weight_grad(const float* x, const double* dP, int64_t tokens, int64_t M,
                                       int64_t N, double* G) {
  double acc[kBlock];
  for (int64_t m0 = 0; m0 < M; m0 += kBlock) {
    const int64_t len = std::min(kBlock, M - m0);
    for (int64_t c = 0; c < N; ++c) {
      double* g = G + c * M + m0;
      for (int64_t k = 0; k < len; ++k) acc[k] = g[k];
      for (int64_t t = 0; t < tokens; ++t) {
        const double weight = dP[t * N + c];
        const float* xt = x + t * M + m0;
        for (int64_t k = 0; k < len; ++k) acc[k] += weight * xt[k];
      }
      for (int64_t k = 0; k < len; ++k) g[k] = acc[k];
    }
  }
}

MHC_CLONES void add_projection_grad(const float* dP, const float* wt, int64_t tokens, int64_t M,
                                    int64_t N, float* dx) {
  float acc[kBlock];
  for (int64_t m0 = 0; m0 < M; m0 += kBlock) {
    const int64_t len = std::min(kBlock, M - m0);
    for (int64_t t = 0; t < tokens; ++t) {
      float* out = dx + t * M + m0;
      for (int64_t k = 0; k < len; ++k) acc[k] = out[k];
      for (int64_t c = 0; c < N; ++c) {
        const float weight = dP[t * N + c];
        const float* w = wt + c * M + m0;
        for (int64_t k = 0; k < len; ++k) acc[k] += weight * w[k];
      }
      for (int64_t k = 0; k < len; ++k) out[k] = acc[k];
    }
  }
}

}  // namespace mhc::cpu
