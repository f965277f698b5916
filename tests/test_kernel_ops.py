"""The C++ kernels as ``torch.library`` custom ops: each passes ``torch.library.opcheck``
(schema, fake implementation, tracing), and one gate (``use_kernel``) decides where they run."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
from torch.utils.flop_counter import FlopCounterMode

from leanformer.ops import attention_native, kmeans_native, kmedoids_native, segment_sum_native
from leanformer.ops.native import KERNELS, MissingKernelWarning, kernel_available, use_kernel
from native_kernels import clustered

FLOAT_TYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64])


def _opcheck(op: torch._ops.OpOverloadPacket, args: tuple[object, ...]) -> None:
    results = torch.library.opcheck(op, args)
    assert all(verdict == "SUCCESS" for verdict in results.values()), results


@FLOAT_TYPES
def test_kmeans_op_passes_opcheck(dtype: torch.dtype) -> None:
    x, w = clustered(2, 12, 3, seed=1, dtype=dtype)
    seeds = w.topk(4, dim=1).indices
    for iters in (0, 3):
        _opcheck(torch.ops.leanformer.kmeans_iterate_cpu, (x, w, seeds, iters))


@FLOAT_TYPES
def test_kmedoids_op_passes_opcheck(dtype: torch.dtype) -> None:
    x, w = clustered(2, 12, 3, seed=2, dtype=dtype)
    medoids = w.topk(4, dim=1).indices
    for pool in (False, True):
        _opcheck(torch.ops.leanformer.kmedoids_iterate_cpu, (x, w, medoids, 3, pool))


@FLOAT_TYPES
def test_segment_sum_op_passes_opcheck(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    values = torch.randn(2, 9, 4, generator=g, dtype=dtype)
    segment = torch.randint(0, 3, (2, 9), generator=g)
    weights = torch.rand(2, 9, generator=g, dtype=dtype)
    _opcheck(torch.ops.leanformer.segment_sum_cpu, (values, segment, 3, weights))


@FLOAT_TYPES
def test_attention_received_op_passes_opcheck(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=dtype) for _ in range(3))
    mask = torch.randn(2, 1, 1, 5, generator=g, dtype=dtype)
    for m in (None, mask):
        _opcheck(torch.ops.leanformer.attention_received_cpu, (q, k, v, m, 0.5))


def test_fake_implementations_trace_without_running_the_kernel(monkeypatch) -> None:
    """``torch.compile(fullgraph=True)`` of a direct call traces the fake: it must not reach
    the extension while tracing (here it is gone), and shapes come out right."""
    x, w = clustered(2, 12, 3, seed=5, dtype=torch.float32)
    seeds = w.topk(4, dim=1).indices
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(KERNELS[kmeans_native.OP], "extension", None)
    monkeypatch.setattr(KERNELS[kmedoids_native.OP], "extension", None)
    with FakeTensorMode() as mode:
        fx, fw, fs = (mode.from_tensor(t) for t in (x, w, seeds))
        assign, centres = torch.ops.leanformer.kmeans_iterate_cpu(fx, fw, fs, 5)
        assert assign.shape == (2, 12) and assign.dtype == torch.int64 and centres.shape == (2, 4, 3)
        assign, medoids, work, pooled = torch.ops.leanformer.kmedoids_iterate_cpu(fx, fw, fs, 5, False)
        assert medoids.shape == (2, 4) and work.shape == (2,) and pooled.shape == (0, 4, 3)


@pytest.mark.parametrize("op", sorted(KERNELS))
def test_every_kernel_is_a_registered_custom_op_with_its_kernel_built(op: str) -> None:
    assert hasattr(torch.ops.leanformer, op)
    assert kernel_available(op), f"the package was built without {KERNELS[op].module}"


def test_the_gate_lets_eager_cpu_inference_through_even_under_a_flop_counter() -> None:
    x = torch.randn(2, 5, 3)
    ids = torch.zeros(2, 5, dtype=torch.int64)
    assert use_kernel(segment_sum_native.OP, x, ids, None)
    assert use_kernel(segment_sum_native.OP, x.double(), ids)
    with torch.no_grad():
        assert use_kernel(segment_sum_native.OP, x.requires_grad_(), ids)
    with FlopCounterMode(display=False):  # the ops register FLOP formulas of their own
        assert use_kernel(segment_sum_native.OP, x.detach(), ids)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")  # forward AD's import
def test_the_gate_refuses_what_the_pytorch_code_must_handle() -> None:
    x = torch.randn(2, 5, 3)
    ids = torch.zeros(2, 5, dtype=torch.int64)
    op = segment_sum_native.OP
    assert not use_kernel(op, x.requires_grad_(), ids)  # a gradient: no kernel has a backward
    x = x.detach()
    assert not use_kernel(op, x.half(), ids)  # not a type the kernels are built for
    assert not use_kernel(op, x, ids.int())
    assert not use_kernel(op, x.to("meta"), ids)  # not on the CPU
    assert not use_kernel(op, x, ids.to("meta"))
    with forward_ad.dual_level():  # a tangent would be dropped
        assert not use_kernel(op, forward_ad.make_dual(x, torch.ones_like(x)), ids)
    seen: list[bool] = []

    def inside_vmap(row: torch.Tensor) -> torch.Tensor:
        seen.append(use_kernel(op, row, ids[0]))
        return row

    torch.vmap(inside_vmap)(x)
    assert seen == [False]

    def traced(t: torch.Tensor) -> torch.Tensor:
        return t + 1 if use_kernel(op, t, ids) else t - 1

    compiled = torch.compile(traced, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), x - 1) and torch.equal(traced(x), x + 1)
    torch._dynamo.reset()


def test_a_missing_kernel_is_refused_with_one_warning_at_the_callers_line(monkeypatch) -> None:
    kernel = KERNELS[attention_native.OP]
    monkeypatch.setattr(kernel, "extension", None)
    monkeypatch.setattr(kernel, "warned", False)
    q = torch.randn(1, 1, 3, 4)
    with pytest.warns(
        MissingKernelWarning, match=r"attention kernel \(leanformer.ops._attention_received_cpu\)"
    ) as got:
        assert not use_kernel(attention_native.OP, q, q, q, None)
    assert got[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not use_kernel(attention_native.OP, q, q, q, None)
        assert not use_kernel(attention_native.OP, q.half())  # refused before the build is asked
    with pytest.raises(RuntimeError, match=r"without its C\+\+ attention kernel"):
        torch.ops.leanformer.attention_received_cpu(q, q, q, None, 1.0)


@FLOAT_TYPES
def test_flop_counters_count_the_kernels_as_their_fallbacks(dtype: torch.dtype, monkeypatch) -> None:
    """Counted through each op's own formula, the kernel gives the fallback's count."""
    from leanformer.bench.flops import flop_counter
    from leanformer.ops.kmeans import kmeans_plan
    from leanformer.ops.received import blocked_attention_received

    x, w = clustered(3, 30, 5, seed=6, dtype=dtype)
    q, k, v = (t.reshape(3, 2, 15, 5) for t in (x, x.flip(1), x.roll(1, 1)))

    def counts() -> tuple[dict[str, int], ...]:
        with flop_counter() as kmeans_counter:
            kmeans_plan(x, 7, weights=w, max_iters=4)
        with torch.no_grad(), flop_counter() as attention_counter:
            blocked_attention_received(q, k, v, mask=None, dropout_p=0.0, scale=0.4)
        return tuple(
            {str(op): n for op, n in c.get_flop_counts()["Global"].items()}
            for c in (kmeans_counter, attention_counter)
        )

    with_kernels = counts()
    assert set(with_kernels[0]) == {"leanformer.kmeans_iterate_cpu"}
    assert set(with_kernels[1]) == {"leanformer.attention_received_cpu"}
    for op in (kmeans_native.OP, attention_native.OP):
        monkeypatch.setattr(KERNELS[op], "extension", None)
        monkeypatch.setattr(KERNELS[op], "warned", True)
    without = counts()
    assert "leanformer.kmeans_iterate_cpu" not in without[0]
    for kernel_counts, fallback_counts in zip(with_kernels, without, strict=True):
        assert sum(kernel_counts.values()) == sum(fallback_counts.values()) > 0
