"""OmniModel: modality embedders -> shared trunk -> task heads. A plain nn.Module; Accelerate,
compile and parallelism wrap it from outside (omni/train.py).

The model API. Every model on the trunk answers the same two calls (timm's split), and its ``forward`` is the
second applied to the first:

    features = model.forward_features(*inputs)    # trunk hidden states (B, T, d)
    output = model.forward_head(features, *what)   # what forward returns

    ImageClassifier      forward_features(images (B, C, H, W)) -> (B, n, d)
                         forward_head(features) -> logits (B, classes); pre_logits=True: pooled (B, d)
    SpeechRecognizer     forward_features(audio (B, S, F), audio_mask (B, S), text (B, T)) -> decoder states (B, T, d)
                         forward_head(features) -> logits (B, T, vocab)
    DecisionTransformer  forward_features(tokens (B, T, F), cache=None) -> (B, T, d)
                         forward_head(features) -> action logits / actions (B, T, n_out)
    OmniModel            forward_features(batch, mask=None) -> packed (B, T, d)
                         forward_head(features, batch, head, modality) -> (S_m, out) per segment | (N_m, out)
    MultitaskModel       forward_features(batch, mask=None) -> packed (B, T, d)
                         forward_head(features, batch) -> (loss, per-task metrics)

OmniModel holds many heads, so its ``forward`` stops at the features and ``forward_head`` names one. The heads
themselves take tensors (omni.heads): (N, d) rows, or tokens + segment ids for a per-segment head.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor, nn

from omni.heads import packed_segments
from omni.packing import PackedBatch
from omni.tokenizers.base import Tokenizer
from omni.trunk import Mask, Trunk, TrunkConfig


class CarriedTensors(nn.Module):
    """Tensors of a converted checkpoint that the model never reads (a Hugging Face ViTModel's pooler), held as
    buffers so that the model's export hands the checkpoint back whole. Named by their source names, '.' written
    '/' (a buffer name cannot hold a dot). ``shapes`` is what an export config records (``shapes()``)."""

    def __init__(self, shapes: Mapping[str, Sequence[int]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_buffer(name.replace(".", "/"), torch.zeros(tuple(shape)))

    def tensors(self) -> dict[str, Tensor]:
        """{source name: tensor}."""
        return {name.replace("/", "."): t for name, t in self.named_buffers()}

    def shapes(self) -> dict[str, list[int]]:
        """{source name: shape}: the export config entry that rebuilds this module."""
        return {name: list(t.shape) for name, t in self.tensors().items()}


class OmniModel(nn.Module):
    """Embedders (one per modality) -> Trunk over packed batches -> ``heads`` by name (the API above)."""

    def __init__(self, tokenizers: Mapping[str, Tokenizer], trunk: TrunkConfig,
                 heads: Mapping[str, nn.Module] | None = None) -> None:
        super().__init__()
        self.trunk_config = trunk
        self.embedders = nn.ModuleDict({m: tok.embedder(trunk.d_model) for m, tok in tokenizers.items()})
        self.trunk = Trunk(trunk)
        self.heads = nn.ModuleDict(dict(heads or {}))

    def embed(self, batch: PackedBatch) -> Tensor:
        """Scatter every modality's embedded tokens into the packed (B, T, d) sequence (padding = 0)."""
        B, T = batch.shape
        parts = {}
        for m, tokens in batch.tokens.items():
            if m not in self.embedders:
                raise KeyError(f"batch has {m!r} tokens but the model has no embedder for it "
                               f"(have: {', '.join(self.embedders)})")
            parts[m] = self.embedders[m](tokens)
        dtype = next(iter(parts.values())).dtype
        x = torch.zeros(B * T, self.trunk_config.d_model, device=batch.document.device, dtype=dtype)
        for m, e in parts.items():
            x = x.index_copy(0, batch.index[m], e.to(dtype))
        return x.view(B, T, -1)

    def forward_features(self, batch: PackedBatch, mask: Mask | None = None) -> Tensor:
        """Packed batch -> hidden states (B, T, d). ``mask`` defaults to the batch's packed mask."""
        if mask is None:
            mask = batch.attention_mask(schedule=self.trunk.schedule)  # per-layer masks for attention patterns
        return self.trunk(self.embed(batch), batch.positions, mask)

    def forward_head(self, features: Tensor, batch: PackedBatch, head: str, modality: str) -> Tensor:
        """Head ``head`` on the ``modality`` tokens of features (B, T, d): (S_m, out), one row per segment, for
        a per-segment head (classification), else (N_m, out), one row per token in packing order."""
        tokens, segment_ids, n_segments = packed_segments(features, batch, modality)
        module = self.heads[head]
        return module(tokens, segment_ids, n_segments) if getattr(module, "per_segment", False) else module(tokens)

    def forward(self, batch: PackedBatch, mask: Mask | None = None) -> Tensor:
        """= ``forward_features``: the heads are read by name with ``forward_head``."""
        return self.forward_features(batch, mask)

    def export_config(self) -> dict[str, Any]:
        """config.json for ``omni.export.load_pretrained`` (the "omni" builder): trunk + every head's spec."""
        return {"builder": "omni", "trunk": self.trunk_config.to_dict(),
                "heads": {name: head.spec() for name, head in self.heads.items()}}

    @staticmethod
    def gather(hidden: Tensor, batch: PackedBatch, modality: str) -> Tensor:
        """The hidden states of one modality's tokens, (N_m, d), in packing order."""
        return packed_segments(hidden, batch, modality)[0]


@runtime_checkable
class HoldsOmniModel(Protocol):
    """A model built around one OmniModel (omni.multitask.MultitaskModel: tasks over a shared ``omni``), for code
    below the task layer that reads the OmniModel itself (omni.introspect) without importing the tasks."""

    omni: OmniModel

