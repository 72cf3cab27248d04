// The roofline ceilings of mhc/roofline.h: a multi-threaded memcpy and register-resident FMA
// chains at the widest vector width, each on the library's thread pool.
#include "mhc/roofline.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "simd.h"
#include "thread_pool.h"

namespace mhc {

namespace {

using Clock = std::chrono::steady_clock;

int resolve_threads(int threads) {
  return threads >= 1 ? threads : cpu::ThreadPool::instance().threads();
}

// Seconds of one call of `job` on `threads` workers (each gets its index), the median of runs.
template <class Job>
double median_seconds(int threads, int repeats, const Job& job) {
  cpu::ThreadPool& pool = cpu::ThreadPool::instance();
  std::vector<double> times;
  for (int r = 0; r < std::max(repeats, 1); ++r) {
    const auto start = Clock::now();
    pool.parallel_for(threads, threads, [&](int64_t task, int) { job(task); });
    times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

// Independent FMA chains of vectors V, more than the FMA latency times the pipes, so throughput
// is the limit: one template, instantiated inside each instruction set's function (the chains are
// contracted into FMAs where the target has them; roofline.cc is compiled with
// -ffp-contract=fast). The inputs come through `seed` so the compiler cannot fold the loop.
template <class V, int kChains>
MHC_INLINE float fma_chains(int64_t iterations, float seed) {
  constexpr int kWidth = static_cast<int>(sizeof(V) / sizeof(float));
  V acc[kChains];
  for (int k = 0; k < kChains; ++k) acc[k] = V{} + (seed + static_cast<float>(k));
  const V scale = V{} + 0.999999f, shift = V{} + seed * 1e-7f;
  for (int64_t i = 0; i < iterations; ++i) {
    for (int k = 0; k < kChains; ++k) acc[k] = acc[k] * scale + shift;
  }
  V total = acc[0];
  for (int k = 1; k < kChains; ++k) total += acc[k];
  return total[0] + total[kWidth - 1];
}

typedef float Lanes4 __attribute__((vector_size(16)));

__attribute__((target("avx512f"))) float fma_chains_avx512(int64_t iterations, float seed) {
  return fma_chains<cpu::simd::Lanes16, 16>(iterations, seed);
}

__attribute__((target("avx2,fma"))) float fma_chains_avx2(int64_t iterations, float seed) {
  return fma_chains<cpu::simd::Lanes8, 12>(iterations, seed);
}

// Baseline x86-64 has no FMA: a multiply and an add per lane, counted as one FMA's two FLOPs.
float fma_chains_sse2(int64_t iterations, float seed) {
  return fma_chains<Lanes4, 12>(iterations, seed);
}

struct FmaKernel {
  const char* name;
  int lanes;
  int chains;
  float (*run)(int64_t, float);
};

FmaKernel widest_fma() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return {"avx512", 16, 16, fma_chains_avx512};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return {"avx2", 8, 12, fma_chains_avx2};
  }
  return {"sse2", 4, 12, fma_chains_sse2};
}

}  // namespace

double copy_bandwidth_gbs(int64_t bytes, int threads, int repeats) {
  threads = resolve_threads(threads);
  bytes = std::max<int64_t>(bytes, 4096);
  std::vector<char> source(static_cast<size_t>(bytes), 1), target(static_cast<size_t>(bytes), 0);
  const int64_t share = (bytes + threads - 1) / threads;
  auto copy = [&](int64_t part) {
    const int64_t begin = std::min(bytes, part * share), end = std::min(bytes, begin + share);
    std::memcpy(target.data() + begin, source.data() + begin, static_cast<size_t>(end - begin));
  };
  median_seconds(threads, 1, copy);  // fault the pages in before timing
  const double seconds = median_seconds(threads, repeats, copy);
  return 2.0 * static_cast<double>(bytes) / seconds / 1e9;
}

double fma_peak_gflops(int threads) {
  threads = resolve_threads(threads);
  const FmaKernel kernel = widest_fma();
  constexpr int64_t kIterations = int64_t{1} << 24;
  std::vector<float> sink(static_cast<size_t>(threads));
  auto chains = [&](int64_t part) {
    sink[static_cast<size_t>(part)] = kernel.run(kIterations, 1.0f + static_cast<float>(part));
  };
  const double seconds = median_seconds(threads, 3, chains);
  const double flops =
      2.0 * kernel.lanes * kernel.chains * static_cast<double>(kIterations) * threads;
  return flops / seconds / 1e9;
}

const char* widest_simd() { return widest_fma().name; }

}  // namespace mhc
