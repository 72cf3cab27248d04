// DeepSeek-V4.1's carried mix (mhc/ops.h: pre_forward_carried, pre_backward_carried, the collapse,
// the V4.1 boundary and the split forms; spec: Single-pass schedule):
// - the float64 reference against central finite differences of a two-sublayer V4.1 chain that
//   ends in the collapse (so the reference's backward is the gradient of its forward);
// - every kernel output against the float64 reference by the one rule (test_util.h,
//   expect_matches), f32 and bf16, the carried mix present and absent (the one-hot on stream 0);
// - the same bits at 1 and 3 threads; the fused V4.1 boundary = post_forward then
//   pre_forward_carried (and pre_backward_carried then post_backward) to the bit; the sublayer's
//   own coefficients = pre_forward's bits; the split forms = the fused ones on one slice;
// - batch invariance of the forward outputs; poisoned outputs overwritten; named errors.
// Absent mixes are passed as empty views at 1 thread and as [T, 0] views at 3, the two spellings
// the API accepts (the FFI passes [T, 0]).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "test_util.h"

namespace mhc::test {
namespace {

// ---------------------------------------------------------------------------------------------
// The reference against finite differences.

struct ChainCase {
  int64_t n, D, T;
  Mix mix;
  bool carried;
};

class CarriedReferenceFiniteDifferences : public testing::TestWithParam<ChainCase> {};

// Two V4.1 sublayers and the collapse, the layer outputs independent inputs (whatever F returned):
//   li1, g1 = pre_carried(x, c0); x2 = post(x, lo1, g1); li2, g2 = pre_carried(x2, g1.h_pre);
//   x3 = post(x2, lo2, g2); h = collapse(x3, g2.h_pre);
//   L = <li1, w1> + <li2, w2> + <h, wh>.
// The backward is the chain the kernels run: collapse_backward, post_backward,
// pre_backward_carried (dh_pre = the collapse's dcarried), post_backward, pre_backward_carried
// (dh_pre = sublayer 2's dcarried).
TEST_P(CarriedReferenceFiniteDifferences, TwoSublayersAndCollapse) {
  const ChainCase& c = GetParam();
  Config config;
  config.n = c.n;
  config.dim = c.D;
  config.mix = c.mix;
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const int64_t n = c.n, D = c.D, T = c.T;
  Vec x = random_normal(rng, T * n * D);
  Vec c0 = c.carried ? random_normal(rng, T * n) : Vec{};
  Vec lo1 = random_normal(rng, T * D), lo2 = random_normal(rng, T * D);
  reference::Params p1 = random_params(rng, config), p2 = random_params(rng, config);
  const Vec w1 = random_normal(rng, T * D), w2 = random_normal(rng, T * D),
            wh = random_normal(rng, T * D);

  auto loss = [&]() {
    const reference::PreForward f1 = reference::pre_forward_carried(config, x, c0, p1);
    const Vec x2 = reference::post_forward(config, x, lo1, f1.h_post, f1.h_res);
    const reference::PreForward f2 = reference::pre_forward_carried(config, x2, f1.h_pre, p2);
    const Vec x3 = reference::post_forward(config, x2, lo2, f2.h_post, f2.h_res);
    const Vec h = reference::collapse_forward(config, x3, f2.h_pre);
    double total = 0.0;
    for (size_t k = 0; k < w1.size(); ++k) total += f1.layer_in[k] * w1[k];
    for (size_t k = 0; k < w2.size(); ++k) total += f2.layer_in[k] * w2[k];
    for (size_t k = 0; k < wh.size(); ++k) total += h[k] * wh[k];
    return total;
  };

  const reference::PreForward f1 = reference::pre_forward_carried(config, x, c0, p1);
  const Vec x2 = reference::post_forward(config, x, lo1, f1.h_post, f1.h_res);
  const reference::PreForward f2 = reference::pre_forward_carried(config, x2, f1.h_pre, p2);
  const Vec x3 = reference::post_forward(config, x2, lo2, f2.h_post, f2.h_res);
  const reference::CollapseBackward cb = reference::collapse_backward(config, wh, x3, f2.h_pre);
  const reference::PostBackward pb2 =
      reference::post_backward(config, cb.dx, x2, lo2, f2.h_post, f2.h_res);
  const reference::PreBackwardCarried b2 = reference::pre_backward_carried(
      config, w2, pb2.dx_partial, cb.dcarried, pb2.dh_post, pb2.dh_res, x2, f1.h_pre, p2);
  const reference::PostBackward pb1 =
      reference::post_backward(config, b2.dx, x, lo1, f1.h_post, f1.h_res);
  const reference::PreBackwardCarried b1 = reference::pre_backward_carried(
      config, w1, pb1.dx_partial, b2.dcarried, pb1.dh_post, pb1.dh_res, x, c0, p1);
  EXPECT_EQ(b1.dcarried.size(), c0.size());

  auto check = [&](const char* name, Vec& values, const Vec& analytic) {
    expect_finite_differences(name, values, analytic, loss, seed);
  };
  check("x", x, b1.dx);
  if (c.carried) check("carried", c0, b1.dcarried);
  check("layer_out 1", lo1, pb1.dlayer_out);
  check("layer_out 2", lo2, pb2.dlayer_out);
  check("params 1 norm_weight", p1.norm_weight, b1.grads.norm_weight);
  check("params 1 phi", p1.phi, b1.grads.phi);
  check("params 1 alpha", p1.alpha, b1.grads.alpha);
  check("params 1 bias", p1.bias, b1.grads.bias);
  check("params 2 phi", p2.phi, b2.grads.phi);
  check("params 2 alpha", p2.alpha, b2.grads.alpha);
  check("params 2 bias", p2.bias, b2.grads.bias);
}

INSTANTIATE_TEST_SUITE_P(SmallShapes, CarriedReferenceFiniteDifferences,
                         testing::Values(ChainCase{1, 3, 2, Mix::sinkhorn, true},
                                         ChainCase{3, 2, 2, Mix::sinkhorn, true},
                                         ChainCase{3, 2, 2, Mix::sinkhorn, false},
                                         ChainCase{4, 2, 2, Mix::permutations, true},
                                         ChainCase{2, 3, 2, Mix::permutations, false}),
                         [](const testing::TestParamInfo<ChainCase>& info) {
                           const ChainCase& c = info.param;
                           return std::string(to_string(c.mix)) + "_n" + std::to_string(c.n) +
                                  "_D" + std::to_string(c.D) +
                                  (c.carried ? "_carried" : "_one_hot");
                         });

// ---------------------------------------------------------------------------------------------
// The kernels.

struct CarriedCase {
  int64_t n, D, T;
  Mix mix;
  DType dtype;
  bool carried;  // false: the one-hot on stream 0
};

std::string carried_case_name(const testing::TestParamInfo<CarriedCase>& info) {
  const CarriedCase& c = info.param;
  return std::string(to_string(c.mix)) + "_n" + std::to_string(c.n) + "_D" + std::to_string(c.D) +
         "_T" + std::to_string(c.T) + "_" + to_string(c.dtype) +
         (c.carried ? "_carried" : "_one_hot");
}

std::vector<CarriedCase> carried_cases() {
  std::vector<CarriedCase> cases;
  for (Mix mix : {Mix::sinkhorn, Mix::permutations}) {
    for (int64_t n : {1, 3, 4}) {
      for (int64_t D : {1, 130, 256}) {
        for (int64_t T : {0, 1, 37}) {
          for (DType dtype : {DType::f32, DType::bf16}) {
            for (bool carried : {true, false}) cases.push_back({n, D, T, mix, dtype, carried});
          }
        }
      }
    }
  }
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (bool carried : {true, false}) {
      // D = 4096, T = 1: the decode split (fewer tiles than threads); T = 257: several chunks.
      cases.push_back({4, 4096, 1, Mix::sinkhorn, dtype, carried});
      cases.push_back({4, 130, 257, Mix::sinkhorn, dtype, carried});
    }
  }
  return cases;
}

class CarriedOps : public KernelCaseTest<CarriedCase> {
 protected:
  std::string context() const override {
    return describe(config, T, GetParam().dtype) +
           (GetParam().carried ? ", carried" : ", one-hot") + ", seed " + std::to_string(seed);
  }

  // The carried mix as the API takes it: the tensor, or absent (an empty view at 1 thread, a
  // [T, 0] view at 3).
  TensorRef carried_view(const HostTensor& carried, int threads) const {
    if (GetParam().carried) return carried.ref();
    return threads == 1 ? TensorRef{} : TensorRef(static_cast<const float*>(nullptr), {T, 0});
  }
  // Its cotangent alike; `present` holds the values when the mix is present.
  MutableTensorRef dcarried_view(HostTensor& present, int threads) {
    if (GetParam().carried) return present.mut();
    return threads == 1 ? MutableTensorRef{}
                        : MutableTensorRef(static_cast<float*>(nullptr), {T, 0});
  }
};

TEST_P(CarriedOps, PreForwardAndBackward) {
  const CarriedCase& c = GetParam();
  const int64_t n = c.n, D = c.D;
  const DType xd = c.dtype;
  HostTensor x = random(xd, {T, n, D});
  HostTensor carried = random(DType::f32, {T, n});
  const Vec xv = x.to_double();
  const Vec cv = c.carried ? carried.to_double() : Vec{};
  HostParams host_params(config, params);

  // pre_forward's own coefficients: pre_forward_carried's must be the same bits.
  HostPreOutputs v4(xd, T, n, D);
  pre_forward(config, x.ref(), host_params.view(), v4.view());

  HostTensor dli = random(xd, {T, D}), dxp = random(xd, {T, n, D}),
             dh_pre = random(DType::f32, {T, n}), dh_post = random(DType::f32, {T, n}),
             dh_res = random(DType::f32, {T, n, n});

  HostTensor first_li, first_dx, first_dcarried;
  HostGrads first_grads(config);
  for (int threads : {1, 3}) {
    set_num_threads(threads);
    SCOPED_TRACE(context() + ", " + std::to_string(threads) + " threads");
    HostPreOutputs out(xd, T, n, D);
    out.poison();
    pre_forward_carried(config, x.ref(), carried_view(carried, threads), host_params.view(),
                        out.view());
    EXPECT_TRUE(bitwise_equal(out.h_pre, v4.h_pre)) << "h_pre (the sublayer's own, as pre_forward)";
    EXPECT_TRUE(bitwise_equal(out.h_post, v4.h_post)) << "h_post";
    EXPECT_TRUE(bitwise_equal(out.h_res, v4.h_res)) << "h_res";

    HostTensor dx(xd, {T, n, D}), dcarried(DType::f32, {T, n});
    HostGrads grads(config);
    dx.poison();
    dcarried.poison();
    grads.poison();
    pre_backward_carried(config, dli.ref(), dxp.ref(), dh_pre.ref(), dh_post.ref(), dh_res.ref(),
                         x.ref(), carried_view(carried, threads), host_params.view(), dx.mut(),
                         dcarried_view(dcarried, threads), grads.view());
    if (threads == 1) {
      first_li = out.layer_in;
      first_dx = dx;
      first_dcarried = dcarried;
      first_grads = grads;
      continue;
    }
    EXPECT_TRUE(bitwise_equal(out.layer_in, first_li)) << "layer_in at 3 threads vs 1";
    EXPECT_TRUE(bitwise_equal(dx, first_dx)) << "dx at 3 threads vs 1";
    if (c.carried) {
      EXPECT_TRUE(bitwise_equal(dcarried, first_dcarried)) << "dcarried, 3 vs 1";
    }
    EXPECT_TRUE(bitwise_equal(grads, first_grads)) << "parameter gradients, 3 vs 1";
  }

  // The one-hot reads stream 0 exactly.
  if (!c.carried && T > 0) {
    const Vec li = first_li.to_double();
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t d = 0; d < D; ++d) {
        ASSERT_EQ(li[t * D + d], xv[t * n * D + d])
            << "layer_in = x[:, 0] at t " << t << " d " << d;
      }
    }
  }

  const reference::PreForward want = reference::pre_forward_carried(config, xv, cv, params);
  expect_close("layer_in", first_li, want.layer_in, [&] {
    return reference::pre_forward_carried(config, perturb(xv), c.carried ? perturb(cv) : cv,
                                          perturb(params))
        .layer_in;
  });
  const Vec dliv = dli.to_double(), dxpv = dxp.to_double(), dhprev = dh_pre.to_double(),
            dhpostv = dh_post.to_double(), dhresv = dh_res.to_double();
  const reference::PreBackwardCarried back =
      reference::pre_backward_carried(config, dliv, dxpv, dhprev, dhpostv, dhresv, xv, cv, params);
  auto rerun = [&] {
    return reference::pre_backward_carried(config, perturb(dliv), perturb(dxpv), perturb(dhprev),
                                           perturb(dhpostv), perturb(dhresv), perturb(xv),
                                           c.carried ? perturb(cv) : cv, perturb(params));
  };
  expect_close("dx", first_dx, back.dx, [&] { return rerun().dx; });
  if (c.carried) {
    expect_close("dcarried", first_dcarried, back.dcarried, [&] { return rerun().dcarried; });
  }
  expect_close("dnorm_weight", first_grads.norm_weight, back.grads.norm_weight,
               [&] { return rerun().grads.norm_weight; });
  expect_close("dphi", first_grads.phi, back.grads.phi, [&] { return rerun().grads.phi; });
  expect_close("dalpha", first_grads.alpha, back.grads.alpha, [&] { return rerun().grads.alpha; });
  expect_close("dbias", first_grads.bias, back.grads.bias, [&] { return rerun().grads.bias; });

  // The split forms on one slice (tensor_parallel = 1). They read P and the sum of squares from
  // the f32 partials, so their coefficients are pre_forward_finish's bits (not pre_forward's);
  // layer_in is the fused one's bits (the same pre-apply of the same x), the dcarried partials
  // (pre_backward_partials) the fused dcarried's, and the backward is held to the reference.
  HostTensor partials(DType::f32, {T, projection_width(config) + 1});
  pre_forward_partials(config, x.ref(), host_params.norm_weight.ref(), host_params.phi.ref(),
                       partials.mut());
  HostPreOutputs v4_split(xd, T, n, D), split(xd, T, n, D);
  pre_forward_finish(config, x.ref(), partials.ref(), host_params.alpha.ref(),
                     host_params.bias.ref(), v4_split.view());
  split.poison();
  pre_forward_finish_carried(config, x.ref(), partials.ref(), carried_view(carried, 1),
                             host_params.alpha.ref(), host_params.bias.ref(), split.view());
  EXPECT_TRUE(bitwise_equal(split.layer_in, first_li)) << "pre_forward_finish_carried's layer_in";
  EXPECT_TRUE(bitwise_equal(split.h_pre, v4_split.h_pre)) << "pre_forward_finish_carried's h_pre";
  EXPECT_TRUE(bitwise_equal(split.h_post, v4_split.h_post))
      << "pre_forward_finish_carried's h_post";
  EXPECT_TRUE(bitwise_equal(split.h_res, v4_split.h_res)) << "pre_forward_finish_carried's h_res";
  HostTensor split_dcarried(DType::f32, {T, n}), dx(xd, {T, n, D});
  HostGrads grads(config);
  pre_backward_partials(config, dli.ref(), x.ref(), split_dcarried.mut());
  if (c.carried) {
    EXPECT_TRUE(bitwise_equal(split_dcarried, first_dcarried)) << "dcarried partials";
  }
  dx.poison();
  grads.poison();
  pre_backward_finish_carried(config, dli.ref(), dxp.ref(), dh_pre.ref(), dh_post.ref(),
                              dh_res.ref(), x.ref(), partials.ref(), carried_view(carried, 1),
                              host_params.view(), dx.mut(), grads.view());
  expect_close("split dx", dx, back.dx, [&] { return rerun().dx; });
  expect_close("split dnorm_weight", grads.norm_weight, back.grads.norm_weight,
               [&] { return rerun().grads.norm_weight; });
  expect_close("split dphi", grads.phi, back.grads.phi, [&] { return rerun().grads.phi; });
  expect_close("split dalpha", grads.alpha, back.grads.alpha, [&] { return rerun().grads.alpha; });
  expect_close("split dbias", grads.bias, back.grads.bias, [&] { return rerun().grads.bias; });
}

TEST_P(CarriedOps, Collapse) {
  const CarriedCase& c = GetParam();
  const int64_t n = c.n, D = c.D;
  const DType xd = c.dtype;
  HostTensor x = random(xd, {T, n, D});
  HostTensor carried = random(DType::f32, {T, n});
  HostTensor dout = random(xd, {T, D});
  const Vec xv = x.to_double(), doutv = dout.to_double();
  const Vec cv = c.carried ? carried.to_double() : Vec{};

  // pre_forward_carried's layer_in is the same sum: the collapse must have its bits.
  HostParams host_params(config, params);
  HostPreOutputs pre(xd, T, n, D);
  pre_forward_carried(config, x.ref(), carried_view(carried, 1), host_params.view(), pre.view());

  HostTensor first_out, first_dx, first_dcarried;
  for (int threads : {1, 3}) {
    set_num_threads(threads);
    SCOPED_TRACE(context() + ", " + std::to_string(threads) + " threads");
    HostTensor out(xd, {T, D}), dx(xd, {T, n, D}), dcarried(DType::f32, {T, n});
    for (HostTensor* o : {&out, &dx, &dcarried}) o->poison();
    collapse_forward(config, x.ref(), carried_view(carried, threads), out.mut());
    collapse_backward(config, dout.ref(), x.ref(), carried_view(carried, threads), dx.mut(),
                      dcarried_view(dcarried, threads));
    EXPECT_TRUE(bitwise_equal(out, pre.layer_in)) << "collapse = pre_forward_carried's layer_in";
    if (threads == 1) {
      first_out = out;
      first_dx = dx;
      first_dcarried = dcarried;
      continue;
    }
    EXPECT_TRUE(bitwise_equal(out, first_out)) << "out, 3 vs 1";
    EXPECT_TRUE(bitwise_equal(dx, first_dx)) << "dx, 3 vs 1";
    if (c.carried) {
      EXPECT_TRUE(bitwise_equal(dcarried, first_dcarried)) << "dcarried, 3 vs 1";
    }
  }
  expect_close("collapse out", first_out, reference::collapse_forward(config, xv, cv), [&] {
    return reference::collapse_forward(config, perturb(xv), c.carried ? perturb(cv) : cv);
  });
  const reference::CollapseBackward back = reference::collapse_backward(config, doutv, xv, cv);
  auto rerun = [&] {
    return reference::collapse_backward(config, perturb(doutv), perturb(xv),
                                        c.carried ? perturb(cv) : cv);
  };
  expect_close("collapse dx", first_dx, back.dx, [&] { return rerun().dx; });
  if (c.carried) {
    expect_close("collapse dcarried", first_dcarried, back.dcarried,
                 [&] { return rerun().dcarried; });
  }
}

// The V4.1 boundary against the separate calls, bit for bit, and the unrounded float64 chain
// (f32). Sublayer l's coefficients come from a real pre_forward_carried.
TEST_P(CarriedOps, BoundaryVsSeparate) {
  const CarriedCase& c = GetParam();
  const int64_t n = c.n, D = c.D;
  const DType xd = c.dtype;
  HostTensor x = random(xd, {T, n, D});
  HostTensor carried = random(DType::f32, {T, n});
  HostParams host_params(config, params), host_next(config, next_params);
  HostPreOutputs own(xd, T, n, D);
  pre_forward_carried(config, x.ref(), carried_view(carried, 1), host_params.view(), own.view());
  const HostTensor &h_pre = own.h_pre, &h_post = own.h_post, &h_res = own.h_res;
  HostTensor layer_out = random(xd, {T, D});

  HostTensor sep_x_next(xd, {T, n, D});
  HostPreOutputs sep_next(xd, T, n, D);
  post_forward(config, x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(), sep_x_next.mut());
  pre_forward_carried(config, sep_x_next.ref(), h_pre.ref(), host_next.view(), sep_next.view());

  HostTensor next_dli = random(xd, {T, D}), next_dxp = random(xd, {T, n, D}),
             next_dhpre = random(DType::f32, {T, n}), next_dhp = random(DType::f32, {T, n}),
             next_dhr = random(DType::f32, {T, n, n});
  HostTensor sep_dx_next(xd, {T, n, D}), sep_dh_pre(DType::f32, {T, n});
  HostPostGrads sep_post(xd, xd, T, n, D);
  HostGrads sep_grads(config);
  pre_backward_carried(config, next_dli.ref(), next_dxp.ref(), next_dhpre.ref(), next_dhp.ref(),
                       next_dhr.ref(), sep_x_next.ref(), h_pre.ref(), host_next.view(),
                       sep_dx_next.mut(), sep_dh_pre.mut(), sep_grads.view());
  post_backward(config, sep_dx_next.ref(), x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(),
                sep_post.view());

  for (int threads : {1, 3}) {
    set_num_threads(threads);
    SCOPED_TRACE(context() + ", " + std::to_string(threads) + " threads");
    HostTensor x_next(xd, {T, n, D});
    HostPreOutputs fused_next(xd, T, n, D);
    x_next.poison();
    fused_next.poison();
    boundary_forward_carried(config, x.ref(), layer_out.ref(), h_pre.ref(), h_post.ref(),
                             h_res.ref(), host_next.view(), x_next.mut(), fused_next.view());
    EXPECT_TRUE(bitwise_equal(x_next, sep_x_next)) << "x_next";
    EXPECT_TRUE(bitwise_equal(fused_next, sep_next)) << "next";

    HostPostGrads fused_post(xd, xd, T, n, D);
    HostTensor dh_pre(DType::f32, {T, n});
    HostGrads grads(config);
    fused_post.poison();
    dh_pre.poison();
    grads.poison();
    boundary_backward_carried(config, next_dli.ref(), next_dxp.ref(), next_dhpre.ref(),
                              next_dhp.ref(), next_dhr.ref(), x.ref(), layer_out.ref(), h_pre.ref(),
                              h_post.ref(), h_res.ref(), host_next.view(), fused_post.view(),
                              dh_pre.mut(), grads.view());
    EXPECT_TRUE(bitwise_equal(fused_post, sep_post)) << "the post's gradients";
    EXPECT_TRUE(bitwise_equal(dh_pre, sep_dh_pre)) << "dh_pre (next sublayer's dcarried)";
    EXPECT_TRUE(bitwise_equal(grads, sep_grads)) << "next_grads";
  }

  if (xd == DType::f32) {
    // The unrounded float64 chain (x_next and dx_next stay in float64; see boundary_test.cc).
    const Vec xv = x.to_double(), lov = layer_out.to_double(), hprev = h_pre.to_double(),
              hpv = h_post.to_double(), hrv = h_res.to_double();
    const reference::BoundaryForward chain =
        reference::boundary_forward_carried(config, xv, lov, hprev, hpv, hrv, next_params);
    auto rerun_chain = [&] {
      return reference::boundary_forward_carried(config, perturb(xv), perturb(lov), perturb(hprev),
                                                 perturb(hpv), perturb(hrv), perturb(next_params));
    };
    expect_close("next.layer_in (chain)", sep_next.layer_in, chain.next.layer_in,
                 [&] { return rerun_chain().next.layer_in; });
    expect_close("next.h_pre (chain)", sep_next.h_pre, chain.next.h_pre,
                 [&] { return rerun_chain().next.h_pre; });
    const Vec dli = next_dli.to_double(), dxpv = next_dxp.to_double(),
              dhprev = next_dhpre.to_double(), dhpv = next_dhp.to_double(),
              dhrv = next_dhr.to_double();
    const reference::BoundaryBackwardCarried back = reference::boundary_backward_carried(
        config, dli, dxpv, dhprev, dhpv, dhrv, xv, lov, hprev, hpv, hrv, next_params);
    auto rerun_back = [&] {
      return reference::boundary_backward_carried(config, perturb(dli), perturb(dxpv),
                                                  perturb(dhprev), perturb(dhpv), perturb(dhrv),
                                                  perturb(xv), perturb(lov), perturb(hprev),
                                                  perturb(hpv), perturb(hrv), perturb(next_params));
    };
    expect_close("dh_pre (chain)", sep_dh_pre, back.dh_pre, [&] { return rerun_back().dh_pre; });
    expect_close("dx_partial (chain)", sep_post.dx_partial, back.post.dx_partial,
                 [&] { return rerun_back().post.dx_partial; });
    expect_close("dlayer_out (chain)", sep_post.dlayer_out, back.post.dlayer_out,
                 [&] { return rerun_back().post.dlayer_out; });
    expect_close("next dphi (chain)", sep_grads.phi, back.next_grads.phi,
                 [&] { return rerun_back().next_grads.phi; });
    expect_close("next dalpha (chain)", sep_grads.alpha, back.next_grads.alpha,
                 [&] { return rerun_back().next_grads.alpha; });
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CarriedOps, testing::ValuesIn(carried_cases()), carried_case_name);

// ---------------------------------------------------------------------------------------------
// Batch invariance: every token of a T = 70 call (D = 130: two tiles of the pre kernels, the
// collapse's tasks) against the same token alone, at 1 and 3 threads.

TEST(CarriedBatchInvariance, ForwardOutputsPerToken) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    Config config;
    config.n = 4;
    config.dim = 130;
    const int64_t n = 4, D = 130, T = 70;
    const uint64_t seed = fresh_seed();
    std::mt19937_64 rng(seed);
    SCOPED_TRACE(describe(config, T, dtype) + ", seed " + std::to_string(seed));
    const Vec xv = random_normal(rng, T * n * D), cv = random_normal(rng, T * n),
              lov = random_normal(rng, T * D);
    const HostParams host_params(config, random_params(rng, config));
    const HostParams host_next(config, random_params(rng, config));
    // The outputs of all three forward operations on tokens [first, first + count).
    auto run = [&](int64_t first, int64_t count) {
      auto slice = [&](const Vec& values, DType type, std::vector<int64_t> inner) {
        int64_t per = 1;
        for (int64_t e : inner) per *= e;
        inner.insert(inner.begin(), count);
        return HostTensor::from(
            type, inner, Vec(values.begin() + first * per, values.begin() + (first + count) * per));
      };
      const HostTensor x = slice(xv, dtype, {n, D}), carried = slice(cv, DType::f32, {n}),
                       layer_out = slice(lov, dtype, {D});
      // pre_forward_carried's four outputs, the collapse's, then the boundary's x_next and four.
      std::vector<HostTensor> outs{
          HostTensor(dtype, {count, D}),      HostTensor(DType::f32, {count, n}),
          HostTensor(DType::f32, {count, n}), HostTensor(DType::f32, {count, n, n}),
          HostTensor(dtype, {count, D}),      HostTensor(dtype, {count, n, D}),
          HostTensor(dtype, {count, D}),      HostTensor(DType::f32, {count, n}),
          HostTensor(DType::f32, {count, n}), HostTensor(DType::f32, {count, n, n})};
      pre_forward_carried(
          config, x.ref(), carried.ref(), host_params.view(),
          PreForwardOutputs{outs[0].mut(), outs[1].mut(), outs[2].mut(), outs[3].mut()});
      collapse_forward(config, x.ref(), carried.ref(), outs[4].mut());
      boundary_forward_carried(
          config, x.ref(), layer_out.ref(), outs[1].ref(), outs[2].ref(), outs[3].ref(),
          host_next.view(), outs[5].mut(),
          PreForwardOutputs{outs[6].mut(), outs[7].mut(), outs[8].mut(), outs[9].mut()});
      return outs;
    };
    for (int threads : {1, 3}) {
      set_num_threads(threads);
      const std::vector<HostTensor> whole = run(0, T);
      for (int64_t t = 0; t < T; ++t) {
        const std::vector<HostTensor> alone = run(t, 1);
        for (size_t o = 0; o < whole.size(); ++o) {
          const int64_t bytes = alone[o].bytes();
          ASSERT_EQ(std::memcmp(static_cast<const char*>(whole[o].data()) + t * bytes,
                                alone[o].data(), static_cast<size_t>(bytes)),
                    0)
              << "output " << o << " of token " << t << " at " << threads << " threads";
        }
      }
    }
    set_num_threads(0);
  }
}

// The collapse is local in D: with D split in two (tensor_parallel = 2) each slice's out and dx are
// the bits of the whole call's, and the slices' dcarried add up to the whole one's.
TEST(CarriedCollapse, SplitOverD) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    Config config;
    config.n = 3;
    config.dim = 260;
    const int64_t n = 3, D = 260, Dl = 130, T = 5;
    const uint64_t seed = fresh_seed();
    std::mt19937_64 rng(seed);
    SCOPED_TRACE(describe(config, T, dtype) + ", seed " + std::to_string(seed));
    const Vec xv = round_to(dtype, random_normal(rng, T * n * D));
    const Vec doutv = round_to(dtype, random_normal(rng, T * D));
    const HostTensor carried = HostTensor::from(DType::f32, {T, n}, random_normal(rng, T * n));
    const HostTensor x = HostTensor::from(dtype, {T, n, D}, xv);
    const HostTensor dout = HostTensor::from(dtype, {T, D}, doutv);
    HostTensor out(dtype, {T, D}), dx(dtype, {T, n, D}), dcarried(DType::f32, {T, n});
    collapse_forward(config, x.ref(), carried.ref(), out.mut());
    collapse_backward(config, dout.ref(), x.ref(), carried.ref(), dx.mut(), dcarried.mut());
    const Vec whole_out = out.to_double(), whole_dx = dx.to_double();
    Vec summed(static_cast<size_t>(T * n), 0.0);
    Config split = config;
    split.tensor_parallel = 2;
    for (int64_t slice = 0; slice < 2; ++slice) {
      Vec xs, douts;
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t k = 0; k < n; ++k) {
          const auto row = xv.begin() + (t * n + k) * D + slice * Dl;
          xs.insert(xs.end(), row, row + Dl);
        }
        const auto row = doutv.begin() + t * D + slice * Dl;
        douts.insert(douts.end(), row, row + Dl);
      }
      const HostTensor xs_t = HostTensor::from(dtype, {T, n, Dl}, xs);
      const HostTensor douts_t = HostTensor::from(dtype, {T, Dl}, douts);
      HostTensor outs(dtype, {T, Dl}), dxs(dtype, {T, n, Dl}), dcs(DType::f32, {T, n});
      for (HostTensor* o : {&outs, &dxs, &dcs}) o->poison();
      collapse_forward(split, xs_t.ref(), carried.ref(), outs.mut());
      collapse_backward(split, douts_t.ref(), xs_t.ref(), carried.ref(), dxs.mut(), dcs.mut());
      const Vec o = outs.to_double(), g = dxs.to_double(), c = dcs.to_double();
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t d = 0; d < Dl; ++d) {
          ASSERT_EQ(o[t * Dl + d], whole_out[t * D + slice * Dl + d]) << "out t " << t;
          for (int64_t k = 0; k < n; ++k) {
            ASSERT_EQ(g[(t * n + k) * Dl + d], whole_dx[(t * n + k) * D + slice * Dl + d])
                << "dx t " << t << " k " << k;
          }
        }
      }
      for (size_t e = 0; e < summed.size(); ++e) summed[e] += c[e];
    }
    const Vec whole_dcarried = dcarried.to_double();
    EXPECT_LE(relative_error(summed, whole_dcarried), 1e-6) << "sum of the slices' dcarried";
  }
}

// ---------------------------------------------------------------------------------------------
// Named errors.

class CarriedBadInput : public testing::Test {
 protected:
  CarriedBadInput()
      : config(make_config()),
        rng(11),
        params(config, random_params(rng, config)),
        grads(config),
        x(HostTensor::from(DType::f32, {T, 4, 6}, random_normal(rng, T * 24))),
        carried(HostTensor::from(DType::f32, {T, 4}, random_normal(rng, T * 4))),
        dli(HostTensor::from(DType::f32, {T, 6}, random_normal(rng, T * 6))),
        dxp(DType::f32, {T, 4, 6}),
        dh_pre(DType::f32, {T, 4}),
        dh_post(DType::f32, {T, 4}),
        dh_res(DType::f32, {T, 4, 4}),
        layer_in(DType::f32, {T, 6}),
        h_pre(DType::f32, {T, 4}),
        h_post(DType::f32, {T, 4}),
        h_res(DType::f32, {T, 4, 4}),
        dx(DType::f32, {T, 4, 6}),
        dcarried(DType::f32, {T, 4}),
        out(DType::f32, {T, 6}) {}

  static Config make_config() {
    Config c;
    c.n = 4;
    c.dim = 6;
    return c;
  }
  void forward(const TensorRef& mix) {
    pre_forward_carried(config, x.ref(), mix, params.view(),
                        PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
  }
  void backward(const TensorRef& mix, const MutableTensorRef& dmix) {
    pre_backward_carried(config, dli.ref(), dxp.ref(), dh_pre.ref(), dh_post.ref(), dh_res.ref(),
                         x.ref(), mix, params.view(), dx.mut(), dmix, grads.view());
  }

  static constexpr int64_t T = 3;
  Config config;
  std::mt19937_64 rng;
  HostParams params;
  HostGrads grads;
  HostTensor x, carried, dli, dxp, dh_pre, dh_post, dh_res, layer_in, h_pre, h_post, h_res, dx,
      dcarried, out;
};

TEST_F(CarriedBadInput, AbsentAndPresentMixesPass) {
  EXPECT_NO_THROW(forward(carried.ref()));
  EXPECT_NO_THROW(forward(TensorRef{}));
  EXPECT_NO_THROW(forward(TensorRef(static_cast<const float*>(nullptr), {T, 0})));
  EXPECT_NO_THROW(backward(carried.ref(), dcarried.mut()));
  EXPECT_NO_THROW(backward(TensorRef{}, MutableTensorRef{}));
  EXPECT_NO_THROW(backward(TensorRef(static_cast<const float*>(nullptr), {T, 0}),
                           MutableTensorRef(static_cast<float*>(nullptr), {T, 0})));
}

TEST_F(CarriedBadInput, CarriedShapeAndDtype) {
  const std::string op = "mhc::pre_forward_carried";
  expect_error(
      [&] {
        forward(TensorRef(static_cast<const float*>(carried.data()), {T, 3}));
      },
      op, "carried", "expected shape [3, 4] (the carried mix, f32 [T, n]) or absent");
  expect_error(
      [&] {
        forward(TensorRef(static_cast<const float*>(carried.data()), {T - 1, 4}));
      },
      op, "carried", "got [2, 4]");
  expect_error([&] { forward(TensorRef(static_cast<const float*>(carried.data()), {T * 4})); }, op,
               "carried", "got [12]");
  HostTensor bf(DType::bf16, {T, 4});
  expect_error([&] { forward(bf.ref()); }, op, "carried", "expected dtype f32, got bf16");
  expect_error(
      [&] {
        forward(TensorRef(static_cast<const float*>(nullptr), {T, 4}));
      },
      op, "carried", "expected non-null data");
  expect_error(
      [&] {
        collapse_forward(config, x.ref(), TensorRef(static_cast<const float*>(nullptr), {T, 2}),
                         out.mut());
      },
      "mhc::collapse_forward", "carried", "or absent");
}

TEST_F(CarriedBadInput, DcarriedPresentExactlyWhenCarriedIs) {
  const std::string op = "mhc::pre_backward_carried";
  expect_error([&] { backward(carried.ref(), MutableTensorRef{}); }, op, "dcarried",
               "because carried is present");
  expect_error(
      [&] {
        backward(carried.ref(), MutableTensorRef(static_cast<float*>(nullptr), {T, 0}));
      },
      op, "dcarried", "because carried is present");
  expect_error([&] { backward(TensorRef{}, dcarried.mut()); }, op, "dcarried",
               "because carried is absent");
  expect_error(
      [&] { collapse_backward(config, dli.ref(), x.ref(), TensorRef{}, dx.mut(), dcarried.mut()); },
      "mhc::collapse_backward", "dcarried", "because carried is absent");
  HostTensor wrong(DType::f32, {T, 5});
  expect_error([&] { backward(carried.ref(), wrong.mut()); }, op, "dcarried", "got [3, 5]");
}

TEST_F(CarriedBadInput, OtherArgumentsNamed) {
  const std::string op = "mhc::pre_backward_carried";
  HostTensor bad_dh_pre(DType::f32, {T, 3});
  expect_error(
      [&] {
        pre_backward_carried(config, dli.ref(), dxp.ref(), bad_dh_pre.ref(), dh_post.ref(),
                             dh_res.ref(), x.ref(), carried.ref(), params.view(), dx.mut(),
                             dcarried.mut(), grads.view());
      },
      op, "dh_pre", "expected shape [3, 4]");
  HostTensor bf_dh_pre(DType::bf16, {T, 4});
  expect_error(
      [&] {
        pre_backward_carried(config, dli.ref(), dxp.ref(), bf_dh_pre.ref(), dh_post.ref(),
                             dh_res.ref(), x.ref(), carried.ref(), params.view(), dx.mut(),
                             dcarried.mut(), grads.view());
      },
      op, "dh_pre", "expected dtype f32");
  // dcarried must not alias an input.
  expect_error(
      [&] {
        pre_backward_carried(
            config, dli.ref(), dxp.ref(), dh_pre.ref(), dh_post.ref(), dh_res.ref(), x.ref(),
            carried.ref(), params.view(), dx.mut(),
            MutableTensorRef(static_cast<float*>(const_cast<void*>(carried.data())), {T, 4}),
            grads.view());
      },
      op, "dcarried", "overlaps carried");
  // The boundary's h_pre is required (sublayer l always has its gates).
  HostTensor x_next(DType::f32, {T, 4, 6});
  expect_error(
      [&] {
        boundary_forward_carried(
            config, x.ref(), dli.ref(), TensorRef{}, h_post.ref(), h_res.ref(), params.view(),
            x_next.mut(),
            PreForwardOutputs{layer_in.mut(), dh_pre.mut(), dh_post.mut(), dh_res.mut()});
      },
      "mhc::boundary_forward_carried", "h_pre", "expected shape [3, 4]");
  HostTensor dlo(DType::f32, {T, 6}), dhp(DType::f32, {T, 4}), dhr(DType::f32, {T, 4, 4});
  expect_error(
      [&] {
        boundary_backward_carried(config, dli.ref(), dxp.ref(), dh_pre.ref(), dh_post.ref(),
                                  dh_res.ref(), x.ref(), dli.ref(), h_pre.ref(), h_post.ref(),
                                  h_res.ref(), params.view(),
                                  PostBackwardOutputs{dx.mut(), dlo.mut(), dhp.mut(), dhr.mut()},
                                  MutableTensorRef{}, grads.view());
      },
      "mhc::boundary_backward_carried", "dh_pre", "expected shape [3, 4]");
  Config split = config;
  split.tensor_parallel = 2;
  expect_error(
      [&] {
        pre_forward_carried(
            split, TensorRef(static_cast<const float*>(x.data()), {T, 4, 3}), carried.ref(),
            params.view(),
            PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
      },
      "mhc::pre_forward_carried", "config.tensor_parallel", "pre_forward_finish_carried");
}

TEST_F(CarriedBadInput, ZeroTokensWriteZeroGradients) {
  HostTensor x0(DType::f32, {0, 4, 6}), dli0(DType::f32, {0, 6}), dxp0(DType::f32, {0, 4, 6}),
      small(DType::f32, {0, 4}), res0(DType::f32, {0, 4, 4}), dx0(DType::f32, {0, 4, 6});
  grads.poison();
  pre_backward_carried(config, dli0.ref(), dxp0.ref(), small.ref(), small.ref(), res0.ref(),
                       x0.ref(), small.ref(), params.view(), dx0.mut(),
                       MutableTensorRef(static_cast<float*>(nullptr), {0, 4}), grads.view());
  const reference::Params values = grads.to_double();
  for (const Vec* g : {&values.norm_weight, &values.phi, &values.alpha, &values.bias}) {
    for (double v : *g) ASSERT_EQ(v, 0.0);
  }
}

}  // namespace
}  // namespace mhc::test
