"""Final export for inference: model.safetensors + config.json (+ tokenizers/), and loading it back
with no training code.

    save_pretrained(model, "runs/vit/final", {"builder": "omni", "trunk": {...}, "heads": {...}},
                    tokenizers={"image": image_tok})
    model = load_pretrained("runs/vit/final")             # rebuilt by the "omni" builder, eval mode
    toks = load_tokenizers("runs/vit/final")               # {"image": ImageTokenizer(...)}

A directory holds:
    config.json        {"omni_format": 1, "builder": NAME, "tokenizers": [modality, ...], ...model config}
    model.safetensors  the weights (tied weights stored once; safetensors.torch.save_model)
    tokenizers/<m>/    each tokenizer's ``Tokenizer.save`` output (config + fitted state)

The builder rebuilds the module from (config, tokenizers) before the weights are loaded. It is named by
``config["builder"]``: a name registered with ``@register_builder("name")`` (the built-in "omni" builds
an OmniModel from trunk + head specs), or an import path "package.module:function" so a project's own
model loads anywhere it is importable. Or pass ``build=`` explicitly.

The whole directory is written next to its destination and renamed into place, so a crash never leaves
a half-written export under the final name. Its last file, ``checksums.json``, records the size and sha256
of every other file; ``load_pretrained`` checks them and names the file that differs (flipped bytes, a
truncated copy), so a damaged export never loads silently. Exports written before checksums existed have
no such file and load unchecked. Training checkpoints carry the same file (omni.train).

``resolve_export_dir`` turns what a user points at (an export, a run's output directory, a checkpoint)
into the export directory, or says what the path is and where its export lives.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from omni.files import fsync_dir, sha256_file, write_json

FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TOKENIZERS_DIR = "tokenizers"
CHECKSUMS_NAME = "checksums.json"
# A training run's output directory (omni.train): named here so errors can point from a run or one of its
# checkpoints to the run's export.
RUN_EXPORT_DIR = "final"
RUN_CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_MARKER = "COMPLETE"


class IntegrityError(ValueError):
    """A file of an export or a checkpoint is missing, truncated, unreadable or differs from its recorded sha256."""


class DiskFullError(OSError):
    """No space left on the device while writing an export or a checkpoint; the partial write is removed and
    what was there before is intact."""


Builder = Callable[[dict[str, Any], dict[str, Any]], nn.Module]  # (config, tokenizers) -> module
_BUILDERS: dict[str, Builder] = {}


def register_builder(name: str) -> Callable[[Builder], Builder]:
    """Decorator: make ``fn(config, tokenizers) -> nn.Module`` loadable as ``config["builder"] = name``."""

    def wrap(fn: Builder) -> Builder:
        if name in _BUILDERS and _BUILDERS[name] is not fn:
            raise ValueError(f"model builder {name!r} is already registered by {_BUILDERS[name].__qualname__}")
        _BUILDERS[name] = fn
        return fn

    return wrap


def get_builder(name: str) -> Builder:
    """A registered builder, or the callable at import path "package.module:attr"."""
    if name in _BUILDERS:
        return _BUILDERS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise KeyError(f"model builder {name!r} cannot be imported: {exc}") from exc
        return obj
    raise KeyError(f"unknown model builder {name!r}; registered: {', '.join(sorted(_BUILDERS)) or 'none'} "
                   f"(or give an import path 'package.module:function')")


def save_pretrained(model: nn.Module, directory: str | os.PathLike, config: Mapping[str, Any] | None = None, *,
                    tokenizers: Mapping[str, Any] | None = None,
                    state_dict: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write ``model``'s weights, ``config`` (JSON-serialisable; ``"builder"`` names how to rebuild it)
    and optional tokenizers to ``directory``, atomically (write beside it, then rename).

    ``state_dict`` (keys relative to ``model``) is written instead of the module's own tensors: the full
    weights gathered from FSDP shards, whose module holds only this rank's shard."""
    from safetensors.torch import save_file, save_model

    directory = Path(directory)
    config = dict(config or {})
    for reserved in ("omni_format", "tokenizers"):
        if reserved in config:
            raise ValueError(f"config key {reserved!r} is reserved for the export format")
    payload = {"omni_format": FORMAT_VERSION, **config, "tokenizers": list(tokenizers or {})}
    try:
        text = json.dumps(payload, indent=2, sort_keys=True)
    except TypeError as exc:
        raise TypeError(f"export config must be JSON-serialisable: {exc}") from exc
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    tmp.mkdir()
    try:
        if state_dict is None:
            save_model(model, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        else:
            expected = set(model.state_dict())
            if set(state_dict) != expected:
                raise ValueError(f"state_dict keys do not match the model: missing {sorted(expected - set(state_dict))}, "
                                 f"unexpected {sorted(set(state_dict) - expected)}")
            # A gathered state dict holds tied weights once per name, as separate tensors. Store each tie
            # once under the name save_model keeps (the first in sorted order), or load_model would call
            # the other names unexpected.
            drop = set()
            for names in tied_names(model):
                names = [n for n in names if n in expected]
                for n in names[1:]:
                    if not torch.equal(state_dict[n], state_dict[names[0]]):
                        raise ValueError(f"state_dict: {n} and {names[0]} are one tied tensor in the model but "
                                         "differ in state_dict")
                drop.update(names[1:])
            # Separate, contiguous CPU copies: safetensors refuses tensors that share memory.
            tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state_dict.items() if k not in drop}
            save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        for name, tok in (tokenizers or {}).items():
            tok.save(tmp / TOKENIZERS_DIR / name)
        with open(tmp / CONFIG_NAME, "w") as f:
            f.write(text)
        write_checksums(tmp)
        fsync_tree(tmp)
        if directory.exists():  # replace an earlier export: move it aside, swap, delete
            old = directory.with_name(f".{directory.name}.old-{os.getpid()}-{time.monotonic_ns()}")
            os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, directory)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):
            kept = f"the earlier export {directory} is unchanged" if directory.exists() else "nothing was replaced"
            raise DiskFullError(errno.ENOSPC, f"disk full (no space left on device) while writing the export "
                                f"{directory} (at {getattr(exc, 'filename', None) or tmp}); the partial export was "
                                f"removed and {kept}: free space on {directory.parent} and export again") from exc
        raise
    return directory


def tied_names(model: nn.Module) -> list[list[str]]:
    """Groups (sorted) of the names under which one parameter or buffer object is registered more than once
    in ``model`` (e.g. an LM head tied to the embedding table). By object identity, not storage, so it also
    works on FSDP2 modules (DTensor parameters)."""
    groups: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(t), []).append(name)
    return [sorted(g) for g in groups.values() if len(g) > 1]


def load_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The export's config.json (FileNotFoundError explaining what ``directory`` is when it is no export)."""
    directory = Path(directory)
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(describe_non_export(directory))
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: invalid JSON or UTF-8, e.g. a truncated copy
        raise IntegrityError(f"{path} is unreadable ({exc}): the export is truncated or corrupt") from exc
    if not isinstance(config, dict):
        raise IntegrityError(f"{path} holds {type(config).__name__}, not a JSON object: not an omni export config")
    if config.get("omni_format", 0) > FORMAT_VERSION:
        raise ValueError(f"{path} has export format {config['omni_format']}; this omni reads <= {FORMAT_VERSION}")
    return config


def load_tokenizers(directory: str | os.PathLike) -> dict[str, Any]:
    """The tokenizers saved with the model, by name (empty if none)."""
    config = load_config(directory)
    names = config.get("tokenizers", [])
    if not names:
        return {}
    import omni.tokenizers  # noqa: F401  (registers the built-in tokenizers)
    from omni.tokenizers.base import Tokenizer

    return {name: Tokenizer.load(Path(directory) / TOKENIZERS_DIR / name) for name in names}


def load_pretrained(directory: str | os.PathLike, build: Builder | None = None, *,
                    device: str | torch.device = "cpu", strict: bool = True) -> nn.Module:
    """Rebuild the exported module and load its weights; returned in eval mode on ``device``. Every file is
    checked against checksums.json first (IntegrityError naming the one that differs)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    directory = Path(directory)
    if not (directory / CONFIG_NAME).is_file():
        raise FileNotFoundError(describe_non_export(directory))
    verify_checksums(directory)
    config = load_config(directory)
    if build is None:
        if not config.get("builder"):
            raise ValueError(f"{directory / CONFIG_NAME} names no 'builder'; pass build=fn(config, tokenizers)")
        build = get_builder(config["builder"])
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} is missing: the export {directory} is incomplete")
    model = build(config, load_tokenizers(directory))
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except SafetensorError as exc:  # its message names no file
        raise IntegrityError(f"{weights} is unreadable ({exc}): truncated or corrupt") from exc
    if strict and (missing or unexpected):
        raise RuntimeError(f"{weights} does not match the rebuilt model: missing {sorted(missing)}, "
                           f"unexpected {sorted(unexpected)}")
    return model.to(device).eval()


def resolve_export_dir(path: str | os.PathLike) -> Path:
    """The export directory ``path`` names: an export itself, or a training run's output directory (its
    ``final/``). Anything else, a checkpoint of a run included (optimizer and RNG state, not an export),
    raises FileNotFoundError saying what ``path`` is and where its export is."""
    path = Path(path)
    for candidate in (path, path / RUN_EXPORT_DIR):
        if (candidate / CONFIG_NAME).is_file():
            return candidate
    raise FileNotFoundError(describe_non_export(path))


def describe_non_export(path: Path) -> str:
    """Why ``path`` (which has no config.json) is not an export, and where the export is if there is one."""
    if not path.exists():
        return f"{path} does not exist"
    if not path.is_dir():
        return f"{path} is a file; an export is a directory (config.json + {WEIGHTS_NAME})"
    if (path / CHECKPOINT_MARKER).is_file() or path.parent.name == RUN_CHECKPOINT_DIR:
        return (f"{path} is a training checkpoint (optimizer, RNG and data state for resuming), not an export; "
                + _run_export_hint(path.parent.parent))
    if (path / RUN_CHECKPOINT_DIR).is_dir() or (path / RUN_EXPORT_DIR).exists():
        return f"{path} is a run directory; " + _run_export_hint(path)
    return f"{path / CONFIG_NAME} not found: not an omni export directory (see omni.export.save_pretrained)"


def _run_export_hint(run: Path) -> str:
    final = run / RUN_EXPORT_DIR
    if (final / CONFIG_NAME).is_file():
        return f"its export is {final}"
    if final.exists():
        return f"its export {final} has no {CONFIG_NAME}: incomplete or corrupt"
    return f"the run {run} has no export yet ({final} is missing: it has not finished, or ran with export=False)"


# ----------------------------------------------------------------------------------------------------
# Files: atomic JSON, checksums, fsync, disk full


def write_checksums(directory: Path) -> None:
    """Record the size and sha256 of every file below ``directory`` in ``directory/checksums.json``
    (atomically). Call it once every other file is written: files added later are not covered."""
    files = {p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(directory.rglob("*")) if p.is_file() and p != directory / CHECKSUMS_NAME}
    write_json(directory / CHECKSUMS_NAME, {"algorithm": "sha256", "files": files})


def verify_checksums(directory: str | os.PathLike) -> bool:
    """Check every file recorded in ``directory/checksums.json``: IntegrityError naming each one that is
    missing, has another size (truncated) or another sha256. False when there is no such file (written
    before checksums existed: nothing to check)."""
    directory = Path(directory)
    manifest = directory / CHECKSUMS_NAME
    if not manifest.is_file():
        return False
    try:
        files = json.loads(manifest.read_text())["files"]
        problems = [p for p in (_file_problem(directory / rel, rec["bytes"], rec["sha256"])
                                for rel, rec in sorted(files.items())) if p]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise IntegrityError(f"{manifest} is unreadable ({exc!r}): cannot verify {directory}") from exc
    if problems:
        raise IntegrityError(f"{directory} is corrupt: " + "; ".join(problems))
    return True


def _file_problem(path: Path, size: int, sha256: str) -> str | None:
    if not path.is_file():
        return f"{path} is missing"
    try:
        actual = path.stat().st_size
        if actual != size:
            return f"{path} has {actual} bytes where {size} were written (truncated or overwritten)"
        if sha256_file(path) != sha256:
            return f"{path} differs from the sha256 recorded when it was written (corrupted)"
    except OSError as exc:
        return f"{path} is unreadable ({exc})"
    return None


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC anywhere in the exception's chain (torch.save and safetensors wrap the OSError in their own)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(seen) or "StorageFull" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def fsync_tree(directory: Path) -> None:
    """Flush every file below ``directory``, then the directory itself."""
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(directory)


# ----------------------------------------------------------------------------------------------------
# The built-in builder: an OmniModel from tokenizers + trunk + heads


@register_builder("omni")
def build_omni_model(config: dict[str, Any], tokenizers: dict[str, Any]) -> nn.Module:
    """OmniModel from ``config["trunk"]`` (TrunkConfig fields, or ``{"preset": name, **overrides}``) and
    ``config["heads"]`` = {name: head spec}, each rebuilt by ``omni.heads.build_head`` (the registered types and
    their options are listed there; ``d_model`` comes from the trunk)."""
    from omni.heads import build_head
    from omni.model import OmniModel
    from omni.trunk import TrunkConfig, preset

    trunk_spec = dict(config.get("trunk", {}))
    trunk = preset(trunk_spec.pop("preset"), **trunk_spec) if "preset" in trunk_spec else TrunkConfig(**trunk_spec)
    model = OmniModel(tokenizers, trunk)
    for name, spec in config.get("heads", {}).items():
        model.heads[name] = build_head(spec, trunk.d_model, model.embedders, name)
    return model


__all__ = ["DiskFullError", "IntegrityError", "build_omni_model", "get_builder", "load_config", "load_pretrained",
           "load_tokenizers", "register_builder", "resolve_export_dir", "save_pretrained", "tied_names",
           "verify_checksums", "write_checksums"]
