"""ViT-B/16 training/inference throughput: omni vs timm vs torchvision, side by side in one process.

  python benchmarks/vit_throughput.py [--batch 256] [--steps 15] [--only omni,timm,torchvision] [--profile]
      [--modes eager,compile,max-autotune-no-cudagraphs] [--inductor coordinate_descent_tuning=True]
      [--omni "attention='flex',bias=False"] [--train-only] [--out vit.json]
  python benchmarks/vit_throughput.py --dry-run --out vit.json   # toy models on the CPU (benchmarks/gpu_check.sh)

Random data, 224px, 1000 classes, bf16 autocast, fused AdamW, step = forward + backward + optimizer;
median step time after warm-up. MFU against a measured bf16 matmul peak (8192^3 GEMM).
--out FILE.json is rewritten after every row (a run cut short keeps what it measured). --dry-run: the same code
on the CPU with toy models (width 64, 2 layers, 32px images, batch 2, 1 step, eager), fp32: it measures nothing.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni.heads import ClassificationHead
from omni.tokenizers.image import ImageTokenizer, grid_positions, patchify
from omni.trunk import Trunk, preset

VIT_B16_GFLOP_FWD = 35.1  # per 224px image (research/anchors.md); training = 3x
TOY = dict(d_model=64, n_layers=2, n_heads=2)  # --dry-run's trunk (timm/torchvision: the same width and depth)
TOY_IMAGE = 32


class OmniViT(nn.Module):
    """Image tokenizer embedder -> shared trunk -> mean-pool ClassificationHead (uniform-batch fast path)."""

    def __init__(self, n_classes: int = 1000, size: str = "B", patch: int = 16, image: int = 224,
                 attention: str = "sdpa", **trunk_overrides) -> None:
        super().__init__()
        self.patch = patch
        cfg = preset(size, positions="learned", max_positions=image // patch, **trunk_overrides)
        if attention not in ("sdpa", "flex"):
            raise ValueError(f"attention must be 'sdpa' or 'flex', got {attention!r}")
        self.attention = attention  # "sdpa" (mask None), or "flex": the same full attention through a BlockMask
        self.block_mask = None
        self.embed = ImageTokenizer(patch_size=patch, channels=3).embedder(cfg.d_model)
        self.trunk = Trunk(cfg)
        self.register_buffer("positions", grid_positions(image // patch, image // patch)[None], persistent=False)
        self.head = ClassificationHead(cfg.d_model, n_classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.embed(patchify(images, self.patch))  # (B, n, d)
        mask = None
        if self.attention == "flex":
            if self.block_mask is None:
                from torch.nn.attention.flex_attention import create_block_mask

                n = x.shape[1]
                self.block_mask = create_block_mask(lambda b, h, q, k: q >= 0, None, None, n, n, device=x.device)
            mask = self.block_mask
        x = self.trunk(x, self.positions.expand(x.shape[0], -1, -1), mask=mask)
        return self.head(x)  # (B, n, d): each row one image


def build(name: str, omni_options: dict | None = None, toy: bool = False) -> nn.Module:
    if name == "omni":
        return OmniViT(**({**TOY, "image": TOY_IMAGE} if toy else {}), **(omni_options or {}))
    if name == "timm":
        import timm

        toy_args = dict(embed_dim=TOY["d_model"], depth=TOY["n_layers"], num_heads=TOY["n_heads"],
                        img_size=TOY_IMAGE) if toy else {}
        return timm.create_model("vit_base_patch16_224", num_classes=1000, **toy_args)
    if name == "torchvision":
        import torchvision

        if toy:
            return torchvision.models.VisionTransformer(TOY_IMAGE, 16, TOY["n_layers"], TOY["n_heads"], TOY["d_model"],
                                                        4 * TOY["d_model"], num_classes=1000)
        return torchvision.models.vit_b_16(num_classes=1000)
    raise ValueError(name)


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * 20 / (time.perf_counter() - t) / 1e12


def bench(name: str, mode: str, batch: int, steps: int, profile: int = 0, train_only: bool = False,
          omni_options: dict | None = None, device: str = "cuda", warmup: int = 3) -> tuple[float, float]:
    """(train, inference) images/s; inference is nan with train_only. profile > 0: after timing, print a
    kernel-time breakdown of the train step with that many top kernels. On a CPU (--dry-run): toy models, fp32."""
    torch.manual_seed(0)
    cuda = device == "cuda"
    model = build(name, omni_options, toy=not cuda).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    if mode == "eager":
        fwd = model
    elif mode == "compile":
        fwd = torch.compile(model)
    else:  # an inductor mode name, e.g. max-autotune-no-cudagraphs
        fwd = torch.compile(model, mode=mode)
    image = 224 if cuda else TOY_IMAGE
    x = torch.randn(batch, 3, image, image, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else nullcontext
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def train_step():
        with autocast():
            loss = F.cross_entropy(fwd(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def infer_step():
        with autocast():
            fwd(x)

    out = []
    for step in (train_step,) if train_only else (train_step, infer_step):
        for _ in range(warmup):
            step()
        sync()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t)
        out.append(batch / statistics.median(times))
    if profile:
        from _profile import kernel_breakdown

        report = kernel_breakdown(train_step, top=profile)
        print(f"\n#### {name} {mode}: where a training step's time goes\n\n{report}\n", flush=True)
    del model, opt, fwd
    if cuda:
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return out[0], (float("nan") if train_only else out[1])


def literal_assignments(text: str) -> dict:
    """"a=1,b.c='x'" -> {"a": 1, "b.c": "x"} (values are Python literals; the --inductor and --omni syntax)."""
    pairs = (item.split("=", 1) for item in filter(None, text.split(",")))
    return {name.strip(): ast.literal_eval(value.strip()) for name, value in pairs}


def set_inductor_option(name: str, value) -> None:
    """torch._inductor.config.<name> = value; an unknown name is an error, not a silent no-op."""
    import torch._inductor.config as config

    *path, leaf = name.split(".")
    target = config
    for part in path:
        target = getattr(target, part)
    if not hasattr(target, leaf):
        raise SystemExit(f"--inductor: torch._inductor.config has no option {name!r}")
    setattr(target, leaf, value)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--only", default="omni,timm,torchvision")
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--sdpa", default="default", help="default, or a priority list e.g. cudnn,flash,efficient")
    ap.add_argument("--profile", type=int, nargs="?", const=12, default=0, metavar="TOP",
                    help="after timing, a kernel-time breakdown of the train step with its TOP kernels (12)")
    ap.add_argument("--inductor", default="", help="torch._inductor.config settings for the compiled modes, e.g. "
                    "coordinate_descent_tuning=True,epilogue_fusion=True (Python literals; dotted names reach "
                    "sub-configs such as triton.cudagraphs)")
    ap.add_argument("--omni", default="", help="omni model variant, e.g. attention='flex' or bias=False (any "
                    "TrunkConfig field; Python literals)")
    ap.add_argument("--train-only", action="store_true", help="skip the inference timing")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    ap.add_argument("--out", type=Path, default=None, help="JSON file, rewritten after every row")
    ap.add_argument("--dry-run", action="store_true",
                    help="toy models on the CPU, fp32, 1 step (checks the script; measures nothing)")
    args = ap.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        args.batch, args.steps, args.warmup = 2, 1, 1
    elif not torch.cuda.is_available():
        ap.error("no CUDA device (--dry-run runs toy models on the CPU)")
    omni_options = literal_assignments(args.omni)
    for name, value in literal_assignments(args.inductor).items():
        set_inductor_option(name, value)
    if args.sdpa != "default":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
        sdpa_kernel([names[n] for n in args.sdpa.split(",")], set_priority=True).__enter__()
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = matmul_peak() if device == "cuda" else float("nan")
    hardware = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run: toy models)"
    print(f"{hardware}, torch {torch.__version__}, measured bf16 matmul peak {peak:.0f} TFLOP/s")
    print("| model | mode | train img/s | MFU | inference img/s |\n|---|---|---|---|---|")
    doc = {"device": hardware, "torch": torch.__version__, "batch": args.batch, "steps": args.steps,
           "peak_tflops": peak, "dry_run": args.dry_run, "rows": []}
    for name in args.only.split(","):
        for mode in args.modes.split(","):
            train, infer = bench(name, mode, args.batch, args.steps, args.profile, args.train_only, omni_options,
                                 device, args.warmup)
            mfu = train * 3 * VIT_B16_GFLOP_FWD * 1e9 / (peak * 1e12)
            extra = f", inductor {args.inductor}" if args.inductor and mode != "eager" else ""
            extra += f", {args.omni}" if args.omni and name == "omni" else ""
            infer_text = "-" if args.train_only else f"{infer:,.0f}"
            print(f"| {name} | {mode} (sdpa {args.sdpa}{extra}) | {train:,.0f} | {mfu:.1%} | {infer_text} |", flush=True)
            doc["rows"].append({"model": name, "mode": mode, "settings": f"sdpa {args.sdpa}{extra}",
                                "train_img_s": train, "mfu": mfu, "infer_img_s": infer})
            if args.out is not None:
                tmp = args.out.with_name(f".{args.out.name}.tmp-{os.getpid()}")
                tmp.write_text(json.dumps(doc, indent=2))
                os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
