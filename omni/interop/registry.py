"""The converter registry and the helpers every converter shares: reading peer files (configs, state dicts,
directories), tensor checks and casts, the export reader / writer, and ``convert`` / ``to_peer`` / ``read_model``.
The converters (omni.interop.timm, hf, hf_vit, gpt2, hf_decision_transformer, whisper) import this module and
register themselves here; ``omni.interop`` imports them all."""


from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from omni.export import (CONFIG_NAME, WEIGHTS_NAME, get_builder, load_config, load_tokenizers, save_pretrained,
                         verify_checksums)

Export = tuple[dict[str, Any], dict[str, Tensor], dict[str, Any]]  # (export config, state dict, tokenizers)


class ConversionError(ValueError):
    """A checkpoint or export that cannot be converted; the message is one line saying why."""


@dataclass(frozen=True)
class Converter:
    """One peer family: ``recognises(src, options)`` says whether SRC is its checkpoint, ``read(src, **options)``
    gives it as an export in memory, ``write(export_dir, out, **options)`` writes an export in the peer's format."""

    name: str
    recognises: Callable[[Path, Mapping[str, Any]], bool]
    read: Callable[..., Export]
    write: Callable[..., Path]


CONVERTERS: dict[str, Converter] = {}


def register_converter(converter: Converter) -> Converter:
    """Make ``converter`` available to ``convert`` / ``to_peer`` / ``omni convert`` under its name."""
    if CONVERTERS.get(converter.name, converter) is not converter:
        raise ValueError(f"a converter named {converter.name!r} is already registered")
    CONVERTERS[converter.name] = converter
    return converter


def names(keys: Any, most: int = 4) -> str:
    """A few of ``keys`` (sorted) for a one-line message: "a, b, c, d and 92 more"."""
    keys = sorted(keys)
    more = f" and {len(keys) - most} more" if len(keys) > most else ""
    return ", ".join(keys[:most]) + more if keys else "none"


def check_tensors(tensors: Mapping[str, Tensor], expected: Mapping[str, torch.Size], what: str) -> None:
    """ConversionError naming the first tensor whose shape differs from ``expected``, then the missing and unexpected
    names; ``what`` is what the tensors should be ("a vit_base_patch16_224 state dict")."""
    for key in sorted(set(tensors) & set(expected)):
        if tensors[key].shape != expected[key]:
            raise ConversionError(f"{key}: shape {tuple(tensors[key].shape)}, {what} has {tuple(expected[key])}")
    if set(tensors) != set(expected):
        raise ConversionError(f"not {what}: missing {names(set(expected) - set(tensors))}; "
                              f"unexpected {names(set(tensors) - set(expected))}")


def source_dtype(tensors: Mapping[str, Tensor]) -> str | None:
    """The one floating dtype of a peer checkpoint's tensors when it is not float32 ("bfloat16", "float16"), for
    the export to record (``source`` "dtype") and the way back to restore (``cast_tensors``); None for float32 or a
    mix (written back as the export holds them). Exports hold float32: bf16 and fp16 values convert exactly."""
    kinds = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(kinds) != 1 or kinds == {torch.float32}:
        return None
    return str(next(iter(kinds))).removeprefix("torch.")


def cast_tensors(tensors: Mapping[str, Tensor], dtype: str | None) -> dict[str, Tensor]:
    """``tensors`` with every floating one in ``dtype`` (a ``source_dtype`` name; None: as they are)."""
    if dtype is None:
        return dict(tensors)
    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype) or not kind.is_floating_point:
        raise ConversionError(f"the export's source dtype {dtype!r} is not a torch floating dtype")
    return {k: v.to(kind) if v.is_floating_point() else v for k, v in tensors.items()}


def get_converter(name: str) -> Converter:
    if name not in CONVERTERS:
        raise ConversionError(f"no converter for {name!r}; available: {', '.join(CONVERTERS)}")
    return CONVERTERS[name]


# ----------------------------------------------------------------------------------------------------
# Files


def is_export(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an omni export directory (its config.json names an omni_format)."""
    config = Path(path) / CONFIG_NAME
    try:
        return config.is_file() and "omni_format" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
    """config.json of a checkpoint directory as a dict; ConversionError naming the file when it is missing,
    unreadable, not JSON (with the parser's line and column) or not a JSON object."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise ConversionError(f"{path} not found")
    try:
        settings = json.loads(path.read_bytes())
    except OSError as exc:
        raise ConversionError(f"{path}: cannot read it: {exc.strerror or exc}") from exc
    except ValueError as exc:  # JSONDecodeError: "Expecting value: line 3 column 5 (char 17)"; UnicodeDecodeError
        raise ConversionError(f"{path} is not JSON: {' '.join(str(exc).split())}") from exc
    if not isinstance(settings, dict):
        raise ConversionError(f"{path} is not a JSON object (it holds a {type(settings).__name__})")
    return settings


def read_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """The tensors of a ``.safetensors`` file, or of a torch pickle (``.pt`` / ``.pth`` / ``.bin``) read with
    ``torch.load(weights_only=True)``; a checkpoint that wraps them in {"state_dict" | "model": ...} is unwrapped."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path} does not exist" if not path.exists() else f"{path} is not a file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors: Any = load_file(str(path))
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors, pickle and zip errors have no common base
        raise ConversionError(f"{path}: cannot read a state dict: {' '.join(str(exc).split())}") from exc
    for key in ("state_dict", "model"):
        if isinstance(tensors, dict) and isinstance(tensors.get(key), dict):
            tensors = tensors[key]
    if not isinstance(tensors, dict) or not all(isinstance(v, Tensor) for v in tensors.values()):
        raise ConversionError(f"{path} holds no state dict (a mapping of names to tensors)")
    return tensors


def read_directory(directory: str | os.PathLike) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(state dict, config) of a Hugging Face hub style directory: config.json + model.safetensors or
    pytorch_model.bin."""
    directory = Path(directory)
    settings = read_config(directory)
    weights = [directory / name for name in (WEIGHTS_NAME, "pytorch_model.bin") if (directory / name).is_file()]
    if weights:
        return read_state_dict(weights[0]), settings
    raise ConversionError(f"{directory} has neither {WEIGHTS_NAME} nor pytorch_model.bin")


def read_export(directory: str | os.PathLike) -> Export:
    """An omni export as (config, state dict, tokenizers), its files checked against checksums.json."""
    from safetensors.torch import load_file

    verify_checksums(directory)
    return load_config(directory), load_file(str(Path(directory) / WEIGHTS_NAME)), load_tokenizers(directory)


def write_export(export: Export, out: str | os.PathLike) -> Path:
    """Build the model ``export``'s config describes, load its state dict (strict: a missing, unexpected or
    misshapen tensor is named) and save it at ``out`` (``omni.export.save_pretrained``)."""
    config, state_dict, tokenizers = export
    model = get_builder(config["builder"])(config, tokenizers)
    check_tensors(state_dict, {k: v.shape for k, v in model.state_dict().items()}, "the model's state dict")
    model.load_state_dict(state_dict, strict=True)
    return save_pretrained(model, out, {k: v for k, v in config.items() if k != "omni_format"}, tokenizers=tokenizers)


def fresh_output(out: str | os.PathLike) -> Path:
    """``out`` as a place to write to: refused when it exists and is not empty (nothing is overwritten)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"{out} exists and is not empty: choose a new output directory")
    return out


# ----------------------------------------------------------------------------------------------------
# The API


def _options(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if v is not None}


def find_converter(src: str | os.PathLike, **options: Any) -> Converter:
    """The converter that recognises ``src`` (a checkpoint directory or file)."""
    for converter in CONVERTERS.values():
        if converter.recognises(Path(src), _options(options)):
            return converter
    if not Path(src).exists():
        raise ConversionError(f"{src} does not exist")
    if (Path(src) / CONFIG_NAME).is_file():
        read_config(src)  # a config.json that is not JSON (or no object) says so, rather than "not recognised"
    raise ConversionError(f"{src}: not a checkpoint any converter recognises ({', '.join(CONVERTERS)}); "
                          "name its library with --from (timm, hf), or its timm architecture with --arch")


def read_model(src: str | os.PathLike, peer: str | None = None, **options: Any) -> Export:
    """An omni export directory as it is, or a peer checkpoint converted (by ``peer``, default the converter that
    recognises it), as (export config, state dict, tokenizers)."""
    if peer is None and is_export(src):
        return read_export(src)
    converter = get_converter(peer) if peer else find_converter(src, **options)
    return converter.read(Path(src), **_options(options))


def convert(src: str | os.PathLike, out: str | os.PathLike, peer: str | None = None, **options: Any) -> Path:
    """Write the peer checkpoint ``src`` as an omni export at ``out`` (a new directory); -> ``out``."""
    if is_export(src):
        raise ConversionError(f"{src} is already an omni export (to write a peer's format: --to PEER)")
    return write_export(read_model(src, peer, **options), fresh_output(out))


def to_peer(export: str | os.PathLike, out: str | os.PathLike, peer: str, **options: Any) -> Path:
    """Write the omni export ``export`` in ``peer``'s format at ``out`` (a new directory); -> ``out``."""
    if not is_export(export):
        raise ConversionError(f"{export} is not an omni export directory (no {CONFIG_NAME} with an omni_format)")
    return get_converter(peer).write(Path(export), fresh_output(out), **_options(options))


__all__ = ["CONVERTERS", "ConversionError", "Converter", "Export", "cast_tensors", "check_tensors", "convert",
           "find_converter", "fresh_output", "get_converter", "is_export", "names", "read_config", "read_directory",
           "read_export", "read_model", "read_state_dict", "register_converter", "source_dtype", "to_peer",
           "write_export"]
