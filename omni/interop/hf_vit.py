"""Hugging Face ViTs (config.json model_type "vit") <-> omni image classifiers (omni.vision.ImageClassifier), exactly.

    config, state_dict, tokenizers = from_hf(hf_state_dict, hf_config, processor_config)   # pure
    hf_config, processor_config, hf_state_dict = to_hf(config, state_dict, tokenizers["image"])  # pure
    omni convert hf-vit/ runs/vit          # a ViTForImageClassification or ViTModel directory
    omni convert --to hf runs/vit out/     # ViTForImageClassification.from_pretrained(out) loads it

The same ImageClassifier the timm converter makes (omni.interop.timm): HF's ViT is timm's token-pooled ViT with
the query, key and value projections kept apart and its own names.

    embeddings.patch_embeddings.projection   embed.proj (Linear over (p1 p2 c) patch features: kernel permuted)
    embeddings.cls_token (1, 1, d)           embed.cls_token (d,)
    embeddings.position_embeddings (1, L, d) trunk.absolute.table: trunk positions "learned_1d", tokenizer
                                             positions "sequence" (CLS first)
    encoder.layer.i.layernorm_before         trunk.blocks.i.attn_norm
    ....attention.attention.query/key/value  trunk.blocks.i.attn.qkv (rows [q; k; v], as timm's qkv)
    ....attention.output.dense               trunk.blocks.i.attn.out
    encoder.layer.i.layernorm_after          trunk.blocks.i.mlp_norm
    ....intermediate.dense / output.dense    trunk.blocks.i.mlp.up / mlp.down
    layernorm                                trunk.norm (every token; the CLS row goes to the classifier)
    classifier                               head.proj, pool "cls", no head norm
    (nothing)                                embed.type_embedding: zero; added into the patch bias and the
                                             class token on the way back

ViTForImageClassification checkpoints carry the prefix "vit."; ViTModel checkpoints (backbones) have none and no
classifier: they become a classifier with no classes, which ``recipes/vit.py --set init=`` gives this run's head.
Their pooler (dense + tanh on the CLS row; ViTForImageClassification has none) and mask token are not on the
classification path: they are carried (``ImageClassifier(carried=...)``, state dict ``carried.pooler/dense/weight``
...) and written back, so HF -> omni -> HF gives every tensor back bit for bit. Names as transformers 5 builds them in memory (layers.i.attention.q_proj, ...)
are read too; files are written with the checkpoint names above, as ``save_pretrained`` writes them.

Trunk: activation "gelu" (erf) for hidden_act gelu, "gelu_tanh" for gelu_new / gelu_pytorch_tanh, "relu";
norm_eps = layer_norm_eps (1e-12 by default), mlp_ratio = intermediate_size / hidden_size, dropout =
hidden_dropout_prob (the residual branches'); attention-probability dropout has no omni counterpart (inference
is the same). qkv_bias=False is a zero bias in omni, left out again on the way back (refused if no longer zero).

The tokenizer carries the image processor (preprocessor_config.json when present, else ViTImageProcessor's
defaults: 224 x 224 bilinear, mean = std = 0.5): ``size`` {height, width} is policy "resize" to that square
(aspect not kept, as ViTImageProcessor); ``size`` {shortest_edge} with ``do_center_crop`` and a square
``crop_size`` is policy "crop" (the shorter side resized, the centre cut: timm's eval transform, what
BitImageProcessor / ConvNextImageProcessor do); ``resample`` nearest, bilinear or bicubic; ``rescale_factor``
1/255; ``image_mean`` / ``image_std`` (the identity when ``do_normalize`` is false); alpha dropped as
``convert_rgb``. omni resizes 8-bit images in float, not in PIL's 8-bit pipeline, so pixels can differ from
HF's by the 8-bit rounding.

Refused, one line naming it: other architectures (masked image modelling), other activations, a processor size
other than the model's image_size, non-square images or patches, other resampling or rescaling, a head_dim
other than hidden_size / num_attention_heads; on the way back, exports HF's ViT cannot hold (mean pooling, a head
norm, other positions or norms, grouped-query attention).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from omni.heads import HEAD_NORM_EPS
from omni.interop.hf import HFFamily, register_hf_family, write_hf_files
from omni.interop.registry import (ConversionError, Export, cast_tensors, names, read_directory, read_export,
                                   source_dtype)
from omni.interop.timm import PATCH_WEIGHT, TYPE_EMBEDDING, layout
from omni.tokenizers.image import ImageTokenizer
from omni.trunk import TrunkConfig
from omni.vision import BUILDER, POSITION_TABLE, ImageClassifier, head_options

MODEL_TYPE = "vit"
SOURCE_FORMAT = "transformers:" + MODEL_TYPE
PROCESSOR_NAME = "preprocessor_config.json"
ARCHITECTURES = ("ViTForImageClassification", "ViTModel")
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
# PIL's resampling filters (PILImageResampling) as preprocessor_config.json writes them, and omni's
RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}
PIL_RESAMPLE = {name: code for code, name in RESAMPLE.items()}
# ViTImageProcessor's defaults: what a directory without preprocessor_config.json is preprocessed with
PROCESSOR_DEFAULTS = {"do_resize": True, "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255,
                      "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
# omni name inside trunk.blocks.i -> HF checkpoint name inside encoder.layer.i (q, k, v: split from attn.qkv)
BLOCK = (("attn_norm", "layernorm_before"), ("attn.out", "attention.output.dense"), ("mlp_norm", "layernorm_after"),
         ("mlp.up", "intermediate.dense"), ("mlp.down", "output.dense"))
QKV = ("query", "key", "value")
# transformers 5's in-memory names -> the checkpoint names (regex, replacement)
RUNTIME_NAMES = ((r"^layers\.(\d+)\.attention\.q_proj\.", r"encoder.layer.\1.attention.attention.query."),
                 (r"^layers\.(\d+)\.attention\.k_proj\.", r"encoder.layer.\1.attention.attention.key."),
                 (r"^layers\.(\d+)\.attention\.v_proj\.", r"encoder.layer.\1.attention.attention.value."),
                 (r"^layers\.(\d+)\.attention\.o_proj\.", r"encoder.layer.\1.attention.output.dense."),
                 (r"^layers\.(\d+)\.mlp\.fc1\.", r"encoder.layer.\1.intermediate.dense."),
                 (r"^layers\.(\d+)\.mlp\.fc2\.", r"encoder.layer.\1.output.dense."),
                 (r"^layers\.(\d+)\.", r"encoder.layer.\1."))
CARRIED = ("pooler.", "embeddings.mask_token")  # ViTModel's pooler and mask token: off the classifier's path, carried


def checkpoint_name(key: str) -> str:
    """A HF ViT tensor's name without the "vit." prefix, in checkpoint form (module docstring)."""
    key = key.removeprefix("vit.")
    for pattern, replacement in RUNTIME_NAMES:
        key, n = re.subn(pattern, replacement, key)
        if n:
            break
    return key


def _square(value: Any, name: str) -> int:
    """An int, or a [h, w] pair with h == w, as that int; ValueError naming ``name`` otherwise."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"{name}={list(value)} is not square; omni converts square images and patches")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is not a positive integer")
    return value


def trunk_config(hf: Mapping[str, Any]) -> TrunkConfig:
    """The TrunkConfig of a HF ViTConfig (dict); ValueError for what omni cannot express."""
    act = hf.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} has no omni counterpart; supported: {', '.join(ACTIVATIONS)}")
    d, heads = int(hf.get("hidden_size", 768)), int(hf.get("num_attention_heads", 12))
    if d % heads or int(hf.get("head_dim") or d // heads) != d // heads:
        raise ValueError(f"head_dim {hf.get('head_dim')} with hidden_size {d} and {heads} heads: omni's heads "
                         "split hidden_size evenly")
    inner = int(hf.get("intermediate_size", 4 * d))
    grid = _square(hf.get("image_size", 224), "image_size") // _square(hf.get("patch_size", 16), "patch_size")
    cfg = TrunkConfig(d_model=d, n_layers=int(hf.get("num_hidden_layers", 12)), n_heads=heads,
                      activation=ACTIVATIONS[act], mlp_ratio=inner / d, norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
                      final_norm=True, positions="learned_1d", max_positions=grid * grid + 1, bias=True,
                      dropout=float(hf.get("hidden_dropout_prob", 0.0)))
    if int(cfg.mlp_ratio * d) != inner:
        raise ValueError(f"intermediate_size={inner} is not representable as mlp_ratio * hidden_size={d}")
    return cfg


def image_tokenizer(hf: Mapping[str, Any], processor: Mapping[str, Any] | None) -> ImageTokenizer:
    """The ImageTokenizer of a ViTConfig and its image processor settings (preprocessor_config.json; None:
    ViTImageProcessor's defaults at the model's image size); ValueError for what omni cannot express."""
    size, channels = _square(hf.get("image_size", 224), "image_size"), int(hf.get("num_channels", 3))
    given = dict(processor or {"size": {"height": size, "width": size}})
    p = {**PROCESSOR_DEFAULTS, **given}
    if p["do_rescale"] and not math.isclose(float(p["rescale_factor"]), 1 / 255, rel_tol=1e-6):
        raise ValueError(f"rescale_factor {p['rescale_factor']}: omni reads 8-bit images as x / 255")
    if not p["do_rescale"]:
        raise ValueError("do_rescale false (pixels fed as 0..255): omni reads 8-bit images as x / 255")
    resample = p["resample"]
    if resample not in RESAMPLE:
        raise ValueError(f"resample {resample!r}: omni resizes with nearest (0), bilinear (2) or bicubic (3)")
    shape = p.get("size") or {}
    crop = {}
    if p.get("do_center_crop"):
        short, cut = shape.get("shortest_edge"), p.get("crop_size") or {}
        if not short or cut.get("height") != cut.get("width") or cut.get("height") != size:
            raise ValueError(f"size {shape} with crop_size {cut}: omni crops a square of the model's image_size "
                             f"({size}) after resizing the shorter side (size {{'shortest_edge': N}})")
        pct = size / short
        if math.floor(size / pct) != short:  # ImageTokenizer resizes to floor(image_size / crop_pct)
            raise ValueError(f"shortest_edge {short} with crop {size} is not a crop_pct omni can hold")
        crop = {"policy": "crop", "crop_pct": pct}
    elif shape.get("height") == shape.get("width") == size or shape.get("shortest_edge") == size:
        crop = {"policy": "resize"}
    else:
        raise ValueError(f"size {shape}: the model takes {size} x {size} images (the processor must resize to "
                         "them, or resize the shorter side and centre-crop them)")
    mean, std = (p["image_mean"], p["image_std"]) if p["do_normalize"] else ([0.0] * channels, [1.0] * channels)
    try:
        return ImageTokenizer(_square(hf.get("patch_size", 16), "patch_size"), channels=channels, image_size=size,
                              interpolation=RESAMPLE[resample], mean=mean, std=std, cls=True,
                              positions="sequence", alpha="drop", **crop)
    except ValueError as exc:  # mean / std of another channel count, a size not a multiple of the patch
        raise ValueError(f"the image processor does not fit the model: {exc}") from exc


def _class_names(hf: Mapping[str, Any], n: int) -> list[str] | None:
    """id2label as n class names (None for HF's placeholder LABEL_i names or a partial mapping)."""
    labels = hf.get("id2label") or {}
    names = [labels.get(str(i), labels.get(i)) for i in range(n)]
    if n == 0 or any(x is None for x in names) or names == [f"LABEL_{i}" for i in range(n)]:
        return None
    return [str(x) for x in names]


# ----------------------------------------------------------------------------------------------------
# The pure conversions


def from_hf(state_dict: Mapping[str, Tensor], hf_config: Mapping[str, Any],
            processor: Mapping[str, Any] | None = None) -> Export:
    """A HF ViTForImageClassification's (or ViTModel's) state dict, config dict and image processor settings ->
    (export config, omni state dict, {"image": tokenizer}); ``omni.vision.build_image_classifier`` builds the
    model that loads it (strict). ValueError for what omni cannot express."""
    if hf_config.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise ValueError(f"model_type is {hf_config.get('model_type')!r}, not {MODEL_TYPE!r}")
    other = [a for a in hf_config.get("architectures") or [] if a not in ARCHITECTURES]
    if other:
        raise ValueError(f"{other[0]} is not converted (omni converts {' and '.join(ARCHITECTURES)})")
    trunk, image = trunk_config(hf_config), image_tokenizer(hf_config, processor)
    sd = {checkpoint_name(k): v for k, v in state_dict.items()}
    carried = {k: v for k, v in sd.items() if k.startswith(CARRIED)}
    sd = {k: v for k, v in sd.items() if k not in carried}
    n_classes = sd["classifier.weight"].shape[0] if "classifier.weight" in sd else 0
    with torch.device("meta"):  # names and shapes only
        classifier = ImageClassifier(image, trunk, n_classes, pool="cls", norm_eps=None,
                                     carried={k: list(v.shape) for k, v in sorted(carried.items())})
    target = {k: v.shape for k, v in classifier.state_dict().items()}
    pairs = tensor_names(trunk.n_layers, bool(hf_config.get("qkv_bias", True)), n_classes > 0)
    expected = {h for _, hf in pairs for h in ((hf,) if isinstance(hf, str) else hf)}
    if set(sd) != expected:
        raise ValueError(f"not a HF ViT state dict of this config: missing {names(expected - set(sd))}; "
                         f"unexpected {names(set(sd) - expected)}")
    out: dict[str, Tensor] = {}
    for key, hf in pairs:
        tensor = sd[hf] if isinstance(hf, str) else torch.cat([sd[h] for h in hf])
        if tensor.numel() != math.prod(target[key]):
            shown = hf if isinstance(hf, str) else hf[0]
            raise ValueError(f"{shown}: shape {tuple(sd[shown].shape)} does not fit the config "
                             f"(omni {key}: {tuple(target[key])})")
        out[key] = layout(key, tensor, target[key], False, image)
    out.update({f"carried.{k.replace('.', '/')}": v for k, v in carried.items()})
    for key, shape in target.items():
        out.setdefault(key, torch.zeros(shape))  # the type embedding; qkv biases when qkv_bias is false
    config = {**classifier.export_config(_class_names(hf_config, n_classes)),
              "source": {"format": SOURCE_FORMAT, "config": dict(hf_config),
                         **({"processor": dict(processor)} if processor else {}),
                         **({"dtype": dtype} if (dtype := source_dtype(state_dict)) else {})}}
    return config, out, {"image": image}


def tensor_names(n_layers: int, qkv_bias: bool, classifier: bool) -> list[tuple[str, str | tuple[str, ...]]]:
    """(omni name, HF checkpoint name without "vit.") for every mapped tensor; a tuple of three names for
    the fused qkv (rows [query; key; value])."""
    pairs: list[tuple[str, str | tuple[str, ...]]] = [
        (PATCH_WEIGHT, "embeddings.patch_embeddings.projection.weight"),
        ("embed.proj.bias", "embeddings.patch_embeddings.projection.bias"),
        ("embed.cls_token", "embeddings.cls_token"), (POSITION_TABLE, "embeddings.position_embeddings"),
        ("trunk.norm.weight", "layernorm.weight"), ("trunk.norm.bias", "layernorm.bias")]
    if classifier:
        pairs += [("head.proj.weight", "classifier.weight"), ("head.proj.bias", "classifier.bias")]
    for i in range(n_layers):
        ours, theirs = f"trunk.blocks.{i}.", f"encoder.layer.{i}."
        qkv = tuple(f"{theirs}attention.attention.{x}." for x in QKV)
        pairs.append((f"{ours}attn.qkv.weight", tuple(q + "weight" for q in qkv)))
        if qkv_bias:
            pairs.append((f"{ours}attn.qkv.bias", tuple(q + "bias" for q in qkv)))
        pairs += [(f"{ours}{o}.{w}", f"{theirs}{h}.{w}") for o, h in BLOCK for w in ("weight", "bias")]
    return pairs


def processor_config(image: ImageTokenizer) -> dict[str, Any]:
    """preprocessor_config.json for an image tokenizer: ViTImageProcessor for policy "resize" (a square of
    image_size), BitImageProcessor for "crop" (shorter side resized, centre cut); ValueError for others."""
    size = image.image_size[0] if image.image_size else None
    common = {"do_resize": True, "resample": PIL_RESAMPLE[image.interpolation], "do_rescale": True,
              "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(image.mean),
              "image_std": list(image.std), "do_convert_rgb": image.channels == 3}
    if image.policy == "resize":
        return {"image_processor_type": "ViTImageProcessor", **common, "size": {"height": size, "width": size}}
    if image.policy == "crop":
        return {"image_processor_type": "BitImageProcessor", **common, "size": {"shortest_edge": image.resize},
                "do_center_crop": True, "crop_size": {"height": size, "width": size}}
    raise ValueError(f"tokenizer policy {image.policy!r}: HF's image processors resize (or resize and crop) to a "
                     "fixed size")


def to_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor], image: ImageTokenizer | None
          ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Tensor]]:
    """An image classifier export (config, state dict, tokenizer) -> (HF config dict, preprocessor_config.json
    dict, HF state dict) for ``ViTForImageClassification`` (``ViTModel`` for an export without classes). A model
    converted from HF gives back its source config and every tensor; ValueError for what HF cannot express."""
    if config.get("builder") != BUILDER or image is None:
        raise ValueError(f"HF's ViT is an image classifier; the export's builder is {config.get('builder')!r}")
    trunk, head = TrunkConfig(**config["trunk"]), head_options(config)
    problems = {
        f"a convolutional stem {config.get('stem')} (HF's ViT projects each patch)": bool(config.get("stem")),
        f"positions {trunk.positions!r} (HF's ViT has one learned table: 'learned_1d')":
            trunk.positions != "learned_1d",
        f"{trunk.norm}, bias={trunk.bias}, n_kv_heads={trunk.n_kv_heads}, cross_attention={trunk.cross_attention} "
        "(HF: layernorm with bias, no GQA, no cross attention)":
            (trunk.norm, trunk.bias, trunk.kv_heads, trunk.cross_attention)
            != ("layernorm", True, trunk.n_heads, False),
        f"activation {trunk.activation!r}": trunk.activation not in HF_ACTIVATIONS,
        f"pool {head['pool']!r} (HF's ViT classifies the CLS token)": head["pool"] != "cls" or not image.cls,
        "a head norm, or no final norm (HF's ViT ends on one layernorm over every token)":
            head.get("norm_eps", HEAD_NORM_EPS) is not None or not trunk.final_norm,
        "a tokenizer without a fixed square image_size": image.image_size is None or len(set(image.image_size)) > 1,
        f"attention patterns {trunk.attention} (HF's ViT attends fully: its logits would differ)":
            trunk.attention is not None,
    }
    why = next((what for what, bad in problems.items() if bad), None)
    if why is not None:
        raise ValueError(f"HF's ViT cannot hold this export: it has {why}")
    source = config.get("source", {})
    source_cfg = dict(source.get("config", {})) if source.get("format") == SOURCE_FORMAT else {}
    n_classes, d, size = head["n_classes"], trunk.d_model, image.image_size[0]
    zero_qkv = all(not bool(t.any()) for k, t in state_dict.items() if k.endswith("attn.qkv.bias"))
    qkv_bias = bool(source_cfg.get("qkv_bias", True)) if zero_qkv else True
    sd: dict[str, Tensor] = {}
    for key, hf in tensor_names(trunk.n_layers, qkv_bias, n_classes > 0):
        if isinstance(hf, str):
            shape = {"embeddings.cls_token": (1, 1, d), "embeddings.position_embeddings": (1, -1, d)}.get(hf)
            tensor = state_dict[key]
            if key == PATCH_WEIGHT:
                tensor = layout(key, tensor, torch.Size((d, image.channels, image.patch_size, image.patch_size)),
                                True, image)
            sd[hf] = (tensor.reshape(shape) if shape else tensor).detach().to("cpu", copy=True).contiguous()
        else:
            for name, part in zip(hf, state_dict[key].chunk(3)):
                sd[name] = part.detach().to("cpu", copy=True).contiguous()
    # the pooler and mask token as they came, for a ViTModel (ViTForImageClassification has neither)
    for name in (config.get("carried") or {}) if n_classes == 0 else ():
        if name.startswith(CARRIED):
            sd[name] = state_dict[f"carried.{name.replace('.', '/')}"].detach().to("cpu", copy=True).contiguous()
    kind = state_dict[TYPE_EMBEDDING].reshape(-1)  # HF has no type embedding: it goes into every token
    sd["embeddings.patch_embeddings.projection.bias"] = sd["embeddings.patch_embeddings.projection.bias"] + kind
    sd["embeddings.cls_token"] = sd["embeddings.cls_token"] + kind
    if n_classes > 0:
        sd = {k if k == "classifier.weight" or k == "classifier.bias" else f"vit.{k}": v for k, v in sd.items()}
    sd = cast_tensors(sd, source.get("dtype") if source_cfg else None)  # a bf16 checkpoint goes back in bf16
    act = source_cfg.get("hidden_act")  # kept where it names the same function (gelu_new)
    names = config.get("class_names")
    # the source's labels where they fit (a backbone keeps its own, or none: transformers 5 writes no id2label for
    # a ViTModel), else the export's class names, else HF's placeholders
    theirs = source_cfg.get("id2label")
    source_labels = isinstance(theirs, dict) and not names and (n_classes == 0 or len(theirs) == n_classes)
    labels = {str(i): n for i, n in enumerate(names)} if names else None if source_labels or not n_classes else \
        {str(i): f"LABEL_{i}" for i in range(n_classes)}
    hf_config = {**source_cfg, "model_type": MODEL_TYPE,
                 "architectures": ["ViTForImageClassification" if n_classes else "ViTModel"],
                 "hidden_size": d, "num_hidden_layers": trunk.n_layers, "num_attention_heads": trunk.n_heads,
                 "intermediate_size": int(trunk.mlp_ratio * d),
                 "hidden_act": act if ACTIVATIONS.get(act) == trunk.activation else HF_ACTIVATIONS[trunk.activation],
                 "layer_norm_eps": trunk.norm_eps, "image_size": size, "patch_size": image.patch_size,
                 "num_channels": image.channels, "qkv_bias": qkv_bias, "hidden_dropout_prob": trunk.dropout}
    if not source_labels:
        hf_config.pop("id2label", None), hf_config.pop("label2id", None)
    if labels is not None:
        hf_config.update(id2label=labels, label2id={n: int(i) for i, n in labels.items()})
    hf_config.setdefault("attention_probs_dropout_prob", 0.0)
    hf_config.pop("head_dim", None)  # = hidden_size / num_attention_heads, the default (from_hf checked)
    processor = {**source.get("processor", {}), **processor_config(image)} if source_cfg else processor_config(image)
    return hf_config, processor, sd


# ----------------------------------------------------------------------------------------------------
# Files: `omni convert --from hf` / `--to hf` for config.json model_type "vit" (omni.interop.hf)


def read_processor(src: Path) -> dict[str, Any] | None:
    """preprocessor_config.json of a directory (None when it has none)."""
    path = Path(src) / PROCESSOR_NAME
    if not path.is_file():
        return None
    try:
        settings = json.loads(path.read_text())
    except ValueError as exc:
        raise ConversionError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(settings, dict):
        raise ConversionError(f"{path} is not a JSON object")
    return settings


def read_hf(src: Path, **options: Any) -> Export:
    """A HF ViT directory (config.json + model.safetensors / pytorch_model.bin [+ preprocessor_config.json])."""
    if options:
        raise ConversionError(f"{', '.join(sorted(options))}: not an option of Hugging Face ViT checkpoints")
    state_dict, hf_config = read_directory(src)
    try:
        return from_hf(state_dict, hf_config, read_processor(src))
    except ValueError as exc:  # from_hf's refusals, as the one conversion error
        raise ConversionError(f"{src}: {exc}") from exc


def write_hf(export: Path, out: Path, **options: Any) -> Path:
    """An omni image classifier export -> ``out``: config.json, model.safetensors and preprocessor_config.json
    (``ViTForImageClassification.from_pretrained(out)`` and ``AutoImageProcessor.from_pretrained(out)``)."""
    if options:
        raise ConversionError(f"{', '.join(sorted(options))}: not an option of Hugging Face ViT checkpoints")
    config, state_dict, tokenizers = read_export(export)
    try:
        hf_config, processor, sd = to_hf(config, state_dict, tokenizers.get("image"))
    except ValueError as exc:
        raise ConversionError(f"{export}: {exc}") from exc
    return write_hf_files(out, hf_config, sd, **{PROCESSOR_NAME: processor})


register_hf_family(HFFamily(MODEL_TYPE, read_hf, write_hf, builders=(BUILDER,)))

__all__ = ["checkpoint_name", "from_hf", "image_tokenizer", "processor_config", "read_hf", "to_hf", "trunk_config",
           "write_hf"]
