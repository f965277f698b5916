"""YAML that refuses a key given twice in one mapping.

PyYAML keeps the last of two equal keys without a word: ``optim: {lr: -5}`` followed by
``optim: {epochs: 1}`` trained with the default learning rate and never checked ``-5``.
"""

from __future__ import annotations

from typing import Any

import yaml


class DuplicateKeyError(ValueError):
    """A mapping holds one key twice; the message names the key and both lines."""


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` then overriding a key of base is YAML's own rule
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                seen = key in first_line
            except TypeError:  # an unhashable key: SafeLoader's own error says so
                break
            if seen:
                raise DuplicateKeyError(
                    f"duplicate key {key!r} on line {line} (first on line {first_line[key]}); "
                    "give each key once"
                )
            first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def safe_load_strict(text: str) -> Any:
    """``yaml.safe_load(text)``, refusing a key given twice in one mapping
    (:class:`DuplicateKeyError`, a ``ValueError``)."""
    return yaml.load(text, Loader=_StrictLoader)
