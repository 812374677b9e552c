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
from omni.pipelines.predict import image_classifier

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: 2 torch threads on 2 busy cores ran 5x slower


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


def test_convolutional_stem(dataset, tmp_path):
    """`stem=[...]` puts a ConvStem before the trunk: it learns (with optimizer=muon, as the CPU default
    fmnist-cpu trains it: Muon on the trunk's matrices, AdamW on the stem's kernels), the export rebuilds the stem,
    and omni predict reads an image file through it as the recipe's evaluation does."""
    from omni.optimizers import muon_parameters

    recipe = load_recipe()
    cpu = recipe.parse_args(["--preset", "fmnist-cpu"])
    assert (cpu["optimizer"], cpu["stem"]) == ("muon", [16, 32, 64, 64])
    metrics = recipe.main(["--preset", "tiny", "--data", str(dataset[0]), "--out", str(tmp_path), "--set",
                           "progress=False", "workers=0", "steps=60", "lr=0.005", "pad=0", "limit_train=None",
                           "limit_eval=None", "stem=[8,16]", "optimizer=muon"])
    assert metrics["eval/accuracy"] > 0.6, metrics
    model = load_pretrained(tmp_path / "final")
    ids = muon_parameters(model)
    assert {n for n, p in model.named_parameters() if id(p) in ids} == {
        f"trunk.blocks.{i}.{m}.weight" for i in range(model.trunk.cfg.n_layers)
        for m in ("attn.qkv", "attn.out", "mlp.up", "mlp.down")}  # stem kernels, patch projection, head: AdamW
    assert model.stem is not None and model.stem.channels == [8, 16]
    images = dataset[1][0][:8]
    files = [save(Image.fromarray(img), tmp_path / f"{i}.png", "PNG") for i, img in enumerate(images)]
    with torch.no_grad():
        direct = model(torch.from_numpy(np.stack(images))[:, None]).softmax(-1)
    classify, tokenizer, _, _, _ = image_classifier(tmp_path / "final", "cpu")
    with torch.no_grad():
        read = torch.stack([classify(tokenizer.encode(f)).softmax(-1) for f in files])
    torch.testing.assert_close(read, direct, rtol=1e-4, atol=1e-5)


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


def eval_history(out: Path) -> dict[int, tuple[float, float]]:
    """Every evaluation of a run: step -> (eval/accuracy, eval/loss), from <out>/history.jsonl."""
    import json

    rows = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    return {r["step"]: (r["eval/accuracy"], r["eval/loss"]) for r in rows if "eval/accuracy" in r}


def test_eval_metrics_do_not_depend_on_hooks_or_resume(dataset, tmp_path, monkeypatch):
    """The sample-picture hook shows the first eval batch without moving the eval loader: every evaluation
    scores all 4 eval batches, with or without hooks, and a run stopped at step 3 and resumed scores at step 4 what
    an uninterrupted run does (its hook's first read comes after the resume). Before, the hook's read cut the
    straight run's second evaluation to 3 of 4 batches (0.3164 where the same weights score 0.3281), and the
    resumed run's final accuracy was another than the straight run's."""
    import os
    import signal

    import omni.plots
    from omni.train import Trainer, TrainingInterrupted

    drawn = []  # the hook's pictures, cheaply (matplotlib takes seconds): the images it was given
    monkeypatch.setattr(omni.plots, "image_grid", lambda images, *a, **kw: drawn.append(images.clone())
                        or np.zeros((2, 2, 3), np.uint8))
    monkeypatch.setattr(omni.plots, "attention_grid", lambda *a, **kw: np.zeros((2, 2, 3), np.uint8))
    monkeypatch.setattr(omni.plots, "training_curves", lambda *a, **kw: None)
    recipe = load_recipe()

    def run(out: Path) -> dict:
        return recipe.main(["--preset", "tiny", "--data", str(dataset[0]), "--out", str(out), "--set",
                            "progress=False", "workers=0", "steps=4", "limit_train=256", "limit_eval=256",
                            "eval_every_epochs=0.5", "pad=0"])  # 4 steps per epoch: evaluations at steps 2 and 4

    straight = run(tmp_path / "straight")
    evaluations = eval_history(tmp_path / "straight")
    assert sorted(evaluations) == [2, 4] and len(drawn) == 2  # the hook ran after each evaluation
    images = torch.from_numpy(dataset[1][0][:16])[:, None]
    assert all(torch.equal(d, images) for d in drawn)  # the first eval batch's first 16 images, both times

    with monkeypatch.context() as mp:  # no sample hook at all
        mp.setattr(recipe, "Trainer", lambda *a, **kw: Trainer(*a, **{**kw, "samples_fn": None}))
        without = run(tmp_path / "without")
    assert eval_history(tmp_path / "without") == evaluations
    assert (without["eval/accuracy"], without["eval/loss"]) == (straight["eval/accuracy"], straight["eval/loss"])

    real_step = Trainer._train_step

    def stop_at_3(self):  # a Ctrl-C during step 3: it finishes, checkpoints and stops
        record = real_step(self)
        if self.step + 1 == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return record

    with monkeypatch.context() as mp:
        mp.setattr(Trainer, "_train_step", stop_at_3)
        with pytest.raises(TrainingInterrupted):
            run(tmp_path / "resumed")
    resumed = run(tmp_path / "resumed")
    assert eval_history(tmp_path / "resumed") == evaluations
    assert (resumed["eval/accuracy"], resumed["eval/loss"]) == (straight["eval/accuracy"], straight["eval/loss"])
    # the final evaluation is the exported model's accuracy on the 256 eval images (all of them, each once)
    test_images, labels = dataset[1]
    with torch.no_grad():
        pred = load_pretrained(tmp_path / "resumed" / "final")(torch.from_numpy(test_images[:256])[:, None]).argmax(-1)
    expected = (pred == torch.from_numpy(labels[:256]).long()).float().mean().item()
    assert straight["eval/accuracy"] == pytest.approx(expected, abs=1e-6)


def test_a_run_killed_before_its_results_reports_them_on_a_rerun(dataset, tmp_path, capsys):
    """A run whose export landed but whose train_results.json did not (killed between the two, as an older
    omni wrote them in that order) is evaluated again from its final checkpoint on a re-run: the re-run reports
    the run's test accuracy (not nan) and writes the results; a further re-run just reports them."""
    recipe = load_recipe()
    args = ["--preset", "tiny", "--data", str(dataset[0]), "--out", str(tmp_path), "--set", "progress=False",
            "workers=0", "steps=4", "limit_train=256", "limit_eval=256", "checkpoint_every_epochs=1"]
    first = recipe.main(args)
    (tmp_path / "train_results.json").unlink()
    export = (tmp_path / "final" / "model.safetensors").read_bytes()
    capsys.readouterr()
    again = recipe.main(args)
    out = capsys.readouterr().out
    assert "results were not recorded: evaluating its final checkpoint" in out
    assert again["eval/accuracy"] == first["eval/accuracy"] and again["eval/loss"] == first["eval/loss"]
    assert f"test accuracy {first['eval/accuracy']:.4f}" in out and "nan" not in out
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == export  # the intact export is kept
    assert (tmp_path / "train_results.json").is_file()
    third = recipe.main(args)
    assert "already finished" in capsys.readouterr().out
    assert third["eval/accuracy"] == first["eval/accuracy"]


@pytest.mark.parametrize("sets, said", [
    (["image_size=1"], "image_size 1 must be a multiple of patch 7: images are cut into patch x patch squares"),
    (["image_size=30"], "image_size 30 must be a multiple of patch 7"),
    (["patch=5"], "image_size 28 must be a multiple of patch 5"),
    (["image_size=32", "patch=4", "resize=16"], "resize 16 must be >= image_size 32"),
    (["stem=[8,8,8,8,8]"], "stem [8, 8, 8, 8, 8]: its 4 stride-2 convolutions reduce 28 pixels to 2, fewer than the "
                           "4 patches of 7 pixels"),
    (["stem=[]"], "stem"),
    (["stem=[8,0]"], "stem"),
    (["stem=[8]", "init=runs/x"], "init brings its own architecture: set stem or init, not both"),
])
def test_image_size_patch_and_resize_that_disagree_are_one_line(sets, said, capsys):
    """Before, image_size=1 (or any size patch does not divide) went on to build the data and failed later with
    another cause; the keys are checked against each other first."""
    with pytest.raises(SystemExit) as stop:
        load_recipe().parse_args(["--preset", "tiny", "--set", *sets])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and said in err and "Traceback" not in err
    assert [line for line in err.splitlines() if "error:" in line] == [err.splitlines()[-1]]


def test_an_image_size_the_init_patch_does_not_divide_is_one_line(trained, dataset, tmp_path):
    out, _ = trained  # its export cuts 28-pixel images into 7 x 7 patches
    with pytest.raises(ValueError, match=r"image_size 30 must be a multiple of the patch 7 of init .*final: images are "
                                         r"cut into patch x patch squares \(the nearest that fit: 28 or 35\)"):
        load_recipe().main(["--preset", "tiny", "--data", str(dataset[0]), "--out", str(tmp_path), "--set",
                            f"init={str(out / 'final')!r}", "image_size=30", "patch=5"])


def test_the_export_records_what_its_training_images_look_like(trained, dataset):
    """image_domain (omni predict compares photos with it): the border and mean of the first eval batch's pixels,
    here dark noise (0..59) with a bright bar inside the border."""
    import json

    out, _ = trained
    domain = json.loads((out / "final" / "config.json").read_text())["image_domain"]
    images = torch.from_numpy(dataset[1][0][:64]).float() / 255
    ring = torch.cat([images[:, 0], images[:, -1], images[:, :, 0], images[:, :, -1]], dim=-1)
    assert domain["border"] == pytest.approx(float(ring.mean()), abs=0.02) and domain["border"] < 0.2
    assert domain["border"] < domain["mean"] < 0.5
