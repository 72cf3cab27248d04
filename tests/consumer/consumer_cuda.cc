// consumer_cuda.cc: mhc::cuda from an installed mhc (find_package(mhc COMPONENTS cuda)). It links
// against the CUDA runtime; bad arguments throw mhc::Error before anything touches a device, so
// this runs on a machine without a GPU too.
#include <cstdio>
#include <vector>

#include "mhc/cuda.h"

int main() {
  mhc::Config config;
  config.dim = 8;
  const int64_t T = 2, n = config.n, D = config.dim;
  std::vector<float> x(T * n * D), layer_out((T - 1) * D), h_post(T * n), h_res(T * n * n),
      out(T * n * D);
  try {
    mhc::cuda::post_forward(config, {x.data(), {T, n, D}}, {layer_out.data(), {T - 1, D}},
                            {h_post.data(), {T, n}}, {h_res.data(), {T, n, n}},
                            {out.data(), {T, n, D}}, nullptr);
  } catch (const mhc::Error& e) {
    if (e.op() == "mhc::cuda::post_forward" && e.argument() == "layer_out") {
      std::printf("consumer (cuda): ok, caught %s; device available: %s\n", e.what(),
                  mhc::cuda::device_available() ? "yes" : "no");
      return 0;
    }
    std::fprintf(stderr, "FAIL: wrong mhc::Error: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "FAIL: a short layer_out did not throw mhc::Error\n");
  return 1;
}
