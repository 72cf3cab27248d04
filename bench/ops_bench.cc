// ops_bench.cc: Google Benchmark timings of the four mHC operations (mhc/ops.h) on the CPU, next
// to the machine's own memcpy bandwidth measured in the same run.
//
// Why: every operation is memory bound, so the useful number is not seconds but how close an op
// comes to the copy bandwidth. Each op reports the spec's minimum traffic ("Minimum memory
// traffic" in docs/math.md) as bytes processed and as a GB/s counter; the memcpy benchmarks (run
// first, with one thread and with mhc::num_threads() threads) give the limit, and every op
// reports fraction_of_copy = its GB/s / the multi-threaded memcpy GB/s.
//
// Cases: T = 4096 tokens, n = 4 streams, D in {1024, 4096}, activations f32 or bf16, Sinkhorn
// mixing, plus permutation mixing for pre_forward and pre_backward at D = 1024 f32. The
// coefficients/ rows time the per-token coefficient math alone (no activations).
// Inputs are random (fixed seed) with alpha = {1, 1, 1} and a random bias so that the
// coefficients are non-trivial; h_pre/h_post/h_res, dx_partial etc. come from running the
// sublayer once in setup. One case's buffers (at most ~1.6 GiB, at D = 4096 f32) are alive at a
// time: they are built when the first benchmark of a case runs and reused by its other ops and by
// the library's repeated calls of the same benchmark, then freed when the next case starts.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../src/cpu/coefficients.h"
#include "mhc/config.h"
#include "mhc/ops.h"
#include "mhc/roofline.h"
#include "mhc/tensor.h"

namespace {

constexpr int64_t kTokens = 4096;
constexpr int64_t kStreams = 4;
constexpr size_t kCopyBytes = size_t{256} << 20;  // 256 MiB source, 256 MiB destination

// Multi-threaded memcpy bandwidth of the latest (hence longest) memcpy run, the denominator of
// fraction_of_copy; 0 until that benchmark has run (e.g. when filtered out).
double g_copy_gbps = 0.0;

// The four operations, and the boundary between two sublayers fused (boundary_*) and as the two
// calls it replaces (two_calls_*: post_forward then pre_forward; pre_backward then
// post_backward). DeepSeek-V4.1's boundary (carried_boundary_*: the next pre-apply reads this
// sublayer's h_pre) and final collapse (spec: Single-pass schedule). DeepSeek-V4's head (head_*,
// spec: Head), in the roofline/ rows.
enum class Op {
  pre_forward,
  post_forward,
  post_backward,
  pre_backward,
  boundary_forward,
  two_calls_forward,
  boundary_backward,
  two_calls_backward,
  head_forward,
  head_backward,
  carried_boundary_forward,
  carried_boundary_backward,
  collapse_forward,
  collapse_backward
};

const char* op_name(Op op) {
  switch (op) {
    case Op::pre_forward: return "pre_forward";
    case Op::post_forward: return "post_forward";
    case Op::post_backward: return "post_backward";
    case Op::pre_backward: return "pre_backward";
    case Op::boundary_forward: return "boundary_forward";
    case Op::two_calls_forward: return "two_calls_forward";
    case Op::boundary_backward: return "boundary_backward";
    case Op::two_calls_backward: return "two_calls_backward";
    case Op::head_forward: return "head_forward";
    case Op::head_backward: return "head_backward";
    case Op::carried_boundary_forward: return "carried_boundary_forward";
    case Op::carried_boundary_backward: return "carried_boundary_backward";
    case Op::collapse_forward: return "collapse_forward";
    case Op::collapse_backward: return "collapse_backward";
  }
  return "?";
}

// Spec minimum traffic per token, in activation elements of D (multiply by D * e).
int64_t traffic_units(Op op, int64_t n) {
  switch (op) {
    case Op::pre_forward: return n + 1;
    case Op::post_forward: return 2 * n + 1;
    case Op::post_backward: return 3 * n + 2;
    case Op::pre_backward: return 3 * n + 1;
    // spec: Boundary
    case Op::boundary_forward: return 2 * n + 2;
    case Op::two_calls_forward: return (2 * n + 1) + (n + 1);
    case Op::boundary_backward: return 3 * n + 3;
    case Op::two_calls_backward: return (3 * n + 1) + (3 * n + 2);
    // spec: Head (read x, write out; backward: read x and dout, write dx)
    case Op::head_forward: return n + 1;
    case Op::head_backward: return 2 * n + 1;
    // spec: Single-pass schedule (the boundary's bytes; h_pre is 4n bytes a token more)
    case Op::carried_boundary_forward: return 2 * n + 2;
    case Op::carried_boundary_backward: return 3 * n + 3;
    case Op::collapse_forward: return n + 1;       // read x, write out
    case Op::collapse_backward: return 2 * n + 1;  // read x and dout, write dx
  }
  return 0;
}

// FLOPs per token from the spec's formulas, as python/mhc/bench.py's flop_count counts them: the
// projection (2 n D N, once forward, three times backward) and the per-element passes.
double flops_per_token(Op op, int64_t n, int64_t D, int64_t N) {
  const double projection = 2.0 * static_cast<double>(n * D * N);
  const double head_projection = 2.0 * static_cast<double>(n * D * n);
  const double nd = static_cast<double>(n * D);
  switch (op) {
    case Op::pre_forward: return projection + 2 * nd;
    case Op::post_forward: return 2 * nd * static_cast<double>(n + 1);
    case Op::post_backward: return 4 * nd + 4 * nd * static_cast<double>(n);
    case Op::pre_backward: return 3 * projection + 8 * nd;
    case Op::boundary_forward:
    case Op::two_calls_forward:
      return flops_per_token(Op::pre_forward, n, D, N) + flops_per_token(Op::post_forward, n, D, N);
    case Op::boundary_backward:
    case Op::two_calls_backward:
      return flops_per_token(Op::pre_backward, n, D, N) +
             flops_per_token(Op::post_backward, n, D, N);
    case Op::head_forward: return head_projection + 2 * nd;
    case Op::head_backward: return 3 * head_projection + 6 * nd;
    case Op::carried_boundary_forward: return flops_per_token(Op::boundary_forward, n, D, N);
    case Op::carried_boundary_backward: return flops_per_token(Op::boundary_backward, n, D, N);
    case Op::collapse_forward: return 2 * nd;   // the weighted sum
    case Op::collapse_backward: return 4 * nd;  // dx, and dcarried's dot products
  }
  return 0.0;
}

// The FMA peak of mhc/roofline.h (GFLOP/s, the library's threads), measured once when first asked.
double fma_peak() {
  static const double peak = mhc::fma_peak_gflops();
  return peak;
}

struct Case {
  mhc::DType dtype;
  int64_t dim;
  mhc::Mix mix;
  int64_t tokens = kTokens;
  bool operator==(const Case& o) const {
    return dtype == o.dtype && dim == o.dim && mix == o.mix && tokens == o.tokens;
  }
};

// "Normal-ish" values: the sum of four uniforms on [-0.5, 0.5), scaled to unit variance. Much
// cheaper than std::normal_distribution for the ~100M values a D = 4096 case needs.
class Noise {
 public:
  explicit Noise(uint32_t seed) : engine_(seed) {}
  float next() {
    const uint32_t a = static_cast<uint32_t>(engine_());
    const uint32_t b = static_cast<uint32_t>(engine_());
    const float sum = static_cast<float>(a & 0xffffu) + static_cast<float>(a >> 16) +
                      static_cast<float>(b & 0xffffu) + static_cast<float>(b >> 16);
    return (sum / 65536.0f - 2.0f) * 1.7320508f;  // var of 4 uniforms = 1/3
  }

 private:
  std::mt19937 engine_;
};

// An activation buffer of either dtype, zero-filled (so every page is touched) or random.
struct Activation {
  mhc::DType dtype;
  std::vector<float> f32;
  std::vector<mhc::bf16> bf16;

  Activation(mhc::DType type, int64_t count) : dtype(type) {
    if (dtype == mhc::DType::f32) {
      f32.assign(static_cast<size_t>(count), 0.0f);
    } else {
      bf16.assign(static_cast<size_t>(count), mhc::bf16{});
    }
  }
  void randomize(Noise& noise) {
    for (float& v : f32) v = noise.next();
    for (mhc::bf16& v : bf16) v = mhc::to_bf16(noise.next());
  }
  mhc::MutableTensorRef ref(std::initializer_list<int64_t> dims) {
    if (dtype == mhc::DType::f32) return mhc::MutableTensorRef(f32.data(), dims);
    return mhc::MutableTensorRef(bf16.data(), dims);
  }
};

// Everything one case needs for all four operations, built once.
struct Workspace {
  Case key;
  mhc::Config config;
  int64_t T, n, D, M, N;
  // Parameters and their gradients (f32).
  std::vector<float> norm_weight, phi, alpha, bias;
  std::vector<float> d_norm_weight, d_phi, d_alpha, d_bias;
  // Coefficients and their gradients (f32).
  std::vector<float> h_pre, h_post, h_res, dh_post, dh_res;
  // The boundary's: the next sublayer's coefficients, this sublayer's coefficient gradients.
  std::vector<float> next_h_pre, next_h_post, next_h_res, post_dh_post, post_dh_res;
  // The head's parameters (fn [n, M], base [n], scale [1]) and their gradients.
  std::vector<float> fn, base, scale, d_fn, d_base, d_scale;
  // V4.1: the cotangent of the carried mix (h_pre).
  std::vector<float> dcarried;
  // Activations in the case's dtype.
  Activation x, layer_in, layer_out, out, g, dx_partial, dlayer_out, dlayer_in, dx;

  explicit Workspace(const Case& c)
      : key(c),
        T(c.tokens),
        n(kStreams),
        D(c.dim),
        M(kStreams * c.dim),
        N(0),
        x(c.dtype, T * n * D),
        layer_in(c.dtype, T * D),
        layer_out(c.dtype, T * D),
        out(c.dtype, T * n * D),
        g(c.dtype, T * n * D),
        dx_partial(c.dtype, T * n * D),
        dlayer_out(c.dtype, T * D),
        dlayer_in(c.dtype, T * D),
        dx(c.dtype, T * n * D) {
    config.n = n;
    config.dim = D;
    config.mix = c.mix;
    N = mhc::projection_width(config);

    Noise noise(12345);
    // Spec init (norm_weight ones), but alpha of order 1 and a random bias so the gates and the
    // mix are far from constant. phi ~ N(0, 1/M) keeps Z = RMSNorm(x) . phi of order 1.
    norm_weight.assign(static_cast<size_t>(M), 1.0f);
    phi.resize(static_cast<size_t>(M * N));
    const float phi_scale = 1.0f / std::sqrt(static_cast<float>(M));
    for (float& v : phi) v = phi_scale * noise.next();
    alpha = {1.0f, 1.0f, 1.0f};
    bias.resize(static_cast<size_t>(N));
    for (float& v : bias) v = noise.next();
    d_norm_weight.assign(norm_weight.size(), 0.0f);
    d_phi.assign(phi.size(), 0.0f);
    d_alpha.assign(3, 0.0f);
    d_bias.assign(bias.size(), 0.0f);
    h_pre.assign(static_cast<size_t>(T * n), 0.0f);
    h_post.assign(h_pre.size(), 0.0f);
    dh_post.assign(h_pre.size(), 0.0f);
    h_res.assign(static_cast<size_t>(T * n * n), 0.0f);
    dh_res.assign(h_res.size(), 0.0f);
    next_h_pre.assign(h_pre.size(), 0.0f);
    next_h_post.assign(h_pre.size(), 0.0f);
    next_h_res.assign(h_res.size(), 0.0f);
    post_dh_post.assign(h_pre.size(), 0.0f);
    post_dh_res.assign(h_res.size(), 0.0f);
    fn.resize(static_cast<size_t>(n * M));
    for (float& v : fn) v = phi_scale * noise.next();
    base.resize(static_cast<size_t>(n));
    for (float& v : base) v = noise.next();
    scale = {1.0f};
    d_fn.assign(fn.size(), 0.0f);
    d_base.assign(base.size(), 0.0f);
    d_scale.assign(1, 0.0f);
    dcarried.assign(h_pre.size(), 0.0f);

    x.randomize(noise);
    layer_out.randomize(noise);  // stands in for F(layer_in)
    g.randomize(noise);
    dlayer_in.randomize(noise);  // stands in for the backward of F

    // One sublayer forward and backward: valid coefficients, dx_partial and dh_* for the timed
    // calls, and a warm-up of the thread pool and every buffer.
    run(Op::pre_forward);
    run(Op::post_forward);
    run(Op::post_backward);
    run(Op::pre_backward);
  }

  mhc::Params params() const {
    return {mhc::TensorRef(norm_weight.data(), {M}), mhc::TensorRef(phi.data(), {M, N}),
            mhc::TensorRef(alpha.data(), {3}), mhc::TensorRef(bias.data(), {N})};
  }

  mhc::HeadParams head_params() const {
    return {mhc::TensorRef(fn.data(), {n, M}), mhc::TensorRef(base.data(), {n}),
            mhc::TensorRef(scale.data(), {1})};
  }

  mhc::ParamGrads grads() {
    return {mhc::MutableTensorRef(d_norm_weight.data(), {M}),
            mhc::MutableTensorRef(d_phi.data(), {M, N}), mhc::MutableTensorRef(d_alpha.data(), {3}),
            mhc::MutableTensorRef(d_bias.data(), {N})};
  }
  mhc::PreForwardOutputs next_outputs() {
    return {layer_in.ref({T, D}), mhc::MutableTensorRef(next_h_pre.data(), {T, n}),
            mhc::MutableTensorRef(next_h_post.data(), {T, n}),
            mhc::MutableTensorRef(next_h_res.data(), {T, n, n})};
  }
  // The post backward's outputs in the boundary cases: dx and the post_dh_* buffers.
  mhc::PostBackwardOutputs boundary_post_outputs() {
    return {dx.ref({T, n, D}), dlayer_out.ref({T, D}),
            mhc::MutableTensorRef(post_dh_post.data(), {T, n}),
            mhc::MutableTensorRef(post_dh_res.data(), {T, n, n})};
  }

  // Boundary cases: sublayer l's x, layer_out, h_post, h_res; the next sublayer's cotangents are
  // dlayer_in, dx_partial, dh_post, dh_res; x_next lives in `out` and dx_next in `g`.
  void run(Op op) {
    const mhc::TensorRef hp(h_post.data(), {T, n}), hr(h_res.data(), {T, n, n});
    const mhc::TensorRef dhp(dh_post.data(), {T, n}), dhr(dh_res.data(), {T, n, n});
    switch (op) {
      case Op::boundary_forward:
        mhc::boundary_forward(config, x.ref({T, n, D}), layer_out.ref({T, D}), hp, hr, params(),
                              out.ref({T, n, D}), next_outputs());
        break;
      case Op::two_calls_forward:
        mhc::post_forward(config, x.ref({T, n, D}), layer_out.ref({T, D}), hp, hr,
                          out.ref({T, n, D}));
        mhc::pre_forward(config, out.ref({T, n, D}), params(), next_outputs());
        break;
      case Op::boundary_backward:
        mhc::boundary_backward(config, dlayer_in.ref({T, D}), dx_partial.ref({T, n, D}), dhp, dhr,
                               x.ref({T, n, D}), layer_out.ref({T, D}), hp, hr, params(),
                               boundary_post_outputs(), grads());
        break;
      case Op::two_calls_backward:
        mhc::pre_backward(config, dlayer_in.ref({T, D}), dx_partial.ref({T, n, D}), dhp, dhr,
                          out.ref({T, n, D}), params(), g.ref({T, n, D}), grads());
        mhc::post_backward(config, g.ref({T, n, D}), x.ref({T, n, D}), layer_out.ref({T, D}), hp,
                           hr, boundary_post_outputs());
        break;
      case Op::head_forward:  // out in layer_in, gates in h_pre
        mhc::head_forward(config, x.ref({T, n, D}), head_params(), layer_in.ref({T, D}),
                          mhc::MutableTensorRef(h_pre.data(), {T, n}));
        break;
      case Op::head_backward:  // dout in dlayer_in
        mhc::head_backward(
            config, dlayer_in.ref({T, D}), x.ref({T, n, D}), head_params(), dx.ref({T, n, D}),
            {mhc::MutableTensorRef(d_fn.data(), {n, M}), mhc::MutableTensorRef(d_base.data(), {n}),
             mhc::MutableTensorRef(d_scale.data(), {1})});
        break;
      // V4.1: h_pre is sublayer l's (the carried mix); dh_post stands in for the next sublayer's
      // dh_pre (the cotangent of its own h_pre).
      case Op::carried_boundary_forward:
        mhc::boundary_forward_carried(config, x.ref({T, n, D}), layer_out.ref({T, D}),
                                      mhc::TensorRef(h_pre.data(), {T, n}), hp, hr, params(),
                                      out.ref({T, n, D}), next_outputs());
        break;
      case Op::carried_boundary_backward:
        mhc::boundary_backward_carried(config, dlayer_in.ref({T, D}), dx_partial.ref({T, n, D}),
                                       dhp, dhp, dhr, x.ref({T, n, D}), layer_out.ref({T, D}),
                                       mhc::TensorRef(h_pre.data(), {T, n}), hp, hr, params(),
                                       boundary_post_outputs(),
                                       mhc::MutableTensorRef(dcarried.data(), {T, n}), grads());
        break;
      case Op::collapse_forward:
        mhc::collapse_forward(config, x.ref({T, n, D}), mhc::TensorRef(h_pre.data(), {T, n}),
                              layer_in.ref({T, D}));
        break;
      case Op::collapse_backward:
        mhc::collapse_backward(config, dlayer_in.ref({T, D}), x.ref({T, n, D}),
                               mhc::TensorRef(h_pre.data(), {T, n}), dx.ref({T, n, D}),
                               mhc::MutableTensorRef(dcarried.data(), {T, n}));
        break;
      case Op::pre_forward:
        mhc::pre_forward(config, x.ref({T, n, D}), params(),
                         {layer_in.ref({T, D}), mhc::MutableTensorRef(h_pre.data(), {T, n}),
                          mhc::MutableTensorRef(h_post.data(), {T, n}),
                          mhc::MutableTensorRef(h_res.data(), {T, n, n})});
        break;
      case Op::post_forward:
        mhc::post_forward(config, x.ref({T, n, D}), layer_out.ref({T, D}),
                          mhc::TensorRef(h_post.data(), {T, n}),
                          mhc::TensorRef(h_res.data(), {T, n, n}), out.ref({T, n, D}));
        break;
      case Op::post_backward:
        mhc::post_backward(config, g.ref({T, n, D}), x.ref({T, n, D}), layer_out.ref({T, D}),
                           mhc::TensorRef(h_post.data(), {T, n}),
                           mhc::TensorRef(h_res.data(), {T, n, n}),
                           {dx_partial.ref({T, n, D}), dlayer_out.ref({T, D}),
                            mhc::MutableTensorRef(dh_post.data(), {T, n}),
                            mhc::MutableTensorRef(dh_res.data(), {T, n, n})});
        break;
      case Op::pre_backward:
        mhc::pre_backward(config, dlayer_in.ref({T, D}), dx_partial.ref({T, n, D}),
                          mhc::TensorRef(dh_post.data(), {T, n}),
                          mhc::TensorRef(dh_res.data(), {T, n, n}), x.ref({T, n, D}), params(),
                          dx.ref({T, n, D}),
                          {mhc::MutableTensorRef(d_norm_weight.data(), {M}),
                           mhc::MutableTensorRef(d_phi.data(), {M, N}),
                           mhc::MutableTensorRef(d_alpha.data(), {3}),
                           mhc::MutableTensorRef(d_bias.data(), {N})});
        break;
    }
  }
};

// The one live workspace, or the memcpy buffers: never both, to keep peak memory down.
std::unique_ptr<Workspace> g_workspace;
std::unique_ptr<std::vector<char>[]> g_copy;  // [0] source, [1] destination

Workspace& workspace_for(const Case& c) {
  if (!g_workspace || !(g_workspace->key == c)) {
    g_copy.reset();
    g_workspace.reset();  // free the previous case before allocating the next
    g_workspace = std::make_unique<Workspace>(c);
  }
  return *g_workspace;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void set_traffic(benchmark::State& state, double bytes_per_iteration) {
  const double bytes = bytes_per_iteration * static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  state.counters["GB/s"] = benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsRate);
}

// roofline: also report fraction_of_roofline (the roofline/ rows; measuring the FMA peak costs a
// second, once).
void time_op(benchmark::State& state, Op op, const Case& c, bool roofline) {
  Workspace& ws = workspace_for(c);
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) ws.run(op);
  const double elapsed = seconds_since(start);

  double bytes = static_cast<double>(traffic_units(op, ws.n) * ws.D * ws.T * mhc::size_of(c.dtype));
  // At decode sizes the parameters dominate: phi is read by the pre operations, and dphi written
  // by pre_backward, once per call whatever T.
  const double phi_bytes = static_cast<double>(ws.M * ws.N * 4);
  const bool pre_forward_inside = op == Op::pre_forward || op == Op::boundary_forward ||
                                  op == Op::two_calls_forward || op == Op::carried_boundary_forward;
  const bool pre_backward_inside = op == Op::pre_backward || op == Op::boundary_backward ||
                                   op == Op::two_calls_backward ||
                                   op == Op::carried_boundary_backward;
  if (pre_forward_inside) bytes += phi_bytes;
  if (pre_backward_inside) bytes += 2.0 * phi_bytes;
  const double fn_bytes = static_cast<double>(ws.n * ws.M * 4);  // the head's fn, like phi
  if (op == Op::head_forward) bytes += fn_bytes;
  if (op == Op::head_backward) bytes += 2.0 * fn_bytes;
  set_traffic(state, bytes);
  if (g_copy_gbps > 0.0 && elapsed > 0.0) {
    const double seconds = elapsed / static_cast<double>(state.iterations());
    state.counters["fraction_of_copy"] = bytes / seconds / 1e9 / g_copy_gbps;
    // The roofline floor max(bytes / copy, FLOPs / FMA peak) over the time.
    if (roofline) {
      const double flops = flops_per_token(op, ws.n, ws.D, ws.N) * static_cast<double>(ws.T);
      const double floor = std::max(bytes / (g_copy_gbps * 1e9), flops / (fma_peak() * 1e9));
      state.counters["fraction_of_roofline"] = floor / seconds;
      state.counters["fma_peak_gflops"] = fma_peak();
    }
  }
}

void BM_op(benchmark::State& state, Op op, Case c) { time_op(state, op, c, false); }
void BM_roofline(benchmark::State& state, Op op, Case c) { time_op(state, op, c, true); }

// Copies kCopyBytes split into `threads` contiguous chunks, one std::thread each (the calling
// thread takes the first chunk).
void BM_memcpy(benchmark::State& state, int threads) {
  g_workspace.reset();
  if (!g_copy) {
    g_copy.reset(new std::vector<char>[2]);
    g_copy[0].assign(kCopyBytes, 1);  // touch every page before timing
    g_copy[1].assign(kCopyBytes, 0);
  }
  const char* src = g_copy[0].data();
  char* dst = g_copy[1].data();
  const size_t parts = static_cast<size_t>(threads);
  const size_t chunk = (kCopyBytes + parts - 1) / parts;
  auto copy_part = [&](int part) {
    const size_t begin = std::min(kCopyBytes, chunk * static_cast<size_t>(part));
    const size_t end = std::min(kCopyBytes, begin + chunk);
    std::memcpy(dst + begin, src + begin, end - begin);
  };

  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    std::vector<std::thread> workers;
    workers.reserve(static_cast<size_t>(threads - 1));
    for (int part = 1; part < threads; ++part) workers.emplace_back(copy_part, part);
    copy_part(0);
    for (std::thread& w : workers) w.join();
    benchmark::ClobberMemory();
  }
  const double elapsed = seconds_since(start);

  const double bytes = 2.0 * static_cast<double>(kCopyBytes);  // read + write
  set_traffic(state, bytes);
  if (threads == mhc::num_threads() && elapsed > 0.0) {
    g_copy_gbps = bytes * static_cast<double>(state.iterations()) / elapsed / 1e9;
  }
}

// The per-token coefficient math alone (src/cpu/coefficients.h, one thread): forward (the gates
// and H_res from P) or forward then backward (as pre_backward runs them), n = 4, Sinkhorn with the
// default 20 iterations or permutations. 1024 tokens of random P with order-one logits per
// iteration; per_token is the CPU time per token.
void BM_coefficients(benchmark::State& state, mhc::Mix mix, bool with_backward) {
  mhc::Config config;
  config.n = kStreams;
  config.mix = mix;
  const int64_t n = config.n, N = mhc::projection_width(config), tokens = 1024;
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal;
  auto draw = [&](int64_t count) {
    std::vector<float> v(static_cast<size_t>(count));
    for (float& e : v) e = normal(rng);
    return v;
  };
  const std::vector<float> P = draw(tokens * N), bias = draw(N), dh_post = draw(tokens * n),
                           dh_res = draw(tokens * n * n), alpha = {1.0f, 1.0f, 1.0f};
  std::vector<double> dh_pre(static_cast<size_t>(tokens * n));
  for (double& e : dh_pre) e = normal(rng);
  mhc::cpu::TokenCoefficients coefficients(config, alpha.data(), bias.data());
  std::vector<float> h(static_cast<size_t>(2 * n + n * n)), dP(static_cast<size_t>(N));
  std::vector<double> sums(static_cast<size_t>(N + 3));
  const double r = 1.0;
  for (auto _ : state) {
    for (int64_t t = 0; t < tokens; ++t) {
      coefficients.forward(&P[t * N], r, h.data(), h.data() + n, h.data() + 2 * n);
      benchmark::DoNotOptimize(h.data());
      if (!with_backward) continue;
      double dr = 0.0;
      coefficients.backward(&P[t * N], r, &dh_pre[t * n], &dh_post[t * n], &dh_res[t * n * n],
                            dP.data(), &dr, sums.data(), sums.data() + 3);
      benchmark::DoNotOptimize(dP.data());
      benchmark::DoNotOptimize(dr);
    }
  }
  state.counters["per_token"] = benchmark::Counter(
      static_cast<double>(tokens),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

void register_all() {
  const int threads = mhc::num_threads();
  benchmark::RegisterBenchmark("memcpy/256MiB/single_thread", BM_memcpy, 1)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  const std::string multi = "memcpy/256MiB/threads:" + std::to_string(threads);
  benchmark::RegisterBenchmark(multi.c_str(), BM_memcpy, threads)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();

  const Op ops[] = {Op::pre_forward, Op::post_forward, Op::post_backward, Op::pre_backward};
  std::vector<Case> cases;
  for (int64_t dim : {int64_t{1024}, int64_t{4096}}) {
    for (mhc::DType dtype : {mhc::DType::f32, mhc::DType::bf16}) {
      cases.push_back({dtype, dim, mhc::Mix::sinkhorn});
    }
  }
  cases.push_back({mhc::DType::f32, 1024, mhc::Mix::permutations});

  // Decode: few tokens, where the per-call costs (reading phi, waking threads) dominate.
  std::vector<Case> decode;
  for (int64_t dim : {int64_t{4096}, int64_t{7168}}) {
    for (mhc::DType dtype : {mhc::DType::f32, mhc::DType::bf16}) {
      for (int64_t tokens : {int64_t{1}, int64_t{8}, int64_t{64}}) {
        decode.push_back({dtype, dim, mhc::Mix::sinkhorn, tokens});
      }
    }
  }
  // V4.1's decode: its boundary next to V4's at the same shape (T = 1 and 8).
  const Op decode_boundary_ops[] = {Op::boundary_forward, Op::carried_boundary_forward,
                                    Op::boundary_backward, Op::carried_boundary_backward};
  for (const Case& c : decode) {
    if (c.tokens > 8) continue;
    for (Op op : decode_boundary_ops) {
      const std::string name = std::string("decode/") + op_name(op) + "/" +
                               mhc::to_string(c.dtype) + "/D:" + std::to_string(c.dim) +
                               "/T:" + std::to_string(c.tokens);
      benchmark::RegisterBenchmark(name.c_str(), BM_op, op, c)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
  }
  for (const Case& c : decode) {
    for (Op op : ops) {
      const std::string name = std::string("decode/") + op_name(op) + "/" +
                               mhc::to_string(c.dtype) + "/D:" + std::to_string(c.dim) +
                               "/T:" + std::to_string(c.tokens);
      benchmark::RegisterBenchmark(name.c_str(), BM_op, op, c)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
  }

  for (mhc::Mix mix : {mhc::Mix::sinkhorn, mhc::Mix::permutations}) {
    for (bool with_backward : {false, true}) {
      const std::string name = std::string("coefficients/") +
                               (with_backward ? "forward_backward/" : "forward/") +
                               mhc::to_string(mix) + "/n:4";
      benchmark::RegisterBenchmark(name.c_str(), BM_coefficients, mix, with_backward)
          ->Unit(benchmark::kMicrosecond);
    }
  }

  // The roofline shape (T = 8192, n = 4, D = 4096): the pre operations and the head, with
  // their fraction of the roofline floor.
  for (mhc::DType dtype : {mhc::DType::f32, mhc::DType::bf16}) {
    const Case c{dtype, 4096, mhc::Mix::sinkhorn, 8192};
    for (Op op : {Op::pre_forward, Op::pre_backward, Op::head_forward, Op::head_backward}) {
      const std::string name =
          std::string("roofline/") + op_name(op) + "/" + mhc::to_string(c.dtype) + "/D:4096/T:8192";
      benchmark::RegisterBenchmark(name.c_str(), BM_roofline, op, c)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }

  // Grouped by case so that each case's buffers are built once.
  const Op boundary_ops[] = {Op::boundary_forward,         Op::two_calls_forward,
                             Op::boundary_backward,        Op::two_calls_backward,
                             Op::carried_boundary_forward, Op::carried_boundary_backward,
                             Op::collapse_forward,         Op::collapse_backward};
  for (const Case& c : cases) {
    for (Op op : boundary_ops) {
      if (c.mix == mhc::Mix::permutations) continue;
      const std::string name =
          std::string(op_name(op)) + "/" + mhc::to_string(c.dtype) + "/D:" + std::to_string(c.dim);
      benchmark::RegisterBenchmark(name.c_str(), BM_op, op, c)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
    for (Op op : ops) {
      const bool perm = c.mix == mhc::Mix::permutations;
      if (perm && op != Op::pre_forward && op != Op::pre_backward) continue;
      std::string name =
          std::string(op_name(op)) + "/" + mhc::to_string(c.dtype) + "/D:" + std::to_string(c.dim);
      if (perm) name += "/mix:permutations";
      benchmark::RegisterBenchmark(name.c_str(), BM_op, op, c)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  g_workspace.reset();
  g_copy.reset();
  return 0;
}
