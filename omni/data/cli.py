"""Command line of the dataset builders: ``omni data BUILDER ...`` and ``omni tokenizer fit ...``.

``add_data_commands(subparsers)`` / ``add_tokenizer_commands(subparsers)`` attach the commands to
an argparse sub-parser group (the ``omni`` console script, omni/cli.py, does that). Each command sets
``func(args) -> int`` (exit status). User errors - bad arguments, bad input, missing data, a dataset folder
another build holds, a full disk - print one ``omni data X: error: ...`` line and exit 2, no traceback.
"""

from __future__ import annotations

import argparse
import errno
import sys
from typing import Any, Callable

from omni.console import number, one_line
from omni.data.shards import DatasetError
from omni.lock import LockedError


# -- argument types ---------------------------------------------------------------------------------
_positive_int = number(int, at_least=1)
_count = number(int, at_least=0)
_fraction = number(float, at_least=0, below=1)


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",")]


def _range(name: str, lo: int, hi: int) -> Callable[[str], tuple[int, int]]:
    def parse(text: str) -> tuple[int, int]:
        from omni.data.speech import parse_range

        try:
            return parse_range(text, name, lo, hi)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _snrs(text: str) -> list[float | None]:
    from omni.data.speech import parse_snrs

    try:
        return parse_snrs(_csv(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _common(p: argparse.ArgumentParser, shard_size: int) -> None:
    p.add_argument("--out", required=True, help="dataset folder to write (shards + manifest.json)")
    p.add_argument("--shard-size", type=_positive_int, default=shard_size, help=f"samples per shard (default {shard_size})")
    p.add_argument("--force", action="store_true", help="rebuild even when the manifest says up to date")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars or messages")


def _runner(command: str, build: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            build(args)
        except (ValueError, OSError, EOFError, ImportError, DatasetError, LockedError) as exc:
            print(f"omni {command}: error: {_error_line(exc, getattr(args, 'out', None))}", file=sys.stderr)
            return 2
        return 0

    return run


def _error_line(exc: BaseException, out: str | None) -> str:
    """The error for a user: the disk-full case says so and where; every message on one line."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        where = exc.filename or out or "the output folder"
        return (f"the disk is full: no space left writing {where}; free space there or build elsewhere "
                "(a build needs room for the old and the new dataset until it completes)")
    return one_line(exc)


def _common_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return {"shard_size": a.shard_size, "quiet": a.quiet, "force": a.force}


# -- the builders -----------------------------------------------------------------------------------
def _fashion_mnist(a: argparse.Namespace) -> Any:
    from omni.data.builders_vision import build_fashion_mnist

    return build_fashion_mnist(a.out, source=a.source, format=a.format, download=a.download, **_common_kwargs(a))


def _images(a: argparse.Namespace) -> Any:
    from omni.data.builders_vision import build_images

    return build_images(a.out, src=a.src, val_fraction=a.val_fraction, seed=a.seed, skip_bad=a.skip_bad, **_common_kwargs(a))


def _speech_synth(a: argparse.Namespace) -> Any:
    from omni.data.builders_speech import build_speech_synth

    variants = ["" if v.lower() in ("", "none", "default") else v for v in a.variants]
    return build_speech_synth(
        a.out, train=a.train, test=a.test, test_sentences=a.test_sentences, per_sentence=a.per_sentence,
        text=a.text, voices=a.voices, variants=variants, rates=a.rates, pitches=a.pitches, snrs=a.noise_snr,
        noise_kinds=a.noise_kinds, min_words=a.min_words, max_words=a.max_words, seed=a.seed, workers=a.workers,
        **_common_kwargs(a),
    )  # fmt: skip


def _librispeech(a: argparse.Namespace) -> Any:
    from omni.data.builders_speech import build_librispeech

    return build_librispeech(a.out, src=a.src, split=a.split, rename=a.rename, seed=a.seed, **_common_kwargs(a))


def _renames(text: str) -> dict[str, str]:
    """``SUBSET=SPLIT,...`` -> {subset folder: split name}."""
    pairs = [item.partition("=") for item in _csv(text) if item]
    bad = [f"{k}{eq}{v}" for k, eq, v in pairs if not (k and eq and v)]
    if bad or not pairs:
        raise argparse.ArgumentTypeError(f"expected SUBSET=SPLIT[,SUBSET=SPLIT...], got {text!r}")
    return {k: v for k, _, v in pairs}


def _gym(a: argparse.Namespace) -> Any:
    from omni.data.builders_rl import build_gym

    return build_gym(
        a.out, env=a.env, episodes=a.episodes, mix=a.mix, seed=a.seed, val_fraction=a.val_fraction,
        reference_episodes=a.reference_episodes, minari=a.minari, minari_id=a.minari_id,
        minari_root_dir=a.minari_root, policies=a.policies, **_common_kwargs(a),
    )  # fmt: skip


def _train_policy(a: argparse.Namespace) -> Any:
    import shlex

    from omni.data.ars import ARSConfig, save_policies, select_behaviour, train_ars

    cfg = ARSConfig(iterations=a.iterations, directions=a.directions, top=a.top, step_size=a.step_size,
                    noise=a.noise, seed=a.seed)
    checkpoints = train_ars(a.env, cfg, log=None if a.quiet else print)
    chosen = select_behaviour(a.env, checkpoints, medium_fraction=a.medium_fraction)
    options = ("env", "out", "iterations", "directions", "top", "step_size", "noise", "medium_fraction", "seed")
    command = "omni data train-policy " + shlex.join(f"--{k.replace('_', '-')}={getattr(a, k)}" for k in options)
    path = save_policies(a.out, a.env, chosen, checkpoints, cfg, command)
    if not a.quiet:
        print(f"omni data train-policy: {path}: expert return {chosen['expert']['return']:.1f} "
              f"(iteration {chosen['expert']['iteration']}), medium {chosen['medium']['return']:.1f} "
              f"(iteration {chosen['medium']['iteration']})")
    return path


def _minari(a: argparse.Namespace) -> Any:
    from omni.data.builders_rl import build_minari

    return build_minari(a.out, dataset_id=a.id, root=a.root, val_fraction=a.val_fraction, seed=a.seed, **_common_kwargs(a))


def _text(a: argparse.Namespace) -> Any:
    from omni.data.builders_text import build_text

    return build_text(
        a.out, src=a.src, max_chars=a.max_chars, mode=a.mode, val_fraction=a.val_fraction, seed=a.seed,
        **_common_kwargs(a),
    )  # fmt: skip


def _verify(a: argparse.Namespace) -> Any:
    from omni.data.shards import verify_dataset

    manifest = verify_dataset(a.dir, check_sha256=not a.sizes_only)
    for name, split in manifest["splits"].items():
        print(f"{name}: {split['count']} samples, {len(split['shards'])} shard(s), {split['bytes']} bytes: ok")
    return manifest


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


def add_data_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``data`` with one sub-command per builder to an argparse sub-parser group."""
    from omni.data.builders_speech import DEFAULT_SNRS, DEFAULT_VARIANTS, DEFAULT_VOICES

    data = subparsers.add_parser(
        "data",
        help="build datasets as webdataset tar shards",
        description="Build a dataset as webdataset tar shards <out>/<split>-NNNNNN.tar plus <out>/manifest.json. "
        "Re-running with the same arguments does nothing when the build is complete and unchanged.",
    )
    # The builders' parsers are of the `omni` parser's class (omni/cli.py): argument errors are one line too.
    sub = data.add_subparsers(dest="builder", required=True, metavar="BUILDER")

    p = sub.add_parser("fashion-mnist", help="Fashion-MNIST (Debian dataset-fashion-mnist, --source, or --download)")
    _common(p, 5000)
    p.add_argument("--source", help="folder with the IDX files (default: $OMNI_FASHION_MNIST_DIR, else "
                   "/usr/share/datasets/fashion-mnist)")  # fmt: skip
    p.add_argument("--format", choices=("png", "raw"), default="png", help="png (default) or raw 784-byte .u8")
    p.add_argument("--download", action=argparse.BooleanOptionalAction, default=False,
                   help="fetch the IDX files from the internet into OUT/download when they are not found "
                   "(default: never download; fail saying where to get them)")  # fmt: skip
    p.set_defaults(func=_runner("data fashion-mnist", _fashion_mnist))

    p = sub.add_parser("images", help="ImageFolder tree (class subfolders of JPEG/PNG) -> original bytes + label")
    _common(p, 2000)
    p.add_argument("--src", required=True, help="SRC/<class>/*.jpg, or SRC/train/<class>/... and SRC/val/<class>/...")
    p.add_argument("--val-fraction", type=_fraction, default=0.1, help="seeded per-class holdout when SRC has no split folders")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-bad", action="store_true", help="skip (with a warning) files that are not whole JPEG/PNG images "
                   "(unreadable, truncated, header only, over 8192x8192 pixels)")
    p.set_defaults(func=_runner("data images", _images))

    p = sub.add_parser("speech-synth", help="speech synthesised with eSpeak NG from public-domain sentences")
    _common(p, 2000)
    p.add_argument("--train", type=_count, default=20000, help="train utterances (default 20000)")
    p.add_argument("--test", type=_count, default=1000, help="test utterances (default 1000)")
    p.add_argument("--test-sentences", type=_positive_int, help="sentences held out for test (default: --test)")
    p.add_argument("--per-sentence", type=_positive_int, default=1, help="train renders per sentence, each with another voice")
    p.add_argument("--text", nargs="+", help="text files (default: Austen's novels from r-cran-janeaustenr, "
                   "or $OMNI_AUSTEN_DIR)")  # fmt: skip
    p.add_argument("--voices", type=_csv, default=list(DEFAULT_VOICES), help=f"eSpeak NG voices (default {','.join(DEFAULT_VOICES)})")
    p.add_argument("--variants", type=_csv, default=list(DEFAULT_VARIANTS),
                   help="voice variants; 'none' = the plain voice (default none,m1,...,f5)")  # fmt: skip
    p.add_argument("--rates", type=_range("--rates", 80, 450), default=(130, 210), help="words/minute MIN:MAX (default 130:210)")
    p.add_argument("--pitches", type=_range("--pitches", 0, 100), default=(30, 70), help="pitch MIN:MAX in 0..100 (default 30:70)")
    p.add_argument("--noise-snr", type=_snrs, default=_snrs(",".join(DEFAULT_SNRS)),
                   help=f"SNRs in dB drawn per utterance, 'clean' = no noise (default {','.join(DEFAULT_SNRS)})")  # fmt: skip
    p.add_argument("--noise-kinds", type=_csv, default=["white", "pink"], help="noise colours (default white,pink)")
    p.add_argument("--min-words", type=_positive_int, default=3)
    p.add_argument("--max-words", type=_positive_int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=_positive_int, help="processes (default: all cores)")
    p.set_defaults(func=_runner("data speech-synth", _speech_synth))

    p = sub.add_parser("librispeech", help="LibriSpeech-layout folder (speaker/chapter/*.flac + *.trans.txt)")
    _common(p, 2000)
    p.add_argument("--src", required=True, help="a subset folder (speaker/chapter/...) or a root of subsets")
    p.add_argument("--split", default="train", help="split name when SRC is one subset (default train)")
    p.add_argument("--rename", type=_renames, help="subset folder -> split, e.g. train-clean-100=train,"
                   "train-clean-360=train,dev-clean=test (default: each subset is a split of its own name)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_runner("data librispeech", _librispeech))

    p = sub.add_parser("gym", help="episodes of scripted behaviour policies in a Gymnasium env (+ a Minari copy)")
    _common(p, 500)
    p.add_argument("--env", default="CartPole-v1", help="Gymnasium env id (behaviour policies: CartPole-v1, Pendulum-v1, Hopper-v5)")
    p.add_argument("--episodes", type=_positive_int, default=1000)
    p.add_argument("--mix", help="POLICY:WEIGHT,... over random, medium, expert, replay, reference "
                   "(default random:0.1,replay:0.3,medium:0.4,expert:0.2)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-fraction", type=_fraction, default=0.0, help="seeded share of episodes in a val split")
    p.add_argument("--reference-episodes", type=_count, default=10, help="episodes per reference score (random, expert)")
    p.add_argument("--minari", action=argparse.BooleanOptionalAction, default=None,
                   help="also write a Minari dataset (default: when minari is installed)")  # fmt: skip
    p.add_argument("--minari-id", help="Minari dataset id (default omni/<out folder name>-v0)")
    p.add_argument("--minari-root", help="Minari datasets folder (default: MINARI_DATASETS_PATH or ~/.minari/datasets)")
    p.add_argument("--policies", help="expert/medium policies from `omni data train-policy` (default: the built-in "
                   "ones: CartPole-v1, Pendulum-v1 hand-written; Hopper-v5 trained)")  # fmt: skip
    p.set_defaults(func=_runner("data gym", _gym))

    p = sub.add_parser("train-policy", help="train expert + medium linear behaviour policies with ARS (Box actions)")
    p.add_argument("--env", required=True, help="Gymnasium env id with a Box action space, e.g. Hopper-v5")
    p.add_argument("--out", required=True, help="JSON file to write (use with `omni data gym --policies`)")
    p.add_argument("--iterations", type=_positive_int, default=300)
    p.add_argument("--directions", type=_positive_int, default=8)
    p.add_argument("--top", type=_positive_int, default=4)
    p.add_argument("--step-size", type=float, default=0.01)
    p.add_argument("--noise", type=float, default=0.025)
    p.add_argument("--medium-fraction", type=_fraction, default=0.4,
                   help="medium = the checkpoint nearest this fraction of the expert's return (default 0.4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_runner("data train-policy", _train_policy))

    p = sub.add_parser("minari", help="a local Minari dataset -> episode shards")
    _common(p, 500)
    p.add_argument("--id", required=True, help="Minari dataset id, e.g. omni/cartpole-v0")
    p.add_argument("--root", help="Minari datasets folder (default: MINARI_DATASETS_PATH or ~/.minari/datasets)")
    p.add_argument("--val-fraction", type=_fraction, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_runner("data minari", _minari))

    p = sub.add_parser("text", help="text files -> shards of .txt chunks")
    _common(p, 5000)
    p.add_argument("--src", nargs="+", help="files or folders (default: Austen's novels from r-cran-janeaustenr, "
                   "or $OMNI_AUSTEN_DIR)")  # fmt: skip
    p.add_argument("--max-chars", type=_positive_int, default=2000, help="most characters per chunk (default 2000)")
    p.add_argument("--mode", choices=("paragraph", "line"), default="paragraph", help="units packed into chunks")
    p.add_argument("--val-fraction", type=_fraction, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_runner("data text", _text))

    # data users already hold (no downloads)
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

    p = sub.add_parser("verify", help="check a dataset's shards against its manifest (sizes and sha256)")
    p.add_argument("dir", help="dataset folder")
    p.add_argument("--sizes-only", action="store_true", help="skip the sha256 check")
    p.set_defaults(func=_runner("data verify", _verify))
    return data


def _fit(a: argparse.Namespace) -> Any:
    from omni.data.builders_text import fit_tokenizer
    from omni.data.corpora import austen_dir

    inputs = a.input or [austen_dir("; or pass --input FILE|DIR ...")]
    path = fit_tokenizer(inputs, a.out, vocab_size=a.vocab_size, min_frequency=a.min_frequency)
    print(f"wrote {path}")
    return path


def add_tokenizer_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``tokenizer fit`` (byte-level BPE for omni.tokenizers.text.TextTokenizer)."""
    tok = subparsers.add_parser("tokenizer", help="fit tokenizers", description="Fit tokenizers with state.")
    sub = tok.add_subparsers(dest="tokenizer_command", required=True, metavar="COMMAND")
    p = sub.add_parser("fit", help="fit the text BPE on files and save it (config.json + tokenizer.json)")
    p.add_argument("--input", nargs="+", help="text files/folders, the janeaustenr folder, or omni text datasets "
                   "(default: Austen's novels from r-cran-janeaustenr, or $OMNI_AUSTEN_DIR)")  # fmt: skip
    p.add_argument("--vocab-size", type=_positive_int, default=8192, help="ids incl. special tokens (default 8192)")
    p.add_argument("--min-frequency", type=_positive_int, default=2)
    p.add_argument("--out", required=True, help="folder to save into, e.g. tokenizers/NAME")
    p.set_defaults(func=_runner("tokenizer fit", _fit))
    return tok
