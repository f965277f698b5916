// Attention and the attention each key received, on the CPU, in one pass over the logits.
//
// The received score of key j is r_j = sum_h sum_i p_hij, a column sum of the softmax
// probabilities (PoWER-BERT, Token Pooling). PyTorch's fused attention never shows its
// probabilities, so leanformer/ops/received.py computes them block by block with three
// tensor operations and a softmax; at token pooling's sizes that measured 1.2-2.5x the
// time of the fused kernel. Here each task takes one (item, head, block of queries) and,
// while the block's logits are in the core's cache:
//
//   logits   s = scale * q k^T (+ mask)            one BLAS product
//   softmax  e = exp(s - max) and its row sums     one vectorised pass (after the max)
//   scores   the task's column sums of e / sum     one pass
//   output   e v / sum, into out[b, rows, h]       one BLAS product, rows then scaled
//
// Tasks run in parallel (at::parallel_for); each writes its own rows of the output and
// its own row of column sums, which are added up afterwards, so no task waits on another.
// Inference only: no autograd, no dropout (the Python code handles those).

// ATen and the pybind11 casters for tensors, not all of <torch/extension.h>: the C++
// frontend it adds (modules, optimizers) is unused here and doubled the build time.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "cpu_kernel.h"

namespace {

using leanformer_blas::gemm;

// exp(x) for x <= 0 (a logit minus its row's maximum), vectorisable: x = k ln2 + r with
// |r| <= ln2 / 2, exp(r) by its degree-7 Taylor-like polynomial (Cephes' expf
// coefficients), 2^k by the exponent bits. Relative error within 2 float32 ulps. Below
// -87.3 (where 2^k leaves the normal floats) the result is 0, as a masked key's (-inf)
// must be; NaN stays NaN. k is rounded by adding 1.5 * 2^23, which leaves it in the low
// bits of the sum, so no float reaches an integer conversion (NaN would be undefined).
inline float exp_nonpositive(float x) {
  const bool underflow = x < -87.3f;  // also -inf
  x = underflow ? -87.3f : x;         // NaN stays NaN, and so does the result
  const float shifted = x * 1.44269504088896341f + 12582912.f;
  const float k = shifted - 12582912.f;                 // x / ln2, rounded to an integer
  float r = x - k * 0.693359375f;  // ln2 in two parts, so r carries no rounding of k ln2
  r = r + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  // The low bits of `shifted` are k (two's complement); shifted into the exponent field,
  // the bits above them fall off.
  const float two_k = std::bit_cast<float>((std::bit_cast<uint32_t>(shifted) << 23) + (127u << 23));
  return underflow ? 0.f : p * two_k;
}

inline double exp_nonpositive(double x) { return std::exp(x); }

// For each of `rows` rows of s [rows, n] (row stride ld; plus the mask's rows): the
// exponentials e = exp(s - max) in place, the inverse 1 / sum(e) of the row into
// inverse [rows], and the probabilities e / sum(e) added into received [n]. The rows are
// left unnormalised: the output's rows are scaled instead, D values a row, not N.
template <typename T>
LEANFORMER_VARIANT_BODY void softmax_rows_into_body(T* s, int64_t rows, int64_t n, int64_t ld, const T* mask,
                                                    int64_t mask_row_stride, int64_t mask_key_stride, T* received,
                                                    T* inverse) {
  for (int64_t i = 0; i < rows; ++i) {
    T* row = s + i * ld;
    T top = -std::numeric_limits<T>::infinity();
    const T* mrow = mask == nullptr ? nullptr : mask + i * mask_row_stride;
    if (mrow != nullptr && mask_key_stride == 1) {
#pragma omp simd reduction(max : top)
      for (int64_t j = 0; j < n; ++j) {
        row[j] += mrow[j];
        top = row[j] > top ? row[j] : top;
      }
    } else {
      if (mrow != nullptr) {
        for (int64_t j = 0; j < n; ++j) row[j] += mrow[j * mask_key_stride];
      }
#pragma omp simd reduction(max : top)
      for (int64_t j = 0; j < n; ++j) top = row[j] > top ? row[j] : top;
    }
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      const T e = exp_nonpositive(row[j] - top);
      row[j] = e;
      sum += e;
    }
    const T inv = T(1) / sum;
    inverse[i] = inv;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) received[j] += row[j] * inv;
  }
}
LEANFORMER_CPU_VARIANTS(softmax_rows_into)

struct Strides {
  int64_t item, head, row;
};

Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* mask, double scale,
         int64_t block_rows, at::Tensor& out, at::Tensor& shares) {
  const int64_t batch = q.size(0), heads = q.size(1), num_queries = q.size(2), head_dim = q.size(3);
  const int64_t num_keys = k.size(2);
  const int64_t blocks = (num_queries + block_rows - 1) / block_rows;
  const Strides qs = strides_of(q), ks = strides_of(k), vs = strides_of(v);
  Strides ms{0, 0, 0};
  int64_t mask_key_stride = 0;
  const T* mp = nullptr;
  if (mask != nullptr) {
    ms = strides_of(*mask);
    mask_key_stride = mask->stride(3);
    mp = mask->data_ptr<T>();
  }
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* sp = shares.data_ptr<T>();
  const T alpha = static_cast<T>(scale);
  at::parallel_for(0, batch * heads * blocks, 1, [&](int64_t begin, int64_t end) {
    // Tasks in parallel: each one's products on its own thread. A single task runs
    // outside any parallel region, and its products may use every thread.
    std::optional<leanformer_blas::SingleThreadedBlas> one_blas_thread;
    if (at::in_parallel_region()) one_blas_thread.emplace();
    // Rows of logits a whole number of cache lines long: a BLAS product with an odd
    // leading dimension (785 keys) measured 5-10% slower.
    const int64_t ld = (num_keys + 15) / 16 * 16;
    std::vector<T> logits(block_rows * ld), inverse(block_rows);
    const int64_t out_ld = heads * head_dim;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (heads * blocks), h = (task / blocks) % heads, first = (task % blocks) * block_rows;
      const int rows = static_cast<int>(std::min(block_rows, num_queries - first));
      const T* qh = qp + b * qs.item + h * qs.head + first * qs.row;
      const T* kh = kp + b * ks.item + h * ks.head;
      const T* vh = vp + b * vs.item + h * vs.head;
      // logits [rows, Nk] = alpha * q_rows k^T: column-major, k^T (transposed) times q^T.
      gemm('T', 'N', static_cast<int>(num_keys), rows, static_cast<int>(head_dim), alpha, kh,
           static_cast<int>(ks.row), qh, static_cast<int>(qs.row), T(0), logits.data(), static_cast<int>(ld));
      const T* mask_rows = mp == nullptr ? nullptr : mp + b * ms.item + h * ms.head + first * ms.row;
      softmax_rows_into(logits.data(), int64_t(rows), num_keys, ld, mask_rows, ms.row, mask_key_stride,
                        sp + task * num_keys, inverse.data());
      // out[b, first:first + rows, h] = e v, rows H * D apart, then each row / sum(e).
      T* oh = op + ((b * num_queries + first) * heads + h) * head_dim;
      gemm('N', 'N', static_cast<int>(head_dim), rows, static_cast<int>(num_keys), T(1), vh,
           static_cast<int>(vs.row), logits.data(), static_cast<int>(ld), T(0), oh, static_cast<int>(out_ld));
      for (int64_t i = 0; i < rows; ++i) {
        T* o = oh + i * out_ld;
        const T inv = inverse[i];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
      }
    }
  });
}

bool fits_blas(const at::Tensor& t) {
  const int64_t limit = std::numeric_limits<int>::max();
  return t.stride(3) == 1 && t.stride(2) >= t.size(3) && t.stride(2) <= limit && t.size(2) <= limit;
}

}  // namespace

// q [B, H, Nq, D], k and v [B, H, Nk, D] (one floating type; any strides with the last
// dimension contiguous), mask an additive [B, H, Nq, Nk] view of the same type (broadcast
// axes may have stride 0) or None, block_rows queries per task. Returns
// (out [B, Nq, H, D] contiguous, received [B, Nk]).
std::tuple<at::Tensor, at::Tensor> attention_received(const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v, const std::optional<at::Tensor>& mask,
                                                      double scale, int64_t block_rows) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "attention_received runs on the CPU");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k and v must be [B, H, N, D]");
  TORCH_CHECK(q.size(1) * q.size(3) <= std::numeric_limits<int>::max(), "too many heads x features for BLAS");
  const int64_t batch = q.size(0), heads = q.size(1), num_queries = q.size(2), head_dim = q.size(3);
  const int64_t num_keys = k.size(2);
  TORCH_CHECK(k.sizes() == at::IntArrayRef({batch, heads, num_keys, head_dim}), "k must be [B, H, Nk, D] like q");
  TORCH_CHECK(v.sizes() == at::IntArrayRef({batch, heads, num_keys, head_dim}),
              "v must be [B, H, Nk, D] like k (the kernel takes values of the queries' width)");
  TORCH_CHECK(num_queries >= 1 && num_keys >= 1 && head_dim >= 1, "attention needs queries, keys and features");
  TORCH_CHECK(block_rows >= 1, "block_rows must be >= 1");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "q, k and v must share one floating type");
  TORCH_CHECK(fits_blas(q) && fits_blas(k) && fits_blas(v),
              "q, k and v need contiguous rows (last stride 1) that a BLAS product can step through");
  // The logits' rows are padded to 16 numbers; their length must stay a BLAS int.
  TORCH_CHECK(num_keys <= std::numeric_limits<int>::max() - 15, "too many keys for BLAS");
  if (mask.has_value()) {
    TORCH_CHECK(mask->device().is_cpu(), "the mask must be a CPU tensor");
    TORCH_CHECK(mask->sizes() == at::IntArrayRef({batch, heads, num_queries, num_keys}),
                "the mask must be a [B, H, Nq, Nk] view");
    TORCH_CHECK(mask->scalar_type() == q.scalar_type(), "the mask must have q's floating type");
  }
  const int64_t rows = std::min(block_rows, num_queries);
  const int64_t blocks = (num_queries + rows - 1) / rows;
  at::Tensor out = at::empty({batch, num_queries, heads, head_dim}, q.options());
  at::Tensor shares = at::zeros({batch, heads * blocks, num_keys}, q.options());
  const at::Tensor* mask_view = mask.has_value() ? &mask.value() : nullptr;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention_received", [&] {
    run<scalar_t>(q, k, v, mask_view, scale, rows, out, shares);
  });
  return {out, shares.sum(1)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The loops touch no Python object: other Python threads (data loaders) may run meanwhile.
  m.def("attention_received", &attention_received,
        "Attention output and the attention each key received, one (item, head, query block) per task",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
