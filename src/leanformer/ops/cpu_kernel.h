// What the package's C++ kernels share: the BLAS matrix product that PyTorch links, and
// the CPU variants their loops are compiled for.
//
// libtorch_cpu exports the Fortran BLAS symbols (sgemm_, dgemm_) of the library it was
// built with (MKL on x86 wheels). Column-major, as BLAS is: a row-major [rows x cols]
// matrix with row stride ld is the column-major [cols x rows] matrix with leading
// dimension ld, so a row-major product C = A B is called as C^T = B^T A^T.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

// Loops that vectorise are compiled three times, for CPUs with AVX-512 (and FMA), with
// AVX2, and for plain x86-64; the CPU picks one when the library loads, by its features
// (clones named by "arch=" match one CPU model only), so the build flags stay portable.
#if defined(__x86_64__) && defined(__GNUC__)
#define LEANFORMER_CPU_VARIANTS __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LEANFORMER_CPU_VARIANTS
#endif

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b, const int* ldb,
            const double* beta, double* c, const int* ldc);
// MKL's thread count for the calling thread, when the BLAS is MKL (else null): a product
// inside a parallel task must not start threads of its own.
int MKL_Set_Num_Threads_Local(int threads) __attribute__((weak));
}

namespace leanformer_blas {

// Column-major C [m x n] = alpha op(A) op(B) + beta C.
inline void gemm(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
                 int ldb, float beta, float* c, int ldc) {
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

inline void gemm(char ta, char tb, int m, int n, int k, double alpha, const double* a, int lda, const double* b,
                 int ldb, double beta, double* c, int ldc) {
  dgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

// One BLAS thread for the calling thread while in scope (no-op without MKL).
class SingleThreadedBlas {
 public:
  SingleThreadedBlas() : saved_(MKL_Set_Num_Threads_Local ? MKL_Set_Num_Threads_Local(1) : 0) {}
  ~SingleThreadedBlas() {
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(saved_);
  }
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

 private:
  int saved_;
};

}  // namespace leanformer_blas

namespace leanformer_tokens {

// a . b over n elements (inlined into the callers, whose CPU variants it then shares).
template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// An example's mean token, then the tokens minus it (as leanformer.ops.token_distances.
// centred) and their squared norms. Distances do not change; their float rounding does:
// the expansion |x|^2 + |y|^2 - 2 x.y loses the digits of |x - y|^2 below the rounding of
// |x|^2, which centring keeps small. The mean is summed here, not by a separate tensor
// pass, because the example is then read from memory once and centred from the cache.
template <typename T>
LEANFORMER_CPU_VARIANTS void centre(const T* x, int64_t n, int64_t c, T* mean, T* out, T* sq) {
  std::fill(mean, mean + c, T(0));
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * c;
#pragma omp simd
    for (int64_t d = 0; d < c; ++d) mean[d] += xi[d];
  }
  const T count = static_cast<T>(n);
#pragma omp simd
  for (int64_t d = 0; d < c; ++d) mean[d] /= count;  // divided, as torch's mean: a product by 1/n rounds apart
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * c;
    T* oi = out + i * c;
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < c; ++d) {
      const T v = xi[d] - mean[d];
      oi[d] = v;
      sum += v * v;
    }
    sq[i] = sum;
  }
}

struct ClusteringShape {
  int64_t batch, n, c, k;
};

// The clustering kernels' inputs: tokens x [B, N, C], weights [B, N] (one floating type,
// both on the CPU) and `start` [B, K] int64 token indices, K < N (named `start_name` in
// the errors).
inline ClusteringShape check_clustering_inputs(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& start,
                                               const char* start_name) {
  TORCH_CHECK(x.device().is_cpu() && weights.device().is_cpu() && start.device().is_cpu(),
              "the C++ clustering runs on the CPU: tokens, weights and ", start_name, " must all be CPU tensors");
  TORCH_CHECK(x.dim() == 3, "tokens must be [B, N, C]");
  TORCH_CHECK(start.dim() == 2, start_name, " must be [B, K]");
  const ClusteringShape s{x.size(0), x.size(1), x.size(2), start.size(1)};
  TORCH_CHECK(s.c >= 1, "tokens need at least one feature");
  TORCH_CHECK(weights.sizes() == at::IntArrayRef({s.batch, s.n}), "weights must be [B, N]");
  TORCH_CHECK(start.size(0) == s.batch && s.k >= 1 && s.k < s.n, start_name, " must be [B, K], K < N");
  TORCH_CHECK(start.scalar_type() == at::kLong, start_name, " must be int64");
  TORCH_CHECK(weights.scalar_type() == x.scalar_type(), "tokens and weights must share one floating type");
  TORCH_CHECK(s.c <= std::numeric_limits<int>::max() && s.n <= std::numeric_limits<int>::max(),
              "too many tokens or features for a BLAS product");
  return s;
}

// The tokens as the kernels read them: each example's rows contiguous, examples any
// whole number of elements apart. A block hands a reducer x[:, 1:] (no class token) of
// a contiguous tensor, which is read in place rather than copied first.
struct TokenRows {
  at::Tensor tensor;
  int64_t batch_stride;
};

inline TokenRows token_rows(const at::Tensor& x) {
  const int64_t batch = x.size(0), n = x.size(1), c = x.size(2);
  // A size-1 dimension's stride is never used, whatever it holds. A lazily negated view
  // (the imaginary part of a conjugate) stores its values negated: it is copied.
  if (!x.is_neg() && (c == 1 || x.stride(2) == 1) && (n == 1 || x.stride(1) == c)) {
    return {x, batch == 1 ? 0 : x.stride(0)};
  }
  at::Tensor copy = x.resolve_neg().contiguous();
  return {copy, n * c};
}

// work(b, centred, sq, mean) for every example b of the tokens (rows contiguous, examples
// `batch_stride` elements apart), centred on its mean (with the squared norms), examples
// in parallel: each task's BLAS products on its own thread. A single task (batch 1) runs
// outside any parallel region, and its products may use every thread. A task's buffers
// are reused by its examples, so they stay in the core's cache through the work.
template <typename T, typename Work>
void for_each_centred_example(const T* x, int64_t batch_stride, int64_t batch, int64_t n, int64_t c,
                              const Work& work) {
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::optional<leanformer_blas::SingleThreadedBlas> one_blas_thread;
    if (at::in_parallel_region()) one_blas_thread.emplace();
    std::vector<T> centred(n * c), sq(n), mean(c);
    for (int64_t b = begin; b < end; ++b) {
      centre(x + b * batch_stride, n, c, mean.data(), centred.data(), sq.data());
      work(b, centred.data(), sq.data(), mean.data());
    }
  });
}

}  // namespace leanformer_tokens
