"""The prefix-LM transcriber: a multitask OmniModel's transcribe head as an ``omni.interfaces.Seq2SeqDecoder``, so
the model that reads [audio, <bos><|transcribe|> text] in one packed document is decoded by ``omni.decoding``
as recipes/whisper.py's encoder-decoder is. A model-level module: the task (omni.tasks.transcribe) and the
pipelines (omni transcribe, word timing) use it; it imports neither."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch
from torch import Tensor, nn

from omni.model import OmniModel
from omni.packing import Packer
from omni.segment import Sample, Segment
from omni.tokenizers.base import Tokenizer
from omni.tokenizers.text import TextTokenizer
from omni.trunk import KVCache

if TYPE_CHECKING:
    from omni.tasks.transcribe import TranscribeTask


class PrefixLMTranscriber:
    """A transcribe head of a multitask OmniModel as an ``omni.interfaces.Seq2SeqDecoder``, so the prefix-LM model
    is decoded by the very code, stop rules and guards that score recipes/whisper.py (``omni.decoding``).
    ``head``: the task's LM head in ``model.heads``; ``audio``/``text``: the export's tokenizers.

    Layout, as in training (one packed document): [audio frames (bidirectional), bos, <|transcribe|>,
    generated ... (causal)], audio positions 0..n-1 and text positions from n on, n = that clip's real
    frames (the packer's rule). ``memory`` is the right-padded audio TOKENS (B, S, F) with ``audio_mask``:
    the trunk itself runs in ``decode_hidden``.

    With a KV cache (S audio slots + the text's) the first call writes the audio in one bidirectional forward
    (mask "full"; padded frames marked ``pad``, so no token ever sees them) and then the prompt; every later
    call appends one token per row, at position n_b + its text index = the real tokens the cache holds for that
    row, at the next slot or at ``cache_position`` (fixed-shape steps: ``omni.decoding.GraphedGreedyDecoder``).
    Without a cache every call packs [audio_b, text so far] per clip with the training ``Packer`` and runs the
    whole packed forward: the reference the cached path must match token for token (tests/test_multimodal.py).
    """

    def __init__(self, model: OmniModel, head: str, audio: Tokenizer, text: TextTokenizer,
                 task_token: str = "transcribe") -> None:
        self.omni, self.audio, self.text = model, audio, text
        self.head = model.heads[head]
        self.prompt = [text.bos_id, text.token_id(task_token)]
        self.eos_id, self.pad_id = text.eos_id, text.pad_id
        self.tokens_per_second = audio.tokens_per_second
        self.logit_filters: list = []  # omni's own prefix-LM decodes with DecodingOptions' rules alone

    @classmethod
    def for_task(cls, model: OmniModel, task: TranscribeTask) -> PrefixLMTranscriber:
        """The decoder of a multitask model's transcribe task (its name = its head, tokenizers, task token)."""
        return cls(model, task.name, task.audio, task.text, task.task_token)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.omni.parameters(recurse)

    def encode(self, audio: Tensor, audio_mask: Tensor | None = None) -> Tensor:
        """The memory is the padded audio tokens themselves: the trunk reads them in ``decode_hidden``."""
        return audio

    def new_cache(self, memory: Tensor, max_length: int) -> KVCache:
        """Room for the S audio tokens plus ``max_length`` text tokens. The audio tokens are float32 whatever
        the autocast, so the cache follows the trunk's parameters."""
        return self.omni.trunk.new_cache(memory.shape[0], memory.shape[1] + max_length)

    def logits(self, text: Tensor, memory: Tensor | None, audio_mask: Tensor | None, cache: KVCache | None = None,
               cache_position: Tensor | None = None) -> Tensor:
        """Next-token logits (B, V) after text (B, T)."""
        return self.head(self.decode_hidden(text, memory, audio_mask, cache, cache_position)[:, -1])

    def decode_hidden(self, text: Tensor, memory: Tensor | None, audio_mask: Tensor | None,
                      cache: KVCache | None = None, cache_position: Tensor | None = None) -> Tensor:
        """Hidden states (B, T, d) of the text tokens ``text`` (B, T) after the audio prefix."""
        if cache is None:
            return self._packed_hidden(text, memory, audio_mask)
        B, T = text.shape
        dev, trunk = text.device, self.omni.trunk
        if memory is not None:  # first call: the audio prefix, bidirectional over its real frames
            if cache.length != 0:
                raise ValueError("the audio prefix goes into an empty cache")
            S = memory.shape[1]
            pad = None if audio_mask is None else ~audio_mask
            trunk(self.omni.embedders["audio"](memory), torch.arange(S, device=dev).expand(B, S), "full",
                  cache=cache, pad=pad)
        positions = cache.real_tokens()[:, None] + torch.arange(T, device=dev)  # (B, T): row b continues at n_b
        return trunk(self.omni.embedders["text"](text), positions, None, cache=cache, cache_position=cache_position)

    def _packed_hidden(self, text: Tensor, audio: Tensor, audio_mask: Tensor | None) -> Tensor:
        """Reference path: the training computation (Packer + packed mask) on [audio_b, text_b] per row, all in
        one packed row (a dense T x T mask on CPU: for tests and small batches)."""
        B, T = text.shape
        frames = [audio.shape[1]] * B if audio_mask is None else audio_mask.sum(1).tolist()
        samples = []
        for b, n in enumerate(frames):
            a = Segment("audio", audio[b, :n], torch.arange(n), self.audio.role)
            t = Segment("text", text[b], torch.arange(T), self.text.role)
            samples.append(Sample([a, t], key=f"decode/{b}"))
        batch = Packer()(samples).to(text.device)  # one row, documents in row order
        return OmniModel.gather(self.omni(batch), batch, "text").view(B, T, -1)


__all__ = ["PrefixLMTranscriber"]
