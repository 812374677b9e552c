"""recipes/multimodal.py's CPU default and what a run shows: the preset a machine without CUDA gets, each result
row's chance / baseline (majority class, another sentence's CER, a unigram LM), the curves' choice of metrics
(every task's loss and headline metric) and log lines split per task (omni.progress.metric_lines)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from conftest import load_recipe

from omni.asr_text import error_rates
from omni.progress import WIDE, metric_lines
from omni.segment import Segment
from omni.tasks import ClassifyTask, LMTask, TranscribeTask
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.image import ImageTokenizer
from omni.tokenizers.text import TextTokenizer



@pytest.fixture(scope="module")
def recipe():
    return load_recipe("multimodal", "multimodal_cpu_recipe")


def test_the_cpu_default_is_chosen_without_cuda_and_trains_all_four_tasks(recipe, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = recipe.parse_args([])
    assert cfg["preset"] == "cpu-default" and list(cfg["tasks"]) == ["image", "asr", "rl", "text"]
    assert cfg["eval_tasks"] == "end" and cfg["workers"] == 0  # one table at the end; no worker processes
    assert recipe.parse_args(["--preset", "tiny"])["steps"] == 60  # the tests' smoke run is unchanged
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert recipe.parse_args([])["preset"] == "base"


def test_classify_baseline_is_chance_and_the_train_splits_majority_class(recipe):
    image = ImageTokenizer(patch_size=7, channels=1, image_size=28, policy="resize")
    blank = [torch.zeros(1, 28, 28)]
    train = ClassifyTask("image", image, blank * 5, [0, 0, 0, 1, 2], 3)
    test = ClassifyTask("image", image, blank * 4, [0, 1, 1, 2], 3)
    b = recipe.baseline(train, test)
    assert b["chance"] == pytest.approx(1 / 3) and b["majority"] == 0.25  # class 0: one of the four test items
    assert b["text"] == "chance 33.33 (3 classes); majority class 25.00"


def test_transcribe_baseline_is_the_empty_transcript_and_another_sentence(recipe):
    audio, text = AudioTokenizer(), TextTokenizer()
    clips = [Segment("audio", torch.zeros(4, 400), torch.arange(4), audio.role)] * 3
    task = TranscribeTask("asr", audio, text, clips, ["abc", "abd", "xyz"])
    b = recipe.baseline(task, task)
    # each reference against the next one's sentence: abc/abd 1 edit, abd/xyz 3, xyz/abc 3 -> 7 of 9 characters
    assert b["empty_cer"] == 1.0 and b["other_sentence_cer"] == pytest.approx(7 / 9)
    assert b["other_sentence_cer"] == error_rates(["abc", "abd", "xyz"], ["abd", "xyz", "abc"])["cer"]
    assert b["text"] == "empty transcript 100.00; another test sentence 77.78"


def test_lm_baseline_is_an_add_one_unigram_of_the_train_split(recipe):
    text = TextTokenizer()
    train = LMTask("text", text, ["the cat sat on the mat.", "the dog sat on the log."] * 3)
    test = LMTask("text", text, ["the cat sat on the log."])
    b = recipe.baseline(train, test)
    counts = Counter(i for t in train.texts for i in text.encode(t, key="k").tokens[1:].tolist())
    total = sum(counts.values()) + text.vocab_size
    held = text.encode(test.texts[0], key="k").tokens[1:].tolist()
    nll = -sum(math.log((counts[i] + 1) / total) for i in held)
    assert b["unigram_ppl"] == pytest.approx(math.exp(nll / len(held)), rel=1e-9)
    assert b["unigram_bpb"] == pytest.approx(nll / math.log(2) / len(test.texts[0].encode()), rel=1e-9)
    # below a uniform guess over the vocabulary (8192), though add-one over 8192 ids outweighs 48 seen tokens here
    assert 1000 < b["unigram_ppl"] < text.vocab_size / 4


def test_curves_show_every_tasks_loss_and_headline_metric_not_the_bookkeeping(recipe):
    class History:
        records = [{"step": 10, "train/loss": 9.0, "train/loss_per_step": [9.0], "train/lr": 1e-3,
                    "train/image/loss": 2.0, "train/image/token_share": 0.1, "train/text/token_accuracy": 0.1},
                   {"step": 10, "eval/loss": 8.0, "eval/image/loss": 2.1, "eval/image/documents": 20.0,
                    "eval/image/test_accuracy": 0.8, "eval/image/test_loss": 0.6, "eval/image/test_items": 10.0,
                    "eval/asr/test_cer": 0.5, "eval/asr/test_ctc_cer": 0.4, "eval/asr/test_wer": 0.7,
                    "eval/rl/test_score_mean": 90.0, "eval/rl/test_score_std": 5.0, "eval/rl/test_return_mean": 450.0,
                    "eval/text/test_bpb": 1.9, "eval/text/test_ppl": 200.0, "eval/ts/test_f1": 0.5}]

    kinds = {"image": "classify", "asr": "transcribe", "rl": "action", "text": "lm", "ts": "plug-in"}
    tasks = [type("T", (), {"name": n, "kind": k})() for n, k in kinds.items()]
    shown = recipe.CurveRecords(History(), tasks).records
    assert list(shown[0]) == ["step", "train/loss", "train/loss_per_step", "train/image/loss"]
    assert list(shown[1]) == ["step", "eval/loss", "eval/image/loss", "eval/image/test_accuracy", "eval/asr/test_cer",
                              "eval/asr/test_ctc_cer", "eval/rl/test_score_mean", "eval/rl/test_score_std",
                              "eval/text/test_bpb", "eval/ts/test_f1"]  # a plug-in kind: all its test metrics


def test_wide_log_lines_are_split_per_task_and_short_ones_stay_whole():
    short = metric_lines("step 2/4: ", {"loss": 1.5, "acc": 0.25}, ", it/s 3, left 1s")
    assert short == "step 2/4: loss 1.5, acc 0.25, it/s 3, left 1s"
    values = {"loss": 9.0, "lr": 1e-3, **{f"{t}/{m}": 0.5 for t in ("asr", "image", "rl", "text")
                                          for m in ("loss", "accuracy", "documents", "token_share")}}
    lines = metric_lines("step 50/800: ", values, ", it/s 3, left 4m10s").splitlines()
    assert lines[0] == "step 50/800: loss 9, lr 0.001, it/s 3, left 4m10s"
    assert lines[1:] == [f"  {t}: loss 0.5, accuracy 0.5, documents 0.5, token_share 0.5"
                         for t in ("asr", "image", "rl", "text")]
    evaluated = metric_lines("step 50: ", {"eval/loss": 8.0, **{f"eval/{k}": v for k, v in values.items() if "/" in k}})
    assert evaluated.splitlines()[:2] == ["step 50: eval/loss 8",
                                          "  eval/asr: loss 0.5, accuracy 0.5, documents 0.5, token_share 0.5"]
    assert all(len(line) <= WIDE for line in lines + evaluated.splitlines())
