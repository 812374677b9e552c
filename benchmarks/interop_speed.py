"""Fine-tuning speed of converted checkpoints vs their own library, same weights, same batch, one process.

  python benchmarks/interop_speed.py vit [--arch vit_base_patch16_224] [--batch 256] [--steps 15]
  python benchmarks/interop_speed.py whisper [--dims base] [--batch 32] [--steps 15]
  python benchmarks/interop_speed.py vit whisper --modes compile --out interop.json   # both, one process
  add --device cpu --smoke for a seconds-long CPU check of the script itself (tiny models, no timing claims)

vit:     timm's model (eager and torch.compile) vs the omni export omni.interop.timm made of it (eager, compile).
whisper: HF WhisperForConditionalGeneration (eager, compile) vs the omni export omni.interop.whisper made of it,
         teacher-forced on 30 s log-mel windows and 64-token transcripts (the fine-tuning step).
Before timing, the converted model's fp32 output is checked against the peer's on the batch (max |diff| printed),
so the two sides compute the same function. Step = forward + backward + fused AdamW, bf16 autocast on CUDA;
median of --steps after 3 warm-up steps. Issue #18's bars: ViT-B/16 >= 1.2x timm+compile, Whisper-base >= 1.5x HF.
--out FILE.json: {family: {"model", "max_abs_diff", "rows": [{"side", "mode", "rate", "unit"}]}}, rewritten after
every row (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from contextlib import nullcontext
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni.export import get_builder

WHISPER_DIMS = {  # (d_model, heads, encoder layers, decoder layers, n_mels): openai-whisper's released sizes
    "tiny": (384, 6, 4, 4, 80), "base": (512, 8, 6, 6, 80), "small": (768, 12, 12, 12, 80),
    "smoke": (64, 2, 2, 2, 80),
}


def build_omni(export: tuple) -> nn.Module:
    config, state_dict, tokenizers = export
    model = get_builder(config["builder"])(config, tokenizers)
    model.load_state_dict(state_dict, strict=True)
    return model


def time_steps(step: Callable[[], None], steps: int, device: str) -> float:
    """Median seconds per call after 3 warm-up calls."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(3):
        step()
    sync()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def train_step(model: nn.Module, loss_of: Callable[[nn.Module], Tensor], device: str) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.startswith("cuda"))
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.startswith("cuda") else nullcontext

    def step() -> None:
        with autocast():
            loss = loss_of(model)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


class Results:
    """What the families measured, as JSON rewritten after every row (--out)."""

    def __init__(self, out: Path | None) -> None:
        self.out, self.doc = out, {"torch": torch.__version__}

    def family(self, family: str, **info) -> dict:
        self.doc[family] = {**info, "rows": []}
        self.save()
        return self.doc[family]

    def save(self) -> None:
        if self.out is not None:
            tmp = self.out.with_name(f".{self.out.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(self.doc, indent=2))
            os.replace(tmp, self.out)


def vit(args: argparse.Namespace) -> list[tuple[str, float]]:
    import timm

    from omni.interop.timm import from_timm

    arch = "vit_tiny_patch16_224" if args.smoke else args.arch
    torch.manual_seed(0)
    small = dict(img_size=32, depth=2) if args.smoke else {}  # smoke: 4 patches, 2 blocks
    peer = timm.create_model(arch, num_classes=1000, **small).to(args.device)
    size = peer.patch_embed.img_size[0]
    ours = build_omni(from_timm({k: v.cpu() for k, v in peer.state_dict().items()}, peer.cpu())).to(args.device)
    peer.to(args.device)
    images = torch.rand(args.batch, 3, size, size, device=args.device)  # in [0, 1]: omni normalises inside
    labels = torch.randint(0, 1000, (args.batch,), device=args.device)
    mean = torch.tensor(peer.pretrained_cfg["mean"], device=args.device).view(1, 3, 1, 1)
    std = torch.tensor(peer.pretrained_cfg["std"], device=args.device).view(1, 3, 1, 1)
    with torch.no_grad():
        diff = (ours(images[:2]) - peer((images[:2] - mean) / std)).abs().max().item()
    print(f"{arch}: omni vs timm fp32 logits max |diff| {diff:.2e}")
    args.record = args.results.family("vit", model=arch, max_abs_diff=diff, batch=args.batch)
    peer_loss = lambda m: F.cross_entropy(m((images - mean) / std), labels)  # noqa: E731
    our_loss = lambda m: F.cross_entropy(m(images), labels)  # noqa: E731
    return run_modes(args, {"timm": (peer, peer_loss), "omni": (ours, our_loss)}, args.batch, "img")


def whisper(args: argparse.Namespace) -> list[tuple[str, float]]:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from omni.interop.whisper import from_hf

    d, heads, enc, dec, mels = WHISPER_DIMS["smoke" if args.smoke else args.dims]
    frames = 100 if args.smoke else 3000  # log-mel frames: 30 s windows (smoke: 1 s)
    config = WhisperConfig(vocab_size=51865, num_mel_bins=mels, d_model=d, encoder_attention_heads=heads,
                           decoder_attention_heads=heads, encoder_layers=enc, decoder_layers=dec,
                           encoder_ffn_dim=4 * d, decoder_ffn_dim=4 * d, max_source_positions=frames // 2,
                           max_target_positions=448)
    torch.manual_seed(0)
    peer = WhisperForConditionalGeneration(config).eval()
    ours = build_omni(from_hf(peer.state_dict(), config.to_dict())).to(args.device)
    peer.to(args.device)
    batch = 2 if args.smoke else args.batch
    mel = torch.randn(batch, mels, frames, device=args.device)
    text = torch.randint(0, 50257, (batch, 65), device=args.device)
    inputs, targets = text[:, :-1], text[:, 1:]
    pairs = mel.transpose(1, 2).reshape(batch, frames // 2, 2 * mels)  # omni's Whisper tokens: frame pairs (B, S, 2 n_mels)
    with torch.no_grad():
        diff = (ours(pairs[:1], None, inputs[:1]) - peer(input_features=mel[:1], decoder_input_ids=inputs[:1]).logits)
    print(f"whisper {'smoke' if args.smoke else args.dims}: omni vs HF fp32 logits max |diff| {diff.abs().max().item():.2e}")
    args.record = args.results.family("whisper", model=f"whisper-{'smoke' if args.smoke else args.dims}",
                                      max_abs_diff=diff.abs().max().item(), batch=batch)

    def peer_loss(m: nn.Module) -> Tensor:
        logits = m(input_features=mel, decoder_input_ids=inputs).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def our_loss(m: nn.Module) -> Tensor:
        return F.cross_entropy(m(pairs, None, inputs).flatten(0, 1).float(), targets.flatten())

    return run_modes(args, {"hf": (peer.train(), peer_loss), "omni": (ours.train(), our_loss)}, batch, "utt")


def run_modes(args: argparse.Namespace, models: dict, batch: int, unit: str) -> list[tuple[str, float]]:
    rows = []
    for name, (model, loss_of) in models.items():
        for mode in args.modes.split(","):
            fwd = model if mode == "eager" else torch.compile(model)
            seconds = time_steps(train_step(fwd, loss_of, args.device), 1 if args.smoke else args.steps, args.device)
            rows.append((f"{name} {mode}", batch / seconds))
            args.record["rows"].append({"side": name, "mode": mode, "rate": batch / seconds, "unit": unit})
            args.results.save()
            print(f"| {name} | {mode} | {batch / seconds:,.1f} {unit}/s |", flush=True)
            torch._dynamo.reset()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("family", nargs="+", choices=("vit", "whisper"), help="one or both, run in this order")
    ap.add_argument("--arch", default="vit_base_patch16_224")
    ap.add_argument("--dims", default="base", choices=sorted(WHISPER_DIMS))
    ap.add_argument("--batch", type=int, default=None, help="default: 256 (vit), 32 (whisper)")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny models, one timed step: checks the script only")
    ap.add_argument("--out", type=Path, default=None, help="JSON file, rewritten after every row")
    args = ap.parse_args()
    batch = args.batch
    if args.smoke:
        batch, args.modes = 2, "eager"
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    args.results = Results(args.out)
    args.results.doc["device"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    for family in args.family:
        args.batch = batch or (256 if family == "vit" else 32)
        rows = {"vit": vit, "whisper": whisper}[family](args)
        best = {side: max(v for n, v in rows if n.startswith(side)) for side in {n.split()[0] for n, _ in rows}}
        peer = next(s for s in best if s != "omni")
        print(f"omni best / {peer} best: {best['omni'] / best[peer]:.2f}x")


if __name__ == "__main__":
    main()
