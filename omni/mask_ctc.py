"""Mask-CTC (Higuchi et al. 2020): non-autoregressive decoding of a speech recognizer whose decoder also learned a
conditional masked LM (``omni.speech.SpeechLoss(mask_weight=...)``). Small pieces, like omni.decoding:

    drafts = ctc_tokens(model.ctc_head(memory), mask, text_tok)      # the CTC head's best path, re-tokenised,
                                                                     # each decoder token with its confidence
    ids = mask_ctc(model, memory, mask, drafts, iterations=3)        # unsure tokens masked, filled easy-first
    ids = [d.ids for d in drafts]                                    # CTC alone (``--decode ctc``)

* Confidence of a decoder token: the CTC head's byte units, each scored by the MAX of the best path's probability
  over the frames that emit it (ESPnet's Mask-CTC: a unit as sure as its surest frame), and a token by the MIN over
  its bytes (a token is as sure as its least sure byte: one doubtful letter makes the word doubtful).
* Masking: tokens whose confidence is under ``threshold`` become the model's mask token (``model.mask_id``).
* Filling: N iterations, one bidirectional decoder pass each (``SpeechRecognizer.decode_bidirectional``: the same
  weights as greedy decoding, without the causal mask), batched over rows. A row with m masks runs min(N, m)
  iterations; each but the last fills the floor(m / its iterations) masks the decoder is surest of (its max
  probability, special tokens excluded), the last fills all that remain (ESPnet's schedule). Unmasked tokens never
  change; the length is the CTC draft's.
* No length edits (Improved Mask-CTC's insert / delete): the length is the CTC text's; see
  /work/notes/results_mask_ctc.md for how often the CTC draft's token count is wrong on the benchmark.

``ctc_decode`` and ``mask_ctc_decode`` wrap these as ``decode_batch(parallel=...)`` strategies (one call per batch:
memory and audio mask in, ids out), which is how ``omni transcribe --decode ctc|mask-ctc`` runs them.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from omni.asr_text import CTC_BLANK
from omni.timestamps import token_char_ends

# Tokens under this CTC confidence are re-predicted: Higuchi et al.'s (and ESPnet's) p_thres 0.999, for a decoder that
# reads the audio well. On omni's CPU models every threshold that masks anything loses to CTC alone (their decoder
# hardly reads the audio: /work/notes/results_mask_ctc.md); `omni transcribe --mask-threshold` sets another.
DEFAULT_THRESHOLD = 0.999
MAX_ITERATIONS = 64  # one decoder pass each: past this the passes outnumber any transcript's tokens

ParallelDecode = Callable[[Tensor, Tensor | None], list[list[int]]]  # (memory, audio mask) -> ids per row


@dataclass
class Draft:
    """One row's CTC draft: decoder token ids (no bos / eos), each token's confidence, and the CTC text."""

    ids: list[int]
    confidence: list[float]
    text: str


@dataclass
class MaskCTCStats:
    """What a Mask-CTC decoding cost: ``passes`` sequential decoder passes (0 for CTC alone), ``tokens`` output
    tokens, ``masked`` of them re-predicted."""

    passes: int = 0
    tokens: int = 0
    masked: int = 0


def check_iterations(n: int) -> int:
    if not 1 <= n <= MAX_ITERATIONS:
        raise ValueError(f"iterations must be 1 .. {MAX_ITERATIONS}, got {n}")
    return n


def _char_confidence(units: Sequence[int], scores: Sequence[float]) -> tuple[str, list[float]]:
    """CTC byte units and their scores -> the UTF-8 text (invalid bytes replaced, as ``ctc_greedy_decode``) and each
    character's score: the min over the bytes that made it."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text, conf, pending = [], [], 1.0
    for unit, score in zip(units, scores):
        pending = min(pending, score)
        out = decoder.decode(bytes([unit]))
        for ch in out:
            text.append(ch)
            conf.append(pending)
        if out:
            pending = 1.0
    for ch in decoder.decode(b"", final=True):  # an unfinished character at the end
        text.append(ch)
        conf.append(pending)
    return "".join(text), conf


def ctc_tokens(ctc_logits: Tensor, audio_mask: Tensor | None, text_tok: Any) -> list[Draft]:
    """(B, S, 257) CTC logits -> each row's best path (``ctc_greedy_decode``'s text) re-tokenised into decoder ids
    with per-token confidence (module docstring: max over a byte's frames, min over a token's bytes)."""
    probs = ctc_logits.float().softmax(-1)
    best_p, best = probs.max(-1)
    lengths = [best.shape[1]] * best.shape[0] if audio_mask is None else audio_mask.sum(1).tolist()
    drafts = []
    for path, p, n in zip(best.tolist(), best_p.tolist(), lengths):
        units: list[int] = []
        scores: list[float] = []
        for i in range(int(n)):
            c = path[i]
            if c == CTC_BLANK:
                continue
            if i > 0 and path[i - 1] == c:  # the same unit's run: its score is the max over the run
                scores[-1] = max(scores[-1], p[i])
            else:
                units.append(c)
                scores.append(p[i])
        text, conf = _char_confidence(units, scores)
        ids = text_tok.encode(text).tokens.tolist()
        ids = ids[int(text_tok.add_bos):len(ids) - int(text_tok.add_eos)]
        ends = token_char_ends(text_tok, ids)
        token_conf, start = [], 0
        for end in ends:
            span = conf[start:end]
            token_conf.append(min(span) if span else 1.0)  # a token that completes no character: decided by its next
            start = max(start, end)
        for k in range(len(token_conf) - 2, -1, -1):
            if ends[k] == (ends[k - 1] if k else 0):
                token_conf[k] = token_conf[k + 1]
        drafts.append(Draft(ids, token_conf, text))
    return drafts


def _special_ids(text_tok: Any) -> list[int]:
    return sorted({text_tok.token_id(name) for name in text_tok.special_tokens})


def check_mask_ctc(model: Any, option: str = "--decode mask-ctc") -> None:
    """ValueError (one line naming ``option``) unless ``model`` has a CTC head and a decoder trained as a masked LM."""
    if getattr(model, "ctc_head", None) is None:
        raise ValueError(f"{option} edits the CTC head's text: this model has no CTC head (trained with ctc_weight=0); "
                         "use --decode greedy or beam")
    if getattr(model, "mask_id", None) is None:
        raise ValueError(f"{option} needs a decoder trained as a masked LM (recipes/whisper.py --set mask_weight=0.5; "
                         "its export records mask_token): this model was not; use --decode ctc, greedy or beam")


@torch.no_grad()
def mask_ctc(model: Any, memory: Tensor, audio_mask: Tensor | None, drafts: Sequence[Draft], *, iterations: int = 3,
             threshold: float = DEFAULT_THRESHOLD, suppress: Sequence[int] = (),
             stats: MaskCTCStats | None = None) -> list[list[int]]:
    """Each row's draft with its tokens under ``threshold`` masked and re-predicted in ``iterations`` bidirectional
    decoder passes, easy first (module docstring) -> ids per row (no bos / eos). ``suppress``: ids never filled in
    (the special tokens). Rows without masks cost nothing; the passes run over the rows that still have masks."""
    check_mask_ctc(model)
    check_iterations(iterations)
    B, dev = len(drafts), memory.device
    prompt = list(model.prompt)
    P = len(prompt)
    width = P + max([len(d.ids) for d in drafts] + [0]) + 1
    text = torch.full((B, width), model.pad_id, dtype=torch.long, device=dev)
    real = torch.zeros(B, width, dtype=torch.bool, device=dev)
    masked = torch.zeros(B, width, dtype=torch.bool, device=dev)
    for b, d in enumerate(drafts):
        n = len(d.ids)
        text[b, :P + n + 1] = torch.tensor(prompt + d.ids + [model.eos_id], dtype=torch.long)
        real[b, :P + n + 1] = True
        masked[b, P:P + n] = torch.tensor([c < threshold for c in d.confidence], dtype=torch.bool)
    text = torch.where(masked, model.mask_id, text)
    total = masked.sum(1)  # (B,) masks at the start
    runs = torch.minimum(total, torch.tensor(iterations, device=dev))  # iterations per row
    per_pass = torch.where(runs > 0, total // runs.clamp(min=1), 0)
    stats = stats if stats is not None else MaskCTCStats()
    banned = torch.tensor(sorted(set(suppress)), dtype=torch.long, device=dev)
    for t in range(int(runs.max()) if B else 0):
        rows = (masked.any(1)).nonzero()[:, 0]
        sub_text, sub_real, sub_masked = text[rows], real[rows], masked[rows]
        mem = memory.index_select(0, rows)
        am = None if audio_mask is None else audio_mask.index_select(0, rows)
        logits = model.head(model.decode_bidirectional(sub_text, mem, am, sub_real)).float()
        if banned.numel():
            logits[..., banned] = float("-inf")
        score, choice = logits.softmax(-1).max(-1)  # (R, T)
        score = torch.where(sub_masked, score, -1.0)
        last = t + 1 >= runs[rows]  # the row's last iteration: every remaining mask
        k = torch.where(last, sub_masked.sum(1), per_pass[rows])  # (R,) masks filled now
        rank = score.argsort(1, descending=True).argsort(1)
        fill = sub_masked & (rank < k[:, None])
        text[rows] = torch.where(fill, choice, sub_text)
        masked[rows] = sub_masked & ~fill
        stats.passes += 1
    out = [text[b, P:P + len(d.ids)].tolist() for b, d in enumerate(drafts)]
    stats.tokens += sum(len(d.ids) for d in drafts)
    stats.masked += int(total.sum())
    return out


def ctc_decode(model: Any, text_tok: Any, stats: MaskCTCStats | None = None) -> ParallelDecode:
    """A ``decode_batch(parallel=...)`` strategy: the CTC head's best path, re-tokenised into decoder ids."""
    head = getattr(model, "ctc_head", None)
    if head is None:
        raise ValueError("--decode ctc reads the CTC head: this model has no CTC head (trained with ctc_weight=0); use "
                         "--decode greedy or beam")

    def run(memory: Tensor, audio_mask: Tensor | None) -> list[list[int]]:
        drafts = ctc_tokens(head(memory), audio_mask, text_tok)
        if stats is not None:
            stats.tokens += sum(len(d.ids) for d in drafts)
        return [d.ids for d in drafts]

    return run


def mask_ctc_decode(model: Any, text_tok: Any, iterations: int = 3, threshold: float = DEFAULT_THRESHOLD,
                    stats: MaskCTCStats | None = None) -> ParallelDecode:
    """A ``decode_batch(parallel=...)`` strategy: ``ctc_tokens`` then ``mask_ctc``."""
    check_mask_ctc(model)
    check_iterations(iterations)
    suppress = _special_ids(text_tok)

    def run(memory: Tensor, audio_mask: Tensor | None) -> list[list[int]]:
        drafts = ctc_tokens(model.ctc_head(memory), audio_mask, text_tok)
        return mask_ctc(model, memory, audio_mask, drafts, iterations=iterations, threshold=threshold,
                        suppress=suppress, stats=stats)

    return run


__all__ = ["DEFAULT_THRESHOLD", "MAX_ITERATIONS", "Draft", "MaskCTCStats", "ParallelDecode", "check_iterations",
           "check_mask_ctc", "ctc_decode", "ctc_tokens", "mask_ctc", "mask_ctc_decode"]
