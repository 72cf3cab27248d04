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
    ASSERT_EQ(values.size(), analytic.size()) << name;
    Vec numeric(values.size());
    for (size_t k = 0; k < values.size(); ++k) {
      const double saved = values[k];
      const double h = 1e-5 * std::max(1.0, std::fabs(saved));
      values[k] = saved + h;
      const double up = loss();
      values[k] = saved - h;
      const double down = loss();
      values[k] = saved;
      numeric[k] = (up - down) / (2.0 * h);
    }
    const double error = relative_error(analytic, numeric);
    EXPECT_TRUE(error <= 1e-6) << name << ": backward vs finite differences, relative error "
                               << error << " (seed " << seed << ")";
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
