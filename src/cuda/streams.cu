// The streaming kernels: one block per token, threads over D in vectors of kVector elements
// (or single elements when D or an address does not allow 16-byte accesses), the token's
// coefficients in shared memory and its streams in registers. Per-token sums over D (dh_post,
// dh_res, dh_pre) are reduced inside the block in a fixed order, so no atomics are needed.
//
// Precision of those sums: they add signed terms that can cancel far below the size of the terms,
// and the CPU backend had to move exactly these sums to double after f32 partial sums missed the
// spec's 1e-5 on one cancelling dh_post (n = 1, D = 130, a case the suite runs on both backends).
// So, as there (src/cpu/post.cc, vector_math.h): each value is widened to double once, products
// and per-thread sums are in double (fma_wide: the product of two f32 is exact), the block sum is
// in double (block_sum), and the result is rounded to f32 once. Fixed order throughout: a thread
// walks its features in increasing d, the block reduces in block_sum's fixed tree. An emulation of
// this kernel's order for one token at n = 1, D = 130 (numpy, 200000 normal draws) put 796 draws
// of the f32 sums past 1e-5 relative (worst 3.9e-2) and none of the double ones (worst 5.9e-8,
// the final rounding); the device itself has not run it yet.
//
// Why double and not compensated f32: simpler, as accurate as the CPU by construction, and the
// FP64 pipe has room. Napkin math for post_backward at T = 65536, n = 4, D = 7168 on the H200
// (132 SMs at ~1.98 GHz; CUDA C++ Programming Guide throughput for sm_90: 64 FP64 FMAs and 16
// conversions to or from 64-bit types per clock per SM): per token (n + n*n) D = 143k double FMAs
// and (2n + 1) D = 65k widenings, 9.4e9 FMAs in 0.56 ms and 4.2e9 widenings in 1.0 ms, against
// the 3.06 ms memory floor (/work/shared/guides/cuda.md): the FP64 pipe is at most about half busy
// while memory sets the pace. dh_pre (pre_backward) needs n D FMAs and (n + 1) D widenings per
// token, 0.11 + 0.56 ms against its 2.84 ms floor. Each value is widened once (the dot loops run
// one feature at a time after the f32 mixes), never once per product, which would cost 4.5 ms.
// Registers (ptxas -v, sm_90): post_backward's n <= 4 vector path 148-150 per thread (f32 sums:
// 118-122), no spill, which leaves one 256-thread block per SM instead of two; the n <= 8 vector
// path spills 270-390 bytes per thread (none before), the n <= 16 scalar path spilled before too.
//
// STATUS: compiled in CI; not yet run on a GPU. Unverified: the accuracy on a device, and the
// timing above (derived; part 2 of issue 28 measures whether one block per SM still reaches the
// bandwidth the f32 version would have).
#include "common.cuh"
#include "kernels.h"

namespace mhc::cuda {

namespace {

// The token's coefficients, copied once to shared memory: h_post [n] then h_res [n*n].
__device__ void load_coefficients(const float* h_post, const float* h_res, int n, int64_t t,
                                  float* shared) {
  for (int e = threadIdx.x; e < n + n * n; e += blockDim.x) {
    shared[e] = e < n ? h_post[t * n + e] : h_res[t * n * n + (e - n)];
  }
  __syncthreads();
}

// layer_in[t, d] = sum_k h_pre[t, k] x[t, k, d]   (spec: Forward step 6)
template <class X, int V>
__global__ void __launch_bounds__(kBlockThreads)
    pre_apply_kernel(const X* __restrict__ x, const float* __restrict__ h_pre,
                     X* __restrict__ layer_in, int64_t T, int n, int64_t D) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const X* xt = x + t * n * D;
    for (int64_t d = threadIdx.x * int64_t{V}; d < D; d += int64_t{blockDim.x} * V) {
      float acc[V] = {};
      for (int k = 0; k < n; ++k) {
        const float h = __ldg(h_pre + t * n + k);
        float xv[V];
        load<V>(xt + k * D + d, xv);
#pragma unroll
        for (int v = 0; v < V; ++v) acc[v] += h * xv[v];
      }
      store<V>(layer_in + t * D + d, acc);
    }
  }
}

// out[t,j,d] = sum_i h_res[t,i,j] x[t,i,d] + h_post[t,j] layer_out[t,d]   (spec: step 8).
// kMaxN bounds n at compile time so the unrolled stream loops keep x in registers.
template <class X, class L, int kMaxN, int V>
__global__ void __launch_bounds__(kBlockThreads)
    post_forward_kernel(const X* __restrict__ x, const L* __restrict__ layer_out,
                        const float* __restrict__ h_post, const float* __restrict__ h_res,
                        X* __restrict__ out, int64_t T, int n, int64_t D) {
  __shared__ float coefficients[kMaxN + kMaxN * kMaxN];
  const float* hp = coefficients;
  const float* hr = coefficients + n;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    load_coefficients(h_post, h_res, n, t, coefficients);
    const X* xt = x + t * n * D;
    for (int64_t d = threadIdx.x * int64_t{V}; d < D; d += int64_t{blockDim.x} * V) {
      float xv[kMaxN][V];
#pragma unroll
      for (int i = 0; i < kMaxN; ++i) {
        if (i < n) load<V>(xt + i * D + d, xv[i]);
      }
      float lo[V];
      load<V>(layer_out + t * D + d, lo);
#pragma unroll
      for (int j = 0; j < kMaxN; ++j) {
        if (j >= n) break;
        float acc[V];
#pragma unroll
        for (int v = 0; v < V; ++v) acc[v] = hp[j] * lo[v];
#pragma unroll
        for (int i = 0; i < kMaxN; ++i) {
          if (i >= n) break;
          const float h = hr[i * n + j];
#pragma unroll
          for (int v = 0; v < V; ++v) acc[v] += h * xv[i][v];
        }
        store<V>(out + (t * n + j) * D + d, acc);
      }
    }
    __syncthreads();  // the next token overwrites the shared coefficients
  }
}

// spec: Backward, Post. dlayer_out and dx_partial stream out; dh_post [n] and dh_res [n*n] are
// per-thread double sums over D, reduced over the block at the end of each token.
template <class X, class L, int kMaxN, int V>
__global__ void __launch_bounds__(kBlockThreads)
    post_backward_kernel(const X* __restrict__ g, const X* __restrict__ x,
                         const L* __restrict__ layer_out, const float* __restrict__ h_post,
                         const float* __restrict__ h_res, X* __restrict__ dx_partial,
                         L* __restrict__ dlayer_out, float* __restrict__ dh_post,
                         float* __restrict__ dh_res, int64_t T, int n, int64_t D) {
  constexpr int kSums = kMaxN + kMaxN * kMaxN;
  __shared__ float coefficients[kSums];
  __shared__ double scratch[kWarps * kSums];
  __shared__ double totals[kSums];
  const float* hp = coefficients;
  const float* hr = coefficients + n;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    load_coefficients(h_post, h_res, n, t, coefficients);
    // [0, kMaxN): dh_post; then dh_res[i][j] at kMaxN + i * kMaxN + j. Compile-time positions
    // keep the array in registers.
    double partial[kSums] = {};
    const X* gt = g + t * n * D;
    const X* xt = x + t * n * D;
    for (int64_t d = threadIdx.x * int64_t{V}; d < D; d += int64_t{blockDim.x} * V) {
      float gv[kMaxN][V];
      float xv[kMaxN][V];
#pragma unroll
      for (int i = 0; i < kMaxN; ++i) {
        if (i < n) {
          load<V>(gt + i * D + d, gv[i]);
          load<V>(xt + i * D + d, xv[i]);
        }
      }
      float lo[V];
      load<V>(layer_out + t * D + d, lo);
      // The mixes, in f32 (sums of n products).
      float dlo[V] = {};
#pragma unroll
      for (int j = 0; j < kMaxN; ++j) {
        if (j >= n) break;
#pragma unroll
        for (int v = 0; v < V; ++v) dlo[v] += hp[j] * gv[j][v];
      }
      store<V>(dlayer_out + t * D + d, dlo);
#pragma unroll
      for (int i = 0; i < kMaxN; ++i) {
        if (i >= n) break;
        float dxi[V] = {};
#pragma unroll
        for (int j = 0; j < kMaxN; ++j) {
          if (j >= n) break;
          const float h = hr[i * n + j];
#pragma unroll
          for (int v = 0; v < V; ++v) dxi[v] += h * gv[j][v];
        }
        store<V>(dx_partial + (t * n + i) * D + d, dxi);
      }
      // The dots, one feature at a time: each value widened to double once, then its n + n*n
      // products added in double.
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const double lo_wide = lo[v];
        double g_wide[kMaxN];
#pragma unroll
        for (int j = 0; j < kMaxN; ++j) {
          if (j >= n) break;
          g_wide[j] = gv[j][v];
          partial[j] = fma(lo_wide, g_wide[j], partial[j]);
        }
#pragma unroll
        for (int i = 0; i < kMaxN; ++i) {
          if (i >= n) break;
          const double x_wide = xv[i][v];
#pragma unroll
          for (int j = 0; j < kMaxN; ++j) {
            if (j >= n) break;
            partial[kMaxN + i * kMaxN + j] = fma(x_wide, g_wide[j], partial[kMaxN + i * kMaxN + j]);
          }
        }
      }
    }
    block_sum<kSums>(partial, kSums, scratch, totals);
    for (int e = threadIdx.x; e < n + n * n; e += blockDim.x) {
      if (e < n) {
        dh_post[t * n + e] = static_cast<float>(totals[e]);
      } else {
        const int i = (e - n) / n, j = (e - n) % n;
        dh_res[t * n * n + (e - n)] = static_cast<float>(totals[kMaxN + i * kMaxN + j]);
      }
    }
    __syncthreads();
  }
}

// dh_pre[t, k] = sum_d x[t, k, d] dlayer_in[t, d]   (spec: Backward, Pre-apply), summed in double
// like post_backward's dots.
template <class X, int kMaxN, int V>
__global__ void __launch_bounds__(kBlockThreads)
    dh_pre_kernel(const X* __restrict__ dlayer_in, const X* __restrict__ x,
                  float* __restrict__ dh_pre, int64_t T, int n, int64_t D) {
  __shared__ double scratch[kWarps * kMaxN];
  __shared__ double totals[kMaxN];
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    double partial[kMaxN] = {};
    const X* xt = x + t * n * D;
    for (int64_t d = threadIdx.x * int64_t{V}; d < D; d += int64_t{blockDim.x} * V) {
      float dli[V];
      load<V>(dlayer_in + t * D + d, dli);
      double dli_wide[V];
#pragma unroll
      for (int v = 0; v < V; ++v) dli_wide[v] = dli[v];
#pragma unroll
      for (int k = 0; k < kMaxN; ++k) {
        if (k >= n) break;
        float xv[V];
        load<V>(xt + k * D + d, xv);
#pragma unroll
        for (int v = 0; v < V; ++v)
          partial[k] = fma(static_cast<double>(xv[v]), dli_wide[v], partial[k]);
      }
    }
    block_sum<kMaxN>(partial, n, scratch, totals);
    for (int k = threadIdx.x; k < n; k += blockDim.x)
      dh_pre[t * n + k] = static_cast<float>(totals[k]);
    __syncthreads();
  }
}

// Calls body(kMaxN, V) as integral constants: kMaxN the smallest supported bound >= n, V the
// vector width. Beyond 8 streams (rare; the per-thread sums then live in local memory anyway)
// only the scalar path is built, which keeps the compile time of this file in check.
template <class Body>
void with_bound_and_width(int64_t n, bool vector, Body body) {
  using Scalar = std::integral_constant<int, 1>;
  using Vector = std::integral_constant<int, kVector>;
  if (n <= 4) {
    vector ? body(std::integral_constant<int, 4>{}, Vector{})
           : body(std::integral_constant<int, 4>{}, Scalar{});
  } else if (n <= 8) {
    vector ? body(std::integral_constant<int, 8>{}, Vector{})
           : body(std::integral_constant<int, 8>{}, Scalar{});
  } else {
    static_assert(kMaxStreams == 16, "the CUDA stream bounds must cover kMaxStreams");
    body(std::integral_constant<int, 16>{}, Scalar{});
  }
}

}  // namespace

int64_t token_blocks(int64_t T) { return T < kMaxTokenBlocks ? T : kMaxTokenBlocks; }

void launch_pre_apply(const detail::Dims& d, Grid grid, const TensorRef& x, const float* h_pre,
                      const MutableTensorRef& layer_in, cudaStream_t stream) {
  if (d.T == 0) return;
  const bool vector = vector_path(d.D, {x.data, layer_in.data});
  with_device_type(x.dtype, [&](auto x_type) {
    using X = decltype(x_type);
    with_bound_and_width(1, vector, [&](auto, auto width) {
      pre_apply_kernel<X, width()><<<grid.blocks(), kBlockThreads, 0, stream>>>(
          static_cast<const X*>(x.data), h_pre, static_cast<X*>(layer_in.data), d.T,
          static_cast<int>(d.n), d.D);
    });
  });
}

void launch_post_forward(const detail::Dims& d, Grid grid, const TensorRef& x,
                         const TensorRef& layer_out, const TensorRef& h_post,
                         const TensorRef& h_res, const MutableTensorRef& out, cudaStream_t stream) {
  if (d.T == 0) return;
  const bool vector = vector_path(d.D, {x.data, layer_out.data, out.data});
  with_device_type(x.dtype, [&](auto x_type) {
    using X = decltype(x_type);
    with_device_type(layer_out.dtype, [&](auto lo_type) {
      using L = decltype(lo_type);
      with_bound_and_width(d.n, vector, [&](auto bound, auto width) {
        post_forward_kernel<X, L, bound(), width()><<<grid.blocks(), kBlockThreads, 0, stream>>>(
            static_cast<const X*>(x.data), static_cast<const L*>(layer_out.data),
            static_cast<const float*>(h_post.data), static_cast<const float*>(h_res.data),
            static_cast<X*>(out.data), d.T, static_cast<int>(d.n), d.D);
      });
    });
  });
}

void launch_post_backward(const detail::Dims& d, Grid grid, const TensorRef& g, const TensorRef& x,
                          const TensorRef& layer_out, const TensorRef& h_post,
                          const TensorRef& h_res, const PostBackwardOutputs& outputs,
                          cudaStream_t stream) {
  if (d.T == 0) return;
  const bool vector = vector_path(
      d.D, {g.data, x.data, layer_out.data, outputs.dx_partial.data, outputs.dlayer_out.data});
  with_device_type(x.dtype, [&](auto x_type) {
    using X = decltype(x_type);
    with_device_type(layer_out.dtype, [&](auto lo_type) {
      using L = decltype(lo_type);
      with_bound_and_width(d.n, vector, [&](auto bound, auto width) {
        post_backward_kernel<X, L, bound(), width()><<<grid.blocks(), kBlockThreads, 0, stream>>>(
            static_cast<const X*>(g.data), static_cast<const X*>(x.data),
            static_cast<const L*>(layer_out.data), static_cast<const float*>(h_post.data),
            static_cast<const float*>(h_res.data), static_cast<X*>(outputs.dx_partial.data),
            static_cast<L*>(outputs.dlayer_out.data), static_cast<float*>(outputs.dh_post.data),
            static_cast<float*>(outputs.dh_res.data), d.T, static_cast<int>(d.n), d.D);
      });
    });
  });
}

void launch_dh_pre(const detail::Dims& d, Grid grid, const TensorRef& dlayer_in, const TensorRef& x,
                   float* dh_pre, cudaStream_t stream) {
  if (d.T == 0) return;
  const bool vector = vector_path(d.D, {dlayer_in.data, x.data});
  with_device_type(x.dtype, [&](auto x_type) {
    using X = decltype(x_type);
    with_bound_and_width(d.n, vector, [&](auto bound, auto width) {
      dh_pre_kernel<X, bound(), width()><<<grid.blocks(), kBlockThreads, 0, stream>>>(
          static_cast<const X*>(dlayer_in.data), static_cast<const X*>(x.data), dh_pre, d.T,
          static_cast<int>(d.n), d.D);
    });
  });
}

}  // namespace mhc::cuda
