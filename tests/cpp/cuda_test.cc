// CUDA-only checks beside the shared kernel tests (kernels_test.cc runs against the CUDA backend
// in this binary): the argument and workspace checks, which run without a GPU, and on a device,
// bitwise run-to-run determinism and shapes with several token groups in the fixed-order sums.
#include "mhc/cuda.h"

#include <gtest/gtest.h>

#include <cstring>

#include "backend.h"
#include "test_util.h"

namespace mhc::test {
namespace {

Config small_config() {
  Config config;
  config.n = 4;
  config.dim = 8;
  return config;
}

// Host memory stands in for device memory: every call here throws before anything is touched.
struct Buffers {
  std::vector<float> x = std::vector<float>(2 * 4 * 8), layer_in = std::vector<float>(2 * 8);
  std::vector<float> h_pre = std::vector<float>(2 * 4), h_post = std::vector<float>(2 * 4);
  std::vector<float> h_res = std::vector<float>(2 * 16);
  reference::Params values;
  HostParams params;
  Buffers() : values(zero_params()), params(small_config(), values) {}
  static reference::Params zero_params() {
    const Config config = small_config();
    const int64_t M = 32, N = projection_width(config);
    return reference::Params{Vec(M, 1.0), Vec(M * N, 0.0), Vec(3, 1.0), Vec(N, 0.0)};
  }
  PreForwardOutputs outputs() {
    return PreForwardOutputs{
        MutableTensorRef(layer_in.data(), {2, 8}), MutableTensorRef(h_pre.data(), {2, 4}),
        MutableTensorRef(h_post.data(), {2, 4}), MutableTensorRef(h_res.data(), {2, 4, 4})};
  }
};

TEST(CudaArguments, WorkspaceTooSmallOrMisaligned) {
  Buffers b;
  const Config config = small_config();
  const int64_t needed = cuda::pre_forward_workspace_bytes(config, 2);
  ASSERT_GT(needed, 0);
  expect_error(
      [&] {
        cuda::pre_forward(config, TensorRef(b.x.data(), {2, 4, 8}), b.params.view(), b.outputs(),
                          cuda::Workspace{nullptr, needed - 1}, nullptr);
      },
      "mhc::cuda::pre_forward", "workspace", "expected at least " + std::to_string(needed));
  expect_error(
      [&] {
        cuda::pre_forward(config, TensorRef(b.x.data(), {2, 4, 8}), b.params.view(), b.outputs(),
                          cuda::Workspace{nullptr, needed}, nullptr);
      },
      "mhc::cuda::pre_forward", "workspace", "non-null");
  alignas(256) static char storage[1 << 16];
  ASSERT_LE(needed + 8, static_cast<int64_t>(sizeof(storage)));
  expect_error(
      [&] {
        cuda::pre_forward(config, TensorRef(b.x.data(), {2, 4, 8}), b.params.view(), b.outputs(),
                          cuda::Workspace{storage + 8, needed}, nullptr);
      },
      "mhc::cuda::pre_forward", "workspace", "aligned to 256 bytes");
}

TEST(CudaArguments, SameChecksAsTheCpuOperations) {
  Buffers b;
  const Config config = small_config();
  // x with 3 streams where the config says 4: the shared check, named for the CUDA operation.
  expect_error(
      [&] {
        cuda::pre_forward(config, TensorRef(b.x.data(), {2, 3, 8}), b.params.view(), b.outputs(),
                          cuda::Workspace{}, nullptr);
      },
      "mhc::cuda::pre_forward", "x", "expected shape [T, 4, 8]");
  expect_error(
      [&] {
        cuda::post_forward(config, TensorRef(b.x.data(), {2, 4, 8}),
                           TensorRef(b.layer_in.data(), {2, 7}), TensorRef(b.h_post.data(), {2, 4}),
                           TensorRef(b.h_res.data(), {2, 4, 4}),
                           MutableTensorRef(b.x.data(), {2, 4, 8}), nullptr);
      },
      "mhc::cuda::post_forward", "layer_out", "expected shape [2, 8]");
  Config bad = config;
  bad.n = 0;
  expect_error([&] { cuda::pre_backward_workspace_bytes(bad, 4); },
               "mhc::cuda::pre_backward_workspace_bytes", "config.n", "expected");
  expect_error([&] { cuda::pre_forward_workspace_bytes(config, -1); },
               "mhc::cuda::pre_forward_workspace_bytes", "tokens", "expected T >= 0");
}

TEST(CudaArguments, SplitOperationsCheckToo) {
  Buffers b;
  Config split = small_config();
  split.tensor_parallel = 2;  // x holds D / 2 = 4 features per stream
  expect_error(
      [&] {
        cuda::pre_backward_partials(split, TensorRef(b.layer_in.data(), {2, 4}),
                                    TensorRef(b.x.data(), {2, 4, 4}),
                                    MutableTensorRef(b.h_pre.data(), {2, 3}), nullptr);
      },
      "mhc::cuda::pre_backward_partials", "dh_pre", "expected shape [2, 4]");
  const int64_t N = projection_width(split);
  ASSERT_GT(cuda::pre_forward_partials_workspace_bytes(split, 2), 0);
  std::vector<float> phi(16 * N), partials(2 * (N + 1));
  expect_error(
      [&] {
        cuda::pre_forward_partials(split, TensorRef(b.x.data(), {2, 4, 4}),
                                   TensorRef(b.h_res.data(), {16}), TensorRef(phi.data(), {16, N}),
                                   MutableTensorRef(partials.data(), {2, N + 1}), cuda::Workspace{},
                                   nullptr);
      },
      "mhc::cuda::pre_forward_partials", "workspace", "expected at least");
  EXPECT_GT(cuda::pre_backward_finish_workspace_bytes(split, 100), 0);
  EXPECT_LT(cuda::pre_forward_finish_workspace_bytes(split, 100),
            cuda::pre_forward_workspace_bytes(small_config(), 100));
}

TEST(CudaArguments, WorkspaceDependsOnTokens) {
  const Config config = small_config();
  EXPECT_LT(cuda::pre_backward_workspace_bytes(config, 10),
            cuda::pre_backward_workspace_bytes(config, 10000));
  EXPECT_EQ(cuda::pre_forward_workspace_bytes(config, 0), 0);
}

class CudaDevice : public testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

// Several weight-gradient token groups (2048 tokens each) and dbias groups (1024): the
// fixed-order sums across groups, against the float64 reference.
TEST_F(CudaDevice, ManyTokenGroups) {
  Config config;
  config.n = 4;
  config.dim = 24;
  const int64_t T = 4500, n = 4, D = 24;
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const reference::Params params = random_params(rng, config);
  HostTensor x = HostTensor::from(DType::f32, {T, n, D}, random_normal(rng, T * n * D));
  HostTensor dli = HostTensor::from(DType::f32, {T, D}, random_normal(rng, T * D));
  HostTensor dxp = HostTensor::from(DType::f32, {T, n, D}, random_normal(rng, T * n * D));
  HostTensor dhp = HostTensor::from(DType::f32, {T, n}, random_normal(rng, T * n));
  HostTensor dhr = HostTensor::from(DType::f32, {T, n, n}, random_normal(rng, T * n * n));
  HostParams host_params(config, params);
  HostTensor dx(DType::f32, {T, n, D});
  HostGrads grads(config);
  dx.poison();
  grads.poison();
  backend().pre_backward(config, dli.ref(), dxp.ref(), dhp.ref(), dhr.ref(), x.ref(),
                         host_params.view(), dx.mut(), grads.view());
  const reference::PreBackward want =
      reference::pre_backward(config, dli.to_double(), dxp.to_double(), dhp.to_double(),
                              dhr.to_double(), x.to_double(), params);
  const reference::Params got = grads.to_double();
  EXPECT_LE(relative_error(dx.to_double(), want.dx), 1e-5) << "seed " << seed;
  EXPECT_LE(relative_error(got.phi, want.grads.phi), 1e-5) << "seed " << seed;
  EXPECT_LE(relative_error(got.norm_weight, want.grads.norm_weight), 1e-5) << "seed " << seed;
  EXPECT_LE(relative_error(got.bias, want.grads.bias), 1e-5) << "seed " << seed;
  EXPECT_LE(relative_error(got.alpha, want.grads.alpha), 1e-4) << "seed " << seed;
}

// Two runs of the backward on the same inputs give the same bits (no atomics, fixed orders).
TEST_F(CudaDevice, BitwiseRunToRun) {
  Config config;
  config.n = 4;
  config.dim = 520;
  const int64_t T = 3000, n = 4, D = 520;
  std::mt19937_64 rng(fresh_seed());
  const reference::Params params = random_params(rng, config);
  HostTensor x = HostTensor::from(DType::bf16, {T, n, D}, random_normal(rng, T * n * D));
  HostTensor dli = HostTensor::from(DType::bf16, {T, D}, random_normal(rng, T * D));
  HostTensor dxp = HostTensor::from(DType::bf16, {T, n, D}, random_normal(rng, T * n * D));
  HostTensor dhp = HostTensor::from(DType::f32, {T, n}, random_normal(rng, T * n));
  HostTensor dhr = HostTensor::from(DType::f32, {T, n, n}, random_normal(rng, T * n * n));
  HostParams host_params(config, params);
  std::vector<Vec> runs;
  for (int run = 0; run < 2; ++run) {
    HostTensor dx(DType::bf16, {T, n, D});
    HostGrads grads(config);
    backend().pre_backward(config, dli.ref(), dxp.ref(), dhp.ref(), dhr.ref(), x.ref(),
                           host_params.view(), dx.mut(), grads.view());
    const reference::Params g = grads.to_double();
    Vec all = dx.to_double();
    for (const Vec* part : {&g.norm_weight, &g.phi, &g.alpha, &g.bias}) {
      all.insert(all.end(), part->begin(), part->end());
    }
    runs.push_back(std::move(all));
  }
  ASSERT_EQ(runs[0].size(), runs[1].size());
  EXPECT_EQ(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(double)), 0);
}

}  // namespace
}  // namespace mhc::test
