"""Token budgets: how many tokens each block may keep.

``keep=`` accepts

- a list of per-block maxima ``[K_1, ..., K_L]`` (ints >= 0; the class token is not
  counted and always kept). ``K_l`` is a *maximum*: block l keeps
  ``min(K_l, tokens it receives)``, so a schedule may go up again (the paper's DeiT-e252
  level 7 does) without effect;
- one keep ratio ``r`` in (0, 1]: every block keeps ``round(r * tokens it receives)``;
- a list of per-block ratios (floats in (0, 1]);
- ToMe's form ``{"r": r}`` (``"r16"`` on the command line): every block removes ``r``
  tokens, at most half of those it receives (ToMe's bipartite matching cannot remove
  more), which turns into per-block counts for the host's token count;
- a named preset from the paper's appendix G (tables 3-5): ``deit_s_level0`` ...
  ``deit_s_level7``, ``deit_e318_level0`` ... ``deit_e318_level7``, ``deit_e252_level0``
  ... ``deit_e252_level7`` (224x224 images, patch 16: 196 tokens, 12 blocks).

:func:`resolve_keep` turns any of these into a validated per-block list.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from typing import Any

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

Budget = int | float  # int: max tokens kept; float: fraction of the tokens received


def list_presets() -> list[str]:
    """Names of the built-in keep schedules."""
    return sorted(PRESETS)


def _check_entry(v: Any, layer: int) -> Budget:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"keep[{layer}] (block {layer}): expected an int or a float ratio, got {v!r}")
    if isinstance(v, float):
        if not math.isfinite(v) or not 0.0 < v <= 1.0:
            raise ValueError(f"keep[{layer}] (block {layer}): a keep ratio must be in (0, 1], got {v}")
        return float(v)
    if v < 0:
        raise ValueError(f"keep[{layer}] (block {layer}): a token count must be >= 0, got {v}")
    return int(v)


def resolve_keep(keep: Any, *, depth: int, num_tokens: int | None = None) -> list[Budget]:
    """Validate ``keep`` and return one budget per block (``int`` count or ``float`` ratio).

    Strings name a preset (or a number, as typed on the command line: ``"0.5"``, a
    comma-separated list ``"196,180,..."``, or ``"r16"``). Errors name the offending
    block. ``{"r": r}`` needs ``num_tokens`` (the patch tokens the first block receives).
    """
    if keep is None:
        raise ValueError("a pooling method needs keep= (a per-block list, a ratio in (0, 1] or a preset)")
    if isinstance(keep, str):
        keep = _parse_string(keep)
    if isinstance(keep, dict):
        return _remove_per_block(keep, depth=depth, num_tokens=num_tokens)
    if isinstance(keep, bool):
        raise ValueError(f"keep must be a list, a ratio or a preset name, got {keep!r}")
    if isinstance(keep, int):
        raise ValueError(
            f"keep={keep}: give a per-block list of {depth} counts, a float ratio in (0, 1] "
            "or a preset name (an int alone is ambiguous)"
        )
    if isinstance(keep, float):
        return [_check_entry(keep, i) for i in range(depth)]
    if not isinstance(keep, Sequence):
        raise ValueError(f"keep must be a list, a ratio or a preset name, got {type(keep).__name__}")
    if len(keep) != depth:
        raise ValueError(f"keep schedule has {len(keep)} entries but the model has {depth} blocks")
    return [_check_entry(v, i) for i, v in enumerate(keep)]


def parse_keep_list(text: str) -> list[Budget]:
    """``"196,180,0.5"`` -> one budget per entry: a ratio if it has a ``.``, else a count.

    An empty entry (``"12,,8"``, ``"4,2,"``) is a typo, not a shorter schedule: dropping
    it would shift every later budget to the block before it, so it is refused.
    """
    budgets: list[Budget] = []
    for position, entry in enumerate((t.strip() for t in text.split(",")), start=1):
        if not entry:
            raise ValueError(f"keep list {text!r}: empty entry at position {position}")
        try:
            budgets.append(float(entry) if "." in entry else int(entry))
        except ValueError:
            raise ValueError(
                f"keep list {text!r}: entry {position} ({entry!r}) is neither a token count nor a ratio"
            ) from None
    return budgets


def _remove_per_block(keep: dict[str, Any], *, depth: int, num_tokens: int | None) -> list[Budget]:
    """ToMe's ``{"r": r}``: block l keeps ``n_l - min(r, n_l // 2)`` of the ``n_l`` it receives."""
    if set(keep) != {"r"}:
        raise ValueError(
            f"keep must be a list, a ratio, a preset name or {{'r': tokens removed per block}}, got {keep!r}"
        )
    r = keep["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"keep={{'r': ...}} needs a token count >= 0, got {r!r}")
    if num_tokens is None:
        raise ValueError("keep={'r': ...} needs the host's token count to turn into per-block budgets")
    counts: list[Budget] = []
    n = num_tokens
    for _ in range(depth):
        n -= min(r, n // 2)
        counts.append(n)
    return counts


def _parse_string(text: str) -> Any:
    name = text.strip()
    if name in PRESETS:
        return list(PRESETS[name])
    if name[:1] in "rR" and name[1:].isdigit():
        return {"r": int(name[1:])}
    if "," in name:
        return parse_keep_list(name)
    try:
        return float(name) if "." in name else int(name)
    except ValueError:
        close = difflib.get_close_matches(name, PRESETS, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; presets: {', '.join(list_presets())}"
        raise ValueError(f"unknown keep preset {text!r}{hint}") from None


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
