"""Whole-training-step CUDA graphs for small, launch-bound models, and the capture helpers (``warm_up``,
``capture``) that this step and ``omni.decoding.GraphedGreedyDecoder`` share.

    opt = make_adamw(model.parameters(), lr=1e-4, weight_decay=1e-4)   # tensor LR; fused + capturable on CUDA
    step = GraphedTrainStep(model, loss_fn, opt, example=(tokens, targets), clip_norm=0.25,
                            autocast_dtype=torch.bfloat16)
    for i, (tokens, targets) in enumerate(batches):
        step.set_lr(1e-4 * schedule(i))    # fills the LR tensor in place: no re-capture
        loss = step(tokens, targets)       # copy into static buffers + one graph replay; no host sync

Why. The official Decision Transformer (3 layers, width 128, context 20) does a few microseconds of math
per kernel but launches hundreds of kernels per training step (forward, backward, clipping, optimizer),
so the GPU waits on the CPU. Capturing the WHOLE step -- ``loss_fn`` forward, backward,
``clip_grad_norm_`` and ``optimizer.step()`` -- in one ``torch.cuda.CUDAGraph`` turns it into one launch.
``torch.compile`` (inductor) fuses the math first; the two compose (compile the ``loss_fn``).

The rules this follows (PyTorch "CUDA Graphs" notes, checked against the torch 2.11 sources):

* Static shapes. The graph replays fixed addresses and shapes: every call's batch must have the shapes and
  dtypes of ``example`` (ValueError naming the mismatch otherwise; pad or drop a short last batch).
* Warm-up, then undo it. Before capture, ``warmup`` eager steps run on a side stream (lazy optimizer
  state, cuBLAS workspaces, torch.compile, autograd's first-call work). They would change the training
  result, so they are undone: parameters and buffers are snapshot before and copied back in place
  after, optimizer state that existed is copied back, Adam state that warm-up created is zeroed in place
  (a fresh Adam state IS zeros: step 0, zero moments), and the CPU/CUDA RNG states are restored.
  The object therefore starts exactly where model and optimizer were. The CPU path does the same.
* Optimizer. Adam / AdamW only (the exact undo relies on their all-zero fresh state). Every param
  group's ``lr`` must be a 1-element tensor, so a schedule changes it in place (``set_lr`` or a torch
  LRScheduler, which ``fill_``s tensor LRs) without re-capture. On CUDA the groups must be
  ``capturable=True`` -- torch refuses to capture ``step()`` otherwise, even with ``fused=True``
  (``Optimizer._accelerator_graph_capture_health_check``) -- and ``lr`` a float32 tensor on the
  parameters' device (the fused kernel, ``_fused_adamw_.tensor_lr``, reads it from device memory on every
  replay; a CPU ``lr`` would be read once with ``.item()``). ``make_adamw`` builds exactly that.
* Clipping. ``clip_grad_norm_(..., error_if_nonfinite=False)`` is capture-safe: the total norm and the
  clip coefficient ``clamp(max_norm / (norm + 1e-6), max=1)`` stay on the device (no ``.item()``, no
  data-dependent Python branch). The norm is returned through ``grad_norm``.
* Gradients. Set to None before capture, so backward allocates them in the graph's private memory pool
  and every replay overwrites them (no zero_grad inside the graph, nothing accumulates).
* Autocast. Applied around ``loss_fn`` with ``cache_enabled=False`` (the CUDA-graphs notes' rule for
  autocast under capture); backward runs outside it as usual.
* No host sync, so no non-finite check: inspect the returned loss when you log it.
* Dropout on CUDA: a captured graph draws from the Philox offset torch advances on every replay, so the
  masks differ from an eager run's (equally random); on CPU the draws equal the eager loop's.
* ``loss`` and ``grad_norm`` are static tensors overwritten by the next call: ``.clone()`` or ``.item()``
  them to keep a value.

On CPU (or ``use_graph=False``) the identical step runs eagerly on the same static buffers, warm-up and
undo included, so all of the plumbing is testable without a GPU (tests/test_cuda_graphs.py).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.nn.utils import clip_grad_norm_

LossFn = Callable[..., Tensor]  # loss_fn(model, *batch) -> scalar loss tensor
T = TypeVar("T")


# ----------------------------------------------------------------------------------------------------
# Capture: the two halves of the PyTorch CUDA-graphs recipe, shared by GraphedTrainStep and
# omni.decoding.GraphedGreedyDecoder


def _capture_safe_autocast() -> contextlib.AbstractContextManager:
    """The caller's CUDA autocast state with the weight-cast cache off: a graph cannot hold that cache (the
    CUDA-graphs notes' rule), so casts are replayed. No change where autocast is off."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


def warm_up(step: Callable[[], T], n: int, device: torch.device) -> T:
    """Run ``step`` ``n`` times on a side stream of CUDA ``device`` before capturing it (lazy initialisation,
    cuBLAS workspaces, torch.compile, autotuning must not happen inside the capture); the current stream then
    waits for it. Returns the last call's result."""
    if n < 1:
        raise ValueError(f"warm_up needs n >= 1, got {n}")
    with torch.cuda.device(device), _capture_safe_autocast():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(n):
                out = step()
        torch.cuda.current_stream().wait_stream(side)
    return out


def capture(step: Callable[[], T], device: torch.device, what: str) -> tuple[torch.cuda.CUDAGraph, T]:
    """One call of ``step`` captured as a CUDA graph on ``device`` -> (graph, the call's outputs: static tensors
    every replay overwrites). ``what`` names the step in the error a failed capture raises."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.device(device), _capture_safe_autocast(), torch.cuda.graph(graph):
            out = step()
    except Exception as exc:
        raise RuntimeError(
            f"CUDA graph capture of {what} failed. Usual causes: a host sync inside the step "
            "(.item(), .cpu(), printing a tensor, a data-dependent shape such as boolean indexing or "
            "nonzero()), a CPU tensor used by the step, or another thread touching the GPU during capture. "
            f"Original error: {type(exc).__name__}: {exc}") from exc
    return graph, out


# ----------------------------------------------------------------------------------------------------
# The training step


def make_adamw(params: Iterable[Any], lr: float, *, weight_decay: float = 0.01,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               device: torch.device | str | None = None) -> torch.optim.AdamW:
    """AdamW ready for ``GraphedTrainStep``: each param group gets its OWN 0-dim LR tensor on ``device``
    (default: the first parameter's), so ``set_lr`` / a scheduler can update it in place.
    On CUDA: float32 LR (the fused kernel reads a ``float*``), ``fused=True`` (one kernel per group) and
    ``capturable=True`` (step counts on the device, required for capture). On CPU: float64 LR and torch's
    default (single-tensor) AdamW, which then gives bit-identical results to a Python-float LR.
    ``params``: parameters or param-group dicts (a group's own "lr" is kept)."""
    items = list(params)
    if not items:
        raise ValueError("make_adamw got no parameters")
    groups = [dict(g) for g in items] if isinstance(items[0], dict) else [{"params": items}]
    for g in groups:
        g["params"] = list(g["params"])
    if device is None:
        device = groups[0]["params"][0].device
    device = torch.device(device)
    cuda = device.type == "cuda"
    dtype = torch.float32 if cuda else torch.float64
    for g in groups:
        g["lr"] = torch.tensor(float(g.get("lr", lr)), dtype=dtype, device=device)
    flags = {"fused": True, "capturable": True} if cuda else {}
    return torch.optim.AdamW(groups, lr=torch.tensor(float(lr), dtype=dtype, device=device),
                             betas=betas, eps=eps, weight_decay=weight_decay, **flags)


class GraphedTrainStep:
    """One training step -- ``loss_fn(model, *batch)``, backward, optional grad-norm clip, optimizer step --
    captured once as a CUDA graph (CUDA) or run eagerly on the same static buffers (CPU).

    model: the module whose parameters ``optimizer`` updates (its first parameter sets the device).
    loss_fn: ``loss_fn(model, *batch) -> scalar Tensor``; may be ``torch.compile``d.
    optimizer: Adam / AdamW with tensor LRs (see ``make_adamw`` and the module docstring).
    example: one batch (tuple of tensors) fixing the shapes and dtypes of every later batch; its values
        are used by the warm-up steps only (which are undone).
    clip_norm: max total gradient norm over ``model.parameters()`` (``clip_grad_norm_``), or None for no clipping.
    autocast_dtype: e.g. ``torch.bfloat16`` to run ``loss_fn`` under autocast; None for none.
    warmup: eager steps before capture (>= 1; the PyTorch notes use 3, 11 under DDP).
    use_graph: None = capture when the model is on CUDA; False forces the eager path (debugging).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
                 example: Sequence[Tensor], *, clip_norm: float | None = None,
                 autocast_dtype: torch.dtype | None = None, warmup: int = 3, use_graph: bool | None = None) -> None:
        first = next(iter(model.parameters()), None)
        if first is None:
            raise ValueError("GraphedTrainStep needs a model with parameters")
        self.device = first.device
        self.use_graph = self.device.type == "cuda" if use_graph is None else bool(use_graph)
        if self.use_graph and self.device.type != "cuda":
            raise ValueError(f"use_graph=True needs the model on a CUDA device, it is on {self.device}")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0 or None, got {clip_norm!r}")
        if warmup < 1:
            # capture must find the optimizer state already allocated and initialised
            raise ValueError(f"warmup must be >= 1, got {warmup}")
        _check_optimizer(optimizer, self.device, self.use_graph)
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.clip_norm, self.autocast_dtype = clip_norm, autocast_dtype
        # clipped in the model's own order, as clip_grad_norm_(model.parameters()) does: the same norm to the
        # last bit as an eager loop's (the optimizer's groups may list the parameters in another order)
        self.clip_params = list(model.parameters())
        if not isinstance(example, (tuple, list)) or not example:
            raise ValueError("example must be a non-empty tuple of tensors (one batch)")
        for i, x in enumerate(example):
            if not isinstance(x, Tensor):
                raise ValueError(f"example[{i}] is a {type(x).__name__}, expected a Tensor")
        # Static inputs: every call copies into these, the graph reads them.
        self.static_batch: tuple[Tensor, ...] = tuple(x.detach().to(self.device, copy=True) for x in example)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._loss: Tensor
        self._grad_norm: Tensor | None = None
        with self._on_device():
            self._warm_up(warmup)
            if self.use_graph:
                self._capture()

    # -- public ----------------------------------------------------------------------------------------
    @property
    def graphed(self) -> bool:
        """True when calls replay a captured CUDA graph (False: the eager fallback)."""
        return self._graph is not None

    @property
    def grad_norm(self) -> Tensor | None:
        """Total gradient norm before clipping of the latest step (a static tensor), None without clipping."""
        return self._grad_norm

    def __call__(self, *batch: Tensor) -> Tensor:
        """Train on one batch (shapes/dtypes of ``example``); returns the static loss tensor (no sync)."""
        self._check_batch(batch)
        with self._on_device(), torch.no_grad():
            for buf, x in zip(self.static_batch, batch):
                if x is not buf:
                    buf.copy_(x, non_blocking=True)
        if self._graph is not None:
            with self._on_device():
                self._graph.replay()
        else:
            loss, norm = self._eager_step()
            self._loss.copy_(loss)
            if norm is not None and self._grad_norm is not None:
                self._grad_norm.copy_(norm)
        return self._loss

    def set_lr(self, lr: float | Sequence[float]) -> None:
        """Set the learning rate of every param group (one value, or one per group), in place."""
        groups = self.optimizer.param_groups
        values = [float(lr)] * len(groups) if isinstance(lr, (int, float)) else [float(v) for v in lr]
        if len(values) != len(groups):
            raise ValueError(f"set_lr got {len(values)} values for {len(groups)} param groups")
        if len({id(g["lr"]) for g in groups}) < len(groups) and len(set(values)) > 1:
            raise ValueError("param groups share one LR tensor, so they cannot take different LRs "
                             "(make_adamw gives every group its own)")
        for g, v in zip(groups, values):
            g["lr"].fill_(v)

    # -- internals -------------------------------------------------------------------------------------
    def _on_device(self) -> contextlib.AbstractContextManager:
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _check_batch(self, batch: tuple[Tensor, ...]) -> None:
        if len(batch) != len(self.static_batch):
            raise ValueError(f"GraphedTrainStep was built for batches of {len(self.static_batch)} tensors, "
                             f"got {len(batch)}")
        for i, (x, buf) in enumerate(zip(batch, self.static_batch)):
            if not isinstance(x, Tensor):
                raise ValueError(f"batch[{i}] is a {type(x).__name__}, expected a Tensor")
            if x.shape != buf.shape:
                raise ValueError(f"batch[{i}] has shape {tuple(x.shape)} but the captured example had "
                                 f"{tuple(buf.shape)}: a CUDA graph replays fixed shapes (pad or drop a short "
                                 "batch, or build another GraphedTrainStep)")
            if x.dtype != buf.dtype:
                raise ValueError(f"batch[{i}] has dtype {x.dtype} but the captured example had {buf.dtype}")

    def _compute(self) -> tuple[Tensor, Tensor | None]:
        """Forward + backward + clip + optimizer step on the static batch (what gets captured)."""
        ctx = (torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=False)
               if self.autocast_dtype is not None else contextlib.nullcontext())
        with ctx:
            loss = self.loss_fn(self.model, *self.static_batch)
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else ""))
        loss.backward()
        norm = None
        if self.clip_norm is not None:
            norm = clip_grad_norm_(self.clip_params, self.clip_norm, error_if_nonfinite=False)
        self.optimizer.step()
        return loss.detach(), norm

    def _eager_step(self) -> tuple[Tensor, Tensor | None]:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)  # also params the optimizer does not own
        return self._compute()

    def _warm_up(self, n: int) -> None:
        snapshot = _Snapshot(self.model, self.optimizer, self.device)
        try:  # restored even if a warm-up step raises
            with warnings.catch_warnings():
                # torch warns once that a capturable optimizer steps outside a capture: that is the warm-up.
                warnings.filterwarnings("ignore", message=".*capturable=True.*")
                if self.use_graph:
                    loss, norm = warm_up(self._eager_step, n, self.device)
                else:
                    for _ in range(n):
                        loss, norm = self._eager_step()
        finally:
            snapshot.restore()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        if not self.use_graph:
            self._loss = torch.zeros_like(loss)
            self._grad_norm = None if norm is None else torch.zeros_like(norm)

    def _capture(self) -> None:
        self._graph, (self._loss, self._grad_norm) = capture(self._compute, self.device, "the training step")


def _check_optimizer(optimizer: torch.optim.Optimizer, device: torch.device, use_graph: bool) -> None:
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam in torch 2.11
        raise ValueError(f"GraphedTrainStep supports torch.optim.Adam / AdamW, got {type(optimizer).__name__} "
                         "(undoing the warm-up relies on Adam's all-zero fresh state)")
    for i, g in enumerate(optimizer.param_groups):
        lr = g["lr"]
        if not isinstance(lr, Tensor) or lr.numel() != 1:
            raise ValueError(f"param group {i} has lr={lr!r}; it must be a 1-element tensor so a schedule can "
                             "change it without re-capture (build the optimizer with make_adamw)")
        if use_graph:
            if not g.get("capturable", False):
                raise ValueError(f"param group {i} is not capturable: build the optimizer with capturable=True "
                                 "(and fused=True for speed), e.g. with make_adamw")
            if lr.device != device or lr.dtype != torch.float32:
                raise ValueError(f"param group {i}: the LR tensor must be float32 on {device} (the fused kernel "
                                 f"reads it on the device), got {lr.dtype} on {lr.device}")


class _Snapshot:
    """Model parameters/buffers, optimizer state and RNG states, restored IN PLACE (addresses kept)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        seen: set[int] = set()
        self.tensors: list[tuple[Tensor, Tensor]] = []
        owned = [p for g in optimizer.param_groups for p in g["params"]]
        for t in [*model.parameters(), *model.buffers(), *owned]:
            if id(t) not in seen:
                seen.add(id(t))
                self.tensors.append((t, t.detach().clone()))
        self.optimizer = optimizer
        self.state = {p: {k: v.clone() if isinstance(v, Tensor) else v for k, v in s.items()}
                      for p, s in optimizer.state.items()}
        self.device = device
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @torch.no_grad()
    def restore(self) -> None:
        for t, saved in self.tensors:
            t.copy_(saved)
        for p, state in self.optimizer.state.items():
            before = self.state.get(p, {})
            for k, v in state.items():
                if isinstance(v, Tensor):
                    if k in before:
                        v.copy_(before[k])
                    else:
                        v.zero_()  # created by the warm-up: Adam's fresh state is zeros
                elif k in before:
                    state[k] = before[k]
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)


__all__ = ["GraphedTrainStep", "LossFn", "capture", "make_adamw", "warm_up"]
