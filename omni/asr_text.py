"""ASR text helpers, model-free: the transcript normalisation every WER / CER uses, the edit distances, and the
CTC head's byte labels and best-path decoding. A leaf: numpy, torch and rapidfuzz, nothing of omni, so the speech model,
the multimodal transcribe task, the timing algorithms and the recipes share one definition."""

from __future__ import annotations

import math
import re
import unicodedata
from typing import Hashable, Sequence

import numpy as np
import torch
from rapidfuzz.distance import Levenshtein
from torch import Tensor

CTC_BLANK = 256  # CTC labels are bytes 0..255 of the normalised transcript; 256 is the blank


def ctc_labels(transcript: str) -> Tensor:
    """The CTC targets of a transcript: the UTF-8 bytes of ``normalize_text(transcript)`` (int64)."""
    return torch.tensor(list(normalize_text(transcript).encode("utf-8")), dtype=torch.int64)


def ctc_greedy_decode(ctc_logits: Tensor, audio_mask: Tensor | None = None) -> list[str]:
    """Best-path CTC decoding of (B, S, 257) logits: argmax per audio token, then ``ctc_collapse``. A quick read
    of what the encoder alone hears."""
    best = ctc_logits.argmax(-1).cpu().numpy()
    lengths = [best.shape[1]] * best.shape[0] if audio_mask is None else audio_mask.sum(1).tolist()
    return [ctc_collapse(row[:n]) for row, n in zip(best, lengths)]


def ctc_collapse(path: Sequence[int] | np.ndarray) -> str:
    """Best-path CTC text of per-frame labels: repeats merged, blanks dropped, bytes decoded as UTF-8 (invalid
    sequences replaced). Vectorised: an hour's path (120,000 frames) in milliseconds."""
    path = np.asarray(path, dtype=np.int64)
    if path.size == 0:
        return ""
    keep = (path != CTC_BLANK) & np.concatenate([[True], path[1:] != path[:-1]])
    return bytes(path[keep].astype(np.uint8).tolist()).decode("utf-8", errors="replace")


_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'", "`": "'"})


def normalize_text(text: str) -> str:
    """The WER/CER normalisation: Unicode NFKC; lower case; curly/backtick apostrophes -> '; every
    character that is not a letter, digit, apostrophe or whitespace -> a space (so "well,then" is two
    words); apostrophes kept only between two letters or digits ("don't" stays, 'quoted' loses its
    quotes); whitespace runs collapsed to one space and stripped."""
    s = unicodedata.normalize("NFKC", text).lower().translate(_APOSTROPHES)
    s = "".join(c if c.isalnum() or c == "'" or c.isspace() else " " for c in s)
    s = re.sub(r"(?<![^\W_])'|'(?![^\W_])", " ", s)  # drop apostrophes not inside a word
    return " ".join(s.split())


def edit_distance(ref: Sequence[Hashable], hyp: Sequence[Hashable]) -> int:
    """Levenshtein distance (substitutions + deletions + insertions) between two strings or two sequences
    of hashable items (word lists); rapidfuzz's C++ (bit-parallel), the library jiwer counts with."""
    if not (isinstance(ref, str) and isinstance(hyp, str)):  # items -> ints, equal iff ==: no hash collisions
        ids: dict[Hashable, int] = {}
        ref, hyp = [ids.setdefault(x, len(ids)) for x in ref], [ids.setdefault(x, len(ids)) for x in hyp]
    return Levenshtein.distance(ref, hyp)


def error_counts(reference: str, hypothesis: str) -> tuple[int, int, int, int]:
    """(word edits, reference words, char edits, reference chars) after ``normalize_text``; characters
    include the single spaces between words."""
    r, h = normalize_text(reference), normalize_text(hypothesis)
    return edit_distance(r.split(), h.split()), len(r.split()), edit_distance(r, h), len(r)


def error_rates(references: Sequence[str], hypotheses: Sequence[str]) -> dict[str, float]:
    """Corpus WER and CER: total edits / total reference words (characters), texts normalised by
    ``normalize_text``. An all-empty reference gives 0.0 for an empty hypothesis, else inf."""
    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    we = wn = ce = cn = 0
    for ref, hyp in zip(references, hypotheses):
        a, b, c, d = error_counts(ref, hyp)
        we, wn, ce, cn = we + a, wn + b, ce + c, cn + d

    def rate(e: int, n: int) -> float:
        return e / n if n else (0.0 if e == 0 else math.inf)

    return {"wer": rate(we, wn), "cer": rate(ce, cn)}


__all__ = ["CTC_BLANK", "ctc_greedy_decode", "ctc_labels", "edit_distance", "error_counts", "error_rates",
           "normalize_text"]
