"""Speech shard samples (``<key>.flac|wav|mp3|ogg|opus`` + ``<key>.txt``, as ``omni data speech-synth`` and
``omni data librispeech`` write them) -> training examples. A clip longer than the audio tokenizer's
``max_seconds`` is dropped, found by its type (``ClipTooLong``): a cut clip would not match its transcript."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Generic, TypeVar

from torch import Tensor

from omni.tokenizers.audio import AudioTokenizer, ClipTooLong

AUDIO_FIELDS = ("flac", "wav", "mp3", "ogg", "opus")
T = TypeVar("T")


class DecodeClip(Generic[T]):
    """Shard sample -> ``encode(audio bytes, transcript, key)``, or None (ShardLoader skips it) when the audio
    tokenizer raises ClipTooLong; ``warn``: say which clip was dropped. Picklable for data workers when
    ``encode`` is (a module function, or a functools.partial of one)."""

    def __init__(self, encode: Callable[[bytes, str, str], T], *, warn: bool = True) -> None:
        self.encode, self.warn = encode, warn

    def __call__(self, sample: dict[str, Any]) -> T | None:
        key = sample.get("__key__", "")
        field = next((f for f in AUDIO_FIELDS if f in sample), None)
        if field is None or "txt" not in sample:
            raise ValueError(f"sample {key!r} needs an audio field ({', '.join(AUDIO_FIELDS)}) and a .txt transcript")
        try:
            return self.encode(sample[field], sample["txt"].decode("utf-8").strip(), key)
        except ClipTooLong as exc:
            if self.warn:
                warnings.warn(f"dropping {key!r}: {exc}", stacklevel=2)
            return None


def log_mel_tokens(audio: AudioTokenizer, raw: bytes, transcript: str, key: str) -> tuple[Tensor, str]:
    """(the clip's log-mel tokens, its transcript): an ``encode`` for DecodeClip."""
    return audio.encode(raw, key=key).tokens, transcript
