// Argument checks shared by every backend's entry points.
#include "validate.h"

#include <cstddef>

#include "mhc/error.h"

namespace mhc::detail {

namespace {
std::string shape_text(const std::vector<int64_t>& dims) {
  std::string text = "[";
  for (size_t axis = 0; axis < dims.size(); ++axis) {
    if (axis > 0) text += ", ";
    text += std::to_string(dims[axis]);
  }
  return text + "]";
}
}  // namespace

ArgumentChecker::ArgumentChecker(const char* op, const Config& config)
    : op_(op), tensor_parallel_(config.tensor_parallel) {
  validate(config, op);
  dims_.n = config.n;
  dims_.D = local_dim(config);
  dims_.M = config.n * dims_.D;
  dims_.M_full = flat_width(config);
  dims_.R = residual_logits(config);
  dims_.N = projection_width(config);
}

void ArgumentChecker::tokens(const char* name, const TensorRef& view) {
  if (view.rank != 3 || view.shape[1] != dims_.n || view.shape[2] != dims_.D || view.shape[0] < 0) {
    throw Error(op_, name,
                "expected shape [T, " + std::to_string(dims_.n) + ", " + std::to_string(dims_.D) +
                    "] with T >= 0 (n and D / tensor_parallel from the config), got " +
                    view.shape_string());
  }
  if (view.dtype != DType::f32 && view.dtype != DType::bf16) {
    throw Error(op_, name, "expected dtype f32 or bf16, got an unknown dtype value");
  }
  dims_.T = view.shape[0];
  check_view(name, view, {dims_.T, dims_.n, dims_.D}, view.dtype, false);
}

void ArgumentChecker::tensor(const char* name, const TensorRef& view,
                             std::initializer_list<int64_t> expected, DType dtype) {
  check_view(name, view, std::vector<int64_t>(expected), dtype, false);
}

void ArgumentChecker::output(const char* name, const MutableTensorRef& view,
                             std::initializer_list<int64_t> expected, DType dtype) {
  check_view(name, view, std::vector<int64_t>(expected), dtype, true);
}

void ArgumentChecker::whole_dim(const char* split_ops) {
  if (tensor_parallel_ != 1) {
    throw Error(
        op_, "config.tensor_parallel",
        "expected 1: this fused operation needs all of D; with D split across devices use " +
            std::string(split_ops) + ", got " + std::to_string(tensor_parallel_));
  }
}

void ArgumentChecker::params(const Params& params) {
  tensor("params.norm_weight", params.norm_weight, {dims_.M}, DType::f32);
  tensor("params.phi", params.phi, {dims_.M, dims_.N}, DType::f32);
  tensor("params.alpha", params.alpha, {3}, DType::f32);
  tensor("params.bias", params.bias, {dims_.N}, DType::f32);
}

void ArgumentChecker::grads(const ParamGrads& grads) {
  output("grads.norm_weight", grads.norm_weight, {dims_.M}, DType::f32);
  output("grads.phi", grads.phi, {dims_.M, dims_.N}, DType::f32);
  output("grads.alpha", grads.alpha, {3}, DType::f32);
  output("grads.bias", grads.bias, {dims_.N}, DType::f32);
}

void ArgumentChecker::check_view(const char* name, const TensorRef& view,
                                 const std::vector<int64_t>& expected, DType dtype, bool written) {
  bool same_shape = view.rank == static_cast<int>(expected.size());
  for (size_t axis = 0; same_shape && axis < expected.size(); ++axis) {
    same_shape = view.shape[axis] == expected[axis];
  }
  if (!same_shape) {
    throw Error(op_, name,
                "expected shape " + shape_text(expected) + ", got " + view.shape_string());
  }
  if (view.dtype != dtype) {
    const bool is_unknown = view.dtype != DType::f32 && view.dtype != DType::bf16;
    throw Error(op_, name,
                std::string("expected dtype ") + to_string(dtype) + ", got " +
                    (is_unknown ? "an unknown dtype value" : to_string(view.dtype)));
  }
  // The byte size must be representable: a shape that overflows is a caller bug, not a size.
  int64_t bytes = size_of(dtype);
  for (int64_t extent : expected) {
    if (__builtin_mul_overflow(bytes, extent, &bytes) || bytes > PTRDIFF_MAX) {
      throw Error(op_, name,
                  "shape " + shape_text(expected) + " of " + to_string(dtype) +
                      " overflows the addressable byte size");
    }
  }
  if (bytes == 0) return;  // empty tensors may have null data and overlap nothing
  if (view.data == nullptr) {
    throw Error(op_, name, "expected non-null data for shape " + shape_text(expected));
  }
  const auto begin = reinterpret_cast<uintptr_t>(view.data);
  if (begin > UINTPTR_MAX - static_cast<uintptr_t>(bytes)) {
    throw Error(op_, name,
                "buffer of " + std::to_string(bytes) + " bytes wraps around the address space");
  }
  spans_.push_back(Span{name, begin, begin + static_cast<uintptr_t>(bytes), written});
}

void ArgumentChecker::finish() const {
  for (size_t a = 0; a < spans_.size(); ++a) {
    for (size_t b = 0; b < spans_.size(); ++b) {
      if (a == b || !spans_[a].written || (spans_[b].written && b < a)) continue;
      const bool overlap = spans_[a].begin < spans_[b].end && spans_[b].begin < spans_[a].end;
      if (overlap) {
        throw Error(op_, spans_[a].name,
                    "output memory overlaps " + spans_[b].name +
                        "; outputs must not alias any other argument");
      }
    }
  }
}

}  // namespace mhc::detail
