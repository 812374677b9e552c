"""Word-timestamp accuracy on synthesised speech whose word boundaries are known.

Test set: held-out sentences (the test split of the speech dataset the model was trained on, never heard in
training). Each word is rendered alone by eSpeak NG (voice en-us, 175 wpm, pitch 50, the synthesiser of
omni/data/speech.py), its leading and trailing silence trimmed (first / last sample above -40 dB of the word's
peak), and the words are concatenated with seeded random pauses of 0.1-0.5 s (0.3 s before the first and after
the last): every word's true start and end are known to the sample. Word times then come from
omni.pipelines.timing.time_windows on the model's own CTC head / cross-attention, for the reference transcript
(forced: timing alone, not recognition) and for the model's own transcript (the `omni transcribe` path: words
scored where they match the reference). The boundary error is |predicted - true| over every word start and end.

    python benchmarks/timestamps.py --checkpoint runs/whisper-ts/final       # an export with a CTC head
    python benchmarks/timestamps.py --train                                  # train it first (the command below)

``--train`` runs recipes/whisper.py with TRAIN_SETTINGS (the tiny preset, widened, on clean eSpeak speech with
CTC weight 0.5). ``--calibrate`` measures the energy refinement's threshold (omni.timestamps.LOUD_FRACTION) on
sentences of the TRAIN split (not the test set) and prints the errors per threshold.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omni.data.builders_speech import load_paragraphs, split_sentences_by_seed  # noqa: E402
from omni.data.speech import ESPEAK_RATE, _engine, add_noise, extract_sentences, resample  # noqa: E402
from omni.pipelines.transcribe import load_recognizer, transcribe_waveforms  # noqa: E402
from omni.speech import normalize_text  # noqa: E402
import omni.timestamps as ts  # noqa: E402

DATA, OUT = "data/speech-synth-ts", "runs/whisper-ts"
BUILD = {"train": 3000, "test": 60, "voices": ["en-us", "en"], "variants": ["", "m3", "f2"], "snrs": [None],
         "max_words": 12}
TRAIN_SETTINGS = [f"data='{DATA}'", f"out='{OUT}'", f"build={BUILD!r}",
                  "trunk_overrides={'d_model': 128, 'n_layers': 4}", "steps=1500", "batch_size=24", "lr=2e-3", "warmup_steps=100", "ctc_weight=0.5", "workers=2",
                  "eval_every=0", "checkpoint_every=0", "log_every=100", "progress=False"]
SR = 16000
TRIM_DB = 40.0


def word_audio(word: str, voice: str = "en-us", rate: int = 175, pitch: int = 50) -> np.ndarray:
    """One word spoken alone at 16 kHz, trimmed to its first and last sample above -TRIM_DB of its peak."""
    pcm = _engine().synth(word, voice, rate, pitch)
    x = resample(pcm.astype(np.float64) / 32768.0, ESPEAK_RATE, SR)
    loud = np.flatnonzero(np.abs(x) > np.abs(x).max() * 10 ** (-TRIM_DB / 20))
    return x[loud[0]:loud[-1] + 1]


def concatenated(sentence: str, rng: np.random.Generator, snr: float | None = None
                 ) -> tuple[torch.Tensor, list[tuple[str, float, float]]]:
    """The sentence's words rendered one by one and joined with random pauses (white noise at ``snr`` dB over
    all of it, if given) -> (waveform, [(word, start, end)])."""
    parts, truth, t = [np.zeros(int(0.3 * SR))], [], 0.3
    words = [w for w, _, _ in ts.transcript_words(sentence)]  # a lone "-" is joined to its word, as omni does
    for k, word in enumerate(words):
        x = word_audio(word)
        truth.append((word, t, t + len(x) / SR))
        gap = 0.3 if k == len(words) - 1 else rng.uniform(0.1, 0.5)
        parts += [x, np.zeros(int(gap * SR))]
        t += len(x) / SR + len(parts[-1]) / SR
    x = np.concatenate(parts)
    if snr is not None:  # its own generator: the clean and noisy sets have the same pauses
        x = add_noise(x, snr, "white", np.random.default_rng(zlib.crc32(sentence.encode())))
    return torch.from_numpy(x).float(), truth


def sentences(split: str, n: int, seed: int = 0) -> list[str]:
    """``n`` sentences of the dataset's test split (held out from training), or of its train split's tail
    (sentences past the ones the training set used: for calibration)."""
    paragraphs, _ = load_paragraphs(None)
    train, test = split_sentences_by_seed(extract_sentences(paragraphs, 3, BUILD["max_words"]), BUILD["test"], seed)
    return test[:n] if split == "test" else train[-n:]


def errors(pred: list[ts.WordTiming], truth: list[tuple[str, float, float]]) -> tuple[list[float], list[float], int]:
    """Signed start and end errors (s) of the predicted words that match reference words (by normalised text,
    in order: difflib's matching blocks), and how many reference words were matched."""
    import difflib

    p = [normalize_text(w.word) for w in pred]
    r = [normalize_text(w) for w, _, _ in truth]
    starts, ends, matched = [], [], 0
    for block in difflib.SequenceMatcher(a=p, b=r, autojunk=False).get_matching_blocks():
        for k in range(block.size):
            w, (_, s, e) = pred[block.a + k], truth[block.b + k]
            starts.append(w.start - s)
            ends.append(w.end - e)
            matched += 1
    return starts, ends, matched


def summary(starts: list[float], ends: list[float], matched: int, total: int) -> dict[str, float]:
    both = np.abs(np.r_[starts, ends]) * 1000
    return {"median_ms": round(float(np.median(both)), 1), "p90_ms": round(float(np.percentile(both, 90)), 1),
            "mean_ms": round(float(both.mean()), 1), "start_bias_ms": round(float(np.mean(starts)) * 1000, 1),
            "end_bias_ms": round(float(np.mean(ends)) * 1000, 1), "words": matched, "of": total}


def measure(model, audio, text, clips, modes) -> dict[str, dict[str, float]]:
    waves = [w for w, _ in clips]
    refs = [" ".join(w for w, _, _ in truth) for _, truth in clips]
    total = sum(len(t) for _, t in clips)
    results = {}
    hyps = None
    for name, (method, refine, own) in modes.items():
        if own and hyps is None:
            hyps = transcribe_waveforms(model, audio, text, waves, max_new_tokens=64)
        texts = hyps if own else refs
        timed = ts.time_windows(model, audio, text, waves, texts, [0.0] * len(waves), method=method, refine=refine)
        S, E, m = [], [], 0
        for (words, _), (_, truth) in zip(timed, clips):
            s, e, k = errors(words, truth)
            S, E, m = S + s, E + e, m + k
        results[name] = summary(S, E, m, total)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=f"{OUT}/final")
    ap.add_argument("--train", action="store_true", help="train the model first (recipes/whisper.py)")
    ap.add_argument("--sentences", type=int, default=60, help="held-out test sentences (default: all 60)")
    ap.add_argument("--calibrate", action="store_true", help="sweep LOUD_FRACTION on train-split sentences")
    ap.add_argument("--snr", type=float, default=None, help="white noise at this SNR (dB) over the test audio "
                    "(default: clean; the pauses are then digital silence)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--example", metavar="WAV", help="only write the first held-out test clip (with --snr, noisy) to "
                    "this WAV file and print its words' true times (for `omni transcribe --alignment`)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.train:
        sys.path.insert(0, str(ROOT / "recipes"))
        import whisper as recipe

        recipe.main(["--preset", "tiny", "--set", *TRAIN_SETTINGS])
    if args.example:
        import soundfile as sf

        wave, truth = concatenated(sentences("test", 1)[0], np.random.default_rng(0), args.snr)
        sf.write(args.example, wave.numpy(), SR, subtype="PCM_16")
        print(" ".join(f"{w} {a:.3f}-{b:.3f}" for w, a, b in truth))
        return 0
    model, audio, text = load_recognizer(args.checkpoint, device="cpu")
    model.eval()
    rng = np.random.default_rng(0)
    start = time.time()
    if args.calibrate:
        clips = [concatenated(s, rng, args.snr) for s in sentences("train", 20)]
        for fraction in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6):
            ts.LOUD_FRACTION = fraction
            ts.refine_with_energy.__defaults__ = (fraction, ts.refine_with_energy.__defaults__[1])
            print(fraction, measure(model, audio, text, clips, {"ctc+energy": ("ctc", True, False)}), flush=True)
        return 0
    clips = [concatenated(s, rng, args.snr) for s in sentences("test", args.sentences)]
    modes = {"ctc, reference transcript": ("ctc", False, False),
             "ctc + energy refinement, reference transcript": ("ctc", True, False),
             "cross-attention DTW, reference transcript": ("attention", False, False),
             "ctc + energy refinement, model's own transcript": ("ctc", True, True)}
    results = measure(model, audio, text, clips, modes)
    seconds = sum(w.shape[0] for w, _ in clips) / SR
    noise = "clean" if args.snr is None else f"white noise at {args.snr:g} dB SNR"
    print(f"{len(clips)} held-out sentences ({noise}), {sum(len(t) for _, t in clips)} words, "
          f"{seconds:.0f} s of audio; checkpoint {args.checkpoint}; measured in {time.time() - start:.0f} s")
    print("| word times from | median | 90th pct | mean | start bias | end bias | words scored |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['median_ms']} ms | {r['p90_ms']} ms | {r['mean_ms']} ms | {r['start_bias_ms']:+} ms "
              f"| {r['end_bias_ms']:+} ms | {r['words']} / {r['of']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
