// Batch invariance (spec: Accuracy): a token's forward outputs are the same bits whether it is
// computed alone (T = 1) or at any position in a larger call, at any thread count. For pre_forward,
// post_forward, the fused boundary_forward and the head, f32 and bf16. Every token of the large
// call is compared with a call of that token alone, so every tile position and tile boundary is
// covered; D = 4096 makes the lone token take the decode split (fewer tiles than threads: the
// projection split over rows of W), D = 130 and 33 the calling-thread path.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "test_util.h"

namespace mhc::test {
namespace {

struct InvarianceCase {
  int64_t n, D, T;
  Mix mix;
  DType dtype;
};

std::string invariance_case_name(const testing::TestParamInfo<InvarianceCase>& info) {
  const InvarianceCase& c = info.param;
  return std::string(to_string(c.mix)) + "_n" + std::to_string(c.n) + "_D" + std::to_string(c.D) +
         "_T" + std::to_string(c.T) + "_" + to_string(c.dtype);
}

std::vector<InvarianceCase> invariance_cases() {
  std::vector<InvarianceCase> cases;
  for (DType dtype : {DType::f32, DType::bf16}) {
    cases.push_back({4, 130, 300, Mix::sinkhorn, dtype});
    cases.push_back({3, 33, 257, Mix::permutations, dtype});
    cases.push_back({4, 4096, 40, Mix::sinkhorn, dtype});
    cases.push_back({1, 1, 70, Mix::sinkhorn, dtype});
  }
  return cases;
}

// A token-major input: `inner` is its shape after the token axis; values for every token, exact
// in `dtype`.
struct TokenInput {
  DType dtype;
  std::vector<int64_t> inner;
  Vec values;

  int64_t per_token() const {
    int64_t count = 1;
    for (int64_t e : inner) count *= e;
    return count;
  }
  // Tokens [first, first + count) as a tensor of their own.
  HostTensor tokens(int64_t first, int64_t count) const {
    std::vector<int64_t> shape{count};
    shape.insert(shape.end(), inner.begin(), inner.end());
    const auto begin = values.begin() + first * per_token();
    return HostTensor::from(dtype, shape, Vec(begin, begin + count * per_token()));
  }
};

// Runs one operation on tokens [first, first + count) of its inputs; returns its outputs.
using Operation = std::function<std::vector<HostTensor>(int64_t first, int64_t count)>;

// Token `t` of `whole` (count tokens) against `alone` (one token): the same bytes.
bool same_token_bits(const HostTensor& whole, int64_t count, int64_t t, const HostTensor& alone) {
  const int64_t bytes = alone.bytes();
  if (whole.bytes() != bytes * count) return false;
  return bytes == 0 || std::memcmp(static_cast<const char*>(whole.data()) + t * bytes, alone.data(),
                                   static_cast<size_t>(bytes)) == 0;
}

class BatchInvariance : public testing::TestWithParam<InvarianceCase> {
 protected:
  void SetUp() override {
    const InvarianceCase& c = GetParam();
    config.n = c.n;
    config.dim = c.D;
    config.mix = c.mix;
    T = c.T;
    seed = fresh_seed();
    rng.seed(seed);
  }
  void TearDown() override { set_num_threads(0); }

  TokenInput input(DType dtype, std::vector<int64_t> inner) {
    TokenInput in{dtype, std::move(inner), {}};
    in.values = round_to(dtype, random_normal(rng, T * in.per_token()));
    return in;
  }

  // The large call at 1, 2 and 3 threads, then every token alone at 1 and 3 threads: all against
  // the large call at 1 thread.
  void expect_invariant(const std::string& op, const std::vector<std::string>& names,
                        const Operation& run) {
    const std::string context =
        op + ", " + describe(config, T, GetParam().dtype) + ", seed " + std::to_string(seed);
    set_num_threads(1);
    const std::vector<HostTensor> whole = run(0, T);
    ASSERT_EQ(whole.size(), names.size());
    for (int threads : {2, 3}) {
      set_num_threads(threads);
      const std::vector<HostTensor> again = run(0, T);
      for (size_t k = 0; k < names.size(); ++k) {
        EXPECT_EQ(
            std::memcmp(whole[k].data(), again[k].data(), static_cast<size_t>(whole[k].bytes())), 0)
            << names[k] << " of the whole call differs at " << threads << " threads (" << context
            << ")";
      }
    }
    for (int threads : {1, 3}) {
      set_num_threads(threads);
      for (int64_t t = 0; t < T; ++t) {
        const std::vector<HostTensor> alone = run(t, 1);
        for (size_t k = 0; k < names.size(); ++k) {
          // One message per tensor and thread count is enough to locate a difference.
          if (!same_token_bits(whole[k], T, t, alone[k])) {
            ADD_FAILURE() << names[k] << " of token " << t << " of " << T << " computed alone at "
                          << threads << " threads differs from the whole call (" << context << ")";
            return;
          }
        }
      }
    }
  }

  Config config;
  int64_t T = 0;
  uint64_t seed = 0;
  std::mt19937_64 rng;
};

TEST_P(BatchInvariance, PreForward) {
  const int64_t n = config.n, D = config.dim;
  const DType dtype = GetParam().dtype;
  const HostParams params(config, random_params(rng, config));
  const TokenInput x = input(dtype, {n, D});
  expect_invariant(
      "pre_forward", {"layer_in", "h_pre", "h_post", "h_res"}, [&](int64_t first, int64_t count) {
        std::vector<HostTensor> out{
            HostTensor(dtype, {count, D}), HostTensor(DType::f32, {count, n}),
            HostTensor(DType::f32, {count, n}), HostTensor(DType::f32, {count, n, n})};
        for (HostTensor& o : out) o.poison();
        pre_forward(config, x.tokens(first, count).ref(), params.view(),
                    PreForwardOutputs{out[0].mut(), out[1].mut(), out[2].mut(), out[3].mut()});
        return out;
      });
}

TEST_P(BatchInvariance, PostForward) {
  const int64_t n = config.n, D = config.dim;
  const DType dtype = GetParam().dtype;
  const TokenInput x = input(dtype, {n, D}), layer_out = input(dtype, {D}),
                   h_post = input(DType::f32, {n}), h_res = input(DType::f32, {n, n});
  expect_invariant("post_forward", {"out"}, [&](int64_t first, int64_t count) {
    std::vector<HostTensor> out{HostTensor(dtype, {count, n, D})};
    out[0].poison();
    post_forward(config, x.tokens(first, count).ref(), layer_out.tokens(first, count).ref(),
                 h_post.tokens(first, count).ref(), h_res.tokens(first, count).ref(), out[0].mut());
    return out;
  });
}

TEST_P(BatchInvariance, BoundaryForward) {
  const int64_t n = config.n, D = config.dim;
  const DType dtype = GetParam().dtype;
  const HostParams next(config, random_params(rng, config));
  const TokenInput x = input(dtype, {n, D}), layer_out = input(dtype, {D}),
                   h_post = input(DType::f32, {n}), h_res = input(DType::f32, {n, n});
  expect_invariant(
      "boundary_forward", {"x_next", "next.layer_in", "next.h_pre", "next.h_post", "next.h_res"},
      [&](int64_t first, int64_t count) {
        std::vector<HostTensor> out{HostTensor(dtype, {count, n, D}), HostTensor(dtype, {count, D}),
                                    HostTensor(DType::f32, {count, n}),
                                    HostTensor(DType::f32, {count, n}),
                                    HostTensor(DType::f32, {count, n, n})};
        for (HostTensor& o : out) o.poison();
        boundary_forward(config, x.tokens(first, count).ref(), layer_out.tokens(first, count).ref(),
                         h_post.tokens(first, count).ref(), h_res.tokens(first, count).ref(),
                         next.view(), out[0].mut(),
                         PreForwardOutputs{out[1].mut(), out[2].mut(), out[3].mut(), out[4].mut()});
        return out;
      });
}

TEST_P(BatchInvariance, HeadForward) {
  const int64_t n = config.n, D = config.dim, M = n * D;
  const DType dtype = GetParam().dtype;
  const HostTensor fn = HostTensor::from(DType::f32, {n, M}, random_normal(rng, n * M, 0.05));
  const HostTensor base = HostTensor::from(DType::f32, {n}, random_normal(rng, n));
  const HostTensor scale = HostTensor::from(DType::f32, {1}, {0.8});
  const TokenInput x = input(dtype, {n, D});
  expect_invariant("head_forward", {"out", "gates"}, [&](int64_t first, int64_t count) {
    std::vector<HostTensor> out{HostTensor(dtype, {count, D}), HostTensor(DType::f32, {count, n})};
    for (HostTensor& o : out) o.poison();
    head_forward(config, x.tokens(first, count).ref(),
                 HeadParams{fn.ref(), base.ref(), scale.ref()}, out[0].mut(), out[1].mut());
    return out;
  });
}

INSTANTIATE_TEST_SUITE_P(Shapes, BatchInvariance, testing::ValuesIn(invariance_cases()),
                         invariance_case_name);

}  // namespace
}  // namespace mhc::test
