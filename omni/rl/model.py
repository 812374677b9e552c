"""The Decision Transformer: trajectory embedder -> causal Trunk -> action head, its export builder and loss."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from omni.attention_patterns import check_causal
from omni.heads import ActionHead, masked_action_loss
from omni.model import CarriedTensors  # a converted checkpoint's unread tensors (HF DT's GPT-2 tables, predictors)
from omni.tokenizers.trajectory import TrajectoryTokenizer
from omni.trunk import KVCache, Trunk, TrunkConfig


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


def check_causal_attention(attention: Any, n_layers: int) -> None:
    """ValueError in one line for an attention pattern that leaves a Decision Transformer's (causal) token only
    itself (omni.attention_patterns.check_causal)."""
    check_causal(attention, n_layers, "a Decision Transformer is causal")


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
        check_causal_attention(trunk.attention, trunk.n_layers)
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
        """A KV cache holding one full window (tokens_per_step * context tokens); with attention patterns a
        RingKVCache, whose windowed layers hold their window only (fixed memory, whatever the context)."""
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


__all__ = ["CarriedTensors", "DecisionTransformer", "action_bounds", "action_loss", "build_decision_transformer",
           "check_causal_attention", "rescale_actions"]
