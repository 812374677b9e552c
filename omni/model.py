"""OmniModel: modality embedders -> shared trunk -> task heads. A plain nn.Module; Accelerate,
compile and parallelism wrap it from outside (omni/train.py)."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor, nn

from omni.packing import PackedBatch
from omni.tokenizers.base import Tokenizer
from omni.trunk import Mask, Trunk, TrunkConfig


class OmniModel(nn.Module):
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

    def forward(self, batch: PackedBatch, mask: Mask | None = None) -> Tensor:
        """Packed batch -> hidden states (B, T, d). ``mask`` defaults to the batch's packed mask."""
        if mask is None:
            mask = batch.attention_mask()
        return self.trunk(self.embed(batch), batch.positions, mask)

    @staticmethod
    def gather(hidden: Tensor, batch: PackedBatch, modality: str) -> Tensor:
        """The hidden states of one modality's tokens, (N_m, d), in packing order."""
        return hidden.reshape(-1, hidden.shape[-1])[batch.index[modality]]
