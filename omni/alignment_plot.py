"""The alignment picture of ``omni transcribe --alignment DIR``: what the word timestamps were read from.

Top: the file's log-mel spectrogram with each word's span marked and labelled. Bottom, on the same time axis:
the alignment matrix of every window at its offset in the file (CTC: the posterior of each transcript byte per
frame; attention: the decoder's averaged, standardised cross-attention per text token, or for a multitask
export's prefix-LM transcriber its text-to-audio self-attention, read the same way), rows = the transcript's
units in order, with the forced-alignment / DTW path drawn over it. matplotlib is imported only here, on use
(the ``viz`` extra).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from torch import Tensor

from omni.timestamps import TimedTranscript


def _matplotlib():  # -> (Figure, FigureCanvasAgg)
    from omni.deps import require

    require("matplotlib", "viz")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    return Figure, FigureCanvasAgg


def alignment_png(wave: Tensor, sample_rate: int, transcript: TimedTranscript, title: str = "",
                  width: float | None = None, dpi: int = 72) -> bytes:
    """The picture as PNG bytes. ``wave`` is the file's mono waveform at ``sample_rate``; ``width`` in inches
    (default: 1.2 per second of audio, within 8 .. 40, so words stay readable on long files)."""
    from omni.tokenizers.audio import log_mel

    Figure, Canvas = _matplotlib()
    mel = log_mel(wave.float(), sample_rate=sample_rate).numpy()  # (80, frames) at 100 frames/s
    seconds = wave.shape[0] / sample_rate
    width = min(max(1.2 * seconds, 8.0), 40.0) if width is None else width
    fig = Figure(figsize=(width, 5.5), dpi=dpi)
    Canvas(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 1.3]})
    top.imshow(mel, origin="lower", aspect="auto", cmap="magma", extent=(0, seconds, 0, mel.shape[0]))
    top.set_ylabel("mel bin")
    from matplotlib import patheffects

    outline = patheffects.withStroke(linewidth=2, foreground="black")  # words readable on a bright spectrogram
    words = transcript.words
    for k, w in enumerate(words):
        top.axvspan(w.start, w.end, ymin=0.0, ymax=0.06, color="cyan" if k % 2 else "lime", alpha=0.9)
        top.axvline(w.start, color="white", lw=0.6, alpha=0.7)
        top.axvline(w.end, color="white", lw=0.6, ls=":", alpha=0.7)
        top.text(w.start, mel.shape[0] * (0.9 if k % 2 else 0.78), " " + w.word, color="white", ha="left",
                 va="center", fontsize=8, clip_on=True, path_effects=[outline])
    title = title or f"word timestamps ({transcript.method})"
    limit = int(width * 12)  # characters that fit the figure's width at this font size
    top.set_title(title if len(title) <= limit else title[:limit - 1] + "…", fontsize=10)
    row = 0
    labels: list[tuple[float, str]] = []
    for win in transcript.windows:
        n_units, n_frames = win.matrix.shape
        t0 = win.offset - 0.5 / win.tokens_per_second
        extent = (t0, t0 + n_frames / win.tokens_per_second, row + n_units - 0.5, row - 0.5)
        bottom.imshow(win.matrix, aspect="auto", cmap="viridis", extent=extent, interpolation="nearest")
        path = win.path
        if len(path):
            bottom.plot(win.offset + path[:, 0] / win.tokens_per_second, row + path[:, 1], color="red", lw=0.8)
        labels += [(row + u, text) for u, text in word_rows(win.units)]
        row += n_units
    if row:
        bottom.set_ylim(row - 0.5, -0.5)
    if labels:  # one tick per word, at its first unit: every byte / token would be unreadable
        bottom.set_yticks([r for r, _ in labels], [s for _, s in labels], fontsize=7)
    kinds = {w.method for w in transcript.windows}
    bottom.set_ylabel("transcript bytes (CTC)" if kinds == {"ctc"} else
                      "text tokens (text-to-audio self-attention)" if kinds == {"self-attention"} else
                      "text tokens (cross-attention)" if kinds == {"attention"} else "text tokens")
    bottom.set_xlabel("seconds")
    bottom.set_xlim(0, seconds)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return _palette_png(buf.getvalue())


def word_rows(units: list[str]) -> list[tuple[int, str]]:
    """(first unit, word) of each word of an alignment's units: CTC bytes, where a " " byte separates words, or
    text tokens, where a word's first token starts with a space."""
    rows: list[tuple[int, str]] = []
    for u, text in enumerate(units):
        if text == " ":
            continue
        if text == "<eos>":  # the attention row predicting the end: no part of the last word
            rows.append((u, text))
        elif not rows or units[u - 1] == " " or text.startswith(" "):
            rows.append((u, text.strip()))
        else:
            rows[-1] = (rows[-1][0], rows[-1][1] + text)
    return rows


def _palette_png(png: bytes) -> bytes:
    """The PNG with its colours reduced to a 256-entry palette (Pillow, a core dependency): about a third of the
    bytes, and a spectrogram and a heat map look the same."""
    from PIL import Image

    out = io.BytesIO()
    Image.open(io.BytesIO(png)).convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT).save(
        out, format="PNG", optimize=True)
    return out.getvalue()


def write_alignment_png(path: str | os.PathLike, wave: Tensor, sample_rate: int, transcript: TimedTranscript,
                        title: str = "") -> Path:
    """``alignment_png`` written atomically to ``path``."""
    from omni.files import write_atomic

    return write_atomic(path, alignment_png(wave, sample_rate, transcript, title))


__all__ = ["alignment_png", "write_alignment_png"]
