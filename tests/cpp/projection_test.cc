// The projection's fixed summation order, bit for bit (src/cpu/projection.h): through
// pre_forward_partials, whose [T, N+1] rows are the projection P and the sum of squares, against
// a scalar loop that spells the order out. Every column of a block of 128 rows is one f32 FMA
// chain over the rows in order (narrow W, N <= 8: 16 lanes over the rows, then the halving sum
// and the tail); the block sums are added in double in block order and rounded once. Whatever
// vectors a kernel packs the columns into (3 x 8 lanes, 16 + 8, 2 x 16, a last vector that
// overlaps the one before), whatever token blocking or thread split, it must give these bits: so
// both SIMD paths give the same numbers (the CTest entry projection_8_lanes runs this with
// MHC_NO_AVX512=1). The widths N = 2n + n^2 reach every column plan of the 16-lane kernels.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "mhc/ops.h"

namespace mhc {
namespace {

constexpr int64_t kBlock = 128;  // kProjectionBlock

// A float's bits, so NaNs and signed zeros compare exactly.
uint32_t bits(float value) {
  uint32_t out;
  std::memcpy(&out, &value, sizeof(out));
  return out;
}

// The 16 lanes' sum in the kernels' fixed order (lane i + lane i + 8, then + 4, then the pairs).
float halving_sum(const float* lanes) {
  float h8[8], h4[4];
  for (int i = 0; i < 8; ++i) h8[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; ++i) h4[i] = h8[i] + h8[i + 4];
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// A block's f32 sum of a[r] * b[r] over rows [0, rows) in 16 lanes (lane l: the rows l mod 16 of
// the whole 16-row groups, in order), the lanes halved, then the tail rows added in order.
float lane_sum(const float* a, const float* b, int64_t rows) {
  float lanes[16] = {};
  int64_t r = 0;
  for (; r + 16 <= rows; r += 16) {
    for (int l = 0; l < 16; ++l) lanes[l] = std::fma(a[r + l], b[r + l], lanes[l]);
  }
  float tail = 0.0f;
  for (; r < rows; ++r) tail = std::fma(a[r], b[r], tail);
  return halving_sum(lanes) + tail;
}

// The partials row of one token: P[c] and, last, the sum of squares.
std::vector<float> expected_row(const float* x, const float* norm_weight, const float* phi,
                                int64_t M, int64_t N) {
  std::vector<double> wide(static_cast<size_t>(N + 1), 0.0);
  std::vector<float> w(static_cast<size_t>(kBlock));
  for (int64_t m0 = 0; m0 < M; m0 += kBlock) {
    const int64_t rows = std::min(kBlock, M - m0);
    for (int64_t c = 0; c < N; ++c) {
      for (int64_t r = 0; r < rows; ++r) w[r] = norm_weight[m0 + r] * phi[(m0 + r) * N + c];
      float sum = 0.0f;
      if (N <= 8) {
        sum = lane_sum(x + m0, w.data(), rows);
      } else {
        for (int64_t r = 0; r < rows; ++r) sum = std::fma(x[m0 + r], w[r], sum);
      }
      wide[c] += static_cast<double>(sum);
    }
    wide[N] += static_cast<double>(lane_sum(x + m0, x + m0, rows));
  }
  std::vector<float> row(static_cast<size_t>(N + 1));
  for (int64_t c = 0; c <= N; ++c) row[c] = static_cast<float>(wide[c]);
  return row;
}

struct OrderCase {
  int64_t n, D;
  Mix mix;
};

class ProjectionOrder : public testing::TestWithParam<OrderCase> {
 protected:
  void TearDown() override { set_num_threads(0); }
};

TEST_P(ProjectionOrder, SameBitsAsTheScalarLoop) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("fma")) GTEST_SKIP() << "the kernels contract into FMA only there";
  const OrderCase& oc = GetParam();
  Config config;
  config.n = oc.n;
  config.dim = oc.D;
  config.mix = oc.mix;
  const int64_t M = flat_width(config), N = projection_width(config);
  std::mt19937 rng(static_cast<uint32_t>(oc.n * 1000 + oc.D));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> norm_weight(static_cast<size_t>(M)), phi(static_cast<size_t>(M * N));
  for (float& v : norm_weight) v = 1.0f + 0.3f * normal(rng);
  for (float& v : phi) v = 0.05f * normal(rng);
  // T = 1 and 5 split the rows over threads with W folded in registers, 21 runs blocks of 8
  // tokens, then 4, then 1, from one tile; 70 takes several tiles at small M.
  for (int64_t T : {1, 5, 21, 70}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      for (int threads : {1, 2}) {
        set_num_threads(threads);
        std::vector<float> x(static_cast<size_t>(T * M));
        for (float& v : x) v = normal(rng);
        std::vector<bf16> x_bf16(x.size());
        for (size_t k = 0; k < x.size(); ++k) {
          x_bf16[k] = to_bf16(x[k]);
          x[k] = to_float(x_bf16[k]);  // the bf16 input, widened exactly
        }
        const void* data = dtype == DType::f32 ? static_cast<const void*>(x.data())
                                               : static_cast<const void*>(x_bf16.data());
        std::vector<float> partials(static_cast<size_t>(T * (N + 1)), std::nanf(""));
        pre_forward_partials(config, TensorRef(data, dtype, {T, oc.n, oc.D}),
                             TensorRef(norm_weight.data(), {M}), TensorRef(phi.data(), {M, N}),
                             MutableTensorRef(partials.data(), DType::f32, {T, N + 1}));
        for (int64_t t = 0; t < T; ++t) {
          const std::vector<float> want =
              expected_row(x.data() + t * M, norm_weight.data(), phi.data(), M, N);
          for (int64_t c = 0; c <= N; ++c) {
            const float got = partials[static_cast<size_t>(t * (N + 1) + c)];
            ASSERT_EQ(bits(got), bits(want[c]))
                << "column " << c << (c == N ? " (sum of squares)" : "") << " of token " << t
                << ": " << got << " instead of " << want[c] << " (T=" << T << ", "
                << to_string(dtype) << ", " << threads << " threads)";
          }
        }
      }
    }
  }
}

std::string order_case_name(const testing::TestParamInfo<OrderCase>& info) {
  return "n" + std::to_string(info.param.n) + "_D" + std::to_string(info.param.D) + "_" +
         to_string(info.param.mix);
}

// N = 3, 8 (narrow), 15 (8-lane kernels on both paths), 24 (16 + 8), 35 (2 x 16, then 8 alone),
// 63 (2 x 16, then two 16-lane vectors that overlap), 143 (a last 16-lane vector that overlaps),
// 168 (2 x 16 five times, then 8); permutations 12 and 32 (2 x 16). D = 130 leaves a last block of
// a few rows, D = 1 one block of n rows.
INSTANTIATE_TEST_SUITE_P(
    Widths, ProjectionOrder,
    testing::Values(OrderCase{1, 130, Mix::sinkhorn}, OrderCase{2, 130, Mix::sinkhorn},
                    OrderCase{3, 130, Mix::sinkhorn}, OrderCase{4, 130, Mix::sinkhorn},
                    OrderCase{4, 1, Mix::sinkhorn}, OrderCase{5, 130, Mix::sinkhorn},
                    OrderCase{7, 33, Mix::sinkhorn}, OrderCase{11, 20, Mix::sinkhorn},
                    OrderCase{12, 20, Mix::sinkhorn}, OrderCase{3, 130, Mix::permutations},
                    OrderCase{4, 130, Mix::permutations}),
    order_case_name);

}  // namespace
}  // namespace mhc
