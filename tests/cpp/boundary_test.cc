// The fused boundary (mhc/ops.h: boundary_forward, boundary_backward) against what it replaces:
// - the separate operations (post_forward then pre_forward; pre_backward then post_backward),
//   to the bit, at 1 and at 3 threads;
// - the float64 reference (spec: Accuracy), each half against the reference of the values it saw,
//   as WholeSublayerVsReference does: the pre half sees x_next as the kernel stored it, the post
//   backward sees dx_next as pre_backward stores it (a bf16 intermediate is rounded, which a
//   reference of the unrounded chain would count as an error). f32 cases are also held to the
//   unrounded float64 chain (reference::boundary_forward, boundary_backward). That chain crosses
//   x_next and dx_next, which the fused boundary stores in f32 like the separate calls do; where
//   x_next comes from cancellation (|x_next| near sqrt(rms_eps) with n * D = 1, dx_next ~ 200) the
//   f32 x_next alone moves dx_next by 2e-5 relative: the reference's spread includes that
//   rounding (reference::RoundingNoise on x_next), so the one rule (test_util.h, expect_matches)
//   holds there too.
// Outputs are poisoned with NaN before each call; the two sublayers have different parameters,
// and h_post, h_res of sublayer l come from a real pre_forward (non-trivial coefficients).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "test_util.h"

namespace mhc::test {
namespace {

struct BoundaryCase {
  int64_t n, D, T;
  Mix mix;
  DType x_dtype, layer_out_dtype;
};

std::string boundary_case_name(const testing::TestParamInfo<BoundaryCase>& info) {
  const BoundaryCase& c = info.param;
  return std::string(to_string(c.mix)) + "_n" + std::to_string(c.n) + "_D" + std::to_string(c.D) +
         "_T" + std::to_string(c.T) + "_" + to_string(c.x_dtype) + "_" +
         to_string(c.layer_out_dtype);
}

std::vector<BoundaryCase> boundary_cases() {
  std::vector<BoundaryCase> cases;
  for (Mix mix : {Mix::sinkhorn, Mix::permutations}) {
    for (int64_t n : {1, 3, 4, 8}) {
      if (mix == Mix::permutations && n > kMaxPermutationStreams) continue;
      for (int64_t D : {1, 33, 130}) {
        for (int64_t T : {0, 1, 37}) {
          for (DType dtype : {DType::f32, DType::bf16})
            cases.push_back({n, D, T, mix, dtype, dtype});
        }
      }
    }
  }
  for (DType dtype : {DType::f32, DType::bf16}) {
    // D = 4096: the projection's blocks and the decode split (fewer tiles than threads).
    cases.push_back({4, 4096, 1, Mix::sinkhorn, dtype, dtype});
    cases.push_back({4, 4096, 37, Mix::sinkhorn, dtype, dtype});
    cases.push_back({3, 4096, 37, Mix::permutations, dtype, dtype});
    cases.push_back({8, 4096, 1, Mix::sinkhorn, dtype, dtype});
    // T = 257 and 4096: several tiles and chunks (257 is the sanitizers' multi-chunk case).
    cases.push_back({4, 130, 257, Mix::sinkhorn, dtype, dtype});
    cases.push_back({4, 130, 4096, Mix::sinkhorn, dtype, dtype});
    cases.push_back({1, 33, 4096, Mix::sinkhorn, dtype, dtype});
    cases.push_back({3, 1, 4096, Mix::permutations, dtype, dtype});
  }
  cases.push_back({4, 130, 37, Mix::sinkhorn, DType::f32, DType::bf16});
  cases.push_back({4, 130, 37, Mix::sinkhorn, DType::bf16, DType::f32});
  return cases;
}

class BoundaryVsSeparate : public KernelCaseTest<BoundaryCase> {
 protected:
  std::string context() const override {
    return describe(config, T, GetParam().x_dtype) + ", seed " + std::to_string(seed);
  }
  // Against the unrounded chain: see the file comment.
  void expect_close_to_chain(const std::string& name, const HostTensor& got, const Vec& want,
                             const std::function<Vec()>& resample) {
    expect_close(name + " (unrounded chain)", got, want, resample);
  }
};

TEST_P(BoundaryVsSeparate, ForwardAndBackward) {
  const BoundaryCase& c = GetParam();
  const int64_t n = c.n, D = c.D;
  const DType xd = c.x_dtype, lod = c.layer_out_dtype;
  // Sublayer l: x, its coefficients from pre_forward, a random layer_out.
  HostTensor x = random(xd, {T, n, D});
  HostParams host_params(config, params), host_next(config, next_params);
  HostPreOutputs own(xd, T, n, D);
  pre_forward(config, x.ref(), host_params.view(), own.view());
  const HostTensor &h_post = own.h_post, &h_res = own.h_res;
  HostTensor layer_out = random(lod, {T, D});

  // Forward, separate: post_forward, then pre_forward of sublayer l+1.
  HostTensor sep_x_next(xd, {T, n, D});
  HostPreOutputs sep_next(xd, T, n, D);
  post_forward(config, x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(), sep_x_next.mut());
  pre_forward(config, sep_x_next.ref(), host_next.view(), sep_next.view());

  // Backward inputs of sublayer l+1's pre: random cotangents.
  HostTensor next_dli = random(xd, {T, D}), next_dxp = random(xd, {T, n, D}),
             next_dhp = random(DType::f32, {T, n}), next_dhr = random(DType::f32, {T, n, n});
  // Backward, separate: pre_backward of l+1, then post_backward of l with g = its dx.
  HostTensor sep_dx_next(xd, {T, n, D});
  HostPostGrads sep_post(xd, lod, T, n, D);
  HostGrads sep_grads(config);
  pre_backward(config, next_dli.ref(), next_dxp.ref(), next_dhp.ref(), next_dhr.ref(),
               sep_x_next.ref(), host_next.view(), sep_dx_next.mut(), sep_grads.view());
  post_backward(config, sep_dx_next.ref(), x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(),
                sep_post.view());

  for (int threads : {1, 3}) {
    set_num_threads(threads);
    SCOPED_TRACE(context() + ", " + std::to_string(threads) + " threads");
    HostTensor x_next(xd, {T, n, D});
    HostPreOutputs fused_next(xd, T, n, D);
    x_next.poison();
    fused_next.poison();
    boundary_forward(config, x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(), host_next.view(),
                     x_next.mut(), fused_next.view());
    EXPECT_TRUE(bitwise_equal(x_next, sep_x_next)) << "x_next";
    EXPECT_TRUE(bitwise_equal(fused_next, sep_next)) << "next";

    HostPostGrads fused_post(xd, lod, T, n, D);
    HostGrads grads(config);
    fused_post.poison();
    grads.poison();
    boundary_backward(config, next_dli.ref(), next_dxp.ref(), next_dhp.ref(), next_dhr.ref(),
                      x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(), host_next.view(),
                      fused_post.view(), grads.view());
    EXPECT_TRUE(bitwise_equal(fused_post, sep_post)) << "the post's gradients";
    EXPECT_TRUE(bitwise_equal(grads, sep_grads)) << "next_grads";
  }

  // Against float64, each half on the values it saw (the fused outputs equal these bit for bit).
  const Vec xv = x.to_double(), lov = layer_out.to_double(), hpv = h_post.to_double(),
            hrv = h_res.to_double();
  expect_close("x_next", sep_x_next, reference::post_forward(config, xv, lov, hpv, hrv), [&] {
    return reference::post_forward(config, perturb(xv), perturb(lov), perturb(hpv), perturb(hrv));
  });
  const Vec x_next_seen = sep_x_next.to_double();
  const reference::PreForward next = reference::pre_forward(config, x_next_seen, next_params);
  auto rerun_pre = [&] {
    return reference::pre_forward(config, perturb(x_next_seen), perturb(next_params));
  };
  expect_close("layer_in", sep_next.layer_in, next.layer_in, [&] { return rerun_pre().layer_in; });
  expect_close("h_pre", sep_next.h_pre, next.h_pre, [&] { return rerun_pre().h_pre; });
  expect_close("h_post", sep_next.h_post, next.h_post, [&] { return rerun_pre().h_post; });
  expect_close("h_res", sep_next.h_res, next.h_res, [&] { return rerun_pre().h_res; });

  const Vec dli = next_dli.to_double(), dxpv = next_dxp.to_double(), dhpv = next_dhp.to_double(),
            dhrv = next_dhr.to_double();
  const reference::PreBackward next_back =
      reference::pre_backward(config, dli, dxpv, dhpv, dhrv, x_next_seen, next_params);
  auto rerun_pre_back = [&] {
    return reference::pre_backward(config, perturb(dli), perturb(dxpv), perturb(dhpv),
                                   perturb(dhrv), perturb(x_next_seen), perturb(next_params));
  };
  expect_close("dx_next", sep_dx_next, next_back.dx, [&] { return rerun_pre_back().dx; });
  expect_close("dnorm_weight", sep_grads.norm_weight, next_back.grads.norm_weight,
               [&] { return rerun_pre_back().grads.norm_weight; });
  expect_close("dphi", sep_grads.phi, next_back.grads.phi,
               [&] { return rerun_pre_back().grads.phi; });
  expect_close("dalpha", sep_grads.alpha, next_back.grads.alpha,
               [&] { return rerun_pre_back().grads.alpha; });
  expect_close("dbias", sep_grads.bias, next_back.grads.bias,
               [&] { return rerun_pre_back().grads.bias; });
  const Vec g_seen = sep_dx_next.to_double();
  const reference::PostBackward post_back =
      reference::post_backward(config, g_seen, xv, lov, hpv, hrv);
  auto rerun_post_back = [&] {
    return reference::post_backward(config, perturb(g_seen), perturb(xv), perturb(lov),
                                    perturb(hpv), perturb(hrv));
  };
  expect_close("dx_partial", sep_post.dx_partial, post_back.dx_partial,
               [&] { return rerun_post_back().dx_partial; });
  expect_close("dlayer_out", sep_post.dlayer_out, post_back.dlayer_out,
               [&] { return rerun_post_back().dlayer_out; });
  expect_close("dh_post", sep_post.dh_post, post_back.dh_post,
               [&] { return rerun_post_back().dh_post; });
  expect_close("dh_res", sep_post.dh_res, post_back.dh_res,
               [&] { return rerun_post_back().dh_res; });

  if (xd == DType::f32 && lod == DType::f32) {
    // The unrounded float64 chain: x_next and dx_next never leave float64.
    const reference::BoundaryForward chain =
        reference::boundary_forward(config, xv, lov, hpv, hrv, next_params);
    auto rerun_chain = [&] {
      return reference::boundary_forward(config, perturb(xv), perturb(lov), perturb(hpv),
                                         perturb(hrv), perturb(next_params));
    };
    expect_close_to_chain("layer_in", sep_next.layer_in, chain.next.layer_in,
                          [&] { return rerun_chain().next.layer_in; });
    expect_close_to_chain("h_res", sep_next.h_res, chain.next.h_res,
                          [&] { return rerun_chain().next.h_res; });
    const reference::BoundaryBackward back =
        reference::boundary_backward(config, dli, dxpv, dhpv, dhrv, xv, lov, hpv, hrv, next_params);
    auto rerun_back = [&] {
      return reference::boundary_backward(config, perturb(dli), perturb(dxpv), perturb(dhpv),
                                          perturb(dhrv), perturb(xv), perturb(lov), perturb(hpv),
                                          perturb(hrv), perturb(next_params));
    };
    expect_close_to_chain("dx_partial", sep_post.dx_partial, back.post.dx_partial,
                          [&] { return rerun_back().post.dx_partial; });
    expect_close_to_chain("dh_res", sep_post.dh_res, back.post.dh_res,
                          [&] { return rerun_back().post.dh_res; });
    expect_close_to_chain("dphi", sep_grads.phi, back.next_grads.phi,
                          [&] { return rerun_back().next_grads.phi; });
    expect_close_to_chain("dalpha", sep_grads.alpha, back.next_grads.alpha,
                          [&] { return rerun_back().next_grads.alpha; });
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, BoundaryVsSeparate, testing::ValuesIn(boundary_cases()),
                         boundary_case_name);

// Bad arguments are named, with the boundary's own argument names.
TEST(BoundaryErrors, NamesTheArgument) {
  Config config;
  config.n = 4;
  config.dim = 8;
  const int64_t T = 3, n = 4, D = 8;
  std::mt19937_64 rng(1);
  const reference::Params values = random_params(rng, config);
  HostParams next(config, values);
  HostTensor x(DType::f32, {T, n, D}), layer_out(DType::f32, {T, D}), h_post(DType::f32, {T, n}),
      h_res(DType::f32, {T, n, n}), x_next(DType::f32, {T, n, D}), li(DType::f32, {T, D}),
      hpre(DType::f32, {T, n}), hpost(DType::f32, {T, n}), hres(DType::f32, {T, n, n});
  auto forward = [&](const Config& cfg, const Params& p, MutableTensorRef out) {
    boundary_forward(cfg, x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(), p, out,
                     PreForwardOutputs{li.mut(), hpre.mut(), hpost.mut(), hres.mut()});
  };
  Params bad_phi = next.view();
  bad_phi.phi.shape[1] -= 1;
  expect_error([&] { forward(config, bad_phi, x_next.mut()); }, "mhc::boundary_forward",
               "next_params.phi", "expected shape");
  MutableTensorRef aliased = x_next.mut();
  aliased.data = const_cast<void*>(x.data());
  expect_error([&] { forward(config, next.view(), aliased); }, "mhc::boundary_forward", "x_next",
               "overlaps x");
  Config split = config;
  split.tensor_parallel = 2;
  expect_error([&] { forward(split, next.view(), x_next.mut()); }, "mhc::boundary_forward",
               "config.tensor_parallel", "pre_forward_partials");
  HostTensor bf16_li(DType::bf16, {T, D});
  expect_error(
      [&] {
        boundary_forward(config, x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(), next.view(),
                         x_next.mut(),
                         PreForwardOutputs{bf16_li.mut(), hpre.mut(), hpost.mut(), hres.mut()});
      },
      "mhc::boundary_forward", "next.layer_in", "expected dtype f32");

  HostTensor dli(DType::f32, {T, D}), dxp_in(DType::f32, {T, n, D}), dhp_in(DType::f32, {T, n}),
      wrong_dhr(DType::f32, {T, n, n + 1}), dxp(DType::f32, {T, n, D}), dlo(DType::f32, {T, D}),
      dhp(DType::f32, {T, n}), dhr(DType::f32, {T, n, n}), dhr_in(DType::f32, {T, n, n});
  HostGrads grads(config);
  expect_error(
      [&] {
        boundary_backward(config, dli.ref(), dxp_in.ref(), dhp_in.ref(), wrong_dhr.ref(), x.ref(),
                          layer_out.ref(), h_post.ref(), h_res.ref(), next.view(),
                          PostBackwardOutputs{dxp.mut(), dlo.mut(), dhp.mut(), dhr.mut()},
                          grads.view());
      },
      "mhc::boundary_backward", "next_dh_res", "expected shape [3, 4, 4]");
  ParamGrads bad_grads = grads.view();
  bad_grads.bias.shape[0] += 1;
  expect_error(
      [&] {
        boundary_backward(config, dli.ref(), dxp_in.ref(), dhp_in.ref(), dhr_in.ref(), x.ref(),
                          layer_out.ref(), h_post.ref(), h_res.ref(), next.view(),
                          PostBackwardOutputs{dxp.mut(), dlo.mut(), dhp.mut(), dhr.mut()},
                          bad_grads);
      },
      "mhc::boundary_backward", "next_grads.bias", "expected shape");
}

}  // namespace
}  // namespace mhc::test
