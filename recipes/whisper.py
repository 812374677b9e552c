"""Whisper-style speech recognition on the shared trunk: log-mel audio tokens -> bidirectional encoder;
BPE text -> causal decoder with cross-attention -> tied LM head. Model, decoding and metrics: omni/speech.py.

    python recipes/whisper.py                          # synthetic eSpeak NG speech (built if missing), preset for the device
    python recipes/whisper.py --preset tiny            # CPU smoke run
    python recipes/whisper.py --preset base --data shards/librispeech --set steps=100000
    accelerate launch --num_processes 8 recipes/whisper.py --preset base --data ...

--data takes a dataset directory written by `omni data speech-synth` or `omni data librispeech` (webdataset
shards of <key>.flac|wav + <key>.txt + manifest.json). --set key=value overrides any config entry.

Text tokenizer: the shipped byte-level BPE `tokenizers/bpe-8k` by default (fitted on the same public-domain
Austen novels the synthetic speech reads, so it covers the transcripts; no fitting step, identical on every
rank). `--set bpe_vocab=N` instead fits an N-token BPE on the training transcripts, saved under
<out>/tokenizers/text (use it for other languages or domains). Either way the tokenizer is exported with the
model, so `omni transcribe --checkpoint <out>/final file.wav` needs nothing else.

At the end the test split is transcribed (greedy) and corpus WER/CER (omni.speech.normalize_text) are printed
and written to <out>/eval.json.
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from omni.config import recipe_config, recipe_parser
from omni.data.reader import ShardLoader
from omni.data.shards import read_manifest
from omni.speech import (SpeechCollate, SpeechLoss, SpeechRecognizer, ctc_greedy_decode, error_counts,
                         greedy_decode, speech_example)
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.text import TextTokenizer
from omni.train import TrainConfig, Trainer, process_state, unwrap
from omni.trunk import preset

# ---------------------------------------------------------------------------------------------------
# Config. Every entry can be overridden with --set key=value.

COMMON = dict(
    data="data/speech-synth", build=dict(train=20000, test=500), out="runs/whisper",
    trunk="whisper-base", trunk_overrides={}, bpe_vocab=None, max_seconds=30.0,
    ctc_weight=0.3,  # hybrid CTC/attention: weight of the encoder's CTC loss (0: decoder loss only, no CTC head)
    audio_positions="none",  # "sinusoidal": Whisper's absolute positions added to the audio embeddings
    batch_size=64, steps=6000, lr=1e-3, min_lr_ratio=0.02, warmup_steps=500, weight_decay=0.05, clip_norm=1.0,
    workers=8, compile=False, eval_every=1000, checkpoint_every=1000, limit_eval=None, eval_batch_size=64,
    max_new_tokens=224, seed=0, progress=True, log_every=10,
)
PRESETS: dict[str, dict] = {
    # CPU smoke test: a few steps of a tiny trunk on a few dozen synthesised utterances.
    "tiny": dict(data="data/speech-synth-tiny", build=dict(train=64, test=16), out="runs/whisper-tiny",
                 trunk="tiny", batch_size=16, steps=40, lr=3e-3, warmup_steps=5, workers=0, eval_every=0,
                 checkpoint_every=0, eval_batch_size=16, max_new_tokens=64),
    # Whisper-base shape: 6 encoder + 6 decoder layers, width 512, 8 heads (one GPU).
    # lr: Whisper-base's 1e-3 is for batch 256; at batch 64 it diverged on the H100 (non-finite gradients at
    # step 537, right after warm-up), so 5e-4 (the square-root batch rule).
    # 3,000 steps on the H100: test CER 2.67%, WER 4.95% in 463 s, compilation and evaluations included
    # (benchmarks/results.md, session 5).
    "base": dict(trunk="whisper-base", batch_size=64, steps=3000, lr=5e-4, warmup_steps=500, compile=True),
}


def parse_args(argv=None) -> dict:
    ap = recipe_parser(__doc__, PRESETS, "base on CUDA, tiny otherwise",
                       data_help="dataset directory (manifest.json + shards with audio + .txt)")
    args = ap.parse_args(argv)
    updates = {"data": args.data, "build": None} if args.data else {}
    if args.out:
        updates["out"] = args.out
    cfg = recipe_config(ap, args, COMMON, PRESETS, "base" if torch.cuda.is_available() else "tiny", updates)
    return cfg


# ---------------------------------------------------------------------------------------------------
# Data

AUDIO_FIELDS = ("flac", "wav", "mp3", "ogg", "opus")


class DecodeSpeech:
    """Raw shard sample -> SpeechCollate item. Picklable for data workers. Clips longer than the audio
    tokenizer's max_seconds are dropped (a truncated clip would not match its transcript)."""

    def __init__(self, audio: AudioTokenizer, text: TextTokenizer) -> None:
        self.audio, self.text = audio, text

    def __call__(self, sample: dict) -> dict[str, Any] | None:
        key = sample.get("__key__", "")
        field = next((f for f in AUDIO_FIELDS if f in sample), None)
        if field is None or "txt" not in sample:
            raise ValueError(f"sample {key!r} needs an audio field ({', '.join(AUDIO_FIELDS)}) and a .txt transcript")
        transcript = sample["txt"].decode("utf-8").strip()
        try:
            return speech_example(self.audio, self.text, sample[field], transcript, key=key)
        except ValueError as exc:
            if "longer than max_seconds" in str(exc):
                warnings.warn(f"dropping {key!r}: {exc}", stacklevel=2)
                return None
            raise


def ensure_data(cfg: dict, rank: int, world: int) -> Path:
    data = Path(cfg["data"])
    if not (data / "manifest.json").is_file():
        if not cfg["build"]:
            raise FileNotFoundError(f"{data}/manifest.json not found: build the dataset with "
                                    "`omni data speech-synth` or `omni data librispeech`")
        if rank == 0:
            from omni.data.builders_speech import build_speech_synth

            print(f"synthesising speech shards in {data} ...", flush=True)
            build_speech_synth(data, **cfg["build"], seed=cfg["seed"])
        if world > 1:
            torch.distributed.barrier()
    return data


def read_transcripts(data: Path, split: str) -> list[str]:
    """Every transcript of a split (for fitting the BPE), read with the same loader on one process."""
    loader = ShardLoader(data, _transcript, list, batch_size=1024, split=split, rank=0, world_size=1,
                         shuffle=False, fields=("txt",))
    return [t for batch in loader for t in batch][: loader.num_samples]


def _transcript(sample: dict) -> str:
    return sample["txt"].decode("utf-8").strip()


def make_text_tokenizer(cfg: dict, data: Path, rank: int, world: int) -> TextTokenizer:
    if cfg["bpe_vocab"] is None:
        return TextTokenizer()
    path = Path(cfg["out"]) / "tokenizers" / "text"
    if rank == 0 and not (path / "tokenizer.json").is_file():
        tok = TextTokenizer().fit(read_transcripts(data, "train"), vocab_size=int(cfg["bpe_vocab"]))
        tok.save(path)
    if world > 1:
        torch.distributed.barrier()
    return TextTokenizer.load(path)


# ---------------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    state = process_state()
    rank, world = state.process_index, state.num_processes
    data = ensure_data(cfg, rank, world)
    manifest = read_manifest(data / "manifest.json")
    eval_split = "test" if "test" in manifest["splits"] else next((s for s in manifest["splits"] if s != "train"), None)
    audio = AudioTokenizer(max_seconds=cfg["max_seconds"])
    text = make_text_tokenizer(cfg, data, rank, world)
    decode = DecodeSpeech(audio, text)
    collate = SpeechCollate(text.pad_id)
    workers = cfg["workers"] if state.device.type == "cuda" else min(cfg["workers"], 2)
    train_data = ShardLoader(data, decode, collate, cfg["batch_size"], split="train", rank=rank, world_size=world,
                             shuffle=True, seed=cfg["seed"], num_workers=workers, drop_last=True)
    eval_data = None
    if eval_split is not None:
        eval_data = ShardLoader(data, decode, collate, cfg["eval_batch_size"], split=eval_split, rank=rank,
                                world_size=world, shuffle=False, num_workers=workers)

    encoder = preset(cfg["trunk"], **cfg["trunk_overrides"])
    decoder = preset(cfg["trunk"], cross_attention=True, **cfg["trunk_overrides"])
    torch.manual_seed(cfg["seed"])
    model = SpeechRecognizer(audio, text, encoder, decoder, ctc=cfg["ctc_weight"] > 0,
                             audio_positions=cfg["audio_positions"])
    # limit_eval: greedy-decode (for WER/CER) only the first limit_eval samples of each evaluation pass
    eval_batches = len(eval_data) if eval_data is not None else 1
    calls = {"n": 0}

    def eval_fn(model, batch):
        """Per-sample loss and (greedy-decoded) word/char edit counts: corpus WER = mean(word_edits) /
        mean(words), since every metric is averaged over the same samples. With a CTC head also the char edits
        of its best path (ctc_char_edits: what the encoder alone hears)."""
        m = unwrap(model)
        ctc_logits = None
        if m.ctc_head is not None:
            logits, ctc_logits = m(batch.audio, batch.audio_mask, batch.text, ctc=True)
        else:
            logits = m(batch.audio, batch.audio_mask, batch.text)
        keep = batch.targets != -100
        nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), batch.targets, reduction="none")
        loss = (nll * keep).sum(1) / keep.sum(1)
        out = {"loss": loss}
        position = calls["n"] % eval_batches  # batch index within the current pass
        calls["n"] += 1
        if cfg["limit_eval"] is None or position * cfg["eval_batch_size"] < cfg["limit_eval"]:
            memory = m.encode(batch.audio, batch.audio_mask)
            ids = greedy_decode(m, memory, batch.audio_mask, max_new_tokens=cfg["max_new_tokens"], check_every=8)
            refs = [text.decode(ref) for ref in batch.text.tolist()]
            counts = [error_counts(ref, text.decode(row)) for row, ref in zip(ids, refs)]
            c = torch.tensor(counts, dtype=torch.float32, device=loss.device)
            out.update(word_edits=c[:, 0], words=c[:, 1], char_edits=c[:, 2], chars=c[:, 3])
            if ctc_logits is not None:
                heard = ctc_greedy_decode(ctc_logits, batch.audio_mask)
                out["ctc_char_edits"] = torch.tensor([error_counts(ref, hyp)[2] for ref, hyp in zip(refs, heard)],
                                                     dtype=torch.float32, device=loss.device)
        return out

    config = TrainConfig(
        output_dir=cfg["out"], steps=cfg["steps"], lr=cfg["lr"], min_lr_ratio=cfg["min_lr_ratio"],
        warmup_steps=cfg["warmup_steps"], weight_decay=cfg["weight_decay"], clip_norm=cfg["clip_norm"],
        compile=cfg["compile"], eval_every=cfg["eval_every"], checkpoint_every=cfg["checkpoint_every"],
        seed=cfg["seed"], run_name=f"whisper-{cfg['preset']}", progress=cfg["progress"], log_every=cfg["log_every"],
    )
    export = {"builder": "omni.speech:build_speech_recognizer", "encoder": encoder.to_dict(),
              "decoder": decoder.to_dict(), "ctc": cfg["ctc_weight"] > 0, "audio_positions": cfg["audio_positions"]}
    trainer = Trainer(model, SpeechLoss(cfg["ctc_weight"]), train_data, config, eval_data=eval_data, eval_fn=eval_fn,
                      hparams=cfg, export_config=export, export_tokenizers={"audio": audio, "text": text})
    if state.is_main_process:
        n_params = sum(p.numel() for p in unwrap(trainer.model).parameters())
        print(f"Whisper preset {cfg['preset']}: {n_params / 1e6:.2f}M parameters, {cfg['steps']} steps "
              f"({len(train_data)} per epoch), vocab {text.vocab_size}, {trainer.accelerator.device}", flush=True)
    start = time.time()
    metrics = trainer.fit()
    if state.is_main_process:
        if "eval/words" in metrics:
            metrics["eval/wer"] = metrics["eval/word_edits"] / max(metrics["eval/words"], 1e-12)
            metrics["eval/cer"] = metrics["eval/char_edits"] / max(metrics["eval/chars"], 1e-12)
            if "eval/ctc_char_edits" in metrics:
                metrics["eval/ctc_cer"] = metrics["eval/ctc_char_edits"] / max(metrics["eval/chars"], 1e-12)
        result = {"seconds": round(time.time() - start, 1), **{k: v for k, v in metrics.items()
                                                               if isinstance(v, (int, float))}}
        Path(cfg["out"]).mkdir(parents=True, exist_ok=True)
        (Path(cfg["out"]) / "eval.json").write_text(json.dumps(result, indent=2, sort_keys=True))
        print(f"done in {result['seconds']:.0f} s: test WER {metrics.get('eval/wer', math.nan):.4f} "
              f"CER {metrics.get('eval/cer', math.nan):.4f} (loss {metrics.get('eval/loss', math.nan):.4f}); "
              f"model exported to {trainer.export_dir}", flush=True)
    return metrics


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
