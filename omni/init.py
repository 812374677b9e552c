"""``--set init=PATH``: every recipe starts from a model, an omni export or any checkpoint omni.interop converts.

    source = read_init(path, DT_BUILDER, "recipes/decision_transformer.py", "an omni Decision Transformer export or "
                       "a Hugging Face DecisionTransformerModel directory")       # (config, state dict, tokenizers)
    fresh = load_init(model, source[1], path, new=lambda key: key.startswith("heads."))

``read_init`` reads PATH (``omni.interop.read_model``: an export as it is, a peer checkpoint converted; a training run's
directory is its export ``final/``, resolved as ``omni predict`` resolves it, by ``omni.export.resolve_export_dir``)
and refuses, in one line naming PATH, a model of another kind than the recipe trains (or a run's checkpoint, naming
the run's export). ``load_init`` puts its tensors into the
model the recipe built from it: every tensor must be there with its shape, except those ``new`` allows (a head
for another class count, a head the source has not), which keep their fresh initialisation and are returned.
The recipes' own fitting (omni.vision.adapt_classifier for recipes/vit.py; ``init_decision_transformer``,
``init_trajectory_tokenizer`` and ``init_multitask`` below; recipes/whisper.py's for speech exports and
Whisper checkpoints) decides what the source fixes: its architecture always (the trunk
config replaces the recipe's), its tokenizers where they carry what the weights were trained on (normalisation
statistics, vocabularies), and what the run's data must agree with (one line when it does not).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

from torch import Tensor, nn

from omni.export_kinds import DECISION_TRANSFORMER, MULTITASK, SPEECH_RECOGNIZER
from omni.interop import Export
from omni.trunk import TrunkConfig

# the export kinds (omni.export_kinds) the recipes start from, under the names the recipes import
DT_BUILDER = DECISION_TRANSFORMER
OMNI_BUILDER = MULTITASK
SPEECH_BUILDER = SPEECH_RECOGNIZER


def read_init(path: str | os.PathLike, builders: str | tuple[str, ...], recipe: str, takes: str,
              **options: Any) -> Export:
    """(config, state dict, tokenizers) of ``path``; ValueError (one line) when it is not a model of one of
    ``builders`` (``takes`` says what ``recipe`` starts from) or cannot be read. A run directory is read as its
    export (printed); a run's checkpoint is refused naming the run's export (as ``omni predict`` does)."""
    from omni.export import (CHECKPOINT_MARKER, CONFIG_NAME, RUN_CHECKPOINT_DIR, RUN_EXPORT_DIR,
                             resolve_export_dir)
    from omni.interop import ConversionError, read_model

    builders = (builders,) if isinstance(builders, str) else builders
    given, folder = path, Path(path)
    run = folder.is_dir() and not (folder / CONFIG_NAME).is_file() and (
        (folder / RUN_EXPORT_DIR).exists() or (folder / RUN_CHECKPOINT_DIR).is_dir()
        or (folder / CHECKPOINT_MARKER).is_file() or folder.parent.name == RUN_CHECKPOINT_DIR)
    if run:  # a training run or one of its checkpoints, not a model: predict's resolver says which export
        try:
            path = resolve_export_dir(path)
        except FileNotFoundError as exc:  # a checkpoint, an unfinished run: where its export is, or why none
            raise ValueError(f"init: {exc}") from exc
        print(f"init {given}: using the export {path} of the run directory", flush=True)
    try:
        source = read_model(path, **options)
    except ConversionError as exc:  # its message names the file already, or says which
        raise ValueError(f"init: {exc}" if str(exc).startswith(str(path)) else f"init {path}: {exc}") from exc
    builder = source[0].get("builder")
    if builder not in builders:
        raise ValueError(f"init {path}: a {builder!r} model; {recipe} starts from {takes}")
    return source


def load_init(model: nn.Module, state: Mapping[str, Tensor], path: str | os.PathLike,
              new: Callable[[str], bool] = lambda key: False) -> list[str]:
    """Copy ``state`` into ``model`` (strict but for ``new``: tensors the source lacks, or has with another shape,
    that the recipe may start fresh); -> the names left fresh. ValueError naming the first tensor that does not
    fit; tensors of the source the model has no place for are refused unless ``new`` allows them too (a head of
    a task this run leaves out). A tensor tied in the model (an LM head sharing the text embedding) counts as
    present when the source has it under any of its names, as exports store it under one."""
    from omni.export import tied_names

    state = dict(state)
    for group in tied_names(model):
        have = next((state[name] for name in group if name in state), None)
        if have is not None:
            state.update({name: have for name in group if name not in state})
    own = model.state_dict()
    fresh = sorted(k for k in own if k not in state or state[k].shape != own[k].shape)
    unused = sorted(k for k in state if k not in own)
    for key in fresh:
        if not new(key):
            what = f"shape {tuple(state[key].shape)}, this run's model {tuple(own[key].shape)}" if key in state \
                else "missing from it"
            raise ValueError(f"init {path}: {key}: {what} (the run's data or settings do not fit the model)")
    for key in unused:
        if not new(key):
            raise ValueError(f"init {path}: {key} has no place in this run's model")
    missing, _ = model.load_state_dict({k: v for k, v in state.items() if k in own and k not in fresh}, strict=False)
    assert sorted(missing) == fresh, (missing, fresh)  # exactly the fresh ones are left as they were
    return fresh


# ----------------------------------------------------------------------------------------------------
# recipes/decision_transformer.py


def init_trajectory_tokenizer(source: Export, path: str | os.PathLike, data_tok: Any, context: int) -> Any:
    """The tokenizer of a DT export (or converted HF DT) at this run's ``context``, once the env (the data,
    tokenized by ``data_tok``) is checked to fit it. The source's tokenizer stays: its normalisation is what
    the weights were trained on. A new action space is refused, not re-initialised: actions are the model's
    inputs as well as its outputs (a new head would meet an untrained action embedding). So are other states,
    a timestep table shorter than the env's episodes and a context past learned positions."""
    from omni.tokenizers.trajectory import TrajectoryTokenizer

    config, _, tokenizers = source
    tok = tokenizers["trajectory"]
    space = lambda t: (f"Discrete({t.n_actions})" if t.discrete else f"Box({t.action_dim},)")  # noqa: E731
    if (tok.state_dim, tok.discrete, tok.action_cols) != (data_tok.state_dim, data_tok.discrete, data_tok.action_cols):
        raise ValueError(f"init {path}: the model takes {tok.state_dim} state values and {space(tok)} actions, the "
                         f"env {data_tok.state_dim} and {space(data_tok)}: start from a model of this env")
    if tok.max_timestep < data_tok.max_timestep:
        raise ValueError(f"init {path}: the model's timestep table covers {tok.max_timestep} steps, this env's "
                         f"episodes run to {data_tok.max_timestep - 1}")
    trunk = TrunkConfig(**config["trunk"])
    if trunk.positions in ("learned", "learned_1d") and trunk.max_positions < 3 * context:
        raise ValueError(f"init {path}: the model's learned positions cover {trunk.max_positions // 3} steps, "
                         f"context is {context}")
    return TrajectoryTokenizer(**{**tok.config(), "context": context})


def init_decision_transformer(source: Export, path: str | os.PathLike, tok: Any, dropout: float,
                              action_dropout: float, use_returns: bool) -> tuple[nn.Module, dict[str, Any]]:
    """(the DT of ``source`` over ``tok`` (``init_trajectory_tokenizer``) with this run's dropouts, the export
    config entries the run's export keeps: carried tensors, action squash, source, so ``omni convert --to hf``
    still takes it). A bc model cannot start a DT run, nor a DT a bc run (one line)."""
    from omni.rl import CarriedTensors, DecisionTransformer

    config, state, _ = source
    if bool(config.get("use_returns", True)) != use_returns:
        kind = "a returns-conditioned DT" if config.get("use_returns", True) else "a behaviour-cloning model"
        raise ValueError(f"init {path}: {kind} cannot start this method; set methods=['dt'] for a DT, "
                         "['bc'] or ['fbc'] for a bc model")
    trunk = replace(TrunkConfig(**config["trunk"]), dropout=dropout)
    carried = CarriedTensors(config["carried"]) if config.get("carried") else None
    model = DecisionTransformer(tok, trunk, use_returns=use_returns, action_dropout=action_dropout, carried=carried,
                                action_squash=config.get("action_squash", "tanh"))
    load_init(model, state, path)
    return model, {k: config[k] for k in ("carried", "action_squash", "source") if k in config}


# ----------------------------------------------------------------------------------------------------
# recipes/multimodal.py


def init_multitask(source: Export, path: str | os.PathLike, tokenizers: Mapping[str, Any]) -> TrunkConfig:
    """The trunk config of a multimodal export (``OmniModel``) this run starts from, once its tokenizers are
    checked against the run's ``tokenizers`` (a modality both have must be tokenized alike: the embedder and
    the LM head read the same vocabulary, patches, features). A GPT-2 or other text LM export cannot start the
    multimodal trunk: its vocabulary is not the recipe's bpe-8k shared by the text and speech tasks, and its
    learned position table indexes one token sequence where packed multimodal rows carry 2-D positions."""
    config, _, theirs = source
    trunk = TrunkConfig(**config["trunk"])
    hint = "start from a recipes/multimodal.py export (a GPT-2 or other text LM cannot start this trunk)"
    if trunk.positions == "learned_1d":
        raise ValueError(f"init {path}: its learned 1-D position table indexes one token sequence and cannot "
                         f"start the multimodal trunk (packed rows, 2-D positions); {hint}")
    if "text" in theirs and "text" in tokenizers and theirs["text"].vocab_size != tokenizers["text"].vocab_size:
        raise ValueError(f"init {path}: its text vocabulary ({theirs['text'].vocab_size} tokens) is not the one "
                         f"this recipe's text and speech tasks share ({tokenizers['text'].vocab_size}); {hint}")
    for modality in sorted(set(theirs) & set(tokenizers)):
        a, b = theirs[modality].config(), tokenizers[modality].config()
        # where files live (a text tokenizer's path) and data statistics (the trajectory's normalisation, computed
        # from this run's episodes) may differ; what shapes the embedders and heads may not
        differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)
                        and not k.startswith(("state_", "rtg", "path")))
        if differ:
            raise ValueError(f"init {path}: its {modality} tokenizer differs from this run's in {', '.join(differ)}")
    return trunk


def new_multitask_tensor(key: str) -> bool:
    """A multimodal run may start a head fresh (a task the export has not, another class count) and leave an
    export's head or embedder of a task it does not train (``only``) unused; the trunk must come whole."""
    return key.startswith(("heads.", "embedders."))


__all__ = ["DT_BUILDER", "OMNI_BUILDER", "init_decision_transformer", "init_multitask", "init_trajectory_tokenizer",
           "load_init", "new_multitask_tensor", "read_init"]
