// Tensor parallelism: the split operations (pre_forward_partials/finish, post ops on a slice,
// pre_backward_partials/finish) run on every slice of D, with the partials summed between them
// as an all-reduce would, must give the float64 reference of the whole layer (spec: Accuracy),
// and every slice must compute the same coefficients and alpha/bias gradients. Bounds as in
// kernels_test.cc (test_util.h, expect_matches: f32 outputs 1e-5 whatever the activation dtype,
// bf16 outputs half an ulp, or kSpreadMultiple x the reference's spread where larger), over the
// default config and a non-default one.
#include <gtest/gtest.h>

#include <string>

#include "backend.h"
#include "test_util.h"

namespace mhc::test {
namespace {

struct Case {
  int64_t n, D, T, slices;
  Mix mix;
  DType dtype;
  int64_t custom_iters = 0;  // 0: default config; else non-default scalars with these iterations
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(to_string(c.mix)) + "_n" + std::to_string(c.n) + "_D" + std::to_string(c.D) +
         "_T" + std::to_string(c.T) + "_tp" + std::to_string(c.slices) + "_" + to_string(c.dtype) +
         (c.custom_iters > 0 ? "_custom_it" + std::to_string(c.custom_iters) : "");
}

// Slice s of the axis of extent D in a tensor laid out [outer, D, inner].
Vec take_slice(const Vec& v, int64_t D, int64_t inner, int64_t slices, int64_t s) {
  const int64_t Dl = D / slices, outer = static_cast<int64_t>(v.size()) / (D * inner);
  Vec part;
  for (int64_t o = 0; o < outer; ++o) {
    const auto first = v.begin() + (o * D + s * Dl) * inner;
    part.insert(part.end(), first, first + Dl * inner);
  }
  return part;
}

// The inverse: writes slice s back into `whole`.
void put_slice(const Vec& part, int64_t D, int64_t inner, int64_t slices, int64_t s, Vec& whole) {
  const int64_t Dl = D / slices, outer = static_cast<int64_t>(whole.size()) / (D * inner);
  for (int64_t o = 0; o < outer; ++o) {
    std::copy(part.begin() + o * Dl * inner, part.begin() + (o + 1) * Dl * inner,
              whole.begin() + (o * D + s * Dl) * inner);
  }
}

// Sums f32 partials of every slice in slice order, as an all-reduce would.
HostTensor sum_slices(const std::vector<HostTensor>& parts, std::vector<int64_t> shape) {
  Vec total(static_cast<size_t>(parts.at(0).size()), 0.0);
  for (const HostTensor& part : parts) {
    const Vec values = part.to_double();
    for (size_t k = 0; k < total.size(); ++k) {
      total[k] = static_cast<float>(static_cast<float>(total[k]) + static_cast<float>(values[k]));
    }
  }
  return HostTensor::from(DType::f32, std::move(shape), total);
}

class SplitVsReference : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!backend().available())
      GTEST_SKIP() << "no device for the " << backend().name << " backend";
    const Case& c = GetParam();
    config.n = c.n;
    config.dim = c.D;
    config.mix = c.mix;
    if (c.custom_iters > 0) {
      config.sinkhorn_iters = c.custom_iters;
      config.pre_eps = 0.1f;
      config.sinkhorn_eps = 0.05f;
      config.rms_eps = 0.5f;
      config.post_scale = 1.3f;
    }
    slice_config = config;
    slice_config.tensor_parallel = c.slices;
    seed = fresh_seed();
    rng.seed(seed);
    params = random_params(rng, config);
  }

  Vec random(DType dtype, int64_t count, double stddev = 1.0) {
    return round_to(dtype, random_normal(rng, count, stddev));
  }

  // `dtype`: the dtype the kernel wrote this tensor in. `perturbed`: the reference on inputs moved
  // by one f32 rounding unit (test_util.h, expect_matches).
  void expect_close(const std::string& name, DType dtype, const Vec& got, const Vec& want,
                    const std::function<Vec()>& perturbed) {
    expect_matches(name, dtype, got, want, perturbed,
                   describe(config, GetParam().T, GetParam().dtype) + ", " +
                       std::to_string(GetParam().slices) + " slices, seed " + std::to_string(seed));
  }
  Vec perturb(const Vec& values) { return perturb_f32(rng, values); }

  // Slice s of a [.., n*D, inner] parameter as a host tensor of the local rows.
  HostTensor param_rows(const Vec& values, int64_t inner, int64_t s) const {
    const Case& c = GetParam();
    const Vec part = take_slice(values, c.D, inner, c.slices, s);
    std::vector<int64_t> shape{static_cast<int64_t>(part.size()) / inner};
    if (inner > 1) shape.push_back(inner);
    return HostTensor::from(DType::f32, shape, part);
  }

  Config config, slice_config;
  uint64_t seed = 0;
  std::mt19937_64 rng;
  reference::Params params;
};

TEST_P(SplitVsReference, ForwardAndBackward) {
  const Case& c = GetParam();
  const int64_t n = c.n, D = c.D, T = c.T, S = c.slices, Dl = D / S;
  const int64_t N = projection_width(config);
  // Mean square near rms_eps in the non-default config, so that rms_eps matters.
  const Vec x = random(c.dtype, T * n * D, c.custom_iters > 0 ? 0.7 : 1.0);
  const Vec layer_out = random(c.dtype, T * D);
  const Vec g = random(c.dtype, T * n * D), dlayer_in = random(c.dtype, T * D);
  const Vec dx_partial = random(c.dtype, T * n * D);
  const Vec dh_post = random(DType::f32, T * n), dh_res = random(DType::f32, T * n * n);
  std::vector<HostTensor> xs;
  for (int64_t s = 0; s < S; ++s)
    xs.push_back(HostTensor::from(c.dtype, {T, n, Dl}, take_slice(x, D, 1, S, s)));

  // Forward: partials per slice, summed, then finished per slice.
  std::vector<HostTensor> partials;
  for (int64_t s = 0; s < S; ++s) {
    partials.emplace_back(DType::f32, std::vector<int64_t>{T, N + 1});
    partials.back().poison();
    backend().pre_forward_partials(slice_config, xs[s].ref(),
                                   param_rows(params.norm_weight, 1, s).ref(),
                                   param_rows(params.phi, N, s).ref(), partials.back().mut());
  }
  const HostTensor summed = sum_slices(partials, {T, N + 1});
  const HostTensor alpha = HostTensor::from(DType::f32, {3}, params.alpha);
  const HostTensor bias = HostTensor::from(DType::f32, {N}, params.bias);
  Vec layer_in(static_cast<size_t>(T * D));
  std::vector<Vec> coefficients;  // h_pre, h_post, h_res of slice 0
  for (int64_t s = 0; s < S; ++s) {
    HostTensor li(c.dtype, {T, Dl}), h_pre(DType::f32, {T, n}), h_post(DType::f32, {T, n}),
        h_res(DType::f32, {T, n, n});
    for (HostTensor* t : {&li, &h_pre, &h_post, &h_res}) t->poison();
    backend().pre_forward_finish(
        slice_config, xs[s].ref(), summed.ref(), alpha.ref(), bias.ref(),
        PreForwardOutputs{li.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
    put_slice(li.to_double(), D, 1, S, s, layer_in);
    const std::vector<Vec> mine{h_pre.to_double(), h_post.to_double(), h_res.to_double()};
    if (s == 0) coefficients = mine;
    EXPECT_EQ(mine, coefficients) << "slice " << s << " computed different coefficients";
  }
  const reference::PreForward forward = reference::pre_forward(config, x, params);
  auto forward_again = [&] {
    return reference::pre_forward(config, perturb(x), perturb_f32(rng, params));
  };
  expect_close("layer_in", c.dtype, layer_in, forward.layer_in,
               [&] { return forward_again().layer_in; });
  expect_close("h_pre", DType::f32, coefficients[0], forward.h_pre,
               [&] { return forward_again().h_pre; });
  expect_close("h_post", DType::f32, coefficients[1], forward.h_post,
               [&] { return forward_again().h_post; });
  expect_close("h_res", DType::f32, coefficients[2], forward.h_res,
               [&] { return forward_again().h_res; });

  // Post backward per slice: dh_post and dh_res are partial sums over the slice.
  const HostTensor h_post = HostTensor::from(DType::f32, {T, n}, coefficients[1]);
  const HostTensor h_res = HostTensor::from(DType::f32, {T, n, n}, coefficients[2]);
  Vec dxp_post(static_cast<size_t>(T * n * D)), dlayer_out(static_cast<size_t>(T * D));
  std::vector<HostTensor> dh_post_parts, dh_res_parts;
  for (int64_t s = 0; s < S; ++s) {
    HostTensor dxp(c.dtype, {T, n, Dl}), dlo(c.dtype, {T, Dl});
    dh_post_parts.emplace_back(DType::f32, std::vector<int64_t>{T, n});
    dh_res_parts.emplace_back(DType::f32, std::vector<int64_t>{T, n, n});
    backend().post_backward(
        slice_config, HostTensor::from(c.dtype, {T, n, Dl}, take_slice(g, D, 1, S, s)).ref(),
        xs[s].ref(), HostTensor::from(c.dtype, {T, Dl}, take_slice(layer_out, D, 1, S, s)).ref(),
        h_post.ref(), h_res.ref(),
        PostBackwardOutputs{dxp.mut(), dlo.mut(), dh_post_parts.back().mut(),
                            dh_res_parts.back().mut()});
    put_slice(dxp.to_double(), D, 1, S, s, dxp_post);
    put_slice(dlo.to_double(), D, 1, S, s, dlayer_out);
  }
  const reference::PostBackward post =
      reference::post_backward(config, g, x, layer_out, coefficients[1], coefficients[2]);
  auto post_again = [&] {
    return reference::post_backward(config, perturb(g), perturb(x), perturb(layer_out),
                                    perturb(coefficients[1]), perturb(coefficients[2]));
  };
  expect_close("post dx_partial", c.dtype, dxp_post, post.dx_partial,
               [&] { return post_again().dx_partial; });
  expect_close("post dlayer_out", c.dtype, dlayer_out, post.dlayer_out,
               [&] { return post_again().dlayer_out; });
  expect_close("post dh_post (summed)", DType::f32, sum_slices(dh_post_parts, {T, n}).to_double(),
               post.dh_post, [&] { return post_again().dh_post; });
  expect_close("post dh_res (summed)", DType::f32, sum_slices(dh_res_parts, {T, n, n}).to_double(),
               post.dh_res, [&] { return post_again().dh_res; });

  // Pre backward: dh_pre partials summed, then finished per slice.
  std::vector<HostTensor> dh_pre_parts;
  std::vector<HostTensor> dlis;
  for (int64_t s = 0; s < S; ++s) {
    dlis.push_back(HostTensor::from(c.dtype, {T, Dl}, take_slice(dlayer_in, D, 1, S, s)));
    dh_pre_parts.emplace_back(DType::f32, std::vector<int64_t>{T, n});
    dh_pre_parts.back().poison();
    backend().pre_backward_partials(slice_config, dlis[s].ref(), xs[s].ref(),
                                    dh_pre_parts.back().mut());
  }
  const HostTensor dh_pre = sum_slices(dh_pre_parts, {T, n});
  auto dh_pre_of = [&](const Vec& xv, const Vec& dliv) {
    Vec total(static_cast<size_t>(T * n), 0.0);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < n; ++k) {
        for (int64_t d = 0; d < D; ++d)
          total[t * n + k] += xv[(t * n + k) * D + d] * dliv[t * D + d];
      }
    }
    return total;
  };
  expect_close("dh_pre (summed)", DType::f32, dh_pre.to_double(), dh_pre_of(x, dlayer_in),
               [&] { return dh_pre_of(perturb(x), perturb(dlayer_in)); });

  const HostTensor dhp = HostTensor::from(DType::f32, {T, n}, dh_post);
  const HostTensor dhr = HostTensor::from(DType::f32, {T, n, n}, dh_res);
  Vec dx(static_cast<size_t>(T * n * D)), dnorm_weight(params.norm_weight.size()),
      dphi(params.phi.size());
  Vec dalpha, dbias;
  for (int64_t s = 0; s < S; ++s) {
    const HostTensor nw = param_rows(params.norm_weight, 1, s), phi = param_rows(params.phi, N, s);
    const Params local{nw.ref(), phi.ref(), alpha.ref(), bias.ref()};
    HostTensor dxs(c.dtype, {T, n, Dl}), dnw(DType::f32, {n * Dl}), dphis(DType::f32, {n * Dl, N}),
        da(DType::f32, {3}), db(DType::f32, {N});
    for (HostTensor* t : {&dxs, &dnw, &dphis, &da, &db}) t->poison();
    backend().pre_backward_finish(
        slice_config, dlis[s].ref(),
        HostTensor::from(c.dtype, {T, n, Dl}, take_slice(dx_partial, D, 1, S, s)).ref(),
        dh_pre.ref(), dhp.ref(), dhr.ref(), xs[s].ref(), summed.ref(), local, dxs.mut(),
        ParamGrads{dnw.mut(), dphis.mut(), da.mut(), db.mut()});
    put_slice(dxs.to_double(), D, 1, S, s, dx);
    put_slice(dnw.to_double(), D, 1, S, s, dnorm_weight);
    put_slice(dphis.to_double(), D, N, S, s, dphi);
    if (s == 0) {
      dalpha = da.to_double();
      dbias = db.to_double();
    }
    EXPECT_EQ(da.to_double(), dalpha) << "slice " << s << " computed a different dalpha";
    EXPECT_EQ(db.to_double(), dbias) << "slice " << s << " computed a different dbias";
  }
  const reference::PreBackward backward =
      reference::pre_backward(config, dlayer_in, dx_partial, dh_post, dh_res, x, params);
  auto backward_again = [&] {
    return reference::pre_backward(config, perturb(dlayer_in), perturb(dx_partial),
                                   perturb(dh_post), perturb(dh_res), perturb(x),
                                   perturb_f32(rng, params));
  };
  expect_close("dx", c.dtype, dx, backward.dx, [&] { return backward_again().dx; });
  expect_close("dnorm_weight", DType::f32, dnorm_weight, backward.grads.norm_weight,
               [&] { return backward_again().grads.norm_weight; });
  expect_close("dphi", DType::f32, dphi, backward.grads.phi,
               [&] { return backward_again().grads.phi; });
  expect_close("dalpha", DType::f32, dalpha, backward.grads.alpha,
               [&] { return backward_again().grads.alpha; });
  expect_close("dbias", DType::f32, dbias, backward.grads.bias,
               [&] { return backward_again().grads.bias; });
}

std::vector<Case> split_cases() {
  std::vector<Case> cases;
  for (Mix mix : {Mix::sinkhorn, Mix::permutations}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      for (int64_t slices : {1, 2, 3, 4}) cases.push_back({4, 12, 37, slices, mix, dtype});
      for (int64_t slices : {2, 5, 13}) cases.push_back({3, 130, 9, slices, mix, dtype});
      cases.push_back({1, 1, 3, 1, mix, dtype});
      cases.push_back({2, 8, 0, 8, mix, dtype});
      for (int64_t iters : {1, 3}) cases.push_back({4, 12, 37, 3, mix, dtype, iters});
      cases.push_back({3, 130, 9, 5, mix, dtype, 2});
    }
  }
  return cases;
}
INSTANTIATE_TEST_SUITE_P(Slices, SplitVsReference, testing::ValuesIn(split_cases()), case_name);

TEST(SplitErrors, RejectsBadSlicesAndShapes) {
  Config config;
  config.n = 2;
  config.dim = 6;
  const int64_t T = 2, N = projection_width(config);
  std::mt19937_64 rng(3);
  const reference::Params values = random_params(rng, config);
  HostParams params(config, values);
  HostTensor x = HostTensor::from(DType::f32, {T, 2, 6}, random_normal(rng, T * 12));
  HostTensor partials(DType::f32, {T, N + 1}), h_pre(DType::f32, {T, 2}),
      h_post(DType::f32, {T, 2}), h_res(DType::f32, {T, 2, 2}), layer_in(DType::f32, {T, 6});
  const PreForwardOutputs outputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()};

  Config split = config;
  split.tensor_parallel = 4;  // does not divide D = 6
  expect_error(
      [&] {
        pre_forward_partials(split, x.ref(), params.norm_weight.ref(), params.phi.ref(),
                             partials.mut());
      },
      "mhc::pre_forward_partials", "config.tensor_parallel", "divisor of D = 6");
  split.tensor_parallel = 0;
  expect_error(
      [&] { post_forward(split, x.ref(), layer_in.ref(), h_post.ref(), h_res.ref(), x.mut()); },
      "mhc::post_forward", "config.tensor_parallel", "got 0");

  split.tensor_parallel = 2;  // x must then hold 3 features per stream
  expect_error(
      [&] {
        pre_forward_partials(split, x.ref(), params.norm_weight.ref(), params.phi.ref(),
                             partials.mut());
      },
      "mhc::pre_forward_partials", "x", "[T, 2, 3]");
  expect_error([&] { pre_forward(split, x.ref(), params.view(), outputs); }, "mhc::pre_forward",
               "config.tensor_parallel", "pre_forward_partials and pre_forward_finish");
  HostTensor dx(DType::f32, {T, 2, 6});
  HostGrads grads(config);
  expect_error(
      [&] {
        pre_backward(split, layer_in.ref(), x.ref(), h_pre.ref(), h_res.ref(), x.ref(),
                     params.view(), dx.mut(), grads.view());
      },
      "mhc::pre_backward", "config.tensor_parallel",
      "pre_backward_partials and pre_backward_finish");

  // One slice (tensor_parallel = 1): the split ops check the local shapes like the fused ones.
  HostTensor short_partials(DType::f32, {T, N});
  expect_error(
      [&] {
        pre_forward_partials(config, x.ref(), params.norm_weight.ref(), params.phi.ref(),
                             short_partials.mut());
      },
      "mhc::pre_forward_partials", "partials", "[2, " + std::to_string(N + 1) + "]");
  expect_error(
      [&] {
        pre_forward_finish(config, x.ref(), short_partials.ref(), params.alpha.ref(),
                           params.bias.ref(), outputs);
      },
      "mhc::pre_forward_finish", "partials", "expected shape");
  expect_error(
      [&] {
        pre_forward_finish(config, x.ref(), partials.ref(), params.bias.ref(), params.bias.ref(),
                           outputs);
      },
      "mhc::pre_forward_finish", "alpha", "[3]");
  expect_error([&] { pre_backward_partials(config, x.ref(), x.ref(), h_pre.mut()); },
               "mhc::pre_backward_partials", "dlayer_in", "[2, 6]");
  expect_error([&] { pre_backward_partials(config, layer_in.ref(), x.ref(), x.mut()); },
               "mhc::pre_backward_partials", "dh_pre", "[2, 2]");
  expect_error(
      [&] {
        pre_backward_finish(config, layer_in.ref(), x.ref(), h_res.ref(), h_post.ref(), h_res.ref(),
                            x.ref(), partials.ref(), params.view(), dx.mut(), grads.view());
      },
      "mhc::pre_backward_finish", "dh_pre", "[2, 2]");
  expect_error(
      [&] {
        pre_backward_finish(config, layer_in.ref(), x.ref(), h_pre.ref(), h_post.ref(), h_res.ref(),
                            x.ref(), partials.ref(), params.view(), x.mut(), grads.view());
      },
      "mhc::pre_backward_finish", "dx", "overlaps");
}

}  // namespace
}  // namespace mhc::test
