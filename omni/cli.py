"""The `omni` command line: dataset builders, tokenizer fitting, inference entry points."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def _list_tokenizers(args: argparse.Namespace) -> int:
    from omni.tokenizers import available_tokenizers, get_tokenizer

    for name in available_tokenizers():
        klass = get_tokenizer(name)
        doc = (klass.__doc__ or "").strip().splitlines()
        print(f"{name:12s} {klass.__module__}.{klass.__qualname__}  {doc[0] if doc else ''}")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from omni.vision import predict_files

    try:
        results = predict_files(args.checkpoint, args.images, top_k=args.top_k, device=args.device)
    except (FileNotFoundError, ValueError) as exc:
        print(f"omni predict: error: {exc}", file=sys.stderr)
        return 2
    for path, top in zip(args.images, results):
        print(f"{path}: " + ", ".join(f"{name} {p:.3f}" for name, p in top))
    return 0


def _transcribe(args: argparse.Namespace) -> int:
    from omni.speech import transcribe_files

    try:
        texts = transcribe_files(args.checkpoint, args.files, beam_size=args.beam_size,
                                 length_penalty=args.length_penalty, batch_size=args.batch_size,
                                 device=args.device, max_new_tokens=args.max_new_tokens)
    except (FileNotFoundError, ValueError) as exc:
        print(f"omni transcribe: error: {exc}", file=sys.stderr)
        return 2
    for path, text in zip(args.files, texts):
        print(f"{path}: {text}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("tokenizers", help="list registered tokenizers (built-in and plug-in)")
    p.set_defaults(func=_list_tokenizers)
    p = sub.add_parser("predict", help="classify image files with an exported image classifier (recipes/vit.py)")
    p.add_argument("--checkpoint", required=True, help="an export directory, e.g. runs/vit/final")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("images", nargs="+", help="image files of any size, mode and format (PNG, JPEG, ...)")
    p.set_defaults(func=_predict)
    p = sub.add_parser("transcribe", help="speech to text with an exported speech recognizer (recipes/whisper.py)")
    p.add_argument("--checkpoint", required=True, help="an export directory, e.g. runs/whisper/final")
    p.add_argument("--beam-size", type=int, default=1, help="beam width (1 = greedy)")
    p.add_argument("--length-penalty", type=float, default=1.0, help="GNMT length penalty alpha for beam search (0 = none)")
    p.add_argument("--batch-size", type=int, default=16, help="30 s windows decoded together")
    p.add_argument("--max-new-tokens", type=int, default=224, help="most tokens per 30 s window")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("files", nargs="+", help="audio files (WAV, FLAC, MP3, OGG ...): any sample rate, channels, length")
    p.set_defaults(func=_transcribe)
    from omni.data.cli import add_data_commands, add_tokenizer_commands

    add_data_commands(sub)
    add_tokenizer_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
