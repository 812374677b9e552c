"""Offline RL on the shared trunk: ``ActionTask`` and ``TrajectoryPolicy``, the task as an
``omni.interfaces.Policy`` that ``omni.rl``'s rollouts drive (as they drive the DecisionTransformer)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from omni.heads import masked_action_loss
from omni.mixture import MixedBatch
from omni.model import OmniModel
from omni.rl import action_bounds, rescale_actions
from omni.rl import evaluate as rollouts
from omni.segment import Sample
from omni.tasks.base import Row, Task, inference, register_task
from omni.tokenizers.base import Tokenizer
from omni.tokenizers.trajectory import TrajectoryTokenizer
from omni.trunk import KVCache


@register_task("action")
class ActionTask(Task):
    """Offline RL (Decision-Transformer style): windows of ``tokenizer.context`` steps with a random start,
    the action predicted at each state row. ``episodes``: dicts as ``omni.rl.load_episodes`` returns."""

    def __init__(self, name: str, tokenizer: TrajectoryTokenizer, episodes: Sequence[Mapping[str, Any]], *,
                 weight: float = 1.0, loss_weight: float = 1.0, env_id: str | None = None,
                 reference: tuple[float, float] | None = None) -> None:
        super().__init__(name, weight, loss_weight)
        self.env_id = env_id  # the Gymnasium env the episodes come from (rollout evaluation)
        self.reference = None if reference is None else (float(reference[0]), float(reference[1]))  # (random, expert)
        if not len(episodes):
            raise ValueError(f"task {name!r}: no episodes")
        try:  # (center, half-width) of continuous actions: the tanh head is rescaled to them
            self.bounds = None if tokenizer.discrete else action_bounds(tokenizer)
        except ValueError as exc:
            raise ValueError(f"task {name!r}: {exc}") from None
        self.tokenizer, self.episodes = tokenizer, episodes
        self.metric_names = ("accuracy",) if tokenizer.discrete else ()
        self.lengths = [int(np.asarray(ep["actions"]).shape[0]) for ep in episodes]

    def tokenizers(self) -> dict[str, Tokenizer]:
        return {"trajectory": self.tokenizer}

    def __len__(self) -> int:
        return len(self.episodes)

    def sample(self, i: int, rng: np.random.Generator) -> Sample:
        ep = self.episodes[i]
        key = f"{self.name}/{ep.get('key', i)}"
        start = int(rng.integers(0, max(self.lengths[i] - self.tokenizer.context, 0) + 1))
        return Sample([self.tokenizer.encode(ep, key=key, start=start)], key=f"{key}@{start}")

    def head_specs(self) -> dict[str, dict[str, Any]]:
        tok = self.tokenizer
        return {self.name: {"type": "action", "n_outputs": tok.n_action_outputs, "discrete": tok.discrete}}

    def head_output(self, model: OmniModel, hidden: Tensor) -> Tensor:
        """Action head on trajectory hidden states (..., d): logits, or actions rescaled to the bounds."""
        out = model.heads[self.name](hidden)
        if self.bounds is None:
            return out
        center, scale = (b.to(out.device) for b in self.bounds)
        return rescale_actions(out, center, scale)

    def predict(self, model: OmniModel, hidden: Tensor, batch: MixedBatch) -> Tensor:
        """Head output at every trajectory token of a packed batch."""
        return self.head_output(model, OmniModel.gather(hidden, batch, "trajectory"))

    def loss(self, model: OmniModel, hidden: Tensor, batch: MixedBatch,
             index: int) -> tuple[Tensor, dict[str, Tensor]]:
        tok = self.tokenizer
        keep = tok.action_target_mask(batch.tokens["trajectory"]) & (batch.token_task("trajectory") == index)
        return masked_action_loss(self.predict(model, hidden, batch), batch.targets["trajectory"], keep, tok.discrete)

    def evaluate(self, model: OmniModel, *, seeds: Sequence[int] = tuple(range(10_000, 10_005)),
                 target: float | None = None, max_steps: int | None = None, cache: bool = True) -> dict[str, float]:
        """Rollouts in ``env_id`` with ``omni.rl.evaluate`` (one episode per seed, batched, KV-cached), target
        return ``target`` (default: the expert reference), normalised by ``reference`` as
        recipes/decision_transformer.py does. Default seeds: 10000.., disjoint from the data's env seeds."""
        if self.env_id is None or self.reference is None:
            raise ValueError(f"task {self.name!r}: rollout evaluation needs env_id and reference (random, expert)")
        target = self.reference[1] if target is None else float(target)
        with inference(model) as dev:
            row = rollouts(TrajectoryPolicy(model, self), self.tokenizer, self.env_id, targets=[target],
                           seeds=list(seeds), reference=self.reference, max_steps=max_steps, device=dev,
                           cache=cache)[0]
        return {k: float(row[k]) for k in ("score_mean", "score_std", "return_mean", "return_std", "episodes",
                                           "target")}

    @staticmethod
    def eval_options(entry: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
        """Seeds 10000.. as recipes/decision_transformer.py (disjoint from the data's), the entry's ``target``."""
        return {"seeds": range(10_000, 10_000 + entry.get("eval_seeds", 5)), "target": entry.get("target")}

    def result_row(self, r: Mapping[str, float]) -> Row:
        return ("normalised score", f"{r['score_mean']:.1f} ± {r['score_std']:.1f}",
                f"return {r['return_mean']:.1f} ± {r['return_std']:.1f} at target {r['target']:.1f}",
                f"{self.env_id} rollouts, {r['episodes']:.0f} seeds")


class TrajectoryPolicy(nn.Module):
    """An ActionTask of a multitask OmniModel as an ``omni.interfaces.Policy`` (the interface ``omni.rl.rollout``
    drives, which the DecisionTransformer has too), so rollouts reuse omni.rl unchanged.

    tokens (B, T, F) -> the trajectory embedder -> the shared trunk (causal; positions continue after the
    cache, i.e. the token index inside the window, which is what a packed training window has: a trajectory
    segment is alone in its document, positions 0..3L-1) -> the task's action head."""

    use_returns = True  # ActionTask trains return-conditioned (R, s, a) windows
    tokens_per_step = 3

    def __init__(self, model: OmniModel, task: ActionTask) -> None:
        super().__init__()
        self.omni, self.task = model, task
        self.context, self.discrete = task.tokenizer.context, task.tokenizer.discrete

    def forward(self, tokens: Tensor, cache: KVCache | None = None) -> Tensor:
        h = self.omni.trunk(self.omni.embedders["trajectory"](tokens), mask=None if cache is not None else "causal",
                            cache=cache)
        return self.task.head_output(self.omni, h)

    def new_cache(self, batch_size: int, device: torch.device | str | None = None) -> KVCache:
        return self.omni.trunk.new_cache(batch_size, self.tokens_per_step * self.context, device=device)
