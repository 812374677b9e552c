"""Image classification on the shared trunk: the model and batched augmentation (prediction from files:
omni.pipelines.predict).

ImageClassifier = image tokenizer's patch embedder -> Trunk (bidirectional) -> pooled head. It takes
uniform batches (B, C, H, W) on the fast path (normalise + patchify inside the model, compile
friendly) and tokenizer Segments of any image size on the prediction path; both give the same numbers.
``adapt_classifier`` makes an export (or a converted peer checkpoint, omni.interop) the start of a
fine-tuning run on another image size or class count.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Literal, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni.attention_patterns import LayerMasks, pattern_masks
from omni.export_kinds import IMAGE_CLASSIFIER
from omni.heads import HEAD_NORM_EPS, ClassificationHead, Pool, pool_segments
from omni.model import CarriedTensors
from omni.tokenizers.image import ImagePatchEmbedder, ImageTokenizer, grid_positions, patchify, unpatchify
from omni.trunk import Trunk, TrunkConfig

BUILDER = IMAGE_CLASSIFIER  # the export kind this module builds (omni.export_kinds)
POSITION_TABLE = "trunk.absolute.table.weight"  # the learned 1-D position table (trunk positions "learned_1d")


class ConvStem(nn.Module):
    """Convolutions over the whole image before it becomes tokens, the "hybrid" ViT (Dosovitskiy et al. 2021;
    Xiao et al. 2021, "Early convolutions help transformers see better"): per entry of ``channels`` a 3x3
    convolution, BatchNorm and ReLU, the first at stride 1 and the others at stride 2; a map still larger than the
    patch grid is then average-pooled onto it. The tokens keep the patch layout (one per p x p patch, the same
    positions), so every path that reads patch tokens reads these. On a small CPU budget the convolutions' locality
    is what a plain patch projection must learn from data (Fashion-MNIST, benchmarks/results.md).

    BatchNorm, measured against GroupNorm(1) in the same stem: 4 points better test accuracy after 2 of 3 epochs
    (87.7% vs 83.5%). In eval mode it normalises with its running statistics, so one image predicts as in a batch;
    in training it normalises over the process's batch (recipes/vit.py makes it SyncBatchNorm on several GPUs)."""

    def __init__(self, in_channels: int, channels: Sequence[int], patch_size: int) -> None:
        super().__init__()
        channels = [int(c) for c in channels]
        if not channels or min(channels) < 1:
            raise ValueError(f"stem: a list of positive channel counts, got {channels!r}")
        layers: list[nn.Module] = []
        for i, (cin, cout) in enumerate(zip([in_channels] + channels, channels)):
            layers += [nn.Conv2d(cin, cout, 3, stride=1 if i == 0 else 2, padding=1, bias=False),
                       nn.BatchNorm2d(cout), nn.ReLU()]
        # channels-last kernels: oneDNN / cuDNN then run these convolutions in NHWC, which on a 2-core CPU takes the
        # stem's forward + backward from 62 to 47 ms per 128 Fashion-MNIST images (a 1-channel input gives the
        # kernels' layout no say: its NCHW and NHWC strides are the same). Exports store contiguous copies.
        self.net = nn.Sequential(*layers).to(memory_format=torch.channels_last)
        self.channels, self.patch_size = channels, patch_size

    def map_size(self, size: int) -> int:
        """Rows (or columns) of the stem's map for an image of ``size`` pixels: each stride-2 convolution rounds up."""
        for _ in self.channels[1:]:
            size = (size + 1) // 2
        return size

    def check_size(self, height: int, width: int) -> None:
        """ValueError unless the stem's map of a height x width image has at least the patch grid's rows and columns."""
        for size in (height, width):
            if self.map_size(size) < size // self.patch_size:
                raise ValueError(f"stem {self.channels}: its {len(self.channels) - 1} stride-2 convolutions reduce "
                                 f"{size} pixels to {self.map_size(size)}, fewer than the {size // self.patch_size} "
                                 f"patches of {self.patch_size} pixels: use fewer entries or larger patches")

    def forward(self, x: Tensor) -> Tensor:
        """Normalised images (B, C, H, W), H and W multiples of the patch -> tokens (B, n, channels[-1]),
        row-major on the (H / p, W / p) grid, as ``patchify`` orders patches."""
        grid = x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size
        self.check_size(x.shape[-2], x.shape[-1])
        y = self.net(x.contiguous(memory_format=torch.channels_last))  # (B, c, h, w), h >= grid rows, w >= grid cols
        if tuple(y.shape[-2:]) != grid:
            y = F.adaptive_avg_pool2d(y, grid)
        return y.flatten(2).transpose(1, 2)  # (B, n, c)


class ImageClassifier(nn.Module):
    """Patch embedder -> bidirectional Trunk -> ClassificationHead. With a CLS tokenizer the tokens carry
    its CLS row and flag column on every path; pool="mean" then averages the CLS token with the patches,
    as ClassificationHead does on packed batches. ``norm_eps``: the head's LayerNorm (None: none). ``carried``:
    {name: shape} of a converted checkpoint's tensors off the classification path (a HF ViTModel's pooler), kept in
    the state dict (``CarriedTensors``) so the export converts back whole; None adds nothing. ``stem``: the channels
    of a ``ConvStem`` that makes the tokens from the whole image (None: each patch's pixels, projected)."""

    def __init__(self, image: ImageTokenizer, trunk: TrunkConfig, n_classes: int, pool: Pool = "mean",
                 norm_eps: float | None = HEAD_NORM_EPS, carried: Mapping[str, Sequence[int]] | None = None,
                 stem: Sequence[int] | None = None) -> None:
        super().__init__()
        if trunk.positions == "learned_1d" and image.positions != "sequence":
            raise ValueError("trunk positions 'learned_1d' index one table by token order: the image tokenizer "
                             f"needs positions='sequence', not {image.positions!r}")
        self.tokenizer = image  # its token layout (positions), read on the fast path
        self.patch_size, self.channels, self.cls = image.patch_size, image.channels, image.cls
        self.register_buffer("mean", torch.tensor(image.mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(image.std).view(1, -1, 1, 1), persistent=False)
        self.stem = ConvStem(image.channels, stem, image.patch_size) if stem else None
        self.embed = (ImagePatchEmbedder(self.stem.channels[-1], trunk.d_model, cls=image.cls) if self.stem
                      else image.embedder(trunk.d_model))
        self.trunk = Trunk(trunk)
        self.head = ClassificationHead(trunk.d_model, n_classes, pool=pool, norm_eps=norm_eps)
        self.carried = CarriedTensors(carried) if carried else None

    def forward(self, images: Tensor) -> Tensor:
        """Uniform batch (B, C, H, W), uint8 or float in [0, 1], H and W multiples of the patch -> logits."""
        return self.forward_head(self.forward_features(images))

    def forward_features(self, images: Tensor) -> Tensor:
        """Uniform batch (B, C, H, W) -> trunk hidden states (B, n, d): normalised and patchified here, the
        tokens ImageTokenizer.encode makes (n patches, + 1 CLS row)."""
        x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
        x = (x - self.mean) / self.std
        tokens = self.stem(x) if self.stem is not None else patchify(x, self.patch_size)  # (B, n, p*p*C or c)
        grid = images.shape[-2] // self.patch_size, images.shape[-1] // self.patch_size
        positions = self.tokenizer.token_positions(grid, device=images.device)  # (n (+ 1), 2)
        return self.trunk(self.embed(self._with_cls(tokens)), positions.expand(images.shape[0], -1, -1),
                          mask=self.pattern_mask(grid, images.shape[0], images.device))

    def pattern_mask(self, grid: Sequence[int], batch: int, device: torch.device) -> LayerMasks | None:
        """The trunk's per-layer masks for its attention patterns, laid on the (row, col) patch grid, when the tokens'
        positions are not that grid: a tokenizer of positions "sequence" (converted timm / HF ViTs: one learned table
        over token order) gives the trunk (i, i), on which a 2-D window would be a 1-D one. The CLS token sits at
        (0, 0), as the "grid" layout puts it (a ``global`` part makes it see everything). None: the trunk makes its
        masks from the positions it reads (grid tokenizers), or it has no patterns."""
        if not self.trunk.schedule.sparse or self.tokenizer.positions != "sequence":
            return None
        rows_cols = grid_positions(int(grid[0]), int(grid[1]), device=device)
        if self.cls:
            rows_cols = torch.cat([rows_cols.new_zeros(1, 2), rows_cols])
        return pattern_masks(self.trunk.schedule, None, rows_cols.expand(batch, -1, -1))

    def _with_cls(self, tokens: Tensor) -> Tensor:
        """(B, n, F) -> ImageTokenizer's layout with a CLS tokenizer: first a zero row flagged 1.0, patches 0.0."""
        if not self.cls:
            return tokens
        flag = F.pad(tokens.new_zeros(*tokens.shape[:2], 1), (0, 0, 1, 0), value=1.0)  # (B, 1 + n, 1)
        return torch.cat([F.pad(tokens, (0, 0, 1, 0)), flag], dim=-1)  # (B, 1 + n, F + 1)

    def token_features(self, tokens: Tensor, positions: Tensor, grid: Sequence[int] | None = None) -> Tensor:
        """Tokens (B, n, F) as ImageTokenizer.encode makes them, positions (B, n, 2) -> hidden states (B, n, d).
        ``grid``: the (rows, cols) of patches, which a stem needs to put the patches back together (None: the
        tokenizer's fixed image_size)."""
        if self.stem is not None:
            if grid is None:
                if self.tokenizer.image_size is None:
                    raise ValueError("a model with a convolutional stem needs the patch grid of its tokens")
                grid = self.tokenizer.grid_size(*self.tokenizer.image_size)
            patches = tokens[:, int(self.cls):, : self.tokenizer.patch_dim]  # (B, n, p*p*C) without CLS / flag
            tokens = self._with_cls(self.stem(unpatchify(patches, grid, self.patch_size)))
        mask = None
        if self.trunk.schedule.sparse and self.tokenizer.positions == "sequence":
            if grid is None:
                if self.tokenizer.image_size is None:
                    raise ValueError("a model with a 2-D attention pattern over token-order positions needs the patch "
                                     "grid of its tokens")
                grid = self.tokenizer.grid_size(*self.tokenizer.image_size)
            mask = self.pattern_mask(grid, tokens.shape[0], tokens.device)
        return self.trunk(self.embed(tokens), positions, mask=mask)

    def forward_tokens(self, tokens: Tensor, positions: Tensor, grid: Sequence[int] | None = None) -> Tensor:
        """Tokens (B, n, F), positions (B, n, 2) -> logits (B, classes): images of any size (prediction);
        ``grid`` as in ``token_features``."""
        return self.forward_head(self.token_features(tokens, positions, grid))

    def forward_head(self, features: Tensor, pre_logits: bool = False) -> Tensor:
        """Hidden states (B, n, d), each row one image -> logits (B, classes); ``pre_logits=True``: the pooled,
        normalised features (B, d) the classifier's Linear reads (timm's ``forward_head(x, pre_logits=True)``)."""
        if pre_logits:
            return self.head.norm(pool_segments(features, self.head.pool))
        return self.head(features)

    def export_config(self, class_names: Sequence[str] | None = None) -> dict[str, Any]:
        """config.json for its export (``save_pretrained(model, dir, config, tokenizers={"image": tokenizer})``)."""
        names = {"class_names": list(class_names)} if class_names else {}
        carried = {"carried": self.carried.shapes()} if self.carried is not None else {}
        stem = {"stem": list(self.stem.channels)} if self.stem is not None else {}
        return {"builder": BUILDER, "trunk": self.trunk.cfg.to_dict(), "head": self.head.spec(), **names, **carried,
                **stem}


def head_options(config: dict[str, Any]) -> dict[str, Any]:
    """ImageClassifier's head arguments (n_classes, pool, norm_eps) from its export config: the head's spec, or
    in exports written before it, "n_classes" and "pool"."""
    spec = dict(config.get("head") or {"type": "classification", "n_classes": config["n_classes"],
                                        "pool": config.get("pool", "mean")})
    if spec.pop("type", None) != ClassificationHead.kind:
        raise ValueError(f"an image classifier's head is a classification head, not {config['head']!r}")
    return spec


def build_image_classifier(config: dict[str, Any], tokenizers: dict[str, Any]) -> ImageClassifier:
    """Export builder (config.json "builder": "omni.vision:build_image_classifier")."""
    return ImageClassifier(tokenizers["image"], TrunkConfig(**config["trunk"]), **head_options(config),
                           carried=config.get("carried"), stem=config.get("stem"))


PositionRule = Literal["timm", "hf"]
# Export sources (config.json "source" "format") whose positions resample by Hugging Face's rule, not timm's
HF_POSITION_SOURCES = ("transformers:vit",)


def position_rule(config: Mapping[str, Any]) -> PositionRule:
    """How an image classifier export's position table resamples to another grid: "hf" for a model converted from
    Hugging Face (what ``interpolate_pos_encoding=True`` computes there), else "timm"."""
    source = config.get("source")
    return "hf" if isinstance(source, Mapping) and source.get("format") in HF_POSITION_SOURCES else "timm"


def resample_position_table(table: Tensor, old_grid: Sequence[int], new_grid: Sequence[int], prefix: int,
                            rule: PositionRule = "timm") -> Tensor:
    """A learned (prefix + gh * gw, d) position table for another (gh', gw') patch grid: the patch rows resampled
    on the grid, the prefix (CLS) rows kept. ``rule`` "timm": bicubic, antialiased, as timm's
    ``resample_abs_pos_embed``; "hf": bicubic to the new grid size, align_corners=False, no antialiasing, as
    transformers' ``ViTEmbeddings.interpolate_pos_encoding`` (the same positions HF computes at every forward)."""
    if rule not in ("timm", "hf"):
        raise ValueError(f"position resampling rule {rule!r}: expected 'timm' or 'hf'")
    if tuple(old_grid) == tuple(new_grid):
        return table
    d = table.shape[-1]
    grid = table[prefix:].float().reshape(1, *old_grid, d).permute(0, 3, 1, 2)  # (1, d, gh, gw)
    grid = F.interpolate(grid, size=tuple(new_grid), mode="bicubic", align_corners=False,
                         antialias=rule == "timm")  # (1, d, gh', gw')
    return torch.cat([table[:prefix], grid.permute(0, 2, 3, 1).reshape(-1, d).to(table.dtype)])


KEEP = "keep"  # adapt_classifier(attention=KEEP): the source's attention patterns (a converted peer: full)


def adapted_trunk(config: Mapping[str, Any], attention: Mapping[str, Any] | None | str = KEEP) -> TrunkConfig:
    """The trunk of an image classifier export, with ``attention`` (a ``TrunkConfig.attention`` schedule, None: full
    attention everywhere, KEEP: the source's; omni.attention_patterns) in place of its own; ValueError in one line
    when the schedule does not fit the trunk (a ``layers`` list of another length)."""
    fields = dict(config["trunk"])
    if not (isinstance(attention, str) and attention == KEEP):
        fields["attention"] = attention
    try:
        return TrunkConfig(**fields)
    except ValueError as exc:
        raise ValueError(f"the {fields['n_layers']}-layer trunk of the model to start from: {exc}") from None


def adapt_classifier(config: dict[str, Any], state_dict: dict[str, Tensor], image: ImageTokenizer,
                     image_size: int | None = None, n_classes: int | None = None,
                     attention: Mapping[str, Any] | None | str = KEEP) -> ImageClassifier:
    """An image classifier export (config, state dict, tokenizer: ``omni.interop.read_model`` reads an export or
    a peer checkpoint) as the start of a fine-tuning run on ``image_size`` images with ``n_classes`` classes.
    A new size resamples the learned 1-D position table (``resample_position_table`` by the source's rule,
    ``position_rule``; the tokenizer keeps its crop_pct); a new class count gets a new head (zero, as any new one).
    ``attention``: the trunk's attention patterns (``adapted_trunk``: KEEP the source's, so a converted peer keeps
    full attention unless a pattern is asked for; the weights are the same either way)."""
    trunk, head, state = adapted_trunk(config, attention), head_options(config), dict(state_dict)
    if image_size is not None and image.image_size != (image_size, image_size):
        if image.image_size is None:
            raise ValueError("the tokenizer has no fixed image_size to resample positions from")
        old_grid = image.grid_size(*image.image_size)
        image = ImageTokenizer(**{**image.config(), "image_size": image_size})
        if trunk.positions == "learned_1d":
            state[POSITION_TABLE] = resample_position_table(state[POSITION_TABLE], old_grid,
                                                            image.grid_size(image_size, image_size), int(image.cls),
                                                            position_rule(config))
            trunk = replace(trunk, max_positions=state[POSITION_TABLE].shape[0])
    new_head = n_classes is not None and n_classes != head["n_classes"]
    if new_head:
        head["n_classes"] = n_classes
        state = {k: v for k, v in state.items() if not k.startswith("head.proj.")}
    model = ImageClassifier(image, trunk, **head, carried=config.get("carried"), stem=config.get("stem"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) != ({"head.proj.weight", "head.proj.bias"} if new_head else set()):
        raise ValueError(f"the state dict does not fit the image classifier: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")
    return model


# ----------------------------------------------------------------------------------------------------
# Batched augmentation on the device. torchvision v2 transforms draw ONE set of random parameters per
# call, so on a (B, C, H, W) batch every image would get the same crop; these ops draw per image.


class BatchAugment(nn.Module):
    """Per-image random translation (pad + crop), horizontal flip and random erasing, vectorised."""

    def __init__(self, pad: int = 2, flip: bool = True, erase_prob: float = 0.25,
                 erase_scale: tuple[float, float] = (0.02, 0.2)) -> None:
        super().__init__()
        self.pad, self.flip, self.erase_prob, self.erase_scale = pad, flip, erase_prob, erase_scale

    def forward(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """x (B, C, H, W) float -> augmented copy (same shape and dtype)."""
        B, C, H, W = x.shape
        dev = x.device

        def rand(*shape: int) -> Tensor:
            return torch.rand(*shape, device=dev, generator=generator)

        if self.pad:
            p = self.pad
            padded = F.pad(x, (p, p, p, p))
            dy = (rand(B) * (2 * p + 1)).long()
            dx = (rand(B) * (2 * p + 1)).long()
            rows = (dy[:, None] + torch.arange(H, device=dev))[:, None, :, None].expand(B, C, H, W + 2 * p)
            x = padded.gather(2, rows)
            cols = (dx[:, None] + torch.arange(W, device=dev))[:, None, None, :].expand(B, C, H, W)
            x = x.gather(3, cols)
        if self.flip:
            x = torch.where((rand(B) < 0.5)[:, None, None, None], x.flip(-1), x)
        if self.erase_prob > 0:
            lo, hi = self.erase_scale
            area = (lo + (hi - lo) * rand(B)) * H * W
            aspect = torch.exp((rand(B) * 2 - 1) * math.log(3.0))
            eh = (area * aspect).sqrt().clamp(1, H)
            ew = (area / aspect).sqrt().clamp(1, W)
            y0 = rand(B) * (H - eh + 1)
            x0 = rand(B) * (W - ew + 1)
            ys = torch.arange(H, device=dev)[None, :]
            xs = torch.arange(W, device=dev)[None, :]
            inside = (((ys >= y0[:, None].floor()) & (ys < (y0 + eh)[:, None].floor()))[:, :, None]
                      & ((xs >= x0[:, None].floor()) & (xs < (x0 + ew)[:, None].floor()))[:, None, :])
            erase = inside & (rand(B) < self.erase_prob)[:, None, None]
            x = torch.where(erase[:, None], torch.rand(x.shape, device=dev, generator=generator).to(x.dtype), x)
        return x


def mixup_cutmix(images: Tensor, labels: Tensor, n_classes: int, alpha: float, cutmix_alpha: float,
                 smoothing: float, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Soft targets (B, classes) with label smoothing; mixes the batch with its flip (MixUp or CutMix,
    chosen per batch) when alpha / cutmix_alpha > 0."""
    target = F.one_hot(labels, n_classes).float() * (1 - smoothing) + smoothing / n_classes
    use = [a for a in (alpha, cutmix_alpha) if a > 0]
    if not use:
        return images, target
    pick = int(torch.randint(len(use), (1,), generator=generator)) if len(use) > 1 else 0
    a = use[pick]
    lam = float(torch.distributions.Beta(a, a).sample())
    flipped, flipped_target = images.flip(0), target.flip(0)
    if pick == 0 and alpha > 0:  # MixUp
        return lam * images + (1 - lam) * flipped, lam * target + (1 - lam) * flipped_target
    H, W = images.shape[-2:]  # CutMix: paste a box from the partner image
    h, w = int(H * math.sqrt(1 - lam)), int(W * math.sqrt(1 - lam))
    y, x = int(torch.randint(H - h + 1, (1,))), int(torch.randint(W - w + 1, (1,)))
    out = images.clone()
    out[..., y:y + h, x:x + w] = flipped[..., y:y + h, x:x + w]
    lam = 1 - h * w / (H * W)
    return out, lam * target + (1 - lam) * flipped_target


# ----------------------------------------------------------------------------------------------------
# Prediction (omni predict)

ROLLOUT_BYTES = 256 * 2 ** 20  # the most attention maps one image's rollout picture may hold


def attention_method(model: ImageClassifier, size: Sequence[int]) -> Literal["rollout", "last"]:
    """How to draw what ``model`` looks at in one image of ``size`` (h, w) pixels (omni.introspect.image_attention):
    "rollout" (every layer's maps, multiplied through) unless that would hold more than ROLLOUT_BYTES, then "last"
    (one layer). A capture keeps (heads, T, T) float32 per layer whatever the attention pattern: 4,097 tokens
    (1,024 px, patch 16) x 3 heads x 12 layers is 2.4 GB, and 12 products of 4,097^2 matrices."""
    tokens = (int(size[0]) // model.patch_size) * (int(size[1]) // model.patch_size) + int(model.cls)
    cfg = model.trunk.cfg
    return "rollout" if 4 * cfg.n_heads * tokens ** 2 * cfg.n_layers <= ROLLOUT_BYTES else "last"


def image_domain(images: Tensor) -> dict[str, float]:
    """What the images a classifier trains on look like, for ``omni predict`` to compare a photo with: the mean
    of their outermost pixel ring ("border", the background of centred objects) and of all pixels ("mean"), on
    (B, C, H, W) pixels (uint8, or floats in [0, 1]). Fashion-MNIST: light garments on black (border ~0.0)."""
    x = images.float() if images.is_floating_point() else images.float() / 255.0
    ring = torch.cat([x[..., 0, :], x[..., -1, :], x[..., :, 0], x[..., :, -1]], dim=-1)
    return {"border": round(float(ring.mean()), 4), "mean": round(float(x.mean()), 4)}

