"""Recipe configs: a dict of defaults at the top of each recipe, named presets over it, ``--set key=value``
overrides from the command line; every entry type- and range-checked before anything is built.

    COMMON = dict(steps=6000, lr=1e-3, resize=Key(None, (int, None), at_least(1), "None: keep the size"))
    PRESETS = {"tiny": dict(steps=40)}
    cfg = validate({**defaults(COMMON), **PRESETS["tiny"]}, schema(COMMON))   # a plain, checked dict
    (the recipes' command line around it, --preset / --set / --help, is omni.recipe_runtime)

An entry's type comes from its ``Key`` when it has one, else from the shared ``RULES`` of that name (the
keys every recipe has: steps, lr, batch_size, ...), else from its default (int, float, bool, str, list,
dict; a None default needs a Key). Checks: int takes no bool and no 1.5 (1e4 is 10000); float takes ints,
not NaN or inf; bool only True/False; a list's items are checked (typed by the default's items), and a
dict's entries where the Key declares them (``entries=``, or ``each=`` for a dict of like values). A bad
value is one line naming the key and what it takes, through ``ap.error`` (exit status 2).

Bounds that hold for every value, nested and undeclared ones included: an integer fits in 64 bits
(|n| < 2**63), a number is finite with |x| <= 1e15 (larger ones overflow what recipes compute from them:
a target return of 1e308 x a return scale is inf). ``trunk_overrides`` is checked entry by entry against
the TrunkConfig field types, then as the trunk it makes (divisibility, and a trunk whose training needs
more memory than this machine has is refused with the estimate). A dotted ``--set a.b=v`` may set any
entry the schema declares for ``a`` and is checked exactly like ``--set a={'b': v}``.
"""

from __future__ import annotations

import ast
import copy
import inspect
import dataclasses
import math
import os
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from types import UnionType
from typing import Any, Callable, Iterable, Mapping

from omni.attention_patterns import Global, Window2D, schedule_from_config
from omni.attention_patterns import parts as pattern_parts
from omni.trunk import PRESETS as TRUNKS
from omni.trunk import TrunkConfig

TRUNK_FIELDS = tuple(f.name for f in dataclasses.fields(TrunkConfig))

# ---------------------------------------------------------------------------------------------------
# Typed keys


@dataclass(frozen=True)
class Check:
    """A condition on a value (after its type is checked) and how it reads in an error: ``>= 1``."""

    ok: Callable[[Any], bool]
    text: str
    choices: tuple = ()  # set by one_of: the error lists them instead of the type
    # set by keywords_of: the dict's entries, typed from the function's annotations, so `--set build.train=5`
    # and `--set build={'train': 5}` are checked alike
    entries: Mapping[str, "Key"] | None = field(default=None, compare=False)


Derived = tuple[str, Callable[[Mapping[str, Any]], Any]]  # (how it reads, cfg -> value)


@dataclass(frozen=True)
class SetsTrunk(Check):
    """A ``trunk_overrides`` check that knows the TrunkConfig fields the recipe derives from its other entries
    (``derive``: field -> (how it reads, cfg -> value)), so ``check_trunk`` sizes the trunk the recipe builds,
    and the recipe's token layout, so it refuses attention patterns the tokens cannot take (``grid``: the
    tokens lie on a 2-D grid, as image patches; ``longest``: the most tokens one segment holds)."""

    derive: Mapping[str, Derived] = field(default_factory=dict, compare=False)
    grid: bool = field(default=False, compare=False)
    longest: Derived | None = field(default=None, compare=False)


def sets_trunk(*, grid: bool = False, longest: Derived | None = None, **fields: Derived) -> SetsTrunk:
    """The check of a recipe's ``trunk_overrides`` when the recipe derives these TrunkConfig fields itself:
    ``sets_trunk(max_positions=("image_size // patch", lambda c: c["image_size"] // c["patch"]))``. An
    override of one would be passed twice; the derived value counts in the trunk's memory estimate. ``grid``
    and ``longest`` describe the recipe's tokens for the attention-pattern checks (``check_attention``)."""
    why = "; ".join(f"{n} comes from {how}" for n, (how, _) in fields.items())
    return SetsTrunk(lambda v: not set(v) & set(fields), f"without {', '.join(fields)}: {why}" if fields else "a dict",
                     derive=dict(fields), grid=grid, longest=longest)


def keywords_of(fn: Callable[..., Any], skip: int = 1) -> Check:
    """A dict of keyword arguments for ``fn`` (its parameters after the first ``skip``), each typed by its
    annotation where that is a plain type (int, float, bool, str, a list / tuple / Sequence, ``| None``)."""
    names = list(inspect.signature(fn).parameters)[skip:]
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError, AttributeError):  # an annotation that does not resolve: names still checked
        hints = {}
    entries = {n: Key(type=_hint_types(hints.get(n)) or object) for n in names}
    return Check(lambda v: set(v) <= set(names), f"keyed by {fn.__name__}'s parameters: {', '.join(names)}",
                 entries=entries)


def _hint_types(hint: Any) -> tuple | None:
    """The config types an annotation allows (``int | None`` -> (int, None), ``Sequence[str]`` -> (list,)),
    or None when it is not one of those plain forms (the entry then takes any value within the bounds)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, UnionType):
        parts = [_hint_types(a) if a is not type(None) else (None,) for a in typing.get_args(hint)]
        return None if any(p is None for p in parts) else tuple(dict.fromkeys(t for p in parts for t in p))
    if hint in (int, float, bool, str):
        return (hint,)
    if hint is os.PathLike or origin is os.PathLike:
        return (str,)
    if isinstance(origin, type) and issubclass(origin, Sequence) and not issubclass(origin, str):
        return (list,)
    return None


def at_least(low: float) -> Check:
    return Check(lambda v: v >= low, f">= {low}")


def between(low: float, high: float) -> Check:
    return Check(lambda v: low <= v <= high, f"in [{low}, {high}]")


def one_of(*choices: Any) -> Check:
    shown = [repr(c) for c in choices]
    text = ", ".join(shown[:-1]) + f" or {shown[-1]}" if len(shown) > 1 else shown[0]
    return Check(lambda v: any(v == c and type(v) is type(c) for c in choices), text, choices)


POSITIVE = Check(lambda v: v > 0, "> 0")
# Seeds are offset by the process rank and go to numpy's legacy seeding, which takes 32 bits.
SEED = between(0, 2**31 - 1)
# torch.compile's modes (a string `compile` is one of them)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# report_to: 'none' or an Accelerate tracker (accelerate.utils.LoggerType; a test keeps the two equal)
TRACKERS = ("tensorboard", "none", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio",
            "all")
INT_LIMIT = 2**63  # |n| < INT_LIMIT: what a 64-bit integer holds (torch, numpy, the data loader)
FLOAT_LIMIT = 1e15  # |x| <= FLOAT_LIMIT: room for what recipes compute from a value, far from overflow
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


# The ranges of TrunkConfig's fields; their types come from its annotations (trunk_keys).
TRUNK_RANGES: dict[str, Check] = dict(
    d_model=at_least(1), n_layers=at_least(1), n_heads=at_least(1), n_kv_heads=at_least(1), mlp_ratio=POSITIVE,
    norm_eps=POSITIVE, max_positions=at_least(1), rope_base=Check(lambda v: v > 1, "> 1"), dropout=between(0, 0.99),
)


# TrunkConfig fields the model decides, never a config: the decoder of an encoder-decoder has cross-attention
# (recipes/whisper.py passes it, so an override would be given twice), a decoder-only model cannot use it.
NOT_OVERRIDES = ("cross_attention",)


def trunk_keys() -> dict[str, Key]:
    """One Key per TrunkConfig field but NOT_OVERRIDES, typed by its annotation (an int, ``int | None``, a
    float, a bool, a Literal of strings) with its TRUNK_RANGES range: what ``trunk_overrides`` entries take.
    A field of another type is a TypeError here, so a new field cannot go unchecked."""
    hints = typing.get_type_hints(TrunkConfig)
    keys = {}
    for f in dataclasses.fields(TrunkConfig):
        if f.name in NOT_OVERRIDES:
            continue
        hint = hints[f.name]
        if typing.get_origin(hint) is typing.Literal:
            keys[f.name] = Key(type=str, check=one_of(*typing.get_args(hint)))
            continue
        kinds = _hint_types(hint)
        if kinds is None and set(typing.get_args(hint)) == {dict, type(None)}:  # attention: TrunkConfig checks it
            kinds = (dict, None)
        if kinds is None or not set(kinds) <= {int, float, bool, None, dict}:
            raise TypeError(f"TrunkConfig.{f.name}: {hint} is not a type trunk_overrides can check")
        keys[f.name] = Key(type=kinds, check=TRUNK_RANGES.get(f.name))
    return keys


# The entries recipes share: type, range and help by name, so a recipe's dict gives only the default.
RULES: dict[str, Key] = dict(
    out=Key(type=str, help="output directory: checkpoints/, logs/ (TensorBoard), final/ (the export)"),
    data=Key(type=(str, None), help="dataset directory or URL (https://, s3://, gs://: manifest.json + shards)"),
    text=Key(type=(list, None), check=NON_EMPTY, each=Key(type=str),
             help="the text corpus: UTF-8 text files and/or folders of them (their .txt/.text/.md files) or the "
                  "janeaustenr package folder; None: Jane Austen's novels (r-cran-janeaustenr)"),
    trunk=Key(type=str, check=one_of(*TRUNKS), help="omni.trunk preset (size)"),
    trunk_overrides=Key(type=dict, entries=trunk_keys(),
                        help="TrunkConfig fields over the preset, e.g. {'d_model': 128} or "
                             "--set trunk_overrides.d_model=128"),
    positions=Key(type=str, check=one_of("rope", "rope2d", "learned", "sinusoidal", "none"),
                  help="token positions in the trunk"),
    steps=Key(type=int, check=at_least(1), help="optimizer steps"),
    batch_size=Key(type=int, check=at_least(1), help="samples per step and process"),
    eval_batch_size=Key(type=int, check=at_least(1), help="samples per evaluation batch"),
    lr=Key(type=float, check=POSITIVE, help="peak learning rate"),
    min_lr_ratio=Key(type=float, check=FRACTION, help="the cosine schedule ends at lr * min_lr_ratio"),
    warmup_steps=Key(type=int, check=at_least(0), help="linear warm-up steps"),
    weight_decay=Key(type=float, check=at_least(0), help="AdamW weight decay (matrices only)"),
    optimizer=Key(type=str, check=one_of("adamw", "muon"),
                  help="adamw; or muon: Muon for the 2-D weights of the nn.Linear modules inside the trunk "
                       "(attention, MLP), AdamW for embeddings, heads, norms, biases and conv kernels, one lr and "
                       "schedule (omni.optimizers); not with cuda_graph or FSDP"),
    clip_norm=Key(type=float, help="gradient norm clipping (<= 0: off)"),
    dropout=Key(type=float, check=between(0, 0.99), help="residual dropout"),
    workers=Key(type=int, check=at_least(0), help="data loader worker processes"),
    compile=Key(type=(bool, str), check=one_of(True, False, *COMPILE_MODES),
                help="torch.compile the model (a string: the torch.compile mode)"),
    cuda_graph=Key(type=(bool, str), check=one_of(True, False, "auto"),
                   help="replay each training step as one CUDA graph; auto: when training on one CUDA device"),
    eval_every=Key(type=int, check=at_least(0), help="steps between evaluations (0: at the end only)"),
    checkpoint_every=Key(type=int, check=at_least(0), help="steps between checkpoints (0: none)"),
    log_every=Key(type=int, check=at_least(0), help="steps between logged metrics"),
    limit_train=Key(type=(int, None), check=at_least(1), help="use the first N training samples (None: all)"),
    limit_eval=Key(type=(int, None), check=at_least(1), help="use the first N evaluation samples (None: all)"),
    seed=Key(type=int, check=SEED, help="seed of the model init and data order"),
    progress=Key(type=bool, help="progress bar (False: one printed line per log_every steps)"),
    report_to=Key(type=str, check=one_of(*TRACKERS),
                  help="'tensorboard' (<out>/logs), another Accelerate tracker, or 'none'"),
    resume=Key(type=str, check=one_of("auto", "force", "never"),
               help="auto: continue the run in <out> when its config matches this one; force: continue it "
                    "regardless; never: refuse an <out> that holds a run"),
    max_corrupt_fraction=Key(type=float, check=FRACTION, help="corrupt shard samples are skipped; more than this "
                                                              "fraction of an epoch's stops the run"),
)

_NAMES = {bool: "True or False", int: "an integer", float: "a finite number", str: "a string", list: "a list",
          dict: "a dict", type(None): "None", object: "any value"}
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
    check = key.check or rule.check
    each, entries = key.each or rule.each, key.entries or rule.entries or (check.entries if check else None)
    if each is None and list in types and isinstance(key.default, list) and key.default:
        kinds = {type(v) for v in key.default}  # a list default of one kind (ints with floats: numbers)
        kinds = {float} if kinds == {int, float} else kinds
        each = Key(type=kinds.pop()) if len(kinds) == 1 else None
    return replace(key, type=typ, types=types, check=check, help=key.help or rule.help,
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


def _out_of_bounds(path: str, value: Any, expected: str, shown: Any = None) -> ValueError | None:
    """The error for a number beyond what every entry takes (the bounds in the module docstring), else None;
    ``shown``: the value as the user gave it, when that differs."""
    shown = value if shown is None else shown
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and not -INT_LIMIT < value < INT_LIMIT:
        return ValueError(f"{path} must be {expected}, got {shown!r}: integers must fit in 64 bits (|n| < 2**63)")
    if isinstance(value, float) and not math.isfinite(value):
        return ValueError(f"{path} must be {expected}, got {shown!r}")
    if isinstance(value, float) and abs(value) > FLOAT_LIMIT:
        return ValueError(f"{path} must be {expected}, got {shown!r}: numbers must be within +-{FLOAT_LIMIT:g} "
                          "(larger ones overflow what is computed from them)")
    return None


def check_plain(path: str, value: Any) -> Any:
    """A value no Key describes (a dict without declared entries, a list without an item Key): every
    number in it, however deep, within the bounds every entry has; ValueError naming where otherwise."""
    if isinstance(value, dict):
        return {n: check_plain(f"{path}.{n}", v) for n, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(check_plain(f"{path}[{i}]", v) for i, v in enumerate(value))
    error = _out_of_bounds(path, value, "a finite number" if isinstance(value, float) else "an integer")
    if error is not None:
        raise error
    return value


def check_value(path: str, value: Any, key: Key) -> Any:
    """``value`` as the entry takes it (ints for floats -> float, integral floats for ints -> int, a string
    for a list of strings -> [string], tuples -> lists), nested entries checked; ValueError otherwise."""
    bad = ValueError(f"{path} must be {expectation(key)}, got {value!r}")
    types, shown = key.types, value  # `shown`: as given (1e+100, not the 101-digit int it stands for)
    if object in types:  # any value (an undeclared keyword's): only the bounds
        return check_plain(path, value)
    if value is None:
        if type(None) in types:
            return None
        raise bad
    if isinstance(value, bool):
        if bool not in types:
            raise bad
    elif isinstance(value, int) and int in types:
        if (error := _out_of_bounds(path, value, expectation(key), shown)) is not None:
            raise error
    elif isinstance(value, (int, float)) and (int in types or float in types):
        if not math.isfinite(value):
            raise bad
        if float in types:
            value = float(value)
        elif float(value).is_integer():
            value = int(value)  # steps=1e4; steps=1e100 is refused below, as the integer it is
        else:
            raise bad
        if (error := _out_of_bounds(path, value, expectation(key), shown)) is not None:
            raise error
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
    elif isinstance(value, list):
        value = check_plain(path, value)
    if isinstance(value, dict):
        value = check_dict(path, value, key)
    if value == "" and not (key.check is not None and "" in key.check.choices):  # out='' would write into "."
        raise ValueError(f"{path} must be {expectation(key)}, not empty")
    if key.check is not None and not key.check.ok(value):
        raise bad
    return value


def check_dict(path: str, value: dict, key: Key) -> dict:
    if key.each is not None:
        return {n: check_value(f"{path}.{n}", v, key.each) for n, v in value.items()}
    if key.entries is None:
        return check_plain(path, value)
    unknown = [n for n in value if n not in key.entries]
    if unknown:
        raise ValueError(f"{path} has no entry {unknown[0]!r}; entries: {', '.join(sorted(key.entries))}")
    return {n: check_value(f"{path}.{n}", v, key.entries[n]) for n, v in value.items()}


def validate(cfg: dict[str, Any], keys: Mapping[str, Key]) -> dict[str, Any]:
    """Check (and normalise, in place) every entry of ``cfg`` against ``keys``; ValueError on the first
    bad one, naming it and what it takes. A config with ``trunk`` and ``trunk_overrides`` is then checked
    as the trunk it makes (``check_trunk``)."""
    for name in cfg:
        if name not in keys:
            raise ValueError(f"unknown config entry {name!r}; entries: {', '.join(sorted(keys))}")
    for name, key in keys.items():
        if name in cfg:
            cfg[name] = check_value(name, cfg[name], key)
    if "trunk" in cfg and "trunk_overrides" in cfg:
        check_trunk(cfg, keys)
    return cfg


# ---------------------------------------------------------------------------------------------------
# The trunk a config makes


def trunk_parameters(cfg: TrunkConfig) -> int:
    """The number of parameters of ``omni.trunk.Trunk(cfg)``, counted from the config (nothing is built, so a
    trunk of a trillion parameters is counted as cheaply as a tiny one)."""
    d, width, kv, b = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, int(cfg.bias)
    norm = d * (1 + b) if cfg.norm == "layernorm" else d

    def linear(n_in: int, n_out: int) -> int:
        return n_in * n_out + b * n_out

    hidden = int(cfg.mlp_ratio * d)
    if cfg.activation == "swiglu":  # omni.trunk.MLP: 2/3 of the hidden width, rounded up to 64, two halves
        hidden = 64 * math.ceil(2 * hidden / 3 / 64)
        mlp = linear(d, 2 * hidden) + linear(hidden, d)
    else:
        mlp = linear(d, hidden) + linear(hidden, d)
    block = 2 * norm + linear(d, width + 2 * kv) + linear(width, d) + mlp
    if cfg.cross_attention:
        block += norm + linear(d, width) + linear(d, 2 * kv) + linear(width, d)
    positions = {"learned": 2 * cfg.max_positions * d, "learned_1d": cfg.max_positions * d}.get(cfg.positions, 0)
    return cfg.n_layers * block + (norm if cfg.final_norm else 0) + positions


def machine_memory() -> int:
    """This machine's physical memory in bytes (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB", "PB", "EB"):
        if n < 1000 or unit == "EB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} EB"


TRAIN_BYTES_PER_PARAMETER = 16  # fp32 weights, gradients and AdamW's two moments


def check_trunk(cfg: Mapping[str, Any], keys: Mapping[str, Key] = RULES) -> TrunkConfig:
    """The TrunkConfig that ``trunk`` + ``trunk_overrides`` (+ the config's own ``positions`` / ``dropout``,
    which recipes pass to the trunk) make; ValueError in one line when an override repeats an entry the
    config has (``positions``: set that one), when the fields do not make a trunk (d_model not divisible by
    n_heads, ...), or when training it needs more memory than this machine has (16 bytes per parameter)."""
    overrides = cfg["trunk_overrides"]
    for name in overrides:
        if name in keys and name in TRUNK_FIELDS:  # the recipe passes its own entry: both would be a TypeError
            raise ValueError(f"trunk_overrides.{name}: this recipe sets the trunk's {name} from its own entry: "
                             f"--set {name}=...")
    given = {n: cfg[n] for n in ("positions", "dropout") if cfg.get(n) is not None and n in keys}
    check = keys["trunk_overrides"].check if "trunk_overrides" in keys else None
    try:
        derived = {n: (fn(cfg), how) for n, (how, fn) in check.derive.items()} if isinstance(check, SetsTrunk) else {}
    except (KeyError, TypeError, ArithmeticError):  # an entry it reads is None: the recipe says what it needs
        derived = {}
    made = f"trunk {cfg['trunk']!r}" + (f" with trunk_overrides {overrides}" if overrides else "")
    try:
        trunk = TrunkConfig(**{**TRUNKS[cfg["trunk"]], **given, **{n: v for n, (v, _) in derived.items()},
                               **overrides})
        if trunk.positions == "sinusoidal" and trunk.d_model % 4:  # omni.trunk.SinusoidalPositions
            raise ValueError(f"sinusoidal positions need d_model divisible by 4, got {trunk.d_model}")
        if int(trunk.mlp_ratio * trunk.d_model) < 1:
            raise ValueError(f"mlp_ratio {trunk.mlp_ratio} x d_model {trunk.d_model} leaves the MLP no hidden unit")
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{made}: {exc}") from None
    if isinstance(check, SetsTrunk):
        check_attention(trunk, cfg, check)
    elif trunk.attention is not None:  # a recipe that declares no layout: its tokens are 1-D, lengths its own
        check_attention(trunk, cfg, SetsTrunk(lambda v: True, ""))
    n = trunk_parameters(trunk)
    need, have = TRAIN_BYTES_PER_PARAMETER * n, machine_memory()
    if have and need > have:
        made += "".join(f" and {name} {value} (from {how})" for name, (value, how) in derived.items())
        raise ValueError(f"{made}: about {n:.3g} parameters, which need about {_size(need)} to train "
                         f"({_size(4 * n)} of fp32 weights, as much again for gradients and twice for AdamW's "
                         f"moments): more than this machine's {_size(have)} of memory")
    return trunk


def check_attention(trunk: TrunkConfig, cfg: Mapping[str, Any], layout: SetsTrunk,
                    name: str = "trunk_overrides.attention") -> None:
    """ValueError in one line when ``trunk_overrides.attention`` asks what the recipe's tokens cannot take: a 2-D
    window where tokens have no grid (text, audio frames, trajectories: their (row, col) positions are (p, p),
    so the "2-D" window would silently be a 1-D one), or more global tokens than the longest segment holds (every
    token global: full attention at a sparse pattern's cost)."""
    if trunk.attention is None:
        return
    try:
        longest = None if layout.longest is None else (int(layout.longest[1](cfg)), layout.longest[0])
    except (KeyError, TypeError, ArithmeticError):  # an entry it reads is None: nothing to compare with
        longest = None
    for i, pattern in enumerate(schedule_from_config(trunk.attention, trunk.n_layers).layers):
        for part in [] if pattern is None else pattern_parts(pattern):
            if isinstance(part, Window2D) and not layout.grid:
                raise ValueError(f"{name}: layer {i}'s window2d needs every segment's tokens on a "
                                 "2-D grid (image patches); this recipe's are sequences (text, audio or steps): "
                                 "use {'kind': 'window', 'before': n, 'after': n}")
            if isinstance(part, Global) and longest is not None and part.first >= longest[0]:
                raise ValueError(f"{name}: layer {i}'s global first={part.first} covers every "
                                 f"token of a segment here (at most {longest[0]}, from {longest[1]}): give fewer "
                                 "global tokens, or full attention (null)")


# ---------------------------------------------------------------------------------------------------
# --set overrides


def _entry_key(key: Key | None, name: str) -> Key | None:
    """The Key of entry ``name`` of a dict entry ``key`` (declared ``entries``, or ``each`` for a dict of
    like values); None when the schema does not say."""
    if key is None:
        return None
    if key.entries is not None:
        return key.entries.get(name)
    return key.each if dict in key.types else None


def apply_overrides(cfg: dict[str, Any], items: Iterable[str], keys: Mapping[str, Key] | None = None
                    ) -> dict[str, Any]:
    """Apply ``--set key=value`` items in place, in order: values are Python literals (``lr=3e-4``,
    ``methods=['dt']``, ``limit=None``), anything else stays a string. A dotted key sets one entry of a
    nested dict (``tasks.text.loss_weight=2``) and leaves its siblings alone; with the schema ``keys`` it may
    also add an entry the schema declares for that dict (``trunk_overrides.d_model=128`` over ``{}``), and
    the value is checked later by ``validate`` exactly like the whole-dict form. Unknown keys raise
    ValueError listing the valid ones at that level (the declared ones where the schema knows them)."""
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(cfg))}")
        *parents, leaf = key.split(".")
        node, path = cfg, []
        known: Key | None = None  # the schema's Key of `node` (None: the config itself, or undeclared)
        for part in parents:  # only dicts are descended into, so `node` is always a dict
            if not isinstance(node.get(part), dict):
                where = ".".join([*path, part])
                raise ValueError(f"--set {item!r}: " + (
                    f"{where} is None here: give the whole dict, --set {where}={{...}}" if part in node
                    and node[part] is None else f"{part!r} is not a dict entry of {'.'.join(path) or 'the config'}; "
                    f"entries: {', '.join(sorted(node))}"))
            known = (keys or {}).get(part) if not path else _entry_key(known, part)
            node, path = node[part], [*path, part]
        if leaf not in node and not (path and _entry_key(known, leaf) is not None):
            if not path:
                raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(node))}")
            valid = sorted(known.entries) if known is not None and known.entries else sorted(node)
            raise ValueError(f"--set {item!r}: {'.'.join(path)} has no entry {leaf!r}; entries: "
                             f"{', '.join(valid) or '(none)'}")
        try:
            node[leaf] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            node[leaf] = value
    return cfg
