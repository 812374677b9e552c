"""Long audio (#26): one encoder pass over a whole recording vs the same model on 30 s windows, on synthesised
recordings of 1, 10 and 60 minutes: CER, word-time error at the true sentence boundaries, time and peak memory.

    python benchmarks/long_audio.py --checkpoint runs/whisper-cpu-window/final      # 1 / 10 / 60 min (minutes)
    python benchmarks/long_audio.py --checkpoint ... --minutes 1 --json out.json     # one length
    python benchmarks/long_audio.py build --minutes 1 10 60                         # only the recordings

Recordings (``synth_recording``, written to --data as <m>min.wav + <m>min.json): held-out sentences of the speech
corpus the cpu preset trains on (Austen, 3-15 words: its 200 test sentences, then training-split sentences beyond
the 6,000 that data/speech-synth-cpu renders, so none was heard in training), each spoken by eSpeak NG with a
random voice, variant, rate and pitch (the training ranges), 0.4-1.5 s pauses between them, 1 s of leading
silence, and pink noise over the whole recording at 20 dB below the speech. The JSON keeps the reference transcript
and each sentence's true start / end (the first / last sample of its rendering above 1% of its peak).

Methods (the same model and CTC head, greedy):
  one_pass  omni.pipelines.long_audio.one_pass: the front end in chunks, ONE encoder pass over the recording, CTC
            greedy text, CTC word times over pieces of at most 30 s (absolute)
  spans     one_pass(span_seconds=300): the trunk over 5-minute spans, each with the encoder's receptive field
            (layers x window) of context either side: the same states, the encoder's memory held for one span
  windows   omni transcribe's windows (``split_windows``: at most 30 s, cut at the quietest frame of the last 5 s),
            each window tokenised, encoded and CTC-decoded alone, its word times offset by its start

Each (method, length) runs in its own process (OMP_NUM_THREADS as set, default 1): time = the transcription with
word times (the model and the file already loaded); peak memory = the process's peak RSS during it minus its RSS
before (/proc/self/clear_refs resets the peak), and the absolute peak. Word-time error: reference and hypothesis
words aligned by edit distance; at each sentence whose first (last) word was recognised exactly, |hyp start - true
start| (|hyp end - true end|).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from _memory import reset_peak, rss_kb  # benchmarks/_memory.py: this script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ("one_pass", "spans", "windows")
SPAN_SECONDS = 300.0  # the spans method: the encoder over 5-minute spans with its receptive field of context
MINUTES = (1, 10, 60)
SAMPLE_RATE = 16000


# ----------------------------------------------------------------------------------------------------
# Recordings


def held_out_sentences(n_test: int = 200, n_train_rendered: int = 6000, min_words: int = 3, max_words: int = 15,
                       seed: int = 0, text: Sequence[str] | None = None) -> tuple[list[str], str]:
    """Sentences data/speech-synth-cpu never spoke in training (its build arguments: 200 test sentences, 6,000
    training utterances of 3-15 words, seed 0): the test sentences, then the training-split ones past the first
    ``n_train_rendered`` (the build renders train sentence i for utterance i). Also the corpus sha256, which the
    dataset's manifest records."""
    from omni.data.builders_speech import load_paragraphs, split_sentences_by_seed
    from omni.data.speech import extract_sentences

    paragraphs, _ = load_paragraphs(text)
    sentences = extract_sentences(paragraphs, min_words, max_words)
    train, test = split_sentences_by_seed(sentences, n_test, seed)
    return test + train[n_train_rendered:], hashlib.sha256("\n".join(sentences).encode()).hexdigest()


def synth_recording(minutes: float, sentences: Sequence[str], *, seed: int = 0, snr_db: float = 20.0,
                    pause: tuple[float, float] = (0.4, 1.5), lead: float = 1.0,
                    sample_rate: int = SAMPLE_RATE) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """A ``minutes``-long recording (float32, mono, ``sample_rate``) of ``sentences`` in order, each with a seeded
    random eSpeak voice / rate / pitch, pauses of ``pause`` s between them, ``lead`` s of silence first, and pink
    noise at ``snr_db`` below the speech's mean power -> (wave, [{text, start, end, voice, rate, pitch}]), start /
    end in seconds: where the sentence's rendering first / last exceeds 1% of its peak."""
    from omni.data.builders_speech import DEFAULT_VARIANTS, DEFAULT_VOICES
    from omni.data.speech import ESPEAK_RATE, _engine, noise, resample

    rng = np.random.default_rng([seed, int(minutes * 1000)])
    total = round(minutes * 60 * sample_rate)
    parts: list[np.ndarray] = [np.zeros(int(lead * sample_rate))]
    at, spoken, meta = len(parts[0]), [], []
    for sentence in sentences:
        voice = str(rng.choice(DEFAULT_VOICES))
        variant = str(rng.choice(DEFAULT_VARIANTS))
        voice = f"{voice}+{variant}" if variant else voice
        rate, pitch = int(rng.integers(130, 211)), int(rng.integers(30, 71))
        x = resample(_engine().synth(sentence, voice, rate, pitch).astype(np.float64) / 32768.0, ESPEAK_RATE,
                     sample_rate)
        gap = int(rng.uniform(*pause) * sample_rate)
        if at + len(x) > total:
            break
        loud = np.flatnonzero(np.abs(x) > 0.01 * np.abs(x).max())
        meta.append({"text": sentence, "start": (at + int(loud[0])) / sample_rate,
                     "end": (at + int(loud[-1]) + 1) / sample_rate, "voice": voice, "rate": rate, "pitch": pitch})
        parts += [x, np.zeros(gap)]
        spoken.append((at, at + len(x)))
        at += len(x) + gap
    if not meta:
        raise ValueError(f"{minutes} min holds no sentence")
    wave = np.concatenate(parts)[:total]
    wave = np.pad(wave, (0, total - len(wave)))
    power = np.mean(np.concatenate([wave[a:b] for a, b in spoken]) ** 2)
    wave = wave + noise("pink", total, rng) * np.sqrt(power / 10 ** (snr_db / 10))
    return (wave / max(1.0, np.abs(wave).max() / 0.99)).astype(np.float32), meta


def build(data: Path, minutes: Sequence[float], seed: int = 0) -> None:
    """<m>min.wav + <m>min.json in ``data`` for each length (kept when already there)."""
    import soundfile as sf

    from omni.files import write_atomic

    data.mkdir(parents=True, exist_ok=True)
    sentences, sha = held_out_sentences()
    for m in minutes:
        wav, info = data / f"{m:g}min.wav", data / f"{m:g}min.json"
        if wav.is_file() and info.is_file():
            continue
        t0 = time.perf_counter()
        wave, meta = synth_recording(m, sentences, seed=seed)
        sf.write(str(wav) + ".tmp.wav", wave, SAMPLE_RATE, subtype="PCM_16")
        os.replace(str(wav) + ".tmp.wav", wav)
        write_atomic(info, json.dumps({"minutes": m, "seed": seed, "corpus_sha256": sha, "snr_db": 20.0,
                                       "noise": "pink", "reference": " ".join(s["text"] for s in meta),
                                       "sentences": meta}, indent=1))
        print(f"{wav}: {len(meta)} sentences, {time.perf_counter() - t0:.1f} s to synthesise", flush=True)


# ----------------------------------------------------------------------------------------------------
# The two methods


def windowed(model: Any, audio_tok: Any, wave: Any, refine: bool = True) -> tuple[str, list[Any]]:
    """The 30 s windows baseline: ``split_windows`` (omni transcribe's cuts), each window's tokens encoded alone, its
    CTC head's greedy text and CTC word times (``ctc_word_timings`` with the energy refinement) offset by its start."""
    import torch

    from omni.asr_text import ctc_greedy_decode
    from omni.pipelines.transcribe import split_windows
    from omni.timestamps import ctc_word_timings, frame_energy

    sr, tps = audio_tok.sample_rate, audio_tok.tokens_per_second
    texts, words = [], []
    with torch.no_grad():
        for a, b in split_windows(wave, sr, audio_tok.max_seconds or 30.0, 5.0):
            tokens = audio_tok.encode((wave[a:b], sr)).tokens
            log_probs = model.ctc_head(model.encode(tokens[None]))[0].float().log_softmax(-1)
            text = " ".join(ctc_greedy_decode(log_probs[None])[0].split())
            texts.append(text)
            energy = frame_energy(wave[a:b], sr, tps, log_probs.shape[0]) if refine else None
            words += ctc_word_timings(log_probs, text, tps, offset=a / sr, energy=energy)[0]
    return " ".join(t for t in texts if t), words


def point(method: str, checkpoint: str, wav: Path) -> dict[str, Any]:
    """One (method, recording) in this process: text, words, seconds, peak memory."""
    import torch

    from omni.pipelines.long_audio import one_pass
    from omni.pipelines.transcribe import load_recognizer, read_audio_file

    model, audio_tok, _ = load_recognizer(checkpoint, "cpu")
    model.eval()
    wave = read_audio_file(wav, audio_tok.sample_rate)
    reset_peak()  # the peak RSS (VmHWM) from here
    before = rss_kb("VmRSS")
    cpu0, t0 = time.process_time(), time.perf_counter()
    with torch.no_grad():
        if method == "windows":
            text, words = windowed(model, audio_tok, wave)
        else:
            text, words = one_pass(model, audio_tok, wave, span_seconds=SPAN_SECONDS if method == "spans" else None)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    peak = rss_kb("VmHWM")
    return {"method": method, "seconds": seconds, "cpu_seconds": cpu, "peak_extra_mib": (peak - before) / 1024,
            "peak_mib": peak / 1024, "threads": torch.get_num_threads(), "text": text,
            "words": [[w.word, w.start, w.end] for w in words]}


# ----------------------------------------------------------------------------------------------------
# Scores


def boundary_errors(sentences: Sequence[dict[str, Any]], words: Sequence[Sequence[Any]]) -> dict[str, float]:
    """Word-time error at the true sentence boundaries: reference words (normalised) and hypothesis words aligned
    by edit distance; a sentence's start (end) is scored when its first (last) word is matched exactly."""
    from rapidfuzz.distance import Levenshtein

    from omni.asr_text import normalize_text

    ref, owner = [], []
    for k, s in enumerate(sentences):
        for w in normalize_text(s["text"]).split():
            ref.append(w)
            owner.append(k)
    hyp = [normalize_text(w[0]) for w in words]
    ids: dict[str, int] = {}
    r, h = [ids.setdefault(w, len(ids)) for w in ref], [ids.setdefault(w, len(ids)) for w in hyp]
    match = {}
    for op in Levenshtein.opcodes(r, h):
        if op.tag == "equal":
            for i in range(op.src_end - op.src_start):
                match[op.src_start + i] = op.dest_start + i
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, k in enumerate(owner):
        first.setdefault(k, i)
        last[k] = i
    errs = []
    for k, s in enumerate(sentences):
        if first[k] in match:
            errs.append(abs(words[match[first[k]]][1] - s["start"]))
        if last[k] in match:
            errs.append(abs(words[match[last[k]]][2] - s["end"]))
    e = np.array(errs) if errs else np.array([np.nan])
    return {"boundaries": len(errs), "of": 2 * len(sentences), "median_s": float(np.median(e)),
            "mean_s": float(np.mean(e)), "p90_s": float(np.percentile(e, 90)),
            "within_0.1s": float(np.mean(e <= 0.1)), "within_0.25s": float(np.mean(e <= 0.25))}


def score(result: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    from omni.asr_text import error_counts

    w_edits, w_ref, c_edits, c_ref = error_counts(info["reference"], result["text"])
    return {"cer": c_edits / c_ref, "wer": w_edits / w_ref, **boundary_errors(info["sentences"], result["words"])}


# ----------------------------------------------------------------------------------------------------
# Driver


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("command", nargs="?", default="run", choices=("run", "build"))
    ap.add_argument("--checkpoint", default="runs/whisper-cpu-window/final", help="a speech export with a windowed "
                    "encoder and a CTC head")
    ap.add_argument("--data", type=Path, default=ROOT / "data" / "long-audio", help="where the recordings are")
    ap.add_argument("--minutes", type=float, nargs="+", default=list(MINUTES))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--json", type=Path, help="write every point (scores, times, memory) here")
    ap.add_argument("--point", nargs=2, metavar=("METHOD", "WAV"), help=argparse.SUPPRESS)  # one point, internal
    args = ap.parse_args(argv)
    if args.point:
        print(json.dumps(point(args.point[0], args.checkpoint, Path(args.point[1]))))
        return
    build(args.data, args.minutes)
    if args.command == "build":
        return
    if not (Path(args.checkpoint) / "config.json").is_file():
        ap.error(f"--checkpoint {args.checkpoint}: no export there (config.json); train one first (see the notes)")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    rows = []
    print(f"{'min':>4} {'method':>9} {'CER':>7} {'WER':>7} {'bound.':>10} {'median':>7} {'p90':>6} {'<=0.1s':>7} "
          f"{'wall s':>8} {'CPU s':>8} {'peak+ MiB':>10} {'peak MiB':>9}", flush=True)
    for m in args.minutes:
        wav = args.data / f"{m:g}min.wav"
        info = json.loads((args.data / f"{m:g}min.json").read_text())
        for method in args.methods:
            out = subprocess.run([sys.executable, __file__, "--checkpoint", args.checkpoint, "--point", method,
                                  str(wav)], capture_output=True, text=True, env=env, cwd=ROOT, check=False)
            if out.returncode:
                print(f"{m:>4g} {method:>9}  failed: {out.stderr.strip().splitlines()[-1:]}", flush=True)
                rows.append({"minutes": m, "method": method, "error": out.stderr[-2000:]})
                continue
            res = json.loads(out.stdout.strip().splitlines()[-1])
            row = {"minutes": m, **score(res, info), **{k: v for k, v in res.items() if k not in ("text", "words")}}
            rows.append(row)
            print(f"{m:>4g} {method:>9} {row['cer']:>7.2%} {row['wer']:>7.2%} {row['boundaries']:>5}/{row['of']:<4} "
                  f"{row['median_s']:>7.3f} {row['p90_s']:>6.3f} {row['within_0.1s']:>7.1%} {row['seconds']:>8.1f} "
                  f"{row['cpu_seconds']:>8.1f} {row['peak_extra_mib']:>10.0f} {row['peak_mib']:>9.0f}", flush=True)
    if args.json:
        from omni.files import write_atomic

        write_atomic(args.json, json.dumps({"host": platform.processor() or platform.machine(),
                                            "checkpoint": args.checkpoint, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
