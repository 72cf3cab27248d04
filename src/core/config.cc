// Config helpers and the lexicographic permutation enumeration (spec: Forward step 5).
#include "mhc/config.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "mhc/error.h"

namespace mhc {

const char* to_string(Mix mix) {
  switch (mix) {
    case Mix::sinkhorn: return "sinkhorn";
    case Mix::permutations: return "permutations";
  }
  return "unknown";
}

int64_t flat_width(const Config& config) { return config.n * config.dim; }

int64_t local_dim(const Config& config) { return config.dim / config.tensor_parallel; }

int64_t residual_logits(const Config& config) {
  if (config.mix == Mix::sinkhorn) return config.n * config.n;
  int64_t factorial = 1;
  for (int64_t k = 2; k <= config.n; ++k) factorial *= k;
  return factorial;
}

int64_t projection_width(const Config& config) { return 2 * config.n + residual_logits(config); }

namespace {
void check_eps(const char* op, const char* name, float value, bool allow_zero) {
  if (!std::isfinite(value) || value < 0.0f || (!allow_zero && value == 0.0f)) {
    throw Error(op, std::string("config.") + name,
                std::string("expected a finite value ") + (allow_zero ? ">= 0" : "> 0") + ", got " +
                    std::to_string(value));
  }
}
}  // namespace

void validate(const Config& config, const char* op) {
  if (config.mix != Mix::sinkhorn && config.mix != Mix::permutations) {
    throw Error(op, "config.mix",
                "expected Mix::sinkhorn or Mix::permutations, got value " +
                    std::to_string(static_cast<int>(config.mix)));
  }
  const int64_t max_n = config.mix == Mix::permutations ? kMaxPermutationStreams : kMaxStreams;
  if (config.n < 1 || config.n > max_n) {
    throw Error(op, "config.n",
                "expected 1 <= n <= " + std::to_string(max_n) +
                    " for mix=" + to_string(config.mix) + ", got " + std::to_string(config.n));
  }
  // Keeps M = n*D and M*N far from int64 overflow; real models use D <= 2^16.
  constexpr int64_t kMaxDim = int64_t{1} << 32;
  if (config.dim < 1 || config.dim > kMaxDim) {
    throw Error(op, "config.dim", "expected 1 <= D <= 2^32, got " + std::to_string(config.dim));
  }
  if (config.sinkhorn_iters < 1 || config.sinkhorn_iters > kMaxSinkhornIters) {
    throw Error(op, "config.sinkhorn_iters",
                "expected 1 <= sinkhorn_iters <= " + std::to_string(kMaxSinkhornIters) + ", got " +
                    std::to_string(config.sinkhorn_iters));
  }
  if (config.tensor_parallel < 1 || config.dim % config.tensor_parallel != 0) {
    throw Error(op, "config.tensor_parallel",
                "expected a divisor of D = " + std::to_string(config.dim) +
                    " (equal slices of D), got " + std::to_string(config.tensor_parallel));
  }
  check_eps(op, "sinkhorn_eps", config.sinkhorn_eps, true);
  check_eps(op, "rms_eps", config.rms_eps, false);
  check_eps(op, "pre_eps", config.pre_eps, true);
  if (!std::isfinite(config.post_scale)) {
    throw Error(op, "config.post_scale",
                "expected a finite value, got " + std::to_string(config.post_scale));
  }
}

std::vector<int> permutation(int64_t n, int64_t p) {
  if (n < 1 || n > kMaxPermutationStreams) {
    throw Error("mhc::permutation", "n", "expected 1 <= n <= 6, got " + std::to_string(n));
  }
  Config config;
  config.n = n;
  config.mix = Mix::permutations;
  const int64_t count = residual_logits(config);
  if (p < 0 || p >= count) {
    throw Error("mhc::permutation", "p",
                "expected 0 <= p < n! = " + std::to_string(count) + ", got " + std::to_string(p));
  }
  // Factorial number system: the leading digit of p picks among the unused values in order.
  std::vector<int> unused(static_cast<size_t>(n));
  std::iota(unused.begin(), unused.end(), 0);
  std::vector<int> result;
  int64_t block = count;
  for (int64_t remaining = n; remaining > 0; --remaining) {
    block /= remaining;
    const auto index = static_cast<size_t>(p / block);
    p %= block;
    result.push_back(unused[index]);
    unused.erase(unused.begin() + static_cast<std::ptrdiff_t>(index));
  }
  return result;
}

}  // namespace mhc
