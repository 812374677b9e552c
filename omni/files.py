"""File helpers shared by exports, checkpoints, datasets and the CLI's outputs: content hashes, atomic durable
writes, and output names."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence


class DiskFullError(OSError):
    """No space left on the device while writing an export, a checkpoint or an output file; the partial write
    is removed and what was there before is intact. ``DiskFullError(errno.ENOSPC, message)``: its text is the
    message alone (one line for the user), its errno ENOSPC."""

    def __str__(self) -> str:
        return self.strerror if self.errno is not None and self.strerror else super().__str__()


class NotWritableError(PermissionError):
    """A folder to write (an output directory, a checkpoint, an export) is read-only or not ours:
    ``NotWritableError(errno, message)``, one line naming it (recipes and the CLI report PermissionError as a
    user error)."""

    def __str__(self) -> str:
        return self.strerror if self.errno is not None and self.strerror else super().__str__()


def write_failure(exc: BaseException, path: str | os.PathLike, what: str = "") -> OSError | None:
    """For an OSError met writing ``path``: a ``DiskFullError`` (ENOSPC, EDQUOT) or ``NotWritableError``
    (EROFS, EACCES, EPERM) whose message names ``what`` (default: the file) and its folder, else None."""
    if not isinstance(exc, OSError) or isinstance(exc, (DiskFullError, NotWritableError)):
        return None
    path = Path(path)
    what = what or str(path)
    folder = next((p for p in path.parents if p.is_dir()), path.parent)  # the one that refused a new entry
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        kept = f" (the earlier {path.name} is unchanged)" if path.is_file() else ""
        return DiskFullError(errno.ENOSPC, f"disk full (no space left on device) while writing {what}; it was not "
                             f"written{kept}: free space on {folder}")
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        why = "a read-only file system" if exc.errno == errno.EROFS else "permission denied"
        return NotWritableError(exc.errno, f"cannot write {what}: {folder} is not writable ({why})")
    return None


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """The sha256 hex digest of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush a directory entry (renames and new files inside it) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` so a reader sees the old file or the whole new one, never a part: a temporary
    file in the same folder, flushed to disk, renamed over ``path``, the folder entry flushed. A failed write
    (a full disk) leaves the old file and no temporary, and raises ``DiskFullError``; a read-only folder raises
    ``NotWritableError`` (both OSErrors, with the errno of the cause)."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise (write_failure(exc, path) or exc) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # what open() would have made, not mkstemp's private 0600
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if (failure := write_failure(exc, path)) is not None:  # one line naming the file, not a traceback
            raise failure from exc
        raise
    fsync_dir(path.parent)
    return path


def write_json(path: str | os.PathLike, payload: Any, *, sort_keys: bool = True) -> Path:
    """``payload`` as indented JSON (one trailing newline), written with ``write_atomic``."""
    return write_atomic(path, json.dumps(payload, indent=2, sort_keys=sort_keys) + "\n")


def output_paths(files: Sequence[str | os.PathLike], directory: str | os.PathLike, suffix: str,
                 fallback: str = "output") -> list[Path]:
    """Where each input's output goes: ``directory/<name><suffix>``, name = the file's name without its suffix
    (``fallback`` when it has none); a name met before gets ``-2``, ``-3`` ... (files from two folders may share
    one)."""
    seen: set[str] = set()
    out = []
    for f in files:
        stem = Path(f).stem or fallback
        name, k = stem, 1
        while name in seen:
            k += 1
            name = f"{stem}-{k}"
        seen.add(name)
        out.append(Path(directory) / f"{name}{suffix}")
    return out
