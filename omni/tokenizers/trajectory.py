"""Decision-Transformer trajectories: (return-to-go, state, action) triples, one token each.

An episode of T steps becomes, for a window of L = min(context, T - start) steps,
3L tokens ordered ``R_0, s_0, a_0, R_1, s_1, a_1, ...``. Every token is one float32 row of
``feature_dim = 3 + state_dim + A'`` columns with a fixed layout (unused columns are 0):

    col 0              kind: 0 = return-to-go, 1 = state, 2 = action   (KIND_RETURN/STATE/ACTION)
    col 1              timestep (absolute step index in the episode, an integer stored as float)
    col 2              return-to-go / rtg_scale                        (return rows only)
    cols 3 .. 3+S      normalised state (s - mean) / std               (state rows only)
    cols 3+S ..        the action: action_dim floats (continuous) or   (action rows only)
                       1 column holding the discrete id as a float

Keep these tokens float32 end to end: the timestep and discrete-id columns hold integers up to
``max_timestep`` / ``n_actions``, which bf16 cannot represent exactly beyond 256.

``positions`` is the token index 0..3L-1 (the trunk's RoPE / learned positions); the episode
time lives in the timestep column and gets its own learned embedding, as in the official DT.
``targets`` is (3L, A') float32 holding a_t on the *state* row of step t (the DT predicts a_t
from s_t; causal attention keeps a_t itself out of view) and 0 elsewhere; the per-token loss
mask is ``action_target_mask(tokens)`` (kind == state), usable on packed device tensors, and
``action_loss`` computes the masked cross-entropy / MSE without data-dependent shapes.

Policies:
- Timesteps must lie in [0, max_timestep): a larger one is an error naming the sample (a silent
  clamp would give every late step the same time embedding). The embedder clamps anyway so a
  bad tensor cannot trigger a device-side index assert.
- An episode longer than ``context`` encoded without ``start=`` is truncated to its first
  ``context`` steps with a warning naming the key; use ``windows()``/``encode_windows()`` (or an
  explicit ``start``) to cover a whole episode.
- Observations with T+1 rows (Gymnasium / Minari record the final observation) lose the last row.
- Returns-to-go come from the *whole* episode's rewards (``returns_to_go``, discount ``gamma``)
  before a window is cut, or from a precomputed ``"returns_to_go"`` field.
- State statistics live in ``config()`` (``state_mean``/``state_std``), so ``save``/``load``
  round-trips them; ``fit`` computes them. Unfitted = identity normalisation.

Online rollouts: either re-encode the running context each step with ``encode_rollout`` (states
so far, actions so far, rewards so far, target return; a dummy last action is appended and the
action is read from the output at ``meta["predict_index"]``), or, with a KV cache, append
``encode_step(...)`` rows (R_t, s_t), predict at s_t, then append ``encode_step(..., action=a_t)``'s
action row.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from omni.segment import Role, Segment
from omni.tokenizers.base import Tokenizer, TypeEmbedding, register_tokenizer

KIND_RETURN = 0
KIND_STATE = 1
KIND_ACTION = 2

COL_KIND = 0
COL_TIMESTEP = 1
COL_RTG = 2
COL_STATE = 3

STD_FLOOR = 1e-6


def returns_to_go(rewards: Sequence[float] | np.ndarray, gamma: float = 1.0) -> np.ndarray:
    """Reverse discounted cumulative sum: ``R_t = r_t + gamma * R_{t+1}`` (float64, shape (T,))."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"returns_to_go expects rewards of shape (T,), got {r.shape}")
    if gamma == 1.0:
        # one vectorised pass; summing from the end keeps the same order as the recursion
        return np.cumsum(r[::-1])[::-1].copy()
    out = np.empty_like(r)
    acc = 0.0
    for t in range(r.shape[0] - 1, -1, -1):
        acc = r[t] + gamma * acc
        out[t] = acc
    return out


def windows(
    length: int,
    context: int,
    *,
    n: int | None = None,
    stride: int = 1,
    full: bool = True,
    rng: np.random.Generator | int | None = None,
) -> list[int]:
    """Start indices of training windows of ``context`` steps over an episode of ``length`` steps.

    n=None: every ``stride``-th start from 0 (stride <= context), plus the last full window's
    start, so every step is covered (stride=1: all sliding windows; stride=context: a tiling).
    n given: ``n`` random starts (with replacement) drawn from ``rng``; ``full=True`` keeps each
    window full length (starts in [0, length - context]), ``full=False`` draws from [0, length)
    like the official DT sampler (late windows are shorter).
    """
    if length < 1:
        raise ValueError(f"windows needs an episode of at least 1 step, got length={length}")
    if context < 1 or not 1 <= stride <= context:
        # stride > context would leave steps that no window covers
        raise ValueError(f"windows needs context >= 1 and 1 <= stride <= context, got {context}, {stride}")
    last = max(length - context, 0) if full or n is None else length - 1
    if n is None:
        starts = list(range(0, last + 1, stride))
        if starts[-1] != last:
            starts.append(last)
        return starts
    if n < 0:
        raise ValueError(f"windows needs n >= 0, got {n}")
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    return [int(s) for s in gen.integers(0, last + 1, size=n)]


class _Prepared:
    """A validated episode: float64 normalised states, actions, rtg, int64 timesteps (all length T)."""

    __slots__ = ("states", "actions", "rtg", "timesteps")

    def __init__(self, states: np.ndarray, actions: np.ndarray, rtg: np.ndarray, timesteps: np.ndarray) -> None:
        self.states, self.actions, self.rtg, self.timesteps = states, actions, rtg, timesteps

    def __len__(self) -> int:
        return int(self.states.shape[0])


@register_tokenizer()
class TrajectoryTokenizer(Tokenizer):
    """Decision-Transformer tokenizer: episodes -> interleaved (return-to-go, state, action) tokens.

    Give ``action_dim`` for continuous actions (Box) or ``n_actions`` for discrete ones, not both.
    """

    modality: ClassVar[str] = "trajectory"
    role: ClassVar[Role] = Role.CAUSAL

    def __init__(
        self,
        state_dim: int,
        action_dim: int | None = None,
        n_actions: int | None = None,
        *,
        rtg_scale: float = 1000.0,
        max_timestep: int = 1000,
        context: int = 20,
        gamma: float = 1.0,
        state_mean: Sequence[float] | None = None,
        state_std: Sequence[float] | None = None,
        action_low: Sequence[float] | float | None = None,
        action_high: Sequence[float] | float | None = None,
    ) -> None:
        if not _is_pos_int(state_dim):
            raise ValueError(f"state_dim must be a positive int, got {state_dim!r}")
        if (action_dim is None) == (n_actions is None):
            raise ValueError("give exactly one of action_dim (continuous) or n_actions (discrete)")
        if action_dim is not None and not _is_pos_int(action_dim):
            raise ValueError(f"action_dim must be a positive int, got {action_dim!r}")
        if n_actions is not None and not _is_pos_int(n_actions):
            raise ValueError(f"n_actions must be a positive int, got {n_actions!r}")
        if not (isinstance(rtg_scale, (int, float)) and math.isfinite(rtg_scale) and rtg_scale > 0):
            raise ValueError(f"rtg_scale must be a finite number > 0, got {rtg_scale!r}")
        if not _is_pos_int(max_timestep):
            raise ValueError(f"max_timestep must be a positive int, got {max_timestep!r}")
        if not _is_pos_int(context):
            raise ValueError(f"context must be a positive int, got {context!r}")
        if not (isinstance(gamma, (int, float)) and 0.0 < gamma <= 1.0):
            raise ValueError(f"gamma must be in (0, 1], got {gamma!r}")
        self.state_dim = int(state_dim)
        self.action_dim = None if action_dim is None else int(action_dim)
        self.n_actions = None if n_actions is None else int(n_actions)
        self.rtg_scale = float(rtg_scale)
        self.max_timestep = int(max_timestep)
        self.context = int(context)
        self.gamma = float(gamma)

        if (state_mean is None) != (state_std is None):
            raise ValueError("give both state_mean and state_std, or neither")
        self.state_mean: np.ndarray | None = None
        self.state_std: np.ndarray | None = None
        if state_mean is not None and state_std is not None:
            self._set_stats(
                _vector(state_mean, self.state_dim, "state_mean"), _vector(state_std, self.state_dim, "state_std")
            )

        self.action_low: np.ndarray | None = None
        self.action_high: np.ndarray | None = None
        if action_low is not None or action_high is not None:
            if self.discrete:
                raise ValueError("action_low/action_high only apply to continuous actions (action_dim)")
            assert self.action_dim is not None
            low, high = (
                None if v is None else _vector(v, self.action_dim, name, allow_inf=True)
                for v, name in ((action_low, "action_low"), (action_high, "action_high"))
            )
            if low is not None and high is not None and bool((low > high).any()):
                raise ValueError(f"action_low must be <= action_high, got {low.tolist()} > {high.tolist()}")
            self.action_low, self.action_high = low, high

    # -- layout ----------------------------------------------------------------------------------------
    @property
    def discrete(self) -> bool:
        """True for discrete actions (n_actions), False for continuous (action_dim)."""
        return self.n_actions is not None

    @property
    def n_action_outputs(self) -> int:
        """Width of the action head: n_actions logits (discrete) or action_dim values (continuous)."""
        return self.n_actions if self.n_actions is not None else int(self.action_dim)  # type: ignore[arg-type]

    @property
    def action_cols(self) -> int:
        """Columns of the action field in a token row (and of ``targets``): action_dim, or 1 id."""
        return 1 if self.discrete else int(self.action_dim)  # type: ignore[arg-type]

    @property
    def col_action(self) -> int:
        """First column of the action field."""
        return COL_STATE + self.state_dim

    @property
    def feature_dim(self) -> int:
        """Columns of one token row: 3 + state_dim + action_cols."""
        return COL_STATE + self.state_dim + self.action_cols

    @property
    def fitted(self) -> bool:
        """Whether state normalisation statistics are set."""
        return self.state_mean is not None

    def config(self) -> dict[str, Any]:
        return {
            "state_dim": self.state_dim,
            "action_dim": self.action_dim,
            "n_actions": self.n_actions,
            "rtg_scale": self.rtg_scale,
            "max_timestep": self.max_timestep,
            "context": self.context,
            "gamma": self.gamma,
            "state_mean": None if self.state_mean is None else [float(v) for v in self.state_mean],
            "state_std": None if self.state_std is None else [float(v) for v in self.state_std],
            "action_low": None if self.action_low is None else [float(v) for v in self.action_low],
            "action_high": None if self.action_high is None else [float(v) for v in self.action_high],
        }

    # -- fitting ---------------------------------------------------------------------------------------
    def fit(self, data: Iterable[Any]) -> "TrajectoryTokenizer":
        """Per-dimension state mean / std (population, floored at 1e-6) over every state of every episode.

        Uses the same states ``encode`` sees (a trailing final observation is dropped).
        Episodes are merged with Chan's parallel update so long datasets stay numerically stable.
        """
        count = 0
        mean = np.zeros(self.state_dim, dtype=np.float64)
        m2 = np.zeros(self.state_dim, dtype=np.float64)
        for i, episode in enumerate(data):
            key = _episode_key(episode, f"fit[{i}]")
            fields = _fields(episode, key)
            obs = self._states(fields, key)
            if "actions" in fields:
                n_act = np.asarray(fields["actions"]).shape[0] if np.ndim(fields["actions"]) > 0 else 0
                if obs.shape[0] == n_act + 1:
                    obs = obs[:-1]
            if obs.shape[0] == 0:
                continue
            n_b = obs.shape[0]
            mean_b = obs.mean(axis=0)
            m2_b = ((obs - mean_b) ** 2).sum(axis=0)
            total = count + n_b
            delta = mean_b - mean
            mean = mean + delta * (n_b / total)
            m2 = m2 + m2_b + delta**2 * (count * n_b / total)
            count = total
        if count == 0:
            raise ValueError("fit got no states: pass an iterable of non-empty episodes")
        self._set_stats(mean, np.sqrt(m2 / count))
        return self

    def _set_stats(self, mean: np.ndarray, std: np.ndarray) -> None:
        self.state_mean = mean.astype(np.float64)
        # floor: a constant state dimension (e.g. a fixed flag) must not divide by zero
        self.state_std = np.maximum(std.astype(np.float64), STD_FLOOR)

    def normalize_states(self, states: np.ndarray) -> np.ndarray:
        """(s - mean) / std in float64; identity until fitted."""
        if self.state_mean is None or self.state_std is None:
            return np.asarray(states, dtype=np.float64)
        return (np.asarray(states, dtype=np.float64) - self.state_mean) / self.state_std

    # -- encoding --------------------------------------------------------------------------------------
    def encode(self, raw: Any, *, key: str = "", start: int | None = None) -> Segment:
        """One window of an episode as 3L tokens (see the module docstring for the layout).

        ``raw``: a dict (or an object with these attributes, e.g. a Minari EpisodeData) with
        "observations" (T, S) or (T+1, S), "actions" (T,) int or (T, A) float, "rewards" (T,)
        or "returns_to_go" (T,), and optional "timesteps" (T,) int (default 0..T-1).
        ``start``: first step of the window; None means 0 and warns if the episode is longer
        than ``context`` (it is truncated to the first ``context`` steps).
        """
        prep = self._prepare(raw, key)
        if start is None:
            if len(prep) > self.context:
                warnings.warn(
                    f"trajectory sample {key!r}: episode of {len(prep)} steps is longer than context="
                    f"{self.context}; truncated to its first {self.context} steps (pass start= or use "
                    "encode_windows to cover the whole episode)",
                    stacklevel=2,
                )
            start = 0
        return self._segment(prep, start, key)

    def encode_windows(
        self,
        raw: Any,
        *,
        key: str = "",
        n: int | None = None,
        stride: int = 1,
        full: bool = True,
        rng: np.random.Generator | int | None = None,
    ) -> list[Segment]:
        """Segments for ``windows(T, context, ...)`` of one episode, validating/normalising it once."""
        prep = self._prepare(raw, key)
        starts = windows(len(prep), self.context, n=n, stride=stride, full=full, rng=rng)
        return [self._segment(prep, s, key) for s in starts]

    def encode_rollout(
        self,
        states: Any,
        actions: Any,
        rewards: Any,
        target_return: float,
        *,
        timesteps: Any = None,
        key: str = "rollout",
    ) -> Segment:
        """The running context of an online rollout, re-encoded from scratch (no KV cache).

        states: (t+1, S) states observed so far (the last one is the current state); actions:
        the t actions taken so far; rewards: the t rewards received so far; target_return: the
        desired (unscaled) episode return. Returns-to-go follow ``R_{k+1} = (R_k - r_k) / gamma``
        from ``R_0 = target_return``; a dummy (zero) action is appended for the current step and
        only the last ``context`` steps are kept. Read the action head output at token
        ``meta["predict_index"]`` (the current state token). ``targets`` is None.
        """
        s = np.asarray(states)
        if s.ndim == 0 or s.shape[0] < 1:
            raise ValueError(f"trajectory sample {key!r}: rollout needs at least the current state")
        t = s.shape[0] - 1
        r = np.asarray(rewards, dtype=np.float64).reshape(-1)
        if r.shape[0] != t:
            raise ValueError(
                f"trajectory sample {key!r}: rollout has {t + 1} states so needs {t} rewards, got {r.shape[0]}"
            )
        if not np.isfinite(r).all():
            raise ValueError(f"trajectory sample {key!r}: 'rewards' contains NaN or inf")
        if not math.isfinite(float(target_return)):
            raise ValueError(f"trajectory sample {key!r}: target_return must be finite, got {target_return!r}")
        rtg = np.empty(t + 1, dtype=np.float64)
        rtg[0] = float(target_return)
        for k in range(t):
            rtg[k + 1] = (rtg[k] - r[k]) / self.gamma
        a = np.asarray(actions)
        if self.discrete:
            a = a.reshape(-1).astype(np.int64) if a.size == 0 else a
            dummy = np.zeros((1,) + a.shape[1:], dtype=a.dtype if a.size else np.int64)
        else:
            a = a.reshape(0, self.action_dim) if a.size == 0 else a
            dummy = np.zeros((1,) + a.shape[1:], dtype=np.float64)
        if a.shape[0] != t:
            raise ValueError(
                f"trajectory sample {key!r}: rollout has {t + 1} states so needs {t} actions, got {a.shape[0]}"
            )
        episode = {"observations": s, "actions": np.concatenate([a, dummy]), "returns_to_go": rtg}
        if timesteps is not None:
            episode["timesteps"] = timesteps
        prep = self._prepare(episode, key)
        seg = self._segment(prep, max(len(prep) - self.context, 0), key)
        seg.targets = None
        seg.meta["predict_index"] = len(seg) - 2
        return seg

    def encode_step(
        self,
        state: Any,
        timestep: int,
        *,
        return_to_go: float,
        action: Any = None,
        key: str = "rollout",
    ) -> Tensor:
        """Token rows for one step of a KV-cached rollout: (2, F) rows [R_t, s_t], or (3, F) with a_t.

        ``return_to_go`` is unscaled. Their positions continue the running sequence:
        3 * (t - window_start) + (0, 1, 2).
        """
        s = np.asarray(state)[None]
        if action is None:
            act = np.zeros((1,), dtype=np.int64) if self.discrete else np.zeros((1, self.action_dim))
        else:
            act = np.asarray(action)[None]
        episode = {
            "observations": s,
            "actions": act,
            "returns_to_go": np.asarray([float(return_to_go)]),
            "timesteps": np.asarray([timestep], dtype=np.int64),
        }
        rows = self._segment(self._prepare(episode, key), 0, key).tokens
        return rows if action is not None else rows[:2]

    def _segment(self, prep: _Prepared, start: int, key: str) -> Segment:
        T = len(prep)
        if not isinstance(start, (int, np.integer)) or isinstance(start, bool) or not 0 <= start < T:
            raise ValueError(f"trajectory sample {key!r}: start={start!r} is outside the episode of {T} steps")
        start = int(start)
        L = min(self.context, T - start)
        sl = slice(start, start + L)
        S, ca, A = self.state_dim, self.col_action, self.action_cols
        tok = np.zeros((L, 3, self.feature_dim), dtype=np.float32)
        tok[:, :, COL_KIND] = (KIND_RETURN, KIND_STATE, KIND_ACTION)
        tok[:, :, COL_TIMESTEP] = prep.timesteps[sl, None]
        tok[:, 0, COL_RTG] = prep.rtg[sl] / self.rtg_scale
        tok[:, 1, COL_STATE : COL_STATE + S] = prep.states[sl]
        act = prep.actions[sl].reshape(L, A)
        tok[:, 2, ca : ca + A] = act
        tgt = np.zeros((L, 3, A), dtype=np.float32)
        tgt[:, 1] = act  # a_t is predicted from the state token of step t
        return Segment(
            modality=self.modality,
            tokens=torch.from_numpy(tok.reshape(3 * L, self.feature_dim)),
            positions=torch.arange(3 * L, dtype=torch.int64),
            role=self.role,
            targets=torch.from_numpy(tgt.reshape(3 * L, A)),
            meta={"start": start, "steps": L},
        )

    def _states(self, fields: Mapping[str, Any], key: str) -> np.ndarray:
        if "observations" not in fields:
            raise ValueError(f"trajectory sample {key!r}: missing 'observations' (T, {self.state_dim}) array")
        obs = fields["observations"]
        if isinstance(obs, Mapping):
            raise TypeError(
                f"trajectory sample {key!r}: 'observations' is a dict ({sorted(obs)}); flatten it to a (T, "
                f"{self.state_dim}) array first"
            )
        arr = np.asarray(obs)
        if arr.dtype.kind not in "fiub":
            raise TypeError(f"trajectory sample {key!r}: 'observations' must be numeric, got dtype {arr.dtype}")
        if arr.ndim == 1 and self.state_dim == 1:
            arr = arr[:, None]
        if arr.ndim != 2 or arr.shape[1] != self.state_dim:
            raise ValueError(
                f"trajectory sample {key!r}: 'observations' must be (T, {self.state_dim}), got {arr.shape}"
            )
        arr = arr.astype(np.float64)
        if not np.isfinite(arr).all():
            raise ValueError(f"trajectory sample {key!r}: 'observations' contains NaN or inf")
        return arr

    def _actions(self, fields: Mapping[str, Any], key: str) -> np.ndarray:
        if "actions" not in fields:
            raise ValueError(f"trajectory sample {key!r}: missing 'actions'")
        a = np.asarray(fields["actions"])
        if self.discrete:
            if a.dtype.kind not in "iu":
                raise TypeError(
                    f"trajectory sample {key!r}: 'actions' must be integer ids for a discrete tokenizer "
                    f"(n_actions={self.n_actions}), got dtype {a.dtype}"
                )
            if a.ndim == 2 and a.shape[1] == 1:
                a = a[:, 0]
            if a.ndim != 1:
                raise ValueError(f"trajectory sample {key!r}: discrete 'actions' must be (T,), got {a.shape}")
            if a.size and (a.min() < 0 or a.max() >= self.n_actions):  # type: ignore[operator]
                raise ValueError(
                    f"trajectory sample {key!r}: 'actions' ids must be in [0, {self.n_actions}), "
                    f"got range [{a.min()}, {a.max()}]"
                )
            return a.astype(np.int64)
        if a.dtype.kind not in "fiu":
            raise TypeError(f"trajectory sample {key!r}: 'actions' must be numeric, got dtype {a.dtype}")
        if a.ndim == 1 and self.action_dim == 1:
            a = a[:, None]
        if a.ndim != 2 or a.shape[1] != self.action_dim:
            raise ValueError(f"trajectory sample {key!r}: 'actions' must be (T, {self.action_dim}), got {a.shape}")
        a = a.astype(np.float64)
        if not np.isfinite(a).all():
            raise ValueError(f"trajectory sample {key!r}: 'actions' contains NaN or inf")
        return a

    def _prepare(self, raw: Any, key: str) -> _Prepared:
        fields = _fields(raw, key)
        obs = self._states(fields, key)
        actions = self._actions(fields, key)
        T = actions.shape[0]
        if T == 0:
            raise ValueError(f"trajectory sample {key!r}: empty episode (0 actions)")
        if obs.shape[0] == T + 1:
            obs = obs[:-1]  # Gymnasium/Minari keep the final observation, which has no action
        elif obs.shape[0] != T:
            raise ValueError(
                f"trajectory sample {key!r}: 'observations' has {obs.shape[0]} rows but 'actions' has {T} "
                f"(expected {T} or {T + 1} observations)"
            )
        if "returns_to_go" in fields:
            rtg = self._per_step(fields["returns_to_go"], "returns_to_go", T, key)
        elif "rewards" in fields:
            rtg = returns_to_go(self._per_step(fields["rewards"], "rewards", T, key), self.gamma)
        else:
            raise ValueError(f"trajectory sample {key!r}: needs 'rewards' (T,) or 'returns_to_go' (T,)")
        if "timesteps" in fields and fields["timesteps"] is not None:
            ts = np.asarray(fields["timesteps"])
            if ts.dtype.kind not in "iu":
                raise TypeError(f"trajectory sample {key!r}: 'timesteps' must be integers, got dtype {ts.dtype}")
            ts = ts.reshape(-1) if ts.ndim == 2 and ts.shape[1] == 1 else ts
            if ts.shape != (T,):
                raise ValueError(f"trajectory sample {key!r}: 'timesteps' must be ({T},), got {ts.shape}")
            ts = ts.astype(np.int64)
        else:
            ts = np.arange(T, dtype=np.int64)
        if ts.min() < 0 or ts.max() >= self.max_timestep:
            raise ValueError(
                f"trajectory sample {key!r}: timesteps must be in [0, max_timestep={self.max_timestep}), got "
                f"range [{ts.min()}, {ts.max()}]; raise max_timestep (the timestep embedding size)"
            )
        return _Prepared(self.normalize_states(obs), actions, rtg, ts)

    @staticmethod
    def _per_step(value: Any, name: str, T: int, key: str) -> np.ndarray:
        arr = np.asarray(value)
        if arr.dtype.kind not in "fiub":
            raise TypeError(f"trajectory sample {key!r}: {name!r} must be numeric, got dtype {arr.dtype}")
        if arr.shape != (T,):
            raise ValueError(f"trajectory sample {key!r}: {name!r} must be ({T},) to match 'actions', got {arr.shape}")
        arr = arr.astype(np.float64)
        if not np.isfinite(arr).all():
            raise ValueError(f"trajectory sample {key!r}: {name!r} contains NaN or inf")
        return arr

    # -- device side -----------------------------------------------------------------------------------
    def embedder(self, d_model: int) -> nn.Module:
        return TrajectoryEmbedder(
            d_model,
            state_dim=self.state_dim,
            action_dim=self.action_dim,
            n_actions=self.n_actions,
            max_timestep=self.max_timestep,
        )

    @staticmethod
    def action_target_mask(tokens: Tensor) -> Tensor:
        """bool (N,): rows that carry an action target (the state tokens); works on packed device tensors."""
        return (tokens[..., COL_KIND] - KIND_STATE).abs() < 0.5

    def action_loss(self, pred: Tensor, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean action loss over state rows (``omni.heads.masked_action_loss``): cross-entropy on logits
        (discrete) or MSE (continuous). pred (N, n_action_outputs) head output for every packed trajectory
        token; tokens (N, F) and targets (N, action_cols) the packed tokens and targets."""
        from omni.heads import masked_action_loss  # the one action loss (heads stay off the tokenizers' imports)

        return masked_action_loss(pred, targets, self.action_target_mask(tokens), self.discrete)[0]

    def decode(self, head_output: Tensor | np.ndarray) -> Tensor:
        """Env actions from the action head: argmax int64 ids (discrete) or values clipped to the bounds."""
        x = torch.as_tensor(head_output)
        if x.dim() == 0 or x.shape[-1] != self.n_action_outputs:
            raise ValueError(
                f"trajectory decode expects (..., {self.n_action_outputs}) head output, got {tuple(x.shape)}"
            )
        if self.discrete:
            return x.argmax(dim=-1).to(torch.int64)
        if self.action_low is not None:
            x = torch.maximum(x, torch.as_tensor(self.action_low, dtype=x.dtype, device=x.device))
        if self.action_high is not None:
            x = torch.minimum(x, torch.as_tensor(self.action_high, dtype=x.dtype, device=x.device))
        return x


class TrajectoryEmbedder(nn.Module):
    """Per-token embedding of trajectory rows, chosen by the kind column.

    rtg rows: Linear(1, d); state rows: Linear(S, d); action rows: Embedding(n_actions, d) or
    Linear(A, d). All three run on every row and ``torch.where`` picks one (static shapes, no
    data-dependent Python branching). Then + Embedding(max_timestep, d)(timestep), LayerNorm
    (the official DT's embed_ln), and the modality TypeEmbedding.
    """

    def __init__(
        self,
        d_model: int,
        *,
        state_dim: int,
        action_dim: int | None,
        n_actions: int | None,
        max_timestep: int,
    ) -> None:
        super().__init__()
        self.state_dim = state_dim
        self.n_actions = n_actions
        self.max_timestep = max_timestep
        self.col_action = COL_STATE + state_dim
        self.action_cols = 1 if n_actions is not None else int(action_dim)  # type: ignore[arg-type]
        self.feature_dim = self.col_action + self.action_cols
        self.embed_return = nn.Linear(1, d_model)
        self.embed_state = nn.Linear(state_dim, d_model)
        self.embed_action: nn.Module = (
            nn.Embedding(n_actions, d_model) if n_actions is not None else nn.Linear(self.action_cols, d_model)
        )
        self.embed_timestep = nn.Embedding(max_timestep, d_model)
        self.embed_ln = nn.LayerNorm(d_model)
        self.type_embedding = TypeEmbedding(d_model)

    def forward(self, x: Tensor, action_keep: Tensor | None = None) -> Tensor:
        """x (..., F) rows -> (..., d). action_keep (..., 1), 0/1: action rows where it is 0 carry no action
        value (only their timestep), the Decision Transformer's action dropout in training."""
        if x.shape[-1] != self.feature_dim:
            raise ValueError(f"trajectory embedder expects (..., {self.feature_dim}) tokens, got {tuple(x.shape)}")
        kind = x[..., COL_KIND : COL_KIND + 1]
        # clamp: out-of-range indices would be a device-side assert; encode already rejects them
        t = x[..., COL_TIMESTEP].round().long().clamp(0, self.max_timestep - 1)
        w = self.embed_state.weight
        h_ret = self.embed_return(x[..., COL_RTG : COL_RTG + 1].to(w.dtype))
        h_state = self.embed_state(x[..., COL_STATE : self.col_action].to(w.dtype))
        if self.n_actions is not None:
            ids = x[..., self.col_action].round().long().clamp(0, self.n_actions - 1)
            h_act = self.embed_action(ids)
        else:
            h_act = self.embed_action(x[..., self.col_action :].to(w.dtype))
        if action_keep is not None:
            h_act = h_act * action_keep.to(h_act.dtype)
        h = torch.where(kind < 0.5, h_ret, torch.where(kind < 1.5, h_state, h_act))
        h = h + self.embed_timestep(t)
        return self.type_embedding(self.embed_ln(h))


def _is_pos_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1


def _vector(v: Any, n: int, name: str, *, allow_inf: bool = False) -> np.ndarray:
    arr = np.asarray(v, dtype=np.float64)
    if arr.ndim == 0:
        arr = np.full(n, float(arr))
    if arr.shape != (n,):
        raise ValueError(f"{name} must have {n} values, got shape {arr.shape}")
    if np.isnan(arr).any() or (not allow_inf and not np.isfinite(arr).all()):
        raise ValueError(f"{name} contains NaN{'' if allow_inf else ' or inf'}: {arr.tolist()}")
    if name == "state_std" and (arr <= 0).any():
        raise ValueError(f"state_std must be > 0, got {arr.tolist()}")
    return arr


_EPISODE_FIELDS = ("observations", "actions", "rewards", "returns_to_go", "timesteps")


def _fields(raw: Any, key: str) -> Mapping[str, Any]:
    """The episode as a mapping: a dict as is, or the known attributes of an object (Minari EpisodeData)."""
    if isinstance(raw, Mapping):
        return raw
    found = {name: getattr(raw, name) for name in _EPISODE_FIELDS if getattr(raw, name, None) is not None}
    if not found:
        raise TypeError(
            f"trajectory sample {key!r}: expected an episode dict with 'observations', 'actions', 'rewards', "
            f"got {type(raw).__name__}"
        )
    return found


def _episode_key(raw: Any, default: str) -> str:
    k = raw.get("__key__") if isinstance(raw, Mapping) else getattr(raw, "id", None)
    return default if k is None else str(k)
