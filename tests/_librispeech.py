"""A tiny LibriSpeech-layout tree (SUBSET/SPEAKER/CHAPTER/SPEAKER-CHAPTER-UTT.flac + SPEAKER-CHAPTER.trans.txt)
for the builder and fine-tuning tests: short FLACs written with soundfile, upper-case transcripts."""

from __future__ import annotations

from pathlib import Path

import numpy as np

WORDS = ("THE", "CAT", "SAT", "ON", "A", "MAT", "AND", "DOG", "RAN", "HOME", "SLOWLY", "TODAY")


def transcript(speaker: int, utterance: int) -> str:
    """A deterministic upper-case transcript of 3-6 words (LibriSpeech style: no punctuation)."""
    rng = np.random.default_rng([speaker, utterance])
    return " ".join(rng.choice(WORDS, size=3 + utterance % 4))


def write_tree(root: Path, subsets: dict[str, tuple[int, ...]], utterances: int = 2, chapter: int = 121,
               seconds: float = 0.4, sample_rate: int = 16000) -> dict[str, tuple[str, str]]:
    """``root/SUBSET/SPK/CHAPTER/...`` for each subset's speakers; -> {utterance id: (subset, transcript)}.
    Each clip is a few tones whose pitch follows the words, so different transcripts sound different."""
    import soundfile as sf

    expected = {}
    for subset, speakers in subsets.items():
        for spk in speakers:
            folder = root / subset / str(spk) / str(chapter)
            folder.mkdir(parents=True)
            lines = []
            for u in range(utterances):
                uid, text = f"{spk}-{chapter}-{u:04d}", transcript(spk, u)
                sf.write(folder / f"{uid}.flac", tones(text, seconds, sample_rate), sample_rate)
                lines.append(f"{uid} {text}")
                expected[uid] = (subset, text)
            (folder / f"{spk}-{chapter}.trans.txt").write_text("\n".join(lines) + "\n")
    return expected


def tones(text: str, seconds: float, sample_rate: int) -> np.ndarray:
    """One tone per word (frequency from the word), with a little noise: float32 mono in [-1, 1]."""
    words = text.split()
    n = int(seconds * sample_rate)
    t = np.arange(n) / sample_rate
    freq = np.repeat([200.0 + 40 * (sum(map(ord, w)) % 20) for w in words], -(-n // len(words)))[:n]
    noise = np.random.default_rng(len(text)).normal(0, 0.01, n)
    return (0.3 * np.sin(2 * np.pi * freq * t) + noise).astype(np.float32)
