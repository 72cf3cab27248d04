// Portable SIMD for the CPU inner loops: GCC/Clang vector extensions compiled once per
// instruction set with target_clones, the clone picked at load time (one build runs on any
// x86-64).
//
// GCC also builds an x86-64-v4 (AVX-512) clone. It has not run on AVX-512 hardware, since this
// project's machines are AVX2, so it is unverified. Clang 14 gets no v4 clone: with one, the
// fuzzer build ran AVX-512 instructions in the baseline code and died of SIGILL on this AVX2
// machine.
#pragma once

#include <cstdint>

#if defined(__clang__)
#define MHC_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MHC_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
// Helpers must be inlined into each clone to be compiled for its instruction set; a call to an
// out-of-line copy would run baseline SSE code.
#define MHC_INLINE inline __attribute__((always_inline))

namespace mhc::cpu::simd {

inline constexpr int64_t kLanes = 8;
// Eight f32 lanes as one value: one AVX register in the v3 and v4 clones, two SSE registers in
// the baseline one.
typedef float Lanes8 __attribute__((vector_size(32)));
typedef float Lanes4 __attribute__((vector_size(16)));
typedef double Wide4 __attribute__((vector_size(32)));
// The same lanes at any element-aligned address, for loads and stores straight from arrays (the
// accumulators then stay in registers; memcpy into arrays of vectors made GCC keep them on the
// stack).
typedef float UnalignedLanes8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef float UnalignedLanes4 __attribute__((vector_size(16), aligned(4), may_alias));
typedef double UnalignedWide4 __attribute__((vector_size(32), aligned(8), may_alias));

// Helpers take vectors by pointer: by value would change the ABI between the clones.
MHC_INLINE void load(Lanes8* v, const float* p) {
  *v = *reinterpret_cast<const UnalignedLanes8*>(p);
}
MHC_INLINE void store(float* p, const Lanes8* v) { *reinterpret_cast<UnalignedLanes8*>(p) = *v; }

// out[0:8] += v, widened to double, one half at a time (an 8-double vector goes through memory).
MHC_INLINE void add_wide(double* out, const Lanes8* v) {
  const Lanes4 low = __builtin_shufflevector(*v, *v, 0, 1, 2, 3);
  const Lanes4 high = __builtin_shufflevector(*v, *v, 4, 5, 6, 7);
  *reinterpret_cast<UnalignedWide4*>(out) += __builtin_convertvector(low, Wide4);
  *reinterpret_cast<UnalignedWide4*>(out + 4) += __builtin_convertvector(high, Wide4);
}

// acc += w * p[0:4], the four floats widened to double.
MHC_INLINE void add_weighted4(Wide4* acc, double w, const float* p) {
  *acc += w * __builtin_convertvector(*reinterpret_cast<const UnalignedLanes4*>(p), Wide4);
}

// p[0:4] = v rounded to f32.
MHC_INLINE void narrow4(const Wide4* v, float* p) {
  *reinterpret_cast<UnalignedLanes4*>(p) = __builtin_convertvector(*v, Lanes4);
}

}  // namespace mhc::cpu::simd
