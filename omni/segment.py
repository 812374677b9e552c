"""A Segment: one modality's span of tokens inside a sample.

Tokenizers turn raw inputs into Segments on the CPU (in data workers); the packer
(omni/packing.py) concatenates the Segments of many samples into one packed batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch
from torch import Tensor


class Role(IntEnum):
    """How tokens inside one segment attend to each other.

    Across segments of one document attention is always causal at segment granularity: a
    token sees every token of *earlier* segments of its document and none of later ones.
    An image segment followed by a causal text segment is therefore a prefix-LM.
    """

    BIDIRECTIONAL = 0  # image patches, audio frames, encoder spans
    CAUSAL = 1  # text, actions, trajectories


@dataclass
class Segment:
    """One modality's tokens.

    tokens:    (n,) int64 ids, or (n, *feature_shape) float features; n >= 1.
    positions: (n,) 1-D positions or (n, 2) (row, col) grid positions, int64, local to the
               segment (the packer offsets them inside a document).
    role:      attention role inside the segment.
    targets:   optional per-token targets aligned with tokens on dim 0 (e.g. next-token ids
               with -100 = ignore, or action vectors); the packer concatenates them per modality.
    meta:      free-form per-segment info (shapes needed to decode, labels ...); not collated.
    """

    modality: str
    tokens: Tensor
    positions: Tensor
    role: Role = Role.BIDIRECTIONAL
    targets: Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.tokens.shape[0] if self.tokens.dim() > 0 else 0
        if n == 0:
            raise ValueError(f"{self.modality} segment is empty: a segment needs at least one token")
        if self.positions.shape[0] != n:
            raise ValueError(
                f"{self.modality} segment has {n} tokens but {self.positions.shape[0]} positions"
            )
        if self.positions.dim() not in (1, 2) or (self.positions.dim() == 2 and self.positions.shape[1] != 2):
            raise ValueError(
                f"{self.modality} segment positions must be (n,) or (n, 2), got {tuple(self.positions.shape)}"
            )
        if self.targets is not None and self.targets.shape[0] != n:
            raise ValueError(
                f"{self.modality} segment has {n} tokens but {self.targets.shape[0]} targets"
            )
        if self.tokens.is_floating_point() and not bool(torch.isfinite(self.tokens).all()):
            raise ValueError(f"{self.modality} segment contains NaN or inf values")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def positions_2d(self) -> Tensor:
        """(n, 2) positions; 1-D positions p become (p, p) so 2-D RoPE reduces to 1-D RoPE."""
        p = self.positions.long()
        return p if p.dim() == 2 else torch.stack([p, p], dim=-1)


@dataclass
class Sample:
    """One training/inference example: an ordered list of segments forming one document.

    key names the sample in error messages and logs (webdataset __key__ or an index);
    label is an optional per-sample target (class id, transcript ...).
    """

    segments: list[Segment]
    key: str = ""
    label: Any = None

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError(f"sample {self.key!r} has no segments")

    def __len__(self) -> int:
        return sum(len(s) for s in self.segments)
