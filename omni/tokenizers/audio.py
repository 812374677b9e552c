"""Audio tokenizer: any audio in, Whisper-style log-mel tokens out.

Pipeline (CPU side, ``encode``):
  decode (bytes / file / array) -> float32 in [-1, 1] -> downmix (mean over channels)
  -> optional truncation -> resample to ``sample_rate`` (16 kHz) -> log-mel (80 bins,
  25 ms window, 10 ms hop, Whisper normalisation) -> per-token windows of ``kernel`` frames
  every ``stride`` frames (50 tokens/s by default).

Whisper's stem is two convolutions (k=3, s=1 then k=3, s=2): each output sees 5 mel frames
centred on an even frame. The trunk here sees PACKED tokens (many clips concatenated), where
a convolution along dim 0 would leak across clips, so the stem is expressed per token instead:
``encode`` cuts the 5-frame windows out itself (``unfold_tokens``) and the embedder is a
per-token MLP over the flattened window: same receptive field, same 50 Hz output rate.

Whisper's front-end (``frontend="whisper"``), for checkpoints converted from Whisper (omni.interop.whisper): the
log-mel whisper.transcribe feeds its decoder: the waveform padded with ``max_seconds`` (30 s) of zeros, STFT with
the last centred frame dropped (n // hop_length frames), normalised over all of it, the first 3,000 frames kept
(``whisper_log_mel``). Tokens are pairs of frames, (1500, 2 * n_mels): a reshape, not an unfold, so that one
token is one output of Whisper's stride-2 conv stem (``ConvStem``: conv k3 -> GELU -> conv k3 stride 2 -> GELU,
zero padding at the edges), and a key-padding mask over tokens is also the mask over the encoder's output.
The stem reads neighbouring tokens, so it needs padded batches (B, S, 2 * n_mels), not packed ones.

Array layouts (documented because numpy and torch conventions differ):
  * numpy 2-D arrays are (samples, channels), as ``soundfile.read`` returns them;
  * torch 2-D tensors are (channels, samples), as ``torchaudio.load`` returns them;
  * 1-D arrays/tensors are mono (samples,);
  * a bare array/tensor (no rate given) is assumed to be at the tokenizer's ``sample_rate``.
"""

from __future__ import annotations

import functools
import io
import math
import numbers
import os
import warnings
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torchaudio
from torch import Tensor, nn

from omni.segment import Role, Segment
from omni.tokenizers.base import (NotARegularFileError, Tokenizer, TypeEmbedding, open_regular_file,
                                  register_tokenizer)

__all__ = [
    "AudioEmbedder",
    "AudioTokenizer",
    "ClipTooLong",
    "ConvStem",
    "frame_pairs",
    "load_audio",
    "load_audio_file",
    "log_mel",
    "log_mel_floor",
    "unfold_tokens",
    "whisper_file_log_mel",
    "whisper_log_mel",
]

# Whisper normalisation constants (whisper/audio.py::log_mel_spectrogram).
_MEL_CLAMP = 1e-10  # power floor before log10
_DYNAMIC_RANGE = 8.0  # log10 units kept below the clip's maximum (80 dB)
_OFFSET = 4.0
_SCALE = 4.0
# Lowest value log_mel can output: a silent clip, log10(1e-10) normalised.
_ABSOLUTE_FLOOR = (math.log10(_MEL_CLAMP) + _OFFSET) / _SCALE  # -1.5

SUPPORTED_FORMATS = "WAV, FLAC, OGG (Vorbis/Opus), MP3, AIFF and the other formats libsndfile reads"

Truncation = Literal["error", "truncate"]
FrontEnd = Literal["windows", "whisper"]  # omni's overlapping 5-frame windows | Whisper's 30 s frames

# Integer PCM scaling to [-1, 1]; 8-bit PCM (WAV) is unsigned with 128 as silence.
_INT_PCM: dict[Any, tuple[float, float]] = {
    np.dtype(np.int8): (0.0, 128.0),
    np.dtype(np.uint8): (128.0, 128.0),
    np.dtype(np.int16): (0.0, 32768.0),
    np.dtype(np.int32): (0.0, 2147483648.0),
}
_TORCH_INT_TO_NUMPY = {torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32}

# A numpy/torch layout mix-up turns (2, 16000) into 16000 "channels"; no real recording has
# this many channels *and* more channels than samples, so that shape is reported, not averaged.
_MAX_PLAUSIBLE_CHANNELS = 64


class ClipTooLong(ValueError):
    """A clip longer than the tokenizer's ``max_seconds`` under ``truncation="error"``: a caller that drops
    such clips (a cut clip would not match its transcript) catches this type."""


# ---------------------------------------------------------------------------------------------
# Features: log-mel and per-token windows (usable batched, on any device)
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _mel_transform(
    sample_rate: int, n_fft: int, hop_length: int, n_mels: int, device: str
) -> torchaudio.transforms.MelSpectrogram:
    # Cached per device: building the filterbank each call would dominate short clips.
    return torchaudio.transforms.MelSpectrogram(
        sample_rate=sample_rate,
        n_fft=n_fft,
        win_length=n_fft,
        hop_length=hop_length,
        n_mels=n_mels,
        power=2.0,
        center=True,
        pad_mode="reflect",
        norm="slaney",  # Whisper's filters come from librosa: Slaney scale and area norm
        mel_scale="slaney",
    ).to(device)


def log_mel(
    waveform: Tensor,
    *,
    sample_rate: int = 16000,
    n_fft: int = 400,
    hop_length: int = 160,
    n_mels: int = 80,
) -> Tensor:
    """Whisper-normalised log-mel spectrogram.

    waveform: (..., samples) float, already at ``sample_rate``; any device, any batch shape.
    Returns (..., n_mels, frames) float32 with frames = 1 + samples // hop_length (centred STFT).
    Normalisation is per clip (over the last two dims): log10(clamp(mel, 1e-10)), floored at
    the clip maximum minus 8, then (x + 4) / 4; values lie in [max - 2, max] with max <= ~1.
    """
    if not waveform.is_floating_point():
        raise TypeError(f"log_mel expects a floating-point waveform, got {waveform.dtype}")
    samples = waveform.shape[-1]
    if samples == 0:
        raise ValueError("log_mel got a waveform with 0 samples")
    x = waveform.float()
    frames = 1 + samples // hop_length
    # Reflect padding (center=True) needs more than n_fft // 2 samples; zero-pad tiny clips and
    # keep only the frames the unpadded clip would have produced.
    min_len = n_fft // 2 + 1
    if samples < min_len:
        x = torch.nn.functional.pad(x, (0, min_len - samples))
    mel = _mel_transform(sample_rate, n_fft, hop_length, n_mels, str(x.device))(x)[..., :frames]
    return _normalise(mel)


def _normalise(mel: Tensor) -> Tensor:
    """Whisper's normalisation of mel power (..., n_mels, frames), per clip over the last two dims."""
    logs = torch.clamp(mel, min=_MEL_CLAMP).log10()
    peak = logs.amax(dim=(-2, -1), keepdim=True)
    logs = torch.maximum(logs, peak - _DYNAMIC_RANGE)
    return (logs + _OFFSET) / _SCALE


def whisper_log_mel(
    waveform: Tensor,
    *,
    sample_rate: int = 16000,
    n_fft: int = 400,
    hop_length: int = 160,
    n_mels: int = 80,
    seconds: float = 30.0,
) -> Tensor:
    """The log-mel whisper.transcribe gives its decoder for a clip of at most ``seconds``:
    ``log_mel_spectrogram(audio, n_mels, padding=N_SAMPLES)[:, :N_FRAMES]``.

    waveform (..., samples) at ``sample_rate`` -> (..., n_mels, seconds * sample_rate // hop_length). In
    Whisper's order: the waveform is padded with ``seconds`` of zeros, the centred STFT (reflect padding, a
    periodic Hann window of n_fft) loses its last frame, the normalisation takes the maximum over every frame of
    the padded clip, and only then is the mel cut to the chunk. The filters are torchaudio's Slaney mel
    filterbank, equal to Whisper's shipped mel_filters.npz (librosa's) within 2e-7.
    """
    if not waveform.is_floating_point():
        raise TypeError(f"whisper_log_mel expects a floating-point waveform, got {waveform.dtype}")
    if waveform.shape[-1] == 0:
        raise ValueError("whisper_log_mel got a waveform with 0 samples")
    chunk = int(round(seconds * sample_rate))
    mel = whisper_file_log_mel(waveform, sample_rate=sample_rate, n_fft=n_fft, hop_length=hop_length,
                               n_mels=n_mels, seconds=seconds)  # the clip is a file of at most one window
    return mel[..., : chunk // hop_length]


def whisper_file_log_mel(
    waveform: Tensor,
    *,
    sample_rate: int = 16000,
    n_fft: int = 400,
    hop_length: int = 160,
    n_mels: int = 80,
    seconds: float = 30.0,
) -> Tensor:
    """whisper.transcribe's log-mel of a whole file: ``log_mel_spectrogram(audio, n_mels, padding=N_SAMPLES)``,
    (..., n_mels, (samples + seconds * sample_rate) // hop_length), normalised over the WHOLE file (its loudest
    frame sets the floor of every window); whisper.transcribe slices windows from it and pads them with 0.0."""
    if not waveform.is_floating_point():
        raise TypeError(f"whisper_file_log_mel expects a floating-point waveform, got {waveform.dtype}")
    chunk = int(round(seconds * sample_rate))
    x = torch.nn.functional.pad(waveform.float(), (0, chunk))
    return _normalise(_mel_transform(sample_rate, n_fft, hop_length, n_mels, str(x.device))(x)[..., :-1])


def frame_pairs(mel: Tensor) -> Tensor:
    """(..., n_mels, frames) with an even frame count -> (..., frames / 2, 2 * n_mels): token i holds
    frames 2i and 2i + 1, time-major (``ConvStem`` reads them back as frames)."""
    n_mels, frames = mel.shape[-2], mel.shape[-1]
    if frames % 2:
        raise ValueError(f"frame_pairs needs an even number of frames, got {frames}")
    return mel.transpose(-1, -2).reshape(*mel.shape[:-2], frames // 2, 2 * n_mels)


def log_mel_floor(mel: Tensor) -> Tensor:
    """The lowest value ``log_mel`` can give each clip: max - 2 (80 dB down), never below -1.5.

    mel: (..., n_mels, frames) normalised log-mel; returns (...,) per clip. This is what
    silence/padding maps to, so it is the value windows are padded with at the clip edges.
    """
    return torch.clamp(mel.amax(dim=(-2, -1)) - _DYNAMIC_RANGE / _SCALE, min=_ABSOLUTE_FLOOR)


def unfold_tokens(
    mel: Tensor, kernel: int = 5, stride: int = 2, pad_value: float | Tensor | None = None
) -> Tensor:
    """Cut a log-mel into per-token windows (the per-token form of a conv stem).

    mel: (..., n_mels, frames). Token i holds frames stride*i - kernel//2 ... stride*i - kernel//2
    + kernel - 1 (for odd kernels: centred on frame stride*i), frames outside the clip replaced
    by ``pad_value`` (default: the clip's ``log_mel_floor``; a scalar or a (...,) tensor).
    Returns (..., n, n_mels * kernel) with n = ceil(frames / stride); each token is the
    (n_mels, kernel) window flattened mel-major, the layout of a Conv1d weight (out, in, k).
    """
    if kernel < 1 or stride < 1:
        raise ValueError(f"kernel and stride must be >= 1, got kernel={kernel}, stride={stride}")
    if mel.dim() < 2:
        raise ValueError(f"unfold_tokens expects (..., n_mels, frames), got shape {tuple(mel.shape)}")
    n_mels, frames = mel.shape[-2], mel.shape[-1]
    if frames == 0:
        raise ValueError("unfold_tokens got a log-mel with 0 frames")
    if pad_value is None:
        pad = log_mel_floor(mel)
    else:
        pad = torch.as_tensor(pad_value, dtype=mel.dtype, device=mel.device)
    pad = pad.reshape(*pad.shape, 1, 1)  # broadcast over (n_mels, pad frames)
    left = kernel // 2
    right = kernel - 1 - left
    lead = mel.shape[:-1]
    padded = torch.cat([pad.expand(*lead, left), mel, pad.expand(*lead, right)], dim=-1)
    windows = padded.unfold(-1, kernel, stride)  # (..., n_mels, n, kernel)
    n = windows.shape[-2]
    return windows.transpose(-3, -2).reshape(*mel.shape[:-2], n, n_mels * kernel)


# ---------------------------------------------------------------------------------------------
# Decoding raw inputs to a mono float waveform
# ---------------------------------------------------------------------------------------------
def _where(key: str) -> str:
    return f"audio sample {key!r}"


def _check_rate(rate: Any, key: str) -> int:
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
        raise TypeError(f"{_where(key)}: sample rate must be a positive integer, got {rate!r}")
    if not math.isfinite(float(rate)) or rate <= 0:
        raise ValueError(f"{_where(key)}: sample rate must be a positive integer, got {rate!r}")
    if float(rate) != int(rate):
        raise ValueError(f"{_where(key)}: sample rate must be a whole number of Hz, got {rate!r}")
    return int(rate)


def _reason(exc: Exception) -> str:
    # libsndfile's own words, without soundfile's "Error opening <_io.BytesIO object at 0x...>: "
    return str(getattr(exc, "error_string", None) or exc)


def _decode_bytes(data: bytes | bytearray | memoryview, key: str) -> tuple[np.ndarray, int]:
    if len(data) == 0:
        raise ValueError(f"{_where(key)}: got 0 bytes; expected an encoded audio file ({SUPPORTED_FORMATS})")
    import soundfile as sf  # lazy: only decoding needs libsndfile (importing omni works without it)

    try:
        array, rate = sf.read(io.BytesIO(bytes(data)), dtype="float32", always_2d=True)
    except Exception as exc:  # libsndfile reports bad data as RuntimeError, TypeError or ValueError
        raise ValueError(
            f"{_where(key)}: could not decode {len(data)} bytes as audio ({_reason(exc)}); "
            f"supported formats: {SUPPORTED_FORMATS}"
        ) from exc
    return array, int(rate)


def _decode_path(path: str | os.PathLike, key: str) -> tuple[np.ndarray, int]:
    try:
        fh = open_regular_file(path)  # a FIFO or device would block libsndfile's open() or read() forever
    except FileNotFoundError as exc:
        raise ValueError(f"{_where(key)}: no audio file at {os.fspath(path)!r}") from exc
    except NotARegularFileError as exc:
        raise ValueError(f"{_where(key)}: {exc.path!r} is {exc.kind}, not an audio file") from exc
    except OSError as exc:
        raise ValueError(f"{_where(key)}: cannot read audio file {os.fspath(path)!r}: {exc.strerror or exc}") from exc
    import soundfile as sf

    try:
        with fh:
            array, rate = sf.read(fh, dtype="float32", always_2d=True)
    except Exception as exc:  # see _decode_bytes
        raise ValueError(
            f"{_where(key)}: could not decode {os.fspath(path)!r} as audio ({_reason(exc)}); "
            f"supported formats: {SUPPORTED_FORMATS}"
        ) from exc
    return array, int(rate)


def _unpack(raw: Any, key: str, default_rate: int) -> tuple[np.ndarray | Tensor, Any]:
    """Split a raw input into (array or tensor, sample rate) without converting it."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return _decode_bytes(raw, key)
    if isinstance(raw, (str, os.PathLike)):
        return _decode_path(raw, key)
    if isinstance(raw, dict):
        # Hugging Face `Audio` features: decoded {"array", "sampling_rate"} or raw {"bytes", "path"}.
        if "array" in raw:
            if "sampling_rate" not in raw:
                raise ValueError(f"{_where(key)}: dict with 'array' needs a 'sampling_rate'")
            return _unpack((raw["array"], raw["sampling_rate"]), key, default_rate)
        if raw.get("bytes") is not None:
            return _decode_bytes(raw["bytes"], key)
        if raw.get("path") is not None:
            return _decode_path(raw["path"], key)
        raise ValueError(
            f"{_where(key)}: dict input needs 'array' + 'sampling_rate', 'bytes' or 'path'; "
            f"got keys {sorted(raw)}"
        )
    if isinstance(raw, (tuple, list)) and len(raw) == 2 and isinstance(raw[0], (np.ndarray, Tensor)):
        return raw[0], raw[1]
    if isinstance(raw, (np.ndarray, Tensor)):
        return raw, default_rate
    raise TypeError(
        f"{_where(key)}: unsupported input {type(raw).__name__}; expected encoded bytes, a file path, "
        "a numpy array (samples[, channels]), a torch tensor ([channels,] samples), "
        "an (array, sample_rate) tuple or a {'array', 'sampling_rate'} dict"
    )


def _to_float(array: np.ndarray | Tensor, key: str) -> Tensor:
    """float32 tensor, integer PCM scaled to [-1, 1]; same shape as the input."""
    if isinstance(array, Tensor):
        t = array.detach().cpu()
        if t.is_floating_point():
            return t.float()
        if t.dtype not in _TORCH_INT_TO_NUMPY:
            raise TypeError(
                f"{_where(key)}: audio tensor dtype {t.dtype} not supported; use float in [-1, 1] "
                "or integer PCM (int8, uint8, int16, int32)"
            )
        array = t.numpy()
    dtype = array.dtype
    if np.issubdtype(dtype, np.floating):
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    if dtype in _INT_PCM:
        offset, scale = _INT_PCM[dtype]
        # float64 keeps int32 PCM exact before the final float32 rounding.
        return torch.from_numpy(((array.astype(np.float64) - offset) / scale).astype(np.float32))
    raise TypeError(
        f"{_where(key)}: audio array dtype {dtype} not supported; use float in [-1, 1] "
        "or integer PCM (int8, uint8, int16, int32)"
    )


def _mono(raw: Any, key: str, default_rate: int) -> tuple[Tensor, int]:
    """Decode ``raw`` to a validated mono float32 waveform (samples,) at its own rate."""
    array, rate = _unpack(raw, key, default_rate)
    channels_last = not isinstance(array, Tensor)  # numpy/soundfile: (samples, channels)
    wave = _to_float(array, key)
    rate = _check_rate(rate, key)
    if wave.dim() == 1:
        wave = wave.unsqueeze(0)
    elif wave.dim() == 2:
        if channels_last:
            wave = wave.T
    else:
        layout = "(samples, channels)" if channels_last else "(channels, samples)"
        raise ValueError(
            f"{_where(key)}: expected a 1-D (samples,) or 2-D {layout} "
            f"{'numpy array' if channels_last else 'torch tensor'}, got shape {tuple(array.shape)}"
        )
    channels, samples = wave.shape
    if samples == 0 or channels == 0:
        raise ValueError(f"{_where(key)}: audio is empty (shape {tuple(array.shape)}); need at least 1 sample")
    if channels > _MAX_PLAUSIBLE_CHANNELS and channels > samples:
        layout = "(samples, channels) for numpy" if channels_last else "(channels, samples) for torch"
        raise ValueError(
            f"{_where(key)}: shape {tuple(array.shape)} reads as {channels} channels of {samples} samples; "
            f"2-D audio must be {layout} - transpose it"
        )
    if not bool(torch.isfinite(wave).all()):
        raise ValueError(f"{_where(key)}: audio contains NaN or inf samples")
    return wave.mean(dim=0), rate


def _resample(wave: Tensor, rate: int, target: int) -> Tensor:
    if rate == target:
        return wave
    return torchaudio.functional.resample(wave, orig_freq=rate, new_freq=target)


def load_audio_file(path: str | os.PathLike, *, sample_rate: int = 16000, key: str = "",
                    block_frames: int = 1 << 20) -> Tensor:
    """``load_audio`` of a file path, read in blocks of ``block_frames``: each block downmixed as ``load_audio``
    does (the same float32 samples), so memory holds the mono result and one block, not the file's every channel
    and its float copies (a 2 h stereo file: 0.5 GB, not 2 GB). Same errors as ``load_audio``."""
    try:
        fh = open_regular_file(path)
    except FileNotFoundError as exc:
        raise ValueError(f"{_where(key)}: no audio file at {os.fspath(path)!r}") from exc
    except NotARegularFileError as exc:
        raise ValueError(f"{_where(key)}: {exc.path!r} is {exc.kind}, not an audio file") from exc
    except OSError as exc:
        raise ValueError(f"{_where(key)}: cannot read audio file {os.fspath(path)!r}: {exc.strerror or exc}") from exc
    import soundfile as sf

    def bad(exc: Exception) -> ValueError:
        return ValueError(f"{_where(key)}: could not decode {os.fspath(path)!r} as audio ({_reason(exc)}); "
                          f"supported formats: {SUPPORTED_FORMATS}")

    with fh:
        try:
            f = sf.SoundFile(fh)
        except Exception as exc:  # see _decode_bytes
            raise bad(exc) from exc
        with f:
            channels, rate, frames = f.channels, f.samplerate, f.frames
            if not 0 < frames < 2**62:  # length unknown: the whole file at once
                try:
                    array = f.read(dtype="float32", always_2d=True)
                except Exception as exc:
                    raise bad(exc) from exc
                return load_audio((array, int(rate)), sample_rate=sample_rate, key=key)
            rate = _check_rate(int(rate), key)
            if channels > _MAX_PLAUSIBLE_CHANNELS and channels > frames:
                raise ValueError(f"{_where(key)}: shape ({frames}, {channels}) reads as {channels} channels of "
                                 f"{frames} samples; 2-D audio must be (samples, channels) for numpy - transpose it")
            out = torch.empty(frames, dtype=torch.float32)
            n = 0
            while n < frames:
                try:
                    block = f.read(min(block_frames, frames - n), dtype="float32", always_2d=True)
                except Exception as exc:
                    raise bad(exc) from exc
                if block.shape[0] == 0:  # the header promised more than the file holds
                    break
                wave = torch.from_numpy(block).T  # as _mono: (channels, samples), then the channel mean
                if not bool(torch.isfinite(wave).all()):
                    raise ValueError(f"{_where(key)}: audio contains NaN or inf samples")
                out[n:n + block.shape[0]] = wave.mean(dim=0)
                n += block.shape[0]
    if n == 0:
        raise ValueError(f"{_where(key)}: audio is empty (shape (0, {channels})); need at least 1 sample")
    return _resample(out[:n], rate, sample_rate)


def load_audio(raw: Any, *, sample_rate: int = 16000, key: str = "") -> Tensor:
    """Decode any supported input to a mono float32 waveform (samples,) at ``sample_rate``.

    Accepts encoded bytes, a file path, numpy (samples[, channels]) / torch ([channels,] samples)
    arrays (assumed at ``sample_rate``), (array, rate) tuples and {"array", "sampling_rate"} dicts.
    Channels are averaged; integer PCM is scaled to [-1, 1]. No length limit is applied.
    """
    wave, rate = _mono(raw, key, sample_rate)
    return _resample(wave, rate, sample_rate)


# ---------------------------------------------------------------------------------------------
# Embedder and tokenizer
# ---------------------------------------------------------------------------------------------
class AudioEmbedder(nn.Module):
    """Per-token stem: Linear(n_mels*kernel, d) -> GELU -> Linear(d, d) -> type embedding.

    Applied to windows of ``kernel`` frames every ``stride`` frames it has the receptive field
    and output rate of Whisper's two-conv stem, but touches each packed token on its own.
    """

    def __init__(self, in_features: int, d_model: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(in_features, d_model)
        self.act = nn.GELU()
        self.out_proj = nn.Linear(d_model, d_model)
        self.type_embedding = TypeEmbedding(d_model)

    def forward(self, tokens: Tensor, mask: Tensor | None = None) -> Tensor:
        """tokens (N, n_mels*kernel) or (B, S, n_mels*kernel) -> (..., d_model); ``mask`` is not needed (every
        token on its own) and accepted so that every audio embedder is called alike."""
        return self.type_embedding(self.out_proj(self.act(self.in_proj(tokens))))


class ConvStem(nn.Module):
    """Whisper's stem: Conv1d(n_mels, d, 3, padding 1) -> GELU -> Conv1d(d, d, 3, stride 2, padding 1) -> GELU
    (exact erf GELU, zero padding at the edges), over frame-pair tokens (B, S, 2 * n_mels) -> (B, S, d).

    No type embedding (Whisper has none; conv2's bias plays that part). With a key-padding ``mask`` (B, S) the
    frames of padded tokens and the first conv's outputs there are zeroed, so that a clip in a padded batch is
    stemmed exactly as alone (the second conv then sees zeros past its end, as its own zero padding). In
    Whisper's front-end every clip is 30 s and the mask is all true (multiplying by 1 changes nothing)."""

    def __init__(self, n_mels: int, d_model: int) -> None:
        super().__init__()
        self.n_mels = n_mels
        self.conv1 = nn.Conv1d(n_mels, d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1)
        self.act = nn.GELU()

    def forward(self, tokens: Tensor, mask: Tensor | None = None) -> Tensor:
        if tokens.dim() != 3 or tokens.shape[-1] != 2 * self.n_mels:
            raise ValueError(f"the conv stem reads padded batches of frame pairs (B, S, {2 * self.n_mels}), got "
                             f"{tuple(tokens.shape)} (packed tokens have no neighbours to convolve)")
        B, S, _ = tokens.shape
        x = tokens.reshape(B, 2 * S, self.n_mels).transpose(1, 2)  # (B, n_mels, frames)
        keep = None if mask is None else mask.repeat_interleave(2, dim=1)[:, None].to(x.dtype)  # (B, 1, frames)
        if keep is not None:
            x = x * keep
        h = self.act(self.conv1(x))  # (B, d, frames)
        if keep is not None:
            h = h * keep
        return self.act(self.conv2(h)).transpose(1, 2)  # (B, S, d)


@register_tokenizer()
class AudioTokenizer(Tokenizer):
    """Audio -> (n, n_mels*kernel) float32 log-mel windows at ``sample_rate / (hop_length*stride)`` Hz.

    Inputs: see the module docstring (bytes, paths, arrays, (array, rate), HF dicts; any rate,
    any channel count). Positions are the token's time index (0, 1, 2 ... at 50 Hz by default).
    Clips longer than ``max_seconds`` raise ClipTooLong (``truncation="error"``) or are cut with a warning
    naming the key (``truncation="truncate"``); ``max_seconds=None`` removes the limit.
    Silent audio is valid (every token equals the floor, -1.5).

    ``frontend``: "windows" (omni's: 5-frame windows every 2 frames, ``AudioEmbedder``) or "whisper" (Whisper's:
    every clip padded or cut to ``max_seconds``, frame-pair tokens, ``ConvStem``; see the module docstring).
    Whisper's stem has the windows' receptive field (5 frames) and rate (2), so kernel and stride stay 5 and 2.
    """

    modality: ClassVar[str] = "audio"
    role: ClassVar[Role] = Role.BIDIRECTIONAL

    def __init__(
        self,
        sample_rate: int = 16000,
        n_mels: int = 80,
        n_fft: int = 400,
        hop_length: int = 160,
        kernel: int = 5,
        stride: int = 2,
        max_seconds: float | None = 30.0,
        truncation: Truncation = "error",
        frontend: FrontEnd = "windows",
    ) -> None:
        for name, value in (
            ("sample_rate", sample_rate),
            ("n_mels", n_mels),
            ("n_fft", n_fft),
            ("hop_length", hop_length),
            ("kernel", kernel),
            ("stride", stride),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AudioTokenizer: {name} must be a positive integer, got {value!r}")
        if max_seconds is not None and not (isinstance(max_seconds, (int, float)) and max_seconds > 0):
            raise ValueError(f"AudioTokenizer: max_seconds must be > 0 or None, got {max_seconds!r}")
        if truncation not in ("error", "truncate"):
            raise ValueError(f"AudioTokenizer: truncation must be 'error' or 'truncate', got {truncation!r}")
        if frontend not in ("windows", "whisper"):
            raise ValueError(f"AudioTokenizer: frontend must be 'windows' or 'whisper', got {frontend!r}")
        if frontend == "whisper":
            if (kernel, stride) != (5, 2):
                raise ValueError(f"AudioTokenizer: Whisper's conv stem sees 5 frames every 2 (kernel=5, stride=2), "
                                 f"got kernel={kernel}, stride={stride}")
            if max_seconds is None or (max_seconds * sample_rate / hop_length) % 2:
                raise ValueError("AudioTokenizer: the Whisper front-end pads every clip to max_seconds, which must "
                                 f"give an even number of frames; got max_seconds={max_seconds!r}")
        self.frontend: FrontEnd = frontend
        self.sample_rate = sample_rate
        self.n_mels = n_mels
        self.n_fft = n_fft
        self.hop_length = hop_length
        self.kernel = kernel
        self.stride = stride
        self.max_seconds = None if max_seconds is None else float(max_seconds)
        self.truncation: Truncation = truncation

    def config(self) -> dict[str, Any]:
        return {
            "sample_rate": self.sample_rate,
            "n_mels": self.n_mels,
            "n_fft": self.n_fft,
            "hop_length": self.hop_length,
            "kernel": self.kernel,
            "stride": self.stride,
            "max_seconds": self.max_seconds,
            "truncation": self.truncation,
            **({"frontend": self.frontend} if self.frontend != "windows" else {}),  # older exports unchanged
        }

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def feature_dim(self) -> int:
        """Features per token: n_mels * kernel (Whisper front-end: 2 * n_mels, a pair of frames)."""
        return 2 * self.n_mels if self.frontend == "whisper" else self.n_mels * self.kernel

    @property
    def tokens_per_second(self) -> float:
        return self.sample_rate / (self.hop_length * self.stride)

    def num_tokens(self, num_samples: int) -> int:
        """Tokens for a clip of ``num_samples`` samples at ``sample_rate`` (ceil(frames / stride); the Whisper
        front-end: always the chunk's, 1500 for 30 s)."""
        if self.frontend == "whisper":
            return self._chunk_frames // 2
        frames = 1 + num_samples // self.hop_length
        return (frames - 1) // self.stride + 1

    @property
    def max_tokens(self) -> int | None:
        """Most tokens one clip can produce (None without a length limit)."""
        if self.max_seconds is None:
            return None
        return self.num_tokens(self._max_samples(self.sample_rate))

    @property
    def _chunk_frames(self) -> int:
        assert self.max_seconds is not None
        return int(round(self.max_seconds * self.sample_rate)) // self.hop_length

    def _max_samples(self, rate: int) -> int:
        assert self.max_seconds is not None
        # A hair of slack so 30 s at 44.1 kHz (1323000 samples) is not rejected by float rounding.
        return int(math.floor(self.max_seconds * rate + 1e-6))

    # -- encode ----------------------------------------------------------------------------------
    def waveform(self, raw: Any, *, key: str = "") -> Tensor:
        """Decoded, downmixed, length-checked waveform (samples,) at ``sample_rate``."""
        wave, rate = _mono(raw, key, self.sample_rate)
        if self.max_seconds is not None:
            limit = self._max_samples(rate)
            if wave.shape[0] > limit:
                seconds = wave.shape[0] / rate
                if self.truncation == "error":
                    raise ClipTooLong(
                        f"{_where(key)}: {seconds:.2f} s is longer than max_seconds={self.max_seconds:g}; "
                        "shorten it or use truncation='truncate'"
                    )
                warnings.warn(
                    f"{_where(key)}: {seconds:.2f} s truncated to max_seconds={self.max_seconds:g}",
                    stacklevel=3,
                )
                wave = wave[:limit]  # cut before resampling: cheaper for long inputs
        wave = _resample(wave, rate, self.sample_rate)
        if self.max_seconds is not None:
            # Resampling rounds the length up; never exceed max_tokens because of it.
            wave = wave[: self._max_samples(self.sample_rate)]
        return wave

    def encode(self, raw: Any, *, key: str = "") -> Segment:
        """raw audio -> Segment(tokens (n, n_mels*kernel) float32, positions arange(n))."""
        wave = self.waveform(raw, key=key)
        settings = dict(sample_rate=self.sample_rate, n_fft=self.n_fft, hop_length=self.hop_length, n_mels=self.n_mels)
        if self.frontend == "whisper":
            assert self.max_seconds is not None
            mel = whisper_log_mel(wave, seconds=self.max_seconds, **settings)
            tokens = frame_pairs(mel).contiguous()
        else:
            mel = log_mel(wave, **settings)
            tokens = unfold_tokens(mel, self.kernel, self.stride).contiguous()
        return Segment(
            modality=self.modality,
            tokens=tokens,
            positions=torch.arange(tokens.shape[0], dtype=torch.int64),
            role=self.role,
            meta={"seconds": wave.shape[0] / self.sample_rate, "frames": int(mel.shape[-1])},
        )

    def embedder(self, d_model: int) -> nn.Module:
        if self.frontend == "whisper":
            return ConvStem(self.n_mels, d_model)
        return AudioEmbedder(self.feature_dim, d_model)
