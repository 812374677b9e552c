"""Whisper-base shape, training and greedy decoding throughput: omni vs Hugging Face transformers'
WhisperForConditionalGeneration (sdpa attention), side by side in one process.

  python benchmarks/whisper_throughput.py --out whisper.json                    # every row, 1 GPU
  python benchmarks/whisper_throughput.py --only train --out whisper-train.json   # or in two runs (each
  python benchmarks/whisper_throughput.py --only decode --out whisper-decode.json # a few minutes, compiles incl.)
  OMP_NUM_THREADS=1 python benchmarks/whisper_throughput.py --device cpu --steps 2 --warmup 1 --batch 2 \
      --frames 300 --new-tokens 8                        # CPU smoke run, ~1-2 min (fp32, no compile rows)
  python benchmarks/whisper_throughput.py --dry-run --out whisper.json   # toy dims on the CPU, seconds

Shapes (defaults = the Whisper-base anchors in research/anchors.md): 6 encoder + 6 decoder layers, width 512,
8 heads, MLP 2048; random log-mel inputs (B, 80, 3000) = 30 s; random target ids. HF uses Whisper's
vocabulary size (51,865); omni its own byte-level BPE (tokenizers/bpe-8k, 8,192 tokens), so its tied LM
head is ~6x smaller: at 128 target tokens HF's head is ~6% of its model FLOPs (omni's ~1%). omni's model is the
recipe's `base` preset (recipes/whisper.py: trunk preset "whisper-base", RoPE, per-token audio stem).

Training (rows train/...): batch 32, 128 target tokens, bf16 autocast (CUDA), fused AdamW (CUDA), step =
forward + token cross-entropy + backward + optimizer. Both models start from the same (B, 80, frames)
log-mel tensor: omni's timed step includes cutting it into its per-token windows (unfold_tokens), the
work HF's conv stem does. No audio mask by default (uniform 30 s clips need none, as in HF);
--audio-mask passes an all-True key mask to omni, as the recipe's padded batches do.

Decoding (rows decode/...): greedy, batch 16 x 128 new tokens, model weights in bf16 (CUDA). Every row
generates exactly --new-tokens tokens per row (HF `generate(min_new_tokens=N, max_new_tokens=N,
do_sample=False)`; omni `min_new_tokens=N`: eos suppressed and the repetition guard held off, while its
checks still run each step); the count is asserted. tokens/s = batch x new tokens / seconds, two columns:
"memory given" (encoder output precomputed: HF `generate(encoder_outputs=...)`) and "audio in" (log-mel
-> encoder -> decoder, HF `generate(input_features=...)`). omni rows: `greedy_decode` (eager, static KV
cache, host check every --check-every tokens), `GraphedGreedyDecoder` (the same step captured in one CUDA
graph, replayed per token; on CPU it runs eagerly) and the same with the step torch.compile'd before
capture. "same tokens" compares each omni row's tokens with the eager row's.

Timing: --warmup untimed calls (compilation, graph capture), then --windows windows of --steps calls, each
window closed by a device synchronize; the median window gives the rate. --out FILE.json is rewritten
after every row, so a run cut short keeps what it measured. Compile rows run by default on CUDA only
(--compile forces them; on a CPU compiling takes minutes).

Hardware notes: the anchors (HF 561 samples/s compiled training, 3,186 tokens/s generate) were measured on
one H100 80GB HBM3 with torch 2.11.0+cu130; compare figures only within one run or one machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni.decoding import GraphedGreedyDecoder, greedy_decode
from omni.speech import SpeechRecognizer
from omni.tokenizers.audio import AudioTokenizer, unfold_tokens
from omni.tokenizers.text import TextTokenizer
from omni.trunk import preset

HF_VOCAB = 51865  # Whisper's multilingual vocabulary
DIMS = {"base": dict(d_model=512, n_layers=6, n_heads=8),  # openai/whisper-base; trunk preset "whisper-base"
        "toy": dict(d_model=64, n_layers=2, n_heads=2)}  # --dry-run: checks the script, measures nothing
ROWS = ["train/hf/eager", "train/hf/compile", "train/omni/eager", "train/omni/compile",
        "decode/hf/generate", "decode/omni/eager", "decode/omni/graph", "decode/omni/graph+compile"]


# ----------------------------------------------------------------------------------------------------
# Models: both take (log-mel (B, 80, frames), decoder input ids (B, T)) -> logits (B, T, vocab)


def hf_config(frames: int, dims: str = "base"):
    from transformers import WhisperConfig

    # openai/whisper-base's shape; max_source_positions must equal frames / 2 (HF checks the input length)
    d, layers, heads = DIMS[dims]["d_model"], DIMS[dims]["n_layers"], DIMS[dims]["n_heads"]
    return WhisperConfig(vocab_size=HF_VOCAB, num_mel_bins=80, d_model=d, encoder_layers=layers,
                         decoder_layers=layers, encoder_attention_heads=heads, decoder_attention_heads=heads,
                         encoder_ffn_dim=4 * d, decoder_ffn_dim=4 * d, max_source_positions=frames // 2,
                         max_target_positions=448)


def hf_model(frames: int, dtype: torch.dtype = torch.float32, dims: str = "base"):
    from transformers import WhisperForConditionalGeneration

    torch.manual_seed(0)
    return WhisperForConditionalGeneration._from_config(hf_config(frames, dims), attn_implementation="sdpa",
                                                        dtype=dtype)


def omni_model(dims: str = "base") -> SpeechRecognizer:
    """recipes/whisper.py's `base` preset model: trunk preset "whisper-base" for encoder and decoder."""
    torch.manual_seed(0)
    return SpeechRecognizer(AudioTokenizer(), TextTokenizer(), preset("whisper-base", **DIMS[dims]),
                            preset("whisper-base", cross_attention=True, **DIMS[dims]))


class HFTrain(nn.Module):
    def __init__(self, frames: int, dims: str = "base") -> None:
        super().__init__()
        self.model = hf_model(frames, dims=dims)

    def forward(self, mel: Tensor, ids: Tensor) -> Tensor:
        return self.model(input_features=mel, decoder_input_ids=ids, use_cache=False).logits


class OmniTrain(nn.Module):
    def __init__(self, audio_mask: bool, dims: str = "base") -> None:
        super().__init__()
        self.model, self.audio_mask = omni_model(dims), audio_mask

    def forward(self, mel: Tensor, ids: Tensor) -> Tensor:
        tokens = unfold_tokens(mel)  # (B, frames/2, 400): the tokenizer's windows, here on the device
        mask = torch.ones(tokens.shape[:2], dtype=torch.bool, device=mel.device) if self.audio_mask else None
        return self.model(tokens, mask, ids)


# ----------------------------------------------------------------------------------------------------
# Timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def seconds_per_call(fn: Callable[[], Any], device: torch.device, warmup: int, steps: int, windows: int) -> float:
    """Median over ``windows`` timed windows of ``steps`` calls (after ``warmup`` calls) of seconds per call."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        sync(device)
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


def cleanup() -> None:
    """Free the last row's models, optimizer, compiled code and CUDA graphs before the next row."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------------
# Rows


def train_row(system: str, mode: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    model = (HFTrain(args.frames, args.dims) if system == "hf" else OmniTrain(args.audio_mask, args.dims)).to(device)
    model.train()
    vocab = HF_VOCAB if system == "hf" else model.model.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    fwd = torch.compile(model) if mode == "compile" else model
    g = torch.Generator(device=device).manual_seed(0)
    mel = torch.randn(args.batch, 80, args.frames, device=device, generator=g)
    ids = torch.randint(0, vocab, (args.batch, args.target_tokens), device=device, generator=g)
    targets = torch.randint(0, vocab, (args.batch, args.target_tokens), device=device, generator=g)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = fwd(mel, ids)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    s = seconds_per_call(step, device, args.warmup, args.steps, args.windows)
    params = sum(p.numel() for p in model.parameters())
    return {"samples_per_s": args.batch / s, "ms_per_step": 1e3 * s, "params_m": params / 1e6, "vocab": vocab}


def decode_row(system: str, mode: str, args: argparse.Namespace, device: torch.device,
               reference: dict[str, list[list[int]]]) -> dict[str, Any]:
    """tokens/s with the encoder output given and from audio; for omni also whether the tokens equal the
    eager row's (``reference`` holds them once that row ran)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    B, N = args.decode_batch, args.new_tokens
    g = torch.Generator(device=device).manual_seed(1)
    mel = torch.randn(B, 80, args.frames, device=device, generator=g).to(dtype)
    result: dict[str, Any] = {}
    if system == "hf":
        from transformers.modeling_outputs import BaseModelOutput

        model = hf_model(args.frames, dtype, args.dims).to(device).eval()
        kw = dict(min_new_tokens=N, max_new_tokens=N, do_sample=False)
        with torch.no_grad():
            memory = BaseModelOutput(last_hidden_state=model.model.encoder(mel).last_hidden_state)
        calls = {"memory": lambda: model.generate(encoder_outputs=memory, **kw),
                 "audio": lambda: model.generate(input_features=mel, **kw)}
        for name, fn in calls.items():
            with torch.no_grad():
                out = fn()
            assert out.shape[0] == B and out.shape[1] >= N, f"HF generate returned {tuple(out.shape)}"
    else:
        model = omni_model(args.dims).to(device=device, dtype=dtype).eval()
        mask = torch.ones(B, args.frames // 2, dtype=torch.bool, device=device) if args.audio_mask else None
        with torch.no_grad():
            memory = model.encode(unfold_tokens(mel), mask)
        guards = dict(max_new_tokens=N, min_new_tokens=N, check_every=args.check_every)
        if mode == "eager":
            decode = lambda m: greedy_decode(model, m, mask, **guards)  # noqa: E731
        else:
            decoder = GraphedGreedyDecoder(model, graph=device.type == "cuda", compile=mode == "graph+compile",
                                           **guards)
            decode = lambda m: decoder(m, mask)  # noqa: E731
        calls = {"memory": lambda: decode(memory),
                 "audio": lambda: decode(model.encode(unfold_tokens(mel), mask))}
        with torch.no_grad():
            rows = decode(memory)
        assert [len(r) for r in rows] == [N] * B, f"omni rows hold {sorted({len(r) for r in rows})} tokens, not {N}"
        if mode == "eager":
            reference["omni"] = rows
        elif "omni" in reference:
            same = sum(a == b for ra, rb in zip(rows, reference["omni"]) for a, b in zip(ra, rb))
            result["same_tokens"] = same / (B * N)
    for name, fn in calls.items():
        with torch.no_grad():
            s = seconds_per_call(fn, device, args.warmup, args.decode_steps, args.windows)
        result[f"tokens_per_s_{name}"] = B * N / s
        result[f"ms_per_batch_{name}"] = 1e3 * s
    return result


# ----------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32, help="training batch")
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--frames", type=int, default=3000, help="log-mel frames per clip (3000 = 30 s; even)")
    ap.add_argument("--target-tokens", type=int, default=128, help="training target length")
    ap.add_argument("--new-tokens", type=int, default=128, help="greedy decoding: tokens generated per row")
    ap.add_argument("--steps", type=int, default=10, help="training steps per timed window")
    ap.add_argument("--decode-steps", type=int, default=None, help="decoded batches per timed window (default --steps)")
    ap.add_argument("--windows", type=int, default=3, help="timed windows; the median is reported")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated substrings of row ids to run, e.g. train,decode/omni; "
                    f"rows: {', '.join(ROWS)}")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="run the torch.compile rows (default: on CUDA only)")
    ap.add_argument("--check-every", type=int, default=16, help="omni decoding: tokens between 'all rows done?' checks")
    ap.add_argument("--audio-mask", action="store_true",
                    help="give omni an all-True audio key mask (the recipe's padded-batch path)")
    ap.add_argument("--out", type=Path, default=None, help="JSON file, rewritten after every row")
    ap.add_argument("--dims", choices=sorted(DIMS), default="base", help="model shape (toy: the dry run's)")
    ap.add_argument("--dry-run", action="store_true", help="toy dims on the CPU, tiny batches, one step per row, "
                    "no compile rows: checks the script, measures nothing")
    args = ap.parse_args()
    if args.dry_run:
        args.device, args.dims, args.batch, args.decode_batch, args.frames = "cpu", "toy", 2, 2, 64
        args.target_tokens, args.new_tokens, args.steps, args.decode_steps = 8, 4, 1, 1
        args.windows, args.warmup, args.compile = 1, 0, False
    if args.frames % 2:
        ap.error("--frames must be even (HF's stem halves it; omni's windows are every 2 frames)")
    if args.target_tokens > 448:
        ap.error("--target-tokens above 448 exceeds Whisper's max_target_positions")
    args.decode_steps = args.decode_steps or args.steps
    device = torch.device(args.device)
    compile_rows = device.type == "cuda" if args.compile is None else args.compile
    wanted = [w for w in args.only.split(",") if w]
    rows = [r for r in ROWS if (not wanted or any(w in r for w in wanted)) and (compile_rows or "compile" not in r)]

    import transformers

    transformers.logging.set_verbosity_error()  # generate() warns about its own default config on every call
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = f"CPU, {torch.get_num_threads()} threads"
    header = (f"{hardware}, torch {torch.__version__}, transformers {transformers.__version__}; "
              f"log-mel (B, 80, {args.frames}), train batch {args.batch} x {args.target_tokens} target tokens, "
              f"decode batch {args.decode_batch} x {args.new_tokens} new tokens")
    print(header, flush=True)
    doc: dict[str, Any] = {"hardware": hardware, "dims": args.dims, "torch": torch.__version__, "transformers": transformers.__version__,
                           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "rows": []}
    reference: dict[str, list[list[int]]] = {}
    printed: set[str] = set()
    for row in rows:
        kind, system, mode = row.split("/")
        if kind == "train":
            r = train_row(system, mode, args, device)
            if kind not in printed:
                print("\n| model | mode | train samples/s | ms/step | params (M) | vocab |\n|---|---|---|---|---|---|")
            print(f"| {system} | {mode} | {r['samples_per_s']:,.1f} | {r['ms_per_step']:,.1f} | "
                  f"{r['params_m']:.1f} | {r['vocab']:,} |", flush=True)
        else:
            r = decode_row(system, mode, args, device, reference)
            if kind not in printed:
                print("\n| model | mode | tokens/s (memory given) | tokens/s (audio in) | same tokens as omni eager |\n"
                      "|---|---|---|---|---|")
            label = mode
            if device.type != "cuda" and "graph" in mode:  # GraphedGreedyDecoder runs its step without a graph
                label += " (no CUDA: static step, no graph)"
            same = f"{r['same_tokens']:.1%}" if "same_tokens" in r else "-"
            print(f"| {system} | {label} | {r['tokens_per_s_memory']:,.0f} | {r['tokens_per_s_audio']:,.0f} | "
                  f"{same} |", flush=True)
        cleanup()
        printed.add(kind)
        doc["rows"].append({"row": row, **r})
        if args.out is not None:
            tmp = args.out.with_name(f".{args.out.name}.tmp")
            tmp.write_text(json.dumps(doc, indent=2))
            tmp.replace(args.out)  # a run killed mid-write keeps the previous rows


if __name__ == "__main__":
    main()
