"""The ViT recipe end to end on CPU: shards built from (synthetic) IDX files, the tiny preset trains and
its loss falls, the export loads with no training code, and `omni predict` reads odd images."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import write_idx_gz

from omni.cli import main as omni_main
from omni.data.builders_vision import build_fashion_mnist
from omni.export import load_pretrained

ROOT = Path(__file__).resolve().parents[1]


def load_recipe():
    spec = importlib.util.spec_from_file_location("vit_recipe", ROOT / "recipes" / "vit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic_images(n: int, rng: np.random.Generator, labels: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Class c = a bright bar in row band c (learnable in a few dozen steps), plus noise."""
    labels = rng.integers(0, 10, n) if labels is None else labels
    images = rng.integers(0, 60, (n, 28, 28))
    for i, c in enumerate(labels):
        top = 1 + int(c) * 26 // 10
        images[i, top:top + 3, 2:26] = 255
    return images.astype(np.uint8), labels.astype(np.uint8)


def exemplar(c: int) -> np.ndarray:
    return synthetic_images(1, np.random.default_rng(100 + c), np.array([c]))[0][0]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("fmnist")
    idx = root / "idx"
    idx.mkdir()
    rng = np.random.default_rng(0)
    test_set = None
    for prefix, n in (("train", 2048), ("t10k", 512)):
        images, labels = synthetic_images(n, rng)
        write_idx_gz(idx / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx_gz(idx / f"{prefix}-labels-idx1-ubyte.gz", labels)
        test_set = (images, labels)
    build_fashion_mnist(root / "shards", source=idx, quiet=True)
    return root / "shards", test_set


@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    recipe = load_recipe()
    metrics = recipe.main(["--preset", "tiny", "--data", str(dataset[0]), "--out", str(out),
                           "--set", "progress=False", "workers=0", "steps=60", "lr=0.005", "pad=0",
                           "limit_train=None", "limit_eval=None"])
    return out, metrics


def test_tiny_preset_learns(trained):
    out, metrics = trained
    # synthetic classes are coded by bar position, so translation is off (pad=0); chance is 10% accuracy / loss ln(10) = 2.30
    assert metrics["eval/loss"] < 1.5, metrics
    assert metrics["eval/accuracy"] > 0.6, metrics
    assert (out / "final" / "model.safetensors").is_file()


def test_export_loads_without_training_code(trained, dataset):
    """The exported model, rebuilt from config.json alone, reproduces the run's test accuracy."""
    out, metrics = trained
    model = load_pretrained(out / "final")
    images, labels = dataset[1]
    with torch.no_grad():
        pred = model(torch.from_numpy(images)[:, None]).argmax(-1)
    accuracy = (pred == torch.from_numpy(labels).long()).float().mean().item()
    assert accuracy == pytest.approx(metrics["eval/accuracy"], abs=1e-6)


def test_trunk_without_biases(dataset, tmp_path):
    """`trunk_overrides={'bias': False}` (the faster ViT-B/16 option in benchmarks/results.md) reaches the trunk:
    no Linear or LayerNorm in it has a bias, it learns, and the export rebuilds the same bias-free model."""
    recipe = load_recipe()
    metrics = recipe.main(["--preset", "tiny", "--data", str(dataset[0]), "--out", str(tmp_path), "--set",
                           "progress=False", "workers=0", "steps=60", "lr=0.005", "pad=0", "limit_train=None",
                           "limit_eval=None", "trunk_overrides={'bias': False}"])
    assert metrics["eval/accuracy"] > 0.6, metrics
    model = load_pretrained(tmp_path / "final")
    names = [name for name, _ in model.trunk.named_parameters()]
    assert names and not any(name.endswith("bias") for name in names), names
    assert any(name.endswith("mlp.up.weight") for name in names)


def save(img: Image.Image, path: Path, fmt: str) -> Path:
    img.save(path, format=fmt)
    return path


def test_predict_cli_on_odd_images(trained, tmp_path, capsys):
    out, _ = trained
    bar = exemplar(0)
    files = [
        save(Image.fromarray(bar), tmp_path / "gray.png", "PNG"),
        save(Image.fromarray(np.stack([bar] * 3, -1)).resize((300, 200)), tmp_path / "rgb.jpg", "JPEG"),
        save(Image.fromarray(np.stack([bar] * 3 + [np.full_like(bar, 255)], -1)), tmp_path / "rgba.png", "PNG"),
        save(Image.fromarray(bar).convert("P"), tmp_path / "palette.png", "PNG"),
        save(Image.fromarray(bar[:13, :]).resize((57, 13)), tmp_path / "tiny.png", "PNG"),
    ]
    assert omni_main(["predict", "--checkpoint", str(out / "final"), "--top-k", "3", *map(str, files)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(files)
    names = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
    for line, f in zip(lines, files):
        assert line.startswith(f"{f}: ")
        top = line.split(": ", 1)[1].split(", ")
        assert len(top) == 3 and all(any(t.startswith(n + " ") for n in names) for t in top)
    # gray, RGBA (opaque) and palette files hold the same pixels: same top-1 as the model on the array
    with torch.no_grad():
        expected = names[load_pretrained(out / "final")(torch.from_numpy(bar)[None, None]).argmax(-1).item()]
    for i in (0, 2, 3):
        assert lines[i].split(": ", 1)[1].startswith(expected + " ")


def test_predict_cli_unreadable_file(trained, tmp_path, capsys):
    out, _ = trained
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    assert omni_main(["predict", "--checkpoint", str(out / "final"), str(bad)]) == 2
    err = capsys.readouterr().err
    assert "broken.png" in err and "cannot read as an image" in err
    assert omni_main(["predict", "--checkpoint", str(out / "final"), str(tmp_path / "missing.png")]) == 2
    assert "missing.png" in capsys.readouterr().err


def test_recipe_runs_on_two_processes(dataset, tmp_path):
    """`torchrun --nproc-per-node 2 recipes/vit.py` (gloo on CPU; what `accelerate launch` does on GPUs):
    the ranks split the data (half the batches per epoch each), only the main process reports/exports."""
    import sys

    from _launch import gloo_env, run_group

    env = gloo_env(ACCELERATE_USE_CPU="1")
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "recipes" / "vit.py"), "--preset", "tiny", "--data", str(dataset[0]), "--out", str(out),
           "--set", "progress=False", "workers=0", "steps=6", "limit_train=None", "limit_eval=None"]
    proc = run_group(cmd, env, 180, "two-process recipe run")
    stdout, stderr = proc.stdout, proc.stderr
    assert proc.returncode == 0, stderr[-3000:]
    starts = [line for line in stdout.splitlines() if line.startswith("ViT preset tiny")]
    assert len(starts) == 1, stdout  # main process only
    assert "(16 per epoch)" in starts[0]  # 2048 samples / 2 ranks / batch 64
    assert (out / "final" / "model.safetensors").is_file()
