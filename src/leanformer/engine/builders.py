"""Build datasets and models from a :class:`RunConfig` (shared by train, eval, bench and demos)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.data import Dataset

from leanformer.config import DataConfig
from leanformer.data.registry import DatasetInfo, build_dataset
from leanformer.models.registry import accepted_options, create_model, model_info


class LimitedDataset(Dataset):
    """The first ``limit`` items of a dataset, keeping its ``info``."""

    def __init__(self, dataset: Dataset, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"dataset limit must be >= 1, got {limit}")
        self.dataset = dataset
        self.limit = min(limit, len(dataset))  # type: ignore[arg-type]
        self.info: DatasetInfo = dataset.info  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return self.limit

    def __getitem__(self, index: int) -> Any:
        if index >= self.limit:
            raise IndexError(index)
        return self.dataset[index]


def dataset_options(data: DataConfig) -> dict[str, Any]:
    options = dict(data.options)
    if data.img_size is not None:
        options["img_size"] = data.img_size
    if data.root is not None:
        options["root"] = data.root
    return options


def build_split(data: DataConfig, split: str, *, evaluation: bool = False) -> Dataset:
    """The ``split`` of ``data``; ``evaluation``: without training-time augmentation, so
    evaluating a run trained with it on its training images reads the images themselves,
    the same every time."""
    options = dataset_options(data)
    if evaluation and options.get("augment"):
        options["augment"] = False
    dataset = build_dataset(data.name, split=split, **options)
    limit = data.limit_train if split == "train" else data.limit_test
    return dataset if limit is None else LimitedDataset(dataset, limit)


def check_data_fits(model_cls: type[nn.Module], info: DatasetInfo, *, name: str | None = None) -> None:
    """A clear error when the data gives a different number of inputs per example than the
    model takes (a pair dataset for a single-image model, or the other way round)."""
    task = getattr(model_cls, "task", "classification")  # a detector says "detection"
    if task != info.task:
        hint = (
            "segmenters such as segvit_fashion go with fashion_detect's semantic masks, "
            "data.options.target: semantic"
            if "semantic" in (task, info.task)
            else "detectors such as detr_fashion go with fashion_detect"
        )
        raise ValueError(
            f"{name or model_cls.__name__} is a {task} model, but the dataset's targets are for "
            f"{info.task} ({hint})"
        )
    takes = getattr(model_cls, "NUM_INPUTS", 1)
    if takes != info.inputs:
        what = {1: "one image", 2: "a pair of inputs"}
        raise ValueError(
            f"{name or model_cls.__name__} takes {what.get(takes, takes)} per example, but the dataset "
            f"gives {what.get(info.inputs, info.inputs)} (pair datasets such as digits_pairs are for "
            "the relation models drt_*/drrt_*)"
        )


def check_model_fits(model: nn.Module, info: DatasetInfo) -> None:
    """:func:`check_data_fits` for a built model (a checkpoint's, say), its image channels
    and its class scores: a clear error instead of the first convolution's shape error or
    a target out of range partway through."""
    name = getattr(model, "leanformer_name", None)
    check_data_fits(type(model), info, name=name)
    takes = getattr(model, "in_chans", None)
    if isinstance(takes, int) and info.in_chans is not None and takes != info.in_chans:
        raise ValueError(
            f"{name or type(model).__name__} takes images of {takes} channel(s), but the data gives "
            f"{info.in_chans} (a checkpoint keeps the channels it was trained on)"
        )
    scores = getattr(model, "num_classes", None)
    if isinstance(scores, int) and info.num_classes is not None and scores < info.num_classes:
        # A target past the last score would fail mid-evaluation in the loss or a gather.
        raise ValueError(
            f"{name or type(model).__name__} gives {scores} class scores, but the data has "
            f"{info.num_classes} classes (a checkpoint keeps the classes it was trained on)"
        )


def model_options_for_data(name: str, options: dict[str, Any], info: DatasetInfo | None) -> dict[str, Any]:
    """Fill ``num_classes``/``in_chans``/``img_size`` from the data where the model takes them."""
    resolved = dict(options)
    if info is None:
        return resolved
    entry = model_info(name)
    check_data_fits(entry.cls, info, name=name)
    accepted = accepted_options(entry.cls) or set()
    for key, value in (
        ("num_classes", info.num_classes),
        ("in_chans", info.in_chans),
        ("img_size", info.img_size),
    ):
        if value is not None and key in accepted and key not in resolved:
            resolved[key] = value
    return resolved


def build_model(
    name: str, options: dict[str, Any], info: DatasetInfo | None = None, *, pretrained: bool = False
) -> tuple[nn.Module, dict]:
    """``(model, resolved_options)``; the resolved options rebuild the same model later.

    ``pretrained`` loads the weights shipped with the package (see ``models/pretrained.py``).
    """
    resolved = model_options_for_data(name, options, info)
    return create_model(name, pretrained=pretrained, **resolved), resolved
