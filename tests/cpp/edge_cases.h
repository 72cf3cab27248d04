// Edge-case checks of the four operations that any backend must pass (edge_test.cc, in mhc_tests
// and mhc_cuda_tests) and the CUDA-only large shapes built on them (cuda_test.cc): tensors placed
// a chosen number of elements past a 16-byte boundary inside poisoned guards, and a runner that
// checks every output of an operation against the float64 reference.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"

namespace mhc::test {

// Shapes chosen for the CUDA kernels' loops; cuda_test.cc (CudaCoverage) checks that they still
// reach them. More tokens than the coefficient kernels start threads for (coefficients.cu,
// slots_for: 64 MiB of scratch in all), so each thread walks several tokens:
//   Sinkhorn, n = 16:     14979 threads forward, 3692 backward (20 iterations)
//   permutations, n = 6:   5614 threads forward, 2280 backward
inline constexpr int64_t kLoopSinkhornStreams = 16;
inline constexpr int64_t kLoopSinkhornForwardTokens = 16384;
inline constexpr int64_t kLoopSinkhornBackwardTokens = 4096;
inline constexpr int64_t kLoopPermutationStreams = 6;
inline constexpr int64_t kLoopPermutationTokens = 6144;
inline constexpr int64_t kLoopDim = 2;

// A tensor stored `offset` elements past a 16-byte boundary inside a larger buffer whose other
// elements are NaN, so a view can be misaligned on purpose and a write outside it is seen.
class Placed {
 public:
  static constexpr int64_t kGuard = 8;  // NaN elements at least, on either side
  Placed(DType dtype, std::vector<int64_t> shape, int64_t offset, const Vec& values = {});

  TensorRef ref() const;
  MutableTensorRef mut();
  Vec values() const;          // the view's elements
  bool guards_intact() const;  // every element outside the view still NaN
  int64_t size() const { return count_; }

 private:
  std::vector<int64_t> shape_;
  int64_t count_;
  HostTensor storage_;
  int64_t start_ = 0;
};

// Runs operations of one shape on the backend under test and checks every output against the
// float64 reference by test_util.h's rule (expect_matches: f32 outputs 1e-5, bf16 outputs half an
// ulp, or kSpreadMultiple x the reference's spread under one-f32-unit perturbations where that is
// larger). Activation views are placed `in_offset` (inputs) and `out_offset` (outputs) elements
// past a 16-byte boundary; outputs start as NaN, their guards must stay NaN.
class OperationCheck {
 public:
  OperationCheck(const Config& config, int64_t T, DType dtype, int64_t in_offset = 0,
                 int64_t out_offset = 0);

  void pre_forward();
  void post_forward();
  void post_backward();
  void pre_backward();
  void all() {
    pre_forward();
    post_forward();
    post_backward();
    pre_backward();
  }

 private:
  Placed input(DType dtype, std::vector<int64_t> shape);
  Placed output(DType dtype, std::vector<int64_t> shape);
  Vec perturb(const Vec& values);
  reference::Params perturb(const reference::Params& p);
  // `perturbed`: the reference on inputs moved by one f32 unit (test_util.h, expect_matches).
  void check(const std::string& name, const Placed& got, DType dtype, const Vec& want,
             const std::function<Vec()>& perturbed);
  void check(const std::string& name, const HostTensor& got, const Vec& want,
             const std::function<Vec()>& perturbed);
  std::string where() const;

  Config config_;
  int64_t T_;
  DType dtype_;
  int64_t in_offset_, out_offset_;
  uint64_t seed_;
  std::mt19937_64 rng_;
  reference::Params params_;
};

}  // namespace mhc::test
