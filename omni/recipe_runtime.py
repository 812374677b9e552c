"""The recipes' runtime: the command line of a recipe (``--preset``, ``--data``, ``--out``, ``--set``, ``--help``
listing every entry), the checked config it gives (omni.config's schema), and running ``main`` so that a user's
mistake is one line and exit status 2 while a bug keeps its traceback.

    ap = recipe_parser(__doc__, COMMON, PRESETS, "tiny")
    cfg = recipe_config(ap, ap.parse_args(argv), COMMON, PRESETS, "tiny")     # a plain, checked dict
    ...
    if __name__ == "__main__":
        run_recipe(main)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import textwrap
from typing import Any, Callable, Mapping, NoReturn, TypeVar

from omni.config import apply_overrides, defaults, expectation, schema, validate

T = TypeVar("T")
def _short(value: Any, width: int = 48) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 4] + " ..."


def config_help(common: Mapping[str, Any], presets: Mapping[str, Mapping[str, Any]]) -> str:
    """The --help listing: every entry with its default, what it takes and its help line; then the presets
    with what each changes."""
    keys = schema(common)
    lines = ["config entries (--set KEY=VALUE, a Python literal; KEY.ENTRY=VALUE for one entry of a dict):"]
    for name, value in defaults(common).items():
        key = keys[name]
        lines.append(f"  {name} = {_short(value)}")
        about = f"{key.help}; " if key.help else ""
        lines.extend(textwrap.wrap(f"{about}takes {expectation(key)}", 100, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6, break_on_hyphens=False, break_long_words=False))
    lines.append("presets (--preset NAME; each sets these entries over the defaults):")
    for name, preset in presets.items():
        changes = ", ".join(f"{k}={_short(v, 32)}" for k, v in preset.items()) or "(the defaults)"
        lines.extend(textwrap.wrap(f"{name}: {changes}", 100, initial_indent="  ", subsequent_indent=" " * 6,
                                   break_on_hyphens=False, break_long_words=False))
    return "\n".join(lines)


def recipe_prog() -> str:
    """The recipe as it was started (``recipes/vit.py``): the name its errors begin with."""
    return os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else "recipe"


def recipe_parser(description: str, common: Mapping[str, Any], presets: Mapping[str, Any], default: str, *,
                  data_help: str | None = "dataset directory (manifest.json + shards)") -> argparse.ArgumentParser:
    """The flags every recipe shares: --preset, --data (unless data_help is None), --out, --set KEY=VALUE
    (repeatable: every item counts, in order); --help lists the config entries and the presets."""
    ap = argparse.ArgumentParser(prog=recipe_prog(), description=description,
                                 epilog=config_help(common, presets),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=None, help=f"one of {', '.join(presets)} (default: {default})")
    if data_help is not None:
        ap.add_argument("--data", default=None, help=data_help)
    ap.add_argument("--out", default=None, help="output directory (checkpoints, logs, final export)")
    ap.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                    help="override config entries (Python literals); may be repeated")
    return ap


def recipe_config(ap: argparse.ArgumentParser, args: argparse.Namespace, common: Mapping[str, Any],
                  presets: Mapping[str, Mapping[str, Any]], default: str,
                  updates: Mapping[str, Any] = ()) -> dict[str, Any]:
    """{**defaults, **presets[name], "preset": name}, then --out / --data (which also turns off a ``build``
    entry: the data is given) and ``updates`` (the recipe's own flags), then the --set overrides; every
    entry checked (``validate``). Errors go through ``ap.error``; presets are never mutated."""
    name = args.preset or default
    if name not in presets:
        ap.error(f"unknown preset {name!r}; choose from {', '.join(presets)}")
    cfg = {**defaults(common), **copy.deepcopy(dict(presets[name])), "preset": name}
    if getattr(args, "data", None):
        cfg.update({"data": args.data, **({"build": None} if "build" in cfg else {})})
    if args.out:
        cfg["out"] = args.out
    cfg.update(updates)
    try:
        keys = schema(common)
        apply_overrides(cfg, args.set, keys)
        validate(cfg, keys)
    except ValueError as exc:
        ap.error(str(exc))
    return cfg


TEXT_OPTION = "--set \"text=['corpus.txt']\""  # how a recipe is given its own text corpus


def check_corpus(text: list[str] | None) -> None:
    """Before a recipe builds data from a text corpus: ``text`` names files, folders of text files or the
    janeaustenr folder (``omni.data.builders_text.expand_inputs``, the reader every corpus goes through), or
    (None) the default corpus, Austen's novels, is installed; else one line naming the ``text`` entry."""
    if text is None:
        from omni.data.corpora import austen_dir

        austen_dir(f"; or give your own (public-domain) text: {TEXT_OPTION}")
        return
    if not text:
        raise ValueError(f"text is an empty list: give text files or folders ({TEXT_OPTION}), or None for the "
                         "default corpus")
    from omni.data.builders_text import expand_inputs

    try:
        expand_inputs(text)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"text: {exc}") from None


def train_config(cfg: Mapping[str, Any], **fields: Any):
    """The TrainConfig of a recipe config: every TrainConfig field the config has an entry of that name for
    (steps, lr, warmup_steps, checkpoint_every, resume, ...), ``output_dir`` from ``out``; ``fields`` over
    them (what the recipe derives: steps from epochs, a per-run seed)."""
    from omni.train import TrainConfig

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{"output_dir": cfg["out"], **{n: v for n, v in cfg.items() if n in names}, **fields})


def rank_zero_first(build: Callable[[], T], rank: int, world: int) -> T:
    """``build()`` on rank 0 first, then on the other ranks once rank 0 is done: rank 0 builds or caches
    what is missing, the others find it there (so ``build`` must skip what exists). One process (plain
    python): just ``build()``. Under accelerate launch / torchrun the process group is up (``process_state``
    starts it) and every rank, 0 included, meets at one barrier."""
    import torch.distributed as dist

    if rank == 0:
        result = build()
    if world > 1:
        dist.barrier()
    if rank != 0:
        result = build()
    return result


# ---------------------------------------------------------------------------------------------------
# Running a recipe


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's to fix (bad or missing data, a locked or mismatched output folder,
    a bad value, a full disk, a folder that cannot be written, a run that diverged), not bugs: a recipe
    reports them in one line."""
    from omni.data.shards import DatasetError
    from omni.export import DiskFullError
    from omni.lock import LockedError

    from omni.train import NonFiniteLossError

    # PermissionError, NotADirectoryError, IsADirectoryError: an --out or --data the user cannot write or
    # that is a file; NonFiniteLossError: training diverged (its message names the step and the samples)
    return (ValueError, FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError, LockedError,
            DatasetError, DiskFullError, NonFiniteLossError)


def run_recipe(main: Callable[[], Any]) -> NoReturn:
    """``if __name__ == "__main__": run_recipe(main)``. Exit status 0 when ``main()`` returns a result, 1
    when it returns None. A user error (``user_errors``, or a missing optional package: the line says which
    extra installs it) ends with one line ``<recipe>: error: <message>`` and status 2; anything else is a
    bug and keeps its traceback (so does every error with OMNI_TRACEBACK=1)."""
    from omni.console import plain_warnings
    from omni.deps import install_hint
    from omni.train import TrainingInterrupted

    try:
        with plain_warnings(recipe_prog()):
            result = main()
    except TrainingInterrupted as exc:  # Ctrl-C / SIGTERM in training: the step's checkpoint is saved
        print(f"{recipe_prog()}: {exc}", file=sys.stderr, flush=True)
        sys.exit(128 + exc.signum)
    except KeyboardInterrupt:  # outside the training loop (building data, a second Ctrl-C): nothing to save
        print(f"{recipe_prog()}: interrupted", file=sys.stderr, flush=True)
        sys.exit(128 + 2)
    except Exception as exc:
        message = install_hint(exc) or (str(exc) if isinstance(exc, user_errors()) else None)
        if message is None or os.environ.get("OMNI_TRACEBACK"):
            raise
        print(f"{recipe_prog()}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.exit(0 if result is not None else 1)


__all__ = ["TEXT_OPTION", "check_corpus", "config_help", "rank_zero_first", "recipe_config", "recipe_parser",
           "recipe_prog", "run_recipe", "train_config", "user_errors"]

