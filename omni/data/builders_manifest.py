"""A folder of audio plus a manifest of file + transcript -> speech shards for recipes/whisper.py.

The manifest conventions read (by suffix):

- ``.csv``: the ``audiofolder`` ``metadata.csv`` - columns ``file_name`` + ``transcription`` (or ``text`` /
  ``sentence``);
- ``.tsv``: Common Voice's ``train.tsv`` / ``dev.tsv`` / ``test.tsv`` - columns ``path`` + ``sentence``, the
  audio in ``clips/`` beside the TSV;
- ``.jsonl`` / ``.json``: one JSON object a line, as NeMo writes - ``audio_filepath`` + ``text``.

Paths are relative to the manifest's folder (or ``audio_dir``; Common Voice's ``clips/`` is looked in too).
Shards hold ``<key>.flac|wav|mp3|ogg|opus`` (the file's bytes; other formats libsndfile reads as 16-bit FLAC),
``<key>.txt`` and ``<key>.json``, as ``omni data librispeech`` writes.
"""

from __future__ import annotations

import csv
import json
import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from omni.data.builders_hf import (
    KNOWN_SPLITS,
    Skipped,
    audio_sample,
    check_audio,
    holdout,
    pick_column,
    rename_splits,
    split_seed,
    warn_skips,
)
from omni.data.shards import SPLIT_RE, Build, fingerprint_files

FILE_COLUMNS = ("file_name", "audio_filepath", "path", "file", "filename", "audio", "audio_path")
TEXT_COLUMNS = ("transcription", "text", "sentence", "transcript", "normalized_text")
MANIFEST_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json")
CV_CLIPS = "clips"  # Common Voice keeps the audio here, beside its TSVs


def read_rows(path: Path) -> tuple[list[str], list[tuple[int, dict[str, Any]]]]:
    """(columns, [(line number, row)]) of a CSV, TSV or JSON-lines manifest. A JSON line that does not parse or
    is not an object is a ValueError naming the line."""
    suffix = path.suffix.lower()
    if suffix not in MANIFEST_SUFFIXES:
        raise ValueError(f"{path}: a manifest is a {', '.join(MANIFEST_SUFFIXES)} file (by its suffix)")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})") from None
    if suffix in (".csv", ".tsv"):
        # Common Voice TSVs quote nothing: a sentence may hold a '"' that csv would take for a quote
        quoting = csv.QUOTE_NONE if suffix == ".tsv" else csv.QUOTE_MINIMAL
        reader = csv.DictReader(text.splitlines(), delimiter="\t" if suffix == ".tsv" else ",", quoting=quoting)
        columns = list(reader.fieldnames or [])
        rows = [(reader.line_num, row) for row in reader]
        return columns, rows
    columns: list[str] = []
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not a JSON object ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: not a JSON object (a {type(row).__name__})")
        columns.extend(k for k in row if k not in columns)
        out.append((lineno, row))
    return columns, out


def manifest_split(path: Path, default: str) -> str:
    """A manifest's split: its stem (``test.tsv``) or its folder (``train/metadata.csv``) when that names a
    split, else ``default``."""
    for name in (path.stem.lower(), path.parent.name.lower()):
        if name in KNOWN_SPLITS:
            return name
    return default


def _locate(name: str, base: Path, manifest: Path) -> Path | None:
    p = Path(name).expanduser()
    if p.is_absolute():
        return p if p.is_file() else None
    for folder in (base, manifest.parent / CV_CLIPS):
        if (folder / p).is_file():
            return folder / p
    return None


def build_audio_manifest(
    out: str | os.PathLike,
    *,
    manifest: Sequence[str | os.PathLike],
    audio_dir: str | os.PathLike | None = None,
    audio_column: str | None = None,
    text_column: str | None = None,
    split: str | None = None,
    rename: Mapping[str, str] | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
    shard_size: int = 2000,
    quiet: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """Manifests of audio file + transcript (``read_rows``) -> speech shards, each split in a seeded shuffled
    order. One manifest is one split (``split``, else ``manifest_split``: ``train`` when its name says none);
    several give a split each by name (``train.tsv``, ``dev.tsv``, ``test.tsv``), several of one name share it.
    ``val_fraction`` holds a seeded share of a lone split out as ``val``; ``rename`` maps split names.

    Skipped, one warning each and counted in the manifest (``skipped``, ``skipped_files``): a row whose audio
    file is missing or does not decode, an empty transcript, and an audio file an earlier row (in any split:
    no clip is trained and scored on) already named. A wrong column name is a ValueError listing the columns."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if split is not None and not SPLIT_RE.match(split):
        raise ValueError(f"split {split!r} must match {SPLIT_RE.pattern}")
    paths = [Path(m) for m in manifest]
    if not paths:
        raise ValueError("no manifest given")
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"manifest {p}: no such file")
    if split is not None and len(paths) > 1:
        raise ValueError("split names the split of one manifest; several are split by their names (train.tsv, "
                         "dev.tsv ...): use rename to change those")
    base_dir = Path(audio_dir) if audio_dir is not None else None
    if base_dir is not None and not base_dir.is_dir():
        raise FileNotFoundError(f"audio_dir {base_dir} is not a folder")
    skipped: list[Skipped] = []
    per_split: dict[str, list[tuple[str, Path, str, str]]] = {}  # split -> (where, audio, relative name, text)
    seen: dict[Path, str] = {}
    for p in paths:
        columns, rows = read_rows(p)
        where = str(p)
        file_col = pick_column(columns, audio_column, FILE_COLUMNS, "--audio-column", where)
        text_col = pick_column(columns, text_column, TEXT_COLUMNS, "--text-column", where)
        if file_col is None or text_col is None:
            what, looked, flag = (("audio file", FILE_COLUMNS, "--audio-column") if file_col is None
                                  else ("transcript", TEXT_COLUMNS, "--text-column"))  # fmt: skip
            raise ValueError(f"{where}: no {what} column (looked for {', '.join(looked)}; name it with {flag}); "
                             f"its columns: {', '.join(columns) or 'none'}")
        name = split if split is not None else manifest_split(p, "train")
        base = base_dir if base_dir is not None else p.parent
        items = per_split.setdefault(name, [])
        for lineno, row in rows:
            at = f"{p}:{lineno}"
            rel, text = row.get(file_col), row.get(text_col)
            if not isinstance(rel, str) or not rel.strip():
                skipped.append(Skipped(at, "audio not found", f"no audio file in column {file_col!r}"))
                continue
            audio = _locate(rel.strip(), base, p)
            if audio is None:
                skipped.append(Skipped(at, "audio not found", f"audio {base / rel.strip()} not found"))
                continue
            if not isinstance(text, str) or not text.strip():
                skipped.append(Skipped(at, "empty text", f"{rel} has an empty transcript ({text_col!r})"))
                continue
            key = audio.resolve()
            if key in seen:
                skipped.append(Skipped(at, "repeated id", f"audio {rel} is already named at {seen[key]}"))
                continue
            seen[key] = at
            try:  # checked before any holdout, so a val share is a share of usable clips
                check_audio(audio.read_bytes())
            except ValueError as exc:
                skipped.append(Skipped(at, "unreadable audio", f"{audio}: {exc}"))
                continue
            items.append((at, audio, rel.strip(), text.strip()))
    split_names = rename_splits(list(per_split), rename, ", ".join(map(str, paths)))
    per_split = {split_names[n]: items for n, items in per_split.items()}
    if val_fraction > 0 and len(per_split) > 1:
        raise ValueError(f"val_fraction holds a share of one split out; these manifests give {', '.join(per_split)}")
    per_split = holdout(per_split, val_fraction, seed)
    files = paths + [a for items in per_split.values() for _, a, _, _ in items]
    root = Path(os.path.commonpath([str(f.resolve().parent) for f in files]))
    args = {"audio_column": audio_column, "text_column": text_column, "split": split,
            "rename": dict(sorted((rename or {}).items())), "val_fraction": val_fraction, "seed": seed}
    with Build(
        out, "audio", args,
        source={"manifests": [str(p.resolve()) for p in paths], "files": len(files),
                "stat_sha256": fingerprint_files([f.resolve() for f in files], root)},
        shard_size=shard_size, quiet=quiet, force=force,
    ) as build:  # fmt: skip
        if (done := build.up_to_date()) is not None:
            return done
        build.start()
        stats: dict[str, Any] = {}
        kept = 0
        empty: list[str] = []
        for name, items in per_split.items():
            order = np.random.default_rng(split_seed(seed, name)).permutation(len(items))
            seconds = longest = 0.0
            k = 0
            with build.split(name, total=len(items)) as w:
                for j in order:
                    at, audio, rel, text = items[j]
                    try:  # checked above; a file changed since is skipped like any unreadable one
                        ext, data, info = audio_sample(audio.read_bytes())
                    except (ValueError, OSError) as exc:
                        skipped.append(Skipped(at, "unreadable audio", f"{audio}: {exc}"))
                        continue
                    meta = {"id": rel, "source": at, "sample_rate": info.samplerate,
                            "duration": round(info.frames / info.samplerate, 4)}
                    w.write({"__key__": f"{name}_{k:08d}", ext: data, "txt": text, "json": meta})
                    k += 1
                    seconds += meta["duration"]
                    longest = max(longest, meta["duration"])
            kept += k
            if not k:
                empty.append(name)
            stats[name] = {"hours": round(seconds / 3600, 4), "longest_seconds": longest}
        warn_skips(skipped, kept, ", ".join(map(str, paths)))
        if empty:
            warnings.warn(f"split(s) {', '.join(empty)} kept no utterances", stacklevel=2)
        return build.finish(
            kind="speech",
            manifests=[str(p.resolve()) for p in paths],
            split_stats=stats,
            skipped=dict(Counter(s.kind for s in skipped)),
            skipped_files=[{"path": s.where, "reason": s.reason} for s in skipped],
            fields={
                "flac|wav|mp3|ogg|opus": "the audio file's bytes (other formats libsndfile reads: 16-bit FLAC)",
                "txt": "transcript as in the manifest (whitespace stripped)",
                "json": "{id: the file as the manifest names it, source: manifest:line, sample_rate, duration}",
            },
        )
