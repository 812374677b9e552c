"""CUDA checks of the trunk's attention paths (run on a GPU machine; prints a Markdown report).

  python benchmarks/cuda_checks.py [--out checks.json]
  python benchmarks/cuda_checks.py --dry-run --out checks.json    # toy sizes on the CPU (benchmarks/gpu_check.sh)

1. Packed multimodal batch: FlexAttention BlockMask (compiled) == dense-mask SDPA, forward and
   gradients, fp32 and bf16; whole model under torch.compile with the BlockMask.
2. KV-cache decoding == full recomputation on CUDA (bf16 and fp32).
3. BlockMask build cost (compiled create_block_mask) for T = 35,840.
4. Attention time, packed Flex vs padded SDPA (+key mask), 64 documents of 64-1023 tokens.

--out FILE.json: every check as {"check", "result", "goal", "ok", values...}, rewritten after each check.
--dry-run: the same code at toy sizes on the CPU (eager Flex; its gradients come from the dense form of the
BlockMask, omni.trunk): it proves the script runs, it measures nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omni.model import OmniModel
from omni.packing import Packer, block_mask
from omni.segment import Role, Sample, Segment
from omni.tokenizers.base import Tokenizer, TypeEmbedding
from omni.trunk import Trunk, TrunkConfig, attend


class Vec(Tokenizer):
    modality = "vec"

    def encode(self, raw, *, key=""):
        n = raw.shape[0]
        return Segment("vec", raw, torch.stack([torch.arange(n) // 8, torch.arange(n) % 8], -1), Role.BIDIRECTIONAL)

    def embedder(self, d):
        return nn.Sequential(nn.Linear(16, d), TypeEmbedding(d))


class Ids(Tokenizer):
    modality = "ids"
    role = Role.CAUSAL

    def encode(self, raw, *, key=""):
        return Segment("ids", raw, torch.arange(raw.shape[0]), Role.CAUSAL)

    def embedder(self, d):
        return nn.Sequential(nn.Embedding(1000, d), TypeEmbedding(d))


def samples(n, seed, lo=16, hi=600):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        segs = []
        for _ in range(rng.randint(1, 3)):
            L = rng.randint(lo, hi)
            segs.append(Vec().encode(torch.randn(L, 16)) if rng.random() < 0.5 else Ids().encode(torch.randint(0, 1000, (L,))))
        out.append(Sample(segs, key=str(i)))
    return out


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev="cuda", warmup=3, iters=20):
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class Report:
    """Markdown rows on stdout, and the same rows in a JSON file rewritten after each one."""

    def __init__(self, out: Path | None, meta: dict[str, Any]) -> None:
        self.out, self.doc = out, {"meta": meta, "rows": []}

    def row(self, check: str, result: str, goal: str = "-", ok: bool | None = None, **values: Any) -> None:
        print(f"| {check} | {result} |", flush=True)
        self.doc["rows"].append({"check": check, "result": result, "goal": goal, "ok": ok, **values})
        if self.out is not None:
            tmp = self.out.with_name(f".{self.out.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(self.doc, indent=2))
            os.replace(tmp, self.out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON file, rewritten after every check")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU: checks the script, measures nothing")
    args = ap.parse_args(argv)
    dev = "cpu" if args.dry_run else "cuda"
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # CPU: eager on purpose
    if dev == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: these are GPU checks (--dry-run runs them at toy sizes on the CPU)")
    # sizes: (samples, longest segment, documents in the timing, their longest, the timing's heads)
    n_samples, hi, n_docs, doc_hi, H = (4, 90, 6, 200, 2) if args.dry_run else (24, 600, 64, 1023, 12)
    dtypes = (torch.float32,) if args.dry_run else (torch.float32, torch.bfloat16)
    device_name = torch.cuda.get_device_name() if dev == "cuda" else "CPU (dry run)"
    print(f"device: {device_name}, torch {torch.__version__}\n")
    print("| check | result |\n|---|---|")
    report = Report(args.out, {"device": device_name, "torch": torch.__version__, "dry_run": args.dry_run})
    torch.manual_seed(0)
    cfg = TrunkConfig(d_model=256 if dev == "cuda" else 32, n_layers=4 if dev == "cuda" else 2, n_heads=8 if dev == "cuda" else 4,
                      n_kv_heads=2, positions="rope2d")
    model = OmniModel({"vec": Vec(), "ids": Ids()}, cfg).to(dev)
    batch = Packer()(samples(n_samples, 0, hi=hi)).to(dev)
    bm = batch.attention_mask("block")
    dm = batch.attention_mask("dense")
    for dtype in dtypes:
        with torch.autocast(dev, dtype=dtype, enabled=dtype != torch.float32):
            model.zero_grad()
            a = model(batch, bm)
            a.float().square().mean().backward()
            ga = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            b = model(batch, dm)
            b.float().square().mean().backward()
            gb = [p.grad.clone() for p in model.parameters()]
        out_err = (a.float() - b.float()).abs().max().item()
        grad_err = max(((x - y).abs().max() / (y.abs().max() + 1e-12)).item() for x, y in zip(ga, gb))
        bound = 1e-5 if dtype == torch.float32 else 5e-2
        report.row(f"packed model ({batch.shape[1]} tokens, {batch.num_documents} docs), {dtype}: Flex vs dense SDPA",
                   f"max abs out diff {out_err:.2e}, max rel grad diff {grad_err:.2e}", f"out diff <= {bound:g}",
                   out_err <= bound, out_diff=out_err, grad_rel_diff=grad_err)
    if not args.dry_run:  # compiling the whole model takes minutes on a CPU
        compiled = torch.compile(model)
        with torch.no_grad():
            c = compiled(batch, bm)
            ref = model(batch, dm)
        err = (c - ref).abs().max().item()
        report.row("torch.compile(model) with BlockMask", f"max abs diff vs eager dense {err:.2e}", "<= 1e-4",
                   err <= 1e-4, diff=err)

    # KV cache
    trunk = Trunk(TrunkConfig(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=2,
                              cross_attention=True)).to(dev).eval()
    x, mem = torch.randn(4, 40, cfg.d_model, device=dev), torch.randn(4, 30, cfg.d_model, device=dev)
    for dtype in dtypes:
        with torch.no_grad(), torch.autocast(dev, dtype=dtype, enabled=dtype != torch.float32):
            full = trunk(x, mask="causal", memory=mem)
            cache = trunk.new_cache(4, 64, dtype=dtype)
            steps = torch.cat([trunk(x[:, t:t + 1], memory=mem, cache=cache) for t in range(40)], 1)
        err = (steps.float() - full.float()).abs().max().item()
        bound = 1e-4 if dtype == torch.float32 else 1e-1
        report.row(f"KV cache vs full recompute, {dtype}", f"max abs diff {err:.2e}", f"<= {bound:g}", err <= bound,
                   diff=err)

    # BlockMask build cost and attention speed on the anchor's workload
    rng = random.Random(1)
    lengths = [rng.randint(64, doc_hi) for _ in range(n_docs)]
    T = 128 * -(-sum(lengths) // 128)
    doc = torch.full((1, T), -1, dtype=torch.long)
    pos = 0
    for i, L in enumerate(lengths):
        doc[0, pos:pos + L] = i
        pos += L
    doc = doc.to(dev)
    seg, causal = doc.clone(), doc % 2 == 1  # odd documents causal, even bidirectional
    t0 = time.perf_counter()
    block_mask(doc, seg, causal)
    sync(dev)
    first = time.perf_counter() - t0
    build = timed(lambda: block_mask(doc, seg, causal), dev, warmup=2, iters=10 if dev == "cuda" else 2)
    report.row(f"BlockMask build, T={T}", f"first call {first * 1e3:.0f} ms (compile), then {build * 1e3:.2f} ms",
               first_ms=first * 1e3, build_ms=build * 1e3)
    D = 64 if dev == "cuda" else 16
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    bm = block_mask(doc, seg, causal)
    q, k, v = (torch.randn(1, H, T, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))

    def flex_step():
        attend(q, k, v, bm).sum().backward()

    Lmax = max(lengths)
    qp, kp, vp = (torch.randn(len(lengths), H, Lmax, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    keymask = (torch.arange(Lmax, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None])[:, None, None, :]

    def padded_step():
        attend(qp, kp, vp, keymask).sum().backward()

    iters = dict(warmup=3, iters=20) if dev == "cuda" else dict(warmup=1, iters=1)
    tf, tp = timed(flex_step, dev, **iters), timed(padded_step, dev, **iters)
    report.row(f"attention fwd+bwd, {len(lengths)} docs {sum(lengths)} tokens, H{H} D{D} {str(dtype)[6:]}",
               f"packed Flex {tf * 1e3:.2f} ms, padded SDPA + key mask {tp * 1e3:.2f} ms ({tp / tf:.2f}x), padding "
               f"removed {1 - sum(lengths) / (len(lengths) * Lmax):.0%}", flex_ms=tf * 1e3, padded_ms=tp * 1e3,
               speedup=tp / tf)


if __name__ == "__main__":
    main()
