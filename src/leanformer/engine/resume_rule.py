"""What ``--resume`` may change: one rule, over every config key.

A resumed run must equal an uninterrupted one, so anything that changes what is computed
(data, batch size, seed, model, optimizer, recipe; any key, including keys added later)
must stay as the run saved it. Only the keys of :data:`MAY_CHANGE` may differ, because
they do not change the numbers a run computes.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from leanformer.config import RunConfig, parse_model_options, plain_options, to_dict

# Dotted config keys a resumed run may change, and why each does not alter its result.
MAY_CHANGE: dict[str, str] = {
    "optim.epochs": "extends (or ends) the schedule the run continues",
    "device": "the same computation on other hardware",
    "data.num_workers": "how many processes load the same batches",
    "train.checkpoint": "whether each epoch is also saved",
}


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}``; the entries of free-form option
    mappings are keys of their own too (``data.options.augment``)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):  # an empty mapping has no entries to compare
            flat.update(_flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def _over_defaults(defaults: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` with the keys it lacks taken from ``defaults``, section by section."""
    merged = dict(defaults)
    for key, value in saved.items():
        default = defaults.get(key)
        both_sections = isinstance(value, dict) and isinstance(default, dict)
        merged[key] = _over_defaults(default, value) if both_sections and default else value
    return merged


def resume_differences(
    saved: dict[str, Any],
    config: RunConfig,
    *,
    saved_model_options: dict[str, Any] | None = None,
    model_options: dict[str, Any] | None = None,
    without_effect: Collection[str] = (),
) -> list[str]:
    """``"key saved -> new"`` for every config key on which ``config`` differs from the
    ``saved`` config of the run (a checkpoint's ``meta["config"]``), except :data:`MAY_CHANGE`.

    A key the saved config lacks (a run written before the key existed) counts at its
    default. ``saved_model_options``/``model_options``: the model's options as resolved
    from the data (``num_classes``, ...), compared instead of the configs' own entries.
    ``without_effect``: keys that change nothing in this run (an option of a switch that is
    off; the switch itself is compared), so an old run's ignored value does not block it.
    """
    before = _flatten(_over_defaults(to_dict(RunConfig()), saved))
    after = _flatten(to_dict(config))
    if model_options is not None:
        before = {k: v for k, v in before.items() if not k.startswith("model_options.")}
        after = {k: v for k, v in after.items() if not k.startswith("model_options.")}
        old = plain_options(parse_model_options(dict(saved_model_options or {})))
        before.update(_flatten({"model_options": old}))
        after.update(_flatten({"model_options": plain_options(model_options)}))
    missing = object()
    changed = []
    for key in sorted(before.keys() | after.keys()):
        if key in MAY_CHANGE or key in without_effect:
            continue
        old_value, new_value = before.get(key, missing), after.get(key, missing)
        if not _same(old_value, new_value):
            changed.append(f"{key} {_show(old_value, missing)} -> {_show(new_value, missing)}")
    return changed


def check_resume(
    saved: dict[str, Any],
    config: RunConfig,
    *,
    saved_model_options: dict[str, Any] | None = None,
    model_options: dict[str, Any] | None = None,
    without_effect: Collection[str] = (),
) -> None:
    """Raise ``ValueError`` listing every difference :func:`resume_differences` finds."""
    changed = resume_differences(
        saved,
        config,
        saved_model_options=saved_model_options,
        model_options=model_options,
        without_effect=without_effect,
    )
    if changed:
        allowed = ", ".join(MAY_CHANGE)
        raise ValueError(
            f"resume: a resumed run keeps what it computes, and this would change "
            f"{', '.join(changed)}; only {allowed} may change (train a new run, another --out, instead)"
        )


def _same(old: Any, new: Any) -> bool:
    # YAML and JSON round trips turn tuples into lists and whole floats may come back as ints.
    if isinstance(old, list | tuple) and isinstance(new, list | tuple):
        return len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new, strict=True))
    if isinstance(old, bool) or isinstance(new, bool):
        return old is new
    if isinstance(old, int | float) and isinstance(new, int | float):
        return float(old) == float(new)
    return bool(old == new)


def _show(value: Any, missing: object) -> str:
    return "(absent)" if value is missing else repr(value)
