"""timm ViTs <-> omni image classifiers (omni.interop.timm): exact logits, `omni predict` preprocessing as timm's
eval transform, the round trip back to timm's format, fine-tuning from a converted model, and one-line errors.

Peers are built from their own configs (pretrained=False: nothing downloads) with random weights at O(1) scale,
not the libraries' init (small weights hide mapping mistakes): matrices ~ N(0, 1/fan_in), biases ~ N(0, 0.1),
norm gains ~ N(1, 0.1), class token and position table ~ N(0, 1). CPU, fp32."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from _interop import cli_error, o1_weights
from test_vit_recipe import load_recipe

from omni.cli import main as omni_main
from omni.export import load_pretrained, load_tokenizers, save_pretrained
from omni.interop import ConversionError, convert, read_model, to_peer
from omni.tokenizers.image import ImageTokenizer, patchify
from omni.trunk import TrunkConfig
from omni.vision import ImageClassifier, adapt_classifier, resample_position_table

timm = pytest.importorskip("timm")
from timm.data import create_transform, resolve_data_config  # noqa: E402
from timm.layers import resample_abs_pos_embed  # noqa: E402
from timm.models import save_for_hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
SMALL = dict(img_size=32, patch_size=8, depth=2, embed_dim=64, num_heads=2, num_classes=7)  # a quick timm ViT


def o1(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random weights at O(1) scale (module docstring), in eval mode: the position tables ~ N(0, 1)."""
    return o1_weights(model, seed, by_module=False, unscaled=("pos_embed", "table"))


def timm_vit(arch: str = "vit_tiny_patch16_224", seed: int = 0, **kwargs) -> nn.Module:
    return o1(timm.create_model(arch, pretrained=False, **kwargs), seed)


def images(n: int, size: int, seed: int = 1) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def timm_logits(model: nn.Module, x: torch.Tensor, data: dict | None = None) -> torch.Tensor:
    """timm's logits on images x in [0, 1], normalised by ``data`` (default: the model's data config)."""
    data = data or resolve_data_config({}, model=model)
    mean, std = (torch.tensor(data[k]).view(1, -1, 1, 1) for k in ("mean", "std"))
    with torch.no_grad():
        return model((x - mean) / std)


def omni_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def hub_dir(model: nn.Module, path: Path, **config) -> Path:
    """The model as timm writes it for the Hugging Face hub (config.json + model.safetensors), no upload."""
    save_for_hf(model, str(path), model_config=config or None, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """vit_tiny_patch16_224 (O(1) weights, named classes) as a timm hub directory and its `omni convert` export."""
    root = tmp_path_factory.mktemp("tiny")
    model = timm_vit()
    names = [f"class{i}" for i in range(model.num_classes)]
    src = hub_dir(model, root / "timm", label_names=names)
    assert omni_main(["convert", str(src), str(root / "omni")]) == 0
    return model, src, root / "omni", names


# ----------------------------------------------------------------------------------------------------
# Exact logits


@pytest.mark.parametrize("arch,kwargs,via", [
    ("vit_tiny_patch16_224", {}, "directory"),
    ("vit_small_patch16_224", {}, "file"),
    ("vit_base_patch16_224", {}, "memory"),
    ("vit_tiny_patch16_224", {"global_pool": "avg", "class_token": False}, "directory"),
], ids=["tiny", "small", "base", "tiny-avg-no-cls"])
def test_converted_logits_equal_timm(arch, kwargs, via, tmp_path, capsys):
    peer = timm_vit(arch, seed=3, **kwargs)
    if via == "directory":  # hub layout: the architecture comes from config.json
        export = convert(hub_dir(peer, tmp_path / "timm"), tmp_path / "omni")
        model = load_pretrained(export)
    elif via == "file":  # a bare state dict (torch pickle) named by --arch
        torch.save(peer.state_dict(), tmp_path / "weights.pth")
        export = convert(tmp_path / "weights.pth", tmp_path / "omni", arch=arch)
        model = load_pretrained(export)
    else:  # vit_base: no disk round trip, a batch of 2 is enough
        config, state_dict, tokenizers = read_model_from(peer, arch)
        model = build(config, state_dict, tokenizers)
    x = images(2, 224)
    expected, got = timm_logits(peer, x), omni_logits(model, x)
    diff = (expected - got).abs().max().item()
    with capsys.disabled():
        print(f"\n{arch} {kwargs}: max |logit diff| {diff:.2e} (logits up to {expected.abs().max().item():.1f})")
    assert diff <= 1e-4
    assert expected.abs().max() > 1  # O(1) weights: logits far from zero, a mapping mistake would show
    if not kwargs.get("class_token", True):
        assert model.head.pool == "mean" and model.trunk.cfg.final_norm is False and model.head.norm_eps == 1e-6


def read_model_from(peer: nn.Module, arch: str):
    from omni.interop.timm import from_timm, timm_model

    return from_timm(peer.state_dict(), timm_model(arch))


def build(config, state_dict, tokenizers) -> ImageClassifier:
    from omni.vision import build_image_classifier

    model = build_image_classifier(config, tokenizers)
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def test_a_missing_qkv_bias_is_a_zero_bias(tmp_path):
    """qkv_bias=False: omni holds a zero bias (same logits) and leaves it out again on the way back (bit-exact)."""
    peer = timm_vit(seed=2, qkv_bias=False, **SMALL)
    export = convert(hub_dir(peer, tmp_path / "timm"), tmp_path / "omni")
    model = load_pretrained(export)
    assert not model.trunk.blocks[0].attn.qkv.bias.any()
    x = images(2, 32)
    assert (timm_logits(peer, x) - omni_logits(model, x)).abs().max() <= 1e-4
    back = timm.create_model(f"local-dir:{to_peer(export, tmp_path / 'back', 'timm')}", pretrained=True)
    assert back.state_dict().keys() == peer.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in peer.state_dict().items())


def test_export_records_the_architecture_and_data_config(tiny):
    _, _, export, names = tiny
    config = json.loads((export / "config.json").read_text())
    assert config["builder"] == "omni.vision:build_image_classifier" and config["class_names"] == names
    assert config["head"] == {"type": "classification", "n_classes": 1000, "pool": "cls", "norm_eps": None}
    trunk = config["trunk"]
    assert (trunk["positions"], trunk["max_positions"], trunk["activation"], trunk["norm_eps"], trunk["final_norm"]) \
        == ("learned_1d", 197, "gelu", 1e-6, True)
    tok = load_tokenizers(export)["image"].config()
    assert {k: tok[k] for k in ("policy", "image_size", "crop_pct", "interpolation", "positions", "cls", "alpha")} == \
        {"policy": "crop", "image_size": [224, 224], "crop_pct": 0.9, "interpolation": "bicubic",
         "positions": "sequence", "cls": True, "alpha": "drop"}
    assert config["source"]["format"] == "timm" and config["source"]["config"]["architecture"] == "vit_tiny_patch16_224"


# ----------------------------------------------------------------------------------------------------
# omni predict preprocesses as timm's eval transform


def odd_images(folder: Path) -> list[Path]:
    rng = np.random.default_rng(5)
    rgb = lambda h, w: rng.integers(0, 256, (h, w, 3), dtype=np.uint8)  # noqa: E731
    files = {
        "wide.png": Image.fromarray(rgb(200, 300)),
        "tall.jpg": Image.fromarray(rgb(331, 157)),
        "grey.png": Image.fromarray(rng.integers(0, 256, (97, 131), dtype=np.uint8)),
        "alpha.png": Image.fromarray(np.concatenate([rgb(250, 250), rng.integers(0, 256, (250, 250, 1),
                                                                                 dtype=np.uint8)], -1)),
        "palette.png": Image.fromarray(rgb(45, 61)).convert("P"),
        "tiny.png": Image.fromarray(rgb(13, 40)),
    }
    for name, img in files.items():
        img.save(folder / name)
    return [folder / name for name in files]


def test_predict_prints_timms_top5(tiny, tmp_path, capsys):
    model, _, export, names = tiny
    files = odd_images(tmp_path)
    transform = create_transform(**resolve_data_config({}, model=model))
    tokenizer = load_pretrained(export).tokenizer
    with torch.no_grad():
        pixels = torch.stack([transform(Image.open(f).convert("RGB")) for f in files])  # timm's own pipeline
        probs = model(pixels).softmax(-1)
    for f, x in zip(files, pixels):  # the same pixels, to the bit
        assert torch.equal(tokenizer.encode(f).tokens[1:, :-1], patchify(x, 16)), f.name
    capsys.readouterr()
    assert omni_main(["predict", "--checkpoint", str(export), "--device", "cpu", "--format", "json",
                      *map(str, files)]) == 0
    rows = json.loads(capsys.readouterr().out)
    for row, p in zip(rows, probs):
        top = p.topk(5)
        assert [e["label"] for e in row["top_k"]] == [names[i] for i in top.indices.tolist()], row["file"]
        assert [e["probability"] for e in row["top_k"]] == pytest.approx(top.values.tolist(), abs=1e-5)


# ----------------------------------------------------------------------------------------------------
# Back to timm


def test_timm_to_omni_to_timm_is_bit_exact(tiny, tmp_path):
    model, src, export, names = tiny
    out = to_peer(export, tmp_path / "back", "timm")
    from safetensors.torch import load_file

    state_dict = load_file(str(out / "model.safetensors"))
    fresh = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    fresh.load_state_dict(state_dict, strict=True)
    original = model.state_dict()
    assert set(state_dict) == set(original) and all(torch.equal(state_dict[k], v) for k, v in original.items())
    again = timm.create_model(f"local-dir:{out}", pretrained=True)  # timm reads our config.json, offline
    data = [{k: tuple(v) if isinstance(v, list) else v for k, v in resolve_data_config({}, model=m).items()}
            for m in (again, model)]
    assert data[0] == data[1]
    assert json.loads((out / "config.json").read_text())["label_names"] == names


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_an_omni_model_in_timms_format_gives_its_logits(pool, tmp_path):
    """An omni-built classifier (a type embedding timm has not, head norm instead of a final one for "mean")
    -> timm's format for --arch -> timm.create_model(arch, **model_args).load_state_dict(strict=True): same logits."""
    image = ImageTokenizer(8, image_size=32, policy="crop", crop_pct=0.875, interpolation="bicubic",
                           mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3), cls=True, positions="sequence", alpha="drop")
    trunk = TrunkConfig(d_model=64, n_layers=2, n_heads=2, activation="gelu", norm_eps=1e-6, positions="learned_1d",
                        max_positions=17, final_norm=pool == "cls")
    model = o1(ImageClassifier(image, trunk, 5, pool=pool, norm_eps=None if pool == "cls" else 1e-6), seed=4)
    export = save_pretrained(model, tmp_path / "omni", model.export_config(), tokenizers={"image": image})
    out = to_peer(export, tmp_path / "timm", "timm", arch="vit_tiny_patch16_224")
    config = json.loads((out / "config.json").read_text())
    from safetensors.torch import load_file

    peer = timm.create_model("vit_tiny_patch16_224", pretrained=False, **config["model_args"]).eval()
    peer.load_state_dict(load_file(str(out / "model.safetensors")), strict=True)
    data = resolve_data_config({}, model=timm.create_model(f"local-dir:{out}"))  # timm reads config.json
    assert (data["mean"], data["std"], data["interpolation"]) == ([0.4, 0.5, 0.6], [0.2, 0.25, 0.3], "bicubic")
    assert data["crop_pct"] == 0.875 and data["crop_mode"] == "center"
    x = images(3, 32)
    assert (timm_logits(peer, x, data) - omni_logits(model, x)).abs().max() <= 1e-5


# ----------------------------------------------------------------------------------------------------
# Fine-tuning


def test_position_table_resampling_is_timms():
    table = torch.randn(1 + 4 * 4, 8)
    for grid in ((2, 2), (6, 6), (3, 5)):
        expected = resample_abs_pos_embed(table[None], list(grid), old_size=[4, 4], num_prefix_tokens=1)[0]
        assert torch.equal(resample_position_table(table, (4, 4), grid, 1), expected)


def test_new_image_size_and_classes(tmp_path):
    """A converted model at another image size equals timm's at that size with timm's resampled pos_embed; another
    class count starts from a new, zero head."""
    peer = timm_vit(seed=6, **SMALL)
    config, state_dict, tokenizers = read_model(hub_dir(peer, tmp_path / "timm"))
    same = adapt_classifier(config, state_dict, tokenizers["image"], image_size=32, n_classes=7).eval()
    x = images(2, 32)
    assert (timm_logits(peer, x) - omni_logits(same, x)).abs().max() <= 1e-4  # the first forward is timm's

    bigger = adapt_classifier(config, state_dict, tokenizers["image"], image_size=48, n_classes=7).eval()
    resized = timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**SMALL, "img_size": 48}).eval()
    weights = dict(peer.state_dict())
    weights["pos_embed"] = resample_abs_pos_embed(weights["pos_embed"], [6, 6], old_size=[4, 4])
    resized.load_state_dict(weights, strict=True)
    x = images(2, 48)
    assert (timm_logits(resized, x) - omni_logits(bigger, x)).abs().max() <= 1e-4
    assert bigger.tokenizer.image_size == (48, 48) and bigger.tokenizer.resize == math.floor(48 / 0.9)

    other = adapt_classifier(config, state_dict, tokenizers["image"], image_size=32, n_classes=3).eval()
    assert torch.equal(omni_logits(other, x[:, :, :32, :32]), torch.zeros(2, 3))
    assert torch.equal(other.trunk.blocks[1].mlp.up.weight, same.trunk.blocks[1].mlp.up.weight)


def test_recipe_fine_tunes_a_timm_checkpoint(tiny_corpora, tmp_path):
    """recipes/vit.py --set init=<timm hub directory>: 3-channel, 28 px, 7 -> 10 classes (a new head starts at
    the uniform loss ln 10); a few steps lower the loss; the export is a timm-convertible classifier."""
    from omni.data.builders_vision import build_fashion_mnist

    shards = tmp_path / "shards"
    build_fashion_mnist(shards, source=tiny_corpora.fashion_mnist, quiet=True)
    src = hub_dir(timm_vit(seed=7, **{**SMALL, "img_size": 28, "patch_size": 7}), tmp_path / "timm")
    metrics = load_recipe().main(["--preset", "tiny", "--data", str(shards), "--out", str(tmp_path / "run"), "--set",
                                  f"init={src}", "progress=False", "workers=0", "steps=40", "lr=0.001", "pad=0",
                                  "limit_train=None", "limit_eval=None"])
    assert metrics["eval/loss"] < math.log(10) - 0.3, metrics
    tuned = load_pretrained(tmp_path / "run" / "final")
    assert tuned.head.proj.out_features == 10 and tuned.tokenizer.channels == 3
    assert tuned.trunk.cfg.attention is None  # no pattern asked for: the converted peer keeps full attention
    assert to_peer(tmp_path / "run" / "final", tmp_path / "back", "timm").is_dir()


# ----------------------------------------------------------------------------------------------------
# Errors


def test_cli_errors_are_one_line(tiny, tmp_path, capsys):
    model, src, export, _ = tiny
    torch.save(model.state_dict(), tmp_path / "w.pt")
    assert "unknown timm architecture 'vit_tiny_patch16_22' (close: vit_tiny_patch16_224" in cli_error(
        ["convert", str(tmp_path / "w.pt"), str(tmp_path / "a"), "--arch", "vit_tiny_patch16_22"], capsys)
    assert "w.pt is a bare state dict: name its timm architecture with --arch" in cli_error(
        ["convert", str(tmp_path / "w.pt"), str(tmp_path / "a"), "--from", "timm"], capsys)
    assert "blocks.0.attn.proj.bias: shape (192,), a timm vit_small_patch16_224 state dict has (384,)" in cli_error(
        ["convert", str(tmp_path / "w.pt"), str(tmp_path / "a"), "--arch", "vit_small_patch16_224"], capsys)
    assert "missing.pt does not exist" in cli_error(
        ["convert", str(tmp_path / "missing.pt"), str(tmp_path / "a"), "--arch", "vit_tiny_patch16_224"], capsys)
    assert "exists and is not empty" in cli_error(["convert", str(src), str(export)], capsys)
    assert "is already an omni export" in cli_error(["convert", str(export), str(tmp_path / "a")], capsys)
    assert "not an omni export directory" in cli_error(["convert", "--to", "timm", str(src), str(tmp_path / "a")],
                                                       capsys)
    scaled = timm_vit(seed=1, init_values=1e-5, **SMALL)
    assert "it has layer scale (init_values)" in cli_error(
        ["convert", str(hub_dir(scaled, tmp_path / "ls")), str(tmp_path / "a")], capsys)
    assert not (tmp_path / "a").exists()


def test_exports_timm_cannot_hold_are_refused(tmp_path):
    """The recipe's own ViT (factorised positions, a head norm after the final norm) has no timm counterpart."""
    image = ImageTokenizer(4, channels=1, image_size=28, policy="resize")
    trunk = TrunkConfig(d_model=32, n_layers=1, n_heads=2, positions="learned", max_positions=7)
    model = ImageClassifier(image, trunk, 3)
    export = save_pretrained(model, tmp_path / "omni", model.export_config(), tokenizers={"image": image})
    with pytest.raises(ConversionError, match="timm's ViT cannot hold this export: it has positions 'learned'"):
        to_peer(export, tmp_path / "timm", "timm", arch="vit_tiny_patch16_224")
    with pytest.raises(ValueError, match="positions='sequence'"):
        ImageClassifier(image, TrunkConfig(d_model=32, n_layers=1, n_heads=2, positions="learned_1d"), 3)


def test_legacy_exports_and_defaults_unchanged(tmp_path):
    """Exports written before the head spec (n_classes / pool) load as before; the defaults add no tensors."""
    image = ImageTokenizer(4, channels=1, image_size=8, policy="resize")
    trunk = TrunkConfig(d_model=16, n_layers=1, n_heads=2, positions="learned", max_positions=2)
    model = ImageClassifier(image, trunk, 3)
    assert model.export_config()["head"] == {"type": "classification", "n_classes": 3, "pool": "mean"}
    assert isinstance(model.head.norm, nn.LayerNorm) and model.head.norm.eps == 1e-5
    assert "trunk.norm.weight" in model.state_dict()
    legacy = {"builder": "omni.vision:build_image_classifier", "trunk": trunk.to_dict(), "n_classes": 3, "pool": "mean"}
    legacy["trunk"].pop("final_norm")
    save_pretrained(model, tmp_path / "old", legacy, tokenizers={"image": image})
    x = torch.rand(2, 1, 8, 8)
    torch.testing.assert_close(omni_logits(load_pretrained(tmp_path / "old"), x), omni_logits(model.eval(), x))


def test_crop_policy_tokenizer():
    """policy "crop" = torchvision Resize(resize) + CenterCrop(image_size); 8-bit images through PIL (exact), others
    through torch; its settings survive save / load."""
    from torchvision.transforms import v2

    tok = ImageTokenizer(8, image_size=16, policy="crop", crop_pct=0.8, interpolation="bicubic", positions="sequence")
    assert tok.resize == 20
    img = np.random.default_rng(0).integers(0, 256, (30, 45, 3), dtype=np.uint8)
    expected = v2.Compose([v2.Resize(20, interpolation=v2.InterpolationMode.BICUBIC), v2.CenterCrop(16),
                           v2.PILToTensor()])(Image.fromarray(img)).float() / 255
    seg = tok.encode(img)
    assert torch.equal(seg.tokens, patchify((expected - 0.5) / 0.5, 8))
    assert seg.positions.tolist() == [[i, i] for i in range(4)]
    floats = tok.encode(torch.rand(3, 30, 45)).tokens  # not 8-bit: torch's kernel, clamped
    assert floats.shape == (4, 192) and floats.abs().max() <= 1
    batch_tokens, positions, _ = tok.encode_batch(torch.from_numpy(img).permute(2, 0, 1)[None])
    assert torch.equal(batch_tokens[0], seg.tokens) and torch.equal(positions, seg.positions)
    assert ImageTokenizer(**tok.config()).config() == tok.config()
    with pytest.raises(ValueError, match="policy='crop' needs image_size"):
        ImageTokenizer(8, policy="crop")
    with pytest.raises(ValueError, match="crop_pct is the centre crop's share"):
        ImageTokenizer(8, image_size=16, crop_pct=0.9)


# ----------------------------------------------------------------------------------------------------
# What omni's ImageClassifier cannot hold is refused, naming the architecture and the feature


@pytest.mark.parametrize("kwargs,feature", [
    ({"init_values": 1e-5}, "layer scale (init_values)"),
    ({"reg_tokens": 4}, "register tokens (reg_tokens=4)"),
    ({"pre_norm": True}, "a patch embedding without bias (CLIP-style, pre_norm)"),
    ({"no_embed_class": True}, "no_embed_class"),
    ({"qk_norm": True}, "qk, attention or MLP norms"),
    ({"scale_mlp_norm": True}, "qk, attention or MLP norms"),
    ({"proj_bias": False}, "projections without bias (proj_bias=False)"),
    ({"global_pool": "map"}, "global_pool 'map'"),
    ({"global_pool": "avg", "pool_include_prefix": False}, "'avg' pooling without the class token"),
    ({"num_classes": 0}, "no classifier head (num_classes=0)"),
    ({"img_size": (32, 48)}, "not a square input"),
], ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_unsupported_timm_features_are_refused(kwargs, feature):
    from omni.interop.timm import describe, timm_model

    with pytest.raises(ConversionError) as info:
        describe(timm_model("vit_tiny_patch16_224", **{**SMALL, **kwargs}))
    message = str(info.value)
    assert message.startswith("vit_tiny_patch16_224: ") and feature in message and "\n" not in message, message


def test_attention_heads_of_another_width_are_refused():
    """attn_head_dim is an Attention argument (no VisionTransformer one): a timm ViT with such blocks."""
    from timm.layers import Attention

    from omni.interop.timm import describe, timm_model

    model = timm_model("vit_tiny_patch16_224", **SMALL)
    for block in model.blocks:
        block.attn = Attention(64, num_heads=2, qkv_bias=True, attn_head_dim=16, device="meta")
    with pytest.raises(ConversionError, match="attention heads narrower or wider than embed_dim / num_heads"):
        describe(model)


@pytest.mark.parametrize("mode,pct,refused", [("center", 0.9, False), ("squash", 1.0, False),
                                              ("squash", 0.9, True), ("border", 0.9, True)])
def test_data_config_crop_modes(mode, pct, refused):
    """timm's eval crop: "center" is policy crop, "squash" at crop_pct 1 policy resize; others are refused."""
    from omni.interop.timm import from_timm

    peer = timm_vit(seed=12, **SMALL)
    peer.pretrained_cfg = {**peer.pretrained_cfg, "crop_mode": mode, "crop_pct": pct}
    if refused:
        with pytest.raises(ConversionError, match=f"vit_tiny_patch16_224: timm's data config crop_mode '{mode}'"):
            from_timm(peer.state_dict(), peer)
        return
    config, state_dict, tokenizers = from_timm(peer.state_dict(), peer)
    tok = tokenizers["image"]
    assert (tok.policy, tok.crop_pct) == (("crop", 0.9) if mode == "center" else ("resize", None))
    x = images(2, 32)
    assert (timm_logits(peer, x) - omni_logits(build(config, state_dict, tokenizers), x)).abs().max() <= 1e-4


@pytest.mark.parametrize("kwargs", [{"global_pool": "token", "fc_norm": True},
                                    {"global_pool": "avg", "fc_norm": False, "pool_include_prefix": True}],
                         ids=["token-fc-norm", "avg-final-norm"])
def test_fc_norm_either_way_converts(kwargs, tmp_path):
    """fc_norm is the head norm (no trunk norm); "avg" without it pools after the trunk's final norm: both exact,
    both back to timm bit-exact."""
    peer = timm_vit(seed=13, **{**SMALL, **kwargs})
    export = convert(hub_dir(peer, tmp_path / "timm"), tmp_path / "omni")
    model = load_pretrained(export)
    x = images(2, 32)
    assert (timm_logits(peer, x) - omni_logits(model, x)).abs().max() <= 1e-4
    assert (model.head.norm_eps is not None) == kwargs["fc_norm"] and model.trunk.cfg.final_norm != kwargs["fc_norm"]
    back = timm.create_model(f"local-dir:{to_peer(export, tmp_path / 'back', 'timm')}", pretrained=True)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in peer.state_dict().items())
