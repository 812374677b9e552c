"""Task heads: read trunk outputs, produce predictions. A task = tokenizers + trunk + heads + loss."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from omni.packing import PackedBatch, segment_mean


class ClassificationHead(nn.Module):
    """One prediction per segment of a modality: mean-pool its tokens, or read its first (CLS) token."""

    def __init__(self, d_model: int, n_classes: int, pool: Literal["mean", "cls"] = "mean") -> None:
        super().__init__()
        if pool not in ("mean", "cls"):
            raise ValueError(f"pool must be 'mean' or 'cls', got {pool!r}")
        self.pool = pool
        self.norm = nn.LayerNorm(d_model)
        self.proj = nn.Linear(d_model, n_classes)
        nn.init.zeros_(self.proj.weight)  # start from uniform predictions (as big_vision's head)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: Tensor, batch: PackedBatch, modality: str) -> Tensor:
        """hidden (B, T, d) -> logits (S_m, n_classes), one row per segment of ``modality``."""
        tokens = hidden.reshape(-1, hidden.shape[-1])[batch.index[modality]]  # (N_m, d)
        seg = batch.segment_of[modality]
        n = batch.segment_document[modality].shape[0]
        if self.pool == "mean":
            pooled = segment_mean(tokens, seg, n)
        else:  # first token of each segment
            first = torch.ones_like(seg, dtype=torch.bool)
            first[1:] = seg[1:] != seg[:-1]
            pooled = tokens[first]
        return self.proj(self.norm(pooled))

    def forward_rows(self, hidden: Tensor) -> Tensor:
        """hidden (B, n, d), each row one whole segment (a uniform batch) -> logits (B, n_classes)."""
        pooled = hidden[:, 0] if self.pool == "cls" else hidden.mean(1)
        return self.proj(self.norm(pooled))


class LMHead(nn.Module):
    """Next-token logits; ``tie_to`` shares the weight with a text embedding table."""

    def __init__(self, d_model: int, vocab_size: int, tie_to: nn.Embedding | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, vocab_size, bias=False)
        if tie_to is not None:
            if tie_to.weight.shape != self.proj.weight.shape:
                raise ValueError(f"cannot tie LM head {tuple(self.proj.weight.shape)} to embedding {tuple(tie_to.weight.shape)}")
            self.proj.weight = tie_to.weight
        else:
            nn.init.normal_(self.proj.weight, std=0.02)

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden (..., d) -> logits (..., vocab)."""
        return self.proj(hidden)


class ActionHead(nn.Module):
    """Discrete action logits (n_outputs = number of actions) or continuous actions (tanh-squashed)."""

    def __init__(self, d_model: int, n_outputs: int, discrete: bool) -> None:
        super().__init__()
        self.discrete = discrete
        self.proj = nn.Linear(d_model, n_outputs)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        out = self.proj(hidden)
        return out if self.discrete else torch.tanh(out)
