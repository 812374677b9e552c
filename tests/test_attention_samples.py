"""Attention maps among the training samples (issue #19): the ViT recipe's samples hook logs its first eval images
under the model's attention rollout (``eval/attention``, omni.plots.attention_grid) to TensorBoard and writes
<out>/samples/eval_attention.png; an image ClassifyTask with ``attention`` > 0 offers the same picture through
``Task.samples`` (the multimodal recipe's hook), computed only when pictures are drawn. CPU, deterministic."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omni import plots
from conftest import load_recipe

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))


def png(data: Path | bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as im:
        return np.asarray(im.convert("RGB"))


def assert_pairs(rgb: np.ndarray, images: list[np.ndarray], columns: int = 2, top_k: int = 2) -> None:
    """Each image's input panel is the plain (grey) image, pixel for pixel; its heat-map panel is the same image
    under a coloured map: other pixels, colours the image has not, and not all one colour."""
    assert rgb.std() > 20 and len(np.unique(rgb.reshape(-1, 3), axis=0)) >= 16  # not blank
    boxes = plots.attention_grid_boxes(len(images), columns, top_k)
    for image, ((t, l, b, r), (t2, l2, b2, r2)) in zip(images, boxes):
        plain, heat = rgb[t:b, l:r].astype(int), rgb[t2:b2, l2:r2].astype(int)
        assert plain.shape == heat.shape and 0 < b <= rgb.shape[0] and 0 < r2 <= rgb.shape[1]
        h, w = image.shape
        centres = plain[((np.arange(h) + 0.5) * plain.shape[0] / h).astype(int)][:, ((np.arange(w) + 0.5)
                                                                                     * plain.shape[1] / w).astype(int)]
        assert np.abs(centres - image[..., None].astype(int)).max() <= 1  # the image, unchanged and grey
        assert np.abs(heat - plain).mean() > 10  # the heat map changes what the panel shows
        colour = (heat.max(-1) - heat.min(-1)) > 30  # the image is grey: colour comes from the map
        assert colour.mean() > 0.2, colour.mean()
        assert heat.reshape(-1, 3).std(0).max() > 20


# ----------------------------------------------------------------------------------------------------
# The ViT recipe


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory):
    from conftest import write_idx_gz
    from omni.data.builders_vision import build_fashion_mnist

    root = tmp_path_factory.mktemp("vit-attention")
    (root / "idx").mkdir()
    rng = np.random.default_rng(0)
    test_images = None
    for prefix, n in (("train", 128), ("t10k", 32)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, c in enumerate(labels):
            images[i, 2 + 2 * int(c):5 + 2 * int(c), 4:24] = 255  # a bar whose height is the class
        write_idx_gz(root / "idx" / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx_gz(root / "idx" / f"{prefix}-labels-idx1-ubyte.gz", labels)
        test_images = images
    build_fashion_mnist(root / "shards", source=root / "idx", quiet=True)
    out = root / "run"
    vit = load_recipe("vit", "vit_recipe_attention")
    vit.main(["--preset", "tiny", "--data", str(root / "shards"), "--out", str(out), "--set", "progress=False",
              "workers=0", "steps=4", "batch_size=32", "limit_train=None", "limit_eval=None"])
    return out, test_images


def test_vit_run_logs_the_attention_of_four_eval_images(vit_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, test_images = vit_run
    acc = EventAccumulator(str(out / "logs" / "vit-tiny"), size_guidance={"images": 0})
    acc.Reload()
    assert {"eval/predictions", "eval/attention"} <= set(acc.Tags()["images"])
    events = acc.Images("eval/attention")
    assert [e.step for e in events] == [4]  # the one evaluation, at the end
    event = events[-1]
    assert (event.width, event.height) == (691, 428)  # 4 images: 2 rows of 2 (input, heat map) pairs
    rgb = png(event.encoded_image_string)
    assert rgb.shape == (428, 691, 3)
    written = out / "samples" / "eval_attention.png"
    assert np.array_equal(png(written), rgb)  # the same picture under <out>/samples/
    assert_pairs(rgb, list(test_images[:4]))  # the first eval images (shards keep the order)


# ----------------------------------------------------------------------------------------------------
# ClassifyTask.samples (the multimodal recipe's hook)


def image_task(attention: int):
    from omni.tasks import ClassifyTask
    from omni.tokenizers import ImageTokenizer

    rng = np.random.default_rng(0)
    items = [rng.integers(20, 200, (28, 28)).astype(np.uint8) for _ in range(3)]
    return ClassifyTask("image", ImageTokenizer(patch_size=7, channels=1), items, [0, 1, 2], 3,
                        attention=attention), items


def test_classify_task_offers_attention_maps():
    from omni.multitask import MultitaskModel
    from omni.tasks import task_samples
    from omni.trunk import preset

    task, items = image_task(attention=2)
    torch.manual_seed(0)
    model = MultitaskModel([task], preset("tiny", positions="rope2d")).eval()
    pictures = task_samples(model.omni, [task])
    assert [p.tag for p in pictures] == ["image/predictions", "image/attention"]
    grid, attention = pictures
    assert grid.image.shape[1] == 3 * 155  # every item still in the prediction grid
    assert attention.image.shape == (240, 691, 3)  # 2 images: one row of 2 pairs
    assert_pairs(attention.image, items[:2])
    assert model.training is False and torch.is_grad_enabled()
    plain, _ = image_task(attention=0)
    assert [p.tag for p in plain.samples(model.omni)] == ["image/predictions"]  # by default: as before


def test_no_attention_is_computed_when_no_picture_is_drawn(monkeypatch):
    import omni.deps
    import omni.introspect
    from omni.multitask import MultitaskModel
    from omni.trunk import preset

    def missing(module, extra=None):
        raise omni.deps.MissingDependency('matplotlib is not installed: pip install -e ".[viz]"')

    calls = []
    monkeypatch.setattr(omni.deps, "require", missing)
    monkeypatch.setattr(omni.introspect, "image_attention", lambda *a, **k: calls.append(a))
    task, _ = image_task(attention=2)
    torch.manual_seed(0)
    model = MultitaskModel([task], preset("tiny", positions="rope2d"))
    with pytest.raises(omni.deps.MissingDependency):
        task.samples(model.omni)  # the Trainer's Pictures turn this into one warning
    assert calls == []
