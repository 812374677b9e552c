"""``omni generate`` as a pipeline above the models: a text LM export (a converted GPT-2, recipes/lm.py's, a
multimodal run's LM task) loaded as a ``omni.generate.TextLM``, and prompts in, continuations out.

    lm = load_lm("omni/gpt2")                                   # an export with a text tokenizer and an LM head
    texts = generate(lm, ["The meaning of life is"], max_new_tokens=20)             # greedy continuations
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from omni.export import load_config, load_pretrained, load_tokenizers
from omni.export_kinds import generation_head
from omni.generate import TextLM, generate_ids
from omni.model import OmniModel


def generate(lm: TextLM | str | os.PathLike, prompts: str | Sequence[str], **options: Any) -> list[str]:
    """The continuation of every prompt (text; ``lm`` a TextLM or an export directory); ``options`` are
    ``generate_ids``'s. One string gives a list of one."""
    if not isinstance(lm, TextLM):
        lm = load_lm(lm)
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    return [lm.decode(ids) for ids in generate_ids(lm, [lm.encode(t) for t in texts], **options)]


def load_lm(export: str | os.PathLike, *, device: str | torch.device = "cpu", head: str | None = None) -> TextLM:
    """A text LM export (a converted GPT-2, or an omni run with an LM task) as a TextLM in eval mode on
    ``device``; ``head`` names the LM head when the export has several."""
    name = generation_head(load_config(export), head, where=os.fspath(export))
    model = load_pretrained(export, device=device)
    if not isinstance(model, OmniModel):
        raise ValueError(f"the export builds a {type(model).__name__}, not an OmniModel")
    return TextLM(model, name, load_tokenizers(export)["text"])


__all__ = ["generate", "load_lm"]
