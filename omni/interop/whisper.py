"""Whisper checkpoints (Hugging Face ``WhisperForConditionalGeneration``, openai-whisper ``.pt``) <-> omni's
SpeechRecognizer (omni.speech), exactly.

    export = from_openai(model_state_dict, dims)          # pure: tensors and dicts in, (config, state dict,
    export = from_hf(hf_state_dict, hf_config)            #   tokenizers) out; build_speech_recognizer builds it
    dims, state_dict = to_openai(*export)                 # {"dims": dims, "model_state_dict": state_dict}
    hf_config, hf_state_dict = to_hf(*export)             # WhisperForConditionalGeneration's
    omni convert whisper-base.pt OUT; omni convert HF_DIR OUT; omni convert --to openai-whisper|hf EXPORT OUT

Whisper is omni's SpeechRecognizer with these composed options (no trunk branch is Whisper's): the audio
tokenizer's Whisper front-end (``AudioTokenizer(frontend="whisper")``: whisper.transcribe's 30 s log-mel as
frame-pair tokens), its conv stem (``ConvStem``), both trunks with learned_1d positions (the tables of the
checkpoint, the encoder's sinusoids included, so nothing is recomputed), exact-erf GELU, LayerNorm eps 1e-5,
final norms; the decoder's LM head tied to the token table; a config prompt and decoding rules.

    openai-whisper                    HF (prefix model.)                  omni
    encoder.conv1, conv2              encoder.conv1, conv2                audio_embed.conv1, conv2
    encoder.positional_embedding      encoder.embed_positions.weight      encoder.absolute.table.weight
    {enc,dec}oder.blocks.i.           {enc,dec}oder.layers.i.             {enc,dec}oder.blocks.i.
      attn_ln                           self_attn_layer_norm                attn_norm
      attn.query, key, value            self_attn.q_proj, k_proj, v_proj    attn.qkv (one Linear: rows q, k, v)
      attn.out                          self_attn.out_proj                  attn.out
      cross_attn_ln                     encoder_attn_layer_norm             cross_norm
      cross_attn.query                  encoder_attn.q_proj                 cross.q
      cross_attn.key, value             encoder_attn.k_proj, v_proj         cross.kv (rows k, v)
      cross_attn.out                    encoder_attn.out_proj               cross.out
      mlp_ln, mlp.0, mlp.2              final_layer_norm, fc1, fc2          mlp_norm, mlp.up, mlp.down
    encoder.ln_post                   encoder.layer_norm                  encoder.norm
    decoder.token_embedding           decoder.embed_tokens (= proj_out)   text_embed.token (= head.proj, tied)
    decoder.positional_embedding      decoder.embed_positions.weight      decoder.absolute.table.weight
    decoder.ln                        decoder.layer_norm                  decoder.norm
    (nothing)                         (nothing)                           text_embed.type_embedding: zero

Biases Whisper has not: the keys (self and cross attention) have no bias, and omni's fused projections get a
zero one. It is trained like any parameter, and dropped on the way back, exactly: a key bias b adds q . b to
every score of a query row, the same for all keys, and softmax is invariant to a constant added to a row.
The text type embedding (a constant added to every token embedding) is folded into the decoder's position table
on the way back (zero: the table unchanged, bit for bit). The encoder's position table is a buffer in Whisper and
frozen in HF; in omni it is a parameter (fine-tuning trains it unless frozen).

Tokenizers: ``whisper_tokenizer`` (multilingual when n_vocab >= 51,865, num_languages = n_vocab - 51,765 -
multilingual), Whisper's audio front-end with n_mels (80; 128 for large-v3). Prompt: [<|startoftranscript|>,
<|language|>, <|task|>, <|notimestamps|>] (``language`` "en", ``task`` "transcribe" by default), English-only
models [<|startoftranscript|>, <|notimestamps|>]. Decoding rules (export config "decoding", used by omni
transcribe): at most n_text_ctx // 2 tokens (224), no repetition guard or duration cap (whisper.decode has
neither), Whisper's suppress_tokens "-1" (``suppress_tokens``) and suppress-blank (" " and eot first).
Timestamps are not predicted (<|notimestamps|>) unless asked for: ``SpeechRecognizer.timestamp_mode()`` (``omni
transcribe --timestamps tokens``) decodes as whisper.decode(without_timestamps=False) does, the prompt without
<|notimestamps|>, the rules above and then omni.decoding.TimestampRules (Whisper's ApplyTimestampRules,
max_initial_timestamp 1.0 s); the export is the same either way. HF's dropout (also on the embeddings) is not
carried: dropout 0.

Refused, naming it: another model_type, activation other than gelu, scale_embedding, an untied proj_out, encoder
and decoder widths that differ, missing or misshapen tensors (by key); on the way back a model without the
Whisper front-end and stem, other positions / norms / activations, GQA, a CTC head, and for openai-whisper
MLP widths other than 4 d.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from omni.export_kinds import SPEECH_RECOGNIZER
from omni.files import sha256_file
from omni.interop.hf import HFFamily, register_hf_family, write_hf_files
from omni.interop.registry import (ConversionError, Converter, Export, check_tensors, names, read_directory,
                                   read_export, register_converter)
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.text import TextTokenizer
from omni.trunk import TrunkConfig

MODEL_TYPE = "whisper"
HF_FORMAT = "transformers:" + MODEL_TYPE
OPENAI_FORMAT = "openai-whisper"
BUILDER = SPEECH_RECOGNIZER
DIMS = ("n_mels", "n_audio_ctx", "n_audio_state", "n_audio_head", "n_audio_layer", "n_vocab", "n_text_ctx",
        "n_text_state", "n_text_head", "n_text_layer")
HOP, RATE = 160, 16000  # Whisper's front-end: 10 ms frames at 16 kHz, two frames per encoder position
OPTIONS = ("language", "task")
# inside a block: omni name -> openai name (fused attention projections separately)
BLOCK = (("attn_norm", "attn_ln"), ("attn.out", "attn.out"), ("cross_norm", "cross_attn_ln"),
         ("cross.q", "cross_attn.query"), ("cross.out", "cross_attn.out"), ("mlp_norm", "mlp_ln"),
         ("mlp.up", "mlp.0"), ("mlp.down", "mlp.2"))
TOP = (("audio_embed.conv1", "encoder.conv1"), ("audio_embed.conv2", "encoder.conv2"),
       ("encoder.norm", "encoder.ln_post"), ("decoder.norm", "decoder.ln"))
ENCODER_TABLE, DECODER_TABLE = "encoder.absolute.table.weight", "decoder.absolute.table.weight"
TOKENS, HEAD, TYPE_EMBEDDING = "text_embed.token.weight", "head.proj.weight", "text_embed.type_embedding.weight"
# HF name pieces <-> openai's (HF keys: "model." + these after the renames; proj_out.weight is the tied table)
HF_TOP = (("encoder.embed_positions.weight", "encoder.positional_embedding"), ("encoder.layer_norm.", "encoder.ln_post."),
          ("decoder.embed_tokens.weight", "decoder.token_embedding.weight"),
          ("decoder.embed_positions.weight", "decoder.positional_embedding"), ("decoder.layer_norm.", "decoder.ln."))
HF_BLOCK = (("self_attn.q_proj.", "attn.query."), ("self_attn.k_proj.", "attn.key."), ("self_attn.v_proj.", "attn.value."),
            ("self_attn.out_proj.", "attn.out."), ("self_attn_layer_norm.", "attn_ln."),
            ("encoder_attn.q_proj.", "cross_attn.query."), ("encoder_attn.k_proj.", "cross_attn.key."),
            ("encoder_attn.v_proj.", "cross_attn.value."), ("encoder_attn.out_proj.", "cross_attn.out."),
            ("encoder_attn_layer_norm.", "cross_attn_ln."), ("fc1.", "mlp.0."), ("fc2.", "mlp.2."),
            ("final_layer_norm.", "mlp_ln."))
PROJ_OUT = "proj_out.weight"


# ----------------------------------------------------------------------------------------------------
# Tokenizers, prompt, decoding rules


def text_tokenizer(n_vocab: int) -> TextTokenizer:
    """Whisper's vocabulary for an ``n_vocab``-wide model (51,864 English-only, 51,865 multilingual, 51,866
    large-v3)."""
    from omni.tokenizers.ranks import whisper_tokenizer

    multilingual = n_vocab >= 51865
    try:
        return whisper_tokenizer(multilingual=multilingual, num_languages=n_vocab - 51765 - int(multilingual))
    except ValueError as exc:
        raise ConversionError(f"n_vocab {n_vocab} is not a Whisper vocabulary size ({exc})") from exc


def is_multilingual(text: TextTokenizer) -> bool:
    return text.vocab_size >= 51865


def prompt_names(text: TextTokenizer, language: str = "en", task: str = "transcribe") -> list[str]:
    """The decoder prompt by token names: Whisper's sot sequence + <|notimestamps|>."""
    if not is_multilingual(text):
        if (language, task) != ("en", "transcribe"):
            raise ConversionError(f"an English-only Whisper has no language or task tokens (language {language!r}, "
                                  f"task {task!r} asked): it only transcribes English")
        return ["<|startoftranscript|>", "<|notimestamps|>"]
    if task not in ("transcribe", "translate"):
        raise ConversionError(f"task must be transcribe or translate, got {task!r}")
    names = ["<|startoftranscript|>", f"<|{language}|>", f"<|{task}|>", "<|notimestamps|>"]
    try:
        for name in names:
            text.token_id(name)
    except KeyError:
        raise ConversionError(f"language {language!r} is not one of this model's language tokens") from None
    return names


def non_speech_tokens(text: TextTokenizer) -> list[int]:
    """Whisper's non-speech tokens (whisper.tokenizer.Tokenizer.non_speech_tokens, the same rule): the single-token
    symbols of speaker tags and annotations, alone or after a space, the first token of the musical signs, and
    " -" / " '" (hyphens and quotes stay allowed inside words)."""
    def encode(s: str) -> list[int]:
        return text.hf.encode(s, add_special_tokens=False).ids

    symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
    symbols += "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
    music = set("♩♪♫♬♭♮♯")  # U+2640..267F: 3-byte UTF-8 sharing their first token, which is safe to suppress
    result = {encode(" -")[0], encode(" '")[0]}
    for symbol in symbols + sorted(music):
        for ids in (encode(symbol), encode(" " + symbol)):
            if len(ids) == 1 or symbol in music:
                result.add(ids[0])
    return sorted(result)


def suppress_tokens(text: TextTokenizer) -> list[int]:
    """Whisper's default suppress_tokens ("-1"): the non-speech tokens and translate, transcribe,
    startoftranscript, startofprev, startoflm, nospeech."""
    specials = ("translate", "transcribe", "startoftranscript", "startofprev", "startoflm", "nospeech")
    return sorted(set(non_speech_tokens(text)) | {text.token_id(name) for name in specials})


def decoding_rules(text: TextTokenizer, n_text_ctx: int) -> dict[str, Any]:
    """whisper.decode's rules at temperature 0 without timestamps, as a SpeechRecognizer's config "decoding"."""
    blank = text.hf.encode(" ", add_special_tokens=False).ids
    return {"max_new_tokens": n_text_ctx // 2, "tokens_per_second": None, "max_repeats": None,
            "suppress_tokens": suppress_tokens(text), "suppress_at_start": sorted({*blank, text.eos_id})}


# ----------------------------------------------------------------------------------------------------
# Alignment heads: the decoder's cross-attention heads whose maps follow the speech (word timestamps). Export config
# "alignment_heads", [layer, head] pairs, read by omni.timestamps: from a HF directory's generation_config.json, or
# for an openai .pt by the file's sha256 (released models only); written back to a HF generation_config.json, not to
# a .pt (the format has no such field).

GENERATION_CONFIG = "generation_config.json"  # HF: where "alignment_heads" ([layer, head] pairs) lives


def decode_alignment_heads(dump: bytes, n_layers: int, n_heads: int) -> list[list[int]]:
    """openai-whisper's alignment heads (gzip + base85 bool array, ``whisper._ALIGNMENT_HEADS``) -> [layer, head]
    pairs in row-major order, HF's generation_config "alignment_heads" form."""
    import base64
    import gzip

    import numpy as np

    mask = np.frombuffer(gzip.decompress(base64.b85decode(dump)), dtype=bool)
    if mask.size != n_layers * n_heads:
        raise ConversionError(f"alignment heads of {mask.size} entries do not fit {n_layers} x {n_heads} heads")
    return [[int(i), int(j)] for i, j in np.argwhere(mask.reshape(n_layers, n_heads))]


def openai_checkpoints() -> dict[str, tuple[str, bytes]]:
    """openai-whisper's released checkpoints, sha256 of the .pt -> (model name, its alignment heads dump), from the
    installed package ({} without it). Its download table is private (``whisper._MODELS``, ``_ALIGNMENT_HEADS``) but
    the only record of which file is which model: each URL names the file's sha256, so a given file's own hash
    names its model, with nothing downloaded."""
    try:
        import whisper
    except ImportError:
        return {}
    table: dict[str, tuple[str, bytes]] = {}
    for name, url in whisper._MODELS.items():
        if name in whisper._ALIGNMENT_HEADS:  # "large" / "turbo" alias a file listed under its own name first
            table.setdefault(url.split("/")[-2], (name, whisper._ALIGNMENT_HEADS[name]))
    return table


def openai_model_name(path: Path) -> str | None:
    """The released openai-whisper model this file is (by its sha256), else None."""
    known = openai_checkpoints().get(sha256_file(path))
    return known[0] if known else None


def openai_alignment_heads(path: Path, dims: Mapping[str, int]) -> list[list[int]] | None:
    """The alignment heads of a released openai-whisper file (identified by its sha256), else None (a fine-tune
    or any other file: no heads are known for it)."""
    known = openai_checkpoints().get(sha256_file(path))
    return decode_alignment_heads(known[1], dims["n_text_layer"], dims["n_text_head"]) if known else None


def hf_alignment_heads(src: Path, dims: Mapping[str, int]) -> list[list[int]] | None:
    """The "alignment_heads" of a HF directory's generation_config.json, checked against the decoder's layers
    and heads; None without the file or the key."""
    import json

    path = src / GENERATION_CONFIG
    if not path.is_file():
        return None
    try:
        heads = json.loads(path.read_text()).get("alignment_heads")
    except (ValueError, AttributeError) as exc:
        raise ConversionError(f"{path} is not a JSON object: {exc}") from exc
    if heads is None:
        return None
    L, H = dims["n_text_layer"], dims["n_text_head"]
    try:
        pairs = [[int(layer), int(head)] for layer, head in heads]
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"{path}: alignment_heads must be [layer, head] pairs, got {heads!r}") from exc
    bad = [p for p in pairs if not (0 <= p[0] < L and 0 <= p[1] < H)]
    if not pairs or bad:
        raise ConversionError(f"{path}: alignment_heads {bad or heads} do not fit the decoder ({L} layers x {H} "
                              "heads)")
    return pairs


def hf_generation_config(config: Mapping[str, Any], hf_config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The generation_config.json ``write_hf`` writes for an export with alignment heads: the token ids of the HF
    config (what HF derives from config.json without the file) and "alignment_heads"; None without alignment
    heads (no file: HF derives its generation config from config.json, as before)."""
    heads = config.get("alignment_heads")
    if not heads:
        return None
    keys = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "begin_suppress_tokens")
    return {**{k: hf_config[k] for k in keys if hf_config.get(k) is not None},
            "max_length": hf_config["max_target_positions"], "alignment_heads": [list(map(int, p)) for p in heads]}


# ----------------------------------------------------------------------------------------------------
# openai-whisper <-> omni (pure)


def openai_shapes(dims: Mapping[str, int], encoder_mlp: int | None = None,
                  decoder_mlp: int | None = None) -> dict[str, torch.Size]:
    """Every tensor of ``Whisper(ModelDimensions(**dims)).state_dict()`` with its shape."""
    d, t = dims["n_audio_state"], dims["n_text_state"]
    shapes: dict[str, tuple[int, ...]] = {
        "encoder.conv1.weight": (d, dims["n_mels"], 3), "encoder.conv1.bias": (d,),
        "encoder.conv2.weight": (d, d, 3), "encoder.conv2.bias": (d,),
        "encoder.positional_embedding": (dims["n_audio_ctx"], d), "encoder.ln_post.weight": (d,),
        "encoder.ln_post.bias": (d,), "decoder.token_embedding.weight": (dims["n_vocab"], t),
        "decoder.positional_embedding": (dims["n_text_ctx"], t), "decoder.ln.weight": (t,), "decoder.ln.bias": (t,)}
    for side, w, layers, mlp, cross in (("encoder", d, dims["n_audio_layer"], encoder_mlp or 4 * d, False),
                                        ("decoder", t, dims["n_text_layer"], decoder_mlp or 4 * t, True)):
        for i in range(layers):
            p = f"{side}.blocks.{i}."
            attns = ("attn", "cross_attn") if cross else ("attn",)
            for a in attns:
                for proj in ("query", "key", "value", "out"):
                    shapes[f"{p}{a}.{proj}.weight"] = (w, w)
                    if proj != "key":
                        shapes[f"{p}{a}.{proj}.bias"] = (w,)
                shapes[f"{p}{a}_ln.weight"] = shapes[f"{p}{a}_ln.bias"] = (w,)
            shapes.update({f"{p}mlp.0.weight": (mlp, w), f"{p}mlp.0.bias": (mlp,), f"{p}mlp.2.weight": (w, mlp),
                           f"{p}mlp.2.bias": (w,), f"{p}mlp_ln.weight": (w,), f"{p}mlp_ln.bias": (w,)})
    return {k: torch.Size(v) for k, v in shapes.items()}


def trunk_configs(dims: Mapping[str, int], encoder_mlp: int, decoder_mlp: int) -> tuple[TrunkConfig, TrunkConfig]:
    d = dims["n_audio_state"]
    common = dict(d_model=d, activation="gelu", norm="layernorm", norm_eps=1e-5, final_norm=True,
                  positions="learned_1d", bias=True, dropout=0.0)
    encoder = TrunkConfig(n_layers=dims["n_audio_layer"], n_heads=dims["n_audio_head"], mlp_ratio=encoder_mlp / d,
                          max_positions=dims["n_audio_ctx"], **common)
    decoder = TrunkConfig(n_layers=dims["n_text_layer"], n_heads=dims["n_text_head"], mlp_ratio=decoder_mlp / d,
                          max_positions=dims["n_text_ctx"], cross_attention=True, **common)
    for cfg, mlp in ((encoder, encoder_mlp), (decoder, decoder_mlp)):
        if int(cfg.mlp_ratio * d) != mlp:
            raise ConversionError(f"an MLP width of {mlp} is not representable as mlp_ratio * {d}")
    return encoder, decoder


def _check_dims(dims: Any) -> dict[str, int]:
    if not isinstance(dims, Mapping) or set(DIMS) - set(dims):
        got = names(dims) if isinstance(dims, Mapping) else type(dims).__name__
        raise ConversionError(f"Whisper dims need {', '.join(DIMS)}; got {got}")
    dims = {k: int(dims[k]) for k in DIMS}
    if dims["n_audio_state"] != dims["n_text_state"]:
        raise ConversionError(f"n_audio_state {dims['n_audio_state']} != n_text_state {dims['n_text_state']}: "
                              "omni's cross-attention reads encoder states at the decoder width")
    return dims


def from_openai(state_dict: Mapping[str, Tensor], dims: Mapping[str, int], *, language: str = "en",
                task: str = "transcribe", source: Mapping[str, Any] | None = None,
                encoder_mlp: int | None = None, decoder_mlp: int | None = None) -> Export:
    """openai-whisper's (model_state_dict, dims) -> (export config, state dict, {"audio", "text"} tokenizers) of a
    SpeechRecognizer; ``source`` (default {"format": "openai-whisper", "dims": dims}) is kept in the config."""
    dims = _check_dims(dims)
    d = dims["n_audio_state"]
    sd = {k: v for k, v in state_dict.items() if k not in ("decoder.mask", "alignment_heads")}  # non-persistent
    check_tensors(sd, openai_shapes(dims, encoder_mlp, decoder_mlp), f"a Whisper with dims {dims}")
    encoder, decoder = trunk_configs(dims, encoder_mlp or 4 * d, decoder_mlp or 4 * d)
    text = text_tokenizer(dims["n_vocab"])
    if text.vocab_size != dims["n_vocab"]:
        raise ConversionError(f"n_vocab {dims['n_vocab']} but Whisper's vocabulary has {text.vocab_size} ids")
    audio = AudioTokenizer(n_mels=dims["n_mels"], frontend="whisper", max_seconds=dims["n_audio_ctx"] * 2 * HOP / RATE,
                           truncation="truncate")  # pad_or_trim cuts, silently
    out: dict[str, Tensor] = {}
    for ours, theirs in TOP:
        out[f"{ours}.weight"], out[f"{ours}.bias"] = sd[f"{theirs}.weight"], sd[f"{theirs}.bias"]
    out[ENCODER_TABLE], out[DECODER_TABLE] = sd["encoder.positional_embedding"], sd["decoder.positional_embedding"]
    out[TOKENS] = out[HEAD] = sd["decoder.token_embedding.weight"]
    out[TYPE_EMBEDDING] = torch.zeros(d, dtype=out[TOKENS].dtype)
    for side, layers in (("encoder", dims["n_audio_layer"]), ("decoder", dims["n_text_layer"])):
        for i in range(layers):
            ours, theirs = f"{side}.blocks.{i}.", f"{side}.blocks.{i}."
            for o, t in BLOCK:
                if f"{theirs}{t}.weight" in sd:
                    out[f"{ours}{o}.weight"], out[f"{ours}{o}.bias"] = sd[f"{theirs}{t}.weight"], sd[f"{theirs}{t}.bias"]
            a = f"{theirs}attn."
            out[f"{ours}attn.qkv.weight"] = torch.cat([sd[a + "query.weight"], sd[a + "key.weight"], sd[a + "value.weight"]])
            out[f"{ours}attn.qkv.bias"] = torch.cat([sd[a + "query.bias"], torch.zeros_like(sd[a + "query.bias"]),
                                                     sd[a + "value.bias"]])
            if side == "decoder":
                c = f"{theirs}cross_attn."
                out[f"{ours}cross.kv.weight"] = torch.cat([sd[c + "key.weight"], sd[c + "value.weight"]])
                out[f"{ours}cross.kv.bias"] = torch.cat([torch.zeros_like(sd[c + "value.bias"]), sd[c + "value.bias"]])
    out = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in out.items()}
    out[HEAD] = out[TOKENS]  # one tensor, as the tied model has it
    dtype = str(sd["decoder.token_embedding.weight"].dtype).removeprefix("torch.")
    config = {"builder": BUILDER, "encoder": encoder.to_dict(), "decoder": decoder.to_dict(), "ctc": False,
              "audio_positions": "none", "prompt": prompt_names(text, language, task),
              "decoding": decoding_rules(text, dims["n_text_ctx"]),
              "source": {"format": OPENAI_FORMAT, "dims": dims, "dtype": dtype, **(source or {})}}
    return config, out, {"audio": audio, "text": text}


def _refuse_layout(config: Mapping[str, Any], tokenizers: Mapping[str, Any]) -> tuple[TrunkConfig, TrunkConfig]:
    """The export's trunks, refused (ConversionError, one line) unless Whisper can express them."""
    if config.get("builder") != BUILDER:
        raise ConversionError(f"a {config.get('builder')!r} model is not a speech recognizer (Whisper's is {BUILDER})")
    audio = tokenizers.get("audio")
    if not isinstance(audio, AudioTokenizer) or audio.frontend != "whisper" or audio.n_fft != 400 \
            or audio.hop_length != HOP or audio.sample_rate != RATE:
        raise ConversionError("Whisper reads its own front-end (AudioTokenizer(frontend='whisper'), 16 kHz, n_fft "
                              "400, hop 160) through its conv stem; this export's audio tokenizer is another")
    if config.get("ctc"):
        raise ConversionError("the CTC head has no Whisper counterpart (export a model built with ctc=False)")
    if config.get("audio_positions", "none") != "none":
        raise ConversionError("audio_positions must be 'none' (Whisper's encoder positions are its trunk table)")
    encoder, decoder = TrunkConfig(**config["encoder"]), TrunkConfig(**config["decoder"])
    for side, cfg in (("encoder", encoder), ("decoder", decoder)):
        layout = (cfg.activation, cfg.norm, cfg.norm_eps, cfg.final_norm, cfg.positions, cfg.bias, cfg.kv_heads)
        if layout != ("gelu", "layernorm", 1e-5, True, "learned_1d", True, cfg.n_heads):
            raise ConversionError(f"Whisper's {side} needs activation gelu, layernorm eps 1e-5 with a final norm, "
                                  f"learned_1d positions, biases and n_kv_heads = n_heads; got {cfg}")
    return encoder, decoder


def to_openai(config: Mapping[str, Any], state_dict: Mapping[str, Tensor],
              tokenizers: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, Tensor]]:
    """An export (config, state dict, tokenizers) -> (dims, model_state_dict) for ``Whisper(ModelDimensions(**dims))``.
    Key biases are dropped and the text type embedding folded into the decoder's position table (module
    docstring); tensors come back in the dtype the model was converted from (else as stored)."""
    encoder, decoder = _refuse_layout(config, tokenizers)
    sd = dict(state_dict)
    if TOKENS not in sd and HEAD in sd:  # the export stores a tied tensor once, under either name
        sd[TOKENS] = sd[HEAD]
    d = encoder.d_model
    enc_mlp, dec_mlp = int(encoder.mlp_ratio * d), int(decoder.mlp_ratio * d)
    dims = {"n_mels": tokenizers["audio"].n_mels, "n_audio_ctx": encoder.max_positions, "n_audio_state": d,
            "n_audio_head": encoder.n_heads, "n_audio_layer": encoder.n_layers, "n_vocab": sd[TOKENS].shape[0],
            "n_text_ctx": decoder.max_positions, "n_text_state": decoder.d_model, "n_text_head": decoder.n_heads,
            "n_text_layer": decoder.n_layers}
    if HEAD in sd and not torch.equal(sd[HEAD], sd[TOKENS]):
        raise ConversionError("Whisper's logits use the token table: the LM head must be tied to it")
    out: dict[str, Tensor] = {}
    for ours, theirs in TOP:
        out[f"{theirs}.weight"], out[f"{theirs}.bias"] = sd[f"{ours}.weight"], sd[f"{ours}.bias"]
    out["encoder.positional_embedding"] = sd[ENCODER_TABLE]
    table, shift = sd[DECODER_TABLE], sd.get(TYPE_EMBEDDING)
    out["decoder.positional_embedding"] = table + shift if shift is not None and bool(shift.any()) else table
    out["decoder.token_embedding.weight"] = sd[TOKENS]
    for side, layers in (("encoder", encoder.n_layers), ("decoder", decoder.n_layers)):
        for i in range(layers):
            p = f"{side}.blocks.{i}."
            for o, t in BLOCK:
                if f"{p}{o}.weight" in sd:
                    out[f"{p}{t}.weight"], out[f"{p}{t}.bias"] = sd[f"{p}{o}.weight"], sd[f"{p}{o}.bias"]
            q, k, v = sd[f"{p}attn.qkv.weight"].chunk(3)
            qb, _, vb = sd[f"{p}attn.qkv.bias"].chunk(3)  # the key bias cancels in softmax: dropped
            out.update({f"{p}attn.query.weight": q, f"{p}attn.key.weight": k, f"{p}attn.value.weight": v,
                        f"{p}attn.query.bias": qb, f"{p}attn.value.bias": vb})
            if side == "decoder":
                k, v = sd[f"{p}cross.kv.weight"].chunk(2)
                out.update({f"{p}cross_attn.key.weight": k, f"{p}cross_attn.value.weight": v,
                            f"{p}cross_attn.value.bias": sd[f"{p}cross.kv.bias"].chunk(2)[1]})
    check_tensors(out, openai_shapes(dims, enc_mlp, dec_mlp), f"a Whisper with dims {dims}")
    dtype = getattr(torch, str(config.get("source", {}).get("dtype", "")), None)
    out = {k: v.detach().to("cpu", dtype=dtype if isinstance(dtype, torch.dtype) else v.dtype, copy=True).contiguous()
           for k, v in out.items()}
    return dims, out


# ----------------------------------------------------------------------------------------------------
# Hugging Face <-> openai names (the tensors are the same)


def hf_to_openai_name(key: str) -> str | None:
    """openai-whisper's name of a HF WhisperForConditionalGeneration tensor (None: proj_out, the tied table)."""
    if key == PROJ_OUT:
        return None
    key = key.removeprefix("model.")
    for side in ("encoder", "decoder"):
        prefix = f"{side}.layers."
        if key.startswith(prefix):
            i, _, rest = key[len(prefix):].partition(".")
            for hf, ours in HF_BLOCK:
                if rest.startswith(hf):
                    return f"{side}.blocks.{i}.{ours}{rest[len(hf):]}"
            return "model." + key  # unknown: check_tensors names it as it is
    for hf, ours in HF_TOP:
        if key.startswith(hf):
            return ours + key[len(hf):]
    return key  # conv1, conv2: the same names


def openai_to_hf_name(key: str) -> str:
    for side in ("encoder", "decoder"):
        prefix = f"{side}.blocks."
        if key.startswith(prefix):
            i, _, rest = key[len(prefix):].partition(".")
            hf, ours = next((hf, ours) for hf, ours in HF_BLOCK if rest.startswith(ours))
            return f"model.{side}.layers.{i}.{hf}{rest[len(ours):]}"
    for hf, ours in HF_TOP:
        if key.startswith(ours):
            return "model." + hf + key[len(ours):]
    return "model." + key


def hf_dims(hf: Mapping[str, Any]) -> dict[str, int]:
    """openai-whisper's dims of a WhisperConfig (dict); ConversionError for what Whisper's layout is not."""
    if hf.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise ConversionError(f"model_type is {hf.get('model_type')!r}, not {MODEL_TYPE!r}")
    if hf.get("activation_function", "gelu") != "gelu":
        raise ConversionError(f"activation_function {hf['activation_function']!r} has no omni Whisper counterpart "
                              "(only gelu)")
    if hf.get("scale_embedding", False):
        raise ConversionError("scale_embedding=True (token embeddings times sqrt(d_model)) is not Whisper's layout")
    d = int(hf.get("d_model", 384))
    return {"n_mels": int(hf.get("num_mel_bins", 80)), "n_audio_ctx": int(hf.get("max_source_positions", 1500)),
            "n_audio_state": d, "n_audio_head": int(hf.get("encoder_attention_heads", 6)),
            "n_audio_layer": int(hf.get("encoder_layers", 4)), "n_vocab": int(hf.get("vocab_size", 51865)),
            "n_text_ctx": int(hf.get("max_target_positions", 448)), "n_text_state": d,
            "n_text_head": int(hf.get("decoder_attention_heads", 6)), "n_text_layer": int(hf.get("decoder_layers", 4))}


def from_hf(state_dict: Mapping[str, Tensor], hf_config: Mapping[str, Any], *, language: str = "en",
            task: str = "transcribe") -> Export:
    """A HF WhisperForConditionalGeneration's (state dict, config dict) -> an export (as ``from_openai``)."""
    dims = hf_dims(hf_config)
    d = dims["n_audio_state"]
    table = state_dict.get("model.decoder.embed_tokens.weight")
    if PROJ_OUT in state_dict and table is not None and not torch.equal(state_dict[PROJ_OUT], table):
        raise ConversionError("proj_out.weight differs from model.decoder.embed_tokens.weight: an untied LM head has "
                              "no counterpart in Whisper's layout")
    sd = {name: v for k, v in state_dict.items() if (name := hf_to_openai_name(k)) is not None}
    try:
        return from_openai(sd, dims, language=language, task=task,
                           encoder_mlp=int(hf_config.get("encoder_ffn_dim", 4 * d)),
                           decoder_mlp=int(hf_config.get("decoder_ffn_dim", 4 * d)),
                           source={"format": HF_FORMAT, "config": dict(hf_config)})
    except ConversionError as exc:  # name the HF tensors, not openai's names for them
        known = set(openai_shapes(dims, int(hf_config.get("encoder_ffn_dim", 4 * d)),
                                  int(hf_config.get("decoder_ffn_dim", 4 * d))))
        message = re.sub(r"[\w.]+", lambda m: openai_to_hf_name(m[0]) if m[0] in known else m[0], str(exc))
        raise ConversionError(message) from exc


def to_hf(config: Mapping[str, Any], state_dict: Mapping[str, Tensor],
          tokenizers: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """An export -> (HF config dict, HF state dict, proj_out.weight included as the token table) for
    ``WhisperForConditionalGeneration``. A model converted from HF keeps its source config's other settings."""
    encoder, decoder = _refuse_layout(config, tokenizers)
    dims, sd = to_openai(config, state_dict, tokenizers)
    hf_sd = {openai_to_hf_name(k): v for k, v in sd.items()}
    hf_sd[PROJ_OUT] = hf_sd["model.decoder.embed_tokens.weight"]
    text = tokenizers["text"]
    source = dict(config.get("source", {}).get("config", {}))
    d = dims["n_audio_state"]
    eot, sot = text.eos_id, text.bos_id
    hf_config = {"architectures": ["WhisperForConditionalGeneration"], "pad_token_id": eot, "bos_token_id": eot,
                 "eos_token_id": eot, "decoder_start_token_id": sot,
                 "begin_suppress_tokens": config.get("decoding", {}).get("suppress_at_start"),
                 **source, "model_type": MODEL_TYPE, "vocab_size": dims["n_vocab"], "num_mel_bins": dims["n_mels"],
                 "d_model": d, "encoder_layers": dims["n_audio_layer"], "decoder_layers": dims["n_text_layer"],
                 "encoder_attention_heads": dims["n_audio_head"], "decoder_attention_heads": dims["n_text_head"],
                 "encoder_ffn_dim": int(encoder.mlp_ratio * d), "decoder_ffn_dim": int(decoder.mlp_ratio * d),
                 "max_source_positions": dims["n_audio_ctx"], "max_target_positions": dims["n_text_ctx"],
                 "activation_function": "gelu", "scale_embedding": False, "tie_word_embeddings": True}
    return hf_config, hf_sd


# ----------------------------------------------------------------------------------------------------
# Files: `omni convert` (HF directories through the "hf" converter; openai-whisper .pt files)


def _options(options: Mapping[str, Any], what: str) -> dict[str, Any]:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConversionError(f"{', '.join(unknown)}: not an option of {what} (those are {', '.join(OPTIONS)})")
    return dict(options)


def read_hf(src: Path, **options: Any) -> Export:
    """A HF Whisper directory (config.json + model.safetensors or pytorch_model.bin) as an export; the alignment
    heads of its generation_config.json, where it has them, go into the config ("alignment_heads")."""
    state_dict, hf_config = read_directory(src)
    try:
        config, sd, tokenizers = from_hf(state_dict, hf_config, **_options(options, "Hugging Face Whisper checkpoints"))
    except ConversionError as exc:
        raise ConversionError(f"{src}: {exc}") from exc
    heads = hf_alignment_heads(Path(src), config["source"]["dims"])
    if heads is not None:
        config["alignment_heads"] = heads
    return config, sd, tokenizers


def write_hf(export: Path, out: Path, **options: Any) -> Path:
    """An omni Whisper export -> ``out``: config.json + model.safetensors (the tied proj_out left out, as HF's
    save_pretrained does); ``WhisperForConditionalGeneration.from_pretrained(out)`` loads it."""
    _options({k: v for k, v in options.items() if k not in OPTIONS}, "writing Hugging Face Whisper")
    try:
        config, state_dict, tokenizers = read_export(export)
        hf_config, sd = to_hf(config, state_dict, tokenizers)
    except ConversionError as exc:
        raise ConversionError(f"{export}: {exc}") from exc
    generation = hf_generation_config(config, hf_config)  # the alignment heads, where the export has them
    return write_hf_files(out, hf_config, {k: v for k, v in sd.items() if k != PROJ_OUT},
                          **({GENERATION_CONFIG: generation} if generation else {}))


def load_openai(src: Path) -> dict[str, Any]:
    """The checkpoint dict of an openai-whisper file, read with torch.load(weights_only=True) (memory-mapped)."""
    if not src.is_file():
        raise ConversionError(f"{src} does not exist" if not src.exists() else f"{src} is not a file")
    try:
        try:
            checkpoint = torch.load(src, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a legacy (non-zip) torch file cannot be memory-mapped
            checkpoint = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle and zip errors have no common base
        raise ConversionError(f"{src}: cannot read a torch checkpoint: {' '.join(str(exc).split())}") from exc
    if not isinstance(checkpoint, dict):
        raise ConversionError(f"{src} holds a {type(checkpoint).__name__}, not an openai-whisper checkpoint dict")
    return checkpoint


def recognises_openai(src: Path, options: Mapping[str, Any]) -> bool:
    """A .pt / .pth file whose dict has "dims" or "model_state_dict" (openai-whisper's checkpoint layout)."""
    if src.suffix not in (".pt", ".pth") or not src.is_file():
        return False
    try:
        checkpoint = load_openai(src)
    except ConversionError:
        return False
    return "dims" in checkpoint or "model_state_dict" in checkpoint


def read_openai(src: Path, **options: Any) -> Export:
    """An openai-whisper checkpoint file ({"dims": ..., "model_state_dict": ...}) as an export."""
    checkpoint = load_openai(src)
    for key in ("dims", "model_state_dict"):
        if key not in checkpoint:
            raise ConversionError(f"{src}: not an openai-whisper checkpoint: no {key!r} (keys: {names(checkpoint)})")
    sd = checkpoint["model_state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, Tensor) for v in sd.values()):
        raise ConversionError(f"{src}: 'model_state_dict' is not a mapping of names to tensors")
    try:
        config, state_dict, tokenizers = from_openai(sd, checkpoint["dims"],
                                                     **_options(options, "openai-whisper checkpoints"))
    except ConversionError as exc:
        raise ConversionError(f"{src}: {exc}") from exc
    # a released model's alignment heads, known by the file's sha256 (the .pt itself has no such field)
    heads = openai_alignment_heads(src, config["source"]["dims"])
    if heads is not None:
        config["alignment_heads"] = heads
    return config, state_dict, tokenizers


def write_openai(export: Path, out: Path, **options: Any) -> Path:
    """An omni Whisper export -> an openai-whisper checkpoint ``out`` (a .pt / .pth path; any other path is made a
    directory holding model.pt) that ``whisper.load_model(path)`` loads; -> the file's path. The export's
    alignment heads are not written: the .pt format has no field for them (whisper.load_model takes them from its
    own table by model name; ``model.set_alignment_heads`` sets them)."""
    _options({k: v for k, v in options.items() if k not in OPTIONS}, "writing openai-whisper")
    try:
        dims, sd = to_openai(*read_export(export))
    except ConversionError as exc:
        raise ConversionError(f"{export}: {exc}") from exc
    if out.suffix not in (".pt", ".pth"):
        out.mkdir(parents=True, exist_ok=True)
        out = out / "model.pt"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    torch.save({"dims": dims, "model_state_dict": sd}, tmp)
    tmp.replace(out)
    return out


register_hf_family(HFFamily(MODEL_TYPE, read_hf, write_hf, builders=(BUILDER,)))
register_converter(Converter(OPENAI_FORMAT, recognises_openai, read_openai, write_openai))

__all__ = ["decode_alignment_heads", "from_hf", "from_openai", "hf_alignment_heads", "hf_dims",
           "hf_generation_config", "hf_to_openai_name", "non_speech_tokens", "openai_alignment_heads", "openai_checkpoints",
           "openai_model_name", "openai_shapes", "openai_to_hf_name", "prompt_names", "read_hf", "read_openai",
           "suppress_tokens", "text_tokenizer", "to_hf", "to_openai", "write_hf", "write_openai"]
