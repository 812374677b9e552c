"""Task kinds by name (``Task.kind``), as big_vision picks its evaluators by a config ``type``: for each kind
the Task class a recipe builds, the options its ``evaluate`` takes from the recipe config, and its row of a
results table. A recipe looks a kind up here and never branches on it (recipes/multimodal.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from omni.multitask import ActionTask, ClassifyTask, LMTask, Task, TranscribeTask
from omni.tokenizers.text import TextTokenizer

Row = tuple[str, str, str, str]  # metric, value, secondary metric, held-out data


@dataclass(frozen=True)
class TaskKind:
    """``task(name, weight=, loss_weight=, **data)`` builds one split's Task from its data; ``eval_options(entry,
    cfg)``: ``Task.evaluate``'s keyword arguments from the task's config entry and the recipe config;
    ``row(task, result)``: its Markdown row; ``from_items(entry, items, labels, text)``: the data of a user's
    (items, labels) split, None when the kind takes none."""

    task: type[Task]
    eval_options: Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]
    row: Callable[[Any, Mapping[str, float]], Row]  # (the kind's Task, its evaluate result)
    from_items: Callable[[Mapping[str, Any], Sequence[Any], Sequence[Any], TextTokenizer], dict[str, Any]] | None = None


def packed(entry: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Packed like training batches: ``rows`` x ``row_length`` tokens at a time."""
    return {"row_length": cfg["row_length"], "rows": cfg["rows"]}


def classify_row(task: Task, r: Mapping[str, float]) -> Row:
    return "top-1 accuracy (%)", f"{100 * r['accuracy']:.2f}", f"loss {r['loss']:.4f}", f"{r['items']:.0f} test items"


def classify_items(entry: Mapping[str, Any], items: Sequence[Any], labels: Sequence[Any],
                   text: TextTokenizer) -> dict[str, Any]:
    """A registered tokenizer (``tokenizer``, ``tokenizer_kwargs``) over the items, ``n_classes`` labels."""
    from omni.tokenizers import build_tokenizer

    return {"tokenizer": build_tokenizer(entry["tokenizer"], **entry.get("tokenizer_kwargs", {})), "items": items,
            "labels": labels, "n_classes": int(entry["n_classes"])}


def transcribe_options(entry: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"batch_size": entry.get("eval_batch_size", 64), "max_new_tokens": entry.get("max_new_tokens", 224)}


def transcribe_row(task: Task, r: Mapping[str, float]) -> Row:
    also = f"WER {100 * r['wer']:.2f}%" + (f", CTC CER {100 * r['ctc_cer']:.2f}%" if "ctc_cer" in r else "")
    return "CER (%)", f"{100 * r['cer']:.2f}", also, f"{r['utterances']:.0f} test utterances, greedy"


def action_options(entry: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Seeds 10000.. as recipes/decision_transformer.py (disjoint from the data's)."""
    return {"seeds": range(10_000, 10_000 + entry.get("eval_seeds", 5)), "target": entry.get("target")}


def action_row(task: ActionTask, r: Mapping[str, float]) -> Row:
    return ("normalised score", f"{r['score_mean']:.1f} ± {r['score_std']:.1f}",
            f"return {r['return_mean']:.1f} ± {r['return_std']:.1f} at target {r['target']:.1f}",
            f"{task.env_id} rollouts, {r['episodes']:.0f} seeds")


def lm_row(task: Task, r: Mapping[str, float]) -> Row:
    return ("perplexity (token)", f"{r['ppl']:.2f}", f"{r['bpb']:.4f} bits/byte",
            f"{r['documents']:.0f} held-out documents, {r['tokens']:.0f} tokens")


def lm_items(entry: Mapping[str, Any], items: Sequence[Any], labels: Sequence[Any],
             text: TextTokenizer) -> dict[str, Any]:
    """The items are the texts (labels ignored), on the shared text tokenizer."""
    return {"tokenizer": text, "texts": items}


def no_options(entry: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def any_row(task: Task, r: Mapping[str, float]) -> Row:
    return "", ", ".join(f"{k} {v:.4g}" for k, v in r.items() if k != "seconds"), "", ""


KINDS: dict[str, TaskKind] = {
    "classify": TaskKind(ClassifyTask, packed, classify_row, classify_items),
    "transcribe": TaskKind(TranscribeTask, transcribe_options, transcribe_row),
    "action": TaskKind(ActionTask, action_options, action_row),
    "lm": TaskKind(LMTask, packed, lm_row, lm_items),
}
OTHER = TaskKind(Task, no_options, any_row)  # a kind not registered here (a plug-in Task subclass)


def task_kind(name: str) -> TaskKind:
    """The registered kind ``name``, else OTHER (no evaluation options, every metric in one cell)."""
    return KINDS.get(name, OTHER)
