// TokenCoefficients (src/cpu/coefficients.h), the per-token coefficient math on its own:
// - the Sinkhorn loops compiled for small n give the generic loops' bits, forward and backward,
//   for several tokens through one instance (as a worker runs them);
// - H_res is within one f32 rounding of the float64 reference, plus 1e-12 for the double
//   arithmetic before it (a few roundings of double per step: the kernel multiplies by
//   1 / (s + eps) where the reference divides by s + eps);
// - a NaN logit reaches every output it feeds and no other.
#include "../../src/cpu/coefficients.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "test_util.h"

namespace mhc::test {
namespace {

using Loops = cpu::TokenCoefficients::Loops;

// Random per-token inputs with order-one logits, for `tokens` tokens.
struct Problem {
  Config config;
  bool pre_gates_only = false;
  int64_t n = 0, N = 0, tokens = 3;
  std::vector<float> alpha, bias, P, dh_post, dh_res;
  std::vector<double> r, dh_pre;

  Problem(const Config& c, bool gates_only, uint64_t seed) : config(c), pre_gates_only(gates_only) {
    n = config.n;
    N = pre_gates_only ? n : projection_width(config);
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal;
    std::uniform_real_distribution<double> uniform(0.5, 2.0);
    auto draw = [&](int64_t count) {
      std::vector<float> v(static_cast<size_t>(count));
      for (float& e : v) e = static_cast<float>(normal(rng));
      return v;
    };
    alpha = draw(3);
    bias = draw(N);
    P = draw(tokens * N);
    dh_post = draw(tokens * n);
    dh_res = draw(tokens * n * n);
    for (int64_t t = 0; t < tokens; ++t) r.push_back(uniform(rng));
    for (int64_t e = 0; e < tokens * n; ++e) dh_pre.push_back(normal(rng));
  }
};

// Everything TokenCoefficients writes for the problem's tokens, one instance for all of them.
struct Results {
  std::vector<float> h;   // per token h_pre [n], h_post [n], h_res [n*n]
  std::vector<float> dP;  // per token [N]
  std::vector<double> dr;
  std::vector<double> sums;  // dalpha [3] then dbias [N], over all tokens
};

Results run(const Problem& p, Loops loops) {
  const int64_t n = p.n, N = p.N, per_token = 2 * n + n * n;
  Results out{std::vector<float>(static_cast<size_t>(p.tokens * per_token)),
              std::vector<float>(static_cast<size_t>(p.tokens * N)),
              std::vector<double>(static_cast<size_t>(p.tokens)),
              std::vector<double>(static_cast<size_t>(3 + N))};
  cpu::TokenCoefficients coefficients(p.config, p.alpha.data(), p.bias.data(), p.pre_gates_only,
                                      loops);
  for (int64_t t = 0; t < p.tokens; ++t) {
    float* h = &out.h[t * per_token];
    const float* P = &p.P[t * N];
    coefficients.forward(P, p.r[t], h, p.pre_gates_only ? nullptr : h + n,
                         p.pre_gates_only ? nullptr : h + 2 * n);
    coefficients.backward(P, p.r[t], &p.dh_pre[t * n],
                          p.pre_gates_only ? nullptr : &p.dh_post[t * n],
                          p.pre_gates_only ? nullptr : &p.dh_res[t * n * n], &out.dP[t * N],
                          &out.dr[t], out.sums.data(), out.sums.data() + 3);
  }
  return out;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

std::string describe_mix(const Config& config) {
  return "n " + std::to_string(config.n) + ", " + to_string(config.mix) + ", iters " +
         std::to_string(config.sinkhorn_iters);
}

// (n, sinkhorn_iters)
class SinkhornLoops : public testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(SinkhornLoops, SpecializedEqualsGenericBitForBit) {
  Config config;
  std::tie(config.n, config.sinkhorn_iters) = GetParam();
  const uint64_t seed = fresh_seed();
  const Problem problem(config, false, seed);
  const Results specialized = run(problem, Loops::specialized);
  const Results generic = run(problem, Loops::generic);
  const std::string context = describe_mix(config) + ", seed " + std::to_string(seed);
  EXPECT_TRUE(same_bits(specialized.h, generic.h)) << "h_pre, h_post, h_res: " << context;
  EXPECT_TRUE(same_bits(specialized.dP, generic.dP)) << "dP: " << context;
  EXPECT_TRUE(same_bits(specialized.dr, generic.dr)) << "dr: " << context;
  EXPECT_TRUE(same_bits(specialized.sums, generic.sums)) << "dalpha, dbias: " << context;
}

// n = 4 has the specialized kernel; the other n take the generic loops either way.
INSTANTIATE_TEST_SUITE_P(WithAndWithoutKernel, SinkhornLoops,
                         testing::Combine(testing::Values(1, 2, 3, 4, 5, 8, 9),
                                          testing::Values(1, 2, 20)));

// (n, mix, sinkhorn_iters)
class CoefficientsReference : public testing::TestWithParam<std::tuple<int64_t, Mix, int64_t>> {};

TEST_P(CoefficientsReference, HResWithinOneF32Rounding) {
  Config config;
  std::tie(config.n, config.mix, config.sinkhorn_iters) = GetParam();
  if (config.mix == Mix::permutations && config.n > 6) GTEST_SKIP() << "n! columns";
  const uint64_t seed = fresh_seed();
  const Problem p(config, false, seed);
  const int64_t n = p.n, N = p.N, per_token = 2 * n + n * n;
  for (Loops loops : {Loops::specialized, Loops::generic}) {
    const Results got = run(p, loops);
    for (int64_t t = 0; t < p.tokens; ++t) {
      Vec logits(static_cast<size_t>(N - 2 * n));  // the kernel's own expression, in double
      for (int64_t c = 2 * n; c < N; ++c) {
        logits[c - 2 * n] = double{p.alpha[2]} * (p.r[t] * p.P[t * N + c]) + p.bias[c];
      }
      const Vec want = reference::mix_matrix(config, logits.data());
      for (int64_t e = 0; e < n * n; ++e) {
        const double value = got.h[t * per_token + 2 * n + e];
        const double bound = 0x1p-24 * std::fabs(want[e]) + 1e-12;
        EXPECT_TRUE(std::fabs(value - want[e]) <= bound)
            << "token " << t << " h_res[" << e << "] = " << value << ", reference " << want[e]
            << ": " << describe_mix(config) << ", seed " << seed;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CoefficientsReference,
                         testing::Combine(testing::Values(1, 2, 3, 4, 5, 8, 16),
                                          testing::Values(Mix::sinkhorn, Mix::permutations),
                                          testing::Values(1, 20)));

// The head's gates alone (pre_gates_only, N = n): the same bits as the pre columns of the full
// problem (h_pre, dP, dalpha_pre, dbias), and nothing read or written beyond them.
TEST(CoefficientsPreGatesOnly, EqualThePreColumnsOfTheFullProblem) {
  Config config;
  config.n = 4;
  const uint64_t seed = fresh_seed();
  const Problem full(config, false, seed);
  Problem gates(config, true, seed);
  const int64_t n = config.n, N = full.N, per_token = 2 * n + n * n;
  gates.alpha = full.alpha;
  gates.r = full.r;
  gates.dh_pre = full.dh_pre;
  gates.bias.assign(full.bias.begin(), full.bias.begin() + n);
  gates.P.clear();
  for (int64_t t = 0; t < full.tokens; ++t) {
    gates.P.insert(gates.P.end(), full.P.begin() + t * N, full.P.begin() + t * N + n);
  }
  const Results want = run(full, Loops::specialized);
  const Results got = run(gates, Loops::specialized);
  for (int64_t t = 0; t < full.tokens; ++t) {
    for (int64_t k = 0; k < n; ++k) {
      EXPECT_EQ(got.h[t * per_token + k], want.h[t * per_token + k]) << "seed " << seed;
      EXPECT_EQ(got.dP[t * n + k], want.dP[t * N + k]) << "seed " << seed;
    }
    for (int64_t e = n; e < per_token; ++e) EXPECT_EQ(got.h[t * per_token + e], 0.0f);
  }
  EXPECT_EQ(got.sums[0], want.sums[0]) << "dalpha_pre, seed " << seed;
  EXPECT_EQ(got.sums[1], 0.0) << "dalpha_post";
  EXPECT_EQ(got.sums[2], 0.0) << "dalpha_res";
  for (int64_t k = 0; k < n; ++k) EXPECT_EQ(got.sums[3 + k], want.sums[3 + k]) << "seed " << seed;
}

// NaN in one logit (through P): which outputs it reaches. A res logit reaches all of H_res (the
// softmax row, then every column sum), the res columns of dP, dr, dalpha_res and the res biases'
// gradients; a pre logit only its own gate, dP column, dbias, dr and dalpha_pre.
class CoefficientsNaN : public testing::TestWithParam<std::tuple<Mix, Loops>> {};

TEST_P(CoefficientsNaN, ReachesWhatItFeeds) {
  Config config;
  config.n = 4;
  std::tie(config.mix, std::ignore) = GetParam();
  const Loops loops = std::get<1>(GetParam());
  const uint64_t seed = fresh_seed();
  const int64_t n = config.n;
  for (const bool in_res : {true, false}) {
    Problem p(config, false, seed);
    p.tokens = 1;
    const int64_t N = p.N, bad = in_res ? 2 * n + 1 : 1;
    p.P[bad] = std::numeric_limits<float>::quiet_NaN();
    const Results got = run(p, loops);
    const std::string context = std::string(in_res ? "res" : "pre") + " logit, " +
                                to_string(config.mix) + ", seed " + std::to_string(seed);
    for (int64_t e = 0; e < 2 * n + n * n; ++e) {
      const bool fed = in_res ? e >= 2 * n : e == bad;
      EXPECT_EQ(std::isnan(got.h[e]), fed) << "h[" << e << "], " << context;
    }
    for (int64_t c = 0; c < N; ++c) {
      const bool fed = in_res ? c >= 2 * n : c == bad;
      EXPECT_EQ(std::isnan(got.dP[c]), fed) << "dP[" << c << "], " << context;
      EXPECT_EQ(std::isnan(got.sums[3 + c]), fed) << "dbias[" << c << "], " << context;
    }
    EXPECT_TRUE(std::isnan(got.dr[0])) << context;
    for (int group = 0; group < 3; ++group) {
      EXPECT_EQ(std::isnan(got.sums[group]), group == (in_res ? 2 : 0))
          << "dalpha[" << group << "], " << context;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(BothMixes, CoefficientsNaN,
                         testing::Combine(testing::Values(Mix::sinkhorn, Mix::permutations),
                                          testing::Values(Loops::specialized, Loops::generic)));

}  // namespace
}  // namespace mhc::test
