"""Word-level timestamps for ``omni transcribe``: where each word of a transcript lies in the audio.

Two sources, chosen per export (``method="auto"``):

* ``ctc`` (a SpeechRecognizer with a CTC head, recipes/whisper.py's default): the decoder's transcript,
  normalised as the CTC labels are (``omni.speech.normalize_text``, UTF-8 bytes, spaces included), is forced-
  aligned to the encoder frames (``ctc_align``: torchaudio's ``forced_align``, or this module's own Viterbi
  where torchaudio was built without it). A word spans the frames of its first to its last byte; its
  probability is the mean, over those non-blank frames, of the CTC posterior of the aligned byte. Byte-level CTC
  is peaky (a letter is one or two frames, blanks between), so a word's frames start late and end early; where
  a word borders a pause the bounds are moved out over the loud frames (``refine_with_energy``): blank frames
  whose energy is speech-level belong to the word, quiet ones to the pause.
* ``attention`` (exports without a CTC head): Whisper's way. The transcript is teacher-forced through the
  decoder with ``omni.introspect.capture`` recording cross-attention; the chosen heads' maps are standardised
  per head over the text tokens, median-filtered along time, averaged, and a monotonic DTW path through their
  negation gives each text token its frames (``attention_alignment``, ``attention_word_timings``). A converted
  Whisper's alignment heads (export config "alignment_heads", [layer, head] pairs: the checkpoint's own list, see
  omni/interop/whisper.py) are used where known, else every head of the second half of the decoder's layers.
* ``attention`` for the prefix-LM transcriber of a multitask export (``omni.prefix_lm.PrefixLMTranscriber``:
  [audio tokens, bos, <|transcribe|>, text] in one sequence on the shared trunk, no cross-attention): the same
  DTW over the trunk's SELF-attention of the text rows to the audio columns (``prefix_lm_attention``), captured
  during one teacher-forced packed forward of [audio, prompt, transcript, eos]. Each row is renormalised over
  the audio columns first: a text token also attends to the text before it, and how much it does so varies from
  token to token, which would otherwise weigh the rows unequally in the standardisation.

Times: audio token ``i`` is centred on mel frame ``stride * i``, i.e. on ``i / tokens_per_second`` seconds
(the STFT is centred), so frame ``i`` stands for ``[(i - 0.5) / tps, (i + 0.5) / tps)``; a window cut from a
longer file by ``split_windows`` adds its start, so times are absolute in the file.

Words are the transcript's whitespace-separated words; a word of punctuation only ("--") is joined to the
word before it (to the next one at the start), so every word has speech under it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal, Sequence

import numpy as np
import torch
from torch import Tensor

Method = Literal["auto", "ctc", "attention"]

# Refinement: a frame is "loud" when its energy (dB) is above this fraction of the way from the window's quietest
# frame to its loudest (a fraction of the dB range, at most 80 dB: frame_energy). On the calibration words
# (benchmarks/timestamps.py --calibrate, train-split sentences) 0.1 .. 0.6 gave medians within 1 ms in clean audio.
LOUD_FRACTION = 0.3


@dataclass(frozen=True)
class WordTiming:
    """One word: its text as the transcript spells it, start / end in seconds, and a confidence in [0, 1]."""

    word: str
    start: float
    end: float
    probability: float


@dataclass(frozen=True)
class TimedSegment:
    """A run of words shown together (a subtitle cue): start of its first word, end of its last."""

    start: float
    end: float
    text: str
    words: tuple[WordTiming, ...]


@dataclass
class WindowAlignment:
    """What one window's alignment looked at, for the alignment picture: ``matrix`` (units, frames) (CTC
    posteriors of the transcript's bytes, or the averaged cross-attention of its tokens), the unit labels, the
    path (frame, unit) pairs, and where the window starts in the file (seconds)."""

    offset: float
    tokens_per_second: float
    units: list[str]
    matrix: np.ndarray
    path: np.ndarray  # (n, 2) int: frame, unit
    method: str


@dataclass
class TimedTranscript:
    """A file's transcript with its segments (words inside), the method that timed them ("ctc", "attention"),
    and per window what the alignment saw (kept only when asked for: ``keep_alignment``)."""

    text: str
    segments: list[TimedSegment]
    method: str
    duration: float
    windows: list[WindowAlignment] = field(default_factory=list)

    @property
    def words(self) -> list[WordTiming]:
        return [w for s in self.segments for w in s.words]


# ----------------------------------------------------------------------------------------------------
# Words of a transcript


def transcript_words(text: str) -> list[tuple[str, int, int]]:
    """The transcript's words as (word, first char, end char) in ``text``: whitespace-separated, with words of
    punctuation only joined to the word before (or, for leading ones, after): they carry no speech to time."""
    from omni.asr_text import normalize_text

    spans: list[list[Any]] = []
    pending: list[int] | None = None  # leading punctuation-only words, joined to the first real word
    pos = 0
    for raw in text.split():
        start = text.index(raw, pos)
        end = pos = start + len(raw)
        if normalize_text(raw):
            if pending is not None:
                start, pending = pending[0], None
            spans.append([start, end])
        elif spans:
            spans[-1][1] = end
        elif pending is None:
            pending = [start, end]
    if pending is not None and not spans:  # nothing but punctuation: nothing to time
        return []
    return [(text[a:b], a, b) for a, b in spans]


# ----------------------------------------------------------------------------------------------------
# CTC forced alignment


def _viterbi(log_probs: np.ndarray, targets: Sequence[int], blank: int) -> np.ndarray:
    """The best CTC path of ``targets`` through (T, C) log-probabilities: the label of every frame (blank or a
    target). States are the usual blank-interleaved sequence (2L + 1); a state may stay, step one, or skip
    the blank between two different labels."""
    T = log_probs.shape[0]
    ext = np.full(2 * len(targets) + 1, blank, dtype=np.int64)
    ext[1::2] = targets
    S = len(ext)
    skip = np.zeros(S, dtype=bool)
    skip[2:] = (ext[2:] != blank) & (ext[2:] != ext[:-2])
    emit = log_probs[:, ext]  # (T, S)
    score = np.full(S, -np.inf)
    score[:2] = emit[0, :2]
    back = np.zeros((T, S), dtype=np.int8)  # 0 stay, 1 from s-1, 2 from s-2
    for t in range(1, T):
        prev1 = np.concatenate([[-np.inf], score[:-1]])
        prev2 = np.where(skip, np.concatenate([[-np.inf, -np.inf], score[:-2]]), -np.inf)
        choices = np.stack([score, prev1, prev2])
        back[t] = choices.argmax(0)
        score = choices.max(0) + emit[t]
    s = S - 1 if S == 1 or score[S - 1] >= score[S - 2] else S - 2
    if not np.isfinite(score[s]):
        raise ValueError(f"no CTC path of {len(targets)} labels fits {T} frames")
    labels = np.empty(T, dtype=np.int64)
    for t in range(T - 1, -1, -1):
        labels[t] = ext[s]
        s -= int(back[t, s])
    return labels


def ctc_frames_needed(targets: Sequence[int]) -> int:
    """Fewest frames a CTC path of ``targets`` needs: one per label plus a blank between equal neighbours."""
    return len(targets) + sum(1 for a, b in zip(targets, targets[1:]) if a == b)


def ctc_align(log_probs: Tensor, targets: Sequence[int], blank: int) -> np.ndarray:
    """Forced alignment: (T, C) CTC log-probabilities and a label sequence -> per frame the index of the
    target it emits, -1 on blank frames. torchaudio.functional.forced_align (C++) where this torchaudio has
    it, else ``_viterbi``; both find the most probable path. Raises ValueError when T is too short."""
    targets = [int(t) for t in targets]
    T = int(log_probs.shape[0])
    if not targets:
        return np.full(T, -1, dtype=np.int64)
    if ctc_frames_needed(targets) > T:
        raise ValueError(f"no CTC path of {len(targets)} labels fits {T} frames")
    lp = log_probs.detach().float().cpu()
    try:
        from torchaudio.functional import forced_align

        path, _ = forced_align(lp[None], torch.tensor([targets], dtype=torch.int32), blank=blank)
        labels = path[0].numpy().astype(np.int64)
    except (ImportError, RuntimeError, AttributeError):  # a torchaudio without its alignment extension
        labels = _viterbi(lp.numpy(), targets, blank)
    return labels_to_units(labels, blank)


def labels_to_units(labels: np.ndarray, blank: int) -> np.ndarray:
    """A CTC path's frame labels -> the index of the target each frame emits (-1 for blank). A new target
    starts where the label changes to a non-blank one or a label follows a blank (doubled letters)."""
    units = np.full(len(labels), -1, dtype=np.int64)
    k, prev = -1, blank
    for t, lab in enumerate(labels.tolist()):
        if lab != blank:
            if lab != prev:
                k += 1
            units[t] = k
        prev = lab
    return units


def frame_energy(wave: Tensor, sample_rate: int, tokens_per_second: float, n: int,
                 floor_db: float = 80.0) -> np.ndarray:
    """Per audio token, the energy (dB) of the waveform in the token's frame, ``1 / tokens_per_second`` wide and
    centred on ``i / tokens_per_second``; floored ``floor_db`` below the loudest frame, as log-mel is, so that
    digital silence does not stretch the range. Read from the waveform, so any audio front-end gives the same."""
    hop = sample_rate / tokens_per_second
    x = wave.detach().float().cpu().numpy()
    out = np.empty(n)
    for i in range(n):
        a, b = int(round((i - 0.5) * hop)), int(round((i + 0.5) * hop))
        seg = x[max(a, 0):max(min(b, len(x)), 0)]
        out[i] = 10 * np.log10(np.mean(seg ** 2) + 1e-12) if len(seg) else -120.0
    return np.maximum(out, out.max() - floor_db)


def real_frames(num_samples: int, sample_rate: int, tokens_per_second: float, available: int) -> int:
    """Audio tokens that hold the clip (not padding): 1 + samples // samples-per-token (omni's windows make
    exactly that many; Whisper's front-end pads every clip to 30 s), at most ``available``."""
    return min(available, 1 + num_samples // int(round(sample_rate / tokens_per_second)))


def loud_frames(energy: np.ndarray, loud_fraction: float = LOUD_FRACTION) -> np.ndarray:
    """Frames whose energy is above ``loud_fraction`` of the way from the quietest frame to the loudest."""
    lo, hi = float(energy.min()), float(energy.max())
    return energy > lo + loud_fraction * (hi - lo)


def _trim_quiet(a: int, b: int, loud: np.ndarray) -> tuple[int, int]:
    """[a, b] without its quiet frames at either end, unless none of it is loud."""
    inside = np.flatnonzero(loud[a:b + 1])
    return (a + int(inside[0]), a + int(inside[-1])) if len(inside) else (a, b)


def refine_with_energy(spans: list[tuple[int, int]], energy: np.ndarray,
                       loud_fraction: float = LOUD_FRACTION, trim: bool = True) -> list[tuple[int, int]]:
    """Fit each word's frame span [first, last] to the sound: first its quiet ends are cut off (a CTC spike
    that fell in a pause, as a model does in noise; a span with no loud frame is kept), then it is widened over
    the loud frames next to it, never past the frames of its neighbours: the CTC spikes sit inside the word, the
    pause around it is quiet. A word inside continuous speech (no quiet frame between it and its neighbour) is
    widened up to the midpoint between the two."""
    if not spans:
        return spans
    loud = loud_frames(energy, loud_fraction)
    n = len(energy)
    if trim:
        spans = [_trim_quiet(a, b, loud) for a, b in spans]
    out = []
    for k, (a, b) in enumerate(spans):
        left = spans[k - 1][1] + 1 if k else 0  # first frame this word may take
        right = spans[k + 1][0] - 1 if k + 1 < len(spans) else n - 1
        # continuous speech up to the neighbour: the frames between the two words are split at the midpoint,
        # the earlier word taking frames up to (last + next first) // 2, the later one those after it
        if k and loud[left:a].all():
            left = (spans[k - 1][1] + a) // 2 + 1
        if k + 1 < len(spans) and loud[b + 1:right + 1].all():
            right = (b + spans[k + 1][0]) // 2
        while a > left and loud[a - 1]:
            a -= 1
        while b < right and loud[b + 1]:
            b += 1
        out.append((a, b))
    return out


def ctc_word_timings(log_probs: Tensor, text: str, tokens_per_second: float, *, offset: float = 0.0,
                     energy: np.ndarray | None = None, blank: int | None = None,
                     keep_alignment: bool = False) -> tuple[list[WordTiming], WindowAlignment | None]:
    """One window: (T, 257) CTC log-probabilities of its audio tokens and the transcript decoded from it ->
    its words with absolute times (``offset`` = the window's start in the file, seconds).

    ``energy`` (T,) per-frame energy (``frame_energy``) turns on ``refine_with_energy``; a bound next to a
    pause is then the centre of the word's first (last) loud frame, any other bound a frame edge. A transcript
    longer than the window can hold as CTC labels (a decoder that ran on) cannot be aligned: its words share
    the window in proportion to their byte lengths, with probability 0."""
    from omni.asr_text import CTC_BLANK, normalize_text

    blank = CTC_BLANK if blank is None else blank
    words = transcript_words(text)
    if not words:
        return [], None
    pieces = [normalize_text(w).encode("utf-8") for w, _, _ in words]
    labels = b" ".join(pieces)
    bounds, pos = [], 0  # each word's [first, end) byte in labels
    for p in pieces:
        bounds.append((pos, pos + len(p)))
        pos += len(p) + 1
    T = int(log_probs.shape[0])
    if ctc_frames_needed(list(labels)) > T:
        total = sum(len(p) + 1 for p in pieces)
        out, at = [], 0
        for (w, _, _), p in zip(words, pieces):
            a, at = at, at + len(p) + 1
            out.append(WordTiming(w, offset + a / total * T / tokens_per_second,
                                  offset + at / total * T / tokens_per_second, 0.0))
        return out, None
    lp = log_probs.detach().float().cpu()
    units = ctc_align(lp, list(labels), blank)
    first = np.full(len(labels), -1)
    last = np.full(len(labels), -1)
    for t in np.flatnonzero(units >= 0):
        u = units[t]
        first[u] = t if first[u] < 0 else first[u]
        last[u] = t
    frame_prob = np.exp(lp.numpy()[np.arange(T), np.where(units >= 0, np.frombuffer(labels, np.uint8)[
        np.clip(units, 0, None)], blank)])
    spans = [(int(first[a]), int(last[b - 1])) for a, b in bounds]
    probs = []
    for a, b in spans:
        frames = np.arange(a, b + 1)
        on = frames[(units[frames] >= 0)]
        probs.append(float(frame_prob[on].mean()))
    edges = []  # each word's bounds in frames: a frame's outer edge, or its centre where it borders a pause
    if energy is not None:
        spans = refine_with_energy(spans, energy[:T])
        loud = loud_frames(energy[:T])
    for a, b in spans:
        # at a loud frame next to a quiet one the sound starts (ends) inside that frame: its centre is the
        # unbiased guess (measured on train-split words: the outer edge was 10 ms early / late on average)
        onset = energy is not None and 0 < a and loud[a] and not loud[a - 1]
        release = energy is not None and b < T - 1 and loud[b] and not loud[b + 1]
        edges.append((a if onset else max(a - 0.5, 0.0), b if release else min(b + 0.5, T)))
    out = [WordTiming(w, offset + a / tokens_per_second, offset + b / tokens_per_second, p)
           for (w, _, _), (a, b), p in zip(words, edges, probs)]
    alignment = None
    if keep_alignment:
        cols = np.frombuffer(labels, np.uint8).astype(np.int64)
        path = np.stack([np.flatnonzero(units >= 0), units[units >= 0]], 1)
        alignment = WindowAlignment(offset, tokens_per_second, [chr(c) if c < 128 else "?" for c in cols],
                                    np.exp(lp.numpy()[:, cols]).T, path, "ctc")
    return out, alignment


# ----------------------------------------------------------------------------------------------------
# Cross-attention alignment (DTW)


def dtw_path(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through a (N, M) cost matrix from (0, 0) to (N - 1, M - 1), moving
    right, down or diagonally -> (rows, cols) of its cells in order.

    Row by row, vectorised: with m[j] = cost[i, j] + min(D[i-1, j-1], D[i-1, j]) and C the running sum of row
    i's costs, D[i, j] = min(m[j], D[i, j-1] + cost[i, j]) = C[j] + min over k <= j of (m[k] - C[k])."""
    cost = np.asarray(cost, dtype=np.float64)
    N, M = cost.shape
    if N == 0 or M == 0:
        raise ValueError(f"dtw_path needs a non-empty cost matrix, got shape {cost.shape}")
    move = np.zeros((N, M), dtype=np.int8)  # 0 diagonal, 1 from above, 2 from the left
    D = np.cumsum(cost[0])
    move[0, 1:] = 2
    move[0, 0] = 0
    for i in range(1, N):
        diag = np.concatenate([[np.inf], D[:-1]])
        from_up = D < diag  # ties go diagonal
        m = cost[i] + np.minimum(D, diag)
        C = np.cumsum(cost[i])
        shifted = m - C
        best = np.minimum.accumulate(shifted)
        left = shifted > best  # the minimum came from an earlier column: a run of right moves
        D = C + best
        move[i] = np.where(left, 2, np.where(from_up, 1, 0))
    rows, cols = [N - 1], [M - 1]
    i, j = N - 1, M - 1
    while i > 0 or j > 0:
        step = move[i, j]
        if i == 0 or step == 2:
            j -= 1
        elif j == 0 or step == 1:
            i -= 1
        else:
            i, j = i - 1, j - 1
        rows.append(i)
        cols.append(j)
    return np.array(rows[::-1]), np.array(cols[::-1])


def median_filter(x: Tensor, width: int) -> Tensor:
    """Median over a sliding window of odd ``width`` along the last axis, edges reflected (as Whisper does)."""
    if width <= 1:
        return x
    if width % 2 == 0:
        raise ValueError(f"median filter width must be odd, got {width}")
    pad = width // 2
    if x.shape[-1] <= pad:  # reflect padding needs more samples than the pad
        return x
    flat = x.reshape(-1, 1, x.shape[-1])
    padded = torch.nn.functional.pad(flat, (pad, pad), mode="reflect")
    return padded.unfold(-1, width, 1).median(-1).values.reshape(x.shape)


def attention_alignment(weights: Tensor, medfilt_width: int = 7) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cross-attention of the chosen heads, (H, N, M) over N text rows and M real audio frames -> the (N, M)
    alignment matrix (each head standardised over the text rows, so a head that looks at one frame for every
    token counts for nothing; median-filtered along time; averaged over heads) and the DTW path through its
    negation: (rows, cols)."""
    w = weights.float()
    std, mean = torch.std_mean(w, dim=-2, keepdim=True, unbiased=False)
    w = (w - mean) / std.clamp_min(1e-8)
    matrix = median_filter(w, medfilt_width).mean(0).cpu().numpy()
    rows, cols = dtw_path(-matrix)
    return matrix, rows, cols


def row_spans(rows: np.ndarray, cols: np.ndarray, n_rows: int) -> list[tuple[int, int]]:
    """Per row of a DTW path, its first and last column."""
    first = np.full(n_rows, -1)
    last = np.full(n_rows, -1)
    for r, c in zip(rows.tolist(), cols.tolist()):
        first[r] = c if first[r] < 0 else first[r]
        last[r] = c
    return list(zip(first.tolist(), last.tolist()))


def token_char_ends(text_tok: Any, ids: Sequence[int]) -> list[int]:
    """For each id, the number of characters of ``text_tok.decode(ids)`` decoded once it is in: a token that
    ends inside a UTF-8 character gets the end of the token that completes it."""
    ends = []
    for k in range(1, len(ids) + 1):
        prefix = text_tok.decode(list(ids[:k]))
        ends.append(len(prefix.rstrip("\ufffd")))
    for k in range(len(ends) - 2, -1, -1):  # an unfinished character belongs to the token completing it
        ends[k] = min(ends[k], ends[k + 1])
    return ends


def attention_word_timings(cross: Sequence[Tensor], token_probs: Sequence[float], text_tok: Any, ids: Sequence[int],
                           n_frames: int, tokens_per_second: float, *, offset: float = 0.0,
                           layers: Sequence[int] | None = None, heads: Sequence[Sequence[int]] | None = None,
                           medfilt_width: int = 7, keep_alignment: bool = False,
                           label: str = "attention") -> tuple[list[WordTiming], WindowAlignment | None]:
    """One window: the decoder's cross-attention (per layer (H, P + n + 1, S) over the teacher-forced input
    [prompt (P), ids (n), eos]) -> its words with absolute times. A text token's row is the query that
    predicts it (the row before it), as in Whisper; the row predicting eos takes what follows the last word.
    ``heads``: the (layer, head) pairs used (a Whisper checkpoint's alignment heads); else every head of
    ``layers`` (default: the second half, Whisper's choice when no alignment heads are known). A word's
    probability is the mean of its tokens' teacher-forced probabilities. ``label``: the alignment's method name
    for the picture ("attention": cross-attention; "self-attention": a prefix-LM's text-to-audio attention)."""
    text = text_tok.decode(list(ids))
    words = transcript_words(text)
    if not words or not ids:
        return [], None
    L = len(cross)
    P = cross[0].shape[1] - len(ids) - 1
    rows = slice(P - 1, P + len(ids))  # queries predicting ids[0] .. eos
    if heads is not None:
        pairs = check_alignment_heads(heads, L, cross[0].shape[0])
        weights = torch.stack([cross[i][h, rows, :n_frames] for i, h in pairs], 0)
    else:
        layers = list(range(L // 2, L)) if layers is None else list(layers)
        weights = torch.cat([cross[i][:, rows, :n_frames] for i in layers], 0)
    matrix, path_rows, path_cols = attention_alignment(weights, medfilt_width)
    spans = row_spans(path_rows, path_cols, len(ids) + 1)
    ends = token_char_ends(text_tok, ids)
    starts = [0] + ends[:-1]
    out = []
    for w, a, b in words:
        toks = [k for k in range(len(ids)) if starts[k] < b and ends[k] > a and ends[k] > starts[k]]
        f0, f1 = spans[toks[0]][0], spans[toks[-1]][1]
        p = float(np.mean([token_probs[k] for k in toks]))
        out.append(WordTiming(w, offset + max(f0 - 0.5, 0.0) / tokens_per_second,
                              offset + min(f1 + 0.5, n_frames) / tokens_per_second, p))
    for k in range(len(out) - 1):  # a DTW path may step down inside a frame: that frame goes to the later word
        if out[k].end > out[k + 1].start:
            out[k] = replace(out[k], end=max(out[k + 1].start, out[k].start))
    alignment = None
    if keep_alignment:
        units = [text_tok.decode([i]) for i in ids] + ["<eos>"]
        alignment = WindowAlignment(offset, tokens_per_second, units, matrix,
                                    np.stack([path_cols, path_rows], 1), label)
    return out, alignment


def check_alignment_heads(heads: Sequence[Sequence[int]], n_layers: int, n_heads: int) -> list[tuple[int, int]]:
    """(layer, head) pairs as ints, each inside a decoder of ``n_layers`` x ``n_heads``; ValueError for an empty
    list or a pair outside it (heads of another model size)."""
    pairs = [(int(p[0]), int(p[1])) for p in heads]
    if not pairs:
        raise ValueError("alignment_heads is empty: give [layer, head] pairs, or none to use the default heads")
    bad = [p for p in pairs if not (0 <= p[0] < n_layers and 0 <= p[1] < n_heads)]
    if bad:
        raise ValueError(f"alignment heads {bad} lie outside this decoder ({n_layers} layers x {n_heads} heads)")
    return pairs


# ----------------------------------------------------------------------------------------------------
# Segments


def segment_words(words: Sequence[WordTiming], max_chars: int = 84, max_gap: float = 1.0) -> list[TimedSegment]:
    """Words -> subtitle-sized segments: a new one after a sentence end (. ! ?), across a pause longer than
    ``max_gap`` seconds, or where the text would pass ``max_chars`` (two 42-character subtitle lines)."""
    segments: list[TimedSegment] = []
    run: list[WordTiming] = []

    def close() -> None:
        if run:
            segments.append(TimedSegment(run[0].start, run[-1].end, " ".join(w.word for w in run), tuple(run)))
            run.clear()

    for w in words:
        if run and (run[-1].word.rstrip("\"')]").endswith((".", "!", "?")) or w.start - run[-1].end > max_gap
                    or len(" ".join(x.word for x in run)) + 1 + len(w.word) > max_chars):
            close()
        run.append(w)
    close()
    return segments


# ----------------------------------------------------------------------------------------------------
# Token ids


def text_ids(text_tok: Any, text: str) -> list[int]:
    """The text's token ids without the tokenizer's own bos / eos (the model's prompt goes first instead)."""
    ids = text_tok.encode(text).tokens.tolist()
    if ids and ids[0] == text_tok.bos_id:
        ids = ids[1:]
    if ids and ids[-1] == text_tok.eos_id:
        ids = ids[:-1]
    return ids
