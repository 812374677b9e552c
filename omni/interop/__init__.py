"""Other libraries' checkpoints (peers) <-> omni exports, exactly: one converter per peer family.

    convert("timm/vit-b16", "omni/vit-b16")                  # a peer checkpoint -> an omni export (load_pretrained)
    to_peer("omni/vit-b16", "timm/vit-b16-tuned", "timm")    # an omni export -> the peer's own format
    config, state_dict, tokenizers = read_model(src)        # an export or a peer checkpoint, in memory

The same from the shell: ``omni convert SRC OUT [--from PEER] [--arch NAME]`` and
``omni convert --to PEER EXPORT OUT [--arch NAME]``.

A converter is a pair of pure functions, the peer's tensors and config <-> an export's (config, state dict,
tokenizers) with the trunk options that make the architecture exact, plus the reading and writing of the peer's
files (``Converter``). ``register_converter`` adds one; ``convert`` takes the converter named, or the one that
recognises SRC. Options (``arch=``) go to the converter. Nothing here downloads: peers' models are built from
their configs, weights are read from the files given (``.pt`` / ``.bin`` with ``torch.load(weights_only=True)``).

What cannot be converted raises ConversionError, one line naming it: an unknown architecture, a missing file, a
tensor of the wrong shape (by key), an option the other side cannot express.
"""

from __future__ import annotations

from omni.interop.registry import (CONVERTERS, ConversionError, Converter, Export, cast_tensors, check_tensors, convert,
                                   find_converter, fresh_output, get_converter, is_export, names, read_config,
                                   read_directory, read_export, read_model, read_state_dict, register_converter,
                                   source_dtype, to_peer, write_export)

# the converters, each registering itself with omni.interop.registry; none imports its peer library until used
from omni.interop import hf  # noqa: F401  (the "hf" converter; the HF families below register with it)
from omni.interop import gpt2  # noqa: F401  (HF GPT-2, and the GPT-2 body the DT shares)
from omni.interop import hf_decision_transformer  # noqa: F401
from omni.interop import timm  # noqa: F401
from omni.interop import hf_vit  # noqa: F401  (reuses timm's layout)
from omni.interop import whisper  # noqa: F401  (HF family "whisper" and the "openai-whisper" converter)

__all__ = ["CONVERTERS", "ConversionError", "Converter", "Export", "cast_tensors", "check_tensors", "convert",
           "find_converter", "fresh_output", "get_converter", "is_export", "names", "read_config", "read_directory",
           "read_export", "read_model", "read_state_dict", "register_converter", "source_dtype", "to_peer",
           "write_export"]
