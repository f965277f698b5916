// Weighted K-Means (Lloyd) iterations on the CPU, one example at a time (Token Pooling,
// eqs. 10-11 / 14-15).
//
// The batched Python plan (leanformer/ops/kmeans.py) runs a dozen small tensor
// operations per iteration, whose fixed cost outweighs the arithmetic at token pooling's
// sizes (tens of tokens per example on small models). Here each task takes one example,
// examples in parallel, with the same algorithm:
//
//   start    the centres are the seed tokens; every token goes to its nearest centre,
//            and each seed to its own cluster (so none starts empty);
//   update   every cluster's centre to the weighted mean of its members; a cluster
//            without weight keeps its centre (standard Lloyd);
//   assign   every token to its nearest centre (the first on ties);
//   stop     when the assignment does not change, or after max_iters updates.
//
// Distances to the centres are one BLAS product per assignment, summed as
// leanformer.ops.token_distances.pairwise_sq_dists sums them: (|c|^2 - 2 x.c) + |x|^2.

// ATen and the pybind11 casters for tensors, not all of <torch/extension.h>: the C++
// frontend it adds (modules, optimizers) is unused here and doubled the build time.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "cpu_kernel.h"

namespace {

template <typename T>
struct Example {
  const T* x;        // [N, C] centred tokens
  const T* sq;       // [N] their squared norms
  const T* w;        // [N] weights
  T* centres;        // [K, C]
  int64_t* assign;   // [N]
  int64_t n, k, c;
};

// Every token's nearest centre, the first on ties -> assign; whether it changed.
// Buffers for finding equal centres: centre j is row centre_index[j] = j of the centres.
struct EqualCentres {
  std::vector<int64_t> centre_index, by_norm, first_equal;
  explicit EqualCentres(int64_t k) : centre_index(k), by_norm(k), first_equal(k) {
    for (int64_t j = 0; j < k; ++j) centre_index[j] = j;
  }
};

template <typename T>
LEANFORMER_VARIANT_BODY bool assign_nearest_body(const Example<T>& e, std::vector<T>& dist,
                                                 std::vector<T>& centre_sq, EqualCentres& equal) {
  const int64_t n = e.n, k = e.k, c = e.c;
  for (int64_t j = 0; j < k; ++j) centre_sq[j] = leanformer_tokens::dot(e.centres + j * c, e.centres + j * c, c);
  for (int64_t i = 0; i < n; ++i) std::copy(centre_sq.begin(), centre_sq.end(), dist.begin() + i * k);
  // Row-major dist [N x K] += -2 x centres^T, as column-major dist^T.
  leanformer_blas::gemm('T', 'N', static_cast<int>(k), static_cast<int>(n), static_cast<int>(c), T(-2), e.centres,
                        static_cast<int>(c), e.x, static_cast<int>(c), T(1), dist.data(), static_cast<int>(k));
  // Equal centres tie, the first winning, only if their distances are equal: each takes
  // the first one's.
  leanformer_tokens::first_equal_rows(e.centres, centre_sq.data(), equal.centre_index.data(), k, c, equal.by_norm,
                                      equal.first_equal);
  for (int64_t j = 0; j < k; ++j) {
    const int64_t t = equal.first_equal[j];
    if (t == j) continue;
    for (int64_t i = 0; i < n; ++i) dist[i * k + j] = dist[i * k + t];
  }
  bool changed = false;
  for (int64_t i = 0; i < n; ++i) {
    const T* row = dist.data() + i * k;
    int64_t best = 0;
    T best_d = std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < k; ++j) {
      T d = row[j] + e.sq[i];
      d = d > T(0) ? d : T(0);
      if (d < best_d) {  // strict: the first centre keeps a tie
        best_d = d;
        best = j;
      }
    }
    changed |= e.assign[i] != best;
    e.assign[i] = best;
  }
  return changed;
}
LEANFORMER_CPU_VARIANTS(assign_nearest)

// Every cluster with weight moves to the weighted mean of its members.
template <typename T>
LEANFORMER_VARIANT_BODY void update_centres_body(const Example<T>& e, std::vector<T>& sums,
                                                 std::vector<T>& total) {
  const int64_t n = e.n, k = e.k, c = e.c;
  std::fill(sums.begin(), sums.end(), T(0));
  std::fill(total.begin(), total.end(), T(0));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = e.assign[i];
    const T wi = e.w[i];
    total[j] += wi;
    T* sj = sums.data() + j * c;
    const T* xi = e.x + i * c;
#pragma omp simd
    for (int64_t d = 0; d < c; ++d) sj[d] += wi * xi[d];
  }
  for (int64_t j = 0; j < k; ++j) {
    if (!(total[j] > T(0))) continue;
    const T* sj = sums.data() + j * c;
    T* cj = e.centres + j * c;
    for (int64_t d = 0; d < c; ++d) cj[d] = sj[d] / total[j];
  }
}
LEANFORMER_CPU_VARIANTS(update_centres)

enum class Fault : int { none = 0, bad_seeds, not_finite };

// A task's buffers, reused by its examples (allocated, and zeroed, once per task).
template <typename T>
struct Workspace {
  std::vector<char> seen;
  std::vector<T> dist, centre_sq, sums, total;
  EqualCentres equal;
  Workspace(int64_t n, int64_t k, int64_t c) : seen(n), dist(n * k), centre_sq(k), sums(k * c), total(k), equal(k) {}
};

template <typename T>
Fault run_example(const Example<T>& e, const int64_t* seeds, int64_t max_iters, Workspace<T>& ws) {
  const int64_t n = e.n, k = e.k, c = e.c;
  std::fill(ws.seen.begin(), ws.seen.end(), 0);
  for (int64_t j = 0; j < k; ++j) {
    const int64_t t = seeds[j];
    if (t < 0 || t >= n || ws.seen[t]) return Fault::bad_seeds;
    ws.seen[t] = 1;
    std::copy(e.x + t * c, e.x + (t + 1) * c, e.centres + j * c);
  }
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(e.sq[i]) || std::isnan(e.w[i])) return Fault::not_finite;
  }
  std::fill(e.assign, e.assign + n, int64_t(-1));
  assign_nearest(e, ws.dist, ws.centre_sq, ws.equal);
  for (int64_t j = 0; j < k; ++j) e.assign[seeds[j]] = j;
  for (int64_t it = 0; it < max_iters; ++it) {
    update_centres(e, ws.sums, ws.total);
    if (!assign_nearest(e, ws.dist, ws.centre_sq, ws.equal)) break;  // a fixed point: later iterations give it again
  }
  return Fault::none;
}

template <typename T>
Fault run_batch(const leanformer_tokens::TokenRows& x, const at::Tensor& w, const at::Tensor& seeds,
                at::Tensor& centres, at::Tensor& assign, int64_t max_iters) {
  const int64_t batch = x.tensor.size(0), n = x.tensor.size(1), c = x.tensor.size(2), k = seeds.size(1);
  const T* xp = x.tensor.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  const int64_t* sp = seeds.data_ptr<int64_t>();
  T* cp = centres.data_ptr<T>();
  int64_t* ap = assign.data_ptr<int64_t>();
  std::atomic<int> fault{static_cast<int>(Fault::none)};
  leanformer_tokens::for_each_centred_example(
      xp, x.batch_stride, batch, n, c, [&] { return Workspace<T>(n, k, c); },
      [&](int64_t b, const T* centred, const T* sq, const T* mean, Workspace<T>& ws) {
        const Example<T> e{centred, sq, wp + b * n, cp + b * k * c, ap + b * n, n, k, c};
        const Fault found = run_example(e, sp + b * k, max_iters, ws);
        if (found != Fault::none) {
          fault.store(static_cast<int>(found));
          return;
        }
        // Back from centred coordinates to the tokens' own.
        T* centres_b = cp + b * k * c;
        for (int64_t j = 0; j < k; ++j) {
          for (int64_t d = 0; d < c; ++d) centres_b[j * c + d] += mean[d];
        }
      });
  return static_cast<Fault>(fault.load());
}

}  // namespace

// x [B, N, C] tokens, weights [B, N] (one floating type), seeds [B, K] int64 distinct seed tokens (K < N). Returns (assign [B, N],
// centres [B, K, C] in the tokens' coordinates); the inputs are not modified.
std::tuple<at::Tensor, at::Tensor> kmeans_iterate(const at::Tensor& x_in, const at::Tensor& weights,
                                                  const at::Tensor& seeds, int64_t max_iters) {
  const auto [batch, n, c, k] = leanformer_tokens::check_clustering_inputs(x_in, weights, seeds, "seeds");
  const leanformer_tokens::TokenRows x = leanformer_tokens::token_rows(x_in);
  const at::Tensor w = weights.resolve_neg().contiguous();
  const at::Tensor s = seeds.contiguous();
  at::Tensor centres = at::empty({batch, k, c}, x_in.options());
  at::Tensor assign = at::empty({batch, n}, seeds.options());
  Fault fault = Fault::none;
  AT_DISPATCH_FLOATING_TYPES(x_in.scalar_type(), "kmeans_iterate", [&] {
    fault = run_batch<scalar_t>(x, w, s, centres, assign, max_iters);
  });
  TORCH_CHECK_VALUE(fault != Fault::bad_seeds, "K-Means: the seeds must be K distinct tokens");
  TORCH_CHECK_VALUE(fault != Fault::not_finite, "K-Means needs finite tokens and weights (got NaN)");
  return {assign, centres};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The loops touch no Python object: other Python threads (data loaders) may run meanwhile.
  m.def("kmeans_iterate", &kmeans_iterate, "Weighted K-Means iterations, one example per task",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
