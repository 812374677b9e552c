"""One optimizer step of ``omni.train.Trainer``: where its batches come from and how it is computed.

* ``DataStream``: endless batches from a re-iterable, epochs rolled over (``set_epoch`` when the data has it),
  ``None`` batches skipped (a rank fetches the next one, so every rank still runs ``grad_accum`` backward
  passes per step). It tracks each rank's position (epoch, batches taken in the epoch; the loader's own
  ``state_dict`` when it has one) for checkpoints and resumes there: a stateful loader loads its state, an
  Accelerate-prepared DataLoader skips batches (``skip_first_batches``), any other re-iterable is replayed.
  Every call into the data runs on the stream's own RNG (``DataRNG``, checkpointed with the position):
  loaders that draw from the global RNG (a DataLoader's worker seed, augmenting collate functions) would
  otherwise shift the training stream (dropout) differently in a resumed run than in a straight one.
* ``Loss``: ``loss_fn(model, batch)`` under the mixed-precision autocast, checked to be a scalar.
* The step strategies, both ``step(model, batches, step) -> record`` with record = loss, lr, grad_norm, samples,
  tokens and loss_fn's metrics (means over micro-batches and ranks; samples and tokens summed):

  - ``EagerStep``: ``grad_accum`` micro-batches per rank, each loss divided by ``grad_accum`` (DDP averages
    over ranks: the gradient is the mean of the per-micro-batch mean losses), gradient sync only on the last
    one (``no_sync``), clipping (the norm of the sharded gradients under FSDP2), then ONE all-reduce of the
    logging values and every micro-batch's non-finite flag: if any rank saw a NaN/inf loss (or the norm is
    non-finite) every rank raises ``NonFiniteLossError`` naming the step, rank, batch position and sample
    keys, before the optimizer steps. The LR scheduler steps once per optimizer step.
  - ``GraphedStep`` (``TrainConfig.cuda_graph``): the whole step (forward, backward, clipping, AdamW) as one
    ``omni.cuda_graphs.GraphedTrainStep`` replay, captured on the first batch (after any resume, so it reads
    the restored optimizer state). Same record and checks, after the fact: the optimizer step is part of the
    graph, so a non-finite error says the weights in memory are unusable. On CPU it runs the identical step
    eagerly, with results equal to ``EagerStep``'s.
"""

from __future__ import annotations

import base64
import contextlib
import math
import random
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
from torch import Tensor, nn

Position = tuple[Any, int, int]  # (batch, epoch, index of the batch in its epoch)
LossOutput = Tensor | tuple[Tensor, Mapping[str, float | Tensor]]


class NonFiniteLossError(RuntimeError):
    """Loss (or gradient norm) became NaN/inf; raised on every rank before the optimizer step."""


# ----------------------------------------------------------------------------------------------------
# Batches: what they hold, where they go


def batch_keys(batch: Any) -> list[str] | None:
    """Sample keys of a batch: PackedBatch.keys, batch["keys"] / batch["__key__"], or None."""
    keys = getattr(batch, "keys", None)
    if isinstance(keys, (list, tuple)):
        return [str(k) for k in keys]
    if isinstance(batch, Mapping):
        for name in ("keys", "__key__", "key"):
            if name in batch and isinstance(batch[name], (list, tuple)):
                return [str(k) for k in batch[name]]
    return None


def count_samples(batch: Any) -> int:
    if hasattr(batch, "num_documents"):
        return int(batch.num_documents)
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        if isinstance(v, Tensor) and v.dim() > 0:
            return int(v.shape[0])
    return 0


def count_tokens(batch: Any) -> Tensor | None:
    document = getattr(batch, "document", None)  # PackedBatch: real (non-padding) tokens
    return (document >= 0).sum() if isinstance(document, Tensor) else None


def to_device(batch: Any, device: torch.device) -> Any:
    """A batch Accelerate did not prepare, on the training device."""
    from accelerate.utils import send_to_device

    return send_to_device(batch, device, non_blocking=True)


def prepare_data(accelerator: Any, data: Any, prepare: bool | None) -> tuple[Any, bool]:
    """(data, whether ``accelerator.prepare_data_loader`` took it). ``prepare`` None: only a plain DataLoader
    without ``state_dict``/``set_epoch`` is prepared (sharded, seeded sampler); loaders that have them
    (omni's ShardLoader) are already split per rank and must not be re-sharded."""
    if data is None:
        return None, False
    if prepare is None:
        prepare = isinstance(data, torch.utils.data.DataLoader) and not (
            hasattr(data, "state_dict") or hasattr(data, "set_epoch"))
    return (accelerator.prepare_data_loader(data) if prepare else data), prepare


# ----------------------------------------------------------------------------------------------------
# The data stream: epochs, position, its own RNG, resume


class DataRNG:
    """A private python/numpy/torch-CPU RNG stream swapped in around every call into the training data
    (module docstring); JSON-serialisable state."""

    def __init__(self, seed: int) -> None:
        self.torch = torch.Generator().manual_seed(seed).get_state()
        self.python = random.Random(seed).getstate()
        self.numpy = np.random.RandomState(seed % 2**32).get_state()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
        torch.set_rng_state(self.torch)
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        try:
            yield
        finally:
            self.torch, self.python, self.numpy = torch.get_rng_state(), random.getstate(), np.random.get_state()
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])

    def state_dict(self) -> dict[str, Any]:
        name, keys, pos, has_gauss, gauss = self.numpy
        return {"torch": base64.b64encode(self.torch.numpy().tobytes()).decode(),
                "python": [self.python[0], list(self.python[1]), self.python[2]],
                "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
        self.torch = torch.from_numpy(raw)
        version, internal, gauss_next = state["python"]
        self.python = (version, tuple(internal), gauss_next)
        name, keys, pos, has_gauss, gauss = state["numpy"]
        self.numpy = (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss)


class DataStream:
    """Endless (batch, epoch, index in epoch) from a re-iterable, tracking this rank's position (module
    docstring). ``prepare``: as ``prepare_data`` says; ``seed``: the run's, made per rank here."""

    def __init__(self, data: Any, accelerator: Any, seed: int, prepare: bool | None = None) -> None:
        self.data, self.prepared = prepare_data(accelerator, data, prepare)
        self.accelerator = accelerator
        self.rng = DataRNG(1_000_003 * (seed + 1) + accelerator.process_index)
        self.stateful = not self.prepared and hasattr(data, "state_dict") and hasattr(data, "load_state_dict")
        self.epoch, self.position = 0, 0
        self._yielded_this_epoch = 0
        self._it: Iterator | None = None

    def _set_epoch(self, epoch: int) -> None:
        if hasattr(self.data, "set_epoch"):
            self.data.set_epoch(epoch)

    def start(self, epoch: int = 0, position: int = 0, loader_state: Any = None,
              rng_state: Mapping[str, Any] | None = None) -> None:
        """Open the iterator at (epoch, position), under the data RNG stream."""
        if rng_state is not None:
            self.rng.load_state_dict(rng_state)
        with self.rng.active():
            self._start(epoch, position, loader_state)

    def _start(self, epoch: int, position: int, loader_state: Any) -> None:
        self.epoch, self.position = epoch, position
        self._yielded_this_epoch = position
        self._set_epoch(epoch)
        if self.stateful and loader_state is not None:
            self.data.load_state_dict(loader_state)
            # The loader's own position is the authority: after the last batch of an epoch it may
            # already name the next epoch (ShardLoader does) while our counter has not rolled over.
            own = self.data.state_dict()
            if isinstance(own, Mapping) and "epoch" in own:
                self.epoch = int(own["epoch"])
                self.position = self._yielded_this_epoch = int(own.get("batches_done", position))
            self._it = iter(self.data)
        elif self.prepared and position:
            skipping = self.accelerator.skip_first_batches(self.data, position)
            skipping.set_epoch(epoch)  # its own counter starts at 0 and would reseed the shared sampler
            self._it = iter(skipping)
        else:
            self._it = iter(self.data)
            for i in range(position):  # generic re-iterable: replay (must be deterministic per epoch)
                try:
                    next(self._it)
                except StopIteration:
                    raise ValueError(f"cannot resume the training data at epoch {epoch} batch {position}: "
                                     f"the epoch has only {i} batches now") from None

    def __iter__(self) -> "DataStream":
        return self

    def __next__(self) -> Position:
        """(batch, epoch, index in epoch) of the next non-None batch, rolling over epochs."""
        assert self._it is not None, "start() first"
        with self.rng.active():
            return self._next()

    def _next(self) -> Position:
        while True:
            try:
                batch = next(self._it)
            except StopIteration:
                if self._yielded_this_epoch == 0:
                    raise ValueError(
                        f"the training data yielded no batches in epoch {self.epoch}: pass a re-iterable "
                        f"(list, DataLoader, ShardLoader), not a one-shot generator") from None
                self.epoch += 1
                self.position = self._yielded_this_epoch = 0
                self._set_epoch(self.epoch)
                self._it = iter(self.data)
                continue
            index = self.position
            self.position += 1
            if batch is None:  # skipped; still counted, it was consumed from the loader
                continue
            self._yielded_this_epoch += 1
            return batch, self.epoch, index

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position,
                "loader": self.data.state_dict() if self.stateful else None, "rng": self.rng.state_dict()}


# ----------------------------------------------------------------------------------------------------
# The loss and the step strategies


class Loss:
    """``loss_fn(model, batch)`` (None: ``model(batch)``) under the mixed-precision autocast, as (0-d loss,
    {name: 0-d float32 metric on the device})."""

    def __init__(self, accelerator: Any, loss_fn: Callable[[nn.Module, Any], LossOutput] | None) -> None:
        self.accelerator, self.loss_fn = accelerator, loss_fn

    def __call__(self, model: nn.Module, batch: Any) -> tuple[Tensor, dict[str, Tensor]]:
        with self.accelerator.autocast():
            out = self.loss_fn(model, batch) if self.loss_fn is not None else model(batch)
        loss, metrics = (out if isinstance(out, tuple) else (out, {}))
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(f"the loss must be a scalar Tensor, got {type(loss).__name__}"
                            f"{tuple(loss.shape) if isinstance(loss, Tensor) else ''}")
        dev = self.accelerator.device
        return loss.reshape(()), {k: torch.as_tensor(v, dtype=torch.float32, device=dev).detach().reshape(())
                                  for k, v in metrics.items()}


class _Step:
    """What both strategies share: the prepared optimizer and scheduler, the loss, the clip norm, the
    metric names every step must repeat, the way a batch reaches the device and the collective non-finite
    report (``last_checkpoint()`` names the checkpoint a user falls back to). The model is the caller's,
    passed to every step: no reference to a DDP wrapper outlives the Trainer's (``Trainer.close``)."""

    def __init__(self, accelerator: Any, optimizer: Any, scheduler: Any, loss: Loss, *, grad_accum: int,
                 clip_norm: float, prepared: bool, last_checkpoint: Callable[[], Path | None]) -> None:
        self.accelerator, self.optimizer, self.scheduler, self.loss = accelerator, optimizer, scheduler, loss
        self.grad_accum, self.prepared, self.last_checkpoint = grad_accum, prepared, last_checkpoint
        self.max_norm = clip_norm if clip_norm and clip_norm > 0 else float("inf")  # inf: the norm is only logged
        self.metric_names: list[str] | None = None

    def _fetch(self, batches: Iterator[Position], where: list) -> tuple[Any, int, Tensor | None]:
        """The next batch on the device, its (samples, tokens), its position appended to ``where``."""
        batch, epoch, index = next(batches)
        where.append((epoch, index, batch_keys(batch)))
        samples, tokens = count_samples(batch), count_tokens(batch)
        return (batch if self.prepared else to_device(batch, self.accelerator.device)), samples, tokens

    def _raise_non_finite(self, step: int, what: str, local: list[tuple], step_taken: bool = False) -> None:
        """Collective: every rank gathers every rank's culprits and raises the same error."""
        from accelerate.utils import gather_object

        acc = self.accelerator
        mine = [(acc.process_index, *c) for c in local]
        culprits = gather_object(mine) if acc.num_processes > 1 else mine

        def show(keys: list[str] | None) -> str:
            if keys is None:
                return "(batch has no keys)"
            return str(keys) if len(keys) <= 32 else f"{keys[:32]} ... ({len(keys)} keys)"

        lines = [f"  rank {r} micro-batch {m} (epoch {e}, batch {i} of the epoch): keys {show(keys)}"
                 for r, m, e, i, keys in culprits]
        last = self.last_checkpoint()
        taken = ("the optimizer step was already taken inside the CUDA graph (cuda_graph), so the weights in "
                 "memory are unusable" if step_taken else "the optimizer step was not taken")
        raise NonFiniteLossError(
            f"non-finite {what} at step {step}; {taken} and nothing was saved for this step (last complete "
            f"checkpoint: {last if last else 'none'}). Batches:\n" + "\n".join(lines))

    def _record(self, values: list[float], lr: float, divisor: int) -> dict[str, float]:
        """The step's record from [loss, *metrics, tokens, samples, ..., grad_norm]: loss and metrics are
        sums over ``divisor`` micro-batches."""
        k = len(self.metric_names)
        out = {"loss": values[0] / divisor, "lr": lr, "grad_norm": values[-1], "tokens": values[1 + k],
               "samples": values[2 + k]}
        out.update({name: values[1 + i] / divisor for i, name in enumerate(self.metric_names)})
        return out


class EagerStep(_Step):
    """``grad_accum`` micro-batches per rank, clipping, the non-finite check, AdamW, the scheduler (module
    docstring)."""

    def step(self, model: nn.Module, batches: Iterator[Position], step: int) -> dict[str, float]:
        """Compute optimizer step number ``step`` (1-based) of the prepared ``model`` from the next
        ``grad_accum`` batches."""
        acc, accum = self.accelerator, self.grad_accum
        dev = acc.device
        where: list[tuple[int, int, list[str] | None]] = []
        flags, loss_sum, samples, tokens = [], torch.zeros((), device=dev), 0, torch.zeros((), device=dev)
        metric_sums: dict[str, Tensor] = {}
        for micro in range(accum):
            batch, n, n_tok = self._fetch(batches, where)
            samples += n
            if n_tok is not None:
                tokens = tokens + n_tok.to(dev)
            with contextlib.nullcontext() if micro == accum - 1 else acc.no_sync(model):
                loss, metrics = self.loss(model, batch)
                acc.backward(loss / accum)
            flags.append((~torch.isfinite(loss.detach())).float())
            loss_sum = loss_sum + loss.detach().float()
            for k, v in metrics.items():
                metric_sums[k] = metric_sums.get(k, 0.0) + v
        if self.metric_names is None:
            self.metric_names = sorted(metric_sums)
        if sorted(metric_sums) != self.metric_names:
            raise ValueError(f"loss_fn metrics changed at step {step}: {sorted(metric_sums)} "
                             f"instead of {self.metric_names}")
        norm = acc.clip_grad_norm_(model.parameters(), self.max_norm)
        norm = norm if isinstance(norm, Tensor) else torch.tensor(float(norm))
        if hasattr(norm, "full_tensor"):  # FSDP2: a replicated DTensor, which torch.cat below refuses
            norm = norm.full_tensor()
        # One small all-reduce and one host sync per step: global loss/metrics for logging, and the
        # non-finite flags every rank must agree on before anyone steps the optimizer.
        packed = torch.stack([loss_sum, *[metric_sums[k] for k in self.metric_names], tokens,
                              torch.tensor(float(samples), device=dev), *flags])
        if acc.num_processes > 1:
            packed = acc.reduce(packed, reduction="sum")
        values = torch.cat([packed, norm.detach().float().reshape(1).to(dev)]).tolist()
        grad_norm = values[-1]
        if any(b > 0 for b in values[-1 - accum:-1]):
            self._raise_non_finite(step, "loss", [(m, *w) for m, w in enumerate(where) if flags[m].item() > 0])
        if not math.isfinite(grad_norm) and acc.mixed_precision != "fp16":  # fp16: the scaler skips it
            self._raise_non_finite(step, "gradient norm", [(m, *w) for m, w in enumerate(where)])
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._record(values, lr, accum * acc.num_processes)


class GraphedStep(_Step):
    """One replay of the captured step per optimizer step, then the same record and non-finite checks
    (module docstring). ``graph``: the ``GraphedTrainStep``, captured from the first step's model and batch."""

    def __init__(self, accelerator: Any, *args: Any, **kwargs: Any) -> None:
        if accelerator.num_processes > 1:
            raise ValueError(f"cuda_graph trains on one process; this run has {accelerator.num_processes}")
        super().__init__(accelerator, *args, **kwargs)
        self.graph: Any = None
        self._layout: tuple[Any, list[bool]] | None = None  # the captured batch's pytree spec, tensor leaves
        self._metrics: dict[str, Tensor] = {}  # the captured loss call's metric outputs (every replay refills)

    def step(self, model: nn.Module, batches: Iterator[Position], step: int) -> dict[str, float]:
        """Optimizer step number ``step`` on the next batch (``model``: the prepared one, captured once)."""
        from torch.utils._pytree import tree_flatten

        dev, where = self.accelerator.device, []
        batch, samples, n_tok = self._fetch(batches, where)
        epoch, index, _ = where[0]
        leaves, spec = tree_flatten(batch)
        is_tensor = [isinstance(x, Tensor) for x in leaves]
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        if self.graph is None:
            self._build(model, tensors, spec, is_tensor)
        elif (spec, is_tensor) != self._layout:
            raise ValueError(f"cuda_graph: batch {index} of epoch {epoch} is structured differently from the "
                             f"captured first batch ({spec} vs {self._layout[0]}); a CUDA graph replays one "
                             "fixed batch layout")
        lr = float(self.scheduler.get_last_lr()[0])
        try:
            loss = self.graph(*tensors)
        except ValueError as exc:  # a shape or dtype that differs from the captured batch
            raise ValueError(f"cuda_graph: batch {index} of epoch {epoch}: {exc}") from exc
        self.scheduler.step()
        tokens = n_tok.to(dev).float() if n_tok is not None else torch.zeros((), device=dev)
        values = torch.stack([loss.float(), *[self._metrics[k] for k in self.metric_names], tokens,
                              self.graph.grad_norm.float()]).tolist()
        values.insert(-1, float(samples))  # counted on the host: no copy to the device
        if not math.isfinite(values[0]):
            self._raise_non_finite(step, "loss", [(0, *where[0])], step_taken=True)
        if not math.isfinite(values[-1]):
            self._raise_non_finite(step, "gradient norm", [(0, *where[0])], step_taken=True)
        return self._record(values, lr, 1)

    def _build(self, model: nn.Module, tensors: list[Tensor], spec: Any, is_tensor: list[bool]) -> None:
        """Capture the step on the first batch. The optimizer becomes what capture needs: a tensor LR per
        group on the device (the scheduler fills it in place; float64 on CPU keeps results bit-identical to
        a float LR), fused + capturable on CUDA."""
        from torch.utils._pytree import tree_unflatten

        from omni.cuda_graphs import GraphedTrainStep

        dev = self.accelerator.device
        cuda = dev.type == "cuda"
        opt = getattr(self.optimizer, "optimizer", self.optimizer)  # the torch optimizer inside Accelerate's
        for group in opt.param_groups:
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32 if cuda else torch.float64,
                                       device=dev)
            if cuda:
                group["fused"], group["capturable"] = True, True
        if cuda:
            for state in opt.state.values():
                if "step" in state:
                    state["step"] = state["step"].to(device=dev, dtype=torch.float32)

        def loss_of_tensors(model: nn.Module, *tensors: Tensor) -> Tensor:
            it = iter(tensors)
            batch = tree_unflatten([next(it) if t else None for t in is_tensor], spec)
            loss, self._metrics = self.loss(model, batch)  # the captured call's outputs
            return loss

        self.graph = GraphedTrainStep(model, loss_of_tensors, opt, tensors, clip_norm=self.max_norm)
        self._layout = (spec, is_tensor)
        self.metric_names = sorted(self._metrics)


def build_step(config: Any, accelerator: Any, optimizer: Any, scheduler: Any, loss: Loss, prepared: bool,
               last_checkpoint: Callable[[], Path | None]) -> EagerStep | GraphedStep:
    """The step strategy ``config`` (a TrainConfig) asks for: ``GraphedStep`` with ``cuda_graph``, else
    ``EagerStep``."""
    kind = GraphedStep if config.cuda_graph else EagerStep
    return kind(accelerator, optimizer, scheduler, loss, grad_accum=config.grad_accum,
                clip_norm=config.clip_norm, prepared=prepared, last_checkpoint=last_checkpoint)


__all__ = ["DataRNG", "DataStream", "EagerStep", "GraphedStep", "Loss", "NonFiniteLossError", "batch_keys",
           "build_step", "count_samples", "count_tokens", "prepare_data", "to_device"]
