"""Long images (#26): ViTs at a larger size than they were trained at, with 2-D window attention on the patch grid
and a few full layers (ViTDet's layout). A converted timm ViT fine-tuned at another size: its position table
resampled as timm does, its windows laid on the (row, col) grid although its positions are token order; the fast
path, the prediction path and the dense masked reference agree; the export keeps the pattern and `omni predict`
uses it; introspection's maps respect the windows. Tiny sizes, CPU, fp32, seconds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from test_interop_timm import hub_dir, images, timm_vit
from test_vit_recipe import load_recipe

from omni.attention_patterns import LayerMasks
from omni.cli import main as omni_main
from omni.export import load_pretrained
from omni.interop import ConversionError, read_model, to_peer
from omni.introspect import capture, image_attention
from omni.pipelines.predict import image_classifier
from omni.tokenizers.image import ImageTokenizer, patchify
from omni.trunk import TrunkConfig
from omni.vision import ImageClassifier, adapt_classifier, attention_method, resample_position_table

timm = pytest.importorskip("timm")
from timm.layers import resample_abs_pos_embed  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
PEER = dict(img_size=32, patch_size=8, depth=3, embed_dim=32, num_heads=2, num_classes=5)  # a 4 x 4 grid + CLS
WINDOW = {"kind": "any", "of": [{"kind": "window2d", "rows": 1, "cols": 2}, {"kind": "global", "first": 1}]}
SCHEDULE = {"pattern": WINDOW, "full_every": 2}  # layers 0 and 2 windowed, layer 1 full


def grid_reference(grid: tuple[int, int], rows: int, cols: int, cls: bool) -> torch.Tensor:
    """(T, T) bool written pair by pair: patches see patches within rows / cols on the grid; CLS sees and is seen
    by every token."""
    places = [(-1, -1)] * int(cls) + [(r, c) for r in range(grid[0]) for c in range(grid[1])]
    T = len(places)
    out = torch.zeros(T, T, dtype=torch.bool)
    for i, (ri, ci) in enumerate(places):
        for j, (rj, cj) in enumerate(places):
            out[i, j] = (cls and (i == 0 or j == 0)) or (abs(ri - rj) <= rows and abs(ci - cj) <= cols)
    return out


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    model = timm_vit(seed=11, **PEER)
    return model, read_model(hub_dir(model, tmp_path_factory.mktemp("timm") / "hub"))


def test_resampled_positions_are_timms_224_to_1024():
    """A 224-px ViT/16's table (CLS + 14 x 14) to 512 and 1,024 px (32 x 32, 64 x 64), the CLS row kept."""
    table = torch.randn(1 + 14 * 14, 16, generator=torch.Generator().manual_seed(0))
    for side in (32, 64):
        expected = resample_abs_pos_embed(table[None], [side, side], old_size=[14, 14], num_prefix_tokens=1)[0]
        got = resample_position_table(table, (14, 14), (side, side), 1)
        assert got.shape == (1 + side * side, 16) and torch.equal(got[0], table[0])
        assert (got - expected).abs().max() <= 1e-6


def test_a_converted_peer_keeps_full_attention_unless_asked(peer):
    model, (config, state, tokenizers) = peer
    assert config["trunk"].get("attention") is None
    kept = adapt_classifier(config, state, tokenizers["image"], image_size=64).eval()
    assert kept.trunk.cfg.attention is None and not kept.trunk.schedule.sparse
    x = images(2, 32)
    same = adapt_classifier(config, state, tokenizers["image"], image_size=32).eval()
    with torch.no_grad():  # at its own size the converted model is timm's
        assert (same(x) - model((x - 0.5) / 0.5)).abs().max() <= 1e-4
    windowed = adapt_classifier(config, state, tokenizers["image"], image_size=64, attention=SCHEDULE)
    assert windowed.trunk.cfg.attention == SCHEDULE
    assert [p is None for p in windowed.trunk.schedule.layers] == [False, True, False]
    assert torch.equal(windowed.trunk.blocks[0].attn.qkv.weight, kept.trunk.blocks[0].attn.qkv.weight)
    with pytest.raises(ValueError, match="the 3-layer trunk of the model to start from: attention.layers: expected "
                                         "a list of 3"):
        adapt_classifier(config, state, tokenizers["image"], attention={"layers": [WINDOW, None]})


def test_windowed_timm_vit_at_a_larger_size_equals_the_dense_reference(peer):
    """64 px = an 8 x 8 grid + CLS: the fast path, the prediction path (tokens and positions) and the trunk under the
    hand-written (row, col) masks agree; a 1-D window over token order (what the trunk alone would make of timm's
    (i, i) positions) and full attention both give other logits."""
    _, (config, state, tokenizers) = peer
    model = adapt_classifier(config, state, tokenizers["image"], image_size=64, attention=SCHEDULE).eval()
    full = adapt_classifier(config, state, tokenizers["image"], image_size=64).eval()
    assert model.tokenizer.positions == "sequence" and model.cls
    x = images(3, 64, seed=2)
    reference = grid_reference((8, 8), 1, 2, cls=True)
    with torch.no_grad():
        got = model(x)
        tokens = model._with_cls(patchify((x - model.mean) / model.std, 8))
        positions = model.tokenizer.token_positions((8, 8)).expand(3, -1, -1)
        masks = LayerMasks(None if p is None else reference[None, None].expand(3, 1, -1, -1)
                           for p in model.trunk.schedule.layers)
        expected = model.forward_head(model.trunk(model.embed(tokens), positions, mask=masks))
        predicted = model.forward_tokens(tokens, positions, (8, 8))  # the prediction path (omni predict)
        no_grid = model.forward_tokens(tokens, positions)  # its grid: the tokenizer's image_size
        one_d = model.forward_head(model.trunk(model.embed(tokens), positions, mask=None))
    assert (got - expected).abs().max() <= 1e-5
    assert (predicted - got).abs().max() <= 1e-5 and torch.equal(no_grid, predicted)
    assert (got - full(x)).abs().max() > 1e-2 and (got - one_d).abs().max() > 1e-2


def test_attention_maps_of_a_windowed_model_respect_the_grid(peer):
    """capture records each layer's probabilities: zero outside the 2-D window for the windowed layers, on the
    grid; image_attention's rollout and last-layer maps are distributions over the patches."""
    _, (config, state, tokenizers) = peer
    model = adapt_classifier(config, state, tokenizers["image"], image_size=48, attention=SCHEDULE).eval()
    x = images(1, 48, seed=3)
    with capture(model, hidden_states=False) as rec:
        model(x)
    outside = ~grid_reference((6, 6), 1, 2, cls=True)
    a0, a1 = rec.attention["trunk.blocks.0.attn"][0], rec.attention["trunk.blocks.1.attn"][0]
    assert a0[:, outside].abs().max() == 0 and a1[:, outside].min() > 0  # layer 1 is full
    assert torch.allclose(a0.sum(-1), torch.ones(2, 37), atol=1e-5)
    for method in ("rollout", "last"):
        heat = image_attention(model, x, method=method)
        assert heat.shape == (1, 6, 6) and torch.allclose(heat.sum((1, 2)), torch.ones(1), atol=1e-5)


def test_omni_grid_vit_windowed_equals_the_dense_reference():
    """An omni ViT (grid positions, no CLS, 2-D learned positions) with the pattern on every layer: its own masks
    (the trunk reads the grid from its positions) equal the hand-written reference."""
    image = ImageTokenizer(patch_size=4, channels=1, image_size=32, policy="resize")
    trunk = TrunkConfig(d_model=32, n_layers=2, n_heads=2, positions="learned", max_positions=8,
                        attention={"kind": "window2d", "rows": 2, "cols": 1})
    torch.manual_seed(0)
    model = ImageClassifier(image, trunk, 3).eval()
    x = torch.rand(2, 1, 32, 32, generator=torch.Generator().manual_seed(4))
    reference = grid_reference((8, 8), 2, 1, cls=False)[None, None].expand(2, 1, -1, -1)
    with torch.no_grad():
        tokens = patchify((x - model.mean) / model.std, 4)
        positions = image.token_positions((8, 8)).expand(2, -1, -1)
        expected = model.forward_head(model.trunk(model.embed(tokens), positions, mask=LayerMasks([reference] * 2)))
        assert (model(x) - expected).abs().max() <= 1e-5


def test_recipe_fine_tunes_at_a_larger_size_with_windows_and_predicts(peer, tmp_path, capsys, monkeypatch):
    """recipes/vit.py --set init=<timm hub dir> image_size=64 resize=64 trunk_overrides.attention=...: a few steps
    run, the export keeps the pattern, `omni predict` (fast and with --attention) reads it and equals the model."""
    from conftest import write_idx_gz
    from test_vit_recipe import synthetic_images

    from omni.data.builders_vision import build_fashion_mnist

    idx = tmp_path / "idx"
    idx.mkdir()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 256), ("t10k", 64)):
        pixels, labels = synthetic_images(n, rng)
        write_idx_gz(idx / f"{prefix}-images-idx3-ubyte.gz", pixels)
        write_idx_gz(idx / f"{prefix}-labels-idx1-ubyte.gz", labels)
    build_fashion_mnist(tmp_path / "shards", source=idx, quiet=True)
    src = peer[0]
    hub = hub_dir(src, tmp_path / "timm")
    metrics = load_recipe().main([
        "--preset", "tiny", "--data", str(tmp_path / "shards"), "--out", str(tmp_path / "run"), "--set",
        f"init={hub}", "image_size=64", "resize=64", "train_crop=center", "steps=4", "batch_size=16", "pad=0",
        "progress=False", "workers=0", "limit_train=64", "limit_eval=32", f"trunk_overrides.attention={SCHEDULE!r}"])
    assert math.isfinite(metrics["eval/loss"])
    export = tmp_path / "run" / "final"
    assert json.loads((export / "config.json").read_text())["trunk"]["attention"] == SCHEDULE
    model = load_pretrained(export).eval()
    assert model.trunk.schedule.sparse and model.tokenizer.image_size == (64, 64)
    picture = tmp_path / "shoe.png"
    Image.fromarray(synthetic_images(1, rng)[0][0]).save(picture)  # 28 px: the tokenizer resizes it to 64
    classify, tokenizer, _, loaded, _ = image_classifier(export, "cpu")
    seg = tokenizer.encode(picture)
    with torch.no_grad():
        logits = classify(seg)
        dense = loaded.forward_tokens(seg.tokens[None], seg.positions_2d[None], seg.meta["grid"])[0]
        loaded.trunk.schedule = type(loaded.trunk.schedule)((None,) * 3)  # the same weights, full attention
        full = loaded.forward_tokens(seg.tokens[None], seg.positions_2d[None], seg.meta["grid"])[0]
    assert torch.equal(logits, dense) and (logits - full).abs().max() > 1e-4
    capsys.readouterr()
    assert omni_main(["predict", "--checkpoint", str(export), "--format", "json", "--attention",
                      str(tmp_path / "pics"), str(picture)]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert Path(row["attention"]).is_file()  # the rollout picture over the 8 x 8 grid
    # --attention-method auto (the default) draws the last layer's attention where a rollout would not fit
    import omni.pipelines.predict as predict
    import omni.vision

    drawn = []
    real = predict.image_attention
    monkeypatch.setattr(predict, "image_attention",
                        lambda *a, method, **k: drawn.append(method) or real(*a, method=method, **k))
    for limit, want in ((omni.vision.ROLLOUT_BYTES, "rollout"), (1000, "last")):
        monkeypatch.setattr(omni.vision, "ROLLOUT_BYTES", limit)
        assert omni_main(["predict", "--checkpoint", str(export), "--attention", str(tmp_path / "pics"),
                          str(picture)]) == 0
        assert drawn[-1] == want
    assert row["top_k"][0]["probability"] == pytest.approx(float(logits.softmax(-1).max()), abs=1e-4)
    with pytest.raises(ConversionError, match="timm's ViT cannot hold this export: it has attention patterns"):
        to_peer(export, tmp_path / "back", "timm")  # timm attends fully: its logits would differ


@pytest.mark.parametrize("sets,said", [
    (["trunk_overrides.d_model=64"], ("trunk_overrides.d_model: init brings its own trunk; with init, "
                                      "trunk_overrides sets only attention")),
    (["image_size=1000", "patch=16", "init=None"], ("image_size 1000 must be a multiple of patch 16: images are cut "
                                                    "into patch x patch squares (the nearest that fit: 992 or 1008)")),
])
def test_user_errors_are_one_line_before_data(sets, said, capsys):
    with pytest.raises(SystemExit) as stop:
        load_recipe().parse_args(["--preset", "tiny", "--set", "init=somewhere", *sets])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and said in err and "Traceback" not in err


def test_an_attention_schedule_that_does_not_fit_the_init_is_one_line_before_data(peer, tmp_path):
    """The recipe's trunk (tiny: 2 layers) takes a 2-entry layers list; the 3-layer init does not: one line naming
    the init's trunk, before any data is built (--data names nothing)."""
    hub = hub_dir(peer[0], tmp_path / "timm")
    with pytest.raises(ValueError, match="the 3-layer trunk of the model to start from: attention.layers: expected "
                                         "a list of 3"):
        load_recipe().main(["--preset", "tiny", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "run"),
                            "--set", f"init={hub}", "image_size=64",
                            f"trunk_overrides.attention={{'layers': [{WINDOW!r}, None]}}"])
    assert not (tmp_path / "none").exists()


def test_sample_pictures_use_the_last_layer_when_a_rollout_would_not_fit():
    """vit.py's pictures: a ViT-Ti/16 rollout holds 12 x 3 x 197^2 floats at 224 px (5.6 MB: rollout) but 2.4 GB at
    1,024 px (4,097 tokens: the last layer only)."""
    with torch.device("meta"):
        model = build_vit_ti(1024)
    assert attention_method(model, (224, 224)) == "rollout"
    assert attention_method(model, (512, 512)) == "rollout"  # 12 x 3 x 1,025^2 x 4 bytes = 151 MB
    assert attention_method(model, (1024, 1024)) == "last"


def build_vit_ti(size: int) -> ImageClassifier:
    image = ImageTokenizer(16, channels=3, image_size=size, cls=True, positions="sequence")
    trunk = TrunkConfig(d_model=192, n_layers=12, n_heads=3, positions="learned_1d", max_positions=(size // 16) ** 2 + 1)
    return ImageClassifier(image, trunk, 10, pool="cls")
