"""The Tokenizer protocol and the registry that finds tokenizers by name.

A tokenizer owns one modality end to end:
  encode(raw) -> Segment            CPU side, in data workers
  embedder(d_model) -> nn.Module    device side: maps that modality's packed tokens to (N, d_model)
  decode(...)                       where the modality is generated
  fit / save / load                 where it has state (BPE merges, normalisation statistics)

Third-party packages add tokenizers without touching omni through the entry-point group
``omni.tokenizers`` (``name = "package.module:Class"``) or by calling ``register_tokenizer``.
"""

from __future__ import annotations

import json
import os
import stat
from abc import ABC, abstractmethod
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, BinaryIO, Callable, ClassVar, Iterable, TypeVar

import torch
from torch import Tensor, nn

from omni.files import write_atomic
from omni.segment import Role, Segment

ENTRY_POINT_GROUP = "omni.tokenizers"
CONFIG_FILE = "omni_tokenizer.json"

_REGISTRY: dict[str, type["Tokenizer"]] = {}
_ENTRY_POINTS_LOADED = False

T = TypeVar("T", bound="type[Tokenizer]")


class Tokenizer(ABC):
    """Base class of every modality tokenizer.

    Subclasses set ``modality`` (the registry name) and ``role`` (the default attention
    role of their segments), implement ``encode`` and ``embedder``, and keep every
    constructor argument JSON-serialisable in ``config()`` so ``save``/``load`` round-trip.
    """

    modality: ClassVar[str]
    role: ClassVar[Role] = Role.BIDIRECTIONAL

    @abstractmethod
    def encode(self, raw: Any, *, key: str = "") -> Segment:
        """Turn one raw input into a Segment; ``key`` names the sample in error messages."""

    @abstractmethod
    def embedder(self, d_model: int) -> nn.Module:
        """A module mapping this modality's packed tokens (N, ...) to embeddings (N, d_model)."""

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"the {self.modality!r} tokenizer does not decode")

    def fit(self, data: Iterable[Any]) -> "Tokenizer":
        """Fit state (vocabulary, statistics) on an iterable of raw inputs; stateless tokenizers return self."""
        return self

    def config(self) -> dict[str, Any]:
        """Constructor arguments (JSON-serialisable) that rebuild this tokenizer."""
        return {}

    # -- persistence ---------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> Path:
        """Write config (and any fitted state, via ``save_state``) to ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        payload = {"modality": self.modality, "config": self.config()}
        write_atomic(directory / CONFIG_FILE, json.dumps(payload, indent=2, sort_keys=True))
        self.save_state(directory)
        return directory

    def save_state(self, directory: Path) -> None:
        """Hook for fitted state beyond the config; default: nothing."""

    def load_state(self, directory: Path) -> None:
        """Hook for fitted state beyond the config; default: nothing."""

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Tokenizer":
        """Rebuild a tokenizer saved with ``save`` (any registered modality when called on Tokenizer)."""
        directory = Path(directory)
        path = directory / CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: not a saved omni tokenizer directory")
        payload = json.loads(path.read_text())
        klass = get_tokenizer(payload["modality"]) if cls is Tokenizer else cls
        tok = klass(**payload["config"])
        tok.load_state(directory)
        return tok

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"


class TypeEmbedding(nn.Module):
    """Adds a learned modality-type vector so the trunk knows which tokenizer produced a token."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d_model))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.weight.to(x.dtype)  # keep autocast dtype (bf16) rather than promoting to fp32


def register_tokenizer(name: str | None = None) -> Callable[[T], T]:
    """Class decorator: ``@register_tokenizer()`` registers under the class's ``modality``."""

    def wrap(klass: T) -> T:
        key = name or klass.modality
        if key in _REGISTRY and _REGISTRY[key] is not klass:
            raise ValueError(f"tokenizer name {key!r} is already registered by {_REGISTRY[key].__qualname__}")
        _REGISTRY[key] = klass
        return klass

    return wrap


def _load_entry_points() -> None:
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue
        try:
            klass = ep.load()
        except Exception as exc:  # a broken plug-in must not hide the built-ins
            raise ImportError(f"omni tokenizer plug-in {ep.name!r} ({ep.value}) failed to import: {exc}") from exc
        _REGISTRY.setdefault(ep.name, klass)


def available_tokenizers() -> list[str]:
    """Names of every registered tokenizer, built-in and plug-in."""
    _load_entry_points()
    return sorted(_REGISTRY)


def get_tokenizer(name: str) -> type[Tokenizer]:
    """The tokenizer class registered under ``name``."""
    if name not in _REGISTRY:
        _load_entry_points()
    if name not in _REGISTRY:
        raise KeyError(
            f"unknown tokenizer {name!r}; available: {', '.join(available_tokenizers())} "
            f"(plug-ins register through the {ENTRY_POINT_GROUP!r} entry-point group)"
        )
    return _REGISTRY[name]


def build_tokenizer(name: str, **kwargs: Any) -> Tokenizer:
    """Instantiate the tokenizer registered under ``name``."""
    return get_tokenizer(name)(**kwargs)


# -- reading input files ---------------------------------------------------------------------------------
class NotARegularFileError(ValueError):
    """A path names a directory, FIFO, device or socket where a file to read was expected."""

    def __init__(self, path: str | os.PathLike, kind: str) -> None:
        self.path, self.kind = os.fspath(path), kind
        super().__init__(f"{self.path}: is {kind}, not a regular file")


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _check_mode(path: str | os.PathLike, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise NotARegularFileError(path, next((name for test, name in _FILE_KINDS if test(mode)), "a special file"))


def check_regular_file(path: str | os.PathLike, what: str = "file") -> os.stat_result:
    """``os.stat(path)`` if ``path`` is a regular file (symlinks followed). Raises FileNotFoundError
    "<path>: no such <what>", NotARegularFileError (a ValueError naming what it is: directory, FIFO, device,
    socket) or the OSError of ``os.stat``."""
    try:
        st = os.stat(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{os.fspath(path)}: no such {what}") from exc
    _check_mode(path, st.st_mode)
    return st


def open_regular_file(path: str | os.PathLike) -> BinaryIO:
    """Open a regular file for binary reading; refuse anything else at once (``check_regular_file``'s errors).

    Opening a FIFO blocks until a writer appears and a device can be read forever, so the type is checked
    by ``os.stat`` before opening (which has no side effects), and again on the descriptor, opened
    non-blocking: a path swapped for a FIFO in between cannot block either."""
    check_regular_file(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        _check_mode(path, os.fstat(fd).st_mode)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
