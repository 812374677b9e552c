"""A long recording in ONE encoder pass (#26): no 30 s windows for a speech model whose encoder attends locally.

    wave --front end in chunks--> log-mel tokens --embedded chunk by chunk--> encoder over the whole recording
         (local attention: omni.attention_patterns' BlockMask per pattern, the eager banded path on the CPU, the
         compiled Flex kernels on CUDA; memory and time linear in its length)
         --CTC head--> greedy text; word times: omni.timestamps' CTC alignment over pieces of at most 30 s cut
         in the greedy path's longest blank runs, times absolute.

``one_pass(model, audio_tok, wave) -> (text, words)`` is the entry point; ``check_one_pass`` says in one line why
a model cannot take it (``supports_one_pass``: the same as a bool, for routing). What a model needs:

* an encoder whose every layer attends locally (a window / dilated pattern of bounded reach, optionally with
  global tokens): a full-attention encoder (every omni model before #26, every converted Whisper) is refused. It
  was trained on clips of at most 30 s, and over an hour its attention would span 100,000+ tokens it never saw,
  at a cost growing with the square of the length: those keep the 30 s windows (``omni transcribe``'s default);
* relative positions (the trunk's RoPE, or none): absolute ones (``audio_positions="sinusoidal"``, a learned or
  sinusoidal trunk table) name places the model never saw past its training clips' 1-15 s;
* a CTC head (the text and the word times come from it; the decoder's transcripts are 30 s long at most);
* omni's windowed log-mel front end (Whisper's pads every clip to 30 s).

``span_seconds`` (``encode_long``) bounds the encoder's memory without changing a number: a local layer's output
reads only its reach, so the trunk can run over spans with the layers' summed reach of context either side
(measured at 60 min: 358 MiB instead of 1.1 GB, the same text and times).

The front end (``features``) equals ``AudioTokenizer.encode`` on the whole recording (tests: to 1e-6): the STFT runs
over chunks of ``chunk_seconds`` with two frames of context each side, the normalisation takes the peak of the
whole recording, and tokens are cut per chunk, so memory holds the log-mel (80 floats per 10 ms: 115 MB an hour)
and one chunk's STFT, not an hour's (~2 GB). Normalising over the whole recording is what one pass means (the 30 s
windows normalise each window over itself).

Word times: ``omni.timestamps.ctc_word_timings`` (the forced alignment ``omni transcribe --timestamps`` uses, with
the energy refinement) on pieces of the recording: its alignment keeps a (frames x labels) table, which over an
hour would be ~10^10 entries. The cuts lie at blank frames of the greedy path (the middle of the longest run of
blank / space frames in the last ``search_seconds`` of a piece: the pauses), so the greedy text is the pieces'
texts joined, and each piece's words are offset by the piece's start: absolute in the recording.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from omni.asr_text import CTC_BLANK
from omni.asr_text import ctc_collapse as collapse  # the best-path text of a label path
from omni.attention_patterns import UNBOUNDED, Pattern, Schedule, lower
from omni.timestamps import WordTiming, ctc_word_timings, frame_energy
from omni.tokenizers.audio import (_DYNAMIC_RANGE, _MEL_CLAMP, _OFFSET, _SCALE, AudioTokenizer, _mel_transform, log_mel,
                                  log_mel_floor)

SPACE = 32  # the CTC label of " " (UTF-8 bytes)
ABSOLUTE = ("learned", "learned_1d", "sinusoidal")  # trunk positions that name places, not distances


# ----------------------------------------------------------------------------------------------------
# Which models take one pass


def layer_reach(p: Pattern | None) -> int | None:
    """How far (tokens, either side) a layer of pattern ``p`` attends, or None when it attends to everything (full,
    an unbounded window / dilation) or on a 2-D grid. Global tokens are not counted: they cost a few rows and
    columns, linear in the length."""
    if p is None:
        return None
    full, win, before, after, dil, _, dbefore, dafter, grid = lower(p)[:9]
    sides = ([before, after] if win else []) + ([dbefore, dafter] if dil else [])
    if full or grid or not sides or max(sides) >= UNBOUNDED:
        return None
    return max(sides)


def local_reach(schedule: Schedule) -> int | None:
    """The farthest any layer of ``schedule`` attends (``layer_reach``), None unless every layer is local."""
    reaches = [layer_reach(p) for p in schedule.layers]
    return None if any(r is None for r in reaches) else max(reaches, default=0)  # type: ignore[type-var]


def receptive_field(schedule: Schedule) -> int | None:
    """How far (tokens, either side) a token's final state reads through all the layers of a local ``schedule``:
    the sum of their reaches; None when some layer is not local or has global tokens (which read everything)."""
    if local_reach(schedule) is None or any(lower(p)[11] for p in schedule.layers):
        return None
    return sum(layer_reach(p) or 0 for p in schedule.layers)


def check_one_pass(model: Any, audio_tok: AudioTokenizer, seconds: float | None = None) -> None:
    """ValueError in one line unless ``model`` (a SpeechRecognizer) can transcribe a long recording in one encoder
    pass (see the module docstring); ``seconds`` (the recording's length) goes into the full-attention message."""
    encoder = getattr(model, "encoder", None)
    if encoder is None or not hasattr(encoder, "schedule"):
        raise ValueError(f"one pass needs a speech recognition model (an encoder trunk), got {type(model).__name__}")
    if local_reach(encoder.schedule) is None:
        n = None if seconds is None else audio_tok.num_tokens(int(seconds * audio_tok.sample_rate))
        size = "" if n is None else f" over {seconds:.0f} s ({n:,} tokens, every pair of them in every layer)"
        raise ValueError(f"this model's encoder has full attention: one pass{size} would attend over contexts it was "
                         "never trained on at a cost growing with the square of the length: transcribe it in windows "
                         "(--long-form pauses); a model trained with a local encoder takes one pass "
                         "(recipes/whisper.py --preset cpu-long, or encoder_attention=...)")
    if getattr(model, "audio_positions", "none") != "none" or encoder.cfg.positions in ABSOLUTE:
        what = ("audio_positions='sinusoidal'" if getattr(model, "audio_positions", "none") != "none"
                else f"positions={encoder.cfg.positions!r}")
        raise ValueError(f"one pass needs relative positions (RoPE or none) in the encoder; this model adds absolute "
                         f"ones ({what}), which name places it never saw beyond its training clips")
    if getattr(model, "ctc_head", None) is None:
        raise ValueError("one pass reads the text from the CTC head; this model has none (train with ctc_weight > 0)")
    if audio_tok.frontend != "windows":
        raise ValueError("one pass needs omni's windowed log-mel front end; this tokenizer's is "
                         f"{audio_tok.frontend!r} (it pads every clip to its max_seconds)")


def supports_one_pass(model: Any, audio_tok: AudioTokenizer) -> bool:
    """Whether ``check_one_pass`` accepts the model (for routing: ``omni transcribe`` picks one pass for these)."""
    try:
        check_one_pass(model, audio_tok)
    except ValueError:
        return False
    return True


# ----------------------------------------------------------------------------------------------------
# The front end in chunks


def log_mel_chunked(wave: Tensor, audio_tok: AudioTokenizer, chunk_seconds: float = 30.0) -> Tensor:
    """``omni.tokenizers.audio.log_mel`` of the whole (samples,) ``wave`` with the tokenizer's settings, computed
    ``chunk_seconds`` of frames at a time: each chunk's STFT reads its samples with ceil(n_fft / 2 / hop) frames of
    context either side (the recording's own reflect padding at its two ends), so every frame sees the samples it
    sees in one STFT; the normalisation's peak is the whole recording's."""
    hop, n_fft = audio_tok.hop_length, audio_tok.n_fft
    n = int(wave.shape[-1])
    frames = 1 + n // hop
    step = max(1, int(chunk_seconds * audio_tok.sample_rate) // hop)
    context = -(-(n_fft // 2) // hop)
    if frames <= step + 2 * context or n < n_fft // 2 + 1:
        return log_mel(wave, sample_rate=audio_tok.sample_rate, n_fft=n_fft, hop_length=hop, n_mels=audio_tok.n_mels)
    x = wave.float()
    transform = _mel_transform(audio_tok.sample_rate, n_fft, hop, audio_tok.n_mels, str(x.device))
    logs = torch.empty(audio_tok.n_mels, frames, device=x.device)
    for f0 in range(0, frames, step):
        f1 = min(frames, f0 + step)
        left = min(context, f0)
        s0 = (f0 - left) * hop
        s1 = n if f1 + context >= frames else (f1 - 1) * hop + n_fft // 2 + 1  # the last frame's window, whole
        mel = transform(x[s0:s1])[..., left:left + f1 - f0]
        logs[:, f0:f1] = torch.clamp(mel, min=_MEL_CLAMP).log10()
    # omni.tokenizers.audio._normalise's floor and scale, in place on the stored logs (tests: equal to log_mel)
    peak = logs.amax()
    torch.maximum(logs, peak - _DYNAMIC_RANGE, out=logs)
    return logs.add_(_OFFSET).div_(_SCALE)


def features(wave: Tensor, audio_tok: AudioTokenizer, chunk_seconds: float = 30.0) -> Iterator[Tensor]:
    """The recording's audio tokens (what ``audio_tok.encode`` gives for the whole ``wave``, (n, n_mels * kernel)),
    ``chunk_seconds`` of them at a time: a chunk's windows read their neighbours' frames, the recording's edges
    are padded with its ``log_mel_floor``."""
    mel = log_mel_chunked(wave, audio_tok, chunk_seconds)
    n_mels, frames = mel.shape
    kernel, stride = audio_tok.kernel, audio_tok.stride
    left = kernel // 2
    pad = log_mel_floor(mel).reshape(1, 1)  # what unfold_tokens pads the recording's two edges with
    n_tokens = (frames - 1) // stride + 1
    per = max(1, int(chunk_seconds * audio_tok.tokens_per_second))
    for t0 in range(0, n_tokens, per):
        t1 = min(n_tokens, t0 + per)
        a, b = stride * t0 - left, stride * (t1 - 1) - left + kernel  # frames [a, b) the chunk's windows read
        piece = mel[:, max(a, 0):min(b, frames)]
        piece = torch.cat([pad.expand(n_mels, max(0, -a)), piece, pad.expand(n_mels, max(0, b - frames))], -1)
        windows = piece.unfold(-1, kernel, stride)  # (n_mels, t1 - t0, kernel)
        yield windows.transpose(0, 1).reshape(t1 - t0, n_mels * kernel)


def front_end(wave: Tensor, audio_tok: AudioTokenizer, chunk_seconds: float = 30.0) -> Tensor:
    """Every token of ``features`` in one (n, n_mels * kernel) tensor."""
    return torch.cat(list(features(wave, audio_tok, chunk_seconds)))


# ----------------------------------------------------------------------------------------------------
# The encoder pass and the CTC head


@torch.no_grad()
def encode_long(model: Any, audio_tok: AudioTokenizer, wave: Tensor, chunk_seconds: float = 30.0,
                span_seconds: float | None = None) -> Tensor:
    """The encoder's states (1, n, d) over the whole recording in one pass: tokens embedded a chunk at a time (the
    embedder is per token), the trunk called without a mask, so every local layer takes its BlockMask (the banded
    path on the CPU: memory linear in n) and no (n x n) mask is ever built.

    ``span_seconds``: the trunk runs over spans of that many seconds, each with ``receptive_field`` tokens of context
    either side (positions kept), and keeps the span's states: the same states (a local layer's output reads only
    that far), with the encoder's activations held for one span, not the recording (its embeddings and states stay
    linear, 2 x d floats a token). Refused for patterns with global tokens."""
    seconds = wave.shape[-1] / audio_tok.sample_rate
    check_one_pass(model, audio_tok, seconds)
    p = next(model.parameters())
    n = audio_tok.num_tokens(int(wave.shape[-1]))
    x = torch.empty(1, n, model.encoder.cfg.d_model, device=p.device, dtype=p.dtype)
    at = 0
    for chunk in features(wave, audio_tok, chunk_seconds):
        x[0, at:at + chunk.shape[0]] = model.audio_embed(chunk.to(p.device, p.dtype))
        at += chunk.shape[0]
    assert at == n, (at, n)
    span = None if span_seconds is None else max(1, int(span_seconds * audio_tok.tokens_per_second))
    if span is None or span >= n:
        return model.encoder(x, None, None)
    margin = receptive_field(model.encoder.schedule)
    if margin is None:
        raise ValueError("span_seconds needs an encoder whose layers all read a bounded neighbourhood; this one has "
                         "global tokens, which read the whole recording: use one pass without spans")
    out = torch.empty_like(x)
    for a in range(0, n, span):
        b = min(n, a + span)
        lo, hi = max(0, a - margin), min(n, b + margin)
        states = model.encoder(x[:, lo:hi], torch.arange(lo, hi, device=p.device)[None], None)
        out[:, a:b] = states[:, a - lo:b - lo]
    return out


@torch.no_grad()
def ctc_log_probs(model: Any, memory: Tensor, chunk: int = 8192) -> Tensor:
    """(n, 257) float32 CTC log-probabilities of the encoder states (1, n, d), ``chunk`` tokens at a time."""
    out = torch.empty(memory.shape[1], CTC_BLANK + 1)
    for a in range(0, memory.shape[1], chunk):
        out[a:a + chunk] = model.ctc_head(memory[0, a:a + chunk]).float().log_softmax(-1).cpu()
    return out


def pieces(path: np.ndarray, limit: int, search: int) -> list[tuple[int, int]]:
    """[start, end) frame ranges covering ``path`` (greedy CTC labels), each at most ``limit`` frames. A piece that
    must end is cut inside the longest run of blank / space frames among its last ``search`` frames, at the blank
    frame nearest the run's middle (a pause between words, where no label spans the cut), else at its last blank
    frame; a piece with no blank frame at all ends at the limit."""
    n = len(path)
    quiet = (path == CTC_BLANK) | (path == SPACE)
    out, start = [], 0
    while n - start > limit:
        lo, hi = start + max(1, limit - search), start + limit  # the cut c lies in [lo, hi]: piece [start, c)
        best, best_len, i = -1, 0, lo
        while i <= hi:
            if not quiet[i]:
                i += 1
                continue
            j = i
            while j + 1 <= hi and quiet[j + 1]:
                j += 1
            blanks = np.flatnonzero(path[i:j + 1] == CTC_BLANK) + i
            if len(blanks) and j - i + 1 > best_len:
                mid = (i + j) / 2
                best, best_len = int(blanks[np.argmin(np.abs(blanks - mid))]), j - i + 1
            i = j + 1
        if best < 0:
            blanks = np.flatnonzero(path[start + 1:hi + 1] == CTC_BLANK)
            best = start + 1 + int(blanks[-1]) if len(blanks) else hi
        out.append((start, best))
        start = best
    out.append((start, n))
    return out


def ctc_words(log_probs: Tensor, audio_tok: AudioTokenizer, wave: Tensor | None = None, *, piece_seconds: float = 30.0,
              search_seconds: float = 10.0) -> list[WordTiming]:
    """The words of the greedy text of (n, 257) CTC log-probabilities over a whole recording, with absolute start / end
    (s): ``ctc_word_timings`` on each of its ``pieces`` (at most ``piece_seconds``), offset by the piece's start;
    ``wave`` (the recording) turns on the energy refinement, read per piece as ``omni transcribe --timestamps``
    reads it per window."""
    tps = audio_tok.tokens_per_second
    per_token = audio_tok.sample_rate / tps  # samples per audio token (480 at 33 Hz)
    path = log_probs.argmax(-1).numpy()
    timed: list[WordTiming] = []
    for a, b in pieces(path, max(2, int(piece_seconds * tps)), max(1, int(search_seconds * tps))):
        text = collapse(path[a:b])
        if not text.strip():
            continue
        energy = None
        if wave is not None:
            piece = wave[round(a * per_token):round((b + 1) * per_token)]
            energy = frame_energy(piece, audio_tok.sample_rate, tps, b - a)
        timed.extend(ctc_word_timings(log_probs[a:b], text, tps, offset=a / tps, energy=energy)[0])
    return timed


def one_pass(model: Any, audio_tok: AudioTokenizer, wave: Tensor, *, words: bool = True, refine: bool = True,
             chunk_seconds: float = 30.0, span_seconds: float | None = None, piece_seconds: float = 30.0,
             search_seconds: float = 10.0) -> tuple[str, list[WordTiming]]:
    """A long mono ``wave`` (samples,) at ``audio_tok.sample_rate`` -> (text, words): the CTC head's greedy text of
    ONE encoder pass over the whole recording, and (``words``) each word's absolute start / end (s) from the CTC
    forced alignment over pieces of at most ``piece_seconds`` (``ctc_words``; ``refine``: the energy refinement of
    ``omni transcribe --timestamps``). ``span_seconds``: ``encode_long``'s (the same states, the encoder's memory
    bounded). ValueError in one line for a model that cannot (``check_one_pass``)."""
    memory = encode_long(model, audio_tok, wave, chunk_seconds, span_seconds)
    log_probs = ctc_log_probs(model, memory)
    del memory
    text = " ".join(collapse(log_probs.argmax(-1).numpy()).split())
    if not words:
        return text, []
    return text, ctc_words(log_probs, audio_tok, wave if refine else None, piece_seconds=piece_seconds,
                           search_seconds=search_seconds)


__all__ = ["check_one_pass", "collapse", "ctc_log_probs", "ctc_words", "encode_long", "features", "front_end",
           "layer_reach", "local_reach", "log_mel_chunked", "one_pass", "pieces", "receptive_field",
           "supports_one_pass"]
