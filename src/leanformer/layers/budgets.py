"""Token budgets: how many tokens each block may keep, parsed once into a :class:`KeepSchedule`.

``keep=`` (Python), ``--keep`` (command line), ``keep:`` (YAML) and
``model.token_pooling.keep = ...`` (run time) all go through :func:`parse_keep`, which
accepts

- a list of per-block budgets ``[K_1, ..., K_L]``. An **int** is a token count: block l
  keeps at most ``K_l`` tokens (the class token is not counted and always kept), so
  ``1`` keeps one token. ``K_l`` is a *maximum*: block l keeps
  ``min(K_l, tokens it receives)``, so a schedule may go up again (the paper's DeiT-e252
  level 7 does) without effect. A **float** is a keep ratio in (0, 1]: ``1.0`` keeps every
  token. Ints and floats may be mixed (``[196, 0.5, 0.5]``);
- one keep ratio (a float in (0, 1]): every block keeps ``round(r * tokens it receives)``.
  A bare int is refused: one count for every block is almost always a typo for a ratio;
- ToMe's form ``{"r": r}`` (``"r16"`` as a string): every block removes ``r`` tokens, at
  most half of those it receives (ToMe's bipartite matching cannot remove more);
- a named preset from the paper's appendix G (tables 3-5): ``deit_s_level0`` ...
  ``deit_s_level7``, ``deit_e318_level0`` ... ``deit_e318_level7``, ``deit_e252_level0``
  ... ``deit_e252_level7`` (224x224 images, patch 16: 196 tokens, 12 blocks).

Strings spell the same values as on the command line: ``"0.7"``, ``"12,8,4"``,
``"0.5,0.5"``, ``"[0.5, 0.5]"``, ``"r16"``, ``"deit_s_level3"``; a number with a ``.`` or an
exponent is a ratio, one without is a count.
"""

from __future__ import annotations

import difflib
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from leanformer.strict_yaml import safe_load_strict

# Keep schedules copied from the Token Pooling paper, appendix G: the maximal number of
# tokens (class token excluded) retained after each of the 12 transformer blocks.
# DeiT-S level 0 is printed with 13 entries, ending in seven 173s for a 12-block model
# (an extraction duplicate); all trailing entries are 173, so dropping one is exact.
PRESETS: dict[str, tuple[int, ...]] = {
    # Table 3: DeiT-S.
    "deit_s_level0": (196, 196, 195, 194, 189, 180, 173, 173, 173, 173, 173, 173),
    "deit_s_level1": (196, 195, 193, 188, 169, 140, 121, 110, 73, 38, 7, 0),
    "deit_s_level2": (196, 195, 190, 177, 141, 108, 84, 69, 35, 18, 3, 0),
    "deit_s_level3": (196, 194, 187, 163, 118, 85, 58, 47, 20, 12, 2, 0),
    "deit_s_level4": (196, 193, 179, 142, 97, 64, 46, 34, 13, 9, 1, 0),
    "deit_s_level5": (194, 183, 142, 89, 41, 20, 10, 7, 0, 0, 0, 0),
    "deit_s_level6": (186, 162, 102, 56, 13, 4, 2, 2, 0, 0, 0, 0),
    "deit_s_level7": (162, 129, 66, 33, 4, 1, 1, 0, 0, 0, 0, 0),
    # Table 4: DeiT-e318.
    "deit_e318_level0": (196, 196, 196, 194, 192, 184, 181, 181, 170, 170, 170, 170),
    "deit_e318_level1": (196, 195, 195, 190, 171, 147, 132, 122, 66, 43, 15, 0),
    "deit_e318_level2": (196, 195, 193, 180, 143, 109, 92, 77, 40, 21, 4, 0),
    "deit_e318_level3": (196, 195, 190, 165, 119, 84, 65, 50, 26, 14, 3, 0),
    "deit_e318_level4": (196, 194, 184, 149, 97, 65, 47, 33, 12, 9, 2, 0),
    "deit_e318_level5": (196, 186, 153, 93, 40, 15, 12, 9, 0, 0, 0, 0),
    "deit_e318_level6": (193, 173, 109, 52, 16, 4, 4, 4, 0, 0, 0, 0),
    "deit_e318_level7": (183, 145, 80, 33, 5, 1, 1, 2, 0, 0, 0, 0),
    # Table 5: DeiT-e252.
    "deit_e252_level0": (196, 196, 196, 195, 193, 189, 177, 177, 177, 177, 177, 177),
    "deit_e252_level1": (196, 196, 195, 189, 176, 161, 123, 122, 76, 48, 17, 0),
    "deit_e252_level2": (196, 196, 193, 179, 154, 123, 88, 79, 39, 22, 5, 0),
    "deit_e252_level3": (196, 195, 188, 167, 131, 96, 63, 52, 13, 11, 2, 0),
    "deit_e252_level4": (196, 194, 181, 147, 111, 75, 48, 36, 5, 7, 2, 0),
    "deit_e252_level5": (196, 187, 129, 88, 54, 20, 10, 10, 0, 1, 0, 0),
    "deit_e252_level6": (194, 163, 83, 44, 22, 6, 1, 3, 0, 0, 0, 0),
    "deit_e252_level7": (188, 122, 58, 28, 12, 2, 0, 2, 0, 0, 0, 0),
}

TokenCount = int  # the most tokens a block keeps (0 drops every patch token)
KeepRatio = float  # the fraction of the tokens a block receives that it keeps, in (0, 1]
Budget = TokenCount | KeepRatio  # one block's budget: the Python type tells which


@dataclass(frozen=True, eq=False, repr=False)
class KeepSchedule:
    """A parsed token budget: exactly one of ``blocks``, ``ratio`` and ``remove`` is set.

    Build it with :func:`parse_keep`; :meth:`per_block` turns it into one budget per block
    of a given host. ``str()`` gives the command-line spelling and :meth:`to_value` a plain
    value for YAML/JSON; both parse back to an equal schedule.
    """

    blocks: tuple[Budget, ...] | None = None  # one per block: int = token count, float = ratio
    ratio: KeepRatio | None = None  # the same ratio in every block, whatever the depth
    remove: TokenCount | None = None  # ToMe's r: tokens removed per block
    preset: str | None = field(default=None, compare=False)  # the appendix-G table `blocks` is

    def __post_init__(self) -> None:
        if sum(v is not None for v in (self.blocks, self.ratio, self.remove)) != 1:
            raise ValueError("a KeepSchedule holds exactly one of blocks, ratio and remove")

    def _key(self) -> tuple[Any, ...]:
        # Python finds 1 == 1.0, but a count of one token is not a ratio that keeps them all.
        blocks = None if self.blocks is None else tuple((type(v), v) for v in self.blocks)
        return (blocks, self.ratio, self.remove)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeepSchedule) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def per_block(self, *, depth: int, num_tokens: int | None = None) -> list[Budget]:
        """One budget per block of a ``depth``-block host whose first block receives
        ``num_tokens`` patch tokens (needed by ToMe's form only)."""
        if self.ratio is not None:
            return [self.ratio] * depth
        if self.remove is not None:
            if num_tokens is None:
                raise ValueError(f"keep={self}: ToMe's form needs the host's token count")
            counts: list[Budget] = []
            n = num_tokens
            for _ in range(depth):
                n -= min(self.remove, n // 2)
                counts.append(n)
            return counts
        assert self.blocks is not None
        if len(self.blocks) != depth:
            raise ValueError(
                f"keep schedule has {len(self.blocks)} entries but the model has {depth} blocks (keep={self})"
            )
        return list(self.blocks)

    def to_value(self) -> str | float | list[Budget]:
        """The plain value (preset name, ratio, list, ``"r16"``) that parses back to this."""
        if self.preset is not None:
            return self.preset
        if self.ratio is not None:
            return self.ratio
        if self.remove is not None:
            return f"r{self.remove}"
        return list(self.blocks or ())

    def __repr__(self) -> str:
        return f"parse_keep({self.to_value()!r})"

    def __str__(self) -> str:
        value = self.to_value()
        if isinstance(value, list):
            return ",".join(_spell(v) for v in value)
        return value if isinstance(value, str) else _spell(value)

    def label(self) -> str:
        """A short name for tables and plots: the preset name, ``r0.7`` for a ratio,
        ``64-48-32`` for per-block budgets, ``16/block`` for ToMe's r.

        Not a spelling that parses back (``r0.7`` would read as ToMe's form): use ``str()``
        for that. Trade-off results are keyed by these names, so they must not change.
        """
        if self.preset is not None:
            return self.preset
        if self.ratio is not None:
            return f"r{self.ratio:g}"
        if self.remove is not None:
            return f"{self.remove}/block"
        return "-".join(f"{v:g}" if isinstance(v, float) else str(v) for v in self.blocks or ())


KeepLike = KeepSchedule | str | float | Sequence[Budget] | Mapping[str, int]

KEEP_HELP = (
    "token budget: a keep ratio (float in (0, 1], 1.0 keeps all), per-block counts (ints: "
    "12,8,4) or ratios (0.5,0.5), ToMe's r16, or a preset (deit_s_level3)"
)


def _spell(budget: Budget) -> str:
    # repr keeps the '.' of a ratio (1.0, not 1), so a spelled ratio never reads back as a count.
    return repr(float(budget)) if isinstance(budget, float) else str(budget)


def list_presets() -> list[str]:
    """Names of the built-in keep schedules."""
    return sorted(PRESETS)


def parse_keep(keep: Any) -> KeepSchedule:
    """The one parser of token budgets: any accepted spelling -> a validated :class:`KeepSchedule`.

    Raises ``ValueError`` naming the offending entry (block) for a bad budget.
    """
    if isinstance(keep, KeepSchedule):
        return keep
    if keep is None:
        raise ValueError(f"a pooling method needs keep= ({KEEP_HELP})")
    if isinstance(keep, str):
        return _parse_text(keep)
    if isinstance(keep, bool):
        raise ValueError(f"keep must be a ratio, a list, ToMe's r or a preset name, got {keep!r}")
    if isinstance(keep, numbers.Integral):
        raise ValueError(
            f"keep={keep}: an int is a token count and needs one per block (e.g. [{keep}, {keep}, ...]); "
            f"for a ratio write a float in (0, 1] (1.0 keeps every token)"
        )
    if isinstance(keep, numbers.Real):
        return KeepSchedule(ratio=_ratio(float(keep), "keep"))
    if isinstance(keep, Mapping):
        return _remove_per_block(keep)
    if isinstance(keep, Sequence):
        if not keep:
            raise ValueError("keep=[]: a per-block list needs one entry per block")
        return KeepSchedule(blocks=tuple(_block_budget(v, i) for i, v in enumerate(keep)))
    raise ValueError(f"keep must be a ratio, a list, ToMe's r or a preset name, got {type(keep).__name__}")


def _ratio(value: float, where: str) -> KeepRatio:
    if not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"{where}: a keep ratio (float) must be in (0, 1], got {value}")
    return value


def _block_budget(value: Any, block: int) -> Budget:
    where = f"keep[{block}] (block {block})"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{where}: expected an int token count or a float ratio, got {value!r}")
    if isinstance(value, numbers.Integral):
        if value < 0:
            raise ValueError(f"{where}: a token count (int) must be >= 0, got {value}")
        return int(value)
    return _ratio(float(value), where)


def _remove_per_block(keep: Mapping[str, Any]) -> KeepSchedule:
    """ToMe's ``{"r": r}``: block l keeps ``n_l - min(r, n_l // 2)`` of the ``n_l`` it receives."""
    if set(keep) != {"r"}:
        raise ValueError(
            f"keep must be a ratio, a list, a preset name or {{'r': tokens removed per block}}, got {keep!r}"
        )
    r = keep["r"]
    if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 0:
        raise ValueError(f"keep={{'r': ...}} needs a token count (int) >= 0, got {r!r}")
    return KeepSchedule(remove=int(r))


_COUNT = re.compile(r"[+-]?\d+")


def _parse_number(text: str) -> Budget:
    """``"12"`` -> 12 (a count); ``"0.5"``, ``"1.0"``, ``"5e-1"`` -> a float ratio."""
    return int(text) if _COUNT.fullmatch(text) else float(text)


def _parse_text(text: str) -> KeepSchedule:
    name = text.strip()
    if name in PRESETS:
        return KeepSchedule(blocks=PRESETS[name], preset=name)
    if name[:1] in "rR" and name[1:].isdigit():
        return KeepSchedule(remove=int(name[1:]))
    if name[:1] in "rR" and re.fullmatch(r"[+-]?[0-9.eE+-]+", name[1:]):
        # ToMe's form with another number: say what the form takes, not "unknown preset".
        raise ValueError(f"keep {text!r}: ToMe's form r<N> removes a whole number N >= 0 of tokens per block")
    if name[:1] in "[{":  # a YAML list or mapping, as a dotted config override spells it
        try:
            value = safe_load_strict(name)
        except yaml.YAMLError:
            raise ValueError(f"keep {text!r} is not a valid YAML list or mapping") from None
        return parse_keep(value)
    if "," in name:
        entries = []
        for position, entry in enumerate((t.strip() for t in name.split(",")), start=1):
            # An empty entry ("12,,8") is a typo, not a shorter schedule: dropping it would
            # shift every later budget to the block before it.
            if not entry:
                raise ValueError(f"keep list {text!r}: empty entry at position {position}")
            try:
                entries.append(_parse_number(entry))
            except ValueError:
                raise ValueError(
                    f"keep list {text!r}: entry {position} ({entry!r}) is neither a token count "
                    "(int) nor a ratio (float)"
                ) from None
        return parse_keep(entries)
    try:
        number = _parse_number(name)
    except ValueError:
        close = difflib.get_close_matches(name, PRESETS, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; presets: {', '.join(list_presets())}"
        raise ValueError(f"unknown keep preset {text!r}{hint}") from None
    return parse_keep(number)


def effective_counts(keep: Sequence[Budget], num_tokens: int) -> list[int]:
    """Tokens left after each block for ``num_tokens`` input tokens: ``min(K_l, so far)``."""
    counts, n = [], num_tokens
    for budget in keep:
        n = budget_to_count(budget, n)
        counts.append(n)
    return counts


def budget_to_count(budget: Budget, n: int) -> int:
    """Tokens kept by one block that receives ``n`` tokens."""
    if isinstance(budget, float):
        return min(n, int(budget * n + 0.5))
    return min(n, budget)
