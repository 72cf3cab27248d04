// libFuzzer target over the public C++ API. The input bytes choose an operation, a config
// (n, D, T, mix, iters, eps values, including invalid ones), dtypes, which pointers are null and
// shape mistakes; every buffer is allocated with exactly the bytes its view claims, so ASan
// catches any read or write past it. A call must either succeed or throw mhc::Error; anything
// else (a crash, another exception, a sanitizer report) is a finding.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "mhc/ops.h"

namespace {

// One exactly-sized heap buffer per view (no slack for an overrun to hide in).
struct Arena {
  std::vector<std::unique_ptr<uint8_t[]>> blocks;
  void* bytes(size_t count, FuzzedDataProvider& data) {
    if (count == 0) return nullptr;
    blocks.emplace_back(new uint8_t[count]);
    uint8_t* block = blocks.back().get();
    const std::vector<uint8_t> fill = data.ConsumeBytes<uint8_t>(std::min<size_t>(count, 64));
    for (size_t k = 0; k < count; ++k) block[k] = fill.empty() ? 0x3f : fill[k % fill.size()];
    return block;
  }
};

float pick_float(FuzzedDataProvider& data, float usual) {
  switch (data.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: return 0.0f;
    case 1: return -1e-3f;
    case 2: return std::numeric_limits<float>::quiet_NaN();
    case 3: return std::numeric_limits<float>::infinity();
    case 4: return data.ConsumeFloatingPointInRange<float>(-10.0f, 10.0f);
    default: return usual;
  }
}

struct Views {
  Arena arena;
  FuzzedDataProvider& data;

  // A view over a fresh exact buffer; sometimes null data, a wrong dtype or a perturbed shape.
  mhc::MutableTensorRef make(std::initializer_list<int64_t> shape, mhc::DType dtype) {
    mhc::MutableTensorRef view;
    view.dtype = dtype;
    view.rank = static_cast<int>(shape.size());
    int axis = 0;
    for (int64_t extent : shape) view.shape[axis++] = extent;
    const int mistake = data.ConsumeIntegralInRange<int>(0, 40);
    if (mistake == 0 && view.rank > 0) view.shape[view.rank - 1] += 1;
    if (mistake == 1 && view.rank > 0) view.shape[0] = -view.shape[0] - 1;
    if (mistake == 2) view.dtype = dtype == mhc::DType::f32 ? mhc::DType::bf16 : mhc::DType::f32;
    if (mistake == 3) view.dtype = static_cast<mhc::DType>(5);
    if (mistake == 4) view.rank = 0;
    // Size the buffer from the (possibly perturbed) shape the view claims, as a caller would.
    size_t count = 1;
    for (int k = 0; k < view.rank; ++k) {
      count = view.shape[k] < 0 ? 0 : count * static_cast<size_t>(view.shape[k]);
    }
    const size_t element = view.dtype == mhc::DType::bf16 ? 2 : 4;
    view.data = mistake == 5 ? nullptr : arena.bytes(count * element, data);
    return view;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  FuzzedDataProvider data(bytes, size);
  mhc::Config config;
  config.n = data.ConsumeIntegralInRange<int64_t>(0, 17);
  config.dim = data.ConsumeIntegralInRange<int64_t>(0, 70);
  config.mix = data.ConsumeBool() ? mhc::Mix::sinkhorn : mhc::Mix::permutations;
  config.sinkhorn_iters = data.ConsumeIntegralInRange<int64_t>(0, 24);
  config.sinkhorn_eps = pick_float(data, 1e-6f);
  config.rms_eps = pick_float(data, 1e-6f);
  config.pre_eps = pick_float(data, 1e-6f);
  config.post_scale = pick_float(data, 2.0f);
  const int64_t T = data.ConsumeIntegralInRange<int64_t>(0, 40);
  const mhc::DType x_dtype = data.ConsumeBool() ? mhc::DType::f32 : mhc::DType::bf16;
  const mhc::DType lo_dtype = data.ConsumeBool() ? mhc::DType::f32 : mhc::DType::bf16;
  const int op = data.ConsumeIntegralInRange<int>(0, 17);
  config.tensor_parallel = data.ConsumeIntegralInRange<int64_t>(0, 4);

  // Shapes as the config implies (R, N computed only when n is in range, as a caller would);
  // D is the slice's when tensor_parallel divides it.
  const int64_t n = config.n;
  const int64_t tp = config.tensor_parallel;
  const int64_t D = tp > 0 && config.dim % tp == 0 ? config.dim / tp : config.dim;
  const bool n_ok = n >= 1 && n <= (config.mix == mhc::Mix::permutations ? 6 : 16);
  const int64_t N = n_ok ? mhc::projection_width(config) : 1;
  const int64_t M = n * D;
  constexpr auto f32 = mhc::DType::f32;
  // V4.1's carried mix: [T, n], or [T, 0] for the one-hot; its cotangent usually alike.
  const int64_t carried_n = data.ConsumeBool() ? n : 0;
  const int64_t dcarried_n =
      data.ConsumeIntegralInRange<int>(0, 20) == 0 ? n - carried_n : carried_n;

  Views v{Arena{}, data};
  try {
    const mhc::Params params{v.make({M}, f32), v.make({M, N}, f32), v.make({3}, f32),
                             v.make({N}, f32)};
    const mhc::TensorRef x = v.make({T, n, D}, x_dtype);
    switch (op) {
      case 0:
        mhc::pre_forward(config, x, params,
                         {v.make({T, D}, x_dtype), v.make({T, n}, f32), v.make({T, n}, f32),
                          v.make({T, n, n}, f32)});
        break;
      case 1:
        mhc::post_forward(config, x, v.make({T, D}, lo_dtype), v.make({T, n}, f32),
                          v.make({T, n, n}, f32), v.make({T, n, D}, x_dtype));
        break;
      case 2:
        mhc::post_backward(config, v.make({T, n, D}, x_dtype), x, v.make({T, D}, lo_dtype),
                           v.make({T, n}, f32), v.make({T, n, n}, f32),
                           {v.make({T, n, D}, x_dtype), v.make({T, D}, lo_dtype),
                            v.make({T, n}, f32), v.make({T, n, n}, f32)});
        break;
      case 4:
        mhc::pre_forward_partials(config, x, params.norm_weight, params.phi,
                                  v.make({T, N + 1}, f32));
        break;
      case 5:
        mhc::pre_forward_finish(config, x, v.make({T, N + 1}, f32), params.alpha, params.bias,
                                {v.make({T, D}, x_dtype), v.make({T, n}, f32), v.make({T, n}, f32),
                                 v.make({T, n, n}, f32)});
        break;
      case 6:
        mhc::pre_backward_partials(config, v.make({T, D}, x_dtype), x, v.make({T, n}, f32));
        break;
      case 7:
        mhc::pre_backward_finish(
            config, v.make({T, D}, x_dtype), v.make({T, n, D}, x_dtype), v.make({T, n}, f32),
            v.make({T, n}, f32), v.make({T, n, n}, f32), x, v.make({T, N + 1}, f32), params,
            v.make({T, n, D}, x_dtype),
            {v.make({M}, f32), v.make({M, N}, f32), v.make({3}, f32), v.make({N}, f32)});
        break;
      case 8:
        mhc::boundary_forward(config, x, v.make({T, D}, lo_dtype), v.make({T, n}, f32),
                              v.make({T, n, n}, f32), params, v.make({T, n, D}, x_dtype),
                              {v.make({T, D}, x_dtype), v.make({T, n}, f32), v.make({T, n}, f32),
                               v.make({T, n, n}, f32)});
        break;
      case 9:
        mhc::boundary_backward(
            config, v.make({T, D}, x_dtype), v.make({T, n, D}, x_dtype), v.make({T, n}, f32),
            v.make({T, n, n}, f32), x, v.make({T, D}, lo_dtype), v.make({T, n}, f32),
            v.make({T, n, n}, f32), params,
            {v.make({T, n, D}, x_dtype), v.make({T, D}, lo_dtype), v.make({T, n}, f32),
             v.make({T, n, n}, f32)},
            {v.make({M}, f32), v.make({M, N}, f32), v.make({3}, f32), v.make({N}, f32)});
        break;
      case 10:
        mhc::head_forward(config, x, {v.make({n, M}, f32), v.make({n}, f32), v.make({1}, f32)},
                          v.make({T, D}, x_dtype), v.make({T, n}, f32));
        break;
      case 11:
        mhc::head_backward(config, v.make({T, D}, x_dtype), x,
                           {v.make({n, M}, f32), v.make({n}, f32), v.make({1}, f32)},
                           v.make({T, n, D}, x_dtype),
                           {v.make({n, M}, f32), v.make({n}, f32), v.make({1}, f32)});
        break;
      case 12:
        mhc::pre_forward_carried(config, x, v.make({T, carried_n}, f32), params,
                                 {v.make({T, D}, x_dtype), v.make({T, n}, f32), v.make({T, n}, f32),
                                  v.make({T, n, n}, f32)});
        break;
      case 13:
        mhc::pre_backward_carried(
            config, v.make({T, D}, x_dtype), v.make({T, n, D}, x_dtype), v.make({T, n}, f32),
            v.make({T, n}, f32), v.make({T, n, n}, f32), x, v.make({T, carried_n}, f32), params,
            v.make({T, n, D}, x_dtype), v.make({T, dcarried_n}, f32),
            {v.make({M}, f32), v.make({M, N}, f32), v.make({3}, f32), v.make({N}, f32)});
        break;
      case 14:
        mhc::collapse_forward(config, x, v.make({T, carried_n}, f32), v.make({T, D}, x_dtype));
        break;
      case 15:
        mhc::collapse_backward(config, v.make({T, D}, x_dtype), x, v.make({T, carried_n}, f32),
                               v.make({T, n, D}, x_dtype), v.make({T, dcarried_n}, f32));
        break;
      case 16:
        mhc::boundary_forward_carried(config, x, v.make({T, D}, lo_dtype), v.make({T, n}, f32),
                                      v.make({T, n}, f32), v.make({T, n, n}, f32), params,
                                      v.make({T, n, D}, x_dtype),
                                      {v.make({T, D}, x_dtype), v.make({T, n}, f32),
                                       v.make({T, n}, f32), v.make({T, n, n}, f32)});
        break;
      case 17:
        mhc::boundary_backward_carried(
            config, v.make({T, D}, x_dtype), v.make({T, n, D}, x_dtype), v.make({T, n}, f32),
            v.make({T, n}, f32), v.make({T, n, n}, f32), x, v.make({T, D}, lo_dtype),
            v.make({T, n}, f32), v.make({T, n}, f32), v.make({T, n, n}, f32), params,
            {v.make({T, n, D}, x_dtype), v.make({T, D}, lo_dtype), v.make({T, n}, f32),
             v.make({T, n, n}, f32)},
            v.make({T, n}, f32),
            {v.make({M}, f32), v.make({M, N}, f32), v.make({3}, f32), v.make({N}, f32)});
        break;
      default:  // 3
        mhc::pre_backward(
            config, v.make({T, D}, x_dtype), v.make({T, n, D}, x_dtype), v.make({T, n}, f32),
            v.make({T, n, n}, f32), x, params, v.make({T, n, D}, x_dtype),
            {v.make({M}, f32), v.make({M, N}, f32), v.make({3}, f32), v.make({N}, f32)});
        break;
    }
  } catch (const mhc::Error&) {
    // The documented rejection.
  }
  return 0;
}
