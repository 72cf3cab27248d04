// Tensor views and the error type.
#include "mhc/tensor.h"

#include <string>

#include "mhc/error.h"

namespace mhc {

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
  }
  return "unknown";
}

int64_t size_of(DType dtype) { return dtype == DType::bf16 ? 2 : 4; }

namespace {
template <class View>
void fill_shape(View& view, std::initializer_list<int64_t> dims) {
  if (dims.size() > static_cast<size_t>(kMaxRank)) {
    throw Error("mhc::TensorRef", "dims",
                "expected at most " + std::to_string(kMaxRank) + " dimensions, got " +
                    std::to_string(dims.size()));
  }
  view.rank = static_cast<int>(dims.size());
  int axis = 0;
  for (int64_t d : dims) view.shape[axis++] = d;
}
}  // namespace

TensorRef::TensorRef(const void* data_, DType dtype_, std::initializer_list<int64_t> dims)
    : data(data_), dtype(dtype_) {
  fill_shape(*this, dims);
}

MutableTensorRef::MutableTensorRef(void* data_, DType dtype_, std::initializer_list<int64_t> dims)
    : data(data_), dtype(dtype_) {
  fill_shape(*this, dims);
}

MutableTensorRef::operator TensorRef() const {
  TensorRef view;
  view.data = data;
  view.dtype = dtype;
  view.rank = rank;
  for (int axis = 0; axis < kMaxRank; ++axis) view.shape[axis] = shape[axis];
  return view;
}

std::string TensorRef::shape_string() const {
  std::string text = "[";
  for (int axis = 0; axis < rank && axis < kMaxRank; ++axis) {
    if (axis > 0) text += ", ";
    text += std::to_string(shape[axis]);
  }
  return text + "]";
}

Error::Error(const std::string& op, const std::string& argument, const std::string& problem)
    : std::invalid_argument(op + ": " + argument + ": " + problem), op_(op), argument_(argument) {}

}  // namespace mhc
