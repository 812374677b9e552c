"""Image dataset builders: Fashion-MNIST (IDX files) and ImageFolder trees."""

from __future__ import annotations

import gzip
import io
import os
import struct
import urllib.error
import urllib.request
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from omni.image_bytes import ImageTooLarge, open_image
from omni.data.shards import Build, fingerprint_files

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # Debian package dataset-fashion-mnist
FASHION_MNIST_ENV = "OMNI_FASHION_MNIST_DIR"  # points the default elsewhere
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
FASHION_MNIST_URLS = (
    "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
SPLIT_DIR_NAMES = ("train", "val", "validation", "test")


# -- Fashion-MNIST -----------------------------------------------------------------------------------
def _idx_file(folder: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (folder / name).is_file():
            return folder / name
    return None


def _idx_complete(folder: Path) -> bool:
    return all(_idx_file(folder, s) for pair in FASHION_MNIST_FILES.values() for s in pair)


def fashion_mnist_dir() -> Path:
    """The folder looked in when no --source is given: ``$OMNI_FASHION_MNIST_DIR``, else where the
    Debian package puts the files. Read on every call (not at import), so tests can point it elsewhere."""
    return Path(os.environ.get(FASHION_MNIST_ENV) or FASHION_MNIST_DIR)


def _where_to_get(folder: Path, offer_download: bool = True) -> str:
    names = ", ".join(f"{s}.gz" for pair in FASHION_MNIST_FILES.values() for s in pair)
    download = "; `omni data fashion-mnist --download` fetches them" if offer_download else ""
    # named by command, not by flag: recipes show this message too, and they take no --source
    return (f"looked in {folder}: `apt-get install dataset-fashion-mnist`, or set {FASHION_MNIST_ENV}=DIR to a folder "
            f"with {names} (`omni data fashion-mnist --source DIR` reads such a folder too){download}")


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An IDX file (optionally gzipped) of unsigned bytes -> uint8 array of its shape."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as exc:  # a cut or damaged download: the user's data, not a bug
            raise ValueError(f"{path}: not a valid gzip file ({exc})") from None
    if len(raw) < 4 or raw[:2] != b"\0\0" or len(raw) < 4 + 4 * raw[3]:
        raise ValueError(f"{path}: not an IDX file (bad magic or header)")
    dtype, ndim = raw[2], raw[3]
    if dtype != 0x08:
        raise ValueError(f"{path}: IDX element type 0x{dtype:02x} is not unsigned byte (0x08)")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    body = raw[4 + 4 * ndim :]
    if len(body) != int(np.prod(shape)):
        raise ValueError(f"{path}: IDX header says shape {shape} but holds {len(body)} bytes")
    return np.frombuffer(body, dtype=np.uint8).reshape(shape)


def _download_fashion_mnist(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    errors = []
    for pair in FASHION_MNIST_FILES.values():
        for stem in pair:
            target = dest / (stem + ".gz")
            if target.is_file():
                continue
            for base in FASHION_MNIST_URLS:
                try:
                    with urllib.request.urlopen(base + stem + ".gz", timeout=30) as r:
                        data = r.read()
                    gzip.decompress(data)  # a truncated or HTML answer fails here
                except (urllib.error.URLError, OSError, EOFError, ValueError, zlib.error) as exc:
                    errors.append(f"{base}{stem}.gz: {exc}")
                    continue
                tmp = target.with_name(target.name + ".tmp")
                tmp.write_bytes(data)
                os.replace(tmp, target)
                break
            else:
                raise FileNotFoundError(
                    f"the Fashion-MNIST download failed ({'; '.join(errors[-2:])}); "
                    + _where_to_get(fashion_mnist_dir(), offer_download=False)
                )


def locate_fashion_mnist(source: str | os.PathLike | None, out: Path, download: bool = False) -> Path:
    """The folder with the four IDX files: ``source``, else ``fashion_mnist_dir()``, else an
    earlier download in ``<out>/download``, else - only with ``download``, nothing fetches data
    unasked - a download into ``<out>/download``."""
    if source is not None:
        folder = Path(source)
        if not _idx_complete(folder):
            raise FileNotFoundError(
                f"--source {folder} lacks the Fashion-MNIST IDX files (train-images-idx3-ubyte[.gz], "
                "train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz])"
            )
        return folder
    default = fashion_mnist_dir()
    for folder in (default, out / "download"):
        if _idx_complete(folder):
            return folder
    if not download:
        raise FileNotFoundError(f"Fashion-MNIST IDX files not found: {_where_to_get(default)}")
    _download_fashion_mnist(out / "download")
    return out / "download"


def _png(img: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img, mode="L").save(buf, format="PNG")
    return buf.getvalue()


def build_fashion_mnist(
    out: str | os.PathLike,
    *,
    source: str | os.PathLike | None = None,
    format: str = "png",
    shard_size: int = 5000,
    download: bool = False,
    quiet: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """Fashion-MNIST -> ``train``/``test`` shards of ``<key>.png`` (28x28 grayscale) or
    ``<key>.u8`` (784 raw bytes, row-major) plus ``<key>.cls`` (label 0-9). The IDX files come
    from ``locate_fashion_mnist`` (downloaded only with ``download=True``)."""
    if format not in ("png", "raw"):
        raise ValueError(f"format must be 'png' or 'raw', got {format!r}")
    out = Path(out)
    folder = locate_fashion_mnist(source, out, download)
    files = [_idx_file(folder, s) for pair in FASHION_MNIST_FILES.values() for s in pair]
    with Build(
        out,
        "fashion-mnist",
        {"format": format},
        source={"sha256": fingerprint_files(files, content=True)},
        shard_size=shard_size,
        quiet=quiet,
        force=force,
    ) as build:
        if (manifest := build.up_to_date()) is not None:
            return manifest
        data = {}
        for split, (img_stem, lbl_stem) in FASHION_MNIST_FILES.items():
            images, labels = read_idx(_idx_file(folder, img_stem)), read_idx(_idx_file(folder, lbl_stem))
            if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
                raise ValueError(
                    f"{folder}: {split} images {images.shape} and labels {labels.shape} do not match "
                    "(expected (N, H, W) and (N,))"
                )
            if labels.size and labels.max() >= len(FASHION_MNIST_CLASSES):
                raise ValueError(f"{folder}: {split} label {labels.max()} outside 0..9")
            data[split] = (images, labels)
        build.start()
        ext = "png" if format == "png" else "u8"
        for split, (images, labels) in data.items():
            with build.split(split, total=len(images)) as w:
                for i, (img, label) in enumerate(zip(images, labels)):
                    w.write({"__key__": f"{split}_{i:06d}", ext: _png(img) if ext == "png" else img.tobytes(),
                             "cls": int(label)})
        shape = list(data["train"][0].shape[1:])
        return build.finish(
            classes=list(FASHION_MNIST_CLASSES),
            image_shape=shape,
            source_dir=str(folder.resolve()),
            fields={
                ext: f"{'PNG, 8-bit grayscale' if ext == 'png' else 'raw uint8, row-major'} {shape[0]}x{shape[1]}",
                "cls": "class index (decimal text)",
            },
        )


# -- ImageFolder ------------------------------------------------------------------------------------
def _sniff(head: bytes) -> str | None:
    if head[:3] == b"\xff\xd8\xff":
        return "jpg"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    return None


def _undecodable(data: bytes) -> str | None:
    """Why PIL cannot decode these image bytes whole (truncated, header only, corrupt, more than
    omni.image_bytes.MAX_PIXELS), or None. The magic bytes alone would let a cut file into the dataset,
    where every epoch would skip it again."""
    try:
        open_image(data)  # the one opener every reader uses (omni.image_bytes)
    except ImageTooLarge as exc:
        return str(exc).split(": ", 1)[1]
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, EOFError ... on broken files
        return f"not a complete image ({type(exc).__name__}: {' '.join(str(exc).split())})"
    return None


def _class_files(folder: Path) -> dict[str, list[Path]]:
    classes: dict[str, list[Path]] = {}
    for d in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        files = sorted(
            p for p in d.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".")
        )
        classes[d.name] = files
    return classes


def scan_image_folder(src: Path, val_fraction: float, seed: int) -> tuple[list[str], dict[str, list[tuple[Path, int]]]]:
    """Class names (sorted) and, per split, ``(file, class index)`` pairs in a seeded order.

    ``src/train/<class>/...`` (+ ``val``/``validation``/``test``) keeps those splits; a plain
    ``src/<class>/...`` is split per class with a seeded holdout of ``val_fraction`` -> ``val``.
    """
    if not src.is_dir():
        raise FileNotFoundError(f"--src {src} is not a folder")
    rng = np.random.default_rng(seed)
    split_dirs = {p.name: p for p in src.iterdir() if p.is_dir() and p.name in SPLIT_DIR_NAMES}
    if "train" in split_dirs:
        per_split = {name: _class_files(d) for name, d in sorted(split_dirs.items())}
        classes = sorted({c for files in per_split.values() for c in files})
        for name, files in per_split.items():
            missing = set(classes) - set(files)
            if missing:
                warnings.warn(f"{split_dirs[name]}: no folder for class(es) {', '.join(sorted(missing))}", stacklevel=3)
        splits = {
            name: [(f, classes.index(c)) for c, fs in files.items() for f in fs] for name, files in per_split.items()
        }
    else:
        files = _class_files(src)
        classes = sorted(files)
        splits = {"train": [], "val": []}
        for idx, c in enumerate(classes):
            order = rng.permutation(len(files[c]))
            n_val = int(round(val_fraction * len(order)))
            for j, k in enumerate(order):
                splits["val" if j < n_val else "train"].append((files[c][k], idx))
        if not splits["val"]:
            del splits["val"]
    if not classes:
        raise ValueError(f"{src}: no class subfolders (expected {src}/<class>/*.jpg or {src}/train/<class>/*.jpg)")
    empty = [c for c in classes if not any(ci == classes.index(c) for pairs in splits.values() for _, ci in pairs)]
    if empty:
        raise ValueError(f"{src}: class folder(s) without JPEG/PNG images: {', '.join(empty)}")
    for name in splits:
        splits[name] = [splits[name][i] for i in rng.permutation(len(splits[name]))]
    return classes, splits


def build_images(
    out: str | os.PathLike,
    *,
    src: str | os.PathLike,
    val_fraction: float = 0.1,
    seed: int = 0,
    shard_size: int = 2000,
    skip_bad: bool = False,
    quiet: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """An ImageFolder tree -> shards with each image's ORIGINAL bytes as ``<key>.jpg`` or
    ``<key>.png`` (by content, not file name), ``<key>.cls`` and ``<key>.json`` (source path,
    class name). Class indices follow the sorted class-folder names. Every image is decoded once here: a
    file that is not a whole JPEG/PNG (truncated, header only, corrupt, over MAX_PIXELS) stops the build naming
    it, or with ``skip_bad`` is skipped, warned about and listed in the manifest's ``skipped``."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    src = Path(src)
    classes, splits = scan_image_folder(src, val_fraction, seed)
    all_files = [f for pairs in splits.values() for f, _ in pairs]
    with Build(
        out,
        "images",
        {"val_fraction": val_fraction, "seed": seed, "skip_bad": skip_bad},
        source={"files": len(all_files), "stat_sha256": fingerprint_files(all_files, src)},
        shard_size=shard_size,
        quiet=quiet,
        force=force,
    ) as build:
        if (manifest := build.up_to_date()) is not None:
            return manifest
        build.start()
        skipped: list[str] = []
        class_counts: dict[str, list[int]] = {}
        for split, pairs in splits.items():
            counts = [0] * len(classes)
            with build.split(split, total=len(pairs)) as w:
                for i, (file, idx) in enumerate(pairs):
                    data = file.read_bytes()
                    ext = _sniff(data[:8])
                    problem = "not a JPEG or PNG file (by its first bytes)" if ext is None else _undecodable(data)
                    if problem is not None:
                        msg = f"{file}: {problem}"
                        if not skip_bad:
                            raise ValueError(msg + "; pass --skip-bad to skip such files")
                        warnings.warn(msg + "; skipped", stacklevel=2)
                        skipped.append(str(file.relative_to(src)))
                        continue
                    rel = file.relative_to(src).as_posix()
                    w.write({"__key__": f"{split}_{i:08d}", ext: data, "cls": idx,
                             "json": {"path": rel, "class": classes[idx]}})
                    counts[idx] += 1
            class_counts[split] = counts
        return build.finish(
            classes=classes,
            class_counts=class_counts,
            skipped=skipped,
            source_dir=str(src.resolve()),
            fields={
                "jpg|png": "the original encoded image bytes",
                "cls": "class index (decimal text) into 'classes'",
                "json": "{path: file relative to the source folder, class: class name}",
            },
        )
