// One real large case: bf16 x with more than 2^31 elements (about 4.3 GB, plus as much for out),
// so any 32-bit index arithmetic would wrap. Checks tokens before, across and after the 2^31
// element boundary against the float64 reference. Its own binary, run serially by CTest.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "test_util.h"

namespace mhc::test {
namespace {

TEST(LargeShapes, BeyondTwoToThe31Elements) {
  Config config;
  config.n = 4;
  config.dim = 4096;
  const int64_t n = config.n, D = config.dim, M = n * D;
  const int64_t T = (int64_t{1} << 31) / M + 3;  // the last tokens lie past element 2^31
  ASSERT_GT(T * M, int64_t{1} << 31);
  std::mt19937_64 rng(fresh_seed());
  const reference::Params params = random_params(rng, config);
  HostParams host_params(config, params);

  // Token t holds a table of random values rotated by t: cheap to fill, different per token.
  const Vec table = round_to(DType::bf16, random_normal(rng, M));
  std::vector<bf16> table_bf16(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) table_bf16[m] = to_bf16(static_cast<float>(table[m]));
  auto token_values = [&](int64_t t) {
    Vec values(static_cast<size_t>(M));
    for (int64_t m = 0; m < M; ++m) values[m] = table[(m + t) % M];
    return values;
  };
  std::vector<bf16> x(static_cast<size_t>(T * M));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t shift = t % M;
    std::copy(table_bf16.begin() + shift, table_bf16.end(), x.begin() + t * M);
    std::copy(table_bf16.begin(), table_bf16.begin() + shift, x.begin() + t * M + (M - shift));
  }

  std::vector<bf16> layer_in(static_cast<size_t>(T * D));
  std::vector<float> h_pre(static_cast<size_t>(T * n)), h_post(static_cast<size_t>(T * n)),
      h_res(static_cast<size_t>(T * n * n));
  pre_forward(config, TensorRef(x.data(), {T, n, D}), host_params.view(),
              {MutableTensorRef(layer_in.data(), {T, D}), MutableTensorRef(h_pre.data(), {T, n}),
               MutableTensorRef(h_post.data(), {T, n}), MutableTensorRef(h_res.data(), {T, n, n})});
  // out reuses nothing: a second >4 GB buffer.
  std::vector<bf16> out(static_cast<size_t>(T * M));
  post_forward(config, TensorRef(x.data(), {T, n, D}), TensorRef(layer_in.data(), {T, D}),
               TensorRef(h_post.data(), {T, n}), TensorRef(h_res.data(), {T, n, n}),
               MutableTensorRef(out.data(), {T, n, D}));

  const int64_t boundary_token = (int64_t{1} << 31) / M;
  for (int64_t t : {int64_t{0}, boundary_token - 1, boundary_token, T - 1}) {
    const Vec xt = token_values(t);
    const reference::PreForward want = reference::pre_forward(config, xt, params);
    Vec got_layer_in(static_cast<size_t>(D)), got_out(static_cast<size_t>(M));
    for (int64_t d = 0; d < D; ++d) got_layer_in[d] = to_float(layer_in[t * D + d]);
    for (int64_t m = 0; m < M; ++m) got_out[m] = to_float(out[t * M + m]);
    EXPECT_LE(relative_error(got_layer_in, want.layer_in), 1e-2) << "layer_in, token " << t;
    const Vec want_out = reference::post_forward(
        config, xt, got_layer_in, Vec(h_post.begin() + t * n, h_post.begin() + (t + 1) * n),
        Vec(h_res.begin() + t * n * n, h_res.begin() + (t + 1) * n * n));
    EXPECT_LE(relative_error(got_out, want_out), 1e-2) << "out, token " << t;
  }
}

}  // namespace
}  // namespace mhc::test
