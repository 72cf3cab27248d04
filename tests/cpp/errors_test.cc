// Bad input: every rejected case throws mhc::Error naming the operation and the argument, and
// touches no output. Also the accepted edge cases: T = 0 (null data allowed) and odd sizes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>

#include "test_util.h"

namespace mhc::test {
namespace {

// Valid arguments for all four operations; each test breaks one of them.
class BadInput : public testing::Test {
 protected:
  BadInput()
      : config(make_config()),
        rng(7),
        values(random_params(rng, config)),
        params(config, values),
        grads(config),
        x(HostTensor::from(DType::f32, {T, 4, 6}, random_normal(rng, T * 24))),
        layer_out(HostTensor::from(DType::f32, {T, 6}, random_normal(rng, T * 6))),
        h_pre(DType::f32, {T, 4}),
        h_post(DType::f32, {T, 4}),
        h_res(DType::f32, {T, 4, 4}),
        layer_in(DType::f32, {T, 6}),
        out(DType::f32, {T, 4, 6}),
        dx(DType::f32, {T, 4, 6}) {}

  static Config make_config() {
    Config c;
    c.n = 4;
    c.dim = 6;
    return c;
  }
  void pre() {
    pre_forward(config, x.ref(), params.view(),
                PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
  }
  void post() {
    post_forward(config, x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(), out.mut());
  }

  static constexpr int64_t T = 3;
  Config config;
  std::mt19937_64 rng;
  reference::Params values;
  HostParams params;
  HostGrads grads;
  HostTensor x, layer_out, h_pre, h_post, h_res, layer_in, out, dx;
};

TEST_F(BadInput, ValidArgumentsPass) {
  EXPECT_NO_THROW(pre());
  EXPECT_NO_THROW(post());
}

TEST_F(BadInput, ConfigFields) {
  const std::string op = "mhc::pre_forward";
  struct Bad {
    const char* field;
    void (*mutate)(Config&);
    const char* fragment;
  };
  const Bad cases[] = {
      {"config.n", [](Config& c) { c.n = 0; }, "1 <= n <= 16"},
      {"config.n", [](Config& c) { c.n = 17; }, "got 17"},
      {"config.n",
       [](Config& c) {
         c.n = 7;
         c.mix = Mix::permutations;
       },
       "1 <= n <= 6"},
      {"config.dim", [](Config& c) { c.dim = 0; }, "1 <= D"},
      {"config.dim", [](Config& c) { c.dim = -5; }, "got -5"},
      {"config.sinkhorn_iters", [](Config& c) { c.sinkhorn_iters = 0; }, "1 <= sinkhorn_iters"},
      {"config.sinkhorn_iters", [](Config& c) { c.sinkhorn_iters = 10001; }, "10000"},
      {"config.sinkhorn_eps", [](Config& c) { c.sinkhorn_eps = -1e-3f; }, ">= 0"},
      {"config.sinkhorn_eps", [](Config& c) { c.sinkhorn_eps = std::nanf(""); }, "finite"},
      {"config.rms_eps", [](Config& c) { c.rms_eps = 0.0f; }, "> 0"},
      {"config.pre_eps", [](Config& c) { c.pre_eps = INFINITY; }, "finite"},
      {"config.post_scale", [](Config& c) { c.post_scale = NAN; }, "finite"},
      {"config.mix", [](Config& c) { c.mix = static_cast<Mix>(9); }, "Mix::sinkhorn"},
  };
  for (const Bad& bad : cases) {
    Config broken = config;
    bad.mutate(broken);
    expect_error(
        [&] {
          pre_forward(broken, x.ref(), params.view(),
                      PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
        },
        op, bad.field, bad.fragment);
  }
}

TEST_F(BadInput, ShapesDtypesAndNulls) {
  const std::string op = "mhc::pre_forward";
  HostTensor wrong_streams(DType::f32, {T, 3, 6});
  layer_in.poison();
  expect_error(
      [&] {
        pre_forward(config, wrong_streams.ref(), params.view(),
                    PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
      },
      op, "x", "expected shape [T, 4, 6]");
  EXPECT_TRUE(std::isnan(layer_in.to_double()[0])) << "an output was written before the error";

  TensorRef flat = x.ref();
  flat.rank = 2;
  expect_error(
      [&] {
        pre_forward(config, flat, params.view(),
                    PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
      },
      op, "x", "got [3, 4]");

  HostTensor half_layer_in(DType::bf16, {T, 6});
  expect_error(
      [&] {
        pre_forward(config, x.ref(), params.view(),
                    PreForwardOutputs{half_layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
      },
      op, "layer_in", "expected dtype f32, got bf16");

  HostTensor half_h_res(DType::bf16, {T, 4, 4});
  expect_error(
      [&] {
        pre_forward(config, x.ref(), params.view(),
                    PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), half_h_res.mut()});
      },
      op, "h_res", "expected dtype f32");

  Params no_phi = params.view();
  no_phi.phi.data = nullptr;
  expect_error(
      [&] {
        pre_forward(config, x.ref(), no_phi,
                    PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
      },
      op, "params.phi", "non-null");

  HostTensor short_bias(DType::f32, {projection_width(config) - 1});
  Params bad_bias = params.view();
  bad_bias.bias = short_bias.ref();
  expect_error(
      [&] {
        pre_forward(config, x.ref(), bad_bias,
                    PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
      },
      op, "params.bias", "expected shape [24]");

  MutableTensorRef no_h_pre = h_pre.mut();
  no_h_pre.data = nullptr;
  expect_error(
      [&] {
        pre_forward(config, x.ref(), params.view(),
                    PreForwardOutputs{layer_in.mut(), no_h_pre, h_post.mut(), h_res.mut()});
      },
      op, "h_pre", "non-null");

  TensorRef negative = x.ref();
  negative.shape[0] = -1;
  expect_error(
      [&] {
        pre_forward(config, negative, params.view(),
                    PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
      },
      op, "x", "T >= 0");

  TensorRef unknown = x.ref();
  unknown.dtype = static_cast<DType>(7);
  expect_error(
      [&] {
        pre_forward(config, unknown, params.view(),
                    PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
      },
      op, "x", "unknown dtype");
}

TEST_F(BadInput, SizesThatOverflow) {
  TensorRef huge = x.ref();
  huge.shape[0] = int64_t{1} << 60;
  HostTensor li(DType::f32, {0, 6});
  expect_error(
      [&] {
        pre_forward(config, huge, params.view(),
                    PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
      },
      "mhc::pre_forward", "x", "overflows");
  Config wide = config;
  wide.dim = int64_t{1} << 33;
  expect_error([&] { pre_forward(wide, x.ref(), params.view(), {}); }, "mhc::pre_forward",
               "config.dim", "2^32");
}

TEST_F(BadInput, OutputsMustNotAlias) {
  expect_error(
      [&] {
        post_forward(config, x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(),
                     MutableTensorRef(const_cast<void*>(x.data()), DType::f32, {T, 4, 6}));
      },
      "mhc::post_forward", "out", "overlaps x");
  // dh_post placed inside dh_res's buffer: two outputs overlapping each other.
  HostTensor dh_res(DType::f32, {T, 4, 4});
  const MutableTensorRef inside(static_cast<float*>(dh_res.mut().data) + 4, {T, 4});
  expect_error(
      [&] {
        post_backward(config, out.ref(), x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(),
                      PostBackwardOutputs{dx.mut(), layer_in.mut(), inside, dh_res.mut()});
      },
      "mhc::post_backward", "dh_post", "overlaps dh_res");
  // An output over an input parameter.
  expect_error(
      [&] {
        pre_backward(config, layer_out.ref(), out.ref(), h_post.ref(), h_res.ref(), x.ref(),
                     params.view(), dx.mut(),
                     ParamGrads{grads.norm_weight.mut(), grads.phi.mut(), grads.alpha.mut(),
                                MutableTensorRef(const_cast<void*>(params.bias.data()), DType::f32,
                                                 {projection_width(config)})});
      },
      "mhc::pre_backward", "grads.bias", "overlaps params.bias");
}

TEST_F(BadInput, PostAndBackwardArguments) {
  HostTensor half_layer_out(DType::bf16, {T, 6});
  expect_error(
      [&] {
        post_backward(config, out.ref(), x.ref(), half_layer_out.ref(), h_post.ref(), h_res.ref(),
                      PostBackwardOutputs{dx.mut(), layer_in.mut(), h_post.mut(), h_res.mut()});
      },
      "mhc::post_backward", "dlayer_out", "expected dtype bf16, got f32");
  HostTensor half_g(DType::bf16, {T, 4, 6});
  expect_error(
      [&] {
        post_backward(config, half_g.ref(), x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(),
                      PostBackwardOutputs{dx.mut(), layer_in.mut(), h_pre.mut(), h_res.mut()});
      },
      "mhc::post_backward", "g", "expected dtype f32, got bf16");
  HostTensor short_dli(DType::f32, {T - 1, 6});
  HostTensor dxp(DType::f32, {T, 4, 6}), dhp(DType::f32, {T, 4}), dhr(DType::f32, {T, 4, 4});
  expect_error(
      [&] {
        pre_backward(config, short_dli.ref(), dxp.ref(), dhp.ref(), dhr.ref(), x.ref(),
                     params.view(), dx.mut(), grads.view());
      },
      "mhc::pre_backward", "dlayer_in", "expected shape [3, 6], got [2, 6]");
  ParamGrads no_dalpha = grads.view();
  no_dalpha.alpha = MutableTensorRef();
  expect_error(
      [&] {
        pre_backward(config, layer_out.ref(), dxp.ref(), dhp.ref(), dhr.ref(), x.ref(),
                     params.view(), dx.mut(), no_dalpha);
      },
      "mhc::pre_backward", "grads.alpha", "expected shape [3]");
}

TEST_F(BadInput, TensorRefRankLimit) {
  float value = 0.0f;
  expect_error([&] { TensorRef(&value, {1, 1, 1, 1, 1}); }, "mhc::TensorRef", "dims", "at most 4");
}

// T = 0: null data is fine, nothing is read, parameter gradients are zeros.
TEST(EdgeCases, ZeroTokens) {
  Config config;
  config.n = 3;
  config.dim = 5;
  std::mt19937_64 rng(fresh_seed());
  HostParams params(config, random_params(rng, config));
  HostGrads grads(config);
  grads.poison();
  const TensorRef x(static_cast<const float*>(nullptr), {0, 3, 5});
  const MutableTensorRef empty_x(static_cast<float*>(nullptr), {0, 3, 5});
  const MutableTensorRef empty_row(static_cast<float*>(nullptr), {0, 5});
  const MutableTensorRef empty_n(static_cast<float*>(nullptr), {0, 3});
  const MutableTensorRef empty_nn(static_cast<float*>(nullptr), {0, 3, 3});
  EXPECT_NO_THROW(pre_forward(config, x, params.view(), {empty_row, empty_n, empty_n, empty_nn}));
  EXPECT_NO_THROW(post_forward(config, x, empty_row, empty_n, empty_nn, empty_x));
  EXPECT_NO_THROW(post_backward(config, x, x, empty_row, empty_n, empty_nn,
                                {empty_x, empty_row, empty_n, empty_nn}));
  EXPECT_NO_THROW(pre_backward(config, empty_row, x, empty_n, empty_nn, x, params.view(), empty_x,
                               grads.view()));
  const reference::Params zeros = grads.to_double();
  for (const Vec* grad : {&zeros.norm_weight, &zeros.phi, &zeros.alpha, &zeros.bias}) {
    for (double v : *grad) EXPECT_EQ(v, 0.0);
  }
}

TEST(EdgeCases, ThreadCountFromEnvironment) {
  ASSERT_EQ(setenv("MHC_NUM_THREADS", "2", 1), 0);
  set_num_threads(0);
  EXPECT_EQ(num_threads(), 2);
  ASSERT_EQ(setenv("MHC_NUM_THREADS", "not a number", 1), 0);
  set_num_threads(0);
  EXPECT_GE(num_threads(), 1);
  unsetenv("MHC_NUM_THREADS");
  set_num_threads(0);
}

}  // namespace
}  // namespace mhc::test
