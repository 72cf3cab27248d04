// Edge cases of the four operations beside kernels_test.cc's sweep, run against whichever backend
// the binary holds (mhc_tests: CPU; mhc_cuda_tests: CUDA), so the CPU checks the same shapes:
// - n from 9 to 16: on CUDA the streaming kernels' 16-stream bound (scalar path only);
// - more tokens than the CUDA coefficient kernels start threads for (each walks several tokens);
// - views one element past a 16-byte boundary with D a multiple of 8: on CUDA the fallback from
//   the 16-byte vector path (the CUDA test backend keeps a host view's misalignment on the
//   device), with guards around every output that must stay untouched.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "backend.h"
#include "edge_cases.h"

namespace mhc::test {
namespace {

void skip_without_device() {
  // backend().available() throws instead when MHC_REQUIRE_CUDA=1 (backend_cuda.cc).
  if (!backend().available()) GTEST_SKIP() << "no device for the " << backend().name << " backend";
}

// The placement the misaligned cases rely on: offset 1 is one element past a 16-byte boundary,
// and the guards around a view start as NaN.
TEST(Placed, OffsetViewsAreMisaligned) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (int64_t offset : {0, 1}) {
      Placed p(dtype, {3, 5}, offset, Vec(15, 1.0));
      const auto address = reinterpret_cast<uintptr_t>(p.ref().data);
      EXPECT_EQ(address % 16, static_cast<uintptr_t>(offset * size_of(dtype)));
      EXPECT_TRUE(p.guards_intact());
      EXPECT_EQ(p.values(), Vec(15, 1.0));
    }
  }
}

struct Shape {
  int64_t n, D, T;
  DType dtype;
};

std::string shape_name(const testing::TestParamInfo<Shape>& info) {
  const Shape& s = info.param;
  return "n" + std::to_string(s.n) + "_D" + std::to_string(s.D) + "_T" + std::to_string(s.T) + "_" +
         to_string(s.dtype);
}

// n from 9 to 16, Sinkhorn (permutations stop at n = 6); D = 8 would take the vector path at
// n <= 8; T = 70 spans two 64-token tiles of the CUDA projection.
class ManyStreams : public testing::TestWithParam<Shape> {
 protected:
  void SetUp() override { skip_without_device(); }
};

TEST_P(ManyStreams, FourOperations) {
  const Shape& s = GetParam();
  Config config;
  config.n = s.n;
  config.dim = s.D;
  OperationCheck(config, s.T, s.dtype).all();
}

std::vector<Shape> many_streams() {
  std::vector<Shape> shapes;
  for (int64_t n : {9, 13, 16}) {
    for (int64_t D : {8, 130}) {
      for (int64_t T : {5, 70}) {
        for (DType dtype : {DType::f32, DType::bf16}) shapes.push_back({n, D, T, dtype});
      }
    }
  }
  return shapes;
}
INSTANTIATE_TEST_SUITE_P(Streams9To16, ManyStreams, testing::ValuesIn(many_streams()), shape_name);

// More tokens than the CUDA coefficient kernels have threads (edge_cases.h gives the counts).
TEST(CoefficientTokenLoop, SinkhornSixteenStreams) {
  skip_without_device();
  if (IsSkipped()) return;  // GTEST_SKIP in a helper returns only from the helper
  Config config;
  config.n = kLoopSinkhornStreams;
  config.dim = kLoopDim;
  OperationCheck(config, kLoopSinkhornForwardTokens, DType::f32).pre_forward();
  OperationCheck(config, kLoopSinkhornBackwardTokens, DType::f32).pre_backward();
}

TEST(CoefficientTokenLoop, PermutationsSixStreams) {
  skip_without_device();
  if (IsSkipped()) return;  // GTEST_SKIP in a helper returns only from the helper
  Config config;
  config.n = kLoopPermutationStreams;
  config.dim = kLoopDim;
  config.mix = Mix::permutations;
  OperationCheck check(config, kLoopPermutationTokens, DType::f32);
  check.pre_forward();
  check.pre_backward();
}

// Every activation view one element past a 16-byte boundary ("all"), or only the outputs
// ("outputs"): D a multiple of 8 would take the CUDA vector path if the pointers allowed it.
struct Misalignment {
  int64_t D;
  DType dtype;
  bool inputs_too;
};

class MisalignedViews : public testing::TestWithParam<Misalignment> {
 protected:
  void SetUp() override { skip_without_device(); }
};

TEST_P(MisalignedViews, FourOperations) {
  const Misalignment& m = GetParam();
  Config config;
  config.n = 4;
  config.dim = m.D;
  OperationCheck(config, 3, m.dtype, m.inputs_too ? 1 : 0, 1).all();
}

std::vector<Misalignment> misalignments() {
  std::vector<Misalignment> cases;
  for (int64_t D : {64, 1024}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      for (bool inputs_too : {true, false}) cases.push_back({D, dtype, inputs_too});
    }
  }
  return cases;
}
INSTANTIATE_TEST_SUITE_P(ByOneElement, MisalignedViews, testing::ValuesIn(misalignments()),
                         [](const testing::TestParamInfo<Misalignment>& info) {
                           const Misalignment& m = info.param;
                           return "D" + std::to_string(m.D) + "_" + to_string(m.dtype) +
                                  (m.inputs_too ? "_all" : "_outputs");
                         });

}  // namespace
}  // namespace mhc::test
