// Bitwise reproducibility: the same results for 1, 2 and 3 threads and across repeated runs.
#include <gtest/gtest.h>

#include <cstring>

#include "test_util.h"

namespace mhc::test {
namespace {

struct Outputs {
  std::vector<HostTensor> tensors;
  bool operator==(const Outputs& other) const {
    if (tensors.size() != other.tensors.size()) return false;
    for (size_t k = 0; k < tensors.size(); ++k) {
      const HostTensor& a = tensors[k];
      const HostTensor& b = other.tensors[k];
      if (a.bytes() != b.bytes() ||
          std::memcmp(a.data(), b.data(), static_cast<size_t>(a.bytes())) != 0) {
        return false;
      }
    }
    return true;
  }
};

// All four operations on one fixed random problem; every output kept.
Outputs run_all(const Config& config, int64_t T, DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t n = config.n, D = config.dim;
  const reference::Params params = random_params(rng, config);
  HostParams host_params(config, params);
  auto random = [&](DType type, std::vector<int64_t> shape) {
    int64_t count = 1;
    for (int64_t e : shape) count *= e;
    return HostTensor::from(type, std::move(shape), random_normal(rng, count));
  };
  HostTensor x = random(dtype, {T, n, D});
  HostTensor layer_out = random(dtype, {T, D});
  HostTensor g = random(dtype, {T, n, D});
  HostTensor dlayer_in = random(dtype, {T, D});
  Outputs o;
  o.tensors = {HostTensor(dtype, {T, D}),         HostTensor(DType::f32, {T, n}),
               HostTensor(DType::f32, {T, n}),    HostTensor(DType::f32, {T, n, n}),
               HostTensor(dtype, {T, n, D}),      HostTensor(dtype, {T, n, D}),
               HostTensor(dtype, {T, D}),         HostTensor(DType::f32, {T, n}),
               HostTensor(DType::f32, {T, n, n}), HostTensor(dtype, {T, n, D})};
  auto& t = o.tensors;
  pre_forward(config, x.ref(), host_params.view(),
              PreForwardOutputs{t[0].mut(), t[1].mut(), t[2].mut(), t[3].mut()});
  post_forward(config, x.ref(), layer_out.ref(), t[2].ref(), t[3].ref(), t[4].mut());
  post_backward(config, g.ref(), x.ref(), layer_out.ref(), t[2].ref(), t[3].ref(),
                PostBackwardOutputs{t[5].mut(), t[6].mut(), t[7].mut(), t[8].mut()});
  HostGrads grads(config);
  pre_backward(config, dlayer_in.ref(), t[5].ref(), t[7].ref(), t[8].ref(), x.ref(),
               host_params.view(), t[9].mut(), grads.view());
  for (HostTensor* grad : {&grads.norm_weight, &grads.phi, &grads.alpha, &grads.bias}) {
    o.tensors.push_back(*grad);
  }
  return o;
}

class Determinism : public testing::TestWithParam<std::tuple<Mix, DType>> {
 protected:
  void TearDown() override { set_num_threads(0); }
};

TEST_P(Determinism, SameBitsForAnyThreadCountAndRun) {
  Config config;
  config.mix = std::get<0>(GetParam());
  config.n = 4;
  config.dim = 130;
  const DType dtype = std::get<1>(GetParam());
  // Enough tokens for many tiles and every gradient chunk.
  const int64_t T = 2000;
  const uint64_t seed = fresh_seed();
  set_num_threads(1);
  ASSERT_EQ(num_threads(), 1);
  const Outputs one = run_all(config, T, dtype, seed);
  const Outputs again = run_all(config, T, dtype, seed);
  set_num_threads(2);
  ASSERT_EQ(num_threads(), 2);
  const Outputs two = run_all(config, T, dtype, seed);
  set_num_threads(3);
  const Outputs three = run_all(config, T, dtype, seed);
  EXPECT_TRUE(one == again) << "two runs differ (seed " << seed << ")";
  EXPECT_TRUE(one == two) << "1 vs 2 threads differ (seed " << seed << ")";
  EXPECT_TRUE(one == three) << "1 vs 3 threads differ (seed " << seed << ")";
}

INSTANTIATE_TEST_SUITE_P(MixAndDtype, Determinism,
                         testing::Combine(testing::Values(Mix::sinkhorn, Mix::permutations),
                                          testing::Values(DType::f32, DType::bf16)));

// Decode sizes: with fewer token tiles than threads the pre operations split each tile's
// projection and second sweep over the rows of W, and with fewer than 8 tokens the kernels fold W
// in registers; the results must be the bits of one thread's token-by-token run (T = 1 and 8
// split the rows, T = 70 splits the rows of two tiles, 8 threads exercise both). n = 3 makes
// N = 15 (Sinkhorn) and 12 (permutations), so the last column vector overlaps the one before.
class DecodeDeterminism : public testing::TestWithParam<std::tuple<int64_t, int64_t, DType>> {
 protected:
  void TearDown() override { set_num_threads(0); }
};

TEST_P(DecodeDeterminism, SameBitsForAnyThreadCount) {
  const auto [n, T, dtype] = GetParam();
  for (Mix mix : {Mix::sinkhorn, Mix::permutations}) {
    for (int64_t dim : {int64_t{130}, int64_t{1024}}) {
      Config config;
      config.mix = mix;
      config.n = n;
      config.dim = dim;
      const uint64_t seed = fresh_seed();
      set_num_threads(1);
      const Outputs one = run_all(config, T, dtype, seed);
      for (int threads : {2, 3, 8}) {
        set_num_threads(threads);
        EXPECT_TRUE(run_all(config, T, dtype, seed) == one)
            << "1 vs " << threads << " threads differ: n=" << n << " D=" << dim << " T=" << T
            << " mix=" << to_string(mix) << " (seed " << seed << ")";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(FewTokens, DecodeDeterminism,
                         testing::Combine(testing::Values(int64_t{3}, int64_t{4}),
                                          testing::Values(int64_t{1}, int64_t{8}, int64_t{70}),
                                          testing::Values(DType::f32, DType::bf16)));

// Many tiles per gradient chunk: at T = 16384, n = 2, D = 8 (256 tiles of 64 tokens, 16 chunks
// of 16) each chunk adds 16 tiles' f32 weight-gradient sums into its double accumulator, in tile
// order on one worker; chunk boundaries come from the shapes only, so the bits do not depend on
// the thread count (the T = 2000 case above has two tiles per chunk).
TEST(LongDeterminism, ManyTilesPerChunkSameBitsForAnyThreadCount) {
  Config config;
  config.n = 2;
  config.dim = 8;
  for (DType dtype : {DType::f32, DType::bf16}) {
    const uint64_t seed = fresh_seed();
    set_num_threads(1);
    const Outputs one = run_all(config, 16384, dtype, seed);
    for (int threads : {2, 3}) {
      set_num_threads(threads);
      EXPECT_TRUE(run_all(config, 16384, dtype, seed) == one)
          << "1 vs " << threads << " threads differ: " << to_string(dtype) << " (seed " << seed
          << ")";
    }
  }
  set_num_threads(0);
}

// Resizing the pool between calls with jobs of many and of few tiles: new workers must not join a
// job they were not counted in (a stale-generation race once let them run tasks of the next job
// under a worker index beyond its scratch). Results must stay identical throughout.
TEST(Threads, ResizeBetweenCallsKeepsResults) {
  Config config;
  config.n = 4;
  config.dim = 64;
  const uint64_t seed = fresh_seed();
  set_num_threads(1);
  const Outputs many = run_all(config, 1000, DType::f32, seed);
  const Outputs few = run_all(config, 128, DType::f32, seed);
  for (int round = 0; round < 20; ++round) {
    set_num_threads(round % 2 == 0 ? 8 : 7);
    EXPECT_TRUE(run_all(config, 1000, DType::f32, seed) == many) << "round " << round;
    EXPECT_TRUE(run_all(config, 128, DType::f32, seed) == few) << "round " << round;
  }
  set_num_threads(0);
}

TEST(Threads, SettableAndResettable) {
  set_num_threads(3);
  EXPECT_EQ(num_threads(), 3);
  set_num_threads(0);
  EXPECT_GE(num_threads(), 1);
}

}  // namespace
}  // namespace mhc::test
