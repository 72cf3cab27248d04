// Test helpers: host tensors in either activation dtype, random problems with non-trivial
// coefficients, and the spec's relative-norm error (NaN never passes).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "mhc/ops.h"
#include "mhc/reference.h"

namespace mhc::test {

using reference::Vec;

// An owning tensor of f32 or bf16 values with a shape; converts to and from double exactly
// (values are rounded to the dtype when set, so the double copy is what the kernel sees).
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape);
  static HostTensor from(DType dtype, std::vector<int64_t> shape, const Vec& values);

  int64_t size() const;
  DType dtype() const { return dtype_; }
  void set(const Vec& values);
  Vec to_double() const;
  void poison();  // NaN everywhere, so an output that is never written fails the comparison
  TensorRef ref() const;
  MutableTensorRef mut();
  const void* data() const;
  int64_t bytes() const { return size() * size_of(dtype_); }

 private:
  DType dtype_ = DType::f32;
  std::vector<int64_t> shape_;
  std::vector<float> f32_;
  std::vector<bf16> bf16_;
};

// ||got - want|| / ||want||; ||got|| when want is all zeros; NaN if anything is NaN.
double relative_error(const Vec& got, const Vec& want);

// The spec's bound for one output tensor of `dtype` against its float64 value `want`, computed
// from the exact inputs the kernel saw (bf16 inputs are exact in double, so a bf16 case has no
// excuse beyond the rounding of its own bf16 outputs):
// - f32 output: ||got - want|| / ||want|| <= `relative` (the spec's 1e-5 unless the reference's
//   spread allows more, expect_matches);
// - bf16 output: every element within half a bf16 ulp of want (what rounding to nearest gives;
//   truncation misses by up to a whole ulp) plus `relative` * rms(want) for the f32 arithmetic
//   before the rounding.
// The message names the worst element. NaN never passes.
testing::AssertionResult matches_reference(DType dtype, const Vec& got, const Vec& want,
                                           double relative = 1e-5);

// Half a bf16 ulp at |value| (bf16 keeps 8 significant bits).
double half_bf16_ulp(double value);

// values * (1 + u), u uniform in [-2^-24, 2^-24]: inputs moved by one f32 rounding unit, the
// kernels' working precision whatever the activation dtype (a bf16 input is exact; what the kernel
// adds to it is f32 rounding).
Vec perturb_f32(std::mt19937_64& rng, const Vec& values);
reference::Params perturb_f32(std::mt19937_64& rng, const reference::Params& params);

// The one rule of every accuracy comparison (spec: Accuracy, with the reference's conditioning):
//   allowed relative error = max(1e-5, kSpreadMultiple * spread / ||want||),
// used by matches_reference for both dtypes. The spread is how far the float64 reference moves
// when the kernel's inputs, and the intermediates the kernels round to f32 and reuse (r, P, the
// logits, the coefficients, x_next: reference::RoundingNoise), move by one f32 unit in random
// directions: the root mean square of ||perturbed() - want|| over spread_draws(size) draws, at
// least two, and enough that kSpreadValues values are drawn in all (one draw of a one-element
// tensor can land near zero by chance; 32 such values rarely all do). A well-conditioned tensor
// spreads ~1e-7 relative, so 1e-5 decides; a cancelling sum (dalpha over all tokens, a
// one-element parameter gradient, layer_in of one feature, the RMS backward's dx with one value
// per token) spreads as far as its cancellation amplifies rounding, and its kernel error with it.
// kSpreadMultiple: the kernels' error is several roundings per step, in their own order, where
// the spread draws one per intermediate. In 1000 repetitions of the small-shape tests with fresh
// seeds (1397 cases each, no failure at a multiple of 32) the 647 f32 tensors that missed 1e-5
// had error / spread: median 0.9, 99th percentile 6.2, largest 18.7 (the boundary's unrounded
// chain at n = D = 1); 37 and 41 before the intermediates moved too. 64 leaves a margin of 3.4
// over the largest, and keeps 64 x the spread of a well-conditioned tensor (3e-8 to 8e-8
// relative) under 1e-5, where the spec decides; a planted bug (1e-3 relative and more there)
// stays far beyond it. MHC_LOG_SPREAD=1 prints each use of the spread, to measure this again.
inline constexpr double kSpreadMultiple = 64.0;
inline constexpr size_t kSpreadValues = 32;
int spread_draws(size_t elements);

// `got` against `want` by the rule above. `perturbed` returns the reference's value of this tensor
// on inputs moved by perturb_f32 (expect_matches adds the RoundingNoise around each call); it runs
// only when the 1e-5 bound fails, the rule's outcome being the same either way. `context` goes
// into the message.
void expect_matches(const std::string& name, DType dtype, const Vec& got, const Vec& want,
                    const std::function<Vec()>& perturbed, const std::string& context);

// A fresh seed per call (logged by the tests so a failure can be replayed with MHC_TEST_SEED).
uint64_t fresh_seed();

Vec random_normal(std::mt19937_64& rng, int64_t count, double stddev = 1.0);
// Values rounded to what `dtype` can hold, so double references see the kernel's exact inputs.
Vec round_to(DType dtype, Vec values);

// A [shape] tensor of `dtype` holding N(0, 1) values (rounded to the dtype).
HostTensor random_tensor(std::mt19937_64& rng, DType dtype, std::vector<int64_t> shape);

// The same dtype, size and bytes: the kernels' outputs that must agree to the bit.
bool bitwise_equal(const HostTensor& a, const HostTensor& b);

// Parameters with non-trivial coefficients: alpha of order 1 with mixed signs, random bias,
// norm_weight around 1, phi ~ N(0, 1/M).
reference::Params random_params(std::mt19937_64& rng, const Config& config);

struct HostParams {
  HostTensor norm_weight, phi, alpha, bias;
  explicit HostParams(const Config& config, const reference::Params& values);
  Params view() const;
};

struct HostGrads {
  HostTensor norm_weight, phi, alpha, bias;
  explicit HostGrads(const Config& config);
  ParamGrads view();
  void poison();
  reference::Params to_double() const;
};

// The pre forward's outputs for T tokens: layer_in [T, D] in the activation dtype, h_pre and
// h_post [T, n] and h_res [T, n, n] in f32.
struct HostPreOutputs {
  HostTensor layer_in, h_pre, h_post, h_res;
  HostPreOutputs(DType dtype, int64_t T, int64_t n, int64_t D);
  PreForwardOutputs view();
  void poison();
};

// The post backward's outputs: dx_partial [T, n, D] in x's dtype, dlayer_out [T, D] in
// layer_out's, dh_post [T, n] and dh_res [T, n, n] in f32.
struct HostPostGrads {
  HostTensor dx_partial, dlayer_out, dh_post, dh_res;
  HostPostGrads(DType x_dtype, DType layer_out_dtype, int64_t T, int64_t n, int64_t D);
  PostBackwardOutputs view();
  void poison();
};

// Every tensor of `a` bitwise_equal to b's; the failure names those that differ.
testing::AssertionResult bitwise_equal(const HostPreOutputs& a, const HostPreOutputs& b);
testing::AssertionResult bitwise_equal(const HostPostGrads& a, const HostPostGrads& b);
testing::AssertionResult bitwise_equal(const HostGrads& a, const HostGrads& b);

std::string describe(const Config& config, int64_t T, DType dtype);

// The fixture of the kernel tests parameterized by a Case with n, D, T and mix: the config and T,
// a fresh seed (its rng), random parameters for a sublayer and the next, and the comparisons with
// the reference by the one rule (expect_matches) named by context(), which the test defines (the
// case and the seed). The thread count goes back to the default after each test.
template <class Case>
class KernelCaseTest : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const Case& c = this->GetParam();
    config.n = c.n;
    config.dim = c.D;
    config.mix = c.mix;
    T = c.T;
    seed = fresh_seed();
    rng.seed(seed);
    params = random_params(rng, config);
    next_params = random_params(rng, config);
  }
  void TearDown() override { set_num_threads(0); }

  virtual std::string context() const = 0;
  HostTensor random(DType dtype, std::vector<int64_t> shape) {
    return random_tensor(rng, dtype, std::move(shape));
  }
  void expect_close(const std::string& name, const HostTensor& got, const Vec& want,
                    const std::function<Vec()>& resample) {
    expect_matches(name, got.dtype(), got.to_double(), want, resample, context());
  }
  Vec perturb(const Vec& values) { return perturb_f32(rng, values); }
  reference::Params perturb(const reference::Params& p) { return perturb_f32(rng, p); }

  Config config;
  int64_t T = 0;
  uint64_t seed = 0;
  std::mt19937_64 rng;
  reference::Params params, next_params;
};

// The float64 reference's backward against central finite differences of its forward: each value
// of `values` moved by +-1e-5 relative (at least 1e-5) and restored, the difference quotient of
// loss() against `analytic` within 1e-6 relative. `name` and `seed` go into the message.
void expect_finite_differences(const std::string& name, Vec& values, const Vec& analytic,
                               const std::function<double()>& loss, uint64_t seed);

// Expects call() to throw mhc::Error naming `op` and `argument`, with `fragment` in its message.
template <class Call>
void expect_error(Call call, const std::string& op, const std::string& argument,
                  const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "expected mhc::Error for " << argument;
  } catch (const Error& error) {
    EXPECT_EQ(error.op(), op) << error.what();
    EXPECT_EQ(error.argument(), argument) << error.what();
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos)
        << "message '" << error.what() << "' lacks '" << fragment << "'";
  }
}

}  // namespace mhc::test
