"""The interfaces that decoding and rollouts drive, declared once (``typing.Protocol``: structural, nothing to
inherit). A model satisfies one by having the members; ``isinstance`` checks their presence only.

    Seq2SeqDecoder  what omni.decoding decodes: memory -> next-token logits, incrementally through a KV cache
                    (omni.speech.SpeechRecognizer, omni.prefix_lm.PrefixLMTranscriber)
    CausalLM        a decoder-only language model: ids -> hidden states -> next-token logits, through a KV cache
                    (omni.generate.TextLM); omni.generate.PromptedLM decodes one as a Seq2SeqDecoder whose memory
                    is the prompt
    LogitFilter     one decoding rule applied to the logits before a token is chosen (omni.decoding)
    Policy          what omni.rl.rollout steps: trajectory tokens -> action head output
                    (omni.rl.DecisionTransformer, omni.multitask.TrajectoryPolicy)

Shapes: B rows, S memory tokens, T text tokens, V vocabulary, d model width, F trajectory features.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor, nn

from omni.trunk import KVCache


@runtime_checkable
class Seq2SeqDecoder(Protocol):
    """A model decoded token by token from a memory (omni.decoding)."""

    eos_id: int  # ends a row
    pad_id: int  # fills a row after it ended
    tokens_per_second: float  # memory tokens per second of input: token limits scale with the input's duration
    logit_filters: Sequence[LogitFilter]  # the model's own decoding rules (a converted Whisper's), run by every strategy

    @property
    def prompt(self) -> list[int]:
        """The ids every output starts with (given, never returned)."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The weights (their device is where inputs go)."""
        ...

    def encode(self, inputs: Tensor, mask: Tensor | None = None) -> Tensor:
        """inputs (B, S, ...) + mask (B, S) True = real -> memory (B, S, ...), what the decoder reads."""
        ...

    def new_cache(self, memory: Tensor, max_length: int) -> KVCache:
        """An empty cache for this batch's memory with room for ``max_length`` text tokens."""
        ...

    def logits(self, text: Tensor, memory: Tensor | None, mask: Tensor | None, cache: KVCache | None = None,
               cache_position: Tensor | None = None) -> Tensor:
        """Next-token logits (B, V) after text (B, T). Without a cache, ``text`` is the whole text so far. With
        one, the text is appended to it and ``memory`` is needed on the first call only (after ``reset``);
        ``cache_position``: the cache slot of text[:, 0] as a () long device tensor (fixed-shape steps: no
        Python int per token), else the text follows what the cache holds."""
        ...


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model (omni.generate): every token sees the tokens before it and itself."""

    eos_id: int  # ends a generated row
    pad_id: int  # fills prompts to one length (never attended to)
    max_positions: int | None  # positions the model has (a learned table), None: unbounded (RoPE, none)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The weights (their device is where inputs go)."""
        ...

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        """An empty cache with room for ``max_length`` tokens per row."""
        ...

    def features(self, ids: Tensor, positions: Tensor, cache: KVCache | None = None, pad: Tensor | None = None,
                 cache_position: Tensor | None = None) -> Tensor:
        """ids (B, T) at positions (B, T) -> hidden states (B, T, d), causal. With a cache the tokens are appended
        to it (``pad`` (B, T) marks tokens no later token sees; ``cache_position``: the slot of ids[:, 0] as a ()
        long device tensor, else after what the cache holds); without one, ids is the whole sequence."""
        ...

    def head(self, features: Tensor) -> Tensor:
        """Hidden states (..., d) -> next-token logits (..., V)."""
        ...


class LogitFilter(Protocol):
    """A decoding rule on the logits before the choice (omni.decoding: MinNewTokens, SuppressTokens,
    SuppressAtStart, TimestampRules, the sampler's temperature / top-k)."""

    def __call__(self, logits: Tensor, tokens: Tensor, t: Tensor) -> Tensor:
        """logits (N, V) for token ``t`` (a () long device tensor, or (N,) per row: omni.speculative verifies rows
        at different positions) of rows whose tokens so far are tokens[:, :t]
        (N, max_new_tokens) -> the logits to choose from (may be changed in place). Fixed shapes, no host sync."""
        ...


class Policy(Protocol):
    """A trajectory model: tokens (B, T, F) -> action head output (B, T, n_out) at every token, causal. With a
    cache the tokens are appended to it (positions continue after the cached ones)."""

    use_returns: bool  # fed return-to-go rows (Decision Transformer), or only (state, action) rows (BC)
    training: bool

    def __call__(self, tokens: Tensor, cache: KVCache | None = None) -> Tensor: ...

    def new_cache(self, batch_size: int, device: torch.device | str | None = None) -> KVCache:
        """An empty cache holding one full context window."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...


__all__ = ["CausalLM", "LogitFilter", "Policy", "Seq2SeqDecoder"]
