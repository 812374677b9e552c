"""Reading webdataset shards for training on many ranks and data workers.

``ShardLoader`` turns local webdataset tar shards into collated batches with these guarantees:

* **Exactly once.** Each epoch the N samples are laid out in a seeded shard order, rank r takes
  the contiguous range of N//W or N//W+1 samples, shuffles it inside windows of
  ``shuffle_window`` samples (a full permutation per window, seeded by seed/epoch/rank/window) and
  cuts it into batches. Every sample lands in exactly one batch of one rank.
* **Equal batch counts.** Every rank yields the same K = ceil(ceil(N/W)/batch_size) batches
  (floor(N//W / batch_size) with ``drop_last``), whose sizes differ by at most one, so collective
  ops never wait on a rank that ran out of data (accelerate #2258).
* **Worker independent.** The contents of batch j depend only on (seed, epoch, rank, j): data
  worker w builds batches w, w+num_workers, ... and torch's in-order DataLoader hands them back
  as 0, 1, 2, ... So num_workers=0 and num_workers=4 give identical batches.
* **Exact, free resume.** ``state_dict()`` is the position of the next batch (epoch, batches
  done). After ``load_state_dict`` the loader starts at that batch directly: no sample before it
  is read or decoded, because each batch is addressed by its index (shards are read by random
  access through a tar header index, not streamed).
* **Corrupt data.** A truncated shard, a truncated member, a sample missing a required field or
  one that ``decode`` cannot handle is skipped, counted and logged with its key; so is every sample
  of a shard whose sha256 differs from the dataset's manifest (checked when a process first indexes
  the shard: bytes changed after the build, e.g. a flipped label, would otherwise train silently).
  A run fails with a DatasetError naming the shards when more than ``max_corrupt_fraction`` of the
  samples of an epoch are corrupt.
  Skipped samples make their batch smaller. A batch left with no usable sample is never dropped
  (that would desynchronise the ranks) nor yielded as None: it holds one copy of a *filler*, the
  first usable sample that follows it in the rank's order (wrapping, then the whole dataset), a
  rule that depends only on the plan, so resumed runs agree with uninterrupted ones. The same
  happens, and is warned about at construction, when batch_size is 1 and N % world_size != 0.
  ``last_batch_was_filler`` tells an evaluation loop to ignore such a batch.

Do not pass the loader to ``accelerator.prepare``: it already splits by rank, and Accelerate
would re-shard or dispatch it (research/pitfalls.md 1-3). Move batches to the device yourself.

Shards are uncompressed tar files read by random access: that is what makes resume and
worker-independent batches cheap. Shards behind URLs (``https://``, ``s3://``, ``gs://``, ``pipe:CMD``; a dataset
URL whose manifest.json lists them, a URL list or a brace pattern) are fetched whole, on demand, into a bounded
local cache (omni.data.remote.ShardCache) and then read like local ones, so every promise above holds for them:
a rank's data workers only touch the shards of their current shuffle window, a resumed run fetches only the
shards of the batch it starts at, and a shard whose bytes differ from the manifest's sha256 (changed on the
server) is skipped and counted like a local one. A 404, a refused credential, a spent retry budget or a full
cache disk stops the run with one line naming the URL or the folder.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Sequence, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

# the field decoders and the shard index live in their own modules; the reader's users import them from here too
from omni.data.fields import (decode_audio, decode_cls, decode_field, decode_fields, decode_image,  # noqa: F401
                              decode_json, decode_npy, decode_npz, decode_text, decode_u8)  # noqa: F401
from omni.data.remote import RemoteOptions, ShardCache, expand, is_dataset_url, is_remote, join_url, local_path
from omni.data.shards import MANIFEST_NAME, DatasetError, read_manifest, sha256_file
from omni.data.tar_index import ShardIndex, count_samples, index_shard  # noqa: F401
from omni.deps import MissingDependency
from omni.files import DiskFullError, NotWritableError

T = TypeVar("T")
logger = logging.getLogger(__name__)


# Seed-sequence tags so the shard order and the window permutations never share a stream.
_SHARD_ORDER, _WINDOW = 0x5A4D, 0x57494E


def manifest_shards(
    dataset_dir: str | os.PathLike[str], split: str, kind: str | Sequence[str] | None = None
) -> tuple[list[str], list[int], list[str | None]]:
    """Shard paths, per-shard sample counts and sha256 digests (None where the manifest has none)
    of ``split`` from the dataset's manifest.json (written by omni.data.shards.Build; shard names
    are relative to the dataset folder).

    A shard whose size differs from the manifest is only logged here: the reader finds its sha256
    wrong too, skips and counts its samples as corrupt, and the corrupt-fraction limit decides.
    ``dataset_dir`` may be a URL (omni.data.remote): the shard URLs are then the manifest's names next to it.
    """
    return _manifest_plan(dataset_dir, split, kind)[:3]


def _manifest_plan(
    dataset_dir: str | os.PathLike[str], split: str, kind: str | Sequence[str] | None = None,
    remote: RemoteOptions | None = None,
) -> tuple[list[str], list[int], list[str | None], list[int | None]]:
    """manifest_shards plus each shard's size in bytes (None where the manifest has none)."""
    if is_remote(os.fspath(dataset_dir)):
        from omni.data.remote import manifest_url

        where = manifest_url(os.fspath(dataset_dir))
        manifest = read_manifest(where, kind=kind, options=remote)
        shard_path: Callable[[str], str] = lambda name: join_url(where, name)
    else:
        root = Path(dataset_dir)
        where = str(root / MANIFEST_NAME)
        manifest = read_manifest(root, kind=kind)
        shard_path = lambda name: str(root / name)
    splits = manifest["splits"]
    if split not in splits:
        raise DatasetError(f"{where} has no split {split!r}; available: {', '.join(sorted(splits)) or 'none'}")
    urls, counts, digests, sizes = [], [], [], []
    for shard in splits[split]["shards"]:
        path = shard_path(shard["name"])
        if not is_remote(path) and os.path.isfile(path) and "bytes" in shard and os.path.getsize(path) != shard["bytes"]:
            logger.warning("shard %s has %d bytes but the manifest says %d: it changed after the build; "
                           "its samples will be skipped as corrupt", path, os.path.getsize(path), shard["bytes"])
        urls.append(path)
        counts.append(int(shard["count"]))
        digests.append(shard.get("sha256"))
        sizes.append(int(shard["bytes"]) if isinstance(shard.get("bytes"), int) else None)
    return urls, counts, digests, sizes


def _expand_source(source: Any) -> list[str]:
    """A list of paths or URLs, one of them, or a brace pattern like ``dir/train-{000..009}.tar`` (brace patterns
    inside a list are expanded too); ``file://`` URLs become paths."""
    if isinstance(source, (str, os.PathLike)):
        return [local_path(u) for u in expand(os.fspath(source))]
    return [local_path(u) for s in source for u in expand(os.fspath(s))]


# ---------------------------------------------------------------------------------------------
# The per-epoch plan: which samples form batch j of rank r (pure functions of the config)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Config:
    urls: tuple[str, ...]
    counts: tuple[int, ...]
    decode: Callable[[dict[str, Any]], Any]
    collate: Callable[[list[Any]], Any]
    batch_size: int
    rank: int
    world_size: int
    seed: int
    shuffle: bool
    shuffle_window: int
    drop_last: bool
    fields: tuple[str, ...]
    sha256: tuple[str | None, ...] = ()  # per shard, from the manifest; () for bare shard paths
    sizes: tuple[int | None, ...] = ()  # per shard, bytes from the manifest (room made in the cache first)
    remote: RemoteOptions | None = None  # set when some shard is a URL: how it is fetched and cached

    @property
    def num_samples(self) -> int:
        return sum(self.counts)

    @property
    def num_batches(self) -> int:
        """Batches per rank per epoch: the same on every rank."""
        per_rank = self.num_samples // self.world_size
        if self.drop_last:
            return per_rank // self.batch_size
        return math.ceil(math.ceil(self.num_samples / self.world_size) / self.batch_size)


class _Plan:
    """Layout of one epoch for one rank: shard order, the rank's range, batch boundaries."""

    def __init__(self, cfg: _Config, epoch: int) -> None:
        self.cfg, self.epoch = cfg, epoch
        counts = np.asarray(cfg.counts, dtype=np.int64)
        if cfg.shuffle:
            self.shard_order = np.random.default_rng([cfg.seed, epoch, _SHARD_ORDER]).permutation(len(counts))
        else:
            self.shard_order = np.arange(len(counts))
        self.layout_start = np.concatenate([[0], np.cumsum(counts[self.shard_order])])
        n, w, r = cfg.num_samples, cfg.world_size, cfg.rank
        base, rem = divmod(n, w)
        self.rank_start = r * base + min(r, rem)
        self.rank_n = base + (1 if r < rem else 0)
        k = cfg.num_batches
        if cfg.drop_last:
            sizes = [cfg.batch_size] * k
        elif k:
            q, e = divmod(self.rank_n, k)
            sizes = [q + 1] * e + [q] * (k - e)
        else:
            sizes = []
        self.offsets = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))])
        self.used = int(self.offsets[-1])  # samples of this rank that go into batches
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    @property
    def num_batches(self) -> int:
        return len(self.offsets) - 1

    def batch_range(self, j: int) -> tuple[int, int]:
        return int(self.offsets[j]), int(self.offsets[j + 1])

    def _perm(self, window: int) -> np.ndarray:
        if window not in self._perms:
            size = min(self.cfg.shuffle_window, self.rank_n - window * self.cfg.shuffle_window)
            rng = np.random.default_rng([self.cfg.seed, self.epoch, self.cfg.rank, window, _WINDOW])
            self._perms[window] = rng.permutation(size)
            while len(self._perms) > 4:  # batches walk forward through windows; keep a few
                self._perms.popitem(last=False)
        return self._perms[window]

    def positions(self, lo: int, hi: int) -> np.ndarray:
        """Layout positions (0..N-1) of this rank's shuffled sequence entries lo..hi-1."""
        if hi <= lo:
            return np.zeros(0, dtype=np.int64)
        if not self.cfg.shuffle:
            return self.rank_start + np.arange(lo, hi, dtype=np.int64)
        size = self.cfg.shuffle_window
        parts = []
        for window in range(lo // size, (hi - 1) // size + 1):
            a, b = max(lo, window * size) - window * size, min(hi, (window + 1) * size) - window * size
            parts.append(window * size + self._perm(window)[a:b])
        return self.rank_start + np.concatenate(parts).astype(np.int64)

    def locate(self, position: int) -> tuple[int, int]:
        """Layout position -> (shard number in cfg.urls, sample number inside that shard)."""
        slot = int(np.searchsorted(self.layout_start, position, side="right")) - 1
        return int(self.shard_order[slot]), int(position - self.layout_start[slot])


# ---------------------------------------------------------------------------------------------
# Worker side: read, decode, collate one batch
# ---------------------------------------------------------------------------------------------


@dataclass
class _Item:
    """One collated batch plus the bookkeeping the main process aggregates."""

    epoch: int
    index: int
    data: Any
    slots: int  # planned samples in this batch
    valid: int
    filtered: int  # decode returned None on purpose
    corrupt: list[tuple[str, str, str]]  # (key, shard path, reason)
    filler_key: str | None  # set when every slot failed and one valid sample was borrowed
    error: BaseException | None = None  # a data worker's fatal error (a 404, a full cache disk), raised in the loader


class _Reader:
    """Per-process shard access: header indexes (given, or built on first use) and a few open files."""

    def __init__(self, cfg: _Config, indexes: dict[int, ShardIndex] | None = None, max_open: int = 16) -> None:
        self.cfg, self.max_open = cfg, max_open
        self._index: dict[int, ShardIndex] = {} if indexes is None else indexes
        self._files: OrderedDict[int, BinaryIO] = OrderedDict()
        self._cache = ShardCache(cfg.remote) if cfg.remote is not None else None
        self._digests: dict[int, str] = {}  # remote shards: sha256 of the cached copy, computed while fetched

    def path(self, sid: int) -> str:
        """The local file of shard sid: the path itself, or its copy in the shard cache (fetched now if needed)."""
        url = self.cfg.urls[sid]
        if self._cache is None or not is_remote(url):
            return url
        expected = self.cfg.sha256[sid] if self.cfg.sha256 else None
        size = self.cfg.sizes[sid] if self.cfg.sizes else None
        local, self._digests[sid] = self._cache.get(url, expected, size)
        return local

    def _with_local(self, sid: int, use: Callable[[str], T]) -> tuple[str, T]:
        """(local path, use(local path)) of shard sid. A cached remote shard can be evicted by another process (a data
        worker making room) between its fetch and its opening: then it is fetched again, up to twice."""
        for _ in range(2):
            local = self.path(sid)
            try:
                return local, use(local)
            except FileNotFoundError:
                if local == self.cfg.urls[sid]:  # not a cached copy: the file itself is missing
                    raise
        local = self.path(sid)
        return local, use(local)

    def cached(self, sid: int) -> bool:
        """Whether shard sid can be read without a fetch: a local file, or a remote one in the cache."""
        url = self.cfg.urls[sid]
        if self._cache is None or not is_remote(url):
            return True
        return self._cache.peek(url, self.cfg.sha256[sid] if self.cfg.sha256 else None)

    def index(self, sid: int) -> ShardIndex:
        """The shard's header index, built once per process; with a manifest digest the whole file is
        hashed first (a remote shard's digest comes from its fetch), and a mismatch marks every sample corrupt."""
        if sid not in self._index:
            url = self.cfg.urls[sid]
            local, idx = self._with_local(sid, index_shard)
            if len(idx) > self.cfg.counts[sid]:
                logger.warning(
                    "shard %s holds %d samples but its count is %d; the extra samples are never read",
                    url, len(idx), self.cfg.counts[sid],
                )
            expected = self.cfg.sha256[sid] if self.cfg.sha256 else None
            if expected is not None and (actual := self._digests.get(sid) or sha256_file(local)) != expected:
                where = "on the server" if local != url else ""
                why = (f"shard {url} sha256 mismatch (manifest says {expected}, file has {actual}): "
                       f"it changed {where + ' ' if where else ''}after the build")
                idx = ShardIndex(url, idx.samples, dict.fromkeys(range(len(idx)), why), idx.error or why)
                if self._cache is not None and local != url:
                    self._cache.discard(local)  # a later run fetches it again rather than trust this copy
            self._index[sid] = idx
        return self._index[sid]

    def _file(self, sid: int) -> BinaryIO:
        if sid in self._files:
            self._files.move_to_end(sid)
        else:
            self._files[sid] = self._with_local(sid, lambda local: open(local, "rb"))[1]
            while len(self._files) > self.max_open:
                self._files.popitem(last=False)[1].close()
        return self._files[sid]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def load(self, sid: int, i: int) -> tuple[dict[str, Any] | None, str, str | None]:
        """Raw sample i of shard sid -> (sample or None, key, reason it is unusable or None)."""
        url = self.cfg.urls[sid]
        try:
            idx = self.index(sid)
        except (DiskFullError, NotWritableError):
            raise  # the shard cache's disk, not the shard: the run cannot go on
        except OSError as exc:
            return None, f"{Path(url).name}#{i}", f"cannot open shard: {type(exc).__name__}: {exc}"
        if i >= len(idx):
            why = f" ({idx.error})" if idx.error else ""
            return None, f"{Path(url).name}#{i}", (
                f"missing: the shard has {len(idx)} readable samples, {self.cfg.counts[sid]} expected{why}"
            )
        key, members = idx.samples[i]
        if i in idx.bad:
            return None, key, idx.bad[i]
        missing = [f for f in self.cfg.fields if f not in members]
        if missing:
            return None, key, f"missing field(s) {missing} (has {sorted(members)})"
        sample: dict[str, Any] = {"__key__": key, "__url__": url}
        f = self._file(sid)
        for ext, (offset, size) in sorted(members.items(), key=lambda kv: kv[1][0]):
            f.seek(offset)
            data = f.read(size)
            if len(data) != size:
                return None, key, f"field {ext!r} truncated ({len(data)} of {size} bytes)"
            sample[ext] = data
        return sample, key, None

    def decode(self, sid: int, i: int) -> tuple[Any, str, str | None]:
        """(decoded value or None, key, corrupt reason or None); value None + reason None = filtered."""
        sample, key, reason = self.load(sid, i)
        if reason is not None:
            return None, key, reason
        try:
            return self.cfg.decode(sample), key, None
        except Exception as exc:  # any decoder failure marks the sample corrupt, never the run
            return None, key, f"decode failed: {type(exc).__name__}: {exc}"


def _make_batch(plan: _Plan, reader: _Reader, j: int) -> _Item:
    cfg = plan.cfg
    lo, hi = plan.batch_range(j)
    refs = [plan.locate(int(p)) for p in plan.positions(lo, hi)]
    values: list[Any] = []
    corrupt: list[tuple[str, str, str]] = []
    filtered = 0
    # Read in file order (one seek run per shard), keep the shuffled order for the batch.
    results: dict[int, tuple[Any, str, str | None]] = {}
    for n in sorted(range(len(refs)), key=lambda n: refs[n]):
        results[n] = reader.decode(*refs[n])
    for n, (sid, _) in enumerate(refs):
        value, key, reason = results[n]
        if reason is not None:
            corrupt.append((key, cfg.urls[sid], reason))
        elif value is None:
            filtered += 1
        else:
            values.append(value)
    filler_key = None
    if not values:
        value, filler_key = _filler(plan, reader, hi)
        values = [value]
    return _Item(plan.epoch, j, cfg.collate(values), hi - lo, len(values) if filler_key is None else 0,
                 filtered, corrupt, filler_key)


_FILLER_SCAN_LIMIT = 1000


def _filler(plan: _Plan, reader: _Reader, after: int) -> tuple[Any, str]:
    """The first usable sample after sequence entry ``after`` of this rank (wrapping), else of the
    whole layout: a function of the plan only, so resumed and uninterrupted runs agree.

    Gives up after _FILLER_SCAN_LIMIT unusable candidates: by then the data or the decode function
    is broken, and the reasons say which.
    """
    reasons: list[str] = []

    def candidates() -> Iterator[int]:
        for lo, hi in ((after, plan.used), (0, after)):
            for start in range(lo, hi, 64):
                yield from (int(p) for p in plan.positions(start, min(hi, start + 64)))
        yield from range(plan.cfg.num_samples)

    for n, p in enumerate(candidates()):
        if n == _FILLER_SCAN_LIMIT:
            break
        value, key, reason = reader.decode(*plan.locate(p))
        if reason is None and value is not None:
            return value, key
        if len(reasons) < 3:
            reasons.append(f"{key}: {reason or 'decode returned None'}")
    raise RuntimeError(
        f"rank {plan.cfg.rank} epoch {plan.epoch}: a batch had no usable sample and neither had the next "
        f"{min(n, _FILLER_SCAN_LIMIT)} candidates; check the shards and the decode function. First failures: "
        + "; ".join(reasons)
    )


def leave_sigint_to_the_parent(worker_id: int) -> None:
    """Data workers ignore SIGINT. A Ctrl-C in a terminal reaches every process of the foreground group, and a
    worker that takes it exits (torch's worker loop swallows the KeyboardInterrupt), so the training process,
    finishing its step before it checkpoints and stops (omni.train), would find its loader dead. Workers still
    end with their parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _identity(x: Any) -> Any:
    return x


class _EpochBatches(IterableDataset):
    """Batches start, start+1, ... of one epoch; data worker w builds every num_workers-th one."""

    def __init__(self, cfg: _Config, epoch: int, start: int, indexes: dict[int, ShardIndex]) -> None:
        super().__init__()
        self.cfg, self.epoch, self.start, self.indexes = cfg, epoch, start, indexes

    def __iter__(self) -> Iterator[_Item]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        plan = _Plan(self.cfg, self.epoch)
        reader = _Reader(self.cfg, self.indexes)
        try:
            # torch's in-order DataLoader asks workers round robin, so worker wid's k-th batch is
            # delivered as the (wid + k*nw)-th item: exactly batch start + wid + k*nw.
            for j in range(self.start + wid, plan.num_batches, nw):
                try:
                    item = _make_batch(plan, reader, j)
                except (DatasetError, OSError, MissingDependency) as exc:
                    if info is None or not isinstance(exc, (DatasetError, DiskFullError, NotWritableError,
                                                            MissingDependency)):
                        raise
                    # torch re-raises a worker's exception with its traceback in the message: hand the
                    # one-line error to the loader instead, which raises it in the training process.
                    item = _Item(self.epoch, j, None, 0, 0, 0, [], None, error=exc)
                yield item
                if item.error is not None:
                    return
        finally:
            reader.close()


# ---------------------------------------------------------------------------------------------
# The loader
# ---------------------------------------------------------------------------------------------


def _rank_defaults(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        r, w = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        r, w = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return (r if rank is None else rank), (w if world_size is None else world_size)


class ShardLoader:
    """Seeded, rank- and worker-split batches from webdataset shards, with exact resume.

    source:      a dataset directory holding manifest.json (use ``split``), shard paths, one path,
                 or a brace pattern ("data/train-{000..009}.tar"). Each may be a URL: a dataset URL
                 ("https://host/ds", "s3://bucket/ds", or its manifest.json), shard URLs ("gs://b/train-0.tar",
                 "pipe:curl -s https://host/train-{000..009}.tar"); see the module docstring.
    decode:      raw sample dict {"__key__", "__url__", field: bytes} -> value for ``collate``
                 (e.g. an omni Sample); raising marks the sample corrupt, returning None drops it.
                 Must be picklable for spawned workers (a module-level function or object).
    collate:     list of decoded values -> batch (e.g. omni.packing.Packer()). Never given [].
    batch_size:  the most samples in a batch. Sizes are spread evenly (differ by at most one across
                 all batches and ranks): 9 samples at batch_size 8 give batches of 5 and 4.
    rank, world_size: default to torch.distributed when initialised, else $RANK/$WORLD_SIZE, else 0/1.
    fields:      required fields (extensions); a sample lacking one is corrupt.
    counts:      per-shard sample counts; read from the manifest for a dataset directory, else
                 counted by scanning the tar headers once.
    kind:        the kinds of data the caller reads ("images", "speech", "episodes", "text": see
                 omni.data.shards.DATASET_KINDS): a dataset directory whose builder writes another kind is a
                 DatasetError naming both.
    max_corrupt_fraction: fail (DatasetError) when corrupt/seen in an epoch exceeds it (checked once
                 ``corrupt_check_after`` samples were seen, and at the end of every epoch). Recipes
                 expose it as the config key ``max_corrupt_fraction``.
    remote:      how remote shards are fetched and cached (omni.data.remote.RemoteOptions: cache folder and
                 size limit, retries, storage options); by default from $OMNI_SHARD_CACHE, $OMNI_SHARD_CACHE_GB ...

    Iterating yields the remaining batches of the current epoch, then moves to the next epoch.
    ``state_dict()`` is the position of the next batch; save it with the model checkpoint.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        decode: Callable[[dict[str, Any]], Any],
        collate: Callable[[list[Any]], Any],
        batch_size: int,
        *,
        split: str = "train",
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_window: int = 8192,
        drop_last: bool = False,
        fields: Sequence[str] = (),
        counts: Sequence[int] | None = None,
        max_corrupt_fraction: float = 0.01,
        corrupt_check_after: int = 100,
        prefetch_factor: int = 2,
        multiprocessing_context: str | None = None,
        kind: str | Sequence[str] | None = None,
        remote: RemoteOptions | None = None,
    ) -> None:
        digests: list[str | None] = []  # checked against each shard when first indexed (manifest only)
        sizes: list[int | None] = []
        if isinstance(source, (str, os.PathLike)) and (
            is_dataset_url(os.fspath(source)) or (not is_remote(os.fspath(source)) and Path(source).is_dir())
        ):
            if counts is not None:
                raise ValueError("counts comes from the manifest when source is a dataset directory")
            urls, counts, digests, sizes = _manifest_plan(source, split, kind, remote)
        else:
            urls = _expand_source(source)
        if not urls:
            raise ValueError("no shards given")
        for url in urls:
            if is_remote(url):
                continue
            if "://" in url:
                raise ValueError(f"{url!r}: not a shard URL omni reads (http://, https://, s3://, gs://, pipe:CMD or "
                                 "a local path)")
            if not os.path.isfile(url):
                raise FileNotFoundError(f"shard {url!r} does not exist")
        if any(is_remote(u) for u in urls) and remote is None:
            remote = RemoteOptions()
        scanned: dict[int, ShardIndex] = {}
        if counts is None:
            # Bare shards: their headers give the counts. Remote ones are fetched for that (into the cache), once
            # per run; a manifest (or counts=) spares it.
            early = _Reader(_Config(urls=tuple(urls), counts=(0,) * len(urls), decode=decode, collate=collate,
                                    batch_size=1, rank=0, world_size=1, seed=0, shuffle=False, shuffle_window=1,
                                    drop_last=False, fields=(), remote=remote))
            scanned = {sid: index_shard(early.path(sid)) for sid in range(len(urls))}
            counts = [len(scanned[sid]) for sid in range(len(urls))]
        if len(counts) != len(urls):
            raise ValueError(f"{len(counts)} counts for {len(urls)} shards")
        rank, world_size = _rank_defaults(rank, world_size)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
        if batch_size < 1 or shuffle_window < 1 or num_workers < 0 or seed < 0:
            raise ValueError("batch_size and shuffle_window must be >= 1, num_workers and seed >= 0")
        if not 0.0 <= max_corrupt_fraction <= 1.0:
            raise ValueError(f"max_corrupt_fraction must be in [0, 1], got {max_corrupt_fraction}")
        self.cfg = _Config(
            urls=tuple(urls), counts=tuple(int(c) for c in counts), decode=decode, collate=collate,
            batch_size=int(batch_size), rank=int(rank), world_size=int(world_size), seed=int(seed),
            shuffle=bool(shuffle), shuffle_window=int(shuffle_window), drop_last=bool(drop_last),
            fields=tuple(f.lower() for f in fields), sha256=tuple(digests), sizes=tuple(sizes), remote=remote,
        )
        self.num_workers = num_workers
        self.max_corrupt_fraction = max_corrupt_fraction
        self.corrupt_check_after = corrupt_check_after
        self.prefetch_factor = prefetch_factor
        self.multiprocessing_context = multiprocessing_context
        self.epoch = 0
        self.batches_done = 0
        self.stats = self._fresh_stats()
        self._generation = 0
        self.last_batch_was_filler = False  # the batch just yielded repeats a sample (see module doc)
        # corrupt samples logged this epoch: shard -> reasons given a line; shard -> samples counted without one
        self._log_epoch: int | None = None
        self._logged: dict[str, set[str]] = {}
        self._unlogged: dict[str, int] = {}
        self._indexes: dict[int, ShardIndex] = scanned  # shard headers, scanned once per run
        if self.cfg.num_batches == 0:
            raise ValueError(
                f"{self.cfg.num_samples} samples on {self.cfg.world_size} ranks give no batch of "
                f"{self.cfg.batch_size}{' with drop_last' if drop_last else ''}"
            )
        fewest = self.cfg.num_samples // self.cfg.world_size
        if not drop_last and fewest < self.cfg.num_batches:
            warnings.warn(
                f"{self.cfg.num_samples} samples on {self.cfg.world_size} ranks with batch_size "
                f"{self.cfg.batch_size}: some ranks have fewer samples than the {self.cfg.num_batches} "
                "batches every rank must yield, so they repeat a sample each epoch", stacklevel=2,
            )

    # -- sizes -------------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        """Samples in the whole dataset (all ranks)."""
        return self.cfg.num_samples

    def __len__(self) -> int:
        """Batches per epoch on this rank (identical on every rank)."""
        return self.cfg.num_batches

    # -- position ----------------------------------------------------------------------------

    @staticmethod
    def _fresh_stats() -> dict[str, Any]:
        # corrupt_shards: shard path -> [corrupt samples, the first one's key and reason] (for the error)
        return {"seen": 0, "valid": 0, "corrupt": 0, "filtered": 0, "fillers": 0, "corrupt_keys": [],
                "corrupt_shards": {}}

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch``; a no-op when already in it (so it is safe after a resume)."""
        if epoch != self.epoch:
            self.epoch, self.batches_done = int(epoch), 0
            self.stats = self._fresh_stats()

    def _fingerprint(self) -> dict[str, int]:
        c = self.cfg
        return {"num_samples": c.num_samples, "num_shards": len(c.urls), "world_size": c.world_size,
                "batch_size": c.batch_size, "seed": c.seed, "num_batches": c.num_batches}

    def state_dict(self) -> dict[str, Any]:
        """Position of the next batch plus this epoch's corruption counters (identical positions on
        every rank, so rank 0's state resumes all of them)."""
        stats = {k: v for k, v in self.stats.items() if k not in ("corrupt_keys", "corrupt_shards")}
        return {"epoch": self.epoch, "batches_done": self.batches_done, **stats,
                "corrupt_keys": list(self.stats["corrupt_keys"]),
                "corrupt_shards": {k: list(v) for k, v in self.stats["corrupt_shards"].items()},
                "plan": self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        saved = state.get("plan", {})
        mine = self._fingerprint()
        changed = {k: (saved[k], mine[k]) for k in mine if k in saved and saved[k] != mine[k]}
        if changed:
            # The batch layout differs, so exact resume is impossible; keep the epoch and the
            # fraction of it already done rather than fail a long run.
            if saved.get("num_batches"):
                done = done * mine["num_batches"] // int(saved["num_batches"])
            warnings.warn(f"data loader resumed with a different setup {changed}: the epoch continues at "
                          f"batch {done} of {mine['num_batches']} but samples may repeat or be skipped",
                          stacklevel=2)
        self.epoch, self.batches_done = epoch, min(done, mine["num_batches"])
        self.stats = self._fresh_stats()
        for k in ("seen", "valid", "corrupt", "filtered", "fillers"):
            self.stats[k] = int(state.get(k, 0))
        self.stats["corrupt_keys"] = list(state.get("corrupt_keys", []))
        self.stats["corrupt_shards"] = {k: list(v) for k, v in state.get("corrupt_shards", {}).items()}

    # -- iteration ---------------------------------------------------------------------------

    def _items(self, epoch: int, start: int) -> Iterator[_Item]:
        if self.num_workers == 0:
            return iter(_EpochBatches(self.cfg, epoch, start, self._indexes))  # fills the cache lazily
        # Index this epoch's shards here, once per run, and hand the workers only those: workers
        # are new processes every epoch, and each would otherwise scan every shard again.
        plan = _Plan(self.cfg, epoch)
        lo, hi = plan.rank_start, plan.rank_start + plan.rank_n
        first = int(np.searchsorted(plan.layout_start, lo, side="right")) - 1
        last = int(np.searchsorted(plan.layout_start, max(hi - 1, lo), side="right")) - 1
        reader = _Reader(self.cfg, self._indexes)
        needed = {}
        for slot in range(max(first, 0), min(last, len(self.cfg.urls) - 1) + 1):
            sid = int(plan.shard_order[slot])
            if sid not in self._indexes and not reader.cached(sid):
                # Fetching here would download the rank's whole epoch before the first batch (and past the
                # cache's limit): workers fetch remote shards on demand, sharing the cache. Shards already in
                # the cache are indexed here, once per run, like local ones.
                continue
            needed[sid] = reader.index(sid)
        dataset = _EpochBatches(self.cfg, epoch, start, needed)
        loader = DataLoader(
            dataset, batch_size=None, num_workers=self.num_workers, collate_fn=_identity,
            prefetch_factor=self.prefetch_factor, multiprocessing_context=self.multiprocessing_context,
            worker_init_fn=leave_sigint_to_the_parent,
        )
        return iter(loader)

    def __iter__(self) -> Iterator[Any]:
        k = len(self)
        if self.batches_done >= k:  # the previous epoch was used up without exhausting an iterator
            self.epoch, self.batches_done = self.epoch + 1, 0
        if self.batches_done == 0:
            self.stats = self._fresh_stats()
        self._generation += 1
        return self._iterate(self._generation, self.epoch, self.batches_done)

    def _iterate(self, generation: int, epoch: int, start: int) -> Iterator[Any]:
        for item in self._items(epoch, start):
            if item.error is not None:
                raise item.error
            if generation != self._generation:
                raise RuntimeError("this ShardLoader was iterated again or repositioned; the older iterator is stale")
            if item.epoch != self.epoch or item.index != self.batches_done:
                raise RuntimeError(f"batch order broken: got epoch {item.epoch} batch {item.index}, "
                                   f"expected epoch {self.epoch} batch {self.batches_done}")
            self._account(item)
            self.last_batch_was_filler = item.filler_key is not None
            last = item.index + 1 == len(self)
            self._check(final=last)
            if last:
                self._log_unlogged(epoch)
            # The position always names the NEXT batch, so a checkpoint taken while this batch
            # trains resumes right after it; after the last batch that is the next epoch's start.
            self.epoch, self.batches_done = (epoch + 1, 0) if last else (epoch, item.index + 1)
            yield item.data

    def _account(self, item: _Item) -> None:
        s = self.stats
        s["seen"] += item.slots
        s["valid"] += item.valid
        s["filtered"] += item.filtered
        s["corrupt"] += len(item.corrupt)
        if self._log_epoch != item.epoch:
            self._log_epoch, self._logged, self._unlogged = item.epoch, {}, {}
        for key, url, reason in item.corrupt:
            # A line per new reason (at most 3) of each shard; the rest are counted and summed up in one line at
            # the end of the epoch: a changed or cut shard would otherwise print a line per sample.
            reasons = self._logged.setdefault(url, set())
            if reason not in reasons and len(reasons) < 3:
                reasons.add(reason)
                logger.warning("corrupt sample %r in %s skipped: %s", key, url, reason)
            else:
                self._unlogged[url] = self._unlogged.get(url, 0) + 1
            if len(s["corrupt_keys"]) < 20:
                s["corrupt_keys"].append(key)
            if url in s["corrupt_shards"]:
                s["corrupt_shards"][url][0] += 1
            elif len(s["corrupt_shards"]) < 20:
                s["corrupt_shards"][url] = [1, f"{key!r}: {reason}"]
        if item.filler_key is not None:
            s["fillers"] += 1
            logger.warning("epoch %d batch %d of rank %d had no usable sample; it repeats sample %r so every "
                           "rank keeps the same number of batches", item.epoch, item.index, self.cfg.rank,
                           item.filler_key)

    def _log_unlogged(self, epoch: int) -> None:
        """One line per shard for the corrupt samples ``_account`` counted without a line each."""
        if self._log_epoch == epoch:
            for url, n in self._unlogged.items():
                logger.warning("%s: %d more sample%s skipped as corrupt in epoch %d, for the reasons above (not "
                               "logged one by one)", url, n, "s" if n > 1 else "", epoch)
            self._unlogged = {}

    def _check(self, final: bool) -> None:
        s = self.stats
        seen, bad = s["seen"], s["corrupt"]
        if seen == 0 or (not final and seen < self.corrupt_check_after):
            return
        if bad / seen > self.max_corrupt_fraction:
            shards = "; ".join(f"{url}: {n} corrupt, first {first}" for url, (n, first) in
                               list(s["corrupt_shards"].items())[:5])
            raise DatasetError(
                f"{bad} of {seen} samples ({bad / seen:.2%}) read by rank {self.cfg.rank} in epoch {self.epoch} "
                f"were corrupt, more than max_corrupt_fraction={self.max_corrupt_fraction:g}. By shard: {shards}. "
                "Rebuild or fix the shards (`omni data verify DIR` checks a dataset), or accept more corrupt samples: "
                "`--set max_corrupt_fraction=0.05` for a recipe, ShardLoader(max_corrupt_fraction=0.05) in Python."
            )
