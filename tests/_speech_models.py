"""Tiny speech recognisers shared by the Whisper tests."""

from __future__ import annotations

import torch

from omni.speech import SpeechRecognizer
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.text import TextTokenizer
from omni.trunk import preset


def tiny_model(audio: AudioTokenizer, text: TextTokenizer, seed: int = 0, **trunk) -> SpeechRecognizer:
    """Seeded tiny encoder-decoder; ``trunk`` overrides both trunks' preset."""
    torch.manual_seed(seed)
    return SpeechRecognizer(audio, text, preset("tiny", **trunk), preset("tiny", cross_attention=True, **trunk))


def one_token_model(audio: AudioTokenizer, text: TextTokenizer, token: int = 500) -> SpeechRecognizer:
    """A model that emits ``token`` at every step whatever it hears (for the repetition guards): the
    decoder's final norm outputs e0, and only ``token``'s embedding has a weight on that channel."""
    model = tiny_model(audio, text).eval()
    with torch.no_grad():
        model.decoder.norm.weight.zero_()
        model.decoder.norm.bias.zero_()
        model.decoder.norm.bias[0] = 1.0  # hidden = e0 -> logits = embedding column 0
        model.text_embed.token.weight[:, 0] = 0.0
        model.text_embed.token.weight[token, 0] = 5.0
    return model
