"""Modality tokenizers: the protocol, the registry and the four built-ins."""

from omni.tokenizers.base import (
    ENTRY_POINT_GROUP,
    Tokenizer,
    TypeEmbedding,
    available_tokenizers,
    build_tokenizer,
    get_tokenizer,
    register_tokenizer,
)
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.image import ImageTokenizer
from omni.tokenizers.text import TextTokenizer
from omni.tokenizers.trajectory import TrajectoryTokenizer

__all__ = [
    "ENTRY_POINT_GROUP",
    "AudioTokenizer",
    "ImageTokenizer",
    "TextTokenizer",
    "Tokenizer",
    "TrajectoryTokenizer",
    "TypeEmbedding",
    "available_tokenizers",
    "build_tokenizer",
    "get_tokenizer",
    "register_tokenizer",
]
