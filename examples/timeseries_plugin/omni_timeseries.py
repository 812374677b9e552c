"""A third-party omni tokenizer: multivariate time series -> patches of `patch` steps.

Installed with `pip install examples/timeseries_plugin`, it is found by name through the
`omni.tokenizers` entry-point group; nothing inside omni changes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from omni.segment import Role, Segment
from omni.tokenizers.base import Tokenizer, TypeEmbedding


class TimeSeriesTokenizer(Tokenizer):
    modality = "timeseries"
    role = Role.BIDIRECTIONAL

    def __init__(self, channels: int = 1, patch: int = 8) -> None:
        self.channels, self.patch = channels, patch

    def config(self) -> dict[str, Any]:
        return {"channels": self.channels, "patch": self.patch}

    def encode(self, raw: Any, *, key: str = "") -> Segment:
        x = torch.as_tensor(np.asarray(raw, dtype=np.float32))
        if x.dim() == 1:
            x = x[:, None]
        if x.dim() != 2 or x.shape[1] != self.channels:
            raise ValueError(f"sample {key!r}: expected a (steps, {self.channels}) series, got {tuple(x.shape)}")
        if x.shape[0] == 0 or not torch.isfinite(x).all():
            raise ValueError(f"sample {key!r}: the series is empty or has NaN/inf")
        # Instance normalisation (RevIN-style) so scale does not leak into the tokens.
        x = (x - x.mean(0)) / (x.std(0, unbiased=False) + 1e-5)
        pad = (-x.shape[0]) % self.patch
        x = torch.cat([x, x.new_zeros(pad, self.channels)])
        tokens = x.reshape(-1, self.patch * self.channels)  # (n, patch * channels)
        return Segment(self.modality, tokens, torch.arange(tokens.shape[0]), self.role)

    def embedder(self, d_model: int) -> nn.Module:
        return nn.Sequential(nn.Linear(self.patch * self.channels, d_model), TypeEmbedding(d_model))
