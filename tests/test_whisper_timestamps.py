"""Whisper's timestamp mode on converted models (omni.decoding.TimestampRules, omni.speech.TimestampMode,
timestamp_segments, transcribe_timestamp_tokens, `omni transcribe --timestamps tokens`): the rules mask logits as
openai-whisper's ApplyTimestampRules does in every state of a row's history, greedy decoding gives
whisper.decode(without_timestamps=False)'s tokens (every rule changes them when left out), and segments carry
absolute times across windows. Random O(1) weights (tests/_interop.py), Whisper's real vocabulary."""

from __future__ import annotations

import json

import pytest
import torch

from _interop import o1_weights

from omni.cli import main as omni_main
from omni.decoding import GraphedGreedyDecoder, TimestampRules
from omni.interop import write_export
from omni.interop.whisper import from_openai, text_tokenizer
from omni.pipelines.transcribe import split_windows, transcribe_timestamp_tokens
from omni.speech import SpeechRecognizer, build_speech_recognizer, decode_batch, timestamp_segments
from omni.tokenizers.audio import AudioTokenizer

whisper = pytest.importorskip("whisper")
from whisper.audio import N_FRAMES, N_SAMPLES, log_mel_spectrogram  # noqa: E402
from whisper.decoding import ApplyTimestampRules  # noqa: E402
from whisper.model import ModelDimensions, Whisper  # noqa: E402
from whisper.tokenizer import get_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SMALL = dict(n_mels=80, n_audio_ctx=1500, n_audio_state=64, n_audio_head=4, n_audio_layer=2, n_vocab=51865,
             n_text_ctx=448, n_text_state=64, n_text_head=4, n_text_layer=2)
OPTIONS = whisper.DecodingOptions(temperature=0, without_timestamps=False, language="en", fp16=False)


def openai_model(dims: dict, seed: int) -> Whisper:
    """As tests/test_interop_whisper.py builds its peers: O(1) weights, the token table (the LM head) N(0, 1/d)."""
    return o1_weights(Whisper(ModelDimensions(**dims)), seed,
                      embedding_std=lambda table: table.shape[1] ** -0.5 if table.shape[0] > 50000 else 1,
                      named={"positional_embedding": 1.0})


def omni_model(peer: Whisper, dims: dict) -> SpeechRecognizer:
    config, sd, toks = from_openai(peer.state_dict(), dims)
    model = build_speech_recognizer(config, toks)
    model.load_state_dict(sd, strict=True)
    return model.eval()


def wave(seconds: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = int(seconds * 16000)
    t = torch.arange(n) / 16000
    return 0.1 * torch.randn(n, generator=gen) * (1.2 + torch.sin(2 * torch.pi * 1.3 * t))


def whisper_mel(audio: torch.Tensor) -> torch.Tensor:
    return log_mel_spectrogram(audio, 80, padding=N_SAMPLES)[:, :N_FRAMES]


# ----------------------------------------------------------------------------------------------------
# The rules against ApplyTimestampRules


def histories(tb: int, eot: int, V: int, gen: torch.Generator) -> list[list[int]]:
    """Token histories in every state the rules tell apart: empty (the first step), a first timestamp, a pair, a
    lone (closing) timestamp, text after timestamps, text only, decreasing timestamps (no decoder makes them, the
    rules must still match), timestamps at 0.00 and 30.00, specials."""
    def ts(lo: int = 0, hi: int = 1501) -> int:
        return tb + int(torch.randint(lo, hi, (), generator=gen))

    def text() -> int:
        return int(torch.randint(0, eot, (), generator=gen))

    rows = [[], [ts()], [ts(0, 51)], [ts(), text()], [ts(), ts()], [ts(0, 10), text(), ts(100, 200)],
            [ts(0, 10), text(), ts(100, 200), ts(100, 200)], [text()], [text(), text()], [tb + 1500],
            [tb, text(), tb], [ts(700, 800), text(), ts(10, 20)], [ts(), text(), text(), eot + 3, ts()],
            [text(), ts(), text(), ts(), ts(), text(), text()]]
    for _ in range(40):  # and random mixtures, each token a timestamp or not with probability 1/2
        n = int(torch.randint(0, 9, (), generator=gen))
        rows.append([ts() if float(torch.rand((), generator=gen)) < 0.5 else text() for _ in range(n)])
    return rows


@pytest.mark.parametrize("multilingual", [True, False], ids=["multilingual", "english"])
@pytest.mark.parametrize("max_initial", [50, None])
def test_rules_equal_apply_timestamp_rules(multilingual, max_initial):
    tok = get_tokenizer(multilingual, num_languages=99, language="en" if multilingual else None, task="transcribe")
    V = 51865 if multilingual else 51864
    tb, eot = tok.timestamp_begin, tok.eot
    prompt = list(tok.sot_sequence)  # timestamp mode: no <|notimestamps|>
    theirs = ApplyTimestampRules(tok, len(prompt), max_initial)
    ours = TimestampRules(tb, eot, tok.no_timestamps, max_initial)
    gen = torch.Generator().manual_seed(0)
    rows = histories(tb, eot, V, gen)
    W = 12  # the strategy's token buffer: columns from t on hold anything (here timestamps): never read
    forced = kept = 0
    for t in sorted({len(r) for r in rows}):
        batch = [r for r in rows if len(r) == t]
        N = len(batch)
        logits = torch.randn(N, V, generator=gen) * 2
        logits[:, tb:] += torch.linspace(-6, 6, N)[:, None]  # timestamp mass from far below to far above the text's
        logits[:, torch.randint(0, V, (50,), generator=gen)] = float("-inf")  # as earlier filters leave them
        history = torch.tensor(batch, dtype=torch.long).view(N, t)
        tokens = torch.randint(tb, V, (N, W), generator=gen)
        tokens[:, :t] = history
        expected = logits.clone()
        theirs.apply(expected, torch.cat([torch.tensor(prompt).expand(N, -1), history], 1))
        got = ours(logits.clone(), tokens, torch.tensor(t))
        assert torch.equal(got, expected), f"t={t}: {(got != expected).any(1).nonzero().flatten().tolist()}"
        text_open = expected[:, :tb].isfinite().any(1)
        forced += int((~text_open).sum())
        kept += int(text_open.sum())
    assert forced > 10 and kept > 10  # the probability rule fired on some rows and not on others


def test_rules_keep_fixed_shapes_and_stay_on_the_device():
    """A row's rules depend on its own history only (batch rows are independent) and the filter compiles without
    a graph break (no host sync, so a CUDA graph may replay it)."""
    tok = get_tokenizer(True, num_languages=99, language="en", task="transcribe")
    rules = TimestampRules(tok.timestamp_begin, tok.eot, tok.no_timestamps)
    gen = torch.Generator().manual_seed(1)
    tb = tok.timestamp_begin
    tokens = torch.tensor([[tb + 3, 11, tb + 40, 0], [17, 18, 19, 0], [tb, tb + 9, 5, 0]])
    logits = torch.randn(3, 51865, generator=gen)
    together = rules(logits.clone(), tokens, torch.tensor(2))
    alone = torch.cat([rules(logits[i:i + 1].clone(), tokens[i:i + 1], torch.tensor(2)) for i in range(3)])
    assert torch.equal(together, alone)
    compiled = torch.compile(rules.__call__, fullgraph=True, dynamic=False, backend="eager")
    assert torch.equal(compiled(logits.clone(), tokens, torch.tensor(2)), together)


# ----------------------------------------------------------------------------------------------------
# Greedy decoding against whisper.decode


class Without(TimestampRules):
    """The rules with one of them left out: ``rule`` is pairs, monotonic, start, force or no_timestamps."""

    def __init__(self, rules: TimestampRules, rule: str) -> None:
        super().__init__(rules.timestamp_begin, rules.eos_id, None if rule == "no_timestamps" else
                         rules.no_timestamps_id, rules.max_initial)
        if rule == "force":
            self.force = lambda logits: logits
        elif rule != "no_timestamps":
            setattr(self, rule, lambda vocab, *_: torch.zeros_like(vocab, dtype=torch.bool))


@pytest.fixture(scope="module")
def biased():
    """A random-weight Whisper whose <|notimestamps|> outscores the text token it chooses most (so that its
    suppression decides), converted; two clips (6 s, 21 s) and whisper.decode's timestamp-mode results."""
    peer = openai_model(SMALL, seed=1)
    clips = [wave(6.0, 5), wave(21.0, 6)]
    mel = torch.stack([whisper_mel(c) for c in clips])
    text_tok = text_tokenizer(SMALL["n_vocab"])
    with torch.no_grad():
        first = whisper.decode(peer, mel, OPTIONS)
        words = [t for r in first for t in r.tokens if t < text_tok.eos_id]
        winner = max(set(words), key=words.count)
        table = peer.decoder.token_embedding.weight
        table[text_tok.token_id("<|notimestamps|>")] = 1.2 * table[winner]
        expected = [r.tokens for r in whisper.decode(peer, mel, OPTIONS)]
    return peer, omni_model(peer, SMALL), clips, expected


def test_greedy_timestamp_tokens_equal_whisper_decode(biased, capsys):
    peer, model, clips, expected = biased
    tok = AudioTokenizer(frontend="whisper")
    audio = torch.stack([tok.encode(c).tokens for c in clips])
    mask = torch.ones(audio.shape[:2], dtype=torch.bool)
    mode = model.timestamp_mode()
    tb = mode.timestamp_begin
    assert mode.prompt == model.prompt[:-1] and model.prompt[-1] == model.no_timestamps_id
    with torch.no_grad():
        got = decode_batch(mode, audio, mask)
        memory = model.encode(audio, mask)
        stepped = GraphedGreedyDecoder(mode, **dict(model.decoding.guards), graph=False)(memory, mask)
        rules = mode.rules
        variants = {}
        for rule in ("all", "pairs", "monotonic", "start", "force", "no_timestamps"):
            mode.rules = Without(rules, rule) if rule != "all" else (lambda logits, *_: logits)
            variants[rule] = decode_batch(mode, audio, mask)
        mode.rules = rules
    with capsys.disabled():
        print(f"\ntimestamp mode: lengths {[len(r) for r in got]}, timestamps {[sum(t >= tb for t in r) for r in got]}")
    assert got == expected
    assert stepped == got  # the fixed-shape step a CUDA graph replays applies the same rules
    assert all(sum(t >= tb for t in r) >= 4 for r in got)  # timestamps were chosen, not only the first
    for rule, tokens in variants.items():
        assert tokens != expected, f"leaving out {rule} changed nothing: the test does not exercise it"
    # the model itself keeps decoding without timestamps (its prompt and rules are the export's)
    assert model.prompt[-1] == model.no_timestamps_id
    assert not any(isinstance(f, TimestampRules) for f in model.logit_filters)


# ----------------------------------------------------------------------------------------------------
# Segments


def segments(*args, **kwargs) -> list[tuple[float, float, list[int]]]:
    return [(round(a, 9), round(b, 9), ids) for a, b, ids in timestamp_segments(*args, **kwargs)]


def test_segments_from_tokens():
    tb = 50365
    ids = [tb + 0, 11, 12, tb + 60, tb + 60, 13, tb + 100, tb + 120, 14, 15, tb + 1500]
    assert segments(ids, tb, offset=10.0, duration=25.0) == [
        (10.0, 11.2, [11, 12]), (11.2, 12.0, [13]), (12.4, 35.0, [14, 15])]  # 30.00 clamped to the window
    # text after the last timestamp (the token limit) ends at the window's end
    assert segments([tb + 5, 11, tb + 10, tb + 10, 12], tb, duration=4.0) == [(0.1, 0.2, [11]), (0.2, 4.0, [12])]
    assert segments([11, 12], tb, offset=3.0, duration=2.0) == [(3.0, 5.0, [11, 12])]  # no timestamps at all
    assert segments([tb + 3], tb) == [] and segments([], tb) == []  # nothing said: no segment


def test_two_windows_have_absolute_times(biased):
    peer, model, _, _ = biased
    audio_tok = AudioTokenizer(frontend="whisper")
    text_tok = text_tokenizer(SMALL["n_vocab"])
    clip = wave(41.0, 7)
    windows = split_windows(clip, 16000, 30.0)
    assert len(windows) == 2
    with torch.no_grad():
        result = transcribe_timestamp_tokens(model, audio_tok, text_tok, [clip])[0]
        runs = [whisper.decode(peer, whisper_mel(clip[a:b]), OPTIONS) for a, b in windows]
    tb = model.timestamp_begin
    assert result.method == "tokens" and result.duration == pytest.approx(41.0)
    # whisper's tokens of each window, as segments shifted by the window's start (timestamp_segments itself is
    # checked by hand above): the windows' segments in order, none outside its window
    expected = []
    for (a, b), run in zip(windows, runs):
        mine = timestamp_segments(run.tokens, tb, offset=a / 16000, duration=(b - a) / 16000)
        assert mine and all(a / 16000 <= x <= y <= b / 16000 for x, y, _ in mine)
        expected += [(x, y, text_tok.decode(ids).strip()) for x, y, ids in mine]
    assert [(s.start, s.end, s.text) for s in result.segments] == expected
    assert result.segments[-1].start > windows[1][0] / 16000  # the second window's offset is in its times
    assert result.text == " ".join(text_tok.decode([t for t in run.tokens if t < tb]).strip() for run in runs)
    words = [w for s in result.segments for w in s.words]
    assert words and all(s.start <= w.start <= w.end <= s.end for s in result.segments for w in s.words)


def test_cli_timestamps_tokens(biased, tmp_path, capsys):
    import soundfile as sf

    peer, model, clips, _ = biased
    export = write_export(from_openai(peer.state_dict(), SMALL), tmp_path / "export")
    sf.write(tmp_path / "a.wav", clips[0].numpy(), 16000)
    capsys.readouterr()
    assert omni_main(["transcribe", "--checkpoint", str(export), "--device", "cpu", "--format", "json",
                      "--timestamps", "tokens", str(tmp_path / "a.wav")]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["method"] == "tokens" and rows[0]["segments"]
    # a converted Whisper's default is whisper.transcribe's loop: its segments, times past the clip's end included
    from omni.pipelines.transcribe import read_audio_file

    torch.manual_seed(0)  # what WhisperSeek's default seed gives every file
    with torch.no_grad():  # the WAV's 16-bit samples, as omni read them
        expected = whisper.transcribe(peer, read_audio_file(tmp_path / "a.wav"), language="en", fp16=False,
                                      verbose=None)
    assert [(round(s["start"], 6), round(s["end"], 6), s["text"]) for s in rows[0]["segments"]] == [
        (round(s["start"], 6), round(s["end"], 6), s["text"].strip()) for s in expected["segments"] if s["text"].strip()]
    assert rows[0]["text"] == expected["text"].strip()
    # omni's own prompt (no config prompt): the model was never trained on timestamp tokens, one line says so
    config, sd, toks = from_openai(peer.state_dict(), SMALL)
    plain = write_export(({k: v for k, v in config.items() if k != "prompt"}, sd, toks), tmp_path / "plain")
    assert omni_main(["transcribe", "--checkpoint", str(plain), "--device", "cpu", "--format", "srt",
                      "--timestamps", "tokens", str(tmp_path / "a.wav")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "timestamps from tokens need a converted Whisper" in err, err
