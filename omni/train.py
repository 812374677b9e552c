"""The training loop: the one module that owns Accelerate.

    trainer = Trainer(model, loss_fn, train_data, TrainConfig(output_dir="runs/vit", steps=10_000))
    metrics = trainer.fit()      # resumes from output_dir/checkpoints, exports output_dir/final

The same script runs as ``python recipes/x.py`` and ``accelerate launch --num_processes N recipes/x.py``
(or ``torchrun``). Build the model after ``seed_everything(seed)`` so every run starts from the same init;
under DDP rank 0's parameters are broadcast anyway.

``Trainer`` sets up Accelerate, the optimizer and the schedule, and coordinates components that each own one
job and document it: ``omni.steps`` (the training data stream, and the step strategy: ``EagerStep``, or
``GraphedStep`` with ``cuda_graph``), ``omni.checkpointing`` (``Checkpointer``: checkpoints and resume),
``omni.evaluation`` (``Evaluator``; ``MetricHistory`` and ``Pictures``: the logged scalars kept in
``output_dir/history.jsonl``, the training curves drawn to ``output_dir/curves.png``, sample pictures and audio to
TensorBoard) and ``omni.export`` (the final model). What a run guarantees, and the
traps it avoids (the project's research notes on Accelerate/webdataset pitfalls, numbered there):

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
* Non-finite loss. If any rank's loss (or the gradient norm) is NaN/inf, every rank raises
  ``NonFiniteLossError`` naming the step, the rank, the batch position and the sample keys, before the
  optimizer step. Parameters, optimizer and checkpoints stay untouched.
* One run per output directory. The main process holds ``DirectoryLock(output_dir)`` from the
  constructor to ``close`` (``fit`` closes at its end and on errors): a second run on the same directory
  gets ``LockedError`` naming the live holder (pid, host, command). A killed run's lock is free (flock). At
  the start of ``fit`` the lock holder deletes the temp dirs killed runs left: no live run can own them.
* Checkpoints (``checkpoint_every``) are atomic: a crash at any moment leaves the previous one intact,
  resume picks the newest complete one, a full disk raises ``DiskFullError`` naming the checkpoint.
* Resume (``TrainConfig.resume``). "auto": resume the newest intact checkpoint when its recorded config
  (TrainConfig + ``hparams`` + ``export_config``) matches this run's, else ``ResumeMismatchError`` listing
  ``key: old -> new``; "force": resume even so; "never": ``RunExistsError`` if the directory holds a run.
  Keys in ``RESUME_IGNORED`` may differ (none changes what a step computes). A corrupt checkpoint is set
  aside and the previous one used (``IntegrityError`` if none is intact); a checkpoint whose tensors do not
  fit the model is refused. A run that already finished is reported, not trained or exported again;
  ``fit`` returns the metrics it recorded. Results (``train_results.json``) and ``curves.png`` are written
  before the export, which marks a run finished; one finished without them (killed in between, by an omni
  that wrote them after) is evaluated again from its final checkpoint and they are written.
* Evaluation scores the whole eval set every time, whatever a hook read of it (``omni.evaluation``), so a
  resumed run logs the eval metrics of an uninterrupted one.
* Exact resume. Model, optimizer, scheduler, RNG (python, numpy, torch, CUDA, per rank) and the data
  position are restored; training N steps, stopping and resuming to 2N gives the same parameters as
  2N steps straight (bitwise on CPU; on CUDA up to non-deterministic kernels, ~1e-9 in our check).
  Calls into the training data run on their own checkpointed RNG stream and evaluation under a
  saved-and-restored one, so neither shifts the training stream (dropout). Resume needs the same number
  of processes (per-rank data positions); ``compile`` may change (checkpoints hold plain names).
  Checkpoints assume a file system every rank sees (as Accelerate's ``save_state`` does).
* Interruption. The first SIGINT (Ctrl-C) or SIGTERM lets the step finish, saves its checkpoint and raises
  ``TrainingInterrupted`` (ranks agree every ``log_every`` steps); a second one stops at once. A signal the
  process started ignoring (SIGINT of a background job ``... &`` in a script, ``nohup``) stays ignored.
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
With ``optimizer="muon"`` the same groups are cut in two (``omni.optimizers``): the trunk's nn.Linear weights
train with Muon, the rest with AdamW.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import os
import random
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
from torch import nn

from omni import export as _export
from omni.checkpointing import (RESULTS_NAME, RESUME_IGNORED, RESUME_MODES, Checkpointer, ResumeMismatchError,
                                RunExistsError, config_differences, flatten_config, latest_checkpoint,
                                list_checkpoints, on_main, run_config)
from omni.evaluation import (HISTORY_NAME, EvalFn, Evaluator, MetricHistory, ModelMetricsFn, Pictures, SamplesFn,
                             held_position)
from omni.export import DiskFullError, IntegrityError
from omni.interrupts import StopOnSignal, TrainingInterrupted
from omni.lock import DirectoryLock, LockedError
from omni.optimizers import MuonAdamW, muon_parameters, split_groups
from omni.progress import Progress
from omni.steps import DataStream, Loss, LossOutput, NonFiniteLossError, batch_keys, build_step


@dataclass
class TrainConfig:
    """Every field is a flat scalar so the config goes to TensorBoard's hparams as it is."""

    output_dir: str = "runs/omni"
    steps: int = 1000  # optimizer steps
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.0  # cosine ends at lr * min_lr_ratio
    warmup_steps: int = 0  # linear warmup from lr/warmup_steps to lr
    weight_decay: float = 0.05  # on matrices only (module docstring)
    # "adamw", or "muon": Muon for the 2-D weights of the nn.Linear modules inside the trunk (attention, MLP),
    # AdamW for the rest (embeddings, heads, norms, biases, conv kernels), same lr / weight decay / schedule
    # (omni.optimizers.MuonAdamW). Not with cuda_graph (AdamW only) or FSDP (Muon needs whole matrices).
    optimizer: str = "adamw"
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
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer must be adamw or muon, got {self.optimizer!r}")
        if self.cuda_graph and self.optimizer != "adamw":
            raise ValueError(f"optimizer {self.optimizer!r} cannot run under cuda_graph (the captured step replays "
                             "AdamW only): set cuda_graph=False or optimizer='adamw'")
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


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices): call before building the model."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------------------------------
# Accelerate and the optimizer


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
    load_state) once the state names FSDP: switch it here, before anything is prepared. This is the one
    place omni overrides Accelerate's decisions, through public attributes of its process-wide states. Both
    are set: every ``AcceleratorState()`` re-reads PartialState's distributed_type."""
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
    PartialState().distributed_type = DistributedType.FSDP  # every PartialState() shares one state


def build_accelerator(config: TrainConfig, accelerator_kwargs: Mapping[str, Any] | None = None) -> Any:
    """The run's Accelerator (``accelerator_kwargs`` take precedence): ``config``'s mixed precision, tracker and
    DDP options, a seedable sampler for prepared DataLoaders, logs in output_dir/logs; the scheduler is
    stepped by us once per optimizer step (Accelerate's default steps it num_processes times per step) and
    accumulation is the step strategy's. FSDP on CPU ranks (``_fsdp_on_cpu``); per-rank seeds (dropout differs
    across ranks)."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import (AutocastKwargs, DistributedDataParallelKwargs, DistributedType,
                                  ProjectConfiguration, parse_flag_from_env, set_seed)

    output_dir = Path(config.output_dir)
    kwargs: dict[str, Any] = dict(accelerator_kwargs or {})
    kwargs.setdefault("mixed_precision", _mixed_precision(config.mixed_precision))
    kwargs.setdefault("project_config", ProjectConfiguration(project_dir=str(output_dir),
                                                             logging_dir=str(output_dir / "logs")))
    kwargs.setdefault("dataloader_config", DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed))
    if config.report_to and config.report_to != "none":
        kwargs.setdefault("log_with", _tracker(config.report_to))
    handlers = list(kwargs.pop("kwargs_handlers", []))
    if config.find_unused_parameters:
        handlers.append(DistributedDataParallelKwargs(find_unused_parameters=True))
    if config.cuda_graph:  # the CUDA-graphs notes' rule: no autocast weight-cast cache under capture
        handlers.append(AutocastKwargs(cache_enabled=False))
    if use_cpu():
        kwargs.setdefault("cpu", True)
    acc = Accelerator(step_scheduler_with_optimizer=False, gradient_accumulation_steps=1, kwargs_handlers=handlers,
                      **kwargs)
    if parse_flag_from_env("ACCELERATE_USE_FSDP") and acc.distributed_type == DistributedType.MULTI_CPU:
        _fsdp_on_cpu(acc, kwargs.get("fsdp_plugin"))
    set_seed(config.seed, device_specific=True)
    return acc


def _mixed_precision(requested: str) -> str | None:
    if requested != "auto":
        return requested
    # `accelerate launch` always exports its --mixed_precision, "no" by default: honour it only when
    # it asks for reduced precision, so a default launch still gets bf16 on the GPU.
    if os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower() not in ("", "no"):
        return None
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def _tracker(name: str) -> str | None:
    if name == "tensorboard":
        from accelerate.utils import is_tensorboard_available

        if not is_tensorboard_available():
            import warnings

            warnings.warn("tensorboard is not installed: training metrics are not logged "
                          "(pip install tensorboard, or set report_to='none')")
            return None
    return name


def build_optimizer(groups: list[dict[str, Any]], config: TrainConfig, device: torch.device,
                    muon_ids: set[int] | None = None
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """``config.optimizer`` over ``groups`` and its warmup + cosine schedule (``lr_multiplier``): AdamW (fused on
    CUDA), or ``omni.optimizers.MuonAdamW`` with the params in ``muon_ids`` (``muon_parameters``; a group's own
    ``"muon"`` flag wins) on Muon and the rest on AdamW; ValueError in one line when Muon would get nothing."""
    kwargs = dict(lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps, weight_decay=config.weight_decay,
                  fused=device.type == "cuda" or None)
    if config.optimizer == "muon":
        groups = split_groups(groups, muon_ids or set())
        if not any(g["muon"] for g in groups):
            raise ValueError("optimizer 'muon' found no hidden matrices to train: Muon takes the nn.Linear weights "
                             "inside an omni Trunk (or param groups marked 'muon': True); use optimizer='adamw'")
        optimizer: torch.optim.Optimizer = MuonAdamW(groups, **kwargs)
    else:
        optimizer = torch.optim.AdamW(groups, **kwargs)
    warmup, total, min_ratio = config.warmup_steps, config.steps, config.min_lr_ratio

    def schedule(i: int) -> float:  # a plain function: LambdaLR does not pickle it, so the schedule
        return lr_multiplier(i, warmup=warmup, total=total, min_ratio=min_ratio)  # follows the current config

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


# ----------------------------------------------------------------------------------------------------
# The trainer


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
        to this evaluation (e.g. "only at the end": measure when ``step >= config.steps``). The values join
        the eval metrics as ``eval/<name>`` (returned by ``evaluate``/``fit``, logged to the trackers,
        printed); a name may not also come from ``eval_fn``. Contract across processes: it is called on EVERY
        rank with the prepared model (as ``eval_fn``), and each name's value is the mean over the ranks that
        return it (exact when every rank measures the same thing, as the usual seeded held-out loop
        does; a hook that splits the work over ranks combines it itself, with collectives, since all
        ranks are in it). Its forward passes must not desynchronise the ranks: under DDP run them on
        ``unwrap(model)`` (no collectives) rather than through the DDP wrapper, whose forward may
        communicate; under FSDP every forward is collective (parameters are all-gathered per unit, and
        submodules outside the root forward see only their shards), so a data-dependent loop (decoding,
        rollouts) cannot run there: pass no hook and measure the exported model instead
        (recipes/multimodal.py does so, once at the end, on the main process).
    samples_fn(model, step) -> [omni.plots.Picture | Clip | Note]
        what a person looks at after each evaluation (predictions on a few images, a few transcribed clips, a
        return plot), logged to TensorBoard as images, audio and text (``omni.evaluation.Pictures``); called on
        the main process with the plain module, under the evaluation's conditions; not under FSDP.
    param_groups(model) -> optimizer param groups; default ``default_param_groups``. With optimizer="muon" each
        is cut into its Muon part (``muon_parameters``) and its AdamW part, unless it says ``"muon": True/False``.
    hparams: extra (nested) config logged to TensorBoard next to TrainConfig (flattened).
    export_config / export_tokenizers / export_module: what ``omni.export.save_pretrained`` writes to
        output_dir/final (``export_module(model)`` picks the submodule to export, default: all of it).
    prepare_data: hand train/eval DataLoaders to ``accelerator.prepare`` (None: only plain DataLoaders
        without ``state_dict``/``set_epoch``; rank-local loaders must not be re-sharded).

    Components (built here, each documented in its module): ``data`` (``omni.steps.DataStream``),
    ``stepper`` (``omni.steps.EagerStep`` / ``GraphedStep``), ``evaluator`` (``omni.evaluation.Evaluator``),
    ``checkpointer`` (``omni.checkpointing.Checkpointer``), ``history`` and ``pictures``
    (``omni.evaluation.MetricHistory``, ``Pictures``: history.jsonl, curves.png, TensorBoard samples).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], LossOutput] | None,
        train_data: Iterable[Any],
        config: TrainConfig,
        *,
        eval_data: Iterable[Any] | None = None,
        eval_fn: EvalFn | None = None,
        model_metrics_fn: ModelMetricsFn | None = None,
        samples_fn: SamplesFn | None = None,
        param_groups: Callable[[nn.Module], list[dict[str, Any]]] | None = None,
        hparams: Mapping[str, Any] | None = None,
        export_config: Mapping[str, Any] | None = None,
        export_tokenizers: Mapping[str, Any] | None = None,
        export_module: Callable[[nn.Module], nn.Module] | None = None,
        prepare_data: bool | None = None,
        accelerator_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.output_dir = Path(config.output_dir)
        self.model_metrics_fn = model_metrics_fn
        self.hparams = dict(hparams or {})
        self.export_config = dict(export_config or {})
        self.export_tokenizers, self.export_module = export_tokenizers, export_module

        self.accelerator = acc = build_accelerator(config, accelerator_kwargs)
        groups = param_groups(model) if param_groups is not None else default_param_groups(model, config.weight_decay)
        from accelerate.utils import DistributedType

        if config.optimizer == "muon" and acc.distributed_type == DistributedType.FSDP:
            raise ValueError("optimizer 'muon' cannot run under FSDP (Newton-Schulz needs whole matrices, FSDP "
                             "shards them): use DDP or optimizer='adamw'")
        muon_ids = muon_parameters(model) if config.optimizer == "muon" else None
        self.model, self.optimizer, self.scheduler = acc.prepare(model, *build_optimizer(groups, config, acc.device,
                                                                                          muon_ids))
        if config.compile:
            # Compiled here rather than by Accelerate's dynamo plugin: that one lives in the process-wide
            # AcceleratorState (a later Trainer could not change it), and checkpoints keep the plain
            # parameter names (Accelerate saves the module it prepared), so compile can be toggled on resume.
            self.model = torch.compile(self.model) if config.compile is True else \
                torch.compile(self.model, mode=str(config.compile))

        self.data = DataStream(train_data, acc, config.seed, prepare_data)
        loss = Loss(acc, loss_fn)
        self.evaluator = Evaluator(acc, loss, eval_data, eval_fn, prepare_data)
        self.stepper = build_step(config, acc, self.optimizer, self.scheduler, loss, self.data.prepared,
                                  functools.partial(latest_checkpoint, self.output_dir))
        self.checkpointer = Checkpointer(acc, config, self.run_config(), self.data, unwrap(self.model))
        self.history = MetricHistory(self.output_dir / HISTORY_NAME if acc.is_main_process else None)
        self.pictures = Pictures(acc, self.output_dir, self.history, samples_fn, title=config.run_name)
        self.step = 0  # optimizer steps taken
        # Last, so nothing after it can fail and leave the lock taken: the main process owns output_dir.
        self._lock = DirectoryLock(self.output_dir, "output directory")

        def take_lock() -> None:  # returns nothing: the lock (an open fd) must not travel to other ranks
            self._lock.acquire()

        on_main(acc, take_lock)

    @property
    def checkpoint_root(self) -> Path:
        return self.checkpointer.root

    @property
    def export_dir(self) -> Path:
        return self.checkpointer.export_dir

    def run_config(self) -> dict[str, Any]:
        """This run's flattened config (``run_config``): recorded in checkpoints, compared on resume."""
        return run_config(self.config, self.hparams, self.export_config)

    def save_checkpoint(self) -> Path:
        """Write output_dir/checkpoints/step-XXXXXX atomically (``omni.checkpointing``). Collective."""
        return self.checkpointer.save(self.step)

    @property
    def evaluates(self) -> bool:
        """Whether ``fit`` evaluates: there is eval data or a ``model_metrics_fn``."""
        return self.evaluator.data is not None or self.model_metrics_fn is not None

    def evaluate(self, data: Iterable[Any] | None = None, *, model_metrics: bool = True) -> dict[str, float]:
        """Mean of every eval metric over the whole eval set (``data``, default the Trainer's eval data)
        and all ranks, plus (``model_metrics``) the ``model_metrics_fn`` values, as {"eval/<name>": value}.
        Collective: call it on every rank."""
        return self.evaluator(self.model, self.step, data, self.model_metrics_fn if model_metrics else None)

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
                                    state_dict=full, rescue=True)  # a full disk must not lose the trained model
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
        acc, cfg = self.accelerator, self.config
        self.checkpointer.clean_stale(owner=self._lock.held)
        resumed, self.step, changed = self.checkpointer.restore()
        # A run whose export is in place finished; from before results were recorded first (or after a kill
        # between an export and its results by an older omni), it is evaluated again from its final checkpoint
        # and its results written: never "finished" without them.
        exported = bool(resumed) and not changed and self.step >= cfg.steps and self.checkpointer.finished()
        if exported and self._results_recorded():
            return self.checkpointer.report_finished(resumed, self.step)
        if exported and acc.is_main_process:
            print(f"omni.train: {self.output_dir} finished at step {self.step} but its results were not recorded: "
                  f"evaluating its final checkpoint {resumed} again", flush=True)
        if not resumed and not changed and self.checkpointer.finished_without_checkpoint():
            return self.checkpointer.report_finished(None, cfg.steps)
        self.checkpointer.record_start()
        on_main(acc, lambda: self.history.restore(self.step if resumed else 0))  # the curves cover the whole run
        if acc.trackers == [] and acc.log_with:
            acc.init_trackers(cfg.run_name, config=flatten_config({**cfg.to_dict(), **self.hparams}))
        if resumed and acc.is_main_process:
            print(f"omni.train: resumed from {resumed} at step {self.step}", flush=True)
        last_ckpt = self.step if resumed else None
        last_eval: int | None = None
        results: dict[str, float] = {}
        if exported:  # evaluated again: its training metrics are the last ones it logged
            results.update(self.history.latest("train/"))
        self.model.train()
        with StopOnSignal() as stop, Progress(acc, cfg, self.step, self.history) as progress:
            while self.step < cfg.steps:
                record = self._train_step()
                self.step += 1
                results.update(progress.step(self.step, record, self.data.epoch))
                if cfg.eval_every > 0 and self.step % cfg.eval_every == 0 and self.evaluates:
                    results.update(self._evaluate_and_log(progress))
                    last_eval = self.step
                if cfg.checkpoint_every > 0 and self.step % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
                    last_ckpt = self.step
                if self.step < cfg.steps and (signum := stop.agreed(acc, self.step, cfg.log_every)):
                    self._stop_here(signum, saved=last_ckpt == self.step)
            if self.evaluates and last_eval != self.step:
                results.update(self._evaluate_and_log(progress))
            if cfg.checkpoint_every > 0 and last_ckpt != self.step:
                self.save_checkpoint()
            self.pictures.curves()
            results["step"] = self.step
            # Recorded before the export: an export in place marks a finished run (a re-run reports these
            # results), so a kill between the two must leave the results, not the export alone.
            self.checkpointer.record_results(results)
            if cfg.export and not exported:
                self.export()
        return results

    def _results_recorded(self) -> bool:
        """Whether ``output_dir`` holds this run's results (``RESULTS_NAME``, at ``steps``). Collective."""
        def recorded() -> bool:
            try:
                results = json.loads((self.output_dir / RESULTS_NAME).read_text())
            except (OSError, ValueError):
                return False
            return isinstance(results, dict) and isinstance(results.get("step"), int) \
                and results["step"] >= self.config.steps
        return bool(on_main(self.accelerator, recorded))

    def _train_step(self) -> dict[str, float]:
        """Optimizer step ``self.step + 1`` on the next batches: the step strategy's record."""
        return self.stepper.step(self.model, self.data, self.step + 1)

    def _evaluate_and_log(self, progress: Progress) -> dict[str, float]:
        metrics = self.evaluate()
        progress.evaluated(self.step, metrics)
        with held_position(self.evaluator.data if not self.evaluator.prepared else None):  # a hook reading eval
            self.pictures.samples(unwrap(self.model), self.step)  # data must not move what evaluations score
        if self.step < self.config.steps:  # the last one is drawn once training is done
            self.pictures.curves()
        return metrics

    def _stop_here(self, signum: int, saved: bool) -> None:
        """Checkpoint this step (unless just done) and raise TrainingInterrupted."""
        path = self.checkpointer.path(self.step) if saved else self.save_checkpoint()
        self.pictures.curves()
        raise TrainingInterrupted(f"stopped by {signal.Signals(signum).name} at step {self.step} of "
                                  f"{self.config.steps}; checkpoint {path}: run the same command again to resume",
                                  signum)

    def close(self) -> None:
        """Finish the trackers, tear down the process group and release output_dir; ``self.model`` becomes
        the plain module.

        Every reference to the DDP wrapper is dropped first (ours, and Accelerate's, which ``free_memory``
        clears before a garbage collection; the components never keep one): its C++ Reducer holds the gloo
        process group, and a process group destroyed through the Reducer blocks while holding the GIL on gloo
        threads that need the GIL (torch #56297), an intermittent hang at exit. Freed through
        ``destroy_process_group`` instead, the GIL is released."""
        acc = self.accelerator
        try:
            self.model = acc.unwrap_model(self.model, keep_fp32_wrapper=False, keep_torch_compile=False)
            acc.free_memory()
            acc.end_training()
        finally:
            self._lock.release()


__all__ = ["DiskFullError", "IntegrityError", "LockedError", "NonFiniteLossError", "RESUME_IGNORED", "RESUME_MODES",
           "ResumeMismatchError", "RunExistsError", "TrainConfig", "Trainer", "TrainingInterrupted", "batch_keys",
           "build_accelerator", "build_optimizer", "config_differences", "default_param_groups", "flatten_config",
           "latest_checkpoint", "list_checkpoints", "lr_multiplier", "process_state", "run_config", "seed_everything",
           "unwrap", "use_cpu"]
