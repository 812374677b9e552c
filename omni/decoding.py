"""Autoregressive decoding, written once: one loop, one device-side step, strategies and rules as small pieces.

    memory = model.encode(inputs, mask)                               # model: an omni.interfaces.Seq2SeqDecoder
    ids = greedy_decode(model, memory, mask, max_new_tokens=224)      # (SpeechRecognizer, PrefixLMTranscriber)
    ids = beam_search(model, memory, mask, beam_size=4, length_penalty=1.0)
    decoder = GraphedGreedyDecoder(model, max_new_tokens=224)         # the step captured once in a CUDA graph
    ids = decoder(memory, mask)                                       # ... and replayed per token

The parts (the split of openai/whisper's decoding.py):

    DecodingOptions   the rules every strategy applies: token limits, repetition guard, min_new_tokens (frozen)
    CachedInference   model + this batch's KV cache: the prompt once, then each row's last token at a cache slot
                      held in a device tensor, so a step has fixed shapes and no host sync
    FullInference     the reference: the whole text so far through the model every step (no cache)
    MinNewTokens      a LogitFilter (omni.interfaces): eos cannot win before min_new_tokens
    SuppressTokens    a LogitFilter: these ids are never chosen (Whisper's suppress_tokens)
    SuppressAtStart   a LogitFilter: these ids are not chosen first (Whisper's suppress_blank: " " and eot)
    TimestampRules    a LogitFilter: Whisper's timestamp rules (pairs, a first timestamp <= 1 s, never decreasing,
                      a timestamp when they outweigh the best text token), for decoding with timestamp tokens
                      (a model's own filters, ``model.logit_filters``, run after DecodingOptions' in every strategy)
    RepetitionGuard   a stop rule: a row ending in max_repeats copies of one block of <= max_period tokens ends,
                      keeping the first copy
    Greedy            strategy: argmax per row, all state on the device (what a CUDA graph replays)
    BeamSearch        strategy: K hypotheses per input, chosen on the host, the cache reordered by beam
    Decoding          the loop: start (prompt -> token 0), then step = model -> filters -> strategy, until done
    (omni.speculative: a drafter's k tokens verified in one pass, the cache rolled back: greedy's tokens, fewer passes)

The rules: a row ends at eos, at its token limit (``max_new_tokens``, and for an input of s seconds
ceil(tokens_per_second * s) + 8, a hallucination guard that scales with the clip), or when the repetition guard
fires. Returned ids exclude the prompt and eos. A new rule is a LogitFilter (before the choice) or a stop rule
inside the strategy (after it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from omni.cuda_graphs import capture, warm_up
from omni.interfaces import LogitFilter, Seq2SeqDecoder

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------------
# The model side


def _prompts(model: Seq2SeqDecoder, memory: Tensor) -> Tensor:
    """(B, P) the prompt of every row."""
    # long even when empty (a decoder-only LM's prompt is in its memory): (B, 0) then concatenates with ids
    return torch.tensor(model.prompt, dtype=torch.long, device=memory.device).expand(memory.shape[0], -1)


class CachedInference:
    """The model, this batch's mask and KV cache. ``start`` runs the prompt (and the memory, on its first call
    after a reset); ``step`` feeds each row's last token at the cache slot ``t`` + first slot - 1, computed on the
    device, so every step has the same shapes and addresses: it compiles once and a CUDA graph replays it. The
    cache and mask are refilled IN PLACE per batch (``start``), so one object serves many batches of one shape."""

    def __init__(self, model: Seq2SeqDecoder, memory: Tensor, mask: Tensor | None, max_new_tokens: int) -> None:
        self.model, self.prompt = model, _prompts(model, memory)
        self.mask = None if mask is None else torch.empty_like(mask)  # (B, S), filled per batch
        self.cache = model.new_cache(memory, self.prompt.shape[1] + max_new_tokens)
        self.first_slot = 0  # cache slot of generated token 0 (after the prompt and any memory held in the cache)

    def start(self, memory: Tensor, mask: Tensor | None) -> Tensor:
        """A new batch: empty the cache, run the prompt -> logits (B, V) of token 0."""
        if self.mask is not None:
            self.mask.copy_(mask)
        self.cache.reset()
        logits = self.model.logits(self.prompt, memory, self.mask, self.cache)
        self.cache.pin_cross()  # the steps read the cross K/V at fixed addresses
        self.first_slot = self.cache.length
        return logits

    def step(self, tokens: Tensor, t: Tensor) -> Tensor:
        """tokens (B,) = token t-1 of every row -> logits (B, V) of token t."""
        slot = t + (self.first_slot - 1)  # () long on the device: no Python int per token
        return self.model.logits(tokens[:, None], None, self.mask, self.cache, slot)

    def reorder(self, index: Tensor) -> None:
        """Row i continues from row index[i] (beam search)."""
        self.cache.reorder(index)


class FullInference:
    """The reference the cache must match token for token: every step runs the prompt and all tokens chosen so
    far (pad for ended rows) through the model, without a cache."""

    def __init__(self, model: Seq2SeqDecoder, memory: Tensor) -> None:
        self.model, self.prompt = model, _prompts(model, memory)
        self.text, self.memory, self.mask = self.prompt, memory, None  # text (B, P + t)

    def start(self, memory: Tensor, mask: Tensor | None) -> Tensor:
        self.text, self.memory, self.mask = self.prompt, memory, mask
        return self.model.logits(self.text, memory, mask)

    def step(self, tokens: Tensor, t: Tensor) -> Tensor:
        self.text = torch.cat([self.text, tokens[:, None]], 1)
        return self.model.logits(self.text, self.memory, self.mask)


# ----------------------------------------------------------------------------------------------------
# Rules


class MinNewTokens:
    """eos cannot win before ``n`` new tokens (Hugging Face's min_new_tokens)."""

    def __init__(self, eos_id: int, n: int) -> None:
        self.eos_id, self.n = eos_id, n

    def __call__(self, logits: Tensor, tokens: Tensor, t: Tensor) -> Tensor:
        logits[:, self.eos_id] = torch.where(t < self.n, NEG_INF, logits[:, self.eos_id])
        return logits


class SuppressTokens(nn.Module):
    """These ids are never chosen: Whisper's SuppressTokens (its default "-1" set: the non-speech tokens and the
    task / start specials, omni.interop.whisper.suppress_tokens). The ids are a non-persistent buffer: they move
    with the model and stay out of its state dict."""

    def __init__(self, ids: Sequence[int]) -> None:
        super().__init__()
        self.register_buffer("ids", torch.tensor(sorted(set(int(i) for i in ids)), dtype=torch.long), persistent=False)

    def forward(self, logits: Tensor, tokens: Tensor, t: Tensor) -> Tensor:
        return logits.index_fill_(1, self.ids, NEG_INF)


class SuppressAtStart(nn.Module):
    """These ids cannot be the first generated token: Whisper's SuppressBlank (" " and eot at the first sampled
    position, so a transcript neither starts with a blank nor is empty). Fixed shapes, no host sync."""

    def __init__(self, ids: Sequence[int]) -> None:
        super().__init__()
        self.register_buffer("ids", torch.tensor(sorted(set(int(i) for i in ids)), dtype=torch.long), persistent=False)

    def forward(self, logits: Tensor, tokens: Tensor, t: Tensor) -> Tensor:
        logits[:, self.ids] = torch.where(t.reshape(-1, 1) == 0, NEG_INF, logits[:, self.ids])  # t: () or (N,)
        return logits


class TimestampRules:
    """Whisper's timestamp rules (openai-whisper's ApplyTimestampRules), for decoding with timestamp tokens
    (ids ``timestamp_begin`` .. the end of the vocabulary: <|0.00|>, <|0.02|>, ... <|30.00|>):

    * <|notimestamps|> is never chosen;
    * the first token is a timestamp, at most ``max_initial`` steps (Whisper: 50, 1.0 s) past <|0.00|>;
    * timestamps come in pairs (a segment's end, the next one's start), except directly before eos: after a
      pair (or after the first token) text follows, after a lone timestamp a timestamp or eos (no text);
    * timestamps never decrease: at least the last one when it closes a segment, later than it otherwise
      (every segment has a length, so decoding cannot loop on one time);
    * when the timestamps together are more probable than the most probable text token, a timestamp is chosen.

    The history is ``tokens[:, :t]`` (the strategy's chosen tokens; ``t`` (), or (N,) per row: omni.speculative).
    All rules are masks over the batch and the vocabulary built from ``t`` and the history on the device, then one
    data-dependent choice per row (the probability rule) taken with a mask too: fixed shapes and no host sync, so
    the graphed greedy step may carry it. Rows that ended are masked like any other (their choice is ignored)."""

    def __init__(self, timestamp_begin: int, eos_id: int, no_timestamps_id: int | None,
                 max_initial: int | None = 50) -> None:
        if eos_id >= timestamp_begin:
            raise ValueError(f"eos id {eos_id} must come before the timestamp tokens ({timestamp_begin} on)")
        self.timestamp_begin, self.eos_id = timestamp_begin, eos_id
        self.no_timestamps_id, self.max_initial = no_timestamps_id, max_initial

    def pairs(self, vocab: Tensor, last: Tensor, penultimate: Tensor) -> Tensor:
        """(N, V) banned by pairing: no timestamp after two (or after a first one), no text after a lone one."""
        two = (last & penultimate)[:, None] & (vocab >= self.timestamp_begin)
        lone = (last & ~penultimate)[:, None] & (vocab < self.eos_id)  # eos and the specials stay allowed
        return two | lone

    def monotonic(self, vocab: Tensor, tokens: Tensor, history: Tensor, closes: Tensor) -> Tensor:
        """(N, V) banned as earlier than the last timestamp (as early, too, unless it closes a segment)."""
        col = torch.arange(tokens.shape[1], device=tokens.device)
        at = torch.where(history, col, -1).amax(1)  # (N,) column of the latest timestamp, -1: none yet
        latest = tokens.gather(1, at.clamp(min=0)[:, None])[:, 0]  # latest, not largest: any history is handled
        bound = torch.where(closes, latest, latest + 1)
        return (at >= 0)[:, None] & (vocab >= self.timestamp_begin) & (vocab < bound[:, None])

    def start(self, vocab: Tensor, t: Tensor) -> Tensor:
        """(1|N, V) banned at the first token: text, eos and timestamps past ``max_initial``."""
        late = vocab > self.timestamp_begin + self.max_initial if self.max_initial is not None else vocab < 0
        return (t == 0) & ((vocab < self.timestamp_begin) | late)

    def force(self, logits: Tensor) -> Tensor:
        """Rows whose timestamps outweigh every text token (in probability) choose a timestamp."""
        tb = self.timestamp_begin
        logprobs = torch.log_softmax(logits.float(), -1)
        mass = logprobs[:, tb:].logsumexp(-1) > logprobs[:, :tb].amax(-1)
        logits[:, :tb].masked_fill_(mass[:, None], NEG_INF)  # a view: fills logits in place
        return logits

    def __call__(self, logits: Tensor, tokens: Tensor, t: Tensor) -> Tensor:
        N, V, W = logits.shape[0], logits.shape[1], tokens.shape[1]
        vocab, tc, t = torch.arange(V, device=logits.device), t.reshape(-1), t.reshape(-1, 1)  # t: () or (N,) per row
        history = (tokens >= self.timestamp_begin) & (torch.arange(W, device=tokens.device) < t)  # (N, W)

        def back(k: int) -> Tensor:  # (N,) tokens[:, t - k] (column 0 while t < k: masked by the callers)
            return tokens.gather(1, (t - k).clamp(min=0).expand(N, 1))[:, 0]

        last = (tc >= 1) & (back(1) >= self.timestamp_begin)
        penultimate = (tc < 2) | (back(2) >= self.timestamp_begin)  # Whisper counts "no penultimate" as one
        banned = self.pairs(vocab, last, penultimate) | self.monotonic(vocab, tokens, history, last & ~penultimate)
        logits.masked_fill_(banned | self.start(vocab, t), NEG_INF)
        if self.no_timestamps_id is not None:
            logits[:, self.no_timestamps_id] = NEG_INF
        return self.force(logits)


class RepetitionGuard:
    """A row whose tokens end in ``max_repeats`` copies of one block of p <= ``max_period`` tokens is in a loop:
    it ends, keeping the first copy; the shortest period wins ("a a a a" keeps one "a"). Never before
    ``min_length`` tokens, nor cut below them.

    All periods are compared at once from index tables: with W = max_period * max_repeats tail tokens, period p
    (the last p * max_repeats tokens) repeats when tail[j] == tail[j - p] for every j in [W - p * max_repeats + p,
    W). Rows of ``a``/``b`` hold those (j, j - p) pairs per period, padded with (W-1, W-1), which are always equal."""

    def __init__(self, max_period: int, max_repeats: int, min_length: int, device: torch.device) -> None:
        self.max_repeats, self.min_length = max_repeats, min_length
        W, n = max_period * max_repeats, (max_repeats - 1) * max_period
        a = torch.full((max_period, n), W - 1, dtype=torch.long)
        b = a.clone()
        for p in range(1, max_period + 1):
            j = torch.arange(W - p * max_repeats + p, W)
            a[p - 1, :len(j)], b[p - 1, :len(j)] = j, j - p
        self.a, self.b = a.to(device), b.to(device)  # (max_period, n)
        self.period = torch.arange(1, max_period + 1, device=device)
        self.offsets = torch.arange(1 - W, 1, device=device)  # + t: the last W tokens

    def keep(self, tokens: Tensor, t: Tensor | int) -> Tensor:
        """(N,) tokens to keep of rows whose tokens[:, :t+1] end in a loop, else -1 (``t``: one, or (N,) per row)."""
        t = torch.as_tensor(t, device=tokens.device).reshape(-1, 1)  # (1|N, 1)
        tail = tokens.gather(1, (t + self.offsets).clamp(min=0).expand(tokens.shape[0], -1))  # (N, W); clamped: masked
        hit = (tail[:, self.a] == tail[:, self.b]).all(-1) & (t + 1 >= self.period * self.max_repeats)  # (N, periods)
        keep = torch.where(hit, t + 1 - (self.max_repeats - 1) * self.period, -1).amax(-1)  # shortest period
        return torch.where((keep >= 0) & (t[:, 0] >= self.min_length), keep.clamp(min=self.min_length), -1)


@dataclass(frozen=True)
class DecodingOptions:
    """The rules every strategy applies (module docstring)."""

    max_new_tokens: int = 224  # tokens per row at most, eos included
    tokens_per_second: float | None = 25.0  # and at most ceil(this x input seconds) + 8; None: no such cap
    max_period: int = 8  # repetition guard: blocks of up to this many tokens ...
    max_repeats: int | None = 4  # ... repeated this many times end the row; None: no guard
    min_new_tokens: int = 0  # no row ends before this many tokens (eos suppressed, the guard held off)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_repeats is not None and (self.max_repeats < 1 or self.max_period < 1):
            raise ValueError(f"max_repeats and max_period must be >= 1, got {self.max_repeats}, {self.max_period}")

    def limits(self, model: Seq2SeqDecoder, mask: Tensor | None, rows: int, device: torch.device) -> Tensor:
        """(rows,) long: tokens each row may generate."""
        limit = torch.full((rows,), self.max_new_tokens, dtype=torch.long, device=device)
        if self.tokens_per_second is not None and mask is not None:
            seconds = mask.sum(1).float() / model.tokens_per_second
            limit = torch.minimum(limit, (seconds * self.tokens_per_second).ceil().long() + 8)
        return limit.clamp(min=1)

    def filters(self, model: Seq2SeqDecoder) -> list[LogitFilter]:
        """These options' rules, then the model's own (``model.logit_filters``, e.g. a converted Whisper's)."""
        mine = [MinNewTokens(model.eos_id, self.min_new_tokens)] if self.min_new_tokens > 0 else []
        return mine + list(model.logit_filters)

    def guard(self, device: torch.device) -> RepetitionGuard | None:
        if self.max_repeats is None:
            return None
        return RepetitionGuard(self.max_period, self.max_repeats, self.min_new_tokens, device)


# ----------------------------------------------------------------------------------------------------
# Strategies


class Greedy:
    """The most likely token of every row. State on the device in fixed-shape tensors: ``out`` (N, steps) the
    chosen tokens (pad after a row ended), ``length`` (N,) tokens kept, ``done`` (N,); a step never syncs."""

    def __init__(self, rows: int, steps: int, eos_id: int, pad_id: int, guard: RepetitionGuard | None,
                 device: torch.device) -> None:
        self.eos_id, self.pad_id, self.guard = eos_id, pad_id, guard
        self.out = torch.full((rows, steps), pad_id, dtype=torch.long, device=device)
        self.tokens = torch.full((rows,), pad_id, dtype=torch.long, device=device)  # last chosen: the next input
        self.length = torch.zeros(rows, dtype=torch.long, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.limit = torch.zeros(rows, dtype=torch.long, device=device)

    def start(self, limit: Tensor) -> None:
        self.out.fill_(self.pad_id)
        self.limit.copy_(limit)
        self.length.copy_(limit)
        self.done.zero_()

    def update(self, logits: Tensor, t: Tensor) -> None:
        """Choose token ``t`` of every row from logits (N, V); eos, the limit or the guard end a row."""
        done = self.done
        nxt = torch.where(done, self.pad_id, logits.argmax(-1))
        self.out.scatter_(1, t.expand(nxt.shape[0], 1), nxt[:, None])  # out[:, t] = nxt
        ended = ~done & (nxt == self.eos_id)
        length = torch.where(ended, t, self.length)
        if self.guard is not None:
            keep = self.guard.keep(self.out, t)
            loop = ~done & ~ended & (keep >= 0)
            length = torch.where(loop, keep, length)
            ended = ended | loop
        self.done.copy_(done | ended | (t + 1 >= self.limit))
        self.length.copy_(length)
        self.tokens.copy_(nxt)

    def all_done(self) -> bool:
        return bool(self.done.all())

    def result(self) -> list[list[int]]:
        lengths = self.length.tolist()
        return [row[:n] for row, n in zip(self.out.tolist(), lengths)]


class ScoredGreedy(Greedy):
    """``Greedy`` as openai-whisper's ``GreedyDecoder``: the argmax (``temperature`` 0) or a ``Categorical(logits /
    temperature)`` draw (torch's, so the same tokens under the same RNG state), and ``logprob`` (N,): each row's
    summed log-probability (filtered, untempered logits) of its tokens, eos included. Host-free, like Greedy."""

    def __init__(self, rows: int, steps: int, eos_id: int, pad_id: int, device: torch.device,
                 temperature: float = 0.0) -> None:
        super().__init__(rows, steps, eos_id, pad_id, None, device)
        self.temperature = temperature
        self.logprob = torch.zeros(rows, device=device)

    def start(self, limit: Tensor) -> None:
        super().start(limit)
        self.logprob.zero_()

    def update(self, logits: Tensor, t: Tensor) -> None:
        if self.temperature > 0:
            scaled = logits / self.temperature
            # a tiny temperature overflows logits / T (+-inf, nan): softmax((l - max l) / T) is the same
            # distribution, its max 0 and tending to the argmax as T -> 0; whisper's own draw wherever it is finite
            below = logits - logits.amax(-1, keepdim=True)
            shifted = torch.where(below == 0, 0.0, below / self.temperature)  # (0 / a T that rounds to 0: nan)
            overflow = ~scaled.amax(-1, keepdim=True).isfinite()  # amax propagates nan
            choice = torch.distributions.Categorical(logits=torch.where(overflow, shifted, scaled)).sample()
        else:
            choice = logits.argmax(-1)
        logp = logits.float().log_softmax(-1).gather(1, choice[:, None])[:, 0]
        self.logprob.add_(torch.where(self.done, 0.0, logp))
        # Greedy's bookkeeping on a one-hot of the choice (its argmax is the choice)
        super().update(torch.nn.functional.one_hot(choice, logits.shape[-1]).float(), t)


def length_normalised(score: float, length: int, alpha: float) -> float:
    """GNMT length penalty: score / ((5 + length) / 6) ** alpha (alpha 0 = raw log-probability)."""
    return score / (((5.0 + length) / 6.0) ** alpha)


@dataclass(frozen=True)
class GNMTRanker:
    """omni's beam ranking: summed log-probability / ((5 + steps) / 6) ** alpha (steps count the eos); eos
    continuations finish only among an input's K best candidates."""

    alpha: float = 1.0
    eos_until_kept = False

    def score(self, logprob: float, tokens: int, steps: int) -> float:
        return length_normalised(logprob, steps, self.alpha)


@dataclass(frozen=True)
class WhisperRanker:
    """openai-whisper's ``MaximumLikelihoodRanker`` and ``BeamSearchDecoder``: summed log-probability / token count
    (eos excluded; with ``length_penalty``: / ((5 + tokens) / 6) ** it); every eos candidate ranked above the K-th
    continuing one finishes (``eos_until_kept``), best first, up to K. Converted Whispers' default."""

    length_penalty: float | None = None
    eos_until_kept = True

    def score(self, logprob: float, tokens: int, steps: int) -> float:
        if self.length_penalty is None:
            return logprob / tokens if tokens else logprob  # whisper divides by 0 tokens too: -inf/nan; keep it finite
        return logprob / (((5.0 + tokens) / 6.0) ** self.length_penalty)


Ranker = GNMTRanker | WhisperRanker


class BeamSearch:
    """K beams per input (rows b*K .. b*K+K-1). Each step every live input takes its 2K best (beam, token)
    continuations: eos ones among the top K (``GNMTRanker``) or ranked above the K-th continuing one
    (``WhisperRanker``) finish a hypothesis, scored by the ``ranker``; ones the repetition guard stops finish with
    the first copy of the loop, the best K others continue and the cache follows them (``reorder``). An input
    stops once K hypotheses finished or at its token limit (live beams then finish as they are). The choice runs
    on the host (one sync per step); K = 1 is greedy. ``length_penalty`` (a float) is ``GNMTRanker(alpha)``."""

    def __init__(self, inputs: int, beam_size: int, length_penalty: float | Ranker, steps: int, eos_id: int,
                 pad_id: int, guard: RepetitionGuard | None, reorder: Callable[[Tensor], None],
                 device: torch.device) -> None:
        if beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {beam_size}")
        self.ranker = GNMTRanker(float(length_penalty)) if isinstance(length_penalty, (int, float)) else length_penalty
        self.B, self.K = inputs, beam_size
        self.eos_id, self.pad_id, self.guard, self.reorder = eos_id, pad_id, guard, reorder
        self.out = torch.full((inputs * beam_size, steps), pad_id, dtype=torch.long, device=device)  # live beams
        self.tokens = torch.full((inputs * beam_size,), pad_id, dtype=torch.long, device=device)
        self.scores = torch.full((inputs, beam_size), NEG_INF, device=device)  # (B, K) summed log-probabilities
        self.scores[:, 0] = 0.0  # all beams start identical: expand from one only
        self.hypotheses: list[list[tuple[float, list[int]]]] = [[] for _ in range(inputs)]
        self.live = [True] * inputs
        self.limit: list[int] = []

    def start(self, limit: Tensor) -> None:
        self.limit = limit.tolist()  # per input

    def update(self, logits: Tensor, clock: Tensor) -> None:
        """Choose the beams' token ``clock`` from logits (B*K, V); finished hypotheses leave, the cache follows."""
        t, B, K, V = int(clock), self.B, self.K, logits.shape[-1]
        logp = logits.float().log_softmax(-1).view(B, K, V)
        top_s, top_i = (self.scores[..., None] + logp).view(B, K * V).topk(min(2 * K, K * V), dim=-1)  # (B, C)
        C = top_s.shape[1]
        # candidate c of input b: the tokens of its source beam + the new one, row b*C + c of `cand`
        cand = self.out.index_select(0, (top_i // V + K * torch.arange(B, device=logits.device)[:, None]).flatten())
        cand[:, t] = (top_i % V).flatten()
        keep = self.guard.keep(cand, t).view(B, C).tolist() if self.guard is not None else [[-1] * C] * B
        top_s, top_i = top_s.tolist(), top_i.tolist()
        source = [b * K for b in range(B) for _ in range(K)]  # rows of ended inputs: never read again
        tokens, scores = [self.pad_id] * (B * K), [[NEG_INF] * K for _ in range(B)]
        for b in range(B):
            if not self.live[b]:
                continue
            chosen: list[int] = []  # candidates that continue, in beam order
            for c, (s, i) in enumerate(zip(top_s[b], top_i[b])):
                if s == NEG_INF:
                    break
                k, v = divmod(i, V)
                if v == self.eos_id:
                    # whisper: at most K finished, the best first (candidates come sorted)
                    if len(self.hypotheses[b]) < K if self.ranker.eos_until_kept else c < K:
                        self._finish(b, s, t + 1, cand[b * C + c, :t])
                    continue
                if keep[b][c] >= 0:  # a repetition loop: finish with the first copy only
                    self._finish(b, s, t + 1, cand[b * C + c, :keep[b][c]])
                    continue
                n = len(chosen)
                source[b * K + n], tokens[b * K + n], scores[b][n] = b * K + k, v, s
                chosen.append(c)
                if len(chosen) == K:
                    break
            if len(self.hypotheses[b]) >= K or t + 1 >= self.limit[b]:
                if len(self.hypotheses[b]) < K:  # token limit: live beams finish as they are
                    for n, c in enumerate(chosen):
                        if self.ranker.eos_until_kept and len(self.hypotheses[b]) >= K:  # whisper's: up to K
                            break
                        self._finish(b, scores[b][n], t + 1, cand[b * C + c, :t + 1])
                self.live[b] = False
        if self.all_done():
            return
        index = torch.tensor(source, device=logits.device)
        self.out.copy_(self.out.index_select(0, index))
        self.tokens.copy_(torch.tensor(tokens))
        self.out[:, t] = self.tokens
        self.scores = torch.tensor(scores, device=logits.device)
        self.reorder(index)

    def _finish(self, b: int, score: float, steps: int, tokens: Tensor) -> None:
        self.hypotheses[b].append((self.ranker.score(score, tokens.shape[0], steps), tokens.tolist(), score))

    def all_done(self) -> bool:
        return not any(self.live)

    def result(self) -> list[list[int]]:
        return [tokens for tokens, _ in self.scored()]

    def scored(self) -> list[tuple[list[int], float]]:
        """The best hypothesis of every input and its summed log-probability (first of equals, as whisper)."""
        best = [max(h, key=lambda x: x[0]) if h else (0.0, [], NEG_INF) for h in self.hypotheses]
        return [(tokens, logprob) for _, tokens, logprob in best]


# ----------------------------------------------------------------------------------------------------
# The loop


class Decoding:
    """One batch's decoding: an inference, the logit filters and a strategy over one clock ``t`` (a () long
    device tensor: the index of the token being chosen)."""

    def __init__(self, inference: CachedInference | FullInference, strategy: Greedy | BeamSearch,
                 filters: list[LogitFilter], device: torch.device) -> None:
        self.inference, self.strategy, self.filters = inference, strategy, filters
        self.t = torch.zeros((), dtype=torch.long, device=device)

    def start(self, memory: Tensor, mask: Tensor | None, limit: Tensor) -> None:
        """A new batch: reset the strategy, run the prompt and choose token 0."""
        self.t.zero_()
        self.strategy.start(limit)
        self.choose(self.inference.start(memory, mask))

    def step(self) -> None:
        """Token t: the last chosen tokens through the model -> filters -> choice. Fixed shapes and no host sync
        with CachedInference and Greedy: run eagerly, or captured once and replayed."""
        self.choose(self.inference.step(self.strategy.tokens, self.t))

    def choose(self, logits: Tensor) -> None:
        for rule in self.filters:
            logits = rule(logits, self.strategy.out, self.t)
        self.strategy.update(logits, self.t)
        self.t.add_(1)

    def run(self, steps: int, check_every: int = 1, step: Callable[[], None] | None = None) -> list[list[int]]:
        """Tokens 1 .. steps-1 by ``step`` (default ``self.step``; a graph's replay), after ``start``. Whether every
        row is done is read on the host every ``check_every`` tokens; steps after a row ended change nothing of
        it, so the result does not depend on ``check_every``."""
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        step = step or self.step
        for t in range(1, steps):
            if t % check_every == 0 and self.strategy.all_done():
                break
            step()
        return self.strategy.result()


def _greedy(model: Seq2SeqDecoder, memory: Tensor, mask: Tensor | None, options: DecodingOptions, steps: int,
            use_cache: bool = True) -> Decoding:
    """A greedy Decoding for batches shaped like this one, room for ``steps`` tokens."""
    B, dev = memory.shape[0], memory.device
    inference = CachedInference(model, memory, mask, steps) if use_cache else FullInference(model, memory)
    strategy = Greedy(B, steps, model.eos_id, model.pad_id, options.guard(dev), dev)
    return Decoding(inference, strategy, options.filters(model), dev)


@torch.no_grad()
def greedy_decode(model: Seq2SeqDecoder, memory: Tensor, mask: Tensor | None = None, *,
                  max_new_tokens: int = 224, tokens_per_second: float | None = 25.0, max_period: int = 8,
                  max_repeats: int | None = 4, min_new_tokens: int = 0, use_cache: bool = True,
                  check_every: int = 1, graph: bool = False) -> list[list[int]]:
    """Batched greedy decoding. memory (B, S, ...) from ``model.encode``, mask (B, S) True = real; returns the
    generated ids of each row (prompt and eos excluded). The options are ``DecodingOptions``'s; ``min_new_tokens``
    is Hugging Face's option of that name (benchmarks use it for a fixed token count). ``use_cache=False``
    recomputes the whole text every step (the reference the cached path must match token for token).
    ``check_every``: steps between host syncs that stop once every row is done (larger = fewer syncs on GPU,
    identical output).

    ``graph=True`` decodes with a one-off ``GraphedGreedyDecoder`` (one CUDA graph replayed per token on CUDA,
    the same step run eagerly elsewhere), same tokens; ``check_every`` is then at least 16. To decode many batches
    of one shape, build a ``GraphedGreedyDecoder`` once and call it per batch."""
    options = DecodingOptions(max_new_tokens, tokens_per_second, max_period, max_repeats, min_new_tokens)
    # The cache holds exactly as many slots as this batch needs (the attention shapes of either path).
    limit = options.limits(model, mask, memory.shape[0], memory.device)
    steps = int(limit.max())
    if graph:
        if not use_cache:
            raise ValueError("graph=True decodes with the static KV cache; it cannot be combined with use_cache=False")
        one_off = GraphedGreedyDecoder(model, max_new_tokens=steps, tokens_per_second=tokens_per_second,
                                       max_period=max_period, max_repeats=max_repeats,
                                       min_new_tokens=min_new_tokens, check_every=max(check_every, 16))
        return one_off(memory, mask)
    decoding = _greedy(model, memory, mask, options, steps, use_cache)
    decoding.start(memory, mask, limit)
    return decoding.run(steps, check_every)


@torch.no_grad()
def beam_search(model: Seq2SeqDecoder, memory: Tensor, mask: Tensor | None = None, *,
                beam_size: int = 4, length_penalty: float | Ranker | None = None, max_new_tokens: int = 224,
                tokens_per_second: float | None = 25.0, max_period: int = 8,
                max_repeats: int | None = 4) -> list[list[int]]:
    """Batched beam search (``BeamSearch``) with the KV cache: the beams of an input share its cross K/V, the
    self-attention cache is reordered by beam each step. Options as ``greedy_decode``; beam_size=1 is greedy.
    ``length_penalty``: a ranker (``GNMTRanker``, ``WhisperRanker``), a float (GNMT's alpha), or None: the model's
    own (``model.ranker``: a converted Whisper's ``WhisperRanker``), else ``GNMTRanker(1.0)``."""
    if length_penalty is None:
        length_penalty = getattr(model, "ranker", None) or GNMTRanker(1.0)
    options = DecodingOptions(max_new_tokens, tokens_per_second, max_period, max_repeats)
    B, K, dev = memory.shape[0], beam_size, memory.device
    limit = options.limits(model, mask, B, dev)
    steps = int(limit.max())
    memory = memory.repeat_interleave(K, 0)  # (B*K, S, ...)
    mask = None if mask is None else mask.repeat_interleave(K, 0)
    inference = CachedInference(model, memory, mask, steps)
    strategy = BeamSearch(B, K, length_penalty, steps, model.eos_id, model.pad_id, options.guard(dev),
                          inference.reorder, dev)
    decoding = Decoding(inference, strategy, options.filters(model), dev)
    decoding.start(memory, mask, limit)
    return decoding.run(steps)


@torch.no_grad()
def decode_scored(model: Seq2SeqDecoder, memory: Tensor, mask: Tensor | None = None, *, max_new_tokens: int = 224,
                  temperature: float = 0.0, beam_size: int = 1, ranker: Ranker | None = None
                  ) -> list[tuple[list[int], float]]:
    """openai-whisper's ``DecodingTask`` strategies without its guards: greedy or sampling at ``temperature``
    (``ScoredGreedy``), or beam search (``beam_size`` > 1 at temperature 0, ``ranker`` default the model's) ->
    every row's tokens (prompt and eos excluded) and summed log-probability (eos included)."""
    options = DecodingOptions(max_new_tokens, None, max_repeats=None)
    B, dev = memory.shape[0], memory.device
    limit = options.limits(model, mask, B, dev)
    steps = int(limit.max())
    beams = beam_size > 1 and temperature == 0
    if beams:
        memory = memory.repeat_interleave(beam_size, 0)
        mask = None if mask is None else mask.repeat_interleave(beam_size, 0)
    inference = CachedInference(model, memory, mask, steps)
    strategy = (BeamSearch(B, beam_size, ranker or getattr(model, "ranker", None) or GNMTRanker(1.0), steps,
                           model.eos_id, model.pad_id, None, inference.reorder, dev) if beams
                else ScoredGreedy(B, steps, model.eos_id, model.pad_id, dev, temperature))
    decoding = Decoding(inference, strategy, options.filters(model), dev)
    decoding.start(memory, mask, limit)
    ids = decoding.run(steps)
    return strategy.scored() if isinstance(strategy, BeamSearch) else list(zip(ids, strategy.logprob.tolist()))


# ----------------------------------------------------------------------------------------------------
# One step captured in a CUDA graph, replayed per token


class GraphedGreedyDecoder:
    """Greedy decoding with the rules and tokens of ``greedy_decode``, reusing one fixed-shape ``Decoding``
    (CachedInference + Greedy: no host sync, no Python state per token) so that on CUDA its step is captured once
    in a ``torch.cuda.CUDAGraph`` and each token is a single ``replay()``. Whether every row has finished is read
    on the host only every ``check_every`` tokens.

    The object owns the static buffers and the graph and is reused across batches of ONE shape: the first call
    fixes batch size, memory length, dtype, device and whether a mask is given (capturing the graph then); a call
    with another shape raises. ``max_new_tokens`` sizes the cache.

    graph:   capture and replay a CUDA graph (default: when ``memory`` is on CUDA and the decoder has no attention
             patterns, whose ring KV cache syncs with the host). Off, the same step runs
             eagerly (CPU, tests). Graph replay launches the kernels eager mode launches, so the tokens are
             identical to ``greedy_decode``'s given the same cache size (as ``greedy_decode(graph=True)`` builds it).
    compile: ``torch.compile`` the step before capture (fuses the many small kernels of a one-token step).
             Compiled kernels round differently from eager ones, so on near-ties a token may differ from
             ``greedy_decode``, as with any compiled model. Each decoder compiles its own step (meant for long-lived
             decoders; past torch._dynamo's cache_size_limit per process, steps run uncompiled).
    Inference dtype: run the model in its serving dtype (``model.to(torch.bfloat16)``); under autocast the capture
    disables autocast's weight-cast cache (a graph cannot hold it), so casts are replayed."""

    def __init__(self, model: Seq2SeqDecoder, *, max_new_tokens: int = 224,
                 tokens_per_second: float | None = 25.0, max_period: int = 8, max_repeats: int | None = 4,
                 min_new_tokens: int = 0, check_every: int = 16, graph: bool | None = None,
                 compile: bool = False) -> None:
        self.model = model
        self.options = DecodingOptions(max_new_tokens, tokens_per_second, max_period, max_repeats, min_new_tokens)
        self.check_every, self.graph, self.compile = check_every, graph, compile
        self._shape: tuple | None = None  # (B, S, memory dtype, device, masked) fixed by the first call
        self._decoding: Decoding | None = None
        self._step: Callable[[], None] | None = None
        self._graph: torch.cuda.CUDAGraph | None = None

    def _prepare(self, memory: Tensor, mask: Tensor | None) -> None:
        """Allocate the static state on the first call; later calls must have its shape."""
        got = (memory.shape[0], memory.shape[1], memory.dtype, memory.device, mask is not None)
        if self._shape is None:
            self._shape = got
            self._decoding = _greedy(self.model, memory, mask, self.options, self.options.max_new_tokens)
            step = self._decoding.step
            self._step = torch.compile(step, fullgraph=True, dynamic=False) if self.compile else step
        if got != self._shape:
            raise ValueError(f"this GraphedGreedyDecoder was built for (batch, memory length, dtype, device, "
                             f"masked) = {self._shape}, got {got}: build one decoder per batch shape")

    def _capture(self) -> None:
        """Warm up (compile, cuBLAS handles, autotuning), then capture one step; both leave state to reset."""
        decoding, device = self._decoding, self._shape[3]

        def warm_step() -> None:
            decoding.t.fill_(1)  # every warm-up step writes the same in-range slot
            self._step()

        warm_up(warm_step, 3, device)
        decoding.t.fill_(1)
        self._graph, _ = capture(self._step, device, "the decoding step")

    @torch.no_grad()
    def __call__(self, memory: Tensor, mask: Tensor | None = None) -> list[list[int]]:
        """memory (B, S, ...) from ``model.encode`` (+ its mask) -> generated ids per row, as greedy_decode."""
        self._prepare(memory, mask)
        ring = getattr(getattr(self.model, "decoder", None), "schedule", None)
        ring = ring is not None and ring.sparse  # a ring KV cache's bookkeeping syncs with the host per step
        graph = memory.is_cuda and not ring if self.graph is None else self.graph
        if graph and not memory.is_cuda:
            raise ValueError("graph=True needs CUDA tensors; use graph=False to run the step eagerly")
        if graph and ring:
            raise ValueError("graph=True: this decoder has attention patterns, whose ring KV cache is not CUDA-graphed; "
                             "use graph=False (the same step, eager)")
        limit = self.options.limits(self.model, mask, memory.shape[0], memory.device)
        self._decoding.start(memory, mask, limit)
        if graph and self._graph is None and self.options.max_new_tokens > 1:
            self._capture()
            self._decoding.start(memory, mask, limit)  # warm-up and capture changed the state: start again
        replay = self._graph.replay if graph and self._graph is not None else self._step
        return self._decoding.run(int(limit.max()), self.check_every, replay)


__all__ = ["BeamSearch", "CachedInference", "Decoding", "DecodingOptions", "FullInference", "GNMTRanker",
           "GraphedGreedyDecoder", "Greedy", "MinNewTokens", "Ranker", "RepetitionGuard", "ScoredGreedy",
           "SuppressAtStart", "SuppressTokens", "TimestampRules", "WhisperRanker", "beam_search", "decode_scored",
           "greedy_decode", "length_normalised"]
