"""All dataset builders, by the name ``omni data NAME`` uses.

Each ``build_*`` function writes ``<out>/<split>-%06d.tar`` webdataset shards plus
``<out>/manifest.json`` (see omni.data.shards) and returns the manifest; re-running with the same
arguments on an unchanged source prints "up to date" and touches nothing.
"""

from __future__ import annotations

from typing import Any, Callable

from omni.data.builders_hf import build_hf
from omni.data.builders_manifest import build_audio_manifest
from omni.data.builders_rl import build_gym, build_minari
from omni.data.builders_speech import build_librispeech, build_speech_synth
from omni.data.builders_text import build_text, fit_tokenizer
from omni.data.builders_vision import build_fashion_mnist, build_images

BUILDERS: dict[str, Callable[..., dict[str, Any]]] = {
    "fashion-mnist": build_fashion_mnist,
    "images": build_images,
    "speech-synth": build_speech_synth,
    "librispeech": build_librispeech,
    "gym": build_gym,
    "minari": build_minari,
    "text": build_text,
    "hf": build_hf,
    "audio": build_audio_manifest,
}

__all__ = [
    "BUILDERS",
    "build_fashion_mnist",
    "build_images",
    "build_speech_synth",
    "build_librispeech",
    "build_gym",
    "build_minari",
    "build_text",
    "build_hf",
    "build_audio_manifest",
    "fit_tokenizer",
]
