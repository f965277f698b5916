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
#include <utility>
#include <vector>

// Loops that vectorise are compiled three times, for CPUs with AVX-512, with AVX2 and FMA,
// and for plain x86-64, and run in the best variant the CPU has (picked once, by its
// features), so the build flags stay portable. Written out, not by GCC's target_clones:
// a clone names one feature, and its "avx2" clone has no FMA, so every multiply-add was
// two instructions (the attention kernel ran 6% slower); clones named by "arch=" match
// one CPU model only.
//
// A hot loop is written once as `name_body` (LEANFORMER_VARIANT_BODY, a template), and
// LEANFORMER_CPU_VARIANTS(name) then defines `name(args...)`, which calls it compiled for
// the CPU. Small helpers it calls are compiled into each variant with it only where GCC
// inlines them (an out-of-line copy is plain x86-64), so the hot ones (dot, sq_dist) are
// forced inline.
#if defined(__x86_64__) && defined(__GNUC__)
#define LEANFORMER_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma")))
#define LEANFORMER_TARGET_AVX2 __attribute__((target("avx2,fma")))
#else
#define LEANFORMER_TARGET_AVX512
#define LEANFORMER_TARGET_AVX2
#endif
#define LEANFORMER_VARIANT_BODY __attribute__((always_inline)) inline

namespace leanformer_cpu {

enum class Variant { avx512, avx2, plain };

inline Variant best_variant() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const Variant best = __builtin_cpu_supports("avx512f")                                   ? Variant::avx512
                              : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? Variant::avx2
                                                                                                : Variant::plain;
  return best;
#else
  return Variant::plain;
#endif
}

}  // namespace leanformer_cpu

#define LEANFORMER_CPU_VARIANTS(name)                                                  \
  template <typename... Args>                                                          \
  LEANFORMER_TARGET_AVX512 auto name##_avx512(Args&&... args) {                        \
    return name##_body(std::forward<Args>(args)...);                                   \
  }                                                                                    \
  template <typename... Args>                                                          \
  LEANFORMER_TARGET_AVX2 auto name##_avx2(Args&&... args) {                            \
    return name##_body(std::forward<Args>(args)...);                                   \
  }                                                                                    \
  template <typename... Args>                                                          \
  auto name(Args&&... args) {                                                          \
    switch (leanformer_cpu::best_variant()) {                                          \
      case leanformer_cpu::Variant::avx512:                                            \
        return name##_avx512(std::forward<Args>(args)...);                             \
      case leanformer_cpu::Variant::avx2:                                              \
        return name##_avx2(std::forward<Args>(args)...);                               \
      default:                                                                         \
        return name##_body(std::forward<Args>(args)...);                               \
    }                                                                                  \
  }

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
// Tokens have tens of channels, so with one vector of partial sums every multiply-add
// waits for the one before: four vectors keep four chains in flight, and the lanes are
// added as a tree. The order is fixed, so equal inputs give equal sums. Vectors of 32
// bytes: one AVX2 register (half an AVX-512 one, two SSE ones in the plain variant).
template <typename T>
__attribute__((always_inline)) inline T dot(const T* a, const T* b, int64_t n) {
  // Loaded straight from unaligned rows (the type's alignment is the element's).
  typedef T Vec __attribute__((vector_size(32), aligned(alignof(T)), may_alias));
  constexpr int64_t lanes = 32 / sizeof(T);
  const Vec* va = reinterpret_cast<const Vec*>(a);
  const Vec* vb = reinterpret_cast<const Vec*>(b);
  Vec s0 = {}, s1 = {}, s2 = {}, s3 = {};
  int64_t v = 0;
  const int64_t vectors = n / lanes;
  for (; v + 4 <= vectors; v += 4) {
    s0 += va[v] * vb[v];
    s1 += va[v + 1] * vb[v + 1];
    s2 += va[v + 2] * vb[v + 2];
    s3 += va[v + 3] * vb[v + 3];
  }
  for (; v < vectors; ++v) s0 += va[v] * vb[v];
  s0 = (s0 + s1) + (s2 + s3);
  for (int64_t half = lanes / 2; half > 0; half /= 2) {
    for (int64_t l = 0; l < half; ++l) s0[l] += s0[l + half];
  }
  T sum = s0[0];
  for (int64_t i = vectors * lanes; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// An example's mean token, then the tokens minus it (as leanformer.ops.token_distances.
// centred) and their squared norms. Distances do not change; their float rounding does:
// the expansion |x|^2 + |y|^2 - 2 x.y loses the digits of |x - y|^2 below the rounding of
// |x|^2, which centring keeps small. The mean is summed here, not by a separate tensor
// pass, because the example is then read from memory once and centred from the cache.
template <typename T>
LEANFORMER_VARIANT_BODY void centre_body(const T* x, int64_t n, int64_t c, T* mean, T* out, T* sq) {
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
#pragma omp simd
    for (int64_t d = 0; d < c; ++d) oi[d] = xi[d] - mean[d];
    // By dot itself (the row is in L1), so a token's squared norm is its dot product
    // with itself to the bit, and sq_dist gives a token and its copy a distance of 0.
    sq[i] = dot(oi, oi, c);
  }
}
LEANFORMER_CPU_VARIANTS(centre)

// For each of k rows of c values (row j at rows + index[j] * c, squared norm
// sq[index[j]]): the first row equal to it, itself if none -> first_equal [k]. Exact ties
// between equal centres go to the first (the clusterings' rule), and a BLAS product need
// not round two equal rows alike: it may take another kernel for the rows of an edge
// tile. Rows are ranked by norm first, so only rows of equal norms are compared.
template <typename T>
void first_equal_rows(const T* rows, const T* sq, const int64_t* index, int64_t k, int64_t c,
                      std::vector<int64_t>& by_norm, std::vector<int64_t>& first_equal) {
  for (int64_t j = 0; j < k; ++j) by_norm[j] = first_equal[j] = j;
  std::stable_sort(by_norm.begin(), by_norm.begin() + k,
                   [&](int64_t a, int64_t b) { return sq[index[a]] < sq[index[b]]; });
  for (int64_t r = 1; r < k; ++r) {
    const int64_t j = by_norm[r];
    const T* row = rows + index[j] * c;
    // Earlier in the run of equal norms, which the stable sort keeps in row order.
    for (int64_t q = r - 1; q >= 0 && sq[index[by_norm[q]]] == sq[index[j]]; --q) {
      const int64_t t = by_norm[q];
      if (std::equal(row, row + c, rows + index[t] * c)) {
        first_equal[j] = first_equal[t];
        break;
      }
    }
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

// work(b, centred, sq, mean, task) for every example b of the tokens (rows contiguous,
// examples `batch_stride` elements apart), centred on its mean (with the squared norms),
// examples in parallel: each task's BLAS products on its own thread, and its buffers
// (`task`, from make_task(), and the centred tokens) made once and reused by its
// examples, so they stay in the core's cache through the work. A single task (batch 1)
// runs outside any parallel region, and its products may use every thread.
template <typename T, typename MakeTask, typename Work>
void for_each_centred_example(const T* x, int64_t batch_stride, int64_t batch, int64_t n, int64_t c,
                              const MakeTask& make_task, const Work& work) {
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::optional<leanformer_blas::SingleThreadedBlas> one_blas_thread;
    if (at::in_parallel_region()) one_blas_thread.emplace();
    std::vector<T> centred(n * c), sq(n), mean(c);
    auto task = make_task();
    for (int64_t b = begin; b < end; ++b) {
      centre(x + b * batch_stride, n, c, mean.data(), centred.data(), sq.data());
      work(b, centred.data(), sq.data(), mean.data(), task);
    }
  });
}

// One example: out [S, C] = sum over the rows i of each segment of w_i x_i, in row
// order. The rows are listed by segment first (a stable counting sort), so each output
// row is summed while it sits in L1 and written once, as embedding_bag does; adding
// every input row into its output row in turn measured 7-10% slower on tokens out of
// cache. False when a segment id is outside [0, S).
template <typename T>
LEANFORMER_VARIANT_BODY bool sum_segments_body(const T* x, const T* w, const int64_t* segment, int64_t n, int64_t c,
                                               int64_t segments, T* out, std::vector<int64_t>& start,
                                               std::vector<int64_t>& next, std::vector<int64_t>& order) {
  std::fill(start.begin(), start.end(), int64_t(0));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = segment[i];
    if (s < 0 || s >= segments) return false;
    ++start[s + 1];
  }
  for (int64_t s = 0; s < segments; ++s) start[s + 1] += start[s];
  std::copy(start.begin(), start.end() - 1, next.begin());
  for (int64_t i = 0; i < n; ++i) order[next[segment[i]]++] = i;
  for (int64_t s = 0; s < segments; ++s) {
    T* os = out + s * c;
    std::fill(os, os + c, T(0));
    for (int64_t r = start[s]; r < start[s + 1]; ++r) {
      const int64_t i = order[r];
      const T wi = w[i];
      const T* xi = x + i * c;
#pragma omp simd
      for (int64_t d = 0; d < c; ++d) os[d] += wi * xi[d];
    }
  }
  return true;
}
LEANFORMER_CPU_VARIANTS(sum_segments)

// What a task needs to pool its examples' clusters (sized for n tokens, k clusters).
template <typename T>
struct PoolBuffers {
  std::vector<T> total, share;
  std::vector<int64_t> members, start, next, order;
  PoolBuffers(int64_t n, int64_t k) : total(k), share(n), members(k), start(k + 1), next(k), order(n) {}
};

// One example's pooled tokens, out [K, C]: the weighted mean of every cluster of
// assign [N] (ids in [0, K)), as leanformer.ops.cluster_plan.cluster_mean makes it, bit for
// bit: each weight divided by its cluster's total (summed in token order, at least the
// smallest normal number), or 1 / members where that total is not positive; then one
// segment sum of the tokens x [N, C] with those shares. An empty cluster sums to 0.
template <typename T>
void pool_clusters(const T* x, const T* w, const int64_t* assign, int64_t n, int64_t c, int64_t k, T* out,
                   PoolBuffers<T>& buf) {
  std::fill(buf.total.begin(), buf.total.end(), T(0));
  std::fill(buf.members.begin(), buf.members.end(), int64_t(0));
  for (int64_t i = 0; i < n; ++i) {
    buf.total[assign[i]] += w[i];
    buf.members[assign[i]] += 1;
  }
  const T tiny = std::numeric_limits<T>::min();
  for (int64_t i = 0; i < n; ++i) {
    const T own = buf.total[assign[i]];
    buf.share[i] = own > T(0) ? w[i] / std::max(own, tiny) : T(1) / static_cast<T>(buf.members[assign[i]]);
  }
  sum_segments(x, buf.share.data(), assign, n, c, k, out, buf.start, buf.next, buf.order);
}

}  // namespace leanformer_tokens