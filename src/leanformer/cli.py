"""`leanformer ...`: parse arguments, hand them to a command module; no tensor math here.

Bad input exits with code 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from leanformer import __version__
from leanformer.allocator import configure_allocator
from leanformer.commands import add_common_arguments, discover
from leanformer.device import check_device
from leanformer.errors import NonFiniteLossError, UnverifiedCheckpointWarning
from leanformer.pooling.budgets import KeepSchedule


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help that names each option's default value, unless its text already does or the
    default is "not given" (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default in (None, False, argparse.SUPPRESS)
            or default == []
            or not action.option_strings
        ):
            return action.help
        return f"{text} (default: %(default)s)".strip()


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)
        # group -> (its default command's name, all its command names); set by build_parser
        self.default_commands: dict[str, tuple[str, frozenset[str]]] = {}

    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse's usage block is noise for one wrong flag: one line, exit 2.
        self.exit(2, f"{self.prog}: error: {message}\n")


def _default_of(modules: list[ModuleType]) -> ModuleType | None:
    # Only a group that names a default (demo) runs something when called bare.
    marked = [m for m in modules if getattr(m, "DEFAULT", False)]
    return marked[0] if marked else None


def build_parser() -> _Parser:
    parser = _Parser(
        prog="leanformer", description="Token reduction for transformers, measured side by side."
    )
    parser.add_argument("--version", action="version", version=f"leanformer {__version__}")
    top = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    groups: dict[str, list[ModuleType]] = {}
    for module in discover():
        path = module.COMMAND
        if len(path) == 1:
            sub = top.add_parser(path[0], help=module.HELP, description=module.HELP)
            add_common_arguments(sub)
            module.add_arguments(sub)
            sub.set_defaults(_module=module)
        else:
            groups.setdefault(path[0], []).append(module)
    for group, modules in groups.items():
        default = _default_of(modules)
        if default is not None:
            parser.default_commands[group] = (default.COMMAND[1], frozenset(m.COMMAND[1] for m in modules))
        names = ", ".join(m.COMMAND[1] for m in modules)
        gparser = top.add_parser(group, help=f"{group} ({names})", description=f"{group}: {names}")
        add_common_arguments(gparser)
        gparser.set_defaults(_module=default, _group=group, _group_parser=gparser)
        gsub = gparser.add_subparsers(dest="name", metavar="NAME", parser_class=_Parser)
        for module in modules:
            sub = gsub.add_parser(module.COMMAND[1], help=module.HELP, description=module.HELP)
            add_common_arguments(sub, inherit=True)
            module.add_arguments(sub)
            sub.set_defaults(_module=module)
    return parser


def _jsonable(value: Any) -> Any:
    if isinstance(value, KeepSchedule):
        return value.to_value()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def _show_warning(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
    """leanformer's own warnings as one line, like its errors; others as Python shows them."""
    if issubclass(category, UnverifiedCheckpointWarning):
        print(f"leanformer: warning: {message}", file=sys.stderr)
    else:
        _python_show_warning(message, category, *args, **kwargs)


_python_show_warning = warnings.showwarning


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__


def _file_in_the_way(filename: object) -> str | None:
    """The nearest existing ancestor of ``filename`` (itself included) if it is a file."""
    if not isinstance(filename, str | os.PathLike):
        return None
    path = Path(filename)
    for candidate in (path, *path.parents):
        if candidate.exists():
            return str(candidate) if candidate.is_file() else None
    return None


def main(argv: list[str] | None = None) -> int:
    configure_allocator()  # before any large tensor: timings must not depend on the shell
    with warnings.catch_warnings():  # restores Python's own display when the command ends
        warnings.showwarning = _show_warning
        return _run_command(argv)


def with_default_command(parser: _Parser, words: list[str]) -> list[str]:
    """``leanformer demo [options]`` is ``leanformer demo tokenpool [options]``: a group that
    names a default runs it, with every option typed, unless a command is named or help is
    asked for (``leanformer demo --help`` lists the group's commands)."""
    if not words or words[0] not in parser.default_commands:
        return words
    default, names = parser.default_commands[words[0]]
    rest = set(words[1:])
    if rest & names or rest & {"-h", "--help"}:
        return words
    return [words[0], default, *words[1:]]


def _run_command(argv: list[str] | None) -> int:
    parser = build_parser()
    words = with_default_command(parser, list(sys.argv[1:] if argv is None else argv))
    args, extra = parser.parse_known_args(words)
    module: ModuleType | None = getattr(args, "_module", None)
    if module is None:
        getattr(args, "_group_parser", parser).print_help()
        return 2
    if extra and not getattr(module, "ACCEPTS_OVERRIDES", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    # Which common options were typed: a config file's seed/device wins over their defaults.
    args.given_options = {w.split("=", 1)[0] for w in words if w.startswith("--")}
    try:
        if args.threads is not None:
            if not 1 <= args.threads <= 1024:
                raise ValueError(f"--threads must be in [1, 1024], got {args.threads}")
            torch.set_num_threads(args.threads)
        check_device(args.device)  # every command has the common --device option
        results = module.run(args)
    except KeyboardInterrupt:
        print("leanformer: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _reader_gone()
    except (FileExistsError, NotADirectoryError) as exc:
        # Usually mkdir meeting a file where a folder (--out, or one of its parents) must be.
        blocker = _file_in_the_way(exc.filename)
        link = _broken_link_on(exc.filename)
        if link:
            where = (
                f"{link} is a symbolic link that leads to no folder (a loop or a missing target); "
                "give another path"
            )
        elif blocker:
            where = f"{blocker} is a file, but a folder is needed there (check --out and other paths)"
        else:
            where = _first_line(exc)
        print(f"leanformer: error: {where}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            link = _broken_link_on(exc.filename) or exc.filename
            print(
                f"leanformer: error: {link} is a symbolic link that loops; give another path", file=sys.stderr
            )
            return 2
        if exc.errno != errno.ENOSPC or os.environ.get("LEANFORMER_TRACEBACK"):
            return _unexpected(exc)
        # Writes go to a temporary file renamed into place: the file named keeps its last
        # complete version (a run folder its last good checkpoint, for --resume).
        print(
            f"leanformer: error: no space left on the device writing {exc.filename}; it keeps its last "
            "complete version (a run keeps its last good checkpoint: free space, then --resume)",
            file=sys.stderr,
        )
        return 1
    except (ValueError, FileNotFoundError) as exc:
        print(f"leanformer: error: {_first_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:
        if isinstance(exc, NonFiniteLossError):
            print(f"leanformer: {exc}", file=sys.stderr)
            return 1
        return _unexpected(exc)
    if args.json:
        try:
            for row in results or []:
                print(json.dumps(_jsonable(row)), flush=True)
        except BrokenPipeError:
            return _reader_gone()
    return 0


def _unexpected(exc: BaseException) -> int:
    """Anything else (torch, PIL, the file system) in one line, with the exception type,
    rather than as a traceback; LEANFORMER_TRACEBACK=1 shows it."""
    if os.environ.get("LEANFORMER_TRACEBACK"):
        raise exc
    print(
        f"leanformer: error: {type(exc).__name__}: {_first_line(exc)} "
        "(set LEANFORMER_TRACEBACK=1 for the traceback)",
        file=sys.stderr,
    )
    return 1


def _broken_link_on(filename: object) -> str | None:
    """The first symbolic link on the way to ``filename`` (itself included) that leads
    nowhere: a loop, or a target that does not exist."""
    if not isinstance(filename, str | os.PathLike):
        return None
    path = Path(filename)
    for candidate in (*reversed(path.parents), path):
        if candidate.is_symlink() and not candidate.exists():
            return str(candidate)
    return None


def _reader_gone() -> int:
    """stdout's reader closed early (``leanformer ... | head``): stop quietly, as a
    program killed by SIGPIPE would (exit 141), instead of a traceback."""
    try:
        # Python flushes stdout again at exit; point it at /dev/null so that cannot fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        pass  # stdout is not a real file (e.g. captured): nothing will flush to the pipe
    return 141


if __name__ == "__main__":
    raise SystemExit(main())
