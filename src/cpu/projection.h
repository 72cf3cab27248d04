// The skinny matrix products of the pre operations (spec: Forward step 2 and its two gradients):
// x [tokens, M] times the folded weight W = norm_weight * phi [M, N], with N = 2n + R small (24
// for n = 4) and M = n*D large. Register-blocked micro-kernels, one per product.
//
// W is never built whole. Each kernel folds the block of rows it is about to use,
// norm_weight[m] * phi[m, c], into a small buffer that stays in L1 (rows for the projection, W^T
// for the input gradient), so a call costs one read of phi and nothing else proportional to M*N:
// at decode sizes (a few tokens) building W took most of the time. The fold is the same f32
// product wherever it happens, so results do not depend on which kernel or thread folded.
//
// Every kernel works on a range of rows of W, so a call with few tokens can split the rows over
// threads; every output element sees the same sequence of operations whatever the range split,
// the token blocking or the thread count, so results depend on the shapes only.
#pragma once

#include <cstdint>

#include "mhc/tensor.h"

namespace mhc::cpu {

// The parameters W is folded from: norm_weight [M] and phi [M, N] as the caller holds them.
struct FoldedWeight {
  const float* norm_weight;
  const float* phi;
  int64_t M, N;
};

// Rows of W per f32 partial sum of the projection: the partial sums of consecutive blocks are
// added in double, so the error of a length-M dot product stays near eps*sqrt(128) relative
// instead of growing with M.
inline constexpr int64_t kProjectionBlock = 128;
// Columns of M per block of the input gradient (one folded W^T block of N x 256).
inline constexpr int64_t kInputGradBlock = 256;
// Columns of M per block of the weight gradient.
inline constexpr int64_t kWeightGradBlock = 64;

// Whether the projection runs its 16-lane (AVX-512) kernels: on CPUs with AVX-512F, unless
// MHC_NO_AVX512=1 (which the tests set to cover the 8-lane kernels on such machines). Both give
// the same numbers: every output sums the same products in the same order.
bool wide_projection();

// N rounded up to whole 8-lane vectors: the row stride of the projection block sums (the 16-lane
// kernels end a row in an 8-lane vector or in one that overlaps the one before, so they need no
// more).
int64_t padded_width(int64_t N);

// Block sums of the projection for the blocks [block_begin, block_end) of kProjectionBlock rows:
// sums[((b - block_begin) * tokens + t) * padded_width(N) + c] = f32 sum over the rows m of
// block b of x[t*M + m] W[m, c] (padding columns hold garbage), and, in the same sweep over the
// block while it is in L1, squares[(b - block_begin) * tokens + t] = the f32 sum of x[t*M + m]^2
// over those rows (8 lanes in a fixed order, whatever the SIMD path).
void project_blocks(const float* x, int64_t tokens, const FoldedWeight& w, int64_t block_begin,
                    int64_t block_end, float* sums, float* squares);

// wide[t * NP + c] += the block sums of `blocks` consecutive blocks, widened to double, in block
// order (NP = padded_width(N)); wide_squares[t] += their sums of squares, likewise.
void add_block_sums(const float* sums, const float* squares, int64_t blocks, int64_t tokens,
                    int64_t NP, double* wide, double* wide_squares);

// P[t*N + c] = float(wide[t*NP + c]).
void round_projection(const double* wide, int64_t tokens, int64_t N, float* P);

// The whole projection P = x W of a tile of x ([tokens, M], row stride M) on the calling thread,
// and each token's sum of squares of x (squares[t], in double): project_blocks over every block,
// added with add_block_sums and rounded, the same numbers as any split of the blocks over threads.
// A bf16 tile is widened a few blocks at a time into an L1-sized piece, never as a whole.
void project(const float* x, int64_t tokens, const FoldedWeight& w, float* P, double* squares);
void project(const bf16* x, int64_t tokens, const FoldedWeight& w, float* P, double* squares);

// dx[t*M + m] += sum_c dP[t*N + c] W[m, c] for m in [m_begin, m_end), columns summed in order.
// m_begin is a multiple of kInputGradBlock.
void add_projection_grad(const float* dP, int64_t tokens, const FoldedWeight& w, int64_t m_begin,
                         int64_t m_end, float* dx);

// The weight gradient of one block of columns [m0, m0 + width), width = min(kWeightGradBlock,
// M - m0), m0 a multiple of kWeightGradBlock: S[c * width + j] = f32 sum over the tokens of
// dP[t*N + c] x[t*M + m0 + j].
void weight_grad_sums(const float* x, const float* dP, int64_t tokens, int64_t M, int64_t N,
                      int64_t m0, float* S);

// dphi and dnorm_weight of the rows [m0, m0 + width) of one weight-gradient block from its
// totals, total[c * width + j] = G[c, m0 + j] in double: dphi[m, c] = float(norm_weight[m] *
// total) and dnorm_weight[m] = sum_c phi[m, c] total, in double and in order of c, each product
// rounded before it is added. The one finish of pre_backward: a single tile passes its f32 sums
// widened to double, the chunked reduction the chunks' sum (weight_grad_finish.cc).
void finish_weight_block(const double* total, int64_t width, int64_t N, int64_t m0,
                         const float* norm_weight, const float* phi, float* dphi,
                         float* dnorm_weight);
// The same from a single tile's f32 sums: the bits of the double form on the sums widened (exact),
// without the widening pass (at T = 1 that pass took about a sixth of pre_backward).
void finish_weight_block(const float* total, int64_t width, int64_t N, int64_t m0,
                         const float* norm_weight, const float* phi, float* dphi,
                         float* dnorm_weight);

}  // namespace mhc::cpu
