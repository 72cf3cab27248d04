// mhc/roofline.h: the two ceilings of the roofline model on this machine, measured the way the
// benchmarks use them (spec: Minimum memory traffic). An operation's time floor is the larger of
// (bytes it must move / copy bandwidth) and (FLOPs it must do / FMA peak).
#pragma once

#include <cstdint>

#include "mhc/export.h"

namespace mhc {

// Copy bandwidth in GB/s (1e9 bytes per second, read + write bytes counted): the median of
// `repeats` copies of a `bytes`-sized buffer split across `threads` threads (< 1: the library's
// thread count, see set_num_threads).
MHC_API double copy_bandwidth_gbs(int64_t bytes = int64_t{256} << 20, int threads = 0,
                                  int repeats = 5);

// Peak f32 FMA throughput in GFLOP/s (2 FLOPs per lane per FMA), from independent register-resident
// FMA chains at the widest vector width the CPU supports, on `threads` threads as above.
MHC_API double fma_peak_gflops(int threads = 0);

// The vector width fma_peak_gflops used: "avx512", "avx2" or "sse2".
MHC_API const char* widest_simd();

}  // namespace mhc
