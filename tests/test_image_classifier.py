"""ImageClassifier's uniform-batch fast path against the generic paths, with and without a CLS token:
forward(images) == forward_tokens(ImageTokenizer.encode segments) == OmniModel + ClassificationHead on
a packed batch of the same images (same weights)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omni.heads import ClassificationHead
from omni.model import OmniModel
from omni.packing import Packer
from omni.segment import Sample
from omni.tokenizers.image import ImageTokenizer
from omni.trunk import TrunkConfig
from omni.vision import ImageClassifier

CASES = [(True, "cls", "learned"), (True, "mean", "learned"), (True, "cls", "rope2d"), (False, "mean", "learned"),
         (False, "cls", "rope2d")]


def make(cls: bool, pool: str, positions: str) -> tuple[ImageTokenizer, ImageClassifier]:
    tok = ImageTokenizer(patch_size=4, channels=3, cls=cls)
    cfg = TrunkConfig(d_model=32, n_layers=2, n_heads=4, positions=positions, max_positions=8)
    torch.manual_seed(0)
    model = ImageClassifier(tok, cfg, n_classes=5, pool=pool).eval()
    nn.init.normal_(model.head.proj.weight)  # the head starts at zero: logits would be trivially equal
    nn.init.normal_(model.head.proj.bias)
    return tok, model


def images(n: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, 12, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("cls,pool,positions", CASES)
def test_fast_path_equals_segment_and_packed_paths(cls, pool, positions):
    tok, model = make(cls, pool, positions)
    x = images()
    segments = [tok.encode(img, key=f"img{i}") for i, img in enumerate(x)]
    assert segments[0].tokens.shape == (12 + cls, 4 * 4 * 3 + cls)
    with torch.no_grad():
        fast = model(x)  # (B, classes)
        per_segment = torch.cat([model.forward_tokens(s.tokens[None], s.positions_2d[None]) for s in segments])
        # the generic path: the same weights in an OmniModel, images packed into one row, pooled per segment
        omni = OmniModel({"image": tok}, model.trunk.cfg, heads={"label": ClassificationHead(32, 5, pool=pool)})
        rename = {"embed.": "embedders.image.", "head.": "heads.label.", "trunk.": "trunk."}
        omni.load_state_dict({next(v + k[len(p):] for p, v in rename.items() if k.startswith(p)): t
                              for k, t in model.state_dict().items()})
        batch = Packer()([Sample([s], key=s.meta.get("key", str(i))) for i, s in enumerate(segments)])
        packed = omni.eval().forward_head(omni(batch), batch, "label", "image")
    assert fast.shape == (3, 5)
    torch.testing.assert_close(fast, per_segment, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, packed, atol=1e-5, rtol=1e-5)


def test_cls_token_and_pool_reach_the_logits():
    """With CLS, "cls" reads the CLS token and "mean" averages it with the patches: different logits."""
    x = images()
    with torch.no_grad():
        by_cls, by_mean = make(True, "cls", "learned")[1](x), make(True, "mean", "learned")[1](x)
    assert not torch.allclose(by_cls, by_mean, atol=1e-3)


def test_fast_path_with_cls_compiles_as_one_graph():
    _, model = make(True, "cls", "rope2d")
    x = images(2)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


def test_cls_classifier_export_round_trip(tmp_path):
    """The export builder rebuilds a CLS classifier (tokenizer cls flag, pool) with the same logits."""
    from omni.export import load_pretrained, save_pretrained

    tok, model = make(True, "mean", "learned")
    save_pretrained(model, tmp_path / "cls", {"builder": "omni.vision:build_image_classifier",
                                              "trunk": model.trunk.cfg.to_dict(), "n_classes": 5, "pool": "mean"},
                    tokenizers={"image": tok})
    loaded = load_pretrained(tmp_path / "cls")
    assert loaded.cls and loaded.head.pool == "mean"
    with torch.no_grad():
        torch.testing.assert_close(loaded(images()), model(images()), atol=0, rtol=0)
