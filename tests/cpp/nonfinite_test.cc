// Non-finite policy (README: Guarantees): NaN or Inf in an input reaches every output that
// depends on it and no other; the kernels never hang, crash or throw on such values.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "test_util.h"

namespace mhc::test {
namespace {

constexpr int64_t kT = 6, kN = 3, kD = 9, kBad = 2;  // token kBad gets the non-finite value

bool all_finite(const Vec& v, int64_t begin, int64_t end) {
  for (int64_t k = begin; k < end; ++k) {
    if (!std::isfinite(v[static_cast<size_t>(k)])) return false;
  }
  return true;
}
bool any_nonfinite(const Vec& v, int64_t begin, int64_t end) { return !all_finite(v, begin, end); }

// Per-token outputs: the bad token's rows are non-finite, every other token's rows finite.
void expect_only_token(const char* name, const HostTensor& out, int64_t per_token, double value) {
  const Vec v = out.to_double();
  for (int64_t t = 0; t < kT; ++t) {
    if (t == kBad) {
      EXPECT_TRUE(any_nonfinite(v, t * per_token, (t + 1) * per_token))
          << name << ": " << value << " in token " << kBad << " did not reach its output";
    } else {
      EXPECT_TRUE(all_finite(v, t * per_token, (t + 1) * per_token))
          << name << ": token " << t << " was contaminated by token " << kBad;
    }
  }
}

class NonFinite : public testing::TestWithParam<std::tuple<double, Mix>> {
 protected:
  void SetUp() override {
    config.n = kN;
    config.dim = kD;
    config.mix = std::get<1>(GetParam());
    value = std::get<0>(GetParam());
    rng.seed(fresh_seed());
    params = random_params(rng, config);
  }
  HostTensor random(std::vector<int64_t> shape) {
    int64_t count = 1;
    for (int64_t e : shape) count *= e;
    return HostTensor::from(DType::f32, std::move(shape), random_normal(rng, count));
  }
  // Sets one element of token kBad.
  void poison_token(HostTensor& tensor, int64_t per_token) {
    Vec v = tensor.to_double();
    v[static_cast<size_t>(kBad * per_token + per_token / 2)] = value;
    tensor.set(v);
  }

  Config config;
  double value = 0.0;
  std::mt19937_64 rng;
  reference::Params params;
};

TEST_P(NonFinite, InActivationsStaysInItsToken) {
  HostParams host_params(config, params);
  HostTensor x = random({kT, kN, kD});
  poison_token(x, kN * kD);
  HostTensor layer_in(DType::f32, {kT, kD}), h_pre(DType::f32, {kT, kN}),
      h_post(DType::f32, {kT, kN}), h_res(DType::f32, {kT, kN, kN});
  pre_forward(config, x.ref(), host_params.view(),
              {layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
  expect_only_token("layer_in", layer_in, kD, value);
  expect_only_token("h_pre", h_pre, kN, value);
  expect_only_token("h_post", h_post, kN, value);
  expect_only_token("h_res", h_res, kN * kN, value);

  HostTensor layer_out = random({kT, kD});
  poison_token(layer_out, kD);
  HostTensor clean_x = random({kT, kN, kD});
  HostTensor good_post = random({kT, kN}), good_res = random({kT, kN, kN});
  HostTensor out(DType::f32, {kT, kN, kD});
  post_forward(config, clean_x.ref(), layer_out.ref(), good_post.ref(), good_res.ref(), out.mut());
  expect_only_token("out", out, kN * kD, value);

  HostTensor g = random({kT, kN, kD});
  poison_token(g, kN * kD);
  HostTensor dxp(DType::f32, {kT, kN, kD}), dlo(DType::f32, {kT, kD}), dhp(DType::f32, {kT, kN}),
      dhr(DType::f32, {kT, kN, kN});
  post_backward(config, g.ref(), clean_x.ref(), random({kT, kD}).ref(), good_post.ref(),
                good_res.ref(), {dxp.mut(), dlo.mut(), dhp.mut(), dhr.mut()});
  expect_only_token("dx_partial", dxp, kN * kD, value);
  expect_only_token("dlayer_out", dlo, kD, value);
  expect_only_token("dh_post", dhp, kN, value);
  expect_only_token("dh_res", dhr, kN * kN, value);

  // pre_backward: the bad token's dx is non-finite; parameter gradients sum over all tokens.
  HostTensor dli = random({kT, kD});
  poison_token(dli, kD);
  HostTensor dx(DType::f32, {kT, kN, kD});
  HostGrads grads(config);
  pre_backward(config, dli.ref(), random({kT, kN, kD}).ref(), random({kT, kN}).ref(),
               random({kT, kN, kN}).ref(), clean_x.ref(), host_params.view(), dx.mut(),
               grads.view());
  expect_only_token("dx", dx, kN * kD, value);
  const Vec dphi = grads.phi.to_double();
  EXPECT_TRUE(any_nonfinite(dphi, 0, static_cast<int64_t>(dphi.size())))
      << "dphi did not see " << value;
}

// A NaN parameter reaches every token. An infinite one follows IEEE arithmetic: the pre logit
// becomes +-Inf and the gate saturates to exactly pre_eps or 1 + pre_eps (a finite, correct
// limit), which is what this checks for +-Inf.
TEST_P(NonFinite, InParametersReachesEveryToken) {
  reference::Params bad = params;
  bad.phi[static_cast<size_t>(3 * projection_width(config))] = value;  // row 3, column 0 (pre)
  HostParams host_params(config, bad);
  HostTensor x = random({kT, kN, kD});
  HostTensor layer_in(DType::f32, {kT, kD}), h_pre(DType::f32, {kT, kN}),
      h_post(DType::f32, {kT, kN}), h_res(DType::f32, {kT, kN, kN});
  pre_forward(config, x.ref(), host_params.view(),
              {layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
  const Vec gate = h_pre.to_double();
  const double eps = static_cast<double>(config.pre_eps);
  for (int64_t t = 0; t < kT; ++t) {
    const double first = gate[static_cast<size_t>(t * kN)];
    if (std::isnan(value)) {
      EXPECT_TRUE(std::isnan(first)) << "token " << t << ": NaN in phi did not reach h_pre";
    } else {
      EXPECT_TRUE(first == static_cast<float>(eps) || first == static_cast<float>(1.0 + eps))
          << "token " << t << ": an infinite logit must saturate the gate, got " << first;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Values, NonFinite,
                         testing::Combine(testing::Values(std::numeric_limits<double>::quiet_NaN(),
                                                          std::numeric_limits<double>::infinity(),
                                                          -std::numeric_limits<double>::infinity()),
                                          testing::Values(Mix::sinkhorn, Mix::permutations)));

// sinkhorn_eps = 0 is accepted: with extreme logits a softmax entry underflows to 0, and a
// column whose mass is 0 divides 0 by 0. The result is then NaN in that token's H_res, and the
// call still returns (the iteration count is fixed, nothing loops on convergence).
TEST(NonFiniteEdge, ZeroSinkhornEpsWithUnderflowReturns) {
  Config config;
  config.n = 2;
  config.dim = 4;
  config.sinkhorn_eps = 0.0f;
  reference::Params params{Vec(8, 1.0), Vec(size_t{8} * 8, 0.0), {1.0, 1.0, 1.0}, Vec(8, 0.0)};
  params.bias[4] = 2000.0;  // A[0,0]: row 0 all on column 0
  params.bias[6] = 2000.0;  // A[1,0]: row 1 all on column 0; column 1's mass exp(-2000) is 0
  HostParams host_params(config, params);
  HostTensor x = HostTensor::from(DType::f32, {1, 2, 4}, Vec(8, 1.0));
  HostTensor layer_in(DType::f32, {1, 4}), h_pre(DType::f32, {1, 2}), h_post(DType::f32, {1, 2}),
      h_res(DType::f32, {1, 2, 2});
  EXPECT_NO_THROW(pre_forward(config, x.ref(), host_params.view(),
                              {layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()}));
  const Vec h = h_res.to_double();
  EXPECT_TRUE(std::isnan(h[1]) || std::isnan(h[3])) << "expected 0/0 in the empty column";
  EXPECT_TRUE(all_finite(layer_in.to_double(), 0, 4)) << "layer_in does not depend on H_res";
}

}  // namespace
}  // namespace mhc::test
