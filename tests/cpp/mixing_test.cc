// H_res properties: Sinkhorn column sums, the permutation enumeration, double stochasticity.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "test_util.h"

namespace mhc::test {
namespace {

// H_res from the f32 kernel for T random tokens with logits of order one.
Vec kernel_h_res(const Config& config, int64_t T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const reference::Params params = random_params(rng, config);
  HostParams host_params(config, params);
  const int64_t n = config.n, D = config.dim;
  HostTensor x = HostTensor::from(DType::f32, {T, n, D}, random_normal(rng, T * n * D));
  HostTensor layer_in(DType::f32, {T, D}), h_pre(DType::f32, {T, n}), h_post(DType::f32, {T, n}),
      h_res(DType::f32, {T, n, n});
  pre_forward(config, x.ref(), host_params.view(),
              PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
  return h_res.to_double();
}

// After the final column step a column sums to s / (s + eps), s being its mass before the step,
// so it is off by about eps / s: "within about sinkhorn_eps" holds for masses of order one. With
// 20 iterations the rows are balanced and s is near 1; with one iteration s is a column of the
// row softmax and can be small. The kernel is therefore checked against the float64 reference's
// column sums (1e-6) at any iters, and against 1 (1e-5) at 20 iterations; the one-iteration
// formula itself is checked on explicit logits below.
class SinkhornColumns : public testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(SinkhornColumns, SumToOne) {
  Config config;
  std::tie(config.n, config.sinkhorn_iters) = GetParam();
  config.dim = 16;
  const int64_t n = config.n, D = config.dim, T = 9;
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const reference::Params params = random_params(rng, config);
  HostParams host_params(config, params);
  HostTensor x = HostTensor::from(DType::f32, {T, n, D}, random_normal(rng, T * n * D));
  HostTensor layer_in(DType::f32, {T, D}), h_pre(DType::f32, {T, n}), h_post(DType::f32, {T, n}),
      h_res(DType::f32, {T, n, n});
  pre_forward(config, x.ref(), host_params.view(),
              PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
  const Vec got = h_res.to_double();
  const Vec want = reference::pre_forward(config, x.to_double(), params).h_res;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < n; ++j) {
      double column = 0.0, reference_column = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        const double value = got[(t * n + i) * n + j];
        EXPECT_TRUE(value >= 0.0) << "negative entry, seed " << seed;
        column += value;
        reference_column += want[(t * n + i) * n + j];
      }
      EXPECT_TRUE(std::fabs(column - reference_column) <= 1e-6)
          << "token " << t << " column " << j << ": kernel " << column << ", reference "
          << reference_column << " (seed " << seed << ")";
      if (config.sinkhorn_iters == 20) {
        EXPECT_TRUE(std::fabs(column - 1.0) <= 1e-5)
            << "token " << t << " column " << j << " sums to " << column << " (seed " << seed
            << ")";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ItersAndStreams, SinkhornColumns,
                         testing::Combine(testing::Values(2, 4, 8, 16), testing::Values(1, 20)));

// One iteration, explicit logits: every column sums to exactly s / (s + eps) with s the column's
// mass after softmax + eps, and is within 1e-5 of 1 when that mass is at least 0.1.
TEST(Sinkhorn, OneIterationColumnSumsFollowTheFormula) {
  Config config;
  config.n = 4;
  config.sinkhorn_iters = 1;
  const double eps = config.sinkhorn_eps;
  std::mt19937_64 rng(fresh_seed());
  const Vec logits = random_normal(rng, 16, 1.0);
  const Vec h_res = reference::mix_matrix(config, logits.data());
  for (int64_t j = 0; j < 4; ++j) {
    double mass = 0.0, column = 0.0;
    for (int64_t i = 0; i < 4; ++i) {
      double row_total = 0.0;
      for (int64_t k = 0; k < 4; ++k) row_total += std::exp(logits[i * 4 + k]);
      mass += std::exp(logits[i * 4 + j]) / row_total + eps;
      column += h_res[i * 4 + j];
    }
    EXPECT_NEAR(column, mass / (mass + eps), 1e-12);
    if (mass >= 0.1) {
      EXPECT_NEAR(column, 1.0, 1e-5);
    }
  }
}

TEST(Sinkhorn, ReferenceColumnsSumToOneAfterTwentyIterations) {
  Config config;
  config.n = 4;
  std::mt19937_64 rng(fresh_seed());
  const Vec logits = random_normal(rng, 16, 1.0);
  const Vec h_res = reference::mix_matrix(config, logits.data());
  for (int64_t j = 0; j < 4; ++j) {
    double column = 0.0;
    for (int64_t i = 0; i < 4; ++i) column += h_res[i * 4 + j];
    EXPECT_NEAR(column, 1.0, 1e-5);
  }
}

TEST(Permutations, LexicographicFromIdentity) {
  for (int64_t n = 1; n <= kMaxPermutationStreams; ++n) {
    Config config;
    config.n = n;
    config.mix = Mix::permutations;
    const int64_t count = residual_logits(config);
    std::vector<int> identity(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) identity[i] = i;
    EXPECT_EQ(permutation(n, 0), identity);
    std::set<std::vector<int>> seen;
    std::vector<int> previous;
    for (int64_t p = 0; p < count; ++p) {
      std::vector<int> perm = permutation(n, p);
      std::vector<int> sorted = perm;
      std::sort(sorted.begin(), sorted.end());
      EXPECT_EQ(sorted, identity) << "not a permutation: n=" << n << " p=" << p;
      if (p > 0) {
        EXPECT_TRUE(previous < perm) << "not lexicographic at n=" << n << " p=" << p;
      }
      seen.insert(perm);
      previous = perm;
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), count);
    EXPECT_TRUE(std::next_permutation(previous.begin(), previous.end()) == false)
        << "last permutation must be the reversed order";
  }
  EXPECT_EQ(permutation(3, 1), (std::vector<int>{0, 2, 1}));
  EXPECT_EQ(permutation(3, 5), (std::vector<int>{2, 1, 0}));
  EXPECT_THROW(permutation(3, 6), Error);
  EXPECT_THROW(permutation(7, 0), Error);
}

TEST(Permutations, KernelMixIsDoublyStochastic) {
  for (int64_t n : {2, 3, 4, 5}) {
    Config config;
    config.n = n;
    config.dim = 8;
    config.mix = Mix::permutations;
    const int64_t T = 5;
    const uint64_t seed = fresh_seed();
    const Vec h_res = kernel_h_res(config, T, seed);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < n; ++k) {
        double row = 0.0, column = 0.0;
        for (int64_t e = 0; e < n; ++e) {
          row += h_res[(t * n + k) * n + e];
          column += h_res[(t * n + e) * n + k];
        }
        EXPECT_NEAR(row, 1.0, 1e-6) << "n=" << n << " seed " << seed;
        EXPECT_NEAR(column, 1.0, 1e-6) << "n=" << n << " seed " << seed;
      }
    }
  }
}

// A dominant logit on p = 0 must give the identity, on p = 1 the swap of the last two streams.
TEST(Permutations, DominantLogitSelectsThatPermutation) {
  Config config;
  config.n = 3;
  config.mix = Mix::permutations;
  for (int64_t p : {0, 1, 5}) {
    Vec logits(6, 0.0);
    logits[static_cast<size_t>(p)] = 60.0;
    const Vec h_res = reference::mix_matrix(config, logits.data());
    const std::vector<int> perm = permutation(3, p);
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t j = 0; j < 3; ++j) {
        EXPECT_NEAR(h_res[i * 3 + j], perm[i] == j ? 1.0 : 0.0, 1e-12) << "p=" << p;
      }
    }
  }
}

}  // namespace
}  // namespace mhc::test
