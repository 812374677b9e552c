"""Shards behind URLs: ``http(s)://``, ``s3://`` / ``gs://`` (fsspec), ``pipe:CMD``, fetched into a bounded local cache.

The reader (omni.data.reader) reads shards by random access through a tar header index: that is what makes its
batches worker independent and its resume exact and free. Remote shards keep every one of those promises by
being fetched whole, on demand, into a local cache directory (webdataset's ``wids`` does the same), and then read
exactly like local ones:

* **Bounded disk.** The cache holds at most ``cache_bytes`` (least recently used shards are evicted first); a
  shard is always kept while it is being fetched, so a limit below one shard's size still works, one shard at a
  time. The reader only touches the shards of its current shuffle window (``shuffle_window`` samples of its
  rank's contiguous range), so a cache of a few shards per data worker is enough; a larger one makes every epoch
  after the first read from local disk.
* **Atomic, shared.** A fetch writes ``<entry>.part`` and renames it when complete (a reader never sees half a
  shard); a per-entry ``flock`` makes concurrent data workers and ranks on one machine fetch each shard once.
  The sha256 of the bytes is computed while they arrive and kept next to the entry (``<entry>.sha256``), so the
  manifest check costs no second read.
* **Faults.** Dropped connections, timeouts, HTTP 5xx / 408 / 429 and other transient errors are retried with
  exponential backoff (an HTTP download continues where it stopped with a Range request when the server allows
  it). A 404, a refused credential (401 / 403) or a spent retry budget is a ``DatasetError`` of one line naming
  the URL; a full cache disk is a ``DiskFullError`` naming the cache folder.

A cache entry is named by the URL and the sha256 the manifest expects, so a rebuilt dataset (new digests) never
reads a stale copy; a bare URL list (no manifest) trusts a complete cached copy.
"""

from __future__ import annotations

import fcntl
import hashlib
import http.client
import io
import json
import os
import random
import re
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from omni.data.errors import DatasetError
from omni.files import DiskFullError, NotWritableError, write_failure

REMOTE_SCHEMES = ("http://", "https://", "s3://", "gs://", "gcs://")
# fsspec back ends the "remote" extra installs: scheme -> the package that implements it
_FSSPEC_PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
_CHUNK = 1 << 20


def is_remote(source: Any) -> bool:
    """True for a shard or dataset given by URL (``http(s)://``, ``s3://``, ``gs://``) or as ``pipe:CMD``."""
    if not isinstance(source, str):
        return False
    return source.startswith(REMOTE_SCHEMES) or source.startswith("pipe:")


def dataset_source(value: str | os.PathLike) -> str | Path:
    """A recipe's ``data`` entry as the readers take it: a URL (or ``pipe:``) as given, a local folder as a Path
    (``Path`` would fold ``https://host`` into ``https:/host``)."""
    return value if is_remote(value) else Path(value)


def local_path(source: str) -> str:
    """``file://PATH`` -> PATH; anything else unchanged."""
    return urllib.parse.unquote(source[len("file://"):]) if source.startswith("file://") else source


def is_dataset_url(source: Any) -> bool:
    """A URL naming a dataset (its folder or its manifest.json), not one shard: no ``.tar`` at the end, no
    ``pipe:`` and no brace pattern."""
    return (is_remote(source) and not source.startswith("pipe:") and "{" not in source
            and not source.split("?", 1)[0].endswith(".tar"))


def manifest_url(dataset_url: str) -> str:
    """The manifest.json of a dataset URL (the URL itself when it already names one)."""
    base = dataset_url.split("?", 1)[0]
    return dataset_url if base.endswith(".json") else dataset_url.rstrip("/") + "/manifest.json"


def join_url(manifest: str, name: str) -> str:
    """A shard named by the manifest (relative, checked by read_manifest) -> its URL next to the manifest."""
    base, _, query = manifest.partition("?")
    folder = base.rsplit("/", 1)[0]
    return f"{folder}/{urllib.parse.quote(name)}" + (f"?{query}" if query else "")


def _env_float(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"${name}={text!r} is not a number") from None


def default_cache_dir() -> str:
    """$OMNI_SHARD_CACHE, else $XDG_CACHE_HOME/omni/shards, else ~/.cache/omni/shards."""
    if os.environ.get("OMNI_SHARD_CACHE"):
        return os.environ["OMNI_SHARD_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "omni", "shards")


@dataclass(frozen=True)
class RemoteOptions:
    """How remote shards are fetched and cached (picklable: data workers get a copy).

    cache_dir:   the shard cache ($OMNI_SHARD_CACHE, default ~/.cache/omni/shards).
    cache_bytes: its size limit ($OMNI_SHARD_CACHE_GB, default 50 GB).
    retries:     tries after the first one for a transient fault ($OMNI_FETCH_RETRIES, default 6).
    backoff:     the first wait in seconds, doubled each retry up to 30 s, with jitter ($OMNI_FETCH_BACKOFF, 0.5).
    timeout:     seconds without a byte before a connection counts as dropped.
    storage_options: keyword arguments for the fsspec file system (e.g. ``{"endpoint_url": ...}`` for s3fs);
                 s3fs also reads the usual AWS_* variables, AWS_ENDPOINT_URL included.
    """

    cache_dir: str = field(default_factory=default_cache_dir)
    cache_bytes: int = field(default_factory=lambda: int(_env_float("OMNI_SHARD_CACHE_GB", 50.0) * 1e9))
    retries: int = field(default_factory=lambda: int(_env_float("OMNI_FETCH_RETRIES", 6)))
    backoff: float = field(default_factory=lambda: _env_float("OMNI_FETCH_BACKOFF", 0.5))
    timeout: float = 60.0
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cache_bytes < 0 or self.retries < 0 or self.backoff < 0 or self.timeout <= 0:
            raise ValueError(f"RemoteOptions: cache_bytes, retries and backoff must be >= 0 and timeout > 0, got "
                             f"{self.cache_bytes}, {self.retries}, {self.backoff}, {self.timeout}")


class _Transient(Exception):
    """A fault worth another try (dropped connection, 5xx, timeout)."""


def _describe(url: str) -> str:
    return url if not url.startswith("pipe:") else f"'{url}'"


# ---------------------------------------------------------------------------------------------------
# One download: bytes of a URL -> an open file, hashing as they pass


class _Sink:
    """The ``.part`` file being written plus the running sha256; a write error becomes DiskFullError / NotWritable."""

    def __init__(self, path: Path | None, what: str) -> None:
        self.path, self.what = path, what  # path None: in memory (a manifest)
        self.f: BinaryIO = io.BytesIO() if path is None else self._call(lambda: open(path, "wb"))
        self.hash = hashlib.sha256()
        self.size = 0

    def _call(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except OSError as exc:
            failure = write_failure(exc, self.path, self.what) if self.path is not None else None
            if failure is not None:
                raise failure from exc
            raise

    def write(self, data: bytes) -> None:
        self._call(lambda: self.f.write(data))
        self.hash.update(data)
        self.size += len(data)

    def restart(self) -> None:
        self._call(lambda: (self.f.seek(0), self.f.truncate()))
        self.hash, self.size = hashlib.sha256(), 0

    def close(self) -> None:
        if self.path is not None:
            self._call(lambda: (self.f.flush(), os.fsync(self.f.fileno())))
            self.f.close()


def _http_once(url: str, sink: _Sink, timeout: float) -> None:
    """One HTTP GET into ``sink``, continuing from ``sink.size`` bytes with a Range request when there are some."""
    headers = {"User-Agent": "omni-shard-reader"}
    if sink.size:
        headers["Range"] = f"bytes={sink.size}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as exc:
        code = exc.code
        exc.close()
        if code in (401, 403):
            raise DatasetError(f"{url}: access refused (HTTP {code} {exc.reason}): check the credentials or the "
                               "URL's signature") from None
        if code in (404, 410):
            raise DatasetError(f"{url}: not found (HTTP {code})") from None
        if code == 416 and sink.size:  # our Range is past the end: the file changed; fetch it whole again
            sink.restart()
            raise _Transient("HTTP 416 for a Range request (the file changed while it was fetched)") from None
        if code >= 500 or code in (408, 425, 429):
            raise _Transient(f"HTTP {code} {exc.reason}") from None
        raise DatasetError(f"{url}: HTTP {code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise _Transient(f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}") from None
    with response:
        if sink.size:
            start = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
            if response.status != 206 or start is None or int(start.group(1)) != sink.size:
                sink.restart()  # the server ignored the Range (or answered another one): start over
                if response.status == 206:
                    raise _Transient("the server answered a Range request with another range")
        length = response.headers.get("Content-Length")
        expected = sink.size + int(length) if length is not None and length.isdigit() else None
        while True:
            try:
                chunk = response.read(_CHUNK)
            except (OSError, http.client.HTTPException) as exc:
                raise _Transient(f"connection dropped after {sink.size} bytes ({type(exc).__name__}: {exc})") from None
            if not chunk:
                break
            sink.write(chunk)
        if expected is not None and sink.size != expected:
            raise _Transient(f"connection dropped after {sink.size} of {expected} bytes")


def _fsspec_fs(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    from omni.deps import require

    scheme = url.split("://", 1)[0]
    if scheme in _FSSPEC_PACKAGES:
        require(_FSSPEC_PACKAGES[scheme], "remote")  # one line naming the extra, not fsspec's ImportError
    fsspec = require("fsspec", "remote")
    return fsspec.core.url_to_fs(url, **storage_options)


def _refused(exc: BaseException) -> bool:
    """A refused credential from an fsspec back end: s3fs raises PermissionError; gcsfs raises OSError("Forbidden:
    ...") for HTTP 403 (the test gcsfs itself makes) and an HttpError with ``code`` 401."""
    return (isinstance(exc, PermissionError) or getattr(exc, "code", None) in (401, 403)
            or (isinstance(exc, OSError) and str(exc).startswith("Forbidden")))


def _reason(exc: BaseException) -> str:
    """The server's words on one line: gcsfs puts the request URL on a first line and the message on the next."""
    head, _, rest = str(exc).partition("\n")
    return " ".join(rest.split()) or " ".join(head.split())


def _fsspec_once(url: str, sink: _Sink, options: RemoteOptions) -> None:
    """One object-store read into ``sink`` (from the start: object stores are read whole)."""
    sink.restart()
    fs, path = _fsspec_fs(url, options.storage_options)
    try:
        with fs.open(path, "rb", block_size=8 * _CHUNK) as f:
            size = getattr(f, "size", None)
            while True:
                chunk = f.read(8 * _CHUNK)
                if not chunk:
                    break
                sink.write(chunk)
    except (DiskFullError, NotWritableError, DatasetError):  # the cache folder's fault, or already one line
        raise
    except FileNotFoundError:
        raise DatasetError(f"{url}: not found") from None
    except Exception as exc:
        if _refused(exc):
            raise DatasetError(f"{url}: access refused ({_reason(exc)}): check the credentials") from None
        if "Credentials" in type(exc).__name__:  # botocore's NoCredentialsError / PartialCredentialsError
            raise DatasetError(f"{url}: no usable credentials ({_reason(exc)}): set AWS_ACCESS_KEY_ID and "
                               "AWS_SECRET_ACCESS_KEY, a profile, or storage options") from None
        # OSError, and back-end specific network errors (aiohttp, botocore): worth a retry
        raise _Transient(f"{type(exc).__name__}: {' '.join(str(exc).split())}") from None
    if size is not None and sink.size != size:
        raise _Transient(f"read {sink.size} of {size} bytes")


def _pipe_once(url: str, sink: _Sink, timeout: float) -> None:
    """Run the command of ``pipe:CMD`` and keep its standard output; a failing command is not retried."""
    sink.restart()
    command = url[len("pipe:"):]

    with tempfile.TemporaryFile() as errors:  # a file, not a pipe: a chatty stderr cannot block the command
        proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=errors)
        assert proc.stdout is not None
        try:
            while chunk := proc.stdout.read(_CHUNK):
                sink.write(chunk)
        except BaseException:  # a full cache disk, Ctrl-C: the command must not outlive us
            proc.kill()
            proc.wait()
            raise
        finally:
            proc.stdout.close()
        rc = proc.wait()
        errors.seek(0)
        err = errors.read().decode("utf-8", "replace").strip()
    if rc != 0:
        last = err.splitlines()[-1] if err else "no message"
        raise DatasetError(f"{_describe(url)} exited with status {rc}: {last}")


def fetch(url: str, sink: _Sink, options: RemoteOptions, sleep: Callable[[float], None] = time.sleep) -> None:
    """Everything at ``url`` into ``sink``, retrying transient faults with exponential backoff."""
    last = ""
    for attempt in range(options.retries + 1):
        if attempt:
            delay = min(30.0, options.backoff * 2 ** (attempt - 1))
            sleep(delay * (0.5 + random.random() / 2))  # jitter: ranks that failed together retry apart
        try:
            if url.startswith("pipe:"):
                return _pipe_once(url, sink, options.timeout)
            if url.startswith(("http://", "https://")):
                return _http_once(url, sink, options.timeout)
            return _fsspec_once(url, sink, options)
        except _Transient as exc:
            last = str(exc)
    raise DatasetError(f"{_describe(url)}: giving up after {options.retries + 1} tries, the last one: {last}")


def read_url(url: str, options: RemoteOptions | None = None) -> bytes:
    """The bytes at ``url`` (a manifest), in memory, with the same retries and errors as shards; never cached."""
    sink = _Sink(None, url)
    fetch(url, sink, options or RemoteOptions())
    return sink.f.getvalue()  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------------
# The cache


@contextmanager
def _flock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


_SIDE = (".part", ".lock", ".sha256")


class ShardCache:
    """Remote shards as local files in ``options.cache_dir``, at most ``options.cache_bytes`` of them (LRU)."""

    def __init__(self, options: RemoteOptions) -> None:
        self.options = options
        self.dir = Path(options.cache_dir)

    def entry(self, url: str, sha256: str | None = None) -> Path:
        """The cache file of ``url`` (whose manifest digest is ``sha256``): readable, and unique per content."""
        digest = hashlib.sha256(f"{url}\0{sha256 or ''}".encode()).hexdigest()[:20]
        tail = re.sub(r"[^A-Za-z0-9_.-]", "_", url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1])[-60:]
        return self.dir / f"{digest}-{tail or 'shard'}"

    def get(self, url: str, sha256: str | None = None, size: int | None = None) -> tuple[str, str]:
        """(local path, sha256 of its bytes) of ``url``, fetched first unless cached. ``size`` (from a manifest)
        makes room before the download starts."""
        path = self.entry(url, sha256)
        hit = self._hit(path)
        if hit is not None:
            return hit
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise write_failure(exc, self.dir / "x", f"the shard cache {self.dir}") or exc from exc
        with _flock(path.with_name(path.name + ".lock")):
            hit = self._hit(path)  # another worker fetched it while we waited
            if hit is not None:
                return hit
            if size:
                self._make_room(size, keep=path)
            part = path.with_name(path.name + ".part")
            sink = _Sink(part, f"{part} (the shard cache's copy of {_describe(url)}; set $OMNI_SHARD_CACHE "
                               "to a folder on a disk with room)")
            try:
                fetch(url, sink, self.options)
                sink.close()
                digest = sink.hash.hexdigest()
                side = path.with_name(path.name + ".sha256")
                sink._call(lambda: side.write_text(digest))
                os.replace(part, path)  # the data last: an entry exists only complete, with its digest
            except BaseException:
                if not sink.f.closed:
                    sink.f.close()
                part.unlink(missing_ok=True)
                raise
            self._make_room(0, keep=path)
            return str(path), digest

    def peek(self, url: str, sha256: str | None = None) -> bool:
        """Whether ``url`` is in the cache now (nothing is fetched)."""
        return self.entry(url, sha256).with_name(self.entry(url, sha256).name + ".sha256").is_file()

    def _hit(self, path: Path) -> tuple[str, str] | None:
        side = path.with_name(path.name + ".sha256")
        try:
            digest = side.read_text().strip()
            os.utime(path)  # the LRU clock
        except FileNotFoundError:
            return None
        return str(path), digest

    def discard(self, path: str) -> None:
        """Drop an entry (its bytes did not match the manifest): the next run fetches it again."""
        Path(path).with_name(Path(path).name + ".sha256").unlink(missing_ok=True)
        Path(path).unlink(missing_ok=True)

    def _make_room(self, need: int, keep: Path) -> None:
        """Evict least recently used entries until they and ``need`` more bytes fit the limit. An evicted shard that
        a worker still has open stays readable through its descriptor (POSIX), and is fetched again if reopened."""
        entries = []
        for p in self.dir.iterdir():
            if p.name.endswith(_SIDE) or p == keep:
                continue
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries) + need
        if keep.is_file():
            total += keep.stat().st_size
        for _, size, p in sorted(entries):
            if total <= self.options.cache_bytes:
                break
            self.discard(str(p))
            total -= size

    def usage(self) -> int:
        """Bytes of complete entries in the cache."""
        if not self.dir.is_dir():
            return 0
        return sum(p.stat().st_size for p in self.dir.iterdir() if not p.name.endswith(_SIDE) and p.is_file())


def expand(source: str) -> list[str]:
    """Brace patterns (``train-{000000..000127}.tar``, ``{a,b}``) -> the names, in order."""
    if "{" not in source:
        return [source]
    import braceexpand

    return list(braceexpand.braceexpand(source))


def read_remote_manifest(url: str, options: RemoteOptions | None = None) -> tuple[str, dict[str, Any]]:
    """(manifest URL, parsed JSON) of a dataset URL; DatasetError naming the URL when it is not JSON."""
    where = manifest_url(url)
    data = read_url(where, options)
    try:
        return where, json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{where} is not valid JSON: {exc}") from None


__all__ = ["RemoteOptions", "ShardCache", "dataset_source", "is_remote", "is_dataset_url", "manifest_url", "join_url", "read_url",
           "read_remote_manifest", "expand", "default_cache_dir", "fetch", "local_path"]
