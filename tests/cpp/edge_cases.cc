#include "edge_cases.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "backend.h"

namespace mhc::test {
namespace {

int64_t product(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t e : shape) count *= e;
  return count;
}

}  // namespace

// Room for the guards, the search for a 16-byte boundary (at most 7 elements) and the offset.
Placed::Placed(DType dtype, std::vector<int64_t> shape, int64_t offset, const Vec& values)
    : shape_(std::move(shape)),
      count_(product(shape_)),
      storage_(dtype, {count_ + 3 * kGuard + 8 + offset}) {
  storage_.poison();
  const int64_t element = size_of(dtype);
  const auto base = reinterpret_cast<uintptr_t>(storage_.data());
  int64_t first = kGuard;
  while ((base + static_cast<uintptr_t>(first * element)) % 16 != 0) ++first;
  start_ = first + offset;
  if (!values.empty()) {
    Vec all = storage_.to_double();
    std::copy(values.begin(), values.end(), all.begin() + start_);
    storage_.set(all);
  }
}

TensorRef Placed::ref() const {
  TensorRef view = storage_.ref();
  view.data = static_cast<const char*>(view.data) + start_ * size_of(view.dtype);
  view.rank = static_cast<int>(shape_.size());
  for (size_t axis = 0; axis < shape_.size(); ++axis) view.shape[axis] = shape_[axis];
  return view;
}

MutableTensorRef Placed::mut() {
  MutableTensorRef view = storage_.mut();
  view.data = static_cast<char*>(view.data) + start_ * size_of(view.dtype);
  view.rank = static_cast<int>(shape_.size());
  for (size_t axis = 0; axis < shape_.size(); ++axis) view.shape[axis] = shape_[axis];
  return view;
}

Vec Placed::values() const {
  const Vec all = storage_.to_double();
  return Vec(all.begin() + start_, all.begin() + start_ + count_);
}

bool Placed::guards_intact() const {
  const Vec all = storage_.to_double();
  for (int64_t k = 0; k < static_cast<int64_t>(all.size()); ++k) {
    if ((k < start_ || k >= start_ + count_) && !std::isnan(all[k])) return false;
  }
  return true;
}

OperationCheck::OperationCheck(const Config& config, int64_t T, DType dtype, int64_t in_offset,
                               int64_t out_offset)
    : config_(config),
      T_(T),
      dtype_(dtype),
      in_offset_(in_offset),
      out_offset_(out_offset),
      seed_(fresh_seed()),
      rng_(seed_),
      params_(random_params(rng_, config)) {}

std::string OperationCheck::where() const {
  return describe(config_, T_, dtype_) + ", input offset " + std::to_string(in_offset_) +
         ", output offset " + std::to_string(out_offset_) + ", backend " + backend().name +
         ", seed " + std::to_string(seed_);
}

Placed OperationCheck::input(DType dtype, std::vector<int64_t> shape) {
  const int64_t count = product(shape);
  return Placed(dtype, std::move(shape), in_offset_, random_normal(rng_, count));
}

Placed OperationCheck::output(DType dtype, std::vector<int64_t> shape) {
  return Placed(dtype, std::move(shape), out_offset_);
}

Vec OperationCheck::perturb(const Vec& values) { return perturb_f32(rng_, values); }

reference::Params OperationCheck::perturb(const reference::Params& p) {
  return perturb_f32(rng_, p);
}

void OperationCheck::check(const std::string& name, const Placed& got, DType dtype, const Vec& want,
                           const std::function<Vec()>& perturbed) {
  EXPECT_TRUE(got.guards_intact()) << name << ": written outside its view (" << where() << ")";
  expect_matches(name, dtype, got.values(), want, perturbed, where());
}

void OperationCheck::check(const std::string& name, const HostTensor& got, const Vec& want,
                           const std::function<Vec()>& perturbed) {
  expect_matches(name, got.dtype(), got.to_double(), want, perturbed, where());
}

void OperationCheck::pre_forward() {
  const int64_t T = T_, n = config_.n, D = config_.dim;
  const Placed x = input(dtype_, {T, n, D});
  const HostParams params(config_, params_);
  Placed layer_in = output(dtype_, {T, D}), h_pre = output(DType::f32, {T, n}),
         h_post = output(DType::f32, {T, n}), h_res = output(DType::f32, {T, n, n});
  backend().pre_forward(config_, x.ref(), params.view(),
                        PreForwardOutputs{layer_in.mut(), h_pre.mut(), h_post.mut(), h_res.mut()});
  const reference::PreForward want = reference::pre_forward(config_, x.values(), params_);
  auto moved = [&] {
    return reference::pre_forward(config_, perturb(x.values()), perturb(params_));
  };
  check("pre_forward layer_in", layer_in, dtype_, want.layer_in, [&] { return moved().layer_in; });
  check("pre_forward h_pre", h_pre, DType::f32, want.h_pre, [&] { return moved().h_pre; });
  check("pre_forward h_post", h_post, DType::f32, want.h_post, [&] { return moved().h_post; });
  check("pre_forward h_res", h_res, DType::f32, want.h_res, [&] { return moved().h_res; });
}

void OperationCheck::post_forward() {
  const int64_t T = T_, n = config_.n, D = config_.dim;
  const Placed x = input(dtype_, {T, n, D}), layer_out = input(dtype_, {T, D}),
               h_post = input(DType::f32, {T, n}), h_res = input(DType::f32, {T, n, n});
  Placed out = output(dtype_, {T, n, D});
  backend().post_forward(config_, x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(), out.mut());
  check("post_forward out", out, dtype_,
        reference::post_forward(config_, x.values(), layer_out.values(), h_post.values(),
                                h_res.values()),
        [&] {
          return reference::post_forward(config_, perturb(x.values()), perturb(layer_out.values()),
                                         perturb(h_post.values()), perturb(h_res.values()));
        });
}

void OperationCheck::post_backward() {
  const int64_t T = T_, n = config_.n, D = config_.dim;
  const Placed g = input(dtype_, {T, n, D}), x = input(dtype_, {T, n, D}),
               layer_out = input(dtype_, {T, D}), h_post = input(DType::f32, {T, n}),
               h_res = input(DType::f32, {T, n, n});
  Placed dx_partial = output(dtype_, {T, n, D}), dlayer_out = output(dtype_, {T, D}),
         dh_post = output(DType::f32, {T, n}), dh_res = output(DType::f32, {T, n, n});
  backend().post_backward(
      config_, g.ref(), x.ref(), layer_out.ref(), h_post.ref(), h_res.ref(),
      PostBackwardOutputs{dx_partial.mut(), dlayer_out.mut(), dh_post.mut(), dh_res.mut()});
  const reference::PostBackward want = reference::post_backward(
      config_, g.values(), x.values(), layer_out.values(), h_post.values(), h_res.values());
  auto moved = [&] {
    return reference::post_backward(config_, perturb(g.values()), perturb(x.values()),
                                    perturb(layer_out.values()), perturb(h_post.values()),
                                    perturb(h_res.values()));
  };
  check("post_backward dx_partial", dx_partial, dtype_, want.dx_partial,
        [&] { return moved().dx_partial; });
  check("post_backward dlayer_out", dlayer_out, dtype_, want.dlayer_out,
        [&] { return moved().dlayer_out; });
  check("post_backward dh_post", dh_post, DType::f32, want.dh_post,
        [&] { return moved().dh_post; });
  check("post_backward dh_res", dh_res, DType::f32, want.dh_res, [&] { return moved().dh_res; });
}

void OperationCheck::pre_backward() {
  const int64_t T = T_, n = config_.n, D = config_.dim;
  const Placed dlayer_in = input(dtype_, {T, D}), dx_partial = input(dtype_, {T, n, D}),
               dh_post = input(DType::f32, {T, n}), dh_res = input(DType::f32, {T, n, n}),
               x = input(dtype_, {T, n, D});
  const HostParams params(config_, params_);
  Placed dx = output(dtype_, {T, n, D});
  HostGrads grads(config_);
  grads.poison();
  backend().pre_backward(config_, dlayer_in.ref(), dx_partial.ref(), dh_post.ref(), dh_res.ref(),
                         x.ref(), params.view(), dx.mut(), grads.view());
  const reference::PreBackward want =
      reference::pre_backward(config_, dlayer_in.values(), dx_partial.values(), dh_post.values(),
                              dh_res.values(), x.values(), params_);
  auto moved = [&] {
    return reference::pre_backward(config_, perturb(dlayer_in.values()),
                                   perturb(dx_partial.values()), perturb(dh_post.values()),
                                   perturb(dh_res.values()), perturb(x.values()), perturb(params_));
  };
  check("pre_backward dx", dx, dtype_, want.dx, [&] { return moved().dx; });
  check("pre_backward dnorm_weight", grads.norm_weight, want.grads.norm_weight,
        [&] { return moved().grads.norm_weight; });
  check("pre_backward dphi", grads.phi, want.grads.phi, [&] { return moved().grads.phi; });
  check("pre_backward dbias", grads.bias, want.grads.bias, [&] { return moved().grads.bias; });
  check("pre_backward dalpha", grads.alpha, want.grads.alpha, [&] { return moved().grads.alpha; });
}

}  // namespace mhc::test
