"""Webdataset tar shards plus a manifest: writing them atomically, and finding them again.

Layout of a dataset folder::

    <out>/<split>-000000.tar ...   webdataset shards: the files of one sample share a basename
                                    (``<key>.png``, ``<key>.cls``, ``<key>.json`` ...)
    <out>/manifest.json            written last; the only list of shards readers trust

Writing is atomic and idempotent (``Build``): a build holds ``<out>/.omni.lock`` (omni.lock.DirectoryLock,
so a second build into the same folder is refused, naming the first) and writes every shard under
``<out>/.omni-build/`` (``<name>.tmp`` until complete), the manifest last. Only a complete build
replaces the old dataset: its shards are renamed into ``<out>`` and its manifest goes in last, so an
interrupted or failed build - ``--force`` included - leaves the old dataset as it was. A build whose
manifest exists with the same builder, arguments and source fingerprint, and whose listed shards all
exist with matching sizes and sha256, is "up to date" and touches nothing. Anything else (no manifest,
a shard that changed) makes the next build write the dataset again.

Tar members get fixed metadata (mtime 0, uid/gid 0, mode 0444), so the same samples give
byte-identical shards and checksums on every run.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from omni.data.errors import DatasetError  # defined there, re-exported here (its long-standing home)
from omni.files import fsync_dir, sha256_file, write_json
from omni.lock import DirectoryLock

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TMP_SUFFIX = ".tmp"
# Where a build writes until it is complete: inside the dataset folder, so the same file system and
# the final renames are atomic.
STAGING_NAME = ".omni-build"
# A split name: letters, digits, '_' and '-' (it becomes the shard file prefix).
SPLIT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
SHARD_RE = re.compile(r"^(?P<split>[A-Za-z0-9_][A-Za-z0-9_-]*)-(?P<index>\d{6})\.tar$")
# webdataset takes everything before the first '.' of a member's basename as the sample key,
# so keys may not contain dots (or slashes, which would make directories inside the tar).
KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
EXT_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")




# What each builder's datasets hold (its manifest's "builder"): a reader says which kind it expects
# (``read_manifest(kind=...)``, ``ShardLoader(kind=...)``), so audio shards given to an image recipe are one
# line naming both kinds, not a traceback deep in decoding. Builders not listed (plug-ins, hand-made
# manifests) are not checked.
DATASET_KINDS = {
    "fashion-mnist": "images", "images": "images",
    "speech-synth": "speech", "librispeech": "speech",
    "gym": "episodes", "minari": "episodes",
    "text": "text", "audio": "speech",
}
KINDS_BY_MANIFEST = ("hf",)  # builders of several kinds: their manifest's "kind" says which (omni data hf)


def dataset_kind(manifest: Mapping[str, Any]) -> str | None:
    """The kind of data a manifest's builder writes (``DATASET_KINDS``), None for another builder."""
    builder = manifest.get("builder")
    if builder in KINDS_BY_MANIFEST:
        kind = manifest.get("kind")
        return kind if kind in set(DATASET_KINDS.values()) else None
    return DATASET_KINDS.get(builder) if isinstance(builder, str) else None


# -- reading -----------------------------------------------------------------------------------------
def read_manifest(path: str | os.PathLike, *, kind: str | Sequence[str] | None = None,
                  options: Any = None) -> dict[str, Any]:
    """The manifest of a dataset: ``path`` is the dataset folder or its manifest.json.

    ``path`` may also be a URL (``https://host/ds``, ``s3://bucket/ds`` or either's ``.../manifest.json``: see
    omni.data.remote), fetched with retries (``options``: a RemoteOptions), never cached.

    Raises DatasetError (naming the file) when it is missing, not JSON, not a manifest of a format version
    this code reads, when it names a shard outside its folder, or (``kind``: the kinds of ``DATASET_KINDS``
    the caller reads) when its builder writes another kind of data.
    """
    from omni.data.remote import is_remote, read_remote_manifest

    file: Any
    if is_remote(os.fspath(path)):
        url, manifest = read_remote_manifest(os.fspath(path), options)
        file = _Where(url)
    else:
        path = Path(path)
        file = path if path.is_file() or path.name == MANIFEST_NAME else path / MANIFEST_NAME
        if not file.is_file():
            where = file.parent
            raise DatasetError(
                f"{file} not found: {where} is not a complete omni dataset (build it with `omni data ...`; "
                "an interrupted build leaves no manifest)"
            )
        try:
            manifest = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DatasetError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("splits"), dict):
        raise DatasetError(f"{file} is not an omni dataset manifest (no 'splits' mapping)")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise DatasetError(f"{file} has format_version {version!r}; this omni reads version {FORMAT_VERSION}")
    for split, record in manifest["splits"].items():
        shards = record.get("shards") if isinstance(record, dict) else None
        if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
            raise DatasetError(f"{file}: split {split!r} has no 'shards' list of objects")
        for shard in shards:
            _check_shard_name(file, split, shard.get("name"))
    if kind is not None:
        wanted = (kind,) if isinstance(kind, str) else tuple(kind)
        found = dataset_kind(manifest)
        if found is not None and found not in wanted:
            builders = ", ".join(b for b, k in DATASET_KINDS.items() if k in wanted)
            raise DatasetError(f"{file.parent} is a dataset of {found} (built by `omni data "
                               f"{manifest['builder']}`), where a dataset of {' or '.join(wanted)} is expected (`omni data "
                               f"{builders or '...'}` builds them)")
    return manifest


class _Where(str):
    """A manifest URL that prints as itself, with ``.parent`` (the dataset URL) like a Path (for messages)."""

    @property
    def parent(self) -> str:
        return self.rsplit("/", 1)[0]


def _check_shard_name(file: Path, split: str, name: Any) -> None:
    """A manifest may only name files inside its dataset folder: a relative path without ``..`` (a manifest
    someone else wrote must not make a reader open, hash or train on files elsewhere on the machine)."""
    if not isinstance(name, str) or not name:
        raise DatasetError(f"{file}: split {split!r} lists a shard without a 'name' ({name!r})")
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\", "~")) or re.match(r"^[A-Za-z]:", name) or ".." in parts or "\0" in name:
        raise DatasetError(f"{file}: split {split!r} lists the shard {name!r}, outside the dataset folder "
                           f"{file.parent}; a manifest names its shards relative to its folder (no '..', no "
                           "absolute paths)")


def shard_urls(dataset_dir: str | os.PathLike, split: str, *, check_sha256: bool = False,
               kind: str | Sequence[str] | None = None) -> list[str]:
    """Absolute paths of the shards of ``split`` listed in the manifest, in order.

    Every listed shard must exist with the size the manifest records (and, with
    ``check_sha256``, the same sha256); otherwise DatasetError names the file. ``kind``: as ``read_manifest``.
    """
    dataset_dir = Path(dataset_dir).resolve()
    manifest = read_manifest(dataset_dir, kind=kind)
    splits = manifest["splits"]
    if split not in splits:
        raise DatasetError(
            f"{dataset_dir / MANIFEST_NAME} has no split {split!r}; available: {', '.join(sorted(splits)) or 'none'}"
        )
    urls = []
    for shard in splits[split]["shards"]:
        file = dataset_dir / shard["name"]
        _check_shard(file, shard, check_sha256)
        urls.append(str(file))
    return urls


def verify_dataset(dataset_dir: str | os.PathLike, *, check_sha256: bool = True) -> dict[str, Any]:
    """Check every shard of every split against the manifest; returns the manifest."""
    dataset_dir = Path(dataset_dir)
    manifest = read_manifest(dataset_dir)
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            _check_shard(dataset_dir / shard["name"], shard, check_sha256)
    return manifest


def _check_shard(file: Path, shard: Mapping[str, Any], check_sha256: bool) -> None:
    if not file.is_file():
        raise DatasetError(f"shard {file} is listed in the manifest but missing; rebuild the dataset")
    size = file.stat().st_size
    if size != shard["bytes"]:
        raise DatasetError(
            f"shard {file} has {size} bytes but the manifest says {shard['bytes']}: it changed after the build; "
            "rebuild the dataset"
        )
    if check_sha256 and sha256_file(file) != shard["sha256"]:
        raise DatasetError(f"shard {file} does not match the sha256 in the manifest; rebuild the dataset")


# -- writing -----------------------------------------------------------------------------------------
def encode_value(value: Any, *, what: str) -> bytes:
    """A sample field -> bytes: bytes as is, str as UTF-8, ints (``.cls``) as decimal text,
    dicts/lists as JSON."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what}: bool is ambiguous as a file; store an int or a JSON dict")
    if isinstance(value, (int, np.integer)):
        return str(int(value)).encode()
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")
    raise TypeError(f"{what}: cannot store a {type(value).__name__}; encode it to bytes first")


class _HashingFile:
    """Write-only file wrapper that hashes and counts what passes through (tarfile writes
    sequentially, so the digest of the stream is the digest of the file)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.nbytes = 0

    def write(self, b: Any) -> int:
        self._f.write(b)
        self.sha256.update(b)
        self.nbytes += len(b)
        return len(b)

    def tell(self) -> int:
        return self.nbytes


class ShardWriter:
    """Writes the samples of one split to ``<out>/<split>-%06d.tar``, ``shard_size`` samples each.

    A sample is a mapping with ``"__key__"`` plus one entry per file: extension -> bytes, str,
    int or JSON-able dict/list. Each shard goes to ``<name>.tmp`` first and is renamed when full
    (or on ``close``). ``shards`` lists ``{name, count, bytes, sha256}`` of the finished ones.
    Leaving the ``with`` block through an exception removes the unfinished temp file.
    """

    def __init__(
        self,
        out: str | os.PathLike,
        split: str,
        shard_size: int,
        progress: Any = None,
        on_close: Callable[["ShardWriter"], None] | None = None,
    ) -> None:
        if not SPLIT_RE.match(split):
            raise ValueError(f"split name {split!r} must match {SPLIT_RE.pattern}")
        if int(shard_size) < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.out = Path(out)
        self.split = split
        self.shard_size = int(shard_size)
        self.progress = progress
        self.on_close = on_close
        self.shards: list[dict[str, Any]] = []
        self.count = 0
        self._tar: tarfile.TarFile | None = None
        self._file: Any = None
        self._hash: _HashingFile | None = None
        self._tmp: Path | None = None
        self._in_shard = 0
        self._last_key: str | None = None

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):06d}.tar"
        self._tmp = self.out / (name + TMP_SUFFIX)
        self._file = open(self._tmp, "wb")
        self._hash = _HashingFile(self._file)
        self._tar = tarfile.open(fileobj=self._hash, mode="w", format=tarfile.PAX_FORMAT)
        self._in_shard = 0

    def _finish_shard(self) -> None:
        assert self._tar is not None and self._tmp is not None and self._hash is not None
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        final = self._tmp.with_name(self._tmp.name[: -len(TMP_SUFFIX)])
        os.replace(self._tmp, final)
        self.shards.append(
            {"name": final.name, "count": self._in_shard, "bytes": self._hash.nbytes, "sha256": self._hash.sha256.hexdigest()}
        )
        self._tar = self._file = self._hash = self._tmp = None

    def write(self, sample: Mapping[str, Any]) -> None:
        key = sample.get("__key__")
        if not isinstance(key, str) or not KEY_RE.match(key):
            raise ValueError(f"sample key {key!r} must be a str matching {KEY_RE.pattern} (no dots or slashes)")
        if key == self._last_key:
            # webdataset groups consecutive members by key: two samples would silently merge.
            raise ValueError(f"sample key {key!r} repeats the previous sample's key")
        files = [(ext, v) for ext, v in sample.items() if not ext.startswith("__")]
        if not files:
            raise ValueError(f"sample {key!r} has no files")
        if self._tar is None:
            self._open()
        assert self._tar is not None
        for ext, value in files:
            if not EXT_RE.match(ext):
                raise ValueError(f"sample {key!r}: extension {ext!r} must match {EXT_RE.pattern}")
            data = encode_value(value, what=f"sample {key!r} field {ext!r}")
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            info.mtime = 0
            info.mode = 0o444
            self._tar.addfile(info, io.BytesIO(data))
        self._last_key = key
        self._in_shard += 1
        self.count += 1
        if self.progress is not None:
            self.progress.update(1)
        if self._in_shard >= self.shard_size:
            self._finish_shard()

    def close(self) -> list[dict[str, Any]]:
        if self._tar is not None:
            self._finish_shard()
        if self.progress is not None:
            self.progress.close()
        if self.on_close is not None:
            self.on_close(self)
        return self.shards

    def abort(self) -> None:
        """Drop the unfinished shard (its temp file)."""
        if self._tar is not None:
            try:
                self._tar.close()
                self._file.close()
            finally:
                assert self._tmp is not None
                self._tmp.unlink(missing_ok=True)
                self._tar = self._file = self._hash = self._tmp = None
        if self.progress is not None:
            self.progress.close()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def make_progress(total: int | None, desc: str, quiet: bool, unit: str = "sample") -> Any:
    """A tqdm bar on stderr, or None when quiet or stderr is not a terminal."""
    if quiet or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=False)


def _jsonable(value: Any) -> Any:
    """Round trip through JSON, so args compare equal to what a manifest stores (tuples -> lists)."""
    return json.loads(json.dumps(value, sort_keys=True))


def fingerprint_files(paths: Iterable[str | os.PathLike], root: str | os.PathLike | None = None, *, content: bool = False) -> str:
    """sha256 over (relative path, size, mtime) of ``paths`` - or over their content with
    ``content=True`` - so a changed source makes an "up to date" build stale."""
    h = hashlib.sha256()
    base = Path(root) if root is not None else None
    for p in sorted(Path(x) for x in paths):
        rel = str(p.relative_to(base)) if base is not None else p.name
        h.update(rel.encode("utf-8", "surrogateescape") + b"\0")
        if content:
            h.update(sha256_file(p).encode())
        else:
            st = p.stat()
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


class Build:
    """One dataset build into ``out``: lock, up-to-date check, split writers, manifest, swap.

    Typical use::

        with Build(out, "images", {"val_fraction": 0.1, ...}, source=fingerprint) as build:
            if (manifest := build.up_to_date()) is not None:
                return manifest        # prints "up to date" unless quiet
            build.start()              # new shards go to <out>/.omni-build; the old dataset stays
            with build.split("train", total=n) as w:
                for sample in samples: w.write(sample)
            return build.finish(classes=[...])  # the new dataset replaces the old one

    The ``with`` block holds the folder's lock (``up_to_date`` and ``start`` take it too when used
    without one; LockedError names the running build) and, left through an exception, drops the
    unfinished build. A complete build needs room for the old and the new dataset at once.

    ``args`` are the builder's output-determining arguments (not e.g. worker counts) and
    ``source`` fingerprints the input data; both must match for a build to be up to date.
    """

    def __init__(
        self,
        out: str | os.PathLike,
        builder: str,
        args: Mapping[str, Any],
        *,
        source: Any = None,
        shard_size: int = 2000,
        quiet: bool = False,
        force: bool = False,
    ) -> None:
        if int(shard_size) < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.out = Path(out)
        self.builder = builder
        self.shard_size = int(shard_size)
        self.args = _jsonable({**dict(args), "shard_size": self.shard_size})
        self.source = _jsonable(source)
        self.quiet = quiet
        self.force = force
        self._splits: dict[str, dict[str, Any]] = {}
        self._started = 0.0
        self._lock = DirectoryLock(self.out, "dataset directory")

    def __enter__(self) -> "Build":
        self._lock.acquire()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        self._lock.release()

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(msg, flush=True)

    @property
    def manifest_path(self) -> Path:
        return self.out / MANIFEST_NAME

    @property
    def staging(self) -> Path:
        return self.out / STAGING_NAME

    def up_to_date(self, extra_check: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any] | None:
        """The existing manifest if it was written by this builder with these args and source
        and every listed shard matches its size and sha256 (and ``extra_check(manifest)``
        holds); else None. Prints "<out>: up to date" when it returns a manifest."""
        self._lock.acquire()
        if self.force:
            return None
        try:
            manifest = read_manifest(self.out)
        except DatasetError:
            return None
        if (
            manifest.get("builder") != self.builder
            or manifest.get("args") != self.args
            or manifest.get("source") != self.source
        ):
            return None
        try:
            verify_dataset(self.out, check_sha256=True)
        except DatasetError:
            return None
        if extra_check is not None and not extra_check(manifest):
            return None
        shutil.rmtree(self.staging, ignore_errors=True)  # what an interrupted later build left
        self.log(f"{self.out}: up to date ({self.builder}, {_summary(manifest)})")
        return manifest

    def start(self) -> None:
        """Lock ``out`` (creating it), drop what an interrupted build left in the staging folder and
        start a new one there. The old dataset stays untouched until ``finish``."""
        self._lock.acquire()
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir()
        self._started = time.time()

    def split(self, name: str, total: int | None = None) -> ShardWriter:
        """A writer for split ``name``; its shards are recorded when the writer closes."""
        if name in self._splits:
            raise ValueError(f"split {name!r} written twice")
        if not self._started:
            raise RuntimeError("Build.start() must run before Build.split()")
        record: dict[str, Any] = {}
        self._splits[name] = record

        def done(writer: ShardWriter) -> None:
            record.update(count=writer.count, bytes=sum(s["bytes"] for s in writer.shards), shards=list(writer.shards))

        progress = make_progress(total, f"{self.builder} {name}", self.quiet)
        return ShardWriter(self.staging, name, self.shard_size, progress, on_close=done)

    def finish(self, **extra: Any) -> dict[str, Any]:
        """Write the manifest (after every shard), swap the new dataset in and release the lock;
        returns the manifest. ``extra`` adds builder-specific top-level keys (classes, fields,
        reference scores ...)."""
        unfinished = [name for name, rec in self._splits.items() if "shards" not in rec]
        if unfinished:
            raise RuntimeError(f"split writer(s) not closed before finish: {', '.join(unfinished)}")
        from omni import __version__

        manifest: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "builder": self.builder,
            "args": self.args,
            "source": self.source,
            "omni_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(time.time() - self._started, 3),
            "splits": self._splits,
            **_jsonable(extra),
        }
        write_json(self.staging / MANIFEST_NAME, manifest, sort_keys=False)
        self._swap({s["name"] for split in self._splits.values() for s in split["shards"]})
        self._lock.release()
        self.log(f"{self.out}: wrote {_summary(manifest)}")
        return manifest

    def _swap(self, new: set[str]) -> None:
        """Renames only, the manifest last: readers see the old dataset, then for a moment none (no
        manifest), then the new one; never a manifest naming shards that do not belong to it."""
        old: set[str] = set()
        try:
            for split in read_manifest(self.out)["splits"].values():
                old.update(s["name"] for s in split.get("shards", []))
        except DatasetError:
            pass
        self.manifest_path.unlink(missing_ok=True)
        for name in sorted(new):
            os.replace(self.staging / name, self.out / name)
        for p in self.out.iterdir():  # old shards the new dataset does not overwrite, legacy temp files
            if p.is_file() and p.name not in new and _is_build_file(p.name, old):
                p.unlink()
        os.replace(self.staging / MANIFEST_NAME, self.manifest_path)
        fsync_dir(self.out)
        shutil.rmtree(self.staging, ignore_errors=True)

    def abort(self) -> None:
        """Drop the unfinished build (the staging folder) and release the lock; the old dataset stays."""
        if self._lock.held:
            shutil.rmtree(self.staging, ignore_errors=True)
        self._lock.release()


def _is_build_file(name: str, listed: set[str]) -> bool:
    """A file a build writes: a listed or shard-named tar, the manifest, or a temp file of either."""
    stem = name[: -len(TMP_SUFFIX)] if name.endswith(TMP_SUFFIX) else name
    return name in listed or bool(SHARD_RE.match(stem)) or stem == MANIFEST_NAME


def _summary(manifest: Mapping[str, Any]) -> str:
    parts = [
        f"{name}: {s['count']} samples in {len(s['shards'])} shard(s)" for name, s in manifest["splits"].items()
    ]
    return "; ".join(parts) or "no splits"
