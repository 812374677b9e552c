"""``ClassifyTask``: one segment of any modality, one class label -> ClassificationHead -> cross-entropy."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from omni.mixture import MixedBatch
from omni.model import OmniModel
from omni.segment import Sample, Segment
from omni.tasks.base import Row, Task, inference, masked_mean, packed_eval_options, packed_items, register_task
from omni.tokenizers.base import Tokenizer
from omni.tokenizers.text import TextTokenizer


@register_task("classify")
class ClassifyTask(Task):
    """One segment of ``tokenizer``'s modality per sample, one class label -> ClassificationHead.

    ``items[i]`` is a raw input for ``tokenizer.encode`` (encoded when drawn) or an already encoded Segment.
    ``attention``: how many of the first items an image task's ``samples`` also shows under the model's attention
    rollout (0: none). ``class_names``: one name per class, recorded in the export (``omni predict`` prints them).
    """

    metric_names = ("accuracy",)

    def __init__(self, name: str, tokenizer: Tokenizer, items: Sequence[Any], labels: Sequence[int], n_classes: int,
                 *, weight: float = 1.0, loss_weight: float = 1.0, pool: str = "mean",
                 label_smoothing: float = 0.0, attention: int = 0, class_names: Sequence[str] | None = None) -> None:
        super().__init__(name, weight, loss_weight)
        if len(items) != len(labels) or not len(items):
            raise ValueError(f"task {name!r}: {len(items)} items but {len(labels)} labels (need as many, >= 1)")
        bad = [int(y) for y in labels if not 0 <= int(y) < n_classes]
        if bad:
            raise ValueError(f"task {name!r}: labels must lie in [0, {n_classes}), got {bad[:5]}")
        if class_names is not None and len(class_names) != n_classes:
            raise ValueError(f"task {name!r}: {len(class_names)} class names for {n_classes} classes")
        self.class_names = [str(c) for c in class_names] if class_names is not None else None
        self.tokenizer, self.items, self.labels = tokenizer, items, [int(y) for y in labels]
        self.n_classes, self.pool, self.label_smoothing = int(n_classes), pool, float(label_smoothing)
        self.modality, self.attention = tokenizer.modality, max(int(attention), 0)

    def tokenizers(self) -> dict[str, Tokenizer]:
        return {self.modality: self.tokenizer}

    def __len__(self) -> int:
        return len(self.items)

    def sample(self, i: int, rng: np.random.Generator) -> Sample:
        key = f"{self.name}/{i}"
        raw = self.items[i]
        seg = raw if isinstance(raw, Segment) else self.tokenizer.encode(raw, key=key)
        y = self.labels[i]
        seg = Segment(seg.modality, seg.tokens, seg.positions, seg.role,
                      targets=torch.full((len(seg),), y, dtype=torch.long), meta=seg.meta)
        return Sample([seg], key=key, label=y)

    def head_specs(self) -> dict[str, dict[str, Any]]:
        return {self.name: {"type": "classification", "n_classes": self.n_classes, "pool": self.pool}}

    def logits(self, model: OmniModel, hidden: Tensor, batch: MixedBatch) -> Tensor:
        """(S_m, n_classes) for every segment of the modality (other tasks' segments included)."""
        return model.forward_head(hidden, batch, self.name, self.modality)

    def segment_labels(self, batch: MixedBatch) -> Tensor:
        """(S_m,) label of every segment (0 for segments without a label of this task)."""
        m = self.modality
        n = batch.segment_document[m].shape[0]
        y = batch.targets[m].long() if m in batch.targets else torch.zeros_like(batch.segment_of[m])
        return torch.zeros(n, dtype=torch.long, device=y.device).scatter(0, batch.segment_of[m], y)

    def loss(self, model: OmniModel, hidden: Tensor, batch: MixedBatch,
             index: int) -> tuple[Tensor, dict[str, Tensor]]:
        logits = self.logits(model, hidden, batch).float()
        y = self.segment_labels(batch)
        w = (batch.segment_task(self.modality) == index).float()
        nll = F.cross_entropy(logits, y, reduction="none", label_smoothing=self.label_smoothing)
        acc = (logits.argmax(-1) == y).float()
        return masked_mean(nll, w), {"accuracy": masked_mean(acc, w)}

    def evaluate(self, model: OmniModel, *, row_length: int = 1024, rows: int = 8) -> dict[str, float]:
        """Top-1 accuracy and mean cross-entropy (no label smoothing) over every item, as recipes/vit.py
        reports on its test split. Items are packed ``rows x row_length`` tokens at a time."""
        correct, nll = 0, 0.0
        for batch, hidden in packed_items(self, model, row_length, rows):
            logits = self.logits(model, hidden, batch).float()  # one row per segment = per item
            y = self.segment_labels(batch)
            correct += int((logits.argmax(-1) == y).sum())
            nll += float(F.cross_entropy(logits, y, reduction="sum"))
        return {"accuracy": correct / len(self), "loss": nll / len(self), "items": float(len(self))}

    def samples(self, model: OmniModel, count: int = 8) -> list[Any]:
        """An image task's first ``count`` held-out images (as the model saw them: the tokenizer's ``decode``) with
        their predicted class and probability over the true one (``<name>/predictions``); with ``attention`` > 0,
        also the first ``attention`` images under the model's attention rollout (``omni.introspect.image_attention``,
        read by the query the head pools) with their top-2 classes (``<name>/attention``,
        ``omni.plots.attention_grid``), computed after the first picture is drawn (never without matplotlib).
        Other modalities have no picture."""
        decode = getattr(self.tokenizer, "decode", None)
        if self.modality != "image" or decode is None or count < 1:
            return []
        from omni.mixture import eval_batches
        from omni.plots import Picture, attention_grid, image_grid

        rng = np.random.default_rng(0)  # (not drawn from: every item is taken whole)
        shown, heated = min(count, len(self)), min(self.attention, len(self))
        chosen = [self.sample(i, rng) for i in range(max(shown, heated))]
        row = -(-sum(len(s) for s in chosen) // 128) * 128  # one packed row holds them all
        with inference(model) as dev:
            batch = next(iter(eval_batches(chosen, row, 1))).to(dev)
            probs = self.logits(model, model(batch), batch).float().softmax(-1)
            labels = self.segment_labels(batch).tolist()
        p, predicted = probs.max(-1)
        images = [decode(s.segments[0]) for s in chosen]
        names = getattr(self, "class_names", None)
        # drawn first: without matplotlib this raises before any attention is computed
        items = [Picture(f"{self.name}/predictions", image_grid(images[:shown], labels[:shown],
                                                                predicted[:shown].tolist(), names,
                                                                probabilities=p[:shown].tolist(), title=self.name))]
        if heated:
            from omni.introspect import image_attention

            with inference(model):
                heats = [image_attention(model, s.segments[0], head=self.name)[0] for s in chosen[:heated]]
            top_p, top_c = probs[:heated].topk(min(2, self.n_classes), -1)
            top = [list(zip(c.tolist(), q.tolist())) for c, q in zip(top_c, top_p)]
            items.append(Picture(f"{self.name}/attention", attention_grid(
                images[:heated], heats, labels[:heated], top, names, patch_size=self.tokenizer.patch_size,
                title=self.name)))
        return items

    eval_options = staticmethod(packed_eval_options)

    def result_row(self, r: Mapping[str, float]) -> Row:
        return "top-1 accuracy (%)", f"{100 * r['accuracy']:.2f}", f"loss {r['loss']:.4f}", f"{r['items']:.0f} test items"

    @staticmethod
    def from_items(entry: Mapping[str, Any], items: Sequence[Any], labels: Sequence[Any],
                   text: TextTokenizer) -> dict[str, Any]:
        """A registered tokenizer (``tokenizer``, ``tokenizer_kwargs``) over the items, ``n_classes`` labels."""
        from omni.tokenizers import build_tokenizer

        return {"tokenizer": build_tokenizer(entry["tokenizer"], **entry.get("tokenizer_kwargs", {})), "items": items,
                "labels": labels, "n_classes": int(entry["n_classes"])}
