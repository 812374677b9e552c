"""The training loop: the one module that owns Accelerate.

    trainer = Trainer(model, loss_fn, train_data, TrainConfig(output_dir="runs/vit", steps=10_000))
    metrics = trainer.fit()      # resumes from output_dir/checkpoints, exports output_dir/final

The same script runs as ``python recipes/x.py`` and ``accelerate launch --num_processes N recipes/x.py``
(or ``torchrun``). Build the model after ``seed_everything(seed)`` so every run starts from the same init;
under DDP rank 0's parameters are broadcast anyway.

What it does, and the traps it avoids (docs/research/pitfalls.md):

* Data. ``train_data`` is any re-iterable of batches. Objects that expose ``state_dict``/``set_epoch``
  (omni's ShardLoader) are taken as already split per rank and are NOT handed to ``accelerator.prepare``
  (pitfalls 1-3); a plain ``torch.utils.data.DataLoader`` over a map-style dataset is prepared
  (sharded, with a sampler seeded by ``seed`` + epoch). ``None`` batches are skipped: a rank fetches
  the next batch, so every rank still runs exactly ``grad_accum`` backward passes per step.
* Steps. One *step* is one optimizer update of ``grad_accum`` micro-batches per rank. The loss of each
  micro-batch is divided by ``grad_accum`` and DDP averages over ranks, so the gradient is the mean of
  the per-micro-batch mean losses (== the global mean when micro-batches are the same size). The LR
  scheduler steps exactly once per optimizer step (Accelerate's default would step it ``num_processes``
  times per step: we prepare it with ``step_scheduler_with_optimizer=False``).
* Non-finite loss. Every rank's per-micro-batch loss flags are summed across ranks before the
  optimizer step; if any is NaN/inf, every rank raises ``NonFiniteLossError`` naming the step, the
  rank, the batch position and the sample keys. Parameters, optimizer and checkpoints stay untouched.
* One run per output directory. The main process holds ``DirectoryLock(output_dir)`` from the
  constructor to ``close`` (``fit`` closes at its end and on errors): a second run on the same directory
  gets ``LockedError`` naming the live holder (pid, host, command). A killed run's lock is free (flock). At
  the start of ``fit`` the lock holder deletes the temp dirs killed runs left (checkpoint ``.tmp-*`` /
  ``.trash-*``, export ``.final.tmp-*`` / ``.final.old-*``): no live run can own them.
* Checkpoints. ``output_dir/checkpoints/step-000100/`` is written as ``.tmp-step-000100/`` (Accelerate
  ``save_state``: model, optimizer, scheduler, grad scaler, per-rank RNG; plus our per-rank data position,
  ``trainer_state.json`` with the run's config, ``checksums.json`` with every file's sha256, and a
  ``COMPLETE`` marker written last, everything fsynced) and renamed into place by the main process.
  A crash at any moment leaves the previous checkpoint intact; resume picks the newest directory with the
  marker and ignores temp dirs. Old checkpoints are renamed away before deletion (and only once the new one
  is complete), so a half-deleted one never looks like a checkpoint. A full disk (ENOSPC) raises
  ``DiskFullError`` naming the checkpoint; its partial directory is removed, the previous one is intact.
* Resume (``TrainConfig.resume``). "auto": resume the newest intact checkpoint when its recorded config
  (TrainConfig + ``hparams`` + ``export_config``, flattened) matches this run's, else ``ResumeMismatchError``
  listing ``key: old -> new``; "force": resume even so; "never": ``RunExistsError`` if the directory holds
  checkpoints or an export. Keys in ``RESUME_IGNORED`` may differ (where the run lives and how it is shown,
  logged, evaluated, checkpointed and executed: none changes what a step computes). A checkpoint whose
  files differ from their checksums (or are missing, truncated, unreadable) is reported, renamed to
  ``corrupt-step-*`` and the previous one is used; if none is intact, ``IntegrityError`` lists why rather
  than training over them from scratch. A checkpoint whose tensors do not fit the model (another
  architecture, even under "force") is refused naming the parameters, both shapes and the checkpoint. A
  run that already finished (checkpoint at ``steps``, intact export) is reported, not trained or exported
  again; ``fit`` returns the metrics it recorded in ``output_dir/train_results.json``.
* Exact resume. Model, optimizer, scheduler, RNG (python, numpy, torch, CUDA, per rank) and the data
  position (the loader's own ``state_dict`` when it has one, else the batch count in the epoch, skipped
  on resume) are restored; training N steps, stopping and resuming to 2N gives the same parameters as
  2N steps straight (bitwise on CPU; on CUDA up to non-deterministic kernels, ~1e-9 in our check).
  Calls into the training data run on their own checkpointed RNG stream and evaluation under a
  saved-and-restored one, so neither shifts the training stream (dropout). Resume needs the same number
  of processes (per-rank data positions); ``compile`` may change (checkpoints hold plain names).
  Checkpoints assume a file system every rank sees (as Accelerate's ``save_state`` does).
* FSDP2. ``accelerate launch --config_file recipes/accelerate_fsdp2.yaml`` (or an ``fsdp_plugin`` with
  ``fsdp_version=2`` in ``accelerator_kwargs``) shards the model with ``fully_shard``; the loop is the same
  (``no_sync`` for accumulation, the gradient norm of the sharded gradients), checkpoints are sharded
  (torch.distributed.checkpoint) and resume exactly, the export gathers the full weights. Accelerate only
  does FSDP on GPUs; on CPU ranks (gloo) the Trainer switches it on itself (``_fsdp_on_cpu``), and a
  multi-process launch on a machine without an accelerator runs on the CPU (``use_cpu``), so 2 CPU
  processes reproduce 1 process on the same global batch (tests/test_fsdp2.py).
* Logging. TensorBoard through Accelerate trackers (``output_dir/logs/<run_name>``) with a flattened
  config (nested dicts are rejected by TensorBoard's hparams, pitfall 7); tqdm on the main process when
  stderr is a terminal, else (log files, ``progress=False``) one plain line per ``log_every`` steps.
* Export. At the end the main process writes ``output_dir/final/`` (model.safetensors + config.json [+
  tokenizers]) with ``omni.export.save_pretrained``; ``omni.export.load_pretrained`` rebuilds it for
  inference with no training code.

Weight decay rule (``default_param_groups``): decay every parameter with >= 2 dims (Linear / conv
kernels) except embedding tables (``nn.Embedding`` weights: token, learned-position, timestep tables, and
any LM head tied to them); never decay 1-D parameters (biases, norm scales, type embeddings, CLS tokens).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import math
import numbers
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch
from torch import Tensor, nn

from omni import export as _export
from omni.export import DiskFullError, IntegrityError
from omni.lock import DirectoryLock, LockedError

CHECKPOINT_DIR = _export.RUN_CHECKPOINT_DIR
EXPORT_DIR = _export.RUN_EXPORT_DIR
COMPLETE_MARKER = _export.CHECKPOINT_MARKER
TRAINER_STATE = "trainer_state.json"
RESULTS_NAME = "train_results.json"  # the metrics fit returned, for a re-run of a finished run
_STEP_DIR = re.compile(r"^step-(\d+)$")
RESUME_MODES = ("auto", "force", "never")
# Config keys (the last part of a flattened key, in TrainConfig and in the recipe's hparams, which has its
# own names for some: out, workers, *_every_epochs) that may differ when a run is resumed: where the run
# lives, how it is shown and logged, how often it evaluates and checkpoints, how it executes. None changes
# what a step computes (evaluation runs under saved-and-restored RNG streams, checkpoints only read state,
# compile / cuda_graph / loader workers compute the same steps), so the resumed run still ends where the
# uninterrupted one would. max_corrupt_fraction only decides when corrupt data stops the run (raising it is
# how a run stopped that way continues). Everything else (steps, lr, data, seed, model, eval settings) counts.
RESUME_IGNORED = frozenset({
    "output_dir", "out", "resume", "progress", "report_to", "run_name", "log_every",
    "eval_every", "eval_every_epochs", "checkpoint_every", "checkpoint_every_epochs", "keep_checkpoints",
    "export", "compile", "cuda_graph", "find_unused_parameters", "workers", "num_workers", "max_corrupt_fraction",
})


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM stopped ``fit`` after a whole step, whose checkpoint was saved: running the
    same command again resumes there. ``signum`` is the signal (exit status 128 + signum, as a shell reports)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


class _StopOnSignal:
    """While entered, the first SIGINT or SIGTERM only records itself (``signum``), so the loop can finish its
    step, checkpoint and stop; a second one acts as it would have (KeyboardInterrupt, termination). Handlers
    can only be installed from the main thread: elsewhere this records nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._record) for s in self.SIGNALS}
        return self

    def _record(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
            # os.write, not print: the handler may run while the main thread is inside a write to stderr
            # (tqdm), and a buffered stream refuses that reentrant call
            os.write(2, f"\nomni.train: {signal.Signals(signum).name} received: stopping after this step with a "
                        "checkpoint (send it again to stop at once)\n".encode())
            return
        self.__exit__()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        os.kill(os.getpid(), signum)  # the restored handler (by default: terminate)

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


class NonFiniteLossError(RuntimeError):
    """Loss (or gradient norm) became NaN/inf; raised on every rank before the optimizer step."""


class ResumeMismatchError(ValueError):
    """The output directory holds a run this one cannot continue: another config (resume="auto"), or
    tensors of other shapes (another architecture, whatever ``resume`` says)."""


class RunExistsError(ValueError):
    """resume="never" and the output directory already holds checkpoints or an export."""


@dataclass
class TrainConfig:
    """Every field is a flat scalar so the config goes to TensorBoard's hparams as it is."""

    output_dir: str = "runs/omni"
    steps: int = 1000  # optimizer steps
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.0  # cosine ends at lr * min_lr_ratio
    warmup_steps: int = 0  # linear warmup from lr/warmup_steps to lr
    weight_decay: float = 0.05  # on matrices only (module docstring)
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_accum: int = 1  # micro-batches per optimizer step (per rank)
    clip_norm: float = 1.0  # <= 0 disables clipping (the norm is still logged)
    mixed_precision: str = "auto"  # auto | no | bf16 | fp16; auto = the launcher's bf16/fp16 if it asks for
    # one, else bf16 on a CUDA GPU that has it, else no (CPU autocast is slow; force "bf16" if wanted)
    compile: bool | str = False  # torch.compile the model (inductor); a string names the inductor mode,
    # e.g. "max-autotune-no-cudagraphs" (autotuned GEMMs with fused epilogues: longer compile, faster steps)
    # Replay the whole step (forward, backward, clipping, AdamW) as ONE captured CUDA graph
    # (omni.cuda_graphs.GraphedTrainStep): the lever for small, launch-bound models on one GPU. Needs every
    # batch of the first batch's structure and shapes, grad_accum 1, one process and no fp16; the loss sees
    # the batch's tensors only (other leaves, e.g. sample keys, read as None). On CPU the same step runs
    # eagerly (identical results), so it is testable anywhere.
    cuda_graph: bool = False
    find_unused_parameters: bool = False  # DDP: set when some batches leave parameters unused
    eval_every: int = 0  # steps; 0 = only at the end (when eval data or a model_metrics_fn is given)
    checkpoint_every: int = 0  # steps; 0 = no checkpoints
    keep_checkpoints: int = 2  # newest complete checkpoints kept; <= 0 keeps all
    log_every: int = 10
    seed: int = 0  # torch/numpy/python seed (+ rank), and the prepared DataLoader's shuffle seed
    progress: bool = True  # tqdm bar on the main process; False: one printed line per log_every steps
    report_to: str = "tensorboard"  # any Accelerate tracker name, or "none"
    run_name: str = "omni"  # tracker run name: logs go to output_dir/logs/<run_name>
    # What to do with a run already in output_dir (module docstring): "auto" resumes its newest intact
    # checkpoint if the config matches and refuses otherwise, "force" resumes even if the config differs,
    # "never" refuses if output_dir holds checkpoints or an export (nothing is ever overwritten).
    resume: str = "auto"
    export: bool = True  # write output_dir/final at the end

    def __post_init__(self) -> None:
        for name, minimum in (("steps", 1), ("warmup_steps", 0), ("grad_accum", 1), ("eval_every", 0),
                              ("checkpoint_every", 0), ("keep_checkpoints", None), ("log_every", 0), ("seed", 0)):
            setattr(self, name, _integer(name, getattr(self, name), minimum))
        self.lr = _real("lr", self.lr, above=0.0)
        self.min_lr_ratio = _real("min_lr_ratio", self.min_lr_ratio, at_least=0.0, at_most=1.0)
        self.weight_decay = _real("weight_decay", self.weight_decay, at_least=0.0)
        self.beta1 = _real("beta1", self.beta1, at_least=0.0, below=1.0)
        self.beta2 = _real("beta2", self.beta2, at_least=0.0, below=1.0)
        self.eps = _real("eps", self.eps, above=0.0)
        self.clip_norm = _real("clip_norm", self.clip_norm)  # <= 0 disables clipping; NaN/inf are mistakes
        if self.resume not in RESUME_MODES:
            raise ValueError(f"resume must be one of {', '.join(map(repr, RESUME_MODES))}, got {self.resume!r}")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be auto, no, bf16 or fp16, got {self.mixed_precision!r}")
        if self.cuda_graph and (self.grad_accum != 1 or self.mixed_precision == "fp16"):
            raise ValueError("cuda_graph needs grad_accum 1 and no fp16 (the loss scaler skips steps on the host), "
                             f"got grad_accum {self.grad_accum}, mixed_precision {self.mixed_precision!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _integer(name: str, value: Any, minimum: int | None) -> int:
    """A TrainConfig integer field (an integral float, e.g. ``--set steps=1e4``, is taken as an int)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"TrainConfig.{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"TrainConfig.{name} must be >= {minimum}, got {value}")
    return int(value)


def _real(name: str, value: Any, *, above: float | None = None, at_least: float | None = None,
          below: float | None = None, at_most: float | None = None) -> float:
    """A TrainConfig float field: finite and inside the given bounds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"TrainConfig.{name} must be a finite number, got {value!r}")
    for bound, ok, word in ((above, lambda b: value > b, ">"), (at_least, lambda b: value >= b, ">="),
                            (below, lambda b: value < b, "<"), (at_most, lambda b: value <= b, "<=")):
        if bound is not None and not ok(bound):
            raise ValueError(f"TrainConfig.{name} must be {word} {bound:g}, got {value!r}")
    return float(value)


# ----------------------------------------------------------------------------------------------------
# Small pure helpers (tested on their own)


def lr_multiplier(i: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """LR factor for the optimizer step with 0-based index ``i``: linear warmup ((i+1)/warmup), then a
    cosine from 1 down towards ``min_ratio`` that reaches it one step after the last step (no step is
    wasted at lr 0 on either end)."""
    if i < warmup:
        return (i + 1) / warmup
    decay_steps = max(1, total - warmup)
    progress = min(1.0, (i - warmup) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def default_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay >= 2-D weights except embedding tables; no decay for everything else."""
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
                     for p in m.parameters(recurse=False)}
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # named_parameters dedups tied parameters
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and id(p) not in embedding_ids else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, int | float | str | bool]:
    """Nested config -> flat {"a.b": scalar} that TensorBoard's hparams accepts (pitfall 7).
    Lists/tuples/None/other objects become strings."""
    flat: dict[str, int | float | str | bool] = {}
    for k, v in config.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            flat.update(flatten_config(v, prefix=f"{name}."))
        elif isinstance(v, (bool, int, float, str)):
            flat[name] = v
        elif isinstance(v, Tensor) and v.numel() == 1:
            flat[name] = v.item()
        else:
            flat[name] = str(v)
    return flat


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def run_config(train: TrainConfig, hparams: Mapping[str, Any], export_config: Mapping[str, Any]) -> dict[str, Any]:
    """What defines a run, flattened (``train.lr``, ``hparams.model.widths``, ``export.trunk.d_model``): saved
    in every checkpoint and compared on resume. Object addresses in stringified values are dropped: they
    differ from process to process."""
    flat = flatten_config({"train": train.to_dict(), "hparams": hparams, "export": export_config})
    return {k: _ADDRESS.sub("", v) if isinstance(v, str) else v for k, v in flat.items()}


def config_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``key: old -> new`` for every flattened key that differs, except the ``RESUME_IGNORED`` ones (which
    never apply to the export config: that is the model itself)."""
    lines = []
    for key in sorted(set(old) | set(new)):
        if not key.startswith("export.") and key.rsplit(".", 1)[-1] in RESUME_IGNORED:
            continue
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if not (a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))):
            lines.append(f"{key}: {a!r} -> {b!r}")
    return lines


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()


def unwrap(model: nn.Module) -> nn.Module:
    """Strip DDP (``.module``) and torch.compile (``._orig_mod``) wrappers; for loss functions that
    need a submodule (``unwrap(model).heads["cls"]``) of the model the Trainer hands them."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def use_cpu() -> bool:
    """Whether this process trains on the CPU: ACCELERATE_USE_CPU is set, or a multi-process launch
    (WORLD_SIZE > 1) runs on a machine without an accelerator. Accelerate alone turns the latter into N
    unrelated single-process runs (DistributedType.NO, num_processes 1 on every rank, all writing the same
    output_dir): that is what ``accelerate launch --config_file recipes/accelerate_fsdp2.yaml`` (use_cpu:
    false) does on a CPU-only machine."""
    from accelerate.utils import parse_flag_from_env

    if parse_flag_from_env("ACCELERATE_USE_CPU"):
        return True
    accel = getattr(torch, "accelerator", None)
    has_accelerator = accel.is_available() if accel is not None else torch.cuda.is_available()
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and not has_accelerator


def process_state() -> Any:
    """Accelerate's PartialState for recipes that need the rank before building the Trainer (data
    splitting, building datasets once). It honours ACCELERATE_USE_CPU as Accelerator does (and
    ``use_cpu``): a bare PartialState() ignores it, and since the state is a process-wide singleton, a
    later Accelerator would then see a single-process state on every CPU rank (torchrun / accelerate
    launch --cpu)."""
    from accelerate import PartialState

    return PartialState(cpu=use_cpu())


def _fsdp_on_cpu(accelerator: Any, plugin: Any = None) -> None:
    """Make a multi-process CPU (gloo) run use the FSDP it was asked for (ACCELERATE_USE_FSDP, from
    ``accelerate launch --config_file recipes/accelerate_fsdp2.yaml`` or an ``fsdp_plugin``).

    Accelerate (1.15) applies FSDP only on GPUs and other accelerators: AcceleratorState.__init__ switches
    to DistributedType.FSDP only inside ``elif self.distributed_type in [MULTI_GPU, MULTI_MLU, ...,
    MULTI_NEURON]`` (accelerate/state.py), so under ACCELERATE_USE_CPU the run silently becomes plain DDP
    (MULTI_CPU) and the plugin is dropped. torch's ``fully_shard`` works on CPU over gloo, and so does
    Accelerate's FSDP2 code (prepare, no_sync, clip_grad_norm_, get_state_dict, sharded save_state /
    load_state) once the state names FSDP: switch it here, before anything is prepared. Both shared
    states are set: every ``AcceleratorState()`` re-reads PartialState's distributed_type."""
    from accelerate import FullyShardedDataParallelPlugin, PartialState
    from accelerate.utils import DistributedType

    plugin = plugin if plugin is not None else FullyShardedDataParallelPlugin()  # from the FSDP_* env vars
    if plugin.fsdp_version != 2:
        raise ValueError("FSDP on CPU needs fsdp_version 2 (torch.distributed.fsdp.fully_shard); got "
                         f"fsdp_version {plugin.fsdp_version}")
    precision = accelerator.state.mixed_precision
    if precision == "fp16":
        raise ValueError("FSDP on CPU: use mixed precision bf16 or no (fp16 needs a GPU grad scaler)")
    if precision != "no":
        plugin.set_mixed_precision(precision)  # as AcceleratorState does for FSDP on a GPU
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices): call before building the model."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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


def list_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under output_dir/checkpoints, oldest first (temp/trash dirs ignored)."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and (d / COMPLETE_MARKER).is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(output_dir)
    return ckpts[-1][1] if ckpts else None


def _count_samples(batch: Any) -> int:
    if hasattr(batch, "num_documents"):
        return int(batch.num_documents)
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        if isinstance(v, Tensor) and v.dim() > 0:
            return int(v.shape[0])
    return 0


def _count_tokens(batch: Any) -> Tensor | None:
    document = getattr(batch, "document", None)  # PackedBatch: real (non-padding) tokens
    return (document >= 0).sum() if isinstance(document, Tensor) else None


def _remove_dir(path: Path) -> None:
    """Rename away, then delete: an interrupted delete never leaves a directory that looks valid."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _dirs_named(root: Path, prefixes: tuple[str, ...]) -> list[Path]:
    return [d for d in root.iterdir() if d.is_dir() and d.name.startswith(prefixes)] if root.is_dir() else []


def _read_checkpoint(ckpt: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]] | None]:
    """A checkpoint's trainer state and stored model tensor shapes (None: no model.safetensors, e.g. FSDP
    shards), once its files match their checksums; IntegrityError naming what is wrong otherwise.
    Checkpoints written before checksums are only read."""
    from safetensors import SafetensorError, safe_open

    _export.verify_checksums(ckpt)
    path = ckpt / TRAINER_STATE
    try:
        meta = json.loads(path.read_text())
        path = ckpt / "model.safetensors"
        if not path.is_file():
            return meta, None
        with safe_open(str(path), framework="pt") as f:
            return meta, {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (OSError, ValueError, SafetensorError) as exc:
        raise IntegrityError(f"{path} is unreadable ({exc})") from exc


def _set_aside(ckpt: Path) -> Path:
    """Rename a corrupt checkpoint out of the listing: kept for inspection, never resumed or rotated away."""
    target, n = ckpt.with_name(f"corrupt-{ckpt.name}"), 1
    while target.exists():
        target, n = ckpt.with_name(f"corrupt-{ckpt.name}-{n}"), n + 1
    os.replace(ckpt, target)
    return target


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


@contextlib.contextmanager
def _preserved_rng() -> Iterator[None]:
    """Run a block (evaluation) without changing any RNG stream the training uses."""
    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(py)
    np.random.set_state(npy)


# ----------------------------------------------------------------------------------------------------
# The data stream: epochs, position, its own RNG, resume


class _DataRNG:
    """A private python/numpy/torch-CPU RNG stream swapped in around every call into the training data.

    Data loading that draws from the global RNG (a torch DataLoader draws its worker base seed when an
    iterator is created, lazily, at the first batch; collate functions may augment) would otherwise
    shift the training stream (dropout) by a different amount in a resumed run than in a straight one.
    With the swap the training stream never sees data draws, and the data stream is checkpointed too."""

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

    def state_dict(self) -> dict[str, Any]:  # JSON-serialisable
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


class _DataStream:
    """Endless batches from a re-iterable, tracking (epoch, batches yielded in the epoch) per rank."""

    def __init__(self, data: Any, prepared: bool, accelerator: Any, seed: int) -> None:
        self.data, self.prepared, self.accelerator = data, prepared, accelerator
        self.rng = _DataRNG(seed)
        self.stateful = not prepared and hasattr(data, "state_dict") and hasattr(data, "load_state_dict")
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

    def next(self) -> tuple[Any, int, int]:
        """(batch, epoch, index in epoch) of the next non-None batch, rolling over epochs."""
        assert self._it is not None, "start() first"
        with self.rng.active():
            return self._next()

    def _next(self) -> tuple[Any, int, int]:
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
# The trainer


LossOutput = Tensor | tuple[Tensor, Mapping[str, float | Tensor]]


class Trainer:
    """Train ``model`` with Accelerate; see the module docstring for the guarantees.

    loss_fn(model, batch) -> loss | (loss, {name: float | 0-d Tensor})
        ``model`` is the prepared (maybe DDP/compiled) module: call it, and use ``unwrap(model)`` for
        submodules. Runs under the mixed-precision autocast. ``None``: ``model(batch)`` returns that.
        The extra metrics are averaged over ranks and steps and logged as ``train/<name>``; their
        names must be the same on every step and rank.
    eval_fn(model, batch) -> {name: Tensor}
        per-sample values (dim 0 = samples; more dims are averaged too) or 0-d per-batch values;
        the metric is the mean over the whole eval set and all ranks (``gather_for_metrics`` drops
        the padding samples of a prepared DataLoader). ``None``: the mean of loss_fn's loss.
    model_metrics_fn(model, step) -> {name: float | 0-d Tensor}
        metrics of the whole model rather than of an eval batch (test-set accuracy by its own loop,
        greedy-decoding error rates, environment rollouts, ...). ``evaluate`` calls it once per pass,
        after the eval batches (or alone when there is no eval data: an evaluation then still runs at
        ``eval_every`` and at the end), under the same conditions as ``eval_fn``: model in eval mode,
        ``torch.no_grad``, the mixed-precision autocast, and every RNG stream (python, numpy, torch,
        CUDA) saved before and restored after, so training continues exactly as without evaluation.
        ``step`` is the number of optimizer steps taken (``self.step``); an empty mapping adds nothing
        to this evaluation (e.g. "only at the end": measure when ``step >= config.steps``). The values join the eval metrics
        as ``eval/<name>`` (returned by ``evaluate``/``fit``, logged to the trackers, printed); a name
        may not also come from ``eval_fn``. Contract across processes: it is called on EVERY rank with
        the prepared model (as ``eval_fn``), and each name's value is the mean over the ranks that
        return it (exact when every rank measures the same thing, as the usual seeded held-out loop
        does; a hook that splits the work over ranks combines it itself, with collectives, since all
        ranks are in it). Its forward passes must not desynchronise the ranks: under DDP run them on
        ``unwrap(model)`` (no collectives) rather than through the DDP wrapper, whose forward may
        communicate; under FSDP every forward is collective (parameters are all-gathered per unit, and
        submodules outside the root forward see only their shards), so a data-dependent loop (decoding,
        rollouts) cannot run there: pass no hook and measure the exported model instead
        (recipes/multimodal.py does so, once at the end, on the main process).
    param_groups(model) -> AdamW param groups; default ``default_param_groups``.
    hparams: extra (nested) config logged to TensorBoard next to TrainConfig (flattened).
    export_config / export_tokenizers / export_module: what ``omni.export.save_pretrained`` writes to
        output_dir/final (``export_module(model)`` picks the submodule to export, default: all of it).
    prepare_data: hand train/eval DataLoaders to ``accelerator.prepare`` (None: only plain DataLoaders
        without ``state_dict``/``set_epoch``; rank-local loaders must not be re-sharded).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], LossOutput] | None,
        train_data: Iterable[Any],
        config: TrainConfig,
        *,
        eval_data: Iterable[Any] | None = None,
        eval_fn: Callable[[nn.Module, Any], Mapping[str, Tensor]] | None = None,
        model_metrics_fn: Callable[[nn.Module, int], Mapping[str, float | Tensor]] | None = None,
        param_groups: Callable[[nn.Module], list[dict[str, Any]]] | None = None,
        hparams: Mapping[str, Any] | None = None,
        export_config: Mapping[str, Any] | None = None,
        export_tokenizers: Mapping[str, Any] | None = None,
        export_module: Callable[[nn.Module], nn.Module] | None = None,
        prepare_data: bool | None = None,
        accelerator_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        from accelerate import Accelerator, DataLoaderConfiguration
        from accelerate.utils import DistributedDataParallelKwargs, ProjectConfiguration, set_seed

        self.config = config
        self.output_dir = Path(config.output_dir)
        self.loss_fn, self.eval_fn, self.model_metrics_fn = loss_fn, eval_fn, model_metrics_fn
        self.hparams = dict(hparams or {})
        self.export_config = dict(export_config or {})
        self.export_tokenizers = export_tokenizers
        self.export_module = export_module

        kwargs: dict[str, Any] = dict(accelerator_kwargs or {})
        kwargs.setdefault("mixed_precision", self._mixed_precision(config.mixed_precision))
        kwargs.setdefault("project_config", ProjectConfiguration(
            project_dir=str(self.output_dir), logging_dir=str(self.output_dir / "logs")))
        kwargs.setdefault("dataloader_config", DataLoaderConfiguration(use_seedable_sampler=True,
                                                                       data_seed=config.seed))
        if config.report_to and config.report_to != "none":
            kwargs.setdefault("log_with", self._tracker(config.report_to))
        handlers = list(kwargs.pop("kwargs_handlers", []))
        if config.find_unused_parameters:
            handlers.append(DistributedDataParallelKwargs(find_unused_parameters=True))
        if config.cuda_graph:  # the CUDA-graphs notes' rule: no autocast weight-cast cache under capture
            from accelerate.utils import AutocastKwargs

            handlers.append(AutocastKwargs(cache_enabled=False))
        # Scheduler stepped once per optimizer step, by us (Accelerate's default steps it
        # num_processes times per step); accumulation is ours too (grad_accum micro-batches per step).
        if use_cpu():
            kwargs.setdefault("cpu", True)
        self.accelerator = acc = Accelerator(step_scheduler_with_optimizer=False, gradient_accumulation_steps=1,
                                             kwargs_handlers=handlers, **kwargs)
        from accelerate.utils import DistributedType, parse_flag_from_env

        if parse_flag_from_env("ACCELERATE_USE_FSDP") and acc.distributed_type == DistributedType.MULTI_CPU:
            _fsdp_on_cpu(acc, kwargs.get("fsdp_plugin"))
        set_seed(config.seed, device_specific=True)  # per-rank streams (dropout differs across ranks)
        if config.cuda_graph and acc.num_processes > 1:
            raise ValueError(f"cuda_graph trains on one process; this run has {acc.num_processes}")

        groups = param_groups(model) if param_groups is not None else default_param_groups(model, config.weight_decay)
        fused = acc.device.type == "cuda"
        optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                                      weight_decay=config.weight_decay, fused=fused or None)
        warmup, total, min_ratio = config.warmup_steps, config.steps, config.min_lr_ratio

        def schedule(i: int) -> float:  # a plain function: LambdaLR does not pickle it, so the schedule
            return lr_multiplier(i, warmup=warmup, total=total, min_ratio=min_ratio)  # follows the current config

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        self.model, self.optimizer, self.scheduler = acc.prepare(model, optimizer, scheduler)
        if config.compile:
            # Compiled here rather than by Accelerate's dynamo plugin: that one lives in the process-wide
            # AcceleratorState (a later Trainer could not change it), and checkpoints keep the plain
            # parameter names (Accelerate saves the module it prepared), so compile can be toggled on resume.
            self.model = torch.compile(self.model) if config.compile is True else \
                torch.compile(self.model, mode=str(config.compile))

        self._prepare_data = prepare_data
        self._train_prepared = self._should_prepare(train_data)
        self.train_data = acc.prepare_data_loader(train_data) if self._train_prepared else train_data
        self._eval_prepared = eval_data is not None and self._should_prepare(eval_data)
        self.eval_data = acc.prepare_data_loader(eval_data) if self._eval_prepared else eval_data
        self._stream = _DataStream(self.train_data, self._train_prepared, acc,
                                   seed=1_000_003 * (config.seed + 1) + acc.process_index)
        self.step = 0
        self._metric_names: list[str] | None = None
        self._graph: Any = None  # cuda_graph: the GraphedTrainStep, built on the first step (after resume)
        self._graph_layout: tuple[Any, list[bool]] | None = None  # the captured batch's pytree spec, tensor leaves
        self._graph_metrics: dict[str, Tensor] = {}
        self._config_changed = False  # resumed under resume="force" from a checkpoint of another config
        # Last, so nothing after it can fail and leave the lock taken: the main process owns output_dir.
        self._lock = DirectoryLock(self.output_dir, "output directory")
        self._on_main(self._take_lock)

    # -- setup helpers -------------------------------------------------------------------------------
    def _should_prepare(self, data: Any) -> bool:
        """Plain DataLoaders are sharded by Accelerate; loaders with state_dict/set_epoch are rank-local."""
        if self._prepare_data is not None:
            return self._prepare_data
        return isinstance(data, torch.utils.data.DataLoader) and not (
            hasattr(data, "state_dict") or hasattr(data, "set_epoch"))

    @staticmethod
    def _mixed_precision(requested: str) -> str | None:
        if requested != "auto":
            return requested
        # `accelerate launch` always exports its --mixed_precision, "no" by default: honour it only when
        # it asks for reduced precision, so a default launch still gets bf16 on the GPU.
        if os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower() not in ("", "no"):
            return None
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"

    @staticmethod
    def _tracker(name: str) -> str | None:
        if name == "tensorboard":
            from accelerate.utils import is_tensorboard_available

            if not is_tensorboard_available():
                import warnings

                warnings.warn("tensorboard is not installed: training metrics are not logged "
                              "(pip install tensorboard, or set report_to='none')")
                return None
        return name

    @property
    def checkpoint_root(self) -> Path:
        return self.output_dir / CHECKPOINT_DIR

    @property
    def export_dir(self) -> Path:
        return self.output_dir / EXPORT_DIR

    def _state_payload(self) -> dict[str, Any]:
        return {"step": self.step, "world_size": self.accelerator.num_processes,
                "compile": self.config.compile, "train_prepared": self._train_prepared,
                "config": self.config.to_dict(), "run_config": self.run_config(), "time": time.time()}

    def run_config(self) -> dict[str, Any]:
        """This run's flattened config (``run_config``): recorded in checkpoints, compared on resume."""
        return run_config(self.config, self.hparams, self.export_config)

    def _take_lock(self) -> None:  # returns nothing: the lock (an open fd) must not travel to other ranks
        self._lock.acquire()

    def _on_main(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the main process only, its result or exception shared with every rank: one decision,
        and a failure raised on every rank instead of leaving the others waiting in a collective."""
        acc = self.accelerator
        outcome: list[Any] = [None]
        if acc.is_main_process:
            try:
                outcome[0] = (True, fn())
            except Exception as exc:
                outcome[0] = (False, exc)
        if acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(outcome)
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    # -- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Write output_dir/checkpoints/step-XXXXXX atomically (module docstring). Collective."""
        acc = self.accelerator
        name = f"step-{self.step:06d}"
        final, tmp = self.checkpoint_root / name, self.checkpoint_root / f".tmp-{name}"
        try:
            self._write_checkpoint(tmp, final)
        except Exception as exc:
            if not _export.is_disk_full(exc):
                raise
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)  # useless now, and removing it frees the space it took
            previous = latest_checkpoint(self.output_dir)
            kept = f"the previous checkpoint {previous} is intact" if previous else "there is no earlier checkpoint"
            raise DiskFullError(errno.ENOSPC, f"disk full (no space left on device) while writing checkpoint {final} "
                                f"(at {getattr(exc, 'filename', None) or tmp}); the partial checkpoint was removed "
                                f"and {kept}: free space on {self.checkpoint_root} and run again (it resumes from "
                                "there)") from exc
        if acc.is_main_process and self.config.keep_checkpoints > 0:  # only now that the new one is complete
            for _, old in list_checkpoints(self.output_dir)[:-self.config.keep_checkpoints]:
                _remove_dir(old)
        acc.wait_for_everyone()
        return final

    def _write_checkpoint(self, tmp: Path, final: Path) -> None:
        acc = self.accelerator
        if acc.is_main_process:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))  # main: model/optimizer/scheduler; every rank: its RNG file
        _export.write_json(tmp / f"data_state_rank{acc.process_index}.json", self._stream.state())
        acc.wait_for_everyone()
        if acc.is_main_process:
            _export.write_json(tmp / TRAINER_STATE, self._state_payload())
            _export.write_checksums(tmp)  # every rank's files are in by now
            _export.fsync_tree(tmp)
            _export.write_json(tmp / COMPLETE_MARKER, {"step": self.step})
            _export.fsync_dir(tmp)
            if final.exists():  # a checkpoint of this step from an earlier (non-resumed) run
                _remove_dir(final)
            os.replace(tmp, final)
            _export.fsync_dir(self.checkpoint_root)

    def _clean_stale_dirs(self) -> None:
        """Delete what killed runs left: checkpoint ``.tmp-*`` / ``.trash-*`` and export ``.final.tmp-*`` /
        ``.final.old-*`` dirs. Only the holder of the run lock does, so no live run's temp dirs are touched."""
        if self.accelerator.is_main_process and self._lock.held:
            for d in [*_dirs_named(self.checkpoint_root, (".tmp-", ".trash-")),
                      *_dirs_named(self.output_dir, (f".{EXPORT_DIR}.tmp-", f".{EXPORT_DIR}.old-"))]:
                shutil.rmtree(d, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    # -- resume --------------------------------------------------------------------------------------
    def _resume(self) -> Path | None:
        """Restore everything from the checkpoint ``_choose_checkpoint`` picks (on the main process, for
        every rank); returns it (None: fresh start)."""
        acc = self.accelerator
        chosen, self._config_changed = self._on_main(self._choose_checkpoint)
        if chosen is None:
            self._stream.start(0, 0, None)
            return None
        ckpt = Path(chosen)
        meta = json.loads((ckpt / TRAINER_STATE).read_text())
        if meta["world_size"] != acc.num_processes:
            raise ValueError(f"{ckpt} was written by {meta['world_size']} processes; resume it with "
                             f"{meta['world_size']} (now {acc.num_processes}): per-rank data positions and RNG "
                             f"streams do not map onto another number of ranks")
        data_state = json.loads((ckpt / f"data_state_rank{acc.process_index}.json").read_text())
        self._stream.start(data_state["epoch"], data_state["position"], data_state["loader"], data_state["rng"])
        try:
            acc.load_state(str(ckpt))
        except Exception as exc:
            exc.add_note(f"omni.train: while restoring the checkpoint {ckpt}")
            raise
        self.step = int(meta["step"])
        return ckpt

    def _choose_checkpoint(self) -> tuple[str | None, bool]:
        """Main process: the checkpoint to resume (None: start fresh) and whether its config differs from
        this run's, as ``config.resume`` says (module docstring)."""
        found = list_checkpoints(self.output_dir)
        if self.config.resume == "never":
            held = [str(p) for _, p in found[-1:]] + ([str(self.export_dir)] if self.export_dir.exists() else [])
            if held:
                raise RunExistsError(f"{self.output_dir} already holds a run ({', '.join(held)}) and resume='never': "
                                     "use another output directory (--out), or resume='auto' to continue it")
            return None, False
        corrupt: list[tuple[Path, str]] = []
        for _, ckpt in reversed(found):
            try:
                meta, shapes = _read_checkpoint(ckpt)
            except IntegrityError as exc:
                corrupt.append((ckpt, str(exc)))
                continue
            changed = self._compare_config(ckpt, meta)
            self._check_shapes(ckpt, shapes)
            for bad, why in corrupt:
                warnings.warn(f"omni.train: {why}; resuming from the previous intact checkpoint {ckpt} instead "
                              f"({bad.name} is kept as {_set_aside(bad).name})", stacklevel=3)
            return str(ckpt), changed
        if corrupt:
            raise IntegrityError(f"no intact checkpoint to resume in {self.checkpoint_root}; not training over them "
                                 "from scratch:\n  " + "\n  ".join(why for _, why in corrupt) + "\nMove them away "
                                 "to start fresh, or use another output directory (--out).")
        if self.export_dir.exists():
            print(f"omni.train: {self.output_dir} holds an export but no checkpoint to resume: training from "
                  f"scratch, {self.export_dir} will be replaced at the end", flush=True)
        return None, False

    def _compare_config(self, ckpt: Path, meta: Mapping[str, Any]) -> bool:
        """Whether the checkpoint's recorded run config differs from this run's (ResumeMismatchError under
        resume="auto"). Checkpoints written before configs were recorded are taken as they are."""
        old = meta.get("run_config")
        differences = config_differences(old, self.run_config()) if isinstance(old, Mapping) else []
        if differences and self.config.resume == "auto":
            raise ResumeMismatchError(
                f"{self.output_dir} holds a run with another config (checkpoint {ckpt}):\n  " + "\n  ".join(differences)
                + "\nResuming would continue that run, not train this one. Pass resume='force' (recipes: --set "
                "resume=force) to resume it with this config anyway, or use another output directory (--out).")
        if differences:
            print(f"omni.train: resume='force': resuming {ckpt} although the config differs:\n  "
                  + "\n  ".join(differences), flush=True)
        return bool(differences)

    def _check_shapes(self, ckpt: Path, shapes: Mapping[str, tuple[int, ...]] | None) -> None:
        """ResumeMismatchError naming every tensor whose checkpoint shape is not the model's, before
        anything is loaded (whatever ``resume`` says: the weights cannot go into this model)."""
        if shapes is None:  # sharded (FSDP): load_state's own error, with the checkpoint's path added
            return
        model = {k: tuple(v.shape) for k, v in unwrap(self.model).state_dict().items()}
        wrong = [f"{k}: checkpoint {shapes[k]}, model {model[k]}" for k in sorted(shapes.keys() & model.keys())
                 if shapes[k] != model[k]]
        if wrong:
            raise ResumeMismatchError(f"the checkpoint {ckpt} does not fit this model (another architecture?); "
                                      "tensors of other shapes:\n  " + "\n  ".join(wrong)
                                      + "\nTrain this model in another output directory (--out).")

    def _finished(self) -> bool:
        """Main process, after a resume at ``steps`` with the same config: whether the export is in place too
        (or none is wanted). A damaged export is reported and written again."""
        if not self.config.export:
            return True
        if not (self.export_dir / _export.CONFIG_NAME).is_file():
            return False
        try:
            _export.verify_checksums(self.export_dir)
        except IntegrityError as exc:
            warnings.warn(f"omni.train: {exc}; exporting the final checkpoint again", stacklevel=3)
            return False
        return True

    def _report_finished(self, ckpt: Path) -> dict[str, float]:
        """What a re-run of a finished run returns: the metrics it recorded; nothing is trained or written."""
        if self.accelerator.is_main_process:
            exported = f" and its export {self.export_dir} is intact" if self.config.export else ""
            print(f"omni.train: {self.output_dir} already finished: {ckpt} is at step {self.step} of "
                  f"{self.config.steps}{exported}; nothing to do (use another output directory to train anew)",
                  flush=True)
        try:
            results = json.loads((self.output_dir / RESULTS_NAME).read_text())
        except (OSError, ValueError):  # finished before results were recorded
            results = {}
        return {**results, "step": self.step}

    # -- one optimizer step --------------------------------------------------------------------------
    def _loss(self, batch: Any) -> tuple[Tensor, dict[str, Tensor]]:
        with self.accelerator.autocast():
            out = self.loss_fn(self.model, batch) if self.loss_fn is not None else self.model(batch)
        loss, metrics = (out if isinstance(out, tuple) else (out, {}))
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(f"the loss must be a scalar Tensor, got {type(loss).__name__}"
                            f"{tuple(loss.shape) if isinstance(loss, Tensor) else ''}")
        dev = self.accelerator.device
        return loss.reshape(()), {k: torch.as_tensor(v, dtype=torch.float32, device=dev).detach().reshape(())
                                  for k, v in metrics.items()}

    def _train_step(self) -> dict[str, float]:
        if self.config.cuda_graph:
            return self._graph_train_step()
        acc, cfg = self.accelerator, self.config
        step = self.step + 1  # the step being computed (1-based: step-000003 holds the state after it)
        dev = acc.device
        where: list[tuple[int, int, list[str] | None]] = []
        flags, loss_sum, samples = [], torch.zeros((), device=dev), 0
        tokens = torch.zeros((), device=dev)
        metric_sums: dict[str, Tensor] = {}
        for micro in range(cfg.grad_accum):
            batch, epoch, index = self._stream.next()
            where.append((epoch, index, batch_keys(batch)))
            samples += _count_samples(batch)
            n_tok = _count_tokens(batch)
            if n_tok is not None:
                tokens = tokens + n_tok.to(dev)
            if not self._train_prepared:
                from accelerate.utils import send_to_device

                batch = send_to_device(batch, dev, non_blocking=True)
            sync = contextlib.nullcontext() if micro == cfg.grad_accum - 1 else acc.no_sync(self.model)
            with sync:
                loss, metrics = self._loss(batch)
                acc.backward(loss / cfg.grad_accum)
            flags.append((~torch.isfinite(loss.detach())).float())
            loss_sum = loss_sum + loss.detach().float()
            for k, v in metrics.items():
                metric_sums[k] = metric_sums.get(k, 0.0) + v
        if self._metric_names is None:
            self._metric_names = sorted(metric_sums)
        if sorted(metric_sums) != self._metric_names:
            raise ValueError(f"loss_fn metrics changed at step {step}: {sorted(metric_sums)} "
                             f"instead of {self._metric_names}")
        max_norm = cfg.clip_norm if cfg.clip_norm and cfg.clip_norm > 0 else float("inf")
        norm = acc.clip_grad_norm_(self.model.parameters(), max_norm)
        norm = norm if isinstance(norm, Tensor) else torch.tensor(float(norm))
        if hasattr(norm, "full_tensor"):  # FSDP2: a replicated DTensor, which torch.cat below refuses
            norm = norm.full_tensor()
        # One small all-reduce and one host sync per step: global loss/metrics for logging, and the
        # non-finite flags every rank must agree on before anyone steps the optimizer.
        packed = torch.stack([loss_sum, *[metric_sums[k] for k in self._metric_names], tokens,
                              torch.tensor(float(samples), device=dev), *flags])
        if acc.num_processes > 1:
            packed = acc.reduce(packed, reduction="sum")
        values = torch.cat([packed, norm.detach().float().reshape(1).to(dev)]).tolist()
        n_micro = cfg.grad_accum * acc.num_processes
        bad = values[-1 - cfg.grad_accum:-1]
        grad_norm = values[-1]
        if any(b > 0 for b in bad):
            self._raise_non_finite(step, "loss", [(m, *w) for m, w in enumerate(where) if flags[m].item() > 0])
        if not math.isfinite(grad_norm) and acc.mixed_precision != "fp16":  # fp16: the scaler skips it
            self._raise_non_finite(step, "gradient norm", [(m, *w) for m, w in enumerate(where)])
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        k = len(self._metric_names)
        out = {"loss": values[0] / n_micro, "lr": lr, "grad_norm": grad_norm,
               "tokens": values[1 + k], "samples": values[2 + k]}
        out.update({name: values[1 + i] / n_micro for i, name in enumerate(self._metric_names)})
        return out

    def _graph_train_step(self) -> dict[str, float]:
        """``_train_step`` with config.cuda_graph: one replay of the captured step, then the same logging
        values and non-finite checks (after the fact: the optimizer step is part of the graph)."""
        from torch.utils._pytree import tree_flatten

        acc, step = self.accelerator, self.step + 1
        batch, epoch, index = self._stream.next()
        where = [(epoch, index, batch_keys(batch))]
        samples, n_tok = _count_samples(batch), _count_tokens(batch)
        if not self._train_prepared:
            from accelerate.utils import send_to_device

            batch = send_to_device(batch, acc.device, non_blocking=True)
        leaves, spec = tree_flatten(batch)
        is_tensor = [isinstance(x, Tensor) for x in leaves]
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        if self._graph is None:
            self._build_graph(tensors, spec, is_tensor)
        elif (spec, is_tensor) != self._graph_layout:
            raise ValueError(f"cuda_graph: batch {index} of epoch {epoch} is structured differently from the "
                             f"captured first batch ({spec} vs {self._graph_layout[0]}); a CUDA graph replays one "
                             "fixed batch layout")
        lr = float(self.scheduler.get_last_lr()[0])
        try:
            loss = self._graph(*tensors)
        except ValueError as exc:  # a shape or dtype that differs from the captured batch
            raise ValueError(f"cuda_graph: batch {index} of epoch {epoch}: {exc}") from exc
        self.scheduler.step()
        names = self._metric_names or []
        tokens = n_tok.to(acc.device).float() if n_tok is not None else torch.zeros((), device=acc.device)
        values = torch.stack([loss.float(), *[self._graph_metrics[k] for k in names], tokens,
                              self._graph.grad_norm.float()]).tolist()
        if not math.isfinite(values[0]):
            self._raise_non_finite(step, "loss", [(0, *where[0])], step_taken=True)
        if not math.isfinite(values[-1]):
            self._raise_non_finite(step, "gradient norm", [(0, *where[0])], step_taken=True)
        out = {"loss": values[0], "lr": lr, "grad_norm": values[-1], "tokens": values[-2], "samples": samples}
        out.update({name: values[1 + i] for i, name in enumerate(names)})
        return out

    def _build_graph(self, tensors: list[Tensor], spec: Any, is_tensor: list[bool]) -> None:
        """Capture the step on the first batch (after any resume, so it reads the restored optimizer state).
        The optimizer becomes what capture needs: a tensor LR per group on the device (the scheduler fills
        it in place; float64 on CPU keeps results bit-identical to a float LR), fused + capturable on CUDA."""
        from torch.utils._pytree import tree_unflatten

        from omni.cuda_graphs import GraphedTrainStep

        acc, cfg = self.accelerator, self.config
        dev = acc.device
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
            loss, metrics = self._loss(batch)
            self._graph_metrics = metrics  # the captured call's outputs: every replay overwrites them
            return loss

        clip = cfg.clip_norm if cfg.clip_norm and cfg.clip_norm > 0 else float("inf")  # inf: norm logged only
        self._graph = GraphedTrainStep(self.model, loss_of_tensors, opt, tensors, clip_norm=clip)
        self._graph_layout = (spec, is_tensor)
        self._metric_names = sorted(self._graph_metrics)

    def _raise_non_finite(self, step: int, what: str, local: list[tuple], step_taken: bool = False) -> None:
        """Collective: every rank gathers every rank's culprits and raises the same error."""
        from accelerate.utils import gather_object

        acc = self.accelerator
        culprits = gather_object([(acc.process_index, *c) for c in local]) if acc.num_processes > 1 else \
            [(acc.process_index, *c) for c in local]
        def show(keys: list[str] | None) -> str:
            if keys is None:
                return "(batch has no keys)"
            return str(keys) if len(keys) <= 32 else f"{keys[:32]} ... ({len(keys)} keys)"

        lines = [f"  rank {r} micro-batch {m} (epoch {e}, batch {i} of the epoch): keys {show(keys)}"
                 for r, m, e, i, keys in culprits]
        last = latest_checkpoint(self.output_dir)
        taken = ("the optimizer step was already taken inside the CUDA graph (cuda_graph), so the weights in "
                 "memory are unusable" if step_taken else "the optimizer step was not taken")
        raise NonFiniteLossError(
            f"non-finite {what} at step {step}; {taken} and nothing was saved for this step (last complete "
            f"checkpoint: {last if last else 'none'}). Batches:\n" + "\n".join(lines))

    # -- evaluation ----------------------------------------------------------------------------------
    @property
    def evaluates(self) -> bool:
        """Whether ``fit`` evaluates: there is eval data or a ``model_metrics_fn``."""
        return self.eval_data is not None or self.model_metrics_fn is not None

    @torch.no_grad()
    def evaluate(self, data: Iterable[Any] | None = None, *, model_metrics: bool = True) -> dict[str, float]:
        """Mean of every eval metric over the whole eval set (``data``, default the Trainer's eval data)
        and all ranks, plus (``model_metrics``) the ``model_metrics_fn`` values, as {"eval/<name>": value}.
        Collective: call it on every rank."""
        acc = self.accelerator
        prepared = self._eval_prepared
        if data is not None:
            prepared = self._should_prepare(data)
            data = acc.prepare_data_loader(data) if prepared else data
        else:
            data = self.eval_data
        hook = self.model_metrics_fn if model_metrics else None
        if data is None and hook is None:
            return {}
        dev = acc.device
        sums: dict[str, Tensor] = {}  # rank-local partial sums (summed across ranks at the end)
        counts: dict[str, Tensor] = {}
        whole: dict[str, float] = {}  # this rank's model_metrics_fn values
        self.model.eval()
        try:
            with _preserved_rng():
                for batch in data if data is not None else ():
                    if batch is None:
                        continue
                    if not prepared:
                        from accelerate.utils import send_to_device

                        batch = send_to_device(batch, dev, non_blocking=True)
                    if self.eval_fn is not None:
                        with acc.autocast():
                            out = dict(self.eval_fn(self.model, batch))
                    else:
                        out = {"loss": self._loss(batch)[0]}
                    for name, v in out.items():
                        v = torch.as_tensor(v, device=dev).detach().float()
                        if prepared:
                            # gather_for_metrics drops the samples Accelerate duplicates to even out the
                            # last batch (per-sample values only; a 0-d per-batch value is gathered as is).
                            # Sums are global now; divide by the world size as the final reduce sums again.
                            g = acc.gather_for_metrics(v) if v.dim() > 0 else acc.gather(v.reshape(1))
                            s = g.sum() / acc.num_processes
                            c = torch.tensor(g.numel() / acc.num_processes, device=dev)
                        else:
                            s, c = v.sum(), torch.tensor(float(v.numel()), device=dev)
                        sums[name] = sums.get(name, 0.0) + s
                        counts[name] = counts.get(name, 0.0) + c
                if hook is not None:
                    with acc.autocast():
                        whole = {str(k): self._scalar(k, v) for k, v in hook(self.model, self.step).items()}
        finally:
            self.model.train()
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

    @staticmethod
    def _scalar(name: Any, value: Any) -> float:
        """A model_metrics_fn value as a python float (a number or a one-element Tensor)."""
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise TypeError(f"model_metrics_fn value {name!r} must be a scalar, got a Tensor of shape "
                                f"{tuple(value.shape)}")
            return float(value.detach().reshape(()).item())
        return float(value)

    # -- export --------------------------------------------------------------------------------------
    def export(self, directory: str | os.PathLike | None = None) -> Path:
        """Write the final model (main process) for ``omni.export.load_pretrained``. Collective."""
        acc = self.accelerator
        directory = Path(directory) if directory is not None else self.export_dir
        acc.wait_for_everyone()
        full = None
        if acc.distributed_type == "FSDP":  # each rank holds a shard: gather the full weights (collective)
            full = acc.get_state_dict(self.model)
        if acc.is_main_process:
            root = acc.unwrap_model(self.model, keep_torch_compile=False)  # the fp32 wrapper only wraps forward
            module = self.export_module(root) if self.export_module is not None else root
            if full is not None:
                prefix = next(name for name, m in root.named_modules() if m is module)
                prefix = f"{prefix}." if prefix else ""
                full = {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
            _export.save_pretrained(module, directory, self.export_config, tokenizers=self.export_tokenizers,
                                    state_dict=full)
        acc.wait_for_everyone()
        return directory

    # -- the loop ------------------------------------------------------------------------------------
    def fit(self, finish: bool = True) -> dict[str, float]:
        """Train to ``config.steps`` (resuming as ``config.resume`` says), evaluate, checkpoint, export.
        Returns the last logged training metrics and the final eval metrics (a run that had already
        finished: the ones it recorded). ``finish`` ends the trackers, the process group
        (``accelerator.end_training``) and the hold on output_dir; pass False to keep using collectives
        (``evaluate`` on a test set) and call ``close()`` yourself."""
        failed = True
        try:
            results = self._fit()
            failed = False
        finally:
            if finish or failed:  # a failed fit ends the run: trackers flushed, process group torn down, lock freed
                self.close()
        return results

    def _fit(self) -> dict[str, float]:
        from tqdm.auto import tqdm

        acc, cfg = self.accelerator, self.config
        self._clean_stale_dirs()
        resumed = self._resume()
        if resumed and not self._config_changed and self.step >= cfg.steps and self._on_main(self._finished):
            return self._report_finished(resumed)
        if acc.trackers == [] and acc.log_with:
            acc.init_trackers(cfg.run_name, config=flatten_config({**cfg.to_dict(), **self.hparams}))
        if resumed and acc.is_main_process:
            print(f"omni.train: resumed from {resumed} at step {self.step}", flush=True)
        # tqdm redraws its line with carriage returns: in a log file (stderr not a terminal) that is one
        # endless line, so there the main process prints a plain line per log step instead.
        show_bar = acc.is_main_process and cfg.progress and _is_terminal(sys.stderr)
        print_lines = acc.is_main_process and not show_bar
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", dynamic_ncols=True, disable=not show_bar)
        last_ckpt = self.step if resumed else None
        last_eval: int | None = None
        results: dict[str, float] = {}
        window: list[dict[str, float]] = []
        t0 = time.perf_counter()
        self.model.train()
        with _StopOnSignal() as stop:
            try:
                while self.step < cfg.steps:
                    record = self._train_step()
                    self.step += 1
                    window.append(record)
                    bar.update(1)
                    if (cfg.log_every > 0 and self.step % cfg.log_every == 0) or self.step == cfg.steps:
                        dt = max(time.perf_counter() - t0, 1e-9)
                        logged = self._summarise(window, dt, self._stream.epoch)
                        acc.log(logged, step=self.step)
                        bar.set_postfix(loss=f"{logged['train/loss']:.4g}", lr=f"{logged['train/lr']:.3g}")
                        if print_lines:
                            print(f"step {self.step}/{cfg.steps}: " + ", ".join(
                                f"{k.removeprefix('train/')} {v:.4g}" for k, v in logged.items())
                                + f", it/s {len(window) / dt:.3g}", flush=True)
                        results.update(logged)
                        window, t0 = [], time.perf_counter()
                    if cfg.eval_every > 0 and self.step % cfg.eval_every == 0 and self.evaluates:
                        results.update(self._eval_and_log(bar))
                        last_eval = self.step
                    if cfg.checkpoint_every > 0 and self.step % cfg.checkpoint_every == 0:
                        self.save_checkpoint()
                        last_ckpt = self.step
                    if self.step < cfg.steps and (signum := self._stop_signal(stop)):
                        self._stop_here(signum, saved=last_ckpt == self.step)
                if self.evaluates and last_eval != self.step:
                    results.update(self._eval_and_log(bar))
                if cfg.checkpoint_every > 0 and last_ckpt != self.step:
                    self.save_checkpoint()
                if cfg.export:
                    self.export()
            finally:
                bar.close()
        results["step"] = self.step
        if acc.is_main_process:  # for a re-run of this finished run (_report_finished)
            _export.write_json(self.output_dir / RESULTS_NAME, results)
        return results

    def _stop_signal(self, stop: _StopOnSignal) -> int | None:
        """The stop signal this run has received, agreed by every rank: a rank alone may have got it, and the
        checkpoint that follows is collective. Several processes compare notes every ``log_every`` steps
        (a scalar all-reduce; every step would cost a device sync per step), one process every step."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return stop.signum
        if self.step % max(self.config.log_every, 1):
            return None
        flag = torch.tensor([stop.signum or 0], device=acc.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item()) or None

    def _stop_here(self, signum: int, saved: bool) -> None:
        """Checkpoint this step (unless just done) and raise TrainingInterrupted."""
        path = self.checkpoint_root / f"step-{self.step:06d}" if saved else self.save_checkpoint()
        raise TrainingInterrupted(f"stopped by {signal.Signals(signum).name} at step {self.step} of "
                                  f"{self.config.steps}; checkpoint {path}: run the same command again to resume",
                                  signum)

    def close(self) -> None:
        """Finish the trackers, tear down the process group and release output_dir; ``self.model`` becomes
        the plain module.

        The DDP wrapper is freed first: its C++ Reducer holds the gloo process group, and a process group
        destroyed through the Reducer blocks while holding the GIL on gloo threads that need the GIL
        (torch #56297), an intermittent hang at exit. Freed through ``destroy_process_group`` instead,
        the GIL is released."""
        import gc

        acc = self.accelerator
        try:
            self.model = acc.unwrap_model(self.model, keep_fp32_wrapper=False, keep_torch_compile=False)
            acc._models.clear()  # Accelerate's own reference to the wrapper
            gc.collect()
            acc.end_training()
        finally:
            self._lock.release()

    def _eval_and_log(self, bar: Any) -> dict[str, float]:
        metrics = self.evaluate()
        self.accelerator.log(metrics, step=self.step)
        if self.accelerator.is_main_process and metrics:
            bar.write(f"step {self.step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        return metrics

    def _summarise(self, window: list[dict[str, float]], seconds: float, epoch: int) -> dict[str, float]:
        n = len(window)
        out = {"train/loss": sum(r["loss"] for r in window) / n, "train/lr": window[-1]["lr"],
               "train/grad_norm": sum(r["grad_norm"] for r in window) / n,
               "train/samples_per_s": sum(r["samples"] for r in window) / seconds, "train/epoch": float(epoch)}
        tokens = sum(r["tokens"] for r in window)
        if tokens:
            out["train/tokens_per_s"] = tokens / seconds
        for name in self._metric_names or []:
            out[f"train/{name}"] = sum(r[name] for r in window) / n
        return out


__all__ = ["DiskFullError", "IntegrityError", "LockedError", "NonFiniteLossError", "RESUME_IGNORED", "RESUME_MODES",
           "ResumeMismatchError", "RunExistsError", "TrainConfig", "Trainer", "batch_keys", "config_differences",
           "default_param_groups", "flatten_config", "latest_checkpoint", "list_checkpoints", "lr_multiplier",
           "run_config", "seed_everything", "unwrap"]
