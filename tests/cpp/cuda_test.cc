// CUDA-only checks beside the shared kernel tests (kernels_test.cc and edge_test.cc run against
// the CUDA backend in this binary). Without a GPU: the argument, workspace and grid checks (and
// that a refused grid enqueues nothing), and that the edge shapes still reach the kernel loops
// they were chosen for (CudaCoverage). On a device:
// bitwise run-to-run determinism, several token groups in the fixed-order sums, grids past the
// kernels' caps (their grid-stride loops), and the small cases that scripts/gpu_check.sh runs
// under compute-sanitizer (CudaSanitizer). With MHC_REQUIRE_CUDA=1 a missing device fails every
// device test instead of skipping it.
//
// STATUS: the device tests have not run yet (no GPU where they were written).
#include "mhc/cuda.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "../../src/cuda/kernels.h"
#include "backend.h"
#include "edge_cases.h"
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

// A grid's x extent holds kMaxGridBlocks blocks: that many are accepted, one more is refused with
// the operation, the kernel and the shape in the message.
TEST(CudaArguments, GridsPastTheCudaLimitAreRefused) {
  detail::Dims d;
  d.T = 5, d.n = 4, d.D = 8;
  EXPECT_EQ(cuda::checked_grid("op", "kernel", cuda::kMaxGridBlocks, d).blocks(), 0x7fffffffu);
  EXPECT_EQ(cuda::checked_grid("op", "kernel", 0, d).blocks(), 0u);
  expect_error([&] { cuda::checked_grid("op", "input_grad", cuda::kMaxGridBlocks + 1, d); }, "op",
               "x", "expected a shape whose input_grad grid fits in 2147483647 blocks, got T = 5");
  expect_error([&] { cuda::checked_grid("op", "kernel", -1, d); }, "op", "x", "(-1 blocks)");
}

// Addresses that stand for device buffers no call here touches: each view gets its own range, so
// the argument checks (written views must not overlap) pass at sizes no machine could allocate.
class FakeDeviceMemory {
 public:
  void* take(int64_t bytes) {
    void* at = reinterpret_cast<void*>(next_);
    next_ += static_cast<uintptr_t>((bytes + 511) / 256 * 256);  // 256-aligned, a gap between
    return at;
  }

 private:
  uintptr_t next_ = uintptr_t{1} << 40;
};

// Runs call(stream), which throws, and expects that it enqueued nothing (mhc/cuda.h: errors come
// before anything is enqueued). With a device the call runs under stream capture, which records
// kernels without running them (the fake addresses are never touched), and the captured graph
// must be empty. Without one nothing can be observed: the runtime then reports its failed
// initialization on every call, cudaGetLastError included, so a launch leaves no trace; the
// error's message (the operation and the kernel, from the plan before the first launch) is all
// that is checked. STATUS: the device half is unverified (no GPU where it was written).
template <class Call>
void expect_nothing_enqueued(Call call) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    call(nullptr);
    return;
  }
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  call(stream);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  size_t nodes = 0;
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
  EXPECT_EQ(nodes, 0u) << "kernels were enqueued before the error";
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// The backward's input-gradient grid (ceil(T / 64) * ceil(n D / 32) blocks) is the one past the
// limit at T = 2^22, n D = 2^21; it is launched after the projection, dh_pre and the coefficient
// backward (pre_backward) or after the coefficient backward (pre_backward_finish), so both must
// check every grid before their first launch.
TEST(CudaArguments, GridTooLargeEnqueuesNothing) {
  Config config;
  config.n = 1;
  config.dim = int64_t{1} << 21;
  const int64_t T = int64_t{1} << 22, n = 1, D = config.dim, M = n * D;
  const int64_t N = projection_width(config);
  detail::Dims d;
  d.T = T, d.n = n, d.D = D, d.M = M, d.N = N;
  ASSERT_GT(cuda::input_grad_blocks(d), cuda::kMaxGridBlocks);
  FakeDeviceMemory memory;
  auto bf16_view = [&](std::initializer_list<int64_t> shape) {
    int64_t count = 1;
    for (int64_t extent : shape) count *= extent;
    return MutableTensorRef(memory.take(2 * count), DType::bf16, shape);
  };
  auto f32_view = [&](std::initializer_list<int64_t> shape) {
    int64_t count = 1;
    for (int64_t extent : shape) count *= extent;
    return MutableTensorRef(memory.take(4 * count), DType::f32, shape);
  };
  const TensorRef x = bf16_view({T, n, D}), dlayer_in = bf16_view({T, D});
  const TensorRef dx_partial = bf16_view({T, n, D});
  const TensorRef dh_pre = f32_view({T, n}), dh_post = f32_view({T, n});
  const TensorRef dh_res = f32_view({T, n, n}), partials = f32_view({T, N + 1});
  const Params params{f32_view({M}), f32_view({M, N}), f32_view({3}), f32_view({N})};
  const ParamGrads grads{f32_view({M}), f32_view({M, N}), f32_view({3}), f32_view({N})};
  const MutableTensorRef dx = bf16_view({T, n, D});
  const std::string message = "expected a shape whose input_grad grid fits in 2147483647 blocks";

  const int64_t fused_bytes = cuda::pre_backward_workspace_bytes(config, T);
  const cuda::Workspace fused{memory.take(fused_bytes), fused_bytes};
  expect_nothing_enqueued([&](cuda::Stream stream) {
    expect_error(
        [&] {
          cuda::pre_backward(config, dlayer_in, dx_partial, dh_post, dh_res, x, params, dx, grads,
                             fused, stream);
        },
        "mhc::cuda::pre_backward", "x", message);
  });
  const int64_t finish_bytes = cuda::pre_backward_finish_workspace_bytes(config, T);
  const cuda::Workspace finish{memory.take(finish_bytes), finish_bytes};
  expect_nothing_enqueued([&](cuda::Stream stream) {
    expect_error(
        [&] {
          cuda::pre_backward_finish(config, dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x,
                                    partials, params, dx, grads, finish, stream);
        },
        "mhc::cuda::pre_backward_finish", "x", message);
  });
}

// The edge shapes (edge_cases.h) against the CUDA launch arithmetic: each must still exceed the
// thread count of the coefficient kernel it was sized for, or the check it stands for is gone.
TEST(CudaCoverage, EdgeShapesReachTheCoefficientTokenLoop) {
  Config sinkhorn;
  sinkhorn.n = kLoopSinkhornStreams;
  sinkhorn.dim = kLoopDim;
  EXPECT_GT(kLoopSinkhornForwardTokens,
            cuda::forward_coefficient_slots(sinkhorn, kLoopSinkhornForwardTokens).threads);
  EXPECT_GT(kLoopSinkhornBackwardTokens,
            cuda::backward_coefficient_slots(sinkhorn, kLoopSinkhornBackwardTokens).threads);
  Config permutations;
  permutations.n = kLoopPermutationStreams;
  permutations.dim = kLoopDim;
  permutations.mix = Mix::permutations;
  EXPECT_GT(kLoopPermutationTokens,
            cuda::forward_coefficient_slots(permutations, kLoopPermutationTokens).threads);
  EXPECT_GT(kLoopPermutationTokens,
            cuda::backward_coefficient_slots(permutations, kLoopPermutationTokens).threads);
}

// Grid-stride shapes (the CudaDevice tests below): past each kernel family's grid cap.
constexpr int64_t kStrideTokens = cuda::kMaxTokenBlocks + 5;    // streams.cu
constexpr int64_t kSliceSumTokens = (int64_t{1} << 22) + 4096;  // sum_slices, n = 1
constexpr int64_t kWeightFinishDim = (int64_t{1} << 24) + 64;   // weight_grad_finish, n = 1

TEST(CudaCoverage, GridStrideShapesPassTheGridCaps) {
  const int64_t stride_elements = cuda::kMaxStrideBlocks * cuda::kStrideThreads;
  Config one;
  one.n = 1;
  one.dim = 1;
  EXPECT_GT(kStrideTokens, cuda::kMaxTokenBlocks);
  EXPECT_GT(kSliceSumTokens * (projection_width(one) + 1), stride_elements);  // T (N+1) partials
  EXPECT_GT(kWeightFinishDim, stride_elements);                               // M = n D rows
}

bool cuda_required() {
  const char* flag = std::getenv("MHC_REQUIRE_CUDA");
  return flag != nullptr && std::strcmp(flag, "1") == 0;
}

// The first device check of scripts/gpu_check.sh: a device is there and what it is.
TEST(CudaRequired, DeviceIsPresent) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    cudaGetLastError();
    const std::string why = status == cudaSuccess ? "0 devices" : cudaGetErrorString(status);
    if (!cuda_required()) GTEST_SKIP() << "no CUDA device (" << why << ")";
    FAIL() << "MHC_REQUIRE_CUDA=1 but no usable CUDA device: cudaGetDeviceCount: " << why;
  }
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::printf("device 0 of %d: %s, sm_%d%d, %d SMs, %.1f GiB, L2 %d MiB; driver %d, runtime %d\n",
              count, prop.name, prop.major, prop.minor, prop.multiProcessorCount,
              static_cast<double>(prop.totalGlobalMem) / (1 << 30), prop.l2CacheSize >> 20, driver,
              runtime);
  // A kernel of this build must launch here (a wrong architecture fails at the first launch).
  void* probe = nullptr;
  ASSERT_EQ(cudaMalloc(&probe, 256), cudaSuccess);
  cudaFree(probe);
  EXPECT_GT(cuda::copy_bandwidth_gbs(1 << 20, 1), 0.0);
}

class CudaDevice : public testing::Test {
 protected:
  void SetUp() override {
    // backend().available() throws when MHC_REQUIRE_CUDA=1 and there is no device.
    if (!backend().available()) GTEST_SKIP() << "no CUDA device";
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
  // Every tensor by the one accuracy rule (test_util.h, expect_matches): dalpha is three sums of
  // cancelling terms over all 4500 tokens, so it may need the reference's own spread.
  const auto perturbed = [&] {
    return reference::pre_backward(
        config, perturb_f32(rng, dli.to_double()), perturb_f32(rng, dxp.to_double()),
        perturb_f32(rng, dhp.to_double()), perturb_f32(rng, dhr.to_double()),
        perturb_f32(rng, x.to_double()), perturb_f32(rng, params));
  };
  const std::string context = "seed " + std::to_string(seed);
  expect_matches(
      "dx", DType::f32, dx.to_double(), want.dx, [&] { return perturbed().dx; }, context);
  expect_matches(
      "dphi", DType::f32, got.phi, want.grads.phi, [&] { return perturbed().grads.phi; }, context);
  expect_matches(
      "dnorm_weight", DType::f32, got.norm_weight, want.grads.norm_weight,
      [&] { return perturbed().grads.norm_weight; }, context);
  expect_matches(
      "dbias", DType::f32, got.bias, want.grads.bias, [&] { return perturbed().grads.bias; },
      context);
  expect_matches(
      "dalpha", DType::f32, got.alpha, want.grads.alpha, [&] { return perturbed().grads.alpha; },
      context);
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

// More tokens than the block-per-token kernels start blocks for (kMaxTokenBlocks): every
// streaming kernel walks its tokens in a grid-stride loop, reusing its shared coefficients and
// block sums per token; the forward coefficient kernel also walks several tokens per thread. f32
// with D = 8, the vector path. About 2 GB of host memory for the double references.
TEST_F(CudaDevice, StreamingKernelsGridStride) {
  Config config;
  config.n = 2;
  config.dim = 8;
  OperationCheck(config, kStrideTokens, DType::f32).all();
}

// sum_slices (pre_forward_partials) past kMaxStrideBlocks * kStrideThreads partials.
TEST_F(CudaDevice, SumSlicesGridStride) {
  Config config;
  config.n = 1;
  config.dim = 1;
  const int64_t T = kSliceSumTokens, N = projection_width(config);
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const reference::Params params = random_params(rng, config);
  const HostTensor x = HostTensor::from(DType::f32, {T, 1, 1}, random_normal(rng, T));
  const HostParams host_params(config, params);
  HostTensor partials(DType::f32, {T, N + 1});
  partials.poison();
  backend().pre_forward_partials(config, x.ref(), host_params.norm_weight.ref(),
                                 host_params.phi.ref(), partials.mut());
  // M = 1: P[t, c] = x[t] norm_weight phi[c], and the sum of squares x[t]^2 at c = N.
  const Vec xs = x.to_double();
  Vec want(static_cast<size_t>(T * (N + 1)));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < N; ++c) {
      want[t * (N + 1) + c] = xs[t] * params.norm_weight[0] * params.phi[c];
    }
    want[t * (N + 1) + N] = xs[t] * xs[t];
  }
  EXPECT_LE(relative_error(partials.to_double(), want), 1e-5) << "seed " << seed;
}

// weight_grad_finish past kMaxStrideBlocks * kStrideThreads rows of phi (M = D, n = 1, T = 2):
// about 0.7 GB on the device and 2 GB of host memory.
TEST_F(CudaDevice, WeightGradFinishGridStride) {
  Config config;
  config.n = 1;
  config.dim = kWeightFinishDim;
  OperationCheck(config, 2, DType::f32).pre_backward();
}

// The cases scripts/gpu_check.sh runs under compute-sanitizer (keep them small: the tools slow
// kernels down 10-100x). memcheck: every operation on the 16-byte vector path (D = 1024), both
// dtypes.
TEST_F(CudaDevice, SanitizerVectorPathD1024) {
  Config config;
  config.n = 4;
  config.dim = 1024;
  OperationCheck(config, 3, DType::f32).all();
  OperationCheck(config, 3, DType::bf16).all();
}

// racecheck: pre_backward, whose kernels share memory most (the projection, input- and
// weight-gradient tiles, dh_pre's and the term sums' block reductions); two token tiles.
TEST_F(CudaDevice, SanitizerPreBackward) {
  Config config;
  config.n = 4;
  config.dim = 1024;
  OperationCheck(config, 70, DType::f32).pre_backward();
}

}  // namespace
}  // namespace mhc::test
