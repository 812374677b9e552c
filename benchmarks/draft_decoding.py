"""Speculative decoding (omni.speculative) against greedy decoding: sequential decoder passes per token, tokens/s,
and whether the ids are identical, per model kind, drafter, draft length k and batch size.

    python benchmarks/draft_decoding.py                    # CPU, the default sizes (a few minutes on 2 cores)
    python benchmarks/draft_decoding.py --dry-run          # toy sizes: checks the script, measures nothing
    python benchmarks/draft_decoding.py --json out.json    # the rows as JSON too
    python benchmarks/draft_decoding.py --export runs/whisper-cpu-mask/final --data data/speech-synth-cpu
                                                           # a trained export on its test split: greedy,
                                                           # speculative, Mask-CTC at N = 1, 3, 10, CTC alone

With --export (a trained speech export; ``--data`` its dataset, the split ``--split``, the first ``--limit`` clips):
every decoding of the same clips at batch 1 and 16, with sequential decoder passes per output token (the
encoder's one pass not counted: every row has it), output tokens per CPU-s and per wall-s (encoder included), and
corpus CER / WER against the references (omni.speech.error_rates). Mask-CTC rows need an export trained with
mask_weight > 0, the ctc rows a CTC head; ``--draft-export`` adds a draft-model row.

Models (random weights: no trained export ships with the repository, and none can be downloaded here):

    speech  omni's SpeechRecognizer at Whisper-tiny's size (d 384, 4 layers, a CTC head), 8 s of random audio
            tokens, 96 new tokens a row, without the repetition guard (a random model repeats itself)
    gpt2    a GPT-2 (Hugging Face GPT2LMHeadModel, n_embd 384, 6 layers, 50257 tokens) converted by omni.interop,
            prompts of 30-60 tokens of Austen-like text, 64 new tokens, no guard (HF generate(do_sample=False))

Drafters: ``oracle`` proposes greedy's own continuation (``Reference`` of the greedy ids: the upper bound, every
draft right, so the row shows what verifying k + 1 positions per pass costs against one per pass), ``wrong``
(every draft wrong: the worst case, greedy's passes plus the verification overhead), ``ngram`` (prompt lookup) and
``ctc`` (the speech model's CTC head re-tokenized; on random weights it drafts noise). Acceptance on random weights
says nothing about trained models: the oracle and wrong rows bound what a drafter can give.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from typing import Any, Callable

import torch

from omni.decoding import greedy_decode
from omni.files import write_atomic
from omni.speculative import DraftStats, PromptLookup, Reference, speculative_decode
from omni.speech import SpeechRecognizer, ctc_draft
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.text import TextTokenizer
from omni.trunk import preset

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
        "the rightful property of some one or other of their daughters.")


class Counted:
    """The decoder's sequential passes: every logits / decode_hidden call is one forward."""

    def __init__(self, model: Any) -> None:
        self.model, self.passes = model, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def logits(self, *args: Any) -> torch.Tensor:
        self.passes += 1
        return self.model.logits(*args)

    def decode_hidden(self, *args: Any) -> torch.Tensor:
        self.passes += 1
        return self.model.decode_hidden(*args)


def timed(fn: Callable[[], Any], repeats: int) -> tuple[Any, float, float]:
    """fn's result, its best wall time and its best CPU time (this process, s) of ``repeats`` runs. On a shared
    machine the CPU time of a one-thread run is the steadier measure: other processes stretch the wall time."""
    wall, cpu, out = float("inf"), float("inf"), None
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        out = fn()
        wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    return out, wall, cpu


def speech_case(dry: bool, batch: int) -> tuple[Any, torch.Tensor, torch.Tensor, dict, dict]:
    audio, text = AudioTokenizer(), TextTokenizer()
    torch.manual_seed(0)
    size = dict(d_model=64, n_layers=2, n_heads=4) if dry else preset("whisper-tiny").to_dict()
    enc = preset("tiny", **{k: size[k] for k in ("d_model", "n_layers", "n_heads")})
    dec = preset("tiny", cross_attention=True, **{k: size[k] for k in ("d_model", "n_layers", "n_heads")})
    model = SpeechRecognizer(audio, text, enc, dec, ctc=True).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # enlarged weights: varied tokens rather than one repeated
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    frames = 40 if dry else int(8 * audio.tokens_per_second)
    x = torch.randn(batch, frames, audio.n_mels * audio.kernel, generator=g)
    mask = torch.ones(batch, frames, dtype=torch.bool)
    memory = model.encode(x, mask)
    # no guard and no per-clip cap: every row decodes max_new_tokens (a random model repeats itself, and the guard
    # would end it after a few tokens: nothing left to measure)
    options = dict(max_new_tokens=12 if dry else 96, tokens_per_second=None, max_repeats=None)
    drafters = {"ctc": lambda ref: ctc_draft(model, text)(memory, mask)}
    return model, memory, mask, options, drafters


def gpt2_case(dry: bool, batch: int) -> tuple[Any, torch.Tensor, torch.Tensor, dict, dict]:
    from transformers import GPT2Config, GPT2LMHeadModel

    from omni.export import get_builder
    from omni.generate import PromptedLM, TextLM
    from omni.interop.gpt2 import from_hf

    torch.manual_seed(0)
    size = dict(n_embd=64, n_layer=2, n_head=4) if dry else dict(n_embd=384, n_layer=6, n_head=6)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=256, **size)).eval()
    config, sd, toks = from_hf(hf.state_dict(), hf.config.to_dict())
    omni = get_builder(config["builder"])(config, toks)
    omni.load_state_dict(sd, strict=True)
    lm = TextLM(omni.eval(), "lm", toks["text"])
    words = TEXT.split()
    prompts = [lm.encode(" ".join(words[(7 * b) % 20:(7 * b) % 20 + 20 + b % 3 * 6])) for b in range(batch)]
    longest = max(len(p) for p in prompts)
    ids = torch.full((batch, longest), lm.pad_id, dtype=torch.long)
    mask = torch.zeros(batch, longest, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, :len(p)], mask[b, :len(p)] = torch.tensor(p), True
    options = dict(max_new_tokens=12 if dry else 64, tokens_per_second=None, max_repeats=None)
    return PromptedLM(lm), ids, mask, options, {"ngram": lambda ref: PromptLookup(prompts)}


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    cases = {"speech": speech_case, "gpt2": gpt2_case}
    ks = (1, 3) if args.dry_run else (1, 3, 5)
    for name in args.models:
        for batch in args.batches:
            model, memory, mask, options, extra = cases[name](args.dry_run, batch)
            counted = Counted(model)
            with torch.no_grad():
                ref, base, base_cpu = timed(lambda: greedy_decode(counted, memory, mask, **options), args.repeats)
            greedy_passes = counted.passes // args.repeats
            tokens = sum(len(r) for r in ref)
            rows.append(dict(model=name, batch=batch, drafter="greedy", k=0, passes=greedy_passes, tokens=tokens,
                             seconds=base, cpu_seconds=base_cpu, identical=True, acceptance=None))
            drafters: dict[str, Callable[[list[list[int]]], Any]] = {
                "oracle": lambda ref: Reference(ref),
                "wrong": lambda ref: Reference([[(t + 1) % 50000 for t in r] + [1] * 8 for r in ref]),
                **extra}
            for dname, make in drafters.items():
                for k in ks:
                    runs: list[DraftStats] = []

                    def once() -> list[list[int]]:
                        runs.append(DraftStats())
                        return speculative_decode(model, memory, mask, drafter=make(ref), draft_tokens=k,
                                                  stats=runs[-1], **options)

                    with torch.no_grad():
                        got, seconds, cpu = timed(once, args.repeats)
                    stats = runs[-1]
                    rows.append(dict(model=name, batch=batch, drafter=dname, k=k, passes=stats.passes, tokens=tokens,
                                     seconds=seconds, cpu_seconds=cpu, identical=got == ref,
                                     acceptance=round(stats.acceptance, 3)))
                    r = rows[-1]
                    print(f"{name:6s} b{batch:<3d} {dname:7s} k={k}  passes {r['passes']:4d} (greedy "
                          f"{greedy_passes})  {tokens / cpu:8.1f} tok/CPU-s (greedy {tokens / base_cpu:8.1f})  "
                          f"accept {r['acceptance']:.2f}  identical {r['identical']}", file=sys.stderr)
    return rows


def table(rows: list[dict]) -> str:
    greedy = {(r["model"], r["batch"]): r for r in rows if r["drafter"] == "greedy"}
    lines = ["| model | batch | drafter | k | passes | passes / token | tokens / CPU-s | vs greedy | tokens / wall-s | "
             "vs greedy | acceptance | identical |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = greedy[r["model"], r["batch"]]
        lines.append(f"| {r['model']} | {r['batch']} | {r['drafter']} | {r['k'] or '-'} | {r['passes']} | "
                     f"{r['passes'] / (r['tokens'] / r['batch']):.3f} | {r['tokens'] / r['cpu_seconds']:.0f} | "
                     f"{g['cpu_seconds'] / r['cpu_seconds']:.2f}x | {r['tokens'] / r['seconds']:.0f} | "
                     f"{g['seconds'] / r['seconds']:.2f}x | {'-' if r['acceptance'] is None else r['acceptance']} | "
                     f"{'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def test_clips(data: str, split: str, limit: int) -> tuple[list[torch.Tensor], list[str]]:
    """The first ``limit`` (waveform, transcript) pairs of a speech dataset's split, in shard order."""
    from omni.data.reader import ShardLoader
    from omni.tokenizers.audio import load_audio

    def decode(sample: dict) -> tuple[torch.Tensor, str]:
        field = next(f for f in ("flac", "wav", "mp3", "ogg") if f in sample)
        return load_audio(sample[field], sample_rate=16000, key=sample["__key__"]), sample["txt"].decode().strip()

    loader = ShardLoader(data, decode, list, batch_size=limit, split=split, rank=0, world_size=1, shuffle=False,
                         kind="speech")
    clips = next(iter(loader))[:limit]
    return [w for w, _ in clips], [t for _, t in clips]


def trained(args: argparse.Namespace) -> list[dict]:
    """Every decoding of a trained export on its test clips (module docstring)."""
    from omni.mask_ctc import MaskCTCStats, ctc_decode, mask_ctc_decode
    from omni.pipelines.transcribe import load_draft_recognizer, load_recognizer
    from omni.speech import decode_batch, error_rates, model_draft, ngram_draft, pad_audio

    model, audio_tok, text_tok = load_recognizer(args.export, "cpu")
    model.eval()
    waves, refs = test_clips(args.data, args.split, args.limit)
    tokens = [audio_tok.encode((w, audio_tok.sample_rate)).tokens for w in waves]
    order = sorted(range(len(tokens)), key=lambda i: tokens[i].shape[0])  # as omni transcribe batches
    trained_mask = model.mask_id is not None
    modes: list[tuple[str, Callable[[], dict]]] = [("greedy", lambda: {})]
    modes += [(f"speculative ctc k={k}", lambda k=k: dict(draft=ctc_draft(model, text_tok), draft_tokens=k,
                                                          draft_stats=DraftStats())) for k in (4,)]
    modes.append(("speculative ngram k=4", lambda: dict(draft=ngram_draft, draft_tokens=4, draft_stats=DraftStats())))
    if args.draft_export:
        small = load_draft_recognizer(args.draft_export, audio_tok, text_tok, "cpu").eval()
        modes.append(("speculative draft model k=4", lambda: dict(draft=model_draft(small), draft_tokens=4,
                                                                  draft_stats=DraftStats())))
    if trained_mask:
        def masked_at(n: int, threshold: float) -> dict:
            stats = MaskCTCStats()
            return dict(parallel=mask_ctc_decode(model, text_tok, n, threshold, stats=stats), _stats=stats)

        modes += [(f"mask-ctc N={n} p<{th}", lambda n=n, th=th: masked_at(n, th)) for th in args.threshold
                  for n in (1, 3, 10)]
    modes.append(("ctc", lambda: dict(parallel=ctc_decode(model, text_tok))))
    rows = []
    for batch in args.batches:
        for name, make in modes:
            counted = Counted(model)
            hyps: dict[int, str] = {}
            passes = out_tokens = 0
            wall = cpu = 0.0
            for lo in range(0, len(order), batch):
                chunk = order[lo:lo + batch]
                x, mask = pad_audio([tokens[i] for i in chunk])
                options = make()
                mstats = options.pop("_stats", None)
                counted.passes = 0
                with torch.no_grad():
                    ids, w, c = timed(lambda: decode_batch(counted, x, mask, max_new_tokens=args.max_new_tokens,
                                                           **options), 1)
                stats = options.get("draft_stats") or mstats
                passes += counted.passes + (mstats.passes if mstats is not None else 0)
                wall, cpu = wall + w, cpu + c
                out_tokens += sum(len(r) + (0 if "parallel" in options else 1) for r in ids)  # greedy's eos a token
                for i, r in zip(chunk, ids):
                    hyps[i] = text_tok.decode(r)
            rates = error_rates(refs, [hyps[i] for i in range(len(refs))])
            rows.append(dict(mode=name, batch=batch, passes=passes, tokens=out_tokens, seconds=wall, cpu_seconds=cpu,
                             cer=rates["cer"], wer=rates["wer"], stats=None if stats is None else vars(stats),
                             masked=mstats.masked if mstats is not None else None))
            r = rows[-1]
            print(f"b{batch:<3d} {name:28s} passes/token {passes * batch / out_tokens:.3f}  "
                  f"{out_tokens / cpu:7.0f} tok/CPU-s "
                  f"CER {100 * r['cer']:.1f}%  WER {100 * r['wer']:.1f}%", file=sys.stderr)
    return rows


def trained_table(rows: list[dict]) -> str:
    greedy = {r["batch"]: r for r in rows if r["mode"] == "greedy"}
    lines = ["| batch | decoding | sequential decoder passes / token | tokens / CPU-s | vs greedy | tokens / wall-s | "
             "CER | WER |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = greedy[r["batch"]]
        speed = (r["tokens"] / r["cpu_seconds"]) / (g["tokens"] / g["cpu_seconds"])
        # per row: a batch's pass serves every row of it
        lines.append(f"| {r['batch']} | {r['mode']} | {r['passes'] * r['batch'] / r['tokens']:.3f} | "
                     f"{r['tokens'] / r['cpu_seconds']:.0f} | {speed:.2f}x | {r['tokens'] / r['seconds']:.0f} | "
                     f"{100 * r['cer']:.1f}% | {100 * r['wer']:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="toy sizes: checks the script, measures nothing")
    ap.add_argument("--models", nargs="+", choices=("speech", "gpt2"), default=["speech", "gpt2"])
    ap.add_argument("--batches", nargs="+", type=int, default=None, help="batch sizes (default: 1 16; dry run: 1 3)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per row, the best kept (default 3; dry 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--export", default=None, help="a trained speech export: its test clips, every decoding")
    ap.add_argument("--data", default="data/speech-synth-cpu", help="--export: the dataset directory")
    ap.add_argument("--split", default="test", help="--export: the split decoded")
    ap.add_argument("--limit", type=int, default=200, help="--export: the first N clips")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="--export: the recipe's eval limit")
    ap.add_argument("--threshold", type=float, nargs="+", default=None,
                    help="--export: Mask-CTC's confidence thresholds (default: omni.mask_ctc's)")
    ap.add_argument("--draft-export", default=None, help="--export: a smaller speech export that drafts")
    args = ap.parse_args(argv)
    args.batches = args.batches or ([1, 3] if args.dry_run else [1, 16])
    args.repeats = args.repeats or (1 if args.dry_run else 3)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.export:
        from omni.mask_ctc import DEFAULT_THRESHOLD

        args.threshold = args.threshold or [DEFAULT_THRESHOLD]
        rows = trained(args)
        header = (f"{datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                  f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.export} on the first "
                  f"{args.limit} clips of {args.data} {args.split}")
        print(header)
        print(trained_table(rows))
        if args.json:
            write_atomic(args.json, json.dumps({"header": header, "rows": rows}, indent=1))
        return 0
    rows = run(args)
    header = (f"{datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    header += " (DRY RUN: measures nothing)" if args.dry_run else ""
    print(header)
    print(table(rows))
    if args.json:
        write_atomic(args.json, json.dumps({"header": header, "rows": rows}, indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
