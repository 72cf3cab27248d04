// mhc/tensor.h: element types and the non-owning tensor views the operations take.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>

#include "mhc/export.h"

namespace mhc {

enum class DType { f32, bf16 };

MHC_API const char* to_string(DType dtype);
MHC_API int64_t size_of(DType dtype);

// bfloat16 storage: the top 16 bits of an IEEE float32.
struct bf16 {
  uint16_t bits = 0;
};

inline float to_float(bf16 value) {
  uint32_t word = static_cast<uint32_t>(value.bits) << 16;
  float result;
  std::memcpy(&result, &word, sizeof(result));
  return result;
}

// Round to nearest even; NaN stays NaN (quieted) instead of rounding into infinity.
inline bf16 to_bf16(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  if ((word & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((word >> 16) | 0x40u)};
  word += 0x7fffu + ((word >> 16) & 1u);
  return bf16{static_cast<uint16_t>(word >> 16)};
}

inline constexpr int kMaxRank = 4;

// A dense, row-major view of memory the caller owns. Shapes are checked by every operation
// against the config, so a view always says how big the caller believes its buffer is.
struct TensorRef {
  const void* data = nullptr;
  DType dtype = DType::f32;
  int rank = 0;
  int64_t shape[kMaxRank] = {0, 0, 0, 0};

  TensorRef() = default;
  MHC_API TensorRef(const void* data, DType dtype, std::initializer_list<int64_t> dims);
  TensorRef(const float* data, std::initializer_list<int64_t> dims)
      : TensorRef(data, DType::f32, dims) {}
  TensorRef(const bf16* data, std::initializer_list<int64_t> dims)
      : TensorRef(data, DType::bf16, dims) {}

  int64_t dim(int axis) const { return shape[axis]; }
  MHC_API std::string shape_string() const;  // "[T, n, D]" with the numbers filled in
};

// The same view over memory an operation writes.
struct MutableTensorRef {
  void* data = nullptr;
  DType dtype = DType::f32;
  int rank = 0;
  int64_t shape[kMaxRank] = {0, 0, 0, 0};

  MutableTensorRef() = default;
  MHC_API MutableTensorRef(void* data, DType dtype, std::initializer_list<int64_t> dims);
  MutableTensorRef(float* data, std::initializer_list<int64_t> dims)
      : MutableTensorRef(data, DType::f32, dims) {}
  MutableTensorRef(bf16* data, std::initializer_list<int64_t> dims)
      : MutableTensorRef(data, DType::bf16, dims) {}

  MHC_API operator TensorRef() const;  // NOLINT(google-explicit-constructor): writable is readable
  int64_t dim(int axis) const { return shape[axis]; }
};

}  // namespace mhc
