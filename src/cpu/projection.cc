// Micro-kernels of projection.h. Vectors run along the dimension each product keeps in
// registers: N for the projection (a row of W is three 8-lane vectors for N = 24), M for the two
// gradients; the other operand is broadcast. Every output element sees the same sequence of
// operations whatever the blocking, so results depend on the shapes only.
#include "projection.h"

#include <algorithm>

#include "simd.h"
#include "thread_pool.h"

namespace mhc::cpu {

namespace {

using simd::add_wide;
using simd::kLanes;
using simd::Lanes8;
using simd::load;
using simd::store;

constexpr int64_t kFoldRows = 128;  // rows of W per f32 partial sum of the projection
// Columns of M per block of the input gradient. W^T is stored blocked, [M/256][N][256], so a
// block's N rows are contiguous: N rows 64 KiB apart would all map to the same L1 sets.
constexpr int64_t kGradColumns = 256;
// Columns of x per packed block of the weight gradient: the tile's rows of x are M apart, and
// packing [tokens, 64] contiguously keeps the register blocks' loads in L1.
constexpr int64_t kPackColumns = kWeightGradBlock;

// TB tokens x CB*8 columns of P over rows [m0, m1): acc[t][j] += x[t, m] * W[m, cols].
template <int TB, int CB>
MHC_INLINE void project_block(const float* x, int64_t M, const float* rows, int64_t NP, int64_t m0,
                              int64_t m1, int64_t col, double* wide) {
  Lanes8 acc[TB][CB] = {};
  for (int64_t m = m0; m < m1; ++m) {
    Lanes8 w[CB];
    for (int64_t j = 0; j < CB; ++j) load(&w[j], rows + m * NP + col + j * kLanes);
    for (int64_t t = 0; t < TB; ++t) {
      const float xv = x[t * M + m];
      for (int64_t j = 0; j < CB; ++j) acc[t][j] += xv * w[j];
    }
  }
  for (int64_t t = 0; t < TB; ++t) {
    for (int64_t j = 0; j < CB; ++j) add_wide(wide + t * NP + col + j * kLanes, &acc[t][j]);
  }
}

template <int TB>
MHC_INLINE void project_tokens(const float* x, int64_t M, const float* rows, int64_t NP, int64_t m0,
                               int64_t m1, double* wide) {
  int64_t col = 0;
  for (; col + 3 * kLanes <= NP; col += 3 * kLanes)
    project_block<TB, 3>(x, M, rows, NP, m0, m1, col, wide);
  if (NP - col == 2 * kLanes) project_block<TB, 2>(x, M, rows, NP, m0, m1, col, wide);
  if (NP - col == kLanes) project_block<TB, 1>(x, M, rows, NP, m0, m1, col, wide);
}

// dx rows of TB tokens, VB*8 columns from m: acc = dx; acc += dP[t, c] * W^T[c, m..] over c.
// `block` is W^T's block holding column m, with rows `width` apart, m0 its first column.
template <int TB, int VB>
MHC_INLINE void input_grad_block(const float* dP, int64_t N, const float* block, int64_t width,
                                 int64_t m0, int64_t M, int64_t m, float* dx) {
  Lanes8 acc[TB][VB];
  for (int64_t t = 0; t < TB; ++t) {
    for (int64_t v = 0; v < VB; ++v) load(&acc[t][v], dx + t * M + m + v * kLanes);
  }
  for (int64_t c = 0; c < N; ++c) {
    Lanes8 w[VB];
    for (int64_t v = 0; v < VB; ++v) load(&w[v], block + c * width + (m - m0) + v * kLanes);
    for (int64_t t = 0; t < TB; ++t) {
      const float d = dP[t * N + c];
      for (int64_t v = 0; v < VB; ++v) acc[t][v] += d * w[v];
    }
  }
  for (int64_t t = 0; t < TB; ++t) {
    for (int64_t v = 0; v < VB; ++v) store(dx + t * M + m + v * kLanes, &acc[t][v]);
  }
}

template <int TB>
MHC_INLINE void input_grad_tokens(const float* dP, int64_t N, const float* cols, int64_t M,
                                  int64_t m0, int64_t m1, float* dx) {
  const float* block = cols + m0 * N;
  const int64_t width = m1 - m0;
  int64_t m = m0;
  for (; m + 2 * kLanes <= m1; m += 2 * kLanes)
    input_grad_block<TB, 2>(dP, N, block, width, m0, M, m, dx);
  for (; m + kLanes <= m1; m += kLanes) input_grad_block<TB, 1>(dP, N, block, width, m0, M, m, dx);
  for (; m < m1; ++m) {
    for (int64_t t = 0; t < TB; ++t) {
      float acc = dx[t * M + m];
      for (int64_t c = 0; c < N; ++c) acc += dP[t * N + c] * block[c * width + (m - m0)];
      dx[t * M + m] = acc;
    }
  }
}

// G rows c0..c0+CB, VB*8 columns from m: f32 sums over the tokens, then added to the double
// block of G that holds column m (rows `width` apart, first column m0). `packed` holds the
// tile's x for columns from m, one token every kPackColumns floats.
template <int CB, int VB>
MHC_INLINE void weight_grad_block(const float* packed, const float* dP, int64_t N, int64_t tokens,
                                  int64_t c0, int64_t width, int64_t offset, double* block) {
  Lanes8 acc[CB][VB] = {};
  for (int64_t t = 0; t < tokens; ++t) {
    Lanes8 xv[VB];
    for (int64_t v = 0; v < VB; ++v) load(&xv[v], packed + t * kPackColumns + v * kLanes);
    for (int64_t j = 0; j < CB; ++j) {
      const float d = dP[t * N + c0 + j];
      for (int64_t v = 0; v < VB; ++v) acc[j][v] += d * xv[v];
    }
  }
  for (int64_t j = 0; j < CB; ++j) {
    for (int64_t v = 0; v < VB; ++v)
      add_wide(block + (c0 + j) * width + offset + v * kLanes, &acc[j][v]);
  }
}

template <int VB>
MHC_INLINE void weight_grad_columns(const float* packed, const float* dP, int64_t N, int64_t tokens,
                                    int64_t width, int64_t offset, double* block) {
  int64_t c = 0;
  for (; c + 4 <= N; c += 4)
    weight_grad_block<4, VB>(packed, dP, N, tokens, c, width, offset, block);
  for (; c < N; ++c) weight_grad_block<1, VB>(packed, dP, N, tokens, c, width, offset, block);
}

}  // namespace

ProjectionWeight::ProjectionWeight(const float* norm_weight, const float* phi, int64_t M, int64_t N,
                                   unsigned layouts)
    : M_(M),
      N_(N),
      NP_((N + kLanes - 1) / kLanes * kLanes),
      rows_((layouts & kRowLayout) != 0 ? static_cast<size_t>(M * NP_) : 0, 0.0f),
      cols_((layouts & kColLayout) != 0 ? static_cast<size_t>(M * N) : 0) {
  const bool with_rows = !rows_.empty(), with_cols = !cols_.empty();
  constexpr int64_t kRows = 1024;
  ThreadPool& pool = ThreadPool::instance();
  pool.parallel_for((M + kRows - 1) / kRows, pool.threads(), [&](int64_t task, int) {
    const int64_t end = std::min(M, (task + 1) * kRows);
    for (int64_t m = task * kRows; m < end; ++m) {
      const int64_t m0 = m / kGradColumns * kGradColumns, width = std::min(kGradColumns, M - m0);
      for (int64_t c = 0; c < N; ++c) {
        const float w = norm_weight[m] * phi[m * N + c];
        if (with_rows) rows_[static_cast<size_t>(m * NP_ + c)] = w;
        if (with_cols) cols_[static_cast<size_t>(m0 * N + c * width + (m - m0))] = w;
      }
    }
  });
}

MHC_CLONES void project(const float* x, int64_t tokens, const ProjectionWeight& w, float* P) {
  const int64_t M = w.M(), N = w.N(), NP = w.padded_N();
  thread_local std::vector<double> wide;
  wide.assign(static_cast<size_t>(tokens * NP), 0.0);
  for (int64_t m0 = 0; m0 < M; m0 += kFoldRows) {
    const int64_t m1 = std::min(M, m0 + kFoldRows);
    int64_t t = 0;
    for (; t + 4 <= tokens; t += 4)
      project_tokens<4>(x + t * M, M, w.rows(), NP, m0, m1, wide.data() + t * NP);
    const int64_t rest = tokens - t;
    if (rest == 3) project_tokens<3>(x + t * M, M, w.rows(), NP, m0, m1, wide.data() + t * NP);
    if (rest == 2) project_tokens<2>(x + t * M, M, w.rows(), NP, m0, m1, wide.data() + t * NP);
    if (rest == 1) project_tokens<1>(x + t * M, M, w.rows(), NP, m0, m1, wide.data() + t * NP);
  }
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < N; ++c)
      P[t * N + c] = static_cast<float>(wide[static_cast<size_t>(t * NP + c)]);
  }
}

MHC_CLONES void add_projection_grad(const float* dP, int64_t tokens, const ProjectionWeight& w,
                                    float* dx) {
  const int64_t M = w.M(), N = w.N();
  for (int64_t m0 = 0; m0 < M; m0 += kGradColumns) {
    const int64_t m1 = std::min(M, m0 + kGradColumns);
    int64_t t = 0;
    for (; t + 4 <= tokens; t += 4)
      input_grad_tokens<4>(dP + t * N, N, w.cols(), M, m0, m1, dx + t * M);
    const int64_t rest = tokens - t;
    if (rest == 3) input_grad_tokens<3>(dP + t * N, N, w.cols(), M, m0, m1, dx + t * M);
    if (rest == 2) input_grad_tokens<2>(dP + t * N, N, w.cols(), M, m0, m1, dx + t * M);
    if (rest == 1) input_grad_tokens<1>(dP + t * N, N, w.cols(), M, m0, m1, dx + t * M);
  }
}

MHC_CLONES void accumulate_weight_grad(const float* x, const float* dP, int64_t tokens, int64_t M,
                                       int64_t N, double* G) {
  thread_local std::vector<float> packed;
  packed.resize(static_cast<size_t>(tokens * kPackColumns));
  for (int64_t m0 = 0; m0 < M; m0 += kPackColumns) {
    const int64_t m1 = std::min(M, m0 + kPackColumns);
    // The tile's rows are M floats apart, more streams than the hardware prefetcher follows:
    // fetch the next block's lines while packing this one.
    for (int64_t t = 0; t < tokens; ++t) {
      const float* row = x + t * M;
      for (int64_t ahead = m1; ahead < std::min(M, m1 + kPackColumns); ahead += 16) {
        __builtin_prefetch(row + ahead);
      }
      float* out = packed.data() + t * kPackColumns;
      if (m1 - m0 == kPackColumns) {
        for (int64_t v = 0; v < kPackColumns / kLanes; ++v) {
          Lanes8 lanes;
          load(&lanes, row + m0 + v * kLanes);
          store(out + v * kLanes, &lanes);
        }
      } else {
        std::copy(row + m0, row + m1, out);
      }
    }
    double* block = G + m0 * N;
    const int64_t width = m1 - m0;
    int64_t m = 0;
    for (; m + 2 * kLanes <= width; m += 2 * kLanes) {
      weight_grad_columns<2>(packed.data() + m, dP, N, tokens, width, m, block);
    }
    for (; m + kLanes <= width; m += kLanes) {
      weight_grad_columns<1>(packed.data() + m, dP, N, tokens, width, m, block);
    }
    for (; m < width; ++m) {
      for (int64_t c = 0; c < N; ++c) {
        float acc = 0.0f;
        for (int64_t t = 0; t < tokens; ++t)
          acc += dP[t * N + c] * packed[static_cast<size_t>(t * kPackColumns + m)];
        block[c * width + m] += acc;
      }
    }
  }
}

}  // namespace mhc::cpu
