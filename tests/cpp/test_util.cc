#include "test_util.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>

namespace mhc::test {

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape)
    : dtype_(dtype), shape_(std::move(shape)) {
  if (dtype_ == DType::f32) {
    f32_.assign(static_cast<size_t>(size()), 0.0f);
  } else {
    bf16_.assign(static_cast<size_t>(size()), bf16{});
  }
}

HostTensor HostTensor::from(DType dtype, std::vector<int64_t> shape, const Vec& values) {
  HostTensor tensor(dtype, std::move(shape));
  tensor.set(values);
  return tensor;
}

int64_t HostTensor::size() const {
  int64_t count = 1;
  for (int64_t extent : shape_) count *= extent;
  return count;
}

void HostTensor::set(const Vec& values) {
  for (size_t k = 0; k < values.size(); ++k) {
    if (dtype_ == DType::f32) {
      f32_.at(k) = static_cast<float>(values[k]);
    } else {
      bf16_.at(k) = to_bf16(static_cast<float>(values[k]));
    }
  }
}

Vec HostTensor::to_double() const {
  Vec values(static_cast<size_t>(size()));
  for (size_t k = 0; k < values.size(); ++k) {
    values[k] = dtype_ == DType::f32 ? f32_[k] : to_float(bf16_[k]);
  }
  return values;
}

void HostTensor::poison() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float& v : f32_) v = nan;
  for (bf16& v : bf16_) v = to_bf16(nan);
}

const void* HostTensor::data() const {
  if (size() == 0) return nullptr;
  return dtype_ == DType::f32 ? static_cast<const void*>(f32_.data())
                              : static_cast<const void*>(bf16_.data());
}

TensorRef HostTensor::ref() const {
  TensorRef view;
  view.data = data();
  view.dtype = dtype_;
  view.rank = static_cast<int>(shape_.size());
  for (size_t axis = 0; axis < shape_.size(); ++axis) view.shape[axis] = shape_[axis];
  return view;
}

MutableTensorRef HostTensor::mut() {
  MutableTensorRef view;
  view.data = const_cast<void*>(data());
  view.dtype = dtype_;
  view.rank = static_cast<int>(shape_.size());
  for (size_t axis = 0; axis < shape_.size(); ++axis) view.shape[axis] = shape_[axis];
  return view;
}

double relative_error(const Vec& got, const Vec& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::quiet_NaN();
  double diff = 0.0, norm = 0.0, got_norm = 0.0;
  for (size_t k = 0; k < got.size(); ++k) {
    diff += (got[k] - want[k]) * (got[k] - want[k]);
    norm += want[k] * want[k];
    got_norm += got[k] * got[k];
  }
  if (std::isnan(diff) || std::isnan(got_norm)) return std::numeric_limits<double>::quiet_NaN();
  if (norm == 0.0) return std::sqrt(got_norm);
  return std::sqrt(diff / norm);
}

double half_bf16_ulp(double value) {
  const double magnitude = std::fabs(value);
  if (!(magnitude >= 0x1p-126)) return 0x1p-134;  // zero and the subnormal range: fixed spacing
  int exponent = 0;
  std::frexp(magnitude, &exponent);  // magnitude in [2^(exponent-1), 2^exponent)
  return std::ldexp(1.0, exponent - 1 - 8);
}

testing::AssertionResult matches_reference(DType dtype, const Vec& got, const Vec& want,
                                           double relative) {
  if (got.size() != want.size()) {
    return testing::AssertionFailure()
           << got.size() << " values where the reference has " << want.size();
  }
  const double error = relative_error(got, want);
  if (dtype == DType::f32) {
    if (error <= relative) return testing::AssertionSuccess();
    return testing::AssertionFailure()
           << "relative error " << error << " > " << relative << " (f32 output)";
  }
  double squares = 0.0;
  for (double v : want) squares += v * v;
  const double slack = want.empty() ? 0.0 : relative * std::sqrt(squares / want.size());
  size_t worst = 0, outside = 0;
  double worst_excess = -1.0;
  for (size_t k = 0; k < got.size(); ++k) {
    const double bound = half_bf16_ulp(std::fmax(std::fabs(got[k]), std::fabs(want[k]))) + slack;
    const double excess = std::fabs(got[k] - want[k]) - bound;
    if (!(excess <= 0.0)) {
      ++outside;
      if (!(excess <= worst_excess)) {
        worst_excess = excess;
        worst = k;
      }
    }
  }
  if (outside == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure()
         << outside << " of " << got.size()
         << " bf16 elements off the rounded float64 value by more than half an ulp; worst ["
         << worst << "] " << got[worst] << " vs " << want[worst] << " (relative norm error "
         << error << ")";
}

Vec perturb_f32(std::mt19937_64& rng, const Vec& values) {
  std::uniform_real_distribution<double> u(-0x1p-24, 0x1p-24);
  Vec result = values;
  for (double& v : result) v *= 1.0 + u(rng);
  return result;
}

reference::Params perturb_f32(std::mt19937_64& rng, const reference::Params& params) {
  return reference::Params{perturb_f32(rng, params.norm_weight), perturb_f32(rng, params.phi),
                           perturb_f32(rng, params.alpha), perturb_f32(rng, params.bias)};
}

int spread_draws(size_t elements) {
  const size_t wanted = (kSpreadValues + elements - 1) / std::max<size_t>(elements, 1);
  return static_cast<int>(std::clamp<size_t>(wanted, 2, kSpreadValues));
}

void expect_matches(const std::string& name, DType dtype, const Vec& got, const Vec& want,
                    const std::function<Vec()>& perturbed, const std::string& context) {
  const testing::AssertionResult spec = matches_reference(dtype, got, want);
  if (spec) return;
  ASSERT_TRUE(perturbed) << name << ": " << spec.message() << ", and no reference spread given ("
                         << context << ")";
  double norm = 0.0;
  for (double v : want) norm += v * v;
  norm = std::sqrt(norm);
  // The noise's seed follows from the test's own (in `context`), so MHC_TEST_SEED replays it.
  const uint64_t noise_seed = std::hash<std::string>{}(name + context);
  const int draws = spread_draws(want.size());
  double squares = 0.0;
  for (int draw = 0; draw < draws; ++draw) {
    Vec moved;
    {
      const reference::RoundingNoise noise(noise_seed + static_cast<uint64_t>(draw), 0x1p-24);
      moved = perturbed();
    }
    if (moved.size() != want.size()) {
      ADD_FAILURE() << name << ": the perturbed reference has " << moved.size() << " values, not "
                    << want.size();
      return;
    }
    for (size_t k = 0; k < moved.size(); ++k)
      squares += (moved[k] - want[k]) * (moved[k] - want[k]);
  }
  const double spread = std::sqrt(squares / draws);
  // relative_error measures against ||want||, or absolutely when want is all zeros.
  const double relative_spread = norm > 0.0 ? spread / norm : spread;
  const double allowed = std::max(1e-5, kSpreadMultiple * relative_spread);
  const testing::AssertionResult rule = matches_reference(dtype, got, want, allowed);
  // MHC_LOG_SPREAD=1 prints every use of the spread, for measuring kSpreadMultiple's margin.
  if (std::getenv("MHC_LOG_SPREAD") != nullptr) {
    std::fprintf(stderr, "spread %s dtype=%s error=%.3g relative_spread=%.3g passed=%d (%s)\n",
                 name.c_str(), to_string(dtype), relative_error(got, want), relative_spread,
                 static_cast<int>(static_cast<bool>(rule)), context.c_str());
  }
  EXPECT_TRUE(rule) << name << ": " << rule.message() << "; allowed = max(1e-5, " << kSpreadMultiple
                    << " x reference spread " << relative_spread << ") (" << context << ")";
}

uint64_t fresh_seed() {
  if (const char* text = std::getenv("MHC_TEST_SEED")) return std::strtoull(text, nullptr, 10);
  static std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device() ^
         static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
}

Vec random_normal(std::mt19937_64& rng, int64_t count, double stddev) {
  std::normal_distribution<double> normal(0.0, stddev);
  Vec values(static_cast<size_t>(count));
  for (double& v : values) v = normal(rng);
  return values;
}

Vec round_to(DType dtype, Vec values) {
  for (double& v : values) {
    const float f = static_cast<float>(v);
    v = dtype == DType::f32 ? f : to_float(to_bf16(f));
  }
  return values;
}

HostTensor random_tensor(std::mt19937_64& rng, DType dtype, std::vector<int64_t> shape) {
  int64_t count = 1;
  for (int64_t extent : shape) count *= extent;
  return HostTensor::from(dtype, std::move(shape), random_normal(rng, count));
}

bool bitwise_equal(const HostTensor& a, const HostTensor& b) {
  if (a.dtype() != b.dtype() || a.bytes() != b.bytes()) return false;
  return a.bytes() == 0 || std::memcmp(a.data(), b.data(), static_cast<size_t>(a.bytes())) == 0;
}

reference::Params random_params(std::mt19937_64& rng, const Config& config) {
  const int64_t M = flat_width(config), N = projection_width(config);
  std::uniform_real_distribution<double> magnitude(0.5, 1.5);
  std::bernoulli_distribution negative(0.3);
  reference::Params params;
  params.norm_weight = random_normal(rng, M, 0.2);
  for (double& w : params.norm_weight) w += 1.0;
  params.phi = random_normal(rng, M * N, 1.0 / std::sqrt(static_cast<double>(M)));
  for (int g = 0; g < 3; ++g) params.alpha.push_back(magnitude(rng) * (negative(rng) ? -1.0 : 1.0));
  params.bias = random_normal(rng, N, 1.0);
  // Parameters are f32 at the API: the reference must see the same rounded values.
  params.norm_weight = round_to(DType::f32, params.norm_weight);
  params.phi = round_to(DType::f32, params.phi);
  params.alpha = round_to(DType::f32, params.alpha);
  params.bias = round_to(DType::f32, params.bias);
  return params;
}

HostParams::HostParams(const Config& config, const reference::Params& values)
    : norm_weight(HostTensor::from(DType::f32, {flat_width(config)}, values.norm_weight)),
      phi(HostTensor::from(DType::f32, {flat_width(config), projection_width(config)}, values.phi)),
      alpha(HostTensor::from(DType::f32, {3}, values.alpha)),
      bias(HostTensor::from(DType::f32, {projection_width(config)}, values.bias)) {}

Params HostParams::view() const {
  return Params{norm_weight.ref(), phi.ref(), alpha.ref(), bias.ref()};
}

HostGrads::HostGrads(const Config& config)
    : norm_weight(DType::f32, {flat_width(config)}),
      phi(DType::f32, {flat_width(config), projection_width(config)}),
      alpha(DType::f32, {3}),
      bias(DType::f32, {projection_width(config)}) {}

ParamGrads HostGrads::view() {
  return ParamGrads{norm_weight.mut(), phi.mut(), alpha.mut(), bias.mut()};
}

void HostGrads::poison() {
  norm_weight.poison();
  phi.poison();
  alpha.poison();
  bias.poison();
}

reference::Params HostGrads::to_double() const {
  return reference::Params{norm_weight.to_double(), phi.to_double(), alpha.to_double(),
                           bias.to_double()};
}

HostPreOutputs::HostPreOutputs(DType dtype, int64_t T, int64_t n, int64_t D)
    : layer_in(dtype, {T, D}),
      h_pre(DType::f32, {T, n}),
      h_post(DType::f32, {T, n}),
      h_res(DType::f32, {T, n, n}) {}

PreForwardOutputs HostPreOutputs::view() {
  return PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()};
}

void HostPreOutputs::poison() {
  for (HostTensor* tensor : {&layer_in, &h_pre, &h_post, &h_res}) tensor->poison();
}

HostPostGrads::HostPostGrads(DType x_dtype, DType layer_out_dtype, int64_t T, int64_t n, int64_t D)
    : dx_partial(x_dtype, {T, n, D}),
      dlayer_out(layer_out_dtype, {T, D}),
      dh_post(DType::f32, {T, n}),
      dh_res(DType::f32, {T, n, n}) {}

PostBackwardOutputs HostPostGrads::view() {
  return PostBackwardOutputs{dx_partial.mut(), dlayer_out.mut(), dh_post.mut(), dh_res.mut()};
}

void HostPostGrads::poison() {
  for (HostTensor* tensor : {&dx_partial, &dlayer_out, &dh_post, &dh_res}) tensor->poison();
}

namespace {
struct NamedPair {
  const char* name;
  const HostTensor& a;
  const HostTensor& b;
};

testing::AssertionResult all_bitwise_equal(std::initializer_list<NamedPair> pairs) {
  std::string differing;
  for (const NamedPair& pair : pairs) {
    if (!bitwise_equal(pair.a, pair.b)) differing += std::string(" ") + pair.name;
  }
  if (differing.empty()) return testing::AssertionSuccess();
  return testing::AssertionFailure() << "different bits in" << differing;
}
}  // namespace

testing::AssertionResult bitwise_equal(const HostPreOutputs& a, const HostPreOutputs& b) {
  return all_bitwise_equal({{"layer_in", a.layer_in, b.layer_in},
                            {"h_pre", a.h_pre, b.h_pre},
                            {"h_post", a.h_post, b.h_post},
                            {"h_res", a.h_res, b.h_res}});
}

testing::AssertionResult bitwise_equal(const HostPostGrads& a, const HostPostGrads& b) {
  return all_bitwise_equal({{"dx_partial", a.dx_partial, b.dx_partial},
                            {"dlayer_out", a.dlayer_out, b.dlayer_out},
                            {"dh_post", a.dh_post, b.dh_post},
                            {"dh_res", a.dh_res, b.dh_res}});
}

testing::AssertionResult bitwise_equal(const HostGrads& a, const HostGrads& b) {
  return all_bitwise_equal({{"norm_weight", a.norm_weight, b.norm_weight},
                            {"phi", a.phi, b.phi},
                            {"alpha", a.alpha, b.alpha},
                            {"bias", a.bias, b.bias}});
}

std::string describe(const Config& config, int64_t T, DType dtype) {
  return "n=" + std::to_string(config.n) + " D=" + std::to_string(config.dim) +
         " T=" + std::to_string(T) + " mix=" + to_string(config.mix) +
         " iters=" + std::to_string(config.sinkhorn_iters) + " dtype=" + to_string(dtype);
}

void expect_finite_differences(const std::string& name, Vec& values, const Vec& analytic,
                               const std::function<double()>& loss, uint64_t seed) {
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
  EXPECT_TRUE(error <= 1e-6) << name << ": backward vs finite differences, relative error " << error
                             << " (seed " << seed << ")";
}

}  // namespace mhc::test
