// The float64 reference pinned two ways: hand-computed constants, and its backward against
// central finite differences of its forward for every input and parameter.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "test_util.h"

namespace mhc::test {
namespace {

// n = 1, D = 2, x = [3, 4], phi picks x0 for the pre logit and x1 for the post logit:
// ms = 12.5, r = 1/sqrt(12.5 + 1e-6); h_pre = sigmoid(3r) + 1e-6, h_post = 2 sigmoid(4r);
// a 1 x 1 Sinkhorn maps v -> v / (v + eps) 39 times from 1 + eps, which lands on 1 - eps.
// Expected values computed independently (Python, float64).
TEST(ReferenceConstants, OneStreamSinkhorn) {
  Config config;
  config.n = 1;
  config.dim = 2;
  reference::Params params{
      {1.0, 1.0}, {1.0, 0.0, 0.0, 0.0, 1.0, 0.0}, {1.0, 1.0, 1.0}, {0.0, 0.0, 0.5}};
  const reference::PreForward f = reference::pre_forward(config, {3.0, 4.0}, params);
  EXPECT_NEAR(f.h_pre[0], 0.7002592874662105, 1e-12);
  EXPECT_NEAR(f.h_post[0], 1.5121835750142498, 1e-12);
  EXPECT_NEAR(f.h_res[0], 0.9999990000000001, 1e-12);
  EXPECT_NEAR(f.layer_in[0], 2.1007778623986315, 1e-12);
  EXPECT_NEAR(f.layer_in[1], 2.801037149864842, 1e-12);
}

// n = 2 permutations with phi = 0, so the logits are the bias: the res logits (ln 3, 0) give
// weights (3/4, 1/4) on (identity, swap); h_pre = sigmoid(0) + eps.
TEST(ReferenceConstants, TwoStreamPermutations) {
  Config config;
  config.n = 2;
  config.dim = 1;
  config.mix = Mix::permutations;
  reference::Params params{
      {1.0, 1.0}, Vec(12, 0.0), {1.0, 1.0, 1.0}, {0.0, 0.0, 0.0, 0.0, std::log(3.0), 0.0}};
  const reference::PreForward f = reference::pre_forward(config, {1.0, 2.0}, params);
  EXPECT_NEAR(f.h_res[0], 0.75, 1e-12);
  EXPECT_NEAR(f.h_res[1], 0.25, 1e-12);
  EXPECT_NEAR(f.h_res[2], 0.25, 1e-12);
  EXPECT_NEAR(f.h_res[3], 0.75, 1e-12);
  EXPECT_NEAR(f.layer_in[0], 1.5 + 3e-6, 1e-12);
  EXPECT_NEAR(f.h_post[0], 1.0, 1e-12);
  // out = H_res^T x + h_post * layer_out: stream 0 gets 0.75*1 + 0.25*2 + 1*10.
  const Vec out = reference::post_forward(config, {1.0, 2.0}, {10.0}, f.h_post, f.h_res);
  EXPECT_NEAR(out[0], 11.25, 1e-13);
  EXPECT_NEAR(out[1], 11.75, 1e-13);
}

// Sinkhorn (spec: Forward step 5) against an independent NumPy evaluation of the spec's text
// (tests/cpp/pins/sinkhorn_pins.py, which printed these rows): asymmetric logits
// A[i, j] = 0.7 (i + 1) (-1)^j + 0.3 j - 0.2 i^2, n = 2 and 3, 1 and 3 iterations, two eps values.
// One fewer iteration, a last step over rows, or a transposed result each miss by > 1e-2.
struct SinkhornPin {
  int64_t n, iters;
  double eps;
  Vec h_res;
};

TEST(ReferenceConstants, SinkhornAgainstIndependentEvaluation) {
  const SinkhornPin pins[] = {
      {2,
       1,
       1e-06,
       {0.44807626526658617, 0.7670149579360338, 0.5519231375063126, 0.23298197082102956}},
      {2,
       3,
       0.05,
       {0.35360815790613975, 0.6000924233643959, 0.5968799362053969, 0.3494046855375013}},
      {3,
       1,
       0.05,
       {0.30249454856446023, 0.4561745494616388, 0.3067131928553069, 0.325056637102517,
        0.22958653660140324, 0.3310884492098994, 0.33123233160121085, 0.1675648694968441,
        0.3377604439731234}},
      {3,
       3,
       1e-06,
       {0.1937868887293148, 0.6270211951786229, 0.1937868686198446, 0.35654097793107203,
        0.2844895812170813, 0.35654098127548733, 0.44967114990580226, 0.08848818873915994,
        0.44967116667085955}},
  };
  for (const SinkhornPin& pin : pins) {
    Config config;
    config.n = pin.n;
    config.dim = 1;
    config.sinkhorn_iters = pin.iters;
    config.sinkhorn_eps = static_cast<float>(pin.eps);
    Vec logits;
    for (int64_t i = 0; i < pin.n; ++i) {
      for (int64_t j = 0; j < pin.n; ++j) {
        logits.push_back(0.7 * static_cast<double>(i + 1) * (j % 2 == 0 ? 1.0 : -1.0) +
                         0.3 * static_cast<double>(j) - 0.2 * static_cast<double>(i * i));
      }
    }
    const Vec h_res = reference::mix_matrix(config, logits.data());
    ASSERT_EQ(h_res.size(), pin.h_res.size());
    for (size_t e = 0; e < h_res.size(); ++e) {
      // The eps the reference sees is the f32 config value; the pins used the decimal one.
      EXPECT_NEAR(h_res[e], pin.h_res[e], 1e-7)
          << "n=" << pin.n << " iters=" << pin.iters << " eps=" << pin.eps << " element " << e;
    }
  }
}

// n = 3, permutations, phi = 0 so the logits are the bias: residual logits ln(1, 1, 1, 5, 1, 1)
// give weights 0.1 on each permutation but 0.5 on p3 = (1, 2, 0) (lexicographic order: (0,1,2),
// (0,2,1), (1,0,2), (1,2,0), (2,0,1), (2,1,0)). Each H_res[i][j] collects the permutations with
// perm(i) = j: 0.6 where j = i + 1 (mod 3), 0.2 elsewhere, an asymmetric matrix. Post-apply then
// sends stream i mostly to stream i + 1: out[j] = sum_i H_res[i][j] x[i] + h_post[j] layer_out.
TEST(ReferenceConstants, ThreeStreamCycle) {
  Config config;
  config.n = 3;
  config.dim = 2;
  config.mix = Mix::permutations;
  const int64_t N = projection_width(config);  // 6 + 6
  Vec bias(static_cast<size_t>(N), 0.0);
  for (int64_t p = 0; p < 6; ++p) bias[6 + p] = std::log(p == 3 ? 5.0 : 1.0);
  reference::Params params{
      Vec(6, 1.0), Vec(static_cast<size_t>(6 * N), 0.0), {1.0, 1.0, 1.0}, bias};
  const Vec x{1.0, 2.0, 3.0, 4.0, 5.0, 6.0};  // streams (1, 2), (3, 4), (5, 6)
  const reference::PreForward f = reference::pre_forward(config, x, params);
  const double cycle[9] = {0.2, 0.6, 0.2, 0.2, 0.2, 0.6, 0.6, 0.2, 0.2};
  for (int e = 0; e < 9; ++e) EXPECT_NEAR(f.h_res[e], cycle[e], 1e-12) << "H_res element " << e;
  // h_pre = sigmoid(0) + 1e-6 on every stream: layer_in = 0.500001 * (1 + 3 + 5, 2 + 4 + 6).
  EXPECT_NEAR(f.layer_in[0], 9.0 * 0.500001, 1e-12);
  EXPECT_NEAR(f.layer_in[1], 12.0 * 0.500001, 1e-12);

  // The exact cycle, H_res[i][j] = 1 where j = i + 1: out[j] = x[j - 1] + h_post[j] layer_out.
  const Vec exact_cycle{0, 1, 0, 0, 0, 1, 1, 0, 0};
  const Vec h_post{0.5, 1.0, 2.0}, layer_out{10.0, 20.0};
  const Vec out = reference::post_forward(config, x, layer_out, h_post, exact_cycle);
  const Vec expected_out{5.0 + 5.0, 6.0 + 10.0, 1.0 + 10.0, 2.0 + 20.0, 3.0 + 20.0, 4.0 + 40.0};
  for (int e = 0; e < 6; ++e) EXPECT_NEAR(out[e], expected_out[e], 1e-12) << "out element " << e;

  // Backward of the same: dx_partial[i] = g[i + 1], dlayer_out = sum_j h_post[j] g[j],
  // dh_res[i][j] = <x[i], g[j]>, dh_post[j] = <layer_out, g[j]>.
  const Vec g{1.0, -1.0, 2.0, 0.5, -3.0, 4.0};  // cotangent streams (1, -1), (2, 0.5), (-3, 4)
  const reference::PostBackward b =
      reference::post_backward(config, g, x, layer_out, h_post, exact_cycle);
  const Vec expected_dx{2.0, 0.5, -3.0, 4.0, 1.0, -1.0};
  for (int e = 0; e < 6; ++e) EXPECT_NEAR(b.dx_partial[e], expected_dx[e], 1e-12) << e;
  EXPECT_NEAR(b.dlayer_out[0], 0.5 * 1.0 + 1.0 * 2.0 + 2.0 * -3.0, 1e-12);
  EXPECT_NEAR(b.dlayer_out[1], 0.5 * -1.0 + 1.0 * 0.5 + 2.0 * 4.0, 1e-12);
  EXPECT_NEAR(b.dh_post[2], 10.0 * -3.0 + 20.0 * 4.0, 1e-12);
  EXPECT_NEAR(b.dh_res[0 * 3 + 1], 1.0 * 2.0 + 2.0 * 0.5, 1e-12);   // <x0, g1>
  EXPECT_NEAR(b.dh_res[1 * 3 + 0], 3.0 * 1.0 + 4.0 * -1.0, 1e-12);  // <x1, g0>
  EXPECT_NEAR(b.dh_res[2 * 3 + 1], 5.0 * 2.0 + 6.0 * 0.5, 1e-12);   // <x2, g1>
}

struct FdCase {
  int64_t n, D, T, iters;
  Mix mix;
};

class ReferenceFiniteDifferences : public testing::TestWithParam<FdCase> {};

// L = <layer_in, w_in> + <out, w_out> with random weights; layer_out is an independent input
// (it is whatever the caller's F returned).
TEST_P(ReferenceFiniteDifferences, EveryInputAndParameter) {
  const FdCase& c = GetParam();
  Config config;
  config.n = c.n;
  config.dim = c.D;
  config.mix = c.mix;
  config.sinkhorn_iters = c.iters;
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const int64_t n = c.n, D = c.D, T = c.T;
  Vec x = random_normal(rng, T * n * D);
  Vec layer_out = random_normal(rng, T * D);
  reference::Params params = random_params(rng, config);
  const Vec w_in = random_normal(rng, T * D);
  const Vec w_out = random_normal(rng, T * n * D);

  auto loss = [&]() {
    const reference::PreForward f = reference::pre_forward(config, x, params);
    const Vec out = reference::post_forward(config, x, layer_out, f.h_post, f.h_res);
    double total = 0.0;
    for (size_t k = 0; k < w_in.size(); ++k) total += f.layer_in[k] * w_in[k];
    for (size_t k = 0; k < w_out.size(); ++k) total += out[k] * w_out[k];
    return total;
  };

  const reference::PreForward f = reference::pre_forward(config, x, params);
  const reference::PostBackward pb =
      reference::post_backward(config, w_out, x, layer_out, f.h_post, f.h_res);
  const reference::PreBackward b =
      reference::pre_backward(config, w_in, pb.dx_partial, pb.dh_post, pb.dh_res, x, params);

  auto check = [&](const char* name, Vec& values, const Vec& analytic) {
    expect_finite_differences(name, values, analytic, loss, seed);
  };
  check("x", x, b.dx);
  check("layer_out", layer_out, pb.dlayer_out);
  check("norm_weight", params.norm_weight, b.grads.norm_weight);
  check("phi", params.phi, b.grads.phi);
  check("alpha", params.alpha, b.grads.alpha);
  check("bias", params.bias, b.grads.bias);
}

INSTANTIATE_TEST_SUITE_P(
    SmallShapes, ReferenceFiniteDifferences,
    testing::Values(FdCase{1, 3, 2, 20, Mix::sinkhorn}, FdCase{2, 3, 2, 1, Mix::sinkhorn},
                    FdCase{2, 3, 2, 3, Mix::sinkhorn}, FdCase{3, 2, 3, 20, Mix::sinkhorn},
                    FdCase{4, 2, 2, 20, Mix::sinkhorn}, FdCase{2, 3, 2, 20, Mix::permutations},
                    FdCase{3, 2, 3, 20, Mix::permutations}, FdCase{4, 1, 2, 20, Mix::permutations}),
    [](const testing::TestParamInfo<FdCase>& info) {
      const FdCase& c = info.param;
      return std::string(to_string(c.mix)) + "_n" + std::to_string(c.n) + "_D" +
             std::to_string(c.D) + "_iters" + std::to_string(c.iters);
    });

}  // namespace
}  // namespace mhc::test
