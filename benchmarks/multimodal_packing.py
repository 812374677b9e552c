"""Packed FlexAttention rows vs padded SDPA batches: training throughput on the multimodal recipe's data (issue #5).

  python benchmarks/multimodal_packing.py --out multimodal_packing.json                  # H100: recipe preset base
  python benchmarks/multimodal_packing.py --row-length 8192 --out multimodal_packing_8k.json     # 4 rows of 8,192
  python benchmarks/multimodal_packing.py --row-length 16384 --out multimodal_packing_16k.json   # 2 rows of 16,384
  python benchmarks/multimodal_packing.py --compile --warmup 4 --out multimodal_packing_compile.json  # + torch.compile
  python benchmarks/multimodal_packing.py --data-only    # every variant's shapes and padding, no model (any machine)
  OMP_NUM_THREADS=1 python benchmarks/multimodal_packing.py --device cpu --preset tiny --steps 2 --warmup 1 \
      --row-length 1024 --tokens-per-step 2048                                      # CPU smoke run (~15 s)

The issue's bar: on an H100, packed FlexAttention batches >= 1.5x the useful (non-pad) tokens/s of padded SDPA
batches on the same mixed-length data, the BlockMask built once per batch and reused by every layer, with the
mask-building cost and the fraction of padding removed reported.

Data: the samples recipes/multimodal.py trains on, with synthetic inputs of the right shapes (no dataset needed on
the GPU machine) going through the REAL tokenizers, tasks, mixing loader and packer, so token counts, roles and
masks are the recipe's. The recipe's preset (--preset, default "base": trunk "S" = d384 / 12 layers / 6 heads,
2-D RoPE, 8 rows x 4096 tokens) gives the trunk, the task specs, the task weights and the packing shape:
  image  Fashion-MNIST-shaped uint8 (1, 28, 28) random pixels -> ImageTokenizer(patch, resize 28) -> 49 tokens at
         patch 4 (16 at the tiny preset's patch 7), bidirectional, ClassifyTask.
  asr    eSpeak-like utterances (the speech-synth builder's rules: words ~ U{3..25}, speaking rate
         ~ U(130, 210) wpm; a tiny preset's max_words applies) + 0.3 s of silence -> 1.2-11.8 s of random audio ->
         AudioTokenizer (log-mel, 50 tokens/s; pre-encoded once, as the recipe caches them) + a transcript of
         round(1.3 x words) BPE tokens (single-token vocabulary words, "<bos><|transcribe|> ... <eos>"):
         TranscribeTask, a prefix-LM.
  rl     CartPole-shaped episodes (state 4, 2 actions) of 8-60 steps (25%, scripted-random-like) or 100-500 steps ->
         TrajectoryTokenizer windows of `context` steps at a random start (3 x 20 = 60 tokens), ActionTask.
  text   "paragraphs" with log-normal BPE lengths fitted to the recipe's Austen corpus (median 58, log-sd 0.84,
         max_tokens 256 as the recipe keeps), strings of vocabulary words -> TextTokenizer, LMTask.
A step's samples are one MixtureLoader.draw (the recipe's mixing: one of every task, then weighted draws placed
first-fit into the rows until max_misses misses). Every variant trains on exactly those samples.

Variants (--variants), all on the same MultitaskModel (embedders + trunk + every head + every task loss):
  packed-flex      the recipe's path: rows x row_length packed tokens, ONE FlexAttention BlockMask per batch
                   (omni.packing.block_mask, built from per-block summaries), handed to every layer.
  packed-sdpa      the same packed rows with the same rule as a dense (rows, 1, T, T) bool mask, SDPA: isolates the
                   gain from Flex's block sparsity (packed rows are long, so dense attention does T^2 work).
  padded-max       one sample per row, padded to the batch's longest sample (rounded up to --pad-multiple),
                   SDPA with the dense bool mask of the same rule (omni.packing.dense_mask: bidirectional inside
                   image/audio, causal text/actions, prefix-LM transcripts, pad keys never visible).
  padded-bucketed  the stronger padded baseline: the step's samples sorted by length and split into --buckets
                   contiguous buckets (the split that minimises padding, by dynamic programming), each bucket one
                   padded SDPA forward + backward, gradients accumulated, one optimizer step.
Step = build the mask(s) + forward + losses + backward + clip_grad_norm_(1.0) + AdamW (fused on CUDA) + zero_grad;
bf16 autocast on CUDA (fp32 on CPU; --amp/--no-amp). Batches are moved to the device before timing (data loading
is not timed); the mask is built inside the timed step. Fresh model (same seed) and optimizer per variant.

Reported per variant: rows x T, total and useful tokens per step, padding fraction, median step time, useful and
total tokens/s (sums over the timed steps / summed step times), the mask build time per step (median, measured in
a separate synchronized loop over the same batches after a warm-up) and its share of the median step, peak device
memory, and packed-flex's speedup over the variant. "padding removed" = 1 - pad tokens of packed-flex / pad tokens
of the padded variant.

Equality check first (unless --no-check): --check-samples samples of the first batch, fp32 (TF32 off), on the
device: per-sample trunk outputs of packed-flex vs padded-max, padded-bucketed and packed-sdpa, plus the total loss
and every parameter gradient of packed-flex vs padded-max (the per-task losses are means over the same targets, so
they are equal too). Pass = max abs output diff <= --tolerance (1e-4) and loss diff <= tolerance x max(1, loss);
the relative gradient diff is reported, not gated. A failed check is printed and recorded, the timing still runs,
and the exit status is 1.

CPU: FlexAttention has no CPU backward (torch 2.11), so a CPU training step of packed-flex builds its BlockMask (the
cost reported) and attends with the dense mask of the same rule, as the CPU recipe does; its forward-only outputs
in the equality check do go through eager Flex. CPU timings only show that the script runs.

Results: Markdown to stdout; --out FILE.json is rewritten after the check and after every variant, so a timeout keeps
what was measured (an out-of-memory variant is recorded as such and the run goes on). Nothing is appended to
benchmarks/results.md automatically.

Notes for the GPU run: the first packed-flex step compiles the Flex kernels (forward + backward; the warm-up steps
absorb it). block_mask has host syncs (mixed.any(), nonzero()), so the CPU cannot queue the next step ahead while a
mask is built; that cost is inside the step times. --compile: per-modality token counts and padded shapes change
every batch, so dynamo recompiles once to dynamic shapes during warm-up (use --warmup >= 4; TORCH_LOGS=recompiles
shows it). The Packer returns its per-modality dicts in modality-name order, so dict order never recompiles.
Compare figures only within one run / one machine.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import math
import platform
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from omni.config import defaults
from omni.mixture import MixedBatch, MixtureLoader, pack_mixed
from omni.multitask import MultitaskModel
from omni.packing import PackedBatch, Packer
from omni.segment import Sample
from omni.tasks import ActionTask, ClassifyTask, LMTask, Task, TranscribeTask
from omni.tokenizers.audio import AudioTokenizer
from omni.tokenizers.image import ImageTokenizer
from omni.tokenizers.text import TextTokenizer
from omni.tokenizers.trajectory import TrajectoryTokenizer
from omni.trunk import preset

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["packed-flex", "packed-sdpa", "padded-max", "padded-bucketed"]
DESCRIPTION = {
    "packed-flex": "packed rows, FlexAttention BlockMask",
    "packed-sdpa": "packed rows, dense-mask SDPA",
    "padded-max": "1 sample/row, pad to max, dense-mask SDPA",
    "padded-bucketed": "{k} length buckets, pad per bucket, dense-mask SDPA",
}

# Synthetic-data constants (module docstring).
SILENCE_S = 0.3  # lead + trail silence of a synthesised utterance
BPE_PER_WORD = 1.3  # BPE tokens per English word (bpe-8k on Austen)
TEXT_LOG_MEAN, TEXT_LOG_SD = 4.01, 0.84  # log of Austen paragraph lengths in bpe-8k tokens (<= 256 kept)
CARTPOLE = dict(state_dim=4, n_actions=2, max_timestep=501)
SPEECH = dict(min_words=3, max_words=25, rates=(130, 210))  # omni.data.builders_speech.build_speech_synth defaults


# ----------------------------------------------------------------------------------------------------
# Recipe config and synthetic tasks


def recipe_config(name: str) -> dict[str, Any]:
    """{**COMMON's defaults, **PRESETS[name]} of recipes/multimodal.py (loaded from its file: recipes/ is no
    package)."""
    spec = importlib.util.spec_from_file_location("multimodal_recipe", ROOT / "recipes" / "multimodal.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    if name not in module.PRESETS:
        raise SystemExit(f"unknown recipe preset {name!r}; choose from {', '.join(module.PRESETS)}")
    return {**defaults(module.COMMON), **copy.deepcopy(module.PRESETS[name]), "preset": name}


def vocabulary_words(text: TextTokenizer) -> list[str]:
    """Words that are one bpe-8k token each when preceded by a space ("Ġword" entries)."""
    vocab = text.hf.get_vocab()
    return sorted(k[1:] for k in vocab if k.startswith("Ġ") and k[1:].isalpha() and k[1:].isascii())


def words_string(rng: np.random.Generator, words: Sequence[str], n: int) -> str:
    """A string that encodes to exactly n BPE tokens (n >= 1): " w1 w2 ... wn"."""
    return " " + " ".join(words[int(i)] for i in rng.integers(len(words), size=max(1, n)))


def text_lengths(rng: np.random.Generator, n: int, max_tokens: int) -> list[int]:
    """Paragraph lengths (bos + eos included): log-normal fitted to the Austen corpus, those above max_tokens
    redrawn (the recipe drops longer paragraphs), at least 4 tokens."""
    out: list[int] = []
    while len(out) < n:
        x = int(round(math.exp(rng.normal(TEXT_LOG_MEAN, TEXT_LOG_SD))))
        if 4 <= x <= max_tokens:
            out.append(x)
    return out


def build_tasks(cfg: dict[str, Any], pool: int, seed: int) -> list[Task]:
    """The recipe's four tasks (its specs and weights) over synthetic items of the right shapes."""
    rng = np.random.default_rng(seed)
    text = TextTokenizer()
    words = vocabulary_words(text)
    tasks: list[Task] = []
    for name, spec in cfg["tasks"].items():
        kind, w = spec["kind"], float(spec.get("weight", 1.0))
        lw = float(spec.get("loss_weight", 1.0))
        if kind == "classify":
            image = ImageTokenizer(patch_size=spec.get("patch", 4), channels=1, image_size=28, policy="resize")
            items = [torch.from_numpy(rng.integers(0, 256, (1, 28, 28), dtype=np.uint8)) for _ in range(pool)]
            labels = rng.integers(0, 10, pool).tolist()
            tasks.append(ClassifyTask(name, image, items, labels, 10, weight=w, loss_weight=lw))
        elif kind == "transcribe":
            audio = AudioTokenizer()
            clips, transcripts = [], []
            speech = {**SPEECH, **spec.get("build", {}), **spec}  # shards- or synth-sourced: same utterance rules
            lo, hi = speech["rates"]
            for i in range(pool):
                n_words = int(rng.integers(speech["min_words"], speech["max_words"] + 1))
                seconds = n_words * 60.0 / rng.uniform(lo, hi) + SILENCE_S
                wave = (rng.standard_normal(int(seconds * audio.sample_rate)) * 0.05).astype(np.float32)
                clips.append(audio.encode(wave, key=f"{name}/{i}"))  # pre-encoded, as the recipe's cache
                transcripts.append(words_string(rng, words, round(BPE_PER_WORD * n_words)))
            tasks.append(TranscribeTask(name, audio, text, clips, transcripts, weight=w, loss_weight=lw))
        elif kind == "action":
            tok = TrajectoryTokenizer(context=spec.get("context", 20), **CARTPOLE)
            episodes = []
            for i in range(pool):
                T = int(rng.integers(8, 61) if rng.random() < 0.25 else rng.integers(100, 501))
                episodes.append({"observations": rng.standard_normal((T + 1, 4)).astype(np.float32),
                                 "actions": rng.integers(0, 2, T), "rewards": np.ones(T, np.float32), "key": str(i)})
            tasks.append(ActionTask(name, tok, episodes, weight=w, loss_weight=lw))
        elif kind == "lm":
            texts = [words_string(rng, words, n - 2) for n in text_lengths(rng, pool, spec.get("max_tokens", 256))]
            tasks.append(LMTask(name, text, texts, weight=w, loss_weight=lw))
        else:
            raise SystemExit(f"task {name!r}: kind {kind!r} is not one of the recipe's built-in four")
    return tasks


# ----------------------------------------------------------------------------------------------------
# Layouts: the same samples packed, padded to the max, or padded per length bucket


class RowPacker(Packer):
    """Packer with a given row assignment and block size (padded rows need not be multiples of 128)."""

    def __init__(self, row_length: int, rows: list[list[int]], block_size: int) -> None:
        super().__init__(row_length=row_length, block_size=block_size)
        self._rows = rows

    def rows_for(self, samples: Sequence[Sample]) -> list[list[int]]:
        return self._rows


def round_up(n: int, multiple: int) -> int:
    return multiple * -(-n // multiple)


def padded(samples: Sequence[Sample], tasks: Sequence[int], names: Sequence[str], group: Sequence[int],
           multiple: int) -> MixedBatch:
    """One sample per row, padded to the group's longest (rounded up to ``multiple``)."""
    rows = [[i] for i in group]
    T = round_up(max(len(samples[i]) for i in group), multiple)
    batch = RowPacker(T, rows, multiple)(samples)
    return MixedBatch(**{f.name: getattr(batch, f.name) for f in fields(PackedBatch)},
                      document_task=torch.tensor([tasks[i] for i in group], dtype=torch.long),
                      task_names=tuple(names))


def bucket_split(lengths: Sequence[int], k: int, multiple: int) -> list[list[int]]:
    """Sort by length and split into <= k contiguous buckets minimising sum(bucket size x padded max length)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    L = np.array([round_up(lengths[i], multiple) for i in order], dtype=np.float64)
    n, k = len(order), max(1, min(k, len(order)))
    cost = np.full((k + 1, n + 1), np.inf)
    cut = np.zeros((k + 1, n + 1), dtype=np.int64)
    cost[0, 0] = 0.0
    a = np.arange(n + 1)
    for j in range(1, k + 1):
        for i in range(1, n + 1):  # bucket (a, i]: (i - a) rows of L[i - 1] tokens
            c = cost[j - 1, :i] + (i - a[:i]) * L[i - 1]
            cut[j, i] = int(np.argmin(c))
            cost[j, i] = c[cut[j, i]]
    j = int(np.argmin(cost[1:, n])) + 1  # fewer buckets when that pads no more
    bounds, i = [], n
    while j > 0:
        bounds.append((int(cut[j, i]), i))
        i, j = int(cut[j, i]), j - 1
    return [[order[t] for t in range(lo, hi)] for lo, hi in reversed(bounds) if hi > lo]


Layout = list[tuple[MixedBatch, list[int]]]  # sub-batches (one forward/backward each), sample index per document


def layouts(draw: tuple[list[Sample], list[int], list[list[int]]], names: Sequence[str], row_length: int,
            variants: Sequence[str], buckets: int, multiple: int) -> dict[str, Layout]:
    """Each variant's sub-batches for one step's samples."""
    samples, tasks, rows = draw
    out: dict[str, Layout] = {}
    packed = (pack_mixed(samples, tasks, names, row_length, rows),  # the recipe's own batch
              [i for row in rows for i in row])
    for v in variants:
        if v in ("packed-flex", "packed-sdpa"):
            out[v] = [packed]
        elif v == "padded-max":
            group = list(range(len(samples)))
            out[v] = [(padded(samples, tasks, names, group, multiple), group)]
        elif v == "padded-bucketed":
            groups = bucket_split([len(s) for s in samples], buckets, multiple)
            out[v] = [(padded(samples, tasks, names, g, multiple), g) for g in groups]
    return out


def mask_for(variant: str, batch: MixedBatch, train: bool = False):
    """The variant's attention mask, built once per (sub-)batch and handed to every layer.

    FlexAttention has no CPU backward (torch 2.11), so a CPU *training* step of packed-flex builds the BlockMask
    (its cost is the one reported) and then attends with the dense mask of the same rule (the CPU recipe's path)."""
    if variant != "packed-flex":
        return batch.attention_mask("dense")
    mask = batch.attention_mask("block")
    if train and not batch.document.is_cuda:
        return batch.attention_mask("dense")
    return mask


def documents_of(batch: MixedBatch) -> list[tuple[int, Tensor]]:
    """(document number, flat token indices in token order) per document of a batch."""
    flat = batch.document.flatten()
    return [(d, (flat == d).nonzero().flatten()) for d in range(batch.num_documents)]


# ----------------------------------------------------------------------------------------------------
# Equality check


def equality_check(tasks: list[Task], trunk, draw, names, args, device) -> dict[str, Any]:
    """fp32 per-sample outputs of every variant vs packed-flex; loss and grads of packed-flex vs padded-max."""
    samples, task_ids, _ = draw
    k = min(args.check_samples, len(samples))
    sub, sub_tasks = samples[:k], task_ids[:k]  # the first samples of a draw are one of every task
    rows = Packer(row_length=args.row_length).rows_for(sub)
    variants = [v for v in VARIANTS if v in args.variants or v in ("packed-flex", "padded-max")]
    lay = layouts((sub, sub_tasks, rows), names, args.row_length, variants, args.buckets, args.pad_multiple)
    torch.manual_seed(args.seed)
    model = MultitaskModel(tasks, trunk).to(device)
    result: dict[str, Any] = {"samples": k, "tokens": sum(len(s) for s in sub), "tolerance": args.tolerance}

    def outputs(variant: str) -> dict[int, Tensor]:
        """sample index -> (n, d) trunk output, fp32."""
        per: dict[int, Tensor] = {}
        for b, order in lay[variant]:
            b = b.to(device)
            with torch.no_grad():
                hidden = model.omni(b, mask_for(variant, b)).reshape(-1, trunk.d_model)
            for d, idx in documents_of(b):
                per[order[d]] = hidden[idx].float()
        return per

    def loss_and_grads(variant: str) -> tuple[float, float, list[Tensor]]:
        """(loss with the variant's own mask, no grad; loss and grads of a training step, which on CPU for
        packed-flex attends with the dense mask: Flex has no CPU backward)."""
        b = lay[variant][0][0].to(device)
        with torch.no_grad():
            own = float(model(b, mask_for(variant, b))[0])
        model.zero_grad(set_to_none=True)
        loss, _ = model(b, mask_for(variant, b, train=True))
        loss.backward()
        return own, float(loss.detach()), [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                                  for p in model.parameters()]

    ref = outputs("packed-flex")
    ok = True
    for v in lay:
        if v == "packed-flex":
            continue
        other = outputs(v)
        assert set(other) == set(ref), f"{v}: samples differ"
        err = max(float((ref[i] - other[i]).abs().max()) for i in ref)
        result[f"max_abs_out_diff/{v}"] = err
        ok &= err <= args.tolerance
    la, la_train, ga = loss_and_grads("packed-flex")
    lb, _, gb = loss_and_grads("padded-max")
    result["loss/packed-flex"], result["loss/padded-max"] = la, lb
    result["loss_abs_diff/padded-max"] = max(abs(la - lb), abs(la_train - lb))
    # reported, not gated: a parameter whose gradient is nearly zero everywhere makes this ratio noisy
    result["max_rel_grad_diff/padded-max"] = max(
        float((x - y).abs().max() / (y.abs().max() + 1e-12)) for x, y in zip(ga, gb))
    if device.type != "cuda":
        result["note"] = "CPU: packed-flex gradients come from the packed rows with the dense mask (no Flex backward)"
    ok &= result["loss_abs_diff/padded-max"] <= args.tolerance * max(1.0, abs(lb))
    result["passed"] = bool(ok)
    return result


# ----------------------------------------------------------------------------------------------------
# Timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_variant(variant: str, tasks: list[Task], trunk, steps_data: list[list[MixedBatch]], useful: list[int],
                args, device: torch.device) -> dict[str, Any]:
    """Warm-up + timed training steps of one variant; its mask build time in a separate synchronized loop."""
    torch.manual_seed(args.seed)
    model = MultitaskModel(tasks, trunk).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.05, fused=device.type == "cuda")
    step_fn = model if not args.compile else torch.compile(model)
    amp = args.amp

    def step(subs: list[MixedBatch], scales: list[float]) -> None:
        for b, scale in zip(subs, scales):
            mask = mask_for(variant, b, train=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss, _ = step_fn(b, mask)
            (loss * scale).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    # gradient accumulation over buckets: each bucket's loss weighted by its share of the step's real tokens
    scales = [[b.num_tokens / n for b in subs] for subs, n in zip(steps_data, useful)]
    batches = [[b.to(device) for b in subs] for subs in steps_data]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for i in range(args.warmup):
        step(batches[i], scales[i])
    sync(device)
    warmup_s = time.perf_counter() - t0
    times = []
    for i in range(args.warmup, args.warmup + args.steps):
        t = time.perf_counter()
        step(batches[i], scales[i])
        sync(device)
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    # Mask build per step (all sub-batches of the step), synchronized, after one warm-up build.
    for b in batches[0]:
        mask_for(variant, b)
    mask_times = []
    for i in range(args.warmup, args.warmup + args.steps):
        sync(device)
        t = time.perf_counter()
        for b in batches[i]:
            mask_for(variant, b)
        sync(device)
        mask_times.append(time.perf_counter() - t)
    timed = range(args.warmup, args.warmup + args.steps)
    total = [sum(b.document.numel() for b in steps_data[i]) for i in timed]
    used = [useful[i] for i in timed]
    first = steps_data[args.warmup]
    step_ms, mask_ms = statistics.median(times) * 1e3, statistics.median(mask_times) * 1e3
    description = DESCRIPTION[variant].format(k=args.buckets)
    if variant == "packed-flex" and device.type != "cuda":
        description += " (CPU: BlockMask built, dense-mask attention: no Flex CPU backward)"
    out = {
        "variant": variant, "description": description,
        "forwards_per_step": statistics.mean(len(steps_data[i]) for i in timed),
        "shape_first_step": [list(b.shape) for b in first],
        "tokens_per_step": statistics.mean(total), "useful_tokens_per_step": statistics.mean(used),
        "padding_fraction": 1 - sum(used) / sum(total),
        "step_ms": step_ms, "step_ms_min": min(times) * 1e3, "step_ms_max": max(times) * 1e3,
        "useful_tokens_per_s": sum(used) / sum(times), "total_tokens_per_s": sum(total) / sum(times),
        "mask_ms": mask_ms, "mask_share": mask_ms / step_ms, "peak_gib": peak, "warmup_s": warmup_s,
    }
    return out  # model, optimizer and device batches go with this frame; main() then empties the cache


# ----------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="base", help="recipes/multimodal.py preset: trunk, tasks, packing shape")
    ap.add_argument("--d-model", type=int, default=None, help="override the preset trunk's width")
    ap.add_argument("--layers", type=int, default=None, help="override the preset trunk's depth")
    ap.add_argument("--heads", type=int, default=None, help="override the preset trunk's head count")
    ap.add_argument("--row-length", type=int, default=None, help="packed row length (default: the preset's)")
    ap.add_argument("--tokens-per-step", type=int, default=None,
                    help="packed tokens per step = rows x row-length (default: the preset's rows x row_length)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (each a different batch)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (Flex compile happens here)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}")
    ap.add_argument("--buckets", type=int, default=8, help="padded-bucketed: length buckets per step")
    ap.add_argument("--pad-multiple", type=int, default=16, help="padded rows: length rounded up to this")
    ap.add_argument("--pool", type=int, default=256, help="synthetic items per task (drawn with replacement)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                    help="bf16 autocast (default: on CUDA only)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (Flex is compiled regardless)")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                    help="fp32 equality check of the variants before timing")
    ap.add_argument("--check-samples", type=int, default=12)
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--data-only", action="store_true",
                    help="build the data and print every variant's shapes and padding, run no model (memory planning)")
    ap.add_argument("--out", type=Path, default=None, help="JSON file, rewritten after the check and every variant")
    args = ap.parse_args()

    device = torch.device(args.device)
    if device.type == "cpu":  # eager Flex (the CPU forward) warns on every first call; expected here
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    args.amp = device.type == "cuda" if args.amp is None else args.amp
    args.variants = [v for v in args.variants.split(",") if v]
    if bad := [v for v in args.variants if v not in VARIANTS]:
        ap.error(f"unknown variants {bad}; choose from {', '.join(VARIANTS)}")
    cfg = recipe_config(args.preset)
    args.row_length = args.row_length or cfg["row_length"]
    args.tokens_per_step = args.tokens_per_step or cfg["rows"] * cfg["row_length"]
    if args.row_length % 128 or args.tokens_per_step % args.row_length:
        ap.error("--row-length must be a multiple of 128 and --tokens-per-step a multiple of --row-length")
    rows = args.tokens_per_step // args.row_length
    overrides = dict(cfg["trunk_overrides"])
    for key, value in (("d_model", args.d_model), ("n_layers", args.layers), ("n_heads", args.heads)):
        if value is not None:
            overrides[key] = value
    trunk = preset(cfg["trunk"], positions=cfg["positions"], **overrides)

    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads"
    t0 = time.perf_counter()
    tasks = build_tasks(cfg, args.pool, args.seed)
    names = [t.name for t in tasks]
    loader = MixtureLoader(tasks, row_length=args.row_length, rows=rows, seed=args.seed, max_misses=cfg["max_misses"])
    n_batches = args.warmup + args.steps
    draws = [loader.draw(0, i) for i in range(n_batches)]
    per_step = [layouts(d, names, args.row_length, args.variants, args.buckets, args.pad_multiple) for d in draws]
    useful = [sum(len(s) for s in d[0]) for d in draws]
    data_s = time.perf_counter() - t0

    # Data summary: per task, samples per step and token lengths.
    lengths: dict[str, list[int]] = {n: [] for n in names}
    for samples, task_ids, _ in draws:
        for s, t in zip(samples, task_ids):
            lengths[names[t]].append(len(s))
    n_params = sum(p.numel() for p in MultitaskModel(tasks, trunk).parameters())
    header = (f"{hardware}, torch {torch.__version__}; recipe preset {args.preset}: trunk {cfg['trunk']} "
              f"(d{trunk.d_model}, {trunk.n_layers} layers, {trunk.n_heads} heads, {cfg['positions']}), "
              f"{n_params / 1e6:.2f}M parameters; packed {rows} x {args.row_length} tokens per step; "
              f"{'bf16 autocast' if args.amp else 'fp32'}{', torch.compile' if args.compile else ''}; "
              f"{args.warmup} warm-up + {args.steps} timed steps (data built in {data_s:.1f} s)")
    print(header, flush=True)
    print("\n| task | samples/step | tokens min / median / max | token share |\n|---|---|---|---|")
    all_tokens = sum(sum(v) for v in lengths.values())
    data_summary = {}
    for n, ls in lengths.items():
        q = np.percentile(ls, [0, 50, 100]).astype(int).tolist()
        data_summary[n] = {"samples_per_step": len(ls) / n_batches, "min": q[0], "median": q[1], "max": q[2],
                           "token_share": sum(ls) / all_tokens}
        print(f"| {n} | {len(ls) / n_batches:.1f} | {q[0]} / {q[1]} / {q[2]} | {sum(ls) / all_tokens:.1%} |")
    print(f"\nuseful tokens per step: {statistics.mean(useful):,.0f} (same samples in every variant); "
          f"samples per step: {statistics.mean(len(d[0]) for d in draws):.1f}", flush=True)

    for variant in args.variants:
        total = [sum(b.document.numel() for b, _ in p[variant]) for p in per_step]
        biggest = max((b.shape for p in per_step for b, _ in p[variant]), key=lambda s: s[0] * s[1])
        print(f"{variant}: {statistics.mean(len(p[variant]) for p in per_step):.1f} forwards/step, "
              f"{statistics.mean(total):,.0f} tokens/step (max {max(total):,}), padding "
              f"{1 - sum(useful) / sum(total):.1%}, largest sub-batch {biggest[0]} x {biggest[1]}", flush=True)
    if args.data_only:
        return 0

    doc: dict[str, Any] = {"hardware": hardware, "torch": torch.__version__, "header": header,
                           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "trunk": trunk.to_dict(), "params": n_params, "rows": rows, "data": data_summary,
                           "check": None, "results": []}

    def save() -> None:
        if args.out is not None:
            args.out.write_text(json.dumps(doc, indent=2))

    status = 0
    if args.check:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        check = equality_check(tasks, trunk, draws[0], names, args, device)
        doc["check"] = check
        diffs = ", ".join(f"{k.split('/')[1]} {v:.2e}" for k, v in check.items() if k.startswith("max_abs_out_diff"))
        print(f"\nequality check (fp32, {check['samples']} samples, {check['tokens']} tokens): max abs output diff "
              f"vs packed-flex: {diffs}; loss packed-flex {check['loss/packed-flex']:.6f} vs padded-max "
              f"{check['loss/padded-max']:.6f}; max rel grad diff {check['max_rel_grad_diff/padded-max']:.2e} -> "
              f"{'PASSED' if check['passed'] else 'FAILED'} (tolerance {args.tolerance:g})"
              + (f" [{check['note']}]" if "note" in check else ""), flush=True)
        if not check["passed"]:
            status = 1
        save()
        cleanup(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    print("\n| variant | forwards/step x shape | tokens/step | useful tokens/step | padding | step ms (min-max) "
          "| mask ms (share) | useful tok/s | total tok/s | peak GiB | packed-flex speedup |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for variant in args.variants:
        steps_data = [[b for b, _ in p[variant]] for p in per_step]
        try:
            r = run_variant(variant, tasks, trunk, steps_data, useful, args, device)
        except torch.OutOfMemoryError:
            traceback.print_exc(limit=1)
            r = {"variant": variant, "description": DESCRIPTION[variant].format(k=args.buckets), "oom": True}
        # outside the except block: the exception's traceback no longer holds the variant's tensors
        if args.compile:
            torch._dynamo.reset()
        cleanup(device)
        if r.get("oom"):
            print(f"| {variant} | out of memory | | | | | | | | | |", flush=True)
            doc["results"].append(r)
            save()
            continue
        results[variant] = r
        base = results.get("packed-flex")
        if base is not None:
            r["packed_flex_speedup"] = base["useful_tokens_per_s"] / r["useful_tokens_per_s"]
            pad_packed = base["tokens_per_step"] - base["useful_tokens_per_step"]
            pad_this = r["tokens_per_step"] - r["useful_tokens_per_step"]
            r["padding_removed_by_packing"] = 1 - pad_packed / pad_this if pad_this > 0 else float("nan")
        shape = " + ".join(f"{b[0]}x{b[1]}" for b in r["shape_first_step"][:3])
        if len(r["shape_first_step"]) > 3:
            shape += f" + ... ({len(r['shape_first_step'])} buckets)"
        speed = f"{r['packed_flex_speedup']:.2f}x" if "packed_flex_speedup" in r else "-"
        peak = "-" if math.isnan(r["peak_gib"]) else f"{r['peak_gib']:.1f}"
        print(f"| {variant}: {r['description']} | {shape} | {r['tokens_per_step']:,.0f} | "
              f"{r['useful_tokens_per_step']:,.0f} | {r['padding_fraction']:.1%} | {r['step_ms']:,.1f} "
              f"({r['step_ms_min']:,.1f}-{r['step_ms_max']:,.1f}) | "
              f"{r['mask_ms']:,.2f} ({r['mask_share']:.1%}) | {r['useful_tokens_per_s']:,.0f} | "
              f"{r['total_tokens_per_s']:,.0f} | {peak} | {speed} |", flush=True)
        doc["results"].append(r)
        save()

    base = results.get("packed-flex")
    if base is not None:
        print(f"\npacked-flex: BlockMask built once per batch in {base['mask_ms']:.2f} ms (median), "
              f"{base['mask_share']:.1%} of the {base['step_ms']:.1f} ms step; padding {base['padding_fraction']:.1%}.")
        for v, r in results.items():
            if v.startswith("padded"):
                print(f"vs {v}: {r['packed_flex_speedup']:.2f}x useful tokens/s; padding removed "
                      f"{r['padding_removed_by_packing']:.1%} ({r['padding_fraction']:.1%} -> "
                      f"{base['padding_fraction']:.1%} of the tokens)")
    save()
    return status


if __name__ == "__main__":
    sys.exit(main())
