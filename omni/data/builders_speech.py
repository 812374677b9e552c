"""Speech dataset builders: synthetic speech (eSpeak NG) and LibriSpeech-layout folders."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from omni.data.shards import KEY_RE, SPLIT_RE, Build, fingerprint_files
from omni.data.speech import (
    NOISE_TYPES,
    check_voices,
    extract_sentences,
    paragraphs_of,
    render_utterance,
)

DEFAULT_VOICES = ("en-us", "en", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-029", "en-us-nyc")
# "" = the voice's own default; the others are eSpeak NG voice variants (voices/!v/*).
DEFAULT_VARIANTS = ("", "m1", "m2", "m3", "m4", "m5", "m7", "f1", "f2", "f3", "f4", "f5")
DEFAULT_SNRS = ("clean", "clean", "30", "20", "10")
SAMPLE_RATE = 16000
CORPUS_NAME = "Jane Austen's six novels (Debian r-cran-janeaustenr; public domain)"


# -- corpus -----------------------------------------------------------------------------------------
def load_paragraphs(text: Sequence[str | os.PathLike] | None) -> tuple[list[str], str]:
    """Paragraphs of the text corpus and a description of it.

    ``text``: UTF-8 text files and/or folders holding the janeaustenr R package (read with
    ``omni.data.corpora.austen_novels``); None means that package (``austen_dir()``).
    """
    from omni.data.builders_text import expand_inputs, iter_documents
    from omni.data.corpora import austen_dir, austen_novels, find_austen_data

    if not text:
        text = [austen_dir("; or give your own (public-domain) text files: `omni data speech-synth --text FILE`, "
                           "in a recipe --set \"text=['FILE']\"")]
    paragraphs: list[str] = []
    names = []
    for p in expand_inputs(text):  # the text builder's reader: folders of text files, UTF-8 only, no binary
        if p.is_dir() and find_austen_data(p) is not None:
            novels = austen_novels(p)
            paragraphs.extend(para for _, paras in sorted(novels.items()) for para in paras)
            names.append(CORPUS_NAME)
        else:
            paragraphs.extend(para for _, doc in iter_documents([p]) for para in paragraphs_of(doc))
            names.append(p.name)
    return paragraphs, " + ".join(names)


def split_sentences_by_seed(sentences: Sequence[str], n_test: int, seed: int) -> tuple[list[str], list[str]]:
    """Seeded shuffle, then the first ``n_test`` sentences are test and the rest train. Sentences
    are already deduplicated by ``sentence_key``, so no test sentence is spoken in train."""
    if n_test >= len(sentences):
        raise ValueError(
            f"the corpus has {len(sentences)} usable sentences; cannot hold out {n_test} for test and keep any for train"
        )
    order = np.random.default_rng([seed, 7]).permutation(len(sentences))
    shuffled = [sentences[i] for i in order]
    return shuffled[n_test:], shuffled[:n_test]


# -- speech-synth -----------------------------------------------------------------------------------
def _jobs(
    split: str,
    split_id: int,
    sentences: Sequence[str],
    n: int,
    per_sentence: int,
    voices: Sequence[str],
    variants: Sequence[str],
    rates: tuple[int, int],
    pitches: tuple[int, int],
    snrs: Sequence[float | None],
    noise_kinds: Sequence[str],
    seed: int,
) -> list[tuple]:
    """``n`` utterance jobs: sentence i // per_sentence (cycling), each with its own seeded
    random voice configuration, in a seeded shuffled order (so shards mix sentences)."""
    rng = np.random.default_rng([seed, split_id, 0])
    jobs = []
    for i in range(n):
        sentence = sentences[(i // per_sentence) % len(sentences)]
        voice = str(rng.choice(voices))
        variant = str(rng.choice(variants))
        jobs.append(
            (
                sentence,
                f"{voice}+{variant}" if variant else voice,
                int(rng.integers(rates[0], rates[1] + 1)),
                int(rng.integers(pitches[0], pitches[1] + 1)),
                snrs[int(rng.integers(len(snrs)))],
                str(rng.choice(noise_kinds)),
            )
        )
    order = rng.permutation(n)
    return [
        (f"{split}_{k:07d}", *jobs[j], [seed, split_id, 1, k], SAMPLE_RATE) for k, j in enumerate(order)
    ]


def _render_all(jobs: list[tuple], workers: int) -> Iterator[tuple[str, bytes, dict, str]]:
    if workers <= 1 or len(jobs) < 2 * workers:
        yield from map(render_utterance, jobs)
        return
    # spawn, not fork: the parent may hold OpenMP/tokenizer threads (e.g. under pytest with torch),
    # which a forked child can deadlock on; workers only import numpy, soundfile and eSpeak.
    with mp.get_context("spawn").Pool(workers) as pool:
        yield from pool.imap(render_utterance, jobs, chunksize=16)


def build_speech_synth(
    out: str | os.PathLike,
    *,
    train: int = 20000,
    test: int = 1000,
    test_sentences: int | None = None,
    per_sentence: int = 1,
    text: Sequence[str | os.PathLike] | None = None,
    voices: Sequence[str] = DEFAULT_VOICES,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    rates: tuple[int, int] = (130, 210),
    pitches: tuple[int, int] = (30, 70),
    snrs: Sequence[float | None] = (None, None, 30.0, 20.0, 10.0),
    noise_kinds: Sequence[str] = NOISE_TYPES,
    min_words: int = 3,
    max_words: int = 25,
    seed: int = 0,
    workers: int | None = None,
    shard_size: int = 2000,
    quiet: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """Synthesised speech -> ``train``/``test`` shards of ``<key>.flac`` (16 kHz mono PCM16),
    ``<key>.txt`` (transcript) and ``<key>.json`` (voice, rate, pitch, snr, noise, duration).

    Sentences come from ``text`` (default: Austen's novels), split 3-25 words, cleaned and
    deduplicated; ``test_sentences`` of them (default ``test``) are held out for test. Train
    renders every train sentence ``per_sentence`` times with different random voice configs
    (cycling through the sentences when ``train`` needs more). ``snrs`` entries of None are clean.
    """
    if train < 0 or test < 0 or train + test == 0:
        raise ValueError(f"need train >= 0, test >= 0 and some utterances, got train={train}, test={test}")
    if per_sentence < 1:
        raise ValueError(f"per_sentence must be >= 1, got {per_sentence}")
    if not voices or not variants or not snrs or not noise_kinds:
        raise ValueError("voices, variants, snrs and noise kinds must each list at least one value")
    bad = [k for k in noise_kinds if k not in NOISE_TYPES]
    if bad:
        raise ValueError(f"unknown noise kind(s) {bad}; choose from {NOISE_TYPES}")
    if not (80 <= rates[0] <= rates[1] <= 450):
        raise ValueError(f"rates must satisfy 80 <= min <= max <= 450 words/minute, got {rates}")
    if not (0 <= pitches[0] <= pitches[1] <= 100):
        raise ValueError(f"pitches must satisfy 0 <= min <= max <= 100, got {pitches}")
    n_test_sent = test if test_sentences is None else int(test_sentences)
    if test > 0 and n_test_sent < 1:
        raise ValueError("test utterances need test_sentences >= 1")
    workers = (os.cpu_count() or 1) if workers is None else int(workers)

    paragraphs, corpus = load_paragraphs(text)
    sentences = extract_sentences(paragraphs, min_words, max_words)
    if len(sentences) <= n_test_sent:
        raise ValueError(f"the text corpus ({corpus}) has {len(sentences)} usable sentences of {min_words}-{max_words} "
                         f"words; {n_test_sent} are held out for test, so it needs more than that (plain UTF-8 prose)")
    train_sents, test_sents = split_sentences_by_seed(sentences, n_test_sent, seed)
    corpus_hash = hashlib.sha256("\n".join(sentences).encode()).hexdigest()
    args = {
        "train": train, "test": test, "test_sentences": n_test_sent, "per_sentence": per_sentence,
        "voices": list(voices), "variants": list(variants), "rates": list(rates), "pitches": list(pitches),
        "snrs": list(snrs), "noise_kinds": list(noise_kinds), "min_words": min_words, "max_words": max_words,
        "seed": seed, "sample_rate": SAMPLE_RATE,
    }  # fmt: skip
    with Build(
        out, "speech-synth", args, source={"corpus": corpus, "sentences": len(sentences), "sha256": corpus_hash},
        shard_size=shard_size, quiet=quiet, force=force,
    ) as build:  # fmt: skip
        if (manifest := build.up_to_date()) is not None:
            return manifest
        check_voices(f"{v}+{x}" if x else v for v in voices for x in variants)
        build.start()
        stats: dict[str, Any] = {}
        for split_id, (split, sents, n, per) in enumerate(
            [("train", train_sents, train, per_sentence), ("test", test_sents, test, 1)]
        ):
            if n == 0:
                continue
            jobs = _jobs(split, split_id, sents, n, per, voices, variants, rates, pitches, snrs, noise_kinds, seed)
            seconds = longest = 0.0
            with build.split(split, total=n) as w:
                for key, flac, meta, transcript in _render_all(jobs, workers):
                    w.write({"__key__": key, "flac": flac, "txt": transcript, "json": meta})
                    seconds += meta["duration"]
                    longest = max(longest, meta["duration"])
            stats[split] = {
                "sentences": min(len(sents), -(-n // per)),
                "hours": round(seconds / 3600, 4),
                "longest_seconds": longest,
            }
        return build.finish(
            sample_rate=SAMPLE_RATE,
            corpus={"name": corpus, "usable_sentences": len(sentences), "train_sentences": len(train_sents),
                    "test_sentences": len(test_sents)},
            split_stats=stats,
            fields={
                "flac": f"FLAC, mono, {SAMPLE_RATE} Hz, 16-bit",
                "txt": "transcript (the sentence that was spoken)",
                "json": "{voice, rate, pitch, snr (dB or null = clean), noise, sample_rate, duration}",
            },
        )  # fmt: skip


# -- LibriSpeech ------------------------------------------------------------------------------------
_AUDIO_EXTS = (".flac", ".wav")


@dataclass(frozen=True)
class Skipped:
    """An utterance (or audio file) left out of a LibriSpeech build, and why."""

    path: str  # the audio file, or "<trans.txt>:<line>" for a transcript line
    kind: str  # one of SKIP_KINDS: the manifest counts skips per kind
    reason: str


SKIP_KINDS = ("empty transcript", "audio not found", "repeated id", "no transcript", "unreadable audio")


def scan_librispeech(
    src: Path, default_split: str, rename: Mapping[str, str] | None = None
) -> tuple[dict[str, list[tuple[str, Path, str]]], list[Skipped]]:
    """``(utterance id, audio file, transcript)`` per split from ``*.trans.txt`` files, and what was left out.

    ``speaker/chapter/*.trans.txt`` directly under ``src`` is one split (``default_split``);
    ``SUBSET/speaker/chapter/...`` (e.g. ``train-clean-100``, ``dev-clean``) gives one split per subset,
    named as the subset unless ``rename`` maps it to another split (several subsets may share one).

    Left out (each a ``Skipped``, the build warns one line per item): a transcript line without text, a line
    whose audio file is missing, an utterance id already seen in the split (its sample key would repeat), and
    an audio file that no transcript line names.
    """
    if not src.is_dir():
        raise FileNotFoundError(f"--src {src} is not a folder")
    trans = sorted(src.rglob("*.trans.txt"))
    if not trans:
        raise ValueError(f"{src}: no *.trans.txt files (expected LibriSpeech layout speaker/chapter/*.trans.txt)")
    rename = dict(rename or {})
    splits: dict[str, list[tuple[str, Path, str]]] = {}
    skipped: list[Skipped] = []
    named: set[Path] = set()  # every audio file some transcript line names
    keys: dict[str, set[str]] = {}
    subsets: set[str] = set()
    for t in trans:
        parts = t.relative_to(src).parts
        subset = parts[-4] if len(parts) >= 4 else None
        if subset is not None:
            subsets.add(subset)
        split = rename.get(subset, subset) if subset is not None else default_split
        split = re.sub(r"[^A-Za-z0-9_-]", "_", split)
        if not SPLIT_RE.match(split):
            raise ValueError(f"{t}: split name {split!r} derived from its folder is not usable")
        try:
            lines = t.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as exc:
            raise ValueError(f"{t}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            uid, _, text = line.strip().partition(" ")
            where = f"{t}:{lineno}"
            candidates = [t.parent / (uid + e) for e in _AUDIO_EXTS]
            audio = next((a for a in candidates if a.is_file()), None)
            named.update(candidates)
            if not text.strip():
                skipped.append(Skipped(where, "empty transcript", f"utterance {uid} has an empty transcript"))
            elif audio is None:
                skipped.append(Skipped(where, "audio not found", f"audio {candidates[0]} not found"))
            elif _key(uid) in keys.setdefault(split, set()):
                skipped.append(Skipped(where, "repeated id", f"utterance id {uid} repeats in split {split!r}"))
            else:
                keys[split].add(_key(uid))
                splits.setdefault(split, []).append((uid, audio, text.strip()))
    unknown = sorted(set(rename) - subsets)
    if unknown:
        raise ValueError(f"{src}: rename names subset folder(s) {', '.join(unknown)} that hold no *.trans.txt "
                         f"(subsets: {', '.join(sorted(subsets)) or 'none, the folder is one subset'})")
    for audio in sorted(p for e in _AUDIO_EXTS for p in src.rglob(f"*{e}")):
        if audio not in named:
            skipped.append(Skipped(str(audio), "no transcript", "no transcript line names it"))
    return splits, skipped


def _key(uid: str) -> str:
    """The shard sample key of an utterance id: the id itself when it is a valid key."""
    return uid if KEY_RE.match(uid) else re.sub(r"[^A-Za-z0-9_-]", "_", uid)


def audio_info(path: Path) -> Any:
    """``soundfile.info`` of an audio file, checked to decode: the header must parse, the clip must have samples,
    and its last sample must be readable (a seek there fails in a truncated FLAC, whose header still gives the
    full length). A ValueError says what is wrong. Damage inside the stream is found later, by the data reader,
    which skips and counts such samples."""
    import soundfile as sf

    try:
        info = sf.info(str(path))
        if info.frames < 1:
            raise ValueError("the audio has no samples")
        with sf.SoundFile(str(path)) as f:
            f.seek(info.frames - 1)
            if f.read(1).shape[0] != 1:
                raise ValueError("the audio ends before its header says")
    except (RuntimeError, sf.SoundFileError) as exc:  # libsndfile: unknown format, lost sync, failed seek
        detail = " ".join(str(exc).replace(repr(str(path)), "the file").split())  # the path is named once, first
        raise ValueError(f"not readable audio ({detail})") from None
    return info


def build_librispeech(
    out: str | os.PathLike,
    *,
    src: str | os.PathLike,
    split: str = "train",
    rename: Mapping[str, str] | None = None,
    seed: int = 0,
    shard_size: int = 2000,
    quiet: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """A LibriSpeech-layout folder -> shards of ``<key>.flac`` (the original bytes), ``<key>.txt``
    (the transcript as written, e.g. LibriSpeech's upper case) and ``<key>.json`` (id, speaker, chapter,
    sample_rate, duration), in a seeded shuffled order per split.

    ``split``: the split of a folder that is one subset (speaker/chapter/...); a root of subset folders gives
    one split per subset, named as the folder unless ``rename`` maps it ({"train-clean-100": "train",
    "train-clean-360": "train", "test-clean": "test"}: subsets mapped to one split are shuffled together).

    What cannot be used is skipped, one warning line each, and counted in the manifest (``skipped``: the
    number per reason, ``skipped_files``: path and reason of each): transcript lines without text, lines whose
    audio is missing, repeated utterance ids, audio no line names, audio that does not decode (``audio_info``).
    A build where nothing is left fails."""
    src = Path(src)
    if not SPLIT_RE.match(split):
        raise ValueError(f"split {split!r} must match {SPLIT_RE.pattern}")
    bad = {k: v for k, v in (rename or {}).items() if not isinstance(v, str) or not SPLIT_RE.match(v)}
    if bad:
        raise ValueError(f"rename: split names must match {SPLIT_RE.pattern}, got {bad}")
    splits, skipped = scan_librispeech(src, split, rename)
    files = [a for items in splits.values() for _, a, _ in items] + sorted(src.rglob("*.trans.txt"))
    args = {"split": split, "seed": seed, **({"rename": dict(sorted(rename.items()))} if rename else {})}
    with Build(
        out, "librispeech", args,
        source={"files": len(files), "stat_sha256": fingerprint_files(files, src)},
        shard_size=shard_size, quiet=quiet, force=force,
    ) as build:  # fmt: skip
        if (manifest := build.up_to_date()) is not None:
            return manifest
        for s in skipped:
            warnings.warn(f"{s.path}: {s.reason}; skipped", stacklevel=2)
        readable: dict[str, list[tuple[str, Path, str, Any]]] = {}
        for name, items in sorted(splits.items()):
            for uid, audio, text in items:
                try:
                    readable.setdefault(name, []).append((uid, audio, text, audio_info(audio)))
                except ValueError as exc:
                    skipped.append(Skipped(str(audio), "unreadable audio", str(exc)))
                    warnings.warn(f"{audio}: {exc}; skipped", stacklevel=2)
        kept = sum(len(items) for items in readable.values())
        if not kept:
            raise ValueError(f"{src}: no usable utterances ({len(skipped)} skipped: {_reasons(skipped)})")
        if skipped:
            warnings.warn(f"{src}: {len(skipped)} item(s) skipped ({_reasons(skipped)}), {kept} utterances kept",
                          stacklevel=2)
        build.start()
        stats = {}
        for name, items in sorted(readable.items()):
            name_id = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
            order = np.random.default_rng([seed, name_id]).permutation(len(items))
            seconds = longest = 0.0
            with build.split(name, total=len(items)) as w:
                for j in order:
                    uid, audio, text, info = items[j]
                    parts = uid.split("-")
                    meta = {
                        "id": uid,
                        "speaker": parts[0] if len(parts) == 3 else None,
                        "chapter": parts[1] if len(parts) == 3 else None,
                        "sample_rate": info.samplerate,
                        "duration": round(info.frames / info.samplerate, 4),
                    }
                    w.write({"__key__": _key(uid), audio.suffix[1:]: audio.read_bytes(), "txt": text, "json": meta})
                    seconds += meta["duration"]
                    longest = max(longest, meta["duration"])
            stats[name] = {"hours": round(seconds / 3600, 4), "longest_seconds": longest}
        return build.finish(
            split_stats=stats,
            source_dir=str(src.resolve()),
            skipped=dict(Counter(s.kind for s in skipped)),
            skipped_files=[{"path": s.path, "reason": s.reason} for s in skipped],
            fields={
                "flac": "the original audio bytes (.wav where the source had WAV)",
                "txt": "transcript as in the .trans.txt file",
                "json": "{id, speaker, chapter, sample_rate, duration}",
            },
        )


def _reasons(skipped: Sequence[Skipped]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(Counter(s.kind for s in skipped).items()))
