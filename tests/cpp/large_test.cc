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

  // Each checked token against the float64 reference of its own x: coefficients (f32) and
  // layer_in (bf16) from pre_forward, and out from the reference's coefficients, with layer_out =
  // the layer_in the kernel wrote (an input of post_forward, exact in double).
  const int64_t boundary_token = (int64_t{1} << 31) / M;
  auto slice = [](const std::vector<float>& v, int64_t t, int64_t width) {
    return Vec(v.begin() + t * width, v.begin() + (t + 1) * width);
  };
  for (int64_t t : {int64_t{0}, boundary_token - 1, boundary_token, T - 1}) {
    const Vec xt = token_values(t);
    const reference::PreForward want = reference::pre_forward(config, xt, params);
    Vec got_layer_in(static_cast<size_t>(D)), got_out(static_cast<size_t>(M));
    for (int64_t d = 0; d < D; ++d) got_layer_in[d] = to_float(layer_in[t * D + d]);
    for (int64_t m = 0; m < M; ++m) got_out[m] = to_float(out[t * M + m]);
    EXPECT_TRUE(matches_reference(DType::f32, slice(h_pre, t, n), want.h_pre))
        << "h_pre, token " << t;
    EXPECT_TRUE(matches_reference(DType::f32, slice(h_post, t, n), want.h_post))
        << "h_post, token " << t;
    EXPECT_TRUE(matches_reference(DType::f32, slice(h_res, t, n * n), want.h_res))
        << "h_res, token " << t;
    EXPECT_TRUE(matches_reference(DType::bf16, got_layer_in, want.layer_in))
        << "layer_in, token " << t;
    const Vec want_out = reference::post_forward(config, xt, got_layer_in, want.h_post, want.h_res);
    EXPECT_TRUE(matches_reference(DType::bf16, got_out, want_out)) << "out, token " << t;
  }
}

}  // namespace
}  // namespace mhc::test
