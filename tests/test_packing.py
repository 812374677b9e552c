"""Packing and masks: the dense mask against a per-token reference, the FlexAttention BlockMask against
the dense mask, and the packed forward of several documents against each document run alone."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask

from omni.heads import ClassificationHead, packed_segments
from omni.model import OmniModel
from omni.packing import BLOCK_SIZE, Packer, block_mask, dense_mask, mask_mod, segment_mean
from omni.segment import Role, Sample, Segment
from omni.tokenizers.base import Tokenizer, TypeEmbedding
from omni.trunk import TrunkConfig


class VecTokenizer(Tokenizer):
    """Test modality: continuous 6-d vectors, bidirectional, with 2-D positions."""

    modality = "vec"

    def encode(self, raw, *, key=""):
        n = raw.shape[0]
        return Segment("vec", raw.float(), torch.stack([torch.arange(n) // 3, torch.arange(n) % 3], -1), Role.BIDIRECTIONAL)

    def embedder(self, d_model):
        return nn.Sequential(nn.Linear(6, d_model), TypeEmbedding(d_model))


class IdsTokenizer(Tokenizer):
    """Test modality: token ids, causal."""

    modality = "ids"
    role = Role.CAUSAL

    def encode(self, raw, *, key=""):
        return Segment("ids", raw.long(), torch.arange(raw.shape[0]), Role.CAUSAL, targets=raw.roll(-1))

    def embedder(self, d_model):
        return nn.Sequential(nn.Embedding(50, d_model), TypeEmbedding(d_model))


def random_samples(n, seed=0, max_len=40):
    rng = random.Random(seed)
    vec, ids = VecTokenizer(), IdsTokenizer()
    samples = []
    for i in range(n):
        segs = []
        for _ in range(rng.randint(1, 3)):
            length = rng.randint(1, max_len)
            if rng.random() < 0.5:
                segs.append(vec.encode(torch.randn(length, 6)))
            else:
                segs.append(ids.encode(torch.randint(0, 50, (length,))))
        samples.append(Sample(segs, key=f"s{i}", label=i % 3))
    return samples


def reference_allowed(batch):
    """Per-token python loop over the packing rule."""
    B, T = batch.shape
    out = torch.zeros(B, 1, T, T, dtype=torch.bool)
    doc, seg, causal = batch.document.tolist(), batch.segment.tolist(), batch.causal.tolist()
    for b in range(B):
        for q in range(T):
            for k in range(T):
                if doc[b][q] != doc[b][k]:
                    continue
                if seg[b][k] < seg[b][q]:
                    out[b, 0, q, k] = True
                elif seg[b][k] == seg[b][q]:
                    out[b, 0, q, k] = (not causal[b][q]) or k <= q
    return out


def test_dense_mask_matches_reference_rule():
    batch = Packer()(random_samples(5, seed=1, max_len=12))
    assert torch.equal(dense_mask(batch.document, batch.segment, batch.causal), reference_allowed(batch))


def test_rule_examples():
    """Spot checks: image span bidirectional, text after it sees the whole image (prefix-LM) and
    is causal itself, the image never sees the text, and documents never see each other."""
    vec, ids = VecTokenizer(), IdsTokenizer()
    a = Sample([vec.encode(torch.randn(3, 6)), ids.encode(torch.arange(2))], key="a")
    b = Sample([ids.encode(torch.arange(2))], key="b")
    m = Packer()([a, b]).attention_mask("dense")[0, 0]
    assert m[0, 2] and m[2, 0]  # image bidirectional
    assert m[3, 0] and m[3, 2] and m[4, 3] and not m[3, 4]  # text sees image, causal inside
    assert not m[0, 3]  # image does not see later text
    assert not m[5, 0] and not m[0, 5] and m[6, 5] and not m[5, 6]  # doc b: separate and causal


def test_padding_only_to_the_final_block():
    samples = random_samples(9, seed=2)
    total = sum(len(s) for s in samples)
    batch = Packer()(samples)
    assert batch.shape == (1, BLOCK_SIZE * math.ceil(total / BLOCK_SIZE))
    assert batch.num_tokens == total and batch.num_documents == 9
    assert (batch.document[0, total:] == -1).all() and (batch.document[0, :total] >= 0).all()


def test_rows_first_fit_and_overlong_error():
    samples = random_samples(20, seed=3, max_len=60)
    packer = Packer(row_length=256)
    batch = packer(samples)
    B, T = batch.shape
    assert T == 256
    per_row = [(batch.document[r] >= 0).sum().item() for r in range(B)]
    assert sum(per_row) == sum(len(s) for s in samples) and max(per_row) <= 256
    assert B == len(packer.rows_for(samples)) <= math.ceil(sum(per_row) / 256) + 1
    long = Sample([IdsTokenizer().encode(torch.zeros(300))], key="too-long-sample")
    with pytest.raises(ValueError, match="too-long-sample"):
        packer([long])
    with pytest.raises(ValueError, match="multiple of block_size"):
        Packer(row_length=100)


def test_positions_offset_per_document_and_tokens_grouped():
    vec, ids = VecTokenizer(), IdsTokenizer()
    s = Sample([vec.encode(torch.randn(7, 6)), ids.encode(torch.tensor([4, 5, 6]))], key="x")
    batch = Packer()([s, s])
    # vec positions (row, col) for 7 tokens: rows 0..2, cols 0..2; max = 2 -> text starts at 3
    assert batch.positions[0, 7:10].tolist() == [[3, 3], [4, 4], [5, 5]]
    assert batch.positions[0, 10:12].tolist() == [[0, 0], [0, 1]]  # second document restarts
    assert batch.tokens["vec"].shape == (14, 6) and batch.tokens["ids"].tolist() == [4, 5, 6, 4, 5, 6]
    assert batch.index["ids"].tolist() == [7, 8, 9, 17, 18, 19]
    assert batch.targets["ids"].tolist() == [5, 6, 4, 5, 6, 4]
    assert batch.segment_of["vec"].tolist() == [0] * 7 + [1] * 7
    assert batch.segment_document["vec"].tolist() == [0, 1]


def test_inconsistent_feature_shapes_name_the_sample():
    vec = VecTokenizer()
    bad = Sample([Segment("vec", torch.randn(3, 5), torch.arange(3))], key="odd-one")
    with pytest.raises(ValueError, match="odd-one"):
        Packer()([Sample([vec.encode(torch.randn(2, 6))], key="ok"), bad])


def make_model(positions="rope2d"):
    torch.manual_seed(0)
    cfg = TrunkConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, positions=positions)
    return OmniModel({"vec": VecTokenizer(), "ids": IdsTokenizer()}, cfg).eval()


@pytest.mark.parametrize("positions", ["rope2d", "learned"])
@pytest.mark.parametrize("row_length", [None, 128])
def test_packed_forward_equals_each_document_alone(positions, row_length):
    model = make_model(positions)
    samples = random_samples(7, seed=4)
    packer = Packer(row_length=row_length)
    batch = packer(samples)
    with torch.no_grad():
        dense_out = model(batch, batch.attention_mask("dense"))
        flex_out = model(batch, batch.attention_mask("block"))
        torch.testing.assert_close(flex_out, dense_out, atol=1e-5, rtol=1e-5)
        flat = dense_out.reshape(-1, 32)
        for doc, key in enumerate(batch.keys):
            sample = next(s for s in samples if s.key == key)
            alone = Packer()([sample])
            out = model(alone).reshape(-1, 32)[: len(sample)]
            where = (batch.document.reshape(-1) == doc).nonzero().squeeze(1)
            torch.testing.assert_close(flat[where], out, atol=1e-5, rtol=1e-5)


def test_block_mask_matches_dense_mask_blockwise():
    batch = Packer()(random_samples(12, seed=5))
    bm = block_mask(batch.document, batch.segment, batch.causal)
    dense = dense_mask(batch.document, batch.segment, batch.causal)[0, 0]
    T = batch.shape[1]
    nb = T // BLOCK_SIZE
    # a block is skipped by Flex only if the dense mask has no True inside it
    blocks = bm.to_dense()[0, 0].bool()  # (nb, nb)
    any_true = dense.view(nb, BLOCK_SIZE, nb, BLOCK_SIZE).any(dim=(1, 3))
    assert torch.equal(blocks, any_true)


def test_classification_head_pools_each_segment():
    model = make_model()
    head = ClassificationHead(32, 3)
    nn.init.normal_(head.proj.weight)
    samples = random_samples(6, seed=6)
    batch = Packer()(samples)
    hidden = torch.randn(*batch.shape, 32)
    logits = head(*packed_segments(hidden, batch, "vec"))
    flat = hidden.reshape(-1, 32)
    vec_tokens = flat[batch.index["vec"]]
    for s in range(logits.shape[0]):
        mean = vec_tokens[batch.segment_of["vec"] == s].mean(0)
        torch.testing.assert_close(logits[s], head.proj(head.norm(mean)), atol=1e-5, rtol=1e-5)
    assert segment_mean(torch.ones(4, 2), torch.tensor([0, 0, 2, 2]), 3).tolist() == [[1, 1], [0, 0], [1, 1]]
    cls = ClassificationHead(32, 3, pool="cls")
    assert cls(*packed_segments(hidden, batch, "vec")).shape == logits.shape
    del model


def test_unknown_modality_in_batch():
    model = OmniModel({"vec": VecTokenizer()}, TrunkConfig(d_model=32, n_layers=1, n_heads=4))
    batch = Packer()([Sample([IdsTokenizer().encode(torch.arange(3))], key="k")])
    with pytest.raises(KeyError, match="no embedder"):
        model(batch)


def test_segment_validation():
    with pytest.raises(ValueError, match="empty"):
        Segment("x", torch.zeros(0, 3), torch.zeros(0))
    with pytest.raises(ValueError, match="NaN"):
        Segment("x", torch.tensor([[float("nan")]]), torch.zeros(1))
    with pytest.raises(ValueError, match="positions"):
        Segment("x", torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="no segments"):
        Sample([], key="k")


def _block_sets(bm):
    """(partial, full) as dense (B, nb, nb) bool matrices from a BlockMask's index lists."""
    def dense(num, idx):
        B, _, nb = num.shape
        out = torch.zeros(B, nb, nb, dtype=torch.bool)
        for b in range(B):
            for q in range(nb):
                out[b, q, idx[b, 0, q, : num[b, 0, q]].long()] = True
        return out

    return dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices)


@pytest.mark.parametrize("seed,row_length,max_len,block", [(7, None, 40, 128), (8, 256, 60, 128),
                                                           (9, None, 400, 128), (10, None, 30, 16)])
def test_block_mask_equals_create_block_mask(seed, row_length, max_len, block):
    """The summary-based BlockMask marks exactly the tiles create_block_mask marks, partial and full."""
    batch = Packer(row_length=row_length, block_size=block)(random_samples(15, seed=seed, max_len=max_len))
    ours = block_mask(batch.document, batch.segment, batch.causal, block_size=block)
    B, T = batch.shape
    reference = create_block_mask(mask_mod(batch.document, batch.segment, batch.causal), B, None, T, T,
                                  device="cpu", BLOCK_SIZE=block)
    for mine, theirs in zip(_block_sets(ours), _block_sets(reference)):
        assert torch.equal(mine, theirs)
    assert ours.seq_lengths == (T, T)


def test_packed_dicts_in_modality_name_order():
    """torch.compile guards on dict key order: the per-modality dicts must not follow sample order."""
    vec, ids = VecTokenizer(), IdsTokenizer()
    a = Sample([ids.encode(torch.arange(5))], key="a")
    b = Sample([vec.encode(torch.randn(4, 6))], key="b")
    for samples in ([a, b], [b, a]):
        batch = Packer(row_length=128)(samples)
        for d in (batch.tokens, batch.index, batch.segment_of, batch.segment_document):
            assert list(d) == ["ids", "vec"]


def test_segment_mean_counts_with_empty_segments():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [10.0, 0.0]])
    out = segment_mean(values, torch.tensor([0, 0, 2]), 4)
    assert torch.equal(out, torch.tensor([[2.0, 3.0], [0.0, 0.0], [10.0, 0.0], [0.0, 0.0]]))
