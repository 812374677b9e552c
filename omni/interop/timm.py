"""timm Vision Transformers <-> omni image classifiers (omni.vision.ImageClassifier), exactly.

    config, state_dict, tokenizers = from_timm(timm_state_dict, timm_model("vit_base_patch16_224"))  # pure
    description, timm_state_dict = to_timm(config, state_dict, tokenizers["image"])                 # pure
    read_timm("timm/vit-b16")   # a timm hub directory (config.json + weights), or a state dict file with arch=
    write_timm("omni/vit-b16", "timm/tuned")   # config.json + model.safetensors (timm's save_for_hf):
                                               # timm.create_model("local-dir:timm/tuned", pretrained=True)

timm's VisionTransformer (vision_transformer.py: pre-norm blocks, no layer scale) is omni's ImageClassifier:

    patch_embed.proj (Conv2d, C x p x p)   embed.proj (Linear over (p1 p2 c) patch features: the kernel permuted)
    cls_token (1, 1, d)                    embed.cls_token (d,)
    pos_embed (1, 1 + N, d)                trunk.absolute.table: trunk positions "learned_1d", tokenizer positions
                                           "sequence" (one index per token, CLS first)
    blocks.i.norm1, attn.qkv, attn.proj    trunk.blocks.i.attn_norm, attn.qkv, attn.out
    blocks.i.norm2, mlp.fc1, mlp.fc2       trunk.blocks.i.mlp_norm, mlp.up, mlp.down
    norm                                   trunk.norm (without it, global_pool "avg": trunk final_norm False)
    fc_norm                                head.norm (head norm_eps; else None: the trunk's norm is the last)
    head                                   head.proj: pool "cls" for global_pool "token", "mean" for "avg"
    (nothing)                              embed.type_embedding: zero; added into the patch bias and the class
                                           token on the way back

Trunk: activation "gelu" (exact erf) or "gelu_tanh", norm_eps = timm's LayerNorm eps (1e-6), bias on (a bias
timm leaves out, e.g. qkv_bias=False, is a zero tensor in omni and is left out again, refused if no longer zero).
The tokenizer carries timm's data config: policy "crop" with timm's crop_pct resizes the shorter side to
floor(size / crop_pct) with timm's interpolation and cuts the centre, then mean / std; alpha is dropped as PIL's
convert("RGB") does. So ``omni predict`` preprocesses image files as timm's eval transform, to the bit (crop_mode
"center"), but for EXIF orientation, which omni applies and timm's PIL pipeline does not. crop_mode "squash" at
crop_pct 1 (the whole image to size x size, what omni's policy "resize" writes back) is policy "resize" (resized in
float: within the 8-bit rounding of timm's PIL resize); other crop modes are refused.

Refused, one line naming the architecture and the feature: other model classes, layer scale (init_values),
register tokens (reg_tokens), no_embed_class, CLIP-style pre_norm (a norm before the blocks, no patch bias), a
patch-embedding norm, qk / attention / MLP norms, attention heads of another width (attn_head_dim), projections
without bias (proj_bias=False), gated attention, attention pooling ("map") and other pools, "avg" pooling that
leaves the class token out, num_classes=0, norms with different eps, a non-square input, data configs with other
crop modes or resampling. fc_norm converts: it is the head norm (with "avg" or "token" pooling).
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from omni.deps import require
from omni.export_kinds import IMAGE_CLASSIFIER
from omni.heads import HEAD_NORM_EPS
from omni.interop.registry import (ConversionError, Converter, Export, check_tensors, names, read_config,
                                   read_directory, read_export, read_state_dict, register_converter)
from omni.tokenizers.image import ImageTokenizer
from omni.trunk import TrunkConfig
from omni.vision import POSITION_TABLE, ImageClassifier, head_options

FORMAT = "timm"
TYPE_EMBEDDING = "embed.type_embedding.weight"
PATCH_WEIGHT = "embed.proj.weight"
# omni name prefix -> timm name prefix; inside trunk.blocks.i / blocks.i, BLOCK_RENAMES
RENAMES = (("embed.proj.", "patch_embed.proj."), ("embed.cls_token", "cls_token"), (POSITION_TABLE, "pos_embed"),
           ("trunk.norm.", "norm."), ("head.norm.", "fc_norm."), ("head.proj.", "head."))
BLOCK_RENAMES = (("attn_norm.", "norm1."), ("attn.qkv.", "attn.qkv."), ("attn.out.", "attn.proj."),
                 ("mlp_norm.", "norm2."), ("mlp.up.", "mlp.fc1."), ("mlp.down.", "mlp.fc2."))
# describe()'s keys that are timm model arguments (norm_eps is not: timm's ViT norms are LayerNorm(eps=1e-6))
MODEL_ARGS = ("img_size", "patch_size", "in_chans", "num_classes", "embed_dim", "depth", "num_heads", "mlp_ratio",
              "qkv_bias", "class_token", "global_pool", "pool_include_prefix", "fc_norm", "final_norm", "act_layer")


def timm_name(key: str) -> str | None:
    """timm's name of an omni ImageClassifier tensor (None for the type embedding, which timm has not)."""
    if key.startswith("trunk.blocks."):
        i, _, rest = key.removeprefix("trunk.blocks.").partition(".")
        return next(f"blocks.{i}.{theirs}{rest[len(ours):]}" for ours, theirs in BLOCK_RENAMES if rest.startswith(ours))
    return next((theirs + key[len(ours):] for ours, theirs in RENAMES if key.startswith(ours)), None)


def timm_model(name: str, **model_args: Any) -> nn.Module:
    """timm's model ``name`` (an architecture, or "local-dir:PATH" of a hub directory) built from its own config
    with ``model_args`` on the meta device: structure and shapes, no weights, nothing downloaded."""
    timm = require("timm", extra="interop")
    if not name.startswith("local-dir:"):
        known_architecture(name)
    try:
        return timm.create_model(name, pretrained=False, device="meta", **model_args)
    except (TypeError, ValueError, AssertionError, RuntimeError) as exc:
        raise ConversionError(f"timm cannot build {name} with {model_args}: {exc}") from exc


def known_architecture(name: Any) -> None:
    """ConversionError unless timm's registry has an architecture ``name`` (with close names when it has not)."""
    timm = require("timm", extra="interop")
    if not isinstance(name, str) or not timm.is_model(name):
        close = difflib.get_close_matches(str(name), timm.list_models(), n=3)
        hint = f" (close: {', '.join(close)})" if close else ""
        raise ConversionError(f"unknown timm architecture {name!r}{hint}")


def _activation(act: nn.Module) -> str | None:
    from timm.layers.activations import GELU, GELUTanh

    if isinstance(act, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    return {GELU: "gelu", GELUTanh: "gelu_tanh"}.get(type(act))


def _unsupported(model: nn.Module) -> str | None:
    """What of a timm model omni's ImageClassifier cannot hold exactly (None: nothing)."""
    from timm.layers import Attention, Mlp, PatchEmbed
    from timm.models.vision_transformer import Block, VisionTransformer

    if type(model) is not VisionTransformer:
        return f"{type(model).__name__} is not timm's VisionTransformer (vision_transformer.py)"
    pe = model.patch_embed
    if type(pe) is PatchEmbed and not isinstance(pe.norm, nn.Identity):
        return "it has a norm on the patch embedding (embed_norm_layer)"
    if type(pe) is PatchEmbed and pe.proj.bias is None:
        return "it has a patch embedding without bias (CLIP-style, pre_norm)"
    if (type(pe) is not PatchEmbed or pe.proj.stride != pe.proj.kernel_size or pe.proj.padding != (0, 0)
            or pe.dynamic_img_pad or len(set(pe.img_size)) > 1):
        return "the patch embedding is not a square input cut into square patches (Conv2d, stride = kernel)"
    blocks = list(model.blocks)
    if any(type(b) is not Block or type(b.attn) is not Attention or type(b.mlp) is not Mlp for b in blocks):
        return "its blocks are not pre-norm Block(Attention, Mlp)"
    d = model.embed_dim
    norms = [m for b in blocks for m in (b.norm1, b.norm2)] + [m for m in (model.norm, model.fc_norm)
                                                               if not isinstance(m, nn.Identity)]
    problems = {
        f"register tokens (reg_tokens={model.num_reg_tokens})": model.reg_token is not None,
        "no_embed_class": model.no_embed_class,
        "no position table": model.pos_embed is None,
        "a norm before the blocks (CLIP-style pre_norm)": not isinstance(model.norm_pre, nn.Identity),
        f"global_pool {model.global_pool!r}": model.attn_pool is not None or model.global_pool not in ("token", "avg"),
        "'avg' pooling without the class token": (model.global_pool == "avg" and model.has_class_token
                                                  and not model.pool_include_prefix),
        "no classifier head (num_classes=0)": not isinstance(model.head, nn.Linear),
        "layer scale (init_values)": any(not isinstance(m, nn.Identity) for b in blocks for m in (b.ls1, b.ls2)),
        "qk, attention or MLP norms": any(not isinstance(m, nn.Identity) for b in blocks
                                          for m in (b.attn.q_norm, b.attn.k_norm, b.attn.norm, b.mlp.norm)),
        "gated attention": any(getattr(b.attn, "gate", None) is not None for b in blocks),
        "attention heads narrower or wider than embed_dim / num_heads (attn_head_dim)": any(
            b.attn.qkv.out_features != 3 * d or b.attn.proj.in_features != d for b in blocks),
        "projections without bias (proj_bias=False)": any(
            m.bias is None for b in blocks for m in (b.attn.proj, b.mlp.fc1, b.mlp.fc2)),
        "an activation other than GELU": any(_activation(b.mlp.act) is None for b in blocks),
        "norms other than LayerNorm with weight and bias": any(
            not isinstance(m, nn.LayerNorm) or m.weight is None or m.bias is None for m in norms),
        "norms with different eps": len({m.eps for m in norms if isinstance(m, nn.LayerNorm)}) > 1,
        "blocks of different sizes": len({(b.mlp.fc1.out_features, b.attn.num_heads) for b in blocks}) > 1,
    }
    return next((f"it has {what}" for what, bad in problems.items() if bad), None)


def _eval_transform(data: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """ImageTokenizer arguments for timm's data config (its input_size is the architecture's default, not the
    model's img_size: the model's is the tokenizer's image_size): crop_mode "center" is policy "crop" with its crop_pct,
    "squash" at crop_pct 1 is policy "resize" (the whole image to size x size); ConversionError for the rest."""
    mode, pct, interpolation = data.get("crop_mode", "center"), float(data.get("crop_pct", 1.0)), data["interpolation"]
    if interpolation not in ("bilinear", "bicubic", "nearest"):
        raise ConversionError(f"{arch}: timm's data config resamples with {interpolation!r}; omni resizes with "
                              "bilinear, bicubic or nearest")
    common = {"interpolation": interpolation, "mean": data["mean"], "std": data["std"]}
    if mode == "center":
        return {"policy": "crop", "crop_pct": pct, **common}
    if mode == "squash" and pct == 1.0:
        return {"policy": "resize", **common}
    raise ConversionError(f"{arch}: timm's data config crop_mode {mode!r} (crop_pct {pct}): omni preprocesses with a "
                          "centre crop, or a squash to the input size at crop_pct 1")


def describe(model: nn.Module) -> dict[str, Any]:
    """A timm ViT as its model arguments (MODEL_ARGS) and norm eps; ConversionError naming what omni cannot hold."""
    why = _unsupported(model)
    if why is not None:
        raise ConversionError(f"{model.pretrained_cfg.get('architecture', type(model).__name__)}: {why}; omni "
                              "converts timm's pre-norm VisionTransformer without layer scale")
    block, d = model.blocks[0], model.embed_dim
    fc_norm = not isinstance(model.fc_norm, nn.Identity)
    return {"img_size": model.patch_embed.img_size[0], "patch_size": model.patch_embed.patch_size[0],
            "in_chans": model.patch_embed.proj.in_channels, "num_classes": model.num_classes, "embed_dim": d,
            "depth": len(model.blocks), "num_heads": block.attn.num_heads, "mlp_ratio": block.mlp.fc1.out_features / d,
            "qkv_bias": block.attn.qkv.bias is not None, "class_token": model.has_class_token,
            "global_pool": model.global_pool,
            "pool_include_prefix": model.global_pool == "avg" and model.has_class_token,
            "fc_norm": fc_norm, "final_norm": fc_norm or not isinstance(model.norm, nn.Identity),
            "act_layer": _activation(block.mlp.act), "norm_eps": block.norm1.eps}


def _class_names(labels: Any, n: int) -> list[str] | None:
    """timm's label_names (a list, or {index: name}) as n class names, if it names every class."""
    if isinstance(labels, dict):
        labels = [labels.get(i, labels.get(str(i))) for i in range(n)]
    return [str(x) for x in labels] if isinstance(labels, (list, tuple)) and len(labels) == n and all(
        x is not None for x in labels) else None


def layout(key: str, tensor: Tensor, shape: torch.Size, to_timm: bool, image: ImageTokenizer) -> Tensor:
    """One tensor from omni's layout to timm's (or back; HF's ViT has timm's layout): the patch kernel
    (d, C, p, p) <-> (d, p * p * C), every other tensor reshaped ((1, 1, d) <-> (d,), (1, L, d) <-> (L, d))."""
    if key == PATCH_WEIGHT:
        p, c = image.patch_size, image.channels
        tensor = tensor.reshape(-1, p, p, c).permute(0, 3, 1, 2) if to_timm else tensor.permute(0, 2, 3, 1)
    if tensor.numel() != math.prod(shape):
        raise ConversionError(f"{key}: shape {tuple(tensor.shape)} does not fit {tuple(shape)}")
    return tensor.reshape(shape).detach().to("cpu", copy=True).contiguous()


# ----------------------------------------------------------------------------------------------------
# The pure conversions


def from_timm(state_dict: Mapping[str, Tensor], model: nn.Module, source: Mapping[str, Any] | None = None) -> Export:
    """A timm ViT's state dict and its architecture (``timm_model``) -> (export config, omni state dict,
    {"image": tokenizer}); ``omni.vision.build_image_classifier`` builds the model that loads it (strict).
    ``source`` (architecture, model_args) is recorded in the config, for the way back."""
    timm = require("timm", extra="interop")
    desc, arch = describe(model), model.pretrained_cfg.get("architecture", "")
    check_tensors(state_dict, {k: v.shape for k, v in model.state_dict().items()}, f"a timm {arch} state dict")
    data = timm.data.resolve_data_config({}, model=model)
    size, patch, cls = desc["img_size"], desc["patch_size"], desc["class_token"]
    image = ImageTokenizer(patch, channels=desc["in_chans"], image_size=size, cls=cls, positions="sequence",
                           alpha="drop", **_eval_transform(data, arch))
    trunk = TrunkConfig(d_model=desc["embed_dim"], n_layers=desc["depth"], n_heads=desc["num_heads"],
                        activation=desc["act_layer"], mlp_ratio=desc["mlp_ratio"], norm_eps=desc["norm_eps"],
                        final_norm=desc["final_norm"] and not desc["fc_norm"], positions="learned_1d",
                        max_positions=(size // patch) ** 2 + cls, bias=True)
    head_norm = desc["norm_eps"] if desc["fc_norm"] else None
    pool = "cls" if desc["global_pool"] == "token" else "mean"
    with torch.device("meta"):  # names and shapes only
        classifier = ImageClassifier(image, trunk, desc["num_classes"], pool=pool, norm_eps=head_norm)
    out = {}
    for key, target in classifier.state_dict().items():
        name = timm_name(key)
        if name in state_dict:
            out[key] = layout(key, state_dict[name], target.shape, False, image)
        else:  # the type embedding, or a bias timm leaves out
            out[key] = torch.zeros(target.shape)
    names = _class_names(model.pretrained_cfg.get("label_names"), desc["num_classes"])
    config = {**classifier.export_config(names),
              "source": {"format": FORMAT, "config": dict(source or {"architecture": arch})}}
    return config, out, {"image": image}


def _describe_export(trunk: TrunkConfig, head: Mapping[str, Any], image: ImageTokenizer,
                     state_dict: Mapping[str, Tensor]) -> dict[str, Any]:
    """An omni image classifier as describe() would see it in timm; ConversionError for what timm cannot hold."""
    head_norm = head.get("norm_eps", HEAD_NORM_EPS)
    problems = {
        f"positions {trunk.positions!r} (timm has one learned table: 'learned_1d')": trunk.positions != "learned_1d",
        f"{trunk.norm}, bias={trunk.bias}, n_kv_heads={trunk.n_kv_heads}, cross_attention={trunk.cross_attention} "
        "(timm: layernorm with bias, no GQA, no cross attention)":
            (trunk.norm, trunk.bias, trunk.kv_heads, trunk.cross_attention)
            != ("layernorm", True, trunk.n_heads, False),
        f"activation {trunk.activation!r}": trunk.activation not in ("gelu", "gelu_tanh"),
        "a final trunk norm and a head norm (timm has one of norm and fc_norm)":
            trunk.final_norm and head_norm is not None,
        f"a head norm eps {head_norm} other than the trunk's {trunk.norm_eps}":
            head_norm not in (None, trunk.norm_eps),
        f"pool {head['pool']!r} without a CLS token": head["pool"] == "cls" and not image.cls,
        "a tokenizer without a fixed square image_size": image.image_size is None or len(set(image.image_size)) > 1,
        f"attention patterns {trunk.attention} (timm's ViT attends fully: its logits would differ)":
            trunk.attention is not None,
    }
    why = next((what for what, bad in problems.items() if bad), None)
    if why is not None:
        raise ConversionError(f"timm's ViT cannot hold this export: it has {why}")
    qkv = [t for k, t in state_dict.items() if k.endswith("attn.qkv.bias")]
    return {"img_size": image.image_size[0], "patch_size": image.patch_size, "in_chans": image.channels,
            "num_classes": head["n_classes"], "embed_dim": trunk.d_model, "depth": trunk.n_layers,
            "num_heads": trunk.n_heads, "mlp_ratio": trunk.mlp_ratio,
            "qkv_bias": True if any(bool(t.any()) for t in qkv) else None,  # None: zero, either fits
            "class_token": image.cls, "global_pool": "token" if head["pool"] == "cls" else "avg",
            "pool_include_prefix": head["pool"] == "mean" and image.cls, "fc_norm": head_norm is not None,
            "final_norm": trunk.final_norm or head_norm is not None, "act_layer": trunk.activation,
            "norm_eps": trunk.norm_eps}


def to_timm(config: Mapping[str, Any], state_dict: Mapping[str, Tensor], image: ImageTokenizer | None,
            arch: str | None = None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """An image classifier export (config, state dict, tokenizer) -> ({"architecture", "model_args",
    "data_config", "label_names"}, timm state dict): ``timm.create_model(architecture, **model_args)`` loads the
    state dict (strict). ``arch`` defaults to the architecture the export was converted from."""
    if config.get("builder") != IMAGE_CLASSIFIER or image is None:
        raise ConversionError(f"timm's ViT is an image classifier; the export's builder is {config.get('builder')!r}")
    source = config.get("source", {})
    recorded = source.get("config", {}) if source.get("format") == FORMAT else {}
    arch = arch or recorded.get("architecture")
    if not arch:
        raise ConversionError("the export records no timm architecture: name one with --arch "
                              "(e.g. vit_base_patch16_224)")
    if config.get("stem"):  # timm's vit_* models project each patch; their hybrids have other stems
        raise ConversionError(f"timm's ViT cannot hold this export: it has a convolutional stem {config['stem']}")
    trunk, head = TrunkConfig(**config["trunk"]), head_options(config)
    wanted, default = _describe_export(trunk, head, image, state_dict), describe(timm_model(arch))
    source_args = recorded.get("model_args", {})
    if wanted["qkv_bias"] is None:  # zero qkv biases: as the source had them, else as the architecture has
        wanted["qkv_bias"] = source_args.get("qkv_bias", default["qkv_bias"])
    model_args = {k: v for k, v in source_args.items() if k not in MODEL_ARGS}
    model_args.update({k: wanted[k] for k in MODEL_ARGS if wanted[k] != default[k]})
    model = timm_model(arch, **model_args)
    got = describe(model)
    if got != wanted:  # a default that follows another argument (fc_norm follows global_pool): name it too
        model_args.update({k: wanted[k] for k in MODEL_ARGS if got[k] != wanted[k]})
        model = timm_model(arch, **model_args)
        got = describe(model)
    if got != wanted:
        differ = ", ".join(f"{k}: timm {got[k]!r}, export {wanted[k]!r}" for k in got if got[k] != wanted[k])
        raise ConversionError(f"{arch} cannot be made to match the export ({differ})")
    ours = {timm_name(k): k for k in state_dict if timm_name(k) is not None}
    theirs = {k: v.shape for k, v in model.state_dict().items()}
    if set(theirs) - set(ours):
        raise ConversionError(f"the export has no tensors for {arch}'s {names(set(theirs) - set(ours))}")
    out = {name: layout(ours[name], state_dict[ours[name]], shape, True, image) for name, shape in theirs.items()}
    for name, key in ours.items():
        if name not in out and bool(state_dict[key].any()):
            raise ConversionError(f"{key} is not zero, and {arch} (with {model_args}) has no {name}")
    kind = state_dict[TYPE_EMBEDDING].reshape(-1)  # timm has no type embedding: it goes into every token
    out["patch_embed.proj.bias"] = out["patch_embed.proj.bias"] + kind
    if image.cls:
        out["cls_token"] = out["cls_token"] + kind
    size = image.image_size[0]  # _describe_export checked: square
    crop = {"crop_pct": image.crop_pct, "crop_mode": "center"} if image.policy == "crop" else \
        {"crop_pct": 1.0, "crop_mode": "squash"}
    data = {"input_size": (image.channels, size, size), "interpolation": image.interpolation,
            "mean": tuple(image.mean), "std": tuple(image.std), **crop}
    return {"architecture": arch, "model_args": model_args, "data_config": data,
            "label_names": config.get("class_names")}, out


# ----------------------------------------------------------------------------------------------------
# Files


def recognises(src: Path, options: Mapping[str, Any]) -> bool:
    """A timm checkpoint: a directory whose config.json names an "architecture", or any file given an arch."""
    if src.is_file():
        return bool(options.get("arch"))
    try:
        settings = json.loads((src / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(settings, dict) and "architecture" in settings and "omni_format" not in settings


def read_timm(src: str | Path, arch: str | None = None) -> Export:
    """A timm hub directory (config.json with "architecture" + model.safetensors or pytorch_model.bin), or a bare
    state dict file of the timm architecture ``arch``, as an export (config, state dict, tokenizers)."""
    src = Path(src)
    if src.is_dir():
        settings = read_config(src)  # checked before the weights are read
        name = settings.get("architecture")
        if name is None:
            kind = settings.get("model_type")
            raise ConversionError(
                f"{src / 'config.json'} is a Hugging Face config (model_type {kind!r}), not timm's: convert it with "
                "--from hf" if kind is not None else f"{src / 'config.json'} names no timm \"architecture\": --from "
                "timm reads a timm hub directory (config.json with \"architecture\", as timm's save_for_hf writes "
                "it) or a state dict file with --arch")
        if arch and arch != name:
            raise ConversionError(f"{src} holds a {name} checkpoint, not {arch}")
        known_architecture(name)
        state_dict, settings = read_directory(src)
        model = timm_model(f"local-dir:{src.resolve()}")  # timm reads its own config.json
        return from_timm(state_dict, model, {"architecture": name, "model_args": settings.get("model_args", {})})
    if not src.exists():
        raise ConversionError(f"{src} does not exist")
    if not arch:
        raise ConversionError(f"{src} is a bare state dict: name its timm architecture with --arch "
                              "(e.g. vit_base_patch16_224)")
    state_dict = read_state_dict(src)
    head = state_dict.get("head.weight")
    return from_timm(state_dict, timm_model(arch, **({} if head is None else {"num_classes": head.shape[0]})))


def write_timm(export: str | Path, out: str | Path, arch: str | None = None) -> Path:
    """An omni image classifier export -> ``out``: config.json + model.safetensors, written by timm's own
    ``save_for_hf`` (``timm.create_model(f"local-dir:{out}", pretrained=True)`` loads it)."""
    timm = require("timm", extra="interop")
    config, state_dict, tokenizers = read_export(export)
    description, weights = to_timm(config, state_dict, tokenizers.get("image"), arch)
    model = timm_model(description["architecture"], **description["model_args"])
    model.load_state_dict(weights, strict=True, assign=True)
    names = {"label_names": description["label_names"]} if description["label_names"] else {}
    timm.models.save_for_hf(model, str(out), model_config=names, data_config=description["data_config"],
                            safe_serialization=True)
    return Path(out)


register_converter(Converter(FORMAT, recognises, read_timm, write_timm))

__all__ = ["describe", "from_timm", "layout", "read_timm", "timm_model", "timm_name", "to_timm", "write_timm"]
