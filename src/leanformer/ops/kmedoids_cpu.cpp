// Weighted K-Medoids iterations on the CPU, one example at a time (Token Pooling, Alg. 1).
//
// The batched Python plan (leanformer/ops/kmedoids.py) runs about a hundred small
// tensor operations per iteration; at the sizes token pooling meets (tens to hundreds
// of tokens per example) their fixed cost outweighs the arithmetic. Here an iteration
// is a few plain loops per example, examples in parallel, with the same algorithm:
//
//   assign   every token to its nearest medoid (the first in medoid order on ties;
//            a medoid to its own cluster);
//   update   every cluster's medoid to the member nearest the cluster's weighted mean,
//            which minimises the weighted sum of squared distances to the members
//            (eq. 17 weighted); the lowest index on ties;
//   stop     at the fixed point, or after max_iters updates.
//
// Distances are kept as a table between the K medoids and the M = N - K other tokens,
// dist[j][m] from medoid j to token others[m] (a medoid is in its own cluster, so the
// assignment needs no more), made for the initial medoids by one BLAS product, as
// leanformer/ops/medoid_distances.py makes it, and kept current here: when medoid j
// moves from token o to token t, t's column goes to o, and row j and that column are
// recomputed.
//
// On request the example's clusters are then pooled (their weighted means, as
// leanformer.ops.cluster_plan.cluster_mean makes them) while its tokens are still in the
// core's cache, which saves a later pass over the whole batch.

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

using leanformer_tokens::dot;

// Squared distance between medoid token a and token b, at least 0, summed in the order
// of the caller's product (leanformer.ops.token_distances.pairwise_sq_dists):
// (|x_b|^2 - 2 x_a.x_b) + |x_a|^2.
template <typename T>
LEANFORMER_VARIANT_BODY T sq_dist(const T* x, const T* sq, int64_t a, int64_t b, int64_t c) {
  const T d = (sq[b] - T(2) * dot(x + a * c, x + b * c, c)) + sq[a];
  return d > T(0) ? d : T(0);
}

template <typename T>
struct Example {
  const T* x;   // [N, C] centred tokens
  const T* sq;  // [N] their squared norms
  const T* w;   // [N] weights
  T* dist;            // [K, M] distances from every medoid to the other tokens
  int64_t* medoids;   // [K]
  int64_t* others;    // [M] the tokens that are not medoids
  int64_t* assign;    // [N]
  int64_t* work;      // distances computed (a count, for the FLOP counters)
  int64_t n, k, m, c;
};

// What a task found wrong with its example; reported after the parallel loop.
enum class Fault : int { none = 0, not_a_partition, not_finite };

template <typename T>
LEANFORMER_VARIANT_BODY void assign_nearest_body(const Example<T>& e, std::vector<T>& best,
                                                 std::vector<int32_t>& nearest) {
  std::fill(nearest.begin(), nearest.end(), 0);
  std::copy(e.dist, e.dist + e.m, best.begin());
  T* best_d = best.data();
  int32_t* near = nearest.data();
  for (int64_t j = 1; j < e.k; ++j) {
    const T* row = e.dist + j * e.m;
    const int32_t jj = static_cast<int32_t>(j);
    // Selects, not branches, and 32-bit indices beside 32-bit floats: the loop vectorises.
#pragma omp simd
    for (int64_t i = 0; i < e.m; ++i) {
      const bool nearer = row[i] < best_d[i];  // strict: the first medoid keeps a tie
      best_d[i] = nearer ? row[i] : best_d[i];
      near[i] = nearer ? jj : near[i];
    }
  }
  for (int64_t i = 0; i < e.m; ++i) e.assign[e.others[i]] = nearest[i];
  for (int64_t j = 0; j < e.k; ++j) e.assign[e.medoids[j]] = j;
}
LEANFORMER_CPU_VARIANTS(assign_nearest)

// Medoid j moved: recompute its row.
template <typename T>
LEANFORMER_VARIANT_BODY void recompute_row_body(const Example<T>& e, int64_t j) {
  T* row = e.dist + j * e.m;
  for (int64_t i = 0; i < e.m; ++i) row[i] = sq_dist(e.x, e.sq, e.medoids[j], e.others[i], e.c);
  *e.work += e.m;
}
LEANFORMER_CPU_VARIANTS(recompute_row)

// Column i now holds another token: recompute it.
template <typename T>
LEANFORMER_VARIANT_BODY void recompute_column_body(const Example<T>& e, int64_t i) {
  for (int64_t j = 0; j < e.k; ++j) e.dist[j * e.m + i] = sq_dist(e.x, e.sq, e.medoids[j], e.others[i], e.c);
  *e.work += e.k;
}
LEANFORMER_CPU_VARIANTS(recompute_column)

// The member of every cluster nearest its weighted mean -> new_medoids [K]. Members are
// ranked by |x_i|^2 - 2 x_i.mean (the distance to the mean less a constant of the cluster).
template <typename T>
LEANFORMER_VARIANT_BODY void medoids_from_means_body(const Example<T>& e, std::vector<T>& means,
                                                     std::vector<T>& total, std::vector<int64_t>& members,
                                                     std::vector<T>& best_score, std::vector<int64_t>& new_medoids) {
  const int64_t n = e.n, c = e.c;
  std::fill(total.begin(), total.end(), T(0));
  std::fill(members.begin(), members.end(), 0);
  for (int64_t i = 0; i < n; ++i) {
    total[e.assign[i]] += e.w[i];
    members[e.assign[i]] += 1;
  }
  std::fill(means.begin(), means.end(), T(0));
  const T tiny = std::numeric_limits<T>::min();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = e.assign[i];
    const T coef = e.w[i] / std::max(total[j], tiny);
    T* mean = means.data() + j * c;
    const T* xi = e.x + i * c;
#pragma omp simd
    for (int64_t d = 0; d < c; ++d) mean[d] += coef * xi[d];
  }
  std::fill(best_score.begin(), best_score.end(), std::numeric_limits<T>::infinity());
  std::fill(new_medoids.begin(), new_medoids.end(), n);
  // Members in index order: the first member of each cluster keeps it when no score is
  // below +inf (norms that overflow), as the batched code's minimum does.
  for (int64_t i = n - 1; i >= 0; --i) new_medoids[e.assign[i]] = i;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = e.assign[i];
    // Exact ties that the rounding of the mean would break at random score alike: the
    // two members of a two-token cluster of equal weights (each costs the other's
    // distance), and every member of a cluster of weight 0.
    const bool tied = (members[j] == 2 && total[j] - e.w[i] == e.w[i]) || total[j] == T(0);
    const T score = tied ? T(0) : e.sq[i] - T(2) * dot(e.x + i * c, means.data() + j * c, c);
    if (score < best_score[j]) {  // tokens in index order: the lowest index keeps a tie
      best_score[j] = score;
      new_medoids[j] = i;
    }
  }
}
LEANFORMER_CPU_VARIANTS(medoids_from_means)

// The tokens that are not medoids, in token order, into e.others, and column_of every
// token (-1 for a medoid); not_a_partition unless the medoids are K distinct tokens.
// not_finite when a norm or a weight is NaN (a NaN token gives a NaN norm).
template <typename T>
Fault find_others(const Example<T>& e, std::vector<int64_t>& column_of) {
  std::fill(column_of.begin(), column_of.end(), -2);
  for (int64_t j = 0; j < e.k; ++j) {
    const int64_t t = e.medoids[j];
    if (t < 0 || t >= e.n || column_of[t] != -2) return Fault::not_a_partition;
    column_of[t] = -1;
  }
  int64_t i = 0;
  for (int64_t t = 0; t < e.n; ++t) {
    if (column_of[t] == -1) continue;
    e.others[i] = t;
    column_of[t] = i++;
  }
  for (int64_t t = 0; t < e.n; ++t) {
    if (std::isnan(e.sq[t]) || std::isnan(e.w[t])) return Fault::not_finite;
  }
  return Fault::none;
}

// The initial table, as pairwise_sq_dists (leanformer/ops/token_distances.py) makes it:
// the others' squared norms, minus twice the dot products in one product (beta = 1),
// plus the medoids' squared norms, at least 0.
template <typename T>
void initial_table(const Example<T>& e, std::vector<T>& medoid_rows, std::vector<T>& other_rows) {
  const int64_t c = e.c;
  for (int64_t j = 0; j < e.k; ++j) std::copy(e.x + e.medoids[j] * c, e.x + (e.medoids[j] + 1) * c, medoid_rows.data() + j * c);
  for (int64_t i = 0; i < e.m; ++i) std::copy(e.x + e.others[i] * c, e.x + (e.others[i] + 1) * c, other_rows.data() + i * c);
  for (int64_t j = 0; j < e.k; ++j) {
    for (int64_t i = 0; i < e.m; ++i) e.dist[j * e.m + i] = e.sq[e.others[i]];
  }
  // Row-major dist [K x M] += -2 medoid_rows other_rows^T, as column-major dist^T.
  leanformer_blas::gemm('T', 'N', static_cast<int>(e.m), static_cast<int>(e.k), static_cast<int>(c), T(-2),
                        other_rows.data(), static_cast<int>(c), medoid_rows.data(), static_cast<int>(c), T(1),
                        e.dist, static_cast<int>(e.m));
  for (int64_t j = 0; j < e.k; ++j) {
    const T norm = e.sq[e.medoids[j]];
    T* row = e.dist + j * e.m;
    for (int64_t i = 0; i < e.m; ++i) {
      const T d = row[i] + norm;
      row[i] = d > T(0) ? d : T(0);
    }
  }
  *e.work += e.k * e.m;
}

// A task's buffers, reused by its examples (allocated, and zeroed, once per task).
template <typename T>
struct Workspace {
  std::vector<T> best, means, total, best_score, medoid_rows, other_rows;
  std::vector<int32_t> nearest;
  std::vector<int64_t> members, new_medoids, column_of, moved, columns, by_norm, first_equal, unmoved_at;
  std::vector<char> is_moved;
  leanformer_tokens::PoolBuffers<T> pool;
  Workspace(int64_t n, int64_t k, int64_t c)
      : best(n - k), means(k * c), total(k), best_score(k), medoid_rows(k * c), other_rows((n - k) * c),
        nearest(n - k), members(k), new_medoids(k), column_of(n), by_norm(k), first_equal(k), unmoved_at(k), is_moved(k),
        pool(n, k) {}
};

template <typename T>
Fault run_example(const Example<T>& e, int64_t max_iters, Workspace<T>& ws) {
  const Fault fault = find_others(e, ws.column_of);
  if (fault != Fault::none) return fault;
  initial_table(e, ws.medoid_rows, ws.other_rows);
  // Medoids at one point tie, the first in medoid order winning, only if their rows are
  // equal: each takes the first one's.
  leanformer_tokens::first_equal_rows(e.x, e.sq, e.medoids, e.k, e.c, ws.by_norm, ws.first_equal);
  for (int64_t j = 0; j < e.k; ++j) {
    const int64_t t = ws.first_equal[j];
    if (t != j) std::copy(e.dist + t * e.m, e.dist + (t + 1) * e.m, e.dist + j * e.m);
  }
  assign_nearest(e, ws.best, ws.nearest);
  for (int64_t it = 0; it < max_iters; ++it) {
    medoids_from_means(e, ws.means, ws.total, ws.members, ws.best_score, ws.new_medoids);
    ws.moved.clear();
    ws.columns.clear();
    std::fill(ws.is_moved.begin(), ws.is_moved.end(), 0);
    for (int64_t j = 0; j < e.k; ++j) {
      const int64_t old = e.medoids[j], now = ws.new_medoids[j];
      if (now == old) continue;
      // The new medoid is a member of cluster j, so it was one of the other tokens; the
      // old medoid takes its column.
      const int64_t i = ws.column_of[now];
      if (i < 0) return Fault::not_a_partition;  // cannot happen: a member is not a medoid
      e.others[i] = old;
      ws.column_of[old] = i;
      ws.column_of[now] = -1;
      e.medoids[j] = now;
      ws.moved.push_back(j);
      ws.is_moved[j] = 1;
      ws.columns.push_back(i);
    }
    if (ws.moved.empty()) return Fault::none;  // a fixed point: later iterations would give it again
    // Medoids at one point keep equal rows (as at the start, found the same way): a moved
    // medoid takes the row of the first unmoved one at its point, which a recomputed row
    // would not round alike; only a medoid with none has its row recomputed.
    leanformer_tokens::first_equal_rows(e.x, e.sq, e.medoids, e.k, e.c, ws.by_norm, ws.first_equal);
    std::fill(ws.unmoved_at.begin(), ws.unmoved_at.end(), int64_t(-1));
    for (int64_t t = e.k - 1; t >= 0; --t) {
      if (!ws.is_moved[t]) ws.unmoved_at[ws.first_equal[t]] = t;
    }
    for (const int64_t j : ws.moved) {
      const int64_t twin = ws.unmoved_at[ws.first_equal[j]];
      if (twin < 0) {
        recompute_row(e, j);
      } else {
        std::copy(e.dist + twin * e.m, e.dist + (twin + 1) * e.m, e.dist + j * e.m);
      }
    }
    for (const int64_t i : ws.columns) recompute_column(e, i);
    assign_nearest(e, ws.best, ws.nearest);
  }
  return Fault::none;
}

template <typename T>
Fault run_batch(const leanformer_tokens::TokenRows& x, const at::Tensor& w, at::Tensor& dist, at::Tensor& medoids,
                at::Tensor& others, at::Tensor& assign, at::Tensor& work, bool pool, at::Tensor& pooled,
                int64_t max_iters) {
  const int64_t batch = x.tensor.size(0), n = x.tensor.size(1), c = x.tensor.size(2), k = medoids.size(1), m = n - k;
  const T* xp = x.tensor.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* dp = dist.data_ptr<T>();
  int64_t* mp = medoids.data_ptr<int64_t>();
  int64_t* op = others.data_ptr<int64_t>();
  int64_t* ap = assign.data_ptr<int64_t>();
  int64_t* wk = work.data_ptr<int64_t>();
  T* pp = pool ? pooled.data_ptr<T>() : nullptr;
  std::atomic<int> fault{static_cast<int>(Fault::none)};
  leanformer_tokens::for_each_centred_example(
      xp, x.batch_stride, batch, n, c, [&] { return Workspace<T>(n, k, c); },
      [&](int64_t b, const T* centred, const T* sq, const T*, Workspace<T>& ws) {
        const Example<T> e{centred, sq, wp + b * n, dp + b * k * m, mp + b * k, op + b * m, ap + b * n, wk + b,
                           n, k, m, c};
        const Fault found = run_example(e, max_iters, ws);
        if (found != Fault::none) {
          fault.store(static_cast<int>(found));
        } else if (pp != nullptr) {
          // The example's tokens are still in this core's cache: pool them now rather than
          // in another pass over the batch.
          leanformer_tokens::pool_clusters(xp + b * x.batch_stride, e.w, e.assign, n, c, k, pp + b * k * c, ws.pool);
        }
      });
  return static_cast<Fault>(fault.load());
}

}  // namespace

// x [B, N, C] tokens, weights [B, N] (one floating type), medoids [B, K] int64 distinct
// initial medoids (K < N). Returns (assign [B, N], medoids [B, K], work [B]: how many
// distances each example computed, pooled): with `pool`, pooled [B, K, C] holds every
// cluster's weighted mean of the tokens (leanformer_tokens::pool_clusters), else it is
// empty. The inputs are not modified.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kmedoids_iterate(const at::Tensor& x_in,
                                                                            const at::Tensor& weights,
                                                                            const at::Tensor& medoids,
                                                                            int64_t max_iters, bool pool) {
  const auto [batch, n, c, k] = leanformer_tokens::check_clustering_inputs(x_in, weights, medoids, "medoids");
  const leanformer_tokens::TokenRows x = leanformer_tokens::token_rows(x_in);
  const at::Tensor w = weights.resolve_neg().contiguous();
  at::Tensor table = at::empty({batch, k, n - k}, x_in.options());
  at::Tensor new_medoids = medoids.clone(at::MemoryFormat::Contiguous);
  at::Tensor others = at::empty({batch, n - k}, medoids.options());
  at::Tensor assign = at::empty({batch, n}, medoids.options());
  at::Tensor work = at::zeros({batch}, medoids.options());
  at::Tensor pooled = at::empty({pool ? batch : 0, k, c}, x_in.options());
  Fault fault = Fault::none;
  AT_DISPATCH_FLOATING_TYPES(x_in.scalar_type(), "kmedoids_iterate", [&] {
    fault = run_batch<scalar_t>(x, w, table, new_medoids, others, assign, work, pool, pooled, max_iters);
  });
  TORCH_CHECK_VALUE(fault != Fault::not_a_partition, "K-Medoids: the initial medoids must be K distinct tokens");
  TORCH_CHECK_VALUE(fault != Fault::not_finite, "K-Medoids needs finite tokens and weights (got NaN)");
  return {assign, new_medoids, work, pooled};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The loops touch no Python object: other Python threads (data loaders) may run meanwhile.
  m.def("kmedoids_iterate", &kmedoids_iterate, "Weighted K-Medoids iterations, one example per task",
        pybind11::arg("x"), pybind11::arg("weights"), pybind11::arg("medoids"), pybind11::arg("max_iters"),
        pybind11::arg("pool") = false, pybind11::call_guard<pybind11::gil_scoped_release>());
}
