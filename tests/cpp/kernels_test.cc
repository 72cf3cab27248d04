// Every output and gradient of one backend's fused kernels (backend.h: the CPU ones in mhc_tests,
// the CUDA ones in mhc_cuda_tests) against the float64 reference (spec: Accuracy), with outputs
// poisoned with NaN before each call, random alpha of order 1 and random bias.
//
// Bounds (test_util.h, expect_matches): inputs are exact values of their dtype, so the
// reference sees what the kernel sees; f32 outputs (coefficients and parameter gradients included,
// whatever the activation dtype) are held to 1e-5, bf16 outputs to half an ulp of the float64
// value, each widened to kSpreadMultiple x the reference's own spread under one-f32-unit
// perturbations where that is larger (a cancelling sum).
//
// Configs: the defaults, and non-default ones on the smaller shapes (pre_eps 0.1, sinkhorn_eps
// 0.05, rms_eps 0.5 with activations whose mean square is near it, post_scale 1.3, 1, 2, 3 or 20
// Sinkhorn iterations), so a kernel that ignores a config value fails. When T >= 2 one token of x
// is all zeros (r = 1/sqrt(rms_eps), finite outputs).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "backend.h"
#include "test_util.h"

namespace mhc::test {
namespace {

struct Case {
  int64_t n, D, T;
  Mix mix;
  DType x_dtype, layer_out_dtype;
  // 0: the default config; else the non-default eps and post_scale with this many iterations.
  int64_t custom_iters = 0;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string name = std::string(to_string(c.mix)) + "_n" + std::to_string(c.n) + "_D" +
                     std::to_string(c.D) + "_T" + std::to_string(c.T) + "_" + to_string(c.x_dtype) +
                     "_" + to_string(c.layer_out_dtype);
  if (c.custom_iters > 0) name += "_custom_it" + std::to_string(c.custom_iters);
  return name;
}

// The non-default config of the custom cases (every scalar away from its default and from the
// others, eps values far above the rounding noise they would otherwise hide in).
Config custom_config(Config config, int64_t iters) {
  config.sinkhorn_iters = iters;
  config.pre_eps = 0.1f;
  config.sinkhorn_eps = 0.05f;
  config.rms_eps = 0.5f;
  config.post_scale = 1.3f;
  return config;
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (Mix mix : {Mix::sinkhorn, Mix::permutations}) {
    for (int64_t n : {1, 2, 3, 4, 8}) {
      if (mix == Mix::permutations && n > kMaxPermutationStreams) continue;
      for (int64_t D : {1, 7, 130, 1024}) {
        for (int64_t T : {0, 1, 5, 257}) {
          for (DType dtype : {DType::f32, DType::bf16})
            cases.push_back({n, D, T, mix, dtype, dtype});
        }
      }
    }
  }
  // Mixed activation dtypes: x in one, layer_out in the other.
  cases.push_back({4, 130, 5, Mix::sinkhorn, DType::f32, DType::bf16});
  cases.push_back({4, 130, 5, Mix::sinkhorn, DType::bf16, DType::f32});
  cases.push_back({3, 7, 257, Mix::permutations, DType::bf16, DType::f32});
  // The non-default config on the shapes below 1024 features, iterations 1, 2, 3, 20 in turn.
  const int64_t iterations[] = {1, 2, 3, 20};
  int64_t turn = 0;
  for (Mix mix : {Mix::sinkhorn, Mix::permutations}) {
    for (int64_t n : {1, 2, 3, 4, 8}) {
      if (mix == Mix::permutations && n > kMaxPermutationStreams) continue;
      for (int64_t D : {1, 7, 130}) {
        for (int64_t T : {1, 5, 257}) {
          for (DType dtype : {DType::f32, DType::bf16}) {
            cases.push_back({n, D, T, mix, dtype, dtype, iterations[turn++ % 4]});
          }
        }
      }
    }
  }
  return cases;
}

class KernelsVsReference : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!backend().available())
      GTEST_SKIP() << "no device for the " << backend().name << " backend";
    const Case& c = GetParam();
    config.n = c.n;
    config.dim = c.D;
    config.mix = c.mix;
    if (c.custom_iters > 0) config = custom_config(config, c.custom_iters);
    T = c.T;
    seed = fresh_seed();
    rng.seed(seed);
    params = random_params(rng, config);
  }

  // A random activation tensor, rounded to its dtype.
  HostTensor activation(DType dtype, std::vector<int64_t> shape, double stddev = 1.0) {
    int64_t count = 1;
    for (int64_t e : shape) count *= e;
    return HostTensor::from(dtype, std::move(shape), random_normal(rng, count, stddev));
  }
  // The streams x [T, n, D]: mean square near rms_eps in the custom config (so rms_eps matters),
  // and token T/2 all zeros when T >= 2.
  HostTensor streams(DType dtype) {
    const Case& c = GetParam();
    Vec values = random_normal(rng, T * c.n * c.D, c.custom_iters > 0 ? 0.7 : 1.0);
    if (T >= 2) {
      std::fill(values.begin() + (T / 2) * c.n * c.D, values.begin() + (T / 2 + 1) * c.n * c.D,
                0.0);
    }
    return HostTensor::from(dtype, {T, c.n, c.D}, values);
  }

  Vec perturb(const Vec& values) { return perturb_f32(rng, values); }
  reference::Params perturb(const reference::Params& p) { return perturb_f32(rng, p); }

  // `got` against the reference value `want` by test_util.h's rule; `resample` is the reference
  // on inputs perturbed by one f32 rounding unit (its spread).
  void expect_close(const std::string& name, const HostTensor& got, const Vec& want,
                    const std::function<Vec()>& resample) {
    expect_matches(name, got.dtype(), got.to_double(), want, resample,
                   describe(config, T, GetParam().x_dtype) + ", seed " + std::to_string(seed));
  }
  Config config;
  int64_t T = 0;
  uint64_t seed = 0;
  std::mt19937_64 rng;
  reference::Params params;
};

TEST_P(KernelsVsReference, PreForward) {
  const Case& c = GetParam();
  const int64_t n = c.n, D = c.D;
  HostTensor x = streams(c.x_dtype);
  HostParams host_params(config, params);
  HostTensor layer_in(c.x_dtype, {T, D}), h_pre(DType::f32, {T, n}), h_post(DType::f32, {T, n}),
      h_res(DType::f32, {T, n, n});
  for (HostTensor* out : {&layer_in, &h_pre, &h_post, &h_res}) out->poison();
  backend().pre_forward(config, x.ref(), host_params.view(),
                        PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
  const reference::PreForward want = reference::pre_forward(config, x.to_double(), params);
  auto rerun = [&] {
    return reference::pre_forward(config, perturb(x.to_double()), perturb(params));
  };
  expect_close("layer_in", layer_in, want.layer_in, [&] { return rerun().layer_in; });
  expect_close("h_pre", h_pre, want.h_pre, [&] { return rerun().h_pre; });
  expect_close("h_post", h_post, want.h_post, [&] { return rerun().h_post; });
  expect_close("h_res", h_res, want.h_res, [&] { return rerun().h_res; });
}

TEST_P(KernelsVsReference, PostForward) {
  const Case& c = GetParam();
  const int64_t n = c.n, D = c.D;
  HostTensor x = streams(c.x_dtype);
  HostTensor layer_out = activation(c.layer_out_dtype, {T, D});
  HostTensor h_post = activation(DType::f32, {T, n});
  HostTensor h_res = activation(DType::f32, {T, n, n});
  HostTensor out(c.x_dtype, {T, n, D});
  out.poison();
  backend().post_forward(config, x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(), out.mut());
  auto rerun = [&] {
    return reference::post_forward(config, perturb(x.to_double()), perturb(layer_out.to_double()),
                                   perturb(h_post.to_double()), perturb(h_res.to_double()));
  };
  expect_close("out", out,
               reference::post_forward(config, x.to_double(), layer_out.to_double(),
                                       h_post.to_double(), h_res.to_double()),
               rerun);
}

TEST_P(KernelsVsReference, PostBackward) {
  const Case& c = GetParam();
  const int64_t n = c.n, D = c.D;
  HostTensor g = activation(c.x_dtype, {T, n, D});
  HostTensor x = streams(c.x_dtype);
  HostTensor layer_out = activation(c.layer_out_dtype, {T, D});
  HostTensor h_post = activation(DType::f32, {T, n});
  HostTensor h_res = activation(DType::f32, {T, n, n});
  HostTensor dx_partial(c.x_dtype, {T, n, D}), dlayer_out(c.layer_out_dtype, {T, D}),
      dh_post(DType::f32, {T, n}), dh_res(DType::f32, {T, n, n});
  for (HostTensor* out : {&dx_partial, &dlayer_out, &dh_post, &dh_res}) out->poison();
  backend().post_backward(
      config, g.ref(), x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(),
      PostBackwardOutputs{dx_partial.mut(), dlayer_out.mut(), dh_post.mut(), dh_res.mut()});
  const reference::PostBackward want =
      reference::post_backward(config, g.to_double(), x.to_double(), layer_out.to_double(),
                               h_post.to_double(), h_res.to_double());
  auto rerun = [&] {
    return reference::post_backward(config, perturb(g.to_double()), perturb(x.to_double()),
                                    perturb(layer_out.to_double()), perturb(h_post.to_double()),
                                    perturb(h_res.to_double()));
  };
  expect_close("dx_partial", dx_partial, want.dx_partial, [&] { return rerun().dx_partial; });
  expect_close("dlayer_out", dlayer_out, want.dlayer_out, [&] { return rerun().dlayer_out; });
  expect_close("dh_post", dh_post, want.dh_post, [&] { return rerun().dh_post; });
  expect_close("dh_res", dh_res, want.dh_res, [&] { return rerun().dh_res; });
}

TEST_P(KernelsVsReference, PreBackward) {
  const Case& c = GetParam();
  const int64_t n = c.n, D = c.D;
  HostTensor x = streams(c.x_dtype);
  HostTensor dlayer_in = activation(c.x_dtype, {T, D});
  HostTensor dx_partial = activation(c.x_dtype, {T, n, D});
  HostTensor dh_post = activation(DType::f32, {T, n});
  HostTensor dh_res = activation(DType::f32, {T, n, n});
  HostParams host_params(config, params);
  HostTensor dx(c.x_dtype, {T, n, D});
  HostGrads grads(config);
  dx.poison();
  grads.poison();
  backend().pre_backward(config, dlayer_in.ref(), dx_partial.ref(), dh_post.ref(), dh_res.ref(),
                         x.ref(), host_params.view(), dx.mut(), grads.view());
  const reference::PreBackward want =
      reference::pre_backward(config, dlayer_in.to_double(), dx_partial.to_double(),
                              dh_post.to_double(), dh_res.to_double(), x.to_double(), params);
  auto rerun = [&] {
    return reference::pre_backward(config, perturb(dlayer_in.to_double()),
                                   perturb(dx_partial.to_double()), perturb(dh_post.to_double()),
                                   perturb(dh_res.to_double()), perturb(x.to_double()),
                                   perturb(params));
  };
  expect_close("dx", dx, want.dx, [&] { return rerun().dx; });
  expect_close("dnorm_weight", grads.norm_weight, want.grads.norm_weight,
               [&] { return rerun().grads.norm_weight; });
  expect_close("dphi", grads.phi, want.grads.phi, [&] { return rerun().grads.phi; });
  expect_close("dalpha", grads.alpha, want.grads.alpha, [&] { return rerun().grads.alpha; });
  expect_close("dbias", grads.bias, want.grads.bias, [&] { return rerun().grads.bias; });
}

// The four kernels chained as a framework would: the dx_partial, dh_post and dh_res of
// post_backward feed pre_backward, with a random layer_out and random cotangents. Each stage is
// held to the reference of its exact inputs: the backward's pre stage sees the dx_partial the
// kernel wrote (a bf16 intermediate is rounded once more, which a reference of the unrounded
// chain would count as the next kernel's error).
class WholeSublayerVsReference : public KernelsVsReference {};

TEST_P(WholeSublayerVsReference, ForwardAndBackward) {
  const Case& c = GetParam();
  const int64_t n = c.n, D = c.D;
  HostTensor x = streams(c.x_dtype);
  HostParams host_params(config, params);
  HostTensor layer_in(c.x_dtype, {T, D}), h_pre(DType::f32, {T, n}), h_post(DType::f32, {T, n}),
      h_res(DType::f32, {T, n, n});
  backend().pre_forward(config, x.ref(), host_params.view(),
                        PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
  HostTensor layer_out = activation(c.layer_out_dtype, {T, D});
  HostTensor out(c.x_dtype, {T, n, D});
  backend().post_forward(config, x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(), out.mut());
  HostTensor g = activation(c.x_dtype, {T, n, D});
  HostTensor dx_partial(c.x_dtype, {T, n, D}), dlayer_out(c.layer_out_dtype, {T, D}),
      dh_post(DType::f32, {T, n}), dh_res(DType::f32, {T, n, n});
  backend().post_backward(
      config, g.ref(), x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(),
      PostBackwardOutputs{dx_partial.mut(), dlayer_out.mut(), dh_post.mut(), dh_res.mut()});
  HostTensor dlayer_in = activation(c.x_dtype, {T, D});
  HostTensor dx(c.x_dtype, {T, n, D});
  HostGrads grads(config);
  backend().pre_backward(config, dlayer_in.ref(), dx_partial.ref(), dh_post.ref(), dh_res.ref(),
                         x.ref(), host_params.view(), dx.mut(), grads.view());

  struct Chain {
    Vec out, dx_partial, dlayer_out;
    reference::PreBackward backward;
  };
  // `dxp` is the dx_partial the pre stage receives: the kernel's, rounded like it.
  auto chain = [&](const Vec& xd, const reference::Params& p, const Vec& lo, const Vec& gd,
                   const Vec& dli, const Vec& dxp) {
    const reference::PreForward f = reference::pre_forward(config, xd, p);
    const reference::PostBackward pb =
        reference::post_backward(config, gd, xd, lo, f.h_post, f.h_res);
    return Chain{reference::post_forward(config, xd, lo, f.h_post, f.h_res), pb.dx_partial,
                 pb.dlayer_out,
                 reference::pre_backward(config, dli, dxp, pb.dh_post, pb.dh_res, xd, p)};
  };
  const Chain want = chain(x.to_double(), params, layer_out.to_double(), g.to_double(),
                           dlayer_in.to_double(), dx_partial.to_double());
  auto rerun = [&] {
    return chain(perturb(x.to_double()), perturb(params), perturb(layer_out.to_double()),
                 perturb(g.to_double()), perturb(dlayer_in.to_double()),
                 perturb(dx_partial.to_double()));
  };
  expect_close("out", out, want.out, [&] { return rerun().out; });
  expect_close("dx_partial", dx_partial, want.dx_partial, [&] { return rerun().dx_partial; });
  expect_close("dlayer_out", dlayer_out, want.dlayer_out, [&] { return rerun().dlayer_out; });
  expect_close("dx", dx, want.backward.dx, [&] { return rerun().backward.dx; });
  expect_close("dnorm_weight", grads.norm_weight, want.backward.grads.norm_weight,
               [&] { return rerun().backward.grads.norm_weight; });
  expect_close("dphi", grads.phi, want.backward.grads.phi,
               [&] { return rerun().backward.grads.phi; });
  expect_close("dalpha", grads.alpha, want.backward.grads.alpha,
               [&] { return rerun().backward.grads.alpha; });
  expect_close("dbias", grads.bias, want.backward.grads.bias,
               [&] { return rerun().backward.grads.bias; });
}

INSTANTIATE_TEST_SUITE_P(Shapes, KernelsVsReference, testing::ValuesIn(all_cases()), case_name);

// The chain on the small shapes; the large ones are covered operation by operation.
std::vector<Case> chain_cases() {
  std::vector<Case> cases;
  for (const Case& c : all_cases()) {
    if (c.T > 0 && c.D < 1024) cases.push_back(c);
  }
  return cases;
}
INSTANTIATE_TEST_SUITE_P(Shapes, WholeSublayerVsReference, testing::ValuesIn(chain_cases()),
                         case_name);

// Hidden sizes of real models and sizes around the 8-lane vector width and the 64-column block.
TEST(KernelsVsReferenceWidths, BoundarySizes) {
  if (!backend().available()) GTEST_SKIP() << "no device for the " << backend().name << " backend";
  for (int64_t D : {8, 9, 15, 16, 17, 63, 64, 65, 1280}) {
    Config config;
    config.n = 4;
    config.dim = D;
    const uint64_t seed = fresh_seed();
    std::mt19937_64 rng(seed);
    const reference::Params params = random_params(rng, config);
    const int64_t T = 3, n = 4;
    HostTensor x = HostTensor::from(DType::f32, {T, n, D}, random_normal(rng, T * n * D));
    HostTensor dli = HostTensor::from(DType::f32, {T, D}, random_normal(rng, T * D));
    HostTensor dxp = HostTensor::from(DType::f32, {T, n, D}, random_normal(rng, T * n * D));
    HostTensor dhp = HostTensor::from(DType::f32, {T, n}, random_normal(rng, T * n));
    HostTensor dhr = HostTensor::from(DType::f32, {T, n, n}, random_normal(rng, T * n * n));
    HostParams host_params(config, params);
    HostTensor dx(DType::f32, {T, n, D});
    HostGrads grads(config);
    dx.poison();
    grads.poison();
    backend().pre_backward(config, dli.ref(), dxp.ref(), dhp.ref(), dhr.ref(), x.ref(),
                           host_params.view(), dx.mut(), grads.view());
    const reference::PreBackward want =
        reference::pre_backward(config, dli.to_double(), dxp.to_double(), dhp.to_double(),
                                dhr.to_double(), x.to_double(), params);
    auto moved = [&] {
      return reference::pre_backward(
          config, perturb_f32(rng, dli.to_double()), perturb_f32(rng, dxp.to_double()),
          perturb_f32(rng, dhp.to_double()), perturb_f32(rng, dhr.to_double()),
          perturb_f32(rng, x.to_double()), perturb_f32(rng, params));
    };
    const std::string context = describe(config, T, DType::f32) + ", seed " + std::to_string(seed);
    expect_matches(
        "dx", DType::f32, dx.to_double(), want.dx, [&] { return moved().dx; }, context);
    expect_matches(
        "dphi", DType::f32, grads.phi.to_double(), want.grads.phi,
        [&] { return moved().grads.phi; }, context);
    expect_matches(
        "dnorm_weight", DType::f32, grads.norm_weight.to_double(), want.grads.norm_weight,
        [&] { return moved().grads.norm_weight; }, context);
  }
}

// Parameter gradients summed over many tokens: at T = 16384 (256 tiles of 64 tokens, 16 chunks of
// 16 tiles) the CPU kernel sums each tile's weight gradient in f32 and adds the tiles in double
// (pre_backward.cc). x has a mean (0.5, the hard case: partial sums that grow with the tokens);
// n = 2, D = 8 keep the float64 reference cheap.
TEST(KernelsVsReferenceLongSums, PreBackwardParameterGradients) {
  if (!backend().available()) GTEST_SKIP() << "no device for the " << backend().name << " backend";
  Config config;
  config.n = 2;
  config.dim = 8;
  const int64_t T = 16384, n = config.n, D = config.dim;
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const reference::Params params = random_params(rng, config);
  Vec x_values = random_normal(rng, T * n * D);
  for (double& v : x_values) v += 0.5;
  HostTensor x = HostTensor::from(DType::f32, {T, n, D}, x_values);
  HostTensor dli = HostTensor::from(DType::f32, {T, D}, random_normal(rng, T * D));
  HostTensor dxp = HostTensor::from(DType::f32, {T, n, D}, random_normal(rng, T * n * D));
  HostTensor dhp = HostTensor::from(DType::f32, {T, n}, random_normal(rng, T * n));
  HostTensor dhr = HostTensor::from(DType::f32, {T, n, n}, random_normal(rng, T * n * n));
  HostParams host_params(config, params);
  HostTensor dx(DType::f32, {T, n, D});
  HostGrads grads(config);
  dx.poison();
  grads.poison();
  backend().pre_backward(config, dli.ref(), dxp.ref(), dhp.ref(), dhr.ref(), x.ref(),
                         host_params.view(), dx.mut(), grads.view());
  const reference::PreBackward want =
      reference::pre_backward(config, dli.to_double(), dxp.to_double(), dhp.to_double(),
                              dhr.to_double(), x.to_double(), params);
  auto moved = [&] {
    return reference::pre_backward(
        config, perturb_f32(rng, dli.to_double()), perturb_f32(rng, dxp.to_double()),
        perturb_f32(rng, dhp.to_double()), perturb_f32(rng, dhr.to_double()),
        perturb_f32(rng, x.to_double()), perturb_f32(rng, params));
  };
  const std::string context = describe(config, T, DType::f32) + ", seed " + std::to_string(seed);
  expect_matches(
      "dphi", DType::f32, grads.phi.to_double(), want.grads.phi, [&] { return moved().grads.phi; },
      context);
  expect_matches(
      "dnorm_weight", DType::f32, grads.norm_weight.to_double(), want.grads.norm_weight,
      [&] { return moved().grads.norm_weight; }, context);
  expect_matches(
      "dalpha", DType::f32, grads.alpha.to_double(), want.grads.alpha,
      [&] { return moved().grads.alpha; }, context);
  expect_matches(
      "dbias", DType::f32, grads.bias.to_double(), want.grads.bias,
      [&] { return moved().grads.bias; }, context);
  expect_matches(
      "dx", DType::f32, dx.to_double(), want.dx, [&] { return moved().dx; }, context);
}

}  // namespace
}  // namespace mhc::test
