"""Checkpoints and resume for ``omni.train.Trainer``: the state of a run directory.

* Layout. ``output_dir/checkpoints/step-000100/`` holds Accelerate's ``save_state`` (model, optimizer,
  scheduler, grad scaler, per-rank RNG; sharded torch.distributed.checkpoint files under FSDP), each rank's
  data position (``data_state_rank<r>.json``: ``omni.steps.DataStream.state``), ``trainer_state.json``
  (step, world size, the run's config), ``checksums.json`` (every file's sha256) and a ``COMPLETE`` marker.
* Atomic writes. A checkpoint is written as ``.tmp-step-000100/``, everything fsynced, the marker last, and
  renamed into place by the main process: a crash at any moment leaves the previous checkpoint intact, and
  only directories with the marker are listed (``list_checkpoints``). Old checkpoints (beyond
  ``keep_checkpoints``) are renamed to ``.trash-*`` before deletion and only once the new one is complete,
  so a half-deleted one never looks like a checkpoint. A failed write always removes its partial directory;
  a full disk (ENOSPC, or torch.save's errno-less stream error while the disk is nearly full) raises
  ``DiskFullError`` naming the checkpoint, the space a checkpoint takes and the space free; a read-only folder
  raises ``NotWritableError`` naming it. ``clean_stale`` deletes the temp dirs killed runs left
  (checkpoint ``.tmp-*`` / ``.trash-*``, export ``.final.tmp-*`` / ``.final.old-*``); the Trainer calls it
  only while it holds the run lock, so no live run's temp dirs are touched.
* Resume modes (``TrainConfig.resume``). "auto": the newest intact checkpoint when its recorded run config
  (``run_config``: TrainConfig + hparams + export config, flattened) matches this run's, else
  ``ResumeMismatchError`` listing ``key: old -> new``; "force": resume even so; "never": ``RunExistsError``
  if the directory holds checkpoints or an export. Keys in ``RESUME_IGNORED`` may differ.
* Integrity. A checkpoint whose files differ from their checksums (or are missing, truncated, unreadable; or
  whose checksums.json is gone while its COMPLETE marker says it was written; or whose RNG state Accelerate
  could not restore, a failure its load_state swallows) is
  reported, renamed to ``corrupt-step-*`` and the previous one is used; if none is intact, ``IntegrityError``
  lists why rather than training over them from scratch. A checkpoint whose tensors do not fit the model
  (another architecture, even under "force") is refused naming the parameters and both shapes.
* Datasets. Every config value naming an omni dataset (a folder with manifest.json) is recorded in each
  checkpoint with a hash of its shards (``dataset_identities``); resuming on a dataset rebuilt or replaced
  since (same path, same size, other shards) is a ``ResumeMismatchError`` naming both (printed under "force").
* Resume needs the number of processes that wrote the checkpoint (per-rank data positions and RNG streams).
* A finished run (checkpoint at ``steps`` with the same config, intact export) is not trained again: the
  metrics it recorded in ``train_results.json`` are returned. A damaged export is reported and rewritten.
* Runs without checkpoints (``checkpoint_every=0``) are held to the same rules through ``run_config.json``,
  written when training starts: a later run with another config is refused under "auto" (its export would
  be replaced), and one with the same config whose results reached ``steps`` and whose export is intact is
  reported as finished.

Decisions about the directory are made on the main process and shared with every rank (``on_main``): one
decision, and a failure raised on every rank instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

from torch import Tensor, nn

from omni import export as _export
from omni.export import DiskFullError, IntegrityError

CHECKPOINT_DIR = _export.RUN_CHECKPOINT_DIR
EXPORT_DIR = _export.RUN_EXPORT_DIR
COMPLETE_MARKER = _export.CHECKPOINT_MARKER
TRAINER_STATE = "trainer_state.json"
RESULTS_NAME = "train_results.json"  # the metrics fit returned, for a re-run of a finished run
RUN_CONFIG_NAME = "run_config.json"  # the config of the run that last trained here (runs without checkpoints too)
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


class ResumeMismatchError(ValueError):
    """The output directory holds a run this one cannot continue: another config (resume="auto"), or
    tensors of other shapes (another architecture, whatever ``resume`` says)."""


class RunExistsError(ValueError):
    """resume="never" and the output directory already holds checkpoints or an export."""


# ----------------------------------------------------------------------------------------------------
# What defines a run


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, int | float | str | bool]:
    """Nested config -> flat {"a.b": scalar} that TensorBoard's hparams accepts (it rejects nested dicts).
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


def run_config(train: Any, hparams: Mapping[str, Any], export_config: Mapping[str, Any]) -> dict[str, Any]:
    """What defines a run (``train``: its TrainConfig), flattened (``train.lr``, ``hparams.model.widths``,
    ``export.trunk.d_model``): saved in every checkpoint and compared on resume. Object addresses in
    stringified values are dropped: they differ from process to process."""
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


# ----------------------------------------------------------------------------------------------------
# The directory


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


def on_main(accelerator: Any, fn: Callable[[], Any]) -> Any:
    """``fn()`` on the main process only, its result or exception shared with every rank (module docstring)."""
    outcome: list[Any] = [None]
    if accelerator.is_main_process:
        try:
            outcome[0] = (True, fn())
        except Exception as exc:
            outcome[0] = (False, exc)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(outcome)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


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
    _check_rng_states(ckpt)
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


def _check_rng_states(ckpt: Path) -> None:
    """IntegrityError naming a ``random_states_<rank>.pkl`` that Accelerate could not restore: its load_state
    swallows any failure there (logged at info level), and a resumed run would go on with the wrong random
    streams. Read with Accelerate's own loader (weights_only), applied, then this process's streams put back."""
    import random

    import numpy as np
    import torch
    from accelerate.utils import load

    for path in sorted(ckpt.glob("random_states_*.pkl")):
        kept = random.getstate(), np.random.get_state(), torch.get_rng_state()
        try:
            states = load(path)
            random.setstate(states["random_state"])
            np.random.set_state(states["numpy_random_seed"])
            torch.set_rng_state(states["torch_manual_seed"])
            cuda = states.get("torch_cuda_manual_seed", [])
            if not (isinstance(cuda, list) and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8
                                                   for t in cuda)):
                raise ValueError("torch_cuda_manual_seed is not a list of uint8 tensors")
        except Exception as exc:  # anything Accelerate would swallow
            raise IntegrityError(f"{path} is not an RNG state this run can restore ({type(exc).__name__}: "
                                 f"{' '.join(str(exc).split())[:300]})") from exc
        finally:
            random.setstate(kept[0])
            np.random.set_state(kept[1])
            torch.set_rng_state(kept[2])


_MANIFEST = "manifest.json"  # omni.data.shards.MANIFEST_NAME (the data layer sits above this one)


def dataset_identities(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{flattened key: identity} of every config value that names an omni dataset (a folder holding
    manifest.json, or that file): where it is, when it was built, and ``content``, a sha256 over its splits'
    shard names, sizes and sha256s (a rebuild of the same samples is the same dataset; another one is not,
    whatever its size). Recorded in every checkpoint and compared on resume."""
    import hashlib

    found: dict[str, dict[str, Any]] = {}
    for key, value in config.items():
        if key.startswith("export.") or not isinstance(value, str) or not value.strip() or len(value) > 4096:
            continue
        path = Path(value)
        manifest = path if path.name == _MANIFEST else path / _MANIFEST
        try:
            if not manifest.is_file():
                continue
            data = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # not a dataset (or unreadable: the data reader says so)
            continue
        if not isinstance(data, dict) or not isinstance(data.get("splits"), dict):
            continue
        shards = {split: [[s.get("name"), s.get("bytes"), s.get("sha256")] for s in rec.get("shards", [])
                          if isinstance(s, dict)]
                  for split, rec in data["splits"].items() if isinstance(rec, dict)}
        content = hashlib.sha256(json.dumps(shards, sort_keys=True).encode()).hexdigest()
        found[key] = {"path": str(manifest.resolve().parent), "created": data.get("created"), "content": content}
    return found


def _tree_bytes(path: Path | None) -> int:
    """Bytes of the files below ``path`` (0 if it is gone)."""
    if path is None or not path.is_dir():
        return 0
    total = 0
    for p in path.rglob("*"):
        try:
            total += p.stat().st_size if p.is_file() else 0
        except OSError:  # removed meanwhile
            pass
    return total


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 0 else "unknown space"


def _set_aside(ckpt: Path) -> Path:
    """Rename a corrupt checkpoint out of the listing: kept for inspection, never resumed or rotated away."""
    target, n = ckpt.with_name(f"corrupt-{ckpt.name}"), 1
    while target.exists():
        target, n = ckpt.with_name(f"corrupt-{ckpt.name}-{n}"), n + 1
    os.replace(ckpt, target)
    return target


# ----------------------------------------------------------------------------------------------------
# The checkpointer


class Checkpointer:
    """Saves and restores a run in ``config.output_dir`` (module docstring). ``config``: the run's
    TrainConfig (output_dir, resume, keep_checkpoints, export, compile); ``run_config``: its flattened
    config (``run_config``); ``data``: the ``omni.steps.DataStream`` whose position is saved and restored;
    ``model``: the plain module, for the shape check. Methods that touch the directory are collective."""

    def __init__(self, accelerator: Any, config: Any, run_config: Mapping[str, Any], data: Any,
                 model: nn.Module) -> None:
        self.accelerator, self.config, self.run_config, self.data, self.model = \
            accelerator, config, dict(run_config), data, model
        self.output_dir = Path(config.output_dir)
        self.root = self.output_dir / CHECKPOINT_DIR
        self.export_dir = self.output_dir / EXPORT_DIR

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    # -- saving --------------------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        """Write the checkpoint of optimizer step ``step`` atomically, then rotate old ones away."""
        acc = self.accelerator
        final = self.path(step)
        tmp = final.with_name(f".tmp-{final.name}")
        try:
            self._write(tmp, final, step)
        except Exception as exc:
            written, full = _tree_bytes(tmp), _export.is_disk_full(exc, self.root)  # before space is freed
            if acc.is_main_process:  # useless now, and removing it frees the space it took
                shutil.rmtree(tmp, ignore_errors=True)
            previous = latest_checkpoint(self.output_dir)
            kept = f"the previous checkpoint {previous} is intact" if previous else "there is no earlier checkpoint"
            if full:
                # the previous checkpoint's size, else the weights plus Adam's two moments (and what was written)
                model = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
                need = (f"a checkpoint of this run takes about {_mib(_tree_bytes(previous))}" if previous else
                        f"a checkpoint of this run needs about {_mib(max(written, 3 * model))}")
                raise DiskFullError(errno.ENOSPC, f"disk full (no space left on device) while writing checkpoint "
                                    f"{final} (at {getattr(exc, 'filename', None) or tmp}); the partial checkpoint "
                                    f"was removed and {kept}: {need}, {_mib(_export.free_bytes(self.root))} are free "
                                    f"on {self.root}; free space and run again (it resumes from there)") from exc
            if (denied := _export.not_writable(exc)) is not None:
                raise denied(errno.EACCES, f"cannot write checkpoint {final}: {self.root} is not writable "
                             f"({exc.strerror if isinstance(exc, OSError) else exc}); {kept}. Make it writable, or "
                             "use another output directory (--out)") from exc
            raise
        if acc.is_main_process and self.config.keep_checkpoints > 0:  # only now that the new one is complete
            for _, old in list_checkpoints(self.output_dir)[:-self.config.keep_checkpoints]:
                _remove_dir(old)
        acc.wait_for_everyone()
        return final

    def _write(self, tmp: Path, final: Path, step: int) -> None:
        acc = self.accelerator
        if acc.is_main_process:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))  # main: model/optimizer/scheduler; every rank: its RNG file
        _export.write_json(tmp / f"data_state_rank{acc.process_index}.json", self.data.state())
        acc.wait_for_everyone()
        if acc.is_main_process:
            _export.write_json(tmp / TRAINER_STATE, {
                "step": step, "world_size": acc.num_processes, "compile": self.config.compile,
                "train_prepared": self.data.prepared, "config": self.config.to_dict(),
                "run_config": self.run_config, "datasets": dataset_identities(self.run_config),
                _export.CHECKSUMS_KEY: _export.CHECKSUMS_NAME, "time": time.time()})
            _export.write_checksums(tmp)  # every rank's files are in by now
            _export.fsync_tree(tmp)
            # says checksums.json exists: a checkpoint that lost it is refused, not read unchecked
            _export.write_json(tmp / COMPLETE_MARKER, {"step": step, _export.CHECKSUMS_KEY: _export.CHECKSUMS_NAME})
            _export.fsync_dir(tmp)
            if final.exists():  # a checkpoint of this step from an earlier (non-resumed) run
                _remove_dir(final)
            os.replace(tmp, final)
            _export.fsync_dir(self.root)

    def clean_stale(self, owner: bool) -> None:
        """Delete the temp dirs killed runs left, when ``owner`` (this process holds the run lock)."""
        if self.accelerator.is_main_process and owner:
            for d in [*_dirs_named(self.root, (".tmp-", ".trash-")),
                      *_dirs_named(self.output_dir, (f".{EXPORT_DIR}.tmp-", f".{EXPORT_DIR}.old-"))]:
                shutil.rmtree(d, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    # -- resume --------------------------------------------------------------------------------------
    def restore(self) -> tuple[Path | None, int, bool]:
        """Restore everything from the checkpoint ``config.resume`` picks and start the data stream there
        (at the beginning without one): (checkpoint or None, its step, whether its config differs)."""
        acc = self.accelerator
        chosen, changed = on_main(acc, self._choose)
        if chosen is None:
            self.data.start(0, 0, None)
            return None, 0, changed
        ckpt = Path(chosen)
        meta = json.loads((ckpt / TRAINER_STATE).read_text())
        self._check_world_size(ckpt, meta)
        data_state = json.loads((ckpt / f"data_state_rank{acc.process_index}.json").read_text())
        self.data.start(data_state["epoch"], data_state["position"], data_state["loader"], data_state["rng"])
        try:
            acc.load_state(str(ckpt))
        except Exception as exc:
            exc.add_note(f"omni.train: while restoring the checkpoint {ckpt}")
            raise
        return ckpt, int(meta["step"]), changed

    def _check_world_size(self, ckpt: Path, meta: Mapping[str, Any]) -> None:
        n = self.accelerator.num_processes
        if meta.get("world_size", n) != n:
            raise ValueError(f"{ckpt} was written by {meta['world_size']} processes; resume it with "
                             f"{meta['world_size']} (now {n}): per-rank data positions and RNG "
                             f"streams do not map onto another number of ranks")

    def _choose(self) -> tuple[str | None, bool]:
        """Main process: the checkpoint to resume (None: start fresh) and whether its config differs."""
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
            # the process count first: a recipe derives steps and warmup from batches per rank, so on another
            # count the config comparison below would blame those entries instead of the real cause
            self._check_world_size(ckpt, meta)
            changed = self._compare_config(ckpt, meta)
            self._check_shapes(ckpt, shapes)
            self._compare_datasets(ckpt, meta)
            for bad, why in corrupt:
                warnings.warn(f"omni.train: {why}; resuming from the previous intact checkpoint {ckpt} instead "
                              f"({bad.name} is kept as {_set_aside(bad).name})", stacklevel=3)
            return str(ckpt), changed
        if corrupt:
            raise IntegrityError(f"no intact checkpoint to resume in {self.root}; not training over them "
                                 "from scratch:\n  " + "\n  ".join(why for _, why in corrupt) + "\nMove them away "
                                 "to start fresh, or use another output directory (--out).")
        return None, self._compare_recorded()

    def _compare_recorded(self) -> bool:
        """No checkpoint to resume: hold this run to the config recorded by the last run here (run_config.json)
        as a checkpoint's would be, since training from scratch replaces that run's export. Whether it differs."""
        try:
            recorded = json.loads((self.output_dir / RUN_CONFIG_NAME).read_text())
        except (OSError, ValueError):  # a new directory, or a run from before configs were recorded
            recorded = None
        if not isinstance(recorded, Mapping):
            if self.export_dir.exists():
                print(f"omni.train: {self.output_dir} holds an export but no checkpoint to resume: training from "
                      f"scratch, {self.export_dir} will be replaced at the end", flush=True)
            return False
        # refused only where work would be lost: an export that training anew replaces
        return self._held_to(recorded, f"{RUN_CONFIG_NAME}; it wrote no checkpoint to resume, and training anew "
                             f"replaces its export {self.export_dir}", refuse=self.export_dir.exists(),
                             going_on=f"training {self.output_dir} anew with another config than its last run's")

    def record_start(self) -> None:
        """Main process: record this run's config (``run_config.json``) before training starts."""
        if self.accelerator.is_main_process:
            _export.write_json(self.output_dir / RUN_CONFIG_NAME, self.run_config)

    def finished_without_checkpoint(self) -> bool:
        """No checkpoint was resumed and the config is the recorded one: whether that run reached ``steps``
        (its recorded results say so) with its export intact. Collective."""
        def done() -> bool:
            try:
                step = json.loads((self.output_dir / RESULTS_NAME).read_text()).get("step", 0)
            except (OSError, ValueError, AttributeError):
                return False
            return (self.output_dir / RUN_CONFIG_NAME).is_file() and step >= self.config.steps \
                and self._export_intact()
        return on_main(self.accelerator, done)

    def _compare_config(self, ckpt: Path, meta: Mapping[str, Any]) -> bool:
        """Whether the checkpoint's recorded run config differs from this run's (ResumeMismatchError under
        resume="auto"). Checkpoints written before configs were recorded are taken as they are."""
        old = meta.get("run_config")
        if not isinstance(old, Mapping):
            return False
        return self._held_to(old, f"checkpoint {ckpt}; resuming would continue that run, not train this one",
                             refuse=True, going_on=f"resume='force': resuming {ckpt} although the config differs")

    def _held_to(self, recorded: Mapping[str, Any], source: str, refuse: bool, going_on: str) -> bool:
        """Whether ``recorded`` (an earlier run's config; ``source`` says where it is and what going on does)
        differs from this run's: ResumeMismatchError listing the differences under resume="auto" where
        ``refuse``, else they are printed after ``going_on``."""
        differences = config_differences(recorded, self.run_config)
        if differences and refuse and self.config.resume == "auto":
            raise ResumeMismatchError(
                f"{self.output_dir} holds a run with another config ({source}):\n  " + "\n  ".join(differences)
                + "\nPass resume='force' (recipes: --set resume=force) to go on with this config anyway, or use "
                "another output directory (--out).")
        if differences:
            print(f"omni.train: {going_on}:\n  " + "\n  ".join(differences), flush=True)
        return bool(differences)

    def _compare_datasets(self, ckpt: Path, meta: Mapping[str, Any]) -> None:
        """ResumeMismatchError (resume="auto"; printed under "force") when a dataset the checkpoint was trained
        on (``dataset_identities``) holds other shards now, the same path and config notwithstanding: a
        rebuilt or replaced dataset, on which resuming would continue other samples at the saved position."""
        old = meta.get("datasets")
        if not isinstance(old, Mapping):  # written before datasets were recorded
            return
        now = dataset_identities(self.run_config)
        lines = [f"{key}: the checkpoint was trained on {o.get('path')} (built {o.get('created')}, content "
                 f"{str(o.get('content'))[:12]}), which now holds {now[key]['path']} (built {now[key]['created']}, "
                 f"content {now[key]['content'][:12]})"
                 for key, o in sorted(old.items()) if isinstance(o, Mapping) and key in now
                 and o.get("content") != now[key]["content"]]
        if lines and self.config.resume == "auto":
            raise ResumeMismatchError(
                f"{self.output_dir} holds a run trained on another dataset (checkpoint {ckpt}): " + "; ".join(lines)
                + ". It was rebuilt or replaced since: put the original dataset back, pass resume='force' "
                "(recipes: --set resume=force) to continue on this one anyway, or train anew in another output "
                "directory (--out).")
        if lines:
            print(f"omni.train: resume='force': resuming {ckpt} on another dataset: " + "; ".join(lines), flush=True)

    def _check_shapes(self, ckpt: Path, shapes: Mapping[str, tuple[int, ...]] | None) -> None:
        """ResumeMismatchError naming every tensor whose checkpoint shape is not the model's, before
        anything is loaded (whatever ``resume`` says: the weights cannot go into this model)."""
        if shapes is None:  # sharded (FSDP): load_state's own error, with the checkpoint's path added
            return
        model = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        wrong = [f"{k}: checkpoint {shapes[k]}, model {model[k]}" for k in sorted(shapes.keys() & model.keys())
                 if shapes[k] != model[k]]
        if wrong:
            raise ResumeMismatchError(f"the checkpoint {ckpt} does not fit this model (another architecture?); "
                                      "tensors of other shapes:\n  " + "\n  ".join(wrong)
                                      + "\nTrain this model in another output directory (--out).")

    # -- a finished run ------------------------------------------------------------------------------
    def finished(self) -> bool:
        """After a resume at ``steps`` with the same config: whether the export is in place too (or none is
        wanted). A damaged export is reported (and written again by the run). Collective."""
        return on_main(self.accelerator, self._export_intact)

    def _export_intact(self) -> bool:
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

    def report_finished(self, ckpt: Path | None, step: int) -> dict[str, float]:
        """What a re-run of a finished run returns: the metrics it recorded; nothing is trained or written.
        ``ckpt``: its final checkpoint (None for a run without checkpoints: its recorded results)."""
        if self.accelerator.is_main_process:
            exported = f" and its export {self.export_dir} is intact" if self.config.export else ""
            where = ckpt if ckpt is not None else self.output_dir / RESULTS_NAME
            print(f"omni.train: {self.output_dir} already finished: {where} is at step {step} of "
                  f"{self.config.steps}{exported}; nothing to do (use another output directory to train anew)",
                  flush=True)
        try:
            results = json.loads((self.output_dir / RESULTS_NAME).read_text())
        except (OSError, ValueError):  # finished before results were recorded
            results = {}
        return {**results, "step": step}

    def record_results(self, results: Mapping[str, float]) -> None:
        """Keep what ``fit`` returned, for a re-run of this finished run (main process writes)."""
        if self.accelerator.is_main_process:
            _export.write_json(self.output_dir / RESULTS_NAME, results)


__all__ = ["CHECKPOINT_DIR", "COMPLETE_MARKER", "Checkpointer", "DiskFullError", "EXPORT_DIR", "IntegrityError",
           "RESULTS_NAME", "RUN_CONFIG_NAME", "RESUME_IGNORED", "RESUME_MODES", "ResumeMismatchError", "RunExistsError", "TRAINER_STATE",
           "config_differences", "dataset_identities", "flatten_config", "latest_checkpoint", "list_checkpoints", "on_main", "run_config"]
