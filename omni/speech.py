"""Whisper-style speech recognition on the shared trunk: model, batching, batch decoding, loss, metrics.

    audio --AudioTokenizer--> (S, n_mels*5) log-mel windows --AudioEmbedder--> encoder Trunk (bidirectional)
                                                                                  |  memory (B, S, d)
    [bos, <|transcribe|>, ids..., eos] --TextEmbedder--> decoder Trunk (causal + cross-attention) --> LMHead (tied)

Design decisions (documented here because recipes/whisper.py and `omni transcribe` rely on them):

* Batches are PADDED, not packed. Clips of one batch are right-padded to the longest (rounded up to a
  multiple of ``pad_multiple``) and a key-padding ``audio_mask`` (B, S) hides the padding from encoder
  self-attention and decoder cross-attention. Padding costs little here (utterances of one batch are
  1-15 s, far below Whisper's fixed 30 s), keeps the decoder's cross-attention a plain (B, S) key mask
  and lets incremental decoding use the static KV cache unchanged. Padded text targets are -100.
* Teacher forcing on ``[bos, <|transcribe|>, ids..., eos]`` (TextTokenizer.encode(..., task="transcribe")):
  the task token is a given condition, so its prediction is never trained.
* Decoding is omni.decoding's (``greedy_decode``, ``beam_search``, ``GraphedGreedyDecoder``, re-exported here);
  a SpeechRecognizer is an ``omni.interfaces.Seq2SeqDecoder`` (``new_cache``, ``logits``): the decoder trunk's
  static KV cache, cross-attention K/V computed once on the prompt step and reused. Guards: a per-row token limit
  (``max_new_tokens``, and ``tokens_per_second`` (25) x clip seconds + 8), and a repetition guard that stops
  a row whose last ``max_repeats`` blocks of ``p`` tokens (p = 1 .. ``max_period``) are identical and
  keeps only the first copy of that block. ``GraphedGreedyDecoder`` (and ``greedy_decode(graph=True)``)
  captures the one fixed-shape step in a CUDA graph replayed per token (tests/test_whisper_decode_graph.py;
  benchmarks/whisper_throughput.py times it).
* A converted Whisper also decodes with its timestamp tokens (``SpeechRecognizer.timestamp_mode()``: the prompt
  without <|notimestamps|> and Whisper's timestamp rules, ``omni.decoding.TimestampRules``); its tokens become
  segments with absolute times (``timestamp_segments``). The export's own prompt and rules, and so the default
  decoding, are unchanged. Beam search ranks as the model says (``SpeechRecognizer.ranker``): a converted
  Whisper as whisper.decode (``omni.decoding.WhisperRanker``: score / length), omni's models by GNMT's penalty.
* Long audio, files and exports are the application layer's (``omni.pipelines.transcribe``: omni's pause windows,
  or ``whisper.transcribe``'s seek loop for a converted Whisper); this module decodes batches of windows.
* Mask-CTC (``mask_token``, config "mask_token"; trained by ``SpeechLoss(mask_weight=...)``): the SAME decoder
  weights also learn a conditional masked LM: the normalised transcript's tokens (the CTC head's units, re-tokenised)
  with random ones replaced by the mask token, the decoder run over the text without its causal mask
  (``decode_bidirectional``: every text position sees every other, cross-attention to the audio as always), the
  loss on the masked positions only. omni.mask_ctc fills a CTC draft's unsure tokens with it.
* WER / CER (``error_rates``) compare texts normalised by ``normalize_text`` (rule in its docstring),
  as corpus totals: sum of edit distances / sum of reference lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni.decoding import (GNMTRanker, GraphedGreedyDecoder, Ranker, SuppressAtStart, SuppressTokens, TimestampRules,
                           WhisperRanker, beam_search, greedy_decode)
from omni.asr_text import (CTC_BLANK, ctc_greedy_decode, ctc_labels, edit_distance, error_counts,  # noqa: F401
                           error_rates, normalize_text)  # the ASR text helpers (a leaf), still importable from here
from omni.heads import LMHead
from omni.interfaces import Seq2SeqDecoder
from omni.speculative import Drafter, DraftModel, DraftStats, PromptLookup, Reference, speculative_decode
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.text import IGNORE_INDEX, TextTokenizer
from omni.trunk import KVCache, Trunk, TrunkConfig

TASK = "transcribe"
# Mask-CTC's mask token: the first reserved special slot of omni's text tokenizers (id 7 of every BPE that
# TextTokenizer.fit makes, the shipped bpe-8k included): no embedding row added, no vocabulary change, and the
# slots exist for exactly this (a control token added later without refitting). A vocabulary without it (a
# converted Whisper's) is refused by the recipe in one line.
MASK_TOKEN = "<|reserved_0|>"
SILENCE_PEAK = 1e-4  # |sample| peak below this (-80 dBFS) = a silent file: nothing to transcribe
NO_TIMESTAMPS, FIRST_TIMESTAMP = "<|notimestamps|>", "<|0.00|>"  # Whisper's vocabulary (omni.tokenizers.ranks)
TIMESTAMPS_PER_SECOND = 50  # Whisper's timestamp tokens: <|0.00|>, <|0.02|>, ... <|30.00|>
TIMESTAMP_SECONDS = 1 / TIMESTAMPS_PER_SECOND
MAX_INITIAL_TIMESTAMP = 1.0  # whisper.decode's max_initial_timestamp: the first timestamp is at most this (s)


# ----------------------------------------------------------------------------------------------------
# The model


class SpeechRecognizer(nn.Module):
    """Encoder-decoder ASR: audio embedder -> encoder Trunk; text embedder -> decoder Trunk
    (cross-attention over the encoder output) -> LM head tied to the text embedding.

    ``ctc=True`` adds a CTC head on the encoder output, trained jointly with the decoder
    (``SpeechLoss(ctc_weight=...)``), as in hybrid CTC/attention ASR: the CTC loss makes the encoder states line
    up with the transcript from the first steps, which the decoder's cross-attention then only has to read.
    Trained from scratch on small corpora, the attention decoder alone first learns the transcripts' language
    and finds the alignment late (or not at all). The CTC labels are the UTF-8 bytes of the normalised
    transcript (``normalize_text``; ``CTC_BLANK`` = 256 is the blank), so the head is 257 wide whatever the
    BPE vocabulary: at 50 audio tokens/s a BPE-wide head would cost more than the encoder's MLPs."""

    def __init__(self, audio: AudioTokenizer, text: TextTokenizer, encoder: TrunkConfig,
                 decoder: TrunkConfig, ctc: bool = False, audio_positions: str = "none",
                 prompt: Sequence[str] | None = None, decoding: Mapping[str, Any] | None = None,
                 mask_token: str | None = None) -> None:
        super().__init__()
        if encoder.d_model != decoder.d_model:
            raise ValueError(f"encoder width {encoder.d_model} != decoder width {decoder.d_model}: "
                             "cross-attention reads encoder states at the decoder width")
        if encoder.cross_attention:
            raise ValueError("the encoder trunk must not have cross-attention")
        if not decoder.cross_attention:
            raise ValueError("the decoder trunk needs cross_attention=True")
        d = encoder.d_model
        self.audio_embed = audio.embedder(d)
        self.encoder = Trunk(encoder)
        self.text_embed = text.embedder(d)
        self.decoder = Trunk(decoder)
        self.head = LMHead(d, text.vocab_size, tie_to=self.text_embed.token)
        self.ctc_head = nn.Linear(d, CTC_BLANK + 1) if ctc else None  # bytes 0..255 + blank
        self.vocab_size = text.vocab_size
        self.bos_id, self.eos_id, self.pad_id = text.bos_id, text.eos_id, text.pad_id
        self.task_id = text.token_id(TASK)
        # Mask-CTC: the special token that stands for a masked transcript token (None: not trained for it)
        self.mask_token = mask_token
        self.mask_id: int | None = None if mask_token is None else text.token_id(mask_token)
        self.tokens_per_second = audio.tokens_per_second
        if audio_positions not in ("none", "sinusoidal"):
            raise ValueError(f"audio_positions must be 'none' or 'sinusoidal', got {audio_positions!r}")
        self.audio_positions = audio_positions
        # The prompt by special-token names (config "prompt"): Whisper's is [<|startoftranscript|>, <|en|>,
        # <|transcribe|>, <|notimestamps|>]; None is omni's own [bos, <|transcribe|>].
        self.prompt_names = None if prompt is None else [str(name) for name in prompt]
        self._prompt = ([self.bos_id, self.task_id] if prompt is None
                        else [text.token_id(name) for name in self.prompt_names])
        self.decoding = DecodingRules.from_config(decoding)
        # Logit rules every decoding strategy applies (omni.decoding reads ``logit_filters``); ids in non-persistent
        # buffers, so they follow the model's device and stay out of the state dict.
        self.logit_filters = nn.ModuleList(self.decoding.filters())
        # Whisper's timestamp tokens, where the vocabulary has them and the prompt is a config (Whisper's) prompt:
        # ``timestamp_mode()`` decodes with them. None otherwise (omni's own prompt was never trained on them).
        self.timestamp_begin: int | None = None
        self.no_timestamps_id: int | None = None
        if self.prompt_names is not None and {NO_TIMESTAMPS, FIRST_TIMESTAMP} <= set(text.special_tokens):
            self.timestamp_begin = text.token_id(FIRST_TIMESTAMP)
            self.no_timestamps_id = text.token_id(NO_TIMESTAMPS)
        # Beam ranking (omni.decoding): a converted Whisper ranks as whisper.decode does (score / length), omni's
        # own models by GNMT's length penalty
        self.ranker: Ranker = WhisperRanker() if self.timestamp_begin is not None else GNMTRanker(1.0)

    @property
    def prompt(self) -> list[int]:
        """The decoder prompt every transcript starts with: [bos, <|transcribe|>], or the config's."""
        return list(self._prompt)

    def timestamp_mode(self) -> "TimestampMode":
        """This model decoded with Whisper's timestamp tokens (``TimestampMode``); ValueError for a model without
        them."""
        return TimestampMode(self)

    def encode(self, audio: Tensor, audio_mask: Tensor | None = None) -> Tensor:
        """audio (B, S, F) audio tokens, audio_mask (B, S) bool True = real -> memory (B, S, d)."""
        mask = None if audio_mask is None else audio_mask[:, None, None, :]
        x = self.audio_embed(audio, audio_mask)
        if self.audio_positions == "sinusoidal":  # Whisper's absolute positions, on top of the trunk's own
            x = x + sinusoid(x.shape[1], x.shape[2], x.device).to(x.dtype)
        return self.encoder(x, None, mask)

    def decode_hidden(self, text: Tensor, memory: Tensor | None, audio_mask: Tensor | None,
                      cache: KVCache | None = None, cache_position: Tensor | None = None) -> Tensor:
        """text ids (B, T) -> decoder hidden states (B, T, d); with a cache, ``memory`` is needed on the
        first call only (cross-attention K/V are cached). ``cache_position``: the cache slot of text[:, 0]
        as a device tensor (fixed-shape decoding, see Trunk.forward), else after ``cache.length``. Positions
        continue after the real tokens the cache holds per row: the slot, but after a speculative rollback
        (omni.speculative) a row's slots may have gaps."""
        positions = None if cache is None else cache.real_tokens()[:, None] + torch.arange(text.shape[1],
                                                                                           device=text.device)
        return self.decoder(self.text_embed(text), positions, "causal" if cache is None else None,
                            memory=memory, memory_mask=audio_mask, cache=cache, cache_position=cache_position)

    def decode_bidirectional(self, text: Tensor, memory: Tensor, audio_mask: Tensor | None,
                             text_mask: Tensor | None = None) -> Tensor:
        """The conditional masked LM's pass (Mask-CTC): text ids (B, T) -> decoder hidden states (B, T, d) with every
        text position seeing every other (no causal mask; ``text_mask`` (B, T) True = real hides the padding) and
        cross-attention to ``memory``. The same weights as ``decode_hidden``: one decoder, two attention modes."""
        mask = None if text_mask is None else text_mask[:, None, None, :]
        return self.decoder(self.text_embed(text), None, mask, memory=memory, memory_mask=audio_mask)

    def new_cache(self, memory: Tensor, max_length: int) -> KVCache:
        """The decoder's empty cache for this batch: ``max_length`` text tokens, cross K/V in memory's dtype."""
        return self.decoder.new_cache(memory.shape[0], max_length, dtype=memory.dtype)

    def logits(self, text: Tensor, memory: Tensor | None, audio_mask: Tensor | None, cache: KVCache | None = None,
               cache_position: Tensor | None = None) -> Tensor:
        """Next-token logits (B, V) after text (B, T) (``omni.interfaces.Seq2SeqDecoder``)."""
        return self.head(self.decode_hidden(text, memory, audio_mask, cache, cache_position)[:, -1])

    def forward_features(self, audio: Tensor, audio_mask: Tensor | None, text: Tensor) -> Tensor:
        """Teacher forcing: decoder hidden states (B, T, d) of text ids (B, T) over the encoded audio (B, S, F)."""
        return self.decode_hidden(text, self.encode(audio, audio_mask), audio_mask)

    def forward_head(self, features: Tensor) -> Tensor:
        """Decoder hidden states (B, T, d) -> next-token logits (B, T, vocab)."""
        return self.head(features)

    def forward(self, audio: Tensor, audio_mask: Tensor | None, text: Tensor, ctc: bool = False,
                masked: tuple[Tensor, Tensor] | None = None) -> Tensor | tuple[Tensor, ...]:
        """Teacher forcing: logits (B, T, vocab) for every text position; with ``ctc=True`` also the CTC
        head's logits (B, S, 257) over the audio tokens; with ``masked`` = (masked text (B, T'), its real-token mask
        (B, T')) also the masked LM's logits (B, T', vocab) (``decode_bidirectional``), as (logits, CTC logits or
        None, masked logits). One forward, so DDP/compile see one call."""
        if not ctc and masked is None:
            return self.forward_head(self.forward_features(audio, audio_mask, text))
        if ctc and self.ctc_head is None:
            raise ValueError("this SpeechRecognizer has no CTC head: build it with ctc=True")
        memory = self.encode(audio, audio_mask)
        logits = self.forward_head(self.decode_hidden(text, memory, audio_mask))
        ctc_logits = self.ctc_head(memory) if ctc else None
        if masked is None:
            return logits, ctc_logits
        return logits, ctc_logits, self.head(self.decode_bidirectional(masked[0], memory, audio_mask, masked[1]))


class TimestampMode:
    """A SpeechRecognizer with Whisper's timestamp tokens, decoded as ``whisper.decode(without_timestamps=False)``
    does: the prompt without <|notimestamps|>, the model's own logit rules and then ``TimestampRules`` (first
    timestamp at most ``MAX_INITIAL_TIMESTAMP``). An ``omni.interfaces.Seq2SeqDecoder`` over the same weights
    (nothing copied, the model unchanged), so every strategy and ``GraphedGreedyDecoder`` decode it;
    ``timestamp_segments`` turns its tokens into timed segments."""

    def __init__(self, model: SpeechRecognizer) -> None:
        if getattr(model, "timestamp_begin", None) is None:
            raise ValueError("this model has no Whisper timestamp tokens (<|0.00|> .. <|30.00|> and a Whisper "
                             "prompt with <|notimestamps|>): only converted Whispers decode with timestamps")
        self.model = model
        self.eos_id, self.pad_id, self.tokens_per_second = model.eos_id, model.pad_id, model.tokens_per_second
        self.decoding, self.timestamp_begin, self.ranker = model.decoding, model.timestamp_begin, model.ranker
        self._prompt = [i for i in model.prompt if i != model.no_timestamps_id]
        self.rules = TimestampRules(model.timestamp_begin, model.eos_id, model.no_timestamps_id,
                                    round(MAX_INITIAL_TIMESTAMP * TIMESTAMPS_PER_SECOND))

    @property
    def prompt(self) -> list[int]:
        return list(self._prompt)

    @property
    def logit_filters(self) -> list[Any]:
        """The model's rules, then the timestamp rules: their probability rule reads the suppressed logits."""
        return [*self.model.logit_filters, self.rules]

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.model.parameters(recurse)

    def encode(self, audio: Tensor, audio_mask: Tensor | None = None) -> Tensor:
        return self.model.encode(audio, audio_mask)

    def new_cache(self, memory: Tensor, max_length: int) -> KVCache:
        return self.model.new_cache(memory, max_length)

    def logits(self, text: Tensor, memory: Tensor | None, audio_mask: Tensor | None, cache: KVCache | None = None,
               cache_position: Tensor | None = None) -> Tensor:
        return self.model.logits(text, memory, audio_mask, cache, cache_position)

    def decode_hidden(self, text: Tensor, memory: Tensor | None, audio_mask: Tensor | None,
                      cache: KVCache | None = None, cache_position: Tensor | None = None) -> Tensor:
        return self.model.decode_hidden(text, memory, audio_mask, cache, cache_position)

    def head(self, hidden: Tensor) -> Tensor:
        return self.model.head(hidden)


def timestamp_segments(ids: Sequence[int], timestamp_begin: int, *, offset: float = 0.0,
                       duration: float = 30.0) -> list[tuple[float, float, list[int]]]:
    """Tokens decoded in timestamp mode (``TimestampMode``; prompt and eos excluded) -> segments (start, end, text
    ids), times absolute: ``offset`` (the window's start in its file, s) + the token's time. A timestamp after
    text closes a segment, one after a timestamp (or at the start) opens the next; text before any timestamp
    starts where the last segment ended (0 at first); text after the last timestamp (the token limit, or a
    segment Whisper would have re-decoded from its start: omni's windows are fixed) ends at the window's end.
    Times are clamped to the window (``duration`` s: a 30.00 token in a shorter window); empty segments are
    dropped."""
    segments: list[tuple[float, float, list[int]]] = []
    start: float | None = None
    end = 0.0  # where the last segment ended
    body: list[int] = []
    for i in ids:
        if i < timestamp_begin:
            body.append(int(i))
            continue
        at = min((i - timestamp_begin) / TIMESTAMPS_PER_SECOND, duration)  # 60 / 50, not 60 * 0.02: 1.2 exactly
        if body:
            begin = end if start is None else start
            segments.append((offset + begin, offset + max(at, begin), body))
            body, start, end = [], None, max(at, begin)
        else:
            start = at
    if body:
        begin = end if start is None else start
        segments.append((offset + begin, offset + max(duration, begin), body))
    return segments


def sinusoid(length: int, d: int, device: torch.device | str | None = None) -> Tensor:
    """(length, d) Whisper-style sinusoidal positions: sin over the first d/2 channels, cos over the rest,
    timescales log-spaced from 1 to 10,000."""
    half = d // 2
    inv = torch.exp(-math.log(10_000) * torch.arange(half, device=device, dtype=torch.float32) / max(half - 1, 1))
    angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


@dataclass(frozen=True)
class DecodingRules:
    """A model's own decoding defaults (export config "decoding"; absent keys: omni's defaults): the guards of
    ``greedy_decode`` / ``beam_search`` (``GUARDS``; callers' arguments win) and Whisper's logit rules,
    ``suppress_tokens`` (never chosen) and ``suppress_at_start`` (not chosen first: Whisper's suppress-blank,
    " " and eot)."""

    guards: tuple[tuple[str, Any], ...] = ()
    suppress_tokens: tuple[int, ...] = ()
    suppress_at_start: tuple[int, ...] = ()

    GUARDS = ("max_new_tokens", "tokens_per_second", "max_period", "max_repeats", "min_new_tokens")

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> "DecodingRules":
        config = dict(config or {})
        unknown = sorted(set(config) - {*cls.GUARDS, "suppress_tokens", "suppress_at_start"})
        if unknown:
            raise ValueError(f"decoding rules {', '.join(unknown)} are unknown; known: "
                             f"{', '.join(cls.GUARDS)}, suppress_tokens, suppress_at_start")
        guards = tuple((k, config[k]) for k in cls.GUARDS if k in config)
        return cls(guards, tuple(int(i) for i in config.get("suppress_tokens", ())),
                   tuple(int(i) for i in config.get("suppress_at_start", ())))

    def filters(self) -> list[nn.Module]:
        return ([SuppressTokens(self.suppress_tokens)] if self.suppress_tokens else []) + \
               ([SuppressAtStart(self.suppress_at_start)] if self.suppress_at_start else [])

    def config(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.guards)
        if self.suppress_tokens:
            out["suppress_tokens"] = list(self.suppress_tokens)
        if self.suppress_at_start:
            out["suppress_at_start"] = list(self.suppress_at_start)
        return out


def build_speech_recognizer(config: dict[str, Any], tokenizers: dict[str, Any]) -> SpeechRecognizer:
    """Export builder (config.json "builder": "omni.speech:build_speech_recognizer"); "prompt" and "decoding"
    are optional (omni's own prompt and rules without them)."""
    return SpeechRecognizer(tokenizers["audio"], tokenizers["text"], TrunkConfig(**config["encoder"]),
                            TrunkConfig(**config["decoder"]), ctc=bool(config.get("ctc", False)),
                            audio_positions=config.get("audio_positions", "none"), prompt=config.get("prompt"),
                            decoding=config.get("decoding"), mask_token=config.get("mask_token"))


# ----------------------------------------------------------------------------------------------------
# Batches


@dataclass
class SpeechBatch:
    """A padded batch: audio (B, S, F) float, audio_mask (B, S) bool, text (B, T) int64 decoder input,
    targets (B, T) int64 next-token ids with -100 where nothing is predicted, keys (B sample names), and
    the CTC labels: ctc_labels (B, L) int64 bytes of each normalised transcript (0-padded), ctc_lengths (B,); and
    for the masked LM (Mask-CTC) mlm_text (B, T') the prompt + the normalised transcript's ids + eos (pad after),
    mlm_body (B, T') True at the transcript's tokens (what may be masked), mlm_real (B, T') True at real tokens."""

    audio: Tensor
    audio_mask: Tensor
    text: Tensor
    targets: Tensor
    keys: list[str]
    ctc_labels: Tensor | None = None
    ctc_lengths: Tensor | None = None
    mlm_text: Tensor | None = None
    mlm_body: Tensor | None = None
    mlm_real: Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "SpeechBatch":
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return SpeechBatch(move(self.audio), move(self.audio_mask), move(self.text), move(self.targets), self.keys,
                           move(self.ctc_labels), move(self.ctc_lengths), move(self.mlm_text), move(self.mlm_body),
                           move(self.mlm_real))

    @property
    def num_documents(self) -> int:  # Trainer sample count
        return int(self.audio.shape[0])

    @property
    def document(self) -> Tensor:
        """0 for every real (audio or target) token, -1 for padding: the Trainer's tokens/s counter."""
        real = torch.cat([self.audio_mask.flatten(), (self.targets != IGNORE_INDEX).flatten()])
        return real.long() - 1


def pad_audio(items: Sequence[Tensor], pad_multiple: int = 8) -> tuple[Tensor, Tensor]:
    """(n_i, F) token tensors -> (B, S, F) zero-padded, mask (B, S) True = real; S rounded up to a
    multiple of ``pad_multiple`` (fewer distinct shapes for compiled kernels)."""
    if not items:
        raise ValueError("pad_audio got no clips")
    S = max(t.shape[0] for t in items)
    S = -(-S // pad_multiple) * pad_multiple
    out = items[0].new_zeros(len(items), S, items[0].shape[1])
    mask = torch.zeros(len(items), S, dtype=torch.bool)
    for i, t in enumerate(items):
        out[i, :t.shape[0]] = t
        mask[i, :t.shape[0]] = True
    return out, mask


class SpeechCollate:
    """List of ``{"audio": (n, F), "text": (m,), "targets": (m,), "key"[, "ctc": (k,)][, "mlm": (j,), "mlm_start"]}``
    -> SpeechBatch (picklable); CTC labels are batched when every item has them, the masked LM's text likewise
    ("mlm": prompt + ids + eos, "mlm_start": the prompt's length)."""

    def __init__(self, pad_id: int, pad_multiple: int = 8) -> None:
        self.pad_id, self.pad_multiple = pad_id, pad_multiple

    def __call__(self, items: list[dict[str, Any]]) -> SpeechBatch:
        audio, mask = pad_audio([it["audio"] for it in items], self.pad_multiple)
        T = max(it["text"].shape[0] for it in items)
        text = torch.full((len(items), T), self.pad_id, dtype=torch.int64)
        targets = torch.full((len(items), T), IGNORE_INDEX, dtype=torch.int64)
        for i, it in enumerate(items):
            text[i, :it["text"].shape[0]] = it["text"]
            targets[i, :it["targets"].shape[0]] = it["targets"]
        labels = lengths = None
        if all("ctc" in it for it in items):
            lengths = torch.tensor([it["ctc"].shape[0] for it in items], dtype=torch.int64)
            labels = torch.zeros(len(items), max(int(lengths.max()), 1), dtype=torch.int64)
            for i, it in enumerate(items):
                labels[i, :it["ctc"].shape[0]] = it["ctc"]
        mlm = body = real = None
        if all("mlm" in it for it in items):
            width = max(it["mlm"].shape[0] for it in items)
            mlm = torch.full((len(items), width), self.pad_id, dtype=torch.int64)
            body = torch.zeros(len(items), width, dtype=torch.bool)
            real = torch.zeros(len(items), width, dtype=torch.bool)
            for i, it in enumerate(items):
                n = it["mlm"].shape[0]
                mlm[i, :n], real[i, :n] = it["mlm"], True
                body[i, int(it["mlm_start"]):n - 1] = True  # the transcript's tokens: not the prompt, not eos
        return SpeechBatch(audio, mask, text, targets, [str(it["key"]) for it in items], labels, lengths, mlm, body,
                           real)


def speech_example(audio_tok: AudioTokenizer, text_tok: TextTokenizer, audio: Any, transcript: str,
                   key: str = "", mlm: bool = False) -> dict[str, Any]:
    """One (audio, transcript) pair -> the dict SpeechCollate batches (CTC labels included; with ``mlm`` the masked
    LM's text too, ``masked_lm_text`` after omni's prompt [bos, <|transcribe|>])."""
    seg = audio_tok.encode(audio, key=key)
    txt = text_tok.encode(transcript, key=key, task=TASK)
    out = {"audio": seg.tokens, "text": txt.tokens, "targets": txt.targets, "key": key, "ctc": ctc_labels(transcript)}
    if mlm:
        prompt = [text_tok.bos_id, text_tok.token_id(TASK)]
        out.update(mlm=masked_lm_text(text_tok, prompt, transcript, key), mlm_start=len(prompt))
    return out


def masked_lm_text(text_tok: TextTokenizer, prompt: Sequence[int], transcript: str, key: str = "") -> Tensor:
    """The masked LM's decoder text of a transcript: prompt + the ids of ``normalize_text(transcript)`` + eos. The
    normalised text, not the transcript as written: at inference the masked LM edits the CTC head's text, which is
    normalised (lower case, no punctuation), re-tokenised the same way (``omni.mask_ctc.ctc_tokens``)."""
    ids = text_tok.encode(normalize_text(transcript), key=key).tokens
    ids = ids[int(text_tok.add_bos):]
    if not text_tok.add_eos:
        ids = torch.cat([ids, torch.tensor([text_tok.eos_id])])
    return torch.cat([torch.tensor(list(prompt), dtype=torch.int64), ids])


def mask_tokens(text: Tensor, body: Tensor, mask_id: int, generator: torch.Generator | None = None
                ) -> tuple[Tensor, Tensor]:
    """Mask-CTC's training corruption: in each row, n ~ Uniform{1 .. L} of its L body tokens (``body`` (B, T) True)
    chosen uniformly at random and replaced by ``mask_id`` -> (masked text (B, T), chosen (B, T) bool). As Higuchi
    et al. 2020: every masking ratio is trained, from one token to the whole transcript (the first iteration at
    inference may fill almost all of it)."""
    length = body.sum(1)  # (B,)
    n = (torch.rand(text.shape[0], generator=generator, device=text.device) * length).floor().long() + 1  # 1 .. L
    scores = torch.where(body, torch.rand(text.shape, generator=generator, device=text.device), 2.0)  # body first
    rank = scores.argsort(1).argsort(1)
    chosen = body & (rank < n[:, None])
    return torch.where(chosen, mask_id, text), chosen


@dataclass(frozen=True)
class SpeechLoss:
    """Next-token cross-entropy over real target positions (+ ``ctc_weight`` x CTC loss of the encoder's CTC
    head, hybrid CTC/attention training; + the masked LM with ``mask_weight``) -> (loss, {"token_accuracy", and
    "ctc_loss" / "mask_loss" / "mask_accuracy" when used}).

    The CTC term reads the batch's byte labels (``SpeechCollate`` of ``speech_example`` items): the per-row
    loss divided by the label length, averaged over rows (``F.ctc_loss`` reduction "mean"); rows whose
    transcript cannot be aligned to their audio (more labels than audio tokens) would be infinite and are
    zeroed (``zero_infinity``), so they only train the decoder.

    Mask-CTC (``mask_weight`` > 0, ``mask_id`` the model's mask token): the decoder's loss is (1 - mask_weight) x
    next-token + mask_weight x the masked LM's cross-entropy, the mean over the masked positions of the batch
    (``mask_tokens`` on the batch's ``mlm_text``, the decoder run bidirectionally); the CTC term weighs the decoder's
    total as before: (1 - ctc_weight) x decoder + ctc_weight x CTC. mask_weight 0 is the loss without it."""

    ctc_weight: float = 0.0
    mask_weight: float = 0.0
    mask_id: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.mask_weight < 1:
            raise ValueError(f"mask_weight must be in [0, 1), got {self.mask_weight}")
        if self.mask_weight > 0 and self.mask_id is None:
            raise ValueError("SpeechLoss(mask_weight > 0) needs mask_id: the model's mask token (mask_token=...)")

    def __call__(self, model: nn.Module, batch: SpeechBatch) -> tuple[Tensor, dict[str, Tensor]]:
        keep = batch.targets != IGNORE_INDEX
        ctc_logits = masked = None
        if self.mask_weight > 0:
            if batch.mlm_text is None or batch.mlm_body is None or batch.mlm_real is None:
                raise ValueError("SpeechLoss(mask_weight > 0) needs the masked LM's text in the batch: build the "
                                 "items with speech_example(..., mlm=True) and batch with SpeechCollate")
            masked_text, chosen = mask_tokens(batch.mlm_text, batch.mlm_body, int(self.mask_id))
            logits, ctc_logits, mlm_logits = model(batch.audio, batch.audio_mask, batch.text, ctc=self.ctc_weight > 0,
                                                   masked=(masked_text, batch.mlm_real))
            masked = (mlm_logits[chosen].float(), batch.mlm_text[chosen])
        elif self.ctc_weight == 0:
            logits = model(batch.audio, batch.audio_mask, batch.text)
        else:
            logits, ctc_logits = model(batch.audio, batch.audio_mask, batch.text, ctc=True)
        loss = F.cross_entropy(logits[keep].float(), batch.targets[keep])
        metrics = {"token_accuracy": (logits[keep].argmax(-1) == batch.targets[keep]).float().mean()}
        if masked is not None:
            mlm = F.cross_entropy(masked[0], masked[1]) if masked[1].numel() else masked[0].sum() * 0.0
            metrics["mask_loss"] = mlm.detach()
            metrics["mask_accuracy"] = (masked[0].argmax(-1) == masked[1]).float().mean() if masked[1].numel() \
                else mlm.detach()
            loss = (1 - self.mask_weight) * loss + self.mask_weight * mlm
        if self.ctc_weight == 0:
            return loss, metrics
        if batch.ctc_labels is None or batch.ctc_lengths is None:
            raise ValueError("SpeechLoss(ctc_weight > 0) needs CTC labels in the batch: build the items with "
                             "speech_example (or add 'ctc': ctc_labels(transcript)) and batch with SpeechCollate")
        log_probs = ctc_logits.float().log_softmax(-1).transpose(0, 1)  # (S, B, 257)
        ctc = F.ctc_loss(log_probs, batch.ctc_labels, batch.audio_mask.sum(1), batch.ctc_lengths,
                         blank=CTC_BLANK, reduction="mean", zero_infinity=True)
        metrics["ctc_loss"] = ctc.detach()
        return (1 - self.ctc_weight) * loss + self.ctc_weight * ctc, metrics


speech_loss = SpeechLoss()  # decoder cross-entropy only (the loss of every model without a CTC head)


# ----------------------------------------------------------------------------------------------------
# Decoding (omni.decoding: greedy_decode, beam_search and GraphedGreedyDecoder)


# (memory, audio_mask[, audio]) of a batch -> its drafter (audio: the batch's audio tokens, for a draft model)
DraftSource = Callable[..., Drafter]


def ngram_draft(memory: Tensor, audio_mask: Tensor | None = None, audio: Tensor | None = None) -> Drafter:
    """A ``DraftSource``: prompt lookup over each row's own text so far (``omni.speculative.PromptLookup``)."""
    return PromptLookup()


def ctc_draft(model: Any, text_tok: TextTokenizer, max_ngram: int = 3) -> DraftSource:
    """A ``DraftSource``: the CTC head's greedy transcript of every row (``ctc_greedy_decode``), re-tokenized into
    decoder ids (without bos / eos) and aligned to the text decoded so far (``omni.speculative.Reference``)."""
    head = getattr(getattr(model, "model", model), "ctc_head", None)  # a TimestampMode's model holds the head
    if head is None:
        raise ValueError("draft 'ctc' (omni transcribe --draft ctc) needs a speech model with a CTC head (trained "
                         "with ctc_weight > 0); draft 'ngram' works with any model")

    def source(memory: Tensor, audio_mask: Tensor | None = None, audio: Tensor | None = None) -> Drafter:
        drafts = []
        for text in ctc_greedy_decode(head(memory), audio_mask):
            ids = text_tok.encode(text).tokens.tolist()
            drafts.append(ids[int(text_tok.add_bos):len(ids) - int(text_tok.add_eos)])
        return Reference(drafts, max_ngram)

    return source


def model_draft(draft: Any) -> DraftSource:
    """A ``DraftSource``: a smaller speech model sharing the vocabulary and the audio features (``check_draft_model``)
    drafts greedily from its own encoding of the batch's audio (``omni.speculative.DraftModel``: its own memory and
    KV cache, kept across passes)."""

    def source(memory: Tensor, audio_mask: Tensor | None = None, audio: Tensor | None = None) -> Drafter:
        if audio is None:
            raise ValueError("a draft model encodes the batch's audio itself: pass audio= to the draft source")
        return DraftModel(draft, draft.encode(audio, audio_mask), audio_mask)

    return source


@torch.no_grad()
def decode_batch(model: Seq2SeqDecoder, audio: Tensor, audio_mask: Tensor, *, beam_size: int = 1,
                 length_penalty: float | Ranker | None = None, draft: DraftSource | None = None,
                 draft_tokens: int = 4, draft_stats: DraftStats | None = None,
                 parallel: Callable[[Tensor, Tensor | None], list[list[int]]] | None = None,
                 **guards: Any) -> list[list[int]]:
    """Padded audio tokens (B, S, F) + mask -> the generated ids of each row (greedy for beam_size 1, else beam
    search, ranked by ``length_penalty``: None = the model's ranker, ``SpeechRecognizer.ranker``). The model's own
    decoding guards (``SpeechRecognizer.decoding``: a converted Whisper's) are the defaults of ``guards``.
    ``model`` may be a ``TimestampMode`` (ids then hold timestamp tokens). ``draft`` (``ctc_draft``, ``ngram_draft``):
    greedy's ids by speculative decoding (omni.speculative), ``draft_tokens`` a pass, counted in ``draft_stats``.
    ``parallel`` (omni.mask_ctc's ``ctc_decode``, ``mask_ctc_decode``): the ids it gives for the encoded batch, not
    autoregressive (the guards do not apply)."""
    rules = getattr(model, "decoding", None)
    guards = {**dict(rules.guards), **guards} if isinstance(rules, DecodingRules) else guards
    memory = model.encode(audio, audio_mask)
    if parallel is not None:
        if draft is not None or beam_size != 1:
            raise ValueError("a parallel (CTC / Mask-CTC) decoding takes neither a draft nor a beam")
        return parallel(memory, audio_mask)
    if draft is not None:
        if beam_size != 1:
            raise ValueError(f"draft decoding is greedy: beam_size must be 1, got {beam_size}")
        return speculative_decode(model, memory, audio_mask, drafter=draft(memory, audio_mask, audio),
                                  draft_tokens=draft_tokens, stats=draft_stats, **guards)
    if beam_size == 1:
        return greedy_decode(model, memory, audio_mask, **guards)
    return beam_search(model, memory, audio_mask, beam_size=beam_size, length_penalty=length_penalty, **guards)


@torch.no_grad()
def transcribe_batch(model: Seq2SeqDecoder, text_tok: TextTokenizer, audio: Tensor,
                     audio_mask: Tensor, *, beam_size: int = 1, length_penalty: float | Ranker | None = None,
                     **guards: Any) -> list[str]:
    """Padded audio tokens (B, S, F) + mask -> transcripts (``decode_batch``, decoded to text)."""
    ids = decode_batch(model, audio, audio_mask, beam_size=beam_size, length_penalty=length_penalty, **guards)
    return [text_tok.decode(row) for row in ids]


__all__ = [
    "CTC_BLANK", "GraphedGreedyDecoder", "SpeechBatch", "SpeechCollate", "SpeechLoss", "SpeechRecognizer",
    "beam_search", "build_speech_recognizer", "ctc_greedy_decode", "ctc_labels", "edit_distance", "error_counts",
    "error_rates", "greedy_decode", "normalize_text", "pad_audio", "speech_example", "speech_loss",
    "transcribe_batch", "MAX_INITIAL_TIMESTAMP", "TIMESTAMP_SECONDS", "TimestampMode", "decode_batch",
    "timestamp_segments", "DraftSource", "ctc_draft", "model_draft", "ngram_draft", "MASK_TOKEN", "mask_tokens",
    "masked_lm_text",
]
