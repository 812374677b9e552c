"""CUDA checks of the trunk's attention paths (run on a GPU machine; prints a Markdown report).

  python benchmarks/cuda_checks.py

1. Packed multimodal batch: FlexAttention BlockMask (compiled) == dense-mask SDPA, forward and
   gradients, fp32 and bf16; whole model under torch.compile with the BlockMask.
2. KV-cache decoding == full recomputation on CUDA (bf16 and fp32).
3. BlockMask build cost (compiled create_block_mask) for T = 35,840.
4. Attention time, packed Flex vs padded SDPA (+key mask), 64 documents of 64-1023 tokens.
"""

from __future__ import annotations

import random
import statistics
import time

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


def timed(fn, warmup=3, iters=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    dev = "cuda"
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| check | result |\n|---|---|")
    torch.manual_seed(0)
    cfg = TrunkConfig(d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, positions="rope2d")
    model = OmniModel({"vec": Vec(), "ids": Ids()}, cfg).to(dev)
    batch = Packer()(samples(24, 0)).to(dev)
    bm = batch.attention_mask("block")
    dm = batch.attention_mask("dense")
    for dtype in (torch.float32, torch.bfloat16):
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
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
        print(f"| packed model ({batch.shape[1]} tokens, {batch.num_documents} docs), {dtype}: Flex vs dense SDPA "
              f"| max abs out diff {out_err:.2e}, max rel grad diff {grad_err:.2e} |")
    compiled = torch.compile(model)
    with torch.no_grad():
        c = compiled(batch, bm)
        ref = model(batch, dm)
    print(f"| torch.compile(model) with BlockMask | max abs diff vs eager dense {(c - ref).abs().max().item():.2e} |")

    # KV cache on CUDA
    trunk = Trunk(TrunkConfig(d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, cross_attention=True)).to(dev).eval()
    x, mem = torch.randn(4, 40, 256, device=dev), torch.randn(4, 30, 256, device=dev)
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            full = trunk(x, mask="causal", memory=mem)
            cache = trunk.new_cache(4, 64, dtype=dtype)
            steps = torch.cat([trunk(x[:, t:t + 1], memory=mem, cache=cache) for t in range(40)], 1)
        print(f"| KV cache vs full recompute, {dtype} | max abs diff {(steps.float() - full.float()).abs().max().item():.2e} |")

    # BlockMask build cost and attention speed on the anchor's workload
    rng = random.Random(1)
    lengths = [rng.randint(64, 1023) for _ in range(64)]
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
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    build = timed(lambda: block_mask(doc, seg, causal), warmup=2, iters=10)
    print(f"| BlockMask build, T={T} | first call {first * 1e3:.0f} ms (compile), then {build * 1e3:.2f} ms |")
    H, D = 12, 64
    bm = block_mask(doc, seg, causal)
    q, k, v = (torch.randn(1, H, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def flex_step():
        attend(q, k, v, bm).sum().backward()

    Lmax = max(lengths)
    qp, kp, vp = (torch.randn(len(lengths), H, Lmax, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    keymask = (torch.arange(Lmax, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None])[:, None, None, :]

    def padded_step():
        attend(qp, kp, vp, keymask).sum().backward()

    tf, tp = timed(flex_step), timed(padded_step)
    print(f"| attention fwd+bwd, 64 docs {sum(lengths)} tokens, H12 D64 bf16 | packed Flex {tf * 1e3:.2f} ms, "
          f"padded SDPA + key mask {tp * 1e3:.2f} ms ({tp / tf:.2f}x), padding removed "
          f"{1 - sum(lengths) / (len(lengths) * Lmax):.0%} |")


if __name__ == "__main__":
    main()
