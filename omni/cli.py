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
    from omni.data.cli import add_data_commands, add_tokenizer_commands

    add_data_commands(sub)
    add_tokenizer_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
