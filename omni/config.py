"""Recipe configs: plain dicts at the top of each recipe, overridden from the command line."""

from __future__ import annotations

import argparse
import ast
import copy
from typing import Any, Iterable, Mapping


def apply_overrides(cfg: dict[str, Any], items: Iterable[str]) -> dict[str, Any]:
    """Apply ``--set key=value`` items in place: values are Python literals (``lr=3e-4``, ``methods=['dt']``,
    ``limit=None``), anything else stays a string. A dotted key sets one entry of a nested dict
    (``tasks.text.loss_weight=2``) and leaves its siblings alone. Unknown keys raise ValueError listing the
    known ones at that level."""
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(cfg))}")
        *parents, leaf = key.split(".")
        node, path = cfg, []
        for part in parents:  # only dicts are descended into, so `node` is always a dict
            if not isinstance(node.get(part), dict):
                raise ValueError(f"--set {item!r}: {part!r} is not a dict entry of {'.'.join(path) or 'the config'}; "
                                 f"entries: {', '.join(sorted(node))}")
            node, path = node[part], [*path, part]
        if leaf not in node:
            if not path:
                raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(node))}")
            raise ValueError(f"--set {item!r}: {'.'.join(path)} has no entry {leaf!r}; entries: "
                             f"{', '.join(sorted(node))}")
        try:
            node[leaf] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            node[leaf] = value
    return cfg


def recipe_parser(description: str, presets: Mapping[str, Any], default: str, *,
                  data_help: str | None = "dataset directory (manifest.json + shards)") -> argparse.ArgumentParser:
    """The flags every recipe shares: --preset, --data (unless data_help is None), --out, --set KEY=VALUE."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=None, help=f"one of {', '.join(presets)} (default: {default})")
    if data_help is not None:
        ap.add_argument("--data", default=None, help=data_help)
    ap.add_argument("--out", default=None, help="output directory (checkpoints, logs, final export)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="override config entries (Python literals)")
    return ap


def recipe_config(ap: argparse.ArgumentParser, args: argparse.Namespace, common: Mapping[str, Any],
                  presets: Mapping[str, Mapping[str, Any]], default: str,
                  updates: Mapping[str, Any] = ()) -> dict[str, Any]:
    """{**common, **presets[name], "preset": name}, then ``updates`` (from the command line's own flags),
    then the --set overrides; errors go through ``ap.error``. Copies deeply: presets are never mutated."""
    name = args.preset or default
    if name not in presets:
        ap.error(f"unknown preset {name!r}; choose from {', '.join(presets)}")
    cfg = {**copy.deepcopy(dict(common)), **copy.deepcopy(dict(presets[name])), "preset": name}
    cfg.update(updates)
    try:
        apply_overrides(cfg, args.set)
    except ValueError as exc:
        ap.error(str(exc))
    return cfg
