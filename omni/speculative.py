"""Speculative decoding, exact: a drafter proposes k tokens per row, the decoder checks them all in ONE forward pass
over the k + 1 positions, keeps the longest prefix it agrees with plus its own next token, and rolls its KV cache
back past the rest. The tokens are greedy decoding's by construction (every kept token is the decoder's own argmax
after the same filters, over the same history); only the number of sequential decoder passes changes.

    drafter = PromptLookup(prompts)                       # (a) n-gram copy from the prompt and the text so far
    drafter = Reference(ctc_token_ids)                    # (c) a fixed draft per row (the CTC head's text), aligned
    drafter = DraftModel(small_model, memory, mask)       # (b) a smaller decoder sharing the vocabulary, greedy
    ids = speculative_decode(model, memory, mask, drafter=drafter, draft_tokens=4, stats=stats)

A ``Drafter`` is one method, ``propose(tokens, k)``: each row's generated tokens so far (prompt excluded) -> up to
k next tokens per row. The model is any ``omni.interfaces.Seq2SeqDecoder`` that also gives the hidden states of
every text position (``Verifiable``: ``decode_hidden`` and ``head``; omni's speech recognizer and its Whisper
timestamp mode, the prefix-LM transcriber, ``omni.generate.PromptedLM``).

How the batch stays exact when rows accept different counts: every pass writes the k + 1 inputs of every row at
one cache slot P (a device tensor, as the graphed greedy step), then ``KVCache.rollback`` forgets, per row, the
slots past what that row kept. A row that kept fewer leaves invalid slots behind (masked like padding); positions
come from each row's real token count (``KVCache.real_tokens``), not from the slot, so they are greedy's. When P
would run past the cache, the cache is compacted (``rollback(compact=True)``) and P restarts after the longest row.
The logit filters see, at verified position j of row b, greedy's history (the row's tokens + drafts 1..j) and
clock t = the row's length + j: ``omni.decoding``'s filters and repetition guard take a per-row ``t`` (N,).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from omni.decoding import CachedInference, Decoding, DecodingOptions, Greedy
from omni.interfaces import Seq2SeqDecoder
from omni.trunk import KVCache

MAX_DRAFT_TOKENS = 32  # a pass verifies k + 1 positions: past this the wasted work outweighs any acceptance


@runtime_checkable
class Drafter(Protocol):
    """Proposes the next tokens of every row."""

    def propose(self, tokens: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """Each row's generated tokens so far (prompt excluded) -> up to ``k`` proposed next tokens per row."""
        ...


@runtime_checkable
class Verifiable(Protocol):
    """A decoder whose cached call gives hidden states at every new text position (not only the last)."""

    def decode_hidden(self, text: Tensor, memory: Tensor | None, mask: Tensor | None, cache: KVCache | None = None,
                      cache_position: Tensor | None = None) -> Tensor: ...

    def head(self, hidden: Tensor) -> Tensor: ...


def continuation(source: Sequence[int], suffix: Sequence[int], k: int, max_ngram: int, *,
                 near: int | None = None, exclude_end: bool = False) -> list[int] | None:
    """The up to ``k`` tokens that follow an occurrence in ``source`` of the longest tail of ``suffix`` (n-grams of
    ``max_ngram`` .. 1 tokens), None when no tail occurs. Among occurrences of one n-gram: the one ending nearest
    to ``near`` (alignment of a draft to the text so far), else the latest followed by k tokens (else by the
    most: in a text that repeats itself the latest occurrence sits just before the end, with one token to copy).
    ``exclude_end``: an occurrence must be followed by a token (the suffix itself, at the end of ``source``, is not
    a match)."""
    limit = len(source) - 1 if exclude_end else len(source)
    for n in range(min(max_ngram, len(suffix)), 0, -1):
        tail = list(suffix[-n:])
        ends = [i + n for i in range(0, limit - n + 1) if list(source[i:i + n]) == tail]
        ends = [e for e in ends if e < len(source)]  # something follows
        if ends:
            if near is None:
                end = max(ends, key=lambda e: (min(len(source) - e, k), e))
            else:
                end = min(ends, key=lambda e: (abs(e - near), e))
            return list(source[end:end + k])
    return None


class PromptLookup:
    """(a) Prompt lookup: the tokens that followed the last earlier occurrence of the text's final n-gram
    (``max_ngram`` .. 1 tokens) in the row's prompt + generated text. Nothing when it never occurred: the pass is
    then a plain greedy step."""

    def __init__(self, prompts: Sequence[Sequence[int]] | None = None, max_ngram: int = 3) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.prompts = [list(p) for p in prompts] if prompts is not None else None
        self.max_ngram = max_ngram

    def propose(self, tokens: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        out = []
        for b, row in enumerate(tokens):
            context = (self.prompts[b] if self.prompts is not None else []) + list(row)
            out.append(continuation(context, context, k, self.max_ngram, exclude_end=True) or [])
        return out


class Reference:
    """(c) A fixed draft per row (e.g. the CTC head's greedy transcript re-tokenized into decoder ids): aligned to
    the text so far by its longest tail (``max_ngram`` .. 1 tokens) found in the draft, the occurrence ending nearest
    the text's length; without a match, by position (draft[len(text):])."""

    def __init__(self, drafts: Sequence[Sequence[int]], max_ngram: int = 3) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.drafts, self.max_ngram = [list(d) for d in drafts], max_ngram

    def propose(self, tokens: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        out = []
        for draft, row in zip(self.drafts, tokens):
            found = continuation(draft, row, k, self.max_ngram, near=len(row)) if row else None
            out.append(found if found is not None else draft[len(row):len(row) + k])
        return out


class DraftModel:
    """(b) A smaller decoder sharing the vocabulary (a shallow decoder, a smaller converted Whisper / GPT-2): its own
    greedy tokens (no filters, no guard: a draft need not be exact). ``memory`` and ``mask`` are its own
    (``draft.encode`` of the batch's inputs; ``PromptedLM``: the prompt ids).

    Its KV cache lives across proposals: the prompt (and the cross-attention K/V of ``memory``) are computed once;
    each proposal rolls a row back to the tokens it already holds that are still the row's (all of them but the
    last: the last one is re-fed so that its hidden state gives the first draft token), feeds the rest (rows right-
    padded to one width, written at one slot and the padding rolled back, as ``speculative_decode`` does), drafts
    k tokens greedily and then forgets them (the accepted ones come back as the row's tokens). When the slots run
    out the cache is compacted, and grown (prompt re-run) only when a row's real tokens no longer fit."""

    def __init__(self, draft: Seq2SeqDecoder, memory: Tensor, mask: Tensor | None = None, capacity: int = 256) -> None:
        self.draft, self.memory, self.mask = _verifier(draft), memory, mask
        self.capacity = capacity
        self.cache: KVCache | None = None
        self.held: list[int] = []  # per row: the row's generated tokens the cache holds
        self.base = torch.zeros(0)  # (B,) real slots of each row's prompt (memory held in the cache included)
        self.slot = 0  # where the next write goes (every row at once)
        self.first: Tensor | None = None  # (B, V) logits after the prompt: the draft of a row with no tokens yet

    def _start(self, capacity: int) -> None:
        B, dev = self.memory.shape[0], self.memory.device
        self.capacity = capacity
        self.cache = self.draft.new_cache(self.memory, capacity)
        prompt = torch.tensor(self.draft.prompt, dtype=torch.long, device=dev).expand(B, -1)
        self.first = self.draft.logits(prompt, self.memory, self.mask, self.cache)
        self.base, self.slot, self.held = self.cache.real_tokens().clone(), self.cache.length, [0] * B

    @torch.no_grad()
    def propose(self, tokens: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        B, dev = len(tokens), self.memory.device
        lengths = [len(r) for r in tokens]
        if self.cache is None:
            self._start(self.capacity)
        keep = [min(h, max(n - 1, 0)) for h, n in zip(self.held, lengths)]  # what stays: never a row's last token
        width = max(n - c for n, c in zip(lengths, keep))
        if self.slot + width + k > self.cache.max_length:  # compact, and grow when the real tokens do not fit
            self.cache.rollback(self.base + torch.tensor(keep, device=dev), compact=True)
            self.slot = int(self.cache.real_tokens().max())
            if self.slot + width + k > self.cache.max_length:
                self._start(2 * (self.slot + width + k))
                keep = [0] * B
                width = max(lengths)
        self.cache.rollback(self.base + torch.tensor(keep, device=dev))
        chosen = torch.zeros(B, k, dtype=torch.long, device=dev)
        if width > 0:
            feed = torch.full((B, width), self.draft.pad_id, dtype=torch.long, device=dev)
            for b, (row, c) in enumerate(zip(tokens, keep)):
                if len(row) > c:
                    feed[b, :len(row) - c] = torch.as_tensor(list(row[c:]), dtype=torch.long)
            hidden = self.draft.decode_hidden(feed, None, self.mask, self.cache,
                                              torch.tensor(self.slot, dtype=torch.long, device=dev))
            self.slot += width
            fed = torch.tensor([n - c for n, c in zip(lengths, keep)], device=dev)
            self.cache.rollback(self.base + torch.tensor(lengths, device=dev))  # the padding forgotten
            last = hidden[torch.arange(B, device=dev), (fed - 1).clamp(min=0)]  # (B, d)
            logits = self.draft.head(last[:, None])[:, 0]
            if self.first is not None:  # a row without tokens drafts from the prompt's logits
                logits = torch.where((fed == 0)[:, None], self.first, logits)
        else:
            logits = self.first
        for i in range(k):
            chosen[:, i] = logits.argmax(-1)
            if i + 1 < k:
                hidden = self.draft.decode_hidden(chosen[:, i:i + 1], None, self.mask, self.cache,
                                                  torch.tensor(self.slot, dtype=torch.long, device=dev))
                self.slot += 1
                logits = self.draft.head(hidden)[:, -1]
        self.cache.rollback(self.base + torch.tensor(lengths, device=dev))  # the drafts forgotten
        self.held = lengths
        return chosen.tolist()


@dataclass
class DraftStats:
    """What a speculative decoding cost: ``passes`` sequential decoder passes (the prompt's included, as greedy
    decoding's one pass per token), ``tokens`` generated (eos and guard-cut tokens included: greedy's steps),
    ``proposed`` draft tokens offered to live rows and ``accepted`` of them."""

    passes: int = 0
    tokens: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def vocabulary_fingerprint(text_tok: Any) -> tuple[int, str]:
    """(vocabulary size, sha256 of every token and its id, special tokens included): two tokenizers with equal
    fingerprints turn the same ids into the same text, which a draft model's tokens need."""
    vocab = sorted(text_tok.hf.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    return int(text_tok.vocab_size), digest


def check_draft_vocabulary(text_tok: Any, draft_tok: Any, draft: str, option: str = "--draft") -> None:
    """ValueError (one line naming ``option``) unless the draft model's text tokenizer has the same vocabulary: the
    same size and the same tokens at the same ids (``vocabulary_fingerprint``)."""
    (n, mine), (m, theirs) = vocabulary_fingerprint(text_tok), vocabulary_fingerprint(draft_tok)
    if n != m:
        raise ValueError(f"{option} {draft}: its vocabulary has {m} tokens, this model's {n}: a draft model must share "
                         "the vocabulary (a smaller model trained with the same tokenizer, or use --draft ngram)")
    if mine != theirs:
        raise ValueError(f"{option} {draft}: its {m} tokens are not this model's (another tokenizer of the same size): "
                         "a draft model must share the vocabulary (or use --draft ngram)")


def check_draft_tokens(k: int) -> int:
    if not 1 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(f"draft tokens must be 1 .. {MAX_DRAFT_TOKENS}, got {k}")
    return k


def _verifier(model: Seq2SeqDecoder) -> Verifiable:
    if not isinstance(model, Verifiable):
        raise ValueError(f"{type(model).__name__} gives the logits of its last position only: speculative decoding "
                         "needs decode_hidden (every position's hidden states) and head")
    return model


@torch.no_grad()
def speculative_decode(model: Seq2SeqDecoder, memory: Tensor, mask: Tensor | None = None, *, drafter: Drafter,
                       draft_tokens: int = 4, max_new_tokens: int = 224, tokens_per_second: float | None = 25.0,
                       max_period: int = 8, max_repeats: int | None = 4, min_new_tokens: int = 0,
                       stats: DraftStats | None = None) -> list[list[int]]:
    """``omni.decoding.greedy_decode``'s tokens (same options, same rules, the model's logit filters included) in
    fewer sequential passes when the drafter guesses well (module docstring). ``stats`` (a ``DraftStats``) is
    filled in place."""
    k, verifier = check_draft_tokens(draft_tokens), _verifier(model)
    options = DecodingOptions(max_new_tokens, tokens_per_second, max_period, max_repeats, min_new_tokens)
    B, dev = memory.shape[0], memory.device
    limit = options.limits(model, mask, B, dev)
    steps = int(limit.max())
    stats = stats if stats is not None else DraftStats()
    # room for the longest row plus two passes of slack (compaction frees the rest); token 0 as greedy chooses it
    inference = CachedInference(model, memory, mask, steps + 2 * (k + 1))
    if not callable(getattr(inference.cache, "rollback", None)):
        raise ValueError(f"speculative decoding rolls the KV cache back; this model's {type(inference.cache).__name__} "
                         "cannot (attention patterns keep a ring cache): decode it greedily")
    greedy = Greedy(B, steps + k + 1, model.eos_id, model.pad_id, options.guard(dev), dev)
    filters = options.filters(model)
    Decoding(inference, greedy, filters, dev).start(memory, mask, limit)
    stats.passes += 1
    cache, P = inference.cache, inference.first_slot  # P: the slot of every row's next input
    count = torch.ones(B, dtype=torch.long, device=dev)  # tokens chosen per row (token 0 so far)
    probe = False  # check the first draft before the head runs at the others (see below)
    while not greedy.all_done():
        live = ~greedy.done
        rows = greedy.out.tolist()
        n_so_far = count.tolist()
        proposals = drafter.propose([row[:n] for row, n in zip(rows, n_so_far)], k)
        width = max([0] + [len(p[:k]) for p, alive in zip(proposals, live.tolist()) if alive])
        drafts = torch.full((B, width), model.pad_id, dtype=torch.long, device=dev)
        offered = torch.zeros(B, dtype=torch.long, device=dev)
        for b, p in enumerate(proposals):
            p = p[:width]
            if p:
                drafts[b, :len(p)] = torch.as_tensor(p, dtype=torch.long)
                offered[b] = len(p)
        offered = torch.where(live, offered, 0)
        T = width + 1
        if P + T > cache.max_length:  # compact: each row's kept slots to the front, P after the longest
            real = cache.real_tokens()
            cache.rollback(real, compact=True)
            P = int(real.max())
        real = cache.real_tokens()
        inputs = torch.cat([greedy.tokens[:, None], drafts], 1)  # (B, T): the last chosen token, then the drafts
        slot = torch.tensor(P, dtype=torch.long, device=dev)
        hidden = verifier.decode_hidden(inputs, None, inference.mask, cache, slot)  # (B, T, d)
        stats.passes += 1
        stats.proposed += int(offered.sum())
        if T > 1 and probe:  # the last pass kept no draft: the head at the drafts only if the first one can stand
            first = verifier.head(hidden[:, :1])  # (B, 1, V)
            if _first_agrees(first[:, 0].clone(), filters, greedy.out, count, drafts[:, 0], offered):
                logits = torch.cat([first, verifier.head(hidden[:, 1:])], 1)
            else:  # every draft is rejected: the pass is a greedy step (the rejected slots roll back below)
                logits, drafts, offered = first, drafts[:, :0], torch.zeros_like(offered)
        else:
            logits = verifier.head(hidden)  # (B, T, V)
        kept = _accept(greedy, filters, logits, drafts, offered, count, live)  # (B,) inputs kept per row
        cache.rollback(real + kept)
        P += int(kept.max())
        stats.accepted += int(torch.where(live, (kept - 1).clamp(min=0), 0).sum())
        count += kept
        # a pass in which no live row kept a draft makes the next one probe first: with wrong drafts, a pass then
        # costs the decoder's body at T positions but its head (a vocabulary-wide matmul) at one
        probe = not bool(((kept > 1) & live).any())
    stats.tokens += int(count.sum())
    return greedy.result()


def _first_agrees(logits: Tensor, filters: list, tokens: Tensor, count: Tensor, first: Tensor,
                  offered: Tensor) -> bool:
    """Whether any row with a draft (``offered`` > 0) would keep its first: greedy's choice after the filters
    (logits (B, V) of the pass's position 0, history ``tokens[:, :count]``) equals it."""
    for rule in filters:
        logits = rule(logits, tokens, count)
    return bool(((logits.argmax(-1) == first) & (offered > 0)).any())


def _accept(greedy: Greedy, filters: list, logits: Tensor, drafts: Tensor, offered: Tensor, count: Tensor,
            live: Tensor) -> Tensor:
    """Greedy's choices at the T verified positions of every row, its stop rules applied in order; the state of
    ``greedy`` (out, tokens, length, done) advanced IN PLACE -> (B,) new tokens per row (0 for rows already done),
    which is also the number of this pass's inputs each row keeps in the cache."""
    B, T, V = logits.shape
    dev, W = logits.device, greedy.out.shape[1]
    j = torch.arange(T, device=dev)
    pos = count[:, None] + j  # (B, T): the clock t of each verified position
    # the history greedy would have had at position j: the row's tokens, then drafts 1..j (filters read [:, :t])
    history = greedy.out.clone()
    if T > 1:
        history.scatter_(1, (pos[:, :-1]).clamp(max=W - 1), drafts)
    flat = logits.reshape(B * T, V)
    for rule in filters:
        flat = rule(flat, history.repeat_interleave(T, 0), pos.reshape(-1))
    choice = flat.argmax(-1).view(B, T)
    agree = (choice[:, :-1] == drafts) & (j[:-1] < offered[:, None])  # (B, T-1)
    accepted = agree.long().cumprod(1).sum(1)  # (B,) drafts kept before the first disagreement
    within = live[:, None] & (j <= accepted[:, None]) & (pos < greedy.limit[:, None])  # (B, T) candidate tokens
    greedy.out.scatter_(1, pos.clamp(max=W - 1), torch.where(within, choice, greedy.pad_id))
    eos = within & (choice == greedy.eos_id)
    keep = (greedy.guard.keep(greedy.out.repeat_interleave(T, 0), pos.reshape(-1)).view(B, T)
            if greedy.guard is not None else torch.full_like(pos, -1))
    loop = within & ~eos & (keep >= 0)
    stop = eos | loop | (within & (pos + 1 >= greedy.limit[:, None]))
    first = torch.where(stop, j, T).amin(1)  # (B,) the position the row ends at, T: it goes on
    ends = live & (first < T)
    new = torch.where(live, torch.minimum(accepted, first) + 1, 0)  # tokens this pass gives each row
    at = (new - 1).clamp(min=0)[:, None]
    length = torch.where(eos.gather(1, at)[:, 0], pos.gather(1, at)[:, 0], greedy.length)
    length = torch.where(loop.gather(1, at)[:, 0], keep.gather(1, at)[:, 0], length)
    greedy.length.copy_(torch.where(ends, length, greedy.length))
    beyond = j >= new[:, None]  # positions past a row's end: back to pad (greedy writes nothing there)
    greedy.out.scatter_(1, pos.clamp(max=W - 1), torch.where(within & ~beyond, choice, greedy.pad_id))
    greedy.done.copy_(greedy.done | ends)
    greedy.tokens.copy_(torch.where(live, choice.gather(1, at)[:, 0], greedy.pad_id))
    return new


__all__ = ["DraftModel", "DraftStats", "Drafter", "MAX_DRAFT_TOKENS", "PromptLookup", "Reference", "Verifiable",
           "check_draft_tokens", "check_draft_vocabulary", "continuation", "speculative_decode",
           "vocabulary_fingerprint"]
