"""Data pipeline throughput on the CPU alone (no model): webdataset shards -> decoded, collated batches.

    python benchmarks/data_pipeline.py [--workers 2] [--fmnist data/fashion-mnist] [--speech data/speech-bench]

1. Fashion-MNIST: PNG shards (`omni data fashion-mnist`) -> uint8 (B, 1, 28, 28) + labels, samples/s.
2. Speech: FLAC shards (`omni data speech-synth`, built here if missing: 600 utterances from `--text`
   or the default corpus) -> decoded, resampled, 80-bin log-mel stem tokens per utterance (the audio
   tokenizer's encode), seconds of audio per second of wall time.
Both read through ShardLoader (seeded shuffle, exactly-once epochs) with `--workers` data workers.
"""

from __future__ import annotations

import argparse
import io
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from omni.data.clips import DecodeClip
from omni.data.reader import ShardLoader
from omni.tokenizers.audio import AudioTokenizer


class DecodePNG:
    def __call__(self, sample):
        from PIL import Image

        image = np.asarray(Image.open(io.BytesIO(sample["png"])))
        return torch.from_numpy(image.copy())[None], int(sample["cls"])


def collate_images(items):
    images, labels = zip(*items)
    return torch.stack(images), torch.tensor(labels)


def tokens_and_seconds(audio: AudioTokenizer, raw: bytes, transcript: str, key: str) -> tuple[torch.Tensor, float]:
    """A DecodeClip ``encode``: (the clip's log-mel tokens, its duration in seconds)."""
    segment = audio.encode(raw, key=key)
    return segment.tokens, segment.meta["seconds"]


def collate_speech(items):
    return [t for t, _ in items], sum(s for _, s in items)


def run(loader, measure) -> tuple[float, float]:
    start = time.perf_counter()
    total = 0.0
    for batch in loader:
        total += measure(batch)
    return total, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--fmnist", default="data/fashion-mnist")
    ap.add_argument("--speech", default="data/speech-bench")
    ap.add_argument("--text", nargs="*", default=None, help="corpus files for the speech build (default corpus if omitted)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the workers own the cores

    if not (Path(args.fmnist) / "manifest.json").is_file():
        from omni.data.builders_vision import build_fashion_mnist

        build_fashion_mnist(args.fmnist, quiet=True)
    loader = ShardLoader(args.fmnist, DecodePNG(), collate_images, batch_size=512, num_workers=args.workers, seed=0)
    n, secs = run(loader, lambda b: b[0].shape[0])
    print(f"| Fashion-MNIST PNG -> uint8 batches of 512 | {args.workers} workers | {n:,.0f} samples in {secs:.1f} s "
          f"| **{n / secs:,.0f} samples/s** |", flush=True)

    if not (Path(args.speech) / "manifest.json").is_file():
        from omni.data.builders_speech import build_speech_synth

        build_speech_synth(args.speech, train=600, test=20, text=args.text, quiet=True)
    decode = DecodeClip(partial(tokens_and_seconds, AudioTokenizer()))  # a clip over 30 s is dropped, with a warning
    loader = ShardLoader(args.speech, decode, collate_speech, batch_size=32, num_workers=args.workers, seed=0)
    audio, secs = run(loader, lambda b: b[1])
    print(f"| speech FLAC -> log-mel stem tokens | {args.workers} workers | {audio:,.0f} s of audio in {secs:.1f} s "
          f"| **{audio / secs:,.0f} s of audio/s** |", flush=True)


if __name__ == "__main__":
    main()
