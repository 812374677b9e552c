"""``omni predict`` as a pipeline above the models: image files -> top-k classes, with attention pictures.

Reads an image classifier export (recipes/vit.py, converted timm / HF ViTs) or the image task of a multitask export
(recipes/multimodal.py; omni.export_kinds picks the task), encodes each file of any size, mode and format with the
export's image tokenizer, and ranks the classes; ``attention`` draws what the model looked at
(``omni.introspect.image_attention``) over the image.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from omni.export import load_config, load_pretrained, load_tokenizers
from omni.export_kinds import image_task, is_multitask
from omni.files import output_paths
from omni.introspect import image_attention
from omni.packing import Packer
from omni.segment import Sample, Segment
from omni.tokenizers.base import check_regular_file
from omni.tokenizers.image import ImageTokenizer
from omni.vision import ImageClassifier, image_domain
from omni.vision import attention_method as choose_attention_method


def image_classifier(checkpoint: str | Path, device: str
                      ) -> tuple[Callable[[Segment], Tensor], ImageTokenizer, list[str], nn.Module, str | None]:
    """(image segment -> logits (classes,), image tokenizer, class names, the model, the head name of a multitask
    export's image task or None) of an ImageClassifier export (recipes/vit.py) or of the image task of a
    multitask export (recipes/multimodal.py)."""
    config = load_config(checkpoint)
    builder = config.get("builder")
    task = image_task(config) if is_multitask(config) else None
    if is_multitask(config) and task is None:
        raise ValueError(f"{checkpoint}: the multitask export has no image classification task")
    model = load_pretrained(checkpoint, device=device)
    tokenizer = load_tokenizers(checkpoint).get("image")
    if task is not None:
        def classify(seg: Segment) -> Tensor:  # the image alone, packed as in training
            batch = Packer()([Sample([seg], key="predict")]).to(device)
            return model.forward_head(model(batch), batch, task, "image")[0]

        n_classes = int(config["heads"][task]["n_classes"])
    elif isinstance(model, ImageClassifier) and tokenizer is not None:
        def classify(seg: Segment) -> Tensor:
            return model.forward_tokens(seg.tokens[None].to(device), seg.positions_2d[None].to(device),
                                        seg.meta["grid"])[0]

        n_classes = model.head.proj.out_features
    else:
        raise ValueError(f"{checkpoint}: not an image classifier export (its builder {builder!r} "
                         f"makes a {type(model).__name__})")
    if n_classes == 0:  # a converted backbone (HF ViTModel): nothing to rank
        raise ValueError(f"{checkpoint}: this export has no classifier head (a backbone, 0 classes): fine-tune it "
                         "on labelled images first (recipes/vit.py --set init=...)")
    names = (config["tasks"][task] if task is not None else config).get("class_names")
    # without recorded names, the classes are their indices, printed as such ("class 3"), never a bare number
    return classify, tokenizer, names or [f"class {i}" for i in range(n_classes)], model, task


def _encode_file(tokenizer: ImageTokenizer, path: str | Path) -> Segment:
    """One image file -> Segment; FileNotFoundError / ValueError messages start with the path."""
    name = os.fspath(path)
    check_regular_file(path, "image file")  # a missing file, a directory, FIFO, device: named for what it is
    try:
        return tokenizer.encode(path, key=name)
    except (ValueError, TypeError) as exc:
        reason = str(exc).removeprefix(f"image {name!r}: ")  # the path is named once, first
        raise ValueError(f"{name}: cannot read as an image: {reason}") from exc


def attention_paths(files: Sequence[str | Path], directory: str | Path) -> list[Path]:
    """Where ``predict_files(..., attention=directory)`` writes each file's picture: ``directory/<name>.png``
    (omni.files.output_paths: a name met before gets ``-2``, ``-3`` ...)."""
    return output_paths(files, directory, ".png", fallback="image")


ATTENTION_METHODS = ("auto", "rollout", "last")


def _draw_attention(model: nn.Module, head: str | None, tokenizer: ImageTokenizer, seg: Segment,
                    top: list[tuple[str, float]], method: str, path: Path, title: str) -> None:
    """``path``: the image as the model saw it, under what the model looked at (omni.introspect.image_attention:
    a rollout over every layer, or the last layer's attention, read by the query the head pools), top-k above."""
    from omni.plots import attention_overlay  # matplotlib: only when pictures are asked for

    if method == "auto":  # a rollout unless its maps would not fit (1,024-px images: 2.4 GB), then the last layer
        pixels = tokenizer.decode(seg)
        method = choose_attention_method(model, pixels.shape[-2:]) if isinstance(model, ImageClassifier) else "rollout"
    heat = image_attention(model, seg, method=method, head=head)[0]
    pixels = tokenizer.decode(seg)  # (C, h, w) in [0, 1]: normalisation and padding undone
    label = "attention rollout" if method == "rollout" else "last-layer attention"
    attention_overlay(pixels, heat, top, path, patch_size=tokenizer.patch_size, label=label, title=title)


@torch.no_grad()
def predict_files(checkpoint: str | Path, files: Sequence[str | Path], top_k: int = 5, device: str | None = None,
                  *, return_exceptions: bool = False, attention: str | Path | None = None,
                  attention_method: str = "auto", invert: str = "auto"
                  ) -> list[list[tuple[str, float]] | Exception]:
    """Top-k (class name, probability) for each image file of any size, mode and format, by an image classifier
    export (recipes/vit.py) or the image task of a multitask export (recipes/multimodal.py). A file that cannot
    be read raises FileNotFoundError / ValueError naming it, or with ``return_exceptions`` that exception takes
    its place in the result (the export's own errors raise either way).

    ``attention``: a directory; each readable image's picture goes to ``attention_paths(files, attention)``: the
    image with its attention heat map over the patch grid (``attention_method`` "rollout", "last", or "auto": the
    rollout unless its maps would pass 256 MB, omni.vision.attention_method) and its
    top-k in the title (needs matplotlib, the ``viz`` extra).

    ``invert``: a grey-scale export that records its training images' look (``image_domain``: recipes/vit.py
    writes it) reads a photo whose background is the opposite of its training images' (a dark garment on white,
    where Fashion-MNIST is light on black) with its grey levels inverted, saying so on stderr ("auto"); "yes"
    always inverts, "no" never."""
    if invert not in INVERT_CHOICES:
        raise ValueError(f"invert must be one of {', '.join(INVERT_CHOICES)}, got {invert!r}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if attention_method not in ATTENTION_METHODS:
        raise ValueError(f"attention_method must be one of {', '.join(ATTENTION_METHODS)}, got {attention_method!r}")
    if attention is not None:
        from omni.deps import require

        require("matplotlib", "viz")  # before any work: the pictures are what was asked for
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    classify, tokenizer, names, model, head = image_classifier(checkpoint, device)
    domain = load_config(checkpoint).get("image_domain") if tokenizer.channels == 1 else None
    pictures = attention_paths(files, attention) if attention is not None else None
    results: list[list[tuple[str, float]] | Exception] = []
    for k, f in enumerate(files):
        try:
            seg = _encode_file(tokenizer, f)
        except (OSError, ValueError) as exc:
            if not return_exceptions:
                raise
            results.append(exc)
            continue
        if invert == "yes" or (invert == "auto" and _inverted(tokenizer.decode(seg), domain)):
            if invert == "auto":
                print(f"omni predict: {f}: its background is {'light' if domain['border'] < 0.5 else 'dark'} "
                      f"where the model's training images are {'dark' if domain['border'] < 0.5 else 'light'}: "
                      "read with its grey levels inverted (--invert no keeps them)", file=sys.stderr)
            seg = tokenizer.encode(1.0 - tokenizer.decode(seg).clamp(0.0, 1.0), key=os.fspath(f))
        probs = classify(seg).float().softmax(-1)
        top = probs.topk(min(top_k, probs.numel()))
        results.append([(names[i], float(p)) for p, i in zip(top.values.tolist(), top.indices.tolist())])
        if pictures is not None:
            _draw_attention(model, head, tokenizer, seg, results[-1], attention_method, pictures[k], Path(f).name)
    return results


INVERT_CHOICES = ("auto", "yes", "no")
INVERT_MARGIN = 0.5  # a background this far from the training images' (on [0, 1]) is the opposite one


def _inverted(pixels: Tensor, domain: dict[str, float] | None) -> bool:
    """Whether an image (C, h, w in [0, 1]) has the opposite background of the training images' ``domain``."""
    if not domain or "border" not in domain:
        return False
    return abs(image_domain(pixels[None])["border"] - float(domain["border"])) > INVERT_MARGIN


__all__ = ["ATTENTION_METHODS", "INVERT_CHOICES", "attention_paths", "image_classifier", "predict_files"]
