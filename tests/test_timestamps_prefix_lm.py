"""Word timestamps of a multitask export's prefix-LM transcriber (omni/pipelines/timing.py: ``prefix_lm_attention``, DTW over
the shared trunk's text-to-audio self-attention): a tiny model whose attention is set by its weights recovers the
word spans it was built to look at, and `omni transcribe --format srt|json --alignment` works on a multitask export."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from omni.cli import main
from omni.export import save_pretrained
from omni.multitask import MultitaskModel, PrefixLMTranscriber, TranscribeTask, merge_tokenizers
from omni.pipelines.timing import prefix_lm_attention, time_windows, timing_method
from omni.timestamps import attention_word_timings, text_ids
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.text import TextTokenizer
from omni.trunk import preset

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SR, TPS = 16000, 50.0
SPANS = [(0, 7), (8, 19), (20, 27), (28, 41), (42, 51), (52, 59)]  # audio frames of query rows 0 .. 5
TEXT = "the cat sat down"  # tokens: the | c, at | sat | down (+ eos): rows 0 | 1, 2 | 3 | 4 (| 5)


@pytest.fixture(scope="module")
def toks():
    return AudioTokenizer(), TextTokenizer()


def steered_model(audio: AudioTokenizer, text: TextTokenizer, queries: list[int]) -> MultitaskModel:
    """A 2-layer trunk (no positions) where the query of row r (text token ``queries[r]``) attends to the audio
    tokens carrying code r: layer 0 is made the identity (its residual branches zeroed); in layer 1 q = 5 x, k = x
    after the LayerNorm, so a query and a key match where they hold the same one-hot code. Every head sees the
    code (it is repeated in each head's 16 channels); the audio embedder passes the first 64 features through."""
    asr = TranscribeTask("asr", audio, text, [torch.zeros(1600)], [TEXT])
    torch.manual_seed(0)
    model = MultitaskModel([asr], preset("tiny", positions="none")).eval()
    omni = model.omni
    d = omni.trunk_config.d_model
    with torch.no_grad():
        block0, block1 = omni.trunk.blocks
        for p in (block0.attn.out.weight, block0.attn.out.bias, block0.mlp.down.weight, block0.mlp.down.bias,
                  block1.attn.qkv.bias):
            p.zero_()
        block1.attn.qkv.weight.zero_()
        block1.attn.qkv.weight[:d] = 5 * torch.eye(d)  # q
        block1.attn.qkv.weight[d:2 * d] = torch.eye(d)  # k
        emb = omni.embedders["audio"]
        emb.in_proj.weight.zero_()
        emb.in_proj.weight[:, :d] = torch.eye(d)
        emb.out_proj.weight.copy_(torch.eye(d))
        for p in (emb.in_proj.bias, emb.out_proj.bias, emb.type_embedding.weight,
                  omni.embedders["text"].type_embedding.weight):
            p.zero_()
        table = omni.embedders["text"].token.weight
        table.zero_()
        for r, tok in enumerate(queries):
            table[tok] = 4 * code(r, d)
    return model


def code(r: int, d: int) -> torch.Tensor:
    """One-hot code ``r`` repeated in each of the 4 heads' 16 channels."""
    v = torch.zeros(d)
    v[[h * 16 + r for h in range(4)]] = 1.0
    return v


def test_recovered_word_times_are_the_constructed_spans(toks):
    audio, text = toks
    ids = text_ids(text, TEXT)
    queries = [text.token_id("transcribe"), *ids]  # row r's query is the token before ids[r] (r = n: before eos)
    assert len(set(queries)) == len(queries) == len(SPANS)
    model = steered_model(audio, text, queries)
    transcriber = PrefixLMTranscriber(model.omni, "asr", audio, text)
    assert timing_method(transcriber) == "attention"
    with pytest.raises(ValueError, match="text-to-audio attention"):
        timing_method(transcriber, "ctc")
    frames = SPANS[-1][1] + 1
    tokens = torch.zeros(frames, audio.n_mels * audio.kernel)
    for r, (a, b) in enumerate(SPANS):
        tokens[a:b + 1, :64] = 4 * code(r, 64)
    maps, probs = prefix_lm_attention(transcriber, tokens, ids)
    P = len(transcriber.prompt)
    assert len(maps) == 1 and maps[0].shape == (4, P + len(ids) + 1, frames)  # layer 1 of 2: the second half
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(4, P + len(ids) + 1))  # renormalised over the audio
    for r, (a, b) in enumerate(SPANS):  # the constructed map: row P - 1 + r holds (almost) all on its span
        assert float(maps[0][:, P - 1 + r, a:b + 1].sum(-1).min()) > 0.99
    # the teacher-forced probabilities are the decoder's own (the prefix-LM's packed reference path)
    for k in range(len(ids)):
        prefix = torch.tensor([[*transcriber.prompt, *ids[:k]]])
        with torch.no_grad():
            logits = transcriber.logits(prefix, tokens[None], torch.ones(1, frames, dtype=torch.bool))
        assert probs[k] == pytest.approx(float(logits.softmax(-1)[0, ids[k]]), rel=1e-4)

    words, alignment = attention_word_timings(maps, probs, text, ids, frames, TPS, offset=1.0,
                                              layers=range(len(maps)), keep_alignment=True, label="self-attention")
    want = {"the": SPANS[0], "cat": (SPANS[1][0], SPANS[2][1]), "sat": SPANS[3], "down": SPANS[4]}
    assert [w.word for w in words] == list(want)
    for w, (a, b) in zip(words, want.values()):
        assert abs(w.start - (1.0 + max(a - 0.5, 0) / TPS)) <= 1 / TPS, (w, a)
        assert abs(w.end - (1.0 + (b + 0.5) / TPS)) <= 1 / TPS, (w, b)
    assert alignment is not None and alignment.method == "self-attention"
    assert alignment.matrix.shape == (len(ids) + 1, frames)


@pytest.fixture(scope="module")
def export(toks, tmp_path_factory) -> Path:
    """A tiny multitask export (one prefix-LM transcribe task) whose head says "house" whatever it hears: the trunk's
    final norm outputs e0 and only that token's embedding has a weight there (tests/_speech_models.py's trick)."""
    audio, text = toks
    asr = TranscribeTask("asr", audio, text, [torch.zeros(1600)], ["house"])
    torch.manual_seed(0)
    model = MultitaskModel([asr], preset("tiny")).eval()
    token = text_ids(text, "house")[0]
    with torch.no_grad():
        model.omni.trunk.norm.weight.zero_()
        model.omni.trunk.norm.bias.zero_()
        model.omni.trunk.norm.bias[0] = 1.0
        table = model.omni.embedders["text"].token.weight  # tied to the head
        table[:, 0] = 0.0
        table[token, 0] = 5.0
    return save_pretrained(model.omni, tmp_path_factory.mktemp("mm") / "final", model.export_config(),
                           tokenizers=merge_tokenizers([asr]))


def tone(seconds: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * SR)) / SR
    return 0.3 * torch.sin(2 * torch.pi * 300 * t) + 0.05 * torch.randn(len(t), generator=g)


def test_transcribe_srt_json_and_alignment_on_a_multitask_export(export, toks, tmp_path, capsys):
    from test_timestamps import parse_srt  # the strict SubRip reader

    clip = tmp_path / "a.wav"
    sf.write(clip, tone(1.2).numpy(), SR)
    base = ["transcribe", "--checkpoint", str(export), "--device", "cpu", "--max-new-tokens", "3"]
    status = main([*base, "--format", "srt", "--alignment", str(tmp_path / "png"), str(clip)])
    out, err = capsys.readouterr()
    assert status == 0, err
    cues = parse_srt(out)
    assert [c[2] for c in cues] == ["househousehouse"] and 0 <= cues[0][0] < cues[0][1] <= 1.2
    picture = (tmp_path / "png" / "a.png").read_bytes()
    assert picture[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image
    import io

    pixels = np.asarray(Image.open(io.BytesIO(picture)).convert("L"), dtype=np.float32)
    assert pixels.std() > 10  # not a blank canvas: the log-mel and the attention map are drawn

    status = main([*base, "--format", "json", "--alignment", str(tmp_path / "png2"), str(clip)])
    out, err = capsys.readouterr()
    [row] = json.loads(out)
    assert status == 0 and row["method"] == "attention" and row["alignment"] == str(tmp_path / "png2" / "a.png")
    assert Path(row["alignment"]).is_file() and row["segments"][0]["words"][0]["word"] == "househousehouse"
    status = main([*base, "--format", "json", "--output-dir", str(tmp_path / "js"), "--alignment",
                   str(tmp_path / "png3"), str(clip)])
    out, err = capsys.readouterr()
    assert status == 0 and out.splitlines() == [str(tmp_path / "js" / "a.json")]
    saved = json.loads((tmp_path / "js" / "a.json").read_text())
    assert saved["file"] == str(clip) and saved["alignment"] == str(tmp_path / "png3" / "a.png")

    status = main([*base, "--timestamps", "ctc", "--format", "srt", str(clip)])
    _, err = capsys.readouterr()
    assert status == 2 and "text-to-audio attention" in err and err.count("\n") == 1

    # the library path: the same words as the CLI's, and the window's offset moves them exactly
    audio, text = toks
    from omni.pipelines.transcribe import recognizer as _recognizer

    model, _, _ = _recognizer(export, "cpu")
    wave = tone(1.2)
    [(words, _)] = time_windows(model, audio, text, [wave], ["househousehouse"], [0.0])
    [(shifted, _)] = time_windows(model, audio, text, [wave], ["househousehouse"], [7.0])
    cli_words = [(w["start"], w["end"]) for w in row["segments"][0]["words"]]
    assert [t for w in words for t in (w.start, w.end)] == pytest.approx([t for w in cli_words for t in w], abs=1e-3)
    assert [t + 7.0 for w in words for t in (w.start, w.end)] == \
        pytest.approx([t for w in shifted for t in (w.start, w.end)])
