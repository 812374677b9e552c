"""Pictures (omni/plots.py and what writes them): each picture is written at its returned size and is not blank; the
Trainer keeps a resume-safe metric history and draws curves.png, logs its samples_fn's pictures, audio and text
to TensorBoard, and goes on without matplotlib; the tasks' samples hooks; the ViT recipe writes its curves and
prediction grid; the DT recipe's return plot; `omni predict --attention`. CPU, deterministic."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omni import plots
from omni.evaluation import CURVES_NAME, HISTORY_NAME, MetricHistory, read_history
from omni.plots import Clip, Note, Picture
from conftest import load_recipe

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import _train_worker as W  # noqa: E402


def png(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def assert_picture(rgb: np.ndarray, path: Path | None = None, *, min_colours: int = 8) -> None:
    """Written at the returned size, and not blank: varied pixels, several colours."""
    assert rgb.dtype == np.uint8 and rgb.ndim == 3 and rgb.shape[2] == 3
    if path is not None:
        assert np.array_equal(png(path), rgb)
    assert rgb.std() > 20, rgb.std()
    assert len(np.unique(rgb.reshape(-1, 3), axis=0)) >= min_colours


def history(steps: int = 30, evals: tuple[int, ...] = (10, 20, 30)) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for s in range(5, steps + 1, 5):
        losses = list(2.0 * np.exp(-np.arange(s - 4, s + 1) / 15) + 0.1 * rng.random(5))
        out.append({"step": s, "train/loss": float(np.mean(losses)), "train/accuracy": s / (steps + 5),
                    "train/loss_per_step": losses})
        if s in evals:
            out.append({"step": s, "eval/loss": 1.5 - s / 40, "eval/accuracy": s / (steps + 1),
                        "eval/target5/return_mean": 3.0 + s / 10, "eval/target5/return_std": 0.5, "eval/words": 40.0})
    return out


# ----------------------------------------------------------------------------------------------------
# The pictures


def test_training_curves_panels_and_size(tmp_path):
    path = tmp_path / "sub" / "curves.png"
    rgb = plots.training_curves(history(), path, title="run")
    assert_picture(rgb, path)
    assert rgb.shape == (int(3.4 * 100 + 0.4 * 100), int(3 * 4.6 * 100), 3)  # 3 panels: loss, accuracy, return
    series = plots.curve_series(history())
    assert series["train/loss_step"][0] == list(range(1, 31))  # each step's loss, for the raw curve
    assert "eval/words" in series  # counted, but not drawn (3 panels above, not 4)
    assert not list(path.parent.glob(".*tmp"))  # the temporary file was renamed into place


def test_curve_series_keeps_the_last_value_of_a_step_logged_twice():
    s = plots.curve_series([{"step": 2, "eval/x": 1.0}, {"step": 1, "eval/x": 0.5}, {"step": 2, "eval/x": 3.0}])
    assert s["eval/x"] == ([1, 2], [0.5, 3.0])


def test_ema_is_debiased_and_skips_nan():
    smoothed = plots.ema([1.0, float("nan"), 1.0, 3.0], 0.5)
    assert smoothed[0] == 1.0 and smoothed[1] == 1.0  # no pull towards zero; NaN keeps the average
    assert 1.0 < smoothed[3] < 3.0


def test_returns_plot(tmp_path):
    rows = [{"method": "dt", "target": t, "return_mean": 0.8 * t, "return_std": 20.0} for t in (250.0, 375.0, 500.0)]
    rows += [{"method": "bc", "target": None, "return_mean": 300.0, "return_std": 40.0},
             {"method": "fbc", "target": None, "return_mean": 420.0, "return_std": 30.0}]
    path = tmp_path / "returns.png"
    rgb = plots.returns_plot(rows, (20.0, 500.0), path, title="CartPole-v1")
    assert_picture(rgb, path)
    assert rgb.shape == (460, 640, 3)
    for colour in ((31, 119, 180), (44, 160, 44), (148, 103, 189)):  # dt, bc, fbc
        assert (np.abs(rgb.astype(int) - colour).sum(-1) < 30).sum() > 50, colour
    assert (np.abs(rgb.astype(int) - (214, 39, 40)).sum(-1) < 90).sum() > 50  # the random line (dashed)


def test_image_grid(tmp_path):
    images = torch.zeros(10, 1, 28, 28, dtype=torch.uint8)
    images[:, :, 8:20, 8:20] = 200  # uint8 stays 0..255: grey squares, not clipped to white
    path = tmp_path / "grid.png"
    rgb = plots.image_grid(images, list(range(10)), [0] * 10, [f"class {i}" for i in range(10)], path,
                           probabilities=[0.5] * 10)
    assert_picture(rgb, path)
    assert rgb.shape == (2 * 200 + 40, 8 * 155, 3)
    assert (np.abs(rgb.astype(int) - 200).max(-1) < 2).sum() > 10 * 100  # the squares' grey
    assert (np.abs(rgb.astype(int) - (214, 39, 40)).sum(-1) < 60).sum() > 0  # a wrong prediction, in red
    with pytest.raises(ValueError, match="as many labels"):
        plots.image_grid(images, [0], [0] * 10)


def test_attention_overlay_lines_up_with_the_patch_grid(tmp_path):
    image = np.full((28, 28), 0.5, np.float32)
    heat = np.zeros((4, 4))
    pictures = []
    for cell in ((0, 0), (3, 3)):
        h = heat.copy()
        h[cell] = 1.0
        path = tmp_path / f"{cell[0]}.png"
        pictures.append(plots.attention_overlay(image, h, [("Sneaker", 0.9), ("Sandal", 0.05)], path, patch_size=7))
        assert_picture(pictures[-1], path)
    a, b = pictures
    assert a.shape == (390, 740, 3)
    rows, cols = np.nonzero((a != b).any(-1))
    assert cols.min() > 0.45 * a.shape[1]  # only the heat-map panel differs: the input panel is the plain image
    left = a[:, : int(0.45 * a.shape[1])]
    grey = (np.abs(left.astype(int) - 128).max(-1) < 2).sum()
    assert grey > 100 * 100  # the input, unchanged (0.5 grey)
    # the hot cell: top-left patch in a, bottom-right in b; it is brighter than the cold one at the same place
    r, c = rows.min(), cols.min()
    assert a[r + 5, c + 5].astype(int).sum() > b[r + 5, c + 5].astype(int).sum()
    with pytest.raises(ValueError, match="patch-grid map"):
        plots.attention_overlay(image, np.zeros(16))


def test_spectrogram(tmp_path):
    mel = torch.linspace(-1, 1, 80).expand(100, 80) + 0.1 * torch.randn(100, 80, generator=torch.Generator().manual_seed(0))
    rgb = plots.spectrogram(mel, tmp_path / "mel.png", title="reference: hello", frames_per_second=50)
    assert_picture(rgb, tmp_path / "mel.png")


# ----------------------------------------------------------------------------------------------------
# History, curves and samples in the Trainer


def test_history_drops_steps_after_the_resumed_checkpoint_and_torn_lines(tmp_path):
    path = tmp_path / HISTORY_NAME
    h = MetricHistory(path)
    for s in (1, 2, 3, 4):
        h.append(s, {"train/loss": float(s), "train/loss_per_step": [float(s)]})
    h.append(4, {"eval/x": float("nan")})
    with open(path, "a") as f:
        f.write('{"step": 5, "train/lo')  # a write cut short by a crash
    with pytest.warns(UserWarning, match="skipped 1 unreadable line"):
        assert [r["step"] for r in read_history(path)] == [1, 2, 3, 4, 4]
    resumed = MetricHistory(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed.restore(2)
    assert [r["step"] for r in resumed.records] == [1, 2]
    assert [r["step"] for r in read_history(path)] == [1, 2]  # rewritten: the torn line and steps 3.. are gone
    assert json.loads(json.dumps(read_history(tmp_path / "none.jsonl"))) == []
    assert read_history(path)[0]["train/loss_per_step"] == [1.0]


def _trainer(out: Path, steps: int = 6, samples_fn=None, loss_fn=W.mlp_loss, **config):
    from omni.train import TrainConfig, Trainer

    x, y = W.mlp_data(48)
    cfg = TrainConfig(output_dir=str(out), steps=steps, lr=1e-2, log_every=1, eval_every=3, progress=False,
                      mixed_precision="no", **config)
    return Trainer(W.make_mlp(0, 0.0), loss_fn, W.ListLoader(x, y, 8), cfg, eval_data=W.ListLoader(x, y, 16),
                   eval_fn=W.mlp_eval, samples_fn=samples_fn, export_config={"builder": "x"})


def test_resumed_run_curves_cover_the_whole_run(tmp_path):
    calls = {"n": 0}

    def failing_loss(model, batch):  # dies in step 5, after the checkpoint of step 4
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("killed")
        return W.mlp_loss(model, batch)

    with pytest.raises(RuntimeError, match="killed"):
        _trainer(tmp_path, loss_fn=failing_loss, checkpoint_every=2).fit()
    with open(tmp_path / HISTORY_NAME, "a") as f:  # a record of a step after the checkpoint (trained again)
        f.write(json.dumps({"step": 5, "train/loss": 99.0}) + "\n")
    trainer = _trainer(tmp_path, checkpoint_every=2)
    trainer.fit()
    records = read_history(tmp_path / HISTORY_NAME)
    assert records == trainer.history.records
    train = [r["step"] for r in records if "train/loss" in r]
    assert train == [1, 2, 3, 4, 5, 6] and 99.0 not in [r["train/loss"] for r in records if "train/loss" in r]
    assert [r["step"] for r in records if "eval/loss" in r] == [3, 6]
    assert_picture(png(tmp_path / CURVES_NAME))


def test_samples_go_to_tensorboard_as_images_audio_and_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seen = []

    def samples(model, step):
        seen.append((step, model.training, torch.is_grad_enabled()))
        wave = 0.3 * np.sin(2 * np.pi * 440 * np.arange(1600) / 16000)
        return [Picture("eval/grid", np.full((20, 30, 3), 7 * step, np.uint8)),
                Clip("eval/clip0", wave, 16000, "**reference:** hi"), Note("eval/note", f"step {step}")]

    _trainer(tmp_path, samples_fn=samples).fit()
    assert seen == [(3, False, False), (6, False, False)]  # after each evaluation, in eval mode, no gradients
    acc = EventAccumulator(str(tmp_path / "logs" / "omni"), size_guidance={"images": 0, "audio": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    assert tags["images"] == ["eval/grid"] and tags["audio"] == ["eval/clip0"]
    assert {"eval/clip0/text_summary", "eval/note/text_summary"} <= set(tags["tensors"])
    images = acc.Images("eval/grid")
    assert [e.step for e in images] == [3, 6] and (images[0].width, images[0].height) == (30, 20)
    audio = acc.Audio("eval/clip0")[0]
    assert audio.sample_rate == 16000 and audio.length_frames == 1600
    note = acc.Tensors("eval/note/text_summary")[-1]
    assert note.tensor_proto.string_val[0] == b"step 6"
    assert np.array_equal(png(tmp_path / "samples" / "eval_grid.png"), np.full((20, 30, 3), 42, np.uint8))  # the last


def test_a_run_without_matplotlib_warns_once_and_finishes(tmp_path, monkeypatch):
    import omni.deps
    import omni.evaluation

    def missing(module, extra=None):
        raise omni.deps.MissingDependency('matplotlib is not installed: pip install -e ".[viz]"')

    monkeypatch.setattr(omni.deps, "require", missing)
    monkeypatch.setattr(omni.evaluation, "_WARNED_MISSING", False)
    with pytest.warns(UserWarning) as caught:
        metrics = _trainer(tmp_path, samples_fn=lambda m, s: [Picture("x", plots.spectrogram(np.ones((4, 4))))]).fit()
    lines = [str(w.message) for w in caught if "matplotlib" in str(w.message)]
    assert lines == ['omni.train: matplotlib is not installed: pip install -e ".[viz]": no pictures (training '
                     'curves, samples) are drawn']
    assert metrics["step"] == 6 and not (tmp_path / CURVES_NAME).exists()
    assert (tmp_path / "final").is_dir() and (tmp_path / HISTORY_NAME).is_file()


# ----------------------------------------------------------------------------------------------------
# The tasks' samples hooks


def test_task_samples_classify_grid_and_transcribe_clips():
    from omni.multitask import MultitaskModel
    from omni.tasks import ClassifyTask, TranscribeTask, task_samples
    from omni.tokenizers import ImageTokenizer
    from omni.tokenizers.audio import AudioTokenizer
    from omni.tokenizers.text import TextTokenizer
    from omni.trunk import preset

    rng = np.random.default_rng(0)
    image = ClassifyTask("image", ImageTokenizer(patch_size=7, channels=1),
                         [rng.integers(0, 255, (28, 28)).astype(np.uint8) for _ in range(3)], [0, 1, 2], 3)
    audio = AudioTokenizer()
    wave = (0.3 * np.sin(2 * np.pi * 300 * np.arange(8000) / 16000)).astype(np.float32)
    seg = audio.encode(wave, key="s")
    asr = TranscribeTask("asr", audio, TextTokenizer(), [wave, seg], ["hello", "world"])
    torch.manual_seed(0)
    model = MultitaskModel([image, asr], preset("tiny", positions="rope2d")).eval()
    items = task_samples(model.omni, [image, asr])
    assert [type(i).__name__ for i in items] == ["Picture", "Clip", "Picture", "Note"]
    grid, clip, mel, note = items
    assert grid.tag == "image/predictions" and grid.image.shape[1] == 3 * 155
    assert_picture(grid.image)
    assert clip.tag == "asr/clip0" and clip.sample_rate == 16000 and len(clip.waveform) == 8000
    assert clip.text.startswith("**reference:** hello  \n**transcript:** ")
    assert mel.tag == "asr/clip1/log_mel" and note.text.startswith("**reference:** world")
    assert_picture(mel.image)


# ----------------------------------------------------------------------------------------------------
# Recipes and omni predict --attention


def load(name: str):
    return load_recipe(name, f"{name}_recipe_plots")


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory):
    from conftest import write_idx_gz
    from omni.data.builders_vision import build_fashion_mnist

    root = tmp_path_factory.mktemp("vit-plots")
    (root / "idx").mkdir()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 128), ("t10k", 32)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, c in enumerate(labels):
            images[i, 2 + 2 * int(c):5 + 2 * int(c), 4:24] = 255
        write_idx_gz(root / "idx" / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx_gz(root / "idx" / f"{prefix}-labels-idx1-ubyte.gz", labels)
    build_fashion_mnist(root / "shards", source=root / "idx", quiet=True)
    out = root / "run"
    load("vit").main(["--preset", "tiny", "--data", str(root / "shards"), "--out", str(out), "--set",
                      "progress=False", "workers=0", "steps=4", "batch_size=32", "limit_train=None",
                      "limit_eval=None"])
    return out


def test_vit_recipe_writes_curves_and_logs_its_prediction_grid(vit_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert_picture(png(vit_run / CURVES_NAME))
    assert plots.curve_series(read_history(vit_run / HISTORY_NAME))["train/loss_step"][0] == [1, 2, 3, 4]
    acc = EventAccumulator(str(vit_run / "logs" / "vit-tiny"), size_guidance={"images": 0})
    acc.Reload()
    event = acc.Images("eval/predictions")[-1]
    grid = np.asarray(Image.open(__import__("io").BytesIO(event.encoded_image_string)).convert("RGB"))
    assert event.step == 4 and grid.shape == (2 * 200 + 40, 8 * 155, 3)
    assert_picture(grid)
    assert np.array_equal(png(vit_run / "samples" / "eval_predictions.png"), grid)


def test_predict_attention_writes_one_picture_per_image(vit_run, tmp_path, capsys):
    from omni.cli import main as omni_main

    files = []
    for k, size in enumerate(((28, 28), (40, 56))):  # any size: the picture shows what the model saw
        f = tmp_path / f"in{k}" / "shoe.png"
        f.parent.mkdir()
        Image.fromarray(np.random.default_rng(k).integers(0, 255, size).astype(np.uint8)).save(f)
        files.append(str(f))
    out = tmp_path / "attention"
    assert omni_main(["predict", "--checkpoint", str(vit_run), "--attention", str(out), "--format", "json",
                      "--top-k", "3", *files]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["attention"] for r in rows] == [str(out / "shoe.png"), str(out / "shoe-2.png")]
    assert sorted(p.name for p in out.iterdir()) == ["shoe-2.png", "shoe.png"]
    for row in rows:
        rgb = png(Path(row["attention"]))
        assert rgb.shape == (390, 740, 3)
        assert_picture(rgb)
        half = rgb.shape[1] // 2  # the heat map changes what the right panel shows of the same image
        assert np.abs(rgb[60:340, 40:half - 40].astype(int) - rgb[60:340, half - 20:2 * half - 100].astype(int)).mean() > 5
    assert omni_main(["predict", "--checkpoint", str(vit_run), "--attention", files[0], files[0]]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_dt_recipe_return_plot_and_its_tensorboard_image(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dt = load("decision_transformer")
    cfg = {"env": "CartPole-v1", "train_seeds": [0], "eval_seeds": 2, "report_to": "tensorboard", "steps": 60}
    results = [{"method": "dt", "target": 500.0, "return_mean": 336.5, "return_std": 55.9},
               {"method": "bc", "target": None, "return_mean": 322.0, "return_std": 53.7},
               {"method": "fbc", "target": None, "return_mean": 365.5, "return_std": 78.5}]
    path = dt.write_returns_plot(cfg, results, (30.8, 500.0), tmp_path)
    assert path == tmp_path / "returns.png"
    assert_picture(png(path))
    acc = EventAccumulator(str(tmp_path / "logs" / "summary"), size_guidance={"images": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("returns")] == [60]


def test_multimodal_task_counts_do_not_crowd_out_the_metrics():
    """#30: the multimodal recipe logs eval/<task>/test_<name> for metrics and counts alike; every task's metrics
    are drawn (up to 12 panels), its counts (items, utterances, tokens, bytes, documents, episodes) are not."""
    names = []
    for task, logged in (("image", ["accuracy", "loss", "items"]), ("asr", ["cer", "wer", "utterances"]),
                         ("rl", ["score_mean", "score_std", "return_mean", "episodes", "target"]),
                         ("text", ["ppl", "bpb", "nll", "tokens", "bytes", "documents"])):
        names += [f"eval/{task}/test_{m}" for m in logged]
    series = {"eval/loss": ([1], [1.0]), **{n: ([1], [0.5]) for n in names}}
    assert plots.curve_metrics(series, 12) == [
        "image/test_accuracy", "image/test_loss", "asr/test_cer", "asr/test_wer", "rl/test_score_mean",
        "rl/test_return_mean", "text/test_ppl", "text/test_bpb", "text/test_nll"]
