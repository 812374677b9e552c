"""One encoder pass over a long recording (omni.pipelines.long_audio, #26): the chunked front end equals the whole
one, the windowed encoder's one pass equals the dense masked reference, the banded path is the one taken (block
tables of a fixed width however long the input), word times are absolute, and the models that cannot are refused."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

import omni.pipelines.long_audio
import omni.trunk
from omni.asr_text import CTC_BLANK, ctc_greedy_decode
from omni.pipelines.long_audio import (check_one_pass, collapse, ctc_words, encode_long, front_end, local_reach,
                                       log_mel_chunked, one_pass, pieces, receptive_field, supports_one_pass)
from omni.speech import SpeechRecognizer
from omni.tokenizers.audio import AudioTokenizer, log_mel
from omni.tokenizers.text import TextTokenizer
from omni.trunk import preset

SR = 16000
WINDOW = {"pattern": {"kind": "window", "before": 8, "after": 8}}


def wave_of(seconds: float, seed: int = 0) -> torch.Tensor:
    """Seeded noise with a rising level and a tone: no two frames alike."""
    g = torch.Generator().manual_seed(seed)
    n = int(seconds * SR)
    t = torch.arange(n, dtype=torch.float32)
    return torch.randn(n, generator=g) * torch.linspace(0.01, 0.4, n) + 0.2 * torch.sin(t * 0.07)


def speech_model(attention=WINDOW, ctc: bool = True, seed: int = 0, **kw) -> SpeechRecognizer:
    torch.manual_seed(seed)
    enc = preset("tiny", attention=attention)
    return SpeechRecognizer(AudioTokenizer(max_seconds=None, stride=3), TextTokenizer(), enc,
                            preset("tiny", cross_attention=True), ctc=ctc, **kw).eval()


@pytest.mark.parametrize("stride,samples", [(3, SR * 20 + 37), (2, SR * 9 + 159), (3, 1000)])
def test_chunked_front_end_equals_the_whole(stride, samples):
    tok = AudioTokenizer(max_seconds=None, stride=stride)
    wave = wave_of(samples / SR)[:samples]
    whole = tok.encode((wave, SR)).tokens
    got = front_end(wave, tok, chunk_seconds=3.0)  # 3 s chunks: 7 and 3 chunks, edges inside tokens' windows
    assert got.shape == whole.shape == (tok.num_tokens(samples), 80 * 5)
    assert (got - whole).abs().max().item() <= 1e-6
    assert (log_mel_chunked(wave, tok, 3.0) - log_mel(wave)).abs().max().item() <= 1e-6


def test_one_pass_encoder_equals_dense_masked_reference():
    model = speech_model()
    tok = AudioTokenizer(max_seconds=None, stride=3)
    wave = wave_of(12.0)  # 401 tokens: 4 query blocks of 128, a window of 8 crossing block edges
    tokens = tok.encode((wave, SR)).tokens[None]
    with torch.no_grad():
        dense = model.encode(tokens, torch.ones(tokens.shape[:2], dtype=torch.bool))  # (T x T) bool mask, SDPA
        full = SpeechRecognizer(tok, TextTokenizer(), preset("tiny"), preset("tiny", cross_attention=True), ctc=True)
        full.load_state_dict(model.state_dict())
        unmasked = full.eval().encode(tokens)
    got = encode_long(model, tok, wave, chunk_seconds=2.0)
    assert (got - dense).abs().max().item() <= 1e-5
    assert (got - unmasked).abs().max().item() > 1e-2  # the window matters: full attention differs
    text, _ = one_pass(model, tok, wave, words=False, chunk_seconds=2.0)
    assert text == " ".join(ctc_greedy_decode(model.ctc_head(dense))[0].split())


def test_spans_with_the_receptive_field_give_the_same_states(monkeypatch):
    model = speech_model()
    tok = AudioTokenizer(max_seconds=None, stride=3)
    assert receptive_field(model.encoder.schedule) == 16  # 2 layers x 8
    wave = wave_of(12.0)  # 401 tokens: 7 spans
    whole = encode_long(model, tok, wave)
    spans = encode_long(model, tok, wave, span_seconds=2.0)  # 66-token spans, 16 tokens of context either side
    assert (spans - whole).abs().max().item() <= 1e-5
    globals_ = speech_model(attention={"pattern": {"kind": "any", "of": [WINDOW["pattern"], {"kind": "global"}]}})
    assert receptive_field(globals_.encoder.schedule) is None and supports_one_pass(globals_, tok)
    with pytest.raises(ValueError, match="global tokens"):
        encode_long(globals_, tok, wave, span_seconds=2.0)
    monkeypatch.setattr(omni.pipelines.long_audio, "receptive_field", lambda schedule: 8)  # one layer's worth
    assert (encode_long(model, tok, wave, span_seconds=2.0) - whole).abs().max().item() > 1e-4  # 40x the tolerance


def test_encoder_pass_takes_the_banded_path_with_fixed_width_tables(monkeypatch):
    seen: list[tuple[int, int]] = []
    banded = omni.trunk.banded_attention

    def spy(q, k, v, mask, *args, **kwargs):
        assert isinstance(mask, BlockMask)
        width = (mask.kv_num_blocks + mask.full_kv_num_blocks).max().item()  # key blocks a query block reads
        seen.append((q.shape[2], width))
        return banded(q, k, v, mask, *args, **kwargs)

    def no_dense(*args, **kwargs):
        raise AssertionError("a dense (T x T) mask was built")

    monkeypatch.setattr(omni.trunk, "banded_attention", spy)
    monkeypatch.setattr(omni.attention_patterns, "dense", no_dense)
    model = speech_model()
    tok = AudioTokenizer(stride=3)  # an export's tokenizer: max_seconds 30, which one pass does not apply
    for seconds in (20.0, 80.0):
        encode_long(model, tok, wave_of(seconds))
    lengths = sorted({t for t, _ in seen})
    assert lengths == [tok.num_tokens(20 * SR), tok.num_tokens(80 * SR)]  # 667 and 2667 tokens
    assert len(seen) == 2 * model.encoder.cfg.n_layers
    assert {w for _, w in seen} == {3}  # its own 128-block and the two beside it, at 667 tokens as at 2667


def spelled(words_at: list[tuple[str, int]], frames: int, lead: int = 0) -> torch.Tensor:
    """(frames + lead, 257) CTC log-probabilities whose best path spells each word from its frame, one frame per
    letter, a space after it, blanks elsewhere."""
    path = np.full(frames + lead, CTC_BLANK)
    for word, at in words_at:
        for i, c in enumerate(word.encode() + b" "):
            path[lead + at + 2 * i] = c  # a blank between letters: doubled letters stay two
    logits = torch.full((frames + lead, CTC_BLANK + 1), -8.0)
    logits[torch.arange(frames + lead), torch.as_tensor(path)] = 8.0
    return logits.log_softmax(-1)


def test_word_times_are_absolute_and_pieces_change_nothing():
    tok = AudioTokenizer(max_seconds=None, stride=3)  # 33.3 tokens/s
    plan = [("the", 40), ("quiet", 300), ("lane", 700), ("was", 1500), ("empty", 2600)]
    lp = spelled(plan, 3000)  # 90 s
    whole = ctc_words(lp, tok, piece_seconds=1000.0)
    cut = ctc_words(lp, tok, piece_seconds=10.0, search_seconds=5.0)  # 10 pieces or more, cut in the pauses
    assert [w.word for w in whole] == [w for w, _ in plan]
    assert [(w.word, w.start, w.end) for w in cut] == [(w.word, w.start, w.end) for w in whole]
    tps = tok.tokens_per_second
    assert [round(w.start * tps, 6) for w in whole] == [at - 0.5 for _, at in plan]  # a frame's outer edge
    lead = 1000  # 30 s of leading silence: every word moves by exactly 30 s
    shifted = ctc_words(spelled(plan, 3000, lead), tok, piece_seconds=10.0, search_seconds=5.0)
    assert [w.start - v.start for w, v in zip(shifted, whole)] == pytest.approx([lead / tps] * len(plan), abs=1e-9)
    assert [w.end - v.end for w, v in zip(shifted, whole)] == pytest.approx([lead / tps] * len(plan), abs=1e-9)


def test_pieces_cut_at_blank_frames_and_keep_the_text():
    rng = np.random.default_rng(0)
    path = rng.choice([CTC_BLANK] * 6 + [97, 98, 32], size=5000)
    cuts = pieces(path, limit=300, search=100)
    assert cuts[0][0] == 0 and cuts[-1][1] == 5000
    assert all(b - a <= 300 for a, b in cuts) and all(b == a2 for (_, b), (a2, _) in itertools.pairwise(cuts))
    assert all(path[a] == CTC_BLANK for a, _ in cuts[1:])
    assert "".join(collapse(path[a:b]) for a, b in cuts) == collapse(path)


def test_models_that_cannot_take_one_pass_are_refused_in_one_line():
    tok = AudioTokenizer(max_seconds=None, stride=3)
    assert local_reach(speech_model().encoder.schedule) == 8
    assert supports_one_pass(speech_model(), tok)
    full = speech_model(attention=None)
    assert local_reach(full.encoder.schedule) is None and not supports_one_pass(full, tok)
    with pytest.raises(ValueError, match=r"full attention: one pass over 3600 s \(120,001 tokens") as err:
        check_one_pass(full, tok, 3600.0)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="full attention"):
        one_pass(full, tok, wave_of(2.0))
    second_full = {"pattern": WINDOW["pattern"], "full_every": 2}  # tiny has 2 layers: layer 1 full
    assert not supports_one_pass(speech_model(attention=second_full), tok)
    with pytest.raises(ValueError, match="relative positions"):
        check_one_pass(speech_model(audio_positions="sinusoidal"), tok)
    with pytest.raises(ValueError, match="CTC head"):
        check_one_pass(speech_model(ctc=False), tok)


def test_rope_with_a_window_holds_an_hour_in():
    """The encoder's positions are RoPE's (relative): the same tokens 120,000 places in (an hour at 33 Hz) give the
    same states as at the start, so a model trained on 1-15 s clips reads the hour's end as it reads its start."""
    model = speech_model()
    x = torch.randn(1, 300, model.encoder.cfg.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        start = model.encoder(x)
        later = model.encoder(x, torch.arange(120_000, 120_300)[None])
    assert (start - later).abs().max().item() <= 1e-5


def test_omni_transcribe_reads_a_local_encoder_export_in_one_pass(tmp_path, capsys):
    """`omni transcribe --decode ctc` on an export whose encoder attends locally reads each file in one encoder pass
    (auto, and --long-form one-pass): the text of one_pass, word times absolute; a 45 s file is longer than any
    window. Wrong uses are one line, exit 2: one pass without --decode ctc, with --alignment, on a full-attention
    export."""
    import json

    import soundfile as sf

    from _interop import cli_error

    from omni.cli import main
    from omni.export import save_pretrained
    from omni.pipelines.transcribe import read_audio_file

    model = speech_model()
    with torch.no_grad():
        model.ctc_head.weight.mul_(4.0)  # a varied best path, not all blanks
    toks = {"audio": AudioTokenizer(max_seconds=None, stride=3), "text": TextTokenizer()}  # speech_model's
    config = {"builder": "omni.speech:build_speech_recognizer", "encoder": model.encoder.cfg.to_dict(),
              "decoder": model.decoder.cfg.to_dict(), "ctc": True}
    local = save_pretrained(model, tmp_path / "local", config, tokenizers=toks)
    full_model = speech_model(attention=None)
    full = save_pretrained(full_model, tmp_path / "full", {**config, "encoder": full_model.encoder.cfg.to_dict()},
                           tokenizers=toks)
    wav = tmp_path / "long.wav"
    sf.write(wav, torch.cat([torch.zeros(SR * 5), wave_of(40.0)]).numpy(), SR)
    want_text, want_words = one_pass(model, toks["audio"], read_audio_file(wav, SR), span_seconds=300.0)
    assert want_text and want_words
    for extra in ([], ["--long-form", "one-pass"]):
        assert main(["transcribe", "--checkpoint", str(local), "--device", "cpu", "--format", "json", "--decode", "ctc",
                     *extra, str(wav)]) == 0
        row = json.loads(capsys.readouterr().out)[0]
        assert row["text"] == want_text and row["method"] == "ctc"
        got = [(w["word"], w["start"], w["end"]) for s in row["segments"] for w in s["words"]]
        assert [g[0] for g in got] == [w.word.strip() for w in want_words]
        assert max(abs(g[1] - w.start) + abs(g[2] - w.end) for g, w in zip(got, want_words)) < 0.01
        assert min(g[1] for g in got) >= 4.5  # 5 s of silence first: times are the file's
    base = ["--device", "cpu", "--long-form", "one-pass", str(wav)]
    assert "add --decode ctc" in cli_error(["transcribe", "--checkpoint", str(local), *base], capsys,
                                           prog="omni transcribe")
    assert "--alignment" in cli_error(["transcribe", "--checkpoint", str(local), "--decode", "ctc", "--long-form",
                                       "one-pass", "--alignment", str(tmp_path / "pics"), str(wav)], capsys,
                                      prog="omni transcribe")
    err = cli_error(["transcribe", "--checkpoint", str(full), "--decode", "ctc", *base], capsys, prog=None)
    assert "full attention" in err and "--long-form pauses" in err
