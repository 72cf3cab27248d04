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
// - f32 output: ||got - want|| / ||want|| <= 1e-5;
// - bf16 output: every element within half a bf16 ulp of want (what rounding to nearest gives;
//   truncation misses by up to a whole ulp) plus 1e-5 * rms(want) for the f32 arithmetic before
//   the rounding.
// The message names the worst element. NaN never passes. `f32_bound` replaces 1e-5 only where
// f32_bound() below says so.
testing::AssertionResult matches_reference(DType dtype, const Vec& got, const Vec& want,
                                           double f32_bound = 1e-5);

// With one value per token (n * D = 1), x r = x / sqrt(x^2 + rms_eps), and the RMS backward's
// dx = r v - r^3 x^2 v (v: the gradient through the projection) keeps only rms_eps r^2 of either
// term. Both carry an f32 rounding of r |v| <= |v| / sqrt(rms_eps), so an f32 kernel's dx can be
// off by ~1e-4 |v| at the default rms_eps however exact its inputs, and perturbing the inputs does
// not show it (seen: 8e-5 relative, 41x the rounding spread, when |x| ~ 0.01). Tensors computed
// from that dx (dx of pre_backward and the head, dx_next of the boundary; the boundary's chain
// check also passes its post backward outputs as "dx_next") are held to 1e-3 when n * D = 1, every
// other tensor and shape to 1e-5. The smallest other shape, n * D = 3, cancels only when v is
// parallel to x, and has not missed 1e-5 in 700 runs of the small-shape tests.
double f32_bound(const std::string& name, int64_t n, int64_t D);

// Half a bf16 ulp at |value| (bf16 keeps 8 significant bits).
double half_bf16_ulp(double value);

// values * (1 + u), u uniform in [-2^-24, 2^-24]: inputs moved by one f32 rounding unit, the
// kernels' working precision whatever the activation dtype.
Vec perturb_f32(std::mt19937_64& rng, const Vec& values);
reference::Params perturb_f32(std::mt19937_64& rng, const reference::Params& params);

// The ill-conditioned tensors, the only ones given the conditioning allowance below: dalpha (three
// sums over all tokens of terms of both signs), a parameter gradient of at most 8 elements
// (dnorm_weight, dphi or dbias at tiny n*D or N, and the head's dfn and dbase: each element such a
// sum as well), the head's dscale (one such sum), and every
// tensor of a problem with T * D <= 8 (a one-element layer_in or dlayer_out can be a cancelling
// sum of n terms). Their norm can lie far below their terms, and no arithmetic that rounds its
// intermediates to f32 meets a relative bound there.
bool ill_conditioned(const std::string& name, size_t elements, int64_t T, int64_t D);

// `got` against `want` by matches_reference for `dtype`. `perturbed` is given only for an
// ill-conditioned tensor (the caller names which and why): when the bound fails, the absolute
// error may instead be within 32x of the largest of up to four draws of |perturbed() - want|,
// the spread that rounding alone causes. NaN never passes. `context` goes into the message.
void expect_matches(const std::string& name, DType dtype, const Vec& got, const Vec& want,
                    const std::function<Vec()>& perturbed, const std::string& context,
                    double f32_bound = 1e-5);

// A fresh seed per call (logged by the tests so a failure can be replayed with MHC_TEST_SEED).
uint64_t fresh_seed();

Vec random_normal(std::mt19937_64& rng, int64_t count, double stddev = 1.0);
// Values rounded to what `dtype` can hold, so double references see the kernel's exact inputs.
Vec round_to(DType dtype, Vec values);

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

std::string describe(const Config& config, int64_t T, DType dtype);

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
