// Micro-kernels of projection.h. Vectors run along the dimension each product keeps in
// registers: N for the projection (a row of W is three 8-lane vectors for N = 24), M for the two
// gradients; the other operand is broadcast.
#include "projection.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "simd.h"
#include "vector_math.h"

namespace mhc::cpu {

namespace {

using simd::kLanes;
using simd::Lanes16;
using simd::Lanes8;
using simd::load;
using simd::store;
using simd::transpose8;

// Whether the kernels fold W in registers rather than into a block buffer: with few tokens the
// fold, done once per block, would cost more than the products; a row of phi narrower than one
// vector always goes through the buffer. Either way gives the same numbers.
inline bool fold_in_registers(int64_t tokens, int64_t N) { return tokens < 8 && N >= kLanes; }

// Columns of x per packed block of the weight gradient: the tile's rows of x are M apart, and
// packing [tokens, 64] contiguously keeps the register blocks' loads in L1.
constexpr int64_t kPackColumns = kWeightGradBlock;
constexpr int64_t kLanes16 = 16;

// Every register-blocked kernel below is one template over the vector type V: simd::Lanes8 in the
// target_clones functions (8 lanes: AVX2 in the v3 clone, SSE pairs in the baseline one) and
// simd::Lanes16 in the target("avx512f") entry points. Vectors of either width run the same
// element-wise FMAs in the same order, so the two widths give the same bits.
template <class V>
inline constexpr int64_t kWidth = static_cast<int64_t>(sizeof(V) / sizeof(float));

// TB tokens x CB vectors of columns from col of one block's sums over its rows [0, rows) of the
// folded block W (row stride NP): acc[t][j] = sum_m x[t, m] * W[m, cols], stored as f32.
template <class V, int TB, int CB>
MHC_INLINE void project_block(const float* x, int64_t M, const float* W, int64_t NP, int64_t rows,
                              int64_t col, float* sums) {
  constexpr int64_t L = kWidth<V>;
  V acc[TB][CB] = {};
  for (int64_t m = 0; m < rows; ++m) {
    V w[CB];
    for (int64_t j = 0; j < CB; ++j) load(&w[j], W + m * NP + col + j * L);
    for (int64_t t = 0; t < TB; ++t) {
      const float xv = x[t * M + m];
      for (int64_t j = 0; j < CB; ++j) acc[t][j] += xv * w[j];
    }
  }
  for (int64_t t = 0; t < TB; ++t) {
    for (int64_t j = 0; j < CB; ++j) store(sums + t * NP + col + j * L, &acc[t][j]);
  }
}

// The same sums with W folded in registers from phi (row stride N) instead of from a folded
// block: the product norm_weight[m] * phi[m, c] is the same f32 value either way. Column vector j
// of V starts at starts[j], and with kTail an 8-lane vector follows at starts[CB]; a last vector
// that would pass N starts earlier, and recomputes its overlap with the one before to the same
// values (every column is the same FMAs in the same order, whatever vector it falls in).
template <class V, int TB, int CB, bool kTail>
MHC_INLINE void project_block_direct(const float* x, int64_t M, const float* norm_weight,
                                     const float* phi, int64_t N, int64_t NP, int64_t rows,
                                     const int64_t* starts, float* sums) {
  constexpr int kVectors = std::max(CB, 1);  // no zero-length arrays; unused when CB = 0
  V acc[TB][kVectors] = {};
  Lanes8 tail[TB] = {};
  for (int64_t m = 0; m < rows; ++m) {
    const float scale = norm_weight[m];
    V w[kVectors];
    for (int64_t j = 0; j < CB; ++j) {
      load(&w[j], phi + m * N + starts[j]);
      w[j] *= scale;
    }
    Lanes8 w_tail{};
    if constexpr (kTail) {
      load(&w_tail, phi + m * N + starts[CB]);
      w_tail *= scale;
    }
    for (int64_t t = 0; t < TB; ++t) {
      const float xv = x[t * M + m];
      for (int64_t j = 0; j < CB; ++j) acc[t][j] += xv * w[j];
      if constexpr (kTail) tail[t] += xv * w_tail;
    }
  }
  for (int64_t t = 0; t < TB; ++t) {
    for (int64_t j = 0; j < CB; ++j) store(sums + t * NP + starts[j], &acc[t][j]);
    if constexpr (kTail) store(sums + t * NP + starts[CB], &tail[t]);
  }
}

// Vectors of columns per register block of the projection: 3 x 8 lanes (N = 24 for n = 4) or
// 2 x 16.
template <class V>
inline constexpr int kProjectionVectors = kWidth<V> == 8 ? 3 : 2;

// The register blocks of columns: kProjectionVectors<V> vectors at a time. With 16 lanes a last
// block of at most 24 columns ends in an 8-lane vector (16 + 8, or 8 alone), not in a second
// 16-lane one: N = 24 (n = 4) takes a quarter fewer lanes, and on CPUs that run a 16-lane FMA as
// two 8-lane halves (AMD Zen 4) a quarter less time; elsewhere it is the same count of FMAs.
template <class V, int TB>
MHC_INLINE void project_tokens_direct(const float* x, int64_t M, const float* norm_weight,
                                      const float* phi, int64_t N, int64_t NP, int64_t rows,
                                      float* sums) {
  constexpr int64_t L = kWidth<V>;
  constexpr int kVectors = kProjectionVectors<V>;
  int64_t starts[kVectors];
  for (int64_t col = 0; col < N; col += kVectors * L) {
    const int64_t rest = N - col;
    if constexpr (L > kLanes) {
      if (rest <= kLanes) {
        starts[0] = N - kLanes;
        project_block_direct<V, TB, 0, true>(x, M, norm_weight, phi, N, NP, rows, starts, sums);
        continue;
      }
      if (rest > L && rest <= L + kLanes) {
        starts[0] = col;
        starts[1] = N - kLanes;
        project_block_direct<V, TB, 1, true>(x, M, norm_weight, phi, N, NP, rows, starts, sums);
        continue;
      }
    }
    int64_t count = 0;
    for (; count < kVectors && col + count * L < N; ++count) {
      starts[count] = std::min(col + count * L, N - L);
    }
    if constexpr (kVectors == 3) {
      if (count == 3) {
        project_block_direct<V, TB, 3, false>(x, M, norm_weight, phi, N, NP, rows, starts, sums);
      }
    }
    if (count == 2)
      project_block_direct<V, TB, 2, false>(x, M, norm_weight, phi, N, NP, rows, starts, sums);
    if (count == 1)
      project_block_direct<V, TB, 1, false>(x, M, norm_weight, phi, N, NP, rows, starts, sums);
  }
}

// Every token of one block of rows, W folded in registers: kMaxTokens tokens at a time, then 4,
// then the rest.
template <class V, int kMaxTokens>
MHC_INLINE void project_rows_direct(const float* x, int64_t tokens, int64_t M,
                                    const float* norm_weight, const float* phi, int64_t N,
                                    int64_t NP, int64_t rows, float* out) {
  int64_t t = 0;
  if constexpr (kMaxTokens == 8) {
    for (; t + 8 <= tokens; t += 8) {
      project_tokens_direct<V, 8>(x + t * M, M, norm_weight, phi, N, NP, rows, out + t * NP);
    }
  }
  for (; t + 4 <= tokens; t += 4) {
    project_tokens_direct<V, 4>(x + t * M, M, norm_weight, phi, N, NP, rows, out + t * NP);
  }
  const int64_t rest = tokens - t;
  const float* xt = x + t * M;
  float* sums = out + t * NP;
  if (rest == 3) project_tokens_direct<V, 3>(xt, M, norm_weight, phi, N, NP, rows, sums);
  if (rest == 2) project_tokens_direct<V, 2>(xt, M, norm_weight, phi, N, NP, rows, sums);
  if (rest == 1) project_tokens_direct<V, 1>(xt, M, norm_weight, phi, N, NP, rows, sums);
}

template <int TB>
MHC_INLINE void project_tokens(const float* x, int64_t M, const float* W, int64_t NP, int64_t rows,
                               float* sums) {
  int64_t col = 0;
  for (; col + 3 * kLanes <= NP; col += 3 * kLanes)
    project_block<Lanes8, TB, 3>(x, M, W, NP, rows, col, sums);
  if (NP - col == 2 * kLanes) project_block<Lanes8, TB, 2>(x, M, W, NP, rows, col, sums);
  if (NP - col == kLanes) project_block<Lanes8, TB, 1>(x, M, W, NP, rows, col, sums);
}

// dx rows of TB tokens, VB vectors of columns from j of the folded block W^T (rows `width`
// apart): acc = dx; acc += dP[t, c] * W^T[c, j..] over c in order.
template <class V, int TB, int VB>
MHC_INLINE void input_grad_block(const float* dP, int64_t N, const float* block, int64_t width,
                                 int64_t M, int64_t j, float* dx) {
  constexpr int64_t L = kWidth<V>;
  V acc[TB][VB];
  for (int64_t t = 0; t < TB; ++t) {
    for (int64_t v = 0; v < VB; ++v) load(&acc[t][v], dx + t * M + j + v * L);
  }
  for (int64_t c = 0; c < N; ++c) {
    V w[VB];
    for (int64_t v = 0; v < VB; ++v) load(&w[v], block + c * width + j + v * L);
    for (int64_t t = 0; t < TB; ++t) {
      const float d = dP[t * N + c];
      for (int64_t v = 0; v < VB; ++v) acc[t][v] += d * w[v];
    }
  }
  for (int64_t t = 0; t < TB; ++t) {
    for (int64_t v = 0; v < VB; ++v) store(dx + t * M + j + v * L, &acc[t][v]);
  }
}

// The input gradient of TB tokens for 8 columns from m with W^T folded in registers: 8 rows of
// phi at a time, scaled by their norm_weight and transposed, so each column c of W^T arrives as
// one vector over the 8 rows. The sums run over c in order, as in input_grad_block: a last group
// of columns that would pass N starts at N - 8 and skips the columns already added.
template <int TB>
MHC_INLINE void input_grad_direct(const float* dP, int64_t N, const float* norm_weight,
                                  const float* phi, int64_t M, int64_t m, float* dx) {
  Lanes8 acc[TB];
  for (int64_t t = 0; t < TB; ++t) load(&acc[t], dx + t * M + m);
  for (int64_t c0 = 0; c0 < N; c0 += kLanes) {
    const int64_t start = std::min(c0, N - kLanes);
    Lanes8 w[8];
    for (int64_t i = 0; i < 8; ++i) {
      load(&w[i], phi + (m + i) * N + start);
      w[i] *= norm_weight[m + i];
    }
    transpose8(w);
    for (int64_t k = c0 - start; k < kLanes; ++k) {
      for (int64_t t = 0; t < TB; ++t) acc[t] += dP[t * N + start + k] * w[k];
    }
  }
  for (int64_t t = 0; t < TB; ++t) store(dx + t * M + m, &acc[t]);
}

template <int TB>
MHC_INLINE void input_grad_tokens_direct(const float* dP, int64_t N, const float* norm_weight,
                                         const float* phi, int64_t M, int64_t m_begin,
                                         int64_t m_end, float* dx) {
  int64_t m = m_begin;
  for (; m + kLanes <= m_end; m += kLanes) input_grad_direct<TB>(dP, N, norm_weight, phi, M, m, dx);
  for (; m < m_end; ++m) {
    for (int64_t t = 0; t < TB; ++t) {
      float acc = dx[t * M + m];
      for (int64_t c = 0; c < N; ++c) acc += dP[t * N + c] * (norm_weight[m] * phi[m * N + c]);
      dx[t * M + m] = acc;
    }
  }
}

// TB tokens of dx over one folded block (dx points at the block's first column): two vectors at a
// time, then one; the 16-lane instance leaves a last 8 columns to an 8-lane vector.
template <class V, int TB>
MHC_INLINE void input_grad_tokens(const float* dP, int64_t N, const float* block, int64_t width,
                                  int64_t M, float* dx) {
  constexpr int64_t L = kWidth<V>;
  int64_t j = 0;
  for (; j + 2 * L <= width; j += 2 * L) input_grad_block<V, TB, 2>(dP, N, block, width, M, j, dx);
  for (; j + L <= width; j += L) input_grad_block<V, TB, 1>(dP, N, block, width, M, j, dx);
  if constexpr (L > kLanes) {
    for (; j + kLanes <= width; j += kLanes) {
      input_grad_block<Lanes8, TB, 1>(dP, N, block, width, M, j, dx);
    }
  }
  for (; j < width; ++j) {
    for (int64_t t = 0; t < TB; ++t) {
      float acc = dx[t * M + j];
      for (int64_t c = 0; c < N; ++c) acc += dP[t * N + c] * block[c * width + j];
      dx[t * M + j] = acc;
    }
  }
}

// One folded block of the input gradient, every token: kMaxTokens at a time, then 4, then the
// rest.
template <class V, int kMaxTokens>
MHC_INLINE void input_grad_rows(const float* dP, int64_t tokens, int64_t N, const float* block,
                                int64_t width, int64_t M, float* dx) {
  int64_t t = 0;
  if constexpr (kMaxTokens == 8) {
    for (; t + 8 <= tokens; t += 8) {
      input_grad_tokens<V, 8>(dP + t * N, N, block, width, M, dx + t * M);
    }
  }
  for (; t + 4 <= tokens; t += 4)
    input_grad_tokens<V, 4>(dP + t * N, N, block, width, M, dx + t * M);
  const int64_t rest = tokens - t;
  if (rest == 3) input_grad_tokens<V, 3>(dP + t * N, N, block, width, M, dx + t * M);
  if (rest == 2) input_grad_tokens<V, 2>(dP + t * N, N, block, width, M, dx + t * M);
  if (rest == 1) input_grad_tokens<V, 1>(dP + t * N, N, block, width, M, dx + t * M);
}

// Sums of CB rows from c0 and VB vectors of columns from j: f32 sums over the tokens, stored in S
// (rows `width` apart). `packed` holds the tile's x for columns from j, one token every
// kPackColumns.
template <class V, int CB, int VB>
MHC_INLINE void weight_grad_block(const float* packed, const float* dP, int64_t N, int64_t tokens,
                                  int64_t c0, int64_t width, int64_t j, float* S) {
  constexpr int64_t L = kWidth<V>;
  V acc[CB][VB] = {};
  for (int64_t t = 0; t < tokens; ++t) {
    V xv[VB];
    for (int64_t v = 0; v < VB; ++v) load(&xv[v], packed + t * kPackColumns + v * L);
    for (int64_t k = 0; k < CB; ++k) {
      const float d = dP[t * N + c0 + k];
      for (int64_t v = 0; v < VB; ++v) acc[k][v] += d * xv[v];
    }
  }
  for (int64_t k = 0; k < CB; ++k) {
    for (int64_t v = 0; v < VB; ++v) store(S + (c0 + k) * width + j + v * L, &acc[k][v]);
  }
}

// Rows of N per register block of the weight gradient: 4 with 8 lanes, 8 with 16.
template <class V>
inline constexpr int kWeightGradRows = kWidth<V> == 8 ? 4 : 8;

template <class V, int VB>
MHC_INLINE void weight_grad_columns(const float* packed, const float* dP, int64_t N, int64_t tokens,
                                    int64_t width, int64_t j, float* S) {
  constexpr int kRows = kWeightGradRows<V>;
  int64_t c = 0;
  for (; c + kRows <= N; c += kRows) {
    weight_grad_block<V, kRows, VB>(packed, dP, N, tokens, c, width, j, S);
  }
  // The rest four rows at a time where it can (the head's N = 4 with 16 lanes): each row alone
  // would load the tile's x again.
  if constexpr (kRows > 4) {
    for (; c + 4 <= N; c += 4) weight_grad_block<V, 4, VB>(packed, dP, N, tokens, c, width, j, S);
  }
  for (; c < N; ++c) weight_grad_block<V, 1, VB>(packed, dP, N, tokens, c, width, j, S);
}

// The columns [j, done) of one packed block, two vectors at a time, then one; returns done.
template <class V>
MHC_INLINE int64_t weight_grad_vectors(const float* packed, const float* dP, int64_t N,
                                       int64_t tokens, int64_t width, int64_t j, float* S) {
  constexpr int64_t L = kWidth<V>;
  for (; j + 2 * L <= width; j += 2 * L) {
    weight_grad_columns<V, 2>(packed + j, dP, N, tokens, width, j, S);
  }
  for (; j + L <= width; j += L) weight_grad_columns<V, 1>(packed + j, dP, N, tokens, width, j, S);
  return j;
}

// The 16-lane instances, for CPUs with AVX-512 (wide_projection()).
#define MHC_AVX512 __attribute__((target("avx512f,avx512vl,avx2,fma")))

// One block of rows of the projection (N >= 16), W folded in registers.
MHC_AVX512 void project_block_avx512(const float* x, int64_t tokens, int64_t M,
                                     const float* norm_weight, const float* phi, int64_t N,
                                     int64_t NP, int64_t rows, float* out) {
  project_rows_direct<Lanes16, 8>(x, tokens, M, norm_weight, phi, N, NP, rows, out);
}

// One folded block of the input gradient.
MHC_AVX512 void input_grad_avx512(const float* dP, int64_t tokens, int64_t N, const float* block,
                                  int64_t width, int64_t M, float* dx) {
  input_grad_rows<Lanes16, 8>(dP, tokens, N, block, width, M, dx);
}

// The columns [0, done) of one packed block of the weight gradient; returns done (a multiple of
// 16), the rest left to the 8-lane vectors.
MHC_AVX512 int64_t weight_grad_avx512(const float* packed, const float* dP, int64_t N,
                                      int64_t tokens, int64_t width, float* S) {
  return weight_grad_vectors<Lanes16>(packed, dP, N, tokens, width, 0, S);
}

}  // namespace

bool wide_projection() {
  static const bool wide = [] {
    const char* off = std::getenv("MHC_NO_AVX512");
    if (off != nullptr && off[0] == '1') return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return wide;
}

int64_t padded_width(int64_t N) { return (N + kLanes - 1) / kLanes * kLanes; }

namespace {

int64_t ceil_blocks(int64_t M) { return (M + kProjectionBlock - 1) / kProjectionBlock; }

// Sixteen f32 lanes (one AVX-512 register, two AVX ones in the v3 clone, four SSE ones in the
// baseline): the lane structure of the sums below, so every instance sums the same way.
using simd::Lanes16;

MHC_INLINE void load16(Lanes16* v, const float* p) {
  *v = *reinterpret_cast<const simd::UnalignedLanes16*>(p);
}

// The 16 lanes' sums of K vectors (K <= 16), each in one fixed order: out[j] = ((h[0] + h[2]) +
// (h[1] + h[3])) with h[i] = (v[j][i] + v[j][i + 8]) + (v[j][i + 4] + v[j][i + 12]), i.e. halving:
// lane i + lane i + 8, then + 4, + 2, + 1. The adds of the 16 vectors' trees run side by side, a
// round of shuffles and vector adds per level (four levels, 15 vector adds), where one vector's
// sum alone took 15 scalar adds: the per-block sums were as many instructions as the narrow
// projection's FMAs. Missing vectors (j >= K) are zeros, which never meet a present vector's lanes.
template <int K>
MHC_INLINE void sum16_each(const Lanes16* v, float* out) {
  static_assert(K >= 1 && K <= 16, "at most 16 vectors");
  if constexpr (K == 1) {  // one vector: the same tree in scalar adds, fewer instructions
    const Lanes16& a = *v;
    float h8[8], h4[4];
    for (int i = 0; i < 8; ++i) h8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; ++i) h4[i] = h8[i] + h8[i + 4];
    out[0] = (h4[0] + h4[2]) + (h4[1] + h4[3]);
    return;
  }
  Lanes16 a[16];
  for (int64_t j = 0; j < 16; ++j) a[j] = j < K ? v[j] : Lanes16{};
  // Level 1: u[k] = [h8 of a[2k] | h8 of a[2k + 1]], h8[i] = lane i + lane i + 8.
  Lanes16 u[8];
  for (int64_t k = 0; k < 8; ++k) {
    const Lanes16 lo = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16,
                                               17, 18, 19, 20, 21, 22, 23);
    const Lanes16 hi = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                                               24, 25, 26, 27, 28, 29, 30, 31);
    u[k] = lo + hi;
  }
  // Level 2: w[k] = the h4 of vectors 4k .. 4k + 3, four lanes each, h4[i] = h8[i] + h8[i + 4].
  Lanes16 w[4];
  for (int64_t k = 0; k < 4; ++k) {
    const Lanes16 lo = __builtin_shufflevector(u[2 * k], u[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16,
                                               17, 18, 19, 24, 25, 26, 27);
    const Lanes16 hi = __builtin_shufflevector(u[2 * k], u[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15,
                                               20, 21, 22, 23, 28, 29, 30, 31);
    w[k] = lo + hi;
  }
  // Level 3: z[k] = (h4[0] + h4[2], h4[1] + h4[3]) of vectors 8k .. 8k + 7.
  Lanes16 z[2];
  for (int64_t k = 0; k < 2; ++k) {
    const Lanes16 lo = __builtin_shufflevector(w[2 * k], w[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16,
                                               17, 20, 21, 24, 25, 28, 29);
    const Lanes16 hi = __builtin_shufflevector(w[2 * k], w[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15,
                                               18, 19, 22, 23, 26, 27, 30, 31);
    z[k] = lo + hi;
  }
  // Level 4: the two halves of each pair.
  const Lanes16 even = __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20,
                                               22, 24, 26, 28, 30);
  const Lanes16 odd = __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23,
                                              25, 27, 29, 31);
  const Lanes16 sums = even + odd;
  for (int64_t j = 0; j < K; ++j) out[j] = sums[j];
}

// Each of G tokens' f32 sum of squares over one block of rows of x (rows <= kProjectionBlock,
// token rows `stride` apart): lane l of 16 sums the rows l mod 16 in order, the lanes are added
// by sum16_each, then the scalar tail in order. At most 8 positive terms per lane, so the block
// sum is within a few ulps; the blocks are added in double as the projection's are. The narrow
// projection below computes the same sums from the same loads.
template <int G>
MHC_INLINE void block_squares_group(const float* x, int64_t stride, int64_t rows, float* squares) {
  Lanes16 acc[G] = {};
  int64_t m = 0;
  for (; m + kLanes16 <= rows; m += kLanes16) {
    for (int g = 0; g < G; ++g) {
      Lanes16 v;
      load16(&v, x + g * stride + m);
      acc[g] += v * v;
    }
  }
  float totals[G];
  sum16_each<G>(acc, totals);
  for (int g = 0; g < G; ++g) {
    const float* xg = x + g * stride;
    float tail = 0.0f;
    for (int64_t r = m; r < rows; ++r) tail = std::fma(xg[r], xg[r], tail);
    squares[g] = totals[g] + tail;
  }
}

// block_squares_group over `tokens` tokens, one at a time (four at a time saved nothing on the
// AVX-512 path and cost the 8-lane one 3%: M = 16384, N = 24, 16 tokens in cache).
MHC_INLINE void block_squares(const float* x, int64_t stride, int64_t tokens, int64_t rows,
                              float* squares) {
  for (int64_t t = 0; t < tokens; ++t) {
    block_squares_group<1>(x + t * stride, stride, rows, squares + t);
  }
}

// The projection of a narrow W (N <= 8: the head's N = n, and small n) as dot products along the
// rows: lanes over m, one accumulator per token and column, so no lane is padding. TB tokens from
// x (rows `stride` apart) over one block of `rows` rows of Wt, the block of W transposed and
// folded ([N][kProjectionBlock]). The block sum of column c is the halving sum of its lanes (lane l
// summing the rows l mod 16 in order) plus the scalar tail, the same whatever TB or the instance;
// each token's sum of squares comes from the same loads, as block_squares computes it.
// The scalar tails are explicit FMAs (std::fma), not a*b+c left to -ffp-contract: on an AVX2-only
// EPYC, GCC 12's x86-64-v3 clone left the N = 8 tails unfused, a few ulps off the 16-lane
// instance and projection_test's order (2026-12-06); the same in block_squares_group.
template <int TB, int NC>
MHC_INLINE void project_narrow_tokens(const float* x, int64_t stride, const float* Wt, int64_t NP,
                                      int64_t rows, float* sums, float* squares) {
  Lanes16 acc[TB][NC] = {};
  Lanes16 sq[TB] = {};
  int64_t m = 0;
  for (; m + kLanes16 <= rows; m += kLanes16) {
    Lanes16 xv[TB];
    for (int t = 0; t < TB; ++t) {
      load16(&xv[t], x + t * stride + m);
      sq[t] += xv[t] * xv[t];
    }
    for (int c = 0; c < NC; ++c) {
      Lanes16 w;
      load16(&w, Wt + c * kProjectionBlock + m);
      for (int t = 0; t < TB; ++t) acc[t][c] += xv[t] * w;
    }
  }
  float totals[TB * NC], square_totals[TB];
  sum16_each<TB * NC>(&acc[0][0], totals);
  sum16_each<TB>(sq, square_totals);
  for (int t = 0; t < TB; ++t) {
    const float* xt = x + t * stride;
    float tail = 0.0f;
    for (int64_t r = m; r < rows; ++r) tail = std::fma(xt[r], xt[r], tail);
    squares[t] = square_totals[t] + tail;
    for (int c = 0; c < NC; ++c) {
      float column_tail = 0.0f;
      for (int64_t r = m; r < rows; ++r) {
        column_tail = std::fma(xt[r], Wt[c * kProjectionBlock + r], column_tail);
      }
      sums[t * NP + c] = totals[t * NC + c] + column_tail;
    }
  }
}

// Every token of one block of a narrow projection of NC columns: kMaxTokens at a time (four
// tokens of up to four columns, or two, in the 16-lane instance; one in the others, whose 16
// registers hold one token's accumulators), then one. Wt as in project_narrow_tokens.
template <int kMaxTokens, int NC>
MHC_INLINE void project_narrow_columns(const float* x, int64_t stride, int64_t tokens,
                                       const float* Wt, int64_t NP, int64_t rows, float* sums,
                                       float* squares) {
  constexpr int kTokens = kMaxTokens == 1 ? 1 : (NC <= 4 ? kMaxTokens : 2);
  int64_t t = 0;
  for (; t + kTokens <= tokens; t += kTokens) {
    project_narrow_tokens<kTokens, NC>(x + t * stride, stride, Wt, NP, rows, sums + t * NP,
                                       squares + t);
  }
  for (; t < tokens; ++t) {
    project_narrow_tokens<1, NC>(x + t * stride, stride, Wt, NP, rows, sums + t * NP, squares + t);
  }
}

template <int kMaxTokens>
MHC_INLINE void project_narrow(const float* x, int64_t stride, int64_t tokens, const float* Wt,
                               int64_t N, int64_t NP, int64_t rows, float* sums, float* squares) {
  switch (N) {
    case 1:
      return project_narrow_columns<kMaxTokens, 1>(x, stride, tokens, Wt, NP, rows, sums, squares);
    case 2:
      return project_narrow_columns<kMaxTokens, 2>(x, stride, tokens, Wt, NP, rows, sums, squares);
    case 3:
      return project_narrow_columns<kMaxTokens, 3>(x, stride, tokens, Wt, NP, rows, sums, squares);
    case 4:
      return project_narrow_columns<kMaxTokens, 4>(x, stride, tokens, Wt, NP, rows, sums, squares);
    case 5:
      return project_narrow_columns<kMaxTokens, 5>(x, stride, tokens, Wt, NP, rows, sums, squares);
    case 6:
      return project_narrow_columns<kMaxTokens, 6>(x, stride, tokens, Wt, NP, rows, sums, squares);
    case 7:
      return project_narrow_columns<kMaxTokens, 7>(x, stride, tokens, Wt, NP, rows, sums, squares);
    default:
      return project_narrow_columns<kMaxTokens, 8>(x, stride, tokens, Wt, NP, rows, sums, squares);
  }
}

// The 16-lane instance (wide_projection()): several tokens' accumulators in its 32 registers.
MHC_AVX512 void project_narrow_avx512(const float* x, int64_t stride, int64_t tokens,
                                      const float* Wt, int64_t N, int64_t NP, int64_t rows,
                                      float* sums, float* squares) {
  project_narrow<4>(x, stride, tokens, Wt, N, NP, rows, sums, squares);
}

// project_blocks with x at the first block's first row and rows of x `stride` floats apart: the
// caller's tile (stride M) or a widened piece of it (stride: the piece's width).
MHC_CLONES void project_blocks_at(const float* x, int64_t stride, int64_t tokens,
                                  const FoldedWeight& w, int64_t block_begin, int64_t block_end,
                                  float* sums, float* squares) {
  const int64_t M = w.M, N = w.N, NP = padded_width(N);
  thread_local std::vector<float> folded;
  if (folded.size() < static_cast<size_t>(kProjectionBlock * NP)) {
    folded.resize(static_cast<size_t>(kProjectionBlock * NP));
  }
  float* W = folded.data();
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t m0 = b * kProjectionBlock, rows = std::min(kProjectionBlock, M - m0);
    const float* xb = x + (b - block_begin) * kProjectionBlock;
    float* out = sums + (b - block_begin) * tokens * NP;
    float* block_sq = squares + (b - block_begin) * tokens;
    if (N <= kLanes) {
      // W^T of the block, folded; rows past the block's end never read.
      for (int64_t r = 0; r < rows; ++r) {
        const float scale = w.norm_weight[m0 + r];
        for (int64_t c = 0; c < N; ++c)
          W[c * kProjectionBlock + r] = scale * w.phi[(m0 + r) * N + c];
      }
      if (wide_projection()) {
        project_narrow_avx512(xb, stride, tokens, W, N, NP, rows, out, block_sq);
      } else {
        project_narrow<1>(xb, stride, tokens, W, N, NP, rows, out, block_sq);
      }
      continue;
    }
    block_squares(xb, stride, tokens, rows, block_sq);
    if (N >= kLanes16 && wide_projection()) {
      project_block_avx512(xb, tokens, stride, w.norm_weight + m0, w.phi + m0 * N, N, NP, rows,
                           out);
      continue;
    }
    if (fold_in_registers(tokens, N)) {
      project_rows_direct<Lanes8, 4>(xb, tokens, stride, w.norm_weight + m0, w.phi + m0 * N, N, NP,
                                     rows, out);
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float scale = w.norm_weight[m0 + r];
      const float* phi_row = w.phi + (m0 + r) * N;
      float* row = W + r * NP;
      for (int64_t c = 0; c < N; ++c) row[c] = scale * phi_row[c];
      for (int64_t c = N; c < NP; ++c) row[c] = 0.0f;
    }
    int64_t t = 0;
    // One or two vectors of columns (the head's N = n, small n): 8 tokens at a time, so that 8 or
    // 16 independent accumulators cover the FMA latency.
    if (NP <= 2 * kLanes) {
      for (; t + 8 <= tokens; t += 8) {
        project_tokens<8>(xb + t * stride, stride, W, NP, rows, out + t * NP);
      }
    }
    for (; t + 4 <= tokens; t += 4) {
      project_tokens<4>(xb + t * stride, stride, W, NP, rows, out + t * NP);
    }
    const int64_t rest = tokens - t;
    if (rest == 3) project_tokens<3>(xb + t * stride, stride, W, NP, rows, out + t * NP);
    if (rest == 2) project_tokens<2>(xb + t * stride, stride, W, NP, rows, out + t * NP);
    if (rest == 1) project_tokens<1>(xb + t * stride, stride, W, NP, rows, out + t * NP);
  }
}

// Rows of x per widened piece of a bf16 tile in project(): kBlocksPerStep blocks.
constexpr int64_t kBlocksPerStep = 4;

// project() for either activation type: a few blocks at a time, so the block sums (and, for bf16,
// the piece of the tile widened to f32) stay in L1 until they are added.
template <class X>
void project_any(const X* x, int64_t tokens, const FoldedWeight& w, float* P, double* squares) {
  const int64_t M = w.M, NP = padded_width(w.N), blocks = ceil_blocks(M);
  constexpr bool kWiden = std::is_same_v<X, bf16>;
  constexpr int64_t kStepRows = kBlocksPerStep * kProjectionBlock;
  thread_local std::vector<double> wide;
  thread_local std::vector<float> sums, block_sq, piece;
  wide.assign(static_cast<size_t>(tokens * NP), 0.0);
  std::fill_n(squares, tokens, 0.0);
  if (sums.size() < static_cast<size_t>(kBlocksPerStep * tokens * NP)) {
    sums.resize(static_cast<size_t>(kBlocksPerStep * tokens * NP));
  }
  if (block_sq.size() < static_cast<size_t>(kBlocksPerStep * tokens)) {
    block_sq.resize(static_cast<size_t>(kBlocksPerStep * tokens));
  }
  if (kWiden && piece.size() < static_cast<size_t>(tokens * kStepRows)) {
    piece.resize(static_cast<size_t>(tokens * kStepRows));
  }
  for (int64_t b = 0; b < blocks; b += kBlocksPerStep) {
    const int64_t end = std::min(blocks, b + kBlocksPerStep);
    const int64_t m0 = b * kProjectionBlock, width = std::min(M, end * kProjectionBlock) - m0;
    // The tile's rows are M apart, more streams than the hardware prefetcher follows: fetch the
    // next step's lines while this one is projected (the tile's first reads from memory).
    constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(X));
    const int64_t ahead_end = std::min(M, m0 + width + kStepRows);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t ahead = m0 + width; ahead < ahead_end; ahead += kLine) {
        __builtin_prefetch(x + t * M + ahead);
      }
    }
    if constexpr (kWiden) {
      for (int64_t t = 0; t < tokens; ++t) widen(x + t * M + m0, piece.data() + t * width, width);
      project_blocks_at(piece.data(), width, tokens, w, b, end, sums.data(), block_sq.data());
    } else {
      project_blocks_at(x + m0, M, tokens, w, b, end, sums.data(), block_sq.data());
    }
    add_block_sums(sums.data(), block_sq.data(), end - b, tokens, NP, wide.data(), squares);
  }
  round_projection(wide.data(), tokens, w.N, P);
}

}  // namespace

void project_blocks(const float* x, int64_t tokens, const FoldedWeight& w, int64_t block_begin,
                    int64_t block_end, float* sums, float* squares) {
  project_blocks_at(x + block_begin * kProjectionBlock, w.M, tokens, w, block_begin, block_end,
                    sums, squares);
}

MHC_CLONES void add_block_sums(const float* sums, const float* squares, int64_t blocks,
                               int64_t tokens, int64_t NP, double* wide, double* wide_squares) {
  const int64_t count = tokens * NP;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* block = sums + b * count;
    for (int64_t k = 0; k < count; ++k) wide[k] += static_cast<double>(block[k]);
    const float* block_sq = squares + b * tokens;
    for (int64_t t = 0; t < tokens; ++t) wide_squares[t] += static_cast<double>(block_sq[t]);
  }
}

void round_projection(const double* wide, int64_t tokens, int64_t N, float* P) {
  const int64_t NP = padded_width(N);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < N; ++c) P[t * N + c] = static_cast<float>(wide[t * NP + c]);
  }
}

void project(const float* x, int64_t tokens, const FoldedWeight& w, float* P, double* squares) {
  project_any(x, tokens, w, P, squares);
}

void project(const bf16* x, int64_t tokens, const FoldedWeight& w, float* P, double* squares) {
  project_any(x, tokens, w, P, squares);
}

MHC_CLONES void add_projection_grad(const float* dP, int64_t tokens, const FoldedWeight& w,
                                    int64_t m_begin, int64_t m_end, float* dx) {
  const int64_t M = w.M, N = w.N;
  if (fold_in_registers(tokens, N)) {
    int64_t t = 0;
    for (; t + 4 <= tokens; t += 4) {
      input_grad_tokens_direct<4>(dP + t * N, N, w.norm_weight, w.phi, M, m_begin, m_end,
                                  dx + t * M);
    }
    const int64_t rest = tokens - t;
    const float* dPt = dP + t * N;
    float* dxt = dx + t * M;
    if (rest == 3)
      input_grad_tokens_direct<3>(dPt, N, w.norm_weight, w.phi, M, m_begin, m_end, dxt);
    if (rest == 2)
      input_grad_tokens_direct<2>(dPt, N, w.norm_weight, w.phi, M, m_begin, m_end, dxt);
    if (rest == 1)
      input_grad_tokens_direct<1>(dPt, N, w.norm_weight, w.phi, M, m_begin, m_end, dxt);
    return;
  }
  // W^T of one block: N rows of `width` columns, contiguous (rows 64 KiB apart in a whole W^T
  // would all map to the same L1 sets).
  thread_local std::vector<float> folded;
  if (folded.size() < static_cast<size_t>(N * kInputGradBlock)) {
    folded.resize(static_cast<size_t>(N * kInputGradBlock));
  }
  float* block = folded.data();
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kInputGradBlock) {
    const int64_t width = std::min(kInputGradBlock, m_end - m0);
    for (int64_t j = 0; j < width; ++j) {
      const float scale = w.norm_weight[m0 + j];
      const float* phi_row = w.phi + (m0 + j) * N;
      for (int64_t c = 0; c < N; ++c) block[c * width + j] = scale * phi_row[c];
    }
    float* out = dx + m0;
    if (wide_projection()) {
      input_grad_avx512(dP, tokens, N, block, width, M, out);
      continue;
    }
    input_grad_rows<Lanes8, 4>(dP, tokens, N, block, width, M, out);
  }
}

MHC_CLONES void weight_grad_sums(const float* x, const float* dP, int64_t tokens, int64_t M,
                                 int64_t N, int64_t m0, float* S) {
  thread_local std::vector<float> packed;
  if (packed.size() < static_cast<size_t>(tokens * kPackColumns)) {
    packed.resize(static_cast<size_t>(tokens * kPackColumns));
  }
  const int64_t m1 = std::min(M, m0 + kPackColumns), width = m1 - m0;
  // The tile's rows are M floats apart, more streams than the hardware prefetcher follows:
  // fetch the next block's lines while packing this one.
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = x + t * M;
    for (int64_t ahead = m1; ahead < std::min(M, m1 + kPackColumns); ahead += 16) {
      __builtin_prefetch(row + ahead);
    }
    float* out = packed.data() + t * kPackColumns;
    if (width == kPackColumns) {
      for (int64_t v = 0; v < kPackColumns / kLanes; ++v) {
        Lanes8 lanes;
        load(&lanes, row + m0 + v * kLanes);
        store(out + v * kLanes, &lanes);
      }
    } else {
      std::copy(row + m0, row + m1, out);
    }
  }
  int64_t j = wide_projection() ? weight_grad_avx512(packed.data(), dP, N, tokens, width, S) : 0;
  j = weight_grad_vectors<Lanes8>(packed.data(), dP, N, tokens, width, j, S);
  for (; j < width; ++j) {
    for (int64_t c = 0; c < N; ++c) {
      float acc = 0.0f;
      for (int64_t t = 0; t < tokens; ++t)
        acc += dP[t * N + c] * packed[static_cast<size_t>(t * kPackColumns + j)];
      S[c * width + j] = acc;
    }
  }
}

}  // namespace mhc::cpu
