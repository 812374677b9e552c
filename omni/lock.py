"""One writer per directory: an advisory lock file that names its holder.

``DirectoryLock(path)`` takes an exclusive ``fcntl.flock`` on ``<path>/.omni.lock`` and writes who holds it
(pid, host, command, start time). The kernel drops a flock when its process dies, however it dies, so a
lock left by a killed run is stale by construction and the next run simply takes it; a live holder makes
``acquire`` raise ``LockedError`` naming that holder.

Why flock and not an O_EXCL file with a pid inside: a pid check cannot tell a dead holder on another host,
or a recycled pid, from a live one; the kernel's lock can (on local file systems and NFSv4).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from omni.files import write_failure

try:  # POSIX; on Windows the lock degrades to the holder file alone
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".omni.lock"


class LockedError(RuntimeError):
    """Another live process holds the directory's lock."""


def describe_holder(info: dict[str, Any]) -> str:
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return (f"pid {info.get('pid', '?')} on {info.get('host', '?')} since {when} "
            f"({info.get('command', '?')})")


class DirectoryLock:
    """Exclusive lock on a directory for as long as this object holds it (a context manager too).

    ``what`` names the directory's use in the error ("output directory", "dataset directory")."""

    def __init__(self, directory: str | os.PathLike, what: str = "directory") -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.what = what
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "DirectoryLock":
        if self._fd is not None:
            return self
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(f"{self.what} {self.directory} exists and is not a directory")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise (write_failure(exc, self.path, f"the lock file of the {self.what} {self.directory}") or exc) from exc
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise LockedError(f"{self.what} {self.directory} is in use by {describe_holder(self._read(fd))}; "
                                      "wait for it to finish, stop it, or choose another directory") from None
            info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                    "command": " ".join(sys.argv)[:300]}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        except BaseException as exc:
            os.close(fd)
            # a full disk (the empty file fit, its line does not) or a folder we may not write: one line
            if (failure := write_failure(exc, self.path, f"the lock file of the {self.what} {self.directory}")):
                raise failure from exc
            raise
        self._fd = fd
        return self

    @staticmethod
    def _read(fd: int) -> dict[str, Any]:
        try:
            return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # the file stays (removing it would race a waiting process); empty = free
        except OSError:
            pass
        os.close(fd)  # closing drops the flock

    def __enter__(self) -> "DirectoryLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:  # a forgotten lock is dropped with its object, as the kernel would at exit
        try:
            self.release()
        except Exception:
            pass
