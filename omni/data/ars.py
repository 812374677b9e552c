"""Trained behaviour policies for continuous-control envs with no scripted controller (MuJoCo Hopper).

Augmented Random Search, version V2-t (Mania, Guy and Recht, "Simple random search provides a
competitive approach to reinforcement learning", 2018): a *linear* policy ``a = W (s - mean) / std``
with running observation statistics, improved by antithetic random perturbations of ``W`` keeping the
best ``top`` of ``directions`` pairs. It needs no neural network, no GPU and no replay buffer, reaches
expert-level Hopper returns in about a million env steps (a few minutes on one CPU core), and is
deterministic for a seed. Its checkpoints along the way give the D4RL-style skill levels: the final
(best) one is the expert, an earlier one scoring about 40% of the expert is the medium policy: a
genuinely half-trained agent with its own gait, not a noisy expert.

``omni data train-policy --env Hopper-v5 --out FILE`` runs this and writes the JSON file that
``omni.data.policies`` loads; the package ships ``policy_weights/Hopper-v5.json`` made that way.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class LinearPolicy:
    """``action = clip(weights @ ((obs - obs_mean) / obs_std), low, high)``; the observation statistics
    are frozen at the moment the policy was saved."""

    weights: np.ndarray  # (action_dim, obs_dim)
    obs_mean: np.ndarray  # (obs_dim,)
    obs_std: np.ndarray  # (obs_dim,)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return self.weights @ ((np.asarray(obs, dtype=np.float64) - self.obs_mean) / self.obs_std)

    def to_dict(self) -> dict[str, Any]:
        return {"weights": self.weights.tolist(), "obs_mean": self.obs_mean.tolist(), "obs_std": self.obs_std.tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "policy") -> LinearPolicy:
        try:
            w = np.asarray(d["weights"], dtype=np.float64)
            mean = np.asarray(d["obs_mean"], dtype=np.float64)
            std = np.asarray(d["obs_std"], dtype=np.float64)
        except KeyError as e:
            raise ValueError(f"{where}: missing {e.args[0]!r} (need weights, obs_mean, obs_std)") from None
        if w.ndim != 2 or mean.shape != (w.shape[1],) or std.shape != (w.shape[1],):
            raise ValueError(f"{where}: weights {w.shape}, obs_mean {mean.shape}, obs_std {std.shape} do not fit "
                             "(need (action_dim, obs_dim), (obs_dim,), (obs_dim,))")
        if not (np.isfinite(w).all() and np.isfinite(mean).all() and (std > 0).all()):
            raise ValueError(f"{where}: non-finite weights or statistics, or a non-positive obs_std")
        return cls(w, mean, std)


@dataclass(frozen=True)
class ARSConfig:
    iterations: int = 300
    directions: int = 8  # antithetic pairs per iteration
    top: int = 4  # best pairs used in the update
    step_size: float = 0.01
    noise: float = 0.025  # perturbation std in weight space
    alive_shift: float = 1.0  # subtracted from every training reward (ARS's fix for "stand still and collect")
    eval_every: int = 10
    eval_episodes: int = 3
    seed: int = 0


class _RunningStats:
    """Mean / variance of every observation seen so far (Chan et al.'s parallel update per episode)."""

    def __init__(self, dim: int) -> None:
        self.count, self.mean, self.m2 = 0, np.zeros(dim), np.zeros(dim)

    def update(self, batch: np.ndarray) -> None:
        n = len(batch)
        if n == 0:
            return
        b_mean = batch.mean(0)
        delta = b_mean - self.mean
        total = self.count + n
        self.mean = self.mean + delta * n / total
        self.m2 = self.m2 + ((batch - b_mean) ** 2).sum(0) + delta**2 * self.count * n / total
        self.count = total

    def std(self) -> np.ndarray:
        if self.count < 2:
            return np.ones_like(self.mean)
        return np.sqrt(self.m2 / self.count) + 1e-8


def _episode(env: Any, policy: Callable[[np.ndarray], np.ndarray], seed: int, shift: float,
             record: list | None = None) -> tuple[float, int]:
    low, high = env.action_space.low, env.action_space.high
    obs, _ = env.reset(seed=seed)
    total, n = 0.0, 0
    while True:
        if record is not None:
            record.append(obs)
        obs, reward, terminated, truncated, _ = env.step(np.clip(policy(obs), low, high))
        total += float(reward) - shift
        n += 1
        if terminated or truncated:
            return total, n


def evaluate_policy(env_id: str, policy: Callable[[np.ndarray], np.ndarray], episodes: int,
                    seed: int = 10_000) -> list[float]:
    """Undiscounted returns of ``episodes`` noise-free episodes on seeds ``seed, seed+1, ...``."""
    import gymnasium as gym

    env = gym.make(env_id)
    try:
        return [_episode(env, policy, seed + i, 0.0)[0] for i in range(episodes)]
    finally:
        env.close()


def train_ars(env_id: str, cfg: ARSConfig = ARSConfig(), log: Callable[[str], None] | None = print) -> list[dict]:
    """Train a linear policy with ARS V2-t; returns the checkpoints taken every ``eval_every`` iterations
    (and after the last), each ``{iteration, env_steps, return, policy: LinearPolicy}``."""
    import gymnasium as gym

    env = gym.make(env_id)
    if not isinstance(env.action_space, gym.spaces.Box) or len(env.observation_space.shape or ()) != 1:
        raise ValueError(f"ARS needs a Box action space and a flat observation vector; {env_id} has "
                         f"{env.action_space} / {env.observation_space}")
    if not 0 < cfg.top <= cfg.directions:
        raise ValueError(f"ARS: top ({cfg.top}) must be in 1..directions ({cfg.directions})")
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    rng = np.random.default_rng(cfg.seed)
    weights = np.zeros((act_dim, obs_dim))
    stats = _RunningStats(obs_dim)
    steps, checkpoints, t0 = 0, [], time.perf_counter()

    def frozen(w: np.ndarray) -> LinearPolicy:
        return LinearPolicy(w.copy(), stats.mean.copy(), stats.std())

    for it in range(1, cfg.iterations + 1):
        deltas = rng.standard_normal((cfg.directions, act_dim, obs_dim))
        seeds = rng.integers(0, 2**31 - 1, size=(cfg.directions, 2))
        policy_stats = frozen(weights)  # every rollout of one iteration normalises with the same statistics
        returns = np.zeros((cfg.directions, 2))
        seen: list[np.ndarray] = []
        for k in range(cfg.directions):
            for j, sign in enumerate((1.0, -1.0)):
                p = LinearPolicy(weights + sign * cfg.noise * deltas[k], policy_stats.obs_mean, policy_stats.obs_std)
                returns[k, j], n = _episode(env, p, int(seeds[k, j]), cfg.alive_shift, seen)
                steps += n
        stats.update(np.asarray(seen, dtype=np.float64))
        best = np.argsort(-returns.max(axis=1), kind="stable")[: cfg.top]
        sigma = returns[best].std()
        if sigma > 0:
            diff = returns[best, 0] - returns[best, 1]
            weights = weights + cfg.step_size / (cfg.top * sigma) * np.einsum("k,kij->ij", diff, deltas[best])
        if it % cfg.eval_every == 0 or it == cfg.iterations:
            policy = frozen(weights)
            ret = float(np.mean(evaluate_policy(env_id, policy, cfg.eval_episodes, seed=1_000_000 + it * 100)))
            checkpoints.append({"iteration": it, "env_steps": steps, "return": ret, "policy": policy})
            if log:
                log(f"ARS {env_id}: iteration {it}, {steps} env steps, return {ret:.1f} "
                    f"({time.perf_counter() - t0:.0f} s)")
    env.close()
    return checkpoints


def select_behaviour(env_id: str, checkpoints: list[dict], medium_fraction: float = 0.4,
                     episodes: int = 10, candidates: int = 3) -> dict[str, dict]:
    """Expert: the best of the ``candidates`` highest-scoring checkpoints re-evaluated on ``episodes``
    fresh episodes. Medium: the checkpoint whose re-evaluated return is closest to ``medium_fraction``
    of the way from the first checkpoint's return to the expert's (the early, half-trained agent)."""
    if not checkpoints:
        raise ValueError("no ARS checkpoints to choose from")

    def score(c: dict) -> float:
        return float(np.mean(evaluate_policy(env_id, c["policy"], episodes)))

    ranked = sorted(checkpoints, key=lambda c: -c["return"])[:candidates]
    rescored = [(score(c), c) for c in ranked]
    expert_return, expert = max(rescored, key=lambda rc: rc[0])
    floor = checkpoints[0]["return"]
    goal = floor + medium_fraction * (expert_return - floor)
    near = sorted((c for c in checkpoints if c["iteration"] < expert["iteration"]),
                  key=lambda c: abs(c["return"] - goal))[:candidates]
    if not near:
        raise ValueError("ARS: the best checkpoint is the first one; train longer to get a medium policy")
    medium_return, medium = min(((score(c), c) for c in near), key=lambda rc: abs(rc[0] - goal))
    return {"expert": {**expert, "return": expert_return}, "medium": {**medium, "return": medium_return}}


def save_policies(path: str | os.PathLike, env_id: str, chosen: dict[str, dict], checkpoints: list[dict],
                  cfg: ARSConfig, command: str) -> Path:
    """Write the file ``omni.data.policies`` loads (atomically: temp file, then rename)."""
    doc = {
        "env": env_id,
        "algorithm": "ARS V2-t linear policy (Mania et al. 2018)",
        "command": command,
        "config": asdict(cfg),
        "policies": {name: {"iteration": c["iteration"], "env_steps": c["env_steps"], "return": c["return"],
                            **c["policy"].to_dict()} for name, c in chosen.items()},
        "curve": [[c["iteration"], c["env_steps"], round(c["return"], 2)] for c in checkpoints],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load_policies(path: str | os.PathLike) -> tuple[str, dict[str, LinearPolicy]]:
    """``(env_id, {"expert": LinearPolicy, "medium": LinearPolicy})`` from a ``save_policies`` file."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a behaviour-policy file: {e}") from None
    if not isinstance(doc, dict) or "env" not in doc or not isinstance(doc.get("policies"), dict):
        raise ValueError(f"{path}: not a behaviour-policy file (needs 'env' and 'policies')")
    missing = {"expert", "medium"} - set(doc["policies"])
    if missing:
        raise ValueError(f"{path}: policies {sorted(missing)} missing (needs expert and medium)")
    return doc["env"], {name: LinearPolicy.from_dict(doc["policies"][name], f"{path} [{name}]")
                        for name in ("expert", "medium")}


__all__ = ["ARSConfig", "LinearPolicy", "evaluate_policy", "load_policies", "save_policies", "select_behaviour",
           "train_ars"]
