"""Episodes: reading `omni data gym` / `minari` shards, returns, filtered-BC selection, the env spaces and the
TrajectoryTokenizer fitted to a dataset."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omni.tokenizers.trajectory import TrajectoryTokenizer


def _decode_episode(sample: dict[str, Any]) -> dict[str, Any]:
    """Raw shard sample -> {"key", arrays..., "meta"} (module level: picklable for loader workers)."""
    key = sample.get("__key__", "?")
    if "npz" not in sample:
        raise ValueError(f"episode sample {key!r} has no .npz field (expected `omni data gym` / `minari` shards)")
    with np.load(io.BytesIO(sample["npz"]), allow_pickle=False) as z:
        ep: dict[str, Any] = {name: z[name] for name in z.files}
    ep["meta"] = json.loads(sample["json"]) if "json" in sample else {}
    ep["key"] = key
    return ep


def _as_list(items: list[Any]) -> list[Any]:
    return items


def load_episodes(data: str | Path, split: str = "train", *, max_corrupt_fraction: float = 0.0) -> list[dict[str, Any]]:
    """Every episode of a dataset split written by ``omni data gym`` / ``omni data minari``, in shard order.
    Each is a dict with observations/actions/rewards/terminations/truncations, "key" and "meta". Corrupt
    samples are skipped up to ``max_corrupt_fraction`` of them (ShardLoader; default: none)."""
    from omni.data.reader import ShardLoader

    loader = ShardLoader(data, _decode_episode, _as_list, batch_size=256, split=split, rank=0, world_size=1,
                         shuffle=False, fields=("npz",), max_corrupt_fraction=max_corrupt_fraction,
                         kind="episodes")
    episodes = [ep for batch in loader for ep in batch]
    if not episodes:
        raise ValueError(f"{data}: split {split!r} has no episodes")
    return episodes


def episode_return(ep: Mapping[str, Any]) -> float:
    return float(np.asarray(ep["rewards"], dtype=np.float64).sum())


def top_episodes(episodes: Sequence[Mapping[str, Any]], fraction: float = 0.1) -> list[Mapping[str, Any]]:
    """The best ``fraction`` of episodes by return (at least one): filtered-BC data. Ties keep data order."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    n = max(1, int(math.ceil(fraction * len(episodes))))
    order = sorted(range(len(episodes)), key=lambda i: (-episode_return(episodes[i]), i))
    return [episodes[i] for i in sorted(order[:n])]


@dataclass
class SpaceSpec:
    """What the tokenizer needs from the env spaces: state_dim and n_actions (discrete) or action_dim + bounds."""

    state_dim: int
    n_actions: int | None = None
    action_dim: int | None = None
    action_low: list[float] | None = None
    action_high: list[float] | None = None

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> "SpaceSpec":
        """From the ``observation_space`` / ``action_space`` entries ``omni data gym|minari`` writes."""
        obs, act = manifest.get("observation_space") or {}, manifest.get("action_space") or {}
        if obs.get("type") != "Box" or len(obs.get("shape", [])) != 1:
            raise ValueError(f"dataset observation space must be a flat Box (S,), got {obs}")
        if act.get("type") == "Discrete":
            if int(act.get("start", 0)) != 0:
                raise ValueError(f"Discrete action spaces must start at 0, got {act}")
            return cls(state_dim=int(obs["shape"][0]), n_actions=int(act["n"]))
        if act.get("type") == "Box" and len(act.get("shape", [])) == 1:
            return cls(state_dim=int(obs["shape"][0]), action_dim=int(act["shape"][0]),
                       action_low=[float(v) for v in act["low"]], action_high=[float(v) for v in act["high"]])
        raise ValueError(f"dataset action space must be Discrete or a flat Box (A,), got {act}")

    @classmethod
    def from_env(cls, env: Any) -> "SpaceSpec":
        return cls.from_manifest({"observation_space": _space_dict(env.observation_space),
                                  "action_space": _space_dict(env.action_space)})


def _space_dict(space: Any) -> dict[str, Any]:
    import gymnasium as gym

    if isinstance(space, gym.spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, gym.spaces.Box):
        return {"type": "Box", "shape": list(space.shape), "low": np.asarray(space.low, np.float64).tolist(),
                "high": np.asarray(space.high, np.float64).tolist()}
    return {"type": type(space).__name__}


def make_tokenizer(episodes: Sequence[Mapping[str, Any]], spaces: SpaceSpec, *, context: int = 20,
                   rtg_scale: float | None = None, max_timestep: int | None = None) -> TrajectoryTokenizer:
    """A TrajectoryTokenizer fitted to the episodes: state mean/std, ``rtg_scale`` (default: the largest
    |episode return|, so scaled returns lie in [-1, 1]) and ``max_timestep`` (default: longest episode + 1,
    raise it to the env's step limit for rollouts)."""
    if not episodes:
        raise ValueError("make_tokenizer needs at least one episode")
    rets = np.array([episode_return(ep) for ep in episodes])
    lengths = [int(np.asarray(ep["actions"]).shape[0]) for ep in episodes]
    scale = rtg_scale if rtg_scale is not None else max(float(np.abs(rets).max()), 1.0)
    tok = TrajectoryTokenizer(
        spaces.state_dim, action_dim=spaces.action_dim, n_actions=spaces.n_actions, rtg_scale=scale,
        max_timestep=max_timestep or max(lengths) + 1, context=context,
        action_low=spaces.action_low, action_high=spaces.action_high)
    tok.fit({**ep, "__key__": ep.get("key", f"episode[{i}]")} for i, ep in enumerate(episodes))
    return tok


__all__ = ["SpaceSpec", "episode_return", "load_episodes", "make_tokenizer", "top_episodes"]
