// consumer.cc: an installed mhc, as a program built against it sees it. One sublayer forward and
// backward through the installed library, every output checked against the installed float64
// reference (mhc/reference.h) given the same inputs; the version of the headers, the library and
// the CMake package; mhc::Error thrown inside the library and caught here by type.
//
// Usage: mhc_consumer static|shared   (the library kind this build is expected to have linked)
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "mhc/ops.h"
#include "mhc/reference.h"
#include "mhc/version.h"

namespace {

using Buffer = std::vector<float>;
using Vec = mhc::reference::Vec;

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    ++failures;
  }
}

Buffer random_buffer(std::mt19937& rng, size_t count, float stddev) {
  std::normal_distribution<float> normal(0.0f, stddev);
  Buffer values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

Vec widen(const Buffer& values) { return Vec(values.begin(), values.end()); }

// The spec's bound for an f32 output: ||got - want|| / ||want|| <= 1e-5, written so NaN fails.
void expect_close(const char* op, const char* name, const Buffer& got, const Vec& want) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    diff += d * d;
    norm += want[i] * want[i];
  }
  const double error = std::sqrt(diff) / (norm > 0.0 ? std::sqrt(norm) : 1.0);
  std::printf("  %-13s %-12s relative error %.2e\n", op, name, error);
  check(got.size() == want.size() && error <= 1e-5,
        std::string(op) + " " + name + ": relative error " + std::to_string(error) + " > 1e-5");
}

}  // namespace

int main(int argc, char** argv) {
  // ---- What was linked ----
#if defined(MHC_STATIC)
  const char* kind = "static";
#else
  const char* kind = "shared";
#endif
  std::printf("mhc %s (headers %s, CMake package %s), %s library\n", mhc::version(),
              MHC_VERSION_STRING, MHC_PACKAGE_VERSION, kind);
  check(argc == 2 && std::strcmp(argv[1], kind) == 0,
        std::string("expected the ") + (argc == 2 ? argv[1] : "?") +
            " library, built against the " + kind + " one");
  check(std::strcmp(mhc::version(), MHC_VERSION_STRING) == 0,
        "mhc::version() differs from the headers' MHC_VERSION_STRING");
  check(std::strcmp(MHC_PACKAGE_VERSION, MHC_VERSION_STRING) == 0,
        "the CMake package's version differs from the headers' MHC_VERSION_STRING");

  // ---- One sublayer: T tokens, n streams of D features; F = tanh ----
  mhc::Config config;
  config.n = 4;
  config.dim = 40;
  const int64_t T = 6, n = config.n, D = config.dim;
  const int64_t M = mhc::flat_width(config), N = mhc::projection_width(config);
  const auto size = [](int64_t a, int64_t b = 1, int64_t c = 1) {
    return static_cast<size_t>(a * b * c);
  };
  std::mt19937 rng(2024);
  Buffer norm_weight = random_buffer(rng, size(M), 0.1f);
  for (float& w : norm_weight) w += 1.0f;
  Buffer phi = random_buffer(rng, size(M, N), 0.05f);
  Buffer alpha = {0.8f, -0.6f, 1.1f};
  Buffer bias = random_buffer(rng, size(N), 1.0f);
  Buffer x = random_buffer(rng, size(T, n, D), 1.0f);
  const mhc::Params params{
      {norm_weight.data(), {M}}, {phi.data(), {M, N}}, {alpha.data(), {3}}, {bias.data(), {N}}};
  const mhc::reference::Params ref_params{widen(norm_weight), widen(phi), widen(alpha),
                                          widen(bias)};

  // Forward: pre_forward -> F -> post_forward.
  Buffer layer_in(size(T, D)), h_pre(size(T, n)), h_post(size(T, n)), h_res(size(T, n, n));
  mhc::pre_forward(config, {x.data(), {T, n, D}}, params,
                   {{layer_in.data(), {T, D}},
                    {h_pre.data(), {T, n}},
                    {h_post.data(), {T, n}},
                    {h_res.data(), {T, n, n}}});
  const auto pre = mhc::reference::pre_forward(config, widen(x), ref_params);
  expect_close("pre_forward", "layer_in", layer_in, pre.layer_in);
  expect_close("pre_forward", "h_pre", h_pre, pre.h_pre);
  expect_close("pre_forward", "h_post", h_post, pre.h_post);
  expect_close("pre_forward", "h_res", h_res, pre.h_res);

  Buffer layer_out(size(T, D));
  for (size_t i = 0; i < layer_out.size(); ++i) layer_out[i] = std::tanh(layer_in[i]);
  Buffer out(size(T, n, D));
  mhc::post_forward(config, {x.data(), {T, n, D}}, {layer_out.data(), {T, D}},
                    {h_post.data(), {T, n}}, {h_res.data(), {T, n, n}}, {out.data(), {T, n, D}});
  expect_close("post_forward", "out", out,
               mhc::reference::post_forward(config, widen(x), widen(layer_out), widen(h_post),
                                            widen(h_res)));

  // Backward, from a random cotangent: post_backward -> back through F -> pre_backward.
  Buffer g = random_buffer(rng, size(T, n, D), 1.0f);
  Buffer dx_partial(size(T, n, D)), dlayer_out(size(T, D)), dh_post(size(T, n)),
      dh_res(size(T, n, n));
  mhc::post_backward(config, {g.data(), {T, n, D}}, {x.data(), {T, n, D}},
                     {layer_out.data(), {T, D}}, {h_post.data(), {T, n}}, {h_res.data(), {T, n, n}},
                     {{dx_partial.data(), {T, n, D}},
                      {dlayer_out.data(), {T, D}},
                      {dh_post.data(), {T, n}},
                      {dh_res.data(), {T, n, n}}});
  const auto post = mhc::reference::post_backward(config, widen(g), widen(x), widen(layer_out),
                                                  widen(h_post), widen(h_res));
  expect_close("post_backward", "dx_partial", dx_partial, post.dx_partial);
  expect_close("post_backward", "dlayer_out", dlayer_out, post.dlayer_out);
  expect_close("post_backward", "dh_post", dh_post, post.dh_post);
  expect_close("post_backward", "dh_res", dh_res, post.dh_res);

  Buffer dlayer_in(size(T, D));
  for (size_t i = 0; i < dlayer_in.size(); ++i) {
    dlayer_in[i] = dlayer_out[i] * (1.0f - layer_out[i] * layer_out[i]);
  }
  Buffer dx(size(T, n, D)), dnorm_weight(size(M)), dphi(size(M, N)), dalpha(3), dbias(size(N));
  mhc::pre_backward(config, {dlayer_in.data(), {T, D}}, {dx_partial.data(), {T, n, D}},
                    {dh_post.data(), {T, n}}, {dh_res.data(), {T, n, n}}, {x.data(), {T, n, D}},
                    params, {dx.data(), {T, n, D}},
                    {{dnorm_weight.data(), {M}},
                     {dphi.data(), {M, N}},
                     {dalpha.data(), {3}},
                     {dbias.data(), {N}}});
  const auto pre_back =
      mhc::reference::pre_backward(config, widen(dlayer_in), widen(dx_partial), widen(dh_post),
                                   widen(dh_res), widen(x), ref_params);
  expect_close("pre_backward", "dx", dx, pre_back.dx);
  expect_close("pre_backward", "dnorm_weight", dnorm_weight, pre_back.grads.norm_weight);
  expect_close("pre_backward", "dphi", dphi, pre_back.grads.phi);
  expect_close("pre_backward", "dalpha", dalpha, pre_back.grads.alpha);
  expect_close("pre_backward", "dbias", dbias, pre_back.grads.bias);

  // ---- DeepSeek-V4's head, forward and backward ----
  const Buffer head_fn = random_buffer(rng, size(n, M), 0.5f),
               head_base = random_buffer(rng, size(n), 1.0f);
  const Buffer head_scale{0.8f};
  const mhc::HeadParams head{
      {head_fn.data(), {n, M}}, {head_base.data(), {n}}, {head_scale.data(), {1}}};
  const mhc::reference::HeadParams ref_head{widen(head_fn), widen(head_base), widen(head_scale)};
  Buffer head_out(size(T, D)), gates(size(T, n));
  mhc::head_forward(config, {x.data(), {T, n, D}}, head, {head_out.data(), {T, D}},
                    {gates.data(), {T, n}});
  expect_close("head_forward", "out", head_out,
               mhc::reference::head_forward(config, widen(x), ref_head).out);
  Buffer head_dx(size(T, n, D)), dfn(size(n, M)), dbase(size(n)), dscale(1);
  mhc::head_backward(config, {dlayer_in.data(), {T, D}}, {x.data(), {T, n, D}}, head,
                     {head_dx.data(), {T, n, D}},
                     {{dfn.data(), {n, M}}, {dbase.data(), {n}}, {dscale.data(), {1}}});
  const auto head_back =
      mhc::reference::head_backward(config, widen(dlayer_in), widen(x), ref_head);
  expect_close("head_backward", "dx", head_dx, head_back.dx);
  expect_close("head_backward", "dfn", dfn, head_back.grads.fn);

  // ---- Errors: thrown in the library, caught here by type (needs mhc::Error's typeinfo) ----
  bool caught = false;
  try {
    mhc::post_forward(config, {x.data(), {T, n, D}}, {layer_out.data(), {T - 1, D}},
                      {h_post.data(), {T, n}}, {h_res.data(), {T, n, n}}, {out.data(), {T, n, D}});
  } catch (const mhc::Error& e) {
    caught = e.op() == "mhc::post_forward" && e.argument() == "layer_out";
    std::printf("  caught mhc::Error: %s\n", e.what());
  }
  check(caught, "a short layer_out did not throw mhc::Error naming mhc::post_forward, layer_out");

  if (failures > 0) {
    std::fprintf(stderr, "consumer (%s): %d check(s) failed\n", kind, failures);
    return 1;
  }
  std::printf("consumer (%s): ok\n", kind);
  return 0;
}
