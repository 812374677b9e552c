"""Long images (#26): a whole ViT's time and peak memory per image, windowed vs full attention, as the image grows
(224 / 512 / 1,024 px), on the CPU; and a short fine-tuning run at 1,024 px from a converted timm ViT.

    python benchmarks/long_images.py                     # the table (ViT-Ti/16: d192, 12 layers, 3 heads)
    python benchmarks/long_images.py --dry-run           # toy sizes (64 / 128 px, d32, 2 layers): seconds
    python benchmarks/long_images.py --sizes 1024 --variants full w7/4 --json out.json
    python benchmarks/long_images.py --finetune runs/long-images   # recipes/vit.py at 1,024 px from a timm ViT
    python benchmarks/long_images.py --one-layer --sizes 1024 2048 --variants full w7/4   # one attention layer

The model is a converted timm ViT's layout (omni.interop.timm: a CLS token, one learned position table over token
order, patch 16, RGB), built in omni with random weights. Variants (``--variants``):
  full        every layer attends to all 1 + (size / 16)^2 tokens (SDPA, the CPU's flash kernel)
  wR/K        a (2R + 1) x (2R + 1) window on the patch grid, the CLS token global, every K-th layer full
              (K = 0: no full layer): TrunkConfig.attention {"pattern": window2d(R, R) | global(1), "full_every": K};
              the windowed layers run omni's eager banded path over the pattern's BlockMask (built per forward,
              as in training)
Each (variant, size) runs in its own process: one warm-up, then --repeats measured calls of a batch of 1:
forward + backward of the classifier's loss (the training step without the optimizer: AdamW's update is the same
for every variant), and a forward under no_grad (inference); the median CPU time of the process (all its threads;
on a shared machine a steadier measure than wall time, which the JSON also records) is reported. Peak memory = the
process's peak RSS over the warm-up and measured forward + backward calls minus its RSS once the model and the
image are built (Linux /proc/self/clear_refs).

--finetune DIR writes a random-weight timm ViT (224 px, patch 16; a small width so a CPU run takes minutes: timm
is in the dev extra, nothing downloads), then runs recipes/vit.py on Fashion-MNIST upscaled to 1,024 px with a
window and prints the exact command; its time per step is in the recipe's progress lines and results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from _memory import reset_peak, rss_kb  # benchmarks/_memory.py: this script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = (224, 512, 1024)
VARIANTS = ("full", "w7/4", "w7/0", "w3/4")


def attention(variant: str) -> dict | None:
    """The TrunkConfig.attention of a variant name ("full", "wR/K")."""
    if variant == "full":
        return None
    m = re.fullmatch(r"w(\d+)/(\d+)", variant)
    if not m:
        raise ValueError(f"variant {variant!r}: 'full' or 'wR/K' (window radius R on the grid, every K-th layer full)")
    r, k = int(m.group(1)), int(m.group(2))
    window = {"kind": "any", "of": [{"kind": "window2d", "rows": r, "cols": r}, {"kind": "global", "first": 1}]}
    return {"pattern": window, "full_every": k}


def build(size: int, variant: str, d_model: int, layers: int, heads: int, patch: int):
    """A timm-layout ViT (CLS, learned_1d positions) at ``size`` px with the variant's attention."""
    from omni.tokenizers.image import ImageTokenizer
    from omni.trunk import TrunkConfig
    from omni.vision import ImageClassifier

    image = ImageTokenizer(patch, channels=3, image_size=size, cls=True, positions="sequence", alpha="drop")
    trunk = TrunkConfig(d_model=d_model, n_layers=layers, n_heads=heads, activation="gelu", norm_eps=1e-6,
                        positions="learned_1d", max_positions=(size // patch) ** 2 + 1, bias=True,
                        attention=attention(variant))
    return ImageClassifier(image, trunk, 1000, pool="cls", norm_eps=None)


def measure(variant: str, size: int, args: argparse.Namespace) -> dict:
    """One (variant, size) point in this process."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = build(size, variant, args.d_model, args.layers, args.heads, args.patch)
    x = torch.rand(1, 3, size, size)
    label = torch.tensor([3])

    def train_step() -> None:
        F.cross_entropy(model(x), label).backward()
        model.zero_grad(set_to_none=True)

    def infer() -> None:
        with torch.no_grad():
            model(x)

    base = rss_kb("VmRSS")  # the model and the image, before any activation
    reset_peak()  # the peak RSS (VmHWM) from here
    train_step()  # warm-up: first-call costs (kernel choice, allocator)
    cpu, wall = [], []
    for _ in range(args.repeats):
        c, w = time.process_time(), time.perf_counter()
        train_step()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    peak = (rss_kb("VmHWM") - base) / 1024  # the allocator keeps what the warm-up freed: peak over all calls
    infer()
    fcpu, fwall = [], []
    for _ in range(args.repeats):
        c, w = time.process_time(), time.perf_counter()
        infer()
        fcpu.append(time.process_time() - c)
        fwall.append(time.perf_counter() - w)
    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    return {"seconds": med(cpu), "forward_seconds": med(fcpu), "wall_seconds": med(wall),
            "forward_wall_seconds": med(fwall), "peak_mib": peak, "tokens": (size // args.patch) ** 2 + 1}


def layer_point(variant: str, size: int, args: argparse.Namespace) -> dict:
    """One attention call alone, (1, heads, T, d_model / heads) fp32 with the CLS + grid layout of ``size`` px:
    full = SDPA (the CPU's flash kernel), wR/K = the window's BlockMask (built inside the measured region, as the
    trunk does per forward) through the eager banded path; forward + backward, median CPU s; and the key blocks the
    BlockMask visits per 128-token query block."""
    import torch
    import torch.nn.functional as F

    from omni.attention_patterns import Layout, block_mask, schedule_from_config
    from omni.tokenizers.image import grid_positions
    from omni.trunk import attend, flex_mode

    g = size // args.patch
    T, D = g * g + 1, args.d_model // args.heads
    positions = torch.cat([torch.zeros(1, 2, dtype=torch.long), grid_positions(g, g)])[None]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, T, D, requires_grad=True) for _ in range(3))
    pattern = None if variant == "full" else schedule_from_config(attention(variant), 1).layers[0]
    visited = []

    def call() -> None:
        if pattern is None:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            mask = block_mask(Layout.single(positions, causal=False), pattern)
            visited.append(float((mask.kv_num_blocks + mask.full_kv_num_blocks).float().mean()))
            with flex_mode("eager"):
                out = attend(q, k, v, mask)
        out.square().mean().backward()
        q.grad = k.grad = v.grad = None

    call()
    cpu = []
    for _ in range(args.repeats):
        c = time.process_time()
        call()
        cpu.append(time.process_time() - c)
    blocks = visited[-1] if visited else float(-(-T // 128))
    return {"seconds": sorted(cpu)[len(cpu) // 2], "tokens": T, "key_blocks": blocks, "of_blocks": -(-T // 128)}


def point(args: argparse.Namespace, variant: str, size: int) -> dict:
    """One point in a fresh process, within the time limit."""
    cmd = [sys.executable, __file__, "--one", variant, str(size), "--d-model", str(args.d_model), "--layers",
           str(args.layers), "--heads", str(args.heads), "--patch", str(args.patch), "--repeats", str(args.repeats),
           *(["--one-layer"] if args.one_layer else [])]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit, check=False,
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    except subprocess.TimeoutExpired:
        return {"skipped": f"over {args.limit:.0f} s"}
    if done.returncode:
        return {"skipped": f"failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict, variants: list[str], sizes: list[int], patch: int = 16) -> str:
    rows = ["| attention | " + " | ".join(f"{s} px ({(s // patch) ** 2 + 1:,} tokens)" for s in sizes) + " |",
            "|---|" + "---|" * len(sizes)]
    for v in variants:
        cells = []
        for s in sizes:
            r, full = results[v].get(str(s), {}), results.get("full", {}).get(str(s), {})
            if "seconds" not in r:
                cells.append(r.get("skipped", ""))
                continue
            ratio = f" ({r['seconds'] / full['seconds']:.2f}x)" if v != "full" and "seconds" in full else ""
            cells.append(f"{r['seconds']:.3g} s{ratio} / {r['forward_seconds']:.3g} s / {r['peak_mib']:,.0f} MiB")
        rows.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# the fine-tuning run's peer: a 224-px ViT/16 in timm's layout (CLS token, one position table), narrow and shallow so a
# 1,024-px step costs seconds on a CPU; grey (in_chans 1): Fashion-MNIST's 1,024-px images are 1 MB each in memory
TIMM_PEER = dict(img_size=224, patch_size=16, embed_dim=64, depth=2, num_heads=2, num_classes=1000, in_chans=1)


def finetune(args: argparse.Namespace) -> None:
    """A random-weight timm ViT hub directory in DIR/timm, then recipes/vit.py from it at 1,024 px."""
    import timm
    import torch
    from timm.models import save_for_hf

    out = args.finetune
    hub = out / "timm"
    if not (hub / "config.json").is_file():
        torch.manual_seed(0)
        save_for_hf(timm.create_model("vit_tiny_patch16_224", pretrained=False, **TIMM_PEER), str(hub),
                    safe_serialization=True)
    schedule = attention(args.finetune_variant)
    cmd = [sys.executable, str(ROOT / "recipes" / "vit.py"), "--preset", "tiny", "--out", str(out / "run"),
           "--set", f"init={hub}", "image_size=1024", "resize=1024", "train_crop=center", "pad=0", "erase_prob=0.0",
           f"steps={args.finetune_steps}", "batch_size=8", "lr=2e-3", "warmup_epochs=0.1", "label_smoothing=0.0",
           "limit_train=256", "limit_eval=100", "eval_every_epochs=0", "workers=0",
           *( [f"trunk_overrides.attention={schedule!r}"] if schedule else [])]
    print("$ OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "") + " " + " ".join(
        a if re.fullmatch(r"[\w/.=,:-]+", a) else repr(a) for a in cmd), flush=True)
    start = time.time()
    done = subprocess.run(cmd, check=False)
    print(f"recipe exit {done.returncode} after {time.time() - start:.0f} s wall", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--patch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 2))
    ap.add_argument("--limit", type=float, default=600.0, help="seconds per point")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes (64 / 128 px, d32, 2 layers, 2 heads)")
    ap.add_argument("--finetune", type=Path, metavar="DIR", help="the 1,024-px fine-tuning run instead (module doc)")
    ap.add_argument("--finetune-steps", type=int, default=40)
    ap.add_argument("--finetune-variant", default="w7/2", help="layer 0 windowed, layer 1 full (the peer has 2)")
    ap.add_argument("--one-layer", action="store_true", help="one attention call instead of the model (layer_point)")
    ap.add_argument("--one", nargs=2, metavar=("VARIANT", "SIZE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    for v in args.variants + [args.finetune_variant]:
        try:
            attention(v)
        except ValueError as exc:
            ap.error(str(exc))
    if args.one:
        print(json.dumps((layer_point if args.one_layer else measure)(args.one[0], int(args.one[1]), args)))
        return
    if args.finetune:
        finetune(args)
        return
    if args.dry_run:
        args.sizes, args.d_model, args.layers, args.heads, args.repeats = [64, 128], 32, 2, 2, 1
        args.variants = ["full", "w1/2"]
    bad = [s for s in args.sizes if s % args.patch]
    if bad:
        ap.error(f"--sizes {bad[0]} is not a multiple of --patch {args.patch}")
    results: dict = {v: {} for v in args.variants}
    for s in args.sizes:
        for v in args.variants:
            results[v][str(s)] = point(args, v, s)
            print(f"{v:>6} {s:>5} px: {results[v][str(s)]}", flush=True)
    import torch
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.threads} thread(s), torch "
          f"{torch.__version__}, {time.strftime('%Y-%m-%d')}; ViT d{args.d_model} x {args.layers} layers, "
          f"{args.heads} heads, patch {args.patch}, CLS, batch 1, fp32; cell = forward + backward median CPU s (vs "
          f"full) / forward (no_grad) CPU s / peak MiB of activations (forward + backward)\n")
    if args.one_layer:
        print("one attention call, fwd + bwd, median CPU s (key blocks visited per query block of 128):")
        for v in args.variants:
            print(f"| {v} | " + " | ".join(
                f"{r['seconds']:.3g} s ({r['key_blocks']:.1f} of {r['of_blocks']})" if "seconds" in r
                else r.get("skipped", "") for r in (results[v][str(s)] for s in args.sizes)) + " |")
    else:
        print(table(results, args.variants, args.sizes, args.patch))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items() if k != "json"},
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
