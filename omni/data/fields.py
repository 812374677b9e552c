"""Field decoders: the raw bytes of one tar member -> a Python value, by the field's extension (webdataset's
convention). They run inside data workers. Images open through omni.image_bytes, the one rule the image tokenizer
follows too (the pixel bound read from the header, EXIF orientation applied), so a photo trains the way
``omni predict`` later reads it."""

from __future__ import annotations

import io
import json
from typing import Any, Callable

import numpy as np

from omni.image_bytes import open_image



def decode_image(data: bytes, mode: str | None = None) -> Any:
    """Encoded image bytes (PNG, JPEG, WebP, PPM, ...) -> a loaded PIL image in its own mode, upright (EXIF
    orientation applied, as the image tokenizer applies it).

    ``mode`` converts (e.g. "RGB"); by default the file's mode (L, LA, RGB, RGBA, I;16 ...) is kept. More than
    ``omni.image_bytes.MAX_PIXELS`` pixels (by the header, before decoding) is a ValueError: the sample is corrupt.
    """
    image = open_image(data)
    return image.convert(mode) if mode is not None and image.mode != mode else image


def decode_audio(data: bytes) -> tuple[np.ndarray, int]:
    """Encoded audio bytes (WAV, FLAC, OGG, MP3) -> (float32 samples[, channels] array, sample rate).

    Uses soundfile, never torchaudio.load (which needs FFmpeg through torchcodec).
    """
    import soundfile as sf

    array, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=False)
    return array, int(rate)


def decode_cls(data: bytes) -> int:
    """An integer class id written as text."""
    return int(data.decode("utf-8").strip())


def decode_text(data: bytes) -> str:
    return data.decode("utf-8")


def decode_json(data: bytes) -> Any:
    return json.loads(data.decode("utf-8"))


def decode_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def decode_npz(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def decode_u8(data: bytes) -> np.ndarray:
    """Raw bytes as a uint8 array (e.g. byte-level token ids)."""
    return np.frombuffer(data, dtype=np.uint8).copy()


_IMAGE_EXTS = {"png", "jpg", "jpeg", "webp", "ppm", "pgm", "pbm", "pnm", "bmp", "tif", "tiff", "gif"}
_AUDIO_EXTS = {"wav", "flac", "ogg", "mp3", "opus"}
_BY_EXT: dict[str, Callable[[bytes], Any]] = {
    **{e: decode_image for e in _IMAGE_EXTS},
    **{e: decode_audio for e in _AUDIO_EXTS},
    **{e: decode_cls for e in ("cls", "cls2", "index", "id")},
    **{e: decode_text for e in ("txt", "text", "transcript")},
    "json": decode_json,
    "npy": decode_npy,
    "npz": decode_npz,
    "u8": decode_u8,
}


def decode_field(ext: str, data: bytes) -> Any:
    """Decode one field by its extension (the part after the last dot); unknown kinds stay bytes."""
    fn = _BY_EXT.get(ext.rsplit(".", 1)[-1].lower())
    return fn(data) if fn is not None else data


def decode_fields(sample: dict[str, Any]) -> dict[str, Any]:
    """Every field of a raw sample decoded by extension; ``__key__``/``__url__`` are kept."""
    return {k: (v if k.startswith("__") else decode_field(k, v)) for k, v in sample.items()}


__all__ = ["decode_audio", "decode_cls", "decode_field", "decode_fields", "decode_image", "decode_json", "decode_npy",
           "decode_npz", "decode_text", "decode_u8"]
