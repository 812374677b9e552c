"""Hugging Face ``datasets`` on disk -> omni shards: ``save_to_disk`` folders and parquet / arrow files.

Read with pyarrow alone (``pip install 'omni[data]'``): ``datasets`` itself is not needed. What the rows hold
decides what is written, in the layouts the other builders write, so the recipes train on it with ``--data``:

- an image column (+ a label column): ``<key>.jpg|png`` (the encoded bytes as stored; other formats re-encoded
  as PNG) + ``<key>.cls`` + ``<key>.json``, manifest ``classes`` - as ``omni data images`` (recipes/vit.py);
- an audio column + a text column: ``<key>.flac|wav|mp3|ogg|opus`` (the bytes as stored; decoded arrays as
  16-bit FLAC) + ``<key>.txt`` + ``<key>.json`` - as ``omni data librispeech`` (recipes/whisper.py);
- a text column alone: ``<key>.txt`` + ``<key>.json`` - as ``omni data text`` (recipes/lm.py ``text=[OUT]``).

Rows that cannot be used (an image or audio that does not decode or is missing, an empty transcript or text, a
row without a label, an id seen before in the split) are skipped with one warning each and counted in the
manifest (``skipped``: per reason, ``skipped_rows``: where and why).
"""

from __future__ import annotations

import glob as globlib
import hashlib
import io
import json
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from omni.data.shards import SPLIT_RE, Build, fingerprint_files

IMAGE_COLUMNS = ("image", "img")
AUDIO_COLUMNS = ("audio",)
TEXT_COLUMNS = ("text", "sentence", "transcript", "transcription")
LABEL_COLUMNS = ("label", "labels")
ID_COLUMNS = ("id",)
# File stems / folder names that name a split (the Hub's data/train-00000-of-00002.parquet, train/*.parquet).
KNOWN_SPLITS = ("train", "validation", "valid", "val", "dev", "test", "eval")
DATA_SUFFIXES = (".parquet", ".arrow")
AUDIO_EXTS = ("flac", "wav", "mp3", "ogg", "opus")  # what the speech recipes read (omni.data.clips.AUDIO_FIELDS)


@dataclass(frozen=True)
class Skipped:
    """A row (or manifest line) left out of a build, and why."""

    where: str  # "<split>[<row>]" of the source, or "<manifest>:<line>"
    kind: str  # one of SKIP_KINDS: the manifest counts skips per kind
    reason: str


SKIP_KINDS = ("unreadable image", "image not found", "unreadable audio", "audio not found", "empty text",
              "no label", "repeated id")  # fmt: skip


def require_pyarrow() -> Any:
    """The pyarrow module, or ImportError saying how to install it (one line for the CLI)."""
    try:
        import pyarrow
    except ImportError:
        raise ImportError("omni data hf reads parquet and arrow files with pyarrow: pip install 'omni[data]' "
                          "(or pip install pyarrow)") from None
    return pyarrow


# -- finding the splits -----------------------------------------------------------------------------
@dataclass
class Source:
    """The files of a dataset, per split, and the features its metadata declares (``datasets`` JSON)."""

    root: Path
    splits: dict[str, list[Path]]
    features: dict[str, Any] = field(default_factory=dict)
    layout: str = "files"  # "dataset_dict", "dataset" (save_to_disk) or "files" (parquet / arrow)


def _split_of(path: Path, root: Path, default: str) -> str:
    """The split a data file belongs to by the Hub's conventions: its file stem up to the first '-', '_' or
    '.' (``train-00000-of-00001.parquet``, ``test.parquet``) or a folder between it and ``root`` named as a
    split (``train/0.parquet``); else ``default``."""
    stem = re.split(r"[-_.]", path.name, maxsplit=1)[0].lower()
    if stem in KNOWN_SPLITS:
        return stem
    try:
        parents = path.parent.relative_to(root).parts
    except ValueError:
        parents = ()
    for part in reversed(parents):
        if part.lower() in KNOWN_SPLITS:
            return part.lower()
    return default


def _data_files(folder: Path) -> list[Path]:
    """The arrow files of one ``save_to_disk`` folder, in the order its state.json lists them."""
    state = folder / "state.json"
    try:
        names = [f["filename"] for f in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{state}: not a datasets state.json with '_data_files' ({exc})") from None
    files = [folder / n for n in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{state} lists {', '.join(missing)}, which is missing: copy the whole dataset folder")
    return files


def _info_features(folder: Path) -> dict[str, Any]:
    info = folder / "dataset_info.json"
    if not info.is_file():
        return {}
    try:
        features = json.loads(info.read_text(encoding="utf-8")).get("features") or {}
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"{info}: not valid JSON ({exc})") from None
    return features if isinstance(features, dict) else {}


def find_source(src: str | os.PathLike, split: str = "train") -> Source:
    """The splits and files of ``src``: a ``save_to_disk`` folder of a DatasetDict (``dataset_dict.json``: one
    split per folder) or of a Dataset (``state.json``: one split, ``split``), a parquet / arrow file, a folder
    of them (searched recursively), or a glob pattern. Files are split by name (``_split_of``)."""
    text = str(src)
    root = Path(src)
    if root.is_dir() and (root / "dataset_dict.json").is_file():
        try:
            names = json.loads((root / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{root / 'dataset_dict.json'}: not a datasets dataset_dict.json ({exc})") from None
        splits = {n: _data_files(root / n) for n in names}
        features: dict[str, Any] = {}
        for n in names:
            features = features or _info_features(root / n)
        return Source(root, splits, features, "dataset_dict")
    if root.is_dir() and (root / "state.json").is_file():
        return Source(root, {split: _data_files(root)}, _info_features(root), "dataset")
    if root.is_file():
        files, base = [root], root.parent
    elif root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES)
        base = root
        if not files:
            raise FileNotFoundError(f"{root}: no save_to_disk dataset (dataset_dict.json or state.json) and no "
                                    f"{' or '.join(DATA_SUFFIXES)} files inside")
    elif any(c in text for c in "*?["):
        files = sorted(Path(p) for p in globlib.glob(text, recursive=True) if Path(p).is_file())
        if not files:
            raise FileNotFoundError(f"{text}: the pattern matches no files")
        base = Path(os.path.commonpath([str(p.parent) for p in files]))
    else:
        raise FileNotFoundError(f"{text}: no such file or folder")
    bad = [str(p) for p in files if p.suffix not in DATA_SUFFIXES]
    if bad:
        raise ValueError(f"{bad[0]}: not a .parquet or .arrow file")
    splits: dict[str, list[Path]] = {}
    for p in files:
        splits.setdefault(_split_of(p, base, split), []).append(p)
    return Source(base, splits, {}, "files")


# -- reading ----------------------------------------------------------------------------------------
def read_table(path: Path, columns: Sequence[str] | None = None, spill: Path | None = None) -> Any:
    """One parquet or arrow file as a pyarrow Table of ``columns`` (all when None). Arrow files (the IPC stream
    format ``save_to_disk`` writes, or the IPC file format) are memory-mapped: nothing is copied. Parquet is
    decompressed into memory, or with ``spill`` (a file to write) decoded a row group at a time into an
    uncompressed arrow file there, memory-mapped: the build's memory stays bounded, whatever the dataset's size,
    for the disk of the columns read."""
    pa = require_pyarrow()
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            cols = list(columns) if columns is not None else None
            if spill is None:
                return pq.read_table(path, columns=cols, memory_map=True)
            parquet = pq.ParquetFile(path, memory_map=True)
            schema = parquet.schema_arrow
            schema = pa.schema([schema.field(c) for c in cols], metadata=schema.metadata) if cols else schema
            with pa.OSFile(str(spill), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
                for group in range(parquet.num_row_groups):
                    writer.write_table(parquet.read_row_group(group, columns=cols).cast(schema))
            return pa.ipc.open_file(pa.memory_map(str(spill))).read_all()
        source = pa.memory_map(str(path))
        try:
            table = pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not a readable {path.suffix[1:]} file ({' '.join(str(exc).split())})") from None
    return table.select(list(columns)) if columns is not None else table


def read_schema(path: Path) -> Any:
    pa = require_pyarrow()
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_schema(path)
        try:
            return pa.ipc.open_stream(pa.memory_map(str(path))).schema
        except pa.ArrowInvalid:
            return pa.ipc.open_file(pa.memory_map(str(path))).schema
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not a readable {path.suffix[1:]} file ({' '.join(str(exc).split())})") from None


def schema_features(schema: Any) -> dict[str, Any]:
    """The ``datasets`` features a file's schema metadata declares (key "huggingface"), or {}."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw:
        return {}
    try:
        features = json.loads(raw.decode("utf-8")).get("info", {}).get("features") or {}
    except (ValueError, AttributeError):
        return {}
    return features if isinstance(features, dict) else {}


def class_names(feature: Any) -> list[str] | None:
    """The names of a ClassLabel feature (``datasets`` JSON), else None."""
    if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" and isinstance(feature.get("names"), list):
        return [str(n) for n in feature["names"]]
    return None


def pick_column(columns: Sequence[str], given: str | None, defaults: Sequence[str], flag: str, where: str) -> str | None:
    """``given`` when it is a column (else ValueError listing the columns), else the first default present."""
    if given is not None:
        if given not in columns:
            raise ValueError(f"{where}: no column {given!r} ({flag}); its columns: {', '.join(columns)}")
        return given
    lower = {c.lower(): c for c in columns}
    return next((lower[d] for d in defaults if d in lower), None)


# -- checking and encoding one value ----------------------------------------------------------------
def sniff_audio(head: bytes) -> str | None:
    """The extension of encoded audio by its first bytes (the formats the speech recipes read), else None."""
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "opus" if b"OpusHead" in head[:64] else "ogg"
    if head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def check_audio(data: bytes) -> Any:
    """``soundfile.info`` of encoded audio, checked to decode: it has samples and its last one is readable (a cut
    FLAC's header still gives the full length). ValueError says what is wrong."""
    import soundfile as sf

    try:
        info = sf.info(io.BytesIO(data))
        if info.frames < 1:
            raise ValueError("the audio has no samples")
        with sf.SoundFile(io.BytesIO(data)) as f:
            f.seek(info.frames - 1)
            if f.read(1).shape[0] != 1:
                raise ValueError("the audio ends before its header says")
    except (RuntimeError, sf.SoundFileError, TypeError) as exc:  # libsndfile: unknown format, lost sync
        raise ValueError(f"not readable audio ({' '.join(str(exc).split())})") from None
    return info


def flac_bytes(array: np.ndarray, sample_rate: int) -> bytes:
    """Samples (float in [-1, 1] or int16; frames[, channels]) -> 16-bit FLAC bytes."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, array, int(sample_rate), format="FLAC", subtype="PCM_16")
    return buf.getvalue()


def audio_sample(data: bytes) -> tuple[str, bytes, Any]:
    """(extension, bytes, soundfile info) of encoded audio: kept as is when it is a format the recipes read,
    else (AIFF, CAF ... whatever libsndfile decodes) re-encoded as 16-bit FLAC. ValueError when it does not
    decode."""
    info = check_audio(data)
    ext = sniff_audio(data[:64])
    if ext is None:
        import soundfile as sf

        array, rate = sf.read(io.BytesIO(data), dtype="float32")
        data, ext = flac_bytes(array, rate), "flac"
    return ext, data, info


def image_sample(data: bytes) -> tuple[str, bytes]:
    """(extension, bytes) of an encoded image: JPEG and PNG kept as they are (by content), any other format PIL
    decodes re-encoded as PNG (lossless). ValueError when it is not a whole image (omni data images' check)."""
    from omni.data.builders_vision import _sniff, _undecodable

    problem = _undecodable(data)
    if problem is not None:  # PIL names the in-memory file by its address: noise in a warning
        raise ValueError(re.sub(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "the bytes", problem))
    ext = _sniff(data[:8])
    if ext is not None:
        return ext, data
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        img.load()
        if img.mode not in ("1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"):
            img = img.convert("RGBA" if "A" in img.getbands() else "RGB")
        buf = io.BytesIO()
        img.save(buf, format="PNG")
    return "png", buf.getvalue()


def _resolve(path: str, root: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else root / p


def media_bytes(value: Any, root: Path, what: str) -> bytes:
    """The encoded bytes of an Image / Audio cell: {"bytes", "path"} (bytes first, else the file at path,
    relative to the dataset folder), raw bytes, or a path string. FileNotFoundError when there is neither."""
    if isinstance(value, dict):
        if value.get("bytes"):
            return bytes(value["bytes"])
        path = value.get("path")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        if not value:
            raise FileNotFoundError(f"the {what} is empty")
        return bytes(value)
    else:
        path = value
    if not isinstance(path, str) or not path:
        raise FileNotFoundError(f"the {what} has neither bytes nor a path")
    file = _resolve(path, root)
    if not file.is_file():
        raise FileNotFoundError(f"{what} file {file} not found")
    return file.read_bytes()


def audio_value(value: Any, root: Path) -> tuple[str, bytes, dict[str, Any]]:
    """(extension, bytes, {sample_rate, duration}) of an Audio cell: encoded bytes or a path (``media_bytes``),
    or a decoded {"array", "sampling_rate"} (written as 16-bit FLAC)."""
    if isinstance(value, dict) and value.get("array") is not None:
        rate = value.get("sampling_rate")
        if not isinstance(rate, (int, np.integer)) or rate < 1:
            raise ValueError(f"the audio array has no usable sampling_rate ({rate!r})")
        array = np.asarray(value["array"])
        if array.ndim not in (1, 2) or array.shape[0] < 1:
            raise ValueError(f"the audio array has shape {array.shape}; expected (frames,) or (frames, channels)")
        if not np.isfinite(array.astype(np.float64, copy=False)).all():
            raise ValueError("the audio array holds NaN or infinite samples")
        if array.dtype.kind == "f":
            array = array.astype(np.float32)
        elif array.dtype != np.int16:
            raise ValueError(f"the audio array has dtype {array.dtype}; expected float or int16 samples")
        data = flac_bytes(array, int(rate))
        return "flac", data, {"sample_rate": int(rate), "duration": round(array.shape[0] / int(rate), 4)}
    ext, data, info = audio_sample(media_bytes(value, root, "audio"))
    return ext, data, {"sample_rate": info.samplerate, "duration": round(info.frames / info.samplerate, 4)}


# -- the build --------------------------------------------------------------------------------------
def split_seed(seed: int, name: str) -> list[int]:
    """A split's own seed sequence: its order does not change when another split is added."""
    return [seed, int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")]


def holdout(splits: dict[str, list[Any]], val_fraction: float, seed: int, name: str = "val") -> dict[str, list[Any]]:
    """A single split's seeded ``val_fraction`` moved to a split ``name`` (no-op at 0 or with several splits)."""
    if val_fraction <= 0 or len(splits) != 1:
        return splits
    (only, rows), = splits.items()
    if name in splits:
        return splits
    order = np.random.default_rng(split_seed(seed, "holdout")).permutation(len(rows))
    n_val = int(round(val_fraction * len(rows)))
    val = set(order[:n_val].tolist())
    return {only: [r for i, r in enumerate(rows) if i not in val], name: [r for i, r in enumerate(rows) if i in val]}


def rename_splits(names: Sequence[str], rename: Mapping[str, str] | None, where: str) -> dict[str, str]:
    """{source split: dataset split}: ``rename`` applied, every name checked to be a usable split name."""
    rename = dict(rename or {})
    unknown = sorted(set(rename) - set(names))
    if unknown:
        raise ValueError(f"{where}: rename names split(s) {', '.join(unknown)}, which it does not have "
                         f"(splits: {', '.join(names)})")
    out = {}
    for n in names:
        target = rename.get(n, n)
        if not SPLIT_RE.match(target):
            raise ValueError(f"{where}: split name {target!r} is not usable (letters, digits, '_' and '-'); "
                             f"rename it: --rename {n}=NAME")
        out[n] = target
    return out


def warn_skips(skipped: Sequence[Skipped], kept: int, where: str) -> None:
    """One warning per skipped item, then one summary; ValueError when nothing is left."""
    for s in skipped:
        warnings.warn(f"{s.where}: {s.reason}; skipped", stacklevel=3)
    reasons = ", ".join(f"{n} {kind}" for kind, n in sorted(Counter(s.kind for s in skipped).items()))
    if not kept:
        raise ValueError(f"{where}: no usable rows ({len(skipped)} skipped: {reasons or 'none'})")
    if skipped:
        warnings.warn(f"{where}: {len(skipped)} row(s) skipped ({reasons}), {kept} kept", stacklevel=3)


@dataclass
class _Columns:
    kind: str  # "images", "speech" or "text"
    image: str | None
    audio: str | None
    text: str | None
    label: str | None
    id: str | None

    def used(self) -> list[str]:
        return [c for c in (self.image, self.audio, self.text, self.label, self.id) if c is not None]


def _choose_columns(names: Sequence[str], where: str, image: str | None, audio: str | None, text: str | None,
                    label: str | None, id_: str | None) -> _Columns:
    # a named text column and no named image column: the text is the data (images take labels, not text)
    img = pick_column(names, image, IMAGE_COLUMNS if text is None else (), "--image-column", where)
    aud = pick_column(names, audio, AUDIO_COLUMNS, "--audio-column", where)
    txt = pick_column(names, text, TEXT_COLUMNS, "--text-column", where)
    lbl = pick_column(names, label, LABEL_COLUMNS, "--label-column", where)
    ids = pick_column(names, id_, ID_COLUMNS, "--id-column", where)
    if image is not None and audio is not None:
        raise ValueError(f"{where}: give --image-column or --audio-column, not both (one dataset is images or speech)")
    if img is not None and audio is None:
        if lbl is None:
            raise ValueError(f"{where}: image column {img!r} but no label column (looked for "
                             f"{', '.join(LABEL_COLUMNS)}; name it with --label-column); its columns: {', '.join(names)}")
        return _Columns("images", img, None, None, lbl, ids)
    if aud is not None:
        if txt is None:
            raise ValueError(f"{where}: audio column {aud!r} but no transcript column (looked for "
                             f"{', '.join(TEXT_COLUMNS)}; name it with --text-column); its columns: {', '.join(names)}")
        return _Columns("speech", None, aud, txt, None, ids)
    if txt is not None:
        return _Columns("text", None, None, txt, lbl if label is not None else None, ids)  # a label only when asked
    raise ValueError(f"{where}: no image, audio or text column (looked for {', '.join(IMAGE_COLUMNS + AUDIO_COLUMNS + TEXT_COLUMNS)}; "
                     f"name one with --image-column, --audio-column or --text-column); its columns: {', '.join(names)}")


def _label_type_ok(pa: Any, typ: Any) -> bool:
    return pa.types.is_integer(typ) or pa.types.is_string(typ) or pa.types.is_large_string(typ)


def build_hf(
    out: str | os.PathLike,
    *,
    src: str | os.PathLike,
    image_column: str | None = None,
    audio_column: str | None = None,
    text_column: str | None = None,
    label_column: str | None = None,
    id_column: str | None = None,
    split: str = "train",
    rename: Mapping[str, str] | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
    shard_size: int = 2000,
    quiet: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """A ``datasets`` ``save_to_disk`` folder or parquet / arrow files (``find_source``) -> omni shards of
    images + labels, speech + transcripts, or text (see the module docstring), each split in a seeded shuffled
    order (sorted sources - rows by class - would otherwise give shards of one class).

    Columns: the ``*_column`` arguments, else the first present of ``IMAGE_COLUMNS`` ... (case-insensitive);
    a named column that is not there is a ValueError listing the columns. Class names: the label's ClassLabel
    names (dataset_info.json or the schema's "huggingface" metadata), else the sorted label strings, else the
    integers 0..max. ``split`` names a source that is one split; ``val_fraction`` then holds a seeded share out
    as ``val``. ``rename`` maps source split names to dataset split names ({"validation": "val"})."""
    pa = require_pyarrow()
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if not SPLIT_RE.match(split):
        raise ValueError(f"split {split!r} must match {SPLIT_RE.pattern}")
    source = find_source(src, split)
    where = str(src)
    if val_fraction > 0 and len(source.splits) > 1:
        raise ValueError(f"{where}: val_fraction holds a share of a one-split source out; this one has splits "
                         f"{', '.join(source.splits)}")
    first = next(f for files in source.splits.values() for f in files)
    schema = read_schema(first)
    names = list(schema.names)
    cols = _choose_columns(names, where, image_column, audio_column, text_column, label_column, id_column)
    features = source.features or schema_features(schema)
    files = [f for fs in source.splits.values() for f in fs]
    split_names = rename_splits(list(source.splits), rename, where)
    targets = list(split_names.values())
    if len(set(targets)) != len(targets):
        raise ValueError(f"{where}: two source splits map to one name ({split_names}); rename them apart")
    args = {"columns": {k: getattr(cols, k) for k in ("image", "audio", "text", "label", "id")}, "split": split,
            "rename": dict(sorted((rename or {}).items())), "val_fraction": val_fraction, "seed": seed}
    with Build(
        out, "hf", args, source={"files": len(files), "stat_sha256": fingerprint_files(files, source.root)},
        shard_size=shard_size, quiet=quiet, force=force,
    ) as build:  # fmt: skip
        if (manifest := build.up_to_date()) is not None:
            return manifest
        build.start()  # parquet is spilled into the staging folder, which goes when the build ends
        spill = build.staging / "source"
        spill.mkdir()
        tables: dict[str, Any] = {}
        for name, fs in source.splits.items():
            parts = []
            for f in fs:
                have = read_schema(f).names
                missing = [c for c in cols.used() if c not in have]
                if missing:
                    raise ValueError(f"{f}: no column {missing[0]!r}; its columns: {', '.join(have)}")
                parts.append(read_table(f, cols.used(), spill / f"{files.index(f):06d}.arrow"))
            try:
                tables[split_names[name]] = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
            except pa.ArrowInvalid as exc:
                raise ValueError(f"{where}: the files of split {name!r} have different columns ({exc})") from None
        classes = _classes(pa, cols, features, tables, where)
        # (split, row) per sample; a single split may lose a seeded val share
        rows = holdout({s: [(s, i) for i in range(t.num_rows)] for s, t in tables.items()}, val_fraction, seed)
        source_name = {v: k for k, v in split_names.items()}  # rows are named by the source's split names
        found: list[tuple[tuple[int, str, int], Skipped]] = []  # (where in the source, what), warned in that order
        stats: dict[str, Any] = {}
        kept = 0
        for name, items in rows.items():
            order = np.random.default_rng(split_seed(seed, name)).permutation(len(items))
            ordered = [items[j] for j in order]
            counts = [0] * len(classes) if classes is not None else None
            seconds = longest = 0.0
            ids: set[str] = set()
            with build.split(name, total=len(ordered)) as w:
                for k, (table, i, row) in enumerate(_rows(tables, ordered)):
                    sname = source_name[table]
                    at = f"{sname}[{i}]"
                    try:
                        sample = _sample(cols, row, source.root, classes, ids)
                    except _Skip as exc:
                        found.append(((list(rows).index(name), sname, i), Skipped(at, exc.kind, exc.reason)))
                        continue
                    sample["json"] = {"split": sname, "row": i, **sample.get("json", {})}
                    w.write({"__key__": f"{name}_{k:08d}", **sample})
                    kept += 1
                    if counts is not None and "cls" in sample:
                        counts[sample["cls"]] += 1
                    seconds += sample["json"].get("duration", 0.0)
                    longest = max(longest, sample["json"].get("duration", 0.0))
            stats[name] = {"class_counts": counts} if counts is not None else {}
            if cols.kind == "speech":
                stats[name].update(hours=round(seconds / 3600, 4), longest_seconds=longest)
        skipped = [s for _, s in sorted(found, key=lambda f: f[0])]
        warn_skips(skipped, kept, where)
        return build.finish(
            kind=cols.kind,
            **({"classes": classes} if classes is not None else {}),
            columns={k: getattr(cols, k) for k in ("image", "audio", "text", "label", "id") if getattr(cols, k)},
            source_dir=str(Path(src).resolve()) if Path(src).exists() else str(src),
            source_layout=source.layout,
            split_stats=stats,
            skipped=dict(Counter(s.kind for s in skipped)),
            skipped_rows=[{"row": s.where, "reason": s.reason} for s in skipped],
            fields=_fields(cols),
        )


def _fields(cols: _Columns) -> dict[str, str]:
    meta = "{split, row: the source split and row" + (", id" if cols.id else "")
    if cols.kind == "images":
        return {"jpg|png": "the encoded image (JPEG/PNG bytes as stored; other formats as PNG)",
                "cls": "class index (decimal text) into 'classes'", "json": meta + "}"}
    if cols.kind == "speech":
        return {"flac|wav|mp3|ogg|opus": "the encoded audio as stored (decoded arrays: 16-bit FLAC)",
                "txt": "transcript", "json": meta + ", sample_rate, duration}"}
    return {"txt": "the text", **({"cls": "class index into 'classes'"} if cols.label else {}), "json": meta + "}"}


def _classes(pa: Any, cols: _Columns, features: Mapping[str, Any], tables: Mapping[str, Any], where: str) -> list[str] | None:
    if cols.label is None:
        return None
    names = class_names(features.get(cols.label))
    typ = next(iter(tables.values())).schema.field(cols.label).type
    if not _label_type_ok(pa, typ):
        raise ValueError(f"{where}: label column {cols.label!r} holds {typ}; expected one class per row (an integer "
                         "or a string), not lists (multi-label) or other values")
    if names is not None:
        return names
    values = [v for t in tables.values() for v in t.column(cols.label).to_pylist() if v is not None]
    if pa.types.is_integer(typ):
        top = max((v for v in values if v >= 0), default=-1)
        return [str(i) for i in range(top + 1)]
    return sorted({v for v in values if v != ""})


class _Skip(Exception):
    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind, self.reason = kind, reason


def _rows(tables: Mapping[str, Any], ordered: Sequence[tuple[str, int]]) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(split, row, row values) in ``ordered``'s order. A one-row slice is zero-copy; ``Table.take`` copies
    (measured: 1200 rows of 200 kB images, 25x slower, and its buffers add to the peak memory)."""
    for s, i in ordered:
        yield s, i, tables[s].slice(i, 1).to_pylist()[0]


def _sample(cols: _Columns, row: Mapping[str, Any], root: Path, classes: list[str] | None, ids: set[str]) -> dict[str, Any]:
    """The shard fields of one row; _Skip when it cannot be used."""
    sample: dict[str, Any] = {"json": {}}
    if cols.id is not None:
        uid = row[cols.id]
        if uid is not None:
            uid = str(uid)
            if uid in ids:
                raise _Skip("repeated id", f"id {uid!r} repeats in this split")
            ids.add(uid)
            sample["json"]["id"] = uid
    if cols.label is not None:
        value = row[cols.label]
        if isinstance(value, str):
            index = classes.index(value) if classes is not None and value in classes else -1
        else:
            index = -1 if value is None else int(value)
        assert classes is not None
        if not 0 <= index < len(classes):
            raise _Skip("no label", f"label {value!r} is not a class (ClassLabel -1 means unlabelled); "
                        f"{len(classes)} classes")
        sample["cls"] = index
    if cols.image is not None:
        try:
            ext, data = image_sample(media_bytes(row[cols.image], root, "image"))
        except FileNotFoundError as exc:
            raise _Skip("image not found", str(exc)) from None
        except ValueError as exc:
            raise _Skip("unreadable image", str(exc)) from None
        sample[ext] = data
    if cols.text is not None:
        text = row[cols.text]
        if not isinstance(text, str) or not text.strip():
            raise _Skip("empty text", f"{'transcript' if cols.audio else 'text'} {cols.text!r} is empty")
        sample["txt"] = text.strip() if cols.audio else text
    if cols.audio is not None:
        try:
            ext, data, meta = audio_value(row[cols.audio], root)
        except FileNotFoundError as exc:
            raise _Skip("audio not found", str(exc)) from None
        except ValueError as exc:
            raise _Skip("unreadable audio", str(exc)) from None
        sample[ext] = data
        sample["json"].update(meta)
    return sample

