"""recipes/whisper.py's CPU default and its reporting: the `cpu` preset is the default without CUDA, the result
line gives the CER the preset reports first and the other after, with the trivial transcribers' scores; the
constant-transcript baseline is the training medoid; samples/ files are one clip a line, whatever a transcript
holds. (The recipe end to end, samples/ included: tests/test_whisper.py::test_recipe_tiny_smoke.)"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import load_recipe



@pytest.fixture(scope="module")
def recipe():
    return load_recipe("whisper", "whisper_recipe_cpu")


def test_default_preset_is_cpu_without_cuda_and_base_with_it(recipe, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = recipe.parse_args([])
    assert (cfg["preset"], cfg["out"], cfg["report"], cfg["audio_stride"]) == ("cpu", "runs/whisper-cpu", "ctc", 3)
    assert cfg["build"]["test"] >= 200 and cfg["limit_eval"] is None  # the whole held-out set is scored
    assert cfg["optimizer"] == "muon" and recipe.parse_args(["--preset", "tiny"])["optimizer"] == "adamw"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert recipe.parse_args([])["preset"] == "base"
    assert recipe.parse_args(["--preset", "tiny"])["report"] == "decoder"  # the tiny smoke run keeps its order


def test_result_line_reports_the_claimed_cer_first_and_the_baselines(recipe):
    metrics = {"eval/cer": 0.6123, "eval/ctc_cer": 0.1849, "eval/wer": 0.81}
    baselines = {"words": 2706.0, "constant_cer": 0.7771, "empty_cer": 1.0}
    line = recipe.result_line("ctc", metrics, baselines, "it was a very fine day")
    assert line == ("test CER: CTC head (best path) 18.5%, decoder (greedy) 61.2%; test WER (decoder) 81.0%; "
                    "baselines on the same 2706 words: an empty transcript 100%, one training sentence every time "
                    "(6 words) 77.7%")
    assert recipe.result_line("decoder", metrics, baselines, "x").startswith(
        "test CER: decoder (greedy) 61.2%, CTC head (best path) 18.5%;")
    # no CTC head (ctc_weight=0): the decoder alone; no evaluation: n/a, never a made-up number
    assert recipe.result_line("ctc", {"eval/cer": 0.5, "eval/wer": 0.7}, {}, "") == \
        "test CER: decoder (greedy) 50.0%; test WER (decoder) 70.0%"
    assert recipe.result_line("ctc", {"eval/wer": math.nan}, {}, "") == \
        "test CER: decoder (greedy) n/a; test WER (decoder) n/a"


def test_constant_transcript_is_the_training_medoid(recipe):
    transcripts = ["The cat sat.", "the cat sat down", "The dog sat!", "zzzz zzzz zzzz zzzz zzzz zzzz"]
    assert recipe.constant_transcript(transcripts) == "the cat sat"  # normalised as CER counts
    assert recipe.constant_transcript(transcripts, candidates=1) == "the cat sat"
    assert recipe.constant_transcript(transcripts[::-1], candidates=1) == "zzzz zzzz zzzz zzzz zzzz zzzz"
    assert recipe.constant_transcript([]) == ""


def test_samples_file_has_one_clip_a_line(recipe, tmp_path):
    from omni.tokenizers.text import TextTokenizer

    scorer = recipe.Scorer(TextTokenizer(), None, 8, samples=tmp_path / "samples")
    path = scorer.write_samples(7, [("k0", "a\tb", "a b", ""), ("k1", "two\nlines", "two  lines", "x")])
    assert path == tmp_path / "samples" / "step_7.tsv"
    assert path.read_text() == "key\treference\tctc\tdecoder\nk0\ta b\ta b\t\nk1\ttwo lines\ttwo lines\tx\n"
    assert [p.name for p in (tmp_path / "samples").iterdir()] == ["step_7.tsv"]  # no temporary left behind


def test_a_synthesised_dataset_from_another_corpus_is_refused(recipe, tmp_path):
    """Before, a data folder synthesised from one corpus was trained on whatever text= said, without a word."""
    import hashlib
    import json

    from omni.data.builders_speech import load_paragraphs
    from omni.data.speech import extract_sentences

    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text("The cat sat on the mat today. A dog ran in the park at noon. Rain fell over the quiet town.\n")
    second.write_text("Ships sail across the wide grey sea. Birds sing in the early light of spring.\n")
    sentences = extract_sentences(load_paragraphs([str(first)])[0], 3, 25)
    data = tmp_path / "speech"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({
        "format_version": 1, "builder": "speech-synth", "splits": {},
        "args": {"min_words": 3, "max_words": 25},
        "source": {"corpus": "first.txt", "sentences": len(sentences),
                   "sha256": hashlib.sha256("\n".join(sentences).encode()).hexdigest()}}))
    recipe.check_synthesised_corpus(json.loads((data / "manifest.json").read_text()), [str(first)], data)  # same
    with pytest.raises(ValueError, match=r"holds speech synthesised from 'first.txt', not from the text this run "
                                         r"names \(second.txt\): remove"):
        recipe.check_synthesised_corpus(json.loads((data / "manifest.json").read_text()), [str(second)], data)
    other = {"builder": "librispeech", "splits": {}, "source": {"sha256": "x"}}
    recipe.check_synthesised_corpus(other, [str(second)], data)  # not synthesised: read as it is


def test_encoder_attention_windows_the_encoder_only(recipe, capsys):
    """`encoder_attention` (the cpu-long preset's local encoder, which `omni transcribe` reads in one pass) patterns
    the encoder alone; a pattern audio cannot take, or one with init, is one line before any data (exit 2)."""
    from omni.tokenizers.audio import AudioTokenizer
    from omni.tokenizers.text import TextTokenizer

    cfg = recipe.parse_args(["--preset", "cpu-long"])
    assert cfg["encoder_attention"] == {"pattern": {"kind": "window", "before": 64, "after": 64}}
    model, config = recipe.from_scratch(cfg, AudioTokenizer(stride=3), TextTokenizer())
    assert config["encoder"]["attention"] == {"pattern": {"kind": "window", "before": 64, "after": 64},
                                              "full_every": 0}
    assert config["decoder"]["attention"] is None and model.encoder.schedule.sparse
    assert not model.decoder.schedule.sparse
    for extra, words in (
        (["encoder_attention={'pattern': {'kind': 'window2d', 'rows': 2, 'cols': 2}}"], "encoder_attention: layer 0's "
                                                                                        "window2d needs"),
        (["encoder_attention={'pattern': {'kind': 'window', 'before': 0, 'after': 0}}"], "encoder_attention: "
                                                                                         "attention pattern: a window "
                                                                                         "of 0"),
        (["init=runs/x"], "encoder_attention: init brings its own encoder"),
    ):
        with pytest.raises(SystemExit) as stop:
            recipe.parse_args(["--preset", "cpu-long", "--set", *extra])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert words in err and "Traceback" not in err


def test_optimizer_muon_reaches_the_trainer_and_learns(recipe, tmp_path, capsys, monkeypatch):
    """`optimizer` goes to the Trainer: with muon, Muon trains the nn.Linear weights of both trunks (self- and
    cross-attention, MLPs) and AdamW the audio / text embedders, the tied LM head and the CTC head; a few tiny steps
    lower the loss. A bad name is argparse's usage and one error line, exit 2, before any data is built."""
    import json

    from omni.optimizers import MuonAdamW, muon_parameters

    built = []

    class Recorded(recipe.Trainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            built.append(self)

    monkeypatch.setattr(recipe, "Trainer", Recorded)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"{s} It was a fine day number {w}." for s, w in zip(
        ["The cat sat down.", "A red ball rolls away.", "She sings a song.", "Where is my hat?"] * 2,
        "one two three four five six seven eight".split())))
    build = {"train": 6, "test": 3, "text": [str(corpus)], "workers": 1, "quiet": True}
    out = tmp_path / "run"
    recipe.main(["--preset", "tiny", "--out", str(out), "--set", f"data='{tmp_path / 'data'}'", f"build={build!r}",
                 "steps=10", "batch_size=3", "eval_batch_size=3", "max_new_tokens=4", "progress=False",
                 "log_every=5", "optimizer=muon"])
    trainer = built[0]
    assert trainer.config.optimizer == "muon"
    assert isinstance(getattr(trainer.optimizer, "optimizer", trainer.optimizer), MuonAdamW)
    model = recipe.unwrap(trainer.model)
    ids = muon_parameters(model)
    muon = {n for n, p in model.named_parameters() if id(p) in ids}
    assert muon and all(n.startswith(("encoder.blocks.", "decoder.blocks.")) and n.endswith(".weight") for n in muon)
    assert any(".cross" in n for n in muon), muon  # the decoder's cross-attention matrices are Muon's too
    for n, p in model.named_parameters():  # every trunk matrix is Muon's; embedders and heads are AdamW's
        if n.startswith(("encoder.blocks.", "decoder.blocks.")) and p.ndim == 2:
            assert n in muon, n
        if n.startswith(("audio_embed.", "text_embed.", "head.", "ctc_head.")):
            assert n not in muon, n
    rows = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    losses = [x for r in rows for x in r.get("train/loss_per_step", [])]
    assert len(losses) == 10 and losses[-1] < losses[0] - 1.0, losses
    capsys.readouterr()
    monkeypatch.setattr("sys.argv", ["recipes/whisper.py"])
    with pytest.raises(SystemExit) as stop:
        recipe.run_recipe(lambda: recipe.main(["--preset", "tiny", "--out", str(tmp_path / "o"), "--set",
                                               f"data='{tmp_path / 'nothing'}'", "optimizer=sgd"]))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.strip().splitlines()[-1] == ("recipes/whisper.py: error: optimizer must be "
                                                                     "'adamw' or 'muon', got 'sgd'"), err
    assert not (tmp_path / "nothing").exists()
