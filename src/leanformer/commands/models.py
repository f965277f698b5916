"""`leanformer models`: list the registry."""

from __future__ import annotations

import argparse

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
    names = list_models(args.pattern, family=args.family)
    shipped = set(shipped_models())
    if args.pretrained:
        names = [n for n in names if n in shipped]
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
        width = max((len(r["model"]) for r in rows), default=5)
        for r in rows:
            mark = " [pretrained]" if r["pretrained"] else ""
            print(f"{r['model']:<{width}}  {r['family']:<10} {r['description']}{mark}")
        if not rows:
            print("no models match")
    return rows
