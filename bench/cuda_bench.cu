// Times the four CUDA operations with CUDA events next to a device-to-device copy, the limit the
// spec measures them against (spec: Minimum memory traffic). Prints a table; --json PATH writes
// the same numbers.
//
//   mhc_cuda_bench [--tokens 4096 65536] [--dims 4096 7168] [--streams 4] [--dtype bf16|f32]
//                  [--mix sinkhorn|permutations] [--repeats 20] [--json PATH]
//
// STATUS: compiled in CI; not yet run on a GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mhc/cuda.h"

namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

// Deterministic pseudo-random values in [-1, 1) (a hash of the index), written on the device so
// multi-GB inputs take no host time.
__global__ void fill_kernel(float* f32, __nv_bfloat16* bf16, int64_t count, uint32_t seed,
                            float scale, float offset) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float v = offset + scale * (static_cast<float>(h) * (2.0f / 4294967296.0f) - 1.0f);
    if (f32 != nullptr) f32[i] = v;
    if (bf16 != nullptr) bf16[i] = __float2bfloat16_rn(v);
  }
}

struct Buffer {
  void* data = nullptr;
  mhc::DType dtype = mhc::DType::f32;
  int64_t count = 0;
  Buffer(mhc::DType type, int64_t elements, uint32_t seed, float scale = 1.0f, float offset = 0.0f)
      : dtype(type), count(elements) {
    check(cudaMalloc(&data, std::max<int64_t>(1, count) * mhc::size_of(type)), "cudaMalloc");
    fill_kernel<<<1024, 256>>>(
        type == mhc::DType::f32 ? static_cast<float*>(data) : nullptr,
        type == mhc::DType::bf16 ? static_cast<__nv_bfloat16*>(data) : nullptr, count, seed, scale,
        offset);
    check(cudaGetLastError(), "fill");
  }
  ~Buffer() { cudaFree(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  mhc::TensorRef in(std::initializer_list<int64_t> shape) const {
    return mhc::TensorRef(data, dtype, shape);
  }
  mhc::MutableTensorRef out(std::initializer_list<int64_t> shape) const {
    return mhc::MutableTensorRef(data, dtype, shape);
  }
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// Median milliseconds of `body` on the default stream, by CUDA events, after 3 warm-up calls.
double time_ms(const std::function<void()>& body, int repeats) {
  for (int i = 0; i < 3; ++i) body();
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    check(cudaEventRecord(start), "record");
    body();
    check(cudaEventRecord(stop), "record");
    check(cudaEventSynchronize(stop), "synchronize");
    float ms = 0.0f;
    check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median(times);
}

struct Row {
  std::string op;
  int64_t T, D;
  double ms, bytes;
};

std::vector<int64_t> parse_list(int& i, int argc, char** argv) {
  std::vector<int64_t> values;
  while (i + 1 < argc && argv[i + 1][0] != '-') values.push_back(std::atoll(argv[++i]));
  return values;
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<int64_t> tokens = {4096, 65536}, dims = {4096, 7168};
  int64_t n = 4;
  int repeats = 20;
  mhc::DType dtype = mhc::DType::bf16;
  mhc::Mix mix = mhc::Mix::sinkhorn;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--tokens") {
      tokens = parse_list(i, argc, argv);
    } else if (arg == "--dims") {
      dims = parse_list(i, argc, argv);
    } else if (arg == "--streams" && i + 1 < argc) {
      n = std::atoll(argv[++i]);
    } else if (arg == "--repeats" && i + 1 < argc) {
      repeats = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--dtype" && i + 1 < argc) {
      dtype = std::string(argv[++i]) == "f32" ? mhc::DType::f32 : mhc::DType::bf16;
    } else if (arg == "--mix" && i + 1 < argc) {
      mix = std::string(argv[++i]) == "permutations" ? mhc::Mix::permutations : mhc::Mix::sinkhorn;
    } else if (arg == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      std::fprintf(stderr, "unknown argument %s (see the comment at the top of cuda_bench.cu)\n",
                   arg.c_str());
      return 2;
    }
  }
  if (!mhc::cuda::device_available()) {
    std::fprintf(stderr, "mhc_cuda_bench: no CUDA device\n");
    return 77;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "properties");
  const double copy_gbs = mhc::cuda::copy_bandwidth_gbs(int64_t{1} << 31, repeats);
  std::printf("%s, %d SMs: device-to-device copy %.0f GB/s (read + write, median of %d)\n",
              prop.name, prop.multiProcessorCount, copy_gbs, repeats);

  std::vector<Row> rows;
  const double e = static_cast<double>(mhc::size_of(dtype));
  for (int64_t D : dims) {
    for (int64_t T : tokens) {
      mhc::Config config;
      config.n = n;
      config.dim = D;
      config.mix = mix;
      const int64_t M = n * D, N = mhc::projection_width(config);
      Buffer x(dtype, T * M, 1), layer_out(dtype, T * D, 2), g(dtype, T * M, 3);
      Buffer dli(dtype, T * D, 4), dxp_in(dtype, T * M, 5);
      Buffer norm_weight(mhc::DType::f32, M, 6, 0.1f, 1.0f),
          phi(mhc::DType::f32, M * N, 7, 1.0f / 64.0f);
      Buffer alpha(mhc::DType::f32, 3, 8, 0.5f, 0.8f), bias(mhc::DType::f32, N, 9, 0.5f);
      Buffer layer_in(dtype, T * D, 0), h_pre(mhc::DType::f32, T * n, 0),
          h_post(mhc::DType::f32, T * n, 0), h_res(mhc::DType::f32, T * n * n, 0);
      Buffer out(dtype, T * M, 0), dx_partial(dtype, T * M, 0), dlayer_out(dtype, T * D, 0);
      Buffer dh_post(mhc::DType::f32, T * n, 10), dh_res(mhc::DType::f32, T * n * n, 11);
      Buffer dx(dtype, T * M, 0), dnw(mhc::DType::f32, M, 0), dphi(mhc::DType::f32, M * N, 0),
          dalpha(mhc::DType::f32, 3, 0), dbias(mhc::DType::f32, N, 0);
      const int64_t ws_bytes = std::max(mhc::cuda::pre_forward_workspace_bytes(config, T),
                                        mhc::cuda::pre_backward_workspace_bytes(config, T));
      void* ws = nullptr;
      check(cudaMalloc(&ws, std::max<int64_t>(ws_bytes, 256)), "cudaMalloc workspace");
      const mhc::cuda::Workspace workspace{ws, ws_bytes};
      const mhc::Params params{norm_weight.in({M}), phi.in({M, N}), alpha.in({3}), bias.in({N})};
      const mhc::ParamGrads grads{dnw.out({M}), dphi.out({M, N}), dalpha.out({3}), dbias.out({N})};

      auto pre_forward = [&] {
        mhc::cuda::pre_forward(
            config, x.in({T, n, D}), params,
            {layer_in.out({T, D}), h_pre.out({T, n}), h_post.out({T, n}), h_res.out({T, n, n})},
            workspace, nullptr);
      };
      auto post_forward = [&] {
        mhc::cuda::post_forward(config, x.in({T, n, D}), layer_out.in({T, D}), h_post.in({T, n}),
                                h_res.in({T, n, n}), out.out({T, n, D}), nullptr);
      };
      auto post_backward = [&] {
        mhc::cuda::post_backward(config, g.in({T, n, D}), x.in({T, n, D}), layer_out.in({T, D}),
                                 h_post.in({T, n}), h_res.in({T, n, n}),
                                 {dx_partial.out({T, n, D}), dlayer_out.out({T, D}),
                                  dh_post.out({T, n}), dh_res.out({T, n, n})},
                                 nullptr);
      };
      auto pre_backward = [&] {
        mhc::cuda::pre_backward(config, dli.in({T, D}), dxp_in.in({T, n, D}), dh_post.in({T, n}),
                                dh_res.in({T, n, n}), x.in({T, n, D}), params, dx.out({T, n, D}),
                                grads, workspace, nullptr);
      };
      pre_forward();  // the coefficients the post operations read
      const double Td = static_cast<double>(T), Dd = static_cast<double>(D),
                   nd = static_cast<double>(n);
      rows.push_back({"pre_forward", T, D, time_ms(pre_forward, repeats), (nd + 1) * Dd * e * Td});
      rows.push_back(
          {"post_forward", T, D, time_ms(post_forward, repeats), (2 * nd + 1) * Dd * e * Td});
      rows.push_back(
          {"post_backward", T, D, time_ms(post_backward, repeats), (3 * nd + 2) * Dd * e * Td});
      rows.push_back(
          {"pre_backward", T, D, time_ms(pre_backward, repeats), (3 * nd + 1) * Dd * e * Td});
      check(cudaDeviceSynchronize(), "the operations");
      cudaFree(ws);
    }
  }

  std::printf("\n%-14s %7s %6s %10s %9s %11s\n", "op", "T", "D", "median ms", "GB/s", "of copy bw");
  for (const Row& r : rows) {
    const double gbs = r.bytes / (r.ms * 1e-3) / 1e9;
    std::printf("%-14s %7lld %6lld %10.3f %9.0f %10.1f%%\n", r.op.c_str(),
                static_cast<long long>(r.T), static_cast<long long>(r.D), r.ms, gbs,
                100.0 * gbs / copy_gbs);
  }
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) throw std::runtime_error("cannot write " + json_path);
    std::fprintf(f, "{\"device\": \"%s\", \"copy_gbs\": %.3f, \"repeats\": %d, \"dtype\": \"%s\", ",
                 prop.name, copy_gbs, repeats, mhc::to_string(dtype));
    std::fprintf(f, "\"n\": %lld, \"rows\": [", static_cast<long long>(n));
    for (size_t k = 0; k < rows.size(); ++k) {
      const Row& r = rows[k];
      const double gbs = r.bytes / (r.ms * 1e-3) / 1e9;
      std::fprintf(f,
                   "%s{\"op\": \"%s\", \"tokens\": %lld, \"dim\": %lld, \"ms\": %.5f, "
                   "\"bytes\": %.0f, \"gbs\": %.2f, \"copy_fraction\": %.4f}",
                   k ? ", " : "", r.op.c_str(), static_cast<long long>(r.T),
                   static_cast<long long>(r.D), r.ms, r.bytes, gbs, gbs / copy_gbs);
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "mhc_cuda_bench: %s\n", error.what());
  return 1;
}
