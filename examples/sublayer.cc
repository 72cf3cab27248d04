// sublayer.cc: one mHC sublayer, forward and backward, with the public API (mhc/ops.h).
//
//   forward:  pre_forward -> F(layer_in) -> post_forward
//   backward: post_backward -> backward of F -> pre_backward
//
// F here is a toy branch, tanh, whose backward we write by hand, which is what a framework's
// custom VJP does with a real attention or MLP block. Sizes are tiny so the output is readable.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "mhc/ops.h"

namespace {

using Buffer = std::vector<float>;

Buffer random_buffer(std::mt19937& rng, int64_t count, float stddev) {
  std::normal_distribution<float> normal(0.0f, stddev);
  Buffer values(static_cast<size_t>(count));
  for (float& v : values) v = normal(rng);
  return values;
}

double norm(const Buffer& values) {
  double sum = 0.0;
  for (float v : values) sum += static_cast<double>(v) * v;
  return std::sqrt(sum);
}

}  // namespace

int main() {
  mhc::Config config;
  config.n = 4;
  config.dim = 64;
  config.mix = mhc::Mix::sinkhorn;
  const int64_t T = 8, n = config.n, D = config.dim;
  const int64_t M = mhc::flat_width(config);        // n*D
  const int64_t N = mhc::projection_width(config);  // 2n + n*n
  std::mt19937 rng(7);

  // Parameters. alpha of order 1 and a random bias (instead of the initial 0.01 and 0) so the
  // coefficients visibly depend on the input.
  Buffer norm_weight(static_cast<size_t>(M), 1.0f);
  Buffer phi = random_buffer(rng, M * N, 0.02f);
  Buffer alpha = {1.0f, 1.0f, 1.0f};
  Buffer bias = random_buffer(rng, N, 1.0f);
  const mhc::Params params{
      {norm_weight.data(), {M}}, {phi.data(), {M, N}}, {alpha.data(), {3}}, {bias.data(), {N}}};

  Buffer x = random_buffer(rng, T * n * D, 1.0f);  // the n residual streams of T tokens
  std::printf("x [T, n, D] = [%lld, %lld, %lld], phi [M, N] = [%lld, %lld]\n",
              static_cast<long long>(T), static_cast<long long>(n), static_cast<long long>(D),
              static_cast<long long>(M), static_cast<long long>(N));

  // ---- Forward ----
  // pre_forward: one pass over x gives what F reads and the three coefficient tensors.
  Buffer layer_in(T * D), h_pre(T * n), h_post(T * n), h_res(T * n * n);
  mhc::pre_forward(config, {x.data(), {T, n, D}}, params,
                   {{layer_in.data(), {T, D}},
                    {h_pre.data(), {T, n}},
                    {h_post.data(), {T, n}},
                    {h_res.data(), {T, n, n}}});

  // The branch F: layer_out = tanh(layer_in).
  Buffer layer_out(T * D);
  for (size_t i = 0; i < layer_out.size(); ++i) layer_out[i] = std::tanh(layer_in[i]);

  // post_forward: mix the streams through H_res and write F's output back through H_post.
  Buffer out(T * n * D);
  mhc::post_forward(config, {x.data(), {T, n, D}}, {layer_out.data(), {T, D}},
                    {h_post.data(), {T, n}}, {h_res.data(), {T, n, n}}, {out.data(), {T, n, D}});

  // H_res is doubly stochastic: Sinkhorn ends on a column step, so column sums are ~1 and every
  // output stream is a convex mix of the input streams.
  std::printf("\nH_res of token 0 (row i = input stream, column j = output stream):\n");
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) std::printf("  %8.5f", h_res[i * n + j]);
    std::printf("\n");
  }
  std::printf("column sums:\n");
  for (int64_t j = 0; j < n; ++j) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += h_res[i * n + j];
    std::printf("  %8.5f", sum);
  }
  std::printf("\n\n");

  // ---- Backward ----
  // A random cotangent dL/dout stands in for the rest of the network.
  Buffer g = random_buffer(rng, T * n * D, 1.0f);

  // post_backward: the part of dx that flows through H_res, and the gradients F and the
  // coefficients receive.
  Buffer dx_partial(T * n * D), dlayer_out(T * D), dh_post(T * n), dh_res(T * n * n);
  mhc::post_backward(config, {g.data(), {T, n, D}}, {x.data(), {T, n, D}},
                     {layer_out.data(), {T, D}}, {h_post.data(), {T, n}}, {h_res.data(), {T, n, n}},
                     {{dx_partial.data(), {T, n, D}},
                      {dlayer_out.data(), {T, D}},
                      {dh_post.data(), {T, n}},
                      {dh_res.data(), {T, n, n}}});

  // Backward of F by hand: d tanh(u)/du = 1 - tanh(u)^2, and tanh(u) is layer_out.
  Buffer dlayer_in(T * D);
  for (size_t i = 0; i < dlayer_in.size(); ++i) {
    dlayer_in[i] = dlayer_out[i] * (1.0f - layer_out[i] * layer_out[i]);
  }

  // pre_backward: recomputes the coefficients from x (nothing else was kept from the forward)
  // and finishes dx and the parameter gradients.
  Buffer dx(T * n * D), dnorm_weight(M), dphi(M * N), dalpha(3), dbias(N);
  mhc::pre_backward(config, {dlayer_in.data(), {T, D}}, {dx_partial.data(), {T, n, D}},
                    {dh_post.data(), {T, n}}, {dh_res.data(), {T, n, n}}, {x.data(), {T, n, D}},
                    params, {dx.data(), {T, n, D}},
                    {{dnorm_weight.data(), {M}},
                     {dphi.data(), {M, N}},
                     {dalpha.data(), {3}},
                     {dbias.data(), {N}}});

  std::printf("||x|| = %.4f  ||out|| = %.4f  ||dx|| = %.4f  ||dphi|| = %.4f\n", norm(x), norm(out),
              norm(dx), norm(dphi));
  std::printf("dalpha = {%.4f, %.4f, %.4f}\n\n", dalpha[0], dalpha[1], dalpha[2]);

  // ---- Errors ----
  // Every entry point checks shapes before touching memory and says which argument is wrong.
  try {
    Buffer short_layer_out((T - 1) * D);
    mhc::post_forward(config, {x.data(), {T, n, D}}, {short_layer_out.data(), {T - 1, D}},
                      {h_post.data(), {T, n}}, {h_res.data(), {T, n, n}}, {out.data(), {T, n, D}});
    std::printf("expected mhc::Error, got none\n");
    return 1;
  } catch (const mhc::Error& e) {
    std::printf("caught mhc::Error: %s\n", e.what());
  }
  return 0;
}
