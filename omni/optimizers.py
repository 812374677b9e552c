"""Muon for a Transformer's hidden matrices, AdamW for everything else, as ONE torch optimizer.

``TrainConfig.optimizer="muon"`` (``omni.train.build_optimizer``) builds ``MuonAdamW``: the split of
modded-nanogpt and of "Muon is Scalable for LLM Training". Which parameters Muon trains (``muon_parameters``):
the 2-D weights of the ``nn.Linear`` modules inside an ``omni.trunk.Trunk`` (attention q/k/v/out, cross-
attention, MLP up/down). AdamW keeps the rest: token / position / type embeddings, heads (an LM head tied to
the embedding too), norm scales, biases, conv kernels and patch projections of tokenizers' embedders. A param
group that says ``"muon": True`` or ``False`` (a ``param_groups`` callable's) is taken as it says.

Muon uses torch.optim.Muon (momentum 0.95, Nesterov, 5 Newton-Schulz steps in bf16) with
``adjust_lr_fn="match_rms_adamw"`` (the update scaled by 0.2 sqrt(max(A, B)), so its RMS matches AdamW's):
the same ``lr``, weight decay and schedule then serve both halves.

One optimizer, so the rest of the loop needs no change: ``param_groups`` lists every group (the LambdaLR
schedule drives both halves), ``state_dict`` / ``load_state_dict`` are ``torch.optim.Optimizer``'s over all
of them (a checkpoint resumes bit-identically), ``zero_grad`` clears every gradient. Inside, a
``torch.optim.AdamW`` and a ``torch.optim.Muon`` step the very same group dicts and share this optimizer's
``state``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def muon_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters Muon trains: the weights of every ``nn.Linear`` inside an ``omni.trunk.Trunk``
    (2-D hidden matrices; module docstring). Embeddings, heads, norms, biases, conv kernels are not in it."""
    from omni.trunk import Trunk

    return {id(m.weight) for t in model.modules() if isinstance(t, Trunk) for m in t.modules()
            if isinstance(m, nn.Linear) and m.weight.requires_grad and m.weight.ndim == 2}


def split_groups(groups: list[dict[str, Any]], muon_ids: set[int]) -> list[dict[str, Any]]:
    """Each param group cut into its Muon part (``"muon": True``: the params in ``muon_ids``) and its AdamW
    part (``"muon": False``), the group's other options kept; a group that already says ``"muon"`` is kept
    whole. Empty parts are dropped. Muon takes 2-D params only: a 1-D one marked ``muon`` is a ValueError."""
    out = []
    for g in groups:
        params = list(g["params"])
        if "muon" in g:
            parts = [(bool(g["muon"]), params)]
        else:
            parts = [(True, [p for p in params if id(p) in muon_ids]),
                     (False, [p for p in params if id(p) not in muon_ids])]
        for flag, ps in parts:
            if ps:
                out.append({**g, "params": ps, "muon": flag})
    for g in out:
        if g["muon"] and any(p.ndim != 2 for p in g["params"]):
            shapes = [tuple(p.shape) for p in g["params"] if p.ndim != 2]
            raise ValueError(f"optimizer 'muon': a param group marked muon holds parameters of shapes {shapes}; "
                             "Muon trains 2-D matrices only")
    return out


class MuonAdamW(torch.optim.Optimizer):
    """Muon over the groups with ``"muon": True``, AdamW over the others (module docstring).

    ``groups``: param groups, each with a ``"muon"`` flag (``split_groups``) and optionally its own
    ``weight_decay``; ``lr``, ``betas``, ``eps``, ``weight_decay`` are the defaults (AdamW's ``betas`` / ``eps``
    apply to the AdamW groups only; Muon uses ``momentum``)."""

    def __init__(self, groups: list[dict[str, Any]], *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, fused: bool | None = None) -> None:
        groups = [dict(g) for g in groups]  # the inner optimizers fill their defaults into these dicts
        if any("muon" not in g for g in groups):
            raise ValueError("MuonAdamW: every param group needs a 'muon' flag (omni.optimizers.split_groups)")
        adam = [g for g in groups if not g["muon"]]
        muon = [g for g in groups if g["muon"]]
        self._adamw = torch.optim.AdamW(adam, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                        fused=fused) if adam else None
        self._muon = torch.optim.Muon(muon, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_steps=ns_steps, adjust_lr_fn="match_rms_adamw") if muon else None
        # The same dicts again: this optimizer's param_groups ARE the inner ones' (the schedule's lr reaches both)
        super().__init__(adam + muon, {"lr": lr, "weight_decay": weight_decay})
        self._link()

    def _link(self) -> None:
        """Point the inner optimizers at this one's group dicts and state (again after ``load_state_dict``,
        which builds new ones)."""
        for inner, flag in ((self._adamw, False), (self._muon, True)):
            if inner is not None:
                inner.param_groups = [g for g in self.param_groups if g["muon"] == flag]
                inner.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step of the AdamW groups, then one Muon step of the Muon groups."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in (self._adamw, self._muon):
            if inner is not None:
                inner.step()
        return loss


__all__ = ["MuonAdamW", "muon_parameters", "split_groups"]
