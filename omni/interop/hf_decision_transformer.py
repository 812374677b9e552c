"""Hugging Face Decision Transformer checkpoints <-> omni's DecisionTransformer, exactly.

    config, state_dict, tokenizers = from_hf(hf_state_dict, hf_config)   # pure: tensors and dicts in and out
    convert_directory("hf/dt-hopper", "omni/dt-hopper")                  # -> an export load_pretrained loads
    write_hf_directory("omni/dt-hopper", "hf/dt-hopper-tuned")           # -> DecisionTransformerModel.from_pretrained
    hf_config, hf_state_dict = to_hf("omni/dt-hopper")                   # or to_hf(model, config, tokenizer)

``transformers.DecisionTransformerModel`` is omni's Decision Transformer (omni.rl) under other names, and
no transformers import is needed to convert it:

    embed_return / embed_state / embed_action   Linear(1 | S | A, d)    embed.embed_*   (TrajectoryEmbedder)
    embed_timestep, embed_ln                    + time, LayerNorm       embed.embed_timestep, embed.embed_ln
    encoder.wpe.weight[0]                       added after embed_ln    embed.type_embedding: HF passes
                                                                        position_ids = 0 for every token
    encoder.h.i.ln_1, attn.c_attn, attn.c_proj  pre-norm GPT-2 block    trunk.blocks.i.attn_norm, attn.qkv,
    encoder.h.i.ln_2, mlp.c_fc, mlp.c_proj                              attn.out, mlp_norm, mlp.up, mlp.down
                                                (Conv1D weights are (in, out): transposed)
    encoder.ln_f                                final LayerNorm         trunk.norm
    predict_action (Linear + Tanh; Linear       read at state tokens    head.proj; action_tanh=False is head
    alone with action_tanh=False)                                       squash=None (config "action_squash": None).
                                                                        HF never rescales: the tokenizer's bounds
                                                                        are [-1, 1], so omni's rescaling is the
                                                                        identity (to_hf refuses other bounds);
                                                                        decode clips env actions to them
    encoder.wte, encoder.wpe, predict_state, predict_return             carried (CarriedTensors): never read on
                                                                        the action path, handed back as they are
                                                                        (wpe row 0 from the type embedding)

The trunk (the GPT-2 body omni.interop.gpt2 maps, shared): positions "none", activation relu / gelu_new
(= "gelu_tanh", and its other spellings) / gelu, norm_eps =
layer_norm_epsilon, mlp_ratio = n_inner / hidden_size, dropout = resid_pdrop (GPT-2's residual dropout, the
same place). HF's embedding (embd_pdrop) and attention-probability (attn_pdrop) dropout have no omni
counterpart: training differs by those, inference is the same. Not expressible, so refused:
scale_attn_by_inverse_layer_idx, scale_attn_weights=False, add_cross_attention.

What the HF model leaves to its caller goes into the tokenizer: states are normalised by the caller (HF's
get_action example: (s - state_mean) / state_std) and returns-to-go divided by a scale (1000 for the MuJoCo
checkpoints), over a window of ``context`` steps (20). ``from_hf`` reads "state_mean", "state_std",
"rtg_scale" and "context" from the HF config when present (``to_hf`` writes them there: HF's model ignores
them), else takes them as arguments; without statistics the tokenizer's normalisation is the identity, so
the caller must pass states as the checkpoint was trained on. A left-padded HF window (get_action's
attention_mask) computes what omni computes on the unpadded window: no position depends on the padding.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from omni.export import load_config, load_pretrained, load_tokenizers, save_pretrained
from omni.export_kinds import DECISION_TRANSFORMER
from omni.interop.gpt2 import (IGNORED_SUFFIXES, body_hf_config, body_tensor_names, body_trunk_options, check_body,
                               named_pairs)
from omni.interop.hf import HFFamily, register_hf_family, write_hf_files
from omni.interop.registry import ConversionError, read_directory
from omni.rl import DecisionTransformer, action_bounds, build_decision_transformer
from omni.tokenizers.trajectory import TrajectoryTokenizer
from omni.trunk import TrunkConfig

MODEL_TYPE = "decision_transformer"
SOURCE_FORMAT = "transformers:" + MODEL_TYPE
CARRIED = ("encoder.wte.weight", "encoder.wpe.weight", "predict_state.weight", "predict_state.bias",
           "predict_return.weight", "predict_return.bias")
TYPE_EMBEDDING = "embed.type_embedding.weight"  # = encoder.wpe.weight[0]
# omni's additions to the HF config (ignored by transformers): the tokenizer's part of the policy
TOKENIZER_KEYS = ("state_mean", "state_std", "rtg_scale", "context")


def tensor_names(n_layers: int) -> list[tuple[str, str, bool]]:
    """(omni name, HF name, transposed: a GPT-2 Conv1D weight) for every tensor mapped one to one."""
    pairs = [("embed.embed_timestep.weight", "embed_timestep.weight", False)]
    modules = [(f"embed.{m}", m, False) for m in ("embed_return", "embed_state", "embed_action", "embed_ln")]
    modules += [("head.proj", "predict_action.0", False)]
    return pairs + named_pairs(modules) + body_tensor_names(n_layers, "encoder")


def trunk_config(hf: Mapping[str, Any]) -> TrunkConfig:
    """The TrunkConfig of a HF DecisionTransformerConfig (dict); ValueError for what omni cannot express."""
    options = body_trunk_options(hf, int(hf.get("hidden_size", 128)), what="HF Decision Transformer", n_layer=3,
                                 n_head=1, activation="relu")
    return TrunkConfig(**options, positions="none")


def trajectory_tokenizer(hf: Mapping[str, Any], **overrides: Any) -> TrajectoryTokenizer:
    """The TrajectoryTokenizer of a HF config: continuous actions in [-1, 1] (no rescaling), timesteps below
    max_ep_len; state_mean / state_std / rtg_scale / context from ``overrides``, else the config, else
    identity normalisation, 1000 and 20."""
    given = {k: overrides[k] if overrides.get(k) is not None else hf.get(k) for k in TOKENIZER_KEYS}
    act_dim = int(hf.get("act_dim", 4))
    return TrajectoryTokenizer(int(hf.get("state_dim", 17)), action_dim=act_dim,
                               max_timestep=int(hf.get("max_ep_len", 4096)),
                               rtg_scale=float(given["rtg_scale"] or 1000.0), context=int(given["context"] or 20),
                               state_mean=given["state_mean"], state_std=given["state_std"],
                               action_low=[-1.0] * act_dim, action_high=[1.0] * act_dim)


def from_hf(state_dict: Mapping[str, Tensor], hf_config: Mapping[str, Any], *, context: int | None = None,
            rtg_scale: float | None = None, state_mean: Sequence[float] | None = None,
            state_std: Sequence[float] | None = None) -> tuple[dict[str, Any], dict[str, Tensor], dict[str, Any]]:
    """A HF DecisionTransformerModel's (state dict, config dict) -> (omni export config, omni state dict,
    {"trajectory": tokenizer}); ``build_decision_transformer(config, tokenizers)`` builds the model that loads
    the state dict (strict). The tokenizer arguments override the config's (module docstring)."""
    if hf_config.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise ValueError(f"model_type is {hf_config.get('model_type')!r}, not {MODEL_TYPE!r}")
    trunk = trunk_config(hf_config)
    tok = trajectory_tokenizer(hf_config, context=context, rtg_scale=rtg_scale, state_mean=state_mean,
                               state_std=state_std)
    sd = {k: v for k, v in state_dict.items() if not k.endswith(IGNORED_SUFFIXES)}
    pairs = tensor_names(trunk.n_layers)
    expected = {hf for _, hf, _ in pairs} | set(CARRIED)
    if set(sd) != expected:
        raise ValueError(f"not a DecisionTransformerModel state dict: missing {sorted(expected - set(sd))}, "
                         f"unexpected {sorted(set(sd) - expected)}")
    out = {omni: sd[hf].t() if conv else sd[hf] for omni, hf, conv in pairs}
    out = {k: v.detach().clone().contiguous() for k, v in out.items()}
    out[TYPE_EMBEDDING] = sd["encoder.wpe.weight"][0].clone()
    out["action_center"], out["action_scale"] = action_bounds(tok)
    out.update({f"carried.{name.replace('.', '/')}": sd[name].detach().clone() for name in CARRIED})
    config = {"builder": DECISION_TRANSFORMER, "trunk": trunk.to_dict(), "use_returns": True,
              "carried": {name: list(sd[name].shape) for name in CARRIED},
              **({} if hf_config.get("action_tanh", True) else {"action_squash": None}),
              "source": {"format": SOURCE_FORMAT, "config": dict(hf_config)}}
    return config, out, {"trajectory": tok}


def to_hf(source: str | os.PathLike | DecisionTransformer, config: Mapping[str, Any] | None = None,
          tokenizer: TrajectoryTokenizer | None = None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """An omni export directory (or a DecisionTransformer with its export config and tokenizer, both optional)
    -> (HF config dict, HF state dict) for ``DecisionTransformerModel``. A model converted from HF gives back
    its source config (with what omni changed) and every tensor; ValueError for what HF cannot express."""
    if not isinstance(source, DecisionTransformer):
        config, tokenizer = load_config(source), load_tokenizers(source).get("trajectory")
        source = load_pretrained(source)
        if not isinstance(source, DecisionTransformer):
            raise ValueError(f"the export builds a {type(source).__name__}, not a DecisionTransformer")
    model, cfg = source, source.trunk_config
    if not model.use_returns or model.discrete:
        raise ValueError("HF's Decision Transformer has return-to-go tokens and continuous actions: "
                         "a behaviour-cloning or discrete-action model has no HF counterpart")
    check_body(cfg, "none")
    if not (torch.equal(model.action_center, torch.zeros_like(model.action_center))
            and torch.equal(model.action_scale, torch.ones_like(model.action_scale))):
        raise ValueError("HF's action head has no rescaling: the tokenizer's action bounds must be [-1, 1]")
    own = model.state_dict()
    d = cfg.d_model
    sd = {hf: own[omni].t() if conv else own[omni] for omni, hf, conv in tensor_names(cfg.n_layers)}
    source_cfg = dict((config or {}).get("source", {}).get("config", {}))
    carried = model.carried.tensors() if model.carried is not None else {}
    n_pos = int(source_cfg.get("n_positions", 1024))
    blank = {"encoder.wte.weight": (1, d), "encoder.wpe.weight": (n_pos, d), "predict_state.weight":
             (model.embed.state_dim, d), "predict_state.bias": (model.embed.state_dim,),
             "predict_return.weight": (1, d), "predict_return.bias": (1,)}
    sd.update({name: carried[name] if name in carried else torch.zeros(blank[name]) for name in CARRIED})
    sd["encoder.wpe.weight"] = torch.cat([own[TYPE_EMBEDDING][None], sd["encoder.wpe.weight"][1:]])
    sd = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}
    inner = model.trunk.blocks[0].mlp.up.out_features
    hf_config = {**source_cfg, "model_type": MODEL_TYPE, "architectures": ["DecisionTransformerModel"],
                 "state_dim": model.embed.state_dim, "act_dim": model.embed.action_cols, "hidden_size": d,
                 "max_ep_len": model.embed.max_timestep, "action_tanh": model.head.squash == "tanh",
                 "n_positions": sd["encoder.wpe.weight"].shape[0],
                 **body_hf_config(cfg, inner, source_cfg.get("activation_function"))}
    for key in ("embd_pdrop", "attn_pdrop"):
        hf_config.setdefault(key, cfg.dropout)
    if tokenizer is not None:
        hf_config.update({k: v for k, v in tokenizer.config().items() if k in TOKENIZER_KEYS and v is not None})
    return hf_config, sd


def convert_directory(src_dir: str | os.PathLike, out_dir: str | os.PathLike, **tokenizer_args: Any) -> Path:
    """A HF DecisionTransformerModel directory -> an omni export at ``out_dir`` (``omni.export.load_pretrained``
    loads it; ``omni.rl.rollout`` / ``evaluate`` run it with its tokenizer). ``tokenizer_args``: context,
    rtg_scale, state_mean, state_std (``from_hf``)."""
    state_dict, hf_config = read_directory(src_dir)
    config, sd, tokenizers = from_hf(state_dict, hf_config, **tokenizer_args)
    model = build_decision_transformer(config, tokenizers)
    model.load_state_dict(sd, strict=True)
    return save_pretrained(model, out_dir, config, tokenizers=tokenizers)


def write_hf_directory(export_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """An omni Decision Transformer export -> a HF directory (config.json + model.safetensors) that
    ``DecisionTransformerModel.from_pretrained(out_dir)`` loads."""
    return write_hf_files(out_dir, *to_hf(export_dir))


# ----------------------------------------------------------------------------------------------------
# `omni convert --from hf`: a HF directory whose config.json says model_type "decision_transformer" (omni.interop.hf)

TOKENIZER_OPTIONS = ("context", "rtg_scale", "state_mean", "state_std")


def _hf_options(options: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - set(TOKENIZER_OPTIONS))
    if unknown:
        raise ConversionError(f"{', '.join(unknown)}: not an option of Hugging Face Decision Transformer checkpoints "
                              f"(those are {', '.join(TOKENIZER_OPTIONS)})")
    return dict(options)


def read_hf(src: Path, **options: Any) -> tuple[dict[str, Any], dict[str, Tensor], dict[str, Any]]:
    try:
        return from_hf(*read_directory(src), **_hf_options(options))
    except ValueError as exc:  # from_hf's refusals (scale_attn_weights=False, ...) as the one conversion error
        raise ConversionError(f"{src}: {exc}") from exc


def write_hf(export: Path, out: Path, **options: Any) -> Path:
    _hf_options(options)
    try:
        return write_hf_directory(export, out)
    except ValueError as exc:  # to_hf's refusals (not a DT, RoPE, other action bounds ...)
        raise ConversionError(f"{export}: {exc}") from exc


register_hf_family(HFFamily(MODEL_TYPE, read_hf, write_hf, builders=(DECISION_TRANSFORMER,)))

__all__ = ["convert_directory", "from_hf", "read_hf", "to_hf", "trajectory_tokenizer", "trunk_config",
           "write_hf", "write_hf_directory"]
