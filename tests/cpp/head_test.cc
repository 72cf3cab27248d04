// DeepSeek-V4's head (mhc/ops.h: head_forward, head_backward) against the float64 reference
// (spec: Head; Accuracy), the same bits at 1 and 3 threads, and its argument errors. Outputs are
// poisoned with NaN before each call; the parameters give gates well away from 0 and 1 (scale of
// order 1 with either sign, random base). Some cases run pre_eps = 0.1 (the default 1e-6 is below
// the f32 bound of the gates it is added to: a head that drops it misses the reference by 1e-6
// relative there, and by ~0.1 at 0.1).
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "test_util.h"

namespace mhc::test {
namespace {

struct HeadCase {
  int64_t n, D, T;
  DType dtype;
  bool large_pre_eps = false;  // pre_eps = 0.1 instead of the default
};

std::string head_case_name(const testing::TestParamInfo<HeadCase>& info) {
  const HeadCase& c = info.param;
  return "n" + std::to_string(c.n) + "_D" + std::to_string(c.D) + "_T" + std::to_string(c.T) + "_" +
         to_string(c.dtype) + (c.large_pre_eps ? "_pre_eps0_1" : "");
}

std::vector<HeadCase> head_cases() {
  std::vector<HeadCase> cases;
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (int64_t n : {1, 3, 4, 8}) {
      for (int64_t D : {1, 33, 130}) {
        for (int64_t T : {0, 1, 37}) cases.push_back({n, D, T, dtype});
      }
    }
    // The projection's blocks and the decode split (D = 4096), many tiles and chunks (T = 4096).
    cases.push_back({4, 4096, 1, dtype});
    cases.push_back({4, 4096, 37, dtype});
    cases.push_back({4, 130, 4096, dtype});
    cases.push_back({16, 64, 300, dtype});
    // pre_eps = 0.1 through the one-tile path, the decode split and several tiles.
    cases.push_back({3, 33, 37, dtype, true});
    cases.push_back({4, 4096, 1, dtype, true});
    cases.push_back({4, 130, 4096, dtype, true});
  }
  return cases;
}

reference::HeadParams random_head_params(std::mt19937_64& rng, const Config& config) {
  const int64_t M = flat_width(config);
  std::uniform_real_distribution<double> magnitude(0.5, 1.5);
  std::bernoulli_distribution negative(0.3);
  return reference::HeadParams{
      round_to(DType::f32, random_normal(rng, config.n * M, 1.0 / std::sqrt(double(M)))),
      round_to(DType::f32, random_normal(rng, config.n, 1.0)),
      round_to(DType::f32, {magnitude(rng) * (negative(rng) ? -1.0 : 1.0)})};
}

struct HostHead {
  HostTensor fn, base, scale;
  HostHead(const Config& config, const reference::HeadParams& values)
      : fn(HostTensor::from(DType::f32, {config.n, flat_width(config)}, values.fn)),
        base(HostTensor::from(DType::f32, {config.n}, values.base)),
        scale(HostTensor::from(DType::f32, {1}, values.scale)) {}
  explicit HostHead(const Config& config)
      : fn(DType::f32, {config.n, flat_width(config)}),
        base(DType::f32, {config.n}),
        scale(DType::f32, {1}) {}
  HeadParams view() const { return HeadParams{fn.ref(), base.ref(), scale.ref()}; }
  HeadGrads grads() { return HeadGrads{fn.mut(), base.mut(), scale.mut()}; }
  void poison() {
    fn.poison();
    base.poison();
    scale.poison();
  }
};

class HeadVsReference : public testing::TestWithParam<HeadCase> {
 protected:
  void TearDown() override { set_num_threads(0); }
};

TEST_P(HeadVsReference, ForwardAndBackward) {
  const HeadCase& c = GetParam();
  Config config;
  config.n = c.n;
  config.dim = c.D;
  if (c.large_pre_eps) config.pre_eps = 0.1f;
  const int64_t T = c.T, n = c.n, D = c.D;
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const reference::HeadParams values = random_head_params(rng, config);
  const HostHead params(config, values);
  const HostTensor x = HostTensor::from(c.dtype, {T, n, D}, random_normal(rng, T * n * D));
  const HostTensor dout = HostTensor::from(c.dtype, {T, D}, random_normal(rng, T * D));
  const std::string context = describe(config, T, c.dtype) +
                              " pre_eps=" + std::to_string(config.pre_eps) + ", seed " +
                              std::to_string(seed);

  // Each output at 1 and at 3 threads: the same bits.
  struct Results {
    HostTensor out, gates, dx;
    HostHead grads;
  };
  auto run = [&](int threads) {
    set_num_threads(threads);
    Results r{HostTensor(c.dtype, {T, D}), HostTensor(DType::f32, {T, n}),
              HostTensor(c.dtype, {T, n, D}), HostHead(config)};
    r.out.poison();
    r.gates.poison();
    r.dx.poison();
    r.grads.poison();
    head_forward(config, x.ref(), params.view(), r.out.mut(), r.gates.mut());
    head_backward(config, dout.ref(), x.ref(), params.view(), r.dx.mut(), r.grads.grads());
    return r;
  };
  Results one = run(1);
  const Results three = run(3);
  EXPECT_TRUE(bitwise_equal(one.out, three.out)) << context;
  EXPECT_TRUE(bitwise_equal(one.gates, three.gates)) << context;
  EXPECT_TRUE(bitwise_equal(one.dx, three.dx)) << context;
  EXPECT_TRUE(bitwise_equal(one.grads.fn, three.grads.fn)) << context;
  EXPECT_TRUE(bitwise_equal(one.grads.base, three.grads.base)) << context;
  EXPECT_TRUE(bitwise_equal(one.grads.scale, three.grads.scale)) << context;

  const Vec xd = x.to_double(), doutd = dout.to_double();
  const reference::HeadForward want = reference::head_forward(config, xd, values);
  const reference::HeadBackward want_grad = reference::head_backward(config, doutd, xd, values);
  // The reference's spread (test_util.h, expect_matches): inputs moved by one f32 unit.
  auto moved = [&]() {
    return reference::HeadParams{perturb_f32(rng, values.fn), perturb_f32(rng, values.base),
                                 perturb_f32(rng, values.scale)};
  };
  auto check = [&](const std::string& name, const HostTensor& got, const Vec& ref,
                   const std::function<Vec()>& resample) {
    expect_matches(name, got.dtype(), got.to_double(), ref, resample, context);
  };
  auto forward_moved = [&] {
    return reference::head_forward(config, perturb_f32(rng, xd), moved());
  };
  check("out", one.out, want.out, [&] { return forward_moved().out; });
  check("gates", one.gates, want.gates, [&] { return forward_moved().gates; });
  auto backward_moved = [&] {
    return reference::head_backward(config, perturb_f32(rng, doutd), perturb_f32(rng, xd), moved());
  };
  check("dx", one.dx, want_grad.dx, [&] { return backward_moved().dx; });
  check("dfn", one.grads.fn, want_grad.grads.fn, [&] { return backward_moved().grads.fn; });
  check("dbase", one.grads.base, want_grad.grads.base, [&] { return backward_moved().grads.base; });
  check("dscale", one.grads.scale, want_grad.grads.scale,
        [&] { return backward_moved().grads.scale; });
}

INSTANTIATE_TEST_SUITE_P(Shapes, HeadVsReference, testing::ValuesIn(head_cases()), head_case_name);

// The head is the pre operation's gates alone: with phi = [fn^T | 0], alpha = (scale, 0, 0),
// bias = [base | 0] and norm_weight = ones, pre_forward's layer_in and h_pre are the head's out
// and gates (the spec's "steps 1-4 and 6 with only the pre columns"). Equal to f32 rounding, not
// to the bit: the projection's micro-kernels block the columns by N, and a compiler may contract
// a column's products differently in the N = n and the N = 2n + R code.
TEST(Head, IsThePreGatesAlone) {
  Config config;
  config.n = 4;
  config.dim = 130;
  const int64_t T = 70, n = 4, D = 130, M = n * D, N = projection_width(config);
  std::mt19937_64 rng(fresh_seed());
  const reference::HeadParams values = random_head_params(rng, config);
  reference::Params pre{Vec(static_cast<size_t>(M), 1.0),
                        Vec(static_cast<size_t>(M * N), 0.0),
                        {values.scale[0], 0.0, 0.0},
                        Vec(static_cast<size_t>(N), 0.0)};
  for (int64_t k = 0; k < n; ++k) {
    pre.bias[k] = values.base[k];
    for (int64_t m = 0; m < M; ++m) pre.phi[m * N + k] = values.fn[k * M + m];
  }
  const HostTensor x = HostTensor::from(DType::f32, {T, n, D}, random_normal(rng, T * M));
  HostTensor out(DType::f32, {T, D}), gates(DType::f32, {T, n});
  head_forward(config, x.ref(), HostHead(config, values).view(), out.mut(), gates.mut());
  HostTensor layer_in(DType::f32, {T, D}), h_pre(DType::f32, {T, n}), h_post(DType::f32, {T, n}),
      h_res(DType::f32, {T, n, n});
  pre_forward(config, x.ref(), HostParams(config, pre).view(),
              PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
  EXPECT_LE(relative_error(out.to_double(), layer_in.to_double()), 1e-6);
  EXPECT_LE(relative_error(gates.to_double(), h_pre.to_double()), 1e-6);
}

TEST(HeadErrors, NameTheArgument) {
  Config config;
  config.n = 3;
  config.dim = 5;
  const int64_t T = 2, n = 3, D = 5, M = 15;
  HostTensor x(DType::f32, {T, n, D}), out(DType::f32, {T, D}), gates(DType::f32, {T, n}),
      dx(DType::f32, {T, n, D}), dout(DType::f32, {T, D});
  HostHead params(config), grads(config);
  auto forward = [&](const HeadParams& p, const MutableTensorRef& o) {
    return [&, p, o] { head_forward(config, x.ref(), p, o, gates.mut()); };
  };
  const std::string fwd = "mhc::head_forward", bwd = "mhc::head_backward";
  HostTensor wide_fn(DType::f32, {n, M + 1});
  expect_error(forward(HeadParams{wide_fn.ref(), params.base.ref(), params.scale.ref()}, out.mut()),
               fwd, "params.fn", "expected shape [3, 15]");
  HostTensor two(DType::f32, {2});
  expect_error(forward(HeadParams{params.fn.ref(), params.base.ref(), two.ref()}, out.mut()), fwd,
               "params.scale", "expected shape [1]");
  HostTensor bf16_out(DType::bf16, {T, D});
  expect_error(forward(params.view(), bf16_out.mut()), fwd, "out", "expected dtype f32");
  expect_error([&] { head_forward(config, x.ref(), params.view(), out.mut(), out.mut()); }, fwd,
               "gates", "expected shape [2, 3]");
  expect_error(
      [&] {
        head_forward(config, x.ref(), params.view(),
                     MutableTensorRef(const_cast<void*>(x.data()), DType::f32, {T, D}),
                     gates.mut());
      },
      fwd, "out", "overlaps x");
  HostTensor bf16_dout(DType::bf16, {T, D});
  expect_error(
      [&] {
        head_backward(config, bf16_dout.ref(), x.ref(), params.view(), dx.mut(), grads.grads());
      },
      bwd, "dout", "expected dtype f32");
  HostTensor short_base(DType::f32, {n - 1});
  expect_error(
      [&] {
        head_backward(config, dout.ref(), x.ref(), params.view(), dx.mut(),
                      HeadGrads{grads.fn.mut(), short_base.mut(), grads.scale.mut()});
      },
      bwd, "grads.base", "expected shape [3]");
  Config split = config;
  split.dim = 6;
  split.tensor_parallel = 2;
  expect_error([&] { head_forward(split, x.ref(), params.view(), out.mut(), gates.mut()); }, fwd,
               "config.tensor_parallel", "all-gather of D before the head");
}

}  // namespace
}  // namespace mhc::test
