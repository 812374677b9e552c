"""A new modality is one file: the example time-series tokenizer (examples/timeseries_plugin) is
installed into a temporary site directory as a distribution with an `omni.tokenizers` entry point —
exactly what `pip install examples/timeseries_plugin` writes — and then found by name, packed beside a
built-in modality and trained, with no change inside omni."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from omni.heads import ClassificationHead
from omni.model import OmniModel
from omni.packing import Packer
from omni.segment import Sample
from omni.tokenizers import Tokenizer, available_tokenizers, build_tokenizer, get_tokenizer
from omni.trunk import TrunkConfig


def test_builtins_registered():
    assert {"text", "image", "audio", "trajectory"} <= set(available_tokenizers())


def test_unknown_tokenizer_name_lists_available():
    with pytest.raises(KeyError, match="unknown tokenizer 'video'.*available: .*image"):
        get_tokenizer("video")


def series(label: int, rng: np.random.Generator, n: int) -> np.ndarray:
    """Class 0: slow sine (period 32), class 1: fast sine (period 6); random phase, noise."""
    t = np.arange(n)
    wave = np.sin(2 * np.pi * t / [32, 6][label] + rng.uniform(0, 2 * np.pi))
    return (wave + 0.1 * rng.standard_normal(n)).astype(np.float32)[:, None]


def test_entry_point_plugin_trains_beside_a_builtin(installed_plugin):
    klass = get_tokenizer("timeseries")
    assert issubclass(klass, Tokenizer) and "timeseries" in available_tokenizers()
    ts = build_tokenizer("timeseries", channels=1, patch=8)
    image = build_tokenizer("image", patch_size=4, channels=1)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = OmniModel({"timeseries": ts, "image": image}, TrunkConfig(d_model=32, n_layers=2, n_heads=4),
                      heads={"ts": ClassificationHead(32, 2)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    packer = Packer()
    losses = []
    for step in range(30):
        samples = []
        for i in range(8):
            label = int(rng.integers(2))
            x = series(label, rng, int(rng.integers(48, 97)))
            segments = [ts.encode(x, key=f"ts{step}-{i}")]
            if i % 2:  # every other sample also carries an image: mixed modalities in one packed batch
                segments.insert(0, image.encode(torch.rand(1, 8, 8), key=f"img{step}-{i}"))
            samples.append(Sample(segments, key=f"{step}-{i}", label=label))
        batch = packer(samples)
        hidden = model(batch)
        logits = model.forward_head(hidden, batch, "ts", "timeseries")
        target = torch.tensor([batch.labels[d] for d in batch.segment_document["timeseries"].tolist()])
        loss = F.cross_entropy(logits, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.mean(losses[-5:]) < 0.2 * np.mean(losses[:5]), losses


def test_plugin_bad_input_and_save_load(installed_plugin, tmp_path):
    ts = build_tokenizer("timeseries", channels=2, patch=4)
    with pytest.raises(ValueError, match="'odd'.*expected a \\(steps, 2\\)"):
        ts.encode(np.zeros((10, 3)), key="odd")
    ts.save(tmp_path / "ts")
    again = Tokenizer.load(tmp_path / "ts")
    assert type(again).__name__ == "TimeSeriesTokenizer" and again.config() == ts.config()
