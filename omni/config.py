"""Recipe configs: plain dicts at the top of each recipe, overridden from the command line."""

from __future__ import annotations

import ast
from typing import Any, Iterable


def apply_overrides(cfg: dict[str, Any], items: Iterable[str]) -> dict[str, Any]:
    """Apply ``--set key=value`` items in place: values are Python literals (``lr=3e-4``, ``methods=['dt']``,
    ``limit=None``), anything else stays a string. Unknown keys raise ValueError listing the known ones."""
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in cfg:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(cfg))}")
        try:
            cfg[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            cfg[key] = value
    return cfg
