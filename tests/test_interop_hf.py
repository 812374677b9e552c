"""The "hf" converter: dispatch on config.json model_type, and HF directories written whole or not at all."""

from __future__ import annotations

import json

import pytest
import torch

from omni.interop import ConversionError, convert
from omni.interop.hf import HF_FAMILIES, write_hf_files


def test_families_registered():
    assert {"decision_transformer", "gpt2", "vit", "whisper"} <= set(HF_FAMILIES)


def test_unsupported_model_type_names_the_supported(tmp_path):
    src = tmp_path / "bert"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConversionError, match=r"model_type 'bert' is not supported \(supported: "
                                              r"decision_transformer, gpt2, vit, whisper"):
        convert(src, tmp_path / "out", "hf")


def test_write_hf_files_is_all_or_nothing(tmp_path, monkeypatch):
    out = write_hf_files(tmp_path / "ok", {"model_type": "x"}, {"w": torch.ones(2)}, **{"extra.json": {"a": 1}})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "extra.json", "model.safetensors"]
    assert json.loads((out / "extra.json").read_text()) == {"a": 1}
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)

    import safetensors.torch

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="No space left"):
        write_hf_files(tmp_path / "empty", {"model_type": "x"}, {"w": torch.ones(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "ok"]  # no temporary left behind
    assert not any((tmp_path / "empty").iterdir())
