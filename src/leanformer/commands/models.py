"""`leanformer models`: list the registry."""

from __future__ import annotations

import argparse
import difflib

from leanformer.models.pretrained import shipped_models
from leanformer.models.registry import list_models, model_info

COMMAND = ("models",)
HELP = "list registered models"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pattern", nargs="?", help="glob filter, e.g. 'deit_*'")
    parser.add_argument("--family", help="only this family (deit, sret, perceiver, detr, drrt, ...)")
    parser.add_argument(
        "--pretrained", action="store_true", help="only models whose weights ship with leanformer"
    )


def run(args: argparse.Namespace) -> list[dict]:
    if args.family is not None:
        families = sorted({model_info(name).family for name in list_models()})
        if args.family not in families:
            close = difflib.get_close_matches(args.family, families, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ValueError(f"unknown family {args.family!r}; {hint}families: {', '.join(families)}")
    shipped = set(shipped_models())
    names = _filtered(args, shipped, args.pattern)
    pattern = args.pattern
    if not names and pattern is not None and not _is_glob(pattern) and pattern not in list_models():
        # A plain name that names no model is a typo, not an empty listing.
        raise ValueError(f"unknown model {pattern!r}{_near_names(pattern, _filtered(args, shipped, None))}")
    rows = []
    for name in names:
        entry = model_info(name)
        rows.append(
            {
                "model": name,
                "family": entry.family,
                "tiny": entry.tiny,
                "pretrained": name in shipped,
                "description": entry.description,
            }
        )
    if not args.json:
        width = max((len(str(r["model"])) for r in rows), default=5)
        for r in rows:
            mark = " [pretrained]" if r["pretrained"] else ""
            print(f"{r['model']:<{width}}  {r['family']:<10} {r['description']}{mark}")
        if not rows:
            print(f"no models match{_near_names(args.pattern, _filtered(args, shipped, None))}")
    return rows


def _filtered(args: argparse.Namespace, shipped: set[str], pattern: str | None) -> list[str]:
    """The names ``pattern`` and the filters (``--family``, ``--pretrained``) leave."""
    names = list_models(pattern, family=args.family)
    return [n for n in names if n in shipped] if args.pretrained else names


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _near_names(pattern: str | None, candidates: list[str]) -> str:
    """Why a plain name (no glob characters) matched nothing: it is outside the filters, or
    ``"; did you mean ...?"`` with the close names among ``candidates``."""
    if pattern is None or _is_glob(pattern):
        return ""
    if pattern in list_models():
        return f" ({pattern} is a model, but not one the --family/--pretrained filters keep)"
    close = difflib.get_close_matches(pattern, candidates, n=3, cutoff=0.6)
    return f"; did you mean {', '.join(close)}?" if close else ""
