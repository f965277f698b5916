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
  ``{"r": [r_1, ..., r_L]}`` gives one ``r`` per block, and ``{"r": r, "inflection": i}``
  ToMe's linear schedule (see :func:`tome_schedule`; ``r=(r, i)`` in Python);
- a fraction of the unpooled model's GFLOPs, ``"0.5x"``: solved per method and model
  into per-block budgets (:mod:`leanformer.pooling.gflops`). ``{"gflops": 0.5}`` and
  ``"g0.5"`` (the trade-off sweep's spellings, which also take a ``tilt`` and a ``bend``
  of the schedule: ``"g0.36t-1.2b1"``) mean the same;
- a named preset from the paper's appendix G (tables 3-5): ``deit_s_level0`` ...
  ``deit_s_level7``, ``deit_e318_level0`` ... ``deit_e318_level7``, ``deit_e252_level0``
  ... ``deit_e252_level7`` (224x224 images, patch 16: 196 tokens, 12 blocks).

Strings spell the same values as on the command line: ``"0.7"``, ``"12,8,4"``,
``"0.5,0.5"``, ``"[0.5, 0.5]"``, ``"r16"``, ``"{r: 16, inflection: 0.5}"``, ``"0.5x"``,
``"deit_s_level3"``; a number with a ``.`` or an
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
    """A parsed token budget: exactly one of ``blocks``, ``ratio``, ``remove`` and ``gflops`` is set.

    Build it with :func:`parse_keep`; :meth:`per_block` turns it into one budget per block
    of a given host. ``str()`` gives the command-line spelling and :meth:`to_value` a plain
    value for YAML/JSON; both parse back to an equal schedule. A GFLOPs fraction has no
    per-block budgets of its own: they are solved for a method on a model
    (:mod:`leanformer.pooling.gflops`).
    """

    blocks: tuple[Budget, ...] | None = None  # one per block: int = token count, float = ratio
    ratio: KeepRatio | None = None  # the same ratio in every block, whatever the depth
    # ToMe's r: tokens removed per block, one for all (with ToMe's inflection) or one per block
    remove: TokenCount | tuple[TokenCount, ...] | None = None
    inflection: float = 0.0
    gflops: float | None = None  # a fraction of the unpooled model's GFLOPs, in (0, 1]
    tilt: float = 0.0  # the shape of the per-block ratios solved for `gflops`
    bend: float = 0.0
    preset: str | None = field(default=None, compare=False)  # the appendix-G table `blocks` is

    def __post_init__(self) -> None:
        if sum(v is not None for v in (self.blocks, self.ratio, self.remove, self.gflops)) != 1:
            raise ValueError("a KeepSchedule holds exactly one of blocks, ratio, remove and gflops")

    def _key(self) -> tuple[Any, ...]:
        # Python finds 1 == 1.0, but a count of one token is not a ratio that keeps them all.
        blocks = None if self.blocks is None else tuple((type(v), v) for v in self.blocks)
        return (blocks, self.ratio, self.remove, self.inflection, self.gflops, self.tilt, self.bend)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeepSchedule) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def removals(self, depth: int) -> list[int]:
        """ToMe's form: the tokens each of ``depth`` blocks removes (before ToMe's cap at half)."""
        if self.remove is None:
            raise ValueError(f"keep={self} is not ToMe's form (r tokens removed per block)")
        if isinstance(self.remove, tuple):
            if len(self.remove) != depth:
                raise ValueError(f"keep={self}: {len(self.remove)} values of r for a model of {depth} blocks")
            return list(self.remove)
        return tome_schedule(self.remove, self.inflection, depth)

    def per_block(self, *, depth: int, num_tokens: int | None = None) -> list[Budget]:
        """One budget per block of a ``depth``-block host whose first block receives
        ``num_tokens`` patch tokens (needed by ToMe's form only)."""
        if self.gflops is not None:
            raise ValueError(
                f"keep={self} is a fraction of the model's GFLOPs: it is solved for a method on a "
                "model (apply_token_pooling, create_model), not read per block"
            )
        if self.ratio is not None:
            return [self.ratio] * depth
        if self.remove is not None:
            if num_tokens is None:
                raise ValueError(f"keep={self}: ToMe's form needs the host's token count")
            counts: list[Budget] = []
            n = num_tokens
            for r in self.removals(depth):
                n -= min(r, n // 2)
                counts.append(n)
            return counts
        assert self.blocks is not None
        if len(self.blocks) != depth:
            raise ValueError(
                f"keep schedule has {len(self.blocks)} entries but the model has {depth} blocks (keep={self})"
            )
        return list(self.blocks)

    def to_value(self) -> str | float | list[Budget] | dict[str, Any]:
        """The plain value (preset name, ratio, list, ``"r16"``, ``"0.5x"``) that parses back to this."""
        if self.preset is not None:
            return self.preset
        if self.ratio is not None:
            return self.ratio
        if self.gflops is not None:
            if self.tilt == 0.0 and self.bend == 0.0:
                return f"{self.gflops!r}x"
            shape = {"tilt": self.tilt} | ({"bend": self.bend} if self.bend != 0.0 else {})
            return {"gflops": self.gflops, **shape}
        if isinstance(self.remove, tuple):
            return {"r": list(self.remove)}
        if self.remove is not None:
            return (
                f"r{self.remove}"
                if self.inflection == 0.0
                else {"r": self.remove, "inflection": self.inflection}
            )
        return list(self.blocks or ())

    def __repr__(self) -> str:
        return f"parse_keep({self.to_value()!r})"

    def __str__(self) -> str:
        value = self.to_value()
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k}: {_spell_any(v)}" for k, v in value.items()) + "}"
        if isinstance(value, list):
            return ",".join(_spell(v) for v in value)
        return value if isinstance(value, str) else _spell(value)

    def label(self) -> str:
        """A short name for tables and plots: the preset name, ``r0.7`` for a ratio,
        ``64-48-32`` for per-block budgets, ``16/block`` for ToMe's r (``16/block i0.5``
        with an inflection, ``r8-8-4`` for one r per block), ``g0.5`` for a GFLOPs fraction.

        Not a spelling that parses back (``r0.7`` would read as ToMe's form): use ``str()``
        for that. Trade-off results are keyed by these names, so they must not change.
        """
        if self.preset is not None:
            return self.preset
        if self.ratio is not None:
            return f"r{self.ratio:g}"
        if self.gflops is not None:
            label = f"g{self.gflops!r}"
            label += f"t{self.tilt!r}" if self.tilt != 0.0 else ""
            return label + (f"b{self.bend!r}" if self.bend != 0.0 else "")
        if isinstance(self.remove, tuple):
            return "r" + "-".join(map(str, self.remove))
        if self.remove is not None:
            return f"{self.remove}/block" + (f" i{self.inflection:g}" if self.inflection != 0.0 else "")
        return "-".join(f"{v:g}" if isinstance(v, float) else str(v) for v in self.blocks or ())


def tome_schedule(r: int, inflection: float, depth: int) -> list[int]:
    """ToMe's ``(r, inflection)`` schedule: ``r`` per block on a straight line from
    ``r (1 - inflection)`` at the first block to ``r (1 + inflection)`` at the last, each
    rounded down, so ``inflection = 0`` removes ``r`` everywhere and ``inflection > 0``
    removes more in later blocks (ToMe's ``parse_r``)."""
    first = int(r * (1.0 - inflection))
    last = 2 * r - first
    if depth == 1:
        return [first]
    step = (last - first) / (depth - 1)
    return [max(0, int(first + step * i)) for i in range(depth)]


KeepLike = KeepSchedule | str | float | Sequence[Budget] | Mapping[str, Any]

KEEP_HELP = (
    "token budget: a keep ratio (float in (0, 1], 1.0 keeps all), per-block counts (ints: "
    "12,8,4) or ratios (0.5,0.5), ToMe's r16, a fraction of the GFLOPs (0.5x), or a preset "
    "(deit_s_level3)"
)


def _spell_any(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return repr(value) if isinstance(value, float) else str(value)


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
        raise ValueError(
            f"keep must be a ratio, a list, ToMe's r, a GFLOPs fraction or a preset name, got {keep!r}"
        )
    if isinstance(keep, numbers.Integral):
        raise ValueError(
            f"keep={keep}: an int is a token count and needs one per block (e.g. [{keep}, {keep}, ...]); "
            f"for a ratio write a float in (0, 1] (1.0 keeps every token)"
        )
    if isinstance(keep, numbers.Real):
        return KeepSchedule(ratio=_ratio(float(keep), "keep"))
    if isinstance(keep, Mapping):
        return _gflops_schedule(keep) if "gflops" in keep else _remove_per_block(keep)
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
    """ToMe's ``{"r": r}``: block l keeps ``n_l - min(r, n_l // 2)`` of the ``n_l`` it
    receives; ``{"r": [r_1, ...]}`` one r per block; ``{"r": r, "inflection": i}`` ToMe's schedule."""
    if "r" not in keep or set(keep) - {"r", "inflection"}:
        raise ValueError(
            "keep must be a ratio, a list, a preset name, {'r': tokens removed per block} or "
            f"{{'gflops': fraction}}, got {dict(keep)!r}"
        )
    r = keep["r"]
    if "inflection" in keep:
        r = (r, keep["inflection"])
    return parse_r(r)


def parse_r(r: Any) -> KeepSchedule:
    """ToMe's ``r``: an int (tokens removed by every block), a list (one per block) or
    ToMe's ``(r, inflection)`` schedule (:func:`tome_schedule`) -> a :class:`KeepSchedule`."""

    def count(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{where} needs a token count (int) >= 0, got {value!r}")
        return int(value)

    if isinstance(r, tuple):
        if len(r) != 2:
            raise ValueError(f"r=(r, inflection) takes two values, got {r!r}")
        inflection = r[1]
        if isinstance(inflection, bool) or not isinstance(inflection, numbers.Real):
            raise ValueError(f"r=(r, inflection): the inflection must be a number, got {inflection!r}")
        if not -1.0 <= float(inflection) <= 1.0:
            raise ValueError(f"r=(r, inflection): the inflection must lie in [-1, 1], got {inflection}")
        return KeepSchedule(remove=count(r[0], "r=(r, inflection)"), inflection=float(inflection))
    if isinstance(r, list):
        if not r:
            raise ValueError("r=[]: a per-block list of r needs one entry per block")
        return KeepSchedule(remove=tuple(count(v, f"r[{i}] (block {i})") for i, v in enumerate(r)))
    return KeepSchedule(remove=count(r, "r"))


# A GFLOPs fraction's schedule shape beyond these keeps every token or none in the first or
# last blocks whatever the target.
MAX_TILT = 10.0
MAX_BEND = 10.0
_GFLOPS_TEXT = re.compile(r"g(?P<gflops>[0-9.eE+-]+?)(?:t(?P<tilt>[0-9.eE+-]+?))?(?:b(?P<bend>[0-9.eE+-]+))?")
_TIMES_TEXT = re.compile(r"(?P<gflops>[0-9.eE+-]+)[xX]")


def check_gflops_budget(keep: Mapping[str, Any]) -> dict[str, float]:
    """A GFLOPs budget ``{"gflops": f, "tilt": t, "bend": b}`` with its numbers checked:
    ``gflops`` in (0, 1], ``tilt`` and ``bend`` finite (default 0). ``bend`` is left out
    when it is 0, so budgets without one read as before."""
    stray = sorted(set(keep) - {"gflops", "tilt", "bend"})
    if stray:
        raise ValueError(
            f"a GFLOPs budget takes gflops:, tilt: and bend:, not {', '.join(stray)} (got {dict(keep)!r})"
        )
    target, tilt, bend = keep["gflops"], keep.get("tilt", 0.0), keep.get("bend", 0.0)
    for name, value in (("gflops", target), ("tilt", tilt), ("bend", bend)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"GFLOPs budget {dict(keep)!r}: {name} must be a finite number, got {value!r}")
    for name, value, limit in (("tilt", tilt, MAX_TILT), ("bend", bend, MAX_BEND)):
        if abs(value) > limit:
            raise ValueError(
                f"GFLOPs budget {dict(keep)!r}: {name} must lie in [-{limit}, {limit}], got {value}"
            )
    if not 0.0 < target <= 1.0:
        raise ValueError(
            f"GFLOPs budget {dict(keep)!r}: gflops is a fraction of the unpooled model's GFLOPs, "
            f"in (0, 1], got {target}"
        )
    checked = {"gflops": float(target), "tilt": float(tilt)}
    return checked | ({"bend": float(bend)} if bend != 0.0 else {})


def parse_gflops_text(text: str) -> dict[str, float] | None:
    """``"0.5x"``, ``"g0.5"``, ``"g0.36t-1.2"``, ``"g0.36b1"`` -> the budget as a mapping
    (:func:`check_gflops_budget`); None when ``text`` is of neither form."""
    text = text.strip()
    times = _TIMES_TEXT.fullmatch(text)
    if times is not None:
        try:
            return check_gflops_budget({"gflops": float(times["gflops"])})
        except ValueError as err:
            if "fraction" in str(err):
                raise
            raise ValueError(f"GFLOPs budget {text!r}: expected <fraction>x, e.g. 0.5x") from None
    match = _GFLOPS_TEXT.fullmatch(text)
    if match is None:
        # No preset name starts with g followed by a digit or point: such a text was meant
        # as a GFLOPs budget, and is better told so than shown the list of presets.
        if re.fullmatch(r"[gG][0-9.].*", text):
            raise _misspelled_gflops(text)
        return None
    try:
        keep = {"gflops": float(match["gflops"])}
        for name in ("tilt", "bend"):
            if match[name] is not None:
                keep[name] = float(match[name])
    except ValueError:
        raise _misspelled_gflops(text) from None
    return check_gflops_budget(keep)


def _misspelled_gflops(text: str) -> ValueError:
    return ValueError(
        f"GFLOPs budget {text!r}: expected g<fraction>, optionally followed by t<tilt> and then b<bend>, "
        "e.g. g0.5, g0.36t-1.2 or g0.36b1 (or <fraction>x: 0.5x)"
    )


def _gflops_schedule(budget: Mapping[str, Any]) -> KeepSchedule:
    checked = check_gflops_budget(budget)
    return KeepSchedule(gflops=checked["gflops"], tilt=checked["tilt"], bend=checked.get("bend", 0.0))


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
    gflops = parse_gflops_text(name)
    if gflops is not None:
        return _gflops_schedule(gflops)
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
