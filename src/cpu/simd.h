// Portable SIMD for the CPU inner loops: GCC/Clang vector extensions compiled once per
// instruction set with target_clones, the clone picked at load time (one build runs on any
// x86-64).
//
// GCC also builds an x86-64-v4 (AVX-512) clone; the test suite has run it on an AVX-512 machine
// (2026-12-01) as well as the v3 clone on AVX2 machines. Clang 14 gets no v4 clone: with one, the
// fuzzer build ran AVX-512 instructions in the baseline code and died of SIGILL on an AVX2
// machine. The projection's 16-lane kernels (projection.cc) are separate target("avx512f")
// functions picked at run time, which clang builds too.
#pragma once

#include <cstdint>

#include "mhc/tensor.h"

// ThreadSanitizer instruments the ifunc resolvers that target_clones creates, and the loader runs
// them before the sanitizer's runtime is up (the TSan test binary crashed at load): TSan builds
// get the baseline code only.
#if defined(__SANITIZE_THREAD__)
#define MHC_THREAD_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MHC_THREAD_SANITIZER 1
#endif
#endif

#if defined(MHC_THREAD_SANITIZER)
#define MHC_CLONES
#elif defined(__clang__)
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
// The same lanes at any element-aligned address, for loads and stores straight from arrays (the
// accumulators then stay in registers; memcpy into arrays of vectors made GCC keep them on the
// stack).
typedef float UnalignedLanes8 __attribute__((vector_size(32), aligned(4), may_alias));

// Sixteen f32 lanes, one AVX-512 register: only inside target("avx512f") functions (the
// projection's, projection.cc), which kernels templated over the vector type instantiate.
typedef float Lanes16 __attribute__((vector_size(64)));
typedef float UnalignedLanes16 __attribute__((vector_size(64), aligned(4), may_alias));

// Helpers take vectors by pointer: by value would change the ABI between the clones.
MHC_INLINE void load(Lanes8* v, const float* p) {
  *v = *reinterpret_cast<const UnalignedLanes8*>(p);
}
MHC_INLINE void store(float* p, const Lanes8* v) { *reinterpret_cast<UnalignedLanes8*>(p) = *v; }
MHC_INLINE void load(Lanes16* v, const float* p) {
  *v = *reinterpret_cast<const UnalignedLanes16*>(p);
}
MHC_INLINE void store(float* p, const Lanes16* v) { *reinterpret_cast<UnalignedLanes16*>(p) = *v; }

typedef uint16_t Bits8x16 __attribute__((vector_size(16)));
typedef uint32_t Bits8x32 __attribute__((vector_size(32)));
typedef uint16_t UnalignedBits8x16 __attribute__((vector_size(16), aligned(2), may_alias));

// Eight bf16 values at p as f32: each is the top half of its f32.
MHC_INLINE void load_bf16(Lanes8* v, const bf16* p) {
  const Bits8x16 bits = *reinterpret_cast<const UnalignedBits8x16*>(p);
  const Bits8x32 wide = __builtin_convertvector(bits, Bits8x32) << 16;
  *v = (Lanes8)wide;  // NOLINT(google-readability-casting): a vector cast reinterprets the bits
}

// Eight f32 lanes rounded to bf16 bits: nearest even, NaN kept NaN (as to_bf16 in mhc/tensor.h).
MHC_INLINE Bits8x16 bf16_bits(const Lanes8* v) {
  const Bits8x32 bits = (Bits8x32)*v;  // NOLINT(google-readability-casting): reinterprets the bits
  const Bits8x32 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const Bits8x32 quiet_nan = (bits >> 16) | 0x40u;
  const Bits8x32 result = (bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
  return __builtin_convertvector(result, Bits8x16);
}

MHC_INLINE void store_bf16(bf16* p, const Lanes8* v) {
  *reinterpret_cast<UnalignedBits8x16*>(p) = bf16_bits(v);
}

// Eight activations of either dtype as f32, and back.
MHC_INLINE void load_any(Lanes8* v, const float* p) { load(v, p); }
MHC_INLINE void load_any(Lanes8* v, const bf16* p) { load_bf16(v, p); }
MHC_INLINE void store_any(float* p, const Lanes8* v) { store(p, v); }
MHC_INLINE void store_any(bf16* p, const Lanes8* v) { store_bf16(p, v); }

// Rows r[0..8) of 8 floats transposed in place: r[c][i] becomes the old r[i][c].
MHC_INLINE void transpose8(Lanes8* r) {
  Lanes8 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = __builtin_shufflevector(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    u[i + 1] = __builtin_shufflevector(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    u[i + 2] = __builtin_shufflevector(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
    u[i + 3] = __builtin_shufflevector(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = __builtin_shufflevector(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[i + 4] = __builtin_shufflevector(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

// Eight f32 lanes widened to double: one AVX-512 register in the v4 clone, two AVX ones in v3.
// Reductions whose signed terms can cancel accumulate in these lanes.
typedef double Wide8 __attribute__((vector_size(64)));

MHC_INLINE void widen(const Lanes8* v, Wide8* out) { *out = __builtin_convertvector(*v, Wide8); }
typedef double UnalignedWide8 __attribute__((vector_size(64), aligned(8), may_alias));
MHC_INLINE void load(Wide8* v, const double* p) {
  *v = *reinterpret_cast<const UnalignedWide8*>(p);
}

// The one fixed-order sum of eight double lanes that every reduction uses, so a result depends on
// the length only, never on the blocking or the SIMD level:
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
MHC_INLINE double sum8(const Wide8* v) {
  const Wide8& w = *v;
  const double s0 = w[0] + w[4], s1 = w[1] + w[5], s2 = w[2] + w[6], s3 = w[3] + w[7];
  return (s0 + s2) + (s1 + s3);
}

}  // namespace mhc::cpu::simd
