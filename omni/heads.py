"""Task heads: trunk features in, predictions out, and the registry that describes and rebuilds them.

A head maps features row by row: ``head(x)``, x (N, d) (or any (..., d)) -> (N, out). A per-segment head
(``ClassificationHead``) first pools tokens into one row per segment with ``pool_segments``, a free function of
segment ids, so a packed batch (segment ids from the packer) and a uniform batch (each row of (B, n, d) one
segment) go through the same code. Reading a head on a ``PackedBatch`` is the model's job
(``OmniModel.forward_head``, via ``packed_segments``).

Registry. Each head type is registered under its spec "type"; ``head.spec()`` gives the JSON spec an export
records, ``{"type": ..., **options}``, and ``build_head(spec, d_model, embedders)`` rebuilds the same head
from it (the export's "omni" builder and ``Task.make_heads`` both build through it):

    classification  n_classes, pool ("mean" | "cls"), norm_eps (the head LayerNorm's eps; None: no head norm;
                    recorded only when not the default 1e-5)
    lm              vocab_size, tie_to (optional: the modality whose embedding table the head shares)
    action          n_outputs, discrete, squash (continuous: "tanh" or None, a plain Linear; recorded only
                    when not the default "tanh")

``register_head("name")`` adds a type: a ``Head`` subclass whose ``__init__`` takes ``(d_model, **options)``.

``masked_action_loss`` is the one action loss (the Decision Transformer, the multitask ActionTask and
``TrajectoryTokenizer.action_loss`` all call it).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, ClassVar, Literal, Mapping, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni.packing import PackedBatch, segment_mean

Pool = Literal["mean", "cls"]


def pool_segments(x: Tensor, mode: Pool, segment_ids: Tensor | None = None, n_segments: int | None = None) -> Tensor:
    """One row per segment: the mean of its tokens ("mean") or its first token ("cls").

    x (N, d) with ``segment_ids`` (N,) in [0, n_segments), each segment's tokens contiguous -> (n_segments, d);
    x (B, n, d) without segment ids, each row one segment -> (B, d). Static shapes (torch.compile)."""
    if segment_ids is None:
        return x[:, 0] if mode == "cls" else x.mean(1)
    if n_segments is None:
        raise ValueError("pool_segments: segment_ids need n_segments")
    if mode == "mean":
        return segment_mean(x, segment_ids, n_segments)
    counts = torch.zeros(n_segments, dtype=torch.long, device=x.device).index_add_(
        0, segment_ids, torch.ones_like(segment_ids))
    return x[(counts.cumsum(0) - counts).clamp_max(x.shape[0] - 1)]  # each segment's first token


def packed_segments(hidden: Tensor, batch: PackedBatch, modality: str) -> tuple[Tensor, Tensor, int]:
    """A packed batch's ``modality`` tokens of hidden (B, T, d): (tokens (N_m, d) in packing order, their
    segment ids (N_m,), the modality's segment count S_m)."""
    tokens = hidden.reshape(-1, hidden.shape[-1])[batch.index[modality]]
    return tokens, batch.segment_of[modality], batch.segment_document[modality].shape[0]


# ----------------------------------------------------------------------------------------------------
# Registry


class Head(nn.Module):
    """A registered head: features (..., d) -> predictions (..., out). ``spec()`` describes it for an export,
    ``from_spec`` rebuilds it; ``per_segment`` heads take (tokens, segment ids, segment count) and give one
    row per segment."""

    kind: ClassVar[str] = ""  # the spec's "type" (set by register_head)
    per_segment: ClassVar[bool] = False

    def options(self) -> dict[str, Any]:
        """The keyword arguments that, with d_model, rebuild this head."""
        raise NotImplementedError

    def spec(self) -> dict[str, Any]:
        """The JSON spec an export records: {"type": kind, **options}."""
        return {"type": self.kind, **self.options()}

    @classmethod
    def from_spec(cls, options: dict[str, Any], d_model: int, embedders: Mapping[str, nn.Module]) -> Head:
        """The head ``options`` describe, on a trunk of width ``d_model`` whose modality embedders are given."""
        return cls(d_model, **options)


HEADS: dict[str, type[Head]] = {}
H = TypeVar("H", bound=type[Head])


def register_head(kind: str) -> Callable[[H], H]:
    """Class decorator: make a Head subclass buildable from specs ``{"type": kind, ...}``."""

    def wrap(cls: H) -> H:
        if HEADS.get(kind, cls) is not cls:
            raise ValueError(f"head type {kind!r} is already registered by {HEADS[kind].__qualname__}")
        cls.kind = kind
        HEADS[kind] = cls
        return cls

    return wrap


def build_head(spec: Mapping[str, Any], d_model: int, embedders: Mapping[str, nn.Module] | None = None,
               name: str = "head") -> Head:
    """The head a spec ({"type": registered type, **options}) describes; ``name`` is for error messages."""
    options = dict(spec)
    kind = options.pop("type", None)
    if kind not in HEADS:
        raise ValueError(f"head {name!r} has type {kind!r}; expected one of {', '.join(HEADS)}")
    try:
        return HEADS[kind].from_spec(options, d_model, embedders or {})
    except ValueError as exc:
        raise ValueError(f"head {name!r}: {exc}") from exc


# ----------------------------------------------------------------------------------------------------
# The built-in heads


HEAD_NORM_EPS = 1e-5  # ClassificationHead's default LayerNorm eps (torch's)


@register_head("classification")
class ClassificationHead(Head):
    """Pool -> LayerNorm -> Linear: one prediction per segment (the mean of its tokens, or its first, CLS, token).
    ``norm_eps=None`` drops the LayerNorm (the trunk's final norm is the last, as in timm's token-pooled ViTs)."""

    per_segment = True

    def __init__(self, d_model: int, n_classes: int, pool: Pool = "mean",
                 norm_eps: float | None = HEAD_NORM_EPS) -> None:
        super().__init__()
        if pool not in ("mean", "cls"):
            raise ValueError(f"pool must be 'mean' or 'cls', got {pool!r}")
        self.pool, self.norm_eps = pool, norm_eps
        self.norm = nn.Identity() if norm_eps is None else nn.LayerNorm(d_model, eps=norm_eps)
        with warnings.catch_warnings():
            # n_classes=0 (a converted backbone, HF's ViTModel, waiting for a run's head): torch warns that
            # initialising its empty weight does nothing, which is all right here, on every conversion and load
            warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op", UserWarning)
            self.proj = nn.Linear(d_model, n_classes)
            nn.init.zeros_(self.proj.weight)  # start from uniform predictions (as big_vision's head)
            nn.init.zeros_(self.proj.bias)

    def options(self) -> dict[str, Any]:
        eps = {} if self.norm_eps == HEAD_NORM_EPS else {"norm_eps": self.norm_eps}  # older specs stay as they were
        return {"n_classes": self.proj.out_features, "pool": self.pool, **eps}

    def forward(self, x: Tensor, segment_ids: Tensor | None = None, n_segments: int | None = None) -> Tensor:
        """x (N, d) tokens with ``segment_ids`` (N,) -> logits (n_segments, n_classes); x (B, n, d) without,
        each row one segment -> (B, n_classes). A packed batch's segments: ``OmniModel.forward_head``."""
        return self.proj(self.norm(pool_segments(x, self.pool, segment_ids, n_segments)))


@register_head("lm")
class LMHead(Head):
    """Next-token logits (..., d) -> (..., vocab); ``tie_to`` shares the weight with an embedding table."""

    def __init__(self, d_model: int, vocab_size: int, tie_to: nn.Embedding | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, vocab_size, bias=False)
        self.tied = tie_to is not None
        self.tied_modality: str | None = None  # the modality of the shared table, when built from a spec
        if tie_to is not None:
            if tie_to.weight.shape != self.proj.weight.shape:
                raise ValueError(f"cannot tie LM head {tuple(self.proj.weight.shape)} to embedding "
                                 f"{tuple(tie_to.weight.shape)}")
            self.proj.weight = tie_to.weight
        else:
            nn.init.normal_(self.proj.weight, std=0.02)

    def options(self) -> dict[str, Any]:
        if self.tied and self.tied_modality is None:
            raise ValueError("this LM head shares an embedding table its spec cannot name: build it with "
                             "build_head({'type': 'lm', 'vocab_size': ..., 'tie_to': modality}, ...)")
        tie = {"tie_to": self.tied_modality} if self.tied else {}
        return {"vocab_size": self.proj.out_features, **tie}

    @classmethod
    def from_spec(cls, options: dict[str, Any], d_model: int, embedders: Mapping[str, nn.Module]) -> Head:
        tie = options.pop("tie_to", None)
        if tie is None:
            return cls(d_model, **options)
        if tie not in embedders:
            raise ValueError(f"the LM head ties to {tie!r}, which is not one of the model's modalities "
                             f"({', '.join(embedders)})")
        table = next((m for m in embedders[tie].modules() if isinstance(m, nn.Embedding)), None)
        if table is None:
            raise ValueError(f"the LM head ties to {tie!r}, whose embedder has no nn.Embedding")
        head = cls(d_model, tie_to=table, **options)
        head.tied_modality = tie
        return head

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden (..., d) -> logits (..., vocab)."""
        return self.proj(hidden)


@register_head("action")
class ActionHead(Head):
    """Discrete action logits (n_outputs = number of actions) or continuous actions: tanh-squashed to [-1, 1]
    (``squash="tanh"``, the default) or the Linear's output as it is (``squash=None``)."""

    def __init__(self, d_model: int, n_outputs: int, discrete: bool, squash: Literal["tanh"] | None = "tanh") -> None:
        super().__init__()
        if squash not in ("tanh", None):
            raise ValueError(f"squash must be 'tanh' or None, got {squash!r}")
        self.discrete, self.squash = discrete, squash
        self.proj = nn.Linear(d_model, n_outputs)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def options(self) -> dict[str, Any]:
        squash = {} if self.squash == "tanh" else {"squash": self.squash}  # older specs stay as they were
        return {"n_outputs": self.proj.out_features, "discrete": self.discrete, **squash}

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden (..., d) -> (..., n_outputs)."""
        out = self.proj(hidden)
        return out if self.discrete or self.squash is None else torch.tanh(out)


def masked_action_loss(pred: Tensor, targets: Tensor, weight: Tensor,
                       discrete: bool) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted mean action loss over rows -> (loss, {"accuracy"} for discrete actions, else {}).

    pred (N, n_outputs): logits (discrete: cross-entropy against the action id in targets[:, 0]) or actions
    (continuous: MSE against targets (N, A)); weight (N,) bool or float, 0 for rows without an action target.
    Weights, not boolean indexing, keep shapes static for torch.compile."""
    w = weight.to(torch.float32)
    total = w.sum().clamp_min(1.0)
    if not discrete:
        return (((pred.float() - targets.float()) ** 2).mean(-1) * w).sum() / total, {}
    y = targets[..., 0].round().long()  # rows without a target hold 0, a valid class, at weight 0
    nll = F.cross_entropy(pred.float(), y, reduction="none")
    return (nll * w).sum() / total, {"accuracy": ((pred.argmax(-1) == y).float() * w).sum() / total}
