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
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch
from torch import Tensor, nn

from omni.steps import Loss, prepare_data, to_device

EvalFn = Callable[[nn.Module, Any], Mapping[str, Tensor]]
ModelMetricsFn = Callable[[nn.Module, int], Mapping[str, float | Tensor]]


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Run a block (evaluation) without changing any RNG stream the training uses."""
    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(py)
    np.random.set_state(npy)


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
        try:
            with preserved_rng():
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


__all__ = ["Evaluator", "preserved_rng"]
