"""The convolutional stem (omni.vision.ConvStem): every path that reads patch tokens gives the fast path's numbers,
one image predicts as in a batch, the export rebuilds it, and the peers' ViTs refuse it in one line."""

from __future__ import annotations

import pytest
import torch

from omni.export import load_pretrained, save_pretrained
from omni.interop.registry import ConversionError
from omni.interop.hf_vit import to_hf
from omni.interop.timm import to_timm
from omni.introspect import image_attention
from omni.tokenizers.image import ImageTokenizer
from omni.trunk import preset
from omni.vision import ConvStem, ImageClassifier, adapt_classifier

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def classifier(cls: bool = False, pool: str = "mean", positions: str = "rope2d", seed: int = 0) -> ImageClassifier:
    tok = ImageTokenizer(patch_size=7, channels=1, image_size=28, cls=cls,
                         positions="sequence" if positions == "learned_1d" else "grid")
    torch.manual_seed(seed)
    model = ImageClassifier(tok, preset("tiny", positions=positions, max_positions=17), 10, pool=pool,
                            stem=[8, 16, 16])
    torch.nn.init.normal_(model.head.proj.weight, std=1.0)  # the zero-init head would hide differences
    return model.eval()


def images(n: int = 3, size: int = 28) -> torch.Tensor:
    return torch.randint(0, 256, (n, 1, size, size), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)


@pytest.mark.parametrize("cls,pool,positions", [(False, "mean", "rope2d"), (True, "cls", "rope2d"),
                                                (True, "mean", "learned_1d")])
def test_tokenizer_path_equals_fast_path(cls, pool, positions):
    model, x = classifier(cls, pool, positions), images()
    tokens, pos, grid = model.tokenizer.encode_batch(x)
    with torch.no_grad():
        fast = model(x)
        tokenized = model.forward_tokens(tokens, pos.expand(len(x), -1, -1), grid)
        default_grid = model.forward_tokens(tokens, pos.expand(len(x), -1, -1))  # the tokenizer's image_size
    assert fast.shape == (3, 10)
    torch.testing.assert_close(tokenized, fast, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(default_grid, fast, rtol=1e-5, atol=1e-5)


def test_one_image_predicts_as_in_a_batch():
    model, x = classifier(), images(4)
    with torch.no_grad():
        batch = model(x)
        alone = torch.cat([model(x[i:i + 1]) for i in range(4)])
    torch.testing.assert_close(alone, batch, rtol=1e-5, atol=1e-5)


def test_other_image_sizes_keep_the_patch_grid():
    stem = classifier().stem  # [8, 16, 16]: two stride-2 convolutions, 28 -> 14 -> 7, pooled onto 4 x 4
    for size in (28, 56, 35, 21):
        out = stem(torch.randn(2, 1, size, size))
        assert out.shape == (2, (size // 7) ** 2, 16)
    four = ConvStem(1, [8, 8, 8, 8], 7)  # 28 -> 14 -> 7 -> 4: the grid itself, no pooling
    assert four(torch.randn(1, 1, 28, 28)).shape == (1, 16, 8)
    with pytest.raises(ValueError, match=r"reduce 56 pixels to 7, fewer than the 8 patches of 7 pixels"):
        four(torch.randn(1, 1, 56, 56))


def test_segment_path_and_attention_map():
    model, x = classifier(cls=True, pool="cls"), images(1)
    seg = model.tokenizer.encode(x[0])
    with torch.no_grad():
        logits = model.forward_tokens(seg.tokens[None], seg.positions_2d[None], seg.meta["grid"])
        torch.testing.assert_close(logits, model(x), rtol=1e-5, atol=1e-5)
    maps = image_attention(model, seg)
    assert maps.shape[-2:] == (4, 4) and torch.isfinite(maps).all()


def test_export_round_trip_and_adapt(tmp_path):
    model, x = classifier(cls=True, pool="cls", positions="learned_1d"), images()
    path = save_pretrained(model, tmp_path / "final", model.export_config(["c%d" % i for i in range(10)]),
                           tokenizers={"image": model.tokenizer})
    back = load_pretrained(path)
    assert back.stem is not None and back.stem.channels == [8, 16, 16]
    with torch.no_grad():
        torch.testing.assert_close(back(x), model(x), rtol=0, atol=0)
    config, state = model.export_config(), model.state_dict()
    adapted = adapt_classifier(config, state, model.tokenizer, n_classes=3).eval()
    assert adapted.stem.channels == [8, 16, 16] and adapted.head.proj.out_features == 3
    with torch.no_grad():  # the stem and trunk are the source's: the same features
        torch.testing.assert_close(adapted.forward_features(x), model.forward_features(x), rtol=0, atol=0)


def test_peer_vits_refuse_a_stem():
    model = classifier(cls=True, pool="cls", positions="learned_1d")
    config = {**model.export_config(), "source": {"format": "timm", "config": {"architecture": "vit_tiny_patch16_224"}}}
    with pytest.raises(ConversionError, match="convolutional stem"):
        to_timm(config, model.state_dict(), model.tokenizer, arch="vit_tiny_patch16_224")
    with pytest.raises(ValueError, match="convolutional stem"):
        to_hf(model.export_config(), model.state_dict(), model.tokenizer)


def test_stem_shape_is_checked():
    with pytest.raises(ValueError, match="positive channel counts"):
        ConvStem(1, [], 4)
    with pytest.raises(ValueError, match="positive channel counts"):
        ConvStem(1, [8, 0], 4)
    assert [ConvStem(1, [8] * k, 7).map_size(28) for k in (1, 2, 3, 4, 5)] == [28, 14, 7, 4, 2]
