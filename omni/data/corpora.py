"""The default text corpus: Jane Austen's six novels (public domain), read from the janeaustenr R package's data
(Debian ``r-cran-janeaustenr``) without R. The recipes' ``text`` default, ``omni data text``'s and the shipped BPE's
corpus. The text tokenizer does not read corpora; the data builders do (omni.data.builders_text)."""

from __future__ import annotations

import os
from pathlib import Path

from omni.data.rdata import read_lazyload

# Where ``apt-get install r-cran-janeaustenr`` puts the package (``dpkg-deb -x`` of the .deb
# into a folder puts it under that folder's usr/lib/R/site-library/janeaustenr); $OMNI_AUSTEN_DIR
# points elsewhere.
AUSTEN_DIR = "/usr/lib/R/site-library/janeaustenr"
AUSTEN_ENV = "OMNI_AUSTEN_DIR"


def austen_dir(alternative: str = "") -> Path:
    """The janeaustenr package folder: ``$OMNI_AUSTEN_DIR``, else AUSTEN_DIR. Read on every call
    (not at import) so a test or a user can point it elsewhere. FileNotFoundError naming the
    folder, the variable and the Debian package when the package's data is not there;
    ``alternative`` is appended to that message (e.g. "; or pass --src FILE ...")."""
    path = Path(os.environ.get(AUSTEN_ENV) or AUSTEN_DIR)
    if not path.is_dir() or find_austen_data(path) is None:
        raise FileNotFoundError(
            f"the default text corpus (Jane Austen's novels) is not in {path}: `apt-get install r-cran-janeaustenr`, "
            f"or set {AUSTEN_ENV} to the folder of the janeaustenr R package{alternative}"
        )
    return path


def find_austen_data(root: str | os.PathLike) -> Path | None:
    """The janeaustenr package's data/Rdata.rdx under ``root`` (the package folder or any folder
    above it, searched by package name so other R packages' data are never picked), else None."""
    root = Path(root)
    if root.name == "janeaustenr" and (root / "data" / "Rdata.rdx").is_file():
        return root / "data" / "Rdata.rdx"
    return next(iter(sorted(root.glob("**/janeaustenr/data/Rdata.rdx"))), None)


def austen_novels(root: str | os.PathLike | None = None) -> dict[str, list[str]]:
    """Jane Austen's six novels (public domain) as lists of paragraphs, keyed by R name
    (``emma``, ``prideprejudice`` ...).

    Reads the R lazy-load database of the ``janeaustenr`` package (Debian package
    ``r-cran-janeaustenr``) with ``omni.data.rdata``, so R itself is not needed: ``root`` is the package
    folder or any folder above it (e.g. where ``dpkg-deb -x`` unpacked the .deb).
    Paragraphs are the blank-line separated blocks with their hard line breaks joined by
    one space; chapter headings are paragraphs too. ``root`` None is ``austen_dir()``.
    """
    root = austen_dir() if root is None else Path(root)
    rdx = find_austen_data(root)
    if rdx is None:
        raise FileNotFoundError(
            f"no janeaustenr data (data/Rdata.rdx) under {root}: `apt-get install r-cran-janeaustenr` (or "
            "`apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb DIR`) and pass that "
            f"folder or set {AUSTEN_ENV} to it"
        )
    novels: dict[str, list[str]] = {}
    for name, lines in read_lazyload(rdx).items():
        paragraphs, block = [], []
        for line in [*lines, ""]:
            if line is not None and line.strip():
                block.append(line.strip())
            elif block:
                paragraphs.append(" ".join(block))
                block = []
        novels[name] = paragraphs
    return novels


__all__ = ["AUSTEN_DIR", "AUSTEN_ENV", "austen_dir", "austen_novels", "find_austen_data"]
