"""Hugging Face ViTs <-> omni image classifiers (omni.interop.hf_vit): exact logits against ViTForImageClassification
and ViTModel, the image processor carried by the tokenizer, the way back through from_pretrained, HF -> omni -> HF
bit-exact, a timm ViT handed to transformers through omni, `omni convert` and its one-line refusals.

Peers are built from small configs (nothing downloads) with random weights at O(1) scale, not the libraries' init
(small weights hide mapping mistakes): matrices ~ N(0, 1/fan_in), biases ~ N(0, 0.1), norm gains ~ N(1, 0.1),
class token and position table ~ N(0, 1). CPU, fp32."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from _interop import cli_error, o1_weights

from omni.cli import main as omni_main
from omni.export import load_pretrained, load_tokenizers, save_pretrained
from omni.interop import ConversionError, convert, read_model, to_peer
from omni.tokenizers.image import ImageTokenizer, patchify
from omni.trunk import TrunkConfig
from omni.vision import ImageClassifier, adapt_classifier

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from transformers import ViTConfig, ViTForImageClassification, ViTModel  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, image_size=32,
             patch_size=8)


def o1(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random weights at O(1) scale (module docstring), in eval mode; HF's, timm's and omni's names: the class
    tokens and the position tables ~ N(0, 1)."""
    return o1_weights(model, seed, by_module=False,
                      unscaled=("table", "cls_token", "position_embeddings", "pos_embed"))


def hf_vit(seed: int = 0, classes: int = 5, cls=ViTForImageClassification, **overrides) -> nn.Module:
    config = ViTConfig(**{**SMALL, **overrides}, num_labels=classes)
    return o1(cls(config), seed)


def images(n: int, size: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def hf_logits(model: nn.Module, x: torch.Tensor, mean=0.5, std=0.5) -> torch.Tensor:
    with torch.no_grad():
        return model((x - mean) / std).logits


def omni_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------------------------------
# Exact logits


@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": False, "hidden_act": "gelu_new"},
                                       {"layer_norm_eps": 1e-6, "num_attention_heads": 2, "patch_size": 4}],
                         ids=["defaults", "no-qkv-bias-gelu-new", "eps-heads-patch"])
def test_converted_logits_equal_hf(overrides, tmp_path, capsys):
    peer = hf_vit(seed=3, **overrides)
    peer.save_pretrained(tmp_path / "hf")
    model = load_pretrained(convert(tmp_path / "hf", tmp_path / "omni"))
    x = images(3)
    expected, got = hf_logits(peer, x), omni_logits(model, x)
    with capsys.disabled():
        print(f"\nHF ViT {overrides}: max |logit diff| {max_diff(expected, got):.2e} "
              f"(logits up to {expected.abs().max().item():.1f})")
    assert max_diff(expected, got) <= 1e-4
    assert expected.abs().max() > 0.5  # O(1) weights: logits far from zero, a mapping mistake would show
    trunk = model.trunk.cfg
    assert (trunk.norm_eps, trunk.activation, model.head.pool, model.head.norm_eps) == (
        overrides.get("layer_norm_eps", 1e-12), "gelu_tanh" if "hidden_act" in overrides else "gelu", "cls", None)
    assert bool(model.trunk.blocks[0].attn.qkv.bias.any()) == overrides.get("qkv_bias", True)


def test_a_vit_model_backbone_is_a_classifier_without_classes(tmp_path):
    """ViTModel (no classifier, a pooler off the classification path): the trunk's hidden states are HF's
    last_hidden_state; the pooler is carried as it is; recipes/vit.py's init gives it this run's head (zero: the
    uniform prediction)."""
    peer = hf_vit(seed=4, cls=ViTModel)
    peer.save_pretrained(tmp_path / "hf")
    config, state_dict, tokenizers = read_model(tmp_path / "hf")
    assert config["head"]["n_classes"] == 0 and config["carried"] == {"pooler.dense.bias": [64],
                                                                       "pooler.dense.weight": [64, 64]}
    assert torch.equal(state_dict["carried.pooler/dense/weight"], peer.pooler.dense.weight)
    model = adapt_classifier(config, state_dict, tokenizers["image"], image_size=32, n_classes=3).eval()
    x = images(2)
    with torch.no_grad():
        expected = peer((x - 0.5) / 0.5).last_hidden_state
        assert max_diff(expected, model.forward_features(x)) <= 1e-4
        assert torch.equal(model(x), torch.zeros(2, 3))


@pytest.mark.parametrize("size", [48, 24, 40], ids=["up-4to6", "down-4to3", "up-4to5"])
def test_another_image_size_resamples_positions_as_hf(tmp_path, size):
    """A HF ViT fine-tuned at another image size (recipes/vit.py init=, omni.vision.adapt_classifier) resamples its
    position table by HF's rule (bicubic, no antialiasing): its logits are HF's with interpolate_pos_encoding=True.
    timm's rule (antialiased bicubic) is another function: those logits would differ."""
    from omni.vision import POSITION_TABLE, resample_position_table

    peer = hf_vit(seed=14)
    peer.save_pretrained(tmp_path / "hf")
    config, state_dict, tokenizers = read_model(tmp_path / "hf")
    model = adapt_classifier(config, state_dict, tokenizers["image"], image_size=size).eval()
    x = images(3, size=size)
    with torch.no_grad():
        expected = peer((x - 0.5) / 0.5, interpolate_pos_encoding=True).logits
    assert max_diff(expected, omni_logits(model, x)) <= 1e-4
    timm_rule = resample_position_table(state_dict[POSITION_TABLE], (4, 4), (size // 8,) * 2, 1, "timm")
    assert max_diff(timm_rule, model.state_dict()[POSITION_TABLE]) > 1e-2


# ----------------------------------------------------------------------------------------------------
# The image processor


@pytest.mark.parametrize("resample,interpolation", [(2, "bilinear"), (3, "bicubic")])
def test_processor_settings_are_carried_and_preprocess_as_hf(tmp_path, resample, interpolation):
    """preprocessor_config.json (size, resample, mean / std) becomes the tokenizer; omni's pixels on 8-bit images
    are HF's ViTImageProcessor's (bilinear, its default; bicubic) but for the 8-bit rounding of PIL's resize: one
    level (bicubic upsampling overshot by up to 12.6 levels before the "resize" policy clipped to [0, 1])."""
    from transformers import AutoImageProcessor

    peer = hf_vit(seed=5)
    peer.save_pretrained(tmp_path / "hf")
    settings = {"image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": 32, "width": 32},
                "resample": resample, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
    (tmp_path / "hf" / "preprocessor_config.json").write_text(json.dumps(settings))
    export = convert(tmp_path / "hf", tmp_path / "omni")
    tok = load_tokenizers(export)["image"]
    assert (tok.policy, tok.image_size, tok.interpolation, tok.mean, tok.std, tok.cls, tok.positions) == (
        "resize", (32, 32), interpolation, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225], True, "sequence")
    processor = AutoImageProcessor.from_pretrained(tmp_path / "hf")
    rng = np.random.default_rng(0)
    for shape in ((50, 70, 3), (32, 32, 3), (20, 45, 3), (300, 200, 3)):
        img = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
        theirs = processor(img, return_tensors="pt")["pixel_values"][0]
        ours = tok.encode(img).tokens[1:, :-1]  # the patches, without the CLS row and flag column
        worst = max_diff(ours, patchify(theirs, 8)) * min(tok.std)  # in [0, 1] pixel units
        assert worst <= 1.01 / 255, (shape, worst)
    back = to_peer(export, tmp_path / "back", "hf")
    assert {k: v for k, v in json.loads((back / "preprocessor_config.json").read_text()).items()
            if k in settings} == settings


def test_shortest_edge_and_centre_crop_is_policy_crop(tmp_path):
    peer = hf_vit(seed=6)
    peer.save_pretrained(tmp_path / "hf")
    settings = {"size": {"shortest_edge": 36}, "do_center_crop": True, "crop_size": {"height": 32, "width": 32},
                "resample": 3}
    (tmp_path / "hf" / "preprocessor_config.json").write_text(json.dumps(settings))
    tok = read_model(tmp_path / "hf")[2]["image"]
    assert (tok.policy, tok.resize, tok.image_size, tok.interpolation) == ("crop", 36, (32, 32), "bicubic")


# ----------------------------------------------------------------------------------------------------
# Back to HF


def test_hf_to_omni_to_hf_is_bit_exact(tmp_path):
    """Every tensor comes back bit for bit, a ViTModel's pooler included; a ViTModel as transformers 5 saves it
    (no id2label in its config.json) goes back without one, and gives HF's pooler_output again."""
    bare = o1(ViTModel(ViTConfig(**SMALL)), seed=13)  # ViTConfig's own num_labels: config.json has no id2label
    for name, peer in (("cls", hf_vit(seed=7)), ("no-bias", hf_vit(seed=8, qkv_bias=False)),
                       ("backbone", hf_vit(seed=9, cls=ViTModel)), ("bare-backbone", bare)):
        peer.save_pretrained(tmp_path / name)
        assert omni_main(["convert", str(tmp_path / name), str(tmp_path / f"{name}-omni")]) == 0
        assert omni_main(["convert", "--to", "hf", str(tmp_path / f"{name}-omni"), str(tmp_path / f"{name}-back")]) == 0
        original = load_file(str(tmp_path / name / "model.safetensors"))
        back = load_file(str(tmp_path / f"{name}-back" / "model.safetensors"))
        assert set(back) == set(original), name
        assert all(torch.equal(back[k], v) for k, v in original.items()), name
        settings = json.loads((tmp_path / f"{name}-back" / "config.json").read_text())
        assert settings["qkv_bias"] == (name != "no-bias") and settings["architectures"] == \
            [type(peer).__name__]
        source = json.loads((tmp_path / name / "config.json").read_text())
        assert settings.get("id2label") == source.get("id2label"), name
    assert "id2label" not in json.loads((tmp_path / "bare-backbone" / "config.json").read_text())
    again = ViTModel.from_pretrained(tmp_path / "bare-backbone-back").eval()
    x = images(2)
    with torch.no_grad():
        expected, got = bare((x - 0.5) / 0.5).pooler_output, again((x - 0.5) / 0.5).pooler_output
    assert torch.equal(got, expected) and expected.abs().max() > 0.1


def test_an_omni_model_in_hfs_format_gives_its_logits(tmp_path):
    """An omni-built classifier (a type embedding HF has not, named classes) -> --to hf -> from_pretrained."""
    image = ImageTokenizer(8, image_size=32, policy="resize", interpolation="bicubic", mean=(0.4, 0.5, 0.6),
                           std=(0.2, 0.25, 0.3), cls=True, positions="sequence", alpha="drop")
    trunk = TrunkConfig(d_model=64, n_layers=2, n_heads=2, activation="gelu", norm_eps=1e-6, positions="learned_1d",
                        max_positions=17)
    model = o1(ImageClassifier(image, trunk, 4, pool="cls", norm_eps=None), seed=10)
    names = ["ant", "bee", "cat", "dog"]
    export = save_pretrained(model, tmp_path / "omni", model.export_config(names), tokenizers={"image": image})
    out = to_peer(export, tmp_path / "hf", "hf")
    peer = ViTForImageClassification.from_pretrained(out).eval()
    assert peer.config.id2label == dict(enumerate(names)) and peer.config.layer_norm_eps == 1e-6
    x = images(3)
    mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in ((0.4, 0.5, 0.6), (0.2, 0.25, 0.3)))
    assert max_diff(hf_logits(peer, x, mean, std), omni_logits(model, x)) <= 1e-5
    again = load_pretrained(convert(out, tmp_path / "again"))
    assert max_diff(omni_logits(again, x), omni_logits(model, x)) <= 1e-5


def test_a_timm_vit_reaches_transformers_through_omni(tmp_path):
    """timm -> omni -> HF: ViTForImageClassification gives timm's logits; timm's centre crop is BitImageProcessor's."""
    timm = pytest.importorskip("timm")
    from timm.data import resolve_data_config
    from timm.models import save_for_hf

    peer = o1(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                                embed_dim=64, num_heads=2, num_classes=7), seed=11)
    save_for_hf(peer, str(tmp_path / "timm"), safe_serialization=True)
    out = to_peer(convert(tmp_path / "timm", tmp_path / "omni"), tmp_path / "hf", "hf")
    hf = ViTForImageClassification.from_pretrained(out).eval()
    data = resolve_data_config({}, model=peer)
    x = images(2)
    mean, std = (torch.tensor(data[k]).view(1, -1, 1, 1) for k in ("mean", "std"))
    with torch.no_grad():
        assert max_diff(hf((x - mean) / std).logits, peer((x - mean) / std)) <= 1e-5
    settings = json.loads((out / "preprocessor_config.json").read_text())
    assert settings["image_processor_type"] == "BitImageProcessor" and settings["size"] == {
        "shortest_edge": math.floor(32 / data["crop_pct"])} and settings["crop_size"] == {"height": 32, "width": 32}


# ----------------------------------------------------------------------------------------------------
# Errors


def test_refusals_are_one_line(tmp_path, capsys):
    def hf_dir(name: str, edit=None, processor=None, **overrides) -> str:
        hf_vit(**overrides).save_pretrained(tmp_path / name)
        if edit:
            path = tmp_path / name / "config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
        if processor:
            (tmp_path / name / "preprocessor_config.json").write_text(json.dumps(processor))
        return str(tmp_path / name)

    out = str(tmp_path / "out")
    assert "hidden_act 'silu' has no omni counterpart" in cli_error(
        ["convert", hf_dir("silu", hidden_act="silu"), out], capsys)
    assert "ViTForMaskedImageModeling is not converted" in cli_error(
        ["convert", hf_dir("mim", {"architectures": ["ViTForMaskedImageModeling"]}), out], capsys)
    assert "size {'height': 48, 'width': 48}: the model takes 32 x 32 images" in cli_error(
        ["convert", hf_dir("size", processor={"size": {"height": 48, "width": 48}}), out], capsys)
    assert "resample 1: omni resizes with nearest (0), bilinear (2) or bicubic (3)" in cli_error(
        ["convert", hf_dir("lanczos", processor={"resample": 1}), out], capsys)
    assert "image_size=[32, 48] is not square" in cli_error(
        ["convert", hf_dir("wide", {"image_size": [32, 48]}), out], capsys)
    weights = tmp_path / "short" / "model.safetensors"
    hf_dir("short")
    tensors = load_file(str(weights))
    tensors.pop("vit.encoder.layer.1.output.dense.bias")
    from safetensors.torch import save_file

    save_file(tensors, str(weights))
    assert "missing encoder.layer.1.output.dense.bias" in cli_error(["convert", str(tmp_path / "short"), out],
                                                                    capsys)
    assert not (tmp_path / "out").exists()


def test_exports_hf_cannot_hold_are_refused(tmp_path):
    """Mean pooling with a head norm (the recipe's own ViT, timm's avg-pool ViTs) has no ViTForImageClassification."""
    image = ImageTokenizer(4, channels=1, image_size=28, policy="resize", cls=True, positions="sequence")
    trunk = TrunkConfig(d_model=32, n_layers=1, n_heads=2, positions="learned_1d", max_positions=50)
    model = ImageClassifier(image, trunk, 3)
    export = save_pretrained(model, tmp_path / "omni", model.export_config(), tokenizers={"image": image})
    with pytest.raises(ConversionError, match="HF's ViT cannot hold this export: it has pool 'mean'"):
        to_peer(export, tmp_path / "hf", "hf")


def test_recipe_starts_from_a_hf_vit(tiny_corpora, tmp_path):
    """recipes/vit.py --set init=<HF ViT directory>: 3 channels, 28 px, 5 -> 10 classes (a new zero head: the first
    evaluation is the uniform loss ln 10); the tuned export goes back to ViTForImageClassification."""
    from test_vit_recipe import load_recipe

    from omni.data.builders_vision import build_fashion_mnist

    shards = tmp_path / "shards"
    build_fashion_mnist(shards, source=tiny_corpora.fashion_mnist, quiet=True)
    hf_vit(seed=12, **{**SMALL, "image_size": 28, "patch_size": 7}).save_pretrained(tmp_path / "hf")
    metrics = load_recipe().main(["--preset", "tiny", "--data", str(shards), "--out", str(tmp_path / "run"), "--set",
                                  f"init={str(tmp_path / 'hf')!r}", "progress=False", "workers=0", "steps=1",
                                  "lr=1e-12", "pad=0", "limit_eval=64"])
    assert metrics["eval/loss"] == pytest.approx(math.log(10), abs=1e-6)
    back = ViTForImageClassification.from_pretrained(to_peer(tmp_path / "run" / "final", tmp_path / "back", "hf"))
    assert back.config.num_labels == 10 and back.config.num_channels == 3
    from omni.model import OmniModel

    other = OmniModel({}, TrunkConfig(d_model=16, n_layers=1, n_heads=2))
    save_pretrained(other, tmp_path / "other", other.export_config(), tokenizers={})
    with pytest.raises(ValueError, match="other: a 'omni' model; recipes/vit.py starts from an image classifier"):
        load_recipe().main(["--preset", "tiny", "--data", str(shards), "--out", str(tmp_path / "x"), "--set",
                            f"init={str(tmp_path / 'other')!r}", "steps=1"])
