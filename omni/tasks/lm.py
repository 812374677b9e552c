"""``LMTask``: causal language modelling on text documents -> an LM head, tied to the text embedding unless the
model it fine-tunes has its own (an untied GPT-2: ``tied=False``)."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch.nn.functional as F
from torch import Tensor

from omni.model import OmniModel
from omni.packing import PackedBatch
from omni.segment import Sample
from omni.tasks.base import (NextTextTokenTask, Row, inference, packed_eval_options, packed_items,
                             register_task)
from omni.tokenizers.base import Tokenizer
from omni.tokenizers.text import IGNORE_INDEX, TextTokenizer


def _lm_nll_sum(model: OmniModel, head: str, hidden: Tensor, batch: PackedBatch) -> tuple[float, int]:
    """(summed next-token NLL in nats, predicted tokens) over every text token of a batch of one task."""
    logits = model.forward_head(hidden, batch, head, "text").float()
    targets = batch.targets["text"]
    keep = targets != IGNORE_INDEX
    return float(F.cross_entropy(logits[keep], targets[keep], reduction="sum")), int(keep.sum())


@register_task("lm")
class LMTask(NextTextTokenTask):
    """Causal language modelling on text documents. The LM head is tied to the text embedding; ``tied=False``
    gives it its own weight (the head of an untied checkpoint, e.g. a GPT-2 with tie_word_embeddings=False,
    which must keep training apart from the table)."""

    metric_names = ("token_accuracy",)

    def __init__(self, name: str, tokenizer: TextTokenizer, texts: Sequence[str], *, weight: float = 1.0,
                 loss_weight: float = 1.0, tied: bool = True) -> None:
        super().__init__(name, weight, loss_weight)
        if not len(texts):
            raise ValueError(f"task {name!r}: no texts")
        self.tokenizer, self.texts = tokenizer, texts
        self.text_tokenizer = tokenizer
        self.tied = bool(tied)

    def head_specs(self) -> dict[str, dict[str, Any]]:
        specs = super().head_specs()
        if not self.tied:  # a spec without tie_to builds the head with its own weight (omni.heads.LMHead)
            specs[self.name].pop("tie_to")
        return specs

    def tokenizers(self) -> dict[str, Tokenizer]:
        return {"text": self.tokenizer}

    def __len__(self) -> int:
        return len(self.texts)

    def sample(self, i: int, rng: np.random.Generator) -> Sample:
        key = f"{self.name}/{i}"
        return Sample([self.tokenizer.encode(self.texts[i], key=key)], key=key)

    def evaluate(self, model: OmniModel, *, row_length: int = 1024, rows: int = 8) -> dict[str, float]:
        """Held-out language modelling: token perplexity exp(NLL / tokens) and bits per byte
        NLL / ln 2 / (UTF-8 bytes of the raw texts), NLL summed over every predicted token (the first
        token after bos through eos; bos itself is given)."""
        nll, tokens = 0.0, 0
        for batch, hidden in packed_items(self, model, row_length, rows):
            a, b = _lm_nll_sum(model, self.name, hidden, batch)
            nll, tokens = nll + a, tokens + b
        n_bytes = sum(len(t.encode("utf-8")) for t in self.texts)
        return {"ppl": math.exp(nll / max(tokens, 1)), "bpb": nll / math.log(2) / max(n_bytes, 1),
                "nll": nll / max(tokens, 1), "tokens": float(tokens), "bytes": float(n_bytes),
                "documents": float(len(self))}

    eval_options = staticmethod(packed_eval_options)

    def samples(self, model: OmniModel, count: int = 4, prompt_tokens: int = 16, max_new_tokens: int = 48,
                temperature: float = 0.8, top_k: int | None = 40) -> list[Any]:
        """The first ``count`` held-out texts' opening ``prompt_tokens`` tokens and the model's continuation
        (sampled with a fixed seed, so a step's notes compare with the next's), as ``omni.plots.Note`` items
        (TensorBoard text). Fewer new tokens where a learned position table ends sooner."""
        from omni.generate import TextLM, generate_ids
        from omni.plots import Note

        if count <= 0:
            return []
        lm = TextLM(model, self.name, self.tokenizer)
        prompts = []
        for text in self.texts[:count]:
            ids = self.tokenizer.encode(text, key="sample").tokens.tolist()
            prompts.append(ids[:max(1, min(prompt_tokens, len(ids) - 1))])  # leave the text something to continue
        new = max_new_tokens
        if lm.max_positions is not None:
            new = min(new, lm.max_positions - max(len(p) for p in prompts))
        if new <= 0:
            return []
        with inference(model):
            out = generate_ids(lm, prompts, max_new_tokens=new, temperature=temperature, top_k=top_k, seed=0)
        return [Note(f"{self.name}/sample{i}", f"**{lm.decode(p)}**{lm.decode(o)}")
                for i, (p, o) in enumerate(zip(prompts, out))]

    def result_row(self, r: Mapping[str, float]) -> Row:
        return ("perplexity (token)", f"{r['ppl']:.2f}", f"{r['bpb']:.4f} bits/byte",
                f"{r['documents']:.0f} held-out documents, {r['tokens']:.0f} tokens")

    @staticmethod
    def from_items(entry: Mapping[str, Any], items: Sequence[Any], labels: Sequence[Any],
                   text: TextTokenizer) -> dict[str, Any]:
        """The items are the texts (labels ignored), on the shared text tokenizer."""
        return {"tokenizer": text, "texts": items}
