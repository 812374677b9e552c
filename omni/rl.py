"""Decision Transformer and behaviour cloning on the shared trunk, with rollout evaluation.

    episodes = load_episodes("data/gym-CartPole-v1")              # shards from `omni data gym`
    tok = make_tokenizer(episodes, env_spaces, context=20)        # state stats, rtg scale, timesteps
    data = encode_episodes(tok, episodes)                         # every step once, as token rows
    loader = WindowLoader(data, batch_size=64, use_returns=True)  # (tokens, targets) windows
    model = DecisionTransformer(tok, preset("dt", positions="none"))
    loss, metrics = dt_loss(model, next(iter(loader)))
    rows = evaluate(model, tok, "CartPole-v1", targets=[500, 250], seeds=range(5), reference=(22.0, 500.0))

Model. trajectory tokens (omni.tokenizers.trajectory) -> embedder -> causal Trunk -> ActionHead read
at every state token (a_t is predicted from s_t). ``use_returns=False`` is the behaviour-cloning
baseline: the same trunk fed (s_t, a_t) pairs only, the return-to-go rows dropped. Filtered BC is BC on
the top 10% of episodes by return (``top_episodes``). Continuous actions: tanh head (or, with
``action_squash=None``, a plain Linear) rescaled to the action bounds, MSE loss; discrete: logits, cross-entropy.

Training windows. An episode's steps are encoded once (``encode_episodes``) into a (steps, 3, F) tensor;
a training sample is a window of ``context`` consecutive steps, gathered on the device per batch
(``WindowLoader``: TensorLoader over window starts, so seeded, rank-split, resumable). Every window
starting in [0, T - context] is one sample per epoch (plus the start-0 window of an episode shorter
than the context). Windows are RIGHT-padded to ``context`` steps with rows of kind ``KIND_PAD``: under
causal attention no real token ever sees a later pad, so every batch uses the plain "causal" mask (the
SDPA flash/cuDNN path) and the pads only need to leave the loss, which ``action_target_mask`` (kind ==
state) already does. Short episodes are padded (``short="pad"``), or rejected / dropped.

Rollouts (``rollout``). Many envs are stepped together (one gymnasium env per row, lockstep in time; a
finished env is frozen and ignored) and the policy runs batched. With ``cache=True`` the KV cache
serves the growing window: step t appends [a_{t-1}, R_t, s_t] (one forward of 3 tokens) and reads a_t at
s_t. Once the window is full (t >= context) it slides, and then every hidden state depends on the
window's first step, so no cache can be reused exactly: the cache is reset and refilled with the last
context-1 steps + [R_t, s_t] in one batched forward (what the official DT computes every step). A
"rolling" cache would silently change the policy (old entries would have attended to steps outside the
window), so it is not offered. ``cache=False`` re-encodes each env's whole running context with the
tokenizer's own ``encode_rollout`` every step: the reference the tests compare against (equal actions,
equal head outputs to 1e-5, for episodes longer than the context).

Scores: ``normalized_score`` = 100 * (R - R_random) / (R_expert - R_random), mean +- std over episodes
(std with ddof=1), per target return.
"""

from __future__ import annotations

import io
import json
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from omni.data.memory import TensorLoader
from omni.heads import ActionHead, masked_action_loss
from omni.interfaces import Policy
from omni.tokenizers.trajectory import (
    COL_KIND,
    COL_RTG,
    COL_STATE,
    COL_TIMESTEP,
    KIND_ACTION,
    KIND_RETURN,
    KIND_STATE,
    TrajectoryTokenizer,
)
from omni.trunk import KVCache, Trunk, TrunkConfig

KIND_PAD = 3  # right-padding rows of training windows (the embedder treats them as zero actions)


# ----------------------------------------------------------------------------------------------------
# Scores


def normalized_score(ret: float | np.ndarray, random_return: float, expert_return: float) -> float | np.ndarray:
    """100 * (R - R_random) / (R_expert - R_random): 0 = random policy, 100 = expert (D4RL convention)."""
    if not (math.isfinite(random_return) and math.isfinite(expert_return)) or expert_return == random_return:
        raise ValueError(f"normalized_score needs finite, different references, got random={random_return}, "
                         f"expert={expert_return}")
    return 100.0 * (np.asarray(ret, dtype=np.float64) - random_return) / (expert_return - random_return) \
        if isinstance(ret, np.ndarray) else 100.0 * (float(ret) - random_return) / (expert_return - random_return)


def summarize_returns(returns: Sequence[float], reference: tuple[float, float] | None) -> dict[str, float]:
    """mean / std (ddof=1; 0 for one episode) of the returns and of their normalised scores."""
    r = np.asarray(returns, dtype=np.float64)
    if r.size == 0:
        raise ValueError("summarize_returns got no returns")
    std = lambda a: float(a.std(ddof=1)) if a.size > 1 else 0.0  # noqa: E731
    out = {"episodes": int(r.size), "return_mean": float(r.mean()), "return_std": std(r)}
    if reference is not None:
        s = normalized_score(r, *reference)
        out.update(score_mean=float(s.mean()), score_std=std(s))
    return out


# ----------------------------------------------------------------------------------------------------
# Episodes


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
                         shuffle=False, fields=("npz",), max_corrupt_fraction=max_corrupt_fraction)
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


# ----------------------------------------------------------------------------------------------------
# Encoded dataset and window batches


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


# ----------------------------------------------------------------------------------------------------
# The model


def action_bounds(tok: TrajectoryTokenizer) -> tuple[Tensor, Tensor]:
    """(center, half-width) of a continuous tokenizer's action bounds, float32, for ``rescale_actions``."""
    low, high = tok.action_low, tok.action_high
    if low is None or high is None or not (np.isfinite(low).all() and np.isfinite(high).all()):
        raise ValueError("continuous actions need finite action_low/action_high on the tokenizer "
                         "(the tanh head is rescaled to them)")
    return torch.tensor((high + low) / 2, dtype=torch.float32), torch.tensor((high - low) / 2, dtype=torch.float32)


def rescale_actions(out: Tensor, center: Tensor, scale: Tensor) -> Tensor:
    """The continuous action head's output (..., A), [-1, 1] for the tanh head -> actions in the bounds
    ``action_bounds`` describes (center + scale * out)."""
    return center + scale * out


class CarriedTensors(nn.Module):
    """Tensors of a converted checkpoint that the model never reads, held as buffers so that the model hands
    the checkpoint back whole (a Hugging Face Decision Transformer's GPT-2 token / position tables and state /
    return predictors: omni.interop.hf_decision_transformer). Named by their source names, '.' written '/'."""

    def __init__(self, shapes: Mapping[str, Sequence[int]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_buffer(name.replace(".", "/"), torch.zeros(tuple(shape)))

    def tensors(self) -> dict[str, Tensor]:
        """{source name: tensor}."""
        return {name.replace("/", "."): t for name, t in self.named_buffers()}


class DecisionTransformer(nn.Module):
    """Trajectory embedder -> causal Trunk -> action head at every token (read at state tokens).

    use_returns=False: behaviour cloning on (s, a) tokens (the return-to-go rows are never fed).
    action_dropout: in training, each past action token's value is hidden with this probability (the
    token keeps its timestep). On datasets of smooth controllers "repeat the last action" predicts the
    data almost as well as the state does, and a model that leans on it copies its own first, timid
    actions in rollouts; hiding actions makes it read the state. 0 (default) is the official DT.
    carried: tensors of a converted checkpoint the model does not read (``CarriedTensors``), kept in its
    state dict; None (default) adds nothing.
    action_squash: the continuous ActionHead's ``squash``: "tanh" (default) or None (unbounded outputs).
    """

    def __init__(self, tokenizer: TrajectoryTokenizer, trunk: TrunkConfig, *, use_returns: bool = True,
                 action_dropout: float = 0.0, carried: CarriedTensors | None = None,
                 action_squash: Literal["tanh"] | None = "tanh") -> None:
        super().__init__()
        if not 0.0 <= action_dropout < 1.0:
            raise ValueError(f"action_dropout must be in [0, 1), got {action_dropout}")
        self.use_returns = bool(use_returns)
        self.action_dropout = float(action_dropout)
        self.discrete = tokenizer.discrete
        self.context = tokenizer.context
        self.tokens_per_step = 3 if use_returns else 2
        self.feature_dim = tokenizer.feature_dim
        self.trunk_config = trunk
        self.embed = tokenizer.embedder(trunk.d_model)
        self.trunk = Trunk(trunk)
        self.head = ActionHead(trunk.d_model, tokenizer.n_action_outputs, tokenizer.discrete, squash=action_squash)
        if not tokenizer.discrete:
            center, scale = action_bounds(tokenizer)
            self.register_buffer("action_center", center)
            self.register_buffer("action_scale", scale)
        self.carried = carried

    def forward(self, tokens: Tensor, cache: KVCache | None = None) -> Tensor:
        """tokens (B, T, F) -> head output (B, T, n_action_outputs) at every token, causal attention.
        With ``cache`` the tokens are appended to it (positions continue after the cached ones)."""
        return self.forward_head(self.forward_features(tokens, cache))

    def forward_features(self, tokens: Tensor, cache: KVCache | None = None) -> Tensor:
        """tokens (B, T, F) -> trunk hidden states (B, T, d) (causal; ``cache`` as in ``forward``)."""
        if tokens.dim() != 3 or tokens.shape[-1] != self.feature_dim:
            raise ValueError(f"DecisionTransformer expects tokens (B, T, {self.feature_dim}), got {tuple(tokens.shape)}")
        keep = None
        if self.training and self.action_dropout > 0.0:
            keep = torch.rand(tokens.shape[:-1] + (1,), device=tokens.device) >= self.action_dropout
        return self.trunk(self.embed(tokens, keep), mask=None if cache is not None else "causal", cache=cache)

    def forward_head(self, features: Tensor) -> Tensor:
        """Hidden states (..., d) -> action logits, or continuous actions rescaled to the bounds (..., n_out)."""
        out = self.head(features)
        return out if self.discrete else rescale_actions(out, self.action_center, self.action_scale)

    def new_cache(self, batch_size: int, device: torch.device | str | None = None) -> KVCache:
        """A KV cache holding one full window (tokens_per_step * context tokens)."""
        return self.trunk.new_cache(batch_size, self.tokens_per_step * self.context, device=device)


def build_decision_transformer(config: dict[str, Any], tokenizers: dict[str, Any]) -> DecisionTransformer:
    """Export builder (config.json "builder": "omni.rl:build_decision_transformer"); ``config["carried"]``
    ({name: shape}, optional) rebuilds the ``CarriedTensors`` of a converted checkpoint, ``config["action_squash"]``
    (optional, default "tanh") the head's squash."""
    carried = CarriedTensors(config["carried"]) if config.get("carried") else None
    return DecisionTransformer(tokenizers["trajectory"], TrunkConfig(**config["trunk"]),
                               use_returns=config.get("use_returns", True), carried=carried,
                               action_squash=config.get("action_squash", "tanh"))


def action_loss(model: nn.Module, tok: TrajectoryTokenizer, tokens: Tensor, targets: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """``model(tokens)``'s action loss at state tokens (``omni.heads.masked_action_loss``: cross-entropy / MSE)
    and, for discrete actions, accuracy. tokens (B, T, F), targets (B, T, A')."""
    pred, tokens, targets = [t.reshape(-1, t.shape[-1]) for t in (model(tokens), tokens, targets)]  # (B*T, .)
    return masked_action_loss(pred, targets, tok.action_target_mask(tokens), tok.discrete)


# ----------------------------------------------------------------------------------------------------
# Rollouts


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


def reference_returns(manifest: Mapping[str, Any], episodes: Sequence[Mapping[str, Any]]
                      ) -> tuple[tuple[float, float], str]:
    """((random, expert) returns for the normalised score, where they come from): the manifest's
    (``omni data gym`` measures them with a random policy and the noise-free expert policy, scripted or
    trained; Minari ports carry ref_min/max_score), else the dataset's min / max episode return, with a
    warning."""
    refs = manifest.get("reference_returns") or {}
    lo, hi = refs.get("random"), refs.get("expert")
    if lo is not None and hi is not None:
        return (float(lo), float(hi)), "manifest (random policy / noise-free expert policy)"
    import warnings

    warnings.warn("dataset has no random/expert reference returns: using the dataset's min/max episode return")
    rets = [episode_return(ep) for ep in episodes]
    lo, hi = (min(rets) if lo is None else lo), (max(rets) if hi is None else hi)
    return (float(lo), float(hi)), "dataset min/max return"


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


__all__ = ["CarriedTensors", "DecisionTransformer", "EpisodeData", "KIND_PAD", "RolloutResult", "SpaceSpec",
           "WindowLoader", "action_bounds", "action_loss", "build_decision_transformer", "check_env",
           "encode_episodes", "episode_return", "evaluate", "gather_windows", "load_episodes", "make_envs",
           "make_tokenizer", "normalized_score", "reference_returns", "rescale_actions", "rollout", "summarize_returns",
           "top_episodes"]
