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
an OmniModel from trunk + head specs), or an import path "package.module:function" into omni or into a
module the program has imported itself: loading never imports a module a config names (``get_builder``).
Or pass ``build=`` explicitly.

The whole directory is written next to its destination and renamed into place, so a crash never leaves
a half-written export under the final name. Its last file, ``checksums.json``, records the size and sha256
of every other file; ``load_pretrained`` checks them and names the file that differs (flipped bytes, a
truncated copy), so a damaged export never loads silently. model.safetensors' metadata records that the export
has checksums (``CHECKSUMS_KEY``), so one whose checksums.json was lost or deleted is refused too; exports
written before checksums existed, and hand-made folders, carry neither and load unchecked. Training
checkpoints carry the same file, promised by their COMPLETE marker (omni.train).

``resolve_export_dir`` turns what a user points at (an export, a run's output directory, a checkpoint)
into the export directory, or says what the path is and where its export lives.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import shutil
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from omni.files import DiskFullError, NotWritableError, fsync_dir, sha256_file, write_json

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
# Where a folder says it was written with checksums.json, so a copy that lost it (or a deleted one) is refused
# instead of loading unchecked: a key of model.safetensors' header metadata (exports), or of the checkpoint's
# COMPLETE marker / trainer_state.json. Hand-made folders and exports from before checksums carry none.
CHECKSUMS_KEY = "omni_checksums"
_WEIGHTS_METADATA = {"format": "pt", CHECKSUMS_KEY: CHECKSUMS_NAME}


class IntegrityError(ValueError):
    """A file of an export or a checkpoint is missing, truncated, unreadable or differs from its recorded sha256."""


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
    """A registered builder, or the function at import path "package.module:function" in a module this
    program has already imported itself (or one of omni's own). An export names its builder, so following any
    import path would run whatever module a downloaded config.json names: that is refused (KeyError saying how
    to trust it: import the module, register the builder, or pass ``build=``)."""
    if name in _BUILDERS:
        return _BUILDERS[name]
    if not isinstance(name, str):
        raise KeyError(f"model builder {name!r} is not a name (a registered builder or 'package.module:function')")
    if ":" in name:
        module, _, attr = name.partition(":")
        own = module == "omni" or module.startswith("omni.")
        top = module.split(".", 1)[0]
        if not own and (module not in sys.modules or top in sys.stdlib_module_names or top == "builtins"):
            raise KeyError(f"model builder {name!r}: the module {module!r} is not imported here, and loading an "
                           "export imports no module its config names (that would run its code); import it "
                           "yourself first if you trust it, register the builder with @omni.export.register_builder,"
                           " or pass build=fn(config, tokenizers)")
        try:
            obj: Any = importlib.import_module(module)  # omni's own, or already imported: runs nothing new
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise KeyError(f"model builder {name!r} cannot be imported: {exc}") from exc
        if not isinstance(obj, types.FunctionType) or not (obj.__module__ == module or own):
            raise KeyError(f"model builder {name!r} is not a function defined in {module!r} "
                           f"({type(obj).__name__} from {getattr(obj, '__module__', None)!r})")
        return obj
    raise KeyError(f"unknown model builder {name!r}; registered: {', '.join(sorted(_BUILDERS)) or 'none'} "
                   f"(or give an import path 'package.module:function' of a module the program imported)")


def save_pretrained(model: nn.Module, directory: str | os.PathLike, config: Mapping[str, Any] | None = None, *,
                    tokenizers: Mapping[str, Any] | None = None,
                    state_dict: Mapping[str, torch.Tensor] | None = None, rescue: bool = False) -> Path:
    """Write ``model``'s weights, ``config`` (JSON-serialisable; ``"builder"`` names how to rebuild it)
    and optional tokenizers to ``directory``, atomically (write beside it, then rename).

    ``state_dict`` (keys relative to ``model``) is written instead of the module's own tensors: the full
    weights gathered from FSDP shards, whose module holds only this rank's shard.

    A full disk raises ``DiskFullError`` (the partial export removed, an earlier one unchanged), saying how much
    the export needs and how much is free; a folder that cannot be written raises ``NotWritableError`` naming
    it. With ``rescue`` (a trainer's final export, whose weights exist nowhere else), a full disk first writes
    the export to the temp folder or the home folder when one is on another file system with room, and the
    error says where it went."""
    try:
        return _save_pretrained(model, Path(directory), config, tokenizers, state_dict)
    except DiskFullError as exc:
        if not rescue:
            raise
        raise DiskFullError(errno.ENOSPC, f"{exc.strerror}; {_rescue(model, Path(directory), config, tokenizers, state_dict)}") from exc


def _weights_bytes(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None) -> int:
    tensors = state_dict.values() if state_dict is not None else model.state_dict().values()
    return sum(t.numel() * t.element_size() for t in tensors)


def _rescue(model: nn.Module, directory: Path, config: Mapping[str, Any] | None, tokenizers: Any,
            state_dict: Mapping[str, torch.Tensor] | None) -> str:
    """Write the export to a folder on another file system with room (temp, then home): what happened, in words."""
    need = _weights_bytes(model, state_dict) + (1 << 20)
    full = _file_system(directory)
    tried = []
    for base in _rescue_places():
        try:
            if not base.is_dir():
                continue
            if _file_system(base) == full:
                tried.append(f"{base} is on the same file system")
                continue
            if free_bytes(base) < need:
                tried.append(f"{base} has {_mib(free_bytes(base))} free")
                continue
            target = base / f"omni-rescued-{directory.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            _save_pretrained(model, target, config, tokenizers, state_dict)
        except (OSError, ValueError) as exc:
            tried.append(f"{base}: {' '.join(str(exc).split())[:120]}")
            continue
        return (f"the trained model was saved to {target} instead: move it to {directory} once there is space "
                "(it loads from there as it is)")
    return (f"no other file system had room for the trained model either ({'; '.join(tried)}): it is lost with "
            "this process unless a checkpoint holds it")


def _rescue_places() -> list[Path]:
    import tempfile

    return [Path(tempfile.gettempdir()), Path.home()]


def _file_system(path: Path) -> int:
    return os.stat(_existing(path)).st_dev


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return path


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 0 else "unknown space"


def _save_pretrained(model: nn.Module, directory: Path, config: Mapping[str, Any] | None,
                     tokenizers: Mapping[str, Any] | None, state_dict: Mapping[str, torch.Tensor] | None) -> Path:
    from safetensors.torch import save_file, save_model

    config = dict(config or {})
    for reserved in ("omni_format", "tokenizers"):
        if reserved in config:
            raise ValueError(f"config key {reserved!r} is reserved for the export format")
    payload = {"omni_format": FORMAT_VERSION, **config, "tokenizers": list(tokenizers or {})}
    try:
        text = json.dumps(payload, indent=2, sort_keys=True)
    except TypeError as exc:
        raise TypeError(f"export config must be JSON-serialisable: {exc}") from exc
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as exc:
        if (denied := not_writable(exc)) is not None:
            raise denied(exc.errno, f"cannot write the export {directory}: {_existing(directory.parent)} is not "
                         f"writable ({exc.strerror})") from exc
        raise
    try:
        if state_dict is None:
            save_model(model, str(tmp / WEIGHTS_NAME), metadata=_WEIGHTS_METADATA)
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
            save_file(tensors, str(tmp / WEIGHTS_NAME), metadata=_WEIGHTS_METADATA)
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
        full = is_disk_full(exc, directory.parent)  # before the partial export is removed
        shutil.rmtree(tmp, ignore_errors=True)
        kept = f"the earlier export {directory} is unchanged" if directory.exists() else "nothing was replaced"
        if full:
            raise DiskFullError(errno.ENOSPC, f"disk full (no space left on device) while writing the export "
                                f"{directory} (at {getattr(exc, 'filename', None) or tmp}); the partial export was "
                                f"removed and {kept}: it needs about {_mib(_weights_bytes(model, state_dict))}, "
                                f"{_mib(free_bytes(directory.parent))} are free on {directory.parent}; free space "
                                "and export again") from exc
        if isinstance(exc, Exception) and (denied := not_writable(exc)) is not None:
            raise denied(errno.EACCES, f"cannot write the export {directory}: {directory.parent} is not writable "
                         f"({getattr(exc, 'strerror', None) or exc}); {kept}") from exc
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
        if (promise := checksums_promised(directory)) is not None:
            raise IntegrityError(f"{manifest} is missing, but {promise} says {directory} was written with it: its "
                                 "files cannot be verified (a copy that left it out, or it was deleted). Copy it "
                                 "back, or, if the files were changed on purpose, record them anew with "
                                 f"omni.export.write_checksums('{directory}')")
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


def checksums_promised(directory: str | os.PathLike) -> Path | None:
    """The file of ``directory`` that records it was written with checksums.json (``CHECKSUMS_KEY`` in
    model.safetensors' metadata, the COMPLETE marker or trainer_state.json of a checkpoint), or None."""
    directory = Path(directory)
    for name in (CHECKPOINT_MARKER, "trainer_state.json"):
        try:
            if CHECKSUMS_KEY in json.loads((directory / name).read_text()):
                return directory / name
        except (OSError, ValueError, TypeError):  # absent, unreadable or not a JSON object: says nothing
            pass
    weights = directory / WEIGHTS_NAME
    if weights.is_file():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(weights), framework="pt") as f:
                if CHECKSUMS_KEY in (f.metadata() or {}):
                    return weights
        except (OSError, SafetensorError):  # an unreadable header fails the load itself, naming the file
            pass
    return None


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


# torch.save's stream writer reports a failed write without an errno ("unexpected pos 576 vs 534", its
# stream "basic_ios::clear: iostream error", "PytorchStreamWriter failed writing file"): a full disk when the
# disk is (nearly) full at that moment.
_STREAM_WRITE_FAILED = ("unexpected pos", "iostream error", "PytorchStreamWriter failed", "file write failed")
LOW_SPACE = 64 * 2**20  # bytes free below which a failed write is taken for a full disk


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the file system of ``path`` (its nearest existing parent); -1 when unknown."""
    path = Path(path)
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return -1


def is_disk_full(exc: BaseException, where: str | os.PathLike | None = None) -> bool:
    """ENOSPC / EDQUOT anywhere in the exception's chain (torch.save and safetensors wrap the OSError in their
    own); with ``where`` (the folder being written), also torch's errno-less stream-writer failure while that
    file system has under ``LOW_SPACE`` free."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(seen)
        if "No space left on device" in text or "StorageFull" in text or "Disk quota exceeded" in text:
            return True
        if where is not None and any(m in text for m in _STREAM_WRITE_FAILED) and 0 <= free_bytes(where) < LOW_SPACE:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def not_writable(exc: BaseException) -> type[NotWritableError] | None:
    """``NotWritableError`` when the exception's chain holds EACCES / EPERM / EROFS (a read-only file system,
    a folder without write permission), else None."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return NotWritableError
        seen = seen.__cause__ or seen.__context__
    return None


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


__all__ = ["DiskFullError", "IntegrityError", "NotWritableError", "free_bytes", "is_disk_full", "not_writable", "build_omni_model", "get_builder", "load_config", "load_pretrained",
           "load_tokenizers", "register_builder", "checksums_promised", "resolve_export_dir", "save_pretrained", "tied_names",
           "verify_checksums", "write_checksums"]
