"""``omni convert --from hf`` / ``--to hf``: Hugging Face directories, one family per ``model_type``.

A Hugging Face checkpoint directory says what it is in config.json ``model_type``; each family module
(hf_decision_transformer, whisper, gpt2, ...) registers an ``HFFamily`` for its model type, and this one
converter named "hf" reads a directory with the family its config names, and writes an export back with the
family whose export builders include the export's ``builder`` and, where a family gives one, whose ``accepts``
takes the export's config (the generic "omni" builder makes many kinds of model: GPT-2 takes text LMs only).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from torch import Tensor

from omni.export import CONFIG_NAME, WEIGHTS_NAME
from omni.files import fsync_dir, write_json
from omni.interop.registry import ConversionError, Converter, Export, read_config, register_converter


@dataclass(frozen=True)
class HFFamily:
    """``read(src_dir, **options) -> Export``; ``write(export_dir, out_dir, **options) -> out_dir``;
    ``builders``: the export builders (config.json "builder") this family writes back; ``accepts(config)``: whether
    it writes back this export (config.json), for a builder that makes other models too (None: every one)."""

    model_type: str
    read: Callable[..., Export]
    write: Callable[..., Path]
    builders: tuple[str, ...]
    accepts: Callable[[Mapping[str, Any]], bool] | None = None


HF_FAMILIES: dict[str, HFFamily] = {}


def register_hf_family(family: HFFamily) -> HFFamily:
    if HF_FAMILIES.get(family.model_type, family) is not family:
        raise ValueError(f"a Hugging Face family for model_type {family.model_type!r} is already registered")
    HF_FAMILIES[family.model_type] = family
    return family


def model_type(src: Path) -> str | None:
    """config.json ``model_type`` of a directory (None when it has none or is not a directory)."""
    try:
        value = json.loads((Path(src) / CONFIG_NAME).read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def write_hf_files(out: str | os.PathLike, config: Mapping[str, Any], tensors: Mapping[str, Tensor],
                   **json_files: Mapping[str, Any]) -> Path:
    """A Hugging Face directory at ``out`` (new, or empty): config.json, model.safetensors and ``json_files``
    (file name -> content, e.g. preprocessor_config.json). Written in a sibling temporary directory and renamed into
    place, so a failure (a full disk) leaves no half-written checkpoint."""
    from safetensors.torch import save_file

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(dict(tensors), str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        for name, content in {CONFIG_NAME: config, **json_files}.items():
            write_json(tmp / name, content)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        os.replace(tmp, out)  # onto a missing or empty directory (fresh_output refused anything else)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out.parent)
    return out


def _supported() -> str:
    return ", ".join(sorted(HF_FAMILIES))


def recognises(src: Path, options: Mapping[str, Any]) -> bool:
    return model_type(src) in HF_FAMILIES


def read_hf(src: Path, **options: Any) -> Export:
    if not Path(src).is_dir():
        raise ConversionError(f"{src} does not exist" if not Path(src).exists() else
                              f"{src} is a file; a Hugging Face checkpoint is a directory (config.json + weights)")
    settings = read_config(src)  # a missing config.json, or one that is not JSON, named as such
    kind = settings.get("model_type")
    if kind is None:
        what = " (a timm checkpoint: --from timm)" if "architecture" in settings else ""
        raise ConversionError(f"{src / CONFIG_NAME}: no model_type; not a Hugging Face model directory{what}")
    if not isinstance(kind, str):
        raise ConversionError(f"{src / CONFIG_NAME}: model_type {kind!r} is not a string")
    if kind not in HF_FAMILIES:
        raise ConversionError(f"{src}: Hugging Face model_type {kind!r} is not supported (supported: {_supported()})")
    return HF_FAMILIES[kind].read(src, **options)


def write_hf(export: Path, out: Path, **options: Any) -> Path:
    try:
        config = json.loads((export / CONFIG_NAME).read_text())
        builder = config.get("builder")
    except (OSError, ValueError, AttributeError) as exc:
        raise ConversionError(f"{export / CONFIG_NAME}: cannot read the export's config: {exc}") from exc
    for family in HF_FAMILIES.values():
        if builder in family.builders and (family.accepts is None or family.accepts(config)):
            return family.write(export, out, **options)
    raise ConversionError(f"{export}: a {builder!r} model has no Hugging Face counterpart here "
                          f"(supported model types: {_supported()})")


register_converter(Converter("hf", recognises, read_hf, write_hf))
