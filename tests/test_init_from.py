"""``train.init_from`` (``--init-from``): a run that starts from trained weights (fine-tuning).

The weights a run starts from are those of the source (checked through a run whose
learning rate is too small to move them), and a source that is missing, has no shipped
weights, or holds another architecture is refused by name before any training.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leanformer.config import load_config
from leanformer.engine.checkpoint import load_model
from leanformer.engine.train import fit

DATA = {"data.limit_train": 32, "data.batch_size": 16, "data.limit_test": 32, "optim.epochs": 1}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("source")
    fit(load_config(None, {"model": "deit_test", **DATA, "optim.lr": 0.01}), out_dir=out, progress=False)
    return out


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_model(run).state_dict()


def test_a_run_starts_from_the_weights_it_is_given(trained: Path, tmp_path: Path) -> None:
    still = {"model": "deit_test", **DATA, "optim.lr": 1e-12, "optim.min_lr": 0.0, "optim.weight_decay": 0.0}
    fit(
        load_config(None, {**still, "train.init_from": str(trained)}), out_dir=tmp_path / "ft", progress=False
    )
    fit(load_config(None, still), out_dir=tmp_path / "fresh", progress=False)
    source, tuned, fresh = _weights(trained), _weights(tmp_path / "ft"), _weights(tmp_path / "fresh")
    for key, value in source.items():
        torch.testing.assert_close(tuned[key], value, rtol=0, atol=1e-6)
    assert any((fresh[k] - v).abs().max() > 1e-3 for k, v in source.items())  # training moved them


def test_bad_sources_are_refused_by_name(trained: Path) -> None:
    def run(source: str, **options: object) -> None:
        fit(
            load_config(None, {"model": "deit_test", **DATA, "train.init_from": source, **options}),
            progress=False,
        )

    with pytest.raises(ValueError, match="init_from runs/nowhere: no such checkpoint file or run folder"):
        run("runs/nowhere")
    with pytest.raises(ValueError, match="init_from deit_test: a model given by name needs shipped weights"):
        run("deit_test")
    with pytest.raises(ValueError, match="its weights do not fit deit_test with these options"):
        run(str(trained), **{"model_options": {"embed_dim": 16}})
