"""Audio tokenizer: log-mel numbers, resampling, decoding, per-token windows, embedder, errors."""

from __future__ import annotations

import io
import json
import math
import warnings

import numpy as np
import pytest
import soundfile as sf
import torch

from omni.segment import Role
from omni.tokenizers.audio import (
    AudioEmbedder,
    AudioTokenizer,
    load_audio,
    log_mel,
    log_mel_floor,
    unfold_tokens,
)
from omni.tokenizers.base import Tokenizer, TypeEmbedding, get_tokenizer

SR = 16000


def sine(freq: float, seconds: float, rate: int, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(round(seconds * rate))) / rate
    return (amp * np.sin(2 * math.pi * freq * t)).astype(np.float32)


def noise(samples: int, seed: int = 0, amp: float = 0.3) -> np.ndarray:
    return (amp * np.random.default_rng(seed).standard_normal(samples)).astype(np.float32)


# -- independent reference: Whisper's log_mel_spectrogram written out in numpy ---------------------
def _slaney_hz_to_mel(f: np.ndarray) -> np.ndarray:
    f = np.asarray(f, dtype=np.float64)
    logstep = math.log(6.4) / 27.0
    return np.where(f < 1000.0, f * 3.0 / 200.0, 15.0 + np.log(np.maximum(f, 1e-9) / 1000.0) / logstep)


def _slaney_mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    logstep = math.log(6.4) / 27.0
    return np.where(m < 15.0, m * 200.0 / 3.0, 1000.0 * np.exp(logstep * (m - 15.0)))


def _mel_centres_hz(n_mels: int = 80, sr: int = SR) -> np.ndarray:
    pts = _slaney_mel_to_hz(np.linspace(0.0, _slaney_hz_to_mel(sr / 2), n_mels + 2))
    return pts


def reference_log_mel(x: np.ndarray, n_fft: int = 400, hop: int = 160, n_mels: int = 80) -> np.ndarray:
    """librosa-style Slaney filters, periodic Hann, reflect-centred STFT, Whisper normalisation."""
    pad = n_fft // 2
    xp = np.pad(x.astype(np.float64), (pad, pad), mode="reflect")
    frames = 1 + len(x) // hop
    window = 0.5 - 0.5 * np.cos(2 * math.pi * np.arange(n_fft) / n_fft)
    stft = np.stack([np.fft.rfft(xp[i * hop : i * hop + n_fft] * window) for i in range(frames)], axis=1)
    power = np.abs(stft) ** 2  # (n_fft//2+1, frames)
    fft_freqs = np.linspace(0, SR / 2, n_fft // 2 + 1)
    mel_f = _mel_centres_hz(n_mels)
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_freqs[None, :]
    weights = np.maximum(0, np.minimum(-ramps[:-2] / fdiff[:-1, None], ramps[2:] / fdiff[1:, None]))
    weights *= (2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels]))[:, None]
    logs = np.log10(np.maximum(weights @ power, 1e-10))
    logs = np.maximum(logs, logs.max() - 8.0)
    return (logs + 4.0) / 4.0


def expected_mel_bin(freq: float) -> int:
    """Filter whose centre (Slaney scale) is nearest to ``freq``."""
    return int(np.argmin(np.abs(_mel_centres_hz()[1:-1] - freq)))


# -- log-mel ---------------------------------------------------------------------------------------
def test_log_mel_shape_one_second_and_batched() -> None:
    x = torch.from_numpy(noise(SR))
    mel = log_mel(x)
    assert mel.shape == (80, 101)  # centred STFT: 1 + 16000 // 160
    assert mel.dtype == torch.float32
    batch = torch.stack([x, 0.1 * x, torch.from_numpy(noise(SR, seed=1))])
    mb = log_mel(batch)
    assert mb.shape == (3, 80, 101)
    for i in range(3):  # normalisation is per clip, not per batch
        torch.testing.assert_close(mb[i], log_mel(batch[i]), rtol=0, atol=1e-5)
    assert log_mel(torch.zeros(100)).shape == (80, 1)  # shorter than the reflect pad still works


def test_log_mel_matches_whisper_reference_and_range() -> None:
    x = noise(SR // 2)
    x[4000:] = 0.0  # a silent tail reaches the 80 dB floor
    mel = log_mel(torch.from_numpy(x)).numpy()
    ref = reference_log_mel(x)
    np.testing.assert_allclose(mel, ref, atol=2e-4)
    top = mel.max()
    assert np.isclose(mel.min(), top - 2.0, atol=1e-6)  # floor = max - 8 in log10 units, /4
    assert (np.abs(mel - (top - 2.0)) < 1e-6).sum() > 500
    assert float(log_mel_floor(torch.from_numpy(mel))) == pytest.approx(top - 2.0, abs=1e-6)
    # silence: everything clamps to log10(1e-10) -> (-10 + 4) / 4
    silent = log_mel(torch.zeros(SR))
    assert torch.all(silent == -1.5)
    assert float(log_mel_floor(silent)) == -1.5


def test_sine_energy_lands_in_expected_mel_bin() -> None:
    mel = log_mel(torch.from_numpy(sine(1000.0, 1.0, SR)))
    assert expected_mel_bin(1000.0) == 26
    assert int(mel.mean(dim=1).argmax()) == 26


# -- resampling, downmix, PCM ------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [44100, 8000])
def test_resampling_token_count_and_sine_bin(rate: int) -> None:
    tok = AudioTokenizer()
    seg = tok.encode((sine(1000.0, 1.0, rate), rate), key="s")
    assert seg.meta == {"seconds": 1.0, "frames": 101}
    assert seg.tokens.shape == (51, 400)
    wave = tok.waveform((sine(1000.0, 1.0, rate), rate))
    assert wave.shape == (SR,)
    assert float(wave[2000:-2000].pow(2).mean().sqrt()) == pytest.approx(0.5 / math.sqrt(2), rel=0.01)
    centre = seg.tokens.reshape(51, 80, 5)[:, :, 2]  # the window's centre frame
    assert int(centre[2:-2].mean(dim=0).argmax()) == expected_mel_bin(1000.0)
    # odd lengths: ceil(n * 16000 / rate) samples, 1 + samples // 160 frames, ceil(frames / 2) tokens
    n_in = 16317
    seg = tok.encode((noise(n_in), rate))
    samples = math.ceil(n_in * SR / rate)
    assert seg.meta["frames"] == 1 + samples // 160
    assert len(seg) == tok.num_tokens(samples) == math.ceil(seg.meta["frames"] / 2)


def test_stereo_downmix_equals_mono_of_mean() -> None:
    tok = AudioTokenizer()
    left, right = sine(440.0, 0.5, 22050), noise(11025, seed=3)
    mono = tok.encode(((left + right) / 2, 22050)).tokens
    np_stereo = tok.encode((np.stack([left, right], axis=1), 22050)).tokens  # numpy: (samples, channels)
    th_stereo = tok.encode((torch.from_numpy(np.stack([left, right])), 22050)).tokens  # torch: (channels, samples)
    torch.testing.assert_close(np_stereo, mono, rtol=0, atol=1e-5)
    torch.testing.assert_close(th_stereo, mono, rtol=0, atol=1e-5)


def test_integer_pcm_is_scaled() -> None:
    pcm = (noise(SR // 4, seed=4) * 30000).clip(-32768, 32767).astype(np.int16)
    torch.testing.assert_close(load_audio(pcm), torch.from_numpy(pcm.astype(np.float32) / 32768.0))
    torch.testing.assert_close(load_audio(torch.from_numpy(pcm)), torch.from_numpy(pcm / 32768.0).float())
    assert float(load_audio(np.array([-32768], dtype=np.int16))[0]) == -1.0
    assert float(load_audio(np.array([2**31 - 1, -(2**31)], dtype=np.int32))[1]) == -1.0
    np.testing.assert_array_equal(load_audio(np.array([0, 128, 255], dtype=np.uint8)).numpy(), [-1.0, 0.0, 127 / 128])
    tok = AudioTokenizer()
    torch.testing.assert_close(tok.encode(pcm).tokens, tok.encode(pcm.astype(np.float32) / 32768.0).tokens)


# -- decoding --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_encoded_bytes_round_trip(fmt: str, tmp_path) -> None:
    rate = 22050
    pcm = (np.stack([sine(300.0, 0.4, rate), noise(int(0.4 * rate), seed=5)], axis=1) * 32767).astype(np.int16)
    buf = io.BytesIO()
    sf.write(buf, pcm, rate, format=fmt, subtype="PCM_16")  # 16-bit PCM: lossless for int16 input
    data = buf.getvalue()
    tok = AudioTokenizer()
    expected = tok.encode((pcm, rate), key="x")
    for raw in (data, bytearray(data), {"bytes": data, "path": None}):
        seg = tok.encode(raw, key="x")
        torch.testing.assert_close(seg.tokens, expected.tokens, rtol=0, atol=0)
        assert seg.meta == expected.meta
    path = tmp_path / f"clip.{fmt.lower()}"
    path.write_bytes(data)
    for raw in (path, str(path), {"path": str(path)}):
        torch.testing.assert_close(tok.encode(raw).tokens, expected.tokens, rtol=0, atol=0)
    hf = {"array": pcm.astype(np.float32) / 32768.0, "sampling_rate": rate}
    torch.testing.assert_close(tok.encode(hf).tokens, expected.tokens, rtol=0, atol=0)


# -- per-token windows -----------------------------------------------------------------------------
@pytest.mark.parametrize(("kernel", "stride"), [(5, 2), (3, 1), (4, 3), (1, 2)])
def test_unfold_matches_manual_loop(kernel: int, stride: int) -> None:
    mel = torch.from_numpy(np.random.default_rng(7).standard_normal((6, 11)).astype(np.float32))
    pad = -0.75
    out = unfold_tokens(mel, kernel, stride, pad_value=pad)
    n = math.ceil(11 / stride)
    assert out.shape == (n, 6 * kernel)
    expected = torch.full((n, 6, kernel), pad)
    for i in range(n):
        for j in range(kernel):
            f = stride * i - kernel // 2 + j
            if 0 <= f < 11:
                expected[i, :, j] = mel[:, f]
    torch.testing.assert_close(out, expected.reshape(n, 6 * kernel), rtol=0, atol=0)


def test_unfold_default_pad_is_clip_floor_and_batches() -> None:
    mels = log_mel(torch.from_numpy(np.stack([noise(3000, seed=8), 0.01 * noise(3000, seed=9)])))
    out = unfold_tokens(mels)  # (2, n, 400)
    for b in range(2):
        single = unfold_tokens(mels[b])
        torch.testing.assert_close(out[b], single, rtol=0, atol=0)
        first = single[0].reshape(80, 5)
        floor = max(float(mels[b].max()) - 2.0, -1.5)  # the quiet clip never goes below log10(1e-10)
        assert floor == ([float(mels[0].max()) - 2.0, -1.5][b])
        assert torch.allclose(first[:, :2], torch.full((80, 2), floor), atol=1e-6)  # frames -2, -1
        torch.testing.assert_close(first[:, 2:], mels[b][:, :3], rtol=0, atol=0)


def test_encode_segment_contract() -> None:
    tok = AudioTokenizer()
    x = noise(12345, seed=10)
    seg = tok.encode(x, key="k")  # a bare array is taken at the tokenizer's 16 kHz
    assert seg.modality == "audio" and seg.role is Role.BIDIRECTIONAL
    assert seg.tokens.dtype == torch.float32 and seg.tokens.shape == (39, 400)  # 1 + 12345//160 = 78 frames
    assert seg.positions.dtype == torch.int64
    torch.testing.assert_close(seg.positions, torch.arange(39))
    assert seg.meta == {"seconds": 12345 / SR, "frames": 78}
    torch.testing.assert_close(seg.tokens, unfold_tokens(log_mel(torch.from_numpy(x))), rtol=0, atol=0)
    silent = tok.encode(np.zeros(SR, dtype=np.float32))  # silence is valid here
    assert torch.all(silent.tokens == -1.5)
    assert len(tok.encode(np.zeros(1, dtype=np.float32))) == 1
    assert tok.tokens_per_second == 50.0 and tok.max_tokens == 1501


def test_embedder_is_per_token() -> None:
    tok = AudioTokenizer()
    torch.manual_seed(0)
    emb = tok.embedder(32)
    assert isinstance(emb, AudioEmbedder) and isinstance(emb.type_embedding, TypeEmbedding)
    a, b = tok.encode(noise(8000, seed=11)).tokens, tok.encode(noise(3200, seed=12)).tokens
    packed = torch.cat([a, b])
    out = emb(packed)
    assert out.shape == (26 + 11, 32)
    torch.testing.assert_close(out, torch.cat([emb(a), emb(b)]), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        emb.type_embedding.weight.fill_(1.0)
    torch.testing.assert_close(emb(a) - 1.0, emb.out_proj(emb.act(emb.in_proj(a))), rtol=0, atol=1e-6)


# -- errors ----------------------------------------------------------------------------------------
def test_errors_name_the_key() -> None:
    tok = AudioTokenizer()
    with pytest.raises(ValueError, match=r"'bad'.*could not decode.*WAV, FLAC"):
        tok.encode(b"RIFF\x00\x00not really a wave file", key="bad")
    with pytest.raises(ValueError, match=r"'e0'.*0 bytes"):
        tok.encode(b"", key="e0")
    with pytest.raises(ValueError, match=r"'empty'.*empty"):
        tok.encode(np.zeros(0, dtype=np.float32), key="empty")
    with pytest.raises(ValueError, match=r"'empty2'.*empty"):
        tok.encode(torch.zeros(2, 0), key="empty2")
    for bad in (np.nan, np.inf):
        x = noise(1000)
        x[10] = bad
        with pytest.raises(ValueError, match=r"'nan'.*NaN or inf"):
            tok.encode(x, key="nan")
    with pytest.raises(ValueError, match=r"'nd'.*1-D.*shape \(1, 2, 100\)"):
        tok.encode(np.zeros((1, 2, 100), dtype=np.float32), key="nd")
    with pytest.raises(ValueError, match=r"'flip'.*transpose"):
        tok.encode(np.zeros((2, 16000), dtype=np.float32), key="flip")  # numpy wants (samples, channels)
    for rate in (0, -16000, 22050.5):
        with pytest.raises(ValueError, match=r"'sr'.*sample rate"):
            tok.encode((noise(100), rate), key="sr")
    with pytest.raises(TypeError, match=r"'dt'.*int64"):
        tok.encode(np.zeros(100, dtype=np.int64), key="dt")
    with pytest.raises(TypeError, match=r"'ty'.*unsupported input"):
        tok.encode(12, key="ty")
    with pytest.raises(ValueError, match=r"'nofile'.*no audio file"):
        tok.encode("/nonexistent/clip.wav", key="nofile")


def test_max_seconds_error_and_truncate() -> None:
    x = noise(int(2.5 * 8000), seed=13)
    with pytest.raises(ValueError, match=r"'long'.*2\.50 s.*max_seconds=2"):
        AudioTokenizer(max_seconds=2.0).encode((x, 8000), key="long")
    tok = AudioTokenizer(max_seconds=2.0, truncation="truncate")
    with pytest.warns(UserWarning, match=r"'long'.*truncated"):
        seg = tok.encode((x, 8000), key="long")
    assert seg.meta["seconds"] == 2.0 and len(seg) == tok.max_tokens == 101
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exactly max_seconds is fine, also at 44.1 kHz
        assert len(AudioTokenizer(max_seconds=2.0).encode((noise(88200), 44100))) == 101
    with pytest.raises(ValueError, match="truncation"):
        AudioTokenizer(truncation="drop")  # type: ignore[arg-type]


def test_config_save_load_round_trip(tmp_path) -> None:
    tok = AudioTokenizer(n_mels=64, kernel=3, stride=1, max_seconds=10, truncation="truncate")
    cfg = tok.config()
    assert json.loads(json.dumps(cfg)) == cfg
    assert cfg == {
        "sample_rate": 16000, "n_mels": 64, "n_fft": 400, "hop_length": 160,
        "kernel": 3, "stride": 1, "max_seconds": 10.0, "truncation": "truncate",
    }
    tok.save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    assert type(loaded) is AudioTokenizer and loaded.config() == cfg
    assert get_tokenizer("audio") is AudioTokenizer
    x = noise(4000, seed=14)
    a, b = tok.encode(x), loaded.encode(x)
    assert a.tokens.shape == (26, 192)
    torch.testing.assert_close(a.tokens, b.tokens, rtol=0, atol=0)
