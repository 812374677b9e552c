"""Word timestamps (omni/timestamps.py) and transcript formats (omni/transcript_formats.py): CTC forced alignment
on emissions built from known word boundaries, the energy refinement, DTW through a known attention map, token ->
word grouping, segments, SRT / WebVTT checked by a strict parser of each spec (and by the srt / webvtt-py
packages where installed), the JSON schema, absolute times across long-audio windows, and `omni transcribe
--format srt|vtt|json --output-dir --alignment` end to end on a tiny export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from omni.cli import main
from omni.export import save_pretrained
from omni.pipelines.timing import time_windows
from omni.pipelines.transcribe import split_windows, transcribe_timed
from omni.speech import CTC_BLANK, SpeechRecognizer
from omni.timestamps import (TimedSegment, TimedTranscript, WordTiming, _viterbi, attention_alignment,
                             attention_word_timings, ctc_align, ctc_word_timings, dtw_path, refine_with_energy,
                             row_spans, segment_words, text_ids, token_char_ends, transcript_words)
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.text import TextTokenizer
from omni.files import output_paths, write_atomic
from omni.transcript_formats import format_timestamp, to_srt, to_vtt, transcript_json
from omni.trunk import preset

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SR, TPS = 16000, 50.0


@pytest.fixture(scope="module")
def toks():
    return AudioTokenizer(), TextTokenizer()


# -- CTC forced alignment on constructed emissions -----------------------------------------------------------
def emissions(words: dict[str, tuple[int, int]], T: int, noise: float, seed: int = 0) -> torch.Tensor:
    """(T, 257) CTC log-probs of a peaky model that heard ``words`` at known frame spans: each word's letters
    are spikes spread over its span, the first on its first frame and the last on its last; the space label
    spikes halfway between two words; blank everywhere else; Gaussian noise on every logit."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, CTC_BLANK + 1, generator=g) * noise
    logits[:, CTC_BLANK] += 8.0
    spans = list(words.items())
    for k, (word, (a, b)) in enumerate(spans):
        for frame, byte in zip(np.linspace(a, b, len(word)).round().astype(int), word.encode()):
            logits[frame, byte] += 12.0
        if k + 1 < len(spans):
            logits[(b + spans[k + 1][1][0]) // 2, ord(" ")] += 12.0
    return logits.log_softmax(-1)


def test_forced_alignment_recovers_known_word_boundaries():
    truth = {"the": (10, 24), "cat": (35, 52), "sat": (60, 71), "down": (80, 99)}
    lp = emissions(truth, 110, noise=1.0)
    words, alignment = ctc_word_timings(lp, "The cat sat, down.", TPS, keep_alignment=True)
    assert [w.word for w in words] == ["The", "cat", "sat,", "down."]
    for w, (a, b) in zip(words, truth.values()):
        # frame i stands for [(i - 0.5) / 50, (i + 0.5) / 50): within one frame (20 ms) of the known span
        assert abs(w.start - (a - 0.5) / TPS) <= 1 / TPS and abs(w.end - (b + 0.5) / TPS) <= 1 / TPS
        spikes = np.linspace(a, b, len(w.word.strip(",."))).round().astype(int)
        posterior = lp[spikes, list(w.word.strip(",.").lower().encode())].exp().mean()
        assert w.probability == pytest.approx(float(posterior), abs=1e-6)  # mean over the word's aligned frames
    assert alignment is not None and alignment.matrix.shape == (len("the cat sat down"), 110)
    assert alignment.path[:, 0].tolist() == sorted(alignment.path[:, 0].tolist())  # frames in order
    # the offset of a window moves every time by exactly that much
    shifted, _ = ctc_word_timings(lp, "The cat sat, down.", TPS, offset=30.0)
    assert [round(s.start - w.start, 9) for s, w in zip(shifted, words)] == [30.0] * 4


def test_own_viterbi_equals_torchaudio_forced_align():
    g = torch.Generator().manual_seed(1)
    for T, L in ((40, 12), (25, 24), (60, 3)):
        lp = (torch.randn(T, 6, generator=g) * 3).log_softmax(-1)
        targets = torch.randint(0, 5, (L,), generator=g).tolist()  # blank = 5
        if sum(1 for a, b in zip(targets, targets[1:]) if a == b) + L > T:
            continue
        ours = _viterbi(lp.numpy(), targets, blank=5)
        units = ctc_align(lp, targets, blank=5)  # torchaudio's
        theirs = np.where(units >= 0, np.array(targets)[np.clip(units, 0, None)], 5)
        assert ours.tolist() == theirs.tolist()
    with pytest.raises(ValueError, match="no CTC path of 4 labels fits 3 frames"):
        ctc_align(lp[:3], [0, 1, 2, 3], blank=5)


def test_transcript_too_long_for_the_window_shares_it_by_length():
    lp = emissions({"a": (1, 1)}, 8, noise=0.0)
    words, alignment = ctc_word_timings(lp, "abcdef ghijkl", TPS)
    assert alignment is None and [w.probability for w in words] == [0.0, 0.0]
    assert words[0].start == 0.0 and words[1].end == pytest.approx(8 / TPS) and words[0].end == words[1].start


def test_energy_refinement_widens_spikes_to_the_loud_frames():
    energy = np.full(70, -60.0)
    energy[8:27] = energy[33:56] = -10.0  # two words with a pause between
    assert refine_with_energy([(10, 24), (35, 52)], energy) == [(8, 26), (33, 55)]
    # a spike that fell in the pause is cut off first (a model in noise does that); an all-quiet span stays
    assert refine_with_energy([(10, 30), (35, 52)], energy) == [(8, 26), (33, 55)]
    assert refine_with_energy([(10, 24), (28, 31), (35, 52)], energy) == [(8, 26), (28, 31), (33, 55)]
    # through ctc_word_timings: a bound next to a pause is the centre of the word's first / last loud frame
    words, _ = ctc_word_timings(emissions({"ab": (10, 24), "cd": (35, 52)}, 70, noise=1.0), "ab cd", TPS,
                                energy=energy)
    assert [t for w in words for t in (w.start, w.end)] == pytest.approx([8 / TPS, 26 / TPS, 33 / TPS, 55 / TPS])
    # continuous speech: the frames between the two words are shared at the midpoint
    speech = np.r_[np.full(5, -60.0), np.full(65, -10.0)]
    assert refine_with_energy([(10, 24), (35, 52)], speech) == [(5, 29), (30, 69)]
    assert refine_with_energy([(10, 24), (34, 52), (53, 60)], speech) == [(5, 29), (30, 52), (53, 69)]
    # and no two words ever share a frame, whatever the energy
    rng = np.random.default_rng(0)
    for _ in range(50):
        cuts = np.sort(rng.choice(np.arange(1, 69), 8, replace=False))
        spans = [(int(a), int(b)) for a, b in zip(cuts[::2], cuts[1::2])]
        out = refine_with_energy(spans, rng.choice([-60.0, -10.0], 70))
        assert all(a <= b < c for (a, b), (c, _) in zip(out, out[1:]))  # ordered, disjoint
        assert all(max(a, s) <= min(b, e) for (a, b), (s, e) in zip(out, spans))  # still on its CTC frames


# -- DTW over cross-attention ----------------------------------------------------------------------------
def test_dtw_path_is_optimal_and_monotonic():
    rng = np.random.default_rng(0)
    for _ in range(10):
        cost = rng.random((rng.integers(1, 7), rng.integers(1, 9)))
        N, M = cost.shape
        D = np.full((N + 1, M + 1), np.inf)
        D[0, 0] = 0.0
        for i in range(1, N + 1):
            for j in range(1, M + 1):
                D[i, j] = cost[i - 1, j - 1] + min(D[i - 1, j - 1], D[i - 1, j], D[i, j - 1])
        rows, cols = dtw_path(cost)
        assert cost[rows, cols].sum() == pytest.approx(D[N, M])
        assert (rows[0], cols[0], rows[-1], cols[-1]) == (0, 0, N - 1, M - 1)
        steps = set(zip(np.diff(rows).tolist(), np.diff(cols).tolist()))
        assert steps <= {(0, 1), (1, 0), (1, 1)}


def test_dtw_finds_a_diagonal_attention_map():
    """Two heads over 6 text rows and 60 frames, row k looking at frames 10k .. 10k + 9, plus noise and a
    third head that looks at frame 0 for every row (standardising over the rows makes it count for nothing)."""
    g = torch.Generator().manual_seed(0)
    w = torch.rand(3, 6, 60, generator=g) * 0.05
    for k in range(6):
        w[:2, k, 10 * k:10 * k + 10] += 1.0
    w[2, :, 0] += 5.0
    w = w / w.sum(-1, keepdim=True)
    matrix, rows, cols = attention_alignment(w)
    assert matrix.shape == (6, 60)
    assert row_spans(rows, cols, 6) == [(10 * k, 10 * k + 9) for k in range(6)]


def test_attention_word_timings_group_tokens_into_words(toks):
    _, text = toks
    ids = text_ids(text, "Good morning, Hello.")
    pieces = [text.decode([i]) for i in ids]
    assert pieces == ["Good", " morning", ",", " H", "ell", "o", "."]  # the tokenisation the expectations use
    P, n, M = 2, len(ids), 8 * (len(ids) + 1)
    cross = torch.full((1, 2, P + n + 1, M), 0.01)  # one layer, 2 heads; rows: prompt, ids, (eos input)
    for k in range(n + 1):  # the query predicting token k (row P - 1 + k) looks at frames 8k .. 8k + 7
        cross[0, :, P - 1 + k, 8 * k:8 * k + 8] = 1.0
    probs = [0.9, 0.8, 0.6, 0.7, 0.5, 0.3, 0.1]
    words, _ = attention_word_timings(list(cross), probs, text, ids, M, TPS, offset=2.0)
    frames = {"Good": (0, 7), "morning,": (8, 23), "Hello.": (24, 55)}
    assert [w.word for w in words] == list(frames)
    for w, (a, b) in zip(words, frames.values()):
        assert w.start == pytest.approx(2.0 + max(a - 0.5, 0) / TPS) and w.end == pytest.approx(2.0 + (b + 0.5) / TPS)
    assert [w.probability for w in words] == pytest.approx([0.9, 0.7, 0.4])  # mean over each word's tokens


def test_word_grouping_and_multibyte_tokens(toks):
    _, text = toks
    assert transcript_words("-- Well, then -- don't go! ...") == [
        ("-- Well,", 0, 8), ("then --", 9, 16), ("don't", 17, 22), ("go! ...", 23, 30)]
    assert transcript_words(" ... -- ") == []
    sample = "Naïve café, über!"
    ids = text_ids(text, sample)
    ends = token_char_ends(text, ids)
    assert ends == sorted(ends) and ends[-1] == len(sample)
    assert all(text.decode(ids[:k + 1]).startswith(sample[:e]) for k, e in enumerate(ends))


def test_segments_break_at_sentences_pauses_and_length():
    def w(word, start, end):
        return WordTiming(word, start, end, 1.0)

    words = [w("One", 0.0, 0.3), w("two.", 0.4, 0.7), w("Three", 0.8, 1.0), w("four", 2.5, 2.8),
             *[w("x" * 20, 3.0 + k, 3.5 + k) for k in range(5)]]
    segments = segment_words(words, max_chars=50, max_gap=1.0)
    assert [s.text for s in segments] == ["One two.", "Three", "four " + "x" * 20 + " " + "x" * 20,
                                          " ".join(["x" * 20] * 2), "x" * 20]
    assert [(s.start, s.end) for s in segments[:2]] == [(0.0, 0.7), (0.8, 1.0)]


# -- formats --------------------------------------------------------------------------------------------
def timed_example() -> TimedTranscript:
    words = [WordTiming("Tom", 0.5, 0.8, 0.9), WordTiming("&", 0.9, 1.0, 0.5), WordTiming("<Jerry>.", 1.0, 1.6, 0.75),
             WordTiming("Later", 3661.25, 3661.5, 1.0)]
    segs = [TimedSegment(0.5, 1.6, "Tom & <Jerry>.", tuple(words[:3])),
            TimedSegment(3661.25, 3661.5, "Later", tuple(words[3:]))]
    return TimedTranscript("Tom & <Jerry>. Later", segs, "ctc", 3662.0)


SRT_CUE = re.compile(r"(\d+)\n(\d{2}):([0-5]\d):([0-5]\d),(\d{3}) --> (\d{2}):([0-5]\d):([0-5]\d),(\d{3})\n"
                     r"((?:[^\n]+\n)+)\n")
VTT_CUE = re.compile(r"(\d{2,}):([0-5]\d):([0-5]\d)\.(\d{3}) --> (\d{2,}):([0-5]\d):([0-5]\d)\.(\d{3})\n"
                     r"((?:[^\n]+\n)+)\n")


def seconds(h, m, s, ms) -> float:
    return int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000


def parse_srt(text: str) -> list[tuple[float, float, str]]:
    """A strict SubRip reader: the whole text must be cues numbered from 1 (no stray line anywhere)."""
    cues, pos = [], 0
    for m in SRT_CUE.finditer(text):
        assert m.start() == pos, f"stray text before cue {m.group(1)}: {text[pos:m.start()]!r}"
        assert int(m.group(1)) == len(cues) + 1
        cues.append((seconds(*m.group(2, 3, 4, 5)), seconds(*m.group(6, 7, 8, 9)), m.group(10)[:-1]))
        pos = m.end()
    assert pos == len(text), f"stray text at the end: {text[pos:]!r}"
    return cues


def parse_vtt(text: str) -> list[tuple[float, float, str]]:
    """A strict WebVTT reader (W3C WebVTT 4.1): the header, then cues whose text holds no raw '<', '&' or
    '-->' (escaped as the spec requires)."""
    assert text.startswith("WEBVTT\n\n")
    cues, pos = [], len("WEBVTT\n\n")
    for m in VTT_CUE.finditer(text, pos):
        assert m.start() == pos, f"stray text: {text[pos:m.start()]!r}"
        body = m.group(9)[:-1]
        assert "-->" not in body and not re.search(r"&(?!amp;|lt;|gt;)|<", body)
        cues.append((seconds(*m.group(1, 2, 3, 4)), seconds(*m.group(5, 6, 7, 8)),
                     body.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")))
        pos = m.end()
    assert pos == len(text)
    return cues


def test_srt_and_vtt_follow_their_specs():
    t = timed_example()
    assert format_timestamp(3661.2504) == "01:01:01,250" and format_timestamp(0.0005, ".") == "00:00:00.001"
    want = [(0.5, 1.6, "Tom & <Jerry>."), (3661.25, 3661.5, "Later")]
    assert parse_srt(to_srt(t.segments)) == want
    assert parse_vtt(to_vtt(t.segments)) == want
    assert to_srt([]) == "" and parse_vtt(to_vtt([])) == []
    long = TimedSegment(0.0, 5.0, " ".join(["word"] * 20), ())
    lines = parse_srt(to_srt([long]))[0][2].split("\n")
    assert len(lines) == 3 and max(map(len, lines)) <= 42 and " ".join(lines) == long.text


def test_srt_and_vtt_read_by_the_reference_packages():
    srt = pytest.importorskip("srt")
    webvtt = pytest.importorskip("webvtt")
    import io

    t = timed_example()
    subs = list(srt.parse(to_srt(t.segments)))
    assert [(s.start.total_seconds(), s.end.total_seconds(), s.content) for s in subs] == \
        [(0.5, 1.6, "Tom & <Jerry>."), (3661.25, 3661.5, "Later")]
    captions = webvtt.from_buffer(io.StringIO(to_vtt(t.segments)))
    assert [(c.start, c.end) for c in captions] == [("00:00:00.500", "00:00:01.600"), ("01:01:01.250", "01:01:01.500")]


def test_json_schema():
    row = transcript_json(timed_example())
    assert set(row) == {"text", "duration", "method", "segments"} and row["method"] == "ctc"
    for seg in row["segments"]:
        assert set(seg) == {"start", "end", "text", "words"}
        assert seg["text"] == " ".join(w["word"] for w in seg["words"])
        for w in seg["words"]:
            assert set(w) == {"word", "start", "end", "probability"}
            assert seg["start"] <= w["start"] <= w["end"] <= seg["end"] and 0 <= w["probability"] <= 1
    assert json.loads(json.dumps(row)) == row


def test_atomic_write_and_output_names(tmp_path):
    target = write_atomic(tmp_path / "a.srt", "one")
    write_atomic(target, "two")
    assert target.read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["a.srt"]  # no temp left
    assert [p.name for p in output_paths(["x/a.wav", "y/a.flac", "b.mp3"], tmp_path, ".vtt")] == \
        ["a.vtt", "a-2.vtt", "b.vtt"]


# -- long audio: absolute times across windows ---------------------------------------------------------------
def fixed_token_model(audio: AudioTokenizer, text: TextTokenizer, token: int, ctc: bool) -> SpeechRecognizer:
    """A tiny model whose decoder says ``token`` whatever it hears (tests/_speech_models.one_token_model's
    trick, here optionally with a CTC head), so every window has a known transcript."""
    torch.manual_seed(0)
    model = SpeechRecognizer(audio, text, preset("tiny"), preset("tiny", cross_attention=True), ctc=ctc).eval()
    with torch.no_grad():
        model.decoder.norm.weight.zero_()
        model.decoder.norm.bias.zero_()
        model.decoder.norm.bias[0] = 1.0
        model.text_embed.token.weight[:, 0] = 0.0
        model.text_embed.token.weight[token, 0] = 5.0
    return model


def speech_like(*parts: tuple[float, bool], seed: int = 0) -> torch.Tensor:
    """(seconds, loud?) parts: a 300 Hz tone with noise where loud, digital silence elsewhere (so that
    split_windows' quietest frame is the last silent one, not a random one)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for sec, loud in parts:
        t = torch.arange(int(sec * SR)) / SR
        out.append(0.3 * torch.sin(2 * torch.pi * 300 * t) + 0.05 * torch.randn(len(t), generator=g) if loud
                   else torch.zeros(len(t)))
    return torch.cat(out)


@pytest.mark.parametrize("ctc", [True, False])
def test_long_audio_keeps_absolute_times(toks, ctc):
    audio, text = toks
    token = text_ids(text, "house")[0]
    model = fixed_token_model(audio, text, token, ctc)
    wave = speech_like((0.2, False), (0.6, True), (0.5, False), (0.6, True), (0.1, False))
    windows = split_windows(wave, SR, 1.2)
    assert len(windows) == 2
    cut = windows[1][0] / SR
    assert 0.8 <= cut <= 1.3  # in the pause
    [timed] = transcribe_timed(model, audio, text, [wave], window_seconds=1.2, max_new_tokens=1)
    assert timed.method == ("ctc" if ctc else "attention") and timed.duration == pytest.approx(2.0)
    first, second = timed.segments
    assert first.text == second.text == text.decode([token]).strip()
    assert 0 <= first.start < first.end <= cut <= second.start < second.end <= 2.0
    assert timed.text == f"{first.text} {second.text}"
    # the second window timed alone, from 0: the same words shifted by the window's start
    [(local, _)] = time_windows(model, audio, text, [wave[windows[1][0]:]], [second.text], [0.0])
    assert [t + cut for w in local for t in (w.start, w.end)] == \
        pytest.approx([t for w in second.words for t in (w.start, w.end)])


# -- omni transcribe end to end ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def export(toks, tmp_path_factory) -> Path:
    audio, text = toks
    model = fixed_token_model(audio, text, text_ids(text, "house")[0], ctc=True)
    return save_pretrained(model, tmp_path_factory.mktemp("ts") / "final",
                           {"builder": "omni.speech:build_speech_recognizer", "encoder": preset("tiny").to_dict(),
                            "decoder": preset("tiny", cross_attention=True).to_dict(), "ctc": True},
                           tokenizers={"audio": audio, "text": text})


def cli(argv, capsys) -> tuple[int, str, str]:
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def test_transcribe_srt_vtt_json_end_to_end(export, tmp_path, capsys):
    a, b = tmp_path / "in" / "a.wav", tmp_path / "b.flac"
    a.parent.mkdir()
    sf.write(a, speech_like((0.3, False), (0.9, True), (0.3, False)).numpy(), SR)
    sf.write(b, speech_like((0.2, False), (0.6, True), (0.2, False), seed=1).numpy(), SR)
    base = ["transcribe", "--checkpoint", str(export), "--device", "cpu", "--max-new-tokens", "1"]
    status, out, err = cli([*base, "--format", "srt", str(a)], capsys)
    assert status == 0, err
    [(start, end, words)] = parse_srt(out)
    assert words == "house" and 0 <= start < end <= 1.5  # where: random CTC weights, tested above

    status, out, err = cli([*base, "--format", "vtt", "--output-dir", str(tmp_path / "subs"),
                            "--alignment", str(tmp_path / "png"), str(a), str(b)], capsys)
    assert status == 0, err
    assert out.splitlines() == [str(tmp_path / "subs" / "a.vtt"), str(tmp_path / "subs" / "b.vtt")]
    assert parse_vtt((tmp_path / "subs" / "b.vtt").read_text())[0][2] == "house"
    for name in ("a", "b"):
        assert (tmp_path / "png" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    status, out, _ = cli([*base, "--format", "json", str(a), str(b)], capsys)
    rows = json.loads(out)
    assert status == 0 and [r["file"] for r in rows] == [str(a), str(b)] and rows[0]["method"] == "ctc"
    assert rows[1]["segments"][0]["words"][0]["word"] == "house" and rows[1]["duration"] == 1.0


def test_transcribe_format_errors_are_one_line(export, tmp_path, capsys, monkeypatch):
    clip = tmp_path / "a.wav"
    sf.write(clip, speech_like((0.5, True)).numpy(), SR)
    base = ["transcribe", "--checkpoint", str(export), "--device", "cpu"]
    status, _, err = cli([*base, "--format", "srt", str(clip), str(clip)], capsys)
    assert status == 2 and err == "omni transcribe: error: --format srt is one document per file: give " \
                                  "--output-dir DIR for 2 files\n"
    (tmp_path / "file").write_text("x")
    status, _, err = cli([*base, "--output-dir", str(tmp_path / "file"), str(clip)], capsys)
    assert status == 2 and err == f"omni transcribe: error: --output-dir {tmp_path / 'file'}: not a directory\n"
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if not installed
    status, _, err = cli([*base, "--alignment", str(tmp_path / "png"), str(clip)], capsys)
    assert status == 2 and err.count("\n") == 1 and 'pip install -e ".[viz]"' in err and "--alignment" in err


def test_cli_format_choices_are_the_writers_formats():
    import argparse

    from omni.cli import build_parser
    from omni.transcript_formats import FORMATS

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert tuple(sub.choices["transcribe"]._option_string_actions["--format"].choices) == FORMATS
