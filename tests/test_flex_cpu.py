"""The BlockMask path of every GPU run, on the CPU: ``torch.compile``'d FlexAttention (omni.trunk.flex_mode
"compiled") over packed multimodal batches (omni.packing's BlockMask) against the dense-mask SDPA reference,
fp32: forward and backward, the attention capture (omni.introspect.capture) under Flex, and training steps.

Eager flex_attention (the CPU default) evaluates mask_mod on every pair and ignores the block tables; the
compiled kernels skip unlisted blocks and trust full ones, as on the GPU, so a wrong block table shows up here.
Every test uses the same shapes (rows x ROW_LENGTH tokens, HEADS query / KV_HEADS key heads of HEAD_DIM), so the
module compiles Flex once (~20-45 s on 2 cores); ``test_one_compile`` checks that. Marker: ``flex_cpu``."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from torch._dynamo.utils import counters

from omni import trunk as trunk_module
from omni.heads import ClassificationHead, LMHead
from omni.introspect import capture
from omni.model import OmniModel
from omni.packing import BLOCK_SIZE, PackedBatch, Packer, dense_mask
from omni.segment import Role, Sample, Segment
from omni.tokenizers.base import Tokenizer, TypeEmbedding
from omni.trunk import TrunkConfig, flex_mode

ROWS, ROW_LENGTH = 2, 256  # two 128-token blocks per row: full, partial and skipped tiles all occur
D_MODEL, HEADS, KV_HEADS = 64, 4, 2  # head_dim 16 (the compiled kernels' minimum), GQA
TOL = dict(atol=1e-5, rtol=1e-5)

pytestmark = [pytest.mark.flex_cpu, pytest.mark.filterwarnings("ignore::UserWarning")]


class Vec(Tokenizer):
    """Continuous 6-d vectors on a 2-D grid, bidirectional (an image-like span)."""

    modality = "vec"

    def encode(self, raw, *, key=""):
        n = raw.shape[0]
        return Segment("vec", raw.float(), torch.stack([torch.arange(n) // 4, torch.arange(n) % 4], -1),
                       Role.BIDIRECTIONAL)

    def embedder(self, d_model):
        return nn.Sequential(nn.Linear(6, d_model), TypeEmbedding(d_model))


class Ids(Tokenizer):
    """Token ids, causal, next-token targets (a text span: after a vec span, a prefix-LM)."""

    modality = "ids"
    role = Role.CAUSAL

    def encode(self, raw, *, key=""):
        return Segment("ids", raw.long(), torch.arange(raw.shape[0]), Role.CAUSAL, targets=raw.roll(-1))

    def embedder(self, d_model):
        return nn.Sequential(nn.Embedding(50, d_model), TypeEmbedding(d_model))


def packed(seed: int) -> PackedBatch:
    """ROWS x ROW_LENGTH packed rows of 1-3 segment documents (vec/ids mixed; prefix-LM pairs among them), filled
    until the rows are nearly full: documents cross the 128-token block edges."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    samples: list[Sample] = []
    total = 0
    while True:
        segs = []
        for _ in range(rng.randint(1, 3)):
            n = rng.randint(5, 60)
            segs.append(Vec().encode(torch.randn(n, 6, generator=g)) if rng.random() < 0.5
                        else Ids().encode(torch.randint(0, 50, (n,), generator=g)))
        length = sum(len(s) for s in segs)
        if total + length > ROWS * ROW_LENGTH - 60:
            break
        samples.append(Sample(segs, key=f"{seed}/{len(samples)}"))
        total += length
    batch = Packer(row_length=ROW_LENGTH)(samples)
    assert batch.shape == (ROWS, ROW_LENGTH), batch.shape  # fixed shapes: one compile for the module
    return batch


def model(seed: int = 0) -> OmniModel:
    torch.manual_seed(seed)
    cfg = TrunkConfig(d_model=D_MODEL, n_layers=2, n_heads=HEADS, n_kv_heads=KV_HEADS, positions="rope2d")
    heads = {"cls": ClassificationHead(D_MODEL, 3), "lm": LMHead(D_MODEL, 50)}
    return OmniModel({"vec": Vec(), "ids": Ids()}, cfg, heads)


def loss_of(m: OmniModel, batch: PackedBatch, mask) -> torch.Tensor:
    """A per-segment classification loss on the vec spans + next-token loss on the ids spans."""
    hidden = m(batch, mask)
    logits = m.forward_head(hidden, batch, "cls", "vec")
    labels = torch.arange(logits.shape[0]) % 3
    lm = m.forward_head(hidden, batch, "lm", "ids")
    return F.cross_entropy(logits, labels) + F.cross_entropy(lm, batch.targets["ids"])


@pytest.fixture(scope="module")
def compiled():
    """Compiled Flex on the CPU for the whole module (one compile: shapes are fixed); yields the number of
    graphs dynamo had compiled before the module."""
    before = counters["stats"]["unique_graphs"]
    with flex_mode("compiled"):
        yield before


def test_packed_forward_and_backward_equal_dense_sdpa(compiled):
    """The packed model through compiled Flex == through SDPA with the dense mask: hidden states and every
    parameter's gradient (fp32, 1e-5)."""
    batch = packed(1)
    block, dense = batch.attention_mask("block"), batch.attention_mask("dense")
    grads = []
    for mask in (block, dense):
        m = model()
        m.zero_grad()
        hidden = m(batch, mask)
        (hidden.square().mean() + loss_of(m, batch, mask)).backward()
        grads.append((hidden.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (h_flex, g_flex), (h_dense, g_dense) = grads
    torch.testing.assert_close(h_flex, h_dense, **TOL)
    assert g_flex.keys() == g_dense.keys() and len(g_flex) > 20
    for name in g_flex:
        torch.testing.assert_close(g_flex[name], g_dense[name], **TOL, msg=name)
    assert trunk_module._FLEX is not None  # the compiled function ran, not the eager reference


def test_wrong_block_table_is_seen(compiled):
    """The compiled kernels read the block tables (eager Flex does not): the same BlockMask with its partial
    tiles listed as full (mask_mod then skipped there) gives other numbers, so the tests above check the tables."""
    batch = packed(1)
    good = batch.attention_mask("block")
    bad = BlockMask.from_kv_blocks(torch.zeros_like(good.kv_num_blocks), good.kv_indices,
                                   good.full_kv_num_blocks + good.kv_num_blocks, merged_indices(good),
                                   BLOCK_SIZE=BLOCK_SIZE, mask_mod=good.mask_mod, seq_lengths=good.seq_lengths)
    m = model().eval()
    with torch.no_grad():
        right, wrong = m(batch, good), m(batch, bad)
        torch.testing.assert_close(right, m(batch, batch.attention_mask("dense")), **TOL)
    assert (right - wrong).abs().max() > 1e-2


def merged_indices(mask):
    """Per query block: the full blocks' indices followed by the partial ones (all now 'full')."""
    full, part = mask.full_kv_indices, mask.kv_indices
    n_full, n_part = mask.full_kv_num_blocks, mask.kv_num_blocks
    out = torch.zeros_like(full)
    B, H, nq, nk = full.shape
    for b in range(B):
        for h in range(H):
            for q in range(nq):
                f, p = int(n_full[b, h, q]), int(n_part[b, h, q])
                out[b, h, q, :f + p] = torch.cat([full[b, h, q, :f], part[b, h, q, :p]])
    return out


def test_capture_under_flex(compiled):
    """omni.introspect.capture with the BlockMask: the recorded layers' reference attention gives the compiled
    Flex output (all layers recorded, and one recorded while the other runs Flex), probabilities are 0 outside
    the packing rule and each real query's row sums to 1."""
    batch = packed(2)
    block = batch.attention_mask("block")
    m = model().eval()
    allowed = dense_mask(batch.document, batch.segment, batch.causal)  # (B, 1, T, T)
    with torch.no_grad():
        fast = m(batch, block)
        with capture(m) as rec:
            recorded = m(batch, block)
        with capture(m, layers=["trunk.blocks.1.attn"]) as one:
            mixed = m(batch, block)  # block 0 through compiled Flex, block 1 recorded
    torch.testing.assert_close(recorded, fast, **TOL)
    torch.testing.assert_close(mixed, fast, **TOL)
    assert list(one.attention) == ["trunk.blocks.1.attn"]
    torch.testing.assert_close(one.attention["trunk.blocks.1.attn"], rec.attention["trunk.blocks.1.attn"], **TOL)
    real = (batch.document >= 0)[:, None, :]  # (B, 1, T) real queries
    for name in ("trunk.blocks.0.attn", "trunk.blocks.1.attn"):
        probs = rec.attention[name]
        assert probs.shape == (ROWS, HEADS, ROW_LENGTH, ROW_LENGTH)
        assert probs.masked_select(~allowed).abs().max() == 0
        sums = probs.sum(-1)
        torch.testing.assert_close(sums[real.expand_as(sums)], torch.ones(int(real.sum()) * HEADS), **TOL)


def test_training_steps_equal_dense(compiled):
    """Four AdamW steps on four packed batches: the losses and final weights of the compiled-Flex run equal the
    dense-mask SDPA run's."""
    batches = [packed(10 + i) for i in range(4)]
    runs = []
    for kind in ("block", "dense"):
        m = model(seed=3)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        losses = []
        for batch in batches:
            loss = loss_of(m, batch, batch.attention_mask(kind))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        runs.append((losses, m))
    (l_flex, m_flex), (l_dense, m_dense) = runs
    assert l_flex == pytest.approx(l_dense, rel=1e-5, abs=1e-6)
    assert l_flex[-1] < l_flex[0]  # it trains
    worst = max((a - b).abs().max().item() for a, b in zip(m_flex.parameters(), m_dense.parameters()))
    assert worst < 1e-5


def test_one_compile(compiled):
    """Every test above ran the same compiled Flex graph: the module compiled once (when it runs whole)."""
    assert counters["stats"]["unique_graphs"] - compiled <= 1
