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

// The comparison the header promises: copying 256 KiB (in cache) against 256 MiB (out of every
// cache) on one thread. In cache is usually several times faster; a tenth of the out-of-cache rate
// would mean the measurement itself is broken (a loop that does not copy, a wrong byte count).
TEST(Roofline, InCacheCopyIsNotSlowerThanOutOfCache) {
  const double in_cache = copy_bandwidth_gbs(int64_t{256} << 10, 1, 20);
  const double out_of_cache = copy_bandwidth_gbs(int64_t{256} << 20, 1, 3);
  EXPECT_TRUE(std::isfinite(in_cache) && std::isfinite(out_of_cache));
  EXPECT_GT(in_cache, 0.1 * out_of_cache)
      << "in cache " << in_cache << " GB/s, out of cache " << out_of_cache << " GB/s";
}

TEST(Roofline, TinyBuffersAndDefaultThreadsWork) {
  // A size below one page is raised to one page; threads < 1 means the library's count.
  EXPECT_GT(copy_bandwidth_gbs(1, 0, 1), 0.0);
  EXPECT_GT(fma_peak_gflops(0), 0.0);
}

}  // namespace
}  // namespace mhc
