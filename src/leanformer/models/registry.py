"""Model registry: a variant is an entry (class + defaults), not a copied class.

``register(name, cls, family=..., **defaults)`` records an entry;
``create_model(name, **overrides)`` builds it, rejecting unknown names or options
with a ``ValueError`` that names the close matches.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import inspect
import pkgutil
from dataclasses import dataclass, field
from typing import Any

from torch import nn

import leanformer.models as pkg
from leanformer.memory_budget import check_model_budget
from leanformer.models.pretrained import load_pretrained, model_card
from leanformer.pooling.state import resolve_gflops_budget


@dataclass(frozen=True)
class ModelEntry:
    name: str
    cls: type[nn.Module]
    family: str
    defaults: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    tiny: bool = False  # a small preset for fast tests


_REGISTRY: dict[str, ModelEntry] = {}
_LOADED = False


def register(
    name: str,
    cls: type[nn.Module],
    *,
    family: str,
    description: str = "",
    tiny: bool = False,
    **defaults: Any,
) -> ModelEntry:
    """Record ``name`` as ``cls(**defaults)``; duplicate names are an error."""
    _check_entry(name, cls, family)
    # The built-in models first: a user's name that takes one of theirs is refused here,
    # not by the next create_model, whose loading would then fail for every model.
    _load_builtin_models()
    if name in _REGISTRY:
        raise ValueError(f"model {name!r} is registered twice")
    _check_options(name, cls, defaults)
    entry = ModelEntry(name, cls, family, dict(defaults), description, tiny)
    _REGISTRY[name] = entry
    return entry


def register_model(
    name: str, *, family: str = "custom", description: str = "", tiny: bool = False, **defaults: Any
):
    """Decorator form of :func:`register` for a user's own ``nn.Module`` class."""
    if isinstance(name, type):  # @register_model without a name
        raise TypeError(f'register_model needs a name: @register_model("my_model") above {name.__name__}')

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        register(name, cls, family=family, description=description, tiny=tiny, **defaults)
        return cls

    return wrap


def _check_entry(name: Any, cls: Any, family: Any) -> None:
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"a model name must be a non-empty string, got {name!r}")
    # A class, or a factory function that returns a module.
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)) and not inspect.isfunction(cls):
        raise TypeError(f"model {name!r}: register an nn.Module subclass or a function, got {cls!r}")
    if not isinstance(family, str) or not family:
        raise TypeError(f"model {name!r}: family must be a non-empty string, got {family!r}")


def _load_builtin_models() -> None:
    # Every module in leanformer.models registers its family on import.
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name != "registry" and not info.name.startswith("_"):
            importlib.import_module(f"{pkg.__name__}.{info.name}")


def _init_params(cls: type[nn.Module]) -> dict[str, inspect.Parameter] | None:
    """The constructor's named parameters, or None if it takes ``**kwargs`` (anything)."""
    params = dict(inspect.signature(cls.__init__).parameters)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None  # accepts anything; the class validates itself
    params.pop("self", None)
    return params


def accepted_options(cls: type[nn.Module]) -> set[str] | None:
    params = _init_params(cls)
    return None if params is None else set(params)


def _check_options(name: str, cls: type[nn.Module], options: dict[str, Any]) -> None:
    params = _init_params(cls)
    if params is None:
        return
    accepted = set(params)
    for key in options:
        if key not in accepted:
            close = difflib.get_close_matches(key, sorted(accepted), n=3)
            hint = (
                f"; did you mean {', '.join(close)}?"
                if close
                else f"; options are {', '.join(sorted(accepted))}"
            )
            raise ValueError(f"model {name!r} has no option {key!r}{hint}")
    # A yes/no option given a word ("maybe") would otherwise count as True.
    for key, value in options.items():
        param = params[key]
        if isinstance(param.default, bool) and not isinstance(value, bool):
            raise ValueError(f"model {name!r}: option {key} must be true or false, got {value!r}")
        if _is_optional_bool(param) and not isinstance(value, bool | None):
            raise ValueError(f"model {name!r}: option {key} must be true, false or null, got {value!r}")


def _is_optional_bool(param: inspect.Parameter) -> bool:
    """A ``bool | None`` option (None: derived from another option), e.g. DRRT's map_recurrence."""
    annotation = param.annotation
    if isinstance(annotation, str):  # postponed annotations (`from __future__ import annotations`)
        return annotation.replace(" ", "") in ("bool|None", "None|bool", "Optional[bool]")
    return annotation == bool | None


def model_info(name: str) -> ModelEntry:
    """The registry entry for ``name`` (raises ``ValueError`` with close matches)."""
    _load_builtin_models()
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, sorted(_REGISTRY), n=5, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else "; run `leanformer models` for the list"
        raise ValueError(f"unknown model {name!r}{hint}") from None


def create_model(name: str, *, pretrained: bool = False, **overrides: Any) -> nn.Module:
    """Build registered model ``name``; ``overrides`` replace its defaults.

    ``pretrained=True`` loads the weights shipped with the package (checked against
    their SHA-256); a model without shipped weights raises a ValueError.
    """
    if not isinstance(name, str):
        raise TypeError(f"create_model takes a model name (a str, see list_models()), got {name!r}")
    # Only a real bool: `pretrained="no"` would be truthy and load the weights.
    if not isinstance(pretrained, bool):
        raise TypeError(f"pretrained must be True or False, got {pretrained!r}")
    entry = model_info(name)
    _check_options(name, entry.cls, overrides)
    if pretrained:
        model_card(name)  # fail before building when nothing is shipped
    options = {**entry.defaults, **overrides}
    check_model_budget(name, entry.cls, options)  # before a size the machine cannot hold is built
    model = entry.cls(**options)
    model.leanformer_name = name  # type: ignore[assignment]
    if pretrained:
        load_pretrained(model, name)
        resolve_gflops_budget(model)  # a GFLOPs fraction, solved again on these weights
    return model


def list_models(
    pattern: str | None = None, *, family: str | None = None, tiny: bool | None = None
) -> list[str]:
    """Sorted registered names, optionally filtered by a glob ``pattern``, family or tiny flag."""
    _load_builtin_models()
    names = sorted(_REGISTRY)
    if pattern is not None:
        names = [n for n in names if fnmatch.fnmatch(n, pattern)]
    if family is not None:
        names = [n for n in names if _REGISTRY[n].family == family]
    if tiny is not None:
        names = [n for n in names if _REGISTRY[n].tiny == tiny]
    return names
