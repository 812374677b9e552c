"""Text generation with decoder-only language models, through omni.decoding's one loop.

    lm = TextLM(model, "text", tokenizer)                      # an OmniModel with a text tokenizer and an LM head
    ids = generate_ids(lm, [lm.encode("Hello")], max_new_tokens=20, temperature=0.8, top_k=40, seed=0)

(From an export directory, and as text: omni.pipelines.generate's ``load_lm`` and ``generate``, ``omni generate``.)

The pieces:

    TextLM      an omni.interfaces.CausalLM over an OmniModel: text embedder -> trunk -> the LM head, the way
                omni.tasks.LMTask trains it (a converted GPT-2, omni.interop.gpt2, or a model trained by omni)
    PromptedLM  any CausalLM as the omni.interfaces.Seq2SeqDecoder omni.decoding decodes: its memory is the
                right-padded prompt ids (B, S) with their mask, written into the KV cache by the first call (pad
                slots marked, so no token sees them); token 0 is read at each row's last real prompt token and
                row b continues at position n_b (its prompt length), as a left-padded Hugging Face batch does.
                Without a cache every step runs each row's prompt + tokens so far whole: the reference.
    Sampler     a LogitFilter: temperature, top-k, then the Gumbel-max trick (the argmax of logits / T - log E,
                E ~ Exp(1), is a sample of softmax(logits / T)), so the Greedy strategy's argmax samples, with
                fixed shapes and no host sync. Below T = 1 it takes the same argmax as logits - T log E, which
                stays finite as T -> 0 and becomes greedy (logits / 1e-39 overflowed: every row tied at inf).

Greedy generation (the default) equals Hugging Face's ``generate(do_sample=False)`` token for token: a row ends at
eos or after ``max_new_tokens``, and, unlike transcription, no repetition guard stops it. Returned ids exclude
the prompt and eos.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import torch
from torch import Tensor, nn

from omni.decoding import CachedInference, Decoding, DecodingOptions, FullInference, Greedy
from omni.interfaces import CausalLM
from omni.model import OmniModel
from omni.speculative import Drafter, DraftModel, DraftStats, PromptLookup, speculative_decode
from omni.tokenizers.text import TextTokenizer
from omni.trunk import KVCache

NEG_INF = float("-inf")


class TextLM:
    """An OmniModel's text LM (``omni.interfaces.CausalLM``): ``model.embedders["text"]`` -> trunk ->
    ``model.heads[head]``; ``tokenizer`` encodes prompts and decodes continuations."""

    def __init__(self, model: OmniModel, head: str, tokenizer: TextTokenizer) -> None:
        if "text" not in model.embedders:
            raise ValueError(f"the model has no text embedder (modalities: {', '.join(model.embedders)})")
        if head not in model.heads:
            raise ValueError(f"the model has no head {head!r} (heads: {', '.join(model.heads)})")
        self.omni, self.tokenizer = model, tokenizer
        self.lm_head = model.heads[head]
        self.eos_id, self.pad_id = tokenizer.eos_id, tokenizer.pad_id
        cfg = model.trunk_config
        self.max_positions = cfg.max_positions if cfg.positions in ("learned", "learned_1d") else None

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.omni.parameters(recurse)

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        return self.omni.trunk.new_cache(batch_size, max_length)

    def features(self, ids: Tensor, positions: Tensor, cache: KVCache | None = None, pad: Tensor | None = None,
                 cache_position: Tensor | None = None) -> Tensor:
        x = self.omni.embedders["text"](ids)  # (B, T, d)
        mask = "causal" if cache is None else None  # with a cache: causal among the new tokens
        return self.omni.trunk(x, positions, mask, cache=cache, pad=pad, cache_position=cache_position)

    def head(self, features: Tensor) -> Tensor:
        return self.lm_head(features)

    def encode(self, text: str) -> list[int]:
        """A prompt's ids: the text as training encodes a document, without its eos (the continuation goes
        there). An empty prompt starts a document: [bos] (GPT-2's unconditional samples start at <|endoftext|>)."""
        tok = self.tokenizer
        if not text:
            return [tok.bos_id]
        ids = tok.encode(text, key="prompt").tokens.tolist()
        return ids[:-1] if tok.add_eos else ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))


class PromptedLM:
    """A CausalLM as an ``omni.interfaces.Seq2SeqDecoder`` whose memory is the prompt (module docstring)."""

    prompt: list[int] = []  # the common prompt: none, every row's own is in the memory
    tokens_per_second = 1.0  # no time scale: generation gives DecodingOptions tokens_per_second=None
    logit_filters: tuple = ()  # HF generate(do_sample=False) has no rules; sampling is a filter in the options

    def __init__(self, lm: CausalLM) -> None:
        self.lm = lm
        self.eos_id, self.pad_id = lm.eos_id, lm.pad_id

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.lm.parameters(recurse)

    def encode(self, ids: Tensor, mask: Tensor | None = None) -> Tensor:
        """The memory is the prompt ids themselves: the model reads them in ``logits``."""
        return ids

    def new_cache(self, memory: Tensor, max_length: int) -> KVCache:
        """Room for the S prompt slots plus ``max_length`` generated tokens."""
        return self.lm.new_cache(memory.shape[0], memory.shape[1] + max_length)

    def logits(self, text: Tensor, memory: Tensor | None, mask: Tensor | None, cache: KVCache | None = None,
               cache_position: Tensor | None = None) -> Tensor:
        """Next-token logits (B, V) after the prompt (on the first call: ``memory`` (B, S), ``mask`` (B, S) True =
        real, right-padded) and ``text`` (B, T) generated so far."""
        if cache is None:
            return self._whole(text, memory, mask)
        B, T = text.shape
        dev = text.device
        if memory is not None:  # first call: the prompts into the empty cache
            if cache.length != 0:
                raise ValueError("the prompt goes into an empty cache")
            S = memory.shape[1]
            pad = None if mask is None else ~mask
            hidden = self.lm.features(memory, torch.arange(S, device=dev).expand(B, S), cache, pad)
            if T == 0:
                n = torch.full((B,), S, device=dev) if mask is None else mask.sum(1)
                return self.lm.head(hidden[torch.arange(B, device=dev), n - 1])  # each row's last real token
        return self.head(self.decode_hidden(text, None, None, cache, cache_position)[:, -1])

    def decode_hidden(self, text: Tensor, memory: Tensor | None, mask: Tensor | None, cache: KVCache | None = None,
                      cache_position: Tensor | None = None) -> Tensor:
        """Hidden states (B, T, d) of ``text`` appended to a cache that holds the prompt (``logits``' first call):
        every position's, which omni.speculative verifies drafts with. Row b continues at its real token count."""
        if cache is None or memory is not None:
            raise ValueError("decode_hidden appends to a cache that already holds the prompt (memory=None)")
        positions = cache.real_tokens()[:, None] + torch.arange(text.shape[1], device=text.device)  # (B, T)
        return self.lm.features(text, positions, cache, cache_position=cache_position)

    def head(self, hidden: Tensor) -> Tensor:
        return self.lm.head(hidden)

    def _whole(self, text: Tensor, memory: Tensor, mask: Tensor | None) -> Tensor:
        """The reference: each row's real prompt + ``text`` run whole, without a cache or padding."""
        rows = []
        for b in range(text.shape[0]):
            n = memory.shape[1] if mask is None else int(mask[b].sum())
            ids = torch.cat([memory[b, :n], text[b]])[None]  # (1, n + T)
            rows.append(self.lm.features(ids, torch.arange(ids.shape[1], device=ids.device)[None])[0, -1])
        return self.lm.head(torch.stack(rows))


class Sampler:
    """A LogitFilter that turns greedy choice into sampling from softmax(logits / temperature), restricted to the
    ``top_k`` most likely tokens when given (Gumbel-max: module docstring). ``seed`` makes the draws repeatable."""

    def __init__(self, temperature: float, top_k: int | None = None, seed: int | None = None) -> None:
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0 to sample, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.temperature, self.top_k, self.seed = temperature, top_k, seed
        self.generator: torch.Generator | None = None  # made on the logits' device at the first call

    def __call__(self, logits: Tensor, tokens: Tensor, t: Tensor) -> Tensor:
        if self.generator is None:
            self.generator = torch.Generator(device=logits.device)
            if self.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.seed)
        logits = logits.float()
        if self.top_k is not None and self.top_k < logits.shape[-1]:  # dividing by T > 0 keeps the order
            kth = logits.topk(self.top_k, dim=-1).values[:, -1:]  # (N, 1)
            logits = logits.masked_fill(logits < kth, NEG_INF)
        race = torch.empty_like(logits).exponential_(generator=self.generator).log()  # log E, E ~ Exp(1) per token
        # argmax(logits / T - log E) == argmax(logits - T log E) for T > 0: the first form stays finite for a
        # large T, the second for a small one (and tends to the greedy argmax as T -> 0)
        if self.temperature >= 1.0:
            return logits / self.temperature - race
        return logits - self.temperature * race


@torch.no_grad()
def generate_ids(lm: CausalLM, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
                 temperature: float = 0.0, top_k: int | None = None, seed: int | None = None,
                 min_new_tokens: int = 0, use_cache: bool = True, draft: Drafter | CausalLM | str | None = None,
                 draft_tokens: int = 4, stats: DraftStats | None = None) -> list[list[int]]:
    """The generated ids of every prompt (ids, each at least one), prompt and eos excluded. ``temperature`` 0 is
    greedy (``top_k`` and ``seed`` then have nothing to do and are refused); > 0 samples (``Sampler``).
    ``use_cache=False`` recomputes every row whole each step (the reference the cached path matches).
    ``draft``: speculative greedy decoding (omni.speculative; the same tokens in fewer sequential passes) with a
    ``Drafter``, "ngram" (prompt lookup) or a smaller CausalLM sharing the vocabulary (``DraftModel``),
    ``draft_tokens`` proposed per pass, ``stats`` a ``DraftStats`` to fill.
    The model runs in the mode it is in (``load_lm`` returns it in eval mode)."""
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt has no tokens: give at least one id (e.g. the tokenizer's bos)")
    if not math.isfinite(temperature) or temperature < 0 or (temperature == 0 and (top_k is not None or
                                                                                  seed is not None)):
        raise ValueError(f"temperature {temperature}: 0 is greedy (no top_k or seed), a finite number > 0 samples")
    longest = max(len(p) for p in prompts)
    options = DecodingOptions(max_new_tokens, tokens_per_second=None, max_repeats=None, min_new_tokens=min_new_tokens)
    # the last new token is never fed back, so the model reads at most longest + max_new_tokens - 1 positions
    if lm.max_positions is not None and longest + max_new_tokens - 1 > lm.max_positions:
        raise ValueError(f"a prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the model's "
                         f"{lm.max_positions} positions")
    device = next(lm.parameters()).device
    B = len(prompts)
    ids = torch.full((B, longest), lm.pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(B, longest, dtype=torch.bool, device=device)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        mask[b, :len(p)] = True
    model = PromptedLM(lm)
    if draft is not None:
        if temperature > 0 or not use_cache:
            raise ValueError("draft decoding is greedy through the KV cache: not with temperature > 0 or "
                             "use_cache=False")
        if draft == "ngram":
            drafter: Drafter = PromptLookup(prompts)
        elif isinstance(draft, Drafter):
            drafter = draft
        elif callable(getattr(draft, "features", None)):  # a smaller CausalLM (TextLM) sharing the vocabulary
            drafter = DraftModel(PromptedLM(draft), ids, mask)
        else:
            raise ValueError(f"draft must be 'ngram', a Drafter (omni.speculative) or a CausalLM, got {draft!r}")
        return speculative_decode(model, ids, mask, drafter=drafter, draft_tokens=draft_tokens, stats=stats,
                                  max_new_tokens=max_new_tokens, tokens_per_second=None, max_repeats=None,
                                  min_new_tokens=min_new_tokens)
    inference = CachedInference(model, ids, mask, max_new_tokens) if use_cache else FullInference(model, ids)
    strategy = Greedy(B, max_new_tokens, model.eos_id, model.pad_id, None, device)
    filters = options.filters(model) + ([Sampler(temperature, top_k, seed)] if temperature > 0 else [])
    decoding = Decoding(inference, strategy, filters, device)
    decoding.start(ids, mask, options.limits(model, mask, B, device))
    return decoding.run(max_new_tokens)


__all__ = ["PromptedLM", "Sampler", "TextLM", "generate_ids"]
