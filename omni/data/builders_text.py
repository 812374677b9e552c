"""Text: plain-text files -> shards of ``.txt`` chunks; text inputs for the BPE fit."""

from __future__ import annotations

import os
import re
import tarfile
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from omni.data.corpora import austen_dir, austen_novels, find_austen_data
from omni.data.shards import MANIFEST_NAME, Build, fingerprint_files, read_manifest

TEXT_SUFFIXES = (".txt", ".text", ".md")


def read_text_file(path: str | os.PathLike) -> str:
    """The text of one corpus file, the one rule every text reader follows (``omni data text``, the BPE fit,
    the recipes' ``text=`` corpus, synthesised speech): UTF-8 (a BOM is dropped) with no NUL byte; else
    ValueError naming the file and where it stops being text (a binary file never trains as random bytes)."""
    path = Path(path)
    data = path.read_bytes()
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{path}: not a text file (a NUL byte at offset {nul}: binary data); give UTF-8 text files")
    try:  # newlines as open() in text mode reads them: \r\n and \r are \n
        return data.decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); give UTF-8 "
                         "text files") from None


def expand_inputs(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Files as given; folders -> their ``*.txt``/``*.text``/``*.md`` files (recursive, sorted).
    A folder holding the janeaustenr package or an omni dataset (manifest.json) stays a folder."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            if find_austen_data(p) is not None or (p / MANIFEST_NAME).is_file():
                out.append(p)
                continue
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
            if not found:
                raise FileNotFoundError(f"{p}: no {'/'.join(TEXT_SUFFIXES)} files inside")
            out.extend(found)
        else:
            raise FileNotFoundError(f"{p}: no such file or folder")
    if not out:
        raise ValueError("no text inputs given")
    return out


def iter_documents(paths: Sequence[Path]) -> Iterator[tuple[str, str]]:
    """(name, text) per document: a file; each Austen novel (paragraphs joined by blank lines);
    each ``.txt`` sample of an omni dataset's shards (all splits)."""
    for p in paths:
        if p.is_dir() and (p / MANIFEST_NAME).is_file():
            manifest = read_manifest(p)
            for split in manifest["splits"].values():
                for shard in split["shards"]:
                    with tarfile.open(p / shard["name"]) as tar:
                        for member in tar:
                            if member.isfile() and member.name.endswith(".txt"):
                                f = tar.extractfile(member)
                                assert f is not None
                                yield f"{shard['name']}:{member.name}", f.read().decode("utf-8")
        elif p.is_dir():
            for name, paragraphs in sorted(austen_novels(p).items()):
                yield name, "\n\n".join(paragraphs)
        else:
            yield p.name, read_text_file(p)


def _split_long(block: str, max_chars: int) -> list[str]:
    """A block longer than max_chars -> pieces at line breaks, else at spaces, else hard cuts."""
    pieces: list[str] = []
    for sep in ("\n", " "):
        if sep in block:
            cur = ""
            for part in block.split(sep):
                cand = part if not cur else cur + sep + part
                if len(cand) <= max_chars:
                    cur = cand
                    continue
                if cur:
                    pieces.append(cur)
                if len(part) > max_chars:
                    pieces.extend(_split_long(part, max_chars) if sep == "\n" else
                                  [part[i : i + max_chars] for i in range(0, len(part), max_chars)])  # fmt: skip
                    cur = ""
                else:
                    cur = part
            if cur:
                pieces.append(cur)
            return pieces
    return [block[i : i + max_chars] for i in range(0, len(block), max_chars)]


def chunk_text(text: str, max_chars: int = 2000, mode: str = "paragraph") -> list[str]:
    """Greedy chunks of at most ``max_chars`` characters made of whole units: paragraphs
    (blank-line separated, re-joined with a blank line) or lines; longer units are split at line
    breaks, then spaces, then hard. Whitespace-only units are dropped."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    if mode == "paragraph":
        units, joiner = [u.strip("\n") for u in re.split(r"\n[ \t]*\n", text)], "\n\n"
    elif mode == "line":
        units, joiner = text.splitlines(), "\n"
    else:
        raise ValueError(f"mode must be 'paragraph' or 'line', got {mode!r}")
    chunks: list[str] = []
    cur = ""
    for unit in units:
        if not unit.strip():
            continue
        for piece in [unit] if len(unit) <= max_chars else _split_long(unit, max_chars):
            cand = piece if not cur else cur + joiner + piece
            if len(cand) <= max_chars:
                cur = cand
            else:
                chunks.append(cur)
                cur = piece
    if cur:
        chunks.append(cur)
    return chunks


def build_text(
    out: str | os.PathLike,
    *,
    src: Sequence[str | os.PathLike] | None = None,
    max_chars: int = 2000,
    mode: str = "paragraph",
    val_fraction: float = 0.0,
    seed: int = 0,
    shard_size: int = 5000,
    quiet: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """Text files (or the Austen novels: the default when ``src`` is empty) -> shards of
    ``<key>.txt`` chunks (``chunk_text``) and ``<key>.json`` (source document, chunk index), in
    corpus order; ``val_fraction`` of the chunks (seeded) form a ``val`` split."""

    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:  # numpy's seeds: 32 bits
        raise ValueError(f"seed must be an integer in [0, 2147483647], got {seed!r}")
    if not src:
        src = [austen_dir("; or pass --src FILE|DIR ... with your own text")]
    paths = expand_inputs(src)
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file()))]
    with Build(
        out, "text", {"max_chars": max_chars, "mode": mode, "val_fraction": val_fraction, "seed": seed},
        source={"inputs": [str(p.resolve()) for p in paths], "stat_sha256": fingerprint_files(files)},
        shard_size=shard_size, quiet=quiet, force=force,
    ) as build:  # fmt: skip
        if (manifest := build.up_to_date()) is not None:
            return manifest
        chunks = [(name, i, c) for name, text in iter_documents(paths)
                  for i, c in enumerate(chunk_text(text, max_chars, mode))]
        if not chunks:
            raise ValueError(f"no text in {', '.join(map(str, paths))}")
        n_val = int(round(val_fraction * len(chunks)))
        val = np.zeros(len(chunks), dtype=bool)
        val[np.random.default_rng([seed, 4]).permutation(len(chunks))[:n_val]] = True
        build.start()
        chars = {}
        for split, mask in (("train", ~val), ("val", val)):
            if not mask.any():
                continue
            n_chars = 0
            with build.split(split, total=int(mask.sum())) as w:
                k = 0
                for (name, i, c), keep in zip(chunks, mask):
                    if keep:
                        w.write({"__key__": f"{split}_{k:08d}", "txt": c, "json": {"source": name, "chunk": i}})
                        n_chars += len(c)
                        k += 1
            chars[split] = n_chars
        return build.finish(
            split_chars=chars,
            fields={"txt": f"UTF-8 text chunk of at most {max_chars} characters", "json": "{source, chunk}"},
        )


def fit_tokenizer(
    inputs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    vocab_size: int = 8192,
    min_frequency: int = 2,
) -> Path:
    """Fit ``omni.tokenizers.text.TextTokenizer`` (byte-level BPE) on ``inputs`` (text files,
    folders of them, the janeaustenr folder, or omni text datasets) and ``save`` it to ``out``."""
    from omni.tokenizers.text import TextTokenizer

    paths = expand_inputs(inputs)
    tok = TextTokenizer().fit((text for _, text in iter_documents(paths)), vocab_size=vocab_size, min_frequency=min_frequency)
    return Path(tok.save(out))


def fit_default_asset(corpus_paths: Sequence[str | os.PathLike], out_dir: str | os.PathLike, vocab_size: int = 8192,
                      min_frequency: int = 2) -> Path:
    """Fit the BPE on ``corpus_paths`` and write ``out_dir/tokenizer.json`` alone (the asset form); returns its path.

    Each path is read as ``iter_documents`` reads it: a UTF-8 text file, or a folder holding the janeaustenr R
    package, whose novels become one training text each with paragraphs joined by blank lines (so merges over
    "\\n\\n" are learned too). The shipped ``tokenizers/bpe-8k`` is ``fit_default_asset([DIR], "tokenizers/bpe-8k")``
    (see its README for DIR)."""
    from omni.tokenizers.text import TOKENIZER_FILE, TextTokenizer

    documents = (text for _, text in iter_documents([Path(p) for p in corpus_paths]))
    tok = TextTokenizer().fit(documents, vocab_size=vocab_size, min_frequency=min_frequency)
    tok.save_state(Path(out_dir))
    return Path(out_dir) / TOKENIZER_FILE

