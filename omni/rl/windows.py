"""Training windows: every step of every episode encoded once (EpisodeData), windows gathered on the device per
batch (WindowLoader: seeded, rank-split, resumable)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from omni.data.memory import TensorLoader
from omni.rl.episodes import episode_return
from omni.tokenizers.trajectory import COL_KIND, TrajectoryTokenizer

KIND_PAD = 3  # right-padding rows of training windows (the embedder treats them as zero actions)


@dataclass
class EpisodeData:
    """Every step of every episode as token rows: steps (N, 3, F) = [R_t, s_t, a_t] rows, targets (N, 3, A')
    (a_t on the state row), and the training windows as (first step, valid steps) pairs."""

    steps: Tensor
    targets: Tensor
    window_start: Tensor  # (W,) int64 index into steps
    window_steps: Tensor  # (W,) int64 valid steps in the window (< context only for short episodes)
    keys: list[str] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)

    def to(self, device: torch.device | str) -> "EpisodeData":
        return EpisodeData(self.steps.to(device), self.targets.to(device), self.window_start.to(device),
                           self.window_steps.to(device), self.keys, self.returns)


def encode_episodes(tok: TrajectoryTokenizer, episodes: Sequence[Mapping[str, Any]], *,
                    short: Literal["pad", "drop", "error"] = "pad") -> EpisodeData:
    """Tokenise whole episodes once (validation errors name the episode key) and list the windows.

    short: what to do with an episode shorter than ``tok.context``: "pad" (one right-padded window),
    "drop" (skip it, with a warning counting them) or "error".
    """
    if short not in ("pad", "drop", "error"):
        raise ValueError(f"short must be 'pad', 'drop' or 'error', got {short!r}")
    K = tok.context
    steps, targets, starts, valid, keys, rets = [], [], [], [], [], []
    offset, dropped = 0, 0
    for i, ep in enumerate(episodes):
        key = str(ep.get("key", f"episode[{i}]")) if isinstance(ep, Mapping) else f"episode[{i}]"
        T = int(np.asarray(ep["actions"]).shape[0]) if "actions" in ep else 0
        whole = TrajectoryTokenizer(**{**tok.config(), "context": max(T, 1)})  # same layout, one window
        seg = whole.encode(ep, key=key, start=0)
        T = seg.tokens.shape[0] // 3
        if T < K:
            if short == "error":
                raise ValueError(f"trajectory sample {key!r}: episode of {T} steps is shorter than context={K} "
                                 f"(use short='pad' to right-pad it, or 'drop')")
            if short == "drop":
                dropped += 1
                continue
        steps.append(seg.tokens.view(T, 3, -1))
        targets.append(seg.targets.view(T, 3, -1))
        n_win = max(T - K + 1, 1)
        starts.append(offset + torch.arange(n_win))
        valid.append(torch.full((n_win,), min(K, T), dtype=torch.int64))
        keys.append(key)
        rets.append(episode_return(ep))
        offset += T
    if dropped:
        warnings.warn(f"encode_episodes: dropped {dropped} episodes shorter than context={K}", stacklevel=2)
    if not steps:
        raise ValueError(f"no episode left to train on ({dropped} shorter than context={K} were dropped)")
    return EpisodeData(torch.cat(steps), torch.cat(targets), torch.cat(starts), torch.cat(valid), keys, rets)


def gather_windows(data: EpisodeData, start: Tensor, n_valid: Tensor, context: int,
                   use_returns: bool = True) -> tuple[Tensor, Tensor]:
    """Windows (B, n*context, F) tokens and (B, n*context, A') targets, n = 3 (DT) or 2 (BC: no return
    rows), right-padded with KIND_PAD rows past ``n_valid`` steps. Runs on the data's device."""
    ar = torch.arange(context, device=start.device)
    idx = (start[:, None] + ar).clamp_max(data.steps.shape[0] - 1)  # (B, K)
    x, y = data.steps[idx], data.targets[idx]  # (B, K, 3, F), (B, K, 3, A)
    keep = (ar[None] < n_valid[:, None])[..., None, None]
    pad = torch.zeros_like(x[:1, :1])
    pad[..., COL_KIND] = KIND_PAD
    x, y = torch.where(keep, x, pad), torch.where(keep, y, torch.zeros_like(y))
    if not use_returns:
        x, y = x[:, :, 1:], y[:, :, 1:]
    B = x.shape[0]
    return x.reshape(B, -1, x.shape[-1]), y.reshape(B, -1, y.shape[-1])


class WindowLoader:
    """Batches of (tokens, targets) windows: a TensorLoader over window indices (seeded order per epoch,
    rank split, equal batch counts, ``state_dict`` resume), gathered from ``EpisodeData`` on its device."""

    def __init__(self, data: EpisodeData, batch_size: int, *, context: int, use_returns: bool = True,
                 shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
                 drop_last: bool = True) -> None:
        self.data, self.context, self.use_returns = data, context, use_returns
        n = data.window_start.shape[0]
        if drop_last and n // world_size < batch_size:
            drop_last = False  # tiny datasets: one short batch rather than none
        self.inner = TensorLoader([data.window_start, data.window_steps], min(batch_size, max(n // world_size, 1)),
                                  shuffle=shuffle, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last)

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def num_windows(self) -> int:
        return self.inner.num_samples

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.inner.load_state_dict(state)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for start, n_valid in self.inner:
            yield gather_windows(self.data, start, n_valid, self.context, self.use_returns)


__all__ = ["EpisodeData", "KIND_PAD", "WindowLoader", "encode_episodes", "gather_windows"]
