// The pre operations' three skinny products on one token tile, single-threaded, f32: mhc's
// hand-written micro-kernels (src/cpu/projection.h, linked from build/libmhc.a) against OpenBLAS
// and libxsmm (Debian's libopenblas0-serial and libxsmm; issue 26 item 1). bf16 inputs reach
// these products widened to f32, so the f32 products are what either path would run for them.
//
//   projection  P [T, N]  = x [T, M] W [M, N]     W = norm_weight * phi (folded per call)
//   dphi        S [M, N]  = x^T [M, T] g [T, N]   (before the norm_weight scaling)
//   dx          dx [T, M] += g [T, N] W^T [N, M]
//
// M = n D, N = n^2 + 2n. Each library variant includes the work it needs around the library
// call (the fold of W, the transposes of small operands, and for the blocked projection the
// double sums of 128-row blocks that give mhc's numbers), because a kernel built on it would
// pay for them too. Every result is compared with mhc's (largest difference relative to the
// largest value), so a variant that computes something else shows it.
//
// The SIMD path comes from each library's own switch, read at startup: MHC_NO_AVX512=1 (mhc),
// OPENBLAS_CORETYPE=Haswell or SkylakeX (OpenBLAS), LIBXSMM_TARGET=hsw or skx (libxsmm);
// run.sh runs both paths. Output: one line per (product, tokens, implementation).
#include <cblas.h>
#include <libxsmm.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "projection.h"  // mhc's internal header (src/cpu): the micro-kernels' entry points

extern "C" char* openblas_get_corename(void);

namespace {

struct Problem {
  int64_t T, M, N;
  std::vector<float> x, norm_weight, phi, g;
};

Problem make_problem(int64_t T, int64_t M, int64_t N) {
  Problem p{T, M, N, {}, {}, {}, {}};
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  auto fill = [&](std::vector<float>& v, size_t size, float offset) {
    v.resize(size);
    for (float& value : v) value = offset + uniform(rng);
  };
  fill(p.x, static_cast<size_t>(T * M), 0.0f);
  fill(p.norm_weight, static_cast<size_t>(M), 1.0f);
  fill(p.phi, static_cast<size_t>(M * N), 0.0f);
  fill(p.g, static_cast<size_t>(T * N), 0.0f);
  return p;
}

double median_ms(const std::function<void()>& call, int repeats) {
  call();  // warm-up: first-touch pages, JIT, library initialisation
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    call();
    times.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

double relative_difference(const std::vector<float>& got, const std::vector<float>& want) {
  double largest = 0.0, difference = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    largest = std::max(largest, std::fabs(static_cast<double>(want[i])));
    difference = std::max(difference, std::fabs(static_cast<double>(got[i]) - want[i]));
  }
  return largest > 0 ? difference / largest : difference;
}

void fold(const Problem& p, std::vector<float>& W) {
  W.resize(static_cast<size_t>(p.M * p.N));
  for (int64_t m = 0; m < p.M; ++m) {
    for (int64_t c = 0; c < p.N; ++c) W[m * p.N + c] = p.norm_weight[m] * p.phi[m * p.N + c];
  }
}

// W^T of the rows [m0, m0 + rows) as [N, rows] row-major, which the column-major libxsmm kernel
// of dx reads as [rows, N]: one small block folded at a time, as mhc's own kernel does.
void fold_transposed_block(const Problem& p, int64_t m0, int64_t rows, float* Wt) {
  for (int64_t c = 0; c < p.N; ++c) {
    for (int64_t j = 0; j < rows; ++j)
      Wt[c * rows + j] = p.norm_weight[m0 + j] * p.phi[(m0 + j) * p.N + c];
  }
}

libxsmm_smmfunction xsmm_kernel(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,
                                int64_t ldc, float beta) {
  const libxsmm_blasint ld[3] = {static_cast<libxsmm_blasint>(lda),
                                 static_cast<libxsmm_blasint>(ldb),
                                 static_cast<libxsmm_blasint>(ldc)};
  const float alpha = 1.0f;
  const int flags = LIBXSMM_GEMM_FLAG_NONE;
  const int prefetch = LIBXSMM_PREFETCH_NONE;
  libxsmm_smmfunction kernel = libxsmm_smmdispatch(
      static_cast<libxsmm_blasint>(m), static_cast<libxsmm_blasint>(n),
      static_cast<libxsmm_blasint>(k), &ld[0], &ld[1], &ld[2], &alpha, &beta, &flags, &prefetch);
  if (kernel == nullptr) {
    std::fprintf(stderr, "libxsmm: no kernel for m=%ld n=%ld k=%ld\n", static_cast<long>(m),
                 static_cast<long>(n), static_cast<long>(k));
    std::exit(1);
  }
  return kernel;
}

struct Row {
  std::string product, implementation;
  int64_t tokens;
  double ms, gflops, difference;
};

void print(const Row& r) {
  std::printf("%-10s T=%-4ld %-28s %9.3f ms %8.1f GFLOP/s   diff %.1e\n", r.product.c_str(),
              static_cast<long>(r.tokens), r.implementation.c_str(), r.ms, r.gflops, r.difference);
  std::fflush(stdout);
}

void run(int64_t T, int64_t M, int64_t N, int repeats) {
  const Problem p = make_problem(T, M, N);
  const double flops = 2.0 * static_cast<double>(T) * M * N;
  auto report = [&](const char* product, const char* implementation, double ms, double difference) {
    print({product, implementation, T, ms, flops / (ms * 1e6), difference});
  };
  const mhc::cpu::FoldedWeight w{p.norm_weight.data(), p.phi.data(), M, N};
  std::vector<float> W;

  // --- projection ---
  std::vector<float> P_mhc(static_cast<size_t>(T * N)), P(static_cast<size_t>(T * N));
  std::vector<double> squares(static_cast<size_t>(T));  // project() sums them in the same sweep
  const double mhc_projection = median_ms(
      [&] { mhc::cpu::project(p.x.data(), T, w, P_mhc.data(), squares.data()); }, repeats);
  report("projection", "mhc", mhc_projection, 0.0);

  const double blas_whole = median_ms(
      [&] {
        fold(p, W);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(T),
                    static_cast<int>(N), static_cast<int>(M), 1.0f, p.x.data(), static_cast<int>(M),
                    W.data(), static_cast<int>(N), 0.0f, P.data(), static_cast<int>(N));
      },
      repeats);
  report("projection", "openblas, one call", blas_whole, relative_difference(P, P_mhc));

  // mhc's numbers: f32 sums over 128-row blocks, added in double in block order.
  const int64_t block = mhc::cpu::kProjectionBlock;
  std::vector<float> sums(static_cast<size_t>(T * N));
  std::vector<double> wide(static_cast<size_t>(T * N));
  auto blocked = [&](const std::function<void(int64_t m0, int64_t rows)>& block_product) {
    fold(p, W);
    std::fill(wide.begin(), wide.end(), 0.0);
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      block_product(m0, std::min(block, M - m0));
      for (size_t i = 0; i < wide.size(); ++i) wide[i] += static_cast<double>(sums[i]);
    }
    for (size_t i = 0; i < wide.size(); ++i) P[i] = static_cast<float>(wide[i]);
  };
  const double blas_blocked = median_ms(
      [&] {
        blocked([&](int64_t m0, int64_t rows) {
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(T),
                      static_cast<int>(N), static_cast<int>(rows), 1.0f, p.x.data() + m0,
                      static_cast<int>(M), W.data() + m0 * N, static_cast<int>(N), 0.0f,
                      sums.data(), static_cast<int>(N));
        });
      },
      repeats);
  report("projection", "openblas, 128-row blocks", blas_blocked, relative_difference(P, P_mhc));

  // Column-major: sums^T [N, T] = W_block^T [N, 128] (W row-major, ld N) x x_block^T [128, T] (ld
  // M).
  const libxsmm_smmfunction projection_kernel = xsmm_kernel(N, T, block, N, M, N, 0.0f);
  const double xsmm_blocked = median_ms(
      [&] {
        blocked([&](int64_t m0, int64_t rows) {
          if (rows != block) {
            std::fprintf(stderr, "M must be a multiple of %ld\n", static_cast<long>(block));
            std::exit(1);
          }
          projection_kernel(W.data() + m0 * N, p.x.data() + m0, sums.data());
        });
      },
      repeats);
  report("projection", "libxsmm, 128-row blocks", xsmm_blocked, relative_difference(P, P_mhc));

  // --- dphi (weight gradient sums) ---
  const int64_t wg_block = mhc::cpu::kWeightGradBlock;
  std::vector<float> S_blocks(static_cast<size_t>(M * N)), S_mhc(static_cast<size_t>(M * N)),
      S(static_cast<size_t>(M * N));
  const double mhc_dphi = median_ms(
      [&] {
        for (int64_t m0 = 0; m0 < M; m0 += wg_block) {
          mhc::cpu::weight_grad_sums(p.x.data(), p.g.data(), T, M, N, m0, S_blocks.data() + m0 * N);
        }
      },
      repeats);
  // mhc's block layout S[c * width + j] to [M, N].
  for (int64_t m0 = 0; m0 < M; m0 += wg_block) {
    const int64_t width = std::min(wg_block, M - m0);
    for (int64_t c = 0; c < N; ++c) {
      for (int64_t j = 0; j < width; ++j)
        S_mhc[(m0 + j) * N + c] = S_blocks[m0 * N + c * width + j];
    }
  }
  report("dphi", "mhc", mhc_dphi, 0.0);

  const double blas_dphi = median_ms(
      [&] {
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(M),
                    static_cast<int>(N), static_cast<int>(T), 1.0f, p.x.data(), static_cast<int>(M),
                    p.g.data(), static_cast<int>(N), 0.0f, S.data(), static_cast<int>(N));
      },
      repeats);
  report("dphi", "openblas, one call", blas_dphi, relative_difference(S, S_mhc));

  // Column-major: S_block [64, N] (mhc's layout, ld 64) = x_block [64, T] (ld M) x g^T... with g
  // transposed once per call to [N, T] row-major (= [T, N] column-major, ld T). The tokens go in
  // chunks of at most 128 (libxsmm's small-kernel size), accumulated with beta = 1.
  const int64_t token_chunk = std::min<int64_t>(T, 128);
  if (T % token_chunk != 0) {
    std::fprintf(stderr, "T must be at most 128 or a multiple of 128\n");
    std::exit(1);
  }
  std::vector<float> gt(static_cast<size_t>(T * N));
  const libxsmm_smmfunction dphi_first =
      xsmm_kernel(wg_block, N, token_chunk, M, T, wg_block, 0.0f);
  const libxsmm_smmfunction dphi_more = xsmm_kernel(wg_block, N, token_chunk, M, T, wg_block, 1.0f);
  const double xsmm_dphi = median_ms(
      [&] {
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t c = 0; c < N; ++c) gt[c * T + t] = p.g[t * N + c];
        }
        for (int64_t m0 = 0; m0 < M; m0 += wg_block) {
          for (int64_t t0 = 0; t0 < T; t0 += token_chunk) {
            (t0 == 0 ? dphi_first : dphi_more)(p.x.data() + t0 * M + m0, gt.data() + t0,
                                               S_blocks.data() + m0 * N);
          }
        }
      },
      repeats);
  for (int64_t m0 = 0; m0 < M; m0 += wg_block) {
    for (int64_t c = 0; c < N; ++c) {
      for (int64_t j = 0; j < wg_block; ++j)
        S[(m0 + j) * N + c] = S_blocks[m0 * N + c * wg_block + j];
    }
  }
  report("dphi", "libxsmm, 64-column blocks", xsmm_dphi, relative_difference(S, S_mhc));

  // --- dx (input gradient) ---
  // dx accumulates (+=), as in the kernels: the timed calls keep adding, and one more call on a
  // zeroed dx gives the values compared.
  std::vector<float> dx_mhc(static_cast<size_t>(T * M)), dx(static_cast<size_t>(T * M));
  const auto time_dx = [&](const std::function<void()>& call, std::vector<float>& result) {
    const double ms = median_ms(call, repeats);
    std::fill(result.begin(), result.end(), 0.0f);
    call();
    return ms;
  };
  const double mhc_dx = time_dx(
      [&] { mhc::cpu::add_projection_grad(p.g.data(), T, w, 0, M, dx_mhc.data()); }, dx_mhc);
  report("dx", "mhc", mhc_dx, 0.0);

  const double blas_dx = time_dx(
      [&] {
        fold(p, W);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(T),
                    static_cast<int>(M), static_cast<int>(N), 1.0f, p.g.data(), static_cast<int>(N),
                    W.data(), static_cast<int>(N), 1.0f, dx.data(), static_cast<int>(M));
      },
      dx);
  report("dx", "openblas, one call", blas_dx, relative_difference(dx, dx_mhc));

  // Column-major: dx^T block [128, chunk] (ld M) += W^T block [128, N] (ld 128) x g^T [N, chunk]
  // (ld N).
  const int64_t dx_block = 128, dx_tokens = std::min<int64_t>(T, 64);
  if (T % dx_tokens != 0 || M % dx_block != 0) {
    std::fprintf(stderr, "T must be at most 64 or a multiple of 64, M a multiple of 128\n");
    std::exit(1);
  }
  const libxsmm_smmfunction dx_kernel = xsmm_kernel(dx_block, dx_tokens, N, dx_block, N, M, 1.0f);
  std::vector<float> Wt(static_cast<size_t>(dx_block * N));
  const double xsmm_dx = time_dx(
      [&] {
        for (int64_t m0 = 0; m0 < M; m0 += dx_block) {
          fold_transposed_block(p, m0, dx_block, Wt.data());
          for (int64_t t0 = 0; t0 < T; t0 += dx_tokens) {
            dx_kernel(Wt.data(), p.g.data() + t0 * N, dx.data() + t0 * M + m0);
          }
        }
      },
      dx);
  report("dx", "libxsmm, 128-column blocks", xsmm_dx, relative_difference(dx, dx_mhc));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> tokens = {64, 256};
  int64_t M = 16384, N = 24;
  int repeats = 21;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int64_t value = std::strtoll(argv[i + 1], nullptr, 10);
    if (flag == "--tokens") {
      tokens = {value};
    } else if (flag == "--M") {
      M = value;
    } else if (flag == "--N") {
      N = value;
    } else if (flag == "--repeats") {
      repeats = static_cast<int>(value);
    } else {
      std::fprintf(stderr, "usage: gemm_bench [--tokens T] [--M M] [--N N] [--repeats R]\n");
      return 2;
    }
  }
  if (M < 128 || M % 128 != 0 || N < 1 || repeats < 1 || tokens[0] < 1) {
    std::fprintf(stderr, "expected M a positive multiple of 128, N >= 1, T >= 1, repeats >= 1\n");
    return 2;
  }
  libxsmm_init();
  std::printf("M=%ld N=%ld, single thread, f32, medians of %d; mhc %s, OpenBLAS %s, libxsmm %s\n",
              static_cast<long>(M), static_cast<long>(N), repeats,
              mhc::cpu::wide_projection() ? "16-lane (AVX-512)" : "8-lane (AVX2)",
              openblas_get_corename(), libxsmm_get_target_arch());
  for (const int64_t T : tokens) run(T, M, N, repeats);
  libxsmm_finalize();
  return 0;
}
