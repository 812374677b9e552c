"""Command-line helpers every command shares (``omni``, ``omni data``, the recipes): the user-error exception,
numeric option types, one-line messages and warnings, and output folders checked before any work. A leaf: it
imports nothing of omni, so any command-line module can use it."""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator


class UsageError(Exception):
    """A mistake of the caller (options, paths, the export given): one line on stderr, exit status 2."""


# -- option types: bad values stop at argument parsing ------------------------------------------------------
def number(kind: type, *, at_least: float | None = None, below: float | None = None) -> Callable[[str], Any]:
    """An argparse type: text -> ``kind`` (int, or a finite float), ``>= at_least`` and ``< below`` where given.
    The one checker of numeric options for ``omni`` and ``omni data``."""
    bounds = " and ".join(t for t in (at_least is not None and f">= {at_least}", below is not None and f"< {below}") if t)

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if (at_least is not None and value < at_least) or (below is not None and value >= below):
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse




def one_line(exc: BaseException) -> str:
    """An exception's message on one line (whitespace folded), for `omni ...: error: <it>`."""
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)  # str(KeyError) adds quotes
    return " ".join(str(text).split()) or type(exc).__name__


# -- output folders: checked before any work, and a write that fails later is named, never the export ----------
def writable_dir(option: str, directory: str) -> None:
    """Create ``directory`` and write a few bytes there: UsageError naming the option and the folder when it is
    a file, read-only or full (probed by writing: root ignores permission bits, and only a write sees a full
    disk)."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {directory}: not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path) as probe:
            probe.write(b"\0" * 4096)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        raise UsageError(write_error(option, directory, exc)) from exc


def write_error(option: str, directory: str | Path, exc: OSError) -> str:
    """The one line for an output folder that cannot be written: which option, which folder, why."""
    why = {errno.ENOSPC: "the disk is full (no space left on device)", errno.EDQUOT: "the disk quota is exceeded",
           errno.EROFS: "it is on a read-only file system", errno.EACCES: "permission denied",
           errno.EPERM: "permission denied"}.get(exc.errno or 0, exc.strerror or str(exc))
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(directory) else ""
    return f"{option} {directory}: cannot write there{where}: {why}"


def writing(option: str, directory: str | Path | None, exc: BaseException) -> bool:
    """Whether ``exc`` is a failed write of an output under ``directory`` (not reading the export or an input)."""
    return (directory is not None and isinstance(exc, OSError)
            and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
            and (not exc.filename or Path(directory) in (Path(str(exc.filename)), *Path(str(exc.filename)).parents)))


@contextlib.contextmanager
def plain_warnings(prog: str) -> Iterator[None]:
    """While entered, warnings print as one line ``<prog>: warning: <message>``: Python's default format adds the
    source file and the line of code that warned, which a command-line user has no use for. The previous
    format comes back on exit (``main`` may be called in-process)."""
    previous = warnings.formatwarning
    warnings.formatwarning = lambda message, *_, **__: f"{prog}: warning: {message}\n"
    try:
        yield
    finally:
        warnings.formatwarning = previous


__all__ = ["UsageError", "number", "one_line", "plain_warnings", "writable_dir", "write_error", "writing"]
