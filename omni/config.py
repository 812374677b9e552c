"""Recipe configs: a dict of defaults at the top of each recipe, named presets over it, ``--set key=value``
overrides from the command line; every entry type- and range-checked before anything is built.

    COMMON = dict(steps=6000, lr=1e-3, resize=Key(None, (int, None), at_least(1), "None: keep the size"))
    PRESETS = {"tiny": dict(steps=40)}
    ap = recipe_parser(__doc__, COMMON, PRESETS, "tiny")
    cfg = recipe_config(ap, ap.parse_args(argv), COMMON, PRESETS, "tiny")     # a plain, checked dict
    ...
    if __name__ == "__main__":
        run_recipe(main)

An entry's type comes from its ``Key`` when it has one, else from the shared ``RULES`` of that name (the
keys every recipe has: steps, lr, batch_size, ...), else from its default (int, float, bool, str, list,
dict; a None default needs a Key). Checks: int takes no bool and no 1.5 (1e4 is 10000); float takes ints,
not NaN or inf; bool only True/False; a list's items are checked (typed by the default's items), and a
dict's entries where the Key declares them (``entries=``, or ``each=`` for a dict of like values). A bad
value is one line naming the key and what it takes, through ``ap.error`` (exit status 2).
"""

from __future__ import annotations

import argparse
import ast
import copy
import inspect
import dataclasses
import math
import os
import sys
import textwrap
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, NoReturn, TypeVar

from omni.trunk import PRESETS as TRUNKS
from omni.trunk import TrunkConfig

TRUNK_FIELDS = tuple(f.name for f in dataclasses.fields(TrunkConfig))
T = TypeVar("T")

# ---------------------------------------------------------------------------------------------------
# Typed keys


@dataclass(frozen=True)
class Check:
    """A condition on a value (after its type is checked) and how it reads in an error: ``>= 1``."""

    ok: Callable[[Any], bool]
    text: str
    choices: tuple = ()  # set by one_of: the error lists them instead of the type


def keywords_of(fn: Callable[..., Any], skip: int = 1) -> Check:
    """A dict of keyword arguments for ``fn`` (its parameters after the first ``skip``)."""
    names = list(inspect.signature(fn).parameters)[skip:]
    return Check(lambda v: set(v) <= set(names), f"keyed by {fn.__name__}'s parameters: {', '.join(names)}")


def at_least(low: float) -> Check:
    return Check(lambda v: v >= low, f">= {low}")


def between(low: float, high: float) -> Check:
    return Check(lambda v: low <= v <= high, f"in [{low}, {high}]")


def one_of(*choices: Any) -> Check:
    shown = [repr(c) for c in choices]
    text = ", ".join(shown[:-1]) + f" or {shown[-1]}" if len(shown) > 1 else shown[0]
    return Check(lambda v: any(v == c and type(v) is type(c) for c in choices), text, choices)


POSITIVE = Check(lambda v: v > 0, "> 0")
FRACTION = between(0, 1)
NON_EMPTY = Check(lambda v: len(v) > 0, "non-empty")
_UNSET = object()


@dataclass(frozen=True)
class Key:
    """One config entry: its default, the types it takes (a type or a tuple of them; None in the tuple
    allows None; None here: the shared rule of that name, else the default's type), a range ``check``,
    a help line; for a dict ``entries`` (its known entries) or ``each`` (the Key of every value), for a
    list ``each`` (the Key of every item)."""

    default: Any = _UNSET
    type: Any = None
    check: Check | None = None
    help: str = ""
    entries: Mapping[str, "Key"] | None = None
    each: "Key | None" = None
    types: tuple = field(default=(), compare=False, repr=False)  # resolved `type`, set by `resolve`


# The entries recipes share: type, range and help by name, so a recipe's dict gives only the default.
RULES: dict[str, Key] = dict(
    out=Key(type=str, help="output directory: checkpoints/, logs/ (TensorBoard), final/ (the export)"),
    data=Key(type=(str, None), help="dataset directory (manifest.json + shards)"),
    text=Key(type=(list, None), each=Key(type=str),
             help="the text corpus: UTF-8 files and/or folders; None: Jane Austen's novels (r-cran-janeaustenr)"),
    trunk=Key(type=str, check=one_of(*TRUNKS), help="omni.trunk preset (size)"),
    trunk_overrides=Key(type=dict, check=Check(lambda v: set(v) <= set(TRUNK_FIELDS),
                                               f"keyed by TrunkConfig fields: {', '.join(TRUNK_FIELDS)}"),
                        help="TrunkConfig fields over the preset, e.g. {'d_model': 128}"),
    positions=Key(type=str, check=one_of("rope", "rope2d", "learned", "sinusoidal", "none"),
                  help="token positions in the trunk"),
    steps=Key(type=int, check=at_least(1), help="optimizer steps"),
    batch_size=Key(type=int, check=at_least(1), help="samples per step and process"),
    eval_batch_size=Key(type=int, check=at_least(1), help="samples per evaluation batch"),
    lr=Key(type=float, check=POSITIVE, help="peak learning rate"),
    min_lr_ratio=Key(type=float, check=FRACTION, help="the cosine schedule ends at lr * min_lr_ratio"),
    warmup_steps=Key(type=int, check=at_least(0), help="linear warm-up steps"),
    weight_decay=Key(type=float, check=at_least(0), help="AdamW weight decay (matrices only)"),
    clip_norm=Key(type=float, help="gradient norm clipping (<= 0: off)"),
    dropout=Key(type=float, check=between(0, 0.99), help="residual dropout"),
    workers=Key(type=int, check=at_least(0), help="data loader worker processes"),
    compile=Key(type=(bool, str), help="torch.compile the model (a string: the inductor mode)"),
    cuda_graph=Key(type=(bool, str), check=one_of(True, False, "auto"),
                   help="replay each training step as one CUDA graph; auto: when training on one CUDA device"),
    eval_every=Key(type=int, check=at_least(0), help="steps between evaluations (0: at the end only)"),
    checkpoint_every=Key(type=int, check=at_least(0), help="steps between checkpoints (0: none)"),
    log_every=Key(type=int, check=at_least(0), help="steps between logged metrics"),
    limit_train=Key(type=(int, None), check=at_least(1), help="use the first N training samples (None: all)"),
    limit_eval=Key(type=(int, None), check=at_least(1), help="use the first N evaluation samples (None: all)"),
    seed=Key(type=int, check=at_least(0), help="seed of the model init and data order"),
    progress=Key(type=bool, help="progress bar (False: one printed line per log_every steps)"),
    report_to=Key(type=str, help="'tensorboard' (<out>/logs), another Accelerate tracker, or 'none'"),
    resume=Key(type=str, check=one_of("auto", "force", "never"),
               help="auto: continue the run in <out> when its config matches this one; force: continue it "
                    "regardless; never: refuse an <out> that holds a run"),
    max_corrupt_fraction=Key(type=float, check=FRACTION, help="corrupt shard samples are skipped; more than this "
                                                              "fraction of an epoch's stops the run"),
)

_NAMES = {bool: "True or False", int: "an integer", float: "a finite number", str: "a string", list: "a list",
          dict: "a dict", type(None): "None"}
_PLURAL = {bool: "booleans", int: "integers", float: "finite numbers", str: "strings", list: "lists", dict: "dicts"}


def resolve(name: str, key: Any, rules: Mapping[str, Key] = RULES) -> Key:
    """The full Key of an entry: ``key`` (a Key or a plain default) over the rule of that name; the type
    from the default when neither gives one. A None default without a declared type is a recipe bug."""
    key = key if isinstance(key, Key) else Key(key)
    rule = rules.get(name, Key())
    typ = key.type or rule.type
    if typ is None:
        if key.default is _UNSET or key.default is None:
            raise TypeError(f"config entry {name!r}: give its type (Key(default, type)); None does not say")
        typ = type(key.default)
    types = tuple(type(None) if t is None else t for t in (typ if isinstance(typ, tuple) else (typ,)))
    each, entries = key.each or rule.each, key.entries or rule.entries
    if each is None and list in types and isinstance(key.default, list) and key.default:
        kinds = {type(v) for v in key.default}  # a list default of one kind (ints with floats: numbers)
        kinds = {float} if kinds == {int, float} else kinds
        each = Key(type=kinds.pop()) if len(kinds) == 1 else None
    return replace(key, type=typ, types=types, check=key.check or rule.check, help=key.help or rule.help,
                   each=None if each is None else resolve(f"{name}[]", each, {}),
                   entries=None if entries is None else {n: resolve(n, v) for n, v in entries.items()})


def schema(common: Mapping[str, Any]) -> dict[str, Key]:
    """Every entry of a recipe's COMMON resolved, plus ``preset``."""
    return {"preset": Key(type=str, types=(str,)), **{name: resolve(name, v) for name, v in common.items()}}


def defaults(common: Mapping[str, Any]) -> dict[str, Any]:
    """COMMON with each Key replaced by its default (deep copies)."""
    return {n: copy.deepcopy(v.default if isinstance(v, Key) else v) for n, v in common.items()}


def expectation(key: Key) -> str:
    """What an entry takes, as an error message says it: 'an integer >= 1 or None'."""
    if key.check is not None and key.check.choices:
        parts = [key.check.text] + (["None"] if type(None) in key.types else [])
        return " or ".join(parts)
    parts = []
    for t in key.types:
        text = _NAMES[t]
        if t is list:
            text = "a non-empty list" if key.check is NON_EMPTY else text
            item = key.each
            if item is not None and item.check is not None and item.check.choices:
                text += " of " + ", ".join(map(repr, item.check.choices))
            elif item is not None:
                text += " of " + " or ".join(_PLURAL[k] for k in item.types if k is not type(None)) + \
                    (f" {item.check.text}" if item.check else "")
        elif key.check is not None and t is not type(None):
            text += f" {key.check.text}" if t in (int, float) else f" ({key.check.text})"
        parts.append(text)
    if len(parts) > 1 and parts[0] == _NAMES[bool]:
        parts[0] = "True, False"
    return ", ".join(parts[:-1]) + f" or {parts[-1]}" if len(parts) > 1 else parts[0]


def check_value(path: str, value: Any, key: Key) -> Any:
    """``value`` as the entry takes it (ints for floats -> float, integral floats for ints -> int, a string
    for a list of strings -> [string], tuples -> lists), nested entries checked; ValueError otherwise."""
    bad = ValueError(f"{path} must be {expectation(key)}, got {value!r}")
    types = key.types
    if value is None:
        if type(None) in types:
            return None
        raise bad
    if isinstance(value, bool):
        if bool not in types:
            raise bad
    elif isinstance(value, int) and int in types:
        pass
    elif isinstance(value, (int, float)) and (int in types or float in types):
        if not math.isfinite(value):
            raise bad
        if float in types:
            value = float(value)
        elif float(value).is_integer():
            value = int(value)
        else:
            raise bad
    elif isinstance(value, str) and str not in types:
        if not (list in types and key.each is not None and str in key.each.types):
            raise bad
        value = [value]  # text=corpus.txt: one file
    elif isinstance(value, (list, tuple)) and list in types:
        value = list(value)
    elif not any(isinstance(value, t) for t in types if t not in (bool, int, float)):
        raise bad
    if isinstance(value, list) and key.each is not None:
        value = [check_value(f"{path}[{i}]", v, key.each) for i, v in enumerate(value)]
    if isinstance(value, dict):
        value = check_dict(path, value, key)
    if key.check is not None and not key.check.ok(value):
        raise bad
    return value


def check_dict(path: str, value: dict, key: Key) -> dict:
    if key.each is not None:
        return {n: check_value(f"{path}.{n}", v, key.each) for n, v in value.items()}
    if key.entries is None:
        return value
    unknown = [n for n in value if n not in key.entries]
    if unknown:
        raise ValueError(f"{path} has no entry {unknown[0]!r}; entries: {', '.join(sorted(key.entries))}")
    return {n: check_value(f"{path}.{n}", v, key.entries[n]) for n, v in value.items()}


def validate(cfg: dict[str, Any], keys: Mapping[str, Key]) -> dict[str, Any]:
    """Check (and normalise, in place) every entry of ``cfg`` against ``keys``; ValueError on the first
    bad one, naming it and what it takes."""
    for name in cfg:
        if name not in keys:
            raise ValueError(f"unknown config entry {name!r}; entries: {', '.join(sorted(keys))}")
    for name, key in keys.items():
        if name in cfg:
            cfg[name] = check_value(name, cfg[name], key)
    return cfg


# ---------------------------------------------------------------------------------------------------
# --set overrides


def apply_overrides(cfg: dict[str, Any], items: Iterable[str]) -> dict[str, Any]:
    """Apply ``--set key=value`` items in place, in order: values are Python literals (``lr=3e-4``,
    ``methods=['dt']``, ``limit=None``), anything else stays a string. A dotted key sets one entry of a
    nested dict (``tasks.text.loss_weight=2``) and leaves its siblings alone. Unknown keys raise ValueError
    listing the known ones at that level."""
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


# ---------------------------------------------------------------------------------------------------
# The command line


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
        apply_overrides(cfg, args.set)
        validate(cfg, schema(common))
    except ValueError as exc:
        ap.error(str(exc))
    return cfg


TEXT_OPTION = "--set \"text=['corpus.txt']\""  # how a recipe is given its own text corpus


def check_corpus(text: list[str] | None) -> None:
    """Before a recipe builds data from a text corpus: every file or folder of ``text`` exists, or (None)
    the default corpus, Austen's novels, is installed; else FileNotFoundError naming the ``text`` entry."""
    if text is None:
        from omni.tokenizers.text import austen_dir

        austen_dir(f"; or give your own (public-domain) text: {TEXT_OPTION}")
    for path in text or ():
        if not os.path.exists(path):
            raise FileNotFoundError(f"text: {path}: no such file or folder")


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
    from omni.cli import plain_warnings
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
