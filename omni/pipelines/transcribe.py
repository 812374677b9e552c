"""Long-form transcription with a converted Whisper, as ``whisper.transcribe`` does it, token for token.

``WhisperSeek`` is the window policy of openai-whisper's transcribe.py: the log-mel of the whole file (plus 30 s of
zeros) normalised over the whole file (``whisper_file_log_mel``), a window = mel[:, seek:seek + 3000] padded with
0.0, the next window starting at the window's last timestamp token (or after the window when the tokens end on a
single timestamp or have none); per window ``decode_with_fallback`` (temperatures tried in turn while the
compression ratio or the average log-probability fail their thresholds, unless the window is silence), the
no-speech skip, and the previous windows' tokens as the prompt (<|startofprev|>) while conditioning is on and the
last temperature was at most 0.5. Decoding is ``omni.decoding.decode_scored`` on the model's ``TimestampMode``
(greedy, ``Categorical`` sampling at temperature > 0 under torch's global RNG as whisper samples, or beam search
ranked by the model's ``WhisperRanker``).

Left out (whisper.transcribe options without an omni counterpart yet): language detection (the export's prompt
names the language), ``initial_prompt``, ``clip_timestamps``, word timestamps and the hallucination-silence rules.
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from omni.decoding import decode_scored
from omni.speech import SpeechRecognizer
from omni.tokenizers.audio import AudioTokenizer, frame_pairs, whisper_file_log_mel

TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # whisper.transcribe's defaults


@dataclass(frozen=True)
class WindowResult:
    """One decoded window (whisper's ``DecodingResult``): tokens (prompt and eot excluded), and the scores the
    fallback and no-speech rules read."""

    tokens: list[int]
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    temperature: float


@dataclass(frozen=True)
class WhisperSeek:
    """whisper.transcribe's window policy and rules (its arguments of the same names and defaults)."""

    temperature: float | tuple[float, ...] = TEMPERATURES
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    condition_on_previous_text: bool = True
    beam_size: int = 1
    sample_len: int | None = None  # tokens per window (whisper's sample_len): default n_text_ctx // 2
    text_ctx: int = 448  # the decoder's positions (Whisper's n_text_ctx)

    def temperatures(self) -> tuple[float, ...]:
        t = self.temperature
        return (float(t),) if isinstance(t, (int, float)) else tuple(float(x) for x in t)


def _compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data))


class WhisperDecode:
    """The decode step of ``WhisperSeek``: one window (mel (n_mels, 3000)) and its prompt -> ``WindowResult``."""

    def __init__(self, model: SpeechRecognizer, audio_tok: AudioTokenizer, text_tok: Any, policy: WhisperSeek) -> None:
        self.model, self.mode, self.text_tok, self.policy = model, model.timestamp_mode(), text_tok, policy
        self.sot_prev = text_tok.token_id("<|startofprev|>")
        self.no_speech = text_tok.token_id("<|nospeech|>")
        self.sot = model.prompt[0]
        self.sample_len = policy.sample_len or dict(model.decoding.guards).get("max_new_tokens", policy.text_ctx // 2)

    def _prompted(self, previous: Sequence[int]) -> Any:
        mode = copy.copy(self.mode)
        keep = list(previous)[-(self.policy.text_ctx // 2 - 1):] if previous else []
        mode._prompt = ([self.sot_prev] + keep if previous else []) + self.mode.prompt
        return mode

    @torch.no_grad()
    def __call__(self, mel: Tensor, previous: Sequence[int]) -> WindowResult:
        dev = next(self.model.parameters()).device
        audio = frame_pairs(mel)[None].to(dev)
        memory = self.model.encode(audio, None)
        mode = self._prompted(previous)
        prompt = torch.tensor([mode.prompt], device=dev)
        sot_index = mode.prompt.index(self.sot)
        hidden = self.model.decode_hidden(prompt, memory, None)[:, sot_index]
        no_speech = float(self.model.head(hidden).float().softmax(-1)[0, self.no_speech])
        # whisper stops once the text is longer than n_text_ctx (the last token is never fed back)
        limit = max(1, min(self.sample_len, self.policy.text_ctx + 1 - len(mode.prompt)))
        result = None
        for t in self.policy.temperatures():
            beam = self.policy.beam_size if t == 0 else 1
            [(tokens, logprob)] = decode_scored(mode, memory, None, max_new_tokens=limit, temperature=t,
                                                beam_size=beam)
            text = self.text_tok.decode([i for i in tokens if i < self.mode.timestamp_begin])
            result = WindowResult(tokens, logprob / (len(tokens) + 1), _compression_ratio(text.strip()), no_speech, t)
            if not self._needs_fallback(result):
                break
        assert result is not None
        return result

    def _needs_fallback(self, r: WindowResult) -> bool:
        p = self.policy
        fallback = (p.compression_ratio_threshold is not None and r.compression_ratio > p.compression_ratio_threshold)
        fallback |= p.logprob_threshold is not None and r.avg_logprob < p.logprob_threshold
        if (p.no_speech_threshold is not None and r.no_speech_prob > p.no_speech_threshold
                and p.logprob_threshold is not None and r.avg_logprob < p.logprob_threshold):
            fallback = False  # silence
        return fallback


@dataclass
class WhisperTranscript:
    """whisper.transcribe's result: the text, and segments (start, end, text, tokens) with absolute times."""

    text: str
    segments: list[dict[str, Any]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def transcribe_whisper(model: SpeechRecognizer, audio_tok: AudioTokenizer, text_tok: Any, wave: Tensor,
                       policy: WhisperSeek | None = None) -> WhisperTranscript:
    """One waveform (samples,) at the tokenizer's rate -> ``whisper.transcribe``'s text and segments."""
    policy = policy or WhisperSeek()
    step = WhisperDecode(model, audio_tok, text_tok, policy)
    sr, hop = audio_tok.sample_rate, audio_tok.hop_length
    mel = whisper_file_log_mel(wave, sample_rate=sr, n_fft=audio_tok.n_fft, hop_length=hop,
                               n_mels=audio_tok.n_mels, seconds=audio_tok.max_seconds or 30.0)
    n_frames = int(round((audio_tok.max_seconds or 30.0) * sr)) // hop  # 3000
    content = mel.shape[-1] - n_frames
    stride = 2  # mel frames per audio token (Whisper's conv stem)
    precision = stride * hop / sr  # seconds per timestamp step: 0.02
    tb = model.timestamp_begin
    assert tb is not None
    seek, all_tokens, segments, reset = 0, [], [], 0
    while seek < content:
        offset = seek * hop / sr
        size = min(n_frames, content - seek)
        window = F.pad(mel[:, seek:seek + size], (0, n_frames - size))  # whisper's pad_or_trim: zeros
        result = step(window, all_tokens[reset:])
        if policy.no_speech_threshold is not None:
            skip = result.no_speech_prob > policy.no_speech_threshold
            if policy.logprob_threshold is not None and result.avg_logprob > policy.logprob_threshold:
                skip = False
            if skip:
                seek += size
                continue
        tokens = result.tokens
        is_ts = [i >= tb for i in tokens]
        single_ending = is_ts[-2:] == [False, True]
        consecutive = [k + 1 for k in range(len(tokens) - 1) if is_ts[k] and is_ts[k + 1]]
        current: list[dict[str, Any]] = []
        if consecutive:
            slices = consecutive + ([len(tokens)] if single_ending else [])
            last = 0
            for cut in slices:
                piece = tokens[last:cut]
                current.append({"start": offset + (piece[0] - tb) * precision,
                                "end": offset + (piece[-1] - tb) * precision, "tokens": piece})
                last = cut
            seek += size if single_ending else (tokens[last - 1] - tb) * stride
        else:
            duration = size * hop / sr
            stamps = [i for i in tokens if i >= tb]
            if stamps and stamps[-1] != tb:
                duration = (stamps[-1] - tb) * precision
            current.append({"start": offset, "end": offset + duration, "tokens": tokens})
            seek += size
        for s in current:
            s["text"] = text_tok.decode([i for i in s["tokens"] if i < model.eos_id])
            if s["start"] == s["end"] or not s["text"].strip():
                s["text"], s["tokens"] = "", []
            s["temperature"] = result.temperature
        segments.extend(current)
        all_tokens.extend(i for s in current for i in s["tokens"])
        if not policy.condition_on_previous_text or result.temperature > 0.5:
            reset = len(all_tokens)
    return WhisperTranscript(text_tok.decode([i for i in all_tokens if i < tb]), segments, all_tokens)


__all__ = ["TEMPERATURES", "WhisperDecode", "WhisperSeek", "WhisperTranscript", "WindowResult",
           "transcribe_whisper"]
