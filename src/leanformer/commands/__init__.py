"""CLI subcommands, one module each; discovered on start-up.

Each module defines::

    COMMAND: tuple[str, ...]   # ("bench",) or ("demo", "perceiver") or ("visualize", "enact")
    HELP: str                  # one line for --help
    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> list[dict] | None: ...

``run`` prints its human-readable output itself unless ``args.json`` is set; the
results it returns are printed as one JSON object per line when ``--json`` is given.
Every parser gets the common options (``--json``, ``--quiet``, ``--device``,
``--seed``, ``--threads``) from :func:`add_common_arguments`. Bad input is reported by
raising ``ValueError`` with a message for the user; the CLI prints it on one line and
exits with code 2.

Groups with several subcommands (``demo``, ``visualize``) may name a default with a
module-level ``DEFAULT = True`` (used when the group is called without a name).

A command parses, calls the library or an application in :mod:`leanformer.apps`, and
prints; tensor code goes to ``apps``. Every command module is imported to build the
parser, so what only ``run`` needs (training, sweeps, matplotlib) is imported inside
``run``: ``--help`` and a usage error stay quick. Helpers shared by several commands are
private modules (``_options``, ``_hosts``, ``_perceiver``, ``_hf_detr``); no command
imports another.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from types import ModuleType


def add_common_arguments(parser: argparse.ArgumentParser, *, inherit: bool = False) -> None:
    """The options every command takes.

    ``inherit``: for a command inside a group (``visualize enact``), options not given
    after the command name keep the value given after the group name
    (``leanformer visualize --json enact``) instead of being reset to their defaults.
    """
    from leanformer.commands._options import argument_type
    from leanformer.config import seed_argument

    def default(value: object) -> object:
        return argparse.SUPPRESS if inherit else value

    parser.add_argument(
        "--json",
        action="store_true",
        default=default(False),
        help="print one JSON object per result on stdout",
    )
    parser.add_argument(
        "--quiet", action="store_true", default=default(False), help="no progress bars or chatter"
    )
    parser.add_argument("--device", default=default("cpu"), help="torch device (default: cpu)")
    parser.add_argument(
        "--seed",
        type=argument_type(seed_argument),
        default=default(0),
        help="random seed, an integer from 0 to 2^32 - 1 (default: 0)",
    )
    parser.add_argument(
        "--threads", type=int, default=default(None), help="torch intra-op threads (default: torch's)"
    )


def given(args: argparse.Namespace, option: str) -> bool:
    """Whether ``option`` (e.g. ``"--seed"``) was typed on the command line, not defaulted."""
    return option in getattr(args, "given_options", ())


def discover() -> list[ModuleType]:
    """All command modules in this package, sorted by their command path."""
    import leanformer.commands as pkg

    modules = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        if hasattr(mod, "COMMAND"):
            modules.append(mod)
    return sorted(modules, key=lambda m: m.COMMAND)
