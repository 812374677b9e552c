"""Rollouts: many Gymnasium envs stepped together under one batched, KV-cached policy call per step, and the
target-return sweep (evaluate)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from omni.interfaces import Policy
from omni.rl.model import DecisionTransformer
from omni.rl.scores import summarize_returns
from omni.tokenizers.trajectory import COL_KIND, COL_RTG, COL_STATE, COL_TIMESTEP, KIND_ACTION, KIND_RETURN, KIND_STATE, TrajectoryTokenizer


def check_env(env: Any, tok: TrajectoryTokenizer, name: str = "env") -> None:
    """Raise ValueError naming ``name`` if the env's spaces do not match the tokenizer (the dataset)."""
    import gymnasium as gym

    obs, act = env.observation_space, env.action_space
    if not isinstance(obs, gym.spaces.Box) or tuple(obs.shape) != (tok.state_dim,):
        raise ValueError(f"{name}: observation space {obs} does not match the dataset's states ({tok.state_dim},)")
    if tok.discrete:
        if not isinstance(act, gym.spaces.Discrete) or int(act.n) != tok.n_actions or int(act.start) != 0:
            raise ValueError(f"{name}: action space {act} does not match the dataset's Discrete({tok.n_actions})")
    elif not isinstance(act, gym.spaces.Box) or tuple(act.shape) != (tok.action_dim,):
        raise ValueError(f"{name}: action space {act} does not match the dataset's Box actions ({tok.action_dim},)")


def _step_rows(tok: TrajectoryTokenizer, obs: np.ndarray, t: int, rtg: np.ndarray, use_returns: bool,
               names: Sequence[str]) -> Tensor:
    """[R_t, s_t] (or [s_t] for BC) rows for every env, (B, 2|1, F), the tokenizer's layout, vectorised."""
    obs = np.asarray(obs, dtype=np.float64).reshape(len(names), -1)
    bad = ~np.isfinite(obs).all(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{names[i]} step {t}: observation contains NaN or inf: {obs[i].tolist()}")
    if obs.shape[1] != tok.state_dim:
        raise ValueError(f"{names[0]} step {t}: observation has {obs.shape[1]} values, the dataset's states have "
                         f"{tok.state_dim}")
    B = obs.shape[0]
    rows = np.zeros((B, 2, tok.feature_dim), dtype=np.float32)
    rows[:, :, COL_KIND] = (KIND_RETURN, KIND_STATE)
    rows[:, :, COL_TIMESTEP] = t
    rows[:, 0, COL_RTG] = rtg / tok.rtg_scale
    rows[:, 1, COL_STATE:COL_STATE + tok.state_dim] = tok.normalize_states(obs)
    out = torch.from_numpy(rows)
    return out if use_returns else out[:, 1:]


def _action_rows(tok: TrajectoryTokenizer, actions: np.ndarray, t: int) -> Tensor:
    B = actions.shape[0]
    rows = np.zeros((B, 1, tok.feature_dim), dtype=np.float32)
    rows[:, 0, COL_KIND] = KIND_ACTION
    rows[:, 0, COL_TIMESTEP] = t
    rows[:, 0, tok.col_action:] = actions.reshape(B, tok.action_cols)
    return torch.from_numpy(rows)


@dataclass
class RolloutResult:
    returns: np.ndarray  # (B,) float64 episode returns
    lengths: np.ndarray  # (B,) int64 steps taken
    actions: list[np.ndarray] = field(default_factory=list)  # per step: (B, ...) actions (record=True)
    outputs: list[np.ndarray] = field(default_factory=list)  # per step: (B, n_out) head outputs (record=True)


@torch.no_grad()
def rollout(model: Policy, tok: TrajectoryTokenizer, envs: Sequence[Any], seeds: Sequence[int], *,
            targets: Sequence[float] | None = None, max_steps: int | None = None, cache: bool = True,
            record: bool = False, device: torch.device | str | None = None,
            names: Sequence[str] | None = None) -> RolloutResult:
    """Run one episode in each env, all stepped together with one batched policy call per step.

    targets: the (unscaled) target return per env (DT); None for BC. max_steps: default the envs' time
    limit. cache: KV-cached inference (see the module docstring) or full re-encoding per step (reference).
    record: keep every step's actions and head outputs (rows of finished envs: NaN outputs, action -1 / NaN).
    """
    B = len(envs)
    names = list(names) if names is not None else [f"env {i} (seed {s})" for i, s in enumerate(seeds)]
    if B == 0 or len(seeds) != B:
        raise ValueError(f"rollout needs one seed per env, got {len(envs)} envs and {len(seeds)} seeds")
    if model.use_returns and (targets is None or len(targets) != B):
        raise ValueError("a Decision Transformer rollout needs one target return per env")
    for env, name in zip(envs, names):
        check_env(env, tok, name)
    if max_steps is None:
        limits = [getattr(getattr(env, "spec", None), "max_episode_steps", None) for env in envs]
        if any(v is None for v in limits):
            raise ValueError("envs without a time limit (spec.max_episode_steps) need max_steps=")
        max_steps = max(limits)
    if max_steps > tok.max_timestep:
        raise ValueError(f"max_steps={max_steps} exceeds the tokenizer's max_timestep={tok.max_timestep}")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    K = tok.context
    rtg = np.asarray(targets if model.use_returns else np.zeros(B), dtype=np.float64).copy()
    obs = np.stack([np.asarray(env.reset(seed=int(s))[0]) for env, s in zip(envs, seeds)])
    done = np.zeros(B, dtype=bool)
    returns, lengths = np.zeros(B), np.zeros(B, dtype=np.int64)
    history: list[Tensor] = []  # per completed step: (B, n_tok, F) rows
    hist_obs = [[o.copy()] for o in obs]  # copies: obs is updated in place below
    hist_act: list[list[Any]] = [[] for _ in range(B)]
    hist_rew: list[list[float]] = [[] for _ in range(B)]
    kv = model.new_cache(B, device) if cache else None
    prev_action: Tensor | None = None
    result = RolloutResult(returns, lengths)
    try:
        for t in range(max_steps):
            cur = _step_rows(tok, obs, t, rtg, model.use_returns, names)
            if cache:
                if t < K:
                    inp = cur if prev_action is None else torch.cat([prev_action, cur], dim=1)
                else:  # window slides: refill the cache with the last K-1 steps + the current one
                    kv.reset()
                    inp = torch.cat([*history[len(history) - (K - 1):], cur], dim=1) if K > 1 else cur
                out = model(inp.to(device), cache=kv)[:, -1]
            else:
                out = _uncached_outputs(model, tok, hist_obs, hist_act, hist_rew, targets, t, done, device)
            out = out.float().cpu()
            act = tok.decode(out).numpy()
            if record:
                o = out.numpy().copy()
                o[done] = np.nan
                a_rec = act.astype(np.int64 if tok.discrete else np.float64)
                a_rec[done] = -1 if tok.discrete else np.nan
                result.outputs.append(o)
                result.actions.append(a_rec)
            for i, env in enumerate(envs):
                if done[i]:
                    continue
                a = int(act[i]) if tok.discrete else act[i].astype(env.action_space.dtype)
                o, r, term, trunc, _ = env.step(a)
                returns[i] += float(r)
                lengths[i] += 1
                obs[i] = o
                rtg[i] = (rtg[i] - float(r)) / tok.gamma if model.use_returns else 0.0
                hist_obs[i].append(np.asarray(o))
                hist_act[i].append(act[i])
                hist_rew[i].append(float(r))
                done[i] = bool(term or trunc)
            prev_action = _action_rows(tok, act, t)
            history.append(torch.cat([cur, prev_action], dim=1))
            if len(history) > K:
                history.pop(0)
            if done.all():
                break
    finally:
        model.train(was_training)
    return result


def _uncached_outputs(model: Policy, tok: TrajectoryTokenizer, hist_obs: list[list[np.ndarray]],
                      hist_act: list[list[Any]], hist_rew: list[list[float]], targets: Sequence[float] | None,
                      t: int, done: np.ndarray, device: torch.device) -> Tensor:
    """Reference path: each active env's running context re-encoded by ``encode_rollout``; rows of finished
    envs are zeros (never read)."""
    n_out = tok.n_action_outputs
    out = torch.zeros(len(hist_obs), n_out)
    for i in np.flatnonzero(~done):
        acts = np.asarray(hist_act[i]) if hist_act[i] else (np.zeros(0, np.int64) if tok.discrete
                                                            else np.zeros((0, tok.action_dim)))
        seg = tok.encode_rollout(np.stack(hist_obs[i]), acts, np.asarray(hist_rew[i]),
                                 float(targets[i]) if targets is not None and model.use_returns else 0.0,
                                 key=f"env {i}")
        x = seg.tokens
        idx = seg.meta["predict_index"]
        if not model.use_returns:
            keep = x[:, COL_KIND] != KIND_RETURN
            idx = int(keep[:idx].sum())
            x = x[keep]
        out[i] = model(x[None].to(device))[0, idx].float().cpu()
    return out


def make_envs(env_id: str, n: int) -> list[Any]:
    import gymnasium as gym

    try:
        return [gym.make(env_id) for _ in range(n)]
    except gym.error.Error as exc:
        raise ValueError(f"cannot make Gymnasium env {env_id!r}: {exc}") from None


def evaluate(model: DecisionTransformer, tok: TrajectoryTokenizer, env_id: str, *,
             targets: Sequence[float | None], seeds: Sequence[int], reference: tuple[float, float] | None,
             max_steps: int | None = None, device: torch.device | str | None = None, cache: bool = True,
             env_fn: Callable[[str, int], list[Any]] = make_envs) -> list[dict[str, Any]]:
    """Target-return sweep: one episode per (target, seed), all envs batched into one rollout.
    Returns one row per target: {"target", "returns", episodes, return_mean/std, score_mean/std}.
    For BC models pass targets=[None]."""
    if len(seeds) < 1 or not targets:
        raise ValueError("evaluate needs at least one target and one seed")
    pairs = [(tgt, int(s)) for tgt in targets for s in seeds]
    envs = env_fn(env_id, len(pairs))
    try:
        res = rollout(model, tok, envs, [s for _, s in pairs],
                      targets=[float(tg) if tg is not None else 0.0 for tg, _ in pairs] if model.use_returns else None,
                      max_steps=max_steps, cache=cache, device=device,
                      names=[f"{env_id} env {i} (seed {s})" for i, (_, s) in enumerate(pairs)])
    finally:
        for env in envs:
            env.close()
    rows = []
    for j, tgt in enumerate(targets):
        r = res.returns[j * len(seeds):(j + 1) * len(seeds)]
        rows.append({"target": tgt, "returns": [float(v) for v in r], **summarize_returns(r, reference)})
    return rows


__all__ = ["RolloutResult", "check_env", "evaluate", "make_envs", "rollout"]
