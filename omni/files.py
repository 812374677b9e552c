"""File helpers shared by exports, checkpoints, datasets and the CLI's outputs: content hashes, atomic durable
writes, and output names."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence


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
    (a full disk) leaves the old file and no temporary."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # what open() would have made, not mkstemp's private 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
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
