// The skinny matrix products of the pre operations (spec: Forward step 2 and its two gradients):
// x [tokens, M] times the folded weight W = norm_weight * phi [M, N], with N = 2n + R small (24
// for n = 4) and M = n*D large. Register-blocked micro-kernels, one per product, each cache
// blocked so the block of W it streams stays in L1 while every token of the tile passes over it.
#pragma once

#include <cstdint>
#include <vector>

namespace mhc::cpu {

// Layouts of W a call needs: the projection streams rows, the input gradient cols.
enum WeightLayout : unsigned { kRowLayout = 1, kColLayout = 2 };

// W in the layouts the kernels stream, folded once per call; only those in `layouts` are built
// (the forward never reads cols, and pre_backward_finish, which is handed P, never reads rows).
class ProjectionWeight {
 public:
  ProjectionWeight(const float* norm_weight, const float* phi, int64_t M, int64_t N,
                   unsigned layouts);

  int64_t M() const { return M_; }
  int64_t N() const { return N_; }
  int64_t padded_N() const { return NP_; }
  const float* rows() const { return rows_.data(); }  // [M, NP]: N padded with zeros to 8 lanes
  // W^T blocked by 256 columns of M: block b holds [N, width] with width = min(256, M - 256 b).
  const float* cols() const { return cols_.data(); }

 private:
  int64_t M_, N_, NP_;
  std::vector<float> rows_, cols_;
};

// P[t*N + c] = sum_m x[t*M + m] W[m, c] for t < tokens. Each output sums f32 products over
// blocks of 128 rows and adds the block sums in double: the error of a length-M dot product
// stays near eps*sqrt(128) relative instead of growing with M.
void project(const float* x, int64_t tokens, const ProjectionWeight& w, float* P);

// dx[t*M + m] += sum_c dP[t*N + c] W[m, c], columns summed in order.
void add_projection_grad(const float* dP, int64_t tokens, const ProjectionWeight& w, float* dx);

// G[c, m] += sum_t dP[t*N + c] x[t*M + m]: the tokens of one call summed in f32 (a tile, at
// most 64), then added to the double accumulator G that spans all tiles. G [N, M] is stored
// blocked by 64 columns of M (weight_grad_index), so the block a register tile adds to is
// contiguous instead of N rows 8*M bytes apart.
void accumulate_weight_grad(const float* x, const float* dP, int64_t tokens, int64_t M, int64_t N,
                            double* G);

// Columns of M per block of G (and per packed block of x in accumulate_weight_grad).
inline constexpr int64_t kWeightGradBlock = 64;

// Where G[c, m] lives in accumulate_weight_grad's layout.
inline int64_t weight_grad_index(int64_t c, int64_t m, int64_t M, int64_t N) {
  const int64_t m0 = m / kWeightGradBlock * kWeightGradBlock;
  const int64_t width = M - m0 < kWeightGradBlock ? M - m0 : kWeightGradBlock;
  return m0 * N + c * width + (m - m0);
}

}  // namespace mhc::cpu
