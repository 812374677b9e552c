"""Many tasks, one trunk: ``MultitaskModel`` (the OmniModel with every task's heads, whose forward returns the
training loss and per-task metrics), ``multitask_loss`` and ``merge_tokenizers``.

    tasks = [ClassifyTask("image", image_tok, images, labels, n_classes=10, weight=1.0),
             TranscribeTask("asr", audio_tok, text_tok, clips, transcripts, weight=1.0),
             ActionTask("rl", traj_tok, episodes, weight=0.5),
             LMTask("text", text_tok, paragraphs, weight=1.0)]
    model = MultitaskModel(tasks, preset("tiny", positions="rope2d"))
    loader = MixtureLoader(tasks, row_length=512, rows=2, batches_per_epoch=1000, seed=0)
    loss, metrics = model(next(iter(loader)))      # metrics: {"image/loss", "image/accuracy", "asr/loss", ...}

The training loss is sum(loss_weight * task loss), each task loss a mean over that task's own targets in the
batch. The pieces live where they belong: the task kinds, their heads, losses, held-out metrics and adapters
in ``omni.tasks``; the packed mixed batch and the mixing loader in ``omni.mixture``. Their names are
re-exported here, so ``from omni.multitask import ClassifyTask, MixtureLoader, ...`` keeps working.
"""

from __future__ import annotations

import ast
import logging
import re
import weakref
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from omni.mixture import MixedBatch, MixtureLoader, eval_batches, pack_mixed
from omni.model import OmniModel
from omni.tasks import ActionTask, ClassifyTask, LMTask, PrefixLMTranscriber, Task, TrajectoryPolicy, TranscribeTask
from omni.tokenizers.base import Tokenizer
from omni.trunk import TrunkConfig


def merge_tokenizers(tasks: Sequence[Task]) -> dict[str, Tokenizer]:
    """One tokenizer per modality across tasks; two tasks may share a modality only with equal configs."""
    out: dict[str, Tokenizer] = {}
    for t in tasks:
        for m, tok in t.tokenizers().items():
            if m in out and out[m] is not tok and (type(out[m]) is not type(tok) or out[m].config() != tok.config()):
                raise ValueError(f"task {t.name!r} uses a {m!r} tokenizer {tok!r} that differs from another task's "
                                 f"{out[m]!r}: one trunk has one embedder per modality")
            out.setdefault(m, tok)
    return out


class _TiedTensorsSaved(logging.Filter):
    """Drops Accelerate's "Removed shared tensor {...} while saving" warning when every name it removed is a tied
    alias of a live MultitaskModel (an LM head sharing the text embedding table). safetensors cannot store one
    tensor twice, so ``save_state`` keeps one name; ``load_state`` fills the tied one back (it is the same
    tensor), so the warning, printed at every checkpoint, reports nothing wrong. Any other shared tensor still
    warns."""

    MESSAGE = re.compile(r"(?:\[RANK \d+\] )?Removed shared tensor (\{.*?\}) while saving")

    def __init__(self) -> None:
        super().__init__()
        self.models: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        found = self.MESSAGE.match(record.getMessage())
        if found is None:
            return True
        try:
            removed = ast.literal_eval(found.group(1))
        except (ValueError, SyntaxError):
            return True
        from omni.export import tied_names

        for model in list(self.models):
            tied = {name for group in tied_names(model) for name in group}
            # the saved module may be wrapped (DDP: "module." first): a removed name ends with a tied one
            if removed and all(any(n == t or n.endswith(f".{t}") for t in tied) for n in removed):
                return False
        return True


_TIED_SAVES = _TiedTensorsSaved()
logging.getLogger("accelerate.utils.other").addFilter(_TIED_SAVES)  # where Accelerate logs that warning


class MultitaskModel(nn.Module):
    """OmniModel (embedders -> trunk -> every task's heads) whose forward returns (loss, per-task metrics).

    Everything, heads and losses included, runs inside ``forward``, so DDP and FSDP2 wrap one module and see
    every parameter used in the forward they hooked. ``model.omni`` is the plain OmniModel (exported)."""

    def __init__(self, tasks: Sequence[Task], trunk: TrunkConfig) -> None:
        super().__init__()
        names = [t.name for t in tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"task names must be unique, got {names}")
        self.tasks = list(tasks)
        self.omni = OmniModel(merge_tokenizers(tasks), trunk)
        for t in tasks:
            for name, head in t.make_heads(self.omni).items():
                if name in self.omni.heads:  # e.g. a task named "asr_ctc" next to asr's CTC head
                    raise ValueError(f"task {t.name!r} makes a head {name!r} that another task already made")
                self.omni.heads[name] = head
        _TIED_SAVES.models.add(self)  # its tied LM head: no "Removed shared tensor" warning at each checkpoint

    def export_config(self) -> dict[str, Any]:
        """config.json for ``omni.export.load_pretrained`` (the built-in "omni" builder) of ``self.omni``: the heads,
        and per task its kind, weight and, for a classify task that has them, its class names (``omni predict``)."""
        def entry(t: Task) -> dict[str, Any]:
            names = getattr(t, "class_names", None)
            return {"kind": t.kind, "weight": t.weight, **({"class_names": list(names)} if names else {})}

        return {**self.omni.export_config(), "tasks": {t.name: entry(t) for t in self.tasks}}

    def forward(self, batch: MixedBatch, mask: Any = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Packed mixed batch -> (training loss, per-task metrics)."""
        return self.forward_head(self.forward_features(batch, mask), batch)

    def forward_features(self, batch: MixedBatch, mask: Any = None) -> Tensor:
        """Hidden states (B, T, d) of the shared trunk; the packed mask (BlockMask on CUDA) is built once, here."""
        return self.omni(batch, mask)  # through __call__: hooks on self.omni (FSDP, compile) run

    def forward_head(self, features: Tensor, batch: MixedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """Every task's heads and loss on features (B, T, d) -> (sum of loss_weight x task loss, metrics)."""
        if tuple(batch.task_names) != tuple(t.name for t in self.tasks):
            raise ValueError(f"batch tasks {batch.task_names} do not match the model's {[t.name for t in self.tasks]}")
        total = features.new_zeros((), dtype=torch.float32)
        metrics: dict[str, Tensor] = {}
        real = (batch.document >= 0).sum().clamp_min(1)
        n_docs = batch.document_task.shape[0]
        # tokens per document; padding (-1) lands in slot 0 and is dropped (no data-dependent shapes)
        # (index_add_, not bincount: bincount's data-dependent output size breaks the compiled graph)
        slot = (batch.document + 1).flatten()
        doc_tokens = torch.zeros(n_docs + 1, dtype=torch.long, device=slot.device).index_add_(
            0, slot, torch.ones_like(slot))[1:n_docs + 1]
        for i, t in enumerate(self.tasks):
            if all(m in batch.tokens for m in t.tokenizers()):
                loss, extra = t.loss(self.omni, features, batch, i)
            else:  # a weight-0 task whose modality this batch lacks: same metric names, zero values
                loss, extra = total.new_zeros(()), {k: total.new_zeros(()) for k in t.metric_names}
            total = total + t.loss_weight * loss
            metrics[f"{t.name}/loss"] = loss.detach()
            for k, v in extra.items():
                metrics[f"{t.name}/{k}"] = v.detach()
            mine = (batch.document_task == i)
            metrics[f"{t.name}/token_share"] = (doc_tokens * mine).sum() / real
            metrics[f"{t.name}/documents"] = mine.sum().float()
        return total, metrics


def multitask_loss(model: nn.Module, batch: MixedBatch) -> tuple[Tensor, dict[str, Tensor]]:
    """Trainer loss_fn: the model's own forward (it computes every task's loss)."""
    return model(batch)


__all__ = ["ActionTask", "ClassifyTask", "LMTask", "MixedBatch", "MixtureLoader", "MultitaskModel",
           "PrefixLMTranscriber", "Task", "TrajectoryPolicy", "TranscribeTask", "eval_batches", "merge_tokenizers",
           "multitask_loss", "pack_mixed"]
