"""Registry behaviour and contract tests over every registered model."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest
import torch

import leanformer
from leanformer.bench.report import example_inputs
from leanformer.models.registry import model_info

ALL_MODELS = leanformer.list_models()
TINY = leanformer.list_models(tiny=True)
FULL = [name for name in ALL_MODELS if name not in TINY]


def test_every_family_has_a_tiny_preset() -> None:
    families = {model_info(n).family for n in ALL_MODELS}
    tiny_families = {model_info(n).family for n in TINY}
    assert families == tiny_families


def test_unknown_model_names_close_matches() -> None:
    with pytest.raises(ValueError, match="did you mean deit_tiny"):
        leanformer.create_model("deit_tinyy")


def test_unknown_option_names_close_matches() -> None:
    with pytest.raises(ValueError, match="embed_dim"):
        leanformer.create_model("deit_test", embed_dimm=3)


def test_list_models_pattern() -> None:
    assert leanformer.list_models("deit_s*") == sorted(n for n in ALL_MODELS if n.startswith("deit_s"))
    assert leanformer.list_models("no_such_*") == []


def test_duplicate_registration_rejected() -> None:
    from leanformer.models.deit import DeiT
    from leanformer.models.registry import register

    with pytest.raises(ValueError, match="twice"):
        register("deit_test", DeiT, family="deit")


def test_a_users_built_in_name_is_refused_before_the_registry_loads() -> None:
    """In a fresh process the user's entry came first, and the next create_model failed to
    load the built-in models (every one of them) with "registered twice"."""
    import subprocess
    import sys

    script = """
from torch import nn
from leanformer import create_model, list_models, register_model
try:
    register_model("deit_test")(nn.Identity)
except ValueError as err:
    print(err)
create_model("deit_small")
print(len(list_models()))
"""

    def run(code: str) -> list[str]:
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.splitlines()

    built_in = run("from leanformer import list_models; print(len(list_models()))")
    assert run(script) == ["model 'deit_test' is registered twice", *built_in]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: leanformer.register_model(5)(torch.nn.Identity), "a model name must be a non-empty string"),
        (
            lambda: leanformer.register_model(" ")(torch.nn.Identity),
            "a model name must be a non-empty string",
        ),
        (
            lambda: leanformer.register_model("_test_dict")(dict),
            "register an nn.Module subclass or a function",
        ),
        (lambda: leanformer.register_model(torch.nn.Identity), "register_model needs a name"),
    ],
)
def test_register_model_checks_its_arguments(call, message: str) -> None:
    count = len(leanformer.list_models())
    with pytest.raises(TypeError, match=message):
        call()
    assert len(leanformer.list_models()) == count


def _contract(name: str, batch: int, max_img_size: int | None = None) -> None:
    torch.manual_seed(0)
    options = {}
    default_size = model_info(name).defaults.get("img_size")
    if max_img_size is not None and isinstance(default_size, int) and default_size > max_img_size:
        # The same layers on a smaller input: every parameter is still exercised, at a fraction of the cost.
        options["img_size"] = max_img_size
    model = leanformer.create_model(name, **options)
    if getattr(model, "task", "classification") == "detection":
        _detection_contract(name, model, batch)
        return
    if getattr(model, "task", "classification") == "semantic":
        _segmentation_contract(name, model, batch)
        return
    for method in ("forward_features", "forward_head", "reset_classifier"):
        assert callable(getattr(model, method, None)), f"{name} lacks {method}"
    model.train()
    inputs = example_inputs(model, batch)
    logits = model(*inputs)
    num_classes = model.num_classes
    assert logits.shape == (batch, num_classes)
    assert torch.isfinite(logits).all()
    logits.float().square().mean().backward()
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None)]
    assert not no_grad, f"{name}: parameters without gradient: {no_grad[:5]}"
    nonfinite = [
        n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()
    ]
    assert not nonfinite, f"{name}: non-finite gradients in {nonfinite[:5]}"
    model.reset_classifier(3)
    model.eval()
    with torch.no_grad():
        assert model(*inputs).shape == (batch, 3)
    with pytest.raises(ValueError, match="num_classes must be"):
        model.reset_classifier(-1)
    assert model.num_classes == 3  # a refused reset leaves the model as it was
    with torch.no_grad():
        assert model(*inputs).shape == (batch, 3)


def _segmentation_contract(name: str, model: torch.nn.Module, batch: int) -> None:
    """A segmenter: logits for every class at every pixel, every parameter trained, a new head."""
    model.train()
    (images,) = example_inputs(model, batch)
    logits = model(images)
    assert logits.shape == (batch, model.num_classes, *images.shape[-2:])
    logits.square().mean().backward()
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None)]
    assert not no_grad, f"{name}: parameters without gradient: {no_grad[:5]}"
    model.reset_classifier(3)
    with torch.no_grad():
        assert model.eval()(images).shape == (batch, 3, *images.shape[-2:])


def _detection_contract(name: str, model: torch.nn.Module, batch: int) -> None:
    """A detector: its loss on a target per image trains every parameter; ``predict`` gives
    boxes, scores and labels per image."""
    model.train()
    (images,) = example_inputs(model, batch)
    size = images.shape[-1]
    box = torch.tensor([[0.1, 0.2, 0.6, 0.7]]) * size
    targets = [{"boxes": box, "labels": torch.tensor([i % model.num_classes])} for i in range(batch)]
    loss = model(images, targets).loss
    assert torch.isfinite(loss)
    loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None)]
    assert not no_grad, f"{name}: parameters without gradient: {no_grad[:5]}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    predictions = model.eval().predict(images)
    assert len(predictions) == batch
    for p in predictions:
        assert p["boxes"].shape == (len(p["scores"]), 4) and p["labels"].shape == p["scores"].shape
        assert ((p["labels"] >= 0) & (p["labels"] < model.num_classes)).all()


@pytest.mark.parametrize("name", TINY)
def test_contract_tiny(name: str) -> None:
    _contract(name, batch=2)


@pytest.mark.parametrize("name", TINY)
def test_negative_class_count_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="num_classes must be"):
        leanformer.create_model(name, num_classes=-2)


def _integer_options(name: str) -> list[tuple[str, str, Any]]:
    """``(option, annotation, default)`` for every constructor option typed with ``int``."""
    entry = model_info(name)
    params = inspect.signature(entry.cls.__init__).parameters
    return [
        (key, str(p.annotation), entry.defaults.get(key, p.default))
        for key, p in params.items()
        if re.search(r"\bint\b", str(p.annotation))
    ]


def _bad_values(key: str, annotation: str, default: Any) -> list[tuple[Any, str]]:
    """Wrongly typed or out-of-range values for an integer option, and the name its error must give."""
    if annotation.startswith("Sequence[Sequence[int]]"):  # e.g. SReT's groups per stage and pass
        first = list(default[0])
        return [([[*first[:-1], v], *default[1:]], f"{key}[0][{len(first) - 1}]") for v in (1.5, -1, "x")]
    if annotation.startswith("Sequence[int]"):  # one size per stage
        return [("abc", key)] + [([*default[:-1], v], f"{key}[{len(default) - 1}]") for v in (1.5, -1, "x")]
    return [(v, key) for v in ("abc", 1.5, -1, [2, 3, 4])]


@pytest.mark.parametrize("name", TINY)
def test_every_integer_option_is_checked(name: str) -> None:
    """Every integer option of every family refuses a word, a float and a negative with a
    ``ValueError`` naming it (the CLI's exit code 2), never an error from inside torch."""
    options = _integer_options(name)
    assert options
    for key, annotation, default in options:
        for bad, named in _bad_values(key, annotation, default):
            with pytest.raises(ValueError, match=re.escape(named)):
                leanformer.create_model(name, **{key: bad})


@pytest.mark.parametrize("name", ["drrt_test"])
def test_optional_yes_no_options_refuse_words(name: str) -> None:
    with pytest.raises(ValueError, match="option map_recurrence must be true, false or null, got 'maybe'"):
        leanformer.create_model(name, map_recurrence="maybe")
    assert leanformer.create_model(name, map_recurrence=None).map_recurrence is True


@pytest.mark.slow
@pytest.mark.parametrize("name", FULL)
def test_contract_full_size(name: str) -> None:
    _contract(name, batch=1, max_img_size=64)


def test_a_factory_function_registers() -> None:
    from leanformer.models.registry import _REGISTRY

    def factory(width: int = 3) -> torch.nn.Module:
        return torch.nn.Linear(2, width)

    leanformer.register_model("_test_factory")(factory)
    try:
        assert leanformer.create_model("_test_factory", width=5).out_features == 5
    finally:
        del _REGISTRY["_test_factory"]
