"""Image tokenizer: any image -> a segment of flattened, normalised p x p patches with 2-D positions.

Pipeline (``encode`` for one image, ``encode_batch`` for a uniform (B, C, H, W) batch; same numbers):

1. **Read** to float32 in [0, 1], (C, H, W). Accepted: torch Tensor (C, H, W) / (H, W) (torchvision
   convention), numpy ndarray (H, W) / (H, W, C) (PIL/numpy convention), ``PIL.Image`` of any mode,
   encoded bytes (PNG/JPEG/... decoded with PIL; EXIF orientation applied, first frame of animations)
   or a file path. uint8 is divided by 255, other integer dtypes by their dtype maximum (PIL mode
   ``I`` is taken as 16-bit, /65535), bool is 0/1. Floats must already lie in [0, 1] (1e-4 slack for
   rounding, then clamped): 0-255 floats or pre-normalised inputs are an error, not silently squashed.
   NaN/inf, wrong ndim, channel counts other than 1/3/4 and empty images are errors naming the key.
2. **Channels** -> ``channels`` (1, 3 or 4). Grey is replicated to RGB exactly; RGB -> grey is ITU-R
   601 luma (0.299, 0.587, 0.114). Alpha (RGBA, LA, P with transparency) is by default composited
   over ``background`` (white), i.e. ``c * a + bg * (1 - a)``; ``alpha="drop"`` discards it instead.
   ``channels=4`` keeps alpha (opaque inputs get alpha 1).
3. **Size policy** (``image_size`` None = keep the native size):

   - ``"pad"`` (default): no resampling. The image is padded bottom/right to the next multiple of
     ``patch_size`` (or to ``image_size``; an image larger than ``image_size`` is an error). Padding
     uses the *normalised* zero, i.e. padded pixels equal ``mean`` before normalisation, so they
     add nothing through the patch projection but its bias. Every patch of the padded canvas is a
     token (also all-padding ones), so ``n == gh * gw`` always and the grid is
     ``ceil(H / p) x ceil(W / p)`` (or ``image_size / p``); 37x53 at p=16 -> (3, 4), 1x1 -> (1, 1).
   - ``"resize"``: resize (the ``interpolation`` filter, as "crop" resamples) to ``image_size`` (aspect not kept,
     like ``Resize((H, W))``) or, without ``image_size``, to the nearest multiple of ``patch_size``
     per side (at least one patch); 37x53 at p=16 -> 32x48, grid (2, 3); 1x1 -> 16x16, grid (1, 1).

   - ``"crop"``: torchvision's ``Resize(resize)`` + ``CenterCrop(image_size)``, timm's evaluation transform:
     the shorter side is resized to ``resize = floor(max(image_size) / crop_pct)`` (crop_pct 1.0 by default),
     aspect kept, and the centre ``image_size`` is cut out. 8-bit images (every value k / 255) are resampled
     by PIL in 8 bits as torchvision does for PIL images, so the pixels equal that pipeline's bit for bit;
     others by torch's antialiased kernel, clamped to [0, 1].

   ``image_size`` must be a multiple of ``patch_size``. ``interpolation`` ("bilinear" default, "bicubic",
   "nearest") is the filter of "resize" and "crop".
4. **Normalise** per channel: ``(x - mean) / std`` (defaults 0.5 / 0.5 -> [-1, 1]).
5. **Patchify** with einops ``c (gh p1) (gw p2) -> (gh gw) (p1 p2 c)``: tokens (n, p*p*C) float32
   in row-major patch order, positions (n, 2) int64 = (row, col) (``positions="grid"``), or (i, i) for the i-th
   token (``positions="sequence"``: one index per token, CLS first, for a single learned position table).

``max_patches`` (None = unlimited) bounds ``gh * gw``. Over-long images raise by default
(``on_overflow="error"``); ``on_overflow="resize"`` instead downsizes the image, aspect kept, until
its grid fits, with a warning naming the key. With a fixed ``image_size`` the bound is checked once,
in the constructor.

``cls=True`` prepends a CLS token and appends one flag column to every token: the CLS row is all
zeros with flag 1.0, patch rows carry flag 0.0. The embedder swaps flagged rows for a learned vector
with ``torch.where`` (no data-dependent Python, compile friendly). The CLS position is (0, 0), shared
with the top-left patch (``positions="grid"``); its learned vector, not its position, tells it apart, and
patch positions stay the same with or without CLS. With ``positions="sequence"`` CLS is token 0.

``meta`` = ``{"grid": (gh, gw), "image_size": (H, W) of the input, "content_size": (h, w) of the
image inside the padded canvas after any resize}``; ``decode`` uses it to invert tokens to pixels.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, ClassVar, Sequence

import numpy as np
import torch
import torchvision.transforms.v2.functional as TF
from einops import rearrange
from torch import Tensor, nn
from torch.nn import functional as F

from omni.image_bytes import MAX_PIXELS, ImageTooLarge, open_image  # noqa: F401 (MAX_PIXELS: its documented home)
from omni.image_bytes import check_image_size as _check_size
from omni.segment import Role, Segment
from omni.tokenizers.base import (NotARegularFileError, Tokenizer, TypeEmbedding, open_regular_file,
                                  register_tokenizer)

__all__ = [
    "ImagePatchEmbedder",
    "ImageTokenizer",
    "grid_positions",
    "patchify",
    "to_image_tensor",
    "unpatchify",
]

LUMA_601 = (0.299, 0.587, 0.114)
_FLOAT_SLACK = 1e-4  # rounding slack for float inputs computed as e.g. x / 255 or by a resize
_POLICIES = ("pad", "resize", "crop")
_POSITIONS = ("grid", "sequence")
_INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
_OVERFLOW = ("error", "resize")
_ALPHA = ("composite", "drop")


# -- batched geometry helpers (pure reshapes: exact, device agnostic) --------------------------------
def patchify(images: Tensor, patch_size: int) -> Tensor:
    """(B, C, H, W) -> (B, n, p*p*C), or (C, H, W) -> (n, p*p*C); row-major patches, (p1 p2 c) features."""
    if images.dim() not in (3, 4):
        raise ValueError(f"patchify expects (B, C, H, W) or (C, H, W), got shape {tuple(images.shape)}")
    h, w = images.shape[-2:]
    if h % patch_size or w % patch_size:
        raise ValueError(f"patchify: image size {h}x{w} is not a multiple of the patch size {patch_size}")
    return rearrange(images, "... c (gh p1) (gw p2) -> ... (gh gw) (p1 p2 c)", p1=patch_size, p2=patch_size)


def unpatchify(tokens: Tensor, grid: Sequence[int], patch_size: int) -> Tensor:
    """Exact inverse of ``patchify``: (B, n, p*p*C) -> (B, C, H, W), or (n, p*p*C) -> (C, H, W)."""
    gh, gw = int(grid[0]), int(grid[1])
    if tokens.dim() not in (2, 3):
        raise ValueError(f"unpatchify expects (B, n, p*p*C) or (n, p*p*C), got shape {tuple(tokens.shape)}")
    n, feat = tokens.shape[-2:]
    if n != gh * gw or feat % (patch_size * patch_size):
        raise ValueError(
            f"unpatchify: tokens {tuple(tokens.shape)} do not fit grid {gh}x{gw} with patch size {patch_size}"
        )
    return rearrange(
        tokens, "... (gh gw) (p1 p2 c) -> ... c (gh p1) (gw p2)", gh=gh, gw=gw, p1=patch_size, p2=patch_size
    )


def grid_positions(gh: int, gw: int, device: torch.device | str | None = None) -> Tensor:
    """(gh * gw, 2) int64 (row, col) positions in the row-major order ``patchify`` emits."""
    rows, cols = torch.meshgrid(
        torch.arange(gh, device=device), torch.arange(gw, device=device), indexing="ij"
    )
    return torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=-1).to(torch.int64)


# -- reading raw inputs ---------------------------------------------------------------------------------
def _name(key: str) -> str:
    return f"image {key!r}"


def _to_unit(x: Tensor, key: str) -> Tensor:
    """Scale any dtype to float32 in [0, 1] (see the module docstring for the rules)."""
    if x.dtype == torch.bool:
        return x.to(torch.float32)
    if x.dtype == torch.uint8:
        return x.to(torch.float32).div_(255)  # in place: one float copy of a large image, not two
    if x.is_floating_point():
        x = x.to(torch.float32)
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{_name(key)} contains NaN or inf values")
        lo, hi = float(x.min()), float(x.max())
        if lo < -_FLOAT_SLACK or hi > 1 + _FLOAT_SLACK:
            raise ValueError(
                f"{_name(key)}: float pixels must lie in [0, 1], got range [{lo:.4g}, {hi:.4g}] "
                "(divide 0-255 data by 255 or pass uint8; do not pre-normalise)"
            )
        return x.clamp(0.0, 1.0)
    if x.is_complex():
        raise TypeError(f"{_name(key)}: complex pixels are not supported (dtype {x.dtype})")
    # Wider integers: scale by the dtype maximum, in float64 so 32/64-bit values keep their precision.
    x64 = x.to(torch.float64)
    if float(x64.min()) < 0:
        raise ValueError(f"{_name(key)}: integer pixels must be >= 0, got a minimum of {float(x64.min()):g}")
    return (x64 / torch.iinfo(x.dtype).max).to(torch.float32)


def _check_hw(shape: Sequence[int], key: str) -> None:
    if shape[-1] == 0 or shape[-2] == 0:
        raise ValueError(f"{_name(key)} is empty: shape {tuple(shape)} has a zero height or width")


def _from_numpy(arr: np.ndarray, key: str, *, allow_grey_alpha: bool = False) -> Tensor:
    """(H, W) / (H, W, C) ndarray -> (C, H, W) tensor of the same dtype."""
    channels = (1, 2, 3, 4) if allow_grey_alpha else (1, 3, 4)
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in channels):
        raise ValueError(
            f"{_name(key)}: expected a numpy array (H, W) or (H, W, C) with C in (1, 3, 4), "
            f"got shape {arr.shape}" + (" (channels-first? transpose to (H, W, C))" if arr.ndim == 3 else "")
        )
    _check_hw(arr.shape[:2], key)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{_name(key)}: unsupported numpy dtype {arr.dtype} (use uint8, uint16 or float)")
    if arr.dtype.kind == "f" and arr.dtype.itemsize > 8:
        arr = arr.astype(np.float64)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if not arr.flags.writeable:  # e.g. np.asarray(PIL image); torch warns on read-only buffers
        arr = arr.copy()
    t = torch.from_numpy(np.ascontiguousarray(arr))
    return t[None] if t.dim() == 2 else t.permute(2, 0, 1)


def _from_pil(img: Any, key: str) -> Tensor:
    """Any PIL mode -> (C, H, W) tensor; C = 2 only for grey + alpha (LA), composited later."""
    mode = img.mode
    if mode in ("1", "L") and "transparency" not in img.info:
        arr = np.asarray(img.convert("L"))
    elif mode.startswith("I;16"):
        arr = np.asarray(img).astype(np.uint16)  # also fixes big-endian I;16B
    elif mode == "I":
        # Pillow's 32-bit container for 16-bit greyscale: scale as 16-bit, reject what does not fit.
        arr = np.asarray(img)
        if arr.size and (arr.min() < 0 or arr.max() > 65535):
            raise ValueError(f"{_name(key)}: PIL mode 'I' values must lie in [0, 65535] (read as 16-bit)")
        arr = arr.astype(np.uint16)
    elif mode == "F":
        arr = np.asarray(img, dtype=np.float32)
    elif mode in ("LA", "La", "L"):
        arr = np.asarray(img.convert("LA"))
    elif mode == "RGB" and "transparency" not in img.info:
        arr = np.asarray(img)
    elif mode in ("RGBA", "RGBa", "PA") or "transparency" in img.info:
        arr = np.asarray(img.convert("RGBA"))
    else:  # P, RGBX, CMYK, YCbCr, LAB, HSV, ...
        try:
            arr = np.asarray(img.convert("RGB"))
        except (ValueError, OSError) as exc:
            raise ValueError(f"{_name(key)}: cannot convert PIL mode {mode!r} to RGB: {exc}") from exc
    return _from_numpy(arr, key, allow_grey_alpha=True)


# The most pixels an encoded image may have (8192 x 8192, 64 MP): checked from its header, before it is
# decoded. Decoding needs C bytes a pixel and the float tensor 4 C more (a 13,000 x 13,000 PNG took 5.3 GB in
# `omni predict`); at the bound an RGB image takes about 1 GB while read. Larger ones are refused naming their
# size: downscale them first (they are resized to a few hundred pixels anyway). Below PIL's own
# decompression-bomb limit, so PIL's warning never shows.
def check_image_size(width: int, height: int, key: str = "") -> None:
    """``ImageTooLarge`` (a ValueError) naming the image when ``width * height`` exceeds ``MAX_PIXELS``."""
    _check_size(width, height, _name(key))


def _decode_bytes(data: bytes, key: str) -> Tensor:
    from PIL import Image, UnidentifiedImageError

    try:
        img = open_image(data, _name(key))  # the bound from the header, decoded at once, EXIF orientation applied
    except ImageTooLarge:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        # SyntaxError/EOFError: raised by some PIL plugins on corrupt headers
        # PIL names an unknown format's source "<_io.BytesIO object at 0x...>": say what it means instead
        unknown = isinstance(exc, UnidentifiedImageError)
        reason = "not an image format PIL reads (PNG, JPEG, GIF, BMP, TIFF, WebP ...)" if unknown else str(exc)
        raise ValueError(f"{_name(key)}: could not decode {len(data)} bytes as an image: {reason}") from exc
    return _from_pil(img, key)


def to_image_tensor(raw: Any, *, key: str = "") -> Tensor:
    """Read any accepted input into a float32 (C, H, W) tensor in [0, 1] on the CPU.

    C is 1, 3 or 4, or 2 (grey + alpha) for PIL LA images. See the module docstring for the rules.
    """
    if isinstance(raw, Tensor):
        if raw.dim() not in (2, 3) or (raw.dim() == 3 and raw.shape[0] not in (1, 3, 4)):
            hint = " (a batch? use encode_batch)" if raw.dim() == 4 else ""
            if raw.dim() == 3 and raw.shape[-1] in (1, 3, 4):
                hint = " (channels-last? use .permute(2, 0, 1))"
            raise ValueError(
                f"{_name(key)}: expected a tensor (C, H, W) or (H, W) with C in (1, 3, 4), "
                f"got shape {tuple(raw.shape)}{hint}"
            )
        _check_hw(raw.shape, key)
        x = raw.detach().cpu()
        x = x[None] if x.dim() == 2 else x
    elif isinstance(raw, np.ndarray):
        x = _from_numpy(raw, key)
    elif isinstance(raw, (bytes, bytearray, memoryview)):
        x = _decode_bytes(bytes(raw), key)
    elif isinstance(raw, (str, os.PathLike)):
        try:
            with open_regular_file(raw) as fh:  # a FIFO or device would block open() or read() forever
                data = fh.read()
        except FileNotFoundError as exc:
            raise ValueError(f"{_name(key)}: cannot read image file {os.fspath(raw)!r}: no such file") from exc
        except NotARegularFileError as exc:
            raise ValueError(f"{_name(key)}: {exc.path!r} is {exc.kind}, not an image file") from exc
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise ValueError(f"{_name(key)}: cannot read image file {os.fspath(raw)!r}: {reason}") from exc
        x = _decode_bytes(data, key)
    elif type(raw).__module__.startswith("PIL.") and hasattr(raw, "mode"):
        x = _from_pil(raw, key)
    else:
        raise TypeError(
            f"{_name(key)}: expected a torch.Tensor (C, H, W)/(H, W), numpy array (H, W)/(H, W, C), "
            f"PIL.Image, encoded bytes or a file path, got {type(raw).__name__}"
        )
    _check_hw(x.shape, key)
    return _to_unit(x, key)


# -- the embedder ---------------------------------------------------------------------------------------
class ImagePatchEmbedder(nn.Module):
    """Linear patch projection (+ learned CLS swap-in) + modality type vector; strictly per-token.

    With ``cls`` the last input column is the CLS flag: rows with flag > 0.5 get ``cls_token``
    instead of their projection (``torch.where``, so no data-dependent control flow).
    """

    def __init__(self, patch_dim: int, d_model: int, cls: bool = False) -> None:
        super().__init__()
        self.patch_dim = patch_dim
        self.proj = nn.Linear(patch_dim, d_model)
        self.cls_token = nn.Parameter(torch.randn(d_model) * 0.02) if cls else None
        self.type_embedding = TypeEmbedding(d_model)

    def forward(self, tokens: Tensor) -> Tensor:
        if self.cls_token is None:  # static: fixed at construction
            return self.type_embedding(self.proj(tokens))
        x = self.proj(tokens[..., : self.patch_dim])
        flag = tokens[..., self.patch_dim :] > 0.5
        x = torch.where(flag, self.cls_token.to(x.dtype), x)
        return self.type_embedding(x)


# -- the tokenizer --------------------------------------------------------------------------------------
def _per_channel(value: float | Sequence[float], channels: int, name: str) -> list[float]:
    vals = [float(value)] * channels if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(vals) != channels:
        raise ValueError(f"{name} needs 1 or {channels} values (one per output channel), got {len(vals)}")
    return vals


@register_tokenizer()
class ImageTokenizer(Tokenizer):
    """Images -> p x p patch tokens with (row, col) positions; see the module docstring for every policy."""

    modality: ClassVar[str] = "image"
    role: ClassVar[Role] = Role.BIDIRECTIONAL

    def __init__(
        self,
        patch_size: int = 16,
        channels: int = 3,
        image_size: int | Sequence[int] | None = None,
        policy: str = "pad",
        mean: float | Sequence[float] = 0.5,
        std: float | Sequence[float] = 0.5,
        max_patches: int | None = None,
        on_overflow: str = "error",
        cls: bool = False,
        alpha: str = "composite",
        background: float | Sequence[float] = 1.0,
        crop_pct: float | None = None,
        interpolation: str = "bilinear",
        positions: str = "grid",
    ) -> None:
        if int(patch_size) != patch_size or patch_size < 1:
            raise ValueError(f"patch_size must be a positive integer, got {patch_size!r}")
        if channels not in (1, 3, 4):
            raise ValueError(f"channels must be 1, 3 or 4, got {channels!r}")
        if policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
        if on_overflow not in _OVERFLOW:
            raise ValueError(f"on_overflow must be one of {_OVERFLOW}, got {on_overflow!r}")
        if alpha not in _ALPHA:
            raise ValueError(f"alpha must be one of {_ALPHA}, got {alpha!r}")
        if interpolation not in _INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {_INTERPOLATIONS}, got {interpolation!r}")
        if positions not in _POSITIONS:
            raise ValueError(f"positions must be one of {_POSITIONS}, got {positions!r}")
        self.interpolation, self.positions = interpolation, positions
        self.patch_size = int(patch_size)
        self.channels = int(channels)
        self.policy = policy
        self.on_overflow = on_overflow
        self.alpha = alpha
        self.cls = bool(cls)

        self.image_size: tuple[int, int] | None = None
        if image_size is not None:
            hw = (image_size, image_size) if isinstance(image_size, int) else tuple(int(v) for v in image_size)
            if len(hw) != 2 or min(hw) < 1 or hw[0] % self.patch_size or hw[1] % self.patch_size:
                raise ValueError(
                    f"image_size must be an int or (H, W) of positive multiples of patch_size "
                    f"{self.patch_size}, got {image_size!r}"
                )
            self.image_size = (hw[0], hw[1])
        self.crop_pct: float | None = None
        if policy == "crop":
            if self.image_size is None:
                raise ValueError("policy='crop' needs image_size (the size of the centre crop)")
            self.crop_pct = 1.0 if crop_pct is None else float(crop_pct)
            if not 0 < self.crop_pct <= 1:
                raise ValueError(f"crop_pct must lie in (0, 1], got {crop_pct!r}")
        elif crop_pct is not None:
            raise ValueError(f"crop_pct is the centre crop's share of policy='crop'; policy is {policy!r}")

        if max_patches is not None and (int(max_patches) != max_patches or max_patches < 1):
            raise ValueError(f"max_patches must be None or a positive integer, got {max_patches!r}")
        self.max_patches = None if max_patches is None else int(max_patches)
        if self.max_patches is not None and self.image_size is not None:
            n = (self.image_size[0] // self.patch_size) * (self.image_size[1] // self.patch_size)
            if n > self.max_patches:
                raise ValueError(f"image_size {self.image_size} gives {n} patches > max_patches={self.max_patches}")

        self.mean = _per_channel(mean, self.channels, "mean")
        self.std = _per_channel(std, self.channels, "std")
        if min(self.std) <= 0:
            raise ValueError(f"std must be > 0, got {self.std}")
        self.background = _per_channel(background, 3, "background")
        if not all(0.0 <= b <= 1.0 for b in self.background):
            raise ValueError(f"background must lie in [0, 1], got {self.background}")

    def config(self) -> dict[str, Any]:
        return {
            "patch_size": self.patch_size,
            "channels": self.channels,
            "image_size": None if self.image_size is None else list(self.image_size),
            "policy": self.policy,
            "mean": list(self.mean),
            "std": list(self.std),
            "max_patches": self.max_patches,
            "on_overflow": self.on_overflow,
            "cls": self.cls,
            "alpha": self.alpha,
            "background": list(self.background),
            "crop_pct": self.crop_pct,
            "interpolation": self.interpolation,
            "positions": self.positions,
        }

    # -- sizes --------------------------------------------------------------------------------------
    @property
    def patch_dim(self) -> int:
        """Pixel features per patch: p * p * channels."""
        return self.patch_size * self.patch_size * self.channels

    @property
    def token_dim(self) -> int:
        """Width of ``Segment.tokens``: ``patch_dim`` plus the CLS flag column when ``cls``."""
        return self.patch_dim + int(self.cls)

    def _fit(self, h: int, w: int) -> tuple[int, int, int, int]:
        """(content_h, content_w, canvas_h, canvas_w) for an h x w input, before the max_patches bound."""
        p = self.patch_size
        if self.policy == "crop":
            assert self.image_size is not None  # the constructor's check
            return (*self.image_size, *self.image_size)
        if self.policy == "resize":
            if self.image_size is not None:
                ch, cw = self.image_size
            else:  # nearest multiple of p, half rounds up, at least one patch
                ch, cw = max(p, int(h / p + 0.5) * p), max(p, int(w / p + 0.5) * p)
            return ch, cw, ch, cw
        if self.image_size is not None:
            return h, w, self.image_size[0], self.image_size[1]
        return h, w, math.ceil(h / p) * p, math.ceil(w / p) * p

    def _layout(self, h: int, w: int, key: str) -> tuple[int, int, int, int]:
        """Where an h x w input ends up: (content_h, content_w, canvas_h, canvas_w)."""
        p = self.patch_size
        if self.policy == "pad" and self.image_size is not None and (h > self.image_size[0] or w > self.image_size[1]):
            raise ValueError(
                f"{_name(key)}: {h}x{w} is larger than image_size {self.image_size[0]}x{self.image_size[1]} "
                "under policy='pad' (use policy='resize' or a larger image_size)"
            )
        layout = self._fit(h, w)
        n = (layout[2] // p) * (layout[3] // p)
        if self.max_patches is None or n <= self.max_patches:
            return layout
        if self.on_overflow == "error":
            raise ValueError(
                f"{_name(key)}: {h}x{w} gives {n} patches of {p}x{p} > max_patches={self.max_patches} "
                "(raise max_patches, set image_size, or on_overflow='resize')"
            )
        # Downscale, aspect kept: start from the area estimate and shrink until the grid fits
        # (terminates: a 1x1 image is one patch and max_patches >= 1).
        s = math.sqrt(self.max_patches * p * p / (h * w))
        while True:
            hs, ws = max(1, int(h * s)), max(1, int(w * s))
            layout = self._fit(hs, ws)
            if (layout[2] // p) * (layout[3] // p) <= self.max_patches:
                break
            s *= 0.97
        warnings.warn(
            f"{_name(key)}: {h}x{w} gives {n} patches > max_patches={self.max_patches}; "
            f"downscaled to {layout[0]}x{layout[1]} ({layout[2] // p}x{layout[3] // p} patches)",
            stacklevel=4,
        )
        return layout

    def grid_size(self, height: int, width: int) -> tuple[int, int]:
        """The (gh, gw) patch grid an input of height x width gets (n = gh * gw, + 1 with CLS)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, _, ch, cw = self._layout(int(height), int(width), "")
        return ch // self.patch_size, cw // self.patch_size

    # -- the shared pipeline (batched; encode uses B = 1) --------------------------------------------
    def _convert_channels(self, x: Tensor) -> Tensor:
        """(B, C, H, W) with C in 1..4 (2 = grey + alpha) -> (B, channels, H, W)."""
        c = x.shape[1]
        alpha = None
        if c in (2, 4):
            x, alpha = x[:, :-1], x[:, -1:]
        if self.channels == 4:
            rgb = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x
            return torch.cat([rgb, alpha if alpha is not None else torch.ones_like(x[:, :1])], dim=1)
        if alpha is not None and self.alpha == "composite":
            bg = torch.tensor(self.background, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
            if x.shape[1] == 1 and self.channels == 1:
                # luma is linear, so compositing grey over luma(bg) == luma of the RGB composite
                bg = (bg * torch.tensor(LUMA_601, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)).sum(
                    1, keepdim=True
                )
            elif x.shape[1] == 1:
                x = x.expand(-1, 3, -1, -1)
            x = x * alpha + bg * (1 - alpha)
        if self.channels == 1 and x.shape[1] == 3:
            w = torch.tensor(LUMA_601, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
            return (x * w).sum(1, keepdim=True)
        if self.channels == 3 and x.shape[1] == 1:
            return x.expand(-1, 3, -1, -1)
        return x

    def _tokens(self, x: Tensor, key: str) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
        """(B, C, H, W) float in [0, 1] -> tokens (B, n(+1), token_dim), grid, content size."""
        h, w = x.shape[-2:]
        ch, cw, canvas_h, canvas_w = self._layout(h, w, key)
        x = self._convert_channels(x)
        if self.policy == "crop":
            x = self._resize_crop(x)
        elif (ch, cw) != (h, w):
            x = self._resample(x, [ch, cw])
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        x = (x - mean) / std
        if (canvas_h, canvas_w) != (ch, cw):
            x = F.pad(x, (0, canvas_w - cw, 0, canvas_h - ch), value=0.0)  # the normalised zero
        tokens = patchify(x, self.patch_size)
        if self.cls:
            b, n, _ = tokens.shape
            tokens = F.pad(tokens, (0, 1), value=0.0)  # flag column = 0 for patches
            cls_row = torch.zeros(b, 1, self.token_dim, dtype=tokens.dtype, device=tokens.device)
            cls_row[..., -1] = 1.0
            tokens = torch.cat([cls_row, tokens], dim=1)
        grid = (canvas_h // self.patch_size, canvas_w // self.patch_size)
        return tokens.contiguous(), grid, (ch, cw)

    @property
    def resize(self) -> int | None:
        """Policy "crop": the shorter side before the centre is cut out, floor(max(image_size) / crop_pct)."""
        if self.crop_pct is None or self.image_size is None:
            return None
        return math.floor(max(self.image_size) / self.crop_pct)

    def _resize_crop(self, x: Tensor) -> Tensor:
        """(B, C, H, W) in [0, 1] -> (B, C, *image_size): the shorter side to ``resize``, then the centre."""
        assert self.resize is not None and self.image_size is not None  # the constructor's check
        return TF.center_crop(self._resample(x, [self.resize]), list(self.image_size))

    def _resample(self, x: Tensor, size: list[int]) -> Tensor:
        """(B, C, H, W) in [0, 1] resized as torchvision's ``Resize(size)`` (one int: the shorter side, aspect
        kept). 8-bit images (every value k / 255) go through PIL in 8 bits, one band at a time, as torchvision
        and Hugging Face image processors resize PIL images, so the pixels equal theirs bit for bit; others
        through torch's antialiased kernel. Both clip to [0, 1]: a bicubic filter overshoots at edges."""
        mode = TF.InterpolationMode(self.interpolation)
        q = x * 255
        if torch.equal(q, q.round()):
            from PIL import Image

            return torch.stack([torch.stack([torch.from_numpy(np.array(
                TF.resize(Image.fromarray(band.numpy()), size, interpolation=mode))) for band in image])
                for image in q.to(torch.uint8).cpu()]).to(x.device, torch.float32) / 255
        return TF.resize(x, size, interpolation=mode, antialias=True).clamp(0.0, 1.0)

    def token_positions(self, grid: Sequence[int], device: torch.device | str | None = None) -> Tensor:
        """Positions (n (+ 1), 2) int64 of an image's tokens on a (gh, gw) grid: (row, col), CLS at (0, 0)
        ("grid"), or (i, i) for the i-th token, CLS first ("sequence")."""
        if self.positions == "sequence":
            index = torch.arange(int(grid[0]) * int(grid[1]) + int(self.cls), device=device)
            return torch.stack([index, index], dim=-1)
        pos = grid_positions(int(grid[0]), int(grid[1]), device=device)
        if self.cls:  # CLS at (0, 0); patches keep their grid coordinates
            pos = torch.cat([torch.zeros(1, 2, dtype=torch.int64, device=pos.device), pos])
        return pos

    # -- public API ---------------------------------------------------------------------------------
    def encode(self, raw: Any, *, key: str = "") -> Segment:
        """One image (Tensor, ndarray, PIL.Image, encoded bytes or path) -> Segment of patch tokens."""
        x = to_image_tensor(raw, key=key)
        tokens, grid, content = self._tokens(x[None], key)
        return Segment(
            modality=self.modality,
            tokens=tokens[0],
            positions=self.token_positions(grid),
            role=self.role,
            meta={"grid": grid, "image_size": (int(x.shape[-2]), int(x.shape[-1])), "content_size": content},
        )

    def encode_batch(self, images: Tensor, *, key: str = "batch") -> tuple[Tensor, Tensor, tuple[int, int]]:
        """Uniform batch fast path, on the images' device: (B, C, H, W) with C in (1, 3, 4), any dtype.

        Returns tokens (B, n, token_dim) float32, positions (n, 2) int64 shared by every image, and
        the grid; each row equals ``encode`` of that image (policy "crop" resamples 8-bit images by PIL, on the CPU).
        """
        if not isinstance(images, Tensor) or images.dim() != 4 or images.shape[1] not in (1, 3, 4):
            shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
            raise ValueError(
                f"{_name(key)}: encode_batch expects a tensor (B, C, H, W) with C in (1, 3, 4), got {shape}"
            )
        _check_hw(images.shape, key)
        tokens, grid, _ = self._tokens(_to_unit(images.detach(), key), key)
        return tokens, self.token_positions(grid, device=images.device), grid

    def patchify(self, images: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, n, p*p*C) with this tokenizer's patch size (no scaling or normalisation)."""
        return patchify(images, self.patch_size)

    def unpatchify(self, tokens: Tensor, grid: Sequence[int]) -> Tensor:
        """Exact inverse of ``patchify``: (B, n, p*p*C) or (n, p*p*C) -> (B, C, H, W) or (C, H, W)."""
        return unpatchify(tokens, grid, self.patch_size)

    @staticmethod
    def grid_positions(gh: int, gw: int) -> Tensor:
        """(gh * gw, 2) int64 (row, col) positions of a gh x gw grid."""
        return grid_positions(gh, gw)

    def decode(self, tokens: Tensor | Segment, meta: dict[str, Any] | None = None) -> Tensor:
        """Tokens (as ``encode`` made them, CLS row/flag included or not) -> (C, h, w) pixels in [0, 1].

        Undoes normalisation and padding; the result has ``meta["content_size"]``, i.e. the size after
        any resize (the original size is ``meta["image_size"]``). Pixel values are not clamped.
        """
        if isinstance(tokens, Segment):
            tokens, meta = tokens.tokens, tokens.meta
        if meta is None:
            raise ValueError("decode needs the segment meta (grid and content_size)")
        gh, gw = meta["grid"]
        if tokens.dim() == 2 and tokens.shape == (gh * gw + 1, self.patch_dim + 1):
            tokens = tokens[1:, : self.patch_dim]  # drop the CLS row and flag column
        x = unpatchify(tokens.to(torch.float32), (gh, gw), self.patch_size)
        mean = torch.tensor(self.mean, device=x.device).view(-1, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(-1, 1, 1)
        ch, cw = meta.get("content_size", (x.shape[-2], x.shape[-1]))
        return (x * std + mean)[..., :ch, :cw]

    def embedder(self, d_model: int) -> nn.Module:
        """Linear(p*p*C -> d_model) (+ learned CLS vector for flagged rows) + TypeEmbedding."""
        return ImagePatchEmbedder(self.patch_dim, d_model, cls=self.cls)
