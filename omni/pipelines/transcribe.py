"""``omni transcribe`` as a pipeline above the models: files, exports, long-form windows, decoding, timing.

    waves --policy--> windows --decode step--> tokens --policy--> segments --timer--> words      (``long_form``)

One loop (``long_form``) with three parts passed in:

* a **window policy** (the one place windows are cut): ``PauseWindows`` (omni's: every window at most the
  tokenizer's 30 s, cut at the quietest 20 ms frame of its last 5 s, ``split_windows``; all windows known up front,
  decoded as batch rows) or ``WhisperSeek`` (openai-whisper's ``transcribe``: the log-mel of the whole file plus
  30 s of zeros normalised over the whole file, a window = mel[:, seek:seek + 3000] padded with 0.0, the next
  window starting at the last timestamp token, the previous windows' tokens as a <|startofprev|> prompt while
  conditioning is on; windows one after another). A policy hands out the windows it knows (``ready``) and turns
  each decoded window into segments (``advance``).
* a **decode step**: ``BatchDecode`` (``omni.speech.decode_batch`` over padded batches of windows, sorted by length)
  or ``WhisperDecode`` (whisper's ``decode_with_fallback``: temperatures tried in turn while the compression ratio
  or average log-probability fail their thresholds unless the window is silence; ``omni.decoding.decode_scored``:
  greedy, ``Categorical`` sampling under torch's global RNG as whisper samples, or beam search ranked by the
  model's ranker).
* a **word timer** (optional): ``omni.pipelines.timing.time_windows`` (CTC forced alignment or cross-/self-attention
  DTW, ``omni.timestamps``' model-free algorithms on the model's outputs).

Entry points: ``transcribe_waveforms`` (text), ``transcribe_timed`` (word times), ``transcribe_timestamp_tokens``
(a converted Whisper's segments from its timestamp tokens), ``transcribe_whisper`` (``whisper.transcribe``'s loop
and rules, token for token) and ``transcribe_files`` (``omni transcribe``: a converted Whisper takes
``WhisperSeek`` by default, omni-trained models ``PauseWindows``). Left out of ``WhisperSeek``: language detection
(the export's prompt names the language), ``initial_prompt``, ``clip_timestamps``, whisper's own word timestamps
and its hallucination-silence rules.
"""

from __future__ import annotations

import copy
import math
import os
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from omni.decoding import Ranker, WhisperRanker, decode_scored
from omni.console import one_line
from omni.export import load_config, load_pretrained, load_tokenizers, resolve_export_dir
from omni.export_kinds import speech_task
from omni.interfaces import Seq2SeqDecoder
from omni.pipelines.timing import time_windows, timing_method
from omni.pipelines.long_audio import check_one_pass, one_pass, supports_one_pass
from omni.mask_ctc import DEFAULT_THRESHOLD, check_iterations, ctc_decode, mask_ctc_decode
from omni.speculative import check_draft_tokens, check_draft_vocabulary
from omni.speech import (SILENCE_PEAK, TASK, SpeechRecognizer, ctc_draft, decode_batch, model_draft, ngram_draft,
                         pad_audio, timestamp_segments)
from omni.prefix_lm import PrefixLMTranscriber
from omni.timestamps import (Method, TimedSegment, TimedTranscript, WordTiming, segment_words, token_char_ends,
                             transcript_words)
from omni.tokenizers.audio import AudioTokenizer, frame_pairs, load_audio_file, whisper_file_log_mel
from omni.tokenizers.base import check_regular_file
from omni.tokenizers.text import TextTokenizer

# ----------------------------------------------------------------------------------------------------
# Files and exports


def read_audio_file(path: str | os.PathLike, sample_rate: int = 16000) -> Tensor:
    """Mono float waveform at ``sample_rate`` of any file libsndfile reads (WAV, FLAC, MP3, OGG ...), any
    rate and channel count. Raises FileNotFoundError / ValueError naming the file for a missing, empty
    (0 bytes or 0 samples), undecodable or silent (peak below -80 dBFS) file, and for a path that is not a
    regular file (a directory, FIFO, device or socket: refused before opening, which could block)."""
    name = os.fspath(path)
    if check_regular_file(path, "audio file").st_size == 0:
        raise ValueError(f"{name}: the file is empty (0 bytes)")
    try:
        wave = load_audio_file(name, sample_rate=sample_rate, key=name)  # in blocks: memory ~ the mono result
    except (ValueError, TypeError) as exc:
        msg = str(exc).removeprefix(f"audio sample {name!r}: ")  # the file is named once, first
        if "audio is empty" in msg:
            raise ValueError(f"{name}: the audio has no samples") from exc
        raise ValueError(f"{name}: cannot decode as audio ({msg})") from exc
    peak = max(float(wave.max()), -float(wave.min()))  # |wave| without a copy of the file
    if peak < SILENCE_PEAK:
        raise ValueError(f"{name}: the audio is silent (peak amplitude {peak:.2e} < {SILENCE_PEAK:g}); "
                         "nothing to transcribe")
    return wave


def load_recognizer(checkpoint: str | os.PathLike, device: str | torch.device | None = None
                    ) -> tuple[SpeechRecognizer, AudioTokenizer, TextTokenizer]:
    """The exported model (recipes/whisper.py writes runs/whisper/final) and its tokenizers. A converted Whisper's
    alignment heads (config "alignment_heads", [layer, head] pairs) become ``model.alignment_heads``: the
    cross-attention heads ``omni.timestamps`` times words with (None: its default heads)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_pretrained(checkpoint, device=device)
    toks = load_tokenizers(checkpoint)
    if not isinstance(model, SpeechRecognizer) or "audio" not in toks or "text" not in toks:
        raise ValueError(f"{checkpoint}: not a speech recognition export (see recipes/whisper.py)")
    model.alignment_heads = load_config(checkpoint).get("alignment_heads")
    return model, toks["audio"], toks["text"]


def recognizer(checkpoint: str | os.PathLike, device: str | torch.device | None
                ) -> tuple[Seq2SeqDecoder, AudioTokenizer, TextTokenizer]:
    """``load_recognizer``, or for a multitask export (recipes/multimodal.py) its transcribe task as a prefix-LM
    decoder (``omni.prefix_lm.PrefixLMTranscriber``) that ``transcribe_waveforms`` drives."""
    config = load_config(checkpoint)
    if config.get("builder") != "omni":
        return load_recognizer(checkpoint, device)
    task = speech_task(config)
    if task is None:
        raise ValueError(f"{checkpoint}: the multitask export has no speech recognition (transcribe) task")
    model = load_pretrained(checkpoint, device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
    toks = load_tokenizers(checkpoint)
    return PrefixLMTranscriber(model, task, toks["audio"], toks["text"], TASK), toks["audio"], toks["text"]


# ----------------------------------------------------------------------------------------------------
# Windows: the one place they are cut


def split_windows(wave: Tensor, sample_rate: int, window_seconds: float = 30.0, search_seconds: float = 5.0,
                  frame_seconds: float = 0.02) -> list[tuple[int, int]]:
    """[start, end) sample ranges covering ``wave`` (samples,), each at most ``window_seconds`` long.
    A window longer than the limit is cut at the centre of its quietest ``frame_seconds`` frame (lowest
    RMS, hop = half a frame) inside the last ``search_seconds`` before the limit: cuts land in pauses."""
    n = int(wave.shape[0])
    W = int(window_seconds * sample_rate)
    if W < 1:
        raise ValueError(f"window_seconds={window_seconds} is below one sample")
    frame = max(1, int(frame_seconds * sample_rate))
    hop = max(1, frame // 2)
    search = min(int(search_seconds * sample_rate), W - frame)
    windows, start = [], 0
    while n - start > W:
        lo = start + W - max(search, 0) - frame // 2
        region = wave[max(lo - frame // 2, start):start + W].float()
        if region.shape[0] >= frame:
            rms = region.unfold(0, frame, hop).pow(2).mean(1)
            # the latest among equally quiet frames: longer windows, fewer of them
            best = int(rms.shape[0] - 1 - torch.argmin(rms.flip(0)))
            cut = max(lo - frame // 2, start) + best * hop + frame // 2
        else:
            cut = start + W
        cut = min(max(cut, start + 1), start + W)
        windows.append((start, cut))
        start = cut
    windows.append((start, n))
    return windows


@dataclass
class Window:
    """One window of one file: where it lies (samples ``start``..``end`` of file ``file``), what the decode step
    reads (``wave``: its samples; ``mel``: a (n_mels, frames) log-mel slice for ``WhisperDecode``), the tokens to
    condition on (``previous``), and once decoded its ``result`` and ``segments`` ((start s, end s, ids), absolute)."""

    file: int
    start: int
    end: int
    key: str
    wave: Tensor
    mel: Tensor | None = None
    previous: list[int] = field(default_factory=list)
    rng: Any = None  # the file's sampling RNG state before this window (WhisperSeek with a seed)
    result: "WindowResult | None" = None
    segments: list[tuple[float, float, list[int]]] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [] if self.result is None else self.result.tokens


@dataclass(frozen=True)
class Parts:
    """What a window policy may read: the model (a ``Seq2SeqDecoder``) and its tokenizers."""

    model: Any
    audio_tok: AudioTokenizer
    text_tok: Any


class Cursor(Protocol):
    """A window policy's walk through one file: ``ready`` hands out the windows it can cut now (none once the file
    is done), ``advance`` takes one decoded window back (its segments, and where the next window starts)."""

    windows: list[Window]

    def ready(self) -> list[Window]: ...

    def advance(self, window: Window, result: "WindowResult") -> None: ...


class WindowPolicy(Protocol):
    def start(self, file: int, wave: Tensor, key: str, parts: Parts) -> Cursor: ...


@dataclass(frozen=True)
class PauseWindows:
    """omni's windows: ``split_windows`` (at most ``window_seconds``, default the tokenizer's max_seconds, cut at the
    quietest frame of the last ``search_seconds``), all handed out at once. A window's segments: with
    ``timestamps`` (decoded in a converted Whisper's timestamp mode) its timestamp tokens'
    (``omni.speech.timestamp_segments``, clamped to the window), else one segment over the window."""

    window_seconds: float | None = None
    search_seconds: float = 5.0
    timestamps: bool = False

    def start(self, file: int, wave: Tensor, key: str, parts: Parts) -> "_PauseCursor":
        sr = parts.audio_tok.sample_rate
        seconds = self.window_seconds or parts.audio_tok.max_seconds or 30.0
        bounds = split_windows(wave, sr, seconds, self.search_seconds)
        return _PauseCursor([Window(file, a, b, f"{key}@{a / sr:.2f}s", wave[a:b]) for a, b in bounds], sr,
                            getattr(parts.model, "timestamp_begin", None) if self.timestamps else None)


class _PauseCursor:
    def __init__(self, windows: list[Window], sample_rate: int, timestamp_begin: int | None) -> None:
        self.windows, self.sr, self.tb, self._handed = windows, sample_rate, timestamp_begin, False

    def ready(self) -> list[Window]:
        if self._handed:
            return []
        self._handed = True
        return list(self.windows)

    def advance(self, window: Window, result: "WindowResult") -> None:
        window.result = result
        offset, duration = window.start / self.sr, (window.end - window.start) / self.sr
        if self.tb is not None:
            window.segments = timestamp_segments(result.tokens, self.tb, offset=offset, duration=duration)
        else:
            window.segments = [(offset, offset + duration, list(result.tokens))] if result.tokens else []


TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # whisper.transcribe's defaults


@dataclass(frozen=True)
class WhisperSeek:
    """openai-whisper's transcribe loop as a window policy (its arguments of the same names and defaults; the
    decode-side ones are read by ``WhisperDecode``). Windows come one at a time per file: where the next starts
    depends on the last one's tokens."""

    temperature: float | tuple[float, ...] = TEMPERATURES
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    condition_on_previous_text: bool = True
    beam_size: int = 1
    length_penalty: float | None = None  # whisper's: None = score / length, else ((5 + length) / 6) ** this
    sample_len: int | None = None  # tokens per window (whisper's sample_len): default n_text_ctx // 2
    text_ctx: int = 448  # the decoder's positions (Whisper's n_text_ctx)
    # Sampling (temperature > 0) draws from torch's RNG as whisper does; with a seed, every file draws from its
    # own RNG seeded so (what torch.manual_seed(seed) before whisper.transcribe(file) gives), so results do not
    # depend on the other files or on what ran before; None: the global RNG as it stands (whisper's own way).
    seed: int | None = 0

    def __post_init__(self) -> None:
        if not self.temperatures() or any(not (math.isfinite(t) and t >= 0) for t in self.temperatures()):
            raise ValueError(f"temperature must be one or more finite numbers >= 0, got {self.temperature!r}")
        if self.beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {self.beam_size}")
        if self.sample_len is not None and self.sample_len < 1:
            raise ValueError(f"sample_len must be >= 1, got {self.sample_len}")

    def temperatures(self) -> tuple[float, ...]:
        t = self.temperature
        return (float(t),) if isinstance(t, (int, float)) else tuple(float(x) for x in t)

    def start(self, file: int, wave: Tensor, key: str, parts: Parts) -> "_SeekCursor":
        if getattr(parts.model, "timestamp_begin", None) is None:
            raise ValueError("whisper's long-form loop needs a converted Whisper (its timestamp tokens and prompt)")
        return _SeekCursor(self, file, wave, key, parts)


class _SeekCursor:
    """whisper.transcribe's ``seek`` loop over one file (frames of 10 ms; a timestamp step is 2 frames)."""

    def __init__(self, policy: WhisperSeek, file: int, wave: Tensor, key: str, parts: Parts) -> None:
        tok = parts.audio_tok
        self.policy, self.file, self.wave, self.key, self.parts = policy, file, wave, key, parts
        self.sr, self.hop = tok.sample_rate, tok.hop_length
        seconds = tok.max_seconds or 30.0
        # the whole file's log-mel plus 30 s of zeros, normalised over all of it (whisper's log_mel_spectrogram)
        self.mel = whisper_file_log_mel(wave, sample_rate=self.sr, n_fft=tok.n_fft, hop_length=self.hop,
                                        n_mels=tok.n_mels, seconds=seconds)
        self.n_frames = int(round(seconds * self.sr)) // self.hop  # 3000
        self.content = self.mel.shape[-1] - self.n_frames
        self.tb, self.eos = parts.model.timestamp_begin, parts.model.eos_id
        self.seek, self.reset, self.all_tokens = 0, 0, []  # whisper's seek, prompt_reset_since, all_tokens
        self.windows: list[Window] = []
        self._out: Window | None = None
        self.rng: Any = None  # the file's RNG state between windows (WhisperDecode keeps it)

    def ready(self) -> list[Window]:
        if self._out is not None or self.seek >= self.content:
            return []
        size = min(self.n_frames, self.content - self.seek)
        a = self.seek * self.hop
        b = min(a + size * self.hop, self.wave.shape[0])
        mel = F.pad(self.mel[:, self.seek:self.seek + size], (0, self.n_frames - size))  # pad_or_trim: 0.0
        self._out = Window(self.file, a, max(b, a), f"{self.key}@{a / self.sr:.2f}s", self.wave[a:b], mel,
                           self.all_tokens[self.reset:], self.rng)
        self._size = size
        return [self._out]

    def advance(self, window: Window, result: "WindowResult") -> None:
        self._out, size, p, tb = None, self._size, self.policy, self.tb
        window.result, self.rng = result, window.rng
        offset = self.seek * self.hop / self.sr
        stride = 2  # mel frames per audio token: timestamps step by 0.02 s
        precision = stride * self.hop / self.sr
        if p.no_speech_threshold is not None and result.no_speech_prob > p.no_speech_threshold and not (
                p.logprob_threshold is not None and result.avg_logprob > p.logprob_threshold):
            self.seek += size  # silence: skip the window
            return
        tokens = result.tokens
        is_ts = [i >= tb for i in tokens]
        single_ending = is_ts[-2:] == [False, True]
        consecutive = [k + 1 for k in range(len(tokens) - 1) if is_ts[k] and is_ts[k + 1]]
        segments: list[tuple[float, float, list[int]]] = []
        if consecutive:
            last = 0
            for cut in consecutive + ([len(tokens)] if single_ending else []):
                piece = tokens[last:cut]
                segments.append((offset + (piece[0] - tb) * precision, offset + (piece[-1] - tb) * precision, piece))
                last = cut
            self.seek += size if single_ending else (tokens[last - 1] - tb) * stride
        else:
            duration = size * self.hop / self.sr
            stamps = [i for i in tokens if i >= tb]
            if stamps and stamps[-1] != tb:
                duration = (stamps[-1] - tb) * precision
            segments.append((offset, offset + duration, list(tokens)))
            self.seek += size
        decode = self.parts.text_tok.decode
        # whisper empties a zero-length or blank segment (its tokens leave the prompt too)
        window.segments = [(s, e, ids if s != e and decode([i for i in ids if i < self.eos]).strip() else [])
                           for s, e, ids in segments]
        self.windows.append(window)
        self.all_tokens.extend(i for _, _, ids in window.segments for i in ids)
        if not p.condition_on_previous_text or result.temperature > 0.5:
            self.reset = len(self.all_tokens)


# ----------------------------------------------------------------------------------------------------
# Decode steps


@torch.no_grad()
def decode_windows(model: Seq2SeqDecoder, audio_tok: AudioTokenizer, windows: Sequence[Tensor], *,
                   keys: Sequence[str] | None = None, batch_size: int = 16, beam_size: int = 1,
                   length_penalty: float | Ranker | None = None, **guards: Any) -> list[list[int]]:
    """Waveforms of at most the tokenizer's max_seconds -> the generated ids of each (``decode_batch``), decoded
    in batches of ``batch_size`` sorted by length. A batch's features are computed when it is decoded, so memory
    holds one batch of them, not a whole file's (a 2 h file has 240 windows)."""
    keys = list(keys) if keys is not None else [str(i) for i in range(len(windows))]
    lengths = [audio_tok.num_tokens(int(w.shape[0])) for w in windows]  # what encode gives, without encoding
    order = sorted(range(len(windows)), key=lambda i: lengths[i])
    out: list[list[int]] = [[] for _ in windows]
    dev = next(model.parameters()).device
    for lo in range(0, len(order), batch_size):
        chunk = order[lo:lo + batch_size]
        tokens = [audio_tok.encode((windows[i], audio_tok.sample_rate), key=keys[i]).tokens for i in chunk]
        # Whisper's front-end makes every window 1,500 tokens: rounding up to 8 would add 4 masked tokens a row
        audio, mask = pad_audio(tokens, 1 if audio_tok.frontend == "whisper" else 8)
        rows = decode_batch(model, audio.to(dev), mask.to(dev), beam_size=beam_size, length_penalty=length_penalty,
                            **guards)
        for i, row in zip(chunk, rows):
            out[i] = row
    return out


@dataclass(frozen=True)
class WindowResult:
    """One decoded window (whisper's ``DecodingResult``): tokens (prompt and eot excluded) and the scores the
    fallback and no-speech rules read (nan where the step does not compute them)."""

    tokens: list[int]
    avg_logprob: float = math.nan
    compression_ratio: float = math.nan
    no_speech_prob: float = math.nan
    temperature: float = 0.0


DecodeStep = Callable[[Sequence[Window]], list[WindowResult]]


class BatchDecode:
    """Windows' waveforms -> tokens, in padded batches (``decode_windows``): greedy or beam search with the model's
    own rules and guards; ``model`` may be a ``TimestampMode``."""

    def __init__(self, model: Seq2SeqDecoder, audio_tok: AudioTokenizer, *, batch_size: int = 16, beam_size: int = 1,
                 length_penalty: float | Ranker | None = None, **guards: Any) -> None:
        self.model, self.audio_tok, self.guards = model, audio_tok, guards
        self.batch_size, self.beam_size, self.length_penalty = batch_size, beam_size, length_penalty

    def __call__(self, windows: Sequence[Window]) -> list[WindowResult]:
        ids = decode_windows(self.model, self.audio_tok, [w.wave for w in windows], keys=[w.key for w in windows],
                             batch_size=self.batch_size, beam_size=self.beam_size,
                             length_penalty=self.length_penalty, **self.guards)
        return [WindowResult(row) for row in ids]


def _compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


class WhisperDecode:
    """whisper.transcribe's ``decode_with_fallback`` on a converted Whisper's ``TimestampMode``: one window's log-mel
    and previous tokens -> ``WindowResult``, one window at a time (each has its own prompt)."""

    def __init__(self, model: SpeechRecognizer, text_tok: Any, policy: WhisperSeek) -> None:
        self.model, self.mode, self.text_tok, self.policy = model, model.timestamp_mode(), text_tok, policy
        self.sot_prev = text_tok.token_id("<|startofprev|>")
        self.no_speech = text_tok.token_id("<|nospeech|>")
        self.sot = model.prompt[0]
        self.sample_len = policy.sample_len or policy.text_ctx // 2
        self.ranker = WhisperRanker(policy.length_penalty)

    def _prompted(self, previous: Sequence[int]) -> Any:
        mode = copy.copy(self.mode)  # the same weights and rules, another prompt
        keep = list(previous)[-(self.policy.text_ctx // 2 - 1):]
        mode._prompt = ([self.sot_prev] + keep if keep else []) + self.mode.prompt
        return mode

    def __call__(self, windows: Sequence[Window]) -> list[WindowResult]:
        return [self._seeded(w) for w in windows]

    def _seeded(self, window: Window) -> WindowResult:
        """``one`` under the window's file's own RNG (``WhisperSeek.seed``), its state carried to the next window."""
        if self.policy.seed is None:
            return self.one(window)
        dev = next(self.model.parameters()).device
        cuda = dev.type == "cuda"
        with torch.random.fork_rng(devices=[dev] if cuda else []):
            if window.rng is None:
                torch.manual_seed(self.policy.seed)
            else:
                torch.set_rng_state(window.rng[0])
                if cuda:
                    torch.cuda.set_rng_state(window.rng[1], dev)
            result = self.one(window)
            window.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(dev) if cuda else None)
        return result

    @torch.no_grad()
    def one(self, window: Window) -> WindowResult:
        assert window.mel is not None
        dev = next(self.model.parameters()).device
        memory = self.model.encode(frame_pairs(window.mel)[None].to(dev), None)
        mode = self._prompted(window.previous)
        prompt = torch.tensor([mode.prompt], device=dev)
        hidden = self.model.decode_hidden(prompt, memory, None)[:, mode.prompt.index(self.sot)]
        no_speech = float(self.model.head(hidden).float().softmax(-1)[0, self.no_speech])  # raw logits at <|sot|>
        # whisper stops once the text is longer than n_text_ctx (the last token is never fed back)
        limit = max(1, min(self.sample_len, self.policy.text_ctx + 1 - len(mode.prompt)))
        result = None
        for t in self.policy.temperatures():
            beam = self.policy.beam_size if t == 0 else 1  # whisper drops beam_size when sampling
            [(tokens, logprob)] = decode_scored(mode, memory, None, max_new_tokens=limit, temperature=t,
                                                beam_size=beam, ranker=self.ranker)
            text = self.text_tok.decode([i for i in tokens if i < self.mode.timestamp_begin])
            result = WindowResult(tokens, logprob / (len(tokens) + 1), _compression_ratio(text.strip()), no_speech, t)
            if not self._needs_fallback(result):
                break
        assert result is not None
        return result

    def _needs_fallback(self, r: WindowResult) -> bool:
        p = self.policy
        fallback = p.compression_ratio_threshold is not None and r.compression_ratio > p.compression_ratio_threshold
        fallback |= p.logprob_threshold is not None and r.avg_logprob < p.logprob_threshold
        if (p.no_speech_threshold is not None and r.no_speech_prob > p.no_speech_threshold
                and p.logprob_threshold is not None and r.avg_logprob < p.logprob_threshold):
            fallback = False  # silence
        return fallback


# ----------------------------------------------------------------------------------------------------
# The loop


def long_form(parts: Parts, waves: Sequence[Tensor], policy: WindowPolicy, decode: DecodeStep, *,
              keys: Sequence[str] | None = None) -> list[list[Window]]:
    """THE long-form loop: every file's cursor (``policy.start``) hands out the windows it can cut, all of them are
    decoded together (``decode``: batches across files), and each result goes back to its cursor, until no file
    has a window left -> every file's decoded windows, in order."""
    keys = list(keys) if keys is not None else [str(i) for i in range(len(waves))]
    cursors = [policy.start(c, wave, key, parts) for c, (wave, key) in enumerate(zip(waves, keys))]
    while True:
        ready = [(cursor, w) for cursor in cursors for w in cursor.ready()]
        if not ready:
            return [cursor.windows for cursor in cursors]
        for (cursor, window), result in zip(ready, decode([w for _, w in ready])):
            cursor.advance(window, result)


# ----------------------------------------------------------------------------------------------------
# Entry points


def _text(text_tok: Any, ids: Sequence[int], timestamp_begin: int | None) -> str:
    return text_tok.decode([i for i in ids if timestamp_begin is None or i < timestamp_begin]).strip()


def _file_text(text_tok: Any, windows: Sequence[Window], timestamp_begin: int | None) -> str:
    """A file's text as whisper.transcribe gives it: every segment's tokens decoded at once (no space added)."""
    return _text(text_tok, [i for w in windows for _, _, ids in w.segments for i in ids], timestamp_begin)


@torch.no_grad()
def transcribe_waveforms(model: Seq2SeqDecoder, audio_tok: AudioTokenizer, text_tok: TextTokenizer,
                         waves: Sequence[Tensor], *, keys: Sequence[str] | None = None, batch_size: int = 16,
                         beam_size: int = 1, length_penalty: float | Ranker | None = None,
                         window_seconds: float | None = None, **guards: Any) -> list[str]:
    """Mono waveforms at ``audio_tok.sample_rate`` (any length) -> transcripts: ``long_form`` with ``PauseWindows``
    and ``BatchDecode`` (windows of every clip sorted by length, decoded in batches of ``batch_size``); a clip's
    window texts are joined with one space. For a converted Whisper this is ``whisper.decode`` per window (not
    ``whisper.transcribe``: ``transcribe_whisper``)."""
    step = BatchDecode(model, audio_tok, batch_size=batch_size, beam_size=beam_size, length_penalty=length_penalty,
                       **guards)
    files = long_form(Parts(model, audio_tok, text_tok), waves, PauseWindows(window_seconds), step, keys=keys)
    return [" ".join(t for t in (text_tok.decode(w.tokens).strip() for w in windows) if t) for windows in files]


def _words_in(segments: Sequence[tuple[float, float, list[int]]], text_tok: Any, timings: Sequence[WordTiming]
              ) -> list[TimedSegment]:
    """Token segments + the words timed in their window -> TimedSegments, a word in the segment its first character
    falls in, kept inside it."""
    ids = [i for _, _, b in segments for i in b]
    text = text_tok.decode(ids)
    ends = token_char_ends(text_tok, ids)
    starts = [a for _, a, _ in transcript_words(text)]
    if len(starts) != len(timings):  # words timed from another reading of the text: none rather than wrong
        starts, timings = [], []
    out, n = [], 0
    for start, end, b in segments:
        lo, n = (ends[n - 1] if n else 0), n + len(b)
        inside = tuple(replace(w, start=min(max(w.start, start), end), end=min(max(w.end, start), end))
                       for w, a in zip(timings, starts) if b and lo <= a < ends[n - 1])
        if text_tok.decode(b).strip():
            out.append(TimedSegment(start, end, text_tok.decode(b).strip(), inside))
    return out


def _timed_tokens(files: list[list[Window]], waves: Sequence[Tensor], parts: Parts, *, words: bool,
                  batch_size: int, keep_alignment: bool, whisper_text: bool = False) -> list[TimedTranscript]:
    """Decoded windows with timestamp-token segments -> one TimedTranscript (method "tokens") per file, word times
    inside the segments from cross-attention (``time_windows``: the window's text teacher-forced after the
    <|notimestamps|> prompt, as whisper's word timestamps do). The text: the windows' texts joined by a space, or
    with ``whisper_text`` all the tokens decoded at once (whisper.transcribe's text)."""
    model, audio_tok, text_tok = parts.model, parts.audio_tok, parts.text_tok
    sr = audio_tok.sample_rate
    flat = [w for windows in files for w in windows]
    texts = [text_tok.decode([i for _, _, b in w.segments for i in b]) for w in flat]
    timed = (time_windows(model, audio_tok, text_tok, [w.wave for w in flat], texts, [w.start / sr for w in flat],
                          method="attention", batch_size=batch_size, keep_alignment=keep_alignment)
             if words else [([], None)] * len(flat))
    per_window = {id(w): (text, t) for w, text, t in zip(flat, texts, timed)}
    out = []
    for c, windows in enumerate(files):
        segments = [s for w in windows for s in _words_in(w.segments, text_tok, per_window[id(w)][1][0])]
        text = (_file_text(text_tok, windows, model.timestamp_begin) if whisper_text else
                " ".join(per_window[id(w)][0].strip() for w in windows if per_window[id(w)][0].strip()))
        out.append(TimedTranscript(text,
                                   segments, "tokens", waves[c].shape[0] / sr,
                                   [per_window[id(w)][1][1] for w in windows if per_window[id(w)][1][1] is not None]))
    return out


@torch.no_grad()
def transcribe_timestamp_tokens(model: SpeechRecognizer, audio_tok: AudioTokenizer, text_tok: TextTokenizer,
                                waves: Sequence[Tensor], *, keys: Sequence[str] | None = None, batch_size: int = 16,
                                beam_size: int = 1, length_penalty: float | Ranker | None = None,
                                window_seconds: float | None = None, words: bool = True,
                                keep_alignment: bool = False, **guards: Any) -> list[TimedTranscript]:
    """A converted Whisper's segments from its own timestamp tokens on omni's windows (``PauseWindows``: each
    decoded in timestamp mode, ``SpeechRecognizer.timestamp_mode``, as ``whisper.decode`` does; segments with
    absolute times, clamped to the window) -> one ``TimedTranscript`` (method "tokens") per file; with ``words``,
    word times inside a segment from cross-attention."""
    parts = Parts(model, audio_tok, text_tok)
    step = BatchDecode(model.timestamp_mode(), audio_tok, batch_size=batch_size, beam_size=beam_size,
                       length_penalty=length_penalty, **guards)
    files = long_form(parts, waves, PauseWindows(window_seconds, timestamps=True), step, keys=keys)
    return _timed_tokens(files, waves, parts, words=words, batch_size=batch_size, keep_alignment=keep_alignment)


def transcribe_timed(model: Any, audio_tok: Any, text_tok: Any, waves: Sequence[Tensor], *,
                     keys: Sequence[str] | None = None, batch_size: int = 16, beam_size: int = 1,
                     length_penalty: float | Ranker | None = None, window_seconds: float | None = None,
                     method: Method = "auto", refine: bool = True, keep_alignment: bool = False, max_chars: int = 84,
                     max_gap: float = 1.0, alignment_heads: Sequence[Sequence[int]] | None = None,
                     policy: WindowPolicy | None = None, **guards: Any) -> list[TimedTranscript]:
    """``transcribe_waveforms`` with word timestamps: the same windows (``policy``, default ``PauseWindows``), each
    transcribed and then timed (``time_windows``), its words offset by the window's start; segments
    (``segment_words``) never cross a window cut. ``alignment_heads``: as ``time_windows``. With ``WhisperSeek``
    the text is whisper.transcribe's (decoded by ``WhisperDecode``)."""
    how = timing_method(model, method)  # refuse an untimeable model before decoding anything
    parts = Parts(model, audio_tok, text_tok)
    policy = policy or PauseWindows(window_seconds)
    if isinstance(policy, WhisperSeek):
        step: DecodeStep = WhisperDecode(model, text_tok, policy)
    else:
        step = BatchDecode(model, audio_tok, batch_size=batch_size, beam_size=beam_size,
                           length_penalty=length_penalty, **guards)
    files = long_form(parts, waves, policy, step, keys=keys)
    tb = getattr(model, "timestamp_begin", None)
    flat = [w for windows in files for w in windows]
    texts = [_text(text_tok, [i for _, _, b in w.segments for i in b], tb) for w in flat]
    sr = audio_tok.sample_rate
    timed = time_windows(model, audio_tok, text_tok, [w.wave for w in flat], texts, [w.start / sr for w in flat],
                         method=method, batch_size=batch_size, refine=refine, keep_alignment=keep_alignment,
                         alignment_heads=alignment_heads)
    result, k = [], 0
    for c, windows in enumerate(files):
        mine = range(k, k + len(windows))
        k += len(windows)
        segments = [s for i in mine for s in segment_words(timed[i][0], max_chars, max_gap)]
        text = (_file_text(text_tok, windows, tb) if isinstance(policy, WhisperSeek)
                else " ".join(texts[i] for i in mine if texts[i]))
        result.append(TimedTranscript(text, segments, how,
                                      waves[c].shape[0] / sr, [timed[i][1] for i in mine if timed[i][1] is not None]))
    return result


@dataclass
class WhisperTranscript:
    """whisper.transcribe's result: the text, its segments (start, end, tokens, temperature; absolute times) and
    all the tokens."""

    text: str
    segments: list[dict[str, Any]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


@torch.no_grad()
def transcribe_whisper(model: SpeechRecognizer, audio_tok: AudioTokenizer, text_tok: Any, waves: Sequence[Tensor],
                       policy: WhisperSeek | None = None, *, keys: Sequence[str] | None = None
                       ) -> list[WhisperTranscript]:
    """Waveforms (samples,) at the tokenizer's rate -> ``whisper.transcribe``'s text and segments, token for token:
    ``long_form`` with ``WhisperSeek`` and ``WhisperDecode``."""
    policy = policy or WhisperSeek()
    files = long_form(Parts(model, audio_tok, text_tok), waves, policy, WhisperDecode(model, text_tok, policy),
                      keys=keys)
    tb = model.timestamp_begin
    out = []
    for windows in files:
        segments = [{"start": s, "end": e, "tokens": ids, "temperature": w.result.temperature,
                     "text": text_tok.decode([i for i in ids if i < model.eos_id])}
                    for w in windows if w.result is not None for s, e, ids in w.segments]
        tokens = [i for s in segments for i in s["tokens"]]
        out.append(WhisperTranscript(text_tok.decode([i for i in tokens if i < tb]), segments, tokens))
    return out


DECODE_MODES = ("greedy", "beam", "ctc", "mask-ctc")
WINDOWS = ("auto", "whisper", "pauses", "one-pass")


def _read_files(files: Sequence[str | os.PathLike], sample_rate: int, return_exceptions: bool
                ) -> tuple[list[Any], dict[int, Tensor]]:
    """Every file read and checked before any is transcribed: (a result list with "" per readable file, or its
    exception with ``return_exceptions``; {index: waveform at ``sample_rate``})."""
    results: list[Any] = []
    waves: dict[int, Tensor] = {}
    for i, f in enumerate(files):
        try:
            waves[i] = read_audio_file(f, sample_rate)
            results.append("")
        except (OSError, ValueError) as exc:
            if not return_exceptions:
                raise
            results.append(exc)
    return results, waves


def _one_pass_files(model: SpeechRecognizer, audio_tok: AudioTokenizer, files: Sequence[str | os.PathLike],
                    return_exceptions: bool, timestamps: bool) -> list[Any]:
    """``transcribe_files`` for windows "one-pass": each file's CTC text from ONE encoder pass (a local encoder:
    omni.pipelines.long_audio), word times absolute; every file read and checked before any is transcribed."""
    results, waves = _read_files(files, audio_tok.sample_rate, return_exceptions)
    for i, wave in waves.items():
        # spans of 5 min: the same states as one whole pass (encode_long), the encoder's activations bounded
        text, words = one_pass(model, audio_tok, wave, words=timestamps, span_seconds=300.0)
        results[i] = (TimedTranscript(text, segment_words(words), "ctc", wave.shape[0] / audio_tok.sample_rate)
                      if timestamps else text)
    return results


def load_draft_recognizer(draft: str | os.PathLike, audio_tok: AudioTokenizer, text_tok: Any,
                          device: torch.device | str) -> SpeechRecognizer:
    """A draft model for speculative transcription (``--draft PATH``): a speech recognition export whose text
    vocabulary and audio features are this model's (ValueError in one line naming --draft otherwise), in eval mode
    on ``device``."""
    try:
        draft = resolve_export_dir(draft)  # a run directory: its export
        draft_model, draft_audio, draft_text = recognizer(draft, device)
    except (OSError, KeyError, ValueError) as exc:
        said = one_line(exc).removeprefix(f"{os.fspath(draft)}: ")
        if "speech recognition export" not in said:
            said = f"not a speech recognition export ({said})"
        raise ValueError(f"--draft {os.fspath(draft)}: {said}") from exc
    if not isinstance(draft_model, SpeechRecognizer):
        raise ValueError(f"--draft {os.fspath(draft)}: a draft model is a speech recognition export "
                         "(recipes/whisper.py, omni convert of a Whisper)")
    check_draft_vocabulary(text_tok, draft_text, os.fspath(draft))
    if draft_audio.config() != audio_tok.config():
        raise ValueError(f"--draft {os.fspath(draft)}: its audio features ({draft_audio.config()}) are not this "
                         "model's: a draft model encodes the same audio tokens")
    return draft_model


def transcribe_files(checkpoint: str | os.PathLike, files: Sequence[str | os.PathLike], *, beam_size: int = 1,
                     length_penalty: float | None = None, batch_size: int = 16, device: str | None = None,
                     max_new_tokens: int = 224, return_exceptions: bool = False, timestamps: bool = False,
                     timing: dict[str, Any] | None = None, windows: str = "auto",
                     whisper: WhisperSeek | None = None, draft: str | os.PathLike | None = None, draft_tokens: int = 4,
                     decode: str | None = None, iterations: int | None = None, mask_threshold: float | None = None,
                     stats: Any = None) -> list[Any]:
    """Transcribe audio files (WAV, FLAC, MP3, OGG ...; any rate, channels, length) with a speech recognition
    export (recipes/whisper.py, a converted Whisper) or the transcribe task of a multitask export
    (recipes/multimodal.py). Every file is read and checked first, so a bad file fails before any decoding, naming
    the file; with ``return_exceptions`` its exception takes its place in the result instead and the other files
    are transcribed (the export's own errors raise either way). One text per file, or with ``timestamps`` one
    ``omni.timestamps.TimedTranscript`` (word times; ``timing``: options of ``transcribe_timed``; its
    ``method="tokens"``: a converted Whisper's segments from its own timestamp tokens, with ``keep_alignment`` its
    only other option).

    ``windows``: "auto" (with decode "ctc", "one-pass" for an export whose encoder attends locally; else the export
    config's "long_form"; without one a converted Whisper (config "source") takes "whisper", anything else "pauses";
    recipes/whisper.py's fine-tuned exports record "pauses": decoded as its eval decodes, without timestamps),
    "one-pass" (the whole file in ONE encoder pass, the CTC head's text and absolute word times: a local encoder,
    recipes/whisper.py --preset cpu-long; omni.pipelines.long_audio), "whisper" (``whisper.transcribe``'s loop
    and rules, ``WhisperSeek``: ``whisper`` gives its options, default whisper's with this call's beam_size,
    length_penalty (whisper's meaning) and max_new_tokens as sample_len) or "pauses" (omni's ``PauseWindows``, each
    window decoded alone: ``whisper.decode`` per window; at most the export config's "long_form_seconds" long, the
    longest clip recipes/whisper.py trained it on, else the tokenizer's max_seconds).

    ``draft``: "ctc" (the export's CTC head drafts), "ngram" (the text so far does) or a draft model's export
    directory (a smaller speech model with the same vocabulary and audio features): speculative decoding of the
    windows (omni.speculative: greedy's text in fewer decoder passes), ``draft_tokens`` per pass; greedy only.

    ``decode``: None (greedy, or beam search when beam_size > 1), "greedy", "beam", "ctc" (the CTC head's own best
    path, re-tokenised: omni.mask_ctc.ctc_decode) or "mask-ctc" (the CTC text's unsure tokens re-predicted by the
    decoder's masked LM in ``iterations`` passes, default 3; the tokens under ``mask_threshold``: omni.mask_ctc).
    ``stats``: a DraftStats (draft) or MaskCTCStats (ctc / mask-ctc) filled in place."""
    decode = decode or ("beam" if beam_size > 1 else "greedy")
    if decode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, got {decode!r}")
    if decode == "greedy" and beam_size != 1:
        raise ValueError(f"decode 'greedy' has no beam: beam_size {beam_size} is decode 'beam'")
    if decode in ("ctc", "mask-ctc") and beam_size != 1:
        raise ValueError(f"decode {decode!r} has no beam: beam_size must be 1, got {beam_size}")
    if iterations is not None:
        if decode != "mask-ctc":
            raise ValueError(f"iterations are Mask-CTC's passes: decode 'mask-ctc', not {decode!r}")
        check_iterations(iterations)
    if draft is not None:
        if decode != "greedy" or beam_size != 1:
            raise ValueError(f"draft decoding is greedy's text in fewer passes: not with decode {decode!r}")
        check_draft_tokens(draft_tokens)
    for option, value in (("beam_size", beam_size), ("batch_size", batch_size), ("max_new_tokens", max_new_tokens)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
    if length_penalty is not None and not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty}")
    if windows not in WINDOWS:
        raise ValueError(f"windows must be {', '.join(WINDOWS)}, got {windows!r}")
    if windows == "one-pass" and decode != "ctc":
        raise ValueError(f"one pass gives the CTC head's text (the decoder reads 30 s at most): decode 'ctc', not "
                         f"{decode!r}")
    model, audio_tok, text_tok = recognizer(checkpoint, device)
    is_whisper = getattr(model, "timestamp_begin", None) is not None
    keep_alignment = bool((timing or {}).get("keep_alignment"))
    if windows == "auto" and decode == "ctc" and not keep_alignment and supports_one_pass(model, audio_tok):
        windows = "one-pass"  # a local encoder (recipes/whisper.py --preset cpu-long): the whole file at once
    if windows == "one-pass":
        try:
            check_one_pass(model, audio_tok)
        except ValueError as exc:
            raise ValueError(f"{os.fspath(checkpoint)}: {exc}") from exc
        if keep_alignment:
            raise ValueError("alignment pictures show each window's alignment; one pass has no windows: transcribe "
                             "with --long-form pauses to draw them")
        return _one_pass_files(model, audio_tok, files, return_exceptions, timestamps)
    if windows == "auto":  # the export's own (recipes/whisper.py records "pauses"), else a converted Whisper's
        config = load_config(checkpoint)
        windows = config.get("long_form") or ("whisper" if is_whisper and "source" in config else "pauses")
        if windows not in ("whisper", "pauses"):
            raise ValueError(f"{os.fspath(checkpoint)}: config.json's long_form is {windows!r}; expected "
                             "'whisper' or 'pauses'")
    tokens = timestamps and (timing or {}).get("method") == "tokens"
    if (tokens or windows == "whisper") and not is_whisper:  # before any file is read
        what = "timestamps from tokens" if tokens else "whisper's windows"
        raise ValueError(f"{os.fspath(checkpoint)}: {what} need a converted Whisper (its timestamp tokens "
                         "<|0.00|> .. <|30.00|> and prompt); time this export with ctc or attention")
    seek = None
    if windows == "whisper":
        seek = whisper or WhisperSeek(beam_size=beam_size, length_penalty=length_penalty, sample_len=max_new_tokens)
    results, waves = _read_files(files, audio_tok.sample_rate, return_exceptions)
    if not waves:
        return results
    keys = [os.fspath(files[i]) for i in waves]
    parts = Parts(model, audio_tok, text_tok)
    # omni's windows are at most as long as the clips the export trained on (recipes/whisper.py records it)
    batch = dict(keys=keys, batch_size=batch_size, beam_size=beam_size, length_penalty=length_penalty,
                 max_new_tokens=max_new_tokens, window_seconds=load_config(checkpoint).get("long_form_seconds"))
    if draft is not None:
        if seek is not None:
            raise ValueError(f"{os.fspath(checkpoint)}: draft decoding runs on omni's pause windows; this export "
                             "is transcribed by whisper.transcribe's loop (windows 'whisper')")
        try:
            if draft in ("ctc", "ngram"):
                source = ctc_draft(model, text_tok) if draft == "ctc" else ngram_draft
            else:
                source = model_draft(load_draft_recognizer(draft, audio_tok, text_tok, next(model.parameters()).device))
        except ValueError as exc:
            raise ValueError(f"{os.fspath(checkpoint)}: {exc}") from exc
        batch.update(draft=source, draft_tokens=draft_tokens, draft_stats=stats)
    if decode in ("ctc", "mask-ctc"):
        if seek is not None:
            raise ValueError(f"{os.fspath(checkpoint)}: --decode {decode} runs on omni's pause windows; this export "
                             "is transcribed by whisper.transcribe's loop (windows 'whisper')")
        if tokens:
            raise ValueError(f"--decode {decode} writes no timestamp tokens: time it with --timestamps ctc or auto")
        try:
            parallel = (ctc_decode(model, text_tok, stats) if decode == "ctc" else
                        mask_ctc_decode(model, text_tok, iterations or 3,
                                        DEFAULT_THRESHOLD if mask_threshold is None else mask_threshold, stats=stats))
        except ValueError as exc:
            raise ValueError(f"{os.fspath(checkpoint)}: {exc}") from exc
        batch.update(parallel=parallel)
    out: list[Any]
    if tokens:
        keep = bool((timing or {}).get("keep_alignment", False))
        if seek is not None:
            decoded = long_form(parts, list(waves.values()), seek, WhisperDecode(model, text_tok, seek), keys=keys)
            out = _timed_tokens(decoded, list(waves.values()), parts, words=True, batch_size=batch_size,
                                keep_alignment=keep, whisper_text=True)
        else:
            out = transcribe_timestamp_tokens(model, audio_tok, text_tok, list(waves.values()), keep_alignment=keep,
                                              **batch)
    elif timestamps:
        out = transcribe_timed(model, audio_tok, text_tok, list(waves.values()), policy=seek, **(timing or {}),
                               **batch)
    elif seek is not None:
        out = [r.text.strip() for r in transcribe_whisper(model, audio_tok, text_tok, list(waves.values()), seek,
                                                          keys=keys)]
    else:
        out = transcribe_waveforms(model, audio_tok, text_tok, list(waves.values()), **batch)
    for i, result in zip(waves, out):
        results[i] = result
    return results


__all__ = [
    "BatchDecode", "Cursor", "DECODE_MODES", "PauseWindows", "WINDOWS", "Parts", "TEMPERATURES", "WhisperDecode", "WhisperSeek",
    "WhisperTranscript", "Window", "WindowPolicy", "WindowResult", "decode_windows", "load_recognizer", "long_form",
    "read_audio_file", "recognizer", "split_windows", "transcribe_files", "transcribe_timed",
    "transcribe_timestamp_tokens", "transcribe_waveforms", "transcribe_whisper",
]
