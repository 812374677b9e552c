"""Evaluation for ``omni.train.Trainer``: eval-set means merged over ranks, plus whole-model metrics.

``Evaluator(model, step, data, model_metrics_fn)`` returns {"eval/<name>": value}:

* Per-batch metrics: ``eval_fn(model, batch) -> {name: Tensor}`` (per-sample values, dim 0 = samples, more
  dims averaged too; or 0-d per-batch values), default the mean of the training loss. Each metric is the
  mean over the whole eval set and all ranks. An Accelerate-prepared DataLoader's per-sample values go
  through ``gather_for_metrics``, which drops the samples Accelerate duplicated to even out the last
  batch; a rank-local loader's sums are summed over ranks. A rank may have had no batches: the ranks agree
  on the metric names before the one all-reduce of (sums, counts).
* Whole-model metrics: ``model_metrics_fn(model, step) -> {name: float | 0-d Tensor}``, called once after the
  batches on every rank; each name is the mean over the ranks that returned it, and may not also come from
  ``eval_fn``.
* Conditions: model in eval mode (train mode restored after), ``torch.no_grad``, the mixed-precision
  autocast, and every RNG stream (python, numpy, torch, CUDA) saved before and restored after, so training
  continues exactly as without evaluation. Collective: call it on every rank.
* The whole eval set, every time: a rank-local resumable loader (``state_dict``/``load_state_dict``/``set_epoch``:
  ShardLoader, TensorLoader, MixtureLoader) is read from the start of its epoch and left where it was
  (``held_position``), so every evaluation scores the same batches whatever a hook read before (a samples_fn
  showing its first batch once cut the next evaluation to 3 of 4 batches), and a resumed run, whose eval loader
  starts afresh, scores what an uninterrupted one does. Hooks that show eval items take them with
  ``first_batch``.

What a person looks at, beside the numbers (``Pictures``, built by the Trainer from its config):

* ``MetricHistory``: every scalar the run logs (training windows, with each step's loss, and evaluations), kept in
  memory and appended to ``output_dir/history.jsonl`` (one JSON object per logged step, each written by one
  ``write`` to a file opened for appending, so a line is whole or absent). A resumed run first drops the lines
  after its checkpoint's step (those steps are trained again) and so the curves always cover the whole run.
* ``output_dir/curves.png``: ``omni.plots.training_curves`` of that history, drawn at every evaluation, at the end
  of training and when a signal stops it.
* Samples: ``samples_fn(model, step) -> [omni.plots.Picture | Clip | Note]`` (a recipe's, or its tasks'
  ``Task.samples``) runs after each evaluation on the main process, under the evaluation's conditions (eval mode, no gradients,
  autocast, RNG streams restored) with the plain module; its pictures, audio clips and texts go to
  TensorBoard (``add_image``, ``add_audio``, ``add_text``), and the pictures of the latest evaluation also to
  ``output_dir/samples/<tag>.png`` (the tag's "/" as "_"), for a person without TensorBoard. Not under FSDP (every forward is collective there).
* matplotlib is optional (the ``viz`` extra): without it one warning line says how to install it and the run
  goes on without pictures. A picture that fails to draw is a warning too: it never fails a trained run.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from omni.files import write_atomic
from omni.steps import Loss, prepare_data, to_device

EvalFn = Callable[[nn.Module, Any], Mapping[str, Tensor]]
ModelMetricsFn = Callable[[nn.Module, int], Mapping[str, float | Tensor]]
SamplesFn = Callable[[nn.Module, int], Sequence[Any]]  # -> omni.plots.Picture | Clip | Note items
HISTORY_NAME = "history.jsonl"
CURVES_NAME = "curves.png"
SAMPLES_DIR = "samples"


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Run a block (evaluation) without changing any RNG stream the training uses."""
    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(py)
    np.random.set_state(npy)


_RESUMABLE = ("state_dict", "load_state_dict", "set_epoch")


@contextlib.contextmanager
def held_position(data: Any) -> Iterator[None]:
    """Run a block that reads ``data`` from the start of its current epoch, and put ``data`` back where it was
    after it. For rank-local resumable loaders (``state_dict``/``load_state_dict``/``set_epoch`` and an
    ``epoch``); any other iterable (a list, a plain DataLoader) starts afresh at every ``iter`` anyway."""
    if not all(callable(getattr(data, name, None)) for name in _RESUMABLE) or not hasattr(data, "epoch"):
        yield
        return
    saved = copy.deepcopy(data.state_dict())
    epoch = int(data.epoch)
    data.set_epoch(epoch + 1)  # set_epoch(e) goes to the start of e, a no-op when already in e: leave e first
    data.set_epoch(epoch)
    try:
        yield
    finally:
        data.load_state_dict(saved)


def first_batch(data: Iterable[Any]) -> Any:
    """The first batch of a pass over ``data`` without moving it (``held_position``): what a samples_fn shows
    of the eval set. A resumable loader's iterator is closed, not left half-read (workers, cursor)."""
    with held_position(data):
        it = iter(data)
        try:
            return next(it)
        finally:
            close = getattr(it, "close", None)
            if callable(close):
                close()


def _scalar(name: Any, value: Any) -> float:
    """A model_metrics_fn value as a python float (a number or a one-element Tensor)."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise TypeError(f"model_metrics_fn value {name!r} must be a scalar, got a Tensor of shape "
                            f"{tuple(value.shape)}")
        return float(value.detach().reshape(()).item())
    return float(value)


class Evaluator:
    """The module docstring's evaluation over ``data`` (prepared by Accelerate as ``prepare`` says, see
    ``omni.steps.prepare_data``) with ``eval_fn`` (None: ``loss``'s loss)."""

    def __init__(self, accelerator: Any, loss: Loss, data: Iterable[Any] | None = None,
                 eval_fn: EvalFn | None = None, prepare: bool | None = None) -> None:
        self.accelerator, self.loss, self.eval_fn, self.prepare = accelerator, loss, eval_fn, prepare
        self.data, self.prepared = prepare_data(accelerator, data, prepare)

    @torch.no_grad()
    def __call__(self, model: nn.Module, step: int, data: Iterable[Any] | None = None,
                 model_metrics_fn: ModelMetricsFn | None = None) -> dict[str, float]:
        """Evaluate on ``data`` (default: the Evaluator's) and ``model_metrics_fn`` at optimizer step ``step``."""
        data, prepared = (self.data, self.prepared) if data is None else \
            prepare_data(self.accelerator, data, self.prepare)
        if data is None and model_metrics_fn is None:
            return {}
        model.eval()
        try:  # hooks are inside held_position too: whatever they read of the eval data is put back
            with preserved_rng(), held_position(data if not prepared else None):
                sums, counts = self._local_sums(model, data if data is not None else (), prepared)
                whole: dict[str, float] = {}  # this rank's model_metrics_fn values
                if model_metrics_fn is not None:
                    with self.accelerator.autocast():
                        whole = {str(k): _scalar(k, v) for k, v in model_metrics_fn(model, step).items()}
        finally:
            model.train()
        return self._merge(sums, counts, whole)

    def _local_sums(self, model: nn.Module, data: Iterable[Any], prepared: bool
                    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """This rank's per-metric (sum, count) over ``data`` (a prepared loader's: already summed over ranks
        and divided by the world size, as the final reduce sums again)."""
        acc = self.accelerator
        dev = acc.device
        sums: dict[str, Tensor] = {}
        counts: dict[str, Tensor] = {}
        for batch in data:
            if batch is None:
                continue
            if not prepared:
                batch = to_device(batch, dev)
            if self.eval_fn is not None:
                with acc.autocast():
                    out = dict(self.eval_fn(model, batch))
            else:
                out = {"loss": self.loss(model, batch)[0]}
            for name, v in out.items():
                v = torch.as_tensor(v, device=dev).detach().float()
                if prepared:  # gather_for_metrics: per-sample values only; a 0-d per-batch value is gathered
                    g = acc.gather_for_metrics(v) if v.dim() > 0 else acc.gather(v.reshape(1))
                    s = g.sum() / acc.num_processes
                    c = torch.tensor(g.numel() / acc.num_processes, device=dev)
                else:
                    s, c = v.sum(), torch.tensor(float(v.numel()), device=dev)
                sums[name] = sums.get(name, 0.0) + s
                counts[name] = counts.get(name, 0.0) + c
        return sums, counts

    def _merge(self, sums: dict[str, Tensor], counts: dict[str, Tensor], whole: dict[str, float]
               ) -> dict[str, float]:
        """Every rank's sums, counts and model_metrics_fn values as the eval metrics (collective)."""
        acc = self.accelerator
        dev = acc.device
        names = sorted(sums)
        ranks_whole = [whole]
        if acc.num_processes > 1:  # a rank may have had no batches: agree on the names first
            from accelerate.utils import gather_object

            gathered = gather_object([(names, whole)])  # one object gather: eval_fn names, hook values
            names = sorted(set().union(*[set(n) for n, _ in gathered]))
            ranks_whole = [w for _, w in gathered]
        clash = set(names) & set().union(*ranks_whole)
        if clash:  # the same on every rank (gathered), so every rank raises
            raise ValueError(f"model_metrics_fn returned eval_fn's metric name(s) {sorted(clash)}")
        zero = torch.zeros((), device=dev)
        packed = torch.stack([*(sums.get(n, zero) for n in names), *(counts.get(n, zero) for n in names)]) \
            if names else torch.zeros(0, device=dev)
        if acc.num_processes > 1 and names:
            packed = acc.reduce(packed, reduction="sum")
        vals = packed.tolist()
        out = {f"eval/{n}": vals[i] / max(vals[len(names) + i], 1e-12) for i, n in enumerate(names)}
        for n in sorted(set().union(*ranks_whole)):  # mean over the ranks that returned it (python floats)
            reported = [w[n] for w in ranks_whole if n in w]
            out[f"eval/{n}"] = sum(reported) / len(reported)
        return out


# ----------------------------------------------------------------------------------------------------
# The run's history and its pictures


def read_history(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a history file (``MetricHistory``); [] when there is none. A line that is not a JSON
    object with a ``step`` (a write cut short by a crash) is skipped with one warning naming the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    records, bad = [], 0
    for line in text.splitlines():
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError
        except ValueError:
            bad += line.strip() != ""
            continue
        records.append(rec)
    if bad:
        warnings.warn(f"omni.train: {path}: skipped {bad} unreadable line{'s' if bad > 1 else ''} (a write cut "
                      "short?)", stacklevel=2)
    return records


class MetricHistory:
    """Every scalar a run logged: ``records`` ({"step": s, name: value, ...}) in memory and, when ``path`` is
    given (the main process), appended to that JSON-lines file (module docstring)."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = Path(path) if path is not None else None
        self.records: list[dict[str, Any]] = []

    def restore(self, step: int) -> None:
        """Start at optimizer step ``step`` (a resumed checkpoint's, 0 for a fresh run): the file's records up to
        it are kept, later ones (steps trained again) dropped, the file rewritten atomically."""
        if self.path is None:
            return
        self.records = [r for r in read_history(self.path) if r["step"] <= step]
        if not self.records and not self.path.exists():
            return
        write_atomic(self.path, "".join(_line(r) for r in self.records))

    def latest(self, prefix: str = "") -> dict[str, float]:
        """The last value logged of every scalar whose name starts with ``prefix`` (e.g. a finished run's final
        training metrics, read back from its history)."""
        out: dict[str, float] = {}
        for record in self.records:
            out.update({k: float(v) for k, v in record.items() if k != "step" and k.startswith(prefix)
                        and isinstance(v, (int, float)) and not isinstance(v, bool)})
        return out

    def append(self, step: int, values: Mapping[str, Any]) -> None:
        """Record ``values`` logged at ``step`` (floats, or lists of floats)."""
        record = {"step": int(step), **values}
        self.records.append(record)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, _line(record).encode("utf-8"))  # one write: the line is whole or absent
            finally:
                os.close(fd)


def _line(record: Mapping[str, Any]) -> str:
    def number(v: Any) -> Any:  # NaN / inf as strings: the file stays strict JSON for any reader
        return v if not isinstance(v, float) or math.isfinite(v) else str(v)

    return json.dumps({k: [number(x) for x in v] if isinstance(v, list) else number(v)
                       for k, v in record.items()}, separators=(",", ":")) + "\n"


class Pictures:
    """The run's pictures (module docstring): ``curves()`` writes ``output_dir/curves.png`` from ``history``;
    ``samples(model, step)`` logs ``samples_fn``'s items to TensorBoard. Only the main process draws or writes.
    ``title``: the curves' title (the run name)."""

    def __init__(self, accelerator: Any, output_dir: str | os.PathLike, history: MetricHistory,
                 samples_fn: SamplesFn | None = None, title: str | None = None) -> None:
        self.accelerator, self.history, self.samples_fn, self.title = accelerator, history, samples_fn, title
        self.path = Path(output_dir) / CURVES_NAME
        self.enabled = accelerator.is_main_process

    def curves(self) -> Path | None:
        """Draw the training curves to ``output_dir/curves.png`` (None when nothing was drawn)."""
        if not self.enabled or not self.history.records:
            return None
        from omni.plots import training_curves

        return self.path if self._draw("the training curves", lambda: training_curves(
            self.history.records, self.path, title=self.title)) is not None else None

    def samples(self, model: nn.Module, step: int) -> int:
        """Run ``samples_fn`` on the plain ``model`` under the evaluation's conditions, log its items to
        TensorBoard at ``step`` and write its pictures to ``output_dir/samples/``; the number of items."""
        if self.samples_fn is None or not self.enabled or self.accelerator.distributed_type == "FSDP":
            return 0
        was_training = model.training
        model.eval()
        try:
            with preserved_rng(), torch.no_grad(), self.accelerator.autocast():
                items = self._draw("the sample pictures", lambda: list(self.samples_fn(model, step)))
        finally:
            model.train(was_training)
        items = items or []
        from omni.plots import Picture, write_png

        for item in items:
            if isinstance(item, Picture):
                write_png(item.image, self.path.parent / SAMPLES_DIR / f"{item.tag.replace('/', '_')}.png")
        writer = self.writer()
        return log_items(writer, items, step) if writer is not None else len(items)

    def writer(self) -> Any:
        """The TensorBoard SummaryWriter of the run's trackers (None without one)."""
        for tracker in getattr(self.accelerator, "trackers", []):
            if getattr(tracker, "name", None) == "tensorboard":
                return tracker.writer
        return None

    def _draw(self, what: str, draw: Callable[[], Any]) -> Any:
        return drawn(what, draw)


_WARNED_MISSING = False


def drawn(what: str, draw: Callable[[], Any], prog: str = "omni.train") -> Any:
    """``draw()``, or None with one warning line ``<prog>: ...`` when it cannot: matplotlib missing (said once
    per process, with the install line), or the picture failing to draw (a picture is never worth a run)."""
    from omni.deps import MissingDependency

    global _WARNED_MISSING
    try:
        return draw()
    except MissingDependency as exc:
        if not _WARNED_MISSING:
            _WARNED_MISSING = True
            warnings.warn(f"{prog}: {exc}: no pictures (training curves, samples) are drawn", stacklevel=3)
    except Exception as exc:
        warnings.warn(f"{prog}: could not draw {what}: {type(exc).__name__}: {' '.join(str(exc).split())}",
                      stacklevel=3)
    return None


def log_items(writer: Any, items: Sequence[Any], step: int) -> int:
    """Log ``omni.plots.Picture`` / ``Clip`` / ``Note`` items to a TensorBoard SummaryWriter at ``step``; the number logged."""
    from omni.plots import Clip, Note, Picture

    for item in items:
        if isinstance(item, Picture):
            writer.add_image(item.tag, np.asarray(item.image), step, dataformats="HWC")
        elif isinstance(item, Clip):
            wave = torch.as_tensor(np.asarray(item.waveform, dtype=np.float32)).clamp(-1, 1).reshape(1, -1)
            writer.add_audio(item.tag, wave, step, sample_rate=int(item.sample_rate))
            writer.add_text(item.tag, item.text, step)
        elif isinstance(item, Note):
            writer.add_text(item.tag, item.text, step)
        else:
            raise TypeError(f"a sample item must be an omni.plots.Picture, Clip or Note, got {type(item).__name__}")
    writer.flush()
    return len(items)


__all__ = ["CURVES_NAME", "Evaluator", "HISTORY_NAME", "MetricHistory", "Pictures", "SAMPLES_DIR", "SamplesFn", "drawn",
           "first_batch", "held_position", "log_items", "preserved_rng", "read_history"]
