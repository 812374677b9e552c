"""Hugging Face GPT-2 (``GPT2LMHeadModel``) checkpoints <-> omni text LM exports, exactly.

    config, state_dict, tokenizers = from_hf(hf_state_dict, hf_config)   # pure: tensors and dicts in and out
    convert_directory("hf/gpt2", "omni/gpt2")                             # -> an export load_pretrained loads
    write_hf_directory("omni/gpt2", "hf/gpt2-tuned")                      # -> GPT2LMHeadModel.from_pretrained
    hf_config, hf_state_dict = to_hf("omni/gpt2")

A GPT-2 is omni's ``OmniModel`` with one text tokenizer (GPT-2's BPE, ``omni.tokenizers.ranks.gpt2_tokenizer``)
and one LM head tied to the text embedding: the model ``omni.tasks.LMTask`` trains, so a converted GPT-2 is
fine-tuned by omni's own training code and generated from by ``omni.generate`` / ``omni generate``.

    wte                                         token table                 embedders.text.token (+ the text
                                                                            type embedding, zero: adds nothing)
    wpe (n_positions, d)                        learned absolute positions  trunk.absolute.table ("learned_1d":
                                                                            one table indexed by token order)
    h.i.ln_1, attn.c_attn, attn.c_proj          pre-norm GPT-2 block        trunk.blocks.i.attn_norm, attn.qkv,
    h.i.ln_2, mlp.c_fc, mlp.c_proj                                          attn.out, mlp_norm, mlp.up, mlp.down
                                                (Conv1D weights are (in, out): transposed)
    ln_f                                        final LayerNorm             trunk.norm
    lm_head (tied to wte)                       logits                      heads.lm (tie_to "text"); an untied
                                                                            lm_head (tie_word_embeddings=False)
                                                                            is an untied head

Keys are read with or without the ``transformer.`` prefix (GPT2LMHeadModel / GPT2Model checkpoints, the hub's
gpt2 files have none); the causal-mask buffers of old checkpoints (attn.bias, attn.masked_bias) are dropped.

The trunk (shared with the Decision Transformer, a GPT-2 body: ``body_tensor_names``, ``body_trunk_options``):
activation gelu_new and its other spellings (gelu_pytorch_tanh, gelu_fast, gelu_accurate, gelu_python_tanh: one
function, the tanh approximation) -> "gelu_tanh", gelu / gelu_python -> "gelu", relu -> "relu"; norm_eps =
layer_norm_epsilon; mlp_ratio = n_inner / n_embd; dropout = resid_pdrop (GPT-2's residual dropout, the same
place). HF's embedding (embd_pdrop) and attention-probability (attn_pdrop) dropout have no omni counterpart:
training differs by those, inference is the same; they are kept in the source config for the way back.
reorder_and_upcast_attn only changes where HF's eager attention scales and casts (fp32 scores under mixed
precision): the same function, accepted. Not expressible, so refused in one line: other activations,
scale_attn_by_inverse_layer_idx, scale_attn_weights=False, add_cross_attention, a vocabulary other than
GPT-2's 50,257 ids (the text tokenizer sizes the embedding).

Back to HF, a type embedding that fine-tuning moved away from zero is added to every wpe row (HF has no such
vector; the sum differs by one rounding), so every other tensor goes back bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from omni.export import load_config, load_pretrained, save_pretrained
from omni.export_kinds import MULTITASK
from omni.interop.hf import HFFamily, register_hf_family, write_hf_files
from omni.interop.registry import ConversionError, cast_tensors, check_tensors, read_directory, source_dtype
from omni.trunk import TrunkConfig

MODEL_TYPE = "gpt2"
SOURCE_FORMAT = "transformers:" + MODEL_TYPE
BUILDER = MULTITASK  # the generic OmniModel builder: ``accepts`` tells a text LM export from the others
HEAD = "lm"  # the LM head's (and the LMTask's) name in a converted export
GPT2_VOCAB = 50257

# -- the GPT-2 body, shared with the Decision Transformer (omni.interop.hf_decision_transformer) ----------------

# HF activation_function -> TrunkConfig.activation (the same function), and back
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh",
               "gelu_fast": "gelu_tanh", "gelu_accurate": "gelu_tanh", "gelu": "gelu", "gelu_python": "gelu",
               "relu": "relu"}
HF_ACTIVATIONS = {"relu": "relu", "gelu_tanh": "gelu_new", "gelu": "gelu"}
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # GPT-2's causal-mask buffers in older checkpoints
# (omni module in a trunk block, HF module in a GPT-2 block h.i, transposed: a Conv1D weight)
BLOCK = (("attn_norm", "ln_1", False), ("attn.qkv", "attn.c_attn", True), ("attn.out", "attn.c_proj", True),
         ("mlp_norm", "ln_2", False), ("mlp.up", "mlp.c_fc", True), ("mlp.down", "mlp.c_proj", True))
# GPT2Config options omni cannot express: the value that is refused
REFUSED = {"scale_attn_by_inverse_layer_idx": True, "scale_attn_weights": False, "add_cross_attention": True}


def named_pairs(modules: list[tuple[str, str, bool]]) -> list[tuple[str, str, bool]]:
    """(omni, HF, transposed) modules -> the same for their .weight and .bias tensors (a bias never transposes)."""
    out = []
    for omni, hf, conv in modules:
        out += [(f"{omni}.weight", f"{hf}.weight", conv), (f"{omni}.bias", f"{hf}.bias", False)]
    return out


def body_tensor_names(n_layers: int, hf_prefix: str) -> list[tuple[str, str, bool]]:
    """(omni name, HF name, transposed) of every tensor of a GPT-2 body (blocks and ln_f) under ``hf_prefix``
    ("encoder" for the Decision Transformer, "transformer" for GPT2LMHeadModel) and omni's ``trunk``."""
    modules = [(f"trunk.blocks.{i}.{omni}", f"{hf_prefix}.h.{i}.{hf}", conv)
               for i in range(n_layers) for omni, hf, conv in BLOCK]
    return named_pairs(modules + [("trunk.norm", f"{hf_prefix}.ln_f", False)])


def body_trunk_options(hf: Mapping[str, Any], d_model: int, *, what: str, n_layer: int, n_head: int,
                       activation: str) -> dict[str, Any]:
    """TrunkConfig fields of a GPT-2 body's config (dict; ``n_layer`` / ``n_head`` / ``activation``: the family's
    defaults for keys the config leaves out); ValueError naming what omni cannot express (``what``: the family)."""
    for key, bad in REFUSED.items():
        if hf.get(key, not bad) == bad:
            raise ValueError(f"{what} with {key}={bad} has no omni counterpart")
    act = hf.get("activation_function", activation)
    if act not in ACTIVATIONS:
        raise ValueError(f"activation_function {act!r} has no omni counterpart; supported: {', '.join(ACTIVATIONS)}")
    inner = hf.get("n_inner") or 4 * d_model
    if int(inner / d_model * d_model) != inner:
        raise ValueError(f"n_inner={inner} is not representable as mlp_ratio * hidden size {d_model}")
    return dict(d_model=d_model, n_layers=int(hf.get("n_layer", n_layer)), n_heads=int(hf.get("n_head", n_head)),
                activation=ACTIVATIONS[act], mlp_ratio=inner / d_model,
                norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), dropout=float(hf.get("resid_pdrop", 0.1)))


def check_body(cfg: TrunkConfig, positions: str) -> None:
    """ValueError unless ``cfg`` is a trunk HF's GPT-2 blocks express, with these ``positions``."""
    layout = (cfg.positions, cfg.norm, cfg.final_norm, cfg.bias, cfg.kv_heads == cfg.n_heads, cfg.cross_attention)
    if layout != (positions, "layernorm", True, True, True, False) or cfg.activation not in HF_ACTIVATIONS:
        raise ValueError(f"HF's GPT-2 trunk needs positions={positions!r}, layernorm with a final norm, bias, "
                         f"n_kv_heads=n_heads, no cross attention and activation in {sorted(HF_ACTIVATIONS)}; "
                         f"got {cfg}")


def body_hf_config(cfg: TrunkConfig, inner: int, source_activation: str | None) -> dict[str, Any]:
    """The GPT2Config keys of a trunk (``inner``: its MLP width); the source's activation name is kept where it
    names the same function (gelu_pytorch_tanh stays gelu_pytorch_tanh)."""
    same = ACTIVATIONS.get(source_activation or "") == cfg.activation
    return {"n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": None if inner == 4 * cfg.d_model else inner,
            "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": cfg.dropout,
            "activation_function": source_activation if same else HF_ACTIVATIONS[cfg.activation]}


# -- GPT2LMHeadModel ---------------------------------------------------------------------------------------

TOKEN = "embedders.text.token.weight"
TYPE_EMBEDDING = "embedders.text.type_embedding.weight"
POSITIONS = "trunk.absolute.table.weight"
HEAD_WEIGHT = f"heads.{HEAD}.proj.weight"


def tensor_names(n_layers: int, tied: bool = True) -> list[tuple[str, str, bool]]:
    """(omni name, HF GPT2LMHeadModel name, transposed) of every tensor mapped one to one."""
    pairs = [(TOKEN, "transformer.wte.weight", False), (POSITIONS, "transformer.wpe.weight", False)]
    pairs += body_tensor_names(n_layers, "transformer")
    return pairs if tied else pairs + [(HEAD_WEIGHT, "lm_head.weight", False)]


def trunk_config(hf: Mapping[str, Any]) -> TrunkConfig:
    """The TrunkConfig of a HF GPT2Config (dict); ValueError for what omni cannot express."""
    d = int(hf.get("n_embd", 768))
    options = body_trunk_options(hf, d, what="HF GPT-2", n_layer=12, n_head=12, activation="gelu_new")
    return TrunkConfig(**options, positions="learned_1d", max_positions=int(hf.get("n_positions", 1024)))


def _hf_tensors(state_dict: Mapping[str, Tensor], tied: bool) -> dict[str, Tensor]:
    """The state dict with every key under ``transformer.`` (GPT2Model checkpoints have no prefix), the mask
    buffers dropped, and a tied lm_head dropped (it is wte)."""
    out = {}
    for key, value in state_dict.items():
        if key.endswith(IGNORED_SUFFIXES) or (tied and key == "lm_head.weight"):
            continue
        out[key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"] = value
    return out


def export_config(trunk: TrunkConfig, tied: bool, source: Mapping[str, Any] | None = None,
                  dtype: str | None = None) -> dict[str, Any]:
    """The export config of a GPT-2 text LM: the "omni" builder with one LM head, recorded as an LM task (the
    multitask recipe's layout, so omni's LM training and tooling read it); ``source``: the HF config, ``dtype``:
    its tensors' dtype when not float32 (``omni.interop.source_dtype``: written back in it)."""
    head = {"type": "lm", "vocab_size": GPT2_VOCAB, **({"tie_to": "text"} if tied else {})}
    config = {"builder": BUILDER, "trunk": trunk.to_dict(), "heads": {HEAD: head},
              "tasks": {HEAD: {"kind": "lm", "weight": 1.0}}}
    if source is not None:
        config["source"] = {"format": SOURCE_FORMAT, "config": dict(source), **({"dtype": dtype} if dtype else {})}
    return config


def from_hf(state_dict: Mapping[str, Tensor], hf_config: Mapping[str, Any]
            ) -> tuple[dict[str, Any], dict[str, Tensor], dict[str, Any]]:
    """A HF GPT2LMHeadModel's (state dict, config dict) -> (omni export config, omni state dict, {"text": GPT-2's
    tokenizer}); the "omni" builder builds the model that loads the state dict (strict). ValueError (one line)
    for what omni cannot express or a state dict that is not this config's (a wrong shape names its key)."""
    from omni.tokenizers.ranks import gpt2_tokenizer

    if hf_config.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise ValueError(f"model_type is {hf_config.get('model_type')!r}, not {MODEL_TYPE!r}")
    vocab = int(hf_config.get("vocab_size", GPT2_VOCAB))
    if vocab != GPT2_VOCAB:
        raise ValueError(f"vocab_size {vocab}: only GPT-2's own {GPT2_VOCAB}-token BPE is supported (the text "
                         "tokenizer gives the embedding its size)")
    trunk = trunk_config(hf_config)
    tied = bool(hf_config.get("tie_word_embeddings", True))
    d = trunk.d_model
    inner = int(trunk.mlp_ratio * d)
    # HF's weight shape by module (Conv1D: (in, out)); a bias is the weight's last dimension
    shapes = {"wte": (vocab, d), "wpe": (trunk.max_positions, d), "ln_1": (d,), "ln_2": (d,), "ln_f": (d,),
              "attn.c_attn": (d, 3 * d), "attn.c_proj": (d, d), "mlp.c_fc": (d, inner), "mlp.c_proj": (inner, d),
              "lm_head": (vocab, d)}
    pairs = tensor_names(trunk.n_layers, tied)
    expected = {}
    for _, hf, _ in pairs:
        module, _, kind = hf.rpartition(".")
        shape = next(v for k, v in shapes.items() if module == k or module.endswith(f".{k}"))
        expected[hf] = torch.Size(shape if kind == "weight" else shape[-1:])
    sd = _hf_tensors(state_dict, tied)  # (check_tensors' ConversionError is a ValueError)
    check_tensors(sd, expected, f"a GPT2LMHeadModel of this config ({trunk.n_layers} layers, width {d})")
    out = {omni: (sd[hf].t() if conv else sd[hf]).detach().clone().contiguous() for omni, hf, conv in pairs}
    if tied:
        out[HEAD_WEIGHT] = out[TOKEN]  # one tensor: the head is the table
    out[TYPE_EMBEDDING] = torch.zeros(d, dtype=out[TOKEN].dtype)  # HF has no modality vector: zero adds nothing
    tokenizer = gpt2_tokenizer(max_length=trunk.max_positions)
    return export_config(trunk, tied, hf_config, source_dtype(sd)), out, {"text": tokenizer}


def text_lm_head(config: Mapping[str, Any]) -> str | None:
    """The name of the LM head of a text-LM export config (one text tokenizer, one "lm" head on the "omni"
    builder), else None."""
    heads = config.get("heads", {})
    lm = [name for name, spec in heads.items() if isinstance(spec, Mapping) and spec.get("type") == "lm"]
    if config.get("builder") != BUILDER or config.get("tokenizers") != ["text"] or len(heads) != 1 or len(lm) != 1:
        return None
    return lm[0]


def to_hf(export: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """An omni text-LM export -> (HF config dict, HF state dict) for ``GPT2LMHeadModel``. A model converted from
    HF gives back its source config (with what omni changed) and every tensor; ValueError for what HF cannot
    express."""
    config = load_config(export)
    head = text_lm_head(config)
    if head is None:
        raise ValueError("not a text language model export (one text tokenizer and one LM head)")
    model = load_pretrained(export)
    cfg: TrunkConfig = model.trunk_config
    check_body(cfg, "learned_1d")
    own = model.state_dict()
    vocab, d = own[TOKEN].shape
    if vocab != GPT2_VOCAB:
        raise ValueError(f"the text vocabulary has {vocab} ids; HF GPT-2 checkpoints here use GPT-2's {GPT2_VOCAB}")
    tied = model.heads[head].tied
    own = {**own, HEAD_WEIGHT: own[f"heads.{head}.proj.weight"]}
    sd = {hf: own[omni].t() if conv else own[omni] for omni, hf, conv in tensor_names(cfg.n_layers, tied)}
    shift = own[TYPE_EMBEDDING]
    if bool(shift.any()):  # HF adds wte + wpe only: fold the modality vector into every position row
        sd["transformer.wpe.weight"] = sd["transformer.wpe.weight"] + shift
    recorded = config.get("source", {})
    # in the checkpoint's own dtype (a bf16 GPT-2 goes back in bf16); the export holds float32
    dtype = recorded.get("dtype") if recorded.get("format") == SOURCE_FORMAT else None
    sd = cast_tensors({k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}, dtype)
    source = dict(recorded.get("config", {})) if recorded.get("format") == SOURCE_FORMAT else {}
    inner = model.trunk.blocks[0].mlp.up.out_features
    hf_config = {**source, "model_type": MODEL_TYPE, "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab,
                 "n_embd": d, "n_positions": cfg.max_positions, "tie_word_embeddings": tied,
                 **body_hf_config(cfg, inner, source.get("activation_function")),
                 "bos_token_id": source.get("bos_token_id", GPT2_VOCAB - 1),
                 "eos_token_id": source.get("eos_token_id", GPT2_VOCAB - 1)}
    for key in ("embd_pdrop", "attn_pdrop"):
        hf_config.setdefault(key, cfg.dropout)
    return hf_config, sd


def convert_directory(src_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """A HF GPT2LMHeadModel directory -> an omni export at ``out_dir``."""
    from omni.export import get_builder

    state_dict, hf_config = read_directory(src_dir)
    config, sd, tokenizers = from_hf(state_dict, hf_config)
    model = get_builder(BUILDER)(config, tokenizers)
    model.load_state_dict(sd, strict=True)
    return save_pretrained(model, out_dir, config, tokenizers=tokenizers)


def write_hf_directory(export_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """An omni text-LM export -> a HF directory (config.json + model.safetensors) that
    ``GPT2LMHeadModel.from_pretrained(out_dir)`` loads."""
    return write_hf_files(out_dir, *to_hf(export_dir))


# ----------------------------------------------------------------------------------------------------
# `omni convert --from hf` / `--to hf` (omni.interop.hf): model_type "gpt2"


def _no_options(options: Mapping[str, Any]) -> None:
    if options:
        raise ConversionError(f"{', '.join(sorted(options))}: not an option of Hugging Face GPT-2 checkpoints "
                              "(they take none)")


def read_hf(src: Path, **options: Any) -> tuple[dict[str, Any], dict[str, Tensor], dict[str, Any]]:
    _no_options(options)
    try:
        return from_hf(*read_directory(src))
    except ValueError as exc:  # from_hf's refusals and shape errors as the one conversion error
        raise ConversionError(f"{src}: {exc}") from exc


def write_hf(export: Path, out: Path, **options: Any) -> Path:
    _no_options(options)
    try:
        return write_hf_directory(export, out)
    except ValueError as exc:  # to_hf's refusals (RoPE, another vocabulary, ...)
        raise ConversionError(f"{export}: {exc}") from exc


def accepts(config: Mapping[str, Any]) -> bool:
    """Whether an export config (builder "omni") is a text LM, the one kind of "omni" export GPT-2 writes back."""
    return text_lm_head(config) is not None


register_hf_family(HFFamily(MODEL_TYPE, read_hf, write_hf, builders=(BUILDER,), accepts=accepts))

__all__ = ["ACTIVATIONS", "BLOCK", "HF_ACTIVATIONS", "accepts", "body_hf_config", "body_tensor_names",
           "body_trunk_options", "check_body", "convert_directory", "export_config", "from_hf", "named_pairs",
           "read_hf", "tensor_names", "text_lm_head", "to_hf", "trunk_config", "write_hf", "write_hf_directory"]
