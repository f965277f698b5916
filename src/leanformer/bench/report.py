"""One measurement row for a model: parameters, GFLOPs, throughput, peak memory."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from leanformer.bench.compiled import compile_for_inference
from leanformer.bench.flops import count_gflops
from leanformer.bench.memory import peak_memory_mb
from leanformer.bench.throughput import measure_throughput


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def input_channels(model: nn.Module) -> int:
    """``model.in_chans``, else the input channels of its first convolution, else 3."""
    chans = getattr(model, "in_chans", None)
    if isinstance(chans, int):
        return chans
    first_conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    return first_conv.in_channels if first_conv is not None else 3


def example_inputs(
    model: nn.Module,
    batch_size: int,
    *,
    img_size: int | None = None,
    feature_size: tuple[int, int] | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[Any, ...]:
    """The model's own ``example_inputs`` if it has one, else a random image batch."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    torch.manual_seed(seed)
    make = getattr(model, "example_inputs", None)
    if callable(make):
        inputs = make(batch_size, img_size=img_size, feature_size=feature_size)
    else:
        if feature_size is not None:
            raise ValueError(f"{type(model).__name__} takes images, not feature maps: use --img-size")
        size: Any = img_size or getattr(model, "img_size", 224)  # an int or (h, w)
        h, w = (size, size) if isinstance(size, int) else size
        inputs = (torch.randn(batch_size, input_channels(model), h, w),)
    return tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)


def bench_model(
    model: nn.Module,
    inputs: tuple[Any, ...],
    *,
    forward_kwargs: dict[str, Any] | None = None,
    warmup: int = 3,
    runs: int = 10,
    memory: bool = True,
    compile: bool = False,
    progress: bool = False,
    computing_before: bool = False,
) -> dict[str, Any]:
    """Params (M), GFLOPs/sample (multiply-adds), img/s, ms/batch, peak memory (MB), extras.
    ``progress``: a bar over the timed runs. ``computing_before``: the process was busy just
    before (e.g. training), so its own load is not read as other work's.

    ``compile``: time (and measure the memory of) ``torch.compile(model, fullgraph=True)``;
    ``compile_s`` is the first call's duration, left out of the steady-state timings
    (None when not compiled). FLOPs are counted on the eager model. Compiled on the CPU,
    ``peak_mem_mb`` is None: the profiler that measures CPU memory does not see the
    buffers the compiled code allocates (it measured a few bytes for a whole DeiT).
    """
    model.eval()
    kwargs = forward_kwargs or {}
    row: dict[str, Any] = {
        "params_m": count_params(model) / 1e6,
        "gflops": count_gflops(model, inputs, forward_kwargs=kwargs),
        "compile_s": None,
    }
    if compile:
        model, row["compile_s"] = compile_for_inference(model, inputs, forward_kwargs=kwargs)
    row.update(
        measure_throughput(
            model,
            inputs,
            forward_kwargs=kwargs,
            warmup=warmup,
            runs=runs,
            progress=progress,
            computing_before=computing_before,
        )
    )
    if memory:
        device = inputs[0].device if isinstance(inputs[0], torch.Tensor) else torch.device("cpu")

        def forward() -> None:
            with torch.inference_mode():
                model(*inputs, **kwargs)

        unseen = compile and device.type == "cpu"  # see the docstring
        row["peak_mem_mb"] = None if unseen else peak_memory_mb(forward, device=device)
    extras = getattr(model, "bench_extras", None)
    if callable(extras):
        row.update(extras())
    return row


def trained_model_row(
    model: nn.Module, top1: float, *, device: str | torch.device = "cpu", batch_size: int = 64
) -> dict[str, Any]:
    """A trained classifier's row in the demo tables: top-1, params (M), GFLOPs, img/s, threads.

    img/s is measured in eval mode at ``batch_size`` on random inputs of the model's shape.
    """
    inputs = example_inputs(model, batch_size, device=device)
    stats = bench_model(model, inputs, memory=False, computing_before=True)  # timed right after training
    kept = ("params_m", "gflops", "img_per_s", "threads", "spread_pct", "busy", "unreliable")
    return {"top1": top1, **{key: stats[key] for key in kept}}
