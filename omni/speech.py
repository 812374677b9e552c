"""Whisper-style speech recognition on the shared trunk: model, batching, decoding, metrics, inference.

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
* Decoding (``greedy_decode``, ``beam_search``) uses the trunk's static KV cache; cross-attention K/V
  are computed once, on the prompt step, and reused. Guards: a per-row token limit
  (``max_new_tokens``, and ``tokens_per_second`` (25) x clip seconds + 8), and a repetition guard that stops
  a row whose last ``max_repeats`` blocks of ``p`` tokens (p = 1 .. ``max_period``) are identical and
  keeps only the first copy of that block.
* ``GraphedGreedyDecoder`` (and ``greedy_decode(graph=True)``) runs the same greedy rules as ONE fixed-shape
  decoder step with all state on the device (position, stop flags, repetition guard), captured once in a
  CUDA graph and replayed per token, optionally torch.compile'd first; on CPU the step runs eagerly. Same
  tokens as ``greedy_decode`` (tests/test_whisper_decode_graph.py); benchmarks/whisper_throughput.py times it.
* Long audio (longer than the tokenizer's ``max_seconds``, 30 s) is cut by ``split_windows`` at the
  quietest 20 ms frame of the last ``search_seconds`` of each window, so cuts fall in pauses, not in
  words; the windows are decoded as independent batch rows and their texts joined with one space.
* WER / CER (``error_rates``) compare texts normalised by ``normalize_text`` (rule in its docstring),
  as corpus totals: sum of edit distances / sum of reference lengths.
"""

from __future__ import annotations

import math
import os
import re
import unicodedata
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import torch
import torch.nn.functional as F
from rapidfuzz.distance import Levenshtein
from torch import Tensor, nn

from omni.heads import LMHead
from omni.tokenizers.audio import AudioTokenizer, load_audio
from omni.tokenizers.base import check_regular_file
from omni.tokenizers.text import IGNORE_INDEX, TextTokenizer
from omni.trunk import KVCache, Trunk, TrunkConfig

TASK = "transcribe"
CTC_BLANK = 256  # CTC labels are bytes 0..255 of the normalised transcript; 256 is the blank
SILENCE_PEAK = 1e-4  # |sample| peak below this (-80 dBFS) = a silent file: nothing to transcribe


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
                 decoder: TrunkConfig, ctc: bool = False, audio_positions: str = "none") -> None:
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
        self.tokens_per_second = audio.tokens_per_second
        if audio_positions not in ("none", "sinusoidal"):
            raise ValueError(f"audio_positions must be 'none' or 'sinusoidal', got {audio_positions!r}")
        self.audio_positions = audio_positions

    @property
    def prompt(self) -> list[int]:
        """The decoder prompt every transcript starts with: [bos, <|transcribe|>]."""
        return [self.bos_id, self.task_id]

    def encode(self, audio: Tensor, audio_mask: Tensor | None = None) -> Tensor:
        """audio (B, S, F) log-mel windows, audio_mask (B, S) bool True = real -> memory (B, S, d)."""
        mask = None if audio_mask is None else audio_mask[:, None, None, :]
        x = self.audio_embed(audio)
        if self.audio_positions == "sinusoidal":  # Whisper's absolute positions, on top of the trunk's own
            x = x + sinusoid(x.shape[1], x.shape[2], x.device).to(x.dtype)
        return self.encoder(x, None, mask)

    def decode_hidden(self, text: Tensor, memory: Tensor | None, audio_mask: Tensor | None,
                      cache: KVCache | None = None, cache_position: Tensor | None = None) -> Tensor:
        """text ids (B, T) -> decoder hidden states (B, T, d); with a cache, ``memory`` is needed on the
        first call only (cross-attention K/V are cached). ``cache_position``: the cache slot of text[:, 0]
        as a device tensor (fixed-shape decoding, see Trunk.forward), else after ``cache.length``."""
        return self.decoder(self.text_embed(text), None, "causal" if cache is None else None,
                            memory=memory, memory_mask=audio_mask, cache=cache, cache_position=cache_position)

    def forward_features(self, audio: Tensor, audio_mask: Tensor | None, text: Tensor) -> Tensor:
        """Teacher forcing: decoder hidden states (B, T, d) of text ids (B, T) over the encoded audio (B, S, F)."""
        return self.decode_hidden(text, self.encode(audio, audio_mask), audio_mask)

    def forward_head(self, features: Tensor) -> Tensor:
        """Decoder hidden states (B, T, d) -> next-token logits (B, T, vocab)."""
        return self.head(features)

    def forward(self, audio: Tensor, audio_mask: Tensor | None, text: Tensor,
                ctc: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Teacher forcing: logits (B, T, vocab) for every text position; with ``ctc=True`` also the CTC
        head's logits (B, S, 257) over the audio tokens (one forward, so DDP/compile see one call)."""
        if not ctc:
            return self.forward_head(self.forward_features(audio, audio_mask, text))
        if self.ctc_head is None:
            raise ValueError("this SpeechRecognizer has no CTC head: build it with ctc=True")
        memory = self.encode(audio, audio_mask)
        return self.forward_head(self.decode_hidden(text, memory, audio_mask)), self.ctc_head(memory)


def sinusoid(length: int, d: int, device: torch.device | str | None = None) -> Tensor:
    """(length, d) Whisper-style sinusoidal positions: sin over the first d/2 channels, cos over the rest,
    timescales log-spaced from 1 to 10,000."""
    half = d // 2
    inv = torch.exp(-math.log(10_000) * torch.arange(half, device=device, dtype=torch.float32) / max(half - 1, 1))
    angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def build_speech_recognizer(config: dict[str, Any], tokenizers: dict[str, Any]) -> SpeechRecognizer:
    """Export builder (config.json "builder": "omni.speech:build_speech_recognizer")."""
    return SpeechRecognizer(tokenizers["audio"], tokenizers["text"], TrunkConfig(**config["encoder"]),
                            TrunkConfig(**config["decoder"]), ctc=bool(config.get("ctc", False)),
                            audio_positions=config.get("audio_positions", "none"))


# ----------------------------------------------------------------------------------------------------
# Batches


@dataclass
class SpeechBatch:
    """A padded batch: audio (B, S, F) float, audio_mask (B, S) bool, text (B, T) int64 decoder input,
    targets (B, T) int64 next-token ids with -100 where nothing is predicted, keys (B sample names), and
    the CTC labels: ctc_labels (B, L) int64 bytes of each normalised transcript (0-padded), ctc_lengths (B,)."""

    audio: Tensor
    audio_mask: Tensor
    text: Tensor
    targets: Tensor
    keys: list[str]
    ctc_labels: Tensor | None = None
    ctc_lengths: Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "SpeechBatch":
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return SpeechBatch(move(self.audio), move(self.audio_mask), move(self.text), move(self.targets), self.keys,
                           move(self.ctc_labels), move(self.ctc_lengths))

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
    """List of ``{"audio": (n, F), "text": (m,), "targets": (m,), "key"[, "ctc": (k,)]}`` -> SpeechBatch
    (picklable); CTC labels are batched when every item has them."""

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
        return SpeechBatch(audio, mask, text, targets, [str(it["key"]) for it in items], labels, lengths)


def speech_example(audio_tok: AudioTokenizer, text_tok: TextTokenizer, audio: Any, transcript: str,
                   key: str = "") -> dict[str, Any]:
    """One (audio, transcript) pair -> the dict SpeechCollate batches (CTC labels included)."""
    seg = audio_tok.encode(audio, key=key)
    txt = text_tok.encode(transcript, key=key, task=TASK)
    return {"audio": seg.tokens, "text": txt.tokens, "targets": txt.targets, "key": key,
            "ctc": ctc_labels(transcript)}


def ctc_labels(transcript: str) -> Tensor:
    """The CTC targets of a transcript: the UTF-8 bytes of ``normalize_text(transcript)`` (int64)."""
    return torch.tensor(list(normalize_text(transcript).encode("utf-8")), dtype=torch.int64)


def ctc_greedy_decode(ctc_logits: Tensor, audio_mask: Tensor | None = None) -> list[str]:
    """Best-path CTC decoding of (B, S, 257) logits: argmax per audio token, repeats merged, blanks dropped,
    bytes decoded as UTF-8 (invalid sequences replaced). A quick read of what the encoder alone hears."""
    best = ctc_logits.argmax(-1).tolist()
    lengths = [len(row) for row in best] if audio_mask is None else audio_mask.sum(1).tolist()
    out = []
    for row, n in zip(best, lengths):
        kept = [c for i, c in enumerate(row[:n]) if c != CTC_BLANK and (i == 0 or c != row[i - 1])]
        out.append(bytes(kept).decode("utf-8", errors="replace"))
    return out


@dataclass(frozen=True)
class SpeechLoss:
    """Next-token cross-entropy over real target positions (+ ``ctc_weight`` x CTC loss of the encoder's CTC
    head, hybrid CTC/attention training) -> (loss, {"token_accuracy", and "ctc_loss" when used}).

    The CTC term reads the batch's byte labels (``SpeechCollate`` of ``speech_example`` items): the per-row
    loss divided by the label length, averaged over rows (``F.ctc_loss`` reduction "mean"); rows whose
    transcript cannot be aligned to their audio (more labels than audio tokens) would be infinite and are
    zeroed (``zero_infinity``), so they only train the decoder."""

    ctc_weight: float = 0.0

    def __call__(self, model: nn.Module, batch: SpeechBatch) -> tuple[Tensor, dict[str, Tensor]]:
        keep = batch.targets != IGNORE_INDEX
        if self.ctc_weight == 0:
            logits = model(batch.audio, batch.audio_mask, batch.text)
        else:
            logits, ctc_logits = model(batch.audio, batch.audio_mask, batch.text, ctc=True)
        loss = F.cross_entropy(logits[keep].float(), batch.targets[keep])
        metrics = {"token_accuracy": (logits[keep].argmax(-1) == batch.targets[keep]).float().mean()}
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
# Decoding


def _limits(model: SpeechRecognizer, audio_mask: Tensor | None, batch: int, max_new_tokens: int,
            tokens_per_second: float | None, device: torch.device) -> Tensor:
    """Per-row cap on generated tokens (eos included): max_new_tokens, and for audio of s seconds at most
    ceil(tokens_per_second * s) + 8 (a hallucination guard that scales with the clip)."""
    limit = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
    if tokens_per_second is not None and audio_mask is not None:
        seconds = audio_mask.sum(1).float() / model.tokens_per_second
        limit = torch.minimum(limit, (seconds * tokens_per_second).ceil().long() + 8)
    return limit.clamp(min=1)


def _repeated_tail(out: Tensor, t: int, max_period: int, max_repeats: int) -> Tensor:
    """(B,) length to keep for rows whose tokens out[:, :t+1] end in ``max_repeats`` copies of one block
    of p <= max_period tokens (first copy kept), else -1."""
    keep = torch.full((out.shape[0],), -1, dtype=torch.long, device=out.device)
    for p in range(max_period, 0, -1):  # shorter periods win (assigned last): "a a a a" keeps one "a"
        w = p * max_repeats
        if t + 1 < w:
            continue
        tail = out[:, t + 1 - w:t + 1]
        hit = (tail[:, p:] == tail[:, :-p]).all(1)
        keep = torch.where(hit, torch.full_like(keep, t + 1 - (max_repeats - 1) * p), keep)
    return keep


@torch.no_grad()
def greedy_decode(model: SpeechRecognizer, memory: Tensor, audio_mask: Tensor | None = None, *,
                  max_new_tokens: int = 224, tokens_per_second: float | None = 25.0,
                  max_period: int = 8, max_repeats: int | None = 4, min_new_tokens: int = 0,
                  use_cache: bool = True, check_every: int = 1, graph: bool = False) -> list[list[int]]:
    """Batched greedy decoding. memory (B, S, d) from ``model.encode``; returns the generated ids of each
    row (prompt and eos excluded). ``use_cache=False`` recomputes the whole prefix every step (the
    reference the cached path must match token for token). ``check_every`` steps between host syncs
    that stop once every row is done (larger = fewer syncs on GPU, identical output). ``min_new_tokens``:
    no row stops or is cut below that many tokens (eos suppressed before, the repetition guard neither
    fires before nor trims below it), as Hugging Face's option of that name (benchmarks use it for a fixed
    token count); the token limits still apply.

    ``graph=True`` decodes with a one-off ``GraphedGreedyDecoder`` (fixed-shape step: one CUDA graph
    replayed per token on CUDA, run eagerly elsewhere), same tokens; ``check_every`` is then at least 16.
    To decode many batches of one shape, build a ``GraphedGreedyDecoder`` once and call it per batch."""
    if graph:
        if not use_cache:
            raise ValueError("graph=True decodes with the static KV cache; it cannot be combined with use_cache=False")
        # The cache holds exactly as many slots as this call needs, as below (same attention shapes).
        steps = int(_limits(model, audio_mask, memory.shape[0], max_new_tokens, tokens_per_second,
                            memory.device).max())
        decoder = GraphedGreedyDecoder(model, max_new_tokens=steps, tokens_per_second=tokens_per_second,
                                       max_period=max_period, max_repeats=max_repeats,
                                       min_new_tokens=min_new_tokens, check_every=max(check_every, 16))
        return decoder(memory, audio_mask)
    B, dev = memory.shape[0], memory.device
    prompt = torch.tensor(model.prompt, device=dev).expand(B, -1)
    limit = _limits(model, audio_mask, B, max_new_tokens, tokens_per_second, dev)
    steps = int(limit.max())
    cache = model.decoder.new_cache(B, prompt.shape[1] + steps, dtype=memory.dtype) if use_cache else None
    out = torch.full((B, steps), model.pad_id, dtype=torch.long, device=dev)
    length = limit.clone()  # tokens kept per row
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    h = model.decode_hidden(prompt, memory, audio_mask, cache)
    for t in range(steps):
        logits = model.head(h[:, -1])
        if t < min_new_tokens:
            logits[:, model.eos_id] = float("-inf")
        nxt = logits.argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, model.pad_id), nxt)
        out[:, t] = nxt
        ended = ~done & (nxt == model.eos_id)
        length = torch.where(ended, torch.full_like(length, t), length)
        if max_repeats is not None and t >= min_new_tokens:
            keep = _repeated_tail(out, t, max_period, max_repeats)
            rep = ~done & ~ended & (keep >= 0)
            length = torch.where(rep, keep.clamp(min=min_new_tokens), length)
            ended = ended | rep
        done = done | ended | (t + 1 >= limit)
        if t + 1 == steps or ((t + 1) % check_every == 0 and bool(done.all())):
            break
        if cache is not None:
            h = model.decode_hidden(nxt[:, None], None, audio_mask, cache)
        else:
            h = model.decode_hidden(torch.cat([prompt, out[:, :t + 1]], 1), memory, audio_mask)
    lengths = length.tolist()
    return [row[:n] for row, n in zip(out.tolist(), lengths)]


# ----------------------------------------------------------------------------------------------------
# Fixed-shape greedy decoding: one decoder step captured in a CUDA graph, replayed per token


class GraphedGreedyDecoder:
    """Batched greedy decoding with the same rules and tokens as ``greedy_decode``, written as one
    fixed-shape step (no host sync, no Python state per token) so that on CUDA it is captured once in a
    ``torch.cuda.CUDAGraph`` and each token is a single ``replay()``.

    One step = the last token through the decoder at its position held in a device tensor
    (``Trunk.forward(..., cache_position=...)``: self-attention over the trunk's static KVCache, written at
    that slot; cross-attention over the cross K/V computed once per batch) -> LM head -> argmax -> the
    stop bookkeeping of ``greedy_decode`` on device: eos ends a row (pad afterwards), per-row token limits,
    the repetition guard (``_repeat_keep_static``, all periods at once), ``min_new_tokens``. Whether every
    row has finished is read on the host only every ``check_every`` tokens; steps after a row finished
    write pad and change nothing, so the output does not depend on ``check_every``.

    The object owns the static buffers and the graph and is reused across batches of ONE shape: the
    first call fixes batch size, memory length, dtype, device and whether an ``audio_mask`` is given
    (capturing the graph then); a call with another shape raises. ``max_new_tokens`` sizes the cache.

    graph:   capture and replay a CUDA graph (default: when ``memory`` is on CUDA). Off, the same step runs
             eagerly (CPU, tests). Graph replay launches the kernels eager mode launches, so the tokens are
             identical to ``greedy_decode``'s given the same cache size (as ``greedy_decode(graph=True)``
             builds it).
    compile: ``torch.compile`` the step before capture (fuses the many small kernels of a one-token
             step). Compiled kernels round differently from eager ones, so on near-ties a token may differ
             from ``greedy_decode``, as with any compiled model. Each decoder compiles its own step (meant
             for long-lived decoders; past torch._dynamo's cache_size_limit per process, steps run uncompiled).
    Inference dtype: run the model in its serving dtype (``model.to(torch.bfloat16)``); under autocast the
    capture disables autocast's weight-cast cache (a graph cannot hold it), so casts are replayed.
    """

    def __init__(self, model: SpeechRecognizer, *, max_new_tokens: int = 224,
                 tokens_per_second: float | None = 25.0, max_period: int = 8, max_repeats: int | None = 4,
                 min_new_tokens: int = 0, check_every: int = 16, graph: bool | None = None,
                 compile: bool = False) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if max_repeats is not None and (max_repeats < 1 or max_period < 1):
            raise ValueError(f"max_repeats and max_period must be >= 1, got {max_repeats}, {max_period}")
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.model = model
        self.max_new_tokens, self.tokens_per_second = max_new_tokens, tokens_per_second
        self.max_period, self.max_repeats, self.min_new_tokens = max_period, max_repeats, min_new_tokens
        self.check_every, self.graph, self.compile = check_every, graph, compile
        self.prompt_length = len(model.prompt)
        self._shape: tuple | None = None  # (B, S, memory dtype, device, masked) fixed by the first call
        self._graph: torch.cuda.CUDAGraph | None = None
        self._step_fn = torch.compile(self._step, fullgraph=True, dynamic=False) if compile else self._step

    # -- buffers ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def _allocate(self, memory: Tensor, audio_mask: Tensor | None) -> None:
        """Static buffers for batches shaped like this one (allocated once: the graph reads their addresses)."""
        m, dec = self.model, self.model.decoder
        B, S, dev = memory.shape[0], memory.shape[1], memory.device
        self._shape = (B, S, memory.dtype, dev, audio_mask is not None)
        L = self.prompt_length + self.max_new_tokens
        # The trunk's KVCache (the layout and dtype greedy_decode uses): the prompt fills it through the
        # Python-int path, each step writes it at a device-tensor position (cache_position); it is reset
        # in place per batch, so the captured step keeps reading the same tensors.
        self._cache = dec.new_cache(B, L, dtype=memory.dtype)
        # Cross K/V: one (B, S, 2*G*D) projection per layer, viewed exactly as CrossAttention.memory_kv does,
        # refilled in place per batch.
        self._cross_raw = [block.cross.kv(memory) for block in dec.blocks]
        self._cross = []
        for raw, block in zip(self._cross_raw, dec.blocks):
            G, D = block.cross.n_kv, block.cross.head_dim
            k, v = raw.view(B, S, 2, G, D).permute(2, 0, 3, 1, 4)
            self._cross.append((k, v))
        self._mask = audio_mask.clone() if audio_mask is not None else None
        self._prompt = torch.tensor(m.prompt, device=dev).expand(B, -1)
        # decoding state, all on device
        self._t = torch.zeros((), dtype=torch.long, device=dev)  # index of the token being chosen
        self._token = torch.zeros(B, dtype=torch.long, device=dev)  # last chosen token (next step's input)
        self._out = torch.full((B, self.max_new_tokens), m.pad_id, dtype=torch.long, device=dev)
        self._length = torch.zeros(B, dtype=torch.long, device=dev)  # tokens kept per row
        self._done = torch.zeros(B, dtype=torch.bool, device=dev)
        self._limit = torch.zeros(B, dtype=torch.long, device=dev)
        if self.max_repeats is not None:  # index tables of the vectorised repetition guard
            self._repeat_tables = _repeat_tables(self.max_period, self.max_repeats, dev)

    def _check_shape(self, memory: Tensor, audio_mask: Tensor | None) -> None:
        got = (memory.shape[0], memory.shape[1], memory.dtype, memory.device, audio_mask is not None)
        if got != self._shape:
            raise ValueError(f"this GraphedGreedyDecoder was built for (batch, memory length, dtype, device, "
                             f"masked) = {self._shape}, got {got}: build one decoder per batch shape")

    # -- the step --------------------------------------------------------------------------------------

    def _advance(self, logits: Tensor) -> None:
        """Choose token number ``t`` of every row from ``logits`` (B, vocab) and update the stop state:
        greedy_decode's loop body with ``t`` as a device tensor, written into the static buffers."""
        m, t = self.model, self._t
        if self.min_new_tokens > 0:  # eos cannot win before min_new_tokens
            logits[:, m.eos_id] = torch.where(t < self.min_new_tokens, float("-inf"), logits[:, m.eos_id])
        done, length = self._done, self._length
        nxt = logits.argmax(-1)
        nxt = torch.where(done, m.pad_id, nxt)
        self._out.scatter_(1, t.expand(nxt.shape[0], 1), nxt[:, None])  # out[:, t] = nxt
        ended = ~done & (nxt == m.eos_id)
        length = torch.where(ended, t, length)
        if self.max_repeats is not None:
            keep = _repeat_keep_static(self._out, t, self.max_repeats, *self._repeat_tables)
            rep = ~done & ~ended & (keep >= 0) & (t >= self.min_new_tokens)
            length = torch.where(rep, keep.clamp(min=self.min_new_tokens), length)
            ended = ended | rep
        self._done.copy_(done | ended | (t + 1 >= self._limit))
        self._length.copy_(length)
        self._token.copy_(nxt)
        self._t.add_(1)

    def _step(self) -> None:
        """One token: the previous token (consumed at cache slot prompt_length - 1 + t) -> the next."""
        position = self._t + (self.prompt_length - 1)  # () long, on device: no Python int per token
        h = self.model.decode_hidden(self._token[:, None], None, self._mask, self._cache, position)
        self._advance(self.model.head(h[:, -1]))

    # -- per batch -------------------------------------------------------------------------------------

    @torch.no_grad()
    def _start(self, memory: Tensor, audio_mask: Tensor | None) -> int:
        """Reset the state for a new batch, fill the cross K/V, run the prompt (eagerly: it is one call per
        batch, through Trunk.forward exactly as greedy_decode) and choose token 0. Returns the step count."""
        m, dec = self.model, self.model.decoder
        B = memory.shape[0]
        for raw, block in zip(self._cross_raw, dec.blocks):
            raw.copy_(block.cross.kv(memory))
        if audio_mask is not None:
            self._mask.copy_(audio_mask)
        cache = self._cache
        cache.reset()
        cache.cross = list(self._cross)  # cross K/V given: the prompt and the steps read them
        limit = _limits(m, audio_mask, B, self.max_new_tokens, self.tokens_per_second, memory.device)
        self._limit.copy_(limit)
        self._t.zero_()
        self._out.fill_(m.pad_id)
        self._length.copy_(limit)
        self._done.zero_()
        h = m.decode_hidden(self._prompt, None, self._mask, cache)
        self._advance(m.head(h[:, -1]))
        return int(limit.max())

    def _capture(self) -> None:
        """Warm up (compile, cuBLAS/cuDNN handles, autotuning) on a side stream, then capture one step."""
        autocast = torch.is_autocast_enabled("cuda")
        with (torch.cuda.device(self._shape[3]),  # streams and graph on the memory's GPU
              torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), enabled=autocast, cache_enabled=False)):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    self._t.fill_(1)  # every warm-up step writes the same in-range slot
                    self._step_fn()
            torch.cuda.current_stream().wait_stream(side)
            self._t.fill_(1)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._step_fn()

    @torch.no_grad()
    def __call__(self, memory: Tensor, audio_mask: Tensor | None = None) -> list[list[int]]:
        """memory (B, S, d) from ``model.encode`` (+ its audio_mask) -> generated ids per row, as greedy_decode."""
        if self._shape is None:
            self._allocate(memory, audio_mask)
        self._check_shape(memory, audio_mask)
        graph = memory.is_cuda if self.graph is None else self.graph
        if graph and not memory.is_cuda:
            raise ValueError("graph=True needs CUDA tensors; use graph=False to run the step eagerly")
        steps = self._start(memory, audio_mask)
        if graph and self._graph is None and self.max_new_tokens > 1:
            self._capture()  # the warm-up and capture steps changed the state: start the batch again
            steps = self._start(memory, audio_mask)
        for t in range(steps):
            if t > 0:
                if graph:
                    self._graph.replay()
                else:
                    self._step_fn()
            if t + 1 == steps or ((t + 1) % self.check_every == 0 and bool(self._done.all())):
                break
        lengths = self._length.tolist()
        return [row[:n] for row, n in zip(self._out.tolist(), lengths)]


def _repeat_tables(max_period: int, max_repeats: int, device: torch.device) -> tuple[Tensor, ...]:
    """Index tables for ``_repeat_keep_static``. With W = max_period * max_repeats tail tokens, period p
    (window w = p * max_repeats, the last w tokens) repeats when tail[j] == tail[j - p] for every j in
    [W - w + p, W). Rows of ``a``/``b`` hold those (j, j - p) pairs per period, padded with (W-1, W-1)
    (always equal); ``period`` is 1..max_period; ``offsets`` (1-W .. 0) + t index the last W tokens."""
    W, n = max_period * max_repeats, (max_repeats - 1) * max_period
    a = torch.full((max_period, n), W - 1, dtype=torch.long)
    b = a.clone()
    for p in range(1, max_period + 1):
        j = torch.arange(W - p * max_repeats + p, W)
        a[p - 1, :len(j)], b[p - 1, :len(j)] = j, j - p
    period, offsets = torch.arange(1, max_period + 1), torch.arange(1 - W, 1)
    return a.to(device), b.to(device), period.to(device), offsets.to(device)


def _repeat_keep_static(out: Tensor, t: Tensor, max_repeats: int, a: Tensor, b: Tensor,
                        period: Tensor, offsets: Tensor) -> Tensor:
    """``_repeated_tail`` with ``t`` a device tensor and all periods compared at once (a handful of
    kernels instead of a few per period): (B,) length to keep for rows whose tokens out[:, :t+1] end in
    ``max_repeats`` copies of one block of p <= max_period tokens, else -1. The shortest period wins,
    i.e. the largest kept length."""
    index = (t + offsets).clamp(min=0)  # out[:, t+1-W .. t], W = max_period * max_repeats
    tail = out.index_select(1, index)  # (B, W); clamped columns only feed periods masked below
    hit = (tail[:, a] == tail[:, b]).all(-1) & (t + 1 >= period * max_repeats)  # (B, max_period)
    keep = t + 1 - (max_repeats - 1) * period  # (max_period,)
    return torch.where(hit, keep, -1).amax(-1)


def _length_normalised(score: float, length: int, alpha: float) -> float:
    """GNMT length penalty: score / ((5 + length) / 6) ** alpha (alpha 0 = raw log-probability)."""
    return score / (((5.0 + length) / 6.0) ** alpha)


def _repeat_keep(seq: list[int], max_period: int, max_repeats: int) -> int:
    """Host version of _repeated_tail for one sequence: length to keep, or -1."""
    keep = -1
    for p in range(max_period, 0, -1):
        w = p * max_repeats
        if len(seq) >= w and all(seq[-w + i] == seq[-w + i + p] for i in range(w - p)):
            keep = len(seq) - (max_repeats - 1) * p
    return keep


@torch.no_grad()
def beam_search(model: SpeechRecognizer, memory: Tensor, audio_mask: Tensor | None = None, *,
                beam_size: int = 4, length_penalty: float = 1.0, max_new_tokens: int = 224,
                tokens_per_second: float | None = 25.0, max_period: int = 8,
                max_repeats: int | None = 4) -> list[list[int]]:
    """Batched beam search with the KV cache (beams of a row share its cross-attention K/V; the
    self-attention cache is reordered by beam each step). Each step every live row takes the 2K best
    (beam, token) continuations: eos ones among the top K finish a hypothesis (scored by the GNMT
    ``length_penalty``), the best K others continue. A row stops once K hypotheses finished or its
    token limit is reached (live beams then finish as they are). beam_size=1 is exactly greedy."""
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    B, K, dev = memory.shape[0], beam_size, memory.device
    V = model.vocab_size
    mem = memory.repeat_interleave(K, 0)
    mask = None if audio_mask is None else audio_mask.repeat_interleave(K, 0)
    limit = _limits(model, audio_mask, B, max_new_tokens, tokens_per_second, dev).tolist()
    steps = max(limit)
    prompt = torch.tensor(model.prompt, device=dev).expand(B * K, -1)
    cache = model.decoder.new_cache(B * K, prompt.shape[1] + steps, dtype=memory.dtype)
    h = model.decode_hidden(prompt, mem, mask, cache)
    scores = torch.full((B, K), float("-inf"), device=dev)
    scores[:, 0] = 0.0  # all beams start identical: expand from one only
    seqs: list[list[list[int]]] = [[[] for _ in range(K)] for _ in range(B)]
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
    live = [True] * B
    for t in range(steps):
        logp = model.head(h[:, -1]).float().log_softmax(-1).view(B, K, V)
        cand = (scores[..., None] + logp).view(B, K * V)
        top_s, top_i = cand.topk(min(2 * K, K * V), dim=-1)
        top_s, top_i = top_s.tolist(), top_i.tolist()
        src = [b * K for b in range(B) for _ in range(K)]
        tokens = [model.pad_id] * (B * K)
        new_scores = [[float("-inf")] * K for _ in range(B)]
        new_seqs: list[list[list[int]]] = [[[] for _ in range(K)] for _ in range(B)]
        for b in range(B):
            if not live[b]:
                continue
            n = 0
            for rank, (s, i) in enumerate(zip(top_s[b], top_i[b])):
                if s == float("-inf"):
                    break
                k, v = divmod(i, V)
                if v == model.eos_id:
                    if rank < K:
                        seq = seqs[b][k]
                        finished[b].append((_length_normalised(s, len(seq) + 1, length_penalty), seq))
                    continue
                seq = seqs[b][k] + [v]
                keep = _repeat_keep(seq, max_period, max_repeats) if max_repeats is not None else -1
                if keep >= 0:  # a repetition loop: finish with the first copy only
                    finished[b].append((_length_normalised(s, len(seq), length_penalty), seq[:keep]))
                    continue
                src[b * K + n], tokens[b * K + n] = b * K + k, v
                new_scores[b][n], new_seqs[b][n] = s, seq
                n += 1
                if n == K:
                    break
            if len(finished[b]) >= K or t + 1 >= limit[b]:
                if len(finished[b]) < K:  # token limit: live beams finish as they are
                    finished[b].extend((_length_normalised(s, len(q), length_penalty), q)
                                       for s, q in zip(new_scores[b], new_seqs[b]) if s > float("-inf"))
                live[b] = False
        if not any(live):
            break
        seqs = new_seqs
        scores = torch.tensor(new_scores, device=dev)
        index = torch.tensor(src, device=dev)
        # beams follow their source beam; cross K/V stay (the beams of a row share its memory)
        cache.k = [k.index_select(0, index) for k in cache.k]
        cache.v = [v.index_select(0, index) for v in cache.v]
        cache.valid = cache.valid.index_select(0, index)
        h = model.decode_hidden(torch.tensor(tokens, device=dev)[:, None], None, mask, cache)
    return [max(f, key=lambda x: x[0])[1] if f else [] for f in finished]


@torch.no_grad()
def transcribe_batch(model: SpeechRecognizer, text_tok: TextTokenizer, audio: Tensor, audio_mask: Tensor, *,
                     beam_size: int = 1, length_penalty: float = 1.0, **guards: Any) -> list[str]:
    """Padded audio tokens (B, S, F) + mask -> transcripts (greedy for beam_size 1, else beam search)."""
    memory = model.encode(audio, audio_mask)
    if beam_size == 1:
        ids = greedy_decode(model, memory, audio_mask, **guards)
    else:
        ids = beam_search(model, memory, audio_mask, beam_size=beam_size, length_penalty=length_penalty, **guards)
    return [text_tok.decode(row) for row in ids]


# ----------------------------------------------------------------------------------------------------
# Long audio


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


# ----------------------------------------------------------------------------------------------------
# Inference on files (omni transcribe)


def read_audio_file(path: str | os.PathLike, sample_rate: int = 16000) -> Tensor:
    """Mono float waveform at ``sample_rate`` of any file libsndfile reads (WAV, FLAC, MP3, OGG ...), any
    rate and channel count. Raises FileNotFoundError / ValueError naming the file for a missing, empty
    (0 bytes or 0 samples), undecodable or silent (peak below -80 dBFS) file, and for a path that is not a
    regular file (a directory, FIFO, device or socket: refused before opening, which could block)."""
    name = os.fspath(path)
    if check_regular_file(path, "audio file").st_size == 0:
        raise ValueError(f"{name}: the file is empty (0 bytes)")
    try:
        wave = load_audio(name, sample_rate=sample_rate, key=name)
    except (ValueError, TypeError) as exc:
        msg = str(exc).removeprefix(f"audio sample {name!r}: ")  # the file is named once, first
        if "audio is empty" in msg:
            raise ValueError(f"{name}: the audio has no samples") from exc
        raise ValueError(f"{name}: cannot decode as audio ({msg})") from exc
    peak = float(wave.abs().max())
    if peak < SILENCE_PEAK:
        raise ValueError(f"{name}: the audio is silent (peak amplitude {peak:.2e} < {SILENCE_PEAK:g}); nothing to transcribe")
    return wave


@torch.no_grad()
def transcribe_waveforms(model: SpeechRecognizer, audio_tok: AudioTokenizer, text_tok: TextTokenizer,
                         waves: Sequence[Tensor], *, keys: Sequence[str] | None = None, batch_size: int = 16,
                         beam_size: int = 1, length_penalty: float = 1.0, window_seconds: float | None = None,
                         **guards: Any) -> list[str]:
    """Mono waveforms at ``audio_tok.sample_rate`` (any length) -> transcripts. Long clips are split by
    ``split_windows`` (window = the tokenizer's max_seconds, 30 s); all windows of all clips are sorted by
    length and decoded in batches of ``batch_size``; a clip's window texts are joined with one space."""
    keys = list(keys) if keys is not None else [str(i) for i in range(len(waves))]
    window = window_seconds or audio_tok.max_seconds or 30.0
    items: list[tuple[int, int, Tensor]] = []  # (clip, window index, tokens)
    for c, (wave, key) in enumerate(zip(waves, keys)):
        for w, (a, b) in enumerate(split_windows(wave, audio_tok.sample_rate, window)):
            seg = audio_tok.encode((wave[a:b], audio_tok.sample_rate), key=f"{key}[{a}:{b}]")
            items.append((c, w, seg.tokens))
    order = sorted(range(len(items)), key=lambda i: items[i][2].shape[0])
    texts: dict[tuple[int, int], str] = {}
    dev = next(model.parameters()).device
    for lo in range(0, len(order), batch_size):
        chunk = [items[i] for i in order[lo:lo + batch_size]]
        audio, mask = pad_audio([it[2] for it in chunk])
        out = transcribe_batch(model, text_tok, audio.to(dev), mask.to(dev), beam_size=beam_size,
                               length_penalty=length_penalty, **guards)
        texts.update({(c, w): s for (c, w, _), s in zip(chunk, out)})
    result = []
    for c in range(len(waves)):
        parts = [texts[(cc, w)].strip() for (cc, w) in sorted(k for k in texts if k[0] == c)]
        result.append(" ".join(p for p in parts if p))
    return result


def load_recognizer(checkpoint: str | os.PathLike, device: str | torch.device | None = None
                    ) -> tuple[SpeechRecognizer, AudioTokenizer, TextTokenizer]:
    """The exported model (recipes/whisper.py writes runs/whisper/final) and its tokenizers."""
    from omni.export import load_pretrained, load_tokenizers

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_pretrained(checkpoint, device=device)
    toks = load_tokenizers(checkpoint)
    if not isinstance(model, SpeechRecognizer) or "audio" not in toks or "text" not in toks:
        raise ValueError(f"{checkpoint}: not a speech recognition export (see recipes/whisper.py)")
    return model, toks["audio"], toks["text"]


def speech_task(config: dict[str, Any]) -> str | None:
    """The task (= LM head) of a multitask export (builder "omni", recipes/multimodal.py) that transcribes speech:
    its one transcribe task, or among several the one named "asr"; None when it has none or lacks the audio
    and text tokenizers."""
    if not {"audio", "text"} <= set(config.get("tokenizers", [])):
        return None
    heads = config.get("heads", {})
    names = [name for name, task in config.get("tasks", {}).items()
             if task.get("kind") == TASK and heads.get(name, {}).get("type") == "lm"]
    if len(names) > 1 and "asr" not in names:
        raise ValueError(f"the export has transcribe tasks {', '.join(names)} and none is named 'asr': "
                         "which one to decode is not recorded")
    return names[0] if len(names) == 1 else "asr" if names else None


def _recognizer(checkpoint: str | os.PathLike, device: str | torch.device | None
                ) -> tuple[Any, AudioTokenizer, TextTokenizer]:
    """``load_recognizer``, or for a multitask export (recipes/multimodal.py) its transcribe task as a prefix-LM
    behind the decoding interface (``omni.multitask.PrefixLMTranscriber``) that ``transcribe_waveforms`` drives."""
    from omni.export import load_config, load_pretrained, load_tokenizers

    config = load_config(checkpoint)
    if config.get("builder") != "omni":
        return load_recognizer(checkpoint, device)
    task = speech_task(config)
    if task is None:
        raise ValueError(f"{checkpoint}: the multitask export has no speech recognition (transcribe) task")
    from types import SimpleNamespace

    from omni.multitask import PrefixLMTranscriber

    model = load_pretrained(checkpoint, device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
    toks = load_tokenizers(checkpoint)
    # PrefixLMTranscriber reads only these attributes of its TranscribeTask (whose clips are training data)
    spec = SimpleNamespace(name=task, audio=toks["audio"], text=toks["text"], task_token=TASK)
    decoder = PrefixLMTranscriber(model, spec)  # type: ignore[arg-type]
    decoder.parameters = model.parameters  # type: ignore[attr-defined]  # transcribe_waveforms: the device
    return decoder, toks["audio"], toks["text"]


def transcribe_files(checkpoint: str | os.PathLike, files: Sequence[str | os.PathLike], *, beam_size: int = 1,
                     length_penalty: float = 1.0, batch_size: int = 16, device: str | None = None,
                     max_new_tokens: int = 224, return_exceptions: bool = False) -> list[str | Exception]:
    """Transcribe audio files (WAV, FLAC, MP3, OGG ...; any rate, channels, length) with a speech recognition
    export (recipes/whisper.py) or the transcribe task of a multitask export (recipes/multimodal.py).
    Every file is read and checked first, so a bad file fails before any decoding, naming the file; with
    ``return_exceptions`` its exception takes its place in the result instead and the other files are
    transcribed (the export's own errors raise either way)."""
    for option, value in (("beam_size", beam_size), ("batch_size", batch_size), ("max_new_tokens", max_new_tokens)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
    if not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty}")
    model, audio_tok, text_tok = _recognizer(checkpoint, device)
    results: list[str | Exception] = []
    waves: dict[int, Tensor] = {}
    for i, f in enumerate(files):
        try:
            waves[i] = read_audio_file(f, audio_tok.sample_rate)
            results.append("")
        except (OSError, ValueError) as exc:
            if not return_exceptions:
                raise
            results.append(exc)
    if waves:
        texts = transcribe_waveforms(model, audio_tok, text_tok, list(waves.values()),
                                     keys=[os.fspath(files[i]) for i in waves], batch_size=batch_size,
                                     beam_size=beam_size, length_penalty=length_penalty,
                                     max_new_tokens=max_new_tokens)
        for i, text in zip(waves, texts):
            results[i] = text
    return results


# ----------------------------------------------------------------------------------------------------
# Metrics

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


__all__ = [
    "CTC_BLANK", "GraphedGreedyDecoder", "SpeechBatch", "SpeechCollate", "SpeechLoss", "SpeechRecognizer",
    "beam_search", "build_speech_recognizer", "ctc_greedy_decode", "ctc_labels", "edit_distance", "error_counts",
    "error_rates", "greedy_decode", "load_recognizer", "normalize_text", "pad_audio", "read_audio_file",
    "speech_example", "speech_loss", "split_windows", "transcribe_batch", "transcribe_files", "transcribe_waveforms",
]
