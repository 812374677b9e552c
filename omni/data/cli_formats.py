"""``omni data hf`` and ``omni data audio``: the builders for data users already hold (no downloads).

Registered by ``omni.data.cli.add_data_commands``; errors are one ``omni data X: error: ...`` line, exit 2.
"""

from __future__ import annotations

import argparse
from typing import Any


def _hf(a: argparse.Namespace) -> Any:
    from omni.data.builders_hf import build_hf

    return build_hf(
        a.out, src=a.src, image_column=a.image_column, audio_column=a.audio_column, text_column=a.text_column,
        label_column=a.label_column, id_column=a.id_column, split=a.split, rename=a.rename,
        val_fraction=a.val_fraction, seed=a.seed, shard_size=a.shard_size, quiet=a.quiet, force=a.force,
    )  # fmt: skip


def _audio(a: argparse.Namespace) -> Any:
    from omni.data.builders_manifest import build_audio_manifest

    return build_audio_manifest(
        a.out, manifest=a.manifest, audio_dir=a.audio_dir, audio_column=a.audio_column, text_column=a.text_column,
        split=a.split, rename=a.rename, val_fraction=a.val_fraction, seed=a.seed, shard_size=a.shard_size,
        quiet=a.quiet, force=a.force,
    )  # fmt: skip


def add_format_commands(sub: Any) -> None:
    """Add ``hf`` and ``audio`` to the ``omni data`` sub-parser group ``sub``."""
    from omni.data.cli import _common, _fraction, _renames, _runner

    p = sub.add_parser("hf", help="a Hugging Face datasets save_to_disk folder, or parquet / arrow files -> shards "
                       "(images + labels, audio + text, or text)")  # fmt: skip
    _common(p, 2000)
    p.add_argument("src", metavar="PATH", help="a save_to_disk folder (Dataset or DatasetDict), a .parquet / .arrow "
                   "file, a folder of them, or a glob ('data/*.parquet'); files split by name (train-*.parquet)")
    p.add_argument("--image-column", help="image column (default: image or img): writes images + labels for vit.py")
    p.add_argument("--audio-column", help="audio column (default: audio): writes audio + transcripts for whisper.py")
    p.add_argument("--text-column", help="text / transcript column (default: text, sentence, transcript, "
                   "transcription); alone: text for lm.py")  # fmt: skip
    p.add_argument("--label-column", help="class label column (default: label or labels); class names from its "
                   "ClassLabel feature")  # fmt: skip
    p.add_argument("--id-column", help="row id column (default: id): a repeated id is skipped")
    p.add_argument("--split", default="train", help="the split of a source that is one split (default train)")
    p.add_argument("--rename", type=_renames, help="source split -> dataset split, e.g. validation=val")
    p.add_argument("--val-fraction", type=_fraction, default=0.0, help="seeded share of a one-split source held out as val")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_runner("data hf", _hf))

    p = sub.add_parser("audio", help="audio files + a CSV / TSV / JSONL manifest of file and transcript -> speech shards")
    _common(p, 2000)
    p.add_argument("--manifest", required=True, nargs="+", action="extend", metavar="FILE",
                   help="metadata.csv (file_name, transcription), Common Voice TSVs (path, sentence; audio in clips/) "
                   "or NeMo JSONL (audio_filepath, text); several give a split each by name (train.tsv, test.tsv)")
    p.add_argument("--audio-dir", help="folder the audio paths are relative to (default: the manifest's folder)")
    p.add_argument("--audio-column", help="audio file column (default: the first of file_name, audio_filepath, path, ...)")
    p.add_argument("--text-column", help="transcript column (default: transcription, text, sentence, ...)")
    p.add_argument("--split", help="the split of a lone manifest (default: by its name, else train)")
    p.add_argument("--rename", type=_renames, help="split -> split, e.g. dev=test")
    p.add_argument("--val-fraction", type=_fraction, default=0.0, help="seeded share of a lone split held out as val")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_runner("data audio", _audio))
