"""Parity of a converted Whisper with openai-whisper beyond one window's greedy tokens (issue #29): beam search
ranked as whisper.decode ranks (omni.decoding.WhisperRanker, a converted Whisper's default ranker) and the long-form
loop (omni.pipelines.transcribe) as whisper.transcribe. Random O(1) weights (tests/_interop.py), Whisper's real
vocabulary; eot's embedding is set near the most chosen token's so that hypotheses finish within a few tokens."""

from __future__ import annotations

import pytest
import torch

from _interop import o1_weights

from omni.decoding import GNMTRanker, WhisperRanker
from omni.interop.whisper import from_openai
from omni.speech import SpeechRecognizer, build_speech_recognizer, decode_batch
from omni.tokenizers.audio import AudioTokenizer

whisper = pytest.importorskip("whisper")
from whisper.audio import N_FRAMES, N_SAMPLES, log_mel_spectrogram  # noqa: E402
from whisper.model import ModelDimensions, Whisper  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SMALL = dict(n_mels=80, n_audio_ctx=1500, n_audio_state=64, n_audio_head=4, n_audio_layer=2, n_vocab=51865,
             n_text_ctx=448, n_text_state=64, n_text_head=4, n_text_layer=2)
EOT = 50257
SAMPLE_LEN = 20  # whisper.decode's sample_len (tokens per window) and omni's max_new_tokens: a fast test


def openai_model(seed: int = 1) -> Whisper:
    return o1_weights(Whisper(ModelDimensions(**SMALL)), seed,
                      embedding_std=lambda table: table.shape[1] ** -0.5 if table.shape[0] > 50000 else 1,
                      named={"positional_embedding": 1.0})


def omni_model(peer: Whisper) -> SpeechRecognizer:
    config, sd, toks = from_openai(peer.state_dict(), SMALL)
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


@pytest.fixture(scope="module")
def ending():
    """A peer whose eot embedding is 0.97 x that of the token it chooses most (hypotheses end after a few tokens,
    no exact ties), its conversion and three clips."""
    peer = openai_model()
    clips = [wave(6.0, 5), wave(21.0, 6), wave(12.0, 3)]
    mel = torch.stack([whisper_mel(c) for c in clips])
    options = whisper.DecodingOptions(temperature=0, without_timestamps=True, language="en", fp16=False,
                                      sample_len=SAMPLE_LEN)
    with torch.no_grad():
        tokens = [t for r in whisper.decode(peer, mel, options) for t in r.tokens]
        table = peer.decoder.token_embedding.weight
        table[EOT] = 0.97 * table[max(set(tokens), key=tokens.count)]
    return peer, omni_model(peer), clips, mel


@pytest.mark.parametrize("timestamps", [False, True], ids=["text", "timestamps"])
def test_beam_search_ranks_as_whisper_decode(ending, timestamps, capsys):
    peer, model, clips, mel = ending
    assert isinstance(model.ranker, WhisperRanker)  # a converted Whisper's default
    tok = AudioTokenizer(frontend="whisper")
    audio = torch.stack([tok.encode(c).tokens for c in clips])
    mask = torch.ones(audio.shape[:2], dtype=torch.bool)
    decoder = model.timestamp_mode() if timestamps else model
    options = whisper.DecodingOptions(temperature=0, beam_size=3, without_timestamps=not timestamps, language="en",
                                      fp16=False, sample_len=SAMPLE_LEN)
    with torch.no_grad():
        expected = [whisper.decode(peer, m, options).tokens for m in mel]  # one at a time: whisper's batched
        got = decode_batch(decoder, audio, mask, beam_size=3, max_new_tokens=SAMPLE_LEN)  # beams break on cross KV
        gnmt = decode_batch(decoder, audio, mask, beam_size=3, max_new_tokens=SAMPLE_LEN,
                            length_penalty=GNMTRanker(1.0))
    with capsys.disabled():
        print(f"\nbeam 3 ({'timestamps' if timestamps else 'text'}): whisper lengths {[len(e) for e in expected]}, "
              f"GNMT's {[len(g) for g in gnmt]}")
    assert any(len(e) < SAMPLE_LEN for e in expected)  # hypotheses finished: the ranking decided
    assert got == expected
    assert gnmt != expected  # GNMT's penalty prefers other (shorter) hypotheses here: the ranker was exercised


# ----------------------------------------------------------------------------------------------------
# whisper.transcribe's long-form loop (omni.pipelines.transcribe.transcribe_whisper)

LONG_LEN = 12  # tokens per window: whisper.transcribe(sample_len=...) and WhisperSeek(sample_len=...)


@pytest.fixture(scope="module")
def plain():
    from omni.interop.whisper import text_tokenizer

    peer = openai_model()
    return peer, omni_model(peer), text_tokenizer(SMALL["n_vocab"])


@pytest.mark.parametrize("seconds,temperature,condition,beam", [
    (5.0, 0.0, True, 1),  # a short clip: the normalised log-mel padded with 0.0, timestamps past the end
    (45.0, 0.0, True, 1),  # a quiet first half: the whole file's normalisation, seek by the last timestamp
    (45.0, 0.0, False, 1),
    (5.0, (0.0, 0.2, 0.4), True, 1),  # fallback: sampled at 0.2 / 0.4 under the same RNG state as whisper
    (5.0, 0.0, True, 2),  # beam search ranked as whisper's
], ids=["5s", "45s-quiet-half", "45s-no-condition", "5s-fallback", "5s-beam2"])
def test_transcribe_equals_whisper_transcribe(plain, seconds, temperature, condition, beam, capsys):
    from omni.pipelines.transcribe import WhisperSeek, transcribe_whisper

    peer, model, text_tok = plain
    clip = wave(seconds, 2)
    if seconds > 40:
        clip[:clip.shape[0] // 2] *= 0.01
    kw = dict(beam_size=beam) if beam > 1 else {}
    with torch.no_grad():
        torch.manual_seed(0)  # what WhisperSeek's default seed gives every file
        expected = whisper.transcribe(peer, clip, temperature=temperature, condition_on_previous_text=condition,
                                      language="en", fp16=False, sample_len=LONG_LEN, verbose=None, **kw)
        torch.manual_seed(1)  # not read: the file draws from its own RNG
        [got] = transcribe_whisper(model, AudioTokenizer(frontend="whisper"), text_tok, [clip],
                                   WhisperSeek(temperature=temperature, condition_on_previous_text=condition,
                                               sample_len=LONG_LEN, beam_size=beam))
    theirs = [(round(s["start"], 6), round(s["end"], 6), s["tokens"], s["temperature"]) for s in expected["segments"]]
    ours = [(round(s["start"], 6), round(s["end"], 6), s["tokens"], s["temperature"]) for s in got.segments]
    with capsys.disabled():
        print(f"\n{seconds:g} s: {len(ours)} segments, starts {[s[0] for s in ours]}, "
              f"temperatures {sorted({s[3] for s in ours})}")
    assert ours == theirs
    assert got.text == expected["text"]
    assert len(theirs) >= 2  # more than one window or segment: the seek rules decided
    if isinstance(temperature, tuple):
        assert any(s[3] > 0 for s in theirs)  # the fallback sampled


@pytest.mark.parametrize("seconds", [75.0])
def test_cli_transcribe_equals_whisper_transcribe(plain, seconds, tmp_path, capsys):
    """`omni transcribe` of a converted Whisper export: whisper.transcribe's text with its defaults (temperature
    fallback 0.0 .. 1.0, conditioning on the previous text), three windows of a file whose first half is quiet;
    --max-new-tokens is whisper's sample_len. A fine-tuned export (config long_form "pauses") keeps omni's windows."""
    import json

    import soundfile as sf

    from omni.cli import main as omni_main
    from omni.interop import write_export

    peer, model, text_tok = plain
    clip = wave(seconds, 4)
    clip[:clip.shape[0] // 2] *= 0.01
    sf.write(tmp_path / "a.wav", clip.numpy(), 16000, subtype="FLOAT")  # the samples exactly
    config, sd, toks = from_openai(peer.state_dict(), SMALL)
    export = write_export((config, sd, toks), tmp_path / "export")
    capsys.readouterr()
    args = ["transcribe", "--checkpoint", str(export), "--device", "cpu", "--format", "json", "--max-new-tokens",
            str(LONG_LEN), str(tmp_path / "a.wav")]
    assert omni_main(args) == 0
    got = json.loads(capsys.readouterr().out)[0]["text"]
    torch.manual_seed(0)  # what WhisperSeek's default seed gives every file
    with torch.no_grad():
        expected = whisper.transcribe(peer, clip, language="en", fp16=False, sample_len=LONG_LEN, verbose=None)
    with capsys.disabled():
        print(f"\n{seconds:g} s through the CLI: {len(expected['segments'])} segments, seeks "
              f"{sorted({s['seek'] for s in expected['segments']})}, temperatures "
              f"{sorted({s['temperature'] for s in expected['segments']})}")
    assert got == expected["text"].strip()
    assert len({s["seek"] for s in expected["segments"]}) >= 3  # three windows or more
    # the same weights recorded as fine-tuned by recipes/whisper.py: omni's pause windows, whisper.decode per window
    tuned = write_export(({**config, "long_form": "pauses"}, sd, toks), tmp_path / "tuned")
    assert omni_main(args[:2] + [str(tuned)] + args[3:]) == 0
    assert json.loads(capsys.readouterr().out)[0]["text"] != got


def test_bad_long_form_is_one_line(plain, tmp_path, capsys):
    import soundfile as sf

    from _interop import cli_error
    from omni.interop import write_export

    peer, _, _ = plain
    config, sd, toks = from_openai(peer.state_dict(), SMALL)
    export = write_export(({**config, "long_form": "sliding"}, sd, toks), tmp_path / "export")
    sf.write(tmp_path / "a.wav", wave(2.0, 1).numpy(), 16000)
    err = cli_error(["transcribe", "--checkpoint", str(export), "--device", "cpu", str(tmp_path / "a.wav")], capsys,
                    prog=None)
    assert "long_form is 'sliding'; expected 'whisper' or 'pauses'" in err, err


# ----------------------------------------------------------------------------------------------------
# Reading a long file in blocks (omni.tokenizers.audio.load_audio_file, read_audio_file)


@pytest.mark.parametrize("subtype,channels,rate", [("PCM_16", 2, 44100), ("FLOAT", 1, 16000), ("PCM_24", 3, 8000)])
def test_block_reading_equals_whole_file(tmp_path, subtype, channels, rate):
    import numpy as np
    import soundfile as sf

    from omni.tokenizers.audio import load_audio, load_audio_file

    gen = np.random.default_rng(0)
    data = (0.3 * gen.standard_normal((rate * 3 + 17, channels))).clip(-1, 1).astype(np.float32)
    sf.write(tmp_path / "a.wav", data, rate, subtype=subtype)
    whole = load_audio(str(tmp_path / "a.wav"), sample_rate=16000, key="a")
    blocks = load_audio_file(tmp_path / "a.wav", sample_rate=16000, key="a", block_frames=4099)  # 30+ blocks
    assert blocks.dtype == whole.dtype and torch.equal(blocks, whole)


def test_block_reading_errors_name_the_file(tmp_path):
    import numpy as np
    import soundfile as sf

    from omni.pipelines.transcribe import read_audio_file

    (tmp_path / "junk.wav").write_bytes(b"RIFF0000WAVEnot audio at all")
    with pytest.raises(ValueError, match=r"junk.wav: cannot decode as audio"):
        read_audio_file(tmp_path / "junk.wav")
    sf.write(tmp_path / "nan.wav", np.array([0.1, np.nan, 0.2], np.float32), 16000, subtype="FLOAT")
    with pytest.raises(ValueError, match=r"nan.wav: cannot decode as audio \(audio contains NaN or inf samples\)"):
        read_audio_file(tmp_path / "nan.wav")
    sf.write(tmp_path / "quiet.wav", np.full(1600, 1e-6, np.float32), 16000, subtype="FLOAT")
    with pytest.raises(ValueError, match=r"quiet.wav: the audio is silent"):
        read_audio_file(tmp_path / "quiet.wav")
