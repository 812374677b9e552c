"""Speech synthesis helpers: eSpeak NG through ctypes, a windowed-sinc resampler, noise, and
sentence extraction from prose.

eSpeak NG comes from the PyPI wheel ``espeakng-loader`` (library + voice data, no system
package, no audio device). Only numpy is needed on top, so worker processes stay light (no
torch import, which is also unsafe after fork once OpenMP threads exist).
"""

from __future__ import annotations

import ctypes
import math
import re
import unicodedata
from functools import lru_cache
from typing import Iterable, Sequence

import numpy as np

ESPEAK_RATE = 22050  # eSpeak NG's fixed output rate
# espeak_PARAMETER values (speak_lib.h)
_RATE, _PITCH = 1, 3
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_CHARS_UTF8 = 1


class ESpeak:
    """One eSpeak NG engine in this process (the library keeps global state: make one per process).

    ``synth(text, voice, rate, pitch)`` -> int16 samples at 22.05 kHz. ``voice`` is an eSpeak
    voice name with an optional variant, e.g. ``"en-us"`` or ``"en-us+f3"``.
    """

    def __init__(self) -> None:
        try:
            import espeakng_loader
        except ImportError as exc:
            raise ImportError(
                "speech synthesis needs the PyPI wheel espeakng-loader (`pip install espeakng-loader`)"
            ) from exc
        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_SetParameter.restype = ctypes.c_int
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ]  # fmt: skip
        lib.espeak_Synth.restype = ctypes.c_int
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, espeakng_loader.get_data_path().encode(), 0)
        if rate != ESPEAK_RATE:
            raise RuntimeError(f"espeak_Initialize failed (returned {rate}, expected sample rate {ESPEAK_RATE})")
        self._lib = lib
        self._chunks: list[bytes] = []
        callback_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)

        def collect(wav: ctypes.Array, n: int, events: int) -> int:
            if wav and n > 0:
                self._chunks.append(ctypes.string_at(wav, n * 2))
            return 0  # 0 = continue synthesis

        self._callback = callback_type(collect)  # keep a reference: the library holds a raw pointer
        lib.espeak_SetSynthCallback(self._callback)
        self._voice: str | None = None

    def set_voice(self, voice: str) -> None:
        if voice != self._voice:
            err = self._lib.espeak_SetVoiceByName(voice.encode())
            if err != 0:
                raise ValueError(f"eSpeak NG has no voice {voice!r} (error {err}); try en-us, en, en-us+f3 ...")
            self._voice = voice

    def synth(self, text: str, voice: str, rate: int = 175, pitch: int = 50) -> np.ndarray:
        self.set_voice(voice)
        self._lib.espeak_SetParameter(_RATE, int(rate), 0)
        self._lib.espeak_SetParameter(_PITCH, int(pitch), 0)
        data = text.encode("utf-8") + b"\0"
        self._chunks.clear()
        err = self._lib.espeak_Synth(data, len(data), 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
        if err != 0:
            raise RuntimeError(f"espeak_Synth failed with error {err} on {text!r}")
        self._lib.espeak_Synchronize()
        return np.frombuffer(b"".join(self._chunks), dtype=np.int16).copy()


def check_voices(voices: Iterable[str]) -> None:
    """Raise ValueError naming the first voice eSpeak NG does not know."""
    engine = _engine()
    for v in voices:
        engine._voice = None
        engine.set_voice(v)


@lru_cache(maxsize=1)
def _engine() -> ESpeak:
    return ESpeak()


# -- resampling -------------------------------------------------------------------------------------
@lru_cache(maxsize=8)
def _resample_plan(
    up: int, down: int, half_width: int, rolloff: float, beta: float, group: int = 32
) -> tuple[int, list[tuple[int, int, int, int, np.ndarray]]]:
    """Frame length and, per group of output phases ``r0:r1``, the input rows ``lo:hi`` of a
    frame and the (hi - lo, r1 - r0) tap matrix, such that
    ``y[q*up + r0 : q*up + r1] = padded[q*down + lo : q*down + hi] @ m``.

    Output sample n sits at input time t = n * down / up; it weights the 2 * half_width input
    samples around t with a Kaiser-windowed sinc whose cutoff is just below the lower Nyquist
    frequency. The (integer offset, fractional phase) pattern repeats every ``up`` outputs /
    ``down`` inputs, so resampling is a few small matrix products over frames of the input;
    grouping phases keeps each matrix nearly dense (one dense frame x up matrix would be
    mostly zeros and ~6x slower).
    """
    cutoff = rolloff * min(1.0, up / down)  # as a fraction of the input Nyquist
    r = np.arange(up)
    base, phase = (r * down) // up, (r * down) % up
    k = np.arange(-half_width + 1, half_width + 1)
    offsets = k[None, :] - (phase[:, None] / up)  # distance of each tap from t, in input samples
    window = np.interp(offsets, np.arange(-half_width, half_width + 1), np.kaiser(2 * half_width + 1, beta))
    taps = cutoff * np.sinc(cutoff * offsets) * window
    taps /= taps.sum(axis=1, keepdims=True)  # unit DC gain for every phase
    frame = int(base.max()) + 2 * half_width + 1
    groups = []
    for r0 in range(0, up, group):
        rs = np.arange(r0, min(r0 + group, up))
        # padded index of tap j for output r: base_r + 1 + j (the signal is padded by half_width)
        lo, hi = int(base[rs[0]]) + 1, int(base[rs[-1]]) + 2 * half_width + 1
        m = np.zeros((hi - lo, len(rs)))
        m[base[rs, None] + 1 - lo + np.arange(2 * half_width)[None, :], (rs - r0)[:, None]] = taps[rs]
        groups.append((r0, int(rs[-1]) + 1, lo, hi, m))
    return frame, groups


def resample(x: np.ndarray, orig_sr: int, new_sr: int, half_width: int = 16) -> np.ndarray:
    """Band-limited resampling of a 1-D float signal (Kaiser-windowed sinc, polyphase).
    Output length is ``ceil(len(x) * new_sr / orig_sr)``."""
    x = np.asarray(x, dtype=np.float64)
    if orig_sr == new_sr:
        return x.copy()
    g = math.gcd(orig_sr, new_sr)
    up, down = new_sr // g, orig_sr // g
    n_out = -(-len(x) * up // down)
    frame, groups = _resample_plan(up, down, half_width, 0.95, 8.0)
    n_frames = -(-n_out // up)
    padded = np.zeros((n_frames - 1) * down + frame)
    padded[half_width : half_width + len(x)] = x
    frames = np.lib.stride_tricks.sliding_window_view(padded, frame)[::down][:n_frames]
    y = np.empty((n_frames, up))
    for r0, r1, lo, hi, m in groups:
        y[:, r0:r1] = frames[:, lo:hi] @ m
    return y.reshape(-1)[:n_out]


# -- noise ------------------------------------------------------------------------------------------
NOISE_TYPES = ("white", "pink")


def noise(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Unit-power noise: white (flat spectrum) or pink (1/f power)."""
    if kind == "white":
        return rng.standard_normal(n)
    if kind == "pink":
        m = 1 << max(n - 1, 1).bit_length()  # FFT of a power-of-two length: odd lengths can be 30x slower
        spec = np.fft.rfft(rng.standard_normal(m))
        f = np.arange(len(spec), dtype=np.float64)
        f[0] = 1.0
        y = np.fft.irfft(spec / np.sqrt(f), m)[:n]
        return y / (np.sqrt(np.mean(y**2)) + 1e-12)
    raise ValueError(f"noise kind must be one of {NOISE_TYPES}, got {kind!r}")


def add_noise(x: np.ndarray, snr_db: float, kind: str, rng: np.random.Generator) -> np.ndarray:
    """``x`` plus ``kind`` noise scaled to ``snr_db`` relative to the signal's mean power."""
    p_signal = float(np.mean(x**2))
    if p_signal == 0.0:
        return x.copy()
    return x + noise(kind, len(x), rng) * math.sqrt(p_signal / 10.0 ** (snr_db / 10.0))


# -- sentences --------------------------------------------------------------------------------------
_ABBREVIATIONS = {"mr", "mrs", "dr", "st", "col", "capt", "messrs", "esq", "gen", "lt", "rev", "sr", "jr", "mme", "mlle", "no"}
# end of sentence: . ! ? (plus closing quotes/brackets), whitespace, then a capitalised word
_BOUNDARY = re.compile(r"([.!?][\"')\]]*)\s+(?=[\"'(]*[A-Z])")
_ALLOWED = re.compile(r"^[A-Za-z ,.;:!?'-]+$")
_TRANSLATE = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2014": " - ", "\u2013": " - "})


def split_sentences(paragraph: str) -> list[str]:
    """Split prose at ``. ! ?`` followed by a capitalised word, not after Mr./Mrs./initials."""
    out: list[str] = []
    for piece in _BOUNDARY.sub("\\1\n", " ".join(paragraph.split())).split("\n"):
        if out:
            words = out[-1].rstrip(".").split()
            last = words[-1].lstrip("\"'(").lower() if words else ""
            if out[-1].endswith(".") and (last in _ABBREVIATIONS or (len(last) == 1 and last.isalpha())):
                out[-1] = f"{out[-1]} {piece}"
                continue
        out.append(piece)
    return out


def clean_sentence(s: str, min_words: int = 3, max_words: int = 25) -> str | None:
    """A speakable sentence or None: ASCII letters and ``,.;:!?'-`` only (no digits: eSpeak
    would read them as words the transcript lacks), quotes/brackets/underscores removed,
    ``--`` dashes spaced, ``min_words..max_words`` words, capitalised, ending in ``. ! ?``."""
    s = unicodedata.normalize("NFKD", s.translate(_TRANSLATE)).encode("ascii", "ignore").decode()
    s = s.replace("--", " - ").replace("_", " ")
    s = re.sub(r"[\"()\[\]]", " ", s)
    s = re.sub(r"(?<![A-Za-z])'|'(?![A-Za-z])", " ", s)  # quote marks, not apostrophes inside words
    s = re.sub(r"\s+", " ", s).strip()
    s = re.sub(r"\s+([,.;:!?])", r"\1", s)
    s = re.sub(r"^[-,;: ]+|(?<=[.!?])[- ]+$", "", s)
    if not s or not _ALLOWED.match(s) or s[-1] not in ".!?" or not s[0].isupper():
        return None
    words = [w for w in s.split() if any(c.isalpha() for c in w)]
    if not min_words <= len(words) <= max_words or s.isupper():
        return None
    return s


def sentence_key(s: str) -> str:
    """Normalised form for dedupe: lowercase letters and single spaces."""
    return " ".join(re.sub(r"[^a-z ]", " ", s.lower()).split())


def extract_sentences(paragraphs: Iterable[str], min_words: int = 3, max_words: int = 25) -> list[str]:
    """Cleaned, deduplicated sentences in corpus order."""
    seen: set[str] = set()
    out: list[str] = []
    for para in paragraphs:
        for raw in split_sentences(para):
            s = clean_sentence(raw, min_words, max_words)
            if s is None:
                continue
            k = sentence_key(s)
            if k not in seen:
                seen.add(k)
                out.append(s)
    return out


def paragraphs_of(text: str) -> list[str]:
    """Blank-line separated blocks with their line breaks joined by spaces."""
    return [" ".join(block.split()) for block in re.split(r"\n\s*\n", text) if block.strip()]


def parse_range(spec: str, name: str, lo: int, hi: int) -> tuple[int, int]:
    """``"130:210"`` or ``"175"`` -> inclusive int range within [lo, hi]."""
    try:
        parts = [int(p) for p in spec.split(":")]
    except ValueError:
        raise ValueError(f"{name} must be N or MIN:MAX integers, got {spec!r}") from None
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or parts[0] > parts[1] or parts[0] < lo or parts[1] > hi:
        raise ValueError(f"{name} must be N or MIN:MAX with {lo} <= MIN <= MAX <= {hi}, got {spec!r}")
    return parts[0], parts[1]


def parse_snrs(values: Sequence[str]) -> list[float | None]:
    """SNR list items: a number in dB, or ``clean`` / ``none`` / ``inf`` for no noise."""
    out: list[float | None] = []
    for v in values:
        v = v.strip().lower()
        if v in ("clean", "none", "inf"):
            out.append(None)
            continue
        try:
            out.append(float(v))
        except ValueError:
            raise ValueError(f"noise SNR must be a number of dB or 'clean', got {v!r}") from None
    if not out:
        raise ValueError("noise SNR list is empty")
    return out


# -- one utterance (runs in worker processes) -------------------------------------------------------
def render_utterance(job: tuple) -> tuple[str, bytes, dict, str]:
    """Synthesise one utterance -> (key, FLAC bytes, metadata, transcript).

    ``job`` = (key, sentence, voice, rate, pitch, snr_db or None, noise kind, seed, sample_rate).
    The noise is drawn from ``seed`` alone, so the result does not depend on which worker runs it.
    """
    import io

    import soundfile as sf

    key, sentence, voice, rate, pitch, snr, kind, seed, sample_rate = job
    pcm = _engine().synth(sentence, voice, rate, pitch)
    if pcm.size == 0:
        raise RuntimeError(f"utterance {key!r}: eSpeak NG produced no audio for {sentence!r} with voice {voice!r}")
    x = resample(pcm.astype(np.float64) / 32768.0, ESPEAK_RATE, sample_rate)
    if snr is not None:
        x = add_noise(x, snr, kind, np.random.default_rng(seed))
    x = np.clip(np.round(x * 32767.0), -32768, 32767).astype(np.int16)
    buf = io.BytesIO()
    sf.write(buf, x, sample_rate, format="FLAC", subtype="PCM_16")
    meta = {
        "voice": voice,
        "rate": int(rate),
        "pitch": int(pitch),
        "snr": None if snr is None else float(snr),
        "noise": None if snr is None else kind,
        "sample_rate": sample_rate,
        "duration": round(len(x) / sample_rate, 4),
    }
    return key, buf.getvalue(), meta, sentence
