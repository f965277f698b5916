// Weighted sums of the token segments on the CPU, one example per task: the pooled
// tokens of every merge and clustering reducer in eager inference.
//
// The PyTorch version (leanformer/ops/segment_sum.py) sorts the rows by segment and sums
// them with embedding_bag, which keeps it differentiable, in about a dozen tensor
// operations whose fixed cost dominates at the sizes small models meet. For inference
// this is one call, each example's rows summed segment by segment in row order: the
// same sums in the same order.

// ATen and the pybind11 casters for tensors, not all of <torch/extension.h>: the C++
// frontend it adds (modules, optimizers) is unused here and doubled the build time.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "cpu_kernel.h"

// x [B, N, C] rows, segment [B, N] int64 ids in [0, S), weights [B, N] (the rows' floating
// type). Returns [B, S, C]; an empty segment sums to 0. The inputs are not modified.
at::Tensor segment_sum(const at::Tensor& x_in, const at::Tensor& segment, int64_t segments,
                       const at::Tensor& weights) {
  TORCH_CHECK(x_in.device().is_cpu() && weights.device().is_cpu() && segment.device().is_cpu(),
              "the C++ segment sum runs on the CPU: rows, segments and weights must all be CPU tensors");
  TORCH_CHECK(x_in.dim() == 3, "rows must be [B, N, C]");
  const int64_t batch = x_in.size(0), n = x_in.size(1), c = x_in.size(2);
  TORCH_CHECK(segments >= 0, "the number of segments cannot be negative");
  TORCH_CHECK(segment.sizes() == at::IntArrayRef({batch, n}), "segments must be [B, N]");
  TORCH_CHECK(weights.sizes() == at::IntArrayRef({batch, n}), "weights must be [B, N]");
  TORCH_CHECK(segment.scalar_type() == at::kLong, "segments must be int64");
  TORCH_CHECK(weights.scalar_type() == x_in.scalar_type(), "rows and weights must share one floating type");
  const leanformer_tokens::TokenRows x = leanformer_tokens::token_rows(x_in);
  const at::Tensor w = weights.resolve_neg().contiguous(), s = segment.contiguous();
  at::Tensor out = at::empty({batch, segments, c}, x_in.options());
  std::atomic<bool> in_range{true};
  AT_DISPATCH_FLOATING_TYPES(x_in.scalar_type(), "segment_sum", [&] {
    const scalar_t* xp = x.tensor.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    const int64_t* sp = s.data_ptr<int64_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      std::vector<int64_t> start(segments + 1), next(segments), order(n);
      for (int64_t b = begin; b < end; ++b) {
        if (!leanformer_tokens::sum_segments(xp + b * x.batch_stride, wp + b * n, sp + b * n, n, c, segments, op + b * segments * c,
                          start, next, order)) {
          in_range.store(false);
        }
      }
    });
  });
  TORCH_CHECK_VALUE(in_range.load(), "segment ids must lie in [0, S) with S = ", segments);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The loop touches no Python object: other Python threads (data loaders) may run meanwhile.
  m.def("segment_sum", &segment_sum, "Weighted segment sums, one example per task",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
