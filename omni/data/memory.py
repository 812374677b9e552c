"""Small datasets held as tensors (on the GPU when there is one): decoded once from shards, then
batched by index with no data workers. Same guarantees as ShardLoader: a seeded per-epoch order,
every sample exactly once per epoch across ranks, equal batch counts per rank, exact resume."""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor


class EpochCursor:
    """The resumable position of a rank-local loader: (epoch, batches done in it). ``set_epoch`` to the
    current epoch is a no-op, so it is safe right after ``load_state_dict``."""

    epoch: int = 0
    batches_done: int = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.batches_done = int(epoch), 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches_done": self.batches_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batches_done = int(state["epoch"]), int(state["batches_done"])


class TensorLoader(EpochCursor):
    """Batches of aligned tensors (images, labels, ...) sliced by a seeded permutation.

    Each epoch permutes all N samples with (seed, epoch); rank r takes positions r, r+W, r+2W, ...
    and cuts them into K = ceil(ceil(N/W) / batch_size) batches (ranks with one sample fewer repeat
    their first sample once so every rank yields K batches of equal shapes; ``drop_last`` drops the
    partial tail instead). ``state_dict`` = (epoch, batches done).
    """

    def __init__(self, tensors: Sequence[Tensor], batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 rank: int = 0, world_size: int = 1, drop_last: bool = False) -> None:
        n = tensors[0].shape[0]
        if any(t.shape[0] != n for t in tensors):
            raise ValueError(f"tensors disagree on the sample count: {[t.shape[0] for t in tensors]}")
        if n < world_size:
            raise ValueError(f"{n} samples cannot be split over {world_size} ranks")
        self.tensors, self.batch_size, self.shuffle, self.seed = list(tensors), batch_size, shuffle, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.epoch, self.batches_done = 0, 0
        per_rank = math.ceil(n / world_size)
        self.num_batches = (n // world_size) // batch_size if drop_last else math.ceil(per_rank / batch_size)
        if self.num_batches == 0:
            raise ValueError(f"{n} samples on {world_size} ranks give no full batch of {batch_size}")

    @property
    def num_samples(self) -> int:
        return self.tensors[0].shape[0]

    def __len__(self) -> int:
        return self.num_batches

    def _indices(self) -> Tensor:
        n = self.num_samples
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(n, generator=g)
        else:
            order = torch.arange(n)
        mine = order[self.rank::self.world_size]
        per_rank = math.ceil(n / self.world_size)
        if not self.drop_last and mine.numel() < per_rank:  # equal shapes on every rank
            mine = torch.cat([mine, mine[: per_rank - mine.numel()]])
        return mine

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        idx = self._indices().to(self.tensors[0].device)
        # Even batch sizes: K batches whose sizes differ by at most one.
        bounds = [round(i * idx.numel() / self.num_batches) for i in range(self.num_batches + 1)] \
            if not self.drop_last else [i * self.batch_size for i in range(self.num_batches + 1)]
        while self.batches_done < self.num_batches:
            j = self.batches_done
            sel = idx[bounds[j]:bounds[j + 1]]
            self.batches_done += 1
            yield tuple(t.index_select(0, sel) for t in self.tensors)
        self.epoch += 1
        self.batches_done = 0


def materialise(loader: Any, device: torch.device | str = "cpu") -> list[Tensor]:
    """Read one pass of a loader yielding tuples of tensors into concatenated tensors on ``device``."""
    parts: list[list[Tensor]] | None = None
    for batch in loader:
        if batch is None:
            continue
        if parts is None:
            parts = [[] for _ in batch]
        for p, t in zip(parts, batch):
            p.append(t)
    if parts is None:
        raise ValueError("the loader yielded no batches")
    return [torch.cat(p).to(device) for p in parts]
