"""``Task``, the base of every task kind, the registry of task classes by kind name (``register_task``) and
what kinds share (``NextTextTokenTask``, the base of the lm and transcribe kinds)."""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni.heads import build_head
from omni.mixture import MixedBatch, eval_batches
from omni.model import OmniModel
from omni.packing import PackedBatch
from omni.segment import Sample
from omni.tokenizers.base import Tokenizer
from omni.tokenizers.text import IGNORE_INDEX, TextTokenizer

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

Row = tuple[str, str, str, str]  # a results-table row: metric, value, secondary metric, held-out data


class Task:
    """Base: a named source of Samples plus the heads and loss that train on them.

    Subclasses implement ``tokenizers``, ``__len__``, ``sample(i, rng)``, ``head_specs()`` (the heads as
    ``omni.heads`` specs: ``make_heads`` builds them, the export rebuilds them) and ``loss(model, hidden, batch,
    index)``, which reads the heads through ``model.forward_head``. A recipe builds a kind by name
    (``task_class``) and scores it through the class: ``eval_options`` (``evaluate``'s keyword arguments from
    the recipe config), ``result_row`` (its results-table row) and, for a user's (items, labels) data,
    ``from_items``.
    """

    kind: ClassVar[str] = "task"  # the registered kind name (set by ``register_task``)
    metric_names: tuple[str, ...] = ()  # the extra metrics ``loss`` returns (besides the loss)

    def __init__(self, name: str, weight: float = 1.0, loss_weight: float = 1.0) -> None:
        if not _NAME.match(name):
            raise ValueError(f"task name {name!r} must be an identifier (it names heads and metrics)")
        if not (weight >= 0 and math.isfinite(weight)):
            raise ValueError(f"task {name!r}: weight must be a finite number >= 0, got {weight!r}")
        self.name, self.weight, self.loss_weight = name, float(weight), float(loss_weight)

    def tokenizers(self) -> dict[str, Tokenizer]:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def sample(self, i: int, rng: np.random.Generator) -> Sample:
        raise NotImplementedError

    def head_specs(self) -> dict[str, dict[str, Any]]:
        """{head name: spec}: the heads this task trains, as ``omni.heads.build_head`` specs."""
        raise NotImplementedError

    def make_heads(self, model: OmniModel) -> dict[str, nn.Module]:
        """The heads of ``head_specs()``, built for ``model``'s trunk and embedders as the export rebuilds them."""
        d = model.trunk_config.d_model
        return {name: build_head(spec, d, model.embedders, name) for name, spec in self.head_specs().items()}

    def loss(self, model: OmniModel, hidden: Tensor, batch: MixedBatch, index: int) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    def samples(self, model: OmniModel, count: int = 8) -> list[Any]:
        """What a person looks at after an evaluation: ``omni.plots.Picture`` / ``Clip`` / ``Note`` items of the
        first ``count`` held-out items (their tags start with the task's name), which the Trainer logs to
        TensorBoard (its ``samples_fn``; ``task_samples``). None by default."""
        return []

    def evaluate(self, model: OmniModel, **options: Any) -> dict[str, float]:
        """The task's held-out metric(s) over all its items (omni.tasks docstring); ``model`` is the OmniModel."""
        raise NotImplementedError(f"{type(self).__name__} {self.name!r} has no held-out metric")

    @staticmethod
    def eval_options(entry: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
        """``evaluate``'s keyword arguments from the task's config entry and the recipe config: none here."""
        return {}

    def result_row(self, result: Mapping[str, float]) -> Row:
        """The results-table row of an ``evaluate`` result: here every metric in one cell."""
        return "", ", ".join(f"{k} {v:.4g}" for k, v in result.items() if k != "seconds"), "", ""

    @staticmethod
    def from_items(entry: Mapping[str, Any], items: Sequence[Any], labels: Sequence[Any],
                   text: TextTokenizer) -> dict[str, Any]:
        """The constructor's data keywords for a user's (items, labels) split (``text``: the shared text
        tokenizer); a kind that reads such data overrides this."""
        raise ValueError("this task kind takes no (items, labels) data")

    @classmethod
    def reads_items(cls) -> bool:
        """Whether the kind builds from a user's (items, labels) data (overrides ``from_items``)."""
        return cls.from_items is not Task.from_items

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, weight={self.weight}, items={len(self)})"


# ----------------------------------------------------------------------------------------------------
# The registry: kind name -> Task class


TASK_KINDS: dict[str, type[Task]] = {}
T = TypeVar("T", bound=type[Task])


def register_task(kind: str) -> Callable[[T], T]:
    """Class decorator: register a Task subclass as kind ``kind`` (its ``kind``, the name configs use)."""

    def wrap(cls: T) -> T:
        registered = TASK_KINDS.setdefault(kind, cls)
        if registered is not cls:
            raise ValueError(f"task kind {kind!r} is already registered by {registered.__qualname__}")
        cls.kind = kind
        return cls

    return wrap


def task_class(kind: str) -> type[Task]:
    """The Task class registered as ``kind``."""
    if kind not in TASK_KINDS:
        raise ValueError(f"unknown task kind {kind!r}; registered: {', '.join(TASK_KINDS)}")
    return TASK_KINDS[kind]


def task_samples(model: OmniModel, tasks: Sequence[Task], count: int | None = None) -> list[Any]:
    """Every task's ``samples`` on ``model`` (the OmniModel), in task order (``count`` items each, default each
    kind's own): a Trainer ``samples_fn`` is ``lambda model, step: task_samples(model.omni, tasks)``."""
    return [item for task in tasks for item in (task.samples(model) if count is None else task.samples(model, count))]


# ----------------------------------------------------------------------------------------------------
# Helpers of the task kinds


def masked_mean(values: Tensor, weights: Tensor) -> Tensor:
    """sum(values * w) / max(sum(w), 1): static shapes (no boolean indexing) for torch.compile."""
    return (values * weights).sum() / weights.sum().clamp_min(1.0)


@contextmanager
def inference(model: nn.Module) -> Iterator[torch.device]:
    """no_grad + eval mode (restored afterwards); yields the model's device."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield next(model.parameters()).device
    finally:
        model.train(was_training)


def packed_items(task: Task, model: OmniModel, row_length: int, rows: int) -> Iterator[tuple[PackedBatch, Tensor]]:
    """Every item of ``task`` once, packed ``rows`` x ``row_length`` tokens at a time (``eval_batches``): (batch on
    ``model``'s device, its hidden states (B, T, d)), in eval mode without gradients."""
    rng = np.random.default_rng(0)  # (not drawn from: every item is taken whole)
    samples = [task.sample(i, rng) for i in range(len(task))]
    with inference(model) as dev:
        for batch in eval_batches(samples, row_length, rows):
            batch = batch.to(dev)
            yield batch, model(batch)


def packed_eval_options(entry: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``eval_options`` of a task scored on packed items: ``rows`` x ``row_length`` tokens at a time, as training."""
    return {"row_length": cfg["row_length"], "rows": cfg["rows"]}


class NextTextTokenTask(Task):
    """A task whose head predicts the next text token (LM head tied to the text embedding) and whose loss is
    next-token cross-entropy over the text tokens of its documents. Subclasses name their ``text_tokenizer``."""

    text_tokenizer: TextTokenizer

    def head_specs(self) -> dict[str, dict[str, Any]]:
        return {self.name: {"type": "lm", "vocab_size": self.text_tokenizer.vocab_size, "tie_to": "text"}}

    def loss(self, model: OmniModel, hidden: Tensor, batch: MixedBatch,
             index: int) -> tuple[Tensor, dict[str, Tensor]]:
        targets = batch.targets["text"]
        mine = (batch.token_task("text") == index) & (targets != IGNORE_INDEX)
        capturing = hidden.is_cuda and torch.cuda.is_current_stream_capturing()  # a CUDA graph: static shapes too
        if not torch.compiler.is_compiling() and not capturing:
            # Eager: the head only on this task's targets. Its vocabulary-wide matmul and log-softmax are the
            # largest cost of a CPU step, and every text task's head would otherwise run on every text token
            # (asr + text: 29% more tokens/s on the CPU multimodal presets).
            keep = mine.nonzero().squeeze(1)
            logits = model.heads[self.name](model.gather(hidden, batch, "text")[keep]).float()
            y, n = targets[keep], max(keep.numel(), 1)
            return (F.cross_entropy(logits, y, reduction="sum") / n,
                    {"token_accuracy": (logits.argmax(-1) == y).float().sum() / n})
        logits = model.forward_head(hidden, batch, self.name, "text").float()  # static shapes for torch.compile
        w, safe = mine.float(), targets.clamp_min(0)  # ignored rows get weight 0; keep the index valid
        nll = F.cross_entropy(logits, safe, reduction="none")
        acc = (logits.argmax(-1) == safe).float()
        return masked_mean(nll, w), {"token_accuracy": masked_mean(acc, w)}
