"""The kinds of export omni writes and reads, in one table: each builder name, what it makes, the recipe that
trains it and the commands that serve it; and, for a multitask export (builder "omni"), which task's head serves
``omni predict``, ``omni transcribe`` and ``omni generate``.

Every caller asks this module: the CLI's export checks, the pipelines, ``init=``, the converters and the recipes.
It reads config.json dicts and imports nothing of omni, so any layer may use it. The builder names are what
exports on disk record, so they never change (``omni.rl`` became a package; its name stayed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

IMAGE_CLASSIFIER = "omni.vision:build_image_classifier"  # ImageClassifier: recipes/vit.py, converted timm / HF ViTs
SPEECH_RECOGNIZER = "omni.speech:build_speech_recognizer"  # SpeechRecognizer: recipes/whisper.py, converted Whispers
DECISION_TRANSFORMER = "omni.rl:build_decision_transformer"  # recipes/decision_transformer.py, converted HF DTs
MULTITASK = "omni"  # OmniModel: recipes/multimodal.py, recipes/lm.py, converted GPT-2s; its tasks say what it serves

COMMANDS = ("predict", "transcribe", "generate")


@dataclass(frozen=True)
class ExportKind:
    """One single-task builder: what it makes, the recipe that trains it, the commands that read its exports."""

    builder: str
    what: str
    recipe: str
    commands: tuple[str, ...]


KINDS: dict[str, ExportKind] = {k.builder: k for k in (
    ExportKind(IMAGE_CLASSIFIER, "an image classifier", "recipes/vit.py", ("predict",)),
    ExportKind(SPEECH_RECOGNIZER, "a speech recognizer", "recipes/whisper.py", ("transcribe",)),
    ExportKind(DECISION_TRANSFORMER, "a decision transformer", "recipes/decision_transformer.py", ()),
)}


def is_multitask(config: Mapping[str, Any]) -> bool:
    """Whether the export is an OmniModel whose tasks (not its builder) say which heads serve which command."""
    return config.get("builder") == MULTITASK


def _heads(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in (config.get("heads") or {}).items() if isinstance(s, dict)}


def _tasks(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: t for n, t in (config.get("tasks") or {}).items() if isinstance(t, dict)}


def _one_task(config: Mapping[str, Any], kind: str, head_type: str, tokenizers: set[str], preferred: str,
              plural: str, unrecorded: str) -> str | None:
    """The task of ``kind`` (with a ``head_type`` head) a multitask export serves a command with: its one such task,
    or among several the one named ``preferred``; None when it has none or lacks the ``tokenizers``."""
    if not tokenizers <= set(config.get("tokenizers", [])):
        return None
    heads = _heads(config)
    names = [n for n, t in _tasks(config).items()
             if t.get("kind") == kind and heads.get(n, {}).get("type") == head_type]
    if len(names) > 1 and preferred not in names:
        raise ValueError(f"the export has {plural} tasks {', '.join(names)} and none is named {preferred!r}: "
                         f"{unrecorded} is not recorded")
    return names[0] if len(names) == 1 else preferred if names else None


def image_task(config: Mapping[str, Any]) -> str | None:
    """The image classification task (= head) of a multitask export: ``omni predict``'s."""
    return _one_task(config, "classify", "classification", {"image"}, "image", "classification",
                     "which one classifies images")


def speech_task(config: Mapping[str, Any]) -> str | None:
    """The transcribe task (= its LM head) of a multitask export: ``omni transcribe``'s."""
    return _one_task(config, "transcribe", "lm", {"audio", "text"}, "asr", "transcribe", "which one to decode")


def _head_description(config: Mapping[str, Any], name: str) -> str:
    heads, tasks = _heads(config), _tasks(config)
    transcriber = next((t for t, task in tasks.items() if task.get("kind") == "transcribe" and name == f"{t}_ctc"),
                       None)  # omni.tasks.TranscribeTask names its CTC head so
    if name not in heads:
        return "no head of that name"
    if transcriber is not None:
        return f"the CTC head of the transcribe task {transcriber!r} (audio frames -> characters)"
    if name in tasks:
        return f"the head of the {tasks[name].get('kind')} task {name!r}"
    return f"a {heads[name].get('type')!r} head"


def generation_head(config: Mapping[str, Any], head: str | None = None, *, where: str = "this export",
                    option: str = "head") -> str:
    """The head ``omni generate`` continues text with: ``head`` when it is one of the export's text LM heads, else
    its only one. ValueError (one line; ``where`` names the export, ``option`` the argument) when the export is
    no text LM, or ``head`` names a head that does not continue text (a transcribe task's CTC head and its
    audio-conditioned text head are "lm" heads too, but only an LM task's head continues text), or there are
    several and none is named."""
    heads, tasks = _heads(config), _tasks(config)
    lm = [n for n, s in heads.items() if s.get("type") == "lm"]
    if "text" not in config.get("tokenizers", []) or not lm:
        raise ValueError(f"not a text language model export (builder {config.get('builder')!r}, heads "
                         f"{', '.join(heads) or 'none'}): it has no text tokenizer and LM head")
    # an export that records its tasks (recipes, converted GPT-2s): the heads of its LM tasks; else every LM head
    valid = [n for n in lm if tasks.get(n, {}).get("kind") == "lm"] if tasks else lm
    listed = f"the text LM heads of {where}: {', '.join(valid) or 'none'}"
    if head is not None and head not in valid:
        raise ValueError(f"{option} {head}: {_head_description(config, head)}, which does not generate text; {listed}")
    if head is None and len(valid) != 1:
        raise ValueError(f"{where} has several text LM heads: name one with {option} ({', '.join(valid)})" if valid
                         else f"{where} has no text LM head to generate with; its LM heads are "
                         + "; ".join(f"{n}: {_head_description(config, n)}" for n in lm))
    return head or valid[0]


def _generates(config: Mapping[str, Any]) -> str | None:
    heads = _heads(config).values()
    return "lm" if "text" in config.get("tokenizers", []) and any(h.get("type") == "lm" for h in heads) else None


SERVES: dict[str, Callable[[Mapping[str, Any]], str | None]] = {  # a multitask export: command -> its head finder
    "predict": image_task, "transcribe": speech_task, "generate": _generates}


def describe(config: Mapping[str, Any]) -> tuple[str, list[str]]:
    """(what the export is, naming its builder and recipe; the commands that read it)."""
    builder = config.get("builder")
    if builder in KINDS:
        kind = KINDS[builder]
        return f"{kind.what} export (builder {builder!r}, {kind.recipe})", list(kind.commands)
    if not is_multitask(config):
        return (f"an export of builder {builder!r}" if builder else "an export that names no builder"), []
    commands = []
    for command, finds in SERVES.items():
        try:
            if finds(config) is not None:
                commands.append(command)
        except ValueError:  # several candidate tasks: the command itself says so
            commands.append(command)
    tasks = ", ".join(f"{name} ({task.get('kind')})" for name, task in _tasks(config).items())
    if not tasks:
        return "an OmniModel export (builder 'omni') that records no tasks", commands
    return f"a multitask export (builder 'omni', recipes/multimodal.py; tasks {tasks})", commands


def check_command(config: Mapping[str, Any], command: str, where: str) -> None:
    """ValueError (one line naming the export's kind and the command that fits) when ``omni <command>`` cannot
    read the export at ``where``."""
    what, commands = describe(config)
    if not commands:
        raise ValueError(f"{where} is {what}: none of {', '.join(f'`omni {c}`' for c in COMMANDS)} reads it")
    if command not in commands:
        raise ValueError(f"{where} is {what}, which `omni {command}` does not read: use `omni {commands[0]}`")


__all__ = ["COMMANDS", "DECISION_TRANSFORMER", "IMAGE_CLASSIFIER", "KINDS", "MULTITASK", "SERVES", "SPEECH_RECOGNIZER",
           "ExportKind", "check_command", "describe", "generation_head", "image_task", "is_multitask", "speech_task"]
