"""Many tasks, one trunk: task definitions, the weighted mixing loader and the packed-batch losses.

    tasks = [ClassifyTask("image", image_tok, images, labels, n_classes=10, weight=1.0),
             TranscribeTask("asr", audio_tok, text_tok, clips, transcripts, weight=1.0),
             ActionTask("rl", traj_tok, episodes, weight=0.5),
             LMTask("text", text_tok, paragraphs, weight=1.0)]
    model = MultitaskModel(tasks, preset("tiny", positions="rope2d"))
    loader = MixtureLoader(tasks, row_length=512, rows=2, batches_per_epoch=1000, seed=0)
    loss, metrics = model(next(iter(loader)))      # metrics: {"image/loss", "image/accuracy", "asr/loss", ...}

A *task* is (name, sampling weight, loss weight, items -> Sample, tokenizers, heads, loss on the packed
batch). Four kinds cover the built-in modalities and any plug-in:

  ClassifyTask   [x segment] of ANY registered modality (image, or a plug-in such as time series) with a
                 class label -> ClassificationHead (mean-pool over the segment) -> cross-entropy.
                 The label travels as the segment's per-token targets, so it is collated and moved to
                 the device with the batch.
  TranscribeTask [audio segment, text segment "<bos><|transcribe|> ... <eos>"]: the packing rule makes it
                 a prefix-LM (every transcript token sees the whole clip, the clip never sees the text)
                 -> LM head tied to the text embedding -> next-token cross-entropy on the transcript;
                 with ``ctc_weight`` > 0 also a byte-level CTC head on the audio span's hidden states
                 (hybrid CTC/attention, as recipes/whisper.py), its labels carried as the audio segment's
                 targets.
  ActionTask     [trajectory segment] (a window of ``context`` steps of an episode, random start) ->
                 ActionHead read at state rows -> cross-entropy (discrete) / MSE (continuous, the tanh
                 output rescaled to the action bounds as omni.rl does).
  LMTask         [text segment] -> the same tied LM head -> next-token cross-entropy.

Per-task losses are means over that task's own targets in the batch; the training loss is
sum(loss_weight * task loss). Each task's documents are told apart by ``MixedBatch.document_task``, so two
tasks may share a modality (ASR transcripts and the text corpus are both "text").

Held-out metrics (``Task.evaluate(model.omni, ...)``): each kind measures what its single-task recipe
reports, on the task's held-out items, so a jointly trained trunk is compared like for like:

  ClassifyTask   top-1 accuracy (and mean cross-entropy) over every item        (recipes/vit.py)
  TranscribeTask greedy transcripts -> corpus CER / WER (``omni.speech.error_rates``), decoded by
                 ``omni.speech.greedy_decode`` itself (same eos / token-limit / repetition rules) through
                 ``PrefixLMTranscriber``: the audio prefix goes into the trunk's KV cache once
                 (bidirectional over the real frames), then one cached step per token  (recipes/whisper.py);
                 with a CTC head also its best-path CER (``ctc_cer``)
  ActionTask     ``omni.rl.evaluate`` rollouts in the real env through ``TrajectoryPolicy`` (the
                 DecisionTransformer interface over the shared trunk), target = the expert reference,
                 normalised score 100 (R - R_random) / (R_expert - R_random)   (recipes/decision_transformer.py)
  LMTask         token perplexity exp(mean next-token NLL) and bits per UTF-8 byte of the raw text

Mixing (``MixtureLoader``). A batch is ``rows`` packed rows of ``row_length`` tokens (fixed shapes, so
compiled kernels see one shape). Batch ``i`` of epoch ``e`` on rank ``r`` is a pure function of
(seed, e, i, r): first ONE sample of every task (in a random order; so every batch trains every head and
logs every per-task metric, and DDP never sees unused parameters), then tasks drawn with probability
proportional to ``weight`` and a uniformly drawn item of that task, each placed first-fit into the rows,
until ``max_misses`` consecutive draws do not fit. Sampling is with replacement (a mixture has no natural
epoch; ``batches_per_epoch`` only sets the checkpoint/epoch bookkeeping). Because batches are stateless,
the loader's state is just (epoch, batches done): exact resume, and ``num_workers`` DataLoader workers can
build batches in parallel. Drop-on-miss slightly favours short samples near the end of a batch; the
per-task token share is logged (``<task>/token_share``) so the realised mixture is visible.
"""

from __future__ import annotations

import math
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni.data.memory import EpochCursor
from omni.heads import build_head, masked_action_loss
from omni.model import OmniModel
from omni.packing import BLOCK_SIZE, PackedBatch, Packer
from omni.segment import Sample, Segment
from omni.tokenizers.base import Tokenizer
from omni.tokenizers.text import IGNORE_INDEX, TextTokenizer
from omni.tokenizers.trajectory import TrajectoryTokenizer
from omni.trunk import KVCache, TrunkConfig

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# ----------------------------------------------------------------------------------------------------
# The packed batch with per-document task ids


@dataclass
class MixedBatch(PackedBatch):
    """A PackedBatch whose documents come from several tasks: ``document_task[d]`` is the task index of
    document ``d`` (in ``task_names`` order)."""

    document_task: Tensor | None = None
    task_names: tuple[str, ...] = ()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "MixedBatch":
        base = PackedBatch.to(self, device, non_blocking)
        assert self.document_task is not None
        return MixedBatch(**{f.name: getattr(base, f.name) for f in fields(PackedBatch)},
                          document_task=self.document_task.to(device, non_blocking=non_blocking),
                          task_names=self.task_names)

    def token_task(self, modality: str) -> Tensor:
        """(N_m,) task index of every packed token of ``modality``."""
        assert self.document_task is not None
        return self.document_task[self.segment_document[modality]][self.segment_of[modality]]

    def segment_task(self, modality: str) -> Tensor:
        """(S_m,) task index of every segment of ``modality``."""
        assert self.document_task is not None
        return self.document_task[self.segment_document[modality]]


class _AssignedPacker(Packer):
    """A Packer that uses a row assignment made by the mixing loader (empty rows stay padding)."""

    def __init__(self, row_length: int, rows: list[list[int]]) -> None:
        super().__init__(row_length=row_length)
        self._rows = rows

    def rows_for(self, samples: Sequence[Sample]) -> list[list[int]]:
        return self._rows


def pack_mixed(samples: Sequence[Sample], tasks: Sequence[int], task_names: Sequence[str],
               row_length: int | None = None, rows: list[list[int]] | None = None) -> MixedBatch:
    """Pack samples (sample ``i`` from task ``tasks[i]``) into a MixedBatch: with ``rows`` (an assignment of
    sample indices to rows of ``row_length``) as given, else ``Packer(row_length)``'s own packing."""
    packer = _AssignedPacker(row_length, rows) if rows is not None else Packer(row_length=row_length)
    assignment = packer.rows_for(samples)
    order = [i for row in assignment for i in row]  # Packer numbers documents in this order
    batch = packer(samples)
    return MixedBatch(**{f.name: getattr(batch, f.name) for f in fields(PackedBatch)},
                      document_task=torch.tensor([tasks[i] for i in order], dtype=torch.long),
                      task_names=tuple(task_names))


# ----------------------------------------------------------------------------------------------------
# Tasks


class Task:
    """Base: a named source of Samples plus the heads and loss that train on them.

    Subclasses implement ``tokenizers``, ``__len__``, ``sample(i, rng)``, ``head_specs()`` (the heads as
    ``omni.heads`` specs: ``make_heads`` builds them, the export rebuilds them) and ``loss(model, hidden, batch,
    index)``, which reads the heads through ``model.forward_head``.
    """

    kind: str = "task"
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

    def evaluate(self, model: OmniModel, **options: Any) -> dict[str, float]:
        """The task's held-out metric(s) over all its items (module docstring); ``model`` is the OmniModel."""
        raise NotImplementedError(f"{type(self).__name__} {self.name!r} has no held-out metric")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, weight={self.weight}, items={len(self)})"


def _masked_mean(values: Tensor, weights: Tensor) -> Tensor:
    """sum(values * w) / max(sum(w), 1): static shapes (no boolean indexing) for torch.compile."""
    return (values * weights).sum() / weights.sum().clamp_min(1.0)


@contextmanager
def _inference(model: nn.Module) -> Iterator[torch.device]:
    """no_grad + eval mode (restored afterwards); yields the model's device."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield next(model.parameters()).device
    finally:
        model.train(was_training)


def eval_batches(samples: Sequence[Sample], row_length: int, rows: int) -> Iterator[PackedBatch]:
    """The samples in order, placed first-fit into ``rows`` rows of ``row_length`` tokens; a batch is emitted
    when the next sample fits nowhere. Every batch has the training shape (rows, row_length), so compiled
    kernels see no new shape (the last batch is partly padding)."""
    chunk: list[Sample] = []
    assignment: list[list[int]] = [[] for _ in range(rows)]
    free = [row_length] * rows
    for s in samples:
        n = len(s)
        if n > row_length:
            raise ValueError(f"sample {s.key!r} has {n} tokens, more than row_length {row_length}")
        r = next((r for r in range(rows) if free[r] >= n), None)
        if r is None:
            yield _AssignedPacker(row_length, assignment)(chunk)
            chunk, assignment, free, r = [], [[] for _ in range(rows)], [row_length] * rows, 0
        assignment[r].append(len(chunk))
        free[r] -= n
        chunk.append(s)
    if chunk:
        yield _AssignedPacker(row_length, assignment)(chunk)


class ClassifyTask(Task):
    """One segment of ``tokenizer``'s modality per sample, one class label -> ClassificationHead.

    ``items[i]`` is a raw input for ``tokenizer.encode`` (encoded when drawn) or an already encoded Segment.
    """

    kind = "classify"
    metric_names = ("accuracy",)

    def __init__(self, name: str, tokenizer: Tokenizer, items: Sequence[Any], labels: Sequence[int], n_classes: int,
                 *, weight: float = 1.0, loss_weight: float = 1.0, pool: str = "mean",
                 label_smoothing: float = 0.0) -> None:
        super().__init__(name, weight, loss_weight)
        if len(items) != len(labels) or not len(items):
            raise ValueError(f"task {name!r}: {len(items)} items but {len(labels)} labels (need as many, >= 1)")
        bad = [int(y) for y in labels if not 0 <= int(y) < n_classes]
        if bad:
            raise ValueError(f"task {name!r}: labels must lie in [0, {n_classes}), got {bad[:5]}")
        self.tokenizer, self.items, self.labels = tokenizer, items, [int(y) for y in labels]
        self.n_classes, self.pool, self.label_smoothing = int(n_classes), pool, float(label_smoothing)
        self.modality = tokenizer.modality

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

    def loss(self, model, hidden, batch, index):
        logits = self.logits(model, hidden, batch).float()
        y = self.segment_labels(batch)
        w = (batch.segment_task(self.modality) == index).float()
        nll = F.cross_entropy(logits, y, reduction="none", label_smoothing=self.label_smoothing)
        acc = (logits.argmax(-1) == y).float()
        return _masked_mean(nll, w), {"accuracy": _masked_mean(acc, w)}

    def evaluate(self, model: OmniModel, *, row_length: int = 1024, rows: int = 8) -> dict[str, float]:
        """Top-1 accuracy and mean cross-entropy (no label smoothing) over every item, as recipes/vit.py
        reports on its test split. Items are packed ``rows x row_length`` tokens at a time."""
        rng = np.random.default_rng(0)  # (not drawn from: every item is taken whole)
        samples = [self.sample(i, rng) for i in range(len(self))]
        correct, nll = 0, 0.0
        with _inference(model) as dev:
            for batch in eval_batches(samples, row_length, rows):
                batch = batch.to(dev)
                logits = self.logits(model, model(batch), batch).float()  # one row per segment = per item
                y = self.segment_labels(batch)
                correct += int((logits.argmax(-1) == y).sum())
                nll += float(F.cross_entropy(logits, y, reduction="sum"))
        return {"accuracy": correct / len(samples), "loss": nll / len(samples), "items": float(len(samples))}


class _NextTextTokenTask(Task):
    """A task whose head predicts the next text token (LM head tied to the text embedding) and whose loss is
    next-token cross-entropy over the text tokens of its documents. Subclasses name their ``text_tokenizer``."""

    text_tokenizer: TextTokenizer

    def head_specs(self) -> dict[str, dict[str, Any]]:
        return {self.name: {"type": "lm", "vocab_size": self.text_tokenizer.vocab_size, "tie_to": "text"}}

    def loss(self, model, hidden, batch, index):
        logits = model.forward_head(hidden, batch, self.name, "text").float()
        targets = batch.targets["text"]
        w = ((batch.token_task("text") == index) & (targets != IGNORE_INDEX)).float()
        safe = targets.clamp_min(0)  # ignored rows get weight 0; keep the index valid
        nll = F.cross_entropy(logits, safe, reduction="none")
        acc = (logits.argmax(-1) == safe).float()
        return _masked_mean(nll, w), {"token_accuracy": _masked_mean(acc, w)}


def _lm_nll_sum(model: OmniModel, head: str, hidden: Tensor, batch: PackedBatch) -> tuple[float, int]:
    """(summed next-token NLL in nats, predicted tokens) over every text token of a batch of one task."""
    logits = model.forward_head(hidden, batch, head, "text").float()
    targets = batch.targets["text"]
    keep = targets != IGNORE_INDEX
    return float(F.cross_entropy(logits[keep], targets[keep], reduction="sum")), int(keep.sum())


class LMTask(_NextTextTokenTask):
    """Causal language modelling on text documents, LM head tied to the text embedding."""

    kind = "lm"
    metric_names = ("token_accuracy",)

    def __init__(self, name: str, tokenizer: TextTokenizer, texts: Sequence[str], *, weight: float = 1.0,
                 loss_weight: float = 1.0) -> None:
        super().__init__(name, weight, loss_weight)
        if not len(texts):
            raise ValueError(f"task {name!r}: no texts")
        self.tokenizer, self.texts = tokenizer, texts
        self.text_tokenizer = tokenizer

    def tokenizers(self) -> dict[str, Tokenizer]:
        return {"text": self.tokenizer}

    def __len__(self) -> int:
        return len(self.texts)

    def sample(self, i: int, rng: np.random.Generator) -> Sample:
        key = f"{self.name}/{i}"
        return Sample([self.tokenizer.encode(self.texts[i], key=key)], key=key)

    def evaluate(self, model: OmniModel, *, row_length: int = 1024, rows: int = 8) -> dict[str, float]:
        """Held-out language modelling: token perplexity exp(NLL / tokens) and bits per byte
        NLL / ln 2 / (UTF-8 bytes of the raw texts), NLL summed over every predicted token (the first
        token after bos through eos; bos itself is given)."""
        rng = np.random.default_rng(0)  # (not drawn from: every item is taken whole)
        samples = [self.sample(i, rng) for i in range(len(self))]
        nll, tokens = 0.0, 0
        with _inference(model) as dev:
            for batch in eval_batches(samples, row_length, rows):
                batch = batch.to(dev)
                a, b = _lm_nll_sum(model, self.name, model(batch), batch)
                nll, tokens = nll + a, tokens + b
        n_bytes = sum(len(t.encode("utf-8")) for t in self.texts)
        return {"ppl": math.exp(nll / max(tokens, 1)), "bpb": nll / math.log(2) / max(n_bytes, 1),
                "nll": nll / max(tokens, 1), "tokens": float(tokens), "bytes": float(n_bytes),
                "documents": float(len(samples))}


class TranscribeTask(_NextTextTokenTask):
    """Speech recognition as a prefix-LM: [audio, <bos><|transcribe|> text <eos>] in one document.

    ``clips[i]`` is raw audio for ``audio.encode`` or an encoded audio Segment (pre-encode small sets:
    log-mel extraction dominates the CPU cost of a batch).

    ``ctc_weight`` > 0 adds hybrid CTC/attention training (``omni.speech.SpeechRecognizer``'s reason: trained
    from scratch, the text part can learn the transcripts' language and ignore the audio; a CTC loss on the
    audio span makes its hidden states line up with the transcript): a byte-level CTC head (``{name}_ctc``,
    257 outputs, ``omni.speech.CTC_BLANK`` the blank) on every audio token, task loss = (1 - ctc_weight) x
    text cross-entropy + ctc_weight x CTC (as ``omni.speech.SpeechLoss``). The CTC labels
    (``omni.speech.ctc_labels``) travel as the audio segment's per-token targets: label byte k at frame k,
    ``IGNORE_INDEX`` after the label, so they are collated and moved with the batch like ClassifyTask's labels."""

    kind = "transcribe"
    metric_names = ("token_accuracy",)

    def __init__(self, name: str, audio: Tokenizer, text: TextTokenizer, clips: Sequence[Any],
                 transcripts: Sequence[str], *, weight: float = 1.0, loss_weight: float = 1.0,
                 task_token: str = "transcribe", ctc_weight: float = 0.0) -> None:
        super().__init__(name, weight, loss_weight)
        if len(clips) != len(transcripts) or not len(clips):
            raise ValueError(f"task {name!r}: {len(clips)} clips but {len(transcripts)} transcripts")
        if not (ctc_weight >= 0 and math.isfinite(ctc_weight)):
            raise ValueError(f"task {name!r}: ctc_weight must be a finite number >= 0, got {ctc_weight!r}")
        self.audio, self.text, self.clips, self.transcripts = audio, text, clips, transcripts
        self.text_tokenizer = text
        self.task_token = task_token
        self.ctc_weight = float(ctc_weight)
        self.ctc_head = f"{name}_ctc"  # the CTC head's name in model.heads (when ctc_weight > 0)
        if self.ctc_weight > 0:
            self.metric_names = ("token_accuracy", "ctc_loss")

    def tokenizers(self) -> dict[str, Tokenizer]:
        return {"audio": self.audio, "text": self.text}

    def __len__(self) -> int:
        return len(self.clips)

    def audio_segment(self, i: int) -> Segment:
        clip = self.clips[i]
        return clip if isinstance(clip, Segment) else self.audio.encode(clip, key=f"{self.name}/{i}")

    def sample(self, i: int, rng: np.random.Generator) -> Sample:
        key = f"{self.name}/{i}"
        text = self.text.encode(self.transcripts[i], key=key, task=self.task_token)
        audio = self.audio_segment(i)
        if self.ctc_weight > 0:
            audio = Segment(audio.modality, audio.tokens, audio.positions, audio.role,
                            targets=self._ctc_targets(i, len(audio), key), meta=audio.meta)
        return Sample([audio, text], key=key, label=self.transcripts[i])

    def _ctc_targets(self, i: int, frames: int, key: str) -> Tensor:
        """(frames,) CTC labels of transcript ``i`` laid along its audio frames, IGNORE_INDEX after them. A
        label longer than the clip cannot be aligned (and cannot be laid out): warned, and left all
        IGNORE_INDEX, which the loss reads as "no CTC term" for this sample."""
        from omni.speech import ctc_labels  # omni.speech (torchaudio) stays off the import path of omni.multitask

        labels = ctc_labels(self.transcripts[i])
        out = torch.full((frames,), IGNORE_INDEX, dtype=torch.long)
        if labels.shape[0] > frames:
            warnings.warn(f"task {self.name!r}: sample {key!r} has {labels.shape[0]} CTC label bytes but only "
                          f"{frames} audio tokens: trained without its CTC term")
        else:
            out[:labels.shape[0]] = labels
        return out

    def head_specs(self) -> dict[str, dict[str, Any]]:
        from omni.speech import CTC_BLANK

        specs = super().head_specs()
        if self.ctc_weight > 0:  # an untied "lm" head: a Linear(d, 257) without bias
            specs[self.ctc_head] = {"type": "lm", "vocab_size": CTC_BLANK + 1}
        return specs

    def loss(self, model, hidden, batch, index):
        loss, metrics = super().loss(model, hidden, batch, index)
        if self.ctc_weight == 0:
            return loss, metrics
        ctc = self.ctc_loss(model, hidden, batch, index)
        metrics["ctc_loss"] = ctc
        # the weighting of omni.speech.SpeechLoss, so ctc_weight means the same in both recipes
        return (1.0 - self.ctc_weight) * loss + self.ctc_weight * ctc, metrics

    # Eager under torch.compile: F.ctc_loss is a dynamic-shape op and needs host lengths (a sync) anyway;
    # traced, this would break the graph twice and recompile as the segment count changes.
    @torch.compiler.disable
    def ctc_loss(self, model: OmniModel, hidden: Tensor, batch: MixedBatch, index: int) -> Tensor:
        """CTC loss of this task's audio spans in a packed batch: every audio segment's head log-probs padded
        into (T_max, S, 257) by (frame, segment) index tensors, ``F.ctc_loss`` per segment / label length,
        averaged over this task's segments that carry labels (infeasible alignments: 0, ``zero_infinity``)."""
        from omni.speech import CTC_BLANK

        if "audio" not in batch.targets:
            raise ValueError(f"task {self.name!r} has ctc_weight > 0 but the batch's audio segments carry no CTC "
                             "labels (targets): build its samples with TranscribeTask.sample")
        seg = batch.segment_of["audio"]  # (N_a,) audio segment of every audio token, tokens in segment order
        n_seg = batch.segment_document["audio"].shape[0]
        frames = torch.zeros(n_seg, dtype=torch.long, device=seg.device).index_add_(0, seg, torch.ones_like(seg))
        t = torch.arange(seg.shape[0], device=seg.device) - (frames.cumsum(0) - frames)[seg]  # frame in segment
        targets = batch.targets["audio"].long()
        mine = batch.segment_task("audio") == index
        # other tasks' audio segments (their targets are not CTC labels) get an empty label and weight 0
        lengths = torch.zeros_like(frames).index_add_(0, seg, (targets != IGNORE_INDEX).long()) * mine
        T = int(frames.max())
        logp = model.forward_head(hidden, batch, self.ctc_head, "audio").float().log_softmax(-1)
        padded = logp.new_zeros(T, n_seg, logp.shape[-1]).index_put((t, seg), logp)
        labels = torch.zeros(n_seg, T, dtype=torch.long, device=seg.device).index_put((seg, t), targets.clamp_min(0))
        per = F.ctc_loss(padded, labels, frames, lengths, blank=CTC_BLANK, reduction="none", zero_infinity=True)
        return _masked_mean(per / lengths.clamp_min(1), (lengths > 0).float())

    def ctc_transcribe(self, model: OmniModel, indices: Sequence[int] | None = None, *,
                       batch_size: int = 64) -> list[str]:
        """Best-path CTC transcripts (``omni.speech.ctc_greedy_decode``) of clips ``indices`` (default all):
        the audio alone through the trunk, bidirectional over each clip's real frames (padding masked out of
        the keys), as in a packed training document (the audio never sees its text), then the CTC head."""
        from omni.speech import ctc_greedy_decode

        idx = list(range(len(self))) if indices is None else [int(i) for i in indices]
        texts: dict[int, str] = {}
        with _inference(model) as dev:
            for chunk, frames, mask in self._audio_batches(idx, batch_size, dev):
                positions = torch.arange(frames.shape[1], device=dev).expand(frames.shape[:2])
                h = model.trunk(model.embedders["audio"](frames), positions, mask[:, None, None, :])
                texts.update(zip(chunk, ctc_greedy_decode(model.heads[self.ctc_head](h).float(), mask)))
        return [texts[i] for i in idx]

    def _audio_batches(self, indices: Sequence[int], batch_size: int,
                       device: torch.device) -> Iterator[tuple[list[int], Tensor, Tensor]]:
        """(clip indices, right-padded audio tokens (B, S, F), mask (B, S)) on ``device``, ``batch_size`` clips
        at a time, sorted by length (little padding); each clip once."""
        from omni.speech import pad_audio  # decoding is not on the training import path

        audio = {i: self.audio_segment(i).tokens for i in indices}
        order = sorted(audio, key=lambda i: audio[i].shape[0])
        for lo in range(0, len(order), batch_size):
            chunk = order[lo:lo + batch_size]
            frames, mask = pad_audio([audio[i] for i in chunk])
            yield chunk, frames.to(device), mask.to(device)

    def transcribe(self, model: OmniModel, indices: Sequence[int] | None = None, *, batch_size: int = 64,
                   use_cache: bool = True, **guards: Any) -> list[str]:
        """Greedy transcripts of clips ``indices`` (default all), by ``omni.speech.greedy_decode`` with its
        defaults (max_new_tokens 224, 25 tokens/s + 8 per clip, repetition guard) unless ``guards`` say
        otherwise. Clips are sorted by length and decoded ``batch_size`` at a time (little padding)."""
        from omni.speech import greedy_decode  # decoding is not on the training import path

        idx = list(range(len(self))) if indices is None else [int(i) for i in indices]
        texts: dict[int, str] = {}
        with _inference(model) as dev:
            decoder = PrefixLMTranscriber.for_task(model, self)
            for chunk, frames, mask in self._audio_batches(idx, batch_size, dev):
                ids = greedy_decode(decoder, decoder.encode(frames, mask), mask, use_cache=use_cache,
                                    check_every=8 if use_cache else 1, **guards)
                texts.update(zip(chunk, (self.text.decode(row) for row in ids)))
        return [texts[i] for i in idx]

    def evaluate(self, model: OmniModel, *, batch_size: int = 64, **guards: Any) -> dict[str, float]:
        """Corpus CER and WER of greedy transcripts of every clip (``omni.speech.error_rates``: texts
        normalised by ``normalize_text``, total edits / total reference characters or words), as
        recipes/whisper.py reports on its test split; with a CTC head in ``model`` also ``ctc_cer``, the CER
        of its best-path transcripts (``ctc_transcribe``), as recipes/whisper.py's ``ctc_cer``."""
        from omni.speech import error_rates

        hyps = self.transcribe(model, batch_size=batch_size, **guards)
        out = {**error_rates(list(self.transcripts), hyps), "utterances": float(len(hyps))}
        if self.ctc_head in model.heads:  # what the audio span alone says, through the CTC head
            heard = self.ctc_transcribe(model, batch_size=batch_size)
            out["ctc_cer"] = error_rates(list(self.transcripts), heard)["cer"]
        return out


class PrefixLMTranscriber:
    """A transcribe head of a multitask OmniModel as an ``omni.interfaces.Seq2SeqDecoder``, so the prefix-LM model
    is decoded by the very code, stop rules and guards that score recipes/whisper.py (``omni.decoding``).
    ``head``: the task's LM head in ``model.heads``; ``audio``/``text``: the export's tokenizers.

    Layout, as in training (one packed document): [audio frames (bidirectional), bos, <|transcribe|>,
    generated ... (causal)], audio positions 0..n-1 and text positions from n on, n = that clip's real
    frames (the packer's rule). ``memory`` is the right-padded audio TOKENS (B, S, F) with ``audio_mask``:
    the trunk itself runs in ``decode_hidden``.

    With a KV cache (S audio slots + the text's) the first call writes the audio in one bidirectional forward
    (mask "full"; padded frames marked ``pad``, so no token ever sees them) and then the prompt; every later
    call appends one token per row, at position n_b + its text index = the real tokens the cache holds for that
    row, at the next slot or at ``cache_position`` (fixed-shape steps: ``omni.decoding.GraphedGreedyDecoder``).
    Without a cache every call packs [audio_b, text so far] per clip with the training ``Packer`` and runs the
    whole packed forward: the reference the cached path must match token for token (tests/test_multimodal.py).
    """

    def __init__(self, model: OmniModel, head: str, audio: Tokenizer, text: TextTokenizer,
                 task_token: str = "transcribe") -> None:
        self.omni, self.audio, self.text = model, audio, text
        self.head = model.heads[head]
        self.prompt = [text.bos_id, text.token_id(task_token)]
        self.eos_id, self.pad_id = text.eos_id, text.pad_id
        self.tokens_per_second = audio.tokens_per_second

    @classmethod
    def for_task(cls, model: OmniModel, task: TranscribeTask) -> PrefixLMTranscriber:
        return cls(model, task.name, task.audio, task.text, task.task_token)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.omni.parameters(recurse)

    def encode(self, audio: Tensor, audio_mask: Tensor | None = None) -> Tensor:
        """The memory is the padded audio tokens themselves: the trunk reads them in ``decode_hidden``."""
        return audio

    def new_cache(self, memory: Tensor, max_length: int) -> KVCache:
        """Room for the S audio tokens plus ``max_length`` text tokens. The audio tokens are float32 whatever
        the autocast, so the cache follows the trunk's parameters."""
        return self.omni.trunk.new_cache(memory.shape[0], memory.shape[1] + max_length)

    def logits(self, text: Tensor, memory: Tensor | None, audio_mask: Tensor | None, cache: KVCache | None = None,
               cache_position: Tensor | None = None) -> Tensor:
        """Next-token logits (B, V) after text (B, T)."""
        return self.head(self.decode_hidden(text, memory, audio_mask, cache, cache_position)[:, -1])

    def decode_hidden(self, text: Tensor, memory: Tensor | None, audio_mask: Tensor | None,
                      cache: KVCache | None = None, cache_position: Tensor | None = None) -> Tensor:
        """Hidden states (B, T, d) of the text tokens ``text`` (B, T) after the audio prefix."""
        if cache is None:
            return self._packed_hidden(text, memory, audio_mask)
        B, T = text.shape
        dev, trunk = text.device, self.omni.trunk
        if memory is not None:  # first call: the audio prefix, bidirectional over its real frames
            if cache.length != 0:
                raise ValueError("the audio prefix goes into an empty cache")
            S = memory.shape[1]
            pad = None if audio_mask is None else ~audio_mask
            trunk(self.omni.embedders["audio"](memory), torch.arange(S, device=dev).expand(B, S), "full",
                  cache=cache, pad=pad)
        positions = cache.real_tokens()[:, None] + torch.arange(T, device=dev)  # (B, T): row b continues at n_b
        return trunk(self.omni.embedders["text"](text), positions, None, cache=cache, cache_position=cache_position)

    def _packed_hidden(self, text: Tensor, audio: Tensor, audio_mask: Tensor | None) -> Tensor:
        """Reference path: the training computation (Packer + packed mask) on [audio_b, text_b] per row, all in
        one packed row (a dense T x T mask on CPU: for tests and small batches)."""
        B, T = text.shape
        frames = [audio.shape[1]] * B if audio_mask is None else audio_mask.sum(1).tolist()
        samples = []
        for b, n in enumerate(frames):
            a = Segment("audio", audio[b, :n], torch.arange(n), self.audio.role)
            t = Segment("text", text[b], torch.arange(T), self.text.role)
            samples.append(Sample([a, t], key=f"decode/{b}"))
        batch = Packer()(samples).to(text.device)  # one row, documents in row order
        return OmniModel.gather(self.omni(batch), batch, "text").view(B, T, -1)


class ActionTask(Task):
    """Offline RL (Decision-Transformer style): windows of ``tokenizer.context`` steps with a random start,
    the action predicted at each state row. ``episodes``: dicts as ``omni.rl.load_episodes`` returns."""

    kind = "action"

    def __init__(self, name: str, tokenizer: TrajectoryTokenizer, episodes: Sequence[Mapping[str, Any]], *,
                 weight: float = 1.0, loss_weight: float = 1.0, env_id: str | None = None,
                 reference: tuple[float, float] | None = None) -> None:
        super().__init__(name, weight, loss_weight)
        self.env_id = env_id  # the Gymnasium env the episodes come from (rollout evaluation)
        self.reference = None if reference is None else (float(reference[0]), float(reference[1]))  # (random, expert)
        if not len(episodes):
            raise ValueError(f"task {name!r}: no episodes")
        if not tokenizer.discrete and (tokenizer.action_low is None or tokenizer.action_high is None):
            raise ValueError(f"task {name!r}: continuous actions need action_low/action_high on the tokenizer")
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
        tok = self.tokenizer
        if not tok.discrete:
            low = torch.as_tensor(tok.action_low, dtype=out.dtype, device=out.device)
            high = torch.as_tensor(tok.action_high, dtype=out.dtype, device=out.device)
            out = (high + low) / 2 + (high - low) / 2 * out
        return out

    def predict(self, model: OmniModel, hidden: Tensor, batch: MixedBatch) -> Tensor:
        """Head output at every trajectory token of a packed batch."""
        return self.head_output(model, OmniModel.gather(hidden, batch, "trajectory"))

    def loss(self, model, hidden, batch, index):
        tok = self.tokenizer
        keep = tok.action_target_mask(batch.tokens["trajectory"]) & (batch.token_task("trajectory") == index)
        return masked_action_loss(self.predict(model, hidden, batch), batch.targets["trajectory"], keep, tok.discrete)

    def evaluate(self, model: OmniModel, *, seeds: Sequence[int] = tuple(range(10_000, 10_005)),
                 target: float | None = None, max_steps: int | None = None, cache: bool = True) -> dict[str, float]:
        """Rollouts in ``env_id`` with ``omni.rl.evaluate`` (one episode per seed, batched, KV-cached), target
        return ``target`` (default: the expert reference), normalised by ``reference`` as
        recipes/decision_transformer.py does. Default seeds: 10000.., disjoint from the data's env seeds."""
        from omni.rl import evaluate as rollouts

        if self.env_id is None or self.reference is None:
            raise ValueError(f"task {self.name!r}: rollout evaluation needs env_id and reference (random, expert)")
        target = self.reference[1] if target is None else float(target)
        with _inference(model) as dev:
            row = rollouts(TrajectoryPolicy(model, self), self.tokenizer, self.env_id, targets=[target],
                           seeds=list(seeds), reference=self.reference, max_steps=max_steps, device=dev,
                           cache=cache)[0]
        return {k: float(row[k]) for k in ("score_mean", "score_std", "return_mean", "return_std", "episodes",
                                           "target")}


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


# ----------------------------------------------------------------------------------------------------
# The model


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

    def export_config(self) -> dict[str, Any]:
        """config.json for ``omni.export.load_pretrained`` (the built-in "omni" builder) of ``self.omni``."""
        return {**self.omni.export_config(),
                "tasks": {t.name: {"kind": t.kind, "weight": t.weight} for t in self.tasks}}

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


# ----------------------------------------------------------------------------------------------------
# Mixing


class MixtureLoader(EpochCursor):
    """Weighted mixture of tasks packed into fixed (rows, row_length) batches (module docstring).

    Rank-local and stateful (``state_dict``/``load_state_dict``/``set_epoch``), so the Trainer does not
    re-shard it and resumes it exactly. ``num_workers > 0`` builds batches in DataLoader worker processes.
    """

    def __init__(self, tasks: Sequence[Task], *, row_length: int, rows: int = 1, batches_per_epoch: int = 1000,
                 seed: int = 0, rank: int = 0, world_size: int = 1, max_misses: int = 4, num_workers: int = 0,
                 block_size: int = BLOCK_SIZE) -> None:
        if row_length % block_size:
            raise ValueError(f"row_length {row_length} must be a multiple of {block_size}")
        if rows < 1 or batches_per_epoch < 1:
            raise ValueError(f"rows and batches_per_epoch must be >= 1, got {rows}, {batches_per_epoch}")
        active = [t for t in tasks if t.weight > 0]
        if not active:
            raise ValueError("every task has weight 0: nothing to sample")
        self.tasks, self.row_length, self.rows = list(tasks), int(row_length), int(rows)
        self.batches_per_epoch, self.seed, self.rank, self.world_size = int(batches_per_epoch), seed, rank, world_size
        self.max_misses, self.num_workers = int(max_misses), int(num_workers)
        w = np.array([t.weight for t in self.tasks], dtype=np.float64)
        self.probs = w / w.sum()
        self.epoch, self.batches_done = 0, 0

    @property
    def task_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tasks)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def draw(self, epoch: int, index: int) -> tuple[list[Sample], list[int], list[list[int]]]:
        """The samples of batch ``index`` of ``epoch`` on this rank, their task indices and row assignment."""
        rng = np.random.default_rng([self.seed, epoch, index, self.rank])
        L, samples, tasks = self.row_length, [], []
        free = [L] * self.rows
        rows: list[list[int]] = [[] for _ in range(self.rows)]

        def place(t: int, required: bool) -> bool:
            task = self.tasks[t]
            s = task.sample(int(rng.integers(len(task))), rng)
            n = len(s)
            if n > L:
                raise ValueError(f"sample {s.key!r} of task {task.name!r} has {n} tokens, more than row_length {L}: "
                                 f"raise row_length or shorten the task's inputs")
            r = next((r for r in range(self.rows) if free[r] >= n), None)
            if r is None:
                if required:
                    raise ValueError(f"batch of {self.rows} x {L} tokens cannot hold one sample of every task "
                                     f"({task.name!r} did not fit): raise rows or row_length")
                return False
            rows[r].append(len(samples))
            free[r] -= n
            samples.append(s)
            tasks.append(t)
            return True

        for t in rng.permutation([i for i, task in enumerate(self.tasks) if task.weight > 0]):
            place(int(t), required=True)
        misses = 0
        while misses < self.max_misses and max(free) > 0:
            t = int(rng.choice(len(self.tasks), p=self.probs))
            misses = 0 if place(t, required=False) else misses + 1
        return samples, tasks, rows

    def batch(self, epoch: int, index: int) -> MixedBatch:
        samples, tasks, rows = self.draw(epoch, index)
        return pack_mixed(samples, tasks, self.task_names, self.row_length, rows)

    def __getitem__(self, index: int) -> MixedBatch:  # DataLoader worker entry (epoch set before iterating)
        return self.batch(self._iter_epoch, index)

    def __iter__(self) -> Iterator[MixedBatch]:
        self._iter_epoch = self.epoch
        todo = range(self.batches_done, self.batches_per_epoch)
        if self.num_workers > 0:
            it: Any = torch.utils.data.DataLoader(self, batch_size=None, sampler=list(todo), num_workers=self.num_workers,
                                                  persistent_workers=False)
        else:
            it = (self.batch(self.epoch, i) for i in todo)
        for b in it:
            self.batches_done += 1
            yield b
        self.epoch += 1
        self.batches_done = 0


__all__ = ["ActionTask", "ClassifyTask", "LMTask", "MixedBatch", "MixtureLoader", "MultitaskModel",
           "PrefixLMTranscriber", "Task", "TrajectoryPolicy", "TranscribeTask", "eval_batches", "merge_tokenizers",
           "multitask_loss", "pack_mixed"]
