"""Shared fixtures."""

from __future__ import annotations

import gzip
import lzma
import shutil
import struct
import sys
import textwrap
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import pytest
import torch

import omni.tokenizers.base as base

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "timeseries_plugin"


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """examples/timeseries_plugin installed into a temp site dir as a distribution with an
    `omni.tokenizers` entry point (what `pip install examples/timeseries_plugin` writes), with the
    registry restored afterwards."""
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(EXAMPLE / "omni_timeseries.py", site)
    dist = site / "omni_timeseries-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: omni-timeseries\nVersion: 0.1.0\n")
    entry = [ln for ln in (EXAMPLE / "pyproject.toml").read_text().splitlines() if ln.startswith("timeseries =")][0]
    (dist / "entry_points.txt").write_text("[omni.tokenizers]\n" + entry.replace('"', "") + "\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(base, "_ENTRY_POINTS_LOADED", False)
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    yield
    sys.modules.pop("omni_timeseries", None)


@pytest.fixture(scope="module")
def one_thread():
    """torch on one intra-op thread: for tiny matmuls on a loaded 2-core box the thread pool costs far
    more than the work itself (100x seen). Modules opt in with pytestmark."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -- the system data, made small: nothing in the suite may need a Debian data package ----------------
@dataclass(frozen=True)
class TinyCorpora:
    """Stand-ins for the data the recipes read from Debian packages, written by the test session."""

    fashion_mnist: Path  # the four Fashion-MNIST IDX .gz files (dataset-fashion-mnist)
    austen: Path  # a janeaustenr R package folder (r-cran-janeaustenr), as austen_novels reads it
    text: Path  # the same novels as UTF-8 .txt files, for the text builders' --src / --text
    train_labels: np.ndarray
    test_labels: np.ndarray

    def env(self) -> dict[str, str]:
        """The variables that point omni at this data instead of the system folders."""
        return {"OMNI_FASHION_MNIST_DIR": str(self.fashion_mnist), "OMNI_AUSTEN_DIR": str(self.austen)}

    def text_files(self) -> list[str]:
        """The text corpus as a recipe's ``text`` entry takes it (``--set "text=[...]"``)."""
        return [str(p) for p in sorted(self.text.glob("*.txt"))]


def load_recipe(name: str, module_name: str):
    """recipes/<name>.py imported as module ``module_name`` (a recipe is a script, not a package module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(module_name, Path(__file__).resolve().parents[1] / "recipes"
                                                  / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_idx_gz(path: Path, array: np.ndarray) -> None:
    """An unsigned-byte IDX file, gzipped, as Fashion-MNIST ships it."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes(), mtime=0))


def disc_images(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """28x28 images where class c is a bright disc of radius 3 + c centred on row 4 + 2c (column jittered), over
    noise of a level drawn per image: learnable in a few dozen steps, and, like Fashion-MNIST's classes, holding
    different amounts of ink (so even an untrained model's pooled features tell images apart)."""
    levels = rng.integers(20, 120, (len(labels), 1, 1))
    images = (rng.random((len(labels), 28, 28)) * levels).astype(np.int64)
    rows, cols = np.mgrid[:28, :28]
    for i, c in enumerate(labels):
        col = 14 + int(rng.integers(-3, 4))
        images[i][(rows - 4 - 2 * int(c)) ** 2 + (cols - col) ** 2 < (3 + int(c)) ** 2] = 255
    return images.astype(np.uint8)


_WHO = ("Emma", "Anne", "Elizabeth", "Mr Knightley", "Captain Wentworth", "Mrs Jennings", "Harriet", "Elinor")
_DID = ("walked to", "wrote to", "spoke of", "thought of", "smiled at", "looked for", "called on", "waited for")
_WHAT = ("the garden", "her sister", "the old house", "a letter", "the village", "his friend", "the window",
         "the park")
_WHEN = ("", " in the morning", " after dinner", " with great care", " before the ball", " in silence")


def novel_paragraphs(seed: int, n: int) -> list[str]:
    """``n`` paragraphs of two to five plain English sentences from a small grammar (a public-domain stand-in
    for Austen: speakable, a few thousand distinct sentences, common words the shipped BPE knows)."""
    rng = np.random.default_rng(seed)
    pick = lambda options: options[int(rng.integers(len(options)))]  # noqa: E731
    return [" ".join(f"{pick(_WHO)} {pick(_DID)} {pick(_WHAT)}{pick(_WHEN)}." for _ in range(int(rng.integers(2, 6))))
            for _ in range(n)]


def _r_char(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack(">ii", 9 | (8 << 12), len(raw)) + raw  # CHARSXP flagged UTF-8


def _r_str(values: list[str]) -> bytes:
    return struct.pack(">ii", 16, len(values)) + b"".join(_r_char(v) for v in values)


def _r_named_list(items: dict[str, bytes], names_sym: bytes) -> bytes:
    body = struct.pack(">ii", 19 | (1 << 9), len(items)) + b"".join(items.values())
    return body + struct.pack(">i", 2 | (1 << 10)) + names_sym + _r_str(list(items)) + struct.pack(">i", 254)


def _r_stream(obj: bytes) -> bytes:
    return b"X\n" + struct.pack(">iii", 2, 0x040201, 0x020300) + obj


def write_janeaustenr(package: Path, novels: dict[str, list[str]], xz: Iterable[str] = ()) -> None:
    """``package``/data/Rdata.rdx + .rdb: an R lazy-load database of character vectors (one line of text
    each), as the janeaustenr package stores its novels; zlib-compressed as R does by default, the novels
    named in ``xz`` with xz (R's other compression)."""
    data = package / "data"
    data.mkdir(parents=True)
    rdb, index = b"", {}
    for name, lines in novels.items():
        raw = _r_stream(_r_str(lines))
        packed = b"X" + lzma.compress(raw) if name in xz else b"Z" + zlib.compress(raw)
        chunk = struct.pack(">I", len(raw)) + packed
        index[name] = struct.pack(">ii", 13, 2) + struct.pack(">ii", len(rdb), len(chunk))
        rdb += chunk
    names = struct.pack(">i", 1) + _r_char("names")  # SYMSXP, then referenced as REFSXP 1
    top = _r_named_list({"variables": _r_named_list(index, names), "references": struct.pack(">ii", 19, 0),
                         "compressed": struct.pack(">iii", 10, 1, 1)}, struct.pack(">i", (1 << 8) | 255))
    (data / "Rdata.rdb").write_bytes(rdb)
    (data / "Rdata.rdx").write_bytes(gzip.compress(_r_stream(top), mtime=0))


@pytest.fixture(scope="session")
def tiny_corpora(tmp_path_factory) -> TinyCorpora:
    """Fashion-MNIST (1000 train + 256 test disc images, 10 classes) and two 150-paragraph novels, written
    once per session; deterministic."""
    root = tmp_path_factory.mktemp("system-data")
    rng = np.random.default_rng(0)
    fmnist = root / "fashion-mnist"
    fmnist.mkdir()
    labels = {}
    for prefix, n in (("train", 1000), ("t10k", 256)):
        labels[prefix] = rng.integers(0, 10, n).astype(np.uint8)
        write_idx_gz(fmnist / f"{prefix}-images-idx3-ubyte.gz", disc_images(labels[prefix], rng))
        write_idx_gz(fmnist / f"{prefix}-labels-idx1-ubyte.gz", labels[prefix])
    text = root / "text"
    text.mkdir()
    novels = {}
    for k, name in enumerate(("emma", "persuasion")):
        paragraphs = [f"CHAPTER {k + 1}", *novel_paragraphs(k, 150)]
        (text / f"{name}.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
        # R stores one printed line per element, paragraphs separated by empty lines
        novels[name] = [line for para in paragraphs for line in [*textwrap.wrap(para, 70), ""]]
    austen = root / "janeaustenr"
    write_janeaustenr(austen, novels)
    return TinyCorpora(fmnist, austen, text, labels["train"], labels["t10k"])


@pytest.fixture(scope="module")
def fashion_mnist_env(tiny_corpora):
    """``tiny_corpora`` with OMNI_FASHION_MNIST_DIR pointing at its IDX files for the rest of the module (processes
    the tests start inherit it): recipes/multimodal.py has no config entry for that folder. The text corpus goes
    through the recipes' ``text`` entry instead (``tiny_corpora.text_files()``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_FASHION_MNIST_DIR", str(tiny_corpora.fashion_mnist))
        yield tiny_corpora
