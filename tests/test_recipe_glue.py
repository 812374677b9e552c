"""The glue the recipes share: rank 0 first (omni.recipe_runtime.rank_zero_first), one speech-shard clip decoder with a
typed too-long exception (omni.data.clips, ClipTooLong), the task kinds recipes/multimodal.py looks up by name
(omni.tasks: each Task class owns its evaluation options and results row), and the R lazy-load reader
(omni.data.rdata)."""

from __future__ import annotations

import bz2
import io
import pickle
import runpy
import struct
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from conftest import write_janeaustenr
from omni.recipe_runtime import rank_zero_first
from omni.data.clips import DecodeClip, log_mel_tokens
from omni.data.rdata import decompress_chunk, read_lazyload
from omni.speech import speech_example
from omni.tasks import TASK_KINDS, ActionTask, ClassifyTask, LMTask, Task, TranscribeTask, register_task, task_class
from omni.tokenizers.audio import AudioTokenizer, ClipTooLong
from omni.tokenizers.text import TextTokenizer

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------
# rank_zero_first


@pytest.mark.parametrize("rank, world, order", [(0, 1, ["build"]), (0, 2, ["build", "barrier"]),
                                                (1, 2, ["barrier", "build"])])
def test_rank_zero_builds_before_the_others(rank, world, order, monkeypatch):
    seen = []
    monkeypatch.setattr(torch.distributed, "barrier", lambda: seen.append("barrier"))
    assert rank_zero_first(lambda: seen.append("build") or 7, rank, world) == 7
    assert seen == order


# ----------------------------------------------------------------------------------------------------
# One clip decoder; a too-long clip is a ClipTooLong


def flac(seconds: float, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format="FLAC")
    return buf.getvalue()


def sample(key: str, seconds: float) -> dict:
    return {"__key__": key, "flac": flac(seconds), "txt": b" a short clip \n"}


def test_too_long_clip_is_a_typed_value_error():
    with pytest.raises(ClipTooLong, match=r"'long': 2\.00 s is longer than max_seconds=1") as info:
        AudioTokenizer(max_seconds=1.0).encode(flac(2.0), key="long")
    assert isinstance(info.value, ValueError)  # callers that caught ValueError still do


def test_clip_decoder_drops_a_too_long_clip_by_type():
    audio = AudioTokenizer(max_seconds=1.0)
    decode = DecodeClip(partial(log_mel_tokens, audio))
    tokens, transcript = decode(sample("ok", 0.5))
    assert transcript == "a short clip" and tokens.shape == audio.encode(flac(0.5)).tokens.shape
    with pytest.warns(UserWarning, match=r"dropping 'long': .* longer than max_seconds"):
        assert decode(sample("long", 2.0)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DecodeClip(partial(log_mel_tokens, audio), warn=False)(sample("long", 2.0)) is None
    with pytest.raises(ValueError, match="could not decode") as info:  # any other ValueError is the sample's fault
        decode({"__key__": "bad", "flac": b"not audio", "txt": b"x"})
    assert not isinstance(info.value, ClipTooLong)
    with pytest.raises(ValueError, match=r"sample 'bare' needs an audio field \(flac, wav, mp3, ogg, opus\)"):
        decode({"__key__": "bare", "txt": b"x"})


def test_clip_decoder_makes_whisper_examples_and_pickles():
    audio, text = AudioTokenizer(max_seconds=1.0), TextTokenizer()
    decode = pickle.loads(pickle.dumps(DecodeClip(partial(speech_example, audio, text))))  # data workers
    example = decode(sample("ok", 0.5))
    expected = speech_example(audio, text, flac(0.5), "a short clip", key="ok")
    assert example["key"] == "ok" and set(example) == set(expected)
    for name in ("audio", "text", "targets", "ctc"):
        torch.testing.assert_close(example[name], expected[name], atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------------
# Task kinds: what recipes/multimodal.py looks up instead of branching on the kind


def test_every_kind_names_its_task_class():
    assert list(TASK_KINDS) == ["classify", "transcribe", "action", "lm"]  # the recipe's config takes these, in order
    assert {name: task_class(name) for name in TASK_KINDS} == {
        "classify": ClassifyTask, "transcribe": TranscribeTask, "action": ActionTask, "lm": LMTask}
    assert all(cls.kind == name for name, cls in TASK_KINDS.items())
    for unknown in ("video", Task.kind):
        with pytest.raises(ValueError, match=f"unknown task kind '{unknown}'; registered: classify, transcribe"):
            task_class(unknown)
    assert [k for k, cls in TASK_KINDS.items() if cls.reads_items()] == ["classify", "lm"]


def test_a_plugin_kind_registers_by_name():
    @register_task("test_video")
    class VideoTask(Task):
        pass

    try:
        assert task_class("test_video") is VideoTask and VideoTask.kind == "test_video"
        with pytest.raises(ValueError, match="task kind 'test_video' is already registered by .*VideoTask"):
            register_task("test_video")(type("Other", (Task,), {}))
    finally:
        del TASK_KINDS["test_video"]


def test_evaluation_options_by_kind():
    cfg = {"row_length": 512, "rows": 2}
    assert task_class("classify").eval_options({}, cfg) == task_class("lm").eval_options({}, cfg) == cfg
    assert task_class("transcribe").eval_options({}, cfg) == {"batch_size": 64, "max_new_tokens": 224}
    assert task_class("transcribe").eval_options({"eval_batch_size": 8, "max_new_tokens": 64}, cfg) == {
        "batch_size": 8, "max_new_tokens": 64}
    assert task_class("action").eval_options({"eval_seeds": 2, "target": 50.0}, cfg) == {
        "seeds": range(10_000, 10_002), "target": 50.0}
    assert Task.eval_options({"eval_seeds": 2}, cfg) == {}  # a kind without options (a plug-in Task subclass)


def test_results_rows_by_kind():
    class Env:  # stands in for the task: the action row names its env
        env_id = "CartPole-v1"

    rows = {
        "classify": ({"accuracy": 0.8123, "loss": 0.5, "items": 256.0},
                     ("top-1 accuracy (%)", "81.23", "loss 0.5000", "256 test items")),
        "transcribe": ({"cer": 0.1, "wer": 0.2, "ctc_cer": 0.3, "utterances": 8.0},
                       ("CER (%)", "10.00", "WER 20.00%, CTC CER 30.00%", "8 test utterances, greedy")),
        "action": ({"score_mean": 99.0, "score_std": 1.0, "return_mean": 500.0, "return_std": 0.0,
                    "target": 500.0, "episodes": 5.0},
                   ("normalised score", "99.0 ± 1.0", "return 500.0 ± 0.0 at target 500.0",
                    "CartPole-v1 rollouts, 5 seeds")),
        "lm": ({"ppl": 12.345, "bpb": 1.5, "documents": 3.0, "tokens": 40.0},
               ("perplexity (token)", "12.35", "1.5000 bits/byte", "3 held-out documents, 40 tokens")),
        "video": ({"f1": 0.5, "seconds": 3.0}, ("", "f1 0.5", "", "")),
    }
    for name, (result, row) in rows.items():
        cls = Task if name == "video" else task_class(name)  # video: a plug-in Task subclass's default row
        assert cls.result_row(Env(), result) == row, name


def test_multimodal_sources_name_their_kind():
    recipe = runpy.run_path(str(ROOT / "recipes" / "multimodal.py"))  # its globals
    task_source = recipe["task_source"]
    assert {source: kind for source, (kind, _) in recipe["SOURCES"].items()} == {
        "fashion-mnist": "classify", "speech-synth": "transcribe", "speech-shards": "transcribe", "gym": "action",
        "austen": "lm"}
    assert task_source("t", {"kind": "lm", "source": "austen"}) is recipe["austen"]
    assert task_source("t", {"kind": "lm", "data": "m:f"}) is recipe["user_data"]
    with pytest.raises(ValueError, match=r"task 'x': unknown kind/source 'lm'/'gym' \(built in: classify/fashion-mnist"):
        task_source("x", {"kind": "lm", "source": "gym"})
    with pytest.raises(ValueError, match="task 'x': kind 'action' with a data callable must be classify or lm"):
        task_source("x", {"kind": "action", "data": "m:f"})


# ----------------------------------------------------------------------------------------------------
# The R lazy-load reader


def test_read_lazyload_returns_every_variable(tmp_path):
    novels = {"emma": ["EMMA", "", "Emma Woodhouse, handsome,"], "persuasion": ["Sir Walter", ""]}
    write_janeaustenr(tmp_path / "janeaustenr", novels, xz=["persuasion"])  # zlib and xz chunks
    assert read_lazyload(tmp_path / "janeaustenr" / "data" / "Rdata.rdx") == novels


def test_decompress_chunk_kinds():
    raw = b"X\n" + bytes(range(40))
    for packed in (b"2" + bz2.compress(raw), b"0" + raw):
        assert decompress_chunk(struct.pack(">I", len(raw)) + packed) == raw
    with pytest.raises(ValueError, match="corrupt R lazy-load chunk: expected 41 bytes, got 42"):
        decompress_chunk(struct.pack(">I", len(raw) - 1) + b"0" + raw)
